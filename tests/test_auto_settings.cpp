// train/auto_settings.h: what `offload.compute_dtype: auto` resolves to on each kind of device, the
// warning for bf16 on a CPU without native bf16, and the thread budget from the cores available.
#include "megaslide/train/auto_settings.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

using namespace megaslide;

namespace {
const CpuBf16Support kNative = cpu_bf16_support(true, false, "");
const CpuBf16Support kEmulated = cpu_bf16_support(false, false, "");

CoreCount cores(int n) {
  CoreCount c;
  c.cores = c.affinity_cpus = n;
  return c;
}
}  // namespace

TEST(AutoSettings, AutoComputeDtypeIsWhatTheDeviceRunsFast) {
  const c10::Device cpu(c10::kCPU), gpu(c10::kCUDA, 0);
  EXPECT_EQ(resolve_compute_dtype("auto", cpu, true, kNative).dtype, "bf16");
  EXPECT_EQ(resolve_compute_dtype("auto", cpu, true, kEmulated).dtype, "fp32");
  EXPECT_EQ(resolve_compute_dtype("auto", cpu, true, cpu_bf16_support(true, false, "AVX2")).dtype, "fp32");
  EXPECT_EQ(resolve_compute_dtype("auto", gpu, true, kEmulated).dtype, "bf16") << "the CPU does not matter on a GPU";
  EXPECT_EQ(resolve_compute_dtype("auto", gpu, false, kNative).dtype, "fp16") << "a GPU without bf16";
  for (const char* explicit_dtype : {"bf16", "fp16", "fp32"}) {
    for (const auto& device : {cpu, gpu}) {
      const auto choice = resolve_compute_dtype(explicit_dtype, device, false, kEmulated);
      EXPECT_EQ(choice.dtype, explicit_dtype) << "explicit settings win";
      EXPECT_EQ(choice.reason, "as configured");
    }
  }
  EXPECT_NE(resolve_compute_dtype("auto", cpu, true, kEmulated).reason.find("no AVX512-BF16 or AMX-BF16"),
            std::string::npos);
}

TEST(AutoSettings, ResolvingAConfigWritesTheConcreteDtypeOnceAndIsIdempotent) {
  RunConfig c;
  c.train.device = "cpu";
  ASSERT_EQ(c.offload.compute_dtype, "auto") << "the shipped default";
  const RunConfig r = resolve_auto_settings(c);
  EXPECT_EQ(r.offload.compute_dtype, cpu_bf16_support().native ? "bf16" : "fp32");
  EXPECT_EQ(resolve_auto_settings(r).offload.compute_dtype, r.offload.compute_dtype);
  EXPECT_EQ(to_yaml(resolve_auto_settings(r)), to_yaml(r)) << "nothing else changes";
  c.offload.compute_dtype = "fp16";
  EXPECT_EQ(resolve_auto_settings(c).offload.compute_dtype, "fp16");
  // A GPU run described on a machine without one (a dry run of a GPU config) resolves as on a GPU.
  c.offload.compute_dtype = "auto";
  c.train.device = "cuda:3";
  const auto gpu = resolve_auto_settings(c).offload.compute_dtype;
  EXPECT_TRUE(gpu == "bf16" || gpu == "fp16") << gpu;
}

TEST(AutoSettings, Bf16OnACpuWithoutNativeBf16WarnsOnceWithTheMeasuredFactorAndTheSwitch) {
  const c10::Device cpu(c10::kCPU), gpu(c10::kCUDA, 0);
  const std::string w = compute_dtype_warning("bf16", cpu, "set offload.compute_dtype: auto", kEmulated);
  EXPECT_NE(w.find("set offload.compute_dtype: auto"), std::string::npos) << w;
  EXPECT_NE(w.find("x slower than in fp32"), std::string::npos) << w;
  EXPECT_EQ(w.find("0x slower"), std::string::npos) << "a measured factor, not a placeholder: " << w;
  EXPECT_EQ(w.find('\n'), std::string::npos) << "one line";
  EXPECT_EQ(compute_dtype_warning("bf16", cpu, "x", kNative), "");
  EXPECT_EQ(compute_dtype_warning("fp32", cpu, "x", kEmulated), "");
  EXPECT_EQ(compute_dtype_warning("bf16", gpu, "x", kEmulated), "");
}

