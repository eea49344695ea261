// Validation videos of a Wan run (train/wan_validation.h), on the tiny umT5, the tiny Wan VAE and a DiT sized
// to them (tests/fixtures/umt5, wan_vae/tiny; the sizes of tests/fixtures/wan_pipeline):
//   - the sampled latents are WanTextToVideo's (umT5 -> flow_sample -> the DiT) over a fresh model holding
//     the trainer's current fp32 masters (its blocks rounded to bf16 for a bf16 trainer), bit for bit, for
//     the resident loop and for the streamed trainer, whose blocks are read from its host store in place;
//     and they change as the weights train;
//   - sampling leaves training alone: a trainer that samples between its steps has the losses and the
//     weights of one that does not, bit for bit, and keeps its module's training mode;
//   - megaslide-train with train.sample_every writes playable H.264 videos (5 frames of 32 x 48) and
//     index.json under samples/step-NNNNNNN/ at each validation step, with the same prompts and seeds each
//     time, and logs them; a run trained without the encoders writes them once resumed with them; a Wan
//     run with train.sample_every but without umT5 or the Wan VAE is refused with exit 2 naming the key,
//     before anything is written, as is a VAE that does not load.
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <utility>
#include <vector>

#include "megaslide/diffusion/wan_text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/video.h"
#include "megaslide/io/fp8.h"
#include "megaslide/model/lora.h"
#include "megaslide/model/wan_weights.h"
#include "trainers.h"
#include "megaslide/train/wan_validation.h"
#include "run_tool.h"

using namespace megaslide::testing;
using megaslide::Trainer;

using megaslide::io::join_path;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";
const std::string kUmt5 = kFixtures + "umt5/hf";
const std::string kSpiece = kFixtures + "umt5/tokenizer/spiece.model";
const std::string kVae = kFixtures + "wan_vae/tiny";

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-wanval-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

// A Wan run of the wan_pipeline fixture DiT's sizes (umT5 24 wide, 16 latent channels): latents
// 16 x 2 x 4 x 6 (5 frames of 32 x 48 pixels), 8 text tokens, 2 sampling steps.
const std::string kModel =
    "model:\n  arch: wan\n  wan: {dim: 16, layers: 2, heads: 2, ffn_dim: 32, freq_dim: 16, text_dim: 24, patch: [1, 2, "
    "2], "
    "in_channels: 16, out_channels: 16, qk_norm: true, cross_attn_norm: true}\n";
const std::string kEncoders = "  text_encoder: {kind: umt5, weights: " + kUmt5 + ", vocab: " + kSpiece +
                              "}\n  vae: {kind: wan, weights: " + kVae + ", latent_channels: 16}\n";
std::string run_sections(const std::string& tensors) {
  return "data: {dataset: latent-tensors, tensors: " + tensors +
         ", channels: 16, frames: 2, height: 4, width: 6, max_text_tokens: 8}\n"
         "diffusion: {objective: flow, shift: 3.0, sample_steps: 2, guidance_scale: 4.0}\n"
         "train: {steps: 4, batch_size: 2, lr: 0.01, warmup_steps: 0, lr_schedule: constant, device: cpu, seed: 3, "
         "log_every: 1, threads: 1}\n"
         "offload: {compute_dtype: fp32, mode: async, emulated_copy_delay_ms: 1}\noutput: {progress: false}\n";
}

megaslide::WanLatentData tiny_data() {
  torch::manual_seed(11);
  megaslide::WanLatentData d;
  d.latents = torch::randn({4, 16, 2, 4, 6});
  d.text = torch::randn({4, 8, 24});
  d.empty_text = torch::zeros({8, 24});  // caption dropout's (diffusion.caption_dropout 0.1)
  return d;
}

megaslide::RunConfig tiny_config(const std::vector<std::string>& overrides) {
  return megaslide::parse_run_config(kModel + kEncoders + run_sections("unused.safetensors"), "test", overrides);
}

// A fresh Wan DiT holding the trainer's fp32 masters.
megaslide::WanTransformer with_masters(megaslide::Trainer& trainer) {
  megaslide::WanTransformer model(megaslide::WanOptions::from_config(trainer.config()));
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> params;
  for (auto& p : model->named_parameters(true)) params.emplace(p.key(), p.value());
  for (const auto& [name, value] : trainer.master_weights()) params.at(name).copy_(value);
  return model;
}

