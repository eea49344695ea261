#include "megaslide/model/layers.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

namespace megaslide {

namespace {
thread_local at::Generator current_init_generator;

torch::TensorOptions on(torch::Device device) { return torch::TensorOptions().dtype(torch::kFloat32).device(device); }

// torch.nn's default for Linear and Conv: weight Kaiming-uniform(a = sqrt(5)), bias U(±1/sqrt(fan_in)),
// drawn from InitGenerator::current(). The weight's bound is computed as torch::nn::init::kaiming_uniform_
// computes it (gain sqrt(2 / (1 + a²)), std = gain / sqrt(fan_in), bound = sqrt(3) · std).
void default_init(torch::Tensor& weight, torch::Tensor& bias, int64_t fan_in) {
  torch::NoGradGuard no_grad;
  const at::Generator gen = InitGenerator::current();
  const double a = std::sqrt(5.0);
  const double gain = std::sqrt(2.0 / (1 + a * a));
  const double weight_bound = std::sqrt(3.0) * (gain / std::sqrt(static_cast<double>(fan_in)));
  weight.uniform_(-weight_bound, weight_bound, gen);
  if (bias.defined()) {
    double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    bias.uniform_(-bound, bound, gen);
  }
}
}  // namespace

InitGenerator::InitGenerator(uint64_t seed)
    : generator_(at::detail::createCPUGenerator(seed)), previous_(current_init_generator) {
  current_init_generator = generator_;
}

InitGenerator::~InitGenerator() { current_init_generator = previous_; }

at::Generator InitGenerator::current() { return current_init_generator; }

uint64_t derive_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

LinearImpl::LinearImpl(LinearOptions options_) : options(std::move(options_)) { reset(); }

void LinearImpl::reset() {
  TORCH_CHECK(options.in_features() > 0 && options.out_features() > 0,
              "Linear: sizes must be positive, got in=", options.in_features(), " out=", options.out_features());
  weight =
      register_parameter("weight", torch::empty({options.out_features(), options.in_features()}, on(options.device())));
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

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  auto y = torch::nn::functional::linear(x, weight, bias);
  return adapter ? adapter->apply(x, y, is_training()) : y;
}

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
              "Conv3d: channels (", options.in_channels(), " -> ", options.out_channels(),
              ") must be divisible by groups ", options.groups());
  int64_t in_per_group = options.in_channels() / options.groups();
  weight = register_parameter(
      "weight", torch::empty({options.out_channels(), in_per_group, k[0], k[1], k[2]}, on(options.device())));
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
  weight.normal_(0.0, options.init_std(), InitGenerator::current());
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) { return torch::embedding(weight, ids); }

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace megaslide
