// ResidentTrainer: the reference training loop — every weight and AdamW moment on the training device
// (the GPU when there is one, else the CPU), LibTorch's torch::optim::AdamW.
//
// A step whose loss or gradient norm is not finite is skipped (no update; StepMetrics::skipped).
//
// One step: train.grad_accum_steps micro-batches (loss / accum each) of structured-motion clips, captions dropped to the empty prompt with probability
// diffusion.caption_dropout, uniform DDPM timesteps, MSE against the diffusion.prediction target (DiffusionBatch::target: ε, v or x0), global-norm clipping, AdamW with
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
#include "megaslide/data/video_manifest.h"
#include "megaslide/diffusion/ddpm.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/frozen_encoders.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/init_from.h"
#include "megaslide/train/weights_ema.h"
#include "megaslide/util/device.h"

namespace megaslide {

struct StepMetrics {
  int64_t step = 0;  // 1-based: the number of optimizer steps taken so far
  double loss = 0.0;       // mean over the step's micro-batches
  double lr = 0.0;
  double grad_norm = 0.0;  // global L2 norm before clipping (of the unscaled gradient)
  double step_time_s = 0.0;
  double tokens_per_s = 0.0;
  double samples_per_s = 0.0;
  // Streamed trainer only (zero for the resident loop, which moves nothing), except optimizer_s:
  int64_t h2d_bytes = 0;            // weights copied host -> device this step
  int64_t d2h_bytes = 0;            // gradients copied device -> host this step
  double exposed_transfer_s = 0.0;  // time the compute stream waited on copies (CPU: the copies' own time)
  double optimizer_wait_s = 0.0;    // time the compute side waited for a block's host update
  double optimizer_s = 0.0;         // streamed: host AdamW time (all CpuAdamW calls that finished during this step);
                                    // resident: gradient clipping + torch::optim::AdamW step on the device
  int64_t peak_device_bytes = 0;    // GPU: allocator peak this step; CPU: the trainer's own accounting
  double mfu = 0.0;                 // GPU only: model FLOPs / (step time x peak); 0 elsewhere
  double loss_scale = 0.0;          // fp16 only: the loss scale used this step
  bool skipped = false;             // a non-finite loss or gradient (fp16: an overflow) skipped the update
  int64_t skipped_total = 0;        // steps skipped so far in the run
  int64_t consecutive_skips = 0;    // skipped steps in a row, ending with this one
  double data_wait_s = 0.0;         // time the step waited for its clips (the loader, or rendering in line)
  // The streamed trainer sharded over several ranks: bytes this rank handed to the block exchange
  // (reduce-scatter + all-gather) and its host thread's seconds in those collectives; 0 otherwise.
  int64_t exchange_bytes = 0;
  double exchange_s = 0.0;
};

// One micro-batch of DDPM training data on a device.
struct DiffusionBatch {
  torch::Tensor x0, noise, timesteps, xt;  // video [B, C, T, H, W] and timesteps [B] (int64)
  torch::Tensor target;                    // what the loss compares the model's output with (diffusion.prediction)
  torch::Tensor text_ids, text_mask;       // [B, L] int64 and bool
  torch::Tensor text;                      // [B, L, model.text_dim] float32: the frozen CLIP's embeddings (text_ids undefined),
                                           // or undefined for the built-in encoder, which the trainer runs on text_ids
  double data_wait_s = 0.0;                // time next() waited for the clips
};

class ClipLoader;

// The random streams of a training run, shared by the resident and the streamed trainer so that
// both see the same clips, captions, timesteps and noise in the same order: clip order from an
// EpochSampler(train.seed) (structured-motion) or a BucketBatchSampler(train.seed) behind a background
// ClipLoader (videos, decoded or from data.cache; data/loader.h), caption dropout from an mt19937_64,
// timesteps then noise from a CPU generator seeded by train.seed.
// With frozen encoders (model.text_encoder.kind: clip, model.vae.kind: sd; model/frozen_encoders.h), the
// batch's captions become CLIP embeddings (DiffusionBatch::text) and its pixels the VAE's scaled latents,
// on the training device, before the noise is drawn: x0, noise and target are latents.
class DiffusionBatchSource {
 public:
  // videos: reads the manifest and probes the files, or opens the cache (DatasetError for bad input).
  explicit DiffusionBatchSource(const RunConfig& config);
  ~DiffusionBatchSource();
  DiffusionBatch next(torch::Device device);
  const CaptionTokenizer& tokenizer() const { return tokenizer_; }
  const DDPMSchedule& schedule() const { return schedule_; }
  // The frozen CLIP / VAE the config names (nullptr for the built-in encoder without a VAE).
  const std::shared_ptr<FrozenEncoders>& frozen() const { return frozen_; }
  // The streams' position as JSON (clip order epoch and cursor, the caption-dropout engine, the
  // timestep/noise generator), and its restoration: a source restored from state() draws exactly
  // what the saved one would have drawn next. restore() throws std::invalid_argument on bad JSON.
  std::string state() const;
  void restore(const std::string& state);
  // videos: bad items not reported yet — those found when listing and probing (or by megaslide-cache),
  // then those that failed to load — each once. Empty for structured-motion.
  std::vector<BadItem> take_new_bad_items();
  // The first `count` captions of the dataset (validation samples).
  std::vector<std::string> captions(int64_t count) const;
  // One line for the log: the usable items, those listed and found bad, each bucket's size and items, and
  // the epochs `steps` steps of global batches make ("" for structured-motion).
  std::string describe(int64_t steps) const;
  // Data parallelism: next() returns the rank-th contiguous 1/world_size of each global batch of
  // train.batch_size items. Every random draw (clip order, caption dropout, timestep, noise) is still
  // made for the whole global batch in the single-process order, so item i of the global batch gets the
  // same draws at any world size; only the rank's clips are rendered (structured-motion) or loaded
  // (videos: decoded or read from the cache; a failed item's stand-in is drawn per slot, so the rows are
  // the whole batch's). Throws std::invalid_argument unless world_size divides train.batch_size and
  // 0 <= rank < world_size.
  void take_slice(int64_t rank, int64_t world_size);

