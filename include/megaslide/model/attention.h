// The self-attentions a DiT block can use, and the cross-attention to text tokens.
//
// Every self-attention maps tokens x [B, N, D] laid out row-major on a TokenGrid (N = t·h·w) to
// [B, N, D]: GlobalSelfAttention (all pairs, the dense baseline), ShiftedWindowAttention3D (Swin) and
// DeformableSlideAttention3D (model/deformable_slide_attention.h). All own their projections.
// Thread-safety: like any torch::nn::Module.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <array>

#include "megaslide/attention/context_parallel.h"
#include "megaslide/model/layers.h"

namespace megaslide {

// The token grid of one sample after patchify: (t, h, w) = (T/pt, H/ph, W/pw).
struct TokenGrid {
  int64_t t = 1, h = 1, w = 1;
  int64_t numel() const { return t * h * w; }
  std::array<int64_t, 3> dims() const { return {t, h, w}; }
};

// Splits [B, N, M*d] into heads [B, M, N, d] and back.
torch::Tensor split_heads(const torch::Tensor& x, int64_t heads);
torch::Tensor merge_heads(const torch::Tensor& x);

struct SelfAttentionOptions {
  SelfAttentionOptions(int64_t dim, int64_t heads) : dim_(dim), heads_(heads) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, heads);
  // false: at::scaled_dot_product_attention (LibTorch picks a fused flash or memory-efficient kernel
  // where it has one, the CPU included, which keeps no N x N matrix); true: softmax(q kᵀ / √d) v
  // written out, so the N x N scores live until backward (the model.dense_attention ablation).
  TORCH_ARG(bool, materialize_scores) = false;
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

// Global multi-head self-attention over all N tokens. O(N²) time; O(N²) memory only with
// materialize_scores. The dense baseline.
class GlobalSelfAttentionImpl : public torch::nn::Cloneable<GlobalSelfAttentionImpl> {
 public:
  explicit GlobalSelfAttentionImpl(SelfAttentionOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const TokenGrid& grid);
  // Over a context-parallel group (attention/context_parallel.h): `x` [B, T_r·h·w, D] holds the tokens of this rank's
  // frames of the whole `grid` (T = split.frames); returns their rows of forward(whole x, grid) through Ulysses'
  // all-to-all (ops::ulysses_attention: heads divisible by the group's size). Always the fused attention
  // (materialize_scores asks for the ablation of one rank). Collective.
  torch::Tensor forward_context_parallel(const torch::Tensor& x, const TokenGrid& grid, const ops::FrameSplit& split,
                                         ops::FrameExchange& group);

  SelfAttentionOptions options;
  Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(GlobalSelfAttention);

struct WindowAttentionOptions {
  WindowAttentionOptions(int64_t dim, int64_t heads) : dim_(dim), heads_(heads) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(Int3, window) = Int3{3, 16, 16};
  TORCH_ARG(bool, shifted) = false;  // odd blocks shift by half a window
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

// Window size and shift actually used on a grid (Video Swin's rule): an axis no longer than its window
// gets one window of the axis' length and no shift; otherwise the shift is ⌊window/2⌋ when shifted.
struct WindowLayout {
  std::array<int64_t, 3> window{}, shift{}, padded{};
};
WindowLayout window_layout(const TokenGrid& grid, std::array<int64_t, 3> window, bool shifted);

// Which keys each query of each window may see under layout `l` of `grid` (see below): [windows, Wn, Wn]
// bool on `device`, or undefined when every query may see every key of its window. Built once per
// (grid, layout, device) and kept: every later call returns the same tensor (read-only).
torch::Tensor shifted_window_mask(const TokenGrid& grid, const WindowLayout& l, torch::Device device);

// 3D (shifted) window attention, as Video Swin: the grid is padded to whole windows, cyclically rolled
// by -shift, and attention runs inside each window. A token attends to a key of its window only when
// both come from the same side of the roll's wrap on every axis and the key is not padding.
class ShiftedWindowAttention3DImpl : public torch::nn::Cloneable<ShiftedWindowAttention3DImpl> {
 public:
  explicit ShiftedWindowAttention3DImpl(WindowAttentionOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const TokenGrid& grid);
  // Over a context-parallel group (as GlobalSelfAttention's): the whole grid's windows along time, with the shift's
  // roll and mask, are the groups of frames [0, s), [s + k·w, s + (k+1)·w) ∩ [0, T) that attend among themselves
  // (w, s the time axis' window and shift of window_layout; s = 0 unshifted). Each rank takes from its neighbours
  // the frames of the groups its own frames fall in (ops::gather_frame_slab: at most w − 1 each way), attends within
  // each group (the rolled frames of the wrapped window are group [0, s) on the first rank) and keeps its own rows.
  // Exactly forward()'s rows; the halo's gradients go back to their owners. Collective.
  torch::Tensor forward_context_parallel(const torch::Tensor& x, const TokenGrid& grid, const ops::FrameSplit& split,
                                         ops::FrameExchange& group);

  WindowAttentionOptions options;
  Linear qkv{nullptr}, proj{nullptr};

 private:
  // x [B, grid.numel(), D] through the windows of layout `l` of `grid`.
  torch::Tensor attend(const torch::Tensor& x, const TokenGrid& grid, const WindowLayout& l);
};
TORCH_MODULE(ShiftedWindowAttention3D);

struct CrossAttentionOptions {
  CrossAttentionOptions(int64_t dim, int64_t context_dim, int64_t heads)
      : dim_(dim), context_dim_(context_dim), heads_(heads) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, context_dim);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

// Queries from the video tokens, keys and values from text tokens [B, L, context_dim]. The output
// projection starts at zero so that a freshly built block is the identity (adaLN-Zero's promise).
class CrossAttentionImpl : public torch::nn::Cloneable<CrossAttentionImpl> {
 public:
  explicit CrossAttentionImpl(CrossAttentionOptions options);
  void reset() override;
  // text_mask: [B, L] bool, true = a real token; undefined = all real.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& text, const torch::Tensor& text_mask);

  CrossAttentionOptions options;
  Linear q{nullptr}, kv{nullptr}, proj{nullptr};
};
TORCH_MODULE(CrossAttention);

}  // namespace megaslide
