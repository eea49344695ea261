#include "megaslide/train/wan_validation.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "megaslide/data/latent_cache.h"
#include "megaslide/io/files.h"
#include "megaslide/io/video.h"
#include "megaslide/model/encoder_settings.h"
#include "megaslide/model/umt5_encoder.h"
#include "megaslide/model/umt5_tokenizer.h"
#include "megaslide/model/wan_vae.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/diffusion/streamed_denoiser.h"
#include "megaslide/train/trainer.h"
#include "megaslide/train/wan_family.h"
#include "megaslide/util/device.h"
#include "megaslide/util/errors.h"

namespace megaslide {

namespace {

WanVae load_vae(const RunConfig& config, torch::Device device, const std::string& source) {
  const auto& v = config.model.vae;
  try {
    return WanVae::load(v.weights, device, frozen_encoder_dtype(v.dtype, device));
  } catch (const std::exception& e) {
    throw ConfigError(source, "model.vae.weights", error_message(e));
  }
}

// The missing key, whatever train.sample_every says.
void check_encoders_named(const RunConfig& config, const std::string& source) {
  const auto& te = config.model.text_encoder;
  const auto& v = config.model.vae;
  const std::string why = fmt::format("train.sample_every is {}: Wan's validation videos", config.train.sample_every);
  const std::string fix =
      " (docs/wan.md), or name a diffusers repository with text_encoder/ and vae/ in model.wan.weights, or set "
      "train.sample_every: 0";
  if (te.kind != "umt5")
    throw ConfigError(source, "model.text_encoder.kind",
                      fmt::format("is {}, but {} encode their prompts with umT5: set model.text_encoder.kind: umt5 and "
                                  "model.text_encoder.weights{}",
                                  te.kind, why, fix));
  if (te.weights.empty())
    throw ConfigError(source, "model.text_encoder.weights",
                      fmt::format("is empty, but {} encode their prompts with umT5: set it{}", why, fix));
  if (v.kind != "wan")
    throw ConfigError(
        source, "model.vae.kind",
        fmt::format("is {}, but {} are decoded by the Wan VAE: set model.vae.kind: wan and model.vae.weights{}", v.kind,
                    why, fix));
  if (v.weights.empty())
    throw ConfigError(source, "model.vae.weights",
                      fmt::format("is empty, but {} are decoded by the Wan VAE: set it{}", why, fix));
}

}  // namespace

const std::vector<std::string>& wan_validation_prompts() {
  static const std::vector<std::string> prompts{"a red fox runs through fresh snow in a pine forest, morning light",
                                                "waves break on a rocky shore at sunset, seen from a drone"};
  return prompts;
}

void check_wan_validation_config(const RunConfig& config, const std::string& source) {
  if (config.model.arch != Architecture::kWan || config.train.sample_every <= 0) return;
  check_encoders_named(config, source);
}

WanValidation::WanValidation(const RunConfig& config, const std::vector<std::string>& captions,
                             const std::string& source)
    : config_(config),
      source_(source),
      latent_(wan_latent_config(config)),
      options_(WanSampleOptions::from_config(config)) {
  TORCH_CHECK(config.model.arch == Architecture::kWan, "WanValidation: model.arch is ", to_string(config.model.arch),
              ", expected wan");
  check_encoders_named(config, source);
  std::vector<std::string> prompts;
  std::vector<int64_t> items;
  for (size_t i = 0; i < captions.size(); ++i)
    if (static_cast<int64_t>(prompts.size()) < kWanValidationVideos && !captions[i].empty() &&
        std::find(prompts.begin(), prompts.end(), captions[i]) == prompts.end()) {
      prompts.push_back(captions[i]);
      items.push_back(static_cast<int64_t>(i));
    }
  if (prompts.empty())
    prompts.assign(wan_validation_prompts().begin(), wan_validation_prompts().begin() + kWanValidationVideos);
  videos_ = plan_validation_videos(config, prompts, source);
  for (const auto& v : videos_) jobs_.push_back(v.job);
  // The captions' items, when the videos are the captions' (not train.sample_prompts' lines).
  const bool from_captions = config.train.sample_prompts.empty() && !items.empty();
  for (size_t i = 0; i < videos_.size(); ++i) items_.push_back(from_captions && i < items.size() ? items[i] : -1);

  torch::Device device = torch::kCPU;
  try {
    device = resolve_device(config.train.device);
  } catch (const c10::Error& e) {
    throw ConfigError(source, "train.device", error_message(e));
  }
  const auto& te = config.model.text_encoder;
  std::optional<Umt5Tokenizer> tokenizer;
  std::optional<Umt5Encoder> t5;
  try {
    tokenizer.emplace(Umt5Tokenizer::find(te.vocab.empty() ? te.weights : te.vocab));
  } catch (const std::exception& e) {
    throw ConfigError(source, te.vocab.empty() ? "model.text_encoder.weights" : "model.text_encoder.vocab",
                      error_message(e));
  }
  try {
    t5.emplace(Umt5Encoder::load(te.weights, torch::kCPU, frozen_encoder_dtype(te.dtype, device), te.dtype == "fp8"));
  } catch (const std::exception& e) {
    throw ConfigError(source, "model.text_encoder.weights", error_message(e));
  }
  if (t5->config().d_model != config.model.wan.text_dim)
    throw ConfigError(source, "model.wan.text_dim",
                      fmt::format("is {} but umT5 in '{}' is {} wide (d_model)", config.model.wan.text_dim, te.weights,
                                  t5->config().d_model));
  if (tokenizer->vocab_size() > t5->config().vocab_size)
    throw ConfigError(
        source, "model.text_encoder.vocab",
        fmt::format("the tokenizer '{}' has {} pieces, umT5's embedding only {}: not this model's tokenizer",
                    tokenizer->source(), tokenizer->vocab_size(), t5->config().vocab_size));
  // umT5-XXL (11.4 GB in bf16) streamed layer by layer when it would take more than half of the GPU, as
  // megaslide-sample decides.
  const bool stream = should_stream(StreamChoice::kAuto, device, t5->weight_bytes());
  t5.emplace(stream ? Umt5Encoder::streamed(std::move(*t5), device) : Umt5Encoder::resident(std::move(*t5), device));
  // WanTextToVideo::encode's steps, one prompt at a time.
  auto encode = [&](const std::string& prompt) {
    torch::NoGradGuard no_grad;
    const auto tokens =
        tokenizer->encode({options_.clean_prompts() ? wan_prompt_clean(prompt) : prompt}, options_.text_tokens());
    return t5->embed(tokens.ids.to(t5->device()), tokens.mask.to(t5->device())).to(torch::kCPU, torch::kFloat32);
  };
  for (const auto& job : jobs_) {
    text_.push_back(encode(job.prompt));
    // The negative prompt of each video that uses guidance: its own, or the run's; each text encoded once.
    const std::string negative = job.negative_prompt.value_or(options_.negative_prompt());
    if (job.guidance_scale.value_or(options_.guidance_scale()) != 1.0 && !negatives_.count(negative))
      negatives_.emplace(negative, encode(negative));
  }
  t5.reset();  // umT5 is not needed again

  // The VAE now, so that a bad one stops the run before it trains; loaded again for each validation.
  const WanVae vae = load_vae(config, torch::kCPU, source);
  if (vae.config().z_dim != config.model.wan.out_channels)
    throw ConfigError(
        source, "model.vae.weights",
        fmt::format("the Wan VAE in '{}' has {} latent channels but the DiT's model.wan.out_channels is {}",
                    config.model.vae.weights, vae.config().z_dim, config.model.wan.out_channels));
  if (vae.config().spatial_downscale() != config.model.vae.downscale)
    throw ConfigError(source, "model.vae.downscale",
                      fmt::format("is {} but the Wan VAE in '{}' maps {} pixels to a latent: set it to {}",
                                  config.model.vae.downscale, config.model.vae.weights,
                                  vae.config().spatial_downscale(), vae.config().spatial_downscale()));
}

bool wan_validation_from_images(const RunConfig& config) {
  return wan_image_to_video(config.model.wan) || config.diffusion.first_frame_clean > 0;
}

void WanValidation::images(const WanLatentData& data) {
  const int64_t N = data.size();
  // TI2V: the clip's own first latent frame is the image; image-to-video DiTs: the cached conditioning video.
  const bool first_frame = !wan_image_to_video(config_.model.wan);
  const char* const key = first_frame ? "latents" : "image_latents";
  TORCH_CHECK(N >= 1, "WanValidation::images: no items");
  const auto bracketed = [](const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); };
  // An item's latent shape [C, T, H, W] without reading it: its bucket's, each bucket's looked up once.
  std::vector<std::vector<int64_t>> bucket_shapes(static_cast<size_t>(data.num_buckets()));
  for (int64_t b = 0; b < data.num_buckets(); ++b)
    if (const auto s = data.sizes(key, data.bucketed() ? b : -1))
      bucket_shapes[static_cast<size_t>(b)].assign(s->begin() + 1, s->end());
  const auto shape_of = [&](int64_t item) -> const std::vector<int64_t>& {
    const auto& s =
        bucket_shapes.at(data.bucketed() ? static_cast<size_t>(data.bucket_of.at(static_cast<size_t>(item))) : 0);
    TORCH_CHECK(!s.empty(), "WanValidation::images: the data has no ", key);
    return s;
  };
  conditions_.clear();
  for (size_t i = 0; i < videos_.size(); ++i) {
    auto& video = videos_[i];
    const bool own_size = video.job.frames || video.job.height || video.job.width;
    int64_t item = items_[i];
    if (item < 0 && !own_size) item = static_cast<int64_t>(i) % N;
    if (item >= 0) {
      // At its item's size (its bucket's), recorded in index.json where it is not the run's. TI2V takes the item's
      // first frame alone: the video keeps its own length.
      auto shape = shape_of(item);
      if (first_frame) shape[1] = video.shape[1];
      if (shape != video.shape) {
        const int64_t ds = config_.model.vae.downscale;
        video.shape = shape;
        video.job.frames = 1 + 4 * (shape[1] - 1), video.job.height = shape[2] * ds, video.job.width = shape[3] * ds;
        jobs_[i] = video.job;
      }
    } else {  // a line of its own size: the first item from i mod N on that has it
      for (int64_t k = 0; k < N && item < 0; ++k) {
        const int64_t candidate = (static_cast<int64_t>(i) + k) % N;
        const auto& c = shape_of(candidate);
        if (first_frame ? c[0] == video.shape[0] && c[2] == video.shape[2] && c[3] == video.shape[3] : c == video.shape)
          item = candidate;
      }
      if (item < 0)
        throw ConfigError(source_, "train.sample_prompts",
                          fmt::format("validation video {} ('{}') is {} in latents, but image-to-video's images are "
                                      "the data's, of which none has that size (the first item's: {}): give its line "
                                      "no size of its own, or one of the data's",
                                      i, video.job.prompt, bracketed(video.shape), bracketed(shape_of(0))));
    }
    // index.json says where the video's image came from (the data's: a prompt line's --i is refused here).
    if (!video.job.image) {
      if (data.cache) {
        const int64_t at = data.cache_items.at(static_cast<size_t>(item));
        const std::string& own = first_frame ? std::string() : data.cache->image(at);
        video.job.image = !own.empty()  ? own + " (the image of " + data.cache->path(at) + ")"
                          : first_frame ? data.cache->path(at) + " (its first frame)"
                                        : fmt::format("{} (frame {})", data.cache->path(at), config_.data.image_frame);
      } else {
        video.job.image = fmt::format("data.tensors item {} ({})", item, first_frame ? "its first frame" : key);
      }
      jobs_[i] = video.job;
    }
    WanImageCondition c;
    if (first_frame) {
      c.latents = data.rows("latents", {item}).narrow(2, 0, 1).contiguous();
    } else {
      c.latents = data.rows("image_latents", {item});
      c.image = data.rows("image_embeds", {item});
    }
    conditions_.push_back(std::move(c));
  }
}

