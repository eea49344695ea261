#include "megaslide/train/checkpoint.h"

#include "megaslide/io/files.h"

#include <ATen/Parallel.h>
#include <array>

#include <fmt/format.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <torch/optim/adamw.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <tuple>
#include <string_view>

#include "megaslide/io/safetensors_ranges.h"
#include "megaslide/model/dit_weights.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/run_folder.h"
#include "megaslide/train/trainer.h"
#include "megaslide/util/build_info.h"
#include "megaslide/util/device.h"

namespace megaslide {

namespace {
constexpr const char* kFormat = "megaslide.checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kState = "trainer_state.json";
constexpr const char* kModel = "model.safetensors";
const char* const kTensorFiles[3] = {"master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"};
constexpr const char* kEma = "ema.safetensors";  // with train.ema_decay: the fp32 EMA, keyed like the masters
constexpr const char* kModelEma = "model_ema.safetensors";  // ... and as a bf16 weights file
constexpr const char* kTempPrefix = ".tmp-";
// Caps on what is read of the small files: `latest` holds "step-NNNNNNN\n"; the JSON files a few kB
// (the state's data position and RNG states, and the run config).
constexpr uint64_t kMaxPointerBytes = 256;
constexpr uint64_t kMaxJsonBytes = uint64_t{16} << 20;

std::string checkpoints_dir(const std::string& run_dir) { return io::join_path(run_dir, "checkpoints"); }

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw CheckpointError("checkpoint '" + path + "': " + problem);
}

bool is_checkpoint_name(const std::string& name) {
  return name.size() == 12 && name.rfind("step-", 0) == 0 &&
         std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The config keys a resumed run must share with its checkpoint: they fix the model's shape and the
// data and noise streams. Everything else (steps, learning rate, logging, sampling) may change.
bool must_match(const std::string& key) {
  static const std::set<std::string> exact{
      "diffusion.timesteps", "diffusion.beta_schedule", "diffusion.beta_start", "diffusion.beta_end",
      "diffusion.caption_dropout", "diffusion.prediction", "train.batch_size", "train.seed", "offload.compute_dtype",
      "optimizer.state_dtype", "diffusion.objective", "diffusion.shift", "diffusion.timestep_sampling",
      "diffusion.logit_mean", "diffusion.logit_std", "diffusion.first_frame_clean", "diffusion.image_dropout",
      // A LoRA run's adapters: their shapes, scale and the frozen base's storage (its dropout may change).
      "lora.type", "lora.rank", "lora.alpha", "lora.factor", "lora.targets", "lora.base_dtype"};
  // Where a run's initial weights came from (a resume reads its own), and Wan2.2's other expert (the trained
  // low-noise one's initial weights, or the untrained partner the validation videos read): may have moved.
  if (key == "model.wan.weights" || key == "model.wan.weights_2") return false;
  // How data is loaded (threads, read-ahead, from the cache or by decoding) does not change what is drawn.
  // Nor do how many frames the VAE takes per call and how validation videos are decoded.
  static const std::set<std::string> loading{"data.workers",
                                             "data.prefetch",
                                             "data.cache",
                                             "data.max_bad_fraction",
                                             "model.vae.frames_per_batch",
                                             "model.vae.tile_size",
                                             "model.vae.tile_overlap"};
  if (loading.count(key) > 0) return false;
  return key.rfind("model.", 0) == 0 || key.rfind("data.", 0) == 0 || exact.count(key) > 0;
}

// The value at a key path ("model.wan.dim") as YAML text; "" when the config has no such key (to_yaml
// writes only the keys of the run's model family).
std::string lookup(const YAML::Node& root, const std::string& key) {
  YAML::Node node = root;
  for (size_t begin = 0, dot; begin <= key.size(); begin = dot + 1) {
    dot = key.find('.', begin);
    if (dot == std::string::npos) dot = key.size();
    if (!node.IsMap()) return "";
    const YAML::Node next = node[key.substr(begin, dot - begin)];
    if (!next.IsDefined()) return "";
    node.reset(next);  // rebinds `node` (plain assignment would overwrite the value it refers to)
  }
  return YAML::Dump(node);
}

void check_config(const std::string& path, const std::string& saved_yaml, const RunConfig& config) {
  RunConfig saved;
  try {
    saved = parse_saved_run_config(saved_yaml, io::join_path(path, kState) + " (config)");
  } catch (const ConfigError& e) {
    fail(path, std::string("the saved config does not load: ") + e.what());
  }
  const YAML::Node a = YAML::Load(to_yaml(saved)), b = YAML::Load(to_yaml(config));
  // Wan trains on latents and text embeddings made before the run (data.tensors, or a cache that checks
  // its own encoders and whose latents' shape is checked against the model's): its umT5 and VAE serve
  // the validation videos only, which a resume may add.
  const bool wan = config.model.arch == Architecture::kWan;
  auto validation_only = [wan](const std::string& key) {
    return wan && (key.rfind("model.text_encoder.", 0) == 0 || key.rfind("model.vae.", 0) == 0);
  };
  // A LoRA checkpoint holds the adapters alone: without train.init_from the resumed adapters would sit on a
  // freshly initialised frozen model. (Only where the saved one is a model still there to read: one of adapters
  // only started them, and one gone cannot be told apart, nor read again.)
  if (config.lora.rank > 0 && config.train.init_from.empty() && !saved.train.init_from.empty() &&
      holds_lora_adapters(saved.train.init_from) == std::optional<bool>(false))
    fail(path, fmt::format("{}: train.init_from was '{}' when it was saved and is empty here: a LoRA checkpoint holds "
                           "the adapters alone, and they continue on the frozen model train.init_from names; set it "
                           "again (--set train.init_from=...)",
                           kState, saved.train.init_from));
  for (const auto& key : config_keys()) {
    if (!must_match(key) || validation_only(key)) continue;
    std::string x = lookup(a, key), y = lookup(b, key);
    if (key == "lora.alpha") {  // 0 means alpha = rank: the scale the two give is what must match
      const auto effective = [](const RunConfig& c) {
        return c.lora.alpha > 0 ? c.lora.alpha : static_cast<double>(c.lora.rank);
      };
      if (effective(saved) == effective(config)) continue;
      x = fmt::format("{:g}", effective(saved)) + (saved.lora.alpha > 0 ? "" : " (0: the rank)");
      y = fmt::format("{:g}", effective(config)) + (config.lora.alpha > 0 ? "" : " (0: the rank)");
    }
    // auto is sincos or none by the architecture: the model is what counts (a key of the DiT family only).
    if (key == "model.position_embedding" && config.model.arch != Architecture::kWan &&
        saved.model.arch == config.model.arch &&
        DiTOptions::from_config(saved).adds_sincos_positions() ==
            DiTOptions::from_config(config).adds_sincos_positions())
      continue;
    // The resident loop computes in fp32 whatever its config recorded (an older run's `auto` resolved for the
    // streamed trainer): a resume across trainers changes the compute dtype by design (docs/checkpoints.md).
    if (key == "offload.compute_dtype" && (!saved.offload.enabled || !config.offload.enabled)) continue;
    // The number of clips is structured-motion's alone: other data's epoch is its items.
    if (key == "data.num_clips" && saved.data.dataset != "structured-motion" &&
        config.data.dataset != "structured-motion")
      continue;
    if (x != y && key == "offload.compute_dtype")
      fail(path,
           fmt::format("{}: offload.compute_dtype is {} in the checkpoint but {} in this run's config (`auto` "
                       "resolves to the dtype this machine runs fast); resume with --set offload.compute_dtype={}",
                       kState, x, y, x));
    if (x != y)
      fail(path, fmt::format("{}: {} is {} in the checkpoint but {} in this run's config; a run resumes only with the "
                             "model, data and noise settings it was saved with",
                             kState, key, x, y));
  }
}

nlohmann::ordered_json manifest_entry(const io::WrittenFile& f) {
  return {{"bytes", f.bytes}, {"crc32", fmt::format("{:08x}", f.crc32)}};
}

// What each tensor file holds: the masters; m and v, each followed by its int8 group scales, if any.
std::array<io::NamedTensors, 3> tensor_file_lists(const TrainingState& state) {
  std::array<io::NamedTensors, 3> lists{state.master, state.exp_avg, state.exp_avg_sq};
  const io::NamedTensors* scales[2] = {&state.exp_avg_scale, &state.exp_avg_sq_scale};
  for (int i = 0; i < 2; ++i)
    for (const auto& [name, tensor] : *scales[i]) lists[i + 1].emplace_back(name + "#scale", tensor);
  return lists;
}

void write_tensor_files(const std::string& dir, const RunConfig& config, const TrainingState& state,
                        const io::NamedTensors& ema_weights, nlohmann::ordered_json& files) {
  TORCH_CHECK(state.master.size() == state.exp_avg.size() && state.master.size() == state.exp_avg_sq.size(),
              "save_checkpoint: master, exp_avg and exp_avg_sq must list the same parameters");
  const std::map<std::string, std::string> metadata{{"format", kFormat}, {"step", std::to_string(state.step)}};
  io::NamedTensors weights = state.master;
  if (state.shards) weights.insert(weights.end(), state.shards->weights.begin(), state.shards->weights.end());
  files[kModel] = manifest_entry(save_weights(io::join_path(dir, kModel), config, weights, torch::kBFloat16));
  const auto lists = tensor_file_lists(state);
  for (int i = 0; i < 3; ++i)
    files[kTensorFiles[i]] =
        manifest_entry(io::write_safetensors(io::join_path(dir, kTensorFiles[i]), lists[i], metadata));
  if (!state.ema_valid) return;
  TORCH_CHECK(state.ema.size() == state.master.size(), "save_checkpoint: the EMA must list the masters' parameters");
  files[kEma] = manifest_entry(io::write_safetensors(io::join_path(dir, kEma), state.ema, metadata));
  files[kModelEma] = manifest_entry(save_weights(io::join_path(dir, kModelEma), config, ema_weights, torch::kBFloat16));
}
}  // namespace

TrainingState::BlockShards::Held TrainingState::BlockShards::held(int64_t block, Access access) const {
  TORCH_CHECK(block >= 0 && block < static_cast<int64_t>(blocks.size()), "TrainingState: block ", block,
              " out of range");
  if (hold) return hold(block, access);
  return {nullptr, blocks[static_cast<size_t>(block)]};
}

io::NamedTensors gather_ema_weights(const TrainingState& state, bool keep) {
  if (!state.ema_valid) return {};
  if (!state.shards || !state.shards->gather_ema || (state.shards->world_size <= 1 && !state.shards->hold))
    return state.ema;
  io::NamedTensors out = keep ? state.ema : io::NamedTensors{};
  for (size_t l = 0; l < state.shards->blocks.size(); ++l) {
    const auto& b = state.shards->blocks[l];
    const torch::Tensor whole = state.shards->gather_ema(static_cast<int64_t>(l));
    if (!keep) continue;
    int64_t offset = 0;
    for (const auto& [name, shape] : b.params) {
      int64_t n = 1;
      for (const int64_t d : shape) n *= d;
      out.emplace_back(b.name + "." + name, whole.narrow(0, offset, n).view(shape));
      offset += n;
    }
  }
  return out;
}

AdamWMoments adamw_moments(torch::optim::AdamW& optimizer, const torch::Tensor& param) {
  AdamWMoments out;
  auto& state = optimizer.state();
  auto it = state.find(param.unsafeGetTensorImpl());
  if (it == state.end()) {
    out.exp_avg = torch::zeros(param.sizes(), torch::kFloat32);
    out.exp_avg_sq = torch::zeros(param.sizes(), torch::kFloat32);
    return out;
  }
  auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
  out.exp_avg = s.exp_avg().detach().to(torch::kCPU, torch::kFloat32).clone();
  out.exp_avg_sq = s.exp_avg_sq().detach().to(torch::kCPU, torch::kFloat32).clone();
  out.step = s.step();
  return out;
}

void set_adamw_moments(torch::optim::AdamW& optimizer, const torch::Tensor& param, const torch::Tensor& exp_avg,
                       const torch::Tensor& exp_avg_sq, int64_t step) {
  auto& state = optimizer.state();
  auto key = param.unsafeGetTensorImpl();
  if (step == 0) {  // LibTorch creates the state at the first update
    state.erase(key);
    return;
  }
  auto s = std::make_unique<torch::optim::AdamWParamState>();
  s->step(step);
  s->exp_avg(exp_avg.detach().to(param.device(), param.scalar_type()).clone());
  s->exp_avg_sq(exp_avg_sq.detach().to(param.device(), param.scalar_type()).clone());
  state[key] = std::move(s);
}

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:07}", step); }

