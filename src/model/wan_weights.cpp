#include "megaslide/model/wan_weights.h"
#include "megaslide/io/finite_weights.h"
#include "megaslide/io/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <optional>
#include <map>
#include <regex>
#include <set>

#include "megaslide/io/safetensors.h"
#include "megaslide/io/fp8.h"
#include "megaslide/model/encoder_settings.h"
#include "megaslide/model/wan.h"
#include "megaslide/util/glob.h"

namespace megaslide {

namespace {

[[noreturn]] void fail(const std::string& message) { throw WanWeightsError(message); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The one rename table: (diffusers, original) for the names outside the blocks, and for the parts of a
// block's parameter name after "blocks.N.".
const std::vector<std::pair<std::string, std::string>>& top_level_names() {
  static const std::vector<std::pair<std::string, std::string>> table{
      {"condition_embedder.time_embedder.linear_1.", "time_embedding.0."},
      {"condition_embedder.time_embedder.linear_2.", "time_embedding.2."},
      {"condition_embedder.text_embedder.linear_1.", "text_embedding.0."},
      {"condition_embedder.text_embedder.linear_2.", "text_embedding.2."},
      {"condition_embedder.time_proj.", "time_projection.1."},
      {"condition_embedder.image_embedder.norm1.", "img_emb.proj.0."},  // Wan2.1 I2V's MLPProj
      {"condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."},
      {"condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."},
      {"condition_embedder.image_embedder.norm2.", "img_emb.proj.4."},
      {"proj_out.", "head.head."},
      {"patch_embedding.", "patch_embedding."},
  };
  return table;
}
const std::vector<std::pair<std::string, std::string>>& block_names() {
  static const std::vector<std::pair<std::string, std::string>> table{
      {"attn1.to_q.", "self_attn.q."},
      {"attn1.to_k.", "self_attn.k."},
      {"attn1.to_v.", "self_attn.v."},
      {"attn1.to_out.0.", "self_attn.o."},
      {"attn1.norm_q.", "self_attn.norm_q."},
      {"attn1.norm_k.", "self_attn.norm_k."},
      {"attn2.to_q.", "cross_attn.q."},
      {"attn2.to_k.", "cross_attn.k."},
      {"attn2.to_v.", "cross_attn.v."},
      {"attn2.to_out.0.", "cross_attn.o."},
      {"attn2.norm_q.", "cross_attn.norm_q."},
      {"attn2.norm_k.", "cross_attn.norm_k."},
      {"attn2.add_k_proj.", "cross_attn.k_img."},  // Wan2.1 I2V's image branch
      {"attn2.add_v_proj.", "cross_attn.v_img."},
      {"attn2.norm_added_k.", "cross_attn.norm_k_img."},
      {"norm2.", "norm3."},
      {"ffn.net.0.proj.", "ffn.0."},
      {"ffn.net.2.", "ffn.2."},
      {"attn1.offset_dw.", "self_attn.offset_dw."},
      {"attn1.offset_pw.", "self_attn.offset_pw."},
  };
  return table;
}

// Renames `name` with `table` from column `from` to the other; "" when no row applies.
std::string rename(const std::string& name, bool to_original) {
  static const std::regex kBlock(R"(blocks\.([0-9]+)\.(.*))");
  const auto convert = [&](const std::string& rest,
                           const std::vector<std::pair<std::string, std::string>>& table) -> std::string {
    for (const auto& [diffusers, original] : table) {
      const std::string& a = to_original ? diffusers : original;
      const std::string& b = to_original ? original : diffusers;
      if (rest.rfind(a, 0) == 0) return b + rest.substr(a.size());
    }
    return "";
  };
  std::smatch m;
  if (std::regex_match(name, m, kBlock)) {
    const std::string rest = m[2];
    const std::string prefix = "blocks." + m[1].str() + ".";
    if (rest == (to_original ? "scale_shift_table" : "modulation"))
      return prefix + (to_original ? "modulation" : "scale_shift_table");
    if (rest == (to_original ? "attn1.rel_bias" : "self_attn.rel_bias"))
      return prefix + (to_original ? "self_attn.rel_bias" : "attn1.rel_bias");
    const std::string converted = convert(rest, block_names());
    return converted.empty() ? "" : prefix + converted;
  }
  if (name == (to_original ? "scale_shift_table" : "head.modulation"))
    return to_original ? "head.modulation" : "scale_shift_table";
  return convert(name, top_level_names());
}

// One memory-mapped safetensors file.
struct MappedFile {
  std::string path;
  io::SafetensorsHeader header;
  void* base = nullptr;
  size_t bytes = 0;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  explicit MappedFile(std::string path_) : path(std::move(path_)) {
    try {
      header = io::read_safetensors_header(path);
    } catch (const io::IoError& e) {
      fail(e.what());
    }
    int fd = -1;
    try {
      fd = io::open_input_file(path);
    } catch (const io::IoError& e) {
      fail(e.what());
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      fail("'" + path + "': cannot stat: " + std::strerror(errno));
    }
    bytes = static_cast<size_t>(st.st_size);
    base = bytes > 0 ? ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
    ::close(fd);
    if (base == MAP_FAILED) {
      base = nullptr;
      fail("'" + path + "': cannot map: " + std::strerror(errno));
    }
    io::register_mapping(base, bytes, path);
  }
  ~MappedFile() {
    if (base == nullptr) return;
    io::forget_mapping(base);
    ::munmap(base, bytes);
  }
};

struct Source {
  std::shared_ptr<MappedFile> file;
  const io::SafetensorsEntry* entry = nullptr;
  std::string file_name;  // the tensor's name in the file
  // An fp8 weight's per-tensor scale (<layer>.scale_weight or <layer>.weight_scale), when the file has one.
  std::shared_ptr<MappedFile> scale_file{};
  const io::SafetensorsEntry* scale = nullptr;
  std::string scale_name{};
};

// A read-only CPU view of a tensor in its mapping (nothing writes through it; converting it is the copy).
torch::Tensor mapped(const MappedFile& file, const io::SafetensorsEntry& e) {
  auto* data = static_cast<char*>(file.base) + file.header.data_start + e.begin;
  return torch::from_blob(data, e.shape, torch::TensorOptions().dtype(e.dtype));
}

// The fp8 weight of `s` as views of the mapping, its scale a float32 copy (1 when it has none).
Fp8Tensor mapped_fp8(const Source& s) {
  Fp8Tensor t{mapped(*s.file, *s.entry), torch::ones({}, torch::kFloat32)};
  if (s.scale != nullptr) t.scale = mapped(*s.scale_file, *s.scale).to(torch::kFloat32).reshape({}).clone();
  return t;
}

// The first NaN (or, in e5m2, infinity) of fp8 data, -1 when none: e4m3fn's NaNs are S.1111.111 (it has
// no infinity), e5m2's non-finite values S.11111.xx. (io::first_nonfinite knows the 16- to 64-bit types.)
int64_t first_nonfinite_fp8(const torch::Tensor& data) {
  const auto* p = static_cast<const uint8_t*>(data.data_ptr());
  const uint8_t mask = data.scalar_type() == torch::kFloat8_e4m3fn ? 0x7f : 0x7c;
  for (int64_t i = 0; i < data.numel(); ++i)
    if ((p[i] & mask) == mask) return i;
  return -1;
}

// The quantization tensors of fp8 files, which are not parameters (comfy/ops.py, comfy/utils.py
// convert_old_quants): the marker ComfyUI's *_fp8_scaled files carry ("scaled_fp8", its dtype the weights'
// format), each scaled layer's weight scale (<layer>.scale_weight; <layer>.weight_scale in ComfyUI's
// current format, with <layer>.comfy_quant, the layer's format as JSON bytes) and activation scales
// (<layer>.scale_input, <layer>.input_scale: for fp8 matrix products; the weights are dequantized here).
enum class QuantTensor { kNone, kMarker, kWeightScale, kInputScale, kFormat };
QuantTensor quant_tensor(const std::string& name) {
  if (name == "scaled_fp8") return QuantTensor::kMarker;
  if (ends_with(name, ".scale_weight") || ends_with(name, ".weight_scale")) return QuantTensor::kWeightScale;
  if (ends_with(name, ".scale_input") || ends_with(name, ".input_scale")) return QuantTensor::kInputScale;
  if (ends_with(name, ".comfy_quant")) return QuantTensor::kFormat;
  return QuantTensor::kNone;
}
std::string layer_of(const std::string& name) { return name.substr(0, name.rfind('.')); }

bool is_pickle_name(const std::string& path) {
  for (const char* suffix : {".pth", ".pt", ".bin", ".ckpt", ".pkl"})
    if (ends_with(path, suffix)) return true;
  return false;
}

[[noreturn]] void refuse_pickle(const std::string& path) {
  fail("'" + path +
       "' is a PyTorch pickle: MegaSlide reads weights only from safetensors files (loading a pickle can run "
       "code). Use the .safetensors files the model ships (Wan-AI's and the diffusers repositories both have "
       "diffusion_pytorch_model*.safetensors, ComfyUI's are single .safetensors files)");
}

// The safetensors files of a folder: the index's shards, or the one weights file.
std::vector<std::string> weight_files_of_folder(const std::string& dir) {
  for (const std::string index_name :
       {"diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json"}) {
    const std::string index_path = io::join_path(dir, index_name);
    if (!io::path_exists(index_path)) continue;
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(io::read_input_file(index_path, 64u << 20));
    } catch (const std::exception& e) {
      fail("'" + index_path + "' is not a valid index (JSON): " + e.what());
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      fail("'" + index_path + "' has no \"weight_map\" object");
    std::set<std::string> shards;
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string()) fail("'" + index_path + "': the shard of '" + name + "' is not a file name");
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f == "." || f == "..")
        fail("'" + index_path + "': shard '" + f + "' is not a file name");
      shards.insert(f);
    }
    std::vector<std::string> out;
    for (const auto& f : shards) {
      const std::string p = io::join_path(dir, f);
      if (!io::path_exists(p)) fail("'" + index_path + "' names shard '" + f + "', which is not in " + dir);
      out.push_back(p);
    }
    if (out.empty()) fail("'" + index_path + "' lists no shards");
    return out;
  }
  const std::string single = io::join_path(dir, "diffusion_pytorch_model.safetensors");
  if (io::path_exists(single)) return {single};
  std::vector<std::string> found, pickles;
  for (const auto& name : io::list_directory(dir)) {
    if (ends_with(name, ".safetensors")) found.push_back(io::join_path(dir, name));
    if (is_pickle_name(name)) pickles.push_back(name);
  }
  if (found.size() == 1) return found;
  if (found.empty() && !pickles.empty()) refuse_pickle(io::join_path(dir, pickles.front()));
  fail("'" + dir +
       "': expected Wan DiT weights: diffusion_pytorch_model.safetensors, its shards with "
       "diffusion_pytorch_model.safetensors.index.json, or a single .safetensors file (found " +
       std::to_string(found.size()) + " .safetensors files)");
}

