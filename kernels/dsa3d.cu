// Fused 3D-DSA on the GPU (docs/3d-dsa.md). The per-sample arithmetic (window, corners, trilinear
// weights and their derivatives, online softmax, sample gradients) is src/attention/dsa3d_math.h,
// the same functions the CPU backend runs and the CPU tests check; this file is the thread mapping,
// the warp reductions, the atomics and the launches only.
//
// Thread mapping: one warp per query row; lane l holds channels l, l + 32, ... (kChunks of them, so
// d <= 32·kChunks <= 256). Every lane computes the sample position (cheap, no divergence); dot
// products are lane-partial sums reduced with butterfly shuffles, which leave the identical value in
// every lane.
//   forward   warp per (token, head): online softmax over the K samples; writes out and lse.
//   backward  warp per (token, offset group), heads of the group in turn: recomputes each sample's
//             logit and probability from lse, writes dq and d(offsets) (owned by the warp, so plain
//             stores), and
//               default:        fp32 atomicAdd of dk, dv (into fp32 buffers) and dbias;
//               deterministic:  stores each sample's probability and logit gradient (N·M·K scratch),
//                               then a second kernel scatters dk, dv with one warp per (batch, head,
//                               32 channels) walking tokens and samples in order (plain adds, no
//                               atomics), and a third sums dbias over tokens in order. Slower (the
//                               scatter runs B·M·⌈d/32⌉ warps), bit-identical run to run.
// Everything launches on the stream the API layer passes (LibTorch's current stream) and is checked.
#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "attention/dsa3d_math.h"
#include "attention/dsa3d_params.h"
#include "dsa3d_cuda.cuh"

namespace megaslide::ops::detail {
namespace {

using dsa3d_math::corner_sum;
using dsa3d_math::OnlineSoftmax;
using dsa3d_math::Sample;

// Launch shape, in one place.
struct DsaCudaTraits {
  // 4 warps (128 threads) a block: each warp is independent (no shared memory), so small blocks keep
  // the tail of the grid short; the register-heavy Sample struct (~50 registers) bounds occupancy,
  // not the block size.
  static constexpr int kWarpsPerBlock = 4;
  static constexpr int kThreads = kWarpsPerBlock * 32;
  // Threads a block for the dbias reduction (one thread per bias element).
  static constexpr int kReduceThreads = 256;
};

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

struct WarpIndex {
  int64_t warp;
  int lane;
};

__device__ __forceinline__ WarpIndex warp_index() {
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  return {thread / 32, int(threadIdx.x % 32)};
}

__device__ __forceinline__ void token_coord(const Dsa3dShape& s, int64_t bn, int64_t& t, int64_t& h, int64_t& w) {
  const int64_t n = bn % s.tokens();
  t = n / (s.H * s.W);
  h = (n / s.W) % s.H;
  w = n % s.W;
}

template <typename acc_t>
__device__ __forceinline__ void load_sample(const Dsa3dShape& s, const acc_t* offsets, int64_t bn, int64_t g, int64_t j,
                                            int64_t t, int64_t h, int64_t w, Sample<acc_t>& sp) {
  const acc_t* off = offsets + ((bn * s.G + g) * s.K + j) * 3;
  dsa3d_math::token_sample<acc_t>(t, h, w, j, off[0], off[1], off[2], s.T, s.H, s.W, s.kt, s.kh, s.kw, sp);
}

template <typename scalar_t, typename acc_t, int kChunks>
__global__ void __launch_bounds__(DsaCudaTraits::kThreads) forward_kernel(const Dsa3dForwardParams p) {
  const Dsa3dShape& s = p.shape;
  const int64_t N = s.tokens(), M = s.M, d = s.d, K = s.K;
  const WarpIndex wi = warp_index();
  if (wi.warp >= s.B * N * M) return;  // whole warps exit together
  const int64_t bn = wi.warp / M, m = wi.warp % M, g = m / (M / s.G), b = bn / N;
  int64_t t, h, w;
  token_coord(s, bn, t, h, w);
  const auto* q = static_cast<const scalar_t*>(p.q) + (bn * M + m) * d;
  const auto* kb = static_cast<const scalar_t*>(p.k) + b * N * M * d + m * d;
  const auto* vb = static_cast<const scalar_t*>(p.v) + b * N * M * d + m * d;
  const auto* bias = static_cast<const acc_t*>(p.bias);
  const acc_t scale = acc_t(s.scale);

  acc_t qv[kChunks], acc[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = wi.lane + 32 * i;
    qv[i] = c < d ? to_acc(q[c]) : acc_t(0);
    acc[i] = 0;
  }
  OnlineSoftmax<acc_t> softmax;
  for (int64_t j = 0; j < K; ++j) {
    Sample<acc_t> sp;
    load_sample(s, static_cast<const acc_t*>(p.offsets), bn, g, j, t, h, w, sp);
    acc_t qk[8];
#pragma unroll
    for (int corner = 0; corner < 8; ++corner) {
      qk[corner] = 0;
      if (sp.weight[corner] == acc_t(0)) continue;
      const scalar_t* kc = kb + sp.index[corner] * M * d;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int64_t c = wi.lane + 32 * i;
        if (c < d) qk[corner] += qv[i] * to_acc(kc[c]);
      }
    }
    const acc_t logit = warp_sum(corner_sum(sp.weight, qk)) * scale + (bias ? bias[m * K + j] : acc_t(0));
    acc_t prob;
    const acc_t rescale = softmax.add(logit, prob);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) acc[i] *= rescale;
#pragma unroll
    for (int corner = 0; corner < 8; ++corner) {
      if (sp.weight[corner] == acc_t(0)) continue;
      const scalar_t* vc = vb + sp.index[corner] * M * d;
      const acc_t pw = prob * sp.weight[corner];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int64_t c = wi.lane + 32 * i;
        if (c < d) acc[i] += pw * to_acc(vc[c]);
      }
    }
  }
  auto* out = static_cast<scalar_t*>(p.out) + (bn * M + m) * d;
  const acc_t inv_sum = acc_t(1) / softmax.sum;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int64_t c = wi.lane + 32 * i;
    if (c < d) out[c] = from_acc<scalar_t>(acc[i] * inv_sum);
  }
  if (wi.lane == 0) static_cast<acc_t*>(p.lse)[bn * M + m] = softmax.log_sum_exp();
}

