// Every model family's trainer, in both modes, driven only through the seam the training run uses
// (train/trainer.h): the same properties hold for each family without a test of its own.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include "../src/attention/dsa3d_params.h"
#include "megaslide/io/files.h"
#include "megaslide/offload/cpu_adamw.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/offload/weight_streamer.h"
#include "megaslide/plan/step_plan.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/trainer.h"
#include "trainers.h"

using namespace megaslide;

namespace {

// The tiny run of a family (tests/support/trainers.h: "dit" with 2 blocks, or "wan"), streamed or resident,
// fp32 compute, clipped at 1.
RunConfig tiny(const std::string& family, bool streamed, const std::string& dir) {
  return megaslide::testing::tiny_run_config(family, dir,
                                             {"offload.enabled=" + std::string(streamed ? "true" : "false"),
                                              "offload.compute_dtype=fp32", "train.grad_clip=1.0"});
}

using megaslide::testing::trainer_of;

std::map<std::string, torch::Tensor> masters(Trainer& trainer) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : trainer.training_state().master) out[name] = t.clone();
  return out;
}

std::string scratch(const std::string& name) {
  return "/tmp/megaslide-test-trainer-" + name + "-" + std::to_string(::getpid());
}

class Trainers : public ::testing::TestWithParam<std::string> {};

}  // namespace

// Property: each family's streamed trainer (fp32 compute) trains as its resident reference loop does:
// the same losses within 1e-4 relative over 3 steps, the same parameter names, and masters within 1e-4.
TEST_P(Trainers, StreamedFollowsTheResidentLoop) {
  const std::string dir = scratch(GetParam() + "-modes");
  const auto resident_config = tiny(GetParam(), false, dir), streamed_config = tiny(GetParam(), true, dir);
  auto resident = trainer_of(resident_config);
  auto streamed = trainer_of(streamed_config);
  EXPECT_FALSE(resident->streams());
  EXPECT_TRUE(streamed->streams());
  EXPECT_EQ(resident->parameter_count(), streamed->parameter_count());
  // What --dry-run and the memory check before the first step count (the DiT family's caption encoder included).
  EXPECT_EQ(megaslide::count_run_parameters(resident_config).total, resident->parameter_count());
  for (int i = 0; i < 3; ++i) {
    const auto a = resident->step(), b = streamed->step();
    ASSERT_FALSE(a.skipped || b.skipped);
    EXPECT_NEAR(b.loss, a.loss, 1e-4 * std::abs(a.loss)) << "step " << i + 1;
  }
  streamed->synchronize();
  const auto ra = masters(*resident), sa = masters(*streamed);
  ASSERT_EQ(ra.size(), sa.size());
  for (const auto& [name, t] : ra) {
    ASSERT_TRUE(sa.count(name)) << name << " is missing from the streamed trainer's state";
    EXPECT_LT((sa.at(name) - t).abs().max().item<double>(), 1e-4) << name;
  }
  io::remove_tree(dir);
}

// Property: a trainer given another's training_state after 2 steps continues it bit for bit: its next
// 2 losses and its masters equal those of the run that was never interrupted, in both modes.
TEST_P(Trainers, AStateCarriedToANewTrainerContinuesBitExactly) {
  const std::string dir = scratch(GetParam() + "-resume");
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    const auto config = tiny(GetParam(), streamed, dir);
    auto whole = trainer_of(config);
    auto first = trainer_of(config);
    for (int i = 0; i < 2; ++i) {
      whole->step();
      first->step();
    }
    auto second = trainer_of(config);
    second->load_training_state(first->training_state());
    first.reset();
    for (int i = 0; i < 2; ++i) {
      const auto a = whole->step(), b = second->step();
      EXPECT_EQ(a.step, b.step);
      EXPECT_EQ(a.loss, b.loss) << "step " << a.step;
    }
    const auto wa = masters(*whole), sa = masters(*second);
    for (const auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, sa.at(name))) << name;
  }
  io::remove_tree(dir);
}

