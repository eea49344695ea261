// The per-sample weights of the training loss (diffusion.loss_weighting, docs/training.md "Loss weighting"), as
// diffusers' training code weighs it:
//   min_snr (ddpm): Min-SNR-γ (Hang et al. 2023; diffusers' compute_snr and its training scripts' --snr_gamma):
//     with SNR(t) = ᾱ_t / (1 − ᾱ_t), a sample at timestep t weighs min(SNR, γ) / SNR when the model predicts ε,
//     min(SNR, γ) / (SNR + 1) when it predicts v, and min(SNR, γ) when it predicts x0;
//   sigma_sqrt (flow): σ⁻²;  cosmap (flow): 2 / (π·(1 − 2σ + 2σ²))  (diffusers' compute_loss_weighting_for_sd3),
//     weighing the velocity's squared error, as its SD3 scripts do with --precondition_outputs 0 (their default
//     weighs the implied x0's error, σ² times the velocity's).
// The training loss is then the mean over the samples of each one's weight times its mean squared error
// (context_parallel_loss, train/model_family.h), as those scripts take it. The weights are computed in float64
// on the CPU and returned as float32 [B]; tests/fixtures/loss_weighting/ holds diffusers' (tools/make_fixtures.py).
//
// Thread-safety: plain functions.
#pragma once

#include <torch/types.h>

#include <string>

#include "megaslide/diffusion/ddpm.h"

namespace megaslide {

enum class LossWeighting { kNone, kMinSnr, kSigmaSqrt, kCosmap };
LossWeighting parse_loss_weighting(const std::string& name);  // "none" | "min_snr" | "sigma_sqrt" | "cosmap"

// Min-SNR-γ's weights of DDPM timesteps [B] (int64, any device) for a model predicting `prediction`.
torch::Tensor min_snr_weights(const DDPMSchedule& schedule, Prediction prediction, const torch::Tensor& timesteps,
                              double gamma);
// The flow-matching weights (kSigmaSqrt or kCosmap) of the (shifted) σ [B] each sample was noised with.
torch::Tensor flow_loss_weights(LossWeighting weighting, const torch::Tensor& sigma);

}  // namespace megaslide
