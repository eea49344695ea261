// Flow matching (diffusion/flow_matching.h) against diffusers (tests/fixtures/flow/, tools/make_fixtures.py
// flow): FlowMatchEulerDiscreteScheduler's and UniPCMultistepScheduler's (flow sigmas, as Wan samples)
// tables at several shifts, step counts and training timesteps, and whole sampling runs replayed step by
// step; the training objective's definitions and timestep distributions; guided sampling with an oracle.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <iostream>
#include <map>

#include "megaslide/diffusion/flow_matching.h"
#include "megaslide/io/safetensors.h"

namespace {

struct Fixture {
  std::map<std::string, torch::Tensor> tensors;
  nlohmann::json tables, runs;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture out;
    auto file = megaslide::io::read_safetensors(std::string(MEGASLIDE_SOURCE_DIR) +
                                                "/tests/fixtures/flow/diffusers.safetensors");
    for (auto& [name, t] : file.tensors) out.tensors[name] = t;
    out.tables = nlohmann::json::parse(file.metadata.at("tables"));
    out.runs = nlohmann::json::parse(file.metadata.at("runs"));
    return out;
  }();
  return f;
}

double max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

}  // namespace

// The property: the σ and timestep tables are diffusers' for 36 (T, shift, steps) cases: Euler's σ within
// one float32 ulp of 1 (1.2e-7) and its float timesteps within 1e-4; UniPC's σ likewise and its int64
// timesteps exactly.
TEST(FlowMatching, TablesAreDiffusers) {
  const auto& f = fixture();
  int checked = 0;
  for (const auto& t : f.tables) {
    const int64_t T = t["T"], steps = t["steps"];
    const double shift = t["shift"];
    const std::string what =
        "T " + std::to_string(T) + " shift " + std::to_string(shift) + " steps " + std::to_string(steps);
    megaslide::FlowEulerSchedule euler(steps, shift, T);
    const std::string e = t["euler"], u = t["unipc"];
    ASSERT_EQ(euler.sigmas().sizes(), f.tensors.at(e + ".sigmas").sizes()) << what;
    EXPECT_LE(max_abs(euler.sigmas(), f.tensors.at(e + ".sigmas")), 1.2e-7) << "Euler " << what;
    EXPECT_LE(max_abs(euler.timesteps(), f.tensors.at(e + ".timesteps")), 1e-4) << "Euler " << what;
    megaslide::FlowUniPC unipc(steps, shift, 2, megaslide::UniPCSolverType::kBh2, T);
    ASSERT_EQ(unipc.sigmas().sizes(), f.tensors.at(u + ".sigmas").sizes()) << what;
    EXPECT_LE(max_abs(unipc.sigmas(), f.tensors.at(u + ".sigmas")), 1.2e-7) << "UniPC " << what;
    EXPECT_TRUE(torch::equal(unipc.timesteps(), f.tensors.at(u + ".timesteps")))
        << "UniPC " << what << ": " << unipc.timesteps() << " vs " << f.tensors.at(u + ".timesteps");
    ++checked;
  }
  EXPECT_EQ(checked, 36);
}

// The property: replaying diffusers' recorded model outputs, every step of a sampling run lands where
// diffusers' step() did, within 1e-5 of the sample's scale — Euler, and UniPC of orders 1–3 with both
// solver types (predictor and UniC corrector, lower order at the start and the end). diffusers' bh1 solver
// returns NaN at its last step (−inf·0 at σ = 0); ours returns the x0 prediction there (checked finite).
TEST(FlowMatching, SamplingRunsAreDiffusersStepByStep) {
  const auto& f = fixture();
  for (const auto& run : f.runs) {
    const std::string name = run["name"], kind = run["kind"];
    const int64_t steps = run["steps"], order = run["order"];
    const double shift = run["shift"];
    const bool nan_last = run["last_step_nan"];
    megaslide::FlowEulerSchedule euler(steps, shift);
    megaslide::FlowUniPC unipc(
        steps, shift, std::max<int64_t>(order, 1),
        run["solver"] == "bh1" ? megaslide::UniPCSolverType::kBh1 : megaslide::UniPCSolverType::kBh2);
    auto x = f.tensors.at(name + ".x");
    double worst = 0.0;
    for (int64_t i = 0; i < steps; ++i) {
      const auto& v = f.tensors.at(name + ".v" + std::to_string(i));
      const auto& expected = f.tensors.at(name + ".x" + std::to_string(i + 1));
      auto next = kind == "euler" ? euler.step(i, x, v) : unipc.step(i, x, v);
      if (nan_last && i + 1 == steps) {
        EXPECT_TRUE(next.isfinite().all().item<bool>()) << name;
        continue;
      }
      const double error = max_abs(next, expected) / std::max(1.0, expected.abs().max().item<double>());
      worst = std::max(worst, error);
      EXPECT_LT(error, 1e-5) << name << " step " << i;
      x = expected;  // the next step from diffusers' sample, so that one step's error does not carry over
    }
    std::cout << name << " (" << kind << ", " << steps << " steps, shift " << shift << ", order " << order << " "
              << run["solver"] << "): largest difference " << worst << "\n";
  }
}

