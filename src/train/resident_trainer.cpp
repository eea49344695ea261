#include "megaslide/train/resident_trainer.h"

#include "offload/streams.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fmt/format.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <sstream>
#include <cmath>
#include <limits>

#include "megaslide/train/auto_settings.h"

namespace megaslide {

torch::Device resolve_device(const std::string& spec) {
  if (spec == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  torch::Device device(spec);
  if (device.is_cuda()) {
    const auto count = static_cast<int64_t>(torch::cuda::device_count());
    TORCH_CHECK(count > 0, "train.device is '", spec, "' but no CUDA GPU is visible; use train.device: cpu or auto");
    TORCH_CHECK(!device.has_index() || device.index() < count, "train.device is '", spec, "' but only ", count,
                " GPU(s) are visible");
  }
  return offload::detail::canonical_device(device);  // "cuda" is the current GPU, with its index
}

double learning_rate(const TrainConfig& t, int64_t step) {
  if (t.warmup_steps > 0 && step < t.warmup_steps) return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup_steps);
  if (t.lr_schedule == "constant") return t.lr;
  const int64_t decay_steps = std::max<int64_t>(t.steps - t.warmup_steps - 1, 1);
  const double progress = std::min(1.0, static_cast<double>(step - t.warmup_steps) / static_cast<double>(decay_steps));
  const double min_lr = t.lr * t.min_lr_ratio;
  return min_lr + 0.5 * (t.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

DiffusionBatchSource::DiffusionBatchSource(const RunConfig& config)
    : config_(config),
      dataset_(StructuredMotionOptions()
                   .channels(config.data.channels)
                   .frames(config.data.frames)
                   .height(config.data.height)
                   .width(config.data.width)
                   .num_clips(config.data.num_clips)
                   .seed(config.data.seed)),
      sampler_(config.data.num_clips, config.train.seed),
      schedule_(config.diffusion.timesteps, parse_beta_schedule(config.diffusion.beta_schedule), config.diffusion.beta_start,
                config.diffusion.beta_end),
      prediction_(parse_prediction(config.diffusion.prediction)),
      caption_rng_(config.train.seed ^ 0x5DEECE66Dull),
      generator_(at::detail::createCPUGenerator(config.train.seed)) {}

std::string DiffusionBatchSource::state() const {
  std::ostringstream rng;
  rng << caption_rng_;
  const auto generator = generator_.get_state().contiguous();
  const auto* bytes = generator.data_ptr<uint8_t>();
  std::string hex;
  for (int64_t i = 0; i < generator.numel(); ++i) hex += fmt::format("{:02x}", bytes[i]);
  nlohmann::ordered_json j;
  j["epoch"] = sampler_.epoch();
  j["cursor"] = sampler_.cursor();
  j["caption_rng"] = rng.str();
  j["generator"] = hex;
  return j.dump();
}

void DiffusionBatchSource::restore(const std::string& state) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(state);
    const auto epoch = j.at("epoch").get<int64_t>(), cursor = j.at("cursor").get<int64_t>();
    if (cursor < 0 || cursor > config_.data.num_clips || epoch < -1)
      throw std::invalid_argument(fmt::format("data position epoch {} cursor {} is out of range for {} clips", epoch, cursor,
                                              config_.data.num_clips));
    std::istringstream rng(j.at("caption_rng").get<std::string>());
    std::mt19937_64 caption_rng;
    rng >> caption_rng;
    if (rng.fail()) throw std::invalid_argument("caption_rng is not an mt19937_64 state");
    const auto hex = j.at("generator").get<std::string>();
    if (hex.size() % 2 != 0) throw std::invalid_argument("generator state has an odd number of hex digits");
    auto bytes = torch::empty({static_cast<int64_t>(hex.size() / 2)}, torch::kUInt8);
    auto* out = bytes.data_ptr<uint8_t>();
    for (size_t i = 0; i < hex.size() / 2; ++i) {
      const std::string pair = hex.substr(2 * i, 2);
      if (pair.find_first_not_of("0123456789abcdef") != std::string::npos) throw std::invalid_argument("generator state is not hex");
      out[i] = static_cast<uint8_t>(std::stoi(pair, nullptr, 16));
    }
    auto generator = at::detail::createCPUGenerator(config_.train.seed);
    try {
      generator.set_state(bytes);
    } catch (const c10::Error& e) {
      throw std::invalid_argument(std::string("generator state rejected: ") + e.what_without_backtrace());
    }
    sampler_.seek(epoch, cursor);
    caption_rng_ = caption_rng;
    generator_ = generator;
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("data state: ") + e.what());
  }
}

DiffusionBatch DiffusionBatchSource::next(torch::Device device) {
  if (device != schedule_device_) {
    schedule_ = schedule_.to(device);
    schedule_device_ = device;
  }
  const int64_t B = config_.train.batch_size;
  auto clips = dataset_.batch(sampler_.next(B));
  std::bernoulli_distribution drop(config_.diffusion.caption_dropout);
  for (auto& caption : clips.captions)
    if (drop(caption_rng_)) caption.clear();
  auto tokens = tokenizer_.encode_batch(clips.captions, config_.data.max_text_tokens);

  DiffusionBatch b;
  b.x0 = clips.video.to(device);
  b.timesteps = schedule_.sample_timesteps(B, device, generator_);
  // Noise is drawn on the CPU so that a run's random stream is the same on every device.
  b.noise = torch::randn(clips.video.sizes(), generator_, torch::kFloat32).to(device);
  b.xt = schedule_.add_noise(b.x0, b.noise, b.timesteps);
  b.target = schedule_.target(prediction_, b.x0, b.noise, b.timesteps);
  b.text_ids = tokens.ids.to(device);
  b.text_mask = tokens.mask.to(device);
  return b;
}

