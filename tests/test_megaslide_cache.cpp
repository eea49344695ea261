// megaslide-cache and megaslide-train on a video dataset, as a user runs them: a cache killed with SIGKILL
// part-way resumes (keeping its finished shards) and ends with the files of an uninterrupted build; bad
// input exits 2; a run trains from the cache and from decoding, reporting each bad item once and losing
// no good one; data_wait_s is in metrics.jsonl; bad train.init_from is refused with exit 2 before
// anything is written; Wan trains from its cache and writes validation videos of its first captions; with
// Wan 2.2's VAE the cache holds that VAE's latents of each clip and a Wan run of its channels trains from them;
// Wan image-to-video caches each clip's conditioning image, trains, resumes and samples from an image.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <thread>

#include "megaslide/config/run_config.h"
#include "megaslide/data/latent_cache.h"
#include "megaslide/data/video_dataset.h"
#include "megaslide/io/video.h"
#include "megaslide/model/clip_vision_encoder.h"
#include "megaslide/model/wan_vae.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/wan_family.h"
#include "run_tool.h"
#include "video_fixture.h"

extern char** environ;

using megaslide::testing::run_tool;
using megaslide::testing::VideoFixture;

namespace {

std::string write_config(const VideoFixture& fx, const std::string& extra = "") {
  const std::string path = fx.dir + "/run.yaml";
  fx.write("run.yaml", "data:\n  dataset: videos\n  manifest: " + fx.dir +
                           "/webvid.csv\n  frames: 4\n  height: 16\n  width: 16\n"
                           "  frame_stride: 2\n  max_bad_fraction: 0.5\n  clip_start: center\n" +
                           extra +
                           "train:\n  steps: 2\n  batch_size: 2\n  device: cpu\n  log_every: 1\n  warmup_steps: "
                           "0\noffload:\n  enabled: false\n"
                           "output:\n  progress: false\n");
  return path;
}

// The model section of a tiny text-to-video Wan trained on videos (tests/fixtures: umT5 and the Wan VAE).
std::string tiny_wan_model() {
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures";
  return "model:\n  arch: wan\n  wan: {dim: 24, layers: 2, heads: 2, ffn_dim: 40, freq_dim: 16, text_dim: 24, "
         "in_channels: 16, out_channels: 16}\n"
         "  text_encoder: {kind: umt5, weights: " +
         fixtures + "/umt5/hf, vocab: " + fixtures +
         "/umt5/tokenizer/spiece.model}\n  vae: {kind: wan, weights: " + fixtures +
         "/wan_vae/tiny, latent_channels: 16}\n";
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(MegaslideCache, AKilledBuildResumesKeepingItsFinishedShards) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cli-cache-kill", 24, 16, 64, 96);
  const auto config = write_config(fx);
  const std::string full = fx.dir + "/full", part = fx.dir + "/part";
  auto r = run_tool("megaslide-cache", "--config " + config + " --out " + full + " --shard-items 2 --threads 1");
  ASSERT_EQ(r.code, 0) << r.output;

  const std::string tool = std::string(MEGASLIDE_BINARY_DIR) + "/bin/megaslide-cache";
  std::vector<std::string> args{tool, "--config", config, "--out", part, "--shard-items", "2", "--threads", "1"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, tool.c_str(), &actions, nullptr, argv.data(), environ), 0);
  // Killed once two shards are finished (the third is being written or about to be).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!megaslide::io::path_exists(part + "/shard-00001.safetensors") && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  posix_spawn_file_actions_destroy(&actions);
  ASSERT_TRUE(WIFSIGNALED(status)) << "megaslide-cache finished before it could be killed";
  const std::string manifest = megaslide::io::read_file(part + "/cache.json");
  EXPECT_NE(manifest.find("\"complete\": false"), std::string::npos);