// Property: a NaN in a master weight makes the step non-finite: it is skipped and counted, and updates
// no master or moment; with the weight restored, training goes on — each family, both modes.
TEST_P(Trainers, ANonFiniteStepIsSkippedAndUpdatesNothing) {
  const std::string dir = scratch(GetParam() + "-nan");
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    auto trainer = trainer_of(tiny(GetParam(), streamed, dir));
    trainer->step();
    const auto good = trainer->training_state();  // the streamed trainer's: views of its host store
    io::NamedTensors clean;
    for (const auto& [name, t] : good.master) clean.emplace_back(name, t.clone());
    std::vector<torch::Tensor> saved;
    for (const auto* list : {&good.master, &good.exp_avg, &good.exp_avg_sq})
      for (const auto& [name, t] : *list) saved.push_back(t.clone());
    TrainingState poisoned = good;
    poisoned.master = {};
    for (const auto& [name, t] : clean) poisoned.master.emplace_back(name, t.clone());
    poisoned.master.back().second.view(-1)[0] =
        std::numeric_limits<float>::quiet_NaN();  // the output layer's last tensor
    trainer->load_training_state(poisoned);
    const auto m = trainer->step();
    EXPECT_TRUE(m.skipped);
    EXPECT_EQ(m.skipped_total, 1);
    EXPECT_EQ(m.consecutive_skips, 1);
    const auto after = trainer->training_state();
    EXPECT_EQ(after.optimizer_steps, good.optimizer_steps);
    size_t k = 0;
    for (const auto* list : {&after.master, &after.exp_avg, &after.exp_avg_sq})
      for (const auto& [name, t] : *list) {
        const auto& was = k < poisoned.master.size() ? poisoned.master[k].second : saved[k];
        EXPECT_TRUE(torch::equal(t.isnan(), was.isnan()) && torch::equal(t.nan_to_num(), was.nan_to_num())) << name;
        ++k;
      }
    TrainingState restored = trainer->training_state();
    restored.master = clean;
    trainer->load_training_state(restored);
    const auto next = trainer->step();
    EXPECT_FALSE(next.skipped);
    EXPECT_TRUE(std::isfinite(next.loss));
  }
  io::remove_tree(dir);
}

// Property: with train.ema_decay each family's trainer, in both modes, keeps ema_n = d_n·ema_{n-1} +
// (1 − d_n)·w_n over the weights w_n after its n-th update, d_1 = 0 and d_n = min(decay, n/(n+9)) —
// checked against that recurrence in float64 over the masters recorded after each of 6 steps (decay 0.3:
// the warm-up rules steps 2–3, the cap steps 4–6), within 2e-6; and the EMA is not the weights.
TEST_P(Trainers, EmaIsTheWarmedUpDecayedAverageOfTheWeights) {
  const std::string dir = scratch(GetParam() + "-ema");
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    auto config = tiny(GetParam(), streamed, dir);
    config.train.ema_decay = 0.3;
    auto trainer = trainer_of(config);
    std::map<std::string, torch::Tensor> reference;
    for (int64_t n = 1; n <= 6; ++n) {
      ASSERT_FALSE(trainer->step().skipped);
      const auto state = trainer->training_state();
      ASSERT_TRUE(state.ema_valid);
      const double d = n == 1 ? 0.0 : std::min(0.3, static_cast<double>(n) / static_cast<double>(n + 9));
      for (const auto& [name, w] : state.master) {
        const auto w64 = w.to(torch::kFloat64);
        reference[name] = n == 1 ? w64.clone() : d * reference.at(name) + (1 - d) * w64;
      }
      ASSERT_EQ(state.ema.size(), state.master.size());
      double apart = 0;
      for (size_t i = 0; i < state.ema.size(); ++i) {
        const auto& [name, e] = state.ema[i];
        ASSERT_EQ(name, state.master[i].first);
        EXPECT_LT((e.to(torch::kFloat64) - reference.at(name)).abs().max().item<double>(), 2e-6)
            << name << " after step " << n;
        apart = std::max(apart, (e - state.master[i].second).abs().max().item<double>());
      }
      if (n > 1) EXPECT_GT(apart, 1e-5) << "after step " << n << " the EMA equals the weights";
    }
  }
  io::remove_tree(dir);
}

