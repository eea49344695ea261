// Self-attentions of the DiT family against naive float64 attention written from the definitions:
// global attention is softmax(q kᵀ/√d) v over all tokens; shifted-window attention is the same with
// an explicit N×N mask built from token coordinates (same window after the cyclic shift, same side of
// the wrap on every axis) — no rolling or window partitioning involved.
#include "megaslide/model/attention.h"

#include <gtest/gtest.h>

using namespace megaslide;

namespace {

// Naive multi-head attention in float64 from a fused qkv projection. allowed: [N, N] bool or undefined.
torch::Tensor naive_attention(Linear& qkv, Linear& proj, const torch::Tensor& x, int64_t heads,
                              const torch::Tensor& allowed) {
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2), d = D / heads;
  auto packed = qkv(x).view({B, N, 3, heads, d});
  auto q = packed.select(2, 0).permute({0, 2, 1, 3});
  auto k = packed.select(2, 1).permute({0, 2, 1, 3});
  auto v = packed.select(2, 2).permute({0, 2, 1, 3});
  auto logits = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(d));
  if (allowed.defined()) logits = logits.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  auto out = torch::matmul(torch::softmax(logits, -1), v);  // [B, M, N, d]
  return proj(out.permute({0, 2, 1, 3}).reshape({B, N, D}));
}

// The shifted-window mask from coordinates: tokens i and j see each other when, on every axis, their
// shifted coordinates r = (p - s) mod P (P: the axis padded to whole windows) fall into the same window
// and both or neither wrapped around (p < s).
torch::Tensor window_mask_from_coordinates(const TokenGrid& g, std::array<int64_t, 3> window, bool shifted) {
  const auto l = window_layout(g, window, shifted);
  const auto dims = g.dims();
  const int64_t N = g.numel();
  auto allowed = torch::zeros({N, N}, torch::kBool);
  auto acc = allowed.accessor<bool, 2>();
  auto coords = [&](int64_t n) {
    return std::array<int64_t, 3>{n / (dims[1] * dims[2]), (n / dims[2]) % dims[1], n % dims[2]};
  };
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      auto pi = coords(i), pj = coords(j);
      bool ok = true;
      for (int a = 0; a < 3; ++a) {
        const int64_t s = l.shift[a], P = l.padded[a], w = l.window[a];
        const int64_t ri = ((pi[a] - s) % P + P) % P, rj = ((pj[a] - s) % P + P) % P;
        ok &= (ri / w == rj / w) && ((pi[a] < s) == (pj[a] < s));
      }
      acc[i][j] = ok;
    }
  }
  return allowed;
}

}  // namespace

TEST(GlobalSelfAttention, EqualsNaiveSoftmaxAttention) {
  torch::manual_seed(1);
  GlobalSelfAttention attn(SelfAttentionOptions(24, 3));
  attn->to(torch::kFloat64);
  const TokenGrid g{2, 3, 4};
  auto x = torch::randn({2, g.numel(), 24}, torch::kFloat64);
  auto expected = naive_attention(attn->qkv, attn->proj, x, 3, {});
  EXPECT_TRUE(torch::allclose(attn(x, g), expected, 1e-10, 1e-12));
}

// materialize_scores (model.dense_attention: materialized) computes the same function as the fused
// SDPA path: output and the input and weight gradients agree with the fused module's (same weights).
TEST(GlobalSelfAttention, MaterializedScoresEqualFusedAttention) {
  torch::manual_seed(2);
  GlobalSelfAttention fused(SelfAttentionOptions(24, 3));
  GlobalSelfAttention written_out(SelfAttentionOptions(24, 3).materialize_scores(true));
  fused->to(torch::kFloat64);
  written_out->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : written_out->named_parameters()) p.value().copy_(fused->named_parameters()[p.key()]);
  }
  const TokenGrid g{2, 3, 4};
  auto x = torch::randn({2, g.numel(), 24}, torch::kFloat64);
  auto xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
  auto a = fused(xa, g), b = written_out(xb, g);
  EXPECT_TRUE(torch::allclose(a, b, 1e-10, 1e-12));
  EXPECT_TRUE(torch::allclose(b, naive_attention(fused->qkv, fused->proj, x, 3, {}), 1e-10, 1e-12));
  (a * a).sum().backward();
  (b * b).sum().backward();
  EXPECT_TRUE(torch::allclose(xa.grad(), xb.grad(), 1e-9, 1e-11));
  EXPECT_TRUE(torch::allclose(fused->qkv->weight.grad(), written_out->qkv->weight.grad(), 1e-9, 1e-11));
}

struct WindowCase {
  TokenGrid grid;
  std::array<int64_t, 3> window;
  bool shifted;
};

