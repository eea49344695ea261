// The latent and text cache of a video dataset (megaslide-cache, docs/data.md): every usable item decoded
// once, run through the config's VAE and text encoder, and written as sharded safetensors, so that
// training (data.cache: DIR) reads tensors instead of decoding videos and running frozen encoders.
//
//   DIR/shard-NNNNN.safetensors  per item i (its listing index): "i.latents" and the text tensors of the
//                                encoder (see CacheEncoders); for Wan image-to-video also the image's (below)
//   DIR/empty_prompt.safetensors the text tensors of the empty prompt (caption dropout)
//   DIR/cache.json               the manifest, replaced atomically after each shard: the encoders'
//                                identity, the decode settings, every item (source path, size and mtime,
//                                caption, bucket, shard, byte offset and size of its latents, their CRC-32),
//                                every bad item with its reason, every finished shard (size, CRC-32), and
//                                "complete" once all are written
//
// The encoders are the config's (model.text_encoder, model.vae):
//   text  builtin  the caption tokenizer of the trained built-in text encoder: "text_ids" [L] int64 and
//                  "text_mask" [L] bool (data.max_text_tokens; the embedding itself is trained, so it
//                  cannot be cached)
//         clip     CLIP's last_hidden_state "text" [L, width] float32 and "text_mask" [L] bool
//                  (data.max_text_tokens), as FrozenEncoders::encode_text gives them
//         umt5     Wan's convention: the caption cleaned as Wan's prompt_clean (wan_prompt_clean), 512 tokens, umT5's
//                  embeddings zeroed past the prompt: "text" [512, width] float32
//   video none     the pixel codec: the clip's uint8 frames [T, H, W, 3]
//         sd       the SD VAE's scaled latents [C, T, H/8, W/8] float32 (FrozenEncoders::encode_video)
//         wan      the Wan VAE's normalised latents of the distribution's mean [z_dim, 1 + (T−1)/4, H/ds, W/ds]
//                  float32 (WanVae::encode; in model.vae.tile_size tiles when set), ds = model.vae.downscale: z_dim
//                  16 and ds 8 for Wan 2.1's VAE, z_dim 48 and ds 16 for Wan 2.2's (2x2 patches)
// The empty prompt's text tensors go into empty_prompt.safetensors: caption dropout from a cache.
//
// Wan image-to-video (wan_image_to_video: model.wan.in_channels 2 x out_channels + 4) caches each clip's
// conditioning too. The image is the item's own when its listing names one (video_manifest.h), fitted to the
// clip's size (io::fit_image: centre-cropped to its aspect ratio, resized), else the clip's frame
// data.image_frame (0: the first). Per item:
//   image_latents  the Wan VAE's normalised latents of the image followed by black frames, the clip's frame
//                  count (WanVae::encode_image_video, as WanImageToVideoPipeline conditions): [z_dim, T, h, w]
//   image_embeds   with an image branch (model.wan.image_dim > 0), CLIP's penultimate hidden states of the
//                  image as given (CLIP resizes and crops it itself), [257, 1280] for ViT-H/14
//                  (ClipVisionEncoder::encode; the encoder wan_image_encoder_path names)
// The identity then holds "image": the frame, and the image encoder's kind, dtype and files.
//
// The manifest's "encoders" (cache_identity) is what makes two caches interchangeable: per encoder its
// kind, the settings that change its output (dtype, tokens, cleaning, tiling) and a fingerprint of each
// of its files (name, size and the CRC-32 of its first and last MiB, which hold a safetensors file's
// header and first tensors) — another checkpoint, another size or another tokenizer is a mismatch. Paths
// are not part of it: moving the weights keeps a cache valid.
//
// A clip is cached with epoch 0's augmentation draws (video_dataset.h): training from the cache sees
// that clip every epoch, where decoding draws afresh each epoch.
//
// Building resumes: a manifest of the same config keeps every finished shard that still verifies (size
// and CRC-32) and writes the rest; a manifest of another config is refused, naming what differs.
// Opening for training refuses an incomplete cache, other encoders or decode settings, and stale items
// (a source or its own image whose size or mtime changed, an item of the dataset the cache does not hold, an
// item whose listed image is another now), naming them.
// Errors are DatasetError. Shards are memory-mapped; each item's CRC-32 is checked as it is read.
//
// Thread-safety: LatentCache::load may run on several threads at once; building is one call.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/data/loader.h"
#include "megaslide/io/safetensors.h"