int64_t json_int(const nlohmann::json& j, const char* key, int64_t fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number_integer()) fail("'" + source + "': \"" + key + "\" must be an integer, got " + j[key].dump());
  return j[key].get<int64_t>();
}
double json_real(const nlohmann::json& j, const char* key, double fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number()) fail("'" + source + "': \"" + key + "\" must be a number, got " + j[key].dump());
  return j[key].get<double>();
}
bool json_bool(const nlohmann::json& j, const char* key, bool fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) fail("'" + source + "': \"" + key + "\" must be true or false, got " + j[key].dump());
  return j[key].get<bool>();
}
std::array<int64_t, 3> json_patch(const nlohmann::json& j, const std::array<int64_t, 3>& fallback,
                                  const std::string& source) {
  if (!j.contains("patch_size") || j["patch_size"].is_null()) return fallback;
  const auto& v = j["patch_size"];
  if (!v.is_array() || v.size() != 3 || !v[0].is_number_integer() || !v[1].is_number_integer() ||
      !v[2].is_number_integer())
    fail("'" + source + "': \"patch_size\" must be a list of 3 integers, got " + v.dump());
  return {v[0].get<int64_t>(), v[1].get<int64_t>(), v[2].get<int64_t>()};
}

}  // namespace

namespace {
constexpr const char* kWanWeightsFormat = "megaslide.wan_weights";
}  // namespace

const char* to_string(WanNaming naming) { return naming == WanNaming::kDiffusers ? "diffusers" : "original"; }

std::string wan_original_name(const std::string& diffusers_name) {
  return rename(diffusers_name, /*to_original=*/true);
}
std::string wan_diffusers_name(const std::string& original_name) {
  return rename(original_name, /*to_original=*/false);
}

struct WanWeights::Impl {
  std::string path, config_path;
  nlohmann::json config;  // null without a config.json
  WanNaming naming = WanNaming::kDiffusers;
  std::vector<std::string> file_paths;
  std::map<std::string, Source> sources;  // by diffusers name
  std::vector<std::string> unknown;       // file names with no diffusers counterpart
};

