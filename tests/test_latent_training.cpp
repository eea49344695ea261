// Latent-space training and sampling with the frozen encoders (docs/conditioning.md): the config keys
// model.text_encoder and model.vae, the frozen CLIP and VAE checked against the config, batches of VAE
// latents with CLIP embeddings for both trainers, and configs/paper-small.yaml end to end through
// megaslide-train and megaslide-sample (with the tiny fixture models standing in for the real weights).
#include <gtest/gtest.h>

#include "run_tool.h"
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/data/structured_motion.h"
#include "megaslide/io/files.h"
#include "megaslide/io/video.h"
#include "megaslide/model/frozen_encoders.h"
#include "trainers.h"

using namespace megaslide::testing;
using megaslide::Trainer;

using megaslide::ConfigError;
using megaslide::RunConfig;
using megaslide::io::join_path;

namespace {

std::string source_path(const std::string& relative) { return std::string(MEGASLIDE_SOURCE_DIR) + "/" + relative; }
std::string paper_small() { return source_path("configs/paper-small.yaml"); }

// configs/paper-small.yaml with the fixture folders made absolute (the tests may run anywhere).
RunConfig small_config(std::vector<std::string> overrides = {}) {
  std::vector<std::string> all{"model.text_encoder.weights=" + source_path("tests/fixtures/clip/text_only"),
                               "model.text_encoder.vocab=" + source_path("tests/fixtures/clip"),
                               "model.vae.weights=" + source_path("tests/fixtures/vae/tiny"), "train.device=cpu",
                               "output.progress=false"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return megaslide::load_run_config(paper_small(), all);
}

std::string absolute_sets() {
  return " --set model.text_encoder.weights=" + source_path("tests/fixtures/clip/text_only") +
         " --set model.text_encoder.vocab=" + source_path("tests/fixtures/clip") +
         " --set model.vae.weights=" + source_path("tests/fixtures/vae/tiny") +
         " --set train.device=cpu --set output.progress=false";
}

std::string fresh_dir(const std::string& name) {
  auto dir = "/tmp/megaslide-test-latent-" + name + "-" + std::to_string(::getpid());
  megaslide::io::remove_tree(dir);
  return dir;
}

// The key a ConfigError names when `f` throws one (fails the test when it throws nothing).
template <typename F>
std::string config_error_key(F f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.key();
  }
  ADD_FAILURE() << "no ConfigError";
  return "";
}

}  // namespace

TEST(LatentConfig, NestedKeysParseRoundTripAndOverride) {
  const auto c = megaslide::parse_run_config(
      "model:\n  text_dim: 768\n  text_encoder: {kind: clip, weights: /m/clip, dtype: bf16}\n"
      "  vae:\n    kind: sd\n    weights: /m/vae\n    frames_per_batch: 3\n    tile_size: 256\n    tile_overlap: 0.5\n"
      "data:\n  height: 64\n  width: 128\n",
      "test", {"model.vae.latent_channels=4"});
  EXPECT_EQ(c.model.text_encoder.kind, "clip");
  EXPECT_EQ(c.model.text_encoder.weights, "/m/clip");
  EXPECT_EQ(c.model.text_encoder.dtype, "bf16");
  EXPECT_EQ(c.model.vae.kind, "sd");
  EXPECT_EQ(c.model.vae.frames_per_batch, 3);
  EXPECT_EQ(c.model.vae.tile_size, 256);
  EXPECT_DOUBLE_EQ(c.model.vae.tile_overlap, 0.5);
  // The DiT's samples are the VAE's latents: 4 channels, 1/8 of the pixels.
  EXPECT_EQ(megaslide::model_sample_shape(c), (std::array<int64_t, 4>{4, c.data.frames, 8, 16}));
  const auto back = megaslide::parse_run_config(megaslide::to_yaml(c), "round trip");
  EXPECT_EQ(megaslide::to_yaml(back), megaslide::to_yaml(c));
  EXPECT_EQ(back.model.vae.weights, "/m/vae");
  EXPECT_EQ(back.model.text_encoder.kind, "clip");
  // A pixel model's samples are the video's.
  const RunConfig pixel;
  EXPECT_EQ(megaslide::model_sample_shape(pixel),
            (std::array<int64_t, 4>{3, pixel.data.frames, pixel.data.height, pixel.data.width}));
}

