// ops::dsa3d, the 3D-DSA operator: the fused CPU kernel against the grid_sample reference and against an
// independent naive neighbourhood-attention loop; finite-difference gradients; kernel shrink;
// determinism; the API's checks; the shared per-sample math header; and (*_CUDA, skipped without a
// GPU) the fused CUDA kernel against the reference.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "../src/attention/dsa3d_math.h"
#include "megaslide/attention/dsa3d.h"

namespace ms = megaslide::ops;

namespace {

struct Problem {
  int64_t B = 1, T = 3, H = 4, W = 5, M = 2, d = 4, G = 1;
  std::array<int64_t, 3> kernel{3, 3, 3};
  bool with_bias = true;
};

struct Inputs {
  torch::Tensor q, k, v, offsets, bias;  // bias undefined when absent
};

enum class Offsets { kZero, kRandom, kBetweenTokens };

// Random inputs (fixed seed). kRandom: uniform in [-2.5, 2.5] tokens, so border tokens sample beyond
// the volume; kBetweenTokens: an integer in [-3, 2] plus a fraction in [0.05, 0.95], so no position is
// within 0.05 of a token centre or of the border (finite differences never straddle a kink).
Inputs make_inputs(const Problem& pb, torch::ScalarType dtype, Offsets kind, uint64_t seed) {
  torch::manual_seed(seed);
  const auto opts = torch::TensorOptions().dtype(dtype);
  const auto ke = ms::effective_kernel(pb.kernel, {pb.T, pb.H, pb.W});
  const int64_t K = ke[0] * ke[1] * ke[2];
  Inputs in;
  in.q = torch::randn({pb.B, pb.T, pb.H, pb.W, pb.M, pb.d}, opts);
  in.k = torch::randn({pb.B, pb.T, pb.H, pb.W, pb.M, pb.d}, opts);
  in.v = torch::randn({pb.B, pb.T, pb.H, pb.W, pb.M, pb.d}, opts);
  const std::vector<int64_t> off_shape{pb.B, pb.T, pb.H, pb.W, pb.G, K, 3};
  switch (kind) {
    case Offsets::kZero: in.offsets = torch::zeros(off_shape, opts); break;
    case Offsets::kRandom: in.offsets = torch::rand(off_shape, opts) * 5.0 - 2.5; break;
    case Offsets::kBetweenTokens:
      in.offsets = torch::randint(-3, 3, off_shape, opts) + 0.05 + 0.9 * torch::rand(off_shape, opts);
      break;
  }
  if (pb.with_bias) in.bias = torch::randn({pb.M, K}, opts);
  return in;
}

struct Result {
  torch::Tensor out, dq, dk, dv, doffsets, dbias;
};

// Forward, then backward of sum(out ⊙ dout) with a fixed random dout.
Result run_kernel(const Inputs& in, std::array<int64_t, 3> kernel, ms::DsaImpl impl, bool deterministic = false,
                  uint64_t seed = 7) {
  auto q = in.q.detach().clone().requires_grad_(true);
  auto k = in.k.detach().clone().requires_grad_(true);
  auto v = in.v.detach().clone().requires_grad_(true);
  auto offsets = in.offsets.detach().clone().requires_grad_(true);
  std::optional<torch::Tensor> bias;
  if (in.bias.defined()) bias = in.bias.detach().clone().requires_grad_(true);
  auto out = ms::dsa3d(q, k, v, offsets, bias, kernel, impl, deterministic);
  torch::manual_seed(seed);
  auto dout = torch::randn(out.sizes(), out.options().dtype(torch::kFloat)).to(out.scalar_type());
  out.backward(dout);
  Result r;
  r.out = out.detach();
  r.dq = q.grad();
  r.dk = k.grad();
  r.dv = v.grad();
  r.doffsets = offsets.grad();
  if (bias) r.dbias = bias->grad();
  return r;
}

Inputs to_device(const Inputs& in, const torch::Device& device) {
  Inputs r;
  r.q = in.q.to(device), r.k = in.k.to(device), r.v = in.v.to(device), r.offsets = in.offsets.to(device);
  if (in.bias.defined()) r.bias = in.bias.to(device);
  return r;
}

Inputs cast(const Inputs& in, torch::ScalarType qkv, torch::ScalarType rest) {
  Inputs r;
  r.q = in.q.to(qkv), r.k = in.k.to(qkv), r.v = in.v.to(qkv), r.offsets = in.offsets.to(rest);
  if (in.bias.defined()) r.bias = in.bias.to(rest);
  return r;
}

// max |actual - expected| <= atol + rtol · max |expected|, compared in float64 on the CPU.
void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double atol, double rtol,
                  const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << " is undefined";
  ASSERT_TRUE(expected.defined()) << what << " (expected) is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const auto a = actual.detach().to(torch::kCPU, torch::kDouble), e = expected.detach().to(torch::kCPU, torch::kDouble);
  const double err = (a - e).abs().max().item<double>();
  const double scale = e.abs().max().item<double>();
  EXPECT_LE(err, atol + rtol * scale) << what << ": max abs error " << err << ", max |expected| " << scale;
}

