#include "megaslide/attention/context_parallel.h"

#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>

namespace megaslide::ops {

FrameSplit FrameSplit::balanced(int64_t frames, int64_t ranks) {
  TORCH_CHECK(ranks >= 1 && frames >= ranks, "FrameSplit: ", frames, " frames cannot be split over ", ranks,
              " ranks (each rank needs at least one frame)");
  return {frames, ranks};
}

int64_t FrameSplit::begin(int64_t r) const {
  const int64_t base = frames / ranks, extra = frames % ranks;
  return r * base + std::min(r, extra);
}

std::pair<int64_t, int64_t> context_slab(const FrameSplit& split, int64_t r, int64_t kt, double reach) {
  const int64_t T = split.frames, k = std::min(kt, T);
  // One frame more than the farthest sample reaches: a sample never lands on an inner edge, where the clamp (and
  // the position's zero gradient there) would differ from the whole grid's.
  const int64_t h = k / 2 + static_cast<int64_t>(std::floor(reach)) + 1;
  int64_t g0 = std::max<int64_t>(0, split.begin(r) - h), g1 = std::min(T, split.end(r) + h);
  while (g1 - g0 < k) {  // the effective kernel of the slab must be the grid's
    if (g0 > 0) {
      --g0;
    } else {
      ++g1;
    }
  }
  return {g0, g1};
}

namespace {

// Who sends whom which frames: for every other rank, the frames of my own slab its extended slab covers (indices
// into my frames), and the frames of its own slab my extended slab covers (indices into my extended slab).
struct HaloPlan {
  int64_t dim = 1;                      // the frames' dimension
  int64_t own_begin = 0, own_size = 0;  // my frames within my extended slab
  int64_t slab = 0;                     // my extended slab's length
  std::vector<int64_t> send_peer, send_begin, send_size;
  std::vector<int64_t> recv_peer, recv_begin, recv_size;
};

// `slab_of(p)`: the frames [g0, g1) rank p's extended slab covers (its own among them).
HaloPlan plan_halo(const FrameSplit& split, int64_t me, int64_t dim,
                   const std::function<std::pair<int64_t, int64_t>(int64_t)>& slab_of) {
  HaloPlan plan;
  plan.dim = dim;
  const auto [g0, g1] = slab_of(me);
  const int64_t t0 = split.begin(me), t1 = split.end(me);
  plan.own_begin = t0 - g0;
  plan.own_size = t1 - t0;
  plan.slab = g1 - g0;
  for (int64_t p = 0; p < split.ranks; ++p) {
    if (p == me) continue;
    const auto [p0, p1] = slab_of(p);
    const int64_t s0 = std::max(p0, t0), s1 = std::min(p1, t1);
    if (s1 > s0) {
      plan.send_peer.push_back(p);
      plan.send_begin.push_back(s0 - t0);
      plan.send_size.push_back(s1 - s0);
    }
    const int64_t r0 = std::max(g0, split.begin(p)), r1 = std::min(g1, split.end(p));
    if (r1 > r0) {
      plan.recv_peer.push_back(p);
      plan.recv_begin.push_back(r0 - g0);
      plan.recv_size.push_back(r1 - r0);
    }
  }
  return plan;
}

// Frames [begin, begin + size) of dimension `dim` of `t`, contiguous (a message).
at::Tensor frames_of(const at::Tensor& t, int64_t dim, int64_t begin, int64_t size) {
  return t.narrow(dim, begin, size).contiguous();
}

at::Tensor buffer_like(const at::Tensor& t, int64_t dim, int64_t frames) {
  auto sizes = t.sizes().vec();
  sizes[static_cast<size_t>(dim)] = frames;
  return at::empty(sizes, t.options());
}

// [.., T_r, ...] (the frames in dimension plan.dim) -> [.., slab, ...]: my frames and the halo frames of the other
// ranks; the backward sends the halo frames' gradients back to their owners, which add them to their own frames'.
class HaloGather : public torch::autograd::Function<HaloGather> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& kv, FrameExchange* group,
                            const HaloPlan& plan) {
    const int64_t dim = plan.dim;
    auto slab = buffer_like(kv, dim, plan.slab);
    slab.narrow(dim, plan.own_begin, plan.own_size).copy_(kv);
    std::vector<std::pair<int64_t, at::Tensor>> sends, recvs;
    for (size_t i = 0; i < plan.send_peer.size(); ++i)
      sends.emplace_back(plan.send_peer[i], frames_of(kv, dim, plan.send_begin[i], plan.send_size[i]));
    for (size_t i = 0; i < plan.recv_peer.size(); ++i)
      recvs.emplace_back(plan.recv_peer[i], buffer_like(kv, dim, plan.recv_size[i]));
    group->exchange(sends, recvs);
    for (size_t i = 0; i < recvs.size(); ++i)
      slab.narrow(dim, plan.recv_begin[i], plan.recv_size[i]).copy_(recvs[i].second);
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["slab"] = at::empty({0}, slab.options());  // the dtype and device of a missing gradient's zeros
    ctx->saved_data["sizes"] = slab.sizes().vec();
    ctx->saved_data["own"] = std::vector<int64_t>{plan.own_begin, plan.own_size, dim};
    // The backward's messages are the forward's, reversed.
    ctx->saved_data["send"] = flatten(plan.recv_peer, plan.recv_begin, plan.recv_size);
    ctx->saved_data["recv"] = flatten(plan.send_peer, plan.send_begin, plan.send_size);
    return slab;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto* group = reinterpret_cast<FrameExchange*>(ctx->saved_data["group"].toInt());
    const auto own = ctx->saved_data["own"].toIntVector();
    const auto send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    const at::Tensor g = grad_outputs[0].defined() ? grad_outputs[0]
                                                   : at::zeros(ctx->saved_data["sizes"].toIntVector(),
                                                               ctx->saved_data["slab"].toTensor().options());
    // Every rank takes part in the exchange, also one whose slab received no gradient.
    const int64_t dim = own[2];
    auto local = g.narrow(dim, own[0], own[1]).clone();
    std::vector<std::pair<int64_t, at::Tensor>> sends, recvs;
    for (size_t i = 0; i < send.size(); i += 3)
      sends.emplace_back(send[i], frames_of(g, dim, send[i + 1], send[i + 2]));
    for (size_t i = 0; i < recv.size(); i += 3) recvs.emplace_back(recv[i], buffer_like(g, dim, recv[i + 2]));
    group->exchange(sends, recvs);
    for (size_t i = 0; i < recvs.size(); ++i) local.narrow(dim, recv[3 * i + 1], recv[3 * i + 2]).add_(recvs[i].second);
    return {local, at::Tensor(), at::Tensor()};
  }

