// Video files: an MP4 read back with libavformat is H.264/yuv420p with the frames, size and rate
// written, its pixels are close to the input, ffprobe (an independent reader) agrees, PNGs are
// lossless, bad input is refused naming the file, the OpenCV conversion gives opencv-python's frames
// (tests/fixtures/video/), and a display matrix (a phone's rotate=90) reads upright, as ffmpeg shows it.
#include "megaslide/io/video.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <torch/nn/functional/upsampling.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <iostream>
#include <map>
#include <utility>

#include "megaslide/io/safetensors.h"

using megaslide::io::VideoError;
using megaslide::io::VideoInfo;

namespace {

std::string temp_path(const std::string& name) {
  return "/tmp/megaslide-test-video-" + std::to_string(::getpid()) + "-" + name;
}

// Smooth random content (what codecs are built for): a coarse random grid upsampled, moving over time.
torch::Tensor smooth_frames(int64_t T, int64_t H, int64_t W, uint64_t seed) {
  torch::manual_seed(seed);
  auto coarse = torch::rand({1, 3, T, H / 8 + 1, W / 8 + 1});
  auto fine = torch::nn::functional::interpolate(coarse, torch::nn::functional::InterpolateFuncOptions()
                                                             .size(std::vector<int64_t>{T, H, W})
                                                             .mode(torch::kTrilinear)
                                                             .align_corners(true));
  return (fine[0].permute({1, 2, 3, 0}) * 255).round().to(torch::kUInt8).contiguous();  // [T, H, W, 3]
}

std::string run(const std::string& cmd) {
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), pipe) != nullptr) out += buf.data();
  pclose(pipe);
  return out;
}

}  // namespace

TEST(Video, Mp4ReadsBackAsH264WithTheFramesSizeAndRateWritten) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto frames = smooth_frames(8, 32, 48, 1);
  auto path = temp_path("roundtrip.mp4");
  megaslide::io::write_mp4(path, frames, megaslide::io::VideoWriteOptions().fps(8));
  EXPECT_FALSE(megaslide::io::path_exists(path + ".tmp"));
  VideoInfo info;
  auto back = megaslide::io::read_video(path, &info);
  EXPECT_EQ(info.codec, "h264");
  EXPECT_EQ(info.pixel_format, "yuv420p");
  EXPECT_EQ(info.width, 48);
  EXPECT_EQ(info.height, 32);
  EXPECT_EQ(info.frames, 8);
  EXPECT_EQ(info.container_frames, 8);
  EXPECT_NEAR(info.fps, 8.0, 1e-9);
  ASSERT_EQ(back.sizes(), frames.sizes());
  const double mae = (back.to(torch::kFloat32) - frames.to(torch::kFloat32)).abs().mean().item<double>();
  // The same content in grey at crf 0 (lossless H.264): no chroma to subsample and no quantisation, so
  // only the RGB -> limited-range YUV -> RGB rounding remains (< 1 level, no bias) — this catches a
  // colour-matrix or range mismatch between writer and reader.
  auto grey = frames.select(3, 1).unsqueeze(3).expand({8, 32, 48, 3}).contiguous();
  megaslide::io::write_mp4(path, grey, megaslide::io::VideoWriteOptions().crf(0));
  auto grey_error = megaslide::io::read_video(path).to(torch::kFloat32) - grey.to(torch::kFloat32);
  const double grey_mae = grey_error.abs().mean().item<double>(), grey_bias = grey_error.mean().item<double>();
  std::cout << "mean absolute error (of 255): colour crf 17 " << mae << "; grey crf 0 " << grey_mae << ", bias "
            << grey_bias << "\n";
  EXPECT_LT(mae, 4.0);  // measured 2.6: random colours at quarter-resolution chroma, every frame new
  EXPECT_LT(grey_mae, 1.0);
  EXPECT_LT(std::abs(grey_bias), 0.25);
  megaslide::io::remove_tree(path);
}

TEST(Video, RewritingGivesTheSameBytes) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto frames = smooth_frames(5, 16, 16, 2);
  auto a = temp_path("a.mp4"), b = temp_path("b.mp4");
  megaslide::io::write_mp4(a, frames);
  megaslide::io::write_mp4(b, frames);
  EXPECT_EQ(megaslide::io::read_file(a), megaslide::io::read_file(b));
  megaslide::io::remove_tree(a);
  megaslide::io::remove_tree(b);
}