// What WanTextToVideo samples for the validation's jobs (one at a time, as the validation samples them)
// over a fresh model holding the trainer's masters, its blocks in `dtype`.
torch::Tensor reference_latents(const megaslide::WanValidation& v, megaslide::Trainer& trainer, c10::ScalarType dtype) {
  megaslide::WanTransformer model(megaslide::WanOptions::from_config(trainer.config()));
  std::map<std::string, torch::Tensor> params;
  for (auto& p : model->named_parameters(true)) params.emplace(p.key(), p.value());
  const auto masters = trainer.master_weights();
  EXPECT_EQ(masters.size(), params.size());
  {
    torch::NoGradGuard no_grad;
    for (const auto& [name, value] : masters) params.at(name).copy_(value);
  }
  auto denoiser = std::make_shared<megaslide::ResidentWanDenoiser>(model, torch::kCPU, dtype);
  megaslide::WanTextToVideo pipeline(v.latent_config(), megaslide::Umt5Encoder::load(kUmt5),
                                     megaslide::Umt5Tokenizer::from_file(kSpiece), denoiser,
                                     megaslide::WanVae::load(kVae));
  std::vector<torch::Tensor> out;
  for (const auto& job : v.jobs())
    out.push_back(pipeline.sample({job.prompt}, {job.seed}, v.options()).to(torch::kCPU));
  return torch::cat(out);
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

struct Mode {
  const char* name;
  std::vector<std::string> overrides;
  c10::ScalarType blocks;  // the dtype the DiT's blocks run in
};
// bf16 blocks are compared with bf16 blocks (the same operations on the same values), never with fp32.
const std::vector<Mode> kModes{{"resident", {"offload.enabled=false"}, at::kFloat},
                               {"streamed fp32", {}, at::kFloat},
                               {"streamed bf16", {"offload.compute_dtype=bf16"}, at::kBFloat16}};

}  // namespace

TEST(WanValidation, SamplesTheTrainersCurrentWeights) {
  for (const auto& mode : kModes) {
    SCOPED_TRACE(mode.name);
    const auto config = tiny_config(mode.overrides);
    const megaslide::WanValidation validation(config, {}, "test");
    ASSERT_EQ(validation.jobs().size(), 2u);
    EXPECT_EQ(validation.jobs()[0].prompt, megaslide::wan_validation_prompts()[0]);
    EXPECT_EQ(validation.jobs()[1].prompt, megaslide::wan_validation_prompts()[1]);
    megaslide::Trainer trainer = wan_trainer(config, tiny_data());
    EXPECT_EQ(trainer.streams(), std::string(mode.name) != "resident");
    const auto initial = torch::cat(validation.sample(trainer));
    ASSERT_EQ(initial.sizes(), (std::vector<int64_t>{2, 16, 2, 4, 6}));
    const auto initial_reference = reference_latents(validation, trainer, mode.blocks);
    EXPECT_TRUE(torch::equal(initial, initial_reference)) << max_diff(initial, initial_reference);

    trainer.step();
    trainer.step();
    const auto trained = torch::cat(validation.sample(trainer));
    const auto trained_reference = reference_latents(validation, trainer, mode.blocks);
    EXPECT_TRUE(torch::equal(trained, trained_reference)) << max_diff(trained, trained_reference);
    EXPECT_GT(max_diff(trained, initial), 1e-3);  // the weights moved, and the videos with them
  }
}

