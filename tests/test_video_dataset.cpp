// VideoDataset: clips decoded from H.264 files written at test time are the source frames (PSNR >= 35 dB
// after the round trip) at the planned frames and crop; the resize matches an independent 2×2 box
// average; frame sampling by stride and by fps picks the right source frames; random draws are fixed by
// (seed, item, epoch); items go to their nearest bucket; bad items (corrupt, two frames, missing file,
// missing caption) are skipped with a reason and stop the run only beyond data.max_bad_fraction.
#include "megaslide/data/video_dataset.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <utility>

#include "video_fixture.h"

using megaslide::ClipPlan;
using megaslide::DataConfig;
using megaslide::VideoDataset;
using megaslide::testing::psnr;
using megaslide::testing::VideoFixture;

namespace {

DataConfig folder_config(const std::string& root) {
  DataConfig d;
  d.dataset = "videos";
  d.root = root;
  d.frames = 4;
  d.height = 48;
  d.width = 48;
  d.frame_stride = 2;
  d.clip_start = "center";
  d.crop = "center";
  d.max_bad_fraction = 0.5;
  return d;
}

DataConfig folder_config(const VideoFixture& fx) { return folder_config(fx.dir + "/videos"); }

// A folder /tmp/megaslide-test-`name`-PID holding tests/fixtures/video_files' `fixture` as `stem`.mp4 and a caption.
std::string one_video_folder(const std::string& name, const std::string& fixture, const std::string& stem) {
  const std::string dir = "/tmp/megaslide-test-" + name + "-" + std::to_string(::getpid());
  megaslide::io::make_directories(dir);
  megaslide::io::write_file_atomically(
      dir + "/" + stem + ".mp4",
      megaslide::io::read_file(std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/" + fixture));
  megaslide::io::write_file_atomically(dir + "/" + stem + ".txt", "a caption\n");
  return dir;
}

// The source frames a plan names, cropped as it says (no resize).
torch::Tensor expected_clip(const torch::Tensor& source, const ClipPlan& p, int64_t H, int64_t W) {
  auto frames = source.index_select(0, torch::tensor(p.frame_indices, torch::kInt64));
  return frames.slice(1, p.crop_top, p.crop_top + H).slice(2, p.crop_left, p.crop_left + W);
}

}  // namespace

TEST(VideoDataset, ClipsAreTheSourceFramesAtThePlannedFramesAndCrop) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("dataset-frames", 3, 12, 48, 64);
  auto d = folder_config(fx);
  const auto ds = VideoDataset::open(d, 2);
  ASSERT_EQ(ds.size(), 3);
  for (int64_t i = 0; i < ds.size(); ++i) {
    const auto p = ds.plan(i, 0);
    // 12 frames, 4 at stride 2 span 7: starts 0..5, centred at 2; 48x64 covers 48x48 unscaled, centred at column 8.
    EXPECT_EQ(p.frame_indices, (std::vector<int64_t>{2, 4, 6, 8}));
    EXPECT_EQ(p.resized_height, 48);
    EXPECT_EQ(p.resized_width, 64);
    EXPECT_EQ(p.crop_left, 8);
    EXPECT_EQ(p.crop_top, 0);
    const auto clip = ds.load(i, 0);
    ASSERT_EQ(clip.sizes(), (std::vector<int64_t>{4, 48, 48, 3}));
    const auto expected = expected_clip(fx.sources[static_cast<size_t>(i)], p, 48, 48);
    const double db = psnr(clip, expected);
    std::cout << "item " << i << ": PSNR " << db << " dB against the source frames\n";
    EXPECT_GE(db, 35.0);
    // The same check notices a clip one frame off or one column off (the content changes every frame).
    ClipPlan shifted = p;
    for (auto& f : shifted.frame_indices) f += 1;
    EXPECT_LT(psnr(clip, expected_clip(fx.sources[static_cast<size_t>(i)], shifted, 48, 48)), 30.0);
  }
}

TEST(VideoDataset, ResizeCoversTheBucketAndMatchesABoxAverage) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("dataset-resize", 1, 6, 48, 64);
  auto d = folder_config(fx);
  d.frames = 2, d.height = 24, d.width = 24, d.frame_stride = 1;
  const auto ds = VideoDataset::open(d, 1);
  const auto p = ds.plan(0, 0);
  EXPECT_EQ(p.resized_height, 24);  // the shorter side (48) to 24: 48x64 -> 24x32
  EXPECT_EQ(p.resized_width, 32);
  EXPECT_EQ(p.crop_left, 4);
  const auto clip = ds.load(0, 0);
  // Independent reference: each 2×2 block of the source averaged, then the same crop.
  auto src = fx.sources[0].index_select(0, torch::tensor(p.frame_indices, torch::kInt64)).to(torch::kFloat64);
  auto box = src.view({2, 24, 2, 32, 2, 3}).mean({2, 4});
  const double db = psnr(clip, box.slice(2, 4, 28));
  std::cout << "PSNR " << db << " dB against a 2x2 box average (antialiased bilinear is a slightly wider filter)\n";
  EXPECT_GE(db, 35.0);
}

