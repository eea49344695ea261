#include "megaslide/offload/stack_trainer.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cmath>
#include <future>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>

#ifdef __GLIBC__
#include <dlfcn.h>
#include <malloc.h>
#endif

#include "megaslide/io/finite_weights.h"
#include "offload/host_task_queue.h"
#include "offload/streams.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define MEGASLIDE_HAVE_NVTX 1
#endif
#endif

namespace megaslide::offload {

#ifdef __GLIBC__
namespace {
// Whether malloc is glibc's own, not one interposed by a sanitizer or another allocator, whose heaps
// glibc's malloc_trim knows nothing of (under AddressSanitizer it crashed in glibc's mtrim).
bool malloc_is_glibcs() {
  static const bool glibc = [] {
    void* used = ::dlsym(RTLD_DEFAULT, "malloc");
    return used != nullptr && used == ::dlsym(RTLD_DEFAULT, "__libc_malloc");
  }();
  return glibc;
}
}  // namespace
#endif
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// An NVTX range on a GPU build (visible in Nsight Systems); nothing otherwise.
class NvtxRange {
 public:
  explicit NvtxRange(const std::string& name) {
#ifdef MEGASLIDE_HAVE_NVTX
    nvtxRangePushA(name.c_str());
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#ifdef MEGASLIDE_HAVE_NVTX
    nvtxRangePop();
#endif
  }
};

// Host loops for the task thread. They use plain std::threads, never LibTorch ops: an ATen op there
// would start a second OpenMP team next to the compute thread's, and the two teams' spin-waits
// (libgomp) were measured to slow a 2-core machine's steps down several times over.
template <typename Fn>
void parallel_chunks(int64_t n, int threads, Fn&& fn) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (chunks == 1) return fn(0, n, 0);
  std::vector<std::thread> pool;
  for (int64_t c = 1; c < chunks; ++c) pool.emplace_back([&, c] { fn(n * c / chunks, n * (c + 1) / chunks, c); });
  fn(0, n / chunks, 0);
  for (auto& t : pool) t.join();
}

float element(const at::Tensor& t, const void* data, int64_t i) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return static_cast<float>(static_cast<const c10::BFloat16*>(data)[i]);
    case at::kHalf:
      return static_cast<float>(static_cast<const c10::Half*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

void set_element(const at::Tensor& t, void* data, int64_t i, float v) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      static_cast<c10::BFloat16*>(data)[i] = c10::BFloat16(v);
      break;
    case at::kHalf:
      static_cast<c10::Half*>(data)[i] = c10::Half(v);
      break;
    default:
      static_cast<float*>(data)[i] = v;
  }
}

// Σ t[i]² over [begin, end) in double.
double sum_of_squares(const at::Tensor& t, int64_t begin, int64_t end) {
  const void* data = t.data_ptr();
  double sq = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    const double v = element(t, data, i);
    sq += v * v;
  }
  return sq;
}

// dst (fp32) = src or dst += src (src in the compute dtype); returns Σ dst² when `norm`. The sum runs per piece of
// kNormPiece elements, the pieces' sums added in order, whichever thread took a piece: the same bits for any
// offload.optimizer_threads (the thread count used to cut the sum, so the clip scale differed between machines).
constexpr int64_t kNormPiece = int64_t{1} << 20;
double accumulate(const at::Tensor& dst, const at::Tensor& src, bool overwrite, bool norm, int threads) {
  float* out = dst.data_ptr<float>();
  const void* in = src.data_ptr();
  const int64_t n = dst.numel(), pieces = std::max<int64_t>(1, (n + kNormPiece - 1) / kNormPiece);
  std::vector<double> partial(static_cast<size_t>(pieces), 0.0);
  parallel_chunks(pieces, threads, [&](int64_t first, int64_t last, int64_t) {
    for (int64_t p = first; p < last; ++p) {
      double sq = 0.0;
      for (int64_t i = p * kNormPiece, end = std::min(n, (p + 1) * kNormPiece); i < end; ++i) {
        const float v = overwrite ? element(src, in, i) : out[i] + element(src, in, i);
        out[i] = v;
        sq += static_cast<double>(v) * v;
      }
      partial[static_cast<size_t>(p)] = sq;
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return norm ? total : 0.0;
}

struct ParamSlot {
  torch::Tensor param;  // the block module's parameter (rebound to slot views)
  int64_t offset = 0, numel = 0;
  int64_t group_offset = 0;  // int8 state: the parameter's first scale in the block's scale buffers
  std::vector<int64_t> shape;
  // Set by a gradient hook on `param` when the backward reaches it; cleared at the start of each step.
  std::shared_ptr<std::atomic<bool>> received;
};

}  // namespace

c10::ScalarType parse_compute_dtype(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  if (name == "fp32") return at::kFloat;
  TORCH_CHECK(false, "offload.compute_dtype: expected bf16, fp16 or fp32, got '", name, "'");
}

double ema_decay_at(double decay, int64_t update) {
  if (update <= 1) return 0.0;
  const double n = static_cast<double>(update);
  return std::min(decay, n / (n + 9.0));
}

bool step_on_host(torch::optim::AdamW& optimizer, CpuAdamW& kernel) {
  const auto& k = kernel.options();
  bool fused = true;
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    fused = fused && !o.amsgrad() && std::get<0>(o.betas()) == k.beta1 && std::get<1>(o.betas()) == k.beta2 &&
            o.eps() == k.eps && o.weight_decay() == k.weight_decay;
    for (const auto& p : group.params()) {
      const auto& g = p.grad();
      if (!g.defined()) continue;
      fused = fused && p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous() && !g.is_sparse() &&
              g.device().is_cpu() && g.scalar_type() == at::kFloat && g.is_contiguous() && g.numel() == p.numel();
      const auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      for (const auto& m : {s.exp_avg(), s.exp_avg_sq()})
        fused = fused && m.is_contiguous() && m.scalar_type() == at::kFloat && m.device().is_cpu() &&
                m.numel() == p.numel();
    }
  }
  if (!fused) {
    optimizer.step();
    return false;
  }
  torch::NoGradGuard no_grad;
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    const double lr = static_cast<const torch::optim::AdamWOptions&>(group.options()).lr();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;  // LibTorch's step leaves it alone, its state too
      auto it = state.find(p.unsafeGetTensorImpl());
      if (it == state.end()) {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(0);
        s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        it = state.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      s.step(s.step() + 1);
      kernel.step_block(p.detach(), s.exp_avg(), s.exp_avg_sq(), p.grad(), at::Tensor(), s.step(), lr);
    }
  }
  return true;
}

void ema_update(const at::Tensor& ema, const at::Tensor& value, double decay) {
  TORCH_CHECK(ema.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat && ema.sizes() == value.sizes() &&
                  ema.device() == value.device(),
              "ema_update: expected two fp32 tensors of one shape on one device, got ", ema.scalar_type(), " ",
              ema.sizes(), " on ", ema.device(), " and ", value.scalar_type(), " ", value.sizes(), " on ",
              value.device());
  const double weight = 1.0 - decay;
  if (!ema.device().is_cpu() || !ema.is_contiguous() || !value.is_contiguous()) {
    ema.lerp_(value, weight);
    return;
  }
  // at::lerp's two forms (the one that keeps its precision for the weight), without ATen's thread pool:
  // this runs on the optimizer's threads.
  float* e = ema.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const int64_t n = ema.numel();
  const auto w = static_cast<float>(weight);
  if (std::abs(w) < 0.5f) {
    for (int64_t i = 0; i < n; ++i) e[i] = e[i] + w * (v[i] - e[i]);
  } else {
    const float rest = 1.0f - w;
    for (int64_t i = 0; i < n; ++i) e[i] = v[i] - (v[i] - e[i]) * rest;
  }
}