// The property: the training objective is x_t = (1 − σ)·x0 + σ·ε with target ε − x0, and σ follows the
// configured distribution: uniform u shifted (the median of σ is shift·½ / (1 + (shift − 1)·½)), or
// logit-normal (the median of σ at shift 1 is sigmoid(logit_mean)); draws come from the given generator.
TEST(FlowMatching, TrainingObjectiveAndTimestepDistributions) {
  auto x0 = torch::randn({3, 2, 4}), noise = torch::randn({3, 2, 4});
  auto sigma = torch::tensor({0.0f, 0.25f, 1.0f});
  auto xt = megaslide::flow_noisy(x0, noise, sigma);
  EXPECT_TRUE(torch::allclose(xt[0], x0[0]));
  EXPECT_TRUE(torch::allclose(xt[1], 0.75 * x0[1] + 0.25 * noise[1]));
  EXPECT_TRUE(torch::allclose(xt[2], noise[2]));
  EXPECT_TRUE(torch::equal(megaslide::flow_target(x0, noise), noise - x0));
  // d x_t / d σ is the target.
  auto xt2 = megaslide::flow_noisy(x0, noise, sigma + 1e-3);
  EXPECT_TRUE(torch::allclose((xt2 - xt) / 1e-3, noise - x0, 1e-2, 1e-2));

  const int64_t n = 40000;
  for (double shift : {1.0, 3.0, 5.0}) {
    auto gen = at::detail::createCPUGenerator(7);
    auto s = megaslide::sample_flow_sigmas(n, megaslide::FlowMatchingOptions().shift(shift), gen);
    EXPECT_TRUE((s > 0).all().item<bool>() && (s < 1).all().item<bool>());
    const double median = s.median().item<double>();
    EXPECT_NEAR(median, megaslide::shift_sigma(0.5, shift), 0.01) << "shift " << shift;
  }
  for (double mean : {-1.0, 0.0, 0.8}) {
    auto gen = at::detail::createCPUGenerator(9);
    auto options = megaslide::FlowMatchingOptions()
                       .sampling(megaslide::TimestepSampling::kLogitNormal)
                       .logit_mean(mean)
                       .logit_std(1.0);
    auto s = megaslide::sample_flow_sigmas(n, options, gen);
    EXPECT_NEAR(s.median().item<double>(), 1.0 / (1.0 + std::exp(-mean)), 0.01) << "logit mean " << mean;
    // The logit of σ is normal with the configured spread.
    EXPECT_NEAR(torch::logit(s.to(torch::kFloat64)).std().item<double>(), 1.0, 0.02);
  }
  auto g1 = at::detail::createCPUGenerator(3), g2 = at::detail::createCPUGenerator(3);
  EXPECT_TRUE(torch::equal(megaslide::sample_flow_sigmas(8, {}, g1), megaslide::sample_flow_sigmas(8, {}, g2)));
}

