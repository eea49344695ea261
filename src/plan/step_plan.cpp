#include "megaslide/plan/step_plan.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>

#include "megaslide/attention/dsa3d.h"
#include "megaslide/model/attention.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/layers.h"
#include "megaslide/model/lora.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/dit_family.h"
#include "megaslide/train/distributed.h"
#include "megaslide/train/wan_family.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/util/glob.h"

namespace megaslide::plan {
namespace {

// What does not change with frames, resolution or batch: the model's parameter layout.
struct ModelShape {
  int64_t params = 0, text_encoder_params = 0;
  int64_t resident =
      0;  // on the device, outside the store: prologue, epilogue, caption encoder (Wan: the blocks' fp32 tables)
  std::vector<int64_t> block_numels;
  std::vector<offload::BlockSpec> blocks;  // every block's parameters, as the trainer's store lays them out
  int64_t streamed = 0, largest_block = 0;
};

ModelShape model_shape(const RunConfig& config) {
  ModelShape s;
  DiT model(DiTOptions::from_config(config).device(torch::kMeta));
  s.params = count_parameters(*model);
  for (size_t l = 0; l < model->blocks->size(); ++l) {
    const auto& block = *model->blocks[l];
    const int64_t n = count_parameters(block);
    offload::BlockSpec spec{"blocks." + std::to_string(l), {}};
    for (const auto& item : block.named_parameters(/*recurse=*/true))
      spec.params.push_back({item.key(), item.value().sizes().vec()});
    s.blocks.push_back(std::move(spec));
    s.block_numels.push_back(n);
    s.streamed += n;
    s.largest_block = std::max(s.largest_block, n);
  }
  if (config.model.text_encoder.kind == "builtin") {  // CLIP is frozen: not trained, not counted here
    TextEncoder text(
        TextEncoderOptions(CaptionTokenizer().vocab_size(), config.model.text_dim, config.data.max_text_tokens)
            .device(torch::kMeta));
    s.text_encoder_params = count_parameters(*text);
  }
  s.resident = s.params - s.streamed + s.text_encoder_params;
  return s;
}

int64_t compute_element_bytes(const std::string& dtype) { return dtype == "fp32" ? 4 : 2; }

// The WeightStreamer's slot cache, replayed over one optimizer step of StreamedStackTrainer::step:
// forward uploads 0 … L-1 (prefetch of l+1 while l computes), the backward asks for L-1 … 0 and
// finds what is still valid in its slot (slot = block % 2); one gradient copy per block per
// micro-batch. Every block was updated at the end of the previous step, so a step starts with no
// valid slot (the same holds for the first step, whose slots are empty).
// Frozen blocks (LoRA, `gradients` false): no gradient copies, and no update invalidates a slot, so the
// blocks the previous step's backward ended with (1 and 0) are still valid when the next step's forward
// asks for them: the plan is such a step's (two copies fewer than the first step's, first_step_h2d_bytes;
// with at most two blocks nothing is uploaded after the first step).
TransferPlan replay_transfers(const std::vector<int64_t>& numels, int64_t accum, int64_t element_bytes,
                              bool gradients = true) {
  TransferPlan t;
  struct Slot {
    int64_t block = -1;
  } slots[2];
  const int64_t L = static_cast<int64_t>(numels.size());
  const auto prefetch = [&](int64_t l) {
    Slot& s = slots[l % 2];
    if (s.block == l) {
      ++t.cache_hits;
      return;
    }
    s.block = l;
    t.h2d_bytes += numels[l] * element_bytes;
    ++t.h2d_copies;
  };
  const auto step = [&] {
    for (int64_t k = 0; k < accum; ++k) {
      prefetch(0);
      for (int64_t l = 0; l + 1 < L; ++l) prefetch(l + 1);
      for (int64_t l = L - 1; l >= 0; --l) {
        if (l == L - 1) prefetch(l);
        if (gradients) {
          t.d2h_bytes += numels[l] * element_bytes;
          ++t.d2h_copies;
        }
        if (l > 0) prefetch(l - 1);
      }
    }
  };
  step();
  t.first_step_h2d_bytes = t.h2d_bytes;
  if (!gradients) {  // a later step: the slots as the first one left them
    const int64_t first = t.h2d_bytes;
    t = TransferPlan{};
    t.first_step_h2d_bytes = first;
    step();
  }
  return t;
}

struct BlockActivation {
  int64_t saved = 0, workspace = 0;
};

// The tensors autograd keeps while one block is recomputed with grad (its input excluded: that is a
// checkpoint), and the largest set of transients of its backward. Units: X = B·N·D elements of the
// compute dtype, Xm the same at the MLP's width. The count follows DiTBlockImpl::forward and the
// attention modules; docs/planner.md lists it term by term.
BlockActivation block_activation(const RunConfig& c, const TokenGrid& grid, int64_t e, bool dsa_reference) {
  const auto& m = c.model;
  const int64_t B = c.train.batch_size, N = grid.numel(), D = m.hidden, M = m.heads;
  const int64_t Dm = static_cast<int64_t>(std::llround(static_cast<double>(D) * m.mlp_ratio));
  const int64_t Nb = B * N, Lt = c.data.max_text_tokens;
  const int64_t X = Nb * D * e, Xm = Nb * Dm * e, stats = Nb * 8, lse = Nb * M * 4;
  BlockActivation a;
  // Shared by every architecture: LN1 and its modulation, the gated self-attention output, the first
  // residual, LN2, cross-attention (q, SDPA output, merged heads, its lse and the text's k and v), the
  // second residual, LN3 and its modulation, fc1 and GELU outputs (Xm each), fc2's output, the block's
  // output; LayerNorm statistics (fp32 mean and rstd per token) three times.
  a.saved = 13 * X + 2 * Xm + 3 * stats + lse + 2 * B * Lt * D * e;
  const int64_t mlp_stage = 2 * Xm + 2 * X;
  int64_t attention_stage = 0;
  switch (m.arch) {
    case Architecture::kMegaSlide: {
      const auto k = ops::effective_kernel(m.dsa_kernel, grid.dims());
      const int64_t K = k[0] * k[1] * k[2], G = m.dsa_groups;
      const int64_t offsets = Nb * G * K * 3 * e;
      a.saved += 3 * X;  // q, k, v
      // The offset network: the channels-first copy the depthwise conv reads, its output, GELU's
      // output, the channels-last copy the pointwise projection reads; tanh's output and the offsets.
      // Zero or frozen offsets (model.dsa_offsets) keep only the offsets: no gradient flows into a network.
      a.saved += m.dsa_offsets == DsaOffsets::kLearned ? 4 * X + 2 * offsets : offsets;
      if (!dsa_reference) {
        a.saved += X + lse;  // out, lse (FusedDsa3d saves q, k, v, offsets, bias, out, lse)
        // dq, dk, dv, dout and dx, the fp32 dk/dv accumulators, d(offsets).
        attention_stage = 5 * X + 2 * Nb * D * 4 + offsets;
      } else {
        // grid_sample's sampled k and v (K per token), logits and probabilities, the sampling grid, out.
        a.saved += 2 * K * X + 2 * Nb * M * K * e + offsets + X;
        attention_stage = 2 * K * X + 2 * Nb * M * K * e + 5 * X;
      }
      break;
    }
    case Architecture::kDense3D:
      if (m.dense_attention == "materialized") {
        // q, k, v, the softmax probabilities [B, M, N, N] (kept for backward), the merged output; the
        // backward holds the probabilities' and the logits' gradients, N x N each.
        const int64_t scores = B * M * N * N * e;
        a.saved += 4 * X + scores;
        attention_stage = 5 * X + 2 * scores;
      } else {
        // qkv, SDPA output (flash / memory-efficient kernels: no N×N matrix) and its lse, merged heads.
        a.saved += 5 * X + lse;
        attention_stage = 5 * X + Nb * D * 4;  // dq, dk, dv, dout, dx, an fp32 dq accumulator
      }
      break;
    case Architecture::kSwin: {
      const auto layout = window_layout(grid, m.swin_window, /*shifted=*/m.layers > 1);
      const int64_t Np = B * layout.padded[0] * layout.padded[1] * layout.padded[2];
      const int64_t Xp = Np * D * e;
      const int64_t Wn = layout.window[0] * layout.window[1] * layout.window[2];
      const int64_t windows = Np / B / Wn;
      const auto dims = grid.dims();
      bool masked = false;
      for (int ax = 0; ax < 3; ++ax) masked |= layout.shift[ax] > 0 || layout.padded[ax] > dims[ax];
      // Windows (the qkv input), qkv, SDPA output and lse, merged heads; the window mask expanded over
      // the batch (bool) on blocks that shift or pad.
      a.saved += 6 * Xp + Np * M * 4 + (masked ? B * windows * Wn * Wn : 0);
      attention_stage = 5 * Xp + Np * D * 4;
      break;
    }
    case Architecture::kWan:  // wan_block_activation
      break;
  }
  a.workspace = std::max(mlp_stage, attention_stage);
  return a;
}

// Bytes a trained parameter keeps on the device in the resident parts: fp32 weight, gradient, AdamW m
// and v, and with train.ema_decay its fp32 EMA.
int64_t resident_bytes_per_param(const RunConfig& c) { return c.train.ema_decay > 0 ? 20 : 16; }

// The block-boundary checkpoints the streamed trainer keeps on the device, in hidden states: every block's input
// and the stack's output; with offload.activations: host the last block's input, the output and one input in
// flight to or from the host (with_host_activations).
int64_t streamed_checkpoints(const RunConfig& c, int64_t L) {
  return c.offload.activations == "host" ? std::min<int64_t>(L + 1, 3) : L + 1;
}

DeviceMemoryPlan device_memory(const RunConfig& c, const ModelShape& s, const TokenGrid& grid) {
  DeviceMemoryPlan d;
  const bool streamed = c.offload.enabled;
  const int64_t e = streamed ? compute_element_bytes(c.offload.compute_dtype) : 4;  // the resident loop is fp32
  const int64_t B = c.train.batch_size, N = grid.numel(), D = c.model.hidden, L = c.model.layers;
  const int64_t Lt = c.data.max_text_tokens, Dt = c.model.text_dim;
  const int64_t X = B * N * D * e;
  const auto shape = model_sample_shape(c);  // the DiT's samples: pixels or the VAE's latents
  const int64_t video = B * shape[0] * shape[1] * shape[2] * shape[3] * 4;
  const int64_t resident = s.params - s.streamed + s.text_encoder_params;
  // The batch (x_t, noise), the head's projection and unpatchified prediction: four fp32 videos; x_0
  // (fp32 tokens, kept for the prologue's backward), the head's graph (its input, LayerNorm output,
  // modulated input: retained until the step's backward ends) and the input gradient; the caption
  // encoder's output and LayerNorm input.
  d.prologue_epilogue = 4 * video + 5 * B * N * D * 4 + 2 * B * Lt * Dt * 4;
  const BlockActivation fused = block_activation(c, grid, e, false);
  if (streamed) {
    d.weight_slots = d.gradient_slots = 2 * s.largest_block * e;
    d.resident_state = resident_bytes_per_param(c) * resident;
    d.checkpoints = streamed_checkpoints(c, L) * X;
    d.block_inputs = 2 * (B * 6 * D + B * Lt * Dt) * e;  // leaves in the compute dtype and their grads
    d.recompute_saved = fused.saved;
    d.recompute_workspace = fused.workspace;
    if (c.model.arch == Architecture::kMegaSlide) {
      const BlockActivation ref = block_activation(c, grid, e, true);
      d.recompute_saved_reference = ref.saved;
      d.recompute_workspace_reference = ref.workspace;
    }
  } else {
    // The resident loop: every weight, gradient and AdamW moment in fp32 on the device, and every
    // block's graph kept for one backward (no checkpointing).
    d.resident_state = resident_bytes_per_param(c) * (s.params + s.text_encoder_params);
    d.checkpoints = X;  // the first block's input
    d.recompute_saved = L * fused.saved;
    d.recompute_workspace = fused.workspace;
    if (c.model.arch == Architecture::kMegaSlide) {
      const BlockActivation ref = block_activation(c, grid, e, true);
      d.recompute_saved_reference = L * ref.saved;
      d.recompute_workspace_reference = ref.workspace;
    }
  }
  return d;
}

bool is_wan(const RunConfig& c) { return c.model.arch == Architecture::kWan; }

// Wan: the store holds each block's attn1, attn2 and ffn (WanBlock::streamed(), as WanStack streams
// them); every block's fp32 scale_shift_table and norm2, the prologue and the head stay on the device.
// The text encoder (umT5) is not part of the run: its embeddings are data.
ModelShape wan_model_shape(const RunConfig& config) {
  ModelShape s;
  WanTransformer model(WanOptions::from_config(config).device(torch::kMeta));
  s.params = count_parameters(*model);
  for (size_t l = 0; l < model->blocks->size(); ++l) {
    auto& block = model->blocks[l]->as<WanBlockImpl>()->streamed();
    offload::BlockSpec spec{"blocks." + std::to_string(l), {}};
    int64_t n = 0;
    for (const auto& item : block.named_parameters(/*recurse=*/true)) {
      spec.params.push_back({item.key(), item.value().sizes().vec()});
      n += item.value().numel();
    }
    s.blocks.push_back(std::move(spec));
    s.block_numels.push_back(n);
    s.streamed += n;
    s.largest_block = std::max(s.largest_block, n);
  }
  s.resident = s.params - s.streamed;
  return s;
}

ModelShape shape_of(const RunConfig& c) { return is_wan(c) ? wan_model_shape(c) : model_shape(c); }
const std::array<int64_t, 3>& patch_of(const RunConfig& c) { return is_wan(c) ? c.model.wan.patch : c.model.patch; }

// LoRA: one adapted Linear W [out, in] (down [r, in], up [out, r]) and the tokens it runs over.
struct AdaptedLinear {
  int64_t in = 0, out = 0;
  enum class Rows { kVideo, kText, kImage } rows = Rows::kVideo;
  // The adapter (model/lora.h): its parameters, the width of what its backward keeps per row (LoRA's down output
  // r; LoKr's first GEMM's output in_m · out_k) and its forward FLOPs per row (2r·(in + out); LoKr's two GEMMs
  // 2·in_m·out_k·(in_n + out_l)).
  int64_t params = 0, kept = 0;
  double flops_per_row = 0.0;
};

AdaptedLinear adapter_of(int64_t in, int64_t out, AdaptedLinear::Rows rows, const LoraConfig& lora) {
  AdaptedLinear a{in, out, rows};
  const int64_t r = lora.rank;
  if (lora.type == "lokr") {
    const auto [out_l, out_k] = lokr_factorization(out, lora.factor);
    const auto [in_m, in_n] = lokr_factorization(in, lora.factor);
    a.params = out_l * in_m + (2 * r >= std::max(out_k, in_n) ? out_k * in_n : r * (out_k + in_n));
    a.kept = in_m * out_k;
    a.flops_per_row = 2.0 * static_cast<double>(in_m * out_k * (in_n + out_l));
  } else {
    a.params = r * (in + out);
    a.kept = r;
    a.flops_per_row = 2.0 * static_cast<double>(r * (in + out));
  }
  return a;
}

// The adapters of a LoRA run (lora.rank > 0), as LoraAdapters::add creates them: one for each Linear of
// each block whose weight's name, <block name>.<module>.weight, matches one of lora.targets.
struct LoraShape {
  int64_t rank = 0;  // 0: full fine-tuning
  int64_t adapters = 0, params = 0;
  std::vector<std::vector<AdaptedLinear>> blocks;  // per block, in ModelShape::blocks' order
  int64_t blocks_per_part = 0;                     // the blocks of one step (Wan2.2 both: one expert's)
  bool enabled() const { return rank > 0; }
};

// Wan2.2's experts' names of one run (WanModel::block_name): "" for one DiT.
std::vector<std::string> wan_expert_prefixes(const RunConfig& c) {
  return c.model.wan.expert == "both" ? std::vector<std::string>{"transformer.", "transformer_2."}
                                      : std::vector<std::string>{""};
}

// The tokens a block's Linear runs over, by its name in the block: the cross-attention's key and value
// projections read the text (DiTBlock's cross_attn.kv, WanAttention's attn2.to_k and attn2.to_v) or, in
// Wan2.1 I2V, CLIP's image tokens (attn2.add_k_proj, attn2.add_v_proj); every other one the video tokens.
AdaptedLinear::Rows rows_of(const std::string& module) {
  for (const char* text : {"cross_attn.kv", "attn2.to_k", "attn2.to_v"})
    if (module == text) return AdaptedLinear::Rows::kText;
  for (const char* image : {"attn2.add_k_proj", "attn2.add_v_proj"})
    if (module == image) return AdaptedLinear::Rows::kImage;
  return AdaptedLinear::Rows::kVideo;
}

// The adapters LoraAdapters::add creates on `block` under `prefix` (train/lora_model.cpp: the streamed
// model's block(l), the resident one's block_modules(), the same Linear layers); `example` collects the
// first block's Linear weights for the error of targets that match none.
std::vector<AdaptedLinear> adapted_linears(torch::nn::Module& block, const std::string& prefix, const LoraConfig& lora,
                                           std::string& example, LoraShape& shape) {
  std::vector<AdaptedLinear> out;
  const bool first = example.empty();
  for (const auto& item : block.named_modules("", /*include_self=*/false)) {
    const auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (!linear) continue;
    const std::string weight = prefix + item.key() + ".weight";
    if (first) example += (example.empty() ? "" : ", ") + weight;
    bool wanted = false;
    for (const auto& glob : lora.targets) wanted = wanted || name_matches(glob, weight);
    if (!wanted) continue;
    const auto a = adapter_of(linear->options.in_features(), linear->options.out_features(), rows_of(item.key()), lora);
    shape.adapters += 1;
    shape.params += a.params;
    out.push_back(a);
  }
  return out;
}

LoraShape lora_shape(const RunConfig& c, const std::string& source = "megaslide-plan") {
  LoraShape s;
  if (c.lora.rank <= 0) return s;
  s.rank = c.lora.rank;
  std::string example;
  if (is_wan(c)) {
    WanTransformer model(WanOptions::from_config(c).device(torch::kMeta));
    const auto prefixes = wan_expert_prefixes(c);
    for (const auto& prefix : prefixes)  // the two experts' architectures are one
      for (size_t l = 0; l < model->blocks->size(); ++l)
        s.blocks.push_back(adapted_linears(model->blocks[l]->as<WanBlockImpl>()->streamed(),
                                           prefix + "blocks." + std::to_string(l) + ".", c.lora, example, s));
    s.blocks_per_part = static_cast<int64_t>(model->blocks->size());
  } else {
    DiT model(DiTOptions::from_config(c).device(torch::kMeta));
    for (size_t l = 0; l < model->blocks->size(); ++l)
      s.blocks.push_back(adapted_linears(*model->blocks[l], "blocks." + std::to_string(l) + ".", c.lora, example, s));
    s.blocks_per_part = static_cast<int64_t>(model->blocks->size());
  }
  if (s.adapters == 0) {  // as the trainer refuses it (train/lora_model.cpp)
    std::string targets;
    for (const auto& t : c.lora.targets) targets += (targets.empty() ? "" : ", ") + t;
    throw ConfigError(source, "lora.targets",
                      fmt::format("[{}] match no Linear layer of the blocks; the first block's are: {}", targets,
                                  example.empty() ? "none" : example));
  }
  return s;
}

// Wan2.1 I2V's image tokens (CLIP ViT-H/14), as wan_model_flops_per_step counts them.
constexpr int64_t kWanImageTokens = 257;

int64_t rows_per_sample(AdaptedLinear::Rows rows, const RunConfig& c, int64_t video_tokens) {
  switch (rows) {
    case AdaptedLinear::Rows::kText:
      return c.data.max_text_tokens;
    case AdaptedLinear::Rows::kImage:
      return kWanImageTokens;
    case AdaptedLinear::Rows::kVideo:
      break;
  }
  return video_tokens;
}

// What one block's adapters add to the tensors autograd keeps while it is recomputed with grad
// (LoraLinear::apply, LokrLinear::apply; the adapted Linear's input itself is kept by full fine-tuning's
// count already, for its weight's gradient): down's output [rows, r], which up's gradient reads (LoKr: the
// first GEMM's output [rows, in_m · out_k], which W1's reads), and the adapters' weights cast to the compute
// dtype (none in fp32); with lora.dropout > 0 the mask and the dropped input [rows, in].
int64_t lora_block_saved(const std::vector<AdaptedLinear>& layers, const RunConfig& c, int64_t video_tokens,
                         int64_t e) {
  int64_t saved = 0;
  for (const auto& a : layers) {
    const int64_t rows = c.train.batch_size * rows_per_sample(a.rows, c, video_tokens);
    saved += rows * a.kept * e + (e == 4 ? 0 : a.params * e);
    if (c.lora.dropout > 0) saved += 2 * rows * a.in * e;
  }
  return saved;
}

// One forward of the adapters of one step's part, in FLOPs per sample: 2·r·(in + out) per row.
double lora_forward_flops_per_sample(const LoraShape& lora, const RunConfig& c, int64_t video_tokens) {
  double largest = 0.0;  // Wan2.2's two experts: the larger part's
  for (size_t begin = 0; begin < lora.blocks.size(); begin += static_cast<size_t>(lora.blocks_per_part)) {
    double part = 0.0;
    for (size_t l = begin; l < begin + static_cast<size_t>(lora.blocks_per_part) && l < lora.blocks.size(); ++l)
      for (const auto& a : lora.blocks[l])
        part += a.flops_per_row * static_cast<double>(rows_per_sample(a.rows, c, video_tokens));
    largest = std::max(largest, part);
  }
  return largest;
}

// The adapters of one step's part: their parameters (Wan2.2's two experts: the larger part's).
int64_t lora_part_params(const LoraShape& lora) {
  int64_t largest = 0;
  for (size_t begin = 0; begin < lora.blocks.size(); begin += static_cast<size_t>(lora.blocks_per_part)) {
    int64_t part = 0;
    for (size_t l = begin; l < begin + static_cast<size_t>(lora.blocks_per_part) && l < lora.blocks.size(); ++l)
      for (const auto& a : lora.blocks[l]) part += a.params;
    largest = std::max(largest, part);
  }
  return largest;
}

// The tensors autograd keeps while one Wan block is recomputed with grad, following WanBlock::forward
// (docs/planner.md): X = B·N·D in the compute dtype, F the same in fp32 (the block's LayerNorms,
// modulation and gated residuals run in fp32 as diffusers keeps them), Xm at the FFN's width, C = B·Lt·D
// for the text side of the cross-attention.
BlockActivation wan_block_activation(const RunConfig& c, const TokenGrid& grid, int64_t e, bool dsa_reference) {
  const auto& w = c.model.wan;
  const int64_t B = c.train.batch_size, N = grid.numel(), D = w.dim, M = w.heads, Lt = c.data.max_text_tokens;
  const int64_t Nb = B * N;
  const int64_t X = Nb * D * e, F = Nb * D * 4, Xm = Nb * w.ffn_dim * e, C = B * Lt * D * e;
  const int64_t stats = Nb * 8, lse = Nb * M * 4;
  BlockActivation a;
  // Three fp32 LayerNorms: their fp32 input and output (the output is multiplied by the learned
  // modulation) and statistics; the modulated inputs h of attn1, attn2 (cross_attn_norm) and the FFN.
  a.saved = 6 * F + 3 * stats + 3 * X;
  // attn1: q, k, v projections; RoPE's fp32 views of q and k and its outputs; the projection's input
  // (merged heads) and output (multiplied by the gate in fp32).
  a.saved += 3 * X + 2 * F + 2 * X + 2 * X;
  // attn2: q and its output's projection input; the text's k and v, and the context cast to the compute dtype.
  a.saved += 2 * X + 3 * C + lse;
  // The first gated residual's output in the compute dtype, the second residual's output.
  a.saved += 2 * X;
  // RMSNorm over q and k (both attentions): their outputs and per-token fp32 rstd.
  if (w.qk_norm) a.saved += 3 * X + C + 3 * Nb * 4 + B * Lt * 4;
  // FFN: fc1's output, GELU's output (fc2's input), fc2's output in fp32 (multiplied by the gate).
  a.saved += 2 * Xm + F;
  const int64_t mlp_stage = 2 * Xm + 2 * X + F;
  int64_t attention_stage = 0;
  if (c.model.self_attention == "dsa3d") {
    const auto k = ops::effective_kernel(c.model.dsa_kernel, grid.dims());
    const int64_t K = k[0] * k[1] * k[2], G = c.model.dsa_groups;
    const int64_t offsets = Nb * G * K * 3 * e;
    // The offset network (learned): channels-first copy, depthwise output, GELU output, channels-last
    // copy; tanh's output and the offsets. Zero offsets keep the offsets only.
    a.saved += c.model.dsa_offsets == DsaOffsets::kLearned ? 4 * X + 2 * offsets : offsets;
    if (!dsa_reference) {
      a.saved += X + lse;  // FusedDsa3d's out and lse
      attention_stage = 5 * X + 2 * Nb * D * 4 + offsets;
    } else {
      a.saved += 2 * K * X + 2 * Nb * M * K * e + offsets + X;
      attention_stage = 2 * K * X + 2 * Nb * M * K * e + 5 * X;
    }
  } else {
    a.saved += X + lse;                    // SDPA's output and lse (flash / memory-efficient kernels: no N×N matrix)
    attention_stage = 5 * X + Nb * D * 4;  // dq, dk, dv, dout, dx, an fp32 dq accumulator
  }
  a.workspace = std::max(mlp_stage, attention_stage);
  return a;
}

DeviceMemoryPlan wan_device_memory(const RunConfig& c, const ModelShape& s, const TokenGrid& grid) {
  DeviceMemoryPlan d;
  const auto& w = c.model.wan;
  const bool streamed = c.offload.enabled;
  const int64_t e = streamed ? compute_element_bytes(c.offload.compute_dtype) : 4;
  const int64_t B = c.train.batch_size, N = grid.numel(), D = w.dim, L = w.layers, Lt = c.data.max_text_tokens;
  const int64_t X = B * N * D * e;
  const int64_t video = B * c.data.channels * c.data.frames * c.data.height * c.data.width * 4;
  // The batch (x0, noise, x_t, target) and the prediction: five fp32 latent videos; the patch embedding's
  // fp32 tokens, the head's LayerNorm input, output and modulated input, the input gradient; the text
  // embedder's input [B, Lt, text_dim] and its fp32 intermediates; the RoPE tables (fp32 cos and sin).
  d.prologue_epilogue = 5 * video + 5 * B * N * D * 4 + B * Lt * (w.text_dim + 3 * D) * 4 + N * (D / w.heads) * 4;
  BlockActivation fused = wan_block_activation(c, grid, e, false);
  const bool dsa = c.model.self_attention == "dsa3d";
  // Per-token timesteps (diffusion.first_frame_clean): the modulation is per token, tproj [B, N, 6, D] fp32,
  // and each block keeps its fp32 sum with the table for the backward.
  const int64_t modulated = c.diffusion.first_frame_clean > 0 ? B * N : B;
  if (modulated > B) fused.saved += modulated * 6 * D * 4;
  if (streamed) {
    d.weight_slots = d.gradient_slots = 2 * s.largest_block * e;
    d.resident_state = resident_bytes_per_param(c) * s.resident;
    d.checkpoints = streamed_checkpoints(c, L) * X;
    d.block_inputs = 2 * (modulated * 6 * D * 4 + B * Lt * D * e);  // tproj (fp32) and the text context, with grads
    d.recompute_saved = fused.saved;
    d.recompute_workspace = fused.workspace;
    if (dsa) {
      const BlockActivation ref = wan_block_activation(c, grid, e, true);
      d.recompute_saved_reference = ref.saved;
      d.recompute_workspace_reference = ref.workspace;
    }
  } else {
    d.resident_state = resident_bytes_per_param(c) * s.params;
    d.checkpoints = X;
    d.recompute_saved = L * fused.saved;
    d.recompute_workspace = fused.workspace;
    if (dsa) {
      const BlockActivation ref = wan_block_activation(c, grid, e, true);
      d.recompute_saved_reference = L * ref.saved;
      d.recompute_workspace_reference = ref.workspace;
    }
  }
  return d;
}

TokenGrid grid_of(const RunConfig& c) {
  const auto& p = patch_of(c);
  const auto shape = model_sample_shape(c);  // pixels, or the VAE's latents
  return {shape[1] / p[0], shape[2] / p[1], shape[3] / p[2]};
}

// LoRA on the device (`d` full fine-tuning's plan of the same run): no gradient slots; the adapters are
// the trained resident parameters (fp32 weight, gradient, m, v and EMA); the family's own parameters
// outside the store stay as frozen fp32 weights (the resident loop: every parameter); the shared block
// inputs take no gradient (the frozen prologue's outputs do not require one); each recomputed block keeps
// its adapters' tensors too (lora_block_saved; the resident loop: every block's of the step's part). The
// rest of the activation model is full fine-tuning's: an upper bound where frozen weights keep less (a
// Linear without an adapter no longer keeps its input, the frozen prologue keeps no graph).
void with_lora_on_device(DeviceMemoryPlan& d, const RunConfig& c, const ModelShape& s, const TokenGrid& grid,
                         const LoraShape& lora) {
  const bool streamed = c.offload.enabled;
  const int64_t e = streamed ? compute_element_bytes(c.offload.compute_dtype) : 4;
  d.gradient_slots = 0;
  // lora.base_dtype fp8: each slot's fp8 transfer buffer beside its compute-dtype weights (the blocks' scales and
  // exact vectors sit on the device from the start: a few MB, not counted).
  if (streamed && c.lora.base_dtype == "fp8") d.weight_slots += 2 * s.largest_block;
  d.resident_state = resident_bytes_per_param(c) * lora.params;
  d.frozen_resident = 4 * (streamed ? s.resident : s.params + s.text_encoder_params);
  if (streamed) d.block_inputs /= 2;
  int64_t largest_block = 0, largest_part = 0;
  for (size_t begin = 0; begin < lora.blocks.size(); begin += static_cast<size_t>(lora.blocks_per_part)) {
    int64_t part = 0;
    for (size_t l = begin; l < begin + static_cast<size_t>(lora.blocks_per_part) && l < lora.blocks.size(); ++l) {
      const int64_t block = lora_block_saved(lora.blocks[l], c, grid.numel(), e);
      largest_block = std::max(largest_block, block);
      part += block;
    }
    largest_part = std::max(largest_part, part);
  }
  d.lora_saved = streamed ? largest_block : largest_part;
  d.recompute_saved += d.lora_saved;
  if (d.recompute_saved_reference > 0) d.recompute_saved_reference += d.lora_saved;
}

// offload.activations: host (StackTrainerOptions::host_activations): the input of every block but the last goes
// D2H in each micro-batch's forward and comes back H2D ahead of its block's backward, into a page-locked host
// buffer of its own reused by every micro-batch. The device keeps the last block's input, the stack's output
// and one input in flight (saved in the forward, restored ahead in the backward): min(L + 1, 3) of the L + 1
// checkpoints (streamed_checkpoints), X = B·N·D·e bytes each.
void with_host_activations(StepPlan& p, int64_t tokens, int64_t A) {
  const int64_t L = p.layers;
  const int64_t X = p.batch_size_per_rank * tokens * p.hidden * compute_element_bytes(p.compute_dtype);
  const int64_t offloaded = L - 1;
  p.activations = "host";
  p.host.activations = offloaded * X;
  p.host.pinned += offloaded * X;
  p.transfer.activation_bytes = A * offloaded * X;
  p.transfer.h2d_bytes += p.transfer.activation_bytes;
  p.transfer.d2h_bytes += p.transfer.activation_bytes;
  p.transfer.first_step_h2d_bytes += p.transfer.activation_bytes;
  p.transfer.h2d_copies += A * offloaded;
  p.transfer.d2h_copies += A * offloaded;
}

DeviceMemoryPlan device_plan(const RunConfig& c, const ModelShape& s, const TokenGrid& grid, const LoraShape& lora) {
  DeviceMemoryPlan d = is_wan(c) ? wan_device_memory(c, s, grid) : device_memory(c, s, grid);
  if (lora.enabled()) with_lora_on_device(d, c, s, grid, lora);
  return d;
}

bool device_fits(const RunConfig& c, const ModelShape& s, const LoraShape& lora, const HardwareProfile& hw) {
  return device_plan(c, s, grid_of(c), lora).peak() <= hw.device_memory_bytes;
}

std::string gb(double bytes) { return fmt::format("{:.1f} GB", bytes / 1e9); }

// Suggestions when the run does not fit: each one a change that was checked to fit with this model.
// `config` is one rank's (its train.batch_size is the per-rank batch); a batch is advised as the global
// one, world_size times that.
// Wan2.2's two experts of `one`'s shape in one store: the high-noise expert's blocks, then the low-noise
// one's; both experts' resident parts.
ModelShape two_experts(const ModelShape& one) {
  ModelShape s = one;
  s.params *= 2;
  s.resident *= 2;
  s.streamed *= 2;
  s.block_numels.insert(s.block_numels.end(), one.block_numels.begin(), one.block_numels.end());
  for (auto spec : one.blocks) {
    spec.name = "transformer_2." + spec.name;
    s.blocks.push_back(std::move(spec));
  }
  return s;
}

std::vector<std::string> advise(const RunConfig& config, const ModelShape& s, const LoraShape& lora,
                                const StepPlan& plan, const HardwareProfile& hw) {
  const int64_t ranks = plan.world_size;
  std::vector<std::string> out;
  if (!plan.fits_device) {
    if (plan.streamed && config.offload.activations != "host") {  // the block-boundary checkpoints in host RAM
      RunConfig c = config;
      c.train.batch_size *= ranks;  // plan_step takes the global batch
      c.offload.activations = "host";
      const StepPlan moved = plan_step(c, hw, ranks);
      if (moved.fits_device)
        out.push_back(fmt::format(
            "device: activation checkpoints on the host: offload.activations=host fits ({} on the device at peak; "
            "{} of page-locked host RAM and {} each way over PCIe a step more{})",
            gb(static_cast<double>(moved.device.peak())), gb(static_cast<double>(moved.host.activations)),
            gb(static_cast<double>(moved.transfer.activation_bytes)),
            moved.fits_host ? "" : "; the host then does not fit"));
    }
    const auto& p = patch_of(config);
    RunConfig c = config;
    // The largest frame count (a multiple of the temporal patch) below the current one that fits.
    for (int64_t f = config.data.frames - p[0]; f >= p[0]; f -= p[0]) {
      c.data.frames = f;
      if (device_fits(c, s, lora, hw)) {
        out.push_back(fmt::format("device: fewer frames: data.frames={} fits ({} now)", f, config.data.frames));
        break;
      }
    }
    c = config;
    for (int64_t halvings = 1; halvings <= 6; ++halvings) {
      const int64_t h = config.data.height >> halvings, w = config.data.width >> halvings;
      const int64_t unit = c.model.vae.kind == "sd" ? c.model.vae.downscale : 1;  // pixels per latent
      if (h < p[1] * unit || w < p[2] * unit) break;
      c.data.height = h / (p[1] * unit) * (p[1] * unit);
      c.data.width = w / (p[2] * unit) * (p[2] * unit);
      if (device_fits(c, s, lora, hw)) {
        out.push_back(
            fmt::format("device: lower resolution: data.height={} data.width={} fits", c.data.height, c.data.width));
        break;
      }
    }
    if (config.train.batch_size > 1) {
      c = config;
      for (int64_t b = config.train.batch_size - 1; b >= 1; --b) {
        c.train.batch_size = b;
        if (device_fits(c, s, lora, hw)) {
          out.push_back(
              fmt::format("device: smaller batch: train.batch_size={} fits (raise train.grad_accum_steps to keep "
                          "the samples per step)",
                          b * ranks));
          break;
        }
      }
    }
    if (config.model.arch == Architecture::kDense3D) {
      c = config;
      c.model.arch = Architecture::kMegaSlide;
      if (device_fits(c, model_shape(c), lora_shape(c), hw))
        out.push_back("device: local attention: model.arch=megaslide fits");
    }
    if (is_wan(config) && config.model.self_attention == "dense") {
      c = config;
      c.model.self_attention = "dsa3d";
      if (device_fits(c, wan_model_shape(c), lora_shape(c), hw))
        out.push_back("device: the 3D-DSA retrofit: model.self_attention=dsa3d fits");
    }
    const int64_t fixed = plan.device.weight_slots + plan.device.gradient_slots + plan.device.resident_state +
                          plan.device.frozen_resident;
    if (fixed > hw.device_memory_bytes) {
      out.push_back(
          fmt::format("device: the weight and gradient slots and resident parts alone need {}: a narrower model "
                      "({}) is the only way",
                      gb(static_cast<double>(fixed)), is_wan(config) ? "model.wan.dim" : "model.hidden"));
    }
    if (out.empty()) out.push_back("device: no single change of frames, resolution or batch fits this device");
  }
  if (!plan.fits_host && plan.streamed) {
    out.push_back(fmt::format("host: more host RAM: at least {} ({} in the profile)",
                              gb(static_cast<double>(plan.host.peak())),
                              gb(static_cast<double>(hw.host_memory_bytes))));
    if (config.offload.state_tier != "nvme" && !lora.enabled()) {  // the masters and moments on the NVMe disk
      RunConfig c = config;
      c.train.batch_size *= ranks;  // plan_step takes the global batch
      c.offload.state_tier = "nvme";
      c.offload.nvme_dir = "(planned)";
      const StepPlan tiered = plan_step(c, hw, ranks);
      if (tiered.fits_host && tiered.fits_nvme)
        out.push_back(fmt::format(
            "host: the NVMe tier: offload.state_tier=nvme with offload.nvme_dir on the NVMe disk fits ({} of RAM at "
            "peak, {} on the disk; its reads and write-backs take >= {:.3g} s a step at {} GB/s{}, step >= {:.3g} s)",
            gb(static_cast<double>(tiered.host.peak())), gb(static_cast<double>(tiered.nvme_file_bytes)),
            tiered.time.nvme_s, hw.nvme_gbps, hw.nvme_gbps_assumed ? ", assumed" : "", tiered.time.lower_bound_s));
    }
    // (LoRA's store has no moments: the frozen weights alone.)
    if (config.optimizer.state_dtype != "int8" && ranks == 1 && !lora.enabled()) {  // the sharded store refuses int8
      RunConfig c = config;
      c.optimizer.state_dtype = "int8";
      const StepPlan smaller = plan_step(c, hw);
      if (smaller.fits_host)
        out.push_back(fmt::format("host: int8 AdamW moments: optimizer.state_dtype=int8 fits ({} at peak)",
                                  gb(static_cast<double>(smaller.host.peak()))));
    }
    if (is_wan(config) && config.model.wan.expert == "both") {
      // One expert at a time (as it is, else with int8 moments where one rank may keep them).
      RunConfig c = config;
      c.model.wan.expert = "high";
      StepPlan alone = plan_step(c, hw, ranks);
      std::string int8;
      if (!alone.fits_host && config.optimizer.state_dtype != "int8" && ranks == 1 && !lora.enabled()) {
        c.optimizer.state_dtype = "int8";
        alone = plan_step(c, hw, ranks);
        int8 = " optimizer.state_dtype=int8";
      }
      if (alone.fits_host)
        out.push_back(fmt::format(
            "host: one expert at a time: model.wan.expert=high{}, then a run with model.wan.expert=low, fits ({} at "
            "peak; the other expert's state is then not held)",
            int8, gb(static_cast<double>(alone.host.peak()))));
    }
    if (config.train.ema_decay > 0 && !lora.enabled()) {  // LoRA: the adapters' EMA is on the device
      RunConfig c = config;
      c.train.ema_decay = 0;
      const StepPlan without = plan_step(c, hw, ranks);
      if (without.fits_host)
        out.push_back(fmt::format(
            "host: no EMA of the weights: train.ema_decay=0 fits ({} at peak; the EMA takes 4 B a parameter)",
            gb(static_cast<double>(without.host.peak()))));
    }
    // Layers that fit at this width: host bytes grow by the same amount per block.
    const int64_t L = is_wan(config) ? config.model.wan.layers : config.model.layers;
    const double per_block = static_cast<double>(plan.host.peak()) / static_cast<double>(L);
    const int64_t layers = static_cast<int64_t>(std::floor(static_cast<double>(hw.host_memory_bytes) / per_block));
    if (layers >= 1 && layers < L)
      out.push_back(fmt::format("host: fewer blocks: {}={} fits ({} now)",
                                is_wan(config) ? "model.wan.layers" : "model.layers", layers, L));
  }
  return out;
}

// Rank 0's shard of a block of n elements split over R ranks: s = ceil(n/R) (rank r owns
// [min(n, r·s), min(n, r·s + s)); rank 0 has the largest shard).
int64_t shard_numel(int64_t n, int64_t ranks) { return (n + ranks - 1) / ranks; }

// One rank's host memory of the streamed trainer sharded over R > 1 ranks (the sharded HostParamStore):
// rank 0's shard of every block's fp32 master and AdamW m and v; the whole transfer buffer (the compute
// copy in the compute dtype, also with fp32 compute: the master is no longer the upload); the whole fp32
// gradient sums with accumulation; two exchange buffers of R·s_max elements of the exchange dtype.
// The NVMe tier's settings of `config` on a store's options.
void with_state_tier(offload::HostParamStoreOptions& options, const RunConfig& config) {
  options.state_tier = offload::parse_state_tier(config.offload.state_tier);
  options.nvme_dir = "(planned)";
  options.nvme_blocks_in_flight = config.offload.nvme_blocks_in_flight;
}

// A store's figures on the host plan: the NVMe tier's file and buffers (its other figures the caller's).
void set_nvme(HostMemoryPlan& h, StepPlan& p, const offload::MemoryReport& store) {
  h.state_on_nvme = store.state_tier == offload::StateTier::kNvme;
  h.nvme_buffers = store.nvme_buffer_bytes;
  p.nvme_file_bytes = store.nvme_bytes;
}

HostMemoryPlan sharded_host_memory(const ModelShape& s, int64_t ranks, const std::string& compute_dtype,
                                   offload::StateDtype state, int64_t accum, bool ema, const RunConfig& config,
                                   StepPlan& p) {
  // Rank 0's HostParamStore, counted by the store itself (the largest shard of every block).
  auto options = offload::host_store_options(offload::parse_compute_dtype(compute_dtype), accum, state);
  options.ema = ema;
  options.shard_rank = 0;
  options.shard_count = ranks;
  with_state_tier(options, config);
  const auto store = offload::HostParamStore::plan(s.blocks, options);
  const int64_t e = compute_element_bytes(compute_dtype);
  HostMemoryPlan h;
  const int64_t exchange_e = accum > 1 ? 4 : e;
  h.master = store.master_bytes;
  h.exp_avg = store.exp_avg_bytes;
  h.exp_avg_sq = store.exp_avg_sq_bytes;
  h.compute = store.compute_bytes;
  h.grad = store.grad_bytes;
  h.ema = store.ema_bytes;
  set_nvme(h, p, store);
  h.exchange = 2 * ranks * shard_numel(s.largest_block, ranks) * exchange_e;
  h.staging = accum > 1 ? 2 * s.largest_block * e : 0;
  h.pinned = h.compute + h.staging;  // the transfer buffer; the exchange buffers are Gloo's (pageable)
  return h;
}

// A ring's bytes sent by each rank for a reduce-scatter or an all-gather of n elements of `bytes` each:
// R − 1 chunks of ceil(n/R) elements.
int64_t ring_bytes(int64_t n, int64_t ranks, int64_t bytes) { return (ranks - 1) * shard_numel(n, ranks) * bytes; }

// A hardware profile describes a GPU with bf16 arithmetic (its peak is peak_bf16_tflops), so `auto`
// plans what it resolves to on one (train/auto_settings.h).
RunConfig with_planned_compute_dtype(RunConfig config) {
  if (config.offload.compute_dtype == "auto") config.offload.compute_dtype = "bf16";
  return config;
}

}  // namespace

StepPlan plan_step(const RunConfig& requested, const HardwareProfile& hw, int64_t world_size,
                   const std::string& source) {
  RunConfig sized = requested;
  try {  // Wan: the sizes of model.wan.weights when set, as megaslide-train reads them
    sized = with_wan_architecture_from_weights(requested);
  } catch (const WanWeightsError& e) {
    throw ConfigError(source, "model.wan.weights", e.what());
  }
  const RunConfig global = with_planned_compute_dtype(sized);
  validate(global, source, /*wan_sizes_resolved=*/true);
  const int64_t R = world_size, n = global.distributed.context_parallel;
  if (R < 1) throw ConfigError(source, "--world-size", fmt::format("is {}; expected 1 or more ranks", R));
  if (const std::string problem = context_parallel_problem(global, R); !problem.empty())
    throw ConfigError(source, "distributed.context_parallel", problem);
  const int64_t slices = R / n;  // data parallelism's
  if (global.train.batch_size % slices != 0) {
    throw ConfigError(
        source, "train.batch_size",
        fmt::format("is {}, the global batch, which must split evenly over the {} {} of --world-size: set a "
                    "multiple of {}",
                    global.train.batch_size, slices, n > 1 ? "context-parallel groups" : "ranks", slices));
  }
  if (R > 1 && global.offload.enabled && global.optimizer.state_dtype == "int8" && global.lora.rank == 0) {
    throw ConfigError(
        source, "optimizer.state_dtype",
        fmt::format("is int8, which the streamed trainer sharded over {} ranks does not keep (its shards hold "
                    "fp32 or bf16 moments): set fp32 or bf16",
                    R));
  }
  // One rank's run: its share of the global batch (the device memory and the FLOPs are one rank's).
  RunConfig config = global;
  config.train.batch_size = global.train.batch_size / slices;
  const bool wan = is_wan(config);
  // Wan2.2's two experts trained in one run (model.wan.expert both): the host holds both experts' blocks
  // and the device both experts' resident parts, but a step streams, updates and computes one expert.
  const bool both = wan && config.model.wan.expert == "both";
  const ModelShape one = shape_of(config);  // what one step streams
  const ModelShape s = both ? two_experts(one) : one;
  const LoraShape lora = lora_shape(config, source);  // no adapters: full fine-tuning
  const TokenGrid grid = grid_of(config);
  if (const std::string problem = context_parallel_problem(config, R, grid.t); !problem.empty())
    throw ConfigError(source, "distributed.context_parallel", problem);
  const TokenGrid local{(grid.t + n - 1) / n, grid.h, grid.w};  // rank 0's frames of a sample
  const bool dsa = uses_dsa3d(config.model);
  const bool dense_attention = wan ? !dsa : config.model.arch == Architecture::kDense3D;
  const auto& t = config.train;
  StepPlan p;
  p.arch = to_string(config.model.arch);
  p.streamed = config.offload.enabled;
  p.compute_dtype = p.streamed ? config.offload.compute_dtype : "fp32";
  p.state_dtype = "fp32";
  p.ema = t.ema_decay > 0;
  p.mode = config.offload.mode;
  p.layers = wan ? config.model.wan.layers : config.model.layers;
  p.hidden = wan ? config.model.wan.dim : config.model.hidden;
  p.batch_size = global.train.batch_size;
  p.world_size = R;
  p.batch_size_per_rank = t.batch_size;
  p.context_parallel = n;
  p.token_frames_per_rank = local.t;
  p.tokens_per_rank = local.numel();
  p.grad_accum_steps = t.grad_accum_steps;
  p.tokens_per_sample = grid.numel();
  p.token_grid = {grid.t, grid.h, grid.w};
  p.params = s.params;
  p.text_encoder_params = s.text_encoder_params;
  p.streamed_params = s.streamed;
  p.resident_params = s.resident;
  p.params_per_block = s.largest_block;
  p.hardware = hw;
  if (wan) {
    p.wan_expert = config.model.wan.expert;
    p.boundary_ratio = config.model.wan.boundary_ratio;
  }
  if (lora.enabled()) {
    p.lora_rank = lora.rank;
    p.lora_type = config.lora.type;
    p.lora_base_dtype = config.lora.base_dtype == "fp8" ? "fp8" : p.compute_dtype;
    p.lora_alpha = config.lora.alpha > 0 ? config.lora.alpha : static_cast<double>(lora.rank);
    p.lora_targets = config.lora.targets;
    p.lora_adapters = lora.adapters;
    p.lora_params = lora.params;
  }

  const int64_t e = compute_element_bytes(p.compute_dtype);
  const int64_t A = t.grad_accum_steps;
  const int64_t exchange_e = A > 1 ? 4 : e;  // the gradients' dtype in the exchange (sharded trainer)
  const bool ema = t.ema_decay > 0;
  if (p.streamed && lora.enabled()) {
    // LoRA: the frozen store StreamedStackTrainer allocates (frozen_blocks): the transfer buffer alone, the
    // weights in the compute dtype, page-locked; no staging (the adapters' gradients sum on the device) and,
    // over several ranks, every rank's whole copy (nothing sharded, no block exchange).
    // lora.base_dtype fp8: the weights as fp8 with their scales and exact vectors, uploaded as they are.
    auto store_options = offload::host_store_options(offload::parse_compute_dtype(p.compute_dtype), A);
    store_options.separate_grad = false;
    store_options.frozen = true;
    if (p.lora_base_dtype == "fp8") store_options.frozen_dtype = at::kFloat8_e4m3fn;
    const auto store = offload::HostParamStore::plan(s.blocks, store_options);
    p.host.compute = store.compute_bytes + store.scale_bytes + store.exact_bytes;
    p.host.pinned = store.pinnable_bytes;
    p.host.construction_peak = p.host.state() + 2 * 4 * s.largest_block;
    // fp8: 1 B per parameter uploaded (the scales and exact vectors went to the device once, at the start).
    p.transfer = replay_transfers(one.block_numels, A, p.lora_base_dtype == "fp8" ? 1 : e, /*gradients=*/false);
    if (R > 1) p.host_state_bytes_all_ranks = R * p.host.state();
  } else if (p.streamed && R > 1) {
    const auto state = offload::parse_state_dtype(config.optimizer.state_dtype);
    p.state_dtype = config.optimizer.state_dtype;
    p.host = sharded_host_memory(s, R, p.compute_dtype, state, A, ema, config, p);
    for (const int64_t n : s.block_numels) p.sharded_params_per_rank += shard_numel(n, R);
    p.host.construction_peak = p.host.state() + 2 * 4 * s.largest_block;
    // Every rank's store: the shards add up to one whole master and moments; the rest is on every rank.
    p.host_state_bytes_all_ranks = (4 + 2 * offload::state_element_bytes(state) + (ema ? 4 : 0)) * s.streamed +
                                   R * (p.host.compute + p.host.grad + p.host.exchange);
    p.transfer = replay_transfers(one.block_numels, A, e);  // every rank streams every whole block
    for (const int64_t n : one.block_numels) {
      p.exchange.wire_bytes += ring_bytes(n, R, exchange_e) + ring_bytes(n, R, e);
      p.exchange.collectives += 2;
    }
    p.exchange.payload_bytes = (exchange_e + e) * one.streamed;
  } else if (p.streamed) {
    // The HostParamStore StreamedStackTrainer allocates, counted by the store itself from the blocks'
    // real parameter lists (int8 scales are per parameter).
    const auto state = offload::parse_state_dtype(config.optimizer.state_dtype);
    auto store_options = offload::host_store_options(offload::parse_compute_dtype(p.compute_dtype), A, state);
    store_options.ema = ema;
    with_state_tier(store_options, config);
    const auto store = offload::HostParamStore::plan(s.blocks, store_options);
    set_nvme(p.host, p, store);
    p.state_dtype = config.optimizer.state_dtype;
    p.host.master = store.master_bytes;
    p.host.exp_avg = store.exp_avg_bytes;
    p.host.exp_avg_sq = store.exp_avg_sq_bytes;
    p.host.scales = store.scale_bytes;
    p.host.compute = store.compute_bytes;
    p.host.grad = store.grad_bytes;
    p.host.ema = store.ema_bytes;
    p.host.staging = A > 1 ? 2 * s.largest_block * e : 0;
    p.host.pinned = store.pinnable_bytes + p.host.staging;
    // Start-up: the store, and the fp32 initial weights of the blocks being loaded into it
    // (StackTrainerOptions::init_threads at once, 2 by default; every family alike).
    p.host.construction_peak = p.host.state() + 2 * 4 * s.largest_block;
    p.transfer = replay_transfers(one.block_numels, A, e);
  }
  p.device = device_plan(config, s, local, lora);
  if (p.streamed && config.offload.activations == "host") with_host_activations(p, local.numel(), A);
  // Context parallelism's exchanges: elements each rank sends per attention and pass (as many received).
  int64_t context_elements = 0;
  if (n > 1) {
    const int64_t B = t.batch_size, D = p.hidden, frame = grid.h * grid.w;
    // A middle rank's halos come from both sides; with 2 ranks each rank has one neighbour.
    const int64_t sides = n > 2 ? 2 : 1;
    if (dense_attention) {
      p.context_exchange = "Ulysses all-to-all";
      context_elements = 4 * B * local.numel() * D * (n - 1) / n;  // q, k, v there, the output back
    } else if (dsa) {
      p.context_exchange = "3D-DSA halo";
      const int64_t reach = static_cast<int64_t>(std::floor(config.model.dsa_offset_range[0]));
      // The offsets' full temporal range: the trainer exchanges the reach its offsets have (less early on).
      p.context_halo_frames = std::min(sides * (config.model.dsa_kernel[0] / 2 + reach + 1), grid.t - local.t);
      context_elements = 2 * p.context_halo_frames * frame * B * D;  // k and v
      if (config.model.dsa_offsets != DsaOffsets::kZero)             // the offset network's one frame each way
        context_elements += std::min<int64_t>(sides, grid.t - local.t) * frame * B * D;
    } else {
      p.context_exchange = "window halo";
      const auto w = window_layout(grid, config.model.swin_window, /*shifted=*/true).window[0];
      p.context_halo_frames = std::min(sides * (w - 1), grid.t - local.t);
      context_elements = p.context_halo_frames * frame * B * D;
    }
    // The forward, the streamed trainer's recompute and the backward (the gradients going back).
    p.context_bytes = context_elements * e * p.layers * (p.streamed ? 3 : 2) * A;
    p.device.context_buffers = 2 * context_elements * e;
  }
  if (p.streamed && wan && !wan_untrained_expert(config.model.wan).empty() && t.sample_every > 0)
    p.host.other_expert = s.streamed * e;  // the same architecture: its blocks are this one's
  if (R > 1 && (!p.streamed || lora.enabled())) {
    // The resident Trainer's average_gradients_over_ranks: one flat fp32 buffer of every gradient, all-reduced (a ring:
    // a reduce-scatter and an all-gather of it). LoRA (either trainer; the streamed one's resident all-reduce in
    // its global norm): the step's adapters' gradients, in a flat fp32 buffer on the device.
    const int64_t trained = lora.enabled() ? lora_part_params(lora) : s.params + s.text_encoder_params;
    p.device.gradient_all_reduce = 4 * trained;
    p.exchange.payload_bytes = 4 * trained;
    p.exchange.wire_bytes = 2 * ring_bytes(trained, R, 4);
    p.exchange.collectives = 1;
  }

  // Time.
  auto& tm = p.time;
  const double family_flops = wan ? wan_model_flops_per_step(config) : model_flops_per_step(config);
  // LoRA: the wrapper's flops_per_step (train/lora_model.cpp), the MFU numerator: 2/3 of the family's.
  tm.model_flops = lora.enabled() ? family_flops * 2.0 / 3.0 : family_flops;
  const double samples = static_cast<double>(t.batch_size * A);
  double dense_flops = 6.0 * static_cast<double>(s.params) * samples * static_cast<double>(grid.numel());
  if (wan) {  // the linear maps' part of wan_model_flops: the same count without attention's N·keys terms
    const double N = static_cast<double>(grid.numel()), Lt = static_cast<double>(config.data.max_text_tokens);
    double keys = N;
    if (config.model.self_attention == "dsa3d") {
      const auto& k = config.model.dsa_kernel;
      keys = static_cast<double>(std::min(k[0], grid.t) * std::min(k[1], grid.h) * std::min(k[2], grid.w));
    }
    dense_flops =
        family_flops - 12.0 * static_cast<double>(p.layers) * samples * N * (keys + Lt) * static_cast<double>(p.hidden);
  }
  const double attention_flops = family_flops - dense_flops;
  tm.executed_flops = family_flops;
  if (lora.enabled()) {
    // The frozen weights' gradients are not computed: 4 of the 6 FLOPs per weight and token (the forward
    // and the input gradient). Attention has no weights: its backward is all input gradients (dq, dk, dv),
    // executed whole. The adapters: a forward, their weights' and their inputs' gradients (2 more), and in
    // the streamed trainer the recompute's forward — the step's part's adapters (lora_forward_flops_per_sample).
    tm.lora_flops = lora_forward_flops_per_sample(lora, config, grid.numel()) * samples * (p.streamed ? 4.0 : 3.0);
    tm.executed_flops = dense_flops * 2.0 / 3.0 + attention_flops + tm.lora_flops;
  }
  if (p.streamed) {
    // Checkpointing recomputes every block's forward: 2 FLOPs per streamed weight and token, plus the
    // attention's forward third (model_flops counts attention as 4 forward + 8 backward).
    // (Wan: the cross-attention's k and v projections run over the text tokens.)
    const double cross_kv =
        wan ? 2.0 * static_cast<double>(p.hidden * p.hidden + p.hidden) * static_cast<double>(p.layers) : 0.0;
    tm.executed_flops +=
        2.0 * (static_cast<double>(one.streamed) - cross_kv) * samples * static_cast<double>(grid.numel()) +
        2.0 * cross_kv * samples * static_cast<double>(config.data.max_text_tokens) + attention_flops / 3.0;
    // CpuAdamW reads master, m, v and the gradient and writes master, m, v and the compute copy (none
    // with fp32 compute, which uploads the master); m and v in the state dtype (int8: and their group
    // scales, read and written); accumulation reads each staged micro-batch and writes (first) or reads
    // and writes (later) the fp32 sum.
    // Sharded over R > 1 ranks, AdamW runs over rank 0's shard: it reads the reduced gradient shard in
    // the exchange dtype and writes the shard of the compute copy in the compute dtype (fp32 too).
    const int64_t grad_e = A > 1 ? 4 : e;
    const int64_t state_e = offload::state_element_bytes(offload::parse_state_dtype(p.state_dtype));
    // (Two experts: the step's expert's blocks only — half of every block-wise count, the blocks being the
    // same twice — its shards and its share of the int8 scales.)
    const int64_t scales = both ? p.host.scales / 2 : p.host.scales;
    const int64_t stepped_params_per_rank = both ? p.sharded_params_per_rank / 2 : p.sharded_params_per_rank;
    tm.optimizer_bytes =
        R > 1 ? stepped_params_per_rank * (8 + 4 * state_e + grad_e + e)
              : one.streamed * (8 + 4 * state_e + grad_e + (p.compute_dtype == "fp32" ? 0 : 2)) + 2 * scales;
    if (A > 1) tm.optimizer_bytes += one.streamed * (A * e + 4 + (A - 1) * 8);
    // The EMA pass after each block's update: reads the master and the EMA, writes the EMA.
    if (ema) tm.optimizer_bytes += 12 * (R > 1 ? stepped_params_per_rank : one.streamed);
    if (lora.enabled()) tm.optimizer_bytes = 0;  // no host optimizer: the adapters update on the device
    tm.h2d_s = static_cast<double>(p.transfer.h2d_bytes) / (hw.pcie_h2d_gbps * 1e9);
    tm.d2h_s = static_cast<double>(p.transfer.d2h_bytes) / (hw.pcie_d2h_gbps * 1e9);
    tm.optimizer_s = static_cast<double>(tm.optimizer_bytes) / (hw.host_dram_gbps * 1e9);
    if (p.host.state_on_nvme) {
      // Each block the step updates: its region read before its update and written back after it (two experts:
      // the step's expert's half of the file).
      p.nvme_read_bytes = p.nvme_write_bytes = both ? p.nvme_file_bytes / 2 : p.nvme_file_bytes;
      tm.nvme_s = static_cast<double>(p.nvme_read_bytes + p.nvme_write_bytes) / (hw.nvme_gbps * 1e9);
    }
  }
  if (n > 1) {
    // Each rank computes its frames' share of every sample; 3D-DSA also attends from its halo frames' (zero)
    // queries, which the operator computes and drops.
    const double executed_attention = attention_flops * (p.streamed ? 4.0 / 3.0 : 1.0);
    tm.model_flops /= static_cast<double>(n);
    tm.executed_flops /= static_cast<double>(n);
    if (dsa)
      tm.executed_flops += executed_attention / static_cast<double>(n) * static_cast<double>(p.context_halo_frames) /
                           static_cast<double>(local.t);
    tm.context_s = static_cast<double>(p.context_bytes) / (hw.device_link_gbps * 1e9);
  }
  tm.compute_s = tm.executed_flops / (hw.peak_bf16_tflops * 1e12);
  if (R > 1) tm.exchange_s = static_cast<double>(p.exchange.wire_bytes) / (hw.network_gbps * 1e9);
  // The streamed trainer's exchange runs beside the other terms (async); the resident trainer's
  // all-reduce waits for the whole backward.
  tm.overlapped = p.streamed ? config.offload.mode == "async" : R == 1;
  // LoRA's streamed trainer over several ranks exchanges only the adapters' gradients, in its global norm after
  // the backward: async overlaps the other terms, then the all-reduce.
  tm.exchange_after = lora.enabled() && p.streamed && R > 1 && tm.overlapped;
  // The context exchange blocks the attention it feeds: it adds to the compute.
  const std::pair<const char*, double> terms[] = {
      {"compute", tm.compute_s + tm.context_s}, {"h2d", tm.h2d_s},           {"d2h", tm.d2h_s},
      {"host optimizer", tm.optimizer_s},       {"exchange", tm.exchange_s}, {"nvme", tm.nvme_s}};
  double largest = -1.0, sum = 0.0;
  for (const auto& [name, seconds] : terms) {
    sum += seconds;
    if (seconds > largest) {
      largest = seconds;
      tm.bottleneck = name;
    }
  }
  tm.lower_bound_s = tm.overlapped ? largest : sum;
  if (tm.exchange_after) {
    double others = 0.0;
    for (const auto& [name, seconds] : terms)
      if (std::string(name) != "exchange") others = std::max(others, seconds);
    tm.lower_bound_s = others + tm.exchange_s;
  }
  tm.mfu_upper_bound = tm.model_flops / (tm.lower_bound_s * hw.peak_bf16_tflops * 1e12);

  p.fits_device = p.device.peak() <= hw.device_memory_bytes;
  p.fits_host = !p.streamed || p.host.peak() <= hw.host_memory_bytes;
  p.state_tier = p.host.state_on_nvme ? "nvme" : "ram";
  p.fits_nvme = hw.nvme_bytes <= 0 || p.nvme_file_bytes <= hw.nvme_bytes;
  p.advice = advise(config, s, lora, p, hw);
  if (!p.fits_nvme)
    p.advice.push_back(fmt::format("nvme: the state file needs {} on the disk; the profile's has {}",
                                   gb(static_cast<double>(p.nvme_file_bytes)), gb(static_cast<double>(hw.nvme_bytes))));
  return p;
}

std::string to_json(const StepPlan& p) {
  nlohmann::json j;
  j["arch"] = p.arch;
  j["trainer"] = p.streamed ? "streamed" : "resident";
  j["compute_dtype"] = p.compute_dtype;
  j["mode"] = p.mode;
  j["layers"] = p.layers;
  j["hidden"] = p.hidden;
  j["batch_size"] = p.batch_size;
  j["grad_accum_steps"] = p.grad_accum_steps;
  j["tokens_per_sample"] = p.tokens_per_sample;
  j["token_grid"] = p.token_grid;
  j["params"] = p.params;
  j["text_encoder_params"] = p.text_encoder_params;
  j["streamed_params"] = p.streamed_params;
  j["resident_params"] = p.resident_params;
  j["params_per_block"] = p.params_per_block;
  j["hardware"] = {{"name", p.hardware.name},
                   {"source", p.hardware.source},
                   {"device_memory_bytes", p.hardware.device_memory_bytes},
                   {"peak_bf16_tflops", p.hardware.peak_bf16_tflops},
                   {"pcie_h2d_gbps", p.hardware.pcie_h2d_gbps},
                   {"pcie_d2h_gbps", p.hardware.pcie_d2h_gbps},
                   {"host_dram_gbps", p.hardware.host_dram_gbps},
                   {"host_memory_bytes", p.hardware.host_memory_bytes}};
  const auto& h = p.host;
  j["state_dtype"] = p.state_dtype;
  const auto per_param = [&](int64_t bytes) {
    return p.params > 0 ? static_cast<double>(bytes) / static_cast<double>(p.params) : 0.0;
  };
  if (!p.wan_expert.empty()) {
    j["wan_expert"] = p.wan_expert;
    j["boundary_ratio"] = p.boundary_ratio;
  }
  j["host_other_expert_bytes"] = h.other_expert;
  j["host_state_bytes"] = h.state();
  j["host_state_bytes_per_param"] = per_param(h.state());
  j["host_master_bytes"] = h.master;
  j["host_exp_avg_bytes"] = h.exp_avg;
  j["host_exp_avg_sq_bytes"] = h.exp_avg_sq;
  j["host_ema_bytes"] = h.ema;
  j["host_scale_bytes"] = h.scales;
  j["host_compute_bytes"] = h.compute;
  j["host_grad_bytes"] = h.grad;
  j["host_staging_bytes"] = h.staging;
  j["host_steady_bytes"] = h.steady();
  j["host_steady_bytes_per_param"] = per_param(h.steady());
  j["host_construction_peak_bytes"] = h.construction_peak;
  j["host_peak_bytes"] = h.peak();
  j["host_peak_bytes_per_param"] = per_param(h.peak());
  j["pinned_bytes"] = h.pinned;
  const auto& d = p.device;
  j["device_peak_bytes"] = d.peak();
  j["device_weight_slot_bytes"] = d.weight_slots;
  j["device_gradient_slot_bytes"] = d.gradient_slots;
  j["device_resident_state_bytes"] = d.resident_state;
  j["device_checkpoint_bytes"] = d.checkpoints;
  j["device_block_input_bytes"] = d.block_inputs;
  j["device_prologue_epilogue_bytes"] = d.prologue_epilogue;
  j["device_recompute_saved_bytes"] = d.recompute_saved;
  j["device_recompute_workspace_bytes"] = d.recompute_workspace;
  if (d.recompute_saved_reference > 0) {
    j["device_recompute_saved_reference_bytes"] = d.recompute_saved_reference;
    j["device_recompute_workspace_reference_bytes"] = d.recompute_workspace_reference;
    j["device_peak_reference_bytes"] = d.peak_reference();
  }
  j["h2d_bytes_per_step"] = p.transfer.h2d_bytes;
  j["d2h_bytes_per_step"] = p.transfer.d2h_bytes;
  j["h2d_copies_per_step"] = p.transfer.h2d_copies;
  j["d2h_copies_per_step"] = p.transfer.d2h_copies;
  j["slot_cache_hits_per_step"] = p.transfer.cache_hits;
  const auto& t = p.time;
  j["model_flops_per_step"] = t.model_flops;
  j["executed_flops_per_step"] = t.executed_flops;
  j["host_optimizer_bytes_per_step"] = t.optimizer_bytes;
  j["compute_s"] = t.compute_s;
  j["h2d_s"] = t.h2d_s;
  j["d2h_s"] = t.d2h_s;
  j["host_optimizer_s"] = t.optimizer_s;
  j["overlapped"] = t.overlapped;
  j["step_time_lower_bound_s"] = t.lower_bound_s;
  j["bottleneck"] = t.bottleneck;
  j["mfu_upper_bound"] = t.mfu_upper_bound;
  j["fits_device"] = p.fits_device;
  j["fits_host"] = p.fits_host;
  j["state_tier"] = p.state_tier;
  if (p.streamed) j["activations"] = p.activations;
  if (p.activations == "host") {
    j["host_activation_bytes"] = h.activations;
    j["activation_copy_bytes_per_step"] = p.transfer.activation_bytes;
  }
  if (p.state_tier == "nvme") {
    j["nvme_file_bytes"] = p.nvme_file_bytes;
    j["nvme_buffer_bytes"] = h.nvme_buffers;
    j["nvme_read_bytes_per_step"] = p.nvme_read_bytes;
    j["nvme_write_bytes_per_step"] = p.nvme_write_bytes;
    j["nvme_s"] = t.nvme_s;
    j["nvme_gbps"] = p.hardware.nvme_gbps;
    j["nvme_gbps_assumed"] = p.hardware.nvme_gbps_assumed;
    j["fits_nvme"] = p.fits_nvme;
  }
  j["advice"] = p.advice;
  if (p.lora_rank > 0) {  // full fine-tuning: none of these, the keys above alone
    j["lora_rank"] = p.lora_rank;
    j["lora_type"] = p.lora_type;
    j["lora_base_dtype"] = p.lora_base_dtype;
    j["lora_alpha"] = p.lora_alpha;
    j["lora_targets"] = p.lora_targets;
    j["lora_adapters"] = p.lora_adapters;
    j["lora_trained_params"] = p.lora_params;
    j["frozen_params"] = p.params + p.text_encoder_params;
    j["device_frozen_resident_bytes"] = d.frozen_resident;
    j["device_lora_saved_bytes"] = d.lora_saved;
    j["lora_flops_per_step"] = t.lora_flops;
    j["h2d_bytes_first_step"] = p.transfer.first_step_h2d_bytes;
  }
  if (p.world_size > 1) {  // one process: the keys above alone, as before data parallelism was planned
    j["world_size"] = p.world_size;
    j["batch_size_per_rank"] = p.batch_size_per_rank;
    j["hardware"]["network_gbps"] = p.hardware.network_gbps;
    j["hardware"]["network_gbps_assumed"] = p.hardware.network_gbps_assumed;
    j["host_state_bytes_per_rank"] = h.state();
    j["host_peak_bytes_per_rank"] = h.peak();
    j["device_peak_bytes_per_rank"] = d.peak();
    if (p.streamed) {
      j["sharded_params_per_rank"] = p.sharded_params_per_rank;
      j["host_exchange_bytes"] = h.exchange;
      j["host_state_bytes_all_ranks"] = p.host_state_bytes_all_ranks;
    } else {
      j["device_gradient_all_reduce_bytes"] = d.gradient_all_reduce;
    }
    j["exchange_bytes_per_step"] = p.exchange.payload_bytes;
    j["exchange_wire_bytes_per_step"] = p.exchange.wire_bytes;
    j["exchange_collectives_per_step"] = p.exchange.collectives;
    j["exchange_s"] = t.exchange_s;
    if (p.lora_rank > 0) j["exchange_after_backward"] = t.exchange_after;
  }
  if (p.context_parallel > 1) {
    j["context_parallel"] = p.context_parallel;
    j["token_frames_per_rank"] = p.token_frames_per_rank;
    j["tokens_per_rank"] = p.tokens_per_rank;
    j["context_exchange"] = p.context_exchange;
    j["context_halo_frames"] = p.context_halo_frames;
    j["context_bytes_per_step"] = p.context_bytes;
    j["context_s"] = t.context_s;
    j["device_context_buffer_bytes"] = d.context_buffers;
    j["hardware"]["device_link_gbps"] = p.hardware.device_link_gbps;
    j["hardware"]["device_link_gbps_assumed"] = p.hardware.device_link_gbps_assumed;
  }
  return j.dump();
}

std::string to_table(const StepPlan& p) {
  const double n = p.params > 0 ? static_cast<double>(p.params) : 1.0;
  std::string out = fmt::format(
      "megaslide-plan: {} ({} trainer, {} compute, {}), {} layers x {} hidden, {} params ({} streamed, {} resident; "
      "B/param below is per one of them){}\n",
      p.arch, p.streamed ? "streamed" : "resident", p.compute_dtype, p.streamed ? p.mode : "no offload", p.layers,
      p.hidden, p.params, p.streamed_params, p.resident_params - p.text_encoder_params,
      p.text_encoder_params > 0 ? fmt::format(" + {} of the trained caption encoder (resident)", p.text_encoder_params)
                                : std::string());
  out += fmt::format("  tokens/sample {} (grid {}x{}x{}), batch {} x {} micro-batch(es)\n", p.tokens_per_sample,
                     p.token_grid[0], p.token_grid[1], p.token_grid[2], p.batch_size, p.grad_accum_steps);
  const bool lora = p.lora_rank > 0;
  if (lora) {
    std::string targets;
    for (const auto& g : p.lora_targets) targets += (targets.empty() ? "" : ", ") + g;
    out += fmt::format(
        "  {} rank {}, alpha {}, targets [{}]: {} adapters on the blocks' Linear layers, {} trained parameters "
        "(fp32, on the device); the model's {} parameters frozen{}\n",
        p.lora_type == "lokr" ? "LoKr" : "LoRA", p.lora_rank, p.lora_alpha, targets, p.lora_adapters, p.lora_params,
        p.params + p.text_encoder_params,
        p.streamed ? " (its blocks streamed H2D only: no gradient copies, no host optimizer)" : "");
  }
  if (p.world_size > 1) {
    out += fmt::format("  {} over {} ranks: every figure below is one rank's (batch {} of the global {}{})\n",
                       p.world_size > std::max<int64_t>(1, p.context_parallel) ? "data parallel" : "one context group",
                       p.world_size, p.batch_size_per_rank, p.batch_size,
                       !p.streamed ? ""
                       : lora      ? "; the frozen weights not sharded: every rank holds the whole copy"
                                   : "; fp32 master and AdamW moments sharded, rank 0's shard: the largest");
  }
  if (p.context_parallel > 1)
    out += fmt::format(
        "  context parallel: groups of {} ranks share each sample (data parallel over {} groups); this rank holds {} "
        "of "
        "its {} token frames ({} tokens); {}: {} B sent per step{}\n",
        p.context_parallel, p.world_size / p.context_parallel, p.token_frames_per_rank, p.token_grid[0],
        p.tokens_per_rank, p.context_exchange, p.context_bytes,
        p.context_halo_frames > 0 ? fmt::format(" (a halo of {} frames)", p.context_halo_frames) : std::string());
  if (p.wan_expert == "both" && p.streamed)
    out += fmt::format(
        "  Wan2.2's two experts trained in one run (the step's timestep picks its expert at {} x 1000): the host "
        "holds both experts' state, a step streams and updates one ({} params each)\n",
        p.boundary_ratio, p.params / 2);
  else if (!p.wan_expert.empty() && p.streamed)
    out += fmt::format(
        "  Wan2.2's {}-noise expert (timesteps {} {} x 1000) trained alone: the other expert's state is not held; "
        "both experts' would be twice this one's host state ({:.1f} GB)\n",
        p.wan_expert, p.wan_expert == "high" ? ">=" : "<", p.boundary_ratio,
        2.0 * static_cast<double>(p.host.state()) / 1e9);
  out += fmt::format("  hardware: {} ({})\n\n", p.hardware.name, p.hardware.source);
  const auto row = [&](const std::string& name, int64_t bytes) {
    out += fmt::format("  {:<44} {:>20} {:>11.2f} GB {:>8.2f} B/param\n", name, bytes, static_cast<double>(bytes) / 1e9,
                       static_cast<double>(bytes) / n);
  };
  const bool sharded = p.streamed && p.world_size > 1;
  if (p.streamed && lora) {
    out += sharded ? "host RAM per rank                                           bytes\n"
                   : "host RAM                                                    bytes\n";
    row(p.lora_base_dtype == "fp8" ? "fp8 frozen weights and scales (transfer buffer)"
                                   : p.compute_dtype + " frozen weights (transfer buffer)",
        p.host.compute);
    row("host state (no master, moments or gradient)", p.host.state());
    row("steady total", p.host.steady());
    if (p.host.other_expert > 0) row("validation: the other expert's blocks", p.host.other_expert);
    row("start-up peak (state + 2 blocks' fp32 init)", p.host.construction_peak);
    row("of the steady total, page-locked", p.host.pinned);
    if (sharded) row(fmt::format("host state of all {} ranks", p.world_size), p.host_state_bytes_all_ranks);
    out += fmt::format("  -> {} the {:.1f} GB of host RAM{}\n\n", p.fits_host ? "fits" : "DOES NOT FIT",
                       static_cast<double>(p.hardware.host_memory_bytes) / 1e9, sharded ? " (one rank's)" : "");
  } else if (p.streamed) {
    out += sharded ? "host RAM per rank                                           bytes\n"
                   : "host RAM                                                    bytes\n";
    const std::string state = p.state_dtype;
    const bool nvme = p.host.state_on_nvme;
    const std::string shard =
        (sharded ? fmt::format(" (shard, 1/{})", p.world_size) : std::string()) + (nvme ? " [on NVMe]" : "");
    row("fp32 master" + shard, p.host.master);
    row(state + " AdamW m" + shard, p.host.exp_avg);
    row((state == "int8" ? "int8 AdamW v (codes of sqrt v)" : state + " AdamW v") + shard, p.host.exp_avg_sq);
    if (p.host.scales > 0)
      row(std::string("int8 group scales (fp32, m and v)") + (nvme ? " [on NVMe]" : ""), p.host.scales);
    if (p.host.ema > 0 && nvme) row("fp32 EMA of the weights" + shard, p.host.ema);
    if (nvme) {
      row("NVMe state file (4 KiB regions) [disk]", p.nvme_file_bytes);
      row("NVMe tier: in-flight buffers in RAM", p.host.nvme_buffers);
    }
    if (p.host.compute > 0)
      row(p.compute_dtype + (sharded || p.grad_accum_steps > 1    ? " transfer buffer (compute copy)"
                             : p.compute_dtype == "fp32" && !nvme ? " transfer buffer (gradient)"
                                                                  : " transfer buffer (copy / gradient)"),
          p.host.compute);
    if (p.host.grad > 0 && sharded) row("fp32 gradient sums (accumulation)", p.host.grad);
    if (p.host.ema > 0 && !nvme) row("fp32 EMA of the weights" + shard, p.host.ema);
    if (p.host.exchange > 0)
      row(fmt::format("exchange buffers (2 x {} ranks x largest shard)", p.world_size), p.host.exchange);
    row("host state", p.host.state());
    if (p.host.grad > 0 && !sharded) row("fp32 gradient sums (accumulation)", p.host.grad);
    if (p.host.staging > 0) row("accumulation staging (2 blocks)", p.host.staging);
    if (p.host.activations > 0) row("block inputs on the host (L - 1, pinned)", p.host.activations);
    row("steady total", p.host.steady());
    if (p.host.other_expert > 0) row("validation: the other expert's blocks", p.host.other_expert);
    row("start-up peak (state + 2 blocks' fp32 init)", p.host.construction_peak);
    row("of the steady total, page-locked", p.host.pinned);
    if (sharded) row(fmt::format("host state of all {} ranks", p.world_size), p.host_state_bytes_all_ranks);
    out += fmt::format("  -> {} the {:.1f} GB of host RAM{}\n", p.fits_host ? "fits" : "DOES NOT FIT",
                       static_cast<double>(p.hardware.host_memory_bytes) / 1e9, sharded ? " (one rank's)" : "");
    if (nvme)
      out += fmt::format("  -> the state file {} {}\n",
                         p.hardware.nvme_bytes > 0 ? (p.fits_nvme ? "fits" : "DOES NOT FIT") : "needs",
                         p.hardware.nvme_bytes > 0
                             ? fmt::format("the {:.1f} GB NVMe disk", static_cast<double>(p.hardware.nvme_bytes) / 1e9)
                             : fmt::format("{:.1f} GB on the NVMe disk (the profile gives no "
                                           "nvme_bytes)",
                                           static_cast<double>(p.nvme_file_bytes) / 1e9));
    out += "\n";
  }
  out += "device memory                                               bytes\n";
  const auto& d = p.device;
  if (lora) {
    if (p.streamed) {
      row("weight slots (2 blocks)", d.weight_slots);
      row("gradient slots: none (frozen blocks)", d.gradient_slots);
    }
    row(p.ema ? "LoRA adapters: weights, grad, AdamW m, v, EMA (fp32)"
              : "LoRA adapters: weights, grad, AdamW m, v (fp32)",
        d.resident_state);
    row(p.streamed ? "frozen resident parts (fp32 weights)" : "every parameter, frozen (fp32 weights)",
        d.frozen_resident);
    if (p.streamed) {
      row(p.activations == "host" ? "checkpoints: 3 of L + 1 (host activations)" : "block-boundary checkpoints (L + 1)",
          d.checkpoints);
      row("shared block inputs (no grads: frozen)", d.block_inputs);
    } else {
      row("first block's input", d.checkpoints);
    }
  } else if (p.streamed) {
    row("weight slots (2 blocks)", d.weight_slots);
    row("gradient slots (2 blocks)", d.gradient_slots);
    row(p.ema ? "resident parts: weights, grad, AdamW m, v, EMA" : "resident parts: weights, grad, AdamW m, v",
        d.resident_state);
    row(p.activations == "host" ? "checkpoints: 3 of L + 1 (host activations)" : "block-boundary checkpoints (L + 1)",
        d.checkpoints);
    row("shared block inputs and their grads", d.block_inputs);
  } else {
    row(p.ema ? "all parameters: weights, grad, AdamW m, v, EMA (fp32)"
              : "all parameters: weights, grad, AdamW m, v (fp32)",
        d.resident_state);
    row("first block's input", d.checkpoints);
  }
  row("prologue/epilogue activations (fp32)", d.prologue_epilogue);
  row(p.streamed ? "recompute one block: saved for backward" : "every block's graph", d.recompute_saved);
  if (lora) row("  of which the LoRA adapters'", d.lora_saved);
  row("one block's backward: workspace", d.recompute_workspace);
  if (d.gradient_all_reduce > 0)
    row(lora ? "all-reduce buffer (the adapters' gradients, fp32)" : "all-reduce buffer (every gradient, fp32)",
        d.gradient_all_reduce);
  row("peak", d.peak());
  if (d.recompute_saved_reference > 0) row("  peak with the grid_sample 3D-DSA reference", d.peak_reference());
  out += fmt::format("  -> {} the {:.1f} GB of device memory\n\n", p.fits_device ? "fits" : "DOES NOT FIT",
                     static_cast<double>(p.hardware.device_memory_bytes) / 1e9);
  const auto& t = p.time;
  if (p.streamed) {
    out += fmt::format("PCIe per step: H2D {} B ({} copies, {} slot cache hits), D2H {} B ({} copies)\n",
                       p.transfer.h2d_bytes, p.transfer.h2d_copies, p.transfer.cache_hits, p.transfer.d2h_bytes,
                       p.transfer.d2h_copies);
    if (p.transfer.activation_bytes > 0)
      out += fmt::format("  (of them {} B each way are block inputs: offload.activations host)\n",
                         p.transfer.activation_bytes);
    if (lora)
      out += fmt::format(
          "  (frozen blocks: a step finds the two blocks the previous one ended with still in the slots; the first "
          "step uploads {} B)\n",
          p.transfer.first_step_h2d_bytes);
  }
  if (p.world_size > 1) {
    out += fmt::format("exchange per step per rank: {}; {} B, on the wire {} B each way (ring), {} collectives\n",
                       lora ? "all-reduce of the step's LoRA adapters' gradients (fp32)"
                       : p.streamed
                           ? "reduce-scatter of every block's gradient, all-gather of every compute copy (Gloo, host)"
                           : "all-reduce of every gradient (fp32)",
                       p.exchange.payload_bytes, p.exchange.wire_bytes, p.exchange.collectives);
  }
  if (lora)
    out += fmt::format(
        "model FLOPs per step {:.4g} (LoRA: 2/3 of full fine-tuning's; executed{}, the attention's whole backward "
        "and the adapters' {:.4g}: {:.4g}){}\n",
        t.model_flops, p.streamed ? " with recompute" : "", t.lora_flops, t.executed_flops,
        p.world_size > 1 ? " per rank" : "");
  else
    out += fmt::format("model FLOPs per step {:.4g} (executed with recompute: {:.4g}){}\n", t.model_flops,
                       t.executed_flops, p.world_size > 1 ? " per rank" : "");
  out += "lower bound on step time:\n";
  out += fmt::format("  compute         {:>10.4g} s  ({:.4g} FLOP / {} TFLOP/s)\n", t.compute_s, t.executed_flops,
                     p.hardware.peak_bf16_tflops);
  if (p.streamed) {
    out += fmt::format("  H2D             {:>10.4g} s  ({} GB/s)\n", t.h2d_s, p.hardware.pcie_h2d_gbps);
    out += fmt::format("  D2H             {:>10.4g} s  ({} GB/s)\n", t.d2h_s, p.hardware.pcie_d2h_gbps);
    if (lora)
      out +=
          fmt::format("  host optimizer  {:>10.4g} s  (none: the adapters are updated on the device)\n", t.optimizer_s);
    else
      out += fmt::format("  host optimizer  {:>10.4g} s  ({} B of host memory traffic / {} GB/s)\n", t.optimizer_s,
                         t.optimizer_bytes, p.hardware.host_dram_gbps);
    if (p.host.state_on_nvme)
      out += fmt::format("  NVMe            {:>10.4g} s  ({} B read + {} B written back / {} GB/s{})\n", t.nvme_s,
                         p.nvme_read_bytes, p.nvme_write_bytes, p.hardware.nvme_gbps,
                         p.hardware.nvme_gbps_assumed ? ", assumed: the profile gives no nvme_gbps" : "");
  }
  if (p.context_parallel > 1)
    out += fmt::format(
        "  + context       {:>10.4g} s  ({} B each way / {} GB/s between the GPUs{}; in the compute term)\n",
        t.context_s, p.context_bytes, p.hardware.device_link_gbps,
        p.hardware.device_link_gbps_assumed ? ", assumed: the profile has no device_link_gbps" : "");
  if (p.world_size > 1) {
    out += fmt::format("  exchange        {:>10.4g} s  ({} B on the wire / {} GB/s network{})\n", t.exchange_s,
                       p.exchange.wire_bytes, p.hardware.network_gbps,
                       p.hardware.network_gbps_assumed ? ", assumed: the profile has no network_gbps" : "");
  }
  const char* combined = t.exchange_after ? "the largest of the other terms, then the adapters' all-reduce"
                         : t.overlapped   ? "the largest of the terms"
                         : p.streamed     ? "the sum, sync mode of the terms"
                                          : "the sum of the terms: the all-reduce follows the backward";
  out += fmt::format("  step >= {:.4g} s ({}), bottleneck: {}; MFU <= {:.1f} %\n", t.lower_bound_s, combined,
                     t.bottleneck, 100.0 * t.mfu_upper_bound);
  if (!p.advice.empty()) {
    out += "\nto make it fit:\n";
    for (const auto& a : p.advice) out += "  - " + a + "\n";
  }
  return out;
}

int64_t lora_trained_parameters(const RunConfig& config, const std::string& source) {
  try {  // Wan: the sizes of model.wan.weights when set, as plan_step reads them
    return lora_shape(with_wan_architecture_from_weights(config), source).params;
  } catch (const WanWeightsError& e) {
    throw ConfigError(source, "model.wan.weights", e.what());
  }
}

}  // namespace megaslide::plan
