// Samplers for trained diffusion models (DESIGN.md §7): ancestral DDPM over respaced timesteps and
// DDIM, both with classifier-free guidance, for models that predict ε, v or x0 (ddpm.h's Prediction).
// Guidance mixes the model's raw outputs; since each parameterisation is affine in the others given x_t,
// that is the same mix whichever the model predicts, and the steps below use the x0 it implies.
//
//   SamplingSchedule  the training schedule restricted to S of its T timesteps (improved-diffusion's
//                     respacing: ᾱ is kept at the chosen timesteps, β is recomputed between them), with
//                     the posterior tables of q(x_{s-1} | x_s, x0) in float64; the S timesteps are
//                     spaced as diffusers' `timestep_spacing` spaces them (linspace, leading, trailing)
//   Denoiser          the one function a sampler needs: the model's output at (x_t, t, text).
//                     ResidentDenoiser wraps a DiT that fits the device; StreamedDenoiser
//                     (diffusion/streamed_denoiser.h) streams its blocks through the WeightStreamer.
//   guided_prediction  out_u + s·(out_c − out_u), the conditional and unconditional passes in one batch
//   predicted_x0      x0̂ from the output: ε: (x − sqrt(1−ᾱ)·ε̂)/sqrt(ᾱ); v: sqrt(ᾱ)·x − sqrt(1−ᾱ)·v̂; x0: x0̂
//   reverse_step      one DDPM or DDIM step from kept timestep i to i − 1 for a given model output
//   sample            x_T ~ N(0, I) from each sample's own seed, then S reverse steps
//
// Agreement with diffusers (checked against its schedulers' own outputs, tests/fixtures/sampler/):
//   DDPM = DDPMScheduler(timestep_spacing = ours, steps_offset = 0, clip_sample = clip_denoised,
//          clip_sample_range = 1, variance_type = "fixed_small", thresholding = False) for every spacing.
//   DDIM = DDIMScheduler(timestep_spacing = ours, steps_offset = 0, clip_sample = clip_denoised,
//          clip_sample_range = 1, set_alpha_to_one = True, thresholding = False) with
//          step(..., eta, use_clipped_model_output = True), when the spacing is `leading`, or `trailing`
//          with S dividing T. DDIMScheduler steps from t to t − T//S whatever its spacing, which is the next
//          kept timestep only in those cases; this sampler always steps to the next kept timestep.
//   beta_schedule "linear" / "squaredcos_cap_v2" = ours linear / cosine. diffusers keeps its tables in
//   float32, these are float64: single steps agree within 1e-5.
//
// Randomness: every sample has its own CPU generator seeded by its seed; x_T and each step's noise are
// drawn from it on the CPU in a fixed order and moved to the device. A sample therefore does not depend
// on which other samples share its batch, nor on the device (up to floating-point differences).
// Thread-safety: a Denoiser is driven by one thread; SamplingSchedule is immutable.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megaslide/diffusion/ddpm.h"
#include "megaslide/model/dit.h"

namespace megaslide {

// How S sampling timesteps are picked from T training timesteps (the `timestep_spacing` of diffusers'
// schedulers and Table 2 of Lin et al., "Common Diffusion Noise Schedules and Sample Steps are Flawed"):
//   linspace  t_i = round(i·(T−1)/(S−1)): both ends (S = 1 gives {0}, as numpy's linspace does)
//   leading   t_i = i·⌊T/S⌋: starts at 0; the largest is (S−1)·⌊T/S⌋, which can be far below T−1
//   trailing  the values round(T − k·T/S) − 1, k = 0…S−1: ends at T−1; the smallest is ≈ T/S − 1
// round() halves to even, as numpy's does.
enum class TimestepSpacing { kLinspace, kLeading, kTrailing };
TimestepSpacing parse_timestep_spacing(const std::string& name);  // "linspace" | "leading" | "trailing"
const char* to_string(TimestepSpacing spacing);

class SamplingSchedule {
 public:
  // `steps` of the `train_timesteps` training timesteps, spaced by `spacing`. Ascending, distinct.
  static std::vector<int64_t> respaced_timesteps(int64_t train_timesteps, int64_t steps,
                                                 TimestepSpacing spacing = TimestepSpacing::kLinspace);

  SamplingSchedule(const DDPMSchedule& train, int64_t steps, TimestepSpacing spacing = TimestepSpacing::kLinspace);
  SamplingSchedule(const DDPMSchedule& train, const std::vector<int64_t>& timesteps);  // ascending, distinct

  int64_t steps() const { return timesteps_.size(0); }
  // All [S], index i = the i-th kept timestep in ascending order; float64 on the CPU.
  const torch::Tensor& timesteps() const { return timesteps_; }                      // int64, training timesteps
  const torch::Tensor& alphas_cumprod() const { return alphas_cumprod_; }            // ᾱ_i = ᾱ_train(t_i)
  const torch::Tensor& alphas_cumprod_prev() const { return alphas_cumprod_prev_; }  // ᾱ_{i−1}, 1 for i = 0
  const torch::Tensor& betas() const { return betas_; }                              // 1 − ᾱ_i / ᾱ_{i−1}
  // q(x_{i−1} | x_i, x0) = N(coef1_i·x0 + coef2_i·x_i, posterior_variance_i):
  //   coef1 = β_i·sqrt(ᾱ_{i−1}) / (1 − ᾱ_i), coef2 = (1 − ᾱ_{i−1})·sqrt(1 − β_i) / (1 − ᾱ_i),
  //   posterior_variance = β_i·(1 − ᾱ_{i−1}) / (1 − ᾱ_i)
  const torch::Tensor& posterior_mean_coef1() const { return coef1_; }
  const torch::Tensor& posterior_mean_coef2() const { return coef2_; }
  const torch::Tensor& posterior_variance() const { return posterior_variance_; }

