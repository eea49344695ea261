// The per-sample arithmetic of 3D-DSA (DESIGN.md §5, docs/3d-dsa.md), shared by the fused CPU backend
// (src/attention/dsa3d_cpu.cpp) and the CUDA backend (kernels/dsa3d.cu). Everything here is a
// `__host__ __device__` inline function of scalars, so the arithmetic the GPU runs is the arithmetic
// the CPU tests check. Plain C++ when __CUDACC__ is not defined. No LibTorch, no allocation.
//
// acc_t is the accumulation type: float for float32/bfloat16/float16 inputs, double for float64.
//
// Conventions, chosen so the fused kernels equal the grid_sample reference (src/attention/dsa3d.cpp)
// value for value and gradient for gradient:
//   - window start per axis: start(p) = clamp(p - ⌊k/2⌋, 0, S - k) (k is the effective kernel ≤ S);
//   - sample position per axis: x = start + r + Δ, P = clamp(x, 0, S - 1);
//   - trilinear corners are floor-based: i0 = ⌊P⌋, i1 = min(i0 + 1, S - 1), f = P - i0;
//   - the gradient reaching x is ∂value/∂P · ∂P/∂x where torch::clamp passes the gradient for
//     0 ≤ x ≤ S-1 (inclusive) and grid_sample's border padding treats P = 0 and P = S-1 as outside
//     (zero gradient; ATen's clip_coordinates_set_grad). The product: gradient iff 0 < x < S-1.
//     Inside, ∂value/∂P uses the floor-based corners, so at an integer x the right difference
//     v[x+1] - v[x] (grid_sample's convention).
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define MEGASLIDE_HD __host__ __device__ __forceinline__
#else
#define MEGASLIDE_HD inline
#endif

