// Full-parameter training of Wan (train/wan_trainer.h) on tiny models and latent tensors the tests make:
// the streamed trainer's gradients against PyTorch autograd on diffusers' model (the fixture's training
// step, tests/fixtures/wan/), streamed == resident step after step, loss falls with bf16 blocks, a
// checkpoint resumes bit for bit, and the 3D-DSA retrofit trains its offsets from a dense checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <tuple>

#include "megaslide/diffusion/wan_text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/io/finite_weights.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/run_outputs.h"
#include "megaslide/train/training_run.h"
#include "trainers.h"

using namespace megaslide::testing;
using megaslide::Trainer;

using megaslide::RunConfig;
using megaslide::WanLatentData;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan";

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-wantrain-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

// Fixture model "a"'s sizes (tools/make_fixtures.py), latents of 4 × 3 × 6 × 8, text of 7 × 20.
RunConfig tiny_config(std::vector<std::string> overrides = {}) {
  const std::string yaml = R"(
model:
  arch: wan
  wan: {dim: 24, layers: 2, heads: 2, ffn_dim: 40, freq_dim: 16, text_dim: 20, patch: [1, 2, 2], in_channels: 4, out_channels: 4}
data: {dataset: latent-tensors, channels: 4, frames: 3, height: 6, width: 8, max_text_tokens: 7}
diffusion: {objective: flow, shift: 3.0, caption_dropout: 0.0}
train: {steps: 50, batch_size: 2, lr: 0.002, warmup_steps: 0, lr_schedule: constant, grad_clip: 1.0, device: cpu, seed: 5}
offload: {compute_dtype: fp32, mode: async, emulated_copy_delay_ms: 2}
)";
  return megaslide::parse_run_config(yaml, "test", overrides);
}

// Latent videos with structure a model can learn (smooth waves whose phase depends on the sample) and a
// text embedding per video.
WanLatentData tiny_data(int64_t n = 4, int64_t text_tokens = 7) {
  WanLatentData d;
  auto t = torch::arange(3).view({1, 1, 3, 1, 1}).to(torch::kFloat32);
  auto h = torch::arange(6).view({1, 1, 1, 6, 1}).to(torch::kFloat32);
  auto w = torch::arange(8).view({1, 1, 1, 1, 8}).to(torch::kFloat32);
  auto phase = torch::arange(n).view({n, 1, 1, 1, 1}).to(torch::kFloat32);
  auto c = torch::arange(4).view({1, 4, 1, 1, 1}).to(torch::kFloat32);
  d.latents = torch::sin(0.7 * w + 0.5 * h + 0.3 * t + phase + c);
  torch::manual_seed(42);
  d.text = torch::randn({n, text_tokens, 20});
  d.empty_text = torch::zeros({text_tokens, 20});
  return d;
}

double max_difference(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                      const std::vector<std::pair<std::string, torch::Tensor>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    worst = std::max(worst, (a[i].second - b[i].second).abs().max().item<double>());
  }
  return worst;
}

}  // namespace

// The property: the streamed trainer's gradients of one step — blocks from the host store, the resident
// fp32 parts (prologue, every block's scale_shift_table and norm2, head) from the device — are PyTorch
// autograd's on diffusers' model for the same batch, within 1e-4 of each gradient's scale (fp32 compute).
TEST(WanTraining, StreamedGradientsAreAutogradsOnDiffusers) {
  std::map<std::string, torch::Tensor> r;
  for (auto& [name, t] : megaslide::io::read_safetensors(kFixtures + "/reference.safetensors").tensors) r[name] = t;
  auto weights = megaslide::WanWeights::open(kFixtures + "/a/diffusers");
  auto options = megaslide::WanOptions::from_config(tiny_config());
  megaslide::WanTransformer model(options);
  megaslide::load_wan_weights(weights, *model);
  auto stack = std::make_shared<megaslide::WanStack>(model);
  megaslide::offload::StackTrainerOptions o;
  o.compute_dtype = at::kFloat;
  o.emulated_copy_delay_ms = 2;
  o.adamw.lr = 0.0;
  megaslide::offload::StreamedStackTrainer engine(stack, o);

  const auto x0 = r.at("a.train.x0"), noise = r.at("a.train.noise"), sigma = r.at("a.train.sigma");
  megaslide::WanBatch batch;
  batch.xt = megaslide::flow_noisy(x0, noise, sigma);
  batch.target = megaslide::flow_target(x0, noise);
  batch.timesteps = sigma * 1000;
  batch.text = r.at("a.text");
  const auto result = megaslide::wan_streamed_step(
      engine, model, [&] { return batch; }, /*lr=*/0.0);
  engine.synchronize();
  EXPECT_NEAR(result.loss, r.at("a.train.loss").item<double>(), 1e-5 * r.at("a.train.loss").item<double>());

  double worst = 0.0;
  int compared = 0;
  const auto& store = engine.store();
  for (int64_t l = 0; l < store.num_blocks(); ++l) {
    for (const auto& spec : store.block_spec(l).params) {
      const std::string name = "blocks." + std::to_string(l) + "." + spec.name;
      const auto& ref = r.at("a.grad." + name);
      const auto grad = store.param(l, spec.name).grad;
      const double error = (grad - ref).abs().max().item<double>() / std::max(1e-12, ref.abs().max().item<double>());
      EXPECT_LT(error, 1e-4) << name;
      worst = std::max(worst, error), ++compared;
    }
  }
  for (auto& [name, p] : stack->named_resident_parameters()) {
    const auto& ref = r.at("a.grad." + name);
    ASSERT_TRUE(p.grad().defined()) << name;
    const double error = (p.grad() - ref).abs().max().item<double>() / std::max(1e-12, ref.abs().max().item<double>());
    EXPECT_LT(error, 1e-4) << name;
    worst = std::max(worst, error), ++compared;
  }
  std::cout << compared << " gradients (streamed and resident), largest difference " << worst
            << " of the gradient's scale\n";
  EXPECT_EQ(compared, 69);
}

// The property: the streamed trainer (fp32 compute, emulated asynchronous copies 2 ms late) gives the
// resident loop's weights and losses step after step, with clipping on and off and with accumulation.
TEST(WanTraining, StreamedEqualsResident) {
  for (const auto& extra :
       std::vector<std::vector<std::string>>{{}, {"train.grad_clip=0"}, {"train.grad_accum_steps=2"}}) {
    auto streamed_config = tiny_config(extra);
    auto resident_config = tiny_config(extra);
    resident_config.offload.enabled = false;
    Trainer streamed = wan_trainer(streamed_config, tiny_data()), resident = wan_trainer(resident_config, tiny_data());
    ASSERT_TRUE(streamed.streams());
    ASSERT_FALSE(resident.streams());
    EXPECT_EQ(streamed.parameter_count(), resident.parameter_count());
    EXPECT_EQ(max_difference(streamed.master_weights(), resident.master_weights()), 0.0) << "the same initial weights";
    double worst = 0.0;
    for (int s = 0; s < 4; ++s) {
      const auto a = streamed.step(), b = resident.step();
      EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss)) << "step " << s;
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-4 * b.grad_norm) << "step " << s;
      worst = std::max(worst, max_difference(streamed.master_weights(), resident.master_weights()));
    }
    std::cout << (extra.empty() ? "clip 1" : extra[0]) << ": largest weight difference over 4 steps " << worst << "\n";
    EXPECT_LT(worst, 1e-5);
  }
}

// The property: a tiny Wan trained by the streamed trainer with bf16 blocks (fp32 tables, norms and
// masters) learns: the mean loss of steps 41–50 is well below that of steps 1–10.
TEST(WanTraining, LossFallsWithBf16Blocks) {
  auto config = tiny_config({"offload.compute_dtype=bf16", "offload.emulated_copy_delay_ms=0", "train.lr=0.003"});
  Trainer trainer = wan_trainer(config, tiny_data());
  double first = 0.0, last = 0.0;
  for (int s = 0; s < 50; ++s) {
    const auto m = trainer.step();
    ASSERT_FALSE(m.skipped) << "step " << s;
    if (s < 10) first += m.loss / 10;
    if (s >= 40) last += m.loss / 10;
  }
  std::cout << "mean loss, steps 1-10: " << first << ", steps 41-50: " << last << "\n";
  EXPECT_LT(last, 0.7 * first);
}

// The property: a checkpoint written at step 3 and loaded into a fresh trainer continues exactly: the
// losses of steps 4–6 and every master weight and AdamW moment after step 6 are bit-identical to the
// uninterrupted run's (bf16 blocks, clipping, asynchronous copies).
TEST(WanTraining, CheckpointResumesBitExactly) {
  // fp32 moments, and int8 moments, whose per-group scales the checkpoint must keep too.
  for (const char* moments : {"fp32", "int8"}) {
    SCOPED_TRACE(std::string(moments) + " moments");
    auto config = tiny_config({"offload.compute_dtype=bf16", "offload.emulated_copy_delay_ms=1",
                               std::string("optimizer.state_dtype=") + moments});
    const auto dir = temp_dir(std::string("resume-") + moments);
    std::vector<double> losses;
    megaslide::TrainingState after;
    {
      Trainer trainer = wan_trainer(config, tiny_data());
      for (int s = 0; s < 6; ++s) {
        losses.push_back(trainer.step().loss);
        if (s == 2) megaslide::save_checkpoint(dir, config, trainer.training_state());
      }
      after = trainer.training_state();
      for (auto* list :
           {&after.master, &after.exp_avg, &after.exp_avg_sq, &after.exp_avg_scale, &after.exp_avg_sq_scale})
        for (auto& [name, t] : *list) t = t.clone();  // the store's views outlive the trainer only as copies
    }
    Trainer resumed = wan_trainer(config, tiny_data());
    auto state = resumed.training_state();
    megaslide::load_checkpoint(megaslide::latest_checkpoint(dir), config, state);
    resumed.load_training_state(state);
    EXPECT_EQ(resumed.steps_done(), 3);
    for (int s = 3; s < 6; ++s) EXPECT_EQ(resumed.step().loss, losses[static_cast<size_t>(s)]) << "step " << s + 1;
    const auto again = resumed.training_state();
    const std::pair<const megaslide::io::NamedTensors*, const megaslide::io::NamedTensors*> lists[3] = {
        {&after.master, &again.master}, {&after.exp_avg, &again.exp_avg}, {&after.exp_avg_sq, &again.exp_avg_sq}};
    for (const auto& [a, b] : lists) {
      ASSERT_EQ(a->size(), b->size());
      for (size_t i = 0; i < a->size(); ++i) EXPECT_TRUE(torch::equal((*a)[i].second, (*b)[i].second)) << (*a)[i].first;
    }
    EXPECT_EQ(again.optimizer_steps, after.optimizer_steps);
    if (std::string(moments) == "int8") {
      ASSERT_FALSE(after.exp_avg_scale.empty());
      ASSERT_EQ(again.exp_avg_scale.size(), after.exp_avg_scale.size());
      for (size_t i = 0; i < after.exp_avg_scale.size(); ++i) {
        EXPECT_TRUE(torch::equal(after.exp_avg_scale[i].second, again.exp_avg_scale[i].second))
            << after.exp_avg_scale[i].first;
        EXPECT_TRUE(torch::equal(after.exp_avg_sq_scale[i].second, again.exp_avg_sq_scale[i].second))
            << after.exp_avg_sq_scale[i].first;
      }
    } else {
      EXPECT_TRUE(again.exp_avg_scale.empty());
    }
    megaslide::io::remove_tree(dir);
  }
}

