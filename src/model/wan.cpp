#include "megaslide/model/wan.h"

#include "megaslide/model/text_encoder.h"

#include <cmath>
#include <vector>

namespace megaslide {

namespace {
torch::TensorOptions fp32_on(torch::Device device) {
  return torch::TensorOptions().dtype(torch::kFloat32).device(device);
}

// LayerNorm over the last dimension in fp32, rounded back to x's dtype by the caller (FP32LayerNorm).
torch::Tensor fp32_layer_norm(const torch::Tensor& x, int64_t dim, double eps, const torch::Tensor& weight = {},
                              const torch::Tensor& bias = {}) {
  return torch::layer_norm(x.to(torch::kFloat32), {dim}, weight.defined() ? weight.to(torch::kFloat32) : weight,
                           bias.defined() ? bias.to(torch::kFloat32) : bias, eps);
}

// The centred sub-window of a kernel-indexed dimension `dim` of `full` ([.., K, ..] with K = kt·kh·kw)
// for the effective kernel on `grid`: 3D-DSA on a grid smaller than the kernel uses the kernel's centre.
torch::Tensor kernel_window(const torch::Tensor& full, int64_t dim, const Int3& kernel, const TokenGrid& grid) {
  const auto eff = ops::effective_kernel(kernel, grid.dims());
  if (eff == kernel) return full;
  std::vector<int64_t> sizes(full.sizes().begin(), full.sizes().end());
  sizes.erase(sizes.begin() + dim);
  sizes.insert(sizes.begin() + dim, {kernel[0], kernel[1], kernel[2]});
  auto window = full.view(sizes);
  for (int a = 0; a < 3; ++a) window = window.narrow(dim + a, (kernel[a] - eff[a]) / 2, eff[a]);
  std::vector<int64_t> out(full.sizes().begin(), full.sizes().end());
  out[dim] = eff[0] * eff[1] * eff[2];
  return window.reshape(out);
}
}  // namespace

WanSelfAttention parse_wan_self_attention(const std::string& name) {
  if (name == "dense") return WanSelfAttention::kDense;
  if (name == "dsa3d") return WanSelfAttention::kDsa3d;
  TORCH_CHECK(false, "model.self_attention: expected dense or dsa3d, got '", name, "'");
}

WanOptions WanOptions::from_config(const RunConfig& config) {
  const auto& m = config.model;
  const auto& w = m.wan;
  return WanOptions()
      .dim(w.dim)
      .layers(w.layers)
      .heads(w.heads)
      .ffn_dim(w.ffn_dim)
      .freq_dim(w.freq_dim)
      .text_dim(w.text_dim)
      .patch(w.patch)
      .in_channels(w.in_channels)
      .out_channels(w.out_channels)
      .qk_norm(w.qk_norm)
      .cross_attn_norm(w.cross_attn_norm)
      .eps(w.eps)
      .image_dim(w.image_dim)
      .self_attention(parse_wan_self_attention(m.self_attention))
      .dsa_kernel(m.dsa_kernel)
      .dsa_groups(m.dsa_groups)
      .dsa_offset_range(m.dsa_offset_range)
      .dsa_offsets(m.dsa_offsets);
}

torch::Tensor wan_timestep_features(const torch::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == 1, "wan_timestep_features: expected timesteps [B], got ", t.sizes());
  const int64_t half = dim / 2;
  // diffusers' get_timestep_embedding, op for op in float32.
  auto exponent = torch::arange(0, half, fp32_on(t.device())) * (-std::log(10000.0));
  exponent = exponent / static_cast<double>(half);
  auto emb = t.to(torch::kFloat32).unsqueeze(1) * torch::exp(exponent).unsqueeze(0);
  auto out = torch::cat({torch::cos(emb), torch::sin(emb)}, -1);
  if (dim % 2 == 1) out = torch::constant_pad_nd(out, {0, 1});
  return out;
}

