// The planner with several data-parallel ranks (plan_step's world_size, megaslide-plan --world-size):
// one rank's host memory of the sharded streamed trainer against the shard layout's closed form, the
// exchange's bytes, the per-rank batch's device plan, the refusals (a batch the ranks do not divide,
// int8 moments), the exchange time against the profile's network_gbps, and the CLI. World size 1 is
// the single-process plan (tests/test_step_plan.cpp checks it against the trainer).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <set>

#include "megaslide/io/files.h"
#include "megaslide/model/dit.h"
#include "megaslide/train/dit_family.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/plan/step_plan.h"
#include "run_tool.h"

using namespace megaslide;
using megaslide::plan::HardwareProfile;

namespace {

// 4 frames of 8x8, hidden 16, 3 blocks: a plan takes milliseconds. bf16 compute (what `auto` plans).
RunConfig tiny_run(std::vector<std::string> extra = {}) {
  std::vector<std::string> s{"offload.compute_dtype=bf16",
                             "model.layers=3",
                             "model.dsa_kernel=[3,3,3]",
                             "data.frames=4",
                             "data.height=8",
                             "data.width=8",
                             "data.num_clips=16",
                             "train.batch_size=6"};
  for (auto& e : extra) s.push_back(e);
  return parse_run_config("", "test", s);
}

HardwareProfile h200() { return plan::load_hardware_profile("h200"); }

std::string source_path(const std::string& relative) { return std::string(MEGASLIDE_SOURCE_DIR) + "/" + relative; }

// configs/105b.yaml with a global batch of 2 (it trains one clip a step), so 2 ranks divide it.
RunConfig config_105b() { return load_run_config(source_path("configs/105b.yaml"), {"train.batch_size=2"}); }

int64_t ceil_div(int64_t n, int64_t d) { return (n + d - 1) / d; }

// The DiT's blocks are equal: L blocks of P_b parameters, counted independently of the planner.
struct Blocks {
  int64_t L = 0, Pb = 0;
};
Blocks blocks_of(const RunConfig& c) {
  return {c.model.layers, count_dit_parameters(DiTOptions::from_config(c)).per_block};
}

// Every key of the single-process JSON (docs/planner.md, "JSON keys"), for a streamed 3D-DSA run.
const std::set<std::string> kOneProcessKeys{"arch",
                                            "trainer",
                                            "compute_dtype",
                                            "mode",
                                            "layers",
                                            "hidden",
                                            "batch_size",
                                            "grad_accum_steps",
                                            "tokens_per_sample",
                                            "token_grid",
                                            "params",
                                            "text_encoder_params",
                                            "streamed_params",
                                            "resident_params",
                                            "params_per_block",
                                            "hardware",
                                            "state_dtype",
                                            "host_state_bytes",
                                            "host_state_bytes_per_param",
                                            "host_master_bytes",
                                            "host_exp_avg_bytes",
                                            "host_exp_avg_sq_bytes",
                                            "host_ema_bytes",
                                            "host_other_expert_bytes",
                                            "host_scale_bytes",
                                            "host_compute_bytes",
                                            "host_grad_bytes",
                                            "host_staging_bytes",
                                            "host_steady_bytes",
                                            "host_steady_bytes_per_param",
                                            "host_construction_peak_bytes",
                                            "host_peak_bytes",
                                            "host_peak_bytes_per_param",
                                            "pinned_bytes",
                                            "device_peak_bytes",
                                            "device_weight_slot_bytes",
                                            "device_gradient_slot_bytes",
                                            "device_resident_state_bytes",
                                            "device_checkpoint_bytes",
                                            "device_block_input_bytes",
                                            "device_prologue_epilogue_bytes",
                                            "device_recompute_saved_bytes",
                                            "device_recompute_workspace_bytes",
                                            "device_recompute_saved_reference_bytes",
                                            "device_recompute_workspace_reference_bytes",
                                            "device_peak_reference_bytes",
                                            "h2d_bytes_per_step",
                                            "d2h_bytes_per_step",
                                            "h2d_copies_per_step",
                                            "d2h_copies_per_step",
                                            "slot_cache_hits_per_step",
                                            "model_flops_per_step",
                                            "executed_flops_per_step",
                                            "host_optimizer_bytes_per_step",
                                            "compute_s",
                                            "h2d_s",
                                            "d2h_s",
                                            "host_optimizer_s",
                                            "overlapped",
                                            "step_time_lower_bound_s",
                                            "bottleneck",
                                            "mfu_upper_bound",
                                            "fits_device",
                                            "fits_host",
                                            "state_tier",
                                            "activations",
                                            "advice"};

std::set<std::string> keys_of(const nlohmann::json& j) {
  std::set<std::string> keys;
  for (const auto& item : j.items()) keys.insert(item.key());
  return keys;
}

}  // namespace

