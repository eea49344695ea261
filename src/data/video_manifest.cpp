#include "megaslide/data/video_manifest.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <set>

#include "megaslide/io/files.h"
#include "util/utf8.h"

namespace megaslide {

namespace {

struct CsvRow {
  int64_t line = 0;  // 1-based line where the row starts
  std::vector<std::string> fields;
};

std::vector<CsvRow> csv_rows(const std::string& text, const std::string& source) {
  std::vector<CsvRow> rows;
  size_t i = 0;
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) i = 3;  // UTF-8 byte-order mark
  int64_t line = 1;
  CsvRow row;
  row.line = 1;
  std::string field;
  bool quoted = false, field_started = false, row_started = false;
  int64_t quote_line = 0;
  auto end_field = [&] {
    row.fields.push_back(field);
    field.clear();
    field_started = false;
  };
  auto end_row = [&] {
    end_field();
    // A blank line is no row.
    if (!(row.fields.size() == 1 && row.fields[0].empty())) rows.push_back(row);
    row = CsvRow{};
    row_started = false;
  };
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (!row_started) {
      row.line = line;
      row_started = true;
    }
    if (quoted) {
      if (c == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          field += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        if (c == '\n') ++line;
        field += c;
      }
      continue;
    }
    if (c == '"' && !field_started) {
      quoted = true;
      field_started = true;
      quote_line = line;
    } else if (c == ',') {
      end_field();
    } else if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') {
      // CRLF: the \n ends the row
    } else if (c == '\n') {
      end_row();
      ++line;
    } else {
      field += c;
      field_started = true;
    }
  }
  if (quoted) throw DatasetError(source + ": line " + std::to_string(quote_line) + ": a quoted field is never closed");
  if (row_started) end_row();
  return rows;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string parent_folder(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// A listed path against the manifest's folder (absolute), "." and ".." taken out (io::absolute_path): one file has
// one spelling, for the cache and for the paths listed twice.
std::string resolve(const std::string& base, const std::string& path) {
  if (path.empty()) return path;
  return io::absolute_path(path[0] == '/' ? path : io::join_path(base, path));
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Why a named image makes its item a bad one (it is not a file), naming the image and the line that listed
// it; "" when the image is there or none is named.
std::string missing_image(const std::string& image, const std::string& where) {
  if (image.empty() || (io::path_exists(image) && !io::is_directory(image))) return "";
  return "its image " + image + " does not exist (" + where + ")";
}

// {column} -> the row's value; an unknown column or an unclosed brace is a DatasetError.
std::string fill_template(const std::string& tmpl, const std::map<std::string, size_t>& columns,
                          const std::vector<std::string>& fields, const std::string& source) {
  std::string out;
  for (size_t i = 0; i < tmpl.size(); ++i) {
    if (tmpl[i] != '{') {
      out += tmpl[i];
      continue;
    }
    const auto close = tmpl.find('}', i);
    if (close == std::string::npos)
      throw DatasetError(source + ": data.video_path_template '" + tmpl + "' has an unclosed '{'");
    const std::string name = lower(tmpl.substr(i + 1, close - i - 1));
    auto it = columns.find(name);
    if (it == columns.end())
      throw DatasetError(source + ": data.video_path_template '" + tmpl + "' names column '" + name +
                         "', which the header does not have");
    out += it->second < fields.size() ? trim(fields[it->second]) : std::string();
    i = close;
  }
  return out;
}

VideoManifest read_csv(const DataConfig& data, bool images) {
  VideoManifest m;
  m.source = data.manifest;
  const auto rows = csv_rows(io::read_file(data.manifest), data.manifest);
  if (rows.empty()) throw DatasetError(data.manifest + ": empty (expected a header row and one row per video)");
  std::map<std::string, size_t> columns;
  for (size_t c = 0; c < rows[0].fields.size(); ++c) columns.emplace(lower(trim(rows[0].fields[c])), c);
  const bool webvid = columns.count("videoid") && columns.count("name");
  const bool opensora = columns.count("path") && columns.count("text");
  if (!webvid && !opensora) {
    std::string header;
    for (const auto& f : rows[0].fields) header += (header.empty() ? "" : ", ") + f;
    throw DatasetError(
        data.manifest + ": line 1: the header (" + header +
        ") matches no layout: expected WebVid's (videoid, name, page_dir, ...) or Open-Sora's (path, text, ...)");
  }
  m.layout = opensora ? "opensora-csv" : "webvid-csv";
  const std::string base = parent_folder(data.manifest);
  const size_t caption_col = opensora ? columns["text"] : columns["name"];
  const auto image_col = !images                  ? columns.end()
                         : columns.count("image") ? columns.find("image")
                                                  : columns.find("image_path");
  for (size_t r = 1; r < rows.size(); ++r) {
    const auto& fields = rows[r].fields;
    const int64_t index = m.listed();
    const std::string where = data.manifest + ":" + std::to_string(rows[r].line);
    if (fields.size() != rows[0].fields.size()) {
      m.bad.push_back({index, where,
                       "has " + std::to_string(fields.size()) + " fields, the header has " +
                           std::to_string(rows[0].fields.size())});
      continue;
    }
    const std::string file = opensora ? trim(fields[columns["path"]])
                                      : fill_template(data.video_path_template, columns, fields, data.manifest);
    const std::string caption = trim(fields[caption_col]);
    const std::string image = image_col == columns.end() ? "" : resolve(base, trim(fields[image_col->second]));
    if (file.empty()) {
      m.bad.push_back({index, where, "no video path"});
    } else if (caption.empty()) {
      m.bad.push_back({index, resolve(base, file), "missing caption (" + where + ")"});
    } else if (const auto problem = missing_image(image, where); !problem.empty()) {
      m.bad.push_back({index, resolve(base, file), problem});
    } else {
      m.items.push_back({index, resolve(base, file), caption, where, image});
    }
  }
  return m;
}

VideoManifest read_jsonl(const DataConfig& data, bool images) {
  VideoManifest m;
  m.layout = "jsonl";
  m.source = data.manifest;
  const std::string text = io::read_file(data.manifest);
  // One JSON array of objects (a .json file) is not JSON Lines: said once, not as every line's bad item.
  const size_t first = text.find_first_not_of(" \t\r\n\xef\xbb\xbf");
  if (first != std::string::npos && text[first] == '[')
    throw DatasetError("data.manifest '" + data.manifest +
                       "': is a JSON array; a manifest is JSON Lines, one object per line ({\"video\": ..., "
                       "\"caption\": ...}): write each element on a line of its own");
  const std::string base = parent_folder(data.manifest);
  size_t pos = 0;
  int64_t line = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string content = trim(text.substr(pos, end - pos));
    pos = end + 1;
    ++line;
    if (content.empty()) continue;
    const int64_t index = m.listed();
    const std::string where = data.manifest + ":" + std::to_string(line);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(content);
    } catch (const nlohmann::json::exception&) {
      m.bad.push_back({index, where, "not valid JSON"});
      continue;
    }
    if (!j.is_object() || !j.contains("video") || !j["video"].is_string() || j["video"].get<std::string>().empty()) {
      m.bad.push_back({index, where, "expected an object with a \"video\" path (string)"});
      continue;
    }
    const std::string file = resolve(base, j["video"].get<std::string>());
    if (j.contains("caption") && !j["caption"].is_string() && !j["caption"].is_null()) {
      m.bad.push_back(
          {index, file, "\"caption\" is " + std::string(j["caption"].type_name()) + ", expected text (" + where + ")"});
      continue;
    }
    if (!j.contains("caption") || j["caption"].is_null() || trim(j["caption"].get<std::string>()).empty()) {
      m.bad.push_back({index, file, "missing caption (" + where + ")"});
      continue;
    }
    const char* image_key = j.contains("image") ? "image" : "image_path";
    std::string image;
    if (images && j.contains(image_key) && !j[image_key].is_null()) {
      if (!j[image_key].is_string()) {
        m.bad.push_back({index, file,
                         fmt::format("\"{}\" must be an image path (string), got {} ({})", image_key,
                                     j[image_key].type_name(), where)});
        continue;
      }
      image = resolve(base, j[image_key].get<std::string>());
    }
    if (const auto problem = missing_image(image, where); !problem.empty()) {
      m.bad.push_back({index, file, problem});
      continue;
    }
    m.items.push_back({index, file, trim(j["caption"].get<std::string>()), where, image});
  }
  return m;
}

