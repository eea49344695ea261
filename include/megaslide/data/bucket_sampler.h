// Batches for a bucketed dataset (video_dataset.h): every batch holds items of one bucket, in an order
// that is a pure function of (seed, epoch), so a position (epoch, cursor) is the sampler's whole state.
//
// Epoch e: each bucket's items are shuffled (Fisher–Yates over splitmix64 draws of (seed, e, bucket):
// the same on every platform), cut into batches of batch_size — the last one filled up with the bucket's
// first items of that order, so every item is seen once or more per epoch and every batch is full — and
// the batches of all buckets are shuffled together.
//
// Thread-safety: one thread drives a sampler (batch() keeps the plan of the last epoch asked for).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace megaslide {

struct PlannedBatch {
  int64_t epoch = 0;
  int64_t index = 0;  // position within the epoch
  int64_t bucket = 0;
  std::vector<int64_t> items;  // dataset item numbers
};

class BucketBatchSampler {
 public:
  // bucket_of[i]: the bucket of item i (0 <= bucket < num_buckets). Buckets without items get no batches.
  BucketBatchSampler(std::vector<int64_t> bucket_of, int64_t num_buckets, int64_t batch_size, uint64_t seed);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // Batch `index` of `epoch` (no state changes).
  PlannedBatch batch(int64_t epoch, int64_t index) const;
  // The batch at the current position; advances it (to the next epoch after the last batch).
  PlannedBatch next();

  // The position of the next batch: seek() restores one (checkpoint resume).
  int64_t epoch() const { return epoch_; }
  int64_t cursor() const { return cursor_; }
  void seek(int64_t epoch, int64_t cursor);

  // The items of `bucket`, for replacements of items that fail to load.
  const std::vector<int64_t>& bucket_items(int64_t bucket) const { return by_bucket_.at(static_cast<size_t>(bucket)); }

 private:
  std::vector<PlannedBatch> epoch_plan(int64_t epoch) const;

  std::vector<std::vector<int64_t>> by_bucket_;
  int64_t batch_size_;
  uint64_t seed_;
  int64_t batches_per_epoch_ = 0;
  int64_t epoch_ = 0, cursor_ = 0;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<PlannedBatch> cached_plan_;
};

}  // namespace megaslide
