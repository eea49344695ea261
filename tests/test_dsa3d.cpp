// ops::dsa3d, the 3D-DSA operator: the fused CPU kernel against the grid_sample reference and against an
// independent naive neighbourhood-attention loop; finite-difference gradients; kernel shrink;
// determinism; the API's checks; the shared per-sample math header; and (*_CUDA, skipped without a
// GPU) the fused CUDA kernel against the reference.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../src/attention/dsa3d_math.h"
#include "../src/attention/dsa3d_params.h"
#include "../src/attention/dsa3d_tile.h"
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
    case Offsets::kZero:
      in.offsets = torch::zeros(off_shape, opts);
      break;
    case Offsets::kRandom:
      in.offsets = torch::rand(off_shape, opts) * 5.0 - 2.5;
      break;
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

// While alive, the fused kernels' outputs start as NaN (an element a kernel never writes stays NaN and
// fails every comparison).
struct PoisonOutputs {
  PoisonOutputs() { ms::detail::dsa3d_set_poison_outputs(true); }
  ~PoisonOutputs() { ms::detail::dsa3d_set_poison_outputs(false); }
};

// Forward, then backward of sum(out ⊙ dout) with a fixed random dout; outputs poisoned beforehand.
Result run_kernel(const Inputs& in, std::array<int64_t, 3> kernel, ms::DsaImpl impl, bool deterministic = false,
                  uint64_t seed = 7) {
  const PoisonOutputs poisoned;
  auto q = in.q.detach().clone().requires_grad_(true);
  auto k = in.k.detach().clone().requires_grad_(true);
  auto v = in.v.detach().clone().requires_grad_(true);
  auto offsets = in.offsets.detach().clone().requires_grad_(true);
  std::optional<torch::Tensor> bias;
  if (in.bias.defined()) bias = in.bias.detach().clone().requires_grad_(true);
  auto out = ms::dsa3d(q, k, v, offsets, bias, kernel, impl, deterministic);
  // dout from the CPU's generator on every device: a GPU run and its CPU reference see the same dout.
  torch::manual_seed(seed);
  auto dout = torch::randn(out.sizes(), torch::kFloat).to(out.device(), out.scalar_type());
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

// The GPU tests print every comparison's error (the one GPU run should tell everything).
bool report_errors = false;

// max |actual - expected| <= atol + rtol · max |expected|, compared in float64 on the CPU; no NaN.
void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double atol, double rtol,
                  const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << " is undefined";
  ASSERT_TRUE(expected.defined()) << what << " (expected) is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const auto a = actual.detach().to(torch::kCPU, torch::kDouble), e = expected.detach().to(torch::kCPU, torch::kDouble);
  EXPECT_FALSE(a.isnan().any().item<bool>()) << what << " has NaN elements (unwritten, or a NaN computed)";
  const double err = (a - e).abs().max().item<double>();
  const double scale = e.abs().max().item<double>();
  EXPECT_LE(err, atol + rtol * scale) << what << ": max abs error " << err << ", max |expected| " << scale;
  if (report_errors)
    std::printf("    %-10s max abs error %.3e = %.3e of max |expected| %.3e (tolerance %.1e)\n", what.c_str(), err,
                scale > 0 ? err / scale : err, scale, atol + rtol * scale);
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
  const std::vector<std::pair<torch::Tensor*, torch::Tensor>> pairs{{&x.q, analytic.dq},
                                                                    {&x.k, analytic.dk},
                                                                    {&x.v, analytic.dv},
                                                                    {&x.offsets, analytic.doffsets},
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

// Calls f(isa) with each instruction set of the fused CPU kernels that this CPU has (baseline, AVX2, AVX-512,
// AVX512-BF16) forced in turn, under a trace naming it; restores CPUID's choice after. Returns how many ran.
int for_each_cpu_isa(const std::function<void(megaslide::ops::detail::Dsa3dCpuIsa)>& f) {
  namespace detail = megaslide::ops::detail;
  struct Restore {
    ~Restore() { detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAuto); }
  } restore;
  int paths = 0;
  for (const auto isa : {detail::Dsa3dCpuIsa::kBaseline, detail::Dsa3dCpuIsa::kAvx2, detail::Dsa3dCpuIsa::kAvx512,
                         detail::Dsa3dCpuIsa::kAvx512Bf16}) {
    try {
      detail::set_dsa3d_cpu_isa(isa);
    } catch (const std::invalid_argument&) {
      continue;  // this CPU lacks it
    }
    ++paths;
    SCOPED_TRACE(detail::to_string(isa));
    f(isa);
  }
  return paths;
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
// border rule applies: d(offsets) must still equal the reference's (float64, 1e-12). Axis lengths 6, 7,
// 11 (S - 1 not a power of two) are where grid_sample's coordinate round trip used to bring an integer
// position back a rounding below itself, so the reference took the left difference there; 1, 3, 5, 9
// are the lengths where it was always exact. Kernel (3, 5, 7) and (3, 3, 5).
TEST(Dsa3d, FusedCpuMatchesReferenceAtTokenCentresFloat64) {
  struct Case {
    std::array<int64_t, 3> volume, kernel;
  };
  for (const Case& c : {Case{{6, 7, 11}, {3, 5, 7}}, Case{{7, 11, 6}, {3, 5, 7}}, Case{{3, 5, 9}, {3, 3, 5}},
                        Case{{1, 5, 3}, {3, 3, 5}}}) {
    Problem pb;
    pb.T = c.volume[0], pb.H = c.volume[1], pb.W = c.volume[2], pb.M = 2, pb.d = 3;
    pb.kernel = c.kernel;
    const auto in = make_inputs(pb, torch::kDouble, Offsets::kZero, 3);
    const auto fused = run_kernel(in, pb.kernel, ms::DsaImpl::kCpu);
    SCOPED_TRACE("volume " + std::to_string(pb.T) + "x" + std::to_string(pb.H) + "x" + std::to_string(pb.W));
    expect_results_close(fused, run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
    EXPECT_GT(fused.doffsets.abs().max().item<double>(), 0.1);  // the comparison is not vacuous
  }
}

// The same at float32 (what training runs): positions are exact integers in float32 too, so the
// offsets gradients at zero offsets take the same side in both; 1e-5 of the largest value.
TEST(Dsa3d, FusedCpuMatchesReferenceAtTokenCentresFloat32) {
  Problem pb;
  pb.T = 6, pb.H = 7, pb.W = 11, pb.M = 2, pb.d = 8;
  pb.kernel = {3, 5, 7};
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kZero, 17);
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpu), run_kernel(in, pb.kernel, ms::DsaImpl::kReference),
                       0, 1e-5);
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

// The fused CPU forward's softmax numerators (vectors of samples, not expf): within 1 ulp of e^x on [-87, 0] (the
// range the softmax uses: logit minus its maximum), e^0 exactly 1, 0 below -87 and for -inf, NaN for NaN, on every
// instruction set the CPU has, with a tail shorter than a vector.
TEST(Dsa3d, CpuForwardExponentialIsWithinOneUlpOnEveryInstructionSet) {
  namespace detail = megaslide::ops::detail;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int paths = for_each_cpu_isa([&](detail::Dsa3dCpuIsa) {
    std::vector<float> x;
    const int64_t n = 200003;
    for (int64_t i = 0; i < n; ++i) x.push_back(-87.f * static_cast<float>(i) / static_cast<float>(n - 1));
    for (float v : {-0.f, -1e-30f, -1e-7f, -0.34657359f, -0.34657362f, -86.999f, -87.f}) x.push_back(v);
    const size_t checked = x.size();
    for (float v : {-87.001f, -100.f, -1e30f, -inf, nan}) x.push_back(v);
    std::vector<float> y = x;
    detail::dsa3d_cpu_exp(y.data(), static_cast<int64_t>(y.size()));
    double worst = 0;  // in units of the last place of e^x rounded to float
    for (size_t i = 0; i < checked; ++i) {
      const double want = std::exp(static_cast<double>(x[i]));
      const float near = static_cast<float>(want);
      const double ulp = static_cast<double>(std::nextafter(near, 2.f * near)) - near;
      worst = std::max(worst, std::abs(y[i] - want) / ulp);
    }
    EXPECT_LE(worst, 1.0) << "largest error in ulp";
    EXPECT_EQ(y[n - 1 + 1], 1.f) << "e^-0";
    EXPECT_EQ(y[0], 1.f) << "e^0";
    for (size_t i = checked; i + 1 < x.size(); ++i) EXPECT_EQ(y[i], 0.f) << "e^" << x[i];
    EXPECT_TRUE(std::isnan(y.back()));
  });
  EXPECT_GE(paths, 1);
}

// The fused CPU backward computes each sample with its 8 corners in vector lanes: on every instruction set the CPU
// has, the same corner indices and the same weight and derivative bits as dsa3d_math::trilinear_sample (NaN where it
// is NaN), at positions inside, on and beyond each axis' ends, at integers (zero weights, ±0), at -0, tiny and
// huge offsets and NaN, on a volume with an axis of length 1.
TEST(Dsa3d, CpuBackwardSamplesAreTheScalarSamplesBitForBitOnEveryInstructionSet) {
  namespace detail = megaslide::ops::detail;
  namespace math = megaslide::dsa3d_math;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> axis = {-0.f,     0.f,   -1e-30f, 1e-30f, -0.5f, -3.f,    0.25f,
                             1.f,      1.5f,  2.f,     2.999f, 3.f,   3.0001f, 3.5f,
                             7.f,      1e30f, -1e30f,  inf,    -inf,  nan,     std::nextafter(3.f, 0.f),
                             0.999999f};
  for (int i = 0; i < 40; ++i) axis.push_back(-1.f + 0.137f * static_cast<float>(i));
  int checked = 0;
  for_each_cpu_isa([&](detail::Dsa3dCpuIsa) {
    for (const auto& [T, H, W] : {std::tuple<int64_t, int64_t, int64_t>{4, 5, 6}, {1, 4, 7}}) {
      for (size_t a = 0; a < axis.size(); ++a)
        for (size_t b = 0; b < axis.size(); b += 3) {
          // t, h, w take the values in different combinations.
          const float xt = axis[a], xh = axis[b], xw = axis[(a + 2 * b) % axis.size()];
          math::Sample<float> want, got;
          math::trilinear_sample(xt, xh, xw, T, H, W, want);
          detail::dsa3d_cpu_sample(xt, xh, xw, T, H, W, got);
          const auto same = [](float x, float y) {
            return (std::isnan(x) && std::isnan(y)) || std::memcmp(&x, &y, sizeof x) == 0;
          };
          for (int c = 0; c < 8; ++c) {
            ASSERT_EQ(got.index[c], want.index[c]) << "corner " << c << " at " << xt << ", " << xh << ", " << xw;
            ASSERT_TRUE(same(got.weight[c], want.weight[c]))
                << "corner " << c << " weight " << got.weight[c] << " vs " << want.weight[c] << " at " << xt << ", "
                << xh << ", " << xw;
            for (int k = 0; k < 3; ++k)
              ASSERT_TRUE(same(got.dweight[k][c], want.dweight[k][c]))
                  << "corner " << c << " axis " << k << " derivative " << got.dweight[k][c] << " vs "
                  << want.dweight[k][c] << " at " << xt << ", " << xh << ", " << xw;
          }
          ++checked;
        }
    }
  });
  EXPECT_GT(checked, 0);
}

// The fused CPU kernels' loops are compiled once per instruction set (baseline x86-64, AVX2, AVX-512) and
// CPUID picks one: every path this CPU has, forced in turn, equals the reference — float64 to 1e-12,
// float32 to 1e-5, bfloat16 to 1e-2 of the largest value — with a group's channels (heads × d) shorter than a
// vector or spanning vectors with a tail, in blocks of 8 vectors (the forward's interpolation) and not, and with d
// a multiple of 8 or 16 (8, 32), where the AVX2 and AVX-512 backwards reduce a sample's corners together.
TEST(Dsa3d, FusedCpuMatchesReferenceOnEveryInstructionSet) {
  namespace detail = megaslide::ops::detail;
  const int paths = for_each_cpu_isa([&](detail::Dsa3dCpuIsa isa) {
    ASSERT_EQ(detail::dsa3d_cpu_isa(), isa);
    // A group's channels (heads of the group × d) select the loops: by distinct corner row from 64 (backward) and
    // 128 (forward), else per sample. d = 6, 8, 20 (2 heads a group): per sample; d = 32 (64 channels): the
    // backward by rows, the 8-row products on AVX-512 and AVX2; d = 76 (152 channels): both by rows, d a multiple
    // of 4 only (4-lane head products on AVX2 and AVX-512); 6 heads of d = 24 in one group: four heads' logits and
    // coefficients in vectors, then two one by one (8-row products on AVX2); 6 heads of d = 22: the same with the
    // scalar products and value sums (d not a multiple of 4); 4 heads of d = 64: the value rows' sums in
    // registers, blocks of 8 vectors; zero offsets (4 heads of d = 32): integer positions, whose zero-weight
    // corners the forward's row table leaves out (the backward keeps those with a position derivative); zero
    // offsets at d = 8 (2 heads a group): the same corners in the per-sample loops (the forward's zero row, the
    // backward's corner lanes on AVX2); d = 16 (2 heads a group) and 24 (2 heads in one group): the corner lanes with
    // two and three 8-channel chunks a head, the second without a bias. With AVX512-BF16 the bf16 rows' products
    // are bf16 pairs: 32 channels a step at d = 32 and 64, 16 at d = 48 (4 heads in one group: both by rows). bf16
    // rows weighted by coefficients load two channels a lane where d is a multiple of twice the vector width: 2 heads
    // of d = 48 (96 channels, the backward by rows) end in single pairs of vectors on AVX2.
    struct Case {
      int64_t M, G, d;
      Offsets offsets;
      bool bias = true;
    };
    for (const Case c :
         {Case{4, 2, 6, Offsets::kRandom}, Case{4, 2, 8, Offsets::kRandom}, Case{4, 2, 20, Offsets::kRandom},
          Case{4, 2, 32, Offsets::kRandom}, Case{4, 2, 76, Offsets::kRandom}, Case{6, 1, 24, Offsets::kRandom},
          Case{6, 1, 22, Offsets::kRandom}, Case{4, 1, 64, Offsets::kRandom}, Case{4, 1, 32, Offsets::kZero},
          Case{4, 2, 8, Offsets::kZero}, Case{4, 2, 16, Offsets::kRandom}, Case{2, 1, 24, Offsets::kRandom, false},
          Case{4, 1, 48, Offsets::kRandom}, Case{2, 1, 48, Offsets::kRandom}}) {
      const int64_t d = c.d;
      SCOPED_TRACE("M = " + std::to_string(c.M) + ", G = " + std::to_string(c.G) + ", d = " + std::to_string(d) +
                   (c.offsets == Offsets::kZero ? ", zero offsets" : "") + (c.bias ? "" : ", no bias"));
      Problem pb;
      pb.B = 2, pb.T = 3, pb.H = 5, pb.W = 4, pb.M = c.M, pb.d = d, pb.G = c.G;
      pb.kernel = {3, 3, 3};
      pb.with_bias = c.bias;
      const auto in = make_inputs(pb, torch::kDouble, c.offsets, 21);
      expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpu),
                           run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
      const auto in32 = make_inputs(pb, torch::kFloat, c.offsets, 22);
      expect_results_close(run_kernel(in32, pb.kernel, ms::DsaImpl::kCpu),
                           run_kernel(in32, pb.kernel, ms::DsaImpl::kReference), 0, 1e-5);
      const auto in16 = cast(in32, torch::kBFloat16, torch::kFloat);
      expect_results_close(run_kernel(in16, pb.kernel, ms::DsaImpl::kCpu),
                           run_kernel(cast(in16, torch::kFloat, torch::kFloat), pb.kernel, ms::DsaImpl::kReference), 0,
                           1e-2);
    }
  });
  EXPECT_GE(paths, 1);
  detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAuto);
  EXPECT_NE(detail::dsa3d_cpu_isa(), detail::Dsa3dCpuIsa::kAuto) << "the one in use is a real path";
}

