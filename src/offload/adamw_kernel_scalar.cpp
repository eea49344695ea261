// Scalar AdamW kernel and the exact fp16/bf16 conversions. Compiled for baseline
// x86-64 (no per-file ISA flags): this path must run on any x86-64 machine. Like the vector kernels
// it includes no LibTorch header (see adamw_kernels.h).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "offload/adamw_kernels.h"

namespace megaslide::offload::detail {
namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <GradType G>
float load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradType::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == GradType::kBFloat16) {
    return bf16_bits_to_float(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return fp16_bits_to_float(static_cast<const uint16_t*>(grad)[i]);
  }
}

template <ComputeType C>
void store_compute(void* compute, int64_t i, float w) {
  if constexpr (C == ComputeType::kBFloat16) {
    static_cast<uint16_t*>(compute)[i] = float_to_bf16_bits(w);
  } else if constexpr (C == ComputeType::kFloat16) {
    static_cast<uint16_t*>(compute)[i] = float_to_fp16_bits(w);
  }
}

// The moments of element i as fp32, from a kFloat32 or kBFloat16 state.
template <StateType S>
float load_state(const void* state, int64_t i) {
  if constexpr (S == StateType::kFloat32) {
    return static_cast<const float*>(state)[i];
  } else {
    return bf16_bits_to_float(static_cast<const uint16_t*>(state)[i]);
  }
}

template <StateType S>
void store_state(void* state, int64_t i, float x) {
  if constexpr (S == StateType::kFloat32) {
    static_cast<float*>(state)[i] = x;
  } else {
    static_cast<uint16_t*>(state)[i] = float_to_bf16_bits(x);
  }
}

struct Moments {
  float m, v, u;  // u = sqrt(v)
};

// One element of the contract in adamw_kernels.h, from its old moments; writes master and the copy.
template <GradType G, ComputeType C>
Moments adamw_element(const AdamWKernelParams& p, int64_t i, float m_old, float v_old) {
  // The operation order (and the one fma) is the contract of adamw_kernels.h; the vector kernels
  // perform the same IEEE operations lane by lane, so all paths agree bit for bit.
  const float g = load_grad<G>(p.grad, i) * p.grad_scale;
  float w = p.master[i] * p.decay;
  const float m = std::fma(g, p.one_minus_beta1, m_old * p.beta1);
  const float v = std::fma(p.one_minus_beta2 * g, g, v_old * p.beta2);
  const float u = std::sqrt(v);
  const float d = u / p.sqrt_bias_correction2 + p.eps;
  w = w + (p.neg_step_size * m) / d;
  p.master[i] = w;
  store_compute<C>(p.compute, i, w);
  return {m, v, u};
}

// Quantises x * inv to the nearest integer (ties to even) clamped to [lo, hi].
int32_t quantise(float x, float inv, float lo, float hi) {
  return static_cast<int32_t>(std::nearbyint(std::fmin(std::fmax(x * inv, lo), hi)));
}

template <GradType G, ComputeType C>
void adamw_int8_group(const AdamWKernelParams& p, int64_t begin, int64_t n) {
  const int64_t q = begin / kQuantGroup;
  auto* m_codes = static_cast<int8_t*>(p.exp_avg) + begin;
  auto* u_codes = static_cast<uint8_t*>(p.exp_avg_sq) + begin;
  const float m_scale = p.exp_avg_scale[q], u_scale = p.exp_avg_sq_scale[q];
  float m_new[kQuantGroup], u_new[kQuantGroup];
  float m_max = 0.f, u_max = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float u_old = static_cast<float>(u_codes[j]) * u_scale;
    const Moments r = adamw_element<G, C>(p, begin + j, static_cast<float>(m_codes[j]) * m_scale, u_old * u_old);
    m_new[j] = r.m;
    u_new[j] = r.u;
    m_max = std::fmax(m_max, std::fabs(r.m));
    u_max = std::fmax(u_max, r.u);
  }
  const float m_inv = m_max > 0.f ? 127.f / m_max : 0.f;
  const float u_inv = u_max > 0.f ? 255.f / u_max : 0.f;
  for (int64_t j = 0; j < n; ++j) {
    m_codes[j] = static_cast<int8_t>(quantise(m_new[j], m_inv, -127.f, 127.f));
    const int32_t code = quantise(u_new[j], u_inv, 0.f, 255.f);
    u_codes[j] = static_cast<uint8_t>(code == 0 && u_new[j] > 0.f ? 1 : code);
  }
  p.exp_avg_scale[q] = m_max / 127.f;
  p.exp_avg_sq_scale[q] = u_max / 255.f;
}

