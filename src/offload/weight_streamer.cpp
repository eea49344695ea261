#include "megaslide/offload/weight_streamer.h"

#include <chrono>
#include <optional>

#ifdef MEGASLIDE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace megaslide::offload {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

#ifdef MEGASLIDE_WITH_CUDA
using EventPtr = std::shared_ptr<at::cuda::CUDAEvent>;
EventPtr record_event(const c10::cuda::CUDAStream& stream, bool timing = false) {
  auto e = std::make_shared<at::cuda::CUDAEvent>(timing ? cudaEventDefault : cudaEventDisableTiming);
  e->record(stream);
  return e;
}
#endif

}  // namespace

StreamMode parse_stream_mode(const std::string& name) {
  if (name == "async") return StreamMode::kAsync;
  if (name == "sync") return StreamMode::kSync;
  TORCH_CHECK(false, "offload.mode: expected async or sync, got '", name, "'");
}

const char* to_string(StreamMode mode) { return mode == StreamMode::kAsync ? "async" : "sync"; }

struct GradCopy::Impl {
#ifdef MEGASLIDE_WITH_CUDA
  EventPtr done;
#endif
};

void GradCopy::wait() const {
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_ && impl_->done) impl_->done->synchronize();
#endif
}

struct WeightStreamer::Impl {
  struct Slot {
    at::Tensor weights, grads;
    int64_t block = -1;  // whose weights the slot holds (or is receiving); -1: none
    bool valid = false;  // the held weights are the block's current host weights
    bool acquired = false;
#ifdef MEGASLIDE_WITH_CUDA
    EventPtr weights_ready, released, grad_copied;
#endif
  };
  Slot slots[2];
  bool cuda = false;
  bool async_streams = false;  // a GPU in async mode: copies on their own streams
  StepTrace* trace = nullptr;

  struct Span {
    TraceLane lane = TraceLane::kCompute;
    std::string name;
    double host_start_s = 0.0;
#ifdef MEGASLIDE_WITH_CUDA
    EventPtr start, end;
#endif
  };
  std::vector<Span> spans;
#ifdef MEGASLIDE_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> h2d, d2h;
  std::vector<std::pair<EventPtr, EventPtr>> waits;  // compute-stream events around each weight wait
  EventPtr trace_origin;                             // on the compute stream, at set_trace
  double trace_origin_s = 0.0;

  c10::cuda::CUDAStream compute_stream(torch::Device d) const { return c10::cuda::getCurrentCUDAStream(d.index()); }
  c10::cuda::CUDAStream lane_stream(TraceLane lane, torch::Device d) const {
    if (async_streams && lane == TraceLane::kH2D) return *h2d;
    if (async_streams && lane == TraceLane::kD2H) return *d2h;
    return compute_stream(d);
  }
#endif
};

WeightStreamer::WeightStreamer(std::vector<int64_t> block_numels, WeightStreamerOptions options)
    : numels_(std::move(block_numels)), options_(options), impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(!numels_.empty(), "WeightStreamer: expected at least one block");
  const auto dt = options_.compute_dtype;
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat,
              "WeightStreamer: compute dtype must be BFloat16, Half or Float, got ", dt);
  int64_t largest = 0;
  for (size_t l = 0; l < numels_.size(); ++l) {
    TORCH_CHECK(numels_[l] > 0, "WeightStreamer: block ", l, " has ", numels_[l], " elements; expected > 0");
    largest = std::max(largest, numels_[l]);
  }
  impl_->cuda = options_.device.is_cuda();
#ifndef MEGASLIDE_WITH_CUDA
  TORCH_CHECK(!impl_->cuda, "WeightStreamer: device ", options_.device, " needs a build with CUDA (MEGASLIDE_WITH_CUDA)");
#else
  if (impl_->cuda) {
    const c10::cuda::CUDAGuard guard(options_.device);
    if (options_.mode == StreamMode::kAsync) {
      impl_->async_streams = true;
      impl_->h2d = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, options_.device.index());
      impl_->d2h = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, options_.device.index());
    }
  }
#endif
  const auto opts = torch::TensorOptions().dtype(dt).device(options_.device);
  for (auto& s : impl_->slots) {
    s.weights = torch::empty({largest}, opts);
    s.grads = torch::empty({largest}, opts);
  }
}

