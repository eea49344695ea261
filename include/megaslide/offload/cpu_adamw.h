// CpuAdamW: the host optimizer of the CPU-master design (DESIGN.md §2). It runs AdamW over one block's
// fp32 master weights and moments in a single fused pass per element: read the 16- or 32-bit gradient
// (times a scale, for loss-scale unscaling and clipping), update master, m and v in place, and write
// the bf16/fp16 compute copy the GPU will stream next. The pass is bound by host memory bandwidth
// (28 bytes per parameter with a bf16 gradient and copy); docs/cpu-adamw.md has the measurements.
//
// Semantics: LibTorch's torch::optim::AdamW (decoupled weight decay, bias correction, eps added after
// sqrt(v) / sqrt(bias_correction2)), in the same order of fp32 operations, without amsgrad. The
// compute copy is rounded to nearest even exactly as c10::BFloat16 / c10::Half round (NaN kept).
//
// SIMD: AVX-512, AVX2 or scalar, chosen at run time by CPUID (one binary runs on every x86-64
// machine), or forced through the constructor. All paths and all thread counts give the same bits.
//
// Memory: CpuAdamW owns no parameter memory; it updates the arrays it is handed, in place. The caller
// keeps them alive for the duration of the call (HostParamStore is the usual owner).
//
// Threading: the constructor starts num_threads - 1 worker threads of its own (the calling thread is
// the last worker); they sleep between calls and never use LibTorch's intra-op pool, so size
// num_threads together with torch::set_num_threads for the cores you have. step_block may be called
// from any thread; concurrent calls on one CpuAdamW are serialised.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace megaslide::offload {

// LibTorch's AdamW defaults. The learning rate here is only the default of step_block's `lr`.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

enum class SimdPath { kAuto, kAvx512, kAvx2, kScalar };

// "auto", "avx512", "avx2" or "scalar".
const char* to_string(SimdPath path);

// How the compute copy is written. Streaming (non-temporal) stores go straight to memory and skip
// the read-for-ownership an ordinary store pays first (2 of the 28 B per parameter); they lose when
// the copy would have stayed in cache for its next reader. kAuto streams blocks of at least
// kStreamingMinElements elements (far larger than a core's caches), except when the gradient is read
// from the copy's own buffer (the trainer at accumulation 1): each line is then in cache already and a
// streaming store would only evict it.
enum class CopyStores { kAuto, kCached, kStreaming };
constexpr int64_t kStreamingMinElements = int64_t{1} << 20;

// How the AdamW moments m and v are stored (optimizer.state_dtype):
//   kFloat32  fp32, 8 B per parameter: LibTorch's AdamW, bit for bit in m and v.
//   kBFloat16 bf16, rounded to nearest even after each update: 4 B per parameter.
//   kInt8     block-wise quantised in groups of kStateQuantGroup elements with one fp32 scale per group
//             and moment: m as int8 codes (symmetric, absmax / 127), v as uint8 codes of sqrt(v)
//             (absmax / 255; a nonzero v never rounds to 0): 2 B per parameter plus 8 / 256.
// Each step computes the new m and v in fp32 from the stored ones and uses them unrounded for that
// step's update; only what is kept for the next step is narrowed (src/offload/adamw_kernels.h has the
// exact rules).
enum class StateDtype { kFloat32, kBFloat16, kInt8 };
constexpr int64_t kStateQuantGroup = 256;

// "fp32" | "bf16" | "int8".
StateDtype parse_state_dtype(const std::string& name);
const char* to_string(StateDtype dtype);
// Bytes per element of one moment (4, 2 or 1), scales excluded.
int64_t state_element_bytes(StateDtype dtype);
// Quantisation groups of `numel` elements (kInt8: one scale each per moment), ceil(numel / 256).
inline int64_t state_groups(int64_t numel) { return (numel + kStateQuantGroup - 1) / kStateQuantGroup; }

