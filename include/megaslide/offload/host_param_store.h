// HostParamStore: the persistent training state of the CPU-master design (DESIGN.md §2, §6), held in
// host RAM block by block. For each block it allocates one flat buffer per component:
//   master        fp32  the master weights AdamW updates
//   exp_avg       AdamW's m in the state dtype: fp32, bf16, or int8 codes (zero at construction)
//   exp_avg_sq    AdamW's v in the state dtype: fp32, bf16, or uint8 codes of sqrt(v) (zero)
//   *_scale       int8 state only: one fp32 scale per 256-element group of each parameter (zero)
//   compute       the transfer buffer, in the compute dtype (bf16, fp16 or fp32). Between steps it holds
//                 the block's compute copy, which the GPU streams in (H2D; with fp32 compute the master
//                 itself is uploaded and this buffer holds only gradients). Without a separate gradient
//                 buffer it also receives the block's gradient (D2H) after the block's backward, which
//                 the update then reads before writing the new copy over it.
//   grad          fp32, only with separate_grad (gradient accumulation): the sum of the micro-batches'
//                 gradients
//   ema           fp32, only with `ema` (train.ema_decay): the exponential moving average of the master,
//                 which the trainer updates after each block's AdamW update (sharded like the master)
// Every parameter of the block is a view at the same offset into each buffer, in declaration order,
// packed without padding, so a block's flat tensors are the concatenation of its parameters. int8
// scales are per parameter: groups of 256 elements start at each parameter's first element (the last
// group of a parameter may be shorter); ParamViews::group_offset says where its scales start.
//
// Sharding (data parallelism over R ranks, shard_count = R): every rank streams every block, so each
// keeps the whole transfer buffer (and accumulation buffer), but only its shard of the master and the
// moments: elements [shard.begin, shard.end) of each block's flat buffers (shard_range). master(),
// exp_avg() and exp_avg_sq() are then shard-long; the per-parameter views of them are undefined (a
// parameter may straddle two shards). The transfer buffer always exists and always holds the whole
// compute copy, with fp32 compute too (no rank has the whole master to upload). int8 moments are not
// sharded (their groups start at each parameter's first element).
//
// Pinning: only what crosses PCIe is page-locked (cudaHostAlloc), when CUDA is available at run time:
// the transfer buffer, and the master with fp32 compute (then it is uploaded). Masters, moments,
// scales and the accumulation buffer are ordinary page-aligned (4096 B) memory, first touched — zeroed
// — through HostParamStoreOptions::first_touch, which the trainer points at the optimizer threads that
// will update them (on a NUMA machine the pages then sit on those threads' nodes). All bytes start at
// zero.
//
// Memory: the store owns the buffers. Every tensor it hands out (flat or per-parameter) is a view that
// shares ownership of its block's buffer, so a view stays valid even after the store is destroyed;
// the memory is freed when the store and the last view are gone.
//
// The NVMe tier (state_tier kNvme; docs/offload.md): master, moments, their scales and the EMA live in a scratch
// file in nvme_dir (NvmeFile), one 4 KiB-aligned region per block; host RAM keeps the transfer (and
// accumulation) buffers and nvme_blocks_in_flight buffers of the largest region (at most one a block). A block's state
// is in memory only while acquired (acquire_state: a lease that reads it first, if needed, and writes it back when the
// last write lease ends); master(l), exp_avg(l), ..., ema(l) and the ParamViews of them exist only then (the flat
// accessors throw, the views are undefined otherwise). prefetch_state starts the read ahead of the acquires, in the
// order they will come. The transfer buffer always holds the compute copy (fp32 too: the master is not where the GPU
// reads). set_param and copy_master_to_compute acquire the block themselves. The RAM tier's leases do nothing.
//
// Threading: construction and destruction are single-threaded (first_touch may fan out). The
// accessors only read immutable layout and may be called from any thread; writes through the views are
// the caller's to order (the trainer: D2H into the transfer buffer, then CpuAdamW, then H2D from it).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "megaslide/offload/cpu_adamw.h"
#include "megaslide/offload/nvme_file.h"
#include "megaslide/offload/step_trace.h"

