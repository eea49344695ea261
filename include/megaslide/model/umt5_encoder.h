// umT5's text encoder (Wan 2.1's: umT5-XXL, 24 layers, d_model 4096, 64 heads of 64, gated-GELU FFN
// 10240, 5.7 B parameters), computing what transformers' UMT5EncoderModel computes, loaded from the files
// people download:
//   - transformers' layout: a folder with config.json (a UMT5Config) and model.safetensors, or the shards an
//     index names (model.safetensors.index.json: the Wan diffusers repository's text_encoder/, sharded);
//     a diffusers repository's root is accepted too (its text_encoder/ is used). google/umt5-xxl's whole
//     encoder-decoder file works as well: only the encoder.* tensors (and shared.weight) are read.
//   - ComfyUI's single file (umt5_xxl_fp16.safetensors): the same tensor names, no config. Sizes come
//     from the tensors' shapes (vocabulary and d_model from shared.weight, heads and buckets from the
//     relative-attention bias, d_kv from q, d_ff from wi_0, the layers counted); the rest is fixed as
//     ComfyUI fixes it for umT5: relative_attention_max_distance 128, layer_norm_epsilon 1e-6, gated GELU
//     (tanh). A config.json beside such a file is not read.
// Sizes come from config.json (missing keys take UMT5Config's defaults); every tensor the configuration
// implies must be present with that shape and a floating-point dtype; other tensors are ignored; weights
// for more layers than the configuration names are an error. The files are memory-mapped and converted
// tensor by tensor (io MappedWeights), so loading needs one converted tensor beyond the model itself.
//
// Forward, for ids [B, L] and mask [B, L] (1 = token, 0 = padding):
//   h = shared[ids]                                                        (fp32 residual stream)
//   per layer: bias = relative_attention_bias[bucket(j - i)]  (each layer its own, T5's bidirectional
//                     log buckets: num_buckets/2 per direction, half exact, half logarithmic to max_distance)
//              h += o(softmax(q k^T + bias + mask_bias) v)   on x = rms_norm(h) (no 1/sqrt(d_kv) scaling)
//              h += wo(act(wi_0 x) * wi_1 x)                 on x = rms_norm(h) (gated; wi x without)
//   last_hidden_state = rms_norm(h)                                                   [B, L, d_model]
// rms_norm(x) = weight * x / sqrt(mean(x^2) + eps), computed in fp32; mask_bias is -inf at padded keys.
// act: "gated-gelu" is GELU's tanh approximation (transformers' gelu_new), as umT5 uses.
// embed(): Wan's convention: last_hidden_state with every position past the prompt (mask 0) zeroed.
//
// Frozen: no gradients. Weights live on `device` in `dtype` (fp32, or bf16/fp16); norms, the residual
// stream and the output are fp32.
//
// fp8 weights (`fp8` at load; model.text_encoder.dtype: fp8): every layer's seven matrices are kept as
// float8_e4m3fn with one fp32 scale per tensor (io/fp8.h), 1 B per parameter — 4.6 GB for umT5-XXL's layers
// against bf16's 9.3 GB; the embedding and the rest keep `dtype`. A matrix the file stores as e4m3fn (ComfyUI's
// umt5_xxl_fp8_e4m3fn(_scaled) files) is kept as it is, with its scale; any other is quantized per tensor
// (quantize_fp8 kPerTensor). The layers compute in `dtype` on the dequantized matrices, so the output equals
// the encoder loaded in `dtype` from a file holding those dequantized values. Streamed, the fp8 bytes cross
// PCIe (half of bf16's) and are upcast on the device.
//
// fp8 files load in any mode: an F8_E4M3 / F8_E5M2 tensor is its data × its per-tensor scale
// ("<layer>.scale_weight" or "<layer>.weight_scale", else 1).
//
// Streamed (Umt5Encoder::streamed, for a device umT5-XXL does not fit): every layer's seven matrices (q, k,
// v, o, wi_0, wi_1, wo) stay in host RAM, one flat buffer per layer (page-locked for a GPU), and visit the
// device layer by layer through a WeightStreamer (offload/weight_streamer.h: two slots, the next layer
// copied while this one computes); the embedding stays in host RAM (rows gathered there, the hidden
// states then moved), the norms and relative-attention tables on the device. The output equals the
// resident encoder's for the same dtype (bit for bit on the CPU). Errors: Umt5Error (io::IoError) naming the file, the
// tensor and what was expected. Thread-safety: forward may be called from one thread at a time.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"

