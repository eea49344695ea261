#include "megaslide/model/attention.h"

#include <algorithm>
#include <cmath>

#include "model/table_cache.h"

namespace megaslide {

torch::Tensor split_heads(const torch::Tensor& x, int64_t heads) {
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  return x.view({B, N, heads, D / heads}).transpose(1, 2);
}

torch::Tensor merge_heads(const torch::Tensor& x) {
  const int64_t B = x.size(0), M = x.size(1), N = x.size(2), d = x.size(3);
  return x.transpose(1, 2).reshape({B, N, M * d});
}

namespace {
void check_tokens(const torch::Tensor& x, const TokenGrid& grid, int64_t dim, const char* who) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == grid.numel() && x.size(2) == dim, who, ": expected tokens [B, ",
              grid.numel(), ", ", dim, "] for a ", grid.t, "x", grid.h, "x", grid.w, " grid, got ", x.sizes());
}

// q, k, v [B', N', D] from one fused projection.
std::array<torch::Tensor, 3> project_qkv(Linear& qkv, const torch::Tensor& x, int64_t heads) {
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  auto t = qkv(x).view({B, N, 3, heads, D / heads}).permute({2, 0, 3, 1, 4});
  return {t[0], t[1], t[2]};
}
}  // namespace

// --- global ------------------------------------------------------------------------------------------

GlobalSelfAttentionImpl::GlobalSelfAttentionImpl(SelfAttentionOptions options_) : options(std::move(options_)) {
  reset();
}

void GlobalSelfAttentionImpl::reset() {
  TORCH_CHECK(options.dim() % options.heads() == 0, "GlobalSelfAttention: dim ", options.dim(),
              " is not divisible by heads ", options.heads());
  qkv = register_module("qkv", Linear(LinearOptions(options.dim(), 3 * options.dim()).device(options.device())));
  proj = register_module("proj", Linear(LinearOptions(options.dim(), options.dim()).device(options.device())));
}

torch::Tensor GlobalSelfAttentionImpl::forward(const torch::Tensor& x, const TokenGrid& grid) {
  check_tokens(x, grid, options.dim(), "GlobalSelfAttention");
  auto [q, k, v] = project_qkv(qkv, x, options.heads());
  if (options.materialize_scores()) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    auto weights = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) * scale, -1);  // [B, M, N, N]
    return proj(merge_heads(torch::matmul(weights, v)));
  }
  return proj(merge_heads(at::scaled_dot_product_attention(q, k, v)));
}

torch::Tensor GlobalSelfAttentionImpl::forward_context_parallel(const torch::Tensor& x, const TokenGrid& grid,
                                                                const ops::FrameSplit& split,
                                                                ops::FrameExchange& group) {
  TORCH_CHECK(split.frames == grid.t, "GlobalSelfAttention: the split is of ", split.frames, " frames, the grid has ",
              grid.t);
  const int64_t D = options.dim(), M = options.heads();
  check_tokens(x, TokenGrid{split.size(group.rank()), grid.h, grid.w}, D, "GlobalSelfAttention");
  const int64_t B = x.size(0), N = x.size(1);
  auto t = qkv(x).view({B, N, 3, M, D / M});
  auto out = ops::ulysses_attention(t.select(2, 0), t.select(2, 1), t.select(2, 2), split, grid.h * grid.w, group);
  return proj(out.reshape({B, N, D}));
}

// --- shifted windows -----------------------------------------------------------------------------------

WindowLayout window_layout(const TokenGrid& grid, std::array<int64_t, 3> window, bool shifted) {
  WindowLayout layout;
  const auto dims = grid.dims();
  for (int a = 0; a < 3; ++a) {
    TORCH_CHECK(window[a] >= 1, "window sizes must be positive, got ", window[a]);
    layout.window[a] = std::min(window[a], dims[a]);
    layout.shift[a] = (shifted && dims[a] > window[a]) ? layout.window[a] / 2 : 0;
    layout.padded[a] = (dims[a] + layout.window[a] - 1) / layout.window[a] * layout.window[a];
  }
  return layout;
}

ShiftedWindowAttention3DImpl::ShiftedWindowAttention3DImpl(WindowAttentionOptions options_)
    : options(std::move(options_)) {
  reset();
}

void ShiftedWindowAttention3DImpl::reset() {
  TORCH_CHECK(options.dim() % options.heads() == 0, "ShiftedWindowAttention3D: dim ", options.dim(),
              " is not divisible by heads ", options.heads());
  qkv = register_module("qkv", Linear(LinearOptions(options.dim(), 3 * options.dim()).device(options.device())));
  proj = register_module("proj", Linear(LinearOptions(options.dim(), options.dim()).device(options.device())));
}