ResidentTrainer::ResidentTrainer(const RunConfig& config)
    : config_(config), device_(resolve_device(config.train.device)), batches_(config) {
  validate(config_, "ResidentTrainer");
  apply_threads(plan_threads(config_, device_));
  torch::manual_seed(config_.train.seed);
  model_ = DiT(DiTOptions::from_config(config_));
  text_encoder_ = TextEncoder(TextEncoderOptions(batches_.tokenizer().vocab_size(), config_.model.text_dim, config_.data.max_text_tokens));
  model_->to(device_);
  text_encoder_->to(device_);
  for (auto& p : model_->parameters()) parameters_.push_back(p);
  for (auto& p : text_encoder_->parameters()) parameters_.push_back(p);
  const auto& t = config_.train;
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      parameters_, torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(t.eps).weight_decay(t.weight_decay));
  grid_ = model_->token_grid(config_.data.frames, config_.data.height, config_.data.width);
}

int64_t ResidentTrainer::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters_) n += p.numel();
  return n;
}

std::vector<std::pair<std::string, torch::Tensor>> ResidentTrainer::named_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : model_->named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (const auto& p : text_encoder_->named_parameters(true)) out.emplace_back("text_encoder." + p.key(), p.value());
  return out;
}

TrainingState ResidentTrainer::training_state() {
  TrainingState s;
  s.step = steps_done_;
  s.optimizer_steps = optimizer_steps_;
  s.skipped_steps = skipped_total_;
  s.consecutive_skips = consecutive_skips_;
  s.data_state = batches_.state();
  for (auto& [name, p] : named_parameters()) {
    auto moments = adamw_moments(*optimizer_, p);
    s.master.emplace_back(name, p.detach().to(torch::kCPU, torch::kFloat32).clone());
    s.exp_avg.emplace_back(name, moments.exp_avg);
    s.exp_avg_sq.emplace_back(name, moments.exp_avg_sq);
  }
  return s;
}

void ResidentTrainer::load_training_state(const TrainingState& s) {
  auto params = named_parameters();
  TORCH_CHECK(s.master.size() == params.size() && s.exp_avg.size() == params.size() && s.exp_avg_sq.size() == params.size(),
              "ResidentTrainer::load_training_state: expected ", params.size(), " parameters, got ", s.master.size());
  batches_.restore(s.data_state);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& [name, p] = params[i];
    TORCH_CHECK(s.master[i].first == name, "ResidentTrainer::load_training_state: parameter ", i, " is '", s.master[i].first,
                "', expected '", name, "'");
    p.copy_(s.master[i].second);
    set_adamw_moments(*optimizer_, p, s.exp_avg[i].second, s.exp_avg_sq[i].second, s.optimizer_steps);
  }
  steps_done_ = s.step;
  optimizer_steps_ = s.optimizer_steps;
  skipped_total_ = s.skipped_steps;
  consecutive_skips_ = s.consecutive_skips;
}

StepMetrics ResidentTrainer::step() {
  const auto start = std::chrono::steady_clock::now();
  const auto& t = config_.train;
  const double lr = learning_rate(t, steps_done_);
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);

  optimizer_->zero_grad();
  const int64_t accum = t.grad_accum_steps;
  double loss_sum = 0.0;
  for (int64_t k = 0; k < accum; ++k) {
    auto b = batches_.next(device_);
    auto text = text_encoder_(b.text_ids);
    auto loss = diffusion_loss(model_(b.xt, b.timesteps, text, b.text_mask), b.target);
    (accum == 1 ? loss : loss / static_cast<double>(accum)).backward();
    loss_sum += loss.item<double>();  // synchronises with the device, so the timing below is complete
  }
  const auto optimizer_start = std::chrono::steady_clock::now();  // the device is idle here (item() above)
  const double max_norm = t.grad_clip > 0 ? t.grad_clip : std::numeric_limits<double>::infinity();
  const double grad_norm = torch::nn::utils::clip_grad_norm_(parameters_, max_norm);
  StepMetrics m;
  m.loss = loss_sum / static_cast<double>(accum);
  m.skipped = !std::isfinite(m.loss) || !std::isfinite(grad_norm);
  if (m.skipped) {
    ++skipped_total_;
    ++consecutive_skips_;
  } else {
    optimizer_->step();
    ++optimizer_steps_;
    consecutive_skips_ = 0;
  }
  m.skipped_total = skipped_total_;
  m.consecutive_skips = consecutive_skips_;
  if (device_.is_cuda()) torch::cuda::synchronize();
  m.optimizer_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - optimizer_start).count();
  m.step = ++steps_done_;
  m.lr = lr;
  m.grad_norm = grad_norm;
  m.step_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  m.samples_per_s = static_cast<double>(t.batch_size * accum) / m.step_time_s;
  m.tokens_per_s = m.samples_per_s * static_cast<double>(grid_.numel());
  return m;
}

}  // namespace megaslide
