// AVX-512 AdamW kernel: the shared body (adamw_kernel_body.h) on 16 fp32 lanes per vector, with masked
// loads and stores for the tail so the tail runs the very same instructions as the body. Compiled with
// -mavx512f -mavx512bw -mavx512vl -mfma -mf16c (see src/CMakeLists.txt) and called only when
// cpu_has_avx512() says so. Includes no LibTorch header (see adamw_kernels.h for why).
#include <immintrin.h>

#include "offload/adamw_kernel_body.h"
#include "offload/adamw_kernels.h"

// GCC 12 warns inside its own intrinsic headers (_mm512_cvtepi32_epi16's deliberately undefined
// pass-through operand, GCC bug 105593); the warning is about the header, not this code. The same operand
// of other AVX-512 intrinsics draws -Wuninitialized at -O1, -O2 and -Os. (adamw_kernel_avx2.cpp compiles the
// shared body with both warnings on.)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace megaslide::offload::detail {
namespace {

struct Avx512 {
  using F = __m512;   // 16 fp32
  using I = __m512i;  // 16 int32
  using H = __m256i;  // 16 bf16 or fp16
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static constexpr bool kScalarProbeTail = false;  // the probe's tail is masked like the body's
  // The pipelined loops (adamw_kernel_body.h): on an AVX-512 Zen core 6-9 % less time a parameter in cache with
  // bf16 and int8 moments than one vector at a time, fp32 moments even; even or better out of cache
  // (docs/cpu-adamw.md).
  static constexpr bool kPipelined = true;

  static Mask all() { return 0xFFFF; }
  static Mask first(int64_t n) { return static_cast<Mask>((1u << n) - 1); }

  // --- memory: masked-off lanes load as 0 and are not stored ----------------------------------------

  static F load_f32(const float* src, Mask k) { return _mm512_maskz_loadu_ps(k, src); }
  static void store_f32(float* dst, F x, Mask k) { _mm512_mask_storeu_ps(dst, k, x); }
  static F load_aligned(const float* src) { return _mm512_load_ps(src); }
  static void store_aligned(float* dst, F x) { _mm512_store_ps(dst, x); }
  static H load_u16(const uint16_t* src, Mask k) { return _mm256_maskz_loadu_epi16(k, src); }

  // kStream: a full, 32-byte-aligned vector written with a non-temporal store (see
  // AdamWKernelParams::stream_compute); otherwise a masked ordinary store.
  template <bool kStream>
  static void store_u16(uint16_t* dst, H h, Mask k) {
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
    } else {
      _mm256_mask_storeu_epi16(dst, k, h);
    }
  }

  // 16 int8 or uint8 codes widened to fp32; masked-off lanes read as 0.
  static F load_i8(const int8_t* src, Mask k) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(k, src)));
  }
  static F load_u8(const uint8_t* src, Mask k) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, src)));
  }
  // The low byte of each int32 lane (the re-quantised codes are in range; the stream probe's may wrap).
  static void store_i8(int8_t* dst, I x, Mask k) { _mm_mask_storeu_epi8(dst, k, _mm512_cvtepi32_epi8(x)); }
  static void store_u8(uint8_t* dst, I x, Mask k) { _mm_mask_storeu_epi8(dst, k, _mm512_cvtepi32_epi8(x)); }
  static void store_i8_x4(int8_t* dst, I a, I b, I c, I d) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32), _mm512_cvtepi32_epi8(c));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 48), _mm512_cvtepi32_epi8(d));
  }
  static void store_u8_x4(uint8_t* dst, I a, I b, I c, I d) { store_i8_x4(reinterpret_cast<int8_t*>(dst), a, b, c, d); }
  static void store_fence() { _mm_sfence(); }

  // --- 16-bit <-> fp32 ------------------------------------------------------------------------------

  // bf16 is the upper half of an fp32: widening is a shift, exact.
  static F widen_bf16(H h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static F widen_fp16(H h) { return _mm512_cvtph_ps(h); }  // exact, subnormals included

  // Round to nearest even with c10::BFloat16's integer trick (add 0x7FFF + lsb, keep the top half);
  // NaN becomes 0x7FC0 as in c10. Not vcvtneps2bf16: it flushes subnormal inputs to zero, c10 does not.
  static __m512i round_bf16(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  }
  static H to_bf16_not_nan(F x) { return _mm512_cvtepi32_epi16(round_bf16(x)); }
  static H to_bf16(F x) {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(round_bf16(x), nan, _mm512_set1_epi32(0x7FC0)));
  }
  static bool any_nan(F x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }

  // IEEE nearest-even conversion in hardware; NaN lanes are rewritten to c10's sign | 0x7E00 (the
  // hardware keeps payload bits instead).
  static H to_fp16_not_nan(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static H to_fp16(F x) {
    const __m256i h = to_fp16_not_nan(x);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i canonical = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x8000)),
                                              _mm512_set1_epi32(0x7E00));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm256_mask_mov_epi16(h, nan, _mm512_cvtepi32_epi16(canonical));
  }

  static H truncate_bf16(F x) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)); }

  // --- arithmetic -----------------------------------------------------------------------------------

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F x) { return _mm512_sqrt_ps(x); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F x) { return _mm512_abs_ps(x); }
  static float max_lane(F x) { return _mm512_reduce_max_ps(x); }
  static float first_lane(F x) { return _mm512_cvtss_f32(x); }
  static I round_to_i32(F x) { return _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static I truncate_to_i32(F x) { return _mm512_cvttps_epi32(x); }
  // codes, raised to at least 1 where u > 0.
  static I at_least_one_where_positive(I codes, F u) {
    return _mm512_mask_max_epi32(codes, _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_GT_OQ), codes,
                                 _mm512_set1_epi32(1));
  }
  static I at_least_one_where_positive_not_nan(I codes, F u) { return at_least_one_where_positive(codes, u); }
};

}  // namespace

void adamw_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end) { adamw_kernel<Avx512>(p, begin, end); }

void stream_probe_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  stream_probe_kernel<Avx512>(p, begin, end);
}

}  // namespace megaslide::offload::detail
