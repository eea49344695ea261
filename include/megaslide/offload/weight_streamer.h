// WeightStreamer: moves one block's weights at a time from host RAM into one of two device slots, and
// each block's gradient back, on three streams ordered by events (DESIGN.md §2):
//
//   H2D stream:      host weights(l) ──▶ slot[l % 2].weights      (waits: the slot's previous block released)
//   compute stream:  waits weights ready ─ forward/backward of l ─▶ slot[l % 2].grads
//   D2H stream:      slot[l % 2].grads ──▶ host gradient(l)        (waits: the backward of l)
//
// Two consecutive blocks always sit in different slots, so block l±1 uploads while l computes. A block
// still in its slot and not invalidated (its host weights unchanged) is not copied again: the last two
// blocks of a forward are reused by the backward that follows, which is the "less what stays cached"
// of DESIGN.md §6.
//
// The streams sit behind one interface (src/offload/streams.h): CUDA streams and events on a GPU; on
// the CPU in async mode, emulated streams — a copy thread per copy stream, completion flags for events,
// destinations poisoned (NaN) until their copy lands, and `emulated_copy_delay_ms` to make every copy
// late — so that a reader that forgets to wait reads garbage in a CPU test, as it would on a GPU; in
// sync mode every copy runs in line and is waited for (on a GPU, on the compute stream): nothing
// overlaps (the ablation baseline). The byte accounting is the same in every mode.
//
// Memory: the streamer owns the two slots (weights and gradients, each as large as the largest
// block, in the compute dtype) and nothing else; host tensors passed in must stay alive until the
// copy is known complete (acquire() for H2D sources, GradCopy::wait() for D2H destinations). On a GPU
// host tensors should be page-locked (HostParamStore pins its buffers) or copies are synchronous.
//
// Threading: one thread (the trainer's) calls everything except GradCopy::wait, which any host
// thread may call (the optimizer thread waits there before reading a gradient).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "megaslide/offload/step_trace.h"

