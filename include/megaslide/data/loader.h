// The background loader of training batches (docs/data.md): a pool of `workers` threads loads the next
// `prefetch` batches that a BucketBatchSampler plans — decoding videos or reading a cache — and stacks
// each into one tensor (in pinned memory when the trainer feeds a GPU, so the host-to-device copy can
// run asynchronously), while the trainer computes.
//
// Order and content do not depend on threads or timing: batch k is always the sampler's batch k, and
// an item that fails to load is replaced by a stand-in of its bucket drawn from (seed, epoch, batch,
// slot, attempt) — the same stand-in on every run, since failing is a property of the file. Each worker
// runs single-threaded (its LibTorch/OpenMP operations on one thread, FFmpeg decoding on one thread),
// so `workers` threads are what the pool adds to the machine's load.
//
// Thread-safety: one thread drives a loader (next, seek); sources are called from the workers
// concurrently (their load() must be thread-safe).
#pragma once

#include <torch/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "megaslide/data/bucket_sampler.h"
#include "megaslide/data/video_dataset.h"

namespace megaslide {

// One item as a source hands it over.
struct ClipSample {
  torch::Tensor video;                // pixels [T, H, W, 3] uint8, or latents [C, T, h, w] float
  torch::Tensor text_ids, text_mask;  // [L] int64 / bool when the source has them precomputed, else undefined
  torch::Tensor text;                 // [L, width] float: a frozen encoder's embeddings when cached (mask in text_mask)
};

// Where a loader's items come from: a VideoDataset decoding files (decoding_source) or a cache
// (latent_cache.h).
class ClipSource {
 public:
  virtual ~ClipSource() = default;
  virtual int64_t size() const = 0;
  virtual int64_t num_buckets() const = 0;
  virtual int64_t bucket_of(int64_t item) const = 0;
  virtual const std::string& caption(int64_t item) const = 0;
  virtual const std::string& path(int64_t item) const = 0;  // for messages
  // Item `item` for `epoch`'s augmentation draws; throws (any std::exception) when the item is bad.
  virtual ClipSample load(int64_t item, int64_t epoch) const = 0;
};

// A VideoDataset as a ClipSource: load() decodes (VideoDataset::load).
std::shared_ptr<ClipSource> decoding_source(std::shared_ptr<const VideoDataset> dataset);

// Runs the calling thread's LibTorch CPU operations on one thread (OpenMP's per-thread setting, after
// LibTorch's own lazy initialisation of it), leaving every other thread's setting alone.
void use_one_intra_op_thread();

struct LoadedBatch {
  PlannedBatch plan;
  torch::Tensor video;                // [B, ...] the samples stacked (pinned when the loader pins); B: the slots loaded
  torch::Tensor text_ids, text_mask;  // [B, L] when the source has them
  torch::Tensor text;                 // [B, L, width] when the source has cached embeddings
  std::vector<std::string> captions;
  std::vector<BadItem> failed;  // items that failed to load (each replaced by a stand-in)
  double wait_s = 0.0;          // how long next() waited for this batch
};

struct LoaderOptions {
  int64_t workers = 1;        // 0: load in next() on the calling thread
  int64_t prefetch = 2;       // batches loaded ahead (workers > 0)
  bool pin_memory = false;    // stack into page-locked memory (needs CUDA)
  uint64_t seed = 0;          // stand-in draws
  int64_t max_attempts = 16;  // stand-ins tried for one slot before the batch fails
  // Only slots [slots_begin, slots_begin + slots_count) of each planned batch are loaded (a data-parallel
  // rank's part; -1: all). A slot's item and stand-ins do not depend on the other slots, so the part is
  // exactly those rows of the whole batch.
  int64_t slots_begin = 0, slots_count = -1;
};

class ClipLoader {
 public:
  ClipLoader(std::shared_ptr<const ClipSource> source, BucketBatchSampler sampler, LoaderOptions options);
  ~ClipLoader();
  ClipLoader(const ClipLoader&) = delete;
  ClipLoader& operator=(const ClipLoader&) = delete;

  // The next batch in the sampler's order; rethrows what loading it threw (a DatasetError when every
  // stand-in failed too).
  LoadedBatch next();
  // The position of the batch next() returns next, and its restoration (drops what was loaded ahead).
  int64_t epoch() const { return epoch_; }
  int64_t cursor() const { return cursor_; }
  void seek(int64_t epoch, int64_t cursor);
  const BucketBatchSampler& sampler() const { return sampler_; }

 private:
  struct Slot;
  LoadedBatch load(const PlannedBatch& plan) const;
  void top_up();
  void drop_pending();
  void worker();

  std::shared_ptr<const ClipSource> source_;
  BucketBatchSampler sampler_;  // plans ahead of the position below by the batches queued
  LoaderOptions options_;
  int64_t epoch_ = 0, cursor_ = 0;

  std::mutex mutex_;
  std::condition_variable work_ready_, slot_done_;
  std::deque<std::shared_ptr<Slot>> pending_;  // in batch order
  std::deque<std::shared_ptr<Slot>> tasks_;    // not yet picked up by a worker
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace megaslide
