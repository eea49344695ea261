// Tiled 3D-DSA on the GPU (docs/3d-dsa.md, "Tiled kernels"): score-space interpolation with the dense
// products on tensor cores. The algorithm, its index math and every per-sample formula are
// src/attention/dsa3d_tile.h, shared with the CPU twin (src/attention/dsa3d_tiled_cpu.cpp) that CI
// tests against the reference; this file is the thread mapping, the shared-memory tiles, the matrix
// products (WMMA m16n16k16 for bfloat16/float16 with float32 accumulation; plain FMA loops for
// float32/float64, so the same kernel can be checked in float64) and the launches.
//
// A block is 128 threads: thread (q, c) = (tid / 8, tid % 8) is query q ∈ [0, 16) of the tile and
// corner c of its current sample, so a warp holds 4 queries; warp w also owns rows/columns
// [16w, 16w + 16) of each 64-key sub-chunk in the products.
//   forward   block per (tile, head, batch): halo (block min/max of the corners), then per chunk of
//             halo keys S = Q·Kᵀ (smem, fp32) and the logits gathered from it; softmax (8 threads a
//             query); per chunk P' scattered (fp32, one sample per step) and out += P'·V. No atomics:
//             bit-identical run to run.
//   backward  block per (tile, head, batch): S -> logits and the key part of d(offsets); T = dO·Vᵀ ->
//             dout·ṽ and the value part; ds; per chunk P' and dS' scattered, then dV = P'ᵀ·dO and
//             dK = dS'ᵀ·Q merged into the fp32 dk, dv once per halo element (atomicAdd; deterministic
//             mode: tile colours whose halos are disjoint, launched one after the other, plain adds),
//             and dQ += dS'·K. dq is owned by the block; so is d(offsets) when a group is one head,
//             else the group's heads (separate blocks) sum into it by atomicAdd or, deterministic, write
//             per-head partials that a second kernel sums in head order. dbias goes through per-tile
//             partials summed in tile order by another kernel. Heads on the grid rather than in a loop
//             of the block: one block per SM fits the backward's shared memory, and a serial loop over
//             a group's heads left the grid G/M as wide and the tail as long.
#include <cuda_runtime.h>
#include <mma.h>

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <string>
#include <type_traits>

#include "attention/dsa3d_params.h"
#include "attention/dsa3d_tile.h"
#include "dsa3d_cuda.cuh"

