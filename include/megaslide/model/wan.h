// Wan2.1's video diffusion transformer (Wan-AI; diffusers' WanTransformer3DModel), numerically as
// diffusers computes it, with parameter names as diffusers names them (the checkpoint keys):
//
//   x [B, C, T, H, W] --patch_embedding (Conv3d, kernel = stride = patch)--> tokens [B, N, D]
//   t [B] (float) --sinusoid(freq_dim: cos half, then sin)--> time_embedder (Linear, SiLU, Linear) --> temb [B, D]
//                 --SiLU, time_proj--> tproj [B, 6, D]
//   text [B, L, text_dim] --text_embedder (Linear, GELU tanh, Linear)--> context [B, L, D]
//   Wan2.1 I2V (image_dim > 0): image [B, Li, image_dim] (CLIP's tokens) --image_embedder (fp32 LayerNorm,
//   Linear, GELU, Linear, fp32 LayerNorm)--> [B, Li, D], before the text in the context; the cross-attention
//   attends to the text with to_k/to_v and to the image tokens with add_k_proj/add_v_proj (norm_added_k over
//   their keys), with the same queries, and adds the two outputs before to_out.
//   per block, (shift1, scale1, gate1, shift2, scale2, gate2) = scale_shift_table [1, 6, D] + tproj (fp32):
//     x += gate1 · attn1(LN(x)·(1 + scale1) + shift1)              self-attention with RMSNorm over q and k
//                                                                    (across heads) and 3D RoPE on q and k
//     x += attn2(norm2(x), context)                                 cross-attention (RMSNorm over q and k; norm2
//                                                                    an affine LayerNorm or the identity)
//     x += gate2 · ffn(LN(x)·(1 + scale2) + shift2)                  Linear, GELU tanh, Linear
//   head: (shift, scale) = scale_shift_table [1, 2, D] + temb; proj_out(LN(x)·(1 + scale) + shift) --unpatchify-->
//         [B, out_channels, T, H, W]
//   Per-token timesteps (Wan2.2 TI2V-5B; diffusers' expand_timesteps): t [B, N], one per token in token order
//   (t, h, w): temb [B, N, D], tproj [B, N, 6, D], and every token is modulated by its own (its own shift,
//   scale and gate in each block and in the head). Equal timesteps give the [B] path's values.
//
// 3D RoPE: the head size d is split over (t, h, w) as (d − 4⌊d/6⌋, 2⌊d/6⌋, 2⌊d/6⌋); each axis rotates
// pairs of channels (2j, 2j+1) by position·θ^(−2j/axis_size), θ = 10000, the angles in float64.
//
// Precision, as diffusers runs the model in bf16 with its _keep_in_fp32_modules (rope, time_embedder,
// scale_shift_table, norm1, norm2, norm3): the blocks' residual stream stays in the compute dtype of
// the block input x; the modulation tables and norm2's weights are fp32 and the modulation arithmetic,
// LayerNorms and gated residual adds run in fp32 and are rounded back to x's dtype; the RoPE tables are
// fp32. In fp32 every one of these is exact, and the model equals diffusers' (tests/test_wan.cpp).
// For the streamed trainer the fp32 parameters of a block (scale_shift_table, norm2) are not streamed:
// WanBlock::streamed() is the module of the streamed ones (attn1, attn2, ffn); the others stay resident
// in fp32 (train/wan_family.h).
//
// The 3D-DSA retrofit (self_attention kDsa3d): attn1 keeps Wan's projections, norms and RoPE, and
// attends through ops::dsa3d over the latent token grid (attention/dsa3d.h) with three more parameters
// per block: attn1.offset_dw (depthwise 3×3×3 Conv3d on attn1's input), attn1.offset_pw (zero-initialised
// Linear, dim → G·K·3) and attn1.rel_bias ([heads, K], zero). At initialisation Δ = 0 and the bias is 0:
// each token attends to its (kt, kh, kw) neighbourhood, NATTEN's neighbourhood attention; a dense Wan
// checkpoint loads with only these missing. `dsa_offsets` kZero builds no offset network (Δ = 0 always).
//
// Build on torch::kMeta to count the parameters of the 14B model without allocating.
// Thread-safety: like any torch::nn::Module.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "megaslide/attention/dsa3d.h"
#include "megaslide/config/run_config.h"
#include "megaslide/model/attention.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/layers.h"

namespace megaslide {

enum class WanSelfAttention { kDense, kDsa3d };
WanSelfAttention parse_wan_self_attention(const std::string& name);  // "dense" | "dsa3d"

struct WanOptions {
  // model.wan, model.self_attention and the dsa_* keys of a run config.
  static WanOptions from_config(const RunConfig& config);

