// The Stable Diffusion VAE: what diffusers' AutoencoderKL computes, loaded from the folders people
// download — the vae/ folder of a Stable Diffusion 1.x checkpoint, or stabilityai/sd-vae-ft-mse:
// config.json + diffusion_pytorch_model.safetensors. Sizes come from config.json (block_out_channels,
// layers_per_block, latent_channels, norm_num_groups, in/out_channels, use_quant_conv,
// use_post_quant_conv, mid_block_add_attention; down/up blocks must be DownEncoderBlock2D /
// UpDecoderBlock2D and act_fn silu); scaling_factor (and shift_factor, 0 when absent) too. The mid-block
// attention's tensors are accepted under diffusers' names (to_q, to_k, to_v, to_out.0) and the legacy
// ones (query, key, value, proj_attn). Other tensors in the file are ignored.
//
//   encoder: conv_in, per level (layers_per_block ResNet blocks, then a stride-2 conv after padding right
//            and bottom by one, except at the last level), mid block (ResNet, single-head self-attention
//            over all positions, ResNet), GroupNorm, SiLU, conv_out -> 2·latent_channels, quant_conv:
//            mean and log-variance (clamped to [−30, 20])
//   decoder: post_quant_conv, conv_in, mid block, per level (layers_per_block + 1 ResNet blocks, then
//            nearest 2× upsampling and a conv, except at the last level), GroupNorm, SiLU, conv_out
//   ResNet block: x + conv2(SiLU(GN(conv1(SiLU(GN(x)))))) with a 1×1 conv on x when channels change
//   GroupNorm eps 1e-6 everywhere.
//
// Scaled latents (what a diffusion model sees): z = (latent − shift_factor)·scaling_factor, and back.
// Images are [N, in_channels, H, W] in [−1, 1] with H and W multiples of 2^(levels − 1) (8 for SD);
// latents are [N, latent_channels, H/8, W/8].
//
// Video helpers apply the VAE frame by frame ([B, C, T, H, W] <-> [B, C', T, H', W']) in chunks of
// `frames_per_batch` frames. decode_tiled decodes overlapping latent tiles and blends their overlaps
// linearly, exactly as diffusers' AutoencoderKL.tiled_decode, so that memory is bounded by the tile, not
// the frame (docs/conditioning.md).
//
// Frozen: no gradients. Weights live on `device` in `dtype` (fp32, or bf16/fp16 on a GPU); outputs are
// float32 on that device. Errors: io::PretrainedError naming the folder, file, tensor and what was
// expected. Thread-safety: one thread at a time.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace megaslide {

struct SdVaeConfig {
  int64_t in_channels = 3, out_channels = 3, latent_channels = 4;
  std::vector<int64_t> block_out_channels = {128, 256, 512, 512};
  int64_t layers_per_block = 2;
  int64_t norm_num_groups = 32;
  double scaling_factor = 0.18215;
  double shift_factor = 0.0;
  bool use_quant_conv = true, use_post_quant_conv = true, mid_block_add_attention = true;
  // Pixels per latent along each side: 2^(levels − 1).
  int64_t downscale() const { return int64_t{1} << (block_out_channels.size() - 1); }
};

struct VaeTiling {
  int64_t tile_size = 512;  // pixels (diffusers' tile_sample_min_size); the latent tile is tile_size / downscale
  double overlap = 0.25;    // diffusers' tile_overlap_factor
};

class SdVae {
 public:
  static SdVae load(const std::string& dir, torch::Device device = torch::kCPU,
                    torch::ScalarType dtype = torch::kFloat32);
  // The architecture of `config` with random weights (N(0, 1/fan_in), norms 1, biases 0): for benchmarks
  // and memory measurements at real sizes without the download.
  static SdVae random(const SdVaeConfig& config, uint64_t seed = 0, torch::Device device = torch::kCPU,
                      torch::ScalarType dtype = torch::kFloat32);

  // images [N, C, H, W] in [−1, 1] -> the latent distribution's mean and log-variance [N, L, h, w]
  // (unscaled), float32.
  std::pair<torch::Tensor, torch::Tensor> encode_distribution(const torch::Tensor& images) const;
  // Scaled latents: the mean, or a sample mean + exp(logvar/2)·ε with ε drawn from `generator` (CPU) for the
  // whole batch in one draw. `images_per_call` > 0 runs the encoder on that many images at a time (memory bounded
  // by it, not by N); the noise is still the one draw.
  torch::Tensor encode(const torch::Tensor& images, bool sample = false,
                       std::optional<at::Generator> generator = std::nullopt, int64_t images_per_call = 0) const;
  // Unscaled latents [N, L, h, w] -> images [N, C, h·8, w·8] (not clamped), float32.
  torch::Tensor decode_unscaled(const torch::Tensor& latents) const;
  // Scaled latents -> images.
  torch::Tensor decode(const torch::Tensor& latents) const;
  // As decode, tile by tile (diffusers' tiled_decode); plain decode when the latents fit in one tile.
  torch::Tensor decode_tiled(const torch::Tensor& latents, const VaeTiling& tiling) const;

  // Videos [B, C, T, H, W], frame by frame in chunks of frames_per_batch (>= 1).
  torch::Tensor encode_video(const torch::Tensor& videos, int64_t frames_per_batch, bool sample = false,
                             std::optional<at::Generator> generator = std::nullopt) const;
  torch::Tensor decode_video(const torch::Tensor& latents, int64_t frames_per_batch,
                             std::optional<VaeTiling> tiling = std::nullopt) const;

  const SdVaeConfig& config() const { return config_; }
  torch::Device device() const { return device_; }
  torch::ScalarType dtype() const { return dtype_; }
  int64_t parameter_count() const;

 private:
  // (name, legacy names, shape) -> the tensor, on the CPU.
  using WeightSource =
      std::function<torch::Tensor(const std::string&, const std::vector<std::string>&, const std::vector<int64_t>&)>;
  static SdVae build(const SdVaeConfig& config, torch::Device device, torch::ScalarType dtype,
                     const WeightSource& source);
  torch::Tensor resnet(const std::string& p, const torch::Tensor& x) const;
  torch::Tensor attention(const std::string& p, const torch::Tensor& x) const;
  torch::Tensor norm_act(const std::string& p, const torch::Tensor& x) const;
  torch::Tensor conv(const std::string& p, const torch::Tensor& x, int64_t stride = 1, int64_t padding = 1) const;
  const torch::Tensor& w(const std::string& name) const;

  SdVaeConfig config_;
  torch::Device device_ = torch::kCPU;
  torch::ScalarType dtype_ = torch::kFloat32;
  std::map<std::string, torch::Tensor> w_;  // diffusers' names (attention under to_q/to_k/to_v/to_out.0)
};

}  // namespace megaslide
