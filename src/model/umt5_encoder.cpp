#include "megaslide/model/umt5_encoder.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>

#include "io/pretrained.h"
#include "megaslide/io/fp8.h"
#include "megaslide/offload/weight_streamer.h"

namespace megaslide {

namespace {

constexpr const char* kEmbedding = "shared.weight";
constexpr const char* kEmbeddingAlt = "encoder.embed_tokens.weight";

std::string block(int64_t l) { return "encoder.block." + std::to_string(l) + "."; }

// The matrices of a layer, in the order they sit in its flat streamed buffer.
std::vector<std::string> layer_matrices(int64_t l, bool gated) {
  const auto p = block(l);
  std::vector<std::string> out;
  for (const char* proj : {"q", "k", "v", "o"}) out.push_back(p + "layer.0.SelfAttention." + proj + ".weight");
  if (gated) {
    out.push_back(p + "layer.1.DenseReluDense.wi_0.weight");
    out.push_back(p + "layer.1.DenseReluDense.wi_1.weight");
  } else {
    out.push_back(p + "layer.1.DenseReluDense.wi.weight");
  }
  out.push_back(p + "layer.1.DenseReluDense.wo.weight");
  return out;
}

// "gated-gelu" -> (gated, "gelu_new") as UMT5Config maps it; "gated-X" -> (gated, X); "X" -> (not, X).
std::pair<bool, std::string> activation(const std::string& proj) {
  const bool gated = proj.rfind("gated-", 0) == 0;
  std::string act = gated ? proj.substr(6) : proj;
  if (proj == "gated-gelu") act = "gelu_new";
  return {gated, act};
}

void check_config(const Umt5Config& c, const std::string& source) {
  auto positive = [&](const char* key, int64_t v) {
    if (v < 1) throw Umt5Error("'" + source + "': \"" + key + "\" must be >= 1, got " + std::to_string(v));
  };
  positive("vocab_size", c.vocab_size);
  positive("d_model", c.d_model);
  positive("d_kv", c.d_kv);
  positive("d_ff", c.d_ff);
  positive("num_layers", c.num_layers);
  positive("num_heads", c.num_heads);
  positive("relative_attention_max_distance", c.relative_attention_max_distance);
  if (c.relative_attention_num_buckets < 4)
    throw Umt5Error("'" + source + "': \"relative_attention_num_buckets\" must be >= 4, got " +
                    std::to_string(c.relative_attention_num_buckets));
  if (!(c.layer_norm_epsilon > 0)) throw Umt5Error("'" + source + "': \"layer_norm_epsilon\" must be > 0");
  const auto [gated, act] = activation(c.feed_forward_proj);
  if (act != "gelu" && act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "relu" && act != "silu")
    throw Umt5Error("'" + source + "': \"feed_forward_proj\" \"" + c.feed_forward_proj +
                    "\" is not supported (gated-gelu, or [gated-]gelu, gelu_new, gelu_pytorch_tanh, relu, silu)");
  (void)gated;
}

Umt5Config parse_config(const nlohmann::json& j, const std::string& source) {
  Umt5Config c;
  const auto type = io::json_string(j, "model_type", "umt5", source);
  if (type != "umt5")
    throw Umt5Error("'" + source + "': model_type \"" + type +
                    "\" is not umT5 (\"umt5\": a relative-attention bias in every layer)");
  c.vocab_size = io::json_int(j, "vocab_size", c.vocab_size, source);
  c.d_model = io::json_int(j, "d_model", c.d_model, source);
  c.d_kv = io::json_int(j, "d_kv", c.d_kv, source);
  c.d_ff = io::json_int(j, "d_ff", c.d_ff, source);
  c.num_layers = io::json_int(j, "num_layers", c.num_layers, source);
  c.num_heads = io::json_int(j, "num_heads", c.num_heads, source);
  c.relative_attention_num_buckets =
      io::json_int(j, "relative_attention_num_buckets", c.relative_attention_num_buckets, source);
  c.relative_attention_max_distance =
      io::json_int(j, "relative_attention_max_distance", c.relative_attention_max_distance, source);
  c.layer_norm_epsilon = io::json_real(j, "layer_norm_epsilon", c.layer_norm_epsilon, source);
  c.feed_forward_proj = io::json_string(j, "feed_forward_proj", c.feed_forward_proj, source);
  check_config(c, source);
  return c;
}

// ComfyUI's file carries no configuration: the sizes from the shapes, the rest as ComfyUI fixes it.
Umt5Config infer_config(const io::MappedWeights& w, const std::string& file) {
  auto need = [&](const std::string& name, size_t dims) -> const std::vector<int64_t>& {
    if (!w.has(name))
      throw Umt5Error("'" + file + "': no tensor '" + name +
                      "' (not a T5-family encoder file in transformers' or ComfyUI's names)");
    const auto& s = w.shape(name);
    if (s.size() != dims)
      throw Umt5Error("'" + file + "': tensor '" + name + "' has " + std::to_string(s.size()) +
                      " dimensions, expected " + std::to_string(dims));
    return s;
  };
  Umt5Config c;
  const auto& emb = need(w.has(kEmbedding) ? kEmbedding : (w.has(kEmbeddingAlt) ? kEmbeddingAlt : kEmbedding), 2);
  c.vocab_size = emb[0];
  c.d_model = emb[1];
  const auto& bias = need(block(0) + "layer.0.SelfAttention.relative_attention_bias.weight", 2);
  c.relative_attention_num_buckets = bias[0];
  c.num_heads = bias[1];
  const auto& q = need(block(0) + "layer.0.SelfAttention.q.weight", 2);
  if (q[0] % c.num_heads != 0)
    throw Umt5Error("'" + file + "': q has " + std::to_string(q[0]) + " rows, not a multiple of the " +
                    std::to_string(c.num_heads) + " heads");
  c.d_kv = q[0] / c.num_heads;
  c.d_ff = need(block(0) + "layer.1.DenseReluDense.wi_0.weight", 2)[0];
  c.num_layers = 0;
  while (w.has(block(c.num_layers) + "layer.0.SelfAttention.q.weight")) ++c.num_layers;
  if (c.num_layers > 1 && !w.has(block(1) + "layer.0.SelfAttention.relative_attention_bias.weight"))
    throw Umt5Error(
        "'" + file +
        "': only the first layer has a relative-attention bias: a T5 encoder, not umT5 (every layer has its own)");
  c.relative_attention_max_distance = 128;
  c.layer_norm_epsilon = 1e-6;
  c.feed_forward_proj = "gated-gelu";
  check_config(c, file);
  return c;
}

// T5's bidirectional relative-position buckets [L, L] (key position j minus query position i), with
// transformers' arithmetic (float32 log ratio, truncated), on the CPU.
at::Tensor relative_buckets(int64_t L, int64_t num_buckets, int64_t max_distance) {
  auto pos = at::arange(L, at::kLong);
  auto rel = pos.unsqueeze(0) - pos.unsqueeze(1);
  const int64_t half = num_buckets / 2;
  auto buckets = rel.gt(0).to(at::kLong) * half;
  rel = rel.abs();
  const int64_t max_exact = half / 2;
  auto is_small = rel.lt(max_exact);
  auto ratio = at::log(rel.to(at::kFloat) / max_exact) /
               std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) * (half - max_exact);
  auto large = at::minimum(ratio.to(at::kLong) + max_exact, at::full_like(rel, half - 1));
  return buckets + at::where(is_small, rel, large);
}

at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, double eps) {
  auto x = h.to(at::kFloat);
  return weight * (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

at::Tensor act(const at::Tensor& x, const std::string& name) {
  if (name == "gelu") return at::gelu(x);
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  if (name == "relu") return at::relu(x);
  return at::silu(x);
}

}  // namespace

Umt5Config Umt5Config::xxl() {
  Umt5Config c;
  c.vocab_size = 256384;
  c.d_model = 4096;
  c.d_kv = 64;
  c.d_ff = 10240;
  c.num_layers = 24;
  c.num_heads = 64;
  return c;
}

bool Umt5Config::gated() const { return activation(feed_forward_proj).first; }

std::string umt5_weights_file(const std::string& path) {
  if (!io::path_exists(path))
    throw Umt5Error("'" + path +
                    "': no such file or folder (expected umT5 weights: a model folder or a .safetensors file)");
  if (!io::is_directory(path)) return path;
  if (!io::path_exists(io::join_path(path, "config.json")) && io::is_directory(io::join_path(path, "text_encoder")))
    return umt5_weights_file(io::join_path(path, "text_encoder"));
  for (const char* name : {"model.safetensors.index.json", "model.safetensors"})
    if (io::path_exists(io::join_path(path, name))) return io::join_path(path, name);
  throw Umt5Error("model folder '" + path +
                  "': no weights (expected model.safetensors or model.safetensors.index.json)");
}

Umt5Encoder Umt5Encoder::load(const std::string& path, at::Device device, at::ScalarType dtype, bool fp8) {
  const auto file = umt5_weights_file(path);
  Umt5Config config;
  std::unique_ptr<io::MappedWeights> weights;
  try {
    const bool folder =
        io::is_directory(path) || (file.size() > 11 && file.compare(file.size() - 11, 11, ".index.json") == 0);
    if (folder) {
      const auto slash = file.find_last_of('/');
      const auto dir = slash == std::string::npos ? std::string(".") : file.substr(0, slash);
      const auto config_path = io::join_path(dir, "config.json");
      if (!io::path_exists(config_path)) throw Umt5Error("model folder '" + dir + "': no config.json");
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(io::read_file(config_path));
      } catch (const nlohmann::json::exception& e) {
        throw Umt5Error("'" + config_path + "' is not valid JSON: " + e.what());
      }
      if (!j.is_object()) throw Umt5Error("'" + config_path + "' is not a JSON object");
      config = parse_config(j, config_path);
      weights = std::make_unique<io::MappedWeights>(file);
    } else {
      weights = std::make_unique<io::MappedWeights>(file);
      config = infer_config(*weights, file);
    }
    const std::string embedding = weights->has(kEmbedding) || !weights->has(kEmbeddingAlt) ? kEmbedding : kEmbeddingAlt;
    auto e = build(config, device, dtype, fp8, [&](const std::string& name, const std::vector<int64_t>& shape) {
      const std::string& stored = name == kEmbedding ? embedding : name;
      if (weights->is_fp8(stored)) return weights->take_fp8(stored, shape, "from the model's configuration");
      // Stored in the dtype the encoder computes in: a view into the file's memory map, not a copy (the
      // encoder never writes its weights; a GPU copy is made from it directly). Another dtype: converted.
      if (weights->stored_dtype(stored) == dtype) return Fp8Tensor{weights->view(stored, shape), {}};
      return Fp8Tensor{weights->take(stored, shape, dtype), {}};
    });
    if (weights->has(block(config.num_layers) + "layer.0.SelfAttention.q.weight"))
      throw Umt5Error("'" + file + "': the weights have more than the " + std::to_string(config.num_layers) +
                      " layers the configuration names");
    e.source_ = file;
    return e;
  } catch (const io::PretrainedError& e) {
    throw Umt5Error(e.what());
  }
}

