// AVX-512 AdamW kernel: 16 fp32 lanes per vector, masked loads and stores for the tail so the tail
// runs the very same instructions as the body. Compiled with -mavx512f -mavx512bw -mavx512vl -mfma
// -mf16c (see src/CMakeLists.txt) and called only when cpu_has_avx512() says so. Includes no LibTorch
// header (see adamw_kernels.h for why).
#include <immintrin.h>

#include <algorithm>

#include "offload/adamw_kernels.h"

// GCC 12 warns inside its own intrinsic headers (_mm512_cvtepi32_epi16's deliberately undefined
// pass-through operand, GCC bug 105593); the warning is about the header, not this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace megaslide::offload::detail {
namespace {

// --- SIMD shim: 16-bit <-> fp32 conversions on 16 lanes ----------------------------------------

template <GradType G>
inline __m512 load_grad(const void* grad, int64_t i, __mmask16 k) {
  if constexpr (G == GradType::kFloat32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(grad) + i);
    if constexpr (G == GradType::kBFloat16) {
      // bf16 is the upper half of an fp32: widening is a shift, exact.
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);  // exact, subnormals included
    }
  }
}

// Round to nearest even with c10::BFloat16's integer trick (add 0x7FFF + lsb, keep the top half);
// NaN becomes 0x7FC0 as in c10. Not vcvtneps2bf16: it flushes subnormal inputs to zero, c10 does not.
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// IEEE nearest-even conversion in hardware; NaN lanes are rewritten to c10's sign | 0x7E00 (the
// hardware keeps payload bits instead).
inline __m256i to_fp16(__m512 x) {
  __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i canonical = _mm512_or_si512(
      _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7E00));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm256_mask_mov_epi16(h, nan, _mm512_cvtepi32_epi16(canonical));
}

// kStream: a full, 32-byte-aligned vector written with a non-temporal store (see
// AdamWKernelParams::stream_compute); otherwise a masked ordinary store.
template <ComputeType C, bool kStream>
inline void store_compute(void* compute, int64_t i, __m512 w, __mmask16 k) {
  if constexpr (C != ComputeType::kNone) {
    const __m256i h = C == ComputeType::kBFloat16 ? to_bf16(w) : to_fp16(w);
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(compute) + i), h);
    } else {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(compute) + i, k, h);
    }
  }
}

// Whether [begin, end) can take streaming stores for the copy: asked for, and element `begin` of the
// copy on a 32-byte boundary (so every full vector after it is).
inline bool use_streaming(const AdamWKernelParams& p, int64_t begin) {
  return p.stream_compute && p.compute != nullptr &&
         reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(p.compute) + begin) % 32 == 0;
}

// --- state: fp32, bf16 or int8 moments --------------------------------------------------------------

template <StateType S>
inline __m512 load_state(const void* state, int64_t i, __mmask16 k) {
  if constexpr (S == StateType::kFloat32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(state) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(state) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <StateType S>
inline void store_state(void* state, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (S == StateType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(state) + i, k, x);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(state) + i, k, to_bf16(x));
  }
}

// 16 int8 (kSigned) or uint8 codes widened to fp32; masked-off lanes read as 0.
template <bool kSigned>
inline __m512 load_codes(const void* codes, int64_t i, __mmask16 k) {
  const __m128i b = _mm_maskz_loadu_epi8(k, static_cast<const uint8_t*>(codes) + i);
  return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// --- kernels ---------------------------------------------------------------------------------------

struct Constants {
  __m512 grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, eps, neg_step_size;
  explicit Constants(const AdamWKernelParams& p)
      : grad_scale(_mm512_set1_ps(p.grad_scale)),
        decay(_mm512_set1_ps(p.decay)),
        beta1(_mm512_set1_ps(p.beta1)),
        one_minus_beta1(_mm512_set1_ps(p.one_minus_beta1)),
        beta2(_mm512_set1_ps(p.beta2)),
        one_minus_beta2(_mm512_set1_ps(p.one_minus_beta2)),
        sqrt_bc2(_mm512_set1_ps(p.sqrt_bias_correction2)),
        eps(_mm512_set1_ps(p.eps)),
        neg_step_size(_mm512_set1_ps(p.neg_step_size)) {}
};

struct Moments {
  __m512 m, v, u;  // u = sqrt(v)
};

// The contract of adamw_kernels.h on the lanes of k from their old moments; writes master and the copy.
template <GradType G, ComputeType C, bool kStream = false>
inline Moments adamw_core(const AdamWKernelParams& p, const Constants& c, int64_t i, __mmask16 k, __m512 m_old,
                          __m512 v_old) {
  const __m512 g = _mm512_mul_ps(load_grad<G>(p.grad, i, k), c.grad_scale);
  __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.master + i), c.decay);
  const __m512 m = _mm512_fmadd_ps(g, c.one_minus_beta1, _mm512_mul_ps(m_old, c.beta1));
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, _mm512_mul_ps(v_old, c.beta2));
  const __m512 u = _mm512_sqrt_ps(v);
  const __m512 d = _mm512_add_ps(_mm512_div_ps(u, c.sqrt_bc2), c.eps);
  w = _mm512_add_ps(w, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, m), d));
  _mm512_mask_storeu_ps(p.master + i, k, w);
  store_compute<C, kStream>(p.compute, i, w, k);
  return {m, v, u};
}

