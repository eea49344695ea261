// The resident loop (Trainer with offload.enabled: false): the learning-rate schedule, determinism of a run, and a loss
// that falls.
#include "trainers.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

using namespace megaslide::testing;

using namespace megaslide;

namespace {
// A tiny run: 4 frames of 8x8, 64 tokens per clip.
RunConfig tiny_run(Architecture arch, int64_t steps) {
  return parse_run_config(
      "", "test",
      {"model.arch=" + std::string(to_string(arch)), "model.dsa_kernel=[3,3,3]", "model.swin_window=[2,2,2]",
       "data.frames=4", "data.height=8", "data.width=8", "data.num_clips=64", "train.steps=" + std::to_string(steps),
       "train.batch_size=8", "train.lr=3e-3", "train.warmup_steps=5", "train.device=cpu"});
}
}  // namespace

TEST(LearningRate, WarmsUpThenDecaysToTheFloor) {
  TrainConfig t;
  t.lr = 1.0, t.warmup_steps = 4, t.steps = 14, t.min_lr_ratio = 0.1, t.lr_schedule = "cosine";
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(t, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 4), 1.0);
  EXPECT_NEAR(learning_rate(t, 13), 0.1, 1e-12);  // the last step reaches the floor
  EXPECT_NEAR(learning_rate(t, 8), 0.1 + 0.45 * (1 + std::cos(M_PI * 4.0 / 9.0)), 1e-12);  // 4 of 9 decay steps
  t.lr_schedule = "constant";
  EXPECT_DOUBLE_EQ(learning_rate(t, 13), 1.0);
}

TEST(ResidentLoop, SameConfigGivesTheSameLossesBitForBit) {
  auto config = tiny_run(Architecture::kMegaSlide, 3);
  Trainer a = resident_trainer(config), b = resident_trainer(config);
  for (int i = 0; i < 3; ++i) {
    auto ma = a.step(), mb = b.step();
    EXPECT_EQ(ma.loss, mb.loss) << "step " << i;
    EXPECT_EQ(ma.grad_norm, mb.grad_norm) << "step " << i;
  }
}

TEST(ResidentLoop, LossFallsOverAShortRun) {
  for (auto arch : {Architecture::kMegaSlide, Architecture::kDense3D, Architecture::kSwin}) {
    Trainer trainer = resident_trainer(tiny_run(arch, 60));
    double first = 0, last = 0;
    for (int i = 0; i < 60; ++i) {
      auto m = trainer.step();
      ASSERT_TRUE(std::isfinite(m.loss)) << to_string(arch) << " step " << m.step;
      if (i < 10) first += m.loss / 10;
      if (i >= 50) last += m.loss / 10;
    }
    // The untrained model predicts ε = 0 (loss ≈ 1); a working loop learns the data well below that.
    EXPECT_GT(first, 0.6) << to_string(arch);
    EXPECT_LT(last, 0.6 * first) << to_string(arch) << ": first " << first << " last " << last;
  }
}

TEST(ResidentLoop, AskingForAMissingGpuFailsClearly) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  try {
    resolve_device("cuda");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA GPU"), std::string::npos) << e.what();
  }
}