  r = run_tool("megaslide-cache", "--config " + config + " --out " + part + " --shard-items 2 --threads 1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("24 items in " + part), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("items kept from an earlier run"), std::string::npos) << r.output;
  for (const auto& name : megaslide::io::list_directory(full)) {
    if (name == "cache.json" || name == ".lock") continue;  // the lock holds its holder's pid
    EXPECT_EQ(megaslide::io::read_file(part + "/" + name), megaslide::io::read_file(full + "/" + name)) << name;
  }
  for (const auto& name : megaslide::io::list_directory(part)) EXPECT_EQ(name.find(".tmp"), std::string::npos) << name;
}

TEST(MegaslideCache, TrainingFromTheCacheAndFromDecodingReportsEachBadItemOnce) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cli-cache-train", 4, 12, 48, 64);
  const auto config = write_config(fx);
  auto r = run_tool("megaslide-cache", "--config " + config + " --out " + fx.dir + "/cache");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* bad : {"corrupt.mp4", "short.mp4", "missing.mp4"})
    EXPECT_EQ(count(r.output, "bad item " + fx.dir + "/videos/" + bad), 1u) << bad << "\n" << r.output;
  EXPECT_NE(r.output.find("4 items"), std::string::npos) << r.output;

  std::map<std::string, std::string> losses;
  for (const std::string& source : {std::string("decode"), std::string("cache")}) {
    const std::string run = fx.dir + "/run-" + source;
    const std::string extra = source == "cache" ? " --set data.cache=" + fx.dir + "/cache" : "";
    r = run_tool("megaslide-train", "--config " + config + " --run-dir " + run + extra);
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string log = megaslide::io::read_file(run + "/train.log");
    for (const char* bad : {"corrupt.mp4", "short.mp4", "missing.mp4"})
      EXPECT_EQ(count(log, "bad item skipped: " + fx.dir + "/videos/" + bad), 1u) << bad << "\n" << log;
    EXPECT_EQ(count(log, "bad item skipped"), 3u) << log;
    // The captions' words the built-in caption encoder does not know ("clip" and the clip's number): counted, named.
    EXPECT_NE(log.find("[warning] the built-in caption encoder knows only the structured-motion vocabulary: 8 of the "
                       "28 words of the first 4 captions (29%) become <unk> (e.g. 'clip', "),
              std::string::npos)
        << log;
    EXPECT_NE(
        log.find("data: 4 usable items of 7 listed (3 bad); buckets (frames x height x width: items) one size 4x16x16; "
                 "2 steps of 2 items = 1.00 epochs"),
        std::string::npos)
        << log;
    const std::string metrics = megaslide::io::read_file(run + "/metrics.jsonl");
    EXPECT_EQ(count(metrics, "\"data_wait_s\""), 2u) << metrics;
    std::string loss_column;
    for (size_t at = metrics.find("\"loss\":"); at != std::string::npos; at = metrics.find("\"loss\":", at + 1))
      loss_column += metrics.substr(at, metrics.find(',', at) - at) + "\n";
    losses[source] = loss_column;
  }
  EXPECT_EQ(losses["decode"], losses["cache"]);

  // Too many bad items for the fraction: exit 2 naming them, nothing written.
  r = run_tool("megaslide-train",
               "--config " + config + " --run-dir " + fx.dir + "/strict --set data.max_bad_fraction=0.1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("corrupt.mp4"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(fx.dir + "/strict"));
}

TEST(MegaslideCache, BadInputExitsTwoWritingNothing) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cli-cache-bad", 3, 12, 48, 64);
  const auto config = write_config(fx);
  auto r = run_tool("megaslide-cache", "--config " + config);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--out"), std::string::npos) << r.output;
  r = run_tool("megaslide-cache", "--config " + config + " --out " + fx.dir + "/c --set data.frame_stride=0");
  EXPECT_EQ(r.code, 2) << r.output;
  r = run_tool("megaslide-cache",
               "--config " + std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml --out " + fx.dir + "/c");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(fx.dir + "/c"));
  // A cache of another config is not overwritten.
  ASSERT_EQ(run_tool("megaslide-cache", "--config " + config + " --out " + fx.dir + "/c").code, 0);
  const std::string before = megaslide::io::read_file(fx.dir + "/c/cache.json");
  r = run_tool("megaslide-cache", "--config " + config + " --out " + fx.dir + "/c --set data.frames=2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("decode settings"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(fx.dir + "/c/cache.json"), before);
  // Nor is a folder of other files (the videos' own, here): refused naming one, nothing added to it.
  const auto listing = megaslide::io::list_directory(fx.dir + "/videos");
  r = run_tool("megaslide-cache", "--config " + config + " --out " + fx.dir + "/videos");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("holds files that are not a cache's"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::list_directory(fx.dir + "/videos"), listing);
  // train.init_from that does not fit the model: exit 2, run folder not created.
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir +
                                      "/init --set train.init_from=" + fx.dir + "/c/shard-00000.safetensors");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("missing from the file"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(fx.dir + "/init"));
}