void expect_results_close(const Result& a, const Result& e, double atol, double rtol, bool with_offsets = true) {
  expect_close(a.out, e.out, atol, rtol, "out");
  expect_close(a.dq, e.dq, atol, rtol, "dq");
  expect_close(a.dk, e.dk, atol, rtol, "dk");
  expect_close(a.dv, e.dv, atol, rtol, "dv");
  if (with_offsets) expect_close(a.doffsets, e.doffsets, atol, rtol, "doffsets");
  if (e.dbias.defined()) expect_close(a.dbias, e.dbias, atol, rtol, "dbias");
}

// NATTEN's window start (natten/csrc: get_window_start), dilation 1.
int64_t natten_window_start(int64_t index, int64_t length, int64_t kernel) {
  const int64_t neighborhood = kernel / 2;
  if (index < neighborhood) return 0;
  if (index + neighborhood >= length) return length - kernel;
  return index - neighborhood;
}

// Non-causal neighbourhood attention written as plain loops (float64): each query attends to the
// k-window around it, shifted inside the volume at the borders; bias[m, j] by window slot j.
torch::Tensor naive_neighbourhood_attention(const Inputs& in, std::array<int64_t, 3> kernel) {
  const auto q = in.q.to(torch::kDouble), k = in.k.to(torch::kDouble), v = in.v.to(torch::kDouble);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), W = q.size(3), M = q.size(4), d = q.size(5);
  const int64_t kt = std::min(kernel[0], T), kh = std::min(kernel[1], H), kw = std::min(kernel[2], W);
  auto out = torch::zeros_like(q);
  auto qa = q.accessor<double, 6>(), ka = k.accessor<double, 6>(), va = v.accessor<double, 6>();
  auto oa = out.accessor<double, 6>();
  const auto bias = in.bias.defined() ? in.bias.to(torch::kDouble) : torch::Tensor();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w)
          for (int64_t m = 0; m < M; ++m) {
            const int64_t t0 = natten_window_start(t, T, kt), h0 = natten_window_start(h, H, kh),
                          w0 = natten_window_start(w, W, kw);
            std::vector<double> logits;
            for (int64_t i = 0; i < kt; ++i)
              for (int64_t j = 0; j < kh; ++j)
                for (int64_t l = 0; l < kw; ++l) {
                  double s = 0;
                  for (int64_t c = 0; c < d; ++c) s += qa[b][t][h][w][m][c] * ka[b][t0 + i][h0 + j][w0 + l][m][c];
                  s /= std::sqrt(double(d));
                  if (bias.defined()) s += bias[m][int64_t(logits.size())].item<double>();
                  logits.push_back(s);
                }
            const double mx = *std::max_element(logits.begin(), logits.end());
            double sum = 0;
            for (double& s : logits) sum += (s = std::exp(s - mx));
            int64_t slot = 0;
            for (int64_t i = 0; i < kt; ++i)
              for (int64_t j = 0; j < kh; ++j)
                for (int64_t l = 0; l < kw; ++l, ++slot)
                  for (int64_t c = 0; c < d; ++c)
                    oa[b][t][h][w][m][c] += logits[slot] / sum * va[b][t0 + i][h0 + j][w0 + l][m][c];
          }
  return out;
}

