// Basic layers of the DiT family, built on the device the caller names.
//
// Why not torch::nn::Linear & co.: LibTorch's C++ layers always allocate their parameters on the CPU,
// so a 105 B-parameter model could not be described without allocating 420 GB. These layers take a
// `device` option (torch::kMeta builds shapes only) and otherwise follow LibTorch's initialisation.
// Parameter names ("weight", "bias") match torch.nn, so checkpoints keep the usual keys.
//
// Thread-safety: like any torch::nn::Module — one thread mutates a module at a time.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <array>

namespace megaslide {

// Where the layers' reset() draws initial weights: while an InitGenerator lives on a thread, from its
// own generator (seeded at construction), so a module built there depends only on that seed — not on
// the global random stream, other threads or the order modules are built in; otherwise from LibTorch's
// default CPU generator (torch::manual_seed). Nestable; one per thread at a time is in effect.
class InitGenerator {
 public:
  explicit InitGenerator(uint64_t seed);
  ~InitGenerator();
  InitGenerator(const InitGenerator&) = delete;
  InitGenerator& operator=(const InitGenerator&) = delete;
  // The generator to draw from on this thread (undefined: the default generator).
  static at::Generator current();

 private:
  at::Generator generator_;
  at::Generator previous_;
};

// A seed for part `index` of something seeded with `seed` (splitmix64 of both): well spread, so
// neighbouring indices give unrelated streams.
uint64_t derive_seed(uint64_t seed, uint64_t index);

// Three sizes in (t, h, w) order; aliases keep TORCH_ARG (a macro) happy.
using Int3 = std::array<int64_t, 3>;
using Real3 = std::array<double, 3>;

struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features) : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, zero_init) = false;  // weight and bias start at zero (adaLN-Zero, output heads)
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

// A trainable change of a Linear layer's output that lives outside the layer (LoRA, model/lora.h): the
// layer's forward hands it its input and its own output and returns the adapted output. Its tensors
// are not the layer's parameters (they are not registered), so a frozen base streamed by the trainer
// and an adapter resident on the device can make up one layer.
class LinearAdapter {
 public:
  virtual ~LinearAdapter() = default;
  // `x` the layer's input, `y` = x W^T + b; `training` the layer's mode (dropout).
  virtual torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& y, bool training) const = 0;
};

// y = x W^T + b, W: [out, in]. Default init: LibTorch's (Kaiming-uniform a=sqrt(5), bias U(±1/sqrt(in))).
// With an adapter set, forward returns adapter->apply(x, y).
class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features) : LinearImpl(LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(LinearOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  LinearOptions options;
  torch::Tensor weight, bias;
  std::shared_ptr<const LinearAdapter> adapter;  // null: none (a clone shares it)
};
TORCH_MODULE(Linear);

struct LayerNormOptions {
  explicit LayerNormOptions(int64_t dim) : dim_(dim) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

// LayerNorm over the last dimension; without `affine` it has no parameters (adaLN supplies them).
class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl> {
 public:
  explicit LayerNormImpl(LayerNormOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  LayerNormOptions options;
  torch::Tensor weight, bias;  // undefined without affine
};
TORCH_MODULE(LayerNorm);

struct Conv3dOptions {
  Conv3dOptions(int64_t in_channels, int64_t out_channels, std::array<int64_t, 3> kernel)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_(kernel) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, out_channels);
  TORCH_ARG(Int3, kernel);
  TORCH_ARG(Int3, stride) = Int3{1, 1, 1};
  TORCH_ARG(Int3, padding) = Int3{0, 0, 0};
  TORCH_ARG(int64_t, groups) = 1;
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

// 3D convolution on [B, C, T, H, W]; weight [out, in/groups, kt, kh, kw]. Init as torch.nn.Conv3d.
class Conv3dImpl : public torch::nn::Cloneable<Conv3dImpl> {
 public:
  explicit Conv3dImpl(Conv3dOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  Conv3dOptions options;
  torch::Tensor weight, bias;
};
TORCH_MODULE(Conv3d);

struct EmbeddingOptions {
  EmbeddingOptions(int64_t num_embeddings, int64_t dim) : num_embeddings_(num_embeddings), dim_(dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, init_std) = 0.02;
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

// Lookup table [num_embeddings, dim], N(0, init_std) initialised.
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  explicit EmbeddingImpl(EmbeddingOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& ids);

  EmbeddingOptions options;
  torch::Tensor weight;
};
TORCH_MODULE(Embedding);

// Number of elements over all parameters of `module` (works on meta-device modules).
int64_t count_parameters(const torch::nn::Module& module);

}  // namespace megaslide