Umt5Encoder Umt5Encoder::random(const Umt5Config& config, uint64_t seed, at::Device device, at::ScalarType dtype,
                                bool fp8) {
  check_config(config, "Umt5Config");
  auto g = at::detail::createCPUGenerator(seed);
  auto e = build(config, device, dtype, fp8, [&](const std::string& name, const std::vector<int64_t>& shape) {
    if (shape.size() == 1) return Fp8Tensor{at::ones(shape, at::kFloat), {}};
    if (name.find("relative_attention_bias") != std::string::npos)
      return Fp8Tensor{at::randn(shape, g, at::kFloat), {}};
    const double scale = name == kEmbedding ? 1.0 : 1.0 / std::sqrt(static_cast<double>(shape[1]));
    return Fp8Tensor{at::randn(shape, g, at::kFloat) * scale, {}};
  });
  e.source_ = "random";
  return e;
}

Umt5Encoder Umt5Encoder::build(const Umt5Config& config, at::Device device, at::ScalarType dtype, bool fp8,
                               const WeightSource& source) {
  Umt5Encoder e;
  e.config_ = config;
  e.device_ = device;
  e.dtype_ = dtype;
  e.fp8_ = fp8;
  const auto& c = e.config_;
  // Norm weights and the small relative-attention tables stay fp32; the embedding takes `dtype`; the layers'
  // matrices `dtype`, or fp8 with a scale each.
  auto value = [](const Fp8Tensor& t, at::ScalarType as) {
    return t.scale.defined() ? dequantize_fp8(t, as) : t.data.to(as);
  };
  auto take = [&](const std::string& name, std::vector<int64_t> shape, bool fp32) {
    e.w_[name] = value(source(name, shape), fp32 ? at::kFloat : dtype).to(device);
  };
  auto matrix = [&](const std::string& name, std::vector<int64_t> shape) {
    if (!fp8) return take(name, shape, false);
    auto t = source(name, shape);
    // An e4m3fn matrix is kept as the file has it; any other is quantized per tensor.
    if (t.data.scalar_type() != at::kFloat8_e4m3fn) t = quantize_fp8(value(t, at::kFloat), Fp8Scaling::kPerTensor);
    e.w_[name] = t.data.to(device);
    e.scale_[name] = (t.scale.defined() ? t.scale : at::ones({}, at::kFloat)).to(device, at::kFloat).reshape({});
  };
  const int64_t D = c.d_model, I = c.inner_dim(), F = c.d_ff;
  take(kEmbedding, {c.vocab_size, D}, false);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const auto p = block(l);
    for (const char* proj : {"q", "k", "v"}) matrix(p + "layer.0.SelfAttention." + proj + ".weight", {I, D});
    matrix(p + "layer.0.SelfAttention.o.weight", {D, I});
    take(p + "layer.0.SelfAttention.relative_attention_bias.weight", {c.relative_attention_num_buckets, c.num_heads},
         true);
    take(p + "layer.0.layer_norm.weight", {D}, true);
    if (c.gated()) {
      matrix(p + "layer.1.DenseReluDense.wi_0.weight", {F, D});
      matrix(p + "layer.1.DenseReluDense.wi_1.weight", {F, D});
    } else {
      matrix(p + "layer.1.DenseReluDense.wi.weight", {F, D});
    }
    matrix(p + "layer.1.DenseReluDense.wo.weight", {D, F});
    take(p + "layer.1.layer_norm.weight", {D}, true);
  }
  take("encoder.final_layer_norm.weight", {D}, true);
  return e;
}

