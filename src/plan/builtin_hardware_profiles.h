// The shipped hardware profiles (configs/hardware/*.yaml), compiled into the library at build time
// (src/CMakeLists.txt generates builtin_hardware_profiles.cpp from the files), so that
// load_hardware_profile("h200") needs no file at run time. The YAML files stay the one source.
#pragma once

#include <string>
#include <vector>

namespace megaslide::plan::detail {

struct BuiltinHardwareProfile {
  std::string name;  // the file's stem
  std::string path;  // "configs/hardware/NAME.yaml", for messages
  std::string text;  // the file's YAML
};

const std::vector<BuiltinHardwareProfile>& builtin_hardware_profile_texts();

}  // namespace megaslide::plan::detail
