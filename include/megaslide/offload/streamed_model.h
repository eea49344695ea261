// StreamedModel: what a model must offer to be trained by the streamed CPU-master trainer
// (StreamedStackTrainer, the streamed Trainer; DESIGN.md §2): a stack of blocks whose weights live in host
// RAM and visit the device one or two at a time, between a prologue and an epilogue that stay resident.
//
//   prologue (resident, autograd)  ->  x_0, BlockInputs
//   x_{l+1} = forward_block(l, x_l, inputs)      for l = 0 … num_blocks()-1   (streamed)
//   epilogue (resident, autograd)  ->  loss
//
// The prologue and epilogue are plain LibTorch code the caller hands to StreamedStackTrainer::step;
// this interface only describes the stack. docs/offload.md shows a complete small example.
//
// Contract for implementers:
//  - block(l) is an ordinary torch::nn::Module. Its parameters are read once, when the trainer is
//    built (they are the initial weights), unless initial_block(l) gives a module: then block(l) may be
//    a skeleton on the meta device (names and shapes, no storage: how a model larger than host RAM is
//    described), initial_block(l) builds block l with its initial weights on the CPU — one block at a
//    time, possibly from several threads for different blocks, so block l's weights must depend only
//    on l — and the trainer, once it has copied them into its store, hands that module back through
//    adopt_block(l, module): from then on block(l) must return it and forward_block(l) must run it.
//    Either way the trainer owns the parameters' storage from then on: it points them (set_data) at
//    views into a device slot before each use of the block and at empty tensors between uses, and
//    points their .grad at a flat per-slot gradient buffer. A block must therefore read its parameters
//    in forward (not cache them), and hold no buffers that need to move between devices
//    (register_buffer is not supported in streamed blocks).
//  - forward_block(l, x, inputs) runs block l; `x` and the floating tensors of `inputs` arrive in the
//    trainer's compute dtype on the training device. It must be deterministic given its inputs (the
//    backward recomputes it from x: activation checkpointing at block boundaries).
//  - resident_parameters() are the prologue's and epilogue's parameters (everything trained that is
//    not in a block): fp32, already on the training device. The trainer updates them there with
//    LibTorch's AdamW; they are small next to the stack.
//
// Threading: the trainer calls all of these from the thread that drives it.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <any>
#include <vector>

namespace megaslide::offload {

// What every block reads besides its input.
struct BlockInputs {
  // Tensors every block may read (e.g. a timestep modulation, text tokens, a mask). Floating tensors
  // that require grad are differentiable: the trainer hands each block a detached leaf copy in the
  // compute dtype, sums the gradients all blocks send it, and backpropagates the sum into the
  // prologue once per micro-batch. Undefined and integer/bool tensors pass through untouched.
  std::vector<torch::Tensor> tensors;
  // Anything else (e.g. the token grid), passed through untouched.
  std::any info;
};

// The prologue's output for one micro-batch.
struct StackInput {
  torch::Tensor hidden;  // x_0, the first block's input (any floating dtype; cast to the compute dtype)
  BlockInputs inputs;
};

class StreamedModel {
 public:
  virtual ~StreamedModel() = default;
  virtual int64_t num_blocks() const = 0;
  virtual torch::nn::Module& block(int64_t index) = 0;
  virtual torch::Tensor forward_block(int64_t index, const torch::Tensor& x, const BlockInputs& inputs) = 0;
  virtual std::vector<torch::Tensor> resident_parameters() = 0;
  // Block `index` with its initial weights on the CPU (block(index)'s parameter names and shapes), for
  // a model whose block(index) is a meta skeleton; nullptr (the default): block(index)'s own
  // parameters are the initial weights and adopt_block is not called.
  virtual std::shared_ptr<torch::nn::Module> initial_block(int64_t index) { return nullptr; }
  // The module initial_block(index) gave, its weights now in the trainer's store (parameters emptied):
  // the model's block `index` from now on.
  virtual void adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> block) {}
};

}  // namespace megaslide::offload
