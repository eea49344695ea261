// The DiT family's streamed trainer (Trainer with offload.enabled): against the resident reference, sync against
// async, clipping, accumulation, fp16 overflow, device accounting, tracing (the engine alone:
// test_stack_trainer.cpp). On the CPU, async mode runs on emulated streams (copy threads, destinations
// poisoned until their copy lands) and every test here delays each copy by 2 ms, so an update that reads
// a gradient before its copy has landed reads NaN and the comparisons fail.
#include "trainers.h"

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <fstream>
#include <limits>
#include <tuple>
#include <map>
#include <set>
#include <string_view>

#include "megaslide/io/files.h"
#include "stack_checks.h"

using namespace megaslide::testing;

using namespace megaslide;

namespace {
// 4 frames of 8x8 (64 tokens per clip), 3 blocks of hidden 16.
RunConfig tiny_run(Architecture arch, std::vector<std::string> extra = {}) {
  std::vector<std::string> s{"model.arch=" + std::string(to_string(arch)),
                             "model.layers=3",
                             "model.dsa_kernel=[3,3,3]",
                             "model.swin_window=[2,2,2]",
                             "data.frames=4",
                             "data.height=8",
                             "data.width=8",
                             "data.num_clips=64",
                             "train.steps=20",
                             "train.batch_size=4",
                             "train.lr=3e-3",
                             "train.warmup_steps=2",
                             "train.device=cpu",
                             "offload.compute_dtype=fp32",
                             "offload.optimizer_threads=1",
                             "offload.emulated_copy_delay_ms=2"};
  for (auto& e : extra) s.push_back(e);
  return parse_run_config("", "test", s);
}

// max |a - b| over every parameter, both trainers' names matching one to one.
double max_weight_difference(Trainer& r, Trainer& s) {
  const auto ref_list = r.master_weights();
  const std::map<std::string, torch::Tensor> ref(ref_list.begin(), ref_list.end());
  const auto streamed = s.master_weights();
  EXPECT_EQ(streamed.size(), ref.size());
  double worst = 0.0;
  for (const auto& [name, w] : streamed) {
    auto it = ref.find(name);
    EXPECT_NE(it, ref.end()) << name;
    if (it == ref.end()) continue;
    EXPECT_EQ(w.sizes(), it->second.sizes()) << name;
    worst = std::max(worst, (w - it->second).abs().max().item<double>());
  }
  return worst;
}

// Runs both trainers `steps` steps and checks weights after each, with the per-step losses.
void expect_streamed_matches_resident(const RunConfig& config, int steps, double tolerance) {
  Trainer resident = resident_trainer(config);
  Trainer streamed = streamed_trainer(config);
  EXPECT_EQ(max_weight_difference(resident, streamed), 0.0) << "the two trainers must start from the same weights";
  for (int i = 0; i < steps; ++i) {
    auto a = resident.step();
    auto b = streamed.step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::max(1.0, std::abs(a.loss))) << "step " << i + 1;
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-4 * std::max(1.0, a.grad_norm)) << "step " << i + 1;
    const double diff = max_weight_difference(resident, streamed);
    EXPECT_LE(diff, tolerance) << to_string(config.model.arch) << " step " << i + 1;
  }
}

bool same_bits(std::vector<std::pair<std::string, torch::Tensor>> a,
               std::vector<std::pair<std::string, torch::Tensor>> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].first != b[i].first || !torch::equal(a[i].second, b[i].second)) return false;
  return true;
}

// The tolerance of streamed vs resident weights (fp32 compute on both). The sources of difference:
// CpuAdamW vs torch::optim::AdamW (1-2 ulp per step, docs/cpu-adamw.md), the order in which gradients
// of the shared block inputs (t_mod, text) and of the global norm are summed, all fp32 rounding
// (~1e-7 relative) — then amplified by Adam's normalisation for elements whose gradient is near 0.
// Measured: at most 3.2e-7 after 5 steps (three DiTs, clipping, accumulation); a missed or doubled update would move an
// element by ~lr = 1.5e-3 to 3e-3, far outside.
constexpr double kWeightTolerance = 1e-5;
}  // namespace

