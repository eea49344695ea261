#include "megaslide/model/dit.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include <cmath>

#include "model/table_cache.h"

namespace megaslide {

DiTOptions DiTOptions::from_config(const RunConfig& config) {
  const auto& m = config.model;
  return DiTOptions()
      .arch(m.arch)
      .in_channels(model_sample_shape(config)[0])
      .patch(m.patch)
      .hidden(m.hidden)
      .layers(m.layers)
      .heads(m.heads)
      .mlp_ratio(m.mlp_ratio)
      .text_dim(m.text_dim)
      .dsa_kernel(m.dsa_kernel)
      .dsa_groups(m.dsa_groups)
      .dsa_offset_range(m.dsa_offset_range)
      .dsa_offsets(m.dsa_offsets)
      .dense_materialized(m.dense_attention == "materialized")
      .swin_window(m.swin_window)
      .sincos_positions(m.position_embedding == "auto" ? std::nullopt
                                                       : std::optional<bool>(m.position_embedding == "sincos"));
}

torch::Tensor timestep_features(const torch::Tensor& t, int64_t dim, double max_period) {
  TORCH_CHECK(t.dim() == 1, "timestep_features: expected timesteps [B], got ", t.sizes());
  const int64_t half = dim / 2;
  auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(t.device());
  auto freqs = torch::exp(-std::log(max_period) * torch::arange(half, opts) / static_cast<double>(half));
  auto args = t.to(torch::kFloat32).unsqueeze(1) * freqs.unsqueeze(0);
  auto emb = torch::cat({torch::cos(args), torch::sin(args)}, 1);
  if (dim % 2 == 1) emb = torch::cat({emb, torch::zeros({t.size(0), 1}, opts)}, 1);
  return emb;
}

namespace {
// 1D sin-cos embedding of positions 0..n-1 with `dim` (even) channels: [n, dim].
torch::Tensor sincos_1d(int64_t n, int64_t dim) {
  auto pos = torch::arange(n, torch::kFloat64);
  auto omega = 1.0 / torch::pow(10000.0, torch::arange(dim / 2, torch::kFloat64) / static_cast<double>(dim / 2));
  auto args = pos.unsqueeze(1) * omega.unsqueeze(0);
  return torch::cat({torch::sin(args), torch::cos(args)}, 1).to(torch::kFloat32);
}

torch::Tensor modulate(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale) {
  return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}
}  // namespace

torch::Tensor sincos_position_embedding_3d(const TokenGrid& grid, int64_t dim) {
  TORCH_CHECK(dim >= 6 && dim % 2 == 0, "sincos_position_embedding_3d: dim must be even and >= 6, got ", dim);
  const int64_t dh = 2 * (dim / 6), dw = dh, dt = dim - dh - dw;
  auto et = sincos_1d(grid.t, dt).view({grid.t, 1, 1, dt}).expand({grid.t, grid.h, grid.w, dt});
  auto eh = sincos_1d(grid.h, dh).view({1, grid.h, 1, dh}).expand({grid.t, grid.h, grid.w, dh});
  auto ew = sincos_1d(grid.w, dw).view({1, 1, grid.w, dw}).expand({grid.t, grid.h, grid.w, dw});
  return torch::cat({et, eh, ew}, -1).reshape({grid.numel(), dim});
}

torch::Tensor sincos_position_table(const TokenGrid& grid, int64_t dim, torch::Device device, c10::ScalarType dtype) {
  static detail::TableCache cache(8);  // one per grid in use (buckets), device and dtype
  return cache.get({grid.t, grid.h, grid.w, dim}, device, dtype,
                   [&] { return sincos_position_embedding_3d(grid, dim); });
}

// --- small modules --------------------------------------------------------------------------------------

TimestepEmbedderImpl::TimestepEmbedderImpl(int64_t hidden_, int64_t frequency_dim_, torch::Device device_)
    : hidden(hidden_), frequency_dim(frequency_dim_), device(device_) {
  reset();
}

void TimestepEmbedderImpl::reset() {
  fc1 = register_module("fc1", Linear(LinearOptions(frequency_dim, hidden).device(device)));
  fc2 = register_module("fc2", Linear(LinearOptions(hidden, hidden).device(device)));
}

torch::Tensor TimestepEmbedderImpl::forward(const torch::Tensor& t) {
  auto f = timestep_features(t, frequency_dim).to(fc1->weight.scalar_type());
  return fc2(torch::silu(fc1(f)));
}

MlpImpl::MlpImpl(int64_t dim_, int64_t hidden_, torch::Device device_) : dim(dim_), hidden(hidden_), device(device_) {
  reset();
}

void MlpImpl::reset() {
  fc1 = register_module("fc1", Linear(LinearOptions(dim, hidden).device(device)));
  fc2 = register_module("fc2", Linear(LinearOptions(hidden, dim).device(device)));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x), "tanh")); }