// Property: world size 1 is the single-process plan: the host store is what HostParamStore::plan counts
// for these blocks, nothing is exchanged, the time has no exchange term, and the JSON has exactly the
// single-process keys (no world-size key appears, and none went missing).
TEST(StepPlanWorldSize, OneRankIsTheSingleProcessPlan) {
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {}, {"offload.compute_dtype=fp32"}, {"optimizer.state_dtype=int8"}, {"train.grad_accum_steps=2"}}) {
    const auto config = tiny_run(extra);
    const auto p = plan::plan_step(config, h200(), 1);
    const auto b = blocks_of(config);
    std::vector<offload::BlockSpec> specs;
    DiT model(DiTOptions::from_config(config).device(torch::kMeta));
    for (size_t l = 0; l < model->blocks->size(); ++l) {
      offload::BlockSpec spec{"blocks." + std::to_string(l), {}};
      for (const auto& item : model->blocks[l]->named_parameters(true))
        spec.params.push_back({item.key(), item.value().sizes().vec()});
      specs.push_back(spec);
    }
    const auto store = offload::HostParamStore::plan(
        specs, offload::host_store_options(offload::parse_compute_dtype(p.compute_dtype), config.train.grad_accum_steps,
                                           offload::parse_state_dtype(config.optimizer.state_dtype)));
    EXPECT_EQ(p.host.state(), store.total_bytes());
    EXPECT_EQ(p.host.exchange, 0);
    EXPECT_EQ(p.world_size, 1);
    EXPECT_EQ(p.batch_size_per_rank, p.batch_size);
    EXPECT_EQ(p.exchange.payload_bytes, 0);
    EXPECT_EQ(p.exchange.wire_bytes, 0);
    EXPECT_EQ(p.time.exchange_s, 0.0);
    EXPECT_EQ(p.streamed_params, b.L * b.Pb);
    EXPECT_EQ(keys_of(nlohmann::json::parse(plan::to_json(p))), kOneProcessKeys);
    EXPECT_EQ(plan::to_table(p).find("rank"), std::string::npos);
  }
}

