// megaslide-train --export-weights -> megaslide-sample -> megaslide-eval, end to end: VBench file names,
// H.264 MP4s of the model's size and length, index.json, identical reruns, streamed sampling byte-identical, PNG
// frames, scores; and bad input refused with exit code 2, naming the file, writing nothing; Wan2.2 TI2V's --image
// of another size than the videos' cropped to their aspect ratio and resized.
#include <gtest/gtest.h>
#include <torch/nn/functional/upsampling.h>

#include "run_tool.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <set>
#include <sstream>

#include "megaslide/io/vbench_layout.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/video.h"
#include "megaslide/model/wan_vae.h"

using megaslide::io::join_path;
using megaslide::io::path_exists;

namespace {

using Result = megaslide::testing::ToolResult;

Result run(const std::string& tool, const std::string& args) { return megaslide::testing::run_tool(tool, args); }

std::string scratch() {
  static const std::string dir = [] {
    auto d = "/tmp/megaslide-test-sample-" + std::to_string(::getpid());
    megaslide::io::remove_tree(d);
    megaslide::io::make_directories(d);
    return d;
  }();
  return dir;
}

// Each test program removes its scratch folder when it ends.
class RemoveScratch : public ::testing::Environment {
 public:
  void TearDown() override { megaslide::io::remove_tree(scratch()); }
};
const ::testing::Environment* const kRemoveScratch = ::testing::AddGlobalTestEnvironment(new RemoveScratch);

// Trains the smoke config for 3 steps once and exports its weights.
const std::string& weights() {
  static const std::string path = [] {
    auto p = join_path(scratch(), "smoke.safetensors");
    auto r = run("megaslide-train", "--config " + std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml --run-dir " +
                                        join_path(scratch(), "run") +
                                        " --set train.steps=3 --set output.progress=false --export-weights " + p);
    EXPECT_EQ(r.code, 0) << r.output;
    return p;
  }();
  return path;
}

std::string prompts_file(const std::string& name, const std::string& text) {
  auto p = join_path(scratch(), name);
  megaslide::io::write_file_atomically(p, text);
  return p;
}

}  // namespace

