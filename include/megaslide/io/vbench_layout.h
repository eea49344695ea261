// The VBench sample layout, as megaslide-sample writes it:
//   DIR/videos/{prompt}-{index}.mp4   index 0…N−1; this folder holds the MP4s and nothing else
//   DIR/index.json                    every video's prompt, index, seed and file, and the sampler settings
//   DIR/frames/{prompt}-{index}/      PNG frames (megaslide-sample --png)
// VBench is pointed at DIR/videos. Its standard mode takes the video extension from the first entry it
// lists in the folder, so any other file there (index.json sorts before most prompts) can make it find
// no video at all: nothing but the videos goes into videos/.
//
// VBench finds a video's prompt from its file name: standard mode looks for "{prompt}-{index}.mp4",
// custom mode takes the name without its extension and strips one final "-<digits>". So the name keeps
// the prompt as it is whenever a file name can: for every prompt of VBench's own prompt files the name
// is exactly VBench's. A prompt a file name cannot hold as it is — with '/', control characters, bytes
// that are not UTF-8, a leading '-' or '.', or too long for the cap below (VBench's augmented prompts
// are) — is made safe (each such byte becomes '_'), cut at a UTF-8 character boundary, and tagged
// with "~" and 8 hex digits of its FNV-1a hash, so that names stay unique; index.json then holds the
// prompt. Names are decided before any sampling (plan_vbench_samples), so a run never fails at its
// end on a name.
//
// Seeds: video (prompt, index) gets seed = SplitMix64(base_seed ⊕ FNV-1a-64(prompt) ⊕ index·φ) — a pure
// function of the prompt text, the index and the base seed, so reruns, reordered prompt files and
// subsets all give each video the same seed.
//
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace megaslide::io {

// The longest file name (bytes) this layout produces: 255 (the limit of common file systems) less room
// for the suffix of a temporary file written beside it (NAME.tmp, renamed when complete).
constexpr size_t kMaxFileNameBytes = 240;

// The folder of the videos inside a sample folder.
constexpr const char* kVideosFolder = "videos";

// Where a sample folder's parts are, for a folder a user names: DIR in the layout above (`root` DIR,
// `videos` DIR/videos), its videos folder (`root` the parent, when that holds index.json), or any
// folder of MP4s (`root` and `videos` both DIR). `index` is root/index.json, which may not exist. A DIR that is
// no folder is an IoError naming it.
struct SampleFolder {
  std::string root, videos, index;
};
SampleFolder find_sample_folder(const std::string& dir);

// Reads a prompt file: one prompt per line; a leading UTF-8 byte-order mark, '\r' and surrounding white space
// stripped; blank lines skipped; a repeated prompt kept once (it would map to the same files). Throws
// std::runtime_error naming the file when it cannot be read (a folder, a device, more than 64 MiB), holds no prompt,
// or a line is not valid UTF-8 or holds a control character other than a tab (NUL: a binary file; naming the line
// and the byte).
std::vector<std::string> read_prompt_file(const std::string& path);

// The longest prefix of `text` of at most `max_bytes` bytes that does not end inside a UTF-8 character.
std::string utf8_prefix(const std::string& text, size_t max_bytes);

// "{prompt}-{index}.mp4", or the safe, bounded, tagged name above (or another extension, without the dot).
std::string vbench_file_name(const std::string& prompt, int64_t index, const std::string& extension = "mp4");

// What VBench's custom mode recovers from a file name: the stem with one final "-<digits>" removed.
std::string vbench_prompt_from_file_name(const std::string& file_name);

uint64_t vbench_seed(const std::string& prompt, int64_t index, uint64_t base_seed);

struct SampleJob {
  std::string prompt;
  int64_t index = 0;
  uint64_t seed = 0;
  std::string file;  // file name inside the output folder
  // This video's own settings where they differ from the folder's (a prompt file's --s, --g, --n and
  // size: PromptSpec); index.json records those present with the video.
  std::optional<int64_t> steps;
  std::optional<double> guidance_scale;
  std::optional<std::string> negative_prompt;
  std::optional<std::string> image;  // image-to-video: the video's first frame (a prompt file's --i)
  std::optional<int64_t> frames, height, width;
};

// Prompt-major: every index of the first prompt, then the next prompt, …
std::vector<SampleJob> plan_vbench_samples(const std::vector<std::string>& prompts, int64_t samples_per_prompt,
                                           uint64_t base_seed);

// A prompt file with per-line settings (train.sample_prompts; megaslide-sample --prompts): each line a
// prompt, then optionally any of
//   --w WIDTH  --h HEIGHT  --f FRAMES   the video's size in pixels and frames
//   --d SEED   --s STEPS   --g SCALE    its seed, sampling steps and guidance scale
//   --n TEXT                             its negative prompt (everything up to the next setting)
//   --i IMAGE                            image-to-video: the image it starts from (relative to the file's folder)
// e.g. "a red fox runs through snow --w 832 --h 480 --f 81 --d 42 --g 5.0". A setting starts at " --"
// followed by its letter and a space; an unknown one, a repeated one, a value that is not a number in
// range or a line with settings but no prompt is refused naming the file, the line and the setting.
// Blank lines and lines starting with '#' are skipped; lines are kept in order, repeats included (a
// prompt given twice, e.g. at two sizes, gets the next VBench index: plan_prompt_specs). Reading and
// UTF-8 checks as read_prompt_file. What a caller cannot honour (a size its model cannot take) it
// refuses itself, naming `file` and `line`.
struct PromptSpec {
  std::string prompt;
  std::optional<int64_t> width, height, frames, steps;
  std::optional<uint64_t> seed;
  std::optional<double> guidance;
  std::optional<std::string> negative;
  std::optional<std::string> image;
  std::string file;
  int64_t line = 0;
  bool has_size() const { return width || height || frames; }
};
std::vector<PromptSpec> read_prompt_specs(const std::string& path);
// One line's prompt and settings (`where` names it in errors, e.g. "prompts.txt line 3").
PromptSpec parse_prompt_spec(const std::string& line, const std::string& where);

// `samples_per_spec` jobs per spec, in order: index = how many earlier jobs had the same prompt, seed =
// the spec's --d plus k for its k-th video (k = 0 … samples_per_spec − 1) or vbench_seed(prompt, index,
// base_seed), file = vbench_file_name(prompt, index), and the spec's steps, guidance and negative
// prompt (its size is the caller's to resolve and record).
std::vector<SampleJob> plan_prompt_specs(const std::vector<PromptSpec>& specs, uint64_t base_seed,
                                         int64_t samples_per_spec = 1);

// How a folder's videos were made (recorded in index.json).
struct SamplingRecord {
  std::string checkpoint, sampler;
  int64_t steps = 0;
  double guidance_scale = 0, eta = 0;
  uint64_t base_seed = 0;
  int64_t fps = 0, upscale = 1;
  // Wan2.2's two experts: the switch (boundary_ratio x 1000; 0: one model) and the low-noise expert's scale.
  double boundary_ratio = 0, guidance_scale_2 = 0;
  // The other settings that change the videos (empty, < 0 or unset: not recorded): the compute dtype, the
  // device, how the DiT ran ("resident", "blocks streamed", ...), the DiT family's timestep spacing, Wan's
  // shift and negative prompt, H.264's crf, and the LoRA files merged into the DiT (file, scale; Wan2.2's
  // low-noise expert's under "lora_2").
  std::string compute_dtype{}, device{}, dit{}, timestep_spacing{};
  double shift = -1;
  std::optional<std::string> negative_prompt{};
  int64_t crf = -1;
  std::vector<std::pair<std::string, double>> lora{}, lora_2{};
  std::string image{};  // image-to-video: the image of every video without its own (--image)
  // What else the videos depend on: their size where a prompt line gives none ([frames, height, width] in pixels),
  // Wan2.2's two experts' weights (high, low) and the frozen encoders' files (text_encoder, tokenizer, vae,
  // image_encoder; those a pipeline reads). Empty: not recorded.
  std::vector<int64_t> size{};
  std::vector<std::string> experts{};
  std::vector<std::pair<std::string, std::string>> encoders{};
};

// DIR/index.json: {"checkpoint", "sampler", "steps", "guidance_scale", "eta", "base_seed", "fps", "upscale",
// ["boundary_ratio", "guidance_scale_2" (two experts),] [the recorded ones of "compute_dtype", "device", "dit",
// "timestep_spacing", "shift", "negative_prompt", "crf", "lora", "lora_2" ([{"file", "scale"}, …]), "image",
// "size" ([frames, height, width]), "experts" ([high, low]), "encoders" ({"text_encoder": file, …}),]
// "videos_folder" ("videos"),
// "videos": [{"prompt", "index", "seed", "file"[, "steps", "guidance_scale", "negative_prompt", "image",
// "frames", "height", "width"]}, …]} (a video's own settings where it has them).
std::string index_json(const std::vector<SampleJob>& jobs, const SamplingRecord& record);

// Which of `jobs` an earlier run of the same settings has written already (megaslide-sample --resume): `index_text`
// is the folder's index.json. A job is kept when the index lists its file with the same entry (prompt, index, seed,
// its own settings) and every folder-wide setting (checkpoint, sampler, steps, …; all but "videos") is the same;
// `differs` then is empty. Otherwise `differs` says why none is kept — the first setting that is not the same ("they
// were sampled with other settings (guidance_scale: 6 in index.json, 5 in this run)"), or the settings an older
// index does not record. Throws std::runtime_error when `index_text` is not an index
// this layout writes (the caller names the file).
struct EarlierSamples {
  std::vector<bool> kept;  // one per job
  std::string differs;
  size_t count() const;
};
EarlierSamples earlier_samples(const std::string& index_text, const std::vector<SampleJob>& jobs,
                               const SamplingRecord& record);

// Names of the regular files in `dir` that end in `.extension`, sorted. Throws std::runtime_error
// naming the folder when it cannot be read.
std::vector<std::string> list_files(const std::string& dir, const std::string& extension);

}  // namespace megaslide::io
