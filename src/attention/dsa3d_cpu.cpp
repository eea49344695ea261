// Fused 3D-DSA on the CPU (docs/3d-dsa.md). Never materialises the N·K·d sampled keys and values. Work is
// per (token, offset group): the K sample points are computed once and serve every head of the group, whose
// channels are contiguous in q, k and v (heads of the group × d), so each corner row is one run of vector
// loads. Two forms of the loops, chosen by the group's channel count L (dsa3d_params.h):
//   by distinct corner row (L >= 64 backward, 128 forward): the K samples' 8 corners name far fewer distinct
//             rows than 8·K, so each key and value row is read once per (token, group): the products q·k (and
//             dout·v) of every head per distinct row, the logits as Σ_c w_c·(q·k_c) from them, per row the sum
//             of the coefficients of the samples and corners that name it; then one pass over the rows for out
//             (forward) or dq, dk, dv (backward). Heads four at a time in vectors where a group has four or more.
//   per sample (fewer channels, where the row bookkeeping costs more than it saves): the forward
//             interpolates the group's key row at each sample (8 corners, straight from k), takes every head's
//             logit, then the exponentials against each head's maximum weight the interpolated value rows; the
//             backward recomputes per sample and corner each head's q·k and dout·v and adds the corner's dq,
//             dk and dv rows in one pass over the group's channels (on AVX2 and AVX-512 with d a multiple of 8, a
//             sample's 8 corners in the lanes of one vector: backward_samples_corner_lanes).
// Both take the softmax in two passes (the logits of all K samples, then the exponentials against each head's
// maximum); the backward recomputes the probabilities from the saved log-sum-exp.
//
// Parallelism and determinism:
//   forward   at::parallel_for over tokens; every output element is written by one thread.
//   backward  default: the tokens are cut into one chunk per thread; chunk 0 accumulates dk, dv and
//             dbias into the outputs, every other chunk into its own zeroed part of the scratch the API
//             layer allocated, and the parts are added in chunk order. Same result on every run with
//             the same thread count; (threads - 1)·2·N·M·d extra fp32.
//             deterministic: one work unit per (batch, offset group); a unit owns the dk/dv slices of
//             its heads, so each element is summed by one thread in token order, and the per-batch
//             dbias partials are added in batch order. Bit-identical for any thread count, but only
//             B·G units run in parallel.
// The loops are written once and compiled for baseline x86-64, AVX2 and AVX-512 (see the entry points), each with
// vectors of its own unit's width, and for bf16 inputs once more with AVX512-BF16's products by distinct row; within a
// path, the order of every sum is fixed, so the results above hold per path.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/dsa3d_math.h"
#include "attention/dsa3d_params.h"
#include "util/cpu_features.h"

namespace megaslide::ops::detail {
namespace {

using dsa3d_math::Sample;

// The hot loops are inlined into one entry point per instruction set (forward_tokens_* and
// backward_tokens_* below): the library is built for baseline x86-64, and the entry points for AVX2, AVX-512 and
// AVX512-BF16 recompile the same loops for those units; dsa3d_forward_cpu picks one from CPUID.
#define MEGASLIDE_DSA_INLINE inline __attribute__((always_inline))

// x widened to acc_t.
template <typename acc_t, typename scalar_t>
MEGASLIDE_DSA_INLINE acc_t widen(scalar_t x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // exact: bf16 is the top half of an fp32
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<acc_t>(x);
  }
}

// N-lane fp32 vectors (GCC vector extensions). Each entry point uses its unit's width, V lanes: 16 (zmm) on
// AVX-512, 8 (ymm) on AVX2, 4 (xmm) on the baseline. Vectors wider than the registers are split by GCC through
// the stack (16 lanes on AVX2 made its loops 2-3x slower than the baseline's). Only the float accumulation type
// takes them; float64 runs the scalar loops. Every helper is inlined, so no vector crosses a call (-Wpsabi warns
// about an ABI nobody uses).
#pragma GCC diagnostic ignored "-Wpsabi"
template <int N>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef uint16_t U16 __attribute__((vector_size(2 * N)));
  typedef uint32_t U32 __attribute__((vector_size(4 * N)));
  typedef int32_t I32 __attribute__((vector_size(4 * N)));
};

// N elements from x widened to fp32 (bf16: exact, a shift; fp16: lane by lane).
template <int N, typename scalar_t>
MEGASLIDE_DSA_INLINE typename Lanes<N>::F vload(const scalar_t* x) {
  typename Lanes<N>::F f;
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&f, x, sizeof f);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    typename Lanes<N>::U16 h;
    std::memcpy(&h, x, sizeof h);
    const typename Lanes<N>::U32 bits = __builtin_convertvector(h, typename Lanes<N>::U32) << 16;
    std::memcpy(&f, &bits, sizeof f);
  } else {
    for (int i = 0; i < N; ++i) f[i] = static_cast<float>(x[i]);
  }
  return f;
}

template <int N>
MEGASLIDE_DSA_INLINE void vstore(float* x, typename Lanes<N>::F f) {
  std::memcpy(x, &f, sizeof f);
}

// 2N bf16 elements from x as two N-lane fp32 vectors from one load: even[i] = x[2i], odd[i] = x[2i + 1], each exact
// (bf16 is the top half of an fp32: the even element is the low half of each 32-bit lane shifted up, the odd one the
// lane with its low half cleared). Two integer operations for 2N channels where vload takes a widening and a shift
// for each N.
template <int N>
MEGASLIDE_DSA_INLINE void vload_pairs(const c10::BFloat16* x, typename Lanes<N>::F& even, typename Lanes<N>::F& odd) {
  typename Lanes<N>::U32 bits;
  std::memcpy(&bits, x, sizeof bits);
  const typename Lanes<N>::U32 lo = bits << 16, hi = bits & 0xFFFF0000u;
  std::memcpy(&even, &lo, sizeof even);
  std::memcpy(&odd, &hi, sizeof odd);
}

// x[0, 2N) = even and odd interleaved again: x[2i] = even[i], x[2i + 1] = odd[i].
template <int N>
MEGASLIDE_DSA_INLINE void vstore_pairs(float* x, typename Lanes<N>::F even, typename Lanes<N>::F odd) {
  static_assert(N == 8 || N == 16, "the 8- and 16-lane paths only");
  using I = typename Lanes<N>::I32;
  if constexpr (N == 16) {
    vstore<N>(x, __builtin_shuffle(even, odd, I{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}));
    vstore<N>(x + N, __builtin_shuffle(even, odd, I{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}));
  } else {
    vstore<N>(x, __builtin_shuffle(even, odd, I{0, 8, 1, 9, 2, 10, 3, 11}));
    vstore<N>(x + N, __builtin_shuffle(even, odd, I{4, 12, 5, 13, 6, 14, 7, 15}));
  }
}

template <int N>
MEGASLIDE_DSA_INLINE float vsum(typename Lanes<N>::F f) {
  if constexpr (N == 1) {
    return f[0];
  } else {
    typename Lanes<N / 2>::F lo, hi;
    std::memcpy(&lo, &f, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&f) + sizeof lo, sizeof hi);
    return vsum<N / 2>(lo + hi);
  }
}

// x · y over d elements, x in the input type, y already in acc_t: 8 partial sums in a fixed order, which
// vectorises without -ffast-math.
template <typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE acc_t dot(const scalar_t* x, const acc_t* y, int64_t d) {
  acc_t s[8] = {};
  int64_t c = 0;
  for (; c + 8 <= d; c += 8)
    for (int u = 0; u < 8; ++u) s[u] += widen<acc_t>(x[c + u]) * y[c + u];
  acc_t tail = 0;
  for (; c < d; ++c) tail += widen<acc_t>(x[c]) * y[c];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail;
}

// The same product for one head's d channels, in vectors of V lanes where d allows, else V / 2, ... down to 4
// (fp32 accumulation).
template <int V, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE acc_t head_dot(const scalar_t* x, const acc_t* y, int64_t d) {
  if constexpr (std::is_same_v<acc_t, float>) {
    if (d % V == 0) {
      typename Lanes<V>::F a = {};
      for (int64_t e = 0; e < d; e += V) a += vload<V>(x + e) * vload<V>(y + e);
      return vsum<V>(a);
    }
    if constexpr (V > 4) return head_dot<V / 2>(x, y, d);
  }
  return dot(x, y, d);
}

// The 8 sums of the lanes of x[0..7], in out[0..7]: three rounds of pairwise folds (each halves the lanes per
// vector and doubles the vectors per register), then the last adjacent pairs: 8 reductions in about as many
// shuffles as two done one by one.
MEGASLIDE_DSA_INLINE void sum8(const typename Lanes<16>::F* x, float* out) {
  using F = typename Lanes<16>::F;
  typedef int32_t I __attribute__((vector_size(64)));
  const auto fold = [](F a, F b, I lo, I hi) __attribute__((always_inline)) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
  };
  const I lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const I hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const I lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const I hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const I lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const I hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const F a01 = fold(x[0], x[1], lo8, hi8), a23 = fold(x[2], x[3], lo8, hi8);
  const F a45 = fold(x[4], x[5], lo8, hi8), a67 = fold(x[6], x[7], lo8, hi8);
  const F a0123 = fold(a01, a23, lo4, hi4), a4567 = fold(a45, a67, lo4, hi4);
  const F pairs = fold(a0123, a4567, lo2, hi2);  // lanes 2c, 2c + 1: vector c's two partial sums
  for (int c = 0; c < 8; ++c) out[c] = pairs[2 * c] + pairs[2 * c + 1];
}