TEST(Video, FfprobeAgreesOnCodecFramesAndSize) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  if (run("command -v ffprobe").empty()) GTEST_SKIP() << "ffprobe not installed";
  auto path = temp_path("probe.mp4");
  megaslide::io::write_mp4(path, smooth_frames(12, 16, 32, 3), megaslide::io::VideoWriteOptions().fps(10));
  auto out =
      run("ffprobe -v error -select_streams v:0 -count_frames -show_entries "
          "stream=codec_name,pix_fmt,width,height,nb_read_frames,avg_frame_rate -of json '" +
          path + "'");
  auto s = nlohmann::json::parse(out).at("streams").at(0);
  EXPECT_EQ(s.at("codec_name"), "h264");
  EXPECT_EQ(s.at("pix_fmt"), "yuv420p");
  EXPECT_EQ(s.at("width"), 32);
  EXPECT_EQ(s.at("height"), 16);
  EXPECT_EQ(s.at("nb_read_frames"), "12");
  EXPECT_EQ(s.at("avg_frame_rate"), "10/1");
  megaslide::io::remove_tree(path);
}

TEST(Video, ToRgbFramesMapsMinusOneToZeroAndOneTo255) {
  auto video = torch::zeros({3, 2, 2, 2});
  video[0].fill_(-1.0);
  video[1].fill_(1.0);
  video[2].fill_(0.0);
  video[2][1][1][1] = 2.0;  // out of range: clamped
  auto rgb = megaslide::io::to_rgb_frames(video);
  ASSERT_EQ(rgb.sizes(), (std::vector<int64_t>{2, 2, 2, 3}));
  EXPECT_EQ(rgb[0][0][0][0].item<int>(), 0);
  EXPECT_EQ(rgb[0][0][0][1].item<int>(), 255);
  EXPECT_EQ(rgb[0][0][0][2].item<int>(), 128);  // round(127.5)
  EXPECT_EQ(rgb[1][1][1][2].item<int>(), 255);
  auto grey = megaslide::io::to_rgb_frames(torch::full({1, 1, 2, 3}, 0.5), 3);
  ASSERT_EQ(grey.sizes(), (std::vector<int64_t>{1, 6, 9, 3}));
  EXPECT_TRUE(grey.eq(191).all().item<bool>());  // round(1.5 · 127.5) = 191, every channel, every copy
}

TEST(Video, PngIsLossless) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto frame = smooth_frames(1, 10, 14, 4)[0];
  auto path = temp_path("frame.png");
  megaslide::io::write_png(path, frame);
  VideoInfo info;
  auto back = megaslide::io::read_video(path, &info);
  EXPECT_EQ(info.codec, "png");
  ASSERT_EQ(back.size(0), 1);
  EXPECT_TRUE(torch::equal(back[0], frame));
  megaslide::io::remove_tree(path);
}

TEST(Video, BadInputIsRefusedNamingTheFile) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto expect_error = [](auto&& fn, const std::string& path, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << path;
    } catch (const VideoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  auto odd = temp_path("odd.mp4");
  expect_error(
      [&] {
        megaslide::io::write_mp4(odd, torch::zeros({2, 15, 16, 3}, torch::kUInt8));
      },
      odd, "must be even");
  expect_error([&] { megaslide::io::write_mp4(odd, torch::zeros({2, 16, 16, 3})); }, odd, "expected uint8 RGB");
  EXPECT_FALSE(megaslide::io::path_exists(odd));
  auto missing_dir = std::string("/nonexistent-megaslide/x.mp4");
  expect_error(
      [&] {
        megaslide::io::write_mp4(missing_dir, torch::zeros({2, 16, 16, 3}, torch::kUInt8));
      },
      missing_dir, "cannot create");
  expect_error(
      [&] {
        megaslide::io::write_mp4("/dev/null", torch::zeros({2, 16, 16, 3}, torch::kUInt8));
      },
      "/dev/null", "is a device");
  auto text = temp_path("not-a-video.mp4");
  megaslide::io::write_file_atomically(text, "this is not a video");
  expect_error([&] { megaslide::io::read_video(text); }, text, "");
  expect_error([&] { megaslide::io::read_video(temp_path("missing.mp4")); }, temp_path("missing.mp4"), "cannot open");
  megaslide::io::remove_tree(text);
  // A FIFO named as a video is refused at once (FFmpeg's own open would wait for a writer for ever).
  const auto fifo = temp_path("fifo.mp4");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error([&] { megaslide::io::read_video(fifo); }, fifo, "is a pipe");
  expect_error([&] { megaslide::io::probe_video(fifo); }, fifo, "is a pipe");
  ::unlink(fifo.c_str());
}