namespace megaslide {

class Umt5Error : public io::IoError {
 public:
  using io::IoError::IoError;
};

struct Umt5Config {
  int64_t vocab_size = 250112;
  int64_t d_model = 512;
  int64_t d_kv = 64;
  int64_t d_ff = 1024;
  int64_t num_layers = 8;
  int64_t num_heads = 6;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;
  std::string feed_forward_proj =
      "gated-gelu";  // "gated-ACT" or "ACT"; ACT: gelu, gelu_new, gelu_pytorch_tanh, relu, silu

  // umT5-XXL as Wan 2.1 uses it.
  static Umt5Config xxl();
  bool gated() const;
  int64_t inner_dim() const { return d_kv * num_heads; }
};

class Umt5Encoder {
 public:
  // `path`: a folder in transformers' layout (or a diffusers repository root with text_encoder/), an
  // index.json, or a single .safetensors file (ComfyUI's layout). Weights stored in `dtype` on a CPU `device`
  // are not copied: the encoder reads them from the file's memory map (io::MappedWeights::view; the page
  // cache holds them once for every process), so loading costs one finite-value pass over the file.
  static Umt5Encoder load(const std::string& path, at::Device device = at::kCPU, at::ScalarType dtype = at::kFloat,
                          bool fp8 = false);
  // `encoder` (whose weights must be on the CPU) moved to `device` whole, or with its layers streamed as
  // above. `async`: copies overlap compute (CUDA streams; emulated copy threads on the CPU); else in line.
  static Umt5Encoder resident(Umt5Encoder encoder, at::Device device);
  static Umt5Encoder streamed(Umt5Encoder encoder, at::Device device, bool async = true);
  bool is_streamed() const { return stream_ != nullptr; }
  // Bytes of the weights (all of them, wherever they live).
  int64_t weight_bytes() const;
  // The architecture of `config` with random weights: for benchmarks without the download.
  static Umt5Encoder random(const Umt5Config& config, uint64_t seed = 0, at::Device device = at::kCPU,
                            at::ScalarType dtype = at::kFloat, bool fp8 = false);

  // last_hidden_state [B, L, d_model] float32 for ids [B, L] int64 and mask [B, L] (any integer or bool
  // dtype, 1 for tokens; every row needs at least one token). An undefined mask attends everywhere.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& mask = {}) const;
  // Wan's text embeddings: forward(ids, mask) zeroed where mask is 0.
  at::Tensor embed(const at::Tensor& ids, const at::Tensor& mask) const;

  const Umt5Config& config() const { return config_; }
  at::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }  // the compute dtype
  bool fp8() const { return fp8_; }                // the layers' matrices kept as fp8
  int64_t parameter_count() const;
  // Where the weights came from (a file or an index).
  const std::string& source() const { return source_; }
  // A weight as the encoder keeps it, by its name in the file (fp8 data for an fp8 matrix; a view into the
  // file's map when load() did not copy it), for inspection. Throws std::out_of_range for a name it does not
  // keep (a streamed encoder's layer matrices live in its streamer).
  const at::Tensor& stored_weight(const std::string& name) const { return w_.at(name); }

 private:
  // (name, shape) -> the CPU tensor as the file holds it: data in `dtype` (scale undefined), or fp8 data and its
  // scale.
  using WeightSource = std::function<Fp8Tensor(const std::string&, const std::vector<int64_t>&)>;
  static Umt5Encoder build(const Umt5Config& config, at::Device device, at::ScalarType dtype, bool fp8,
                           const WeightSource& source);
  // The weight `name` in the compute dtype: w_'s, dequantized when it is fp8.
  at::Tensor weight(const std::string& name) const;

  Umt5Config config_;
  at::Device device_ = at::kCPU;
  at::ScalarType dtype_ = at::kFloat;
  std::string source_;
  bool fp8_ = false;
  std::map<std::string, at::Tensor> w_;      // transformers' names, shared.weight for the embedding
  std::map<std::string, at::Tensor> scale_;  // fp8: each matrix's fp32 scale, beside w_'s fp8 data
  struct Stream;                             // the streamed layers (null when resident)
  std::shared_ptr<Stream> stream_;
};

// The weights file Umt5Encoder::load reads for `path` (the index.json, model.safetensors or the file
// itself); throws Umt5Error when there is none.
std::string umt5_weights_file(const std::string& path);

}  // namespace megaslide