namespace {
// 4 heads in G groups. G = 2: d = 16 (a group's 2 heads span 32 channels: both directions per sample) or 32 (64
// channels: the backward by distinct rows, kCpuBackwardRowsMinChannels in dsa3d_params.h). G = 1, d = 32 (128
// channels): the forward by rows as well, its four heads in vectors.
Problem determinism_problem(int64_t d = 16, int64_t G = 2) {
  Problem pb;
  pb.B = 2, pb.T = 4, pb.H = 8, pb.W = 8, pb.M = 4, pb.d = d, pb.G = G;
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

// The AVX512-BF16 loops are the AVX-512 loops except for bf16 inputs' products by distinct row: float32 inputs, and
// bf16 inputs in the per-sample loops (2 heads of d = 16 in a group: 32 channels), give the AVX-512 loops' bits; bf16
// inputs by rows (4 heads of d = 64 in one group) take VDPBF16PS's pair sums, so their bits differ (within the
// tolerances FusedCpuMatchesReferenceOnEveryInstructionSet checks against the reference).
TEST(Dsa3d, Avx512Bf16LoopsDifferFromAvx512OnlyInBf16RowProducts) {
  namespace detail = megaslide::ops::detail;
  try {
    detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAvx512Bf16);
  } catch (const std::invalid_argument&) {
    GTEST_SKIP() << "this CPU lacks AVX512-BF16";
  }
  struct Restore {
    ~Restore() { detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAuto); }
  } restore;
  const auto both = [](const Inputs& in, const std::array<int64_t, 3>& kernel) {
    detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAvx512);
    Result avx512 = run_kernel(in, kernel, ms::DsaImpl::kCpu);
    detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAvx512Bf16);
    return std::make_pair(std::move(avx512), run_kernel(in, kernel, ms::DsaImpl::kCpu));
  };
  Problem rows;
  rows.B = 1, rows.T = 3, rows.H = 5, rows.W = 4, rows.M = 4, rows.d = 64, rows.G = 1;
  Problem per_sample = rows;
  per_sample.d = 16, per_sample.G = 2;
  {
    SCOPED_TRACE("float32, by rows");
    const auto [a, b] = both(make_inputs(rows, torch::kFloat, Offsets::kRandom, 31), rows.kernel);
    expect_bit_identical(a, b);
  }
  {
    SCOPED_TRACE("bf16, per sample");
    const auto in = cast(make_inputs(per_sample, torch::kFloat, Offsets::kRandom, 32), torch::kBFloat16, torch::kFloat);
    const auto [a, b] = both(in, per_sample.kernel);
    expect_bit_identical(a, b);
  }
  {
    SCOPED_TRACE("bf16, by rows");
    const auto in = cast(make_inputs(rows, torch::kFloat, Offsets::kRandom, 33), torch::kBFloat16, torch::kFloat);
    const auto [a, b] = both(in, rows.kernel);
    EXPECT_FALSE(torch::equal(a.out, b.out) && torch::equal(a.dq, b.dq) && torch::equal(a.doffsets, b.doffsets))
        << "the bf16 rows ran the AVX-512 loops' products";
  }
}

