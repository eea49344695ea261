#include "megaslide/data/video_dataset.h"

#include <fmt/format.h>
#include <torch/nn/functional/upsampling.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <thread>

#include "megaslide/io/video.h"

namespace megaslide {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The distance between source frames of consecutive clip frames.
double frame_step(const DataConfig& data, double source_fps) {
  return data.fps > 0 ? source_fps / data.fps : static_cast<double>(data.frame_stride);
}

int64_t source_index(int64_t k, double step) {
  return static_cast<int64_t>(std::llround(static_cast<double>(k) * step));
}

// Source frames a clip of `frames` frames spans.
int64_t frame_span(int64_t frames, double step) { return source_index(frames - 1, step) + 1; }

// The nearest bucket that fits, or -1 (see the header). A video goes to a bucket of one frame (a still's) only
// when no longer bucket fits it.
int64_t nearest_bucket(const std::vector<ClipShape>& buckets, const VideoItemInfo& info, double step) {
  const double aspect = std::log(static_cast<double>(info.height) / static_cast<double>(info.width));
  for (const bool stills : {info.frames <= 1, true}) {
    int64_t best = -1;
    double best_distance = std::numeric_limits<double>::infinity();
    for (size_t b = 0; b < buckets.size(); ++b) {
      const auto& s = buckets[b];
      if (frame_span(s.frames, step) > info.frames || (s.frames == 1 && !stills)) continue;
      const double d = std::abs(aspect - std::log(static_cast<double>(s.height) / static_cast<double>(s.width)));
      bool better = best < 0 || d < best_distance - 1e-12;
      if (!better && best >= 0 && std::abs(d - best_distance) <= 1e-12) {
        const auto& c = buckets[static_cast<size_t>(best)];
        better = s.frames > c.frames || (s.frames == c.frames && s.height * s.width > c.height * c.width);
      }
      if (better) best = static_cast<int64_t>(b), best_distance = d;
    }
    if (best >= 0) return best;
  }
  return -1;
}

// VideoDataset::notices() of usable items.
std::vector<std::string> dataset_notices(const DataConfig& data, const std::vector<VideoItem>& items,
                                         const std::vector<VideoItemInfo>& info) {
  std::vector<std::string> out;
  const auto buckets = clip_buckets(data);
  if (data.fps > 0) {
    // A clip repeats a source frame when it spans fewer source frames than it has.
    int64_t slow = 0, slowest = -1;
    const auto videos = std::count_if(info.begin(), info.end(), [](const auto& v) { return v.frames > 1; });
    for (size_t i = 0; i < info.size(); ++i)
      if (const int64_t frames = buckets[static_cast<size_t>(info[i].bucket)].frames;
          info[i].frames > 1 && frame_span(frames, frame_step(data, info[i].fps)) < frames) {
        ++slow;
        if (slowest < 0 || info[i].fps < info[static_cast<size_t>(slowest)].fps) slowest = static_cast<int64_t>(i);
      }
    if (slow > 0)
      out.push_back(fmt::format(
          "{} of {} usable videos have a frame rate below data.fps ({}): their clips repeat source frames to make "
          "{} frames a second (the lowest: {:.4g} fps, '{}'); lower data.fps, or use data.frame_stride",
          slow, videos, data.fps, data.fps, info[static_cast<size_t>(slowest)].fps,
          items[static_cast<size_t>(slowest)].path));
  }
  int64_t as_stills = 0, first_still = -1;  // videos in a bucket of one frame
  for (size_t i = 0; i < info.size(); ++i)
    if (info[i].frames > 1 && buckets[static_cast<size_t>(info[i].bucket)].frames == 1 && as_stills++ == 0)
      first_still = static_cast<int64_t>(i);
  if (as_stills > 0)
    out.push_back(
        fmt::format("{} usable {} no bucket of more than one frame and {} trained on one frame, as a still (the first: "
                    "'{}', {} frames)",
                    as_stills, as_stills == 1 ? "video fits" : "videos fit", as_stills == 1 ? "is" : "are",
                    items[static_cast<size_t>(first_still)].path, info[static_cast<size_t>(first_still)].frames));
  std::map<std::string, int64_t> listings;  // path -> times listed
  int64_t repeats = 0;                      // items whose path an earlier item has
  std::string first_repeated;
  for (const auto& item : items)
    if (++listings[item.path] > 1 && repeats++ == 0) first_repeated = item.path;
  if (repeats > 0)
    out.push_back(fmt::format(
        "{} usable {} the path of an item listed before {} (the first: '{}', listed {} times): each listing is an "
        "item, trained as often as it is listed",
        repeats, repeats == 1 ? "item repeats" : "items repeat", repeats == 1 ? "it" : "them", first_repeated,
        listings[first_repeated]));
  return out;
}

std::string unlisted_images_notice(int64_t images) {
  return fmt::format(
      "{} {} in data.root {} no video's conditioning image and not trained: no bucket has one frame (add "
      "[1, height, width] to data.buckets to train images as stills)",
      images, images == 1 ? "image" : "images", images == 1 ? "is" : "are");
}

}  // namespace

