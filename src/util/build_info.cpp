#include "megaslide/util/build_info.h"

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/version.h>

namespace megaslide {

const char* version() { return MEGASLIDE_VERSION; }

bool built_with_cuda() {
#ifdef MEGASLIDE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string build_summary() {
  return fmt::format("MegaSlide {} (LibTorch {}, CUDA kernels {}, {} GPU(s) visible)", version(), TORCH_VERSION,
                     built_with_cuda() ? "compiled" : "not compiled", torch::cuda::device_count());
}

}  // namespace megaslide
