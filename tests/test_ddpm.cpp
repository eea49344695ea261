// DDPMSchedule: tables equal their closed forms; add_noise is sqrt(ᾱ) x0 + sqrt(1-ᾱ) ε; the ε, v and x0 training
// targets. The loss weights (diffusion.loss_weighting) are diffusers' (tests/fixtures/loss_weighting/).
#include "megaslide/diffusion/ddpm.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>

#include "megaslide/diffusion/loss_weighting.h"
#include "megaslide/io/safetensors.h"

using megaslide::BetaSchedule;
using megaslide::DDPMSchedule;

TEST(DDPM, LinearBetasAndCumulativeProduct) {
  DDPMSchedule s(1000, BetaSchedule::kLinear, 1e-4, 0.02);
  auto betas = s.betas();
  ASSERT_EQ(betas.size(0), 1000);
  EXPECT_NEAR(betas[0].item<double>(), 1e-4, 1e-15);
  EXPECT_NEAR(betas[999].item<double>(), 0.02, 1e-15);
  EXPECT_NEAR(betas[500].item<double>(), 1e-4 + (0.02 - 1e-4) * 500.0 / 999.0, 1e-15);
  double abar = 1.0;  // independent running product
  for (int t = 0; t < 1000; ++t) {
    abar *= 1.0 - (1e-4 + (0.02 - 1e-4) * t / 999.0);
    ASSERT_NEAR(s.alphas_cumprod()[t].item<double>(), abar, 1e-12) << "t=" << t;
  }
}

TEST(DDPM, CosineScheduleMatchesNicholDhariwal) {
  DDPMSchedule s(100, BetaSchedule::kCosine);
  auto f = [](double t) { return std::pow(std::cos((t / 100.0 + 0.008) / 1.008 * M_PI / 2), 2); };
  for (int t = 0; t < 99; ++t) {  // the last step is clipped at beta = 0.999
    ASSERT_NEAR(s.alphas_cumprod()[t].item<double>(), f(t + 1) / f(0), 1e-10) << "t=" << t;
  }
  EXPECT_LE(s.betas().max().item<double>(), 0.999);
}

TEST(DDPM, AddNoiseIsTheClosedForm) {
  DDPMSchedule s(1000, BetaSchedule::kLinear);
  torch::manual_seed(3);
  auto x0 = torch::randn({3, 2, 4, 5, 5});
  auto eps = torch::randn_like(x0);
  auto t = torch::tensor({0, 417, 999}, torch::kLong);
  auto xt = s.add_noise(x0, eps, t);
  for (int b = 0; b < 3; ++b) {
    double abar = s.alphas_cumprod()[t[b].item<int64_t>()].item<double>();
    auto expected = std::sqrt(abar) * x0[b] + std::sqrt(1 - abar) * eps[b];
    EXPECT_TRUE(torch::allclose(xt[b], expected, 1e-5, 1e-6)) << "b=" << b;
  }
}

TEST(DDPM, SampledTimestepsCoverTheRange) {
  DDPMSchedule s(10, BetaSchedule::kLinear);
  torch::manual_seed(0);
  auto t = s.sample_timesteps(2000, torch::kCPU);
  EXPECT_EQ(t.min().item<int64_t>(), 0);
  EXPECT_EQ(t.max().item<int64_t>(), 9);
}

TEST(DDPM, TrainingTargetsAreNoiseVAndX0) {
  // v = sqrt(ᾱ_t)·ε − sqrt(1−ᾱ_t)·x0 with ᾱ_t from an independent running product of the linear β;
  // ε and x0 targets are the inputs themselves.
  DDPMSchedule s(1000, BetaSchedule::kLinear);
  torch::manual_seed(2);
  auto x0 = torch::rand({3, 2, 2, 2, 2}) * 2 - 1, noise = torch::randn({3, 2, 2, 2, 2});
  auto t = torch::tensor({0, 400, 999}, torch::kLong);
  EXPECT_TRUE(torch::equal(s.target(megaslide::Prediction::kEpsilon, x0, noise, t), noise));
  EXPECT_TRUE(torch::equal(s.target(megaslide::Prediction::kX0, x0, noise, t), x0));
  auto v = s.target(megaslide::Prediction::kV, x0, noise, t);
  for (int64_t i = 0; i < 3; ++i) {
    double abar = 1.0;
    for (int64_t k = 0; k <= t[i].item<int64_t>(); ++k)
      abar *= 1.0 - (1e-4 + (0.02 - 1e-4) * static_cast<double>(k) / 999.0);
    auto expected = std::sqrt(abar) * noise[i] - std::sqrt(1 - abar) * x0[i];
    EXPECT_TRUE(torch::allclose(v[i], expected, 0, 1e-6)) << "t = " << t[i].item<int64_t>();
  }
  EXPECT_EQ(megaslide::parse_prediction("v"), megaslide::Prediction::kV);
  EXPECT_STREQ(megaslide::to_string(megaslide::parse_prediction("x0")), "x0");
  EXPECT_THROW(megaslide::parse_prediction("eps"), c10::Error);
}

