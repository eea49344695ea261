// libFuzzer target: the run-config parser. Any input must load or raise ConfigError; anything else
// (another exception, a crash, a sanitizer report) is a finding. Built and run by run_fuzzer.sh.
#include <cstddef>
#include <cstdint>
#include <string>

#include "megaslide/config/run_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    megaslide::parse_run_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz.yaml");
  } catch (const megaslide::ConfigError&) {
  }
  return 0;
}