namespace megaslide::ops::detail {
namespace {

using namespace dsa3d_tile;
namespace wmma = nvcuda::wmma;

// Launch shape and shared-memory budget, in one place.
struct TiledTraits {
  // 16 queries × 8 corners: one thread per corner of a query's current sample, 4 warps.
  static constexpr int kThreads = TileShape::kQueries * kCorners;
  static constexpr int kWarps = kThreads / 32;
  static_assert(kWarps * 16 == kSubKeys, "each warp owns 16 keys of a staged sub-chunk");
  // Elements added to each staged row (16 bytes): consecutive rows start in different banks.
  static constexpr int kPad = 8;
  // Forward: 110 KB of dynamic shared memory lets two blocks share an SM (228 KB on Hopper, less 1 KB
  // reserved and the static arrays per block); the halo chunk takes what the fixed tables leave
  // (1344 keys at d = 64, K = 147: the default 1734-key halo in 2 chunks). Backward: its tables are
  // ~4x larger; one block per SM. Untuned: to be measured on the device.
  static constexpr int kForwardSmemTarget = 110 * 1024;
  static constexpr int kBackwardSmemTarget = 220 * 1024;
  // The kernels' static __shared__ arrays (ptxas: 1408 bytes), kept free below the device's limit.
  static constexpr int kStaticSmem = 2048;
  static constexpr int kMinChunk = 128;  // >= the largest padded head size (the output staging reuses S)
  static constexpr int kMaxChunk = 8192;
  static constexpr int kReduceThreads = 256;  // dbias reduction: one thread per (head, sample)
};

template <typename T>
constexpr bool kTensorCores = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

// Byte offsets of the block's shared-memory regions (host and device compute the same).
struct Layout {
  int dp = 0;     // head size rounded up to 16
  int ld = 0;     // row stride of staged q / dout / key rows, elements
  int ldp = 0;    // row stride of the staged P' / dS' sub-chunks, elements
  int chunk = 0;  // halo keys per chunk, a multiple of kSubKeys
  size_t q = 0, dout = 0, kv = 0, s = 0, s2 = 0, pb = 0, dsb = 0, logit = 0, odv = 0, A = 0, dx = 0, stage = 0,
         rows = 0, total = 0;
};

__host__ __device__ inline size_t align128(size_t x) { return (x + 127) / 128 * 128; }

__host__ __device__ inline Layout make_layout(int d, int K, int chunk, int scalar_bytes, int acc_bytes, bool backward) {
  Layout l;
  l.dp = (d + 15) / 16 * 16;
  l.ld = l.dp + TiledTraits::kPad;
  l.ldp = kSubKeys + TiledTraits::kPad;
  l.chunk = chunk;
  const int Q = TileShape::kQueries;
  size_t at = 0;
  auto region = [&](size_t bytes) {
    const size_t start = at;
    at = align128(at + bytes);
    return start;
  };
  l.q = region(size_t(Q) * l.ld * scalar_bytes);
  if (backward) l.dout = region(size_t(Q) * l.ld * scalar_bytes);
  l.kv = region(size_t(kSubKeys) * l.ld * scalar_bytes);
  l.s = region(size_t(Q) * chunk * acc_bytes);
  if (backward) l.s2 = region(size_t(Q) * chunk * acc_bytes);
  l.pb = region(size_t(Q) * l.ldp * scalar_bytes);
  if (backward) l.dsb = region(size_t(Q) * l.ldp * scalar_bytes);
  l.logit = region(size_t(Q) * K * acc_bytes);
  if (backward) {
    l.odv = region(size_t(Q) * K * acc_bytes);
    l.A = region(size_t(Q) * K * 3 * acc_bytes);
    l.dx = region(size_t(Q) * K * 3 * acc_bytes);
    l.stage = region(size_t(TiledTraits::kWarps) * 16 * 16 * acc_bytes);
    l.rows = region(size_t(2) * Q * acc_bytes);  // dout·out and lse per query
  }
  l.total = at;
  return l;
}

// Sum over the 8 threads of a query, in reduce8's order (dsa3d_tile.h); every thread gets the sum.
template <typename acc_t>
__device__ __forceinline__ acc_t sum8(acc_t x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x;
}

template <typename acc_t>
__device__ __forceinline__ acc_t max8(acc_t x) {
  for (int o = 4; o > 0; o /= 2) {
    const acc_t y = __shfl_xor_sync(0xffffffffu, x, o);
    x = y > x ? y : x;
  }
  return x;
}

__device__ __forceinline__ Geometry geometry_of(const Dsa3dShape& s) {
  return make_geometry(int(s.T), int(s.H), int(s.W), int(s.kt), int(s.kh), int(s.kw));
}

// The block's halo: min/max of every corner of every sample of its valid queries (block-wide).
template <typename acc_t>
__device__ Halo block_halo(const Geometry& geo, const Query& qr, const acc_t* off, int c, int* lo_s, int* hi_s) {
  if (threadIdx.x < 3) lo_s[threadIdx.x] = INT_MAX, hi_s[threadIdx.x] = -1;
  __syncthreads();
  int lo[3] = {INT_MAX, INT_MAX, INT_MAX}, hi[3] = {-1, -1, -1};
  if (qr.valid)
    for (int j = c; j < geo.K; j += kCorners) halo_include(sample_point<acc_t>(geo, qr, j, off + 3 * j), lo, hi);
  for (int a = 0; a < 3; ++a) {
    atomicMin(lo_s + a, lo[a]);  // min and max are exact: the order does not matter
    atomicMax(hi_s + a, hi[a]);
  }
  __syncthreads();
  return make_halo(lo_s, hi_s);
}

// rows[r][0, ld) = x[b, token_s[r], m, :] (zero for invalid rows and the padding columns).
template <typename scalar_t>
__device__ void stage_rows(const scalar_t* x, const int* token_s, int rows, int64_t b, int64_t N, int64_t M, int64_t m,
                           int64_t d, int ld, scalar_t* dst) {
  for (int i = threadIdx.x; i < rows * ld; i += blockDim.x) {
    const int r = i / ld, col = i % ld;
    const int token = token_s[r];
    dst[i] = (token >= 0 && col < d) ? x[((b * N + token) * M + m) * d + col] : zero_of<scalar_t>();
  }
}

// out[16][64] (row stride ldo, acc_t) = a[16][dp] · rowsᵀ where rows = [64][dp]: S or T of a sub-chunk.
template <typename scalar_t, typename acc_t>
__device__ void scores_sub(const scalar_t* a, const scalar_t* rows, const Layout& lay, acc_t* out, int ldo) {
  if constexpr (kTensorCores<scalar_t>) {
    const int w = threadIdx.x / 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < lay.dp; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::col_major> fb;  // rowsᵀ
      wmma::load_matrix_sync(fa, a + kk, lay.ld);
      wmma::load_matrix_sync(fb, rows + w * 16 * lay.ld + kk, lay.ld);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + w * 16, acc, ldo, wmma::mem_row_major);
  } else {
    for (int i = threadIdx.x; i < TileShape::kQueries * kSubKeys; i += blockDim.x) {
      const int r = i / kSubKeys, col = i % kSubKeys;
      acc_t sum = 0;
      for (int k = 0; k < lay.dp; ++k) sum += to_acc(a[r * lay.ld + k]) * to_acc(rows[col * lay.ld + k]);
      out[r * ldo + col] = sum;
    }
  }
}

// P' or dS' columns [col0, col0 + 64) of the fp32 chunk buffer as the input type, for the tensor cores.
template <typename scalar_t, typename acc_t>
__device__ void round_sub(const acc_t* chunk_buf, int chunk, int col0, const Layout& lay, scalar_t* dst) {
  for (int i = threadIdx.x; i < TileShape::kQueries * kSubKeys; i += blockDim.x) {
    const int r = i / kSubKeys, col = i % kSubKeys;
    dst[r * lay.ldp + col] = from_acc<scalar_t>(chunk_buf[r * chunk + col0 + col]);
  }
}

// Accumulators of a [16, dp] product (out or dq): warp w owns column blocks w and w + 4 (dp <= 128).
template <typename scalar_t, typename acc_t>
struct RowAccumulator {
  static constexpr int kBlocks = 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag[kBlocks];  // tensor cores
  acc_t val[16];  // CUDA cores: thread (q, c) owns channels c, c + 8, ... of query q
  __device__ void zero() {
    if constexpr (kTensorCores<scalar_t>) {
      for (int i = 0; i < kBlocks; ++i) wmma::fill_fragment(frag[i], 0.0f);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) val[i] = 0;
    }
  }
  // += coef[16][64] (fp32 chunk buffer, columns col0 ..; rounded copy in coef_b for tensor cores)
  //    · rows[64][dp].
  __device__ void add(const acc_t* coef, int chunk, int col0, const scalar_t* coef_b, const scalar_t* rows,
                      const Layout& lay) {
    if constexpr (kTensorCores<scalar_t>) {
      const int w = threadIdx.x / 32;
      for (int kk = 0; kk < kSubKeys; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, coef_b + kk, lay.ldp);
        for (int i = 0; i < kBlocks; ++i) {
          const int nb = w + TiledTraits::kWarps * i;
          if (nb * 16 >= lay.dp) break;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::row_major> fb;
          wmma::load_matrix_sync(fb, rows + kk * lay.ld + nb * 16, lay.ld);
          wmma::mma_sync(frag[i], fa, fb, frag[i]);
        }
      }
    } else {
      const int q = threadIdx.x / kCorners, c = threadIdx.x % kCorners;
#pragma unroll
      for (int i = 0; i < 16; ++i) {  // unrolled, so val stays in registers
        const int ch = c + kCorners * i;
        if (ch < lay.dp) {
          acc_t sum = val[i];
          for (int l = 0; l < kSubKeys; ++l) sum += coef[q * chunk + col0 + l] * to_acc(rows[l * lay.ld + ch]);
          val[i] = sum;
        }
      }
    }
  }
  // Writes rows of valid queries to dst[b, token, m, :] (staging through `scratch`, [16][dp] acc_t).
  __device__ void write(scalar_t* dst, const int* token_s, int64_t b, int64_t N, int64_t M, int64_t m, int64_t d,
                        const Layout& lay, acc_t* scratch) {
    if constexpr (kTensorCores<scalar_t>) {
      const int w = threadIdx.x / 32;
      for (int i = 0; i < kBlocks; ++i) {
        const int nb = w + TiledTraits::kWarps * i;
        if (nb * 16 >= lay.dp) break;
        wmma::store_matrix_sync(scratch + nb * 16, frag[i], lay.dp, wmma::mem_row_major);
      }
      __syncthreads();
      for (int i = threadIdx.x; i < TileShape::kQueries * d; i += blockDim.x) {
        const int r = int(i / d), col = int(i % d);
        if (token_s[r] >= 0)
          dst[((b * N + token_s[r]) * M + m) * d + col] = from_acc<scalar_t>(scratch[r * lay.dp + col]);
      }
    } else {
      const int q = threadIdx.x / kCorners, c = threadIdx.x % kCorners;
      if (token_s[q] < 0) return;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int ch = c + kCorners * i;
        if (ch < d) dst[((b * N + token_s[q]) * M + m) * d + ch] = from_acc<scalar_t>(val[i]);
      }
    }
  }
};