// The property: what a read holds is bounded (VideoReadOptions::max_bytes, by default a quarter of the
// memory available): a file whose frames would take more is refused naming its frame size, how many
// frames and the limit, counted as they are decoded (a container's frame count may lie).
TEST(Video, ReadsHoldNoMoreFramesThanTheirLimit) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto path = temp_path("budget.mp4");
  megaslide::io::write_mp4(path, smooth_frames(12, 32, 48, 5));
  const int64_t frame_bytes = 32 * 48 * 3;
  EXPECT_EQ(
      megaslide::io::read_video(path, nullptr, megaslide::io::VideoReadOptions().max_bytes(24 * frame_bytes)).size(0),
      12);
  try {
    megaslide::io::read_video(path, nullptr, megaslide::io::VideoReadOptions().max_bytes(10 * frame_bytes));
    ADD_FAILURE() << "a read past its limit was allowed";
  } catch (const VideoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("of 48x32 (W x H)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("VideoReadOptions::max_bytes"), std::string::npos) << msg;
  }
  EXPECT_EQ(megaslide::io::read_video_frames(path, {0, 11}, nullptr,
                                             megaslide::io::VideoReadOptions().max_bytes(4 * frame_bytes))
                .size(0),
            2);
  EXPECT_THROW(megaslide::io::read_video_frames(path, {0, 1, 2, 3, 11}, nullptr,
                                                megaslide::io::VideoReadOptions().max_bytes(4 * frame_bytes)),
               VideoError);
  EXPECT_EQ(megaslide::io::read_video(path).size(0), 12)
      << "the default limit (a quarter of the available memory) allows it";
  megaslide::io::remove_tree(path);
}

namespace {
// tests/fixtures/video/ (tools/make_fixtures.py video): H.264 clips and their frames as opencv-python
// decodes them (cv2.VideoCapture.read: what VBench reads videos with), with VBench's temporal flickering.
const std::string kVideoFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video/";
const std::vector<std::string> kOpenCvClips = {"blocks_64x48", "waves_70x38", "fullrange_32x32"};

std::map<std::string, torch::Tensor> opencv_fixture() {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, tensor] : megaslide::io::read_safetensors(kVideoFixtures + "opencv_frames.safetensors").tensors)
    out[name] = tensor;
  return out;
}
}  // namespace

