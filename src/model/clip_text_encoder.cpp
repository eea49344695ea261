#include "megaslide/model/clip_text_encoder.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "io/pretrained.h"
#include "model/clip_layers.h"

namespace megaslide {

namespace {

ClipTextConfig parse_config(const nlohmann::json& root, const std::string& source) {
  // A CLIPConfig nests the text model's settings under "text_config"; a CLIPTextConfig is flat.
  const nlohmann::json& j =
      root.contains("text_config") && root.at("text_config").is_object() ? root.at("text_config") : root;
  ClipTextConfig c;
  c.vocab_size = io::json_int(j, "vocab_size", c.vocab_size, source);
  c.hidden_size = io::json_int(j, "hidden_size", c.hidden_size, source);
  c.intermediate_size = io::json_int(j, "intermediate_size", c.intermediate_size, source);
  c.num_hidden_layers = io::json_int(j, "num_hidden_layers", c.num_hidden_layers, source);
  c.num_attention_heads = io::json_int(j, "num_attention_heads", c.num_attention_heads, source);
  c.max_position_embeddings = io::json_int(j, "max_position_embeddings", c.max_position_embeddings, source);
  c.hidden_act = io::json_string(j, "hidden_act", c.hidden_act, source);
  c.layer_norm_eps = io::json_real(j, "layer_norm_eps", c.layer_norm_eps, source);
  c.eos_token_id = io::json_int(j, "eos_token_id", c.eos_token_id, source);
  auto positive = [&](const char* key, int64_t v) {
    if (v < 1) throw io::PretrainedError("'" + source + "': \"" + key + "\" must be >= 1, got " + std::to_string(v));
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("max_position_embeddings", c.max_position_embeddings);
  if (c.hidden_size % c.num_attention_heads != 0)
    throw io::PretrainedError("'" + source + "': hidden_size " + std::to_string(c.hidden_size) +
                              " is not a multiple of num_attention_heads " + std::to_string(c.num_attention_heads));
  if (!clip::supported_activation(c.hidden_act))
    throw io::PretrainedError("'" + source + "': hidden_act \"" + c.hidden_act +
                              "\" is not supported (quick_gelu, gelu or gelu_new)");
  return c;
}

}  // namespace

ClipTextEncoder ClipTextEncoder::load(const std::string& dir, torch::Device device, torch::ScalarType dtype, bool fp8) {
  io::PretrainedFolder folder(dir, {"model.safetensors"});
  const auto config = parse_config(folder.config(), io::join_path(dir, "config.json"));
  // text_model.<name> (a CLIPModel, or an older CLIPTextModel) or <name> (transformers 5's CLIPTextModel).
  const std::string prefix = clip::tower_prefix(folder, "text_model.", "embeddings.token_embedding.weight");
  auto e = build(
      config, device, dtype,
      [&](const std::string& name, const std::vector<int64_t>& shape) {
        return folder.take(prefix + name, shape, dtype);
      },
      fp8);
  clip::refuse_extra_layers(folder, prefix, config.num_hidden_layers);
  return e;
}

ClipTextEncoder ClipTextEncoder::random(const ClipTextConfig& config, uint64_t seed, torch::Device device,
                                        torch::ScalarType dtype) {
  auto g = at::detail::createCPUGenerator(seed);
  return build(config, device, dtype, [&](const std::string& name, const std::vector<int64_t>& shape) {
    if (shape.size() == 1)
      return name.find("norm") != std::string::npos && name.substr(name.size() - 7) == ".weight"
                 ? torch::ones(shape, dtype)
                 : torch::zeros(shape, dtype);
    const double scale =
        name.find("embedding") != std::string::npos ? 0.02 : 1.0 / std::sqrt(static_cast<double>(shape[1]));
    return (torch::randn(shape, g, torch::kFloat32) * scale).to(dtype);
  });
}

ClipTextEncoder ClipTextEncoder::build(const ClipTextConfig& config, torch::Device device, torch::ScalarType dtype,
                                       const WeightSource& source, bool fp8) {
  ClipTextEncoder e;
  e.config_ = config;
  e.device_ = device;
  e.dtype_ = dtype;
  e.fp8_ = fp8;
  const auto& c = e.config_;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    clip::keep(e.w_, e.scale_, name, source(name, shape), fp8, device);
  };
  const int64_t D = c.hidden_size, F = c.intermediate_size;
  take("embeddings.token_embedding.weight", {c.vocab_size, D});
  take("embeddings.position_embedding.weight", {c.max_position_embeddings, D});
  clip::take_encoder_layers(take, c.num_hidden_layers, D, F);
  take("final_layer_norm.weight", {D});
  take("final_layer_norm.bias", {D});
  return e;
}

int64_t ClipTextEncoder::weight_bytes() const { return clip::stored_bytes(w_, scale_); }

int64_t ClipTextEncoder::parameter_count() const {
  int64_t n = 0;
  for (const auto& [name, t] : w_) n += t.numel();
  return n;
}

ClipTextOutput ClipTextEncoder::forward(const torch::Tensor& ids_in) const {
  const auto& c = config_;
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.scalar_type() == torch::kLong,
              "ClipTextEncoder: expected ids [B, L] int64, got ", ids_in.scalar_type(), " ", ids_in.sizes());
  const int64_t B = ids_in.size(0), L = ids_in.size(1), H = c.num_attention_heads;
  TORCH_CHECK(L >= 1 && L <= c.max_position_embeddings, "ClipTextEncoder: ", L, " tokens, the model takes 1 to ",
              c.max_position_embeddings);
  TORCH_CHECK(ids_in.numel() == 0 || (ids_in.min().item<int64_t>() >= 0 && ids_in.max().item<int64_t>() < c.vocab_size),
              "ClipTextEncoder: token ids must be in [0, ", c.vocab_size, ")");
  torch::NoGradGuard no_grad;
  auto w = [this](const std::string& name) { return clip::stored(w_, scale_, name, dtype_); };
  const auto ids = ids_in.to(device_);
  auto h = at::embedding(w("embeddings.token_embedding.weight"), ids) +
           w("embeddings.position_embedding.weight").slice(0, 0, L).unsqueeze(0);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    h = clip::encoder_layer(h, l, w, H, c.hidden_act, c.layer_norm_eps, /*causal=*/true);
  auto last = clip::layer_norm(h, w("final_layer_norm.weight"), w("final_layer_norm.bias"), c.layer_norm_eps)
                  .to(torch::kFloat32);
  // The end-of-text position (argmax returns the first of equal maxima, as in transformers).
  auto position = c.eos_token_id == 2 ? ids.argmax(1) : ids.eq(c.eos_token_id).to(torch::kInt).argmax(1);
  auto pooled = last.index({torch::arange(B, ids.options()), position});
  return {last, pooled};
}

}  // namespace megaslide
