// AVX2 AdamW kernel: 8 fp32 lanes per vector. AVX2 has no masked 16-bit loads, so the tail is copied
// into zero-padded stack buffers, run through the same vector body, and copied back: the tail's
// arithmetic is the body's. Compiled with -mavx2 -mfma -mf16c (see src/CMakeLists.txt) and called
// only when cpu_has_avx2() says so. Includes no LibTorch header (see adamw_kernels.h for why).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "offload/adamw_kernels.h"

namespace megaslide::offload::detail {
namespace {

// --- SIMD shim: 16-bit <-> fp32 conversions on 8 lanes --------------------------------------------

template <GradType G>
inline __m256 load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == GradType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Narrows 8 lanes of 32-bit values in [0, 0xFFFF] to 8 uint16.
inline __m128i narrow_u32_to_u16(__m256i r) {
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// c10::BFloat16's rounding: nearest even by integer add, NaN -> 0x7FC0.
inline __m128i to_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return narrow_u32_to_u16(r);
}

// Hardware nearest-even conversion; NaN lanes become c10's sign | 0x7E00.
inline __m128i to_fp16(__m256 x) {
  const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i canonical = _mm256_or_si256(
      _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7E00));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
  return _mm_blendv_epi8(h, narrow_u32_to_u16(canonical), nan16);
}

// kStream: a non-temporal store (see AdamWKernelParams::stream_compute); needs 16-byte alignment.
template <bool kStream>
inline void store_u16x8(void* dst, int64_t i, __m128i h) {
  auto* at = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + i);
  if constexpr (kStream) {
    _mm_stream_si128(at, h);
  } else {
    _mm_storeu_si128(at, h);
  }
}

template <ComputeType C, bool kStream>
inline void store_compute(void* compute, int64_t i, __m256 w) {
  if constexpr (C != ComputeType::kNone) {
    store_u16x8<kStream>(compute, i, C == ComputeType::kBFloat16 ? to_bf16(w) : to_fp16(w));
  }
}

// Whether [begin, end) can take streaming stores for the copy: asked for, and element `begin` of the
// copy on a 16-byte boundary (so every full vector after it is).
inline bool use_streaming(const AdamWKernelParams& p, int64_t begin) {
  return p.stream_compute && p.compute != nullptr &&
         reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(p.compute) + begin) % 16 == 0;
}

// --- state: fp32, bf16 or int8 moments --------------------------------------------------------------

template <StateType S>
inline __m256 load_state(const void* state, int64_t i) {
  if constexpr (S == StateType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(state) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(state) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <StateType S>
inline void store_state(void* state, int64_t i, __m256 x) {
  if constexpr (S == StateType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(state) + i, x);
  } else {
    store_u16x8<false>(state, i, to_bf16(x));
  }
}

template <StateType S>
constexpr int64_t state_bytes() {
  return S == StateType::kFloat32 ? 4 : S == StateType::kBFloat16 ? 2 : 1;
}

// 8 int8 (kSigned) or uint8 codes widened to fp32.
template <bool kSigned>
inline __m256 load_codes(const void* codes, int64_t i) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(codes) + i));
  return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// --- kernels ---------------------------------------------------------------------------------------

struct Constants {
  __m256 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, eps, neg_step_size;
  explicit Constants(const AdamWKernelParams& p)
      : grad_scale(_mm256_set1_ps(p.grad_scale)),
        decay(_mm256_set1_ps(p.decay)),
        beta1(_mm256_set1_ps(p.beta1)),
        one_minus_beta1(_mm256_set1_ps(p.one_minus_beta1)),
        beta2(_mm256_set1_ps(p.beta2)),
        one_minus_beta2(_mm256_set1_ps(p.one_minus_beta2)),
        sqrt_bc2(_mm256_set1_ps(p.sqrt_bias_correction2)),
        eps(_mm256_set1_ps(p.eps)),
        neg_step_size(_mm256_set1_ps(p.neg_step_size)) {}
};

struct Moments {
  __m256 m, v, u;  // u = sqrt(v)
};