template <GradType G, ComputeType C, StateType S, bool kStream = false>
inline void adamw_vector(const AdamWKernelParams& p, const Constants& c, int64_t i, __mmask16 k) {
  const Moments r =
      adamw_core<G, C, kStream>(p, c, i, k, load_state<S>(p.exp_avg, i, k), load_state<S>(p.exp_avg_sq, i, k));
  store_state<S>(p.exp_avg, i, r.m, k);
  store_state<S>(p.exp_avg_sq, i, r.v, k);
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

// 16 lanes of x * inv rounded to nearest even, clamped to [lo, hi], as int32.
inline __m512i quantise(__m512 x, __m512 inv, __m512 lo, __m512 hi) {
  return _mm512_cvt_roundps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, inv), lo), hi),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// One quantisation group [begin, begin + n), n <= kQuantGroup, of kInt8 state (adamw_kernels.h).
template <GradType G, ComputeType C, bool kStream>
inline void adamw_int8_group(const AdamWKernelParams& p, const Constants& c, int64_t begin, int64_t n) {
  const int64_t q = begin / kQuantGroup;
  auto* m_codes = static_cast<int8_t*>(p.exp_avg) + begin;
  auto* u_codes = static_cast<uint8_t*>(p.exp_avg_sq) + begin;
  const __m512 m_scale = _mm512_set1_ps(p.exp_avg_scale[q]), u_scale = _mm512_set1_ps(p.exp_avg_sq_scale[q]);
  alignas(64) float m_new[kQuantGroup], u_new[kQuantGroup];
  __m512 m_max = _mm512_setzero_ps(), u_max = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = j + 16 <= n ? __mmask16(0xFFFF) : tail_mask(n - j);
    const __m512 u_old = _mm512_mul_ps(load_codes<false>(u_codes, j, k), u_scale);
    const __m512 m_old = _mm512_mul_ps(load_codes<true>(m_codes, j, k), m_scale);
    // Streaming stores need whole vectors; a partial one takes the masked ordinary store.
    const Moments r = j + 16 <= n ? adamw_core<G, C, kStream>(p, c, begin + j, k, m_old, _mm512_mul_ps(u_old, u_old))
                                  : adamw_core<G, C, false>(p, c, begin + j, k, m_old, _mm512_mul_ps(u_old, u_old));
    _mm512_store_ps(m_new + j, r.m);  // masked-off lanes are 0 (zero inputs)
    _mm512_store_ps(u_new + j, r.u);
    m_max = _mm512_max_ps(m_max, _mm512_abs_ps(r.m));
    u_max = _mm512_max_ps(u_max, r.u);
  }
  const float m_amax = _mm512_reduce_max_ps(m_max), u_amax = _mm512_reduce_max_ps(u_max);
  const __m512 m_inv = _mm512_set1_ps(m_amax > 0.f ? 127.f / m_amax : 0.f);
  const __m512 u_inv = _mm512_set1_ps(u_amax > 0.f ? 255.f / u_amax : 0.f);
  const __m512 m_lo = _mm512_set1_ps(-127.f), m_hi = _mm512_set1_ps(127.f);
  const __m512 u_lo = _mm512_setzero_ps(), u_hi = _mm512_set1_ps(255.f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = j + 16 <= n ? __mmask16(0xFFFF) : tail_mask(n - j);
    const __m512i mq = quantise(_mm512_load_ps(m_new + j), m_inv, m_lo, m_hi);
    const __m512 u = _mm512_load_ps(u_new + j);
    __m512i uq = quantise(u, u_inv, u_lo, u_hi);
    uq = _mm512_mask_max_epi32(uq, _mm512_cmp_ps_mask(u, u_lo, _CMP_GT_OQ), uq, _mm512_set1_epi32(1));  // >= 1 where u > 0
    _mm_mask_storeu_epi8(m_codes + j, k, _mm512_cvtepi32_epi8(mq));
    _mm_mask_storeu_epi8(u_codes + j, k, _mm512_cvtepi32_epi8(uq));
  }
  p.exp_avg_scale[q] = m_amax / 127.f;
  p.exp_avg_sq_scale[q] = u_amax / 255.f;
}

