// The DiT family (megaslide, dense3d, swin) behind train/model_family.h: the resident reference loop
// (offload.enabled: false) or the streamed CPU-master trainer.
#include <fmt/format.h>

#include <memory>

#include "megaslide/diffusion/text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/dit_weights.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/cpu_master_trainer.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/streamed_state.h"

namespace megaslide {

namespace {

class DiTFamilyTrainer final : public FamilyTrainer {
 public:
  explicit DiTFamilyTrainer(const TrainerRequest& request)
      : config_(*request.config), requested_compute_dtype_(request.requested->offload.compute_dtype) {
    if (config_.offload.enabled)
      streamed_ = std::make_unique<CPUMasterVideoDiT>(config_, request.communicator);
    else
      resident_ = std::make_unique<ResidentTrainer>(config_, request.communicator);
    if (request.init_from) {
      init_ = plan_init_from(config_.train.init_from, streamed_ ? streamed_->parameter_shapes() : resident_->parameter_shapes(),
                             config_.train.init_allow_missing);
      streamed_ ? streamed_->init_from(init_) : resident_->init_from(init_);
    }
    if (request.validation)  // a bad prompt file stops the run now, not at its first validation
      validation_ = plan_validation_videos(
          config_, dit_validation_prompts(config_, 4, config_.data.dataset == "videos" ? data().captions(4) : std::vector<std::string>{}),
          request.source);
  }

  StepMetrics step() override { return streamed_ ? streamed_->step() : resident_->step(); }
  TrainingState training_state() override { return streamed_ ? streamed_->training_state() : resident_->training_state(); }
  void load_training_state(const TrainingState& s) override {
    streamed_ ? streamed_->load_training_state(s) : resident_->load_training_state(s);
  }
  void synchronize() override {
    if (streamed_) streamed_->synchronize();
  }
  int64_t parameter_count() const override { return streamed_ ? streamed_->parameter_count() : resident_->parameter_count(); }
  int64_t tokens_per_sample() const override { return streamed_ ? streamed_->tokens_per_sample() : resident_->tokens_per_sample(); }
  torch::Device device() const override { return streamed_ ? streamed_->device() : resident_->device(); }
  bool streams() const override { return streamed_ != nullptr; }
  bool sharded() const override { return streamed_ && streamed_->sharded(); }
  void trace_next_step(const std::string& path) override {
    if (streamed_) streamed_->trace_next_step(path);
  }
  int64_t persistent_device_bytes() override {
    if (streamed_) return streamed_persistent_device_bytes(streamed_->engine());
    int64_t bytes = 0;
    for (const auto& p : resident_->model()->parameters()) bytes += static_cast<int64_t>(p.nbytes());
    if (resident_->text_encoder())
      for (const auto& p : resident_->text_encoder()->parameters()) bytes += static_cast<int64_t>(p.nbytes());
    return (config_.train.ema_decay > 0 ? 4 : 3) * bytes;  // weights, AdamW m and v (and the EMA)
  }
  const InitPlan& init_plan() const override { return init_; }

