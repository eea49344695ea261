// LoRA and LoKr adapters trained on Linear layers whose own weights stay frozen (model/layers.h
// LinearAdapter; docs/lora.md). For a targeted Linear W [out, in] (bias b), with rank r and scale s = alpha / r:
//
//   LoRA  y = x W^T + b + s · up(down(dropout(x)))      down [r, in] (PEFT's lora_A), up [out, r] (lora_B)
//   LoKr  y = x W^T + b + s · x kron(W1, W2)^T           W1 [out_l, in_m], W2 [out_k, in_n]
//
// LoKr is PEFT's: out = out_l · out_k and in = in_m · in_n (lokr_factorization), W1 = lokr_w1 (or lokr_w1_a ·
// lokr_w1_b in files that decompose both), W2 = lokr_w2 when r >= max(out_k, in_n) / 2, else lokr_w2_a [out_k, r]
// · lokr_w2_b [r, in_n]. x kron(W1, W2)^T is computed without forming the Kronecker product: x viewed as
// [.., in_m, in_n] gives W1 · X · W2^T [.., out_l, out_k].
//
// Both compute in x's dtype (the adapters' fp32 weights cast to it, as an autocast trainer computes it; with
// fp32 compute this is PEFT's arithmetic, up to the order of LoKr's sums), dropout (LoRA's) only in training.
// At initialisation up = 0 (LoRA) or W1 = 0 (LoKr), so the adapted model is the base model. The adapters'
// tensors are fp32 on the training device and require grad; the Linear layers only point at them
// (LinearImpl::adapter), so a trainer that streams the frozen layers (offload::StackTrainerOptions::
// frozen_blocks) keeps the adapters resident.
//
// Naming, as PEFT names a model's adapters without its ".default": the adapter of the Linear whose
// weight is "blocks.0.attn1.to_q.weight" trains "blocks.0.attn1.to_q.lora_A.weight" (down) and
// "blocks.0.attn1.to_q.lora_B.weight" (up), or "blocks.0.attn1.to_q.lokr_w1" and "...lokr_w2" (or "...lokr_w2_a"
// and "...lokr_w2_b").
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
  std::string type = "lora";  // lora | lokr
  int64_t rank = 0;
  double alpha = 0.0;  // 0: rank
  double dropout = 0.0;
  std::vector<std::string> targets = {"*"};
  std::string init = "default";  // default | gaussian (LoRA)
  int64_t factor = -1;           // LoKr's decompose_factor
  static LoraOptions from_config(const LoraConfig& config);
  bool lokr() const { return type == "lokr"; }
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

class LokrLinear final : public LinearAdapter {
 public:
  // w2 defined, or w2_a and w2_b.
  LokrLinear(at::Tensor w1, at::Tensor w2, at::Tensor w2_a, at::Tensor w2_b, double scale);
  torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& y, bool training) const override;

  at::Tensor w1, w2, w2_a, w2_b;  // fp32 leaves on the training device
  double scale = 1.0;
};

// PEFT's factorization of a LoKr dimension into (m, n), m <= n, m · n = dim: with factor f > 0 that divides
// dim, (f, dim / f) (as PEFT returns it, not reordered); otherwise the divisor pair nearest sqrt(dim) whose
// smaller member is at most f (any, for f = -1).
std::pair<int64_t, int64_t> lokr_factorization(int64_t dim, int64_t factor = -1);

// The adapter of one weight as files hold it and merges apply it: LoRA's down and up, or LoKr's tensors.
struct LoraAdapter {
  at::Tensor down;                            // [r, in] (PEFT's lora_A), float32 on the CPU
  at::Tensor up;                              // [out, r] (lora_B)
  at::Tensor w1, w1_a, w1_b, w2, w2_a, w2_b;  // LoKr: W1 = w1 or w1_a · w1_b, W2 = w2 or w2_a · w2_b
  double alpha = 0.0;                         // the update's scale is alpha / r (alpha / sqrt(r) with rslora)
  int64_t lokr_rank = 0;  // LoKr's r (PEFT's config names it; a file's shapes do not when W1 and W2 are whole)
  bool rslora = false;
  bool lokr() const { return w1.defined() || w1_a.defined() || w2.defined() || w2_a.defined(); }
  int64_t rank() const { return lokr() ? lokr_rank : down.size(0); }
  double scale() const;
  int64_t out_features() const;
  int64_t in_features() const;
  at::Tensor delta() const;  // scale · (up · down | kron(W1, W2)) [out, in], float32
  // Its defined tensors by their names' suffixes ("lora_A.weight", "lora_B.weight", "lokr_w1", ...).
  io::NamedTensors tensors() const;
  // Sets the tensor a suffix names; false for a suffix that names none.
  bool set(const std::string& suffix, at::Tensor t);
  // The tensor the update is linear in (up, or LoKr's w1 / w1_a), for rescaling to another scale.
  at::Tensor& scaled_part();
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
  // "<layer>.lora_A.weight" / "<layer>.lora_B.weight" (LoKr: w1, then w2 or w2_a and w2_b, "<layer>.lokr_w1", ...).
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
  struct Entry {
    std::shared_ptr<const LinearAdapter> adapter;
    io::NamedTensors tensors;  // by suffix, in parameters()' order
  };
  std::vector<std::string> order_;  // weight names
  std::map<std::string, Entry> by_weight_;
};

// The suffixes of adapters' tensor names, as PEFT names them: "lora_A.weight", "lora_B.weight", "lokr_w1",
// "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b".
const std::vector<std::string>& lora_suffixes();
// The name of the adapted weight of an adapter's parameter ("x.lora_A.weight" -> "x.weight", "x.lokr_w1" ->
// "x.weight") and the suffix it has ("lora_A.weight"); "" for a name that is not an adapter's.
std::string lora_base_weight(const std::string& parameter, std::string* suffix = nullptr);
// The adapters of named adapter parameters (LoraAdapters::parameters(), a checkpoint's), float32 on the CPU,
// with the options' alpha and rank, by the adapted weight's name. Throws std::invalid_argument for a name
// that is not an adapter's tensor.
std::map<std::string, LoraAdapter> lora_adapters_of(const io::NamedTensors& parameters, const LoraOptions& options);

}  // namespace megaslide