WanRope wan_rope(const TokenGrid& grid, int64_t head_dim, double theta, torch::Device device) {
  TORCH_CHECK(head_dim % 2 == 0, "wan_rope: the head size must be even, got ", head_dim);
  const int64_t hw_dim = 2 * (head_dim / 6), t_dim = head_dim - 2 * hw_dim;
  const int64_t sizes[3] = {grid.t, grid.h, grid.w};
  const int64_t dims[3] = {t_dim, hw_dim, hw_dim};
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  std::vector<torch::Tensor> angles;
  for (int a = 0; a < 3; ++a) {
    if (dims[a] == 0) continue;
    // θ^(−2j/n) for j < n/2 and positions 0 … size−1, all in float64 (diffusers' freqs_dtype).
    auto freqs = 1.0 / torch::pow(theta, torch::arange(0, dims[a], 2, f64) / static_cast<double>(dims[a]));
    auto axis = torch::outer(torch::arange(sizes[a], f64), freqs);  // [size, n/2]
    std::vector<int64_t> shape{1, 1, 1, dims[a] / 2};
    shape[a] = sizes[a];
    angles.push_back(axis.view(shape).expand({grid.t, grid.h, grid.w, dims[a] / 2}));
  }
  auto all = torch::cat(angles, -1).reshape({grid.numel(), head_dim / 2});
  return {all.cos().to(torch::kFloat32).to(device), all.sin().to(torch::kFloat32).to(device)};
}

torch::Tensor apply_wan_rope(const torch::Tensor& x, const WanRope& rope) {
  const int64_t N = x.size(1), d = x.size(3);
  TORCH_CHECK(rope.cos.size(0) == N && rope.cos.size(1) * 2 == d, "apply_wan_rope: tables [", rope.cos.size(0), ", ",
              rope.cos.size(1), "] do not fit x ", x.sizes());
  auto pairs = x.unflatten(-1, {d / 2, 2});
  auto x1 = pairs.select(-1, 0), x2 = pairs.select(-1, 1);
  auto cos = rope.cos.view({1, N, 1, d / 2}), sin = rope.sin.view({1, N, 1, d / 2});
  auto even = x1 * cos - x2 * sin;
  auto odd = x1 * sin + x2 * cos;
  return torch::stack({even, odd}, -1).flatten(-2).to(x.scalar_type());
}

WanRmsNormImpl::WanRmsNormImpl(int64_t dim_, double eps_, torch::Device device_)
    : dim(dim_), eps(eps_), device(device_) {
  reset();
}

void WanRmsNormImpl::reset() { weight = register_parameter("weight", torch::ones({dim}, fp32_on(device))); }

torch::Tensor WanRmsNormImpl::forward(const torch::Tensor& x) { return at::rms_norm(x, {dim}, weight, eps); }

WanAttentionImpl::WanAttentionImpl(const WanOptions& options_, bool self_attention)
    : options(options_), is_self(self_attention) {
  reset();
}

void WanAttentionImpl::reset() {
  const int64_t D = options.dim();
  const auto dev = options.device();
  to_q = register_module("to_q", Linear(LinearOptions(D, D).device(dev)));
  to_k = register_module("to_k", Linear(LinearOptions(D, D).device(dev)));
  to_v = register_module("to_v", Linear(LinearOptions(D, D).device(dev)));
  out = Linear(LinearOptions(D, D).device(dev));
  to_out = register_module("to_out", torch::nn::ModuleList(out));
  if (options.qk_norm()) {
    norm_q = register_module("norm_q", WanRmsNorm(D, options.eps(), dev));
    norm_k = register_module("norm_k", WanRmsNorm(D, options.eps(), dev));
  }
  if (!is_self && options.image_dim() > 0) {  // diffusers' added_kv_proj_dim: the image embedder's width, D
    add_k_proj = register_module("add_k_proj", Linear(LinearOptions(D, D).device(dev)));
    add_v_proj = register_module("add_v_proj", Linear(LinearOptions(D, D).device(dev)));
    norm_added_k = register_module("norm_added_k", WanRmsNorm(D, options.eps(), dev));
  }
  if (is_self && options.self_attention() == WanSelfAttention::kDsa3d) {
    const auto& k = options.dsa_kernel();
    const int64_t K = k[0] * k[1] * k[2], G = options.dsa_groups(), M = options.heads();
    TORCH_CHECK(M % G == 0, "Wan 3D-DSA: offset groups ", G, " must divide heads ", M);
    for (int a = 0; a < 3; ++a)
      TORCH_CHECK(k[a] >= 1 && k[a] % 2 == 1, "Wan 3D-DSA: kernel sizes must be odd and positive");
    TORCH_CHECK(options.dsa_offsets() != DsaOffsets::kFrozen, "Wan 3D-DSA: offsets must be learned or zero");
    if (options.dsa_offsets() == DsaOffsets::kLearned) {
      offset_dw =
          register_module("offset_dw", Conv3d(Conv3dOptions(D, D, {3, 3, 3}).padding({1, 1, 1}).groups(D).device(dev)));
      offset_pw = register_module("offset_pw", Linear(LinearOptions(D, G * K * 3).zero_init(true).device(dev)));
    }
    rel_bias = register_parameter("rel_bias", torch::zeros({M, K}, fp32_on(dev)));
  }
}