namespace megaslide::offload {

namespace detail {
class StatePager;
}

// Where the blocks' masters and moments live (offload.state_tier): host RAM, or a file on an NVMe disk.
enum class StateTier { kRam, kNvme };
StateTier parse_state_tier(const std::string& name);  // "ram" | "nvme"
const char* to_string(StateTier tier);

struct ParamSpec {
  std::string name;            // unique within its block, e.g. "attn.qkv.weight"
  std::vector<int64_t> shape;  // every dim >= 0
};

struct BlockSpec {
  std::string name;  // e.g. "blocks.3"; used in messages and the report
  std::vector<ParamSpec> params;
};

struct HostParamStoreOptions {
  // The transfer buffer: BFloat16 or Half (the compute copy), or Float (fp32 compute: gradients only;
  // the master is uploaded).
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;
  StateDtype state_dtype = StateDtype::kFloat32;  // AdamW's m and v
  // A separate fp32 gradient buffer per block: gradient accumulation sums the micro-batches into it,
  // while the transfer buffer keeps the weights for the next micro-batch's upload. Without it the
  // gradient lands in the transfer buffer.
  bool separate_grad = false;
  // An fp32 EMA buffer beside the master (4 B per parameter, sharded like it).
  bool ema = false;
  // Frozen weights (LoRA's base): the transfer buffer alone, holding the weights in the compute dtype
  // (fp32 too); no master, moments, gradient or EMA (their views are undefined). Not sharded.
  bool frozen = false;
  // Frozen only: how the weights are kept — the compute dtype (Undefined, the default), or Float8_e4m3fn:
  // the matrices (2 or more dimensions) as fp8, 1 B per element, with one fp32 scale per tensor (scales()),
  // set_param quantizing each value (io/fp8.h): unscaled when the value is already fp8 (a published fp8
  // file's weights stay bit for bit), else with a per-tensor scale. Vectors (biases, norm weights) are kept
  // exact, in fp32 beside them (ParamViews::exact; their fp8 bytes are zero), as fp8 checkpoints keep them.
  // The trainer upcasts on the device (WeightStreamer's fp8 transfer).
  c10::ScalarType frozen_dtype = c10::ScalarType::Undefined;
  // Page-lock the transfer buffer (and an uploaded fp32 master) when CUDA is available at run time.
  // Turning it off keeps the memory pageable (and the H2D/D2H copies synchronous).
  bool pin_if_cuda = true;
  // This rank's shard of every block (see Sharding above): rank shard_rank of shard_count.
  int64_t shard_rank = 0, shard_count = 1;
  // The NVMe tier (above): the state file's folder, the blocks' state in host memory at once (>= 1; the
  // trainer needs 2 to overlap I/O with its updates), and the file's I/O settings. Not for a frozen store.
  StateTier state_tier = StateTier::kRam;
  std::string nvme_dir;
  int64_t nvme_blocks_in_flight = 2;
  NvmeFileOptions nvme;
  // Zeroes a block's buffers, each byte first touched here: called once per block with the block's
  // element count and `zero(begin, end)`, which zeroes elements [begin, end) of every buffer (and the
  // scales of the groups that start in that range). It may call `zero` from several threads over
  // disjoint ranges that together cover [0, numel). Empty: the constructing thread zeroes everything.
  std::function<void(int64_t numel, const std::function<void(int64_t begin, int64_t end)>& zero)> first_touch;
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

// Rank `rank`'s shard of a block of `numel` elements split over `count` ranks: contiguous shards of
// ceil(numel / count) elements (the last ones shorter or empty).
struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
ShardRange shard_range(int64_t numel, int64_t rank, int64_t count);
// ceil(numel / count): the padded length every rank's shard has in a collective.
inline int64_t shard_stride(int64_t numel, int64_t count) { return (numel + count - 1) / count; }

// Bytes by component, whole store (docs/offload.md has the budget per parameter): 14 B per parameter
// with fp32 moments and a bf16 copy, 10 with bf16 moments, 8 + 1/32 with int8 moments; gradient
// accumulation adds a 4 B fp32 gradient.
struct MemoryReport {
  int64_t num_blocks = 0;
  int64_t num_params = 0;  // parameter elements
  int64_t master_bytes = 0;
  int64_t exp_avg_bytes = 0;
  int64_t exp_avg_sq_bytes = 0;
  int64_t scale_bytes = 0;    // int8 state: both moments' group scales; fp8 frozen weights: their scales
  int64_t exact_bytes = 0;    // fp8 frozen weights: the vectors kept in fp32 (ParamViews::exact)
  int64_t compute_bytes = 0;  // the transfer buffer (compute copy; the gradient at accumulation 1)
  int64_t grad_bytes = 0;     // separate fp32 gradient buffers (accumulation), else 0
  int64_t ema_bytes = 0;      // the fp32 EMA of the master (HostParamStoreOptions::ema), else 0
  int64_t pinned_bytes = 0;   // of the above, page-locked (0 where CUDA is not available)
  // Of the above, what is page-locked where CUDA is available (the transfer buffer; the master too
  // with fp32 compute), whether or not this machine has CUDA.
  int64_t pinnable_bytes = 0;
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;
  StateDtype state_dtype = StateDtype::kFloat32;
  bool separate_grad = false;
  bool pinned = false;      // whether page-locking is in effect
  int64_t shard_count = 1;  // > 1: master and moments are this rank's shard only
  bool frozen = false;      // HostParamStoreOptions::frozen: compute_bytes are the frozen weights
  bool fp8 = false;         // ... kept as fp8 (HostParamStoreOptions::frozen_dtype), scale_bytes their scales
  // The NVMe tier: master, moments, scales and EMA (the bytes above) are on disk, in a file of nvme_bytes
  // (4 KiB-aligned regions); host RAM holds nvme_buffer_bytes of them (the blocks in flight) instead.
  StateTier state_tier = StateTier::kRam;
  int64_t nvme_bytes = 0;
  int64_t nvme_buffer_bytes = 0;
  int64_t largest_region_bytes = 0;  // one block's state on disk, 4 KiB-aligned (the NVMe tier's unit of I/O)

