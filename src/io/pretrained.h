// Internal to the library (not installed): reading published model folders (transformers / diffusers
// layout): `config.json` beside one safetensors file of weights. Used by the CLIP text encoder and the
// Stable Diffusion VAE.
//
//   PretrainedFolder  opens DIR/config.json (parsed) and the weights file (header only); take() reads a
//                     tensor by name straight from the file (only the tensors asked for are read: a
//                     full CLIPModel file's vision tower is never loaded), checking its shape and that
//                     it is floating point, and converts it to the requested dtype.
//
// Errors are PretrainedError naming the folder or file, the tensor, and what was expected — missing
// files, a tensor missing or of the wrong shape or dtype, a config.json that is not JSON or lacks a
// required key. Thread-safety: one thread per object.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"

namespace megaslide::io {

class PretrainedError : public IoError {
 public:
  using IoError::IoError;
};

class PretrainedFolder {
 public:
  // `dir`: the folder; `weight_files`: the names to look for inside it, the first present is used.
  PretrainedFolder(const std::string& dir, const std::vector<std::string>& weight_files);
  ~PretrainedFolder();

  const std::string& dir() const { return dir_; }
  const std::string& weights_path() const { return weights_path_; }
  const nlohmann::json& config() const;
  bool has(const std::string& name) const;
  // The tensor `name`, which must have `shape` and a floating-point dtype, as `dtype` on the CPU.
  torch::Tensor take(const std::string& name, const std::vector<int64_t>& shape, torch::ScalarType dtype = torch::kFloat32) const;
  // The first of `names` present (e.g. a current and a legacy key); errors name the first.
  torch::Tensor take_any(const std::vector<std::string>& names, const std::vector<int64_t>& shape,
                         torch::ScalarType dtype = torch::kFloat32) const;
  // Every tensor name in the weights file.
  std::vector<std::string> names() const;

  [[noreturn]] void fail(const std::string& what) const;

 private:
  std::string dir_, weights_path_;
  std::unique_ptr<nlohmann::json> config_;
  SafetensorsHeader header_;
};

// Helpers for config.json values: `key` from `j` with a default when absent; a present value of the
// wrong type is an error naming `source` and the key.
int64_t json_int(const nlohmann::json& j, const std::string& key, int64_t fallback, const std::string& source);
double json_real(const nlohmann::json& j, const std::string& key, double fallback, const std::string& source);
std::string json_string(const nlohmann::json& j, const std::string& key, const std::string& fallback, const std::string& source);

}  // namespace megaslide::io
