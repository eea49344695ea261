// HostParamStore: the persistent training state of the CPU-master design (DESIGN.md §2, §6), held in
// host RAM block by block. For each block it allocates one flat buffer per component:
//   master      fp32  the master weights AdamW updates
//   exp_avg     fp32  AdamW's m (zero at construction)
//   exp_avg_sq  fp32  AdamW's v (zero at construction)
//   compute     bf16 or fp16: the copy the GPU streams in (H2D) and CpuAdamW rewrites each step
//   grad        bf16, fp16 or fp32: where the block's gradient lands (D2H) before CpuAdamW reads it
// Every parameter of the block is a view at the same offset into each buffer, in declaration order,
// packed without padding, so a block's flat tensors are the concatenation of its parameters.
// Buffers are page-locked (cudaHostAlloc) when CUDA is available at run time, so the copy engines can
// DMA them asynchronously; otherwise page-aligned (4096 B). All bytes start at zero.
//
// Memory: the store owns the buffers. Every tensor it hands out (flat or per-parameter) is a view that
// shares ownership of its block's buffer, so a view stays valid even after the store is destroyed;
// the memory is freed when the store and the last view are gone.
//
// Threading: construction and destruction are single-threaded. The accessors only read immutable
// layout and may be called from any thread; writes through the views are the caller's to order
// (the trainer: D2H into grad, then CpuAdamW, then H2D from compute).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace megaslide::offload {

struct ParamSpec {
  std::string name;            // unique within its block, e.g. "attn.qkv.weight"
  std::vector<int64_t> shape;  // every dim >= 0
};

struct BlockSpec {
  std::string name;  // e.g. "blocks.3"; used in messages and the report
  std::vector<ParamSpec> params;
};

struct HostParamStoreOptions {
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;  // BFloat16 or Half
  c10::ScalarType grad_dtype = c10::ScalarType::BFloat16;     // BFloat16, Half or Float
  // Page-lock the buffers when CUDA is available at run time. Turning it off keeps the memory
  // pageable (and the H2D/D2H copies synchronous).
  bool pin_if_cuda = true;
};

// Thrown when the store cannot get its memory. what() names the bytes asked for, the bytes the
// machine has, and what to change.
class HostMemoryError : public std::runtime_error {
 public:
  HostMemoryError(const std::string& message, int64_t requested_bytes, int64_t available_bytes)
      : std::runtime_error(message), requested_bytes_(requested_bytes), available_bytes_(available_bytes) {}
  int64_t requested_bytes() const { return requested_bytes_; }
  int64_t available_bytes() const { return available_bytes_; }  // -1 when unknown

 private:
  int64_t requested_bytes_;
  int64_t available_bytes_;
};

// Bytes by component, whole store (DESIGN.md §6: 14 B per parameter persistent with a bf16 copy,
// plus the transient gradient).
struct MemoryReport {
  int64_t num_blocks = 0;
  int64_t num_params = 0;  // parameter elements
  int64_t master_bytes = 0;
  int64_t exp_avg_bytes = 0;
  int64_t exp_avg_sq_bytes = 0;
  int64_t compute_bytes = 0;
  int64_t grad_bytes = 0;
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;
  c10::ScalarType grad_dtype = c10::ScalarType::BFloat16;
  bool pinned = false;

  int64_t persistent_bytes() const { return master_bytes + exp_avg_bytes + exp_avg_sq_bytes + compute_bytes; }
  int64_t total_bytes() const { return persistent_bytes() + grad_bytes; }
  // A table: one row per component with bytes, GiB and bytes per parameter, then the totals.
  std::string to_string() const;
};

class HostParamStore {
 public:
  // Allocates and zeroes every block's buffers. Throws HostMemoryError when the total exceeds the
  // memory the machine has available (checked before anything is allocated) or an allocation fails;
  // throws c10::Error for an invalid spec (negative dim, duplicate name, unsupported dtype).
  explicit HostParamStore(std::vector<BlockSpec> blocks, HostParamStoreOptions options = {});
  ~HostParamStore();
  HostParamStore(const HostParamStore&) = delete;
  HostParamStore& operator=(const HostParamStore&) = delete;

  // What a store of these blocks would take, without allocating (for planning tools). `pinned` is
  // what the constructor would do on this machine.
  static MemoryReport plan(const std::vector<BlockSpec>& blocks, const HostParamStoreOptions& options = {});

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  const BlockSpec& block_spec(int64_t block) const;
  int64_t block_numel(int64_t block) const;
  bool pinned() const { return pinned_; }
  const HostParamStoreOptions& options() const { return options_; }
  MemoryReport memory_report() const;

  // A block's flat 1-D buffers (block_numel elements each).
  at::Tensor master(int64_t block) const;
  at::Tensor exp_avg(int64_t block) const;
  at::Tensor exp_avg_sq(int64_t block) const;
  at::Tensor compute(int64_t block) const;
  at::Tensor grad(int64_t block) const;

  // One parameter's views, shaped as declared. Throws c10::Error naming the block and the parameter
  // when there is no such parameter.
  struct ParamViews {
    at::Tensor master, exp_avg, exp_avg_sq, compute, grad;
    int64_t offset = 0;  // elements from the start of the block's flat buffers
  };
  ParamViews param(int64_t block, const std::string& name) const;

  // Writes `value` (any dtype, the parameter's shape) into the parameter's master and, rounded to
  // nearest even, its compute copy: how a trainer loads initial or checkpointed weights.
  void set_param(int64_t block, const std::string& name, const at::Tensor& value);

 private:
  struct Block;
  std::vector<BlockSpec> specs_;
  std::vector<std::shared_ptr<Block>> blocks_;
  HostParamStoreOptions options_;
  bool pinned_ = false;
};

}  // namespace megaslide::offload