// The property: a Wan2.2 TI2V run (diffusion.first_frame_clean > 0) makes image-to-video validation videos from its
// clips' own first latent frames, kept clean as the training keeps them: the latents are WanTextToVideo's
// sample_from_image of the image those frames encode (the trainer's current weights, fp32), bit for bit, and start
// with that frame exactly.
TEST(WanValidation, Ti2vRunsSampleFromTheirClipsFirstFrames) {
  const auto config = tiny_config({"diffusion.first_frame_clean=0.5", "offload.enabled=false"});
  ASSERT_TRUE(megaslide::wan_validation_from_images(config));
  const auto vae = megaslide::WanVae::load(kVae);
  torch::manual_seed(5);
  const auto image = torch::rand({3, 32, 48}) * 2 - 1;
  torch::Tensor frame;
  {
    torch::NoGradGuard no_grad;
    frame = vae.encode(image.view({1, 3, 1, 32, 48}));  // [1, 16, 1, 4, 6], normalised
  }
  auto data = tiny_data();
  data.latents.narrow(2, 0, 1).copy_(frame.expand({4, -1, -1, -1, -1}));
  megaslide::WanValidation validation(config, {}, "test");
  validation.images(data);
  megaslide::Trainer trainer = wan_trainer(config, data);
  trainer.step();
  const auto sampled = torch::cat(validation.sample(trainer));
  ASSERT_EQ(sampled.sizes(), (std::vector<int64_t>{2, 16, 2, 4, 6}));
  EXPECT_TRUE(torch::equal(sampled.narrow(2, 0, 1), frame.expand({2, -1, -1, -1, -1})));

  const auto model = with_masters(trainer);
  megaslide::WanTextToVideo pipeline(
      validation.latent_config(), megaslide::Umt5Encoder::load(kUmt5), megaslide::Umt5Tokenizer::from_file(kSpiece),
      std::make_shared<megaslide::ResidentWanDenoiser>(model, torch::kCPU, at::kFloat), megaslide::WanVae::load(kVae));
  for (size_t i = 0; i < validation.jobs().size(); ++i) {
    const auto& job = validation.jobs()[i];
    const auto reference = pipeline.sample_from_image({job.prompt}, {job.seed}, image, validation.options());
    EXPECT_TRUE(torch::equal(sampled.narrow(0, static_cast<int64_t>(i), 1), reference))
        << job.prompt << ": " << max_diff(sampled.narrow(0, static_cast<int64_t>(i), 1), reference);
    // index.json says which item's frame each video started from.
    EXPECT_EQ(job.image.value_or(""), "data.tensors item " + std::to_string(i) + " (its first frame)");
  }
}

// The property: a LoRA run's validation videos are the adapted model's — the frozen base as the trainer holds
// it (resident; streamed; streamed as fp8 blocks, upcast on their way to the device) with each adapter's update
// merged in fp32 — within 1e-4, before and after two steps, and the adapters' training moves them.
TEST(WanValidation, LoraRunsSampleTheAdaptedModel) {
  const std::vector<std::pair<const char*, std::vector<std::string>>> modes{
      {"resident", {"offload.enabled=false"}}, {"streamed", {}}, {"streamed fp8 base", {"lora.base_dtype=fp8"}}};
  for (const auto& [name, overrides] : modes) {
    SCOPED_TRACE(name);
    auto all = overrides;
    all.insert(all.end(), {"lora.rank=4", "lora.alpha=8", "train.lr=0.05"});
    const auto config = tiny_config(all);
    const megaslide::WanValidation validation(config, {}, "test");
    megaslide::Trainer trainer = wan_trainer(config, tiny_data());
    // The reference: a fresh model holding the frozen base the trainer uses, with the updates merged in fp32.
    const auto reference = [&] {
      megaslide::WanTransformer model(megaslide::WanOptions::from_config(trainer.config()));
      std::map<std::string, torch::Tensor> params;
      for (auto& p : model->named_parameters(true)) params.emplace(p.key(), p.value());
      torch::NoGradGuard no_grad;
      for (const auto& p : megaslide::wan_module(trainer)->named_parameters(true))
        if (p.value().numel() > 0) params.at(p.key()).copy_(p.value());
      if (auto* engine = trainer.engine()) {  // the blocks as the host store keeps them
        const auto& store = engine->store();
        for (int64_t l = 0; l < store.num_blocks(); ++l) {
          const auto& specs = store.block_spec(l).params;
          for (size_t i = 0; i < specs.size(); ++i) {
            const auto v = store.param(l, specs[i].name);
            const auto value = v.exact.defined() ? v.exact
                               : store.scales(l).defined()
                                   ? megaslide::dequantize_fp8({v.compute, store.scales(l)[static_cast<int64_t>(i)]})
                                   : v.compute.to(torch::kFloat32);
            params.at("blocks." + std::to_string(l) + "." + specs[i].name).copy_(value);
          }
        }
      }
      const auto adapters = trainer.weight_views();
      for (size_t i = 0; i + 1 < adapters.size(); i += 2) {
        const std::string weight = megaslide::lora_base_weight(adapters[i].first);
        params.at(weight) += torch::matmul(adapters[i + 1].second.cpu(), adapters[i].second.cpu()) * 2.0;
      }
      auto denoiser = std::make_shared<megaslide::ResidentWanDenoiser>(model, torch::kCPU, at::kFloat);
      megaslide::WanTextToVideo pipeline(validation.latent_config(), megaslide::Umt5Encoder::load(kUmt5),
                                         megaslide::Umt5Tokenizer::from_file(kSpiece), denoiser,
                                         megaslide::WanVae::load(kVae));
      std::vector<torch::Tensor> out;
      for (const auto& job : validation.jobs())
        out.push_back(pipeline.sample({job.prompt}, {job.seed}, validation.options()).to(torch::kCPU));
      return torch::cat(out);
    };
    const auto initial = torch::cat(validation.sample(trainer));
    EXPECT_LT(max_diff(initial, reference()), 1e-4);
    trainer.step();
    trainer.step();
    const auto trained = torch::cat(validation.sample(trainer));
    EXPECT_LT(max_diff(trained, reference()), 1e-4);
    EXPECT_GT(max_diff(trained, initial), 1e-3) << "the adapters moved, and the videos with them";
  }
}

