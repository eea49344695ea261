#include "megaslide/offload/weight_streamer.h"

#include "megaslide/io/fp8.h"

#include "offload/streams.h"

namespace megaslide::offload {

using detail::EventPtr;
using detail::Lane;

StreamMode parse_stream_mode(const std::string& name) {
  if (name == "async") return StreamMode::kAsync;
  if (name == "sync") return StreamMode::kSync;
  TORCH_CHECK(false, "offload.mode: expected async or sync, got '", name, "'");
}

const char* to_string(StreamMode mode) { return mode == StreamMode::kAsync ? "async" : "sync"; }

struct GradCopy::Impl {
  EventPtr done;
};

void GradCopy::wait() const {
  if (impl_ && impl_->done) impl_->done->synchronize();
}

struct ActivationCopy::Impl {
  EventPtr done;
};

struct WeightStreamer::Impl {
  struct Slot {
    at::Tensor weights, grads;
    at::Tensor raw;           // fp8 transfer: where the upload lands
    bool upcast_due = false;  // fp8 transfer: raw holds a new upload not yet upcast into weights
    int64_t block = -1;       // whose weights the slot holds (or is receiving); -1: none
    bool valid = false;       // the held weights are the block's current host weights
    bool acquired = false;
    EventPtr weights_ready;  // H2D: the upload into the slot has landed
    EventPtr released;       // compute: done with the slot's weights
    EventPtr grad_copied;    // D2H: the slot's gradient has left for the host
  };
  Slot slots[2];
  std::unique_ptr<detail::Streams> streams;
};

WeightStreamer::WeightStreamer(std::vector<int64_t> block_numels, WeightStreamerOptions options)
    : numels_(std::move(block_numels)), options_(options), impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(!numels_.empty(), "WeightStreamer: expected at least one block");
  const auto dt = options_.compute_dtype;
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat,
              "WeightStreamer: compute dtype must be BFloat16, Half or Float, got ", dt);
  TORCH_CHECK(transfer_dtype() == dt || transfer_dtype() == at::kFloat8_e4m3fn,
              "WeightStreamer: the transfer dtype must be the compute dtype or Float8_e4m3fn, got ", transfer_dtype());
  TORCH_CHECK(transfer_dtype() == dt || !options_.gradients,
              "WeightStreamer: an fp8 transfer streams frozen weights only (gradients: false)");
  int64_t largest = 0;
  for (size_t l = 0; l < numels_.size(); ++l) {
    TORCH_CHECK(numels_[l] > 0, "WeightStreamer: block ", l, " has ", numels_[l], " elements; expected > 0");
    largest = std::max(largest, numels_[l]);
  }
  options_.device = detail::canonical_device(options_.device);
  impl_->streams = detail::make_streams(
      {options_.device, options_.mode, options_.emulated_copy_delay_ms, options_.emulated_compute_lag_ms});
  const auto opts = torch::TensorOptions().dtype(dt).device(options_.device);
  for (auto& s : impl_->slots) {
    s.weights = torch::empty({largest}, opts);
    if (options_.gradients) s.grads = torch::empty({largest}, opts);
    if (transfer_dtype() != dt) s.raw = torch::empty({largest}, opts.dtype(transfer_dtype()));
    // The slots' memory may be what the caching allocator just took back from tensors that kernels still
    // queued on the compute stream read or write (validation sampling, a streamed encoder before the
    // trainer): the first upload into a slot waits for that work, like every later one waits for release().
    s.released = impl_->streams->record(Lane::kCompute);
  }
}

WeightStreamer::~WeightStreamer() {
  try {
    synchronize();
  } catch (...) {
  }
}

int64_t WeightStreamer::device_weight_bytes() const {
  const auto& s = impl_->slots[0];
  return 2 * (static_cast<int64_t>(s.weights.nbytes()) + (s.raw.defined() ? static_cast<int64_t>(s.raw.nbytes()) : 0));
}

