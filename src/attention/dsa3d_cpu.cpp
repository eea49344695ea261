// Fused 3D-DSA on the CPU (docs/3d-dsa.md). Never materialises the N·K·d sampled keys and values: each
// query walks its K samples with an online softmax, reading the 8 trilinear corners of each sample
// straight from k and v. The backward recomputes the samples from the saved log-sum-exp.
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
// Inner loops over d use 8 independent partial sums, a fixed order the compiler vectorises without
// -ffast-math.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "attention/dsa3d_math.h"
#include "attention/dsa3d_params.h"

namespace megaslide::ops::detail {
namespace {

using dsa3d_math::corner_sum;
using dsa3d_math::OnlineSoftmax;
using dsa3d_math::Sample;

// x · y over d elements, x in the input type, y already in acc_t.
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

// y += a · x over d elements.
template <typename scalar_t, typename acc_t>
inline void axpy(acc_t a, const scalar_t* x, acc_t* y, int64_t d) {
  for (int64_t c = 0; c < d; ++c) y[c] += a * static_cast<acc_t>(x[c]);
}

template <typename scalar_t, typename acc_t>
inline void load(const scalar_t* x, acc_t* y, int64_t d) {
  for (int64_t c = 0; c < d; ++c) y[c] = static_cast<acc_t>(x[c]);
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

// The K samples of offset group g for token bn.
template <typename acc_t>
inline void group_samples(const Dsa3dShape& s, const acc_t* offsets, const TokenCoord& tc, int64_t bn, int64_t g,
                          Sample<acc_t>* samples) {
  const acc_t* off = offsets + (bn * s.G + g) * s.K * 3;
  for (int64_t j = 0; j < s.K; ++j)
    dsa3d_math::token_sample<acc_t>(tc.t, tc.h, tc.w, j, off[3 * j], off[3 * j + 1], off[3 * j + 2], s.T, s.H, s.W,
                                    s.kt, s.kh, s.kw, samples[j]);
}

template <typename scalar_t, typename acc_t>
void forward_impl(const Dsa3dForwardParams& p) {
  const Dsa3dShape& s = p.shape;
  const int64_t N = s.tokens(), M = s.M, d = s.d, K = s.K, Mg = s.M / s.G;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const auto* offsets = static_cast<const acc_t*>(p.offsets);
  const auto* bias = static_cast<const acc_t*>(p.bias);
  auto* out = static_cast<scalar_t*>(p.out);
  auto* lse = static_cast<acc_t*>(p.lse);
  const acc_t scale = static_cast<acc_t>(s.scale);

  at::parallel_for(0, s.B * N, 1, [&](int64_t begin, int64_t end) {
    std::vector<Sample<acc_t>> samples(K);
    std::vector<acc_t> qf(d), acc(d);
    acc_t qk[8];
    for (int64_t bn = begin; bn < end; ++bn) {
      const TokenCoord tc = coord_of(s, bn);
      const scalar_t* kb = k + tc.b * N * M * d;
      const scalar_t* vb = v + tc.b * N * M * d;
      for (int64_t g = 0; g < s.G; ++g) {
        group_samples(s, offsets, tc, bn, g, samples.data());
        for (int64_t m = g * Mg; m < (g + 1) * Mg; ++m) {
          load(q + (bn * M + m) * d, qf.data(), d);
          std::fill(acc.begin(), acc.end(), acc_t(0));
          OnlineSoftmax<acc_t> softmax;
          for (int64_t j = 0; j < K; ++j) {
            const Sample<acc_t>& sp = samples[j];
            // Zero-weight corners (integer positions) are skipped: their contribution is exactly 0.
            for (int c = 0; c < 8; ++c)
              qk[c] = sp.weight[c] == acc_t(0) ? acc_t(0) : dot(kb + (sp.index[c] * M + m) * d, qf.data(), d);
            const acc_t logit = corner_sum(sp.weight, qk) * scale + (bias ? bias[m * K + j] : acc_t(0));
            acc_t prob;
            const acc_t rescale = softmax.add(logit, prob);
            if (rescale != acc_t(1))
              for (int64_t c = 0; c < d; ++c) acc[c] *= rescale;
            for (int c = 0; c < 8; ++c)
              if (sp.weight[c] != acc_t(0)) axpy(prob * sp.weight[c], vb + (sp.index[c] * M + m) * d, acc.data(), d);
          }
          const acc_t inv_sum = acc_t(1) / softmax.sum;
          scalar_t* o = out + (bn * M + m) * d;
          for (int64_t c = 0; c < d; ++c) o[c] = static_cast<scalar_t>(acc[c] * inv_sum);
          lse[bn * M + m] = softmax.log_sum_exp();
        }
      }
    }
  });
}

// Backward of tokens [bn_begin, bn_end) for offset groups [g_begin, g_end); dk, dv ([B, N, M, d]) and
// dbias ([M, K], may be null) are accumulated into the given buffers, in token order.
template <typename scalar_t, typename acc_t>
void backward_tokens(const Dsa3dBackwardParams& p, int64_t bn_begin, int64_t bn_end, int64_t g_begin, int64_t g_end,
                     acc_t* dk, acc_t* dv, acc_t* dbias) {
  const Dsa3dShape& s = p.shape;
  const int64_t N = s.tokens(), M = s.M, d = s.d, K = s.K, Mg = s.M / s.G;
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
  std::vector<acc_t> qf(d), dof(d), dqf(d), dx(K * 3);
  acc_t qk[8], odv[8];
  for (int64_t bn = bn_begin; bn < bn_end; ++bn) {
    const TokenCoord tc = coord_of(s, bn);
    const scalar_t* kb = k + tc.b * N * M * d;
    const scalar_t* vb = v + tc.b * N * M * d;
    acc_t* dkb = dk + tc.b * N * M * d;
    acc_t* dvb = dv + tc.b * N * M * d;
    for (int64_t g = g_begin; g < g_end; ++g) {
      group_samples(s, offsets, tc, bn, g, samples.data());
      std::fill(dx.begin(), dx.end(), acc_t(0));
      for (int64_t m = g * Mg; m < (g + 1) * Mg; ++m) {
        const int64_t row = (bn * M + m) * d;
        load(q + row, qf.data(), d);
        load(dout + row, dof.data(), d);
        std::fill(dqf.begin(), dqf.end(), acc_t(0));
        const acc_t dout_dot_out = dot(out + row, dof.data(), d);
        const acc_t lse_v = lse[bn * M + m];
        for (int64_t j = 0; j < K; ++j) {
          const Sample<acc_t>& sp = samples[j];
          for (int c = 0; c < 8; ++c) {
            if (dsa3d_math::corner_is_inert(sp, c)) {
              qk[c] = odv[c] = 0;
            } else {
              qk[c] = dot(kb + (sp.index[c] * M + m) * d, qf.data(), d);
              odv[c] = dot(vb + (sp.index[c] * M + m) * d, dof.data(), d);
            }
          }
          const acc_t logit = corner_sum(sp.weight, qk) * scale + (bias ? bias[m * K + j] : acc_t(0));
          const auto grad = dsa3d_math::sample_grad(logit, lse_v, corner_sum(sp.weight, odv), dout_dot_out);
          const acc_t dq_coef = grad.dlogit * scale;
          if (dbias) dbias[m * K + j] += grad.dlogit;
          dsa3d_math::add_position_grad(sp, qk, odv, dq_coef, grad.prob, dx.data() + 3 * j);
          for (int c = 0; c < 8; ++c) {
            const acc_t w = sp.weight[c];
            if (w == acc_t(0)) continue;
            const int64_t corner = (sp.index[c] * M + m) * d;
            axpy(dq_coef * w, kb + corner, dqf.data(), d);
            axpy(dq_coef * w, qf.data(), dkb + corner, d);
            axpy(grad.prob * w, dof.data(), dvb + corner, d);
          }
        }
        for (int64_t c = 0; c < d; ++c) dq[row + c] = static_cast<scalar_t>(dqf[c]);
      }
      std::copy(dx.begin(), dx.end(), doffsets + (bn * s.G + g) * K * 3);
    }
  }
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

  if (p.deterministic) {
    // Unit (b, g) owns dq/doffsets of its tokens and the dk/dv/dbias rows of group g's heads; batch
    // entry b > 0 adds its dbias into scratch part b - 1.
    std::vector<acc_t*> dbias_parts;
    for (int64_t b = 1; dbias && b < s.B; ++b) dbias_parts.push_back(scratch + (b - 1) * bias_numel);
    at::parallel_for(0, s.B * s.G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / s.G, g = u % s.G;
        acc_t* dbias_b = !dbias ? nullptr : b == 0 ? dbias : dbias_parts[b - 1];
        backward_tokens<scalar_t, acc_t>(p, b * s.tokens(), (b + 1) * s.tokens(), g, g + 1, dk, dv, dbias_b);
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
      backward_tokens<scalar_t, acc_t>(p, bn_begin, bn_end, 0, s.G, dk_c, dv_c, dbias_c);
    }
  });
  add_in_order(dk, dk_parts, volume);
  add_in_order(dv, dv_parts, volume);
  if (dbias) add_in_order(dbias, dbias_parts, bias_numel);
}

}  // namespace

void dsa3d_forward_cpu(const Dsa3dForwardParams& p) {
  dispatch_dtype<c10::BFloat16, c10::Half>(
      p.shape.dtype, [&](auto scalar, auto acc) { forward_impl<decltype(scalar), decltype(acc)>(p); });
}

void dsa3d_backward_cpu(const Dsa3dBackwardParams& p) {
  dispatch_dtype<c10::BFloat16, c10::Half>(
      p.shape.dtype, [&](auto scalar, auto acc) { backward_impl<decltype(scalar), decltype(acc)>(p); });
}

}  // namespace megaslide::ops::detail