// The property: a prompt file's line samples at its own size, seed, steps and guidance — exactly what
// WanTextToVideo gives for that size and those settings over the same weights — while a line without
// settings keeps the run's; sizes the Wan VAE or the patch cannot take are refused naming the line.
TEST(WanValidation, PromptFileLinesSampleAtTheirOwnSizeAndSettings) {
  const auto dir = temp_dir("prompts");
  const auto prompts = join_path(dir, "prompts.txt");
  megaslide::io::write_file_atomically(prompts, "a fox in snow --f 9 --h 16 --w 32 --d 3 --s 1 --g 1\na fox in snow\n");
  const auto config = tiny_config({"offload.enabled=false", "train.sample_prompts=" + prompts});
  const megaslide::WanValidation validation(config, {}, "test");
  ASSERT_EQ(validation.jobs().size(), 2u);
  EXPECT_EQ(validation.jobs()[0].seed, 3u);
  EXPECT_EQ(validation.jobs()[1].index, 1);
  megaslide::Trainer trainer = wan_trainer(config, tiny_data());
  trainer.step();
  const auto latents = validation.sample(trainer);
  ASSERT_EQ(latents.size(), 2u);
  EXPECT_EQ(latents[0].sizes(), (std::vector<int64_t>{1, 16, 3, 2, 4}));  // 1 + 8/4 latent frames of 16/8 x 32/8
  EXPECT_EQ(latents[1].sizes(), (std::vector<int64_t>{1, 16, 2, 4, 6}));  // the run's

  auto sized = validation.latent_config();
  sized.data.frames = 3, sized.data.height = 2, sized.data.width = 4;
  const auto model = with_masters(trainer);
  megaslide::WanTextToVideo pipeline(
      sized, megaslide::Umt5Encoder::load(kUmt5), megaslide::Umt5Tokenizer::from_file(kSpiece),
      std::make_shared<megaslide::ResidentWanDenoiser>(model, torch::kCPU, at::kFloat), megaslide::WanVae::load(kVae));
  auto options = validation.options();
  options.steps(1).guidance_scale(1.0);
  const auto reference = pipeline.sample({"a fox in snow"}, {3}, options);
  EXPECT_TRUE(torch::equal(latents[0], reference)) << max_diff(latents[0], reference);

  for (const auto& [line, problem] : std::vector<std::pair<std::string, std::string>>{
           {"a fox --f 8",
            "line 1: this model cannot sample 8x32x48 (frames x height x width): 8 frames: the Wan VAE takes 1 + 4k "
            "frames"},
           {"a fox --h 24",
            "line 1: this model cannot sample 5x24x48 (frames x height x width): height 24: not a multiple of 16"}}) {
    megaslide::io::write_file_atomically(prompts, line + "\n");
    try {
      const megaslide::WanValidation refused(config, {}, "test");
      ADD_FAILURE() << "accepted " << line;
    } catch (const megaslide::ConfigError& e) {
      EXPECT_EQ(e.key(), "train.sample_prompts");
      EXPECT_NE(std::string(e.what()).find(problem), std::string::npos) << e.what();
    }
  }
  megaslide::io::remove_tree(dir);
}