  // The state's bytes, wherever they live (master, moments, scales, EMA).
  int64_t state_bytes() const { return master_bytes + exp_avg_bytes + exp_avg_sq_bytes + scale_bytes + ema_bytes; }
  // Host memory: the state (RAM tier) or its in-flight buffers (NVMe tier), plus the buffers beside it.
  int64_t total_bytes() const {
    return (state_tier == StateTier::kNvme ? nvme_buffer_bytes : state_bytes()) + compute_bytes + grad_bytes +
           exact_bytes;
  }
  // A table: one row per component with bytes, GiB and bytes per parameter, then the total.
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

  // What a store of these blocks would take, without allocating (for planning tools). `pinned` and
  // pinned_bytes are what the constructor would do on this machine.
  static MemoryReport plan(const std::vector<BlockSpec>& blocks, const HostParamStoreOptions& options = {});

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  const BlockSpec& block_spec(int64_t block) const;
  int64_t block_numel(int64_t block) const;
  // This rank's elements of block l's flat buffers ([0, block_numel) unless sharded).
  ShardRange shard(int64_t block) const;
  bool sharded() const { return options_.shard_count > 1; }
  bool pinned() const { return pinned_; }
  const HostParamStoreOptions& options() const { return options_; }
  MemoryReport memory_report() const;

  // A block's flat 1-D buffers (block_numel elements each, master and moments shard(block).size() when
  // sharded; the scales: state_groups of each parameter, concatenated).
  at::Tensor master(int64_t block) const;
  at::Tensor exp_avg(int64_t block) const;
  at::Tensor exp_avg_sq(int64_t block) const;
  at::Tensor exp_avg_scale(int64_t block) const;     // int8 state; undefined otherwise
  at::Tensor exp_avg_sq_scale(int64_t block) const;  // int8 state; undefined otherwise
  at::Tensor ema(int64_t block) const;               // the master's EMA (options.ema); undefined otherwise
  // fp8 frozen weights: one fp32 scale per parameter of the block, in declaration order (weight i =
  // compute's parameter i × scales[i]); undefined otherwise.
  at::Tensor scales(int64_t block) const;
  // The transfer buffer's dtype: the compute dtype, or frozen_dtype.
  c10::ScalarType transfer_dtype() const;
  // The transfer buffer: the compute copy (with fp32 compute: where gradients land). Undefined with
  // fp32 compute and a separate gradient buffer (nothing crosses PCIe through it then).
  at::Tensor compute(int64_t block) const;
  // Where the update reads the block's gradient: the separate fp32 buffer, or compute(block).
  at::Tensor grad(int64_t block) const;
  bool gradient_in_compute_buffer() const { return !options_.separate_grad; }

