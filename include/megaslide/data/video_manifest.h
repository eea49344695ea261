// The item list of a video dataset, read from the layouts users already have (docs/data.md):
//
//   CSV with a header row (RFC 4180: quoted fields, "" inside quotes, CRLF or LF; a UTF-8 BOM is skipped)
//     WebVid:    videoid, name, page_dir, ... — the file is data.video_path_template with each {column}
//                replaced by the row's value ("{page_dir}/{videoid}.mp4"); the caption is `name`
//     Open-Sora: path, text[, num_frames, height, width, fps, ...] — the caption is `text`
//     either may add an `image` column (or `image_path`; `image` wins when both are there): the clip's
//     conditioning image for image-to-video training, an empty cell for none
//   JSONL       one {"video": PATH, "caption": TEXT[, "image": PATH]} object per line (blank lines skipped);
//               "image_path" is accepted for "image"; null or "" is no image
//   a folder    data.root: every video file under it (.mp4 .mov .mkv .webm .avi .m4v, sub-folders
//               included, sorted by path) with its caption in a same-stem .txt file beside it and, when
//               there is one, its image in a same-stem .png, .jpg, .jpeg or .webp (the first found in that
//               order; each extension in lower case, then upper case, then any other spelling). When a bucket has one
//               frame (has_still_bucket), every other image (.png .jpg .jpeg .webp, any case) is an item too, a still,
//               sorted among the videos, with its caption found as a video's
//
// Relative paths resolve against the manifest's folder (data.root for the folder layout). Items keep the
// order of the listing. A listed item that cannot be used — a row without a file or a caption, a JSONL
// line that is not an object with both strings (or whose image is not a string), a video without its
// .txt, an image that does not exist — is a bad item (with the reason), not an error: the dataset decides
// what bad items cost (video_dataset.h). Only a manifest that cannot be read or whose header matches no
// layout is a DatasetError.
//
// Whether a listed video exists is left to the dataset's probe (VideoDataset::open opens every video
// anyway); a listed image is checked here, since nothing opens it before training would.
//
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/util/errors.h"

namespace megaslide {

// A dataset that cannot be used (bad manifest, too many bad items, a stale cache); what() names the file
// and the problem.
class DatasetError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

struct VideoItem {
  int64_t index = 0;  // position in the listing (bad items included): the key of its augmentation draws
  std::string path;   // the video file, resolved
  std::string caption;
  std::string where;  // where it was listed: "data/train.csv:12", "videos/a.mp4"
  std::string image;  // the conditioning image, resolved and known to exist; "" when the listing names none
};

struct BadItem {
  int64_t index = 0;
  std::string path;  // the video file, or the listing line when there is no file
  std::string reason;
  bool unlisted = false;  // the listing could not use it (no caption, no path), before any probe (VideoDataset)
};

// Bad items for a one-line error: " 'PATH': REASON; 'PATH': REASON ..." (quoted: a path's own spaces stay
// readable), the first `max` of them and how many more.
std::string bad_item_list(const std::vector<BadItem>& bad, size_t max = 50);

struct VideoManifest {
  std::string layout;  // "webvid-csv", "opensora-csv", "jsonl" or "folder"
  std::string source;  // the manifest file or the root folder
  std::vector<VideoItem> items;
  std::vector<BadItem> bad;
  int64_t unlisted_images = 0;  // a folder's images that would be stills, not listed: no bucket has one frame
  int64_t listed() const { return static_cast<int64_t>(items.size() + bad.size()); }
};

// Whether `data` trains stills: a bucket (data.buckets, or data.frames × height × width) of one frame.
bool has_still_bucket(const DataConfig& data);

// Reads data.manifest (.csv or .jsonl, by extension) or lists data.root. `images`: read each item's own
// conditioning image (image-to-video); otherwise image columns, keys and files are ignored (never checked).
// Throws DatasetError.
VideoManifest read_video_manifest(const DataConfig& data, bool images = false);

// Parses CSV text into rows of fields (exposed for tests). Throws DatasetError naming `source` and the
// line of an unterminated quote.
std::vector<std::vector<std::string>> parse_csv(const std::string& text, const std::string& source);

}  // namespace megaslide
