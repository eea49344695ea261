#include "megaslide/train/trainer.h"

#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>

#include "attention/dsa3d_params.h"
#include "megaslide/diffusion/ddpm.h"
#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"
#include "megaslide/model/lora.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/offload/step_trace.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/distributed.h"
#include "megaslide/train/streamed_state.h"
#include "megaslide/train/weights_ema.h"
#include "megaslide/util/device.h"
#include "megaslide/util/errors.h"
#include "megaslide/util/numbers.h"

namespace megaslide {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// CpuAdamW's options from the run's train section (the learning rate is only its default).
offload::AdamWOptions adamw_options(const TrainConfig& t) {
  return offload::AdamWOptions{t.lr, t.beta1, t.beta2, t.eps, t.weight_decay};
}

// The streamed engine's options from a run config: one mapping for every family, so a new setting
// reaches all of them. The config's `auto` values are resolved (compute dtype, threads).
offload::StackTrainerOptions engine_options(const RunConfig& c, torch::Device device) {
  offload::StackTrainerOptions o;
  o.device = device;
  o.compute_dtype = offload::parse_compute_dtype(c.offload.compute_dtype);
  o.mode = offload::parse_stream_mode(c.offload.mode);
  o.adamw = adamw_options(c.train);
  o.optimizer_threads = plan_threads(c, device).optimizer;
  o.emulated_copy_delay_ms = c.offload.emulated_copy_delay_ms;
  o.state_dtype = offload::parse_state_dtype(c.optimizer.state_dtype);
  o.grad_clip = c.train.grad_clip;
  o.grad_accum_steps = c.train.grad_accum_steps;
  o.loss_scale_init = c.train.loss_scale_init;
  o.loss_scale_window = c.train.loss_scale_window;
  o.ema_decay = c.train.ema_decay;
  o.state_tier = offload::parse_state_tier(c.offload.state_tier);
  o.nvme_dir = c.offload.nvme_dir;
  o.nvme_blocks_in_flight = c.offload.nvme_blocks_in_flight;
  o.host_activations = c.offload.activations == "host";
  o.frozen_blocks = c.lora.rank > 0;  // LoRA: the family's blocks frozen, streamed H2D only
  if (c.lora.base_dtype == "fp8") o.frozen_dtype = at::kFloat8_e4m3fn;
  return o;
}

std::vector<at::Tensor> tensors_of(const io::NamedTensors& named) {
  std::vector<at::Tensor> out;
  out.reserve(named.size());
  for (const auto& [name, p] : named) out.push_back(p);
  return out;
}

}  // namespace