TEST(StreamedDiT, StreamedEqualsResidentForEachDiT) {
  for (auto arch : {Architecture::kMegaSlide, Architecture::kDense3D, Architecture::kSwin}) {
    SCOPED_TRACE(to_string(arch));
    expect_streamed_matches_resident(tiny_run(arch, {"train.grad_clip=0"}), 5, kWeightTolerance);
  }
}

TEST(StreamedDiT, StreamedEqualsResidentForEachPredictionTarget) {
  // diffusion.prediction reaches both trainers through the shared batch source: the same targets, the
  // same losses, the same weights. The targets differ, so the losses must too.
  std::vector<double> first_losses;
  for (std::string prediction : {"epsilon", "v", "x0"}) {
    SCOPED_TRACE(prediction);
    auto config = tiny_run(Architecture::kDense3D, {"train.grad_clip=0", "diffusion.prediction=" + prediction});
    expect_streamed_matches_resident(config, 3, kWeightTolerance);
    first_losses.push_back(resident_trainer(config).step().loss);
  }
  EXPECT_NE(first_losses[0], first_losses[1]);
  EXPECT_NE(first_losses[0], first_losses[2]);
  EXPECT_NE(first_losses[1], first_losses[2]);
}

TEST(StreamedDiT, ClippingMatchesTheResidentReference) {
  // A small clip norm so that every step is clipped (the updates are deferred to after the backward).
  auto config = tiny_run(Architecture::kMegaSlide, {"train.grad_clip=0.05"});
  Trainer probe = resident_trainer(config);
  EXPECT_GT(probe.step().grad_norm, 0.05) << "the test needs clipping to be active";
  expect_streamed_matches_resident(config, 5, kWeightTolerance);
}

TEST(StreamedDiT, GradientAccumulationMatchesTheResidentReference) {
  expect_streamed_matches_resident(
      tiny_run(Architecture::kDense3D, {"train.grad_accum_steps=3", "train.grad_clip=0.5"}), 5, kWeightTolerance);
  expect_streamed_matches_resident(tiny_run(Architecture::kSwin, {"train.grad_accum_steps=2", "train.grad_clip=0"}), 5,
                                   kWeightTolerance);
}

TEST(StreamedDiT, StreamedEqualsResidentWithImmediateUpdatesAndAccumulation) {
  // Immediate updates (no clipping) with two micro-batches: each block's update waits for the host
  // task that adds the last micro-batch's gradient.
  expect_streamed_matches_resident(
      tiny_run(Architecture::kMegaSlide, {"train.grad_accum_steps=2", "train.grad_clip=0"}), 5, kWeightTolerance);
}

TEST(StreamedDiT, SyncEqualsAsyncBitForBit) {
  for (const char* clip : {"train.grad_clip=0", "train.grad_clip=1.0"}) {
    for (const char* accum : {"train.grad_accum_steps=1", "train.grad_accum_steps=2"}) {
      SCOPED_TRACE(std::string(clip) + " " + accum);
      auto base = tiny_run(Architecture::kMegaSlide, {"offload.compute_dtype=bf16", clip, accum});
      auto sync_config = base;
      sync_config.offload.mode = "sync";
      Trainer a = streamed_trainer(base), b = streamed_trainer(sync_config);
      for (int i = 0; i < 4; ++i) {
        auto ma = a.step(), mb = b.step();
        EXPECT_EQ(ma.loss, mb.loss) << "step " << i + 1;
        EXPECT_EQ(ma.grad_norm, mb.grad_norm) << "step " << i + 1;
        EXPECT_EQ(ma.h2d_bytes, mb.h2d_bytes);
      }
      EXPECT_TRUE(same_bits(a.master_weights(), b.master_weights()));
    }
  }
}

