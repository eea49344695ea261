// Samplers: respacing, the schedule tables against closed forms (including Bayes' rule for the Gaussian
// posterior, derived independently of the code's formulas), classifier-free guidance, DDIM(η = 1) =
// DDPM, per-sample seeding, sampling a known Gaussian data distribution with its exact ε-predictor, and
// the same sampling with the exact v- and x0-predictors; the timestep spacings and single steps against
// diffusers' schedulers (tests/fixtures/sampler/).
#include "megaslide/diffusion/sampler.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>

#include "megaslide/io/safetensors.h"

using megaslide::BetaSchedule;
using megaslide::Conditioning;
using megaslide::DDPMSchedule;
using megaslide::SamplerKind;
using megaslide::SamplerOptions;
using megaslide::SamplingSchedule;

namespace {

// A small dense DiT whose parameters are all random (a freshly built DiT outputs zeros: adaLN-Zero).
megaslide::DiT random_dit(uint64_t seed) {
  torch::manual_seed(seed);
  megaslide::DiT dit(megaslide::DiTOptions()
                         .arch(megaslide::Architecture::kDense3D)
                         .in_channels(3)
                         .patch({1, 2, 2})
                         .hidden(16)
                         .layers(2)
                         .heads(2)
                         .text_dim(8));
  torch::NoGradGuard no_grad;
  for (auto& p : dit->parameters()) p.copy_(torch::randn_like(p) * 0.3);
  dit->eval();
  return dit;
}

Conditioning random_text(int64_t batch, int64_t tokens, uint64_t seed) {
  torch::manual_seed(seed);
  Conditioning c;
  c.text = torch::randn({batch, tokens, 8});
  c.mask = torch::ones({batch, tokens}, torch::kBool);
  c.mask.index_put_({torch::indexing::Slice(), tokens - 1}, false);  // one padded token per row
  return c;
}

// Predictor that is exact for data x0 ~ N(mu, s²) i.i.d. per element: E[ε | x_t] =
// sqrt(1−ᾱ)·(x_t − sqrt(ᾱ)·mu) / (ᾱ·s² + 1 − ᾱ), E[x0 | x_t] = mu + sqrt(ᾱ)·s²·(x_t − sqrt(ᾱ)·mu) / (ᾱ·s² + 1 − ᾱ)
// (Gaussian conditioning, computed here independently of the ε form), and E[v | x_t] = sqrt(ᾱ)·E[ε] −
// sqrt(1−ᾱ)·E[x0]. The ε form in float32 as before; x0 and v in float64, returned as float32. It ignores
// the text, so guidance does not change it.
class GaussianOracle final : public megaslide::Denoiser {
 public:
  GaussianOracle(const DDPMSchedule& s, double mu, double sd,
                 megaslide::Prediction prediction = megaslide::Prediction::kEpsilon)
      : abar_(s.alphas_cumprod()), mu_(mu), sd_(sd), prediction_(prediction) {}
  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor&,
                        const torch::Tensor&) override {
    ++calls;
    if (prediction_ == megaslide::Prediction::kEpsilon) {
      auto a = abar_.index_select(0, t).to(torch::kFloat32).view({-1, 1, 1, 1, 1});
      return (1 - a).sqrt() * (x - a.sqrt() * mu_) / (a * sd_ * sd_ + 1 - a);
    }
    auto a = abar_.index_select(0, t).view({-1, 1, 1, 1, 1});
    auto xd = x.to(torch::kFloat64), denom = a * sd_ * sd_ + 1 - a;
    auto x0 = mu_ + a.sqrt() * sd_ * sd_ * (xd - a.sqrt() * mu_) / denom;
    if (prediction_ == megaslide::Prediction::kX0) return x0.to(torch::kFloat32);
    auto eps = (1 - a).sqrt() * (xd - a.sqrt() * mu_) / denom;
    return (a.sqrt() * eps - (1 - a).sqrt() * x0).to(torch::kFloat32);
  }
  int calls = 0;

 private:
  torch::Tensor abar_;
  double mu_, sd_;
  megaslide::Prediction prediction_;
};

}  // namespace