namespace megaslide::dsa3d_math {

MEGASLIDE_HD float floor_of(float x) { return floorf(x); }
MEGASLIDE_HD double floor_of(double x) { return floor(x); }
MEGASLIDE_HD float exp_of(float x) { return expf(x); }
MEGASLIDE_HD double exp_of(double x) { return exp(x); }
MEGASLIDE_HD float log_of(float x) { return logf(x); }
MEGASLIDE_HD double log_of(double x) { return log(x); }

// First index of the regular k-window of the token at p on an axis of length S (k <= S). Index types:
// int64_t for the per-sample kernels, int for the tile kernels (dsa3d_tile.h), the same rule.
template <typename index_t>
MEGASLIDE_HD index_t window_start(index_t p, index_t k, index_t S) {
  index_t s = p - k / 2;
  s = s < 0 ? 0 : s;
  return s > S - k ? S - k : s;
}

// Regular offsets r_j of sample j, row-major over (kt, kh, kw).
MEGASLIDE_HD void regular_offset(int64_t j, int64_t kh, int64_t kw, int64_t& rt, int64_t& rh, int64_t& rw) {
  rw = j % kw;
  rh = (j / kw) % kh;
  rt = j / (kw * kh);
}

// One axis of a sample at the unclamped position x on an axis of length S.
template <typename acc_t, typename index_t = int64_t>
struct AxisSample {
  index_t i0, i1;  // corner indices (i1 == i0 at the upper border)
  acc_t w0, w1;    // linear weights, w0 + w1 = 1
  acc_t dw;        // ∂w1/∂x = -∂w0/∂x: 1 when 0 < x < S-1, else 0 (see the file comment)
};

template <typename acc_t, typename index_t = int64_t>
MEGASLIDE_HD AxisSample<acc_t, index_t> sample_axis(acc_t x, index_t S) {
  const acc_t hi = acc_t(S - 1);
  acc_t P = x < acc_t(0) ? acc_t(0) : x;
  P = P > hi ? hi : P;
  AxisSample<acc_t, index_t> a;
  const acc_t f0 = floor_of(P);
  // A NaN position reads token 0 with NaN weights: the result is NaN, as the reference's, and no
  // index is ever formed from a NaN.
  a.i0 = (P >= acc_t(0) && P <= hi) ? index_t(f0) : 0;
  a.i1 = a.i0 + 1 < S ? a.i0 + 1 : S - 1;
  const acc_t f = P - f0;
  a.w0 = acc_t(1) - f;
  a.w1 = f;
  a.dw = (x > acc_t(0) && x < hi) ? acc_t(1) : acc_t(0);
  return a;
}

// A trilinear sample: 8 corners, bit 2 of the corner number selects t's upper corner, bit 1 h's, bit 0 w's.
template <typename acc_t>
struct Sample {
  int64_t index[8];     // token index (t·H + h)·W + w of each corner in the T×H×W volume
  acc_t weight[8];      // trilinear weight of each corner
  acc_t dweight[3][8];  // ∂weight/∂x per axis (t, h, w), with the clamp/border rule applied
};

// Corner c of the axis samples (bit 2 of c selects t's upper corner, bit 1 h's, bit 0 w's): its token index
// (t·H + h)·W + w in the T×H×W volume and its trilinear weight.
template <typename acc_t>
MEGASLIDE_HD void trilinear_corner(int c, const AxisSample<acc_t>& at, const AxisSample<acc_t>& ah,
                                   const AxisSample<acc_t>& aw, int64_t H, int64_t W, int64_t& index, acc_t& weight) {
  const bool ut = (c >> 2) & 1, uh = (c >> 1) & 1, uw = c & 1;
  index = ((ut ? at.i1 : at.i0) * H + (uh ? ah.i1 : ah.i0)) * W + (uw ? aw.i1 : aw.i0);
  // grid_sample multiplies the weights in (x, y, z) = (w, h, t) order.
  weight = (uw ? aw.w1 : aw.w0) * (uh ? ah.w1 : ah.w0) * (ut ? at.w1 : at.w0);
}

template <typename acc_t>
MEGASLIDE_HD void trilinear_sample(acc_t xt, acc_t xh, acc_t xw, int64_t T, int64_t H, int64_t W, Sample<acc_t>& s) {
  const AxisSample<acc_t> at = sample_axis(xt, T), ah = sample_axis(xh, H), aw = sample_axis(xw, W);
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int c = 0; c < 8; ++c) {
    const bool ut = (c >> 2) & 1, uh = (c >> 1) & 1, uw = c & 1;
    trilinear_corner(c, at, ah, aw, H, W, s.index[c], s.weight[c]);
    const acc_t wt = ut ? at.w1 : at.w0, wh = uh ? ah.w1 : ah.w0, ww = uw ? aw.w1 : aw.w0;
    const acc_t dt = ut ? at.dw : -at.dw, dh = uh ? ah.dw : -ah.dw, dw = uw ? aw.dw : -aw.dw;
    s.dweight[0][c] = ww * wh * dt;
    s.dweight[1][c] = ww * dh * wt;
    s.dweight[2][c] = dw * wh * wt;
  }
}

// The unclamped position of sample j of the token at (t, h, w): regular window plus offset (dt, dh, dw).
template <typename acc_t>
MEGASLIDE_HD void token_position(int64_t t, int64_t h, int64_t w, int64_t j, acc_t dt, acc_t dh, acc_t dw, int64_t T,
                                 int64_t H, int64_t W, int64_t kt, int64_t kh, int64_t kw, acc_t& xt, acc_t& xh,
                                 acc_t& xw) {
  int64_t rt, rh, rw;
  regular_offset(j, kh, kw, rt, rh, rw);
  xt = acc_t(window_start(t, kt, T) + rt) + dt;
  xh = acc_t(window_start(h, kh, H) + rh) + dh;
  xw = acc_t(window_start(w, kw, W) + rw) + dw;
}

// The sample of point j for the token at (t, h, w): regular window plus offset (dt, dh, dw).
template <typename acc_t>
MEGASLIDE_HD void token_sample(int64_t t, int64_t h, int64_t w, int64_t j, acc_t dt, acc_t dh, acc_t dw, int64_t T,
                               int64_t H, int64_t W, int64_t kt, int64_t kh, int64_t kw, Sample<acc_t>& s) {
  acc_t xt, xh, xw;
  token_position(t, h, w, j, dt, dh, dw, T, H, W, kt, kh, kw, xt, xh, xw);
  trilinear_sample(xt, xh, xw, T, H, W, s);
}

