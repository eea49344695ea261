#include "megaslide/eval/metrics.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "megaslide/io/vbench_layout.h"
#include "megaslide/io/files.h"
#include "megaslide/io/video.h"

namespace megaslide::eval {

namespace {
torch::Tensor as_float_frames(const torch::Tensor& frames, const char* who) {
  if (frames.dim() != 4)
    throw std::invalid_argument(std::string(who) + ": expected frames [T, H, W, C], got " + c10::str(frames.sizes()));
  if (frames.size(0) < 2)
    throw std::invalid_argument(std::string(who) + ": needs at least 2 frames, got " + std::to_string(frames.size(0)));
  return frames.to(torch::kCPU, torch::kFloat64);
}

// c(a, b) of centred frames; `flat`: the frame's values were all equal before centring (its centred values are
// then zero or float rounding's residue, whose direction means nothing).
double consistency(const torch::Tensor& a, const torch::Tensor& b, bool a_flat, bool b_flat) {
  if (a_flat || b_flat) return a_flat && b_flat ? 1.0 : 0.0;
  const double na = a.norm().item<double>(), nb = b.norm().item<double>();
  return std::max(0.0, (a * b).sum().item<double>() / (na * nb));
}
}  // namespace

double mean_abs_frame_difference(const torch::Tensor& frames) {
  auto f = as_float_frames(frames, "mean_abs_frame_difference");
  const int64_t T = f.size(0);
  // The mean of per-pair means (as VBench computes it; every pair has the same pixel count).
  return (f.slice(0, 1) - f.slice(0, 0, T - 1)).abs().flatten(1).mean(1).mean().item<double>();
}

double temporal_flickering_score(const torch::Tensor& frames) {
  return (255.0 - mean_abs_frame_difference(frames)) / 255.0;
}

double frame_consistency_score(const torch::Tensor& frames) {
  auto f = as_float_frames(frames, "frame_consistency_score").flatten(1) / 255.0;
  const auto flat_frames = std::get<0>(f.max(1)).eq(std::get<0>(f.min(1)));
  const auto flat = [&](int64_t i) { return flat_frames[i].item<bool>(); };
  f = f - f.mean(1, true);
  const int64_t T = f.size(0);
  double total = 0.0;
  for (int64_t i = 1; i < T; ++i)
    total += 0.5 * (consistency(f[i], f[i - 1], flat(i), flat(i - 1)) + consistency(f[i], f[0], flat(i), flat(0)));
  return total / static_cast<double>(T - 1);
}

FolderEvaluation evaluate_folder(const std::string& dir, const std::function<void(int64_t, int64_t)>& on_video) {
  const io::SampleFolder sample = io::find_sample_folder(dir);
  const std::string& folder = sample.videos;
  FolderEvaluation out;
  out.folder = folder;
  const auto files = io::list_files(folder, "mp4");
  if (files.empty()) throw std::runtime_error("folder '" + folder + "' holds no .mp4 file");
  std::map<std::string, std::string> prompts;  // from index.json, when there is one
  const auto& index_path = sample.index;
  if (io::path_exists(index_path)) {
    try {
      auto j = nlohmann::json::parse(io::read_input_file(index_path, uint64_t{256} << 20));
      for (const auto& v : j.at("videos")) prompts[v.at("file").get<std::string>()] = v.at("prompt").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error("'" + index_path + "' is not a valid index: " + e.what());
    } catch (const io::IoError& e) {
      throw std::runtime_error(std::string("index: ") + e.what());
    }
  }
  double flicker = 0.0, consistent = 0.0;
  for (const auto& file : files) {
    io::VideoInfo info;
    // Decoded as VBench decodes them (through OpenCV), so that the scores are the ones VBench reports.
    auto frames = io::read_video(io::join_path(folder, file), &info,
                                 io::VideoReadOptions().rgb_conversion(io::RgbConversion::kOpenCV));
    VideoEvaluation v;
    v.file = file;
    auto it = prompts.find(file);
    v.prompt = it != prompts.end() ? it->second : io::vbench_prompt_from_file_name(file);
    v.frames = info.frames, v.width = info.width, v.height = info.height;
    if (info.bits_per_component > 8) out.deep_videos.push_back(file);
    try {
      v.mean_abs_frame_difference = mean_abs_frame_difference(frames);
      v.temporal_flickering = temporal_flickering_score(frames);
      v.frame_consistency = frame_consistency_score(frames);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error("video '" + io::join_path(folder, file) + "': " + e.what());
    }
    flicker += v.temporal_flickering;
    consistent += v.frame_consistency;
    out.videos.push_back(std::move(v));
    if (on_video) on_video(static_cast<int64_t>(out.videos.size()), static_cast<int64_t>(files.size()));
  }
  out.mean_temporal_flickering = flicker / static_cast<double>(out.videos.size());
  out.mean_frame_consistency = consistent / static_cast<double>(out.videos.size());
  return out;
}

std::string to_json(const FolderEvaluation& e) {
  nlohmann::ordered_json j;
  j["folder"] = e.folder;
  j["count"] = e.videos.size();
  j["mean"] = {{"temporal_flickering", e.mean_temporal_flickering}, {"frame_consistency", e.mean_frame_consistency}};
  auto videos = nlohmann::ordered_json::array();
  for (const auto& v : e.videos)
    videos.push_back({{"file", v.file},
                      {"prompt", v.prompt},
                      {"frames", v.frames},
                      {"width", v.width},
                      {"height", v.height},
                      {"mean_abs_frame_difference", v.mean_abs_frame_difference},
                      {"temporal_flickering", v.temporal_flickering},
                      {"frame_consistency", v.frame_consistency}});
  j["videos"] = std::move(videos);
  return j.dump(2) + "\n";
}

std::string to_table(const FolderEvaluation& e) {
  size_t width = 4;
  for (const auto& v : e.videos) width = std::max(width, std::min<size_t>(v.file.size(), 60));
  std::string out = fmt::format("{:<{}}  {:>6}  {:>9}  {:>19}  {:>17}\n", "file", width, "frames", "size",
                                "temporal_flickering", "frame_consistency");
  for (const auto& v : e.videos) {
    std::string name = v.file.size() > 60 ? v.file.substr(0, 57) + "..." : v.file;
    out += fmt::format("{:<{}}  {:>6}  {:>9}  {:>19.4f}  {:>17.4f}\n", name, width, v.frames,
                       fmt::format("{}x{}", v.width, v.height), v.temporal_flickering, v.frame_consistency);
  }
  out += fmt::format("{:<{}}  {:>6}  {:>9}  {:>19.4f}  {:>17.4f}\n", fmt::format("mean of {}", e.videos.size()), width,
                     "", "", e.mean_temporal_flickering, e.mean_frame_consistency);
  return out;
}

}  // namespace megaslide::eval