TEST(MegaslideSample, WritesVBenchNamedH264VideosAnIndexAndRerunsIdentically) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  ASSERT_TRUE(path_exists(weights()));
  auto prompts = prompts_file("prompts.txt", "a red blob moves left quickly\nthe scene darkens from the top\n");
  auto out = join_path(scratch(), "samples");
  const auto videos = join_path(out, "videos");
  const std::string args = "--checkpoint " + weights() + " --prompts " + prompts + " --samples-per-prompt 2 --out " +
                           out + " --steps 4 --no-progress --compute-dtype fp32";
  auto r = run("megaslide-sample", args + " --batch-size 3 --png");
  ASSERT_EQ(r.code, 0) << r.output;

  auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json")));
  ASSERT_EQ(index.at("videos").size(), 4u);
  EXPECT_EQ(index.at("steps"), 4);
  EXPECT_EQ(index.at("guidance_scale"), 7.5);    // from the checkpoint's config
  EXPECT_EQ(index.at("compute_dtype"), "fp32");  // and the other settings that change the videos
  EXPECT_EQ(index.at("device"), "cpu");
  EXPECT_EQ(index.at("dit"), "resident");
  EXPECT_TRUE(index.at("timestep_spacing").is_string()) << index.dump();
  EXPECT_EQ(index.at("crf"), 17);
  std::map<std::string, std::string> first_bytes;
  for (const auto& v : index.at("videos")) {
    const auto prompt = v.at("prompt").get<std::string>();
    const auto i = v.at("index").get<int64_t>();
    const auto file = v.at("file").get<std::string>();
    EXPECT_EQ(file, prompt + "-" + std::to_string(i) + ".mp4");
    EXPECT_EQ(megaslide::io::vbench_prompt_from_file_name(file), prompt);
    EXPECT_EQ(v.at("seed").get<uint64_t>(), megaslide::io::vbench_seed(prompt, i, 0));
    megaslide::io::VideoInfo info;
    auto frames = megaslide::io::read_video(join_path(videos, file), &info);
    EXPECT_EQ(info.codec, "h264");
    EXPECT_EQ(info.frames, 8);  // configs/smoke.yaml: 8 frames of 16 x 16
    EXPECT_EQ(info.width, 16);
    EXPECT_EQ(info.height, 16);
    EXPECT_NEAR(info.fps, 8.0, 1e-9);
    EXPECT_TRUE(
        path_exists(join_path(join_path(join_path(out, "frames"), file.substr(0, file.size() - 4)), "007.png")));
    first_bytes[file] = megaslide::io::read_file(join_path(videos, file));
  }
  // VBench reads the videos folder and takes the extension from its first entry: only videos there.
  for (const auto& name : megaslide::io::list_directory(videos))
    EXPECT_EQ(name.substr(name.size() - 4), ".mp4") << name;
  EXPECT_TRUE(path_exists(join_path(out, "index.json")));
  // A rerun (another batch size, so other batch neighbours) gives the same samples; the encoder is
  // deterministic, so the same bytes.
  r = run("megaslide-sample", args + " --batch-size 1");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const auto& [file, bytes] : first_bytes)
    EXPECT_EQ(megaslide::io::read_file(join_path(videos, file)), bytes) << file;
  // Streamed sampling (the DiT's blocks through the WeightStreamer, fp32) gives the resident videos, byte
  // for byte.
  r = run("megaslide-sample", args + " --batch-size 3 --streamed on");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("blocks streamed"), std::string::npos) << r.output;
  for (const auto& [file, bytes] : first_bytes)
    EXPECT_EQ(megaslide::io::read_file(join_path(videos, file)), bytes) << "streamed: " << file;

  // A training checkpoint folder works as --checkpoint: its model.safetensors holds the same bf16 weights
  // as the exported file (both rounded from the same masters), so the same videos.
  // (With the progress bar on: one line per batch when stderr is not a terminal.)
  r = run("megaslide-sample", "--checkpoint " + join_path(scratch(), "run/checkpoints/step-0000003") + " --prompts " +
                                  prompts + " --samples-per-prompt 2 --out " + out +
                                  " --steps 4 --batch-size 3 --compute-dtype fp32");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("] 4/4 videos | step 4/4"), std::string::npos) << r.output;
  for (const auto& [file, bytes] : first_bytes)
    EXPECT_EQ(megaslide::io::read_file(join_path(videos, file)), bytes) << "checkpoint: " << file;
  // So do the other names a user types for it — the `latest` file beside it, and the run folder — here
  // for one video each (a video depends only on its prompt, index and seed).
  const auto one = prompts_file("one.txt", "a red blob moves left quickly\n");
  const std::string one_file = "a red blob moves left quickly-0.mp4";
  for (const std::string spec : {"run/checkpoints/latest", "run"}) {
    const auto other = join_path(scratch(), "by-name");
    r = run("megaslide-sample", "--checkpoint " + join_path(scratch(), spec) + " --prompts " + one +
                                    " --samples-per-prompt 1 --out " + other +
                                    " --steps 4 --no-progress --compute-dtype fp32");
    ASSERT_EQ(r.code, 0) << spec << "\n" << r.output;
    EXPECT_EQ(megaslide::io::read_file(join_path(other, "videos/" + one_file)), first_bytes.at(one_file)) << spec;
    megaslide::io::remove_tree(other);
  }

  auto e = run("megaslide-eval", out);
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_FALSE(path_exists(join_path(videos, "eval.json"))) << "nothing but videos in the videos folder";
  EXPECT_NE(e.output.find("temporal_flickering"), std::string::npos) << e.output;
  auto scores = nlohmann::json::parse(megaslide::io::read_file(join_path(out, "eval.json")));
  EXPECT_EQ(scores.at("count"), 4);
  for (const auto& v : scores.at("videos")) {
    EXPECT_GE(v.at("temporal_flickering").get<double>(), 0.0);
    EXPECT_LE(v.at("temporal_flickering").get<double>(), 1.0);
    EXPECT_EQ(v.at("frames"), 8);
  }
}

