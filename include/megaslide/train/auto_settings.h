// Auto settings: the compute dtype and the thread counts a run uses, chosen for the machine it runs on
// (docs/training.md, "Compute dtype and threads").
//
//   compute dtype "auto"  a GPU: bf16, or fp16 on a GPU without bf16 arithmetic (compute capability
//                         below 8.0); the CPU: bf16 where LibTorch can do bf16 arithmetic natively
//                         (util/cpu_resources.h: AVX512-BF16 or AMX-BF16), fp32 everywhere else —
//                         LibTorch emulates bf16 matrix products on other CPUs, many times slower than
//                         fp32 (measured in docs/training.md). resolve_auto_settings writes the result
//                         into the config once, before anything uses it: the run's config.yaml, train.log,
//                         --dry-run and checkpoints carry the resolved dtype, and a resume compares the
//                         resolved dtypes (another one is refused, naming both; not where either side is the
//                         resident loop). An explicit bf16 on a CPU without native bf16 runs as asked, with
//                         compute_dtype_warning's one line. The resident loop (offload.enabled: false)
//                         computes in fp32: `auto` resolves to fp32 for it.
//   threads               train.threads (LibTorch intra-op threads) and offload.optimizer_threads
//                         (CpuAdamW's pool, the streamed trainer's host task thread being one of its
//                         workers) at 0 are budgeted from util::available_cores() — the affinity mask and
//                         the cgroup quota, not the host's core count — so that the threads busy at one
//                         time do not outnumber the cores (plan_threads says how). Explicit values win;
//                         OMP_NUM_THREADS, when set, stands for an explicit train.threads.
//
// Thread-safety: the functions read the hardware and the environment; apply_threads sets LibTorch's
// process-wide intra-op thread count (call it from the thread that drives LibTorch, before its work).
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "megaslide/config/run_config.h"
#include "megaslide/util/cpu_resources.h"

namespace megaslide {

struct ComputeDtypeChoice {
  std::string dtype;   // "bf16" | "fp16" | "fp32"
  std::string reason;  // for logs, e.g. "auto: the CPU has no AVX512-BF16 or AMX-BF16", "as configured"
};

// `requested` is "auto", "bf16", "fp16" or "fp32"; anything but "auto" is returned as it is.
ComputeDtypeChoice resolve_compute_dtype(const std::string& requested, c10::Device device);

// The same decision from given facts (what resolve_compute_dtype does with the device's): on a CUDA
// device `gpu_has_bf16` decides, on the CPU `cpu.native`.
ComputeDtypeChoice resolve_compute_dtype(const std::string& requested, c10::Device device, bool gpu_has_bf16,
                                         const CpuBf16Support& cpu);

// The device a train.device spec names, for choosing settings: "auto" resolves (resolve_device), "cuda"
// and "cuda:N" need not exist on this machine (a dry run may describe a GPU run elsewhere).
c10::Device device_kind(const std::string& spec);

// `config` with offload.compute_dtype resolved for device_kind(train.device). Idempotent.
RunConfig resolve_auto_settings(const RunConfig& config);

// One line when `dtype` is a poor choice on `device` ("" otherwise): bf16 on a CPU without native bf16,
// with the slowdown measured on such a CPU and `how_to_switch`, e.g. "set offload.compute_dtype: auto".
std::string compute_dtype_warning(const std::string& dtype, c10::Device device, const std::string& how_to_switch);
std::string compute_dtype_warning(const std::string& dtype, c10::Device device, const std::string& how_to_switch,
                                  const CpuBf16Support& cpu);

struct ThreadRequest {
  int intra_op = 0;             // LibTorch intra-op threads; 0 = auto
  int optimizer = 0;            // CpuAdamW threads; 0 = auto (used when host_optimizer)
  bool host_optimizer = false;  // CpuAdamW runs beside the compute (the streamed trainer)
  c10::Device device = c10::kCPU;
  std::string intra_op_from = "train.threads";  // where intra_op came from, for the log (a tool's flag)
};

struct ThreadPlan {
  CoreCount cores;
  int intra_op = 1;              // LibTorch intra-op threads
  std::string intra_op_source;   // "train.threads", "OMP_NUM_THREADS" or "auto"
  int optimizer = 0;             // CpuAdamW threads (0 without a host optimizer)
  std::string optimizer_source;  // "offload.optimizer_threads" or "auto"
  bool set_intra_op = true;      // false when OMP_NUM_THREADS decides (LibTorch already honours it)
  int local_ranks = 1;           // ranks of one run on this machine, sharing its cores (cores is one's share)
  // One line for train.log, e.g. "threads: LibTorch intra-op 2 (auto), CpuAdamW 1 (auto), from 2 cores
  // (affinity mask 2 CPUs, no cgroup CPU quota)".
  std::string describe() const;
};

// The budget (auto values; explicit ones are kept as they are):
//   no host optimizer     intra-op = cores.
//   host optimizer, CPU   intra-op = cores, CpuAdamW 1: the compute is nearly all of a CPU step, and the
//                         optimizer is bound by memory bandwidth, which one thread nearly fills
//                         (docs/cpu-adamw.md); it overlaps the compute briefly, one thread over the cores.
//   host optimizer, GPU   CpuAdamW = cores − 1 (one core is left to the thread driving the GPU), intra-op =
//                         cores − CpuAdamW (≥ 1): LibTorch's CPU work (the data pipeline) runs while
//                         deferred updates are still going.
// `omp_num_threads` is the OMP_NUM_THREADS value ("" = unset).
ThreadPlan plan_threads(const ThreadRequest& request, const CoreCount& cores, const std::string& omp_num_threads);
// For a run config's trainer on `device`, with this process's available_cores() and environment. When
// the launcher says several ranks run on this machine (LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE:
// train/distributed.h), each budgets its share of the cores, cores / ranks (at least 1).
ThreadPlan plan_threads(const RunConfig& config, c10::Device device);
// Sets LibTorch's intra-op thread count to plan.intra_op (unless OMP_NUM_THREADS decides).
void apply_threads(const ThreadPlan& plan);

}  // namespace megaslide