// The property: the ranks' slices of WanBatchSource, side by side, are the single-process batch — the
// same latents, caption dropout, σ and noise for every item of the global batch, batch after batch, for
// flow matching and DDPM; a batch that does not split over the ranks is refused.
TEST(WanBatchSource, RankSlicesConcatenateToTheSingleProcessBatch) {
  for (const char* objective : {"flow", "ddpm"}) {
    const auto config = tiny_config(
        {"train.batch_size=6", "diffusion.caption_dropout=0.5", std::string("diffusion.objective=") + objective});
    megaslide::WanBatchSource whole(config, tiny_data(5));
    std::vector<std::unique_ptr<megaslide::WanBatchSource>> ranks;
    for (int64_t r = 0; r < 3; ++r) {
      ranks.push_back(std::make_unique<megaslide::WanBatchSource>(config, tiny_data(5)));
      ranks.back()->take_slice(r, 3);
    }
    for (int batch = 0; batch < 3; ++batch) {  // 18 items: crosses epochs of 5 videos
      const auto w = whole.next(torch::kCPU);
      std::vector<megaslide::WanBatch> parts;
      for (auto& r : ranks) parts.push_back(r->next(torch::kCPU));
      auto cat = [&](auto field) {
        std::vector<torch::Tensor> pieces;
        for (auto& p : parts) pieces.push_back(field(p));
        return torch::cat(pieces);
      };
      EXPECT_EQ(parts[0].x0.size(0), 2);
      EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.x0; }), w.x0)) << objective << " batch " << batch;
      EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.noise; }), w.noise)) << objective << " batch " << batch;
      EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.timesteps; }), w.timesteps))
          << objective << " batch " << batch;
      EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.xt; }), w.xt)) << objective << " batch " << batch;
      EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.target; }), w.target)) << objective << " batch " << batch;
      EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.text; }), w.text)) << objective << " batch " << batch;
    }
    megaslide::WanBatchSource odd(config, tiny_data(5));
    EXPECT_THROW(odd.take_slice(0, 4), std::invalid_argument);  // 6 items do not split over 4 ranks
  }
}

// The property: a 3D-DSA Wan starts from a dense checkpoint with only the retrofit's parameters at their
// initialisation, and training moves its offset network away from zero (the offsets learn).
TEST(WanTraining, RetrofitTrainsItsOffsetsFromADenseCheckpoint) {
  auto config = tiny_config(
      {"model.self_attention=dsa3d", "model.dsa_kernel=[3, 3, 3]", "model.wan.weights=" + kFixtures + "/a/diffusers"});
  Trainer trainer = wan_trainer(config, tiny_data());
  EXPECT_EQ(wan_initialised_parameters(trainer).size(), 10u);
  auto masters = trainer.master_weights();
  auto find = [](const std::vector<std::pair<std::string, torch::Tensor>>& list, const std::string& name) {
    for (const auto& [n, t] : list)
      if (n == name) return t;
    ADD_FAILURE() << "no parameter " << name;
    return torch::Tensor();
  };
  EXPECT_EQ(find(masters, "blocks.0.attn1.offset_pw.weight").abs().max().item<double>(), 0.0);
  for (int s = 0; s < 3; ++s) ASSERT_FALSE(trainer.step().skipped);
  masters = trainer.master_weights();
  EXPECT_GT(find(masters, "blocks.0.attn1.offset_pw.weight").abs().max().item<double>(), 0.0);
  EXPECT_GT(find(masters, "blocks.1.attn1.rel_bias").abs().max().item<double>(), 0.0);
}

// The property: data that does not fit the config is refused naming what differs.
TEST(WanTraining, DataThatDoesNotFitIsNamed) {
  auto bad = tiny_data();
  bad.text = torch::randn({4, 7, 19});
  try {
    Trainer trainer = wan_trainer(tiny_config(), bad);
    ADD_FAILURE() << "no error";
  } catch (const megaslide::ConfigError& e) {
    EXPECT_EQ(e.key(), "data.tensors");
    EXPECT_NE(std::string(e.what()).find("model.wan.text_dim"), std::string::npos) << e.what();
  }
  auto no_empty = tiny_data();
  no_empty.empty_text = torch::Tensor();
  try {
    Trainer trainer = wan_trainer(tiny_config({"diffusion.caption_dropout=0.1"}), no_empty);
    ADD_FAILURE() << "no error";
  } catch (const megaslide::ConfigError& e) {
    EXPECT_EQ(e.key(), "data.tensors");
    EXPECT_NE(std::string(e.what()).find("empty_text"), std::string::npos) << e.what();
  }
  // More latent videos than texts (the last ones never trained), and fewer (an index out of range at the first batch).
  const auto dir = temp_dir("uneven");
  for (const int64_t texts : {3, 6}) {
    const auto data = tiny_data();
    const std::string file = dir + "/uneven.safetensors";
    megaslide::io::write_safetensors(
        file, {{"latents", data.latents}, {"text", torch::randn({texts, 7, 20})}, {"empty_text", data.empty_text}});
    try {
      Trainer trainer = megaslide::make_trainer(tiny_config({"data.tensors=" + file}));
      ADD_FAILURE() << "no error for " << texts << " texts";
    } catch (const megaslide::ConfigError& e) {
      EXPECT_EQ(e.key(), "data.tensors");
      EXPECT_NE(std::string(e.what()).find("4 latent videos and " + std::to_string(texts) +
                                           " texts, expected one text per latent video"),
                std::string::npos)
          << e.what();
    }
  }
  megaslide::io::remove_tree(dir);
}

