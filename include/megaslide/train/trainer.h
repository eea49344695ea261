// Trainer: the one training loop of every model family (train/model_family.h), in two modes.
//
//   resident  (offload.enabled: false)  the reference loop: every weight and AdamW moment on the training
//             device, LibTorch's torch::optim::AdamW, the EMA beside the weights (train/weights_ema.h).
//   streamed  (offload.enabled: true)   the CPU-master trainer (DESIGN.md §2, offload::StreamedStackTrainer):
//             the blocks' fp32 masters and moments in host RAM, updated by CpuAdamW; the device holds two
//             blocks' weights, the block-boundary activations and the resident prologue/epilogue.
//
// The family supplies the model, its batches and its objective; the Trainer owns the rest, the same for
// every family: the learning-rate schedule, train.grad_accum_steps, global-norm clipping, the skip of a
// step whose loss or gradient norm is not finite (StepMetrics::skipped: no update), the step's metrics
// (throughput, MFU on a GPU), train.init_from's one protocol, the checkpoint state (train/checkpoint.h:
// after load_training_state the next step is the one the saved trainer would have taken, bit for bit on
// the CPU), the Chrome trace of a streamed step, and data parallelism:
//
// With a communicator of R > 1 ranks (train/distributed.h; it must outlive the trainer), each rank trains
// on its contiguous 1/R of every global batch of train.batch_size items (FamilyModel::take_slice: every
// random draw is made for the whole batch, so item i gets the same draws at any world size). Resident:
// every rank holds the whole model and its AdamW state, and after a step's backward passes the gradients
// and the loss are averaged over the ranks (one all-reduce), so every rank takes the single process's
// step up to the order of float additions. Streamed: the host state is sharded over the ranks (the
// engine's block exchange); every rank keeps the whole compute copy. Every rank builds the same initial
// weights. Construction is collective.
//
// Context parallelism (distributed.context_parallel = n > 1, n dividing R): consecutive ranks form groups of n
// (ranks [g·n, (g+1)·n)); a group shares one data-parallel slice (take_slice(rank / n, R / n)) and splits each of
// its samples' frames among its ranks (ModelRequest::context_group; attention over the group). Each rank's loss
// is n × its part of the slice's loss (context_parallel_loss), so the average over all R ranks above is again
// the single process's loss and gradient; the host state is sharded over all R ranks as before.
//
// A model of parts (FamilyModel::parts: Wan2.2's two experts) trains one part per step, which the family
// draws (FamilyModel::begin_step): the step streams and updates that part only, in both modes, with the
// part's own AdamW step count (TrainingState::part_steps); StepMetrics::part names it.
//
// Thread-safety: one thread drives a trainer.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/init_from.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/step_metrics.h"

namespace torch::optim {
class AdamW;
}

namespace megaslide {

class Communicator;
class WeightsEma;

// Learning rate for the step with 0-based index `step`: linear warmup over warmup_steps to lr, then
// cosine decay to lr * min_lr_ratio at the last step, or constant.
double learning_rate(const TrainConfig& train, int64_t step);

// Peak dense bf16 TFLOP/s of the current GPU, measured with a few large matmuls (~1 s). Throws without
// a GPU.
double measure_peak_tflops(torch::Device device);

struct TrainerRequest {
  const RunConfig* config = nullptr;     // resolved (auto settings, ModelFamily::resolve)
  const RunConfig* requested = nullptr;  // as given (the log says why `auto` chose); null: `config`
  std::string source = "config";         // where the config came from (errors name it)
  bool init_from = false;                // train.init_from: the trainer starts from it
  // The run resumes a checkpoint, which overwrites what init_from set, except a LoRA run's frozen model (its
  // checkpoint holds the adapters alone): with `resuming` a LoRA trainer takes train.init_from for that model only.
  bool resuming = false;
  bool validation = false;  // this rank writes validation videos (train.sample_every > 0)
  // train.val_every > 0 on the rank that measures the validation loss: its data's config (validation_data_config).
  const RunConfig* validation_data = nullptr;
  Communicator* communicator = nullptr;  // data parallelism, or null for one process
};

// Whether `path` holds LoRA adapters (a LoRA file in any layout, or a LoRA run's folder or checkpoint: its
// master.safetensors) rather than a model's weights; nullopt when it cannot be read. A LoRA run's train.init_from
// starts the adapters or the frozen model by it; megaslide-sample refuses a checkpoint of adapters with it.
std::optional<bool> holds_lora_adapters(const std::string& path);

class Trainer {
 public:
  // Throws ConfigError (the family's bad data, weights or encoders), InitFromError, std::invalid_argument
  // when R does not divide train.batch_size.
  explicit Trainer(const TrainerRequest& request);
  ~Trainer();
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;

  // One optimizer step (train.grad_accum_steps micro-batches). Streamed with a trace set, it records this
  // step and writes the file once the step's host updates have finished.
  StepMetrics step();
  // Waits for host updates still running (streamed: they overlap the next step in deferred mode).
  void synchronize();
  // Runs `work` between steps (a checkpoint's save, validation videos) with the NVMe tier's I/O it does left out of
  // the next step's figures (StreamedStackTrainer::leave_out_of_step_figures); the last step's finishes first.
  void outside_steps(const std::function<void()>& work);
  // Streamed: writes a Chrome trace of the next step to `path` (offload/step_trace.h); resident: no-op.
  void trace_next_step(const std::string& path);

  // Checkpointing (train/checkpoint.h): the run's whole state (streamed: the blocks' as views into the
  // host store), and its restoration from a state with the same names and shapes, in either mode's
  // order. load_training_state throws std::invalid_argument (the data position) or c10::Error (a tensor).
  TrainingState training_state();
  void load_training_state(const TrainingState& state);