// The contract of adamw_kernels.h on 8 lanes from their old moments; writes master and the copy.
template <GradType G, ComputeType C, bool kStream = false>
inline Moments adamw_core(const AdamWKernelParams& p, const Constants& c, int64_t i, __m256 m_old, __m256 v_old) {
  const __m256 g = _mm256_mul_ps(load_grad<G>(p.grad, i), c.grad_scale);
  __m256 w = _mm256_mul_ps(_mm256_loadu_ps(p.master + i), c.decay);
  const __m256 m = _mm256_fmadd_ps(g, c.one_minus_beta1, _mm256_mul_ps(m_old, c.beta1));
  const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, _mm256_mul_ps(v_old, c.beta2));
  const __m256 u = _mm256_sqrt_ps(v);
  const __m256 d = _mm256_add_ps(_mm256_div_ps(u, c.sqrt_bc2), c.eps);
  w = _mm256_add_ps(w, _mm256_div_ps(_mm256_mul_ps(c.neg_step_size, m), d));
  _mm256_storeu_ps(p.master + i, w);
  store_compute<C, kStream>(p.compute, i, w);
  return {m, v, u};
}

template <GradType G, ComputeType C, StateType S, bool kStream = false>
inline void adamw_vector(const AdamWKernelParams& p, const Constants& c, int64_t i) {
  const Moments r = adamw_core<G, C, kStream>(p, c, i, load_state<S>(p.exp_avg, i), load_state<S>(p.exp_avg_sq, i));
  store_state<S>(p.exp_avg, i, r.m);
  store_state<S>(p.exp_avg_sq, i, r.v);
}

template <GradType G>
constexpr int64_t grad_bytes() {
  return G == GradType::kFloat32 ? 4 : 2;
}

// Runs `vector_fn(params, 0)` on a copy of elements [i, end) (fewer than 8) padded with zeros, then
// writes the live elements back. `state_size`: bytes per moment element (0: the moments are not
// touched, the int8 path keeps them itself).
template <GradType G, ComputeType C, typename VectorFn>
inline void run_tail(const AdamWKernelParams& p, int64_t i, int64_t end, int64_t state_size, VectorFn vector_fn) {
  const int64_t n = end - i;
  alignas(32) float master[8] = {}, exp_avg[8] = {}, exp_avg_sq[8] = {};
  alignas(32) unsigned char grad[8 * 4] = {};
  alignas(32) uint16_t compute[8] = {};
  std::memcpy(master, p.master + i, n * 4);
  std::memcpy(exp_avg, static_cast<const unsigned char*>(p.exp_avg) + i * state_size, n * state_size);
  std::memcpy(exp_avg_sq, static_cast<const unsigned char*>(p.exp_avg_sq) + i * state_size, n * state_size);
  std::memcpy(grad, static_cast<const unsigned char*>(p.grad) + i * grad_bytes<G>(), n * grad_bytes<G>());
  // The gradient may be the compute copy (adamw_kernels.h): read it before the copy is written.
  if (C != ComputeType::kNone) std::memcpy(compute, static_cast<uint16_t*>(p.compute) + i, n * 2);
  AdamWKernelParams local = p;
  local.master = master;
  local.exp_avg = exp_avg;
  local.exp_avg_sq = exp_avg_sq;
  local.grad = grad;
  local.compute = compute;
  vector_fn(local, 0);
  std::memcpy(p.master + i, master, n * 4);
  std::memcpy(static_cast<unsigned char*>(p.exp_avg) + i * state_size, exp_avg, n * state_size);
  std::memcpy(static_cast<unsigned char*>(p.exp_avg_sq) + i * state_size, exp_avg_sq, n * state_size);
  if (C != ComputeType::kNone) std::memcpy(static_cast<uint16_t*>(p.compute) + i, compute, n * 2);
}

inline float max_lane(__m256 x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  float r = lanes[0];
  for (int k = 1; k < 8; ++k) r = r > lanes[k] ? r : lanes[k];
  return r;
}

// 8 lanes of x * inv rounded to nearest even, clamped to [lo, hi], as int32.
inline __m256i quantise(__m256 x, __m256 inv, __m256 lo, __m256 hi) {
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, inv), lo), hi));
}

