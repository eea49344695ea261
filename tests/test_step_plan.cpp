// The planner (plan/step_plan.h, plan/hardware_profile.h) and megaslide-plan: byte counts against
// closed forms and against what the streamed trainer allocates and measures on the CPU, the 105 B
// config's size, the time bound's arithmetic, the advice, hardware profile errors and the CLI.
#include "megaslide/plan/step_plan.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <tuple>

#include "megaslide/io/files.h"
#include "megaslide/model/lora.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/wan_weights.h"
#include "trainers.h"
#include "run_tool.h"

using namespace megaslide::testing;

using namespace megaslide;
using megaslide::plan::HardwareProfile;
using megaslide::plan::HardwareProfileError;

namespace {

// The NVMe traffic of `steps` steps against the plan's per-step figures: every dirty state is written back, so
// the writes are exact; a block whose next acquire arrives while its write-back is still queued keeps its state
// in the slot and skips that read (the pager's urgent path), so the reads are exact only when the I/O thread
// keeps up — they are at least the first step's (every state read once) and at most the plan's.
void expect_nvme_traffic(const megaslide::offload::HostParamStore::NvmeStats& before,
                         const megaslide::offload::HostParamStore::NvmeStats& after, const megaslide::plan::StepPlan& p,
                         int64_t steps, const std::string& name) {
  EXPECT_EQ(after.write_bytes - before.write_bytes, steps * p.nvme_write_bytes) << name;
  EXPECT_LE(after.read_bytes - before.read_bytes, steps * p.nvme_read_bytes) << name;
  EXPECT_GE(after.read_bytes - before.read_bytes, p.nvme_read_bytes) << name;
}

// 4 frames of 8x8 (64 tokens per clip), hidden 16: a trainer step takes milliseconds on the CPU. bf16
// compute unless a case says otherwise: a plan resolves `auto` as on a GPU (bf16), a CPU trainer as the
// CPU runs fast, so the two are compared at a dtype both use.
RunConfig tiny_run(std::vector<std::string> extra = {}) {
  std::vector<std::string> s{"offload.compute_dtype=bf16",
                             "model.layers=3",
                             "model.dsa_kernel=[3,3,3]",
                             "model.swin_window=[2,2,2]",
                             "data.frames=4",
                             "data.height=8",
                             "data.width=8",
                             "data.num_clips=16",
                             "train.batch_size=2",
                             "train.warmup_steps=1",
                             "train.device=cpu",
                             "train.threads=1",
                             "offload.optimizer_threads=1"};
  for (auto& e : extra) s.push_back(e);
  return parse_run_config("", "test", s);
}

HardwareProfile h200() { return plan::load_hardware_profile("h200"); }

std::string source_path(const std::string& relative) { return std::string(MEGASLIDE_SOURCE_DIR) + "/" + relative; }

// A scratch file under the build folder, removed at the end of the test.
struct ScratchFile {
  std::string path;
  ScratchFile(const std::string& name, const std::string& text)
      : path(std::string(MEGASLIDE_BINARY_DIR) + "/test_step_plan_" + name) {
    io::write_file_atomically(path, text);
  }
  ~ScratchFile() { std::remove(path.c_str()); }
};

const char* kValidProfile =
    "name: lab\ndevice_memory_bytes: 80000000000\npeak_bf16_tflops: 400\npcie_h2d_gbps: 25\npcie_d2h_gbps: 20\n"
    "host_dram_gbps: 150\nhost_memory_bytes: 512000000000\n";

}  // namespace

// Property: with A micro-batches of L equal blocks of P_b parameters and e bytes per compute element,
// uploads are (2L - 2)·P_b·e for the first micro-batch (the backward finds blocks L-1 and L-2 in the
// slots) and (2L - 4)·P_b·e for each later one (its forward also finds blocks 0 and 1), one block
// when L = 1; downloads are A·L·P_b·e. P_b comes from count_dit_parameters, independent of the plan.
TEST(StepPlan, PcieBytesFollowTheClosedForm) {
  for (int64_t L : {1, 2, 3, 5}) {
    for (int64_t A : {1, 2, 3}) {
      for (const char* dtype : {"bf16", "fp32"}) {
        const auto config =
            tiny_run({"model.layers=" + std::to_string(L), "train.grad_accum_steps=" + std::to_string(A),
                      std::string("offload.compute_dtype=") + dtype});
        const int64_t e = std::string(dtype) == "fp32" ? 4 : 2;
        const int64_t Pb = count_dit_parameters(DiTOptions::from_config(config)).per_block;
        const auto p = plan::plan_step(config, h200());
        const int64_t uploads = L == 1 ? 1 : (2 * L - 2) + (A - 1) * (2 * L - 4);
        EXPECT_EQ(p.transfer.h2d_bytes, uploads * Pb * e) << "L=" << L << " A=" << A << " " << dtype;
        EXPECT_EQ(p.transfer.d2h_bytes, A * L * Pb * e) << "L=" << L << " A=" << A << " " << dtype;
        EXPECT_EQ(p.params_per_block, Pb);
        EXPECT_EQ(p.streamed_params, L * Pb);
      }
    }
  }
}

