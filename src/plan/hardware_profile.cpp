#include "megaslide/plan/hardware_profile.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "megaslide/io/files.h"
#include "megaslide/util/numbers.h"
#include "plan/builtin_hardware_profiles.h"

namespace megaslide::plan {
namespace {

[[noreturn]] void fail(const std::string& source, const std::string& key, const std::string& problem) {
  throw HardwareProfileError(source + ": " + (key.empty() ? "" : key + ": ") + problem);
}

std::string describe(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "nothing";
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  return node.IsSequence() ? "a list" : "a mapping";
}

// A finite number > 0 (YAML scalars such as 31.5, 141000000000 or 1.41e11).
double positive_number(const YAML::Node& root, const std::string& source, const std::string& key) {
  const YAML::Node node = root[key];
  if (!node.IsDefined()) fail(source, key, "missing (every profile needs it; see configs/hardware/h200.yaml)");
  if (!node.IsScalar()) fail(source, key, "expected a number > 0, got " + describe(node));
  double value = 0.0;
  try {
    value = parse_real(node.Scalar(), "a number > 0");
  } catch (const NumberError& e) {
    fail(source, key, e.what());
  }
  if (value <= 0) fail(source, key, "expected a number > 0, got " + describe(node));
  return value;
}

int64_t positive_bytes(const YAML::Node& root, const std::string& source, const std::string& key) {
  const double v = positive_number(root, source, key);
  if (v != std::floor(v) || v > 9.0e18) {
    fail(source, key, "expected a whole number of bytes, got '" + root[key].Scalar() + "'");
  }
  return static_cast<int64_t>(v);
}

std::string stem(const std::string& path) {
  const auto slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const auto dot = base.find_last_of('.');
  return dot == std::string::npos || dot == 0 ? base : base.substr(0, dot);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

HardwareProfile parse_hardware_profile(const std::string& yaml_text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    fail(source, "", std::string("not valid YAML: ") + e.what());
  }
  if (!root.IsMap())
    fail(source, "", "expected a mapping of keys (see configs/hardware/h200.yaml), got " + describe(root));
  static const std::set<std::string> kKeys{"name",          "description",   "device_memory_bytes", "peak_bf16_tflops",
                                           "pcie_h2d_gbps", "pcie_d2h_gbps", "host_dram_gbps",      "host_memory_bytes",
                                           "network_gbps",  "nvme_gbps",     "nvme_bytes",          "device_link_gbps"};
  for (const auto& item : root) {
    const std::string key = item.first.as<std::string>();
    if (kKeys.count(key) == 0) {
      std::string known;
      for (const auto& k : kKeys) known += (known.empty() ? "" : ", ") + k;
      fail(source, key, "unknown key; a hardware profile has: " + known);
    }
  }
  HardwareProfile p;
  p.source = source;
  const auto text = [&](const std::string& key, const std::string& fallback) {
    const YAML::Node node = root[key];
    if (!node.IsDefined()) return fallback;
    if (!node.IsScalar()) fail(source, key, "expected text, got " + describe(node));
    return node.Scalar();
  };
  p.name = text("name", stem(source));
  p.description = text("description", "");
  p.device_memory_bytes = positive_bytes(root, source, "device_memory_bytes");
  p.peak_bf16_tflops = positive_number(root, source, "peak_bf16_tflops");
  p.pcie_h2d_gbps = positive_number(root, source, "pcie_h2d_gbps");
  p.pcie_d2h_gbps = positive_number(root, source, "pcie_d2h_gbps");
  p.host_dram_gbps = positive_number(root, source, "host_dram_gbps");
  p.host_memory_bytes = positive_bytes(root, source, "host_memory_bytes");
  if (root["network_gbps"].IsDefined()) {
    p.network_gbps = positive_number(root, source, "network_gbps");
    p.network_gbps_assumed = false;
  }
  p.device_link_gbps = p.network_gbps;  // no link of their own: the GPUs talk over the network
  if (root["device_link_gbps"].IsDefined()) {
    p.device_link_gbps = positive_number(root, source, "device_link_gbps");
    p.device_link_gbps_assumed = false;
  }
  if (root["nvme_gbps"].IsDefined()) {
    p.nvme_gbps = positive_number(root, source, "nvme_gbps");
    p.nvme_gbps_assumed = false;
  }
  if (root["nvme_bytes"].IsDefined()) p.nvme_bytes = positive_bytes(root, source, "nvme_bytes");
  return p;
}

std::vector<std::string> builtin_hardware_profiles() {
  std::vector<std::string> names;
  for (const auto& b : detail::builtin_hardware_profile_texts()) names.push_back(b.name);
  std::sort(names.begin(), names.end());
  return names;
}

HardwareProfile load_hardware_profile(const std::string& name_or_path) {
  const bool is_path = name_or_path.find('/') != std::string::npos || ends_with(name_or_path, ".yaml") ||
                       ends_with(name_or_path, ".yml");
  if (!is_path) {
    for (const auto& b : detail::builtin_hardware_profile_texts()) {
      if (b.name == name_or_path) return parse_hardware_profile(b.text, "built-in " + b.path);
    }
  }
  // Not a built-in name: a path, or a name that exists here (a file or folder in the working directory).
  if (!is_path && !io::path_exists(name_or_path)) {
    std::string known;
    for (const auto& n : builtin_hardware_profiles()) known += (known.empty() ? "" : ", ") + n;
    throw HardwareProfileError("hardware profile '" + name_or_path + "': no built-in profile of that name (built-in: " +
                               known + "); to read a file, give its path (e.g. ./" + name_or_path + ".yaml)");
  }
  std::string text;
  try {
    text = io::read_input_file(name_or_path, 1 << 20);  // a profile is a few hundred bytes
  } catch (const std::exception& e) {
    throw HardwareProfileError(std::string("hardware profile: ") + e.what());
  }
  return parse_hardware_profile(text, name_or_path);
}

}  // namespace megaslide::plan
