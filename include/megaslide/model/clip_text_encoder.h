// CLIP's text transformer (the text half of CLIP ViT-L/14, which Stable Diffusion 1.x and the paper
// condition on), computing what transformers' CLIPTextModel computes, loaded from the folders people
// download:
//   - openai/clip-vit-large-patch14: config.json (a CLIPConfig: its "text_config" is used) and
//     model.safetensors (the whole CLIPModel: only its text_model.* tensors are read);
//   - a text-only folder (a Stable Diffusion checkpoint's text_encoder/): config.json (a CLIPTextConfig)
//     and model.safetensors with text_model.* names, or with no prefix as transformers 5 saves them.
// Sizes come from config.json (missing keys take CLIPTextConfig's defaults); every tensor must be present
// with the shape the config implies (other tensors are ignored).
//
// Forward, for ids [B, L] (L <= max_position_embeddings):
//   h = token_embedding[ids] + position_embedding[0..L)
//   per layer: h += out_proj(causal self-attention(layer_norm1(h)));  h += fc2(act(fc1(layer_norm2(h))))
//   last_hidden_state = final_layer_norm(h)                                       [B, L, hidden]
//   pooled = last_hidden_state at the end-of-text token: the first position of eos_token_id, or, for
//            configs with the legacy eos_token_id 2, the position of the largest id  [B, hidden]
// act is config.hidden_act: quick_gelu (x·sigmoid(1.702x), CLIP's), gelu (erf) or gelu_new (tanh).
// No padding mask: every position attends causally to the positions before it, as Stable Diffusion calls
// the model (so the outputs at real tokens do not depend on the padding).
//
// Frozen: no gradients, eval only. Weights live on `device` in `dtype` (fp32, or bf16/fp16 on a GPU);
// the output is float32. Errors: ClipTextEncoderError (io::PretrainedError) naming the folder, the file,
// the tensor and what was expected. Thread-safety: forward may be called from one thread at a time.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <string>

#include "megaslide/io/files.h"

namespace megaslide {

struct ClipTextConfig {
  int64_t vocab_size = 49408;
  int64_t hidden_size = 512;
  int64_t intermediate_size = 2048;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 8;
  int64_t max_position_embeddings = 77;
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;
  int64_t eos_token_id = 49407;
};

struct ClipTextOutput {
  torch::Tensor last_hidden_state;  // [B, L, hidden] float32
  torch::Tensor pooled;             // [B, hidden] float32
};

class ClipTextEncoder {
 public:
  // Reads DIR/config.json and DIR/model.safetensors (see above).
  // `fp8`: the layers' matrices kept as float8_e4m3fn with a per-tensor scale (model.text_encoder.dtype: fp8),
  // each dequantized into `dtype` when its layer runs: the output is the encoder's on those dequantized values.
  static ClipTextEncoder load(const std::string& dir, torch::Device device = torch::kCPU,
                              torch::ScalarType dtype = torch::kFloat32, bool fp8 = false);
  // The architecture of `config` with random weights: for benchmarks without the download.
  static ClipTextEncoder random(const ClipTextConfig& config, uint64_t seed = 0, torch::Device device = torch::kCPU,
                                torch::ScalarType dtype = torch::kFloat32);

  ClipTextOutput forward(const torch::Tensor& ids) const;  // ids [B, L] int64, any device

  const ClipTextConfig& config() const { return config_; }
  torch::Device device() const { return device_; }
  int64_t parameter_count() const;
  bool fp8() const { return fp8_; }
  int64_t weight_bytes() const;  // the weights' bytes as kept (fp8 matrices: 1 B an element, and their scales)

 private:
  using WeightSource =
      std::function<torch::Tensor(const std::string&, const std::vector<int64_t>&)>;  // (name, shape) -> CPU tensor
  static ClipTextEncoder build(const ClipTextConfig& config, torch::Device device, torch::ScalarType dtype,
                               const WeightSource& source, bool fp8 = false);

  ClipTextConfig config_;
  torch::Device device_ = torch::kCPU;
  torch::ScalarType dtype_ = torch::kFloat32;
  bool fp8_ = false;
  std::map<std::string, torch::Tensor> w_;      // transformers' names without the text_model. prefix
  std::map<std::string, torch::Tensor> scale_;  // fp8: the layers' matrices' scales
};

}  // namespace megaslide