namespace {

// [B, Tp, Hp, Wp, C] -> [B * windows, window volume, C] and back.
torch::Tensor partition(const torch::Tensor& x, const WindowLayout& l) {
  const int64_t B = x.size(0), C = x.size(4);
  const auto& w = l.window;
  const int64_t nt = l.padded[0] / w[0], nh = l.padded[1] / w[1], nw = l.padded[2] / w[2];
  return x.view({B, nt, w[0], nh, w[1], nw, w[2], C})
      .permute({0, 1, 3, 5, 2, 4, 6, 7})
      .reshape({B * nt * nh * nw, w[0] * w[1] * w[2], C});
}

torch::Tensor unpartition(const torch::Tensor& windows, const WindowLayout& l, int64_t B) {
  const auto& w = l.window;
  const int64_t nt = l.padded[0] / w[0], nh = l.padded[1] / w[1], nw = l.padded[2] / w[2];
  const int64_t C = windows.size(-1);
  return windows.view({B, nt, nh, nw, w[0], w[1], w[2], C})
      .permute({0, 1, 4, 2, 5, 3, 6, 7})
      .reshape({B, l.padded[0], l.padded[1], l.padded[2], C});
}

// Which keys each query of each window may see, built on the CPU: [windows, Wn, Wn] bool.
torch::Tensor build_window_mask(const TokenGrid& grid, const WindowLayout& l) {
  const auto dims = grid.dims();
  // Per axis, in rolled coordinates r: the token came from p = (r + shift) mod padded; it wrapped
  // around when p < shift, and it is padding when p >= the axis' length.
  std::array<torch::Tensor, 3> wrapped, real;
  for (int a = 0; a < 3; ++a) {
    auto p = (torch::arange(l.padded[a], torch::kLong) + l.shift[a]) % l.padded[a];
    wrapped[a] = (p < l.shift[a]).to(torch::kLong);
    real[a] = p < dims[a];
  }
  auto code = wrapped[0].view({-1, 1, 1}) * 4 + wrapped[1].view({1, -1, 1}) * 2 + wrapped[2].view({1, 1, -1});
  auto is_real = real[0].view({-1, 1, 1}) & real[1].view({1, -1, 1}) & real[2].view({1, 1, -1});
  auto code_w = partition(code.unsqueeze(0).unsqueeze(-1), l).squeeze(-1);     // [windows, Wn]
  auto real_w = partition(is_real.unsqueeze(0).unsqueeze(-1), l).squeeze(-1);  // [windows, Wn]
  auto mask = (code_w.unsqueeze(2) == code_w.unsqueeze(1)) & real_w.unsqueeze(1);
  // A padding query may see nothing else; letting every query see itself keeps softmax finite (and
  // changes nothing for real queries, which always see themselves).
  mask = mask | torch::eye(code_w.size(1), torch::kBool).unsqueeze(0);
  return mask;
}

}  // namespace

torch::Tensor shifted_window_mask(const TokenGrid& grid, const WindowLayout& l, torch::Device device) {
  const auto dims = grid.dims();
  bool needed = false;
  for (int a = 0; a < 3; ++a) needed |= l.shift[a] > 0 || l.padded[a] > dims[a];
  if (!needed) return {};
  // A stack's blocks alternate between two layouts on one grid; a few grids (buckets) are in use.
  static detail::TableCache cache(16);
  std::vector<int64_t> key(dims.begin(), dims.end());
  for (const auto* v : {&l.window, &l.shift, &l.padded}) key.insert(key.end(), v->begin(), v->end());
  return cache.get(key, device, torch::kBool, [&] { return build_window_mask(grid, l); });
}

torch::Tensor ShiftedWindowAttention3DImpl::forward(const torch::Tensor& x, const TokenGrid& grid) {
  check_tokens(x, grid, options.dim(), "ShiftedWindowAttention3D");
  return attend(x, grid, window_layout(grid, options.window(), options.shifted()));
}