// The property: frames come back in the colours the stream's tags say, not BT.601 studio range whatever they say:
// colour bars whose YUV tools/make_fixtures.py video_files worked out from their RGB with BT.709's matrix
// (studio range, H.264 4:4:4) and at full range on a pixel format without a "j" (VP9 4:2:0) decode to that RGB
// within 2 levels; OpenCV's conversion, which ignores the tags, reads them visibly wrong (the fixture's check).
// 16-bit grey without a range tag is full range, as swscale takes it.
TEST(Video, FramesFollowTheStreamsColourMatrixAndRange) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string dir = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/";
  const auto bars = nlohmann::json::parse(megaslide::io::read_file(dir + "bars.json"));
  const auto opencv = megaslide::io::VideoReadOptions().rgb_conversion(megaslide::io::RgbConversion::kOpenCV);
  for (const std::string clip : {"bars_bt709_64x48.mp4", "bars_fullrange_64x48.webm"}) {
    SCOPED_TRACE(clip);
    const auto frames = megaslide::io::read_video(dir + clip).to(torch::kInt32);
    const auto tags_ignored = megaslide::io::read_video(dir + clip, nullptr, opencv).to(torch::kInt32);
    ASSERT_EQ(frames.sizes(), (std::vector<int64_t>{3, 48, 64, 3}));
    int64_t worst_ignored = 0;
    for (int64_t b = 0; b < 4; ++b) {
      const auto rgb = bars.at("rgb")[static_cast<size_t>(b)].get<std::vector<int64_t>>();
      const auto expected = torch::tensor(rgb, torch::kInt32);
      // The middle of the bar (away from chroma at its edges), every frame.
      const auto middle = frames.index({torch::indexing::Slice(), 24, b * 16 + 8});
      const auto diff = (middle - expected).abs().max().item<int64_t>();
      EXPECT_LE(diff, 2) << "bar " << b << ": " << middle[0] << " for " << expected;
      worst_ignored =
          std::max(worst_ignored, (tags_ignored.index({0, 24, b * 16 + 8}) - expected).abs().max().item<int64_t>());
    }
    EXPECT_GE(worst_ignored, 8) << "read as BT.601 studio range the bars are not these colours";
  }
  // Grey without a range tag is full range, as swscale and FFmpeg take it: 16-bit bars of 8-bit levels 17, 34, 239.
  const auto grey = megaslide::io::read_video(dir + "grey16_48x16.mkv").to(torch::kInt32);
  ASSERT_EQ(grey.sizes(), (std::vector<int64_t>{2, 16, 48, 3}));
  const int levels[3] = {17, 34, 239};
  for (int64_t b = 0; b < 3; ++b)
    EXPECT_LE((grey.index({torch::indexing::Slice(), 8, b * 16 + 8}) - levels[b]).abs().max().item<int64_t>(), 2)
        << "grey bar " << b << ": " << grey.index({0, 8, b * 16 + 8});
}

// The property: a file cut short inside a packet (a download cut short: tools/make_fixtures.py video_files, the
// first 90 % of 24 frames) ends where the damage begins: the frames before it are read, and asking for a frame past
// it is the stream's end (an undefined tensor and the count decoded, which a dataset plans again with), not an
// error that would discard the file.
TEST(Video, AFileCutShortEndsWhereItIsCut) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string path = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/bars_cut_64x48.mp4";
  int64_t decoded = 0;
  const auto past = megaslide::io::read_video_frames(path, {23}, &decoded);
  EXPECT_FALSE(past.defined());
  EXPECT_GT(decoded, 0);
  EXPECT_LT(decoded, 24);
  const auto first = megaslide::io::read_video_frames(path, {0, decoded - 1}, &decoded);
  ASSERT_TRUE(first.defined());
  EXPECT_EQ(first.sizes(), (std::vector<int64_t>{2, 48, 64, 3}));
}