TEST(Sampler, RespacingSpreadsStepsEvenlyOverBothEnds) {
  auto ts = SamplingSchedule::respaced_timesteps(1000, 30);
  ASSERT_EQ(ts.size(), 30u);
  EXPECT_EQ(ts.front(), 0);
  EXPECT_EQ(ts.back(), 999);
  for (size_t i = 1; i < ts.size(); ++i) {
    const int64_t gap = ts[i] - ts[i - 1];
    EXPECT_TRUE(gap == 34 || gap == 35) << "gap " << gap << " at " << i;  // 999 / 29 = 34.45
  }
  auto all = SamplingSchedule::respaced_timesteps(50, 50);
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(all[static_cast<size_t>(i)], i);
  // Halves round to even, as numpy's linspace(...).round() does: 999/6 = 166.5 -> 166, 832.5 -> 832.
  EXPECT_EQ(SamplingSchedule::respaced_timesteps(1000, 7), (std::vector<int64_t>{0, 166, 333, 500, 666, 832, 999}));
  EXPECT_EQ(SamplingSchedule::respaced_timesteps(1000, 1),
            std::vector<int64_t>{0});  // numpy: linspace(0, 999, 1) = [0]
  EXPECT_THROW(SamplingSchedule::respaced_timesteps(1000, 0), c10::Error);
  EXPECT_THROW(SamplingSchedule::respaced_timesteps(1000, 1001), c10::Error);
}

TEST(Sampler, LeadingAndTrailingSpacings) {
  using megaslide::TimestepSpacing;
  // leading: multiples of floor(T/S) from 0; trailing: down from T−1 in steps of T/S (rounded).
  EXPECT_EQ(SamplingSchedule::respaced_timesteps(1000, 4, TimestepSpacing::kLeading),
            (std::vector<int64_t>{0, 250, 500, 750}));
  EXPECT_EQ(SamplingSchedule::respaced_timesteps(1000, 3, TimestepSpacing::kLeading),
            (std::vector<int64_t>{0, 333, 666}));
  EXPECT_EQ(SamplingSchedule::respaced_timesteps(1000, 4, TimestepSpacing::kTrailing),
            (std::vector<int64_t>{249, 499, 749, 999}));
  EXPECT_EQ(SamplingSchedule::respaced_timesteps(1000, 3, TimestepSpacing::kTrailing),
            (std::vector<int64_t>{332, 666, 999}));
  EXPECT_EQ(SamplingSchedule::respaced_timesteps(1000, 1, TimestepSpacing::kTrailing), std::vector<int64_t>{999});
  for (auto spacing : {TimestepSpacing::kLinspace, TimestepSpacing::kLeading, TimestepSpacing::kTrailing}) {
    EXPECT_EQ(megaslide::parse_timestep_spacing(megaslide::to_string(spacing)), spacing);
    for (int64_t S : {1, 2, 61, 999, 1000}) {
      auto ts = SamplingSchedule::respaced_timesteps(1000, S, spacing);
      ASSERT_EQ(static_cast<int64_t>(ts.size()), S);
      EXPECT_NO_THROW(SamplingSchedule(DDPMSchedule(1000, BetaSchedule::kLinear), ts))
          << "ascending, distinct, in range";
    }
  }
  EXPECT_THROW(megaslide::parse_timestep_spacing("uniform"), c10::Error);
}