namespace {
// Elements [begin, end) of a flat gradient hold no NaN or infinity.
bool all_finite(const at::Tensor& flat, int64_t begin, int64_t end) {
  const auto* base = static_cast<const char*>(flat.data_ptr()) + begin * static_cast<int64_t>(flat.element_size());
  return io::first_nonfinite(base, end - begin, flat.scalar_type()) < 0;
}
// A run of a block's elements that one CpuAdamW call updates.
struct UpdateRange {
  int64_t offset = 0, numel = 0, group_offset = 0;
};

// When block l's gradient of this step is complete in the host store's grad(l): the D2H copy itself
// (one micro-batch), or the host task that added the last micro-batch's copy into it (accumulation).
struct BlockGradient {
  GradCopy copy;
  std::shared_future<void> summed;
  void wait() const {
    copy.wait();
    if (summed.valid()) summed.get();
  }
};

// One micro-batch as it moves through the stack.
struct MicroBatch {
  StackInput in;
  BlockInputs leaves;                  // what the blocks read: detached leaves in the compute dtype
  std::vector<size_t> differentiable;  // indices of `leaves` whose gradients go back to the prologue
  std::vector<torch::Tensor> saved;    // block inputs kept by the forward for the recompute (on the device)
  // Host activations: per block, the save of its input into Impl::activation_host, then its restore.
  std::vector<ActivationCopy> saved_copy, restored;
  torch::Tensor last_hidden;  // the stack's output
  torch::Tensor loss;
  torch::Tensor grad;  // dloss/d(input of the block the backward reached)
};

}  // namespace

struct StreamedStackTrainer::Impl {
  std::shared_ptr<StreamedModel> model;
  std::shared_ptr<ShardExchange> exchange;                  // several ranks; null for one process
  std::vector<std::shared_future<void>> reduced;            // sharded, per block: its gradient of this step reduced
  std::vector<char> reduced_nonfinite;                      // sharded, per block: some rank's gradient was non-finite
  at::Tensor reduce_in, reduce_out, gather_in, gather_out;  // sharded: the host task thread's exchange buffers
  std::atomic<int64_t> exchange_ns{0};
  int64_t exchange_bytes = 0;  // handed to the exchange by this step's tasks (counted as they are queued)
  // A restore_block_compute failed (its caller may have swallowed it: a loader's hold releasing a block): the next
  // reload_blocks_from_masters rounds every block again instead of trusting the restores.
  bool compute_stale = false;

  // What block l's reduce-scatter (or all-gather) hands to the exchange: R parts of ⌈n/R⌉ elements (+1
  // for the reduce-scatter's non-finite count) of the gradient's (the compute copy's) dtype.
  int64_t exchange_size(const HostParamStore& st, int64_t l, bool reduce) const {
    const int64_t R = exchange->world_size(), s = shard_stride(st.block_numel(l), R);
    return reduce ? R * (s + 1) * static_cast<int64_t>(reduce_in.element_size())
                  : R * s * static_cast<int64_t>(gather_in.element_size());
  }
  std::vector<std::vector<ParamSlot>> params;  // per block, in the store's order
  std::vector<torch::Tensor> resident;
  std::vector<torch::Tensor> resident_ema;  // options.ema_decay > 0: per resident parameter, on the device
  std::unique_ptr<torch::optim::AdamW> resident_optimizer;
  std::unique_ptr<CpuAdamW> resident_adamw;  // a CPU device: runs resident_optimizer's steps (step_on_host)
  std::unique_ptr<CpuAdamW> adamw;
  std::unique_ptr<detail::HostTaskQueue> tasks;
  std::vector<std::shared_future<void>> pending_update;  // per block: its last host update
  std::vector<double> block_sq;                          // per block: Σ g² (scaled gradient), accumulation
  std::vector<torch::Tensor> block_norm;                 // per block: ‖g‖ on the device (no accumulation)
  at::Tensor staging[2];                                 // accumulation: D2H lands here, then added on the host
  std::shared_future<void> staging_free[2];
  std::atomic<int64_t> optimizer_ns{0};
  std::atomic<int64_t> nonfinite_step{0};  // immediate updates: the step (step_calls_) whose gradients were non-finite
  double optimizer_wait_s = 0.0;
  int64_t activation_bytes_peak = 0;
  // Host activations (StackTrainerOptions::host_activations): per block, the host buffer its input is saved
  // into (page-locked on a GPU), kept from step to step while the input's shape stays.
  std::vector<at::Tensor> activation_host;
  StepTrace* trace = nullptr;
  HostParamStore::NvmeStats nvme_before;  // the NVMe tier's counters when the step began

  void bind(int64_t block, const at::Tensor& weights, const at::Tensor& grads) {
    for (auto& p : params[block]) {
      p.param.set_data(weights.narrow(0, p.offset, p.numel).view(p.shape));
      if (grads.defined()) p.param.mutable_grad() = grads.narrow(0, p.offset, p.numel).view(p.shape);
    }
  }
  void unbind(int64_t block, const torch::TensorOptions& empty) {
    for (auto& p : params[block]) {
      p.param.set_data(torch::empty({0}, empty));
      p.param.mutable_grad().reset();
    }
  }
  // The element ranges [offset, offset + numel) of block l's parameters that received a gradient in
  // this step, adjacent ones merged (int8 state: one per parameter, whose quantisation groups start at
  // its first element). Like torch::optim::AdamW, the update leaves the others alone: no weight decay,
  // no moment update.
  std::vector<UpdateRange> updated_ranges(int64_t block, bool merge) const {
    std::vector<UpdateRange> ranges;
    for (const auto& p : params[block]) {
      if (!p.received->load()) continue;
      if (merge && !ranges.empty() && ranges.back().offset + ranges.back().numel == p.offset)
        ranges.back().numel += p.numel;
      else ranges.push_back({p.offset, p.numel, p.group_offset});
    }
    return ranges;
  }
  // True when block l's gradient holds no NaN or infinity: one pass on the optimizer's threads, each over
  // the range it updates (the scan is on the update's critical path, once per block and step).
  bool gradient_finite(const at::Tensor& grad) {
    TORCH_CHECK(
        grad.scalar_type() == at::kBFloat16 || grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kFloat,
        "StreamedStackTrainer: unsupported gradient dtype ", grad.scalar_type());
    std::atomic<bool> finite{true};
    adamw->for_each_range(grad.numel(), [&](int64_t b, int64_t e) {
      if (!all_finite(grad, b, e)) finite.store(false, std::memory_order_relaxed);
    });
    return finite.load();
  }
  // Block l's EMA (this rank's shard) moved towards its master, on the optimizer's threads.
  void update_block_ema(const HostParamStore& store, int64_t l, double decay) {
    const at::Tensor ema = store.ema(l), master = store.master(l);
    adamw->for_each_range(ema.numel(), [&](int64_t b, int64_t e) {
      ema_update(ema.narrow(0, b, e - b), master.narrow(0, b, e - b), decay);
    });
  }
  // Rounds block l's compute copy from its master over [begin, end), on the optimizer's threads.
  void restore_compute(const HostParamStore& store, int64_t l, int64_t begin, int64_t end) {
    if (end <= begin) return;
    adamw->for_each_range(end - begin,
                          [&](int64_t b, int64_t e) { store.copy_master_to_compute(l, begin + b, begin + e); });
  }

  // Sharded, on the host task thread: block l's gradient (whole, in store.grad(l)) summed over the ranks
  // by a reduce-scatter; this rank's shard of the sum is written back in place. Each rank's part of
  // the exchange carries one more element, the count of ranks whose gradient held a non-finite value,
  // so every rank takes the same skip decision (immediate updates only, `count_nonfinite`: deferred
  // ones decide from the global norm). Leaves Σ g² of the shard in block_sq[l].
  void reduce_gradient(const HostParamStore& st, int64_t l, bool count_nonfinite) {
    const auto start = Clock::now();
    const at::Tensor g = st.grad(l);
    const int64_t n = g.numel(), R = exchange->world_size(), s = shard_stride(n, R), part = s + 1;
    const auto es = static_cast<int64_t>(g.element_size());
    const at::Tensor in = reduce_in.narrow(0, 0, R * part), out = reduce_out.narrow(0, 0, part);
    TORCH_CHECK(in.scalar_type() == g.scalar_type(), "StreamedStackTrainer: exchange buffer dtype mismatch");
    const float nonfinite = count_nonfinite && !gradient_finite(g) ? 1.f : 0.f;
    char* dst = static_cast<char*>(in.data_ptr());
    const char* src = static_cast<const char*>(g.data_ptr());
    for (int64_t r = 0; r < R; ++r) {
      const ShardRange range = shard_range(n, r, R);
      std::memcpy(dst + r * part * es, src + range.begin * es, static_cast<size_t>(range.size() * es));
      std::memset(dst + (r * part + range.size()) * es, 0, static_cast<size_t>((s - range.size()) * es));
      set_element(in, dst, r * part + s, nonfinite);
    }
    exchange->reduce_scatter_sum(in, out);
    const ShardRange mine = st.shard(l);
    std::memcpy(static_cast<char*>(g.data_ptr()) + mine.begin * es, out.data_ptr(),
                static_cast<size_t>(mine.size() * es));
    reduced_nonfinite[l] = element(out, out.data_ptr(), s) != 0.f;
    block_sq[l] = sum_of_squares(g, mine.begin, mine.end);
    exchange_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  }

