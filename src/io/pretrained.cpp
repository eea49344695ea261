#include "io/pretrained.h"
#include "megaslide/io/finite_weights.h"
#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

namespace megaslide::io {

namespace {
std::string shape_string(c10::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
}  // namespace

PretrainedFolder::PretrainedFolder(const std::string& dir, const std::vector<std::string>& weight_files) : dir_(dir) {
  if (!is_directory(dir))
    throw PretrainedError("'" + dir + "' is not a folder (expected a model folder with config.json and weights)");
  const auto config_path = join_path(dir, "config.json");
  if (!path_exists(config_path)) fail("no config.json");
  try {
    config_ = std::make_unique<nlohmann::json>(nlohmann::json::parse(read_file(config_path)));
  } catch (const nlohmann::json::exception& e) {
    throw PretrainedError("'" + config_path + "' is not valid JSON: " + e.what());
  }
  if (!config_->is_object()) throw PretrainedError("'" + config_path + "' is not a JSON object");
  for (const auto& name : weight_files) {
    const auto path = join_path(dir, name);
    if (path_exists(path)) {
      weights_path_ = path;
      break;
    }
  }
  if (weights_path_.empty()) {
    std::string list;
    for (const auto& name : weight_files) list += (list.empty() ? "" : " or ") + name;
    fail("no weights file (expected " + list + ")");
  }
  try {
    header_ = read_safetensors_header(weights_path_);
  } catch (const SafetensorsError& e) {
    throw PretrainedError(e.what());
  }
}

PretrainedFolder::~PretrainedFolder() = default;

const nlohmann::json& PretrainedFolder::config() const { return *config_; }

void PretrainedFolder::fail(const std::string& what) const {
  throw PretrainedError("model folder '" + dir_ + "': " + what);
}

std::string fp8_scale_name(const std::string& name, const std::function<bool(const std::string&)>& has) {
  const std::string weight = ".weight";
  if (name.size() <= weight.size() || name.compare(name.size() - weight.size(), weight.size(), weight) != 0) return "";
  const std::string layer = name.substr(0, name.size() - weight.size());
  for (const char* suffix : {".scale_weight", ".weight_scale"})
    if (has(layer + suffix)) return layer + suffix;
  return "";
}

bool PretrainedFolder::has(const std::string& name) const {
  for (const auto& e : header_.entries)
    if (e.name == name) return true;
  return false;
}

std::vector<std::string> PretrainedFolder::names() const {
  std::vector<std::string> out;
  for (const auto& e : header_.entries) out.push_back(e.name);
  return out;
}

torch::Tensor PretrainedFolder::take(const std::string& name, const std::vector<int64_t>& shape,
                                     torch::ScalarType dtype) const {
  const SafetensorsEntry* entry = nullptr;
  for (const auto& e : header_.entries)
    if (e.name == name) entry = &e;
  if (entry == nullptr)
    throw PretrainedError("'" + weights_path_ + "': no tensor '" + name + "' (expected shape " + shape_string(shape) +
                          ")");
  if (entry->shape != shape)
    throw PretrainedError("'" + weights_path_ + "': tensor '" + name + "' has shape " + shape_string(entry->shape) +
                          ", expected " + shape_string(shape) + " (from config.json)");
  if (!c10::isFloatingType(entry->dtype))
    throw PretrainedError("'" + weights_path_ + "': tensor '" + name + "' is " + safetensors_dtype_name(entry->dtype) +
                          ", expected floating point (F32, F16 or BF16)");
  auto t = torch::empty(entry->shape, torch::TensorOptions().dtype(entry->dtype));
  uint64_t bytes = entry->end - entry->begin, offset = header_.data_start + entry->begin;
  int fd = -1;
  try {
    fd = io::open_input_file(weights_path_);
  } catch (const io::IoError& e) {
    throw PretrainedError(e.what());
  }
  auto* p = static_cast<char*>(t.data_ptr());
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, std::min<uint64_t>(bytes, 1ull << 30), static_cast<off_t>(offset));
    if (n <= 0) {
      ::close(fd);
      throw PretrainedError("'" + weights_path_ + "': cannot read tensor '" + name + "'" +
                            (n < 0 ? std::string(": ") + std::strerror(errno) : ""));
    }
    p += n, bytes -= static_cast<uint64_t>(n), offset += static_cast<uint64_t>(n);
  }
  ::close(fd);
  try {
    io::require_finite(t.data_ptr(), t.numel(), t.scalar_type(), weights_path_, name);
  } catch (const io::NonFiniteWeightsError& e) {
    throw PretrainedError(e.what());
  }
  if (!megaslide::is_fp8(t.scalar_type())) return t.to(dtype);
  const auto scale = fp8_scale_name(name, [this](const std::string& n) { return has(n); });
  if (scale.empty()) return dequantize_fp8({t, {}}, dtype);
  std::vector<int64_t> scale_shape;
  for (const auto& e : header_.entries)
    if (e.name == scale) scale_shape = e.shape;
  const auto s = take(scale, scale_shape);
  if (s.numel() != 1 || megaslide::is_fp8(s.scalar_type()))
    throw PretrainedError("'" + weights_path_ + "': the scale '" + scale + "' of '" + name +
                          "' is not one value: only per-tensor fp8 scales are read");
  return dequantize_fp8({t, s}, dtype);
}

