// Validation videos of a Wan run (model.arch: wan, train.sample_every > 0; docs/wan.md): what
// write_validation_samples (diffusion/text_to_video.h) writes for the DiT family, made with Wan's pipeline
// (diffusion/wan_text_to_video.h) from the trainer's current weights.
//
//   construction   the prompts: train.sample_prompts' lines with their own sizes, seeds, steps, guidance
//                  and negative prompts (plan_validation_videos, diffusion/text_to_video.h), or the first
//                  kWanValidationVideos distinct captions of the run's data (a megaslide-cache folder's
//                  items, in item order) or, when the data has none (data.tensors), wan_validation_prompts();
//                  each with its fixed seed (from train.seed), so that successive validations are comparable. umT5
//                  (model.text_encoder: weights, vocab, dtype as megaslide-cache runs it) encodes them and
//                  the negative prompt once, on the run's device (its layers streamed when it would take
//                  more than half of a GPU's free memory), and is freed; the Wan VAE (model.vae.weights) is
//                  loaded once to check it, and freed.
//   write          per prompt, one video at a time: the flow sampler with guidance (WanSampleOptions::
//                  from_config: diffusion.sample_steps, shift, guidance_scale, data.max_text_tokens; Wan's
//                  negative prompt) over the trainer's DiT, then the Wan VAE, loaded on the run's device for
//                  this call (model.vae.dtype; model.vae.tile_size tiles), decodes it. Writes
//                  DIR/videos/{prompt}-{index}.mp4 (H.264, 16 fps, Wan's sample_fps) and DIR/index.json, VBench's
//                  layout as megaslide-sample's.
//
// The DiT's weights are the trainer's, read in place (no copy of the model): the resident loop's module
// runs as it is (ResidentWanDenoiser, fp32); the streamed trainer's blocks stream from its host store —
// each block's compute copy, or its fp32 master with offload.compute_dtype fp32, exactly what its next
// step uploads — through a WeightStreamer of the sampler's own (StreamedWanDenoiser over
// WanBlockWeights), with the prologue, head and the blocks' fp32 tables where the trainer keeps them on
// the device. When the run fine-tunes one of Wan2.2's experts (model.wan.expert), the other one is read
// from its weights for each validation and streamed (StreamedWanDenoiser, the trainer's compute dtype)
// behind a WanExpertsDenoiser: the videos are the pair's, switching at model.wan.boundary_ratio. So a streamed run's
// videos are what a resident model holding the masters rounded to the compute dtype gives (tested bit for bit on the
// CPU: tests/test_wan_validation.cpp).
//
// Memory, besides the training's: while write runs, the sampler's streamer (two weight and two gradient
// slots of the largest block, compute dtype, on the device; streamed trainer only; measured against the
// resident set in tests/test_host_memory.cpp), with one of Wan2.2's experts trained the other one's
// blocks in the compute dtype in host memory (28.1 GB in bf16 for an A14B expert) and its streamer, the VAE's weights
// (127 M parameters for Wan 2.1's: 0.5 GB in fp32), one video's sampling activations (the DiT on 2 ×
// tokens, guidance's two halves) and its decode; all freed when it returns. At construction umT5 (5.7 B
// parameters for umT5-XXL: 11.4 GB in bf16, 22.8 GB in fp32) is held until the prompts are encoded —
// run_training builds this before the trainer, so that it never coexists with the trainer's state. Kept
// for the run: the prompts' and negative prompts' embeddings ([data.max_text_tokens, text_dim] fp32 each:
// 8.4 MB at 512 × 4096).
//
// Sampling draws from its own generators (one per video's seed): the training's random streams, its
// weights and its optimizer state are untouched (tested: a run that writes validation videos trains
// bit for bit as one that does not).
//
// Thread-safety: the thread that drives the trainer calls write (it waits for the trainer's host
// updates first).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/diffusion/text_to_video.h"
#include "megaslide/diffusion/wan_text_to_video.h"
#include "megaslide/io/vbench_layout.h"