TrainedWanDenoiser trained_wan_denoiser(Trainer& trainer, const RunConfig& config) {
  trainer.synchronize();  // the host updates of the last step have landed in the store
  const auto experts = wan_experts(trainer);
  TrainedWanDenoiser out;
  // One trained DiT as a denoiser; streamed, its blocks are the store's from `first_block` on.
  auto trained = [&](WanTransformer model, int64_t first_block) -> std::shared_ptr<WanDenoiser> {
    out.modes.push_back(std::make_unique<WanTrainingModeGuard>(model));
    auto* engine = trainer.engine();
    if (engine == nullptr)
      return std::make_shared<ResidentWanDenoiser>(model, trainer.device(),
                                                   at::kFloat);  // the module itself: fp32, on its device
    // Each block from the store as the trainer's next step uploads it: the compute copy, or the master
    // with fp32 compute (the transfer buffer then holds gradients; a sharded store's holds the copy).
    const auto& store = engine->store();
    const auto dtype = engine->options().compute_dtype;
    std::vector<WanBlockWeights> blocks;
    for (int64_t b = 0; b < static_cast<int64_t>(model->blocks->size()); ++b) {
      const int64_t l = first_block + b;
      const auto& streamed = model->blocks[b]->as<WanBlockImpl>()->streamed();
      WanBlockWeights w;
      static_cast<StreamedBlockWeights&>(w) = stored_block_weights(store, l, streamed);
      if (store.scales(l).defined()) {  // an fp8 frozen base: each parameter's scale and exact value, in module order
        std::map<std::string, int64_t> index;  // the parameter's place in the store's block (its fp8 scale's)
        for (const auto& spec : store.block_spec(l).params)
          index.emplace(spec.name, static_cast<int64_t>(index.size()));
        std::vector<float> scales;
        for (const auto& item : streamed.named_parameters(true)) {
          scales.push_back(store.scales(l)[index.at(item.key())].item<float>());
          w.exact.push_back(store.param(l, item.key()).exact);
        }
        w.scales = torch::tensor(scales, torch::kFloat);
      }
      blocks.push_back(std::move(w));
    }
    StreamedDenoiserOptions streamed;
    streamed.device = trainer.device();
    streamed.compute_dtype = dtype;
    streamed.mode = engine->options().mode;
    streamed.lent_streamer = &engine->lend_streamer();  // the trainer's slots: no device memory of its own
    streamed.lent_first_block = first_block;
    return std::make_shared<StreamedWanDenoiser>(model, std::move(blocks), streamed);
  };
  out.denoiser = trained(experts[0], 0);
  if (experts.size() == 2)  // Wan2.2's two experts, both trained
    out.denoiser = std::make_shared<WanExpertsDenoiser>(out.denoiser, trained(experts[1], experts[0]->options.layers()),
                                                        config.model.wan.boundary_ratio);
  return out;
}