  // Sharded, on the host task thread: every rank's shard of block l's compute copy into every rank's
  // whole copy (an all-gather), after this rank's shard was updated or restored.
  void gather_compute(const HostParamStore& st, int64_t l) {
    const auto start = Clock::now();
    const at::Tensor c = st.compute(l);
    const int64_t n = c.numel(), R = exchange->world_size(), s = shard_stride(n, R);
    const auto es = static_cast<int64_t>(c.element_size());
    const at::Tensor in = gather_in.narrow(0, 0, s), out = gather_out.narrow(0, 0, R * s);
    const ShardRange mine = st.shard(l);
    char* copy = static_cast<char*>(c.data_ptr());
    std::memcpy(in.data_ptr(), copy + mine.begin * es, static_cast<size_t>(mine.size() * es));
    std::memset(static_cast<char*>(in.data_ptr()) + mine.size() * es, 0, static_cast<size_t>((s - mine.size()) * es));
    exchange->all_gather(in, out);
    std::memcpy(copy, out.data_ptr(), static_cast<size_t>(n * es));  // shard r starts at r·s in both
    exchange_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  }
};

// One optimizer step as a schedule of named phases; StreamedStackTrainer::step reads it top to bottom.
// Every wait on a copy or an update is a call here:
//   acquire(l)            the compute stream waits for block l's upload
//   gradient_buffer(l)    the compute stream waits until the slot's previous gradient has left it
//   upload(l)             the host waits for block l's pending update or restore (both rewrite the
//                         compute copy, which holds the block's gradient until then at accumulation 1)
//   BlockGradient::wait   a host task (an update, or a restore of the copy) waits for block l's gradient to land
//   staging_free          the host waits until the last add has read a staging buffer before reusing it
struct StreamedStackTrainer::StepRun {
  StreamedStackTrainer& t;
  Impl& im;
  HostParamStore& store;
  WeightStreamer& streamer;
  const double lr;
  const int64_t first, L;  // the step's blocks [first, L)
  const int64_t accum;
  const bool deferred;
  const c10::ScalarType dt;
  const double scale;       // the loss scale of this step (1 unless fp16)
  const int64_t adam_step;  // the AdamW step number this update would take
  const int64_t serial;     // this step's number among every step() (immediate updates' skip guard)
  const bool partial;       // not every block
  const bool frozen;        // StackTrainerOptions::frozen_blocks: the blocks have no gradient
  const torch::TensorOptions empty;
  const Clock::time_point start = Clock::now();
  std::vector<BlockGradient> gradient;  // per block
  double loss_sum = 0.0;