TEST(VideoDataset, FrameSamplingByFpsAndDrawsFixedBySeedItemAndEpoch) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("dataset-draws", 2, 24, 48, 64);
  auto d = folder_config(fx);
  d.frame_stride = 1;
  d.fps = 3.0;  // the files are 8 fps: source frame of clip frame k is round(k * 8/3)
  d.clip_start = "random";
  d.crop = "random";  // 48x48 out of 48x64: no resize, a random column offset
  const auto ds = VideoDataset::open(d, 1);
  std::set<std::vector<int64_t>> starts;
  for (int64_t epoch = 0; epoch < 6; ++epoch) {
    const auto p = ds.plan(0, epoch);
    ASSERT_EQ(p.frame_indices.size(), 4u);
    const int64_t s = p.frame_indices[0];
    EXPECT_EQ(p.frame_indices, (std::vector<int64_t>{s, s + 3, s + 5, s + 8}));  // 0, 2.67, 5.33, 8 rounded
    EXPECT_GE(s, 0);
    EXPECT_LE(s + 8, 23);
    EXPECT_EQ(p.crop_top, 0);
    EXPECT_LE(p.crop_left, 16);
    const auto again = ds.plan(0, epoch);  // a pure function of (seed, item, epoch)
    EXPECT_EQ(again.frame_indices, p.frame_indices);
    EXPECT_EQ(ds.load_plan(0, epoch).frame_indices, p.frame_indices);  // evenly spaced frames: by count
    EXPECT_EQ(again.crop_left, p.crop_left);
    starts.insert({s, p.crop_top, p.crop_left});
  }
  EXPECT_GT(starts.size(), 2u) << "the draws do not change between epochs";
  // Another data.seed draws differently.
  auto d2 = d;
  d2.seed = d.seed + 1;
  const auto ds2 = VideoDataset(d2, {ds.item(0)}, {ds.info(0)}, {}, 1);
  bool differs = false;
  for (int64_t epoch = 0; epoch < 6; ++epoch)
    differs |= ds2.plan(0, epoch).frame_indices != ds.plan(0, epoch).frame_indices;
  EXPECT_TRUE(differs);
  // The decoded clip follows the plan at 8/3 source frames per clip frame.
  const auto p = ds.plan(1, 3);
  const auto clip = ds.load(1, 3);
  EXPECT_GE(psnr(clip, expected_clip(fx.sources[1], p, 48, 48)), 35.0);
}