TEST(StreamedDiT, SyncEqualsAsyncBitForBitWithFp16LossScaling) {
  auto base = tiny_run(Architecture::kDense3D, {"offload.compute_dtype=fp16", "train.loss_scale_init=1024"});
  auto sync_config = base;
  sync_config.offload.mode = "sync";
  Trainer a = streamed_trainer(base), b = streamed_trainer(sync_config);
  for (int i = 0; i < 5; ++i) {
    auto ma = a.step(), mb = b.step();
    ASSERT_TRUE(std::isfinite(ma.loss)) << "step " << i + 1;
    EXPECT_EQ(ma.loss, mb.loss) << "step " << i + 1;
    EXPECT_EQ(ma.grad_norm, mb.grad_norm) << "step " << i + 1;
    EXPECT_EQ(ma.loss_scale, mb.loss_scale) << "step " << i + 1;
  }
  EXPECT_TRUE(same_bits(a.master_weights(), b.master_weights()));
}

TEST(StreamedDiT, Bf16AndFp16ComputeTrain) {
  for (const char* dtype : {"offload.compute_dtype=bf16", "offload.compute_dtype=fp16"}) {
    SCOPED_TRACE(dtype);
    Trainer t = streamed_trainer(tiny_run(Architecture::kDense3D, {dtype, "train.lr=1e-2"}));
    double first = 0, last = 0;
    for (int i = 0; i < 20; ++i) {
      auto m = t.step();
      ASSERT_TRUE(std::isfinite(m.loss)) << "step " << m.step;
      EXPECT_FALSE(m.skipped) << "step " << m.step;
      if (i < 3) first += m.loss / 3;
      if (i >= 17) last += m.loss / 3;
    }
    EXPECT_LT(last, 0.8 * first) << "first " << first << " last " << last;
  }
}

TEST(StreamedDiT, Fp16OverflowSkipsTheWholeStepAndLowersTheScale) {
  // A loss scale of 1e30 overflows fp16 block gradients as soon as they are non-zero (from step 2:
  // the zero-initialised head passes no gradient to the blocks in step 1).
  Trainer t = streamed_trainer(
      tiny_run(Architecture::kMegaSlide, {"offload.compute_dtype=fp16", "train.loss_scale_init=1e30"}));
  bool saw_skip = false;
  for (int i = 0; i < 4 && !saw_skip; ++i) {
    const auto before = t.master_weights();
    const int64_t updates = t.engine()->optimizer_steps();
    const double scale = t.engine()->loss_scale();
    auto m = t.step();
    if (!m.skipped) continue;
    saw_skip = true;
    EXPECT_FALSE(std::isfinite(m.grad_norm));
    EXPECT_EQ(m.loss_scale, scale);
    EXPECT_EQ(t.engine()->loss_scale(), scale / 2);
    EXPECT_EQ(t.engine()->optimizer_steps(), updates) << "a skipped step takes no AdamW step";
    EXPECT_TRUE(same_bits(before, t.master_weights())) << "a skipped step changes no weight, resident or streamed";
    megaslide::testing::expect_compute_copies_are_the_masters(*t.engine());
  }
  EXPECT_TRUE(saw_skip);
}

