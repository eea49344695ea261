// train.init_from: the tensors a fresh run starts from instead of its random initialisation — matched
// by name, strictly, before the run writes anything.
//
// Sources (`path`):
//   - a weights file (megaslide-train --export-weights, or a checkpoint's model.safetensors): DiT tensors
//     "dit.<name>", caption-encoder tensors "text_encoder.<name>" (bf16 as exported);
//   - a checkpoint folder: its fp32 master.safetensors (the checkpoint's manifest is verified first);
//     a run folder stands for its latest checkpoint;
//   - any safetensors file with the model's names, with or without the "dit." prefix.
// Names: a model parameter "blocks.0.attn.q.weight" is found as itself or as "dit.blocks.0.attn.q.weight".
// One conversion is built in: a global-attention model's fused "…attn.qkv.weight"/"…attn.qkv.bias" [3D, …]
// feeds a 3D-DSA model's "…attn.q.*", "…attn.k.*", "…attn.v.*" (rows [0, D), [D, 2D), [2D, 3D): q, k, v in
// the order GlobalSelfAttention splits them), so a dense model can start a MegaSlide one.
//
// Strict: every model parameter must be found with its shape and a floating-point dtype, and every tensor
// of the file must be used; otherwise InitFromError lists all the missing, unexpected and mis-shaped
// tensors at once. A parameter matching one of `allow_missing` (glob patterns: `*` matches any run of
// characters, dots included: "blocks.*.attn.offset_*") may be absent and keeps its initialisation — for
// 3D-DSA's offset network (zero-initialised output: Δ = 0) and relative-position bias (zero) that keeps the
// neighbourhood-attention behaviour at step 0.
//
// The result is a list of (parameter name -> where its values are), so any loading path — a resident
// model, a host store filled block by block — reads exactly the tensors it needs when it needs them.
//
// Thread-safety: plain functions; InitTensor::read may run concurrently (each call opens the file).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/util/glob.h"
#include "megaslide/util/errors.h"

namespace megaslide {

class InitFromError : public io::IoError, public InputError {
 public:
  using io::IoError::IoError;
};

// Where one parameter's values are: a tensor of a safetensors file, or rows of one.
struct InitTensor {
  std::string file;
  io::SafetensorsEntry entry;           // the file's tensor
  uint64_t data_start = 0;              // of the file's data section
  int64_t row_begin = 0, row_end = -1;  // rows of dimension 0 taken (-1: all)
  // The values as a CPU tensor of `dtype` (converted from the file's dtype).
  torch::Tensor read(torch::ScalarType dtype = torch::kFloat32) const;
  // Reads into `target` (any device, any floating dtype; the shape must match).
  void read_into(const torch::Tensor& target) const;
};

struct InitPlan {
  std::string path;                                         // the file the tensors come from
  std::vector<std::pair<std::string, InitTensor>> tensors;  // parameter name -> source, in the model's order
  std::vector<std::string> kept;  // parameters allowed to be missing: they keep their initialisation
};

// Parameter names and shapes as a trainer names them ("blocks.0.attn.q.weight", "text_encoder.tokens.weight").
using ParameterShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// Resolves `path` (see above), matches its tensors to `parameters` and checks them. Throws InitFromError.
InitPlan plan_init_from(const std::string& path, const ParameterShapes& parameters,
                        const std::vector<std::string>& allow_missing);

}  // namespace megaslide
