// Flow matching as Wan2.1 is trained and sampled (diffusion.objective: flow).
//
// Training: a clean latent x0, noise ε ~ N(0, I) and σ ∈ (0, 1) per sample give
//     x_t = (1 − σ)·x0 + σ·ε,   the model's input timestep t = σ·T (T = diffusion.timesteps, 1000),
//     target v = ε − x0 (the velocity dx_t/dσ),   loss = mean((model(x_t, t) − v)²).
// σ is drawn as u ~ U(0, 1) ("uniform") or u = sigmoid(n), n ~ N(logit_mean, logit_std) ("logit_normal",
// SD3's), then shifted: σ = shift·u / (1 + (shift − 1)·u) (shift > 1 spends more steps at high noise,
// as Wan's samplers do). One of Wan2.2's experts (model.wan.expert) trains only on its own timesteps:
// σ is then drawn from that distribution restricted to [σ_lo, σ_hi) (the high-noise expert's σ >=
// boundary_ratio, the low-noise one's below): with F the CDF of u and s⁻¹ the inverse shift,
// u = F⁻¹(F(s⁻¹(σ_lo)) + v·(F(s⁻¹(σ_hi)) − F(s⁻¹(σ_lo)))), v ~ U(0, 1) — one draw per sample, no rejection
// (F⁻¹ of the logit-normal through erfinv), exactly the whole distribution's draws that fall in the range.
//
// Samplers, each equal to its diffusers counterpart (tests/fixtures/flow/, tools/make_fixtures.py flow):
//   FlowEulerSchedule  FlowMatchEulerDiscreteScheduler(num_train_timesteps = T, shift): its σ table
//                      (including diffusers' shift of the table's end σ_min at construction, then of
//                      the whole linspace again in set_timesteps), timesteps σ·T (float), and the step
//                      x ← x + (σ_{i+1} − σ_i)·v.
//   FlowUniPC          UniPCMultistepScheduler(use_flow_sigmas = True, prediction_type = "flow_prediction",
//                      flow_shift = shift, solver_order 1–3, solver_type bh1 | bh2, predict_x0 = True,
//                      lower_order_final = True, final_sigmas_type = "zero"): the scheduler Wan's
//                      pipelines use (Wan's own FlowUniPCMultistepScheduler); σ_i = shifted linspace(1, 1/T)
//                      with σ_0 = 1 − 10⁻⁶, the model's timesteps ⌊σ_i·T⌋ (int64, as diffusers truncates),
//                      a multistep predictor and, from the second step on, the UniC corrector.
//   flow_sample        x_1 ~ N(0, I) from each sample's seed; for each σ_i: the guided model output
//                      v̂ = v_u + s·(v_c − v_u), then one step.
// Scalars are computed in float64 (diffusers computes UniPC's in float32 and the Euler table partly in
// float32, as mirrored here): single steps agree within 1e-5.
//
// Thread-safety: plain functions; FlowUniPC holds the state of one sampling run (one thread).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/diffusion/sampler.h"

namespace megaslide {

enum class TimestepSampling { kUniform, kLogitNormal };
TimestepSampling parse_timestep_sampling(const std::string& name);  // "uniform" | "logit_normal"

struct FlowMatchingOptions {
  static FlowMatchingOptions from_config(const RunConfig& config);
  TORCH_ARG(int64_t, train_timesteps) = 1000;
  TORCH_ARG(double, shift) = 1.0;
  TORCH_ARG(TimestepSampling, sampling) = TimestepSampling::kUniform;
  TORCH_ARG(double, logit_mean) = 0.0;
  TORCH_ARG(double, logit_std) = 1.0;
  // The range of the (shifted) σ drawn, [sigma_min, sigma_max): the whole [0, 1] unless one Wan2.2 expert
  // trains (from_config: model.wan.expert high → [boundary_ratio, 1], low → [0, boundary_ratio); with
  // expert both, each step's expert's range). The
  // whole range draws as without one (the same random stream).
  TORCH_ARG(double, sigma_min) = 0.0;
  TORCH_ARG(double, sigma_max) = 1.0;
};

// shift·σ / (1 + (shift − 1)·σ), elementwise (float64 in, float64 out for the double overload), and its
// inverse σ / (shift − (shift − 1)·σ).
double shift_sigma(double sigma, double shift);
double unshift_sigma(double sigma, double shift);
torch::Tensor shift_sigmas(const torch::Tensor& sigma, double shift);

// The probability that a training draw's (shifted) σ is below `sigma` (options' distribution over the
// whole [0, 1], its range ignored): Wan2.2's two experts trained in one run draw each step's expert with
// the mass the distribution puts on its side of the boundary.
double flow_sigma_cdf(double sigma, const FlowMatchingOptions& options);

// σ [B] for a training batch, drawn on the CPU from `generator` in float64 and returned as float32, in
// [options.sigma_min(), options.sigma_max()) (throws c10::Error for an empty range).
torch::Tensor sample_flow_sigmas(int64_t batch, const FlowMatchingOptions& options, at::Generator& generator);
// x_t = (1 − σ)·x0 + σ·ε for σ [B] (x0, noise [B, ...]).
torch::Tensor flow_noisy(const torch::Tensor& x0, const torch::Tensor& noise, const torch::Tensor& sigma);
// ε − x0.
torch::Tensor flow_target(const torch::Tensor& x0, const torch::Tensor& noise);

class FlowEulerSchedule {
 public:
  FlowEulerSchedule(int64_t steps, double shift, int64_t train_timesteps = 1000);
  int64_t steps() const { return timesteps_.size(0); }
  const torch::Tensor& sigmas() const { return sigmas_; }        // [S + 1] float32, descending, ending at 0
  const torch::Tensor& timesteps() const { return timesteps_; }  // [S] float32, σ_i·T
  // x + (σ_{i+1} − σ_i)·v in float32 (x and v any dtype; the result is float32).
  torch::Tensor step(int64_t i, const torch::Tensor& x, const torch::Tensor& v) const;

