// A user-defined block stack trained by the streamed CPU-master engine (docs/offload.md).
// tests/test_cpu_master_trainer.cpp compiles and trains it.
#pragma once

#include <torch/torch.h>

#include "megaslide/offload/stack_trainer.h"

namespace example {

// One block: x + W2 · gelu(W1 · LN(x) + b1) · scale, where `scale` comes from the prologue.
struct ResidualMlpImpl : torch::nn::Module {
  explicit ResidualMlpImpl(int64_t dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& scale) {
    return x + fc2(torch::gelu(fc1(norm(x)))) * scale;
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ResidualMlp);

// The stack: `depth` blocks streamed from the host; an input projection and a scale (the prologue)
// and an output head (the epilogue) stay resident on the device.
class ResidualMlpStack : public megaslide::offload::StreamedModel {
 public:
  ResidualMlpStack(int64_t depth, int64_t dim, torch::Device device)
      : input(torch::nn::Linear(dim, dim)), head(torch::nn::Linear(dim, 1)) {
    for (int64_t i = 0; i < depth; ++i) blocks.push_back(ResidualMlp(dim));  // built on the CPU
    input->to(device);
    head->to(device);
    log_scale = torch::zeros({1}, torch::TensorOptions().device(device)).requires_grad_(true);
  }
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks.size()); }
  torch::nn::Module& block(int64_t i) override { return *blocks[i]; }
  torch::Tensor forward_block(int64_t i, const torch::Tensor& x,
                              const megaslide::offload::BlockInputs& in) override {
    return blocks[i]->forward(x, in.tensors[0]);
  }
  std::vector<torch::Tensor> resident_parameters() override {
    auto p = input->parameters();
    for (auto& h : head->parameters()) p.push_back(h);
    p.push_back(log_scale);
    return p;
  }

  std::vector<ResidualMlp> blocks;
  torch::nn::Linear input, head;
  torch::Tensor log_scale;
};

// One training step on a batch (x, y): the prologue and epilogue are ordinary LibTorch code.
inline megaslide::offload::StackStepResult train_step(megaslide::offload::StreamedStackTrainer& trainer,
                                                      ResidualMlpStack& stack, const torch::Tensor& x,
                                                      const torch::Tensor& y, double lr) {
  auto prologue = [&] {
    megaslide::offload::StackInput in;
    in.hidden = stack.input(x);
    in.inputs.tensors = {stack.log_scale.exp()};  // every block reads it; its gradient is summed
    return in;
  };
  auto epilogue = [&](const torch::Tensor& last_hidden) { return torch::mse_loss(stack.head(last_hidden), y); };
  return trainer.step(prologue, epilogue, lr);
}

}  // namespace example
