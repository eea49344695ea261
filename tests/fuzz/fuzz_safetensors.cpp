// libFuzzer target: the safetensors reader (checkpoints, weights files). Any input must load or raise
// SafetensorsError; anything else is a finding. The reader works on paths, so each input goes through
// a scratch file in /dev/shm. Built and run by run_fuzzer.sh.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "megaslide/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/megaslide-fuzz-" + std::to_string(::getpid()) + ".safetensors";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    megaslide::io::read_safetensors(path);
  } catch (const megaslide::io::SafetensorsError&) {
  }
  return 0;
}