// Wan fine-tuned on videos as a user runs it: megaslide-cache through umT5 and the Wan VAE (tiny fixtures),
// then megaslide-train from the cache, writing validation videos of the cache's first captions; a Wan run over videos
// without data.cache, and a cache made with another umT5 file, exit 2 naming them.
TEST(MegaslideCache, WanCachesItsVideosAndTrainsFromTheCache) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cli-cache-wan", 3, 12, 48, 64);
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures";
  const std::string config = fx.dir + "/wan.yaml";
  fx.write("wan.yaml", tiny_wan_model() + "data:\n  dataset: videos\n  channels: 3\n  manifest: " + fx.dir +
                           "/webvid.csv\n  frames: 5\n  height: 32\n  width: 32\n"
                           "  frame_stride: 2\n  max_bad_fraction: 0.5\n  clip_start: center\n  cache: " +
                           fx.dir +
                           "/cache\n"
                           "diffusion: {objective: flow, shift: 3.0, caption_dropout: 0.2}\n"
                           "train:\n  steps: 3\n  batch_size: 2\n  device: cpu\n  log_every: 1\n  warmup_steps: 0\n"
                           "offload:\n  enabled: false\n  compute_dtype: fp32\noutput:\n  progress: false\n");
  auto r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/early");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("cache.json"), std::string::npos) << r.output;  // not built yet
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/nocache --set data.cache=");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("data.cache"), std::string::npos) << r.output;

  // An encoder that does not fit the config is refused with nothing left behind, not even the --out folder.
  r = run_tool("megaslide-cache",
               "--config " + config + " --out " + fx.dir + "/wrong-width --set model.wan.text_dim=32");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.wan.text_dim"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(fx.dir + "/wrong-width")) << "a refused build leaves no folder";

  r = run_tool("megaslide-cache", "--config " + config);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("3 items in " + fx.dir + "/cache"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("items/s"), std::string::npos) << r.output;
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir +
                                      "/run --set train.sample_every=3 --set diffusion.sample_steps=2");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string metrics = megaslide::io::read_file(fx.dir + "/run/metrics.jsonl");
  EXPECT_EQ(count(metrics, "\"loss\":"), 3u) << metrics;
  // Validation videos of the cache's first two captions (train/wan_validation.h).
  const auto index = nlohmann::json::parse(megaslide::io::read_file(fx.dir + "/run/samples/step-0000003/index.json"));
  ASSERT_EQ(index.at("videos").size(), 2u) << index.dump();
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(index.at("videos")[i].at("prompt").get<std::string>(), fx.captions[i]);
    const auto frames = megaslide::io::read_video(fx.dir + "/run/samples/step-0000003/videos/" +
                                                  index.at("videos")[i].at("file").get<std::string>());
    EXPECT_EQ(frames.sizes(), (std::vector<int64_t>{5, 32, 32, 3}));
    EXPECT_FALSE(index.at("videos")[i].contains("image")) << "text-to-video";
  }
  // A TI2V run's videos start from their clips' first frames: index.json names the clip each came from.
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir +
                                      "/ti2v --set train.steps=1 --set train.sample_every=1 --set "
                                      "diffusion.sample_steps=1 --set diffusion.first_frame_clean=0.5");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto ti2v = nlohmann::json::parse(megaslide::io::read_file(fx.dir + "/ti2v/samples/step-0000001/index.json"));
  for (const auto& video : ti2v.at("videos")) {
    const std::string image = video.value("image", "");
    EXPECT_EQ(image.rfind(fx.dir, 0), 0u) << image;
    EXPECT_NE(image.find(".mp4 (its first frame)"), std::string::npos) << image;
  }

  const std::string other = "--set model.text_encoder.weights=" + fixtures + "/umt5/comfy_umt5_fp16.safetensors";
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/other " + other);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("other encoders (text_encoder.files"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("build one of these settings with megaslide-cache"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(fx.dir + "/other"));
  // megaslide-cache itself, which will not replace the cache, says what will: another --out, or the folder removed.
  r = run_tool("megaslide-cache", "--config " + config + " " + other);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("other encoders"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("give another --out for a cache of these settings, or remove the folder"), std::string::npos)
      << r.output;
}