// ---- the tile algorithm's shared math (src/attention/dsa3d_tile.h) ------------------------------------

namespace tile = megaslide::dsa3d_tile;

// The int32 axis sample (the tile kernels' instantiation) and the corners of the tile header equal the per-sample math
// of the row kernels (dsa3d_math.h) at integers, between tokens, at and beyond both borders, on axes of 1 to 7 tokens;
// and a corner's halo key maps back to the row kernels' token index.
TEST(Dsa3dTile, CornersEqualTheRowKernelsMath) {
  for (int S : {1, 2, 3, 7}) {
    for (double x : {-2.0, -0.5, 0.0, 0.25, 1.0, 1.5, 2.0, 2.75, 3.0, 5.5, 6.0, 6.5, 9.0}) {
      const auto a = megaslide::dsa3d_math::sample_axis<double, int>(x, S);
      const auto r = megaslide::dsa3d_math::sample_axis<double, int64_t>(x, S);
      EXPECT_EQ(a.i0, r.i0) << "S " << S << " x " << x;
      EXPECT_EQ(a.i1, r.i1) << "S " << S << " x " << x;
      EXPECT_EQ(a.w0, r.w0);
      EXPECT_EQ(a.w1, r.w1);
      EXPECT_EQ(a.dw, r.dw);
    }
  }
  // A whole sample on a 4×6×5 volume, halo = the whole volume: same corner tokens, weights, derivatives.
  const auto geo = tile::make_geometry(4, 6, 5, 3, 5, 3);
  const int lo[3] = {0, 0, 0}, hi[3] = {3, 5, 4};
  const tile::Halo halo = tile::make_halo(lo, hi);
  const tile::Query qr = tile::tile_query(geo, /*tile*/ 3, /*q*/ 4);  // tile (0, 1, 1), query (0, 1, 0)
  ASSERT_TRUE(qr.valid);
  EXPECT_EQ(qr.t, 0);
  EXPECT_EQ(qr.h, 5);
  EXPECT_EQ(qr.w, 4);
  EXPECT_EQ(qr.token, (0 * 6 + 5) * 5 + 4);
  const tile::Query outside = tile::tile_query(geo, 3, 15);  // h = 7 > 5: a partial tile's padding
  EXPECT_FALSE(outside.valid);
  const double off[3] = {0.3, -1.0, 2.6};
  for (int j : {0, 7, 44}) {
    const auto pt = tile::sample_point<double>(geo, qr, j, off);
    megaslide::dsa3d_math::Sample<double> ref;
    megaslide::dsa3d_math::token_sample<double>(qr.t, qr.h, qr.w, j, off[0], off[1], off[2], 4, 6, 5, 3, 5, 3, ref);
    for (int c = 0; c < 8; ++c) {
      const auto k = tile::corner_of(pt, halo, c);
      EXPECT_EQ(tile::halo_token(geo, halo, k.L), ref.index[c]) << "j " << j << " corner " << c;
      EXPECT_EQ(k.w, ref.weight[c]);
      for (int a = 0; a < 3; ++a) EXPECT_EQ(k.dw[a], ref.dweight[a][c]);
    }
  }
}

