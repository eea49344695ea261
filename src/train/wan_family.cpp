// Wan behind train/model_family.h (train/wan_family.h says how it is built and split for streaming): its
// latent data (a data.tensors file or a megaslide-cache folder), validation videos through umT5 and the
// Wan VAE, diffusers' weights file.
#include "megaslide/train/wan_family.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>

#include "megaslide/data/latent_cache.h"
#include "megaslide/io/files.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/trainer.h"
#include "megaslide/train/wan_validation.h"
#include "megaslide/util/errors.h"

namespace megaslide {

namespace {

// The validation prompts of a run on cached videos: the captions of the items from the first until
// kWanValidationVideos distinct ones are among them (WanValidation picks those).
std::vector<std::string> validation_captions(const WanLatentData& data) {
  std::vector<std::string> captions;
  int64_t distinct = 0;
  for (size_t i = 0; i < data.captions.size() && distinct < kWanValidationVideos; ++i) {
    const auto& caption = data.captions[i];
    if (!caption.empty() && std::find(captions.begin(), captions.end(), caption) == captions.end()) ++distinct;
    captions.push_back(caption);
  }
  return captions;
}

// Latents and text embeddings: a data.tensors file, or a megaslide-cache folder of the videos.
WanLatentData load_latent_data(const RunConfig& config, const std::string& source) {
  const bool cached = config.data.dataset == "videos";
  try {
    WanLatentData data =
        cached ? WanLatentData::from_cache(config, config.data.cache) : WanLatentData::load(config.data.tensors);
    data.check(wan_latent_config(config));
    return data;
  } catch (const std::invalid_argument& e) {
    throw ConfigError(source, cached ? "data.cache" : "data.tensors", e.what());
  }
}

// The streamed trainer's initial weights, part by part (train/wan_family.h): the blocks as WanBlockDraws draws
// them, overwritten by the weights and init_from's tensors (not serialised: WanWeights::read and
// InitTensor::read_into may run at once).
class WanInitialWeights {
 public:
  WanInitialWeights(WanTransformer model_, std::optional<WanWeights> weights_)
      : model(std::move(model_)), weights(std::move(weights_)) {}

  // The default generator is where block 0's draw starts.
  void start_blocks() { draws_.emplace(model); }

  WanBlock block(int64_t index) {
    TORCH_CHECK(!released_ && draws_, "Wan: block ", index, " asked for outside the trainer's construction");
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

// Wan2.2's two experts as one StreamedModel: the high-noise expert's blocks, then the low-noise one's.
class WanExpertsStack final : public offload::StreamedModel {
 public:
  explicit WanExpertsStack(std::vector<std::shared_ptr<WanStack>> stacks) : stacks_(std::move(stacks)) {}
  int64_t num_blocks() const override {
    int64_t n = 0;
    for (const auto& s : stacks_) n += s->num_blocks();
    return n;
  }
  torch::nn::Module& block(int64_t index) override {
    auto [stack, l] = locate(index);
    return stack.block(l);
  }
  torch::Tensor forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) override {
    auto [stack, l] = locate(index);
    return stack.forward_block(l, x, inputs);
  }
  std::vector<torch::Tensor> resident_parameters() override {
    std::vector<torch::Tensor> out;
    for (const auto& s : stacks_)
      for (auto& p : s->resident_parameters()) out.push_back(p);
    return out;
  }
  std::shared_ptr<torch::nn::Module> initial_block(int64_t index) override {
    auto [stack, l] = locate(index);
    return stack.initial_block(l);
  }
  void adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> block) override {
    auto [stack, l] = locate(index);
    stack.adopt_block(l, std::move(block));
  }