std::optional<bool> holds_lora_adapters(const std::string& path) {
  std::string file = path;
  try {
    if (io::is_directory(path) || is_checkpoint_pointer(path))  // a run, its checkpoint, its `latest` file
      file = io::join_path(find_checkpoint(path), "master.safetensors");
    for (const auto& e : io::read_safetensors_header(file).entries) {
      const std::string down = ".lora_down.weight";  // ComfyUI's and musubi's name of lora_A
      if (!lora_base_weight(e.name).empty() ||
          (e.name.size() > down.size() && e.name.compare(e.name.size() - down.size(), down.size(), down) == 0))
        return true;
    }
    return false;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

at::Tensor context_parallel_loss(const at::Tensor& prediction, const at::Tensor& target, const at::Tensor& loss_mask,
                                 const ops::ContextShard& cp, int64_t patch_frames, const at::Tensor& sample_weights) {
  if (!cp.active() && !loss_mask.defined() && !sample_weights.defined()) return diffusion_loss(prediction, target);
  const int64_t frames = prediction.size(2), first_frame = cp.begin() * patch_frames;
  const double ranks = cp.active() ? static_cast<double>(cp.split.ranks) : 1.0;
  TORCH_CHECK(prediction.dim() == 5 && target.dim() == 5 && first_frame >= 0 && first_frame + frames <= target.size(2),
              "context_parallel_loss: frames [", first_frame, ", ", first_frame + frames, ") of a target ",
              target.sizes());
  const auto mine = target.narrow(2, first_frame, frames).to(at::kFloat);
  const auto squared = (prediction.to(at::kFloat) - mine).square();
  TORCH_CHECK(!sample_weights.defined() || sample_weights.numel() == target.size(0),
              "context_parallel_loss: ", sample_weights.numel(), " sample weights for a batch of ", target.size(0));
  const auto weighed = [&](const at::Tensor& per_sample) {  // [B] -> [B], each sample's times its weight
    return sample_weights.defined() ? per_sample * sample_weights.to(per_sample.device(), at::kFloat) : per_sample;
  };
  if (!loss_mask.defined()) {  // the mean squared error's share: this rank's sum over the whole video's count
    if (!sample_weights.defined()) return squared.sum() * (ranks / static_cast<double>(target.numel()));
    return weighed(squared.flatten(1).sum(1)).sum() * (ranks / static_cast<double>(target.numel()));
  }
  // Each sample's kept elements (of this rank) over the sample's whole kept count.
  const auto weights = loss_mask.to(at::kFloat);
  const auto count = weights.expand_as(target).flatten(1).sum(1);  // [B]
  const auto part = weighed((squared * weights.narrow(2, first_frame, frames)).flatten(1).sum(1) / count);
  return cp.active() ? part.mean() * ranks : part.mean();
}

double learning_rate(const TrainConfig& t, int64_t step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  if (t.lr_schedule == "constant") return t.lr;
  const int64_t decay_steps = std::max<int64_t>(t.steps - t.warmup_steps - 1, 1);
  const double progress = std::min(1.0, static_cast<double>(step - t.warmup_steps) / static_cast<double>(decay_steps));
  const double min_lr = t.lr * t.min_lr_ratio;
  return min_lr + 0.5 * (t.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

double measure_peak_tflops(torch::Device device) {
  TORCH_CHECK(device.is_cuda(), "measure_peak_tflops: needs a CUDA device, got ", device);
  const int64_t n = 8192;
  auto a = torch::randn({n, n}, torch::TensorOptions().dtype(torch::kBFloat16).device(device));
  auto b = torch::randn({n, n}, a.options());
  for (int i = 0; i < 3; ++i) torch::mm(a, b);
  torch::cuda::synchronize();
  const int iters = 20;
  const auto start = Clock::now();
  for (int i = 0; i < iters; ++i) torch::mm(a, b);
  torch::cuda::synchronize();
  return 2.0 * n * n * n * iters / seconds_since(start) / 1e12;
}

Trainer::Trainer(const TrainerRequest& request)
    : config_(*request.config),
      requested_compute_dtype_(
          (request.requested != nullptr ? *request.requested : *request.config).offload.compute_dtype),
      device_(resolve_device(request.config->train.device)),
      communicator_(request.communicator) {
  validate(config_, request.source);
  const auto threads = plan_threads(config_, device_);
  apply_threads(threads);
  const auto& t = config_.train;

  ModelRequest m;
  m.config = &config_;
  m.requested = request.requested != nullptr ? request.requested : &config_;
  m.source = request.source;
  m.device = device_;
  m.streamed = config_.offload.enabled;
  m.validation = request.validation;
  m.validation_data = request.validation_data;
  const int64_t world = communicator_ != nullptr ? communicator_->world_size() : 1;
  const int64_t cp = config_.distributed.context_parallel;
  if (cp > 1) {
    const auto shape = model_sample_shape(model_family(config_.model.arch).sample_config(config_));
    const int64_t pt = config_.model.arch == Architecture::kWan ? config_.model.wan.patch[0] : config_.model.patch[0];
    if (const std::string problem = context_parallel_problem(config_, world, shape[1] / pt); !problem.empty())
      throw ConfigError(request.source, "distributed.context_parallel", problem);
    // Every bucket's samples are shared too: each needs a token frame for every rank of the group.
    for (const auto& b : config_.data.buckets)
      if (const auto at = model_sample_shape_at(config_, {b[0], b[1], b[2]}); at[1] / pt < cp)
        throw ConfigError(request.source, "distributed.context_parallel",
                          fmt::format("{} ranks cannot share a sample of the bucket [{}, {}, {}]: its {} token frames "
                                      "are fewer (each rank needs one)",
                                      cp, b[0], b[1], b[2], at[1] / pt));
    context_group_ = std::make_unique<CommunicatorFrames>(*communicator_, communicator_->rank() / cp * cp, cp);
    m.context_group = context_group_.get();
  }
  if (request.init_from)
    m.init_from = [this](const ParameterShapes& shapes, const std::vector<std::string>& may_stay_initial) {
      auto allow = config_.train.init_allow_missing;
      allow.insert(allow.end(), may_stay_initial.begin(), may_stay_initial.end());
      init_plan_ = plan_init_from(config_.train.init_from, shapes, allow);
      return init_plan_;
    };
  const auto make_model = [&] {
    if (config_.lora.rank > 0) {
      // The family's model as for full fine-tuning, then frozen. train.init_from starts the adapters when it
      // holds adapters, else the frozen model (the DiT family's pretrained weights, a full fine-tune of Wan).
      ModelRequest base = m, adapters = m;
      // Unreadable: the adapters' reader names what is wrong on a fresh run; a resumed run reads only the frozen model
      // from it, so there it is refused here (it went on with a random frozen model).
      const std::optional<bool> holds_adapters =
          m.init_from ? holds_lora_adapters(config_.train.init_from) : std::optional<bool>(false);
      if (!holds_adapters && request.resuming)
        throw InitFromError("train.init_from '" + config_.train.init_from +
                            "' cannot be read: a resumed LoRA run takes its frozen model from it (its checkpoint holds "
                            "the adapters alone)");
      if (holds_adapters.value_or(true)) base.init_from = nullptr;
      else adapters.init_from = nullptr;
      if (request.resuming) adapters.init_from = nullptr;  // the checkpoint's adapters
      model_ = with_lora(model_family(config_.model.arch).make_model(base), adapters);
    } else {
      model_ = model_family(config_.model.arch).make_model(m);
    }
  };
  // The ranks build their models side by side, each as long as it takes (rank 0 also prepares the validation with
  // its encoders; a rank's disk may be slower): what follows (the block exchange, the first collectives) waits for
  // the others with their timeout only once every rank has its model (Communicator::run_on_every_rank).
  if (communicator_ != nullptr) communicator_->run_on_every_rank("building the model", make_model);
  else make_model();
  parts_ = model_->parts();
  part_steps_.assign(parts_.size(), 0);

  const bool shard = communicator_ != nullptr && communicator_->world_size() > 1;
  if (shard && world / cp > 1) model_->take_slice(communicator_->rank() / cp, world / cp);
  if (config_.offload.enabled) {
    auto options = engine_options(config_, device_);
    if (shard) options.exchange = communicator_->shard_exchange();  // collective
    engine_ = std::make_unique<offload::StreamedStackTrainer>(model_->stack(), options);
    model_->blocks_built();
  } else {
    const auto params = model_->named_parameters();
    params_ = tensors_of(params);
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        params_, torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(t.eps).weight_decay(t.weight_decay));
    // On the CPU the compute is idle while the optimizer runs: it takes the intra-op threads' cores.
    if (device_.is_cpu()) host_adamw_ = std::make_unique<offload::CpuAdamW>(adamw_options(t), threads.intra_op);
    ema_ = std::make_unique<WeightsEma>(t.ema_decay, params);
  }
  if (device_.is_cuda()) {
    // The family counts the global batch; this rank computes its 1/R of it (MFU is per GPU).
    flops_per_step_ = model_->flops_per_step() / static_cast<double>(communicator_ ? communicator_->world_size() : 1);
    peak_flops_ = (t.peak_tflops > 0 ? t.peak_tflops : measure_peak_tflops(device_)) * 1e12;
  }
}

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

int64_t Trainer::parameter_count() const {
  if (engine_ && engine_->options().frozen_blocks) return engine_->resident_parameter_count();
  if (engine_) return engine_->streamed_parameter_count() + engine_->resident_parameter_count();
  int64_t n = 0;
  for (const auto& p : params_) n += p.numel();
  return n;
}

bool Trainer::sharded() const { return engine_ && engine_->store().sharded(); }

void Trainer::synchronize() {
  if (engine_) engine_->synchronize();
}

void Trainer::trace_next_step(const std::string& path) {
  if (engine_) trace_path_ = path;
}

int64_t Trainer::persistent_device_bytes() {
  // The parameters LibTorch's AdamW updates on the device (resident: all; streamed: those outside the blocks)
  // with its two moments (and their EMA); streamed, the weight and gradient slots besides.
  int64_t trained = 0;
  if (const auto* optimizer = engine_ ? engine_->resident_optimizer() : optimizer_.get())
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params()) trained += static_cast<int64_t>(p.nbytes());
  const bool ema = engine_ ? engine_->has_ema() : ema_->enabled();
  const int64_t slots =
      engine_ ? engine_->streamer().device_weight_bytes() + engine_->streamer().device_gradient_bytes() : 0;
  return slots + (ema ? 4 : 3) * trained;
}

StepMetrics Trainer::step() {
  const auto& t = config_.train;
  const double lr = learning_rate(t, steps_done_);
  MicroBatchStats stats;  // summed over the micro-batches: their bucket's tokens, not the largest
  const ModelPart* part = nullptr;
  size_t part_index = 0;
  if (!parts_.empty()) {
    part_index = model_->begin_step();
    TORCH_CHECK(part_index < parts_.size(), "Trainer: the family picked part ", part_index, " of ", parts_.size());
    part = &parts_[part_index];
  }
  const int64_t adam_step = (part ? part_steps_[part_index] : optimizer_steps_) + 1;
  StepMetrics m = engine_ ? streamed_step(lr, stats, part, adam_step) : resident_step(lr, stats, part, adam_step);
  if (!m.skipped) {
    ++optimizer_steps_;
    if (part) ++part_steps_[part_index];
  }
  if (part) m.part = part->name;
  m.step = ++steps_done_;
  m.lr = lr;
  m.data_wait_s = stats.data_wait_s;
  if (m.skipped) {
    ++skipped_total_;
    ++consecutive_skips_;
  } else {
    consecutive_skips_ = 0;
  }
  m.skipped_total = skipped_total_;
  m.consecutive_skips = consecutive_skips_;
  m.samples_per_s = static_cast<double>(t.batch_size * t.grad_accum_steps) / m.step_time_s;  // the global batch
  m.tokens_per_s = static_cast<double>(t.batch_size * stats.tokens) / m.step_time_s;
  // The model's FLOPs are counted at the largest sample; a smaller bucket's in proportion to its tokens
  // (exact for the projections and MLPs, which dominate; 3D-DSA is linear in tokens too).
  const double share =
      static_cast<double>(stats.tokens) / static_cast<double>(tokens_per_sample() * t.grad_accum_steps);
  if (peak_flops_ > 0) m.mfu = flops_per_step_ * share / (m.step_time_s * peak_flops_);
  return m;
}

StepMetrics Trainer::resident_step(double lr, MicroBatchStats& stats, const ModelPart* part, int64_t adam_step) {
  const auto start = Clock::now();
  const auto& t = config_.train;
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  optimizer_->zero_grad();
  const int64_t accum = t.grad_accum_steps;
  double loss_sum = 0.0;
  for (int64_t k = 0; k < accum; ++k) {
    const auto loss = model_->loss(stats);
    (accum == 1 ? loss : loss / static_cast<double>(accum)).backward();
    loss_sum += loss.item<double>();  // synchronises with the device, so the timing below is complete
  }
  // One rank with a communicator still runs the collective (the NCCL check on one GPU).
  int64_t exchanged = 0;
  double exchange_s = 0.0;
  if (communicator_ != nullptr) {
    const auto exchange_start = Clock::now();
    exchanged = average_gradients_over_ranks(*communicator_, params_, loss_sum, device_);
    exchange_s = seconds_since(exchange_start);
  }
  const auto optimizer_start = Clock::now();  // the device is idle here (item() above)
  const double max_norm = t.grad_clip > 0 ? t.grad_clip : std::numeric_limits<double>::infinity();
  const double grad_norm = torch::nn::utils::clip_grad_norm_(params_, max_norm);
  StepMetrics m;
  m.loss = loss_sum / static_cast<double>(accum);
  m.grad_norm = grad_norm;
  m.exchange_bytes = exchanged;
  m.exchange_s = exchange_s;
  m.skipped = !std::isfinite(m.loss) || !std::isfinite(grad_norm);
  if (!m.skipped) {
    // A parameter without a gradient (another part's) is left alone, its step count too.
    if (host_adamw_) offload::step_on_host(*optimizer_, *host_adamw_);
    else optimizer_->step();
    if (ema_->enabled()) ema_->update(model_->named_parameters(), adam_step, part ? part->prefix : std::string());
  }
  if (device_.is_cuda()) torch::cuda::synchronize();
  m.optimizer_s = seconds_since(optimizer_start);
  m.step_time_s = seconds_since(start);
  return m;
}

StepMetrics Trainer::streamed_step(double lr, MicroBatchStats& stats, const ModelPart* part, int64_t adam_step) {
  std::unique_ptr<offload::StepTrace> trace;
  // A step that throws leaves the trace with the host tasks and the NVMe tier's I/O thread: they finish, and let
  // it go, before it is freed (declared after `trace`, so destroyed first).
  struct Detach {
    offload::StreamedStackTrainer& engine;
    bool attached = false;
    ~Detach() {
      if (!attached) return;
      try {
        engine.synchronize();
      } catch (...) {  // the step's own exception is on its way
      }
      engine.set_trace(nullptr);
    }
  } detach{*engine_};
  if (!trace_path_.empty()) {
    trace = std::make_unique<offload::StepTrace>();
    engine_->set_trace(trace.get());
    detach.attached = true;
  }
  offload::StepBlocks blocks;
  if (part) blocks = {part->first_block, part->end_block, adam_step};
  const auto r =
      engine_->step([&] { return model_->prologue(stats); },
                    [&](const at::Tensor& last_hidden) { return model_->epilogue(last_hidden); }, lr, blocks);
  if (trace) {
    engine_->synchronize();  // the step's host updates are in the trace
    engine_->set_trace(nullptr);
    detach.attached = false;
    trace->write(trace_path_);
    trace_path_.clear();
  }
  StepMetrics m;
  m.loss = r.loss;
  m.grad_norm = r.grad_norm;
  m.skipped = r.skipped;
  m.step_time_s = r.step_time_s;
  m.exchange_bytes = r.exchange_bytes;
  m.exchange_s = r.exchange_s;
  m.h2d_bytes = r.h2d_bytes;
  m.d2h_bytes = r.d2h_bytes;
  m.exposed_transfer_s = r.exposed_transfer_s;
  m.optimizer_wait_s = r.optimizer_wait_s;
  m.optimizer_s = r.optimizer_s;
  m.peak_device_bytes = r.peak_device_bytes;
  m.nvme = engine_->store().paged();
  m.nvme_read_bytes = r.nvme_read_bytes;
  m.nvme_write_bytes = r.nvme_write_bytes;
  m.nvme_read_s = r.nvme_read_s;
  m.nvme_write_s = r.nvme_write_s;
  m.nvme_wait_s = r.nvme_wait_s;
  m.loss_scale = engine_->options().compute_dtype == at::kHalf ? r.loss_scale : 0.0;
  return m;
}

std::map<std::string, at::Tensor> Trainer::block_views() const {
  std::map<std::string, at::Tensor> out;
  const auto& store = engine_->store();
  if (store.options().frozen) return out;  // LoRA's base: not trained, not the run's weights
  for (int64_t l = 0; l < store.num_blocks(); ++l)
    for (const auto& spec : store.block_spec(l).params) {
      const auto views = store.param(l, spec.name);
      // Sharded or on the NVMe tier no whole master is in memory: the compute copy.
      out.emplace(model_->block_name(l) + "." + spec.name,
                  store.sharded() || store.paged() ? views.compute : views.master);
    }
  return out;
}

io::NamedTensors Trainer::resident_parameters() {
  const auto blocks = block_views();
  io::NamedTensors out;
  for (auto& [name, p] : model_->named_parameters())
    if (!blocks.count(name)) out.emplace_back(name, p);
  return out;
}

io::NamedTensors Trainer::weight_views() {
  synchronize();
  const auto blocks = engine_ ? block_views() : std::map<std::string, at::Tensor>();
  auto out = model_->named_parameters();
  for (auto& [name, p] : out) {
    const auto it = blocks.find(name);
    p = it != blocks.end() ? it->second : p.detach();
  }
  return out;
}

io::NamedTensors Trainer::merged_lora_weights(const io::NamedTensors& adapters, at::ScalarType dtype) {
  if (config_.lora.rank <= 0) throw std::logic_error("Trainer::merged_lora_weights: the run trains no LoRA");
  synchronize();
  // The frozen blocks' values as the host store keeps them (streamed), by name.
  std::map<std::string, at::Tensor> blocks;
  if (engine_) {
    const auto& store = engine_->store();
    for (int64_t l = 0; l < store.num_blocks(); ++l) {
      const auto& specs = store.block_spec(l).params;
      for (size_t i = 0; i < specs.size(); ++i) {
        const auto views = store.param(l, specs[i].name);
        blocks.emplace(model_->block_name(l) + "." + specs[i].name,
                       views.exact.defined() ? views.exact.clone()
                       : store.scales(l).defined()
                           ? dequantize_fp8({views.compute, store.scales(l)[static_cast<int64_t>(i)]}, at::kFloat)
                           : views.compute.to(at::kFloat));
      }
    }
  }
  const auto updates = lora_adapters_of(adapters, LoraOptions::from_config(config_.lora));  // by adapted weight
  io::NamedTensors out;
  size_t merged = 0;
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : model_->base().named_parameters()) {
    const auto it = blocks.find(name);
    at::Tensor w = it != blocks.end() ? it->second : p.detach().to(torch::kCPU, torch::kFloat32);
    const auto u = updates.find(name);
    if (u != updates.end()) {
      w = w + u->second.delta();
      ++merged;
    }
    out.emplace_back(name, w.to(dtype));
  }
  TORCH_CHECK(merged == updates.size(), "Trainer::merged_lora_weights: ", updates.size() - merged,
              " adapters adapt no weight of the model");
  return out;
}

io::NamedTensors Trainer::master_weights() {
  auto out = weight_views();
  for (auto& [name, p] : out) p = p.to(torch::kCPU, torch::kFloat32).clone();
  return out;
}

void Trainer::outside_steps(const std::function<void()>& work) {
  if (!engine_ || !engine_->store().paged()) return work();
  synchronize();
  const auto since = engine_->store().nvme_stats();
  try {
    work();
  } catch (...) {
    engine_->leave_out_of_step_figures(since);
    throw;
  }
  engine_->leave_out_of_step_figures(since);
}

TrainingState Trainer::training_state() {
  synchronize();
  TrainingState s;
  if (engine_) {
    s = streamed_training_state(*engine_, resident_parameters(), [this](int64_t l) { return model_->block_name(l); });
  } else {
    for (auto& [name, p] : model_->named_parameters()) {
      auto moments = adamw_moments(*optimizer_, p);
      s.master.emplace_back(name, p.detach().to(torch::kCPU, torch::kFloat32).clone());
      s.exp_avg.emplace_back(name, moments.exp_avg);
      s.exp_avg_sq.emplace_back(name, moments.exp_avg_sq);
    }
    ema_->save(s);
  }
  s.optimizer_steps = optimizer_steps_;
  s.part_steps = part_steps_;
  s.step = steps_done_;
  s.skipped_steps = skipped_total_;
  s.consecutive_skips = consecutive_skips_;
  s.data_state = model_->data_state();
  return s;
}

int64_t Trainer::adam_steps_of(const std::string& name, const TrainingState& s) const {
  for (size_t i = 0; i < parts_.size(); ++i)
    if (name.rfind(parts_[i].prefix, 0) == 0) return s.part_steps[i];
  return s.optimizer_steps;
}

void Trainer::load_training_state(const TrainingState& s) {
  synchronize();
  TORCH_CHECK(s.part_steps.size() == parts_.size(), "Trainer::load_training_state: the state counts the updates of ",
              s.part_steps.size(), " parts, the model trains ", parts_.size());
  model_->restore_data(s.data_state);
  if (engine_) {
    load_streamed_training_state(
        *engine_, resident_parameters(), s, "Trainer", [this](int64_t l) { return model_->block_name(l); },
        [this, &s](const std::string& name) { return adam_steps_of(name, s); });
  } else {
    const auto params = model_->named_parameters();
    TORCH_CHECK(
        s.master.size() == params.size() && s.exp_avg.size() == params.size() && s.exp_avg_sq.size() == params.size(),
        "Trainer::load_training_state: expected ", params.size(), " parameters, got ", s.master.size());
    std::map<std::string, size_t> index;  // by name: a streamed run's state lists the blocks last
    for (size_t i = 0; i < s.master.size(); ++i) index[s.master[i].first] = i;
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : params) {
      const auto it = index.find(name);
      TORCH_CHECK(it != index.end(), "Trainer::load_training_state: no state for parameter '", name, "'");
      const auto& value = s.master[it->second].second;
      TORCH_CHECK(value.sizes() == p.sizes(), "Trainer::load_training_state: '", name, "' is ", value.sizes(),
                  ", the model's is ", p.sizes());
      p.copy_(value);
      set_adamw_moments(*optimizer_, p, s.exp_avg[it->second].second, s.exp_avg_sq[it->second].second,
                        adam_steps_of(name, s));
    }
    ema_->load(s, params, "Trainer");
  }
  optimizer_steps_ = s.optimizer_steps;
  part_steps_ = s.part_steps;
  steps_done_ = s.step;
  skipped_total_ = s.skipped_steps;
  consecutive_skips_ = s.consecutive_skips;
}