// The property: seeking (VideoReadOptions::seek, the default) gives exactly the frames that decoding from the start
// gives, in the layouts where frames are hardest to tell apart (tools/make_fixtures.py video_files: open GOPs with
// B-frames in H.264 and HEVC, VP9 with hidden frames, H.264 with intra refresh, whose key frames are recovery points
// the frames after which are not whole yet, a variable frame rate in Matroska, an MP4 whose edit list starts
// mid-group, two MPEG-TS files joined end to end, whose second restarts the first's times: a seek by time lands in
// it), and decodes fewer frames doing so: it did seek. A copy of a file cut short still ends where it
// is cut, as without seeking.
TEST(Video, SeekingGivesTheFramesDecodingFromTheStartGives) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string dir = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/";
  const std::vector<std::pair<std::string, int64_t>> files = {
      {"gop_h264_open_32x32.mp4", 96},         {"gop_hevc_open_32x32.mp4", 96}, {"gop_vp9_32x32.webm", 96},
      {"gop_h264_intrarefresh_32x32.mp4", 96}, {"gop_h264_vfr_32x32.mkv", 96},  {"gop_h264_editlist_32x32.mp4", 79},
      {"gop_h264_joined_32x32.ts", 192}};
  const auto from_start = megaslide::io::VideoReadOptions().seek(false);
  for (const auto& [file, frames] : files) {
    SCOPED_TRACE(file);
    const auto all = megaslide::io::read_video(dir + file);
    ASSERT_EQ(all.size(0), frames);
    const std::vector<std::vector<int64_t>> reads = {
        {frames - 1}, {48}, {60, 61, 62, 63}, {frames - 1, 50, frames - 1, 70}, {49, 53, 57, 61, 65, 69, 73, 77}};
    for (const auto& indices : reads) {
      SCOPED_TRACE(::testing::PrintToString(indices));
      int64_t decoded = 0;
      const auto sought = megaslide::io::read_video_frames(dir + file, indices, &decoded);
      ASSERT_TRUE(sought.defined());
      EXPECT_TRUE(torch::equal(sought, all.index_select(0, torch::tensor(indices))));
      EXPECT_TRUE(torch::equal(sought, megaslide::io::read_video_frames(dir + file, indices, nullptr, from_start)));
      // (Intra refresh has no key frame to start from but the first, and the joined files' repeated times leave the
      // second one's frames unnamed: both decode from the start.)
      if (indices.size() == 1 && indices[0] == frames - 1 && file.find("intrarefresh") == std::string::npos &&
          file.find("joined") == std::string::npos)
        EXPECT_LE(decoded, 24) << "decoded from the start";
    }
  }
  // Cut after 90 % of its bytes (its index first, as +faststart writes it): the frames past the cut are the
  // stream's end, and the count decoded is the one decoding from the start gives.
  std::ifstream whole(dir + "gop_h264_open_32x32.mp4", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(whole)), std::istreambuf_iterator<char>());
  const std::string cut = temp_path("cut.mp4");
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() * 9 / 10);
  int64_t decoded = 0, decoded_from_start = 0;
  EXPECT_FALSE(megaslide::io::read_video_frames(cut, {95}, &decoded).defined());
  EXPECT_FALSE(megaslide::io::read_video_frames(cut, {95}, &decoded_from_start, from_start).defined());
  EXPECT_EQ(decoded, decoded_from_start);
  ASSERT_GT(decoded, 60);
  EXPECT_TRUE(torch::equal(megaslide::io::read_video_frames(cut, {decoded - 1}),
                           megaslide::io::read_video_frames(cut, {decoded - 1}, nullptr, from_start)));
  std::remove(cut.c_str());
}

// The property: a recording streamed to its file (a WebM written to a pipe: neither a frame count nor a duration)
// is probed at its true frame count, counted from its packets, not as a file of no frames.
TEST(Video, AStreamedRecordingWithoutADurationIsProbedAtItsFrames) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string path = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/video_files/bars_streamed_64x48.webm";
  const auto info = megaslide::io::probe_video(path);
  EXPECT_EQ(info.container_frames, 0);
  EXPECT_EQ(info.frames, 10);
  EXPECT_EQ(megaslide::io::read_video(path).size(0), 10);
}

// The kOpenCV conversion is OpenCV's: the same frames, bit for bit, as opencv-python decodes from the
// same files (yuv420p at a macroblock-aligned size, at a size that is not — the decoder's coded size
// then differs from the frame's — and full-range yuvj420p).
TEST(Video, OpenCvConversionGivesOpenCvPythonsFrames) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto reference = opencv_fixture();
  const auto opencv = megaslide::io::VideoReadOptions().rgb_conversion(megaslide::io::RgbConversion::kOpenCV);
  for (const auto& clip : kOpenCvClips) {
    const auto& expected = reference.at(clip + ".frames");
    auto frames = megaslide::io::read_video(kVideoFixtures + clip + ".mp4", nullptr, opencv);
    ASSERT_EQ(frames.sizes(), expected.sizes()) << clip;
    const auto diff = (frames.to(torch::kInt32) - expected.to(torch::kInt32)).abs();
    const int64_t max_diff = diff.max().item<int64_t>(), differing = diff.ne(0).sum().item<int64_t>();
    std::cout << clip << ": " << differing << " of " << diff.numel()
              << " values differ from opencv-python's, by at most " << max_diff << "\n";
    // Measured: none differ (Debian 12's swscale 6.7 here, opencv-python 4.13's bundled swscale 9.1). One
    // level is allowed so that another FFmpeg's SIMD rounding does not fail the test; the metric below
    // holds the 1e-3 that matters.
    EXPECT_LE(max_diff, 1) << clip;
    EXPECT_LT(static_cast<double>(differing), 1e-3 * static_cast<double>(diff.numel())) << clip;
  }
}

