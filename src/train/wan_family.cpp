// Wan behind train/model_family.h: WanTrainer in either mode, its latent data (a data.tensors file or a
// megaslide-cache folder), validation videos through umT5 and the Wan VAE, diffusers' weights file.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "megaslide/data/latent_cache.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/streamed_state.h"
#include "megaslide/train/wan_trainer.h"
#include "megaslide/train/wan_validation.h"
#include "megaslide/util/errors.h"

namespace megaslide {

namespace {

// The validation prompts of a run on cached videos: the cache's first distinct captions.
std::vector<std::string> cached_captions(const RunConfig& config, const std::string& source) {
  std::vector<std::string> captions;
  if (config.data.dataset != "videos") return captions;
  try {
    const auto cache = LatentCache::open(config, config.data.cache);
    for (int64_t i = 0; i < cache->size() && static_cast<int64_t>(captions.size()) < kWanValidationVideos; ++i)
      if (!cache->caption(i).empty() && std::find(captions.begin(), captions.end(), cache->caption(i)) == captions.end())
        captions.push_back(cache->caption(i));
  } catch (const DatasetError& e) {
    throw ConfigError(source, "data.cache", e.what());
  }
  return captions;
}

class WanFamilyTrainer final : public FamilyTrainer {
 public:
  explicit WanFamilyTrainer(const TrainerRequest& request) : config_(*request.config) {
    const std::string& source = request.source;
    // Validation first: umT5 encodes the prompts now, before the trainer's state exists, and is freed.
    if (request.validation) validation_.emplace(config_, cached_captions(config_, source), source);
    // Latents and text embeddings: a data.tensors file, or a megaslide-cache folder of the videos.
    WanLatentData data;
    const RunConfig latent = wan_latent_config(config_);
    const bool cached = config_.data.dataset == "videos";
    try {
      data = cached ? WanLatentData::from_cache(config_, config_.data.cache) : WanLatentData::load(config_.data.tensors);
      data.check(latent);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(source, cached ? "data.cache" : "data.tensors", e.what());
    }
    // train.init_from is read into the model as the trainer builds it (no second copy of the weights).
    WanTrainer::InitPlanner init;
    if (request.init_from)
      init = [this](const ParameterShapes& shapes) {
        auto allow = config_.train.init_allow_missing;
        if (config_.model.self_attention == "dsa3d")  // the retrofit from a dense Wan checkpoint
          for (const auto& glob : wan_dsa_parameter_globs()) allow.push_back(glob);
        return plan_init_from(config_.train.init_from, shapes, allow);
      };
    try {
      trainer_ = std::make_unique<WanTrainer>(latent, std::move(data), init, request.communicator);
    } catch (const WanWeightsError& e) {
      throw ConfigError(source, "model.wan.weights", e.what());
    }
  }

  StepMetrics step() override { return trainer_->step(); }
  TrainingState training_state() override { return trainer_->training_state(); }
  void load_training_state(const TrainingState& s) override { trainer_->load_training_state(s); }
  void synchronize() override { trainer_->synchronize(); }
  int64_t parameter_count() const override { return trainer_->parameter_count(); }
  int64_t tokens_per_sample() const override { return trainer_->tokens_per_sample(); }
  torch::Device device() const override { return trainer_->device(); }
  bool streams() const override { return trainer_->streamed(); }
  bool sharded() const override { return trainer_->sharded(); }
  void trace_next_step(const std::string& path) override { trainer_->trace_next_step(path); }
  int64_t persistent_device_bytes() override {
    if (trainer_->streamed()) return streamed_persistent_device_bytes(*trainer_->engine());
    int64_t bytes = 0;
    for (const auto& p : trainer_->model()->parameters()) bytes += static_cast<int64_t>(p.nbytes());
    return (config_.train.ema_decay > 0 ? 4 : 3) * bytes;  // weights, AdamW m and v (and the EMA)
  }
  const InitPlan& init_plan() const override { return trainer_->init_plan(); }