// --- block ------------------------------------------------------------------------------------------------

DiTBlockImpl::DiTBlockImpl(DiTOptions options_, int64_t index_) : options(std::move(options_)), index(index_) {
  reset();
}

void DiTBlockImpl::reset() {
  const int64_t D = options.hidden(), M = options.heads();
  const auto dev = options.device();
  norm1 = register_module("norm1", LayerNorm(LayerNormOptions(D).affine(false).device(dev)));
  switch (options.arch()) {
    case Architecture::kDense3D:
      global_attn = register_module(
          "attn",
          GlobalSelfAttention(SelfAttentionOptions(D, M).materialize_scores(options.dense_materialized()).device(dev)));
      break;
    case Architecture::kSwin:
      window_attn = register_module(
          "attn", ShiftedWindowAttention3D(
                      WindowAttentionOptions(D, M).window(options.swin_window()).shifted(index % 2 == 1).device(dev)));
      break;
    case Architecture::kMegaSlide:
      dsa_attn =
          register_module("attn", DeformableSlideAttention3D(DeformableSlideAttentionOptions(D, M)
                                                                 .kernel(options.dsa_kernel())
                                                                 .groups(options.dsa_groups())
                                                                 .offset_range(options.dsa_offset_range())
                                                                 .offsets(options.dsa_offsets())
                                                                 .frozen_offset_seed(static_cast<uint64_t>(index))
                                                                 .impl(options.dsa_impl())
                                                                 .device(dev)));
      break;
    case Architecture::kWan:
      TORCH_CHECK(false, "DiTBlock: model.arch wan is WanTransformer's, not the DiT family's");
  }
  norm2 = register_module("norm2", LayerNorm(LayerNormOptions(D).device(dev)));
  cross_attn =
      register_module("cross_attn", CrossAttention(CrossAttentionOptions(D, options.text_dim(), M).device(dev)));
  norm3 = register_module("norm3", LayerNorm(LayerNormOptions(D).affine(false).device(dev)));
  const auto mlp_hidden = static_cast<int64_t>(std::llround(D * options.mlp_ratio()));
  mlp = register_module("mlp", Mlp(D, mlp_hidden, dev));
  modulation = register_parameter("modulation", torch::zeros({6, D}, torch::TensorOptions().device(dev)));
}

torch::Tensor DiTBlockImpl::self_attention(const torch::Tensor& x, const BlockContext& ctx) {
  const auto& grid = ctx.grid;
  if (ctx.cp.active()) {
    switch (options.arch()) {
      case Architecture::kDense3D:
        return global_attn->forward_context_parallel(x, grid, ctx.cp.split, *ctx.cp.group);
      case Architecture::kSwin:
        return window_attn->forward_context_parallel(x, grid, ctx.cp.split, *ctx.cp.group);
      case Architecture::kMegaSlide:
        return dsa_attn->forward_context_parallel(x, grid, ctx.cp.split, *ctx.cp.group);
      case Architecture::kWan:
        break;
    }
  }
  switch (options.arch()) {
    case Architecture::kDense3D:
      return global_attn(x, grid);
    case Architecture::kSwin:
      return window_attn(x, grid);
    case Architecture::kMegaSlide:
      return dsa_attn(x, grid);
    case Architecture::kWan:
      break;
  }
  TORCH_CHECK(false, "DiTBlock: unknown architecture");
}

