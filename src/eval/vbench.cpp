#include "megaslide/eval/vbench.h"

#include <dirent.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <set>
#include <sstream>
#include <stdexcept>

#include "megaslide/io/files.h"

namespace megaslide::eval {

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

std::vector<std::string> read_prompt_file(const std::string& path) {
  std::string text;
  try {
    text = io::read_file(path);
  } catch (const io::IoError& e) {
    throw std::runtime_error(std::string("prompt file: ") + e.what());
  }
  std::vector<std::string> prompts;
  std::set<std::string> seen;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    auto p = trim(line);
    if (!p.empty() && seen.insert(p).second) prompts.push_back(p);
  }
  if (prompts.empty()) throw std::runtime_error("prompt file '" + path + "' holds no prompt (one prompt per line expected)");
  return prompts;
}

std::string vbench_file_name(const std::string& prompt, int64_t index, const std::string& extension) {
  if (index < 0) throw std::invalid_argument("vbench_file_name: negative index " + std::to_string(index));
  std::string name;
  for (unsigned char c : prompt) name.push_back(c == '/' || c < 0x20 || c == 0x7f ? '_' : static_cast<char>(c));
  const std::string suffix = "-" + std::to_string(index) + "." + extension;
  if (name.size() + suffix.size() > kMaxFileNameBytes) {
    size_t cut = kMaxFileNameBytes - suffix.size();
    while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
    name.resize(cut);
  }
  if (name.empty()) name = "_";
  return name + suffix;
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

std::vector<SampleJob> plan_vbench_samples(const std::vector<std::string>& prompts, int64_t samples_per_prompt, uint64_t base_seed) {
  if (samples_per_prompt < 1) throw std::invalid_argument("samples per prompt must be >= 1, got " + std::to_string(samples_per_prompt));
  std::vector<SampleJob> jobs;
  std::set<std::string> files;
  for (const auto& prompt : prompts) {
    for (int64_t i = 0; i < samples_per_prompt; ++i) {
      SampleJob job{prompt, i, vbench_seed(prompt, i, base_seed), vbench_file_name(prompt, i)};
      if (!files.insert(job.file).second)
        throw std::invalid_argument("two prompts map to the same file name '" + job.file + "' (they differ only in characters a file name cannot hold, or beyond the length cap)");
      jobs.push_back(std::move(job));
    }
  }
  return jobs;
}

std::string index_json(const std::vector<SampleJob>& jobs, const SamplingRecord& r) {
  nlohmann::ordered_json j{{"checkpoint", r.checkpoint}, {"sampler", r.sampler},   {"steps", r.steps},
                           {"guidance_scale", r.guidance_scale}, {"eta", r.eta}, {"base_seed", r.base_seed},
                           {"fps", r.fps}, {"upscale", r.upscale}};
  auto videos = nlohmann::ordered_json::array();
  for (const auto& job : jobs) videos.push_back({{"prompt", job.prompt}, {"index", job.index}, {"seed", job.seed}, {"file", job.file}});
  j["videos"] = std::move(videos);
  return j.dump(2) + "\n";
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

}  // namespace megaslide::eval