// The lane sums of x[0..7] as one vector, lane c holding x[c]'s: two rounds of pairwise sums of adjacent lanes
// (shuffles within each 128-bit half, which are cheap; those across the halves cost several times more on AVX2
// cores), then the two halves' sums added: lane c is ((x_0 + x_1) + (x_2 + x_3)) + ((x_4 + x_5) + (x_6 + x_7))
// over x[c]'s lanes.
MEGASLIDE_DSA_INLINE typename Lanes<8>::F sum8_lanes(const typename Lanes<8>::F* x) {
  using F = typename Lanes<8>::F;
  typedef int32_t I __attribute__((vector_size(32)));
  // a's and b's lanes 0 + 1, 2 + 3 per half, in order a, a, b, b: the pairs of each half of both, side by side.
  const auto pairs = [](F a, F b) __attribute__((always_inline)) {
    return __builtin_shuffle(a, b, I{0, 2, 8, 10, 4, 6, 12, 14}) +
           __builtin_shuffle(a, b, I{1, 3, 9, 11, 5, 7, 13, 15});
  };
  const F q0 = pairs(pairs(x[0], x[1]), pairs(x[2], x[3]));  // per half: the half's sums of x[0], x[1], x[2], x[3]
  const F q1 = pairs(pairs(x[4], x[5]), pairs(x[6], x[7]));
  return __builtin_shuffle(q0, q1, I{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(q0, q1, I{4, 5, 6, 7, 12, 13, 14, 15});
}

// The same for 8 vectors of 8 lanes (heads of d = 8, 24, 40, ...): two rounds of folds, then adjacent pairs.
MEGASLIDE_DSA_INLINE void sum8(const typename Lanes<8>::F* x, float* out) {
  using F = typename Lanes<8>::F;
  typedef int32_t I __attribute__((vector_size(32)));
  const auto fold = [](F a, F b, I lo, I hi) __attribute__((always_inline)) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
  };
  const I lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
  const I lo2 = {0, 1, 4, 5, 8, 9, 12, 13}, hi2 = {2, 3, 6, 7, 10, 11, 14, 15};
  const F a01 = fold(x[0], x[1], lo4, hi4), a23 = fold(x[2], x[3], lo4, hi4);
  const F a45 = fold(x[4], x[5], lo4, hi4), a67 = fold(x[6], x[7], lo4, hi4);
  const F a0123 = fold(a01, a23, lo2, hi2), a4567 = fold(a45, a67, lo2, hi2);  // lanes 2c, 2c + 1: vector c's
  for (int c = 0; c < 4; ++c) {
    out[c] = a0123[2 * c] + a0123[2 * c + 1];
    out[4 + c] = a4567[2 * c] + a4567[2 * c + 1];
  }
}

// A sample's per-corner products for one head: qk[c] = q·k[corner c], odv[c] = dout·v[corner c] over the
// head's d channels (k_head, v_head: the head's first channel of token 0's row), 0 for inert corners, corner by
// corner (the AVX2 and AVX-512 backward take backward_samples_corner_lanes instead where d is a multiple of 8).
template <int V, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void corner_dots(const Sample<acc_t>& sp, const bool* inert, const scalar_t* k_head,
                                      const scalar_t* v_head, int64_t row_stride, const acc_t* q, const acc_t* dout,
                                      int64_t d, acc_t* qk, acc_t* odv) {
  for (int c = 0; c < 8; ++c) {
    const int64_t row = sp.index[c] * row_stride;
    qk[c] = inert[c] ? acc_t(0) : head_dot<V>(k_head + row, q, d);
    odv[c] = inert[c] ? acc_t(0) : head_dot<V>(v_head + row, dout, d);
  }
}

// e^x lane by lane for x <= 88 (the softmax's x <= 0, up to rounding): n = round(x / ln 2), r = x - n·ln 2
// in two parts (|r| <= ln 2 / 2), e^r by a degree-6 polynomial, then 2^n added to the exponent bits. About 1 ulp
// from expf; 0 below -87 (e^-87 = 1.6e-38: there 2^n·e^r would leave the normal range), NaN for NaN, +inf above 88.
template <int V>
MEGASLIDE_DSA_INLINE typename Lanes<V>::F exp_lanes(typename Lanes<V>::F x) {
  using F = typename Lanes<V>::F;
  typedef int32_t I __attribute__((vector_size(4 * V)));
  const F lo = F{} - 87.f, hi = F{} + 88.f;
  const F xc = x < lo ? lo : (x > hi ? hi : x);  // NaN: neither, kept
  const F shift = F{} + 12582912.f;              // 1.5·2^23: adding and subtracting it rounds to an integer
  const F n = (xc * 1.44269504f + shift) - shift;
  const F r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 = 0.693359375 - 2.12194440e-4
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3333452301e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const F y = p * (r * r) + r + 1.f;  // in [0.7, 1.42), so 2^n·y stays normal for -87 <= x <= 88
  const F e = (F)((I)y + (__builtin_convertvector(n, I) << 23));
  return x < lo ? F{} : (x > hi ? F{} + __builtin_inff() : (x == x ? e : x));
}

// x[0, n) = e^(x - max): V lanes at a time for fp32 (exp_lanes), exp_of for the rest and for float64.
template <int V, typename acc_t>
MEGASLIDE_DSA_INLINE void exponentiate(acc_t* x, int64_t n, acc_t max) {
  int64_t j = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    using F = typename Lanes<V>::F;
    for (; j + V <= n; j += V) vstore<V>(x + j, exp_lanes<V>(vload<V>(x + j) - max));
    if (j < n) {
      float tail[V];
      for (int64_t t = 0; t < V; ++t) tail[t] = j + t < n ? x[j + t] - max : 0.f;
      const F e = exp_lanes<V>(vload<V>(tail));
      for (int64_t t = 0; j + t < n; ++t) x[j + t] = e[t];
    }
    return;
  }
  for (; j < n; ++j) x[j] = dsa3d_math::exp_of(x[j] - max);
}

template <typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void load(const scalar_t* x, acc_t* y, int64_t n) {
  for (int64_t c = 0; c < n; ++c) y[c] = widen<acc_t>(x[c]);
}

struct TokenCoord {
  int64_t b, n, t, h, w;
};

inline TokenCoord coord_of(const Dsa3dShape& s, int64_t bn) {
  const int64_t N = s.tokens();
  TokenCoord c{};
  c.b = bn / N;
  c.n = bn % N;
  c.t = c.n / (s.H * s.W);
  c.h = (c.n / s.W) % s.H;
  c.w = c.n % s.W;
  return c;
}

// Calls f(j, xt, xh, xw) for the K samples of offset group g of token bn with their unclamped positions
// (dsa3d_math::token_position's): the window's start once per token and the regular offsets (rt, rh, rw) counted
// along, where token_position divides j by the kernel's sizes per sample.
template <typename acc_t, typename Fn>
MEGASLIDE_DSA_INLINE void for_each_position(const Dsa3dShape& s, const acc_t* offsets, const TokenCoord& tc, int64_t bn,
                                            int64_t g, Fn&& f) {
  const acc_t* off = offsets + (bn * s.G + g) * s.K * 3;
  const int64_t t0 = dsa3d_math::window_start(tc.t, s.kt, s.T), h0 = dsa3d_math::window_start(tc.h, s.kh, s.H),
                w0 = dsa3d_math::window_start(tc.w, s.kw, s.W);
  int64_t rt = 0, rh = 0, rw = 0;
  for (int64_t j = 0; j < s.K; ++j) {
    f(j, acc_t(t0 + rt) + off[3 * j], acc_t(h0 + rh) + off[3 * j + 1], acc_t(w0 + rw) + off[3 * j + 2]);
    if (++rw == s.kw) {
      rw = 0;
      if (++rh == s.kh) {
        rh = 0;
        ++rt;
      }
    }
  }
}

// dsa3d_math::trilinear_sample for float with each corner in a lane of one vector: the three axes' samples as there,
// then per corner the same selections and the same products in the same order (weight = w_w·w_h·w_t, ∂weight/∂t =
// w_w·w_h·(±dw_t), ...), so the same bits; the index as t·H·W + h·W + w, which is (t·H + h)·W + w exactly.
MEGASLIDE_DSA_INLINE void trilinear_sample_lanes(float xt, float xh, float xw, int64_t T, int64_t H, int64_t W,
                                                 Sample<float>& out) {
  using F = typename Lanes<8>::F;
  typedef int32_t I __attribute__((vector_size(32)));
  typedef int64_t I64 __attribute__((vector_size(64)));
  const auto at = dsa3d_math::sample_axis(xt, T), ah = dsa3d_math::sample_axis(xh, H),
             aw = dsa3d_math::sample_axis(xw, W);
  // Lane c is corner c: bit 2 of c selects t's upper corner, bit 1 h's, bit 0 w's.
  const I ut = {0, 0, 0, 0, -1, -1, -1, -1}, uh = {0, 0, -1, -1, 0, 0, -1, -1}, uw = {0, -1, 0, -1, 0, -1, 0, -1};
  const I64 ut64 = {0, 0, 0, 0, -1, -1, -1, -1}, uh64 = {0, 0, -1, -1, 0, 0, -1, -1},
            uw64 = {0, -1, 0, -1, 0, -1, 0, -1};
  const F wt = ut ? F{} + at.w1 : F{} + at.w0, wh = uh ? F{} + ah.w1 : F{} + ah.w0, ww = uw ? F{} + aw.w1 : F{} + aw.w0;
  const F ww_wh = ww * wh;
  vstore<8>(out.weight, ww_wh * wt);
  const F dt = ut ? F{} + at.dw : -(F{} + at.dw), dh = uh ? F{} + ah.dw : -(F{} + ah.dw),
          dw = uw ? F{} + aw.dw : -(F{} + aw.dw);
  vstore<8>(out.dweight[0], ww_wh * dt);
  vstore<8>(out.dweight[1], (ww * dh) * wt);
  vstore<8>(out.dweight[2], (dw * wh) * wt);
  const I64 idx = (ut64 ? I64{} + at.i1 * H * W : I64{} + at.i0 * H * W) +
                  (uh64 ? I64{} + ah.i1 * W : I64{} + ah.i0 * W) + (uw64 ? I64{} + aw.i1 : I64{} + aw.i0);
  std::memcpy(out.index, &idx, sizeof idx);
}