 private:
  torch::Tensor sigmas_, timesteps_;
};

enum class UniPCSolverType { kBh1, kBh2 };

class FlowUniPC {
 public:
  FlowUniPC(int64_t steps, double shift, int64_t order = 2, UniPCSolverType solver = UniPCSolverType::kBh2,
            int64_t train_timesteps = 1000);
  int64_t steps() const { return timesteps_.size(0); }
  const torch::Tensor& sigmas() const { return sigmas_; }        // [S + 1] float32 (the last 0)
  const torch::Tensor& timesteps() const { return timesteps_; }  // [S] int64, what the model is given
  // The step from σ_i to σ_{i+1} for the model output v at x (steps are taken in order, i = 0, 1, …;
  // float32 in and out). Keeps the history the next steps need.
  torch::Tensor step(int64_t i, const torch::Tensor& x, const torch::Tensor& v);

 private:
  torch::Tensor predictor(const torch::Tensor& x, int64_t order);
  torch::Tensor corrector(const torch::Tensor& this_x0, const torch::Tensor& last_sample,
                          const torch::Tensor& this_sample, int64_t order);
  double lambda(int64_t i) const;  // log(1 − σ_i) − log(σ_i)

  torch::Tensor sigmas_, timesteps_;
  std::vector<double> sigma_;  // σ_i as float32 values, widened
  int64_t order_;
  UniPCSolverType solver_;
  int64_t index_ = 0;
  int64_t this_order_ = 1, lower_order_nums_ = 0;
  std::vector<torch::Tensor> x0_history_;  // the converted outputs (x0 predictions), oldest first
  torch::Tensor last_sample_;
};

enum class FlowSamplerKind { kEuler, kUniPC };
FlowSamplerKind parse_flow_sampler(const std::string& name);  // "euler" | "unipc"

struct FlowSamplerOptions {
  TORCH_ARG(FlowSamplerKind, kind) = FlowSamplerKind::kUniPC;
  TORCH_ARG(int64_t, steps) = 50;
  TORCH_ARG(double, shift) = 5.0;
  TORCH_ARG(double, guidance_scale) = 5.0;
  // Two experts (Wan2.2): from the first step whose timestep is below boundary_ratio x train_timesteps on,
  // the guidance scale is guidance_scale_2 (-1: guidance_scale); 0: one scale throughout. The model
  // function picks its expert from the timesteps it is given.
  TORCH_ARG(double, boundary_ratio) = 0.0;
  TORCH_ARG(double, guidance_scale_2) = -1.0;
  TORCH_ARG(int64_t, order) = 2;  // UniPC
  TORCH_ARG(int64_t, train_timesteps) = 1000;
};

// Samples B = seeds.size() latents of `sample_shape` ([C, T, H, W]) on `device` (float32). The model is
// called once per step on [x; x] with [cond; uncond] (an uncond of batch 1 is broadcast) and timesteps
// [2B] float32: σ_i·T for Euler, ⌊σ_i·T⌋ for UniPC, as diffusers' pipelines pass them. Guidance scale 1
// is the conditional output alone (no unconditional pass); guidance_scale decides that for every step, as
// in diffusers' WanPipeline, whatever guidance_scale_2 is.
using FlowModelFn = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& timesteps,
                                                const torch::Tensor& text, const torch::Tensor& text_mask)>;
torch::Tensor flow_sample(const FlowModelFn& model, const FlowSamplerOptions& options,
                          const std::vector<int64_t>& sample_shape, const std::vector<uint64_t>& seeds,
                          const Conditioning& cond, const Conditioning& uncond, torch::Device device,
                          const std::function<void(int64_t, int64_t)>& on_step = {});

}  // namespace megaslide
