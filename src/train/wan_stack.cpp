#include "megaslide/train/wan_trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "megaslide/data/latent_cache.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/cpu_master_trainer.h"
#include "megaslide/offload/step_trace.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/distributed.h"
#include "megaslide/train/streamed_state.h"
#include "offload/engine_options.h"

namespace megaslide {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// What every streamed block reads besides its input and the shared tensors.
struct WanStackInfo {
  TokenGrid grid;
  WanRope rope;
};

// Generator state as hex and back (the data position of a checkpoint).
std::string generator_hex(const at::Generator& g) {
  const auto state = g.get_state().contiguous();
  std::string hex;
  for (int64_t i = 0; i < state.numel(); ++i) hex += fmt::format("{:02x}", state.data_ptr<uint8_t>()[i]);
  return hex;
}
at::Generator generator_from_hex(const std::string& hex, uint64_t seed) {
  if (hex.size() % 2 != 0 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw std::invalid_argument("generator state is not an even number of hex digits");
  auto bytes = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kUInt8);
  for (size_t i = 0; i < hex.size() / 2; ++i) bytes.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  auto g = at::detail::createCPUGenerator(seed);
  try {
    g.set_state(bytes);
  } catch (const c10::Error& e) {
    throw std::invalid_argument(std::string("generator state rejected: ") + e.what_without_backtrace());
  }
  return g;
}

// Moves a registered parameter's data to `device` in place (its identity, and so the module's and any
// optimizer's references to it, kept).
void move_parameter(torch::Tensor& p, torch::Device device) {
  if (p.defined() && p.device() != device) p.set_data(p.data().to(device));
}

// The streamed trainer's initial weights, part by part (wan_trainer.h): the blocks as WanBlockDraws draws
// them, overwritten by the weights and init_from's tensors (not serialised: WanWeights::read and
// InitTensor::read_into may run at once).
class WanInitialWeights {
 public:
  WanInitialWeights(WanTransformer model_, std::optional<WanWeights> weights_)
      : model(std::move(model_)), weights(std::move(weights_)) {}

  // The default generator is where block 0's draw starts.
  void start_blocks() { draws_.emplace(model); }

  WanBlock block(int64_t index) {
    TORCH_CHECK(!released_ && draws_, "WanTrainer: block ", index, " asked for outside the trainer's construction");
    WanBlock b = draws_->draw(index);
    overwrite("blocks." + std::to_string(index) + ".", *b);
    return b;
  }

  void restore_state_after_blocks() { draws_->restore_state_after_blocks(); }

  // The weights', then init_from's values of `part`'s parameters where they have them.
  void overwrite(const std::string& prefix, torch::nn::Module& part) const {
    for (auto& p : part.named_parameters(true)) overwrite_table(prefix + p.key(), p.value());
  }
  void overwrite_table(const std::string& name, const torch::Tensor& p) const {
    torch::NoGradGuard no_grad;
    if (weights && weights->has(name)) p.copy_(weights->read(name, p.scalar_type()));
    auto it = init_sources.find(name);
    if (it != init_sources.end()) it->second.read_into(p);
  }

  void release() {
    released_ = true;
    weights.reset();
    init_sources.clear();
    draws_.reset();
  }

  WanTransformer model;
  std::optional<WanWeights> weights;
  std::map<std::string, InitTensor> init_sources;

 private:
  std::optional<WanBlockDraws> draws_;
  bool released_ = false;
};
}  // namespace

WanLatentData WanLatentData::load(const std::string& path) {
  io::SafetensorsFile file;
  try {
    file = io::read_safetensors(path);
  } catch (const io::IoError& e) {
    throw std::invalid_argument(e.what());
  }
  WanLatentData d;
  for (auto& [name, t] : file.tensors) {
    if (!t.is_floating_point()) throw std::invalid_argument("'" + path + "': tensor '" + name + "' is not floating point");
    if (name == "latents") d.latents = t.to(torch::kFloat32);
    else if (name == "text") d.text = t.to(torch::kFloat32);
    else if (name == "empty_text") d.empty_text = t.to(torch::kFloat32);
    else throw std::invalid_argument("'" + path + "': unexpected tensor '" + name + "' (expected latents, text, empty_text)");
  }
  if (!d.latents.defined() || !d.text.defined()) throw std::invalid_argument("'" + path + "': needs tensors 'latents' and 'text'");
  return d;
}

