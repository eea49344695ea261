#include "megaslide/train/cpu_master_trainer.h"

#include <chrono>
#include <map>
#include <cmath>
#include <thread>

#include "megaslide/train/auto_settings.h"
#include "megaslide/train/distributed.h"
#include "megaslide/train/streamed_state.h"
#include "offload/engine_options.h"

namespace megaslide {

torch::Tensor DiTStack::forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) {
  TORCH_CHECK(inputs.tensors.size() == 3, "DiTStack: expected block inputs {t_mod, text, text_mask}");
  BlockContext ctx;
  ctx.grid = std::any_cast<TokenGrid>(inputs.info);
  ctx.t_mod = inputs.tensors[0];
  ctx.text = inputs.tensors[1];
  ctx.text_mask = inputs.tensors[2];
  return model_->blocks[index]->as<DiTBlockImpl>()->forward(x, ctx);
}

std::vector<std::pair<std::string, torch::Tensor>> DiTStack::named_resident_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model_->named_parameters(true))
    if (item.key().rfind("blocks.", 0) != 0) out.emplace_back(item.key(), item.value());
  if (text_encoder_)
    for (const auto& item : text_encoder_->named_parameters(true)) out.emplace_back("text_encoder." + item.key(), item.value());
  return out;
}

std::shared_ptr<torch::nn::Module> DiTStack::initial_block(int64_t index) {
  const auto params = model_->blocks[index]->parameters();
  if (params.empty() || !params.front().is_meta()) return nullptr;
  return model_->initial_block(index, torch::kCPU).ptr();
}

void DiTStack::adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> block) {
  auto dit_block = std::dynamic_pointer_cast<DiTBlockImpl>(block);
  TORCH_CHECK(dit_block != nullptr, "DiTStack::adopt_block: block ", index, " is not a DiTBlock");
  model_->replace_block(index, DiTBlock(dit_block));
}

std::vector<torch::Tensor> DiTStack::resident_parameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : named_resident_parameters()) out.push_back(p);
  return out;
}

double model_flops_per_step(const RunConfig& config) {
  const auto count = count_dit_parameters(DiTOptions::from_config(config));
  const auto& m = config.model;
  const auto shape = model_sample_shape(config);
  const TokenGrid grid{shape[1] / m.patch[0], shape[2] / m.patch[1], shape[3] / m.patch[2]};
  const double N = static_cast<double>(grid.numel());
  const double B = static_cast<double>(config.train.batch_size * config.train.grad_accum_steps);
  double keys = N;  // dense
  if (m.arch == Architecture::kSwin) {
    keys = static_cast<double>(std::min(m.swin_window[0], grid.t) * std::min(m.swin_window[1], grid.h) *
                               std::min(m.swin_window[2], grid.w));
  } else if (m.arch == Architecture::kMegaSlide) {
    keys = static_cast<double>(std::min(m.dsa_kernel[0], grid.t) * std::min(m.dsa_kernel[1], grid.h) *
                               std::min(m.dsa_kernel[2], grid.w));
  }
  keys += static_cast<double>(config.data.max_text_tokens);  // cross-attention
  const double attention = 12.0 * static_cast<double>(m.layers) * B * N * keys * static_cast<double>(m.hidden);
  return 6.0 * static_cast<double>(count.total) * B * N + attention;
}

double measure_peak_tflops(torch::Device device) {
  TORCH_CHECK(device.is_cuda(), "measure_peak_tflops: needs a CUDA device, got ", device);
  const int64_t n = 8192;
  auto a = torch::randn({n, n}, torch::TensorOptions().dtype(torch::kBFloat16).device(device));
  auto b = torch::randn({n, n}, a.options());
  for (int i = 0; i < 3; ++i) torch::mm(a, b);
  torch::cuda::synchronize();
  const int iters = 20;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) torch::mm(a, b);
  torch::cuda::synchronize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 2.0 * n * n * n * iters / s / 1e12;
}