// --resume continues a folder an earlier run of the same settings left part-way: the videos its index.json lists stay
// as they are (not sampled again), the others are sampled as a run from scratch samples them, and the index ends as
// that run's. Other settings are refused (exit 2, naming the first that differs, nothing changed); an index that is
// not one is named. Without --resume the run says how many videos of the same names it replaces.
TEST(MegaslideSample, ResumeKeepsTheVideosAnEarlierRunOfTheSameSettingsWrote) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  ASSERT_TRUE(path_exists(weights()));
  const auto both = prompts_file("resume-both.txt", "a red blob moves left\nthe scene darkens\n");
  const auto first = prompts_file("resume-first.txt", "a red blob moves left\n");
  const auto sample = [&](const std::string& prompts, const std::string& out, const std::string& extra) {
    return run("megaslide-sample", "--checkpoint " + weights() + " --prompts " + prompts +
                                       " --samples-per-prompt 2 --steps 3 --batch-size 1 --no-progress "
                                       "--compute-dtype fp32 --out " +
                                       out + " " + extra);
  };
  const auto fresh = join_path(scratch(), "resume-fresh"), out = join_path(scratch(), "resume");
  auto r = sample(both, fresh, "");
  ASSERT_EQ(r.code, 0) << r.output;
  // An earlier run that wrote the first prompt's two videos (as a run stopped after them leaves the folder).
  r = sample(first, out, "");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string kept = join_path(out, "videos/a red blob moves left-1.mp4");
  megaslide::io::write_file_atomically(kept, "marker: not sampled again");

  r = sample(both, out, "--resume");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("--resume: kept 2 of 4 videos already in"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("wrote 2 videos (and kept 2)"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(kept), "marker: not sampled again");
  for (const std::string file : {"the scene darkens-0.mp4", "the scene darkens-1.mp4", "a red blob moves left-0.mp4"})
    EXPECT_EQ(megaslide::io::read_file(join_path(out, "videos/" + file)),
              megaslide::io::read_file(join_path(fresh, "videos/" + file)))
        << file;
  EXPECT_EQ(megaslide::io::read_file(join_path(out, "index.json")),
            megaslide::io::read_file(join_path(fresh, "index.json")));
  // The videos' size is among the settings compared (a resume at another size keeps none).
  EXPECT_EQ(nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json"))).at("size"),
            (std::vector<int64_t>{8, 16, 16}));

  // Other settings: refused, naming the setting, nothing changed.
  const std::string index_before = megaslide::io::read_file(join_path(out, "index.json"));
  r = run("megaslide-sample",
          "--checkpoint " + weights() + " --prompts " + both +
              " --samples-per-prompt 2 --steps 4 --no-progress --compute-dtype fp32 --resume --out " + out);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("steps: 3 in index.json, 4 in this run"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(join_path(out, "index.json")), index_before);
  EXPECT_EQ(megaslide::io::read_file(kept), "marker: not sampled again");

  // Without --resume: every video is sampled again, and the run says how many it replaces.
  r = sample(both, out, "");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("replaces 4 videos of the same names"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--resume keeps those"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(kept),
            megaslide::io::read_file(join_path(fresh, "videos/a red blob moves left-1.mp4")));

  // An index written before the size was recorded cannot tell whether its videos are this run's: refused, saying so.
  auto older = nlohmann::json::parse(megaslide::io::read_file(join_path(fresh, "index.json")));
  older.erase("size");
  megaslide::io::write_file_atomically(join_path(out, "index.json"), older.dump(2));
  r = sample(both, out, "--resume");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("index.json does not record \"size\" (an earlier version"), std::string::npos) << r.output;
  // An index.json that is not one.
  megaslide::io::write_file_atomically(join_path(out, "index.json"), "{\"videos\": ");
  r = sample(both, out, "--resume");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(join_path(out, "index.json") + "' is not JSON"), std::string::npos) << r.output;
}

// A prompt's words outside the built-in caption encoder's vocabulary are named, once each, before it samples (they
// would sample as <unk>).
TEST(MegaslideSample, NamesAPromptsWordsTheBuiltInEncoderDoesNotKnow) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto zebra = prompts_file("zebra.txt", "a zebra moves left past a zebra\n");
  const auto sampled = join_path(scratch(), "zebra-out");
  auto r = run("megaslide-sample",
               "--checkpoint " + weights() + " --prompts " + zebra + " --out " + sampled + " --steps 1 --no-progress");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: prompt 'a zebra moves left past a zebra': 'zebra', 'past' are not in the "
                          "built-in caption encoder's vocabulary"),
            std::string::npos)
      << r.output;
  megaslide::io::remove_tree(sampled);
}