WeightStreamer::~WeightStreamer() {
  try {
    synchronize();
  } catch (...) {
  }
}

int64_t WeightStreamer::device_weight_bytes() const {
  return 2 * impl_->slots[0].weights.numel() * static_cast<int64_t>(c10::elementSize(options_.compute_dtype));
}
int64_t WeightStreamer::device_gradient_bytes() const { return device_weight_bytes(); }

void WeightStreamer::account_resident() {
  int64_t n = 0;
  for (const auto& s : impl_->slots) n += s.block >= 0 ? 1 : 0;
  max_resident_ = std::max(max_resident_, n);
}

void WeightStreamer::prefetch(int64_t block, const at::Tensor& host_weights) {
  TORCH_CHECK(block >= 0 && block < num_blocks(), "WeightStreamer::prefetch: block ", block, " out of range [0, ",
              num_blocks(), ")");
  const int64_t n = numels_[block];
  TORCH_CHECK(host_weights.numel() == n && host_weights.scalar_type() == options_.compute_dtype &&
                  host_weights.is_contiguous(),
              "WeightStreamer::prefetch: block ", block, " expects a contiguous ", options_.compute_dtype, " tensor of ",
              n, " elements, got ", host_weights.scalar_type(), " with ", host_weights.numel());
  auto& slot = impl_->slots[slot_of(block)];
  if (slot.block == block && slot.valid) {
    ++stats_.cache_hits;
    return;
  }
  TORCH_CHECK(!slot.acquired, "WeightStreamer::prefetch: block ", block, " needs slot ", slot_of(block),
              ", which still holds acquired block ", slot.block, "; release it first");
  slot.block = block;
  slot.valid = true;
  account_resident();
  stats_.h2d_bytes += n * static_cast<int64_t>(c10::elementSize(options_.compute_dtype));
  ++stats_.h2d_copies;
  auto dst = slot.weights.narrow(0, 0, n);
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->async_streams) {
    auto& h2d = *impl_->h2d;
    if (slot.released) slot.released->block(h2d);  // the compute stream is done with the previous block
    const int span = begin_span(TraceLane::kH2D, "h2d block " + std::to_string(block));
    {
      const c10::cuda::CUDAStreamGuard guard(h2d);
      dst.copy_(host_weights, /*non_blocking=*/true);
    }
    end_span(span);
    slot.weights_ready = record_event(h2d);
    return;
  }
#endif
  // CPU, or a GPU in sync mode: the copy runs in line and all of it is exposed.
  const int span = begin_span(TraceLane::kH2D, "h2d block " + std::to_string(block));
  const auto start = Clock::now();
  dst.copy_(host_weights);
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->cuda) impl_->compute_stream(options_.device).synchronize();
#endif
  stats_.exposed_transfer_s += seconds_since(start);
  end_span(span);
}

at::Tensor WeightStreamer::acquire(int64_t block) {
  TORCH_CHECK(block >= 0 && block < num_blocks(), "WeightStreamer::acquire: block ", block, " out of range");
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.valid, "WeightStreamer::acquire: block ", block,
              " is not in its slot (call prefetch(block) first)");
  slot.acquired = true;
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->async_streams && slot.weights_ready) {
    auto compute = impl_->compute_stream(options_.device);
    auto before = record_event(compute, /*timing=*/true);
    slot.weights_ready->block(compute);
    impl_->waits.emplace_back(before, record_event(compute, /*timing=*/true));
    slot.weights_ready.reset();
  }
#endif
  return slot.weights.narrow(0, 0, numels_[block]);
}

at::Tensor WeightStreamer::gradient_buffer(int64_t block) {
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.acquired, "WeightStreamer::gradient_buffer: block ", block,
              " is not acquired");
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->async_streams && slot.grad_copied) {
    slot.grad_copied->block(impl_->compute_stream(options_.device));
    slot.grad_copied.reset();
  }
#endif
  auto g = slot.grads.narrow(0, 0, numels_[block]);
  g.zero_();
  return g;
}