WanWeights::WanWeights(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WanWeights::WanWeights(WanWeights&&) noexcept = default;
WanWeights& WanWeights::operator=(WanWeights&&) noexcept = default;
WanWeights::~WanWeights() = default;

const std::string& WanWeights::path() const { return impl_->path; }
WanNaming WanWeights::naming() const { return impl_->naming; }
const std::vector<std::string>& WanWeights::files() const { return impl_->file_paths; }
const std::string& WanWeights::config_path() const { return impl_->config_path; }

WanWeights WanWeights::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  if (path.empty()) fail("model.wan.weights is empty");
  if (!io::path_exists(path)) fail("Wan weights '" + path + "' do not exist" + io::relative_path_note(path));
  std::string dir;
  if (io::is_directory(path)) {
    dir = path;
    // A diffusers repository: its DiT is in transformer/ (Wan2.2's high-noise expert beside transformer_2/);
    // Wan-AI's Wan2.2 repositories: the high-noise expert in high_noise_model/.
    if (!io::path_exists(io::join_path(dir, "diffusion_pytorch_model.safetensors")) &&
        !io::path_exists(io::join_path(dir, "diffusion_pytorch_model.safetensors.index.json"))) {
      for (const char* sub : {"transformer", "high_noise_model"})
        if (io::is_directory(io::join_path(dir, sub))) {
          dir = io::join_path(dir, sub);
          break;
        }
    }
    impl->file_paths = weight_files_of_folder(dir);
    if (io::path_exists(io::join_path(dir, "config.json"))) impl->config_path = io::join_path(dir, "config.json");
  } else if (is_pickle_name(path)) {
    refuse_pickle(path);
  } else if (ends_with(path, ".index.json")) {
    dir = io::parent_path(path);
    impl->file_paths = weight_files_of_folder(dir);
    if (io::path_exists(io::join_path(dir, "config.json"))) impl->config_path = io::join_path(dir, "config.json");
  } else {
    impl->file_paths = {path};
  }
  if (!impl->config_path.empty()) {
    try {
      impl->config = nlohmann::json::parse(io::read_input_file(impl->config_path, 1u << 20));
    } catch (const std::exception& e) {
      fail("'" + impl->config_path + "' is not valid JSON: " + e.what());
    }
    if (!impl->config.is_object()) fail("'" + impl->config_path + "' is not a JSON object");
  }

  // Every tensor of every file, the names as the files have them.
  std::vector<std::pair<std::string, Source>> raw;
  for (const auto& file_path : impl->file_paths) {
    std::shared_ptr<MappedFile> file;
    try {
      file = std::make_shared<MappedFile>(file_path);
    } catch (const WanWeightsError& e) {
      // A pickle with a .safetensors name, or any other file that is not safetensors.
      fail(std::string(e.what()) + (is_pickle_name(file_path) ? "" : " (Wan weights must be safetensors files)"));
    }
    for (const auto& entry : file->header.entries) raw.push_back({entry.name, Source{file, &entry, entry.name}});
    // A file save_wan_weights wrote carries its config.json in its metadata.
    const auto& meta = file->header.metadata;
    const auto format = meta.find("format"), config = meta.find("config");
    if (impl->config_path.empty() && impl->file_paths.size() == 1 && format != meta.end() &&
        format->second == kWanWeightsFormat && config != meta.end()) {
      impl->config_path = file_path + " (metadata \"config\")";
      try {
        impl->config = nlohmann::json::parse(config->second);
      } catch (const std::exception& e) {
        fail("'" + impl->config_path + "' is not valid JSON: " + e.what());
      }
      if (!impl->config.is_object()) fail("'" + impl->config_path + "' is not a JSON object");
    }
  }
  if (raw.empty()) fail("'" + path + "' holds no tensors");
  // ComfyUI's prefix, on every name or none (the scaled_fp8 marker may go without it).
  const std::string prefix = "model.diffusion_model.";
  const bool prefixed = std::all_of(
      raw.begin(), raw.end(), [&](const auto& r) { return r.first.rfind(prefix, 0) == 0 || r.first == "scaled_fp8"; });
  // fp8 files: the quantization tensors set aside, the parameters kept.
  std::map<std::string, Source> weight_scales;  // by layer (file names, prefix removed)
  std::vector<std::pair<std::string, Source>> parameters;
  for (auto& [name, source] : raw) {
    if (prefixed && name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
    switch (quant_tensor(name)) {
      case QuantTensor::kNone:
        parameters.emplace_back(name, source);
        break;
      case QuantTensor::kWeightScale:
        if (!weight_scales.emplace(layer_of(name), source).second)
          fail("'" + source.file->path + "': layer '" + layer_of(name) + "' has two weight scales (" +
               weight_scales.at(layer_of(name)).file_name + ", " + source.file_name + ")");
        break;
      case QuantTensor::kFormat: {
        // ComfyUI's current format: {"format": "float8_e4m3fn", ...}; other formats (nvfp4, mxfp8, int8)
        // pack their weights in ways not read here.
        const auto& e = *source.entry;
        std::string text;
        if (e.dtype == torch::kUInt8 && e.shape.size() == 1)
          text.assign(static_cast<const char*>(source.file->base) + source.file->header.data_start + e.begin,
                      e.end - e.begin);
        const auto conf = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
        const std::string format = conf.is_object() && conf.contains("format") && conf["format"].is_string()
                                       ? conf["format"].get<std::string>()
                                       : "";
        if (format.empty())
          fail("'" + source.file->path + "': tensor '" + source.file_name +
               "' is not a ComfyUI quantization config (U8 bytes of a JSON object with a \"format\")");
        if (format != "float8_e4m3fn" && format != "float8_e5m2")
          fail("'" + source.file->path + "': layer '" + layer_of(name) + "' is quantized as " + format +
               ": only fp8 weights with per-tensor scales (float8_e4m3fn) are read");
        break;
      }
      case QuantTensor::kMarker:
      case QuantTensor::kInputScale:
        break;
    }
  }
  bool diffusers = false, original = false;
  for (const auto& [name, source] : parameters) {
    diffusers |= name.rfind("condition_embedder.", 0) == 0 || name.find(".attn1.") != std::string::npos;
    original |= name.rfind("time_embedding.", 0) == 0 || name.find(".self_attn.") != std::string::npos;
  }
  if (diffusers == original)
    fail("'" + path + "' does not hold a Wan DiT" +
         std::string(diffusers ? " (it mixes diffusers' and Wan's original tensor names)"
                               : " (no condition_embedder.* or time_embedding.* tensors)"));
  impl->naming = diffusers ? WanNaming::kDiffusers : WanNaming::kOriginal;
  for (auto& [name, source] : parameters) {
    // A scaled fp8 layer: its weight takes the layer's scale.
    if (const auto scale = weight_scales.find(layer_of(name));
        scale != weight_scales.end() && ends_with(name, ".weight")) {
      const Source& s = scale->second;
      if (!megaslide::is_fp8(source.entry->dtype))
        fail("'" + source.file->path + "': tensor '" + source.file_name + "' has a scale (" + s.file_name +
             ") but is " + io::safetensors_dtype_name(source.entry->dtype) + ", not fp8");
      const bool one_value = s.entry->end - s.entry->begin == c10::elementSize(s.entry->dtype);
      if (!c10::isFloatingType(s.entry->dtype) || megaslide::is_fp8(s.entry->dtype) || !one_value)
        fail("'" + s.file->path + "': the scale " + s.file_name + " of '" + source.file_name + "' is " +
             io::safetensors_dtype_name(s.entry->dtype) + " " + shape_text(s.entry->shape) +
             ": only per-tensor scales (one F32, BF16 or F16 value) are read");
      source.scale_file = s.file;
      source.scale = s.entry;
      source.scale_name = s.file_name;
      weight_scales.erase(scale);
    }
    std::string ours = name;
    if (original) {
      ours = wan_diffusers_name(name);
      if (ours.empty()) {
        impl->unknown.push_back(source.file_name);
        continue;
      }
    }
    if (!impl->sources.emplace(ours, source).second)
      fail("'" + path + "': tensor '" + source.file_name + "' appears twice");
  }
  if (!weight_scales.empty()) {
    const Source& s = weight_scales.begin()->second;
    fail("'" + s.file->path + "': tensor '" + s.file_name + "' scales layer '" + weight_scales.begin()->first +
         "', which has no weight");
  }
  return WanWeights(std::move(impl));
}

WanConfig WanWeights::architecture(const WanConfig& fallback) const {
  WanConfig c = fallback;
  const auto& j = impl_->config;
  const std::string& src = impl_->config_path;
  if (!j.is_null()) {
    const bool original_keys = j.contains("dim") || j.contains("num_heads") || j.value("_class_name", "") == "WanModel";
    if (original_keys) {
      const std::string type =
          j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "t2v";
      if (type != "t2v" && type != "i2v" && type != "ti2v")
        fail("'" + src + "': model_type '" + type + "' is not supported (t2v, i2v and ti2v are)");
      c.image_dim = type == "i2v" && has("condition_embedder.image_embedder.norm1.weight")
                        ? shape("condition_embedder.image_embedder.norm1.weight")[0]  // CLIP ViT-H/14's 1280
                        : 0;
      c.dim = json_int(j, "dim", c.dim, src);
      c.heads = json_int(j, "num_heads", c.heads, src);
      c.layers = json_int(j, "num_layers", c.layers, src);
      c.ffn_dim = json_int(j, "ffn_dim", c.ffn_dim, src);
      c.freq_dim = json_int(j, "freq_dim", c.freq_dim, src);
      c.text_dim = json_int(j, "text_dim", 4096, src);
      c.in_channels = json_int(j, "in_dim", c.in_channels, src);
      c.out_channels = json_int(j, "out_dim", c.out_channels, src);
      c.qk_norm = json_bool(j, "qk_norm", true, src);
      c.cross_attn_norm = json_bool(j, "cross_attn_norm", true, src);
      c.eps = json_real(j, "eps", 1e-6, src);
      c.patch = json_patch(j, {1, 2, 2}, src);
    } else {
      // diffusers' WanTransformer3DModel; missing keys take its defaults.
      if (j.contains("pos_embed_seq_len") && !j["pos_embed_seq_len"].is_null())
        fail("'" + src + "': \"pos_embed_seq_len\" is set: first-last-frame Wan models are not supported");
      c.heads = json_int(j, "num_attention_heads", 40, src);
      c.dim = c.heads * json_int(j, "attention_head_dim", 128, src);
      // Wan2.1 I2V: the image branch, whose added key/value projections take the image embedder's D.
      c.image_dim = j.contains("image_dim") && !j["image_dim"].is_null() ? json_int(j, "image_dim", 0, src) : 0;
      const bool added_kv = j.contains("added_kv_proj_dim") && !j["added_kv_proj_dim"].is_null();
      if (added_kv != (c.image_dim > 0) || (added_kv && json_int(j, "added_kv_proj_dim", 0, src) != c.dim))
        fail("'" + src + "': \"added_kv_proj_dim\" must be the model's width (" + std::to_string(c.dim) +
             ") exactly when \"image_dim\" is set (Wan2.1 I2V), got " +
             (added_kv ? j["added_kv_proj_dim"].dump() : std::string("null")) + " with image_dim " +
             std::to_string(c.image_dim));
      c.layers = json_int(j, "num_layers", 40, src);
      c.ffn_dim = json_int(j, "ffn_dim", 13824, src);
      c.freq_dim = json_int(j, "freq_dim", 256, src);
      c.text_dim = json_int(j, "text_dim", 4096, src);
      c.in_channels = json_int(j, "in_channels", 16, src);
      c.out_channels = json_int(j, "out_channels", c.in_channels, src);
      c.cross_attn_norm = json_bool(j, "cross_attn_norm", true, src);
      c.eps = json_real(j, "eps", 1e-6, src);
      c.patch = json_patch(j, {1, 2, 2}, src);
      // "qk_norm": null meant no q/k RMSNorm in diffusers 0.42 (the fixtures' version), while later
      // versions' WanAttention makes the norms whatever it says: with null, the weights decide.
      if (!j.contains("qk_norm")) {
        c.qk_norm = true;
      } else if (j["qk_norm"].is_null()) {
        c.qk_norm = has("blocks.0.attn1.norm_q.weight");
      } else if (j["qk_norm"].is_string() && j["qk_norm"].get<std::string>() == "rms_norm_across_heads") {
        c.qk_norm = true;
      } else {
        fail("'" + src + "': \"qk_norm\" must be \"rms_norm_across_heads\" or null, got " + j["qk_norm"].dump());
      }
    }
    return c;
  }
  // No config.json: the shapes say everything but the number of heads.
  const auto need = [&](const std::string& name) {
    if (!has(name)) fail("'" + path() + "': no config.json and no tensor '" + name + "' to read the model's size from");
    return shape(name);
  };
  const auto pe = need("patch_embedding.weight");
  if (pe.size() != 5) fail("'" + path() + "': patch_embedding.weight is " + shape_text(pe) + ", expected 5 dimensions");
  c.dim = pe[0];
  c.in_channels = pe[1];
  c.patch = {pe[2], pe[3], pe[4]};
  c.ffn_dim = need("blocks.0.ffn.net.0.proj.weight")[0];
  c.freq_dim = need("condition_embedder.time_embedder.linear_1.weight")[1];
  c.text_dim = need("condition_embedder.text_embedder.linear_1.weight")[1];
  c.out_channels = need("proj_out.weight")[0] / std::max<int64_t>(1, pe[2] * pe[3] * pe[4]);
  int64_t layers = 0;
  static const std::regex kBlock(R"(blocks\.([0-9]+)\..*)");
  for (const auto& [name, source] : impl_->sources) {
    std::smatch m;
    if (std::regex_match(name, m, kBlock)) layers = std::max<int64_t>(layers, std::stoll(m[1].str()) + 1);
  }
  c.layers = layers;
  c.qk_norm = has("blocks.0.attn1.norm_q.weight");
  c.cross_attn_norm = has("blocks.0.norm2.weight");
  c.image_dim = has("condition_embedder.image_embedder.norm1.weight")
                    ? shape("condition_embedder.image_embedder.norm1.weight")[0]
                    : 0;
  return c;
}

std::vector<std::string> WanWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, source] : impl_->sources) out.push_back(name);
  return out;
}