TEST(MegaslideSample, BadInputExitsTwoNamingItAndWritesNothing) {
  auto prompts = prompts_file("ok.txt", "a red blob moves left\n");
  auto out = join_path(scratch(), "never");
  auto expect_refused = [&](const std::string& args, const std::string& needle) {
    auto r = run("megaslide-sample", args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << r.output;
    EXPECT_FALSE(path_exists(out)) << args;
  };
  const std::string missing = join_path(scratch(), "missing.safetensors");
  expect_refused("--checkpoint " + missing + " --prompts " + prompts + " --out " + out, missing);
  // A base seed takes the unsigned 64-bit range, as a config's seeds and a prompt line's --d do: the largest one
  // passes the flags and the missing checkpoint is what is refused.
  expect_refused("--checkpoint " + missing + " --prompts " + prompts + " --out " + out + " --seed 18446744073709551615",
                 missing);
  auto corrupt = prompts_file("corrupt.safetensors", "definitely not safetensors");
  expect_refused("--checkpoint " + corrupt + " --prompts " + prompts + " --out " + out,
                 corrupt + "': not a safetensors file");
  auto pointer = prompts_file("latest", "step-0000200\n");  // a `latest` file with no checkpoint beside it
  expect_refused("--checkpoint " + pointer + " --prompts " + prompts + " --out " + out, "step-0000200");
  auto latin1 = prompts_file("latin1.txt", "a red blob\ncaf\xe9\n");
  expect_refused("--checkpoint " + weights() + " --prompts " + latin1 + " --out " + out, "line 2: not valid UTF-8");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out ''", "--out");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --guidance nan",
                 "--guidance");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --guidance 1e400",
                 "--guidance");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --eta nan", "--eta");
  // eta is DDIM's: with the DDPM sampler it was taken, recorded in index.json, and changed nothing.
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --eta 0.5",
                 "--eta is DDIM's");
  // A binary file (NUL bytes) is no prompt file: it was sampled as a prompt.
  auto binary = prompts_file("binary.txt", std::string("a red blob\nweights\0\0\x01", 21));
  expect_refused("--checkpoint " + weights() + " --prompts " + binary + " --out " + out,
                 "line 2: holds the control character 0x00");
  // Wan's LoRA weights on a DiT: refused like its other flags (they were taken without a word).
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --lora-scale 1000",
                 "are for Wan models");
  // CLIP's and the SD VAE's folders replace a latent model's; this one has its own caption encoder and no VAE.
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --text-encoder " + out,
                 "trained its own caption encoder");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --vae " + out,
                 "a pixel-space model");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + corrupt + "/sub", "--out");
  {
    // Videos inside a training run's checkpoints/: that run's pruning would remove them with the checkpoint.
    const auto run_dir = join_path(scratch(), "a-run");
    megaslide::io::make_directories(join_path(run_dir, "checkpoints/step-0000060"));
    megaslide::io::write_file_atomically(join_path(run_dir, "config.yaml"), "model: {}\n");
    expect_refused(
        "--checkpoint " + weights() + " --prompts " + prompts + " --out " + run_dir + "/checkpoints/step-0000060",
        "is inside checkpoints/ of the training run folder");
    EXPECT_FALSE(path_exists(join_path(run_dir, "checkpoints/step-0000060/index.json")));
    megaslide::io::remove_tree(run_dir);
  }
  auto empty = prompts_file("empty.txt", "\n\n");
  expect_refused("--checkpoint " + weights() + " --prompts " + empty + " --out " + out, empty);
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --samples-per-prompt 0",
                 "--samples-per-prompt");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --sampler euler",
                 "--sampler");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --steps 5000", "--steps");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --streamed maybe",
                 "--streamed");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts, "--out");
  expect_refused("--checkpoint " + weights() + " --prompts " + prompts + " --out " + out + " --device meta",
                 "--device");
  {
    // A LoRA run's checkpoint holds adapters, not a model: refused saying how to sample it (it once named a missing
    // tensor of the model).
    const auto lora_run = join_path(scratch(), "lora-run");
    ASSERT_EQ(run("megaslide-train", "--config " + std::string(MEGASLIDE_SOURCE_DIR) +
                                         "/configs/smoke.yaml --set lora.rank=2 --set train.steps=2 --set "
                                         "train.checkpoint_every=2 --set output.progress=false --run-dir " +
                                         lora_run)
                  .code,
              0);
    expect_refused("--checkpoint " + lora_run + " --prompts " + prompts + " --out " + out, "--export-merged");
    megaslide::io::remove_tree(lora_run);
  }
  {
    // A video's name under --out taken by a folder: refused before sampling, nothing written (the second video's
    // name once failed after the first video was written).
    const auto taken = join_path(scratch(), "taken");
    auto two = prompts_file("two.txt", "a red blob moves left\na blue blob moves up\n");
    megaslide::io::make_directories(join_path(taken, "videos/a blue blob moves up-0.mp4"));
    auto r = run("megaslide-sample", "--checkpoint " + weights() + " --prompts " + two + " --out " + taken +
                                         " --samples-per-prompt 1 --batch-size 1 --steps 2 --no-progress");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("a blue blob moves up-0.mp4' exists and is a folder"), std::string::npos) << r.output;
    EXPECT_EQ(megaslide::io::list_directory(join_path(taken, "videos")),
              std::vector<std::string>{"a blue blob moves up-0.mp4"});
    megaslide::io::remove_tree(taken);
  }

  auto e = run("megaslide-eval", out);
  EXPECT_EQ(e.code, 2) << e.output;
  EXPECT_NE(e.output.find(out), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("DIR"), std::string::npos) << e.output;
  EXPECT_EQ(e.output.find("--json"), std::string::npos) << e.output;  // the folder is what is wrong, not the JSON
  auto t = run("megaslide-train", "--config " + std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml --run-dir " +
                                      out + " --export-weights /nonexistent-megaslide/w.safetensors");
  EXPECT_EQ(t.code, 2) << t.output;
  EXPECT_NE(t.output.find("--export-weights"), std::string::npos) << t.output;
  EXPECT_FALSE(path_exists(out));
}