WanLatentData WanLatentData::from_cache(const RunConfig& config, const std::string& dir) {
  const auto cache = LatentCache::open(config, dir);
  WanLatentData d;
  d.latents = cache->stacked("latents");
  d.text = cache->stacked("text");
  if (cache->empty_prompt().text.defined()) d.empty_text = cache->empty_prompt().text.to(torch::kFloat32).clone();
  return d;
}

RunConfig wan_latent_config(const RunConfig& config) {
  if (config.data.dataset != "videos") return config;
  RunConfig c = config;
  const auto shape = model_sample_shape(config);
  c.data = DataConfig();
  c.data.dataset = "latent-tensors";
  c.data.channels = shape[0];
  c.data.frames = shape[1];
  c.data.height = shape[2];
  c.data.width = shape[3];
  c.data.seed = config.data.seed;
  c.data.max_text_tokens = config.data.max_text_tokens;
  c.model.text_encoder = TextEncoderConfig();
  c.model.vae = VaeConfig();
  return c;
}

void WanLatentData::check(const RunConfig& c) const {
  const auto& d = c.data;
  const std::vector<int64_t> clip{d.channels, d.frames, d.height, d.width};
  if (!latents.defined() || latents.dim() != 5 || latents.sizes().slice(1).vec() != clip || latents.size(0) < 1)
    throw std::invalid_argument(fmt::format("latents are {}, expected [N, {}, {}, {}, {}] (data.channels, frames, height, width)",
                                            latents.defined() ? c10::str(latents.sizes()) : "missing", d.channels, d.frames, d.height,
                                            d.width));
  if (!text.defined() || text.dim() != 3 || text.size(0) != latents.size(0) || text.size(2) != c.model.wan.text_dim)
    throw std::invalid_argument(fmt::format("text is {}, expected [{}, L, {}] (one per latent video, model.wan.text_dim)",
                                            text.defined() ? c10::str(text.sizes()) : "missing", latents.size(0), c.model.wan.text_dim));
  if (empty_text.defined() && (empty_text.dim() != 2 || empty_text.size(0) != text.size(1) || empty_text.size(1) != text.size(2)))
    throw std::invalid_argument(fmt::format("empty_text is {}, expected [{}, {}]", c10::str(empty_text.sizes()), text.size(1), text.size(2)));
  if (c.diffusion.caption_dropout > 0 && !empty_text.defined())
    throw std::invalid_argument("diffusion.caption_dropout is " + std::to_string(c.diffusion.caption_dropout) +
                                " but the data has no empty_text (the empty prompt's embedding a dropped caption becomes)");
}

WanBatchSource::WanBatchSource(const RunConfig& config, WanLatentData data)
    : config_(config),
      data_(std::move(data)),
      sampler_(data_.latents.defined() ? data_.latents.size(0) : 1, config.train.seed),
      flow_(config.diffusion.objective == "flow"),
      flow_options_(FlowMatchingOptions::from_config(config)),
      schedule_(config.diffusion.timesteps, parse_beta_schedule(config.diffusion.beta_schedule), config.diffusion.beta_start,
                config.diffusion.beta_end),
      prediction_(parse_prediction(config.diffusion.prediction)),
      caption_rng_(config.train.seed ^ 0x5DEECE66Dull),
      generator_(at::detail::createCPUGenerator(config.train.seed)) {
  data_.check(config_);
}

void WanBatchSource::take_slice(int64_t rank, int64_t world_size) {
  check_batch_slice(config_.train.batch_size, rank, world_size);
  slice_rank_ = rank;
  slice_count_ = world_size;
}