template <typename scalar_t, typename acc_t, int kChunks, bool kDeterministic>
__global__ void __launch_bounds__(DsaCudaTraits::kThreads) backward_kernel(const Dsa3dBackwardParams p) {
  const Dsa3dShape& s = p.shape;
  const int64_t N = s.tokens(), M = s.M, d = s.d, K = s.K, Mg = s.M / s.G;
  const WarpIndex wi = warp_index();
  if (wi.warp >= s.B * N * s.G) return;
  const int64_t bn = wi.warp / s.G, g = wi.warp % s.G, b = bn / N;
  int64_t t, h, w;
  token_coord(s, bn, t, h, w);
  const auto* bias = static_cast<const acc_t*>(p.bias);
  const auto* offsets = static_cast<const acc_t*>(p.offsets);
  auto* doffsets = static_cast<acc_t*>(p.doffsets) + (bn * s.G + g) * K * 3;
  auto* dbias = static_cast<acc_t*>(p.dbias);
  const acc_t scale = acc_t(s.scale);

  for (int64_t m = g * Mg; m < (g + 1) * Mg; ++m) {
    const int64_t row = (bn * M + m) * d;
    const auto* q = static_cast<const scalar_t*>(p.q) + row;
    const auto* out = static_cast<const scalar_t*>(p.out) + row;
    const auto* dout = static_cast<const scalar_t*>(p.dout) + row;
    const auto* kb = static_cast<const scalar_t*>(p.k) + b * N * M * d + m * d;
    const auto* vb = static_cast<const scalar_t*>(p.v) + b * N * M * d + m * d;
    auto* dkb = static_cast<acc_t*>(p.dk) + b * N * M * d + m * d;
    auto* dvb = static_cast<acc_t*>(p.dv) + b * N * M * d + m * d;

    acc_t qv[kChunks], dov[kChunks], dqv[kChunks];
    acc_t dout_dot_out = 0;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t c = wi.lane + 32 * i;
      qv[i] = c < d ? to_acc(q[c]) : acc_t(0);
      dov[i] = c < d ? to_acc(dout[c]) : acc_t(0);
      dout_dot_out += c < d ? dov[i] * to_acc(out[c]) : acc_t(0);
      dqv[i] = 0;
    }
    dout_dot_out = warp_sum(dout_dot_out);
    const acc_t lse = static_cast<const acc_t*>(p.lse)[bn * M + m];

    for (int64_t j = 0; j < K; ++j) {
      Sample<acc_t> sp;
      load_sample(s, offsets, bn, g, j, t, h, w, sp);
      acc_t qk[8], odv[8];
#pragma unroll
      for (int corner = 0; corner < 8; ++corner) {
        qk[corner] = odv[corner] = 0;
        if (dsa3d_math::corner_is_inert(sp, corner)) continue;
        const scalar_t* kc = kb + sp.index[corner] * M * d;
        const scalar_t* vc = vb + sp.index[corner] * M * d;
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const int64_t c = wi.lane + 32 * i;
          if (c < d) {
            qk[corner] += qv[i] * to_acc(kc[c]);
            odv[corner] += dov[i] * to_acc(vc[c]);
          }
        }
      }
      const acc_t logit = warp_sum(corner_sum(sp.weight, qk)) * scale + (bias ? bias[m * K + j] : acc_t(0));
      const auto grad = dsa3d_math::sample_grad(logit, lse, warp_sum(corner_sum(sp.weight, odv)), dout_dot_out);
      const acc_t dq_coef = grad.dlogit * scale;
      // Lane-partial position gradient (linear in qk, odv), then reduced.
      acc_t dx[3] = {0, 0, 0};
      dsa3d_math::add_position_grad(sp, qk, odv, dq_coef, grad.prob, dx);
      dx[0] = warp_sum(dx[0]);
      dx[1] = warp_sum(dx[1]);
      dx[2] = warp_sum(dx[2]);
      if (wi.lane == 0) {
        // The warp owns (token, group): heads add in order, no atomics.
        for (int a = 0; a < 3; ++a) doffsets[j * 3 + a] = (m == g * Mg ? acc_t(0) : doffsets[j * 3 + a]) + dx[a];
        if (kDeterministic) {
          const int64_t at = (bn * M + m) * K + j;
          static_cast<acc_t*>(p.prob_scratch)[at] = grad.prob;
          static_cast<acc_t*>(p.dlogit_scratch)[at] = grad.dlogit;
        } else if (dbias) {
          atomicAdd(dbias + m * K + j, grad.dlogit);
        }
      }
#pragma unroll
      for (int corner = 0; corner < 8; ++corner) {
        const acc_t wgt = sp.weight[corner];
        if (wgt == acc_t(0)) continue;
        const int64_t at = sp.index[corner] * M * d;
        const acc_t dk_coef = dq_coef * wgt, dv_coef = grad.prob * wgt;
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const int64_t c = wi.lane + 32 * i;
          if (c >= d) continue;
          dqv[i] += dk_coef * to_acc(kb[at + c]);
          if (!kDeterministic) {
            atomicAdd(dkb + at + c, dk_coef * qv[i]);
            atomicAdd(dvb + at + c, dv_coef * dov[i]);
          }
        }
      }
    }
    auto* dq = static_cast<scalar_t*>(p.dq) + row;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int64_t c = wi.lane + 32 * i;
      if (c < d) dq[c] = from_acc<scalar_t>(dqv[i]);
    }
  }
}