torch::Tensor ShiftedWindowAttention3DImpl::forward_context_parallel(const torch::Tensor& x, const TokenGrid& grid,
                                                                     const ops::FrameSplit& split,
                                                                     ops::FrameExchange& group) {
  TORCH_CHECK(split.frames == grid.t, "ShiftedWindowAttention3D: the split is of ", split.frames,
              " frames, the grid has ", grid.t);
  const int64_t r = group.rank(), B = x.size(0), D = options.dim();
  const TokenGrid local{split.size(r), grid.h, grid.w};
  check_tokens(x, local, D, "ShiftedWindowAttention3D");
  // The time axis' groups on the whole grid: cuts at 0, s, s + w, s + 2w, ... and T.
  const auto l = window_layout(grid, options.window(), options.shifted());
  std::vector<int64_t> cuts{0};
  for (int64_t c = l.shift[0] > 0 ? l.shift[0] : l.window[0]; c < grid.t; c += l.window[0]) cuts.push_back(c);
  cuts.push_back(grid.t);
  const auto group_of = [&](int64_t frame) {  // the index of the group holding `frame`
    return static_cast<size_t>(std::upper_bound(cuts.begin(), cuts.end(), frame) - cuts.begin() - 1);
  };
  const auto slab_of = [&](int64_t p) {
    return std::pair<int64_t, int64_t>{cuts[group_of(split.begin(p))], cuts[group_of(split.end(p) - 1) + 1]};
  };
  const auto [slab, before] = ops::gather_frame_slab(x.view({B, local.t, grid.h, grid.w, D}), slab_of, split, group);
  const int64_t g0 = slab_of(r).first;
  std::vector<torch::Tensor> outs;
  for (size_t i = group_of(g0); cuts[i] < slab_of(r).second; ++i) {
    const TokenGrid piece{cuts[i + 1] - cuts[i], grid.h, grid.w};
    const auto pl = window_layout(piece, {piece.t, options.window()[1], options.window()[2]}, options.shifted());
    outs.push_back(attend(slab.narrow(1, cuts[i] - g0, piece.t).reshape({B, piece.numel(), D}), piece, pl));
  }
  return torch::cat(outs, 1)
      .view({B, slab.size(1), grid.h, grid.w, D})
      .narrow(1, before, local.t)
      .reshape({B, local.numel(), D});
}

torch::Tensor ShiftedWindowAttention3DImpl::attend(const torch::Tensor& x, const TokenGrid& grid,
                                                   const WindowLayout& l) {
  const int64_t B = x.size(0), D = options.dim();
  auto v = x.view({B, grid.t, grid.h, grid.w, D});
  v = torch::constant_pad_nd(v, {0, 0, 0, l.padded[2] - grid.w, 0, l.padded[1] - grid.h, 0, l.padded[0] - grid.t});
  const bool rolled = l.shift[0] || l.shift[1] || l.shift[2];
  if (rolled) v = torch::roll(v, {-l.shift[0], -l.shift[1], -l.shift[2]}, {1, 2, 3});
  auto windows = partition(v, l);  // [B * nW, Wn, D]
  auto [q, k, vv] = project_qkv(qkv, windows, options.heads());
  std::optional<torch::Tensor> mask;
  if (auto m = shifted_window_mask(grid, l, x.device()); m.defined()) {
    const int64_t nW = m.size(0), Wn = m.size(1);
    mask = m.unsqueeze(0).expand({B, nW, Wn, Wn}).reshape({B * nW, 1, Wn, Wn});
  }
  auto out = proj(merge_heads(at::scaled_dot_product_attention(q, k, vv, mask)));
  out = unpartition(out, l, B);
  if (rolled) out = torch::roll(out, {l.shift[0], l.shift[1], l.shift[2]}, {1, 2, 3});
  out = out.slice(1, 0, grid.t).slice(2, 0, grid.h).slice(3, 0, grid.w);
  return out.reshape({B, grid.numel(), D});
}

// --- cross-attention -------------------------------------------------------------------------------------

CrossAttentionImpl::CrossAttentionImpl(CrossAttentionOptions options_) : options(std::move(options_)) { reset(); }

void CrossAttentionImpl::reset() {
  TORCH_CHECK(options.dim() % options.heads() == 0, "CrossAttention: dim ", options.dim(),
              " is not divisible by heads ", options.heads());
  const auto dev = options.device();
  q = register_module("q", Linear(LinearOptions(options.dim(), options.dim()).device(dev)));
  kv = register_module("kv", Linear(LinearOptions(options.context_dim(), 2 * options.dim()).device(dev)));
  proj = register_module("proj", Linear(LinearOptions(options.dim(), options.dim()).zero_init(true).device(dev)));
}

torch::Tensor CrossAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& text,
                                          const torch::Tensor& text_mask) {
  TORCH_CHECK(text.dim() == 3 && text.size(0) == x.size(0) && text.size(2) == options.context_dim(),
              "CrossAttention: expected text [B, L, ", options.context_dim(), "] with B = ", x.size(0), ", got ",
              text.sizes());
  const int64_t B = text.size(0), L = text.size(1), M = options.heads(), D = options.dim();
  auto qh = split_heads(q(x), M);
  auto kvh = kv(text).view({B, L, 2, M, D / M}).permute({2, 0, 3, 1, 4});
  std::optional<torch::Tensor> mask;
  if (text_mask.defined()) {
    TORCH_CHECK(text_mask.sizes() == torch::IntArrayRef({B, L}), "CrossAttention: text_mask must be [B, L] = [", B,
                ", ", L, "], got ", text_mask.sizes());
    mask = text_mask.to(torch::kBool).view({B, 1, 1, L});
  }
  return proj(merge_heads(at::scaled_dot_product_attention(qh, kvh[0], kvh[1], mask)));
}

}  // namespace megaslide
