#include "io/pretrained.h"

#include <fcntl.h>
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
  if (!is_directory(dir)) throw PretrainedError("'" + dir + "' is not a folder (expected a model folder with config.json and weights)");
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

void PretrainedFolder::fail(const std::string& what) const { throw PretrainedError("model folder '" + dir_ + "': " + what); }

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

torch::Tensor PretrainedFolder::take(const std::string& name, const std::vector<int64_t>& shape, torch::ScalarType dtype) const {
  const SafetensorsEntry* entry = nullptr;
  for (const auto& e : header_.entries)
    if (e.name == name) entry = &e;
  if (entry == nullptr) throw PretrainedError("'" + weights_path_ + "': no tensor '" + name + "' (expected shape " + shape_string(shape) + ")");
  if (entry->shape != shape)
    throw PretrainedError("'" + weights_path_ + "': tensor '" + name + "' has shape " + shape_string(entry->shape) + ", expected " +
                          shape_string(shape) + " (from config.json)");
  if (!c10::isFloatingType(entry->dtype))
    throw PretrainedError("'" + weights_path_ + "': tensor '" + name + "' is " + safetensors_dtype_name(entry->dtype) +
                          ", expected floating point (F32, F16 or BF16)");
  auto t = torch::empty(entry->shape, torch::TensorOptions().dtype(entry->dtype));
  uint64_t bytes = entry->end - entry->begin, offset = header_.data_start + entry->begin;
  const int fd = ::open(weights_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw PretrainedError("'" + weights_path_ + "': cannot open: " + std::strerror(errno));
  auto* p = static_cast<char*>(t.data_ptr());
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, std::min<uint64_t>(bytes, 1ull << 30), static_cast<off_t>(offset));
    if (n <= 0) {
      ::close(fd);
      throw PretrainedError("'" + weights_path_ + "': cannot read tensor '" + name + "'" + (n < 0 ? std::string(": ") + std::strerror(errno) : ""));
    }
    p += n, bytes -= static_cast<uint64_t>(n), offset += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return t.to(dtype);
}

torch::Tensor PretrainedFolder::take_any(const std::vector<std::string>& names, const std::vector<int64_t>& shape,
                                         torch::ScalarType dtype) const {
  for (const auto& n : names)
    if (has(n)) return take(n, shape, dtype);
  return take(names.front(), shape, dtype);
}

namespace {
[[noreturn]] void bad_key(const std::string& source, const std::string& key, const std::string& expected, const nlohmann::json& v) {
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

std::string json_string(const nlohmann::json& j, const std::string& key, const std::string& fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const auto& v = j.at(key);
  if (!v.is_string()) bad_key(source, key, "a string", v);
  return v.get<std::string>();
}

}  // namespace megaslide::io