// The default conversion interpolates chroma, which OpenCV does not: on these clips its frames differ
// visibly from OpenCV's — the difference the kOpenCV conversion exists to remove (and the check that
// the fixture can tell the two apart).
TEST(Video, InterpolatedChromaIsNotWhatOpenCvReads) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto reference = opencv_fixture();
  for (const auto& clip : kOpenCvClips) {
    auto frames = megaslide::io::read_video(kVideoFixtures + clip + ".mp4");
    const double mean_diff =
        (frames.to(torch::kFloat64) - reference.at(clip + ".frames").to(torch::kFloat64)).abs().mean().item<double>();
    std::cout << clip << ": interpolated chroma vs opencv-python: mean |difference| " << mean_diff << " levels\n";
    EXPECT_GT(mean_diff, 1.0) << clip;
  }
}

namespace {

// Four flat quadrants of distinct colours (top-left red, top-right green, bottom-left blue, bottom-right
// white) and a dark stripe along the top edge: tells left from right and top from bottom. [T, H, W, 3].
torch::Tensor quadrant_frames(int64_t T, int64_t H, int64_t W) {
  auto f = torch::zeros({T, H, W, 3}, torch::kUInt8);
  using torch::indexing::Slice;
  f.index_put_({Slice(), Slice(0, H / 2), Slice(0, W / 2)}, torch::tensor({220, 30, 30}, torch::kUInt8));
  f.index_put_({Slice(), Slice(0, H / 2), Slice(W / 2, W)}, torch::tensor({30, 200, 40}, torch::kUInt8));
  f.index_put_({Slice(), Slice(H / 2, H), Slice(0, W / 2)}, torch::tensor({40, 50, 210}, torch::kUInt8));
  f.index_put_({Slice(), Slice(H / 2, H), Slice(W / 2, W)}, torch::tensor({230, 230, 230}, torch::kUInt8));
  f.index_put_({Slice(), Slice(0, 4), Slice()}, torch::tensor({16, 16, 16}, torch::kUInt8));
  return f;
}

// What a player shows: turned `degrees` clockwise (torch::rot90 turns from dim 1 towards dim 2, i.e.
// counter-clockwise on an image, for k = 1), then mirrored left-right.
torch::Tensor upright(const torch::Tensor& stored, int64_t degrees, bool hflip) {
  auto t = torch::rot90(stored, -degrees / 90, {1, 2});
  return (hflip ? t.flip({2}) : t).contiguous();
}

double psnr(const torch::Tensor& a, const torch::Tensor& b) {
  const double mse = (a.to(torch::kFloat64) - b.to(torch::kFloat64)).pow(2).mean().item<double>();
  return 10.0 * std::log10(255.0 * 255.0 / std::max(mse, 1e-12));
}

double mean_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().mean().item<double>();
}

// ffmpeg's own frames (its default autorotate), or an undefined tensor when ffmpeg is missing.
torch::Tensor ffmpeg_frames(const std::string& path, int64_t T, int64_t H, int64_t W) {
  std::string bytes;
  FILE* pipe = popen(("ffmpeg -v error -i '" + path + "' -f rawvideo -pix_fmt rgb24 - 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return {};
  std::array<char, 65536> buf{};
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), pipe)) > 0;) bytes.append(buf.data(), n);
  pclose(pipe);
  if (static_cast<int64_t>(bytes.size()) != T * H * W * 3) return {};
  return torch::from_blob(bytes.data(), {T, H, W, 3}, torch::kUInt8).clone();
}

}  // namespace

