#include "megaslide/offload/stack_trainer.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <limits>
#include <thread>

#include "offload/host_task_queue.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define MEGASLIDE_HAVE_NVTX 1
#endif
#endif

namespace megaslide::offload {
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
  constexpr int64_t kMinChunk = int64_t{1} << 20;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinChunk));
  if (chunks == 1) return fn(0, n, 0);
  std::vector<std::thread> pool;
  for (int64_t c = 1; c < chunks; ++c) pool.emplace_back([&, c] { fn(n * c / chunks, n * (c + 1) / chunks, c); });
  fn(0, n / chunks, 0);
  for (auto& t : pool) t.join();
}

float element(const at::Tensor& t, const void* data, int64_t i) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(data)[i]);
    case at::kHalf: return static_cast<float>(static_cast<const c10::Half*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

// dst (fp32) = src or dst += src (src in the compute dtype); returns Σ dst² when `norm`.
double accumulate(const at::Tensor& dst, const at::Tensor& src, bool overwrite, bool norm, int threads) {
  float* out = dst.data_ptr<float>();
  const void* in = src.data_ptr();
  std::vector<double> partial(static_cast<size_t>(std::max(threads, 1)), 0.0);
  parallel_chunks(dst.numel(), threads, [&](int64_t begin, int64_t end, int64_t chunk) {
    double sq = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      const float v = overwrite ? element(src, in, i) : out[i] + element(src, in, i);
      out[i] = v;
      sq += static_cast<double>(v) * v;
    }
    partial[static_cast<size_t>(chunk)] = sq;
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return norm ? total : 0.0;
}

struct ParamSlot {
  torch::Tensor param;  // the block module's parameter (rebound to slot views)
  int64_t offset = 0, numel = 0;
  std::vector<int64_t> shape;
};

}  // namespace

c10::ScalarType parse_compute_dtype(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  if (name == "fp32") return at::kFloat;
  TORCH_CHECK(false, "offload.compute_dtype: expected bf16, fp16 or fp32, got '", name, "'");
}

namespace {
// True when no element is NaN or infinite: the exponent bits of every element are not all ones.
template <typename Bits>
bool exponent_never_saturated(const Bits* p, int64_t n, Bits mask) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= (p[i] & mask) != mask;
  return ok;
}
bool all_finite(const at::Tensor& flat) {
  switch (flat.scalar_type()) {
    case at::kBFloat16: return exponent_never_saturated(static_cast<const uint16_t*>(flat.data_ptr()), flat.numel(), uint16_t{0x7f80});
    case at::kHalf: return exponent_never_saturated(static_cast<const uint16_t*>(flat.data_ptr()), flat.numel(), uint16_t{0x7c00});
    case at::kFloat: return exponent_never_saturated(static_cast<const uint32_t*>(flat.data_ptr()), flat.numel(), uint32_t{0x7f800000});
    default: TORCH_CHECK(false, "all_finite: unsupported gradient dtype ", flat.scalar_type());
  }
}
}  // namespace

struct StreamedStackTrainer::Impl {
  std::shared_ptr<StreamedModel> model;
  std::vector<std::vector<ParamSlot>> params;  // per block, in the store's order
  std::vector<torch::Tensor> resident;
  std::unique_ptr<torch::optim::AdamW> resident_optimizer;
  std::unique_ptr<CpuAdamW> adamw;
  std::unique_ptr<detail::HostTaskQueue> tasks;
  std::vector<std::shared_future<void>> pending_update;  // per block: its last host update
  std::vector<std::shared_future<void>> norm_done;       // per block: squared norm of this step's gradient
  std::vector<double> block_sq;                          // per block: Σ g² (scaled gradient), accumulation
  std::vector<torch::Tensor> block_norm;                 // per block: ‖g‖ on the device (no accumulation)
  at::Tensor staging[2];                                 // accumulation: D2H lands here, then added on the host
  std::shared_future<void> staging_free[2];
  std::atomic<int64_t> optimizer_ns{0};
  std::atomic<int64_t> nonfinite_step{0};  // immediate updates: the AdamW step whose gradients were non-finite
  double optimizer_wait_s = 0.0;
  int64_t activation_bytes_peak = 0;
  StepTrace* trace = nullptr;

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
};