  // One parameter's views, shaped as declared (scales 1-D, undefined unless int8; master and moments
  // undefined when sharded). Throws c10::Error naming the block and the parameter when there is no
  // such parameter.
  struct ParamViews {
    at::Tensor master, exp_avg, exp_avg_sq, compute, grad;
    at::Tensor exp_avg_scale, exp_avg_sq_scale;
    int64_t offset = 0;        // elements from the start of the block's flat buffers
    int64_t group_offset = 0;  // int8 state: this parameter's first scale in the block's scale buffers
    at::Tensor ema;            // options.ema and not sharded; undefined otherwise
    at::Tensor exact;          // fp8 frozen weights: a vector's fp32 value (its compute bytes unused); else undefined
  };
  ParamViews param(int64_t block, const std::string& name) const;
  // Every parameter of a block, in declaration order.
  std::vector<ParamViews> params(int64_t block) const;

  // The NVMe tier's traffic (zero for the RAM tier): bytes and I/O-thread seconds, and the seconds callers
  // waited in acquire_state for a read (or a write-back) to finish.
  struct NvmeStats {
    int64_t read_bytes = 0, write_bytes = 0;
    double read_s = 0, write_s = 0, wait_s = 0;
  };
  // Holds block l's state in memory while alive (NVMe tier; the RAM tier's is empty). Movable.
  class StateLease {
   public:
    StateLease() = default;
    StateLease(StateLease&& other) noexcept : store_(other.store_), block_(other.block_) { other.store_ = nullptr; }
    StateLease& operator=(StateLease&& other) noexcept;
    ~StateLease();

   private:
    friend class HostParamStore;
    StateLease(const HostParamStore* store, int64_t block) : store_(store), block_(block) {}
    const HostParamStore* store_ = nullptr;
    int64_t block_ = -1;
  };
  bool paged() const { return pager_ != nullptr; }
  // NVMe tier: block l's state in memory until the lease ends (waiting for its read); `write`: written back
  // after the last write lease ends. Leases nest and may be taken from any thread; each holder should hold
  // at most one block at a time (blocks wait for free buffers). Throws NvmeError when the disk failed.
  StateLease acquire_state(int64_t block, bool write = true) const;
  // acquire_state(block, /*write=*/true) for a caller that writes every element of the block's state (master,
  // moments, their scales, EMA) before the lease ends: the NVMe tier does not read the old state first (the
  // buffer starts as zeros).
  StateLease acquire_state_to_overwrite(int64_t block) const;
  // NVMe tier: starts reading block l's state ahead of its acquire_state (call in the order of the acquires).
  void prefetch_state(int64_t block) const;
  // NVMe tier: waits until every write-back is on disk; rethrows an I/O failure.
  void flush_state() const;
  NvmeStats nvme_stats() const;
  // The NVMe tier's file (nullptr for the RAM tier).
  const NvmeFile* nvme_file() const;
  // Records the NVMe tier's reads and write-backs into `trace` (nullptr: stop).
  void set_trace(StepTrace* trace) const;
  // Whether the GPU uploads the fp32 master itself (fp32 compute, one rank, RAM tier): the transfer
  // buffer then holds gradients only.
  bool master_uploaded() const;

  // Writes `value` (any dtype, the parameter's shape) into the parameter's master (sharded: the part in
  // this rank's shard) and, rounded to nearest even, its compute copy (none with fp32 compute unless
  // sharded; frozen: the compute copy alone): how weights are loaded.
  void set_param(int64_t block, const std::string& name, const at::Tensor& value);
  // Rounds elements [begin, end) of block's compute copy from its master, with CpuAdamW's rounding (a
  // no-op with fp32 compute unless sharded, where it copies): the copy after a skipped update, or after
  // masters were written in place. Sharded: [begin, end) lies within shard(block) (block coordinates).
  void copy_master_to_compute(int64_t block, int64_t begin, int64_t end) const;

 private:
  struct Block;
  ParamViews views(int64_t block, size_t index) const;
  // A state component (0 master, 1 exp_avg, 2 exp_avg_sq, 3 and 4 their int8 scales, 5 EMA) of block l: the
  // RAM tier's buffer, or a view into the NVMe tier's in-flight buffer (undefined when not acquired).
  at::Tensor state_part(int64_t block, int part) const;
  at::Tensor held_part(int64_t block, int part, const char* who) const;  // state_part, throwing when undefined
  std::vector<BlockSpec> specs_;
  std::vector<std::shared_ptr<Block>> blocks_;
  HostParamStoreOptions options_;
  bool pinned_ = false;
  std::unique_ptr<detail::StatePager> pager_;
};

}  // namespace megaslide::offload