// One quantisation group [begin, begin + n), n <= kQuantGroup, of kInt8 state (adamw_kernels.h).
template <GradType G, ComputeType C, bool kStream>
inline void adamw_int8_group(const AdamWKernelParams& p, const Constants& c, int64_t begin, int64_t n) {
  const int64_t q = begin / kQuantGroup;
  auto* m_codes = static_cast<int8_t*>(p.exp_avg) + begin;
  auto* u_codes = static_cast<uint8_t*>(p.exp_avg_sq) + begin;
  const __m256 m_scale = _mm256_set1_ps(p.exp_avg_scale[q]), u_scale = _mm256_set1_ps(p.exp_avg_sq_scale[q]);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  alignas(32) float m_new[kQuantGroup], u_new[kQuantGroup];
  __m256 m_max = _mm256_setzero_ps(), u_max = _mm256_setzero_ps();
  const auto lane_block = [&](const AdamWKernelParams& q_params, int64_t at, const void* m_src, const void* u_src,
                              int64_t j, auto stream_tag) {
    const __m256 u_old = _mm256_mul_ps(load_codes<false>(u_src, 0), u_scale);
    const Moments r = adamw_core<G, C, decltype(stream_tag)::value>(
        q_params, c, at, _mm256_mul_ps(load_codes<true>(m_src, 0), m_scale), _mm256_mul_ps(u_old, u_old));
    _mm256_store_ps(m_new + j, r.m);
    _mm256_store_ps(u_new + j, r.u);
    m_max = _mm256_max_ps(m_max, _mm256_and_ps(r.m, abs_mask));
    u_max = _mm256_max_ps(u_max, r.u);
  };
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    lane_block(p, begin + j, m_codes + j, u_codes + j, j, std::integral_constant<bool, kStream>{});
  }
  if (j < n) {
    alignas(8) int8_t m_tail[8] = {};
    alignas(8) uint8_t u_tail[8] = {};
    std::memcpy(m_tail, m_codes + j, n - j);
    std::memcpy(u_tail, u_codes + j, n - j);
    run_tail<G, C>(p, begin + j, begin + n, 0, [&](const AdamWKernelParams& local, int64_t at) {
      lane_block(local, at, m_tail, u_tail, j, std::false_type{});
    });
  }
  const float m_amax = max_lane(m_max), u_amax = max_lane(u_max);
  const __m256 m_inv = _mm256_set1_ps(m_amax > 0.f ? 127.f / m_amax : 0.f);
  const __m256 u_inv = _mm256_set1_ps(u_amax > 0.f ? 255.f / u_amax : 0.f);
  const __m256 m_lo = _mm256_set1_ps(-127.f), m_hi = _mm256_set1_ps(127.f);
  const __m256 u_lo = _mm256_setzero_ps(), u_hi = _mm256_set1_ps(255.f);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i mq = quantise(_mm256_load_ps(m_new + k), m_inv, m_lo, m_hi);
    const __m256 u = _mm256_load_ps(u_new + k);
    __m256i uq = quantise(u, u_inv, u_lo, u_hi);
    // At least 1 where u > 0.
    uq = _mm256_max_epi32(uq, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(u, u_lo, _CMP_GT_OQ)), _mm256_set1_epi32(1)));
    const __m128i m16 = _mm_packs_epi32(_mm256_castsi256_si128(mq), _mm256_extracti128_si256(mq, 1));
    const __m128i u16 = _mm_packus_epi32(_mm256_castsi256_si128(uq), _mm256_extracti128_si256(uq, 1));
    const __m128i m8 = _mm_packs_epi16(m16, m16), u8 = _mm_packus_epi16(u16, u16);
    if (k + 8 <= n) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(m_codes + k), m8);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(u_codes + k), u8);
    } else {
      alignas(16) uint8_t mb[16], ub[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(mb), m8);
      _mm_store_si128(reinterpret_cast<__m128i*>(ub), u8);
      std::memcpy(m_codes + k, mb, n - k);
      std::memcpy(u_codes + k, ub, n - k);
    }
  }
  p.exp_avg_scale[q] = m_amax / 127.f;
  p.exp_avg_sq_scale[q] = u_amax / 255.f;
}