TEST(Sampler, FullRespacingReproducesTheTrainingSchedule) {
  DDPMSchedule train(1000, BetaSchedule::kLinear);
  SamplingSchedule s(train, 1000);
  EXPECT_TRUE(torch::allclose(s.betas(), train.betas(), 0, 1e-12));
  EXPECT_TRUE(torch::allclose(s.alphas_cumprod(), train.alphas_cumprod(), 0, 1e-15));
  // Closed forms with an independent running product: ᾱ_t = Π(1 − β), and DDPM's posterior tables.
  double abar_prev = 1.0;
  for (int64_t t = 0; t < 1000; ++t) {
    const double beta = 1e-4 + (0.02 - 1e-4) * static_cast<double>(t) / 999.0, abar = abar_prev * (1 - beta);
    ASSERT_NEAR(s.alphas_cumprod()[t].item<double>(), abar, 1e-12);
    ASSERT_NEAR(s.alphas_cumprod_prev()[t].item<double>(), abar_prev, 1e-12);
    ASSERT_NEAR(s.posterior_variance()[t].item<double>(), beta * (1 - abar_prev) / (1 - abar), 1e-12) << t;
    ASSERT_NEAR(s.posterior_mean_coef1()[t].item<double>(), beta * std::sqrt(abar_prev) / (1 - abar), 1e-12) << t;
    ASSERT_NEAR(s.posterior_mean_coef2()[t].item<double>(), (1 - abar_prev) * std::sqrt(1 - beta) / (1 - abar), 1e-12)
        << t;
    abar_prev = abar;
  }
}

TEST(Sampler, RespacedPosteriorIsBayesRuleForTheKeptTimesteps) {
  // For kept timesteps s < t: q(x_s | x0) = N(sqrt(ᾱ_s)·x0, 1 − ᾱ_s), q(x_t | x_s) = N(sqrt(a)·x_s, 1 − a),
  // a = ᾱ_t/ᾱ_s. Bayes: precision = 1/(1 − ᾱ_s) + a/(1 − a), mean = var·(sqrt(ᾱ_s)·x0/(1 − ᾱ_s) + sqrt(a)·x_t/(1 − a)).
  for (auto kind : {BetaSchedule::kLinear, BetaSchedule::kCosine}) {
    DDPMSchedule train(1000, kind);
    SamplingSchedule s(train, 30);
    auto abar_train = train.alphas_cumprod();
    for (int64_t i = 0; i < 30; ++i) {
      const int64_t t = s.timesteps()[i].item<int64_t>();
      ASSERT_DOUBLE_EQ(s.alphas_cumprod()[i].item<double>(), abar_train[t].item<double>());
      if (i == 0) {  // the last reverse step returns the x0 prediction itself
        EXPECT_NEAR(s.posterior_mean_coef1()[0].item<double>(), 1.0, 1e-12);
        EXPECT_NEAR(s.posterior_mean_coef2()[0].item<double>(), 0.0, 1e-12);
        EXPECT_NEAR(s.posterior_variance()[0].item<double>(), 0.0, 1e-12);
        continue;
      }
      const double abar_s = abar_train[s.timesteps()[i - 1].item<int64_t>()].item<double>(),
                   abar_t = abar_train[t].item<double>();
      const double a = abar_t / abar_s;
      const double var = 1.0 / (1.0 / (1 - abar_s) + a / (1 - a));
      EXPECT_NEAR(s.posterior_variance()[i].item<double>(), var, 1e-12 + 1e-9 * var) << i;
      EXPECT_NEAR(s.posterior_mean_coef1()[i].item<double>(), var * std::sqrt(abar_s) / (1 - abar_s), 1e-10) << i;
      EXPECT_NEAR(s.posterior_mean_coef2()[i].item<double>(), var * std::sqrt(a) / (1 - a), 1e-10) << i;
      // Respaced β reproduce ᾱ through the running product.
      EXPECT_NEAR(s.alphas_cumprod()[i - 1].item<double>() * (1 - s.betas()[i].item<double>()), abar_t, 1e-14);
    }
  }
}