template <GradType G, ComputeType C, StateType S>
void adamw_scalar_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  if constexpr (S == StateType::kInt8) {
    for (int64_t i = begin; i < end; i += kQuantGroup) adamw_int8_group<G, C>(p, i, std::min(kQuantGroup, end - i));
  } else {
    for (int64_t i = begin; i < end; ++i) {
      const Moments r = adamw_element<G, C>(p, i, load_state<S>(p.exp_avg, i), load_state<S>(p.exp_avg_sq, i));
      store_state<S>(p.exp_avg, i, r.m);
      store_state<S>(p.exp_avg_sq, i, r.v);
    }
  }
}

// x + d for a narrow state element, through fp32 (exact when d = 0).
template <StateType S>
void probe_state(void* state, float* scales, int64_t i, float d) {
  if constexpr (S == StateType::kFloat32) {
    static_cast<float*>(state)[i] += d;
  } else if constexpr (S == StateType::kBFloat16) {
    auto* x = static_cast<uint16_t*>(state) + i;
    *x = static_cast<uint16_t>(float_bits(bf16_bits_to_float(*x) + d) >> 16);
  } else {
    auto* x = static_cast<int8_t*>(state) + i;
    *x = static_cast<int8_t>(static_cast<int32_t>(static_cast<float>(*x) + d));
    if (i % kQuantGroup == 0) scales[i / kQuantGroup] += d;
  }
}

template <GradType G, ComputeType C, StateType S>
void stream_probe_scalar_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = load_grad<G>(p.grad, i) * p.grad_scale;
    const float w = p.master[i] + g;
    p.master[i] = w;
    probe_state<S>(p.exp_avg, p.exp_avg_scale, i, g);
    probe_state<S>(p.exp_avg_sq, p.exp_avg_sq_scale, i, g);
    static_cast<uint16_t*>(p.compute)[i] = static_cast<uint16_t>(float_bits(w) >> 16);
  }
}

}  // namespace

// Same arithmetic as c10::detail::round_to_nearest_even.
uint16_t float_to_bf16_bits(float f) {
  if (std::isnan(f)) return UINT16_C(0x7FC0);
  const uint32_t u = float_bits(f);
  const uint32_t rounding_bias = ((u >> 16) & 1) + UINT32_C(0x7FFF);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// The FP16 library's fp16_ieee_from_fp32_value (what c10::Half uses when F16C is not compiled in):
// the two multiplications round the mantissa to fp16 precision with the FPU's own nearest-even
// rounding, subnormal results included.
uint16_t float_to_fp16_bits(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = bits_float((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

// The FP16 library's fp16_ieee_to_fp32_value: exact for every fp16 value, subnormals included.
float fp16_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized_value = bits_float((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = UINT32_C(126) << 23;
  const float magic_bias = 0.5f;
  const float denormalized_value = bits_float((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? float_bits(denormalized_value) : float_bits(normalized_value));
  return bits_float(result);
}

void adamw_scalar(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) { adamw_scalar_typed<g.value, c.value, s.value>(p, begin, end); });
}

void stream_probe_scalar(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) {
    if constexpr (g.value != GradType::kFloat32 && c.value == ComputeType::kBFloat16) {
      stream_probe_scalar_typed<g.value, c.value, s.value>(p, begin, end);
    }
  });
}

}  // namespace megaslide::offload::detail
