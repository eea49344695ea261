#include "megaslide/data/latent_cache.h"

#include "megaslide/model/encoder_settings.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "megaslide/data/video_dataset.h"
#include "megaslide/io/files.h"
#include "megaslide/io/video.h"
#include "megaslide/model/clip_tokenizer.h"
#include "megaslide/model/clip_vision_encoder.h"
#include "megaslide/model/frozen_encoders.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/model/umt5_encoder.h"
#include "megaslide/model/umt5_tokenizer.h"
#include "megaslide/model/wan_vae.h"
#include "megaslide/util/device.h"

namespace megaslide {

namespace {

constexpr const char* kFormat = "megaslide.cache";
constexpr int kFormatVersion = 1;
constexpr const char* kManifest = "cache.json";
constexpr const char* kEmptyPrompt = "empty_prompt.safetensors";

using json = nlohmann::ordered_json;

// A file's fingerprint: its name, size and the CRC-32 of its first and last MiB (for a safetensors file,
// the header — names, shapes, offsets — and the first tensors). Cheap on a 10 GB checkpoint.
json fingerprint(const std::string& path, const std::string& key) {
  constexpr uint64_t kSpan = uint64_t{1} << 20;
  try {
    io::check_input_file(path);  // a regular file: never a FIFO the stream below would hang on
  } catch (const io::IoError& e) {
    throw ConfigError("config", key, std::string(e.what()) + " (to fingerprint the encoder's files for the cache)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError("config", key, "cannot read '" + path + "' (to fingerprint the encoder's files for the cache)");
  const uint64_t size = io::file_size(path);
  std::string buffer;
  uint32_t crc = 0;
  auto add = [&](uint64_t begin, uint64_t bytes) {
    buffer.resize(static_cast<size_t>(bytes));
    in.seekg(static_cast<std::streamoff>(begin));
    in.read(buffer.data(), static_cast<std::streamsize>(bytes));
    if (!in)
      throw ConfigError("config", key, "cannot read '" + path + "' (to fingerprint the encoder's files for the cache)");
    crc = io::crc32(buffer.data(), buffer.size(), crc);
  };
  add(0, std::min(size, kSpan));
  if (size > kSpan) add(std::max(kSpan, size - kSpan), size - std::max(kSpan, size - kSpan));
  const auto slash = path.find_last_of('/');
  return {{"file", slash == std::string::npos ? path : path.substr(slash + 1)},
          {"bytes", size},
          {"crc32", fmt::format("{:08x}", crc)}};
}

// The files of a weights path: the file itself, or a folder's weights, configs and vocabularies.
json fingerprints(const std::string& path, const std::string& key) {
  json out = json::array();
  if (!io::is_directory(path)) {
    out.push_back(fingerprint(path, key));
    return out;
  }
  auto names = io::list_directory(path);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    const std::string file = io::join_path(path, name);
    const auto ends = [&](const std::string& suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (io::is_directory(file)) continue;
    if (ends(".safetensors") || ends(".json") || ends(".model") || ends(".txt")) out.push_back(fingerprint(file, key));
  }
  if (out.empty()) throw ConfigError("config", key, "'" + path + "' holds no weights (.safetensors) to fingerprint");
  return out;
}

// The folder umT5's weights are read from (a diffusers root's text_encoder/), or the file.
std::string umt5_weights_path(const std::string& weights) {
  if (!io::is_directory(weights)) return weights;
  try {
    const std::string file = umt5_weights_file(weights);
    const auto slash = file.find_last_of('/');
    return slash == std::string::npos ? std::string(".") : file.substr(0, slash);
  } catch (const std::exception& e) {
    throw ConfigError("config", "model.text_encoder.weights", e.what());
  }
}

// Whether a cache of `config` holds its clips' image-to-video conditioning (and reads the listing's images).
bool caches_images(const RunConfig& config) {
  return config.model.arch == Architecture::kWan && wan_image_to_video(config.model.wan);
}

// Wan's convention: 512 tokens per prompt.
constexpr int64_t kUmt5Tokens = 512;

class ConfiguredEncoders final : public CacheEncoders {
 public:
  ConfiguredEncoders(const RunConfig& config, torch::Device device) : config_(config), device_(device) {
    const auto& te = config.model.text_encoder;
    const auto& v = config.model.vae;
    auto fail = [](const std::string& key, const std::string& problem) { throw ConfigError("config", key, problem); };
    frozen_ = FrozenEncoders::load(config, device, "config");  // CLIP and the SD VAE (nullptr when neither)
    if (te.kind == "umt5") {
      try {
        tokenizer_.emplace(Umt5Tokenizer::find(te.vocab.empty() ? te.weights : te.vocab));
      } catch (const std::exception& e) {
        fail(te.vocab.empty() ? "model.text_encoder.weights" : "model.text_encoder.vocab", e.what());
      }
      try {
        umt5_.emplace(Umt5Encoder::load(te.weights, device, frozen_encoder_dtype(te.dtype, device), te.dtype == "fp8"));
      } catch (const std::exception& e) {
        fail("model.text_encoder.weights", e.what());
      }
      if (umt5_->config().d_model != config.model.wan.text_dim)
        fail("model.wan.text_dim",
             fmt::format("is {} but umT5 in '{}' is {} wide (d_model): set model.wan.text_dim: {}",
                         config.model.wan.text_dim, te.weights, umt5_->config().d_model, umt5_->config().d_model));
      if (tokenizer_->vocab_size() > umt5_->config().vocab_size)
        fail("model.text_encoder.vocab",
             fmt::format("the tokenizer '{}' has {} pieces, umT5's embedding only {}: not this model's tokenizer",
                         tokenizer_->source(), tokenizer_->vocab_size(), umt5_->config().vocab_size));
    }
    if (v.kind == "wan") {
      try {
        wan_vae_.emplace(WanVae::load(v.weights, device, frozen_encoder_dtype(v.dtype, device)));
      } catch (const std::exception& e) {
        fail("model.vae.weights", e.what());
      }
      const auto& c = wan_vae_->config();
      if (c.z_dim != v.latent_channels)
        fail("model.vae.latent_channels",
             fmt::format("is {} but the Wan VAE in '{}' has z_dim {}: set model.vae.latent_channels: {} (and "
                         "model.wan.in_channels)",
                         v.latent_channels, v.weights, c.z_dim, c.z_dim));
      if (c.spatial_downscale() != v.downscale || c.temporal_downscale() != 4)
        fail("model.vae.downscale",
             fmt::format("is {} but the Wan VAE in '{}' maps {} pixels and {} frames to a latent (the cache takes "
                         "model.vae.downscale pixels and 4 frames: 8 for Wan 2.1's VAE, 16 for Wan 2.2's)",
                         v.downscale, v.weights, c.spatial_downscale(), c.temporal_downscale()));
      if (c.in_channels != 3)
        fail("model.vae.weights",
             fmt::format("the Wan VAE in '{}' encodes {}-channel videos, not RGB", v.weights, c.in_channels));
    }
    const auto& w = config.model.wan;
    if (config.model.arch == Architecture::kWan && w.image_dim > 0) {
      const std::string path = wan_image_encoder_path(config);
      if (path.empty())
        fail("model.image_encoder.weights",
             "Wan2.1 image-to-video caches CLIP's image tokens: name CLIP ViT-H's image encoder (diffusers' "
             "image_encoder/ folder or clip_vision_h.safetensors)");
      try {
        clip_.emplace(ClipVisionEncoder::load(path, device,
                                              frozen_encoder_dtype(config.model.image_encoder.dtype, device), {},
                                              config.model.image_encoder.dtype == "fp8"));
      } catch (const std::exception& e) {
        fail("model.image_encoder.weights", e.what());
      }
      if (clip_->config().hidden_size != w.image_dim)
        fail("model.wan.image_dim",
             fmt::format("is {} but the CLIP image encoder in '{}' is {} wide (hidden_size): not this DiT's",
                         w.image_dim, path, clip_->config().hidden_size));
    }
  }

  std::pair<int64_t, int64_t> caption_tokens(const std::string& caption) const override {
    if (!umt5_) return {0, 0};
    return {static_cast<int64_t>(tokenizer_->encode_text(wan_prompt_clean(caption)).size()) + 1, kUmt5Tokens};  // </s>
  }

  io::NamedTensors encode_text(const std::string& caption) const override {
    torch::NoGradGuard no_grad;
    if (umt5_) {
      const auto tokens = tokenizer_->encode({wan_prompt_clean(caption)}, kUmt5Tokens);
      const auto text = umt5_->embed(tokens.ids.to(device_), tokens.mask.to(device_));
      return {{"text", text[0].to(torch::kCPU, torch::kFloat32).contiguous()}};
    }
    if (frozen_ && frozen_->has_text()) {
      auto [text, mask] = frozen_->encode_text({caption});
      return {{"text", text[0].to(torch::kCPU, torch::kFloat32).contiguous()},
              {"text_mask", mask[0].to(torch::kCPU).contiguous()}};
    }
    const auto ids = builtin_.encode(caption, config_.data.max_text_tokens);
    auto tokens = torch::tensor(ids, torch::kInt64);
    return {{"text_ids", tokens}, {"text_mask", tokens.ne(CaptionTokenizer::kPad)}};
  }

  torch::Tensor encode_video(const torch::Tensor& frames) const override {
    if (!wan_vae_ && !(frozen_ && frozen_->has_vae())) return frames.contiguous();  // the pixel codec
    torch::NoGradGuard no_grad;
    // [T, H, W, 3] uint8 -> [1, 3, T, H, W] in [-1, 1], as the trainer maps a decoded batch.
    const auto pixels = (frames.unsqueeze(0).permute({0, 4, 1, 2, 3}).to(torch::kFloat32) / 127.5 - 1.0).contiguous();
    const auto latents =
        wan_vae_ ? wan_vae_->encode(pixels.to(device_), false, std::nullopt, wan_vae_tiling(config_.model.vae))
                 : frozen_->encode_video(pixels);
    return latents[0].to(torch::kCPU, torch::kFloat32).contiguous();
  }

  io::NamedTensors encode_image(const torch::Tensor& image, const torch::Tensor& pixels,
                                int64_t frames) const override {
    if (!caches_images(config_) || !wan_vae_) return {};
    torch::NoGradGuard no_grad;
    io::NamedTensors out;
    out.emplace_back(
        "image_latents",
        wan_vae_->encode_image_video(image.to(device_, torch::kFloat32), frames, wan_vae_tiling(config_.model.vae))[0]
            .to(torch::kCPU, torch::kFloat32)
            .contiguous());
    if (clip_) out.emplace_back("image_embeds", clip_->encode(pixels)[0].to(torch::kCPU, torch::kFloat32).contiguous());
    return out;
  }

 private:
  RunConfig config_;
  torch::Device device_;
  CaptionTokenizer builtin_;
  std::shared_ptr<FrozenEncoders> frozen_;
  std::optional<Umt5Tokenizer> tokenizer_;
  std::optional<Umt5Encoder> umt5_;
  std::optional<WanVae> wan_vae_;
  std::optional<ClipVisionEncoder> clip_;
};

// The data keys that shape a cached clip.
json decode_settings(const DataConfig& d) {
  json buckets = json::array();
  for (const auto& b : clip_buckets(d)) buckets.push_back({b.frames, b.height, b.width});
  return {{"buckets", buckets},         {"fps", d.fps},   {"frame_stride", d.frame_stride},
          {"clip_start", d.clip_start}, {"crop", d.crop}, {"seed", d.seed}};
}

// The dataset's folder or manifest from the root (a cache made before paths were recorded so holds them as
// written: they are read the same way, from the working directory).
std::string dataset_source(const DataConfig& d) { return io::absolute_path(d.manifest.empty() ? d.root : d.manifest); }
json absolute_source(json dataset) {
  if (dataset.is_object() && dataset.contains("source") && dataset["source"].is_string())
    dataset["source"] = io::absolute_path(dataset["source"].get<std::string>());
  return dataset;
}

struct SourceStat {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  bool exists = false;
};

SourceStat stat_source(const std::string& path) {
  struct stat st {};
  SourceStat s;
  if (::stat(path.c_str(), &st) != 0) return s;
  s.exists = true;
  s.size = static_cast<uint64_t>(st.st_size);
  s.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return s;
}

std::string shard_name(int64_t k) { return fmt::format("shard-{:05}.safetensors", k); }

// The files a cache folder holds, and the temporaries a killed build of it leaves (its files' NAME.XXXXXX.tmp).
const std::regex kShardFile(R"(shard-[0-9]{5,}\.safetensors)");
const std::regex kCacheFile(R"(cache\.json|empty_prompt\.safetensors|\.lock|shard-[0-9]{5,}\.safetensors)");
const std::regex kCacheTemporary(R"((cache\.json|empty_prompt\.safetensors|shard-[0-9]{5,}\.safetensors)\..*\.tmp)");

json read_manifest(const std::string& path) {
  try {
    auto j = json::parse(io::read_file(path));
    if (!j.is_object() || j.value("format", "") != kFormat)
      throw DatasetError("cache '" + path + "': not a MegaSlide cache manifest (expected format '" +
                         std::string(kFormat) + "')");
    if (j.value("format_version", 0) != kFormatVersion)
      throw DatasetError("cache '" + path + "': format_version " + j["format_version"].dump() +
                         " is not supported (this build reads " + std::to_string(kFormatVersion) + ")");
    return j;
  } catch (const json::exception& e) {
    throw DatasetError("cache '" + path + "': not valid JSON: " + e.what());
  } catch (const io::IoError& e) {
    throw DatasetError(std::string("cache: ") + e.what());
  }
}

// The first key where a and b differ ("" when equal), for messages.
std::string first_difference(const json& a, const json& b, const std::string& prefix) {
  if (a.is_object() && b.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it) {
      if (!b.contains(it.key())) return prefix + it.key();
      auto d = first_difference(it.value(), b[it.key()], prefix + it.key() + ".");
      if (!d.empty()) return d;
    }
    for (auto it = b.begin(); it != b.end(); ++it)
      if (!a.contains(it.key())) return prefix + it.key();
    return "";
  }
  return a == b ? "" : (prefix.empty() ? std::string("(value)") : prefix.substr(0, prefix.size() - 1));
}

// The value at a dotted path of first_difference's ("(absent)" where a key is missing).
std::string value_at(const json& j, const std::string& path) {
  if (path == "(value)") return j.dump();
  const json* at = &j;
  for (size_t begin = 0; begin <= path.size();) {
    const size_t dot = std::min(path.find('.', begin), path.size());
    const std::string key = path.substr(begin, dot - begin);
    if (!at->is_object() || !at->contains(key)) return "(absent)";
    at = &(*at)[key];
    begin = dot + 1;
  }
  return at->dump();
}

// The CRC-32 of an item's tensors other than its latents (text, image), chained in the order of their names.
uint32_t others_crc32(const io::NamedTensors& tensors) {
  std::vector<std::pair<std::string, torch::Tensor>> sorted(tensors.begin(), tensors.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  uint32_t crc = 0;
  for (const auto& [name, t] : sorted) {
    if (name == "latents") continue;
    const auto c = t.contiguous();
    crc = io::crc32(c.data_ptr(), static_cast<size_t>(c.numel() * c.element_size()), crc);
  }
  return crc;
}

// `adding`: megaslide-cache adding to the cache, which cannot replace it; else a run reading it.
void check_same(const json& cached, const json& now, const std::string& what, const std::string& dir,
                bool adding = false) {
  const auto diff = first_difference(cached, now, "");
  if (!diff.empty())
    throw DatasetError(fmt::format("cache '{}' was made with other {} ({} is {} in the cache, {} now); {}", dir, what,
                                   diff, value_at(cached, diff), value_at(now, diff),
                                   adding ? "give another --out for a cache of these settings, or remove the folder "
                                            "to build it again there"
                                          : "build one of these settings with megaslide-cache (another --out, or the "
                                            "folder removed first)"));
}

// The lines after a colon, "; " between them (a tool prints an error on one line).
std::string list_paths(const std::vector<std::string>& lines, size_t max = 20) {
  std::string out;
  for (size_t i = 0; i < lines.size() && i < max; ++i) out += (i == 0 ? " " : "; ") + lines[i];
  if (lines.size() > max) out += fmt::format("; ... and {} more", lines.size() - max);
  return out;
}

}  // namespace

std::unique_ptr<CacheEncoders> cache_encoders(const RunConfig& config, torch::Device device) {
  return std::make_unique<ConfiguredEncoders>(config, device);
}

std::string cache_identity(const RunConfig& config) {
  const auto& te = config.model.text_encoder;
  const auto& v = config.model.vae;
  json j;
  if (te.kind == "clip") {
    json vocab = fingerprints(te.weights, "model.text_encoder.weights");
    if (!te.vocab.empty()) vocab = fingerprints(te.vocab, "model.text_encoder.vocab");
    else if (ClipTokenizer::folder_has_vocabulary(te.weights + "/../tokenizer") &&
             !ClipTokenizer::folder_has_vocabulary(te.weights))
      vocab = fingerprints(te.weights + "/../tokenizer", "model.text_encoder.weights");
    j["text_encoder"] = {{"kind", "clip"},
                         {"max_tokens", config.data.max_text_tokens},
                         {"dtype", te.dtype},
                         {"files", fingerprints(te.weights, "model.text_encoder.weights")},
                         {"vocabulary", vocab}};
  } else if (te.kind == "umt5") {
    json tokenizer;
    try {
      const std::string source = Umt5Tokenizer::find(te.vocab.empty() ? te.weights : te.vocab).source();
      tokenizer = io::path_exists(source) && !io::is_directory(source) ? fingerprint(source, "model.text_encoder.vocab")
                                                                       : json(source);
    } catch (const Umt5TokenizerError& e) {
      throw ConfigError("config", te.vocab.empty() ? "model.text_encoder.weights" : "model.text_encoder.vocab",
                        e.what());
    }
    j["text_encoder"] = {{"kind", "umt5"},
                         {"max_tokens", kUmt5Tokens},
                         {"clean", "wan"},
                         {"dtype", te.dtype},
                         {"files", fingerprints(umt5_weights_path(te.weights), "model.text_encoder.weights")},
                         {"tokenizer", tokenizer}};
  } else {
    const CaptionTokenizer tokenizer;
    std::string words;
    for (const auto& w : tokenizer.words()) words += w + "\n";
    j["text_encoder"] = {{"kind", "builtin"},
                         {"max_tokens", config.data.max_text_tokens},
                         {"vocabulary_crc32", fmt::format("{:08x}", io::crc32(words.data(), words.size()))}};
  }
  if (v.kind == "sd") {
    j["vae"] = {{"kind", "sd"},
                {"latents", "scaled mean [C, T, H/ds, W/ds] float32"},
                {"dtype", v.dtype},
                {"files", fingerprints(v.weights, "model.vae.weights")}};
  } else if (v.kind == "wan") {
    const auto tiling = wan_vae_tiling(v);
    j["vae"] = {{"kind", "wan"},
                // The VAE's own downscale: 8 for Wan 2.1's, 16 for Wan 2.2's (a Wan 2.1 cache's text is unchanged).
                {"latents", fmt::format("normalised mean [z, 1 + (T-1)/4, H/{0}, W/{0}] float32", v.downscale)},
                {"dtype", v.dtype},
                {"tiling", tiling ? json{{"tile", tiling->tile}, {"stride", tiling->stride}} : json()},
                {"files", fingerprints(v.weights, "model.vae.weights")}};
  } else {
    j["vae"] = {{"kind", "pixel"}, {"layout", "[T, H, W, 3] uint8"}};
  }
  const auto& w = config.model.wan;
  if (caches_images(config)) {
    json encoder;  // null: no image branch
    if (w.image_dim > 0) {
      const std::string path = wan_image_encoder_path(config);
      if (path.empty())
        throw ConfigError("config", "model.image_encoder.weights",
                          "Wan2.1 image-to-video caches CLIP's image tokens: name CLIP ViT-H's image encoder");
      json files = fingerprints(path, "model.image_encoder.weights");
      // A folder's preprocessing may be its sibling image_processor/'s (diffusers' layout).
      const std::string sibling = io::join_path(path, "../image_processor/preprocessor_config.json");
      if (io::is_directory(path) && !io::path_exists(io::join_path(path, "preprocessor_config.json")) &&
          io::path_exists(sibling))
        files.push_back(fingerprint(sibling, "model.image_encoder.weights"));
      encoder = {{"kind", "clip_vision"},
                 {"tokens", "penultimate hidden states"},
                 {"dtype", config.model.image_encoder.dtype},
                 {"files", files}};
    }
    j["image"] = {{"frame", config.data.image_frame},
                  {"latents", "normalised mean of the image then black frames [z, 1 + (T-1)/4, H/ds, W/ds] float32"},
                  {"fit", "centre crop to the clip's aspect, antialiased bilinear"},
                  {"encoder", encoder}};
  }
  return j.dump();
}

CacheBuildResult build_latent_cache(const RunConfig& config, const CacheBuildOptions& options) {
  if (config.data.dataset != "videos")
    throw DatasetError("data.dataset is '" + config.data.dataset + "'; only videos are cached");
  if (options.out.empty()) throw DatasetError("no output folder for the cache (--out or data.cache)");
  // An existing folder must be a cache's (a build resumes or replaces it): a folder of other files, the videos' own
  // say, is refused before anything is read or written (temporaries of a killed build, its files' *.tmp, are removed
  // below; another .tmp is another program's file).
  if (io::path_exists(options.out) && !io::is_directory(options.out))
    throw DatasetError("the cache folder '" + options.out +
                       "' exists and is not a folder: name a new or empty folder (--out or data.cache)");
  if (io::is_directory(options.out)) {
    for (const auto& name : io::list_directory(options.out))
      if (!std::regex_match(name, kCacheFile) && !std::regex_match(name, kCacheTemporary))
        throw DatasetError("the cache folder '" + options.out + "' holds files that are not a cache's (e.g. '" + name +
                           "'): name a new or empty folder (--out or data.cache)");
  }
  const auto warn = [&](const std::string& m) {
    if (options.on_warning) options.on_warning(m);
  };
  const auto dataset = VideoDataset::open(config.data, static_cast<int>(std::max<int64_t>(1, options.threads)), {},
                                          caches_images(config));
  dataset.check_bad_fraction();
  const json identity = json::parse(cache_identity(config));
  const json decode = decode_settings(config.data);
  const std::string manifest_path = io::join_path(options.out, kManifest);

  CacheBuildResult result;
  result.bad = dataset.bad();
  for (const auto& b : dataset.bad()) warn(fmt::format("bad item {}: {}", b.path, b.reason));
  for (const auto& notice : dataset.notices()) warn(notice);

  json manifest;
  manifest["format"] = kFormat;
  manifest["format_version"] = kFormatVersion;
  manifest["complete"] = false;
  manifest["encoders"] = identity;
  manifest["decode"] = decode;
  manifest["dataset"] = {{"source", dataset_source(config.data)}, {"listed", dataset.listed()}};
  manifest["shard_items"] = options.shard_items;
  // The items the dataset could not use when it opened; "unlisted" marks those its listing could not (no caption,
  // say: an opening of the cache finds them usable once that is fixed).
  json listing_bad = json::array();
  for (const auto& b : dataset.bad()) {
    const auto st = stat_source(b.path);
    listing_bad.push_back({{"index", b.index},
                           {"path", b.path},
                           {"reason", b.reason},
                           {"size", st.size},
                           {"mtime_ns", st.mtime_ns},
                           {"unlisted", b.unlisted}});
  }
  manifest["listing_bad"] = listing_bad;

  // Shard k holds usable items [k·S, (k+1)·S) of the dataset.
  const int64_t S = std::max<int64_t>(1, options.shard_items), n = dataset.size();
  const int64_t num_shards = (n + S - 1) / S;
  std::vector<json> shard_records(static_cast<size_t>(num_shards));

  std::unique_ptr<io::FileLock> lock;  // one build at a time into a folder (two would write the same shards)
  // A build refused before it wrote anything (an encoder that does not fit the config, say) takes back the
  // folder it made: nothing but its lock is left in it then.
  struct RemoveIfStillEmpty {
    const std::string& dir;
    std::unique_ptr<io::FileLock>& lock;
    bool created = false, done = false;
    ~RemoveIfStillEmpty() {
      if (!created || done) return;
      try {
        const auto names = io::list_directory(dir);
        if (names.empty() || (names.size() == 1 && names[0] == ".lock")) {
          lock.reset();
          io::remove_tree(dir);
        }
      } catch (const std::exception&) {
        // Leaving the folder is all that can happen.
      }
    }
  } cleanup{options.out, lock, !io::path_exists(options.out)};
  try {
    io::make_directories(options.out);
    std::string holder;
    lock = io::FileLock::try_acquire(io::join_path(options.out, ".lock"), "megaslide-cache", &holder);
    if (!lock)
      throw DatasetError("cache folder '" + options.out + "' is being written by another megaslide-cache: " + holder +
                         " (lock file " + io::join_path(options.out, ".lock") +
                         "); wait for it to end, or choose another --out");
    // Temporaries of a killed build: its own files' (shards, the manifest, the empty prompt), no other .tmp.
    for (const auto& name : io::list_directory(options.out))
      if (std::regex_match(name, kCacheTemporary)) io::remove_tree(io::join_path(options.out, name));
    if (io::path_exists(manifest_path)) try {
        const json old = read_manifest(manifest_path);
        check_same(old.value("encoders", json()), identity, "encoders", options.out, true);
        check_same(old.value("decode", json()), decode, "decode settings", options.out, true);
        // The same dataset; its listing may have changed (videos added or removed): the shards are kept or written
        // again by their items below.
        json old_source = absolute_source(old.value("dataset", json())), now_source = manifest["dataset"];
        old_source.erase("listed");
        now_source.erase("listed");
        check_same(old_source, now_source, "dataset", options.out, true);
        if (old.value("shard_items", int64_t{0}) == S && old.contains("shards") && old["shards"].is_array()) {
          for (const auto& rec : old["shards"]) {
            const int64_t k = rec.value("shard", int64_t{-1});
            if (k < 0 || k >= num_shards) continue;
            // Kept only when it holds the same items, from unchanged sources, and its file verifies.
            bool same = rec.contains("sources") && rec["sources"].size() == static_cast<size_t>(std::min(S, n - k * S));
            std::map<int64_t, std::string> captions;  // the shard's cached items' (its bad items have none)
            for (const auto& cached : rec.value("items", json::array()))
              captions[cached.value("index", int64_t{-1})] = cached.value("caption", "");
            for (int64_t j = 0; same && j < std::min(S, n - k * S); ++j) {
              const auto& src = rec["sources"][static_cast<size_t>(j)];
              const auto& item = dataset.item(k * S + j);
              // An edited caption changes the item's text embeddings.
              if (const auto c = captions.find(item.index); c != captions.end() && c->second != item.caption) {
                same = false;
                break;
              }
              const auto st = stat_source(item.path);
              same = src.value("index", int64_t{-1}) == item.index &&
                     io::absolute_path(src.value("path", "")) == item.path &&
                     src.value("size", uint64_t{0}) == st.size && src.value("mtime_ns", int64_t{0}) == st.mtime_ns;
              // Image-to-video: the item's own image as listed now, unchanged (or none, as then).
              const json image_was = src.value("image", json());
              if (same && item.image.empty() != image_was.is_null()) same = false;
              if (same && !item.image.empty()) {
                const auto image_st = stat_source(item.image);
                same = io::absolute_path(image_was.value("path", "")) == item.image &&
                       image_was.value("size", uint64_t{0}) == image_st.size &&
                       image_was.value("mtime_ns", int64_t{0}) == image_st.mtime_ns;
              }
            }
            const std::string file = io::join_path(options.out, rec.value("file", ""));
            if (!same) continue;
            if (!io::path_exists(file) || io::file_size(file) != rec.value("bytes", uint64_t{0}) ||
                fmt::format("{:08x}", io::file_crc32(file)) != rec.value("crc32", "")) {
              warn("shard " + file + (io::path_exists(file) ? " does not verify (size or CRC-32)" : " is missing") +
                   "; writing it again");
              continue;
            }
            shard_records[static_cast<size_t>(k)] = rec;
          }
        }
      } catch (const json::exception& e) {
        throw DatasetError(manifest_path + " is malformed (" + e.what() +
                           "); remove the folder or choose another --out");
      }

    // The encoders (after the checks above: a mismatch is refused before loading gigabytes), then the
    // empty prompt (caption dropout).
    const auto encoders = cache_encoders(config, resolve_device(config.train.device));
    const io::NamedTensors empty = encoders->encode_text("");
    io::write_safetensors(io::join_path(options.out, kEmptyPrompt), empty,
                          {{"format", "megaslide.cache.empty_prompt"}});
    manifest["empty_prompt_crc32"] = fmt::format("{:08x}", io::file_crc32(io::join_path(options.out, kEmptyPrompt)));

    auto write_manifest = [&](bool complete) {
      json shards = json::array();
      for (const auto& rec : shard_records)
        if (!rec.is_null()) shards.push_back(rec);
      manifest["shards"] = shards;
      manifest["complete"] = complete;
      io::write_file_atomically(manifest_path, manifest.dump(1) + "\n");
    };

    int64_t done = 0, done_here = 0;  // items finished, and of them those this build encoded
    struct {
      int64_t count = 0, limit = 0, longest = 0;
      std::string example;
    } cut;  // captions longer than the text encoder reads, which it cuts
    for (int64_t k = 0; k < num_shards; ++k) {
      const int64_t first = k * S, count = std::min(S, n - first);
      if (!shard_records[static_cast<size_t>(k)].is_null()) {
        for (const auto& b : shard_records[static_cast<size_t>(k)].value("bad", json::array()))
          result.bad.push_back({b.value("index", int64_t{0}), b.value("path", ""), b.value("reason", "")});
        const auto kept =
            static_cast<int64_t>(shard_records[static_cast<size_t>(k)].value("items", json::array()).size());
        result.items_reused += kept;
        result.items += kept;
        ++result.shards_reused;
        done += count;
        if (options.on_progress) options.on_progress(done, n, 0);
        continue;
      }
      // Decode the shard's items on `threads` threads (epoch 0's draws), then encode in order.
      std::vector<torch::Tensor> clips(static_cast<size_t>(count));
      // Image-to-video: each clip's image at the clip's size ([3, H, W] in [-1, 1]) and as given (uint8).
      const bool image_to_video = caches_images(config);
      std::vector<torch::Tensor> images(static_cast<size_t>(count)), pixels(static_cast<size_t>(count));
      std::vector<std::string> errors(static_cast<size_t>(count));
      std::vector<SourceStat> stats(static_cast<size_t>(count)), image_stats(static_cast<size_t>(count));
      std::atomic<int64_t> next{0};
      auto work = [&] {
        use_one_intra_op_thread();
        for (int64_t j = next++; j < count; j = next++) {
          const auto& item = dataset.item(first + j);
          stats[static_cast<size_t>(j)] = stat_source(item.path);
          try {
            clips[static_cast<size_t>(j)] = dataset.load(first + j, 0);
            if (image_to_video) {
              const auto& clip = clips[static_cast<size_t>(j)];
              auto& given = pixels[static_cast<size_t>(j)];
              if (item.image.empty()) {
                if (config.data.image_frame >= clip.size(0))
                  throw DatasetError(fmt::format("the clip has {} frames; data.image_frame {} is past them",
                                                 clip.size(0), config.data.image_frame));
                given = clip[config.data.image_frame].contiguous();
              } else {
                image_stats[static_cast<size_t>(j)] = stat_source(item.image);  // before it is read
                try {
                  given = io::read_video(item.image)[0].contiguous();
                } catch (const std::exception& e) {
                  throw DatasetError("its image '" + item.image + "': " + e.what());
                }
              }
              images[static_cast<size_t>(j)] = io::fit_image(given, clip.size(1), clip.size(2));
            }
          } catch (const std::exception& e) {
            errors[static_cast<size_t>(j)] = e.what();
          }
        }
      };
      std::vector<std::thread> pool;
      for (int64_t t = 0; t < std::min<int64_t>(std::max<int64_t>(1, options.threads), count); ++t)
        pool.emplace_back(work);
      for (auto& t : pool) t.join();

      io::NamedTensors tensors;
      json items = json::array(), bad = json::array(), sources = json::array();
      std::vector<std::pair<size_t, torch::Tensor>> latents;  // item record -> its latents
      std::vector<io::NamedTensors> others;                   // item record -> its other tensors
      for (int64_t j = 0; j < count; ++j) {
        const auto& item = dataset.item(first + j);
        const auto& st = stats[static_cast<size_t>(j)];
        sources.push_back({{"index", item.index}, {"path", item.path}, {"size", st.size}, {"mtime_ns", st.mtime_ns}});
        if (image_to_video && !item.image.empty()) {  // the item's own image: a change makes the item stale
          const auto& image_st = image_stats[static_cast<size_t>(j)];
          sources.back()["image"] = {{"path", item.image}, {"size", image_st.size}, {"mtime_ns", image_st.mtime_ns}};
        }
        if (!errors[static_cast<size_t>(j)].empty()) {
          bad.push_back({{"index", item.index},
                         {"path", item.path},
                         {"reason", errors[static_cast<size_t>(j)]},
                         {"size", st.size},
                         {"mtime_ns", st.mtime_ns}});
          result.bad.push_back({item.index, item.path, errors[static_cast<size_t>(j)]});
          warn(fmt::format("bad item {}: {}", item.path, errors[static_cast<size_t>(j)]));
          continue;
        }
        const auto video = encoders->encode_video(clips[static_cast<size_t>(j)]);
        latents.emplace_back(items.size(), video);
        tensors.emplace_back(std::to_string(item.index) + ".latents", video);
        io::NamedTensors other = encoders->encode_text(item.caption);
        if (const auto [n, limit] = encoders->caption_tokens(item.caption); limit > 0 && n > limit) {
          ++cut.count;
          cut.limit = limit;
          if (n > cut.longest) cut.longest = n, cut.example = item.path;
        }
        if (image_to_video)
          for (auto& [name, t] : encoders->encode_image(images[static_cast<size_t>(j)], pixels[static_cast<size_t>(j)],
                                                        clips[static_cast<size_t>(j)].size(0)))
            other.emplace_back(name, t);
        for (const auto& [name, t] : other) tensors.emplace_back(std::to_string(item.index) + "." + name, t);
        others.push_back(std::move(other));
        items.push_back({{"index", item.index},
                         {"path", item.path},
                         {"caption", item.caption},
                         {"size", st.size},
                         {"mtime_ns", st.mtime_ns},
                         {"bucket", dataset.info(first + j).bucket}});
        if (image_to_video && !item.image.empty()) items.back()["image"] = sources.back()["image"];
        // Progress by item, not only by shard (a shard of 64 items takes minutes with large encoders).
        if (options.on_progress && j + 1 < count) options.on_progress(done + j + 1, n, done_here + j + 1);
      }
      const std::string file = shard_name(k);
      const auto written =
          io::write_safetensors(io::join_path(options.out, file), tensors, {{"format", "megaslide.cache.shard"}});
      const auto header = io::read_safetensors_header(io::join_path(options.out, file));
      std::map<std::string, const io::SafetensorsEntry*> entries;
      for (const auto& e : header.entries) entries[e.name] = &e;
      for (const auto& [record, t] : latents) {
        auto& rec = items[record];
        const auto* e = entries.at(std::to_string(rec["index"].get<int64_t>()) + ".latents");
        rec["offset"] = header.data_start + e->begin;
        rec["bytes"] = e->end - e->begin;
        rec["crc32"] =
            fmt::format("{:08x}", io::crc32(t.data_ptr(), static_cast<size_t>(t.numel() * t.element_size())));
      }
      for (size_t q = 0; q < latents.size(); ++q)
        items[latents[q].first]["others_crc32"] = fmt::format("{:08x}", others_crc32(others[q]));
      shard_records[static_cast<size_t>(k)] = {
          {"shard", k},     {"file", file}, {"bytes", written.bytes}, {"crc32", fmt::format("{:08x}", written.crc32)},
          {"items", items}, {"bad", bad},   {"sources", sources}};
      write_manifest(false);
      result.items += static_cast<int64_t>(items.size());
      ++result.shards;
      done += count;
      done_here += count;
      if (options.on_progress) options.on_progress(done, n, done_here);
    }
    if (cut.count > 0)
      warn(
          fmt::format("{} caption{} longer than the {} tokens umT5 reads: each is cut there, and what follows does not "
                      "reach the model (the longest, {} tokens: {}'s)",
                      cut.count, cut.count == 1 ? " is" : "s are", cut.limit, cut.longest, cut.example));
    // Too many bad items found decoding: the cache stays incomplete (training refuses it, saying why: "refused"),
    // and the error lists every bad item, the listing's and the decoder's.
    try {
      dataset.check_bad_fraction(&result.bad);
    } catch (const DatasetError& e) {
      const std::string what = e.what();
      manifest["refused"] = what.substr(0, what.find(" allows:")) + " allows";
      write_manifest(false);
      throw;
    }
    manifest.erase("refused");
    write_manifest(true);
    // Shards an earlier build wrote that this one does not list (another --shard-items, a shorter dataset).
    std::set<std::string> listed;
    for (const auto& rec : shard_records)
      if (!rec.is_null()) listed.insert(rec.value("file", ""));
    for (const auto& name : io::list_directory(options.out))
      if (std::regex_match(name, kShardFile) && !listed.count(name)) io::remove_tree(io::join_path(options.out, name));
  } catch (const io::IoError& e) {  // the folder failed (no space…): not bad input, what is written so far stays
    throw std::runtime_error(std::string("the cache folder (--out or data.cache): ") + e.what() +
                             "; run again once it can be read and written: the finished shards are kept");
  }
  cleanup.done = true;
  return result;
}

struct LatentCache::Mapping {
  std::string path;
  void* base = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (base == nullptr || base == MAP_FAILED) return;
    io::forget_mapping(base);
    ::munmap(base, bytes);
  }
};

LatentCache::~LatentCache() = default;

std::shared_ptr<LatentCache> LatentCache::open(const RunConfig& config, const std::string& dir) {
  try {
    return open_checked(config, dir);
  } catch (const json::exception& e) {
    throw DatasetError("data.cache '" + dir + "': " + kManifest + " is malformed: " + e.what());
  }
}

std::shared_ptr<LatentCache> LatentCache::open_checked(const RunConfig& config, const std::string& dir) {
  const std::string manifest_path = io::join_path(dir, kManifest);
  if (!io::path_exists(manifest_path))
    throw DatasetError("data.cache '" + dir + "': no " + kManifest +
                       " (not a cache, or never built: run megaslide-cache)");
  const json m = read_manifest(manifest_path);
  if (!m.value("complete", false) && m.contains("refused") && m["refused"].is_string())
    throw DatasetError("data.cache '" + dir + "' is incomplete: megaslide-cache refused its data (" +
                       m["refused"].get<std::string>() +
                       "); remove or fix the bad items it named, or raise data.max_bad_fraction, and run it again");
  if (!m.value("complete", false))
    throw DatasetError("data.cache '" + dir +
                       "' is incomplete (megaslide-cache was interrupted); run megaslide-cache again to finish it");
  check_same(m.value("encoders", json()), json::parse(cache_identity(config)), "encoders", dir);
  check_same(m.value("decode", json()), decode_settings(config.data), "decode settings", dir);
  const json dataset = {{"source", dataset_source(config.data)},
                        {"listed", m.value("dataset", json()).value("listed", int64_t{0})}};
  check_same(absolute_source(m.value("dataset", json())), dataset, "dataset", dir);

  std::shared_ptr<LatentCache> cache(new LatentCache());
  cache->dir_ = dir;
  cache->listed_ = m.at("dataset").at("listed").get<int64_t>();
  cache->num_buckets_ = static_cast<int64_t>(m.at("decode").at("buckets").size());
  std::set<int64_t> covered;
  std::vector<std::string> stale;
  // A bad item: kept as bad unless its source was replaced since (a fixed video would otherwise stay skipped; caches
  // before did not record the source's size and mtime).
  const auto bad_item = [&](const json& b) {
    cache->bad_.push_back({b.value("index", int64_t{0}), b.value("path", ""), b.value("reason", "")});
    covered.insert(b.value("index", int64_t{0}));
    if (!b.contains("mtime_ns")) return;
    const auto now = stat_source(io::absolute_path(b.value("path", "")));
    if (now.exists && (now.size != b.value("size", uint64_t{0}) || now.mtime_ns != b.value("mtime_ns", int64_t{0})))
      stale.push_back(b.value("path", "") + ": was a bad item when cached and has changed since");
  };
  std::map<int64_t, std::string> unlisted;  // the items its listing could not use, and why (caches before: none)
  for (const auto& b : m.value("listing_bad", json::array())) {
    bad_item(b);
    if (b.value("unlisted", false)) unlisted[b.value("index", int64_t{0})] = b.value("reason", "");
  }
  for (const auto& rec : m.value("shards", json::array())) {
    for (const auto& b : rec.value("bad", json::array())) bad_item(b);
    auto mapping = std::make_unique<Mapping>();
    mapping->path = io::join_path(dir, rec.value("file", ""));
    int fd = -1;
    try {
      fd = io::open_input_file(mapping->path);
    } catch (const io::IoError& e) {
      throw DatasetError(std::string("cache shard: ") + e.what());
    }
    struct stat st {};
    ::fstat(fd, &st);
    mapping->bytes = static_cast<size_t>(st.st_size);
    if (static_cast<uint64_t>(st.st_size) != rec.value("bytes", uint64_t{0})) {
      ::close(fd);
      throw DatasetError(fmt::format("cache shard '{}' is {} bytes but the manifest says {} (truncated or replaced)",
                                     mapping->path, st.st_size, rec.value("bytes", uint64_t{0})));
    }
    mapping->base = mapping->bytes > 0 ? ::mmap(nullptr, mapping->bytes, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
    ::close(fd);
    if (mapping->base == MAP_FAILED)
      throw DatasetError("cache shard '" + mapping->path + "': cannot map: " + std::strerror(errno));
    io::register_mapping(mapping->base, mapping->bytes, mapping->path);
    io::SafetensorsHeader header;
    try {
      header = io::read_safetensors_header(mapping->path);
    } catch (const io::IoError& e) {
      throw DatasetError(e.what());
    }
    std::map<std::string, const io::SafetensorsEntry*> entries;
    for (const auto& e : header.entries) entries[e.name] = &e;
    const int64_t shard = static_cast<int64_t>(cache->shards_.size());
    for (const auto& r : rec.value("items", json::array())) {
      Item item;
      item.index = r.value("index", int64_t{0});
      item.path = io::absolute_path(r.value("path", ""));  // (a cache of before recorded them as listed)
      item.caption = r.value("caption", "");
      item.bucket = r.value("bucket", int64_t{0});
      item.shard = shard;
      item.latents_offset = r.value("offset", uint64_t{0});
      item.latents_bytes = r.value("bytes", uint64_t{0});
      item.latents_crc32 = static_cast<uint32_t>(std::stoul(r.value("crc32", "0"), nullptr, 16));
      if (r.contains("others_crc32"))
        item.others_crc32 = static_cast<uint32_t>(std::stoul(r.value("others_crc32", "0"), nullptr, 16));
      // The latents' bytes as the shard's header places them (an edited manifest would read past the mapping).
      const auto latents_entry = entries.find(std::to_string(item.index) + ".latents");
      if (latents_entry == entries.end() || item.latents_offset != header.data_start + latents_entry->second->begin ||
          item.latents_bytes != latents_entry->second->end - latents_entry->second->begin)
        throw DatasetError(fmt::format(
            "cache shard '{}': item {} ({}): the manifest's offset {} and size {} of its latents are not the shard's "
            "(a damaged {}: build the cache again with megaslide-cache)",
            mapping->path, item.index, item.path, item.latents_offset, item.latents_bytes, kManifest));
      const std::string prefix = std::to_string(item.index) + ".";
      for (const auto& [name, e] : entries) {
        if (name.compare(0, prefix.size(), prefix) != 0) continue;
        if (header.data_start + e->end > mapping->bytes)
          throw DatasetError(fmt::format("cache shard '{}': tensor '{}' ends past the file's {} bytes (damaged)",
                                         mapping->path, name, mapping->bytes));
        auto* data = static_cast<char*>(mapping->base) + header.data_start + e->begin;
        item.tensors.emplace_back(name.substr(prefix.size()),
                                  torch::from_blob(data, e->shape, torch::TensorOptions().dtype(e->dtype)));
      }
      const auto st_now = stat_source(item.path);
      if (!st_now.exists) stale.push_back(item.path + ": the source is gone");
      else if (st_now.size != r.value("size", uint64_t{0}) || st_now.mtime_ns != r.value("mtime_ns", int64_t{0}))
        stale.push_back(item.path + ": the source changed since it was cached (size or mtime)");
      if (r.contains("image") && r["image"].is_object()) {
        item.image = io::absolute_path(r["image"].value("path", ""));
        const auto image_now = stat_source(item.image);
        if (!image_now.exists) stale.push_back(item.path + ": its image " + item.image + " is gone");
        else if (image_now.size != r["image"].value("size", uint64_t{0}) ||
                 image_now.mtime_ns != r["image"].value("mtime_ns", int64_t{0}))
          stale.push_back(item.path + ": its image " + item.image + " changed since it was cached (size or mtime)");
      }
      bool has_latents = false;
      for (const auto& [name, t] : item.tensors) has_latents |= name == "latents";
      if (!has_latents) throw DatasetError("cache shard '" + mapping->path + "' lacks " + prefix + "latents");
      covered.insert(item.index);
      cache->items_.push_back(std::move(item));
    }
    cache->shards_.push_back(std::move(mapping));
  }
  std::sort(cache->items_.begin(), cache->items_.end(), [](const Item& a, const Item& b) { return a.index < b.index; });

  // The dataset as it is listed now: every item must be in the cache (cached or known bad), at the same path.
  const bool image_to_video = caches_images(config);
  const auto listing = read_video_manifest(config.data, image_to_video);
  std::map<int64_t, std::string> cached_path, cached_image, cached_caption;
  for (const auto& it : cache->items_)
    cached_path[it.index] = it.path, cached_image[it.index] = it.image, cached_caption[it.index] = it.caption;
  for (const auto& it : listing.items) {
    if (const auto was = unlisted.find(it.index); was != unlisted.end())
      stale.push_back(it.path + ": usable now, a bad item of the listing when cached (" + was->second + ")");
    else if (!covered.count(it.index)) stale.push_back(it.path + ": listed but not in the cache");
    else if (cached_path.count(it.index) && cached_path[it.index] != it.path)
      stale.push_back(it.path + ": listed where the cache has " + cached_path[it.index]);
    else if (cached_caption.count(it.index) && cached_caption[it.index] != it.caption)
      stale.push_back(it.path + ": its caption changed since it was cached");
    else if (image_to_video && cached_path.count(it.index) && cached_image[it.index] != it.image)
      stale.push_back(it.path + ": its image is now " + (it.image.empty() ? "a frame of the clip" : it.image) +
                      ", the cache has " +
                      (cached_image[it.index].empty() ? "a frame of the clip" : cached_image[it.index]));
  }
  // A cached item the listing cannot use now (its caption file removed, say) would train on what it was.
  for (const auto& b : listing.bad)
    if (cached_path.count(b.index))
      stale.push_back(b.path + ": a bad item of the listing now (" + b.reason + "), cached before");
  if (listing.listed() != cache->listed_)
    stale.push_back(fmt::format("{}: lists {} items, the cache was built from {}", dataset_source(config.data),
                                listing.listed(), cache->listed_));
  if (!stale.empty())
    throw DatasetError(
        fmt::format("data.cache '{}' is stale ({} difference{} from the dataset); rebuild it with "
                    "megaslide-cache:{}",
                    dir, stale.size(), stale.size() == 1 ? "" : "s", list_paths(stale)));

  // The empty prompt, checked against the manifest's CRC-32 where it has one (caches before had none).
  try {
    const std::string empty_path = io::join_path(dir, kEmptyPrompt);
    if (m.contains("empty_prompt_crc32") &&
        fmt::format("{:08x}", io::file_crc32(empty_path)) != m.value("empty_prompt_crc32", ""))
      throw DatasetError(
          fmt::format("data.cache '{}': {} does not match the manifest's CRC-32 (corrupted): build the "
                      "cache again with megaslide-cache",
                      dir, kEmptyPrompt));
    const auto empty = io::read_safetensors(empty_path);
    for (const auto& [name, t] : empty.tensors) {
      if (name == "text_ids") cache->empty_prompt_.text_ids = t;
      if (name == "text_mask") cache->empty_prompt_.text_mask = t;
      if (name == "text") cache->empty_prompt_.text = t;
    }
  } catch (const io::IoError& e) {
    throw DatasetError(e.what());
  }
  if (cache->items_.empty()) throw DatasetError("data.cache '" + dir + "' holds no items");
  cache->max_bad_fraction_ = config.data.max_bad_fraction;
  cache->check_bad_fraction({});
  return cache;
}

void LatentCache::check_bad_fraction(const std::vector<BadItem>& more) const {
  const size_t bad = bad_.size() + more.size();
  if (static_cast<double>(bad) <= max_bad_fraction_ * static_cast<double>(listed_)) return;
  std::vector<std::string> lines;
  for (const auto* list : {&bad_, &more})
    for (const auto& b : *list) lines.push_back(b.path + ": " + b.reason);
  throw DatasetError(
      fmt::format("data.cache '{}': {} of {} items are bad, more than data.max_bad_fraction ({}) allows:{}", dir_, bad,
                  listed_, max_bad_fraction_, list_paths(lines, 1000)));
}

std::vector<int64_t> LatentCache::verified_items(std::vector<BadItem>& failed) const {
  std::vector<int64_t> good;
  std::vector<BadItem> found;
  for (int64_t i = 0; i < size(); ++i) {
    try {
      load(i, 0);
      good.push_back(i);
    } catch (const DatasetError& e) {
      found.push_back({items_[static_cast<size_t>(i)].index, items_[static_cast<size_t>(i)].path, e.what()});
    }
  }
  check_bad_fraction(found);
  if (good.empty()) throw DatasetError("data.cache '" + dir_ + "': no item is usable (every one failed its CRC-32)");
  failed.insert(failed.end(), found.begin(), found.end());
  return good;
}

ClipSample LatentCache::load(int64_t index, int64_t) const {
  const auto& item = items_.at(static_cast<size_t>(index));
  ClipSample s;
  for (const auto& [name, t] : item.tensors) {
    if (name == "latents") s.video = t;
    else if (name == "text_ids") s.text_ids = t;
    else if (name == "text_mask") s.text_mask = t;
    else if (name == "text") s.text = t;
  }
  const auto* bytes = static_cast<const char*>(shards_[static_cast<size_t>(item.shard)]->base) + item.latents_offset;
  const uint32_t crc = io::crc32(bytes, item.latents_bytes);
  if (crc != item.latents_crc32)
    throw DatasetError(fmt::format(
        "cache shard '{}': the latents of item {} ({}) have CRC-32 {:08x}, the manifest says {:08x} (corrupted)",
        shards_[static_cast<size_t>(item.shard)]->path, item.index, item.path, crc, item.latents_crc32));
  if (item.others_crc32) {
    const uint32_t others = others_crc32(item.tensors);
    if (others != *item.others_crc32)
      throw DatasetError(fmt::format(
          "cache shard '{}': the text (and image) tensors of item {} ({}) have CRC-32 {:08x}, the manifest says "
          "{:08x} (corrupted)",
          shards_[static_cast<size_t>(item.shard)]->path, item.index, item.path, others, *item.others_crc32));
  }
  return s;
}

namespace {
// Item i's tensor `name`, undefined when it has none.
torch::Tensor tensor_named(const io::NamedTensors& tensors, const std::string& name) {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  return {};
}
// An item of cache `dir` without tensor `name`.
DatasetError missing_tensor(const std::string& dir, int64_t index, const std::string& path, const std::string& name) {
  return DatasetError(fmt::format("data.cache '{}': item {} ({}) has no tensor '{}' (a cache of other encoders?)", dir,
                                  index, path, name));
}
// `items`, or every one of `count` items when it is empty.
std::vector<int64_t> or_every(const std::vector<int64_t>& items, int64_t count) {
  if (!items.empty()) return items;
  std::vector<int64_t> all(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) all[static_cast<size_t>(i)] = i;
  return all;
}
}  // namespace

std::optional<std::vector<int64_t>> LatentCache::common_sizes(const std::string& name,
                                                              const std::vector<int64_t>& items) const {
  std::optional<std::vector<int64_t>> first;
  for (const int64_t i : or_every(items, size())) {
    const auto& item = items_.at(static_cast<size_t>(i));
    const torch::Tensor found = tensor_named(item.tensors, name);
    if (!found.defined() && !first) return std::nullopt;  // the first item has none
    if (!found.defined()) throw missing_tensor(dir_, item.index, item.path, name);
    if (!first) first = found.sizes().vec();
    if (found.sizes().vec() != *first)
      throw DatasetError(fmt::format(
          "data.cache '{}': item {} ({}) has {} {} where the first item has {}: these items cannot be stacked "
          "(one clip size is needed)",
          dir_, item.index, item.path, name, c10::str(found.sizes()), c10::str(c10::IntArrayRef(*first))));
  }
  return first;
}

torch::Tensor LatentCache::stacked(const std::string& name, const std::vector<int64_t>& items) const {
  const auto which = or_every(items, size());
  if (which.empty()) throw DatasetError("data.cache '" + dir_ + "' holds no items");
  if (!common_sizes(name, which)) {  // the first item has none; a later one without it, or of another shape, threw
    const auto& item = items_.at(static_cast<size_t>(which.front()));
    throw missing_tensor(dir_, item.index, item.path, name);
  }
  std::vector<torch::Tensor> parts;
  for (const int64_t i : which) parts.push_back(tensor_named(items_.at(static_cast<size_t>(i)).tensors, name));
  auto out = torch::stack(parts);
  return out.is_floating_point() ? out.to(torch::kFloat32) : out;
}

torch::ScalarType frozen_encoder_dtype(const std::string& name, torch::Device device) {
  return (name == "bf16" || name == "fp8") && device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
}

std::string wan_image_encoder_path(const RunConfig& config) {
  if (!config.model.image_encoder.weights.empty()) return config.model.image_encoder.weights;
  const std::string& repo = config.model.wan.weights;
  if (!repo.empty() && io::is_directory(io::join_path(repo, "image_encoder")))
    return io::join_path(repo, "image_encoder");
  return "";
}

RunConfig with_wan_repository_encoders(const RunConfig& config, std::vector<std::string>* taken) {
  const std::string& repo = config.model.wan.weights;
  const bool needed = config.data.dataset == "videos" || config.train.sample_every > 0;
  if (config.model.arch != Architecture::kWan || repo.empty() || !needed || !io::is_directory(repo)) return config;
  RunConfig c = config;
  auto& te = c.model.text_encoder;
  const std::string t5 = io::join_path(repo, "text_encoder");
  if (te.kind == "builtin" && te.weights.empty() && te.vocab.empty() && io::is_directory(t5)) {
    te.kind = "umt5";
    te.weights = t5;
    if (taken != nullptr) taken->push_back("model.text_encoder: umT5 from " + t5);
  }
  auto& v = c.model.vae;
  const std::string vae = io::join_path(repo, "vae");
  if (v.kind == "none" && v.weights.empty() && io::is_directory(vae)) {
    WanVaeConfig architecture;
    try {
      architecture = WanVae::folder_config(vae);
    } catch (const std::exception& e) {
      throw ConfigError("model.wan.weights '" + repo + "'", "model.vae.weights", error_message(e));
    }
    v.kind = "wan";
    v.weights = vae;
    v.latent_channels = architecture.z_dim;
    v.downscale = architecture.spatial_downscale();
    if (taken != nullptr)
      taken->push_back(fmt::format("model.vae: the Wan VAE from {} ({} latent channels, downscale {})", vae,
                                   v.latent_channels, v.downscale));
  }
  return c;
}

std::optional<WanVaeTiling> wan_vae_tiling(const VaeConfig& v) {
  if (v.tile_size <= 0) return std::nullopt;
  const int64_t overlap =
      static_cast<int64_t>(std::llround(static_cast<double>(v.tile_size) * v.tile_overlap)) / v.downscale * v.downscale;
  return WanVaeTiling{v.tile_size, std::max<int64_t>(v.downscale, v.tile_size - overlap)};
}

}  // namespace megaslide