std::pair<torch::Tensor, torch::Tensor> WanAttentionImpl::normed_qk(const torch::Tensor& q, const torch::Tensor& k) {
  if (!options.qk_norm()) return {q, k};
  return {norm_q(q), norm_k(k)};
}

torch::Tensor WanAttentionImpl::dsa_offsets(const torch::Tensor& x, const TokenGrid& grid,
                                            const ops::ContextShard& cp) {
  const int64_t B = x.size(0), D = options.dim(), G = options.dsa_groups();
  const auto& kernel = options.dsa_kernel();
  const int64_t K = kernel[0] * kernel[1] * kernel[2];
  const TokenGrid local{cp.frames(grid.t), grid.h, grid.w};  // the whole grid without a group
  if (options.dsa_offsets() == DsaOffsets::kZero) {
    const auto eff = ops::effective_kernel(kernel, grid.dims());
    return torch::zeros({B, local.t, grid.h, grid.w, G, eff[0] * eff[1] * eff[2], 3}, x.options());
  }
  auto tokens = x.view({B, local.t, grid.h, grid.w, D});
  int64_t before = 0;  // the depthwise 3×3×3 convolution reaches one frame each way
  if (cp.active()) std::tie(tokens, before) = ops::gather_frame_halo(tokens, 1, 1, cp.split, *cp.group);
  auto hidden = torch::gelu(offset_dw(tokens.permute({0, 4, 1, 2, 3}))).permute({0, 2, 3, 4, 1});
  if (cp.active()) hidden = hidden.narrow(1, before, local.t);
  auto o = offset_pw(hidden);
  o = kernel_window(o.view({B, local.t, grid.h, grid.w, G, K, 3}), 5, kernel, grid);
  const auto& r = options.dsa_offset_range();
  auto t = torch::tanh(o);
  return torch::stack({t.select(-1, 0) * r[0], t.select(-1, 1) * r[1], t.select(-1, 2) * r[2]}, -1);
}

torch::Tensor WanAttentionImpl::forward_self(const torch::Tensor& x, const TokenGrid& grid, const WanRope& rope,
                                             const ops::ContextShard& cp) {
  const int64_t B = x.size(0), N = x.size(1), D = options.dim(), M = options.heads();
  const TokenGrid local{cp.frames(grid.t), grid.h, grid.w};  // the whole grid without a group
  TORCH_CHECK(!cp.active() || cp.split.frames == grid.t, "Wan self-attention: the split is of ", cp.split.frames,
              " frames, the grid has ", grid.t);
  TORCH_CHECK(N == local.numel(), "Wan self-attention: ", N, " tokens but ",
              cp.active() ? "this rank's frames of " : "", "the grid ha", cp.active() ? "ve " : "s ", local.numel());
  auto [q, k] = normed_qk(to_q(x), to_k(x));
  auto v = to_v(x).unflatten(2, {M, D / M});
  q = apply_wan_rope(q.unflatten(2, {M, D / M}), rope);
  k = apply_wan_rope(k.unflatten(2, {M, D / M}), rope);
  torch::Tensor o;
  if (options.self_attention() == WanSelfAttention::kDsa3d) {
    auto on_grid = [&](const torch::Tensor& t) { return t.reshape({B, local.t, grid.h, grid.w, M, D / M}); };
    auto bias = kernel_window(rel_bias, 1, options.dsa_kernel(), grid).to(q.scalar_type());
    const auto offsets = dsa_offsets(x, grid, cp).to(q.scalar_type());
    o = (cp.active()
             ? ops::dsa3d_context_parallel(on_grid(q), on_grid(k), on_grid(v), offsets, bias, options.dsa_kernel(),
                                           cp.split, *cp.group, options.dsa_impl(), /*deterministic=*/false,
                                           options.dsa_offsets() == DsaOffsets::kZero  // zero offsets: no reach
                                               ? 0.0
                                               : ops::offset_reach_bound(options.dsa_offset_range()[0]))
             : ops::dsa3d(on_grid(q), on_grid(k), on_grid(v), offsets, bias, options.dsa_kernel(), options.dsa_impl()))
            .reshape({B, N, D});
  } else if (cp.active()) {
    o = ops::ulysses_attention(q.contiguous(), k.contiguous(), v.contiguous(), cp.split, grid.h * grid.w, *cp.group)
            .reshape({B, N, D});
  } else {
    o = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            .transpose(1, 2)
            .reshape({B, N, D});
  }
  return out(o.to(x.scalar_type()));
}

