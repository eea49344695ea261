// CPUMasterVideoDiT: the streamed CPU-master trainer of the DiT family (DESIGN.md §2). Same data,
// random streams, objective and learning-rate schedule as ResidentTrainer, but the blocks' weights,
// fp32 masters and AdamW moments live in host RAM (StreamedStackTrainer): the device holds two
// blocks' weights, the block-boundary activations and the resident prologue/epilogue.
//
//   prologue (resident):  caption encoder + DiT::embed (patch, timestep, positions)
//   stack (streamed):     DiT blocks, checkpointed at block boundaries
//   epilogue (resident):  DiT::head + ε-MSE
//
// Prologue and epilogue stay on the device in fp32 and are updated there by LibTorch's AdamW; blocks
// run in offload.compute_dtype and are updated by CpuAdamW on the host.
//
// Initialisation: the model is built as ResidentTrainer builds it (same seed, same order), but its
// blocks as a skeleton on the meta device; each block's initial weights are built on the CPU by
// DiT::initial_block (seeded per block) straight into the host store, one or two blocks at a time. So
// the two trainers start from identical weights and no full copy of the model ever exists.
//
// Threading: one thread drives a trainer.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/offload/streamed_model.h"
#include "megaslide/train/resident_trainer.h"

namespace megaslide {

// A DiT as a StreamedModel: blocks are the DiT's blocks; resident parameters are every other DiT
// parameter plus the caption encoder's. BlockInputs: tensors {t_mod, text, text_mask}, info TokenGrid.
class DiTStack : public offload::StreamedModel {
 public:
  DiTStack(DiT model, TextEncoder text_encoder) : model_(std::move(model)), text_encoder_(std::move(text_encoder)) {}
  int64_t num_blocks() const override { return static_cast<int64_t>(model_->blocks->size()); }
  torch::nn::Module& block(int64_t index) override { return *model_->blocks[index]; }
  torch::Tensor forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) override;
  std::vector<torch::Tensor> resident_parameters() override;
  // DiT::initial_block on the CPU, when the DiT's blocks are a meta skeleton (nullptr otherwise); the
  // trainer's adopted module replaces the skeleton's block (DiT::replace_block).
  std::shared_ptr<torch::nn::Module> initial_block(int64_t index) override;
  void adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> block) override;
  // Resident parameters by name (text encoder ones prefixed "text_encoder."; none when the text encoder
  // is CLIP, frozen outside the stack: a null TextEncoder).
  std::vector<std::pair<std::string, torch::Tensor>> named_resident_parameters();
  DiT& model() { return model_; }
  TextEncoder& text_encoder() { return text_encoder_; }

 private:
  DiT model_;
  TextEncoder text_encoder_;
};

// Model FLOPs of one training step (forward + backward, recompute not counted; DESIGN.md §6):
// 6 · parameters · tokens plus 12 · L · B · N · (keys per query) · D for self- and cross-attention.
double model_flops_per_step(const RunConfig& config);

// Peak dense bf16 TFLOP/s of the current GPU, measured with a few large matmuls (~1 s). Throws without
// a GPU.
double measure_peak_tflops(torch::Device device);

class Communicator;

class CPUMasterVideoDiT {
 public:
  // With a communicator of R > 1 ranks (train/distributed.h; it must outlive the trainer): data
  // parallelism with the host state sharded over the ranks (StreamedStackTrainer's sharding): each rank
  // trains on its slice of every global batch (DiffusionBatchSource::take_slice), keeps the whole
  // compute copy of every block and 1/R of the masters and moments. Every rank builds the same initial
  // weights from train.seed. Construction is collective (the block exchange's process group).
  explicit CPUMasterVideoDiT(const RunConfig& config, Communicator* communicator = nullptr);

  // One optimizer step (train.grad_accum_steps micro-batches). With a trace set, it records this step
  // and writes the file once the step's host updates have finished.
  StepMetrics step();
  // Waits for host updates still running (they overlap the next step in deferred mode).
  void synchronize() { engine_->synchronize(); }
  // Writes a Chrome trace of the next step to `path`.
  void trace_next_step(const std::string& path);

  int64_t steps_done() const { return steps_done_; }
  // Whether the host state is sharded over several ranks.
  bool sharded() const { return engine_->store().sharded(); }
  torch::Device device() const { return device_; }
  const RunConfig& config() const { return config_; }
  int64_t parameter_count() const;
  int64_t tokens_per_sample() const { return grid_.numel(); }
  offload::StreamedStackTrainer& engine() { return *engine_; }
  DiTStack& stack() { return *stack_; }
  // Every trained parameter's fp32 master as a CPU tensor copy, named as in DiT::named_parameters()
  // ("blocks.3.mlp.fc1.weight") and "text_encoder.<name>" (synchronizes first). Sharded over ranks, no
  // rank holds the blocks' whole masters: the blocks' entries are then their compute copies (fp32
  // compute: the masters' values; bf16: rounded as the checkpoint's model.safetensors is).
  std::vector<std::pair<std::string, torch::Tensor>> master_weights();
  // The same without copies: the blocks' masters as views into the host store, the resident parameters
  // as they are (on the training device). Exporting from these needs no second copy of the model
  // (save_weights casts one tensor at a time). Valid until the next step (synchronizes first).
  std::vector<std::pair<std::string, torch::Tensor>> master_views();
  // Copies the fp32 masters into a DiT and caption encoder built from the same config (any device),
  // tensor by tensor from the store, for sampling while training goes on (synchronizes first).
  void copy_weights_to(DiT& dit, TextEncoder& text_encoder);
  // Host memory by component (the store's report) as a table.
  std::string host_memory_report() const;

  // Checkpointing (train/checkpoint.h; synchronizes first). The blocks' master, m and v are views into
  // the host store (nothing copied, so a checkpoint of a model that fills host RAM needs no second copy);
  // the resident parameters' are CPU copies. TrainingState::shards describes the blocks' flat buffers
  // (sharded: the blocks are there only; checkpoints then keep a shard per rank, and any world size
  // resumes them). Sharded, every rank calls these at the same point (load_training_state gathers the
  // compute copies). load_training_state takes a state with the same names and
  // shapes; when it is this trainer's own training_state() that a checkpoint was read into, the blocks'
  // tensors are already in place. After it the next step() is the one the saved trainer would have
  // taken, bit for bit on the CPU. Steps skipped for non-finite values are counted here too.
  TrainingState training_state();
  void load_training_state(const TrainingState& state);
  DiffusionBatchSource& data() { return batches_; }
  // train.init_from (train/init_from.h): names and shapes as training_state() names them, and loading
  // a matched plan — resident parameters on the device, blocks' masters tensor by tensor straight into
  // the host store, then their compute copies refreshed.
  ParameterShapes parameter_shapes() const;
  void init_from(const InitPlan& plan);

 private:
  RunConfig config_;
  torch::Device device_;
  DiffusionBatchSource batches_;
  std::shared_ptr<DiTStack> stack_;
  std::unique_ptr<offload::StreamedStackTrainer> engine_;
  TokenGrid grid_;
  int64_t steps_done_ = 0;
  int64_t skipped_total_ = 0, consecutive_skips_ = 0;
  double flops_per_step_ = 0.0, peak_flops_ = 0.0;
  std::string trace_path_;
};

}  // namespace megaslide