// Property: with R ranks one rank's host store is its shard of every block's fp32 master and AdamW
// moments (ceil(n/R) elements of a block of n), the whole bf16 transfer buffer, and two exchange
// buffers of R·ceil(P_b/R) elements: with fp32 moments 12·Σceil(P_b/R) + 2·P + exchange. At R = 2 that
// is exactly (12/2 + 2)/14 of the single process's 14·P, plus the exchange buffers and 12 B for each
// block of odd size (rank 0's half rounded up). The stores of all ranks together hold one master and one
// pair of moments.
TEST(StepPlanWorldSize, HostStatePerRankIsTheShardLayout) {
  const auto config = config_105b();
  const auto b = blocks_of(config);
  const int64_t P = b.L * b.Pb;
  const auto one = plan::plan_step(config, h200());
  ASSERT_EQ(one.host.state(), 14 * P);
  const auto two = plan::plan_step(config, h200(), 2);
  const int64_t rounding = 12 * b.L * (b.Pb % 2) / 2;  // 105b's blocks are odd: 1010656889 parameters
  EXPECT_EQ(two.host.exchange, 2 * 2 * ceil_div(b.Pb, 2) * 2);
  EXPECT_EQ(two.host.state() - two.host.exchange - rounding, one.host.state() / 14 * (12 / 2 + 2));
  EXPECT_NEAR(static_cast<double>(two.host.state()) / static_cast<double>(one.host.state()), 8.0 / 14.0,
              static_cast<double>(two.host.exchange + rounding) / static_cast<double>(one.host.state()) + 1e-12);
  EXPECT_EQ(two.host_state_bytes_all_ranks, 12 * P + 2 * (2 * P + two.host.exchange));

  // Odd block sizes: R = 3 over the tiny run's blocks, rank 0's shard is the rounded-up third.
  for (const int64_t R : {2, 3, 6}) {
    for (const char* state : {"fp32", "bf16"}) {
      const auto c = tiny_run({std::string("optimizer.state_dtype=") + state});
      const auto t = blocks_of(c);
      const auto p = plan::plan_step(c, h200(), R);
      const int64_t s = ceil_div(t.Pb, R), m = std::string(state) == "fp32" ? 4 : 2;
      EXPECT_EQ(p.sharded_params_per_rank, t.L * s) << R;
      EXPECT_EQ(p.host.master, 4 * t.L * s) << R;
      EXPECT_EQ(p.host.exp_avg, m * t.L * s) << R;
      EXPECT_EQ(p.host.exp_avg_sq, m * t.L * s) << R;
      EXPECT_EQ(p.host.compute, 2 * t.L * t.Pb) << R;
      EXPECT_EQ(p.host.grad, 0) << R;
      EXPECT_EQ(p.host.exchange, 2 * R * s * 2) << R;
      EXPECT_EQ(p.host.state(), (4 + 2 * m) * t.L * s + 2 * t.L * t.Pb + 2 * R * s * 2) << R;
      EXPECT_EQ(p.host.pinned, 2 * t.L * t.Pb) << R;
      EXPECT_EQ(p.host_state_bytes_all_ranks, (4 + 2 * m) * t.L * t.Pb + R * (2 * t.L * t.Pb + 2 * R * s * 2)) << R;
    }
  }
  // fp32 compute: the transfer buffer holds the fp32 compute copy (4 B per parameter, as the single
  // process's gradient buffer). Accumulation: the whole fp32 gradient sums, fp32 exchange buffers.
  const auto c = tiny_run();
  const auto t = blocks_of(c);
  const int64_t s = ceil_div(t.Pb, 2);
  const auto fp32 = plan::plan_step(tiny_run({"offload.compute_dtype=fp32"}), h200(), 2);
  EXPECT_EQ(fp32.host.compute, 4 * t.L * t.Pb);
  EXPECT_EQ(fp32.host.exchange, 2 * 2 * s * 4);
  const auto accum = plan::plan_step(tiny_run({"train.grad_accum_steps=2"}), h200(), 2);
  EXPECT_EQ(accum.host.grad, 4 * t.L * t.Pb);
  EXPECT_EQ(accum.host.exchange, 2 * 2 * s * 4);
  EXPECT_EQ(accum.host.staging, 2 * t.Pb * 2);
  EXPECT_EQ(accum.host.state(), 12 * t.L * s + 2 * t.L * t.Pb + 4 * t.L * t.Pb + 2 * 2 * s * 4);
}