// The property: Wan trains on buckets as the DiT family does — still images and clips side by side, each batch of one
// bucket: megaslide-cache encodes each item at its bucket's size (the images at one frame, 1 latent frame; the clips
// at 5 frames, 2); WanLatentData holds them by bucket, each item's latents the cache's; every batch's items share a
// bucket and an epoch of batch size 1 visits every item once; megaslide-train runs, and a run resumed from its step-2
// checkpoint has the uninterrupted run's losses bit for bit; a checkpoint's data position is refused by a run of
// other buckets; a bucket the Wan VAE cannot take is refused naming it.
TEST(MegaslideCache, WanTrainsOnBucketsOfStillsAndClips) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cli-cache-wan-buckets", 3, 12, 48, 64);
  for (int k = 0; k < 2; ++k) {
    megaslide::io::write_png(fx.dir + "/videos/still-" + std::to_string(k) + ".png",
                             megaslide::testing::smooth_random_frames(1, 48, 64, 300 + k)[0]);
    fx.write("videos/still-" + std::to_string(k) + ".txt", "a still picture " + std::to_string(k) + "\n");
  }
  const std::string config = fx.dir + "/wan.yaml";
  fx.write("wan.yaml", tiny_wan_model() + "data:\n  dataset: videos\n  channels: 3\n  root: " + fx.dir +
                           "/videos\n  frames: 5\n  height: 32\n  width: 48\n  buckets: [[1, 32, 48], [5, 32, 32]]\n"
                           "  frame_stride: 2\n  max_bad_fraction: 0.5\n  clip_start: center\n  cache: " +
                           fx.dir +
                           "/cache\n"
                           "diffusion: {objective: flow, shift: 3.0, caption_dropout: 0.2}\n"
                           "train:\n  steps: 4\n  batch_size: 1\n  device: cpu\n  log_every: 1\n  warmup_steps: 0\n"
                           "  checkpoint_every: 2\n"
                           "offload:\n  enabled: true\n  compute_dtype: fp32\noutput:\n  progress: false\n");
  auto r = run_tool("megaslide-cache", "--config " + config);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto run_config = megaslide::load_run_config(config, {});
  const auto cache = megaslide::LatentCache::open(run_config, fx.dir + "/cache");
  // clip-0..2, the two stills, and short.mp4, whose 2 frames fit only the still bucket (the corrupt and uncaptioned
  // files are bad).
  ASSERT_EQ(cache->size(), 6);
  const auto data = megaslide::WanLatentData::from_cache(run_config, fx.dir + "/cache");
  ASSERT_TRUE(data.bucketed());
  ASSERT_EQ(data.num_buckets(), 2);
  EXPECT_EQ(data.sizes("latents", 0), (std::vector<int64_t>{3, 16, 1, 4, 6}));  // the stills, 32x48
  EXPECT_EQ(data.sizes("latents", 1), (std::vector<int64_t>{3, 16, 2, 4, 4}));  // the clips, 5x32x32
  for (int64_t i = 0; i < cache->size(); ++i) {
    const bool still =
        cache->path(i).find("still-") != std::string::npos || cache->path(i).find("short.mp4") != std::string::npos;
    EXPECT_EQ(data.bucket_of[static_cast<size_t>(i)], still ? 0 : 1) << cache->path(i);
    EXPECT_TRUE(torch::equal(data.item_latents(i), cache->load(i, 0).video.to(torch::kFloat32))) << cache->path(i);
  }
  {
    megaslide::WanBatchSource batches(megaslide::wan_latent_config(run_config), data);
    std::vector<int64_t> seen;
    for (int64_t k = 0; k < 6; ++k) {
      const auto b = batches.next(torch::kCPU);
      ASSERT_EQ(b.x0.size(0), 1);
      int64_t match = -1;
      for (int64_t i = 0; i < cache->size(); ++i)
        if (b.x0[0].sizes() == data.item_latents(i).sizes() && torch::equal(b.x0[0], data.item_latents(i))) match = i;
      ASSERT_GE(match, 0) << "batch " << k << " is no item's latents";
      seen.push_back(match);
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4, 5})) << "an epoch visits every item once";
    // A position in batches of buckets is not one in items of one clip size.
    auto one_size = megaslide::wan_latent_config(run_config);
    one_size.data.width = 4;  // the clips' bucket, 32 pixels wide
    std::vector<int64_t> clips;
    for (int64_t i = 0; i < data.size(); ++i)
      if (data.bucket_of[static_cast<size_t>(i)] == 1) clips.push_back(i);
    megaslide::WanLatentData flat;
    flat.latents = data.rows("latents", clips), flat.text = data.rows("text", clips), flat.empty_text = data.empty_text;
    megaslide::WanBatchSource other(one_size, flat);
    try {
      other.restore(batches.state());
      FAIL() << "a bucketed data position was restored into a run of one clip size";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("resume with the data.buckets it ran with"), std::string::npos) << e.what();
    }
  }

  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/run");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("2 buckets, each batch of one"), std::string::npos) << r.output;
  const std::string whole = megaslide::io::read_file(fx.dir + "/run/metrics.jsonl");
  EXPECT_EQ(count(whole, "\"loss\":"), 4u) << whole;
  // Resumed from step 2 in another folder: steps 3 and 4 as the uninterrupted run's, bit for bit.
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/resumed --resume " + fx.dir +
                                      "/run/checkpoints/step-0000002");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto losses = [](const std::string& metrics) {
    std::vector<std::string> out;
    for (size_t at = metrics.find("\"loss\":"); at != std::string::npos; at = metrics.find("\"loss\":", at + 1))
      out.push_back(metrics.substr(at, metrics.find(',', at) - at));
    return out;
  };
  const auto resumed = losses(megaslide::io::read_file(fx.dir + "/resumed/metrics.jsonl"));
  const auto all = losses(whole);
  ASSERT_GE(resumed.size(), 2u);
  EXPECT_EQ(std::vector<std::string>(resumed.end() - 2, resumed.end()),
            std::vector<std::string>(all.end() - 2, all.end()));

  // A bucket of 4 frames: refused, naming it.
  r = run_tool("megaslide-train",
               "--config " + config + " --run-dir " + fx.dir + "/bad --set 'data.buckets=[[1, 32, 48], [4, 32, 32]]'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("data.buckets: item 1: 4 frames: the Wan VAE takes 1 + 4k frames"), std::string::npos)
      << r.output;
}