// Property: the EMA is part of the training state: carried to a new trainer after 2 steps, it continues
// bit for bit (the EMA after 4 steps equals the uninterrupted run's); a state without an EMA (a run that
// turns train.ema_decay on at a resume) starts it at the loaded weights.
TEST_P(Trainers, EmaIsCarriedWithTheStateOrStartsAtTheLoadedWeights) {
  const std::string dir = scratch(GetParam() + "-ema-state");
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    auto config = tiny(GetParam(), streamed, dir);
    config.train.ema_decay = 0.5;
    auto whole = trainer_of(config), first = trainer_of(config);
    for (int i = 0; i < 2; ++i) whole->step(), first->step();
    auto second = trainer_of(config);
    second->load_training_state(first->training_state());
    for (int i = 0; i < 2; ++i) whole->step(), second->step();
    const auto a = whole->training_state(), b = second->training_state();
    ASSERT_EQ(a.ema.size(), b.ema.size());
    for (size_t i = 0; i < a.ema.size(); ++i)
      EXPECT_TRUE(torch::equal(a.ema[i].second, b.ema[i].second)) << a.ema[i].first;

    auto plain_config = config;
    plain_config.train.ema_decay = 0.0;
    auto plain = trainer_of(plain_config);
    plain->step();
    const auto without = plain->training_state();
    EXPECT_FALSE(without.ema_valid);
    EXPECT_TRUE(without.ema.empty());
    auto turned_on = trainer_of(config);
    turned_on->load_training_state(without);
    const auto started = turned_on->training_state();
    ASSERT_EQ(started.ema.size(), without.master.size());
    for (size_t i = 0; i < started.ema.size(); ++i)
      EXPECT_TRUE(torch::equal(started.ema[i].second, without.master[i].second)) << started.ema[i].first;
  }
  io::remove_tree(dir);
}

// Property: the log names the vector loops the host kernels run, as the kernels themselves pick them: CpuAdamW's in
// both modes on the CPU, and the 3D-DSA row kernel's only for a 3D-DSA model (the tiny DiT is one, the tiny Wan has
// dense attention): forced to the baseline loops, those; forced to the AVX512-BF16 loops (where the CPU has them),
// those with bf16 compute and the AVX-512 loops they are for fp32 inputs.
TEST_P(Trainers, TheLogNamesTheVectorLoopsInUse) {
  namespace detail = megaslide::ops::detail;
  struct Restore {
    ~Restore() { detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAuto); }
  } restore;
  const std::string dir = scratch(GetParam() + "-loops");
  const auto line_of = [&](const RunConfig& config) {
    auto trainer = trainer_of(config);
    std::vector<std::string> info, warnings;
    trainer->describe(info, warnings);
    std::string line;
    for (const auto& i : info)
      if (i.rfind("CPU vector loops", 0) == 0) line = i;
    return line;
  };
  const std::string adamw =
      std::string("CPU vector loops in use: CpuAdamW ") + offload::to_string(offload::CpuAdamW::detect());
  const bool dit = GetParam() == "dit";
  detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kBaseline);
  for (const bool streamed : {false, true})
    EXPECT_EQ(line_of(tiny(GetParam(), streamed, dir)), adamw + (dit ? ", 3D-DSA baseline" : ""))
        << (streamed ? "streamed" : "resident");
  try {
    detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAvx512Bf16);
  } catch (const std::invalid_argument&) {
    io::remove_tree(dir);
    return;  // this CPU lacks AVX512-BF16; the part above ran
  }
  EXPECT_EQ(line_of(tiny(GetParam(), true, dir)), adamw + (dit ? ", 3D-DSA avx512" : "")) << "fp32 compute";
  const auto bf16 =
      megaslide::testing::tiny_run_config(GetParam(), dir, {"offload.enabled=true", "offload.compute_dtype=bf16"});
  EXPECT_EQ(line_of(bf16), adamw + (dit ? ", 3D-DSA avx512bf16" : "")) << "bf16 compute";
  io::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Families, Trainers, ::testing::Values("dit", "wan"));