torch::Tensor WanAttentionImpl::forward_cross(const torch::Tensor& x, const torch::Tensor& context,
                                              int64_t image_tokens) {
  const int64_t B = x.size(0), N = x.size(1), D = options.dim(), M = options.heads();
  TORCH_CHECK(image_tokens == 0 || add_k_proj, "Wan cross-attention: ", image_tokens,
              " image tokens, but the model has no image branch (model.wan.image_dim 0)");
  TORCH_CHECK(image_tokens >= 0 && image_tokens < context.size(1), "Wan cross-attention: ", image_tokens,
              " image tokens of a context of ", context.size(1));
  const auto text = image_tokens > 0 ? context.narrow(1, image_tokens, context.size(1) - image_tokens) : context;
  auto [q, k] = normed_qk(to_q(x), to_k(text));
  auto v = to_v(text);
  auto heads = [&](const torch::Tensor& t) { return t.unflatten(2, {M, D / M}).transpose(1, 2); };
  q = heads(q);
  auto o =
      at::scaled_dot_product_attention(q, heads(k), heads(v)).transpose(1, 2).reshape({B, N, D}).to(x.scalar_type());
  if (image_tokens > 0) {  // the same queries over the image's keys and values; the two outputs added
    const auto image = context.narrow(1, 0, image_tokens);
    auto k_img = norm_added_k(add_k_proj(image)), v_img = add_v_proj(image);
    o = o + at::scaled_dot_product_attention(q, heads(k_img), heads(v_img))
                .transpose(1, 2)
                .reshape({B, N, D})
                .to(x.scalar_type());
  }
  return out(o);
}

WanFeedForwardImpl::WanFeedForwardImpl(int64_t dim_, int64_t ffn_dim_, torch::Device device_, int64_t out_,
                                       bool gelu_tanh_)
    : dim(dim_), ffn_dim(ffn_dim_), out(out_ > 0 ? out_ : dim_), gelu_tanh(gelu_tanh_), device(device_) {
  reset();
}

void WanFeedForwardImpl::reset() {
  // diffusers' FeedForward: net = [GELU(proj = Linear), Dropout, Linear]; the names keep the positions.
  struct GeluProjImpl : torch::nn::Module {
    explicit GeluProjImpl(Linear linear) { register_module("proj", std::move(linear)); }
  };
  fc1 = Linear(LinearOptions(dim, ffn_dim).device(device));
  fc2 = Linear(LinearOptions(ffn_dim, out).device(device));
  net = register_module("net", torch::nn::ModuleList());
  net->push_back(std::make_shared<GeluProjImpl>(fc1));
  net->push_back(torch::nn::Identity());
  net->push_back(fc2);
}

torch::Tensor WanFeedForwardImpl::forward(const torch::Tensor& x) {
  return fc2(torch::gelu(fc1(x), gelu_tanh ? "tanh" : "none"));
}

WanBlockImpl::WanBlockImpl(const WanOptions& options_) : options(options_) { reset(); }

