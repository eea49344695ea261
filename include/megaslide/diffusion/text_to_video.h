// Text to video: captions -> caption encoder -> sampler (with classifier-free guidance) -> codec -> pixels.
//
//   VideoCodec   maps the model's sample space to pixels. PixelCodec is the identity for pixel-space
//                models; VaeCodec decodes a latent model's samples through the frozen Stable Diffusion
//                VAE (model.vae.kind: sd). TextToVideo picks the codec and the prompt encoder (the
//                built-in one, or the frozen CLIP) from the model's config.
//   TextToVideo  holds a loaded model and samples videos for prompts with one seed per video.
//
// The unconditional branch of guidance is the empty prompt, as in training (caption dropout), or a
// negative prompt given to generate.
// Ownership: TextToVideo shares the model's modules (no copies). Thread-safety: one thread drives it.
#pragma once

#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/diffusion/sampler.h"
#include "megaslide/diffusion/streamed_denoiser.h"
#include "megaslide/io/vbench_layout.h"
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

// The denoiser a sampler runs `dit` with on `device`: its blocks streamed from the host (StreamedDenoiser)
// when `stream` says so for its size, else resident in `compute_dtype` (moved to the device); null for
// resident fp32, TextToVideo's own default. `streamed` (when given) tells which.
std::shared_ptr<Denoiser> sampling_denoiser(DiT dit, torch::Device device, StreamChoice stream,
                                            c10::ScalarType compute_dtype, bool* streamed = nullptr);

class TextToVideo {
 public:
  // The denoiser defaults to a ResidentDenoiser over model.dit, which is then moved to `device`; a given
  // denoiser (e.g. StreamedDenoiser over model.dit) places the DiT itself. The caption encoder
  // runs on `device`. The frozen encoders the config names (CLIP, the VAE) are model.frozen, or loaded
  // from their folders onto `device` (ConfigError naming the key when they cannot be). The codec
  // defaults to VaeCodec for latent models, else PixelCodec.
  TextToVideo(TextToVideoModel model, torch::Device device, std::shared_ptr<Denoiser> denoiser = nullptr,
              std::shared_ptr<VideoCodec> codec = nullptr);

  // One video per (prompt, seed) pair: pixels [B, C, T, H, W] float32 in [-1, 1] on the CPU. `shape`:
  // the samples' [C, T, H, W] (empty: sample_shape()); `negative`: the unconditional branch's prompt.
  torch::Tensor generate(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                         const SamplerOptions& options, const std::function<void(int64_t, int64_t)>& on_step = {},
                         const std::vector<int64_t>& shape = {}, const std::string& negative = "");

  // The sampler options of the model's run config (diffusion.sample_steps, diffusion.timestep_spacing,
  // diffusion.guidance_scale).
  SamplerOptions default_options() const;
  const RunConfig& config() const { return model_.config; }
  // [C, T, H, W] of the model's samples (latents for a latent model).
  std::vector<int64_t> sample_shape() const;
  // The tokens `prompt` takes before it is cut to data.max_text_tokens (with its start and end tokens; CLIP's, or the
  // built-in encoder's words after its start token): more means the text encoder reads only its beginning.
  int64_t prompt_tokens(const std::string& prompt) const;

 private:
  Conditioning encode(const std::vector<std::string>& prompts);

  TextToVideoModel model_;
  torch::Device device_;
  CaptionTokenizer tokenizer_;  // the built-in encoder's
  DDPMSchedule schedule_;
  std::shared_ptr<Denoiser> denoiser_;
  std::shared_ptr<VideoCodec> codec_;
};

// One validation video: its job (prompt, VBench index, seed, file name and a prompt file's own steps,
// guidance, negative prompt and size) and the shape [C, T, H, W] it is sampled at.
struct ValidationVideo {
  io::SampleJob job;
  std::vector<int64_t> shape;
};

// A run's validation videos (both model families'): the lines of train.sample_prompts when it is set
// (io::read_prompt_specs, read and checked now: a ConfigError naming train.sample_prompts, the file,
// the line and the problem: a size the model cannot take (model_sample_shape_at), more DDPM steps than
// diffusion.timesteps), else one video per prompt of `prompts` at the run's size and settings. Seeds as
// io::plan_prompt_specs / io::plan_vbench_samples give them (from train.seed). `config`: the run's, with
// pixel sizes for the data that has them.
std::vector<ValidationVideo> plan_validation_videos(const RunConfig& config, const std::vector<std::string>& prompts,
                                                    const std::string& source);

// The videos of a prompt file's lines (io::read_prompt_specs) for a model of `config` (both families;
// pixel sizes for the data that has them): `samples_per_line` per line (io::plan_prompt_specs), each
// at the line's size (--w --h --f over the run's) or the run's. Throws std::invalid_argument naming the
// file and line of a size the model cannot take or of more DDPM steps than diffusion.timesteps.
std::vector<ValidationVideo> plan_prompt_videos(const RunConfig& config, const std::vector<io::PromptSpec>& specs,
                                                int64_t samples_per_line, uint64_t base_seed);

// Whether two videos can be sampled in one batch: the same shape, steps, guidance, negative prompt and image.
bool same_sampling_settings(const ValidationVideo& a, const ValidationVideo& b);

// The DiT family's validation prompts without a prompt file: the first `count` distinct of
// `dataset_captions` (a video dataset's), else the captions of structured-motion clips 0…count−1 of the
// run's dataset (fixed by data.seed).
std::vector<std::string> dit_validation_prompts(const RunConfig& config, int64_t count,
                                                const std::vector<std::string>& dataset_captions);

// Validation videos during training (train.sample_every): `videos` sampled with the config's sampler
// settings (a video's own steps, guidance and negative prompt where it has them) from the given
// modules (shared, not copied; their training mode is restored afterwards) and written in the VBench
// layout — `dir`/videos/{prompt}-{index}.mp4 and `dir`/index.json. Videos at the run's settings are
// sampled as one batch, the others one at a time. Frames of odd size are upscaled 2× (H.264 needs
// even sizes). Sampling draws from its own generators, so it leaves the training's random streams
// untouched. Returns the file names. `frozen`: the trainer's CLIP / VAE when the config names them. `denoiser`:
// what predicts with `dit` (a StreamedDenoiser over a streamed trainer's blocks), else a ResidentDenoiser over it.
std::vector<std::string> write_validation_samples(const std::string& dir, const RunConfig& config, DiT& dit,
                                                  TextEncoder& text_encoder, const std::vector<ValidationVideo>& videos,
                                                  std::shared_ptr<FrozenEncoders> frozen = nullptr,
                                                  std::shared_ptr<Denoiser> denoiser = nullptr);

}  // namespace megaslide