// Property: host state is 4 + 4 + 4 + 2 = 14 B per streamed parameter with fp32 moments (fp32 master,
// m, v and a 16-bit transfer buffer that also takes the gradient: no gradient buffer at accumulation
// 1), 10 with bf16 moments, 8 + 8/256 per parameter of whole groups with int8 moments; accumulation
// adds a 4 B fp32 gradient and two staging blocks in the compute dtype; only the transfer buffer and
// the staging are pinned; the start-up peak is the state plus two blocks' fp32 initial weights; the
// host optimizer moves 28 B per parameter (docs/cpu-adamw.md) with fp32 moments and bf16 compute, 20
// with bf16 moments, 16 (plus the scales) with int8.
TEST(StepPlan, HostBytesFollowTheClosedForm) {
  const auto one = plan::plan_step(tiny_run(), h200());
  const int64_t P = one.streamed_params, Pb = one.params_per_block;
  EXPECT_EQ(one.host.master, 4 * P);
  EXPECT_EQ(one.host.exp_avg, 4 * P);
  EXPECT_EQ(one.host.exp_avg_sq, 4 * P);
  EXPECT_EQ(one.host.compute, 2 * P);
  EXPECT_EQ(one.host.grad, 0);
  EXPECT_EQ(one.host.scales, 0);
  EXPECT_EQ(one.host.state(), 14 * P);
  EXPECT_EQ(one.host.staging, 0);
  EXPECT_EQ(one.host.pinned, 2 * P);
  EXPECT_EQ(one.host.construction_peak, 14 * P + 2 * 4 * Pb);
  EXPECT_EQ(one.host.peak(), one.host.construction_peak);
  EXPECT_EQ(one.time.optimizer_bytes, 28 * P);
  const auto bf16 = plan::plan_step(tiny_run({"optimizer.state_dtype=bf16"}), h200());
  EXPECT_EQ(bf16.host.state(), 10 * P);
  EXPECT_EQ(bf16.time.optimizer_bytes, 20 * P);
  const auto int8 = plan::plan_step(tiny_run({"optimizer.state_dtype=int8"}), h200());
  EXPECT_GE(int8.host.scales, 2 * 4 * P / 256);
  EXPECT_EQ(int8.host.state(), 8 * P + int8.host.scales);
  EXPECT_EQ(int8.time.optimizer_bytes, 16 * P + 2 * int8.host.scales);
  const auto accum = plan::plan_step(tiny_run({"train.grad_accum_steps=2"}), h200());
  EXPECT_EQ(accum.host.grad, 4 * P);
  EXPECT_EQ(accum.host.state(), 18 * P);
  EXPECT_EQ(accum.host.staging, 2 * Pb * 2);
  EXPECT_EQ(accum.host.pinned, 2 * P + 2 * Pb * 2);
  // The EMA of the weights: 4 B a streamed parameter on the host and one pass of 12 B (read master and
  // EMA, write EMA); the resident parts keep 20 B a parameter on the device instead of 16.
  const auto ema = plan::plan_step(tiny_run({"train.ema_decay=0.999"}), h200());
  EXPECT_TRUE(ema.ema);
  EXPECT_EQ(ema.host.ema, 4 * P);
  EXPECT_EQ(ema.host.state(), 18 * P);
  EXPECT_EQ(ema.time.optimizer_bytes, 40 * P);
  EXPECT_EQ(ema.device.resident_state / 20, one.device.resident_state / 16);
  EXPECT_NE(plan::to_table(ema).find("fp32 EMA of the weights"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(plan::to_json(ema)).at("host_ema_bytes"), 4 * P);
}

// Property: the plan's PCIe bytes, host store components, parameter split and the device components
// the trainer accounts on the CPU (slots + resident state + checkpoints) equal what the streamed Trainer
// allocates and measures, step after step, for one and several micro-batches, bf16/fp16/fp32 compute,
// immediate and deferred updates, and each architecture. The plan's device peak adds the modelled
// activations, so it must exceed that accounting.
TEST(StepPlan, MatchesWhatTheStreamedTrainerMeasures) {
  const std::vector<std::vector<std::string>> variants{
      {},
      {"train.grad_clip=0"},
      {"train.grad_accum_steps=2"},
      {"offload.compute_dtype=fp32", "model.layers=2"},
      {"offload.compute_dtype=fp16", "train.loss_scale_init=1"},
      {"model.arch=dense3d", "train.grad_accum_steps=3"},
      {"model.arch=swin", "model.layers=1"},
      {"optimizer.state_dtype=int8", "train.grad_clip=0"},
      {"optimizer.state_dtype=bf16", "train.grad_accum_steps=2"},
      {"offload.mode=sync"},
      {"offload.state_tier=nvme", "offload.nvme_dir=/tmp"},
      {"offload.state_tier=nvme", "offload.nvme_dir=/tmp", "optimizer.state_dtype=int8", "train.ema_decay=0.9",
       "train.grad_accum_steps=2", "offload.nvme_blocks_in_flight=3"}};
  for (const auto& v : variants) {
    const auto config = tiny_run(v);
    std::string name;
    for (const auto& s : v) name += s + " ";
    const auto p = plan::plan_step(config, h200());
    Trainer trainer = streamed_trainer(config);
    EXPECT_EQ(p.streamed_params, trainer.engine()->streamed_parameter_count()) << name;
    EXPECT_EQ(p.resident_params, trainer.engine()->resident_parameter_count()) << name;
    const auto report = trainer.engine()->store().memory_report();
    EXPECT_EQ(p.host.master, report.master_bytes) << name;
    EXPECT_EQ(p.host.exp_avg, report.exp_avg_bytes) << name;
    EXPECT_EQ(p.host.exp_avg_sq, report.exp_avg_sq_bytes) << name;
    EXPECT_EQ(p.host.compute, report.compute_bytes) << name;
    EXPECT_EQ(p.host.grad, report.grad_bytes) << name;
    EXPECT_EQ(p.host.scales, report.scale_bytes) << name;
    EXPECT_EQ(p.host.state(), report.total_bytes()) << name;
    EXPECT_EQ(p.host.pinned, report.pinnable_bytes + p.host.staging) << name;
    EXPECT_EQ(p.device.weight_slots, trainer.engine()->streamer().device_weight_bytes()) << name;
    EXPECT_EQ(p.device.gradient_slots, trainer.engine()->streamer().device_gradient_bytes()) << name;
    // The NVMe tier: the file and the buffers the store allocates; each step reads and writes back every region.
    EXPECT_EQ(p.nvme_file_bytes, report.nvme_bytes) << name;
    EXPECT_EQ(p.host.nvme_buffers, report.nvme_buffer_bytes) << name;
    EXPECT_EQ(p.state_tier, report.state_tier == offload::StateTier::kNvme ? "nvme" : "ram") << name;
    const auto before = trainer.engine()->store().nvme_stats();
    for (int step = 0; step < 2; ++step) {
      const auto m = trainer.step();
      ASSERT_FALSE(m.skipped) << name;
      EXPECT_EQ(p.transfer.h2d_bytes, m.h2d_bytes) << name << "step " << step;
      EXPECT_EQ(p.transfer.d2h_bytes, m.d2h_bytes) << name << "step " << step;
      EXPECT_EQ(p.device.trainer_cpu_accounting(), m.peak_device_bytes) << name << "step " << step;
      EXPECT_GT(p.device.peak(), m.peak_device_bytes) << name;
    }
    trainer.synchronize();
    const auto after = trainer.engine()->store().nvme_stats();
    expect_nvme_traffic(before, after, p, 2, name);
  }
}

// Property: the 105 B config plans to the parameter count the model reports (about 105 B) and 14 B of
// host state per streamed parameter, which is 13.9–14 B per parameter of the whole DiT (the resident
// prologue/epilogue live on the device); the start-up peak is within two blocks of the steady state;
// the targets per parameter hold: <= 14.2 (fp32 moments), <= 10.2 (bf16), <= 8.2 (int8), and the
// steady state fits 1.5 TB.
TEST(StepPlan, The105BConfigHas105BParametersAnd14BytesPerParameter) {
  const auto config = load_run_config(source_path("configs/105b.yaml"));
  const auto p = plan::plan_step(config, h200());
  EXPECT_EQ(p.params, count_dit_parameters(DiTOptions::from_config(config)).total);
  EXPECT_NEAR(static_cast<double>(p.params) / 1e9, 105.0, 1.0);
  EXPECT_EQ(p.host.state(), 14 * p.streamed_params);
  const double per_param = static_cast<double>(p.host.steady()) / static_cast<double>(p.params);
  EXPECT_GT(per_param, 13.9);
  EXPECT_LE(per_param, 14.0);
  EXPECT_LE(p.host.steady(), 1500e9);
  EXPECT_LE(p.host.peak(), p.host.steady() + 2 * 14 * p.params_per_block);
  for (auto [dtype, bound] : {std::pair{"bf16", 10.2}, std::pair{"int8", 8.2}}) {
    RunConfig c = config;
    c.optimizer.state_dtype = dtype;
    const auto q = plan::plan_step(c, h200());
    EXPECT_LE(static_cast<double>(q.host.steady()) / static_cast<double>(q.params), bound) << dtype;
  }
}

// Property: the bound is the largest term in async mode and their sum in sync mode, the bottleneck
// names the largest term, each transfer term is bytes / bandwidth, model FLOPs are the trainer's MFU
// numerator, and the recompute makes the executed FLOPs larger.
TEST(StepPlan, TimeBoundIsTheLargestTermOrTheSum) {
  const auto hw = h200();
  for (const char* mode : {"async", "sync"}) {
    const auto config = tiny_run({std::string("offload.mode=") + mode});
    const auto p = plan::plan_step(config, hw);
    const auto& t = p.time;
    EXPECT_DOUBLE_EQ(t.h2d_s, static_cast<double>(p.transfer.h2d_bytes) / (hw.pcie_h2d_gbps * 1e9));
    EXPECT_DOUBLE_EQ(t.d2h_s, static_cast<double>(p.transfer.d2h_bytes) / (hw.pcie_d2h_gbps * 1e9));
    EXPECT_DOUBLE_EQ(t.optimizer_s, static_cast<double>(t.optimizer_bytes) / (hw.host_dram_gbps * 1e9));
    EXPECT_DOUBLE_EQ(t.compute_s, t.executed_flops / (hw.peak_bf16_tflops * 1e12));
    EXPECT_DOUBLE_EQ(t.model_flops, model_flops_per_step(config));
    EXPECT_GT(t.executed_flops, t.model_flops);
    const double largest = std::max({t.compute_s, t.h2d_s, t.d2h_s, t.optimizer_s});
    if (std::string(mode) == "async") {
      EXPECT_DOUBLE_EQ(t.lower_bound_s, largest);
    } else {
      EXPECT_DOUBLE_EQ(t.lower_bound_s, t.compute_s + t.h2d_s + t.d2h_s + t.optimizer_s);
    }
    const double named = t.bottleneck == "compute" ? t.compute_s
                         : t.bottleneck == "h2d"   ? t.h2d_s
                         : t.bottleneck == "d2h"   ? t.d2h_s
                                                   : t.optimizer_s;
    EXPECT_EQ(named, largest) << t.bottleneck;
  }
}

// Property: device memory grows with frames for every architecture; the fused 3D-DSA needs less than
// the grid_sample reference; and every change the advice names for a run that does not fit, applied,
// makes it fit.
TEST(StepPlan, DeviceMemoryGrowsWithFramesAndTheAdviceFits) {
  for (const char* arch : {"megaslide", "dense3d", "swin"}) {
    int64_t previous = 0;
    for (int64_t frames : {4, 8, 16}) {
      const auto p = plan::plan_step(
          tiny_run({std::string("model.arch=") + arch, "data.frames=" + std::to_string(frames)}), h200());
      EXPECT_GT(p.device.peak(), previous) << arch << " frames " << frames;
      previous = p.device.peak();
    }
  }
  const auto dsa = plan::plan_step(tiny_run(), h200());
  EXPECT_GT(dsa.device.recompute_saved_reference, dsa.device.recompute_saved);

  const auto config = load_run_config(source_path("configs/105b.yaml"));
  const auto p = plan::plan_step(config, h200());
  ASSERT_FALSE(p.fits_device);
  int checked = 0;
  for (const auto& a : p.advice) {
    const auto at = a.find("data.frames=");
    if (a.rfind("device: fewer frames", 0) != 0 || at == std::string::npos) continue;
    const std::string frames = a.substr(at + 12, a.find(' ', at) - at - 12);
    const auto smaller =
        plan::plan_step(load_run_config(source_path("configs/105b.yaml"), {"data.frames=" + frames}), h200());
    EXPECT_TRUE(smaller.fits_device) << a;
    const auto one_more = plan::plan_step(
        load_run_config(source_path("configs/105b.yaml"), {"data.frames=" + std::to_string(std::stoll(frames) + 1)}),
        h200());
    EXPECT_FALSE(one_more.fits_device) << a << ": it was not the largest that fits";
    ++checked;
  }
  EXPECT_EQ(checked, 1);
}

// Property: the shipped profiles load by name and are the files in configs/hardware; a file with a
// missing, unknown, non-numeric, non-positive or fractional-byte key is refused with a message naming
// the file and the key; a name that is no built-in but a folder here is refused as a folder.
TEST(HardwareProfile, BuiltInsAreTheShippedFilesAndBadFilesAreNamed) {
  EXPECT_EQ(plan::builtin_hardware_profiles(), (std::vector<std::string>{"h100nvl", "h200", "hgx-h200", "rtx4090",
                                                                         "workstation-24gb", "workstation-48gb"}));
  for (const auto& name : plan::builtin_hardware_profiles()) {
    const auto builtin = plan::load_hardware_profile(name);
    const auto file = plan::load_hardware_profile(source_path("configs/hardware/" + name + ".yaml"));
    EXPECT_EQ(builtin.name, name);
    EXPECT_EQ(builtin.device_memory_bytes, file.device_memory_bytes);
    EXPECT_EQ(builtin.host_memory_bytes, file.host_memory_bytes);
    EXPECT_EQ(builtin.pcie_h2d_gbps, file.pcie_h2d_gbps);
    EXPECT_EQ(builtin.host_dram_gbps, file.host_dram_gbps);
    EXPECT_EQ(builtin.peak_bf16_tflops, file.peak_bf16_tflops);
    EXPECT_EQ(builtin.nvme_gbps, file.nvme_gbps);
    EXPECT_EQ(builtin.nvme_bytes, file.nvme_bytes);
  }
  const auto workstation = plan::load_hardware_profile("workstation-24gb");
  EXPECT_EQ(workstation.nvme_gbps, 7.0);
  EXPECT_FALSE(workstation.nvme_gbps_assumed);
  EXPECT_TRUE(plan::load_hardware_profile("h200").nvme_gbps_assumed);
  const ScratchFile good("good.yaml", kValidProfile);
  const auto lab = plan::load_hardware_profile(good.path);
  EXPECT_EQ(lab.name, "lab");
  EXPECT_EQ(lab.pcie_d2h_gbps, 20.0);
  EXPECT_EQ(lab.device_memory_bytes, 80000000000);

  const std::string base(kValidProfile);
  const auto without = [&](const std::string& key) {
    const auto at = base.find(key + ":");
    return base.substr(0, at) + base.substr(base.find('\n', at) + 1);
  };
  const std::vector<std::pair<std::string, std::string>> bad{
      {without("pcie_h2d_gbps"), "pcie_h2d_gbps"},
      {base + "pcie_gbps: 3\n", "pcie_gbps"},
      {without("host_dram_gbps") + "host_dram_gbps: fast\n", "host_dram_gbps"},
      {without("peak_bf16_tflops") + "peak_bf16_tflops: -1\n", "peak_bf16_tflops"},
      {without("host_memory_bytes") + "host_memory_bytes: 1.5\n", "host_memory_bytes"},
      {"- just\n- a list\n", ""}};
  for (const auto& [text, key] : bad) {
    const ScratchFile f("bad.yaml", text);
    try {
      plan::load_hardware_profile(f.path);
      ADD_FAILURE() << "accepted a bad profile (" << key << ")";
    } catch (const HardwareProfileError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(f.path), std::string::npos) << what;
      EXPECT_NE(what.find(key), std::string::npos) << what;
    }
  }
  EXPECT_THROW(plan::load_hardware_profile("a100"), HardwareProfileError);
  EXPECT_THROW(plan::load_hardware_profile("/nonexistent/profile.yaml"), HardwareProfileError);
  // A name that is no built-in but exists here is read as the file it is: a folder is named as one (it was told to
  // "give its path").
  const std::string here = "megaslide-test-hw-" + std::to_string(::getpid());
  megaslide::io::make_directories(here);
  try {
    plan::load_hardware_profile(here);
    ADD_FAILURE() << "a folder was read as a profile";
  } catch (const HardwareProfileError& e) {
    EXPECT_NE(std::string(e.what()).find("is a folder"), std::string::npos) << e.what();
  }
  megaslide::io::remove_tree(here);
}