// A skipped step in a row of them (the scale halves each time but stays far too large): every step's
// gradients land in the blocks' compute buffers, so each skip must round every copy back from its
// master, and only once that gradient has landed (the emulated copies land 2 ms late: a restore that
// did not wait would be overwritten). The moments and masters keep every bit, and the copies the next
// step uploads are the masters' (sync and async agree bit for bit on the step after the skips).
TEST(StreamedDiT, SkippedStepsLeaveEveryStateBitAndRestoreTheCopies) {
  auto config = tiny_run(Architecture::kDense3D, {"offload.compute_dtype=fp16", "train.loss_scale_init=1e30"});
  auto sync_config = config;
  sync_config.offload.mode = "sync";
  Trainer a = streamed_trainer(config), b = streamed_trainer(sync_config);
  a.step();
  b.step();  // the zero-initialised head sends the blocks no gradient in step 1: it is taken
  a.synchronize();
  const auto& store = a.engine()->store();
  std::vector<torch::Tensor> m0, v0;
  for (int64_t l = 0; l < store.num_blocks(); ++l) {
    m0.push_back(store.exp_avg(l).clone());
    v0.push_back(store.exp_avg_sq(l).clone());
  }
  const auto before = a.master_weights();
  for (int i = 0; i < 3; ++i) {
    const auto ma = a.step(), mb = b.step();
    ASSERT_TRUE(ma.skipped && mb.skipped) << "step " << i + 2;
  }
  a.synchronize();
  EXPECT_TRUE(same_bits(before, a.master_weights()));
  for (int64_t l = 0; l < store.num_blocks(); ++l) {
    EXPECT_TRUE(torch::equal(store.exp_avg(l), m0[l])) << "block " << l;
    EXPECT_TRUE(torch::equal(store.exp_avg_sq(l), v0[l])) << "block " << l;
  }
  megaslide::testing::expect_compute_copies_are_the_masters(*a.engine());
  megaslide::testing::expect_compute_copies_are_the_masters(*b.engine());
  const auto ma = a.step(), mb = b.step();
  EXPECT_EQ(ma.loss, mb.loss);
}

// int8 and bf16 moments: sync and async give the same bits (immediate and deferred updates,
// accumulation) in the moments and their scales too, and the compute copies follow the masters.
TEST(StreamedDiT, NarrowMomentsSyncEqualsAsyncBitForBit) {
  for (auto [state, clip, accum] :
       {std::tuple{"int8", "0", "1"}, std::tuple{"int8", "1.0", "2"}, std::tuple{"bf16", "1.0", "1"}}) {
    SCOPED_TRACE(std::string(state) + " clip " + clip + " accum " + accum);
    auto base = tiny_run(Architecture::kMegaSlide,
                         {"offload.compute_dtype=bf16", std::string("optimizer.state_dtype=") + state,
                          std::string("train.grad_clip=") + clip, std::string("train.grad_accum_steps=") + accum});
    auto sync_config = base;
    sync_config.offload.mode = "sync";
    Trainer a = streamed_trainer(base), b = streamed_trainer(sync_config);
    for (int i = 0; i < 3; ++i) {
      auto ma = a.step(), mb = b.step();
      EXPECT_EQ(ma.loss, mb.loss) << "step " << i + 1;
      EXPECT_EQ(ma.grad_norm, mb.grad_norm) << "step " << i + 1;
    }
    EXPECT_TRUE(same_bits(a.master_weights(), b.master_weights()));
    const auto& sa = a.engine()->store();
    const auto& sb = b.engine()->store();
    for (int64_t l = 0; l < sa.num_blocks(); ++l) {
      EXPECT_TRUE(torch::equal(sa.exp_avg(l), sb.exp_avg(l)) && torch::equal(sa.exp_avg_sq(l), sb.exp_avg_sq(l)));
      if (sa.exp_avg_scale(l).defined())
        EXPECT_TRUE(torch::equal(sa.exp_avg_scale(l), sb.exp_avg_scale(l)) &&
                    torch::equal(sa.exp_avg_sq_scale(l), sb.exp_avg_sq_scale(l)));
    }
    megaslide::testing::expect_compute_copies_are_the_masters(*a.engine());
  }
}

// int8 moments train this model about as fp32 moments do: over 12 steps the mean loss of the last three
// falls below 0.8 of the first three's, and the int8 run's final loss is within 10 % of the fp32 run's.
TEST(StreamedDiT, Int8MomentsTrainLikeFp32Moments) {
  std::map<std::string, std::pair<double, double>> curve;  // first three, last three
  for (const char* state : {"fp32", "int8"}) {
    Trainer t = streamed_trainer(tiny_run(Architecture::kDense3D, {"offload.compute_dtype=bf16", "train.lr=1e-2",
                                                                   std::string("optimizer.state_dtype=") + state}));
    double first = 0, last = 0;
    for (int i = 0; i < 12; ++i) {
      const auto m = t.step();
      ASSERT_TRUE(std::isfinite(m.loss) && !m.skipped) << state << " step " << m.step;
      if (i < 3) first += m.loss / 3;
      if (i >= 9) last += m.loss / 3;
    }
    EXPECT_LT(last, 0.8 * first) << state << ": first " << first << " last " << last;
    curve[state] = {first, last};
  }
  EXPECT_NEAR(curve["int8"].second, curve["fp32"].second, 0.1 * curve["fp32"].second);
}