namespace megaslide {

struct WanLatentData;

class Trainer;

// Videos per validation.
constexpr int64_t kWanValidationVideos = 2;
// The prompts when the data has no captions (latent tensors).
const std::vector<std::string>& wan_validation_prompts();

// Throws ConfigError(source, key, ...) naming the first key Wan's validation videos need that `config`
// lacks: model.text_encoder.kind (umt5) and .weights, model.vae.kind (wan) and .weights. A no-op when
// train.sample_every is 0 or the model is not Wan.
void check_wan_validation_config(const RunConfig& config, const std::string& source);

// Puts a Wan DiT back in the training mode it had when the guard was made (a denoiser sets eval mode).
class WanTrainingModeGuard {
 public:
  explicit WanTrainingModeGuard(WanTransformer model)
      : model_(std::move(model)), was_training_(model_->is_training()) {}
  ~WanTrainingModeGuard() { model_->train(was_training_); }
  WanTrainingModeGuard(const WanTrainingModeGuard&) = delete;
  WanTrainingModeGuard& operator=(const WanTrainingModeGuard&) = delete;

 private:
  WanTransformer model_;
  bool was_training_;
};

// The trainer's current Wan DiT as a denoiser, read in place as the validation videos read it (above): the resident
// module itself (fp32), or its blocks streamed from the host store; Wan2.2's two experts trained together behind a
// WanExpertsDenoiser switching at model.wan.boundary_ratio. The models are in eval mode until the result is
// destroyed, and then in their modes before. Waits for the trainer's pending updates. `config`: the run's.
struct TrainedWanDenoiser {
  std::vector<std::unique_ptr<WanTrainingModeGuard>> modes;  // destroyed after the denoiser
  std::shared_ptr<WanDenoiser> denoiser;
};
TrainedWanDenoiser trained_wan_denoiser(Trainer& trainer, const RunConfig& config);

class WanValidation {
 public:
  // `config`: the run's (model.arch wan, the encoders named; data.dataset videos with pixel sizes or
  // latent-tensors with latent sizes). `captions`: the data's first items' captions in item order, from item 0
  // (empty for latent tensors); the first kWanValidationVideos distinct non-empty ones are the prompts. Throws
  // ConfigError naming the key of an encoder that cannot be loaded or does not fit the DiT (model.text_encoder.*,
  // model.vae.*, model.wan.text_dim).
  WanValidation(const RunConfig& config, const std::vector<std::string>& captions, const std::string& source);

  const std::vector<io::SampleJob>& jobs() const { return jobs_; }
  const WanSampleOptions& options() const { return options_; }
  const RunConfig& latent_config() const { return latent_; }

  // Image-to-video (wan_image_to_video): the images the videos start from, fixed for the run — a caption's
  // video the image of the item the caption came from, any other (train.sample_prompts' lines, the default
  // prompts) item i mod N's for video i, each sampled at that item's size (its bucket's) — but a line of its own
  // size the first item from i mod N on of that size — from the run's N items (`data`: its image_latents, and its
  // image_embeds where the DiT has an image branch). Throws ConfigError naming train.sample_prompts when no item
  // has a line's size. Wan2.2 TI2V's image-to-video (diffusion.first_frame_clean > 0; wan_first_frame_validation):
  // the same items' own first latent frames, kept clean through the sampling as the training kept them.
  void images(const WanLatentData& data);

  // Each video's normalised latents [1, C, T, H, W] float32 on the CPU, sampled with the trainer's
  // current weights (waits for its pending updates; its weights and modes are as before on return).
  std::vector<torch::Tensor> sample(Trainer& trainer) const;
  // sample, decoded and written into `dir` (created) as above. Returns the videos' file names.
  std::vector<std::string> write(const std::string& dir, Trainer& trainer) const;

 private:
  RunConfig config_;    // the run's (encoders named)
  std::string source_;  // where the config came from (errors name it)
  RunConfig latent_;    // wan_latent_config: the latents' shape
  WanSampleOptions options_;
  std::vector<ValidationVideo> videos_;  // train.sample_prompts' lines, or the captions (plan_validation_videos)
  std::vector<io::SampleJob> jobs_;      // videos_' jobs
  std::vector<torch::Tensor> text_;      // per job [1, L, text_dim] float32, CPU
  std::map<std::string, torch::Tensor>
      negatives_;               // per negative prompt of a video with guidance: [1, L, text_dim] float32, CPU
  std::vector<int64_t> items_;  // per video: the item its caption is, or -1
  std::vector<WanImageCondition> conditions_;  // per video, image-to-video (CPU); TI2V: the first frame [1, C, 1, h, w]
};

// Whether a Wan run's validation videos start from its data's images: image-to-video DiTs (wan_image_to_video), and
// Wan2.2 TI2V trained with a clean first frame (diffusion.first_frame_clean > 0), from its clips' own first frames.
bool wan_validation_from_images(const RunConfig& config);

}  // namespace megaslide