 private:
  std::pair<WanStack&, int64_t> locate(int64_t index) const {
    for (const auto& s : stacks_) {
      if (index < s->num_blocks()) return {*s, index};
      index -= s->num_blocks();
    }
    TORCH_CHECK(false, "WanExpertsStack: block index out of range");
  }
  std::vector<std::shared_ptr<WanStack>> stacks_;
};

// One DiT the run trains (Wan2.2's two experts trained together: two).
struct WanExpert {
  std::string name;                  // "" for one DiT; "high", "low"
  std::string prefix;                // of its parameters' names: "" for one DiT; "transformer.", "transformer_2."
  std::string weights, weights_key;  // its weights (may be empty) and their config key
  WanStackSplit split{WanTransformer(nullptr)};  // the model, and the micro-batch between prologue and epilogue
  std::shared_ptr<WanStack> stack;               // streamed
  std::vector<std::string> initialised;          // parameters not in its weights (prefixed)
  std::shared_ptr<WanInitialWeights> init;       // until the weights are in place (streamed: blocks_built)
};

class WanModel final : public FamilyModel {
 public:
  explicit WanModel(const ModelRequest& request)
      : config_(*request.config),
        latent_(wan_latent_config(config_)),
        device_(request.device),
        streamed_(request.streamed) {
    const std::string& source = request.source;
    auto data = load_latent_data(config_, source);
    unreported_bad_ = data.bad;
    items_ = data.size();
    bad_items_ = static_cast<int64_t>(data.bad.size());
    // Validation before the trainer's state exists: umT5 encodes the prompts now and is freed.
    if (request.validation) validation_.emplace(config_, validation_captions(data), source);
    if (validation_ && wan_validation_from_images(config_)) validation_->images(data);
    batches_.emplace(latent_, std::move(data));
    const auto& w = config_.model.wan;
    if (w.expert == "both") {
      experts_.resize(2);
      experts_[0].name = "high";
      experts_[0].prefix = "transformer.";
      experts_[0].weights = w.weights;
      experts_[0].weights_key = "model.wan.weights";
      experts_[1].name = "low";
      experts_[1].prefix = "transformer_2.";
      experts_[1].weights = w.weights_2;
      experts_[1].weights_key = "model.wan.weights_2";
    } else {
      experts_.resize(1);
      experts_[0].weights = w.weights.empty() ? std::string() : wan_trained_weights(w);
      experts_[0].weights_key = &wan_trained_weights(w) == &w.weights ? "model.wan.weights" : "model.wan.weights_2";
    }
    for (auto& e : experts_) e.split.group = request.context_group;
    build(request.init_from, source);
    if (request.validation_data != nullptr) {  // its data read now: a bad one stops the run before it starts
      const RunConfig& v = *request.validation_data;
      val_batches_.emplace(make_validation_source(
          source, [&] { return WanBatchSource(wan_latent_config(v), load_latent_data(v, source)); }));
      val_start_ = val_batches_->state();
    }
  }

  io::NamedTensors named_parameters() override {
    io::NamedTensors out;
    for (auto& e : experts_)
      for (const auto& p : e.split.model->named_parameters(true)) out.emplace_back(e.prefix + p.key(), p.value());
    return out;
  }
  std::string block_name(int64_t l) const override {
    const int64_t L = config_.model.wan.layers;
    return experts_[static_cast<size_t>(l / L)].prefix + "blocks." + std::to_string(l % L);
  }
  std::vector<ModelPart> parts() const override {
    if (experts_.size() == 1) return {};
    const int64_t L = config_.model.wan.layers;
    std::vector<ModelPart> out;
    for (size_t e = 0; e < experts_.size(); ++e)
      out.push_back(
          {experts_[e].name, experts_[e].prefix, static_cast<int64_t>(e) * L, static_cast<int64_t>(e + 1) * L});
    return out;
  }
  size_t begin_step() override { return active_ = batches_->draw_expert(); }

  std::shared_ptr<offload::StreamedModel> stack() override { return stack_; }
  void blocks_built() override {
    // Each head into the device parameters the engine's resident optimizer holds, drawn where the whole
    // model's construction draws it (after every block).
    for (auto& e : experts_) {
      e.init->restore_state_after_blocks();
      e.split.model->initialise_head();
      e.init->overwrite("proj_out.", *e.split.model->proj_out);
      e.init->overwrite_table("scale_shift_table", e.split.model->scale_shift_table);
      e.init->release();  // the weights' mappings closed (the stack's builder still holds the object); a later
      e.init.reset();     // initial_block is an error
    }
  }

