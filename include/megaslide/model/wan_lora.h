// LoRA and LoKr adapters of a Wan DiT in the files users exchange, read, written and merged into the weights
// (model/lora.h: the adapters' formulas):
//
//   diffusers / PEFT   "transformer.blocks.0.attn1.to_q.lora_A.weight" [r, in], "...lora_B.weight" [out, r];
//                      the adapter config (r, lora_alpha, alpha_pattern, use_rslora) in the metadata
//                      "lora_adapter_metadata", keys prefixed "transformer." (WanPipeline.save_lora_weights);
//                      without it alpha = r (scale 1), as diffusers reads such files. LoKr: "....lokr_w1",
//                      "....lokr_w2" (or lokr_w2_a / lokr_w2_b, lokr_w1_a / lokr_w1_b), PEFT's LoKrConfig (r,
//                      alpha, rank_pattern, alpha_pattern; peft_type LOKR) in the same metadata; without it scale 1
//   ComfyUI            "diffusion_model.blocks.0.self_attn.q.lora_down.weight" / "lora_up.weight" (or
//                      lora_A / lora_B) with an optional scalar "....alpha": Wan's original names
//   musubi-tuner       "lora_unet_blocks_0_self_attn_q.lora_down.weight" / "lora_up.weight" / ".alpha": the
//                      original name with '.' as '_'
//
// LoKr in the ComfyUI and musubi layouts has LyCORIS' names ("....lokr_w1", "....lokr_w2_a", ...) and scale: alpha
// over the rank of the decomposed factor (w2_b's rows, else w1_b's), or 1 when W1 and W2 are both whole (the writer
// then folds the scale into w1).
//
// An adapter is keyed by the base weight it changes, in diffusers' naming ("blocks.0.attn1.to_q.weight");
// its update is ΔW = (alpha / r) · up · down (alpha / sqrt(r) for rsLoRA; LoKr's kron(W1, W2)), times the
// caller's scale. A file is read whole (LoRAs are small); every name must belong to a weight of the model
// (`weight_names`), every adapter must have all its parts of matching shapes; DoRA, LoRA biases and LoKr's
// Tucker cores (lokr_t2, convolutions') are refused by name. Errors: WanLoraError naming the file and the
// tensor. Thread-safety: plain functions.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/lora.h"
#include "megaslide/util/errors.h"

namespace megaslide {

class WanLoraError : public io::IoError, public InputError {
 public:
  using io::IoError::IoError;
};

enum class LoraLayout { kDiffusers, kComfyUi, kMusubi };
const char* to_string(LoraLayout layout);
// "diffusers" | "comfyui" | "musubi"; throws std::invalid_argument naming the choices.
LoraLayout parse_lora_layout(const std::string& name);

struct WanLora {
  std::map<std::string, LoraAdapter> adapters;  // base weight's diffusers name -> adapter
  LoraLayout layout = LoraLayout::kDiffusers;   // the file's, when read
  std::string source;
  // Wan2.2: the expert whose DiT the adapters belong to, "high" or "low" (the file's "expert" metadata,
  // "high_noise" / "low_noise" as Wan2.2's exported weights say it); "" when the file does not say.
  std::string expert;
  // Writing diffusers' layout: the model's Linear modules inside its blocks ("blocks.0.attn1.to_q"), with which
  // the metadata's target_modules name exactly the adapted ones (PEFT adapts every module a target ends); empty:
  // each adapted module's name inside its attention ("to_q"), as diffusers' scripts write it.
  std::vector<std::string> block_linears;
};

// Reads any of the three layouts (detected by the names). `weight_names`: the model's parameter names
// (diffusers'), which the original names map onto (musubi's underscores are resolved against them).
WanLora read_wan_lora(const std::string& path, const std::vector<std::string>& weight_names);
// Writes `lora` in `layout` (float32 tensors; alpha stored: the diffusers metadata, or ".alpha" scalars).
// Atomic. The musubi and ComfyUI layouts need the original names (every target must have one).
// `group` given: finished into it, replaced when the group is published (io::FileGroup).
io::WrittenFile save_wan_lora(const std::string& path, const WanLora& lora, LoraLayout layout,
                              io::FileGroup* group = nullptr);
// W += scale · ΔW, in the weight's dtype and device (ΔW computed in float32), for every adapter whose weight is
// `prefix` + a parameter name of `module` (a whole WanTransformer with prefix "", or block N with "blocks.N.");
// meta parameters (blocks read on demand) are left for their block's call. Returns how many were merged.
// Throws WanLoraError for an adapter under `prefix` whose weight the module lacks or whose shape differs.
int64_t merge_wan_lora(torch::nn::Module& module, const WanLora& lora, double scale = 1.0,
                       const std::string& prefix = "");

}  // namespace megaslide
