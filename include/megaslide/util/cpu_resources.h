// CPU resources: what this process can use of the host CPU, read from the hardware and the OS at run
// time rather than from the host's nominal size.
//
//   cpu_bf16_support()  whether the CPU does bf16 arithmetic natively — AVX512-BF16 or AMX-BF16, read with
//                       CPUID (the same checks that pick CpuAdamW's SIMD path), with the OS saving the
//                       registers they need — and whether LibTorch may use it: its CPU bf16 matrix products
//                       run in oneDNN, which the environment variable ONEDNN_MAX_CPU_ISA (or the older
//                       DNNL_MAX_CPU_ISA) can cap below these instructions. Without native bf16, oneDNN
//                       emulates bf16 products far more slowly than it runs fp32 ones (docs/training.md).
//   available_memory_bytes()  the host's physical memory, or its container's memory limit (cgroup v2
//                       memory.max, then v1 memory.limit_in_bytes) where that is lower; 0 when unknown.
//   available_cores()   the CPUs this process may run on: the CPUs in its affinity mask
//                       (sched_getaffinity), capped by the CPU-time quota of its cgroup and every ancestor
//                       (cgroup v2 cpu.max; cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us), rounded up.
//                       std::thread::hardware_concurrency() counts the host's CPUs, which a container or
//                       `taskset` may not grant.
//
// Neither looks at other processes' load: cores granted are not cores idle (docs/training.md measures
// what a loaded machine does to the thread counts chosen from them).
//
// Thread-safety: every function may be called from any thread; each call reads the hardware, the
// environment and /proc, /sys afresh.
#pragma once

#include <cstdint>
#include <string>

namespace megaslide {

struct CpuBf16Support {
  bool avx512_bf16 = false;  // CPUID: AVX512-BF16 (with AVX-512 F/BW/VL enabled by the OS)
  bool amx_bf16 = false;     // CPUID: AMX-BF16 and AMX-TILE, tile state enabled by the OS
  std::string onednn_cap;    // ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) as set, "" when unset
  bool native = false;       // LibTorch can run bf16 arithmetic natively: an instruction set above, not capped off
  // One line for logs, e.g. "AVX512-BF16", "no AVX512-BF16 or AMX-BF16",
  // "AVX512-BF16, but ONEDNN_MAX_CPU_ISA=AVX2 keeps LibTorch from it".
  std::string describe() const;
};

// This machine, now.
CpuBf16Support cpu_bf16_support();
// The decision from given facts (what cpu_bf16_support() does with CPUID's answers and the variable's
// value; "" = unset). Cap names are oneDNN's (case-insensitive): SSE41, AVX, AVX2, AVX2_VNNI, AVX2_VNNI_2,
// AVX512_CORE, AVX512_CORE_VNNI cap below both; AVX512_CORE_BF16 and AVX512_CORE_FP16 / AVX10_1_512 admit
// AVX512-BF16 only; AVX512_CORE_AMX and above, ALL and DEFAULT admit both. An unknown name caps nothing
// (oneDNN ignores it).
CpuBf16Support cpu_bf16_support(bool avx512_bf16, bool amx_bf16, const std::string& onednn_cap);

struct CoreCount {
  int cores = 1;           // what threads should be budgeted against: min(affinity_cpus, ceil(quota_cpus)), >= 1
  int affinity_cpus = 1;   // CPUs in the affinity mask
  double quota_cpus = 0;   // the tightest cgroup CPU quota in CPUs (quota / period); 0 when none is set
  std::string quota_file;  // the file that set it ("" when none)
  // One line for logs, e.g. "2 cores (affinity mask 2 CPUs, no cgroup CPU quota)".
  std::string describe() const;
};

// This process, now.
CoreCount available_cores();
int64_t available_memory_bytes();
// The cgroup quota part, from given files: `proc_self_cgroup` is the text of /proc/self/cgroup and
// `cgroup_root` the folder the cgroup file systems are mounted under ("/sys/fs/cgroup"). Walks from the
// process's cgroup up to the mount's root and keeps the smallest quota; a file that is missing or does
// not parse sets none. Fills quota_cpus and quota_file; cores and affinity_cpus come from `affinity_cpus`.
CoreCount available_cores(int affinity_cpus, const std::string& proc_self_cgroup, const std::string& cgroup_root);

}  // namespace megaslide