bool has_extension(const std::string& name, std::initializer_list<const char*> extensions) {
  const std::string l = lower(name);
  return std::any_of(extensions.begin(), extensions.end(), [&](const char* e) { return ends_with(l, e); });
}

bool is_video_file(const std::string& name) {
  return has_extension(name, {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".ts", ".mts", ".m2ts", ".mpg", ".mpeg",
                              ".3gp", ".flv", ".wmv"});
}

bool is_image_file(const std::string& name) { return has_extension(name, {".png", ".jpg", ".jpeg", ".webp"}); }

std::string stem_of(const std::string& name) { return name.substr(0, name.find_last_of('.')); }

// The rank of an image extension as a video's conditioning image: .png, .jpg, .jpeg, .webp in that order, each in
// lower case, then upper case, then any other spelling (a camera's .Jpg); -1 for no image.
int image_rank(const std::string& name) {
  const std::string ext = name.substr(std::min(name.find_last_of('.'), name.size())), l = lower(ext);
  const bool upper =
      std::none_of(ext.begin(), ext.end(), [](char c) { return std::islower(static_cast<unsigned char>(c)); });
  static const char* kOrder[] = {".png", ".jpg", ".jpeg", ".webp"};
  for (int k = 0; k < 4; ++k)
    if (l == kOrder[k]) return 3 * k + (ext == l ? 0 : upper ? 1 : 2);
  return -1;
}