WanBatch WanBatchSource::next(torch::Device device) {
  const int64_t B = config_.train.batch_size;  // the global batch: every draw below is made for all of it
  const auto index = torch::tensor(sampler_.next(B), torch::kInt64);
  WanBatch b;
  const auto x0 = data_.latents.index_select(0, index);
  auto text = data_.text.index_select(0, index);
  std::bernoulli_distribution drop(config_.diffusion.caption_dropout);
  for (int64_t i = 0; i < B; ++i)
    if (drop(caption_rng_)) text[i].copy_(data_.empty_text);
  torch::Tensor noise;
  if (flow_) {
    const auto sigma = sample_flow_sigmas(B, flow_options_, generator_);
    noise = torch::randn(x0.sizes(), generator_, torch::kFloat32);
    b.xt = flow_noisy(x0, noise, sigma).to(device);
    b.target = flow_target(x0, noise).to(device);
    b.timesteps = (sigma * static_cast<float>(config_.diffusion.timesteps)).to(device);
  } else {
    const auto t = schedule_.sample_timesteps(B, torch::kCPU, generator_);
    noise = torch::randn(x0.sizes(), generator_, torch::kFloat32);
    b.xt = schedule_.add_noise(x0, noise, t).to(device);
    b.target = schedule_.target(prediction_, x0, noise, t).to(device);
    b.timesteps = t.to(torch::kFloat32).to(device);
  }
  b.x0 = x0.to(device);
  b.noise = noise.to(device);
  b.text = text.to(device);
  if (slice_count_ > 1) {  // this rank's rows [first, first + local) of the global batch
    const int64_t local = B / slice_count_, first = slice_rank_ * local;
    for (auto* t : {&b.x0, &b.noise, &b.xt, &b.timesteps, &b.target, &b.text}) *t = t->narrow(0, first, local).contiguous();
  }
  return b;
}

std::string WanBatchSource::state() const {
  std::ostringstream rng;
  rng << caption_rng_;
  nlohmann::ordered_json j;
  j["epoch"] = sampler_.epoch();
  j["cursor"] = sampler_.cursor();
  j["caption_rng"] = rng.str();
  j["generator"] = generator_hex(generator_);
  return j.dump();
}

void WanBatchSource::restore(const std::string& state) {
  try {
    const auto j = nlohmann::json::parse(state);
    const auto epoch = j.at("epoch").get<int64_t>(), cursor = j.at("cursor").get<int64_t>();
    if (cursor < 0 || cursor > size() || epoch < -1)
      throw std::invalid_argument(fmt::format("data position epoch {} cursor {} is out of range for {} latent videos", epoch, cursor, size()));
    std::istringstream rng(j.at("caption_rng").get<std::string>());
    std::mt19937_64 caption_rng;
    rng >> caption_rng;
    if (rng.fail()) throw std::invalid_argument("caption_rng is not an mt19937_64 state");
    auto generator = generator_from_hex(j.at("generator").get<std::string>(), config_.train.seed);
    sampler_.seek(epoch, cursor);
    caption_rng_ = caption_rng;
    generator_ = generator;
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("data state: ") + e.what());
  }
}

WanBlockDraws::WanBlockDraws(WanTransformer model) : model_(std::move(model)), states_{at::detail::getDefaultCPUGenerator().get_state()} {}

WanBlock WanBlockDraws::draw(int64_t index) {
  TORCH_CHECK(index >= 0 && index < model_->options.layers(), "WanBlockDraws: block ", index, " out of range [0, ",
              model_->options.layers(), ")");
  std::lock_guard<std::mutex> lock(mutex_);
  auto kept = kept_.find(index);
  if (kept != kept_.end()) {
    WanBlock b = std::move(kept->second);
    kept_.erase(kept);
    return b;
  }
  auto generator = at::detail::getDefaultCPUGenerator();
  for (int64_t k = static_cast<int64_t>(states_.size()) - 1; k < index; ++k) {  // predecessors not yet drawn
    generator.set_state(states_[k]);
    kept_.emplace(k, model_->new_block(torch::kCPU));
    states_.push_back(generator.get_state());
  }
  generator.set_state(states_.at(index));
  WanBlock b = model_->new_block(torch::kCPU);
  if (static_cast<int64_t>(states_.size()) == index + 1) states_.push_back(generator.get_state());
  return b;
}

