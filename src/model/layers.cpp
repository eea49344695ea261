#include "megaslide/model/layers.h"

#include <cmath>

namespace megaslide {

namespace {
torch::TensorOptions on(torch::Device device) { return torch::TensorOptions().dtype(torch::kFloat32).device(device); }

// torch.nn's default for Linear and Conv: weight Kaiming-uniform(a = sqrt(5)), bias U(±1/sqrt(fan_in)).
void default_init(torch::Tensor& weight, torch::Tensor& bias, int64_t fan_in) {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    bias.uniform_(-bound, bound);
  }
}
}  // namespace

LinearImpl::LinearImpl(LinearOptions options_) : options(std::move(options_)) { reset(); }

void LinearImpl::reset() {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0, "Linear: sizes must be positive, got in=",
              options.in_features(), " out=", options.out_features());
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}, on(options.device())));
  bias = options.bias() ? register_parameter("bias", torch::empty({options.out_features()}, on(options.device())))
                        : torch::Tensor();
  if (options.zero_init()) {
    torch::NoGradGuard no_grad;
    weight.zero_();
    if (bias.defined()) bias.zero_();
  } else {
    default_init(weight, bias, options.in_features());
  }
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight, bias); }

LayerNormImpl::LayerNormImpl(LayerNormOptions options_) : options(std::move(options_)) { reset(); }

void LayerNormImpl::reset() {
  if (options.affine()) {
    weight = register_parameter("weight", torch::ones({options.dim()}, on(options.device())));
    bias = register_parameter("bias", torch::zeros({options.dim()}, on(options.device())));
  }
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  return torch::layer_norm(x, {options.dim()}, weight, bias, options.eps());
}

Conv3dImpl::Conv3dImpl(Conv3dOptions options_) : options(std::move(options_)) { reset(); }

void Conv3dImpl::reset() {
  const auto& k = options.kernel();
  TORCH_CHECK(options.groups() > 0 && options.in_channels() % options.groups() == 0 &&
                  options.out_channels() % options.groups() == 0,
              "Conv3d: channels (", options.in_channels(), " -> ", options.out_channels(), ") must be divisible by groups ",
              options.groups());
  int64_t in_per_group = options.in_channels() / options.groups();
  weight = register_parameter("weight", torch::empty({options.out_channels(), in_per_group, k[0], k[1], k[2]}, on(options.device())));
  bias = register_parameter("bias", torch::empty({options.out_channels()}, on(options.device())));
  default_init(weight, bias, in_per_group * k[0] * k[1] * k[2]);
}

torch::Tensor Conv3dImpl::forward(const torch::Tensor& x) {
  const auto& s = options.stride();
  const auto& p = options.padding();
  return torch::conv3d(x, weight, bias, {s[0], s[1], s[2]}, {p[0], p[1], p[2]}, {1, 1, 1}, options.groups());
}

EmbeddingImpl::EmbeddingImpl(EmbeddingOptions options_) : options(std::move(options_)) { reset(); }

void EmbeddingImpl::reset() {
  weight = register_parameter("weight", torch::empty({options.num_embeddings(), options.dim()}, on(options.device())));
  torch::NoGradGuard no_grad;
  weight.normal_(0.0, options.init_std());
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) { return torch::embedding(weight, ids); }

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace megaslide