// Central finite differences on every element of every input against the autograd gradient of
// L = sum(dsa3d(...) ⊙ R), R fixed random. |numeric - analytic| <= atol + rtol·|numeric| per element.
void gradcheck(const Inputs& in, std::array<int64_t, 3> kernel, ms::DsaImpl impl, double eps, double atol,
               double rtol) {
  const Result analytic = run_kernel(in, kernel, impl, false, /*seed*/ 11);
  torch::manual_seed(11);
  const auto R = torch::randn(analytic.out.sizes(), torch::kFloat).to(torch::kDouble);
  Inputs x{in.q.clone(), in.k.clone(), in.v.clone(), in.offsets.clone(),
           in.bias.defined() ? in.bias.clone() : torch::Tensor()};
  auto loss = [&] {
    torch::NoGradGuard no_grad;
    std::optional<torch::Tensor> bias;
    if (x.bias.defined()) bias = x.bias;
    return (ms::dsa3d(x.q, x.k, x.v, x.offsets, bias, kernel, impl) * R).sum().item<double>();
  };
  const std::vector<std::pair<torch::Tensor*, torch::Tensor>> pairs{
      {&x.q, analytic.dq}, {&x.k, analytic.dk}, {&x.v, analytic.dv}, {&x.offsets, analytic.doffsets},
      {&x.bias, analytic.dbias}};
  const char* names[] = {"q", "k", "v", "offsets", "bias"};
  for (size_t i = 0; i < pairs.size(); ++i) {
    torch::Tensor& t = *pairs[i].first;
    if (!t.defined()) continue;
    auto flat = t.view({-1});
    auto grad = pairs[i].second.reshape({-1});
    int64_t failures = 0;
    for (int64_t e = 0; e < flat.numel(); ++e) {
      const double x0 = flat[e].item<double>();
      flat[e] = x0 + eps;
      const double lp = loss();
      flat[e] = x0 - eps;
      const double lm = loss();
      flat[e] = x0;
      const double numeric = (lp - lm) / (2 * eps), exact = grad[e].item<double>();
      if (std::abs(numeric - exact) > atol + rtol * std::abs(numeric) && failures++ < 5)
        ADD_FAILURE() << "d" << names[i] << "[" << e << "]: finite difference " << numeric << ", autograd " << exact;
    }
    EXPECT_EQ(failures, 0) << "d" << names[i] << ": " << failures << " of " << flat.numel() << " elements differ";
  }
}

}  // namespace

// ---- the shared per-sample math (src/attention/dsa3d_math.h) -----------------------------------------

// The clamp/border rule and floor-based corners: gradient only strictly inside, right difference at integers.
TEST(Dsa3dMath, AxisSampleFollowsGridSampleConventions) {
  using megaslide::dsa3d_math::sample_axis;
  auto inside = sample_axis<double>(2.0, 5);  // integer, interior
  EXPECT_EQ(inside.i0, 2);
  EXPECT_EQ(inside.i1, 3);
  EXPECT_EQ(inside.w0, 1.0);
  EXPECT_EQ(inside.dw, 1.0);
  auto between = sample_axis<double>(2.25, 5);
  EXPECT_EQ(between.i0, 2);
  EXPECT_DOUBLE_EQ(between.w1, 0.25);
  EXPECT_EQ(between.dw, 1.0);
  for (double x : {0.0, 4.0, -0.5, 4.5}) EXPECT_EQ(sample_axis<double>(x, 5).dw, 0.0) << "x = " << x;
  auto upper = sample_axis<double>(7.0, 5);  // beyond the border: clamped to the last token
  EXPECT_EQ(upper.i0, 4);
  EXPECT_EQ(upper.i1, 4);
  EXPECT_EQ(upper.w0, 1.0);
  auto lower = sample_axis<double>(-3.0, 5);
  EXPECT_EQ(lower.i0, 0);
  EXPECT_EQ(lower.w0, 1.0);
  auto single = sample_axis<double>(0.0, 1);  // an axis of one token: everything maps to it
  EXPECT_EQ(single.i0, 0);
  EXPECT_EQ(single.i1, 0);
  EXPECT_EQ(single.dw, 0.0);
  EXPECT_EQ(megaslide::dsa3d_math::window_start(0, 7, 16), 0);
  EXPECT_EQ(megaslide::dsa3d_math::window_start(8, 7, 16), 5);
  EXPECT_EQ(megaslide::dsa3d_math::window_start(15, 7, 16), 9);
}