void WanBlockDraws::restore_state_after_blocks() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(static_cast<int64_t>(states_.size()) == model_->options.layers() + 1, "WanBlockDraws: ", states_.size() - 1, " of ",
              model_->options.layers(), " blocks drawn");
  auto generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(states_.back());
}

torch::nn::Module& WanStack::block(int64_t index) { return model_->blocks[index]->as<WanBlockImpl>()->streamed(); }

torch::Tensor WanStack::forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) {
  TORCH_CHECK(inputs.tensors.size() == 2, "WanStack: expected block inputs {tproj, context}");
  const auto& info = std::any_cast<const WanStackInfo&>(inputs.info);
  WanBlockContext ctx;
  ctx.grid = info.grid;
  ctx.rope = info.rope;
  ctx.tproj = inputs.tensors[0];
  ctx.context = inputs.tensors[1];
  return model_->blocks[index]->as<WanBlockImpl>()->forward(x, ctx);
}

std::vector<std::pair<std::string, torch::Tensor>> WanStack::named_resident_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const void*> streamed;
  for (int64_t l = 0; l < num_blocks(); ++l)
    for (const auto& p : block(l).parameters(true)) streamed.insert(p.unsafeGetTensorImpl());
  for (const auto& p : model_->named_parameters(true))
    if (!streamed.count(p.value().unsafeGetTensorImpl())) out.emplace_back(p.key(), p.value());
  return out;
}

std::vector<torch::Tensor> WanStack::resident_parameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : named_resident_parameters()) out.push_back(p);
  return out;
}

std::shared_ptr<torch::nn::Module> WanStack::initial_block(int64_t index) {
  const auto params = block(index).parameters(true);
  if (params.empty() || !params.front().is_meta()) return nullptr;
  TORCH_CHECK(builder_, "WanStack: block ", index, " is a meta skeleton and the stack has no block builder");
  WanBlock built = builder_(index);
  auto streamed = built->streamed().shared_from_this();
  std::lock_guard<std::mutex> lock(built_mutex_);
  built_.emplace(index, std::move(built));
  return streamed;
}

void WanStack::adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> module) {
  WanBlock built{nullptr};
  {
    std::lock_guard<std::mutex> lock(built_mutex_);
    auto it = built_.find(index);
    TORCH_CHECK(it != built_.end() && &it->second->streamed() == module.get(), "WanStack::adopt_block: block ", index,
                " is not the one initial_block built");
    built = std::move(it->second);
    built_.erase(it);
  }
  // Its resident fp32 parameters (not in the streamed module) to the device, identities kept.
  std::set<const void*> streamed;
  for (const auto& p : module->parameters(true)) streamed.insert(p.unsafeGetTensorImpl());
  for (auto& p : built->parameters(true))
    if (!streamed.count(p.unsafeGetTensorImpl())) move_parameter(p, resident_device_);
  model_->replace_block(index, built);
}


