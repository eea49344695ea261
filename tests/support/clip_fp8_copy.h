// A CLIP model folder with its layers' matrices replaced by their fp8 values, for the fp8 storage tests of
// tests/test_clip.cpp and tests/test_clip_vision.cpp.
#pragma once

#include <string>

#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"
#include "megaslide/io/safetensors.h"

namespace megaslide::testing {

// A CLIP folder's copy in `dir` whose layer matrices hold their fp8 values: dequantize_fp8(quantize_fp8(W)), per
// tensor. Counts the matrices and their elements.
inline void write_fp8_values_copy(const std::string& folder, const std::string& dir, int64_t& matrices,
                                  int64_t& elements) {
  megaslide::io::NamedTensors tensors;
  for (auto& [name, t] : megaslide::io::read_safetensors(folder + "/model.safetensors").tensors) {
    const auto at = name.find("encoder.layers.");
    const bool matrix = (at == 0 || (at != std::string::npos && name[at - 1] == '.')) &&
                        name.find("layer_norm") == std::string::npos && name.size() > 7 &&
                        name.compare(name.size() - 7, 7, ".weight") == 0;
    if (!matrix) {
      tensors.emplace_back(name, t);
      continue;
    }
    tensors.emplace_back(name, megaslide::dequantize_fp8(
                                   megaslide::quantize_fp8(t.to(torch::kFloat32), megaslide::Fp8Scaling::kPerTensor)));
    ++matrices;
    elements += t.numel();
  }
  megaslide::io::make_directories(dir);
  megaslide::io::write_safetensors(dir + "/model.safetensors", tensors);
  megaslide::io::write_file_atomically(dir + "/config.json", megaslide::io::read_file(folder + "/config.json"));
}

}  // namespace megaslide::testing