// ---- forward ------------------------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(TiledTraits::kThreads, 2)
    tiled_forward_kernel(const Dsa3dForwardParams p, const Layout lay) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int lo_s[3], hi_s[3], token_s[TileShape::kQueries], key_s[kSubKeys];
  auto* q_s = reinterpret_cast<scalar_t*>(smem + lay.q);
  auto* kv_s = reinterpret_cast<scalar_t*>(smem + lay.kv);
  auto* s_s = reinterpret_cast<acc_t*>(smem + lay.s);
  auto* pb_s = reinterpret_cast<scalar_t*>(smem + lay.pb);
  auto* logit_s = reinterpret_cast<acc_t*>(smem + lay.logit);

  const Dsa3dShape& s = p.shape;
  const Geometry geo = geometry_of(s);
  const int K = geo.K, tile = blockIdx.x, chunk = lay.chunk;
  const int64_t m = blockIdx.y, b = blockIdx.z, N = s.tokens(), M = s.M, d = s.d, g = m / (M / s.G);
  const int q = threadIdx.x / kCorners, c = threadIdx.x % kCorners;
  const Query qr = tile_query(geo, tile, q);
  const auto* off = static_cast<const acc_t*>(p.offsets) + ((b * N + qr.token) * s.G + g) * K * 3;
  const auto* bias = static_cast<const acc_t*>(p.bias);
  const acc_t scale = acc_t(s.scale);
  if (c == 0) token_s[q] = qr.valid ? qr.token : -1;
  const Halo halo = block_halo<acc_t>(geo, qr, off, c, lo_s, hi_s);  // syncs: token_s is visible
  const int HV = halo.volume();

  stage_rows(static_cast<const scalar_t*>(p.q), token_s, TileShape::kQueries, b, N, M, m, d, lay.ld, q_s);
  for (int i = threadIdx.x; i < TileShape::kQueries * K; i += blockDim.x) logit_s[i] = 0;

  // Logits, chunk by chunk: S = Q·K_chunkᵀ, then each sample's 8 corner terms.
  for (int base = 0; base < HV; base += chunk) {
    const int n = min(chunk, HV - base);
    for (int sub = 0; sub < n; sub += kSubKeys) {
      __syncthreads();  // kv_s and key_s are free
      if (threadIdx.x < kSubKeys)
        key_s[threadIdx.x] = sub + int(threadIdx.x) < n ? halo_token(geo, halo, base + sub + threadIdx.x) : -1;
      __syncthreads();
      stage_rows(static_cast<const scalar_t*>(p.k), key_s, kSubKeys, b, N, M, m, d, lay.ld, kv_s);
      __syncthreads();
      scores_sub<scalar_t, acc_t>(q_s, kv_s, lay, s_s + sub, chunk);
    }
    __syncthreads();
    for (int j = 0; j < K; ++j) {
      acc_t term = 0;
      if (qr.valid) {
        const Corner<acc_t> k = corner_of(sample_point<acc_t>(geo, qr, j, off + 3 * j), halo, c);
        if (in_chunk(k, base, n)) term = k.w * s_s[q * chunk + k.L - base];
      }
      term = sum8(term);
      if (c == 0) logit_s[q * K + j] += term;
    }
  }
  __syncthreads();

  // Softmax: thread c of a query holds the samples j ≡ c (mod 8) (dsa3d_tile.h: part_max, part_sum_exp).
  {
    acc_t* row = logit_s + q * K;
    for (int j = c; j < K; j += kCorners) row[j] = row[j] * scale + (bias ? bias[m * K + j] : acc_t(0));
    const acc_t mx = max8(part_max(row, K, c));
    const acc_t l = mx + dsa3d_math::log_of(sum8(part_sum_exp(row, K, c, mx)));
    for (int j = c; j < K; j += kCorners) row[j] = dsa3d_math::exp_of(row[j] - l);
    if (c == 0 && qr.valid) static_cast<acc_t*>(p.lse)[(b * N + qr.token) * M + m] = l;
  }
  __syncthreads();

  // out = P'·V, chunk by chunk.
  RowAccumulator<scalar_t, acc_t> out;
  out.zero();
  for (int base = 0; base < HV; base += chunk) {
    const int n = min(chunk, HV - base);
    for (int i = threadIdx.x; i < TileShape::kQueries * chunk; i += blockDim.x) s_s[i] = 0;
    __syncthreads();
    for (int j = 0; j < K; ++j) {
      if (qr.valid) {
        const Corner<acc_t> k = corner_of(sample_point<acc_t>(geo, qr, j, off + 3 * j), halo, c);
        // The 8 threads of a query hit 8 distinct keys (or weight-0 ones); steps are ordered by the
        // warp barrier, so each element adds its samples in j order.
        if (in_chunk(k, base, n)) s_s[q * chunk + k.L - base] += logit_s[q * K + j] * k.w;
      }
      __syncwarp();
    }
    for (int sub = 0; sub < n; sub += kSubKeys) {
      __syncthreads();
      if (threadIdx.x < kSubKeys)
        key_s[threadIdx.x] = sub + int(threadIdx.x) < n ? halo_token(geo, halo, base + sub + threadIdx.x) : -1;
      __syncthreads();
      stage_rows(static_cast<const scalar_t*>(p.v), key_s, kSubKeys, b, N, M, m, d, lay.ld, kv_s);
      if constexpr (kTensorCores<scalar_t>) round_sub(s_s, chunk, sub, lay, pb_s);
      __syncthreads();
      out.add(s_s, chunk, sub, pb_s, kv_s, lay);
    }
    __syncthreads();
  }
  out.write(static_cast<scalar_t*>(p.out), token_s, b, N, M, m, d, lay, s_s);
}