 private:
  struct Videos;
  std::unique_ptr<ClipLoader> make_loader(int64_t slots_begin, int64_t slots_count) const;
  RunConfig config_;
  StructuredMotionDataset dataset_;
  EpochSampler sampler_;
  std::unique_ptr<Videos> videos_;
  CaptionTokenizer tokenizer_;
  DDPMSchedule schedule_;
  Prediction prediction_;
  std::mt19937_64 caption_rng_;
  at::Generator generator_;
  torch::Device schedule_device_ = torch::kCPU;
  int64_t slice_rank_ = 0, slice_count_ = 1;
  std::shared_ptr<FrozenEncoders> frozen_;
};


// Learning rate for the step with 0-based index `step`: linear warmup over warmup_steps to lr, then
// cosine decay to lr * min_lr_ratio at the last step, or constant.
double learning_rate(const TrainConfig& train, int64_t step);

class Communicator;

class ResidentTrainer {
 public:
  // With a communicator of R > 1 ranks (train/distributed.h; it must outlive the trainer): plain data
  // parallelism. Every rank holds the whole model and its AdamW state, built identically from
  // train.seed; each takes its contiguous 1/R of every global batch (DiffusionBatchSource::take_slice),
  // and after the backward passes of a step the gradients and the loss are summed over the ranks and
  // divided by R (one all-reduce of one flat buffer), so every rank takes the same AdamW step as a
  // single process with the same global batch, up to the order of float additions. Throws
  // std::invalid_argument when R does not divide train.batch_size.
  explicit ResidentTrainer(const RunConfig& config, Communicator* communicator = nullptr);

  StepMetrics step();

  int64_t steps_done() const { return steps_done_; }
  torch::Device device() const { return device_; }
  const RunConfig& config() const { return config_; }
  DiT& model() { return model_; }
  TextEncoder& text_encoder() { return text_encoder_; }  // null with model.text_encoder.kind: clip (frozen, in data().frozen())
  int64_t parameter_count() const;
  int64_t tokens_per_sample() const { return grid_.numel(); }

  // Checkpointing (train/checkpoint.h): the run's whole state as CPU copies, and its restoration from
  // a state with the same names and shapes. After load_training_state the next step() is the one the
  // saved trainer would have taken, bit for bit on the CPU.
  TrainingState training_state();
  void load_training_state(const TrainingState& state);
  DiffusionBatchSource& data() { return batches_; }
  // train.init_from (train/init_from.h): every parameter's name and shape, and loading a matched plan.
  ParameterShapes parameter_shapes();
  void init_from(const InitPlan& plan);

 private:
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters();

  // Sums the gradients (and `loss_sum`) over the ranks and divides by their number; no-op without a
  // communicator (one rank with a communicator still runs the collectives: the NCCL check on one GPU).
  void average_over_ranks(double& loss_sum);

  RunConfig config_;
  torch::Device device_;
  DiffusionBatchSource batches_;  // the trainer's own random streams, not LibTorch's global one
  Communicator* communicator_ = nullptr;
  DiT model_{nullptr};
  TextEncoder text_encoder_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<torch::Tensor> parameters_;
  WeightsEma ema_;  // train.ema_decay
  TokenGrid grid_;
  int64_t steps_done_ = 0;
  int64_t optimizer_steps_ = 0, skipped_total_ = 0, consecutive_skips_ = 0;
};

}  // namespace megaslide