  void describe(std::vector<std::string>& info, std::vector<std::string>& /*warnings*/) const override {
    const bool streamed = trainer_->streamed();
    info.push_back(fmt::format("trainer: Wan, {} (offload.mode {}, compute {}, grad_accum_steps {}){}",
                               streamed ? "streamed CPU-master" : "resident reference loop", config_.offload.mode,
                               streamed ? config_.offload.compute_dtype : "fp32", config_.train.grad_accum_steps,
                               streamed ? "; host memory at start:\n" + trainer_->host_memory_report() : ""));
    if (!trainer_->initialised_parameters().empty())
      info.push_back(fmt::format("{} parameters not in model.wan.weights start from their initialisation (the 3D-DSA retrofit's)",
                                 trainer_->initialised_parameters().size()));
    if (validation_) {
      std::string prompts;
      for (const auto& job : validation_->jobs()) prompts += (prompts.empty() ? "\"" : ", \"") + job.prompt + "\"";
      const auto& so = validation_->options();
      info.push_back(fmt::format("validation videos every {} steps into {}: {} ({} {} steps, shift {}, guidance {}; umT5 {} and the Wan VAE {})",
                                 config_.train.sample_every, io::join_path(config_.output.run_dir, "samples/step-NNNNNNN"), prompts,
                                 so.kind() == FlowSamplerKind::kUniPC ? "unipc" : "euler", so.steps(), so.shift(), so.guidance_scale(),
                                 config_.model.text_encoder.weights, config_.model.vae.weights));
    }
  }
  std::string describe_data(int64_t /*steps*/) const override {
    return config_.data.dataset == "videos"
               ? fmt::format("cache {} (Wan VAE latents and umT5 embeddings, all held in memory)", config_.data.cache)
               : fmt::format("tensors {} (latents and text embeddings, all held in memory)", config_.data.tensors);
  }

  std::vector<std::string> write_validation(const std::string& folder) override { return validation_->write(folder, *trainer_); }
  void export_weights(const std::string& path) override {
    // diffusers' names and layout (model/wan_weights.h); the streamed blocks straight from the host store.
    save_wan_weights(path, config_.model.wan, trainer_->weight_views());
  }
  void write_weights(const std::string& path, const io::NamedTensors& weights) override {
    save_wan_weights(path, config_.model.wan, weights);
  }

 private:
  const RunConfig config_;
  std::optional<WanValidation> validation_;
  std::unique_ptr<WanTrainer> trainer_;
};

class WanFamily final : public ModelFamily {
 public:
  std::string name() const override { return "Wan"; }
  RunConfig resolve(const RunConfig& config, const std::string& source) const override {
    // The hyper-parameters of model.wan.weights when set; a run needs its latent tensors.
    RunConfig resolved;
    try {
      resolved = with_wan_architecture_from_weights(config);
    } catch (const WanWeightsError& e) {
      throw ConfigError(source, "model.wan.weights", e.what());
    }
    if (resolved.data.dataset == "videos" && resolved.data.cache.empty())
      throw ConfigError(source, "data.cache",
                        "is empty: model.arch wan trains on videos through their cache of Wan VAE latents and umT5 embeddings: run "
                        "megaslide-cache --config with this config, then set data.cache to its folder (docs/wan.md)");
    if (resolved.data.dataset == "latent-tensors" && resolved.data.tensors.empty())
      throw ConfigError(source, "data.tensors",
                        "is empty: model.arch wan trains on latent videos and text embeddings (a safetensors file of latents, text "
                        "and empty_text, or data.dataset: videos with data.cache; docs/wan.md)");
    check_wan_validation_config(resolved, source);  // umT5 and the Wan VAE named for validation videos
    return resolved;
  }
  RunConfig sample_config(const RunConfig& config) const override { return wan_latent_config(config); }
  std::unique_ptr<FamilyTrainer> make_trainer(const TrainerRequest& request) const override {
    return std::make_unique<WanFamilyTrainer>(request);
  }
};

}  // namespace

const ModelFamily& wan_family() {
  static const WanFamily family;
  return family;
}

}  // namespace megaslide