// One sample as the backward takes it on the path of V lanes: in corner lanes for float on AVX2 and AVX-512 (on
// the baseline path, without blends, they were 7 % slower than the scalar form); dsa3d_math's otherwise.
template <int V, typename acc_t>
MEGASLIDE_DSA_INLINE void sample_at(acc_t xt, acc_t xh, acc_t xw, int64_t T, int64_t H, int64_t W, Sample<acc_t>& out) {
  if constexpr (std::is_same_v<acc_t, float> && V >= 8) {
    trilinear_sample_lanes(xt, xh, xw, T, H, W, out);
  } else {
    dsa3d_math::trilinear_sample<acc_t>(xt, xh, xw, T, H, W, out);
  }
}

// The K samples of offset group g for token bn (dsa3d_math::token_sample).
template <int V, typename acc_t>
MEGASLIDE_DSA_INLINE void group_samples(const Dsa3dShape& s, const acc_t* offsets, const TokenCoord& tc, int64_t bn,
                                        int64_t g, Sample<acc_t>* samples) {
  for_each_position(
      s, offsets, tc, bn, g, [&](int64_t j, acc_t xt, acc_t xh, acc_t xw) __attribute__((always_inline)) {
        sample_at<V>(xt, xh, xw, s.T, s.H, s.W, samples[j]);
      });
}

// The forward needs a sample's corners and weights only, not their derivatives.
template <typename acc_t>
struct Point {
  int64_t index[8];
  acc_t weight[8];
};

// The K sample points of offset group g for token bn (dsa3d_math::token_corners).
template <typename acc_t>
MEGASLIDE_DSA_INLINE void group_points(const Dsa3dShape& s, const acc_t* offsets, const TokenCoord& tc, int64_t bn,
                                       int64_t g, Point<acc_t>* points) {
  for_each_position(
      s, offsets, tc, bn, g, [&](int64_t j, acc_t xt, acc_t xh, acc_t xw) __attribute__((always_inline)) {
        dsa3d_math::trilinear_corners<acc_t>(xt, xh, xw, s.T, s.H, s.W, points[j].index, points[j].weight);
      });
}

// out[0, L) = Σ_c weight[c] · rows[corner c][0, L): the sample's interpolated row of a group's heads (they are
// contiguous: L = heads of the group × d). A zero-weight corner (integer positions) reads zero_row (L zeros) instead
// of its row, so that its term is 0 even where the row holds ±∞ or NaN, as if it were skipped, and every sample runs
// the same 8 terms with no branch on how many corners are live. The sum runs in registers, each channel's terms in
// corner order: kBlock vectors of V channels at a time, corner by corner (each corner row read in order, kBlock
// independent sums), then single vectors, then channel by channel. kAccumulate: out += coef · (the interpolated
// row) instead (coef per channel).
template <int V, int kBlock, bool kAccumulate = false, typename scalar_t, typename acc_t, typename SampleT>
MEGASLIDE_DSA_INLINE void interpolate(const scalar_t* base, const SampleT& sp, int64_t row_stride, int64_t L,
                                      const scalar_t* zero_row, acc_t* __restrict out,
                                      const acc_t* __restrict coef = nullptr) {
  const scalar_t* rows[8];
  acc_t w[8];
  for (int c = 0; c < 8; ++c) {
    rows[c] = sp.weight[c] != acc_t(0) ? base + sp.index[c] * row_stride : zero_row;
    w[c] = sp.weight[c];
  }
  int64_t e = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    using F = typename Lanes<V>::F;
    // nb vectors from channel e on: corner by corner, nb independent sums.
    const auto vectors = [&](auto nb) __attribute__((always_inline)) {
      constexpr int NB = decltype(nb)::value;
      F a[NB];
      for (int b = 0; b < NB; ++b) a[b] = F{};
      for (int c = 0; c < 8; ++c) {
        const F wc = F{} + w[c];
        for (int b = 0; b < NB; ++b) a[b] += wc * vload<V>(rows[c] + e + b * V);
      }
      for (int b = 0; b < NB; ++b) {
        if constexpr (kAccumulate) {
          vstore<V>(out + e + b * V, vload<V>(out + e + b * V) + vload<V>(coef + e + b * V) * a[b]);
        } else {
          vstore<V>(out + e + b * V, a[b]);
        }
      }
    };
    for (; e + kBlock * V <= L; e += kBlock * V) vectors(std::integral_constant<int, kBlock>{});
    for (; e + V <= L; e += V) vectors(std::integral_constant<int, 1>{});
  }
  for (; e < L; ++e) {
    acc_t a = 0;
    for (int c = 0; c < 8; ++c) a += w[c] * widen<acc_t>(rows[c][e]);
    if constexpr (kAccumulate) {
      out[e] += coef[e] * a;
    } else {
      out[e] = a;
    }
  }
}

// A sample's share of the gradients over the group's L channels, corner by corner: dq += a·k, dk += a·q,
// dv += b·dout with a = dq_coef·w and b = prob·w per channel (dq_lane, prob_lane: each head's coefficient on
// its channels). Zero-weight corners are skipped. dq stays in registers across the corners; two corners may
// share a row (at the border), so each corner's dk and dv are read after the previous one's are stored.
template <int V, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void sample_gradients(const Sample<acc_t>& sp, int64_t row_stride, int64_t L, const scalar_t* kb,
                                           acc_t* dkb, acc_t* dvb, const acc_t* dq_lane, const acc_t* prob_lane,
                                           const acc_t* q_row, const acc_t* dout_row, acc_t* dq_row) {
  const scalar_t* k_rows[8];
  acc_t *dk_rows[8], *dv_rows[8];
  acc_t w[8];
  int n = 0;
  for (int c = 0; c < 8; ++c)
    if (sp.weight[c] != acc_t(0)) {
      const int64_t offset = sp.index[c] * row_stride;
      k_rows[n] = kb + offset;
      dk_rows[n] = dkb + offset;
      dv_rows[n] = dvb + offset;
      w[n++] = sp.weight[c];
    }
  int64_t e = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    using F = typename Lanes<V>::F;
    for (; e + V <= L; e += V) {
      const F a = vload<V>(dq_lane + e), b = vload<V>(prob_lane + e);
      const F qv = vload<V>(q_row + e), dov = vload<V>(dout_row + e);
      F dqv = vload<V>(dq_row + e);
      for (int c = 0; c < n; ++c) {
        const F aw = a * w[c];
        dqv += aw * vload<V>(k_rows[c] + e);
        vstore<V>(dk_rows[c] + e, vload<V>(dk_rows[c] + e) + aw * qv);
        vstore<V>(dv_rows[c] + e, vload<V>(dv_rows[c] + e) + (b * w[c]) * dov);
      }
      vstore<V>(dq_row + e, dqv);
    }
  }
  for (; e < L; ++e)
    for (int c = 0; c < n; ++c) {
      const acc_t aw = dq_lane[e] * w[c];
      dq_row[e] += aw * widen<acc_t>(k_rows[c][e]);
      dk_rows[c][e] += aw * q_row[e];
      dv_rows[c][e] += (prob_lane[e] * w[c]) * dout_row[e];
    }
}

// A token's distinct corner rows: the K samples' 8 corners name far fewer distinct key/value rows than 8·K
// (neighbouring samples share corners; 303 of 8·147 at 3x7x7 with offsets uniform in ±1.5 tokens over 4x32x32
// tokens, 365 over 8x32x32). Slots are numbered in order of first use; each entry's generation marks the volume's
// tokens seen for the current (token, group), so nothing is cleared between tokens.
struct CornerRows {
  // Per token of the volume: generation << 32 | slot; the slot is valid where the generation is the current one.
  std::vector<uint64_t> entry;
  uint64_t generation = 0;
  std::vector<int64_t> rows;  // slot -> token index in the volume; the first `count` are this token's
  int64_t count = 0;
  CornerRows(int64_t volume, int64_t corners) : entry(volume, 0), rows(corners) {}
  void begin() {
    if (++generation == (uint64_t{1} << 32)) {  // wrapped: every entry is stale again
      std::fill(entry.begin(), entry.end(), 0);
      generation = 1;
    }
    count = 0;
  }
  // The slots of a sample's 8 corners, -1 where a corner is not live (adds nothing). Free of branches on the
  // table's state: whether a row was seen before is data, not control flow (a branch there was mispredicted
  // about as often as not).
  MEGASLIDE_DSA_INLINE void slots(const int64_t* index, const bool* is_live, int32_t* out) {
    uint64_t* const e = entry.data();
    int64_t* const r = rows.data();
    const uint64_t stamp = generation << 32;
    uint64_t n = static_cast<uint64_t>(count);
    for (int i = 0; i < 8; ++i) {
      const int64_t x = index[i];
      const uint64_t old = e[x];
      const uint64_t live = is_live[i];  // 0 or 1
      const uint64_t fresh = live & static_cast<uint64_t>((old >> 32) != generation);
      const uint64_t pick = uint64_t{0} - fresh;  // all ones where fresh
      const uint64_t slot = (n & pick) | (old & ~pick & 0xffffffffu);
      e[x] = live ? (stamp | slot) : old;
      r[n] = x;
      n += fresh;
      out[i] = live ? static_cast<int32_t>(slot) : -1;
    }
    count = static_cast<int64_t>(n);
  }
};