// ---- backward -----------------------------------------------------------------------------------------

// Which tiles a launch runs: start + period · (i, j, k) for (i, j, k) < count, per axis (all tiles:
// start 0, period 1).
struct TileSet {
  int start[3], period[3], count[3];
};

__device__ __forceinline__ int tile_of(const Geometry& geo, const TileSet& ts, int x) {
  const int i = x / (ts.count[1] * ts.count[2]), j = (x / ts.count[2]) % ts.count[1], k = x % ts.count[2];
  return ((ts.start[0] + ts.period[0] * i) * geo.tiles_h + (ts.start[1] + ts.period[1] * j)) * geo.tiles_w +
         (ts.start[2] + ts.period[2] * k);
}

// dst[b, key row, m, nb·16 ..] (+)= the warp's 16×16 block in stage (row = key of the sub-chunk).
template <typename acc_t>
__device__ void merge_block(const acc_t* stage, acc_t* dst, const int* key_s, int key0, int nb, int64_t b, int64_t N,
                            int64_t M, int64_t m, int64_t d, bool atomic) {
  const int lane = threadIdx.x % 32, r = lane / 2, c0 = (lane % 2) * 8;
  const int token = key_s[key0 + r];
  if (token < 0) return;
  acc_t* row = dst + ((b * N + token) * M + m) * d;
  for (int i = 0; i < 8; ++i) {
    const int ch = nb * 16 + c0 + i;
    if (ch >= d) break;
    if (atomic) atomicAdd(row + ch, stage[r * 16 + c0 + i]);
    else row[ch] += stage[r * 16 + c0 + i];
  }
}