// Property: `megaslide-plan --json` prints one object with the keys docs/planner.md names, agreeing with the
// library; a bad --hardware file exits 2 naming the file and the key; a missing file or unknown name
// exits 2 naming it.
TEST(MegaslidePlanCli, JsonHasTheKeysAndBadHardwareIsRefused) {
  const auto r =
      megaslide::testing::run_tool("megaslide-plan", "--config " + source_path("configs/105b.yaml") + " --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  for (const char* key :
       {"params", "host_state_bytes", "device_peak_bytes", "h2d_bytes_per_step", "d2h_bytes_per_step",
        "step_time_lower_bound_s", "bottleneck", "fits_device", "fits_host", "host_master_bytes",
        "device_checkpoint_bytes", "model_flops_per_step", "host_peak_bytes", "pinned_bytes", "state_dtype"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  const auto p = plan::plan_step(load_run_config(source_path("configs/105b.yaml")), h200());
  EXPECT_EQ(j["params"].template get<int64_t>(), p.params);
  EXPECT_EQ(j["h2d_bytes_per_step"].template get<int64_t>(), p.transfer.h2d_bytes);

  const ScratchFile bad("cli_bad.yaml", std::string(kValidProfile) + "pcie_gbps: 3\n");
  const auto refused = megaslide::testing::run_tool(
      "megaslide-plan", "--config " + source_path("configs/smoke.yaml") + " --hardware " + bad.path);
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_NE(refused.output.find(bad.path), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("pcie_gbps"), std::string::npos) << refused.output;
  const auto missing = megaslide::testing::run_tool(
      "megaslide-plan", "--config " + source_path("configs/smoke.yaml") + " --hardware /nonexistent/hw.yaml");
  EXPECT_EQ(missing.code, 2) << missing.output;
  EXPECT_NE(missing.output.find("/nonexistent/hw.yaml"), std::string::npos) << missing.output;
  const auto unknown = megaslide::testing::run_tool(
      "megaslide-plan", "--config " + source_path("configs/smoke.yaml") + " --hardware a100");
  EXPECT_EQ(unknown.code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("a100"), std::string::npos) << unknown.output;
  const auto table = megaslide::testing::run_tool(
      "megaslide-plan", "--config " + source_path("configs/smoke.yaml") + " --hardware h100nvl");
  EXPECT_EQ(table.code, 0) << table.output;
  EXPECT_NE(table.output.find("bottleneck"), std::string::npos) << table.output;
}

// `auto` compute dtype: a hardware profile is a GPU with bf16 arithmetic, so the plan is bf16's.
TEST(StepPlan, AutoComputeDtypePlansWhatItResolvesToOnAGpu) {
  const auto planned = plan::plan_step(tiny_run({"offload.compute_dtype=auto"}), h200());
  const auto bf16 = plan::plan_step(tiny_run({"offload.compute_dtype=bf16"}), h200());
  EXPECT_EQ(planned.compute_dtype, "bf16");
  EXPECT_EQ(planned.host.compute, bf16.host.compute);
  EXPECT_EQ(planned.host.grad, bf16.host.grad);
  EXPECT_EQ(planned.device.peak(), bf16.device.peak());
  EXPECT_EQ(planned.transfer.h2d_bytes, bf16.transfer.h2d_bytes);
}

namespace {
RunConfig tiny_wan(std::vector<std::string> extra = {}) {
  std::vector<std::string> s{"model.arch=wan",
                             "model.wan.dim=24",
                             "model.wan.layers=3",
                             "model.wan.heads=2",
                             "model.wan.ffn_dim=40",
                             "model.wan.freq_dim=16",
                             "model.wan.text_dim=20",
                             "model.wan.in_channels=4",
                             "model.wan.out_channels=4",
                             "data.dataset=latent-tensors",
                             "data.channels=4",
                             "data.frames=3",
                             "data.height=6",
                             "data.width=8",
                             "data.max_text_tokens=7",
                             "diffusion.objective=flow",
                             "offload.compute_dtype=bf16",
                             "train.batch_size=2",
                             "train.device=cpu",
                             "train.threads=1",
                             "offload.optimizer_threads=1",
                             "model.dsa_kernel=[3,3,3]"};
  for (auto& e : extra) s.push_back(e);
  return parse_run_config("", "test", s);
}
}  // namespace

// Property: for Wan the plan's exact parts are what the streamed Wan Trainer's engine allocates and moves —
// streamed (attn1, attn2, ffn of each block) and resident (prologue, head, every block's fp32 table and
// norm2) parameter counts, the host store's bytes, the device slots, H2D and D2H bytes of real steps and
// the trainer's own device accounting — dense and 3D-DSA, bf16 and fp32 compute, with accumulation.
TEST(StepPlan, WanMatchesWhatTheStreamedTrainerMeasures) {
  const std::vector<std::vector<std::string>> variants{
      {},
      {"model.self_attention=dsa3d"},
      {"offload.compute_dtype=fp32"},
      {"train.grad_accum_steps=2"},
      {"optimizer.state_dtype=int8"},
      {"offload.state_tier=nvme", "offload.nvme_dir=/tmp", "offload.compute_dtype=fp32"}};
  for (const auto& v : variants) {
    const auto config = tiny_wan(v);
    std::string name;
    for (const auto& s : v) name += s + " ";
    const auto p = plan::plan_step(config, h200());
    WanLatentData data;
    torch::manual_seed(1);
    data.latents = torch::randn({4, 4, 3, 6, 8});
    data.text = torch::randn({4, 7, 20});
    data.empty_text = torch::zeros({7, 20});
    Trainer trainer = wan_trainer(config, data);
    ASSERT_TRUE(trainer.streams());
    auto& engine = *trainer.engine();
    EXPECT_EQ(p.params, trainer.parameter_count()) << name;
    EXPECT_EQ(p.streamed_params, engine.streamed_parameter_count()) << name;
    EXPECT_EQ(p.resident_params, engine.resident_parameter_count()) << name;
    const auto report = engine.store().memory_report();
    EXPECT_EQ(p.host.state(), report.total_bytes()) << name;
    EXPECT_EQ(p.host.master, report.master_bytes) << name;
    EXPECT_EQ(p.device.weight_slots, engine.streamer().device_weight_bytes()) << name;
    EXPECT_EQ(p.device.gradient_slots, engine.streamer().device_gradient_bytes()) << name;
    EXPECT_EQ(p.nvme_file_bytes, report.nvme_bytes) << name;
    const auto before = engine.store().nvme_stats();
    for (int step = 0; step < 2; ++step) {
      const auto m = trainer.step();
      ASSERT_FALSE(m.skipped) << name;
      EXPECT_EQ(p.transfer.h2d_bytes, m.h2d_bytes) << name << "step " << step;
      EXPECT_EQ(p.transfer.d2h_bytes, m.d2h_bytes) << name << "step " << step;
      EXPECT_EQ(p.device.trainer_cpu_accounting(), m.peak_device_bytes) << name << "step " << step;
      EXPECT_GT(p.device.peak(), m.peak_device_bytes) << name;
    }
    trainer.synchronize();
    const auto after = trainer.engine()->store().nvme_stats();
    expect_nvme_traffic(before, after, p, 2, name);
  }
}

// Property: the shipped Wan2.2 configs plan the published sizes — one T2V-A14B expert (14,288,491,584
// parameters, the high-noise one: its boundary 0.875 from Wan-AI's default, the other expert's state not
// held) at 480p and the TI2V-5B (4,999,787,712) at its 121 x 704 x 1280 default (31 x 22 x 40 tokens); on the
// rtx4090 workstation profile (24 GB, 128 GiB) an A14B expert's fp32 moments do not fit the host, and the
// int8 moments are advised exactly when they fit. Both A14B experts in one run (model.wan.expert both) hold
// twice one expert's host state and resident device state, but a step's PCIe bytes, optimizer bytes and
// FLOPs are one expert's; they fit the h200 profile's host, not the workstation's, which is advised one
// expert at a time with int8 moments exactly when that fits.
TEST(StepPlan, Wan22ConfigsPlanThePublishedSizes) {
  const auto a14b = load_run_config(source_path("configs/wan2.2-t2v-a14b.yaml"), {"offload.compute_dtype=bf16"});
  const auto expert = plan::plan_step(megaslide::with_wan_architecture_from_weights(a14b), h200());
  EXPECT_EQ(expert.params, 14288491584);
  EXPECT_EQ(expert.layers, 40);
  EXPECT_EQ(expert.tokens_per_sample, 21 * 30 * 52);
  EXPECT_EQ(expert.wan_expert, "high");
  EXPECT_EQ(expert.boundary_ratio, 0.875);
  EXPECT_EQ(expert.host.other_expert, 0) << "no validation videos: the other expert is never read";
  const auto ti2v = plan::plan_step(
      load_run_config(source_path("configs/wan2.2-ti2v-5b.yaml"), {"offload.compute_dtype=bf16"}), h200());
  EXPECT_EQ(ti2v.params, 4999787712);
  EXPECT_EQ(ti2v.layers, 30);
  EXPECT_EQ(ti2v.tokens_per_sample, 31 * 22 * 40);

  const auto workstation = plan::load_hardware_profile("rtx4090");
  const auto fp32 = plan::plan_step(megaslide::with_wan_architecture_from_weights(a14b), workstation);
  EXPECT_FALSE(fp32.fits_host);
  auto int8_config = a14b;
  int8_config.optimizer.state_dtype = "int8";
  const auto int8 = plan::plan_step(megaslide::with_wan_architecture_from_weights(int8_config), workstation);
  bool advised = false;
  for (const auto& a : fp32.advice) advised = advised || a.find("optimizer.state_dtype=int8") != std::string::npos;
  EXPECT_EQ(advised, int8.fits_host);
  std::cout << "a14b expert on h200: " << plan::to_table(expert) << "\nti2v-5b on h200: " << plan::to_table(ti2v)
            << "\na14b expert on rtx4090 (int8 moments): " << plan::to_table(int8) << "\n";

  // Both experts in one run: the host holds both experts' state and the device both resident parts, but a
  // step moves, updates and computes one expert; a host too small is told int8 moments or one expert.
  auto both_config = a14b;
  both_config.model.wan.expert = "both";
  const auto both = plan::plan_step(megaslide::with_wan_architecture_from_weights(both_config), h200());
  EXPECT_EQ(both.params, 2 * expert.params);
  EXPECT_EQ(both.host.master, 2 * expert.host.master);
  EXPECT_EQ(both.host.state(), 2 * expert.host.state());
  EXPECT_EQ(both.device.resident_state, 2 * expert.device.resident_state);
  EXPECT_EQ(both.device.weight_slots, expert.device.weight_slots);
  EXPECT_EQ(both.transfer.h2d_bytes, expert.transfer.h2d_bytes);
  EXPECT_EQ(both.time.model_flops, expert.time.model_flops);
  EXPECT_EQ(both.time.optimizer_bytes, expert.time.optimizer_bytes);
  EXPECT_TRUE(both.fits_host) << "2 x ~197 GB of the profile's 1.6 TB";
  const auto both_workstation =
      plan::plan_step(megaslide::with_wan_architecture_from_weights(both_config), workstation);
  EXPECT_FALSE(both_workstation.fits_host);
  bool one_at_a_time = false;
  for (const auto& a : both_workstation.advice)
    one_at_a_time = one_at_a_time || a.find("model.wan.expert=high optimizer.state_dtype=int8") != std::string::npos;
  EXPECT_EQ(one_at_a_time, int8.fits_host) << "one expert with int8 moments is advised exactly when it fits";
  std::cout << "a14b both experts on h200: " << plan::to_table(both) << "\n";
}

// Property: the shipped image-to-video configs plan their architectures' sizes — Wan2.1 I2V-14B (480p and 720p):
// T2V-14B's 14,288,491,584 parameters plus 20 more input channels of the patch embedding (409,600) and the image
// branch (the image embedder, 8,211,200; each block's add_k_proj, add_v_proj and norm_added_k, 40 x 52,444,160),
// 16,394,878,784; one Wan2.2 I2V-A14B expert: T2V-A14B's plus the input channels, 14,288,901,184, its boundary
// 0.9 — at 21 x 30 x 52 (480p) and 21 x 45 x 80 (720p) tokens; the image branch's work over CLIP's 257 tokens is in
// the model FLOPs (more than the same DiT without it).
TEST(StepPlan, ImageToVideoConfigsPlanTheirSizes) {
  for (const auto& [file, params, tokens] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
           {"configs/wan2.1-i2v-14b-480p.yaml", 16394878784, 21 * 30 * 52},
           {"configs/wan2.1-i2v-14b-720p.yaml", 16394878784, 21 * 45 * 80},
           {"configs/wan2.2-i2v-a14b.yaml", 14288901184, 21 * 30 * 52}}) {
    const auto config = load_run_config(source_path(file), {"offload.compute_dtype=bf16"});
    EXPECT_TRUE(megaslide::wan_image_to_video(config.model.wan)) << file;
    const auto plan = plan::plan_step(megaslide::with_wan_architecture_from_weights(config), h200());
    EXPECT_EQ(plan.params, params) << file;
    EXPECT_EQ(plan.layers, 40) << file;
    EXPECT_EQ(plan.tokens_per_sample, tokens) << file;
    EXPECT_EQ(plan.streamed_params + plan.resident_params, params) << file;
    if (config.model.wan.image_dim > 0) {
      auto without = config;
      without.model.wan.image_dim = 0;
      EXPECT_GT(plan.time.model_flops, plan::plan_step(without, h200()).time.model_flops) << file;
    } else {
      EXPECT_EQ(plan.boundary_ratio, 0.9) << file;
    }
    std::cout << file << ": " << plan::to_table(plan) << "\n";
  }
}

// Property: the shipped Wan2.1 configs plan Wan's published sizes at its 480p default (81 frames of
// 480x832 -> latents 21x60x104, 21x30x52 = 32,760 tokens): 1,418,996,800 and 14,288,491,584 parameters,
// split into streamed and resident parts that sum to them; bf16 PCIe bytes per step follow the closed
// form ((2L - 2) uploads and L downloads of a block); the store holds 4 B of fp32 master per streamed
// parameter; 3D-DSA (kernel 3x7x7) needs under 0.55x dense attention's model FLOPs at this length (0.31x for 1.3B,
// 0.49x for 14B) and streams its offset parameters too (more host bytes and PCIe traffic than dense, by its block's
// extra parameters exactly).
TEST(StepPlan, Wan21ConfigsAt480p) {
  for (const auto& [file, params, layers] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
           {"configs/wan2.1-t2v-1.3b.yaml", 1418996800, 30}, {"configs/wan2.1-t2v-14b.yaml", 14288491584, 40}}) {
    const auto dense_config = load_run_config(source_path(file), {"offload.compute_dtype=bf16"});
    const auto dense = plan::plan_step(dense_config, h200());
    EXPECT_EQ(dense.params, params) << file;
    EXPECT_EQ(dense.layers, layers) << file;
    EXPECT_EQ(dense.tokens_per_sample, 21 * 30 * 52) << file;
    EXPECT_EQ(dense.streamed_params + dense.resident_params, params) << file;
    EXPECT_EQ(dense.streamed_params, layers * dense.params_per_block) << file;
    EXPECT_EQ(dense.host.master, 4 * dense.streamed_params) << file;
    EXPECT_EQ(dense.transfer.h2d_bytes, (2 * layers - 2) * dense.params_per_block * 2) << file;
    EXPECT_EQ(dense.transfer.d2h_bytes, layers * dense.params_per_block * 2) << file;
    const auto dsa = plan::plan_step(
        load_run_config(source_path(file), {"offload.compute_dtype=bf16", "model.self_attention=dsa3d"}), h200());
    EXPECT_GT(dsa.params, dense.params) << file;
    EXPECT_EQ(dsa.resident_params, dense.resident_params) << file;
    EXPECT_LT(dsa.time.model_flops, 0.55 * dense.time.model_flops) << file;
    EXPECT_EQ(dsa.transfer.h2d_bytes - dense.transfer.h2d_bytes,
              (2 * layers - 2) * (dsa.params_per_block - dense.params_per_block) * 2)
        << file;
    EXPECT_EQ(dsa.host.master - dense.host.master, 4 * (dsa.streamed_params - dense.streamed_params)) << file;
    std::cout << file << ": dense " << plan::to_json(dense) << "\n" << file << ": dsa3d " << plan::to_json(dsa) << "\n";
  }
}

