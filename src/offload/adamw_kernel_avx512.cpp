// AVX-512 AdamW kernel: 16 fp32 lanes per vector, masked loads and stores for the tail so the tail
// runs the very same instructions as the body. Compiled with -mavx512f -mavx512bw -mavx512vl -mfma
// -mf16c (see src/CMakeLists.txt) and called only when cpu_has_avx512() says so. Includes no LibTorch
// header (see adamw_kernels.h for why).
#include <immintrin.h>

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

template <GradType G, ComputeType C, bool kStream = false>
inline void adamw_vector(const AdamWKernelParams& p, const Constants& c, int64_t i, __mmask16 k) {
  const __m512 g = _mm512_mul_ps(load_grad<G>(p.grad, i, k), c.grad_scale);
  __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.master + i), c.decay);
  const __m512 m = _mm512_fmadd_ps(g, c.one_minus_beta1, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.exp_avg + i), c.beta1));
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g,
                                   _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.exp_avg_sq + i), c.beta2));
  const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.sqrt_bc2), c.eps);
  w = _mm512_add_ps(w, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, m), d));
  _mm512_mask_storeu_ps(p.master + i, k, w);
  _mm512_mask_storeu_ps(p.exp_avg + i, k, m);
  _mm512_mask_storeu_ps(p.exp_avg_sq + i, k, v);
  store_compute<C, kStream>(p.compute, i, w, k);
}

template <GradType G, ComputeType C>
void adamw_avx512_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const Constants c(p);
  int64_t i = begin;
  if (use_streaming(p, begin)) {
    for (; i + 16 <= end; i += 16) adamw_vector<G, C, true>(p, c, i, 0xFFFF);
    _mm_sfence();  // streaming stores are weakly ordered: publish them before the caller signals done
  } else {
    for (; i + 16 <= end; i += 16) adamw_vector<G, C>(p, c, i, 0xFFFF);
  }
  if (i < end) adamw_vector<G, C>(p, c, i, static_cast<__mmask16>((1u << (end - i)) - 1));
}

template <GradType G, ComputeType C, bool kStream = false>
inline void stream_vector(const AdamWKernelParams& p, __m512 scale, int64_t i, __mmask16 k) {
  const __m512 g = _mm512_mul_ps(load_grad<G>(p.grad, i, k), scale);
  const __m512 w = _mm512_add_ps(_mm512_maskz_loadu_ps(k, p.master + i), g);
  _mm512_mask_storeu_ps(p.master + i, k, w);
  _mm512_mask_storeu_ps(p.exp_avg + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, p.exp_avg + i), g));
  _mm512_mask_storeu_ps(p.exp_avg_sq + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, p.exp_avg_sq + i), g));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(w), 16));
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.compute) + i), h);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.compute) + i, k, h);
  }
}

template <GradType G, ComputeType C>
void stream_probe_avx512_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const __m512 scale = _mm512_set1_ps(p.grad_scale);
  int64_t i = begin;
  if (use_streaming(p, begin)) {
    for (; i + 16 <= end; i += 16) stream_vector<G, C, true>(p, scale, i, 0xFFFF);
    _mm_sfence();
  } else {
    for (; i + 16 <= end; i += 16) stream_vector<G, C>(p, scale, i, 0xFFFF);
  }
  if (i < end) stream_vector<G, C>(p, scale, i, static_cast<__mmask16>((1u << (end - i)) - 1));
}

}  // namespace

void adamw_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  MEGASLIDE_ADAMW_DISPATCH(adamw_avx512_typed, p, begin, end)
}

void stream_probe_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  if (p.grad_type == GradType::kFloat16) return stream_probe_avx512_typed<GradType::kFloat16, ComputeType::kBFloat16>(p, begin, end);
  return stream_probe_avx512_typed<GradType::kBFloat16, ComputeType::kBFloat16>(p, begin, end);
}

}  // namespace megaslide::offload::detail
