#include "megaslide/train/wan_family.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>

#include "io/pretrained.h"
#include "megaslide/data/latent_cache.h"
#include "megaslide/io/finite_weights.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/train/distributed.h"
#include "megaslide/train/model_family.h"

namespace megaslide {

namespace {

// What every streamed block reads besides its input and the shared tensors.
struct WanStackInfo {
  TokenGrid grid;
  ops::ContextShard cp;
  WanRope rope;
  int64_t image_tokens = 0;  // the context's first tokens that are the image's (Wan2.1 I2V)
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
  for (size_t i = 0; i < hex.size() / 2; ++i)
    bytes.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  auto g = at::detail::createCPUGenerator(seed);
  try {
    g.set_state(bytes);
  } catch (const c10::Error& e) {
    throw std::invalid_argument(std::string("generator state rejected: ") + e.what_without_backtrace());
  }
  return g;
}

}  // namespace

void move_parameter(torch::Tensor& p, torch::Device device) {
  if (p.defined() && p.device() != device) p.set_data(p.data().to(device));
}

namespace {
// The in-memory tensor `name` of an item tensor ("latents", "text", "image_latents", "image_embeds") of `d` (a
// WanLatentData or a const one), nullptr for any other name.
template <typename Data>
auto held_tensor(Data& d, const std::string& name) -> decltype(&d.latents) {
  return name == "latents"         ? &d.latents
         : name == "text"          ? &d.text
         : name == "image_latents" ? &d.image_latents
         : name == "image_embeds"  ? &d.image_embeds
                                   : nullptr;
}
bool of_clip_shape(const std::string& name) { return name == "latents" || name == "image_latents"; }
}  // namespace

WanLatentData WanLatentData::load(const std::string& path) {
  WanLatentData d;
  if (!io::path_exists(path) || io::is_directory(path))
    throw std::invalid_argument("'" + path + "': no such file (the latent tensors: a safetensors file)");
  try {
    const io::MappedWeights file(path);
    for (const auto& name : file.names()) {
      if (!c10::isFloatingType(file.stored_dtype(name)) || file.is_fp8(name))
        throw std::invalid_argument("'" + path + "': tensor '" + name + "' is " +
                                    c10::toString(file.stored_dtype(name)) + ", expected float32, bf16 or fp16");
      torch::Tensor* slot = name == "empty_text" ? &d.empty_text : held_tensor(d, name);
      if (slot == nullptr)
        throw std::invalid_argument("'" + path + "': unexpected tensor '" + name +
                                    "' (expected latents, text, empty_text, image_latents, image_embeds)");
      // Read-only, in the file's dtype; scanned for a NaN or an infinity, which no training step survives (refused
      // whatever --allow-nonfinite-weights says of weights), named by its item.
      const auto refuse = [&](int64_t element, int64_t count) {
        const auto shape = file.shape(name);
        const int64_t rows = shape.empty() ? 1 : std::max<int64_t>(shape[0], 1),
                      per = std::max<int64_t>(count / rows, 1);
        throw std::invalid_argument(fmt::format(
            "'{}': tensor '{}' holds a NaN or an infinity in item {} of {} (element {} of {}): the data is broken; "
            "encode that item again",
            path, name, element / per, rows, element, count));
      };
      try {
        *slot = file.view(name, file.shape(name), "as stored");
      } catch (const io::NonFiniteTensorError& e) {
        if (e.element < 0) throw;
        refuse(e.element, e.count);
      }
      if (io::nonfinite_weights_allowed())
        if (const int64_t at = io::first_nonfinite(slot->data_ptr(), slot->numel(), slot->scalar_type()); at >= 0)
          refuse(at, slot->numel());
    }
  } catch (const io::IoError& e) {
    throw std::invalid_argument(e.what());
  }
  if (!d.latents.defined() || !d.text.defined())
    throw std::invalid_argument("'" + path + "': needs tensors 'latents' and 'text'");
  if (d.empty_text.defined()) d.empty_text = d.empty_text.to(torch::kFloat32, false, /*copy=*/true);
  return d;
}

WanLatentData WanLatentData::from_cache(const RunConfig& config, const std::string& dir) {
  const auto cache = LatentCache::open(config, dir);
  WanLatentData d;
  d.bad = cache->bad();
  d.cache_items = cache->verified_items(d.bad);
  for (const int64_t i : d.cache_items) {
    d.captions.push_back(cache->caption(i));
    if (!config.data.buckets.empty()) d.bucket_of.push_back(cache->bucket_of(i));
  }
  if (cache->empty_prompt().text.defined()) d.empty_text = cache->empty_prompt().text.to(torch::kFloat32).clone();
  d.cache = cache;
  return d;
}

int64_t WanLatentData::size() const {
  if (cache) return static_cast<int64_t>(cache_items.size());
  return text.defined() ? text.size(0) : 0;
}

int64_t WanLatentData::num_buckets() const {
  if (!bucketed()) return 1;
  return cache ? cache->num_buckets() : static_cast<int64_t>(buckets.size());
}

torch::Tensor WanLatentData::rows(const std::string& name, const std::vector<int64_t>& items) const {
  if (held_tensor(*this, name) == nullptr)
    throw std::invalid_argument("WanLatentData::rows: no item tensor '" + name + "'");
  for (const int64_t i : items)
    if (i < 0 || i >= size()) throw std::invalid_argument(fmt::format("WanLatentData::rows: item {} of {}", i, size()));
  if (items.empty()) return {};
  if (cache) {
    if (!cache->common_sizes(name, {cache_items.front()})) return {};
    std::vector<int64_t> of_cache;
    for (const int64_t i : items) of_cache.push_back(cache_items[static_cast<size_t>(i)]);
    return cache->stacked(name, of_cache);
  }
  if (bucketed() && of_clip_shape(name)) {
    std::vector<torch::Tensor> parts;
    for (const int64_t i : items) {
      const auto& b = buckets.at(static_cast<size_t>(bucket_of.at(static_cast<size_t>(i))));
      const auto& t = name == "latents" ? b.latents : b.image_latents;
      if (!t.defined()) return {};
      parts.push_back(t[row_of.at(static_cast<size_t>(i))]);
    }
    return torch::stack(parts).to(torch::kFloat32);
  }
  const torch::Tensor& t = *held_tensor(*this, name);
  if (!t.defined()) return {};
  return t.index_select(0, torch::tensor(items, torch::kInt64)).to(torch::kFloat32);
}

std::optional<std::vector<int64_t>> WanLatentData::sizes(const std::string& name, int64_t bucket) const {
  if (held_tensor(*this, name) == nullptr)
    throw std::invalid_argument("WanLatentData::sizes: no item tensor '" + name + "'");
  const bool by_bucket = bucket >= 0 && of_clip_shape(name);  // other tensors: every item's, whatever `bucket`
  if (bucketed() && of_clip_shape(name) && bucket < 0)
    throw std::invalid_argument("WanLatentData::sizes: the items of several buckets: name one");
  if (cache) {
    std::vector<int64_t> items;
    for (size_t i = 0; i < cache_items.size(); ++i)
      if (!by_bucket || bucket_of.at(i) == bucket) items.push_back(cache_items[i]);
    if (items.empty()) return std::nullopt;
    auto shape = cache->common_sizes(name, items);
    if (shape) shape->insert(shape->begin(), static_cast<int64_t>(items.size()));
    return shape;
  }
  torch::Tensor t;
  if (bucketed() && of_clip_shape(name)) {
    if (bucket >= static_cast<int64_t>(buckets.size())) return std::nullopt;
    t = name == "latents" ? buckets[static_cast<size_t>(bucket)].latents
                          : buckets[static_cast<size_t>(bucket)].image_latents;
  } else {
    t = *held_tensor(*this, name);
  }
  if (!t.defined()) return std::nullopt;
  return t.sizes().vec();
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
  const auto& w = c.model.wan;
  const auto shown = [](const std::optional<std::vector<int64_t>>& s) {
    return s ? c10::str(c10::IntArrayRef(*s)) : std::string("missing");
  };
  if (!cache && (!buckets.empty() || bucketed()) &&
      (bucket_of.size() != row_of.size() || bucket_of.empty() || buckets.empty()))
    throw std::invalid_argument("bucketed latents without their items' buckets and rows");
  for (const int64_t b : bucket_of)
    if (b < 0 || b >= num_buckets())
      throw std::invalid_argument(fmt::format("an item's bucket is {}, of {} buckets", b, num_buckets()));
  if (!bucketed()) {
    const std::vector<int64_t> clip{d.channels, d.frames, d.height, d.width};
    const auto x = sizes("latents");
    if (!x || x->size() != 5 || std::vector<int64_t>(x->begin() + 1, x->end()) != clip || x->front() < 1)
      throw std::invalid_argument(
          fmt::format("latents are {}, expected [N, {}, {}, {}, {}] (data.channels, frames, height, width)", shown(x),
                      d.channels, d.frames, d.height, d.width));
    const auto xi = sizes("image_latents");
    if (wan_image_to_video(w) && xi != x)
      throw std::invalid_argument(fmt::format(
          "image_latents are {}, expected {} as the latents: image-to-video (model.wan.in_channels {}) trains on each "
          "clip's conditioning video's latents",
          shown(xi), shown(x), w.in_channels));
    const auto tx = sizes("text");
    if (tx && !tx->empty() && tx->front() != x->front())
      throw std::invalid_argument(
          fmt::format("latents are {} and text {}: {} latent videos and {} texts, expected one "
                      "text per latent video",
                      shown(x), shown(tx), x->front(), tx->front()));
  } else {
    // Each bucket's sizes are the cache's (checked against data.buckets when it opened): the channels here.
    for (int64_t b = 0; b < num_buckets(); ++b) {
      const auto x = sizes("latents", b);
      if (!x) continue;  // a bucket no item went to
      if (x->size() != 5 || (*x)[1] != d.channels)
        throw std::invalid_argument(fmt::format("bucket {}'s latents are {}, expected [n, {}, T, H, W] (data.channels)",
                                                b, shown(x), d.channels));
      const auto xi = sizes("image_latents", b);
      if (wan_image_to_video(w) && xi != x)
        throw std::invalid_argument(fmt::format(
            "bucket {}'s image_latents are {}, expected {} as its latents: image-to-video trains on each clip's "
            "conditioning video's latents",
            b, shown(xi), shown(x)));
    }
  }
  const int64_t N = size();
  const auto tx = sizes("text");
  if (!tx || tx->size() != 3 || (*tx)[0] != N || (*tx)[2] != w.text_dim)
    throw std::invalid_argument(fmt::format(
        "text is {}, expected [{}, L, {}] (one per latent video, model.wan.text_dim)", shown(tx), N, w.text_dim));
  if (empty_text.defined() &&
      (empty_text.dim() != 2 || empty_text.size(0) != (*tx)[1] || empty_text.size(1) != (*tx)[2]))
    throw std::invalid_argument(
        fmt::format("empty_text is {}, expected [{}, {}]", c10::str(empty_text.sizes()), (*tx)[1], (*tx)[2]));
  const auto ie = sizes("image_embeds");
  if (wan_image_to_video(w) && w.image_dim > 0 && (!ie || ie->size() != 3 || (*ie)[0] != N || (*ie)[2] != w.image_dim))
    throw std::invalid_argument(
        fmt::format("image_embeds are {}, expected [{}, Li, {}]: the image branch (model.wan.image_dim) trains on "
                    "each clip's image tokens",
                    shown(ie), N, w.image_dim));
  bool any_image_latents = false;
  for (int64_t b = bucketed() ? 0 : -1; b < (bucketed() ? num_buckets() : 0); ++b)
    any_image_latents = any_image_latents || sizes("image_latents", b).has_value();
  if (!wan_image_to_video(w) && any_image_latents)
    throw std::invalid_argument("the data has image_latents but the Wan DiT is text-to-video (model.wan.in_channels " +
                                std::to_string(w.in_channels) + " = out_channels)");
  if (w.image_dim == 0 && ie)
    throw std::invalid_argument(
        "the data has image_embeds but the Wan DiT has no image branch (model.wan.image_dim 0)");
  if (c.diffusion.caption_dropout > 0 && !empty_text.defined())
    throw std::invalid_argument(
        "diffusion.caption_dropout is " + std::to_string(c.diffusion.caption_dropout) +
        " but the data has no empty_text (the empty prompt's embedding a dropped caption becomes)");
}

WanBatchSource::WanBatchSource(const RunConfig& config, WanLatentData data)
    : config_(config),
      data_(std::move(data)),
      sampler_(std::max<int64_t>(data_.size(), 1), config.train.seed),
      flow_(config.diffusion.objective == "flow"),
      flow_options_(FlowMatchingOptions::from_config(config)),
      schedule_(config.diffusion.timesteps, parse_beta_schedule(config.diffusion.beta_schedule),
                config.diffusion.beta_start, config.diffusion.beta_end),
      prediction_(parse_prediction(config.diffusion.prediction)),
      loss_weighting_(parse_loss_weighting(config.diffusion.loss_weighting)),
      caption_rng_(config.train.seed ^ 0x5DEECE66Dull),
      generator_(at::detail::createCPUGenerator(config.train.seed)) {
  data_.check(config_);
  if (data_.bucketed())
    bucket_sampler_.emplace(data_.bucket_of, data_.num_buckets(), config.train.batch_size, config.train.seed);
}

void WanBatchSource::take_slice(int64_t rank, int64_t world_size) {
  check_batch_slice(config_.train.batch_size, rank, world_size);
  slice_rank_ = rank;
  slice_count_ = world_size;
}

WanBatch WanBatchSource::next(torch::Device device) {
  const int64_t B = config_.train.batch_size;  // the global batch: every draw below is made for all of it
  // The batch's items: one clip shape (with buckets, one bucket's items, as the DiT family's BucketBatchSampler).
  const std::vector<int64_t> items = bucket_sampler_ ? bucket_sampler_->next().items : sampler_.next(B);
  const torch::Tensor x0 = data_.rows("latents", items), image_latents = data_.rows("image_latents", items);
  WanBatch b;
  auto text = data_.rows("text", items);
  std::bernoulli_distribution drop(config_.diffusion.caption_dropout);
  for (int64_t i = 0; i < B; ++i)
    if (drop(caption_rng_)) text[i].copy_(data_.empty_text);
  if (image_latents.defined()) {  // image-to-video: the conditioning channels and image tokens
    b.condition = wan_image_condition(image_latents);
    b.image = data_.rows("image_embeds", items);
    if (config_.diffusion.image_dropout > 0) {
      std::bernoulli_distribution drop_image(config_.diffusion.image_dropout);
      for (int64_t i = 0; i < B; ++i)
        if (drop_image(caption_rng_)) {
          b.condition[i].zero_();
          if (b.image.defined()) b.image[i].zero_();
        }
    }
    b.condition = b.condition.to(device);
    if (b.image.defined()) b.image = b.image.to(device);
  }
  torch::Tensor noise;
  if (flow_) {
    const auto sigma = sample_flow_sigmas(B, flow_options_, generator_);
    if (loss_weighting_ != LossWeighting::kNone) b.loss_weight = flow_loss_weights(loss_weighting_, sigma).to(device);
    noise = torch::randn(x0.sizes(), generator_, torch::kFloat32);
    auto xt = flow_noisy(x0, noise, sigma);
    auto timesteps = sigma * static_cast<float>(config_.diffusion.timesteps);
    if (config_.diffusion.first_frame_clean > 0) {
      // Image-to-video samples: the first latent frame clean, its tokens at timestep 0, out of the loss.
      const auto clean = torch::rand({B}, generator_, torch::kFloat64).lt(config_.diffusion.first_frame_clean);
      const auto& p = config_.model.wan.patch;
      const int64_t T = x0.size(2), per_frame = (x0.size(3) / p[1]) * (x0.size(4) / p[2]);
      timesteps = timesteps.unsqueeze(1).repeat({1, T / p[0] * per_frame});  // [B, N]
      auto mask = torch::ones({B, 1, T, 1, 1}, torch::kFloat32);
      for (int64_t i = 0; i < B; ++i) {
        if (!clean[i].item<bool>()) continue;
        xt[i].select(1, 0).copy_(x0[i].select(1, 0));
        timesteps[i].narrow(0, 0, per_frame).zero_();
        mask[i].select(1, 0).zero_();
      }
      b.loss_mask = mask.to(device);
    }
    b.xt = xt.to(device);
    b.target = flow_target(x0, noise).to(device);
    b.timesteps = timesteps.to(device);
  } else {
    const auto t = schedule_.sample_timesteps(B, torch::kCPU, generator_);
    noise = torch::randn(x0.sizes(), generator_, torch::kFloat32);
    b.xt = schedule_.add_noise(x0, noise, t).to(device);
    b.target = schedule_.target(prediction_, x0, noise, t).to(device);
    b.timesteps = t.to(torch::kFloat32).to(device);
    if (loss_weighting_ == LossWeighting::kMinSnr)
      b.loss_weight = min_snr_weights(schedule_, prediction_, t, config_.diffusion.snr_gamma).to(device);
  }
  b.x0 = x0.to(device);
  b.noise = noise.to(device);
  b.text = text.to(device);
  if (slice_count_ > 1) {  // this rank's rows [first, first + local) of the global batch
    const int64_t local = B / slice_count_, first = slice_rank_ * local;
    for (auto* t : {&b.x0, &b.noise, &b.xt, &b.timesteps, &b.target, &b.text, &b.loss_mask, &b.loss_weight,
                    &b.condition, &b.image})
      if (t->defined()) *t = t->narrow(0, first, local).contiguous();
  }
  return b;
}

size_t WanBatchSource::draw_expert() {
  const double boundary = config_.model.wan.boundary_ratio;
  TORCH_CHECK(flow_ && config_.model.wan.expert == "both" && boundary > 0 && boundary < 1,
              "WanBatchSource::draw_expert: for model.wan.expert both with flow matching and a boundary_ratio in "
              "(0, 1)");
  const double p_high = 1.0 - flow_sigma_cdf(boundary, flow_options_);
  const bool high = torch::rand({1}, generator_, torch::kFloat64).item<double>() < p_high;
  flow_options_.sigma_min(high ? boundary : 0.0).sigma_max(high ? 1.0 : boundary);
  return high ? 0 : 1;
}

std::string WanBatchSource::state() const {
  std::ostringstream rng;
  rng << caption_rng_;
  nlohmann::ordered_json j;
  j["epoch"] = bucket_sampler_ ? bucket_sampler_->epoch() : sampler_.epoch();
  j["cursor"] = bucket_sampler_ ? bucket_sampler_->cursor() : sampler_.cursor();
  if (bucket_sampler_) j["buckets"] = data_.num_buckets();
  j["caption_rng"] = rng.str();
  j["generator"] = generator_hex(generator_);
  return j.dump();
}

void WanBatchSource::restore(const std::string& state) {
  try {
    const auto j = nlohmann::json::parse(state);
    const auto epoch = j.at("epoch").get<int64_t>(), cursor = j.at("cursor").get<int64_t>();
    // A position in batches of buckets, or in items: the checkpoint's data must be held the same way.
    const size_t buckets = j.contains("buckets") ? j.at("buckets").get<size_t>() : 0;
    if (buckets != (bucket_sampler_ ? static_cast<size_t>(data_.num_buckets()) : 0))
      throw std::invalid_argument(fmt::format(
          "the checkpoint's data position is in {}, this run's data in {}: resume with the data.buckets it ran with",
          buckets ? fmt::format("batches of {} buckets", buckets) : std::string("items of one clip size"),
          bucket_sampler_ ? fmt::format("batches of {} buckets", data_.num_buckets())
                          : std::string("items of one clip size")));
    const int64_t positions = bucket_sampler_ ? bucket_sampler_->batches_per_epoch() : size();
    if (cursor < 0 || cursor > positions || epoch < (bucket_sampler_ ? 0 : -1))
      throw std::invalid_argument(fmt::format("data position epoch {} cursor {} is out of range for {} {}", epoch,
                                              cursor, positions,
                                              bucket_sampler_ ? "batches an epoch" : "latent videos"));
    std::istringstream rng(j.at("caption_rng").get<std::string>());
    std::mt19937_64 caption_rng;
    rng >> caption_rng;
    if (rng.fail()) throw std::invalid_argument("caption_rng is not an mt19937_64 state");
    auto generator = generator_from_hex(j.at("generator").get<std::string>(), config_.train.seed);
    if (bucket_sampler_) bucket_sampler_->seek(epoch, cursor);
    else sampler_.seek(epoch, cursor);
    caption_rng_ = caption_rng;
    generator_ = generator;
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("data state: ") + e.what());
  }
}

