// The VBench sample layout: DIR/{prompt}-{index}.mp4, index 0…N−1, plus DIR/index.json.
//
// VBench finds a video's prompt from its file name: standard mode looks for "{prompt}-{index}.mp4",
// custom mode takes the name without its extension and strips one final "-<digits>". So the name keeps
// the prompt as it is, except for what a file name cannot hold: '/' and control characters become '_'
// (a prompt VBench could not have saved either way), and the prompt is cut, at a UTF-8 character
// boundary, so that the whole name fits the 255-byte limit of common file systems. For every prompt
// that VBench's own prompt files contain the name is exactly VBench's.
//
// Seeds: video (prompt, index) gets seed = SplitMix64(base_seed ⊕ FNV-1a-64(prompt) ⊕ index·φ) — a pure
// function of the prompt text, the index and the base seed, so reruns, reordered prompt files and
// subsets all give each video the same seed.
//
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace megaslide::eval {

// The longest file name (bytes) this layout produces.
constexpr size_t kMaxFileNameBytes = 255;

// Reads a prompt file: one prompt per line; '\r' and surrounding white space stripped; blank lines
// skipped; a repeated prompt kept once (it would map to the same files). Throws std::runtime_error
// naming the file when it cannot be read or holds no prompt.
std::vector<std::string> read_prompt_file(const std::string& path);

// "{sanitised, capped prompt}-{index}.mp4" (or another extension, without the dot).
std::string vbench_file_name(const std::string& prompt, int64_t index, const std::string& extension = "mp4");

// What VBench's custom mode recovers from a file name: the stem with one final "-<digits>" removed.
std::string vbench_prompt_from_file_name(const std::string& file_name);

uint64_t vbench_seed(const std::string& prompt, int64_t index, uint64_t base_seed);

struct SampleJob {
  std::string prompt;
  int64_t index = 0;
  uint64_t seed = 0;
  std::string file;  // file name inside the output folder
};

// Prompt-major: every index of the first prompt, then the next prompt, …
std::vector<SampleJob> plan_vbench_samples(const std::vector<std::string>& prompts, int64_t samples_per_prompt, uint64_t base_seed);

// How a folder's videos were made (recorded in index.json).
struct SamplingRecord {
  std::string checkpoint, sampler;
  int64_t steps = 0;
  double guidance_scale = 0, eta = 0;
  uint64_t base_seed = 0;
  int64_t fps = 0, upscale = 1;
};

// DIR/index.json: {"checkpoint", "sampler", "steps", "guidance_scale", "eta", "base_seed", "fps", "upscale",
// "videos": [{"prompt", "index", "seed", "file"}, …]}.
std::string index_json(const std::vector<SampleJob>& jobs, const SamplingRecord& record);

// Names of the regular files in `dir` that end in `.extension`, sorted. Throws std::runtime_error
// naming the folder when it cannot be read.
std::vector<std::string> list_files(const std::string& dir, const std::string& extension);

}  // namespace megaslide::eval