  StepRun(StreamedStackTrainer& trainer, double step_lr, const StepBlocks& blocks)
      : t(trainer),
        im(*trainer.impl_),
        store(*trainer.store_),
        streamer(*trainer.streamer_),
        lr(step_lr),
        first(blocks.begin),
        L(blocks.end < 0 ? trainer.streamer_->num_blocks() : blocks.end),
        accum(trainer.options_.grad_accum_steps),
        deferred(trainer.deferred_updates()),
        dt(trainer.options_.compute_dtype),
        scale(trainer.loss_scale_),
        adam_step(blocks.adam_step > 0 ? blocks.adam_step : trainer.adam_steps_ + 1),
        serial(++trainer.step_calls_),
        partial(first > 0 || L < trainer.streamer_->num_blocks()),
        frozen(trainer.options_.frozen_blocks),
        empty(torch::TensorOptions().dtype(dt).device(trainer.options_.device)),
        gradient(static_cast<size_t>(L)) {
    TORCH_CHECK(0 <= first && first < L && L <= trainer.streamer_->num_blocks(), "StreamedStackTrainer::step: blocks [",
                blocks.begin, ", ", blocks.end, ") is not a non-empty range of the ", trainer.streamer_->num_blocks(),
                " blocks");
    TORCH_CHECK(blocks.adam_step >= 0, "StreamedStackTrainer::step: adam_step ", blocks.adam_step, " is negative");
    if (im.trace != nullptr) streamer.set_trace(im.trace);
    // The NVMe tier's I/O before the first step (the initial load, a resume's) is no step's.
    if (serial == 1) im.nvme_before = store.nvme_stats();
    streamer.reset_stats();
    im.optimizer_wait_s = 0.0;
    im.activation_bytes_peak = 0;
    for (auto& block : im.params)
      for (auto& p : block) p.received->store(false);
#ifdef MEGASLIDE_WITH_CUDA
    if (t.options_.device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(t.options_.device.index());
#endif
    if (im.resident_optimizer) im.resident_optimizer->zero_grad();
  }

  // --- the building blocks ------------------------------------------------------------------------
  void wait_for_update(int64_t l) {
    auto& pending = im.pending_update[l];
    if (!pending.valid()) return;
    const auto wait = Clock::now();
    pending.get();  // rethrows a failed update
    im.optimizer_wait_s += seconds_since(wait);
    pending = {};
  }
  at::Tensor upload_source(int64_t l) const { return store.master_uploaded() ? store.master(l) : store.compute(l); }
  void upload(int64_t l) {
    wait_for_update(l);
    streamer.prefetch(l, upload_source(l));
  }
  // Uploads block l now unless its update is still running (then the caller uploads it later).
  bool try_upload(int64_t l) {
    auto& pending = im.pending_update[l];
    if (pending.valid() && pending.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    upload(l);
    return true;
  }

  // A CpuAdamW update of block l on the host task thread, once its gradient has landed; `grad_scale`
  // unscales and clips. `guard` (immediate updates, which start before the global norm is known): a
  // block whose gradient holds a non-finite value is not updated, nor is any block after it in this step.
  // Where the gradient sat in the compute buffer, every element the update does not rewrite (a skipped
  // block, parameters without a gradient) gets its copy back from the master.
  void dispatch_update(int64_t l, float grad_scale, bool guard) {
    streamer.invalidate(l);
    if (im.exchange) {
      grad_scale /= static_cast<float>(im.exchange->world_size());  // the sum over ranks -> the mean
      im.exchange_bytes += im.exchange_size(store, l, /*reduce=*/false);
    }
    const BlockGradient landed = gradient[l];
    const auto ranges = im.updated_ranges(l, t.options_.state_dtype != StateDtype::kInt8);
    store.prefetch_state(l);  // the NVMe tier: read while the gradient comes, in the order updates run
    StreamedStackTrainer* self = &t;
    const double step_lr = lr;
    const int64_t step = adam_step, run = serial;
    StepTrace* trace = im.trace;
    im.pending_update[l] = im.tasks->submit([self, l, landed, ranges, grad_scale, guard, step_lr, step, run, trace] {
      landed.wait();
      Impl& impl = *self->impl_;
      const HostParamStore& st = *self->store_;
      const bool sharded = impl.exchange != nullptr;
      if (sharded) impl.reduced[l].get();   // queued before this task: done
      const ShardRange mine = st.shard(l);  // the elements this rank updates: all, or its shard
      const bool restore = st.gradient_in_compute_buffer();
      // Only immediate updates (`guard`) look: deferred ones were already decided by the global norm.
      const bool skip = guard && (impl.nonfinite_step.load() == run ||
                                  (sharded ? impl.reduced_nonfinite[l] != 0 : !impl.gradient_finite(st.grad(l))));
      // The NVMe tier: the block's state in memory (read ahead, waited for here), written back after an update.
      const HostParamStore::StateLease lease = st.acquire_state(l, /*write=*/!skip);
      if (skip) {
        impl.nonfinite_step.store(run);
        if (restore) impl.restore_compute(st, l, mine.begin, mine.end);
        if (sharded) impl.gather_compute(st, l);
        return;
      }
      const double t0 = trace != nullptr ? trace->now_s() : 0.0;
      const auto begin = Clock::now();
      const bool fp32_compute = self->options_.compute_dtype == at::kFloat;
      const at::Tensor grad = st.grad(l), compute = st.compute(l);
      const size_t grad_size = c10::elementSize(grad.scalar_type());
      const size_t state_size = static_cast<size_t>(state_element_bytes(st.options().state_dtype));
      const size_t compute_size = c10::elementSize(st.options().compute_dtype);
      const bool int8 = st.options().state_dtype == StateDtype::kInt8;
      int64_t done = mine.begin;  // elements of the shard before `done` are updated or restored
      for (UpdateRange r : ranges) {
        // Sharded: the part of the range in this rank's shard; master and moments are shard-indexed.
        const int64_t first = std::max(r.offset, mine.begin), last = std::min(r.offset + r.numel, mine.end);
        if (first >= last) continue;
        r.numel = last - first;
        r.offset = first;
        if (restore && r.offset > done) impl.restore_compute(st, l, done, r.offset);
        const int64_t local = r.offset - mine.begin;
        AdamWBlockState s;
        s.master = st.master(l).data_ptr<float>() + local;
        s.exp_avg = static_cast<char*>(st.exp_avg(l).data_ptr()) + local * state_size;
        s.exp_avg_sq = static_cast<char*>(st.exp_avg_sq(l).data_ptr()) + local * state_size;
        if (int8) {
          s.exp_avg_scale = st.exp_avg_scale(l).data_ptr<float>() + r.group_offset;
          s.exp_avg_sq_scale = st.exp_avg_sq_scale(l).data_ptr<float>() + r.group_offset;
        }
        s.state_dtype = st.options().state_dtype;
        s.grad = static_cast<const char*>(grad.data_ptr()) + r.offset * grad_size;
        s.grad_dtype = grad.scalar_type();
        s.compute = fp32_compute ? nullptr : static_cast<char*>(compute.data_ptr()) + r.offset * compute_size;
        s.compute_dtype = st.options().compute_dtype;
        s.numel = r.numel;
        impl.adamw->step_block(s, step, step_lr, grad_scale);
        done = r.offset + r.numel;
      }
      if (restore && done < mine.end) impl.restore_compute(st, l, done, mine.end);
      // fp32 compute, sharded or on the NVMe tier: the copy is the master itself (nothing above wrote it).
      if (!st.master_uploaded() && fp32_compute) impl.restore_compute(st, l, mine.begin, mine.end);
      if (self->has_ema()) impl.update_block_ema(st, l, ema_decay_at(self->options_.ema_decay, step));
      impl.optimizer_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - begin).count();
      if (trace != nullptr)
        trace->add(TraceLane::kOptimizer, "adamw block " + std::to_string(l), t0, trace->now_s() - t0);
      if (sharded) impl.gather_compute(st, l);
    });
  }

  // A skipped step leaves block l's master and moments alone; where its gradient sat in the compute
  // buffer, the copy is rounded back from the master once the gradient copy has landed (a restore
  // before it lands would be overwritten by it). The next upload of l waits for this like an update.
  void dispatch_restore(int64_t l) {
    if (!store.gradient_in_compute_buffer()) return;  // the copy was never overwritten
    if (store.master_uploaded()) return;              // fp32: the master is what is uploaded
    const BlockGradient landed = gradient[l];
    StreamedStackTrainer* self = &t;
    if (im.exchange) im.exchange_bytes += im.exchange_size(store, l, /*reduce=*/false);
    store.prefetch_state(l);
    im.pending_update[l] = im.tasks->submit([self, l, landed] {
      landed.wait();
      const HostParamStore& st = *self->store_;
      const HostParamStore::StateLease lease = st.acquire_state(l, /*write=*/false);
      const ShardRange mine = st.shard(l);
      self->impl_->restore_compute(st, l, mine.begin, mine.end);
      if (self->impl_->exchange) self->impl_->gather_compute(st, l);
    });
  }

  // Sharded: once block l's gradient of the step is complete on the host, a host task sums it over
  // the ranks (Impl::reduce_gradient). Queued before the block's update, which reads its result.
  void dispatch_reduce(int64_t l) {
    im.exchange_bytes += im.exchange_size(store, l, /*reduce=*/true);
    const BlockGradient landed = gradient[l];
    StreamedStackTrainer* self = &t;
    const bool count_nonfinite = !deferred;
    im.reduced[l] = im.tasks->submit([self, l, landed, count_nonfinite] {
      landed.wait();
      self->impl_->reduce_gradient(*self->store_, l, count_nonfinite);
    });
  }

  // The gradient of block l leaves its slot: straight into the store (one micro-batch), or through a
  // staging buffer that a host task adds into the store's fp32 sum (accumulation).
  void send_gradient_to_host(int64_t l, const at::Tensor& slot_grads, int64_t k, bool last) {
    if (accum == 1) {
      // The norm on the device, from the slot, before the copy (the compute thread's own ops); sharded,
      // the host computes it from the reduced gradient.
      if (!im.exchange) im.block_norm[l] = at::linalg_vector_norm(slot_grads, 2, {}, false, at::kFloat);
      gradient[l] = {streamer.offload_gradient(l, store.grad(l)), {}};
      return;
    }
    const int64_t slot = WeightStreamer::slot_of(l);
    if (im.staging_free[slot].valid()) im.staging_free[slot].get();  // the last add has read the buffer
    auto staging = im.staging[slot].narrow(0, 0, store.block_numel(l));
    const GradCopy copy = streamer.offload_gradient(l, staging);
    StreamedStackTrainer* self = &t;
    const int threads = t.options_.optimizer_threads;
    im.staging_free[slot] = im.tasks->submit([self, l, staging, copy, k, last, threads] {
      copy.wait();
      const double sq = accumulate(self->store_->grad(l), staging, k == 0, last, threads);
      if (last) self->impl_->block_sq[l] = sq;
    });
    if (last) gradient[l] = {GradCopy(), im.staging_free[slot]};
  }

  // --- the phases -----------------------------------------------------------------------------------
  // The resident prologue under autograd; the blocks' shared inputs become leaves in the compute dtype.
  MicroBatch run_prologue(const Prologue& prologue) {
    MicroBatch mb;
    const int span = streamer.begin_span(TraceLane::kCompute, "prologue");
    mb.in = prologue();
    streamer.end_span(span);
    TORCH_CHECK(mb.in.hidden.defined() && mb.in.hidden.is_floating_point(),
                "StreamedStackTrainer: the prologue must return a floating hidden tensor");
    mb.leaves.info = mb.in.inputs.info;
    for (size_t i = 0; i < mb.in.inputs.tensors.size(); ++i) {
      const auto& x = mb.in.inputs.tensors[i];
      if (!x.defined() || !x.is_floating_point()) {
        mb.leaves.tensors.push_back(x);
        continue;
      }
      auto leaf = x.detach().to(dt);
      if (x.requires_grad()) {
        leaf.requires_grad_(true);
        mb.differentiable.push_back(i);
      }
      mb.leaves.tensors.push_back(leaf);
    }
    return mb;
  }

  // Host activations: the input of every block but the last leaves the device during the forward.
  bool offloaded(int64_t l) const { return t.options_.host_activations && l + 1 < L; }

  // Block l's input to its host buffer (allocated, page-locked on a GPU, when its shape is new).
  void save_input(MicroBatch& mb, int64_t l, const torch::Tensor& x) {
    auto& host = im.activation_host[static_cast<size_t>(l)];
    if (!host.defined() || host.sizes() != x.sizes() || host.scalar_type() != x.scalar_type())
      host = at::empty(x.sizes(), x.options().device(at::kCPU).pinned_memory(x.is_cuda()));
    mb.saved_copy[l] = streamer.save_activation(host, x, "d2h activation " + std::to_string(l));
  }

  // Blocks 0 … L-1 without grad, keeping each block's input (on the device, or saved to the host). Block
  // l+1's upload is queued as soon as block l holds its slot, unless l+1's update is still running.
  void forward_sweep(MicroBatch& mb) {
    NvtxRange range("forward");
    torch::NoGradGuard no_grad;
    mb.saved.assign(static_cast<size_t>(L), torch::Tensor());
    mb.saved_copy.assign(static_cast<size_t>(L), ActivationCopy());
    mb.restored.assign(static_cast<size_t>(L), ActivationCopy());
    if (t.options_.host_activations) im.activation_host.resize(static_cast<size_t>(L));
    // Every block input contiguous (the prologue's tokens are a transposed view): the backward's recompute then
    // sees the layout the forward saw, whether the input stayed on the device or came back from the host.
    torch::Tensor x = mb.in.hidden.detach().to(dt).contiguous();
    int64_t kept_bytes = 0;
    upload(first);
    for (int64_t l = first; l < L; ++l) {
      NvtxRange block_range("forward block " + std::to_string(l));
      auto weights = streamer.acquire(l);
      const bool next_queued = l + 1 < L && try_upload(l + 1);
      im.bind(l, weights, {});
      const int span = streamer.begin_span(TraceLane::kCompute, "forward block " + std::to_string(l));
      if (offloaded(l)) {
        save_input(mb, l, x);
      } else {
        mb.saved[l] = x;
      }
      // Device bytes of block inputs: every one kept; with host activations the last block's, and the one before
      // it counted as still in flight to the host (the planner's min(blocks + 1, 3) with the stack's output).
      if (!t.options_.host_activations || l + 2 >= L) kept_bytes += static_cast<int64_t>(x.nbytes());
      x = im.model->forward_block(l, x, mb.leaves).contiguous();
      streamer.end_span(span);
      im.unbind(l, empty);
      streamer.release(l);
      if (l + 1 < L && !next_queued) upload(l + 1);
    }
    im.activation_bytes_peak =
        std::max<int64_t>(im.activation_bytes_peak, kept_bytes + static_cast<int64_t>(x.nbytes()));
    mb.last_hidden = x;
  }

  // The resident epilogue and loss under autograd, back to the stack's output.
  void run_epilogue(MicroBatch& mb, const Epilogue& epilogue) {
    const int span = streamer.begin_span(TraceLane::kCompute, "epilogue");
    auto last_hidden = mb.last_hidden.to(mb.in.hidden.scalar_type()).detach().requires_grad_(true);
    mb.loss = epilogue(last_hidden);
    TORCH_CHECK(mb.loss.defined() && mb.loss.numel() == 1,
                "StreamedStackTrainer: the epilogue must return a scalar loss");
    torch::Tensor objective = mb.loss;
    if (scale != 1.0) objective = mb.loss * (scale / static_cast<double>(accum));
    else if (accum > 1) objective = mb.loss / static_cast<double>(accum);
    objective.backward({}, /*retain_graph=*/true);
    streamer.end_span(span);
    TORCH_CHECK(last_hidden.grad().defined(),
                "StreamedStackTrainer: the loss does not depend on the last block's output");
    mb.grad = last_hidden.grad().to(dt);
    mb.last_hidden = torch::Tensor();
  }

  // Blocks L-1 … 0: recompute with grad, backward into the slot, gradient to the host; block l-1's
  // upload overlaps block l. After the last micro-batch, immediate updates start block by block.
  void backward_sweep(MicroBatch& mb, int64_t k) {
    NvtxRange range("backward");
    const bool last = k + 1 == accum;
    for (int64_t l = L - 1; l >= first; --l) {
      NvtxRange block_range("backward block " + std::to_string(l));
      if (l == L - 1) upload(l);  // a cache hit: the forward just used it
      auto weights = streamer.acquire(l);
      if (l > first) upload(l - 1);
      if (l > first && offloaded(l - 1))  // block l-1's input comes back while block l computes
        mb.saved[l - 1] =
            streamer.restore_activation(im.activation_host[static_cast<size_t>(l - 1)], mb.saved_copy[l - 1],
                                        &mb.restored[l - 1], "h2d activation " + std::to_string(l - 1));
      auto grads = frozen ? at::Tensor() : streamer.gradient_buffer(l);
      im.bind(l, weights, grads);
      const int span = streamer.begin_span(TraceLane::kCompute, "backward block " + std::to_string(l));
      if (offloaded(l)) streamer.wait_activation(mb.restored[l]);
      auto input = mb.saved[l].detach().requires_grad_(true);
      {
        torch::AutoGradMode grad_mode(true);
        auto y = im.model->forward_block(l, input, mb.leaves);
        torch::autograd::backward({y}, {mb.grad});
      }
      streamer.end_span(span);
      mb.grad = input.grad();
      TORCH_CHECK(mb.grad.defined(), "StreamedStackTrainer: block ", l, "'s output does not depend on its input");
      mb.saved[l] = torch::Tensor();
      im.unbind(l, empty);
      if (frozen) {  // nothing of the block's own leaves the device
        streamer.release(l);
        continue;
      }
      send_gradient_to_host(l, grads, k, last);
      streamer.release(l);
      if (last && im.exchange) dispatch_reduce(l);
      if (last && !deferred) dispatch_update(l, 1.f, /*guard=*/true);
    }
  }

  // The prologue's backward: the first block's input gradient and every block's gradient of the inputs.
  void prologue_backward(MicroBatch& mb) {
    const int span = streamer.begin_span(TraceLane::kCompute, "prologue backward");
    std::vector<torch::Tensor> roots{mb.in.hidden}, root_grads{mb.grad.to(mb.in.hidden.scalar_type())};
    for (size_t i : mb.differentiable) {
      const auto& g = mb.leaves.tensors[i].grad();
      if (!g.defined()) continue;
      roots.push_back(mb.in.inputs.tensors[i]);
      root_grads.push_back(g.to(mb.in.inputs.tensors[i].scalar_type()));
    }
    if (mb.in.hidden.requires_grad()) torch::autograd::backward(roots, root_grads);
    streamer.end_span(span);
    loss_sum += mb.loss.item<double>();
  }

  // The global norm of the unscaled gradient: blocks from their device norms (or the host sums with
  // accumulation), resident parameters on the device — which are unscaled in place here.
  // Every norm computed on the device comes to the host in one copy (one synchronisation per step, not
  // one per resident parameter).
  double global_norm() {
    if (im.exchange) return global_norm_over_ranks();
    std::vector<torch::Tensor> norms;  // [block norms (no accumulation)..., resident norms...], double on the device
    const size_t blocks = accum == 1 && !frozen ? static_cast<size_t>(L - first) : 0;
    if (blocks > 0)
      norms.push_back(torch::stack(std::vector<torch::Tensor>(im.block_norm.begin() + first, im.block_norm.begin() + L))
                          .to(torch::kDouble));
    for (auto& p : im.resident) {
      if (!p.grad().defined()) continue;
      if (scale != 1.0) p.mutable_grad().mul_(1.0 / scale);
      norms.push_back(p.grad().norm().to(torch::kDouble).reshape({1}));
    }
    const auto host = norms.empty() ? torch::Tensor() : torch::cat(norms).to(torch::kCPU);
    double sq = 0.0;
    if (frozen) {
      // no block gradients
    } else if (accum > 1) {
      for (int64_t l = first; l < L; ++l) gradient[l].wait();
      for (int64_t l = first; l < L; ++l) sq += im.block_sq[l];
    } else {
      sq = host.narrow(0, 0, static_cast<int64_t>(blocks)).square().sum().item<double>();
    }
    sq /= scale * scale;
    return std::sqrt(add_resident_sq(sq, host, blocks));
  }
  // sq + the resident norms² (host doubles from index `first` on), added in parameter order.
  static double add_resident_sq(double sq, const torch::Tensor& host, size_t first) {
    if (!host.defined()) return sq;
    const double* n = host.data_ptr<double>();
    for (int64_t i = static_cast<int64_t>(first); i < host.numel(); ++i) sq += std::pow(n[i], 2);
    return sq;
  }

  // Several ranks: the blocks' Σ g² of each rank's reduced shard, the resident gradients and the losses
  // summed over the ranks (one all-reduce for the gradients, one for the two sums), then divided by R:
  // the mean gradient over the global batch and the mean loss, the same on every rank.
  double global_norm_over_ranks() {
    double block_sq = 0.0;
    for (int64_t l = first; l < L && !frozen; ++l) im.reduced[l].get();  // rethrows a failed exchange
    for (int64_t l = first; l < L && !frozen; ++l) block_sq += im.block_sq[l];
    const double R = static_cast<double>(im.exchange->world_size());
    std::vector<torch::Tensor> with_grad;
    for (auto& p : im.resident)
      if (p.grad().defined()) with_grad.push_back(p);
    // The count of resident gradients and its square: every rank's count is the same exactly when the sums are R
    // times this rank's count and square. Checked before the gradients' all-reduce, whose length is the count:
    // ranks that disagree all stop here instead of reducing buffers that do not line up.
    const double n = static_cast<double>(with_grad.size());
    std::vector<at::Tensor> scalars{torch::tensor({block_sq, loss_sum, n, n * n}, torch::kDouble)};
    im.exchange->all_reduce_sum(scalars);
    const auto sums = scalars[0];
    TORCH_CHECK(sums[2].item<double>() == R * n && sums[3].item<double>() == R * n * n,
                "StreamedStackTrainer: this rank has ", with_grad.size(),
                " resident parameters with a gradient but the ranks together have ", sums[2].item<double>(),
                "; every rank must train the same parameters");
    loss_sum = sums[1].item<double>() / R;
    double sq = sums[0].item<double>() / (R * R * scale * scale);
    if (!with_grad.empty()) {
      std::vector<torch::Tensor> parts;
      for (auto& p : with_grad) parts.push_back(p.grad().flatten().to(torch::kFloat));
      std::vector<at::Tensor> collectives{torch::cat(parts)};
      im.exchange->all_reduce_sum(collectives);
      auto flat = collectives[0].div_(R * scale);  // the mean over the ranks, unscaled
      int64_t offset = 0;
      std::vector<torch::Tensor> norms;
      for (auto& p : with_grad) {
        auto g = flat.narrow(0, offset, p.numel()).view(p.sizes());
        offset += p.numel();
        p.mutable_grad().copy_(g);
        norms.push_back(g.norm().to(torch::kDouble));
      }
      sq = add_resident_sq(sq, torch::stack(norms).to(torch::kCPU), 0);  // one copy to the host
    }
    return std::sqrt(sq);
  }

  // Skip or take the step: the loss scale, the clip coefficient, the deferred block updates (each
  // starts once its gradient has landed; the next forward waits for them block by block) or, skipped,
  // the restores of the compute copies that held gradients, the resident AdamW step; then the figures.
  StackStepResult commit(double grad_norm) {
    StackStepResult r;
    r.grad_norm = grad_norm;
    r.loss_scale = scale;
    r.skipped = !std::isfinite(grad_norm);  // immediate updates: the host tasks skip the blocks themselves
    if (deferred) {
      if (dt == at::kHalf) {
        if (r.skipped) {
          t.loss_scale_ = std::max(1.0, t.loss_scale_ / 2);
          t.clean_steps_ = 0;
        } else if (++t.clean_steps_ >= t.options_.loss_scale_window) {
          t.loss_scale_ *= 2;
          t.clean_steps_ = 0;
        }
      }
      if (!r.skipped) {
        float coef = 1.f;
        if (t.options_.grad_clip > 0)
          coef = std::min(1.f, static_cast<float>(t.options_.grad_clip) / (static_cast<float>(grad_norm) + 1e-6f));
        if (coef < 1.f) {
          for (auto& p : im.resident)
            if (p.grad().defined()) p.mutable_grad().mul_(coef);
        }
        for (int64_t l = first; l < L && !frozen; ++l)
          dispatch_update(l, static_cast<float>(coef / scale), /*guard=*/false);
      } else {
        for (int64_t l = first; l < L && !frozen; ++l) dispatch_restore(l);
      }
    }
    if (!r.skipped) {
      if (im.resident_optimizer) {
        for (auto& group : im.resident_optimizer->param_groups())
          static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
        if (im.resident_adamw) step_on_host(*im.resident_optimizer, *im.resident_adamw);
        else im.resident_optimizer->step();
      }
      ++t.adam_steps_;
      if (t.has_ema()) {
        torch::NoGradGuard no_grad;
        const double decay = ema_decay_at(t.options_.ema_decay, adam_step);
        for (size_t i = 0; i < im.resident.size(); ++i)
          if (!partial || im.resident[i].grad().defined())
            ema_update(im.resident_ema[i], im.resident[i].detach(), decay);
      }
    }
    if (t.options_.mode == StreamMode::kSync) t.synchronize();
    else streamer.synchronize();
    return figures(r);
  }

  StackStepResult figures(StackStepResult r) {
    const auto& st = streamer.stats();
    r.loss = loss_sum / static_cast<double>(accum);
    r.h2d_bytes = st.h2d_bytes;
    r.d2h_bytes = st.d2h_bytes;
    r.exposed_transfer_s = st.exposed_transfer_s;
    r.optimizer_wait_s = im.optimizer_wait_s;
    r.optimizer_s = static_cast<double>(im.optimizer_ns.exchange(0)) * 1e-9;
#ifdef MEGASLIDE_WITH_CUDA
    if (t.options_.device.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(t.options_.device.index());
      r.peak_device_bytes = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    }
#endif
    if (!t.options_.device.is_cuda()) {
      int64_t resident_bytes = 0;
      for (const auto& p : im.resident)  // weights, gradient, m, v (and the EMA)
        resident_bytes += (t.has_ema() ? 5 : 4) * static_cast<int64_t>(p.nbytes());
      r.peak_device_bytes =
          streamer.device_weight_bytes() + streamer.device_gradient_bytes() + resident_bytes + im.activation_bytes_peak;
    }
    if (im.trace != nullptr) {
      streamer.resolve_trace();
      im.trace = nullptr;
      streamer.set_trace(nullptr);  // the NVMe tier's write-backs of the step go on into it until synchronize()
    }
    r.step_time_s = seconds_since(start);
    const HostParamStore::NvmeStats nvme = store.nvme_stats();
    r.nvme_read_bytes = nvme.read_bytes - im.nvme_before.read_bytes;
    r.nvme_write_bytes = nvme.write_bytes - im.nvme_before.write_bytes;
    r.nvme_read_s = nvme.read_s - im.nvme_before.read_s;
    r.nvme_write_s = nvme.write_s - im.nvme_before.write_s;
    r.nvme_wait_s = nvme.wait_s - im.nvme_before.wait_s;
    im.nvme_before = nvme;
    r.exchange_bytes = std::exchange(im.exchange_bytes, 0);
    r.exchange_s = static_cast<double>(im.exchange_ns.exchange(0)) * 1e-9;
    return r;
  }
};

StreamedStackTrainer::StreamedStackTrainer(std::shared_ptr<StreamedModel> model, StackTrainerOptions options)
    : impl_(std::make_unique<Impl>()), options_(options) {
  options_.device = detail::canonical_device(options_.device);  // "cuda" means the current GPU
  TORCH_CHECK(model != nullptr, "StreamedStackTrainer: model is null");
  const auto dt = options_.compute_dtype;
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat,
              "StreamedStackTrainer: compute dtype must be BFloat16, Half or Float, got ", dt);
  TORCH_CHECK(options_.grad_accum_steps >= 1, "StreamedStackTrainer: grad_accum_steps must be >= 1, got ",
              options_.grad_accum_steps);
  TORCH_CHECK(options_.grad_clip >= 0, "StreamedStackTrainer: grad_clip must be >= 0, got ", options_.grad_clip);
  TORCH_CHECK(options_.optimizer_threads >= 1, "StreamedStackTrainer: optimizer_threads must be >= 1, got ",
              options_.optimizer_threads);
  TORCH_CHECK(options_.init_threads >= 1, "StreamedStackTrainer: init_threads must be >= 1, got ",
              options_.init_threads);
  const int64_t L = model->num_blocks();
  TORCH_CHECK(L >= 1, "StreamedStackTrainer: the model has ", L, " blocks; expected at least 1");
  impl_->model = model;
  loss_scale_ = dt == at::kHalf ? options_.loss_scale_init : 1.0;