template <GradType G, ComputeType C, StateType S>
void adamw_avx2_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const Constants c(p);
  const bool stream = use_streaming(p, begin);
  if constexpr (S == StateType::kInt8) {
    for (int64_t i = begin; i < end; i += kQuantGroup) {
      const int64_t n = std::min(kQuantGroup, end - i);
      if (stream) adamw_int8_group<G, C, true>(p, c, i, n);
      else adamw_int8_group<G, C, false>(p, c, i, n);
    }
    if (stream) _mm_sfence();
  } else {
    int64_t i = begin;
    if (stream) {
      for (; i + 8 <= end; i += 8) adamw_vector<G, C, S, true>(p, c, i);
      _mm_sfence();  // streaming stores are weakly ordered: publish them before the caller signals done
    } else {
      for (; i + 8 <= end; i += 8) adamw_vector<G, C, S>(p, c, i);
    }
    if (i < end) {
      run_tail<G, C>(p, i, end, state_bytes<S>(),
                     [&c](const AdamWKernelParams& q, int64_t j) { adamw_vector<G, C, S>(q, c, j); });
    }
  }
}

// x + d through fp32 for 8 state elements (the probe's one add per array).
template <StateType S>
inline void probe_state(void* state, float* scales, int64_t i, __m256 d) {
  if constexpr (S == StateType::kFloat32) {
    float* x = static_cast<float*>(state) + i;
    _mm256_storeu_ps(x, _mm256_add_ps(_mm256_loadu_ps(x), d));
  } else if constexpr (S == StateType::kBFloat16) {
    const __m256 x = _mm256_add_ps(load_state<S>(state, i), d);
    store_u16x8<false>(state, i, narrow_u32_to_u16(_mm256_srli_epi32(_mm256_castps_si256(x), 16)));
  } else {
    const __m256i x = _mm256_cvttps_epi32(_mm256_add_ps(load_codes<true>(state, i), d));
    const __m128i x16 = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<int8_t*>(state) + i), _mm_packs_epi16(x16, x16));
    if (i % kQuantGroup == 0) scales[i / kQuantGroup] += _mm256_cvtss_f32(d);
  }
}

template <GradType G, ComputeType C, StateType S, bool kStream = false>
inline void stream_vector(const AdamWKernelParams& p, __m256 scale, int64_t i) {
  const __m256 g = _mm256_mul_ps(load_grad<G>(p.grad, i), scale);
  const __m256 w = _mm256_add_ps(_mm256_loadu_ps(p.master + i), g);
  _mm256_storeu_ps(p.master + i, w);
  probe_state<S>(p.exp_avg, p.exp_avg_scale, i, g);
  probe_state<S>(p.exp_avg_sq, p.exp_avg_sq_scale, i, g);
  store_u16x8<kStream>(p.compute, i, narrow_u32_to_u16(_mm256_srli_epi32(_mm256_castps_si256(w), 16)));
}

template <GradType G, ComputeType C, StateType S>
void stream_probe_avx2_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const __m256 scale = _mm256_set1_ps(p.grad_scale);
  int64_t i = begin;
  if (use_streaming(p, begin)) {
    for (; i + 8 <= end; i += 8) stream_vector<G, C, S, true>(p, scale, i);
    _mm_sfence();
  } else {
    for (; i + 8 <= end; i += 8) stream_vector<G, C, S>(p, scale, i);
  }
  if (i < end) {
    AdamWKernelParams rest = p;  // the last < 8 elements: the scalar probe's bytes are the same
    stream_probe_scalar(rest, i, end);
  }
}

}  // namespace

void adamw_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) { adamw_avx2_typed<g.value, c.value, s.value>(p, begin, end); });
}

void stream_probe_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) {
    if constexpr (g.value != GradType::kFloat32 && c.value == ComputeType::kBFloat16) {
      stream_probe_avx2_typed<g.value, c.value, s.value>(p, begin, end);
    }
  });
}

}  // namespace megaslide::offload::detail
