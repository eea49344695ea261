// Build information: the library's version and how it was compiled (for logs and --version).
// Thread-safe: every function returns constants.
#pragma once

#include <string>

namespace megaslide {

// "MAJOR.MINOR.PATCH" of libmegaslide.
const char* version();

// True when kernels/ was compiled with nvcc into this library (whether or not a GPU is present now).
bool built_with_cuda();

// One line for logs: version, LibTorch version, CUDA kernels on/off, GPUs visible at run time.
std::string build_summary();

}  // namespace megaslide