namespace {
// Loads 40 epochs' clips of 8 frames at 12 frames a second from the MP4 `name` of tools/make_fixtures.py video_files
// (`count` flat frames, frame t grey at level 20 + 3t, shown at time_of(t)) and checks each clip frame is the frame
// shown nearest to the first's time plus k / 12 (ties to the later), from the count's start or an earlier one where
// the clip would run past the last frame; `spans(picks)` says whether a clip shows the feature the file is made of.
// Returns {whether a clip started earlier than the count's, whether `spans` held for one}.
std::pair<bool, bool> expect_sampled_in_time(const std::string& name, int64_t count,
                                             const std::function<double(int64_t)>& time_of,
                                             const std::function<bool(const std::vector<int64_t>&)>& spans) {
  const std::string dir = one_video_folder("vfr", name, "clip");
  auto d = folder_config(dir);
  d.frames = 8;
  d.height = 32;
  d.width = 32;
  d.frame_stride = 1;
  d.fps = 12.0;
  d.clip_start = "random";
  const auto ds = VideoDataset::open(d, 1);
  EXPECT_EQ(ds.size(), 1);
  std::set<int64_t> starts;
  bool moved_back = false, spanned = false;
  for (int64_t epoch = 0; epoch < 40 && ds.size() == 1; ++epoch) {
    const auto counted = ds.plan(0, epoch).frame_indices;
    const auto picks = ds.load_plan(0, epoch).frame_indices;
    EXPECT_EQ(picks.size(), 8u);
    if (picks.size() != 8u) break;
    const int64_t first = picks[0];
    EXPECT_LE(first, counted[0]) << name << " epoch " << epoch;
    EXPECT_LE(time_of(first) + 7.0 / 12.0, time_of(count - 1) + 1e-9) << name << " epoch " << epoch;
    moved_back |= first < counted[0];
    spanned |= spans(picks);
    starts.insert(first);
    for (int64_t k = 0; k < 8; ++k) {
      // The frame shown nearest to the clip frame's time (ties to the later), found independently.
      const double want = time_of(first) + static_cast<double>(k) / 12.0;
      int64_t nearest = 0;
      for (int64_t t = 1; t < count; ++t)
        if (std::abs(time_of(t) - want) <= std::abs(time_of(nearest) - want) + 1e-9) nearest = t;
      EXPECT_EQ(picks[static_cast<size_t>(k)], nearest) << name << " epoch " << epoch << " clip frame " << k;
    }
    // The decoded clip is those frames: grey level 20 + 3t (lossless, within the YUV round trip).
    const auto clip = ds.load(0, epoch).to(torch::kFloat64);
    for (int64_t k = 0; k < 8; ++k)
      EXPECT_NEAR(clip[k].mean().item<double>(), 20.0 + 3.0 * static_cast<double>(picks[static_cast<size_t>(k)]), 1.0)
          << name << " epoch " << epoch << " clip frame " << k;
  }
  EXPECT_GT(starts.size(), 10u) << name;
  megaslide::io::remove_tree(dir);
  return {moved_back, spanned};
}
}  // namespace

// The property: with data.fps, a video of a variable frame rate is sampled in time, not by frame counts: every clip's
// frames are 1 / data.fps apart in presentation time, each the frame shown nearest to its time, from the plan's start
// frame, or from a frame before it where the clip would run past the last frame. Two files (tools/make_fixtures.py
// video_files): 72 frames at 24, then 12, then 24 frames a second, where counted at the average rate (18 fps) clips
// took 1.5 source frames a clip frame everywhere (1/16 s apart in the first second, 1/8 s in the next two); and a
// screen recording's pause of a second between frames 39 and 40 at 24 fps, across which clips show frame 39 while it
// lasts (the times were once read only a little past the clip's average length, missing the pause). The times come
// from the packets (io::presentation_times), which also give the first frame after what is asked.
TEST(VideoDataset, VariableFrameRateVideoIsSampledInPresentationTime) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string steps = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/vfr_steps_32x32.mp4";
  const auto steps_time = [](int64_t t) {
    return t < 24 ? t / 24.0 : t < 48 ? 1.0 + (t - 24) / 12.0 : 3.0 + (t - 48) / 24.0;
  };
  const auto times = megaslide::io::presentation_times(steps, 71, 0.0);
  ASSERT_EQ(times.size(), 72u);
  for (int64_t t = 0; t < 72; ++t) EXPECT_NEAR(times[static_cast<size_t>(t)], steps_time(t), 1e-9) << t;
  const auto early = megaslide::io::presentation_times(steps, 10, 0.5);  // frame 10 at 10/24 s, then 0.5 s on
  ASSERT_GE(early.size(), 24u);  // frame 22 at 22/24 s is within 0.5 s of frame 10's time; 23 is the one after
  EXPECT_LT(early.size(), 72u);
  const auto [steps_moved, steps_slow] =
      expect_sampled_in_time("vfr_steps_32x32.mp4", 72, steps_time,
                             [](const std::vector<int64_t>& p) { return p.front() >= 24 && p.back() < 48; });
  EXPECT_TRUE(steps_moved) << "no clip ran past the last frame in 40 draws";
  EXPECT_TRUE(steps_slow) << "no clip in the 12 fps part";
  const auto pause_time = [](int64_t t) { return t < 40 ? t / 24.0 : 1.0 + t / 24.0; };
  const bool across = expect_sampled_in_time("vfr_pause_32x32.mp4", 70, pause_time, [](const std::vector<int64_t>& p) {
                        return std::count(p.begin(), p.end(), int64_t{39}) > 1;  // frame 39 held through the pause
                      }).second;
  EXPECT_TRUE(across) << "no clip across the pause in 40 draws";
}

