// Internal to the library (not installed): one safetensors weights file memory-mapped read-only, its
// tensors converted one at a time. Used by the Wan VAE, whose single-file checkpoints come without a
// config.json.
//
//   MappedSafetensors  maps the file (the header is parsed and validated first); take() checks a tensor's
//                      presence, shape and floating-point dtype and returns a copy in the requested dtype on
//                      the CPU, so at most one converted tensor exists beside the mapping at a time. The
//                      mapping holds no memory of its own: pages are read as the copies touch them.
//
// Errors are io::PretrainedError naming the file, the tensor and what was expected (`context` says where the
// expected shape came from). Thread-safety: take() may be called from several threads; the object is not
// copyable.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "io/pretrained.h"
#include "megaslide/io/safetensors.h"

namespace megaslide::io {

class MappedSafetensors {
 public:
  explicit MappedSafetensors(const std::string& path);
  ~MappedSafetensors();
  MappedSafetensors(const MappedSafetensors&) = delete;
  MappedSafetensors& operator=(const MappedSafetensors&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const;
  // The shape of `name` (which must be present).
  const std::vector<int64_t>& shape(const std::string& name) const;
  std::vector<std::string> names() const;
  // A copy of tensor `name`, which must have `shape` and a floating-point dtype, as `dtype` on the CPU.
  torch::Tensor take(const std::string& name, const std::vector<int64_t>& shape, torch::ScalarType dtype,
                     const std::string& context) const;

 private:
  const SafetensorsEntry* find(const std::string& name) const;
  std::string path_;
  SafetensorsHeader header_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
};

}  // namespace megaslide::io
