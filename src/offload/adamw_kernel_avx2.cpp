// AVX2 AdamW kernel: the shared body (adamw_kernel_body.h) on 8 fp32 lanes per vector. AVX2 has no masked
// 8- or 16-bit loads, so a tail's loads copy its live lanes into zero-padded stack memory, the same vector
// body runs on them, and its stores copy the live lanes back: the tail's arithmetic is the body's.
// Compiled with -mavx2 -mfma -mf16c (see src/CMakeLists.txt) and called only when cpu_has_avx2() says so.
// Includes no LibTorch header (see adamw_kernels.h for why).
#include <immintrin.h>

#include <cstring>

#include "offload/adamw_kernel_body.h"
#include "offload/adamw_kernels.h"

namespace megaslide::offload::detail {
namespace {

// Narrows 8 lanes of 32-bit values in [0, 0xFFFF] to 8 uint16.
inline __m128i narrow_u32_to_u16(__m256i r) {
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The first `live` of 8 bytes in the low half of the result, the rest 0.
inline __m128i load_bytes(const void* src, int64_t live) {
  if (live == 8) return _mm_loadl_epi64(static_cast<const __m128i*>(src));
  __m128i b = _mm_setzero_si128();
  std::memcpy(&b, src, live);
  return b;
}

inline void store_bytes(void* dst, __m128i b, int64_t live) {
  if (live == 8) {
    _mm_storel_epi64(static_cast<__m128i*>(dst), b);
  } else {
    std::memcpy(dst, &b, live);
  }
}

struct Avx2 {
  using F = __m256;   // 8 fp32
  using I = __m256i;  // 8 int32
  using H = __m128i;  // 8 bf16 or fp16
  static constexpr int64_t kLanes = 8;
  // The stream probe's last < 8 elements take the scalar probe. Its bytes are the vector's, except for
  // int8 state pushed out of range (the scalar probe wraps, store_i8 saturates).
  static constexpr bool kScalarProbeTail = true;
  // Software-pipelined loops (adamw_kernel_body.h): on a Zen 1 core 21 % (fp32 moments) to 7–8 % (int8) less time
  // a parameter in cache (docs/cpu-adamw.md).
  static constexpr bool kPipelined = true;

  // The live lanes are the first `live` (all 8 in the body, fewer in a tail).
  struct Mask {
    int64_t live;
  };
  static Mask all() { return {kLanes}; }
  static Mask first(int64_t n) { return {n}; }

  // --- memory: a partial vector goes through the stack, dead lanes 0 ----------------------------------

  static F load_f32(const float* src, Mask k) {
    if (k.live == kLanes) return _mm256_loadu_ps(src);
    F x = _mm256_setzero_ps();
    std::memcpy(&x, src, k.live * sizeof(float));
    return x;
  }
  static void store_f32(float* dst, F x, Mask k) {
    if (k.live == kLanes) {
      _mm256_storeu_ps(dst, x);
    } else {
      std::memcpy(dst, &x, k.live * sizeof(float));
    }
  }
  static F load_aligned(const float* src) { return _mm256_load_ps(src); }
  static void store_aligned(float* dst, F x) { _mm256_store_ps(dst, x); }

  static H load_u16(const uint16_t* src, Mask k) {
    if (k.live == kLanes) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    H h = _mm_setzero_si128();
    std::memcpy(&h, src, k.live * sizeof(uint16_t));
    return h;
  }

  // kStream: a non-temporal store (see AdamWKernelParams::stream_compute) of a whole vector; needs 16-byte
  // alignment.
  template <bool kStream>
  static void store_u16(uint16_t* dst, H h, Mask k) {
    if constexpr (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), h);
    } else if (k.live == kLanes) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
    } else {
      std::memcpy(dst, &h, k.live * sizeof(uint16_t));
    }
  }

