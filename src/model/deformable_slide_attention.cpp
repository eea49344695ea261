#include "megaslide/model/deformable_slide_attention.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <tuple>

namespace megaslide {

DeformableSlideAttention3DImpl::DeformableSlideAttention3DImpl(DeformableSlideAttentionOptions options_)
    : options(std::move(options_)) {
  reset();
}

int64_t DeformableSlideAttention3DImpl::kernel_volume() const {
  const auto& k = options.kernel();
  return k[0] * k[1] * k[2];
}

void DeformableSlideAttention3DImpl::reset() {
  const int64_t D = options.dim(), M = options.heads(), G = options.groups();
  TORCH_CHECK(D % M == 0, "DeformableSlideAttention3D: dim ", D, " is not divisible by heads ", M);
  TORCH_CHECK(G >= 1 && M % G == 0, "DeformableSlideAttention3D: offset groups ", G, " must divide heads ", M);
  for (int a = 0; a < 3; ++a)
    TORCH_CHECK(options.kernel()[a] >= 1 && options.kernel()[a] % 2 == 1,
                "DeformableSlideAttention3D: kernel sizes must be odd and positive");
  const auto dev = options.device();
  q = register_module("q", Linear(LinearOptions(D, D).device(dev)));
  k = register_module("k", Linear(LinearOptions(D, D).device(dev)));
  v = register_module("v", Linear(LinearOptions(D, D).device(dev)));
  proj = register_module("proj", Linear(LinearOptions(D, D).device(dev)));
  if (options.offsets() == DsaOffsets::kLearned) {
    offset_dw =
        register_module("offset_dw", Conv3d(Conv3dOptions(D, D, {3, 3, 3}).padding({1, 1, 1}).groups(D).device(dev)));
    offset_pw =
        register_module("offset_pw", Linear(LinearOptions(D, G * kernel_volume() * 3).zero_init(true).device(dev)));
  } else if (options.offsets() == DsaOffsets::kFrozen) {
    // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, as LibTorch initialises Conv3d and
    // Linear, from the module's own generator (the global random stream is left alone).
    auto gen = at::detail::createCPUGenerator(options.frozen_offset_seed());
    auto uniform = [&](std::vector<int64_t> shape, int64_t fan_in) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      // Not parameters, so a skeleton built on the meta device (the streamed trainer's) still needs them.
      return (torch::rand(shape, gen, torch::kFloat32) * (2 * bound) - bound)
          .to(dev.is_meta() ? torch::Device(torch::kCPU) : dev);
    };
    const int64_t out = G * kernel_volume() * 3;
    frozen_dw_weight = uniform({D, 1, 3, 3, 3}, 27);
    frozen_dw_bias = uniform({D}, 27);
    frozen_pw_weight = uniform({out, D}, D);
    frozen_pw_bias = uniform({out}, D);
  }
  rel_bias = register_parameter("rel_bias", torch::zeros({M, kernel_volume()}, torch::TensorOptions().device(dev)));
}

torch::Tensor DeformableSlideAttention3DImpl::kernel_window(const torch::Tensor& full_kernel, int64_t dim,
                                                            const TokenGrid& grid) const {
  const auto& full = options.kernel();
  const auto eff = ops::effective_kernel(full, grid.dims());
  if (eff == full) return full_kernel;
  // The centred sub-window of the kernel, as views (no index tensor: nothing is copied to the device).
  std::vector<int64_t> sizes(full_kernel.sizes().begin(), full_kernel.sizes().end());
  sizes.erase(sizes.begin() + dim);
  sizes.insert(sizes.begin() + dim, {full[0], full[1], full[2]});
  auto window = full_kernel.view(sizes);
  for (int a = 0; a < 3; ++a) window = window.narrow(dim + a, (full[a] - eff[a]) / 2, eff[a]);
  std::vector<int64_t> out(full_kernel.sizes().begin(), full_kernel.sizes().end());
  out[dim] = eff[0] * eff[1] * eff[2];
  return window.reshape(out);
}

const std::vector<torch::Tensor>& DeformableSlideAttention3DImpl::frozen_weights_like(const torch::Tensor& x) {
  if (frozen_converted_.empty() || frozen_converted_[0].device() != x.device() ||
      frozen_converted_[0].scalar_type() != x.scalar_type()) {
    frozen_converted_.clear();
    for (const auto* t : {&frozen_dw_weight, &frozen_dw_bias, &frozen_pw_weight, &frozen_pw_bias})
      frozen_converted_.push_back(t->to(x.device(), x.scalar_type()));  // from the originals: no double rounding
  }
  return frozen_converted_;
}

torch::Tensor DeformableSlideAttention3DImpl::offsets(const torch::Tensor& x, const TokenGrid& grid) {
  return offsets_of(x, grid, grid, nullptr, nullptr);
}