  at::Tensor loss(MicroBatchStats& stats) override { return experts_[active_].split.loss(next_batch(stats)); }
  offload::StackInput prologue(MicroBatchStats& stats) override {
    return experts_[active_].split.prologue(next_batch(stats));
  }
  at::Tensor epilogue(const at::Tensor& last_hidden) override { return experts_[active_].split.epilogue(last_hidden); }

  std::vector<BadItem> take_new_bad_items() override { return std::exchange(unreported_bad_, {}); }
  std::string data_state() const override { return batches_->state(); }
  void restore_data(const std::string& state) override { batches_->restore(state); }
  void take_slice(int64_t rank, int64_t world_size) override { batches_->take_slice(rank, world_size); }
  std::string describe_data(int64_t /*steps*/) const override {
    return config_.data.dataset == "videos"
               ? fmt::format(
                     "cache {}: {} usable item{} of {} listed ({} bad; Wan VAE latents and umT5 embeddings, "
                     "read batch by batch from the mapped shards{})",
                     config_.data.cache, items_, items_ == 1 ? "" : "s", items_ + bad_items_, bad_items_,
                     config_.data.buckets.empty()
                         ? ""
                         : fmt::format("; {} buckets, each batch of one", config_.data.buckets.size()))
               : fmt::format("tensors {} (latents and text embeddings, memory-mapped, read batch by batch)",
                             config_.data.tensors);
  }

  int64_t tokens_per_sample() const override { return grid_.numel(); }
  double flops_per_step() const override { return wan_model_flops_per_step(latent_); }

  void describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const override {
    const auto& w = config_.model.wan;
    // The conditioning frame of an image-to-video DiT's clips: unused by a text-to-video one (TI2V's clean first
    // frame is the clip's own). Said, not refused: a run's config keeps its data keys across resumes.
    // (Without model.wan.weights, unused_settings says it.)
    if (!w.weights.empty() && !wan_image_to_video(w) && config_.data.image_frame != 0)
      warnings.push_back(fmt::format(
          "data.image_frame is {}, but this Wan is text-to-video (model.wan.in_channels equals out_channels){}: the "
          "setting is not used",
          config_.data.image_frame,
          config_.diffusion.first_frame_clean > 0 ? ", and TI2V's clean first frame is each clip's own first" : ""));
    if (w.expert == "both") {
      const double p_high = 1.0 - flow_sigma_cdf(w.boundary_ratio, FlowMatchingOptions::from_config(config_));
      info.push_back(fmt::format(
          "Wan2.2's two experts trained in one run: each step trains one, the high-noise expert{} on {:.1f}% of the "
          "steps (σ at timesteps >= {} x 1000), the low-noise expert{} on the others (σ below; "
          "diffusion.timestep_sampling's distribution restricted to each side); only the step's expert streams",
          w.weights.empty() ? "" : " '" + w.weights + "'", 100.0 * p_high, w.boundary_ratio,
          w.weights_2.empty() ? "" : " '" + w.weights_2 + "'"));
    } else if (!w.expert.empty()) {
      info.push_back(fmt::format(
          "Wan2.2's {}-noise expert{}: σ drawn only at timesteps {} {} x 1000 (diffusion.timestep_sampling's "
          "distribution restricted there){}",
          w.expert, wan_trained_weights(w).empty() ? " (randomly initialised)" : " '" + wan_trained_weights(w) + "'",
          w.expert == "high" ? ">=" : "<", w.boundary_ratio,
          w.weights_2.empty() ? std::string()
                              : fmt::format("; the {}-noise expert '{}' is not trained",
                                            w.expert == "high" ? "low" : "high", wan_untrained_expert(w))));
    }
    if (config_.diffusion.first_frame_clean > 0)
      info.push_back(
          fmt::format("image-to-video (Wan2.2 TI2V) for {:.0f}% of the samples: the first latent frame "
                      "clean, its tokens at timestep 0, left out of the loss",
                      100.0 * config_.diffusion.first_frame_clean));
    if (wan_image_to_video(w))
      info.push_back(fmt::format(
          "image-to-video: each clip's image conditions it (the first-frame mask and the conditioning video's "
          "latents as {} input channels{}){}",
          wan_condition_channels(w), w.image_dim > 0 ? ", CLIP's image tokens in the cross-attention" : "",
          config_.diffusion.image_dropout > 0
              ? fmt::format("; dropped for {:.0f}% of the samples", 100.0 * config_.diffusion.image_dropout)
              : std::string()));
    size_t initialised = 0;
    for (const auto& e : experts_) initialised += e.initialised.size();
    if (initialised > 0)
      info.push_back(
          fmt::format("{} parameters not in model.wan.weights start from their initialisation (the 3D-DSA retrofit's)",
                      initialised));
    if (validation_) {
      std::string prompts;
      for (const auto& job : validation_->jobs()) prompts += (prompts.empty() ? "\"" : ", \"") + job.prompt + "\"";
      const auto& so = validation_->options();
      info.push_back(
          fmt::format("validation videos every {} steps into {}: {} ({} {} steps, shift {}, guidance {}; umT5 {} and "
                      "the Wan VAE {})",
                      config_.train.sample_every, io::join_path(config_.output.run_dir, "samples/step-NNNNNNN"),
                      prompts, so.kind() == FlowSamplerKind::kUniPC ? "unipc" : "euler", so.steps(), so.shift(),
                      so.guidance_scale(), config_.model.text_encoder.weights, config_.model.vae.weights));
    }
  }