// The videos under `folder`, recursively, each with its conditioning image (the same stem's image of the lowest
// image_rank, a full path, in `image_of` by the video's relative path), and with `stills` the images that are no
// video's (else counted in `unlisted_images`). Each real folder is listed once, however many links lead to it
// (`visited`: device and inode): a link back to an ancestor (`loop -> .`) would list every video again at each
// level, and two such links without end.
void list_videos(const std::string& folder, const std::string& relative, bool stills, std::vector<std::string>& out,
                 std::map<std::string, std::string>& image_of, int64_t& unlisted_images,
                 std::set<std::pair<dev_t, ino_t>>& visited) {
  struct stat st {};
  if (::stat(folder.c_str(), &st) != 0 || !visited.insert({st.st_dev, st.st_ino}).second) return;
  const auto names = io::list_directory(folder);
  std::map<std::string, std::string> best_image;  // stem -> its image of the lowest rank
  for (const auto& name : names)
    if (!name.empty() && name[0] != '.' && is_image_file(name) && !io::is_directory(io::join_path(folder, name))) {
      auto& best = best_image[stem_of(name)];
      if (best.empty() || image_rank(name) < image_rank(best)) best = name;
    }
  std::set<std::string> video_stems;  // an image of one of these stems is that video's
  for (const auto& name : names)
    if (is_video_file(name)) video_stems.insert(stem_of(name));
  for (const auto& name : names) {
    if (name.empty() || name[0] == '.') continue;
    const std::string path = io::join_path(folder, name), rel = relative.empty() ? name : relative + "/" + name;
    if (io::is_directory(path)) {
      list_videos(path, rel, stills, out, image_of, unlisted_images, visited);
    } else if (is_video_file(name)) {
      out.push_back(rel);
      if (auto it = best_image.find(stem_of(name)); it != best_image.end())
        image_of[rel] = io::join_path(folder, it->second);
    } else if (is_image_file(name) && video_stems.count(stem_of(name)) == 0) {
      if (stills) out.push_back(rel);
      else ++unlisted_images;
    }
  }
}

// Items whose path, caption or image is not UTF-8 text become bad items (the cache's manifest, logs and
// checkpoints store them as UTF-8): skipped and reported like any unreadable item, not a failed run.
void move_non_utf8_items_to_bad(VideoManifest& m) {
  for (auto& b : m.bad) {  // already bad (a missing caption, say): named in UTF-8 all the same
    b.path = utf8::escaped(b.path);
    b.reason = utf8::escaped(b.reason);
  }
  std::vector<VideoItem> kept;
  for (auto& item : m.items) {
    const std::pair<const char*, const std::string*> texts[] = {
        {"file name", &item.path}, {"caption", &item.caption}, {"image's file name", &item.image}};
    const char* what = nullptr;
    size_t offset = std::string::npos;
    unsigned char byte = 0;
    for (const auto& [name, text] : texts) {
      offset = utf8::first_invalid(*text);
      if (offset != std::string::npos) {
        what = name;
        byte = static_cast<unsigned char>((*text)[offset]);
        break;
      }
    }
    // NUL bytes are valid UTF-8 but no caption's: UTF-16 text without a byte-order mark reads as ASCII and NULs.
    if (what == nullptr && item.caption.find('\0') != std::string::npos) {
      m.bad.push_back({item.index, utf8::escaped(item.path),
                       fmt::format("its caption holds a NUL byte (at offset {}): UTF-16 text without a byte-order "
                                   "mark? Captions are UTF-8",
                                   item.caption.find('\0'))});
      continue;
    }
    if (what == nullptr) {
      kept.push_back(std::move(item));
      continue;
    }
    // A UTF-16 byte-order mark (FF FE or FE FF) starts the text: said, as UTF-16 without one is above.
    const bool utf16 = offset == 0 && (byte == 0xff || byte == 0xfe) && std::string(what) == "caption" &&
                       item.caption.size() >= 2 && static_cast<unsigned char>(item.caption[1]) == (byte ^ 0x01);
    m.bad.push_back({item.index, utf8::escaped(item.path),
                     fmt::format("its {} is not UTF-8 text (byte 0x{:02x} at offset {}){}", what, byte, offset,
                                 utf16 ? ": UTF-16 text (its byte-order mark)? Captions are UTF-8" : "")});
  }
  m.items = std::move(kept);
  std::sort(m.bad.begin(), m.bad.end(), [](const BadItem& a, const BadItem& b) { return a.index < b.index; });
}

