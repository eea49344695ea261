// A dataset of real videos (data.dataset: videos, docs/data.md): the items of a manifest
// (video_manifest.h), probed, put into buckets, decoded into training clips.
//
// Opening reads the manifest and probes every listed file (its header only, on `threads` threads): a
// missing or unreadable file, one without a video stream, or one with too few frames for every bucket is
// a bad item, kept with its reason. Each usable item goes to its nearest bucket (data.buckets, or the one
// bucket data.frames × data.height × data.width): among the buckets whose frame span fits the item, the
// one whose aspect ratio is closest (|log(h/w) difference|), then the one with more frames, then the
// larger, then the first. An item of one frame (a still image, read as a one-frame video) fits only a bucket of
// one frame; a video goes to one only when no longer bucket fits it.
//
// A clip of item i in epoch e (plan(), load()):
//   frames   data.frames (the bucket's) source frames, every data.frame_stride-th, or at data.fps (frame k
//            of the clip is source frame start + round(k · source_fps / data.fps)); the start is centred
//            (data.clip_start: center) or drawn uniformly among the starts that fit (random)
//   resize   the frame scaled (antialiased bilinear, aspect kept) so that it just covers the bucket's
//            height × width, rounded to uint8 (as image pipelines store frames)
//   crop     height × width, centred (data.crop: center) or at a uniform offset (random)
// Draws are a pure function of (data.seed, the item's listing index, e): no generator state, any item in
// any order on any thread, the same on a resumed run. Frames come back as [T, H, W, 3] uint8 RGB (the
// trainers map them to [-1, 1]).
//
// Thread-safety: after construction every const method may run concurrently.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/data/video_manifest.h"

namespace megaslide {

struct ClipShape {
  int64_t frames = 0, height = 0, width = 0;
  bool operator==(const ClipShape& o) const { return frames == o.frames && height == o.height && width == o.width; }
};

// What probing found out about a usable item.
struct VideoItemInfo {
  int64_t frames = 0;             // as probe_video states it (a decode that finds fewer re-plans, see load())
  int64_t width = 0, height = 0;  // as shown: upright, anamorphic pixels stretched (io::VideoInfo::display_width)
  double fps = 0.0;
  int64_t bucket = 0;
};

// The source frames and the crop of one clip.
struct ClipPlan {
  int64_t bucket = 0;
  std::vector<int64_t> frame_indices;  // source frames, in clip order
  int64_t resized_height = 0, resized_width = 0;
  int64_t crop_top = 0, crop_left = 0;
};

// The buckets of a config: data.buckets, or the one bucket data.frames × data.height × data.width.
std::vector<ClipShape> clip_buckets(const DataConfig& data);

// The uniform draw number `stream` of (seed, item, epoch) in [0, 1): splitmix64 over the four.
double augmentation_draw(uint64_t seed, int64_t item_index, int64_t epoch, int stream);

class VideoDataset {
 public:
  // Reads the manifest and probes every item on `threads` threads (>= 1). `on_progress(done, total)` is
  // called from the calling thread as probes finish. `images`: the items' own conditioning images are read
  // from the listing (image-to-video; read_video_manifest). Throws DatasetError for a bad manifest.
  static VideoDataset open(const DataConfig& data, int threads = 1,
                           const std::function<void(int64_t, int64_t)>& on_progress = {}, bool images = false);
  // From items already probed (a cache's manifest): nothing is read.
  VideoDataset(DataConfig data, std::vector<VideoItem> items, std::vector<VideoItemInfo> info, std::vector<BadItem> bad,
               int64_t listed);

  int64_t size() const { return static_cast<int64_t>(items_.size()); }  // usable items
  int64_t listed() const { return listed_; }                            // usable + bad
  const VideoItem& item(int64_t i) const { return items_.at(static_cast<size_t>(i)); }
  const VideoItemInfo& info(int64_t i) const { return info_.at(static_cast<size_t>(i)); }
  const std::vector<ClipShape>& buckets() const { return buckets_; }
  const std::vector<BadItem>& bad() const { return bad_; }  // found when listing and probing
  // What the usable items will do that a listing's author may not expect, one line each (logged as warnings):
  // videos whose frame rate is below data.fps (their clips repeat source frames), videos that fit only a bucket of
  // one frame (trained as stills), paths listed more than once (each listing is an item, trained as often as it
  // is listed), and a folder's images left out for want of a bucket of one frame. Empty for a dataset built from a
  // cache's manifest.
  const std::vector<std::string>& notices() const { return notices_; }
  const DataConfig& config() const { return data_; }

  // The plan of item i's clip in `epoch`, for a video of `frames` frames (default: the probed count).
  // Throws DatasetError when the video is too short for the bucket.
  ClipPlan plan(int64_t i, int64_t epoch, int64_t frames = -1) const;
  // The plan load() follows: plan()'s, except that with data.fps a clip whose source frames are not evenly spaced
  // in time at the stream's average rate (a variable frame rate: phones in low light, screen recordings) takes
  // the frame shown nearest to each of its times (io::presentation_times): the first frame's time plus k /
  // data.fps for clip frame k, ties going to the later frame; when those times run past the stream's last frame,
  // the start moves back until they fit (to the first frame when the whole stream is shorter: its last frame
  // then repeats). Evenly spaced frames (within a tenth of a frame's period) keep plan()'s frames; so do files
  // whose packets cannot give the times.
  ClipPlan load_plan(int64_t i, int64_t epoch, int64_t frames = -1) const;
  // Decodes and crops item i's clip for `epoch` (load_plan's): [T, H, W, 3] uint8. When the stream turns out
  // shorter than probed, plans again with the decoded count (the same draws). Throws io::VideoError or
  // DatasetError when the item is bad (unreadable, too few frames).
  torch::Tensor load(int64_t i, int64_t epoch) const;

  // Throws DatasetError listing every bad item when they exceed data.max_bad_fraction of the listed
  // items, or when no item is usable. The bad items are those of the listing (bad()), or `all_bad`
  // when given: the listing's and those found later, decoding (megaslide-cache).
  void check_bad_fraction(const std::vector<BadItem>* all_bad = nullptr) const;

 private:
  DataConfig data_;
  std::vector<ClipShape> buckets_;
  std::vector<VideoItem> items_;
  std::vector<VideoItemInfo> info_;
  std::vector<BadItem> bad_;
  int64_t listed_ = 0;
  std::vector<std::string> notices_;
  int64_t unlisted_images_ = 0;  // VideoManifest::unlisted_images
};

// Resize (antialiased bilinear, aspect kept, covering height × width) and crop of decoded frames
// [N, h, w, 3] uint8 as a plan says: [N, H, W, 3] uint8.
torch::Tensor resize_and_crop(const torch::Tensor& frames, const ClipPlan& plan, const ClipShape& shape);

}  // namespace megaslide