torch::Tensor PretrainedFolder::take_any(const std::vector<std::string>& names, const std::vector<int64_t>& shape,
                                         torch::ScalarType dtype) const {
  for (const auto& n : names)
    if (has(n)) return take(n, shape, dtype);
  return take(names.front(), shape, dtype);
}

// --- MappedWeights ------------------------------------------------------------------------------------

struct MappedWeights::Mapping {
  std::string path;
  SafetensorsHeader header;
  void* base = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (base == nullptr) return;
    forget_mapping(base);
    ::munmap(base, bytes);
  }
};

namespace {
std::string parent_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}
}  // namespace

MappedWeights::MappedWeights(const std::string& path) : path_(path) {
  if (!path_exists(path) || is_directory(path)) throw PretrainedError("'" + path + "': no such weights file");
  auto open_file = [&](const std::string& file) {
    auto m = std::make_shared<Mapping>();
    m->path = file;
    try {
      m->header = read_safetensors_header(file);
    } catch (const SafetensorsError& e) {
      throw PretrainedError(e.what());
    }
    int fd = -1;
    try {
      fd = io::open_input_file(file);
    } catch (const io::IoError& e) {
      throw PretrainedError(e.what());
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throw PretrainedError("'" + file + "': cannot stat: " + std::strerror(errno));
    }
    m->bytes = static_cast<size_t>(st.st_size);
    if (m->bytes > 0) {
      m->base = ::mmap(nullptr, m->bytes, PROT_READ, MAP_PRIVATE, fd, 0);
      if (m->base == MAP_FAILED) {
        m->base = nullptr;
        ::close(fd);
        throw PretrainedError("'" + file + "': cannot map: " + std::strerror(errno));
      }
      register_mapping(m->base, m->bytes, file);
    }
    ::close(fd);
    files_.push_back(std::move(m));
    return files_.size() - 1;
  };
  const bool index = path.size() >= 11 && path.compare(path.size() - 11, 11, ".index.json") == 0;
  if (!index) {
    const size_t f = open_file(path);
    for (const auto& e : files_[f]->header.entries) where_[e.name] = Location{f, &e};
    return;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw PretrainedError("'" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
    throw PretrainedError("'" + path +
                          "': expected an object with a \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, size_t> shard_index;
  for (const auto& [name, file] : j.at("weight_map").items()) {
    if (!file.is_string())
      throw PretrainedError("'" + path + "': weight_map[\"" + name + "\"] must be a file name, got " + file.dump());
    const auto fname = file.get<std::string>();
    if (fname.empty() || fname.find('/') != std::string::npos)
      throw PretrainedError("'" + path + "': weight_map[\"" + name + "\"] = \"" + fname +
                            "\" is not a file name beside the index");
    if (!shard_index.count(fname)) {
      const auto shard = join_path(parent_of(path), fname);
      if (!path_exists(shard))
        throw PretrainedError("'" + path + "': shard '" + shard + "' (of tensor '" + name + "') is missing");
      shard_index[fname] = open_file(shard);
    }
  }
  for (const auto& [fname, f] : shard_index)
    for (const auto& e : files_[f]->header.entries) {
      if (where_.count(e.name))
        throw PretrainedError("'" + path + "': tensor '" + e.name + "' is in both '" +
                              files_[where_[e.name].file]->path + "' and '" + files_[f]->path + "'");
      where_[e.name] = Location{f, &e};
    }
  for (const auto& [name, file] : j.at("weight_map").items()) {
    auto it = where_.find(name);
    if (it == where_.end() || files_[it->second.file]->path != join_path(parent_of(path), file.get<std::string>()))
      throw PretrainedError("'" + path + "': tensor '" + name + "' is not in the shard the index names ('" +
                            file.get<std::string>() + "')");
  }
}

MappedWeights::~MappedWeights() = default;

bool MappedWeights::has(const std::string& name) const { return where_.count(name) > 0; }

std::vector<std::string> MappedWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, loc] : where_) out.push_back(name);
  return out;
}

