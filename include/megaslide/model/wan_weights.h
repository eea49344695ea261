// The published Wan2.1 DiT weights, read tensor by tensor: one name table for the layouts people
// download, memory-mapped safetensors, conversion to the dtype the caller asks for.
//
// Layouts (`WanWeights::open(path)`):
//   - diffusers: a folder (a repository's `transformer/`, or the repository itself, which has one) with
//     config.json (WanTransformer3DModel's) and diffusion_pytorch_model.safetensors, or its shards
//     diffusion_pytorch_model-0000i-of-0000n.safetensors with diffusion_pytorch_model.safetensors.index.json;
//   - Wan-AI's original repositories: the same file names with Wan's own config.json (WanModel's keys:
//     dim, num_heads, in_dim, ...) and the original tensor names (blocks.N.self_attn.q.weight, ...);
//   - ComfyUI's single file (e.g. wan2.1_t2v_1.3B_bf16.safetensors): original names, optionally prefixed
//     model.diffusion_model., no config.json: the hyper-parameters come from the tensor shapes (all but the
//     number of heads, which the caller supplies: model.wan.heads; Wan2.1's heads are 128 wide).
// Tensor names are detected, not assumed from the layout: either naming may sit in either container.
// Every name is exposed in diffusers' naming (the names WanTransformer registers); the original names map
// one to one: time_embedding.{0,2} -> condition_embedder.time_embedder.linear_{1,2}, text_embedding.{0,2}
// -> condition_embedder.text_embedder.linear_{1,2}, time_projection.1 -> condition_embedder.time_proj,
// self_attn/cross_attn -> attn1/attn2, {q,k,v,o} -> {to_q,to_k,to_v,to_out.0}, ffn.{0,2} ->
// ffn.net.{0.proj,2}, modulation -> scale_shift_table, head.head -> proj_out, head.modulation ->
// scale_shift_table, and the cross-attention LayerNorm norm3 -> norm2 (the two names swap).
//
// Files are memory-mapped; read() converts one tensor (bf16, fp16, fp32 or fp8 in the file) into a fresh
// CPU tensor of the asked dtype, so a loader that fills a host store block by block never holds more than
// one tensor's copy beside the mapping (the page cache is the kernel's to drop).
// fp8 files (io/fp8.h), in any of the layouts: any tensor may be F8_E4M3 (or F8_E5M2); read() returns
// it dequantized, data.to(float32) × scale cast to the asked dtype. ComfyUI's *_fp8_e4m3fn files hold
// plain casts (scale 1): the linear weights fp8, the rest bf16/fp32. Its *_fp8_scaled files give each
// fp8 linear weight <layer>.weight a per-tensor scale <layer>.scale_weight (one F32 value; BF16 from some
// other tools), may give it an activation scale <layer>.scale_input, and carry a marker tensor
// scaled_fp8 (with or without the prefix) whose dtype names the weights' format; ComfyUI's current format
// names the scale <layer>.weight_scale (and <layer>.input_scale) and describes each quantized layer in
// <layer>.comfy_quant (U8 bytes of JSON; "format": "float8_e4m3fn" is read, other formats — nvfp4, mxfp8,
// int8 — are refused naming the layer). These quantization tensors are not parameters: names(),
// has(), shape() and check() see the weights alone (shapes and all); a scale whose weight is missing or not
// fp8, or that is not one value (per-row, per-block), is refused. is_fp8() and read_fp8() give the stored
// fp8 data and its scale as they are, for a base kept in fp8.
// Not read: PyTorch pickles (.pth, .pt, .bin, .ckpt), which can run code when loaded — the error says
// to use the .safetensors files Wan's repositories ship; VACE and first-last-frame weights: check() names
// their extra tensors (vace_blocks.*, img_emb.emb_pos) as not in the model, and architecture() refuses a
// diffusers config.json with pos_embed_seq_len. Image-to-video weights are read (Wan2.1 I2V's image
// branch: img_emb.proj.*, cross_attn.{k_img,v_img,norm_k_img}; Wan2.2 I2V's 36 input channels).
//
// Errors: WanWeightsError naming the path, the file and the tensor. Thread-safety: read() and read_fp8()
// may be called from several threads at once; open() returns an object that owns its mappings.
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/fp8.h"
#include "megaslide/util/errors.h"

namespace megaslide {

class WanTransformerImpl;

class WanWeightsError : public io::IoError, public InputError {
 public:
  using io::IoError::IoError;
};

enum class WanNaming { kDiffusers, kOriginal };
const char* to_string(WanNaming naming);

// The original (Wan-AI / ComfyUI) name of a diffusers-named parameter, and back ("" when a name has no
// counterpart).
std::string wan_original_name(const std::string& diffusers_name);
std::string wan_diffusers_name(const std::string& original_name);

class WanWeights {
 public:
  static WanWeights open(const std::string& path);
  WanWeights(WanWeights&&) noexcept;
  WanWeights& operator=(WanWeights&&) noexcept;
  ~WanWeights();

