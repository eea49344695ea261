// AVX2 AdamW kernel: 8 fp32 lanes per vector. AVX2 has no masked 16-bit loads, so the tail is copied
// into zero-padded stack buffers, run through the same vector body, and copied back: the tail's
// arithmetic is the body's. Compiled with -mavx2 -mfma -mf16c (see src/CMakeLists.txt) and called
// only when cpu_has_avx2() says so. Includes no LibTorch header (see adamw_kernels.h for why).
#include <immintrin.h>

#include <cstring>

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

template <GradType G, ComputeType C, bool kStream = false>
inline void adamw_vector(const AdamWKernelParams& p, const Constants& c, int64_t i) {
  const __m256 g = _mm256_mul_ps(load_grad<G>(p.grad, i), c.grad_scale);
  __m256 w = _mm256_mul_ps(_mm256_loadu_ps(p.master + i), c.decay);
  const __m256 m = _mm256_fmadd_ps(g, c.one_minus_beta1, _mm256_mul_ps(_mm256_loadu_ps(p.exp_avg + i), c.beta1));
  const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g,
                                   _mm256_mul_ps(_mm256_loadu_ps(p.exp_avg_sq + i), c.beta2));
  const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.sqrt_bc2), c.eps);
  w = _mm256_add_ps(w, _mm256_div_ps(_mm256_mul_ps(c.neg_step_size, m), d));
  _mm256_storeu_ps(p.master + i, w);
  _mm256_storeu_ps(p.exp_avg + i, m);
  _mm256_storeu_ps(p.exp_avg_sq + i, v);
  store_compute<C, kStream>(p.compute, i, w);
}

template <GradType G>
constexpr int64_t grad_bytes() {
  return G == GradType::kFloat32 ? 4 : 2;
}

// Runs `vector_fn(params, 0)` on a copy of elements [i, end) (fewer than 8) padded with zeros, then
// writes the live elements back.
template <GradType G, ComputeType C, typename VectorFn>
inline void run_tail(const AdamWKernelParams& p, int64_t i, int64_t end, VectorFn vector_fn) {
  const int64_t n = end - i;
  alignas(32) float master[8] = {}, exp_avg[8] = {}, exp_avg_sq[8] = {};
  alignas(32) unsigned char grad[8 * 4] = {};
  alignas(32) uint16_t compute[8] = {};
  std::memcpy(master, p.master + i, n * 4);
  std::memcpy(exp_avg, p.exp_avg + i, n * 4);
  std::memcpy(exp_avg_sq, p.exp_avg_sq + i, n * 4);
  std::memcpy(grad, static_cast<const unsigned char*>(p.grad) + i * grad_bytes<G>(), n * grad_bytes<G>());
  AdamWKernelParams local = p;
  local.master = master;
  local.exp_avg = exp_avg;
  local.exp_avg_sq = exp_avg_sq;
  local.grad = grad;
  local.compute = compute;
  vector_fn(local, 0);
  std::memcpy(p.master + i, master, n * 4);
  std::memcpy(p.exp_avg + i, exp_avg, n * 4);
  std::memcpy(p.exp_avg_sq + i, exp_avg_sq, n * 4);
  if (C != ComputeType::kNone) std::memcpy(static_cast<uint16_t*>(p.compute) + i, compute, n * 2);
}

template <GradType G, ComputeType C>
void adamw_avx2_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const Constants c(p);
  int64_t i = begin;
  if (use_streaming(p, begin)) {
    for (; i + 8 <= end; i += 8) adamw_vector<G, C, true>(p, c, i);
    _mm_sfence();  // streaming stores are weakly ordered: publish them before the caller signals done
  } else {
    for (; i + 8 <= end; i += 8) adamw_vector<G, C>(p, c, i);
  }
  if (i < end) {
    run_tail<G, C>(p, i, end, [&c](const AdamWKernelParams& q, int64_t j) { adamw_vector<G, C>(q, c, j); });
  }
}

template <GradType G, ComputeType C, bool kStream = false>
inline void stream_vector(const AdamWKernelParams& p, __m256 scale, int64_t i) {
  const __m256 g = _mm256_mul_ps(load_grad<G>(p.grad, i), scale);
  const __m256 w = _mm256_add_ps(_mm256_loadu_ps(p.master + i), g);
  _mm256_storeu_ps(p.master + i, w);
  _mm256_storeu_ps(p.exp_avg + i, _mm256_add_ps(_mm256_loadu_ps(p.exp_avg + i), g));
  _mm256_storeu_ps(p.exp_avg_sq + i, _mm256_add_ps(_mm256_loadu_ps(p.exp_avg_sq + i), g));
  store_u16x8<kStream>(p.compute, i, narrow_u32_to_u16(_mm256_srli_epi32(_mm256_castps_si256(w), 16)));
}

template <GradType G, ComputeType C>
void stream_probe_avx2_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const __m256 scale = _mm256_set1_ps(p.grad_scale);
  int64_t i = begin;
  if (use_streaming(p, begin)) {
    for (; i + 8 <= end; i += 8) stream_vector<G, C, true>(p, scale, i);
    _mm_sfence();
  } else {
    for (; i + 8 <= end; i += 8) stream_vector<G, C>(p, scale, i);
  }
  if (i < end) {
    run_tail<G, C>(p, i, end, [scale](const AdamWKernelParams& q, int64_t j) { stream_vector<G, C>(q, scale, j); });
  }
}

}  // namespace

void adamw_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  MEGASLIDE_ADAMW_DISPATCH(adamw_avx2_typed, p, begin, end)
}

void stream_probe_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  if (p.grad_type == GradType::kFloat16) return stream_probe_avx2_typed<GradType::kFloat16, ComputeType::kBFloat16>(p, begin, end);
  return stream_probe_avx2_typed<GradType::kBFloat16, ComputeType::kBFloat16>(p, begin, end);
}

}  // namespace megaslide::offload::detail