// The halo bound: with |Δ| <= r = (1, 2.5, 3), every tile's exact halo (the box of its corners) lies
// inside halo_bound_interval, per axis; the bound is 6×17×17 = 1734 keys for kernel (3, 7, 7), r = (1, 3, 3)
// away from the borders (what docs/3d-dsa.md states); and tiles one colour period apart never share
// a key, for several bounds, kernels and axis lengths (brute force over every pair).
TEST(Dsa3dTile, HaloBoundHoldsAndColoursAreDisjoint) {
  const auto geo = tile::make_geometry(7, 13, 18, 3, 7, 7);
  const double r[3] = {1.0, 2.5, 3.0};  // a fractional bound too (⌈r⌉ and ⌊r⌋ differ)
  torch::manual_seed(30);
  auto off =
      (torch::rand({geo.tokens(), geo.K, 3}, torch::kDouble) * 2 - 1) * torch::tensor({1.0, 2.5, 3.0}, torch::kDouble);
  // Offsets at the bound exactly on every 5th sample (an integer one is the worst case for the floor).
  off.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 5)},
                 torch::tensor({-1.0, -2.5, 3.0}, torch::kDouble));
  const auto* o = off.data_ptr<double>();
  for (int tile_index = 0; tile_index < geo.tiles(); ++tile_index) {
    int lo[3] = {INT_MAX, INT_MAX, INT_MAX}, hi[3] = {-1, -1, -1};
    for (int q = 0; q < tile::TileShape::kQueries; ++q) {
      const auto qr = tile::tile_query(geo, tile_index, q);
      if (!qr.valid) continue;
      for (int j = 0; j < geo.K; ++j)
        tile::halo_include(tile::sample_point<double>(geo, qr, j, o + (qr.token * geo.K + j) * 3), lo, hi);
    }
    const int idx[3] = {tile_index / (geo.tiles_h * geo.tiles_w), (tile_index / geo.tiles_w) % geo.tiles_h,
                        tile_index % geo.tiles_w};
    const int Q[3] = {tile::TileShape::kT, tile::TileShape::kH, tile::TileShape::kW}, k[3] = {3, 7, 7},
              S[3] = {geo.T, geo.H, geo.W};
    for (int a = 0; a < 3; ++a) {
      int blo, bhi;
      tile::halo_bound_interval(idx[a], Q[a], k[a], S[a], r[a], blo, bhi);
      EXPECT_GE(lo[a], blo) << "tile " << tile_index << " axis " << a;
      EXPECT_LE(hi[a], bhi) << "tile " << tile_index << " axis " << a;
    }
  }
  int lo, hi;
  tile::halo_bound_interval(3, 1, 3, 64, 1.0, lo, hi);
  EXPECT_EQ(hi - lo + 1, 6);
  tile::halo_bound_interval(5, 4, 7, 64, 3.0, lo, hi);
  EXPECT_EQ(hi - lo + 1, 17);
  for (double bound : {0.0, 0.5, 1.0, 1.5, 3.0, 7.25}) {
    for (int kk : {1, 3, 7}) {
      for (int S : {5, 16, 23, 64}) {
        if (kk > S) continue;
        for (int Qa : {1, 4}) {
          const int tiles = (S + Qa - 1) / Qa, P = tile::colour_period(tiles, Qa, kk, S, bound);
          for (int i = 0; i < tiles; ++i)
            for (int i2 = i + P; i2 < tiles; i2 += P) {
              int lo0, hi0, lo1, hi1;
              tile::halo_bound_interval(i, Qa, kk, S, bound, lo0, hi0);
              tile::halo_bound_interval(i2, Qa, kk, S, bound, lo1, hi1);
              EXPECT_LT(hi0, lo1) << "bound " << bound << " k " << kk << " S " << S << " Q " << Qa << " tiles " << i
                                  << ", " << i2;
            }
        }
      }
    }
  }
}

