// Metrics: VBench's temporal flickering against its definition computed by a naive loop and closed
// forms; frame consistency against hand-computed cosines; evaluate_folder on real MP4s, and against VBench's
// own score of committed clips (tests/fixtures/video/).
#include "megaslide/eval/metrics.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <iostream>
#include <map>

#include "megaslide/io/vbench_layout.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/video.h"

using namespace megaslide::eval;

namespace {
std::string temp_path(const std::string& name) {
  return "/tmp/megaslide-test-metrics-" + std::to_string(::getpid()) + "-" + name;
}

torch::Tensor random_frames(int64_t T, int64_t H, int64_t W, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(0, 256, {T, H, W, 3}, torch::kUInt8);
}
}  // namespace

TEST(Metrics, TemporalFlickeringIsVBenchsDefinition) {
  auto frames = random_frames(5, 6, 7, 1);
  // vbench/temporal_flickering.py: mean over pairs of np.mean(cv2.absdiff(f_i, f_{i+1})), then (255 − d)/255.
  auto acc = frames.accessor<uint8_t, 4>();
  double sum_of_pair_means = 0.0;
  for (int64_t t = 0; t + 1 < 5; ++t) {
    double s = 0.0;
    for (int64_t y = 0; y < 6; ++y)
      for (int64_t x = 0; x < 7; ++x)
        for (int64_t c = 0; c < 3; ++c)
          s += std::abs(static_cast<double>(acc[t + 1][y][x][c]) - static_cast<double>(acc[t][y][x][c]));
    sum_of_pair_means += s / (6 * 7 * 3);
  }
  const double d = sum_of_pair_means / 4;
  EXPECT_NEAR(mean_abs_frame_difference(frames), d, 1e-9);
  EXPECT_NEAR(temporal_flickering_score(frames), (255.0 - d) / 255.0, 1e-12);
  // Closed forms: a still video scores 1; frames alternating between uniform 10 and 60 score (255 − 50)/255.
  auto still = frames.slice(0, 0, 1).repeat({4, 1, 1, 1});
  EXPECT_EQ(temporal_flickering_score(still), 1.0);
  auto alternating = torch::stack({torch::full({4, 4, 3}, 10), torch::full({4, 4, 3}, 60), torch::full({4, 4, 3}, 10)})
                         .to(torch::kUInt8);
  EXPECT_NEAR(temporal_flickering_score(alternating), 205.0 / 255.0, 1e-12);
  EXPECT_THROW(temporal_flickering_score(frames.slice(0, 0, 1)), std::invalid_argument);
}

// The property: frame consistency is the mean of the centred frames' clipped cosines (an independent loop here),
// unchanged by a uniform brightness change, 1 for still and flat videos, 0 for an inverted frame or a flat frame
// beside a textured one.
TEST(Metrics, FrameConsistencyIsTheMeanOfCentredCosines) {
  auto frames = random_frames(3, 4, 5, 2);
  auto f = frames.to(torch::kFloat64).flatten(1) / 255.0;
  f = f - f.mean(1, true);
  auto cos = [&](int64_t a, int64_t b) {
    return std::max(0.0, (f[a] * f[b]).sum().item<double>() / (f[a].norm() * f[b].norm()).item<double>());
  };
  const double expected = (0.5 * (cos(1, 0) + cos(1, 0)) + 0.5 * (cos(2, 1) + cos(2, 0))) / 2;
  EXPECT_NEAR(frame_consistency_score(frames), expected, 1e-12);
  // Invariant to a uniform brightness change (centring), 1 for a still video, 0 for an inverted frame.
  auto base = random_frames(1, 8, 8, 3)[0].to(torch::kInt32).clamp(20, 200);
  auto brighter = torch::stack({base, base + 40}).to(torch::kUInt8);
  EXPECT_NEAR(frame_consistency_score(brighter), 1.0, 1e-12);
  auto inverted = torch::stack({base, 255 - base}).to(torch::kUInt8);
  EXPECT_EQ(frame_consistency_score(inverted), 0.0);
  auto uniform = torch::full({3, 4, 4, 3}, 90, torch::kUInt8);
  EXPECT_EQ(frame_consistency_score(uniform), 1.0);
  // Flat frames of any levels (a fade), whose centred values are float rounding's residue, not zero: 1.
  for (const auto& [a, b] : {std::pair{128, 200}, {20, 60}, {60, 200}, {19, 89}}) {
    auto fade = torch::stack({torch::full({16, 16, 3}, a), torch::full({16, 16, 3}, b)}).to(torch::kUInt8);
    EXPECT_EQ(frame_consistency_score(fade), 1.0) << a << " -> " << b;
  }
  // One flat frame beside one that is not: 0.
  EXPECT_EQ(frame_consistency_score(torch::stack({base.to(torch::kUInt8), torch::full({8, 8, 3}, 7, torch::kUInt8)})),
            0.0);
}