// dst[key, :] (+)= coefᵀ · rows for the sub-chunk's 64 keys: coef [16][64] (fp32 chunk buffer; rounded
// copy coef_b for tensor cores), rows [16][dp] (q or dout).
template <typename scalar_t, typename acc_t>
__device__ void scatter_sub(const acc_t* coef, int chunk, int col0, const scalar_t* coef_b, const scalar_t* rows,
                            const Layout& lay, acc_t* stage_s, acc_t* dst, const int* key_s, int64_t b, int64_t N,
                            int64_t M, int64_t m, int64_t d, bool atomic) {
  if constexpr (kTensorCores<scalar_t>) {
    const int w = threadIdx.x / 32;
    acc_t* stage = stage_s + w * 256;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::col_major> fa;  // coef_bᵀ: keys × queries
    wmma::load_matrix_sync(fa, coef_b + w * 16, lay.ldp);
    for (int nb = 0; nb * 16 < lay.dp; ++nb) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::row_major> fb;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      wmma::load_matrix_sync(fb, rows + nb * 16, lay.ld);
      wmma::mma_sync(acc, fa, fb, acc);
      wmma::store_matrix_sync(stage, acc, 16, wmma::mem_row_major);
      __syncwarp();
      merge_block(stage, dst, key_s, w * 16, nb, b, N, M, m, d, atomic);
      __syncwarp();
    }
  } else {
    for (int i = threadIdx.x; i < kSubKeys * d; i += blockDim.x) {
      const int r = int(i / d), ch = int(i % d);
      const int token = key_s[r];
      if (token < 0) continue;
      acc_t sum = 0;
      for (int qq = 0; qq < TileShape::kQueries; ++qq)
        sum += coef[qq * chunk + col0 + r] * to_acc(rows[qq * lay.ld + ch]);
      acc_t* at = dst + ((b * N + token) * M + m) * d + ch;
      if (atomic) atomicAdd(at, sum);
      else *at += sum;
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(TiledTraits::kThreads, 1)
    tiled_backward_kernel(const Dsa3dBackwardParams p, const Layout lay, const TileSet tiles) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int lo_s[3], hi_s[3], token_s[TileShape::kQueries], key_s[kSubKeys];
  auto* q_s = reinterpret_cast<scalar_t*>(smem + lay.q);
  auto* do_s = reinterpret_cast<scalar_t*>(smem + lay.dout);
  auto* kv_s = reinterpret_cast<scalar_t*>(smem + lay.kv);
  auto* s_s = reinterpret_cast<acc_t*>(smem + lay.s);
  auto* s2_s = reinterpret_cast<acc_t*>(smem + lay.s2);
  auto* pb_s = reinterpret_cast<scalar_t*>(smem + lay.pb);
  auto* dsb_s = reinterpret_cast<scalar_t*>(smem + lay.dsb);
  auto* prob_s = reinterpret_cast<acc_t*>(smem + lay.logit);  // logits, then probabilities
  auto* ds_s = reinterpret_cast<acc_t*>(smem + lay.odv);      // dout·ṽ, then logit gradients
  auto* A_s = reinterpret_cast<acc_t*>(smem + lay.A);
  auto* dx_s = reinterpret_cast<acc_t*>(smem + lay.dx);
  auto* stage_s = reinterpret_cast<acc_t*>(smem + lay.stage);
  auto* D_s = reinterpret_cast<acc_t*>(smem + lay.rows);
  acc_t* lse_s = D_s + TileShape::kQueries;

  const Dsa3dShape& s = p.shape;
  const Geometry geo = geometry_of(s);
  const int K = geo.K, tile = tile_of(geo, tiles, blockIdx.x), chunk = lay.chunk;
  const int64_t m = blockIdx.y, b = blockIdx.z, N = s.tokens(), M = s.M, d = s.d, Mg = M / s.G, g = m / Mg;
  const int q = threadIdx.x / kCorners, c = threadIdx.x % kCorners;
  const Query qr = tile_query(geo, tile, q);
  const auto* off = static_cast<const acc_t*>(p.offsets) + ((b * N + qr.token) * s.G + g) * K * 3;
  const auto* bias = static_cast<const acc_t*>(p.bias);
  const acc_t scale = acc_t(s.scale);
  const bool atomic = !p.deterministic;
  if (c == 0) token_s[q] = qr.valid ? qr.token : -1;
  const Halo halo = block_halo<acc_t>(geo, qr, off, c, lo_s, hi_s);
  const int HV = halo.volume();
  for (int i = threadIdx.x; i < TileShape::kQueries * K * 3; i += blockDim.x) dx_s[i] = 0;

  {
    __syncthreads();  // dx_s is zeroed
    stage_rows(static_cast<const scalar_t*>(p.q), token_s, TileShape::kQueries, b, N, M, m, d, lay.ld, q_s);
    stage_rows(static_cast<const scalar_t*>(p.dout), token_s, TileShape::kQueries, b, N, M, m, d, lay.ld, do_s);
    for (int i = threadIdx.x; i < TileShape::kQueries * K; i += blockDim.x) prob_s[i] = ds_s[i] = 0;
    for (int i = threadIdx.x; i < TileShape::kQueries * K * 3; i += blockDim.x) A_s[i] = 0;
    {
      // dout·out per query: thread c sums the channels ≡ c (mod 8), then sum8.
      acc_t part = 0;
      if (qr.valid) {
        const int64_t row = ((b * N + qr.token) * M + m) * d;
        const auto* o = static_cast<const scalar_t*>(p.out) + row;
        const auto* dout = static_cast<const scalar_t*>(p.dout) + row;
        for (int64_t ch = c; ch < d; ch += kCorners) part += to_acc(o[ch]) * to_acc(dout[ch]);
      }
      part = sum8(part);
      if (c == 0) {
        D_s[q] = part;
        lse_s[q] = qr.valid ? static_cast<const acc_t*>(p.lse)[(b * N + qr.token) * M + m] : acc_t(0);
      }
    }

    // Passes 1 and 2: S = Q·Kᵀ (logits, A) then T = dO·Vᵀ (dout·ṽ, value part of d(offsets)).
    for (int pass = 0; pass < 2; ++pass) {
      const auto* x = static_cast<const scalar_t*>(pass == 0 ? p.k : p.v);
      const scalar_t* rows = pass == 0 ? q_s : do_s;
      for (int base = 0; base < HV; base += chunk) {
        const int n = min(chunk, HV - base);
        for (int sub = 0; sub < n; sub += kSubKeys) {
          __syncthreads();
          if (threadIdx.x < kSubKeys)
            key_s[threadIdx.x] = sub + int(threadIdx.x) < n ? halo_token(geo, halo, base + sub + threadIdx.x) : -1;
          __syncthreads();
          stage_rows(x, key_s, kSubKeys, b, N, M, m, d, lay.ld, kv_s);
          __syncthreads();
          scores_sub<scalar_t, acc_t>(rows, kv_s, lay, s_s + sub, chunk);
        }
        __syncthreads();
        for (int j = 0; j < K; ++j) {
          acc_t tw = 0, ta[3] = {0, 0, 0};
          if (qr.valid) {
            const Corner<acc_t> k = corner_of(sample_point<acc_t>(geo, qr, j, off + 3 * j), halo, c);
            if (in_chunk(k, base, n)) {
              const acc_t sv = s_s[q * chunk + k.L - base];
              tw = k.w * sv;
              for (int a = 0; a < 3; ++a) ta[a] = k.dw[a] * sv;
            }
          }
          tw = sum8(tw);
          for (int a = 0; a < 3; ++a) ta[a] = sum8(ta[a]);
          if (c == 0 && qr.valid) {
            const int at = q * K + j;
            if (pass == 0) {
              prob_s[at] += tw;
              for (int a = 0; a < 3; ++a) A_s[at * 3 + a] += ta[a];
            } else {
              ds_s[at] += tw;
              for (int a = 0; a < 3; ++a) dx_s[at * 3 + a] += prob_s[at] * ta[a];
            }
          }
        }
        __syncthreads();
      }
      if (pass == 0 && c == 0 && qr.valid) {
        // Probabilities from the saved log-sum-exp (thread c = 0 wrote every logit of its query).
        for (int j = 0; j < K; ++j) {
          acc_t& x = prob_s[q * K + j];
          x = dsa3d_math::exp_of(x * scale + (bias ? bias[m * K + j] : acc_t(0)) - lse_s[q]);
        }
      }
    }
    __syncthreads();
    // ds_j = a_j (dout·ṽ_j - dout·out); the key part of d(offsets).
    if (qr.valid) {
      for (int j = c; j < K; j += kCorners) {
        const int at = q * K + j;
        const acc_t ds = prob_s[at] * (ds_s[at] - D_s[q]);
        ds_s[at] = ds;
        for (int a = 0; a < 3; ++a) dx_s[at * 3 + a] += scale * ds * A_s[at * 3 + a];
      }
    }
    __syncthreads();
    if (bias) {
      auto* part = static_cast<acc_t*>(p.tile_scratch) + ((b * geo.tiles() + tile) * M + m) * K;
      for (int j = threadIdx.x; j < K; j += blockDim.x) {
        acc_t sum = 0;
        for (int qq = 0; qq < TileShape::kQueries; ++qq)
          if (token_s[qq] >= 0) sum += ds_s[qq * K + j];
        part[j] = sum;
      }
    }

    // Pass 3: P' and dS' per chunk; dV, dK merged over the halo; dQ accumulated.
    RowAccumulator<scalar_t, acc_t> dq;
    dq.zero();
    for (int base = 0; base < HV; base += chunk) {
      const int n = min(chunk, HV - base);
      __syncthreads();
      for (int i = threadIdx.x; i < TileShape::kQueries * chunk; i += blockDim.x) s_s[i] = s2_s[i] = 0;
      __syncthreads();
      for (int j = 0; j < K; ++j) {
        if (qr.valid) {
          const Corner<acc_t> k = corner_of(sample_point<acc_t>(geo, qr, j, off + 3 * j), halo, c);
          if (in_chunk(k, base, n)) {
            s_s[q * chunk + k.L - base] += prob_s[q * K + j] * k.w;
            s2_s[q * chunk + k.L - base] += scale * ds_s[q * K + j] * k.w;
          }
        }
        __syncwarp();
      }
      for (int sub = 0; sub < n; sub += kSubKeys) {
        __syncthreads();
        if (threadIdx.x < kSubKeys)
          key_s[threadIdx.x] = sub + int(threadIdx.x) < n ? halo_token(geo, halo, base + sub + threadIdx.x) : -1;
        __syncthreads();
        stage_rows(static_cast<const scalar_t*>(p.k), key_s, kSubKeys, b, N, M, m, d, lay.ld, kv_s);
        if constexpr (kTensorCores<scalar_t>) {
          round_sub(s_s, chunk, sub, lay, pb_s);
          round_sub(s2_s, chunk, sub, lay, dsb_s);
        }
        __syncthreads();
        scatter_sub(s_s, chunk, sub, pb_s, do_s, lay, stage_s, static_cast<acc_t*>(p.dv), key_s, b, N, M, m, d, atomic);
        scatter_sub(s2_s, chunk, sub, dsb_s, q_s, lay, stage_s, static_cast<acc_t*>(p.dk), key_s, b, N, M, m, d,
                    atomic);
        dq.add(s2_s, chunk, sub, dsb_s, kv_s, lay);
      }
    }
    __syncthreads();
    dq.write(static_cast<scalar_t*>(p.dq), token_s, b, N, M, m, d, lay, s_s);
  }
  __syncthreads();
  if (qr.valid) {
    const acc_t* mine = dx_s + q * K * 3;
    if (p.offset_scratch != nullptr) {  // deterministic, several heads a group: this head's partial
      auto* dst = static_cast<acc_t*>(p.offset_scratch) + ((b * N + qr.token) * M + m) * K * 3;
      for (int i = c; i < K * 3; i += kCorners) dst[i] = mine[i];
    } else {
      auto* dst = static_cast<acc_t*>(p.doffsets) + ((b * N + qr.token) * s.G + g) * K * 3;
      if (p.doffsets_accumulated) {
        for (int i = c; i < K * 3; i += kCorners) atomicAdd(dst + i, mine[i]);
      } else {  // one head a group: the block owns the group's d(offsets)
        for (int i = c; i < K * 3; i += kCorners) dst[i] = mine[i];
      }
    }
  }
}

// Deterministic mode with several heads a group: d(offsets)[b, n, g, :] = Σ over the group's heads, in
// head order, of the per-head partials (one thread per element).
template <typename acc_t>
__global__ void tiled_doffsets_kernel(const Dsa3dBackwardParams p) {
  const Dsa3dShape& s = p.shape;
  const int64_t K3 = s.K * 3, n = s.B * s.tokens() * s.G * K3;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t e = i % K3, bng = i / K3, g = bng % s.G, bn = bng / s.G, Mg = s.M / s.G;
  const auto* part = static_cast<const acc_t*>(p.offset_scratch) + (bn * s.M + g * Mg) * K3 + e;
  acc_t sum = 0;
  for (int64_t h = 0; h < Mg; ++h) sum += part[h * K3];
  static_cast<acc_t*>(p.doffsets)[i] = sum;
}

// dbias[m, j] += Σ over (batch, tile) of the partials, in that order.
template <typename acc_t>
__global__ void tiled_dbias_kernel(const Dsa3dBackwardParams p, int64_t units) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, n = p.shape.M * p.shape.K;
  if (i >= n) return;
  const auto* part = static_cast<const acc_t*>(p.tile_scratch);
  acc_t sum = 0;
  for (int64_t u = 0; u < units; ++u) sum += part[u * n + i];
  static_cast<acc_t*>(p.dbias)[i] += sum;
}

