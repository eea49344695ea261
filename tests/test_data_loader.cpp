// The batch sampler and the background loader: every batch holds one bucket's items, each epoch sees every
// item, the order is a function of (seed, epoch) alone and a position restores it; the loader hands over
// the same batches with any number of workers and read-ahead as loading in line, replaces an item that
// fails by the same stand-in every time, and its workers run LibTorch on one thread each.
#include "megaslide/data/loader.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <atomic>
#include <set>
#include <thread>

using megaslide::BucketBatchSampler;
using megaslide::ClipLoader;
using megaslide::ClipSample;
using megaslide::LoaderOptions;

namespace {

// Items whose clip is a function of (item, epoch); items in `broken` throw.
class FakeSource : public megaslide::ClipSource {
 public:
  FakeSource(std::vector<int64_t> buckets, std::set<int64_t> broken = {})
      : buckets_(std::move(buckets)), broken_(std::move(broken)) {
    for (size_t i = 0; i < buckets_.size(); ++i) captions_.push_back("caption " + std::to_string(i));
  }
  int64_t size() const override { return static_cast<int64_t>(buckets_.size()); }
  int64_t num_buckets() const override { return 3; }
  int64_t bucket_of(int64_t item) const override { return buckets_[static_cast<size_t>(item)]; }
  const std::string& caption(int64_t item) const override { return captions_[static_cast<size_t>(item)]; }
  const std::string& path(int64_t item) const override { return captions_[static_cast<size_t>(item)]; }
  ClipSample load(int64_t item, int64_t epoch) const override {
    ++loads;
    if (broken_.count(item)) throw std::runtime_error("item " + std::to_string(item) + " is broken");
    const int64_t side = 2 + bucket_of(item);  // each bucket its own shape
    return {torch::full({2, side, side, 3}, static_cast<uint8_t>(item * 10 + epoch), torch::kUInt8), {}, {}, {}};
  }
  mutable std::atomic<int64_t> loads{0};

 private:
  std::vector<int64_t> buckets_;
  std::set<int64_t> broken_;
  std::vector<std::string> captions_;
};

std::vector<int64_t> mixed_buckets() { return {0, 1, 0, 2, 1, 0, 0, 1, 2, 0, 1}; }

}  // namespace

TEST(BucketBatchSampler, BatchesHoldOneBucketAndEveryEpochSeesEveryItem) {
  const auto buckets = mixed_buckets();
  BucketBatchSampler sampler(buckets, 3, 2, 7);
  EXPECT_EQ(sampler.batches_per_epoch(), 3 + 2 + 1);  // 5, 4 and 2 items in batches of 2
  std::vector<std::vector<int64_t>> orders;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<int64_t> seen;
    std::vector<int64_t> order;
    for (int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
      const auto batch = sampler.next();
      EXPECT_EQ(batch.epoch, epoch);
      ASSERT_EQ(batch.items.size(), 2u);
      for (auto item : batch.items) {
        EXPECT_EQ(buckets[static_cast<size_t>(item)], batch.bucket);
        seen.insert(item);
        order.push_back(item);
      }
    }
    EXPECT_EQ(seen.size(), buckets.size());
    orders.push_back(order);
  }
  EXPECT_NE(orders[0], orders[1]);
  // A position is the whole state; another seed orders differently.
  BucketBatchSampler again(buckets, 3, 2, 7);
  again.seek(1, 2);
  BucketBatchSampler reference(buckets, 3, 2, 7);
  for (int i = 0; i < 6 + 2; ++i) reference.next();
  for (int i = 0; i < 10; ++i) EXPECT_EQ(again.next().items, reference.next().items);
  BucketBatchSampler other(buckets, 3, 2, 8);
  BucketBatchSampler base(buckets, 3, 2, 7);
  bool differs = false;
  for (int i = 0; i < 6; ++i) differs |= other.next().items != base.next().items;
  EXPECT_TRUE(differs);
  EXPECT_THROW(again.seek(0, 6), std::invalid_argument);
}

TEST(ClipLoader, WorkersAndReadAheadHandOverTheSameBatchesAsLoadingInLine) {
  auto source = std::make_shared<FakeSource>(mixed_buckets());
  auto run = [&](int64_t workers, int64_t prefetch) {
    LoaderOptions o;
    o.workers = workers, o.prefetch = prefetch, o.seed = 3;
    ClipLoader loader(source, BucketBatchSampler(mixed_buckets(), 3, 2, 5), o);
    std::vector<torch::Tensor> videos;
    for (int i = 0; i < 14; ++i) {
      auto b = loader.next();
      EXPECT_EQ(b.video.size(0), 2);
      EXPECT_EQ(b.captions.size(), 2u);
      videos.push_back(b.video);
    }
    return videos;
  };
  const auto inline_batches = run(0, 1);
  for (auto [workers, prefetch] : {std::pair<int64_t, int64_t>{1, 1}, {2, 3}, {4, 8}}) {
    const auto batches = run(workers, prefetch);
    for (size_t i = 0; i < batches.size(); ++i)
      EXPECT_TRUE(torch::equal(batches[i], inline_batches[i])) << "batch " << i << " with " << workers << " workers";
  }
}

TEST(ClipLoader, SeekRestoresThePositionAfterReadAhead) {
  auto source = std::make_shared<FakeSource>(mixed_buckets());
  LoaderOptions o;
  o.workers = 2, o.prefetch = 4;
  ClipLoader a(source, BucketBatchSampler(mixed_buckets(), 3, 2, 5), o);
  for (int i = 0; i < 5; ++i) a.next();
  EXPECT_EQ(a.epoch(), 0);
  EXPECT_EQ(a.cursor(), 5);  // what was handed over, not what was loaded ahead
  const int64_t epoch = a.epoch(), cursor = a.cursor();
  std::vector<torch::Tensor> rest;
  for (int i = 0; i < 7; ++i) rest.push_back(a.next().video);
  ClipLoader b(source, BucketBatchSampler(mixed_buckets(), 3, 2, 5), o);
  b.next();
  b.seek(epoch, cursor);
  for (int i = 0; i < 7; ++i) EXPECT_TRUE(torch::equal(b.next().video, rest[static_cast<size_t>(i)])) << i;
}