c10::ScalarType WeightStreamer::transfer_dtype() const {
  return options_.transfer_dtype == c10::ScalarType::Undefined ? options_.compute_dtype : options_.transfer_dtype;
}

void upcast_fp8_block(const at::Tensor& raw, const at::Tensor& weights, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& numels, const at::Tensor& scales,
                      const std::vector<at::Tensor>& exact) {
  TORCH_CHECK(offsets.size() == numels.size() && scales.numel() == static_cast<int64_t>(offsets.size()) &&
                  (exact.empty() || exact.size() == offsets.size()),
              "upcast_fp8_block: ", offsets.size(), " offsets, ", numels.size(), " sizes, ", scales.numel(),
              " scales and ", exact.size(), " exact values");
  for (size_t i = 0; i < offsets.size(); ++i) {
    const auto o = offsets[i], n = numels[i];
    if (!exact.empty() && exact[i].defined()) {
      weights.narrow(0, o, n).copy_(exact[i].reshape({-1}));
      continue;
    }
    weights.narrow(0, o, n).copy_(
        dequantize_fp8({raw.narrow(0, o, n), scales[static_cast<int64_t>(i)]}, weights.scalar_type()));
  }
}
int64_t WeightStreamer::device_gradient_bytes() const { return options_.gradients ? device_weight_bytes() : 0; }

void WeightStreamer::account_resident() {
  int64_t n = 0;
  for (const auto& s : impl_->slots) n += s.block >= 0 ? 1 : 0;
  max_resident_ = std::max(max_resident_, n);
}

void WeightStreamer::prefetch(int64_t block, const at::Tensor& host_weights) {
  TORCH_CHECK(block >= 0 && block < num_blocks(), "WeightStreamer::prefetch: block ", block, " out of range [0, ",
              num_blocks(), ")");
  const int64_t n = numels_[block];
  TORCH_CHECK(
      host_weights.numel() == n && host_weights.scalar_type() == transfer_dtype() && host_weights.is_contiguous(),
      "WeightStreamer::prefetch: block ", block, " expects a contiguous ", transfer_dtype(), " tensor of ", n,
      " elements, got ", host_weights.scalar_type(), " with ", host_weights.numel());
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
  stats_.h2d_bytes += n * static_cast<int64_t>(c10::elementSize(transfer_dtype()));
  ++stats_.h2d_copies;
  auto& streams = *impl_->streams;
  streams.wait(Lane::kH2D, slot.released);  // the compute stream is done with the slot's previous block
  slot.upcast_due = slot.raw.defined();
  try {
    streams.copy(Lane::kH2D, (slot.raw.defined() ? slot.raw : slot.weights).narrow(0, 0, n), host_weights,
                 "h2d block " + std::to_string(block));
    slot.weights_ready = streams.record(Lane::kH2D);
  } catch (...) {
    slot.valid = false;  // what the slot holds is not this block's weights
    throw;
  }
}

at::Tensor WeightStreamer::acquire(int64_t block) {
  TORCH_CHECK(block >= 0 && block < num_blocks(), "WeightStreamer::acquire: block ", block, " out of range");
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.valid, "WeightStreamer::acquire: block ", block,
              " is not in its slot (call prefetch(block) first)");
  impl_->streams->wait(Lane::kCompute, slot.weights_ready);
  slot.weights_ready.reset();
  const int64_t n = numels_[block];
  if (slot.upcast_due) {  // on the compute stream, which now waits for the upload
    TORCH_CHECK(upcast_, "WeightStreamer::acquire: block ", block, " arrived as ", transfer_dtype(),
                " and no upcast is set (set_upcast)");
    upcast_(block, slot.raw.narrow(0, 0, n), slot.weights.narrow(0, 0, n));  // a failed one is retried next time
    slot.upcast_due = false;
  }
  slot.acquired = true;  // only once nothing can fail: an error leaves the slot free for the next prefetch
  return slot.weights.narrow(0, 0, n);
}