// Property: per rank and step the streamed trainer reduce-scatters every block's gradient and
// all-gathers every block's compute copy: payload 2·e·P (gradients in fp32 with accumulation: (4 + e)·P),
// and a ring sends (R − 1)·ceil(P_b/R) elements of each per block: (R − 1)/R of the payload, within
// one element per chunk. The host optimizer works on the shard: 28 B per shard element (bf16 compute, fp32 moments).
// The resident trainer all-reduces one fp32 buffer of every parameter's gradient: twice a ring's
// reduce-scatter. PCIe traffic is every rank's whole stream, as for one process.
TEST(StepPlanWorldSize, ExchangeBytesFollowTheRing) {
  for (const int64_t R : {2, 3, 4}) {
    const auto c = tiny_run({"train.batch_size=12"});
    const auto b = blocks_of(c);
    const int64_t P = b.L * b.Pb, s = ceil_div(b.Pb, R);
    const auto p = plan::plan_step(c, h200(), R);
    EXPECT_EQ(p.exchange.payload_bytes, 2 * 2 * P) << R;
    EXPECT_EQ(p.exchange.wire_bytes, b.L * 2 * (R - 1) * s * 2) << R;
    EXPECT_EQ(p.exchange.collectives, 2 * b.L) << R;
    const double ring =
        static_cast<double>(R - 1) / static_cast<double>(R) * static_cast<double>(p.exchange.payload_bytes);
    EXPECT_GE(static_cast<double>(p.exchange.wire_bytes), ring) << R;
    EXPECT_LE(static_cast<double>(p.exchange.wire_bytes), ring + static_cast<double>(2 * b.L * (R - 1) * 2)) << R;
    EXPECT_EQ(p.time.optimizer_bytes, 28 * b.L * s) << R;
    const auto one = plan::plan_step(c, h200());
    EXPECT_EQ(p.transfer.h2d_bytes, one.transfer.h2d_bytes) << R;
    EXPECT_EQ(p.transfer.d2h_bytes, one.transfer.d2h_bytes) << R;

    const auto accum = plan::plan_step(tiny_run({"train.batch_size=12", "train.grad_accum_steps=2"}), h200(), R);
    EXPECT_EQ(accum.exchange.payload_bytes, (4 + 2) * P) << R;
    EXPECT_EQ(accum.exchange.wire_bytes, b.L * (R - 1) * s * (4 + 2)) << R;

    const auto resident = plan::plan_step(tiny_run({"train.batch_size=12", "offload.enabled=false"}), h200(), R);
    const int64_t trained = resident.params + resident.text_encoder_params;
    EXPECT_EQ(resident.exchange.payload_bytes, 4 * trained) << R;
    EXPECT_EQ(resident.exchange.wire_bytes, 2 * (R - 1) * ceil_div(trained, R) * 4) << R;
    EXPECT_EQ(resident.exchange.collectives, 1) << R;
    EXPECT_EQ(resident.device.gradient_all_reduce, 4 * trained) << R;
    EXPECT_EQ(resident.time.optimizer_bytes, 0) << R;
  }
}

// Property: a rank's device memory and FLOPs are those of one process training the per-rank batch
// (train.batch_size / R), plus, for the resident trainer, the all-reduce buffer (which the peak takes
// instead of the activations when it is the larger).
TEST(StepPlanWorldSize, DevicePlanIsThatOfThePerRankBatch) {
  for (const char* offload : {"true", "false"}) {
    const auto global = tiny_run({"train.batch_size=6", std::string("offload.enabled=") + offload});
    const auto per_rank = tiny_run({"train.batch_size=2", std::string("offload.enabled=") + offload});
    const auto p = plan::plan_step(global, h200(), 3);
    const auto q = plan::plan_step(per_rank, h200(), 1);
    EXPECT_EQ(p.batch_size, 6);
    EXPECT_EQ(p.batch_size_per_rank, 2);
    EXPECT_EQ(p.device.activations(), q.device.activations()) << offload;
    EXPECT_EQ(p.device.resident_state, q.device.resident_state) << offload;
    EXPECT_EQ(p.device.weight_slots, q.device.weight_slots) << offload;
    EXPECT_DOUBLE_EQ(p.time.model_flops, q.time.model_flops) << offload;
    EXPECT_DOUBLE_EQ(p.time.executed_flops, q.time.executed_flops) << offload;
    EXPECT_DOUBLE_EQ(p.time.model_flops, model_flops_per_step(per_rank)) << offload;
    const int64_t fixed = p.device.weight_slots + p.device.gradient_slots + p.device.resident_state;
    EXPECT_EQ(p.device.peak(), fixed + std::max(p.device.activations(), p.device.gradient_all_reduce)) << offload;
    EXPECT_EQ(p.device.gradient_all_reduce > 0, std::string(offload) == "false") << offload;
  }
}

