// The tiled 3D-DSA algorithm on the CPU: the host twin of kernels/dsa3d_tiled.cu (docs/3d-dsa.md,
// "Tiled kernels"). It runs the same phases on the same data as a CUDA block does, calling the same
// shared functions (attention/dsa3d_tile.h: tile and query coordinates, sample points, halo, corners,
// reduce8, the split softmax), so CI checks the GPU's index math and score-space interpolation
// against the reference. What differs is only what the hardware does differently: the matrix
// products are loops here (tensor cores there) and the 128 work items of a block are loops.
//
// Units of work: (batch, tile, offset group), the group's heads in turn: the samples' corners are
// computed once per unit (the CUDA kernel recomputes them; see tile_corners); in the backward the unit
// owns the tile's d(offsets). dK and dV of a unit cover its halo, which overlaps its neighbours':
// default mode, one contiguous range of units per thread, each thread adding into its own copy
// (same bits for the same thread count, as the row kernel); deterministic mode, colours of units whose
// halos are disjoint (dsa3d_tile::colour_period from the offsets' bound), colour after colour, which
// is what the CUDA kernel's deterministic mode does: bit-identical for any thread count.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "attention/dsa3d_params.h"
#include "attention/dsa3d_tile.h"

namespace megaslide::ops::detail {
namespace {

using namespace dsa3d_tile;

constexpr int kQ = TileShape::kQueries;
// Halo keys per chunk: what a CUDA block of the forward holds at d = 64 is ~1400; a smaller chunk here
// makes the CPU tests cross chunk boundaries at modest sizes (the chunked path is the general one).
constexpr int kCpuChunkKeys = 512;

Geometry geometry_of(const Dsa3dShape& s) {
  return make_geometry(int(s.T), int(s.H), int(s.W), int(s.kt), int(s.kh), int(s.kw));
}

// x · y over d elements, x in the input type, y already in acc_t (8 partial sums: vectorises).
template <typename scalar_t, typename acc_t>
inline acc_t dot(const scalar_t* x, const acc_t* y, int64_t d) {
  acc_t s[8] = {};
  int64_t c = 0;
  for (; c + 8 <= d; c += 8)
    for (int u = 0; u < 8; ++u) s[u] += static_cast<acc_t>(x[c + u]) * y[c + u];
  acc_t tail = 0;
  for (; c < d; ++c) tail += static_cast<acc_t>(x[c]) * y[c];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail;
}

template <typename scalar_t, typename acc_t>
inline void axpy(acc_t a, const scalar_t* x, acc_t* y, int64_t d) {
  for (int64_t c = 0; c < d; ++c) y[c] += a * static_cast<acc_t>(x[c]);
}

// The offsets of (batch b, token, group g, sample 0).
template <typename acc_t>
inline const acc_t* offsets_of(const Dsa3dShape& s, const acc_t* offsets, int64_t b, int token, int64_t g) {
  return offsets + ((b * s.tokens() + token) * s.G + g) * s.K * 3;
}

// Per-unit scratch (one per thread).
template <typename acc_t>
struct Workspace {
  Workspace(int64_t d, int64_t K)
      : a(kQ * d),
        b(kQ * d),
        acc(kQ * d),
        rows_t(kQ * d),
        chunk(size_t(kQ) * kCpuChunkKeys),
        chunk2(size_t(kQ) * kCpuChunkKeys),
        logit(kQ * K),
        odv(kQ * K),
        A(kQ * K * 3),
        dx(kQ * K * 3),
        points(kQ * K),
        corners(kQ * K * kCorners) {}
  std::vector<acc_t> a, b, acc;        // [16, d]: q (or dout), dout, and the output/dq accumulator
  std::vector<acc_t> rows_t;           // [d, 16]: chunk_scores' transposed rows
  std::vector<acc_t> chunk, chunk2;    // [16, chunk]: S or T, then P' and dS'
  std::vector<acc_t> logit, odv;       // [16, K]
  std::vector<acc_t> A, dx;            // [16, K, 3]
  std::vector<Point<acc_t>> points;    // [16, K]
  std::vector<Corner<acc_t>> corners;  // [16, K, 8]: computed once per unit, used by every pass and head
};

// The unit's halo and every corner of its samples in halo coordinates (ws.corners). The CUDA kernel
// recomputes these per pass from the same functions (its shared memory is better spent on keys).
template <typename acc_t>
Halo tile_corners(const Geometry& geo, const Dsa3dShape& s, const acc_t* offsets, int64_t b, int tile, int64_t g,
                  Workspace<acc_t>& ws) {
  int lo[3] = {INT_MAX, INT_MAX, INT_MAX}, hi[3] = {-1, -1, -1};
  for (int q = 0; q < kQ; ++q) {
    const Query qr = tile_query(geo, tile, q);
    if (!qr.valid) continue;
    const acc_t* off = offsets_of(s, offsets, b, qr.token, g);
    for (int j = 0; j < geo.K; ++j) {
      ws.points[q * geo.K + j] = sample_point<acc_t>(geo, qr, j, off + 3 * j);
      halo_include(ws.points[q * geo.K + j], lo, hi);
    }
  }
  const Halo halo = make_halo(lo, hi);
  for (int q = 0; q < kQ; ++q) {
    if (!tile_query(geo, tile, q).valid) continue;
    for (int j = 0; j < geo.K; ++j)
      for (int c = 0; c < kCorners; ++c)
        ws.corners[(q * geo.K + j) * kCorners + c] = corner_of(ws.points[q * geo.K + j], halo, c);
  }
  return halo;
}

// Zeroes columns [0, n) of the 16 rows of a chunk buffer.
template <typename acc_t>
void zero_columns(acc_t* chunk, int n) {
  for (int q = 0; q < kQ; ++q) std::fill(chunk + q * kCpuChunkKeys, chunk + q * kCpuChunkKeys + n, acc_t(0));
}

// rows[q] = x[b, token(q), m, :] in acc_t (zero for queries outside the volume).
template <typename scalar_t, typename acc_t>
void load_rows(const Geometry& geo, const Dsa3dShape& s, const scalar_t* x, int64_t b, int tile, int64_t m,
               acc_t* rows) {
  for (int q = 0; q < kQ; ++q) {
    const Query qr = tile_query(geo, tile, q);
    acc_t* r = rows + q * s.d;
    if (!qr.valid) {
      std::fill(r, r + s.d, acc_t(0));
      continue;
    }
    const scalar_t* src = x + ((b * s.tokens() + qr.token) * s.M + m) * s.d;
    for (int64_t c = 0; c < s.d; ++c) r[c] = static_cast<acc_t>(src[c]);
  }
}

// out[q][l] = rows[q] · x[halo key base + l] for l < n (the S or T block of one chunk). The 16
// queries are the inner loop (rows transposed into rows_t, [d][16]): 16 independent sums the compiler
// vectorises, no horizontal reductions.
template <typename scalar_t, typename acc_t>
void chunk_scores(const Geometry& geo, const Dsa3dShape& s, const Halo& halo, const scalar_t* x, int64_t b, int64_t m,
                  const acc_t* rows, int base, int n, acc_t* out, acc_t* rows_t) {
  for (int q = 0; q < kQ; ++q)
    for (int64_t c = 0; c < s.d; ++c) rows_t[c * kQ + q] = rows[q * s.d + c];
  for (int l = 0; l < n; ++l) {
    const scalar_t* key = x + ((b * s.tokens() + halo_token(geo, halo, base + l)) * s.M + m) * s.d;
    acc_t sum[kQ] = {};
    for (int64_t c = 0; c < s.d; ++c) {
      const acc_t kc = static_cast<acc_t>(key[c]);
      const acc_t* r = rows_t + c * kQ;
      for (int q = 0; q < kQ; ++q) sum[q] += r[q] * kc;
    }
    for (int q = 0; q < kQ; ++q) out[q * kCpuChunkKeys + l] = sum[q];
  }
}

// Forward of (batch b, tile, group g): every head of the group (the corners are shared).
template <typename scalar_t, typename acc_t>
void forward_unit(const Dsa3dForwardParams& p, const Geometry& geo, int64_t b, int tile, int64_t g,
                  Workspace<acc_t>& ws) {
  const Dsa3dShape& s = p.shape;
  const int K = geo.K;
  const int64_t d = s.d, Mg = s.M / s.G;
  const auto* bias = static_cast<const acc_t*>(p.bias);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const acc_t scale = static_cast<acc_t>(s.scale);
  const Halo halo = tile_corners(geo, s, static_cast<const acc_t*>(p.offsets), b, tile, g, ws);
  const int HV = halo.volume();
  Query queries[kQ];
  for (int q = 0; q < kQ; ++q) queries[q] = tile_query(geo, tile, q);
  auto corner = [&](int q, int j, int c) -> const Corner<acc_t>& { return ws.corners[(q * K + j) * kCorners + c]; };

  for (int64_t m = g * Mg; m < (g + 1) * Mg; ++m) {
    load_rows(geo, s, static_cast<const scalar_t*>(p.q), b, tile, m, ws.a.data());
    std::fill(ws.logit.begin(), ws.logit.end(), acc_t(0));

    // Logits: Σ over chunks of the chunk's corner terms, each combined by reduce8.
    for (int base = 0; base < HV; base += kCpuChunkKeys) {
      const int n = std::min(kCpuChunkKeys, HV - base);
      chunk_scores(geo, s, halo, static_cast<const scalar_t*>(p.k), b, m, ws.a.data(), base, n, ws.chunk.data(),
                   ws.rows_t.data());
      for (int q = 0; q < kQ; ++q) {
        if (!queries[q].valid) continue;
        const acc_t* S = ws.chunk.data() + q * kCpuChunkKeys;
        for (int j = 0; j < K; ++j) {
          acc_t terms[kCorners];
          for (int c = 0; c < kCorners; ++c) {
            const Corner<acc_t>& k = corner(q, j, c);
            terms[c] = in_chunk(k, base, n) ? k.w * S[k.L - base] : acc_t(0);
          }
          ws.logit[q * K + j] += reduce8(terms);
        }
      }
    }

    // Softmax: probabilities a_j = exp(s_j - lse) replace the logits.
    auto* lse = static_cast<acc_t*>(p.lse);
    for (int q = 0; q < kQ; ++q) {
      if (!queries[q].valid) continue;
      acc_t* row = ws.logit.data() + q * K;
      for (int j = 0; j < K; ++j) row[j] = row[j] * scale + (bias ? bias[m * K + j] : acc_t(0));
      acc_t max = -INFINITY, parts[kCorners];
      for (int c = 0; c < kCorners; ++c) max = std::max(max, part_max(row, K, c));
      for (int c = 0; c < kCorners; ++c) parts[c] = part_sum_exp(row, K, c, max);
      const acc_t l = max + dsa3d_math::log_of(reduce8(parts));
      for (int j = 0; j < K; ++j) row[j] = dsa3d_math::exp_of(row[j] - l);
      lse[(b * s.tokens() + queries[q].token) * s.M + m] = l;
    }

    // out = P'·V_halo, chunk by chunk; P' gathers a_j·w_jc at the corners, in j order.
    std::fill(ws.acc.begin(), ws.acc.end(), acc_t(0));
    for (int base = 0; base < HV; base += kCpuChunkKeys) {
      const int n = std::min(kCpuChunkKeys, HV - base);
      zero_columns(ws.chunk.data(), n);
      for (int q = 0; q < kQ; ++q) {
        if (!queries[q].valid) continue;
        acc_t* P = ws.chunk.data() + q * kCpuChunkKeys;
        for (int j = 0; j < K; ++j) {
          const acc_t a = ws.logit[q * K + j];
          for (int c = 0; c < kCorners; ++c) {
            const Corner<acc_t>& k = corner(q, j, c);
            if (in_chunk(k, base, n)) P[k.L - base] += a * k.w;
          }
        }
      }
      for (int l = 0; l < n; ++l) {
        const scalar_t* val = v + ((b * s.tokens() + halo_token(geo, halo, base + l)) * s.M + m) * d;
        for (int q = 0; q < kQ; ++q) {
          const acc_t w = ws.chunk[q * kCpuChunkKeys + l];
          if (w != acc_t(0)) axpy(w, val, ws.acc.data() + q * d, d);
        }
      }
    }
    auto* out = static_cast<scalar_t*>(p.out);
    for (int q = 0; q < kQ; ++q) {
      if (!queries[q].valid) continue;
      scalar_t* o = out + ((b * s.tokens() + queries[q].token) * s.M + m) * d;
      for (int64_t c = 0; c < d; ++c) o[c] = static_cast<scalar_t>(ws.acc[q * d + c]);
    }
  }
}

template <typename scalar_t, typename acc_t>
void forward_impl(const Dsa3dForwardParams& p) {
  const Dsa3dShape& s = p.shape;
  const Geometry geo = geometry_of(s);
  const int64_t tiles = geo.tiles();
  at::parallel_for(0, s.B * tiles * s.G, 1, [&](int64_t begin, int64_t end) {
    Workspace<acc_t> ws(s.d, s.K);
    for (int64_t u = begin; u < end; ++u)
      forward_unit<scalar_t, acc_t>(p, geo, u / (tiles * s.G), int((u / s.G) % tiles), u % s.G, ws);
  });
}

// Backward of (batch b, tile, group g): every head of the group; writes dq and d(offsets) of the
// tile's queries and its dbias partial [M, K], adds dK and dV over its halo into dk, dv (the caller
// guarantees no other thread touches them meanwhile).
template <typename scalar_t, typename acc_t>
void backward_unit(const Dsa3dBackwardParams& p, const Geometry& geo, int64_t b, int tile, int64_t g, acc_t* dk,
                   acc_t* dv, acc_t* dbias_part, Workspace<acc_t>& ws) {
  const Dsa3dShape& s = p.shape;
  const int K = geo.K;
  const int64_t d = s.d, N = s.tokens(), Mg = s.M / s.G;
  const auto* k_in = static_cast<const scalar_t*>(p.k);
  const auto* v_in = static_cast<const scalar_t*>(p.v);
  const auto* offsets = static_cast<const acc_t*>(p.offsets);
  const auto* bias = static_cast<const acc_t*>(p.bias);
  const auto* lse = static_cast<const acc_t*>(p.lse);
  const auto* out = static_cast<const scalar_t*>(p.out);
  const acc_t scale = static_cast<acc_t>(s.scale);
  const Halo halo = tile_corners(geo, s, offsets, b, tile, g, ws);
  const int HV = halo.volume();
  std::fill(ws.dx.begin(), ws.dx.end(), acc_t(0));
  Query queries[kQ];
  for (int q = 0; q < kQ; ++q) queries[q] = tile_query(geo, tile, q);
  auto corner = [&](int q, int j, int c) -> const Corner<acc_t>& { return ws.corners[(q * K + j) * kCorners + c]; };

  for (int64_t m = g * Mg; m < (g + 1) * Mg; ++m) {
    acc_t* qf = ws.a.data();
    acc_t* dof = ws.b.data();
    load_rows(geo, s, static_cast<const scalar_t*>(p.q), b, tile, m, qf);
    load_rows(geo, s, static_cast<const scalar_t*>(p.dout), b, tile, m, dof);
    std::fill(ws.logit.begin(), ws.logit.end(), acc_t(0));
    std::fill(ws.odv.begin(), ws.odv.end(), acc_t(0));
    std::fill(ws.A.begin(), ws.A.end(), acc_t(0));

    // Pass 1, S = Q·K_haloᵀ: logits and A[a] = Σ_c ∂w_c/∂x_a · q·k_c.
    for (int base = 0; base < HV; base += kCpuChunkKeys) {
      const int n = std::min(kCpuChunkKeys, HV - base);
      chunk_scores(geo, s, halo, k_in, b, m, qf, base, n, ws.chunk.data(), ws.rows_t.data());
      for (int q = 0; q < kQ; ++q) {
        if (!queries[q].valid) continue;
        const acc_t* S = ws.chunk.data() + q * kCpuChunkKeys;
        for (int j = 0; j < K; ++j) {
          acc_t tw[kCorners], ta[3][kCorners];
          for (int c = 0; c < kCorners; ++c) {
            const Corner<acc_t>& k = corner(q, j, c);
            const bool in = in_chunk(k, base, n);
            const acc_t sv = in ? S[k.L - base] : acc_t(0);
            tw[c] = in ? k.w * sv : acc_t(0);
            for (int a = 0; a < 3; ++a) ta[a][c] = in ? k.dw[a] * sv : acc_t(0);
          }
          ws.logit[q * K + j] += reduce8(tw);
          for (int a = 0; a < 3; ++a) ws.A[(q * K + j) * 3 + a] += reduce8(ta[a]);
        }
      }
    }
    acc_t D[kQ];  // dout · out per query
    for (int q = 0; q < kQ; ++q) {
      if (!queries[q].valid) continue;
      const int64_t row = (b * N + queries[q].token) * s.M + m;
      D[q] = dot(out + row * d, dof + q * d, d);
      for (int j = 0; j < K; ++j) {
        acc_t& x = ws.logit[q * K + j];
        x = dsa3d_math::exp_of(x * scale + (bias ? bias[m * K + j] : acc_t(0)) - lse[row]);  // probability
      }
    }

    // Pass 2, T = dO·V_haloᵀ: dout·ṽ_j, and the value part of d(offsets): a_j Σ_c ∂w_c/∂x_a · dout·v_c.
    for (int base = 0; base < HV; base += kCpuChunkKeys) {
      const int n = std::min(kCpuChunkKeys, HV - base);
      chunk_scores(geo, s, halo, v_in, b, m, dof, base, n, ws.chunk.data(), ws.rows_t.data());
      for (int q = 0; q < kQ; ++q) {
        if (!queries[q].valid) continue;
        const acc_t* Tq = ws.chunk.data() + q * kCpuChunkKeys;
        for (int j = 0; j < K; ++j) {
          acc_t tw[kCorners], ta[3][kCorners];
          for (int c = 0; c < kCorners; ++c) {
            const Corner<acc_t>& k = corner(q, j, c);
            const bool in = in_chunk(k, base, n);
            const acc_t tv = in ? Tq[k.L - base] : acc_t(0);
            tw[c] = in ? k.w * tv : acc_t(0);
            for (int a = 0; a < 3; ++a) ta[a][c] = in ? k.dw[a] * tv : acc_t(0);
          }
          const acc_t prob = ws.logit[q * K + j];
          ws.odv[q * K + j] += reduce8(tw);
          for (int a = 0; a < 3; ++a) ws.dx[(q * K + j) * 3 + a] += prob * reduce8(ta[a]);
        }
      }
    }
    // ds_j = a_j (dout·ṽ_j - dout·out) replaces dout·ṽ_j; the key part of d(offsets); dbias partial.
    for (int q = 0; q < kQ; ++q) {
      if (!queries[q].valid) continue;
      for (int j = 0; j < K; ++j) {
        acc_t& ds = ws.odv[q * K + j];
        ds = ws.logit[q * K + j] * (ds - D[q]);
        for (int a = 0; a < 3; ++a) ws.dx[(q * K + j) * 3 + a] += scale * ds * ws.A[(q * K + j) * 3 + a];
      }
    }
    if (dbias_part) {
      for (int j = 0; j < K; ++j) {
        acc_t sum = 0;
        for (int q = 0; q < kQ; ++q)
          if (queries[q].valid) sum += ws.odv[q * K + j];
        dbias_part[m * K + j] = sum;
      }
    }

    // Pass 3: P' and dS' per chunk; dV += P'ᵀ·dO, dK += dS'ᵀ·Q, dQ += dS'·K over the chunk's keys.
    acc_t* dqf = ws.acc.data();
    std::fill(ws.acc.begin(), ws.acc.end(), acc_t(0));
    for (int base = 0; base < HV; base += kCpuChunkKeys) {
      const int n = std::min(kCpuChunkKeys, HV - base);
      zero_columns(ws.chunk.data(), n);
      zero_columns(ws.chunk2.data(), n);
      for (int q = 0; q < kQ; ++q) {
        if (!queries[q].valid) continue;
        acc_t* P = ws.chunk.data() + q * kCpuChunkKeys;
        acc_t* dS = ws.chunk2.data() + q * kCpuChunkKeys;
        for (int j = 0; j < K; ++j) {
          const acc_t a = ws.logit[q * K + j], sds = scale * ws.odv[q * K + j];
          for (int c = 0; c < kCorners; ++c) {
            const Corner<acc_t>& k = corner(q, j, c);
            if (!in_chunk(k, base, n)) continue;
            P[k.L - base] += a * k.w;
            dS[k.L - base] += sds * k.w;
          }
        }
      }
      for (int l = 0; l < n; ++l) {
        const int64_t row = ((b * N + halo_token(geo, halo, base + l)) * s.M + m) * d;
        const scalar_t* key = k_in + row;
        for (int q = 0; q < kQ; ++q) {
          const acc_t pw = ws.chunk[q * kCpuChunkKeys + l], sw = ws.chunk2[q * kCpuChunkKeys + l];
          if (pw != acc_t(0)) axpy(pw, dof + q * d, dv + row, d);
          if (sw != acc_t(0)) {
            axpy(sw, qf + q * d, dk + row, d);
            axpy(sw, key, dqf + q * d, d);
          }
        }
      }
    }
    auto* dq = static_cast<scalar_t*>(p.dq);
    for (int q = 0; q < kQ; ++q) {
      if (!queries[q].valid) continue;
      scalar_t* o = dq + ((b * N + queries[q].token) * s.M + m) * d;
      for (int64_t c = 0; c < d; ++c) o[c] = static_cast<scalar_t>(dqf[q * d + c]);
    }
  }
  auto* doffsets = static_cast<acc_t*>(p.doffsets);
  for (int q = 0; q < kQ; ++q) {
    if (!queries[q].valid) continue;
    std::copy(ws.dx.begin() + q * K * 3, ws.dx.begin() + (q + 1) * K * 3,
              doffsets + ((b * N + queries[q].token) * s.G + g) * K * 3);
  }
}

template <typename scalar_t, typename acc_t>
void backward_impl(const Dsa3dBackwardParams& p) {
  const Dsa3dShape& s = p.shape;
  const Geometry geo = geometry_of(s);
  const int tiles = geo.tiles();
  // dbias partials per (batch, tile), added in that order at the end.
  std::vector<acc_t> dbias_parts(p.dbias ? size_t(s.B * tiles * s.M * s.K) : 0);
  auto unit = [&](int64_t b, int tile, int64_t g, acc_t* dk, acc_t* dv, Workspace<acc_t>& ws) {
    acc_t* part = p.dbias ? dbias_parts.data() + (b * tiles + tile) * s.M * s.K : nullptr;
    backward_unit<scalar_t, acc_t>(p, geo, b, tile, g, dk, dv, part, ws);
  };
  auto* dk = static_cast<acc_t*>(p.dk);
  auto* dv = static_cast<acc_t*>(p.dv);
  if (!p.deterministic) {
    // Default: the units (batch, tile, group) in one contiguous range per chunk; chunk 0 adds into dk,
    // dv, chunk c > 0 into its zeroed part c - 1 of the scratch; the parts are added in chunk order.
    // Same bits on every run with the same thread count (as the row kernel's default mode).
    const int64_t units = s.B * tiles * s.G, volume = s.B * s.tokens() * s.M * s.d;
    const int64_t chunks = std::max<int64_t>(1, std::min(p.cpu_chunks, units));
    auto* scratch = static_cast<acc_t*>(p.cpu_scratch);
    TORCH_CHECK(chunks == 1 || scratch, "dsa3d: the tiled CPU backward needs its scratch for ", chunks, " chunks");
    const int64_t stride = 2 * volume + s.M * s.K;  // dsa3d_cpu_scratch_elements' layout per chunk
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      Workspace<acc_t> ws(s.d, s.K);
      for (int64_t c = begin; c < end; ++c) {
        acc_t* dk_c = c == 0 ? dk : scratch + (c - 1) * stride;
        acc_t* dv_c = c == 0 ? dv : scratch + (c - 1) * stride + volume;
        for (int64_t u = units * c / chunks; u < units * (c + 1) / chunks; ++u)
          unit(u / (tiles * s.G), int((u / s.G) % tiles), u % s.G, dk_c, dv_c, ws);
      }
    });
    if (chunks > 1) {
      at::parallel_for(0, volume, 1 << 15, [&](int64_t begin, int64_t end) {
        for (int64_t c = 1; c < chunks; ++c) {
          const acc_t* dk_c = scratch + (c - 1) * stride;
          const acc_t* dv_c = dk_c + volume;
          for (int64_t i = begin; i < end; ++i) dk[i] += dk_c[i], dv[i] += dv_c[i];
        }
      });
    }
  } else {
    // Deterministic: colours of tiles whose halos are disjoint (from the offsets' bound); a colour's
    // units add straight into dk, dv in parallel, colour after colour. Bit-identical for any thread
    // count, no scratch; fewer units run at once (a colour holds tiles/periods of them).
    const int period[3] = {
        colour_period(geo.tiles_t, TileShape::kT, geo.kt, geo.T, p.offset_bound[0]),
        colour_period(geo.tiles_h, TileShape::kH, geo.kh, geo.H, p.offset_bound[1]),
        colour_period(geo.tiles_w, TileShape::kW, geo.kw, geo.W, p.offset_bound[2]),
    };
    for (int ct = 0; ct < period[0]; ++ct)
      for (int ch = 0; ch < period[1]; ++ch)
        for (int cw = 0; cw < period[2]; ++cw) {
          std::vector<int> colour_tiles;
          for (int it = ct; it < geo.tiles_t; it += period[0])
            for (int ih = ch; ih < geo.tiles_h; ih += period[1])
              for (int iw = cw; iw < geo.tiles_w; iw += period[2])
                colour_tiles.push_back((it * geo.tiles_h + ih) * geo.tiles_w + iw);
          const int64_t n = int64_t(colour_tiles.size());
          at::parallel_for(0, s.B * n * s.G, 1, [&](int64_t begin, int64_t end) {
            Workspace<acc_t> ws(s.d, s.K);
            for (int64_t u = begin; u < end; ++u) unit(u / (n * s.G), colour_tiles[(u / s.G) % n], u % s.G, dk, dv, ws);
          });
        }
  }
  if (p.dbias) {
    auto* dbias = static_cast<acc_t*>(p.dbias);
    const int64_t n = s.M * s.K;
    at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        acc_t sum = 0;
        for (int64_t u = 0; u < s.B * tiles; ++u) sum += dbias_parts[u * n + i];
        dbias[i] += sum;
      }
    });
  }
}

}  // namespace

int64_t dsa3d_tile_count(const Dsa3dShape& s) { return geometry_of(s).tiles(); }

void dsa3d_forward_cpu_tiled(const Dsa3dForwardParams& p) {
  dispatch_dtype<c10::BFloat16, c10::Half>(
      p.shape.dtype, [&](auto scalar, auto acc) { forward_impl<decltype(scalar), decltype(acc)>(p); });
}

void dsa3d_backward_cpu_tiled(const Dsa3dBackwardParams& p) {
  dispatch_dtype<c10::BFloat16, c10::Half>(
      p.shape.dtype, [&](auto scalar, auto acc) { backward_impl<decltype(scalar), decltype(acc)>(p); });
}

}  // namespace megaslide::ops::detail
