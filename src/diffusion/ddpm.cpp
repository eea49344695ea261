#include "megaslide/diffusion/ddpm.h"

#include <cmath>

namespace megaslide {

BetaSchedule parse_beta_schedule(const std::string& name) {
  if (name == "linear") return BetaSchedule::kLinear;
  if (name == "cosine") return BetaSchedule::kCosine;
  TORCH_CHECK(false, "unknown beta schedule '", name, "' (expected linear or cosine)");
}

Prediction parse_prediction(const std::string& name) {
  if (name == "epsilon") return Prediction::kEpsilon;
  if (name == "v") return Prediction::kV;
  if (name == "x0") return Prediction::kX0;
  TORCH_CHECK(false, "unknown prediction '", name, "' (expected epsilon, v or x0)");
}

const char* to_string(Prediction prediction) {
  switch (prediction) {
    case Prediction::kEpsilon:
      return "epsilon";
    case Prediction::kV:
      return "v";
    case Prediction::kX0:
      return "x0";
  }
  return "?";
}

DDPMSchedule::DDPMSchedule(int64_t timesteps, BetaSchedule schedule, double beta_start, double beta_end)
    : timesteps_(timesteps) {
  TORCH_CHECK(timesteps >= 2, "DDPMSchedule: need at least 2 timesteps, got ", timesteps);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  if (schedule == BetaSchedule::kLinear) {
    TORCH_CHECK(0 < beta_start && beta_start < beta_end && beta_end < 1,
                "DDPMSchedule: need 0 < beta_start < beta_end < 1, got ", beta_start, ", ", beta_end);
    betas_ = torch::linspace(beta_start, beta_end, timesteps, f64);
  } else {
    const double s = 0.008;
    auto steps = torch::arange(timesteps + 1, f64) / static_cast<double>(timesteps);
    auto f = torch::cos((steps + s) / (1 + s) * M_PI / 2).pow(2);
    auto abar = f / f[0];
    betas_ = torch::clamp(1 - abar.slice(0, 1) / abar.slice(0, 0, timesteps), 0.0, 0.999);
  }
  alphas_cumprod_ = torch::cumprod(1 - betas_, 0);
}

DDPMSchedule DDPMSchedule::to(torch::Device device) const {
  DDPMSchedule copy = *this;
  copy.betas_ = betas_.to(device);
  copy.alphas_cumprod_ = alphas_cumprod_.to(device);
  return copy;
}

torch::Tensor DDPMSchedule::add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                                      const torch::Tensor& t) const {
  TORCH_CHECK(x0.sizes() == noise.sizes(), "add_noise: x0 ", x0.sizes(), " and noise ", noise.sizes(), " differ");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x0.size(0), "add_noise: expected timesteps [B] with B = ", x0.size(0));
  std::vector<int64_t> shape(static_cast<size_t>(x0.dim()), 1);
  shape[0] = x0.size(0);
  auto abar = alphas_cumprod_.to(x0.device()).index_select(0, t.to(x0.device())).view(shape);
  return (abar.sqrt() * x0.to(torch::kFloat64) + (1 - abar).sqrt() * noise.to(torch::kFloat64)).to(x0.scalar_type());
}

torch::Tensor DDPMSchedule::target(Prediction prediction, const torch::Tensor& x0, const torch::Tensor& noise,
                                   const torch::Tensor& t) const {
  TORCH_CHECK(x0.sizes() == noise.sizes(), "target: x0 ", x0.sizes(), " and noise ", noise.sizes(), " differ");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x0.size(0), "target: expected timesteps [B] with B = ", x0.size(0));
  switch (prediction) {
    case Prediction::kEpsilon:
      return noise;
    case Prediction::kX0:
      return x0;
    case Prediction::kV:
      break;
  }
  std::vector<int64_t> shape(static_cast<size_t>(x0.dim()), 1);
  shape[0] = x0.size(0);
  auto abar = alphas_cumprod_.to(x0.device()).index_select(0, t.to(x0.device())).view(shape);
  return (abar.sqrt() * noise.to(torch::kFloat64) - (1 - abar).sqrt() * x0.to(torch::kFloat64)).to(x0.scalar_type());
}

torch::Tensor DDPMSchedule::sample_timesteps(int64_t batch, torch::Device device,
                                             std::optional<at::Generator> generator) const {
  return torch::randint(0, timesteps_, {batch}, generator, torch::TensorOptions().dtype(torch::kLong)).to(device);
}

torch::Tensor diffusion_loss(const torch::Tensor& predicted, const torch::Tensor& target) {
  return torch::mse_loss(predicted.to(torch::kFloat32), target.to(torch::kFloat32));
}

}  // namespace megaslide
