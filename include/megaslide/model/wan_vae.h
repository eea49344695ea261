// The Wan 2.1 video VAE: what diffusers' AutoencoderKLWan computes, loaded from either download:
//   - diffusers' `vae/` folder (Wan-AI/Wan2.1-T2V-*-Diffusers): config.json +
//     diffusion_pytorch_model.safetensors, diffusers' tensor names. Sizes from config.json (base_dim,
//     decoder_base_dim, z_dim, dim_mult, num_res_blocks, temperal_downsample, in/out_channels,
//     latents_mean, latents_std; attn_scales must be empty, is_residual false and patch_size null — the
//     Wan 2.2 variants are not supported).
//   - one safetensors file with the original Wan names (ComfyUI's `wan_2.1_vae.safetensors`, Wan2.1's
//     `Wan2.1_VAE.pth` converted): sizes inferred from the tensor shapes, latents_mean/latents_std the
//     published Wan 2.1 values (diffusers' defaults; such a file must have z_dim 16).
// One rename table maps the two sets of names; the file is memory-mapped and converted tensor by tensor.
//
//   causal 3D conv: a k×k×k convolution padded by k−1 zero frames before the first (never after) and
//            symmetrically in space; run chunk by chunk, each conv keeps the last two frames of its input
//            (the temporal feature cache), so chunked equals one pass over the whole clip.
//   residual block: shortcut(x) + conv2(SiLU(RMS(conv1(SiLU(RMS(x)))))), shortcut a 1×1×1 conv when the
//            channels change. RMS(x) = x / max(‖x‖₂ over channels, 1e−12) · √C · γ.
//   attention (mid blocks): per frame, RMS, one head over all H·W positions, 1×1 convs in and out, residual.
//   encoder: conv_in, per level num_res_blocks residual blocks then (except at the last level) a
//            downsample — zero-pad right/bottom by one, 3×3 stride-2 conv per frame, and where
//            temperal_downsample says so a temporal stride-2 conv over (previous chunk's last frame, this
//            chunk) — mid block (residual, attention, residual), RMS, SiLU, conv_out -> 2·z_dim, quant conv.
//   decoder: post-quant conv, conv_in, mid block, per level num_res_blocks+1 residual blocks then (except at
//            the last level) an upsample — where temporal, a causal temporal conv to 2·C channels giving two
//            frames per frame (not for the very first frame) — nearest 2× in space and a 3×3 conv to C/2;
//            RMS, SiLU, conv_out, clamped to [−1, 1].
//   The encoder runs on the first frame alone, then chunks of 4 frames; the decoder on one latent frame at a
//   time. T frames <-> 1 + (T − 1)/4 latent frames (T must be 1 + 4k), H×W <-> H/8 × W/8 (H, W multiples of
//   2^(levels − 1)).
//
// Normalised latents (what the Wan DiT sees): z = (μ − latents_mean) / latents_std per channel, and back.
//
// Spatial tiling (diffusers' tiled_encode / tiled_decode): tiles of `tile` pixels every `stride` pixels,
// each run through the whole clip with its own cache; neighbouring tiles blended linearly over
// tile − stride pixels (tile/8 − stride/8 latents when encoding). Memory is then that of a tile-sized
// clip instead of a frame-sized one (docs/conditioning.md gives the figures).
//
// Frozen: no gradients. Weights live on `device` in `dtype` (fp32, or bf16/fp16 on a GPU); outputs are
// float32 on that device. Errors loading: io::PretrainedError naming the folder or file, the tensor and what
// was expected; bad arguments: c10::Error. Thread-safety: one thread at a time.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace megaslide {

struct WanVaeConfig {
  int64_t base_dim = 96, decoder_base_dim = 96, z_dim = 16, num_res_blocks = 2, in_channels = 3, out_channels = 3;
  std::vector<int64_t> dim_mult = {1, 2, 4, 4};
  std::vector<bool> temporal_downsample = {false, true,
                                           true};  // diffusers' temperal_downsample, one per level but the last
  std::vector<double> latents_mean, latents_std;   // z_dim each; Wan 2.1's published values by default
  WanVaeConfig();
  int64_t spatial_downscale() const { return int64_t{1} << (dim_mult.size() - 1); }
  int64_t temporal_downscale() const;
  // Latent frames for `frames` video frames (which must be 1 + 4k), and back.
  int64_t latent_frames(int64_t frames) const { return 1 + (frames - 1) / 4; }
  int64_t video_frames(int64_t latent_frames) const { return 1 + (latent_frames - 1) * temporal_downscale(); }
};