bool WanWeights::has(const std::string& name) const { return impl_->sources.count(name) > 0; }

std::vector<int64_t> WanWeights::shape(const std::string& name) const {
  auto it = impl_->sources.find(name);
  if (it == impl_->sources.end()) fail("'" + path() + "': no tensor '" + name + "'");
  return it->second.entry->shape;
}

torch::Tensor WanWeights::read(const std::string& name, torch::ScalarType dtype) const {
  auto it = impl_->sources.find(name);
  if (it == impl_->sources.end()) fail("'" + path() + "': no tensor '" + name + "'");
  const Source& s = it->second;
  const auto& e = *s.entry;
  if (!c10::isFloatingType(e.dtype))
    fail("'" + s.file->path + "': tensor '" + s.file_name + "' is " + io::safetensors_dtype_name(e.dtype) +
         ", expected F32, F16, BF16, F8_E4M3 or F8_E5M2");
  // fp8: dequantized (data x scale), then checked as the asked dtype (a NaN in the data, or an overflowing
  // scale, shows there).
  const bool fp8 = megaslide::is_fp8(e.dtype);
  auto out = fp8 ? dequantize_fp8(mapped_fp8(s), dtype) : mapped(*s.file, e);
  try {
    io::require_finite(out.data_ptr(), out.numel(), out.scalar_type(), s.file->path, s.file_name);
  } catch (const io::NonFiniteWeightsError& err) {
    fail(err.what());
  }
  if (fp8) return out;
  return e.dtype == dtype ? out.clone() : out.to(dtype);
}

