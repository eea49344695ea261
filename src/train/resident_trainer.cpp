#include "megaslide/train/resident_trainer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <cmath>
#include <limits>

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
  return device;
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
      caption_rng_(config.train.seed ^ 0x5DEECE66Dull),
      generator_(at::detail::createCPUGenerator(config.train.seed)) {}

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
  b.text_ids = tokens.ids.to(device);
  b.text_mask = tokens.mask.to(device);
  return b;
}

ResidentTrainer::ResidentTrainer(const RunConfig& config)
    : config_(config), device_(resolve_device(config.train.device)), batches_(config) {
  validate(config_, "ResidentTrainer");
  if (config_.train.threads > 0) torch::set_num_threads(static_cast<int>(config_.train.threads));
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
    auto loss = epsilon_loss(model_(b.xt, b.timesteps, text, b.text_mask), b.noise);
    (accum == 1 ? loss : loss / static_cast<double>(accum)).backward();
    loss_sum += loss.item<double>();  // synchronises with the device, so the timing below is complete
  }
  const auto optimizer_start = std::chrono::steady_clock::now();  // the device is idle here (item() above)
  const double max_norm = t.grad_clip > 0 ? t.grad_clip : std::numeric_limits<double>::infinity();
  const double grad_norm = torch::nn::utils::clip_grad_norm_(parameters_, max_norm);
  optimizer_->step();

  StepMetrics m;
  m.loss = loss_sum / static_cast<double>(accum);
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