TEST(LatentConfig, BadValuesNameTheKey) {
  auto key = [](const std::string& yaml, std::vector<std::string> sets = {}) {
    return config_error_key([&] { megaslide::parse_run_config(yaml, "test", sets); });
  };
  EXPECT_EQ(key("model: {text_encoder: {kind: clip}}"), "model.text_encoder.weights");
  EXPECT_EQ(key("model: {text_encoder: {kind: t5}}"), "model.text_encoder.kind");
  EXPECT_EQ(key("model: {vae: {kind: sd}}"), "model.vae.weights");
  EXPECT_EQ(key("model: {vae: {weights: /x}}"), "model.vae.weights");  // kind none reads no weights
  EXPECT_EQ(key("model: {vae: {kind: sd, weights: /x, colour: 3}}"), "model.vae.colour");
  EXPECT_EQ(key("model: {vae: sd}"), "model.vae");
  EXPECT_EQ(key("model: {vae: {kind: sd, weights: /x}}\ndata: {height: 20}"),
            "data.height");  // not a multiple of 8 x 2
  EXPECT_EQ(key("model: {vae: {kind: sd, weights: /x}}\ndata: {channels: 4}"), "data.channels");
  EXPECT_EQ(key("model: {vae: {kind: sd, weights: /x, tile_size: 100}}"), "model.vae.tile_size");
  EXPECT_EQ(key("model: {text_encoder: {kind: clip, weights: /x}}\ndata: {max_text_tokens: 78}"),
            "data.max_text_tokens");
  EXPECT_EQ(key("", {"model.vae.frames_per_batch=0"}), "model.vae.frames_per_batch");
}

TEST(FrozenEncoders, LoadTheFixturesAndRefuseFoldersThatDisagreeWithTheConfig) {
  const auto config = small_config();
  auto frozen = megaslide::FrozenEncoders::load(config, torch::kCPU, "test");
  ASSERT_TRUE(frozen && frozen->has_text() && frozen->has_vae());
  EXPECT_EQ(megaslide::FrozenEncoders::load(RunConfig(), torch::kCPU, "test"), nullptr);  // builtin + none

  auto [text, mask] = frozen->encode_text({"a red ball moves left", ""});
  EXPECT_EQ(text.sizes(), (std::vector<int64_t>{2, config.data.max_text_tokens, 32}));
  EXPECT_EQ(mask.scalar_type(), torch::kBool);
  EXPECT_EQ(mask[1].sum().item<int64_t>(), 2);  // the empty prompt: start and end tokens

  auto pixels = torch::rand({1, 3, 2, 32, 32}) * 2 - 1;
  auto latents = frozen->encode_video(pixels);
  EXPECT_EQ(latents.sizes(), (std::vector<int64_t>{1, 3, 2, 8, 8}));
  EXPECT_EQ(frozen->decode_video(latents).sizes(), pixels.sizes());

  auto key = [](std::vector<std::string> sets) {
    return config_error_key([&] { megaslide::FrozenEncoders::load(small_config(sets), torch::kCPU, "test"); });
  };
  EXPECT_EQ(key({"model.vae.weights=/nonexistent/vae"}), "model.vae.weights");
  EXPECT_EQ(key({"model.text_encoder.weights=/nonexistent/clip"}), "model.text_encoder.weights");
  EXPECT_EQ(key({"model.vae.weights=" + source_path("tests/fixtures/clip/text_only")}),
            "model.vae.weights");                                                // no VAE files there
  EXPECT_EQ(key({"model.vae.latent_channels=4"}), "model.vae.latent_channels");  // the DiT's channels are not the VAE's
  EXPECT_EQ(key({"model.vae.downscale=8", "data.height=64", "data.width=64"}), "model.vae.downscale");
  EXPECT_EQ(key({"model.text_dim=768"}), "model.text_dim");
}