 private:
  static std::vector<int64_t> flatten(const std::vector<int64_t>& peer, const std::vector<int64_t>& begin,
                                      const std::vector<int64_t>& size) {
    std::vector<int64_t> out;
    for (size_t i = 0; i < peer.size(); ++i) out.insert(out.end(), {peer[i], begin[i], size[i]});
    return out;
  }
};

// `x` [B, T_r, ...] placed at frames [own_begin, own_begin + T_r) of zeros [B, slab, ...] (differentiable).
at::Tensor pad_frames(const at::Tensor& x, const HaloPlan& plan) {
  auto below = x.sizes().vec(), above = x.sizes().vec();
  below[1] = plan.own_begin;
  above[1] = plan.slab - plan.own_begin - plan.own_size;
  return torch::cat({torch::zeros(below, x.options()), x, torch::zeros(above, x.options())}, 1);
}

// The all-to-alls of Ulysses between the token layout [B, N_r, M, d] (this rank's tokens, every head) and the head
// layout [B, N, M / n, d] (every token, this rank's heads). `to_heads` chooses the direction; the backward is the
// other direction.
struct UlyssesLayout {
  std::vector<int64_t> tokens;  // per rank
  int64_t heads_per_rank = 0;
};

at::Tensor tokens_to_heads(const at::Tensor& x, const UlyssesLayout& layout, FrameExchange& group) {
  const int64_t me = group.rank(), n = group.size(), h = layout.heads_per_rank;
  std::vector<at::Tensor> parts(static_cast<size_t>(n));
  std::vector<std::pair<int64_t, at::Tensor>> sends, recvs;
  for (int64_t p = 0; p < n; ++p) {
    auto mine = x.narrow(2, p * h, h).contiguous();  // rank p's heads of my tokens
    if (p == me) {
      parts[static_cast<size_t>(p)] = mine;
      continue;
    }
    sends.emplace_back(p, mine);
    auto sizes = x.sizes().vec();
    sizes[1] = layout.tokens[static_cast<size_t>(p)], sizes[2] = h;
    parts[static_cast<size_t>(p)] = at::empty(sizes, x.options());
    recvs.emplace_back(p, parts[static_cast<size_t>(p)]);
  }
  group.exchange(sends, recvs);
  return torch::cat(parts, 1);
}