namespace {
// A checkpoint's manifest.json, as read_manifest accepts it.
struct ManifestFile {
  std::string name;  // relative to the checkpoint folder
  uint64_t bytes = 0;
  std::string crc32;  // 8 lower-case hex digits
};
struct Manifest {
  int64_t step = 0;
  int64_t shard_world = 1;  // the ranks whose shard files it lists (1: none)
  std::vector<ManifestFile> files;
  const ManifestFile* find(const std::string& name) const {
    for (const auto& f : files)
      if (f.name == name) return &f;
    return nullptr;
  }
};

bool is_hex_crc32(const std::string& s) {
  return s.size() == 8 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// "shards/rank-RRRRR-of-WWWWW.safetensors" with R < W and W >= 2: (R, W); nullopt for any other name.
std::optional<std::pair<int64_t, int64_t>> shard_of(const std::string& name) {
  static constexpr std::string_view kHead = "shards/rank-", kMid = "-of-", kTail = ".safetensors";
  if (name.size() != kHead.size() + 5 + kMid.size() + 5 + kTail.size() || name.compare(0, kHead.size(), kHead) != 0 ||
      name.compare(kHead.size() + 5, kMid.size(), kMid) != 0 ||
      name.compare(name.size() - kTail.size(), kTail.size(), kTail) != 0)
    return std::nullopt;
  const std::string r = name.substr(kHead.size(), 5), w = name.substr(kHead.size() + 5 + kMid.size(), 5);
  const auto digits = [](const std::string& x) {
    return std::all_of(x.begin(), x.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(r) || !digits(w)) return std::nullopt;
  const int64_t rank = std::stoll(r), world = std::stoll(w);
  if (world < 1 || rank >= world) return std::nullopt;  // world 1: the NVMe tier's one-rank shard layout
  return std::make_pair(rank, world);
}

// The one reader of manifest.json. It accepts exactly what finish_checkpoint writes: the same bytes
// as its own serialisation (so a byte added, removed or changed outside a value is refused), the
// keys format, format_version, step and files and no other, files that are the checkpoint's own
// (the weights, the trainer state, the three tensor files, and the shard files of one world size,
// every rank's) each with its size and CRC-32 — never a path outside the folder.
Manifest read_manifest(const std::string& path) {
  const std::string manifest_path = io::join_path(path, kManifest);
  if (!io::path_exists(manifest_path))
    fail(path, std::string("no ") + kManifest + " (an incomplete or interrupted save, or not a checkpoint)");
  const auto bad = [&](const std::string& what) { fail(manifest_path, what); };
  std::string text;
  try {
    text = io::read_input_file(manifest_path, kMaxJsonBytes);
  } catch (const io::IoError& e) {
    bad(e.what());
  }
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
    if (j.dump(2) + "\n" != text)
      bad(fmt::format("is not byte for byte what MegaSlide writes ({} bytes: edited, truncated or appended to)",
                      text.size()));
  } catch (const nlohmann::json::exception& e) {
    bad(std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || j.value("format", "") != kFormat || !j.contains("files") || !j["files"].is_object())
    bad(std::string("not a MegaSlide checkpoint manifest (expected format '") + kFormat + "' and a 'files' object)");
  if (!j.contains("format_version") || !j["format_version"].is_number_integer() ||
      j["format_version"].get<int64_t>() != kFormatVersion)
    bad("format_version " + (j.contains("format_version") ? j["format_version"].dump() : std::string("(none)")) +
        " is not supported (this build reads " + std::to_string(kFormatVersion) + ")");
  for (const auto& item : j.items())
    if (item.key() != "format" && item.key() != "format_version" && item.key() != "step" && item.key() != "files")
      bad("has the unknown key '" + item.key() + "'");
  if (!j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() < 0) bad("has no valid 'step'");
  Manifest m;
  m.step = j["step"].get<int64_t>();
  std::set<int64_t> worlds, ranks;
  for (const auto& item : j["files"].items()) {
    const std::string& name = item.key();
    const bool own = name == kModel || name == kState || name == kEma || name == kModelEma ||
                     std::find(std::begin(kTensorFiles), std::end(kTensorFiles), name) != std::end(kTensorFiles);
    const auto shard = shard_of(name);
    if (!own && !shard) bad("lists '" + name + "', which is not a file of a checkpoint");
    if (shard) worlds.insert(shard->second), ranks.insert(shard->first);
    const auto& e = item.value();
    if (!e.is_object() || e.size() != 2 || !e.contains("bytes") || !e["bytes"].is_number_unsigned() ||
        !e.contains("crc32") || !e["crc32"].is_string() || !is_hex_crc32(e["crc32"].get<std::string>()))
      bad("entry for " + name + " needs exactly 'bytes' (a size) and 'crc32' (8 hex digits)");
    m.files.push_back({name, e["bytes"].get<uint64_t>(), e["crc32"].get<std::string>()});
  }
  for (const std::string need : {kModel, kState, kTensorFiles[0], kTensorFiles[1], kTensorFiles[2]})
    if (m.find(need) == nullptr) bad("does not list " + need);
  if ((m.find(kEma) == nullptr) != (m.find(kModelEma) == nullptr))
    bad(std::string("lists one of ") + kEma + " and " + kModelEma + " without the other");
  if (worlds.size() > 1) bad("lists the shards of several world sizes");
  if (!worlds.empty()) {
    m.shard_world = *worlds.begin();
    if (static_cast<int64_t>(ranks.size()) != m.shard_world)
      bad(fmt::format("lists {} of the {} shard files of its ranks", ranks.size(), m.shard_world));
  }
  return m;
}

// What the manifest says of `file` (listed, present, the size it has on disk): its expected CRC-32.
std::string expected_crc32(const std::string& path, const Manifest& manifest, const std::string& file) {
  const std::string manifest_path = io::join_path(path, kManifest);
  const ManifestFile* entry = manifest.find(file);
  if (entry == nullptr) fail(manifest_path, "does not list " + file);
  const std::string file_path = io::join_path(path, file);
  if (!io::path_exists(file_path)) fail(path, file + " is missing");
  const uint64_t bytes = io::file_size(file_path);
  if (bytes != entry->bytes)
    fail(file_path, fmt::format("is {} bytes but the manifest says {} (truncated or replaced)", bytes, entry->bytes));
  return entry->crc32;
}

void check_crc32(const std::string& file_path, uint32_t actual, const std::string& expected) {
  const std::string crc = fmt::format("{:08x}", actual);
  if (crc != expected)
    fail(file_path, "CRC-32 is " + crc + " but the manifest says " + expected + " (the file is corrupted)");
}

// Checks `files` against the manifest (size and CRC-32, each read once).
void verify_files(const std::string& path, const Manifest& manifest, const std::vector<std::string>& files) {
  for (const auto& file : files) {
    const std::string expected = expected_crc32(path, manifest, file);
    check_crc32(io::join_path(path, file), io::file_crc32(io::join_path(path, file)), expected);
  }
}
}  // namespace

namespace {
// The checkpoint a `latest` pointer file names (its folder beside it); CheckpointError when the file
// is not a pointer.
// A pointer's text without the line end and blanks after the name (an editor's CRLF or trailing tab included).
void trim_pointer_text(std::string& text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ' || text.back() == '\t'))
    text.pop_back();
}

std::string follow_pointer(const std::string& pointer) {
  std::string name;
  try {
    name = io::read_input_file(pointer, kMaxPointerBytes);
  } catch (const io::IoError& e) {
    fail(pointer, std::string("cannot be read as the `latest` pointer: ") + e.what());
  }
  trim_pointer_text(name);
  if (!is_checkpoint_name(name))
    fail(pointer, "does not name a checkpoint (expected step-NNNNNNN, found '" + name.substr(0, 40) + "')");
  return io::join_path(io::parent_path(pointer), name);
}

bool looks_like_pointer(const std::string& path) {
  if (io::is_directory(path) || !io::path_exists(path)) return false;
  if (io::file_size(path) > kMaxPointerBytes) return false;
  try {
    std::string text = io::read_input_file(path, kMaxPointerBytes);
    trim_pointer_text(text);
    return is_checkpoint_name(text);
  } catch (const io::IoError&) {
    return false;
  }
}
}  // namespace

std::string latest_checkpoint(const std::string& run_dir) {
  const std::string pointer = io::join_path(checkpoints_dir(run_dir), "latest");
  if (!io::path_exists(pointer)) return "";
  if (io::is_symlink(pointer) && io::is_directory(pointer)) {
    // A link made by hand to a checkpoint folder beside it (ln -s step-0000400 latest): that checkpoint.
    char target[4096] = {};
    const ssize_t n = ::readlink(pointer.c_str(), target, sizeof target - 1);
    std::string name = n > 0 ? std::string(target, static_cast<size_t>(n)) : "";
    while (!name.empty() && name.back() == '/') name.pop_back();
    name = name.substr(name.find_last_of('/') == std::string::npos ? 0 : name.find_last_of('/') + 1);
    if (!is_checkpoint_name(name))
      fail(pointer, "is a link to a folder that is not a checkpoint of this run (step-NNNNNNN beside it)");
    return io::join_path(checkpoints_dir(run_dir), name);
  }
  return follow_pointer(pointer);
}

namespace {
// Points `latest` in `root` at checkpoint `name`: an atomic rename over it. A link made there by hand is replaced
// by the pointer file (a rename replaces the link, not what it names).
void write_latest(const std::string& root, const std::string& name) {
  const std::string pointer = io::join_path(root, "latest");
  if (!io::is_symlink(pointer)) return io::write_file_atomically(pointer, name + "\n");
  const std::string fresh = io::join_path(root, ".tmp-latest-" + std::to_string(::getpid()));
  io::write_file_atomically(fresh, name + "\n");
  io::rename_durably(fresh, pointer);
}
}  // namespace

std::vector<std::string> complete_checkpoints(const std::string& run_dir) {
  std::vector<std::string> out;
  const std::string root = checkpoints_dir(run_dir);
  if (!io::is_directory(root)) return out;
  try {
    for (const auto& name : io::list_directory(root))  // sorted: zero-padded steps
      if (is_checkpoint_name(name) && io::path_exists(io::join_path(io::join_path(root, name), kManifest)))
        out.push_back(io::join_path(root, name));
  } catch (const io::IoError&) {
  }
  return out;
}

namespace {
// Why a run folder without `latest` has no checkpoint to resume, or which ones it still holds.
std::string without_latest(const std::string& run_dir) {
  const auto complete = complete_checkpoints(run_dir);
  const std::string pointer = io::join_path(checkpoints_dir(run_dir), "latest");
  if (complete.empty()) return "has no checkpoint (no " + pointer + ")";
  return "has no `latest` pointer (" + pointer + " is missing or a broken link) but holds " +
         std::to_string(complete.size()) + " complete checkpoint" + (complete.size() == 1 ? "" : "s") +
         ": resume the newest by its name, --resume " + complete.back();
}

// `latest`'s checkpoint of run_dir (`pointer` its file), refused when that folder is gone (removed by hand, or a
// failed save's), naming the newest complete checkpoint left.
std::string existing(const std::string& run_dir, const std::string& checkpoint) {
  if (io::path_exists(checkpoint)) return checkpoint;
  const auto complete = complete_checkpoints(run_dir);
  throw CheckpointError(fmt::format(
      "{} names {}, which does not exist{}", io::join_path(checkpoints_dir(run_dir), "latest"), checkpoint,
      complete.empty() ? std::string(": the run has no complete checkpoint left")
                       : fmt::format(": resume the newest complete one by its name, --resume {}", complete.back())));
}
}  // namespace

std::string find_checkpoint(const std::string& spelled) {
  std::string spec = spelled;  // a shell's completion ends a folder with '/'
  while (spec.size() > 1 && spec.back() == '/') spec.pop_back();
  if (spec.empty()) throw CheckpointError("checkpoint: an empty path names no checkpoint");
  if (!io::path_exists(spec)) throw CheckpointError("checkpoint '" + spec + "' does not exist");
  if (io::is_directory(spec)) {
    if (io::path_exists(io::join_path(spec, kManifest))) return spec;  // a checkpoint folder
    if (io::path_exists(io::join_path(spec, "checkpoints"))) {         // a run folder
      const std::string latest = latest_checkpoint(spec);
      if (latest.empty()) throw CheckpointError("run folder '" + spec + "' " + without_latest(spec));
      return existing(spec, latest);
    }
    if (io::path_exists(io::join_path(spec, "latest")))
      return follow_pointer(io::join_path(spec, "latest"));  // RUN/checkpoints
    if (!describe_existing_run(spec).empty())                // a run's files, no checkpoint among them
      throw CheckpointError("run folder '" + spec +
                            "' has no checkpoints: it saved none (it stopped before its first, is still before it, or "
                            "was trained with train.checkpoint_every: 0)");
    fail(spec,
         std::string("is a folder but neither a checkpoint (no ") + kManifest + ") nor a run folder (no checkpoints/)");
  }
  if (looks_like_pointer(spec)) return follow_pointer(spec);
  fail(spec,
       "is a file; a checkpoint is a folder (RUN/checkpoints/step-NNNNNNN), the `latest` file beside it, or a run "
       "folder");
}

bool is_checkpoint_pointer(const std::string& path) { return looks_like_pointer(path); }

namespace {
// `spec` names a weights file (megaslide-train --export-weights), not a checkpoint by one of its names.
bool is_weights_file(const std::string& spec) {
  return !spec.empty() && io::path_exists(spec) && !io::is_directory(spec) && !looks_like_pointer(spec);
}
}  // namespace

std::string find_weights(const std::string& spec) {
  if (is_weights_file(spec)) {
    // A checkpoint's own weights file named directly is checked against its manifest, as through its folder.
    const std::string folder = io::parent_path(io::absolute_path(spec));
    if (io::path_exists(io::join_path(folder, kManifest))) {
      const std::string name = spec.substr(spec.find_last_of('/') + 1);
      const Manifest manifest = read_manifest(folder);
      if (manifest.find(name) != nullptr) verify_files(folder, manifest, {name});
    }
    return spec;
  }
  return checkpoint_weights(find_checkpoint(spec));
}

std::string find_ema_weights(const std::string& spec) {
  if (is_weights_file(spec)) return "";
  const std::string path = find_checkpoint(spec);
  const Manifest manifest = read_manifest(path);
  if (manifest.find(kModelEma) == nullptr) return "";
  verify_files(path, manifest, {kModelEma});
  return io::join_path(path, kModelEma);
}

std::string resolve_checkpoint(const std::string& run_dir, const std::string& spec) {
  if (spec == "latest") {
    const std::string path = latest_checkpoint(run_dir);
    if (path.empty())
      throw CheckpointError("--resume latest: run directory '" + run_dir + "' " + without_latest(run_dir));
    return existing(run_dir, path);
  }
  return find_checkpoint(spec);
}

int64_t checkpoint_step(const std::string& path) { return read_manifest(path).step; }

bool is_checkpoint_of(const std::string& run_dir, const std::string& checkpoint) {
  // Lexically first (a trailing slash, "." and ".." are no other folder), then through links.
  char* here = ::realpath(checkpoints_dir(run_dir).c_str(), nullptr);
  char* there = ::realpath(io::parent_path(io::absolute_path(checkpoint)).c_str(), nullptr);
  const bool same = here != nullptr && there != nullptr && std::string(here) == there;
  std::free(here);
  std::free(there);
  return same;
}

bool roll_back_latest(const std::string& run_dir, const std::string& spelled) {
  const std::string checkpoint = io::absolute_path(spelled);
  const std::string latest = latest_checkpoint(run_dir);
  if (latest.empty() || io::absolute_path(latest) == checkpoint) return false;
  // Only a checkpoint of this run's own folder is made `latest`: one taken from elsewhere starts this
  // run's history afresh (into a folder without a run of its own: training_run), and its own `latest` moves
  // with its first save.
  if (!is_checkpoint_of(run_dir, checkpoint)) return false;
  const std::string name = checkpoint.substr(checkpoint.find_last_of('/') + 1);
  if (!is_checkpoint_name(name) || checkpoint_step(checkpoint) >= checkpoint_step(latest)) return false;
  try {
    write_latest(checkpoints_dir(run_dir), name);
  } catch (const io::IoError& e) {
    throw CheckpointError(std::string("rolling back to ") + checkpoint + ": cannot update `latest`: " + e.what());
  }
  return true;
}

void check_frozen_base_kept(const std::string& path, const RunConfig& config) {
  // A Wan LoRA run may not lose the weights file of its frozen model (model.wan.weights, and weights_2 of Wan2.2's
  // low-noise expert): it would resume on a random one, unless train.init_from names the model now.
  if (config.model.arch != Architecture::kWan || config.lora.rank <= 0 ||
      !holds_lora_adapters(config.train.init_from).value_or(true))
    return;
  const RunConfig saved = checkpoint_config(path);
  for (const auto& [key, then, now] : {std::tuple<const char*, std::string, std::string>{
                                           "model.wan.weights", saved.model.wan.weights, config.model.wan.weights},
                                       {"model.wan.weights_2", saved.model.wan.weights_2, config.model.wan.weights_2}})
    if (!then.empty() && now.empty())
      fail(path, fmt::format("{}: {} was '{}' when it was saved and is empty here: a LoRA checkpoint holds the "
                             "adapters alone, and they continue on the frozen model {} names; set it again (--set "
                             "{}=...)",
                             kState, key, then, key, key));
}

RunConfig checkpoint_config(const std::string& path) {
  try {
    const auto s = nlohmann::json::parse(io::read_input_file(io::join_path(path, kState), kMaxJsonBytes));
    return parse_saved_run_config(s.at("config").get<std::string>(), io::join_path(path, kState) + " (config)");
  } catch (const std::exception& e) {
    fail(path, std::string("its saved config cannot be read: ") + e.what());
  }
}

std::vector<std::string> resume_warnings(const std::string& path, const RunConfig& config, bool training) {
  std::vector<std::string> out;
  nlohmann::json s;
  try {
    s = nlohmann::json::parse(io::read_input_file(io::join_path(path, kState), kMaxJsonBytes));
    const RunConfig saved =
        parse_saved_run_config(s.at("config").get<std::string>(), io::join_path(path, kState) + " (config)");
    const YAML::Node a = YAML::Load(to_yaml(saved)), b = YAML::Load(to_yaml(config));
    // LibTorch's CPU reductions split their work by thread count: another count sums in another order. The count
    // here is the one the settings give on this machine (train.threads 0 is `auto`: as many as it plans here); the
    // saved one is the count the checkpoint records (older checkpoints: its settings' count on this machine).
    const auto threads = [](const RunConfig& c) {
      try {
        return plan_threads(c, resolve_device(c.train.device)).intra_op;
      } catch (const std::exception&) {
        return static_cast<int>(c.train.threads);
      }
    };
    const bool recorded = s.contains("intra_op_threads") && s.at("intra_op_threads").is_number_integer();
    const int saved_threads = recorded ? s.at("intra_op_threads").get<int>() : threads(saved);
    const int threads_here = threads(config);
    if (saved_threads != threads_here) {
      const std::string x = lookup(a, "train.threads"), y = lookup(b, "train.threads");
      const auto count = [](int n) { return fmt::format("{} thread{}", n, n == 1 ? "" : "s"); };
      out.push_back(fmt::format(
          "train.threads is {} here ({}) but was {} ({} {}) when {} was saved: the run continues, but its losses will "
          "no longer match an uninterrupted run's bit for bit; resume with --set train.threads={} for an exact "
          "continuation",
          y, count(threads_here), x, count(saved_threads), recorded ? "then" : "on this machine", path, saved_threads));
    }
    // The learning-rate schedule follows the train section as it is now: another train.steps (or lr, warm-up,
    // schedule, floor) moves the rate of the next step, which a user extending a run may not expect.
    const int64_t next = checkpoint_step(path);
    const double lr_then = learning_rate(saved.train, next), lr_now = learning_rate(config.train, next);
    if (training && lr_then != lr_now) {
      std::string changed;
      for (const char* key :
           {"train.lr", "train.lr_schedule", "train.warmup_steps", "train.min_lr_ratio", "train.steps"})
        if (lookup(a, key) != lookup(b, key))
          changed += fmt::format("{}{} {} -> {}", changed.empty() ? "" : ", ", key, lookup(a, key), lookup(b, key));
      out.push_back(fmt::format(
          "the learning rate of step {} is {:.4g} with this config's train section but was to be {:.4g} when {} was "
          "saved ({}): the schedule continues from the settings given now",
          next + 1, lr_now, lr_then, path, changed));
    }
    // A LoRA checkpoint holds the adapters alone: a resume takes the frozen model from train.init_from again where
    // it names a model (adapters there only started the run).
    const std::string init_then = lookup(a, "train.init_from"), init_now = lookup(b, "train.init_from");
    const auto names_a_model = [](const std::string& path) {
      return !path.empty() && holds_lora_adapters(path) != std::optional<bool>(true);
    };
    if (config.lora.rank > 0 && init_then != init_now && (names_a_model(init_then) || names_a_model(init_now)))
      out.push_back(
          fmt::format("train.init_from is {} here but was {} when {} was saved: this LoRA run's adapters "
                      "continue on the frozen model it names now",
                      init_now, init_then, path));
    // Wan's frozen model from its weights files (check_frozen_base_kept refuses one that became empty).
    if (config.lora.rank > 0 && config.model.arch == Architecture::kWan)
      for (const char* key : {"model.wan.weights", "model.wan.weights_2"})
        if (lookup(a, key) != lookup(b, key) && !names_a_model(config.train.init_from))
          out.push_back(fmt::format(
              "{} is {} here but was {} when {} was saved: this LoRA run's adapters continue on the frozen model it "
              "names now",
              key, lookup(b, key), lookup(a, key), path));
  } catch (const std::exception&) {
    // load_checkpoint reports a broken state file; warnings are only extra.
  }
  return out;
}

namespace {
std::function<void(const std::string&)>& save_observer() {
  static std::function<void(const std::string&)> observer;
  return observer;
}
void observe(const char* stage) {
  if (save_observer()) save_observer()(stage);
}
}  // namespace

void detail::set_save_checkpoint_observer(std::function<void(const std::string& stage)> observer) {
  save_observer() = std::move(observer);
}

namespace {

// The shard layout: several ranks, or the NVMe tier's blocks (in memory one at a time).
bool sharded(const TrainingState& state) {
  return state.shards && (state.shards->world_size > 1 || state.shards->hold);
}

std::string shard_file(int64_t rank, int64_t world_size) {
  return fmt::format("shards/rank-{:05}-of-{:05}.safetensors", rank, world_size);
}

// The blocks' flat layouts of a sharded state, for trainer_state.json: how a shard maps to parameters.
nlohmann::ordered_json shard_layout(const TrainingState::BlockShards& shards) {
  nlohmann::ordered_json blocks = nlohmann::ordered_json::array();
  for (const auto& b : shards.blocks) {
    nlohmann::ordered_json params = nlohmann::ordered_json::array();
    for (const auto& [name, shape] : b.params) params.push_back({{"name", name}, {"shape", shape}});
    blocks.push_back({{"name", b.name}, {"numel", b.numel}, {"params", params}});
  }
  return {{"world_size", shards.world_size}, {"blocks", blocks}};
}

// trainer_state.json and the manifest (written last) into `tmp`, then the folder published under its
// step's name and `latest` pointed at it.
void finish_checkpoint(const std::string& root, const std::string& name, const std::string& tmp,
                       const RunConfig& config, const TrainingState& state, nlohmann::ordered_json& files) {
  const std::string final_path = io::join_path(root, name);
  nlohmann::ordered_json s;
  s["format"] = kFormat;
  s["format_version"] = kFormatVersion;
  s["megaslide_version"] = version();
  s["step"] = state.step;
  s["optimizer_steps"] = state.optimizer_steps;
  if (!state.part_steps.empty()) s["part_steps"] = state.part_steps;
  s["loss_scale"] = state.loss_scale;
  s["clean_steps"] = state.clean_steps;
  s["skipped_steps"] = state.skipped_steps;
  s["consecutive_skips"] = state.consecutive_skips;
  s["data"] = nlohmann::ordered_json::parse(state.data_state.empty() ? "{}" : state.data_state);
  if (sharded(state)) s["shards"] = shard_layout(*state.shards);
  s["config"] = to_yaml(config);
  s["intra_op_threads"] = at::get_num_threads();  // what train.threads resolved to: a resume compares it
  const std::string state_text = s.dump(2) + "\n";
  {
    io::AtomicFileWriter out(io::join_path(tmp, kState));
    out.write(state_text.data(), state_text.size());
    out.commit();
    files[kState] = manifest_entry({out.bytes_written(), out.crc32()});
  }
  nlohmann::ordered_json manifest;
  manifest["format"] = kFormat;
  manifest["format_version"] = kFormatVersion;
  manifest["step"] = state.step;
  manifest["files"] = files;
  io::write_file_atomically(io::join_path(tmp, kManifest), manifest.dump(2) + "\n");

  observe("complete");

  // Same step saved again (a run rolled back to an earlier checkpoint reaching this step again): the
  // new folder and the old one swap names in one atomic exchange, so the name always holds a
  // complete checkpoint; the old one then goes. Where the file system cannot exchange, two renames
  // do it: `latest` never names this step then (a rolled-back run moved `latest` back first).
  if (io::path_exists(final_path)) {
    if (!io::exchange_durably(tmp, final_path)) {
      const std::string aside =
          io::join_path(root, kTempPrefix + std::string("old-") + name + "-" + std::to_string(::getpid()));
      io::rename_durably(final_path, aside);
      observe("moved-aside");
      io::rename_durably(tmp, final_path);
      io::remove_tree(aside);
    }
  } else {
    io::rename_durably(tmp, final_path);
  }
  observe("in-place");
  write_latest(root, name);
  observe("latest");
  io::remove_tree(tmp);  // after an exchange: the replaced checkpoint
}

// What is true of the run's checkpoints after a failed save, for its message.
std::string what_is_intact(const std::string& run_dir, const std::string& previous) {
  try {
    const std::string latest = latest_checkpoint(run_dir);
    if (latest.empty()) {
      const auto complete = complete_checkpoints(run_dir);
      return complete.empty() ? "there is no earlier checkpoint"
                              : "`latest` is missing; the newest complete checkpoint is " + complete.back() +
                                    " (--resume it by that name)";
    }
    if (io::path_exists(io::join_path(latest, kManifest)))
      return latest == previous ? "the previous checkpoint " + latest + " is intact"
                                : "`latest` names " + latest + ", which is intact";
    return "`latest` names " + latest + ", which is missing: resume from another checkpoint folder";
  } catch (const std::exception& pointer_error) {
    return std::string("`latest` cannot be read (") + pointer_error.what() + ")";
  }
}

// A sharded state: three agreements among the ranks (the temporary folder is ready; every shard is
// written, with its size and CRC-32; rank 0 has published), so that every rank returns or throws
// alike and no rank waits for one that gave up.
std::string save_sharded_checkpoint(const std::string& run_dir, const RunConfig& config, const TrainingState& state,
                                    const RankSum& sum) {
  const auto& shards = *state.shards;
  const int64_t rank = shards.rank, world = shards.world_size;
  TORCH_CHECK(sum != nullptr || world == 1, "save_checkpoint: a sharded state needs the ranks' sum");
  const std::string root = checkpoints_dir(run_dir);
  const std::string name = checkpoint_name(state.step);
  const std::string final_path = io::join_path(root, name);
  // The same name on every rank (a shared file system), unlike a one-process save's.
  const std::string tmp = io::join_path(root, kTempPrefix + name + fmt::format("-{}-ranks", world));
  const std::string previous = rank == 0 ? latest_checkpoint(run_dir) : "";
  std::string error;  // this rank's failure
  const auto attempt = [&](const std::function<void()>& fn) {
    if (!error.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  // Agreement: every rank's failure flag (plus `extra` values per rank) summed; the failed ranks named.
  const auto agree = [&](const char* stage, std::vector<int64_t> mine) {
    const size_t per = mine.size() + 1;
    std::vector<int64_t> all(per * static_cast<size_t>(world), 0);
    all[per * rank] = error.empty() ? 0 : 1;
    std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(per * rank + 1));
    if (world > 1) sum(all);
    std::string failed;
    for (int64_t r = 0; r < world; ++r)
      if (all[per * r] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    if (!failed.empty()) {
      if (rank == 0) {
        try {
          io::remove_tree(tmp);
        } catch (...) {
        }
      }
      throw CheckpointError(
          fmt::format("saving checkpoint {} failed {} on rank(s) {}{}; {}", final_path, stage, failed,
                      error.empty() ? " (their logs say why)" : ": " + error,
                      rank == 0 ? what_is_intact(run_dir, previous) : "rank 0's log says what is intact"));
    }
    return all;
  };
  if (rank == 0)
    attempt([&] {
      io::make_directories(root);
      io::remove_tree(tmp);
      io::make_directories(io::join_path(tmp, "shards"));
    });
  agree("preparing the folder", {});
  io::WrittenFile written;
  attempt([&] {
    // Block by block (the NVMe tier holds one block's state in memory at a time while its parts are written).
    io::NamedTensors tensors;
    std::vector<std::pair<size_t, int>> part_of;  // each tensor's block and part
    for (size_t l = 0; l < shards.blocks.size(); ++l) {
      const auto& b = shards.blocks[l];
      const std::pair<const char*, const torch::Tensor*> parts[6] = {
          {"#master", &b.master},
          {"#exp_avg", &b.exp_avg},
          {"#exp_avg_sq", &b.exp_avg_sq},
          {"#ema", state.ema_valid ? &b.ema : nullptr},
          {"#exp_avg_scale", b.exp_avg_scale.defined() ? &b.exp_avg_scale : nullptr},
          {"#exp_avg_sq_scale", b.exp_avg_sq_scale.defined() ? &b.exp_avg_sq_scale : nullptr}};
      for (int k = 0; k < 6; ++k) {
        if (parts[k].second == nullptr) continue;
        tensors.emplace_back(b.name + parts[k].first, *parts[k].second);
        part_of.emplace_back(l, k);
      }
    }
    const std::map<std::string, std::string> metadata{{"format", kFormat},
                                                      {"step", std::to_string(state.step)},
                                                      {"rank", std::to_string(rank)},
                                                      {"world_size", std::to_string(world)}};
    size_t current = shards.blocks.size();
    TrainingState::BlockShards::Held held;
    written = io::write_safetensors(io::join_path(tmp, shard_file(rank, world)), tensors, metadata, [&](size_t i) {
      const auto [l, k] = part_of[i];
      if (l != current) {
        held = {};  // the previous block's lease ends first
        held = shards.held(static_cast<int64_t>(l), TrainingState::BlockShards::Access::kRead);
        current = l;
      }
      const auto& b = held.block;
      const torch::Tensor* parts[6] = {&b.master, &b.exp_avg,       &b.exp_avg_sq,
                                       &b.ema,    &b.exp_avg_scale, &b.exp_avg_sq_scale};
      return *parts[k];
    });
  });
  const auto written_all =
      agree("writing the shards", {static_cast<int64_t>(written.bytes), static_cast<int64_t>(written.crc32)});
  // The EMA's weights file: every rank's shard of each block put together (every rank takes part; rank 0
  // keeps them for model_ema.safetensors, the others one block at a time).
  const io::NamedTensors ema_weights = gather_ema_weights(state, rank == 0);
  if (rank == 0)
    attempt([&] {
      nlohmann::ordered_json files = nlohmann::ordered_json::object();
      write_tensor_files(tmp, config, state, ema_weights, files);
      for (int64_t r = 0; r < world; ++r)
        files[shard_file(r, world)] = manifest_entry(
            {static_cast<uint64_t>(written_all[3 * r + 1]), static_cast<uint32_t>(written_all[3 * r + 2])});
      finish_checkpoint(root, name, tmp, config, state, files);
    });
  agree("publishing", {});
  return final_path;
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, const RunConfig& config, const TrainingState& state,
                            const RankSum& sum) {
  if (sharded(state)) return save_sharded_checkpoint(run_dir, config, state, sum);
  const std::string root = checkpoints_dir(run_dir);
  const std::string name = checkpoint_name(state.step);
  const std::string final_path = io::join_path(root, name);
  const std::string tmp = io::join_path(root, kTempPrefix + name + "-" + std::to_string(::getpid()));
  std::string previous;
  try {
    previous = latest_checkpoint(run_dir);
    io::make_directories(root);
    io::remove_tree(tmp);
    io::make_directories(tmp);
    nlohmann::ordered_json files = nlohmann::ordered_json::object();
    write_tensor_files(tmp, config, state, state.ema, files);
    finish_checkpoint(root, name, tmp, config, state, files);
  } catch (const std::exception& e) {
    try {
      io::remove_tree(tmp);
    } catch (...) {
    }
    // Say what is true now, not what was true before the save began.
    throw CheckpointError(
        fmt::format("saving checkpoint {} failed: {}; {}", final_path, e.what(), what_is_intact(run_dir, previous)));
  }
  return final_path;
}

void check_checkpoints_writable(const std::string& run_dir, int64_t step) {
  const std::string root = checkpoints_dir(run_dir);
  // The names a save uses: its temporary folder, and in it a temporary file of the longest name it writes.
  const std::string tmp =
      io::join_path(root, kTempPrefix + checkpoint_name(step) + "-" + std::to_string(::getpid()) + "-check");
  const bool existed = io::path_exists(root);  // a folder made here is removed again: the check leaves nothing
  try {
    io::make_directories(root);
    io::remove_tree(tmp);
    io::make_directories(tmp);
    std::string file;
    const std::string shard = shard_file(99999, 99999);  // the longest name a save writes in its folder
    io::make_directories(io::join_path(tmp, io::parent_path(shard)));
    const int fd = io::create_temporary_beside(io::join_path(tmp, shard), file);
    ::close(fd);
    io::forget_temporary(file);
    io::remove_tree(existed ? tmp : root);
  } catch (const io::IoError& e) {
    try {
      io::remove_tree(existed ? tmp : root);
    } catch (...) {
    }
    throw CheckpointError(fmt::format("the run's checkpoints cannot be saved in {}: {}", root, e.what()));
  }
}

std::vector<std::string> prune_checkpoints(const std::string& run_dir, int64_t keep_last) {
  const std::string root = checkpoints_dir(run_dir);
  std::vector<std::string> removed;
  if (!io::is_directory(root)) return removed;
  const std::string latest = latest_checkpoint(run_dir);
  std::vector<std::string> complete;
  for (const auto& name : io::list_directory(root)) {
    const std::string path = io::join_path(root, name);
    // `latest`'s temporary file of a save that was killed: latest.XXXXXX.tmp (create_temporary_beside's name), a
    // regular file (a link planted at such a name is left alone).
    const bool pointer_temporary = name.size() == 17 && name.rfind("latest.", 0) == 0 &&
                                   name.compare(13, 4, ".tmp") == 0 && !io::is_symlink(path) && !io::is_directory(path);
    if (name.rfind(kTempPrefix, 0) == 0 || pointer_temporary) {
      io::remove_tree(path);
      removed.push_back(path);
    } else if (is_checkpoint_name(name) && io::path_exists(io::join_path(path, kManifest))) {
      complete.push_back(name);  // sorted: zero-padded steps
    }
  }
  // Checkpoints past `latest` belong to a run that was rolled back to an earlier one: they neither
  // count towards keep_last nor are removed here; the rolled-back run replaces each when it saves
  // that step again, and once it has gone past them they count as older ones.
  if (!latest.empty()) {
    const std::string latest_name = latest.substr(latest.find_last_of('/') + 1);
    complete.erase(
        std::remove_if(complete.begin(), complete.end(), [&](const std::string& n) { return n > latest_name; }),
        complete.end());
  }
  if (keep_last <= 0) return removed;
  const int64_t excess = static_cast<int64_t>(complete.size()) - keep_last;
  for (int64_t i = 0; i < excess; ++i) {
    const std::string path = io::join_path(root, complete[static_cast<size_t>(i)]);
    if (path == latest) continue;
    io::remove_tree(path);
    removed.push_back(path);
  }
  return removed;
}

namespace {
// The manifest, and every file it lists (a sharded run's shard files too) checked for size and CRC-32.
Manifest verified_manifest(const std::string& path) {
  Manifest manifest = read_manifest(path);
  std::vector<std::string> files;
  for (const auto& f : manifest.files) files.push_back(f.name);
  verify_files(path, manifest, files);
  return manifest;
}
}  // namespace

std::string verify_checkpoint(const std::string& path) {
  verified_manifest(path);
  return io::join_path(path, kModel);
}

std::string checkpoint_weights(const std::string& path) {
  verify_files(path, read_manifest(path), {kModel});
  return io::join_path(path, kModel);
}

namespace {
// A Wan checkpoint's weights file (the weights-file format: "dit." + diffusers' names) rewritten as
// --export-weights writes Wan's (model/wan_weights.h), its tensors read through a read-only mapping
// (no copy of the model in RAM). The file's checksum is verified first.
void export_wan_weights(const std::string& checkpoint, const std::string& file, const io::SafetensorsHeader& header,
                        const WanConfig& wan, const std::string& out, WanWeightsLayout layout) {
  verify_files(checkpoint, read_manifest(checkpoint), {file});
  const std::string weights = io::join_path(checkpoint, file);
  int fd = -1;
  try {
    fd = io::open_input_file(weights);
  } catch (const io::IoError& e) {
    fail(weights, e.what());
  }
  const uint64_t bytes = io::file_size(weights);
  void* base = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) fail(weights, std::string("cannot map: ") + std::strerror(errno));
  io::register_mapping(base, bytes, weights);
  try {
    io::NamedTensors tensors;
    for (const auto& e : header.entries) {
      auto* data = static_cast<char*>(base) + header.data_start + e.begin;
      const std::string name = e.name.rfind("dit.", 0) == 0 ? e.name.substr(4) : e.name;
      tensors.emplace_back(name, torch::from_blob(data, e.shape, torch::TensorOptions().dtype(e.dtype)));
    }
    if (layout == WanWeightsLayout::kDiffusers) save_wan_weights(out, wan, tensors, torch::kBFloat16);
    else save_wan_comfyui_weights(out, wan, tensors, layout == WanWeightsLayout::kComfyUI, torch::kBFloat16);
  } catch (...) {
    io::forget_mapping(base);
    ::munmap(base, bytes);
    throw;
  }
  io::forget_mapping(base);
  ::munmap(base, bytes);
}
}  // namespace

std::string export_checkpoint_weights(const std::string& run_dir, const std::string& spec, const std::string& out,
                                      bool ema, WanWeightsLayout layout,
                                      std::vector<std::string>* comfyui_differences) {
  const std::string path = resolve_checkpoint(run_dir, spec);
  const char* file = ema ? kModelEma : kModel;
  if (ema && read_manifest(path).find(kModelEma) == nullptr)
    fail(path,
         std::string("has no EMA of the weights (") + kModelEma + "): it was saved by a run without train.ema_decay");
  const std::string weights = io::join_path(path, file);
  io::SafetensorsHeader header;
  std::optional<WanConfig> wan;
  std::optional<RunConfig> lora;  // a LoRA run's config
  try {
    header = io::read_safetensors_header(weights);
    const auto config = header.metadata.find("config");
    if (config != header.metadata.end()) {
      const RunConfig c = parse_saved_run_config(config->second, weights);
      if (c.model.arch == Architecture::kWan) wan = c.model.wan;
      if (c.lora.rank > 0) lora = c;
    }
  } catch (const std::exception&) {
    // Unreadable: the copy below names what is wrong (its size or checksum).
  }
  if (lora) {  // the adapters as LoRA file(s), from the fp32 masters (or EMA), checked against the manifest
    const char* source = ema ? kEma : kTensorFiles[0];
    verify_files(path, read_manifest(path), {source});
    const auto adapters = io::read_safetensors(io::join_path(path, source)).tensors;
    save_lora_weights(out, *lora, adapters,
                      layout == WanWeightsLayout::kDiffusers ? LoraLayout::kDiffusers : LoraLayout::kComfyUi);
    return path;
  }
  if (wan) {
    export_wan_weights(path, file, header, *wan, out, layout);
    if (comfyui_differences != nullptr && layout != WanWeightsLayout::kDiffusers)
      *comfyui_differences = wan_comfyui_differences(*wan);
    return path;
  }
  if (layout != WanWeightsLayout::kDiffusers) {
    verify_files(path, read_manifest(path), {file});  // an unreadable file: what is wrong with it
    fail(path, std::string("is not a Wan run's (model.arch wan): --export-layout ") + to_string(layout) +
                   " writes a Wan's weights in ComfyUI's layout; export this checkpoint without it");
  }
  const std::string expected = expected_crc32(path, read_manifest(path), file);
  // One read: copied and checksummed together; a mismatch leaves `out` untouched (the writer's
  // temporary file is removed when it is not committed).
  io::AtomicFileWriter writer(out);
  io::read_in_pieces(weights, [&writer](const char* data, size_t bytes) { writer.write(data, bytes); });
  check_crc32(weights, writer.crc32(), expected);
  writer.commit();
  return path;
}

namespace {
// Fills each block's range [begin, end) of master, m and v: from the shard files of the world size
// that saved them (`saved`: trainer_state.json's "shards"; the ranges that overlap), or, without
// shards, from the per-parameter files through the block's layout.
void read_block_ranges(const std::string& path, const nlohmann::json* saved, const TrainingState::BlockShards& shards,
                       bool ema) {
  const std::string state_path = io::join_path(path, kState);
  int64_t saved_world = 1;
  if (saved != nullptr) {
    if (!saved->is_object() || !saved->contains("world_size") || !saved->at("world_size").is_number_integer() ||
        !saved->contains("blocks") || !saved->at("blocks").is_array())
      fail(state_path, "'shards' needs 'world_size' and 'blocks'");
    saved_world = (*saved)["world_size"].get<int64_t>();
    if (saved_world < 1 || (*saved)["blocks"].size() != shards.blocks.size())
      fail(state_path, fmt::format("'shards' describes {} blocks over {} ranks; this model has {} blocks",
                                   (*saved)["blocks"].size(), saved_world, shards.blocks.size()));
  }
  const char* const parts[4] = {"master", "exp_avg", "exp_avg_sq", "ema"};
  const char* const part_files[4] = {kTensorFiles[0], kTensorFiles[1], kTensorFiles[2], kEma};
  const int components = ema ? 4 : 3;  // the EMA's ranges too
  io::SafetensorsRangeReaders file;    // each file's header parsed once
  for (size_t l = 0; l < shards.blocks.size(); ++l) {
    // The NVMe tier: in memory until done. Every element of the block's state is read below, unless it keeps an
    // EMA this checkpoint has none of: then the old state is read first.
    const bool whole = ema || !shards.blocks[l].ema.defined();
    const auto held = shards.held(static_cast<int64_t>(l), whole ? TrainingState::BlockShards::Access::kOverwrite
                                                                 : TrainingState::BlockShards::Access::kWrite);
    const auto& b = held.block;
    const torch::Tensor targets[4] = {b.master, b.exp_avg, b.exp_avg_sq, b.ema};
    const bool scales = b.exp_avg_scale.defined();  // int8 moments (one process)
    if (saved != nullptr) {
      const auto& layout = (*saved)["blocks"][l];
      bool same = layout.is_object() && layout.value("name", "") == b.name &&
                  layout.value("numel", int64_t{-1}) == b.numel && layout.contains("params") &&
                  layout.at("params").is_array() && layout.at("params").size() == b.params.size();
      for (size_t i = 0; same && i < b.params.size(); ++i) {
        const auto& p = layout.at("params")[i];
        same = p.is_object() && p.value("name", "") == b.params[i].first && p.contains("shape") &&
               p.at("shape").is_array() && p.at("shape") == nlohmann::json(b.params[i].second);
      }
      if (!same)
        fail(state_path,
             "the flat layout of " + b.name + " differs from this model's (another model, or another version of it)");
      if (scales) {
        if (saved_world != 1)
          fail(state_path, "holds the shards of " + std::to_string(saved_world) +
                               " ranks, which keep no int8 moments; this run's optimizer.state_dtype is int8");
        file(io::join_path(path, shard_file(0, 1))).read_into(b.name + "#exp_avg_scale", 0, b.exp_avg_scale);
        file(io::join_path(path, shard_file(0, 1))).read_into(b.name + "#exp_avg_sq_scale", 0, b.exp_avg_sq_scale);
      }
      for (int64_t q = 0; q < saved_world; ++q) {
        const auto range = offload::shard_range(b.numel, q, saved_world);
        const int64_t first = std::max(range.begin, b.begin), last = std::min(range.end, b.end);
        if (first >= last) continue;
        for (int c = 0; c < components; ++c)
          file(io::join_path(path, shard_file(q, saved_world)))
              .read_into(b.name + "#" + parts[c], first - range.begin,
                         targets[c].narrow(0, first - b.begin, last - first));
      }
      continue;
    }
    int64_t offset = 0, group = 0;
    for (const auto& [name, shape] : b.params) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      const int64_t first = std::max(offset, b.begin), last = std::min(offset + n, b.end);
      if (first < last)
        for (int c = 0; c < components; ++c)
          file(io::join_path(path, part_files[c]))
              .read_into(b.name + "." + name, first - offset, targets[c].narrow(0, first - b.begin, last - first));
      if (scales) {  // int8 moments: the parameter's group scales, "<name>#scale" in the moments' files
        const int64_t g = offload::state_groups(n);
        file(io::join_path(path, part_files[1]))
            .read_into(b.name + "." + name + "#scale", 0, b.exp_avg_scale.narrow(0, group, g));
        file(io::join_path(path, part_files[2]))
            .read_into(b.name + "." + name + "#scale", 0, b.exp_avg_sq_scale.narrow(0, group, g));
        group += g;
      }
      offset += n;
    }
  }
}
}  // namespace

void load_checkpoint(const std::string& path, const RunConfig& config, TrainingState& into) {
  const Manifest manifest = verified_manifest(path);
  const std::string state_path = io::join_path(path, kState);
  nlohmann::json s;
  try {
    s = nlohmann::json::parse(io::read_input_file(state_path, kMaxJsonBytes));
  } catch (const nlohmann::json::exception& e) {
    fail(state_path, std::string("not valid JSON: ") + e.what());
  } catch (const io::IoError& e) {
    fail(state_path, e.what());
  }
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!s.is_object() || !s.contains(key)) fail(state_path, std::string("has no '") + key + "'");
    return s[key];
  };
  try {
    check_config(path, field("config").get<std::string>(), config);
    into.step = field("step").get<int64_t>();
    into.optimizer_steps = field("optimizer_steps").get<int64_t>();
    into.loss_scale = field("loss_scale").get<double>();
    into.clean_steps = field("clean_steps").get<int64_t>();
    into.skipped_steps = field("skipped_steps").get<int64_t>();
    into.consecutive_skips = field("consecutive_skips").get<int64_t>();
    into.data_state = field("data").dump();
    into.part_steps = s.contains("part_steps") ? s["part_steps"].get<std::vector<int64_t>>() : std::vector<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    fail(state_path, std::string("a field has the wrong type: ") + e.what());
  }
  if (into.step < 0 || into.optimizer_steps < 0 || into.optimizer_steps > into.step)
    fail(state_path,
         fmt::format("inconsistent counters: step {}, optimizer_steps {}", into.step, into.optimizer_steps));
  int64_t part_sum = 0;
  bool negative = false;
  for (const int64_t n : into.part_steps) part_sum += n, negative |= n < 0;
  if (!into.part_steps.empty() && (negative || part_sum != into.optimizer_steps))
    fail(state_path, fmt::format("inconsistent counters: the parts' updates {} do not add up to optimizer_steps {}",
                                 nlohmann::json(into.part_steps).dump(), into.optimizer_steps));
  const bool saved_sharded = s.is_object() && s.contains("shards");
  const bool wants_shards = into.shards && (into.shards->world_size > 1 || into.shards->hold);
  // Only files the manifest lists (hence verified) are read: the state's world size must be its shards'.
  const int64_t state_world = saved_sharded && s["shards"].is_object() && s["shards"].contains("world_size") &&
                                      s["shards"]["world_size"].is_number_integer()
                                  ? s["shards"]["world_size"].get<int64_t>()
                                  : 1;
  if (state_world != manifest.shard_world)
    fail(state_path, fmt::format("describes shards of {} rank(s) but {} lists those of {}", state_world, kManifest,
                                 manifest.shard_world));
  if (saved_sharded && !into.shards)
    fail(state_path,
         "holds the blocks of a sharded run of the streamed trainer (offload.enabled: true), which this trainer cannot "
         "read");
  // Block parameters the shard ranges cover (a one-process trainer lists them too, as views of the
  // same memory): read through the ranges, not by name, whenever shards are involved.
  std::set<std::string> by_range;
  if (saved_sharded || wants_shards)
    for (const auto& b : into.shards->blocks)
      for (const auto& p : b.params) by_range.insert(b.name + "." + p.first);
  // The EMA when the trainer keeps one (`ema`, or the shards' ema, defined) and the checkpoint has it.
  bool wants_ema = !into.ema.empty();
  if (into.shards)
    for (const auto& b : into.shards->blocks) wants_ema = wants_ema || b.ema.defined();
  into.ema_valid = wants_ema && manifest.find(kEma) != nullptr;
  auto lists = tensor_file_lists(into);  // views of `into`'s tensors: read in place
  std::vector<std::pair<std::string, io::NamedTensors>> files;
  for (int i = 0; i < 3; ++i) files.emplace_back(kTensorFiles[i], std::move(lists[i]));
  if (into.ema_valid) files.emplace_back(kEma, into.ema);
  for (auto& [file, list] : files)
    list.erase(std::remove_if(list.begin(), list.end(),
                              [&](const auto& item) {
                                // int8 scales ("<name>#scale") go with their parameter: read through the ranges too
                                const std::string& n = item.first;
                                const bool scale = n.size() > 6 && n.compare(n.size() - 6, 6, "#scale") == 0;
                                return by_range.count(scale ? n.substr(0, n.size() - 6) : n) > 0;
                              }),
               list.end());
  try {
    for (const auto& [file, list] : files)
      io::read_safetensors_into(io::join_path(path, file), list, /*allow_extra=*/!saved_sharded && wants_shards);
    if (!by_range.empty())
      read_block_ranges(path, saved_sharded ? &s["shards"] : nullptr, *into.shards, into.ema_valid);
  } catch (const io::IoError& e) {
    throw CheckpointError(e.what());
  }
}

}  // namespace megaslide
