#include "io/mapped_safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace megaslide::io {

namespace {
std::string shape_string(c10::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
}  // namespace

MappedSafetensors::MappedSafetensors(const std::string& path) : path_(path) {
  if (!path_exists(path)) throw PretrainedError("'" + path + "': no such file");
  try {
    header_ = read_safetensors_header(path);
  } catch (const SafetensorsError& e) {
    throw PretrainedError(e.what());
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw PretrainedError("'" + path + "': cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw PretrainedError("'" + path + "': cannot stat: " + std::strerror(err));
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ > 0) {
    map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      const int err = errno;
      map_ = nullptr;
      ::close(fd);
      throw PretrainedError("'" + path + "': cannot map: " + std::strerror(err));
    }
  }
  ::close(fd);  // the mapping stays valid
}

MappedSafetensors::~MappedSafetensors() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

const SafetensorsEntry* MappedSafetensors::find(const std::string& name) const {
  for (const auto& e : header_.entries)
    if (e.name == name) return &e;
  return nullptr;
}

bool MappedSafetensors::has(const std::string& name) const { return find(name) != nullptr; }

const std::vector<int64_t>& MappedSafetensors::shape(const std::string& name) const {
  const auto* e = find(name);
  if (e == nullptr) throw PretrainedError("'" + path_ + "': no tensor '" + name + "'");
  return e->shape;
}

std::vector<std::string> MappedSafetensors::names() const {
  std::vector<std::string> out;
  for (const auto& e : header_.entries) out.push_back(e.name);
  return out;
}

torch::Tensor MappedSafetensors::take(const std::string& name, const std::vector<int64_t>& shape, torch::ScalarType dtype,
                                      const std::string& context) const {
  const auto* entry = find(name);
  if (entry == nullptr) throw PretrainedError("'" + path_ + "': no tensor '" + name + "' (expected shape " + shape_string(shape) + ")");
  if (entry->shape != shape)
    throw PretrainedError("'" + path_ + "': tensor '" + name + "' has shape " + shape_string(entry->shape) + ", expected " +
                          shape_string(shape) + " (" + context + ")");
  if (!c10::isFloatingType(entry->dtype))
    throw PretrainedError("'" + path_ + "': tensor '" + name + "' is " + safetensors_dtype_name(entry->dtype) +
                          ", expected floating point (F32, F16 or BF16)");
  const uint64_t offset = header_.data_start + entry->begin;
  if (offset + (entry->end - entry->begin) > map_bytes_) throw PretrainedError("'" + path_ + "': tensor '" + name + "' lies past the end of the file");
  // The header check guarantees the byte count matches the shape and dtype. Safetensors data is aligned to
  // its element size only by convention; copy through an aligned buffer when it is not.
  auto* p = static_cast<char*>(map_) + offset;
  auto options = torch::TensorOptions().dtype(entry->dtype);
  torch::Tensor out;
  if (reinterpret_cast<uintptr_t>(p) % c10::elementSize(entry->dtype) == 0) {
    out = torch::from_blob(p, entry->shape, options).to(dtype, /*non_blocking=*/false, /*copy=*/true);
  } else {
    auto aligned = torch::empty(entry->shape, options);
    std::memcpy(aligned.data_ptr(), p, entry->end - entry->begin);
    out = aligned.to(dtype);
  }
  return out;
}

}  // namespace megaslide::io
