#include "megaslide/io/vbench_layout.h"

#include <dirent.h>
#include <sys/stat.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <type_traits>
#include <utility>

#include "megaslide/io/files.h"

namespace megaslide::io {

namespace {
std::string trim(const std::string& s) {
  const char* ws = " \t\r\n\v\f";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}
}  // namespace

static size_t utf8_error_offset(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return i;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (b & 0x3F);
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF are not UTF-8 either.
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return i;
    i += n;
  }
  return std::string::npos;
}

namespace {
// A prompt file's non-blank lines, trimmed, with their line numbers; refused as read_prompt_file says.
std::vector<std::pair<int64_t, std::string>> read_prompt_lines(const std::string& path) {
  // A prompt file is text: VBench's largest is ~100 kB. The cap refuses a wrong file before it fills memory.
  constexpr uint64_t kMaxPromptFileBytes = uint64_t{64} << 20;
  std::string text;
  try {
    text = io::read_input_file(path, kMaxPromptFileBytes, /*allow_pipe=*/true);
  } catch (const io::IoError& e) {
    throw std::runtime_error(std::string("prompt file: ") + e.what());
  }
  // A byte-order mark (editors on Windows write one) is not part of the first prompt.
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);
  std::vector<std::pair<int64_t, std::string>> out;
  std::istringstream lines(text);
  std::string line;
  int64_t line_number = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    // Refused here, before any work: a prompt is written into index.json (JSON is UTF-8) and into a
    // file name, and a guess at the encoding would put a different prompt there than the one given.
    if (const size_t bad = utf8_error_offset(line); bad != std::string::npos)
      throw std::runtime_error(
          fmt::format("prompt file '{}' line {}: not valid UTF-8 (byte 0x{:02X} at byte {} of the line); save the "
                      "file as UTF-8",
                      path, line_number, static_cast<unsigned char>(line[bad]), bad + 1));
    // Control characters (NUL: a binary file, or UTF-16) are no prompt's; a tab and the line's '\r' are white space.
    if (const auto control = std::find_if(line.begin(), line.end(),
                                          [](char c) {
                                            const auto u = static_cast<unsigned char>(c);
                                            return (u < 0x20 && c != '\t' && c != '\r') || u == 0x7F;
                                          });
        control != line.end())
      throw std::runtime_error(fmt::format(
          "prompt file '{}' line {}: holds the control character 0x{:02X} at byte {} of the line (not a text file, "
          "or not UTF-8: UTF-16 holds NUL bytes); save the file as UTF-8 text",
          path, line_number, static_cast<unsigned char>(*control), control - line.begin() + 1));
    auto p = trim(line);
    if (!p.empty()) out.emplace_back(line_number, std::move(p));
  }
  return out;
}

// The settings of a prompt line: " --X " with X one of these letters.
constexpr std::string_view kSettings = "whfdsgni";

// Where the next setting of `line` starts at or after `from` (the position of its " --"), or npos.
size_t next_setting(const std::string& line, size_t from, char& letter) {
  for (size_t at = line.find(" --", from); at != std::string::npos; at = line.find(" --", at + 1)) {
    size_t end = at + 3;
    while (end < line.size() && std::isalpha(static_cast<unsigned char>(line[end]))) ++end;
    if (end == at + 3 || (end < line.size() && line[end] != ' ' && line[end] != '\t'))
      continue;  // "a -- b", "--x=1": prompt text
    letter = end == at + 4 ? line[at + 3] : '?';
    return at;
  }
  return std::string::npos;
}