// kCpuBackwardRowsMinChannels and kCpuForwardRowsMinChannels (dsa3d_params.h): below them the per-row
// bookkeeping costs more than the rows it saves (measured on the AVX-512, AVX2 and baseline loops, docs/3d-dsa.md;
// the README's smoke model, d = 8 with 2 heads, runs the per-sample loops). The forward's per-sample loop has no
// row updates to save, so its crossover lies higher: at 64 channels the two forms were even (4 heads of 16) or the
// per-sample one 15 % faster (2 heads of 32, AVX-512); at 128 and 256 the rows won on every path measured.

// y[0, n) += a · x[0, n), x in the input type.
template <int V, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void add_scaled(acc_t* __restrict y, acc_t a, const scalar_t* __restrict x, int64_t n) {
  int64_t e = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    for (; e + V <= n; e += V) vstore<V>(y + e, vload<V>(y + e) + a * vload<V>(x + e));
  }
  for (; e < n; ++e) y[e] += a * widen<acc_t>(x[e]);
}

// Every head's softmax numerators e^(logit - max) in the logits' place ([Mg, K], vectors of samples), and their
// sums in sample order.
template <int V, typename acc_t>
MEGASLIDE_DSA_INLINE void numerators(acc_t* logits, int64_t K, int64_t Mg, const acc_t* max, acc_t* sum) {
  for (int64_t h = 0; h < Mg; ++h) {
    acc_t* prob = logits + h * K;
    exponentiate<V>(prob, K, max[h]);
    acc_t total = 0;
    for (int64_t j = 0; j < K; ++j) total += prob[j];
    sum[h] = total;
  }
}

// sums[i] = q · row[i] over d channels (a multiple of 16) for eight bf16 rows, q in bf16 as well: VDPBF16PS
// multiplies 32 (16) bf16 pairs, each product exact in fp32 (two 8-bit significands), and adds each lane's two
// products to its fp32 sum (rounding to nearest, subnormal inputs and results read and written as zero); the eight
// rows' lane sums are then reduced together (sum8). One instruction for 32 channels where the widening loop takes
// two loads with their shifts and two FMAs.
#define MEGASLIDE_DSA_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
MEGASLIDE_DSA_AVX512BF16 MEGASLIDE_DSA_INLINE void bf16_dots8(const c10::BFloat16* const* row, const c10::BFloat16* q,
                                                              int64_t d, float* sums) {
  if (d % 32 == 0) {
    __m512 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + e);
      for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(row[i] + e), qv);
    }
    typename Lanes<16>::F f[8];
    std::memcpy(f, a, sizeof f);
    sum8(f, sums);
  } else {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e += 16) {
      const __m256bh qv = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + e));
      for (int i = 0; i < 8; ++i)
        a[i] = _mm256_dpbf16_ps(a[i], (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[i] + e)), qv);
    }
    typename Lanes<8>::F f[8];
    std::memcpy(f, a, sizeof f);
    sum8(f, sums);
  }
}

// row_head_dots below for bf16 rows and q and d a multiple of 16, every row by bf16_dots8, eight at a time (the last
// block filled up with its first row, whose extra sums are dropped). Its own function with the AVX512-BF16 target
// (called once per token, group and direction): GCC inlines an always-inline function only into a caller whose target
// includes the callee's, and the loops it is called from have no target of their own (only their entry point has
// one), so the intrinsics inlined there would fail to compile.
MEGASLIDE_DSA_AVX512BF16 __attribute__((noinline)) void bf16_row_head_dots(const c10::BFloat16* base,
                                                                           const int64_t* rows, int64_t R,
                                                                           int64_t stride, const c10::BFloat16* q_in,
                                                                           int64_t d, int64_t Mg, float* out) {
  for (int64_t r0 = 0; r0 < R; r0 += 8) {
    const int64_t n = std::min<int64_t>(8, R - r0);
    const c10::BFloat16* row[8];
    for (int i = 0; i < 8; ++i) row[i] = base + rows[r0 + (i < n ? i : 0)] * stride;
    for (int64_t h = 0; h < Mg; ++h) {
      const c10::BFloat16* head_row[8];
      for (int i = 0; i < 8; ++i) head_row[i] = row[i] + h * d;
      float sums[8];
      bf16_dots8(head_row, q_in + h * d, d, sums);
      for (int i = 0; i < n; ++i) out[(r0 + i) * Mg + h] = sums[i];
    }
  }
}

// out[r·Mg + h] = q_h · row r's head h, for the distinct rows `rows` (token indices; row r starts at
// base + rows[r]·stride) and the Mg heads of d channels (qf: q in acc_t; q_in: the same q in the input type).
// kBf16Dots with bf16 inputs and d a multiple of 16: bf16_row_head_dots from q_in. Otherwise, with d a multiple of the
// vector width (8 or 16 lanes), eight rows run side by side per head, their sums reduced together (sum8), the rest row
// by row (head_dot).
template <int V, bool kBf16Dots, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void row_head_dots(const scalar_t* base, const int64_t* rows, int64_t R, int64_t stride,
                                        const acc_t* qf, const scalar_t* q_in, int64_t d, int64_t Mg, acc_t* out) {
  int64_t r0 = 0;
  if constexpr (kBf16Dots && std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (d % 16 == 0) return bf16_row_head_dots(base, rows, R, stride, q_in, d, Mg, out);
  }
  if constexpr (std::is_same_v<acc_t, float> && V >= 8) {
    if (d % V == 0) {
      using F = typename Lanes<V>::F;
      for (; r0 + 8 <= R; r0 += 8) {
        const scalar_t* row[8];
        for (int i = 0; i < 8; ++i) row[i] = base + rows[r0 + i] * stride;
        for (int64_t h = 0; h < Mg; ++h) {
          F a[8] = {};
          for (int64_t e = h * d; e < (h + 1) * d; e += V) {
            const F qv = vload<V>(qf + e);
            for (int i = 0; i < 8; ++i) a[i] += vload<V>(row[i] + e) * qv;
          }
          float sums[8];
          sum8(a, sums);
          for (int i = 0; i < 8; ++i) out[(r0 + i) * Mg + h] = sums[i];
        }
      }
    }
  }
  for (; r0 < R; ++r0)
    for (int64_t h = 0; h < Mg; ++h) out[r0 * Mg + h] = head_dot<V>(base + rows[r0] * stride + h * d, qf + h * d, d);
}

// acc[0, L) = Σ_r coef[r·Mg + h] · row r over the distinct rows, each head h on its d channels, rows in slot order.
// With d a multiple of V the sums stay in registers, kBlock vectors of channels at a time over all rows.
template <int V, int kBlock, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void rows_weighted_sum(const scalar_t* base, const int64_t* rows, int64_t R, int64_t stride,
                                            const acc_t* coef, int64_t d, int64_t Mg, acc_t* __restrict acc) {
  const int64_t L = Mg * d;
  if constexpr (std::is_same_v<acc_t, float> && std::is_same_v<scalar_t, c10::BFloat16> && V >= 8) {
    if (d % (2 * V) == 0) {
      // bf16 rows, 2V channels of one head a load (vload_pairs): the even and odd channels' sums apart, kBlock / 2
      // pairs of vectors at a time, interleaved when stored. Per channel the same products in the same order.
      using F = typename Lanes<V>::F;
      constexpr int kPairs = kBlock / 2 > 0 ? kBlock / 2 : 1;
      int64_t e = 0;
      const auto pairs = [&](auto nb) __attribute__((always_inline)) {
        constexpr int NB = decltype(nb)::value;
        int64_t head[NB];
        for (int b = 0; b < NB; ++b) head[b] = (e + 2 * b * V) / d;
        F even[NB], odd[NB];
        for (int b = 0; b < NB; ++b) even[b] = odd[b] = F{};
        for (int64_t r = 0; r < R; ++r) {
          const scalar_t* row = base + rows[r] * stride + e;
          const acc_t* c = coef + r * Mg;
          for (int b = 0; b < NB; ++b) {
            F x0, x1;
            vload_pairs<V>(row + 2 * b * V, x0, x1);
            even[b] += c[head[b]] * x0;
            odd[b] += c[head[b]] * x1;
          }
        }
        for (int b = 0; b < NB; ++b) vstore_pairs<V>(acc + e + 2 * b * V, even[b], odd[b]);
      };
      for (; e + 2 * kPairs * V <= L; e += 2 * kPairs * V) pairs(std::integral_constant<int, kPairs>{});
      for (; e < L; e += 2 * V) pairs(std::integral_constant<int, 1>{});
      return;
    }
  }
  if constexpr (std::is_same_v<acc_t, float>) {
    if (d % V == 0) {
      using F = typename Lanes<V>::F;
      int64_t e = 0;
      // nb vectors from channel e on, each with its head's coefficient of the row.
      const auto vectors = [&](auto nb) __attribute__((always_inline)) {
        constexpr int NB = decltype(nb)::value;
        int64_t head[NB];
        for (int b = 0; b < NB; ++b) head[b] = (e + b * V) / d;
        F a[NB];
        for (int b = 0; b < NB; ++b) a[b] = F{};
        for (int64_t r = 0; r < R; ++r) {
          const scalar_t* row = base + rows[r] * stride + e;
          const acc_t* c = coef + r * Mg;
          for (int b = 0; b < NB; ++b) a[b] += c[head[b]] * vload<V>(row + b * V);
        }
        for (int b = 0; b < NB; ++b) vstore<V>(acc + e + b * V, a[b]);
      };
      for (; e + kBlock * V <= L; e += kBlock * V) vectors(std::integral_constant<int, kBlock>{});
      for (; e < L; e += V) vectors(std::integral_constant<int, 1>{});
      return;
    }
  }
  for (int64_t e = 0; e < L; ++e) acc[e] = acc_t(0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < Mg; ++h) add_scaled<V>(acc + h * d, coef[r * Mg + h], base + rows[r] * stride + h * d, d);
}