// The property: megaslide-cache with Wan 2.2's VAE (tests/fixtures/wan22_vae: z_dim 8, 16 pixels and 4 frames a
// latent, 2x2 patches) caches each clip's latents at that VAE's shape — [z_dim, 1 + (F-1)/4, H/16, W/16] — equal to
// the VAE's own encode of the clip the dataset decodes (within 1e-5, fp32: one computation, here and in the cache),
// and the manifest describes them with the VAE's downscale; a Wan run with model.wan.in_channels = z_dim trains a
// step from the cache.
TEST(MegaslideCache, Wan22VaeCachesItsLatents) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cli-cache-wan22", 3, 12, 48, 64);
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures";
  const std::string vae_path = fixtures + "/wan22_vae/tiny";
  const auto vae = megaslide::WanVae::load(vae_path);
  const int64_t z = vae.config().z_dim, ds = vae.config().spatial_downscale();
  const int64_t frames = 5, height = 32, width = 64;  // not square: a swapped height and width would show
  const std::string config = fx.dir + "/wan22.yaml";
  fx.write("wan22.yaml",
           "model:\n  arch: wan\n  wan: {dim: 24, layers: 1, heads: 2, ffn_dim: 40, freq_dim: 16, text_dim: 24, "
           "in_channels: " +
               std::to_string(z) + ", out_channels: " + std::to_string(z) +
               "}\n"
               "  text_encoder: {kind: umt5, weights: " +
               fixtures + "/umt5/hf, vocab: " + fixtures +
               "/umt5/tokenizer/spiece.model}\n"
               "  vae: {kind: wan, weights: " +
               vae_path + ", latent_channels: " + std::to_string(z) + ", downscale: " + std::to_string(ds) +
               "}\n"
               "data:\n  dataset: videos\n  channels: 3\n  manifest: " +
               fx.dir + "/webvid.csv\n  frames: " + std::to_string(frames) + "\n  height: " + std::to_string(height) +
               "\n  width: " + std::to_string(width) +
               "\n  frame_stride: 2\n  max_bad_fraction: 0.5\n  clip_start: center\n  cache: " + fx.dir +
               "/cache\n"
               "diffusion: {objective: flow, shift: 3.0}\n"
               "train:\n  steps: 1\n  batch_size: 2\n  device: cpu\n  log_every: 1\n  warmup_steps: 0\n"
               "offload:\n  enabled: false\n  compute_dtype: fp32\noutput:\n  progress: false\n");
  auto r = run_tool("megaslide-cache", "--config " + config);
  ASSERT_EQ(r.code, 0) << r.output;

  const auto run_config = megaslide::load_run_config(config, {});
  const auto cache = megaslide::LatentCache::open(run_config, fx.dir + "/cache");
  const auto dataset = megaslide::VideoDataset::open(run_config.data);
  ASSERT_EQ(cache->size(), dataset.size());
  ASSERT_EQ(cache->size(), fx.good);
  const std::vector<int64_t> shape{z, 1 + (frames - 1) / 4, height / ds, width / ds};
  for (int64_t i = 0; i < cache->size(); ++i) {
    const auto cached = cache->load(i, 0).video;
    ASSERT_EQ(cached.sizes(), shape) << cache->path(i);
    int64_t j = 0;
    while (j < dataset.size() && dataset.item(j).path != cache->path(i)) ++j;
    ASSERT_LT(j, dataset.size()) << cache->path(i) << " is cached but not in the dataset";
    const auto clip = dataset.load(j, 0);  // epoch 0's draws, as the cache decodes
    const auto pixels = clip.unsqueeze(0).permute({0, 4, 1, 2, 3}).to(torch::kFloat32) / 127.5 - 1.0;
    const auto expected = vae.encode(pixels)[0];
    EXPECT_LT((cached.to(torch::kFloat32) - expected).abs().max().item<double>(), 1e-5) << cache->path(i);
  }
  const auto manifest = nlohmann::json::parse(megaslide::io::read_file(fx.dir + "/cache/cache.json"));
  const auto latents_text = manifest.at("encoders").at("vae").at("latents").get<std::string>();
  EXPECT_NE(latents_text.find(fmt::format("H/{}, W/{}", ds, ds)), std::string::npos) << latents_text;

  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/run");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string metrics = megaslide::io::read_file(fx.dir + "/run/metrics.jsonl");
  EXPECT_EQ(count(metrics, "\"loss\":"), 1u) << metrics;
}