// ---- host -----------------------------------------------------------------------------------------------

int scalar_bytes(DsaDtype t) { return t == DsaDtype::kFloat64 ? 8 : t == DsaDtype::kFloat32 ? 4 : 2; }
int acc_bytes(DsaDtype t) { return t == DsaDtype::kFloat64 ? 8 : 4; }

// The device's opt-in shared-memory limit per block, cached per device.
int smem_limit(int device) {
  static std::atomic<int> cached[64] = {};
  if (device < 0 || device >= 64) C10_CUDA_CHECK(cudaGetDevice(&device));
  int v = cached[device].load();
  if (v == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cached[device] = v;
  }
  return v;
}

// The layout with the largest halo chunk that fits `budget` bytes (chunk 0 when not even the smallest
// chunk fits). The chunk never exceeds the volume (rounded up to a sub-chunk).
Layout choose_layout(const Dsa3dShape& s, bool backward, int budget) {
  const int sb = scalar_bytes(s.dtype), ab = acc_bytes(s.dtype);
  const int cap =
      std::max(TiledTraits::kMinChunk,
               int(std::min<int64_t>(TiledTraits::kMaxChunk, (s.tokens() + kSubKeys - 1) / kSubKeys * kSubKeys)));
  Layout best = make_layout(int(s.d), int(s.K), 0, sb, ab, backward);
  for (int chunk = TiledTraits::kMinChunk; chunk <= cap; chunk += kSubKeys) {
    const Layout l = make_layout(int(s.d), int(s.K), chunk, sb, ab, backward);
    if (l.total > size_t(budget)) break;
    best = l;
  }
  return best;
}

