// The DiT family: one video diffusion transformer with a pluggable self-attention (DESIGN.md §4).
//
//   x [B, C, T, H, W] --patchify (pt, ph, pw)--> tokens [B, N, D] (+ 3D sin-cos positions: the dense and
//   Swin variants', or as DiTOptions::sincos_positions says) --L blocks--> final adaLN layer --unpatchify-->
//   ε [B, C, T, H, W]
//
// Block (PixArt-α's "adaLN-single" form of adaLN-Zero, see docs/architecture.md):
//   (shift1, scale1, gate1, shift2, scale2, gate2) = t_mod + block.modulation     (t_mod shared, [B, 6D])
//   x += gate1 · SelfAttn(LN(x)·(1 + scale1) + shift1)
//   x += CrossAttn(LN(x), text)
//   x += gate2 · MLP(LN(x)·(1 + scale2) + shift2)
// The shared t_mod projection, every block's modulation table and the cross-attention output start at
// zero, so every block is the identity when built.
//
// The model is split the way the streamed trainer needs it: a prologue (patch, timestep and position
// embeddings: embed()), a stack of blocks (blocks[i]->forward) and an epilogue (final layer and
// unpatchify: head()); forward() is their composition.
//
// Build on torch::kMeta to count parameters of configs that would not fit in memory.
//
// Initialisation: construction draws one 64-bit seed from the current generator (InitGenerator's, or
// LibTorch's default: torch::manual_seed), whatever the device; the non-block parts are drawn from a
// generator seeded from it, and block i from its own, derive_seed(init_seed, i + 1). So block i's
// weights depend only on that seed and i — initial_block(i) rebuilds them alone, in any order or thread
// — and a model whose blocks are a meta skeleton has the very non-block weights of one built in full.
// Thread-safety: like any torch::nn::Module.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/types.h>

#include <array>
#include <optional>

#include "megaslide/model/deformable_slide_attention.h"
#include "megaslide/config/run_config.h"
#include "megaslide/model/attention.h"
#include "megaslide/model/layers.h"

namespace megaslide {

struct DiTOptions {
  // The model section of a run config (in_channels from model_sample_shape: data.channels, or the VAE's latent
  // channels).
  static DiTOptions from_config(const RunConfig& config);
  // Whether the sin-cos position table is added: sincos_positions below, else the architecture's choice.
  bool adds_sincos_positions() const { return sincos_positions().value_or(arch() != Architecture::kMegaSlide); }

  TORCH_ARG(Architecture, arch) = Architecture::kMegaSlide;
  TORCH_ARG(int64_t, in_channels) = 3;
  TORCH_ARG(Int3, patch) = Int3{1, 2, 2};
  TORCH_ARG(int64_t, hidden) = 16;
  TORCH_ARG(int64_t, layers) = 2;
  TORCH_ARG(int64_t, heads) = 2;
  TORCH_ARG(double, mlp_ratio) = 4.0;
  TORCH_ARG(int64_t, text_dim) = 16;
  TORCH_ARG(Int3, dsa_kernel) = Int3{3, 7, 7};
  TORCH_ARG(int64_t, dsa_groups) = 1;
  TORCH_ARG(Real3, dsa_offset_range) = Real3{1.0, 3.0, 3.0};
  TORCH_ARG(DsaOffsets, dsa_offsets) = DsaOffsets::kLearned;
  TORCH_ARG(bool, dense_materialized) = false;  // dense3d: N x N scores written out (model.dense_attention)
  TORCH_ARG(ops::DsaImpl, dsa_impl) = ops::DsaImpl::kAuto;
  TORCH_ARG(Int3, swin_window) = Int3{3, 16, 16};
  // Whether the fixed 3D sin-cos position table is added to the tokens (model.position_embedding); unset: the
  // architecture's (dense3d and swin yes, megaslide no).
  TORCH_ARG(std::optional<bool>, sincos_positions) = std::nullopt;
  TORCH_ARG(int64_t, frequency_dim) = 256;  // sinusoidal timestep features before the MLP
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  // The blocks are built here instead when set: torch::kMeta gives the streamed trainer a skeleton of
  // names and shapes, whose weights DiTImpl::initial_block builds one block at a time.
  TORCH_ARG(std::optional<torch::Device>, block_device) = std::nullopt;
};

// Sinusoidal features of (possibly fractional) timesteps [B] -> [B, dim] (DiT's convention: cos half
// first, max period 10000).
torch::Tensor timestep_features(const torch::Tensor& t, int64_t dim, double max_period = 10000.0);

// Fixed 3D sin-cos position embedding [t*h*w, dim]: dim is split over (t, h, w) as
// (dim - 2·⌊dim/6⌋·2, 2·⌊dim/6⌋, 2·⌊dim/6⌋), each a 1D sin-cos embedding of that axis' index.
torch::Tensor sincos_position_embedding_3d(const TokenGrid& grid, int64_t dim);
// The same on `device` as `dtype`, built once per (grid, dim, device, dtype) and kept: every later call
// returns the same tensor (read-only). What the DiT's prologue adds in every step.
torch::Tensor sincos_position_table(const TokenGrid& grid, int64_t dim, torch::Device device, c10::ScalarType dtype);

class TimestepEmbedderImpl : public torch::nn::Cloneable<TimestepEmbedderImpl> {
 public:
  TimestepEmbedderImpl(int64_t hidden, int64_t frequency_dim, torch::Device device);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& t);  // [B] -> [B, hidden]