  // The blocks' initial weights become the host state, block by block; the modules keep empty
  // parameters (on the meta device a block's skeleton never had any storage).
  std::vector<BlockSpec> specs;
  for (int64_t l = 0; l < L; ++l) {
    BlockSpec spec{"blocks." + std::to_string(l), {}};
    for (const auto& item : model->block(l).named_parameters(/*recurse=*/true)) {
      spec.params.push_back({item.key(), item.value().sizes().vec()});
    }
    TORCH_CHECK(!spec.params.empty(), "StreamedStackTrainer: block ", l, " has no parameters");
    TORCH_CHECK(model->block(l).named_buffers(true).size() == 0, "StreamedStackTrainer: block ", l,
                " registers buffers, which streamed blocks do not support (see offload/streamed_model.h)");
    specs.push_back(std::move(spec));
  }
  const auto& a = options_.adamw;
  impl_->adamw = std::make_unique<CpuAdamW>(a, options_.optimizer_threads);
  TORCH_CHECK(options_.ema_decay >= 0 && options_.ema_decay < 1,
              "StreamedStackTrainer: ema_decay must be in [0, 1), got ", options_.ema_decay);
  const bool frozen = options_.frozen_blocks;
  HostParamStoreOptions store_options = host_store_options(dt, options_.grad_accum_steps, options_.state_dtype);
  store_options.pin_if_cuda = options_.pin_host_memory;
  store_options.ema = has_ema() && !frozen;
  store_options.frozen = frozen;
  TORCH_CHECK(options_.frozen_dtype == c10::ScalarType::Undefined || frozen,
              "StreamedStackTrainer: frozen_dtype applies to frozen blocks (frozen_blocks) only: trained blocks keep "
              "fp32 masters");
  store_options.frozen_dtype = options_.frozen_dtype;
  TORCH_CHECK(options_.state_tier == StateTier::kRam || !frozen,
              "StreamedStackTrainer: frozen blocks (LoRA's base) have no optimizer state for the NVMe tier; use "
              "offload.state_tier ram");
  TORCH_CHECK(options_.state_tier == StateTier::kRam || options_.nvme_blocks_in_flight >= 2,
              "StreamedStackTrainer: offload.nvme_blocks_in_flight must be at least 2 (one block updated while the "
              "next is read), got ",
              options_.nvme_blocks_in_flight);
  store_options.state_tier = options_.state_tier;
  store_options.nvme_dir = options_.nvme_dir;
  store_options.nvme_blocks_in_flight = options_.nvme_blocks_in_flight;
  store_options.nvme = options_.nvme;
  if (frozen) store_options.separate_grad = false;  // the sums are the resident parameters' own .grad
  if (options_.exchange && !frozen) {
    store_options.shard_rank = options_.exchange->rank();
    store_options.shard_count = options_.exchange->world_size();
  }
  // Each block's pages first touched by the optimizer threads that will update them.
  CpuAdamW* adamw = impl_->adamw.get();
  store_options.first_touch = [adamw](int64_t numel, const std::function<void(int64_t, int64_t)>& zero) {
    adamw->for_each_range(numel, zero);
  };
  store_ = std::make_unique<HostParamStore>(specs, store_options);
  load_initial_weights(*model, *store_, std::max(1, options_.init_threads));
  store_->flush_state();  // the NVMe tier: the initial state on disk (a disk that refuses it stops here)

