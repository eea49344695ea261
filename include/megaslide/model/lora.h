// LoRA adapters trained on Linear layers whose own weights stay frozen (model/layers.h LinearAdapter;
// docs/lora.md). For a targeted Linear W [out, in] (bias b), with rank r and scale s = alpha / r:
//
//   y = x W^T + b + s · up(down(dropout(x)))        down [r, in] (PEFT's lora_A), up [out, r] (lora_B)
//
// computed in x's dtype (the adapters' fp32 weights cast to it, as an autocast trainer computes it; with
// fp32 compute this is PEFT's arithmetic), dropout only in training. At initialisation up = 0, so the
// adapted model is the base model. The adapters' tensors are fp32 on the training device and
// require grad; the Linear layers only point at them (LinearImpl::adapter), so a trainer that streams
// the frozen layers (offload::StackTrainerOptions::frozen_blocks) keeps the adapters resident.
//
// Naming, as PEFT names a model's adapters without its ".default": the adapter of the Linear whose
// weight is "blocks.0.attn1.to_q.weight" trains "blocks.0.attn1.to_q.lora_A.weight" (down) and
// "blocks.0.attn1.to_q.lora_B.weight" (up).
//
// Dropout and recomputation: the streamed trainer runs a block twice (forward, then the backward's
// recompute), so a dropout mask must be a function of the micro-batch and the layer, not of a random
// stream's position: each micro-batch sets LoraAdapters::set_draw(n) and every adapter draws its mask
// from a generator seeded with (the adapters' seed, n, the layer's name), on the training device.
//
// Thread-safety: adapters are read by the thread that runs the model; set_draw between micro-batches.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/layers.h"

namespace megaslide {

struct LoraOptions {
  int64_t rank = 0;
  double alpha = 0.0;  // 0: rank
  double dropout = 0.0;
  std::vector<std::string> targets = {"*"};
  std::string init = "default";  // default | gaussian
  static LoraOptions from_config(const LoraConfig& config);
  double alpha_or_rank() const { return alpha > 0 ? alpha : static_cast<double>(rank); }
  double scale() const { return alpha_or_rank() / static_cast<double>(rank); }
};

class LoraLinear final : public LinearAdapter {
 public:
  LoraLinear(at::Tensor down, at::Tensor up, double scale, double dropout, std::shared_ptr<std::atomic<uint64_t>> draw,
             uint64_t seed);
  torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& y, bool training) const override;

  at::Tensor down, up;  // fp32 leaves on the training device
  double scale = 1.0, dropout = 0.0;

 private:
  std::shared_ptr<std::atomic<uint64_t>> draw_;  // the micro-batch's draw (LoraAdapters::set_draw)
  uint64_t seed_ = 0;                            // the layer's own seed
};

// Every adapter of one model, by the name of the Linear weight it adapts.
class LoraAdapters {
 public:
  LoraAdapters(LoraOptions options, torch::Device device, uint64_t seed);

  // Creates an adapter for each Linear of `module` whose weight's name (`prefix` + its name in `module`)
  // matches one of the targets, drawn from the seed and that name alone (so the result does not depend
  // on the order modules are added in; `module` may be a meta skeleton), and attaches it. Returns how
  // many it created. A name added twice is an error (std::invalid_argument).
  int64_t add(torch::nn::Module& module, const std::string& prefix);
  // Attaches the adapters of the weights under `prefix` to `module`'s Linear layers (a block rebuilt
  // with its weights: the streamed trainer's adopted block). Throws std::invalid_argument when a Linear
  // the adapters expect is missing.
  void attach(torch::nn::Module& module, const std::string& prefix) const;

  // The trained parameters: per adapter (in the order added) its down, then its up, named
  // "<layer>.lora_A.weight" / "<layer>.lora_B.weight".
  io::NamedTensors parameters() const;
  // The adapted weights' names ("blocks.0.attn1.to_q.weight"), in the order added.
  std::vector<std::string> weights() const;
  int64_t size() const { return static_cast<int64_t>(order_.size()); }
  const LoraOptions& options() const { return options_; }
  // The micro-batch the next forward runs for (dropout's masks).
  void set_draw(uint64_t draw) { draw_->store(draw); }

 private:
  LoraOptions options_;
  torch::Device device_;
  uint64_t seed_;
  std::shared_ptr<std::atomic<uint64_t>> draw_;
  std::vector<std::string> order_;  // weight names
  std::map<std::string, std::shared_ptr<const LoraLinear>> by_weight_;
};

// The name of the adapted weight of a LoRA parameter ("x.lora_A.weight" -> "x.weight") and which half it
// is ('A' or 'B'); "" for a name that is not a LoRA parameter.
std::string lora_base_weight(const std::string& parameter, char* half = nullptr);

}  // namespace megaslide