  // 8 int8 or uint8 codes widened to fp32.
  static F load_i8(const int8_t* src, Mask k) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes(src, k.live)));
  }
  static F load_u8(const uint8_t* src, Mask k) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load_bytes(src, k.live)));
  }
  // int32 lanes saturated to int8 (store_i8) or uint8 (store_u8).
  static void store_i8(int8_t* dst, I x, Mask k) {
    const __m128i x16 = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    store_bytes(dst, _mm_packs_epi16(x16, x16), k.live);
  }
  static void store_u8(uint8_t* dst, I x, Mask k) {
    const __m128i x16 = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    store_bytes(dst, _mm_packus_epi16(x16, x16), k.live);
  }
  // Four vectors: two 32-to-16 packs and one 16-to-8 pack leave the bytes in 4-byte groups ordered
  // a0 b0 c0 d0 | a1 b1 c1 d1 by 128-bit lane; one dword permute puts them in order.
  static __m256i order_x4(__m256i packed) {
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  static void store_i8_x4(int8_t* dst, I a, I b, I c, I d) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), order_x4(bytes));
  }
  static void store_u8_x4(uint8_t* dst, I a, I b, I c, I d) {
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), order_x4(bytes));
  }
  static void store_fence() { _mm_sfence(); }

  // --- 16-bit <-> fp32 ------------------------------------------------------------------------------

  // bf16 is the upper half of an fp32: each 128-bit lane of the broadcast picks its four 16-bit values into the
  // upper halves of its 32-bit lanes (zeros below) — one shuffle, where a zero-extension and a shift were two; a
  // broadcast of a load is a load.
  static F widen_bf16(H h) {
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(h), _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, -1, -1,
                                                         8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15)));
  }
  static F widen_fp16(H h) { return _mm256_cvtph_ps(h); }

  // c10::BFloat16's rounding: nearest even by integer add; the bf16 is the top half of each 32-bit lane.
  static __m256i round_bf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  }
  // The top halves gathered in order: a byte shuffle packs each 128-bit lane's four into its low 8 bytes,
  // and a quadword permute joins the two (two instructions; a shift, an extract and a pack were three).
  static H to_bf16_not_nan(F x) {
    const __m256i top = _mm256_shuffle_epi8(
        round_bf16(x), _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11,
                                        14, 15, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(top, 0b1000));
  }
  // The same with NaN -> 0x7FC0.
  static H to_bf16(F x) {
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_srli_epi32(round_bf16(x), 16);
    return narrow_u32_to_u16(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan));
  }
  static bool any_nan(F x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }

  // Hardware nearest-even conversion; NaN lanes become c10's sign | 0x7E00.
  static H to_fp16_not_nan(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static H to_fp16(F x) {
    const __m128i h = to_fp16_not_nan(x);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i canonical = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000)),
                                              _mm256_set1_epi32(0x7E00));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    return _mm_blendv_epi8(h, narrow_u32_to_u16(canonical), nan16);
  }

  static H truncate_bf16(F x) { return narrow_u32_to_u16(_mm256_srli_epi32(_mm256_castps_si256(x), 16)); }

  // --- arithmetic -----------------------------------------------------------------------------------

  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F x) { return _mm256_sqrt_ps(x); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  static float max_lane(F x) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, x);
    float r = lanes[0];
    for (int k = 1; k < 8; ++k) r = r > lanes[k] ? r : lanes[k];
    return r;
  }
  static float first_lane(F x) { return _mm256_cvtss_f32(x); }
  static I round_to_i32(F x) { return _mm256_cvtps_epi32(x); }  // MXCSR's mode: nearest even
  static I truncate_to_i32(F x) { return _mm256_cvttps_epi32(x); }
  // codes, raised to at least 1 where u > 0.
  static I at_least_one_where_positive(I codes, F u) {
    const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(u, _mm256_setzero_ps(), _CMP_GT_OQ));
    return _mm256_max_epi32(codes, _mm256_and_si256(positive, _mm256_set1_epi32(1)));
  }
  // The same where u is +0 or positive (never NaN or negative): its bits as an int32 are then 0 or positive.
  static I at_least_one_where_positive_not_nan(I codes, F u) {
    return _mm256_max_epi32(codes, _mm256_min_epi32(_mm256_castps_si256(u), _mm256_set1_epi32(1)));
  }
};

}  // namespace

void adamw_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end) { adamw_kernel<Avx2>(p, begin, end); }

void stream_probe_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  stream_probe_kernel<Avx2>(p, begin, end);
}

}  // namespace megaslide::offload::detail