WanTrainer::WanTrainer(const RunConfig& requested, WanLatentData data, const InitPlanner& init_from, Communicator* communicator)
    : config_(resolve_auto_settings(with_wan_architecture_from_weights(requested))),
      device_(resolve_device(config_.train.device)),
      batches_(config_, std::move(data)),
      communicator_(communicator) {
  TORCH_CHECK(config_.model.arch == Architecture::kWan, "WanTrainer: model.arch is ", to_string(config_.model.arch), ", expected wan");
  validate(config_, "WanTrainer");
  const bool shard = communicator != nullptr && communicator->world_size() > 1;
  if (shard) batches_.take_slice(communicator->rank(), communicator->world_size());
  apply_threads(plan_threads(config_, device_));
  torch::manual_seed(config_.train.seed);
  std::optional<WanWeights> weights;
  if (!config_.model.wan.weights.empty()) weights.emplace(WanWeights::open(config_.model.wan.weights));
  const auto allow_missing = config_.model.self_attention == "dsa3d" ? wan_dsa_parameter_globs() : std::vector<std::string>{};
  const auto& t = config_.train;
  if (!config_.offload.enabled) {
    // The whole model on the CPU in fp32 (the reference the streamed trainer's initialisation equals).
    WanTransformer model(WanOptions::from_config(config_));
    if (weights) initialised_ = load_wan_weights(*weights, *model, allow_missing);
    if (init_from) {
      ParameterShapes shapes;
      std::map<std::string, torch::Tensor> params;
      for (const auto& p : model->named_parameters(true)) {
        shapes.emplace_back(p.key(), p.value().sizes().vec());
        params.emplace(p.key(), p.value());
      }
      init_plan_ = init_from(shapes);
      torch::NoGradGuard no_grad;
      for (const auto& [name, source] : init_plan_.tensors) source.read_into(params.at(name));
    }
    grid_ = model->token_grid(config_.data.frames, config_.data.height, config_.data.width);
    model->to(device_);
    stack_ = std::make_shared<WanStack>(model);
    std::vector<torch::Tensor> params;
    for (auto& [name, p] : named_parameters()) params.push_back(p);
    resident_optimizer_ = std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(t.eps).weight_decay(t.weight_decay));
    ema_ = WeightsEma(t.ema_decay, named_parameters());
    measure_flops();
    return;
  }
  // Streamed: the blocks a meta skeleton whose weights the engine has built one at a time; the prologue
  // and head real (the head drawn again after the blocks, where reset() draws it).
  auto init = std::make_shared<WanInitialWeights>(WanTransformer(WanOptions::from_config(config_).block_device(torch::kMeta)),
                                                  std::move(weights));
  auto& model = init->model;
  ParameterShapes shapes;
  for (const auto& p : model->named_parameters(true)) shapes.emplace_back(p.key(), p.value().sizes().vec());
  if (init->weights) initialised_ = init->weights->check(shapes, allow_missing);
  if (init_from) {
    init_plan_ = init_from(shapes);
    for (const auto& [name, source] : init_plan_.tensors) init->init_sources.emplace(name, source);
  }
  torch::manual_seed(config_.train.seed);
  model->initialise_prologue();  // as the skeleton's construction drew it; the generator now where block 0 starts
  init->overwrite("patch_embedding.", *model->patch_embedding);
  init->overwrite("condition_embedder.", *model->condition_embedder);
  init->start_blocks();
  grid_ = model->token_grid(config_.data.frames, config_.data.height, config_.data.width);
  stack_ = std::make_shared<WanStack>(model, [init](int64_t l) { return init->block(l); }, device_);
  for (auto& [name, p] : stack_->named_resident_parameters())
    if (!p.is_meta()) move_parameter(p, device_);  // the blocks' tables and norm2 follow in adopt_block
  auto options = engine_options(config_, device_);
  if (shard) options.exchange = communicator->shard_exchange();
  engine_ = std::make_unique<offload::StreamedStackTrainer>(stack_, options);
  // The head into the device parameters the engine's resident optimizer holds.
  init->restore_state_after_blocks();
  model->initialise_head();
  init->overwrite("proj_out.", *model->proj_out);
  init->overwrite_table("scale_shift_table", model->scale_shift_table);
  init->release();  // the weights' mappings closed; a later initial_block is an error
  measure_flops();
}

double wan_model_flops_per_step(const RunConfig& c) {
  const auto& w = c.model.wan;
  const auto shape = model_sample_shape(c);
  const TokenGrid grid{shape[1] / w.patch[0], shape[2] / w.patch[1], shape[3] / w.patch[2]};
  const auto count = count_wan_parameters(WanOptions::from_config(c));
  const double N = static_cast<double>(grid.numel()), Lt = static_cast<double>(c.data.max_text_tokens);
  const double B = static_cast<double>(c.train.batch_size * c.train.grad_accum_steps);
  const double D = static_cast<double>(w.dim), L = static_cast<double>(w.layers);
  const double cross_kv = 2.0 * (D * D + D) * L;  // attn2.to_k, attn2.to_v
  const double text_mlp = static_cast<double>(w.text_dim) * D + D + D * D + D;  // condition_embedder.text_embedder
  const double per_video_token = static_cast<double>(count.total) - cross_kv - text_mlp;
  double keys = N;
  if (c.model.self_attention == "dsa3d") {
    const auto& k = c.model.dsa_kernel;
    keys = static_cast<double>(std::min(k[0], grid.t) * std::min(k[1], grid.h) * std::min(k[2], grid.w));
  }
  const double attention = 12.0 * L * B * N * (keys + Lt) * D;
  return 6.0 * B * (per_video_token * N + (cross_kv + text_mlp) * Lt) + attention;
}

