// CLIP's transformer layers (transformers' CLIPEncoderLayer), shared by its text tower
// (clip_text_encoder.cpp, causal) and its vision tower (clip_vision_encoder.cpp): pre-LayerNorm
// self-attention and MLP, each added to the residual stream. Internal to the library.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/pretrained.h"
#include "megaslide/io/fp8.h"

namespace megaslide::clip {

// The tower's prefix in a folder's weights: `tower` ("text_model." / "vision_model.": a whole CLIPModel, or
// transformers 4's single tower) where `probe` is found under it or nowhere, else "" (transformers 5 saves a
// tower alone without it).
inline std::string tower_prefix(const io::PretrainedFolder& folder, const std::string& tower,
                                const std::string& probe) {
  return folder.has(tower + probe) || !folder.has(probe) ? tower : "";
}

// The towers' fp8 storage (model.text_encoder.dtype / model.image_encoder.dtype: fp8): the layers' matrices
// (encoder.layers.N.self_attn.*_proj.weight, mlp.fc1/fc2.weight) kept as float8_e4m3fn with one fp32 scale each
// (quantize_fp8 kPerTensor), everything else as given. keep() stores `t` under `name` so; stored() gives it back
// in `dtype`, an fp8 matrix dequantized.
inline bool fp8_matrix(const std::string& name) {
  const std::string weight = ".weight";
  return name.rfind("encoder.layers.", 0) == 0 && name.find("layer_norm") == std::string::npos &&
         name.size() > weight.size() && name.compare(name.size() - weight.size(), weight.size(), weight) == 0;
}
inline void keep(std::map<std::string, at::Tensor>& w, std::map<std::string, at::Tensor>& scales,
                 const std::string& name, const at::Tensor& t, bool fp8, at::Device device) {
  if (!fp8 || !fp8_matrix(name)) {
    w[name] = t.to(device);
    return;
  }
  const auto q = quantize_fp8(t.to(at::kFloat), Fp8Scaling::kPerTensor);
  w[name] = q.data.to(device);
  scales[name] = q.scale.to(device);
}
inline at::Tensor stored(const std::map<std::string, at::Tensor>& w, const std::map<std::string, at::Tensor>& scales,
                         const std::string& name, at::ScalarType dtype) {
  const auto& t = w.at(name);
  return is_fp8(t.scalar_type()) ? dequantize_fp8({t, scales.at(name)}, dtype) : t;
}
// The bytes of the weights `w` and `scales` hold.
inline int64_t stored_bytes(const std::map<std::string, at::Tensor>& w,
                            const std::map<std::string, at::Tensor>& scales) {
  int64_t n = 0;
  for (const auto* m : {&w, &scales})
    for (const auto& [name, t] : *m) n += static_cast<int64_t>(t.nbytes());
  return n;
}

// Refuses weights with a layer past config.json's num_hidden_layers (its own config would not load them all).
inline void refuse_extra_layers(const io::PretrainedFolder& folder, const std::string& prefix, int64_t layers) {
  if (folder.has(prefix + "encoder.layers." + std::to_string(layers) + ".mlp.fc1.weight"))
    folder.fail("the weights have more than the " + std::to_string(layers) +
                " layers config.json's num_hidden_layers says");
}

// Calls take(name, shape) for every tensor of `layers` layers of width D and MLP width F, transformers'
// names under "encoder.layers.N.".
inline void take_encoder_layers(const std::function<void(const std::string&, std::vector<int64_t>)>& take,
                                int64_t layers, int64_t D, int64_t F) {
  for (int64_t l = 0; l < layers; ++l) {
    const auto p = "encoder.layers." + std::to_string(l) + ".";
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      take(p + "self_attn." + proj + ".weight", {D, D});
      take(p + "self_attn." + proj + ".bias", {D});
    }
    for (const char* norm : {"layer_norm1", "layer_norm2"}) {
      take(p + norm + ".weight", {D});
      take(p + norm + ".bias", {D});
    }
    take(p + "mlp.fc1.weight", {F, D});
    take(p + "mlp.fc1.bias", {F});
    take(p + "mlp.fc2.weight", {D, F});
    take(p + "mlp.fc2.bias", {D});
  }
}

// config.hidden_act: quick_gelu (x·sigmoid(1.702x), CLIP's), gelu (erf) or gelu_new (tanh).
inline bool supported_activation(const std::string& act) {
  return act == "quick_gelu" || act == "gelu" || act == "gelu_new";
}

inline at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  return at::layer_norm(x, {x.size(-1)}, w, b, eps);
}

// Layer l's output for h [B, L, D]; w(name) is the tensor of transformers' name.
inline at::Tensor encoder_layer(const at::Tensor& h, int64_t l, const std::function<at::Tensor(const std::string&)>& w,
                                int64_t heads, const std::string& act, double eps, bool causal) {
  const int64_t B = h.size(0), L = h.size(1), D = h.size(2);
  const auto p = "encoder.layers." + std::to_string(l) + ".";
  auto x = layer_norm(h, w(p + "layer_norm1.weight"), w(p + "layer_norm1.bias"), eps);
  auto split = [&](const char* proj) {
    return at::linear(x, w(p + "self_attn." + proj + ".weight"), w(p + "self_attn." + proj + ".bias"))
        .view({B, L, heads, D / heads})
        .transpose(1, 2);
  };
  auto attn =
      at::scaled_dot_product_attention(split("q_proj"), split("k_proj"), split("v_proj"), std::nullopt, 0.0, causal);
  attn = attn.transpose(1, 2).reshape({B, L, D});
  auto out = h + at::linear(attn, w(p + "self_attn.out_proj.weight"), w(p + "self_attn.out_proj.bias"));
  x = layer_norm(out, w(p + "layer_norm2.weight"), w(p + "layer_norm2.bias"), eps);
  x = at::linear(x, w(p + "mlp.fc1.weight"), w(p + "mlp.fc1.bias"));
  if (act == "quick_gelu") x = x * at::sigmoid(1.702 * x);
  else x = at::gelu(x, act == "gelu" ? "none" : "tanh");
  return out + at::linear(x, w(p + "mlp.fc2.weight"), w(p + "mlp.fc2.bias"));
}

}  // namespace megaslide::clip