// Trilinear weights sum to one and their derivatives are the weights' finite differences.
TEST(Dsa3dMath, TrilinearDerivativesMatchFiniteDifferences) {
  using megaslide::dsa3d_math::Sample;
  using megaslide::dsa3d_math::trilinear_sample;
  const double x[3] = {1.3, 2.71, 0.45}, eps = 1e-7;
  Sample<double> s;
  trilinear_sample(x[0], x[1], x[2], 3, 5, 4, s);
  double total = 0;
  for (int c = 0; c < 8; ++c) total += s.weight[c];
  EXPECT_NEAR(total, 1.0, 1e-15);
  for (int a = 0; a < 3; ++a) {
    double xp[3] = {x[0], x[1], x[2]}, xm[3] = {x[0], x[1], x[2]};
    xp[a] += eps, xm[a] -= eps;
    Sample<double> sp, sm;
    trilinear_sample(xp[0], xp[1], xp[2], 3, 5, 4, sp);
    trilinear_sample(xm[0], xm[1], xm[2], 3, 5, 4, sm);
    for (int c = 0; c < 8; ++c) {
      EXPECT_EQ(sp.index[c], s.index[c]);
      EXPECT_NEAR((sp.weight[c] - sm.weight[c]) / (2 * eps), s.dweight[a][c], 1e-7) << "axis " << a << " corner " << c;
    }
  }
}

// The online softmax's log-sum-exp equals the direct one, whatever order the logits come in.
TEST(Dsa3dMath, OnlineSoftmaxLogSumExp) {
  const std::vector<double> logits{0.5, 3.0, -2.0, 7.5, 7.25};
  megaslide::dsa3d_math::OnlineSoftmax<double> sm;
  double numerator = 0;  // Σ p_j · j, rescaled as the kernels do
  for (size_t j = 0; j < logits.size(); ++j) {
    double p;
    numerator = numerator * sm.add(logits[j], p) + p * double(j);
  }
  double direct = 0, mean = 0;
  for (double s : logits) direct += std::exp(s);
  for (size_t j = 0; j < logits.size(); ++j) mean += std::exp(logits[j]) / direct * double(j);
  EXPECT_NEAR(sm.log_sum_exp(), std::log(direct), 1e-12);
  EXPECT_NEAR(numerator / sm.sum, mean, 1e-12);
}

// ---- fused CPU against the independent references -----------------------------------------------------

// With zero offsets the operator is NATTEN's neighbourhood attention (clamped windows at the borders).
// float64: fused and reference agree with the naive loop to 1e-12 (round-off only).
TEST(Dsa3d, ZeroOffsetsEqualNaiveNeighbourhoodAttention) {
  Problem pb;
  pb.B = 2, pb.T = 4, pb.H = 5, pb.W = 6, pb.M = 2, pb.d = 5;
  pb.kernel = {3, 3, 5};
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kZero, 1);
  const auto naive = naive_neighbourhood_attention(in, pb.kernel);
  expect_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpu).out, naive, 1e-12, 0, "fused cpu vs naive");
  expect_close(run_kernel(in, pb.kernel, ms::DsaImpl::kReference).out, naive, 1e-12, 0, "reference vs naive");
}