// The blocks are built one at a time from per-block seeds (DiT::initial_block): loading them with one
// thread or three gives the same store, and block i equals block i of a DiT built whole on the CPU.
TEST(StreamedDiT, BlockByBlockInitialisationIsIndependentOfThreads) {
  const auto config = tiny_run(Architecture::kMegaSlide, {"model.layers=5"});
  torch::manual_seed(config.train.seed);
  DiT whole(DiTOptions::from_config(config));
  std::vector<std::vector<torch::Tensor>> stores;
  for (int threads : {1, 3}) {
    torch::manual_seed(config.train.seed);
    DiT skeleton(DiTOptions::from_config(config).block_device(torch::kMeta));
    EXPECT_EQ(skeleton->init_seed, whole->init_seed);
    auto stack = std::make_shared<DiTStack>(skeleton, TextEncoder(TextEncoderOptions(64, config.model.text_dim, 12)));
    std::vector<megaslide::offload::BlockSpec> specs;
    for (int64_t l = 0; l < stack->num_blocks(); ++l) {
      megaslide::offload::BlockSpec spec{"blocks." + std::to_string(l), {}};
      for (const auto& item : stack->block(l).named_parameters(true))
        spec.params.push_back({item.key(), item.value().sizes().vec()});
      specs.push_back(spec);
    }
    megaslide::offload::HostParamStore store(specs);
    megaslide::offload::load_initial_weights(*stack, store, threads);
    std::vector<torch::Tensor> masters;
    for (int64_t l = 0; l < store.num_blocks(); ++l) {
      masters.push_back(store.master(l).clone());
      for (const auto& item : whole->blocks[l]->named_parameters(true))
        EXPECT_TRUE(torch::equal(store.param(l, item.key()).master, item.value())) << item.key() << " of block " << l;
      EXPECT_FALSE(stack->block(l).parameters()[0].is_meta()) << "the built block was adopted";
    }
    stores.push_back(masters);
  }
  for (size_t l = 0; l < stores[0].size(); ++l) EXPECT_TRUE(torch::equal(stores[0][l], stores[1][l]));
}

TEST(StreamedDiT, DeviceHoldsAtMostTwoBlocksWhateverTheDepth) {
  int64_t slot_bytes = -1;
  for (int64_t depth : {2, 5, 9}) {
    Trainer t = streamed_trainer(tiny_run(Architecture::kDense3D, {"model.layers=" + std::to_string(depth)}));
    auto m = t.step();
    t.step();
    const auto& s = t.engine()->streamer();
    EXPECT_LE(s.max_resident_blocks(), 2) << depth;
    if (slot_bytes < 0) slot_bytes = s.device_weight_bytes();
    EXPECT_EQ(s.device_weight_bytes(), slot_bytes) << "weight slots must not grow with depth";
    // Between uses the block modules hold no storage: all weights are in the host store or a slot.
    for (int64_t l = 0; l < depth; ++l)
      for (const auto& p : dit_module(t)->blocks[l]->parameters()) EXPECT_EQ(p.numel(), 0) << "block " << l;
    // DESIGN.md §6: 4 B per fp32 weight up for the forward and again for the backward, less the two
    // blocks that stay cached between them; 4 B per weight of gradient down.
    const int64_t block_bytes = 4 * t.engine()->store().block_numel(0);
    EXPECT_EQ(m.h2d_bytes, (2 * depth - 2) * block_bytes) << depth;
    EXPECT_EQ(m.d2h_bytes, depth * block_bytes) << depth;
    EXPECT_GT(m.peak_device_bytes, 0);
  }
}

