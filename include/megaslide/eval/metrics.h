// Per-video metrics computed in C++ on decoded frames (uint8 [T, H, W, C] on the CPU, C = 3 as read
// by io::read_video), and the folder evaluation behind megaslide-eval.
//
// temporal flickering (VBench's dimension, vbench/temporal_flickering.py): d = the mean, over the T−1
//   consecutive frame pairs, of the mean absolute difference of all pixel values (0…255);
//   score = (255 − d) / 255, 1 for a still video. VBench applies it to videos of static prompts.
// frame consistency: a pixel-space counterpart of VBench's subject consistency (which compares DINO
//   features): f_i = frame i's values in [0, 1] minus their mean, as one vector; with
//   c(a, b) = max(0, cos(a, b)) (1 when both frames are uniform, 0 when only one is),
//   score = mean over i = 1…T−1 of ½·(c(f_i, f_{i−1}) + c(f_i, f_0)).
// Both need T >= 2 and throw std::invalid_argument otherwise.
//
// Thread-safety: plain functions.
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

namespace megaslide::eval {

double mean_abs_frame_difference(const torch::Tensor& frames);  // d above, in 0…255
double temporal_flickering_score(const torch::Tensor& frames);
double frame_consistency_score(const torch::Tensor& frames);

struct VideoEvaluation {
  std::string file;  // name inside the folder
  std::string
      prompt;  // from the sample folder's index.json when it lists the file, else parsed from the name as VBench does
  int64_t frames = 0, width = 0, height = 0;
  double mean_abs_frame_difference = 0, temporal_flickering = 0, frame_consistency = 0;
};

struct FolderEvaluation {
  std::string folder;
  std::vector<VideoEvaluation> videos;  // sorted by file name
  double mean_temporal_flickering = 0, mean_frame_consistency = 0;
  // Videos of more than 8 bits a component (10-bit HDR, say), whose scores may differ from VBench's: opencv-python's
  // bundled swscale dithers down to 8 bits, this build's FFmpeg may not. File names.
  std::vector<std::string> deep_videos;
};

// Reads and scores every *.mp4 of a sample folder (io/vbench_layout.h: DIR/videos/ with DIR/index.json,
// that videos folder itself, or any folder of MP4s); `folder` of the result is the videos folder.
// Throws (naming the folder or the file) when the folder cannot be read, holds no MP4, or a video
// cannot be decoded or has fewer than 2 frames.
// `on_video(done, total)` (optional) is called after each video is scored.
FolderEvaluation evaluate_folder(const std::string& dir,
                                 const std::function<void(int64_t done, int64_t total)>& on_video = {});

// {"folder", "count", "mean": {"temporal_flickering", "frame_consistency"}, "videos": [{...}, ...]}
std::string to_json(const FolderEvaluation& evaluation);
// A fixed-width text table, one row per video and a mean row.
std::string to_table(const FolderEvaluation& evaluation);

}  // namespace megaslide::eval
