// Streams: the one interface through which the WeightStreamer queues copies and orders them against the
// compute work, with three implementations chosen once at construction (make_streams):
//
//   CUDA         a GPU. The compute lane is LibTorch's current stream; in async mode H2D and D2H are two
//                pool streams, events are CUDA events. In sync mode every lane is the compute stream and
//                each copy is waited for on the host (nothing overlaps: the ablation baseline).
//   emulated     the CPU in async mode. The compute lane is the calling thread; H2D and D2H each get a
//                copy thread that runs its lane's queue in order; events are completion flags. A copy's
//                destination is filled with poison (NaN) when the copy is queued and receives the data
//                only when its lane reaches it, after an optional delay: a reader that did not wait for
//                the copy reads NaN, as on a GPU it would read whatever the memory held. This is how the
//                CPU tests catch a missing wait. Optionally the compute lane lags: its events complete a
//                fixed time after they are recorded, so a copy that is not ordered after earlier compute
//                work runs visibly early.
//   inline       the CPU in sync mode: every copy runs on the calling thread when queued; events are
//                complete when recorded.
//
// Semantics every implementation keeps (those of CUDA streams):
//   - work queued on one lane runs in queue order;
//   - record(lane) returns an event that completes once everything queued on the lane before it has run;
//   - wait(lane, e) makes work queued on the lane afterwards wait for e (on the compute lane the calling
//     thread's later ATen work; the time the compute lane stalls is the exposed transfer time);
//   - copy(lane, dst, src): dst's contents are undefined until an event recorded on the lane after the
//     copy completes; src must stay unchanged until then.
//
// Threading: one thread (the trainer's) calls everything except Event::synchronize, which any thread
// may call. Internal to libmegaslide.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>

#include "megaslide/offload/step_trace.h"
#include "megaslide/offload/weight_streamer.h"

namespace megaslide::offload::detail {

enum class Lane { kCompute = 0, kH2D = 1, kD2H = 2 };
TraceLane trace_lane(Lane lane);

class Event {
 public:
  virtual ~Event() = default;
  // Blocks the calling host thread until the event has completed.
  virtual void synchronize() = 0;
};
using EventPtr = std::shared_ptr<Event>;

class Streams {
 public:
  virtual ~Streams() = default;
  virtual EventPtr record(Lane lane) = 0;
  virtual void wait(Lane lane, const EventPtr& event) = 0;
  // dst and src: contiguous, same dtype and numel; one of them on the host, the other on the device
  // (or both on the host for the CPU). `span` names the copy in a trace.
  virtual void copy(Lane lane, const at::Tensor& dst, const at::Tensor& src, const std::string& span) = 0;
  // Waits until every lane has run everything queued so far, then resolves the timing figures below.
  virtual void synchronize() = 0;
  // Seconds the compute lane stalled on copies since the last call (resolved by synchronize()).
  virtual double take_exposed_transfer_s() = 0;
  // True when copies can overlap the compute lane (CUDA async, emulated).
  virtual bool overlapping() const = 0;

  // Tracing (optional; nullptr stops it). Copies add their own spans; the trainer opens and closes
  // spans on the compute lane. resolve_trace() (after synchronize) writes device-timed spans.
  virtual void set_trace(StepTrace* trace) = 0;
  virtual int begin_span(Lane lane, const std::string& name) = 0;
  virtual void end_span(int span) = 0;
  virtual void resolve_trace() = 0;
};

struct StreamsOptions {
  c10::Device device = c10::kCPU;
  StreamMode mode = StreamMode::kAsync;
  double emulated_copy_delay_ms = 0.0;  // emulated streams only: each copy starts this much later
  // Emulated streams only: an event recorded on the compute lane completes this much after it is
  // recorded, as when the GPU runs behind the host with kernels still queued (a testing aid: copy lanes
  // that wait for such an event start late; one that does not wait starts at once).
  double emulated_compute_lag_ms = 0.0;
};

// The implementation for the options (see above). A CUDA device needs a build with CUDA.
std::unique_ptr<Streams> make_streams(const StreamsOptions& options);

// A CUDA device without an index becomes the current device ("cuda" -> "cuda:0" by default); any other
// device is returned unchanged.
c10::Device canonical_device(c10::Device device);

namespace cuda {
// Defined in streams_cuda.cpp when CUDA is compiled in; make_streams calls them.
std::unique_ptr<Streams> make_cuda_streams(const StreamsOptions& options);
c10::Device canonical_cuda_device(c10::Device device);
}  // namespace cuda

}  // namespace megaslide::offload::detail