struct Umt5Encoder::Stream {
  struct Matrix {
    std::string name;
    int64_t offset = 0, numel = 0;
    std::vector<int64_t> shape;
  };
  std::vector<std::vector<Matrix>> layers;
  std::vector<at::Tensor> host;                       // per layer, flat, the weights' dtype (fp8: float8_e4m3fn)
  std::vector<at::Tensor> scales;                     // fp8: per layer, the matrices' scales (fp32, on the device)
  std::vector<std::vector<int64_t>> offsets, numels;  // fp8: per layer, the matrices' places in the flat buffer
  at::Tensor embedding;                               // on the CPU
  std::unique_ptr<offload::WeightStreamer> streamer;
  ~Stream() {
    try {
      if (streamer) streamer->synchronize();
    } catch (...) {
    }
  }
};

Umt5Encoder Umt5Encoder::resident(Umt5Encoder encoder, at::Device device) {
  TORCH_CHECK(!encoder.stream_, "Umt5Encoder::resident: the encoder is streamed");
  for (auto& [name, t] : encoder.w_) t = t.to(device);
  for (auto& [name, t] : encoder.scale_) t = t.to(device);
  encoder.device_ = device;
  return encoder;
}

Umt5Encoder Umt5Encoder::streamed(Umt5Encoder encoder, at::Device device, bool async) {
  TORCH_CHECK(!encoder.stream_, "Umt5Encoder::streamed: the encoder is streamed already");
  for (const auto& [name, t] : encoder.w_)
    TORCH_CHECK(t.device().is_cpu(), "Umt5Encoder::streamed: the weights must be on the CPU, '", name, "' is on ",
                t.device());
  bool pin = false;
#ifdef MEGASLIDE_WITH_CUDA
  pin = device.is_cuda();
#endif
  auto s = std::make_shared<Stream>();
  const auto& c = encoder.config_;
  const bool gated = activation(c.feed_forward_proj).first;
  std::vector<int64_t> numels;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    std::vector<Stream::Matrix> matrices;
    int64_t n = 0;
    for (const auto& name : layer_matrices(l, gated)) {
      const auto& t = encoder.w_.at(name);
      matrices.push_back({name, n, t.numel(), t.sizes().vec()});
      n += t.numel();
    }
    const auto stored = encoder.fp8_ ? at::kFloat8_e4m3fn : encoder.dtype_;
    auto flat = at::empty({n}, at::TensorOptions().dtype(stored).pinned_memory(pin));
    std::vector<at::Tensor> scales;
    for (const auto& m : matrices) {
      flat.narrow(0, m.offset, m.numel).copy_(encoder.w_.at(m.name).reshape({-1}));
      encoder.w_.erase(m.name);  // the copy above is now the only one
      if (encoder.fp8_) {
        scales.push_back(encoder.scale_.at(m.name).reshape({1}));
        encoder.scale_.erase(m.name);
      }
    }
    if (encoder.fp8_) {
      s->scales.push_back(at::cat(scales).to(device));
      s->offsets.emplace_back();
      s->numels.emplace_back();
      for (const auto& m : matrices) {
        s->offsets.back().push_back(m.offset);
        s->numels.back().push_back(m.numel);
      }
    }
    s->layers.push_back(std::move(matrices));
    s->host.push_back(flat);
    numels.push_back(n);
  }
  s->embedding = encoder.w_.at(kEmbedding);
  encoder.w_.erase(kEmbedding);
  for (auto& [name, t] : encoder.w_) t = t.to(device);  // norms and relative-attention tables: small
  offload::WeightStreamerOptions options{device, encoder.dtype_,
                                         async ? offload::StreamMode::kAsync : offload::StreamMode::kSync};
  options.gradients = false;  // frozen: no gradient slots
  if (encoder.fp8_) options.transfer_dtype = at::kFloat8_e4m3fn;
  s->streamer = std::make_unique<offload::WeightStreamer>(numels, options);
  if (encoder.fp8_) {
    // The uploaded fp8 bytes of a layer into its slot, in the compute dtype, matrix by matrix.
    Stream* stream = s.get();
    s->streamer->set_upcast([stream](int64_t l, const at::Tensor& raw, const at::Tensor& weights) {
      const auto i = static_cast<size_t>(l);
      offload::upcast_fp8_block(raw, weights, stream->offsets[i], stream->numels[i], stream->scales[i]);
    });
  }
  encoder.device_ = device;
  encoder.stream_ = std::move(s);
  return encoder;
}

