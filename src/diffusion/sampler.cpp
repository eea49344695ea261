#include "megaslide/diffusion/sampler.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

namespace megaslide {

TimestepSpacing parse_timestep_spacing(const std::string& name) {
  if (name == "linspace") return TimestepSpacing::kLinspace;
  if (name == "leading") return TimestepSpacing::kLeading;
  if (name == "trailing") return TimestepSpacing::kTrailing;
  TORCH_CHECK(false, "unknown timestep spacing '", name, "' (expected linspace, leading or trailing)");
}

const char* to_string(TimestepSpacing spacing) {
  switch (spacing) {
    case TimestepSpacing::kLinspace:
      return "linspace";
    case TimestepSpacing::kLeading:
      return "leading";
    case TimestepSpacing::kTrailing:
      return "trailing";
  }
  return "?";
}

namespace {
// numpy's round(): to the nearest integer, halves to even (std::nearbyint in the default rounding mode).
int64_t round_half_even(double v) {
  const double r = std::floor(v), frac = v - r;
  if (frac > 0.5) return static_cast<int64_t>(r) + 1;
  if (frac < 0.5) return static_cast<int64_t>(r);
  const auto i = static_cast<int64_t>(r);
  return i % 2 == 0 ? i : i + 1;
}
}  // namespace

std::vector<int64_t> SamplingSchedule::respaced_timesteps(int64_t train_timesteps, int64_t steps,
                                                          TimestepSpacing spacing) {
  TORCH_CHECK(train_timesteps >= 1, "respaced_timesteps: need at least one training timestep");
  TORCH_CHECK(steps >= 1 && steps <= train_timesteps, "respaced_timesteps: sampling steps must be in [1, ",
              train_timesteps, "] (the training timesteps), got ", steps);
  const auto T = static_cast<double>(train_timesteps), S = static_cast<double>(steps);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(steps));
  switch (spacing) {
    case TimestepSpacing::kLinspace: {
      // numpy.linspace(0, T − 1, S): i·step, the last value exactly T − 1.
      const double stride = steps > 1 ? (T - 1) / (S - 1) : 0.0;
      for (int64_t i = 0; i < steps; ++i)
        out.push_back(round_half_even(i == steps - 1 && steps > 1 ? T - 1 : static_cast<double>(i) * stride));
      break;
    }
    case TimestepSpacing::kLeading:
      for (int64_t i = 0; i < steps; ++i) out.push_back(i * (train_timesteps / steps));
      break;
    case TimestepSpacing::kTrailing: {
      // numpy.arange(T, 0, −T/S) computes its values as T, T + step, then T + k·(second − first): the same
      // arithmetic here, so that halves round as diffusers rounds them. (numpy's arange can also return one
      // value more, which diffusers turns into a timestep of −1; that one is not taken.)
      const double step = -T / S, delta = (T + step) - T;
      for (int64_t k = steps - 1; k >= 0; --k) {
        const double v = k == 0 ? T : k == 1 ? T + step : T + static_cast<double>(k) * delta;
        out.push_back(round_half_even(v) - 1);
      }
      break;
    }
  }
  return out;
}

SamplingSchedule::SamplingSchedule(const DDPMSchedule& train, int64_t steps, TimestepSpacing spacing)
    : SamplingSchedule(train, respaced_timesteps(train.timesteps(), steps, spacing)) {}

SamplingSchedule::SamplingSchedule(const DDPMSchedule& train, const std::vector<int64_t>& timesteps) {
  TORCH_CHECK(!timesteps.empty(), "SamplingSchedule: no timesteps");
  for (size_t i = 0; i < timesteps.size(); ++i) {
    TORCH_CHECK(timesteps[i] >= 0 && timesteps[i] < train.timesteps(), "SamplingSchedule: timestep ", timesteps[i],
                " outside [0, ", train.timesteps(), ")");
    TORCH_CHECK(i == 0 || timesteps[i] > timesteps[i - 1],
                "SamplingSchedule: timesteps must be ascending and distinct");
  }
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  timesteps_ = torch::tensor(timesteps, torch::kLong);
  alphas_cumprod_ = train.alphas_cumprod().to(torch::kCPU).index_select(0, timesteps_);
  alphas_cumprod_prev_ = torch::cat({torch::ones({1}, f64), alphas_cumprod_.slice(0, 0, -1)});
  betas_ = 1 - alphas_cumprod_ / alphas_cumprod_prev_;
  coef1_ = betas_ * alphas_cumprod_prev_.sqrt() / (1 - alphas_cumprod_);
  coef2_ = (1 - alphas_cumprod_prev_) * (1 - betas_).sqrt() / (1 - alphas_cumprod_);
  posterior_variance_ = betas_ * (1 - alphas_cumprod_prev_) / (1 - alphas_cumprod_);
}