TEST(LatentTraining, BatchesAreVaeLatentsOfTheClipsWithClipEmbeddingsOfTheCaptions) {
  const auto config = small_config({"diffusion.caption_dropout=0"});
  megaslide::DiffusionBatchSource source(config);
  auto b = source.next(torch::kCPU);
  EXPECT_EQ(b.x0.sizes(), (std::vector<int64_t>{4, 3, 8, 8, 8}));  // latents, not 4 x 3 x 8 x 32 x 32 pixels
  EXPECT_EQ(b.noise.sizes(), b.x0.sizes());
  EXPECT_FALSE(b.text_ids.defined());
  ASSERT_TRUE(b.text.defined());
  EXPECT_EQ(b.text.sizes(), (std::vector<int64_t>{4, config.data.max_text_tokens, 32}));

  // The same first batch, recomputed independently: the clips the sampler draws first (EpochSampler with
  // train.seed), through the VAE and CLIP.
  megaslide::StructuredMotionDataset dataset(megaslide::StructuredMotionOptions()
                                                 .channels(3)
                                                 .frames(config.data.frames)
                                                 .height(config.data.height)
                                                 .width(config.data.width)
                                                 .num_clips(config.data.num_clips)
                                                 .seed(config.data.seed));
  megaslide::EpochSampler sampler(config.data.num_clips, config.train.seed);
  auto clips = dataset.batch(sampler.next(4));
  auto frozen = megaslide::FrozenEncoders::load(config, torch::kCPU, "test");
  EXPECT_TRUE(torch::allclose(b.x0, frozen->encode_video(clips.video), 1e-5, 1e-6));
  auto [text, mask] = frozen->encode_text(clips.captions);
  EXPECT_TRUE(torch::allclose(b.text, text, 1e-5, 1e-6));
  EXPECT_TRUE(torch::equal(b.text_mask, mask));
}

TEST(LatentTraining, ResidentAndStreamedTrainersTrainTheLatentDiTAlike) {
  // fp32 on the CPU: the streamed CPU-master trainer computes what the resident loop computes.
  const auto config = small_config({"offload.compute_dtype=fp32", "train.threads=1", "offload.optimizer_threads=1"});
  RunConfig resident_config = config;
  resident_config.offload.enabled = false;
  megaslide::Trainer resident = resident_trainer(resident_config);
  megaslide::Trainer streamed = streamed_trainer(config);
  // No built-in text encoder: CLIP is frozen, only the DiT trains.
  EXPECT_FALSE(dit_text_encoder(resident));
  for (const auto& [name, shape] : parameter_shapes(resident)) EXPECT_NE(name.rfind("text_encoder.", 0), 0u) << name;
  EXPECT_EQ(resident.parameter_count(), streamed.parameter_count());
  for (int step = 0; step < 3; ++step) {
    const auto a = resident.step(), b = streamed.step();
    EXPECT_NEAR(a.loss, b.loss, 1e-4 * std::abs(a.loss)) << "step " << step + 1;
    EXPECT_TRUE(std::isfinite(a.loss));
  }
}