bool WanWeights::is_fp8(const std::string& name) const {
  auto it = impl_->sources.find(name);
  if (it == impl_->sources.end()) fail("'" + path() + "': no tensor '" + name + "'");
  return megaslide::is_fp8(it->second.entry->dtype);
}

Fp8Tensor WanWeights::read_fp8(const std::string& name) const {
  auto it = impl_->sources.find(name);
  if (it == impl_->sources.end()) fail("'" + path() + "': no tensor '" + name + "'");
  const Source& s = it->second;
  if (!megaslide::is_fp8(s.entry->dtype))
    fail("'" + s.file->path + "': tensor '" + s.file_name + "' is " + io::safetensors_dtype_name(s.entry->dtype) +
         ", not fp8 (read() converts it)");
  Fp8Tensor t = mapped_fp8(s);
  if (!io::nonfinite_weights_allowed()) {
    const int64_t at = first_nonfinite_fp8(t.data);
    if (at >= 0 || !std::isfinite(t.scale.item<float>()))
      fail("'" + s.file->path + "': tensor '" + (at >= 0 ? s.file_name : s.scale_name) +
           "' holds a NaN or an infinity" +
           (at >= 0 ? " (element " + std::to_string(at) + " of " + std::to_string(t.data.numel()) + ")" : "") +
           ": the weights are broken (a diverged run or a bad conversion); --allow-nonfinite-weights loads them "
           "anyway");
  }
  t.data = t.data.clone();
  return t;
}

std::vector<std::string> WanWeights::check(const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected,
                                           const std::vector<std::string>& allow_missing) const {
  std::vector<std::string> missing, kept, wrong_shape, wrong_dtype, unexpected;
  std::set<std::string> wanted;
  const auto file_name = [&](const std::string& ours) {
    if (naming() == WanNaming::kDiffusers) return ours;
    const std::string o = wan_original_name(ours);
    return o.empty() ? ours : o + " (" + ours + ")";
  };
  for (const auto& [name, shape_] : expected) {
    wanted.insert(name);
    auto it = impl_->sources.find(name);
    if (it == impl_->sources.end()) {
      const bool allowed =
          std::any_of(allow_missing.begin(), allow_missing.end(), [&](const auto& g) { return name_matches(g, name); });
      (allowed ? kept : missing).push_back(name);
      continue;
    }
    if (it->second.entry->shape != shape_)
      wrong_shape.push_back(fmt::format("{} is {}, the model needs {}", it->second.file_name,
                                        shape_text(it->second.entry->shape), shape_text(shape_)));
    if (!c10::isFloatingType(it->second.entry->dtype))
      wrong_dtype.push_back(it->second.file_name + " is " + io::safetensors_dtype_name(it->second.entry->dtype));
  }
  for (const auto& [name, source] : impl_->sources)
    if (!wanted.count(name)) unexpected.push_back(source.file_name);
  for (const auto& name : impl_->unknown) unexpected.push_back(name);
  if (missing.empty() && wrong_shape.empty() && wrong_dtype.empty() && unexpected.empty()) return kept;
  std::string message = fmt::format("Wan weights '{}' ({} names) do not match the model ({} parameters):", path(),
                                    to_string(naming()), expected.size());
  const auto list = [&](const char* what, const std::vector<std::string>& items,
                        const std::function<std::string(const std::string&)>& show) {
    if (items.empty()) return;
    message += fmt::format(" {} {}:", items.size(), what);
    for (size_t i = 0; i < items.size() && i < 8; ++i) message += (i ? ", " : " ") + show(items[i]);
    if (items.size() > 8) message += fmt::format(", ... ({} more)", items.size() - 8);
    message += ";";
  };
  const auto same = [](const std::string& s) { return s; };
  list("missing", missing, file_name);
  list("of the wrong shape", wrong_shape, same);
  list("not floating point", wrong_dtype, same);
  list("not in the model", unexpected, same);
  const bool image = std::any_of(unexpected.begin(), unexpected.end(), [](const std::string& n) {
    return n.find("img_emb") != std::string::npos || n.find("k_img") != std::string::npos ||
           n.find("image_embedder") != std::string::npos || n.find("add_k_proj") != std::string::npos;
  });
  if (image)
    message +=
        " these are image-to-video weights (Wan2.1 I2V's image branch) but the config describes a DiT without "
        "one (model.wan.image_dim 0);";
  else if (!wrong_shape.empty() || !missing.empty())
    message += " does the config (model.wan, or the weights' config.json) describe these weights?";
  message.pop_back();
  fail(message);
}