  std::vector<int64_t> numels;
  const auto empty = torch::TensorOptions().dtype(dt).device(options_.device);
  impl_->params.resize(L);
  for (int64_t l = 0; l < L; ++l) {
    numels.push_back(store_->block_numel(l));
    for (const auto& item : model->block(l).named_parameters(true)) {
      torch::Tensor p = item.value();
      const auto views = store_->param(l, item.key());
      auto received = std::make_shared<std::atomic<bool>>(false);
      if (frozen) p.set_requires_grad(false);
      else p.register_hook([received](const torch::Tensor&) { received->store(true); });
      // Shapes from the store: a block built by initial_block already had its parameters emptied.
      impl_->params[l].push_back(
          {p, views.offset, views.grad.numel(), views.group_offset, views.grad.sizes().vec(), received});
      p.set_data(torch::empty({0}, empty));
    }
  }
  streamer_ = std::make_unique<WeightStreamer>(
      numels, WeightStreamerOptions{options_.device, dt, options_.mode, options_.emulated_copy_delay_ms, 0.0, !frozen,
                                    store_->transfer_dtype()});
  if (store_->transfer_dtype() != dt) {  // fp8 blocks: each upload upcast on the device with its scales
    struct Fp8Block {
      std::vector<int64_t> offsets, sizes;
      torch::Tensor scales;              // on the device
      std::vector<torch::Tensor> exact;  // the vectors kept exact, on the device
    };
    auto blocks = std::make_shared<std::vector<Fp8Block>>(static_cast<size_t>(L));
    for (int64_t l = 0; l < L; ++l) {
      auto& b = (*blocks)[static_cast<size_t>(l)];
      for (const auto& views : store_->params(l)) {
        b.offsets.push_back(views.offset);
        b.sizes.push_back(views.compute.numel());
        b.exact.push_back(views.exact.defined() ? views.exact.to(options_.device) : torch::Tensor());
      }
      b.scales = store_->scales(l).to(options_.device);
    }
    streamer_->set_upcast([blocks](int64_t l, const at::Tensor& raw, const at::Tensor& weights) {
      const auto& b = (*blocks)[static_cast<size_t>(l)];
      upcast_fp8_block(raw, weights, b.offsets, b.sizes, b.scales, b.exact);
    });
  }