// ---- the tiled CPU kernel (the host twin of the tiled CUDA kernel) against the references -----------

// Random offsets beyond the borders, 2 offset groups of 2 heads (G < M), bias, a volume that is no
// multiple of the 1×4×4 tile: forward and every gradient equal the reference in float64 (1e-12).
TEST(Dsa3d, TiledCpuMatchesReferenceFloat64) {
  Problem pb;
  pb.B = 2, pb.T = 3, pb.H = 6, pb.W = 7, pb.M = 4, pb.d = 6, pb.G = 2;
  pb.kernel = {3, 3, 5};
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kRandom, 40);
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled),
                       run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
}

// Halos larger than the CPU twin's chunk of 512 keys (offsets up to ±9 tokens on a 4×20×22 volume, so
// most tiles' halos span 2 to 4 chunks and samples' corners fall on both sides of chunk boundaries):
// still equal to the reference (float64, 1e-12).
TEST(Dsa3d, TiledCpuAcrossHaloChunksMatchesReference) {
  Problem pb;
  pb.T = 4, pb.H = 20, pb.W = 22, pb.M = 2, pb.d = 3, pb.G = 1;
  pb.kernel = {3, 3, 3};
  auto in = make_inputs(pb, torch::kDouble, Offsets::kRandom, 41);
  in.offsets = in.offsets * 3.6;  // uniform in ±9 tokens
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled),
                       run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
}