TEST(MegaslideSample, TrainingWritesValidationVideosWithoutChangingTheRun) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  // train.sample_every: fixed prompts and seeds, videos in RUN_DIR/samples/step-NNNNNNN/; sampling uses
  // its own generators, so the losses are those of the same run without it, bit for bit.
  const std::string base =
      "--config " + std::string(MEGASLIDE_SOURCE_DIR) +
      "/configs/smoke.yaml --set train.steps=2 --set output.progress=false --set diffusion.sample_steps=3";
  auto with = join_path(scratch(), "with-samples"), without = join_path(scratch(), "without-samples");
  auto r = run("megaslide-train", base + " --run-dir " + with + " --set train.sample_every=2");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run("megaslide-train", base + " --run-dir " + without);
  ASSERT_EQ(r.code, 0) << r.output;
  auto losses = [](const std::string& dir) {
    std::vector<double> out;
    std::istringstream lines(megaslide::io::read_file(join_path(dir, "metrics.jsonl")));
    std::string line;
    while (std::getline(lines, line)) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    return out;
  };
  EXPECT_EQ(losses(with), losses(without));
  const auto step_dir = join_path(with, "samples/step-0000002");
  auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(step_dir, "index.json")));
  ASSERT_GE(index.at("videos").size(), 1u);
  EXPECT_EQ(index.at("steps"), 3);
  for (const auto& v : index.at("videos")) {
    megaslide::io::VideoInfo info;
    megaslide::io::read_video(join_path(step_dir, "videos/" + v.at("file").get<std::string>()), &info);
    EXPECT_EQ(info.frames, 8);
    EXPECT_EQ(info.codec, "h264");
  }
  EXPECT_FALSE(path_exists(join_path(without, "samples")));
}

// The property: every prompt gets a safe, bounded, unique file name decided before any sampling, so a
// run never fails at its end on a name — VBench's long (augmented) prompts, prompts that differ only
// in what a file name cannot hold, and prompts with characters a shell would read as an option; a prompt longer
// than the text encoder reads is named in a warning.
TEST(MegaslideSample, LongAndOddPromptsAreNamedBeforeAnyWorkAndAllWritten) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string opening(260, 'x');
  auto prompts =
      prompts_file("odd.txt", opening + " then a cat\n" + opening + " then a dog\na/b\na_b\n-rf *\n日本語の長い" +
                                  std::string(250, 'y') + "\n");
  auto out = join_path(scratch(), "odd");
  auto r = run("megaslide-sample", "--checkpoint " + weights() + " --prompts " + prompts +
                                       " --samples-per-prompt 1 --out " + out + " --steps 2 --no-progress");
  ASSERT_EQ(r.code, 0) << r.output;
  auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json")));
  ASSERT_EQ(index.at("videos").size(), 6u);
  std::set<std::string> files;
  for (const auto& v : index.at("videos")) {
    const auto file = v.at("file").get<std::string>();
    EXPECT_LE(file.size(), megaslide::io::kMaxFileNameBytes) << file;
    EXPECT_NE(file[0], '-') << file;
    EXPECT_TRUE(path_exists(join_path(out, "videos/" + file))) << file;
    files.insert(file);
  }
  EXPECT_EQ(files.size(), 6u) << "one file per prompt";
  EXPECT_EQ(r.output.find("are longer than"), std::string::npos) << r.output;  // 5 tokens at most: none is cut
  // A prompt longer than the text encoder reads (the smoke model's 12 tokens) is named in a warning: it was cut
  // without a word, and two prompts that differed after the cut gave the same video.
  auto wordy =
      prompts_file("wordy.txt", "a red blob\none two three four five six seven eight nine ten eleven twelve\n");
  r = run("megaslide-sample", "--checkpoint " + weights() + " --prompts " + wordy + " --samples-per-prompt 1 --out " +
                                  join_path(scratch(), "wordy") + " --steps 1 --no-progress");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: 1 prompt(s) are longer than the 12 tokens the built-in text encoder reads"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("(the longest, 13 tokens: 'one two three"), std::string::npos) << r.output;
}