// One block's optimizer state as plain pointers, all `numel` elements long and not overlapping,
// except that `grad` may be `compute` itself (the same 16-bit dtype): each element's gradient is read
// before its copy is written.
struct AdamWBlockState {
  float* master = nullptr;     // fp32 master weights, updated in place
  void* exp_avg = nullptr;     // m, updated in place (starts at zero): float, bf16 or int8 (state_dtype)
  void* exp_avg_sq = nullptr;  // v, updated in place (starts at zero): float, bf16, or uint8 codes of sqrt(v)
  // kInt8 only: state_groups(numel) fp32 scales per moment (start at zero); group q covers elements
  // [256 q, 256 q + 256) of these arrays.
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  StateDtype state_dtype = StateDtype::kFloat32;
  const void* grad = nullptr;                                 // gradient, read only
  c10::ScalarType grad_dtype = c10::ScalarType::BFloat16;     // BFloat16, Half or Float
  void* compute = nullptr;                                    // compute copy written from the new master; may be null
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;  // BFloat16 or Half (ignored if null)
  int64_t numel = 0;
};

class CpuAdamW {
 public:
  // num_threads = 0 uses the cores available to the process (util/cpu_resources.h). kAuto picks the widest path CPUID
  // allows; forcing a path the CPU lacks throws.
  explicit CpuAdamW(AdamWOptions options = {}, int num_threads = 0, SimdPath path = SimdPath::kAuto);
  ~CpuAdamW();
  CpuAdamW(const CpuAdamW&) = delete;
  CpuAdamW& operator=(const CpuAdamW&) = delete;

  // The widest path this CPU supports (never kAuto).
  static SimdPath detect();
  // Whether this CPU can run `path` (kAuto and kScalar always can).
  static bool supported(SimdPath path);

  SimdPath path() const { return path_; }
  CopyStores copy_stores() const { return copy_stores_; }
  // Not thread-safe against a concurrent step_block.
  void set_copy_stores(CopyStores stores) { copy_stores_ = stores; }
  int num_threads() const;
  const AdamWOptions& options() const { return options_; }

  // One AdamW step over a block. `step` is the 1-based count of steps this state has taken,
  // including this one (bias correction uses it); `lr` is this step's learning rate, so schedules
  // work; the gradient is multiplied by `grad_scale` (1 / loss scale, times a clipping factor) before
  // use. Elements are tiled over the pool; returns when the whole block is updated.
  void step_block(const AdamWBlockState& state, int64_t step, double lr, float grad_scale = 1.f);

  // The same on tensors: master a contiguous fp32 CPU tensor, exp_avg and exp_avg_sq contiguous CPU
  // tensors of its numel, both fp32 or both bf16 (the state dtype; int8 state goes through the
  // pointer overload with its scales); grad contiguous bf16, fp16 or fp32 of that numel (any shape); compute an
  // undefined tensor or a contiguous bf16/fp16 one of that numel. Throws c10::Error naming the offending argument.
  void step_block(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                  const at::Tensor& grad, const at::Tensor& compute, int64_t step, double lr, float grad_scale = 1.f);

  // Runs fn(begin, end) over [0, numel) split exactly as step_block splits a block of numel elements
  // among its threads, each range on the thread that would update it (the calling thread included):
  // how HostParamStore's first touch puts a block's pages where its updates run. fn must not throw;
  // like step_block, calls are serialised.
  void for_each_range(int64_t numel, const std::function<void(int64_t begin, int64_t end)>& fn);

  // The memory roofline of step_block's access pattern, on the same arrays, pool, SIMD path and
  // copy stores:
  // reads and rewrites master, exp_avg and exp_avg_sq, reads the 16-bit gradient and writes the
  // 16-bit compute copy, with one add per array and none of AdamW's arithmetic
  // (x += grad * grad_scale: grad_scale = 0 leaves the data as it was; the copy gets master's top
  // 16 bits). Benchmarks time it next to step_block to see how close the optimizer is to the bound.
  void stream_probe(const AdamWBlockState& state, float grad_scale = 0.f);

 private:
  class Pool;
  AdamWOptions options_;
  SimdPath path_;
  CopyStores copy_stores_ = CopyStores::kAuto;
  std::unique_ptr<Pool> pool_;
};

}  // namespace megaslide::offload
