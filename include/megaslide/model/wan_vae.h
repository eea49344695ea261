// The Wan video VAEs: what diffusers' AutoencoderKLWan computes, for Wan 2.1's VAE and Wan 2.2's (the
// TI2V-5B VAE: residual down/up blocks and 2×2 patches, 16× in space), loaded from any of the downloads:
//   - diffusers' `vae/` folder (Wan-AI/Wan2.1-T2V-*-Diffusers, Wan-AI/Wan2.2-TI2V-5B-Diffusers): config.json +
//     diffusion_pytorch_model.safetensors, diffusers' tensor names. Sizes from config.json (base_dim,
//     decoder_base_dim, z_dim, dim_mult, num_res_blocks, temperal_downsample, in/out_channels, is_residual,
//     patch_size, latents_mean, latents_std; attn_scales must be empty; scale_factor_spatial/temporal, when
//     present, must agree with the sizes).
//   - one safetensors file with the original Wan names: Wan 2.1's (ComfyUI's `wan_2.1_vae.safetensors`,
//     `Wan2.1_VAE.pth` converted) or Wan 2.2's (ComfyUI's `wan2.2_vae.safetensors`, `Wan2.2_VAE.pth`
//     converted; recognised by its nested encoder.downsamples.L.downsamples.K names and taken with Wan 2.2's 2×2
//     patches). Sizes inferred from the tensor shapes; such a file carries no latent statistics: Wan 2.1's
//     published values for z_dim 16, Wan 2.2's for z_dim 48, or the ones given to load().
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
//   Wan 2.2 (is_residual, patch_size 2):
//     - videos go through the encoder as 2×2 patches (C·4 channels, half the size; channel c·4 + 2·dx + dy for
//       pixel offset (dy, dx)) and the decoder's output comes back the same way;
//     - each encoder level adds to its output a parameter-free shortcut of its input: zero frames in front up to
//       a multiple of its temporal factor, then every channel's 2×2 (×2 frames where temporal) block unfolded
//       into channels and consecutive groups of them averaged down to the level's width;
//     - each decoder level but the last adds the reverse: channels repeated up to width·block, folded back
//       into 2×2 (×2 frames) blocks, for the very first latent frame without the earlier of its two frames;
//     - the upsamplers' 3×3 convs keep the width (no halving).
//   The encoder runs on the first frame alone, then chunks of 4 frames; the decoder on one latent frame at a
//   time. T frames <-> 1 + (T − 1)/4 latent frames (T must be 1 + 4k), H×W <-> H/s × W/s with
//   s = spatial_downscale() (8 for Wan 2.1, 16 for Wan 2.2; H and W must be multiples of s).
//
// Normalised latents (what the Wan DiT sees): z = (μ − latents_mean) / latents_std per channel, and back.
//
// Spatial tiling (diffusers' tiled_encode / tiled_decode): tiles of `tile` pixels every `stride` pixels,
// each run through the whole clip with its own cache; neighbouring tiles blended linearly over
// tile − stride pixels (tile/e − stride/e latents when encoding, e = encoder_downscale()). Memory is then that of a
// tile-sized clip instead of a frame-sized one (docs/conditioning.md gives the figures). With 2×2 patches diffusers
// measures encoding tiles on the patchified frame — `tile` patches every `stride` patches, 2·tile pixels —
// and so does this class, to give diffusers' numbers; decoding tiles stay in pixels.
//
// Frozen: no gradients. Weights live on `device` in `dtype` (fp32, or bf16/fp16 on a GPU); outputs are
// float32 on that device. Errors loading: io::PretrainedError naming the folder or file, the tensor and what
// was expected; bad arguments: c10::Error. Thread-safety: one thread at a time.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace megaslide {