TEST(StreamedDiT, TraceOfOneStepHasEveryLane) {
  const std::string path = std::string(MEGASLIDE_BINARY_DIR) + "/test_cpu_master_trace.json";
  Trainer t = streamed_trainer(tiny_run(Architecture::kMegaSlide));
  t.step();
  t.trace_next_step(path);
  t.step();
  auto j = nlohmann::json::parse(io::read_file(path));
  std::set<int> lanes;
  std::set<std::string> names;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    lanes.insert(e.at("tid").get<int>());
    names.insert(e.at("name").get<std::string>());
    EXPECT_GE(e.at("dur").get<double>(), 0.0);
  }
  EXPECT_EQ(lanes, (std::set<int>{1, 2, 3, 4}));  // compute, H2D, D2H, optimizer
  for (const char* n : {"forward block 0", "backward block 2", "h2d block 1", "d2h block 0", "adamw block 2"})
    EXPECT_TRUE(names.count(n)) << n;
  io::remove_tree(path);
}

TEST(StreamedDiT, StreamsOnAGpu_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  for (const char* mode : {"offload.mode=async", "offload.mode=sync"}) {
    auto config = tiny_run(Architecture::kMegaSlide,
                           {"train.device=cuda", "offload.compute_dtype=bf16", mode, "train.peak_tflops=100"});
    Trainer t = streamed_trainer(config);
    for (int i = 0; i < 5; ++i) {
      auto m = t.step();
      EXPECT_TRUE(std::isfinite(m.loss));
      EXPECT_GT(m.h2d_bytes, 0);
      EXPECT_GT(m.mfu, 0.0);
    }
    EXPECT_LE(t.engine()->streamer().max_resident_blocks(), 2);
  }
}

TEST(StreamedDiT, CudaWithAndWithoutIndexAreAccepted_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  for (const char* device : {"train.device=cuda", "train.device=cuda:0"}) {
    SCOPED_TRACE(device);
    Trainer t = streamed_trainer(tiny_run(Architecture::kDense3D, {device, "train.peak_tflops=100"}));
    EXPECT_EQ(t.device(), torch::Device(torch::kCUDA, 0));
    auto m = t.step();
    EXPECT_TRUE(std::isfinite(m.loss));
    EXPECT_GT(m.peak_device_bytes, 0);
  }
}

TEST(StreamedDiT, AsyncEqualsSyncOnAGpuAndBothMatchTheResidentTrainer_CUDA) {
  // fp32 compute, deterministic kernels: async (three streams) and sync (one stream, every copy waited
  // for) run the same kernels in the same order on the compute stream, so the weights must agree bit
  // for bit after 5 steps; the resident trainer on the same GPU within the CPU tests' tolerance.
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  auto& ctx = at::globalContext();
  const bool was_deterministic = ctx.deterministicAlgorithms(), was_cudnn = ctx.deterministicCuDNN();
  ctx.setDeterministicAlgorithms(true, /*warn_only=*/true);
  ctx.setDeterministicCuDNN(true);
  for (const char* clip : {"train.grad_clip=0", "train.grad_clip=0.05"}) {
    SCOPED_TRACE(clip);
    auto base = tiny_run(Architecture::kDense3D, {"train.device=cuda", clip, "train.peak_tflops=100"});
    auto sync_config = base;
    sync_config.offload.mode = "sync";
    Trainer resident = resident_trainer(base);
    Trainer a = streamed_trainer(base), b = streamed_trainer(sync_config);
    for (int i = 0; i < 5; ++i) {
      auto ma = a.step(), mb = b.step(), mr = resident.step();
      EXPECT_EQ(ma.loss, mb.loss) << "step " << i + 1;
      EXPECT_NEAR(ma.loss, mr.loss, 1e-5 * std::max(1.0, std::abs(mr.loss))) << "step " << i + 1;
    }
    EXPECT_TRUE(same_bits(a.master_weights(), b.master_weights()));
    EXPECT_LE(max_weight_difference(resident, a), kWeightTolerance);
  }
  ctx.setDeterministicAlgorithms(was_deterministic, false);
  ctx.setDeterministicCuDNN(was_cudnn);
}