// The property: a dataset says what its items will do that its author may not expect: clips of videos slower than
// data.fps repeat source frames (named with the slowest video), and a path listed twice is two items (named with
// the first); neither is said when it does not happen.
TEST(VideoDataset, ClipsThatRepeatFramesAndPathsListedTwiceAreNoticed) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("dataset-notices", 2, 24, 48, 64);  // 8 fps
  auto d = folder_config(fx);
  d.frame_stride = 1;
  d.fps = 8.0;  // the files' own rate: every frame once
  EXPECT_TRUE(VideoDataset::open(d, 1).notices().empty());
  d.fps = 12.0;  // 4 clip frames span round(3 · 8/12) + 1 = 3 source frames: one repeats
  const auto fast = VideoDataset::open(d, 1).notices();
  ASSERT_EQ(fast.size(), 1u);
  EXPECT_NE(fast[0].find("2 of 2 usable videos have a frame rate below data.fps (12)"), std::string::npos) << fast[0];
  EXPECT_NE(fast[0].find("the lowest: 8 fps"), std::string::npos) << fast[0];
  d.fps = 0.0;
  fx.write("twice.jsonl",
           "{\"video\": \"videos/clip-0.mp4\", \"caption\": \"a\"}\n"
           "{\"video\": \"videos/clip-1.mp4\", \"caption\": \"b\"}\n"
           "{\"video\": \"./videos/../videos/clip-0.mp4\", \"caption\": \"c\"}\n");  // the same file
  d.root.clear();
  d.manifest = fx.dir + "/twice.jsonl";
  const auto twice = VideoDataset::open(d, 1);
  EXPECT_EQ(twice.size(), 3);
  ASSERT_EQ(twice.notices().size(), 1u);
  EXPECT_NE(twice.notices()[0].find("1 usable item repeats the path of an item listed before it (the first: '" +
                                    fx.dir + "/videos/clip-0.mp4', listed 2 times)"),
            std::string::npos)
      << twice.notices()[0];
}

// The property: anamorphic video (pixels twice as wide as high: stored 32x32, SAR 2:1, shown 64x32) is probed at the
// size it is shown at, and its clips are resized to that aspect, as a player shows it: the file's four 8-row bands
// (red, green, blue, white; tools/make_fixtures.py video_files) stay four 8-row bands of a 32x64 clip. Read at its
// stored size, the 32x32 frame would be scaled to 64x64 and cropped to its middle: 16-row green and blue bands.
TEST(VideoDataset, AnamorphicVideoIsResizedToItsShownAspect) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string file = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/anamorphic_sar2_32x32.mp4";
  const auto info = megaslide::io::probe_video(file);
  EXPECT_EQ(info.sample_aspect_ratio, 2.0);
  EXPECT_EQ(info.width, 32);
  EXPECT_EQ(info.display_width, 64);
  EXPECT_EQ(info.display_height, 32);
  const std::string dir = one_video_folder("anamorphic", "anamorphic_sar2_32x32.mp4", "a");
  auto d = folder_config(dir);
  d.height = 32;
  d.width = 64;
  d.frame_stride = 1;
  const auto ds = VideoDataset::open(d, 1);
  ASSERT_EQ(ds.size(), 1);
  EXPECT_EQ(ds.info(0).width, 64);
  const auto clip = ds.load(0, 0);
  ASSERT_EQ(clip.sizes(), (std::vector<int64_t>{4, 32, 64, 3}));
  const std::vector<std::vector<double>> bands = {{255, 0, 0}, {0, 255, 0}, {0, 0, 255}, {255, 255, 255}};
  for (int64_t k = 0; k < 4; ++k) {
    const auto row = clip.select(1, 8 * k + 4).to(torch::kFloat64).mean(std::vector<int64_t>{0, 1});  // the middle row
    for (int64_t c = 0; c < 3; ++c)
      EXPECT_NEAR(row[c].item<double>(), bands[static_cast<size_t>(k)][static_cast<size_t>(c)], 12.0)
          << "band " << k << " channel " << c;
  }
  megaslide::io::remove_tree(dir);
}

TEST(VideoDataset, ItemsGoToTheirNearestBucketThatFits) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  // Clips 0-1 landscape 48x64, clip 2 portrait 64x48; all 12 frames.
  VideoFixture fx("dataset-buckets", 3, 12, 48, 64, {2});
  auto d = folder_config(fx);
  d.frame_stride = 1;
  d.buckets = {{4, 32, 48}, {4, 48, 32}, {16, 32, 48}};  // the 16-frame bucket fits no 12-frame clip
  const auto ds = VideoDataset::open(d, 2);
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.info(0).bucket, 0);
  EXPECT_EQ(ds.info(1).bucket, 0);
  EXPECT_EQ(ds.info(2).bucket, 1);
  const auto clip = ds.load(2, 0);
  EXPECT_EQ(clip.sizes(), (std::vector<int64_t>{4, 48, 32, 3}));
  // With 12 frames allowed, the longer bucket of the same aspect wins.
  d.buckets = {{4, 32, 48}, {12, 32, 48}};
  EXPECT_EQ(VideoDataset::open(d, 1).info(0).bucket, 1);
}

