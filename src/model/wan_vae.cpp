#include "megaslide/model/wan_vae.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "io/pretrained.h"
#include "megaslide/io/files.h"

namespace megaslide {

namespace {

constexpr int64_t kCacheFrames = 2;  // frames a 3-tap causal conv needs from the previous chunk
constexpr int64_t kChunkFrames = 4;  // video frames per encoder chunk after the first frame

// Wan 2.1's published per-channel latent statistics (diffusers' AutoencoderKLWan defaults).
const std::vector<double> kWan21Mean = {-0.7571, -0.7089, -0.9113, 0.1075,  -0.1745, 0.9653,  -0.1517, 1.5508,
                                        0.4134,  -0.0715, 0.5517,  -0.3632, -0.1922, -0.9497, 0.2503,  -0.2921};
const std::vector<double> kWan21Std = {2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                                       3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160};
// Wan 2.2's (the TI2V-5B VAE's config.json), for a single file of z_dim 48.
const std::vector<double> kWan22Mean = {
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174,  0.1838,  0.1557,  -0.1382, 0.0542,  0.2813,  0.0891,
    0.1570,  -0.0098, 0.0375,  -0.1825, -0.2246, -0.1207, -0.0698, 0.5109,  0.2665,  -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109,  0.1567,  -0.0729, 0.0899,  -0.2799, -0.1230, -0.0313, -0.1649, 0.0117,  0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748,  0.0152,  0.1957,  0.1433,  -0.2944, 0.3573,  -0.0548, -0.1681, -0.0667};
const std::vector<double> kWan22Std = {0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344,
                                       0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804,
                                       0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999,
                                       0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                                       0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744};

std::string shape_string(c10::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void validate(const WanVaeConfig& c, const std::function<void(const std::string&)>& bad) {
  for (auto v : {c.base_dim, c.decoder_base_dim, c.z_dim, c.num_res_blocks, c.in_channels, c.out_channels})
    if (v < 1) bad("base_dim, decoder_base_dim, z_dim, num_res_blocks and the channel counts must be >= 1");
  if (c.dim_mult.empty()) bad("\"dim_mult\" must not be empty");
  for (auto m : c.dim_mult)
    if (m < 1) bad("\"dim_mult\" must hold positive integers");
  if (c.temporal_downsample.size() + 1 != c.dim_mult.size())
    bad("\"temperal_downsample\" must have one entry per level but the last (" + std::to_string(c.dim_mult.size() - 1) +
        "), got " + std::to_string(c.temporal_downsample.size()));
  int64_t temporal = 0;
  for (bool t : c.temporal_downsample) temporal += t ? 1 : 0;
  if (temporal != 2)
    bad("\"temperal_downsample\" must downsample time at exactly two levels (4 frames per latent frame, as Wan)");
  if (c.patch_size < 1) bad("\"patch_size\" must be >= 1, got " + std::to_string(c.patch_size));
  const auto levels = c.dim_mult.size();
  if (!c.is_residual) {
    // The decoder halves the channels in its upsamplers: every level's decoder width must be even.
    for (size_t i = 1; i < levels; ++i)
      if ((c.decoder_base_dim * c.dim_mult[i]) % 2 != 0)
        bad("decoder widths decoder_base_dim·dim_mult must be even above the first level");
  } else if (c.temporal_downsample.size() + 1 == levels) {
    // The shortcuts regroup channels: each encoder level's input, unfolded over its 2×2 (×2) blocks, must
    // divide into its width, and each decoder level's width, unfolded likewise, into its input.
    for (size_t i = 0; i < levels; ++i) {
      const bool down = i + 1 < levels;
      const int64_t block = down ? (c.temporal_downsample[i] ? 8 : 4) : 1;
      const int64_t in = c.base_dim * (i == 0 ? 1 : c.dim_mult[i - 1]), out = c.base_dim * c.dim_mult[i];
      if ((in * block) % out != 0)
        bad("encoder level " + std::to_string(i) + ": " + std::to_string(in) + " channels unfolded ×" +
            std::to_string(block) + " do not average down to " + std::to_string(out) + " (base_dim·dim_mult)");
    }
    for (size_t i = 0; i + 1 < levels; ++i) {
      const int64_t in = c.decoder_base_dim * (i == 0 ? c.dim_mult.back() : c.dim_mult[levels - i]);
      const int64_t out = c.decoder_base_dim * c.dim_mult[levels - 1 - i];
      const int64_t block = c.temporal_downsample[levels - 2 - i] ? 8 : 4;
      if ((out * block) % in != 0)
        bad("decoder level " + std::to_string(i) + ": " + std::to_string(in) + " channels do not repeat up to " +
            std::to_string(out) + "×" + std::to_string(block) + " (decoder_base_dim·dim_mult)");
    }
  }
  if (static_cast<int64_t>(c.latents_mean.size()) != c.z_dim || static_cast<int64_t>(c.latents_std.size()) != c.z_dim)
    bad("\"latents_mean\" and \"latents_std\" must have z_dim (" + std::to_string(c.z_dim) + ") entries, got " +
        std::to_string(c.latents_mean.size()) + " and " + std::to_string(c.latents_std.size()));
  for (double s : c.latents_std)
    if (!(s > 0) || !std::isfinite(s)) bad("\"latents_std\" must be positive");
  for (double m : c.latents_mean)
    if (!std::isfinite(m)) bad("\"latents_mean\" must be finite");
}

std::vector<double> json_reals(const nlohmann::json& j, const char* key, const std::vector<double>& fallback,
                               const std::function<void(const std::string&)>& bad) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const auto& v = j.at(key);
  if (!v.is_array()) bad(std::string("\"") + key + "\" must be a list of numbers, got " + v.dump());
  std::vector<double> out;
  for (const auto& e : v) {
    if (!e.is_number()) bad(std::string("\"") + key + "\" must be a list of numbers, got " + v.dump());
    out.push_back(e.get<double>());
  }
  return out;
}

WanVaeConfig parse_config(const nlohmann::json& j, const std::string& source) {
  WanVaeConfig c;
  auto bad = [&](const std::string& what) { throw io::PretrainedError("'" + source + "': " + what); };
  if (j.contains("_class_name") && j.at("_class_name") != "AutoencoderKLWan")
    bad("\"_class_name\" is " + j.at("_class_name").dump() + ", expected \"AutoencoderKLWan\"");
  c.base_dim = io::json_int(j, "base_dim", c.base_dim, source);
  c.decoder_base_dim = io::json_int(j, "decoder_base_dim", c.base_dim, source);
  c.z_dim = io::json_int(j, "z_dim", c.z_dim, source);
  c.num_res_blocks = io::json_int(j, "num_res_blocks", c.num_res_blocks, source);
  c.in_channels = io::json_int(j, "in_channels", c.in_channels, source);
  c.out_channels = io::json_int(j, "out_channels", c.out_channels, source);
  if (j.contains("dim_mult")) {
    const auto& v = j.at("dim_mult");
    if (!v.is_array()) bad("\"dim_mult\" must be a list of integers, got " + v.dump());
    c.dim_mult.clear();
    for (const auto& e : v) {
      if (!e.is_number_integer()) bad("\"dim_mult\" must be a list of integers, got " + v.dump());
      c.dim_mult.push_back(e.get<int64_t>());
    }
  }
  if (j.contains("temperal_downsample")) {
    const auto& v = j.at("temperal_downsample");
    if (!v.is_array()) bad("\"temperal_downsample\" must be a list of true/false, got " + v.dump());
    c.temporal_downsample.clear();
    for (const auto& e : v) {
      if (!e.is_boolean()) bad("\"temperal_downsample\" must be a list of true/false, got " + v.dump());
      c.temporal_downsample.push_back(e.get<bool>());
    }
  }
  if (j.contains("attn_scales") && !(j.at("attn_scales").is_array() && j.at("attn_scales").empty()))
    bad("\"attn_scales\" must be empty (attention only in the mid blocks, as Wan 2.1), got " +
        j.at("attn_scales").dump());
  if (j.contains("is_residual") && !j.at("is_residual").is_null()) {
    if (!j.at("is_residual").is_boolean())
      bad("\"is_residual\" must be true or false, got " + j.at("is_residual").dump());
    c.is_residual = j.at("is_residual").get<bool>();
  }
  if (j.contains("patch_size") && !j.at("patch_size").is_null()) {
    if (!j.at("patch_size").is_number_integer() || j.at("patch_size").get<int64_t>() < 1)
      bad("\"patch_size\" must be null or a positive integer, got " + j.at("patch_size").dump());
    c.patch_size = j.at("patch_size").get<int64_t>();
  }
  // config.json counts the channels the encoder sees, after the patchify.
  const int64_t per_pixel = c.patch_size * c.patch_size;
  if (c.in_channels % per_pixel != 0 || c.out_channels % per_pixel != 0)
    bad("\"in_channels\" " + std::to_string(c.in_channels) + " and \"out_channels\" " + std::to_string(c.out_channels) +
        " must be multiples of patch_size² (" + std::to_string(per_pixel) + ")");
  c.in_channels /= per_pixel;
  c.out_channels /= per_pixel;
  c.latents_mean = json_reals(j, "latents_mean", c.latents_mean, bad);
  c.latents_std = json_reals(j, "latents_std", c.latents_std, bad);
  validate(c, bad);
  const int64_t spatial = io::json_int(j, "scale_factor_spatial", c.spatial_downscale(), source);
  if (spatial != c.spatial_downscale())
    bad("\"scale_factor_spatial\" " + std::to_string(spatial) + " disagrees with dim_mult (" +
        std::to_string(c.dim_mult.size()) + " levels and patch_size " + std::to_string(c.patch_size) + ": " +
        std::to_string(c.spatial_downscale()) + ")");
  const int64_t temporal = io::json_int(j, "scale_factor_temporal", 4, source);
  if (temporal != 4)
    bad("\"scale_factor_temporal\" " + std::to_string(temporal) + " disagrees with temperal_downsample (4)");
  return c;
}

// The sizes of a single file with the original Wan names, read off its tensors' shapes. Its latent statistics
// are the published ones of its z_dim unless `given_statistics` (the caller sets them).
WanVaeConfig infer_config(const io::MappedWeights& file, bool given_statistics) {
  auto bad = [&](const std::string& what) { throw io::PretrainedError("'" + file.path() + "': " + what); };
  auto need = [&](const std::string& name) -> const std::vector<int64_t>& {
    if (!file.has(name)) bad("no tensor '" + name + "' (a Wan VAE file with the original names has it)");
    return file.shape(name);
  };
  auto need_dims = [&](const std::string& name, size_t dims) -> const std::vector<int64_t>& {
    const auto& shape = need(name);
    if (shape.size() != dims)
      bad("tensor '" + name + "' has shape " + shape_string(shape) + ", expected " + std::to_string(dims) +
          " dimensions");
    return shape;
  };
  WanVaeConfig c;
  // Wan 2.2's levels are blocks of their own (encoder.downsamples.L.downsamples.K), Wan 2.1's one flat list.
  c.is_residual = file.has("encoder.downsamples.0.downsamples.0.residual.0.gamma");
  c.patch_size = c.is_residual ? 2 : 1;  // Wan 2.2's VAE takes 2×2 patches; its file does not say so
  const int64_t per_pixel = c.patch_size * c.patch_size;
  const auto& conv_in = need_dims("encoder.conv1.weight", 5);
  c.base_dim = conv_in[0];
  if (conv_in[1] % per_pixel != 0)
    bad("tensor 'encoder.conv1.weight' takes " + std::to_string(conv_in[1]) +
        " channels, not a multiple of the 2×2 patch (4) of a Wan 2.2 VAE");
  c.in_channels = conv_in[1] / per_pixel;
  c.z_dim = need_dims("conv2.weight", 5)[0];
  std::vector<int64_t> level_width;
  c.temporal_downsample.clear();
  if (c.is_residual) {
    // Level L: num_res_blocks residual blocks, then (but at the last level) the resample.
    std::vector<bool> resamples;
    for (int64_t l = 0;; ++l) {
      const auto p = "encoder.downsamples." + std::to_string(l) + ".downsamples.";
      if (!file.has(p + "0.residual.0.gamma")) break;
      int64_t blocks = 0;
      while (file.has(p + std::to_string(blocks) + ".residual.0.gamma")) ++blocks;
      if (l == 0) c.num_res_blocks = blocks;
      if (blocks != c.num_res_blocks)
        bad("encoder level " + std::to_string(l) + " has " + std::to_string(blocks) + " residual blocks, level 0 " +
            std::to_string(c.num_res_blocks));
      level_width.push_back(need_dims(p + std::to_string(blocks - 1) + ".residual.6.weight", 5)[0]);
      const auto r = p + std::to_string(blocks);
      resamples.push_back(file.has(r + ".resample.1.weight"));
      c.temporal_downsample.push_back(file.has(r + ".time_conv.weight"));
    }
    for (size_t l = 0; l < resamples.size(); ++l)
      if (resamples[l] != (l + 1 < resamples.size()))
        bad("encoder level " + std::to_string(l) + (resamples[l] ? " downsamples" : " does not downsample") +
            " (every level but the last, " + std::to_string(resamples.size() - 1) + ", does)");
    if (!c.temporal_downsample.empty()) c.temporal_downsample.pop_back();
  } else {
    // encoder.downsamples.K: residual blocks (residual.0.gamma) and resamples (resample.1.weight), in order.
    int64_t blocks = 0, width = c.base_dim;
    for (int64_t k = 0;; ++k) {
      const auto p = "encoder.downsamples." + std::to_string(k);
      if (file.has(p + ".residual.0.gamma")) {
        width = need(p + ".residual.2.weight")[0];
        ++blocks;
      } else if (file.has(p + ".resample.1.weight")) {
        level_width.push_back(width);
        c.temporal_downsample.push_back(file.has(p + ".time_conv.weight"));
      } else if (file.has(p + ".to_qkv.weight")) {
        bad("tensor '" + p + ".to_qkv.weight': attention outside the mid block is not supported (Wan has none)");
      } else {
        break;
      }
    }
    level_width.push_back(width);
    const auto levels = static_cast<int64_t>(level_width.size());
    if (blocks == 0 || blocks % levels != 0)
      bad(std::to_string(blocks) + " residual blocks in encoder.downsamples do not divide into " +
          std::to_string(levels) + " levels");
    c.num_res_blocks = blocks / levels;
  }
  if (level_width.empty() || c.num_res_blocks == 0)
    bad("no residual blocks under encoder.downsamples (not a Wan VAE file with the original names)");
  c.dim_mult.clear();
  for (auto w : level_width) {
    if (w % c.base_dim != 0)
      bad("encoder width " + std::to_string(w) + " is not a multiple of the base width " + std::to_string(c.base_dim));
    c.dim_mult.push_back(w / c.base_dim);
  }
  const auto& head = need_dims("decoder.head.2.weight", 5);
  if (head[0] % per_pixel != 0)
    bad("tensor 'decoder.head.2.weight' gives " + std::to_string(head[0]) +
        " channels, not a multiple of the 2×2 patch (4) of a Wan 2.2 VAE");
  c.out_channels = head[0] / per_pixel;
  if (head[1] % c.dim_mult[0] != 0) bad("decoder width " + std::to_string(head[1]) + " does not match dim_mult");
  c.decoder_base_dim = head[1] / c.dim_mult[0];
  if (!given_statistics) {
    const int64_t published = c.is_residual ? 48 : 16;
    if (c.z_dim != published)
      bad("z_dim " + std::to_string(c.z_dim) + ": a single file carries no latents_mean/latents_std, and " +
          (c.is_residual ? "Wan 2.2's" : "Wan 2.1's") + " published ones are for z_dim " + std::to_string(published) +
          " (use a diffusers folder with config.json, or give the statistics)");
    if (c.is_residual) {
      c.latents_mean = kWan22Mean;
      c.latents_std = kWan22Std;
    }
  } else {
    c.latents_mean.assign(static_cast<size_t>(c.z_dim), 0.0);  // placeholders until the caller's
    c.latents_std.assign(static_cast<size_t>(c.z_dim), 1.0);
  }
  validate(c, bad);
  return c;
}

}  // namespace

WanVaeConfig::WanVaeConfig() : latents_mean(kWan21Mean), latents_std(kWan21Std) {}

int64_t WanVaeConfig::temporal_downscale() const {
  int64_t f = 1;
  for (bool t : temporal_downsample) f *= t ? 2 : 1;
  return f;
}

// The temporal feature cache: one slot per cached conv, visited in the same order for every chunk.
struct WanVae::Cache {
  std::vector<torch::Tensor> slots;
  std::vector<bool> first_frame_only;  // an upsampler that has seen only the first frame (diffusers' "Rep")
  size_t next = 0;
  void start_chunk() { next = 0; }
  size_t slot() {
    if (next == slots.size()) slots.emplace_back(), first_frame_only.push_back(false);
    return next++;
  }
};

// (diffusers name, original name, shape) -> the tensor on the CPU in the compute dtype.
struct WanVae::Source {
  std::function<torch::Tensor(const std::string&, const std::string&, const std::vector<int64_t>&)> take;
};

struct WanVae::Statistics {
  const std::vector<double>& mean;
  const std::vector<double>& std;
};

WanVae WanVae::load(const std::string& path, torch::Device device, torch::ScalarType dtype) {
  return load_with(path, device, dtype, nullptr);
}

WanVae WanVae::load(const std::string& path, const std::vector<double>& latents_mean,
                    const std::vector<double>& latents_std, torch::Device device, torch::ScalarType dtype) {
  const Statistics statistics{latents_mean, latents_std};
  return load_with(path, device, dtype, &statistics);
}

WanVaeConfig WanVae::folder_config(const std::string& folder) {
  const auto config_path = io::join_path(folder, "config.json");
  if (!io::path_exists(config_path)) throw io::PretrainedError("model folder '" + folder + "': no config.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_file(config_path));
  } catch (const nlohmann::json::exception& e) {
    throw io::PretrainedError("'" + config_path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw io::PretrainedError("'" + config_path + "' is not a JSON object");
  return parse_config(j, config_path);
}

WanVae WanVae::load_with(const std::string& path, torch::Device device, torch::ScalarType dtype,
                         const Statistics* statistics) {
  auto with_statistics = [&](WanVaeConfig config, const std::string& source) {
    if (statistics == nullptr) return config;
    config.latents_mean = statistics->mean;
    config.latents_std = statistics->std;
    validate(config, [&](const std::string& what) {
      throw io::PretrainedError("'" + source + "' with the latent statistics given: " + what);
    });
    return config;
  };
  if (io::is_directory(path)) {
    auto config = with_statistics(folder_config(path), path);
    const auto weights = io::join_path(path, "diffusion_pytorch_model.safetensors");
    if (!io::path_exists(weights))
      throw io::PretrainedError("model folder '" + path +
                                "': no weights file (expected diffusion_pytorch_model.safetensors)");
    io::MappedWeights file(weights);
    return build(config, device, dtype,
                 Source{[&](const std::string& name, const std::string&, const std::vector<int64_t>& shape) {
                   return file.take(name, shape, dtype, "from config.json");
                 }});
  }
  if (!io::path_exists(path))
    throw io::PretrainedError("'" + path +
                              "': no such file or folder (expected a diffusers vae/ folder or a .safetensors file)");
  io::MappedWeights file(path);
  if (file.has("encoder.conv_in.weight"))
    throw io::PretrainedError("'" + path +
                              "' has diffusers' tensor names: give the folder holding it and its config.json");
  auto config = with_statistics(infer_config(file, statistics != nullptr), path);
  return build(config, device, dtype,
               Source{[&](const std::string&, const std::string& original, const std::vector<int64_t>& shape) {
                 return file.take(original, shape, dtype,
                                  "from the sizes of encoder.conv1, encoder.downsamples and decoder.head");
               }});
}

WanVae WanVae::random(const WanVaeConfig& config, uint64_t seed, torch::Device device, torch::ScalarType dtype) {
  validate(config, [](const std::string& what) { TORCH_CHECK(false, "WanVae::random: ", what); });
  auto g = at::detail::createCPUGenerator(seed);
  return build(config, device, dtype,
               Source{[&](const std::string& name, const std::string&, const std::vector<int64_t>& shape) {
                 if (name.size() > 6 && name.substr(name.size() - 6) == ".gamma") return torch::ones(shape, dtype);
                 if (shape.size() == 1) return torch::zeros(shape, dtype);
                 const int64_t fan_in = c10::multiply_integers(shape.begin() + 1, shape.end());
                 return (torch::randn(shape, g, torch::kFloat32) / std::sqrt(static_cast<double>(fan_in))).to(dtype);
               }});
}

WanVae WanVae::build(const WanVaeConfig& config, torch::Device device, torch::ScalarType dtype, const Source& source) {
  WanVae vae;
  vae.config_ = config;
  vae.device_ = device;
  vae.dtype_ = dtype;
  const auto& c = vae.config_;
  // Every tensor by its diffusers name and its original Wan name: the one rename table.
  auto take = [&](const std::string& name, const std::string& original, std::vector<int64_t> shape) {
    vae.w_[name] = source.take(name, original, shape).to(device);
    vae.original_[name] = original;
  };
  auto conv3d = [&](const std::string& p, const std::string& o, int64_t in, int64_t out, int64_t kt, int64_t ks) {
    take(p + ".weight", o + ".weight", {out, in, kt, ks, ks});
    take(p + ".bias", o + ".bias", {out});
  };
  auto conv2d = [&](const std::string& p, const std::string& o, int64_t in, int64_t out, int64_t k) {
    take(p + ".weight", o + ".weight", {out, in, k, k});
    take(p + ".bias", o + ".bias", {out});
  };
  auto residual = [&](const std::string& p, const std::string& o, int64_t in, int64_t out) {
    take(p + ".norm1.gamma", o + ".residual.0.gamma", {in, 1, 1, 1});
    conv3d(p + ".conv1", o + ".residual.2", in, out, 3, 3);
    take(p + ".norm2.gamma", o + ".residual.3.gamma", {out, 1, 1, 1});
    conv3d(p + ".conv2", o + ".residual.6", out, out, 3, 3);
    if (in != out) conv3d(p + ".conv_shortcut", o + ".shortcut", in, out, 1, 1);
  };
  auto mid = [&](const std::string& p, const std::string& o, int64_t ch) {
    residual(p + ".resnets.0", o + ".0", ch, ch);
    take(p + ".attentions.0.norm.gamma", o + ".1.norm.gamma", {ch, 1, 1});
    conv2d(p + ".attentions.0.to_qkv", o + ".1.to_qkv", ch, 3 * ch, 1);
    conv2d(p + ".attentions.0.proj", o + ".1.proj", ch, ch, 1);
    residual(p + ".resnets.1", o + ".2", ch, ch);
  };
  const auto levels = static_cast<int64_t>(c.dim_mult.size());
  const int64_t per_pixel = c.patch_size * c.patch_size;
  conv3d("encoder.conv_in", "encoder.conv1", c.in_channels * per_pixel, c.base_dim, 3, 3);
  int64_t in = c.base_dim;
  if (c.is_residual) {
    // Encoder: one block per level; the original names list its residual blocks and then its resample.
    for (int64_t i = 0; i < levels; ++i) {
      const int64_t out = c.base_dim * c.dim_mult[static_cast<size_t>(i)];
      const auto p = "encoder.down_blocks." + std::to_string(i), o = "encoder.downsamples." + std::to_string(i);
      for (int64_t j = 0; j < c.num_res_blocks; ++j) {
        residual(p + ".resnets." + std::to_string(j), o + ".downsamples." + std::to_string(j), in, out);
        in = out;
      }
      if (i + 1 < levels) {
        const auto r = o + ".downsamples." + std::to_string(c.num_res_blocks);
        conv2d(p + ".downsampler.resample.1", r + ".resample.1", out, out, 3);
        if (c.temporal_downsample[static_cast<size_t>(i)])
          conv3d(p + ".downsampler.time_conv", r + ".time_conv", out, out, 3, 1);
      }
    }
  } else {
    // Encoder: a flat list of residual blocks and resamples (the same index in both namings).
    int64_t k = 0;
    for (int64_t i = 0; i < levels; ++i) {
      const int64_t out = c.base_dim * c.dim_mult[static_cast<size_t>(i)];
      for (int64_t j = 0; j < c.num_res_blocks; ++j, ++k) {
        residual("encoder.down_blocks." + std::to_string(k), "encoder.downsamples." + std::to_string(k), in, out);
        in = out;
      }
      if (i + 1 < levels) {
        const auto p = "encoder.down_blocks." + std::to_string(k), o = "encoder.downsamples." + std::to_string(k);
        conv2d(p + ".resample.1", o + ".resample.1", out, out, 3);
        if (c.temporal_downsample[static_cast<size_t>(i)]) conv3d(p + ".time_conv", o + ".time_conv", out, out, 3, 1);
        ++k;
      }
    }
  }
  mid("encoder.mid_block", "encoder.middle", in);
  take("encoder.norm_out.gamma", "encoder.head.0.gamma", {in, 1, 1, 1});
  conv3d("encoder.conv_out", "encoder.head.2", in, 2 * c.z_dim, 3, 3);
  conv3d("quant_conv", "conv1", 2 * c.z_dim, 2 * c.z_dim, 1, 1);
  conv3d("post_quant_conv", "conv2", c.z_dim, c.z_dim, 1, 1);
  const int64_t top = c.decoder_base_dim * c.dim_mult.back();
  conv3d("decoder.conv_in", "decoder.conv1", c.z_dim, top, 3, 3);
  mid("decoder.mid_block", "decoder.middle", top);
  in = top;
  if (c.is_residual) {
    // Decoder: one block per level, its upsampler keeping the width; original names nested as the encoder's.
    for (int64_t i = 0; i < levels; ++i) {
      const int64_t out = c.decoder_base_dim * c.dim_mult[static_cast<size_t>(levels - 1 - i)];
      const auto p = "decoder.up_blocks." + std::to_string(i), o = "decoder.upsamples." + std::to_string(i);
      for (int64_t j = 0; j <= c.num_res_blocks; ++j) {
        residual(p + ".resnets." + std::to_string(j), o + ".upsamples." + std::to_string(j), in, out);
        in = out;
      }
      if (i + 1 < levels) {
        const auto r = o + ".upsamples." + std::to_string(c.num_res_blocks + 1);
        conv2d(p + ".upsampler.resample.1", r + ".resample.1", out, out, 3);
        if (c.temporal_downsample[static_cast<size_t>(levels - 2 - i)])
          conv3d(p + ".upsampler.time_conv", r + ".time_conv", out, 2 * out, 3, 1);
      }
    }
  } else {
    // Decoder: diffusers groups the original flat list of upsamples into levels.
    int64_t k = 0;
    for (int64_t i = 0; i < levels; ++i) {
      const int64_t out = c.decoder_base_dim * c.dim_mult[static_cast<size_t>(levels - 1 - i)];
      if (i > 0) in /= 2;  // the previous upsampler halved the channels
      const auto p = "decoder.up_blocks." + std::to_string(i);
      for (int64_t j = 0; j <= c.num_res_blocks; ++j, ++k) {
        residual(p + ".resnets." + std::to_string(j), "decoder.upsamples." + std::to_string(k), in, out);
        in = out;
      }
      if (i + 1 < levels) {
        const auto o = "decoder.upsamples." + std::to_string(k);
        conv2d(p + ".upsamplers.0.resample.1", o + ".resample.1", out, out / 2, 3);
        if (c.temporal_downsample[static_cast<size_t>(levels - 2 - i)])
          conv3d(p + ".upsamplers.0.time_conv", o + ".time_conv", out, 2 * out, 3, 1);
        ++k;
      }
    }
  }
  take("decoder.norm_out.gamma", "decoder.head.0.gamma", {in, 1, 1, 1});
  conv3d("decoder.conv_out", "decoder.head.2", in, c.out_channels * per_pixel, 3, 3);
  auto stats = [&](const std::vector<double>& v) {
    return torch::tensor(v, torch::TensorOptions().dtype(torch::kFloat64))
        .to(torch::kFloat32)
        .view({1, c.z_dim, 1, 1, 1})
        .to(device);
  };
  vae.mean_ = stats(c.latents_mean);
  vae.inv_std_ = 1.0 / stats(c.latents_std);
  return vae;
}

int64_t WanVae::parameter_count() const {
  int64_t n = 0;
  for (const auto& [name, t] : w_) n += t.numel();
  return n;
}

std::string WanVae::original_name(const std::string& diffusers_name) const {
  auto it = original_.find(diffusers_name);
  return it == original_.end() ? std::string() : it->second;
}

const torch::Tensor& WanVae::w(const std::string& name) const {
  auto it = w_.find(name);
  TORCH_CHECK(it != w_.end(), "WanVae: no weight ", name);
  return it->second;
}

torch::Tensor WanVae::rms(const std::string& p, const torch::Tensor& x) const {
  const auto& gamma = w(p + ".gamma");
  const auto xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  const auto normalized =
      (xf / at::linalg_vector_norm(xf, 2, at::IntArrayRef{1}, /*keepdim=*/true).clamp_min(1e-12)).to(x.scalar_type());
  return normalized * (std::sqrt(static_cast<double>(x.size(1))) * gamma);
}

// A causal conv of this chunk, with the previous chunk's last frames in front (zeros before the first).
torch::Tensor WanVae::cached_conv(const std::string& p, const torch::Tensor& x, Cache& cache) const {
  const auto& weight = w(p + ".weight");
  const int64_t kt = weight.size(2), ks = weight.size(3);
  const auto s = cache.slot();
  auto next = x.narrow(2, std::max<int64_t>(0, x.size(2) - kCacheFrames), std::min(kCacheFrames, x.size(2)));
  if (next.size(2) < kCacheFrames && cache.slots[s].defined())
    next = torch::cat({cache.slots[s].narrow(2, cache.slots[s].size(2) - 1, 1), next}, 2);
  auto input = x;
  int64_t pad = kt - 1;
  if (pad > 0 && cache.slots[s].defined()) {
    input = torch::cat({cache.slots[s], input}, 2);
    pad -= cache.slots[s].size(2);
  }
  if (pad > 0) {
    auto shape = input.sizes().vec();
    shape[2] = pad;
    input = torch::cat({torch::zeros(shape, input.options()), input}, 2);
  }
  cache.slots[s] = next.clone();
  return at::conv3d(input, weight, w(p + ".bias"), {1, 1, 1}, {0, (ks - 1) / 2, (ks - 1) / 2});
}

torch::Tensor WanVae::residual(const std::string& p, const torch::Tensor& x, Cache& cache) const {
  auto shortcut = w_.count(p + ".conv_shortcut.weight")
                      ? at::conv3d(x, w(p + ".conv_shortcut.weight"), w(p + ".conv_shortcut.bias"))
                      : x;
  auto h = cached_conv(p + ".conv1", at::silu(rms(p + ".norm1", x)), cache);
  h = cached_conv(p + ".conv2", at::silu(rms(p + ".norm2", h)), cache);
  return h + shortcut;
}

namespace {
// [B, C, T, H, W] <-> [B·T, C, H, W]
torch::Tensor frames_of(const torch::Tensor& x) {
  return x.permute({0, 2, 1, 3, 4}).reshape({x.size(0) * x.size(2), x.size(1), x.size(3), x.size(4)});
}
torch::Tensor clip_of(const torch::Tensor& f, int64_t batch) {
  return f.view({batch, f.size(0) / batch, f.size(1), f.size(2), f.size(3)}).permute({0, 2, 1, 3, 4});
}
}  // namespace

torch::Tensor WanVae::attention(const std::string& p, const torch::Tensor& x) const {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(3), W = x.size(4);
  auto f = rms(p + ".norm", frames_of(x));
  auto qkv =
      at::conv2d(f, w(p + ".to_qkv.weight"), w(p + ".to_qkv.bias")).view({f.size(0), 1, 3 * C, H * W}).transpose(2, 3);
  auto parts = qkv.chunk(3, -1);  // q, k, v [B·T, 1, H·W, C]
  auto o = at::scaled_dot_product_attention(parts[0].contiguous(), parts[1].contiguous(), parts[2].contiguous());
  o = o.squeeze(1).transpose(1, 2).reshape({f.size(0), C, H, W});
  return clip_of(at::conv2d(o, w(p + ".proj.weight"), w(p + ".proj.bias")), B) + x;
}

torch::Tensor WanVae::downsample(const std::string& p, const torch::Tensor& x, bool temporal, Cache& cache) const {
  auto f = at::constant_pad_nd(frames_of(x), {0, 1, 0, 1});
  auto y = clip_of(at::conv2d(f, w(p + ".resample.1.weight"), w(p + ".resample.1.bias"), {2, 2}), x.size(0));
  if (!temporal) return y;
  // First chunk: kept as is (one frame). Later chunks: stride-2 conv over (the last frame before, this chunk).
  const auto s = cache.slot();
  auto last = y.narrow(2, y.size(2) - 1, 1).clone();
  if (!cache.slots[s].defined()) {
    cache.slots[s] = last;
    return y;
  }
  auto input = torch::cat({cache.slots[s], y}, 2);
  cache.slots[s] = last;
  return at::conv3d(input, w(p + ".time_conv.weight"), w(p + ".time_conv.bias"), {2, 1, 1});
}

torch::Tensor WanVae::upsample(const std::string& p, const torch::Tensor& x, bool temporal, Cache& cache) const {
  auto y = x;
  if (temporal) {
    const auto s = cache.slot();
    if (!cache.slots[s].defined() && !cache.first_frame_only[s]) {
      cache.first_frame_only[s] = true;  // the first frame stays one frame
    } else {
      // A causal conv to 2·C channels over the frames after the first (zeros before them), each frame
      // becoming two: channels [0, C) the first, [C, 2C) the second.
      auto next = x.narrow(2, std::max<int64_t>(0, x.size(2) - kCacheFrames), std::min(kCacheFrames, x.size(2)));
      if (next.size(2) < kCacheFrames)
        next = torch::cat({cache.first_frame_only[s] ? torch::zeros_like(next)
                                                     : cache.slots[s].narrow(2, cache.slots[s].size(2) - 1, 1),
                           next},
                          2);
      auto input = x;
      if (cache.first_frame_only[s]) {
        auto shape = x.sizes().vec();
        shape[2] = kCacheFrames;
        input = torch::cat({torch::zeros(shape, x.options()), x}, 2);
      } else {
        input = torch::cat({cache.slots[s], x}, 2);
        if (cache.slots[s].size(2) < kCacheFrames) {
          auto shape = x.sizes().vec();
          shape[2] = kCacheFrames - cache.slots[s].size(2);
          input = torch::cat({torch::zeros(shape, x.options()), input}, 2);
        }
      }
      cache.slots[s] = next.clone();
      cache.first_frame_only[s] = false;
      const int64_t B = x.size(0), C = x.size(1), T = x.size(2), H = x.size(3), W = x.size(4);
      auto t = at::conv3d(input, w(p + ".time_conv.weight"), w(p + ".time_conv.bias"));  // [B, 2C, T, H, W]
      y = t.view({B, 2, C, T, H, W}).permute({0, 2, 3, 1, 4, 5}).reshape({B, C, 2 * T, H, W});
    }
  }
  auto f = frames_of(y);
  f = at::upsample_nearest2d(f, {f.size(2) * 2, f.size(3) * 2});
  return clip_of(at::conv2d(f, w(p + ".resample.1.weight"), w(p + ".resample.1.bias"), {1, 1}, {1, 1}), y.size(0));
}

namespace {

// Wan 2.2's encoder shortcut: zero frames in front up to a multiple of `frames`, each channel's
// frames×size×size blocks unfolded into channels (channel-major, then frame, row, column offset), consecutive
// groups of them averaged down to `channels`.
torch::Tensor average_down(const torch::Tensor& x, int64_t channels, int64_t frames, int64_t size) {
  auto padded = x;
  if (const int64_t pad = (frames - x.size(2) % frames) % frames; pad > 0) {
    auto shape = x.sizes().vec();
    shape[2] = pad;
    padded = torch::cat({torch::zeros(shape, x.options()), x}, 2);
  }
  const int64_t B = padded.size(0), C = padded.size(1), T = padded.size(2) / frames, H = padded.size(3) / size,
                W = padded.size(4) / size;
  const int64_t group = C * frames * size * size / channels;
  return padded.reshape({B, C, T, frames, H, size, W, size})
      .permute({0, 1, 3, 5, 7, 2, 4, 6})
      .reshape({B, channels, group, T, H, W})
      .mean(2);
}

// Wan 2.2's decoder shortcut, the reverse: each channel repeated (consecutively) up to channels·frames·size²,
// folded back into frames×size×size blocks; on the first latent frame only the last of the `frames` frames is
// kept (the decoder makes one frame of it).
torch::Tensor repeat_up(const torch::Tensor& x, int64_t channels, int64_t frames, int64_t size, bool first_chunk) {
  const int64_t B = x.size(0), T = x.size(2), H = x.size(3), W = x.size(4);
  auto y = x.repeat_interleave(channels * frames * size * size / x.size(1), 1)
               .view({B, channels, frames, size, size, T, H, W})
               .permute({0, 1, 5, 2, 6, 3, 7, 4})
               .reshape({B, channels, T * frames, H * size, W * size});
  return first_chunk ? y.narrow(2, frames - 1, y.size(2) - (frames - 1)) : y;
}

// [B, C, T, H, W] <-> [B, C·p², T, H/p, W/p]: pixel (y·p + dy, x·p + dx) of channel c is channel c·p² + dx·p + dy
// (diffusers' order).
torch::Tensor patchify(const torch::Tensor& x, int64_t p) {
  if (p == 1) return x;
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), H = x.size(3) / p, W = x.size(4) / p;
  return x.reshape({B, C, T, H, p, W, p}).permute({0, 1, 6, 4, 2, 3, 5}).reshape({B, C * p * p, T, H, W});
}

torch::Tensor unpatchify(const torch::Tensor& x, int64_t p) {
  if (p == 1) return x;
  const int64_t B = x.size(0), C = x.size(1) / (p * p), T = x.size(2), H = x.size(3), W = x.size(4);
  return x.reshape({B, C, p, p, T, H, W}).permute({0, 1, 4, 5, 3, 6, 2}).reshape({B, C, T, H * p, W * p});
}

}  // namespace

torch::Tensor WanVae::encoder_chunk(const torch::Tensor& x_in, Cache& cache) const {
  const auto& c = config_;
  cache.start_chunk();
  auto x = cached_conv("encoder.conv_in", x_in, cache);
  const auto levels = static_cast<int64_t>(c.dim_mult.size());
  int64_t k = 0;
  for (int64_t i = 0; i < levels; ++i) {
    const bool down = i + 1 < levels, temporal = down && c.temporal_downsample[static_cast<size_t>(i)];
    if (c.is_residual) {
      const auto p = "encoder.down_blocks." + std::to_string(i);
      const auto level_input = x;
      for (int64_t j = 0; j < c.num_res_blocks; ++j) x = residual(p + ".resnets." + std::to_string(j), x, cache);
      if (down) x = downsample(p + ".downsampler", x, temporal, cache);
      x = x + average_down(level_input, x.size(1), temporal ? 2 : 1, down ? 2 : 1);
      continue;
    }
    for (int64_t j = 0; j < c.num_res_blocks; ++j, ++k)
      x = residual("encoder.down_blocks." + std::to_string(k), x, cache);
    if (down) x = downsample("encoder.down_blocks." + std::to_string(k++), x, temporal, cache);
  }
  x = residual("encoder.mid_block.resnets.0", x, cache);
  x = attention("encoder.mid_block.attentions.0", x);
  x = residual("encoder.mid_block.resnets.1", x, cache);
  x = cached_conv("encoder.conv_out", at::silu(rms("encoder.norm_out", x)), cache);
  return at::conv3d(x, w("quant_conv.weight"), w("quant_conv.bias"));
}

torch::Tensor WanVae::decoder_chunk(const torch::Tensor& z, Cache& cache, bool first_chunk) const {
  const auto& c = config_;
  cache.start_chunk();
  auto x = at::conv3d(z, w("post_quant_conv.weight"), w("post_quant_conv.bias"));
  x = cached_conv("decoder.conv_in", x, cache);
  x = residual("decoder.mid_block.resnets.0", x, cache);
  x = attention("decoder.mid_block.attentions.0", x);
  x = residual("decoder.mid_block.resnets.1", x, cache);
  const auto levels = static_cast<int64_t>(c.dim_mult.size());
  for (int64_t i = 0; i < levels; ++i) {
    const auto p = "decoder.up_blocks." + std::to_string(i);
    const bool up = i + 1 < levels, temporal = up && c.temporal_downsample[static_cast<size_t>(levels - 2 - i)];
    const auto level_input = x;
    for (int64_t j = 0; j <= c.num_res_blocks; ++j) x = residual(p + ".resnets." + std::to_string(j), x, cache);
    if (!up) continue;
    if (c.is_residual) {
      x = upsample(p + ".upsampler", x, temporal, cache);
      x = x + repeat_up(level_input, x.size(1), temporal ? 2 : 1, 2, first_chunk);
    } else {
      x = upsample(p + ".upsamplers.0", x, temporal, cache);
    }
  }
  return cached_conv("decoder.conv_out", at::silu(rms("decoder.norm_out", x)), cache);
}

void WanVae::check_video(const torch::Tensor& videos, const char* what) const {
  const auto& c = config_;
  TORCH_CHECK(videos.dim() == 5 && videos.size(1) == c.in_channels, "WanVae::", what, ": expected videos [B, ",
              c.in_channels, ", T, H, W], got ", videos.sizes());
  TORCH_CHECK(videos.size(2) >= 1 && (videos.size(2) - 1) % kChunkFrames == 0, "WanVae::", what, ": ", videos.size(2),
              " frames; the Wan VAE takes 1 + 4k frames (1, 5, 9, ..., 81)");
  TORCH_CHECK(videos.size(3) % c.spatial_downscale() == 0 && videos.size(4) % c.spatial_downscale() == 0 &&
                  videos.size(3) > 0 && videos.size(4) > 0,
              "WanVae::", what, ": frames of ", videos.size(4), "x", videos.size(3),
              " (W x H); the VAE needs multiples of ", c.spatial_downscale());
}

torch::Tensor WanVae::encode_clip(const torch::Tensor& x) const {
  Cache cache;
  std::vector<torch::Tensor> parts;
  parts.push_back(encoder_chunk(x.narrow(2, 0, 1), cache));
  for (int64_t s = 1; s < x.size(2); s += kChunkFrames)
    parts.push_back(encoder_chunk(x.narrow(2, s, kChunkFrames), cache));
  return torch::cat(parts, 2);
}

torch::Tensor WanVae::decode_clip(const torch::Tensor& z) const {
  Cache cache;
  std::vector<torch::Tensor> parts;
  for (int64_t t = 0; t < z.size(2); ++t) parts.push_back(decoder_chunk(z.narrow(2, t, 1), cache, t == 0));
  return torch::cat(parts, 2);
}

namespace {

void check_tiling(const WanVaeTiling& t, int64_t f) {
  TORCH_CHECK(t.tile > 0 && t.tile % f == 0 && t.stride > 0 && t.stride % f == 0 && t.stride <= t.tile,
              "WanVae tiling: tile and stride must be positive multiples of ", f, " with stride <= tile, got tile ",
              t.tile, ", stride ", t.stride);
}

// diffusers' blend_v / blend_h: the first `extent` rows (dim 3) or columns (dim 4) of b become
// a·(1 − y/extent) + b·(y/extent), a's from its end.
void blend_into(const torch::Tensor& a, torch::Tensor& b, int64_t dim, int64_t extent) {
  extent = std::min({a.size(dim), b.size(dim), extent});
  if (extent <= 0) return;
  auto wb = torch::arange(extent, torch::TensorOptions().dtype(torch::kFloat64)) / static_cast<double>(extent);
  std::vector<int64_t> shape(5, 1);
  shape[static_cast<size_t>(dim)] = extent;
  auto head = b.narrow(dim, 0, extent);
  head.copy_(a.narrow(dim, a.size(dim) - extent, extent) * (1 - wb).to(a.options()).view(shape) +
             head * wb.to(b.options()).view(shape));
}

// Tiles of `tile` every `stride` (input units) through `run`, blended over `blend` and cut to `keep` (output
// units), then cut to (out_h, out_w) — diffusers' tiled_encode / tiled_decode.
torch::Tensor tiled(const torch::Tensor& x, int64_t tile, int64_t stride, int64_t blend, int64_t keep, int64_t out_h,
                    int64_t out_w, const std::function<torch::Tensor(const torch::Tensor&)>& run) {
  std::vector<std::vector<torch::Tensor>> rows;
  for (int64_t i = 0; i < x.size(3); i += stride) {
    std::vector<torch::Tensor> row;
    for (int64_t j = 0; j < x.size(4); j += stride)
      row.push_back(run(x.slice(3, i, std::min(i + tile, x.size(3))).slice(4, j, std::min(j + tile, x.size(4)))));
    rows.push_back(std::move(row));
  }
  std::vector<torch::Tensor> result_rows;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<torch::Tensor> result_row;
    for (size_t j = 0; j < rows[i].size(); ++j) {
      auto& t = rows[i][j];
      if (i > 0) blend_into(rows[i - 1][j], t, 3, blend);
      if (j > 0) blend_into(rows[i][j - 1], t, 4, blend);
      result_row.push_back(t.slice(3, 0, keep).slice(4, 0, keep));
    }
    result_rows.push_back(torch::cat(result_row, 4));
  }
  return torch::cat(result_rows, 3).slice(3, 0, out_h).slice(4, 0, out_w);
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> WanVae::encode_distribution(const torch::Tensor& videos,
                                                                    const std::optional<WanVaeTiling>& tiling) const {
  check_video(videos, "encode");
  torch::NoGradGuard no_grad;
  const int64_t f = config_.encoder_downscale();
  // Whether to tile is decided on the video's pixels, the tiles laid on the patchified frame (as diffusers).
  const bool tile = tiling && (videos.size(3) > tiling->tile || videos.size(4) > tiling->tile);
  auto x = patchify(videos.to(device_, dtype_), config_.patch_size);
  torch::Tensor moments;
  if (tile) {
    check_tiling(*tiling, f);
    const int64_t latent_tile = tiling->tile / f, latent_stride = tiling->stride / f;
    moments = tiled(x, tiling->tile, tiling->stride, latent_tile - latent_stride, latent_stride, x.size(3) / f,
                    x.size(4) / f, [&](const torch::Tensor& t) { return encode_clip(t); });
  } else {
    moments = encode_clip(x);
  }
  moments = moments.to(torch::kFloat32);
  return {moments.narrow(1, 0, config_.z_dim), moments.narrow(1, config_.z_dim, config_.z_dim).clamp(-30.0, 20.0)};
}

torch::Tensor WanVae::normalize(const torch::Tensor& latents) const {
  TORCH_CHECK(latents.dim() == 5 && latents.size(1) == config_.z_dim, "WanVae: expected latents [B, ", config_.z_dim,
              ", t, h, w], got ", latents.sizes());
  return (latents.to(mean_.device(), torch::kFloat32) - mean_) * inv_std_;
}

torch::Tensor WanVae::denormalize(const torch::Tensor& latents) const {
  TORCH_CHECK(latents.dim() == 5 && latents.size(1) == config_.z_dim, "WanVae: expected latents [B, ", config_.z_dim,
              ", t, h, w], got ", latents.sizes());
  return latents.to(mean_.device(), torch::kFloat32) / inv_std_ + mean_;
}

torch::Tensor WanVae::encode(const torch::Tensor& videos, bool sample, std::optional<at::Generator> generator,
                             const std::optional<WanVaeTiling>& tiling) const {
  auto [mean, logvar] = encode_distribution(videos, tiling);
  auto z = mean;
  if (sample)
    z = mean + (0.5 * logvar).exp() * torch::randn(mean.sizes(), generator, torch::kFloat32).to(mean.device());
  return normalize(z);
}

torch::Tensor WanVae::encode_image_video(const torch::Tensor& image, int64_t frames,
                                         const std::optional<WanVaeTiling>& tiling) const {
  TORCH_CHECK(image.dim() == 3 && image.size(0) == 3, "WanVae::encode_image_video: expected an image [3, H, W], got ",
              image.sizes());
  TORCH_CHECK(frames >= 1 && (frames - 1) % 4 == 0, "WanVae::encode_image_video: ", frames,
              " frames; the VAE takes 1 + 4k");
  torch::NoGradGuard no_grad;
  auto video =
      torch::zeros({1, 3, frames, image.size(1), image.size(2)}, torch::dtype(torch::kFloat32).device(device_));
  video.select(2, 0)[0].copy_(image);
  return encode(video, false, std::nullopt, tiling);
}

torch::Tensor WanVae::decode_unscaled(const torch::Tensor& latents, const std::optional<WanVaeTiling>& tiling) const {
  TORCH_CHECK(latents.dim() == 5 && latents.size(1) == config_.z_dim && latents.size(2) >= 1,
              "WanVae::decode: expected latents [B, ", config_.z_dim, ", t, h, w], got ", latents.sizes());
  torch::NoGradGuard no_grad;
  const int64_t f = config_.spatial_downscale(), p = config_.patch_size, patched = config_.encoder_downscale();
  auto z = latents.to(device_, dtype_);
  torch::Tensor x;
  if (tiling && (z.size(3) * f > tiling->tile || z.size(4) * f > tiling->tile)) {
    check_tiling(*tiling, f);
    // Tiles in latents, blended on the decoder's patchified output.
    x = tiled(z, tiling->tile / f, tiling->stride / f, (tiling->tile - tiling->stride) / p, tiling->stride / p,
              z.size(3) * patched, z.size(4) * patched, [&](const torch::Tensor& t) { return decode_clip(t); });
  } else {
    x = decode_clip(z);
  }
  return unpatchify(x, p).to(torch::kFloat32).clamp(-1.0, 1.0);
}

torch::Tensor WanVae::decode(const torch::Tensor& latents, const std::optional<WanVaeTiling>& tiling) const {
  return decode_unscaled(denormalize(latents), tiling);
}

}  // namespace megaslide