torch::Tensor DeformableSlideAttention3DImpl::offsets_of(const torch::Tensor& x, const TokenGrid& local,
                                                         const TokenGrid& whole, const ops::FrameSplit* split,
                                                         ops::FrameExchange* group) {
  const int64_t B = x.size(0), D = options.dim(), G = options.groups(), K = kernel_volume();
  if (options.offsets() == DsaOffsets::kZero) {
    const auto eff = ops::effective_kernel(options.kernel(), whole.dims());
    return torch::zeros({B, local.t, local.h, local.w, G, eff[0] * eff[1] * eff[2], 3}, x.options());
  }
  auto tokens = x.view({B, local.t, local.h, local.w, D});
  int64_t before = 0;  // halo frames before this rank's own (the 3×3×3 convolution reaches one frame each way)
  if (group != nullptr) std::tie(tokens, before) = ops::gather_frame_halo(tokens, 1, 1, *split, *group);
  auto volume = tokens.permute({0, 4, 1, 2, 3});
  torch::Tensor hidden;
  if (options.offsets() == DsaOffsets::kFrozen) {
    const auto& w = frozen_weights_like(x);
    hidden = torch::gelu(torch::conv3d(volume, w[0], w[1], 1, 1, 1, D)).permute({0, 2, 3, 4, 1});
  } else {
    hidden = torch::gelu(offset_dw(volume)).permute({0, 2, 3, 4, 1});  // [B, T, H, W, D]
  }
  if (group != nullptr) hidden = hidden.narrow(1, before, local.t);
  torch::Tensor o;
  if (options.offsets() == DsaOffsets::kFrozen) {
    const auto& w = frozen_weights_like(x);
    o = torch::linear(hidden, w[2], w[3]);
  } else {
    o = offset_pw(hidden);
  }
  o = kernel_window(o.view({B, local.t, local.h, local.w, G, K, 3}), 5, whole);
  // Δ = range ⊙ tanh(o), the range as plain numbers: a tensor built from them would be a blocking
  // host-to-device copy in every forward (and rule out CUDA graphs).
  const auto& r = options.offset_range();
  auto t = torch::tanh(o);
  if (r[0] == r[1] && r[1] == r[2]) return t * r[0];
  return torch::stack({t.select(-1, 0) * r[0], t.select(-1, 1) * r[1], t.select(-1, 2) * r[2]}, -1);
}

torch::Tensor DeformableSlideAttention3DImpl::forward(const torch::Tensor& x, const TokenGrid& grid) {
  const int64_t D = options.dim(), M = options.heads();
  TORCH_CHECK(x.dim() == 3 && x.size(1) == grid.numel() && x.size(2) == D,
              "DeformableSlideAttention3D: expected tokens [B, ", grid.numel(), ", ", D, "], got ", x.sizes());
  const int64_t B = x.size(0);
  auto as_heads = [&](Linear& proj_) { return proj_(x).view({B, grid.t, grid.h, grid.w, M, D / M}); };
  auto out = ops::dsa3d(as_heads(q), as_heads(k), as_heads(v), offsets(x, grid), kernel_window(rel_bias, 1, grid),
                        options.kernel(), options.impl(), options.deterministic());
  return proj(out.reshape({B, grid.numel(), D}));
}

torch::Tensor DeformableSlideAttention3DImpl::forward_context_parallel(const torch::Tensor& x, const TokenGrid& grid,
                                                                       const ops::FrameSplit& split,
                                                                       ops::FrameExchange& group) {
  const int64_t D = options.dim(), M = options.heads(), r = group.rank();
  TORCH_CHECK(split.frames == grid.t, "DeformableSlideAttention3D: the split is of ", split.frames,
              " frames, the grid has ", grid.t);
  const TokenGrid local{split.size(r), grid.h, grid.w};
  TORCH_CHECK(x.dim() == 3 && x.size(1) == local.numel() && x.size(2) == D, "DeformableSlideAttention3D: rank ", r,
              " expected the tokens of its ", local.t, " frames [B, ", local.numel(), ", ", D, "], got ", x.sizes());
  const int64_t B = x.size(0);
  auto as_heads = [&](Linear& proj_) { return proj_(x).view({B, local.t, local.h, local.w, M, D / M}); };
  auto out = ops::dsa3d_context_parallel(
      as_heads(q), as_heads(k), as_heads(v), offsets_of(x, local, grid, &split, &group),
      kernel_window(rel_bias, 1, grid), options.kernel(), split, group, options.impl(), options.deterministic(),
      // zero offsets reach no frame beyond the window
      options.offsets() == DsaOffsets::kZero ? 0.0 : ops::offset_reach_bound(options.offset_range()[0]));
  return proj(out.reshape({B, local.numel(), D}));
}

}  // namespace megaslide