StreamedStackTrainer::StreamedStackTrainer(std::shared_ptr<StreamedModel> model, StackTrainerOptions options)
    : impl_(std::make_unique<Impl>()), options_(options) {
  TORCH_CHECK(model != nullptr, "StreamedStackTrainer: model is null");
  const auto dt = options_.compute_dtype;
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat,
              "StreamedStackTrainer: compute dtype must be BFloat16, Half or Float, got ", dt);
  TORCH_CHECK(options_.grad_accum_steps >= 1, "StreamedStackTrainer: grad_accum_steps must be >= 1, got ",
              options_.grad_accum_steps);
  TORCH_CHECK(options_.grad_clip >= 0, "StreamedStackTrainer: grad_clip must be >= 0, got ", options_.grad_clip);
  TORCH_CHECK(options_.optimizer_threads >= 1, "StreamedStackTrainer: optimizer_threads must be >= 1, got ",
              options_.optimizer_threads);
  const int64_t L = model->num_blocks();
  TORCH_CHECK(L >= 1, "StreamedStackTrainer: the model has ", L, " blocks; expected at least 1");
  impl_->model = model;
  loss_scale_ = dt == at::kHalf ? options_.loss_scale_init : 1.0;

  // The blocks' initial weights become the host state; the modules keep empty parameters.
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
  HostParamStoreOptions store_options = host_store_options(dt, options_.grad_accum_steps);
  store_options.pin_if_cuda = options_.pin_host_memory;
  store_ = std::make_unique<HostParamStore>(specs, store_options);

  std::vector<int64_t> numels;
  const auto empty = torch::TensorOptions().dtype(dt).device(options_.device);
  impl_->params.resize(L);
  for (int64_t l = 0; l < L; ++l) {
    numels.push_back(store_->block_numel(l));
    for (const auto& item : model->block(l).named_parameters(true)) {
      torch::Tensor p = item.value();
      {
        torch::NoGradGuard no_grad;
        store_->set_param(l, item.key(), p.detach().to(torch::kCPU, torch::kFloat));
      }
      const auto views = store_->param(l, item.key());
      impl_->params[l].push_back({p, views.offset, p.numel(), p.sizes().vec()});
      p.set_data(torch::empty({0}, empty));
    }
  }
  streamer_ = std::make_unique<WeightStreamer>(numels, WeightStreamerOptions{options_.device, dt, options_.mode});

  impl_->resident = model->resident_parameters();
  for (const auto& p : impl_->resident) {
    TORCH_CHECK(p.device() == options_.device && p.scalar_type() == at::kFloat,
                "StreamedStackTrainer: resident parameters must be fp32 on ", options_.device, ", got one ",
                p.scalar_type(), " on ", p.device());
  }
  const auto& a = options_.adamw;
  if (!impl_->resident.empty()) {
    impl_->resident_optimizer = std::make_unique<torch::optim::AdamW>(
        impl_->resident,
        torch::optim::AdamWOptions(a.lr).betas({a.beta1, a.beta2}).eps(a.eps).weight_decay(a.weight_decay));
  }
  impl_->adamw = std::make_unique<CpuAdamW>(a, options_.optimizer_threads);
  impl_->tasks = std::make_unique<detail::HostTaskQueue>(options_.mode == StreamMode::kSync);
  impl_->pending_update.resize(L);
  impl_->norm_done.resize(L);
  impl_->block_sq.assign(L, 0.0);
  impl_->block_norm.resize(L);
  if (options_.grad_accum_steps > 1) {
    int64_t largest = 0;
    for (auto n : numels) largest = std::max(largest, n);
    bool pin = false;
#ifdef MEGASLIDE_WITH_CUDA
    pin = options_.device.is_cuda() && options_.pin_host_memory;
#endif
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
  for (const auto& p : store_->block_spec(block).params) out.emplace_back(p.name, store_->param(block, p.name).master);
  return out;
}

void StreamedStackTrainer::set_trace(StepTrace* trace) {
  impl_->trace = trace;
  streamer_->set_trace(trace);
}

void StreamedStackTrainer::synchronize() {
  impl_->tasks->drain();
  for (auto& f : impl_->pending_update)
    if (f.valid()) f.get();  // rethrows a failed update
  streamer_->synchronize();
}