// Offsets at the clamp: integers in [-4, 4] put many positions exactly on the borders (x = 0, x = S - 1)
// and beyond them, where the border rule zeroes the position gradient; the rest on token centres. An
// axis shorter than the kernel (W = 5 < 7, T = 2 < 3). Equal to the reference (float64, 1e-12).
TEST(Dsa3d, TiledCpuAtTheClampMatchesReference) {
  Problem pb;
  pb.B = 1, pb.T = 2, pb.H = 9, pb.W = 5, pb.M = 2, pb.d = 5, pb.G = 2;
  pb.kernel = {3, 5, 7};
  auto in = make_inputs(pb, torch::kDouble, Offsets::kZero, 42);
  torch::manual_seed(43);
  in.offsets = torch::randint(-4, 5, in.offsets.sizes(), torch::kDouble);
  const auto tiled = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled);
  expect_results_close(tiled, run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
  EXPECT_GT(tiled.doffsets.abs().max().item<double>(), 0.1);
}

// Zero offsets: neighbourhood attention (the naive loop, 1e-12), and at token centres on axes whose
// S - 1 is not a power of two the offsets gradients equal the reference's (kernel (3, 5, 7)).
TEST(Dsa3d, TiledCpuAtTokenCentresMatchesReference) {
  Problem pb;
  pb.B = 2, pb.T = 6, pb.H = 7, pb.W = 11, pb.M = 2, pb.d = 3;
  pb.kernel = {3, 5, 7};
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kZero, 44);
  const auto tiled = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled);
  expect_close(tiled.out, naive_neighbourhood_attention(in, pb.kernel), 1e-12, 0, "tiled vs naive");
  expect_results_close(tiled, run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
}

// A volume smaller than the kernel and than one tile (2×3×1, kernel (3, 7, 7) -> (2, 3, 1)), no bias.
TEST(Dsa3d, TiledCpuTinyVolumeWithoutBias) {
  Problem pb;
  pb.B = 2, pb.T = 2, pb.H = 3, pb.W = 1, pb.M = 2, pb.d = 4, pb.with_bias = false;
  pb.kernel = {3, 7, 7};
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kRandom, 45);
  const auto tiled = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled);
  EXPECT_FALSE(tiled.dbias.defined());
  expect_results_close(tiled, run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-12, 0);
}

// float32, bfloat16 and float16 inputs, as for the row kernel (same tolerances and reasons).
TEST(Dsa3d, TiledCpuMatchesReferenceInFloat32AndHalfPrecision) {
  Problem pb;
  pb.B = 1, pb.T = 4, pb.H = 7, pb.W = 6, pb.M = 4, pb.d = 16, pb.G = 2;
  pb.kernel = {3, 5, 5};
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 46);
  expect_results_close(run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled),
                       run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 0, 1e-5);
  for (auto [dtype, tol] : {std::pair{torch::kBFloat16, 1e-2}, std::pair{torch::kHalf, 2e-3}}) {
    const auto in16 = cast(in, dtype, torch::kFloat);
    SCOPED_TRACE(std::string("dtype ") + c10::toString(dtype));
    expect_results_close(run_kernel(in16, pb.kernel, ms::DsaImpl::kCpuTiled),
                         run_kernel(cast(in16, torch::kFloat, torch::kFloat), pb.kernel, ms::DsaImpl::kReference), 0,
                         tol);
  }
}

// Central finite differences on every input element (float64), as for the row kernel.
TEST(Dsa3d, GradcheckTiledCpuFloat64) {
  Problem pb;
  pb.T = 3, pb.H = 5, pb.W = 2, pb.M = 2, pb.d = 3, pb.G = 2;  // both tile axes partial
  pb.kernel = {3, 3, 1};
  gradcheck(make_inputs(pb, torch::kDouble, Offsets::kBetweenTokens, 47), pb.kernel, ms::DsaImpl::kCpuTiled, 1e-6, 1e-7,
            1e-6);
}

// Determinism of the tiled CPU kernel: deterministic mode (tile colours) is bit-identical across runs
// and 1 vs 2 threads; the default mode (a dK/dV copy per thread, added in order) repeats bit for bit
// for a fixed thread count and equals deterministic mode up to summation order (1e-5).
TEST(Dsa3d, TiledCpuDeterminism) {
  const auto pb = determinism_problem();
  const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 48);
  Result one, two, again, def1, def2;
  {
    ThreadCount threads(1);
    one = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled, true);
  }
  {
    ThreadCount threads(2);
    two = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled, true);
    again = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled, true);
    def1 = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled);
    def2 = run_kernel(in, pb.kernel, ms::DsaImpl::kCpuTiled);
  }
  expect_bit_identical(one, two);
  expect_bit_identical(two, again);
  expect_bit_identical(def1, def2);
  expect_results_close(def1, one, 1e-6, 1e-5);
}

// ---- gradients against finite differences ------------------------------------------------------------