// The property: a still image is an item of one frame: it goes to a bucket of one frame and loads as that bucket's
// one frame, the image resized and cropped bit for bit (PNG is lossless); without such a bucket it is a bad item
// saying what it needs. A video goes to a bucket of one frame only when no longer bucket fits it, even where the
// still bucket's aspect is closer, and is then named in a notice; data.fps asks nothing of a still's rate. A
// folder of images with no bucket of one frame names the images it left out.
TEST(VideoDataset, StillImagesTrainInBucketsOfOneFrame) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("dataset-stills", 2, 12, 48, 64);  // landscape clips, 8 fps
  const auto image = megaslide::testing::smooth_random_frames(1, 48, 64, 77)[0];
  megaslide::io::write_png(fx.dir + "/still.png", image);
  fx.write("items.jsonl",
           "{\"video\": \"videos/clip-0.mp4\", \"caption\": \"a clip\"}\n"
           "{\"video\": \"still.png\", \"caption\": \"a still\"}\n"
           "{\"video\": \"videos/clip-1.mp4\", \"caption\": \"another clip\"}\n");
  auto d = folder_config(fx);
  d.root.clear();
  d.manifest = fx.dir + "/items.jsonl";
  d.frame_stride = 1;
  d.fps = 30.0;                                         // faster than the clips (a notice), and no rate for the still
  d.buckets = {{1, 32, 48}, {4, 32, 32}, {4, 48, 32}};  // the still bucket is the closest aspect to 48x64
  auto ds = VideoDataset::open(d, 1);
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.info(0).bucket, 1);
  EXPECT_EQ(ds.info(1).bucket, 0);
  EXPECT_EQ(ds.info(1).frames, 1);
  EXPECT_EQ(ds.info(2).bucket, 1);
  const auto plan = ds.plan(1, 0);
  EXPECT_EQ(plan.frame_indices, (std::vector<int64_t>{0}));
  const auto still = ds.load(1, 0);
  ASSERT_EQ(still.sizes(), (std::vector<int64_t>{1, 32, 48, 3}));
  EXPECT_TRUE(torch::equal(still, megaslide::resize_and_crop(image.unsqueeze(0), plan, ds.buckets()[0])));
  ASSERT_EQ(ds.notices().size(), 1u);  // the two videos at 8 fps, not the still
  EXPECT_NE(ds.notices()[0].find("2 of 2 usable videos have a frame rate below data.fps"), std::string::npos)
      << ds.notices()[0];

  // A 12-frame video fits no 16-frame bucket: trained as a still, and said so.
  d.fps = 0.0;
  d.buckets = {{1, 32, 48}, {16, 32, 32}};
  ds = VideoDataset::open(d, 1);
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.info(0).bucket, 0);
  ASSERT_EQ(ds.notices().size(), 1u);
  EXPECT_NE(ds.notices()[0].find("2 usable videos fit no bucket of more than one frame and are trained on one frame"),
            std::string::npos)
      << ds.notices()[0];
  EXPECT_NE(ds.notices()[0].find("clip-0.mp4', 12 frames"), std::string::npos) << ds.notices()[0];

  // No bucket of one frame: the still is a bad item saying what it needs.
  d.buckets = {{4, 32, 32}};
  ds = VideoDataset::open(d, 1);
  ASSERT_EQ(ds.size(), 2);
  ASSERT_EQ(ds.bad().size(), 1u);
  EXPECT_EQ(ds.bad()[0].path, fx.dir + "/still.png");
  EXPECT_NE(ds.bad()[0].reason.find("only a bucket of 1 frame takes it"), std::string::npos) << ds.bad()[0].reason;
  EXPECT_TRUE(ds.notices().empty());

  // A folder holding only images, and no bucket of one frame: the refusal names them.
  const std::string images = fx.dir + "/images";
  megaslide::io::make_directories(images);
  megaslide::io::write_png(images + "/a.png", image);
  fx.write("images/a.txt", "a still\n");
  d.manifest.clear();
  d.root = images;
  ds = VideoDataset::open(d, 1);
  EXPECT_EQ(ds.size(), 0);
  try {
    ds.check_bad_fraction();
    FAIL() << "a dataset of no usable item was accepted";
  } catch (const megaslide::DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find("1 image in data.root is no video's conditioning image and not trained"),
              std::string::npos)
        << e.what();
  }
  d.buckets = {{1, 32, 32}};
  EXPECT_EQ(VideoDataset::open(d, 1).size(), 1);
}