 private:
  torch::Tensor timesteps_, alphas_cumprod_, alphas_cumprod_prev_, betas_, coef1_, coef2_, posterior_variance_;
};

// The model function the samplers call.
class Denoiser {
 public:
  virtual ~Denoiser() = default;
  // The model's output (ε, v or x0, as it was trained) for x [B, C, T, H, W] at training timesteps t [B]
  // (int64), text [B, L, text_dim], text_mask [B, L] bool (true = real token). Called under
  // torch::NoGradGuard.
  virtual torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                                const torch::Tensor& text_mask) = 0;
};

// A DiT held whole on its device (shares the module; does not copy it). With a compute dtype other than
// Float (BFloat16 or Half) the blocks' weights are converted to it in place at construction and the
// blocks run in it, while the embeddings and the final layer stay fp32 — the precision layout of
// StreamedDenoiser, whose output it then equals.
class ResidentDenoiser final : public Denoiser {
 public:
  explicit ResidentDenoiser(DiT model, c10::ScalarType compute_dtype = c10::ScalarType::Float);
  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                        const torch::Tensor& text_mask) override;
  c10::ScalarType compute_dtype() const { return compute_dtype_; }

 private:
  DiT model_;
  c10::ScalarType compute_dtype_;
};

// Encoded text for a batch: embeddings [B, L, text_dim] and mask [B, L] bool.
struct Conditioning {
  torch::Tensor text, mask;
};

// out_u + scale·(out_c − out_u). One denoiser call on [x; x] with [cond; uncond] (an uncond of batch 1 is
// broadcast). Scale 1 is the conditional prediction, 0 the unconditional one.
torch::Tensor guided_prediction(Denoiser& denoiser, const torch::Tensor& x, const torch::Tensor& t,
                                const Conditioning& cond, const Conditioning& uncond, double scale);

// The x0 implied by a model output `output` at x_t = `x` with ᾱ_t = `abar` (float32 in, float32 out).
torch::Tensor predicted_x0(Prediction prediction, const torch::Tensor& output, const torch::Tensor& x, double abar);

enum class SamplerKind { kDDPM, kDDIM };
SamplerKind parse_sampler_kind(const std::string& name);  // "ddpm" | "ddim"
const char* to_string(SamplerKind kind);

struct SamplerOptions {
  TORCH_ARG(SamplerKind, kind) = SamplerKind::kDDPM;
  TORCH_ARG(int64_t, steps) = 30;  // respaced timesteps (DESIGN.md §7: 30 of 1000)
  TORCH_ARG(TimestepSpacing, timestep_spacing) = TimestepSpacing::kLinspace;
  TORCH_ARG(double, guidance_scale) = 7.5;
  TORCH_ARG(double, eta) = 0.0;           // DDIM only: 0 deterministic, 1 = ancestral DDPM's variance
  TORCH_ARG(bool, clip_denoised) = true;  // clamp each x0 prediction to [-1, 1] (pixel-space models)
  TORCH_ARG(Prediction,
            prediction) = Prediction::kEpsilon;  // what the denoiser outputs (the model's diffusion.prediction)
};

// One reverse step of options.kind() from x = x_{t_i} to x_{t_{i−1}} (to x_0 for i = 0), given the
// (guided) model output at t_i; float32 in and out. `noise` ~ N(0, I) of x's shape, or undefined for
// none: sample() passes it for every i > 0. DDPM adds sqrt(var_i)·noise, DDIM σ_i·noise (nothing at η = 0).
torch::Tensor reverse_step(const SamplingSchedule& schedule, int64_t i, const torch::Tensor& x,
                           const torch::Tensor& output, const torch::Tensor& noise, const SamplerOptions& options);

// Samples a batch of B = seeds.size() videos of shape `sample_shape` ([C, T, H, W]) on `device`:
// cond and uncond as for guided_prediction. Returns x_0 [B, C, T, H, W] float32 on `device`.
// `on_step(done, total)` is called after every reverse step.
//
// DDPM (ancestral):  x0̂ = predicted_x0(guided output) (clamped), x_{i−1} = coef1·x0̂ + coef2·x_i + sqrt(var)·z
// DDIM:              ε̂' = ε̂ re-derived from the clamped x0̂, σ = η·sqrt((1−ᾱ_{i−1})/(1−ᾱ_i))·sqrt(1−ᾱ_i/ᾱ_{i−1}),
//                    x_{i−1} = sqrt(ᾱ_{i−1})·x0̂ + sqrt(1−ᾱ_{i−1}−σ²)·ε̂' + σ·z
// Both draw z at every step but the last, so DDIM with η = 1 equals DDPM for the same seeds.
torch::Tensor sample(Denoiser& denoiser, const DDPMSchedule& schedule, const SamplerOptions& options,
                     const std::vector<int64_t>& sample_shape, const std::vector<uint64_t>& seeds,
                     const Conditioning& cond, const Conditioning& uncond, torch::Device device,
                     const std::function<void(int64_t, int64_t)>& on_step = {});

}  // namespace megaslide
