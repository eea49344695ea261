// Scalar AdamW kernel, the exact fp16/bf16 conversions, and the project's CPUID checks. Compiled for baseline
// x86-64 (no per-file ISA flags): this path must run on any x86-64 machine. Like the vector kernels
// it includes no LibTorch header (see adamw_kernels.h).
#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

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

template <GradType G, ComputeType C>
void adamw_scalar_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    // The operation order (and the one fma) is the contract of adamw_kernels.h; the vector kernels
    // perform the same IEEE operations lane by lane, so all paths agree bit for bit.
    const float g = load_grad<G>(p.grad, i) * p.grad_scale;
    float w = p.master[i] * p.decay;
    const float m = std::fma(g, p.one_minus_beta1, p.exp_avg[i] * p.beta1);
    const float v = std::fma(p.one_minus_beta2 * g, g, p.exp_avg_sq[i] * p.beta2);
    const float d = std::sqrt(v) / p.sqrt_bias_correction2 + p.eps;
    w = w + (p.neg_step_size * m) / d;
    p.master[i] = w;
    p.exp_avg[i] = m;
    p.exp_avg_sq[i] = v;
    store_compute<C>(p.compute, i, w);
  }
}

template <GradType G, ComputeType C>
void stream_probe_scalar_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = load_grad<G>(p.grad, i) * p.grad_scale;
    const float w = p.master[i] + g;
    p.master[i] = w;
    p.exp_avg[i] += g;
    p.exp_avg_sq[i] += g;
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
  MEGASLIDE_ADAMW_DISPATCH(adamw_scalar_typed, p, begin, end)
}

void stream_probe_scalar(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  if (p.grad_type == GradType::kFloat16) return stream_probe_scalar_typed<GradType::kFloat16, ComputeType::kBFloat16>(p, begin, end);
  return stream_probe_scalar_typed<GradType::kBFloat16, ComputeType::kBFloat16>(p, begin, end);
}

// __builtin_cpu_supports reads CPUID and, for AVX and AVX-512, also checks (XGETBV) that the OS saves
// the wider registers, so a hypervisor that hides them turns the path off.
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// AMX-BF16 from CPUID leaf 7 (EDX bit 22, with AMX-TILE bit 24), and XCR0 bits 17-18: the OS saves the
// tile configuration and data (Linux then grants them to a process on request, as oneDNN makes it).
// Read by hand: not every compiler's __builtin_cpu_supports knows "amx-bf16" (clang 14 does not).
bool cpu_has_amx_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c & (1u << 27)) == 0) return false;  // OSXSAVE: XGETBV works
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool amx = (d & (1u << 22)) != 0 && (d & (1u << 24)) != 0;
  uint32_t xcr0_low = 0, xcr0_high = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  constexpr uint32_t kTileState = (1u << 17) | (1u << 18);
  return amx && (xcr0_low & kTileState) == kTileState;
#else
  return false;
#endif
}

}  // namespace megaslide::offload::detail