std::vector<std::string> load_wan_weights(const WanWeights& weights, WanTransformerImpl& model,
                                          const std::vector<std::string>& allow_missing) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  auto params = model.named_parameters(true);
  for (const auto& p : params) expected.emplace_back(p.key(), p.value().sizes().vec());
  auto kept = weights.check(expected, allow_missing);
  torch::NoGradGuard no_grad;
  for (auto& p : params) {
    if (!weights.has(p.key())) continue;
    p.value().copy_(weights.read(p.key(), p.value().scalar_type()));
  }
  return kept;
}

std::string wan_diffusers_config(const WanConfig& w) {
  nlohmann::ordered_json j;
  j["_class_name"] = "WanTransformer3DModel";
  j["patch_size"] = {w.patch[0], w.patch[1], w.patch[2]};
  j["num_attention_heads"] = w.heads;
  j["attention_head_dim"] = w.dim / w.heads;
  j["in_channels"] = w.in_channels;
  j["out_channels"] = w.out_channels;
  j["text_dim"] = w.text_dim;
  j["freq_dim"] = w.freq_dim;
  j["ffn_dim"] = w.ffn_dim;
  j["num_layers"] = w.layers;
  j["cross_attn_norm"] = w.cross_attn_norm;
  j["qk_norm"] = w.qk_norm ? nlohmann::ordered_json("rms_norm_across_heads") : nlohmann::ordered_json(nullptr);
  j["eps"] = w.eps;
  j["image_dim"] = w.image_dim > 0 ? nlohmann::ordered_json(w.image_dim) : nlohmann::ordered_json(nullptr);
  j["added_kv_proj_dim"] = w.image_dim > 0 ? nlohmann::ordered_json(w.dim) : nlohmann::ordered_json(nullptr);
  j["rope_max_seq_len"] = 1024;
  return j.dump(2) + "\n";
}

namespace {
// save_wan_weights' files, finished into `files` (published by the caller).
io::WrittenFile write_wan_weights(const std::string& path, const WanConfig& wan, const io::NamedTensors& parameters,
                                  torch::ScalarType dtype, io::FileGroup& files) {
  io::WrittenFile written;
  if (wan.expert == "both") {
    const std::vector<std::string> folders{"transformer", "transformer_2"};
    std::vector<io::NamedTensors> experts(2);
    for (const auto& [name, tensor] : parameters) {
      const auto dot = name.find('.');
      const auto it = std::find(folders.begin(), folders.end(), name.substr(0, dot));
      if (dot == std::string::npos || it == folders.end())
        throw io::IoError("'" + path + "': tensor '" + name +
                          "' is not named transformer.* or transformer_2.* (one of Wan2.2's two experts)");
      experts[static_cast<size_t>(it - folders.begin())].emplace_back(name.substr(dot + 1), tensor);
    }
    WanConfig one = wan;
    one.expert.clear();
    for (size_t e = 0; e < 2; ++e) {
      const std::string folder = io::join_path(path, folders[e]);
      io::make_directories(folder);
      written = write_wan_weights(io::join_path(folder, "diffusion_pytorch_model.safetensors"), one, experts[e], dtype,
                                  files);
    }
    // The pipeline's every component, as diffusers' Wan2.2 repositories list them: WanPipeline.from_pretrained
    // loads the folder once the base repository's vae/, text_encoder/, tokenizer/ and scheduler/ are beside.
    const bool image_to_video = wan_image_to_video(wan);
    nlohmann::ordered_json index;
    index["_class_name"] = image_to_video ? "WanImageToVideoPipeline" : "WanPipeline";
    index["boundary_ratio"] = wan.boundary_ratio;
    if (image_to_video) {  // Wan2.2 I2V-A14B has no image encoder; an image branch takes CLIP's
      const bool clip = wan.image_dim > 0;
      index["image_encoder"] =
          clip ? nlohmann::ordered_json{"transformers", "CLIPVisionModel"} : nlohmann::ordered_json{nullptr, nullptr};
      index["image_processor"] = clip ? nlohmann::ordered_json{"transformers", "CLIPImageProcessor"}
                                      : nlohmann::ordered_json{nullptr, nullptr};
    }
    index["scheduler"] = {"diffusers", "UniPCMultistepScheduler"};
    index["text_encoder"] = {"transformers", "UMT5EncoderModel"};
    index["tokenizer"] = {"transformers", "T5TokenizerFast"};
    index["transformer"] = {"diffusers", "WanTransformer3DModel"};
    index["transformer_2"] = {"diffusers", "WanTransformer3DModel"};
    index["vae"] = {"diffusers", "AutoencoderKLWan"};
    io::write_file_atomically(io::join_path(path, "model_index.json"), index.dump(2) + "\n", &files);
    return written;
  }
  const std::string config = wan_diffusers_config(wan);
  const std::string name = "diffusion_pytorch_model.safetensors";
  const bool diffusers_folder =
      path == name || (path.size() > name.size() && path.compare(path.size() - name.size(), name.size(), name) == 0 &&
                       path[path.size() - name.size() - 1] == '/');
  // The tensors are cast one at a time as they are written (write_safetensors): one tensor's copy at most.
  // diffusers' folder: config.json replaced with the weights, so that the folder's two files describe one model.
  if (diffusers_folder) io::write_file_atomically(io::join_path(io::parent_path(path), "config.json"), config, &files);
  return io::write_safetensors(path, parameters, {{"format", kWanWeightsFormat}, {"config", config}}, dtype, &files);
}
}  // namespace