std::vector<torch::Tensor> WanValidation::sample(Trainer& trainer) const {
  const auto trained = trained_wan_denoiser(trainer, config_);
  std::shared_ptr<WanDenoiser> denoiser = trained.denoiser;
  const auto& w = config_.model.wan;
  // One of Wan2.2's experts trained: the other one, from its weights as published (dense), streamed block
  // by block in the trainer's compute dtype, takes its own timesteps.
  if (!wan_untrained_expert(w).empty()) {
    StreamedDenoiserOptions so;
    so.device = trainer.device();
    so.compute_dtype = trainer.engine() ? trainer.engine()->options().compute_dtype : at::kFloat;
    so.pin_host_memory = false;  // read for each validation: not worth page-locking 28 GB each time
    std::shared_ptr<WanDenoiser> frozen;
    try {
      WanModel other = load_untrained_expert(config_, true);  // its blocks meta skeletons, read as they stream
      // The trainer's slots where the blocks are alike, judged from the skeletons before any block is read: as many
      // streamed elements a block, uploaded in the compute dtype (not over an fp8 base; not where the trained expert
      // has the 3D-DSA retrofit's parameters and the other, dense, has none). Else a streamer of its own.
      if (auto* engine = trainer.engine(); engine && engine->store().transfer_dtype() == so.compute_dtype) {
        const auto& slots = engine->streamer();
        const int64_t L = static_cast<int64_t>(other.dit->blocks->size());
        bool alike = L <= slots.num_blocks();
        for (int64_t l = 0; alike && l < L; ++l) {
          int64_t n = 0;
          for (const auto& p : other.dit->blocks[l]->as<WanBlockImpl>()->streamed().parameters(true)) n += p.numel();
          alike = n == slots.block_numel(l);
        }
        if (alike) {
          so.mode = engine->options().mode;
          so.lent_streamer = &engine->lend_streamer();
        }
      }
      frozen = std::make_shared<StreamedWanDenoiser>(std::move(other), so);
    } catch (const WanWeightsError& e) {
      throw ConfigError(source_, w.expert == "high" ? "model.wan.weights_2" : "model.wan.weights", e.what());
    }
    denoiser = w.expert == "high" ? std::make_shared<WanExpertsDenoiser>(denoiser, frozen, w.boundary_ratio)
                                  : std::make_shared<WanExpertsDenoiser>(frozen, denoiser, w.boundary_ratio);
  }
  TORCH_CHECK(!wan_validation_from_images(config_) || conditions_.size() == videos_.size(),
              "WanValidation: image-to-video's validation needs its images (WanValidation::images)");
  const bool first_frame = !conditions_.empty() && !wan_image_to_video(w);  // TI2V: the first frame kept clean
  std::vector<torch::Tensor> latents;
  for (size_t i = 0; i < videos_.size(); ++i) {
    // Image-to-video: the image's conditioning channels (and tokens) for both halves of the guided batch.
    torch::Tensor channels, tokens;
    std::optional<WanFirstFrame> first;  // as WanTextToVideo::sample_from_image
    if (first_frame) {
      first.emplace(conditions_[i].latents.to(denoiser->device(), torch::kFloat32), videos_[i].shape, w.patch);
    } else if (!conditions_.empty()) {
      channels = wan_image_condition(conditions_[i].latents).to(denoiser->device());
      if (conditions_[i].image.defined()) tokens = conditions_[i].image.to(denoiser->device());
    }
    auto predict = [&](const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                       const torch::Tensor&) {
      if (first) return denoiser->predict(first->mix(x), first->timesteps(t), text);
      if (!channels.defined()) return denoiser->predict(x, t, text);
      const int64_t rows = x.size(0);
      return denoiser->predict(torch::cat({x, channels.expand({rows, -1, -1, -1, -1})}, 1), t, text,
                               tokens.defined() ? tokens.expand({rows, -1, -1}) : torch::Tensor());
    };
    const auto& job = videos_[i].job;
    auto flow = options_.flow();
    if (job.steps) flow.steps(*job.steps);
    if (job.guidance_scale) flow.guidance_scale(*job.guidance_scale);
    Conditioning cond, uncond;
    cond.text = text_[i].to(denoiser->device());
    if (flow.guidance_scale() != 1.0)
      uncond.text = negatives_.at(job.negative_prompt.value_or(options_.negative_prompt())).to(denoiser->device());
    auto sampled = flow_sample(predict, flow, videos_[i].shape, {job.seed}, cond, uncond, denoiser->device());
    latents.push_back((first ? first->mix(sampled) : sampled).to(torch::kCPU));
  }
  return latents;
}