// The property: a Wan2.1-I2V-shaped run (36 input channels, CLIP's image tokens) on a folder of videos, as a user runs
// it: megaslide-cache caches each clip's conditioning — the VAE's latents of its image followed by black frames, and
// CLIP's penultimate hidden states of the image — from its first frame, or from the same-stem image beside the video
// (fitted to the clip's size for the VAE, as given for CLIP), equal to the encoders' own outputs (1e-5);
// megaslide-train trains from the cache writing validation videos from the data's images, resumes, and its weights
// sample a video from an image with megaslide-sample --image (and a prompt line's --i); a run without the image
// encoder is refused naming model.image_encoder.weights.
TEST(MegaslideCache, WanImageToVideoCachesEachClipsImageTrainsResumesAndSamples) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cli-cache-i2v", 3, 12, 32, 48);
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures";
  // clip-1's own image: another picture than its frames, of another size and aspect ratio.
  const auto own = megaslide::testing::smooth_random_frames(1, 40, 40, 77)[0];
  megaslide::io::write_png(fx.dir + "/videos/clip-1.png", own);
  const std::string config = fx.dir + "/i2v.yaml";
  fx.write("i2v.yaml",
           "model:\n  arch: wan\n  wan: {dim: 16, layers: 2, heads: 2, ffn_dim: 32, freq_dim: 16, text_dim: 24, "
           "in_channels: 36, out_channels: 16, image_dim: 24}\n"
           "  text_encoder: {kind: umt5, weights: " +
               fixtures + "/umt5/hf, vocab: " + fixtures +
               "/umt5/tokenizer/spiece.model}\n"
               "  vae: {kind: wan, weights: " +
               fixtures + "/wan_vae/tiny, latent_channels: 16}\n  image_encoder: {weights: " + fixtures +
               "/clip_vision/image_encoder}\n"
               "data:\n  dataset: videos\n  channels: 3\n  root: " +
               fx.dir +
               "/videos\n  frames: 5\n  height: 32\n  width: 48\n"
               "  frame_stride: 2\n  max_bad_fraction: 0.6\n  clip_start: center\n  cache: " +
               fx.dir +
               "/cache\n"
               "diffusion: {objective: flow, shift: 3.0, caption_dropout: 0.2, image_dropout: 0.2, sample_steps: 2}\n"
               "train:\n  steps: 2\n  batch_size: 2\n  device: cpu\n  log_every: 1\n  warmup_steps: 0\n"
               "  checkpoint_every: 1\n  sample_every: 2\n"
               "offload:\n  enabled: false\n  compute_dtype: fp32\noutput:\n  progress: false\n");
  auto r = run_tool("megaslide-cache",
                    "--config " + config + " --out " + fx.dir + "/no-clip --set model.image_encoder.weights=");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.image_encoder.weights"), std::string::npos) << r.output;
  r = run_tool("megaslide-cache", "--config " + config);
  ASSERT_EQ(r.code, 0) << r.output;

  const auto run_config = megaslide::load_run_config(config, {});
  const auto cache = megaslide::LatentCache::open(run_config, fx.dir + "/cache");
  const auto dataset = megaslide::VideoDataset::open(run_config.data, 1, {}, /*images=*/true);
  ASSERT_EQ(cache->size(), fx.good);
  const auto vae = megaslide::WanVae::load(fixtures + "/wan_vae/tiny");
  const auto clip = megaslide::ClipVisionEncoder::load(fixtures + "/clip_vision/image_encoder");
  const auto image_latents = cache->stacked("image_latents"), image_embeds = cache->stacked("image_embeds");
  ASSERT_EQ(image_latents.sizes(), (std::vector<int64_t>{fx.good, 16, 2, 4, 6}));
  ASSERT_EQ(image_embeds.sizes(), (std::vector<int64_t>{fx.good, 17, 24}));
  bool saw_own_image = false;
  for (int64_t i = 0; i < cache->size(); ++i) {
    int64_t j = 0;
    while (j < dataset.size() && dataset.item(j).path != cache->path(i)) ++j;
    ASSERT_LT(j, dataset.size());
    torch::Tensor given;
    if (dataset.item(j).image.empty()) {
      given = dataset.load(j, 0)[0];  // the clip's first frame, as the cache decodes it
    } else {
      EXPECT_NE(dataset.item(j).image.find("clip-1.png"), std::string::npos);
      given = megaslide::io::read_video(dataset.item(j).image)[0];
      EXPECT_TRUE(torch::equal(given, own));
      saw_own_image = true;
    }
    const auto expected = vae.encode_image_video(megaslide::io::fit_image(given, 32, 48), 5)[0];
    EXPECT_LT((image_latents[i] - expected).abs().max().item<double>(), 1e-5) << cache->path(i);
    EXPECT_LT((image_embeds[i] - clip.encode(given)[0]).abs().max().item<double>(), 1e-5) << cache->path(i);
  }
  EXPECT_TRUE(saw_own_image) << "clip-1's same-stem image is its conditioning image";
  const auto manifest = nlohmann::json::parse(megaslide::io::read_file(fx.dir + "/cache/cache.json"));
  EXPECT_EQ(manifest.at("encoders").at("image").at("frame"), 0);
  EXPECT_EQ(manifest.at("encoders").at("image").at("encoder").at("kind"), "clip_vision");

  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/run");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("image-to-video"), std::string::npos) << r.output;
  EXPECT_EQ(count(megaslide::io::read_file(fx.dir + "/run/metrics.jsonl"), "\"loss\":"), 2u);
  const auto index = nlohmann::json::parse(megaslide::io::read_file(fx.dir + "/run/samples/step-0000002/index.json"));
  ASSERT_EQ(index.at("videos").size(), 2u) << index.dump();
  r = run_tool("megaslide-train",
               "--config " + config + " --run-dir " + fx.dir + "/run --resume latest --set train.steps=3");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(megaslide::io::read_file(fx.dir + "/run/metrics.jsonl"), "\"loss\":"), 3u);
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir +
                                      "/run --resume latest --set train.steps=3 --export-weights " + fx.dir +
                                      "/export.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  // The export is diffusers' layout of an I2V DiT: 36 channels in, the image branch.
  const auto exported =
      megaslide::WanWeights::open(fx.dir + "/export.safetensors").architecture(megaslide::WanConfig());
  EXPECT_EQ(exported.in_channels, 36);
  EXPECT_EQ(exported.out_channels, 16);
  EXPECT_EQ(exported.image_dim, 24);
  // Another frame is another cache.
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/frame2 --set data.image_frame=2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("image.frame"), std::string::npos) << r.output;

  // An item's own image that changes makes the cache stale for training, naming it, and megaslide-cache writes
  // that item's shard again (it does not keep it for its unchanged video).
  const auto before = cache->stacked("image_latents");
  megaslide::io::write_png(fx.dir + "/videos/clip-1.png", megaslide::testing::smooth_random_frames(1, 40, 40, 78)[0]);
  r = run_tool("megaslide-train", "--config " + config + " --run-dir " + fx.dir + "/stale");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("clip-1.png changed"), std::string::npos) << r.output;
  r = run_tool("megaslide-cache", "--config " + config);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto rebuilt = megaslide::LatentCache::open(run_config, fx.dir + "/cache")->stacked("image_latents");
  EXPECT_GT((rebuilt - before).abs().max().item<double>(), 1e-3) << "clip-1's conditioning is its new image's";

  // Sampling from an image, with the run's weights: --image for every video, a prompt line's --i for its own (a
  // line that repeats a prompt with another --i is a video of its own).
  fx.write("prompts.txt", "a red blob moves left\na blue blob --i videos/clip-1.png\na blue blob --i first.png\n");
  megaslide::io::write_png(fx.dir + "/first.png", fx.sources[0][0]);
  const std::string sample = "--checkpoint " + fx.dir + "/run --prompts " + fx.dir +
                             "/prompts.txt --samples-per-prompt 1 --steps 2 --no-progress --compute-dtype fp32 "
                             "--image-encoder " +
                             fixtures + "/clip_vision/image_encoder --out ";
  r = run_tool("megaslide-sample", sample + fx.dir + "/no-image --image=");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--image"), std::string::npos) << r.output;
  r = run_tool("megaslide-sample", sample + fx.dir + "/missing --image " + fx.dir + "/missing.png");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--image: "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(" videos of "), std::string::npos) << "refused before the pipeline is opened";
  EXPECT_FALSE(megaslide::io::path_exists(fx.dir + "/missing")) << "nothing written";
  r = run_tool("megaslide-sample", sample + fx.dir + "/samples --image " + fx.dir + "/first.png");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto samples = nlohmann::json::parse(megaslide::io::read_file(fx.dir + "/samples/index.json"));
  ASSERT_EQ(samples.at("videos").size(), 3u);
  EXPECT_FALSE(samples.at("videos")[0].contains("image"));
  EXPECT_NE(samples.at("videos")[1].at("image").get<std::string>().find("clip-1.png"), std::string::npos);
  EXPECT_NE(samples.at("videos")[2].at("image").get<std::string>().find("first.png"), std::string::npos);
  for (const auto& v : samples.at("videos"))
    EXPECT_EQ(megaslide::io::read_video(fx.dir + "/samples/videos/" + v.at("file").get<std::string>()).sizes(),
              (std::vector<int64_t>{5, 32, 48, 3}));
}