ResidentDenoiser::ResidentDenoiser(DiT model, c10::ScalarType compute_dtype)
    : model_(std::move(model)), compute_dtype_(compute_dtype) {
  TORCH_CHECK(model_, "ResidentDenoiser: the model is null");
  TORCH_CHECK(compute_dtype_ == at::kFloat || compute_dtype_ == at::kBFloat16 || compute_dtype_ == at::kHalf,
              "ResidentDenoiser: compute dtype must be Float, BFloat16 or Half, got ", compute_dtype_);
  if (compute_dtype_ != at::kFloat) model_->blocks->to(compute_dtype_);
}

torch::Tensor ResidentDenoiser::predict(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                                        const torch::Tensor& text_mask) {
  torch::NoGradGuard no_grad;
  if (compute_dtype_ == at::kFloat) return model_->forward(x, t, text, text_mask);
  const auto e = model_->embed(x, t, text, text_mask);
  BlockContext ctx = e.ctx;
  ctx.t_mod = ctx.t_mod.to(compute_dtype_);
  ctx.text = ctx.text.to(compute_dtype_);
  auto h = e.tokens.to(compute_dtype_);
  for (const auto& block : *model_->blocks) h = block->as<DiTBlockImpl>()->forward(h, ctx);
  return model_->head(h.to(e.tokens.scalar_type()), e.t_emb, e.ctx.grid);
}

torch::Tensor guided_prediction(Denoiser& denoiser, const torch::Tensor& x, const torch::Tensor& t,
                                const Conditioning& cond, const Conditioning& uncond, double scale) {
  const int64_t B = x.size(0);
  TORCH_CHECK(cond.text.dim() == 3 && cond.text.size(0) == B,
              "guided_prediction: cond.text must be [B, L, D] with B = ", B, ", got ", cond.text.sizes());
  TORCH_CHECK(uncond.text.dim() == 3 && (uncond.text.size(0) == B || uncond.text.size(0) == 1) &&
                  uncond.text.size(2) == cond.text.size(2),
              "guided_prediction: uncond.text must be [B or 1, L, D] matching cond.text ", cond.text.sizes(), ", got ",
              uncond.text.sizes());
  // Pad the shorter token axis so the two can share one batch; padding is masked out.
  auto expand = [&](const Conditioning& c, int64_t L) {
    auto text = c.text.expand({B, c.text.size(1), c.text.size(2)});
    auto mask = c.mask.defined() ? c.mask.expand({B, c.text.size(1)})
                                 : torch::ones({B, c.text.size(1)},
                                               torch::TensorOptions().dtype(torch::kBool).device(c.text.device()));
    if (c.text.size(1) < L) {
      text = torch::cat({text, torch::zeros({B, L - c.text.size(1), c.text.size(2)}, text.options())}, 1);
      mask = torch::cat({mask, torch::zeros({B, L - c.text.size(1)}, mask.options())}, 1);
    }
    return std::make_pair(text, mask);
  };
  const int64_t L = std::max(cond.text.size(1), uncond.text.size(1));
  auto [ct, cm] = expand(cond, L);
  auto [ut, um] = expand(uncond, L);
  torch::NoGradGuard no_grad;
  auto out = denoiser.predict(torch::cat({x, x}), torch::cat({t, t}), torch::cat({ct, ut}), torch::cat({cm, um}));
  auto out_c = out.slice(0, 0, B), out_u = out.slice(0, B);
  return out_u + scale * (out_c - out_u);
}

torch::Tensor predicted_x0(Prediction prediction, const torch::Tensor& output, const torch::Tensor& x, double abar) {
  TORCH_CHECK(abar > 0 && abar <= 1, "predicted_x0: ᾱ must be in (0, 1], got ", abar);
  switch (prediction) {
    case Prediction::kEpsilon:
      return (1.0 / std::sqrt(abar)) * x - std::sqrt(1.0 / abar - 1.0) * output;
    case Prediction::kV:
      return std::sqrt(abar) * x - std::sqrt(1.0 - abar) * output;
    case Prediction::kX0:
      return output;
  }
  TORCH_CHECK(false, "predicted_x0: unknown prediction");
}