// Deterministic dk, dv: warp per (batch, head, 32 channels); lane = channel; tokens and samples in order.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(DsaCudaTraits::kThreads) scatter_kv_kernel(const Dsa3dBackwardParams p) {
  const Dsa3dShape& s = p.shape;
  const int64_t N = s.tokens(), M = s.M, d = s.d, K = s.K, chunks = (d + 31) / 32;
  const WarpIndex wi = warp_index();
  if (wi.warp >= s.B * M * chunks) return;
  const int64_t b = wi.warp / (M * chunks), m = (wi.warp / chunks) % M, c = (wi.warp % chunks) * 32 + wi.lane;
  if (c >= d) return;  // no shuffles below
  const int64_t g = m / (M / s.G);
  const auto* offsets = static_cast<const acc_t*>(p.offsets);
  const auto* prob = static_cast<const acc_t*>(p.prob_scratch);
  const auto* dlogit = static_cast<const acc_t*>(p.dlogit_scratch);
  auto* dkb = static_cast<acc_t*>(p.dk) + b * N * M * d + m * d + c;
  auto* dvb = static_cast<acc_t*>(p.dv) + b * N * M * d + m * d + c;
  const acc_t scale = acc_t(s.scale);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t bn = b * N + n;
    int64_t t, h, w;
    token_coord(s, bn, t, h, w);
    const acc_t qc = to_acc(static_cast<const scalar_t*>(p.q)[(bn * M + m) * d + c]);
    const acc_t doc = to_acc(static_cast<const scalar_t*>(p.dout)[(bn * M + m) * d + c]);
    for (int64_t j = 0; j < K; ++j) {
      Sample<acc_t> sp;
      load_sample(s, offsets, bn, g, j, t, h, w, sp);
      const int64_t at = (bn * M + m) * K + j;
      const acc_t dk_coef = dlogit[at] * scale * qc, dv_coef = prob[at] * doc;
      for (int corner = 0; corner < 8; ++corner) {
        const acc_t wgt = sp.weight[corner];
        if (wgt == acc_t(0)) continue;
        dkb[sp.index[corner] * M * d] += wgt * dk_coef;
        dvb[sp.index[corner] * M * d] += wgt * dv_coef;
      }
    }
  }
}