const MappedWeights::Location& MappedWeights::locate(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw PretrainedError("'" + path_ + "': no tensor '" + name + "'");
  return it->second;
}

const std::string& MappedWeights::file_of(const std::string& name) const { return files_[locate(name).file]->path; }

const std::vector<int64_t>& MappedWeights::shape(const std::string& name) const { return locate(name).entry->shape; }

const SafetensorsEntry& MappedWeights::checked_entry(const std::string& name, const std::vector<int64_t>& shape,
                                                     const std::string& context) const {
  auto it = where_.find(name);
  if (it == where_.end())
    throw PretrainedError("'" + path_ + "': no tensor '" + name + "' (expected shape " + shape_string(shape) + ")");
  const auto& m = *files_[it->second.file];
  const auto& e = *it->second.entry;
  if (e.shape != shape)
    throw PretrainedError("'" + m.path + "': tensor '" + name + "' has shape " + shape_string(e.shape) + ", expected " +
                          shape_string(shape) + " (" + context + ")");
  if (!c10::isFloatingType(e.dtype))
    throw PretrainedError("'" + m.path + "': tensor '" + name + "' is " + safetensors_dtype_name(e.dtype) +
                          ", expected floating point (F32, F16 or BF16)");
  return e;
}

char* MappedWeights::checked_data(const std::string& name) const {
  const auto& loc = locate(name);
  const auto& m = *files_[loc.file];
  const auto& e = *loc.entry;
  const size_t offset = m.header.data_start + e.begin;
  if (offset + (e.end - e.begin) > m.bytes)
    throw PretrainedError("'" + m.path + "': tensor '" + name + "' lies past the end of the file");
  auto* data = static_cast<char*>(m.base) + offset;
  try {
    const int64_t n = static_cast<int64_t>((e.end - e.begin) / c10::elementSize(e.dtype));
    if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(e.dtype) == 0)
      io::require_finite(data, n, e.dtype, m.path, name);
    else
      io::require_finite(
          torch::from_blob(data, {static_cast<int64_t>(e.end - e.begin)}, torch::kUInt8).clone().data_ptr(), n, e.dtype,
          m.path, name);
  } catch (const io::NonFiniteWeightsError& err) {
    throw NonFiniteTensorError(err.what(), err.element, err.count);
  }
  return data;
}

torch::Tensor MappedWeights::take(const std::string& name, const std::vector<int64_t>& shape, torch::ScalarType dtype,
                                  const std::string& context) const {
  const auto& e = checked_entry(name, shape, context);
  // An fp8 tensor asked for in another dtype: its value, data × its scale (take_fp8 reads and checks the data).
  if (megaslide::is_fp8(e.dtype) && dtype != e.dtype) return dequantize_fp8(take_fp8(name, shape, context), dtype);
  char* data = checked_data(name);
  const auto options = torch::TensorOptions().dtype(e.dtype);
  // A copy in any case: the result must not keep pointing into the mapping. Safetensors aligns data to its
  // element size only by convention: an unaligned tensor is copied through an aligned buffer.
  if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(e.dtype) == 0)
    return torch::from_blob(data, e.shape, options).to(dtype, /*non_blocking=*/false, /*copy=*/true);
  auto aligned = torch::empty(e.shape, options);
  std::memcpy(aligned.data_ptr(), data, e.end - e.begin);
  return aligned.to(dtype);
}

