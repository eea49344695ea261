#include "megaslide/model/sd_vae.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "io/pretrained.h"

namespace megaslide {

namespace {

constexpr double kNormEps = 1e-6;

SdVaeConfig parse_config(const nlohmann::json& j, const std::string& source) {
  SdVaeConfig c;
  auto bad = [&](const std::string& what) { throw io::PretrainedError("'" + source + "': " + what); };
  c.in_channels = io::json_int(j, "in_channels", c.in_channels, source);
  c.out_channels = io::json_int(j, "out_channels", c.out_channels, source);
  c.latent_channels = io::json_int(j, "latent_channels", c.latent_channels, source);
  c.layers_per_block = io::json_int(j, "layers_per_block", c.layers_per_block, source);
  c.norm_num_groups = io::json_int(j, "norm_num_groups", c.norm_num_groups, source);
  c.scaling_factor = io::json_real(j, "scaling_factor", c.scaling_factor, source);
  c.shift_factor = io::json_real(j, "shift_factor", c.shift_factor, source);
  auto flag = [&](const char* key, bool& slot) {
    if (!j.contains(key) || j.at(key).is_null()) return;
    if (!j.at(key).is_boolean()) bad(std::string("\"") + key + "\" must be true or false, got " + j.at(key).dump());
    slot = j.at(key).get<bool>();
  };
  flag("use_quant_conv", c.use_quant_conv);
  flag("use_post_quant_conv", c.use_post_quant_conv);
  flag("mid_block_add_attention", c.mid_block_add_attention);
  if (j.contains("block_out_channels")) {
    const auto& b = j.at("block_out_channels");
    if (!b.is_array() || b.empty()) bad("\"block_out_channels\" must be a non-empty list of integers, got " + b.dump());
    c.block_out_channels.clear();
    for (const auto& v : b) {
      if (!v.is_number_integer() || v.get<int64_t>() < 1)
        bad("\"block_out_channels\" must be a list of positive integers, got " + b.dump());
      c.block_out_channels.push_back(v.get<int64_t>());
    }
  }
  const auto levels = c.block_out_channels.size();
  for (const char* key : {"down_block_types", "up_block_types"}) {
    if (!j.contains(key)) continue;
    const auto& t = j.at(key);
    const std::string expected = std::string(key) == "down_block_types" ? "DownEncoderBlock2D" : "UpDecoderBlock2D";
    if (!t.is_array() || t.size() != levels)
      bad(std::string("\"") + key + "\" must list " + std::to_string(levels) + " blocks (one per block_out_channels)");
    for (const auto& v : t)
      if (v != expected) bad(std::string("\"") + key + "\": only " + expected + " is supported, got " + v.dump());
  }
  const auto act = io::json_string(j, "act_fn", "silu", source);
  if (act != "silu") bad("\"act_fn\": only silu is supported, got \"" + act + "\"");
  for (auto v : {c.in_channels, c.out_channels, c.latent_channels, c.layers_per_block, c.norm_num_groups})
    if (v < 1) bad("channel counts, layers_per_block and norm_num_groups must be >= 1");
  for (auto ch : c.block_out_channels)
    if (ch % c.norm_num_groups != 0)
      bad("block_out_channels " + std::to_string(ch) + " is not a multiple of norm_num_groups " +
          std::to_string(c.norm_num_groups));
  if (!(c.scaling_factor > 0)) bad("\"scaling_factor\" must be > 0");
  return c;
}

}  // namespace

SdVae SdVae::load(const std::string& dir, torch::Device device, torch::ScalarType dtype) {
  io::PretrainedFolder folder(dir, {"diffusion_pytorch_model.safetensors", "model.safetensors"});
  return build(parse_config(folder.config(), io::join_path(dir, "config.json")), device, dtype,
               [&](const std::string& name, const std::vector<std::string>& legacy, const std::vector<int64_t>& shape) {
                 std::vector<std::string> names{name};
                 names.insert(names.end(), legacy.begin(), legacy.end());
                 return folder.take_any(names, shape, dtype);
               });
}

SdVae SdVae::random(const SdVaeConfig& config, uint64_t seed, torch::Device device, torch::ScalarType dtype) {
  auto g = at::detail::createCPUGenerator(seed);
  return build(config, device, dtype,
               [&](const std::string& name, const std::vector<std::string>&, const std::vector<int64_t>& shape) {
                 // Unit-variance activations: weights ~ N(0, 1/fan_in), GroupNorm weights 1, biases 0.
                 if (shape.size() == 1)
                   return name.find("norm") != std::string::npos && name.size() > 7 &&
                                  name.substr(name.size() - 7) == ".weight"
                              ? torch::ones(shape, dtype)
                              : torch::zeros(shape, dtype);
                 const int64_t fan_in = c10::multiply_integers(shape.begin() + 1, shape.end());
                 return (torch::randn(shape, g, torch::kFloat32) / std::sqrt(static_cast<double>(fan_in))).to(dtype);
               });
}

SdVae SdVae::build(const SdVaeConfig& config, torch::Device device, torch::ScalarType dtype,
                   const WeightSource& source) {
  SdVae vae;
  vae.config_ = config;
  vae.device_ = device;
  vae.dtype_ = dtype;
  const auto& c = vae.config_;
  auto take = [&](const std::string& name, std::vector<int64_t> shape, std::vector<std::string> legacy = {}) {
    vae.w_[name] = source(name, legacy, shape).to(device);
  };
  auto conv = [&](const std::string& p, int64_t in, int64_t out, int64_t k) {
    take(p + ".weight", {out, in, k, k});
    take(p + ".bias", {out});
  };
  auto norm = [&](const std::string& p, int64_t ch) {
    take(p + ".weight", {ch});
    take(p + ".bias", {ch});
  };
  auto resnet = [&](const std::string& p, int64_t in, int64_t out) {
    norm(p + ".norm1", in);
    conv(p + ".conv1", in, out, 3);
    norm(p + ".norm2", out);
    conv(p + ".conv2", out, out, 3);
    if (in != out) conv(p + ".conv_shortcut", in, out, 1);
  };
  auto mid = [&](const std::string& p, int64_t ch) {
    resnet(p + ".resnets.0", ch, ch);
    if (c.mid_block_add_attention) {
      const auto a = p + ".attentions.0";
      norm(a + ".group_norm", ch);
      for (auto [name, legacy] : {std::pair<const char*, const char*>{"to_q", "query"},
                                  {"to_k", "key"},
                                  {"to_v", "value"},
                                  {"to_out.0", "proj_attn"}}) {
        take(a + "." + name + ".weight", {ch, ch}, {a + "." + legacy + ".weight"});
        take(a + "." + name + ".bias", {ch}, {a + "." + legacy + ".bias"});
      }
    }
    resnet(p + ".resnets.1", ch, ch);
  };
  const auto& ch = c.block_out_channels;
  const auto levels = static_cast<int64_t>(ch.size());
  // Encoder.
  conv("encoder.conv_in", c.in_channels, ch[0], 3);
  for (int64_t i = 0; i < levels; ++i) {
    const auto p = "encoder.down_blocks." + std::to_string(i);
    const int64_t in = i == 0 ? ch[0] : ch[i - 1];
    for (int64_t j = 0; j < c.layers_per_block; ++j)
      resnet(p + ".resnets." + std::to_string(j), j == 0 ? in : ch[i], ch[i]);
    if (i + 1 < levels) conv(p + ".downsamplers.0.conv", ch[i], ch[i], 3);
  }
  mid("encoder.mid_block", ch.back());
  norm("encoder.conv_norm_out", ch.back());
  conv("encoder.conv_out", ch.back(), 2 * c.latent_channels, 3);
  if (c.use_quant_conv) conv("quant_conv", 2 * c.latent_channels, 2 * c.latent_channels, 1);
  // Decoder.
  if (c.use_post_quant_conv) conv("post_quant_conv", c.latent_channels, c.latent_channels, 1);
  conv("decoder.conv_in", c.latent_channels, ch.back(), 3);
  mid("decoder.mid_block", ch.back());
  int64_t previous = ch.back();
  for (int64_t i = 0; i < levels; ++i) {
    const auto p = "decoder.up_blocks." + std::to_string(i);
    const int64_t out = ch[static_cast<size_t>(levels - 1 - i)];
    for (int64_t j = 0; j <= c.layers_per_block; ++j)
      resnet(p + ".resnets." + std::to_string(j), j == 0 ? previous : out, out);
    if (i + 1 < levels) conv(p + ".upsamplers.0.conv", out, out, 3);
    previous = out;
  }
  norm("decoder.conv_norm_out", ch[0]);
  conv("decoder.conv_out", ch[0], c.out_channels, 3);
  return vae;
}

int64_t SdVae::parameter_count() const {
  int64_t n = 0;
  for (const auto& [name, t] : w_) n += t.numel();
  return n;
}

const torch::Tensor& SdVae::w(const std::string& name) const {
  auto it = w_.find(name);
  TORCH_CHECK(it != w_.end(), "SdVae: no weight ", name);
  return it->second;
}

torch::Tensor SdVae::norm_act(const std::string& p, const torch::Tensor& x) const {
  return at::silu(at::group_norm(x, config_.norm_num_groups, w(p + ".weight"), w(p + ".bias"), kNormEps));
}

torch::Tensor SdVae::conv(const std::string& p, const torch::Tensor& x, int64_t stride, int64_t padding) const {
  return at::conv2d(x, w(p + ".weight"), w(p + ".bias"), {stride, stride}, {padding, padding});
}

torch::Tensor SdVae::resnet(const std::string& p, const torch::Tensor& x) const {
  auto h = conv(p + ".conv1", norm_act(p + ".norm1", x));
  h = conv(p + ".conv2", norm_act(p + ".norm2", h));
  auto shortcut = w_.count(p + ".conv_shortcut.weight") ? conv(p + ".conv_shortcut", x, 1, 0) : x;
  return shortcut + h;
}

torch::Tensor SdVae::attention(const std::string& p, const torch::Tensor& x) const {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  auto h = at::group_norm(x, config_.norm_num_groups, w(p + ".group_norm.weight"), w(p + ".group_norm.bias"), kNormEps);
  h = h.view({B, C, H * W}).transpose(1, 2);  // [B, HW, C]: one head over every position
  auto q = at::linear(h, w(p + ".to_q.weight"), w(p + ".to_q.bias")).unsqueeze(1);
  auto k = at::linear(h, w(p + ".to_k.weight"), w(p + ".to_k.bias")).unsqueeze(1);
  auto v = at::linear(h, w(p + ".to_v.weight"), w(p + ".to_v.bias")).unsqueeze(1);
  auto a = at::scaled_dot_product_attention(q, k, v).squeeze(1);
  a = at::linear(a, w(p + ".to_out.0.weight"), w(p + ".to_out.0.bias"));
  return x + a.transpose(1, 2).reshape({B, C, H, W});
}

std::pair<torch::Tensor, torch::Tensor> SdVae::encode_distribution(const torch::Tensor& images) const {
  const auto& c = config_;
  const int64_t f = c.downscale();
  TORCH_CHECK(images.dim() == 4 && images.size(1) == c.in_channels, "SdVae::encode: expected images [N, ",
              c.in_channels, ", H, W], got ", images.sizes());
  TORCH_CHECK(images.size(2) % f == 0 && images.size(3) % f == 0, "SdVae::encode: H and W must be multiples of ", f,
              ", got ", images.size(2), "x", images.size(3));
  torch::NoGradGuard no_grad;
  auto x = conv("encoder.conv_in", images.to(device_, dtype_));
  const auto levels = static_cast<int64_t>(c.block_out_channels.size());
  for (int64_t i = 0; i < levels; ++i) {
    const auto p = "encoder.down_blocks." + std::to_string(i);
    for (int64_t j = 0; j < c.layers_per_block; ++j) x = resnet(p + ".resnets." + std::to_string(j), x);
    if (i + 1 < levels) x = conv(p + ".downsamplers.0.conv", at::constant_pad_nd(x, {0, 1, 0, 1}, 0), 2, 0);
  }
  x = resnet("encoder.mid_block.resnets.0", x);
  if (c.mid_block_add_attention) x = attention("encoder.mid_block.attentions.0", x);
  x = resnet("encoder.mid_block.resnets.1", x);
  x = conv("encoder.conv_out", norm_act("encoder.conv_norm_out", x));
  if (c.use_quant_conv) x = conv("quant_conv", x, 1, 0);
  auto moments = x.to(torch::kFloat32).chunk(2, 1);
  return {moments[0], moments[1].clamp(-30.0, 20.0)};
}

torch::Tensor SdVae::encode(const torch::Tensor& images, bool sample, std::optional<at::Generator> generator,
                            int64_t images_per_call) const {
  TORCH_CHECK(images_per_call >= 0, "SdVae::encode: images_per_call must be >= 0, got ", images_per_call);
  torch::Tensor mean, logvar;
  if (images_per_call == 0 || images.dim() != 4 || images.size(0) <= images_per_call) {
    std::tie(mean, logvar) = encode_distribution(images);
  } else {
    std::vector<torch::Tensor> means, logvars;
    for (int64_t s = 0; s < images.size(0); s += images_per_call) {
      auto [m, lv] = encode_distribution(images.slice(0, s, std::min(s + images_per_call, images.size(0))));
      means.push_back(m);
      if (sample) logvars.push_back(lv);
    }
    mean = torch::cat(means);
    if (sample) logvar = torch::cat(logvars);
  }
  auto z = mean;
  if (sample)
    z = mean + (0.5 * logvar).exp() * torch::randn(mean.sizes(), generator, torch::kFloat32).to(mean.device());
  return (z - config_.shift_factor) * config_.scaling_factor;
}

torch::Tensor SdVae::decode_unscaled(const torch::Tensor& latents) const {
  const auto& c = config_;
  TORCH_CHECK(latents.dim() == 4 && latents.size(1) == c.latent_channels, "SdVae::decode: expected latents [N, ",
              c.latent_channels, ", h, w], got ", latents.sizes());
  torch::NoGradGuard no_grad;
  auto x = latents.to(device_, dtype_);
  if (c.use_post_quant_conv) x = conv("post_quant_conv", x, 1, 0);
  x = conv("decoder.conv_in", x);
  x = resnet("decoder.mid_block.resnets.0", x);
  if (c.mid_block_add_attention) x = attention("decoder.mid_block.attentions.0", x);
  x = resnet("decoder.mid_block.resnets.1", x);
  const auto levels = static_cast<int64_t>(c.block_out_channels.size());
  for (int64_t i = 0; i < levels; ++i) {
    const auto p = "decoder.up_blocks." + std::to_string(i);
    for (int64_t j = 0; j <= c.layers_per_block; ++j) x = resnet(p + ".resnets." + std::to_string(j), x);
    if (i + 1 < levels) x = conv(p + ".upsamplers.0.conv", at::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2}));
  }
  x = conv("decoder.conv_out", norm_act("decoder.conv_norm_out", x));
  return x.to(torch::kFloat32);
}