StackStepResult StreamedStackTrainer::step(const Prologue& prologue, const Epilogue& epilogue, double lr) {
  const auto start = Clock::now();
  Impl& im = *impl_;
  const int64_t L = streamer_->num_blocks();
  const int64_t accum = options_.grad_accum_steps;
  const bool deferred = deferred_updates();
  const auto dt = options_.compute_dtype;
  const auto empty = torch::TensorOptions().dtype(dt).device(options_.device);
  const bool fp32_compute = dt == at::kFloat;
  StepTrace* trace = im.trace;
  if (trace != nullptr) streamer_->set_trace(trace);
  streamer_->reset_stats();
  im.optimizer_wait_s = 0.0;
  im.activation_bytes_peak = 0;
#ifdef MEGASLIDE_WITH_CUDA
  if (options_.device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(options_.device.index());
#endif
  if (im.resident_optimizer) im.resident_optimizer->zero_grad();
  const double scale = loss_scale_;
  const int64_t adam_step = adam_steps_ + 1;  // the step number this update would take

  // Uploads block l (after its pending host update, which rewrites its compute copy).
  const auto prefetch = [&](int64_t l) {
    auto& pending = im.pending_update[l];
    if (pending.valid()) {
      const auto wait = Clock::now();
      pending.get();
      im.optimizer_wait_s += seconds_since(wait);
      pending = {};
    }
    streamer_->prefetch(l, fp32_compute ? store_->master(l) : store_->compute(l));
  };
  // A CpuAdamW update of block l on the host task thread; `grad_scale` unscales and clips.
  // `guard` (immediate updates, which start before the global norm is known): a block whose gradient
  // holds a non-finite value is not updated, nor is any block after it in this step.
  const auto submit_update = [&](int64_t l, float grad_scale, bool guard) {
    streamer_->invalidate(l);
    im.pending_update[l] = im.tasks->submit([this, l, grad_scale, lr, adam_step, trace, guard] {
      if (guard) {
        if (impl_->nonfinite_step.load() == adam_step) return;
        if (!all_finite(store_->grad(l))) {
          impl_->nonfinite_step.store(adam_step);
          return;
        }
      }
      const double t0 = trace != nullptr ? trace->now_s() : 0.0;
      const auto begin = Clock::now();
      AdamWBlockState s;
      s.master = store_->master(l).data_ptr<float>();
      s.exp_avg = store_->exp_avg(l).data_ptr<float>();
      s.exp_avg_sq = store_->exp_avg_sq(l).data_ptr<float>();
      s.grad = store_->grad(l).data_ptr();
      s.grad_dtype = store_->grad(l).scalar_type();
      s.compute = options_.compute_dtype == at::kFloat ? nullptr : store_->compute(l).data_ptr();
      s.compute_dtype = store_->options().compute_dtype;
      s.numel = store_->block_numel(l);
      impl_->adamw->step_block(s, adam_step, lr, grad_scale);
      impl_->optimizer_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - begin).count();
      if (trace != nullptr) trace->add(TraceLane::kOptimizer, "adamw block " + std::to_string(l), t0, trace->now_s() - t0);
    });
  };

  double loss_sum = 0.0;
  for (int64_t k = 0; k < accum; ++k) {
    const bool last = k == accum - 1;
    NvtxRange micro_range("micro-batch " + std::to_string(k));
    int span = streamer_->begin_span(TraceLane::kCompute, "prologue");
    StackInput in = prologue();
    streamer_->end_span(span);
    TORCH_CHECK(in.hidden.defined() && in.hidden.is_floating_point(),
                "StreamedStackTrainer: the prologue must return a floating hidden tensor");
    // Leaves the blocks read: gradients from every block sum in their .grad.
    BlockInputs leaves;
    leaves.info = in.inputs.info;
    std::vector<size_t> differentiable;
    for (size_t i = 0; i < in.inputs.tensors.size(); ++i) {
      const auto& t = in.inputs.tensors[i];
      if (t.defined() && t.is_floating_point()) {
        auto leaf = t.detach().to(dt);
        if (t.requires_grad()) {
          leaf.requires_grad_(true);
          differentiable.push_back(i);
        }
        leaves.tensors.push_back(leaf);
      } else {
        leaves.tensors.push_back(t);
      }
    }

    // Forward without grad, keeping only each block's input.
    std::vector<torch::Tensor> saved(L);
    torch::Tensor x = in.hidden.detach().to(dt);
    {
      NvtxRange range("forward");
      torch::NoGradGuard no_grad;
      prefetch(0);
      int64_t kept_bytes = 0;
      for (int64_t l = 0; l < L; ++l) {
        NvtxRange block_range("forward block " + std::to_string(l));
        auto weights = streamer_->acquire(l);
        im.bind(l, weights, {});
        span = streamer_->begin_span(TraceLane::kCompute, "forward block " + std::to_string(l));
        saved[l] = x;
        kept_bytes += static_cast<int64_t>(x.nbytes());
        x = im.model->forward_block(l, x, leaves);
        streamer_->end_span(span);
        im.unbind(l, empty);
        streamer_->release(l);
        if (l + 1 < L) prefetch(l + 1);
      }
      im.activation_bytes_peak = std::max<int64_t>(im.activation_bytes_peak, kept_bytes + static_cast<int64_t>(x.nbytes()));
    }

    // Epilogue and loss.
    span = streamer_->begin_span(TraceLane::kCompute, "epilogue");
    auto last_hidden = x.to(in.hidden.scalar_type()).detach().requires_grad_(true);
    torch::Tensor loss = epilogue(last_hidden);
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "StreamedStackTrainer: the epilogue must return a scalar loss");
    torch::Tensor objective = loss;
    if (scale != 1.0) objective = loss * (scale / static_cast<double>(accum));
    else if (accum > 1) objective = loss / static_cast<double>(accum);
    objective.backward({}, /*retain_graph=*/true);
    streamer_->end_span(span);
    TORCH_CHECK(last_hidden.grad().defined(), "StreamedStackTrainer: the loss does not depend on the last block's output");
    torch::Tensor grad = last_hidden.grad().to(dt);

    // Backward, last block first: recompute, backward into the slot, gradient to the host.
    {
      NvtxRange range("backward");
      for (int64_t l = L - 1; l >= 0; --l) {
        NvtxRange block_range("backward block " + std::to_string(l));
        if (l == L - 1) prefetch(l);  // a cache hit: the forward just used it
        auto weights = streamer_->acquire(l);
        auto grads = streamer_->gradient_buffer(l);
        im.bind(l, weights, grads);
        span = streamer_->begin_span(TraceLane::kCompute, "backward block " + std::to_string(l));
        auto input = saved[l].detach().requires_grad_(true);
        {
          torch::AutoGradMode grad_mode(true);
          auto y = im.model->forward_block(l, input, leaves);
          torch::autograd::backward({y}, {grad});
        }
        streamer_->end_span(span);
        grad = input.grad();
        TORCH_CHECK(grad.defined(), "StreamedStackTrainer: block ", l, "'s output does not depend on its input");
        saved[l] = torch::Tensor();
        im.unbind(l, empty);

        const int64_t slot = WeightStreamer::slot_of(l);
        GradCopy copy;
        if (accum > 1) {
          if (im.staging_free[slot].valid()) im.staging_free[slot].get();  // the previous add has read it
          copy = streamer_->offload_gradient(l, im.staging[slot].narrow(0, 0, store_->block_numel(l)));
          im.staging_free[slot] = im.tasks->submit([this, l, slot, k, copy, last] {
            copy.wait();
            auto src = impl_->staging[slot].narrow(0, 0, store_->block_numel(l));
            const double sq = accumulate(store_->grad(l), src, k == 0, last, options_.optimizer_threads);
            if (last) impl_->block_sq[l] = sq;
          });
          if (last) im.norm_done[l] = im.staging_free[slot];
        } else {
          // The norm on the device, from the slot, before the copy (the compute thread's own ops).
          if (last) im.block_norm[l] = at::linalg_vector_norm(grads, 2, {}, false, at::kFloat);
          copy = streamer_->offload_gradient(l, store_->grad(l));
        }
        streamer_->release(l);
        if (l > 0) prefetch(l - 1);
        if (last && !deferred) submit_update(l, 1.f, /*guard=*/true);
      }
    }

    // Prologue backward: the first block's input gradient and every block's gradient of the inputs.
    span = streamer_->begin_span(TraceLane::kCompute, "prologue backward");
    std::vector<torch::Tensor> roots{in.hidden}, root_grads{grad.to(in.hidden.scalar_type())};
    for (size_t i : differentiable) {
      const auto& g = leaves.tensors[i].grad();
      if (!g.defined()) continue;
      roots.push_back(in.inputs.tensors[i]);
      root_grads.push_back(g.to(in.inputs.tensors[i].scalar_type()));
    }
    if (in.hidden.requires_grad()) torch::autograd::backward(roots, root_grads);
    streamer_->end_span(span);
    loss_sum += loss.item<double>();
  }

  // The global norm: blocks from the host tasks, resident parameters on the device.
  double sq = 0.0;
  if (accum > 1) {
    for (auto& f : im.norm_done) f.get();
    for (double b : im.block_sq) sq += b;
  } else {
    const auto norms = torch::stack(im.block_norm).to(torch::kCPU, torch::kDouble);
    sq = norms.square().sum().item<double>();
  }
  sq /= scale * scale;
  for (auto& p : im.resident) {
    if (!p.grad().defined()) continue;
    if (scale != 1.0) p.mutable_grad().mul_(1.0 / scale);
    sq += std::pow(p.grad().norm().item<double>(), 2);
  }
  StackStepResult r;
  r.grad_norm = std::sqrt(sq);
  r.loss_scale = scale;
  if (deferred) {
    const bool overflow = !std::isfinite(r.grad_norm);
    if (dt == at::kHalf) {
      if (overflow) {
        loss_scale_ = std::max(1.0, loss_scale_ / 2);
        clean_steps_ = 0;
      } else if (++clean_steps_ >= options_.loss_scale_window) {
        loss_scale_ *= 2;
        clean_steps_ = 0;
      }
    }
    r.skipped = overflow;
    if (!r.skipped) {
      float coef = 1.f;
      if (options_.grad_clip > 0) {
        coef = std::min(1.f, static_cast<float>(options_.grad_clip) / (static_cast<float>(r.grad_norm) + 1e-6f));
      }
      if (coef < 1.f) {
        for (auto& p : im.resident)
          if (p.grad().defined()) p.mutable_grad().mul_(coef);
      }
      for (int64_t l = 0; l < L; ++l) submit_update(l, static_cast<float>(coef / scale), /*guard=*/false);
    }
  }
  if (!deferred) r.skipped = !std::isfinite(r.grad_norm);  // the host tasks skip the blocks themselves
  if (!r.skipped) {
    if (im.resident_optimizer) {
      for (auto& group : im.resident_optimizer->param_groups())
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      im.resident_optimizer->step();
    }
    ++adam_steps_;
  }
  if (options_.mode == StreamMode::kSync) synchronize();
  else streamer_->synchronize();

  const auto& st = streamer_->stats();
  r.loss = loss_sum / static_cast<double>(accum);
  r.h2d_bytes = st.h2d_bytes;
  r.d2h_bytes = st.d2h_bytes;
  r.exposed_transfer_s = st.exposed_transfer_s;
  r.optimizer_wait_s = im.optimizer_wait_s;
  r.optimizer_s = static_cast<double>(im.optimizer_ns.exchange(0)) * 1e-9;
