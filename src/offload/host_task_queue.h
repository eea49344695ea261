// HostTaskQueue: one worker thread running host tasks (gradient accumulation, norms, CpuAdamW
// updates) in submission order, so that the tasks of one block stay ordered without locks. Inline
// mode runs each task on the submitting thread before submit() returns (offload.mode: sync).
// Internal to libmegaslide.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace megaslide::offload::detail {

class HostTaskQueue {
 public:
  explicit HostTaskQueue(bool inline_mode) : inline_(inline_mode) {
    if (!inline_) worker_ = std::thread([this] { run(); });
  }
  ~HostTaskQueue() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }
  HostTaskQueue(const HostTaskQueue&) = delete;
  HostTaskQueue& operator=(const HostTaskQueue&) = delete;

  // The future becomes ready when the task has run; it rethrows the task's exception.
  std::shared_future<void> submit(std::function<void()> task) {
    std::packaged_task<void()> packaged(std::move(task));
    std::shared_future<void> done = packaged.get_future().share();
    if (inline_) {
      packaged();
      return done;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(packaged));
    }
    cv_.notify_one();
    return done;
  }

  // Waits for every task submitted so far (rethrows the first failure among them).
  void drain() {
    submit([] {}).get();
  }

 private:
  void run() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  bool inline_;
  bool stop_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> tasks_;
  std::thread worker_;
};

}  // namespace megaslide::offload::detail