at::Tensor Umt5Encoder::weight(const std::string& name) const {
  const auto& t = w_.at(name);
  return is_fp8(t.scalar_type()) ? dequantize_fp8({t, scale_.at(name)}, dtype_) : t;
}

int64_t Umt5Encoder::weight_bytes() const {
  int64_t n = 0;
  for (const auto& [name, t] : w_) n += static_cast<int64_t>(t.nbytes());
  for (const auto& [name, t] : scale_) n += static_cast<int64_t>(t.nbytes());
  if (stream_) {
    n += static_cast<int64_t>(stream_->embedding.nbytes());
    for (const auto& h : stream_->host) n += static_cast<int64_t>(h.nbytes());
    for (const auto& t : stream_->scales) n += static_cast<int64_t>(t.nbytes());
  }
  return n;
}

int64_t Umt5Encoder::parameter_count() const {
  int64_t n = 0;
  for (const auto& [name, t] : w_) n += t.numel();
  if (stream_) {
    n += stream_->embedding.numel();
    for (const auto& h : stream_->host) n += h.numel();
  }
  return n;
}

at::Tensor Umt5Encoder::forward(const at::Tensor& ids_in, const at::Tensor& mask_in) const {
  const auto& c = config_;
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.scalar_type() == at::kLong, "Umt5Encoder: expected ids [B, L] int64, got ",
              ids_in.scalar_type(), " ", ids_in.sizes());
  const int64_t B = ids_in.size(0), L = ids_in.size(1), H = c.num_heads, I = c.inner_dim();
  TORCH_CHECK(L >= 1, "Umt5Encoder: no tokens");
  TORCH_CHECK(ids_in.numel() == 0 || (ids_in.min().item<int64_t>() >= 0 && ids_in.max().item<int64_t>() < c.vocab_size),
              "Umt5Encoder: token ids must be in [0, ", c.vocab_size, ")");
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> slot;  // streamed: the layer's matrices, views into its device slot
  auto w = [&](const std::string& name) -> at::Tensor {
    const auto it = slot.find(name);
    return it != slot.end() ? it->second : weight(name);
  };
  const auto ids = ids_in.to(device_);
  // Additive key mask [B, 1, 1, L]: -inf at padding.
  at::Tensor key_bias;
  if (mask_in.defined()) {
    TORCH_CHECK(mask_in.sizes() == ids_in.sizes(), "Umt5Encoder: mask ", mask_in.sizes(), " does not match ids ",
                ids_in.sizes());
    const auto keep = mask_in.to(device_).ne(0);
    TORCH_CHECK(keep.any(1).all().item<bool>(), "Umt5Encoder: every row of the mask needs at least one token");
    key_bias = at::zeros({B, 1, 1, L}, ids.options().dtype(at::kFloat))
                   .masked_fill(keep.logical_not().view({B, 1, 1, L}), -std::numeric_limits<float>::infinity());
  }
  const auto buckets =
      relative_buckets(L, c.relative_attention_num_buckets, c.relative_attention_max_distance).to(device_);
  const auto [gated, act_name] = activation(c.feed_forward_proj);
  auto h = stream_ ? at::embedding(stream_->embedding, ids_in.cpu()).to(device_, at::kFloat)
                   : at::embedding(w(kEmbedding), ids).to(at::kFloat);
  // One layer on its weights: the resident ones, or (streamed) `slot`'s views of the layer's device copy.
  auto layer = [&](int64_t l) {
    const auto p = block(l);
    auto x = rms_norm(h, w(p + "layer.0.layer_norm.weight"), c.layer_norm_epsilon).to(dtype_);
    auto heads = [&](const char* proj) {
      return at::linear(x, w(p + "layer.0.SelfAttention." + proj + ".weight")).view({B, L, H, c.d_kv}).transpose(1, 2);
    };
    // [L, L, H] -> [1, H, L, L]: this layer's bias, plus the padding mask.
    auto bias = at::embedding(w(p + "layer.0.SelfAttention.relative_attention_bias.weight"), buckets)
                    .permute({2, 0, 1})
                    .unsqueeze(0);
    if (key_bias.defined()) bias = bias + key_bias;
    auto attn =
        at::scaled_dot_product_attention(heads("q"), heads("k"), heads("v"), bias.to(dtype_), 0.0, /*is_causal=*/false,
                                         /*scale=*/1.0);
    attn = attn.transpose(1, 2).reshape({B, L, I});
    h = h + at::linear(attn, w(p + "layer.0.SelfAttention.o.weight")).to(at::kFloat);
    x = rms_norm(h, w(p + "layer.1.layer_norm.weight"), c.layer_norm_epsilon).to(dtype_);
    at::Tensor ff;
    if (gated) {
      ff = act(at::linear(x, w(p + "layer.1.DenseReluDense.wi_0.weight")), act_name) *
           at::linear(x, w(p + "layer.1.DenseReluDense.wi_1.weight"));
    } else {
      ff = act(at::linear(x, w(p + "layer.1.DenseReluDense.wi.weight")), act_name);
    }
    h = h + at::linear(ff, w(p + "layer.1.DenseReluDense.wo.weight")).to(at::kFloat);
  };
  if (!stream_) {
    for (int64_t l = 0; l < c.num_layers; ++l) layer(l);
  } else {
    offload::StreamedForward layers(*stream_->streamer,
                                    [this](int64_t l) { return stream_->host[static_cast<size_t>(l)]; });
    for (int64_t l = 0; l < c.num_layers; ++l)
      layers.run(l, [&](const at::Tensor& weights) {
        slot.clear();
        for (const auto& m : stream_->layers[static_cast<size_t>(l)])
          slot[m.name] = weights.narrow(0, m.offset, m.numel).view(m.shape);
        struct Clear {  // no view of the slot outlives the layer
          decltype(slot)& views;
          ~Clear() { views.clear(); }
        } clear{slot};
        layer(l);
      });
  }
  return rms_norm(h, w("encoder.final_layer_norm.weight"), c.layer_norm_epsilon);
}

at::Tensor Umt5Encoder::embed(const at::Tensor& ids, const at::Tensor& mask) const {
  TORCH_CHECK(mask.defined(), "Umt5Encoder::embed: a mask is needed");
  auto out = forward(ids, mask);
  return out * mask.to(out.device()).ne(0).unsqueeze(-1).to(out.scalar_type());
}

}  // namespace megaslide