// Central differences (eps 1e-6, float64) on every element of q, k, v, offsets and bias. Offsets land
// between tokens and beyond the borders (zero gradient there). Error budget: eps² · f''' + 1e-16/eps,
// both < 1e-9; the tolerance 1e-7 + 1e-6·|g| leaves margin and still catches any wrong term.
TEST(Dsa3d, GradcheckFusedCpuFloat64) {
  Problem pb;
  pb.T = 3, pb.H = 4, pb.W = 3, pb.M = 2, pb.d = 3, pb.G = 2;
  pb.kernel = {3, 3, 3};
  gradcheck(make_inputs(pb, torch::kDouble, Offsets::kBetweenTokens, 8), pb.kernel, ms::DsaImpl::kCpu, 1e-6, 1e-7,
            1e-6);
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

// Deterministic mode: two runs, and 1 thread against 2 threads, give bit-identical float32 results, on both forms
// of each direction's loops.
TEST(Dsa3d, DeterministicModeIsBitIdenticalAcrossRunsAndThreadCounts) {
  for (const auto& [d, G] : {std::pair<int64_t, int64_t>{16, 2}, {32, 2}, {32, 1}}) {
    SCOPED_TRACE("d = " + std::to_string(d) + ", G = " + std::to_string(G));
    const auto pb = determinism_problem(d, G);
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
}

// Default mode: the same thread count repeats bit-identically (per-chunk buffers added in chunk order), on both
// forms of each direction's loops.
TEST(Dsa3d, DefaultModeRepeatsForAFixedThreadCount) {
  for (const auto& [d, G] : {std::pair<int64_t, int64_t>{16, 2}, {32, 2}, {32, 1}}) {
    SCOPED_TRACE("d = " + std::to_string(d) + ", G = " + std::to_string(G));
    const auto pb = determinism_problem(d, G);
    const auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 13);
    ThreadCount threads(2);
    expect_bit_identical(run_kernel(in, pb.kernel, ms::DsaImpl::kCpu), run_kernel(in, pb.kernel, ms::DsaImpl::kCpu));
  }
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
  expect_error(
      [&] {
        ms::dsa3d(in.q.to(torch::kInt), in.k.to(torch::kInt), in.v.to(torch::kInt), in.offsets, in.bias, k,
                  ms::DsaImpl::kCpu);
      },
      "floating point");
  expect_error(
      [&] {
        ms::dsa3d(in.q, in.k, in.v, in.offsets, torch::zeros({2, 5}), k, ms::DsaImpl::kCpu);
      },
      "bias must be [M, K] = [2, 27]");
  expect_error([&] { ms::dsa3d(in.q, in.k.to(torch::kDouble), in.v, in.offsets, in.bias, k, ms::DsaImpl::kCpu); },
               "share one dtype");
  expect_error([&] { ms::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, {3, 4, 3}, ms::DsaImpl::kCpu); }, "odd");
  expect_error(
      [&] {
        ms::dsa3d(in.q, in.k, in.v, in.offsets.narrow(4, 0, 1).repeat({1, 1, 1, 1, 3, 1, 1}), in.bias, k,
                  ms::DsaImpl::kCpu);
      },
      "must divide the heads");
}

// ---- CUDA (skipped without a GPU) -----------------------------------------------------------------------------

namespace {
bool cuda_ready() { return torch::cuda::is_available(); }

// Tolerances (of the largest expected value) against the float64 reference evaluated on the same,
// already rounded inputs: float32 round-off amplified by the softmax (1e-5); bfloat16 and float16 the
// rounding of the results (2^-9, 2^-11 relative) and, in the tiled kernel, of P' and dS' before the
// tensor-core products (the same order): 1e-2 and 2e-3, as for the CPU kernels.
double tolerance_of(torch::ScalarType t) { return t == torch::kBFloat16 ? 1e-2 : t == torch::kHalf ? 2e-3 : 1e-5; }

const char* name_of(ms::DsaImpl impl) { return ms::to_string(impl); }
}  // namespace

// Both fused CUDA kernels (row and tiled) × bfloat16, float16, float32 × d = 32, 64, 128: forward and
// every gradient (q, k, v, offsets, bias) against the float64 reference on the same inputs. A 3×9×7
// volume (partial 1×4×4 tiles on two axes), 4 heads in 2 offset groups, bias, offsets in ±2.5 tokens
// (samples beyond the borders), kernel (3, 5, 5). Outputs are NaN before each run, so an element a
// kernel does not write fails. Prints every error.
TEST(Dsa3dCuda, KernelsMatchFloat64Reference_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  report_errors = true;
  for (int64_t d : {32, 64, 128}) {
    Problem pb;
    pb.B = 2, pb.T = 3, pb.H = 9, pb.W = 7, pb.M = 4, pb.d = d, pb.G = 2;
    pb.kernel = {3, 5, 5};
    const auto in32 = make_inputs(pb, torch::kFloat, Offsets::kRandom, 60 + uint64_t(d));
    for (auto dtype : {torch::kBFloat16, torch::kHalf, torch::kFloat}) {
      const auto in = to_device(cast(in32, dtype, torch::kFloat), torch::kCUDA);
      const auto ref = run_kernel(cast(in, torch::kDouble, torch::kDouble), pb.kernel, ms::DsaImpl::kReference);
      for (auto impl : {ms::DsaImpl::kCuda, ms::DsaImpl::kCudaTiled}) {
        const std::string what = std::string(name_of(impl)) + " " + c10::toString(dtype) + " d=" + std::to_string(d);
        SCOPED_TRACE(what);
        std::printf("  %s\n", what.c_str());
        expect_results_close(run_kernel(in, pb.kernel, impl), ref, 0, tolerance_of(dtype));
      }
    }
  }
  report_errors = false;
}

