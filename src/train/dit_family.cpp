// The DiT family (megaslide, dense3d, swin) behind train/model_family.h (train/dit_family.h says how it
// is built and split for streaming).
#include "megaslide/train/dit_family.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "megaslide/diffusion/streamed_denoiser.h"
#include "megaslide/diffusion/text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/model/dit_weights.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/trainer.h"

namespace megaslide {

namespace {

class DiTModel final : public FamilyModel {
 public:
  explicit DiTModel(const ModelRequest& request)
      : config_(*request.config),
        device_(request.device),
        streamed_(request.streamed),
        context_group_(request.context_group),
        batches_(config_) {
    // The same seed and construction order in both modes: the streamed DiT's blocks are a meta skeleton
    // whose weights DiTStack::initial_block builds one at a time into the host store (a block's weights
    // depend only on the DiT's init seed and its index, model/dit.h).
    torch::manual_seed(config_.train.seed);
    auto options = DiTOptions::from_config(config_);
    dit_ = DiT(streamed_ ? options.block_device(torch::kMeta) : options);
    if (config_.model.text_encoder.kind == "builtin")  // CLIP is frozen and lives in batches_.frozen()
      text_encoder_ = TextEncoder(
          TextEncoderOptions(batches_.tokenizer().vocab_size(), config_.model.text_dim, config_.data.max_text_tokens));
    const auto shape = model_sample_shape(config_);
    grid_ = dit_->token_grid(shape[1], shape[2], shape[3]);
    if (request.init_from) {
      ParameterShapes shapes;
      for (const auto& [name, p] : named_parameters()) shapes.emplace_back(name, p.sizes().vec());
      init_ = request.init_from(shapes, {});
    }
    if (streamed_) {
      dit_->move_non_block_parts(device_);  // the blocks' weights go to the host store inside the engine
    } else {
      dit_->to(device_);
    }
    if (text_encoder_) text_encoder_->to(device_);
    if (!init_.tensors.empty()) {  // the parts built now; a streamed block's as DiTStack builds it
      auto params = named_parameters();
      std::map<std::string, torch::Tensor> by_name(params.begin(), params.end());
      torch::NoGradGuard no_grad;
      for (const auto& [name, source] : init_.tensors)
        if (!streamed_ || name.rfind("blocks.", 0) != 0) source.read_into(by_name.at(name));
    }
    if (streamed_) stack_ = std::make_shared<DiTStack>(dit_, text_encoder_, &init_);
    if (request.validation)  // a bad prompt file stops the run now, not at its first validation
      validation_ = plan_validation_videos(
          config_,
          dit_validation_prompts(config_, 4,
                                 config_.data.dataset == "videos" ? batches_.captions(4) : std::vector<std::string>{}),
          request.source);
    if (request.validation_data != nullptr) {  // its dataset opened now: a bad one stops the run before it starts
      val_batches_ = make_validation_source(request.source, [&] {
        return std::make_unique<DiffusionBatchSource>(*request.validation_data, batches_.frozen());
      });
      val_start_ = val_batches_->state();
    }
  }

  io::NamedTensors named_parameters() override {
    io::NamedTensors out;
    for (const auto& p : dit_->named_parameters(true)) out.emplace_back(p.key(), p.value());
    if (text_encoder_)
      for (const auto& p : text_encoder_->named_parameters(true))
        out.emplace_back("text_encoder." + p.key(), p.value());
    return out;
  }
  std::shared_ptr<offload::StreamedModel> stack() override { return stack_; }
  void blocks_built() override { init_ = InitPlan(); }  // the file's mapping closed