void WanBlockImpl::reset() {
  const int64_t D = options.dim();
  const auto dev = options.device();
  attn1 = register_module("attn1", WanAttention(options, /*self_attention=*/true));
  attn2 = register_module("attn2", WanAttention(options, /*self_attention=*/false));
  if (options.cross_attn_norm())
    norm2 = register_module("norm2", LayerNorm(LayerNormOptions(D).eps(options.eps()).device(dev)));
  ffn = register_module("ffn", WanFeedForward(D, options.ffn_dim(), dev));
  scale_shift_table = register_parameter("scale_shift_table", torch::empty({1, 6, D}, fp32_on(dev)));
  if (!dev.is_meta()) {
    torch::NoGradGuard no_grad;
    scale_shift_table.normal_().div_(std::sqrt(static_cast<double>(D)));
  }
  streamed_ = std::make_shared<torch::nn::Module>("WanBlockStreamed");
  streamed_->register_module("attn1", attn1.ptr());
  streamed_->register_module("attn2", attn2.ptr());
  streamed_->register_module("ffn", ffn.ptr());
}

torch::nn::Module& WanBlockImpl::streamed() { return *streamed_; }

torch::Tensor WanBlockImpl::forward(const torch::Tensor& x, const WanBlockContext& ctx) {
  return forward(x, ctx, scale_shift_table, norm2 ? norm2->weight : torch::Tensor(),
                 norm2 ? norm2->bias : torch::Tensor());
}

torch::Tensor WanBlockImpl::forward(const torch::Tensor& x, const WanBlockContext& ctx, const torch::Tensor& table,
                                    const torch::Tensor& norm2_weight, const torch::Tensor& norm2_bias) {
  const int64_t D = options.dim();
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 3 && x.size(2) == D, "WanBlock: expected tokens [B, N, ", D, "], got ", x.sizes());
  // Each [B, 1, D], or [B, N, D] with per-token timesteps (tproj [B, N, 6, D]).
  std::vector<torch::Tensor> mod;
  if (ctx.tproj.dim() == 4) {
    for (auto& m : (table.to(torch::kFloat32).unsqueeze(0) + ctx.tproj.to(torch::kFloat32)).chunk(6, 2))
      mod.push_back(m.squeeze(2));
  } else {
    mod = (table.to(torch::kFloat32) + ctx.tproj.to(torch::kFloat32)).chunk(6, 1);
  }
  const double eps = options.eps();
  auto h = (fp32_layer_norm(x, D, eps) * (1 + mod[1]) + mod[0]).to(dtype);
  auto y = (x.to(torch::kFloat32) + attn1->forward_self(h, ctx.grid, ctx.rope, ctx.cp) * mod[2]).to(dtype);
  h = options.cross_attn_norm() ? fp32_layer_norm(y, D, eps, norm2_weight, norm2_bias).to(dtype) : y;
  y = y + attn2->forward_cross(h, ctx.context.to(dtype), ctx.image_tokens);
  h = (fp32_layer_norm(y, D, eps) * (1 + mod[4]) + mod[3]).to(dtype);
  return (y.to(torch::kFloat32) + ffn(h).to(torch::kFloat32) * mod[5]).to(dtype);
}

WanMlpImpl::WanMlpImpl(int64_t in_, int64_t out_, bool gelu_tanh_, torch::Device device_)
    : in(in_), out(out_), gelu_tanh(gelu_tanh_), device(device_) {
  reset();
}

void WanMlpImpl::reset() {
  linear_1 = register_module("linear_1", Linear(LinearOptions(in, out).device(device)));
  linear_2 = register_module("linear_2", Linear(LinearOptions(out, out).device(device)));
}

torch::Tensor WanMlpImpl::forward(const torch::Tensor& x) {
  auto h = linear_1(x);
  return linear_2(gelu_tanh ? torch::gelu(h, "tanh") : torch::silu(h));
}

WanImageEmbedderImpl::WanImageEmbedderImpl(int64_t image_dim_, int64_t dim_, torch::Device device_)
    : image_dim(image_dim_), dim(dim_), device(device_) {
  reset();
}

void WanImageEmbedderImpl::reset() {
  // diffusers' WanImageEmbedding: FP32LayerNorm (eps 1e-5), FeedForward(mult 1, exact GELU), FP32LayerNorm.
  norm1 = register_module("norm1", LayerNorm(LayerNormOptions(image_dim).eps(1e-5).device(device)));
  ff = register_module("ff", WanFeedForward(image_dim, image_dim, device, dim, /*gelu_tanh=*/false));
  norm2 = register_module("norm2", LayerNorm(LayerNormOptions(dim).eps(1e-5).device(device)));
}