  int64_t hidden, frequency_dim;
  torch::Device device;
  Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TimestepEmbedder);

class MlpImpl : public torch::nn::Cloneable<MlpImpl> {
 public:
  MlpImpl(int64_t dim, int64_t hidden, torch::Device device);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  int64_t dim, hidden;
  torch::Device device;
  Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

// What every block needs besides its input: the grid, the shared timestep modulation and the text; over a
// context-parallel group, which of the grid's frames this rank's tokens are.
struct BlockContext {
  TokenGrid grid;        // the whole sample's
  ops::ContextShard cp;  // active: the tokens are this rank's frames of `grid` (attention/context_parallel.h)
  TokenGrid local_grid() const { return TokenGrid{cp.frames(grid.t), grid.h, grid.w}; }  // this rank's tokens
  torch::Tensor t_mod;                                                                   // [B, 6D]
  torch::Tensor text;                                                                    // [B, L, text_dim]
  torch::Tensor text_mask;                                                               // [B, L] bool or undefined
};

class DiTBlockImpl : public torch::nn::Cloneable<DiTBlockImpl> {
 public:
  DiTBlockImpl(DiTOptions options, int64_t index);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, const BlockContext& ctx);

  DiTOptions options;
  int64_t index;  // position in the stack (Swin shifts on odd blocks)
  LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  // Exactly one self-attention is built, registered as "attn".
  GlobalSelfAttention global_attn{nullptr};
  ShiftedWindowAttention3D window_attn{nullptr};
  DeformableSlideAttention3D dsa_attn{nullptr};
  CrossAttention cross_attn{nullptr};
  Mlp mlp{nullptr};
  torch::Tensor modulation;  // [6, D], zero init

 private:
  torch::Tensor self_attention(const torch::Tensor& x, const BlockContext& ctx);
};
TORCH_MODULE(DiTBlock);

// The prologue's output: tokens and the block context.
struct Embedded {
  torch::Tensor tokens;  // [B, N, D]
  BlockContext ctx;
  torch::Tensor t_emb;  // [B, D] (the epilogue's conditioning)
};

class DiTImpl : public torch::nn::Cloneable<DiTImpl> {
 public:
  explicit DiTImpl(DiTOptions options);
  void reset() override;

  // x [B, C, T, H, W], timesteps [B] (int64 or float), text [B, L, text_dim], text_mask [B, L] bool
  // (optional; true = real token, every row needs one) -> ε prediction with x's shape.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                        const torch::Tensor& text_mask = {});

  // With `context_group` (context parallelism, attention/context_parallel.h): the tokens of this rank's frames of
  // FrameSplit::balanced(grid.t, group size) only, with their rows of the whole grid's positions, and ctx.cp set;
  // every block then attends over the group and head(tokens, t_emb, ctx.local_grid()) gives this rank's frames.
  Embedded embed(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                 const torch::Tensor& text_mask = {}, ops::FrameExchange* context_group = nullptr);
  // tokens [B, N, D] -> ε [B, C, T, H, W] for the video grid `grid`.
  torch::Tensor head(const torch::Tensor& tokens, const torch::Tensor& t_emb, const TokenGrid& grid);

  TokenGrid token_grid(int64_t frames, int64_t height, int64_t width) const;

  // Block `index` with its initial weights, built alone on `device` (what reset() builds as block index
  // on options.device()).
  DiTBlock initial_block(int64_t index, torch::Device device) const;
  // Puts `block` in place of block `index` (the streamed trainer's block with its weights in the host
  // store, replacing a meta skeleton's).
  void replace_block(int64_t index, DiTBlock block);

  // Moves everything but the blocks (the embed() and head() parts) to `device`: how the streamed trainer
  // and the streamed sampler keep the prologue and epilogue resident while the blocks stream.
  void move_non_block_parts(torch::Device device);

  DiTOptions options;
  uint64_t init_seed = 0;  // drawn at construction (see above)
  Conv3d patch_embed{nullptr};
  TimestepEmbedder t_embedder{nullptr};
  Linear t_mod{nullptr};  // SiLU(t_emb) -> 6D, zero init, shared by all blocks
  torch::nn::ModuleList blocks{nullptr};
  LayerNorm final_norm{nullptr};
  torch::Tensor final_modulation;  // [2, D], zero init
  Linear final_proj{nullptr};      // D -> pt*ph*pw*C, zero init
};
TORCH_MODULE(DiT);

// The paper's three models: one DiT with 3D-DSA, global attention or shifted windows.
DiT MegaSlideDiT(DiTOptions options);
DiT Dense3DDiT(DiTOptions options);
DiT SwinDiT(DiTOptions options);

// Parameter counts (meta device: no allocation).
struct ParameterCount {
  int64_t total = 0;
  int64_t per_block = 0;  // of one block (blocks are identical in size)
  int64_t prologue = 0;   // patch, timestep embeddings, t_mod
  int64_t epilogue = 0;   // final layer
};
ParameterCount count_dit_parameters(DiTOptions options);

}  // namespace megaslide