// Property: every model.arch has its family, and the DiT family's architectures share one.
// Property: offload.activations host trains bit for bit as device does — the same losses and masters over 3 steps
// of 2 micro-batches — in async mode with every copy landing 2 ms late (a destination reads NaN until its copy
// lands, so a missing wait shows) and in sync mode; its extra PCIe traffic is the planner's, (L - 1) block inputs
// each way per micro-batch, and the device keeps the planner's min(L + 1, 3) checkpoints (the CPU's accounting).
// The resident loop refuses it, naming the key.
TEST_P(Trainers, HostActivationsTrainAsDeviceActivations) {
  const std::string dir = scratch(GetParam() + "-host-activations");
  const auto hw = plan::load_hardware_profile("h200");
  for (const std::string mode : {"async", "sync"}) {
    SCOPED_TRACE(mode);
    std::vector<std::string> sets{"offload.enabled=true", "offload.compute_dtype=fp32",
                                  "train.grad_clip=1.0",  "train.grad_accum_steps=2",
                                  "offload.mode=" + mode, "offload.emulated_copy_delay_ms=2"};
    const auto device_config = megaslide::testing::tiny_run_config(GetParam(), dir, sets, /*layers=*/3);
    sets.push_back("offload.activations=host");
    const auto host_config = megaslide::testing::tiny_run_config(GetParam(), dir, sets, /*layers=*/3);
    const auto device_plan = plan::plan_step(device_config, hw), host_plan = plan::plan_step(host_config, hw);
    ASSERT_GT(host_plan.transfer.activation_bytes, 0);
    auto on_device = trainer_of(device_config), on_host = trainer_of(host_config);
    for (int i = 0; i < 3; ++i) {
      const auto a = on_device->step(), b = on_host->step();
      ASSERT_FALSE(a.skipped || b.skipped);
      EXPECT_EQ(a.loss, b.loss) << "step " << i + 1;
      EXPECT_EQ(b.h2d_bytes - a.h2d_bytes, host_plan.transfer.activation_bytes);
      EXPECT_EQ(b.d2h_bytes - a.d2h_bytes, host_plan.transfer.activation_bytes);
      EXPECT_EQ(a.h2d_bytes, device_plan.transfer.h2d_bytes);
      EXPECT_EQ(b.h2d_bytes, host_plan.transfer.h2d_bytes);
      EXPECT_EQ(a.peak_device_bytes - b.peak_device_bytes,
                device_plan.device.checkpoints - host_plan.device.checkpoints);
    }
    on_device->synchronize();
    on_host->synchronize();
    // train.log says where the checkpoints go.
    std::vector<std::string> info, warnings;
    on_host->describe(info, warnings);
    std::string said;
    for (const auto& line : info) said += line + "\n";
    EXPECT_NE(said.find("activations: offload.activations host"), std::string::npos) << said;
    const auto da = masters(*on_device), ha = masters(*on_host);
    for (const auto& [name, t] : da) EXPECT_TRUE(torch::equal(t, ha.at(name))) << name;
  }
  auto resident = tiny(GetParam(), false, dir);
  resident.offload.activations = "host";
  try {
    validate(resident, "test");
    ADD_FAILURE() << "the resident loop accepted offload.activations: host";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("offload.activations"), std::string::npos) << e.what();
  }
  io::remove_tree(dir);
}

// Property: diffusion.loss_weighting reaches each family's loss in both modes. Weights of exactly 1 (Min-SNR-γ with
// γ above every SNR and ε-prediction: min(SNR, γ) / SNR = 1) train as the unweighted run does (losses within 1e-6
// relative over 2 steps: only the sum's order differs). Real weights — Min-SNR-γ with x0-prediction, and Wan's flow
// matching under cosmap — give other losses than the same run unweighted, and under them the streamed trainer
// follows the resident loop (1e-4 relative over 3 steps, as without weights).
TEST_P(Trainers, LossWeightingReachesTheLossInBothModes) {
  const std::string dir = scratch(GetParam() + "-loss-weighting");
  using Sets = std::vector<std::string>;
  const auto losses = [&](bool streamed, Sets sets, int steps) {
    sets.push_back("offload.enabled=" + std::string(streamed ? "true" : "false"));
    sets.push_back("offload.compute_dtype=fp32");
    auto trainer = trainer_of(megaslide::testing::tiny_run_config(GetParam(), dir, sets));
    std::vector<double> out;
    for (int i = 0; i < steps; ++i) {
      const auto m = trainer->step();
      EXPECT_FALSE(m.skipped) << "step " << i + 1;
      out.push_back(m.loss);
    }
    return out;
  };
  const Sets ddpm{"diffusion.objective=ddpm"};  // the DiT family's objective; Wan's other one
  const auto with = [](Sets sets, const Sets& more) {
    sets.insert(sets.end(), more.begin(), more.end());
    return sets;
  };
  const auto plain = losses(false, ddpm, 2);
  const auto ones = losses(false, with(ddpm, {"diffusion.loss_weighting=min_snr", "diffusion.snr_gamma=1e6"}), 2);
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(ones[i], plain[i], 1e-6 * std::abs(plain[i])) << "step " << i + 1;
  // {unweighted, weighted}
  std::vector<std::pair<Sets, Sets>> runs{
      {with(ddpm, {"diffusion.prediction=x0"}),
       with(ddpm, {"diffusion.prediction=x0", "diffusion.loss_weighting=min_snr", "diffusion.snr_gamma=5"})}};
  if (GetParam() == "wan")
    runs.push_back({{"diffusion.objective=flow"}, {"diffusion.objective=flow", "diffusion.loss_weighting=cosmap"}});
  for (const auto& [unweighted, weighted] : runs) {
    SCOPED_TRACE(weighted.back());
    const double reference = losses(false, unweighted, 1)[0];
    const auto resident = losses(false, weighted, 3), streamed = losses(true, weighted, 3);
    EXPECT_GT(std::abs(resident[0] - reference), 1e-3 * reference) << "the weights changed nothing";
    for (size_t i = 0; i < 3; ++i)
      EXPECT_NEAR(streamed[i], resident[i], 1e-4 * std::abs(resident[i])) << "step " << i + 1;
  }
  io::remove_tree(dir);
}