// The forward of one (token, group) by distinct corner rows, for L >= kCpuForwardRowsMinChannels: (1) q·k of every
// head for each distinct key row; (2) per sample and head the logit from its corners' products (Σ_c w_c·(q·k_c),
// the backward's form), the softmax numerators against each head's maximum, and per distinct row the sum of
// numerator·w over the samples and corners that name it; (3) the value rows weighted by those sums. Each key and
// value row is read once per token, not once per sample and corner. logits: [Mg, K], the numerators on return.
template <int V, int kBlock, bool kBf16Dots, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void forward_rows(const Dsa3dShape& s, const Point<acc_t>* points, CornerRows& table,
                                       std::vector<int32_t>& corner_slot, std::vector<acc_t>& row_values,
                                       const scalar_t* kb, const scalar_t* vb, const acc_t* qf, const scalar_t* q_in,
                                       const acc_t* bias, int64_t head0, acc_t scale, acc_t* logits, acc_t* max,
                                       acc_t* sum, acc_t* acc) {
  const int64_t M = s.M, d = s.d, K = s.K, Mg = s.M / s.G, stride = M * d;
  table.begin();
  for (int64_t j = 0; j < K; ++j) {
    bool live[8];
    for (int c = 0; c < 8; ++c) live[c] = points[j].weight[c] != acc_t(0);
    table.slots(points[j].index, live, corner_slot.data() + j * 8);
  }
  const int64_t R = table.count;
  row_values.assign(2 * R * Mg, acc_t(0));
  acc_t* qk_r = row_values.data();  // per slot and head: q·k, then the value rows' coefficients
  acc_t* cv_r = qk_r + R * Mg;
  row_head_dots<V, kBf16Dots>(kb, table.rows.data(), R, stride, qf, q_in, d, Mg, qk_r);
  for (int64_t h = 0; h < Mg; ++h) max[h] = -INFINITY;
  int64_t h4 = 0;  // heads [0, h4) four at a time in 4-lane vectors, the same sums per lane
  if constexpr (std::is_same_v<acc_t, float>) {
    using F4 = typename Lanes<4>::F;
    for (; h4 + 4 <= Mg; h4 += 4) {
      F4 mx = F4{} - INFINITY;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t* slots = corner_slot.data() + j * 8;
        F4 l = {};
        for (int c = 0; c < 8; ++c)
          if (slots[c] >= 0) l += points[j].weight[c] * vload<4>(qk_r + slots[c] * Mg + h4);
        l *= scale;
        if (bias)
          for (int i = 0; i < 4; ++i) l[i] += bias[(head0 + h4 + i) * K + j];
        for (int i = 0; i < 4; ++i) logits[(h4 + i) * K + j] = l[i];
        mx = l > mx ? l : mx;
      }
      for (int i = 0; i < 4; ++i) max[h4 + i] = mx[i];
    }
  }
  for (int64_t j = 0; j < K; ++j) {
    const int32_t* slots = corner_slot.data() + j * 8;
    for (int64_t h = h4; h < Mg; ++h) {
      acc_t qk[8];
      for (int c = 0; c < 8; ++c) qk[c] = slots[c] < 0 ? acc_t(0) : qk_r[slots[c] * Mg + h];
      const acc_t logit =
          dsa3d_math::corner_sum(points[j].weight, qk) * scale + (bias ? bias[(head0 + h) * K + j] : acc_t(0));
      logits[h * K + j] = logit;
      max[h] = logit > max[h] ? logit : max[h];
    }
  }
  numerators<V>(logits, K, Mg, max, sum);
  for (int64_t j = 0; j < K; ++j) {
    const int32_t* slots = corner_slot.data() + j * 8;
    if constexpr (std::is_same_v<acc_t, float>) {
      using F4 = typename Lanes<4>::F;
      for (int64_t h = 0; h < h4; h += 4) {
        F4 prob;
        for (int i = 0; i < 4; ++i) prob[i] = logits[(h + i) * K + j];
        for (int c = 0; c < 8; ++c)
          if (slots[c] >= 0) {
            float* cv = cv_r + slots[c] * Mg + h;
            vstore<4>(cv, vload<4>(cv) + prob * points[j].weight[c]);
          }
      }
    }
    for (int64_t h = h4; h < Mg; ++h) {
      const acc_t prob = logits[h * K + j];
      for (int c = 0; c < 8; ++c)
        if (slots[c] >= 0) cv_r[slots[c] * Mg + h] += prob * points[j].weight[c];
    }
  }
  rows_weighted_sum<V, kBlock>(vb, table.rows.data(), R, stride, cv_r, d, Mg, acc);
}

// Forward of tokens [begin, end), every offset group: per (token, group) the K samples are computed once and
// serve all the group's heads at once; by distinct corner rows (forward_rows) from kCpuForwardRowsMinChannels,
// else per sample: two passes over the samples, the logits of every head (q against the interpolated key row),
// then the exponentials against each head's maximum, weighting the interpolated value rows. One exponential per
// (head, sample) either way.
template <typename scalar_t, typename acc_t, int V, int kBlock, bool kBf16Dots>
MEGASLIDE_DSA_INLINE void forward_tokens(const Dsa3dForwardParams& p, int64_t begin, int64_t end) {
  const Dsa3dShape& s = p.shape;
  const int64_t N = s.tokens(), M = s.M, d = s.d, K = s.K, Mg = s.M / s.G, L = Mg * d;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const auto* offsets = static_cast<const acc_t*>(p.offsets);
  const auto* bias = static_cast<const acc_t*>(p.bias);
  auto* out = static_cast<scalar_t*>(p.out);
  auto* lse = static_cast<acc_t*>(p.lse);
  const acc_t scale = static_cast<acc_t>(s.scale);

  std::vector<Point<acc_t>> samples(K);
  std::vector<acc_t> qf(L), row(L), acc(L), prob_lanes(L), logits(Mg * K), max(Mg), sum(Mg);
  const std::vector<scalar_t> zero_row(L, scalar_t(0));
  const bool by_rows = L >= kCpuForwardRowsMinChannels;
  std::unique_ptr<CornerRows> table = by_rows ? std::make_unique<CornerRows>(N, 8 * K) : nullptr;
  std::vector<int32_t> corner_slot(by_rows ? K * 8 : 0);
  std::vector<acc_t> row_values;
  for (int64_t bn = begin; bn < end; ++bn) {
    const TokenCoord tc = coord_of(s, bn);
    for (int64_t g = 0; g < s.G; ++g) {
      group_points(s, offsets, tc, bn, g, samples.data());
      const int64_t head0 = g * Mg;
      const scalar_t* kb = k + (tc.b * N * M + head0) * d;  // corner c's row: kb + index·M·d
      const scalar_t* vb = v + (tc.b * N * M + head0) * d;
      const scalar_t* q_in = q + (bn * M + head0) * d;
      load(q_in, qf.data(), L);
      if (by_rows) {
        forward_rows<V, kBlock, kBf16Dots>(s, samples.data(), *table, corner_slot, row_values, kb, vb, qf.data(), q_in,
                                           bias, head0, scale, logits.data(), max.data(), sum.data(), acc.data());
      } else {
        for (int64_t h = 0; h < Mg; ++h) max[h] = -INFINITY;
        for (int64_t j = 0; j < K; ++j) {
          interpolate<V, kBlock>(kb, samples[j], M * d, L, zero_row.data(), row.data());
          for (int64_t h = 0; h < Mg; ++h) {
            const acc_t logit = head_dot<V>(row.data() + h * d, qf.data() + h * d, d) * scale +
                                (bias ? bias[(head0 + h) * K + j] : acc_t(0));
            logits[h * K + j] = logit;
            max[h] = logit > max[h] ? logit : max[h];
          }
        }
        numerators<V>(logits.data(), K, Mg, max.data(), sum.data());
        for (int64_t e = 0; e < L; ++e) acc[e] = acc_t(0);
        for (int64_t j = 0; j < K; ++j) {
          for (int64_t h = 0; h < Mg; ++h)
            for (int64_t c = 0; c < d; ++c) prob_lanes[h * d + c] = logits[h * K + j];
          interpolate<V, kBlock, /*kAccumulate=*/true>(vb, samples[j], M * d, L, zero_row.data(), acc.data(),
                                                       prob_lanes.data());
        }
      }
      scalar_t* o = out + (bn * M + head0) * d;
      for (int64_t h = 0; h < Mg; ++h) {
        const acc_t inv_sum = acc_t(1) / sum[h];
        for (int64_t c = 0; c < d; ++c) o[h * d + c] = static_cast<scalar_t>(acc[h * d + c] * inv_sum);
        lse[bn * M + head0 + h] = max[h] + dsa3d_math::log_of(sum[h]);
      }
    }
  }
}

// One head's per-sample terms from its 8 corner products qk and odv (the scalar loops'): the logit (bias: this head's
// and sample's, or null), the probability from the saved log-sum-exp, the logit gradient into *dbias (or null), the
// position gradient added into dx_sample; returns the probability and dq's coefficient (dlogit · scale).
template <typename acc_t>
struct HeadTerms {
  acc_t prob, dq_coef;
};
template <typename acc_t>
MEGASLIDE_DSA_INLINE HeadTerms<acc_t> head_sample_terms(const Sample<acc_t>& sp, const acc_t* qk, const acc_t* odv,
                                                        acc_t scale, const acc_t* bias, acc_t lse, acc_t dout_dot_out,
                                                        acc_t* dbias, acc_t* dx_sample) {
  const acc_t logit = dsa3d_math::corner_sum(sp.weight, qk) * scale + (bias ? *bias : acc_t(0));
  const auto grad = dsa3d_math::sample_grad(logit, lse, dsa3d_math::corner_sum(sp.weight, odv), dout_dot_out);
  const acc_t dq_coef = grad.dlogit * scale;
  if (dbias) *dbias += grad.dlogit;
  dsa3d_math::add_position_grad(sp, qk, odv, dq_coef, grad.prob, dx_sample);
  return {grad.prob, dq_coef};
}