std::string unsupported_reason(const Dsa3dShape& s, int device) {
  if (s.d > kCudaTiledMaxHeadDim)
    return "head size d = " + std::to_string(s.d) + " is above its limit " + std::to_string(kCudaTiledMaxHeadDim);
  const int limit = smem_limit(device) - TiledTraits::kStaticSmem;
  for (bool backward : {false, true}) {
    const Layout l =
        make_layout(int(s.d), int(s.K), TiledTraits::kMinChunk, scalar_bytes(s.dtype), acc_bytes(s.dtype), backward);
    if (l.total > size_t(limit))
      return std::string("its ") + (backward ? "backward" : "forward") + " needs " + std::to_string(l.total) +
             " bytes of shared memory per block for K = " + std::to_string(s.K) +
             " samples and d = " + std::to_string(s.d) + ", above this device's limit of " + std::to_string(limit) +
             " bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin)";
  }
  return {};
}

// Raises a kernel's dynamic shared-memory limit to `bytes` unless `allowed` (the caller's static, one
// per kernel instantiation) shows it was already raised that far on `device`.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes, int device, std::atomic<int>* allowed) {
  const bool cached = device >= 0 && device < 64;
  if (cached && allowed[device].load() >= int(bytes)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  if (cached) allowed[device] = std::max(allowed[device].load(), int(bytes));
}

