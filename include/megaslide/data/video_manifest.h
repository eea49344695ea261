// The item list of a video dataset, read from the layouts users already have (docs/data.md):
//
//   CSV with a header row (RFC 4180: quoted fields, "" inside quotes, CRLF or LF; a UTF-8 BOM is skipped)
//     WebVid:    videoid, name, page_dir, ... — the file is data.video_path_template with each {column}
//                replaced by the row's value ("{page_dir}/{videoid}.mp4"); the caption is `name`
//     Open-Sora: path, text[, num_frames, height, width, fps, ...] — the caption is `text`
//   JSONL       one {"video": PATH, "caption": TEXT} object per line (blank lines skipped)
//   a folder    data.root: every video file under it (.mp4 .mov .mkv .webm .avi .m4v, sub-folders
//               included, sorted by path) with its caption in a same-stem .txt file beside it
//
// Relative paths resolve against the manifest's folder (data.root for the folder layout). Items keep the
// order of the listing. A listed item that cannot be used — a row without a file or a caption, a JSONL
// line that is not an object with both strings, a video without its .txt — is a bad item (with the
// reason), not an error: the dataset decides what bad items cost (video_dataset.h). Only a manifest that
// cannot be read or whose header matches no layout is a DatasetError.
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
};

struct BadItem {
  int64_t index = 0;
  std::string path;  // the video file, or the listing line when there is no file
  std::string reason;
};

struct VideoManifest {
  std::string layout;  // "webvid-csv", "opensora-csv", "jsonl" or "folder"
  std::string source;  // the manifest file or the root folder
  std::vector<VideoItem> items;
  std::vector<BadItem> bad;
  int64_t listed() const { return static_cast<int64_t>(items.size() + bad.size()); }
};

// Reads data.manifest (.csv or .jsonl, by extension) or lists data.root. Throws DatasetError.
VideoManifest read_video_manifest(const DataConfig& data);

// Parses CSV text into rows of fields (exposed for tests). Throws DatasetError naming `source` and the
// line of an unterminated quote.
std::vector<std::vector<std::string>> parse_csv(const std::string& text, const std::string& source);

}  // namespace megaslide
