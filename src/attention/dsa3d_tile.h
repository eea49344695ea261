// The tile algorithm of 3D-DSA (docs/3d-dsa.md, "Tiled kernels"), shared by the CPU twin
// (src/attention/dsa3d_tiled_cpu.cpp) and the tensor-core CUDA kernels (kernels/dsa3d_tiled.cu).
// Everything here is a `__host__ __device__` inline function of scalars (int32 index math), so the
// arithmetic the GPU runs is the arithmetic the CPU tests check. No LibTorch, no allocation.
//
// Score space. The logit of sample j is linear in the key: q·k̃_j = Σ_c w_jc (q·k_c) over its 8 corners,
// and the output is Σ_j a_j ṽ_j = Σ_c (Σ_j a_j w_jc) v_c. A unit of work owns a tile of queries (one
// mma row block, TileShape) and one head; its samples can only reach the tile's *halo*, a box of key
// tokens. So the unit computes S = Q·K_haloᵀ (a dense matrix product), reads each sample's logit as
// the trilinear combination of 8 entries of S, and scatters each sample's probability into
// P'[q][corner] so that out = P'·V_halo (a second dense product). The backward is the same with
// T = dO·V_haloᵀ, dS' (the logit gradients scattered like P'), dQ = dS'·K_halo, dK_halo = dS'ᵀ·Q and
// dV_halo = P'ᵀ·dO, and the offsets gradient from S and T at the corners.
//
// The halo of a tile is exact: the box spanned by the corners of its samples (computed from the
// offsets, so any offsets are correct). The halo may exceed what a unit holds at once, so it is
// processed in chunks of `chunk_keys` consecutive halo keys (row-major over the box); a sample's corner
// contributes in the chunk that holds it. With |Δ| ≤ r per axis (Δ = r·tanh(o) in the module) the
// halo is bounded (halo_bound_interval): per axis at most Q + k + 2⌈r⌉ keys, e.g. 6×17×17 = 1734 for
// kernel (3, 7, 7), tile 1×4×4 and r = (1, 3, 3).
//
// Work items per (query q, corner c): 16 queries × 8 corners = 128, one CUDA thread each (a warp
// holds 4 queries). Per sample j the 8 corners of a query are distinct halo keys (or have weight 0:
// an upper corner clamped onto the lower one), so the 8 threads of a query never write the same P'
// element in one step; steps run in j order. The 8 corner terms of a sum are combined in the
// butterfly order of the CUDA xor-shuffles (reduce8), on the CPU too.
#pragma once

#include "dsa3d_math.h"