// Property: the weighted loss (diffusion.loss_weighting) is the mean over the samples of each one's weight times its
// mean squared error — over its kept frames with a loss mask — as a float64 reference computes it (1e-6 relative),
// and the mean of its values over any split of the batch into samples (data parallelism's).
TEST(ModelFamily, TheWeightedLossIsTheMeanOfEachSamplesWeightedError) {
  auto g = at::detail::createCPUGenerator(7);
  const auto prediction = torch::randn({3, 2, 4, 3, 3}, g), target = torch::randn({3, 2, 4, 3, 3}, g);
  const auto weights = torch::tensor({0.25f, 2.0f, 0.5f});
  auto mask = torch::ones({3, 1, 4, 1, 1});
  mask[1].select(1, 0).zero_();
  mask[2].narrow(1, 1, 2).zero_();
  const auto sq = (prediction.to(torch::kFloat64) - target.to(torch::kFloat64)).square();
  for (const bool masked : {false, true}) {
    SCOPED_TRACE(masked ? "masked" : "whole");
    const auto m = masked ? mask : torch::Tensor();
    double expected = 0.0;
    for (int64_t b = 0; b < 3; ++b) {
      const auto kept = masked ? mask[b].to(torch::kFloat64).expand_as(sq[b]) : torch::ones_like(sq[b]);
      expected += weights[b].item<double>() * (sq[b] * kept).sum().item<double>() / kept.sum().item<double>() / 3.0;
    }
    const double loss = context_parallel_loss(prediction, target, m, {}, 1, weights).item<double>();
    EXPECT_NEAR(loss, expected, 1e-6 * expected);
    double split = 0.0;
    for (int64_t b = 0; b < 3; ++b)
      split += context_parallel_loss(prediction.narrow(0, b, 1), target.narrow(0, b, 1),
                                     masked ? mask.narrow(0, b, 1) : torch::Tensor(), {}, 1, weights.narrow(0, b, 1))
                   .item<double>() /
               3.0;
    EXPECT_NEAR(split, expected, 1e-6 * expected);
  }
  EXPECT_THROW(context_parallel_loss(prediction, target, {}, {}, 1, weights.narrow(0, 0, 2)), c10::Error);
}

