#include "megaslide/data/bucket_sampler.h"

#include <stdexcept>
#include <string>

namespace megaslide {

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform integer in [0, n) from a 64-bit stream state (Lemire's multiply-shift; the tiny bias of a
// 64-bit draw over n < 2^32 items does not matter for shuffling).
uint64_t below(uint64_t& state, uint64_t n) {
  state = splitmix64(state);
  return static_cast<uint64_t>((static_cast<unsigned __int128>(state) * n) >> 64);
}

template <typename T>
void shuffle(std::vector<T>& v, uint64_t state) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(below(state, i))]);
}
}  // namespace

BucketBatchSampler::BucketBatchSampler(std::vector<int64_t> bucket_of, int64_t num_buckets, int64_t batch_size,
                                       uint64_t seed)
    : by_bucket_(static_cast<size_t>(num_buckets)), batch_size_(batch_size), seed_(seed) {
  if (batch_size < 1) throw std::invalid_argument("BucketBatchSampler: batch_size must be >= 1");
  for (size_t i = 0; i < bucket_of.size(); ++i) {
    const int64_t b = bucket_of[i];
    if (b < 0 || b >= num_buckets)
      throw std::invalid_argument("BucketBatchSampler: item " + std::to_string(i) + " has bucket " + std::to_string(b));
    by_bucket_[static_cast<size_t>(b)].push_back(static_cast<int64_t>(i));
  }
  for (const auto& items : by_bucket_)
    batches_per_epoch_ += (static_cast<int64_t>(items.size()) + batch_size - 1) / batch_size;
  if (batches_per_epoch_ == 0) throw std::invalid_argument("BucketBatchSampler: no items");
}

std::vector<PlannedBatch> BucketBatchSampler::epoch_plan(int64_t epoch) const {
  std::vector<PlannedBatch> plan;
  const uint64_t epoch_state = splitmix64(splitmix64(seed_) ^ static_cast<uint64_t>(epoch));
  for (size_t b = 0; b < by_bucket_.size(); ++b) {
    auto order = by_bucket_[b];
    if (order.empty()) continue;
    shuffle(order, splitmix64(epoch_state ^ (0x1000 + b)));
    for (size_t start = 0; start < order.size(); start += static_cast<size_t>(batch_size_)) {
      PlannedBatch batch;
      batch.epoch = epoch;
      batch.bucket = static_cast<int64_t>(b);
      for (int64_t k = 0; k < batch_size_; ++k)
        batch.items.push_back(order[(start + static_cast<size_t>(k)) % order.size()]);
      plan.push_back(std::move(batch));
    }
  }
  shuffle(plan, splitmix64(epoch_state ^ 0xBA7C4));
  for (size_t i = 0; i < plan.size(); ++i) plan[i].index = static_cast<int64_t>(i);
  return plan;
}

PlannedBatch BucketBatchSampler::batch(int64_t epoch, int64_t index) const {
  if (epoch < 0 || index < 0 || index >= batches_per_epoch_)
    throw std::invalid_argument("BucketBatchSampler: no batch " + std::to_string(index) + " in epoch " +
                                std::to_string(epoch));
  if (cached_epoch_ != epoch) {
    cached_plan_ = epoch_plan(epoch);
    cached_epoch_ = epoch;
  }
  return cached_plan_[static_cast<size_t>(index)];
}

PlannedBatch BucketBatchSampler::next() {
  PlannedBatch b = batch(epoch_, cursor_);
  if (++cursor_ == batches_per_epoch_) ++epoch_, cursor_ = 0;
  return b;
}

void BucketBatchSampler::seek(int64_t epoch, int64_t cursor) {
  if (epoch < 0 || cursor < 0 || cursor >= batches_per_epoch_)
    throw std::invalid_argument("data position epoch " + std::to_string(epoch) + " batch " + std::to_string(cursor) +
                                " is out of range (" + std::to_string(batches_per_epoch_) + " batches per epoch)");
  epoch_ = epoch, cursor_ = cursor;
}

}  // namespace megaslide