offload::StackTrainerOptions engine_options(const RunConfig& c, torch::Device device) {
  offload::StackTrainerOptions o;
  o.device = device;
  o.compute_dtype = offload::parse_compute_dtype(c.offload.compute_dtype);  // resolved by the caller
  o.mode = offload::parse_stream_mode(c.offload.mode);
  o.adamw = offload::AdamWOptions{c.train.lr, c.train.beta1, c.train.beta2, c.train.eps, c.train.weight_decay};
  o.optimizer_threads = plan_threads(c, device).optimizer;
  o.emulated_copy_delay_ms = c.offload.emulated_copy_delay_ms;
  o.state_dtype = offload::parse_state_dtype(c.optimizer.state_dtype);
  o.grad_clip = c.train.grad_clip;
  o.grad_accum_steps = c.train.grad_accum_steps;
  o.loss_scale_init = c.train.loss_scale_init;
  o.loss_scale_window = c.train.loss_scale_window;
  o.ema_decay = c.train.ema_decay;
  return o;
}

CPUMasterVideoDiT::CPUMasterVideoDiT(const RunConfig& config, Communicator* communicator)
    : config_(resolve_auto_settings(config)), device_(resolve_device(config.train.device)), batches_(config) {
  validate(config_, "CPUMasterVideoDiT");
  const bool shard = communicator != nullptr && communicator->world_size() > 1;
  if (shard) batches_.take_slice(communicator->rank(), communicator->world_size());
  apply_threads(plan_threads(config_, device_));
  // ResidentTrainer's initialisation without a full-model copy: the same seed and construction order,
  // the blocks a meta skeleton whose weights initial_block builds one at a time into the host store
  // (a block's weights depend only on the DiT's init seed and its index, dit.h).
  torch::manual_seed(config_.train.seed);
  DiT model(DiTOptions::from_config(config_).block_device(torch::kMeta));
  TextEncoder text_encoder{nullptr};  // CLIP (model.text_encoder.kind: clip) is frozen and lives in batches_.frozen()
  if (config_.model.text_encoder.kind == "builtin")
    text_encoder = TextEncoder(TextEncoderOptions(batches_.tokenizer().vocab_size(), config_.model.text_dim, config_.data.max_text_tokens));
  const auto shape = model_sample_shape(config_);
  grid_ = model->token_grid(shape[1], shape[2], shape[3]);
  // Resident parts to the device; the blocks' weights go to the host store inside the engine.
  model->move_non_block_parts(device_);
  if (text_encoder) text_encoder->to(device_);
  stack_ = std::make_shared<DiTStack>(model, text_encoder);
  auto options = engine_options(config_, device_);
  if (shard) options.exchange = communicator->shard_exchange();
  engine_ = std::make_unique<offload::StreamedStackTrainer>(stack_, options);
  if (device_.is_cuda()) {
    flops_per_step_ = model_flops_per_step(config_);
    peak_flops_ = (config_.train.peak_tflops > 0 ? config_.train.peak_tflops : measure_peak_tflops(device_)) * 1e12;
  }
}

int64_t CPUMasterVideoDiT::parameter_count() const {
  return engine_->streamed_parameter_count() + engine_->resident_parameter_count();
}

void CPUMasterVideoDiT::trace_next_step(const std::string& path) { trace_path_ = path; }

std::string CPUMasterVideoDiT::host_memory_report() const { return engine_->store().memory_report().to_string(); }

StepMetrics CPUMasterVideoDiT::step() {
  const auto& t = config_.train;
  const double lr = learning_rate(t, steps_done_);
  DiT& model = stack_->model();
  TextEncoder& text_encoder = stack_->text_encoder();
  torch::Tensor target, t_emb;
  TokenGrid grid;
  double data_wait_s = 0.0;
  int64_t tokens_per_sample = 0;  // summed over the micro-batches: their bucket's grid, not the largest
  auto prologue = [&] {
    auto b = batches_.next(device_);
    data_wait_s += b.data_wait_s;
    target = b.target;
    auto text = b.text.defined() ? b.text : text_encoder(b.text_ids);
    auto e = model->embed(b.xt, b.timesteps, text, b.text_mask);
    t_emb = e.t_emb;
    grid = e.ctx.grid;
    tokens_per_sample += grid.numel();
    offload::StackInput in;
    in.hidden = e.tokens;
    in.inputs.tensors = {e.ctx.t_mod, e.ctx.text, e.ctx.text_mask};
    in.inputs.info = e.ctx.grid;
    return in;
  };
  auto epilogue = [&](const torch::Tensor& last_hidden) {
    return diffusion_loss(model->head(last_hidden, t_emb, grid), target);
  };
  StepMetrics m = traced_engine_step(*engine_, trace_path_, [&] { return engine_->step(prologue, epilogue, lr); });
  m.step = ++steps_done_;
  m.lr = lr;
  m.data_wait_s = data_wait_s;
  m.samples_per_s = static_cast<double>(t.batch_size * t.grad_accum_steps) / m.step_time_s;  // the global batch
  m.tokens_per_s = static_cast<double>(t.batch_size * tokens_per_sample) / m.step_time_s;
  // The model's FLOPs are counted at the largest bucket; a smaller one's in proportion to its tokens
  // (exact for the projections and MLPs, which dominate; 3D-DSA is linear in tokens too).
  const double bucket_share = static_cast<double>(tokens_per_sample) / static_cast<double>(grid_.numel() * t.grad_accum_steps);
  if (peak_flops_ > 0) m.mfu = flops_per_step_ * bucket_share / (m.step_time_s * peak_flops_);
  count_skip(m, skipped_total_, consecutive_skips_);
  return m;
}