io::WrittenFile save_wan_weights(const std::string& path, const WanConfig& wan, const io::NamedTensors& parameters,
                                 torch::ScalarType dtype, io::FileGroup* group) {
  if (group != nullptr) return write_wan_weights(path, wan, parameters, dtype, *group);
  // Every file of the export is replaced together, once all are written (a full disk half-way leaves the old ones).
  io::FileGroup files;
  const auto written = write_wan_weights(path, wan, parameters, dtype, files);
  files.publish();
  return written;
}

// --- ComfyUI's single file (megaslide-train --export-layout comfyui) --------------------------------------

namespace {

// True when `name` (diffusers') is a parameter of Wan's published DiT: a row of the rename table followed
// by weight or bias alone, or a modulation table; not the 3D-DSA retrofit's rows, which the table carries
// for reading our own files back.
bool is_published_wan_parameter(const std::string& name) {
  for (const auto& glob : wan_dsa_parameter_globs())
    if (name_matches(glob, name)) return false;
  static const std::regex kBlock(R"(blocks\.[0-9]+\.(.*))");
  std::smatch m;
  const bool in_block = std::regex_match(name, m, kBlock);
  const std::string rest = in_block ? m[1].str() : name;
  if (rest == "scale_shift_table") return true;
  for (const auto& [diffusers, original] : in_block ? block_names() : top_level_names())
    if (rest == diffusers + "weight" || rest == diffusers + "bias") return true;
  return false;
}

}  // namespace

const char* to_string(WanWeightsLayout layout) {
  switch (layout) {
    case WanWeightsLayout::kDiffusers:
      return "diffusers";
    case WanWeightsLayout::kComfyUI:
      return "comfyui";
    case WanWeightsLayout::kComfyUIUnprefixed:
      return "comfyui-unprefixed";
  }
  return "?";
}

std::vector<std::string> wan_comfyui_files(const std::string& path, const WanConfig& wan) {
  if (wan.expert != "both") return {path};
  const std::string extension = ".safetensors";
  const std::string stem = ends_with(path, extension) ? path.substr(0, path.size() - extension.size()) : path;
  return {stem + "_high_noise" + extension, stem + "_low_noise" + extension};
}

std::vector<std::string> save_wan_comfyui_weights(const std::string& path, const WanConfig& wan,
                                                  const io::NamedTensors& parameters, bool diffusion_model_prefix,
                                                  torch::ScalarType dtype) {
  const auto files = wan_comfyui_files(path, wan);
  // Each file's tensors under their diffusers names: the experts split by their prefixes.
  std::vector<io::NamedTensors> experts(files.size());
  if (wan.expert == "both") {
    const std::vector<std::string> prefixes{"transformer.", "transformer_2."};
    for (const auto& [name, tensor] : parameters) {
      size_t e = 0;
      while (e < prefixes.size() && name.rfind(prefixes[e], 0) != 0) ++e;
      if (e == prefixes.size())
        throw io::IoError("'" + path + "': tensor '" + name +
                          "' is not named transformer.* or transformer_2.* (one of Wan2.2's two experts)");
      experts[e].emplace_back(name.substr(prefixes[e].size()), tensor);
    }
  } else {
    experts[0] = parameters;
  }
  // Refused before anything is written: what ComfyUI's Wan has no place for.
  std::vector<std::string> foreign;
  for (const auto& [name, tensor] : parameters) {
    const std::string own = wan.expert == "both" ? name.substr(name.find('.') + 1) : name;
    if (!is_published_wan_parameter(own)) foreign.push_back(name);
  }
  if (!foreign.empty()) {
    std::string listed;
    for (size_t i = 0; i < foreign.size() && i < 8; ++i) listed += (i ? ", " : "") + foreign[i];
    if (foreign.size() > 8) listed += fmt::format(", ... ({} more)", foreign.size() - 8);
    const bool dsa = std::any_of(foreign.begin(), foreign.end(), [](const std::string& n) {
      return n.find(".attn1.offset_") != std::string::npos || n.find(".attn1.rel_bias") != std::string::npos;
    });
    fail(fmt::format(
        "'{}': cannot write ComfyUI's layout: {} parameters are not in Wan's published DiT, so ComfyUI could not "
        "load them: {}{}; write diffusers' layout instead (megaslide-train --export-layout diffusers)",
        path, foreign.size(), listed,
        dsa ? " (the 3D-DSA retrofit's offset networks, model.self_attention dsa3d)" : ""));
  }
  const std::string prefix = diffusion_model_prefix ? "model.diffusion_model." : "";
  WanConfig one = wan;
  one.expert.clear();
  const std::string config = wan_diffusers_config(one);
  std::vector<std::string> written;
  io::FileGroup group;  // both experts replaced together, once both are written
  for (size_t e = 0; e < files.size(); ++e) {
    io::NamedTensors renamed;
    renamed.reserve(experts[e].size());
    for (const auto& [name, tensor] : experts[e]) renamed.emplace_back(prefix + wan_original_name(name), tensor);
    std::map<std::string, std::string> metadata{{"format", kWanWeightsFormat}, {"config", config}};
    if (wan.expert == "both") {
      metadata["expert"] = e == 0 ? "high_noise" : "low_noise";
      metadata["boundary_ratio"] = fmt::format("{}", wan.boundary_ratio);
    } else if (!wan.expert.empty()) {
      metadata["expert"] = wan.expert == "low" ? "low_noise" : "high_noise";
      if (wan.boundary_ratio > 0) metadata["boundary_ratio"] = fmt::format("{}", wan.boundary_ratio);
    }
    // Cast one tensor at a time as it is written (write_safetensors): one tensor's copy at most.
    io::write_safetensors(files[e], renamed, metadata, dtype, &group);
    written.push_back(files[e]);
  }
  group.publish();
  return written;
}