// Random offsets (between tokens and beyond the borders), 2 offset groups, bias: forward and every
// gradient of the fused CPU kernel equal the reference's autograd in float64 to 1e-12 (round-off;
// observed ~1e-15 of values of order one).
TEST(Dsa3d, FusedCpuMatchesReferenceFloat64) {
  Problem pb;
  pb.B = 2, pb.T = 3, pb.H = 6, pb.W = 5, pb.M = 4, pb.d = 6, pb.G = 2;
  pb.kernel = {3, 3, 3};
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kRandom, 2);
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpu), run_kernel(in, pb.kernel, ms::DsaImpl::kReference),
                        1e-12, 0);
}

// Zero offsets put every sample on a token centre, where the trilinear derivative is one-sided and the
// border rule applies: d(offsets) must still equal the reference's. Axis lengths 1, 3, 5, 9 keep the
// reference's coordinate round trip (x·2/(S-1) - 1 and back) exact, so both sit on the same side.
TEST(Dsa3d, FusedCpuMatchesReferenceAtTokenCentresFloat64) {
  for (auto vol : {std::array<int64_t, 3>{3, 5, 9}, std::array<int64_t, 3>{1, 5, 3}}) {
    Problem pb;
    pb.T = vol[0], pb.H = vol[1], pb.W = vol[2], pb.M = 2, pb.d = 3;
    pb.kernel = {3, 3, 5};
    const auto in = make_inputs(pb, torch::kDouble, Offsets::kZero, 3);
    const auto fused = run_kernel(in, pb.kernel, ms::DsaImpl::kCpu);
    expect_results_close(fused, run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
    EXPECT_GT(fused.doffsets.abs().max().item<double>(), 0.1);  // the comparison is not vacuous
  }
}

// Without a bias (bias = nullopt): forward and gradients still equal the reference (float64, 1e-12),
// and the result trains (requires_grad inputs, no bias input to the autograd function).
TEST(Dsa3d, FusedCpuWithoutBiasMatchesReference) {
  Problem pb;
  pb.T = 3, pb.H = 5, pb.W = 4, pb.M = 2, pb.d = 4, pb.with_bias = false;
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kRandom, 16);
  ASSERT_FALSE(in.bias.defined());
  const auto fused = run_kernel(in, pb.kernel, ms::DsaImpl::kCpu);
  EXPECT_FALSE(fused.dbias.defined());
  expect_results_close(fused, run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
  torch::NoGradGuard no_grad;  // and without autograd recording
  expect_close(ms::dsa3d(in.q, in.k, in.v, in.offsets, std::nullopt, pb.kernel, ms::DsaImpl::kCpu), fused.out, 0, 0,
               "no-grad forward");
}

// float32: same data; the two accumulate in different orders, so agreement is to float32 round-off
// amplified by the softmax: 1e-5 of the largest value (observed up to 1.8e-6).
TEST(Dsa3d, FusedCpuMatchesReferenceFloat32) {
  Problem pb;
  pb.B = 1, pb.T = 4, pb.H = 7, pb.W = 6, pb.M = 4, pb.d = 16, pb.G = 2;
  pb.kernel = {3, 5, 5};
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 4);
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpu), run_kernel(in, pb.kernel, ms::DsaImpl::kReference),
                       0, 1e-5);
}

