#include "offload/streams.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace megaslide::offload::detail {

TraceLane trace_lane(Lane lane) {
  switch (lane) {
    case Lane::kCompute:
      return TraceLane::kCompute;
    case Lane::kH2D:
      return TraceLane::kH2D;
    case Lane::kD2H:
      return TraceLane::kD2H;
  }
  return TraceLane::kCompute;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A completion flag: the host twin of a CUDA event.
class FlagEvent final : public Event {
 public:
  explicit FlagEvent(bool done) : done_(done) {}
  void set() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
  }
  void synchronize() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return done_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_;
};

// One emulated copy lane: a thread that runs its queue in order.
class LaneThread {
 public:
  LaneThread() : worker_([this] { run(); }) {}
  ~LaneThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left to run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;  // last: starts once the members above exist
};

void check_copy(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.scalar_type() == src.scalar_type() &&
                  dst.numel() == src.numel(),
              "Streams::copy: expected contiguous tensors of one dtype and size, got ", dst.scalar_type(), "[",
              dst.numel(), "] <- ", src.scalar_type(), "[", src.numel(), "]");
}

// The CPU: inline (sync) or emulated (async) lanes. Plain memcpy, never an ATen op, on the copy threads:
// an ATen op there would start a second OpenMP team beside the compute thread's.
class HostStreams final : public Streams {
 public:
  explicit HostStreams(const StreamsOptions& options)
      : emulated_(options.mode == StreamMode::kAsync),
        delay_(options.emulated_copy_delay_ms),
        compute_lag_(options.emulated_compute_lag_ms) {
    TORCH_CHECK(delay_ >= 0.0, "emulated_copy_delay_ms must be >= 0, got ", delay_);
    TORCH_CHECK(compute_lag_ >= 0.0, "emulated_compute_lag_ms must be >= 0, got ", compute_lag_);
    if (emulated_) {
      lanes_[static_cast<int>(Lane::kH2D)] = std::make_unique<LaneThread>();
      lanes_[static_cast<int>(Lane::kD2H)] = std::make_unique<LaneThread>();
      if (compute_lag_ > 0.0) compute_clock_ = std::make_unique<LaneThread>();
    }
  }
  ~HostStreams() override {
    try {
      synchronize();
    } catch (...) {
    }
  }

  EventPtr record(Lane lane) override {
    if (lane == Lane::kCompute && compute_clock_) {  // the lagging compute lane: done `compute_lag_` from now
      auto event = std::make_shared<FlagEvent>(false);
      const auto due = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double, std::milli>(compute_lag_));
      compute_clock_->push([event, due] {
        std::this_thread::sleep_until(due);
        event->set();
      });
      return event;
    }
    LaneThread* thread = lanes_[static_cast<int>(lane)].get();
    if (thread == nullptr) return std::make_shared<FlagEvent>(true);  // the calling thread is the lane
    auto event = std::make_shared<FlagEvent>(false);
    thread->push([event] { event->set(); });
    return event;
  }

  void wait(Lane lane, const EventPtr& event) override {
    if (!event) return;
    LaneThread* thread = lanes_[static_cast<int>(lane)].get();
    if (thread != nullptr) {
      thread->push([event] { event->synchronize(); });
      return;
    }
    const auto start = Clock::now();
    event->synchronize();
    if (lane == Lane::kCompute) add_exposed(seconds_since(start));
  }

  void copy(Lane lane, const at::Tensor& dst, const at::Tensor& src, const std::string& span) override {
    check_copy(dst, src);
    void* to = dst.data_ptr();
    const void* from = src.data_ptr();
    const size_t bytes = src.nbytes();
    LaneThread* thread = lanes_[static_cast<int>(lane)].get();
    if (thread == nullptr) {  // in line: all of it is exposed
      const double t0 = trace_ ? trace_->now_s() : 0.0;
      const auto start = Clock::now();
      std::memcpy(to, from, bytes);
      add_exposed(seconds_since(start));
      if (trace_) trace_->add(trace_lane(lane), span, t0, trace_->now_s() - t0);
      return;
    }
    std::memset(to, 0xff, bytes);  // poison: all-ones is NaN in fp32, bf16 and fp16
    StepTrace* trace = trace_;
    const auto delay = std::chrono::duration<double, std::milli>(delay_);
    // The tensors travel with the task so that their storage outlives the copy.
    thread->push([dst, src, to, from, bytes, trace, lane, span, delay] {
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      const double t0 = trace ? trace->now_s() : 0.0;
      std::memcpy(to, from, bytes);
      if (trace) trace->add(trace_lane(lane), span, t0, trace->now_s() - t0);
    });
  }

  void synchronize() override {
    for (auto lane : {Lane::kH2D, Lane::kD2H})
      if (lanes_[static_cast<int>(lane)]) record(lane)->synchronize();
  }

  double take_exposed_transfer_s() override {
    std::lock_guard<std::mutex> lock(exposed_mutex_);
    const double s = exposed_s_;
    exposed_s_ = 0.0;
    return s;
  }
  bool overlapping() const override { return emulated_; }

  void set_trace(StepTrace* trace) override {
    synchronize();  // copies queued before belong to no trace
    trace_ = trace;
    spans_.clear();
  }
  int begin_span(Lane lane, const std::string& name) override {
    if (trace_ == nullptr) return -1;
    spans_.push_back({lane, name, trace_->now_s()});
    return static_cast<int>(spans_.size()) - 1;
  }
  void end_span(int span) override {
    if (trace_ == nullptr || span < 0) return;
    const auto& s = spans_[static_cast<size_t>(span)];
    trace_->add(trace_lane(s.lane), s.name, s.start_s, trace_->now_s() - s.start_s);
  }
  void resolve_trace() override {
    synchronize();
    spans_.clear();
  }

 private:
  void add_exposed(double s) {
    std::lock_guard<std::mutex> lock(exposed_mutex_);
    exposed_s_ += s;
  }
  struct Span {
    Lane lane;
    std::string name;
    double start_s;
  };
  bool emulated_;
  double delay_;
  double compute_lag_;
  std::unique_ptr<LaneThread> lanes_[3];       // by Lane; null: the calling thread runs the lane
  std::unique_ptr<LaneThread> compute_clock_;  // completes the lagging compute lane's events in order
  std::mutex exposed_mutex_;
  double exposed_s_ = 0.0;
  StepTrace* trace_ = nullptr;
  std::vector<Span> spans_;
};

}  // namespace

std::unique_ptr<Streams> make_streams(const StreamsOptions& options) {
  if (options.device.is_cuda()) return cuda::make_cuda_streams(options);
  TORCH_CHECK(options.device.is_cpu(), "Streams: unsupported device ", options.device, "; expected cpu or cuda");
  return std::make_unique<HostStreams>(options);
}

c10::Device canonical_device(c10::Device device) {
  return device.is_cuda() && !device.has_index() ? cuda::canonical_cuda_device(device) : device;
}

}  // namespace megaslide::offload::detail
