// A small video dataset built at test time (H.264 MP4s through io::write_mp4) in all three layouts, with
// the bad items a real dataset has: a corrupt file, a two-frame file, a listed file that does not
// exist, and (folder layout) a video without its caption.
//
//   DIR/videos/clip-K.mp4 (+ clip-K.txt)  good clips K = 0..good-1: `frames` frames of H×W (landscape, or
//                                          W×H portrait for K in `portrait`), 8 fps, smooth random content
//                                          that changes completely from frame to frame
//   DIR/videos/corrupt.mp4 (+ .txt)        random bytes
//   DIR/videos/short.mp4 (+ .txt)          two frames
//   DIR/videos/nocaption.mp4               a good video without a .txt (folder layout: bad)
//   DIR/opensora.csv, DIR/webvid.csv, DIR/items.jsonl  every clip above plus "missing.mp4" (absent);
//                                          webvid.csv lists files as {page_dir}/{videoid}.mp4
#pragma once

#include <torch/nn/functional/upsampling.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/io/video.h"

namespace megaslide::testing {

// Smooth content (what codecs are built for) that is new in every frame: a coarse random grid per frame,
// upsampled. [T, H, W, 3] uint8.
inline torch::Tensor smooth_random_frames(int64_t T, int64_t H, int64_t W, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto coarse = torch::rand({T, 3, H / 8 + 1, W / 8 + 1}, gen);
  namespace F = torch::nn::functional;
  auto fine = F::interpolate(
      coarse, F::InterpolateFuncOptions().size(std::vector<int64_t>{H, W}).mode(torch::kBilinear).align_corners(true));
  return (fine.permute({0, 2, 3, 1}) * 255).round().to(torch::kUInt8).contiguous();
}

inline double psnr(const torch::Tensor& a, const torch::Tensor& b) {
  const double mse = (a.to(torch::kFloat64) - b.to(torch::kFloat64)).pow(2).mean().item<double>();
  return 10.0 * std::log10(255.0 * 255.0 / std::max(mse, 1e-12));
}

struct VideoFixture {
  std::string dir;
  std::vector<torch::Tensor> sources;  // the good clips' frames as written
  std::vector<std::string> captions;   // of the good clips
  int64_t good = 0;

  VideoFixture(const std::string& name, int64_t good_clips = 5, int64_t frames = 12, int64_t H = 48, int64_t W = 64,
               std::vector<int64_t> portrait = {}) {
    dir = "/tmp/megaslide-test-" + name + "-" + std::to_string(::getpid());
    io::remove_tree(dir);
    io::make_directories(dir + "/videos");
    good = good_clips;
    std::vector<std::pair<std::string, std::string>> listed;  // (file relative to dir, caption)
    for (int64_t k = 0; k < good_clips; ++k) {
      const bool tall = std::find(portrait.begin(), portrait.end(), k) != portrait.end();
      auto frames_k = smooth_random_frames(frames, tall ? W : H, tall ? H : W, 100 + static_cast<uint64_t>(k));
      const std::string file = "videos/clip-" + std::to_string(k) + ".mp4";
      io::write_mp4(dir + "/" + file, frames_k, io::VideoWriteOptions().fps(8).crf(12).preset("veryfast"));
      sources.push_back(frames_k);
      captions.push_back("a red blob moves left clip " + std::to_string(k));
      write(file.substr(0, file.size() - 4) + ".txt", captions.back() + "\n");
      listed.emplace_back(file, captions.back());
    }
    write("videos/corrupt.mp4", std::string(4096, '\x5a') + "not a video");
    write("videos/corrupt.txt", "a corrupt file\n");
    io::write_mp4(dir + "/videos/short.mp4", smooth_random_frames(2, H, W, 7),
                  io::VideoWriteOptions().fps(8).preset("veryfast"));
    write("videos/short.txt", "a two frame file\n");
    io::write_mp4(dir + "/videos/nocaption.mp4", smooth_random_frames(frames, H, W, 8),
                  io::VideoWriteOptions().fps(8).preset("veryfast"));
    listed.emplace_back("videos/corrupt.mp4", "a corrupt file");
    listed.emplace_back("videos/short.mp4", "a two frame file");
    listed.emplace_back("videos/missing.mp4", "a missing file");
    // Open-Sora CSV (a caption with a comma and a quote, to exercise quoting).
    std::string csv = "path,text,num_frames\n";
    for (const auto& [file, caption] : listed) csv += file + ",\"" + caption + "\",12\n";
    write("opensora.csv", csv);
    // WebVid CSV: videoid and page_dir make the path through the template.
    std::string webvid = "videoid,contentUrl,duration,page_dir,name\n";
    for (const auto& [file, caption] : listed) {
      const auto slash = file.find('/');
      webvid += file.substr(slash + 1, file.size() - slash - 5) + ",http://x,PT00H00M10S," + file.substr(0, slash) +
                ",\"" + caption + "\"\n";
    }
    write("webvid.csv", webvid);
    std::string jsonl;
    for (const auto& [file, caption] : listed)
      jsonl += "{\"video\": \"" + file + "\", \"caption\": \"" + caption + "\"}\n";
    write("items.jsonl", jsonl);
  }
  ~VideoFixture() { io::remove_tree(dir); }
  VideoFixture(const VideoFixture&) = delete;
  VideoFixture& operator=(const VideoFixture&) = delete;

  void write(const std::string& relative, const std::string& text) const {
    std::ofstream out(dir + "/" + relative, std::ios::binary);
    out << text;
  }
};

}  // namespace megaslide::testing