namespace {
struct LossWeightingFixture {
  std::map<std::string, torch::Tensor> tensors;
  nlohmann::json schedules;
  LossWeightingFixture() {
    auto file = megaslide::io::read_safetensors(std::string(MEGASLIDE_SOURCE_DIR) +
                                                "/tests/fixtures/loss_weighting/diffusers.safetensors");
    for (auto& [name, t] : file.tensors) tensors[name] = t;
    schedules = nlohmann::json::parse(file.metadata.at("schedules"));
  }
};

// max |ours − theirs| / |theirs|, elementwise.
double max_relative_error(const torch::Tensor& ours, const torch::Tensor& theirs) {
  const auto t = theirs.to(torch::kFloat64);
  return ((ours.to(torch::kFloat64) - t).abs() / t.abs()).max().item<double>();
}
}  // namespace

// Property: Min-SNR-γ's weights are those of diffusers' training scripts (compute_snr, then min(SNR, γ) over SNR for
// ε, over SNR + 1 for v, alone for x0) for linear and cosine schedules, 1000 and 37 timesteps, γ 1, 5 and 20, at
// timesteps from the first to the last, within 2e-5 relative (diffusers keeps β in float32, which puts 1 − β at the
// cosine schedule's cap of 0.999 off by 1.3e-5 relative, and takes SNR's square roots in float32).
TEST(LossWeighting, MinSnrWeightsAreDiffusers) {
  const LossWeightingFixture f;
  ASSERT_EQ(f.schedules.size(), 3u);
  for (const auto& s : f.schedules) {
    const std::string name = s.at("name");
    SCOPED_TRACE(name);
    const DDPMSchedule schedule(s.at("timesteps").get<int64_t>(),
                                megaslide::parse_beta_schedule(s.at("beta_schedule").get<std::string>()),
                                s.at("beta_start").get<double>(), s.at("beta_end").get<double>());
    const auto& t = f.tensors.at(name + ".timesteps");
    for (const double gamma : {1.0, 5.0, 20.0})
      for (const std::string prediction : {"epsilon", "v", "x0"}) {
        const auto ours = megaslide::min_snr_weights(schedule, megaslide::parse_prediction(prediction), t, gamma);
        EXPECT_EQ(ours.scalar_type(), torch::kFloat32);
        const auto& theirs = f.tensors.at(name + "." + prediction + ".gamma" +
                                          (gamma == 1.0   ? "1"
                                           : gamma == 5.0 ? "5"
                                                          : "20"));
        EXPECT_LT(max_relative_error(ours, theirs), 2e-5) << prediction << " γ " << gamma;
      }
  }
}

// Property: the flow weights are SD3's as diffusers computes them (compute_loss_weighting_for_sd3: σ⁻² and
// 2 / (π·(1 − 2σ + 2σ²))) from σ = 0.001 to 1, within 1e-6 relative; none and min_snr are not flow weights.
TEST(LossWeighting, FlowWeightsAreSd3s) {
  const LossWeightingFixture f;
  const auto& sigmas = f.tensors.at("flow.sigmas");
  for (const std::string scheme : {"sigma_sqrt", "cosmap"}) {
    const auto ours = megaslide::flow_loss_weights(megaslide::parse_loss_weighting(scheme), sigmas.to(torch::kFloat32));
    EXPECT_LT(max_relative_error(ours, f.tensors.at("flow." + scheme)), 1e-6) << scheme;
  }
  EXPECT_THROW(megaslide::flow_loss_weights(megaslide::LossWeighting::kMinSnr, sigmas), c10::Error);
  EXPECT_THROW(megaslide::parse_loss_weighting("snr"), c10::Error);
}