  impl_->resident = model->resident_parameters();
  for (const auto& p : impl_->resident) {
    TORCH_CHECK(p.device() == options_.device && p.scalar_type() == at::kFloat,
                "StreamedStackTrainer: resident parameters must be fp32 on ", options_.device, ", got one ",
                p.scalar_type(), " on ", p.device());
  }
  if (has_ema())  // zero until the first update makes it the weights (ema_decay_at(·, 1) = 0)
    for (const auto& p : impl_->resident) impl_->resident_ema.push_back(torch::zeros_like(p));
  if (!impl_->resident.empty()) {
    impl_->resident_optimizer = std::make_unique<torch::optim::AdamW>(
        impl_->resident,
        torch::optim::AdamWOptions(a.lr).betas({a.beta1, a.beta2}).eps(a.eps).weight_decay(a.weight_decay));
    if (options_.device.is_cpu()) impl_->resident_adamw = std::make_unique<CpuAdamW>(a, options_.optimizer_threads);
  }
  impl_->tasks = std::make_unique<detail::HostTaskQueue>(options_.mode == StreamMode::kSync);
  impl_->pending_update.resize(L);
  impl_->block_sq.assign(L, 0.0);
  impl_->block_norm.resize(L);
  if (options_.exchange && options_.exchange->world_size() > 1) {
    impl_->exchange = options_.exchange;  // frozen: the resident gradients' all-reduce only
  }
  if (impl_->exchange && !frozen) {
    impl_->reduced.resize(L);
    impl_->reduced_nonfinite.assign(L, 0);
    int64_t largest = 0;
    for (auto n : numels) largest = std::max(largest, n);
    const int64_t R = options_.exchange->world_size(), s = shard_stride(largest, R);
    const auto grad_dtype = store_->grad(0).scalar_type();
    impl_->reduce_in = torch::zeros({R * (s + 1)}, torch::TensorOptions().dtype(grad_dtype));
    impl_->reduce_out = torch::zeros({s + 1}, torch::TensorOptions().dtype(grad_dtype));
    impl_->gather_in = torch::zeros({s}, torch::TensorOptions().dtype(dt));
    impl_->gather_out = torch::zeros({R * s}, torch::TensorOptions().dtype(dt));
  }
  if (options_.grad_accum_steps > 1 && !frozen) {
    int64_t largest = 0;
    for (auto n : numels) largest = std::max(largest, n);
    const bool pin = options_.device.is_cuda() && options_.pin_host_memory;
    for (auto& s : impl_->staging) s = torch::empty({largest}, torch::TensorOptions().dtype(dt).pinned_memory(pin));
  }
}

StreamedStackTrainer::~StreamedStackTrainer() {
  try {
    synchronize();
  } catch (...) {
  }
}

bool StreamedStackTrainer::deferred_updates() const {
  return options_.grad_clip > 0 || options_.compute_dtype == at::kHalf;
}

int64_t StreamedStackTrainer::streamed_parameter_count() const { return store_->memory_report().num_params; }

int64_t StreamedStackTrainer::resident_parameter_count() const {
  int64_t n = 0;
  for (const auto& p : impl_->resident) n += p.numel();
  return n;
}

std::vector<std::pair<std::string, torch::Tensor>> StreamedStackTrainer::block_master(int64_t block) const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  const auto lease = store_->acquire_state(block, /*write=*/false);
  for (const auto& p : store_->block_spec(block).params) {
    const torch::Tensor master = store_->param(block, p.name).master;
    out.emplace_back(p.name, store_->paged() ? master.clone() : master);  // the NVMe tier's views end with the lease
  }
  return out;
}