// The property: a data.tensors file is mapped, not copied: its tensors stay in the dtype the file stores (bf16 here),
// batches read from it are float32 and equal, bit for bit, the batches of a float32 file of the same values; a tensor
// holding a NaN, one of integers and a name Wan does not read are refused naming the file and the tensor.
TEST(WanTraining, TensorsFileIsMappedAndReadBatchByBatch) {
  const auto dir = temp_dir("mapped");
  const auto data = tiny_data();
  const auto rounded = data.latents.to(torch::kBFloat16), text = data.text.to(torch::kBFloat16);
  megaslide::io::write_safetensors(dir + "/bf16.safetensors",
                                   {{"latents", rounded}, {"text", text}, {"empty_text", data.empty_text}});
  megaslide::io::write_safetensors(
      dir + "/fp32.safetensors",
      {{"latents", rounded.to(torch::kFloat32)}, {"text", text.to(torch::kFloat32)}, {"empty_text", data.empty_text}});
  const auto mapped = WanLatentData::load(dir + "/bf16.safetensors");
  EXPECT_EQ(mapped.latents.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(mapped.text.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(mapped.rows("latents", {2, 0}).scalar_type(), torch::kFloat32);
  EXPECT_TRUE(
      torch::equal(mapped.rows("latents", {2, 0}), rounded.index_select(0, torch::tensor({2, 0})).to(torch::kFloat32)));
  const auto config = megaslide::wan_latent_config(tiny_config({"diffusion.caption_dropout=0.5"}));
  megaslide::WanBatchSource from_bf16(config, mapped),
      from_fp32(config, WanLatentData::load(dir + "/fp32.safetensors"));
  for (int k = 0; k < 4; ++k) {
    const auto a = from_bf16.next(torch::kCPU), b = from_fp32.next(torch::kCPU);
    EXPECT_TRUE(torch::equal(a.xt, b.xt) && torch::equal(a.text, b.text) && torch::equal(a.target, b.target)) << k;
  }
  const auto refusal = [&](const megaslide::io::NamedTensors& tensors) {
    megaslide::io::write_safetensors(dir + "/bad.safetensors", tensors);
    try {
      WanLatentData::load(dir + "/bad.safetensors");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "accepted";
    return std::string();
  };
  auto with_nan = data.latents.clone();
  with_nan[1][0][0][0][0] = NAN;
  auto what = refusal({{"latents", with_nan}, {"text", data.text}});
  EXPECT_NE(what.find("latents"), std::string::npos) << what;
  EXPECT_NE(what.find("bad.safetensors"), std::string::npos) << what;
  EXPECT_NE(what.find("holds a NaN or an infinity in item 1 of 4"), std::string::npos) << what;
  EXPECT_EQ(what.find("weights"), std::string::npos) << "data, not weights: " << what;
  {
    // --allow-nonfinite-weights is for weights: the data is refused all the same.
    megaslide::io::set_nonfinite_weights_allowed(true);
    what = refusal({{"latents", with_nan}, {"text", data.text}});
    megaslide::io::set_nonfinite_weights_allowed(false);
    EXPECT_NE(what.find("holds a NaN or an infinity in item 1 of 4"), std::string::npos) << what;
  }
  what = refusal({{"latents", data.latents}, {"text", data.text.to(torch::kInt32)}});
  EXPECT_NE(what.find("tensor 'text' is"), std::string::npos) << what;
  what = refusal({{"latents", data.latents}, {"text", data.text}, {"captions", data.text}});
  EXPECT_NE(what.find("unexpected tensor 'captions'"), std::string::npos) << what;
}

namespace {
std::vector<double> losses_of(const std::string& run_dir) {
  std::vector<double> out;
  std::ifstream in(megaslide::io::join_path(run_dir, "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}
}  // namespace

// The property: megaslide-train's loop (run_training) trains Wan from data.tensors — fresh, and resumed
// from a checkpoint into the same losses as an uninterrupted run, bit for bit; a missing data file, a
// missing data.tensors and image-to-video-sized data are ConfigErrors naming the key.
TEST(WanTraining, TrainingRunTrainsAndResumesWan) {
  const auto dir = temp_dir("run");
  const auto data = tiny_data();
  const std::string tensors = dir + "/latents.safetensors";
  megaslide::io::write_safetensors(tensors,
                                   {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
  const std::vector<std::string> common{
      "data.tensors=" + tensors,  "offload.compute_dtype=bf16", "offload.emulated_copy_delay_ms=0",
      "train.checkpoint_every=3", "output.progress=false",      "diffusion.caption_dropout=0.25"};
  auto with = [&](const std::string& run, const std::vector<std::string>& extra) {
    auto overrides = common;
    for (const auto& e : extra) overrides.push_back(e);  // after the common ones: they win
    overrides.push_back("output.run_dir=" + dir + "/" + run);
    return tiny_config(overrides);
  };
  megaslide::run_training(with("whole", {"train.steps=6"}), {});
  megaslide::run_training(with("part", {"train.steps=3"}), {});
  megaslide::TrainingRunOptions resume;
  resume.resume = "latest";
  const auto r = megaslide::run_training(with("part", {"train.steps=6"}), resume);
  EXPECT_EQ(r.first_step, 3);
  EXPECT_EQ(r.steps_done, 6);
  const auto whole = losses_of(dir + "/whole"), part = losses_of(dir + "/part");
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(part.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(part[i], whole[i]) << "step " << i + 1;
  EXPECT_TRUE(megaslide::io::path_exists(dir + "/whole/checkpoints/step-0000006/master.safetensors"));

  // train.init_from a Wan run folder: a fresh trainer (streamed, bf16 blocks) starts from the latest
  // checkpoint's fp32 masters bit for bit, every parameter matched by its diffusers name.
  {
    const auto masters =
        megaslide::io::read_safetensors(dir + "/whole/checkpoints/step-0000006/master.safetensors").tensors;
    Trainer from = wan_trainer(with("unused", {"train.init_from=" + dir + "/whole"}), tiny_data());
    EXPECT_EQ(from.init_plan().tensors.size(), masters.size());
    std::map<std::string, torch::Tensor> expected(masters.begin(), masters.end());
    const auto got = from.master_weights();
    ASSERT_EQ(got.size(), expected.size());
    for (const auto& [name, value] : got) {
      ASSERT_TRUE(expected.count(name)) << name;
      EXPECT_TRUE(torch::equal(value, expected.at(name))) << name;
    }
  }

  auto expect_config_error = [&](const RunConfig& c, const std::string& key) {
    try {
      megaslide::run_training(c, {});
      ADD_FAILURE() << "no error for " << key;
    } catch (const megaslide::ConfigError& e) {
      EXPECT_EQ(e.key(), key) << e.what();
    }
  };
  expect_config_error(with("missing", {"data.tensors=" + dir + "/nothing.safetensors"}), "data.tensors");
  expect_config_error(with("empty", {"data.tensors="}), "data.tensors");
  expect_config_error(with("wide", {"model.wan.text_dim=21"}), "data.tensors");
  expect_config_error(with("weights", {"model.wan.weights=" + dir + "/latents.safetensors"}), "model.wan.weights");
  // Wan2.2's two experts train one at a time: a run that does not say which is refused by name.
  expect_config_error(
      with("experts", {"model.wan.weights=" + std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan22_experts",
                       "data.channels=16", "model.wan.in_channels=16", "model.wan.out_channels=16"}),
      "model.wan.expert");
  megaslide::io::remove_tree(dir);
}

// The property: the streamed trainer builds its blocks one at a time into the host store (a meta skeleton,
// WanStack::initial_block) yet starts from the resident loop's weights — the whole model drawn after
// torch::manual_seed(train.seed), overwritten by model.wan.weights, then by train.init_from — bit for bit,
// and leaves LibTorch's default generator where the whole model's construction leaves it. Random
// initialisation, the 3D-DSA retrofit from a dense checkpoint, and init_from a file holding a few tensors
// (of the prologue, a block and the head).
TEST(WanTraining, StreamedStartsFromTheWholeModelsWeightsBitForBit) {
  const auto dir = temp_dir("init");
  torch::manual_seed(9);
  const std::string partial = dir + "/partial.safetensors";
  megaslide::io::write_safetensors(partial, {{"condition_embedder.time_proj.weight", torch::randn({144, 24})},
                                             {"blocks.1.ffn.net.2.weight", torch::randn({24, 40})},
                                             {"blocks.0.attn2.norm_k.weight", torch::randn({24})},
                                             {"proj_out.bias", torch::randn({16})},
                                             {"scale_shift_table", torch::randn({1, 2, 24})}});
  struct Variant {
    std::vector<std::string> overrides;
    bool init_from;
  };
  const std::vector<Variant> variants{
      {{}, false},
      {{"model.self_attention=dsa3d", "model.dsa_kernel=[3, 3, 3]", "model.wan.weights=" + kFixtures + "/a/diffusers"},
       false},
      {{"model.wan.weights=" + kFixtures + "/a/diffusers"}, true}};
  for (const auto& v : variants) {
    SCOPED_TRACE(v.overrides.empty() ? "random" : v.overrides.back() + (v.init_from ? " + init_from" : ""));
    auto streamed_config = tiny_config(v.overrides);
    if (v.init_from) {
      streamed_config.train.init_from = partial;
      streamed_config.train.init_allow_missing = {"*"};
    }
    auto resident_config = streamed_config;
    resident_config.offload.enabled = false;
    const auto streamed_data = tiny_data(),
               resident_data = tiny_data();  // drawn before: tiny_data reseeds the generator
    Trainer streamed = wan_trainer(streamed_config, streamed_data);
    const auto after_streamed = torch::rand({8});
    Trainer resident = wan_trainer(resident_config, resident_data);
    const auto after_resident = torch::rand({8});
    ASSERT_TRUE(streamed.streams());
    EXPECT_EQ(wan_initialised_parameters(streamed), wan_initialised_parameters(resident));
    const auto a = streamed.master_weights(), b = resident.master_weights();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
    }
    EXPECT_TRUE(torch::equal(after_streamed, after_resident)) << "the default generator after construction";
    if (v.init_from) {
      std::map<std::string, torch::Tensor> m(a.begin(), a.end());
      for (const auto& [name, value] : megaslide::io::read_safetensors(partial).tensors)
        EXPECT_TRUE(torch::equal(m.at(name), value)) << name;
    }
  }
  megaslide::io::remove_tree(dir);
}

// The property: the model.wan.* sizes come from model.wan.weights (diffusers' config.json, or ComfyUI's file's
// tensor shapes with the config's heads), not from the defaults (Wan2.1 14B's): a config that names the weights
// and only the data's sizes parses and resolves to the weights' sizes; what does not fit those sizes is refused
// once they are known, naming the key; without weights the config's sizes are checked as it is parsed.
TEST(WanTraining, SizesComeFromTheWeightsNotTheDefaults) {
  const auto yaml = [](const std::string& wan, const std::string& data) {
    return "model:\n  arch: wan\n  wan: {" + wan + "}\ndata: {dataset: latent-tensors, " + data +
           ", max_text_tokens: 5}\ndiffusion: {objective: flow}\ntrain: {device: cpu}\n";
  };
  const std::string b = "weights: " + kFixtures + "/b/diffusers",
                    comfy = "weights: " + kFixtures + "/a/comfyui.safetensors";
  const auto from_b = megaslide::with_wan_architecture_from_weights(
      megaslide::parse_run_config(yaml(b, "channels: 3, frames: 2, height: 3, width: 4"), "test"));
  EXPECT_EQ(from_b.model.wan.out_channels, 3);
  EXPECT_EQ(from_b.model.wan.dim, 24);
  EXPECT_EQ(from_b.model.wan.patch, (std::array<int64_t, 3>{2, 1, 2}));
  const auto from_comfy = megaslide::with_wan_architecture_from_weights(
      megaslide::parse_run_config(yaml(comfy + ", heads: 3", "channels: 4, frames: 2, height: 4, width: 4"), "test"));
  EXPECT_EQ(from_comfy.model.wan.dim, 24);
  EXPECT_EQ(from_comfy.model.wan.heads, 3);
  const auto refused_key = [&](const std::string& wan, const std::string& data) {
    try {
      megaslide::with_wan_architecture_from_weights(megaslide::parse_run_config(yaml(wan, data), "test"));
    } catch (const megaslide::ConfigError& e) {
      return e.key();
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(refused_key(b, "channels: 4, frames: 2, height: 3, width: 4"), "data.channels");
  EXPECT_EQ(refused_key(b, "channels: 3, frames: 3, height: 3, width: 4"), "data.frames");  // the patch's 2 frames
  EXPECT_EQ(refused_key(comfy + ", heads: 5", "channels: 4, frames: 2, height: 4, width: 4"), "model.wan.dim");
  EXPECT_EQ(refused_key("heads: 3", "channels: 16, frames: 2, height: 4, width: 4"), "model.wan.dim");  // 5120 / 3
}

// The property: --export-weights writes a Wan run's weights under diffusers' names, in bf16, with diffusers'
// config in the metadata, and, named diffusion_pytorch_model.safetensors, as a diffusers folder with its
// config.json; --resume X --export-weights writes a checkpoint's the same way: WanWeights reads each back
// with the run's architecture; the model they give computes exactly what the trained masters rounded to
// bf16 compute; model.wan.weights and train.init_from of the exported file start a trainer from them.
TEST(WanTraining, ExportedWeightsLoadBackAsDiffusersWeights) {
  const auto dir = temp_dir("export");
  const auto data = tiny_data();
  const std::string tensors = dir + "/latents.safetensors";
  megaslide::io::write_safetensors(tensors,
                                   {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
  const auto config = tiny_config({"data.tensors=" + tensors, "offload.compute_dtype=bf16",
                                   "offload.emulated_copy_delay_ms=0", "train.steps=3", "train.checkpoint_every=3",
                                   "output.progress=false", "output.run_dir=" + dir + "/run"});
  megaslide::io::make_directories(dir + "/transformer");
  const std::string exported = dir + "/transformer/diffusion_pytorch_model.safetensors";
  megaslide::TrainingRunOptions options;
  options.export_weights = exported;
  megaslide::run_training(config, options);
  EXPECT_TRUE(megaslide::io::path_exists(dir + "/transformer/config.json"));

  // The trained masters, rounded to bf16, in a model built from the config.
  std::map<std::string, torch::Tensor> masters;
  for (auto& [name, t] :
       megaslide::io::read_safetensors(dir + "/run/checkpoints/step-0000003/master.safetensors").tensors)
    masters[name] = t.to(torch::kBFloat16).to(torch::kFloat32);
  const auto options_of = [](const RunConfig& c) { return megaslide::WanOptions::from_config(c); };
  megaslide::WanTransformer trained(options_of(config));
  {
    torch::NoGradGuard no_grad;
    for (auto& p : trained->named_parameters(true)) p.value().copy_(masters.at(p.key()));
  }
  torch::manual_seed(3);
  const auto x = torch::randn({2, 4, 3, 6, 8}), t = torch::rand({2}) * 1000, text = torch::randn({2, 7, 20});
  const auto expected = trained->forward(x, t, text);

  // --resume X --export-weights: the checkpoint's weights file rewritten the same way.
  const std::string from_checkpoint = dir + "/from-checkpoint.safetensors";
  megaslide::export_checkpoint_weights(dir + "/run", "latest", from_checkpoint);
  for (const std::string& path : {exported, dir + "/transformer", from_checkpoint}) {
    SCOPED_TRACE(path);
    const auto weights = megaslide::WanWeights::open(path);
    EXPECT_EQ(weights.naming(), megaslide::WanNaming::kDiffusers);
    EXPECT_FALSE(weights.config_path().empty());
    EXPECT_EQ(weights.read("blocks.0.attn1.to_q.weight", torch::kBFloat16).scalar_type(), torch::kBFloat16);
    megaslide::WanConfig fallback;  // the library's defaults: every size must come from the weights' config
    const auto arch = weights.architecture(fallback);
    const auto& w = config.model.wan;
    EXPECT_EQ(std::vector<int64_t>({arch.dim, arch.layers, arch.heads, arch.ffn_dim, arch.freq_dim, arch.text_dim,
                                    arch.in_channels, arch.out_channels}),
              std::vector<int64_t>(
                  {w.dim, w.layers, w.heads, w.ffn_dim, w.freq_dim, w.text_dim, w.in_channels, w.out_channels}));
    EXPECT_EQ(arch.qk_norm, w.qk_norm);
    EXPECT_EQ(arch.eps, w.eps);
    megaslide::WanTransformer loaded(options_of(config));
    megaslide::load_wan_weights(weights, *loaded);
    EXPECT_TRUE(torch::equal(loaded->forward(x, t, text), expected));
  }

  // model.wan.weights and train.init_from of the exported file.
  const auto expect_masters = [&](Trainer& trainer) {
    for (const auto& [name, value] : trainer.master_weights())
      EXPECT_TRUE(torch::equal(value, masters.at(name))) << name;
  };
  Trainer from_weights = wan_trainer(tiny_config({"model.wan.weights=" + exported, "model.wan.heads=4"}), tiny_data());
  EXPECT_EQ(from_weights.config().model.wan.heads, 2) << "the exported config's heads, not the fallback's";
  expect_masters(from_weights);
  Trainer from_init =
      wan_trainer(tiny_config({"offload.compute_dtype=bf16", "train.init_from=" + exported}), tiny_data());
  expect_masters(from_init);
  megaslide::io::remove_tree(dir);
}

// ComfyUI's single file (--export-layout comfyui, model/wan_weights.h).
namespace {

const std::string kComfyPrefix = "model.diffusion_model.";

// Every tensor of the ComfyUI file `path`: `prefix` then one of Wan's original names (wan_diffusers_name maps it
// back and wan_original_name forth; none of diffusers' words in it), in bf16; `count` of them, among them the
// ones ComfyUI's model detection reads (comfy/model_detection.py: head.modulation, head.head.weight,
// blocks.0.ffn.0.weight, patch_embedding.weight).
void expect_original_names(const std::string& path, const std::string& prefix, size_t count) {
  const auto header = megaslide::io::read_safetensors_header(path);
  EXPECT_EQ(header.entries.size(), count);
  std::set<std::string> names;
  for (const auto& e : header.entries) {
    ASSERT_EQ(e.name.rfind(prefix, 0), 0u) << e.name;
    const std::string name = e.name.substr(prefix.size());
    names.insert(name);
    EXPECT_NE(name.rfind("model.", 0), 0u) << e.name;
    const std::string diffusers = megaslide::wan_diffusers_name(name);
    EXPECT_FALSE(diffusers.empty()) << e.name << " is not one of Wan's original names";
    EXPECT_EQ(megaslide::wan_original_name(diffusers), name) << e.name;
    for (const char* word : {"condition_embedder", "attn1", "attn2", "to_q", "to_k", "to_v", "to_out", "ffn.net",
                             "proj_out", "scale_shift_table", "add_k_proj", "add_v_proj", "norm_added_k", "norm2"})
      EXPECT_EQ(name.find(word), std::string::npos) << e.name << " holds diffusers' " << word;
    EXPECT_EQ(e.dtype, torch::kBFloat16) << e.name;
  }
  for (const char* detected :
       {"head.modulation", "head.head.weight", "blocks.0.ffn.0.weight", "patch_embedding.weight"})
    EXPECT_TRUE(names.count(detected)) << "no " << prefix << detected;
}

// `a` holds `b`'s tensors (diffusers' names), bit for bit in bf16.
void expect_same_weights(const megaslide::WanWeights& a, const megaslide::WanWeights& b) {
  EXPECT_EQ(a.names(), b.names());
  for (const auto& name : b.names())
    if (a.has(name)) EXPECT_TRUE(torch::equal(a.read(name, torch::kBFloat16), b.read(name, torch::kBFloat16))) << name;
}

megaslide::io::NamedTensors all_tensors(const megaslide::WanWeights& weights, const std::string& prefix = "") {
  megaslide::io::NamedTensors out;
  for (const auto& name : weights.names()) out.emplace_back(prefix + name, weights.read(name, torch::kFloat32));
  return out;
}

}  // namespace

// The property: --export-layout comfyui writes a Wan run's weights (and its EMA) as ComfyUI's single file: every
// name one of Wan's original names under model.diffusion_model. (comfyui-unprefixed: bare), bf16, the tensors of
// the run's diffusers export bit for bit, diffusers' config in the metadata (WanWeights reads the heads from it);
// --resume X --export-weights writes the checkpoint's the same way; model.wan.weights starts a run from the file.
TEST(WanComfyUIExport, ExportHoldsTheDiffusersExportUnderOriginalNames) {
  const auto dir = temp_dir("comfyui");
  const auto data = tiny_data();
  const std::string tensors = dir + "/latents.safetensors";
  megaslide::io::write_safetensors(tensors,
                                   {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
  const auto config = tiny_config({"data.tensors=" + tensors, "offload.compute_dtype=bf16",
                                   "offload.emulated_copy_delay_ms=0", "train.steps=3", "train.checkpoint_every=3",
                                   "train.ema_decay=0.5", "output.progress=false", "output.run_dir=" + dir + "/run"});
  megaslide::TrainingRunOptions options;
  options.export_weights = dir + "/wan_ft.safetensors";
  options.export_ema = dir + "/wan_ft_ema.safetensors";
  options.export_layout = megaslide::WanWeightsLayout::kComfyUI;
  megaslide::run_training(config, options);

  const std::string diffusers = dir + "/diffusers.safetensors", ema_diffusers = dir + "/ema-diffusers.safetensors";
  megaslide::export_checkpoint_weights(dir + "/run", "latest", diffusers);
  megaslide::export_checkpoint_weights(dir + "/run", "latest", ema_diffusers, /*ema=*/true);
  const std::string from_checkpoint = dir + "/from-checkpoint.safetensors", bare = dir + "/bare.safetensors";
  megaslide::export_checkpoint_weights(dir + "/run", "latest", from_checkpoint, false,
                                       megaslide::WanWeightsLayout::kComfyUI);
  megaslide::export_checkpoint_weights(dir + "/run", "latest", bare, false,
                                       megaslide::WanWeightsLayout::kComfyUIUnprefixed);
  const auto reference = megaslide::WanWeights::open(diffusers);
  const auto reference_config = megaslide::io::read_safetensors_header(diffusers).metadata.at("config");
  const std::vector<std::tuple<std::string, std::string, std::string>> files{
      {options.export_weights, kComfyPrefix, diffusers},
      {from_checkpoint, kComfyPrefix, diffusers},
      {bare, "", diffusers},
      {options.export_ema, kComfyPrefix, ema_diffusers}};
  for (const auto& [path, prefix, expected] : files) {
    SCOPED_TRACE(path);
    expect_original_names(path, prefix, reference.names().size());
    EXPECT_EQ(megaslide::io::read_safetensors_header(path).metadata.at("config"), reference_config);
    const auto weights = megaslide::WanWeights::open(path);
    EXPECT_EQ(weights.naming(), megaslide::WanNaming::kOriginal);
    megaslide::WanConfig fallback;
    fallback.heads = 4;
    EXPECT_EQ(weights.architecture(fallback).heads, 2) << "the heads of the metadata's config, not the fallback's";
    expect_same_weights(weights, megaslide::WanWeights::open(expected));
  }
  EXPECT_FALSE(torch::equal(megaslide::WanWeights::open(options.export_ema).read("proj_out.weight"),
                            reference.read("proj_out.weight")))
      << "the EMA, not the weights";

  Trainer from_comfyui = wan_trainer(tiny_config({"model.wan.weights=" + options.export_weights}), tiny_data());
  for (const auto& [name, value] : from_comfyui.master_weights())
    EXPECT_TRUE(torch::equal(value, reference.read(name, torch::kFloat32))) << name;
  megaslide::io::remove_tree(dir);
}

// The property: an image-to-video Wan (Wan2.1 I2V's image branch, both fixtures) round-trips through ComfyUI's
// layout, with and without the prefix: the image embedder and the added key/value projections under their
// original names (img_emb.proj.0/1/3/4, cross_attn.k_img/v_img/norm_k_img; ComfyUI takes a Wan with
// img_emb.proj.0.bias for I2V), every tensor back bit for bit in bf16, image_dim from the metadata.
TEST(WanComfyUIExport, ImageToVideoModelRoundTrips) {
  const auto dir = temp_dir("comfyui-i2v");
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";
  for (const std::string& fixture : {fixtures + "wan_i2v/transformer", fixtures + "i2v_pipeline/wan21/transformer"}) {
    const auto source = megaslide::WanWeights::open(fixture);
    const auto arch = source.architecture(megaslide::WanConfig{});
    ASSERT_GT(arch.image_dim, 0) << fixture;
    for (const bool prefixed : {true, false}) {
      SCOPED_TRACE(fixture + (prefixed ? " with" : " without") + " the prefix");
      const std::string out = dir + "/i2v.safetensors", prefix = prefixed ? kComfyPrefix : "";
      EXPECT_EQ(megaslide::save_wan_comfyui_weights(out, arch, all_tensors(source), prefixed),
                std::vector<std::string>{out});
      expect_original_names(out, prefix, source.names().size());
      std::set<std::string> names;
      for (const auto& e : megaslide::io::read_safetensors_header(out).entries) names.insert(e.name);
      for (const char* image : {"img_emb.proj.0.weight", "img_emb.proj.0.bias", "img_emb.proj.1.weight",
                                "img_emb.proj.3.weight", "img_emb.proj.4.weight", "blocks.0.cross_attn.k_img.weight",
                                "blocks.1.cross_attn.v_img.bias", "blocks.0.cross_attn.norm_k_img.weight"})
        EXPECT_TRUE(names.count(prefix + image)) << "no " << prefix << image;
      const auto back = megaslide::WanWeights::open(out);
      EXPECT_EQ(back.architecture(megaslide::WanConfig{}).image_dim, arch.image_dim);
      expect_same_weights(back, source);
    }
  }
  megaslide::io::remove_tree(dir);
}

// The property: ComfyUI's layout refuses a 3D-DSA Wan, naming one of the retrofit's parameters, with nothing
// written; a run asked for that export is refused before it writes anything, naming the key and the flag.
TEST(WanComfyUIExport, TheDsaRetrofitIsRefusedNamingAParameter) {
  const auto dir = temp_dir("comfyui-dsa");
  const auto config =
      tiny_config({"model.self_attention=dsa3d", "model.dsa_kernel=[3, 3, 3]", "output.run_dir=" + dir + "/run"});
  megaslide::WanTransformer model(megaslide::WanOptions::from_config(config));
  megaslide::io::NamedTensors parameters;
  for (const auto& p : model->named_parameters(true)) parameters.emplace_back(p.key(), p.value());
  const std::string out = dir + "/dsa.safetensors";
  try {
    megaslide::save_wan_comfyui_weights(out, config.model.wan, parameters);
    ADD_FAILURE() << "no error";
  } catch (const megaslide::WanWeightsError& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.attn1.offset_dw.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--export-layout diffusers"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(megaslide::io::path_exists(out));

  megaslide::TrainingRunOptions options;
  options.export_weights = out;
  options.export_layout = megaslide::WanWeightsLayout::kComfyUI;
  try {
    megaslide::run_training(config, options);
    ADD_FAILURE() << "no error";
  } catch (const megaslide::ConfigError& e) {
    EXPECT_EQ(e.key(), "model.self_attention") << e.what();
    EXPECT_NE(std::string(e.what()).find("--export-layout comfyui"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(megaslide::io::path_exists(dir + "/run"));
  megaslide::io::remove_tree(dir);
}

// The property: ComfyUI reads every published Wan as it is (its model detection fixes the heads at dim / 128 and
// the rest as Wan has them), and what it would read differently of another Wan is named.
TEST(WanComfyUIExport, DifferencesFromWhatComfyUIAssumesAreNamed) {
  megaslide::WanConfig wan_14b;  // the library's defaults: Wan2.1 T2V-14B
  EXPECT_TRUE(megaslide::wan_comfyui_differences(wan_14b).empty());
  auto wan_1_3b = wan_14b;
  wan_1_3b.dim = 1536;
  wan_1_3b.heads = 12;
  wan_1_3b.image_dim = 1280;
  EXPECT_TRUE(megaslide::wan_comfyui_differences(wan_1_3b).empty());
  const auto tiny = megaslide::wan_comfyui_differences(tiny_config().model.wan);
  ASSERT_FALSE(tiny.empty());
  EXPECT_EQ(tiny.front().rfind("heads:", 0), 0u) << tiny.front();
}

// The property: WanBlockDraws gives WanTransformer's blocks bit for bit in whatever order they are asked
// for (2, 0, 3, 1: a block ahead of its predecessors draws and keeps them), whatever else drew from the
// default generator between two draws, and afterwards sets the generator where the whole model's
// construction draws the head: with initialise_prologue and initialise_head, the whole model part by part.
TEST(WanTraining, BlockDrawsAreTheWholeModelsBlocksInAnyOrder) {
  auto options = megaslide::WanOptions::from_config(tiny_config({"model.wan.layers=4"}));
  torch::manual_seed(21);
  megaslide::WanTransformer whole(options);
  const auto after_whole = torch::rand({8});
  auto skeleton_options = options;
  megaslide::WanTransformer skeleton(skeleton_options.block_device(torch::kMeta));
  torch::manual_seed(21);
  skeleton->initialise_prologue();
  megaslide::WanBlockDraws draws(skeleton);
  const auto expect_equal = [](torch::nn::Module& got, torch::nn::Module& expected, const std::string& what) {
    const auto e = expected.named_parameters(true);
    const auto g = got.named_parameters(true);
    ASSERT_EQ(g.size(), e.size()) << what;
    for (const auto& p : g) EXPECT_TRUE(torch::equal(p.value(), e[p.key()])) << what << " " << p.key();
  };
  for (int64_t l : {2, 0, 3, 1}) {
    auto block = draws.draw(l);
    expect_equal(*block, *whole->blocks[l], "block " + std::to_string(l));
    torch::rand({3});  // another draw from the default generator between two blocks
  }
  draws.restore_state_after_blocks();
  skeleton->initialise_head();
  for (const char* part : {"patch_embedding", "condition_embedder", "proj_out"})
    expect_equal(*skeleton->named_children()[part], *whole->named_children()[part], part);
  EXPECT_TRUE(torch::equal(skeleton->scale_shift_table, whole->scale_shift_table));
  EXPECT_TRUE(torch::equal(torch::rand({8}), after_whole)) << "the default generator after the head";
}

// Wan2.2's two experts (tests/fixtures/wan22_experts: diffusers' layout, boundary_ratio 0.875).
namespace {

const std::string kExperts = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan22_experts";

// A run of one expert of the fixture (16 latent channels, umT5 24 wide) on latents 16 x 2 x 4 x 6.
RunConfig expert_config(const std::string& expert, std::vector<std::string> overrides = {}) {
  const std::string yaml = "model:\n  arch: wan\n  wan: {weights: " + kExperts +
                           (expert.empty() ? "" : ", expert: " + expert) +
                           "}\n"
                           "data: {dataset: latent-tensors, channels: 16, frames: 2, height: 4, width: 6, "
                           "max_text_tokens: 7}\n"
                           "diffusion: {objective: flow, shift: 5.0, timestep_sampling: logit_normal, "
                           "caption_dropout: 0.0}\n"
                           "train: {steps: 4, batch_size: 2, lr: 0.002, warmup_steps: 0, lr_schedule: constant, "
                           "device: cpu, seed: 5}\n"
                           "offload: {compute_dtype: fp32, mode: async, emulated_copy_delay_ms: 0}\n"
                           "output: {progress: false}\n";
  return megaslide::parse_run_config(yaml, "test", overrides);
}

WanLatentData expert_data() {
  torch::manual_seed(8);
  WanLatentData d;
  d.latents = torch::randn({4, 16, 2, 4, 6});
  d.text = torch::randn({4, 7, 24});
  d.empty_text = torch::zeros({7, 24});
  return d;
}

}  // namespace

// The property: a run of model.wan.expert fine-tunes that expert of the two — its masters start from its
// own weights (transformer/ for high, transformer_2/ for low), not the other's — on its own timesteps
// only (every micro-batch's t >= 875 for high, < 875 for low, with the run's shifted logit-normal σ), and
// megaslide-train's loop trains it and resumes from a checkpoint into the same losses bit for bit.
TEST(WanTraining, OneExpertOfTwoTrainsFromItsWeightsOnItsTimesteps) {
  for (const std::string expert : {"high", "low"}) {
    SCOPED_TRACE(expert + "-noise expert");
    const auto config = expert_config(expert);
    const auto resolved = megaslide::with_wan_architecture_from_weights(config);
    EXPECT_EQ(resolved.model.wan.boundary_ratio, 0.875);
    megaslide::WanBatchSource batches(megaslide::wan_latent_config(resolved), expert_data());
    for (int i = 0; i < 40; ++i) {
      const auto t = batches.next(torch::kCPU).timesteps;
      if (expert == "high") EXPECT_TRUE((t >= 875).all().item<bool>()) << t;
      else EXPECT_TRUE((t < 875).all().item<bool>()) << t;
    }

    Trainer trainer = wan_trainer(config, expert_data());
    const auto own = megaslide::WanWeights::open(kExperts + (expert == "high" ? "/transformer" : "/transformer_2"));
    const auto other = megaslide::WanWeights::open(kExperts + (expert == "high" ? "/transformer_2" : "/transformer"));
    const auto masters = trainer.master_weights();
    ASSERT_FALSE(masters.empty());
    for (const auto& [name, value] : masters) EXPECT_TRUE(torch::equal(value, own.read(name, torch::kFloat32))) << name;
    EXPECT_FALSE(
        torch::equal(own.read("proj_out.weight", torch::kFloat32), other.read("proj_out.weight", torch::kFloat32)));
    EXPECT_TRUE(std::isfinite(trainer.step().loss));

    const auto dir = temp_dir("expert-" + expert);
    const std::string tensors = dir + "/latents.safetensors";
    const auto data = expert_data();
    megaslide::io::write_safetensors(tensors,
                                     {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
    auto run = [&](const std::string& name, int steps) {
      return expert_config(expert, {"data.tensors=" + tensors, "train.checkpoint_every=2",
                                    "train.steps=" + std::to_string(steps), "output.run_dir=" + dir + "/" + name});
    };
    // A size the config gives otherwise than the weights is the weights', and the log says so.
    megaslide::run_training(
        expert_config(expert, {"data.tensors=" + tensors, "train.checkpoint_every=2", "train.steps=4",
                               "output.run_dir=" + dir + "/whole", "model.wan.ffn_dim=999", "data.image_frame=1"}),
        {});
    EXPECT_NE(megaslide::io::read_file(dir + "/whole/train.log")
                  .find("model.wan.ffn_dim is 999 in the config but " + std::to_string(resolved.model.wan.ffn_dim) +
                        " in model.wan.weights: the weights' is used"),
              std::string::npos);
    // So is an image-to-video setting the weights (a text-to-video expert) cannot use.
    EXPECT_NE(
        megaslide::io::read_file(dir + "/whole/train.log").find("data.image_frame is 1, but this Wan is text-to-video"),
        std::string::npos);
    megaslide::run_training(run("part", 2), {});
    megaslide::TrainingRunOptions resume;
    resume.resume = "latest";
    megaslide::run_training(run("part", 4), resume);
    const auto whole = losses_of(dir + "/whole"), part = losses_of(dir + "/part");
    ASSERT_EQ(whole.size(), 4u);
    ASSERT_EQ(part.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(part[i], whole[i]) << "step " << i + 1;

    // The run's weights sample with the expert it did not train (megaslide-sample): the pair, high first.
    const auto pair = megaslide::with_untrained_expert(
        megaslide::load_wan_model(megaslide::find_weights(dir + "/whole"), false), false);
    ASSERT_TRUE(pair.low_noise);
    const auto& untrained = expert == "high" ? *pair.low_noise : pair;
    for (const auto& p : untrained.dit->named_parameters(true))
      EXPECT_TRUE(torch::equal(p.value(), other.read(p.key(), torch::kFloat32))) << p.key();
    const auto& trained = expert == "high" ? pair : *pair.low_noise;
    EXPECT_FALSE(torch::equal(trained.dit->named_parameters(true)["proj_out.weight"],
                              own.read("proj_out.weight", torch::kBFloat16).to(torch::kFloat32)))
        << "the trained expert is the run's (its bf16 weights file), not the published one";
    megaslide::io::remove_tree(dir);
  }
}

// The property: what an expert run cannot mean is a ConfigError naming its key — two experts without
// model.wan.expert, "both" with one DiT's weights, an expert with the DDPM objective, and validation videos
// of one expert's own file (the other one is unknown); one expert's own file, or no weights (a plan of an
// expert), trains on its side of Wan-AI's boundary or of the one given.
TEST(WanTraining, ExpertSettingsThatCannotTrainAreRefused) {
  auto refused = [](const std::function<RunConfig()>& make, const std::string& key) {
    try {
      const auto config = make();
      megaslide::dry_run_json(config);
      ADD_FAILURE() << "accepted " << key;
    } catch (const megaslide::ConfigError& e) {
      EXPECT_EQ(e.key(), key) << e.what();
    }
  };
  refused([] { return expert_config(""); }, "model.wan.expert");
  refused([] { return expert_config("both", {"model.wan.weights=" + kExperts + "/transformer"}); }, "model.wan.expert");
  refused([] { return expert_config("both", {"diffusion.objective=ddpm"}); }, "model.wan.expert");
  refused([] { return expert_config("low", {"diffusion.objective=ddpm"}); }, "model.wan.expert");
  refused(
      [] {
        return expert_config("high", {"model.wan.weights=" + kExperts + "/transformer", "train.sample_every=2"});
      },
      "train.sample_every");
  // One expert's own file trains on its side of Wan-AI's boundary, or of the one given.
  const auto single = megaslide::with_wan_architecture_from_weights(
      expert_config("low", {"model.wan.weights=" + kExperts + "/transformer_2"}));
  EXPECT_EQ(single.model.wan.boundary_ratio, 0.875);
  EXPECT_EQ(megaslide::wan_trained_weights(single.model.wan), kExperts + "/transformer_2");
  const auto random = megaslide::with_wan_architecture_from_weights(expert_config("high", {"model.wan.weights="}));
  EXPECT_EQ(random.model.wan.boundary_ratio, 0.875);
  EXPECT_EQ(megaslide::FlowMatchingOptions::from_config(random).sigma_min(), 0.875);
  EXPECT_EQ(megaslide::FlowMatchingOptions::from_config(single).sigma_max(), 0.875);
  EXPECT_EQ(
      megaslide::with_wan_architecture_from_weights(
          expert_config("low", {"model.wan.weights=" + kExperts + "/transformer_2", "model.wan.boundary_ratio=0.9"}))
          .model.wan.boundary_ratio,
      0.9);
}

namespace {
// The masters of one expert of a two-expert trainer ("transformer." or "transformer_2."), by its own names.
std::map<std::string, torch::Tensor> expert_masters(Trainer& trainer, const std::string& prefix) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, value] : trainer.master_weights())
    if (name.rfind(prefix, 0) == 0) out.emplace(name.substr(prefix.size()), value);
  return out;
}
// The EMA of one expert's weights (train.ema_decay), by its own names, as copies.
std::map<std::string, torch::Tensor> expert_ema(Trainer& trainer, const std::string& prefix) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, value] : trainer.training_state().ema)
    if (name.rfind(prefix, 0) == 0) out.emplace(name.substr(prefix.size()), value.clone());
  return out;
}
double largest_change(const std::map<std::string, torch::Tensor>& before,
                      const std::map<std::string, torch::Tensor>& after) {
  double worst = 0.0;
  for (const auto& [name, value] : before) worst = std::max(worst, (after.at(name) - value).abs().max().item<double>());
  return worst;
}
}  // namespace

// The property: model.wan.expert both trains Wan2.2's two experts in one run, each step one expert, in
// both modes alike: the masters start from each expert's own weights (named transformer.* and
// transformer_2.*); a step names its expert, changes that expert's weights and EMA and leaves the other's
// bit-identical; each expert's first update is AdamW's first step (bias-corrected for its own count: the
// largest change is lr, also when it comes at a later step of the run), and each expert's updates are
// counted apart; the draw gives the high-noise expert the share of steps the run's σ distribution puts at
// or above the boundary (0.368 with shift 5 and logit-normal σ); the streamed trainer gives the resident
// loop's losses and weights.
TEST(WanTraining, BothExpertsTrainInOneRunEachOnItsOwnSteps) {
  const auto config = expert_config("both", {"train.weight_decay=0", "train.grad_clip=0", "train.ema_decay=0.9"});
  {
    const auto resolved = megaslide::with_wan_architecture_from_weights(config);
    megaslide::WanBatchSource batches(megaslide::wan_latent_config(resolved), expert_data());
    int high = 0;
    const int draws = 2000;
    for (int i = 0; i < draws; ++i) {
      const size_t expert = batches.draw_expert();
      const auto t = batches.next(torch::kCPU).timesteps;
      if (expert == 0) EXPECT_TRUE((t >= 875).all().item<bool>()) << t;
      else EXPECT_TRUE((t < 875).all().item<bool>()) << t;
      high += expert == 0;
    }
    const double expected =
        1.0 - megaslide::flow_sigma_cdf(0.875, megaslide::FlowMatchingOptions::from_config(resolved));
    EXPECT_NEAR(expected, 0.368, 0.001);
    EXPECT_NEAR(static_cast<double>(high) / draws, expected, 0.04);  // > 3.5 standard deviations
  }
  auto resident_config = config;
  resident_config.offload.enabled = false;
  Trainer streamed = wan_trainer(config, expert_data()), resident = wan_trainer(resident_config, expert_data());
  const std::string prefixes[2] = {"transformer.", "transformer_2."};
  const auto high = megaslide::WanWeights::open(kExperts + "/transformer");
  const auto low = megaslide::WanWeights::open(kExperts + "/transformer_2");
  for (Trainer* t : {&streamed, &resident}) {
    const auto masters = t->master_weights();
    ASSERT_EQ(masters.size(), 2 * expert_masters(*t, prefixes[0]).size());
    // What --dry-run and the memory check before the first step count: both experts.
    int64_t trained = 0;
    for (const auto& [name, value] : masters) trained += value.numel();
    EXPECT_EQ(megaslide::count_run_parameters(megaslide::with_wan_architecture_from_weights(config)).total, trained);
    for (const auto& [name, value] : expert_masters(*t, prefixes[0]))
      EXPECT_TRUE(torch::equal(value, high.read(name, torch::kFloat32))) << name;
    for (const auto& [name, value] : expert_masters(*t, prefixes[1]))
      EXPECT_TRUE(torch::equal(value, low.read(name, torch::kFloat32))) << name;
  }
  std::map<std::string, int> firsts;  // each expert's first update, checked in both modes
  std::map<std::string, int> counts;
  double worst = 0.0;
  const int steps = 8;
  for (int s = 0; s < steps; ++s) {
    std::map<std::string, torch::Tensor> before[2][2], ema_before[2][2];
    for (int e = 0; e < 2; ++e) {
      before[0][e] = expert_masters(streamed, prefixes[e]);
      before[1][e] = expert_masters(resident, prefixes[e]);
      ema_before[0][e] = expert_ema(streamed, prefixes[e]);
      ema_before[1][e] = expert_ema(resident, prefixes[e]);
    }
    const auto a = streamed.step(), b = resident.step();
    ASSERT_EQ(a.part, b.part) << "step " << s + 1;
    ASSERT_TRUE(a.part == "high" || a.part == "low") << a.part;
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss)) << "step " << s + 1;
    const int trained = a.part == "high" ? 0 : 1;
    Trainer* trainers[2] = {&streamed, &resident};
    for (int m = 0; m < 2; ++m) {
      const auto after_trained = expert_masters(*trainers[m], prefixes[trained]);
      const auto after_other = expert_masters(*trainers[m], prefixes[1 - trained]);
      EXPECT_EQ(largest_change(before[m][1 - trained], after_other), 0.0) << "the other expert, step " << s + 1;
      ASSERT_FALSE(ema_before[m][trained].empty());
      EXPECT_EQ(largest_change(ema_before[m][1 - trained], expert_ema(*trainers[m], prefixes[1 - trained])), 0.0)
          << "the other expert's EMA, step " << s + 1;
      EXPECT_GT(largest_change(ema_before[m][trained], expert_ema(*trainers[m], prefixes[trained])), 0.0)
          << "the trained expert's EMA, step " << s + 1;
      const double change = largest_change(before[m][trained], after_trained);
      EXPECT_GT(change, 0.0) << "step " << s + 1;
      if (!firsts.count(a.part + std::to_string(m)))  // AdamW's first step: |Δw| <= lr, = lr where |g| >> eps
        EXPECT_NEAR(change, config.train.lr, 1e-3 * config.train.lr)
            << a.part << " expert's first update, step " << s + 1;
      firsts.emplace(a.part + std::to_string(m), s + 1);
    }
    ++counts[a.part];
    worst = std::max(worst, max_difference(streamed.master_weights(), resident.master_weights()));
  }
  std::cout << "experts of 8 steps: high " << counts["high"] << ", low " << counts["low"]
            << "; largest streamed-resident weight difference " << worst << "\n";
  ASSERT_EQ(counts.size(), 2u) << "both experts trained in 8 steps";
  EXPECT_GT(std::max(firsts["low0"], firsts["high0"]), 1) << "one expert's first update came after step 1";
  EXPECT_LT(worst, 1e-5);
  for (Trainer* t : {&streamed, &resident}) {
    const auto state = t->training_state();
    EXPECT_EQ(state.part_steps, (std::vector<int64_t>{counts["high"], counts["low"]}));
    EXPECT_EQ(state.optimizer_steps, steps);
  }
}

// The property: with Wan2.2's two experts trained together, each validation batch lies on one side of the boundary,
// drawn as a training step draws it, and its expert scores it: the validation loss is the mean over the batches of
// each one's loss through the module of its side's expert (the resident loop), within 1e-6; both sides occur.
TEST(WanTraining, BothExpertsValidationScoresEachBatchWithItsSidesExpert) {
  const std::string path = "/tmp/megaslide-test-wan-val-experts-" + std::to_string(::getpid()) + ".safetensors";
  const auto data = expert_data();
  megaslide::io::write_safetensors(path,
                                   {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
  const int64_t n = 12;
  const auto config = expert_config("both", {"data.tensors=" + path, "offload.enabled=false", "train.val_every=1",
                                             "train.val_batches=" + std::to_string(n)});
  const RunConfig resolved =
      megaslide::model_family(config.model.arch).resolve(megaslide::resolve_auto_settings(config), "test");
  const RunConfig val = megaslide::validation_data_config(resolved, "test");
  Trainer trainer = trainer_with_validation(resolved, val, &config);
  const double measured = trainer.validation_loss();

  auto experts = megaslide::wan_experts(trainer);
  ASSERT_EQ(experts.size(), 2u);
  megaslide::WanBatchSource batches(megaslide::wan_latent_config(val), WanLatentData::load(path));
  torch::NoGradGuard no_grad;
  for (auto& e : experts) e->eval();
  double expected = 0.0;
  int sides[2] = {0, 0};
  for (int64_t i = 0; i < n; ++i) {
    const size_t side = batches.draw_expert();
    const auto b = batches.next(torch::kCPU);
    ++sides[side];
    const auto t = b.timesteps.flatten();
    EXPECT_TRUE(side == 0 ? (t >= 875).all().item<bool>() : (t < 875).all().item<bool>()) << t;
    expected += megaslide::wan_training_loss(experts[side]->forward(b.input(), b.timesteps, b.text, b.image), b.target,
                                             b.loss_mask, b.loss_weight)
                    .item<double>() /
                static_cast<double>(n);
  }
  EXPECT_GT(sides[0], 0);
  EXPECT_GT(sides[1], 0);
  EXPECT_NEAR(measured, expected, 1e-6 * expected);
  std::remove(path.c_str());
}

// The property: a two-expert run of megaslide-train's loop resumes from a checkpoint into the same
// losses and the same expert at every step, bit for bit (bf16 blocks, accumulation); its metrics name each
// step's expert, the batch source's draws; its weights file samples as the pair (megaslide-sample: the high-noise
// expert with the low-noise one) holding the trained weights; its export is diffusers' two-expert repository, which
// model.wan.weights reads back as the two experts and the boundary.
TEST(WanTraining, BothExpertsRunResumesExportsAndSamplesAsThePair) {
  const auto dir = temp_dir("both");
  const std::string tensors = dir + "/latents.safetensors";
  const auto data = expert_data();
  megaslide::io::write_safetensors(tensors,
                                   {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
  // The experts of 6 steps as the batch source draws them (one draw, then two micro-batches, a step); the
  // first seed from 5 on whose 6 steps train both experts.
  auto experts_drawn = [&](int64_t seed) {
    const auto resolved = megaslide::with_wan_architecture_from_weights(
        expert_config("both", {"train.seed=" + std::to_string(seed), "train.grad_accum_steps=2"}));
    megaslide::WanBatchSource batches(megaslide::wan_latent_config(resolved), expert_data());
    std::vector<std::string> out;
    for (int s = 0; s < 6; ++s) {
      out.push_back(batches.draw_expert() == 0 ? "high" : "low");
      batches.next(torch::kCPU);
      batches.next(torch::kCPU);
    }
    return out;
  };
  int64_t seed = 5;
  for (auto e = experts_drawn(seed); std::count(e.begin(), e.end(), "high") % 6 == 0; e = experts_drawn(++seed)) {
  }
  auto run = [&](const std::string& name, int steps) {
    return expert_config(
        "both", {"data.tensors=" + tensors, "train.checkpoint_every=3", "train.steps=" + std::to_string(steps),
                 "output.run_dir=" + dir + "/" + name, "offload.compute_dtype=bf16", "train.grad_accum_steps=2",
                 "train.seed=" + std::to_string(seed)});
  };
  megaslide::TrainingRunOptions whole_options;
  whole_options.export_weights = dir + "/export.safetensors";
  const auto whole_result = megaslide::run_training(run("whole", 6), whole_options);
  ASSERT_EQ(whole_result.exported.size(), 1u);
  EXPECT_NE(whole_result.exported[0].find("export.safetensors (a folder: diffusers' repository of both experts"),
            std::string::npos)
      << whole_result.exported[0] << " (said, whatever the path's name)";
  megaslide::run_training(run("part", 3), {});
  megaslide::TrainingRunOptions resume;
  resume.resume = "latest";
  megaslide::run_training(run("part", 6), resume);
  auto parts_of = [](const std::string& run_dir) {
    std::vector<std::string> out;
    std::ifstream in(megaslide::io::join_path(run_dir, "metrics.jsonl"));
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("part"));
    return out;
  };
  const auto whole = losses_of(dir + "/whole"), part = losses_of(dir + "/part");
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(part.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(part[i], whole[i]) << "step " << i + 1;
  EXPECT_EQ(parts_of(dir + "/whole"), experts_drawn(seed)) << "seed " << seed;
  EXPECT_EQ(parts_of(dir + "/part"), parts_of(dir + "/whole"));

  // The weights file: both experts, the trained ones (not the published ones).
  const auto pair = megaslide::load_wan_model(megaslide::find_weights(dir + "/whole"), false);
  ASSERT_TRUE(pair.low_noise);
  const auto high = megaslide::WanWeights::open(kExperts + "/transformer");
  const auto low = megaslide::WanWeights::open(kExperts + "/transformer_2");
  auto pair_weight = [](const megaslide::WanModel& m) { return m.dit->named_parameters(true)["proj_out.weight"]; };
  EXPECT_FALSE(torch::equal(pair_weight(pair), high.read("proj_out.weight", torch::kBFloat16).to(torch::kFloat32)));
  EXPECT_FALSE(
      torch::equal(pair_weight(*pair.low_noise), low.read("proj_out.weight", torch::kBFloat16).to(torch::kFloat32)));
  EXPECT_FALSE(torch::equal(pair_weight(pair), pair_weight(*pair.low_noise)));

  // The export: diffusers' repository of the two experts, the same tensors as the weights file.
  const auto exported = megaslide::with_wan_architecture_from_weights(
      expert_config("both", {"model.wan.weights=" + dir + "/export.safetensors"}));
  EXPECT_EQ(exported.model.wan.weights_2, dir + "/export.safetensors/transformer_2");
  EXPECT_EQ(exported.model.wan.boundary_ratio, 0.875);
  EXPECT_TRUE(megaslide::io::path_exists(dir + "/export.safetensors/transformer/config.json"));
  // model_index.json lists WanPipeline's every component, as diffusers' Wan2.2 repositories do: from_pretrained
  // loads the folder once the base repository's other folders are copied beside the two experts.
  const auto index = nlohmann::json::parse(megaslide::io::read_file(dir + "/export.safetensors/model_index.json"));
  EXPECT_EQ(index.at("_class_name"), "WanPipeline");
  for (const auto* component : {"scheduler", "text_encoder", "tokenizer", "transformer", "transformer_2", "vae"})
    EXPECT_TRUE(index.contains(component) && index.at(component).size() == 2) << component << ": " << index.dump();
  EXPECT_EQ(index.at("vae")[1], "AutoencoderKLWan");
  const auto exported_high = megaslide::WanWeights::open(dir + "/export.safetensors/transformer");
  const auto exported_low = megaslide::WanWeights::open(dir + "/export.safetensors/transformer_2");
  for (const auto& p : pair.dit->named_parameters(true))
    EXPECT_TRUE(torch::equal(exported_high.read(p.key(), torch::kFloat32), p.value())) << p.key();
  for (const auto& p : pair.low_noise->dit->named_parameters(true))
    EXPECT_TRUE(torch::equal(exported_low.read(p.key(), torch::kFloat32), p.value())) << p.key();
  megaslide::io::remove_tree(dir);
}

// The property: with diffusion.first_frame_clean (Wan2.2 TI2V's image-to-video) an image-to-video sample
// has its first latent frame clean in the input, that frame's 12 tokens at timestep 0 and every other
// token at the sample's timestep, and the frame out of the loss (the masked loss is the mean over the other
// frames, each sample's mean averaged over the samples: the same for any split of the batch); at 0.5 both
// kinds of sample are drawn; the streamed trainer gives the resident loop's losses
// and weights on such batches; the setting is refused for the DDPM objective and the DiT family.
TEST(WanTraining, ImageToVideoSamplesKeepTheFirstFrameCleanAndOutOfTheLoss) {
  {
    megaslide::WanBatchSource batches(tiny_config({"diffusion.first_frame_clean=1"}), tiny_data());
    const auto b = batches.next(torch::kCPU);
    ASSERT_EQ(b.timesteps.sizes(), (std::vector<int64_t>{2, 36}));  // 3 latent frames of 3 x 4 tokens
    EXPECT_TRUE(b.timesteps.narrow(1, 0, 12).eq(0).all().item<bool>());
    for (int64_t i = 0; i < 2; ++i) {
      const auto rest = b.timesteps[i].narrow(0, 12, 24);
      EXPECT_TRUE(rest.eq(rest[0]).all().item<bool>() && rest[0].item<float>() > 0);
    }
    EXPECT_TRUE(torch::equal(b.xt.narrow(2, 0, 1), b.x0.narrow(2, 0, 1)));
    EXPECT_FALSE(torch::equal(b.xt.narrow(2, 1, 1), b.x0.narrow(2, 1, 1)));
    ASSERT_TRUE(b.loss_mask.defined());
    EXPECT_EQ(b.loss_mask.sum().item<float>(), 4.0f);  // 2 samples x 2 frames kept
    const auto prediction = torch::randn(b.target.sizes());
    const double masked = megaslide::wan_training_loss(prediction, b.target, b.loss_mask).item<double>();
    const double rest = megaslide::diffusion_loss(prediction.narrow(2, 1, 2), b.target.narrow(2, 1, 2)).item<double>();
    EXPECT_NEAR(masked, rest, 1e-6 * rest);
    EXPECT_TRUE(torch::equal(megaslide::wan_training_loss(prediction, b.target, torch::Tensor()),
                             megaslide::diffusion_loss(prediction, b.target)));
    // A batch of one image-to-video and one text-to-video sample: the mean of the two samples' losses, as
    // two micro-batches or two ranks of one sample each give it.
    auto mixed = b.loss_mask.clone();
    mixed[1].fill_(1.0f);
    const double whole = megaslide::wan_training_loss(prediction, b.target, mixed).item<double>();
    const double halves =
        (megaslide::wan_training_loss(prediction.narrow(0, 0, 1), b.target.narrow(0, 0, 1), mixed.narrow(0, 0, 1)) +
         megaslide::wan_training_loss(prediction.narrow(0, 1, 1), b.target.narrow(0, 1, 1), mixed.narrow(0, 1, 1)))
            .item<double>() /
        2;
    EXPECT_NEAR(whole, halves, 1e-6 * halves);
  }
  {
    megaslide::WanBatchSource batches(tiny_config({"diffusion.first_frame_clean=0.5"}), tiny_data());
    int clean = 0, text_to_video = 0;
    for (int n = 0; n < 10; ++n) {
      const auto b = batches.next(torch::kCPU);
      for (int64_t i = 0; i < 2; ++i) (b.timesteps[i][0].item<float>() == 0 ? clean : text_to_video)++;
    }
    EXPECT_GT(clean, 0);
    EXPECT_GT(text_to_video, 0);
  }
  auto streamed_config = tiny_config({"diffusion.first_frame_clean=0.5"});
  auto resident_config = streamed_config;
  resident_config.offload.enabled = false;
  Trainer streamed = wan_trainer(streamed_config, tiny_data()), resident = wan_trainer(resident_config, tiny_data());
  for (int s = 0; s < 3; ++s) {
    const auto a = streamed.step(), b = resident.step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss)) << "step " << s;
  }
  EXPECT_LT(max_difference(streamed.master_weights(), resident.master_weights()), 1e-5);
  {
    // data.image_frame picks an image-to-video DiT's conditioning frame: TI2V's first frame is the clip's own, so a
    // non-zero one is said to be unused (not refused: a run's data keys must stay as they were across resumes).
    const auto unused =
        megaslide::unused_settings(tiny_config({"diffusion.first_frame_clean=0.5", "data.image_frame=2"}));
    EXPECT_EQ(std::count_if(unused.begin(), unused.end(),
                            [](const std::string& w) {
                              return w.find("data.image_frame") != std::string::npos &&
                                     w.find("this Wan is text-to-video") != std::string::npos;
                            }),
              1);
  }
  for (const auto& [sets, key] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"diffusion.first_frame_clean=1", "diffusion.objective=ddpm"}, "diffusion.first_frame_clean"},
           {{"diffusion.first_frame_clean=1.5"}, "diffusion.first_frame_clean"}}) {
    try {
      tiny_config(sets);
      ADD_FAILURE() << "accepted " << sets[0];
    } catch (const megaslide::ConfigError& e) {
      EXPECT_EQ(e.key(), key) << e.what();
    }
  }
}

namespace {
// A two-expert run's parameters: `high`'s as transformer.*, `low`'s as transformer_2.*.
megaslide::io::NamedTensors two_experts(const megaslide::WanWeights& high, const megaslide::WanWeights& low) {
  auto parameters = all_tensors(high, "transformer.");
  for (auto& p : all_tensors(low, "transformer_2.")) parameters.push_back(std::move(p));
  return parameters;
}
}  // namespace

// The property: an export of Wan2.2's two experts replaces its files together or not at all: when the second
// expert's file cannot be written (here a folder stands at its path), the first expert's file — and, in diffusers'
// layout, its config.json — keep their old bytes, and no temporary file is left.
TEST(WanComfyUIExport, TwoExpertsAreReplacedTogetherOrNotAtAll) {
  const auto dir = temp_dir("experts-together");
  const auto high = megaslide::WanWeights::open(kExperts + "/transformer");
  const auto low = megaslide::WanWeights::open(kExperts + "/transformer_2");
  const auto wan = megaslide::with_wan_architecture_from_weights(expert_config("both")).model.wan;
  const auto parameters = two_experts(high, low);
  const auto swapped = two_experts(low, high);  // another model to write over the first
  const auto temporaries = [](const std::string& folder) {
    int n = 0;
    for (const auto& name : megaslide::io::list_directory(folder))
      n += name.size() > 4 && name.substr(name.size() - 4) == ".tmp";
    return n;
  };
  // ComfyUI's two files.
  const auto files = megaslide::save_wan_comfyui_weights(dir + "/w.safetensors", wan, parameters);
  const std::string first = megaslide::io::read_file(files[0]);
  megaslide::io::remove_tree(files[1]);
  megaslide::io::make_directories(files[1]);
  EXPECT_THROW(megaslide::save_wan_comfyui_weights(dir + "/w.safetensors", wan, swapped), megaslide::io::IoError);
  EXPECT_EQ(megaslide::io::read_file(files[0]), first) << "the high-noise file was replaced alone";
  EXPECT_EQ(temporaries(dir), 0);
  // diffusers' folder: transformer/ (weights and config.json), transformer_2/, model_index.json.
  const std::string folder = dir + "/diffusers";
  megaslide::save_wan_weights(folder, wan, parameters);
  const std::string weights = megaslide::io::read_file(folder + "/transformer/diffusion_pytorch_model.safetensors");
  const std::string config = megaslide::io::read_file(folder + "/transformer/config.json");
  const std::string second = folder + "/transformer_2/diffusion_pytorch_model.safetensors";
  megaslide::io::remove_tree(second);
  megaslide::io::make_directories(second);
  EXPECT_THROW(megaslide::save_wan_weights(folder, wan, swapped), megaslide::io::IoError);
  EXPECT_EQ(megaslide::io::read_file(folder + "/transformer/diffusion_pytorch_model.safetensors"), weights);
  EXPECT_EQ(megaslide::io::read_file(folder + "/transformer/config.json"), config);
  EXPECT_EQ(temporaries(folder + "/transformer") + temporaries(folder + "/transformer_2") + temporaries(folder), 0);
  megaslide::io::remove_tree(dir);
}

// The property: Wan2.2's two experts (model.wan.expert both: the parameters transformer.* and transformer_2.*, as
// the run names them) export as ComfyUI's two files, the path's name with _high_noise and _low_noise, each its
// expert's tensors bit for bit under original names, marked with the expert and the boundary; the pair reads back
// as the two experts (model.wan.weights, model.wan.weights_2), as ComfyUI's own two files do; a run of both experts
// exports its trained experts so, the tensors of its checkpoint's diffusers export.
TEST(WanComfyUIExport, TwoExpertsExportAsHighAndLowNoiseFiles) {
  const auto dir = temp_dir("comfyui-experts");
  const auto high = megaslide::WanWeights::open(kExperts + "/transformer");
  const auto low = megaslide::WanWeights::open(kExperts + "/transformer_2");
  const auto wan = megaslide::with_wan_architecture_from_weights(expert_config("both")).model.wan;
  const auto parameters = two_experts(high, low);
  const std::vector<std::string> expected{dir + "/wan22_ft_high_noise.safetensors",
                                          dir + "/wan22_ft_low_noise.safetensors"};
  EXPECT_EQ(megaslide::wan_comfyui_files(dir + "/wan22_ft", wan), expected);
  ASSERT_EQ(megaslide::save_wan_comfyui_weights(dir + "/wan22_ft.safetensors", wan, parameters), expected);
  EXPECT_FALSE(megaslide::io::path_exists(dir + "/wan22_ft.safetensors"));
  for (size_t e = 0; e < 2; ++e) {
    SCOPED_TRACE(expected[e]);
    expect_original_names(expected[e], kComfyPrefix, high.names().size());
    const auto metadata = megaslide::io::read_safetensors_header(expected[e]).metadata;
    EXPECT_EQ(metadata.at("expert"), e == 0 ? "high_noise" : "low_noise");
    EXPECT_EQ(metadata.at("boundary_ratio"), "0.875");
    expect_same_weights(megaslide::WanWeights::open(expected[e]), e == 0 ? high : low);
  }
  const auto pair = megaslide::with_wan_architecture_from_weights(
      expert_config("both", {"model.wan.weights=" + expected[0], "model.wan.weights_2=" + expected[1]}));
  EXPECT_EQ(pair.model.wan.weights_2, expected[1]);
  EXPECT_EQ(pair.model.wan.boundary_ratio, 0.875);
  EXPECT_EQ(pair.model.wan.heads, wan.heads);

  // A run of both experts: its export holds its checkpoint's diffusers export, expert by expert.
  const auto data = expert_data();
  const std::string tensors = dir + "/latents.safetensors";
  megaslide::io::write_safetensors(tensors,
                                   {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
  megaslide::TrainingRunOptions options;
  options.export_weights = dir + "/run_ft.safetensors";
  options.export_layout = megaslide::WanWeightsLayout::kComfyUI;
  megaslide::run_training(expert_config("both", {"data.tensors=" + tensors, "train.steps=2", "train.checkpoint_every=2",
                                                 "output.run_dir=" + dir + "/run"}),
                          options);
  megaslide::export_checkpoint_weights(dir + "/run", "latest", dir + "/diffusers");
  const auto run_files = megaslide::wan_comfyui_files(options.export_weights, wan);
  expect_same_weights(megaslide::WanWeights::open(run_files[0]),
                      megaslide::WanWeights::open(dir + "/diffusers/transformer"));
  expect_same_weights(megaslide::WanWeights::open(run_files[1]),
                      megaslide::WanWeights::open(dir + "/diffusers/transformer_2"));
  EXPECT_FALSE(torch::equal(megaslide::WanWeights::open(run_files[1]).read("proj_out.weight"),
                            low.read("proj_out.weight", torch::kBFloat16).to(torch::kFloat32)) &&
               torch::equal(megaslide::WanWeights::open(run_files[0]).read("proj_out.weight"),
                            high.read("proj_out.weight", torch::kBFloat16).to(torch::kFloat32)))
      << "an expert trained";
  megaslide::io::remove_tree(dir);
}