template <typename T>
T setting_number(const std::string& value, const std::string& where, char letter, T low, T high) {
  const auto fail = [&]() -> T {
    throw std::runtime_error(fmt::format("{}: --{} '{}' is not {} from {} to {}", where, letter, value,
                                         std::is_integral_v<T> ? "a whole number" : "a number", low, high));
  };
  if (value.empty()) fail();
  size_t used = 0;
  T v{};
  try {
    if constexpr (std::is_integral_v<T>) {
      if (value[0] == '-' || value[0] == '+') fail();
      const unsigned long long u = std::stoull(value, &used);  // out of its range: std::out_of_range
      if (u > static_cast<unsigned long long>(high)) fail();
      v = static_cast<T>(u);
    } else {
      v = static_cast<T>(std::stod(value, &used));
    }
  } catch (const std::logic_error&) {
    fail();
  }
  if (used != value.size() || !(v >= low && v <= high)) fail();
  return v;
}
}  // namespace

std::vector<std::string> read_prompt_file(const std::string& path) {
  std::vector<std::string> prompts;
  std::set<std::string> seen;
  for (auto& [line, p] : read_prompt_lines(path))
    if (seen.insert(p).second) prompts.push_back(std::move(p));
  if (prompts.empty())
    throw std::runtime_error("prompt file '" + path + "' holds no prompt (one prompt per line expected)");
  return prompts;
}

PromptSpec parse_prompt_spec(const std::string& line, const std::string& where) {
  PromptSpec spec;
  char letter = 0;
  size_t at = next_setting(line, 0, letter);
  spec.prompt = trim(line.substr(0, at));
  if (spec.prompt.empty()) throw std::runtime_error(fmt::format("{}: settings but no prompt before them", where));
  std::string seen;
  while (at != std::string::npos) {
    const size_t name_end = line.find_first_of(" \t", at + 3);
    const std::string name = line.substr(at + 1, name_end == std::string::npos ? std::string::npos : name_end - at - 1);
    if (letter == '?' || kSettings.find(letter) == std::string_view::npos)
      throw std::runtime_error(
          fmt::format("{}: unknown setting '{}' (known: --w width, --h height, --f frames, --d seed, --s steps, "
                      "--g guidance scale, --n negative prompt, --i image)",
                      where, name));
    if (seen.find(letter) != std::string::npos)
      throw std::runtime_error(fmt::format("{}: --{} is given twice", where, letter));
    seen += letter;
    char next_letter = 0;
    const size_t next = next_setting(line, at + 3, next_letter);
    const std::string value =
        name_end == std::string::npos
            ? ""
            : trim(line.substr(name_end, next == std::string::npos ? std::string::npos : next - name_end));
    constexpr int64_t kMaxSize = 1 << 16;  // pixels or frames: far beyond any video model
    switch (letter) {
      case 'w':
        spec.width = setting_number<int64_t>(value, where, letter, 1, kMaxSize);
        break;
      case 'h':
        spec.height = setting_number<int64_t>(value, where, letter, 1, kMaxSize);
        break;
      case 'f':
        spec.frames = setting_number<int64_t>(value, where, letter, 1, kMaxSize);
        break;
      case 's':
        spec.steps = setting_number<int64_t>(value, where, letter, 1, 100000);
        break;
      case 'd':
        spec.seed = setting_number<uint64_t>(value, where, letter, 0, UINT64_MAX);
        break;
      case 'g':
        spec.guidance = setting_number<double>(value, where, letter, 0.0, 1000.0);
        break;
      case 'n':
        spec.negative = value;
        break;
      case 'i':
        if (value.empty()) throw std::runtime_error(fmt::format("{}: --i names no image", where));
        spec.image = value;
        break;
      default:
        break;
    }
    at = next, letter = next_letter;
  }
  return spec;
}

std::vector<PromptSpec> read_prompt_specs(const std::string& path) {
  std::vector<PromptSpec> specs;
  for (const auto& [line, text] : read_prompt_lines(path)) {
    if (text[0] == '#') continue;
    auto spec = parse_prompt_spec(text, fmt::format("prompt file '{}' line {}", path, line));
    spec.file = path;
    spec.line = line;
    if (spec.image && !spec.image->empty() && (*spec.image)[0] != '/') {  // relative to the prompt file's folder
      const auto slash = path.find_last_of('/');
      if (slash != std::string::npos) spec.image = join_path(path.substr(0, slash), *spec.image);
    }
    specs.push_back(std::move(spec));
  }
  if (specs.empty())
    throw std::runtime_error("prompt file '" + path + "' holds no prompt (one prompt per line expected)");
  return specs;
}