SamplerKind parse_sampler_kind(const std::string& name) {
  if (name == "ddpm") return SamplerKind::kDDPM;
  if (name == "ddim") return SamplerKind::kDDIM;
  TORCH_CHECK(false, "unknown sampler '", name, "' (expected ddpm or ddim)");
}

const char* to_string(SamplerKind kind) { return kind == SamplerKind::kDDPM ? "ddpm" : "ddim"; }

namespace {
// One standard-normal draw per sample from its own generator, stacked: [B, ...shape].
torch::Tensor per_sample_noise(std::vector<at::Generator>& generators, const std::vector<int64_t>& shape,
                               torch::Device device) {
  std::vector<torch::Tensor> draws;
  draws.reserve(generators.size());
  for (auto& g : generators) draws.push_back(torch::randn(shape, g, torch::kFloat32));
  return torch::stack(draws).to(device);
}
}  // namespace

torch::Tensor reverse_step(const SamplingSchedule& schedule, int64_t i, const torch::Tensor& x,
                           const torch::Tensor& output, const torch::Tensor& noise, const SamplerOptions& options) {
  TORCH_CHECK(i >= 0 && i < schedule.steps(), "reverse_step: step index ", i, " outside [0, ", schedule.steps(), ")");
  TORCH_CHECK(output.sizes() == x.sizes(), "reverse_step: model output ", output.sizes(), " and x ", x.sizes(),
              " differ");
  TORCH_CHECK(!noise.defined() || noise.sizes() == x.sizes(), "reverse_step: noise ", noise.sizes(), " and x ",
              x.sizes(), " differ");
  const double abar = schedule.alphas_cumprod()[i].item<double>(),
               abar_prev = schedule.alphas_cumprod_prev()[i].item<double>();
  auto x0 = predicted_x0(options.prediction(), output, x, abar);
  if (options.clip_denoised()) x0 = x0.clamp(-1.0, 1.0);
  torch::Tensor next;
  if (options.kind() == SamplerKind::kDDPM) {
    next =
        schedule.posterior_mean_coef1()[i].item<double>() * x0 + schedule.posterior_mean_coef2()[i].item<double>() * x;
    if (noise.defined()) next = next + std::sqrt(schedule.posterior_variance()[i].item<double>()) * noise;
  } else {
    // ε re-derived from the (clamped) x0, so that x0 and ε stay consistent (GLIDE; diffusers'
    // use_clipped_model_output).
    auto eps = ((1.0 / std::sqrt(abar)) * x - x0) / std::sqrt(1.0 / abar - 1.0);
    const double sigma = options.eta() * std::sqrt((1 - abar_prev) / (1 - abar)) * std::sqrt(1 - abar / abar_prev);
    next = std::sqrt(abar_prev) * x0 + std::sqrt(std::max(0.0, 1 - abar_prev - sigma * sigma)) * eps;
    if (noise.defined() && sigma > 0) next = next + sigma * noise;
  }
  return next;
}

torch::Tensor sample(Denoiser& denoiser, const DDPMSchedule& schedule, const SamplerOptions& options,
                     const std::vector<int64_t>& sample_shape, const std::vector<uint64_t>& seeds,
                     const Conditioning& cond, const Conditioning& uncond, torch::Device device,
                     const std::function<void(int64_t, int64_t)>& on_step) {
  TORCH_CHECK(!seeds.empty(), "sample: no seeds (one per sample)");
  TORCH_CHECK(options.eta() >= 0, "sample: eta must be >= 0, got ", options.eta());
  const SamplingSchedule s(schedule, options.steps(), options.timestep_spacing());
  const int64_t B = static_cast<int64_t>(seeds.size()), S = s.steps();
  std::vector<at::Generator> generators;
  for (auto seed : seeds) generators.push_back(at::detail::createCPUGenerator(seed));
  auto timesteps = s.timesteps().accessor<int64_t, 1>();

  torch::NoGradGuard no_grad;
  auto x = per_sample_noise(generators, sample_shape, device);
  for (int64_t i = S - 1; i >= 0; --i) {
    auto t = torch::full({B}, timesteps[i], torch::TensorOptions().dtype(torch::kLong).device(device));
    auto out = guided_prediction(denoiser, x, t, cond, uncond, options.guidance_scale()).to(torch::kFloat32);
    torch::Tensor z;
    if (i > 0) z = per_sample_noise(generators, sample_shape, device);
    x = reverse_step(s, i, x, out, z, options);
    if (on_step) on_step(S - i, S);
  }
  return x;
}

}  // namespace megaslide