torch::Tensor SdVae::decode(const torch::Tensor& latents) const {
  return decode_unscaled(latents / config_.scaling_factor + config_.shift_factor);
}

torch::Tensor SdVae::decode_tiled(const torch::Tensor& latents, const VaeTiling& tiling) const {
  const int64_t f = config_.downscale();
  TORCH_CHECK(tiling.tile_size >= f && tiling.tile_size % f == 0,
              "SdVae::decode_tiled: tile_size must be a positive multiple of ", f, ", got ", tiling.tile_size);
  TORCH_CHECK(tiling.overlap >= 0 && tiling.overlap < 1, "SdVae::decode_tiled: overlap must be in [0, 1), got ",
              tiling.overlap);
  TORCH_CHECK(latents.dim() == 4, "SdVae::decode_tiled: expected latents [N, L, h, w], got ", latents.sizes());
  const int64_t tile = tiling.tile_size / f;  // latent tile
  if (latents.size(2) <= tile && latents.size(3) <= tile) return decode(latents);
  // diffusers' tiled_decode: tiles start every `stride` latents; each decoded tile is blended into the tile
  // above and the tile to its left (already blended) over `blend` pixels, linearly, then cut to `keep`. diffusers
  // takes blend = tile_size · overlap, which agrees with the stride only where tile · (1 - overlap) is whole (its
  // 512 at 0.25); elsewhere its frames came out the wrong size (a 16×24 decode at tile 12 gave 17×26). Here the
  // pixels kept are the stride's and the blend is the rest of the tile: the same where diffusers agrees.
  const auto stride = static_cast<int64_t>(static_cast<double>(tile) * (1 - tiling.overlap));
  const int64_t keep = stride * f;
  const int64_t blend = tiling.tile_size - keep;
  TORCH_CHECK(stride >= 1, "SdVae::decode_tiled: overlap ", tiling.overlap, " leaves no stride at tile_size ",
              tiling.tile_size);
  auto z = latents / config_.scaling_factor + config_.shift_factor;
  std::vector<std::vector<torch::Tensor>> rows;
  for (int64_t i = 0; i < z.size(2); i += stride) {
    std::vector<torch::Tensor> row;
    for (int64_t j = 0; j < z.size(3); j += stride)
      row.push_back(
          decode_unscaled(z.slice(2, i, std::min(i + tile, z.size(2))).slice(3, j, std::min(j + tile, z.size(3)))));
    rows.push_back(std::move(row));
  }
  // Linear weights y/extent for the first `extent` rows (columns), computed in double as diffusers does.
  auto ramp = [&](int64_t extent, const torch::Tensor& like, int64_t dim) {
    auto wgt = torch::arange(extent, torch::TensorOptions().dtype(torch::kFloat64)) / static_cast<double>(extent);
    std::vector<int64_t> shape(4, 1);
    shape[static_cast<size_t>(dim)] = extent;
    return std::make_pair(wgt.to(like.device(), like.scalar_type()).view(shape),
                          (1 - wgt).to(like.device(), like.scalar_type()).view(shape));
  };
  auto blend_into = [&](const torch::Tensor& a, torch::Tensor& b, int64_t dim) {
    const int64_t extent = std::min({a.size(dim), b.size(dim), blend});
    if (extent <= 0) return;
    auto [wb, wa] = ramp(extent, b, dim);
    auto head = b.narrow(dim, 0, extent);
    head.copy_(a.narrow(dim, a.size(dim) - extent, extent) * wa + head * wb);
  };
  std::vector<torch::Tensor> result_rows;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<torch::Tensor> result_row;
    for (size_t j = 0; j < rows[i].size(); ++j) {
      auto& t = rows[i][j];
      if (i > 0) blend_into(rows[i - 1][j], t, 2);
      if (j > 0) blend_into(rows[i][j - 1], t, 3);
      result_row.push_back(t.slice(2, 0, keep).slice(3, 0, keep));
    }
    result_rows.push_back(torch::cat(result_row, 3));
  }
  return torch::cat(result_rows, 2);
}