torch::Tensor WanImageEmbedderImpl::forward(const torch::Tensor& image) {
  const auto dtype = image.scalar_type();
  auto h = fp32_layer_norm(image, image_dim, 1e-5, norm1->weight, norm1->bias).to(dtype);
  return fp32_layer_norm(ff(h), dim, 1e-5, norm2->weight, norm2->bias).to(dtype);
}

WanConditionEmbedderImpl::WanConditionEmbedderImpl(const WanOptions& options_) : options(options_) { reset(); }

void WanConditionEmbedderImpl::reset() {
  const int64_t D = options.dim();
  const auto dev = options.device();
  time_embedder = register_module("time_embedder", WanMlp(options.freq_dim(), D, /*gelu_tanh=*/false, dev));
  time_proj = register_module("time_proj", Linear(LinearOptions(D, 6 * D).device(dev)));
  text_embedder = register_module("text_embedder", WanMlp(options.text_dim(), D, /*gelu_tanh=*/true, dev));
  if (options.image_dim() > 0)
    image_embedder = register_module("image_embedder", WanImageEmbedder(options.image_dim(), D, dev));
}

WanTransformerImpl::WanTransformerImpl(WanOptions options_) : options(std::move(options_)) { reset(); }

namespace {
// The parts reset() draws, each from the default CPU generator's current state.
Conv3d draw_patch_embedding(const WanOptions& o, torch::Device device) {
  const auto& p = o.patch();
  return Conv3d(Conv3dOptions(o.in_channels(), o.dim(), {p[0], p[1], p[2]}).stride({p[0], p[1], p[2]}).device(device));
}
Linear draw_proj_out(const WanOptions& o, torch::Device device) {
  const auto& p = o.patch();
  return Linear(LinearOptions(o.dim(), o.out_channels() * p[0] * p[1] * p[2]).device(device));
}
torch::Tensor draw_head_table(const WanOptions& o, torch::Device device) {
  auto table = torch::empty({1, 2, o.dim()}, fp32_on(device));
  if (!device.is_meta()) {
    torch::NoGradGuard no_grad;
    table.normal_().div_(std::sqrt(static_cast<double>(o.dim())));
  }
  return table;
}
// Copies `from`'s parameters into `to`'s, name by name (same module type).
void copy_parameters(torch::nn::Module& to, const torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  const auto source = from.named_parameters(true);
  for (auto& p : to.named_parameters(true)) p.value().copy_(source[p.key()]);
}
}  // namespace

void WanTransformerImpl::reset() {
  const int64_t D = options.dim();
  const auto dev = options.device();
  TORCH_CHECK(options.heads() > 0 && D % options.heads() == 0, "WanTransformer: dim ", D,
              " is not a multiple of heads ", options.heads());
  TORCH_CHECK(options.head_dim() % 2 == 0, "WanTransformer: the head size (dim / heads = ", options.head_dim(),
              ") must be even for 3D RoPE");
  patch_embedding = register_module("patch_embedding", draw_patch_embedding(options, dev));
  condition_embedder = register_module("condition_embedder", WanConditionEmbedder(options));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t l = 0; l < options.layers(); ++l) blocks->push_back(new_block(options.block_device().value_or(dev)));
  proj_out = register_module("proj_out", draw_proj_out(options, dev));
  scale_shift_table = register_parameter("scale_shift_table", draw_head_table(options, dev));
}

void WanTransformerImpl::initialise_prologue() {
  copy_parameters(*patch_embedding, *draw_patch_embedding(options, torch::kCPU));
  WanOptions cpu = options;
  copy_parameters(*condition_embedder, *WanConditionEmbedder(cpu.device(torch::kCPU)));
}

WanBlock WanTransformerImpl::new_block(torch::Device device) const {
  WanOptions block_options = options;
  return WanBlock(block_options.device(device));
}

void WanTransformerImpl::initialise_head() {
  copy_parameters(*proj_out, *draw_proj_out(options, torch::kCPU));
  torch::NoGradGuard no_grad;
  scale_shift_table.copy_(draw_head_table(options, torch::kCPU));
}

