#include "megaslide/train/dit_batches.h"

#include "megaslide/data/latent_cache.h"
#include "megaslide/data/loader.h"
#include "megaslide/data/video_dataset.h"
#include "offload/streams.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "megaslide/train/auto_settings.h"
#include "megaslide/train/distributed.h"

namespace megaslide {

// data.dataset: videos — the clips come from a ClipLoader over the decoded files or the cache.
struct DiffusionBatchSource::Videos {
  std::shared_ptr<const ClipSource> source;
  std::unique_ptr<ClipLoader> loader;
  std::vector<BadItem> unreported;            // found and not yet handed to take_new_bad_items()
  std::map<std::string, std::string> failed;  // items that failed to load, each counted once, and why
  std::vector<BadItem> known_bad;             // from listing and probing (or the cache)
  int64_t listed = 0;
  std::vector<std::string> notices;  // VideoDataset::notices() (decoding; a cache's were shown when it was built)
  ClipSample empty_prompt;           // the cache's: text tensors of the empty prompt

  // Throws DatasetError listing every bad item once more than data.max_bad_fraction of the items are bad.
  void check(const DataConfig& data) const {
    const int64_t bad = static_cast<int64_t>(known_bad.size() + failed.size());
    if (static_cast<double>(bad) <= data.max_bad_fraction * static_cast<double>(listed)) return;
    std::vector<BadItem> all = known_bad;
    for (const auto& [path, reason] : failed) all.push_back({0, path, reason});
    throw DatasetError(fmt::format("dataset: {} of {} items are bad, more than data.max_bad_fraction ({}) allows:{}",
                                   bad, listed, data.max_bad_fraction, bad_item_list(all)));
  }
};

DiffusionBatchSource::DiffusionBatchSource(const RunConfig& config, std::shared_ptr<FrozenEncoders> frozen)
    : config_(config),
      dataset_(StructuredMotionOptions()
                   .channels(config.data.channels)
                   .frames(config.data.frames)
                   .height(config.data.height)
                   .width(config.data.width)
                   .num_clips(config.data.num_clips)
                   .seed(config.data.seed)),
      sampler_(config.data.num_clips, config.train.seed),
      schedule_(config.diffusion.timesteps, parse_beta_schedule(config.diffusion.beta_schedule),
                config.diffusion.beta_start, config.diffusion.beta_end),
      prediction_(parse_prediction(config.diffusion.prediction)),
      loss_weighting_(parse_loss_weighting(config.diffusion.loss_weighting)),
      caption_rng_(config.train.seed ^ 0x5DEECE66Dull),
      generator_(at::detail::createCPUGenerator(config.train.seed)) {
  // A cache holds the frozen encoders' outputs: training then loads neither (sampling loads them itself).
  if (config.data.dataset != "videos" || config.data.cache.empty())
    frozen_ = frozen ? std::move(frozen) : FrozenEncoders::load(config, resolve_device(config.train.device), "config");
  if (config.data.dataset != "videos") return;
  videos_ = std::make_unique<Videos>();
  const auto& d = config.data;
  if (!d.cache.empty()) {
    auto cache = LatentCache::open(config, d.cache);
    videos_->known_bad = cache->bad();
    videos_->listed = cache->listed();
    videos_->empty_prompt = cache->empty_prompt();
    videos_->source = cache;
  } else {
    auto dataset =
        std::make_shared<VideoDataset>(VideoDataset::open(d, static_cast<int>(std::max<int64_t>(1, d.workers))));
    dataset->check_bad_fraction();
    videos_->known_bad = dataset->bad();
    videos_->listed = dataset->listed();
    videos_->notices = dataset->notices();
    videos_->source = decoding_source(dataset);
  }
  videos_->unreported = videos_->known_bad;
  videos_->loader = make_loader(0, -1);
}

std::unique_ptr<ClipLoader> DiffusionBatchSource::make_loader(int64_t slots_begin, int64_t slots_count) const {
  std::vector<int64_t> bucket_of;
  for (int64_t i = 0; i < videos_->source->size(); ++i) bucket_of.push_back(videos_->source->bucket_of(i));
  LoaderOptions options;
  options.workers = config_.data.workers;
  options.prefetch = config_.data.prefetch;
  options.pin_memory = resolve_device(config_.train.device).is_cuda();
  options.seed = config_.train.seed;
  options.slots_begin = slots_begin;
  options.slots_count = slots_count;
  return std::make_unique<ClipLoader>(
      videos_->source,
      BucketBatchSampler(bucket_of, videos_->source->num_buckets(), config_.train.batch_size, config_.train.seed),
      options);
}

DiffusionBatchSource::~DiffusionBatchSource() = default;

std::vector<BadItem> DiffusionBatchSource::take_new_bad_items() {
  if (!videos_) return {};
  return std::exchange(videos_->unreported, {});
}

std::string DiffusionBatchSource::describe(int64_t steps) const {
  if (!videos_) return "";
  const auto& src = *videos_->source;
  std::vector<int64_t> per_bucket(static_cast<size_t>(std::max<int64_t>(1, src.num_buckets())), 0);
  for (int64_t i = 0; i < src.size(); ++i) ++per_bucket[static_cast<size_t>(src.bucket_of(i))];
  const auto& d = config_.data;
  std::string buckets;
  if (d.buckets.empty()) {
    buckets = fmt::format("one size {}x{}x{}", d.frames, d.height, d.width);
  } else {
    for (size_t b = 0; b < d.buckets.size() && b < per_bucket.size(); ++b)
      buckets += fmt::format("{}{}x{}x{}: {}", b ? ", " : "", d.buckets[b][0], d.buckets[b][1], d.buckets[b][2],
                             per_bucket[b]);
  }
  const int64_t items_per_step = config_.train.batch_size * config_.train.grad_accum_steps;
  const double epochs =
      static_cast<double>(steps * items_per_step) / static_cast<double>(std::max<int64_t>(1, src.size()));
  return fmt::format(
      "{} usable item{} of {} listed ({} bad); buckets (frames x height x width: items) {}; {} step{} of {} item{} = "
      "{} epochs",
      src.size(), src.size() == 1 ? "" : "s", videos_->listed, videos_->listed - src.size(), buckets, steps,
      steps == 1 ? "" : "s", items_per_step, items_per_step == 1 ? "" : "s",
      epochs >= 0.01 || epochs == 0.0 ? fmt::format("{:.2f}", epochs) : fmt::format("{:.2g}", epochs));
}

std::vector<std::string> DiffusionBatchSource::notices() const {
  return videos_ ? videos_->notices : std::vector<std::string>{};
}

std::vector<std::string> DiffusionBatchSource::captions(int64_t count) const {
  std::vector<std::string> out;
  if (videos_) {
    for (int64_t i = 0; i < std::min(count, videos_->source->size()); ++i) out.push_back(videos_->source->caption(i));
  } else {
    for (int64_t i = 0; i < std::min(count, dataset_.size()); ++i) out.push_back(dataset_.get(i).caption);
  }
  return out;
}

std::string DiffusionBatchSource::state() const {
  std::ostringstream rng;
  rng << caption_rng_;
  const auto generator = generator_.get_state().contiguous();
  const auto* bytes = generator.data_ptr<uint8_t>();
  std::string hex;
  for (int64_t i = 0; i < generator.numel(); ++i) hex += fmt::format("{:02x}", bytes[i]);
  nlohmann::ordered_json j;
  if (videos_) {
    // The loader's position: the batch the next step takes (batches loaded ahead are not counted).
    j["dataset"] = "videos";
    j["epoch"] = videos_->loader->epoch();
    j["cursor"] = videos_->loader->cursor();
  } else {
    j["epoch"] = sampler_.epoch();
    j["cursor"] = sampler_.cursor();
  }
  j["caption_rng"] = rng.str();
  j["generator"] = hex;
  return j.dump();
}

void DiffusionBatchSource::restore(const std::string& state) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(state);
    const auto epoch = j.at("epoch").get<int64_t>(), cursor = j.at("cursor").get<int64_t>();
    const bool videos = j.value("dataset", std::string("structured-motion")) == "videos";
    if (videos != static_cast<bool>(videos_))
      throw std::invalid_argument(std::string("the data state is of ") + (videos ? "a videos" : "a structured-motion") +
                                  " dataset");
    if (videos_) {
      if (epoch < 0 || cursor < 0 || cursor >= videos_->loader->sampler().batches_per_epoch())
        throw std::invalid_argument(
            fmt::format("data position epoch {} batch {} is out of range ({} batches per epoch)", epoch, cursor,
                        videos_->loader->sampler().batches_per_epoch()));
    } else if (cursor < 0 || cursor > config_.data.num_clips || epoch < -1)
      throw std::invalid_argument(fmt::format("data position epoch {} cursor {} is out of range for {} clips", epoch,
                                              cursor, config_.data.num_clips));
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
      if (pair.find_first_not_of("0123456789abcdef") != std::string::npos)
        throw std::invalid_argument("generator state is not hex");
      out[i] = static_cast<uint8_t>(std::stoi(pair, nullptr, 16));
    }
    auto generator = at::detail::createCPUGenerator(config_.train.seed);
    try {
      generator.set_state(bytes);
    } catch (const c10::Error& e) {
      throw std::invalid_argument(std::string("generator state rejected: ") + e.what_without_backtrace());
    }
    if (videos_) videos_->loader->seek(epoch, cursor);
    else sampler_.seek(epoch, cursor);
    caption_rng_ = caption_rng;
    generator_ = generator;
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("data state: ") + e.what());
  }
}