GradCopy WeightStreamer::offload_gradient(int64_t block, const at::Tensor& host_grad) {
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.acquired, "WeightStreamer::offload_gradient: block ", block,
              " is not acquired");
  const int64_t n = numels_[block];
  TORCH_CHECK(host_grad.numel() == n && host_grad.scalar_type() == options_.compute_dtype && host_grad.is_contiguous(),
              "WeightStreamer::offload_gradient: block ", block, " expects a contiguous ", options_.compute_dtype,
              " destination of ", n, " elements, got ", host_grad.scalar_type(), " with ", host_grad.numel());
  stats_.d2h_bytes += n * static_cast<int64_t>(c10::elementSize(options_.compute_dtype));
  ++stats_.d2h_copies;
  auto src = slot.grads.narrow(0, 0, n);
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->async_streams) {
    auto& d2h = *impl_->d2h;
    record_event(impl_->compute_stream(options_.device))->block(d2h);  // the backward of `block` is done
    const int span = begin_span(TraceLane::kD2H, "d2h block " + std::to_string(block));
    {
      const c10::cuda::CUDAStreamGuard guard(d2h);
      host_grad.copy_(src, /*non_blocking=*/true);
    }
    end_span(span);
    auto impl = std::make_shared<GradCopy::Impl>();
    impl->done = slot.grad_copied = record_event(d2h);
    return GradCopy(impl);
  }
#endif
  const int span = begin_span(TraceLane::kD2H, "d2h block " + std::to_string(block));
  const auto start = Clock::now();
  host_grad.copy_(src);  // on a GPU a blocking copy: it waits for the backward, then for the copy
  stats_.exposed_transfer_s += seconds_since(start);
  end_span(span);
  return GradCopy();
}

void WeightStreamer::release(int64_t block) {
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.acquired, "WeightStreamer::release: block ", block, " is not acquired");
  slot.acquired = false;
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->async_streams) slot.released = record_event(impl_->compute_stream(options_.device));
#endif
}

void WeightStreamer::invalidate(int64_t block) {
  auto& slot = impl_->slots[slot_of(block)];
  if (slot.block == block) slot.valid = false;
}

void WeightStreamer::reset_stats() { stats_ = StreamerStats{}; }

void WeightStreamer::synchronize() {
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->cuda) {
    if (impl_->h2d) impl_->h2d->synchronize();
    if (impl_->d2h) impl_->d2h->synchronize();
    impl_->compute_stream(options_.device).synchronize();
    for (auto& [before, after] : impl_->waits) stats_.exposed_transfer_s += before->elapsed_time(*after) / 1000.0;
    impl_->waits.clear();
  }
#endif
}

void WeightStreamer::set_trace(StepTrace* trace) {
  impl_->trace = trace;
  impl_->spans.clear();
#ifdef MEGASLIDE_WITH_CUDA
  if (trace != nullptr && impl_->cuda) {
    auto compute = impl_->compute_stream(options_.device);
    impl_->trace_origin = record_event(compute, /*timing=*/true);
    impl_->trace_origin->synchronize();
    impl_->trace_origin_s = trace->now_s();
  }
#endif
}

int WeightStreamer::begin_span(TraceLane lane, const std::string& name) {
  if (impl_->trace == nullptr) return -1;
  Impl::Span s;
  s.lane = lane;
  s.name = name;
  s.host_start_s = impl_->trace->now_s();
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->cuda) s.start = record_event(impl_->lane_stream(lane, options_.device), /*timing=*/true);
#endif
  impl_->spans.push_back(std::move(s));
  return static_cast<int>(impl_->spans.size()) - 1;
}

void WeightStreamer::end_span(int span) {
  if (impl_->trace == nullptr || span < 0) return;
  auto& s = impl_->spans[static_cast<size_t>(span)];
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->cuda) {
    s.end = record_event(impl_->lane_stream(s.lane, options_.device), /*timing=*/true);
    return;
  }
#endif
  const double now = impl_->trace->now_s();
  impl_->trace->add(s.lane, s.name, s.host_start_s, now - s.host_start_s);
}

void WeightStreamer::resolve_trace() {
#ifdef MEGASLIDE_WITH_CUDA
  if (impl_->trace != nullptr && impl_->cuda) {
    synchronize();
    for (auto& s : impl_->spans) {
      if (!s.start || !s.end) continue;
      const double start = impl_->trace_origin_s + impl_->trace_origin->elapsed_time(*s.start) / 1000.0;
      impl_->trace->add(s.lane, s.name, start, s.start->elapsed_time(*s.end) / 1000.0);
    }
  }
#endif
  impl_->spans.clear();
}

}  // namespace megaslide::offload