torch::Tensor StreamedStackTrainer::resident_ema(const torch::Tensor& param) const {
  for (size_t i = 0; i < impl_->resident_ema.size(); ++i)
    if (impl_->resident[i].unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return impl_->resident_ema[i];
  return {};
}

void StreamedStackTrainer::reset_ema_to_weights() {
  TORCH_CHECK(has_ema(), "StreamedStackTrainer::reset_ema_to_weights: the trainer keeps no EMA (ema_decay 0)");
  synchronize();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < impl_->resident.size(); ++i) impl_->resident_ema[i].copy_(impl_->resident[i]);
  for (int64_t l = 0; l < store_->num_blocks() && !options_.frozen_blocks; ++l) {
    const auto lease = store_->acquire_state(l);
    store_->ema(l).copy_(store_->master(l));
  }
}

torch::Tensor StreamedStackTrainer::gathered_block_ema(int64_t block) {
  TORCH_CHECK(has_ema(), "StreamedStackTrainer::gathered_block_ema: the trainer keeps no EMA (ema_decay 0)");
  synchronize();
  const auto dt = options_.compute_dtype;
  if (!impl_->exchange) {
    const auto lease = store_->acquire_state(block, /*write=*/false);
    return store_->ema(block).to(dt, /*non_blocking=*/false, /*copy=*/true);
  }
  // Rounded as the compute copy is rounded from the master; gathered through the host channel's buffers.
  const HostParamStore& st = *store_;
  Impl& im = *impl_;
  auto whole = torch::empty({st.block_numel(block)}, torch::TensorOptions().dtype(dt));
  im.tasks
      ->submit([&st, &im, block, &whole, dt] {
        const int64_t n = st.block_numel(block), R = im.exchange->world_size(), s = shard_stride(n, R);
        const ShardRange mine = st.shard(block);
        const auto lease = st.acquire_state(block, /*write=*/false);
        const at::Tensor in = im.gather_in.narrow(0, 0, s), out = im.gather_out.narrow(0, 0, R * s);
        in.zero_();
        in.narrow(0, 0, mine.size()).copy_(st.ema(block).to(dt));
        im.exchange->all_gather(in, out);
        whole.copy_(out.narrow(0, 0, n));
      })
      .get();
  return whole;
}

void StreamedStackTrainer::set_block_parameter(int64_t block, const std::string& name, const torch::Tensor& value) {
  synchronize();
  store_->set_param(block, name, value);
  streamer_->invalidate(block);
}

WeightStreamer& StreamedStackTrainer::lend_streamer() {
  synchronize();
  return *streamer_;
}

void StreamedStackTrainer::set_trace(StepTrace* trace) {
  impl_->trace = trace;
  streamer_->set_trace(trace);
  store_->set_trace(trace);
}

void StreamedStackTrainer::leave_out_of_step_figures(const HostParamStore::NvmeStats& since) {
  const HostParamStore::NvmeStats now = store_->nvme_stats();
  auto& before = impl_->nvme_before;
  before.read_bytes += now.read_bytes - since.read_bytes;
  before.write_bytes += now.write_bytes - since.write_bytes;
  before.read_s += now.read_s - since.read_s;
  before.write_s += now.write_s - since.write_s;
  before.wait_s += now.wait_s - since.wait_s;
}

void StreamedStackTrainer::synchronize() {
  impl_->tasks->drain();
  for (auto& f : impl_->pending_update)
    if (f.valid()) f.get();  // rethrows a failed update
  streamer_->synchronize();
  store_->flush_state();  // the NVMe tier's write-backs on disk (rethrows a failed one)
  if (impl_->trace == nullptr) store_->set_trace(nullptr);
}

StackStepResult StreamedStackTrainer::step(const Prologue& prologue, const Epilogue& epilogue, double lr,
                                           const StepBlocks& blocks) {
  StepRun run(*this, lr, blocks);
  for (int64_t k = 0; k < options_.grad_accum_steps; ++k) {
    MicroBatch mb = run.run_prologue(prologue);
    run.forward_sweep(mb);
    run.run_epilogue(mb, epilogue);
    run.backward_sweep(mb, k);  // immediate updates start here, each once its block's gradient has landed
    run.prologue_backward(mb);
  }
  return run.commit(run.global_norm());  // deferred updates start here, likewise
}

HostParamStoreOptions host_store_options(c10::ScalarType compute_dtype, int64_t grad_accum_steps,
                                         StateDtype state_dtype) {
  HostParamStoreOptions o;
  o.compute_dtype = compute_dtype;
  o.state_dtype = state_dtype;
  o.separate_grad = grad_accum_steps > 1;
  return o;
}

void load_initial_weights(StreamedModel& model, HostParamStore& store, int threads) {
  const int64_t L = store.num_blocks();
  std::vector<std::shared_ptr<torch::nn::Module>> built(static_cast<size_t>(L));
  std::atomic<int64_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto worker = [&] {
    torch::NoGradGuard no_grad;
    for (int64_t l = next++; l < L; l = next++) {
      try {
        built[l] = model.initial_block(l);
        torch::nn::Module& source = built[l] ? *built[l] : model.block(l);
        // The NVMe tier: the block's state in memory while its parameters are written (read once, written once).
        const auto lease = store.options().frozen ? HostParamStore::StateLease() : store.acquire_state(l);
        for (const auto& item : source.named_parameters(/*recurse=*/true)) {
          TORCH_CHECK(!item.value().is_meta(), "StreamedStackTrainer: block ", l, "'s parameter '", item.key(),
                      "' is on the meta device and the model gives no initial_block(", l,
                      ") (offload/streamed_model.h)");
          store.set_param(l, item.key(), item.value().detach().to(torch::kCPU, torch::kFloat));
          if (built[l]) item.value().set_data(torch::empty({0}, item.value().options()));  // the store has it now
        }
#ifdef __GLIBC__
        // The block's initial tensors are freed now, but glibc keeps such memory in its heaps once its
        // dynamic mmap threshold has risen past their size, and between the blocks' allocations it cannot
        // reuse all of it: a run's peak resident set grew by 2.6 B a streamed parameter beyond the store
        // (16.7 measured, 14.1 planned; small-50m at 8 and 24 blocks, bf16 compute). Handing it back after
        // each block keeps the start-up at the plan.
        if (malloc_is_glibcs()) ::malloc_trim(0);
#endif
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = L;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int k = 1; k < std::min<int64_t>(threads, L); ++k) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
  for (int64_t l = 0; l < L; ++l)
    if (built[l]) model.adopt_block(l, std::move(built[l]));
}

void StreamedStackTrainer::restore_counters(int64_t optimizer_steps, double loss_scale, int64_t clean_steps) {
  TORCH_CHECK(optimizer_steps >= 0 && clean_steps >= 0 && loss_scale > 0, "restore_counters: invalid counters");
  adam_steps_ = optimizer_steps;
  loss_scale_ = loss_scale;
  clean_steps_ = clean_steps;
}

torch::optim::AdamW* StreamedStackTrainer::resident_optimizer() { return impl_->resident_optimizer.get(); }

void StreamedStackTrainer::restore_block_compute(int64_t block) {
  const ShardRange mine = store_->shard(block);
  try {
    const auto lease = options_.frozen_blocks ? HostParamStore::StateLease() : store_->acquire_state(block, false);
    impl_->restore_compute(*store_, block, mine.begin, mine.end);  // rounded as CpuAdamW rounds
    streamer_->invalidate(block);
  } catch (...) {
    impl_->compute_stale = true;
    throw;
  }
}

void StreamedStackTrainer::reload_blocks_from_masters(bool compute_restored) {
  synchronize();
  if (impl_->compute_stale) compute_restored = false;
  impl_->compute_stale = false;
  for (int64_t l = 0; l < store_->num_blocks(); ++l) {
    if (compute_restored) {
      streamer_->invalidate(l);
    } else {
      restore_block_compute(l);
    }
  }
  if (impl_->exchange &&
      !options_.frozen_blocks) {  // every rank's shards into every rank's copy, on the host task thread
    Impl* impl = impl_.get();
    const HostParamStore* store = store_.get();
    for (int64_t l = 0; l < store_->num_blocks(); ++l)
      impl_->pending_update[l] = impl_->tasks->submit([impl, store, l] { impl->gather_compute(*store, l); });
    synchronize();
    impl_->exchange_ns = 0;
  }
}

}  // namespace megaslide::offload
