// ShardExchange: what a StreamedStackTrainer sharded over R data-parallel ranks needs from the ranks'
// communication (docs/distributed.md). MegaSlide's implementation is train/distributed.h's
// Communicator::shard_exchange (c10d process groups); a test may supply its own.
//
// Two channels, each driven by one thread, every rank making the same calls in the same order:
//   the host channel   reduce_scatter_sum / all_gather, from the trainer's host task thread (the block
//                      gradients and updated compute copies; they overlap the compute thread's work);
//   the step channel   all_reduce_sum, from the thread that drives the trainer (losses, the gradient
//                      norm, the resident parameters' gradients).
// A call returns when its result is complete; a failed call (a rank stopped, a timeout) throws.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace megaslide::offload {

class ShardExchange {
 public:
  virtual ~ShardExchange() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;

  // Host channel. `input`: R·s contiguous CPU elements (rank r's part is [r·s, r·s + s)); `output`:
  // s contiguous elements of the same dtype, which receive the sum over the ranks of their inputs'
  // part `rank()`.
  virtual void reduce_scatter_sum(const at::Tensor& input, const at::Tensor& output) = 0;
  // Host channel. `input`: s contiguous CPU elements; `output`: R·s, part r receiving rank r's input.
  virtual void all_gather(const at::Tensor& input, const at::Tensor& output) = 0;

  // Step channel. In place: each tensor becomes the element-wise sum over the ranks.
  virtual void all_reduce_sum(std::vector<at::Tensor>& tensors) = 0;
};

}  // namespace megaslide::offload