std::vector<SampleJob> plan_prompt_specs(const std::vector<PromptSpec>& specs, uint64_t base_seed,
                                         int64_t samples_per_spec) {
  if (samples_per_spec < 1)
    throw std::invalid_argument("plan_prompt_specs: samples_per_spec must be >= 1, got " +
                                std::to_string(samples_per_spec));
  std::vector<SampleJob> jobs;
  std::map<std::string, int64_t> count;
  std::set<std::string> files;
  for (const auto& spec : specs) {
    for (int64_t k = 0; k < samples_per_spec; ++k) {
      const int64_t index = count[spec.prompt]++;
      SampleJob job;
      job.prompt = spec.prompt;
      job.index = index;
      job.seed = spec.seed ? *spec.seed + static_cast<uint64_t>(k) : vbench_seed(spec.prompt, index, base_seed);
      job.file = vbench_file_name(spec.prompt, index);
      job.steps = spec.steps;
      job.guidance_scale = spec.guidance;
      job.negative_prompt = spec.negative;
      job.image = spec.image;
      if (!files.insert(job.file).second)
        throw std::invalid_argument(fmt::format(
            "prompt file '{}' line {}: its prompt maps to the file name '{}' of an earlier line (they differ only "
            "in characters a file name cannot hold, or beyond the length cap)",
            spec.file, spec.line, job.file));
      jobs.push_back(std::move(job));
    }
  }
  return jobs;
}