// A prompt file's lines carry their own settings (--w --h --f --d --s --g --n, as train.sample_prompts'
// lines do): a line's videos are sampled at its size, seed, steps and guidance; --samples-per-prompt
// videos per line, numbered on across the lines of one prompt, seeds d, d+1, … for a line's --d; and a
// line with --s/--g equals a plain line sampled with --steps/--guidance at the same seed, byte for byte.
TEST(MegaslideSample, PromptFileLinesSampleAtTheirOwnSizeSeedAndSettings) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  ASSERT_TRUE(path_exists(weights()));
  const std::string blob = "a red blob moves left quickly", dark = "the scene darkens from the top";
  auto prompts = prompts_file("settings.txt", "# validation prompts\n" + blob + "\n" + blob +
                                                  " --w 20 --h 12 --f 4 --d 7\n" + dark + " --s 3 --g 2.5\n");
  auto out = join_path(scratch(), "per-line");
  auto r =
      run("megaslide-sample", "--checkpoint " + weights() + " --prompts " + prompts + " --samples-per-prompt 2 --out " +
                                  out + " --steps 4 --no-progress --compute-dtype fp32 --batch-size 4");
  ASSERT_EQ(r.code, 0) << r.output;
  auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json")));
  ASSERT_EQ(index.at("videos").size(), 6u);
  std::map<std::string, nlohmann::json> by_file;
  for (const auto& v : index.at("videos")) by_file[v.at("file").get<std::string>()] = v;
  auto info_of = [&](const std::string& file) {
    megaslide::io::VideoInfo info;
    megaslide::io::read_video(join_path(out, "videos/" + file), &info);
    return info;
  };
  for (const std::string file : {blob + "-0.mp4", blob + "-1.mp4"}) {  // the plain line: the run's size
    ASSERT_TRUE(by_file.count(file)) << file;
    EXPECT_FALSE(by_file[file].contains("frames"));
    const auto info = info_of(file);
    EXPECT_EQ(info.frames, 8);
    EXPECT_EQ(info.width, 16);
  }
  for (int k = 0; k < 2; ++k) {  // the sized line: its size and seeds 7, 8; indices 2, 3 of the prompt
    const auto file = blob + "-" + std::to_string(2 + k) + ".mp4";
    ASSERT_TRUE(by_file.count(file)) << file;
    EXPECT_EQ(by_file[file].at("seed"), 7 + k);
    EXPECT_EQ(by_file[file].at("frames"), 4);
    EXPECT_EQ(by_file[file].at("width"), 20);
    const auto info = info_of(file);
    EXPECT_EQ(info.frames, 4);
    EXPECT_EQ(info.width, 20);
    EXPECT_EQ(info.height, 12);
  }
  ASSERT_TRUE(by_file.count(dark + "-1.mp4"));
  EXPECT_EQ(by_file[dark + "-1.mp4"].at("steps"), 3);
  EXPECT_EQ(by_file[dark + "-1.mp4"].at("guidance_scale"), 2.5);

  // The --s/--g line against a plain line with the flags: the same videos.
  auto plain = prompts_file("plain.txt", dark + "\n");
  auto flags = join_path(scratch(), "per-line-flags");
  r = run("megaslide-sample", "--checkpoint " + weights() + " --prompts " + plain + " --samples-per-prompt 2 --out " +
                                  flags + " --steps 3 --guidance 2.5 --no-progress --compute-dtype fp32");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const std::string file : {dark + "-0.mp4", dark + "-1.mp4"})
    EXPECT_EQ(megaslide::io::read_file(join_path(out, "videos/" + file)),
              megaslide::io::read_file(join_path(flags, "videos/" + file)))
        << file;

  // A size the model cannot take is refused before anything is written, naming the file and line.
  auto bad = prompts_file("bad-size.txt", blob + "\n" + blob + " --w 15\n");
  auto never = join_path(scratch(), "per-line-never");
  r = run("megaslide-sample",
          "--checkpoint " + weights() + " --prompts " + bad + " --out " + never + " --steps 2 --no-progress");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("line 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("width 15"), std::string::npos) << r.output;
  EXPECT_FALSE(path_exists(never));
}