// The property: the validation videos of a run that fine-tunes one of Wan2.2's two experts are the pair's —
// WanPipeline's two-expert sampling (the switch at the boundary 0.875) over the trainer's expert and the
// other one read from its weights (tests/fixtures/wan22_experts), for either expert, resident or streamed —
// and not what the trained expert gives alone; a run that trains both (expert both: the low-noise expert's
// streamed blocks after the high-noise one's in the store) samples the pair of its two experts.
TEST(WanValidation, OneTrainedExpertSamplesWithTheOther) {
  const std::string experts = kFixtures + "wan22_experts";
  for (const std::string expert : {"high", "low", "both"})
    for (const bool streamed : {false, true}) {
      SCOPED_TRACE(expert + (streamed ? ", streamed" : ", resident"));
      const auto config =
          megaslide::parse_run_config("model:\n  arch: wan\n  wan: {weights: " + experts + ", expert: " + expert +
                                          "}\n" + kEncoders + run_sections("unused.safetensors"),
                                      "test", {std::string("offload.enabled=") + (streamed ? "true" : "false")});
      const auto resolved = megaslide::with_wan_architecture_from_weights(config);
      const megaslide::WanValidation validation(resolved, {}, "test");
      EXPECT_EQ(validation.options().boundary_ratio(), 0.875);
      megaslide::Trainer trainer = wan_trainer(config, tiny_data());
      const auto got = torch::cat(validation.sample(trainer));

      auto both = megaslide::wan_model_from_config(resolved, "test");
      auto high = std::make_shared<megaslide::ResidentWanDenoiser>(both.dit, torch::kCPU, at::kFloat);
      auto low = std::make_shared<megaslide::ResidentWanDenoiser>(both.low_noise->dit, torch::kCPU, at::kFloat);
      auto sample = [&](std::shared_ptr<megaslide::WanDenoiser> denoiser, double boundary) {
        megaslide::WanTextToVideo pipeline(validation.latent_config(), megaslide::Umt5Encoder::load(kUmt5),
                                           megaslide::Umt5Tokenizer::from_file(kSpiece), denoiser,
                                           megaslide::WanVae::load(kVae));
        std::vector<torch::Tensor> out;
        for (const auto& job : validation.jobs())
          out.push_back(pipeline
                            .sample({job.prompt}, {job.seed},
                                    megaslide::WanSampleOptions(validation.options()).boundary_ratio(boundary))
                            .to(torch::kCPU));
        return torch::cat(out);
      };
      const auto pair = sample(std::make_shared<megaslide::WanExpertsDenoiser>(high, low, 0.875), 0.875);
      EXPECT_LT(max_diff(got, pair), 1e-5);
      if (expert == "both") continue;
      const auto alone = sample(expert == "high" ? std::shared_ptr<megaslide::WanDenoiser>(high)
                                                 : std::shared_ptr<megaslide::WanDenoiser>(low),
                                0.0);
      EXPECT_GT(max_diff(got, alone), 1e-3) << "the other expert takes its timesteps";
    }
}

// Property: an expert trained with the 3D-DSA retrofit (its blocks hold the offset network and relative bias) makes
// its validation videos beside the other expert, dense as published, whose blocks are smaller than the trainer's
// slots expect: that one streams through slots of its own, the trained one through the trainer's, and the videos are
// those of the pair (finite, and changed when the trained expert's weights change).
TEST(WanValidation, ARetrofittedExpertSamplesBesideTheDenseOtherOne) {
  const std::string experts = kFixtures + "wan22_experts";
  const auto config = megaslide::parse_run_config(
      "model:\n  arch: wan\n  wan: {weights: " + experts + ", expert: high}\n" + kEncoders +
          run_sections("unused.safetensors"),
      "test", {"offload.enabled=true", "model.self_attention=dsa3d", "model.dsa_kernel=[3,3,3]"});
  const auto resolved = megaslide::with_wan_architecture_from_weights(config);
  const megaslide::WanValidation validation(resolved, {}, "test");
  megaslide::Trainer trainer = wan_trainer(config, tiny_data());
  const auto before = torch::cat(validation.sample(trainer));
  EXPECT_TRUE(torch::isfinite(before).all().item<bool>());
  trainer.step();
  const auto after = torch::cat(validation.sample(trainer));
  EXPECT_TRUE(torch::isfinite(after).all().item<bool>());
  EXPECT_GT(max_diff(before, after), 0.0) << "the trained expert's step shows";
}