  TORCH_ARG(int64_t, dim) = 5120;
  TORCH_ARG(int64_t, layers) = 40;
  TORCH_ARG(int64_t, heads) = 40;
  TORCH_ARG(int64_t, ffn_dim) = 13824;
  TORCH_ARG(int64_t, freq_dim) = 256;
  TORCH_ARG(int64_t, text_dim) = 4096;
  TORCH_ARG(Int3, patch) = Int3{1, 2, 2};
  TORCH_ARG(int64_t, in_channels) = 16;
  TORCH_ARG(int64_t, out_channels) = 16;
  TORCH_ARG(bool, qk_norm) = true;
  TORCH_ARG(bool, cross_attn_norm) = true;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, rope_theta) = 10000.0;
  TORCH_ARG(int64_t, image_dim) = 0;  // Wan2.1 I2V's image branch (model.wan.image_dim); 0: none
  TORCH_ARG(WanSelfAttention, self_attention) = WanSelfAttention::kDense;
  TORCH_ARG(Int3, dsa_kernel) = Int3{3, 7, 7};
  TORCH_ARG(int64_t, dsa_groups) = 1;
  TORCH_ARG(Real3, dsa_offset_range) = Real3{1.0, 3.0, 3.0};
  TORCH_ARG(DsaOffsets, dsa_offsets) = DsaOffsets::kLearned;  // kLearned or kZero
  TORCH_ARG(ops::DsaImpl, dsa_impl) = ops::DsaImpl::kAuto;
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  // Where the blocks are built when not `device`: torch::kMeta gives a skeleton of the blocks (names and
  // shapes, no storage, nothing drawn) whose weights WanTransformerImpl::new_block draws one at a time.
  TORCH_ARG(std::optional<torch::Device>, block_device) = std::nullopt;

 public:  // (TORCH_ARG leaves the struct private)
  int64_t head_dim() const { return dim() / heads(); }
};

// diffusers' Timesteps(freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0) in float32:
// [cos(t·f_j), sin(t·f_j)], f_j = exp(−ln(10000)·j / (dim/2)), j < dim/2. t [B] (any real dtype) -> [B, dim].
torch::Tensor wan_timestep_features(const torch::Tensor& t, int64_t dim);

// The RoPE angles' cosine and sine for every token of `grid` [N, d/2] (float32, computed in float64),
// the (t, h, w) split as above.
struct WanRope {
  torch::Tensor cos, sin;  // [N, d/2]
};
WanRope wan_rope(const TokenGrid& grid, int64_t head_dim, double theta, torch::Device device);

// Image-to-video's conditioning channels (Wan2.1 I2V, Wan2.2 I2V-A14B; diffusers' WanImageToVideoPipeline) of
// the conditioning video's normalised latents [B, C, T, H, W] (the image, then black frames, through the VAE):
// the mask — 4 channels (the VAE's 4 frames per latent), 1 on the first latent frame (the image's), 0 elsewhere —
// then the latents: [B, 4 + C, T, H, W] float32. The DiT's input is the noisy latents, then these.
torch::Tensor wan_image_condition(const torch::Tensor& image_latents);
// Rotates x [B, N, M, d] (any floating dtype; the arithmetic in fp32, rounded back to x's dtype).
torch::Tensor apply_wan_rope(const torch::Tensor& x, const WanRope& rope);

// RMSNorm over the last dimension with a learned scale (torch.nn.RMSNorm).
class WanRmsNormImpl : public torch::nn::Cloneable<WanRmsNormImpl> {
 public:
  WanRmsNormImpl(int64_t dim, double eps, torch::Device device);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  int64_t dim;
  double eps;
  torch::Device device;
  torch::Tensor weight;
};
TORCH_MODULE(WanRmsNorm);

// Wan's attention (attn1: self, attn2: cross): to_q, to_k, to_v, to_out.0, norm_q, norm_k (qk_norm).
class WanAttentionImpl : public torch::nn::Cloneable<WanAttentionImpl> {
 public:
  WanAttentionImpl(const WanOptions& options, bool self_attention);
  void reset() override;
  // Self-attention: x [B, N, D] on `grid`, `rope` for q and k. Cross-attention: context [B, L, D], whose first
  // `image_tokens` are the image's (image_dim > 0: through add_k_proj and add_v_proj).
  // Over a context-parallel group (cp active): x and `rope` are this rank's frames' tokens of the whole `grid`;
  // dense attention through Ulysses' all-to-all (heads divisible by the group's size), 3D-DSA through its halo
  // exchange (the offset network's convolution takes a one-frame halo): this rank's rows of the one-rank result.
  torch::Tensor forward_self(const torch::Tensor& x, const TokenGrid& grid, const WanRope& rope,
                             const ops::ContextShard& cp = {});
  torch::Tensor forward_cross(const torch::Tensor& x, const torch::Tensor& context, int64_t image_tokens = 0);
  // 3D-DSA's offsets Δ [B, T, H, W, G, K_eff, 3] for attn1's input x (zeros for kZero).
  torch::Tensor dsa_offsets(const torch::Tensor& x, const TokenGrid& grid, const ops::ContextShard& cp = {});