Layout checked_layout(const Dsa3dShape& s, bool backward, int device) {
  const std::string why = unsupported_reason(s, device);
  TORCH_CHECK(why.empty(), "dsa3d: the tiled CUDA kernel cannot run this shape: ", why);
  const int target = backward ? TiledTraits::kBackwardSmemTarget : TiledTraits::kForwardSmemTarget;
  const Layout l = choose_layout(s, backward, std::min(target, smem_limit(device) - TiledTraits::kStaticSmem));
  TORCH_CHECK(l.chunk >= TiledTraits::kMinChunk, "dsa3d: no halo chunk fits the shared memory");  // guarded above
  return l;
}

}  // namespace

std::string dsa3d_cuda_tiled_unsupported(const Dsa3dShape& s, int device) { return unsupported_reason(s, device); }

void dsa3d_forward_cuda_tiled(const Dsa3dForwardParams& p, CUstream_st* stream) {
  const Dsa3dShape& s = p.shape;
  if (s.B * s.tokens() * s.M == 0) return;
  int device;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const Layout lay = checked_layout(s, false, device);
  const Geometry geo = make_geometry(int(s.T), int(s.H), int(s.W), int(s.kt), int(s.kh), int(s.kw));
  TORCH_CHECK(s.M <= 65535 && s.B <= 65535, "dsa3d: the tiled CUDA kernel takes at most 65535 heads and batch entries");
  dtype_switch(s.dtype, [&](auto scalar, auto acc) {
    using scalar_t = decltype(scalar);
    using acc_t = decltype(acc);
    auto kernel = tiled_forward_kernel<scalar_t, acc_t>;
    static std::atomic<int> allowed[64] = {};  // one per instantiation of this generic lambda
    allow_smem(kernel, lay.total, device, allowed);
    kernel<<<dim3(geo.tiles(), unsigned(s.M), unsigned(s.B)), TiledTraits::kThreads, lay.total, stream>>>(p, lay);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void dsa3d_backward_cuda_tiled(const Dsa3dBackwardParams& p, CUstream_st* stream) {
  const Dsa3dShape& s = p.shape;
  if (s.B * s.tokens() * s.M == 0) return;
  int device;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const Layout lay = checked_layout(s, true, device);
  const Geometry geo = make_geometry(int(s.T), int(s.H), int(s.W), int(s.kt), int(s.kh), int(s.kw));
  TORCH_CHECK(s.M <= 65535 && s.B <= 65535, "dsa3d: the tiled CUDA kernel takes at most 65535 heads and batch entries");
  TORCH_CHECK(!p.bias || p.tile_scratch, "dsa3d: the tiled CUDA backward needs its dbias scratch");
  TORCH_CHECK(
      p.doffsets_accumulated == dsa3d_cuda_tiled_accumulates_doffsets(s, p.deterministic) &&
          (p.offset_scratch != nullptr) == dsa3d_cuda_tiled_needs_offset_scratch(s, p.deterministic),
      "dsa3d: the tiled CUDA backward's d(offsets) sum over a group's heads is not set up (zeroed output or partials)");
  // Default: every tile in one launch, dK/dV by atomics. Deterministic: colours of tiles whose halos
  // are disjoint (from the offsets' bound), one launch each, in a fixed order, plain adds.
  int period[3] = {1, 1, 1};
  const int tiles_per_axis[3] = {geo.tiles_t, geo.tiles_h, geo.tiles_w};
  if (p.deterministic) {
    period[0] = colour_period(geo.tiles_t, TileShape::kT, geo.kt, geo.T, p.offset_bound[0]);
    period[1] = colour_period(geo.tiles_h, TileShape::kH, geo.kh, geo.H, p.offset_bound[1]);
    period[2] = colour_period(geo.tiles_w, TileShape::kW, geo.kw, geo.W, p.offset_bound[2]);
  }
  dtype_switch(s.dtype, [&](auto scalar, auto acc) {
    using scalar_t = decltype(scalar);
    using acc_t = decltype(acc);
    auto kernel = tiled_backward_kernel<scalar_t, acc_t>;
    static std::atomic<int> allowed[64] = {};  // one per instantiation of this generic lambda
    allow_smem(kernel, lay.total, device, allowed);
    for (int ct = 0; ct < period[0]; ++ct)
      for (int ch = 0; ch < period[1]; ++ch)
        for (int cw = 0; cw < period[2]; ++cw) {
          TileSet ts;
          const int start[3] = {ct, ch, cw};
          for (int a = 0; a < 3; ++a) {
            ts.start[a] = start[a];
            ts.period[a] = period[a];
            ts.count[a] = (tiles_per_axis[a] - start[a] + period[a] - 1) / period[a];
          }
          const int blocks = ts.count[0] * ts.count[1] * ts.count[2];
          if (blocks == 0) continue;
          kernel<<<dim3(blocks, unsigned(s.M), unsigned(s.B)), TiledTraits::kThreads, lay.total, stream>>>(p, lay, ts);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
    if (p.offset_scratch != nullptr) {
      const int64_t n = s.B * s.tokens() * s.G * s.K * 3;
      tiled_doffsets_kernel<acc_t><<<unsigned((n + TiledTraits::kReduceThreads - 1) / TiledTraits::kReduceThreads),
                                     TiledTraits::kReduceThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (p.dbias) {
      const int64_t n = s.M * s.K;
      tiled_dbias_kernel<acc_t><<<unsigned((n + TiledTraits::kReduceThreads - 1) / TiledTraits::kReduceThreads),
                                  TiledTraits::kReduceThreads, 0, stream>>>(p, s.B * geo.tiles());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace megaslide::ops::detail