at::Tensor WeightStreamer::gradient_buffer(int64_t block) {
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.acquired, "WeightStreamer::gradient_buffer: block ", block,
              " is not acquired");
  TORCH_CHECK(options_.gradients,
              "WeightStreamer::gradient_buffer: the streamer has no gradient slots (frozen blocks)");
  impl_->streams->wait(Lane::kCompute, slot.grad_copied);  // the previous gradient has left the slot
  slot.grad_copied.reset();
  auto g = slot.grads.narrow(0, 0, numels_[block]);
  g.zero_();
  return g;
}

GradCopy WeightStreamer::offload_gradient(int64_t block, const at::Tensor& host_grad) {
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.acquired, "WeightStreamer::offload_gradient: block ", block,
              " is not acquired");
  TORCH_CHECK(options_.gradients,
              "WeightStreamer::offload_gradient: the streamer has no gradient slots (frozen blocks)");
  const int64_t n = numels_[block];
  TORCH_CHECK(host_grad.numel() == n && host_grad.scalar_type() == options_.compute_dtype && host_grad.is_contiguous(),
              "WeightStreamer::offload_gradient: block ", block, " expects a contiguous ", options_.compute_dtype,
              " destination of ", n, " elements, got ", host_grad.scalar_type(), " with ", host_grad.numel());
  stats_.d2h_bytes += n * static_cast<int64_t>(c10::elementSize(options_.compute_dtype));
  ++stats_.d2h_copies;
  auto& streams = *impl_->streams;
  streams.wait(Lane::kD2H, streams.record(Lane::kCompute));  // the backward of `block` has written the slot
  streams.copy(Lane::kD2H, host_grad, slot.grads.narrow(0, 0, n), "d2h block " + std::to_string(block));
  auto impl = std::make_shared<GradCopy::Impl>();
  impl->done = slot.grad_copied = streams.record(Lane::kD2H);
  return GradCopy(impl);
}

ActivationCopy WeightStreamer::save_activation(const at::Tensor& host, const at::Tensor& device,
                                               const std::string& span) {
  TORCH_CHECK(
      host.is_contiguous() && device.is_contiguous() && host.numel() == device.numel() &&
          host.scalar_type() == device.scalar_type() && !host.is_cuda(),
      "WeightStreamer::save_activation: expected a contiguous host tensor of the device tensor's size and dtype");
  stats_.d2h_bytes += static_cast<int64_t>(device.nbytes());
  ++stats_.d2h_copies;
  auto& streams = *impl_->streams;
  streams.wait(Lane::kD2H, streams.record(Lane::kCompute));  // the compute stream has written `device`
  streams.copy(Lane::kD2H, host, device, span);
  auto impl = std::make_shared<ActivationCopy::Impl>();
  impl->done = streams.record(Lane::kD2H);
  return ActivationCopy(impl);
}

at::Tensor WeightStreamer::restore_activation(const at::Tensor& host, const ActivationCopy& saved,
                                              ActivationCopy* ready, const std::string& span) {
  TORCH_CHECK(ready != nullptr && host.is_contiguous(),
              "WeightStreamer::restore_activation: expected a contiguous host "
              "tensor and a destination for the copy's event");
  // Allocated on the compute stream: the memory may be a block that work already queued there still uses, so
  // the copy waits for that work as well as for the save that filled `host`.
  auto device = at::empty(host.sizes(), host.options().device(options_.device).pinned_memory(false));
  stats_.h2d_bytes += static_cast<int64_t>(host.nbytes());
  ++stats_.h2d_copies;
  auto& streams = *impl_->streams;
  if (saved.impl()) streams.wait(Lane::kH2D, saved.impl()->done);
  streams.wait(Lane::kH2D, streams.record(Lane::kCompute));
  streams.copy(Lane::kH2D, device, host, span);
  auto impl = std::make_shared<ActivationCopy::Impl>();
  impl->done = streams.record(Lane::kH2D);
  *ready = ActivationCopy(impl);
  return device;
}