  at::Tensor loss(MicroBatchStats& stats) override {
    const auto b = batches_.next(device_);
    stats.data_wait_s += b.data_wait_s;
    stats.tokens += dit_->token_grid(b.xt.size(2), b.xt.size(3), b.xt.size(4)).numel();
    const auto text = b.text.defined() ? b.text : text_encoder_(b.text_ids);
    if (context_group_ == nullptr)
      return context_parallel_loss(dit_(b.xt, b.timesteps, text, b.text_mask), b.target, {}, {}, 1, b.loss_weight);
    auto e = dit_->embed(b.xt, b.timesteps, text, b.text_mask, context_group_);  // this rank's frames
    auto h = e.tokens;
    for (const auto& block : *dit_->blocks) h = block->as<DiTBlockImpl>()->forward(h, e.ctx);
    return context_parallel_loss(dit_->head(h, e.t_emb, e.ctx.local_grid()), b.target, {}, e.ctx.cp,
                                 config_.model.patch[0], b.loss_weight);
  }
  offload::StackInput prologue(MicroBatchStats& stats) override {
    const auto b = batches_.next(device_);
    stats.data_wait_s += b.data_wait_s;
    target_ = b.target;
    loss_weight_ = b.loss_weight;
    const auto text = b.text.defined() ? b.text : text_encoder_(b.text_ids);
    auto e = dit_->embed(b.xt, b.timesteps, text, b.text_mask, context_group_);
    t_emb_ = e.t_emb;
    last_cp_ = e.ctx.cp;
    last_grid_ = e.ctx.local_grid();
    stats.tokens += e.ctx.grid.numel();
    offload::StackInput in;
    in.hidden = e.tokens;
    in.inputs.tensors = {e.ctx.t_mod, e.ctx.text, e.ctx.text_mask};
    in.inputs.info = DiTStackInfo{e.ctx.grid, e.ctx.cp};
    return in;
  }
  at::Tensor epilogue(const at::Tensor& last_hidden) override {
    return context_parallel_loss(dit_->head(last_hidden, t_emb_, last_grid_), target_, {}, last_cp_,
                                 config_.model.patch[0], loss_weight_);
  }

  std::string data_state() const override { return batches_.state(); }
  void restore_data(const std::string& state) override { batches_.restore(state); }
  void take_slice(int64_t rank, int64_t world_size) override { batches_.take_slice(rank, world_size); }
  std::string describe_data(int64_t steps) const override { return batches_.describe(steps); }
  std::vector<BadItem> take_new_bad_items() override { return batches_.take_new_bad_items(); }

  int64_t tokens_per_sample() const override { return grid_.numel(); }
  double flops_per_step() const override { return model_flops_per_step(config_); }

  void describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const override {
    for (auto& notice : batches_.notices()) warnings.push_back("data: " + notice);
    // Real captions with the built-in caption encoder: its vocabulary is the structured-motion captions' words, so
    // most of theirs would train as <unk> without a word said.
    if (config_.model.text_encoder.kind == "builtin" && config_.data.dataset == "videos") {
      const CaptionTokenizer tokenizer;
      int64_t words = 0, unknown = 0;
      std::vector<std::string> examples;
      const auto captions = batches_.captions(1000);
      for (const auto& caption : captions) {
        int64_t n = 0;
        const auto missing = tokenizer.unknown_words(caption, &n, config_.data.max_text_tokens - 1);
        words += n;
        for (const auto& w : missing) {
          ++unknown;
          if (examples.size() < 5 && std::find(examples.begin(), examples.end(), w) == examples.end())
            examples.push_back(w);
        }
      }
      if (unknown > 0) {
        std::string listed;
        for (const auto& w : examples) listed += (listed.empty() ? "'" : ", '") + w + "'";
        warnings.push_back(fmt::format(
            "the built-in caption encoder knows only the structured-motion vocabulary: {} of the {} words of the "
            "first {} captions ({:.0f}%) become <unk> (e.g. {}); for real captions use CLIP's text encoder "
            "(model.text_encoder.kind: clip, docs/conditioning.md)",
            unknown, words, captions.size(), 100.0 * static_cast<double>(unknown) / static_cast<double>(words),
            listed));
      }
    }
    if (!validation_.empty()) {
      std::string prompts;
      for (const auto& v : validation_) prompts += (prompts.empty() ? "\"" : ", \"") + v.job.prompt + "\"";
      info.push_back(
          fmt::format("validation videos every {} steps into {}: {}{}", config_.train.sample_every,
                      io::join_path(config_.output.run_dir, "samples/step-NNNNNNN"), prompts,
                      config_.train.sample_prompts.empty() ? "" : " (from " + config_.train.sample_prompts + ")"));
    }
    if (config_.model.text_encoder.kind == "clip")
      info.push_back(fmt::format("text encoder: CLIP from {} (frozen), {} tokens of width {}",
                                 config_.model.text_encoder.weights, config_.data.max_text_tokens,
                                 config_.model.text_dim));
    if (config_.model.vae.kind == "sd") {
      const auto shape = model_sample_shape(config_);
      info.push_back(fmt::format(
          "latent space: SD VAE from {} (frozen, {} frames per call): {}x{}x{} pixels -> latents {}x{}x{}x{}",
          config_.model.vae.weights, config_.model.vae.frames_per_batch, config_.data.frames, config_.data.height,
          config_.data.width, shape[0], shape[1], shape[2], shape[3]));
    }
    const auto& d = config_.data;
    if (d.dataset == "videos")
      info.push_back(d.cache.empty() ? fmt::format("data: decoding {} ({} loader workers, {} batches ahead)",
                                                   d.manifest.empty() ? d.root : d.manifest, d.workers, d.prefetch)
                                     : fmt::format("data: cache {} ({} loader workers, {} batches ahead)", d.cache,
                                                   d.workers, d.prefetch));
  }