#ifdef MEGASLIDE_WITH_CUDA
  if (options_.device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(options_.device.index());
    r.peak_device_bytes = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  if (!options_.device.is_cuda()) {
    int64_t resident_bytes = 0;
    for (const auto& p : im.resident) resident_bytes += 4 * static_cast<int64_t>(p.nbytes());  // weights, gradient, m, v
    r.peak_device_bytes = streamer_->device_weight_bytes() + streamer_->device_gradient_bytes() + resident_bytes +
                          im.activation_bytes_peak;
  }
  if (trace != nullptr) {
    streamer_->resolve_trace();
    set_trace(nullptr);
  }
  r.step_time_s = seconds_since(start);
  return r;
}

HostParamStoreOptions host_store_options(c10::ScalarType compute_dtype, int64_t grad_accum_steps) {
  HostParamStoreOptions o;
  o.compute_dtype = compute_dtype == at::kHalf ? at::kHalf : at::kBFloat16;  // fp32 compute streams the master
  o.grad_dtype = grad_accum_steps > 1 ? at::kFloat : compute_dtype;
  return o;
}

void StreamedStackTrainer::restore_counters(int64_t optimizer_steps, double loss_scale, int64_t clean_steps) {
  TORCH_CHECK(optimizer_steps >= 0 && clean_steps >= 0 && loss_scale > 0, "restore_counters: invalid counters");
  adam_steps_ = optimizer_steps;
  loss_scale_ = loss_scale;
  clean_steps_ = clean_steps;
}

torch::optim::AdamW* StreamedStackTrainer::resident_optimizer() { return impl_->resident_optimizer.get(); }

void StreamedStackTrainer::reload_blocks_from_masters() {
  synchronize();
  for (int64_t l = 0; l < store_->num_blocks(); ++l) {
    if (options_.compute_dtype != at::kFloat) store_->compute(l).copy_(store_->master(l));  // round to nearest even
    streamer_->invalidate(l);
  }
}

}  // namespace megaslide::offload