TEST(AutoSettings, ThreadBudgetFromTheCoresAvailable) {
  const c10::Device cpu(c10::kCPU), gpu(c10::kCUDA, 0);
  // Streamed trainer on the CPU: the compute gets every core, CpuAdamW one thread.
  auto p = plan_threads(ThreadRequest{0, 0, true, cpu}, cores(2), "");
  EXPECT_EQ(p.intra_op, 2);
  EXPECT_EQ(p.optimizer, 1);
  EXPECT_TRUE(p.set_intra_op);
  EXPECT_EQ(p.intra_op_source, "auto");
  // On a GPU the host runs the optimizer: all cores but the one driving the GPU; LibTorch gets the rest.
  p = plan_threads(ThreadRequest{0, 0, true, gpu}, cores(16), "");
  EXPECT_EQ(p.optimizer, 15);
  EXPECT_EQ(p.intra_op, 1);
  EXPECT_LE(p.optimizer + p.intra_op, 16) << "no oversubscription";
  p = plan_threads(ThreadRequest{0, 0, true, gpu}, cores(1), "");
  EXPECT_EQ(p.optimizer, 1);
  EXPECT_EQ(p.intra_op, 1);
  // The resident loop: no host optimizer.
  p = plan_threads(ThreadRequest{0, 0, false, cpu}, cores(6), "");
  EXPECT_EQ(p.intra_op, 6);
  EXPECT_EQ(p.optimizer, 0);
  // Explicit settings win, and so does OMP_NUM_THREADS for the intra-op threads.
  p = plan_threads(ThreadRequest{1, 3, true, gpu}, cores(16), "8");
  EXPECT_EQ(p.intra_op, 1);
  EXPECT_EQ(p.intra_op_source, "train.threads");
  EXPECT_EQ(p.optimizer, 3);
  EXPECT_EQ(p.optimizer_source, "offload.optimizer_threads");
  p = plan_threads(ThreadRequest{0, 0, true, cpu}, cores(2), "1");
  EXPECT_EQ(p.intra_op, 1);
  EXPECT_EQ(p.intra_op_source, "OMP_NUM_THREADS");
  EXPECT_FALSE(p.set_intra_op) << "LibTorch already honours OMP_NUM_THREADS";
  // The cores come from the affinity mask and quota (CoreCount), not from the host.
  CoreCount limited = cores(16);
  limited.quota_cpus = 2.0;
  limited.cores = 2;
  EXPECT_EQ(plan_threads(ThreadRequest{0, 0, true, cpu}, limited, "").intra_op, 2);
  const std::string line = plan_threads(ThreadRequest{0, 0, true, cpu}, cores(2), "").describe();
  EXPECT_NE(line.find("LibTorch intra-op 2 (auto)"), std::string::npos) << line;
  EXPECT_NE(line.find("CpuAdamW 1 (auto"), std::string::npos) << line;
  EXPECT_NE(line.find("from 2 cores"), std::string::npos) << line;
}

TEST(AutoSettings, ApplyThreadsSetsLibTorchsIntraOpThreads) {
  const int before = at::get_num_threads();
  ThreadPlan plan;
  plan.intra_op = before == 1 ? 2 : 1;
  apply_threads(plan);
  EXPECT_EQ(at::get_num_threads(), plan.intra_op);
  plan.intra_op = before;
  plan.set_intra_op = false;  // OMP_NUM_THREADS decides: left alone
  apply_threads(plan);
  EXPECT_NE(at::get_num_threads(), before);
  plan.set_intra_op = true;
  apply_threads(plan);
  EXPECT_EQ(at::get_num_threads(), before);
}

// The property: ranks that a launcher puts on one machine (LOCAL_WORLD_SIZE) budget their share of its
// cores — two ranks on this machine each plan half of it (at least one), and say so.
TEST(AutoSettings, LocalRanksShareTheMachinesCores) {
  const auto config = parse_run_config("", "test", {"train.device=cpu", "offload.enabled=false"});
  const int all = plan_threads(config, c10::kCPU).cores.cores;
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string saved_omp = omp ? omp : "";
  ::unsetenv("OMP_NUM_THREADS");
  const auto shared = plan_threads(config, c10::kCPU);
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"}) ::unsetenv(name);
  if (!saved_omp.empty()) ::setenv("OMP_NUM_THREADS", saved_omp.c_str(), 1);
  EXPECT_EQ(shared.local_ranks, 2);
  EXPECT_EQ(shared.cores.cores, std::max(1, all / 2));
  EXPECT_EQ(shared.intra_op, std::max(1, all / 2));
  EXPECT_NE(shared.describe().find("2 local ranks"), std::string::npos) << shared.describe();
  EXPECT_EQ(plan_threads(config, c10::kCPU).local_ranks, 1);
}