std::vector<std::string> wan_comfyui_differences(const WanConfig& w) {
  std::vector<std::string> out;
  if (w.dim % 128 != 0 || w.dim / 128 != w.heads)
    out.push_back(fmt::format("heads: ComfyUI takes dim / 128 = {} heads of 128, the model has {} of {}", w.dim / 128,
                              w.heads, w.heads > 0 ? w.dim / w.heads : 0));
  if (w.patch != std::array<int64_t, 3>{1, 2, 2})
    out.push_back(
        fmt::format("patch: ComfyUI takes [1, 2, 2], the model has [{}, {}, {}]", w.patch[0], w.patch[1], w.patch[2]));
  if (w.freq_dim != 256) out.push_back(fmt::format("freq_dim: ComfyUI takes 256, the model has {}", w.freq_dim));
  if (w.text_dim != 4096)
    out.push_back(fmt::format("text_dim: ComfyUI takes 4096 (umT5-XXL), the model has {}", w.text_dim));
  if (!w.qk_norm) out.push_back("qk_norm: ComfyUI builds the q/k RMSNorm, which the model does not have");
  if (!w.cross_attn_norm)
    out.push_back("cross_attn_norm: ComfyUI builds the cross-attention LayerNorm, which the model does not have");
  if (w.eps != 1e-6) out.push_back(fmt::format("eps: ComfyUI takes 1e-06, the model has {}", w.eps));
  if (w.image_dim > 0 && w.image_dim != 1280)
    out.push_back(
        fmt::format("image_dim: ComfyUI takes 1280 (CLIP ViT-H/14's image tokens), the model has {}", w.image_dim));
  return out;
}

std::vector<std::string> wan_dsa_parameter_globs() {
  return {"blocks.*.attn1.offset_dw.*", "blocks.*.attn1.offset_pw.*", "blocks.*.attn1.rel_bias"};
}

WanExperts find_wan_experts(const std::string& path) {
  WanExperts out;
  out.high = path;
  if (path.empty() || !io::is_directory(path)) return out;
  const std::string index = io::join_path(path, "model_index.json");
  if (io::path_exists(index)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(io::read_input_file(index, 1u << 20));
    } catch (const std::exception& e) {
      fail("'" + index + "' is not valid JSON: " + e.what());
    }
    const auto second = j.find("transformer_2");
    if (j.is_object() && second != j.end() && second->is_array() && !second->empty() && !(*second)[0].is_null()) {
      out.high = io::join_path(path, "transformer");
      out.low = io::join_path(path, "transformer_2");
      const auto ratio = j.find("boundary_ratio");
      if (ratio == j.end() || !ratio->is_number() || ratio->get<double>() <= 0 || ratio->get<double>() >= 1)
        fail("'" + index + "' lists transformer_2 but no boundary_ratio in (0, 1): which expert runs when is unknown");
      out.boundary_ratio = ratio->get<double>();
    }
  } else if (io::is_directory(io::join_path(path, "high_noise_model")) &&
             io::is_directory(io::join_path(path, "low_noise_model"))) {
    out.high = io::join_path(path, "high_noise_model");
    out.low = io::join_path(path, "low_noise_model");
  }
  return out;
}

const std::string& wan_trained_weights(const WanConfig& wan) {
  return wan.expert == "low" && !wan.weights_2.empty() ? wan.weights_2 : wan.weights;
}

std::string wan_untrained_expert(const WanConfig& wan) {
  if (wan.expert.empty() || wan.expert == "both" || wan.weights_2.empty()) return "";
  return wan.expert == "low" ? wan.weights : wan.weights_2;
}

double default_wan_boundary_ratio(const WanConfig& wan) { return wan.in_channels == 36 ? 0.9 : 0.875; }

RunConfig with_wan_architecture_from_weights(const RunConfig& config) {
  if (config.model.arch != Architecture::kWan) return config;
  if (config.model.wan.weights.empty()) {  // a randomly initialised expert (a plan, a test): Wan-AI's boundary
    RunConfig c = config;
    if (!c.model.wan.expert.empty() && c.model.wan.boundary_ratio == 0)
      c.model.wan.boundary_ratio = default_wan_boundary_ratio(c.model.wan);
    return c;
  }
  RunConfig c = config;
  const auto& asked = config.model.wan;
  c.model.wan = WanWeights::open(asked.weights).architecture(asked);
  c.model.wan.weights = asked.weights;
  c.model.wan.weights_2 = asked.weights_2;
  c.model.wan.boundary_ratio = asked.boundary_ratio;
  c.model.wan.expert = asked.expert;
  // Wan2.2's two experts: the low-noise one found in the repository unless named, the boundary from the
  // repository (or Wan-AI's for the task) unless given.
  const WanExperts experts = find_wan_experts(asked.weights);
  if (c.model.wan.weights_2.empty()) c.model.wan.weights_2 = experts.low;
  if (!c.model.wan.weights_2.empty()) {
    const std::string source = "model.wan.weights_2 '" + c.model.wan.weights_2 + "'";
    WanConfig low;
    try {
      low = WanWeights::open(c.model.wan.weights_2).architecture(asked);
    } catch (const WanWeightsError& e) {
      throw ConfigError(source, "model.wan.weights_2", e.what());
    }
    low.weights = c.model.wan.weights;
    low.weights_2 = c.model.wan.weights_2;
    low.boundary_ratio = c.model.wan.boundary_ratio;
    low.expert = c.model.wan.expert;
    const RunConfig high_config = c;
    RunConfig low_config = c;
    low_config.model.wan = low;
    if (const auto keys = differing_keys(high_config, low_config); !keys.empty())
      throw ConfigError(source, "model.wan.weights_2",
                        "the low-noise expert is not the high-noise expert's architecture ('" + asked.weights +
                            "'): " + keys.front() + " is " + config_value_text(low_config, keys.front()) + ", not " +
                            config_value_text(high_config, keys.front()));
    if (c.model.wan.boundary_ratio == 0)
      c.model.wan.boundary_ratio =
          experts.boundary_ratio > 0 ? experts.boundary_ratio : default_wan_boundary_ratio(c.model.wan);
  } else if (!c.model.wan.expert.empty()) {
    // One expert's own file (ComfyUI's): its timesteps from the boundary given, or Wan-AI's for the task.
    if (c.model.wan.boundary_ratio == 0) c.model.wan.boundary_ratio = default_wan_boundary_ratio(c.model.wan);
  } else if (c.model.wan.boundary_ratio != 0) {
    throw ConfigError("model.wan.weights '" + asked.weights + "'", "model.wan.boundary_ratio",
                      "switches between two experts, but the weights are one DiT (name the low-noise expert in "
                      "model.wan.weights_2, or a two-expert repository in model.wan.weights; or set model.wan.expert "
                      "to fine-tune this expert on its timesteps)");
  }
  if (c.model.wan.weights_2.empty() && c.diffusion.guidance_scale_2 != -1.0 && c.model.wan.expert.empty())
    throw ConfigError("model.wan.weights '" + asked.weights + "'", "diffusion.guidance_scale_2",
                      "is the low-noise expert's guidance scale, but the weights are one DiT");
  c = with_wan_repository_encoders(c);
  validate(c, "model.wan.weights '" + config.model.wan.weights + "'", /*wan_sizes_resolved=*/true);
  return c;
}

}  // namespace megaslide
