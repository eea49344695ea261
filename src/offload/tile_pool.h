// TilePool: the few persistent threads CpuAdamW runs its tiles on. Internal to libmegaslide.
//
// run(fn) calls fn(worker) once on each of num_threads workers (worker num_threads - 1 is the calling
// thread) and returns when every call has returned. Workers spin for a few tens of microseconds after
// a job, so a trainer that updates block after block does not pay a futex wake-up per block, then
// sleep on a condition variable, so an idle optimizer costs no CPU. Calls to run are serialised.
// fn must not throw.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace megaslide::offload::detail {

class TilePool {
 public:
  explicit TilePool(int num_threads);
  ~TilePool();
  TilePool(const TilePool&) = delete;
  TilePool& operator=(const TilePool&) = delete;

  int num_threads() const { return num_threads_; }
  void run(const std::function<void(int worker)>& fn);

 private:
  void worker_loop(int worker);

  const int num_threads_;
  std::vector<std::thread> threads_;
  std::mutex run_mutex_;  // one job at a time

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;  // guarded by mutex_; mirrored in generation_published_ for spinning
  bool stop_ = false;
  std::atomic<uint64_t> generation_published_{0};
  std::atomic<bool> stop_published_{false};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* job_ = nullptr;
};

}  // namespace megaslide::offload::detail