torch::Tensor MappedWeights::view(const std::string& name, const std::vector<int64_t>& shape,
                                  const std::string& context) const {
  const auto& e = checked_entry(name, shape, context);
  const auto& m = files_[locate(name).file];
  const auto* start = static_cast<const char*>(m->base) + m->header.data_start + e.begin;
  if (megaslide::is_fp8(e.dtype))
    throw PretrainedError("'" + m->path + "': tensor '" + name + "' is " + c10::toString(e.dtype) +
                          ", whose value needs its scale: read it with take (the value) or take_fp8, not view");
  if (reinterpret_cast<uintptr_t>(start) % c10::elementSize(e.dtype) != 0)
    return take(name, shape, e.dtype, context);  // a copy
  char* data = checked_data(name);
  std::shared_ptr<Mapping> keep = m;
  return torch::from_blob(
      data, e.shape, [keep](void*) mutable { keep.reset(); }, torch::TensorOptions().dtype(e.dtype));
}

torch::ScalarType MappedWeights::stored_dtype(const std::string& name) const { return locate(name).entry->dtype; }

bool MappedWeights::is_fp8(const std::string& name) const { return megaslide::is_fp8(locate(name).entry->dtype); }

Fp8Tensor MappedWeights::take_fp8(const std::string& name, const std::vector<int64_t>& shape,
                                  const std::string& context) const {
  const auto& loc = locate(name);
  if (!megaslide::is_fp8(loc.entry->dtype))
    throw PretrainedError("'" + files_[loc.file]->path + "': tensor '" + name + "' is " +
                          safetensors_dtype_name(loc.entry->dtype) + ", not fp8");
  Fp8Tensor out;
  out.data = take(name, shape, loc.entry->dtype, context);  // its bytes as they are
  const auto scale = fp8_scale_name(name, [this](const std::string& n) { return has(n); });
  if (scale.empty()) {
    out.scale = torch::ones({}, torch::kFloat32);
    return out;
  }
  const auto& s = locate(scale);
  if (megaslide::is_fp8(s.entry->dtype) || c10::multiply_integers(s.entry->shape) != 1)
    throw PretrainedError("'" + files_[s.file]->path + "': the scale '" + scale + "' of '" + name + "' is " +
                          safetensors_dtype_name(s.entry->dtype) + " " + shape_string(s.entry->shape) +
                          ": only per-tensor fp8 scales (one F32, BF16 or F16 value) are read");
  out.scale = take(scale, s.entry->shape, torch::kFloat32, context).reshape({});
  return out;
}

std::string MappedWeights::bytes(const std::string& name) const {
  const auto& loc = locate(name);
  const auto& m = *files_[loc.file];
  if (loc.entry->dtype != torch::kUInt8)
    throw PretrainedError("'" + m.path + "': tensor '" + name + "' is " + safetensors_dtype_name(loc.entry->dtype) +
                          ", expected U8 bytes");
  const auto* data = static_cast<const char*>(m.base) + m.header.data_start + loc.entry->begin;
  return std::string(data, loc.entry->end - loc.entry->begin);
}

namespace {
[[noreturn]] void bad_key(const std::string& source, const std::string& key, const std::string& expected,
                          const nlohmann::json& v) {
  throw PretrainedError("'" + source + "': \"" + key + "\" must be " + expected + ", got " + v.dump());
}
}  // namespace

int64_t json_int(const nlohmann::json& j, const std::string& key, int64_t fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const auto& v = j.at(key);
  if (!v.is_number_integer()) bad_key(source, key, "an integer", v);
  return v.get<int64_t>();
}

double json_real(const nlohmann::json& j, const std::string& key, double fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const auto& v = j.at(key);
  if (!v.is_number()) bad_key(source, key, "a number", v);
  return v.get<double>();
}

std::string json_string(const nlohmann::json& j, const std::string& key, const std::string& fallback,
                        const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const auto& v = j.at(key);
  if (!v.is_string()) bad_key(source, key, "a string", v);
  return v.get<std::string>();
}

}  // namespace megaslide::io