void PrintTo(const WindowCase& c, std::ostream* os) {
  *os << "grid " << c.grid.t << "x" << c.grid.h << "x" << c.grid.w << " window " << c.window[0] << "x" << c.window[1]
      << "x" << c.window[2] << (c.shifted ? " shifted" : "");
}

class ShiftedWindowTest : public ::testing::TestWithParam<WindowCase> {};

TEST_P(ShiftedWindowTest, EqualsNaiveAttentionWithExplicitMask) {
  const auto c = GetParam();
  torch::manual_seed(7);
  ShiftedWindowAttention3D attn(WindowAttentionOptions(16, 2).window(c.window).shifted(c.shifted));
  attn->to(torch::kFloat64);
  auto x = torch::randn({2, c.grid.numel(), 16}, torch::kFloat64);
  auto allowed = window_mask_from_coordinates(c.grid, c.window, c.shifted);
  auto expected = naive_attention(attn->qkv, attn->proj, x, 2, allowed);
  auto got = attn(x, c.grid);
  EXPECT_TRUE(torch::allclose(got, expected, 1e-10, 1e-12)) << (got - expected).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(Grids, ShiftedWindowTest,
                         ::testing::Values(WindowCase{{4, 8, 8}, {2, 4, 4}, false},   // whole windows, no mask
                                           WindowCase{{4, 8, 8}, {2, 4, 4}, true},    // shift on every axis
                                           WindowCase{{5, 6, 7}, {3, 4, 4}, true},    // padding and shift on every axis
                                           WindowCase{{5, 6, 7}, {3, 4, 4}, false},   // padding only
                                           WindowCase{{2, 5, 9}, {3, 16, 4}, true}),  // axes shorter than the window
                         [](const auto& info) { return "case" + std::to_string(info.index); });

TEST(ShiftedWindowAttention3D, LayoutFollowsVideoSwinRule) {
  auto l = window_layout({2, 20, 10}, {3, 16, 16}, true);
  EXPECT_EQ(l.window, (std::array<int64_t, 3>{2, 16, 10}));
  EXPECT_EQ(l.shift, (std::array<int64_t, 3>{0, 8, 0}));
  EXPECT_EQ(l.padded, (std::array<int64_t, 3>{2, 32, 10}));
}

TEST(ShiftedWindowAttention3D, TheMaskIsBuiltOncePerGridAndLayout) {
  // Every Swin block's forward asks for its mask: built once per (grid, layout, device), not on the CPU
  // and copied to the device in every block of every step.
  const TokenGrid grid{5, 6, 7};
  const auto shifted = window_layout(grid, {3, 4, 4}, true), plain = window_layout(grid, {3, 4, 4}, false);
  const auto a = shifted_window_mask(grid, shifted, torch::kCPU);
  ShiftedWindowAttention3D attn(WindowAttentionOptions(8, 2).window({3, 4, 4}).shifted(true));
  attn(torch::randn({1, grid.numel(), 8}), grid);
  const auto b = shifted_window_mask(grid, shifted, torch::kCPU);
  ASSERT_TRUE(a.defined() && b.defined());
  EXPECT_EQ(a.data_ptr(), b.data_ptr()) << "the same grid and layout: the kept mask";
  const auto c = shifted_window_mask(grid, plain, torch::kCPU);
  ASSERT_TRUE(c.defined());  // padding only
  EXPECT_NE(c.data_ptr(), a.data_ptr());
  EXPECT_FALSE(torch::equal(c, a)) << "another layout: another mask";
  EXPECT_FALSE(shifted_window_mask({4, 8, 8}, window_layout({4, 8, 8}, {2, 4, 4}, false), torch::kCPU).defined())
      << "whole windows without a shift need no mask";
}

TEST(CrossAttention, MaskedTokensAreIgnored) {
  torch::manual_seed(2);
  CrossAttention cross(CrossAttentionOptions(16, 8, 2));
  torch::NoGradGuard no_grad;
  cross->proj->weight.normal_();  // the zero-initialised output would hide everything
  auto x = torch::randn({2, 5, 16});
  auto text = torch::randn({2, 4, 8});
  auto mask = torch::tensor({1, 1, 0, 0, 1, 1, 1, 0}, torch::kBool).view({2, 4});
  auto out = cross(x, text, mask);
  auto changed = text.clone();
  changed.index_put_({0, 3}, torch::randn({8}) * 10);  // a masked token of sample 0
  changed.index_put_({1, 3}, torch::randn({8}) * 10);  // a masked token of sample 1
  EXPECT_TRUE(torch::allclose(cross(x, changed, mask), out, 1e-5, 1e-6));
  changed.index_put_({0, 1}, torch::randn({8}) * 10);  // a real token: the output must change
  EXPECT_FALSE(torch::allclose(cross(x, changed, mask), out, 1e-5, 1e-6));
}
