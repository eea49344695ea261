// Text to video: captions -> caption encoder -> sampler (with classifier-free guidance) -> codec -> pixels.
//
//   VideoCodec   maps the model's sample space to pixels. PixelCodec is the identity for pixel-space
//                models; VaeCodec decodes a latent model's samples through the frozen Stable Diffusion
//                VAE (model.vae.kind: sd). TextToVideo picks the codec and the prompt encoder (the
//                built-in one, or the frozen CLIP) from the model's config.
//   TextToVideo  holds a loaded model and samples videos for prompts with one seed per video.
//
// The unconditional branch of guidance is the empty prompt, as in training (caption dropout).
// Ownership: TextToVideo shares the model's modules (no copies). Thread-safety: one thread drives it.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/diffusion/sampler.h"
#include "megaslide/model/dit_weights.h"
#include "megaslide/model/frozen_encoders.h"
#include "megaslide/model/text_encoder.h"

namespace megaslide {

class VideoCodec {
 public:
  virtual ~VideoCodec() = default;
  // Model samples [B, C, T, H, W] -> pixels [B, C', T', H', W'] in [-1, 1].
  virtual torch::Tensor decode(const torch::Tensor& samples) = 0;
};

class PixelCodec final : public VideoCodec {
 public:
  torch::Tensor decode(const torch::Tensor& samples) override { return samples.clamp(-1.0, 1.0); }
};

// Latents [B, C, T, h, w] -> pixels through the frozen VAE (model/frozen_encoders.h), clamped.
class VaeCodec final : public VideoCodec {
 public:
  explicit VaeCodec(std::shared_ptr<FrozenEncoders> encoders) : encoders_(std::move(encoders)) {}
  torch::Tensor decode(const torch::Tensor& samples) override { return encoders_->decode_video(samples); }

 private:
  std::shared_ptr<FrozenEncoders> encoders_;
};

class TextToVideo {
 public:
  // The denoiser defaults to a ResidentDenoiser over model.dit, which is then moved to `device`; a given
  // denoiser (e.g. StreamedDenoiser over model.dit) places the DiT itself. The caption encoder
  // runs on `device`. The frozen encoders the config names (CLIP, the VAE) are model.frozen, or loaded
  // from their folders onto `device` (ConfigError naming the key when they cannot be). The codec
  // defaults to VaeCodec for latent models, else PixelCodec.
  TextToVideo(TextToVideoModel model, torch::Device device, std::shared_ptr<Denoiser> denoiser = nullptr,
              std::shared_ptr<VideoCodec> codec = nullptr);

  // One video per (prompt, seed) pair: pixels [B, C, T, H, W] float32 in [-1, 1] on the CPU.
  torch::Tensor generate(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                         const SamplerOptions& options, const std::function<void(int64_t, int64_t)>& on_step = {});

  // The sampler options of the model's run config (diffusion.sample_steps, diffusion.timestep_spacing,
  // diffusion.guidance_scale).
  SamplerOptions default_options() const;
  const RunConfig& config() const { return model_.config; }
  // [C, T, H, W] of the model's samples (latents for a latent model).
  std::vector<int64_t> sample_shape() const;

 private:
  Conditioning encode(const std::vector<std::string>& prompts);

  TextToVideoModel model_;
  torch::Device device_;
  CaptionTokenizer tokenizer_;  // the built-in encoder's
  DDPMSchedule schedule_;
  std::shared_ptr<Denoiser> denoiser_;
  std::shared_ptr<VideoCodec> codec_;
};

// Validation videos during training (train.sample_every): the captions of structured-motion clips
// 0…count−1 of the run's dataset (fixed by data.seed) — or the first `count` of `dataset_captions` when
// given (a video dataset's) — each with a fixed seed (io::vbench_seed(caption,
// 0, train.seed)), sampled with the config's sampler settings from the given modules (shared, not copied;
// their training mode is restored afterwards) and written in the VBench layout — `dir`/videos/{caption}-0.mp4
// and `dir`/index.json. Frames of odd size are upscaled 2× (H.264 needs even sizes). Sampling draws from
// its own generators, so it leaves the training's random streams untouched. Returns the file names.
// `frozen`: the trainer's CLIP / VAE when the config names them.
std::vector<std::string> write_validation_samples(const std::string& dir, const RunConfig& config, DiT& dit,
                                                  TextEncoder& text_encoder, int64_t count = 4,
                                                  const std::vector<std::string>& dataset_captions = {},
                                                  std::shared_ptr<FrozenEncoders> frozen = nullptr);

}  // namespace megaslide