template <GradType G, ComputeType C, StateType S>
void adamw_avx512_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
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
      for (; i + 16 <= end; i += 16) adamw_vector<G, C, S, true>(p, c, i, 0xFFFF);
      _mm_sfence();  // streaming stores are weakly ordered: publish them before the caller signals done
    } else {
      for (; i + 16 <= end; i += 16) adamw_vector<G, C, S>(p, c, i, 0xFFFF);
    }
    if (i < end) adamw_vector<G, C, S>(p, c, i, tail_mask(end - i));
  }
}

// x + d through fp32 for the lanes of k (the probe's one add per array).
template <StateType S>
inline void probe_state(void* state, float* scales, int64_t i, __m512 d, __mmask16 k) {
  if constexpr (S == StateType::kFloat32) {
    float* x = static_cast<float*>(state) + i;
    _mm512_mask_storeu_ps(x, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, x), d));
  } else if constexpr (S == StateType::kBFloat16) {
    const __m512 x = _mm512_add_ps(load_state<S>(state, i, k), d);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(state) + i, k,
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  } else {
    const __m512i x = _mm512_cvttps_epi32(_mm512_add_ps(load_codes<true>(state, i, k), d));
    _mm_mask_storeu_epi8(static_cast<int8_t*>(state) + i, k, _mm512_cvtepi32_epi8(x));
    if (i % kQuantGroup == 0) scales[i / kQuantGroup] += _mm512_cvtss_f32(d);
  }
}

template <GradType G, ComputeType C, StateType S, bool kStream = false>
inline void stream_vector(const AdamWKernelParams& p, __m512 scale, int64_t i, __mmask16 k) {
  const __m512 g = _mm512_mul_ps(load_grad<G>(p.grad, i, k), scale);
  const __m512 w = _mm512_add_ps(_mm512_maskz_loadu_ps(k, p.master + i), g);
  _mm512_mask_storeu_ps(p.master + i, k, w);
  probe_state<S>(p.exp_avg, p.exp_avg_scale, i, g, k);
  probe_state<S>(p.exp_avg_sq, p.exp_avg_sq_scale, i, g, k);
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(w), 16));
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.compute) + i), h);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.compute) + i, k, h);
  }
}

template <GradType G, ComputeType C, StateType S>
void stream_probe_avx512_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const __m512 scale = _mm512_set1_ps(p.grad_scale);
  int64_t i = begin;
  if (use_streaming(p, begin)) {
    for (; i + 16 <= end; i += 16) stream_vector<G, C, S, true>(p, scale, i, 0xFFFF);
    _mm_sfence();
  } else {
    for (; i + 16 <= end; i += 16) stream_vector<G, C, S>(p, scale, i, 0xFFFF);
  }
  if (i < end) stream_vector<G, C, S>(p, scale, i, tail_mask(end - i));
}

}  // namespace

void adamw_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) { adamw_avx512_typed<g.value, c.value, s.value>(p, begin, end); });
}

void stream_probe_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) {
    if constexpr (g.value != GradType::kFloat32 && c.value == ComputeType::kBFloat16) {
      stream_probe_avx512_typed<g.value, c.value, s.value>(p, begin, end);
    }
  });
}

}  // namespace megaslide::offload::detail