// The tiled kernel in float64 (its CUDA-core path: the tile algorithm without tensor-core rounding)
// equals the reference to round-off (1e-10): random offsets, and zero offsets on 6×7×11 with kernel
// (3, 5, 7) where every sample sits on a token centre (one-sided derivatives, border rule).
TEST(Dsa3dCuda, TiledFloat64MatchesReference_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  report_errors = true;
  Problem pb;
  pb.B = 2, pb.T = 3, pb.H = 6, pb.W = 7, pb.M = 4, pb.d = 6, pb.G = 2;
  pb.kernel = {3, 3, 5};
  const auto in = make_inputs(pb, torch::kDouble, Offsets::kRandom, 70);
  expect_results_close(run_kernel(to_device(in, torch::kCUDA), pb.kernel, ms::DsaImpl::kCudaTiled),
                       run_kernel(in, pb.kernel, ms::DsaImpl::kReference), 1e-10, 0);
  Problem centres;
  centres.T = 6, centres.H = 7, centres.W = 11, centres.M = 2, centres.d = 8;
  centres.kernel = {3, 5, 7};
  const auto zero = make_inputs(centres, torch::kDouble, Offsets::kZero, 71);
  expect_results_close(run_kernel(to_device(zero, torch::kCUDA), centres.kernel, ms::DsaImpl::kCudaTiled),
                       run_kernel(zero, centres.kernel, ms::DsaImpl::kReference), 1e-10, 0);
  report_errors = false;
}

// Halos larger than one shared-memory chunk (offsets up to ±9 tokens on 4×20×22: most halos span 2 or
// more chunks in the forward and the backward), float32 and bfloat16, against the float64 reference.
TEST(Dsa3dCuda, TiledAcrossHaloChunks_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  report_errors = true;
  Problem pb;
  pb.T = 4, pb.H = 20, pb.W = 22, pb.M = 2, pb.d = 64, pb.G = 1;
  pb.kernel = {3, 3, 3};
  auto in = make_inputs(pb, torch::kFloat, Offsets::kRandom, 72);
  in.offsets = in.offsets * 3.6;
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto dev = to_device(cast(in, dtype, torch::kFloat), torch::kCUDA);
    SCOPED_TRACE(c10::toString(dtype));
    expect_results_close(run_kernel(dev, pb.kernel, ms::DsaImpl::kCudaTiled),
                         run_kernel(cast(dev, torch::kDouble, torch::kDouble), pb.kernel, ms::DsaImpl::kReference), 0,
                         tolerance_of(dtype));
  }
  report_errors = false;
}

// Determinism of the tiled kernel: the forward, dq and dbias have one writer each, so two default runs
// agree bit for bit there, and so does d(offsets) where a group is one head (dk, dv, and d(offsets) of
// a group of several heads, are atomic sums in the default mode); two deterministic runs (tile colours,
// plain adds, per-head d(offsets) partials summed in order) agree in every output; and deterministic
// equals default up to summation order (float32, 1e-5). Groups of two heads and of one.
TEST(Dsa3dCuda, TiledDeterminism_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  for (int64_t groups : {2, 4}) {
    auto pb = determinism_problem();
    pb.G = groups;
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " G=" + std::to_string(groups));
      const auto in =
          to_device(cast(make_inputs(pb, torch::kFloat, Offsets::kRandom, 73), dtype, torch::kFloat), torch::kCUDA);
      const auto a = run_kernel(in, pb.kernel, ms::DsaImpl::kCudaTiled),
                 b = run_kernel(in, pb.kernel, ms::DsaImpl::kCudaTiled);
      EXPECT_TRUE(torch::equal(a.out, b.out));
      EXPECT_TRUE(torch::equal(a.dq, b.dq));
      if (pb.G == pb.M) EXPECT_TRUE(torch::equal(a.doffsets, b.doffsets));
      EXPECT_TRUE(torch::equal(a.dbias, b.dbias));
      const auto c = run_kernel(in, pb.kernel, ms::DsaImpl::kCudaTiled, true);
      expect_bit_identical(c, run_kernel(in, pb.kernel, ms::DsaImpl::kCudaTiled, true));
      if (dtype == torch::kFloat) expect_results_close(c, a, 1e-6, 1e-5);
    }
  }
}

// kAuto runs the tiled kernel for bfloat16/float16 (and trains through it), the row kernel for float32
// and for head sizes the tiled kernel lacks; asking for the tiled kernel there names the limit.
TEST(Dsa3dCuda, AutoPicksTheTiledKernelForHalfPrecision_CUDA) {
  if (!cuda_ready()) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(ms::resolve_impl(ms::DsaImpl::kAuto, torch::kCUDA), ms::DsaImpl::kCudaTiled);
  Problem pb;
  pb.d = 16;
  const auto in = to_device(cast(make_inputs(pb, torch::kFloat, Offsets::kRandom, 74), torch::kBFloat16, torch::kFloat),
                            torch::kCUDA);
  // The same kernel ran: bit-identical where it has one writer per element (dk, dv are atomic sums).
  const auto expected = run_kernel(in, pb.kernel, ms::DsaImpl::kCudaTiled),
             got = run_kernel(in, pb.kernel, ms::DsaImpl::kAuto);
  EXPECT_TRUE(torch::equal(got.out, expected.out));
  EXPECT_TRUE(torch::equal(got.dq, expected.dq));
  EXPECT_TRUE(torch::equal(got.doffsets, expected.doffsets));
  Problem wide;
  wide.d = 192;
  const auto in_wide = to_device(
      cast(make_inputs(wide, torch::kFloat, Offsets::kRandom, 75), torch::kBFloat16, torch::kFloat), torch::kCUDA);
  // It fell back to the row kernel: the same forward, bit for bit.
  EXPECT_TRUE(torch::equal(run_kernel(in_wide, wide.kernel, ms::DsaImpl::kAuto).out,
                           run_kernel(in_wide, wide.kernel, ms::DsaImpl::kCuda).out));
  expect_error([&] { run_kernel(in_wide, wide.kernel, ms::DsaImpl::kCudaTiled); }, "head size d = 192");
}

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
  const auto in16 = to_device(
      cast(make_inputs(pb, torch::kFloat, Offsets::kRandom, 23), torch::kBFloat16, torch::kFloat), torch::kCUDA);
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