std::vector<std::pair<std::string, torch::Tensor>> CPUMasterVideoDiT::master_views() {
  engine_->synchronize();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& [name, p] : stack_->named_resident_parameters()) {
    if (name.rfind("text_encoder.", 0) != 0) out.emplace_back(name, p.detach());
  }
  const auto& store = engine_->store();
  for (int64_t l = 0; l < store.num_blocks(); ++l) {
    const std::string prefix = "blocks." + std::to_string(l) + ".";
    if (store.sharded()) {  // no whole master here: the compute copy (copy_ converts it)
      for (const auto& spec : store.block_spec(l).params) out.emplace_back(prefix + spec.name, store.param(l, spec.name).compute);
    } else {
      for (auto& [name, p] : engine_->block_master(l)) out.emplace_back(prefix + name, p);
    }
  }
  for (auto& [name, p] : stack_->named_resident_parameters()) {
    if (name.rfind("text_encoder.", 0) == 0) out.emplace_back(name, p.detach());
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> CPUMasterVideoDiT::master_weights() {
  auto out = master_views();
  for (auto& [name, p] : out) p = p.to(torch::kCPU).clone();
  return out;
}

void CPUMasterVideoDiT::copy_weights_to(DiT& dit, TextEncoder& text_encoder) {
  auto dit_params = dit->named_parameters();
  auto text_params = text_encoder ? text_encoder->named_parameters() : torch::OrderedDict<std::string, torch::Tensor>();
  torch::NoGradGuard no_grad;
  size_t copied = 0;
  for (auto& [name, master] : master_views()) {  // one tensor at a time: no copy of the whole model
    const bool is_text = name.rfind("text_encoder.", 0) == 0;
    const std::string key = is_text ? name.substr(13) : name;
    torch::Tensor* target = is_text ? text_params.find(key) : dit_params.find(key);  // no text_encoder.* with CLIP
    TORCH_CHECK(target != nullptr, "copy_weights_to: the target model has no parameter '", name,
                "' (was it built from this trainer's config?)");
    TORCH_CHECK(target->sizes() == master.sizes(), "copy_weights_to: '", name, "' is ", target->sizes(),
                " in the target model but ", master.sizes(), " in the trainer");
    target->copy_(master);
    ++copied;
  }
  TORCH_CHECK(copied == dit_params.size() + text_params.size(), "copy_weights_to: copied ", copied,
              " parameters but the target model has ", dit_params.size() + text_params.size());
}

ParameterShapes CPUMasterVideoDiT::parameter_shapes() const {
  return streamed_parameter_shapes(*engine_, stack_->named_resident_parameters());
}

void CPUMasterVideoDiT::init_from(const InitPlan& plan) { streamed_init_from(*engine_, stack_->named_resident_parameters(), plan); }

TrainingState CPUMasterVideoDiT::training_state() {
  TrainingState s = streamed_training_state(*engine_, stack_->named_resident_parameters());
  s.step = steps_done_;
  s.skipped_steps = skipped_total_;
  s.consecutive_skips = consecutive_skips_;
  s.data_state = batches_.state();
  return s;
}

void CPUMasterVideoDiT::load_training_state(const TrainingState& s) {
  engine_->synchronize();
  batches_.restore(s.data_state);
  load_streamed_training_state(*engine_, stack_->named_resident_parameters(), s, "CPUMasterVideoDiT");
  steps_done_ = s.step;
  skipped_total_ = s.skipped_steps;
  consecutive_skips_ = s.consecutive_skips;
}

}  // namespace megaslide