// The backward of one (token, group) by distinct corner rows, for L >= kCpuBackwardRowsMinChannels: (1) q·k and
// dout·v of every head for each distinct row; (2) per sample, from those, the logits, softmax gradients, dbias and
// the position gradients, summing each row's coefficients over the samples and corners that name it (dq_coef·w for
// dq and dk, prob·w for dv); heads four at a time in vectors; (3) dq = Σ_rows coef·k with its sums in registers,
// then per distinct row dk += coef·q, dv += coef·dout. The same sums as the per-sample loop, grouped by row (in a
// different order): each row is read (and dk, dv written) once per token, not once per sample and corner.
template <int V, int kBlock, bool kBf16Dots, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void backward_rows(const Dsa3dShape& s, const Sample<acc_t>* samples, CornerRows& table,
                                        std::vector<int32_t>& corner_slot, std::vector<acc_t>& row_dots,
                                        const scalar_t* kb, const scalar_t* vb, acc_t* dkb, acc_t* dvb, const acc_t* qf,
                                        const acc_t* dof, const scalar_t* q_in, const scalar_t* dout_in, acc_t* dqf,
                                        const acc_t* dout_dot_out, const acc_t* bias, const acc_t* lse_token,
                                        int64_t head0, acc_t scale, acc_t* dbias, acc_t* dx) {
  const int64_t M = s.M, d = s.d, K = s.K, Mg = s.M / s.G, stride = M * d;
  table.begin();
  for (int64_t j = 0; j < K; ++j) {
    bool live[8];
    for (int c = 0; c < 8; ++c) live[c] = !dsa3d_math::corner_is_inert(samples[j], c);
    table.slots(samples[j].index, live, corner_slot.data() + j * 8);
  }
  const int64_t R = table.count;
  // Per slot and head: q·k, dout·v, then the coefficients of dq/dk and of dv.
  row_dots.assign(4 * R * Mg, acc_t(0));
  acc_t* qk_r = row_dots.data();
  acc_t* odv_r = qk_r + R * Mg;
  acc_t* cq_r = odv_r + R * Mg;
  acc_t* cv_r = cq_r + R * Mg;
  row_head_dots<V, kBf16Dots>(kb, table.rows.data(), R, stride, qf, q_in, d, Mg, qk_r);
  row_head_dots<V, kBf16Dots>(vb, table.rows.data(), R, stride, dof, dout_in, d, Mg, odv_r);
  for (int64_t j = 0; j < K; ++j) {
    const Sample<acc_t>& sp = samples[j];
    const int32_t* slots = corner_slot.data() + j * 8;
    acc_t dx_sample[3] = {0, 0, 0};
    int64_t h4 = 0;  // heads [0, h4) four at a time in 4-lane vectors, then one by one
    if constexpr (std::is_same_v<acc_t, float>) {
      using F4 = typename Lanes<4>::F;
      F4 dx4[3] = {};
      for (; h4 + 4 <= Mg; h4 += 4) {
        F4 qk[8], odv[8];
        for (int c = 0; c < 8; ++c) {
          qk[c] = slots[c] < 0 ? F4{} : vload<4>(qk_r + slots[c] * Mg + h4);
          odv[c] = slots[c] < 0 ? F4{} : vload<4>(odv_r + slots[c] * Mg + h4);
        }
        F4 logit = {}, dout_dot_v = {};
        for (int c = 0; c < 8; ++c) logit += sp.weight[c] * qk[c];
        for (int c = 0; c < 8; ++c) dout_dot_v += sp.weight[c] * odv[c];
        logit *= scale;
        if (bias)
          for (int i = 0; i < 4; ++i) logit[i] += bias[(head0 + h4 + i) * K + j];
        const F4 prob = exp_lanes<4>(logit - vload<4>(lse_token + h4));
        const F4 dlogit = prob * (dout_dot_v - vload<4>(dout_dot_out + h4));
        const F4 dq_coef = dlogit * scale;
        if (dbias)
          for (int i = 0; i < 4; ++i) dbias[(head0 + h4 + i) * K + j] += dlogit[i];
        for (int c = 0; c < 8; ++c) {
          const F4 g = dq_coef * qk[c] + prob * odv[c];
          for (int a = 0; a < 3; ++a) dx4[a] += sp.dweight[a][c] * g;
        }
        for (int c = 0; c < 8; ++c) {
          if (sp.weight[c] == acc_t(0)) continue;
          float* cq = cq_r + slots[c] * Mg + h4;
          float* cv = cv_r + slots[c] * Mg + h4;
          vstore<4>(cq, vload<4>(cq) + dq_coef * sp.weight[c]);
          vstore<4>(cv, vload<4>(cv) + prob * sp.weight[c]);
        }
      }
      for (int a = 0; a < 3; ++a) dx_sample[a] = (dx4[a][0] + dx4[a][1]) + (dx4[a][2] + dx4[a][3]);
    }
    for (int64_t h = h4; h < Mg; ++h) {
      const int64_t m = head0 + h;
      acc_t qk[8], odv[8];
      for (int c = 0; c < 8; ++c) {
        qk[c] = slots[c] < 0 ? acc_t(0) : qk_r[slots[c] * Mg + h];
        odv[c] = slots[c] < 0 ? acc_t(0) : odv_r[slots[c] * Mg + h];
      }
      const auto grad = head_sample_terms(sp, qk, odv, scale, bias ? bias + m * K + j : nullptr, lse_token[h],
                                          dout_dot_out[h], dbias ? dbias + m * K + j : nullptr, dx_sample);
      const acc_t dq_coef = grad.dq_coef;
      for (int c = 0; c < 8; ++c) {
        if (sp.weight[c] == acc_t(0)) continue;
        cq_r[slots[c] * Mg + h] += dq_coef * sp.weight[c];
        cv_r[slots[c] * Mg + h] += grad.prob * sp.weight[c];
      }
    }
    for (int a = 0; a < 3; ++a) dx[3 * j + a] = dx_sample[a];
  }
  rows_weighted_sum<V, kBlock>(kb, table.rows.data(), R, stride, cq_r, d, Mg, dqf);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = table.rows[r] * stride;
    for (int64_t h = 0; h < Mg; ++h) {
      const acc_t a = cq_r[r * Mg + h], b = cv_r[r * Mg + h];
      const int64_t e = h * d;
      add_scaled<V>(dkb + row + e, a, qf + e, d);
      add_scaled<V>(dvb + row + e, b, dof + e, d);
    }
  }
}

// The per-sample backward of one (token, group) with fp32 accumulation and every head's d channels in whole 8-lane
// vectors (d = 8, 16, 24, ...): the per-sample terms work on a sample's 8 corners in the 8 lanes of one vector —
// each head's q·k and dout·v of the corners (the corner rows' products side by side, reduced into one vector), the
// logit and dout·ṽ from them, the position gradient's Σ_c dweight·(dq_coef·qk + prob·odv) per lane over the heads,
// the corners' coefficients dq_coef·w and prob·w — instead of one corner or one channel at a time; then per
// channel vector the corners' dq, dk and dv terms as sample_gradients adds them (the same products, the same
// order). What differs from corner_dots and the scalar per-sample terms is only the order of four sums: each
// corner's products over the channels (sum8_lanes' tree, not sum8's), the logit's and dout·ṽ's corner sums and the
// position gradient's (trees over the lanes): within the fused kernels' tolerances, and the same on every run.
// coef: 16·Mg floats of scratch.
template <typename scalar_t>
MEGASLIDE_DSA_INLINE void backward_samples_corner_lanes(const Dsa3dShape& s, const Sample<float>* samples,
                                                        const scalar_t* kb, const scalar_t* vb, float* dkb, float* dvb,
                                                        const float* qf, const float* dof, float* dqf,
                                                        const float* dout_dot_out, const float* bias,
                                                        const float* lse_token, int64_t head0, float scale,
                                                        float* dbias, float* dx, float* coef) {
  using F = typename Lanes<8>::F;
  typedef int32_t I __attribute__((vector_size(32)));
  const int64_t M = s.M, d = s.d, K = s.K, Mg = s.M / s.G, stride = M * d;
  for (int64_t j = 0; j < K; ++j) {
    const Sample<float>& sp = samples[j];
    const F w = vload<8>(sp.weight);
    const F dw[3] = {vload<8>(sp.dweight[0]), vload<8>(sp.dweight[1]), vload<8>(sp.dweight[2])};
    // An inert corner's products read as 0 (its row is still a valid one, the clamped corner's), as corner_dots
    // leaves them.
    const I live = (w != 0.f) | (dw[0] != 0.f) | (dw[1] != 0.f) | (dw[2] != 0.f);
    F dx_lanes[3] = {};
    for (int64_t h = 0; h < Mg; ++h) {
      F pk[8] = {}, pv[8] = {};
      for (int64_t e = h * d; e < (h + 1) * d; e += 8) {
        const F qv = vload<8>(qf + e), dov = vload<8>(dof + e);
        for (int c = 0; c < 8; ++c) {
          const int64_t row = sp.index[c] * stride + e;
          pk[c] += vload<8>(kb + row) * qv;
          pv[c] += vload<8>(vb + row) * dov;
        }
      }
      const F qk = (F)((I)sum8_lanes(pk) & live), odv = (F)((I)sum8_lanes(pv) & live);
      const int64_t m = head0 + h;
      const float logit = vsum<8>(w * qk) * scale + (bias ? bias[m * K + j] : 0.f);
      const auto grad = dsa3d_math::sample_grad(logit, lse_token[h], vsum<8>(w * odv), dout_dot_out[h]);
      const float dq_coef = grad.dlogit * scale;
      if (dbias) dbias[m * K + j] += grad.dlogit;
      const F g = dq_coef * qk + grad.prob * odv;
      for (int a = 0; a < 3; ++a) dx_lanes[a] += dw[a] * g;
      vstore<8>(coef + 16 * h, dq_coef * w);
      vstore<8>(coef + 16 * h + 8, grad.prob * w);
    }
    for (int a = 0; a < 3; ++a) dx[3 * j + a] = vsum<8>(dx_lanes[a]);
    // Zero-weight corners (integer positions) add nothing to the rows and are skipped.
    int corner[8];
    int n = 0;
    for (int c = 0; c < 8; ++c) {
      corner[n] = c;
      n += sp.weight[c] != 0.f;
    }
    for (int64_t h = 0; h < Mg; ++h) {
      const float* cq = coef + 16 * h;
      for (int64_t e = h * d; e < (h + 1) * d; e += 8) {
        const F qv = vload<8>(qf + e), dov = vload<8>(dof + e);
        F dqv = vload<8>(dqf + e);
        for (int i = 0; i < n; ++i) {
          const int c = corner[i];
          const int64_t row = sp.index[c] * stride + e;
          const float aw = cq[c], bw = cq[8 + c];
          dqv += aw * vload<8>(kb + row);
          vstore<8>(dkb + row, vload<8>(dkb + row) + aw * qv);
          vstore<8>(dvb + row, vload<8>(dvb + row) + bw * dov);
        }
        vstore<8>(dqf + e, dqv);
      }
    }
  }
}