// Property: a train.batch_size the ranks do not divide is refused naming train.batch_size and both
// numbers; int8 AdamW moments with the sharded streamed trainer are refused naming
// optimizer.state_dtype (one process plans them); a world size below 1 is refused.
TEST(StepPlanWorldSize, RefusesWhatTheShardedTrainerCannotRun) {
  try {
    plan::plan_step(tiny_run({"train.batch_size=3"}), h200(), 2);
    ADD_FAILURE() << "planned a batch of 3 over 2 ranks";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "train.batch_size");
    EXPECT_NE(e.problem().find("3"), std::string::npos) << e.what();
    EXPECT_NE(e.problem().find("2 ranks"), std::string::npos) << e.what();
  }
  try {
    plan::plan_step(tiny_run({"optimizer.state_dtype=int8"}), h200(), 2);
    ADD_FAILURE() << "planned int8 moments over 2 ranks";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "optimizer.state_dtype");
    EXPECT_NE(e.problem().find("int8"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(plan::plan_step(tiny_run({"optimizer.state_dtype=int8"}), h200(), 1));
  EXPECT_THROW(plan::plan_step(tiny_run(), h200(), 0), ConfigError);
}

// Property: the exchange time is the ring's bytes on the wire over network_gbps: the assumed 12.5 GB/s
// when the profile has none, the profile's figure when it has one; in async mode it is one more term
// of the max (and the bottleneck when the network is slow enough), in sync mode of the sum; the
// resident trainer's all-reduce follows its backward, so its bound is compute + exchange.
TEST(StepPlanWorldSize, ExchangeTimeUsesTheNetworkBandwidth) {
  const auto hw = h200();
  EXPECT_TRUE(hw.network_gbps_assumed);
  EXPECT_EQ(hw.network_gbps, plan::kAssumedNetworkGbps);
  const auto p = plan::plan_step(tiny_run(), hw, 2);
  EXPECT_DOUBLE_EQ(p.time.exchange_s, static_cast<double>(p.exchange.wire_bytes) / (12.5e9));
  EXPECT_DOUBLE_EQ(p.time.lower_bound_s,
                   std::max({p.time.compute_s, p.time.h2d_s, p.time.d2h_s, p.time.optimizer_s, p.time.exchange_s}));
  auto slow = hw;
  slow.network_gbps = 1e-6;  // a network slow enough to bound any step
  const auto q = plan::plan_step(tiny_run(), slow, 2);
  EXPECT_EQ(q.time.bottleneck, "exchange");
  EXPECT_DOUBLE_EQ(q.time.lower_bound_s, q.time.exchange_s);
  const auto sync = plan::plan_step(tiny_run({"offload.mode=sync"}), slow, 2);
  EXPECT_DOUBLE_EQ(sync.time.lower_bound_s, sync.time.compute_s + sync.time.h2d_s + sync.time.d2h_s +
                                                sync.time.optimizer_s + sync.time.exchange_s);
  const auto resident = plan::plan_step(tiny_run({"offload.enabled=false"}), hw, 2);
  EXPECT_FALSE(resident.time.overlapped);
  EXPECT_GT(resident.time.exchange_s, 0.0);
  EXPECT_DOUBLE_EQ(resident.time.lower_bound_s, resident.time.compute_s + resident.time.exchange_s);

  const auto parsed = plan::parse_hardware_profile(
      "device_memory_bytes: 1\npeak_bf16_tflops: 1\npcie_h2d_gbps: 1\npcie_d2h_gbps: 1\nhost_dram_gbps: 1\n"
      "host_memory_bytes: 1\nnetwork_gbps: 50\n",
      "lab.yaml");
  EXPECT_EQ(parsed.network_gbps, 50.0);
  EXPECT_FALSE(parsed.network_gbps_assumed);
  try {
    plan::parse_hardware_profile(
        "device_memory_bytes: 1\npeak_bf16_tflops: 1\npcie_h2d_gbps: 1\npcie_d2h_gbps: 1\nhost_dram_gbps: 1\n"
        "host_memory_bytes: 1\nnetwork_gbps: 0\n",
        "lab.yaml");
    ADD_FAILURE() << "accepted network_gbps: 0";
  } catch (const plan::HardwareProfileError& e) {
    EXPECT_NE(std::string(e.what()).find("network_gbps"), std::string::npos) << e.what();
  }
}

// Property: `megaslide-plan --world-size 2 --json` prints the per-rank keys, agreeing with the library;
// the table says the figures are one rank's; a batch the ranks do not divide exits 2 naming
// train.batch_size; --world-size 0 exits 2.
TEST(MegaslidePlanCli, WorldSizeKeysAndRefusals) {
  const std::string config = " --config " + source_path("configs/105b.yaml") + " --set train.batch_size=2";
  const auto r = megaslide::testing::run_tool("megaslide-plan", config + " --world-size 2 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const auto p = plan::plan_step(config_105b(), h200(), 2);
  EXPECT_EQ(j["world_size"].get<int64_t>(), 2);
  EXPECT_EQ(j["batch_size_per_rank"].get<int64_t>(), p.batch_size_per_rank);
  EXPECT_EQ(j["host_state_bytes_per_rank"].get<int64_t>(), p.host.state());
  EXPECT_EQ(j["host_state_bytes"].get<int64_t>(), p.host.state());
  EXPECT_EQ(j["host_exchange_bytes"].get<int64_t>(), p.host.exchange);
  EXPECT_EQ(j["exchange_bytes_per_step"].get<int64_t>(), p.exchange.payload_bytes);
  EXPECT_EQ(j["exchange_wire_bytes_per_step"].get<int64_t>(), p.exchange.wire_bytes);
  EXPECT_EQ(j["host_state_bytes_all_ranks"].get<int64_t>(), p.host_state_bytes_all_ranks);
  EXPECT_TRUE(j.contains("exchange_s"));
  EXPECT_TRUE(j["hardware"]["network_gbps_assumed"].get<bool>());
  const auto table = megaslide::testing::run_tool("megaslide-plan", config + " --world-size 2");
  EXPECT_EQ(table.code, 0) << table.output;
  EXPECT_NE(table.output.find("one rank's"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("exchange"), std::string::npos) << table.output;
  const auto odd = megaslide::testing::run_tool(
      "megaslide-plan", " --config " + source_path("configs/smoke.yaml") + " --set train.batch_size=3 --world-size 2");
  EXPECT_EQ(odd.code, 2) << odd.output;
  EXPECT_NE(odd.output.find("train.batch_size"), std::string::npos) << odd.output;
  const auto zero = megaslide::testing::run_tool("megaslide-plan", config + " --world-size 0");
  EXPECT_EQ(zero.code, 2) << zero.output;
}

// Property: with context parallelism (distributed.context_parallel n) a rank plans its share of every sample: the
// batch splits over world / n groups, its device activations are those of a one-process run of ceil(T / n) frames
// plus one attention's exchange buffers and the whole samples of its batch (the data is not split), its FLOPs 1/n of
// the whole sample's (3D-DSA: plus the halo frames' queries); the bytes it exchanges per step follow the closed forms
// (Ulysses: 4 (n − 1)/n of its q, k, v and output; 3D-DSA: k and v of the halo, ⌊kt/2⌋ + ⌊range⌋ + 1 frames each way,
// and one frame of the offset network's input) in the forward, the recompute and the backward of every block, timed at
// the profile's device_link_gbps and added to the compute term.
TEST(StepPlanContextParallel, ARankPlansItsFramesAndTheGroupsExchange) {
  const auto hw = plan::load_hardware_profile("hgx-h200");
  EXPECT_EQ(hw.device_link_gbps, 450.0);
  EXPECT_FALSE(hw.device_link_gbps_assumed);
  for (const char* arch : {"megaslide", "dense3d"}) {
    SCOPED_TRACE(arch);
    const std::string a = std::string("model.arch=") + arch;
    const auto p = plan::plan_step(tiny_run({a, "data.frames=5", "distributed.context_parallel=2"}), hw, 4);
    const auto whole = plan::plan_step(tiny_run({a, "data.frames=5", "train.batch_size=3"}), hw, 1);
    const auto frames3 = plan::plan_step(tiny_run({a, "data.frames=3", "train.batch_size=3"}), hw, 1);
    EXPECT_EQ(p.context_parallel, 2);
    EXPECT_EQ(p.batch_size_per_rank, 3);  // 6 over 2 groups
    EXPECT_EQ(p.token_frames_per_rank, 3);
    EXPECT_EQ(p.tokens_per_rank, 3 * 4 * 4);
    // The rank still holds its batch's whole samples (x_0, noise, x_t and the target: 4 fp32 [B, 3, 5, 8, 8]).
    const int64_t whole_sample_extra = 4 * 3 * 3 * (5 - 3) * 8 * 8 * 4;
    EXPECT_EQ(p.device.activations() - p.device.context_buffers, frames3.device.activations() + whole_sample_extra);
    const int64_t B = 3, D = 16, frame = 16, L = 3, e = 2;
    int64_t elements = 0;
    if (std::string(arch) == "dense3d") {
      EXPECT_EQ(p.context_exchange, "Ulysses all-to-all");
      elements = 4 * B * p.tokens_per_rank * D / 2;
      EXPECT_DOUBLE_EQ(p.time.executed_flops, whole.time.executed_flops / 2);
    } else {
      EXPECT_EQ(p.context_exchange, "3D-DSA halo");
      // 3 from its one neighbour (2 ranks), capped at the 2 frames the rank does not hold; the offset network's one.
      EXPECT_EQ(p.context_halo_frames, 2);
      elements = 2 * 2 * frame * B * D + 1 * frame * B * D;
      EXPECT_GT(p.time.executed_flops, whole.time.executed_flops / 2);
    }
    EXPECT_EQ(p.device.context_buffers, 2 * elements * e);
    EXPECT_EQ(p.context_bytes, elements * e * L * 3);
    EXPECT_DOUBLE_EQ(p.time.model_flops, whole.time.model_flops / 2);
    EXPECT_DOUBLE_EQ(p.time.context_s, static_cast<double>(p.context_bytes) / 450e9);
    EXPECT_GE(p.time.lower_bound_s, p.time.compute_s + p.time.context_s);
  }
}

// Property: a group size that does not divide the ranks, a sample with fewer token frames than the group, and dense
// attention whose heads the group does not divide are refused naming distributed.context_parallel (the flag when
// `megaslide-plan --context-parallel` set it, the config's file and key when the config did); `megaslide-plan
// --context-parallel 2`, or a config of groups of 2 without --world-size, plans a world of 2 and prints the
// context keys and the table's line.
TEST(StepPlanContextParallel, RefusalsAndTheCli) {
  const auto refused = [](const RunConfig& c, int64_t world, const std::string& needle) {
    try {
      plan::plan_step(c, h200(), world);
      ADD_FAILURE() << "planned " << needle;
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), "distributed.context_parallel") << e.what();
      EXPECT_NE(e.problem().find(needle), std::string::npos) << e.what();
    }
  };
  refused(tiny_run({"distributed.context_parallel=2"}), 3, "3 ranks");
  refused(tiny_run({"distributed.context_parallel=6"}), 6, "4 token frames");
  refused(tiny_run({"model.arch=dense3d", "distributed.context_parallel=3"}), 3, "2 attention heads");
  const std::string config = " --config " + source_path("configs/smoke.yaml") + " --set train.batch_size=2";
  const auto r = megaslide::testing::run_tool("megaslide-plan", config + " --context-parallel 2 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["world_size"].get<int64_t>(), 2);
  EXPECT_EQ(j["context_parallel"].get<int64_t>(), 2);
  EXPECT_EQ(j["token_frames_per_rank"].get<int64_t>(), 4);
  EXPECT_EQ(j["context_exchange"].get<std::string>(), "3D-DSA halo");
  for (const char* key : {"context_bytes_per_step", "context_s", "device_context_buffer_bytes", "tokens_per_rank"})
    EXPECT_TRUE(j.contains(key)) << key;
  const auto table = megaslide::testing::run_tool("megaslide-plan", config + " --context-parallel 2");
  EXPECT_EQ(table.code, 0) << table.output;
  EXPECT_NE(table.output.find("context parallel: groups of 2 ranks"), std::string::npos) << table.output;
  const auto bad = megaslide::testing::run_tool("megaslide-plan", config + " --context-parallel 2 --world-size 3");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--context-parallel: 2 does not divide the 3 ranks"), std::string::npos) << bad.output;
  const auto from_config =
      megaslide::testing::run_tool("megaslide-plan", config + " --set distributed.context_parallel=2 --json");
  ASSERT_EQ(from_config.code, 0) << from_config.output;
  EXPECT_EQ(nlohmann::json::parse(from_config.output)["world_size"].get<int64_t>(), 2);
  const auto config_refused =
      megaslide::testing::run_tool("megaslide-plan", config + " --set distributed.context_parallel=2 --world-size 3");
  EXPECT_EQ(config_refused.code, 2) << config_refused.output;
  EXPECT_NE(config_refused.output.find("smoke.yaml: distributed.context_parallel: 2 does not divide the 3 ranks"),
            std::string::npos)
      << config_refused.output;
}
