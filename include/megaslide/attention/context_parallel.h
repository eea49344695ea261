// Attention over a context-parallel group: the frames of every sample's token grid split across the group's ranks
// (FrameSplit), each rank holding its frames' tokens. Two operators, each exactly the single-rank one on the whole
// grid: 3D-DSA by a halo exchange with the temporal neighbours (dsa3d_context_parallel), and dense attention by
// DeepSpeed-Ulysses' all-to-all (ulysses_attention).
//
// 3D-DSA over a context-parallel group (docs/3d-dsa.md, "Context parallelism: the halo exchange"): the frames
// of every sample's token grid are split across the group's ranks, and each rank computes the outputs of its
// own frames from its own frames' keys and values and a halo of its temporal neighbours', exchanged point to
// point. The result is exactly the single-rank operator's on the whole grid (dsa3d.h), the gradients of q, k,
// v and the offsets too; the bias' gradient is each rank's share (sum it over the group as the other
// parameters' gradients are summed).
//
// Why a halo suffices. A query at global frame p samples frames in [start(p) − Δ, start(p) + kt − 1 + Δ],
// start(p) = clamp(p − ⌊kt/2⌋, 0, T − kt), Δ the largest |temporal offset|. A rank that holds frames
// [t0, t1) runs the operator on the extended slab [g0, g1) = [max(0, t0 − h), min(T, t1 + h)) with
// h = ⌊kt/2⌋ + ⌊Δ⌋ + 1: inside it no query of [t0, t1) has its window clamped or its samples clamped at an
// inner edge (and the sample-position gradient rule, 0 < x < S − 1, holds as on the whole grid), while at the
// grid's own edges the slab's edge is the grid's. Δ is measured on the offsets given (a max over the group),
// so the result is exact for any offsets, not only those inside the model's offset range; the slab is
// widened where needed so that it is at least min(kt, T) frames long (the effective kernel). The halo
// frames' queries are zeros with zero offsets; their outputs are dropped, and they add nothing to any
// gradient (their output gradient is zero).
//
// Exchange: each rank sends every other rank the frames of its own slab the other's extended slab covers (its
// temporal neighbours for a halo within one slab; more ranks when slabs are thinner than the halo) — k and v in
// one message — and in the backward the gradients of the halo frames go back to their owners, which add them.
// Both are collective over the group: every rank calls dsa3d_context_parallel (and runs its backward) at the
// same point with the same split.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "megaslide/attention/dsa3d.h"