// Property: a LoRA plan's exact parts are what the streamed Trainer with lora.rank > 0 allocates and moves
// (its engine's frozen mode) — the trained parameters are the adapters (LoRA's or LoKr's, whose W2 is whole or
// two factors; the plan's count of the Linear layers lora.targets matches), the store is the frozen weights alone (no
// master, moments, gradient, EMA), no gradient slots, no downloads, the uploads of the first step and of the
// later ones (which find two blocks still in the slots: nothing updated them), and the trainer's own device
// accounting (weight slots, adapters' state, checkpoints) — for the
// DiT family (every architecture, bf16/fp32 compute, accumulation, a subset of targets, dropout with an EMA,
// LoKr, an fp8 base) and Wan (dense, 3D-DSA, attn1 only, two micro-batches, LoKr with the default factors and factor
// 4, an fp8 base: its host copy, uploads and slots' fp8 buffers). The
// modelled peak exceeds that accounting.
TEST(StepPlan, LoraMatchesWhatTheStreamedTrainerMeasures) {
  const std::vector<std::vector<std::string>> dit_variants{
      {"lora.rank=4"},
      {"lora.rank=2", "train.grad_accum_steps=2"},
      {"lora.rank=4", "offload.compute_dtype=fp32", "model.layers=2"},
      {"lora.rank=3", "lora.targets=[blocks.*.mlp.*]", "train.grad_clip=0"},
      {"lora.rank=4", "lora.dropout=0.25", "train.ema_decay=0.99"},
      {"lora.rank=2", "model.arch=dense3d"},
      {"lora.rank=2", "model.arch=swin", "model.layers=1"},
      {"lora.type=lokr", "lora.rank=3"},
      {"lora.rank=4", "lora.base_dtype=fp8"}};
  const std::vector<std::vector<std::string>> wan_variants{{"lora.rank=4"},
                                                           {"lora.rank=4", "lora.base_dtype=fp8"},
                                                           {"lora.rank=4", "model.self_attention=dsa3d"},
                                                           {"lora.rank=2", "lora.targets=[blocks.*.attn1.*]"},
                                                           {"lora.rank=4", "train.grad_accum_steps=2"},
                                                           {"lora.type=lokr", "lora.rank=3"},
                                                           {"lora.type=lokr", "lora.rank=1", "lora.factor=4"}};
  for (const bool wan : {false, true}) {
    for (const auto& v : wan ? wan_variants : dit_variants) {
      const auto config = wan ? tiny_wan(v) : tiny_run(v);
      std::string name = wan ? "wan " : "dit ";
      for (const auto& s : v) name += s + " ";
      const auto p = plan::plan_step(config, h200());
      ASSERT_EQ(p.lora_rank, config.lora.rank) << name;
      WanLatentData data;
      torch::manual_seed(1);
      data.latents = torch::randn({4, 4, 3, 6, 8});
      data.text = torch::randn({4, 7, 20});
      data.empty_text = torch::zeros({7, 20});
      Trainer trainer = wan ? wan_trainer(config, data) : streamed_trainer(config);
      ASSERT_TRUE(trainer.streams()) << name;
      auto& engine = *trainer.engine();
      EXPECT_EQ(p.lora_params, engine.resident_parameter_count()) << name;
      std::set<std::string> adapted;  // LoRA's two tensors, LoKr's two or three, per adapted weight
      for (const auto& [tensor, t] : trainer.weight_views()) adapted.insert(megaslide::lora_base_weight(tensor));
      EXPECT_EQ(p.lora_adapters, static_cast<int64_t>(adapted.size())) << name;
      EXPECT_EQ(p.streamed_params, engine.streamed_parameter_count()) << name;
      const auto report = engine.store().memory_report();
      EXPECT_TRUE(report.frozen) << name;
      EXPECT_EQ(p.host.state(), report.total_bytes()) << name;
      EXPECT_EQ(p.host.compute, report.compute_bytes + report.scale_bytes + report.exact_bytes) << name;
      EXPECT_EQ(report.fp8, config.lora.base_dtype == "fp8") << name;
      EXPECT_EQ(p.host.master + p.host.exp_avg + p.host.exp_avg_sq + p.host.grad + p.host.ema + p.host.staging, 0)
          << name;
      EXPECT_EQ(p.host.pinned, report.pinnable_bytes) << name;
      EXPECT_EQ(p.device.weight_slots, engine.streamer().device_weight_bytes()) << name;
      EXPECT_EQ(p.device.gradient_slots, engine.streamer().device_gradient_bytes()) << name;
      EXPECT_EQ(p.device.gradient_slots, 0) << name;
      for (int step = 0; step < 3; ++step) {
        const auto m = trainer.step();
        ASSERT_FALSE(m.skipped) << name;
        // The first step finds empty slots; later ones the two blocks the previous step ended with.
        EXPECT_EQ(step == 0 ? p.transfer.first_step_h2d_bytes : p.transfer.h2d_bytes, m.h2d_bytes)
            << name << "step " << step;
        EXPECT_EQ(p.transfer.d2h_bytes, m.d2h_bytes) << name << "step " << step;
        EXPECT_EQ(m.d2h_bytes, 0) << name;
        EXPECT_EQ(p.device.trainer_cpu_accounting(), m.peak_device_bytes) << name << "step " << step;
        EXPECT_GT(p.device.peak(), m.peak_device_bytes) << name;
      }
      trainer.synchronize();
    }
  }
}