  WanOptions options;
  bool is_self;
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, out{nullptr};
  torch::nn::ModuleList to_out{nullptr};        // [out]: diffusers' "to_out.0"
  WanRmsNorm norm_q{nullptr}, norm_k{nullptr};  // undefined without qk_norm
  // The image branch (cross-attention with image_dim > 0).
  Linear add_k_proj{nullptr}, add_v_proj{nullptr};
  WanRmsNorm norm_added_k{nullptr};
  // The 3D-DSA retrofit (self-attention with kDsa3d only).
  Conv3d offset_dw{nullptr};
  Linear offset_pw{nullptr};
  torch::Tensor rel_bias;

 private:
  std::pair<torch::Tensor, torch::Tensor> normed_qk(const torch::Tensor& q, const torch::Tensor& k);
};
TORCH_MODULE(WanAttention);

// FFN: ffn.net.0.proj (Linear dim -> ffn_dim), GELU tanh (or exact), ffn.net.2 (Linear ffn_dim -> out, 0: dim).
class WanFeedForwardImpl : public torch::nn::Cloneable<WanFeedForwardImpl> {
 public:
  WanFeedForwardImpl(int64_t dim, int64_t ffn_dim, torch::Device device, int64_t out = 0, bool gelu_tanh = true);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  int64_t dim, ffn_dim, out;
  bool gelu_tanh;
  torch::Device device;
  torch::nn::ModuleList net{nullptr};
  Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(WanFeedForward);

// What every block reads besides its input.
struct WanBlockContext {
  TokenGrid grid;        // the whole sample's
  ops::ContextShard cp;  // active: the tokens (and rope's rows, tproj's per token) are this rank's frames of grid
  TokenGrid local_grid() const { return TokenGrid{cp.frames(grid.t), grid.h, grid.w}; }
  WanRope rope;
  torch::Tensor tproj;       // [B, 6, D], or [B, N, 6, D] per token (any floating dtype; added to the table in fp32)
  torch::Tensor context;     // [B, L, D]: the image's tokens (I2V), then the text, after their embedders
  int64_t image_tokens = 0;  // how many of context's first tokens are the image's
};

class WanBlockImpl : public torch::nn::Cloneable<WanBlockImpl> {
 public:
  explicit WanBlockImpl(const WanOptions& options);
  void reset() override;
  // x [B, N, D] in the compute dtype. `table` and `norm2_weight`/`norm2_bias` default to this block's
  // own parameters; the streamed trainer passes its resident fp32 copies instead.
  torch::Tensor forward(const torch::Tensor& x, const WanBlockContext& ctx);
  torch::Tensor forward(const torch::Tensor& x, const WanBlockContext& ctx, const torch::Tensor& table,
                        const torch::Tensor& norm2_weight, const torch::Tensor& norm2_bias);
  // The parameters the streamed trainer streams (attn1, attn2, ffn: every matrix of the block), as one
  // module sharing this block's submodules; scale_shift_table and norm2 are not in it.
  torch::nn::Module& streamed();

  WanOptions options;
  WanAttention attn1{nullptr}, attn2{nullptr};
  LayerNorm norm2{nullptr};  // affine, cross_attn_norm only
  WanFeedForward ffn{nullptr};
  torch::Tensor scale_shift_table;  // [1, 6, D], randn / sqrt(D) as diffusers initialises it

