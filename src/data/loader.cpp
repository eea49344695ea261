#include "megaslide/data/loader.h"

#include <fmt/format.h>

#include <chrono>
#include <exception>

extern "C" void omp_set_num_threads(int);  // libgomp, which LibTorch's CPU kernels run on

namespace megaslide {

namespace {

class DecodingSource final : public ClipSource {
 public:
  explicit DecodingSource(std::shared_ptr<const VideoDataset> dataset) : dataset_(std::move(dataset)) {}
  int64_t size() const override { return dataset_->size(); }
  int64_t num_buckets() const override { return static_cast<int64_t>(dataset_->buckets().size()); }
  int64_t bucket_of(int64_t item) const override { return dataset_->info(item).bucket; }
  const std::string& caption(int64_t item) const override { return dataset_->item(item).caption; }
  const std::string& path(int64_t item) const override { return dataset_->item(item).path; }
  ClipSample load(int64_t item, int64_t epoch) const override { return {dataset_->load(item, epoch), {}, {}, {}}; }

 private:
  std::shared_ptr<const VideoDataset> dataset_;
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::shared_ptr<ClipSource> decoding_source(std::shared_ptr<const VideoDataset> dataset) {
  return std::make_shared<DecodingSource>(std::move(dataset));
}

void use_one_intra_op_thread() {
  // LibTorch sets a thread's OpenMP team size from its global setting the first time the thread asks
  // (at::get_num_threads); after that, omp_set_num_threads changes this thread's setting only.
  (void)at::get_num_threads();
  omp_set_num_threads(1);
}

struct ClipLoader::Slot {
  PlannedBatch plan;
  LoadedBatch result;
  std::exception_ptr error;
  bool done = false;
};

ClipLoader::ClipLoader(std::shared_ptr<const ClipSource> source, BucketBatchSampler sampler, LoaderOptions options)
    : source_(std::move(source)), sampler_(std::move(sampler)), options_(options) {
  TORCH_CHECK(options_.workers >= 0 && options_.prefetch >= 1, "ClipLoader: workers must be >= 0 and prefetch >= 1");
  TORCH_CHECK(options_.slots_begin >= 0 && (options_.slots_count == -1 || options_.slots_count >= 1),
              "ClipLoader: slots_begin must be >= 0 and slots_count >= 1 (or -1: all)");
  epoch_ = sampler_.epoch(), cursor_ = sampler_.cursor();
  for (int64_t t = 0; t < options_.workers; ++t) threads_.emplace_back([this] { worker(); });
}

ClipLoader::~ClipLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    tasks_.clear();
  }
  work_ready_.notify_all();
  for (auto& t : threads_) t.join();
}

LoadedBatch ClipLoader::load(const PlannedBatch& plan) const {
  LoadedBatch out;
  out.plan = plan;
  std::vector<ClipSample> samples;
  const auto& candidates = sampler_.bucket_items(plan.bucket);
  const auto slots = static_cast<int64_t>(plan.items.size());
  const int64_t last = options_.slots_count < 0 ? slots : options_.slots_begin + options_.slots_count;
  if (options_.slots_begin >= slots || last > slots)
    throw DatasetError(fmt::format("batch {} of epoch {} has {} items; slots [{}, {}) were asked for", plan.index,
                                   plan.epoch, slots, options_.slots_begin, last));
  for (auto slot = static_cast<size_t>(options_.slots_begin); slot < static_cast<size_t>(last); ++slot) {
    int64_t item = plan.items[slot];
    for (int64_t attempt = 0;; ++attempt) {
      try {
        samples.push_back(source_->load(item, plan.epoch));
        out.captions.push_back(source_->caption(item));
        break;
      } catch (const std::exception& e) {
        out.failed.push_back({item, source_->path(item), e.what()});
        if (attempt + 1 >= options_.max_attempts)
          throw DatasetError(
              fmt::format("batch {} of epoch {}: {} items of bucket {} failed to load in a row; the last: {}",
                          plan.index, plan.epoch, options_.max_attempts, plan.bucket, e.what()));
        uint64_t h = splitmix64(options_.seed ^ 0x57A9D1Eull);
        for (uint64_t v : {static_cast<uint64_t>(plan.epoch), static_cast<uint64_t>(plan.index),
                           static_cast<uint64_t>(slot), static_cast<uint64_t>(attempt)})
          h = splitmix64(h ^ v);
        item = candidates[static_cast<size_t>(h % candidates.size())];
      }
    }
  }
  const auto& first = samples.front().video;
  std::vector<int64_t> shape{static_cast<int64_t>(samples.size())};
  for (auto s : first.sizes()) shape.push_back(s);
  out.video = torch::empty(shape, first.options().pinned_memory(options_.pin_memory));
  for (size_t i = 0; i < samples.size(); ++i) {
    TORCH_CHECK(samples[i].video.sizes() == first.sizes(),
                "ClipLoader: items of one bucket differ in shape: ", samples[i].video.sizes(), " and ", first.sizes());
    out.video[static_cast<int64_t>(i)].copy_(samples[i].video);
  }
  if (samples.front().text_ids.defined()) {
    std::vector<torch::Tensor> ids, masks;
    for (const auto& s : samples) ids.push_back(s.text_ids), masks.push_back(s.text_mask);
    out.text_ids = torch::stack(ids);
    out.text_mask = torch::stack(masks);
  }
  if (samples.front().text.defined()) {
    std::vector<torch::Tensor> text, masks;
    for (const auto& s : samples) {
      text.push_back(s.text);
      if (s.text_mask.defined()) masks.push_back(s.text_mask);
    }
    out.text = torch::stack(text);
    if (masks.size() == samples.size()) out.text_mask = torch::stack(masks);
  }
  return out;
}

void ClipLoader::worker() {
  use_one_intra_op_thread();
  while (true) {
    std::shared_ptr<Slot> slot;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (stopping_) return;
      slot = tasks_.front();
      tasks_.pop_front();
    }
    LoadedBatch result;
    std::exception_ptr error;
    try {
      result = load(slot->plan);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slot->result = std::move(result);
      slot->error = error;
      slot->done = true;
    }
    slot_done_.notify_all();
  }
}

void ClipLoader::top_up() {
  // Called with mutex_ held.
  while (static_cast<int64_t>(pending_.size()) < options_.prefetch) {
    auto slot = std::make_shared<Slot>();
    slot->plan = sampler_.next();
    pending_.push_back(slot);
    tasks_.push_back(slot);
  }
  work_ready_.notify_all();
}

LoadedBatch ClipLoader::next() {
  const auto start = std::chrono::steady_clock::now();
  LoadedBatch out;
  if (options_.workers == 0) {
    out = load(sampler_.next());
  } else {
    std::shared_ptr<Slot> slot;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      top_up();
      slot = pending_.front();
      slot_done_.wait(lock, [&] { return slot->done; });
      pending_.pop_front();
      top_up();  // the freed place starts loading now, before this batch is used
    }
    if (slot->error) std::rethrow_exception(slot->error);
    out = std::move(slot->result);
  }
  out.wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (++cursor_ == sampler_.batches_per_epoch()) ++epoch_, cursor_ = 0;
  return out;
}

void ClipLoader::drop_pending() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Batches a worker is loading now finish on their own (the worker holds their slot); nobody reads them.
  tasks_.clear();
  pending_.clear();
}

void ClipLoader::seek(int64_t epoch, int64_t cursor) {
  drop_pending();
  sampler_.seek(epoch, cursor);
  epoch_ = epoch, cursor_ = cursor;
}

}  // namespace megaslide
