// The structured-motion dataset of the paper (§10.2): short synthetic clips whose content moves in a
// way the caption states — translating Gaussian blobs, oscillating stripes, smooth temporal
// brightness gradients. Clip i is a pure function of (seed, i), so any clip can be regenerated exactly,
// in any order, on any thread.
//
// Values lie in [-1, 1] (pixel space), layout [C, T, H, W], float32.
// Thread-safety: const methods may run concurrently.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace megaslide {

struct StructuredMotionOptions {
  TORCH_ARG(int64_t, channels) = 3;
  TORCH_ARG(int64_t, frames) = 8;
  TORCH_ARG(int64_t, height) = 16;
  TORCH_ARG(int64_t, width) = 16;
  TORCH_ARG(int64_t, num_clips) = 512;
  TORCH_ARG(uint64_t, seed) = 1234;
};

enum class MotionKind { kBlob, kStripes, kGradient };

// What a clip shows, in numbers (tests and evaluation read these instead of parsing captions).
struct MotionDescription {
  MotionKind kind = MotionKind::kBlob;
  int64_t channel = 0;                  // colour channel the content is drawn in
  double velocity_h = 0.0;              // blob: centre displacement per frame, rows (down is +)
  double velocity_w = 0.0;              // blob: centre displacement per frame, columns (right is +)
  double start_h = 0.0, start_w = 0.0;  // blob: centre at frame 0
  double sigma = 1.0;                   // blob: Gaussian width in pixels
  bool vertical = false;                // stripes: vertical bars; gradient: ramp runs along height
  double cycles = 1.0;                  // stripes: spatial cycles across the frame
  double temporal_cycles = 1.0;         // stripes: oscillation periods over the clip
  bool brightens = true;                // gradient: direction in time
};

struct Clip {
  torch::Tensor video;  // [C, T, H, W]
  std::string caption;
  MotionDescription motion;
};

struct ClipBatch {
  torch::Tensor video;  // [B, C, T, H, W]
  std::vector<std::string> captions;
};

class StructuredMotionDataset {
 public:
  explicit StructuredMotionDataset(StructuredMotionOptions options);
  int64_t size() const { return options_.num_clips(); }
  const StructuredMotionOptions& options() const { return options_; }

  Clip get(int64_t index) const;
  ClipBatch batch(const std::vector<int64_t>& indices) const;

  // Draws a clip from an explicit description (used by get(), tests and evaluation).
  torch::Tensor render(const MotionDescription& motion) const;
  std::string caption(const MotionDescription& motion) const;

 private:
  MotionDescription describe(int64_t index) const;
  StructuredMotionOptions options_;
};

// Yields dataset indices in a fresh seeded permutation every epoch (deterministic for a seed).
class EpochSampler {
 public:
  EpochSampler(int64_t dataset_size, uint64_t seed);
  std::vector<int64_t> next(int64_t batch_size);
  int64_t epoch() const { return epoch_; }
  // Where the sampler stands: the epoch being drawn (-1 before the first draw) and the index of the next
  // clip in that epoch's order. seek() restores a position (checkpoint resume); the order of an epoch
  // depends only on the seed and the epoch, so nothing else needs saving.
  int64_t cursor() const { return static_cast<int64_t>(cursor_); }
  void seek(int64_t epoch, int64_t cursor);

 private:
  void reshuffle();
  int64_t size_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
  size_t cursor_ = 0;
};

}  // namespace megaslide
