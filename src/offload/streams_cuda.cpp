// The CUDA implementation of offload/streams.h: LibTorch's current stream is the compute lane, two pool
// streams carry the copies in async mode, CUDA events order them. Without CUDA compiled in, asking for a
// CUDA device is an error that says so.
#include "offload/streams.h"

#include <c10/util/Exception.h>

#ifdef MEGASLIDE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <optional>
#include <utility>
#include <vector>

namespace megaslide::offload::detail::cuda {
namespace {

struct CudaEvent final : Event {
  explicit CudaEvent(bool timing) : event(timing ? cudaEventDefault : cudaEventDisableTiming) {}
  void synchronize() override { event.synchronize(); }
  at::cuda::CUDAEvent event;
};

std::shared_ptr<CudaEvent> record_on(const c10::cuda::CUDAStream& stream, bool timing) {
  auto e = std::make_shared<CudaEvent>(timing);
  e->event.record(stream);
  return e;
}

class CudaStreams final : public Streams {
 public:
  explicit CudaStreams(const StreamsOptions& options) : device_(options.device) {
    TORCH_CHECK(device_.has_index(), "CudaStreams: expected a device with an index, got ", device_);
    const c10::cuda::CUDAGuard guard(device_);
    if (options.mode == StreamMode::kAsync) {
      h2d_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index());
      d2h_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index());
    }
  }
  ~CudaStreams() override {
    try {
      synchronize();
    } catch (...) {
    }
  }

  EventPtr record(Lane lane) override { return record_on(stream(lane), /*timing=*/false); }

  void wait(Lane lane, const EventPtr& event) override {
    if (!event) return;
    auto& e = static_cast<CudaEvent&>(*event).event;
    auto s = stream(lane);
    if (lane == Lane::kCompute && overlapping()) {
      // Timing events around the wait: the compute stream's stall on the copy (resolved in synchronize).
      auto before = record_on(s, /*timing=*/true);
      e.block(s);
      waits_.emplace_back(before, record_on(s, /*timing=*/true));
      return;
    }
    e.block(s);
  }

  void copy(Lane lane, const at::Tensor& dst, const at::Tensor& src, const std::string& span) override {
    TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.scalar_type() == src.scalar_type() &&
                    dst.numel() == src.numel(),
                "Streams::copy: expected contiguous tensors of one dtype and size");
    auto s = stream(lane);
    const int id = begin_span(lane, span);
    if (overlapping()) {
      // The device side's memory is not handed to another tensor before this stream has used it, even when
      // its tensor is freed on the compute stream first (an activation saved D2H and dropped at once).
      for (const at::Tensor* t : {&dst, &src})
        if (t->is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), s);
      const c10::cuda::CUDAStreamGuard guard(s);
      dst.copy_(src, /*non_blocking=*/true);
      end_span(id);
      return;
    }
    // Sync mode: the copy runs on the compute stream and the host waits for it; all of it is exposed.
    // The compute work queued before it (the previous block's forward or backward) is waited for first,
    // outside the timing: the copy's own time is what is exposed, not the kernels ahead of it.
    s.synchronize();
    const auto start = std::chrono::steady_clock::now();
    dst.copy_(src);
    s.synchronize();
    exposed_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    end_span(id);
  }

  void synchronize() override {
    if (h2d_) h2d_->synchronize();
    if (d2h_) d2h_->synchronize();
    compute().synchronize();
    for (auto& [before, after] : waits_) exposed_s_ += before->event.elapsed_time(after->event) / 1000.0;
    waits_.clear();
  }

  double take_exposed_transfer_s() override { return std::exchange(exposed_s_, 0.0); }
  bool overlapping() const override { return h2d_.has_value(); }

  void set_trace(StepTrace* trace) override {
    trace_ = trace;
    spans_.clear();
    if (trace_ != nullptr) {
      origin_ = record_on(compute(), /*timing=*/true);
      origin_->event.synchronize();
      origin_s_ = trace_->now_s();
    }
  }
  int begin_span(Lane lane, const std::string& name) override {
    if (trace_ == nullptr) return -1;
    spans_.push_back({lane, name, record_on(stream(lane), /*timing=*/true), nullptr});
    return static_cast<int>(spans_.size()) - 1;
  }
  void end_span(int span) override {
    if (trace_ == nullptr || span < 0) return;
    auto& s = spans_[static_cast<size_t>(span)];
    s.end = record_on(stream(s.lane), /*timing=*/true);
  }
  void resolve_trace() override {
    if (trace_ != nullptr) {
      synchronize();
      for (auto& s : spans_) {
        if (!s.start || !s.end) continue;
        const double start = origin_s_ + origin_->event.elapsed_time(s.start->event) / 1000.0;
        trace_->add(trace_lane(s.lane), s.name, start, s.start->event.elapsed_time(s.end->event) / 1000.0);
      }
    }
    spans_.clear();
  }

 private:
  c10::cuda::CUDAStream compute() const { return c10::cuda::getCurrentCUDAStream(device_.index()); }
  c10::cuda::CUDAStream stream(Lane lane) const {
    if (lane == Lane::kH2D && h2d_) return *h2d_;
    if (lane == Lane::kD2H && d2h_) return *d2h_;
    return compute();
  }
  struct Span {
    Lane lane;
    std::string name;
    std::shared_ptr<CudaEvent> start, end;
  };
  c10::Device device_;
  std::optional<c10::cuda::CUDAStream> h2d_, d2h_;
  std::vector<std::pair<std::shared_ptr<CudaEvent>, std::shared_ptr<CudaEvent>>> waits_;
  double exposed_s_ = 0.0;
  StepTrace* trace_ = nullptr;
  std::shared_ptr<CudaEvent> origin_;
  double origin_s_ = 0.0;
  std::vector<Span> spans_;
};

}  // namespace

std::unique_ptr<Streams> make_cuda_streams(const StreamsOptions& options) {
  return std::make_unique<CudaStreams>(options);
}

c10::Device canonical_cuda_device(c10::Device device) {
  return c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device());
}

}  // namespace megaslide::offload::detail::cuda

#else  // no CUDA compiled in

namespace megaslide::offload::detail::cuda {

std::unique_ptr<Streams> make_cuda_streams(const StreamsOptions& options) {
  TORCH_CHECK(false, "device ", options.device, " needs a build with CUDA (MEGASLIDE_WITH_CUDA); this one has none");
}

c10::Device canonical_cuda_device(c10::Device device) { return c10::Device(c10::DeviceType::CUDA, 0); }

}  // namespace megaslide::offload::detail::cuda

#endif