void WanTrainer::measure_flops() {
  if (!device_.is_cuda()) return;
  flops_per_step_ = wan_model_flops_per_step(config_);
  peak_flops_ = (config_.train.peak_tflops > 0 ? config_.train.peak_tflops : measure_peak_tflops(device_)) * 1e12;
}

void WanTrainer::trace_next_step(const std::string& path) { trace_path_ = path; }

std::vector<std::pair<std::string, torch::Tensor>> WanTrainer::named_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : stack_->model()->named_parameters(true)) out.emplace_back(p.key(), p.value());
  return out;
}

int64_t WanTrainer::parameter_count() const {
  if (engine_) return engine_->streamed_parameter_count() + engine_->resident_parameter_count();
  return count_parameters(*stack_->model());
}

void WanTrainer::synchronize() {
  if (engine_) engine_->synchronize();
}

std::string WanTrainer::host_memory_report() const { return engine_ ? engine_->store().memory_report().to_string() : ""; }

StepMetrics WanTrainer::step() {
  const double lr = learning_rate(config_.train, steps_done_);
  StepMetrics m = engine_ ? streamed_step(lr) : resident_step(lr);
  m.step = ++steps_done_;
  m.lr = lr;
  count_skip(m, skipped_total_, consecutive_skips_);
  const auto& t = config_.train;
  m.samples_per_s = static_cast<double>(t.batch_size * t.grad_accum_steps) / m.step_time_s;  // the global batch
  m.tokens_per_s = m.samples_per_s * static_cast<double>(grid_.numel());
  if (peak_flops_ > 0) m.mfu = flops_per_step_ / (m.step_time_s * peak_flops_);
  return m;
}

StepMetrics WanTrainer::resident_step(double lr) {
  const auto start = Clock::now();
  const auto& t = config_.train;
  auto& model = stack_->model();
  for (auto& group : resident_optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  resident_optimizer_->zero_grad();
  double loss_sum = 0.0;
  for (int64_t k = 0; k < t.grad_accum_steps; ++k) {
    auto b = batches_.next(device_);
    auto loss = diffusion_loss(model->forward(b.xt, b.timesteps, b.text), b.target);
    (t.grad_accum_steps == 1 ? loss : loss / static_cast<double>(t.grad_accum_steps)).backward();
    loss_sum += loss.item<double>();
  }
  std::vector<torch::Tensor> params;
  for (auto& group : resident_optimizer_->param_groups())
    for (auto& p : group.params()) params.push_back(p);
  if (communicator_ != nullptr) average_gradients_over_ranks(*communicator_, params, loss_sum, device_);
  const auto optimizer_start = Clock::now();
  const double max_norm = t.grad_clip > 0 ? t.grad_clip : std::numeric_limits<double>::infinity();
  const double grad_norm = torch::nn::utils::clip_grad_norm_(params, max_norm);
  StepMetrics m;
  m.loss = loss_sum / static_cast<double>(t.grad_accum_steps);
  m.grad_norm = grad_norm;
  m.skipped = !std::isfinite(m.loss) || !std::isfinite(grad_norm);
  if (!m.skipped) {
    resident_optimizer_->step();
    ++optimizer_steps_;
    ema_.update(named_parameters(), optimizer_steps_);
  }
  if (device_.is_cuda()) torch::cuda::synchronize();
  m.optimizer_s = seconds_since(optimizer_start);
  m.step_time_s = seconds_since(start);
  return m;
}

offload::StackStepResult wan_streamed_step(offload::StreamedStackTrainer& engine, WanTransformer& model,
                                           const std::function<WanBatch()>& next_batch, double lr) {
  torch::Tensor target, temb;
  TokenGrid grid;
  auto prologue = [&] {
    const auto b = next_batch();
    target = b.target;
    auto e = model->embed(b.xt, b.timesteps, b.text);
    temb = e.temb;
    grid = e.ctx.grid;
    offload::StackInput in;
    in.hidden = e.tokens;
    in.inputs.tensors = {e.ctx.tproj, e.ctx.context};
    in.inputs.info = WanStackInfo{e.ctx.grid, e.ctx.rope};  // fp32 RoPE tables: not cast to the compute dtype
    return in;
  };
  auto epilogue = [&](const torch::Tensor& last_hidden) { return diffusion_loss(model->head(last_hidden, temb, grid), target); };
  return engine.step(prologue, epilogue, lr);
}

StepMetrics WanTrainer::streamed_step(double lr) {
  return traced_engine_step(*engine_, trace_path_,
                            [&] { return wan_streamed_step(*engine_, stack_->model(), [&] { return batches_.next(device_); }, lr); });
}

std::vector<std::pair<std::string, torch::Tensor>> WanTrainer::master_weights() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& [name, p] : weight_views()) out.emplace_back(name, p.detach().to(torch::kCPU, torch::kFloat32).clone());
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> WanTrainer::weight_views() {
  synchronize();
  if (!engine_) return named_parameters();
  std::map<std::string, torch::Tensor> by_name;
  for (auto& [name, p] : stack_->named_resident_parameters()) by_name.emplace(name, p);
  const auto& store = engine_->store();
  for (int64_t l = 0; l < store.num_blocks(); ++l)
    for (const auto& spec : store.block_spec(l).params) {
      const auto views = store.param(l, spec.name);
      by_name.emplace("blocks." + std::to_string(l) + "." + spec.name, store.sharded() ? views.compute : views.master);
    }
  std::vector<std::pair<std::string, torch::Tensor>> out;  // in the model's order
  for (auto& [name, p] : named_parameters()) out.emplace_back(name, by_name.at(name));
  return out;
}