TEST(WanValidation, SamplingBetweenStepsLeavesTrainingBitForBit) {
  for (const auto& mode : kModes) {
    SCOPED_TRACE(mode.name);
    const auto config = tiny_config(mode.overrides);
    const megaslide::WanValidation validation(config, {}, "test");
    megaslide::Trainer sampled = wan_trainer(config, tiny_data());
    megaslide::Trainer plain = wan_trainer(config, tiny_data());
    const bool training = wan_module(sampled)->is_training();
    for (int step = 0; step < 4; ++step) {
      EXPECT_EQ(sampled.step().loss, plain.step().loss) << "step " << step + 1;
      if (step % 2 == 0) validation.sample(sampled);
      EXPECT_EQ(wan_module(sampled)->is_training(), training);
    }
    const auto a = sampled.master_weights(), b = plain.master_weights();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  }
}

TEST(WanValidation, MegaslideTrainWritesPlayableVideosAtEachValidationStep) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto dir = temp_dir("cli");
  const auto tensors = join_path(dir, "latents.safetensors");
  const auto data = tiny_data();
  megaslide::io::write_safetensors(tensors,
                                   {{"latents", data.latents}, {"text", data.text}, {"empty_text", data.empty_text}});
  const auto config = join_path(dir, "wan.yaml"), bare = join_path(dir, "bare.yaml");
  std::ofstream(config) << kModel << kEncoders << run_sections(tensors);
  std::ofstream(bare) << kModel << run_sections(tensors);
  auto train = [](const std::string& args) {
    return megaslide::testing::run_tool("megaslide-train", args + " --set train.sample_every=2");
  };

  auto r = train("--config " + config + " --run-dir " + join_path(dir, "run"));
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<uint64_t> seeds;
  for (const char* step : {"step-0000002", "step-0000004"}) {
    const auto samples = join_path(join_path(dir, "run/samples"), step);
    const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(samples, "index.json")));
    ASSERT_EQ(index.at("videos").size(), 2u) << index.dump();
    EXPECT_EQ(index.at("fps").get<int64_t>(), 16);
    EXPECT_EQ(index.at("steps").get<int64_t>(), 2);
    for (size_t i = 0; i < 2; ++i) {
      const auto& video = index.at("videos")[i];
      EXPECT_EQ(video.at("prompt").get<std::string>(), megaslide::wan_validation_prompts()[i]);
      if (seeds.size() < 2) seeds.push_back(video.at("seed").get<uint64_t>());
      EXPECT_EQ(video.at("seed").get<uint64_t>(), seeds[i]) << step;  // the same videos each validation
      megaslide::io::VideoInfo info;
      const auto frames = megaslide::io::read_video(
          join_path(join_path(samples, "videos"), video.at("file").get<std::string>()), &info);
      EXPECT_EQ(frames.sizes(), (std::vector<int64_t>{5, 32, 48, 3})) << step;  // 1 + 4·(2 − 1) frames of 8·4 x 8·6
      EXPECT_EQ(info.codec, "h264");
    }
  }
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "run/samples/step-0000001")));
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "run/samples/step-0000003")));
  const auto log = megaslide::io::read_file(join_path(dir, "run/train.log"));
  EXPECT_NE(log.find("step 2: 2 validation videos in " + join_path(dir, "run/samples/step-0000002")), std::string::npos)
      << log;
  EXPECT_NE(log.find("step 4: 2 validation videos in"), std::string::npos) << log;

  // A run trained without the encoders gets validation videos when it resumes with them (they do not
  // change what Wan trains on, so the checkpoint does not hold them to its config).
  r = megaslide::testing::run_tool("megaslide-train", "--config " + bare + " --run-dir " + join_path(dir, "later") +
                                                          " --set train.steps=2 --set train.checkpoint_every=2");
  ASSERT_EQ(r.code, 0) << r.output;
  r = train("--config " + config + " --run-dir " + join_path(dir, "later") + " --resume latest");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(megaslide::io::path_exists(join_path(dir, "later/samples/step-0000004/index.json")));
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "later/samples/step-0000002")));

  // Refused before anything is written, naming the key.
  r = train("--config " + bare + " --run-dir " + join_path(dir, "no-umt5"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.text_encoder.kind"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train.sample_every"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "no-umt5")));
  r = train("--config " + bare + " --run-dir " + join_path(dir, "no-vae") +
            " --set model.text_encoder.kind=umt5 --set model.text_encoder.weights=" + kUmt5 +
            " --set model.text_encoder.vocab=" + kSpiece);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.vae.kind"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "no-vae")));
  r = train("--config " + config + " --run-dir " + join_path(dir, "bad-vae") +
            " --set model.vae.weights=" + join_path(dir, "nowhere"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.vae.weights"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "bad-vae")));
  megaslide::io::remove_tree(dir);
}