TEST(Sampler, GuidanceScaleOneIsTheConditionalPredictionAndScaleMixesLinearly) {
  auto dit = random_dit(5);
  megaslide::ResidentDenoiser denoiser(dit);
  torch::manual_seed(6);
  auto x = torch::randn({2, 3, 2, 4, 4});
  auto t = torch::tensor({17, 640}, torch::kLong);
  auto cond = random_text(2, 4, 7), uncond = random_text(1, 2, 8);
  // Separate, unbatched references: the conditional pass, and the unconditional one (batch-1 text
  // broadcast by hand, padded to the conditional length as guided_prediction does).
  auto eps_c = denoiser.predict(x, t, cond.text, cond.mask);
  auto ut = torch::cat({uncond.text, torch::zeros({1, 2, 8})}, 1).expand({2, 4, 8});
  auto um = torch::cat({uncond.mask, torch::zeros({1, 2}, torch::kBool)}, 1).expand({2, 4});
  auto eps_u = denoiser.predict(x, t, ut, um);
  ASSERT_GT((eps_c - eps_u).abs().max().item<double>(), 1e-3) << "the text must matter for this test to mean anything";
  // Batched and unbatched float32 matmuls round differently (measured: 1.5e-6 of the largest |ε|), so
  // agreement is asked to 1e-5 of the largest |ε|, times (1 + 2s) for the mix.
  const double tol = 1e-5 * eps_c.abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(megaslide::guided_prediction(denoiser, x, t, cond, uncond, 1.0), eps_c, 0, 3 * tol));
  EXPECT_TRUE(torch::allclose(megaslide::guided_prediction(denoiser, x, t, cond, uncond, 0.0), eps_u, 0, tol));
  EXPECT_TRUE(torch::allclose(megaslide::guided_prediction(denoiser, x, t, cond, uncond, 7.5),
                              eps_u + 7.5 * (eps_c - eps_u), 0, 16 * tol));
}

TEST(Sampler, DdimWithEtaOneIsAncestralDdpm) {
  auto dit = random_dit(9);
  megaslide::ResidentDenoiser denoiser(dit);
  DDPMSchedule train(1000, BetaSchedule::kLinear);
  auto cond = random_text(2, 3, 10), uncond = random_text(1, 3, 11);
  auto opts = SamplerOptions().steps(12).guidance_scale(3.0);
  auto ddpm = megaslide::sample(denoiser, train, opts, {3, 2, 4, 4}, {101, 202}, cond, uncond, torch::kCPU);
  auto ddim = megaslide::sample(denoiser, train, SamplerOptions(opts).kind(SamplerKind::kDDIM).eta(1.0), {3, 2, 4, 4},
                                {101, 202}, cond, uncond, torch::kCPU);
  auto ddim0 = megaslide::sample(denoiser, train, SamplerOptions(opts).kind(SamplerKind::kDDIM).eta(0.0), {3, 2, 4, 4},
                                 {101, 202}, cond, uncond, torch::kCPU);
  EXPECT_TRUE(torch::allclose(ddim, ddpm, 0, 1e-4)) << (ddim - ddpm).abs().max().item<double>();
  EXPECT_GT((ddim0 - ddpm).abs().max().item<double>(), 1e-2) << "η = 0 must differ from the ancestral sampler";
}

TEST(Sampler, EachSampleDependsOnlyOnItsSeed) {
  auto dit = random_dit(12);
  megaslide::ResidentDenoiser denoiser(dit);
  DDPMSchedule train(1000, BetaSchedule::kLinear);
  auto cond = random_text(2, 3, 13), uncond = random_text(1, 3, 14);
  auto opts = SamplerOptions().steps(8);
  auto pair = megaslide::sample(denoiser, train, opts, {3, 2, 4, 4}, {5, 9}, cond, uncond, torch::kCPU);
  auto again = megaslide::sample(denoiser, train, opts, {3, 2, 4, 4}, {5, 9}, cond, uncond, torch::kCPU);
  EXPECT_TRUE(torch::equal(pair, again)) << "same seeds, same process: identical";
  Conditioning second{cond.text.slice(0, 1), cond.mask.slice(0, 1)};
  auto alone = megaslide::sample(denoiser, train, opts, {3, 2, 4, 4}, {9}, second, uncond, torch::kCPU);
  // Up to float32 rounding of batched vs unbatched matmuls (see above).
  EXPECT_TRUE(torch::allclose(alone[0], pair[1], 0, 1e-4 * (1 + pair.abs().max().item<double>())))
      << "a sample must not depend on its batch neighbours: " << (alone[0] - pair[1]).abs().max().item<double>();
  EXPECT_GT((pair[0] - pair[1]).abs().max().item<double>(), 1e-2);
}