// Property: without offload (the resident loop), a LoRA plan trains the same adapters the resident Trainer
// trains (their elements summed over its trained tensors), keeps every parameter of the model as a frozen
// fp32 weight on the device and the adapters with gradient and AdamW moments, and moves nothing over PCIe.
TEST(StepPlan, LoraWithoutOffloadMatchesTheResidentTrainer) {
  for (const bool wan : {false, true}) {
    auto config = wan ? tiny_wan({"lora.rank=4"}) : tiny_run({"lora.rank=4"});
    config.offload.enabled = false;
    const auto p = plan::plan_step(config, h200());
    WanLatentData data;
    torch::manual_seed(1);
    data.latents = torch::randn({4, 4, 3, 6, 8});
    data.text = torch::randn({4, 7, 20});
    data.empty_text = torch::zeros({7, 20});
    Trainer trainer = wan ? wan_trainer(config, data) : resident_trainer(config);
    ASSERT_FALSE(trainer.streams());
    int64_t trained = 0;
    for (const auto& [name, t] : trainer.weight_views()) trained += t.numel();
    EXPECT_EQ(p.lora_params, trained) << (wan ? "wan" : "dit");
    EXPECT_EQ(2 * p.lora_adapters, static_cast<int64_t>(trainer.weight_views().size()));
    EXPECT_EQ(p.device.resident_state, 16 * p.lora_params);
    EXPECT_EQ(p.device.frozen_resident, 4 * (p.params + p.text_encoder_params));
    EXPECT_EQ(p.transfer.h2d_bytes + p.transfer.d2h_bytes, 0);
    EXPECT_EQ(trainer.step().skipped, false);
  }
}