// The small paper config end to end: a latent-space run whose loss falls, checkpointed; sampling from the
// checkpoint decodes through the VAE into playable videos; a resume with another text encoder is refused.
TEST(LatentTraining, PaperSmallTrainsWithFallingLossAndSamplesPlayableVideos) {
  const auto dir = fresh_dir("run");
  auto r = megaslide::testing::run_tool("megaslide-train",
                                        "--config " + paper_small() + absolute_sets() + " --run-dir " + dir +
                                            " --set train.steps=20 --set train.checkpoint_every=20 --set "
                                            "train.log_every=10 --set offload.compute_dtype=fp32");
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream metrics(join_path(dir, "metrics.jsonl"));
  std::vector<double> losses;
  for (std::string line; std::getline(metrics, line);)
    losses.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  ASSERT_EQ(losses.size(), 20u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i)
    first += losses[static_cast<size_t>(i)] / 5, last += losses[losses.size() - 1 - static_cast<size_t>(i)] / 5;
  std::cout << "paper-small latent run: mean loss of steps 1-5 " << first << ", of steps 16-20 " << last << "\n";
  EXPECT_LT(last, 0.7 * first) << "the loss did not fall";
  std::string log;
  {
    std::ifstream in(join_path(dir, "train.log"));
    log.assign(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_NE(log.find("latent space: SD VAE"), std::string::npos) << log;
  EXPECT_NE(log.find("text encoder: CLIP"), std::string::npos) << log;

  const auto out = fresh_dir("samples");
  const auto prompts = dir + "/prompts.txt";
  {
    std::ofstream p(prompts);
    p << "a red ball moves left\nblue stripes oscillate\n";
  }
  auto s = megaslide::testing::run_tool("megaslide-sample",
                                        "--checkpoint " + dir + " --prompts " + prompts + " --out " + out +
                                            " --samples-per-prompt 1 --steps 4 --device cpu --no-progress");
  ASSERT_EQ(s.code, 0) << s.output;
  int videos = 0;
  for (const auto& name : megaslide::io::list_directory(join_path(out, "videos"))) {
    const auto info = megaslide::io::probe_video(join_path(join_path(out, "videos"), name));
    EXPECT_EQ(info.codec, "h264");
    EXPECT_EQ(info.width, 32);  // decoded by the VAE: pixels, not 8x8 latents
    EXPECT_EQ(info.height, 32);
    EXPECT_EQ(info.frames, 8);
    ++videos;
  }
  EXPECT_EQ(videos, 2);
  // --text-encoder and --vae take the place of the folders the checkpoint's config names (a checkpoint moved, or
  // written with relative paths from another folder): a folder that is not there is refused naming the key.
  for (const std::string flag : {"--text-encoder", "--vae"}) {
    const auto moved = fresh_dir("moved-samples");
    auto m = megaslide::testing::run_tool("megaslide-sample", "--checkpoint " + dir + " --prompts " + prompts +
                                                                  " --out " + moved + " --steps 1 --device cpu " +
                                                                  flag + " /nonexistent/moved");
    EXPECT_EQ(m.code, 2) << m.output;
    EXPECT_NE(m.output.find(flag == "--vae" ? "model.vae.weights" : "model.text_encoder.weights"), std::string::npos)
        << m.output;
    EXPECT_NE(m.output.find("'/nonexistent/moved' is not a folder"), std::string::npos) << m.output;
    EXPECT_FALSE(megaslide::io::path_exists(moved));
  }

  // Resume with the built-in text encoder instead of CLIP: refused, naming the key.
  auto resume = megaslide::testing::run_tool(
      "megaslide-train", "--config " + paper_small() + absolute_sets() + " --run-dir " + dir +
                             " --set train.steps=30 --resume latest --set model.text_encoder.kind=builtin "
                             "--set \"model.text_encoder.weights=''\" --set \"model.text_encoder.vocab=''\"");
  EXPECT_EQ(resume.code, 2) << resume.output;
  EXPECT_NE(resume.output.find("model.text_encoder.kind"), std::string::npos) << resume.output;
  megaslide::io::remove_tree(dir);
  megaslide::io::remove_tree(out);
}

TEST(LatentTraining, MissingWeightsOrChannelMismatchExitTwoNamingItAndWriteNothing) {
  const auto dir = fresh_dir("bad");
  auto r =
      megaslide::testing::run_tool("megaslide-train", "--config " + paper_small() + absolute_sets() + " --run-dir " +
                                                          dir + " --set model.vae.weights=/nonexistent/sd-vae");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.vae.weights"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("/nonexistent/sd-vae"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(dir));

  r = megaslide::testing::run_tool("megaslide-train", "--config " + paper_small() + absolute_sets() + " --run-dir " +
                                                          dir + " --set model.vae.latent_channels=4");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.vae.latent_channels"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(dir));
}

TEST(LatentTraining, PaperConfigPlansWithoutTheWeights) {
  auto r = megaslide::testing::run_tool("megaslide-train",
                                        "--config " + source_path("configs/paper-105b.yaml") + " --dry-run --json");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  // The 105b architecture (104 x 8192) with CLIP's 768-wide text instead of 4096: narrower cross-attention
  // inputs, 99.9 B trained parameters (CLIP and the VAE are frozen and not counted).
  EXPECT_NEAR(j["params"].get<double>() / 1e9, 99.9, 0.1);
  EXPECT_EQ(j["tokens_per_sample"].get<int64_t>(),
            256 * 68 * 120);  // 1088x1920 pixels -> 136x240 latents -> 68x120 tokens
  EXPECT_EQ(j["token_grid"], nlohmann::json::array({256, 68, 120}));
}