at::Tensor heads_to_tokens(const at::Tensor& y, const UlyssesLayout& layout, FrameExchange& group) {
  const int64_t me = group.rank(), n = group.size();
  std::vector<at::Tensor> parts(static_cast<size_t>(n));
  std::vector<std::pair<int64_t, at::Tensor>> sends, recvs;
  int64_t begin = 0;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t count = layout.tokens[static_cast<size_t>(p)];
    auto theirs = y.narrow(1, begin, count).contiguous();  // rank p's tokens of my heads
    begin += count;
    if (p == me) {
      parts[static_cast<size_t>(p)] = theirs;
      continue;
    }
    sends.emplace_back(p, theirs);
    auto sizes = y.sizes().vec();
    sizes[1] = layout.tokens[static_cast<size_t>(me)];
    parts[static_cast<size_t>(p)] = at::empty(sizes, y.options());
    recvs.emplace_back(p, parts[static_cast<size_t>(p)]);
  }
  group.exchange(sends, recvs);
  return torch::cat(parts, 2);
}

class UlyssesAllToAll : public torch::autograd::Function<UlyssesAllToAll> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, FrameExchange* group,
                            const UlyssesLayout& layout, bool to_heads) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["tokens"] = layout.tokens;
    ctx->saved_data["heads"] = layout.heads_per_rank;
    ctx->saved_data["to_heads"] = to_heads;
    return to_heads ? tokens_to_heads(x, layout, *group) : heads_to_tokens(x, layout, *group);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto* group = reinterpret_cast<FrameExchange*>(ctx->saved_data["group"].toInt());
    const UlyssesLayout layout{ctx->saved_data["tokens"].toIntVector(), ctx->saved_data["heads"].toInt()};
    const bool to_heads = ctx->saved_data["to_heads"].toBool();
    TORCH_CHECK(grad_outputs[0].defined(), "ulysses_attention: the backward needs the output's gradient on every rank");
    const auto g = grad_outputs[0].contiguous();
    return {to_heads ? heads_to_tokens(g, layout, *group) : tokens_to_heads(g, layout, *group), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, int64_t> gather_frame_slab(const at::Tensor& x,
                                                 const std::function<std::pair<int64_t, int64_t>(int64_t)>& slab_of,
                                                 const FrameSplit& split, FrameExchange& group) {
  const int64_t me = group.rank();
  TORCH_CHECK(split.ranks == group.size() && x.dim() >= 2 && x.size(1) == split.size(me), "gather_frame_slab: rank ",
              me, " holds ", split.size(me), " of ", split.frames, " frames; got ", x.sizes());
  for (int64_t p = 0; p < split.ranks; ++p) {
    const auto [g0, g1] = slab_of(p);
    TORCH_CHECK(0 <= g0 && g0 <= split.begin(p) && split.end(p) <= g1 && g1 <= split.frames, "gather_frame_slab: rank ",
                p, "'s slab [", g0, ", ", g1, ") does not hold its frames [", split.begin(p), ", ", split.end(p),
                ") inside the grid's ", split.frames);
  }
  const HaloPlan plan = plan_halo(split, me, 1, slab_of);
  return {HaloGather::apply(x, &group, plan), plan.own_begin};
}

std::pair<at::Tensor, int64_t> gather_frame_halo(const at::Tensor& x, int64_t below, int64_t above,
                                                 const FrameSplit& split, FrameExchange& group) {
  return gather_frame_slab(
      x,
      [&](int64_t p) {
        return std::pair<int64_t, int64_t>{std::max<int64_t>(0, split.begin(p) - below),
                                           std::min(split.frames, split.end(p) + above)};
      },
      split, group);
}

at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const FrameSplit& split,
                             int64_t tokens_per_frame, FrameExchange& group) {
  const int64_t me = group.rank(), n = group.size();
  TORCH_CHECK(split.ranks == n, "ulysses_attention: the split is over ", split.ranks, " ranks, the group has ", n);
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes() &&
                  q.size(1) == split.size(me) * tokens_per_frame,
              "ulysses_attention: rank ", me, " holds frames [", split.begin(me), ", ", split.end(me), ") of ",
              tokens_per_frame, " tokens: expected q, k, v [B, ", split.size(me) * tokens_per_frame, ", M, d], got q ",
              q.sizes());
  const int64_t M = q.size(2);
  TORCH_CHECK(M % n == 0, "ulysses_attention: ", M, " heads cannot be split over the ", n,
              " ranks of the context-parallel group (Ulysses gives each rank M / n heads): choose a group size that "
              "divides the heads");
  UlyssesLayout layout;
  layout.heads_per_rank = M / n;
  for (int64_t p = 0; p < n; ++p) layout.tokens.push_back(split.size(p) * tokens_per_frame);
  const auto heads = [&](const at::Tensor& x) {  // [B, N, M/n, d] -> [B, M/n, N, d]
    return UlyssesAllToAll::apply(x, &group, layout, true).transpose(1, 2);
  };
  const auto out = at::scaled_dot_product_attention(heads(q), heads(k), heads(v));
  return UlyssesAllToAll::apply(out.transpose(1, 2).contiguous(), &group, layout, false);
}