std::vector<ClipShape> clip_buckets(const DataConfig& data) {
  std::vector<ClipShape> out;
  for (const auto& b : data.buckets) out.push_back({b[0], b[1], b[2]});
  if (out.empty()) out.push_back({data.frames, data.height, data.width});
  return out;
}

double augmentation_draw(uint64_t seed, int64_t item_index, int64_t epoch, int stream) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(item_index));
  h = splitmix64(h ^ static_cast<uint64_t>(epoch));
  h = splitmix64(h ^ static_cast<uint64_t>(stream));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);  // 53 bits
}

VideoDataset::VideoDataset(DataConfig data, std::vector<VideoItem> items, std::vector<VideoItemInfo> info,
                           std::vector<BadItem> bad, int64_t listed)
    : data_(std::move(data)),
      buckets_(clip_buckets(data_)),
      items_(std::move(items)),
      info_(std::move(info)),
      bad_(std::move(bad)),
      listed_(listed) {
  TORCH_CHECK(items_.size() == info_.size(), "VideoDataset: ", items_.size(), " items but ", info_.size(), " infos");
  for (const auto& i : info_)
    TORCH_CHECK(i.bucket >= 0 && i.bucket < static_cast<int64_t>(buckets_.size()), "VideoDataset: bucket ", i.bucket,
                " out of range");
}