TEST(VideoDataset, BadItemsAreSkippedWithAReasonAndCountAgainstTheFraction) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("dataset-bad", 3, 12, 48, 64);
  auto d = folder_config(fx);
  d.root.clear();
  d.manifest = fx.dir + "/opensora.csv";
  const auto ds = VideoDataset::open(d, 2);
  EXPECT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.listed(), 6);
  ASSERT_EQ(ds.bad().size(), 3u);
  std::map<std::string, std::string> reasons;
  for (const auto& b : ds.bad()) reasons[b.path.substr(b.path.find_last_of('/') + 1)] = b.reason;
  EXPECT_NE(reasons["corrupt.mp4"].find("unreadable"), std::string::npos) << reasons["corrupt.mp4"];
  EXPECT_NE(reasons["short.mp4"].find("too few frames (2"), std::string::npos) << reasons["short.mp4"];
  EXPECT_NE(reasons["missing.mp4"].find("missing file"), std::string::npos) << reasons["missing.mp4"];
  EXPECT_NO_THROW(ds.check_bad_fraction());  // 3 of 6 <= 0.5
  d.max_bad_fraction = 0.4;
  const auto strict = VideoDataset::open(d, 2);
  try {
    strict.check_bad_fraction();
    FAIL() << "3 bad items of 6 passed data.max_bad_fraction 0.4";
  } catch (const megaslide::DatasetError& e) {
    const std::string what = e.what();
    for (const char* name : {"corrupt.mp4", "short.mp4", "missing.mp4"})
      EXPECT_NE(what.find(std::string("/") + name + "': "), std::string::npos) << what;  // quoted, with its reason
    EXPECT_NE(what.find("3 of 6"), std::string::npos) << what;
    EXPECT_NE(what.find("; '"), std::string::npos) << "one line, the items apart: " << what;
  }
  // The folder layout's listing-level bad item (a video without its caption) counts as listed too: the listing
  // count is what a cache records and compares (it was the good items alone once, and every such cache stale).
  auto folder = folder_config(fx);
  const auto from_folder = VideoDataset::open(folder, 2);
  EXPECT_EQ(from_folder.listed(), megaslide::read_video_manifest(folder).listed());
  EXPECT_EQ(from_folder.listed(), 6);  // clip-0..2, corrupt, nocaption, short
  // An item whose file breaks after probing fails to load with its path named.
  fx.write("videos/clip-1.mp4", "garbage now");
  try {
    ds.load(1, 0);
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("clip-1.mp4"), std::string::npos) << e.what();
    // An MP4 that does not open as one may have lost its index (written last): said as the likely cause.
    EXPECT_NE(std::string(e.what()).find("without its index, the moov box: a download or recording cut short?"),
              std::string::npos)
        << e.what();
  }
  // One whose header stays but whose coded frames are zeroed from the start: no frame decodes, which is said so (it
  // was "too few frames (0; ...)").
  {
    std::string bytes = megaslide::io::read_file(fx.dir + "/videos/clip-2.mp4");
    const auto mdat = bytes.find("mdat");
    ASSERT_NE(mdat, std::string::npos);
    ASSERT_GE(mdat, 4u);
    size_t size = 0;  // the box's size, big-endian before its type; its payload zeroed, the index (moov) kept
    for (size_t k = mdat - 4; k < mdat; ++k) size = size << 8 | static_cast<unsigned char>(bytes[k]);
    ASSERT_GT(size, 8u);
    ASSERT_LE(mdat - 4 + size, bytes.size());
    std::fill(bytes.begin() + static_cast<std::ptrdiff_t>(mdat + 4),
              bytes.begin() + static_cast<std::ptrdiff_t>(mdat - 4 + size), '\0');
    fx.write("videos/clip-2.mp4", bytes);
  }
  try {
    ds.load(2, 0);
    FAIL() << "a clip of zeroed frames loaded";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("clip-2.mp4"), std::string::npos) << what;
    EXPECT_NE(what.find("': no frame decodes (its data is damaged or missing from the start)"), std::string::npos)
        << what;
  }
}
