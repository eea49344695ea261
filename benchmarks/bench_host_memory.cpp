// bench_host_memory: the planner's host bytes against the resident set size of a real streamed run of
// any config on the CPU, for models too large for a unit test (tests/test_host_memory.cpp runs
// small-50m and a small Wan). Builds the streamed trainer (for model.arch wan on random latents of the
// config's shapes, written to a scratch file for data.tensors), runs --steps steps, and compares the growth of the
// resident set with the plan (megaslide-plan's figures) at start-up (VmHWM while the trainer is built) and after the
// steps (VmRSS, after malloc_trim). On the CPU the "device" is host memory too, so the device
// components the trainer keeps (slots, resident parts with gradients and AdamW state) are added to the
// plan's host bytes. glibc's mmap threshold is fixed at 1 MiB, as a large model has it in effect (see
// the test). The last line is one JSON object; exit status 1 when a ratio is outside [0.95, 1.05].
//
//   build/bin/bench_host_memory --config configs/h100nvl-1b.yaml [--set key=value ...] [--steps N]
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/io/safetensors.h"
#include "megaslide/plan/step_plan.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/trainer.h"
#include "megaslide/train/wan_family.h"

namespace {

int64_t proc_status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == field + ":") {
      int64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 16, '\n');
  }
  return -1;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  std::vector<std::string> overrides{"train.device=cpu"};
  int steps = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--config") == 0) config_path = argv[i + 1];
    else if (std::strcmp(argv[i], "--set") == 0) overrides.push_back(argv[i + 1]);
    else if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_host_memory: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (config_path.empty()) {
    std::fprintf(stderr, "usage: bench_host_memory --config FILE [--set key=value ...] [--steps N]\n");
    return 2;
  }
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  auto config = megaslide::load_run_config(config_path, overrides);
  // The compute dtype the trainer runs in here (auto: bf16 only where this CPU computes it natively), so
  // that the plan is of the same run.
  const auto compute = megaslide::resolve_compute_dtype(config.offload.compute_dtype, torch::kCPU);
  config.offload.compute_dtype = compute.dtype;
  std::printf("compute dtype %s (%s)\n", compute.dtype.c_str(), compute.reason.c_str());
  const auto plan = megaslide::plan::plan_step(config, megaslide::plan::load_hardware_profile("h200"));
  const auto& d = plan.device;
  const int64_t resident_weights = d.resident_state / 4;
  // The gradient slots (host memory on the CPU) get pages only when the first backward writes them.
  const double expected_start = static_cast<double>(
      resident_weights + std::max(plan.host.construction_peak, plan.host.steady() + d.weight_slots));
  const double expected_steady =
      static_cast<double>(plan.host.steady() + d.weight_slots + d.gradient_slots + d.resident_state);

  // Wan (model.arch: wan) trains on latent videos and text embeddings in memory: random ones of the
  // config's shapes (their values change nothing that is allocated), made before the baseline.
  config.offload.enabled = true;
  std::string wan_tensors;
  if (config.model.arch == megaslide::Architecture::kWan) {
    const auto& d = config.data;
    wan_tensors = "/tmp/bench-host-memory-" + std::to_string(::getpid()) + ".safetensors";
    megaslide::io::write_safetensors(wan_tensors,
                                     {{"latents", torch::randn({1, d.channels, d.frames, d.height, d.width})},
                                      {"text", torch::randn({1, d.max_text_tokens, config.model.wan.text_dim})},
                                      {"empty_text", torch::zeros({d.max_text_tokens, config.model.wan.text_dim})}});
    config.data.dataset = "latent-tensors";
    config.data.tensors = wan_tensors;
  }
  malloc_trim(0);
  const int64_t before = proc_status_bytes("VmRSS");
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
  }
  auto t0 = std::chrono::steady_clock::now();
  megaslide::Trainer trainer = megaslide::make_trainer(config);
  if (!wan_tensors.empty()) std::remove(wan_tensors.c_str());  // held in memory now
  const double construct_s = seconds_since(t0);
  const int64_t start = proc_status_bytes("VmHWM") - before;
  t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) trainer.step();
  trainer.synchronize();
  const double steps_s = seconds_since(t0);
  const int64_t untrimmed = proc_status_bytes("VmRSS") - before;
  malloc_trim(0);
  const int64_t steady = proc_status_bytes("VmRSS") - before;

  const double start_ratio = static_cast<double>(start) / expected_start;
  const double steady_ratio = static_cast<double>(steady) / expected_steady;
  std::printf("%s (%lld parameters, %s moments): built in %.1f s, %d step(s) in %.1f s\n", config_path.c_str(),
              static_cast<long long>(plan.params), plan.state_dtype.c_str(), construct_s, steps, steps_s);
  std::printf("  start-up   %10.1f MB measured  %10.1f MB planned  ratio %.3f\n", start / 1e6, expected_start / 1e6,
              start_ratio);
  std::printf("  after step %10.1f MB measured  %10.1f MB planned  ratio %.3f  (%.1f MB before malloc_trim)\n",
              steady / 1e6, expected_steady / 1e6, steady_ratio, untrimmed / 1e6);
  std::printf(
      "{\"bench\":\"host_memory\",\"config\":\"%s\",\"params\":%lld,\"state_dtype\":\"%s\",\"host_state_bytes\":%lld,"
      "\"host_peak_bytes\":%lld,\"start_bytes\":%lld,\"start_planned_bytes\":%.0f,\"start_ratio\":%.4f,\"steady_"
      "bytes\":%lld,"
      "\"steady_planned_bytes\":%.0f,\"steady_ratio\":%.4f,\"steady_untrimmed_bytes\":%lld}\n",
      config_path.c_str(), static_cast<long long>(plan.params), plan.state_dtype.c_str(),
      static_cast<long long>(plan.host.state()), static_cast<long long>(plan.host.peak()),
      static_cast<long long>(start), expected_start, start_ratio, static_cast<long long>(steady), expected_steady,
      steady_ratio, static_cast<long long>(untrimmed));
  return std::abs(start_ratio - 1.0) <= 0.05 && std::abs(steady_ratio - 1.0) <= 0.05 ? 0 : 1;
}