torch::Tensor DiTBlockImpl::forward(const torch::Tensor& x, const BlockContext& ctx) {
  const int64_t B = x.size(0), D = options.hidden();
  auto mod = (ctx.t_mod.view({B, 6, D}) + modulation.unsqueeze(0)).unbind(1);
  const auto &shift1 = mod[0], &scale1 = mod[1], &gate1 = mod[2], &shift2 = mod[3], &scale2 = mod[4], &gate2 = mod[5];
  auto h = x + gate1.unsqueeze(1) * self_attention(modulate(norm1(x), shift1, scale1), ctx);
  h = h + cross_attn(norm2(h), ctx.text, ctx.text_mask);
  return h + gate2.unsqueeze(1) * mlp(modulate(norm3(h), shift2, scale2));
}

// --- model ------------------------------------------------------------------------------------------------

DiTImpl::DiTImpl(DiTOptions options_) : options(std::move(options_)) { reset(); }

namespace {
// One 64-bit draw from the generator InitGenerator::current() names (the same on every device: meta
// tensors draw nothing, so the draw is made here, explicitly).
uint64_t draw_init_seed() {
  at::Generator gen = InitGenerator::current();
  if (!gen.defined()) gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}
}  // namespace

void DiTImpl::reset() {
  const int64_t D = options.hidden(), C = options.in_channels();
  const auto& p = options.patch();
  const auto dev = options.device();
  TORCH_CHECK(D % options.heads() == 0, "DiT: hidden ", D, " is not divisible by heads ", options.heads());
  TORCH_CHECK(D >= 6 && D % 2 == 0, "DiT: hidden must be even and >= 6 (3D sin-cos positions), got ", D);
  init_seed = draw_init_seed();
  {
    InitGenerator parts(derive_seed(init_seed, 0));
    patch_embed = register_module("patch_embed", Conv3d(Conv3dOptions(C, D, p).stride(p).device(dev)));
    t_embedder = register_module("t_embedder", TimestepEmbedder(D, options.frequency_dim(), dev));
    t_mod = register_module("t_mod", Linear(LinearOptions(D, 6 * D).zero_init(true).device(dev)));
  }
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.layers(); ++i)
    blocks->push_back(initial_block(i, options.block_device().value_or(dev)));
  final_norm = register_module("final_norm", LayerNorm(LayerNormOptions(D).affine(false).device(dev)));
  final_modulation = register_parameter("final_modulation", torch::zeros({2, D}, torch::TensorOptions().device(dev)));
  final_proj =
      register_module("final_proj", Linear(LinearOptions(D, p[0] * p[1] * p[2] * C).zero_init(true).device(dev)));
}

DiTBlock DiTImpl::initial_block(int64_t index, torch::Device device) const {
  TORCH_CHECK(index >= 0 && index < options.layers(), "DiT::initial_block: block ", index, " out of range [0, ",
              options.layers(), ")");
  InitGenerator block_generator(derive_seed(init_seed, static_cast<uint64_t>(index) + 1));
  DiTOptions block_options = options;
  return DiTBlock(block_options.device(device), index);
}

void DiTImpl::replace_block(int64_t index, DiTBlock block) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(blocks->size()), "DiT::replace_block: block ", index,
              " out of range [0, ", blocks->size(), ")");
  // ModuleList cannot swap an element in place: rebuild it (blocks are handles; nothing is copied).
  torch::nn::ModuleList rebuilt;
  for (size_t i = 0; i < blocks->size(); ++i)
    rebuilt->push_back(static_cast<int64_t>(i) == index ? block.ptr() : blocks->ptr(i));
  blocks = replace_module("blocks", rebuilt);
}

TokenGrid DiTImpl::token_grid(int64_t frames, int64_t height, int64_t width) const {
  const auto& p = options.patch();
  TORCH_CHECK(frames % p[0] == 0 && height % p[1] == 0 && width % p[2] == 0, "DiT: video ", frames, "x", height, "x",
              width, " (T x H x W) is not divisible by the patch (", p[0], ", ", p[1], ", ", p[2], ")");
  return {frames / p[0], height / p[1], width / p[2]};
}