  const std::string& path() const;
  WanNaming naming() const;
  const std::vector<std::string>& files() const;  // the safetensors files read
  // The config.json used ("" when none: hyper-parameters from the shapes).
  const std::string& config_path() const;
  // model.wan as the weights describe it; `fallback` supplies what they cannot say (heads and eps
  // without a config.json) and keeps its `weights` path.
  WanConfig architecture(const WanConfig& fallback) const;

  std::vector<std::string> names() const;  // diffusers' names, sorted
  bool has(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  // The tensor `name` (diffusers' naming) as `dtype` on the CPU (an fp8 tensor dequantized:
  // dequantize_fp8(read_fp8(name), dtype)).
  torch::Tensor read(const std::string& name, torch::ScalarType dtype = torch::kFloat32) const;
  // Whether the file holds `name` as fp8 (F8_E4M3 or F8_E5M2), and that fp8 tensor as it is stored: a CPU
  // copy of the data and its float32 scale (1 when the file has none). read_fp8 throws WanWeightsError for
  // a tensor that is not fp8, and, like read(), for one holding a NaN or an infinity (data or scale).
  bool is_fp8(const std::string& name) const;
  Fp8Tensor read_fp8(const std::string& name) const;

  // Checks that the weights hold exactly `expected` (diffusers' names and shapes): every name present
  // with its shape and a floating dtype, except those matching one of `allow_missing` (globs, `*` any
  // run of characters), and nothing else. One WanWeightsError lists every problem. Returns the names that
  // were allowed to be missing and are.
  std::vector<std::string> check(const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected,
                                 const std::vector<std::string>& allow_missing = {}) const;

  struct Impl;

 private:
  explicit WanWeights(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Copies the weights into `model` (any device; each tensor read, converted and copied in turn) after
// check(); returns the parameters left at their initialisation (allowed missing).
std::vector<std::string> load_wan_weights(const WanWeights& weights, WanTransformerImpl& model,
                                          const std::vector<std::string>& allow_missing = {});

// The parameters a dense Wan checkpoint lacks when the model uses the 3D-DSA retrofit.
std::vector<std::string> wan_dsa_parameter_globs();

// diffusers' config.json of WanTransformer3DModel for `wan` (what architecture() reads back).
std::string wan_diffusers_config(const WanConfig& wan);

// Writes a trained Wan's weights as one safetensors file in diffusers' layout: `parameters` under
// diffusers' names (as the Trainer names them: "blocks.0.attn1.to_q.weight"), each cast to `dtype` as it
// is written (one tensor's copy at a time), with wan_diffusers_config in the metadata ("format":
// "megaslide.wan_weights", "config"), from which WanWeights::open(path) reads the architecture. When
// `path` is named diffusion_pytorch_model.safetensors, the config is also written as config.json beside
// it: the folder is then diffusers' transformer/ folder (WanTransformer3DModel.from_pretrained reads
// it; the 3D-DSA retrofit's extra tensors are not diffusers'). Atomic per file; errors are io::IoError.
// Wan2.2's two experts trained in one run (wan.expert both: `parameters` named "transformer.<name>" for
// the high-noise expert, "transformer_2.<name>" for the low-noise one): `path` is a folder, written as
// diffusers' repository holds them — transformer/ and transformer_2/ (each diffusion_pytorch_model.safetensors
// and config.json) and a model_index.json naming them with boundary_ratio, so that model.wan.weights
// reads the folder as two experts (the VAE, text encoder, tokenizer and scheduler are the base
// repository's: copy their folders beside these for diffusers' WanPipeline). Returns the low-noise file's.
// Every file written (weights, config.json, model_index.json) replaces its old one only once all are written
// (io::FileGroup: into `group` when given, published by its owner; else published before returning).
io::WrittenFile save_wan_weights(const std::string& path, const WanConfig& wan, const io::NamedTensors& parameters,
                                 torch::ScalarType dtype = torch::kBFloat16, io::FileGroup* group = nullptr);

// How a trained Wan's weights are exported (megaslide-train --export-layout): diffusers' layout
// (save_wan_weights), or ComfyUI's single file (save_wan_comfyui_weights) with its tensor names under
// model.diffusion_model. — as Comfy-Org's repackaged files (wan2.1_t2v_14B_bf16.safetensors, ...) and
// ComfyUI's own Save Model node have them — or bare (as Wan-AI's and Kijai's files). ComfyUI's Load
// Diffusion Model node reads both forms.
enum class WanWeightsLayout { kDiffusers, kComfyUI, kComfyUIUnprefixed };
const char* to_string(WanWeightsLayout layout);  // "diffusers", "comfyui", "comfyui-unprefixed"

// The files save_wan_comfyui_weights writes for `path`: `path` itself for one DiT; for Wan2.2's two experts
// (wan.expert both) two files named as ComfyUI's users know them, "_high_noise" and "_low_noise" put before
// `path`'s .safetensors (appended with it when `path` has none): w.safetensors -> w_high_noise.safetensors,
// w_low_noise.safetensors.
std::vector<std::string> wan_comfyui_files(const std::string& path, const WanConfig& wan);

// Writes a trained Wan's weights as ComfyUI's single file (model/diffusion_models/ of ComfyUI): `parameters`
// (diffusers' names, as for save_wan_weights) under Wan's original names (wan_original_name; the
// image-to-video branch's img_emb.proj.*, cross_attn.k_img/v_img/norm_k_img), prefixed model.diffusion_model.
// unless `diffusion_model_prefix` is false, each cast to `dtype` as it is written. The metadata, which ComfyUI
// does not read for Wan, holds what save_wan_weights' does ("format", "config": diffusers' config, from which
// WanWeights::open reads the architecture, heads included) and, for an expert, "expert" (high_noise,
// low_noise) and "boundary_ratio". Two experts (wan.expert both; parameters named transformer.* and
// transformer_2.*): the two files of wan_comfyui_files, the high-noise expert's first. Every parameter must
// be one of Wan's published DiT — else a WanWeightsError naming them before anything is written (the
// 3D-DSA retrofit's offset networks: ComfyUI could not load them; diffusers' layout keeps them). The two
// experts' files replace the old ones together, once both are written; other errors are io::IoError. Returns
// the files written.
std::vector<std::string> save_wan_comfyui_weights(const std::string& path, const WanConfig& wan,
                                                  const io::NamedTensors& parameters,
                                                  bool diffusion_model_prefix = true,
                                                  torch::ScalarType dtype = torch::kBFloat16);

// What ComfyUI would take differently from `wan` when it loads the file: comfy/model_detection.py reads the
// sizes from the shapes but fixes the rest as Wan2.1/2.2 have them (heads dim / 128, patch [1, 2, 2],
// freq_dim 256, text_dim 4096, q/k RMSNorm, the cross-attention LayerNorm, eps 1e-6, CLIP's 1280-wide image
// tokens). One sentence each; empty for every published Wan.
std::vector<std::string> wan_comfyui_differences(const WanConfig& wan);

// Wan2.2's two experts (T2V-A14B, I2V-A14B): two DiTs of one architecture, the high-noise expert for
// timesteps t >= boundary_ratio x 1000 and the low-noise one below. Where a path has them: diffusers'
// repository (model_index.json listing transformer_2, with its boundary_ratio; transformer/ is the
// high-noise expert), Wan-AI's (high_noise_model/, low_noise_model/; the boundary is its config's, not in
// the folder: default_wan_boundary_ratio). `low` empty: the path is one DiT (`high` is the path). ComfyUI's
// two files are named one by one (model.wan.weights, model.wan.weights_2). Throws WanWeightsError for a
// model_index.json that is not JSON or lists transformer_2 without a boundary_ratio in (0, 1).
struct WanExperts {
  std::string high, low;
  double boundary_ratio = 0.0;  // the repository's; 0 when it does not say
};
WanExperts find_wan_experts(const std::string& path);
// Wan-AI's boundaries (wan/configs): 0.875 for text-to-video, 0.9 for image-to-video (36 input channels).
double default_wan_boundary_ratio(const WanConfig& wan);

// `config` with model.wan taken from model.wan.weights when set (unchanged otherwise): its architecture and,
// with two experts, model.wan.weights_2 (found in the repository unless given; the same architecture, else
// WanWeightsError naming the first key that differs) and model.wan.boundary_ratio (the repository's or
// Wan-AI's unless given). One DiT with model.wan.expert set is one expert's own file: the boundary is the
// one given, or Wan-AI's. ConfigError for a boundary_ratio given to one DiT without model.wan.expert, or
// a diffusion.guidance_scale_2 given to one DiT.
RunConfig with_wan_architecture_from_weights(const RunConfig& config);

// The weights a run of `wan` (resolved as above) fine-tunes: model.wan.weights_2 for expert low with two
// experts, else model.wan.weights (expert both: the high-noise one's; the low-noise one's is weights_2).
// And the expert it does not train (it samples with the trained one): the other of the two, "" without
// two experts, without model.wan.expert or with expert both.
const std::string& wan_trained_weights(const WanConfig& wan);
std::string wan_untrained_expert(const WanConfig& wan);

}  // namespace megaslide