  // The current weights by name in the model's order, without copies: resident, the parameters;
  // streamed, the blocks' masters as views into the host store (sharded, where no rank holds a whole
  // master: their compute copies). Valid until the next step (synchronizes first).
  io::NamedTensors weight_views();
  // The same as fp32 CPU copies.
  io::NamedTensors master_weights();

  const RunConfig& config() const { return config_; }
  torch::Device device() const { return device_; }
  int64_t steps_done() const { return steps_done_; }
  int64_t parameter_count() const;  // trained parameters (LoRA: the adapters)
  int64_t tokens_per_sample() const { return model_->tokens_per_sample(); }
  bool streams() const { return engine_ != nullptr; }
  bool sharded() const;  // host state sharded over the ranks: every rank saves its shard
  offload::StreamedStackTrainer* engine() { return engine_.get(); }
  FamilyModel& model() { return *model_; }
  const FamilyModel& model() const { return *model_; }
  // Device memory that lives across steps (what each step's own allocations add to): streamed, the
  // weight and gradient slots and the resident parameters with their two AdamW moments (and their EMA
  // with train.ema_decay); resident, every trained parameter with its two moments (and its EMA).
  int64_t persistent_device_bytes();
  // The train.init_from the trainer was built with (empty path: none).
  const InitPlan& init_plan() const { return init_plan_; }

  // Lines for the run log after the model line: the trainer, its memory, then the family's.
  void describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const;
  std::string describe_data(int64_t steps) const { return model_->describe_data(steps); }
  std::vector<BadItem> take_new_bad_items() { return model_->take_new_bad_items(); }
  // Validation videos of the current weights (the trainer was built with `validation`); the files written.
  std::vector<std::string> write_validation(const std::string& folder) {
    return model_->write_validation(folder, *this);
  }
  // The validation loss of the current weights (the trainer was built with TrainerRequest::validation_data;
  // FamilyModel::validation_loss). Waits for host updates still running.
  double validation_loss() {
    synchronize();
    return model_->validation_loss(*this);
  }
  // The family's weights file of the current weights (streamed: straight from the host store).
  void export_weights(const std::string& path) { model_->write_weights(path, weight_views()); }
  // The family's weights file of `weights`, named as training_state() names the parameters (the EMA).
  void write_weights(const std::string& path, const io::NamedTensors& weights) { model_->write_weights(path, weights); }
  // LoRA (lora.rank > 0): the frozen model's weights with `adapters`' updates merged in (W + (alpha / r) ·
  // up · down, in fp32, then cast to `dtype`), named as full fine-tuning names them — the streamed blocks'
  // from the host store (fp8: upcast). Adapters as weight_views() names them (the current ones, or the EMA's).
  // CPU tensors the caller owns (bf16: 2 B per parameter). Throws std::logic_error for a run without LoRA.
  io::NamedTensors merged_lora_weights(const io::NamedTensors& adapters, at::ScalarType dtype = at::kBFloat16);
  // The family's full weights file (diffusers' layout for Wan) of merged_lora_weights.
  void write_base_weights(const std::string& path, const io::NamedTensors& weights) {
    model_->base().write_weights(path, weights);
  }

 private:
  // One step of `part` (null: the whole model) whose updates take AdamW step number `adam_step`.
  StepMetrics resident_step(double lr, MicroBatchStats& stats, const ModelPart* part, int64_t adam_step);
  StepMetrics streamed_step(double lr, MicroBatchStats& stats, const ModelPart* part, int64_t adam_step);
  // The AdamW updates the parameter `name` has taken by a state's counters (its part's, with parts).
  int64_t adam_steps_of(const std::string& name, const TrainingState& s) const;
  io::NamedTensors resident_parameters();  // streamed: the parameters outside the blocks, in the model's order
  // Streamed: every block parameter by its name (FamilyModel::block_name), as a view into the host store (its
  // master, or its compute copy when the store is sharded and holds no whole master).
  std::map<std::string, at::Tensor> block_views() const;

  RunConfig config_;
  std::string requested_compute_dtype_;
  torch::Device device_;
  Communicator* communicator_ = nullptr;
  std::unique_ptr<ops::FrameExchange> context_group_;  // distributed.context_parallel > 1
  InitPlan init_plan_;
  std::unique_ptr<FamilyModel> model_;
  std::unique_ptr<offload::StreamedStackTrainer> engine_;  // streamed mode
  std::vector<at::Tensor> params_;                         // resident mode: what optimizer_ updates
  std::unique_ptr<torch::optim::AdamW> optimizer_;         // resident mode
  std::unique_ptr<offload::CpuAdamW> host_adamw_;          // resident mode on the CPU: runs optimizer_'s steps
  std::unique_ptr<WeightsEma> ema_;                        // resident mode (streamed: the engine's)
  int64_t steps_done_ = 0, optimizer_steps_ = 0;
  std::vector<ModelPart> parts_;     // FamilyModel::parts
  std::vector<int64_t> part_steps_;  // the updates each part took
  int64_t skipped_total_ = 0, consecutive_skips_ = 0;
  double flops_per_step_ = 0.0, peak_flops_ = 0.0;
  std::string trace_path_;
};

// The trainer of `config` for tools, tests and benchmarks, in the mode offload.enabled says: auto settings
// and the family's resolve applied (ConfigError for what it refuses), starting from train.init_from
// when it is set.
Trainer make_trainer(const RunConfig& config, Communicator* communicator = nullptr);

}  // namespace megaslide
