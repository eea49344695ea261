#include "megaslide/train/auto_settings.h"

#include "megaslide/train/distributed.h"
#include "megaslide/util/device.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#ifdef MEGASLIDE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace megaslide {

namespace {

// GPUs below compute capability 8.0 have no bf16 arithmetic (LibTorch emulates it there).
bool gpu_has_bf16(c10::Device device) {
#ifdef MEGASLIDE_WITH_CUDA
  if (device.is_cuda()) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return true;  // a plan for a GPU elsewhere
    int index = device.has_index() ? device.index() : 0;
    if (!device.has_index() && cudaGetDevice(&index) != cudaSuccess) index = 0;
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index) != cudaSuccess) return true;
    return major >= 8;
  }
#endif
  (void)device;
  return true;
}

// Step-time ratio bf16 / fp32 of configs/small-50m.yaml (reduced to 1 block, batch 1) with LibTorch capped
// as on a CPU without AVX512-BF16 or AMX, on this project's 2-core machine, by benchmarks/cpu_step_times.sh:
// 5.8x with oneDNN capped (ONEDNN_MAX_CPU_ISA=AVX2), 5.3x with ATen's kernels capped too
// (ATEN_CPU_CAPABILITY=avx2) (docs/training.md, "Compute dtype and threads").
constexpr const char* kMeasuredEmulatedBf16Slowdown = "5-6x";

}  // namespace

ComputeDtypeChoice resolve_compute_dtype(const std::string& requested, c10::Device device, bool gpu_bf16,
                                         const CpuBf16Support& cpu) {
  if (requested != "auto") return {requested, "as configured"};
  if (device.is_cuda()) {
    if (gpu_bf16) return {"bf16", "auto: the GPU does bf16 arithmetic"};
    return {"fp16", "auto: the GPU has no bf16 arithmetic (compute capability below 8.0)"};
  }
  if (cpu.native) return {"bf16", "auto: the CPU has " + cpu.describe()};
  return {"fp32", "auto: the CPU has " + cpu.describe() + ", so bf16 would be emulated"};
}

ComputeDtypeChoice resolve_compute_dtype(const std::string& requested, c10::Device device) {
  if (requested != "auto") return {requested, "as configured"};
  return resolve_compute_dtype(requested, device, gpu_has_bf16(device),
                               device.is_cuda() ? CpuBf16Support{} : cpu_bf16_support());
}

c10::Device device_kind(const std::string& spec) {
  if (spec == "cpu") return c10::kCPU;
  if (spec == "auto") return resolve_device(spec);
  return c10::Device(spec);  // "cuda" or "cuda:N"; validated by the config; not required to exist here
}

RunConfig resolve_auto_settings(const RunConfig& config) {
  // The resident reference loop computes in fp32 (unused_settings warns of a bf16 or fp16 the config gives it).
  if (!config.offload.enabled && config.offload.compute_dtype == "auto") {
    RunConfig resolved = config;
    resolved.offload.compute_dtype = "fp32";
    return resolved;
  }
  if (config.offload.compute_dtype != "auto") return config;
  RunConfig resolved = config;
  resolved.offload.compute_dtype = resolve_compute_dtype("auto", device_kind(config.train.device)).dtype;
  return resolved;
}

std::string compute_dtype_warning(const std::string& dtype, c10::Device device, const std::string& how_to_switch,
                                  const CpuBf16Support& cpu) {
  if (dtype != "bf16" || !device.is_cpu() || cpu.native) return "";
  return fmt::format(
      "bf16 compute on a CPU without native bf16 arithmetic ({}): LibTorch emulates bf16 matrix products, and a "
      "training step measured {} slower than in fp32 on such a CPU (docs/training.md); {}",
      cpu.describe(), kMeasuredEmulatedBf16Slowdown, how_to_switch);
}

std::string compute_dtype_warning(const std::string& dtype, c10::Device device, const std::string& how_to_switch) {
  if (dtype != "bf16" || !device.is_cpu()) return "";
  return compute_dtype_warning(dtype, device, how_to_switch, cpu_bf16_support());
}

std::string ThreadPlan::describe() const {
  std::string s = fmt::format("threads: LibTorch intra-op {} ({})", intra_op, intra_op_source);
  if (optimizer > 0)
    s += fmt::format(", CpuAdamW {} ({}; the host task thread is one of them)", optimizer, optimizer_source);
  s += ", from " + cores.describe();
  if (local_ranks > 1) s += fmt::format(": this rank's share of the machine, which {} local ranks share", local_ranks);
  return s;
}

ThreadPlan plan_threads(const ThreadRequest& request, const CoreCount& cores, const std::string& omp_num_threads) {
  ThreadPlan plan;
  plan.cores = cores;
  const int C = std::max(1, cores.cores);
  int omp = 0;
  if (!omp_num_threads.empty()) omp = std::atoi(omp_num_threads.c_str());  // "4" or a list "4,2": the first level
  if (request.host_optimizer) {
    if (request.optimizer > 0) {
      plan.optimizer = request.optimizer, plan.optimizer_source = "offload.optimizer_threads";
    } else {
      plan.optimizer = request.device.is_cuda() ? std::max(1, C - 1) : 1;
      plan.optimizer_source = "auto";
    }
  }
  if (request.intra_op > 0) {
    plan.intra_op = request.intra_op, plan.intra_op_source = request.intra_op_from;
  } else if (omp > 0) {
    plan.intra_op = omp, plan.intra_op_source = "OMP_NUM_THREADS", plan.set_intra_op = false;
  } else {
    plan.intra_op = request.host_optimizer && request.device.is_cuda() ? std::max(1, C - plan.optimizer) : C;
    plan.intra_op_source = "auto";
  }
  return plan;
}

ThreadPlan plan_threads(const RunConfig& config, c10::Device device) {
  ThreadRequest request;
  request.intra_op = static_cast<int>(config.train.threads);
  request.optimizer = static_cast<int>(config.offload.optimizer_threads);
  request.host_optimizer = config.offload.enabled;
  request.device = device;
  const char* omp = std::getenv("OMP_NUM_THREADS");
  CoreCount cores = available_cores();
  int64_t local_ranks = 1;
  try {
    local_ranks = read_launch_env().local_world_size;
  } catch (const DistributedError&) {
    // A launch environment that does not parse is refused where the run starts; here: one rank.
  }
  if (local_ranks > 1) cores.cores = std::max<int>(1, cores.cores / static_cast<int>(local_ranks));
  ThreadPlan plan = plan_threads(request, cores, omp ? omp : "");
  plan.local_ranks = static_cast<int>(std::max<int64_t>(1, local_ranks));
  return plan;
}

void apply_threads(const ThreadPlan& plan) {
  if (plan.set_intra_op && at::get_num_threads() != plan.intra_op) at::set_num_threads(plan.intra_op);
}

}  // namespace megaslide