VideoDataset VideoDataset::open(const DataConfig& data, int threads,
                                const std::function<void(int64_t, int64_t)>& on_progress, bool images) {
  VideoManifest manifest = read_video_manifest(data, images);
  const auto buckets = clip_buckets(data);
  const size_t n = manifest.items.size();
  std::vector<VideoItemInfo> info(n);
  std::vector<std::string> problem(n);
  std::atomic<size_t> next{0}, done{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) {
      const auto& item = manifest.items[i];
      try {
        if (!io::path_exists(item.path)) {
          problem[i] = "missing file";
        } else {
          const auto v = io::probe_video(item.path);
          auto& out = info[i];
          // The size it is shown at: a clip of anamorphic video (HDV's 1440x1080 of 4:3 pixels) is resized to its
          // shown aspect, as a player shows it.
          out.frames = v.frames, out.width = v.display_width, out.height = v.display_height, out.fps = v.fps;
          if (data.fps > 0 && v.fps <= 0 && v.frames != 1) {  // a still's rate does not matter
            problem[i] = "its frame rate is unknown (data.fps needs one)";
          } else if (v.frames <= 0) {
            problem[i] = "no frames";
          } else {
            const double step = frame_step(data, v.fps);
            out.bucket = nearest_bucket(buckets, out, step);
            if (out.bucket < 0 && v.frames == 1) {
              problem[i] = "one frame (a still image): only a bucket of 1 frame takes it (data.buckets)";
            } else if (out.bucket < 0) {
              int64_t needed = std::numeric_limits<int64_t>::max();
              for (const auto& b : buckets) needed = std::min(needed, frame_span(b.frames, step));
              problem[i] = fmt::format("too few frames ({}; the shortest clip spans {})", v.frames, needed);
            }
          }
        }
      } catch (const std::exception& e) {
        problem[i] = std::string("unreadable: ") + e.what();
      }
      ++done;
    }
  };
  const int workers = std::max(1, std::min<int>(threads, static_cast<int>(std::max<size_t>(n, 1))));
  if (on_progress) {
    // Probes on `workers` threads while the calling thread reports.
    std::vector<std::thread> pool;
    for (int t = 0; t < workers; ++t) pool.emplace_back(work);
    while (done.load() < n) {
      on_progress(static_cast<int64_t>(done.load()), static_cast<int64_t>(n));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    for (auto& t : pool) t.join();
    on_progress(static_cast<int64_t>(n), static_cast<int64_t>(n));
  } else {
    std::vector<std::thread> pool;
    for (int t = 1; t < workers; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  }

  const int64_t listed = manifest.listed();  // before its bad items move out of it
  std::vector<VideoItem> items;
  std::vector<VideoItemInfo> good;
  std::vector<BadItem> bad = std::move(manifest.bad);
  for (auto& b : bad) b.unlisted = true;
  for (size_t i = 0; i < n; ++i) {
    if (problem[i].empty()) {
      items.push_back(std::move(manifest.items[i]));
      good.push_back(info[i]);
    } else {
      bad.push_back({manifest.items[i].index, manifest.items[i].path, problem[i]});
    }
  }
  std::sort(bad.begin(), bad.end(), [](const BadItem& a, const BadItem& b) { return a.index < b.index; });
  auto notices = dataset_notices(data, items, good);
  if (manifest.unlisted_images > 0) notices.push_back(unlisted_images_notice(manifest.unlisted_images));
  VideoDataset dataset(data, std::move(items), std::move(good), std::move(bad), listed);
  dataset.notices_ = std::move(notices);
  dataset.unlisted_images_ = manifest.unlisted_images;
  return dataset;
}

ClipPlan VideoDataset::plan(int64_t i, int64_t epoch, int64_t frames) const {
  const auto& it = item(i);
  const auto& in = info(i);
  if (frames < 0) frames = in.frames;
  ClipPlan p;
  p.bucket = in.bucket;
  const auto& shape = buckets_[static_cast<size_t>(in.bucket)];
  const double step = frame_step(data_, in.fps);
  const int64_t span = frame_span(shape.frames, step);
  if (frames == 0)  // its probe promised frames, and none decodes
    throw DatasetError(
        fmt::format("video '{}': no frame decodes (its data is damaged or missing from the start)", it.path));
  if (span > frames)
    throw DatasetError(fmt::format("video '{}': too few frames ({}; its {}-frame clip spans {})", it.path, frames,
                                   shape.frames, span));
  const int64_t starts = frames - span + 1;
  const int64_t start =
      data_.clip_start == "center"
          ? (starts - 1) / 2
          : std::min<int64_t>(starts - 1, static_cast<int64_t>(augmentation_draw(data_.seed, it.index, epoch, 0) *
                                                               static_cast<double>(starts)));
  for (int64_t k = 0; k < shape.frames; ++k) p.frame_indices.push_back(start + source_index(k, step));
  // Scale so that the frame just covers the bucket (the shorter side relative to the bucket's aspect).
  const double scale = std::max(static_cast<double>(shape.height) / static_cast<double>(in.height),
                                static_cast<double>(shape.width) / static_cast<double>(in.width));
  p.resized_height = std::max(shape.height, static_cast<int64_t>(std::llround(static_cast<double>(in.height) * scale)));
  p.resized_width = std::max(shape.width, static_cast<int64_t>(std::llround(static_cast<double>(in.width) * scale)));
  const int64_t free_h = p.resized_height - shape.height, free_w = p.resized_width - shape.width;
  if (data_.crop == "center") {
    p.crop_top = free_h / 2, p.crop_left = free_w / 2;
  } else {
    p.crop_top = std::min(free_h, static_cast<int64_t>(augmentation_draw(data_.seed, it.index, epoch, 1) *
                                                       static_cast<double>(free_h + 1)));
    p.crop_left = std::min(free_w, static_cast<int64_t>(augmentation_draw(data_.seed, it.index, epoch, 2) *
                                                        static_cast<double>(free_w + 1)));
  }
  return p;
}

ClipPlan VideoDataset::load_plan(int64_t i, int64_t epoch, int64_t frames) const {
  ClipPlan p = plan(i, epoch, frames);
  const auto& in = info(i);
  auto& picks = p.frame_indices;
  if (data_.fps <= 0 || picks.size() < 2 || in.fps <= 0) return p;
  const double clip_seconds = static_cast<double>(picks.size() - 1) / data_.fps, period = 1.0 / in.fps;
  const int64_t start = picks.front();
  // The times of the frames the count's plan takes, of those the time's would take (from start's time to
  // clip_seconds after it, and the frame after), and no more than a clip's length beyond.
  auto times = io::presentation_times(item(i).path, picks.back(), clip_seconds);
  if (frames >= 0 && static_cast<int64_t>(times.size()) > frames) times.resize(static_cast<size_t>(frames));
  const auto n = static_cast<int64_t>(times.size());
  if (n <= picks.back()) return p;  // no times (the packets cannot say), or fewer frames than planned: load() re-plans
  const auto at = [&](int64_t j) { return times[static_cast<size_t>(j)]; };
  bool even = true;
  for (int64_t j = start; j <= picks.back() && even; ++j)
    even = std::abs(at(j) - at(start) - static_cast<double>(j - start) * period) <= 0.1 * period;
  if (even) return p;
  // Moved back until the clip's times end by the last frame's (when they do not, the times hold the whole stream).
  int64_t first = start;
  while (first > 0 && at(n - 1) - at(first) < clip_seconds - 1e-9) --first;
  for (int64_t k = 0; k < static_cast<int64_t>(picks.size()); ++k) {
    const double t = at(first) + static_cast<double>(k) / data_.fps;
    int64_t j = std::upper_bound(times.begin(), times.end(), t) - times.begin() - 1;  // the last frame at or before t
    // The nearer of j and j + 1, ties (within 2 % of their distance, for the times' rounding) to the later.
    if (j + 1 < n && t - at(j) >= 0.49 * (at(j + 1) - at(j))) ++j;
    picks[static_cast<size_t>(k)] = j;
  }
  return p;
}

torch::Tensor resize_and_crop(const torch::Tensor& frames, const ClipPlan& plan, const ClipShape& shape) {
  TORCH_CHECK(frames.dim() == 4 && frames.size(3) == 3 && frames.scalar_type() == torch::kUInt8,
              "resize_and_crop: expected [N, h, w, 3] uint8 frames, got ", frames.sizes());
  torch::Tensor resized = frames;
  if (frames.size(1) != plan.resized_height || frames.size(2) != plan.resized_width) {
    namespace F = torch::nn::functional;
    auto x = frames.permute({0, 3, 1, 2}).to(torch::kFloat32);
    x = F::interpolate(x, F::InterpolateFuncOptions()
                              .size(std::vector<int64_t>{plan.resized_height, plan.resized_width})
                              .mode(torch::kBilinear)
                              .align_corners(false)
                              .antialias(true));
    resized = x.round().clamp(0, 255).to(torch::kUInt8).permute({0, 2, 3, 1});
  }
  return resized.slice(1, plan.crop_top, plan.crop_top + shape.height)
      .slice(2, plan.crop_left, plan.crop_left + shape.width)
      .contiguous();
}

torch::Tensor VideoDataset::load(int64_t i, int64_t epoch) const {
  const auto& it = item(i);
  ClipPlan p = load_plan(i, epoch);
  int64_t decoded = 0;
  auto frames = io::read_video_frames(it.path, p.frame_indices, &decoded);
  if (!frames.defined()) {
    // The container promised more frames than the stream holds: plan again with the true count.
    p = load_plan(i, epoch, decoded);
    frames = io::read_video_frames(it.path, p.frame_indices, &decoded);
    if (!frames.defined())
      throw DatasetError(fmt::format("video '{}': decoding stopped after {} frames", it.path, decoded));
  }
  return resize_and_crop(frames, p, buckets_[static_cast<size_t>(p.bucket)]);
}

void VideoDataset::check_bad_fraction(const std::vector<BadItem>* all_bad) const {
  const auto& bad = all_bad != nullptr ? *all_bad : bad_;
  const auto bad_count = static_cast<int64_t>(bad.size());
  const double allowed = data_.max_bad_fraction * static_cast<double>(listed_);
  if (size() > 0 && static_cast<double>(bad_count) <= allowed) return;
  const std::string list = bad_item_list(bad);
  const std::string source = data_.manifest.empty() ? data_.root : data_.manifest;
  if (size() == 0)
    throw DatasetError(fmt::format("dataset '{}': no usable video among {} listed{}{}", source, listed_, list,
                                   unlisted_images_ > 0 ? "\n" + unlisted_images_notice(unlisted_images_) : ""));
  throw DatasetError(fmt::format("dataset '{}': {} of {} items are bad, more than data.max_bad_fraction ({}) allows:{}",
                                 source, bad_count, listed_, data_.max_bad_fraction, list));
}

}  // namespace megaslide