// The per-sample backward of one (token, group) on the other paths: per sample and corner the dot products of each
// head (corner_dots), the logits, softmax gradients, dbias and position gradients one head at a time, each head's
// coefficients copied across its channels (dq_lanes, prob_lanes: L each), then the gradient rows of all the group's
// heads in one pass over their contiguous channels (sample_gradients).
template <int V, typename scalar_t, typename acc_t>
MEGASLIDE_DSA_INLINE void backward_samples(const Dsa3dShape& s, const Sample<acc_t>* samples, const scalar_t* kb,
                                           const scalar_t* vb, acc_t* dkb, acc_t* dvb, const acc_t* qf,
                                           const acc_t* dof, acc_t* dqf, const acc_t* dout_dot_out, const acc_t* bias,
                                           const acc_t* lse_token, int64_t head0, acc_t scale, acc_t* dbias, acc_t* dx,
                                           acc_t* dq_lanes, acc_t* prob_lanes) {
  const int64_t M = s.M, d = s.d, K = s.K, Mg = s.M / s.G, L = Mg * d;
  for (int64_t j = 0; j < K; ++j) {
    const Sample<acc_t>& sp = samples[j];
    bool inert[8];
    for (int c = 0; c < 8; ++c) inert[c] = dsa3d_math::corner_is_inert(sp, c);
    acc_t dx_sample[3] = {0, 0, 0};  // summed in registers over the heads, then stored
    for (int64_t h = 0; h < Mg; ++h) {
      const int64_t m = head0 + h;
      acc_t qk[8], odv[8];
      corner_dots<V>(sp, inert, kb + h * d, vb + h * d, M * d, qf + h * d, dof + h * d, d, qk, odv);
      const auto grad = head_sample_terms(sp, qk, odv, scale, bias ? bias + m * K + j : nullptr, lse_token[h],
                                          dout_dot_out[h], dbias ? dbias + m * K + j : nullptr, dx_sample);
      const acc_t dq_coef = grad.dq_coef;
      for (int64_t c = 0; c < d; ++c) {
        dq_lanes[h * d + c] = dq_coef;
        prob_lanes[h * d + c] = grad.prob;
      }
    }
    for (int a = 0; a < 3; ++a) dx[3 * j + a] = dx_sample[a];
    sample_gradients<V>(sp, M * d, L, kb, dkb, dvb, dq_lanes, prob_lanes, qf, dof, dqf);
  }
}

// Backward of tokens [bn_begin, bn_end) for offset groups [g_begin, g_end); dk, dv ([B, N, M, d]) and
// dbias ([M, K], may be null) are accumulated into the given buffers, in token order. Per (token, group)
// the samples are computed once; by distinct corner rows (backward_rows) from kCpuBackwardRowsMinChannels, else
// per sample and corner the dot products of each head, then the gradient rows of all the group's heads in one
// pass over their contiguous channels (on AVX2 and AVX-512 with d a multiple of 8: backward_samples_corner_lanes).
template <typename scalar_t, typename acc_t, int V, int kBlock, bool kBf16Dots>
MEGASLIDE_DSA_INLINE void backward_tokens(const Dsa3dBackwardParams& p, int64_t bn_begin, int64_t bn_end,
                                          int64_t g_begin, int64_t g_end, acc_t* dk, acc_t* dv, acc_t* dbias) {
  const Dsa3dShape& s = p.shape;
  const int64_t N = s.tokens(), M = s.M, d = s.d, K = s.K, Mg = s.M / s.G, L = Mg * d;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const auto* out = static_cast<const scalar_t*>(p.out);
  const auto* dout = static_cast<const scalar_t*>(p.dout);
  const auto* offsets = static_cast<const acc_t*>(p.offsets);
  const auto* bias = static_cast<const acc_t*>(p.bias);
  const auto* lse = static_cast<const acc_t*>(p.lse);
  auto* dq = static_cast<scalar_t*>(p.dq);
  auto* doffsets = static_cast<acc_t*>(p.doffsets);
  const acc_t scale = static_cast<acc_t>(s.scale);

  std::vector<Sample<acc_t>> samples(K);
  std::vector<acc_t> qf(L), dof(L), dqf(L), dq_lanes(L), prob_lanes(L), dx(K * 3), dout_dot_out(Mg), coef(16 * Mg);
  const bool by_rows = L >= kCpuBackwardRowsMinChannels;
  // The AVX2 and AVX-512 per-sample loops with whole 8-lane heads take a sample's corners in the lanes of an 8-lane
  // vector (on AVX-512 too: 6-10 % less time at the smoke shape than its corners side by side in 16 or 8 lanes).
  constexpr bool kCornerLanes = std::is_same_v<acc_t, float> && V >= 8;
  const bool corner_lanes = kCornerLanes && d % 8 == 0;
  std::unique_ptr<CornerRows> table = by_rows ? std::make_unique<CornerRows>(N, 8 * K) : nullptr;
  std::vector<int32_t> corner_slot(by_rows ? K * 8 : 0);
  std::vector<acc_t> row_dots;
  for (int64_t bn = bn_begin; bn < bn_end; ++bn) {
    const TokenCoord tc = coord_of(s, bn);
    for (int64_t g = g_begin; g < g_end; ++g) {
      group_samples<V>(s, offsets, tc, bn, g, samples.data());
      const int64_t head0 = g * Mg, first = (bn * M + head0) * d;
      const scalar_t* kb = k + (tc.b * N * M + head0) * d;  // corner c's row: kb + index·M·d
      const scalar_t* vb = v + (tc.b * N * M + head0) * d;
      acc_t* dkb = dk + (tc.b * N * M + head0) * d;
      acc_t* dvb = dv + (tc.b * N * M + head0) * d;
      load(q + first, qf.data(), L);
      load(dout + first, dof.data(), L);
      for (int64_t e = 0; e < L; ++e) dqf[e] = acc_t(0);
      for (int64_t h = 0; h < Mg; ++h) dout_dot_out[h] = dot(out + first + h * d, dof.data() + h * d, d);
      const acc_t* lse_token = lse + bn * M + head0;
      if (by_rows) {
        backward_rows<V, kBlock, kBf16Dots>(s, samples.data(), *table, corner_slot, row_dots, kb, vb, dkb, dvb,
                                            qf.data(), dof.data(), q + first, dout + first, dqf.data(),
                                            dout_dot_out.data(), bias, lse_token, head0, scale, dbias, dx.data());
      } else if (corner_lanes) {
        if constexpr (kCornerLanes)
          backward_samples_corner_lanes(s, samples.data(), kb, vb, dkb, dvb, qf.data(), dof.data(), dqf.data(),
                                        dout_dot_out.data(), bias, lse_token, head0, scale, dbias, dx.data(),
                                        coef.data());
      } else {
        backward_samples<V>(s, samples.data(), kb, vb, dkb, dvb, qf.data(), dof.data(), dqf.data(), dout_dot_out.data(),
                            bias, lse_token, head0, scale, dbias, dx.data(), dq_lanes.data(), prob_lanes.data());
      }
      for (int64_t e = 0; e < L; ++e) dq[first + e] = static_cast<scalar_t>(dqf[e]);
      std::copy(dx.begin(), dx.end(), doffsets + (bn * s.G + g) * K * 3);
    }
  }
}

// The entry points, one per instruction set; each inlines the loops above into its own code. The AVX512-BF16 ones
// differ from the AVX-512 ones only with bf16 inputs (kBf16Dots), so only those are instantiated (token_kernels).
#define MEGASLIDE_DSA_TOKENS(suffix, target_attr, lanes, block, bf16_dots)                                         \
  template <typename scalar_t, typename acc_t>                                                                     \
  target_attr void forward_tokens_##suffix(const Dsa3dForwardParams& p, int64_t begin, int64_t end) {              \
    forward_tokens<scalar_t, acc_t, lanes, block, bf16_dots>(p, begin, end);                                       \
  }                                                                                                                \
  template <typename scalar_t, typename acc_t>                                                                     \
  target_attr void backward_tokens_##suffix(const Dsa3dBackwardParams& p, int64_t bn_begin, int64_t bn_end,        \
                                            int64_t g_begin, int64_t g_end, acc_t* dk, acc_t* dv, acc_t* dbias) {  \
    backward_tokens<scalar_t, acc_t, lanes, block, bf16_dots>(p, bn_begin, bn_end, g_begin, g_end, dk, dv, dbias); \
  }