void WanTransformerImpl::replace_block(int64_t index, WanBlock block) {
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(blocks->size()), "WanTransformer::replace_block: block ",
              index, " out of range [0, ", blocks->size(), ")");
  // ModuleList cannot swap an element in place: rebuild it (blocks are handles; nothing is copied).
  torch::nn::ModuleList rebuilt;
  for (size_t i = 0; i < blocks->size(); ++i)
    rebuilt->push_back(static_cast<int64_t>(i) == index ? block.ptr() : blocks->ptr(i));
  blocks = replace_module("blocks", rebuilt);
}

torch::Tensor wan_image_condition(const torch::Tensor& image_latents) {
  TORCH_CHECK(image_latents.dim() == 5, "wan_image_condition: expected latents [B, C, T, H, W], got ",
              image_latents.sizes());
  const auto latents = image_latents.to(torch::kFloat32);
  auto mask = torch::zeros({latents.size(0), 4, latents.size(2), latents.size(3), latents.size(4)}, latents.options());
  mask.select(2, 0).fill_(1.0);
  return torch::cat({mask, latents}, 1);
}

TokenGrid WanTransformerImpl::token_grid(int64_t frames, int64_t height, int64_t width) const {
  const auto& p = options.patch();
  TORCH_CHECK(frames % p[0] == 0 && height % p[1] == 0 && width % p[2] == 0, "WanTransformer: video ", frames, "x",
              height, "x", width, " is not a whole number of ", p[0], "x", p[1], "x", p[2], " patches");
  return {frames / p[0], height / p[1], width / p[2]};
}

WanEmbedded WanTransformerImpl::embed(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                                      const torch::Tensor& image, ops::FrameExchange* context_group) {
  TORCH_CHECK(x.dim() == 5 && x.size(1) == options.in_channels(), "WanTransformer: expected latents [B, ",
              options.in_channels(), ", T, H, W], got ", x.sizes());
  const auto& p = options.patch();
  const int64_t tokens = (x.size(2) / p[0]) * (x.size(3) / p[1]) * (x.size(4) / p[2]);
  const bool per_token = timesteps.dim() == 2;
  TORCH_CHECK((timesteps.dim() == 1 || (per_token && timesteps.size(1) == tokens)) && timesteps.size(0) == x.size(0),
              "WanTransformer: expected timesteps [", x.size(0), "] or [", x.size(0), ", ", tokens,
              "] (per token), got ", timesteps.sizes());
  TORCH_CHECK(text.dim() == 3 && text.size(0) == x.size(0) && text.size(2) == options.text_dim(),
              "WanTransformer: expected text [", x.size(0), ", L, ", options.text_dim(), "], got ", text.sizes());
  WanEmbedded e;
  e.ctx.grid = token_grid(x.size(2), x.size(3), x.size(4));
  e.ctx.rope = wan_rope(e.ctx.grid, options.head_dim(), options.rope_theta(), x.device());
  auto mine = x, steps = timesteps;
  if (context_group != nullptr) {  // this rank's frames, their rows of the whole grid's positions and timesteps
    e.ctx.cp = {context_group, ops::FrameSplit::balanced(e.ctx.grid.t, context_group->size())};
    const int64_t frame_tokens = e.ctx.grid.h * e.ctx.grid.w;
    const int64_t first = e.ctx.cp.begin() * frame_tokens, count = e.ctx.cp.frames(e.ctx.grid.t) * frame_tokens;
    mine = x.narrow(2, e.ctx.cp.begin() * p[0], e.ctx.cp.frames(e.ctx.grid.t) * p[0]);
    e.ctx.rope = {e.ctx.rope.cos.narrow(0, first, count), e.ctx.rope.sin.narrow(0, first, count)};
    if (per_token) steps = timesteps.narrow(1, first, count);
  }
  e.tokens = patch_embedding(mine).flatten(2).transpose(1, 2).contiguous();
  auto& ce = *condition_embedder;
  e.temb = ce.time_embedder(wan_timestep_features(steps.flatten(), options.freq_dim()).to(x.device()));
  if (per_token) e.temb = e.temb.unflatten(0, {x.size(0), steps.size(1)});
  e.ctx.tproj = ce.time_proj(torch::silu(e.temb)).unflatten(per_token ? 2 : 1, {6, options.dim()});
  e.ctx.context = ce.text_embedder(text);
  TORCH_CHECK(image.defined() == (options.image_dim() > 0),
              options.image_dim() > 0 ? "WanTransformer: the image-to-video model (image_dim " +
                                            std::to_string(options.image_dim()) + ") needs the image's tokens"
                                      : std::string("WanTransformer: image tokens given to a text-to-video model"));
  if (image.defined()) {
    TORCH_CHECK(
        image.dim() == 3 && image.size(0) == x.size(0) && image.size(2) == options.image_dim() && image.size(1) >= 1,
        "WanTransformer: expected image tokens [", x.size(0), ", Li, ", options.image_dim(), "], got ", image.sizes());
    e.ctx.context = torch::cat({ce.image_embedder(image), e.ctx.context.to(image.scalar_type())}, 1);
    e.ctx.image_tokens = image.size(1);
  }
  return e;
}