// Property: with lora.rank r, Wan's adapters are r·(in + out) for each Linear lora.targets names — per block
// r·(8·2D + 2·(D + F)) for every one (q, k, v, out of both attentions; the FFN's two), r·4·2D for attn1's —
// and with two Wan2.2 experts in one run the targets see each expert's prefix ("transformer." /
// "transformer_2."); the store is e·P (the frozen weights in the compute dtype, page-locked; start-up adds
// two blocks' fp32 weights), whatever the accumulation or EMA; the first step uploads what full fine-tuning's
// step uploads and every later one two blocks less (the blocks the previous step ended with are still in the
// slots: nothing updated them); there are no downloads and no host optimizer; the device trades the gradient slots and
// the resident parts' 16 B a parameter for 4 B a frozen resident parameter and 16 B (20 with an EMA) a trained one;
// model FLOPs are 2/3 of full fine-tuning's, the executed ones full fine-tuning's less a third of the weights' (no
// weight gradients) plus the adapters' 8 FLOPs per parameter and row (forward, recompute, two gradients); over two
// ranks nothing is sharded and the exchange is one fp32 all-reduce of the adapters' gradients. Targets that
// match nothing are refused naming lora.targets, as the trainer refuses them.
TEST(StepPlan, LoraFollowsTheClosedForm) {
  const int64_t D = 24, F = 40, L = 3, r = 4;
  const auto full = plan::plan_step(tiny_wan(), h200());
  const auto lora = plan::plan_step(tiny_wan({"lora.rank=4"}), h200());
  EXPECT_EQ(lora.lora_adapters, 10 * L);
  EXPECT_EQ(lora.lora_params, L * r * (8 * 2 * D + 2 * (D + F)));
  EXPECT_EQ(lora.params, full.params) << "the model's, frozen";
  const auto attn1 = plan::plan_step(tiny_wan({"lora.rank=4", "lora.targets=[blocks.*.attn1.*]"}), h200());
  EXPECT_EQ(attn1.lora_params, L * r * 4 * 2 * D);
  const int64_t P = full.streamed_params, Pb = full.params_per_block;
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {}, {"train.grad_accum_steps=3"}, {"train.ema_decay=0.999"}, {"offload.compute_dtype=fp32"}}) {
    auto with = extra;
    with.push_back("lora.rank=4");
    const auto f = plan::plan_step(tiny_wan(extra), h200());
    const auto p = plan::plan_step(tiny_wan(with), h200());
    const int64_t e = p.compute_dtype == "fp32" ? 4 : 2;
    EXPECT_EQ(p.host.state(), e * P);
    EXPECT_EQ(p.host.steady(), e * P);
    EXPECT_EQ(p.host.pinned, e * P);
    EXPECT_EQ(p.host.construction_peak, e * P + 2 * 4 * Pb);
    EXPECT_EQ(p.transfer.first_step_h2d_bytes, f.transfer.h2d_bytes);
    EXPECT_EQ(f.transfer.first_step_h2d_bytes, f.transfer.h2d_bytes) << "full fine-tuning: every step the first";
    EXPECT_EQ(p.transfer.h2d_bytes, f.transfer.h2d_bytes - 2 * Pb * e);
    EXPECT_EQ(p.transfer.h2d_copies, f.transfer.h2d_copies - 2);
    EXPECT_EQ(p.transfer.d2h_bytes, 0);
    EXPECT_EQ(p.time.optimizer_bytes, 0);
    EXPECT_EQ(p.time.d2h_s, 0.0);
    EXPECT_EQ(p.time.optimizer_s, 0.0);
    EXPECT_EQ(p.device.weight_slots, f.device.weight_slots);
    EXPECT_EQ(p.device.gradient_slots, 0);
    EXPECT_EQ(p.device.frozen_resident, 4 * f.resident_params);
    EXPECT_EQ(p.device.resident_state, (p.ema ? 20 : 16) * p.lora_params);
    EXPECT_EQ(p.device.checkpoints, f.device.checkpoints);
    EXPECT_EQ(p.device.block_inputs, f.device.block_inputs / 2) << "no gradients of the frozen prologue's outputs";
    EXPECT_EQ(p.device.recompute_saved, f.device.recompute_saved + p.device.lora_saved);
    EXPECT_GT(p.device.lora_saved, 0);
    EXPECT_DOUBLE_EQ(p.time.model_flops, f.time.model_flops * 2.0 / 3.0);
  }
  // FLOPs: the weights' share of full fine-tuning's model FLOPs is all but attention's 12·L·B·N·(N + Lt)·D.
  const double B = 2, N = lora.tokens_per_sample, Lt = 7;
  const double attention = 12.0 * L * B * N * (N + Lt) * D;
  const double weights = full.time.model_flops - attention;
  const double rows = 2 * r * (2 * D) * Lt + (8 * 2 * D + 2 * (D + F) - 2 * 2 * D) * r * N;  // attn2.to_k, to_v: text
  EXPECT_NEAR(lora.time.lora_flops, 4.0 * 2.0 * L * B * rows, 1e-6 * lora.time.lora_flops);
  EXPECT_NEAR(lora.time.executed_flops, full.time.executed_flops - weights / 3.0 + lora.time.lora_flops,
              1e-9 * full.time.executed_flops);
  EXPECT_DOUBLE_EQ(lora.time.compute_s, lora.time.executed_flops / (h200().peak_bf16_tflops * 1e12));
  EXPECT_NE(lora.time.bottleneck, "d2h");
  EXPECT_NE(lora.time.bottleneck, "host optimizer");
  // Dropout keeps each adapted Linear's mask and dropped input: 2·rows·in·e more per block (B = 2; attn1's four,
  // attn2's q and out and the FFN's fc1 read D channels of the N video tokens, fc2 F of them; attn2's k and v D
  // of the 7 text tokens).
  const auto dropout = plan::plan_step(tiny_wan({"lora.rank=4", "lora.dropout=0.1"}), h200());
  const int64_t Ni = lora.tokens_per_sample, in_rows = 2 * (7 * D * Ni + F * Ni + 2 * D * 7);
  EXPECT_EQ(dropout.device.lora_saved - lora.device.lora_saved, 2 * in_rows * 2);

  // Two experts: the targets see the prefixes; a step's FLOPs are one expert's adapters'.
  const auto both = plan::plan_step(tiny_wan({"lora.rank=4", "model.wan.expert=both"}), h200());
  EXPECT_EQ(both.lora_params, 2 * lora.lora_params);
  EXPECT_EQ(both.device.resident_state, 2 * lora.device.resident_state);
  EXPECT_EQ(both.host.state(), 2 * lora.host.state());
  EXPECT_DOUBLE_EQ(both.time.lora_flops, lora.time.lora_flops);
  const auto low = plan::plan_step(
      tiny_wan({"lora.rank=4", "model.wan.expert=both", "lora.targets=[transformer_2.blocks.*]"}), h200());
  EXPECT_EQ(low.lora_params, lora.lora_params);
  EXPECT_THROW(plan::plan_step(tiny_wan({"lora.rank=4", "lora.targets=[transformer.*]"}), h200()), ConfigError);
  try {
    plan::plan_step(tiny_wan({"lora.rank=4", "lora.targets=[nothing*]"}), h200());
    ADD_FAILURE() << "targets matching nothing were planned";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "lora.targets");
    EXPECT_NE(std::string(e.what()).find("blocks.0.attn1.to_q.weight"), std::string::npos) << e.what();
  }

  // Two ranks: the whole frozen copy on each, the adapters' gradients all-reduced.
  const auto two = plan::plan_step(tiny_wan({"lora.rank=4", "train.batch_size=2"}), h200(), 2);
  EXPECT_EQ(two.host.state(), lora.host.state());
  EXPECT_EQ(two.host_state_bytes_all_ranks, 2 * lora.host.state());
  EXPECT_EQ(two.sharded_params_per_rank, 0);
  EXPECT_EQ(two.transfer.d2h_bytes, 0);
  EXPECT_EQ(two.exchange.payload_bytes, 4 * lora.lora_params);
  EXPECT_EQ(two.exchange.wire_bytes, 2 * ((lora.lora_params + 1) / 2) * 4);
  EXPECT_EQ(two.exchange.collectives, 1);
  EXPECT_TRUE(two.time.exchange_after);
  EXPECT_DOUBLE_EQ(two.time.lower_bound_s, std::max({two.time.compute_s, two.time.h2d_s}) + two.time.exchange_s);

  // The JSON names the LoRA figures; full fine-tuning's JSON has none of them.
  const auto j = nlohmann::json::parse(plan::to_json(lora));
  EXPECT_EQ(j.at("lora_trained_params").get<int64_t>(), lora.lora_params);
  EXPECT_EQ(j.at("lora_adapters").get<int64_t>(), lora.lora_adapters);
  EXPECT_EQ(j.at("frozen_params").get<int64_t>(), lora.params);
  EXPECT_EQ(j.at("d2h_bytes_per_step").get<int64_t>(), 0);
  EXPECT_FALSE(nlohmann::json::parse(plan::to_json(full)).contains("lora_rank"));
  EXPECT_NE(plan::to_table(lora).find("frozen weights (transfer buffer)"), std::string::npos);
}