// A phone's portrait video is stored landscape with a display matrix; it must read upright, at the
// displayed size, for 90, 180 and 270 degrees and with a mirror. libx264 at crf 0 (lossless luma; the
// 4:2:0 chroma is what differs from the source, at the quadrants' edges).
TEST(Video, DisplayMatrixTurnsFramesUpright) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const int64_t T = 3, H = 32, W = 48;
  const auto source = quadrant_frames(T, H, W);
  const auto options = megaslide::io::VideoWriteOptions().fps(8).crf(0).preset("veryfast");
  const auto plain_path = temp_path("upright-plain.mp4");
  megaslide::io::write_mp4(plain_path, source, options);
  const auto plain = megaslide::io::read_video(plain_path);
  ASSERT_EQ(plain.sizes(), source.sizes());
  const bool have_ffmpeg = !run("command -v ffmpeg").empty();
  const auto plain_reference = have_ffmpeg ? ffmpeg_frames(plain_path, T, H, W) : torch::Tensor();
  if (have_ffmpeg) ASSERT_TRUE(plain_reference.defined()) << "ffmpeg could not read " << plain_path;
  for (const auto& [degrees, hflip] :
       std::vector<std::pair<int64_t, bool>>{{90, false}, {180, false}, {270, false}, {90, true}, {0, true}}) {
    SCOPED_TRACE("rotation " + std::to_string(degrees) + (hflip ? " mirrored" : ""));
    const auto path = temp_path("upright-" + std::to_string(degrees) + (hflip ? "-flip" : "") + ".mp4");
    megaslide::io::write_mp4(path, source,
                             megaslide::io::VideoWriteOptions(options)
                                 .display_rotation_degrees(static_cast<double>(degrees))
                                 .display_hflip(hflip));
    const auto expected = upright(source, degrees, hflip);
    const bool sideways = degrees % 180 != 0;
    const auto info = megaslide::io::probe_video(path);
    EXPECT_EQ(info.width, sideways ? H : W);
    EXPECT_EQ(info.height, sideways ? W : H);
    EXPECT_EQ(info.stored_width, W);
    EXPECT_EQ(info.rotation_degrees, degrees);
    EXPECT_EQ(info.hflip, hflip);
    VideoInfo read_info;
    const auto frames = megaslide::io::read_video(path, &read_info);
    ASSERT_EQ(frames.sizes(), expected.sizes());
    EXPECT_EQ(read_info.width, info.width);
    // The same bitstream as the plain file, turned after the RGB conversion: exact.
    EXPECT_TRUE(torch::equal(frames, upright(plain, degrees, hflip)));
    // And the source turned: of the eight turns and mirrors of the source, the expected one is by far the
    // closest (the quadrants' 4:2:0 chroma edges are what keeps it from exact).
    const double right = psnr(frames, expected);
    EXPECT_GT(right, 20.0);
    for (int64_t d = 0; d < 360; d += 90)
      for (bool f : {false, true}) {
        const auto other = upright(source, d, f);
        if ((d == degrees && f == hflip) || other.sizes() != frames.sizes()) continue;
        EXPECT_GT(right, psnr(frames, other) + 6.0) << "as close to the turn " << d << (f ? " mirrored" : "");
      }
    const auto some = megaslide::io::read_video_frames(path, {2, 0});
    ASSERT_TRUE(some.defined());
    EXPECT_TRUE(torch::equal(some[0], frames[2]));
    EXPECT_TRUE(torch::equal(some[1], frames[0]));
    if (sideways) EXPECT_GT(frames.size(1), frames.size(2)) << "a quarter-turned landscape file reads portrait";
    if (have_ffmpeg) {
      const auto reference = ffmpeg_frames(path, T, expected.size(1), expected.size(2));
      ASSERT_TRUE(reference.defined()) << "ffmpeg gave no frames of the displayed size";
      // ffmpeg turns what it shows of the plain file the same way; its frames differ from ours by its
      // YUV -> RGB conversion only (uninterpolated chroma): as much as they do for the plain file.
      EXPECT_LT(mean_abs_diff(reference, upright(plain_reference, degrees, hflip)), 0.5);
      EXPECT_NEAR(mean_abs_diff(frames, reference), mean_abs_diff(plain, plain_reference), 0.5);
    }
    ::unlink(path.c_str());
  }
  ::unlink(plain_path.c_str());
  if (!have_ffmpeg) GTEST_SKIP() << "ffmpeg not installed: the comparison with ffmpeg's autorotated frames did not run";
}

// An angle that is not a quarter turn is read at the nearest one, with one warning per file.
TEST(Video, OddDisplayAngleReadsAtTheNearestQuarterTurnWithOneWarning) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const int64_t T = 2, H = 32, W = 48;
  const auto source = quadrant_frames(T, H, W);
  const auto path = temp_path("upright-100.mp4");
  megaslide::io::write_mp4(
      path, source, megaslide::io::VideoWriteOptions().fps(8).crf(0).preset("veryfast").display_rotation_degrees(100));
  ::testing::internal::CaptureStderr();
  const auto info = megaslide::io::probe_video(path);
  const auto frames = megaslide::io::read_video(path);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(info.rotation_degrees, 90);
  EXPECT_NEAR(info.display_angle_degrees, 100.0, 0.01);
  EXPECT_EQ(frames.size(1), W);
  EXPECT_EQ(frames.size(2), H);
  EXPECT_GT(psnr(frames, upright(source, 90, false)), psnr(frames, upright(source, 270, false)) + 6.0);
  EXPECT_NE(err.find(path), std::string::npos) << err;
  EXPECT_EQ(err.find(path), err.rfind(path)) << "warned more than once: " << err;
  ::unlink(path.c_str());
}