// bfloat16 q, k, v (float32 offsets and bias) against the float32 reference on the same, already
// rounded values. Inputs are exact in both; what differs is the rounding of out, dq, dk, dv to
// bfloat16 (2^-9 relative) and out's rounding feeding dout·out in the backward: 1e-2 of the largest
// value (observed up to 3e-3).
TEST(Dsa3d, FusedCpuBFloat16MatchesFloat32Reference) {
  Problem pb;
  pb.T = 3, pb.H = 6, pb.W = 6, pb.M = 2, pb.d = 16;
  pb.kernel = {3, 3, 3};
  const auto in32 = make_inputs(pb, torch::kFloat, Offsets::kRandom, 5);
  const auto in16 = cast(in32, torch::kBFloat16, torch::kFloat);
  const auto fused = run_kernel(in16, pb.kernel, ms::DsaImpl::kCpu);
  EXPECT_EQ(fused.out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(fused.dk.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(fused.doffsets.scalar_type(), torch::kFloat);
  expect_results_close(fused, run_kernel(cast(in16, torch::kFloat, torch::kFloat), pb.kernel, ms::DsaImpl::kReference),
                       0, 1e-2);
}

// float16 the same way: 10 mantissa bits, so 2e-3 of the largest value (observed up to 5.6e-4).
TEST(Dsa3d, FusedCpuFloat16MatchesFloat32Reference) {
  Problem pb;
  pb.T = 3, pb.H = 5, pb.W = 6, pb.M = 2, pb.d = 8;
  pb.kernel = {3, 3, 3};
  const auto in32 = make_inputs(pb, torch::kFloat, Offsets::kRandom, 6);
  const auto in16 = cast(in32, torch::kHalf, torch::kFloat);
  expect_results_close(run_kernel(in16, pb.kernel, ms::DsaImpl::kCpu),
                       run_kernel(cast(in16, torch::kFloat, torch::kFloat), pb.kernel, ms::DsaImpl::kReference), 0,
                       2e-3);
}

// ---- gradients against finite differences ------------------------------------------------------------

// Central differences (eps 1e-6, float64) on every element of q, k, v, offsets and bias. Offsets land
// between tokens and beyond the borders (zero gradient there). Error budget: eps² · f''' + 1e-16/eps,
// both < 1e-9; the tolerance 1e-7 + 1e-6·|g| leaves margin and still catches any wrong term.
TEST(Dsa3d, GradcheckFusedCpuFloat64) {
  Problem pb;
  pb.T = 3, pb.H = 4, pb.W = 3, pb.M = 2, pb.d = 3, pb.G = 2;
  pb.kernel = {3, 3, 3};
  gradcheck(make_inputs(pb, torch::kDouble, Offsets::kBetweenTokens, 8), pb.kernel, ms::DsaImpl::kCpu, 1e-6, 1e-7, 1e-6);
}

// The reference through autograd passes the same check (so the two agreeing means both are right).
TEST(Dsa3d, GradcheckReferenceFloat64) {
  Problem pb;
  pb.T = 2, pb.H = 4, pb.W = 3, pb.M = 2, pb.d = 2, pb.G = 1;
  pb.kernel = {3, 3, 1};
  gradcheck(make_inputs(pb, torch::kDouble, Offsets::kBetweenTokens, 9), pb.kernel, ms::DsaImpl::kReference, 1e-6, 1e-7,
            1e-6);
}

// ---- kernel larger than the volume ----------------------------------------------------------------------

// A 2x3x1 volume with kernel (3, 7, 7) uses the effective kernel (2, 3, 1): K = 6. With zero offsets
// every token attends to the whole volume; random offsets match the reference, gradients included.
TEST(Dsa3d, KernelLargerThanVolumeShrinks) {
  Problem pb;
  pb.B = 2, pb.T = 2, pb.H = 3, pb.W = 1, pb.M = 2, pb.d = 4;
  pb.kernel = {3, 7, 7};
  EXPECT_EQ(ms::effective_kernel(pb.kernel, {2, 3, 1}), (std::array<int64_t, 3>{2, 3, 1}));
  const auto zero = make_inputs(pb, torch::kDouble, Offsets::kZero, 10);
  ASSERT_EQ(zero.offsets.size(5), 6);
  expect_close(run_kernel(zero, pb.kernel, ms::DsaImpl::kCpu).out, naive_neighbourhood_attention(zero, pb.kernel),
               1e-12, 0, "fused vs naive");
  const auto random = make_inputs(pb, torch::kDouble, Offsets::kRandom, 11);
  expect_results_close(run_kernel(random, pb.kernel, ms::DsaImpl::kCpu),
                       run_kernel(random, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
  // Offsets carrying the full kernel's K = 147 are rejected with the effective kernel named.
  auto wrong = torch::zeros({2, 2, 3, 1, 1, 147, 3}, torch::kDouble);
  try {
    ms::dsa3d(zero.q, zero.k, zero.v, wrong, std::nullopt, pb.kernel, ms::DsaImpl::kCpu);
    ADD_FAILURE() << "offsets with K = 147 were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("effective kernel (2, 3, 1)"), std::string::npos) << e.what();
  }
}

// ---- determinism -------------------------------------------------------------------------------------------

namespace {
Problem determinism_problem() {
  Problem pb;
  pb.B = 2, pb.T = 4, pb.H = 8, pb.W = 8, pb.M = 4, pb.d = 16, pb.G = 2;
  pb.kernel = {3, 5, 5};
  return pb;
}

void expect_bit_identical(const Result& a, const Result& b) {
  EXPECT_TRUE(torch::equal(a.out, b.out));
  EXPECT_TRUE(torch::equal(a.dq, b.dq));
  EXPECT_TRUE(torch::equal(a.dk, b.dk));
  EXPECT_TRUE(torch::equal(a.dv, b.dv));
  EXPECT_TRUE(torch::equal(a.doffsets, b.doffsets));
  EXPECT_TRUE(torch::equal(a.dbias, b.dbias));
}

struct ThreadCount {
  explicit ThreadCount(int n) : saved(torch::get_num_threads()) { torch::set_num_threads(n); }
  ~ThreadCount() { torch::set_num_threads(saved); }
  int saved;
};
}  // namespace

// Deterministic mode: two runs, and 1 thread against 2 threads, give bit-identical float32 results.
TEST(Dsa3d, DeterministicModeIsBitIdenticalAcrossRunsAndThreadCounts) {
  const auto pb = determinism_problem();
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 12);
  Result one, two, again;
  {
    ThreadCount threads(1);
    one = run_kernel(in, pb.kernel, ms::DsaImpl::kCpu, true);
  }
  {
    ThreadCount threads(2);
    two = run_kernel(in, pb.kernel, ms::DsaImpl::kCpu, true);
    again = run_kernel(in, pb.kernel, ms::DsaImpl::kCpu, true);
  }
  expect_bit_identical(one, two);
  expect_bit_identical(two, again);
  // And deterministic mode computes the same gradients as the default mode (up to summation order).
  expect_results_close(one, run_kernel(in, pb.kernel, ms::DsaImpl::kCpu, false), 1e-6, 1e-5);
}

// Default mode: the same thread count repeats bit-identically (per-chunk buffers added in chunk order).
TEST(Dsa3d, DefaultModeRepeatsForAFixedThreadCount) {
  const auto pb = determinism_problem();
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 13);
  ThreadCount threads(2);
  expect_bit_identical(run_kernel(in, pb.kernel, ms::DsaImpl::kCpu), run_kernel(in, pb.kernel, ms::DsaImpl::kCpu));
}

// ---- API ----------------------------------------------------------------------------------------------------

// kAuto is the fused kernel on the CPU, and the result trains through the custom autograd function.
TEST(Dsa3d, AutoPicksTheFusedCpuKernel) {
  EXPECT_EQ(ms::resolve_impl(ms::DsaImpl::kAuto, torch::kCPU), ms::DsaImpl::kCpu);
  EXPECT_EQ(ms::resolve_impl(ms::DsaImpl::kReference, torch::kCPU), ms::DsaImpl::kReference);
  Problem pb;
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 14);
  auto q = in.q.clone().requires_grad_(true);
  auto out = ms::dsa3d(q, in.k, in.v, in.offsets, in.bias, pb.kernel);
  ASSERT_TRUE(out.grad_fn());
  EXPECT_NE(out.grad_fn()->name().find("FusedDsa3d"), std::string::npos) << out.grad_fn()->name();
  EXPECT_STREQ(ms::to_string(ms::DsaImpl::kCuda), "cuda");
}

namespace {
void expect_error(const std::function<void()>& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << fragment << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Dsa3d, ApiRejectsBadInputsWithClearMessages) {
  Problem pb;
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 15);
  const auto k = pb.kernel;
  expect_error([&] { ms::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, k, ms::DsaImpl::kCuda); }, "cuda");
  expect_error([&] { ms::dsa3d(in.q.to(torch::kInt), in.k.to(torch::kInt), in.v.to(torch::kInt), in.offsets, in.bias, k,
                               ms::DsaImpl::kCpu); },
               "floating point");
  expect_error([&] { ms::dsa3d(in.q, in.k, in.v, in.offsets, torch::zeros({2, 5}), k, ms::DsaImpl::kCpu); },
               "bias must be [M, K] = [2, 27]");
  expect_error([&] { ms::dsa3d(in.q, in.k.to(torch::kDouble), in.v, in.offsets, in.bias, k, ms::DsaImpl::kCpu); },
               "share one dtype");
  expect_error([&] { ms::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, {3, 4, 3}, ms::DsaImpl::kCpu); }, "odd");
  expect_error([&] { ms::dsa3d(in.q, in.k, in.v, in.offsets.narrow(4, 0, 1).repeat({1, 1, 1, 1, 3, 1, 1}), in.bias, k,
                               ms::DsaImpl::kCpu); },
               "must divide the heads");
}