namespace megaslide {

// The frozen part of conditioning and the codec, as the cache runs them.
class CacheEncoders {
 public:
  virtual ~CacheEncoders() = default;
  // One caption's text tensors (above), on the CPU.
  virtual io::NamedTensors encode_text(const std::string& caption) const = 0;
  // The tokens of `caption` the text encoder would read whole, and the most it reads (a longer caption is cut there);
  // {0, 0} where the encoder does not count them.
  virtual std::pair<int64_t, int64_t> caption_tokens(const std::string& /*caption*/) const { return {0, 0}; }
  // One clip [T, H, W, 3] uint8 -> what the model trains on (above), on the CPU.
  virtual torch::Tensor encode_video(const torch::Tensor& frames) const = 0;
  // Image-to-video's tensors of a clip of `frames` frames conditioned on `image` ([3, H, W] float in [-1, 1]
  // at the clip's size) given as `pixels` ([H', W', 3] uint8, the image before it was fitted): image_latents
  // and (image branch) image_embeds, on the CPU; empty when the config is not image-to-video.
  virtual io::NamedTensors encode_image(const torch::Tensor& image, const torch::Tensor& pixels, int64_t frames) const {
    return {};
  }
};

// The encoders `config` names, loaded on `device`. Throws ConfigError naming the key.
std::unique_ptr<CacheEncoders> cache_encoders(const RunConfig& config, torch::Device device = torch::kCPU);
// Their identity (JSON text, as above), from the config and the files' fingerprints (no weights loaded).
// Throws ConfigError naming the key when a file cannot be read.
std::string cache_identity(const RunConfig& config);

struct CacheBuildOptions {
  std::string out;           // the cache folder (created)
  int64_t shard_items = 64;  // items per shard
  int64_t threads = 1;       // decoding threads
  // Called after each item: (items done, items in all, items done by this call).
  std::function<void(int64_t, int64_t, int64_t)> on_progress;
  std::function<void(const std::string&)> on_warning;  // bad items (once each), shards that failed to verify
};

struct CacheBuildResult {
  int64_t items = 0;         // cached
  int64_t items_reused = 0;  // in shards kept from an earlier, interrupted build
  int64_t shards = 0, shards_reused = 0;
  std::vector<BadItem> bad;  // listing, probing and decoding
};

// Builds (or finishes) the cache of `config`'s dataset in options.out. Throws DatasetError.
CacheBuildResult build_latent_cache(const RunConfig& config, const CacheBuildOptions& options);

class LatentCache final : public ClipSource {
 public:
  // Opens DIR for training with `config` (checks as above; reads the dataset's listing to find items the
  // cache lacks). Throws DatasetError.
  static std::shared_ptr<LatentCache> open(const RunConfig& config, const std::string& dir);
  ~LatentCache() override;

  int64_t size() const override { return static_cast<int64_t>(items_.size()); }
  int64_t num_buckets() const override { return num_buckets_; }
  int64_t bucket_of(int64_t item) const override { return items_.at(static_cast<size_t>(item)).bucket; }
  const std::string& caption(int64_t item) const override { return items_.at(static_cast<size_t>(item)).caption; }
  const std::string& path(int64_t item) const override { return items_.at(static_cast<size_t>(item)).path; }
  // Image-to-video: the item's own image ("" when its image is a frame of the clip, data.image_frame).
  const std::string& image(int64_t item) const { return items_.at(static_cast<size_t>(item)).image; }
  // Views into the mapped shard (valid while the cache lives); the epoch is ignored (see above).
  ClipSample load(int64_t item, int64_t epoch) const override;
  // The empty prompt's text tensors.
  const ClipSample& empty_prompt() const { return empty_prompt_; }
  // Every item's tensor `name` ("latents", "text", ...) stacked in item order [N, ...], or the items `items`
  // in that order when given, as float32 for floating-point tensors (Wan reads its batches so, from the items
  // verified_items gives: WanLatentData::rows). Throws DatasetError naming the first item whose shape differs
  // from the first's, or a tensor the cache lacks. It checks no CRC-32: load and verified_items do.
  torch::Tensor stacked(const std::string& name, const std::vector<int64_t>& items = {}) const;
  // The shape [...] that every one of `items` (every item when empty) has for tensor `name`, from the shards'
  // headers (no data read); nullopt when the first of them has no such tensor. Throws DatasetError as stacked.
  std::optional<std::vector<int64_t>> common_sizes(const std::string& name,
                                                   const std::vector<int64_t>& items = {}) const;
  const std::vector<BadItem>& bad() const { return bad_; }
  int64_t listed() const { return listed_; }
  // Every item checked against its CRC-32s (load) at once, as a run that holds them all in memory needs: the
  // items that pass, in order; each that fails is appended to `failed` with its reason. Throws DatasetError,
  // listing them, when the cache's bad items and these are more than data.max_bad_fraction of the listed
  // items, or none is left.
  std::vector<int64_t> verified_items(std::vector<BadItem>& failed) const;

 private:
  struct Item {
    std::string path, caption;
    std::string image;  // image-to-video: the item's own image ("" when its image is a frame of the clip)
    int64_t index = 0, bucket = 0, shard = 0;
    io::NamedTensors tensors;  // views into the mapping
    uint64_t latents_offset = 0, latents_bytes = 0;
    uint32_t latents_crc32 = 0;
    std::optional<uint32_t> others_crc32;  // its other tensors' (text, image), by name; caches before have none
  };
  struct Mapping;
  LatentCache() = default;
  static std::shared_ptr<LatentCache> open_checked(const RunConfig& config, const std::string& dir);
  // Throws DatasetError listing bad_ and `more` when they are more than max_bad_fraction_ of the listed items.
  void check_bad_fraction(const std::vector<BadItem>& more) const;

  std::string dir_;
  std::vector<Item> items_;
  std::vector<BadItem> bad_;
  std::vector<std::unique_ptr<Mapping>> shards_;
  ClipSample empty_prompt_;
  int64_t num_buckets_ = 1, listed_ = 0;
  double max_bad_fraction_ = 0.0;  // the config's data.max_bad_fraction
};

}  // namespace megaslide