 private:
  std::shared_ptr<torch::nn::Module> streamed_;
};
TORCH_MODULE(WanBlock);

// linear_1, activation (SiLU for the time embedder, GELU tanh for the text embedder), linear_2.
class WanMlpImpl : public torch::nn::Cloneable<WanMlpImpl> {
 public:
  WanMlpImpl(int64_t in, int64_t out, bool gelu_tanh, torch::Device device);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  int64_t in, out;
  bool gelu_tanh;
  torch::Device device;
  Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(WanMlp);

// Wan2.1 I2V's image_embedder: norm1 (fp32 LayerNorm, eps 1e-5), ff (Linear, exact GELU, Linear to D), norm2.
class WanImageEmbedderImpl : public torch::nn::Cloneable<WanImageEmbedderImpl> {
 public:
  WanImageEmbedderImpl(int64_t image_dim, int64_t dim, torch::Device device);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& image);
  int64_t image_dim, dim;
  torch::Device device;
  LayerNorm norm1{nullptr}, norm2{nullptr};
  WanFeedForward ff{nullptr};
};
TORCH_MODULE(WanImageEmbedder);

// diffusers' condition_embedder: time_embedder, time_proj, text_embedder (and image_embedder with image_dim).
class WanConditionEmbedderImpl : public torch::nn::Cloneable<WanConditionEmbedderImpl> {
 public:
  explicit WanConditionEmbedderImpl(const WanOptions& options);
  void reset() override;
  WanOptions options;
  WanMlp time_embedder{nullptr}, text_embedder{nullptr};
  Linear time_proj{nullptr};
  WanImageEmbedder image_embedder{nullptr};  // image_dim > 0
};
TORCH_MODULE(WanConditionEmbedder);

// The prologue's output: block input, the blocks' shared inputs and the head's conditioning.
struct WanEmbedded {
  torch::Tensor tokens;  // [B, N, D]
  WanBlockContext ctx;
  torch::Tensor temb;  // [B, D], or [B, N, D] per token
};

class WanTransformerImpl : public torch::nn::Cloneable<WanTransformerImpl> {
 public:
  explicit WanTransformerImpl(WanOptions options);
  void reset() override;

  // x [B, C, T, H, W] (T, H, W multiples of the patch), timesteps [B] (float: σ·1000 for flow matching)
  // or [B, N] per token (N the tokens of x, in token order), text [B, L, text_dim] -> [B, out_channels, T, H, W].
  // `image` [B, Li, image_dim]: the image tokens an image_dim > 0 model needs (and any other refuses).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                        const torch::Tensor& image = {});
  // With `context_group` (context parallelism): this rank's frames of FrameSplit::balanced(grid.t, group size)
  // only, their rows of the whole grid's RoPE (and of per-token timesteps), ctx.cp set; head(tokens, temb,
  // ctx.local_grid()) then gives this rank's frames.
  WanEmbedded embed(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                    const torch::Tensor& image = {}, ops::FrameExchange* context_group = nullptr);
  torch::Tensor head(const torch::Tensor& tokens, const torch::Tensor& temb, const TokenGrid& grid);
  TokenGrid token_grid(int64_t frames, int64_t height, int64_t width) const;

  // Construction part by part, for a trainer that never holds every block's weights at once
  // (train/wan_family.h). reset() draws, from LibTorch's default CPU generator in turn: the prologue
  // (patch_embedding, condition_embedder), blocks 0 … L−1, the head (proj_out, scale_shift_table). Each
  // of these draws its part exactly as reset() does, from the generator's current state: so a caller that
  // replays reset()'s order (restoring the generator's state at each part) gets reset()'s weights bit for
  // bit. initialise_prologue and initialise_head write the drawn values into the existing parameters
  // (identity and device kept); new_block returns block weights on `device` for replace_block.
  void initialise_prologue();
  WanBlock new_block(torch::Device device) const;
  void initialise_head();
  void replace_block(int64_t index, WanBlock block);

  WanOptions options;
  Conv3d patch_embedding{nullptr};
  WanConditionEmbedder condition_embedder{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  Linear proj_out{nullptr};
  torch::Tensor scale_shift_table;  // [1, 2, D]
};
TORCH_MODULE(WanTransformer);

// Parameter counts on the meta device. per_block_streamed excludes the fp32 block parameters the streamed
// trainer keeps resident (scale_shift_table, norm2).
struct WanParameterCount {
  int64_t total = 0;
  int64_t per_block = 0;
  int64_t per_block_streamed = 0;
  int64_t prologue = 0;  // patch and condition embeddings
  int64_t epilogue = 0;  // head
};
WanParameterCount count_wan_parameters(WanOptions options);

// The parameter count of the model a run config describes, whichever its architecture (the DiT family's
// count_dit_parameters with its built-in caption encoder, counted in the prologue; or count_wan_parameters, the
// total of both DiTs when Wan2.2's two experts train in one run, the parts one DiT's; meta device, nothing
// allocated).
ParameterCount count_run_parameters(const RunConfig& config);

// Parameter names and shapes of the model `options` describes, in registration order (meta device).
std::vector<std::pair<std::string, std::vector<int64_t>>> wan_parameter_shapes(WanOptions options);

}  // namespace megaslide
