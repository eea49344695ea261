// HardwareProfile: the figures of one machine that bound a training step (DESIGN.md §6): PCIe bandwidth
// each way, host memory bandwidth, the GPU's peak bf16 FLOP/s and memory, and host RAM. Profiles are
// small YAML files users write (configs/hardware/*.yaml are examples, each figure with the vendor
// document it comes from); the shipped ones are also compiled into the library under their file
// stems ("h200", "h100nvl"), so a name works from any directory and from an installed package.
//
// File format (every key required except name, description and network_gbps; unknown keys are errors):
//   name: h200                       # defaults to the file's stem
//   description: free text
//   device_memory_bytes: 141000000000
//   peak_bf16_tflops: 835.5          # dense, 1e12 FLOP/s
//   pcie_h2d_gbps: 31.5              # 1e9 B/s, host to device
//   pcie_d2h_gbps: 31.5
//   host_dram_gbps: 204.8
//   host_memory_bytes: 1649267441664
//   network_gbps: 12.5               # optional: 1e9 B/s per rank each way, for --world-size > 1
//   nvme_gbps: 7.0                   # optional: the NVMe tier's disk, 1e9 B/s sequential (read and write each)
//   nvme_bytes: 4000000000000        # optional: its capacity (unknown: the plan does not judge the fit)
//
// Errors: HardwareProfileError, whose message names the file (or built-in profile), the key and what
// was expected. Thread-safety: plain values; the functions are pure apart from reading the file.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "megaslide/util/errors.h"

namespace megaslide::plan {

class HardwareProfileError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

// What the planner assumes for a profile without network_gbps: one 100 Gb/s Ethernet link per rank
// (12.5e9 B/s each way). An assumption, not a measurement: the shipped profiles describe one GPU's
// machine and carry no network figure.
inline constexpr double kAssumedNetworkGbps = 12.5;
// What the planner assumes for a profile without nvme_gbps: one PCIe 4.0 x4 NVMe disk's sequential rate
// (7e9 B/s; the link carries at most 7.88e9). An assumption, not a measurement.
inline constexpr double kAssumedNvmeGbps = 7.0;

struct HardwareProfile {
  std::string name;
  std::string description;
  std::string source;  // the file it was read from, or "built-in configs/hardware/NAME.yaml"
  int64_t device_memory_bytes = 0;
  double peak_bf16_tflops = 0.0;
  double pcie_h2d_gbps = 0.0;
  double pcie_d2h_gbps = 0.0;
  double host_dram_gbps = 0.0;
  int64_t host_memory_bytes = 0;
  // The bandwidth each rank's collectives get, 1e9 B/s each way (the exchange of a data-parallel run:
  // Gloo over TCP for the streamed trainer's host buffers, NCCL or Gloo for the resident trainer's).
  double network_gbps = kAssumedNetworkGbps;
  bool network_gbps_assumed = true;  // false when the profile gives network_gbps
  // The bandwidth between the GPUs of a context-parallel group, 1e9 B/s each way per GPU (NCCL over NVLink or
  // NVSwitch: the activations' halo and all-to-all exchanges). Without it, network_gbps.
  double device_link_gbps = kAssumedNetworkGbps;
  bool device_link_gbps_assumed = true;  // false when the profile gives device_link_gbps
  // The NVMe tier's disk (offload.state_tier: nvme): its sequential bandwidth, 1e9 B/s for reads and for writes
  // (the planner adds a step's reads and writes: one disk does not do both at full rate), and its capacity.
  double nvme_gbps = kAssumedNvmeGbps;
  bool nvme_gbps_assumed = true;  // false when the profile gives nvme_gbps
  int64_t nvme_bytes = 0;         // 0: not given
};

// Parses a profile's YAML text; `source` names it in messages and is the default name's origin.
HardwareProfile parse_hardware_profile(const std::string& yaml_text, const std::string& source);

// A built-in name (see builtin_hardware_profiles()) or a path to a YAML file. A path is anything that
// contains '/' or ends in ".yaml"/".yml"; a bare word that is no built-in name is an error listing them.
HardwareProfile load_hardware_profile(const std::string& name_or_path);

// Names of the profiles compiled into the library, sorted.
std::vector<std::string> builtin_hardware_profiles();

}  // namespace megaslide::plan