// Property: Wan2.1-T2V-14B with rank-32 LoRA on every Linear of its blocks (the docs' case) trains
// 40 x 32 x (8 x 2 x 5120 + 2 x (5120 + 13824)) = 153,354,240 adapter parameters, holds 2 B a streamed parameter
// on the host (bf16 frozen weights), uploads 2L - 4 = 76 blocks a step (the first step 78, full fine-tuning's)
// and downloads nothing; the CLI prints the same figures.
TEST(StepPlan, Wan21LoraAt480p) {
  const auto full = plan::plan_step(
      load_run_config(source_path("configs/wan2.1-t2v-14b.yaml"), {"offload.compute_dtype=bf16"}), h200());
  const auto p = plan::plan_step(
      load_run_config(source_path("configs/wan2.1-t2v-14b.yaml"), {"offload.compute_dtype=bf16", "lora.rank=32"}),
      h200());
  EXPECT_EQ(p.lora_adapters, 400);
  EXPECT_EQ(p.lora_params, 153354240);
  EXPECT_EQ(p.host.state(), 2 * full.streamed_params);
  EXPECT_EQ(p.transfer.first_step_h2d_bytes, full.transfer.h2d_bytes);
  EXPECT_EQ(p.transfer.h2d_bytes, 76 * p.params_per_block * 2);
  EXPECT_EQ(p.transfer.d2h_bytes, 0);
  EXPECT_LT(p.device.peak(), full.device.peak());
  EXPECT_LT(p.time.executed_flops, full.time.executed_flops);
  const auto r = megaslide::testing::run_tool(
      "megaslide-plan", "--config " + source_path("configs/wan2.1-t2v-14b.yaml") + " --set lora.rank=32 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j.at("lora_trained_params").get<int64_t>(), p.lora_params);
  EXPECT_EQ(j.at("host_state_bytes").get<int64_t>(), p.host.state());
  EXPECT_EQ(j.at("device_peak_bytes").get<int64_t>(), p.device.peak());
  std::cout << "wan2.1-t2v-14b LoRA rank 32 on h200: " << plan::to_table(p) << "\n";
}