struct WanVaeTiling {
  int64_t tile = 256;    // pixels (diffusers' tile_sample_min_height/width)
  int64_t stride = 192;  // pixels between tile starts (tile_sample_stride_height/width); tile − stride blended
};

class WanVae {
 public:
  // `path`: a diffusers vae/ folder, or a single safetensors file with the original Wan names.
  static WanVae load(const std::string& path, torch::Device device = torch::kCPU,
                     torch::ScalarType dtype = torch::kFloat32);
  // The architecture of `config` with random weights (N(0, 1/fan_in), γ 1, biases 0): for benchmarks and
  // memory measurements at real sizes without the download.
  static WanVae random(const WanVaeConfig& config, uint64_t seed = 0, torch::Device device = torch::kCPU,
                       torch::ScalarType dtype = torch::kFloat32);

  // videos [B, C, T, H, W] in [−1, 1] -> the latent distribution's mean and log-variance [B, z, t, h, w]
  // (not normalised; log-variance clamped to [−30, 20]), float32. Tiled when `tiling` is given and the frame
  // is larger than one tile.
  std::pair<torch::Tensor, torch::Tensor> encode_distribution(
      const torch::Tensor& videos, const std::optional<WanVaeTiling>& tiling = std::nullopt) const;
  // Normalised latents: of the mean, or of a sample mean + exp(logvar/2)·ε with ε drawn from `generator` (CPU).
  torch::Tensor encode(const torch::Tensor& videos, bool sample = false,
                       std::optional<at::Generator> generator = std::nullopt,
                       const std::optional<WanVaeTiling>& tiling = std::nullopt) const;
  // Latents as the encoder gives them (not normalised) [B, z, t, h, w] -> videos [B, C, 1 + 4(t − 1), 8h, 8w]
  // clamped to [−1, 1], float32.
  torch::Tensor decode_unscaled(const torch::Tensor& latents,
                                const std::optional<WanVaeTiling>& tiling = std::nullopt) const;
  // Normalised latents -> videos.
  torch::Tensor decode(const torch::Tensor& latents, const std::optional<WanVaeTiling>& tiling = std::nullopt) const;

  // z = (μ − mean) / std and back, per channel (dim 1) of [B, z, ...] latents.
  torch::Tensor normalize(const torch::Tensor& latents) const;
  torch::Tensor denormalize(const torch::Tensor& latents) const;

  const WanVaeConfig& config() const { return config_; }
  torch::Device device() const { return device_; }
  torch::ScalarType dtype() const { return dtype_; }
  int64_t parameter_count() const;

  // The original Wan name of a diffusers tensor name of this architecture (the rename table); empty when
  // the name is not one of its tensors.
  std::string original_name(const std::string& diffusers_name) const;

 private:
  struct Cache;
  struct Source;
  static WanVae build(const WanVaeConfig& config, torch::Device device, torch::ScalarType dtype, const Source& source);
  torch::Tensor encode_clip(const torch::Tensor& x) const;  // quant conv output [B, 2z, t, h, w], untiled
  torch::Tensor decode_clip(const torch::Tensor& z) const;  // unclamped, untiled
  torch::Tensor encoder_chunk(const torch::Tensor& x, Cache& cache) const;
  torch::Tensor decoder_chunk(const torch::Tensor& x, Cache& cache) const;
  torch::Tensor residual(const std::string& p, const torch::Tensor& x, Cache& cache) const;
  torch::Tensor attention(const std::string& p, const torch::Tensor& x) const;
  torch::Tensor downsample(const std::string& p, const torch::Tensor& x, bool temporal, Cache& cache) const;
  torch::Tensor upsample(const std::string& p, const torch::Tensor& x, bool temporal, Cache& cache) const;
  torch::Tensor cached_conv(const std::string& p, const torch::Tensor& x, Cache& cache) const;
  torch::Tensor rms(const std::string& p, const torch::Tensor& x) const;
  const torch::Tensor& w(const std::string& name) const;
  void check_video(const torch::Tensor& videos, const char* what) const;

  WanVaeConfig config_;
  torch::Device device_ = torch::kCPU;
  torch::ScalarType dtype_ = torch::kFloat32;
  std::unordered_map<std::string, torch::Tensor> w_;       // diffusers' names
  std::unordered_map<std::string, std::string> original_;  // diffusers' name -> original Wan name
  torch::Tensor mean_, inv_std_;                           // [1, z, 1, 1, 1] float32 on device
};

}  // namespace megaslide