// The property: a still image is shown as its EXIF orientation says, as PIL's ImageOps.exif_transpose shows it
// (tests/fixtures/image_exif, tools/make_fixtures.py image_exif: one 24x16 picture under each orientation 1-8):
// PNG (eXIf chunk) and lossless WebP (EXIF chunk) bit for bit; JPEG (APP1) within JPEG's rounding of PIL's decode,
// where any other turn or mirror of the 4x4 colour blocks is far off. The probe gives the shown size.
TEST(Video, StillImagesAreShownAsTheirExifOrientationSays) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string dir = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/image_exif/";
  for (int orientation = 1; orientation <= 8; ++orientation) {
    SCOPED_TRACE("orientation " + std::to_string(orientation));
    const std::string n = std::to_string(orientation);
    const auto shown = megaslide::io::read_video(dir + "shown" + n + ".png");
    const bool sideways = orientation >= 5;
    ASSERT_EQ(shown.sizes(), (std::vector<int64_t>{1, sideways ? 24 : 16, sideways ? 16 : 24, 3}));
    for (const std::string kind : {"png", "webp"}) {
      const auto info = megaslide::io::probe_video(dir + "o" + n + "." + kind);
      EXPECT_EQ(info.width, shown.size(2)) << kind;
      EXPECT_EQ(info.height, shown.size(1)) << kind;
      EXPECT_EQ(info.display_width, shown.size(2)) << kind;
      EXPECT_TRUE(torch::equal(megaslide::io::read_video(dir + "o" + n + "." + kind), shown)) << kind;
    }
    const auto jpeg = megaslide::io::read_video(dir + "o" + n + ".jpg").to(torch::kFloat32);
    const auto pil = megaslide::io::read_video(dir + "shown_jpg" + n + ".png").to(torch::kFloat32);
    ASSERT_EQ(jpeg.sizes(), pil.sizes());
    EXPECT_LT((jpeg - pil).abs().max().item<float>(), 8.0f);
    // Against the other orientations of the same size: far off (the test would see a wrong turn or mirror).
    for (int other = sideways ? 5 : 1; other <= (sideways ? 8 : 4); ++other)
      if (other != orientation)
        EXPECT_GT(
            (jpeg - megaslide::io::read_video(dir + "shown_jpg" + std::to_string(other) + ".png").to(torch::kFloat32))
                .abs()
                .mean()
                .item<float>(),
            20.0f)
            << "orientation " << other;
  }
}

// The property: orientation 6 as other writers store it is read as PIL reads it (tests/fixtures/image_exif): a PNG
// eXIf chunk that keeps the "Exif\0\0" prefix, a LONG tag (big-endian JPEG, little-endian WebP), an orientation only
// in XMP (JPEG APP1, PNG iTXt), a JPEG with fill bytes before its APP1, and one with 80 segments before it.
TEST(Video, StillImageOrientationAsOtherWritersStoreIt) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string dir = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/image_exif/";
  for (const std::string name :
       {"p_prefix6.png", "p_xmp6.png", "w_long6.webp", "j_long6.jpg", "j_xmp6.jpg", "j_fill6.jpg", "j_many6.jpg"}) {
    SCOPED_TRACE(name);
    const auto pil =
        megaslide::io::read_video(dir + "shown_" + name.substr(0, name.find('.')) + ".png").to(torch::kFloat32);
    ASSERT_EQ(pil.sizes(), (std::vector<int64_t>{1, 24, 16, 3}));
    const auto read = megaslide::io::read_video(dir + name).to(torch::kFloat32);
    ASSERT_EQ(read.sizes(), pil.sizes());
    EXPECT_LT((read - pil).abs().max().item<float>(), name.back() == 'g' && name[0] == 'j' ? 8.0f : 0.5f);
  }
}