TrainingState WanTrainer::training_state() {
  synchronize();
  TrainingState s;
  if (engine_) {
    s = streamed_training_state(*engine_, stack_->named_resident_parameters());
  } else {
    s.optimizer_steps = optimizer_steps_;
    for (auto& [name, p] : named_parameters()) {
      auto moments = adamw_moments(*resident_optimizer_, p);
      s.master.emplace_back(name, p.detach().to(torch::kCPU, torch::kFloat32).clone());
      s.exp_avg.emplace_back(name, moments.exp_avg);
      s.exp_avg_sq.emplace_back(name, moments.exp_avg_sq);
    }
    ema_.save(s);
  }
  s.step = steps_done_;
  s.skipped_steps = skipped_total_;
  s.consecutive_skips = consecutive_skips_;
  s.data_state = batches_.state();
  return s;
}

void WanTrainer::load_training_state(const TrainingState& s) {
  synchronize();
  batches_.restore(s.data_state);
  if (engine_) {
    load_streamed_training_state(*engine_, stack_->named_resident_parameters(), s, "WanTrainer");
  } else {
    auto params = named_parameters();
    TORCH_CHECK(s.master.size() == params.size() && s.exp_avg.size() == params.size() && s.exp_avg_sq.size() == params.size(),
                "WanTrainer::load_training_state: expected ", params.size(), " parameters, got ", s.master.size());
    std::map<std::string, size_t> index;  // by name: a streamed run's state lists the blocks last
    for (size_t i = 0; i < s.master.size(); ++i) index[s.master[i].first] = i;
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : params) {
      auto it = index.find(name);
      TORCH_CHECK(it != index.end(), "WanTrainer::load_training_state: no state for parameter '", name, "'");
      p.copy_(s.master[it->second].second);
      set_adamw_moments(*resident_optimizer_, p, s.exp_avg[it->second].second, s.exp_avg_sq[it->second].second, s.optimizer_steps);
    }
    ema_.load(s, params, "WanTrainer");
    optimizer_steps_ = s.optimizer_steps;
  }
  steps_done_ = s.step;
  skipped_total_ = s.skipped_steps;
  consecutive_skips_ = s.consecutive_skips;
}

}  // namespace megaslide