namespace megaslide::ops {

// A group's point-to-point channel for frames (train/distributed.h's Communicator provides one).
class FrameExchange {
 public:
  virtual ~FrameExchange() = default;
  virtual int64_t rank() const = 0;  // in the group
  virtual int64_t size() const = 0;
  // Posts every send (peer, tensor) and receive (peer, tensor) at once, then waits for all of them; each
  // received tensor is filled in place. Tensors are contiguous; peers are group ranks other than rank().
  virtual void exchange(const std::vector<std::pair<int64_t, at::Tensor>>& sends,
                        const std::vector<std::pair<int64_t, at::Tensor>>& recvs) = 0;
  // The maximum of `value` over the group.
  virtual double max(double value) = 0;
};

// How T frames are split over a group of n ranks: rank r holds [begin(r), end(r)), contiguous, in rank
// order, the first T mod n ranks one frame more (every rank at least one frame: T >= n).
struct FrameSplit {
  int64_t frames = 0, ranks = 1;
  static FrameSplit balanced(int64_t frames, int64_t ranks);
  int64_t begin(int64_t r) const;
  int64_t end(int64_t r) const { return begin(r + 1); }
  int64_t size(int64_t r) const { return end(r) - begin(r); }
};

// A rank's place in a context-parallel group for one sample's token grid: the group and how its frames are split.
// What a model's blocks read to run their attention over the group; inactive (no group) for one rank.
struct ContextShard {
  FrameExchange* group = nullptr;  // null: no context parallelism
  FrameSplit split;                // the whole grid's token frames over the group
  bool active() const { return group != nullptr; }
  int64_t rank() const { return group != nullptr ? group->rank() : 0; }
  int64_t begin() const { return group != nullptr ? split.begin(rank()) : 0; }  // this rank's first frame
  // This rank's frames of a grid of `whole` frames (all of them without a group).
  int64_t frames(int64_t whole) const { return group != nullptr ? split.size(rank()) : whole; }
};

// The frames [g0, g1) rank r computes on (its own and its halo), for the kernel's temporal size kt and the
// largest |temporal offset| `reach` (see above).
std::pair<int64_t, int64_t> context_slab(const FrameSplit& split, int64_t r, int64_t kt, double reach);

// dsa3d (dsa3d.h) of this rank's frames: q, k, v [B, T_r, H, W, M, d] and offsets [B, T_r, H, W, G, K, 3] hold
// the frames [split.begin(r), split.end(r)) of the whole grid (r = group.rank()), K the effective kernel of the
// whole grid (T = split.frames); returns those frames' outputs. Differentiable as dsa3d; collective.
// The halo's width comes from the largest |temporal offset| of the group: `reach_bound` when given — a bound on
// it known beforehand, the same on every rank (a module's Δ = r·tanh(o): r, widened for the rounding to the
// offsets' dtype), so that nothing is read back to the host and no all-reduce runs — else measured on the offsets
// (one read to the host and one all-reduce per call). Either gives the same result wherever the bound holds:
// a wider halo only adds frames whose outputs are dropped.
at::Tensor dsa3d_context_parallel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                                  std::array<int64_t, 3> kernel, const FrameSplit& split, FrameExchange& group,
                                  DsaImpl impl = DsaImpl::kAuto, bool deterministic = false,
                                  std::optional<double> reach_bound = std::nullopt);

// The bound on |r·tanh(o)| after rounding to a dtype of at least 8 significand bits (bf16, fp16, float32): r
// widened by 2^-7 of itself, what dsa3d_context_parallel's reach_bound takes for a module's temporal range r.
inline double offset_reach_bound(double range) { return (range < 0 ? -range : range) * (1.0 + 1.0 / 128); }

// `x` [B, T_r, ...] (this rank's frames in dimension 1) extended by up to `below` frames before and `above` after
// from the ranks that hold them (fewer at the grid's ends): returns the extended tensor and the number of frames
// before this rank's own in it. Differentiable: the halo's gradient goes back to its owners. Collective.
std::pair<at::Tensor, int64_t> gather_frame_halo(const at::Tensor& x, int64_t below, int64_t above,
                                                 const FrameSplit& split, FrameExchange& group);

// The general form: rank p's extended frames are slab_of(p) = [g0, g1) ⊇ its own (the same function on every
// rank); returns this rank's frames [g0, g1) and g0's distance to its first own frame. Collective.
std::pair<at::Tensor, int64_t> gather_frame_slab(const at::Tensor& x,
                                                 const std::function<std::pair<int64_t, int64_t>(int64_t)>& slab_of,
                                                 const FrameSplit& split, FrameExchange& group);

// Dense attention over the group (DeepSpeed-Ulysses; docs/distributed.md, "Context parallelism"): q, k, v
// [B, N_r, M, d] are this rank's tokens — frames [split.begin(r), split.end(r)) of `tokens_per_frame` tokens each,
// in order. An all-to-all turns them into every token of M / n heads (n = group.size(); M must be divisible by
// it), scaled dot-product attention runs over all N tokens, and the reverse all-to-all returns this rank's tokens
// of every head: softmax(q·kᵀ/√d)·v over the whole sequence, [B, N_r, M, d]. Differentiable (the backward's
// all-to-alls mirror the forward's); collective.
at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const FrameSplit& split,
                             int64_t tokens_per_frame, FrameExchange& group);

}  // namespace megaslide::ops