// Property: the validation loss (train.val_every) is the training loss of the current weights over the validation
// data, drawn the same each time, in both modes of each family. With the training data as validation data (no
// caption dropped) and one batch, the loss before the first step is that step's loss (1e-5 relative: the resident
// loop's own module; the streamed trainer's, its blocks streamed from the host store); measured twice without a step
// between, it is the same bits; after 2 steps it differs from before, and the two modes agree within 1e-4; a trainer
// that never measures it trains the same bits. DiT: held-out clips (train.val_data: another data.seed) give another
// value. Streamed with bf16 compute (the blocks from the store's bf16 copy): measuring between steps changes no
// training bit, and after 2 steps the value is the fp32 runs' within bf16's rounding (1e-2).
TEST_P(Trainers, ValidationLossIsTheTrainingLossOfTheValidationData) {
  const std::string dir = scratch(GetParam() + "-val-loss");
  std::vector<double> after;
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    // x0-prediction for the DiT family: its output starts at zero (adaLN-zero), so the first loss is the clips'.
    std::vector<std::string> sets{"offload.enabled=" + std::string(streamed ? "true" : "false"),
                                  "offload.compute_dtype=fp32", "diffusion.caption_dropout=0", "train.val_every=1",
                                  "train.val_batches=1"};
    if (GetParam() == "dit") sets.push_back("diffusion.prediction=x0");
    const auto config = megaslide::testing::tiny_run_config(GetParam(), dir, sets);
    const RunConfig val = validation_data_config(config, "test");
    Trainer trainer = megaslide::testing::trainer_with_validation(config, val);
    const double before = trainer.validation_loss();
    EXPECT_EQ(trainer.validation_loss(), before) << "the same draws each time";
    const auto first = trainer.step();
    EXPECT_NEAR(before, first.loss, 1e-5 * first.loss) << "the first step's batch at the first step's weights";
    const auto second = trainer.step();
    const double now = trainer.validation_loss();
    EXPECT_EQ(trainer.validation_loss(), now);
    EXPECT_GT(std::abs(now - before), 1e-6 * before) << "the weights changed";
    after.push_back(now);
    // Measuring changes nothing of the training: the same steps without it give the same bits.
    auto plain = trainer_of(config);
    EXPECT_EQ(plain->step().loss, first.loss);
    EXPECT_EQ(plain->step().loss, second.loss);
    EXPECT_EQ(plain->step().loss, trainer.step().loss);
    if (GetParam() == "dit" && !streamed) {  // held out: other clips
      RunConfig held_config = config;
      held_config.train.val_data = {"data.seed=777"};
      const RunConfig held = validation_data_config(held_config, "test");
      Trainer other = megaslide::testing::trainer_with_validation(config, held);
      EXPECT_GT(std::abs(other.validation_loss() - before), 1e-3 * before);
    }
  }
  EXPECT_NEAR(after[1], after[0], 1e-4 * after[0]) << "streamed vs resident";
  {
    SCOPED_TRACE("streamed, bf16");
    std::vector<std::string> sets{"offload.enabled=true", "offload.compute_dtype=bf16", "diffusion.caption_dropout=0",
                                  "train.val_every=1", "train.val_batches=1"};
    if (GetParam() == "dit") sets.push_back("diffusion.prediction=x0");
    const auto config = megaslide::testing::tiny_run_config(GetParam(), dir, sets);
    Trainer trainer = megaslide::testing::trainer_with_validation(config, validation_data_config(config, "test"));
    auto plain = trainer_of(config);
    trainer.validation_loss();
    EXPECT_EQ(trainer.step().loss, plain->step().loss);
    trainer.validation_loss();
    EXPECT_EQ(trainer.step().loss, plain->step().loss);
    EXPECT_NEAR(trainer.validation_loss(), after[1], 1e-2 * after[1]);
    EXPECT_EQ(trainer.step().loss, plain->step().loss);
    // The validation model runs in the trainer's two device slots (allocating none of its own): its blocks are
    // uploaded by the trainer's streamer, whose counts start again at each step.
    const auto& streamer = trainer.engine()->streamer();
    const int64_t copies = streamer.stats().h2d_copies;
    trainer.validation_loss();
    EXPECT_GE(streamer.stats().h2d_copies, copies + streamer.num_blocks());
    EXPECT_EQ(streamer.max_resident_blocks(), 2);
    EXPECT_EQ(trainer.step().loss, plain->step().loss);
  }
  io::remove_tree(dir);
}

TEST(ModelFamily, EveryArchitectureHasItsFamily) {
  EXPECT_EQ(model_family(Architecture::kWan).name(), "Wan");
  for (const auto arch : {Architecture::kMegaSlide, Architecture::kDense3D, Architecture::kSwin})
    EXPECT_EQ(&model_family(arch), &dit_family()) << to_string(arch);
}

// Property: the device memory a family's trainer keeps across steps is the planner's (plan/step_plan.h:
// the weight and gradient slots, and the resident state less its gradients, which are each step's own),
// for each family in both modes: the ablations' memory accounting and megaslide-plan agree.
TEST_P(Trainers, PersistentDeviceBytesAreThePlans) {
  const std::string dir = scratch(GetParam() + "-persistent");
  for (const bool ema : {false, true})
    for (const bool streamed : {false, true}) {
      SCOPED_TRACE(std::string(streamed ? "streamed" : "resident") + (ema ? ", EMA" : ""));
      auto config = tiny(GetParam(), streamed, dir);
      config.train.ema_decay = ema ? 0.99 : 0.0;
      auto trainer = trainer_of(config);
      const auto plan = plan::plan_step(config, plan::load_hardware_profile("h200"));
      EXPECT_GT(trainer->persistent_device_bytes(), 0);
      // The plan's resident state counts the gradient too (4 of its 16 or, with the EMA, 20 B a parameter).
      const int64_t per_param = ema ? 20 : 16;
      EXPECT_EQ(trainer->persistent_device_bytes(), plan.device.weight_slots + plan.device.gradient_slots +
                                                        plan.device.resident_state / per_param * (per_param - 4));
    }
  io::remove_tree(dir);
}