// Deterministic dbias: thread per (head, sample), summing the logit gradients over tokens in order.
template <typename acc_t>
__global__ void reduce_dbias_kernel(const Dsa3dBackwardParams p) {
  const Dsa3dShape& s = p.shape;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.M * s.K) return;
  const auto* dlogit = static_cast<const acc_t*>(p.dlogit_scratch);
  acc_t sum = 0;
  for (int64_t bn = 0; bn < s.B * s.tokens(); ++bn) sum += dlogit[bn * s.M * s.K + i];
  static_cast<acc_t*>(p.dbias)[i] = sum;
}

int64_t blocks_for(int64_t threads, int per_block) { return (threads + per_block - 1) / per_block; }

// Runtime d -> compile-time channel chunks per lane (1, 2, 4 or 8).
template <typename F>
void chunks_switch(int64_t d, F&& f) {
  if (d <= 32) return f(std::integral_constant<int, 1>{});
  if (d <= 64) return f(std::integral_constant<int, 2>{});
  if (d <= 128) return f(std::integral_constant<int, 4>{});
  return f(std::integral_constant<int, 8>{});
}

}  // namespace

void dsa3d_forward_cuda(const Dsa3dForwardParams& p, CUstream_st* stream) {
  const Dsa3dShape& s = p.shape;
  const int64_t warps = s.B * s.tokens() * s.M;
  if (warps == 0) return;
  dtype_switch(s.dtype, [&](auto scalar, auto acc) {
    using scalar_t = decltype(scalar);
    using acc_t = decltype(acc);
    chunks_switch(s.d, [&](auto chunks) {
      forward_kernel<scalar_t, acc_t, decltype(chunks)::value>
          <<<blocks_for(warps, DsaCudaTraits::kWarpsPerBlock), DsaCudaTraits::kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void dsa3d_backward_cuda(const Dsa3dBackwardParams& p, CUstream_st* stream) {
  const Dsa3dShape& s = p.shape;
  const int64_t warps = s.B * s.tokens() * s.G;
  if (warps == 0) return;
  dtype_switch(s.dtype, [&](auto scalar, auto acc) {
    using scalar_t = decltype(scalar);
    using acc_t = decltype(acc);
    chunks_switch(s.d, [&](auto chunks) {
      constexpr int kChunks = decltype(chunks)::value;
      const int64_t blocks = blocks_for(warps, DsaCudaTraits::kWarpsPerBlock);
      if (p.deterministic) {
        backward_kernel<scalar_t, acc_t, kChunks, true><<<blocks, DsaCudaTraits::kThreads, 0, stream>>>(p);
      } else {
        backward_kernel<scalar_t, acc_t, kChunks, false><<<blocks, DsaCudaTraits::kThreads, 0, stream>>>(p);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    if (p.deterministic) {
      const int64_t scatter_warps = s.B * s.M * ((s.d + 31) / 32);
      scatter_kv_kernel<scalar_t, acc_t>
          <<<blocks_for(scatter_warps, DsaCudaTraits::kWarpsPerBlock), DsaCudaTraits::kThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (p.dbias) {
        reduce_dbias_kernel<acc_t>
            <<<blocks_for(s.M * s.K, DsaCudaTraits::kReduceThreads), DsaCudaTraits::kReduceThreads, 0, stream>>>(p);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  });
}

}  // namespace megaslide::ops::detail
