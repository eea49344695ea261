#include "offload/tile_pool.h"

#include <immintrin.h>

#include <chrono>

namespace megaslide::offload::detail {
namespace {

// How long a worker (or the caller waiting for workers) spins before sleeping. A futex wake-up costs
// 5-50 us on a loaded 2-core machine; blocks arrive back to back during the backward, so a short spin
// catches the next one, and a long gap (the forward) ends in sleep.
constexpr auto kSpin = std::chrono::microseconds(50);

template <typename Done>
bool spin_until(Done done) {
  const auto start = std::chrono::steady_clock::now();
  while (!done()) {
    for (int k = 0; k < 64; ++k) _mm_pause();
    if (std::chrono::steady_clock::now() - start > kSpin) return done();
  }
  return true;
}

}  // namespace

TilePool::TilePool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  threads_.reserve(num_threads_ - 1);
  for (int w = 0; w + 1 < num_threads_; ++w) threads_.emplace_back([this, w] { worker_loop(w); });
}

TilePool::~TilePool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    stop_published_.store(true, std::memory_order_release);
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void TilePool::run(const std::function<void(int)>& fn) {
  std::lock_guard<std::mutex> serial(run_mutex_);
  if (num_threads_ == 1) {
    fn(0);
    return;
  }
  job_ = &fn;
  pending_.store(num_threads_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++generation_;
    generation_published_.store(generation_, std::memory_order_release);
  }
  wake_.notify_all();
  fn(num_threads_ - 1);
  if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }
  job_ = nullptr;
}

void TilePool::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    const bool woke = spin_until([&] {
      return generation_published_.load(std::memory_order_acquire) != seen ||
             stop_published_.load(std::memory_order_acquire);
    });
    if (!woke) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    }
    if (stop_published_.load(std::memory_order_acquire)) return;
    seen = generation_published_.load(std::memory_order_acquire);
    (*job_)(worker);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Taking the mutex orders this notify after the caller's predicate check: no lost wake-up.
      std::lock_guard<std::mutex> lock(mutex_);
      done_.notify_one();
    }
  }
}

}  // namespace megaslide::offload::detail