Embedded DiTImpl::embed(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                        const torch::Tensor& text_mask, ops::FrameExchange* context_group) {
  TORCH_CHECK(x.dim() == 5 && x.size(1) == options.in_channels(), "DiT: expected x [B, ", options.in_channels(),
              ", T, H, W], got ", x.sizes());
  TORCH_CHECK(timesteps.dim() == 1 && timesteps.size(0) == x.size(0),
              "DiT: expected timesteps [B] with B = ", x.size(0), ", got ", timesteps.sizes());
  TORCH_CHECK(text.dim() == 3 && text.size(0) == x.size(0) && text.size(2) == options.text_dim(),
              "DiT: expected text [B, L, ", options.text_dim(), "] with B = ", x.size(0), ", got ", text.sizes());
  const auto grid = token_grid(x.size(2), x.size(3), x.size(4));
  Embedded e;
  e.ctx.grid = grid;
  if (context_group != nullptr) e.ctx.cp = {context_group, ops::FrameSplit::balanced(grid.t, context_group->size())};
  const int64_t pt = options.patch()[0], frame_tokens = grid.h * grid.w;
  const auto mine = e.ctx.cp.active() ? x.narrow(2, e.ctx.cp.begin() * pt, e.ctx.cp.frames(grid.t) * pt) : x;
  e.tokens = patch_embed(mine).flatten(2).transpose(1, 2);  // [B, N, D] (this rank's frames)
  if (options.adds_sincos_positions()) {
    const auto table = sincos_position_table(grid, options.hidden(), e.tokens.device(), e.tokens.scalar_type());
    e.tokens =
        e.tokens + (e.ctx.cp.active() ? table.narrow(0, e.ctx.cp.begin() * frame_tokens, e.tokens.size(1)) : table);
  }
  e.t_emb = t_embedder(timesteps);
  e.ctx.t_mod = t_mod(torch::silu(e.t_emb));
  e.ctx.text = text;
  e.ctx.text_mask = text_mask;
  return e;
}

void DiTImpl::move_non_block_parts(torch::Device device) {
  patch_embed->to(device);
  t_embedder->to(device);
  t_mod->to(device);
  final_norm->to(device);
  final_proj->to(device);
  final_modulation.set_data(final_modulation.to(device));
}

torch::Tensor DiTImpl::head(const torch::Tensor& tokens, const torch::Tensor& t_emb, const TokenGrid& grid) {
  const int64_t B = tokens.size(0), C = options.in_channels();
  const auto& p = options.patch();
  auto mod = (final_modulation.unsqueeze(0) + t_emb.unsqueeze(1)).unbind(1);  // shift, scale: [B, D]
  auto y = final_proj(modulate(final_norm(tokens), mod[0], mod[1]));          // [B, N, pt*ph*pw*C]
  return y.view({B, grid.t, grid.h, grid.w, p[0], p[1], p[2], C})
      .permute({0, 7, 1, 4, 2, 5, 3, 6})
      .reshape({B, C, grid.t * p[0], grid.h * p[1], grid.w * p[2]});
}

torch::Tensor DiTImpl::forward(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                               const torch::Tensor& text_mask) {
  auto e = embed(x, timesteps, text, text_mask);
  auto h = e.tokens;
  for (const auto& block : *blocks) h = block->as<DiTBlockImpl>()->forward(h, e.ctx);
  return head(h, e.t_emb, e.ctx.grid);
}

DiT MegaSlideDiT(DiTOptions options) { return DiT(options.arch(Architecture::kMegaSlide)); }
DiT Dense3DDiT(DiTOptions options) { return DiT(options.arch(Architecture::kDense3D)); }
DiT SwinDiT(DiTOptions options) { return DiT(options.arch(Architecture::kSwin)); }

ParameterCount count_dit_parameters(DiTOptions options) {
  DiT model(options.device(torch::kMeta));
  ParameterCount c;
  c.total = count_parameters(*model);
  c.per_block = model->blocks->size() > 0 ? count_parameters(*model->blocks[0]) : 0;
  c.prologue =
      count_parameters(*model->patch_embed) + count_parameters(*model->t_embedder) + count_parameters(*model->t_mod);
  c.epilogue =
      count_parameters(*model->final_proj) + model->final_modulation.numel() + count_parameters(*model->final_norm);
  return c;
}

}  // namespace megaslide