// A run with train.ema_decay: its checkpoint holds the EMA as a weights file, which megaslide-sample
// samples by default (saying so; index.json names it) and --no-ema passes over for the trained weights;
// megaslide-train --export-ema writes the same EMA after training and, with --resume, from the checkpoint;
// a checkpoint without EMA is refused by --export-ema (exit 2, naming it), as is --export-ema on a run
// without train.ema_decay.
TEST(MegaslideSample, ARunsEmaIsSampledByDefaultAndExported) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string run_dir = join_path(scratch(), "ema-run"),
                    exported = join_path(scratch(), "ema-exported.safetensors");
  const std::string train = "--config " + std::string(MEGASLIDE_SOURCE_DIR) +
                            "/configs/smoke.yaml --set train.steps=3 --set output.progress=false";
  auto r = megaslide::testing::run_tool(
      "megaslide-train", train + " --run-dir " + run_dir +
                             " --set train.ema_decay=0.5 --set train.checkpoint_every=3 --export-ema " + exported);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto checkpoint = join_path(run_dir, "checkpoints/step-0000003");
  const auto ema_file = join_path(checkpoint, "model_ema.safetensors");
  ASSERT_TRUE(path_exists(ema_file));
  const auto a = megaslide::io::read_safetensors(ema_file), b = megaslide::io::read_safetensors(exported);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i)
    EXPECT_TRUE(torch::equal(a.tensors[i].second, b.tensors[i].second)) << a.tensors[i].first;

  auto prompts = prompts_file("ema-prompts.txt", "a red blob moves left quickly\n");
  const std::string file = "videos/a red blob moves left quickly-0.mp4";
  const std::string args =
      " --prompts " + prompts + " --samples-per-prompt 1 --steps 3 --no-progress --compute-dtype fp32 --out ";
  const auto by_default = join_path(scratch(), "ema-default"), trained = join_path(scratch(), "ema-none"),
             ema_direct = join_path(scratch(), "ema-direct"), model_direct = join_path(scratch(), "ema-model");
  r = run("megaslide-sample", "--checkpoint " + run_dir + args + by_default);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("sampling the EMA of the weights"), std::string::npos) << r.output;
  auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(by_default, "index.json")));
  EXPECT_EQ(index.at("checkpoint"), ema_file);
  r = run("megaslide-sample", "--checkpoint " + run_dir + args + trained + " --no-ema");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find("sampling the EMA"), std::string::npos) << r.output;
  ASSERT_EQ(run("megaslide-sample", "--checkpoint " + ema_file + args + ema_direct).code, 0);
  ASSERT_EQ(
      run("megaslide-sample", "--checkpoint " + join_path(checkpoint, "model.safetensors") + args + model_direct).code,
      0);
  const auto video = [&](const std::string& dir) { return megaslide::io::read_file(join_path(dir, file)); };
  EXPECT_EQ(video(by_default), video(ema_direct)) << "the default is the EMA's weights file";
  EXPECT_EQ(video(trained), video(model_direct)) << "--no-ema is the trained weights";
  EXPECT_NE(video(by_default), video(trained)) << "the EMA after 3 steps (decay 0.5) is not the weights";

  // --resume with --export-ema: the checkpoint's EMA file, without training.
  const auto from_checkpoint = join_path(scratch(), "ema-from-checkpoint.safetensors");
  r = megaslide::testing::run_tool(
      "megaslide-train", train + " --run-dir " + run_dir + " --resume latest --export-ema " + from_checkpoint);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(megaslide::io::read_file(from_checkpoint), megaslide::io::read_file(ema_file));
  // Refusals: a checkpoint without EMA (exit 2, naming it), a run without train.ema_decay.
  r = megaslide::testing::run_tool(
      "megaslide-train", train + " --run-dir " + join_path(scratch(), "ema-plain") + " --set train.checkpoint_every=3");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto never = join_path(scratch(), "ema-never.safetensors");
  r = megaslide::testing::run_tool("megaslide-train", train + " --run-dir " + join_path(scratch(), "ema-plain") +
                                                          " --resume latest --export-ema " + never);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("has no EMA of the weights"), std::string::npos) << r.output;
  EXPECT_FALSE(path_exists(never));
  r = megaslide::testing::run_tool(
      "megaslide-train", train + " --run-dir " + join_path(scratch(), "ema-refused") + " --export-ema " + never);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("train.ema_decay"), std::string::npos) << r.output;
  EXPECT_FALSE(path_exists(never));
}