namespace {
// For data x0 ~ N(mu, sd²) and the exact ε-predictor every step is affine in x plus independent noise,
// x' = A·x + B + σ·z, so the sampler's output is Gaussian with a mean and variance computed here by a
// scalar recursion in double, from its own ᾱ (a running product of the linear β), Bayes' rule for the DDPM
// posterior and DDIM's update. Returns {mean, sd}.
std::pair<double, double> gaussian_sampler_output(SamplerKind kind, int64_t steps, double mu, double sd) {
  std::vector<double> abar(1000);
  double p = 1.0;
  for (int t = 0; t < 1000; ++t) abar[static_cast<size_t>(t)] = p *= 1.0 - (1e-4 + (0.02 - 1e-4) * t / 999.0);
  auto ts = SamplingSchedule::respaced_timesteps(1000, steps);
  double m = 0.0, v = 1.0;
  for (int64_t i = steps - 1; i >= 0; --i) {
    const double ab = abar[static_cast<size_t>(ts[static_cast<size_t>(i)])];
    const double abp = i > 0 ? abar[static_cast<size_t>(ts[static_cast<size_t>(i - 1)])] : 1.0;
    const double k = std::sqrt(1 - ab) / (ab * sd * sd + 1 - ab);  // ε̂ = k·x − k·sqrt(ab)·mu
    const double a = (1 - std::sqrt(1 - ab) * k) / std::sqrt(ab), b = std::sqrt(1 - ab) * k * mu;  // x0̂ = a·x + b
    double A, B, noise_var;
    if (i == 0) {
      A = a, B = b, noise_var = 0.0;  // the last step returns x0̂
    } else if (kind == SamplerKind::kDDPM) {
      const double alpha = ab / abp, var = 1.0 / (1.0 / (1 - abp) + alpha / (1 - alpha));
      const double cx0 = var * std::sqrt(abp) / (1 - abp), cx = var * std::sqrt(alpha) / (1 - alpha);
      A = cx0 * a + cx, B = cx0 * b, noise_var = var;
    } else {  // DDIM, η = 0: x' = sqrt(abp)·x0̂ + sqrt(1 − abp)·(x − sqrt(ab)·x0̂)/sqrt(1 − ab)
      const double e = std::sqrt(1 - abp) / std::sqrt(1 - ab);
      A = (std::sqrt(abp) - e * std::sqrt(ab)) * a + e, B = (std::sqrt(abp) - e * std::sqrt(ab)) * b, noise_var = 0.0;
    }
    m = A * m + B;
    v = A * A * v + noise_var;
  }
  return {m, std::sqrt(v)};
}
}  // namespace

TEST(Sampler, ExactPredictorGivesTheSamplersPredictedGaussian) {
  // 4 × 8192 draws: the standard error of the mean is sd/181, of the sd about sd/256; bounds of 4 of
  // them (plus float32 slack) make the test fail for an error in any coefficient, not for bad luck.
  DDPMSchedule train(1000, BetaSchedule::kLinear);
  GaussianOracle oracle(train, 0.3, 0.2);
  Conditioning cond{torch::zeros({4, 1, 8}), torch::ones({4, 1}, torch::kBool)};
  for (auto kind : {SamplerKind::kDDPM, SamplerKind::kDDIM}) {
    for (int64_t steps : {30, 1000}) {
      oracle.calls = 0;
      auto opts = SamplerOptions().kind(kind).steps(steps).guidance_scale(7.5).clip_denoised(false);
      auto x = megaslide::sample(oracle, train, opts, {1, 8, 32, 32}, {1, 2, 3, 4}, cond, cond, torch::kCPU);
      EXPECT_EQ(oracle.calls, steps) << "one batched (cond + uncond) call per step";
      const auto [m, s] = gaussian_sampler_output(kind, steps, 0.3, 0.2);
      const double mean = x.mean().item<double>(), sd = x.std().item<double>();
      const std::string what = std::string(megaslide::to_string(kind)) + " " + std::to_string(steps) + " steps";
      std::cout << what << ": sample mean " << mean << " sd " << sd << "; predicted " << m << ", " << s << "\n";
      EXPECT_NEAR(mean, m, 4 * s / 181 + 1e-4) << what;
      EXPECT_NEAR(sd, s, 4 * s / 256 + 1e-4) << what;
      if (steps == 1000) {
        // With every training step, the samplers come close to the data distribution itself.
        EXPECT_NEAR(m, 0.3, 0.01) << what;
        EXPECT_NEAR(s, 0.2, 0.2 * 0.05) << what;
      }
    }
  }
}