TEST(ClipLoader, AFailingItemIsReplacedByTheSameStandInEveryTime) {
  auto broken = std::make_shared<FakeSource>(mixed_buckets(), std::set<int64_t>{2, 7});
  auto run = [&](int64_t workers) {
    LoaderOptions o;
    o.workers = workers, o.prefetch = 3, o.seed = 11;
    ClipLoader loader(broken, BucketBatchSampler(mixed_buckets(), 3, 2, 5), o);
    std::vector<torch::Tensor> videos;
    std::set<int64_t> failed;
    for (int i = 0; i < 12; ++i) {
      auto b = loader.next();
      for (const auto& f : b.failed) failed.insert(f.index);
      // Nothing of a broken item reaches the batch.
      for (int64_t bad : {2, 7})
        for (int64_t epoch = 0; epoch < 3; ++epoch)
          EXPECT_FALSE(b.video.eq(static_cast<uint8_t>(bad * 10 + epoch)).all(-1).all(-1).all(-1).any().item<bool>());
      videos.push_back(b.video);
    }
    EXPECT_EQ(failed, (std::set<int64_t>{2, 7}));
    return videos;
  };
  const auto a = run(0), b = run(3);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
  // A bucket where every item fails ends in a DatasetError naming the count.
  auto hopeless = std::make_shared<FakeSource>(std::vector<int64_t>{0, 0}, std::set<int64_t>{0, 1});
  LoaderOptions o;
  o.workers = 1, o.max_attempts = 4;
  ClipLoader loader(hopeless, BucketBatchSampler({0, 0}, 1, 2, 5), o);
  EXPECT_THROW(loader.next(), megaslide::DatasetError);
}

// A data-parallel rank loads only its slots of each planned batch: they are exactly those rows of the whole
// batch (stand-ins of failing items included), captions too, and only its items are loaded.
TEST(ClipLoader, ASliceOfSlotsIsThoseRowsOfTheWholeBatch) {
  const std::vector<int64_t> buckets{0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0};
  auto make = [&](int64_t begin, int64_t count, const std::shared_ptr<FakeSource>& source) {
    LoaderOptions o;
    o.workers = 2, o.prefetch = 2, o.seed = 7, o.slots_begin = begin, o.slots_count = count;
    return std::make_unique<ClipLoader>(source, BucketBatchSampler(buckets, 2, 4, 9), o);
  };
  auto whole_source = std::make_shared<FakeSource>(buckets, std::set<int64_t>{1, 8, 12});
  auto whole = make(0, -1, whole_source);
  std::vector<megaslide::LoadedBatch> reference;
  for (int i = 0; i < 10; ++i) reference.push_back(whole->next());
  for (auto [begin, count] : {std::pair<int64_t, int64_t>{0, 2}, {2, 2}, {1, 3}, {3, 1}}) {
    auto source = std::make_shared<FakeSource>(buckets, std::set<int64_t>{1, 8, 12});
    auto part = make(begin, count, source);
    for (size_t i = 0; i < reference.size(); ++i) {
      const auto b = part->next();
      EXPECT_TRUE(torch::equal(b.video, reference[i].video.narrow(0, begin, count)))
          << "batch " << i << " slots " << begin << "+" << count;
      EXPECT_EQ(b.captions, std::vector<std::string>(reference[i].captions.begin() + begin,
                                                     reference[i].captions.begin() + begin + count));
    }
    part.reset();  // workers joined: no load in flight
    EXPECT_LT(source->loads.load(), whole_source->loads.load()) << "slots " << begin << "+" << count;
  }
  auto source = std::make_shared<FakeSource>(buckets);
  EXPECT_THROW(make(3, 2, source)->next(), megaslide::DatasetError);  // past the batch of 4
}

TEST(ClipLoader, WorkersRunLibTorchOnOneThreadAndLeaveOthersAlone) {
  const int before = at::get_num_threads();
  int in_worker = -1;
  std::thread t([&] {
    megaslide::use_one_intra_op_thread();
    in_worker = at::get_num_threads();
  });
  t.join();
  EXPECT_EQ(in_worker, 1);
  EXPECT_EQ(at::get_num_threads(), before);
  int fresh = -1;
  std::thread u([&] { fresh = at::get_num_threads(); });
  u.join();
  EXPECT_EQ(fresh, before) << "a new thread no longer gets the process's setting";
}

TEST(ClipLoader, PinnedBatchesCopyToTheGpuUnchanged_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  auto source = std::make_shared<FakeSource>(mixed_buckets());
  LoaderOptions o;
  o.workers = 2, o.prefetch = 3, o.pin_memory = true;
  ClipLoader loader(source, BucketBatchSampler(mixed_buckets(), 3, 2, 5), o);
  for (int i = 0; i < 8; ++i) {
    auto b = loader.next();
    ASSERT_TRUE(b.video.is_pinned());
    auto on_gpu = b.video.to(torch::Device(torch::kCUDA, 0), /*non_blocking=*/true);
    auto expected = b.video.clone();
    b = {};  // the pinned buffer is released while the copy may still run: the allocator must keep it
    EXPECT_TRUE(torch::equal(on_gpu.cpu(), expected)) << "batch " << i;
  }
}