// The property: one Wan2.2 expert's σ (a range [σ_lo, σ_hi) of the shifted σ) are the whole distribution's
// draws that fall in the range — every draw inside it, and its quantiles those of the unrestricted draws
// kept there (uniform and logit-normal, shift 5, the high- and the low-noise expert's side of 0.875); the
// boundary put on the unshifted u instead (u >= 0.875) would draw the high-noise expert only σ >= 0.97 at
// shift 5, two thirds of its range never seen.
TEST(FlowMatching, ExpertRangesDrawTheDistributionRestrictedToThem) {
  const double shift = 5.0, boundary = 0.875;
  const int64_t n = 200000;
  for (const auto sampling : {megaslide::TimestepSampling::kUniform, megaslide::TimestepSampling::kLogitNormal}) {
    const auto whole_options = megaslide::FlowMatchingOptions().shift(shift).sampling(sampling).logit_mean(-0.3);
    auto g = at::detail::createCPUGenerator(21);
    const auto whole = megaslide::sample_flow_sigmas(4 * n, whole_options, g).to(torch::kFloat64);
    for (const bool high : {true, false}) {
      SCOPED_TRACE(std::string(sampling == megaslide::TimestepSampling::kUniform ? "uniform" : "logit-normal") +
                   (high ? ", high-noise expert" : ", low-noise expert"));
      auto options = whole_options;
      if (high) options.sigma_min(boundary);
      else options.sigma_max(boundary);
      auto gen = at::detail::createCPUGenerator(22);
      const auto s = megaslide::sample_flow_sigmas(n, options, gen).to(torch::kFloat64);
      if (high)
        EXPECT_TRUE((s >= boundary).all().item<bool>() && (s <= 1).all().item<bool>());  // float32 may round up to 1
      else EXPECT_TRUE((s >= 0).all().item<bool>() && (s < boundary).all().item<bool>());
      const auto kept = whole.masked_select(high ? whole >= boundary : whole < boundary);
      ASSERT_GT(kept.numel(), 20000);
      const auto q = torch::tensor({0.05, 0.25, 0.5, 0.75, 0.95}, torch::kFloat64);
      const auto expected = torch::quantile(kept, q), got = torch::quantile(s, q);
      EXPECT_LT((got - expected).abs().max().item<double>(), 0.004) << got << "\n" << expected;
    }
  }
  auto g = at::detail::createCPUGenerator(1);
  EXPECT_THROW(megaslide::sample_flow_sigmas(4, megaslide::FlowMatchingOptions().sigma_min(0.5).sigma_max(0.5), g),
               c10::Error);
}

// The property: guided flow sampling integrates the guided velocity. With an oracle whose conditional
// velocity is (x − c)/σ (the exact velocity towards the data point c) and whose unconditional one is
// x/σ (towards 0), the guided velocity points at s·c, and Euler's steps, each landing on the straight
// line to it, end exactly there; the model receives σ_i·T for the batch [cond; uncond].
TEST(FlowMatching, GuidedSamplingReachesTheOraclesTarget) {
  const std::vector<int64_t> shape{2, 3, 4};
  const auto c = torch::randn({1, 2, 3, 4});
  int calls = 0;
  auto oracle = [&](const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text, const torch::Tensor&) {
    ++calls;
    EXPECT_EQ(t.size(0), x.size(0));
    const auto sigma = (t / 1000.0).view({-1, 1, 1, 1});
    const auto target = text.view({-1, 1, 1, 1}) * c;  // text 1: c, text 0: 0
    return (x - target) / sigma;
  };
  megaslide::Conditioning cond{torch::ones({2, 1}), {}}, uncond{torch::zeros({1, 1}), {}};
  for (double scale : {1.0, 4.0}) {
    calls = 0;
    auto options = megaslide::FlowSamplerOptions()
                       .kind(megaslide::FlowSamplerKind::kEuler)
                       .steps(12)
                       .shift(3.0)
                       .guidance_scale(scale);
    auto out = megaslide::flow_sample(oracle, options, shape, {1, 2}, cond, uncond, torch::kCPU);
    EXPECT_EQ(calls, 12);
    EXPECT_LT((out - scale * c).abs().max().item<double>(), 1e-4) << "guidance " << scale;
  }
  // Different seeds start from different noise; the same seed from the same.
  auto options = megaslide::FlowSamplerOptions().kind(megaslide::FlowSamplerKind::kUniPC).steps(3).guidance_scale(1.0);
  auto zero = [](const torch::Tensor& x, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
    return torch::zeros_like(x);
  };
  auto a = megaslide::flow_sample(zero, options, shape, {5, 5, 6}, megaslide::Conditioning{torch::ones({3, 1}), {}}, {},
                                  torch::kCPU);
  EXPECT_TRUE(torch::equal(a[0], a[1]));
  EXPECT_FALSE(torch::equal(a[0], a[2]));
}