TEST(Sampler, ExactPredictorsOfEpsilonVAndX0SampleTheSameVideos) {
  // The three parameterisations of one exact model are the same function of x_t, so every sampler must
  // turn them into the same samples, draw for draw (same seeds), up to float32 rounding; clamping is on,
  // as for pixel models (data N(0.3, 0.5²), so some x0 predictions are clamped).
  DDPMSchedule train(1000, BetaSchedule::kLinear);
  Conditioning cond{torch::zeros({3, 1, 8}), torch::ones({3, 1}, torch::kBool)};
  using megaslide::Prediction;
  for (auto kind : {SamplerKind::kDDPM, SamplerKind::kDDIM}) {
    for (int64_t steps : {30, 100}) {
      auto opts =
          SamplerOptions().kind(kind).steps(steps).guidance_scale(7.5).eta(kind == SamplerKind::kDDIM ? 0.5 : 0.0);
      std::vector<torch::Tensor> out;
      for (auto p : {Prediction::kEpsilon, Prediction::kV, Prediction::kX0}) {
        GaussianOracle oracle(train, 0.3, 0.5, p);
        out.push_back(megaslide::sample(oracle, train, SamplerOptions(opts).prediction(p), {1, 4, 16, 16}, {7, 8, 9},
                                        cond, cond, torch::kCPU));
      }
      const std::string what = std::string(megaslide::to_string(kind)) + " " + std::to_string(steps) + " steps";
      ASSERT_GT(out[0].std().item<double>(), 0.1) << what << ": the samples must vary";
      ASSERT_TRUE((out[0].abs() > 0.999999).any().item<bool>()) << what << ": some x0 predictions were clamped";
      EXPECT_TRUE(torch::allclose(out[1], out[0], 0, 1e-4))
          << what << ", v vs ε: " << (out[1] - out[0]).abs().max().item<double>();
      EXPECT_TRUE(torch::allclose(out[2], out[0], 0, 1e-4))
          << what << ", x0 vs ε: " << (out[2] - out[0]).abs().max().item<double>();
    }
  }
  // The test can fail: a v-model sampled as if it predicted ε gives other videos.
  GaussianOracle v_oracle(train, 0.3, 0.5, Prediction::kV), eps_oracle(train, 0.3, 0.5, Prediction::kEpsilon);
  auto opts = SamplerOptions().steps(30);
  auto right = megaslide::sample(eps_oracle, train, opts, {1, 4, 16, 16}, {7, 8, 9}, cond, cond, torch::kCPU);
  auto wrong = megaslide::sample(v_oracle, train, opts, {1, 4, 16, 16}, {7, 8, 9}, cond, cond, torch::kCPU);
  EXPECT_GT((right - wrong).abs().max().item<double>(), 0.1);
}

namespace {
// tests/fixtures/sampler/diffusers.safetensors (tools/make_fixtures.py sampler): diffusers'
// DDPMScheduler/DDIMScheduler timestep tables and single steps, the cases described in its metadata.
struct DiffusersFixture {
  std::map<std::string, torch::Tensor> tensors;
  nlohmann::json tables, cases;
};

DiffusersFixture diffusers_fixture() {
  auto file = megaslide::io::read_safetensors(std::string(MEGASLIDE_SOURCE_DIR) +
                                              "/tests/fixtures/sampler/diffusers.safetensors");
  DiffusersFixture f;
  for (auto& [name, tensor] : file.tensors) f.tensors[name] = tensor;
  f.tables = nlohmann::json::parse(file.metadata.at("tables"));
  f.cases = nlohmann::json::parse(file.metadata.at("cases"));
  return f;
}
}  // namespace

