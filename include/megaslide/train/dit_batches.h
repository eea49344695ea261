// The DiT family's training data (train/dit_family.h): micro-batches of DDPM training data drawn from
// structured-motion clips or a video dataset (decoded or cached), with the random streams every mode and
// world size shares.
//
// Thread-safety: one thread drives a batch source (its ClipLoader decodes on its own workers).
#pragma once

#include <torch/types.h>

#include <memory>
#include <random>

#include "megaslide/config/run_config.h"
#include "megaslide/data/structured_motion.h"
#include "megaslide/data/video_manifest.h"
#include "megaslide/diffusion/ddpm.h"
#include "megaslide/diffusion/loss_weighting.h"
#include "megaslide/model/frozen_encoders.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/util/device.h"

namespace megaslide {

// One micro-batch of DDPM training data on a device.
struct DiffusionBatch {
  torch::Tensor x0, noise, timesteps, xt;  // video [B, C, T, H, W] and timesteps [B] (int64)
  torch::Tensor target;                    // what the loss compares the model's output with (diffusion.prediction)
  torch::Tensor
      loss_weight;  // [B] float32: each sample's weight in the loss (diffusion.loss_weighting), else undefined
  torch::Tensor text_ids, text_mask;  // [B, L] int64 and bool
  torch::Tensor text;        // [B, L, model.text_dim] float32: the frozen CLIP's embeddings (text_ids undefined),
                             // or undefined for the built-in encoder, which the trainer runs on text_ids
  double data_wait_s = 0.0;  // time next() waited for the clips
};

class ClipLoader;

// The random streams of a training run, shared by the resident and the streamed trainer so that
// both see the same clips, captions, timesteps and noise in the same order: clip order from an
// EpochSampler(train.seed) (structured-motion) or a BucketBatchSampler(train.seed) behind a background
// ClipLoader (videos, decoded or from data.cache; data/loader.h), caption dropout from an mt19937_64,
// timesteps then noise from a CPU generator seeded by train.seed.
// With frozen encoders (model.text_encoder.kind: clip, model.vae.kind: sd; model/frozen_encoders.h), the
// batch's captions become CLIP embeddings (DiffusionBatch::text) and its pixels the VAE's scaled latents,
// on the training device, before the noise is drawn: x0, noise and target are latents.
class DiffusionBatchSource {
 public:
  // videos: reads the manifest and probes the files, or opens the cache (DatasetError for bad input). `frozen`: the
  // frozen encoders to use where the config needs them, instead of loading its own (a validation source shares the
  // training source's: the same model.* keys and device).
  explicit DiffusionBatchSource(const RunConfig& config, std::shared_ptr<FrozenEncoders> frozen = nullptr);
  ~DiffusionBatchSource();
  DiffusionBatch next(torch::Device device);
  const CaptionTokenizer& tokenizer() const { return tokenizer_; }
  const DDPMSchedule& schedule() const { return schedule_; }
  // The frozen CLIP / VAE the config names (nullptr for the built-in encoder without a VAE).
  const std::shared_ptr<FrozenEncoders>& frozen() const { return frozen_; }
  // The streams' position as JSON (clip order epoch and cursor, the caption-dropout engine, the
  // timestep/noise generator), and its restoration: a source restored from state() draws exactly
  // what the saved one would have drawn next. restore() throws std::invalid_argument on bad JSON.
  std::string state() const;
  void restore(const std::string& state);
  // videos: bad items not reported yet — those found when listing and probing (or by megaslide-cache),
  // then those that failed to load — each once. Empty for structured-motion.
  std::vector<BadItem> take_new_bad_items();
  // The first `count` captions of the dataset (validation samples).
  std::vector<std::string> captions(int64_t count) const;
  // One line for the log: the usable items, those listed and found bad, each bucket's size and items, and
  // the epochs `steps` steps of global batches make ("" for structured-motion).
  std::string describe(int64_t steps) const;
  // videos decoded: the dataset's notices (VideoDataset::notices), for the log's warnings.
  std::vector<std::string> notices() const;
  // Data parallelism: next() returns the rank-th contiguous 1/world_size of each global batch of
  // train.batch_size items. Every random draw (clip order, caption dropout, timestep, noise) is still
  // made for the whole global batch in the single-process order, so item i of the global batch gets the
  // same draws at any world size; only the rank's clips are rendered (structured-motion) or loaded
  // (videos: decoded or read from the cache; a failed item's stand-in is drawn per slot, so the rows are
  // the whole batch's). Throws std::invalid_argument unless world_size divides train.batch_size and
  // 0 <= rank < world_size.
  void take_slice(int64_t rank, int64_t world_size);

 private:
  struct Videos;
  std::unique_ptr<ClipLoader> make_loader(int64_t slots_begin, int64_t slots_count) const;
  RunConfig config_;
  StructuredMotionDataset dataset_;
  EpochSampler sampler_;
  std::unique_ptr<Videos> videos_;
  CaptionTokenizer tokenizer_;
  DDPMSchedule schedule_;
  Prediction prediction_;
  LossWeighting loss_weighting_;
  std::mt19937_64 caption_rng_;
  at::Generator generator_;
  torch::Device schedule_device_ = torch::kCPU;
  int64_t slice_rank_ = 0, slice_count_ = 1;
  std::shared_ptr<FrozenEncoders> frozen_;
};

}  // namespace megaslide
