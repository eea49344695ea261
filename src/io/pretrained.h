// Internal to the library (not installed): reading published model folders (transformers / diffusers
// layout): `config.json` beside one safetensors file of weights. Used by the CLIP text encoder and the
// Stable Diffusion VAE. MappedWeights reads one safetensors file or a sharded set (an index.json's
// weight_map) through read-only memory maps; used by the umT5 encoder.
//
//   PretrainedFolder  opens DIR/config.json (parsed) and the weights file (header only); take() reads a
//                     tensor by name straight from the file (only the tensors asked for are read: a
//                     full CLIPModel file's vision tower is never loaded), checking its shape and that
//                     it is floating point, and converts it to the requested dtype.
//
// fp8 tensors (F8_E4M3, F8_E5M2; io/fp8.h) are dequantized by take(): data × its per-tensor scale, ComfyUI's
// "<layer>.scale_weight" or "<layer>.weight_scale" beside "<layer>.weight" (one value), or 1 without one (its
// *_fp8_e4m3fn files, plain casts).
//
// Errors are PretrainedError naming the folder or file, the tensor, and what was expected — missing
// files, a tensor missing or of the wrong shape or dtype, a config.json that is not JSON or lacks a
// required key. Thread-safety: one thread per object.
#pragma once

#include <torch/types.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/util/errors.h"

namespace megaslide::io {

// The name of the per-tensor scale of the fp8 weight `name` among the names `has` knows ("<layer>.scale_weight" or
// "<layer>.weight_scale" for "<layer>.weight"), or "" when there is none.
std::string fp8_scale_name(const std::string& name, const std::function<bool(const std::string&)>& has);

class PretrainedError : public IoError, public InputError {
 public:
  using IoError::IoError;
};

// A tensor holding a NaN or an infinity (io::require_finite's refusal), with where: its first bad element of `count`.
class NonFiniteTensorError : public PretrainedError {
 public:
  NonFiniteTensorError(const std::string& what, int64_t element, int64_t count)
      : PretrainedError(what), element(element), count(count) {}
  int64_t element, count;
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
  torch::Tensor take(const std::string& name, const std::vector<int64_t>& shape,
                     torch::ScalarType dtype = torch::kFloat32) const;
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

// One safetensors file, or the shards an `*.safetensors.index.json` names ({"weight_map": {tensor: file}},
// files relative to the index), each memory-mapped read-only. Every shard's header is validated at open
// (read_safetensors_header), the index must name only files that exist and tensors they hold, and no
// tensor may be in two shards. take() converts one tensor from the mapping to a fresh CPU tensor of the
// requested dtype (the file's pages are only touched then, so a model is converted tensor by tensor and
// the resident copy of the file is the page cache's, not the process's). Errors: PretrainedError naming
// the file and the tensor. Thread-safety: take() may be called from several threads.
class MappedWeights {
 public:
  // `path`: a .safetensors file or an index.json.
  explicit MappedWeights(const std::string& path);
  ~MappedWeights();
  MappedWeights(const MappedWeights&) = delete;
  MappedWeights& operator=(const MappedWeights&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const;
  std::vector<std::string> names() const;
  // The file that holds `name` (for errors).
  const std::string& file_of(const std::string& name) const;
  // The shape of `name` (it must exist).
  const std::vector<int64_t>& shape(const std::string& name) const;
  // The tensor `name`, which must have `shape` and a floating-point dtype, as a new CPU tensor of `dtype`;
  // `context` says in a shape error where the expected shape came from.
  torch::Tensor take(const std::string& name, const std::vector<int64_t>& shape,
                     torch::ScalarType dtype = torch::kFloat32,
                     const std::string& context = "from the model's configuration") const;
  // The same checks, and the tensor in the dtype the file stores it in (not fp8: an fp8 tensor's value needs its
  // scale, and view() refuses it naming take and take_fp8), without a copy: a view into
  // the memory map that keeps the map alive after this object is gone. Its pages are the file's, read from the
  // page cache when first touched (the finite check here touches them once) and shared with every process that
  // maps the file. The view is READ-ONLY memory: writing into it is a segmentation fault, so it is for weights
  // nothing writes (a frozen encoder's). Data not aligned to its element size come back as take()'s copy. The
  // file must not change while a view lives: one truncated under it ends the process with SIGBUS (a file
  // replaced by a rename, as downloads do, is safe: the map keeps the old one).
  torch::Tensor view(const std::string& name, const std::vector<int64_t>& shape,
                     const std::string& context = "from the model's configuration") const;
  // The dtype `name` is stored in (it must exist).
  torch::ScalarType stored_dtype(const std::string& name) const;
  // Whether `name` is stored as fp8, and that tensor as stored: its data (a fresh CPU copy) and its per-tensor
  // scale (float32, 1 without one), as described above. take_fp8 checks the shape and that it is fp8.
  bool is_fp8(const std::string& name) const;
  Fp8Tensor take_fp8(const std::string& name, const std::vector<int64_t>& shape, const std::string& context) const;
  // The bytes of a U8 tensor (e.g. a tokenizer model stored in the weights file).
  std::string bytes(const std::string& name) const;

 private:
  struct Mapping;
  struct Location {
    size_t file = 0;
    const SafetensorsEntry* entry = nullptr;
  };
  const Location& locate(const std::string& name) const;
  // take()'s and view()'s checks: the entry of `name`, present with `shape` and a floating-point dtype; its data
  // in the map, inside the file and finite.
  const SafetensorsEntry& checked_entry(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::string& context) const;
  char* checked_data(const std::string& name) const;
  std::string path_;
  std::vector<std::shared_ptr<Mapping>> files_;  // shared with view()s
  std::map<std::string, Location> where_;
};

// Helpers for config.json values: `key` from `j` with a default when absent; a present value of the
// wrong type is an error naming `source` and the key.
int64_t json_int(const nlohmann::json& j, const std::string& key, int64_t fallback, const std::string& source);
double json_real(const nlohmann::json& j, const std::string& key, double fallback, const std::string& source);
std::string json_string(const nlohmann::json& j, const std::string& key, const std::string& fallback,
                        const std::string& source);

}  // namespace megaslide::io
