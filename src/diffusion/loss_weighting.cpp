#include "megaslide/diffusion/loss_weighting.h"

#include <cmath>

namespace megaslide {

LossWeighting parse_loss_weighting(const std::string& name) {
  if (name == "none") return LossWeighting::kNone;
  if (name == "min_snr") return LossWeighting::kMinSnr;
  if (name == "sigma_sqrt") return LossWeighting::kSigmaSqrt;
  if (name == "cosmap") return LossWeighting::kCosmap;
  TORCH_CHECK(false, "unknown loss weighting '", name, "' (expected none, min_snr, sigma_sqrt or cosmap)");
}

torch::Tensor min_snr_weights(const DDPMSchedule& schedule, Prediction prediction, const torch::Tensor& timesteps,
                              double gamma) {
  TORCH_CHECK(gamma > 0, "min_snr_weights: γ must be positive, got ", gamma);
  const auto abar = schedule.alphas_cumprod().cpu().index_select(0, timesteps.cpu().to(torch::kLong));
  const auto snr = abar / (1.0 - abar);
  auto weights = snr.clamp_max(gamma);
  if (prediction == Prediction::kEpsilon) weights = weights / snr;
  if (prediction == Prediction::kV) weights = weights / (snr + 1.0);
  return weights.to(torch::kFloat32);
}

torch::Tensor flow_loss_weights(LossWeighting weighting, const torch::Tensor& sigma) {
  const auto s = sigma.cpu().to(torch::kFloat64);
  switch (weighting) {
    case LossWeighting::kSigmaSqrt:
      return s.pow(-2.0).to(torch::kFloat32);
    case LossWeighting::kCosmap:
      return (2.0 / (M_PI * (1.0 - 2.0 * s + 2.0 * s.square()))).to(torch::kFloat32);
    default:
      TORCH_CHECK(false, "flow_loss_weights: expected sigma_sqrt or cosmap");
  }
}

}  // namespace megaslide
