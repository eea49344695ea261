// ResidentTrainer: the reference training loop — every weight and AdamW moment on the training device
// (the GPU when there is one, else the CPU), LibTorch's torch::optim::AdamW.
//
// One step: a batch of structured-motion clips, captions dropped to the empty prompt with probability
// diffusion.caption_dropout, uniform DDPM timesteps, ε-prediction MSE, global-norm clipping, AdamW with
// warmup then cosine or constant learning rate. Deterministic for a config (seeds train.seed and
// data.seed) on the CPU.
//
// Thread-safety: one thread drives a trainer.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <random>

#include "megaslide/config/run_config.h"
#include "megaslide/data/structured_motion.h"
#include "megaslide/diffusion/ddpm.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/text_encoder.h"

namespace megaslide {

struct StepMetrics {
  int64_t step = 0;  // 1-based: the number of optimizer steps taken so far
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;  // global L2 norm before clipping
  double step_time_s = 0.0;
  double tokens_per_s = 0.0;
  double samples_per_s = 0.0;
};

// "auto" -> the first GPU when LibTorch sees one, else the CPU; "cuda[:N]" fails clearly without GPUs.
torch::Device resolve_device(const std::string& spec);

// Learning rate for the step with 0-based index `step`: linear warmup over warmup_steps to lr, then
// cosine decay to lr * min_lr_ratio at the last step, or constant.
double learning_rate(const TrainConfig& train, int64_t step);

class ResidentTrainer {
 public:
  explicit ResidentTrainer(const RunConfig& config);

  StepMetrics step();

  int64_t steps_done() const { return steps_done_; }
  torch::Device device() const { return device_; }
  const RunConfig& config() const { return config_; }
  DiT& model() { return model_; }
  TextEncoder& text_encoder() { return text_encoder_; }
  int64_t parameter_count() const;
  int64_t tokens_per_sample() const { return grid_.numel(); }

 private:
  RunConfig config_;
  torch::Device device_;
  StructuredMotionDataset dataset_;
  EpochSampler sampler_;
  CaptionTokenizer tokenizer_;
  DDPMSchedule schedule_;
  DiT model_{nullptr};
  TextEncoder text_encoder_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<torch::Tensor> parameters_;
  std::mt19937_64 caption_rng_;
  at::Generator generator_;  // timesteps and noise: the trainer's own stream, not LibTorch's global one
  TokenGrid grid_;
  int64_t steps_done_ = 0;
};

}  // namespace megaslide