// ---- CUDA (skipped without a GPU) -----------------------------------------------------------------------------

namespace {
bool cuda_ready() { return torch::cuda::is_available(); }
}  // namespace

// Fused CUDA against the reference (both on the GPU), float32: 1e-5 of the largest value, as on the CPU
// (TF32 is off for the reference's einsum by LibTorch's default).
TEST(Dsa3dCuda, FusedMatchesReferenceFloat32_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  Problem pb;
  pb.B = 2, pb.T = 4, pb.H = 7, pb.W = 6, pb.M = 4, pb.d = 40, pb.G = 2;  // d = 40: two channel chunks, a ragged one
  pb.kernel = {3, 5, 5};
  const auto in = to_device(make_inputs(pb, torch::kFloat, Offsets::kRandom, 20), torch::kCUDA);
  const auto ref = run_kernel(in, pb.kernel, ms::DsaImpl::kReference);
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCuda), ref, 0, 1e-5);
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kAuto), ref, 0, 1e-5);
}

// float64 on the GPU against the CPU reference: round-off only.
TEST(Dsa3dCuda, FusedMatchesReferenceFloat64_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  Problem pb;
  pb.T = 3, pb.H = 5, pb.W = 9, pb.M = 2, pb.d = 8;
  pb.kernel = {3, 3, 5};
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kRandom, 21);
  expect_results_close(run_kernel(to_device(in, torch::kCUDA), pb.kernel, ms::DsaImpl::kCuda),
                       run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-10, 0);
  const auto zero = make_inputs(pb, torch::kDouble, Offsets::kZero, 22);
  expect_results_close(run_kernel(to_device(zero, torch::kCUDA), pb.kernel, ms::DsaImpl::kCuda),
                       run_kernel(zero, pb.kernel, ms::DsaImpl::kReference), 1e-10, 0);
}

