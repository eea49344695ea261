#include "megaslide/data/structured_motion.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace megaslide {

namespace {
const char* kColours[] = {"red", "green", "blue"};

// A well-mixed 64-bit seed for (dataset seed, clip index): SplitMix64's finaliser.
uint64_t mix(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

StructuredMotionDataset::StructuredMotionDataset(StructuredMotionOptions options) : options_(options) {
  TORCH_CHECK(options_.channels() >= 1 && options_.frames() >= 1 && options_.height() >= 2 && options_.width() >= 2,
              "StructuredMotionDataset: need channels >= 1, frames >= 1 and frames of at least 2x2 pixels");
  TORCH_CHECK(options_.num_clips() >= 1, "StructuredMotionDataset: num_clips must be >= 1");
}

MotionDescription StructuredMotionDataset::describe(int64_t index) const {
  std::mt19937_64 rng(mix(options_.seed(), static_cast<uint64_t>(index)));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double H = static_cast<double>(options_.height()), W = static_cast<double>(options_.width());
  const double T = static_cast<double>(options_.frames());
  MotionDescription m;
  m.kind = static_cast<MotionKind>(rng() % 3);
  m.channel = static_cast<int64_t>(rng() % static_cast<uint64_t>(std::min<int64_t>(3, options_.channels())));
  switch (m.kind) {
    case MotionKind::kBlob: {
      // Travel a quarter (slowly) or half (quickly) of the frame over the clip along a path centred
      // near the middle, so the blob stays in view.
      const bool quick = rng() % 2 == 1;
      const int direction = static_cast<int>(rng() % 4);  // left, right, up, down
      const bool horizontal = direction < 2;
      const double extent = horizontal ? W : H, across_extent = horizontal ? H : W;
      const double travel = (quick ? 0.5 : 0.25) * extent;
      const double sign = (direction == 0 || direction == 2) ? -1.0 : 1.0;  // left and up are negative
      const double per_frame = T > 1 ? sign * travel / (T - 1) : 0.0;
      const double start = (0.45 + 0.1 * unit(rng)) * extent - sign * travel / 2;
      const double across = (0.35 + 0.3 * unit(rng)) * across_extent;
      m.sigma = std::max(0.8, std::min(H, W) / 8.0);
      if (horizontal) {
        m.start_w = start, m.velocity_w = per_frame, m.start_h = across;
      } else {
        m.start_h = start, m.velocity_h = per_frame, m.start_w = across;
      }
      break;
    }
    case MotionKind::kStripes:
      m.vertical = rng() % 2 == 1;
      m.cycles = 1.0 + static_cast<double>(rng() % 3);
      m.temporal_cycles = (rng() % 2 == 1) ? 1.0 : 0.5;  // quickly : slowly
      break;
    case MotionKind::kGradient:
      m.vertical = rng() % 2 == 1;
      m.brightens = rng() % 2 == 1;
      break;
  }
  return m;
}

torch::Tensor StructuredMotionDataset::render(const MotionDescription& m) const {
  const int64_t C = options_.channels(), T = options_.frames(), H = options_.height(), W = options_.width();
  auto t = torch::arange(T, torch::kFloat64).view({T, 1, 1});
  auto y = torch::arange(H, torch::kFloat64).view({1, H, 1});
  auto x = torch::arange(W, torch::kFloat64).view({1, 1, W});
  torch::Tensor frame;  // [T, H, W] in [0, 1], drawn into channel m.channel
  switch (m.kind) {
    case MotionKind::kBlob: {
      auto ch = m.start_h + m.velocity_h * t, cw = m.start_w + m.velocity_w * t;
      auto r2 = (y - ch).pow(2) + (x - cw).pow(2);
      frame = torch::exp(-r2 / (2 * m.sigma * m.sigma));
      break;
    }
    case MotionKind::kStripes: {
      auto along = m.vertical ? x / static_cast<double>(W) : y / static_cast<double>(H);
      auto phase = 2 * M_PI * m.temporal_cycles * t / std::max<int64_t>(T, 1);
      frame = 0.5 + 0.5 * torch::sin(2 * M_PI * m.cycles * along) * torch::cos(phase);
      break;
    }
    case MotionKind::kGradient: {
      auto ramp = m.vertical ? y / static_cast<double>(std::max<int64_t>(H - 1, 1))
                             : x / static_cast<double>(std::max<int64_t>(W - 1, 1));
      auto level = T > 1 ? t / static_cast<double>(T - 1) : torch::zeros_like(t);
      if (!m.brightens) level = 1.0 - level;
      frame = 0.5 * ramp * 0.5 + 0.75 * level;  // in [0, 1]
      frame = frame.clamp(0.0, 1.0).expand({T, H, W});
      break;
    }
  }
  auto video = torch::full({C, T, H, W}, -1.0, torch::kFloat64);
  video.select(0, m.channel).copy_(frame.expand({T, H, W}) * 2.0 - 1.0);
  if (m.kind == MotionKind::kGradient) {
    // A scene-wide change: every channel follows the ramp (a grey scene).
    for (int64_t c = 0; c < C; ++c) video.select(0, c).copy_(frame * 2.0 - 1.0);
  }
  return video.to(torch::kFloat32);
}

std::string StructuredMotionDataset::caption(const MotionDescription& m) const {
  const std::string colour = kColours[m.channel % 3];
  switch (m.kind) {
    case MotionKind::kBlob: {
      std::string direction = m.velocity_w < 0 ? "left" : m.velocity_w > 0 ? "right" : m.velocity_h < 0 ? "up" : "down";
      const double speed = std::abs(m.velocity_w) + std::abs(m.velocity_h);
      const double extent = static_cast<double>(m.velocity_w != 0 ? options_.width() : options_.height());
      const double travel = speed * static_cast<double>(std::max<int64_t>(options_.frames() - 1, 1));
      return "a " + colour + " blob moves " + direction + (travel > 0.375 * extent ? " quickly" : " slowly");
    }
    case MotionKind::kStripes:
      return colour + " " + (m.vertical ? "vertical" : "horizontal") + " stripes oscillate " +
             (m.temporal_cycles >= 1.0 ? "quickly" : "slowly");
    case MotionKind::kGradient:
      return std::string("the scene ") + (m.brightens ? "brightens" : "darkens") + " from the " +
             (m.vertical ? "top" : "left");
  }
  return "";
}

Clip StructuredMotionDataset::get(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < size(), "StructuredMotionDataset: index ", index, " out of range [0, ", size(),
              ")");
  Clip clip;
  clip.motion = describe(index);
  clip.video = render(clip.motion);
  clip.caption = caption(clip.motion);
  return clip;
}

ClipBatch StructuredMotionDataset::batch(const std::vector<int64_t>& indices) const {
  ClipBatch b;
  std::vector<torch::Tensor> videos;
  for (auto i : indices) {
    auto clip = get(i);
    videos.push_back(clip.video);
    b.captions.push_back(clip.caption);
  }
  b.video = torch::stack(videos);
  return b;
}

EpochSampler::EpochSampler(int64_t dataset_size, uint64_t seed) : size_(dataset_size), seed_(seed) {
  TORCH_CHECK(dataset_size >= 1, "EpochSampler: empty dataset");
}

void EpochSampler::reshuffle() {
  ++epoch_;
  order_.resize(static_cast<size_t>(size_));
  for (int64_t i = 0; i < size_; ++i) order_[static_cast<size_t>(i)] = i;
  std::mt19937_64 rng(mix(seed_, static_cast<uint64_t>(epoch_)));
  std::shuffle(order_.begin(), order_.end(), rng);
  cursor_ = 0;
}

void EpochSampler::seek(int64_t epoch, int64_t cursor) {
  TORCH_CHECK(epoch >= -1, "EpochSampler::seek: epoch must be >= -1, got ", epoch);
  TORCH_CHECK(cursor >= 0 && cursor <= size_, "EpochSampler::seek: cursor must be in [0, ", size_, "], got ", cursor);
  if (epoch < 0) {
    epoch_ = -1;
    order_.clear();
    cursor_ = 0;
    return;
  }
  epoch_ = epoch - 1;
  reshuffle();
  cursor_ = static_cast<size_t>(cursor);
}

std::vector<int64_t> EpochSampler::next(int64_t batch_size) {
  std::vector<int64_t> out;
  while (static_cast<int64_t>(out.size()) < batch_size) {
    if (epoch_ < 0 || cursor_ >= order_.size()) reshuffle();
    out.push_back(order_[cursor_++]);
  }
  return out;
}

}  // namespace megaslide