void WeightStreamer::wait_activation(const ActivationCopy& ready) {
  if (ready.impl()) impl_->streams->wait(Lane::kCompute, ready.impl()->done);
}

void WeightStreamer::release(int64_t block) {
  auto& slot = impl_->slots[slot_of(block)];
  TORCH_CHECK(slot.block == block && slot.acquired, "WeightStreamer::release: block ", block, " is not acquired");
  slot.acquired = false;
  slot.released = impl_->streams->record(Lane::kCompute);
}

void WeightStreamer::invalidate(int64_t block) {
  auto& slot = impl_->slots[slot_of(block)];
  if (slot.block == block) slot.valid = false;
}

void WeightStreamer::reset_stats() {
  stats_ = StreamerStats{};
  impl_->streams->take_exposed_transfer_s();  // stalls already measured belong to the previous stats
}

void WeightStreamer::synchronize() {
  impl_->streams->synchronize();
  stats_.exposed_transfer_s += impl_->streams->take_exposed_transfer_s();
}

void WeightStreamer::set_trace(StepTrace* trace) { impl_->streams->set_trace(trace); }

int WeightStreamer::begin_span(TraceLane lane, const std::string& name) {
  switch (lane) {
    case TraceLane::kCompute:
      return impl_->streams->begin_span(Lane::kCompute, name);
    case TraceLane::kH2D:
      return impl_->streams->begin_span(Lane::kH2D, name);
    case TraceLane::kD2H:
      return impl_->streams->begin_span(Lane::kD2H, name);
    case TraceLane::kOptimizer:
    case TraceLane::kNvme:
      break;
  }
  TORCH_CHECK(false, "WeightStreamer::begin_span: the ", to_string(lane), " lane is a host thread, not a stream");
}

void WeightStreamer::end_span(int span) { impl_->streams->end_span(span); }

void WeightStreamer::resolve_trace() { impl_->streams->resolve_trace(); }

StreamedForward::StreamedForward(WeightStreamer& streamer, std::function<at::Tensor(int64_t)> host, int64_t first,
                                 int64_t end, bool lent)
    : streamer_(streamer),
      host_(std::move(host)),
      first_(first),
      end_(end < 0 ? streamer.num_blocks() : end),
      lent_(lent) {
  TORCH_CHECK(0 <= first_ && first_ <= end_ && end_ <= streamer_.num_blocks(), "StreamedForward: blocks [", first_,
              ", ", end_, ") do not lie in the streamer's ", streamer_.num_blocks());
  invalidate_window();
  if (first_ < end_) streamer_.prefetch(first_, host_(first_));
}

StreamedForward::~StreamedForward() { invalidate_window(); }

void StreamedForward::invalidate_window() noexcept {
  if (!lent_) return;
  for (int64_t l = first_; l < end_; ++l) streamer_.invalidate(l);  // a host-side flag: no stream work
}

void StreamedForward::next(int64_t block) {
  streamer_.release(block);
  if (block + 1 < end_) streamer_.prefetch(block + 1, host_(block + 1));
}

void StreamedForward::abandon(int64_t block) noexcept {
  try {
    streamer_.release(block);
  } catch (...) {  // the error leaving body is the one to report
  }
}

BoundParams::BoundParams(std::vector<FlatParam>& params, const at::Tensor& weights, at::TensorOptions empty)
    : params_(params), empty_(empty) {
  for (auto& p : params_) p.param.set_data(weights.narrow(0, p.offset, p.numel).view(p.shape));
}

BoundParams::~BoundParams() {
  for (auto& p : params_) p.param.set_data(at::empty({0}, empty_));
}

}  // namespace megaslide::offload