namespace megaslide::offload {

enum class StreamMode { kAsync, kSync };
StreamMode parse_stream_mode(const std::string& name);  // "async" | "sync"
const char* to_string(StreamMode mode);

struct WeightStreamerOptions {
  torch::Device device = torch::kCPU;
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;  // slot dtype: BFloat16, Half or Float
  StreamMode mode = StreamMode::kAsync;
  // CPU async mode only (a testing aid): every emulated copy starts this many milliseconds late.
  double emulated_copy_delay_ms = 0.0;
  // CPU async mode only (a testing aid): the emulated compute lane runs this many milliseconds behind the
  // host, as a GPU with kernels still queued does (src/offload/streams.h).
  double emulated_compute_lag_ms = 0.0;
  // Two gradient slots beside the weight slots; false (frozen blocks: LoRA's base) allocates none, and
  // gradient_buffer / offload_gradient are errors.
  bool gradients = true;
  // What the host weights are and what crosses PCIe: the compute dtype (Undefined, the default), or
  // Float8_e4m3fn (a frozen base stored as fp8, io/fp8.h): each slot then also has a transfer buffer of
  // that dtype, and acquire() turns its bytes into the compute dtype on the compute stream with the
  // upcast set by set_upcast.
  c10::ScalarType transfer_dtype = c10::ScalarType::Undefined;
};

// Writes block weights held as fp8 (`raw`, flat) into `weights` (flat, the compute dtype, on raw's device):
// parameter i, elements [offsets[i], offsets[i] + numels[i]), is dequantize_fp8 of its bytes with scale
// scales[i] (`scales`: fp32 on the same device, one per parameter), or, where exact[i] is defined (a vector
// kept exact, HostParamStoreOptions::frozen_dtype), exact[i]'s values (on the same device). Ops on the
// current stream.
void upcast_fp8_block(const at::Tensor& raw, const at::Tensor& weights, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& numels, const at::Tensor& scales,
                      const std::vector<at::Tensor>& exact = {});

// Cumulative counters (reset with reset_stats()).
struct StreamerStats {
  int64_t h2d_bytes = 0, d2h_bytes = 0;
  int64_t h2d_copies = 0, d2h_copies = 0, cache_hits = 0;
  // Time the compute stream waited on copies. GPU async: measured between CUDA events recorded on the
  // compute stream around each wait. Emulated (CPU async): the compute thread's waits. Sync: the
  // copies' own wall time.
  double exposed_transfer_s = 0.0;
};

// A gradient copy in flight; wait() returns once the host destination holds the gradient.
class GradCopy {
 public:
  GradCopy() = default;
  void wait() const;
  struct Impl;
  explicit GradCopy(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<Impl> impl_;
};

// An activation copy in flight (WeightStreamer::save_activation / restore_activation): an event on a copy
// stream that the other copy stream or the compute stream can be made to wait for.
class ActivationCopy {
 public:
  ActivationCopy() = default;
  struct Impl;
  explicit ActivationCopy(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const std::shared_ptr<Impl>& impl() const { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

class WeightStreamer {
 public:
  // block_numels[l]: elements of block l (> 0). Allocates both slots on the device.
  WeightStreamer(std::vector<int64_t> block_numels, WeightStreamerOptions options);
  ~WeightStreamer();
  WeightStreamer(const WeightStreamer&) = delete;
  WeightStreamer& operator=(const WeightStreamer&) = delete;

  int64_t num_blocks() const { return static_cast<int64_t>(numels_.size()); }
  int64_t block_numel(int64_t block) const { return numels_.at(static_cast<size_t>(block)); }
  const WeightStreamerOptions& options() const { return options_; }
  static int64_t slot_of(int64_t block) { return block % 2; }

  // Starts copying `host_weights` (flat, the block's numel, the transfer dtype) into block's slot, unless
  // the slot already holds this block's current weights. The slot must not hold an acquired block.
  void prefetch(int64_t block, const at::Tensor& host_weights);
  // Makes the compute stream wait for block's weights (prefetch first) and returns them: a flat
  // device tensor of the block's numel in the compute dtype, valid until release(block). With an fp8
  // transfer dtype a newly uploaded block is upcast first (set_upcast), once per upload.
  at::Tensor acquire(int64_t block);
  // The fp8 transfer's upcast of block `block`: from its uploaded bytes (`raw`) into the slot's weights.
  using Upcast = std::function<void(int64_t block, const at::Tensor& raw, const at::Tensor& weights)>;
  void set_upcast(Upcast upcast) { upcast_ = std::move(upcast); }
  // The slot's flat gradient buffer for `block`, zeroed on the compute stream after the previous
  // gradient copy out of this slot has finished. Valid until release(block).
  at::Tensor gradient_buffer(int64_t block);
  // After the compute stream has written block's gradient: copies it into `host_grad` (flat, numel,
  // compute dtype) on the D2H stream. The returned handle's wait() says when host_grad holds it.
  GradCopy offload_gradient(int64_t block, const at::Tensor& host_grad);
  // The compute stream is done with block's slot; its weights stay cached until overwritten.
  void release(int64_t block);
  // The block's host weights changed (an optimizer update): a cached device copy is stale.
  void invalidate(int64_t block);

  // Activations through the copy streams (the trainer's block-boundary checkpoints on the host,
  // StackTrainerOptions::host_activations). Counted in stats() as H2D and D2H copies.
  //   save_activation: `host` (contiguous, page-locked on a GPU) receives `device` on the D2H stream once
  //   the compute work queued so far has run; `device` may be dropped at once (its memory is not reused
  //   before the copy has read it). `host` must stay alive and unread until the returned copy completes.
  ActivationCopy save_activation(const at::Tensor& host, const at::Tensor& device, const std::string& span);
  //   restore_activation: a new device tensor like `host` that receives it on the H2D stream after `saved`
  //   (the save that filled `host`) and the compute work queued so far; `*ready` is set to the copy.
  at::Tensor restore_activation(const at::Tensor& host, const ActivationCopy& saved, ActivationCopy* ready,
                                const std::string& span);
  //   wait_activation: the compute stream's later work waits for `ready` (its stall is exposed transfer time).
  void wait_activation(const ActivationCopy& ready);

  // Accounting: the most blocks whose weights were on the device at once, the slots' bytes.
  int64_t max_resident_blocks() const { return max_resident_; }
  int64_t device_weight_bytes() const;    // both weight slots
  int64_t device_gradient_bytes() const;  // both gradient slots
  const StreamerStats& stats() const { return stats_; }
  void reset_stats();
  // Waits for every copy on every stream (end of a step) and adds the compute stream's stalls to stats().
  void synchronize();

  // Tracing (optional; nullptr stops it). Spans on the compute lane are opened by the trainer with
  // begin/end; copies add their own spans. resolve_trace() waits for the streams and (on a GPU)
  // converts stream times onto the trace's clock.
  void set_trace(StepTrace* trace);
  int begin_span(TraceLane lane, const std::string& name);
  void end_span(int span);
  void resolve_trace();

  struct Impl;

 private:
  void account_resident();
  c10::ScalarType transfer_dtype() const;
  Upcast upcast_;
  std::vector<int64_t> numels_;
  WeightStreamerOptions options_;
  StreamerStats stats_;
  int64_t max_resident_ = 0;
  std::unique_ptr<Impl> impl_;
};

// Forward-only streaming of blocks first, first+1, ..., end-1 in order (sampling and encoding: the DiT
// family's and Wan's streamed denoisers, umT5's streamed layers). Construction prefetches block `first`;
// run(l, body) acquires block l's device weights, calls body(weights) (valid during the call), releases
// the block however body ends, and prefetches block l+1 (below `end`), whose upload then overlaps block
// l's compute. `host(l)` gives block l's flat host weights in the streamer's transfer dtype.
//
// A lent streamer (`lent`: another owner's, such as a streamed trainer's between its steps, whose slots a
// validation denoiser runs in instead of allocating two more): a slot keeps a block by its index alone, so
// the pass invalidates the window's blocks when it starts and when it ends, and neither the owner nor the
// pass takes the other's upload for its own. The owner must have no block acquired meanwhile.
class StreamedForward {
 public:
  StreamedForward(WeightStreamer& streamer, std::function<at::Tensor(int64_t)> host, int64_t first = 0,
                  int64_t end = -1, bool lent = false);
  ~StreamedForward();
  StreamedForward(const StreamedForward&) = delete;
  StreamedForward& operator=(const StreamedForward&) = delete;

  template <typename Body>
  auto run(int64_t block, Body&& body) -> decltype(body(std::declval<const at::Tensor&>())) {
    const at::Tensor weights = streamer_.acquire(block);
    using Result = decltype(body(weights));
    auto guarded = [&]() -> Result {
      try {
        return body(weights);
      } catch (...) {
        abandon(block);
        throw;
      }
    };
    if constexpr (std::is_void_v<Result>) {
      guarded();
      next(block);
    } else {
      Result out = guarded();
      next(block);
      return out;
    }
  }

 private:
  void next(int64_t block);              // releases `block`, prefetches the one after it
  void abandon(int64_t block) noexcept;  // releases `block` while an error leaves body
  void invalidate_window() noexcept;
  WeightStreamer& streamer_;
  std::function<at::Tensor(int64_t)> host_;
  int64_t first_, end_;
  bool lent_;
};

// A block module's parameters bound to views of its flat device weights while the block runs:
// parameter i is weights[offset, offset + numel) viewed as shape.
struct FlatParam {
  at::Tensor param;
  int64_t offset = 0, numel = 0;
  std::vector<int64_t> shape;
};

// Binds `params` to views of `weights` for the scope; empties them again (zero elements, `empty`'s
// dtype and device) when the scope ends, however it ends, so no module holds the slot.
class BoundParams {
 public:
  BoundParams(std::vector<FlatParam>& params, const at::Tensor& weights, at::TensorOptions empty);
  ~BoundParams();
  BoundParams(const BoundParams&) = delete;
  BoundParams& operator=(const BoundParams&) = delete;

 private:
  std::vector<FlatParam>& params_;
  at::TensorOptions empty_;
};

}  // namespace megaslide::offload