void DiffusionBatchSource::take_slice(int64_t rank, int64_t world_size) {
  const int64_t B = config_.train.batch_size;
  check_batch_slice(B, rank, world_size);
  slice_rank_ = rank;
  slice_count_ = world_size;
  if (videos_ && world_size > 1) {
    // The rank loads (decodes) only its rows of each global batch, at the loader's position.
    const int64_t local = B / world_size;
    const int64_t epoch = videos_->loader->epoch(), cursor = videos_->loader->cursor();
    videos_->loader = make_loader(rank * local, local);
    videos_->loader->seek(epoch, cursor);
  }
}

DiffusionBatch DiffusionBatchSource::next(torch::Device device) {
  if (device != schedule_device_) {
    schedule_ = schedule_.to(device);
    schedule_device_ = device;
  }
  const int64_t B = config_.train.batch_size;  // the global batch: every draw below is made for all of it
  const int64_t local = B / slice_count_;      // this rank's items: [first, first + local)
  const int64_t first = slice_rank_ * local;
  const auto data_start = std::chrono::steady_clock::now();
  torch::Tensor video;  // [local, C, T, H, W] float
  std::vector<std::string> captions;
  LoadedBatch loaded;
  if (videos_) {
    loaded = videos_->loader->next();
    for (const auto& f : loaded.failed) {
      if (videos_->failed.emplace(f.path, f.reason).second) videos_->unreported.push_back(f);
    }
    if (!loaded.failed.empty()) videos_->check(config_.data);
    captions = loaded.captions;  // the loader loads this rank's rows only (take_slice)
    TORCH_CHECK(static_cast<int64_t>(captions.size()) == local, "DiffusionBatchSource: the loader gave ",
                captions.size(), " items, expected ", local);
  } else {
    auto order = sampler_.next(B);
    if (slice_count_ > 1) order = std::vector<int64_t>(order.begin() + first, order.begin() + first + local);
    auto clips = dataset_.batch(order);
    video = clips.video;
    captions = std::move(clips.captions);
  }
  const double data_wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - data_start).count();
  // Caption dropout: one draw per item of the global batch, in order; the rank keeps its items' draws.
  std::bernoulli_distribution drop(config_.diffusion.caption_dropout);
  std::vector<bool> dropped;
  for (int64_t i = 0; i < B; ++i) {
    const bool d = drop(caption_rng_);
    if (i >= first && i < first + local) dropped.push_back(d);
  }
  for (size_t i = 0; i < captions.size(); ++i)
    if (dropped[i]) captions[i].clear();
  torch::Tensor text_ids, text_mask, text;
  if (loaded.text.defined()) {
    // A frozen encoder's embeddings from the cache: the empty prompt's for dropped captions.
    text = loaded.text.clone();
    text_mask = loaded.text_mask.clone();
    for (int64_t i = 0; i < local; ++i) {
      if (!dropped[static_cast<size_t>(i)]) continue;
      text[i].copy_(videos_->empty_prompt.text);
      text_mask[i].copy_(videos_->empty_prompt.text_mask);
    }
    text = text.to(device, torch::kFloat32);
    text_mask = text_mask.to(device);
  } else if (frozen_ && frozen_->has_text()) {
    std::tie(text, text_mask) = frozen_->encode_text(captions);  // dropped captions are the empty prompt
  } else if (loaded.text_ids.defined()) {
    // Precomputed by the cache: the empty prompt's for dropped captions.
    text_ids = loaded.text_ids.clone();
    text_mask = loaded.text_mask.clone();
    for (int64_t i = 0; i < local; ++i) {
      if (!dropped[static_cast<size_t>(i)]) continue;
      text_ids[i].copy_(videos_->empty_prompt.text_ids);
      text_mask[i].copy_(videos_->empty_prompt.text_mask);
    }
  } else {
    auto tokens = tokenizer_.encode_batch(captions, config_.data.max_text_tokens);
    text_ids = tokens.ids, text_mask = tokens.mask;
  }

  DiffusionBatch b;
  if (videos_) {
    if (loaded.video.scalar_type() == torch::kUInt8) {
      // Pixels [B, T, H, W, 3] uint8 -> [B, 3, T, H, W] in [-1, 1], mapped on the device.
      auto pixels = loaded.video.to(device, /*non_blocking=*/loaded.video.is_pinned());
      b.x0 = (pixels.permute({0, 4, 1, 2, 3}).to(torch::kFloat32) / 127.5 - 1.0).contiguous();
    } else {
      b.x0 = loaded.video.to(device, torch::kFloat32);
    }
  } else {
    b.x0 = video.to(device);
  }
  if (frozen_ && frozen_->has_vae()) b.x0 = frozen_->encode_video(b.x0).to(device);  // pixels -> scaled latents
  // Timesteps then noise for the whole global batch (the single-process stream), then the rank's rows.
  auto timesteps = schedule_.sample_timesteps(B, torch::kCPU, generator_);
  auto global_shape = b.x0.sizes().vec();
  global_shape[0] = B;
  // Noise is drawn on the CPU so that a run's random stream is the same on every device.
  b.noise = torch::randn(global_shape, generator_, torch::kFloat32);
  if (slice_count_ > 1) {
    timesteps = timesteps.narrow(0, first, local);
    b.noise = b.noise.narrow(0, first, local);
  }
  // The loss weights from the timesteps still on the CPU: no read back from the device.
  if (loss_weighting_ == LossWeighting::kMinSnr)
    b.loss_weight = min_snr_weights(schedule_, prediction_, timesteps, config_.diffusion.snr_gamma).to(device);
  b.timesteps = timesteps.to(device);
  b.noise = b.noise.to(device);
  b.xt = schedule_.add_noise(b.x0, b.noise, b.timesteps);
  b.target = schedule_.target(prediction_, b.x0, b.noise, b.timesteps);
  if (text.defined()) b.text = text.to(device);
  else b.text_ids = text_ids.to(device);
  b.text_mask = text_mask.to(device);
  b.data_wait_s = data_wait_s;
  return b;
}

}  // namespace megaslide