// Every spacing at every size in the fixture gives diffusers' set_timesteps exactly (it lists them
// descending; where numpy's arange overshoots, diffusers' trailing list has one more value, −1, which is
// not a timestep and which this sampler does not take).
TEST(Sampler, TimestepTablesAreDiffusers) {
  auto f = diffusers_fixture();
  ASSERT_GE(f.tables.size(), 50u);
  int overshoots = 0;
  for (const auto& table : f.tables) {
    const auto name = table.at("name").get<std::string>();
    const int64_t T = table.at("train_timesteps"), S = table.at("steps");
    auto reference = f.tensors.at(name);
    std::vector<int64_t> expected(reference.data_ptr<int64_t>(), reference.data_ptr<int64_t>() + reference.numel());
    if (static_cast<int64_t>(expected.size()) == S + 1 && expected.back() == -1) expected.pop_back(), ++overshoots;
    std::reverse(expected.begin(), expected.end());
    EXPECT_EQ(SamplingSchedule::respaced_timesteps(T, S, megaslide::parse_timestep_spacing(table.at("spacing"))),
              expected)
        << name;
  }
  EXPECT_GE(overshoots, 1) << "the fixture covers diffusers' extra trailing timestep";
}

// One DDPM or DDIM step (reverse_step, which sample() takes S times) at fixed inputs equals diffusers'
// step() for every spacing, prediction type and beta schedule; DDIM at η = 0 and η > 0 with the noise
// given. Tolerance 1e-5 of the larger of 1 and the tensor's largest magnitude: diffusers keeps ᾱ in
// float32, this sampler in float64 (the measured worst case, printed, is 5.1e-6: x0 of an ε-model at t = 0
// of the cosine schedule, where diffusers' float32 1 − ᾱ_0 keeps few digits).
TEST(Sampler, SingleStepsAreDiffusers) {
  auto f = diffusers_fixture();
  ASSERT_GE(f.cases.size(), 100u);
  double worst = 0.0;
  std::string worst_case;
  for (const auto& c : f.cases) {
    const auto name = c.at("name").get<std::string>();
    const int64_t T = c.at("train_timesteps"), S = c.at("steps"), position = c.at("position");
    DDPMSchedule train(T, megaslide::parse_beta_schedule(c.at("beta_schedule")));
    SamplingSchedule schedule(train, S, megaslide::parse_timestep_spacing(c.at("spacing")));
    const int64_t i = S - 1 - position;  // diffusers counts down from the noisiest step
    ASSERT_EQ(schedule.timesteps()[i].item<int64_t>(), c.at("timestep").get<int64_t>()) << name;
    auto options = SamplerOptions()
                       .kind(megaslide::parse_sampler_kind(c.at("kind")))
                       .eta(c.at("eta").get<double>())
                       .clip_denoised(c.at("clip_sample").get<bool>())
                       .prediction(megaslide::parse_prediction(c.at("prediction")));
    const auto& x = f.tensors.at(name + ".sample");
    const auto& output = f.tensors.at(name + ".model_output");
    torch::Tensor noise;
    if (i > 0) noise = f.tensors.at(name + ".noise");  // as sample() passes it
    auto check = [&](const torch::Tensor& ours, const torch::Tensor& reference, const char* what) {
      const double scale = std::max(1.0, reference.abs().max().item<double>());
      const double error =
          (ours.to(torch::kFloat64) - reference.to(torch::kFloat64)).abs().max().item<double>() / scale;
      if (error > worst) worst = error, worst_case = std::string(what) + " of " + c.dump();
      EXPECT_LT(error, 1e-5) << name << " " << what << ": " << c.dump();
    };
    auto x0 = megaslide::predicted_x0(options.prediction(), output, x, schedule.alphas_cumprod()[i].item<double>());
    if (options.clip_denoised()) x0 = x0.clamp(-1, 1);
    check(x0, f.tensors.at(name + ".pred_original_sample"), "x0");
    check(megaslide::reverse_step(schedule, i, x, output, noise, options), f.tensors.at(name + ".prev_sample"),
          "x_prev");
  }
  std::cout << f.cases.size() << " steps: worst relative difference from diffusers " << worst << " (" << worst_case
            << ")\n";
}