torch::Tensor WanTransformerImpl::head(const torch::Tensor& tokens, const torch::Tensor& temb, const TokenGrid& grid) {
  const int64_t B = tokens.size(0), D = options.dim();
  std::vector<torch::Tensor> mod;  // shift, scale [B, 1, D], or [B, N, D] per token
  if (temb.dim() == 3) {
    for (auto& m : (scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, 2)) mod.push_back(m.squeeze(2));
  } else {
    mod = (scale_shift_table + temb.unsqueeze(1)).chunk(2, 1);
  }
  auto h = (fp32_layer_norm(tokens, D, options.eps()) * (1 + mod[1]) + mod[0]).to(tokens.scalar_type());
  h = proj_out(h);
  const auto& p = options.patch();
  // [B, t, h, w, pt, ph, pw, C] -> [B, C, t, pt, h, ph, w, pw] -> [B, C, T, H, W]
  h = h.reshape({B, grid.t, grid.h, grid.w, p[0], p[1], p[2], options.out_channels()})
          .permute({0, 7, 1, 4, 2, 5, 3, 6});
  return h.reshape({B, options.out_channels(), grid.t * p[0], grid.h * p[1], grid.w * p[2]});
}

torch::Tensor WanTransformerImpl::forward(const torch::Tensor& x, const torch::Tensor& timesteps,
                                          const torch::Tensor& text, const torch::Tensor& image) {
  auto e = embed(x, timesteps, text, image);
  auto h = e.tokens;
  for (const auto& block : *blocks) h = block->as<WanBlockImpl>()->forward(h, e.ctx);
  return head(h, e.temb, e.ctx.grid);
}

WanParameterCount count_wan_parameters(WanOptions options) {
  const int64_t layers = options.layers();
  options.device(torch::kMeta).layers(1);  // blocks are identical: count one
  WanTransformer one(options);
  WanParameterCount c;
  auto* block = (*one->blocks)[0]->as<WanBlockImpl>();
  c.per_block = count_parameters(*block);
  c.per_block_streamed = count_parameters(block->streamed());
  c.prologue = count_parameters(*one->patch_embedding) + count_parameters(*one->condition_embedder);
  c.epilogue = count_parameters(*one->proj_out) + one->scale_shift_table.numel();
  c.total = c.prologue + layers * c.per_block + c.epilogue;
  return c;
}

ParameterCount count_run_parameters(const RunConfig& config) {
  if (config.model.arch != Architecture::kWan) {
    ParameterCount c = count_dit_parameters(DiTOptions::from_config(config));
    if (config.model.text_encoder.kind == "builtin") {  // trained with the DiT, in its prologue
      TextEncoder text(
          TextEncoderOptions(CaptionTokenizer().vocab_size(), config.model.text_dim, config.data.max_text_tokens)
              .device(torch::kMeta));
      const int64_t n = count_parameters(*text);
      c.total += n;
      c.prologue += n;
    }
    return c;
  }
  const auto w = count_wan_parameters(WanOptions::from_config(config));
  // Wan2.2's two experts trained in one run: two DiTs of one architecture.
  const int64_t dits = config.model.wan.expert == "both" ? 2 : 1;
  ParameterCount c;
  c.total = dits * w.total;
  c.per_block = w.per_block;
  c.prologue = w.prologue;
  c.epilogue = w.epilogue;
  return c;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> wan_parameter_shapes(WanOptions options) {
  WanTransformer model(options.device(torch::kMeta));
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& p : model->named_parameters(true)) out.emplace_back(p.key(), p.value().sizes().vec());
  return out;
}

}  // namespace megaslide