TEST(Metrics, EvaluateFolderScoresEveryMp4WithItsPrompt) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto dir = temp_path("folder");
  megaslide::io::make_directories(dir);
  // A still video and one whose whole frame alternates between two grey levels.
  auto still = torch::full({6, 16, 16, 3}, 100, torch::kUInt8);
  auto flicker = still.clone();
  for (int64_t t = 1; t < 6; t += 2) flicker[t].fill_(160);
  megaslide::io::write_mp4(dir + "/a still scene-0.mp4", still);
  megaslide::io::write_mp4(dir + "/a flickering scene-0.mp4", flicker);
  auto e = evaluate_folder(dir);
  ASSERT_EQ(e.videos.size(), 2u);
  EXPECT_EQ(e.videos[0].file, "a flickering scene-0.mp4");  // sorted
  EXPECT_EQ(e.videos[0].prompt, "a flickering scene");      // no index.json: parsed from the name
  EXPECT_EQ(e.videos[0].frames, 6);
  EXPECT_EQ(e.videos[1].temporal_flickering, 1.0);
  // Uniform greys survive H.264 almost exactly: |160 − 100| = 60 per pair, score (255 − 60)/255; read as
  // OpenCV reads them (its YUV -> RGB tables round the two greys differently) the step is 59 here.
  EXPECT_NEAR(e.videos[0].temporal_flickering, 195.0 / 255.0, 1.5 / 255.0);
  EXPECT_NEAR(e.mean_temporal_flickering, (e.videos[0].temporal_flickering + 1.0) / 2, 1e-12);
  auto j = nlohmann::json::parse(to_json(e));
  EXPECT_EQ(j.at("count"), 2);
  EXPECT_EQ(j.at("videos")[1].at("prompt"), "a still scene");
  EXPECT_NE(to_table(e).find("a still scene-0.mp4"), std::string::npos);

  // With an index.json, prompts come from it.
  megaslide::io::write_file_atomically(
      dir + "/index.json",
      R"({"videos": [{"prompt": "the real prompt", "index": 0, "seed": 1, "file": "a still scene-0.mp4"}]})");
  EXPECT_EQ(evaluate_folder(dir).videos[1].prompt, "the real prompt");
  EXPECT_TRUE(evaluate_folder(dir).deep_videos.empty());
  // A video of more than 8 bits a component (16-bit grey, a Matroska file by another name) is named.
  const std::string deep = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/grey16_48x16.mkv";
  EXPECT_EQ(megaslide::io::probe_video(deep).bits_per_component, 16);
  megaslide::io::write_file_atomically(dir + "/deep-0.mp4", megaslide::io::read_file(deep));
  EXPECT_EQ(evaluate_folder(dir).deep_videos, (std::vector<std::string>{"deep-0.mp4"}));
  megaslide::io::remove_tree(dir);
  EXPECT_THROW(evaluate_folder(dir), std::runtime_error);
  megaslide::io::make_directories(dir);
  EXPECT_THROW(evaluate_folder(dir), std::runtime_error) << "a folder without MP4s";
  megaslide::io::remove_tree(dir);
}

// megaslide-eval reports what VBench reports on the same files: its temporal flickering of the committed
// clips (tests/fixtures/video/, made by tools/make_fixtures.py video) equals VBench's own computation on
// opencv-python's frames within 1e-3 (the difference is printed; float32 against float64 sums). The same
// metric on frames with interpolated chroma (the default conversion) is printed beside it.
TEST(Metrics, EvaluateFolderReportsVBenchsTemporalFlickering) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video/";
  std::map<std::string, double> vbench;
  for (auto& [name, tensor] : megaslide::io::read_safetensors(fixtures + "opencv_frames.safetensors").tensors)
    if (name.size() > 20 && name.substr(name.size() - 20) == ".temporal_flickering")
      vbench[name.substr(0, name.size() - 20)] = tensor.item<double>();
  ASSERT_EQ(vbench.size(), 3u);
  auto dir = temp_path("vbench");
  megaslide::io::make_directories(dir);
  for (const auto& [clip, score] : vbench)
    megaslide::io::write_file_atomically(dir + "/" + clip + "-0.mp4",
                                         megaslide::io::read_file(fixtures + clip + ".mp4"));
  auto e = evaluate_folder(dir);
  ASSERT_EQ(e.videos.size(), vbench.size());
  for (const auto& v : e.videos) {
    const std::string clip = v.file.substr(0, v.file.size() - 6);
    const double interpolated = temporal_flickering_score(megaslide::io::read_video(dir + "/" + v.file));
    std::cout << clip << ": VBench " << vbench.at(clip) << ", megaslide-eval " << v.temporal_flickering
              << " (difference " << v.temporal_flickering - vbench.at(clip)
              << "); from frames with interpolated chroma " << interpolated << "\n";
    EXPECT_NEAR(v.temporal_flickering, vbench.at(clip), 1e-3) << clip;
  }
  megaslide::io::remove_tree(dir);
}
