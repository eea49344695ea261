// The weights file: everything needed to rebuild a trained text-to-video model, in one safetensors file.
//
//   tensors       the DiT's parameters as "dit.<module path>" (e.g. "dit.blocks.0.attn.q.weight") and
//                 the built-in caption encoder's as "text_encoder.<module path>" ("text_encoder.tokens.weight";
//                 none when model.text_encoder.kind is clip: CLIP and the VAE are frozen and read from
//                 the folders the config names, never stored here),
//                 in bf16 by default
//   __metadata__  "format": "megaslide.weights", "format_version": "1",
//                 "config": the resolved run config as YAML (megaslide::to_yaml), from which the model's
//                 shape is rebuilt, "megaslide_version"
//
// This is the weights-only file (forward passes, no optimizer state). A training checkpoint
// (train/checkpoint.h) holds one as its model.safetensors, beside the fp32 masters and AdamW moments.
//
// Loading checks the format, parses the config, builds the model and requires the file's tensor names
// and shapes to match the model's exactly (a missing, extra or misshapen tensor is an error naming the
// file and the tensor). Errors are WeightsError (or ConfigError for a bad embedded config, with the
// file named as its source).
//
// The caller owns the returned modules. Thread-safety: plain functions.
#pragma once

#include <torch/types.h>

#include <string>

#include "megaslide/config/run_config.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/frozen_encoders.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/util/errors.h"

namespace megaslide {

class WeightsError : public io::IoError, public InputError {
 public:
  using io::IoError::IoError;
};

// A trained text-to-video model: the DiT, its caption encoder and the run config they were built from.
struct TextToVideoModel {
  RunConfig config;
  DiT dit{nullptr};
  TextEncoder text_encoder{nullptr};       // null with model.text_encoder.kind: clip
  std::shared_ptr<FrozenEncoders> frozen;  // CLIP / the VAE; TextToVideo loads them from the config when null
};

// The tensors of a weights file, named as above, cast to `dtype` (CPU copies).
io::NamedTensors weights_tensors(DiT& dit, TextEncoder& text_encoder, torch::ScalarType dtype = torch::kBFloat16);

// Writes `path` atomically.
void save_weights(const std::string& path, const RunConfig& config, DiT& dit, TextEncoder& text_encoder,
                  torch::ScalarType dtype = torch::kBFloat16);

// Writes `path` atomically from parameters named as the trainers name them ("blocks.0.attn.q.weight"
// for the DiT, "text_encoder.tokens.weight" for the caption encoder), cast to `dtype`.
io::WrittenFile save_weights(const std::string& path, const RunConfig& config, const io::NamedTensors& parameters,
                             torch::ScalarType dtype = torch::kBFloat16);
// Rebuilds the model from `path` alone, on `device`, with parameters cast to `dtype`; both modules are
// put in eval mode.
TextToVideoModel load_weights(const std::string& path, torch::Device device = torch::kCPU,
                              torch::ScalarType dtype = torch::kFloat32);

}  // namespace megaslide