struct WanVaeConfig {
  // in_channels / out_channels count the video's channels (3 for RGB); diffusers' config.json counts them
  // after the patchify (in_channels·patch_size², 12 for Wan 2.2).
  int64_t base_dim = 96, decoder_base_dim = 96, z_dim = 16, num_res_blocks = 2, in_channels = 3, out_channels = 3;
  std::vector<int64_t> dim_mult = {1, 2, 4, 4};
  std::vector<bool> temporal_downsample = {false, true,
                                           true};  // diffusers' temperal_downsample, one per level but the last
  bool is_residual = false;  // Wan 2.2's residual down/up blocks (averaging / repeating shortcuts)
  int64_t patch_size = 1;    // Wan 2.2: 2 (2×2 pixels become channels before the encoder, back after the decoder)
  std::vector<double> latents_mean, latents_std;  // z_dim each; Wan 2.1's published values by default
  WanVaeConfig();
  // The encoder's own downscale (on the patchified frame) and the video's: pixels per latent.
  int64_t encoder_downscale() const { return int64_t{1} << (dim_mult.size() - 1); }
  int64_t spatial_downscale() const { return patch_size * encoder_downscale(); }
  int64_t temporal_downscale() const;
  // Latent frames for `frames` video frames (which must be 1 + 4k), and back.
  int64_t latent_frames(int64_t frames) const { return 1 + (frames - 1) / 4; }
  int64_t video_frames(int64_t latent_frames) const { return 1 + (latent_frames - 1) * temporal_downscale(); }
};

// Decoding: tile and stride multiples of spatial_downscale(). Encoding: multiples of encoder_downscale(), in
// patches when patch_size > 1 (see above); a frame no larger than `tile` pixels is encoded whole.
struct WanVaeTiling {
  int64_t tile = 256;    // pixels (diffusers' tile_sample_min_height/width)
  int64_t stride = 192;  // pixels between tile starts (tile_sample_stride_height/width); tile − stride blended
};

class WanVae {
 public:
  // `path`: a diffusers vae/ folder, or a single safetensors file with the original Wan names.
  static WanVae load(const std::string& path, torch::Device device = torch::kCPU,
                     torch::ScalarType dtype = torch::kFloat32);
  // The same with the latent statistics given (z_dim each) instead of the source's: for a single file whose
  // z_dim has no published statistics, or a VAE retrained with its own.
  static WanVae load(const std::string& path, const std::vector<double>& latents_mean,
                     const std::vector<double>& latents_std, torch::Device device = torch::kCPU,
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
  // Latents as the encoder gives them (not normalised) [B, z, t, h, w] -> videos [B, C, 1 + 4(t − 1), s·h, s·w]
  // (s = spatial_downscale()) clamped to [−1, 1], float32.
  torch::Tensor decode_unscaled(const torch::Tensor& latents,
                                const std::optional<WanVaeTiling>& tiling = std::nullopt) const;
  // Normalised latents -> videos.
  torch::Tensor decode(const torch::Tensor& latents, const std::optional<WanVaeTiling>& tiling = std::nullopt) const;

  // Image-to-video's conditioning video (diffusers' WanImageToVideoPipeline.prepare_latents): `image` [3, H, W]
  // in [−1, 1] as the first of `frames` frames (1 + 4k), the others black (0), encoded (the mean, normalised):
  // [1, z, 1 + (frames − 1)/4, H/s, W/s] float32. Every latent frame depends on the image (the encoder is causal
  // with a cache across chunks), so the whole video is encoded.
  torch::Tensor encode_image_video(const torch::Tensor& image, int64_t frames,
                                   const std::optional<WanVaeTiling>& tiling = std::nullopt) const;

  // z = (μ − mean) / std and back, per channel (dim 1) of [B, z, ...] latents.
  torch::Tensor normalize(const torch::Tensor& latents) const;
  torch::Tensor denormalize(const torch::Tensor& latents) const;

  // The architecture a diffusers vae/ folder's config.json describes (its weights not read). Throws
  // io::PretrainedError naming the file.
  static WanVaeConfig folder_config(const std::string& folder);

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
  struct Statistics;
  static WanVae load_with(const std::string& path, torch::Device device, torch::ScalarType dtype,
                          const Statistics* statistics);
  static WanVae build(const WanVaeConfig& config, torch::Device device, torch::ScalarType dtype, const Source& source);
  // On patchified videos: quant conv output [B, 2z, t, h, w], untiled; and back, unclamped, untiled.
  torch::Tensor encode_clip(const torch::Tensor& x) const;
  torch::Tensor decode_clip(const torch::Tensor& z) const;
  torch::Tensor encoder_chunk(const torch::Tensor& x, Cache& cache) const;
  torch::Tensor decoder_chunk(const torch::Tensor& x, Cache& cache, bool first_chunk) const;
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