  std::vector<std::string> write_validation(const std::string& folder, Trainer& trainer) override {
    return validation_->write(folder, trainer);
  }
  double validation_loss(Trainer& trainer) override {
    TORCH_CHECK(val_batches_, "WanModel::validation_loss: the model was built without validation data");
    const auto trained = trained_wan_denoiser(trainer, config_);  // Wan2.2's two experts: switching at the boundary
    const auto device = trained.denoiser->device();
    torch::NoGradGuard no_grad;
    val_batches_->restore(val_start_);  // the same draws each time
    double sum = 0.0;
    for (int64_t i = 0; i < config_.train.val_batches; ++i) {
      // Wan2.2's two experts trained together: each batch on one expert's side of the boundary, drawn as each
      // training step draws it (the denoiser picks the expert of the batch's timesteps).
      if (experts_.size() == 2) val_batches_->draw_expert();
      const auto b = val_batches_->next(device);
      const auto prediction = trained.denoiser->predict(b.input(), b.timesteps, b.text, b.image);
      sum += wan_training_loss(prediction, b.target, b.loss_mask, b.loss_weight).item<double>();
    }
    return sum / static_cast<double>(config_.train.val_batches);
  }
  // diffusers' names and layout (model/wan_weights.h); two experts, diffusers' repository folders.
  void write_weights(const std::string& path, const io::NamedTensors& weights) override {
    save_wan_weights(path, config_.model.wan, weights);
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> block_modules() override {
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
    for (auto& e : experts_)
      for (size_t b = 0; b < e.split.model->blocks->size(); ++b)
        out.emplace_back(e.prefix + "blocks." + std::to_string(b) + ".", e.split.model->blocks[b]);
    return out;
  }
  // The trained DiT (two experts: the one the last step trained, the high-noise one before any step).
  WanTransformer& model() { return experts_[active_].split.model; }
  std::vector<WanTransformer> experts() const {
    std::vector<WanTransformer> out;
    for (const auto& e : experts_) out.push_back(e.split.model);
    return out;
  }
  std::vector<std::string> initialised() const {
    std::vector<std::string> out;
    for (const auto& e : experts_) out.insert(out.end(), e.initialised.begin(), e.initialised.end());
    return out;
  }

 private:
  WanBatch next_batch(MicroBatchStats& stats) {
    const auto start = std::chrono::steady_clock::now();
    auto b = batches_->next(device_);
    stats.data_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // One sample's tokens, at this batch's size (a bucket's, with data.buckets).
    stats.tokens += experts_[0].split.model->token_grid(b.x0.size(2), b.x0.size(3), b.x0.size(4)).numel();
    return b;
  }

  // The initial weights (train/wan_family.h): each expert drawn after torch::manual_seed(train.seed + its
  // index), overwritten by its weights, then by train.init_from (one plan over every expert's parameters).
  void build(const InitPlanner& init_from, const std::string& source) {
    const bool dsa = config_.model.self_attention == "dsa3d";
    const auto dsa_globs = dsa ? wan_dsa_parameter_globs() : std::vector<std::string>{};
    std::vector<std::string> allow_missing;  // the 3D-DSA retrofit's parameters, in every expert
    ParameterShapes shapes;
    for (size_t i = 0; i < experts_.size(); ++i) {
      auto& e = experts_[i];
      std::optional<WanWeights> weights;
      try {
        if (!e.weights.empty()) weights.emplace(WanWeights::open(e.weights));
      } catch (const WanWeightsError& error) {
        throw ConfigError(source, e.weights_key, error.what());
      }
      const int64_t seed = config_.train.seed + static_cast<int64_t>(i);
      torch::manual_seed(seed);
      if (!streamed_) {
        // The whole model on the CPU in fp32 (the reference the streamed mode's initialisation equals).
        e.init =
            std::make_shared<WanInitialWeights>(WanTransformer(WanOptions::from_config(latent_)), std::move(weights));
      } else {
        // The blocks a meta skeleton whose weights the engine builds one at a time; the prologue drawn as the
        // skeleton's construction drew it (the generator then where block 0 starts), the head after the
        // blocks (blocks_built).
        e.init = std::make_shared<WanInitialWeights>(
            WanTransformer(WanOptions::from_config(latent_).block_device(torch::kMeta)), std::move(weights));
        torch::manual_seed(seed);
        e.init->model->initialise_prologue();
        e.init->start_blocks();
      }
      std::vector<std::pair<std::string, std::vector<int64_t>>> own;
      for (const auto& p : e.init->model->named_parameters(true)) {
        own.emplace_back(p.key(), p.value().sizes().vec());
        shapes.emplace_back(e.prefix + p.key(), p.value().sizes().vec());
      }
      for (const auto& glob : dsa_globs) allow_missing.push_back(e.prefix + glob);
      try {
        if (e.init->weights)
          for (const auto& name : e.init->weights->check(own, dsa_globs)) e.initialised.push_back(e.prefix + name);
      } catch (const WanWeightsError& error) {
        throw ConfigError(source, e.weights_key, error.what());
      }
    }
    // init_from's tensors by expert, under the expert's own names (the longest matching prefix).
    if (init_from)
      for (const auto& [name, tensor] : init_from(shapes, allow_missing).tensors)
        for (size_t i = experts_.size(); i-- > 0;)
          if (name.rfind(experts_[i].prefix, 0) == 0) {
            experts_[i].init->init_sources.emplace(name.substr(experts_[i].prefix.size()), tensor);
            break;
          }
    std::vector<std::shared_ptr<WanStack>> stacks;
    for (auto& e : experts_) {
      auto& model = e.init->model;
      e.split.model = model;
      try {
        if (!streamed_) {
          e.init->overwrite("", *model);
          model->to(device_);
          e.init.reset();
          continue;
        }
        e.init->overwrite("patch_embedding.", *model->patch_embedding);
        e.init->overwrite("condition_embedder.", *model->condition_embedder);
      } catch (const WanWeightsError& error) {
        throw ConfigError(source, e.weights_key, error.what());
      }
      // The engine builds the blocks after make_model returned: a weights file whose block cannot be read is
      // still the config's error.
      auto block = [init = e.init, source, key = e.weights_key](int64_t l) {
        try {
          return init->block(l);
        } catch (const WanWeightsError& error) {
          throw ConfigError(source, key, error.what());
        }
      };
      e.stack = std::make_shared<WanStack>(model, block, device_);
      for (auto& [name, p] : e.stack->named_resident_parameters())
        if (!p.is_meta()) move_parameter(p, device_);  // the blocks' tables and norm2 follow in adopt_block
      stacks.push_back(e.stack);
    }
    if (streamed_)
      stack_ = stacks.size() == 1 ? std::shared_ptr<offload::StreamedModel>(stacks[0])
                                  : std::make_shared<WanExpertsStack>(std::move(stacks));
    grid_ = experts_[0].split.model->token_grid(latent_.data.frames, latent_.data.height, latent_.data.width);
  }

  const RunConfig config_;
  const RunConfig latent_;  // wan_latent_config: the latents' shape in data.*
  const torch::Device device_;
  const bool streamed_;
  std::optional<WanValidation> validation_;
  std::optional<WanBatchSource> val_batches_;  // train.val_every: the validation data
  std::string val_start_;                      // its streams' state before the first draw
  std::optional<WanBatchSource> batches_;
  std::vector<BadItem> unreported_bad_;  // the cache's items left out, until take_new_bad_items()
  int64_t items_ = 0, bad_items_ = 0;
  std::vector<WanExpert> experts_;
  size_t active_ = 0;                              // the expert the current step trains
  std::shared_ptr<offload::StreamedModel> stack_;  // streamed
  TokenGrid grid_;
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
    // The checks again on the architecture the weights gave (image-to-video's keys need it).
    if (!config.model.wan.weights.empty())
      validate(resolved, source + " (with model.wan.weights' architecture)", /*wan_sizes_resolved=*/true);
    check_expert_training(resolved, source);
    if (resolved.data.dataset == "videos" && resolved.data.cache.empty())
      throw ConfigError(
          source, "data.cache",
          "is empty: model.arch wan trains on videos through their cache of Wan VAE latents and umT5 embeddings: run "
          "megaslide-cache --config with this config, then set data.cache to its folder (docs/wan.md)");
    if (resolved.data.dataset == "latent-tensors" && resolved.data.tensors.empty())
      throw ConfigError(
          source, "data.tensors",
          "is empty: model.arch wan trains on latent videos and text embeddings (a safetensors file of latents, text "
          "and empty_text, or data.dataset: videos with data.cache; docs/wan.md)");
    check_wan_validation_config(resolved, source);  // umT5 and the Wan VAE named for validation videos
    return resolved;
  }
  RunConfig sample_config(const RunConfig& config) const override { return wan_latent_config(config); }
  std::unique_ptr<FamilyModel> make_model(const ModelRequest& request) const override {
    return std::make_unique<WanModel>(request);
  }
};

WanModel& wan_model(Trainer& trainer) {
  auto* model = dynamic_cast<WanModel*>(&trainer.model().base());
  if (model == nullptr)
    throw std::invalid_argument(std::string("the trainer trains model.arch ") + to_string(trainer.config().model.arch) +
                                ", not wan");
  return *model;
}

}  // namespace

void check_expert_training(const RunConfig& resolved, const std::string& source) {
  const auto& w = resolved.model.wan;
  if (w.expert == "both") {
    if (!w.weights.empty() && w.weights_2.empty())
      throw ConfigError(source, "model.wan.expert",
                        fmt::format("is both, but model.wan.weights '{}' is one DiT: name the low-noise expert in "
                                    "model.wan.weights_2, or give the two-expert repository (docs/wan.md)",
                                    w.weights));
    return;  // both trained: the validation videos need no other expert
  }
  if (!w.weights_2.empty() && w.expert.empty())
    throw ConfigError(source, "model.wan.expert",
                      fmt::format("is empty, but the weights are Wan2.2's two experts ('{}' and '{}'): set it to high "
                                  "(timesteps >= {} x 1000) or low to fine-tune one of them (docs/wan.md)",
                                  w.weights, w.weights_2, w.boundary_ratio));
  if (!w.expert.empty() && w.weights_2.empty() && resolved.train.sample_every > 0)
    throw ConfigError(
        source, "train.sample_every",
        fmt::format("is {}, but the validation videos of the {}-noise expert need the other one too: {} (or set "
                    "train.sample_every: 0)",
                    resolved.train.sample_every, w.expert,
                    w.expert == "high" ? "name the low-noise expert in model.wan.weights_2"
                                       : "put the high-noise expert in model.wan.weights and this low-noise one in "
                                         "model.wan.weights_2"));
}

const ModelFamily& wan_family() {
  static const WanFamily family;
  return family;
}

WanTransformer& wan_module(Trainer& trainer) { return wan_model(trainer).model(); }
std::vector<WanTransformer> wan_experts(Trainer& trainer) { return wan_model(trainer).experts(); }
std::vector<std::string> wan_initialised_parameters(Trainer& trainer) { return wan_model(trainer).initialised(); }

}  // namespace megaslide
