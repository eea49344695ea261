// DeformableSlideAttention3D: the 3D-DSA self-attention module of MegaSlideDiT (DESIGN.md §5).
//
//   q, k, v = x Wq, x Wk, x Wv                     (k, v stay dense feature maps on the token grid)
//   o = Wpw(GELU(DWConv3d_3x3x3(x)))               (G·K·3 numbers per token; Wpw starts at zero)
//   Δ = range ⊙ tanh(o)                            (per-axis range in tokens, (t, h, w))
//   out = Wo · dsa3d(q, k, v, Δ, B, kernel)        (B: learned relative-position bias [M, K], zero init)
//
// The operator runs the implementation `impl` picks (default kAuto: the fused CPU or CUDA kernel of the
// input's device, trained through its autograd function; kReference: the grid_sample reference).
//
// At initialisation Δ = 0 and B = 0, so the module starts as plain neighbourhood attention.
// `offsets` is the paper's offset ablation (model.dsa_offsets): kLearned trains the offset network
// above; kZero builds none and Δ stays 0 (fixed neighbourhood attention); kFrozen holds an offset
// network of the same shape whose weights are drawn once from a generator seeded with
// `frozen_offset_seed` (LibTorch's default Conv3d/Linear initialisation ranges, Wpw not zeroed) and are
// not parameters: nothing trains them, they are not streamed or saved, and Δ is fixed per input.
// Parameters are created for the full kernel; on a grid smaller than the kernel the sub-window of the
// kernel's centre is used (the effective kernel of ops::effective_kernel).
// Thread-safety: like any torch::nn::Module.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <array>
#include <vector>

#include "megaslide/attention/context_parallel.h"
#include "megaslide/attention/dsa3d.h"
#include "megaslide/config/run_config.h"
#include "megaslide/model/attention.h"
#include "megaslide/model/layers.h"

namespace megaslide {

struct DeformableSlideAttentionOptions {
  DeformableSlideAttentionOptions(int64_t dim, int64_t heads) : dim_(dim), heads_(heads) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(Int3, kernel) = Int3{3, 7, 7};
  TORCH_ARG(int64_t, groups) = 1;  // offset groups; heads of a group share offsets
  TORCH_ARG(Real3, offset_range) = Real3{1.0, 3.0, 3.0};
  TORCH_ARG(DsaOffsets, offsets) = DsaOffsets::kLearned;
  TORCH_ARG(uint64_t, frozen_offset_seed) = 0;          // kFrozen: seeds the fixed offset network's weights
  TORCH_ARG(ops::DsaImpl, impl) = ops::DsaImpl::kAuto;  // kAuto: the fused kernel of the input's device
  TORCH_ARG(bool, deterministic) = false;               // bit-identical fused backward (ops::dsa3d)
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

class DeformableSlideAttention3DImpl : public torch::nn::Cloneable<DeformableSlideAttention3DImpl> {
 public:
  explicit DeformableSlideAttention3DImpl(DeformableSlideAttentionOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const TokenGrid& grid);

  // The offsets Δ [B, T, H, W, G, K, 3] the module would sample with (zeros for kZero).
  torch::Tensor offsets(const torch::Tensor& x, const TokenGrid& grid);
  // Over a context-parallel group (attention/context_parallel.h): `x` [B, T_r·H·W, D] holds the tokens of this
  // rank's frames of the whole `grid` (T = split.frames); returns their rows of forward(whole x, grid), exactly:
  // the offset network's 3×3×3 depthwise convolution takes a frame of halo from each temporal neighbour, the
  // attention its key/value halo (ops::dsa3d_context_parallel). The parameters' gradients are this rank's share
  // (sum them over the group). Collective: every rank of the group calls it at the same point.
  torch::Tensor forward_context_parallel(const torch::Tensor& x, const TokenGrid& grid, const ops::FrameSplit& split,
                                         ops::FrameExchange& group);

  int64_t kernel_volume() const;  // K of the full kernel

  DeformableSlideAttentionOptions options;
  Linear q{nullptr}, k{nullptr}, v{nullptr}, proj{nullptr};
  Conv3d offset_dw{nullptr};  // depthwise 3x3x3 (groups = dim); kLearned only
  Linear offset_pw{nullptr};  // dim -> G*K*3, zero init; kLearned only
  // kFrozen: the fixed offset network's weights (plain tensors, not parameters or buffers).
  torch::Tensor frozen_dw_weight, frozen_dw_bias, frozen_pw_weight, frozen_pw_bias;
  torch::Tensor rel_bias;  // [heads, K], zero init

 private:
  // `full_kernel` (the full kernel's K along `dim`) restricted to the sub-window used on `grid`: views,
  // so no index tensor is copied to the device; `full_kernel` itself when the whole kernel is used.
  torch::Tensor kernel_window(const torch::Tensor& full_kernel, int64_t dim, const TokenGrid& grid) const;
  // The offsets of the tokens `x` of a `local` grid that is part of `whole` (the same for one rank); with a group,
  // `local` is this rank's frames and the convolution's temporal halo comes from its neighbours.
  torch::Tensor offsets_of(const torch::Tensor& x, const TokenGrid& local, const TokenGrid& whole,
                           const ops::FrameSplit* split, ops::FrameExchange* group);
  // kFrozen: the four frozen tensors on the input's device and dtype, converted once per (device, dtype)
  // rather than on every forward (they are not parameters, so Module::to() does not move them).
  const std::vector<torch::Tensor>& frozen_weights_like(const torch::Tensor& x);
  std::vector<torch::Tensor> frozen_converted_;
};
TORCH_MODULE(DeformableSlideAttention3D);

}  // namespace megaslide