std::vector<std::string> WanValidation::write(const std::string& dir, Trainer& trainer) const {
  const auto latents = sample(trainer);
  const WanVae vae = load_vae(config_, trainer.device(), source_);
  const auto tiling = wan_vae_tiling(config_.model.vae);
  const std::string videos_dir = io::join_path(dir, io::kVideosFolder);
  io::make_directories(videos_dir);
  std::vector<std::string> files;
  int64_t upscale = 1;
  for (size_t i = 0; i < jobs_.size(); ++i) {
    torch::Tensor video;
    {
      torch::NoGradGuard no_grad;
      video = vae.decode(latents[i].to(vae.device(), torch::kFloat32), tiling)[0].to(torch::kCPU, torch::kFloat32);
    }
    upscale = (video.size(2) % 2 != 0 || video.size(3) % 2 != 0) ? 2 : 1;  // H.264 needs even sizes
    io::write_mp4(io::join_path(videos_dir, jobs_[i].file), io::to_rgb_frames(video, upscale),
                  io::VideoWriteOptions().fps(wan_video_fps(config_)));
    files.push_back(jobs_[i].file);
  }
  io::SamplingRecord record{"(training run)",
                            options_.kind() == FlowSamplerKind::kUniPC ? "unipc" : "euler",
                            options_.steps(),
                            options_.guidance_scale(),
                            0.0,
                            config_.train.seed,
                            wan_video_fps(config_),
                            upscale,
                            options_.boundary_ratio(),
                            options_.guidance_scale_2() < 0 ? options_.guidance_scale() : options_.guidance_scale_2()};
  record.shift = options_.shift();
  record.negative_prompt = options_.negative_prompt();
  io::write_file_atomically(io::join_path(dir, "index.json"), io::index_json(jobs_, record));
  return files;
}

}  // namespace megaslide