// The property: megaslide-sample --image (Wan2.2 TI2V's image-to-video; tests/fixtures/ti2v_pipeline's tiny DiT, umT5
// and the Wan2.2-style VAE) takes an image of another size than the videos': a random image at twice their size
// starts the video from the VAE's latent of that image resized to the videos' size with antialiased bilinear
// filtering (float32 on [-1, 1], align_corners false; within 1e-5, fp32), and stderr names the resize; the same image
// between two bands of other random columns (aspect 2 where the videos' is 1.5) is center-cropped back to it before
// resizing, so its video's latents are the same; a file that is not an image is refused with exit 2 naming --image;
// index.json records the image.
TEST(MegaslideSampleWan, AnImageOfAnotherSizeIsCroppedAndResizedToTheVideos) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";
  const int64_t height = 64, width = 96;  // the videos': 4 x 6 latents of the VAE's 16 pixels
  const auto config =
      prompts_file("ti2v.yaml", "model:\n  arch: wan\n  wan: {weights: " + fixtures +
                                    "ti2v_pipeline/transformer, in_channels: 8, out_channels: 8}\n"
                                    "  vae: {downscale: 16}\n"
                                    "data: {dataset: latent-tensors, channels: 8, frames: 3, height: " +
                                    std::to_string(height / 16) + ", width: " + std::to_string(width / 16) +
                                    ", max_text_tokens: 512}\n"
                                    "diffusion: {objective: flow, shift: 5.0, guidance_scale: 5.0}\n");
  const auto prompts = prompts_file("ti2v-prompts.txt", "a red blob moves left quickly\n");
  const std::string common = "--config " + config + " --text-encoder " + fixtures + "umt5/hf --tokenizer " + fixtures +
                             "umt5/tokenizer --vae " + fixtures + "wan22_vae/tiny --prompts " + prompts +
                             " --samples-per-prompt 1 --steps 2 --no-progress --compute-dtype fp32 --latents";
  auto gen = at::detail::createCPUGenerator(29);
  const auto big = torch::randint(0, 256, {2 * height, 2 * width, 3}, gen).to(torch::kUInt8);
  const int64_t band = width / 2;  // on each side: 2 * height x 2 * (width + band) pixels, aspect 2
  const auto wide = torch::cat({torch::randint(0, 256, {2 * height, band, 3}, gen).to(torch::kUInt8), big,
                                torch::randint(0, 256, {2 * height, band, 3}, gen).to(torch::kUInt8)},
                               1)
                        .contiguous();
  auto latents_of = [&](const torch::Tensor& rgb, const std::string& name, std::string* output) {
    const auto png = join_path(scratch(), name + ".png"), out = join_path(scratch(), name);
    megaslide::io::write_png(png, rgb);
    auto r = run("megaslide-sample", common + " --image " + png + " --out " + out);
    EXPECT_EQ(r.code, 0) << r.output;
    *output = r.output;
    // The image every video starts from is recorded with them (it was not).
    if (r.code == 0)
      EXPECT_EQ(nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json"))).at("image"),
                megaslide::io::absolute_path(png));
    const auto files = megaslide::io::list_files(join_path(out, "latents"), "safetensors");
    EXPECT_EQ(files.size(), 1u);
    if (files.size() != 1) return torch::Tensor();
    return megaslide::io::read_safetensors(join_path(join_path(out, "latents"), files[0])).tensors.at(0).second;
  };

  std::string output;
  const auto from_big = latents_of(big, "big", &output);
  ASSERT_TRUE(from_big.defined());
  EXPECT_NE(output.find(fmt::format("resized from {}x{} to {}x{}", 2 * width, 2 * height, width, height)),
            std::string::npos)
      << output;
  namespace F = torch::nn::functional;
  const auto resized = F::interpolate((big.permute({2, 0, 1}).to(torch::kFloat32) / 127.5 - 1.0).unsqueeze(0),
                                      F::InterpolateFuncOptions()
                                          .size(std::vector<int64_t>{height, width})
                                          .mode(torch::kBilinear)
                                          .align_corners(false)
                                          .antialias(true));
  const auto vae = megaslide::WanVae::load(fixtures + "wan22_vae/tiny");
  const auto first = vae.encode(resized.view({1, 3, 1, height, width}))[0];
  EXPECT_LT((from_big.narrow(1, 0, 1) - first).abs().max().item<double>(), 1e-5);

  const auto from_wide = latents_of(wide, "wide", &output);
  ASSERT_TRUE(from_wide.defined());
  EXPECT_NE(output.find(fmt::format("center-cropped to {}x{}", 2 * width, 2 * height)), std::string::npos) << output;
  EXPECT_LT((from_wide - from_big).abs().max().item<double>(), 1e-6);

  const auto not_image = prompts_file("not-an-image.png", "not an image");
  auto r = run("megaslide-sample", common + " --image " + not_image + " --out " + join_path(scratch(), "unreadable"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--image: "), std::string::npos) << r.output;
}