void Trainer::describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const {
  const std::string family = model_family(config_.model.arch).name();
  const auto& t = config_.train;
  if (engine_) {
    info.push_back(
        fmt::format("trainer: {}, streamed CPU-master (offload.mode {}, compute {}, grad_accum_steps {}); host memory "
                    "at start:\n{}",
                    family, config_.offload.mode, config_.offload.compute_dtype, t.grad_accum_steps,
                    engine_->store().memory_report().to_string()));
    info.push_back(fmt::format("compute dtype {} ({})", config_.offload.compute_dtype,
                               resolve_compute_dtype(requested_compute_dtype_, device_).reason));
    if (const auto* file = engine_->store().nvme_file())
      info.push_back(fmt::format(
          "NVMe tier: state file {} (unlinked), {} I/O{}", file->path(), file->engine(),
          file->direct() ? ", O_DIRECT"
                         : ", buffered (the file system refused O_DIRECT: the page cache holds what is written, so "
                           "the state may stay in RAM)"));
    if (config_.offload.activations == "host")
      info.push_back(
          "activations: offload.activations host: each block's input checkpoint is copied to host memory in the "
          "forward and back for the backward (L - 1 buffers of one block's input, page-locked on a GPU, allocated "
          "at the first step: megaslide-plan's host_activation_bytes; not in the table above)");
    const std::string slow = compute_dtype_warning(config_.offload.compute_dtype, device_,
                                                   "set offload.compute_dtype: auto (fp32 on this CPU) to run faster");
    if (!slow.empty()) warnings.push_back(slow);
  } else {
    info.push_back(fmt::format(
        "trainer: {}, resident reference loop (offload.enabled: false), compute dtype fp32, grad_accum_steps {}",
        family, t.grad_accum_steps));
  }
  // The vector loops the host kernels run (CPUID picks them): CpuAdamW wherever it updates (every streamed run, the
  // resident loop on the CPU), the 3D-DSA row kernel where it runs on the CPU.
  std::string loops;
  if (engine_ || host_adamw_) loops = fmt::format("CpuAdamW {}", offload::to_string(offload::CpuAdamW::detect()));
  if (uses_dsa3d(config_.model) && device_.is_cpu()) {
    // bf16 inputs only where the streamed trainer computes in bf16.
    const bool bf16 = engine_ && config_.offload.compute_dtype == "bf16";
    const auto isa =
        ops::detail::dsa3d_cpu_loops(bf16 ? ops::detail::DsaDtype::kBFloat16 : ops::detail::DsaDtype::kFloat32);
    loops += fmt::format("{}3D-DSA {}", loops.empty() ? "" : ", ", ops::detail::to_string(isa));
  }
  if (!loops.empty()) info.push_back("CPU vector loops in use: " + loops);
  if (t.val_every > 0) {
    std::string data;
    for (const auto& o : t.val_data) data += (data.empty() ? "" : ", ") + o;
    info.push_back(fmt::format(
        "validation loss every {} steps and after the last: {} batches of {} of {}, drawn the same each time, no "
        "caption dropped",
        t.val_every, t.val_batches, t.batch_size,
        data.empty() ? std::string("the training data itself (not held out; train.val_data can name other data)")
                     : "the training data's config with " + data));
  }
  model_->describe(info, warnings);
}

Trainer make_trainer(const RunConfig& config, Communicator* communicator) {
  const RunConfig resolved = model_family(config.model.arch).resolve(resolve_auto_settings(config), "config");
  TrainerRequest request;
  request.config = &resolved;
  request.requested = &config;
  request.init_from = !resolved.train.init_from.empty();
  request.communicator = communicator;
  return Trainer(request);
}

}  // namespace megaslide