  void describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const override {
    if (streamed_) {
      info.push_back(fmt::format("trainer: streamed CPU-master (offload.mode {}, compute {}, grad_accum_steps {}); host memory at start:\n{}",
                                 config_.offload.mode, config_.offload.compute_dtype, config_.train.grad_accum_steps,
                                 streamed_->host_memory_report()));
      info.push_back(fmt::format("compute dtype {} ({})", config_.offload.compute_dtype,
                                 resolve_compute_dtype(requested_compute_dtype_, device()).reason));
      const std::string slow = compute_dtype_warning(config_.offload.compute_dtype, device(),
                                                     "set offload.compute_dtype: auto (fp32 on this CPU) to run faster");
      if (!slow.empty()) warnings.push_back(slow);
    } else {
      info.push_back("trainer: resident reference loop (offload.enabled: false), compute dtype fp32");
    }
    if (!validation_.empty()) {
      std::string prompts;
      for (const auto& v : validation_) prompts += (prompts.empty() ? "\"" : ", \"") + v.job.prompt + "\"";
      info.push_back(fmt::format("validation videos every {} steps into {}: {}{}", config_.train.sample_every,
                                 io::join_path(config_.output.run_dir, "samples/step-NNNNNNN"), prompts,
                                 config_.train.sample_prompts.empty() ? "" : " (from " + config_.train.sample_prompts + ")"));
    }
    if (config_.model.text_encoder.kind == "clip")
      info.push_back(fmt::format("text encoder: CLIP from {} (frozen), {} tokens of width {}", config_.model.text_encoder.weights,
                                 config_.data.max_text_tokens, config_.model.text_dim));
    if (config_.model.vae.kind == "sd") {
      const auto shape = model_sample_shape(config_);
      info.push_back(fmt::format("latent space: SD VAE from {} (frozen, {} frames per call): {}x{}x{} pixels -> latents {}x{}x{}x{}",
                                 config_.model.vae.weights, config_.model.vae.frames_per_batch, config_.data.frames, config_.data.height,
                                 config_.data.width, shape[0], shape[1], shape[2], shape[3]));
    }
    const auto& d = config_.data;
    if (d.dataset == "videos")
      info.push_back(d.cache.empty() ? fmt::format("data: decoding {} ({} loader workers, {} batches ahead)",
                                                   d.manifest.empty() ? d.root : d.manifest, d.workers, d.prefetch)
                                     : fmt::format("data: cache {} ({} loader workers, {} batches ahead)", d.cache, d.workers, d.prefetch));
  }
  std::string describe_data(int64_t steps) const override { return data().describe(steps); }
  std::vector<BadItem> take_new_bad_items() override { return data().take_new_bad_items(); }

  std::vector<std::string> write_validation(const std::string& folder) override {
    auto [dit, text] = model();
    return write_validation_samples(folder, config_, dit, text, validation_, data().frozen());
  }
  void export_weights(const std::string& path) override {
    if (streamed_) {
      save_weights(path, config_, streamed_->master_views());  // straight from the host store, one tensor at a time
    } else {
      auto [dit, text] = model();
      save_weights(path, config_, dit, text);
    }
  }
  void write_weights(const std::string& path, const io::NamedTensors& weights) override { save_weights(path, config_, weights); }

 private:
  DiffusionBatchSource& data() const { return streamed_ ? streamed_->data() : resident_->data(); }
  // The model for sampling: the resident trainer's own modules, or a CPU copy of the streamed trainer's masters.
  std::pair<DiT&, TextEncoder&> model() {
    if (resident_) return {resident_->model(), resident_->text_encoder()};
    if (!snapshot_dit_) {
      snapshot_dit_ = DiT(DiTOptions::from_config(config_));
      if (config_.model.text_encoder.kind == "builtin")  // CLIP is frozen: no trained text encoder to copy
        snapshot_text_ =
            TextEncoder(TextEncoderOptions(CaptionTokenizer().vocab_size(), config_.model.text_dim, config_.data.max_text_tokens));
    }
    streamed_->copy_weights_to(snapshot_dit_, snapshot_text_);
    return {snapshot_dit_, snapshot_text_};
  }

  const RunConfig config_;
  const std::string requested_compute_dtype_;
  std::unique_ptr<CPUMasterVideoDiT> streamed_;
  std::unique_ptr<ResidentTrainer> resident_;
  InitPlan init_;
  std::vector<ValidationVideo> validation_;
  DiT snapshot_dit_{nullptr};
  TextEncoder snapshot_text_{nullptr};
};

class DiTFamily final : public ModelFamily {
 public:
  std::string name() const override { return "DiT"; }
  RunConfig resolve(const RunConfig& config, const std::string& /*source*/) const override { return config; }
  std::unique_ptr<FamilyTrainer> make_trainer(const TrainerRequest& request) const override {
    return std::make_unique<DiTFamilyTrainer>(request);
  }
};

}  // namespace

const ModelFamily& dit_family() {
  static const DiTFamily family;
  return family;
}

}  // namespace megaslide