VideoManifest read_folder(const DataConfig& data, bool images) {
  VideoManifest m;
  m.layout = "folder";
  m.source = data.root;
  if (!io::is_directory(data.root)) throw DatasetError("data.root '" + data.root + "' is not a folder");
  std::vector<std::string> videos;
  std::set<std::pair<dev_t, ino_t>> visited;
  std::map<std::string, std::string> image_of;
  list_videos(data.root, "", has_still_bucket(data), videos, image_of, m.unlisted_images, visited);
  std::sort(videos.begin(), videos.end());
  for (const auto& rel : videos) {
    const int64_t index = m.listed();
    const std::string path = io::join_path(data.root, rel);
    // The caption: the same stem's .txt (or a camera's upper-case .TXT), else the video's whole name + .txt
    // (clip.mp4.txt, as some captioning tools write it).
    const std::string stem = path.substr(0, path.find_last_of('.'));
    std::string caption_path;
    for (const auto& candidate : {stem + ".txt", stem + ".TXT", path + ".txt"})
      if (caption_path.empty() && io::path_exists(candidate)) caption_path = candidate;
    if (caption_path.empty()) {
      m.bad.push_back({index, path, "missing caption (no " + stem + ".txt, nor .TXT, nor " + path + ".txt)"});
      continue;
    }
    std::string caption;
    try {
      caption = io::read_file(caption_path);
      if (caption.compare(0, 3, "\xEF\xBB\xBF") == 0) caption.erase(0, 3);  // UTF-8 byte-order mark (Notepad's)
      caption = trim(caption);
    } catch (const io::IoError& e) {
      m.bad.push_back({index, path, std::string("caption unreadable: ") + e.what()});
      continue;
    }
    if (caption.empty()) {
      m.bad.push_back({index, path, "missing caption (" + caption_path + " is empty)"});
      continue;
    }
    // (A still is no video: image_of has no image for it.)
    const auto image = images ? image_of.find(rel) : image_of.end();
    m.items.push_back({index, path, caption, rel, image != image_of.end() ? image->second : std::string()});
  }
  return m;
}

}  // namespace

std::string bad_item_list(const std::vector<BadItem>& bad, size_t max) {
  std::string out;
  for (size_t i = 0; i < bad.size() && i < max; ++i)
    out += fmt::format("{}'{}': {}", i == 0 ? " " : "; ", bad[i].path, bad[i].reason);
  if (bad.size() > max) out += fmt::format("; ... and {} more", bad.size() - max);
  return out;
}

std::vector<std::vector<std::string>> parse_csv(const std::string& text, const std::string& source) {
  std::vector<std::vector<std::string>> out;
  for (auto& row : csv_rows(text, source)) out.push_back(std::move(row.fields));
  return out;
}

bool has_still_bucket(const DataConfig& data) {
  if (data.buckets.empty()) return data.frames == 1;
  return std::any_of(data.buckets.begin(), data.buckets.end(), [](const auto& b) { return b[0] == 1; });
}

namespace {
VideoManifest read_any_layout(const DataConfig& data, bool images) {
  try {
    if (!data.manifest.empty()) {
      if (!io::path_exists(data.manifest)) throw DatasetError("data.manifest '" + data.manifest + "' does not exist");
      const std::string l = lower(data.manifest);
      if (ends_with(l, ".csv")) return read_csv(data, images);
      if (ends_with(l, ".jsonl") || ends_with(l, ".json")) return read_jsonl(data, images);
      throw DatasetError("data.manifest '" + data.manifest + "': expected a .csv or .jsonl file");
    }
    if (!data.root.empty()) return read_folder(data, images);
  } catch (const io::IoError& e) {
    throw DatasetError(e.what());
  }
  throw DatasetError("data.dataset: videos needs data.manifest or data.root");
}
}  // namespace

VideoManifest read_video_manifest(const DataConfig& data, bool images) {
  // From the root: the same files are the same items (and the same cache) whichever working directory or
  // spelling named them.
  DataConfig absolute = data;
  absolute.root = io::absolute_path(data.root);
  absolute.manifest = io::absolute_path(data.manifest);
  VideoManifest m = read_any_layout(absolute, images);
  move_non_utf8_items_to_bad(m);
  return m;
}

}  // namespace megaslide