namespace megaslide::dsa3d_tile {

// The query tile: 1×4×4 tokens = 16 queries, the M of one m16n16k16 mma. A tile of one frame keeps
// the halo of the short t kernel small (6 frames for kt = 3, r_t = 1) while 4×4 in (h, w) keeps the
// (h, w) halo at 17×17 for a 7×7 kernel and r = 3: per query ~108 halo keys against 147 samples·8
// corners = 1176 corner reads (a larger tile reads a larger halo per tile but the same per query).
struct TileShape {
  static constexpr int kT = 1, kH = 4, kW = 4;
  static constexpr int kQueries = kT * kH * kW;  // 16
};
constexpr int kCorners = 8;
// Keys staged per step of the matrix products: 4 warps × 16 keys.
constexpr int kSubKeys = 64;

// Volume, effective kernel and tile grid, int32 (the API checks every count fits).
struct Geometry {
  int T = 0, H = 0, W = 0;
  int kt = 0, kh = 0, kw = 0, K = 0;
  int tiles_t = 0, tiles_h = 0, tiles_w = 0;
  MEGASLIDE_HD int tokens() const { return T * H * W; }
  MEGASLIDE_HD int tiles() const { return tiles_t * tiles_h * tiles_w; }
};

MEGASLIDE_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

MEGASLIDE_HD Geometry make_geometry(int T, int H, int W, int kt, int kh, int kw) {
  Geometry g;
  g.T = T, g.H = H, g.W = W, g.kt = kt, g.kh = kh, g.kw = kw, g.K = kt * kh * kw;
  g.tiles_t = ceil_div(T, TileShape::kT);
  g.tiles_h = ceil_div(H, TileShape::kH);
  g.tiles_w = ceil_div(W, TileShape::kW);
  return g;
}

// Query q ∈ [0, 16) of tile `tile` (row-major over the tile grid): coordinates, token index, and
// whether it lies inside the volume (tiles at the far borders are partial).
struct Query {
  int t, h, w, token;
  bool valid;
};

MEGASLIDE_HD Query tile_query(const Geometry& g, int tile, int q) {
  const int it = tile / (g.tiles_h * g.tiles_w), ih = (tile / g.tiles_w) % g.tiles_h, iw = tile % g.tiles_w;
  const int qt = q / (TileShape::kH * TileShape::kW), qh = (q / TileShape::kW) % TileShape::kH, qw = q % TileShape::kW;
  Query r;
  r.t = it * TileShape::kT + qt, r.h = ih * TileShape::kH + qh, r.w = iw * TileShape::kW + qw;
  r.valid = r.t < g.T && r.h < g.H && r.w < g.W;
  r.token = r.valid ? (r.t * g.H + r.h) * g.W + r.w : 0;
  return r;
}

// The axis math is dsa3d_math's, in int32: window_start<int> and sample_axis<acc_t, int> (the same
// clamp, floor-based corners and border rule; see dsa3d_math.h).
using dsa3d_math::window_start;
template <typename acc_t>
using Axis = dsa3d_math::AxisSample<acc_t, int>;

// The three axes (t, h, w) of sample j of a query; `off` points at its 3 offsets (t, h, w).
template <typename acc_t>
struct Point {
  Axis<acc_t> a[3];
};

template <typename acc_t>
MEGASLIDE_HD Point<acc_t> sample_point(const Geometry& g, const Query& qr, int j, const acc_t* off) {
  const int rw = j % g.kw, rh = (j / g.kw) % g.kh, rt = j / (g.kw * g.kh);
  Point<acc_t> p;
  p.a[0] = dsa3d_math::sample_axis<acc_t, int>(acc_t(window_start(qr.t, g.kt, g.T) + rt) + off[0], g.T);
  p.a[1] = dsa3d_math::sample_axis<acc_t, int>(acc_t(window_start(qr.h, g.kh, g.H) + rh) + off[1], g.H);
  p.a[2] = dsa3d_math::sample_axis<acc_t, int>(acc_t(window_start(qr.w, g.kw, g.W) + rw) + off[2], g.W);
  return p;
}

// The halo: a box of key tokens, lo[a] .. lo[a] + ext[a] - 1 per axis; halo key L is row-major in it.
struct Halo {
  int lo[3], ext[3];
  MEGASLIDE_HD int volume() const { return ext[0] * ext[1] * ext[2]; }
};

// Widens [lo, hi] (per axis, inclusive) to hold every corner of the sample.
template <typename acc_t>
MEGASLIDE_HD void halo_include(const Point<acc_t>& p, int* lo, int* hi) {
  for (int a = 0; a < 3; ++a) {
    lo[a] = p.a[a].i0 < lo[a] ? p.a[a].i0 : lo[a];
    hi[a] = p.a[a].i1 > hi[a] ? p.a[a].i1 : hi[a];
  }
}

MEGASLIDE_HD Halo make_halo(const int* lo, const int* hi) {
  Halo h;
  for (int a = 0; a < 3; ++a) {
    h.lo[a] = lo[a];
    h.ext[a] = hi[a] >= lo[a] ? hi[a] - lo[a] + 1 : 0;  // empty when the tile has no valid query
  }
  return h;
}

// The token index of halo key L.
MEGASLIDE_HD int halo_token(const Geometry& g, const Halo& h, int L) {
  const int w = L % h.ext[2], r = L / h.ext[2];
  const int hh = r % h.ext[1], t = r / h.ext[1];
  return ((h.lo[0] + t) * g.H + (h.lo[1] + hh)) * g.W + (h.lo[2] + w);
}

// Corner c of a sample (bit 2: t's upper corner, bit 1: h's, bit 0: w's) in halo coordinates: key L,
// trilinear weight and its derivatives per axis, exactly as dsa3d_math::trilinear_sample.
template <typename acc_t>
struct Corner {
  int L;
  acc_t w;
  acc_t dw[3];
};

template <typename acc_t>
MEGASLIDE_HD Corner<acc_t> corner_of(const Point<acc_t>& p, const Halo& h, int c) {
  const bool ut = (c >> 2) & 1, uh = (c >> 1) & 1, uw = c & 1;
  const Axis<acc_t>&at = p.a[0], &ah = p.a[1], &aw = p.a[2];
  const int it = ut ? at.i1 : at.i0, ih = uh ? ah.i1 : ah.i0, iw = uw ? aw.i1 : aw.i0;
  const acc_t wt = ut ? at.w1 : at.w0, wh = uh ? ah.w1 : ah.w0, ww = uw ? aw.w1 : aw.w0;
  const acc_t dt = ut ? at.dw : -at.dw, dh = uh ? ah.dw : -ah.dw, dw = uw ? aw.dw : -aw.dw;
  Corner<acc_t> r;
  r.L = ((it - h.lo[0]) * h.ext[1] + (ih - h.lo[1])) * h.ext[2] + (iw - h.lo[2]);
  // grid_sample multiplies the weights in (x, y, z) = (w, h, t) order; so does dsa3d_math.
  r.w = ww * wh * wt;
  r.dw[0] = ww * wh * dt;
  r.dw[1] = ww * dh * wt;
  r.dw[2] = dw * wh * wt;
  return r;
}

// True when the corner takes part in the chunk of halo keys [base, base + size): inside it and not
// inert (an inert corner has zero weight and zero derivatives: it adds nothing anywhere).
template <typename acc_t>
MEGASLIDE_HD bool in_chunk(const Corner<acc_t>& k, int base, int size) {
  return k.L >= base && k.L < base + size &&
         !(k.w == acc_t(0) && k.dw[0] == acc_t(0) && k.dw[1] == acc_t(0) && k.dw[2] == acc_t(0));
}

// The sum of 8 per-corner terms in the order the CUDA kernels form it: xor-shuffles by 4, 2 and 1
// within the 8 threads of a query. Every thread ends with these bits (a + b == b + a exactly).
template <typename T>
MEGASLIDE_HD T reduce8(const T* v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// Softmax over the K logits of one query, split like the CUDA kernels split it: part c ∈ [0, 8) holds
// the samples j ≡ c (mod 8). The parts' maxima combine in any order (max is exact); the parts' sums of
// exp(s - max), each in increasing j, combine by reduce8. log-sum-exp = max + log(sum).
template <typename acc_t>
MEGASLIDE_HD acc_t part_max(const acc_t* logits, int K, int part) {
  acc_t m = -INFINITY;
  for (int j = part; j < K; j += kCorners) m = logits[j] > m ? logits[j] : m;
  return m;
}

template <typename acc_t>
MEGASLIDE_HD acc_t part_sum_exp(const acc_t* logits, int K, int part, acc_t max) {
  acc_t s = 0;
  for (int j = part; j < K; j += kCorners) s += dsa3d_math::exp_of(logits[j] - max);
  return s;
}

// ---- the bound (deterministic merges, docs) -------------------------------------------------------

// Per axis: the interval of key indices the corners of tile index `i` (tile extent Q) can reach when
// |Δ| <= bound: [max(0, start(first) - ⌈bound⌉), min(S - 1, start(last) + k + ⌊bound⌋)]. Proof: a
// position x = start(p) + r + Δ with r ∈ [0, k) lies in [start(p) - bound, start(p) + k - 1 + bound];
// clamping keeps it in [0, S - 1]; i0 = ⌊P⌋ and i1 <= i0 + 1; start(p) is non-decreasing in p. Rounding
// of x in acc_t is monotone and the interval ends are integers, so it cannot leave the interval.
MEGASLIDE_HD void halo_bound_interval(int i, int Q, int k, int S, double bound, int& lo, int& hi) {
  const int first = i * Q, last = (i + 1) * Q - 1 < S - 1 ? (i + 1) * Q - 1 : S - 1;
  const double fl = floor(bound), ce = ceil(bound);
  const double l = double(window_start(first, k, S)) - ce;
  const double h = double(window_start(last, k, S) + k) + fl;
  lo = l >= 0 ? int(l) : 0;  // written so that a NaN or infinite bound gives the whole axis
  hi = h <= double(S - 1) ? int(h) : S - 1;
}

// The smallest period P such that tiles i and i + P (along one axis) never share a halo key when
// |Δ| <= bound: tiles whose indices agree modulo the periods of all three axes ("one colour") can then
// merge their dK, dV into the same tensor without atomics. Host only (loops over the tiles).
inline int colour_period(int tiles, int Q, int k, int S, double bound) {
  for (int P = 1; P < tiles; ++P) {
    bool disjoint = true;
    for (int i = 0; i + P < tiles && disjoint; ++i) {
      int lo0, hi0, lo1, hi1;
      halo_bound_interval(i, Q, k, S, bound, lo0, hi0);
      halo_bound_interval(i + P, Q, k, S, bound, lo1, hi1);
      disjoint = hi0 < lo1;
    }
    if (disjoint) return P;
  }
  return tiles > 0 ? tiles : 1;
}

}  // namespace megaslide::dsa3d_tile
