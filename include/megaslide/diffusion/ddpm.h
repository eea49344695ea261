// DDPM noise schedule and the training objective (DESIGN.md §7): the model predicts ε (the default),
// v = sqrt(ᾱ_t)·ε − sqrt(1−ᾱ_t)·x0 (Salimans & Ho) or x0 itself (diffusion.prediction); the loss is the
// mean squared error against that target. The three are affine in each other given x_t, so the samplers
// convert any of them to (x0̂, ε̂) (sampler.h).
//
// Tables are computed and stored in float64 on the CPU; to(device) copies them.
// Thread-safety: immutable after construction.
#pragma once

#include <torch/types.h>

#include <string>

namespace megaslide {

enum class BetaSchedule { kLinear, kCosine };
BetaSchedule parse_beta_schedule(const std::string& name);  // "linear" | "cosine"

// What the model outputs (and is trained to output).
enum class Prediction { kEpsilon, kV, kX0 };
Prediction parse_prediction(const std::string& name);  // "epsilon" | "v" | "x0"
const char* to_string(Prediction prediction);

class DDPMSchedule {
 public:
  // linear: β_t evenly spaced in [beta_start, beta_end]; cosine: Nichol & Dhariwal (s = 0.008,
  // β clipped at 0.999), beta_start/beta_end unused.
  DDPMSchedule(int64_t timesteps, BetaSchedule schedule, double beta_start = 1e-4, double beta_end = 0.02);

  int64_t timesteps() const { return timesteps_; }
  const torch::Tensor& betas() const { return betas_; }                    // [T] float64
  const torch::Tensor& alphas_cumprod() const { return alphas_cumprod_; }  // [T] float64, ᾱ_t

  DDPMSchedule to(torch::Device device) const;

  // x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε for integer timesteps t [B]; x0, noise [B, ...].
  torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise, const torch::Tensor& t) const;

  // The training target for x_t = add_noise(x0, noise, t): noise (ε), sqrt(ᾱ_t)·noise − sqrt(1−ᾱ_t)·x0 (v)
  // or x0, in x0's dtype (computed in float64).
  torch::Tensor target(Prediction prediction, const torch::Tensor& x0, const torch::Tensor& noise,
                       const torch::Tensor& t) const;

  // Uniform integer timesteps in [0, T) for a batch, drawn on the CPU from `generator` (LibTorch's
  // global generator when none) and moved to `device`.
  torch::Tensor sample_timesteps(int64_t batch, torch::Device device,
                                 std::optional<at::Generator> generator = std::nullopt) const;

 private:
  int64_t timesteps_;
  torch::Tensor betas_, alphas_cumprod_;
};

// Mean squared error between the prediction and its target (in float32).
torch::Tensor diffusion_loss(const torch::Tensor& predicted, const torch::Tensor& target);
// The ε-objective: diffusion_loss against the true noise.
inline torch::Tensor epsilon_loss(const torch::Tensor& predicted, const torch::Tensor& noise) {
  return diffusion_loss(predicted, noise);
}

}  // namespace megaslide