at::Tensor dsa3d_context_parallel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& offsets, const std::optional<at::Tensor>& bias,
                                  std::array<int64_t, 3> kernel, const FrameSplit& split, FrameExchange& group,
                                  DsaImpl impl, bool deterministic, std::optional<double> reach_bound) {
  const int64_t me = group.rank();
  TORCH_CHECK(split.ranks == group.size(), "dsa3d_context_parallel: the split is over ", split.ranks,
              " ranks, the group has ", group.size());
  TORCH_CHECK(q.dim() == 6 && q.size(1) == split.size(me) && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "dsa3d_context_parallel: rank ", me, " holds frames [", split.begin(me), ", ", split.end(me), ") of ",
              split.frames, ": expected q, k, v [B, ", split.size(me), ", H, W, M, d], got q ", q.sizes());
  TORCH_CHECK(offsets.dim() == 7 && offsets.size(1) == q.size(1), "dsa3d_context_parallel: offsets must be [B, ",
              q.size(1), ", H, W, G, K, 3], got ", offsets.sizes());
  // The farthest a temporal offset reaches, anywhere in the group: the halo's width.
  double reach = 0.0;
  if (reach_bound) {
    reach = *reach_bound;
    TORCH_CHECK(std::isfinite(reach) && reach >= 0, "dsa3d_context_parallel: the reach bound is ", reach);
  } else {
    const double local_reach = offsets.numel() > 0 ? offsets.select(-1, 0).detach().abs().max().item<double>() : 0.0;
    reach = group.max(local_reach);
    TORCH_CHECK(std::isfinite(reach), "dsa3d_context_parallel: a temporal offset is not finite");
  }
  const HaloPlan plan = plan_halo(split, me, 2, [&](int64_t p) { return context_slab(split, p, kernel[0], reach); });
  const auto kv = HaloGather::apply(torch::stack({k, v}), &group, plan);
  const auto out =
      dsa3d(pad_frames(q, plan), kv[0], kv[1], pad_frames(offsets, plan), bias, kernel, impl, deterministic);
  return out.narrow(1, plan.own_begin, plan.own_size);
}

}  // namespace megaslide::ops