// trilinear_sample's corner indices and weights only (what a forward needs), the same arithmetic.
template <typename acc_t>
MEGASLIDE_HD void trilinear_corners(acc_t xt, acc_t xh, acc_t xw, int64_t T, int64_t H, int64_t W, int64_t* index,
                                    acc_t* weight) {
  const AxisSample<acc_t> at = sample_axis(xt, T), ah = sample_axis(xh, H), aw = sample_axis(xw, W);
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int c = 0; c < 8; ++c) trilinear_corner(c, at, ah, aw, H, W, index[c], weight[c]);
}

// token_sample's corner indices and weights only.
template <typename acc_t>
MEGASLIDE_HD void token_corners(int64_t t, int64_t h, int64_t w, int64_t j, acc_t dt, acc_t dh, acc_t dw, int64_t T,
                                int64_t H, int64_t W, int64_t kt, int64_t kh, int64_t kw, int64_t* index,
                                acc_t* weight) {
  acc_t xt, xh, xw;
  token_position(t, h, w, j, dt, dh, dw, T, H, W, kt, kh, kw, xt, xh, xw);
  trilinear_corners(xt, xh, xw, T, H, W, index, weight);
}

// Σ_c weight[c]·x[c] over the 8 corners. With x[c] = q·k[corner c] this is q·k̃ (linear, so it also
// holds for partial dot products over a slice of the channels, which is how the CUDA warps use it).
template <typename acc_t>
MEGASLIDE_HD acc_t corner_sum(const acc_t* weight, const acc_t* x) {
  acc_t s = 0;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int c = 0; c < 8; ++c) s += weight[c] * x[c];
  return s;
}

// Online softmax over the K samples of one query (running max and running sum of exponentials).
template <typename acc_t>
struct OnlineSoftmax {
  acc_t max = -INFINITY;
  acc_t sum = 0;
  // Adds logit s. Returns the factor by which the running numerator Σ p_j ṽ_j must be rescaled and
  // sets p = exp(s - new max), the weight of the new sample's value.
  MEGASLIDE_HD acc_t add(acc_t s, acc_t& p) {
    const acc_t new_max = s > max ? s : max;
    const acc_t rescale = exp_of(max - new_max);
    p = exp_of(s - new_max);
    sum = sum * rescale + p;
    max = new_max;
    return rescale;
  }
  MEGASLIDE_HD acc_t log_sum_exp() const { return max + log_of(sum); }
};

// Backward of one sample from the saved log-sum-exp: the attention probability a = exp(s - lse) and
// the logit gradient ds = a·(dout·ṽ - dout·out).
template <typename acc_t>
struct SampleGrad {
  acc_t prob;
  acc_t dlogit;
};

template <typename acc_t>
MEGASLIDE_HD SampleGrad<acc_t> sample_grad(acc_t logit, acc_t lse, acc_t dout_dot_v, acc_t dout_dot_out) {
  SampleGrad<acc_t> g;
  g.prob = exp_of(logit - lse);
  g.dlogit = g.prob * (dout_dot_v - dout_dot_out);
  return g;
}

// Adds ∂loss/∂x (per axis) of one sample to dx: Σ_c dweight[a][c]·(dq_coef·qk[c] + prob·odv[c]), with
// qk[c] = q·k[corner c], odv[c] = dout·v[corner c] and dq_coef = ds·scale. Linear in qk and odv, so
// partial channel sums may be added and reduced afterwards.
template <typename acc_t>
MEGASLIDE_HD void add_position_grad(const Sample<acc_t>& s, const acc_t* qk, const acc_t* odv, acc_t dq_coef,
                                    acc_t prob, acc_t* dx) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int c = 0; c < 8; ++c) {
    const acc_t g = dq_coef * qk[c] + prob * odv[c];
    dx[0] += s.dweight[0][c] * g;
    dx[1] += s.dweight[1][c] * g;
    dx[2] += s.dweight[2][c] * g;
  }
}

// A corner the backward may skip: it contributes to neither the value nor the position gradient.
template <typename acc_t>
MEGASLIDE_HD bool corner_is_inert(const Sample<acc_t>& s, int c) {
  return s.weight[c] == acc_t(0) && s.dweight[0][c] == acc_t(0) && s.dweight[1][c] == acc_t(0) &&
         s.dweight[2][c] == acc_t(0);
}

}  // namespace megaslide::dsa3d_math