std::string vbench_file_name(const std::string& prompt, int64_t index, const std::string& extension) {
  if (index < 0) throw std::invalid_argument("vbench_file_name: negative index " + std::to_string(index));
  // Safe: no '/', no control characters, no byte that is not part of valid UTF-8, and no leading '-'
  // or '.' (an option to a shell command, a hidden file) — each becomes '_'.
  std::string name;
  for (size_t i = 0; i < prompt.size();) {
    const auto c = static_cast<unsigned char>(prompt[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n > 1 && utf8_error_offset(prompt.substr(i, n)) == std::string::npos) {
      name += prompt.substr(i, n);
      i += n;
      continue;
    }
    const bool unsafe = n != 1 || c == '/' || c < 0x20 || c == 0x7f || (name.empty() && (c == '-' || c == '.'));
    name.push_back(unsafe ? '_' : static_cast<char>(c));
    ++i;
  }
  const std::string suffix = "-" + std::to_string(index) + "." + extension;
  if (suffix.size() + 9 >= kMaxFileNameBytes)
    throw std::invalid_argument("vbench_file_name: extension '" + extension + "' is too long");
  if (name == prompt && name.size() + suffix.size() <= kMaxFileNameBytes) return name + suffix;  // VBench's own name
  // Bounded and unique: a name that had to change carries 8 hex digits of the prompt's hash, so two
  // prompts that differ only in what was replaced or cut still get two files.
  const std::string tag = fmt::format("~{:08x}", static_cast<uint32_t>(fnv1a64(prompt) >> 32));
  const size_t room = kMaxFileNameBytes - suffix.size() - tag.size();
  return utf8_prefix(name, room) + tag + suffix;
}

std::string utf8_prefix(const std::string& text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
  return text.substr(0, cut);
}

std::string vbench_prompt_from_file_name(const std::string& file_name) {
  auto slash = file_name.find_last_of('/');
  std::string stem = slash == std::string::npos ? file_name : file_name.substr(slash + 1);
  // Path(path).stem: drop the last suffix unless the name is only a suffix (".mp4" stays as is).
  auto dot = stem.find_last_of('.');
  if (dot != std::string::npos && dot > 0) stem.resize(dot);
  size_t end = stem.size();
  while (end > 0 && std::isdigit(static_cast<unsigned char>(stem[end - 1]))) --end;
  if (end < stem.size() && end > 0 && stem[end - 1] == '-') stem.resize(end - 1);
  return stem;
}

uint64_t vbench_seed(const std::string& prompt, int64_t index, uint64_t base_seed) {
  return splitmix64(base_seed ^ fnv1a64(prompt) ^ (static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull));
}

std::vector<SampleJob> plan_vbench_samples(const std::vector<std::string>& prompts, int64_t samples_per_prompt,
                                           uint64_t base_seed) {
  if (samples_per_prompt < 1)
    throw std::invalid_argument("samples per prompt must be >= 1, got " + std::to_string(samples_per_prompt));
  std::vector<SampleJob> jobs;
  std::set<std::string> files;
  for (const auto& prompt : prompts) {
    for (int64_t i = 0; i < samples_per_prompt; ++i) {
      SampleJob job;
      job.prompt = prompt;
      job.index = i;
      job.seed = vbench_seed(prompt, i, base_seed);
      job.file = vbench_file_name(prompt, i);
      if (!files.insert(job.file).second)
        throw std::invalid_argument(
            "two prompts map to the same file name '" + job.file +
            "' (they differ only in characters a file name cannot hold, or beyond the length cap)");
      jobs.push_back(std::move(job));
    }
  }
  return jobs;
}

SampleFolder find_sample_folder(const std::string& dir) {
  if (!io::is_directory(dir))
    throw io::IoError("'" + dir + "': " + (io::path_exists(dir) ? "is not a folder" : "no such folder"));
  const std::string videos = io::join_path(dir, kVideosFolder);
  if (io::is_directory(videos)) return {dir, videos, io::join_path(dir, "index.json")};
  std::string trimmed = dir;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::string parent = io::parent_path(trimmed);
  const std::string base =
      trimmed.substr(trimmed.find_last_of('/') == std::string::npos ? 0 : trimmed.find_last_of('/') + 1);
  if (base == kVideosFolder && io::path_exists(io::join_path(parent, "index.json")))
    return {parent, dir, io::join_path(parent, "index.json")};
  return {dir, dir, io::join_path(dir, "index.json")};
}

std::string index_json(const std::vector<SampleJob>& jobs, const SamplingRecord& r) {
  nlohmann::ordered_json j{{"checkpoint", r.checkpoint},
                           {"sampler", r.sampler},
                           {"steps", r.steps},
                           {"guidance_scale", r.guidance_scale},
                           {"eta", r.eta},
                           {"base_seed", r.base_seed},
                           {"fps", r.fps},
                           {"upscale", r.upscale}};
  if (r.boundary_ratio > 0) {
    j["boundary_ratio"] = r.boundary_ratio;
    j["guidance_scale_2"] = r.guidance_scale_2;
  }
  if (!r.compute_dtype.empty()) j["compute_dtype"] = r.compute_dtype;
  if (!r.device.empty()) j["device"] = r.device;
  if (!r.dit.empty()) j["dit"] = r.dit;
  if (!r.timestep_spacing.empty()) j["timestep_spacing"] = r.timestep_spacing;
  if (r.shift >= 0) j["shift"] = r.shift;
  if (r.negative_prompt) j["negative_prompt"] = *r.negative_prompt;
  if (r.crf >= 0) j["crf"] = r.crf;
  const auto loras = [](const std::vector<std::pair<std::string, double>>& files) {
    auto list = nlohmann::ordered_json::array();
    for (const auto& [file, scale] : files) list.push_back({{"file", file}, {"scale", scale}});
    return list;
  };
  if (!r.lora.empty()) j["lora"] = loras(r.lora);
  if (!r.lora_2.empty()) j["lora_2"] = loras(r.lora_2);
  if (!r.image.empty()) j["image"] = r.image;
  if (!r.size.empty()) j["size"] = r.size;
  if (!r.experts.empty()) j["experts"] = r.experts;
  if (!r.encoders.empty()) {
    nlohmann::ordered_json encoders = nlohmann::ordered_json::object();
    for (const auto& [what, file] : r.encoders) encoders[what] = file;
    j["encoders"] = std::move(encoders);
  }
  j["videos_folder"] = kVideosFolder;
  auto videos = nlohmann::ordered_json::array();
  for (const auto& job : jobs) {
    nlohmann::ordered_json v{{"prompt", job.prompt}, {"index", job.index}, {"seed", job.seed}, {"file", job.file}};
    if (job.steps) v["steps"] = *job.steps;
    if (job.guidance_scale) v["guidance_scale"] = *job.guidance_scale;
    if (job.negative_prompt) v["negative_prompt"] = *job.negative_prompt;
    if (job.image) v["image"] = *job.image;
    if (job.frames) v["frames"] = *job.frames;
    if (job.height) v["height"] = *job.height;
    if (job.width) v["width"] = *job.width;
    videos.push_back(std::move(v));
  }
  j["videos"] = std::move(videos);
  return j.dump(2) + "\n";
}

size_t EarlierSamples::count() const { return static_cast<size_t>(std::count(kept.begin(), kept.end(), true)); }

EarlierSamples earlier_samples(const std::string& index_text, const std::vector<SampleJob>& jobs,
                               const SamplingRecord& record) {
  nlohmann::json earlier;
  try {
    earlier = nlohmann::json::parse(index_text);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("not JSON (") + e.what() + ")");
  }
  if (!earlier.is_object() || !earlier.contains("videos") || !earlier["videos"].is_array())
    throw std::runtime_error("not a sample folder's index (no \"videos\" list)");
  const auto ours = nlohmann::json::parse(index_json(jobs, record));
  EarlierSamples out;
  out.kept.assign(jobs.size(), false);
  // An index written before megaslide-sample recorded these cannot tell whether its videos are this run's.
  std::vector<std::string> unrecorded;
  for (const char* key : {"size", "experts", "encoders"})
    if (ours.contains(key) && !earlier.contains(key)) unrecorded.push_back(std::string("\"") + key + "\"");
  if (!unrecorded.empty()) {
    out.differs = fmt::format(
        "index.json does not record {} (an earlier version of megaslide-sample wrote it), so whether its videos are "
        "this run's cannot be told",
        fmt::join(unrecorded, ", "));
    return out;
  }
  std::set<std::string> keys;
  for (const auto& [key, value] : earlier.items()) keys.insert(key);
  for (const auto& [key, value] : ours.items()) keys.insert(key);
  for (const auto& key : keys) {
    // How the DiT ran (resident, streamed, experts taking turns: --streamed auto's choice by the free memory) does
    // not change the videos.
    if (key == "videos" || key == "dit") continue;
    const auto shown = [&](const nlohmann::json& j) { return j.contains(key) ? j[key].dump() : "(none)"; };
    if (!earlier.contains(key) || !ours.contains(key) || earlier[key] != ours[key]) {
      out.differs = "they were sampled with other settings (" + key + ": " + shown(earlier) + " in index.json, " +
                    shown(ours) + " in this run)";
      return out;
    }
  }
  std::map<std::string, const nlohmann::json*> by_file;
  for (const auto& video : earlier["videos"])
    if (video.is_object() && video.contains("file") && video["file"].is_string())
      by_file[video["file"].get<std::string>()] = &video;
  const auto& our_videos = ours["videos"];
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto it = by_file.find(jobs[i].file);
    out.kept[i] = it != by_file.end() && *it->second == our_videos[i];
  }
  return out;
}

std::vector<std::string> list_files(const std::string& dir, const std::string& extension) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) throw std::runtime_error("cannot read folder '" + dir + "': " + std::strerror(errno));
  std::vector<std::string> out;
  const std::string suffix = "." + extension;
  while (auto* entry = ::readdir(d)) {
    std::string name = entry->d_name;
    if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    struct stat st {};
    if (::stat(io::join_path(dir, name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace megaslide::io