// bfloat16 on the GPU against the float32 reference on the same rounded values: 1e-2, as on the CPU.
TEST(Dsa3dCuda, FusedBFloat16MatchesFloat32Reference_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  Problem pb;
  pb.T = 3, pb.H = 6, pb.W = 6, pb.M = 2, pb.d = 64;
  pb.kernel = {3, 3, 3};
  const auto in16 = to_device(cast(make_inputs(pb, torch::kFloat, Offsets::kRandom, 23), torch::kBFloat16, torch::kFloat),
                              torch::kCUDA);
  expect_results_close(run_kernel(in16, pb.kernel, ms::DsaImpl::kCuda),
                       run_kernel(cast(in16, torch::kFloat, torch::kFloat), pb.kernel, ms::DsaImpl::kReference), 0,
                       1e-2);
}

// Deterministic CUDA mode: two runs bit-identical, and equal to the atomic path up to summation order.
TEST(Dsa3dCuda, DeterministicModeIsBitIdentical_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  const auto pb = determinism_problem();
  const auto in = to_device(make_inputs(pb, torch::kFloat, Offsets::kRandom, 24), torch::kCUDA);
  const auto a = run_kernel(in, pb.kernel, ms::DsaImpl::kCuda, true);
  expect_bit_identical(a, run_kernel(in, pb.kernel, ms::DsaImpl::kCuda, true));
  expect_results_close(a, run_kernel(in, pb.kernel, ms::DsaImpl::kCuda, false), 1e-6, 1e-5);
}