torch::Tensor SdVae::encode_video(const torch::Tensor& videos, int64_t frames_per_batch, bool sample,
                                  std::optional<at::Generator> generator) const {
  TORCH_CHECK(videos.dim() == 5, "SdVae::encode_video: expected videos [B, C, T, H, W], got ", videos.sizes());
  TORCH_CHECK(frames_per_batch >= 1, "SdVae::encode_video: frames_per_batch must be >= 1, got ", frames_per_batch);
  const int64_t B = videos.size(0), T = videos.size(2);
  auto frames = videos.permute({0, 2, 1, 3, 4}).reshape({B * T, videos.size(1), videos.size(3), videos.size(4)});
  std::vector<torch::Tensor> parts;
  for (int64_t s = 0; s < B * T; s += frames_per_batch)
    parts.push_back(encode(frames.slice(0, s, std::min(s + frames_per_batch, B * T)), sample, generator));
  auto z = torch::cat(parts);
  return z.view({B, T, z.size(1), z.size(2), z.size(3)}).permute({0, 2, 1, 3, 4}).contiguous();
}

torch::Tensor SdVae::decode_video(const torch::Tensor& latents, int64_t frames_per_batch,
                                  std::optional<VaeTiling> tiling) const {
  TORCH_CHECK(latents.dim() == 5, "SdVae::decode_video: expected latents [B, L, T, h, w], got ", latents.sizes());
  TORCH_CHECK(frames_per_batch >= 1, "SdVae::decode_video: frames_per_batch must be >= 1, got ", frames_per_batch);
  const int64_t B = latents.size(0), T = latents.size(2);
  auto frames = latents.permute({0, 2, 1, 3, 4}).reshape({B * T, latents.size(1), latents.size(3), latents.size(4)});
  std::vector<torch::Tensor> parts;
  for (int64_t s = 0; s < B * T; s += frames_per_batch) {
    auto chunk = frames.slice(0, s, std::min(s + frames_per_batch, B * T));
    parts.push_back(tiling ? decode_tiled(chunk, *tiling) : decode(chunk));
  }
  auto x = torch::cat(parts);
  return x.view({B, T, x.size(1), x.size(2), x.size(3)}).permute({0, 2, 1, 3, 4}).contiguous();
}

}  // namespace megaslide