#define MEGASLIDE_DSA_ENTRY(suffix, target_attr, lanes, block)                                    \
  MEGASLIDE_DSA_TOKENS(suffix, target_attr, lanes, block, false)                                  \
  target_attr void exp_##suffix(float* x, int64_t n) { exponentiate<lanes>(x, n, 0.f); }          \
  target_attr void sample_##suffix(float xt, float xh, float xw, int64_t T, int64_t H, int64_t W, \
                                   Sample<float>& out) {                                          \
    sample_at<lanes>(xt, xh, xw, T, H, W, out);                                                   \
  }
MEGASLIDE_DSA_ENTRY(baseline, , 4, 8)
MEGASLIDE_DSA_ENTRY(avx2, __attribute__((target("avx2,fma,f16c"))), 8, 8)
MEGASLIDE_DSA_ENTRY(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), 16, 8)
MEGASLIDE_DSA_TOKENS(avx512bf16, MEGASLIDE_DSA_AVX512BF16, 16, 8, true)
#undef MEGASLIDE_DSA_ENTRY
#undef MEGASLIDE_DSA_TOKENS
#undef MEGASLIDE_DSA_AVX512BF16

std::atomic<Dsa3dCpuIsa> forced_isa{Dsa3dCpuIsa::kAuto};

bool cpu_supports(Dsa3dCpuIsa isa) {
  switch (isa) {
    case Dsa3dCpuIsa::kAvx512Bf16:
      return cpu_has_avx512_bf16() && cpu_has_avx2();
    case Dsa3dCpuIsa::kAvx512:
      return cpu_has_avx512() && cpu_has_avx2();
    case Dsa3dCpuIsa::kAvx2:
      return cpu_has_avx2();
    default:
      return true;
  }
}

// The entry points of the instruction set in use.
template <typename scalar_t, typename acc_t>
struct TokenKernels {
  void (*forward)(const Dsa3dForwardParams&, int64_t, int64_t);
  void (*backward)(const Dsa3dBackwardParams&, int64_t, int64_t, int64_t, int64_t, acc_t*, acc_t*, acc_t*);
};

template <typename scalar_t, typename acc_t>
TokenKernels<scalar_t, acc_t> token_kernels() {
  switch (dsa3d_cpu_isa()) {
    case Dsa3dCpuIsa::kAvx512Bf16:
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
        return {forward_tokens_avx512bf16<scalar_t, acc_t>, backward_tokens_avx512bf16<scalar_t, acc_t>};
      [[fallthrough]];
    case Dsa3dCpuIsa::kAvx512:
      return {forward_tokens_avx512<scalar_t, acc_t>, backward_tokens_avx512<scalar_t, acc_t>};
    case Dsa3dCpuIsa::kAvx2:
      return {forward_tokens_avx2<scalar_t, acc_t>, backward_tokens_avx2<scalar_t, acc_t>};
    default:
      return {forward_tokens_baseline<scalar_t, acc_t>, backward_tokens_baseline<scalar_t, acc_t>};
  }
}

template <typename scalar_t, typename acc_t>
void forward_impl(const Dsa3dForwardParams& p) {
  const auto tokens = token_kernels<scalar_t, acc_t>().forward;
  at::parallel_for(0, p.shape.B * p.shape.tokens(), 1, [&](int64_t begin, int64_t end) { tokens(p, begin, end); });
}

// dst[i] += parts[0][i] + parts[1][i] + ... in that order.
template <typename acc_t>
void add_in_order(acc_t* dst, const std::vector<acc_t*>& parts, int64_t numel) {
  if (parts.empty()) return;
  at::parallel_for(0, numel, 1 << 15, [&](int64_t begin, int64_t end) {
    for (const acc_t* part : parts)
      for (int64_t i = begin; i < end; ++i) dst[i] += part[i];
  });
}

template <typename scalar_t, typename acc_t>
void backward_impl(const Dsa3dBackwardParams& p) {
  const Dsa3dShape& s = p.shape;
  const int64_t BN = s.B * s.tokens(), volume = BN * s.M * s.d, bias_numel = s.M * s.K;
  auto* dk = static_cast<acc_t*>(p.dk);
  auto* dv = static_cast<acc_t*>(p.dv);
  auto* dbias = static_cast<acc_t*>(p.dbias);
  auto* scratch = static_cast<acc_t*>(p.cpu_scratch);
  const auto tokens = token_kernels<scalar_t, acc_t>().backward;

  if (p.deterministic) {
    // Unit (b, g) owns dq/doffsets of its tokens and the dk/dv/dbias rows of group g's heads; batch
    // entry b > 0 adds its dbias into scratch part b - 1.
    std::vector<acc_t*> dbias_parts;
    for (int64_t b = 1; dbias && b < s.B; ++b) dbias_parts.push_back(scratch + (b - 1) * bias_numel);
    at::parallel_for(0, s.B * s.G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / s.G, g = u % s.G;
        acc_t* dbias_b = !dbias ? nullptr : b == 0 ? dbias : dbias_parts[b - 1];
        tokens(p, b * s.tokens(), (b + 1) * s.tokens(), g, g + 1, dk, dv, dbias_b);
      }
    });
    if (dbias) add_in_order(dbias, dbias_parts, bias_numel);
    return;
  }

  // Chunk c > 0 accumulates into scratch part c - 1: [dk | dv | dbias].
  const int64_t chunks = std::max<int64_t>(1, std::min(p.cpu_chunks, BN));
  std::vector<acc_t*> dk_parts, dv_parts, dbias_parts;
  for (int64_t c = 1; c < chunks; ++c) {
    acc_t* part = scratch + (c - 1) * (2 * volume + bias_numel);
    dk_parts.push_back(part);
    dv_parts.push_back(part + volume);
    dbias_parts.push_back(part + 2 * volume);
  }
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t bn_begin = BN * c / chunks, bn_end = BN * (c + 1) / chunks;
      acc_t* dk_c = c == 0 ? dk : dk_parts[c - 1];
      acc_t* dv_c = c == 0 ? dv : dv_parts[c - 1];
      acc_t* dbias_c = !dbias ? nullptr : c == 0 ? dbias : dbias_parts[c - 1];
      tokens(p, bn_begin, bn_end, 0, s.G, dk_c, dv_c, dbias_c);
    }
  });
  add_in_order(dk, dk_parts, volume);
  add_in_order(dv, dv_parts, volume);
  if (dbias) add_in_order(dbias, dbias_parts, bias_numel);
}

}  // namespace

void set_dsa3d_cpu_isa(Dsa3dCpuIsa isa) {
  if (!cpu_supports(isa))
    throw std::invalid_argument(std::string("3D-DSA CPU kernels: this CPU lacks ") + to_string(isa));
  forced_isa.store(isa);
}

Dsa3dCpuIsa dsa3d_cpu_isa() {
  const Dsa3dCpuIsa forced = forced_isa.load();
  if (forced != Dsa3dCpuIsa::kAuto) return forced;
  static const Dsa3dCpuIsa widest = cpu_supports(Dsa3dCpuIsa::kAvx512Bf16) ? Dsa3dCpuIsa::kAvx512Bf16
                                    : cpu_supports(Dsa3dCpuIsa::kAvx512)   ? Dsa3dCpuIsa::kAvx512
                                    : cpu_supports(Dsa3dCpuIsa::kAvx2)     ? Dsa3dCpuIsa::kAvx2
                                                                           : Dsa3dCpuIsa::kBaseline;
  return widest;
}

Dsa3dCpuIsa dsa3d_cpu_loops(DsaDtype dtype) {
  const Dsa3dCpuIsa isa = dsa3d_cpu_isa();
  return isa == Dsa3dCpuIsa::kAvx512Bf16 && dtype != DsaDtype::kBFloat16 ? Dsa3dCpuIsa::kAvx512 : isa;
}

const char* to_string(Dsa3dCpuIsa isa) {
  switch (isa) {
    case Dsa3dCpuIsa::kAuto:
      return "auto";
    case Dsa3dCpuIsa::kBaseline:
      return "baseline";
    case Dsa3dCpuIsa::kAvx2:
      return "avx2";
    case Dsa3dCpuIsa::kAvx512:
      return "avx512";
    case Dsa3dCpuIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "?";
}

void dsa3d_cpu_exp(float* x, int64_t n) {
  switch (dsa3d_cpu_loops(DsaDtype::kFloat32)) {  // float: the AVX512-BF16 path's are the AVX-512 loops
    case Dsa3dCpuIsa::kAvx512:
      return exp_avx512(x, n);
    case Dsa3dCpuIsa::kAvx2:
      return exp_avx2(x, n);
    default:
      return exp_baseline(x, n);
  }
}

void dsa3d_cpu_sample(float xt, float xh, float xw, int64_t T, int64_t H, int64_t W, dsa3d_math::Sample<float>& out) {
  switch (dsa3d_cpu_loops(DsaDtype::kFloat32)) {  // float: the AVX512-BF16 path's are the AVX-512 loops
    case Dsa3dCpuIsa::kAvx512:
      return sample_avx512(xt, xh, xw, T, H, W, out);
    case Dsa3dCpuIsa::kAvx2:
      return sample_avx2(xt, xh, xw, T, H, W, out);
    default:
      return sample_baseline(xt, xh, xw, T, H, W, out);
  }
}

void dsa3d_forward_cpu(const Dsa3dForwardParams& p) {
  dispatch_dtype<c10::BFloat16, c10::Half>(
      p.shape.dtype, [&](auto scalar, auto acc) { forward_impl<decltype(scalar), decltype(acc)>(p); });
}

void dsa3d_backward_cpu(const Dsa3dBackwardParams& p) {
  dispatch_dtype<c10::BFloat16, c10::Half>(
      p.shape.dtype, [&](auto scalar, auto acc) { backward_impl<decltype(scalar), decltype(acc)>(p); });
}

}  // namespace megaslide::ops::detail