  std::vector<std::string> write_validation(const std::string& folder, Trainer& trainer) override {
    if (!streamed_)
      return write_validation_samples(folder, config_, dit_, text_encoder_, validation_, batches_.frozen());
    if (config_.lora.rank > 0) {
      take_snapshot(trainer);
      return write_validation_samples(folder, config_, snapshot_dit_, snapshot_text_, validation_, batches_.frozen());
    }
    const EvalMode mode{dit_, text_encoder_};
    return write_validation_samples(folder, config_, dit_, text_encoder_, validation_, batches_.frozen(),
                                    store_denoiser(trainer));
  }
  double validation_loss(Trainer& trainer) override {
    TORCH_CHECK(val_batches_, "DiTModel::validation_loss: the model was built without validation data");
    // Resident, the model itself; streamed, its blocks from the trainer's host store on the trainer's device
    // (a LoRA run: a CPU model of its current weights).
    const bool snapshot = streamed_ && config_.lora.rank > 0;
    if (snapshot) take_snapshot(trainer);
    DiT dit = snapshot ? snapshot_dit_ : dit_;
    TextEncoder text = snapshot ? snapshot_text_ : text_encoder_;
    const torch::Device device = snapshot ? torch::Device(torch::kCPU) : device_;
    const EvalMode mode{dit, text};  // eval mode (no LoRA dropout) while measuring
    dit->eval();
    if (text) text->eval();
    const std::shared_ptr<Denoiser> streamed = streamed_ && !snapshot ? store_denoiser(trainer) : nullptr;
    torch::NoGradGuard no_grad;
    val_batches_->restore(val_start_);  // the same draws each time
    double sum = 0.0;
    for (int64_t i = 0; i < config_.train.val_batches; ++i) {
      const auto b = val_batches_->next(device);
      const auto t = b.text.defined() ? b.text : text(b.text_ids);
      const auto prediction =
          streamed ? streamed->predict(b.xt, b.timesteps, t, b.text_mask) : dit(b.xt, b.timesteps, t, b.text_mask);
      sum += context_parallel_loss(prediction, b.target, {}, {}, 1, b.loss_weight).item<double>();
    }
    return sum / static_cast<double>(config_.train.val_batches);
  }
  void write_weights(const std::string& path, const io::NamedTensors& weights) override {
    save_weights(path, config_, weights);
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> block_modules() override {
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
    for (size_t b = 0; b < dit_->blocks->size(); ++b)
      out.emplace_back("blocks." + std::to_string(b) + ".", dit_->blocks[b]);
    return out;
  }

  DiT& dit() { return dit_; }
  TextEncoder& text_encoder() { return text_encoder_; }
  DiffusionBatchSource& batches() { return batches_; }

 private:
  // The modes of a DiT and its text encoder, restored when it goes out of scope.
  struct EvalMode {
    DiT dit;
    TextEncoder text;
    bool dit_training = dit->is_training(), text_training = text && text->is_training();
    ~EvalMode() {
      dit->train(dit_training);
      if (text) text->train(text_training);
    }
  };

  // The streamed trainer's current weights as a denoiser on its device, without a copy: each block streamed from
  // the host store as the next step uploads it (the compute copy, or the fp32 masters with fp32 compute), the
  // prologue, head and text encoder the trainer's own. Leaves the module in eval mode (EvalMode restores it).
  std::shared_ptr<Denoiser> store_denoiser(Trainer& trainer) {
    trainer.synchronize();  // the host updates of the last step have landed in the store
    auto* engine = trainer.engine();
    TORCH_CHECK(engine != nullptr, "DiTModel: the trainer is not streamed");
    const auto& store = engine->store();
    std::vector<StreamedBlockWeights> blocks;
    for (int64_t l = 0; l < static_cast<int64_t>(dit_->blocks->size()); ++l)
      blocks.push_back(stored_block_weights(store, l, *dit_->blocks[l]));
    StreamedDenoiserOptions options;
    options.device = trainer.device();
    options.compute_dtype = engine->options().compute_dtype;
    options.mode = engine->options().mode;
    options.lent_streamer = &engine->lend_streamer();  // the trainer's slots: no device memory of its own
    return std::make_shared<StreamedDenoiser>(dit_, std::move(blocks), options);
  }

  // A CPU model of a streamed LoRA run's current weights (its frozen model with the adapters' updates merged,
  // fp32), built once and refilled at each use.
  void take_snapshot(Trainer& trainer) {
    if (!snapshot_dit_) {
      snapshot_dit_ = DiT(DiTOptions::from_config(config_));
      if (config_.model.text_encoder.kind == "builtin")  // CLIP is frozen: no trained text encoder to copy
        snapshot_text_ = TextEncoder(
            TextEncoderOptions(CaptionTokenizer().vocab_size(), config_.model.text_dim, config_.data.max_text_tokens));
    }
    TORCH_CHECK(config_.lora.rank > 0, "DiTModel::take_snapshot: for a LoRA run (full ones stream from the store)");
    copy_weights_to(trainer.merged_lora_weights(trainer.weight_views(), at::kFloat), snapshot_dit_, snapshot_text_);
  }

  const RunConfig config_;
  const torch::Device device_;
  const bool streamed_;
  ops::FrameExchange* const context_group_;  // context parallelism, else null
  DiffusionBatchSource batches_;             // the model's own random streams, not LibTorch's global one
  DiT dit_{nullptr};
  TextEncoder text_encoder_{nullptr};
  std::shared_ptr<DiTStack> stack_;  // streamed mode
  InitPlan init_;
  TokenGrid grid_;
  std::vector<ValidationVideo> validation_;
  DiT snapshot_dit_{nullptr};
  TextEncoder snapshot_text_{nullptr};
  std::unique_ptr<DiffusionBatchSource> val_batches_;  // train.val_every: the validation data
  std::string val_start_;                              // its streams' state before the first draw
  // The micro-batch between prologue and epilogue.
  torch::Tensor target_, t_emb_, loss_weight_;
  TokenGrid last_grid_;  // this rank's frames' grid
  ops::ContextShard last_cp_;
};

class DiTFamily final : public ModelFamily {
 public:
  std::string name() const override { return "DiT"; }
  RunConfig resolve(const RunConfig& config, const std::string& /*source*/) const override { return config; }
  std::unique_ptr<FamilyModel> make_model(const ModelRequest& request) const override {
    return std::make_unique<DiTModel>(request);
  }
};

DiTModel& dit_model(Trainer& trainer) {
  auto* model = dynamic_cast<DiTModel*>(&trainer.model().base());
  if (model == nullptr)
    throw std::invalid_argument(std::string("the trainer trains model.arch ") + to_string(trainer.config().model.arch) +
                                ", not the DiT family");
  return *model;
}

}  // namespace

const ModelFamily& dit_family() {
  static const DiTFamily family;
  return family;
}

DiT& dit_module(Trainer& trainer) { return dit_model(trainer).dit(); }
TextEncoder& dit_text_encoder(Trainer& trainer) { return dit_model(trainer).text_encoder(); }
DiffusionBatchSource& dit_batches(Trainer& trainer) { return dit_model(trainer).batches(); }

void copy_weights_to(const io::NamedTensors& weights, DiT& dit, TextEncoder& text_encoder) {
  auto dit_params = dit->named_parameters();
  auto text_params = text_encoder ? text_encoder->named_parameters() : torch::OrderedDict<std::string, torch::Tensor>();
  torch::NoGradGuard no_grad;
  size_t copied = 0;
  for (const auto& [name, value] : weights) {  // one tensor at a time: no copy of the whole model
    const bool is_text = name.rfind("text_encoder.", 0) == 0;
    const std::string key = is_text ? name.substr(13) : name;
    torch::Tensor* target = is_text ? text_params.find(key) : dit_params.find(key);  // no text_encoder.* with CLIP
    TORCH_CHECK(target != nullptr, "copy_weights_to: the target model has no parameter '", name,
                "' (was it built from this trainer's config?)");
    TORCH_CHECK(target->sizes() == value.sizes(), "copy_weights_to: '", name, "' is ", target->sizes(),
                " in the target model but ", value.sizes(), " in the trainer");
    target->copy_(value);
    ++copied;
  }
  TORCH_CHECK(copied == dit_params.size() + text_params.size(), "copy_weights_to: copied ", copied,
              " parameters but the target model has ", dit_params.size() + text_params.size());
}

}  // namespace megaslide
