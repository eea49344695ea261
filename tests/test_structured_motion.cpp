// The structured-motion dataset: clips are a pure function of (seed, index), stay in [-1, 1], and move
// the way their captions say (measured on the pixels, not read back from the description).
#include "megaslide/data/structured_motion.h"

#include <gtest/gtest.h>

#include <set>

using namespace megaslide;

namespace {
StructuredMotionOptions options(uint64_t seed = 1234) {
  return StructuredMotionOptions().channels(3).frames(8).height(16).width(16).num_clips(200).seed(seed);
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST(StructuredMotion, ClipsAreDeterministicPerSeedAndIndex) {
  StructuredMotionDataset a(options()), b(options()), other(options(99));
  int differing = 0;
  for (int64_t i : {0, 1, 17, 199}) {
    auto ca = a.get(i), cb = b.get(i);
    EXPECT_TRUE(torch::equal(ca.video, cb.video)) << i;
    EXPECT_EQ(ca.caption, cb.caption) << i;
    differing += !torch::equal(ca.video, other.get(i).video);
  }
  EXPECT_GT(differing, 0);
  EXPECT_THROW(a.get(200), c10::Error);
}

TEST(StructuredMotion, ValuesStayInRangeAndShapesMatch) {
  StructuredMotionDataset ds(options());
  auto batch = ds.batch({0, 1, 2, 3, 4});
  EXPECT_EQ(batch.video.sizes(), (std::vector<int64_t>{5, 3, 8, 16, 16}));
  EXPECT_GE(batch.video.min().item<float>(), -1.0f);
  EXPECT_LE(batch.video.max().item<float>(), 1.0f);
  EXPECT_EQ(batch.captions.size(), 5u);
}

TEST(StructuredMotion, BlobsMoveTheWayTheirCaptionSays) {
  StructuredMotionDataset ds(options());
  int checked = 0;
  for (int64_t i = 0; i < ds.size(); ++i) {
    auto clip = ds.get(i);
    if (clip.motion.kind != MotionKind::kBlob) continue;
    // Intensity-weighted centroid of the brightest channel, first and last frame.
    auto energy = (clip.video + 1).sum(0);  // [T, H, W]
    auto centroid = [&](int64_t t) {
      auto f = energy[t];
      auto ys = torch::arange(16, torch::kFloat32).view({16, 1}), xs = torch::arange(16, torch::kFloat32).view({1, 16});
      double mass = f.sum().item<double>();
      return std::make_pair((f * ys).sum().item<double>() / mass, (f * xs).sum().item<double>() / mass);
    };
    auto [y0, x0] = centroid(0);
    auto [y1, x1] = centroid(7);
    const double dy = y1 - y0, dx = x1 - x0;
    if (contains(clip.caption, "left")) EXPECT_LT(dx, -1.0) << clip.caption;
    if (contains(clip.caption, "right")) EXPECT_GT(dx, 1.0) << clip.caption;
    if (contains(clip.caption, " up")) EXPECT_LT(dy, -1.0) << clip.caption;
    if (contains(clip.caption, "down")) EXPECT_GT(dy, 1.0) << clip.caption;
    const double moved = std::abs(dx) + std::abs(dy);
    if (contains(clip.caption, "quickly")) EXPECT_GT(moved, 5.0) << clip.caption;
    if (contains(clip.caption, "slowly")) EXPECT_LT(moved, 5.0) << clip.caption;
    ++checked;
  }
  EXPECT_GT(checked, 30);
}

TEST(StructuredMotion, GradientsBrightenOrDarkenAsCaptioned) {
  StructuredMotionDataset ds(options());
  int checked = 0;
  for (int64_t i = 0; i < ds.size(); ++i) {
    auto clip = ds.get(i);
    if (clip.motion.kind != MotionKind::kGradient) continue;
    const double change = (clip.video.select(1, 7).mean() - clip.video.select(1, 0).mean()).item<double>();
    if (contains(clip.caption, "brightens")) EXPECT_GT(change, 0.5) << clip.caption;
    else EXPECT_LT(change, -0.5) << clip.caption;
    ++checked;
  }
  EXPECT_GT(checked, 30);
}

TEST(StructuredMotion, StripesOscillateInTime) {
  StructuredMotionDataset ds(options());
  int checked = 0;
  for (int64_t i = 0; i < ds.size(); ++i) {
    auto clip = ds.get(i);
    if (clip.motion.kind != MotionKind::kStripes) continue;
    // The pattern's contrast changes over the clip (the caption's oscillation).
    auto contrast = clip.video.select(0, clip.motion.channel).std({1, 2});  // per frame
    EXPECT_GT((contrast.max() - contrast.min()).item<float>(), 0.2f) << clip.caption;
    EXPECT_TRUE(contains(clip.caption, "stripes"));
    ++checked;
  }
  EXPECT_GT(checked, 30);
}

TEST(EpochSampler, EachEpochIsAPermutationAndRepeatable) {
  EpochSampler a(10, 5), b(10, 5);
  auto first = a.next(10), second = a.next(10);
  EXPECT_EQ(std::set<int64_t>(first.begin(), first.end()).size(), 10u);
  EXPECT_EQ(std::set<int64_t>(second.begin(), second.end()).size(), 10u);
  EXPECT_NE(first, second);
  EXPECT_EQ(b.next(10), first);
}
