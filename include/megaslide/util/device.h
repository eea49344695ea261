// The training device a config names.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace megaslide {

// "auto" -> the first GPU when LibTorch sees one, else the CPU; "cuda[:N]" fails clearly (c10::Error)
// without GPUs or past the last one. A GPU always comes back with its index ("cuda" -> the current GPU,
// cuda:0 unless changed).
c10::Device resolve_device(const std::string& spec);

}  // namespace megaslide
