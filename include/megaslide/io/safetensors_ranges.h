// Element ranges of tensors from one safetensors file whose header is parsed once: resuming a checkpoint
// on another number of ranks reads one range per block parameter (or per shard) from the same few files,
// and parsing the header for each read made that quadratic in the number of tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>

namespace megaslide::io {

class SafetensorsRangeReader {
 public:
  // Opens the file and parses its header; errors (SafetensorsError) name the file.
  explicit SafetensorsRangeReader(const std::string& path);
  SafetensorsRangeReader(SafetensorsRangeReader&&) noexcept;
  SafetensorsRangeReader& operator=(SafetensorsRangeReader&&) noexcept;
  ~SafetensorsRangeReader();

  // Reads elements [offset, offset + target.numel()) of tensor `name`, taken flat, into `target` (a
  // contiguous CPU tensor of the file's dtype). Errors name the file and the tensor.
  void read_into(const std::string& name, int64_t offset, const at::Tensor& target) const;

  const std::string& path() const { return path_; }

 private:
  struct Impl;
  std::string path_;
  std::unique_ptr<Impl> impl_;
};

// One reader per file, opened on first use.
class SafetensorsRangeReaders {
 public:
  const SafetensorsRangeReader& operator()(const std::string& path);

 private:
  std::map<std::string, SafetensorsRangeReader> readers_;
};

}  // namespace megaslide::io