WanBlockDraws::WanBlockDraws(WanTransformer model)
    : model_(std::move(model)), states_{at::detail::getDefaultCPUGenerator().get_state()} {}

namespace {
// Every WanBlockDraws draws from LibTorch's one default CPU generator.
std::mutex& default_generator_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace

WanBlock WanBlockDraws::draw(int64_t index) {
  TORCH_CHECK(index >= 0 && index < model_->options.layers(), "WanBlockDraws: block ", index, " out of range [0, ",
              model_->options.layers(), ")");
  std::lock_guard<std::mutex> lock(default_generator_mutex());
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
  std::lock_guard<std::mutex> lock(default_generator_mutex());
  TORCH_CHECK(static_cast<int64_t>(states_.size()) == model_->options.layers() + 1,
              "WanBlockDraws: ", states_.size() - 1, " of ", model_->options.layers(), " blocks drawn");
  auto generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(states_.back());
}

torch::nn::Module& WanStack::block(int64_t index) { return model_->blocks[index]->as<WanBlockImpl>()->streamed(); }

torch::Tensor WanStack::forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) {
  TORCH_CHECK(inputs.tensors.size() == 2, "WanStack: expected block inputs {tproj, context}");
  const auto& info = std::any_cast<const WanStackInfo&>(inputs.info);
  WanBlockContext ctx;
  ctx.grid = info.grid;
  ctx.cp = info.cp;
  ctx.rope = info.rope;
  ctx.tproj = inputs.tensors[0];
  ctx.context = inputs.tensors[1];
  ctx.image_tokens = info.image_tokens;
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

double wan_model_flops_per_step(const RunConfig& c) {
  const auto& w = c.model.wan;
  const auto shape = model_sample_shape(c);
  const TokenGrid grid{shape[1] / w.patch[0], shape[2] / w.patch[1], shape[3] / w.patch[2]};
  const auto count = count_wan_parameters(WanOptions::from_config(c));
  const double N = static_cast<double>(grid.numel()), Lt = static_cast<double>(c.data.max_text_tokens);
  const double B = static_cast<double>(c.train.batch_size * c.train.grad_accum_steps);
  const double D = static_cast<double>(w.dim), L = static_cast<double>(w.layers);
  const double cross_kv = 2.0 * (D * D + D) * L;                                // attn2.to_k, attn2.to_v
  const double text_mlp = static_cast<double>(w.text_dim) * D + D + D * D + D;  // condition_embedder.text_embedder
  // Wan2.1 I2V's image branch runs over CLIP ViT-H/14's 257 image tokens: attn2's add_k_proj, add_v_proj and
  // norm_added_k, and the image embedder.
  const double Di = static_cast<double>(w.image_dim), Li = w.image_dim > 0 ? 257.0 : 0.0;
  const double image_params =
      w.image_dim > 0 ? (2.0 * (D * D + D) + D) * L + (3.0 * Di + Di * Di + Di * D + 3.0 * D) : 0.0;
  const double per_video_token = static_cast<double>(count.total) - cross_kv - text_mlp - image_params;
  double keys = N;
  if (c.model.self_attention == "dsa3d") {
    const auto& k = c.model.dsa_kernel;
    keys = static_cast<double>(std::min(k[0], grid.t) * std::min(k[1], grid.h) * std::min(k[2], grid.w));
  }
  const double attention = 12.0 * L * B * N * (keys + Lt + Li) * D;
  return 6.0 * B * (per_video_token * N + (cross_kv + text_mlp) * Lt + image_params * Li) + attention;
}

torch::Tensor wan_training_loss(const torch::Tensor& prediction, const torch::Tensor& target,
                                const torch::Tensor& loss_mask, const torch::Tensor& loss_weight) {
  return context_parallel_loss(prediction, target, loss_mask, {}, 1, loss_weight);
}

offload::StackInput WanStackSplit::prologue(const WanBatch& b) {
  target = b.target;
  loss_mask = b.loss_mask;
  loss_weight = b.loss_weight;
  auto e = model->embed(b.input(), b.timesteps, b.text, b.image, group);
  temb = e.temb;
  grid = e.ctx.local_grid();
  cp = e.ctx.cp;
  offload::StackInput in;
  in.hidden = e.tokens;
  in.inputs.tensors = {e.ctx.tproj, e.ctx.context};
  in.inputs.info = WanStackInfo{e.ctx.grid, e.ctx.cp, e.ctx.rope,
                                e.ctx.image_tokens};  // fp32 RoPE tables: not cast to the compute dtype
  return in;
}

torch::Tensor WanStackSplit::epilogue(const torch::Tensor& last_hidden) {
  return context_parallel_loss(model->head(last_hidden, temb, grid), target, loss_mask, cp, model->options.patch()[0],
                               loss_weight);
}

torch::Tensor WanStackSplit::loss(const WanBatch& b) {
  if (group == nullptr)
    return wan_training_loss(model->forward(b.input(), b.timesteps, b.text, b.image), b.target, b.loss_mask,
                             b.loss_weight);
  auto e = model->embed(b.input(), b.timesteps, b.text, b.image, group);
  auto h = e.tokens;
  for (const auto& block : *model->blocks) h = block->as<WanBlockImpl>()->forward(h, e.ctx);
  return context_parallel_loss(model->head(h, e.temb, e.ctx.local_grid()), b.target, b.loss_mask, e.ctx.cp,
                               model->options.patch()[0], b.loss_weight);
}

offload::StackStepResult wan_streamed_step(offload::StreamedStackTrainer& engine, WanTransformer& model,
                                           const std::function<WanBatch()>& next_batch, double lr) {
  WanStackSplit split{model};
  return engine.step([&] { return split.prologue(next_batch()); },
                     [&](const torch::Tensor& h) { return split.epilogue(h); }, lr);
}

}  // namespace megaslide
