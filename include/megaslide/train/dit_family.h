// The DiT family (model.arch megaslide, dense3d, swin) behind train/model_family.h: the DiT with its
// built-in caption encoder (or frozen CLIP and SD VAE, model/frozen_encoders.h) on DiffusionBatchSource's
// batches (train/dit_batches.h), trained by the Trainer in either mode (train/trainer.h).
//
//   prologue (resident):  caption encoder + DiT::embed (patch, timestep, positions)
//   stack (streamed):     DiT blocks, checkpointed at block boundaries
//   epilogue (resident):  DiT::head + the diffusion.prediction MSE
//
// Initialisation: torch::manual_seed(train.seed), then the DiT and the caption encoder in that order.
// Streamed, the DiT's blocks are a skeleton on the meta device and each block's initial weights are built
// on the CPU by DiT::initial_block (seeded per block) straight into the host store, one or two blocks at a
// time: both modes start from identical weights and no full copy of the model ever exists. A
// train.init_from plan is read into the resident parts once built and into each block as it is built.
//
// Threading: one thread drives the trainer (DiTStack::initial_block may run on the engine's init threads).
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/offload/streamed_model.h"
#include "megaslide/train/dit_batches.h"
#include "megaslide/train/init_from.h"

namespace megaslide {

class Trainer;

// A DiT as a StreamedModel: blocks are the DiT's blocks; resident parameters are every other DiT
// parameter plus the caption encoder's. BlockInputs: tensors {t_mod, text, text_mask}, info TokenGrid.
// What every streamed block reads besides its input and the shared tensors (StackInput's info).
struct DiTStackInfo {
  TokenGrid grid;        // the whole sample's
  ops::ContextShard cp;  // this rank's frames of it (context parallelism), else inactive
};

class DiTStack : public offload::StreamedModel {
 public:
  // `init`: a train.init_from plan read into each block initial_block builds (its "blocks.<l>." tensors).
  DiTStack(DiT model, TextEncoder text_encoder, const InitPlan* init = nullptr)
      : model_(std::move(model)), text_encoder_(std::move(text_encoder)), init_(init) {}
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
  const InitPlan* init_ = nullptr;
};

// Model FLOPs of one training step (forward + backward, recompute not counted; DESIGN.md §6):
// 6 · parameters · tokens plus 12 · L · B · N · (keys per query) · D for self- and cross-attention.
double model_flops_per_step(const RunConfig& config);

// The DiT family's modules and data inside a Trainer of model.arch megaslide, dense3d or swin (throws
// std::invalid_argument for another family's). Resident: the trained modules themselves; streamed, the
// DiT's blocks are the engine's (their weights are in the host store: Trainer::weight_views). The text
// encoder is null with model.text_encoder.kind: clip (frozen, in dit_batches(trainer).frozen()).
DiT& dit_module(Trainer& trainer);
TextEncoder& dit_text_encoder(Trainer& trainer);
DiffusionBatchSource& dit_batches(Trainer& trainer);

// Copies `weights` (Trainer::weight_views' names) into a DiT and text encoder built from the trainer's
// config, one tensor at a time; throws c10::Error when a name or shape does not fit or one is missing.
void copy_weights_to(const io::NamedTensors& weights, DiT& dit, TextEncoder& text_encoder);

}  // namespace megaslide
