// megaslide-sample: generates videos for a prompt file in VBench's layout (docs/sampling.md).
//
//   megaslide-sample --checkpoint model.safetensors --prompts prompts.txt --samples-per-prompt 5 --out DIR
//   megaslide-sample --checkpoint runs/smoke --prompts prompts.txt --out DIR     (a run's latest checkpoint)
//   Wan (docs/wan.md): a Wan run's checkpoint, or published weights through a config, with umT5 and the VAE:
//   megaslide-sample --checkpoint runs/wan --text-encoder T5 --vae VAE --prompts prompts.txt --out DIR
//   megaslide-sample --config configs/wan2.1-t2v-1.3b.yaml --set model.wan.weights=/models/Wan2.1-T2V-1.3B-Diffusers \
//       --prompts prompts.txt --out DIR     (a diffusers repository: its text_encoder/ and vae/ are found)
//
// Writes DIR/videos/{prompt}-{index}.mp4 (H.264; VBench reads DIR/videos), optionally
// DIR/frames/{prompt}-{index}/NNN.png, and DIR/index.json (io/vbench_layout.h). Exit codes: 0 done, 2 bad
// flags or unusable inputs (nothing written), 1 any other failure.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <set>

#include "megaslide/megaslide.h"
#include "tool_support.h"

namespace {

// "[#####.....] 12/40 videos | 1.3 s/video | ETA 0:36" on stderr: rewritten in place on a terminal; otherwise (a
// log file, a pipe) a line after each batch and, within a long batch, one every 30 seconds.
class SampleProgress {
 public:
  SampleProgress(int64_t total, bool enabled) : total_(total), enabled_(enabled), tty_(::isatty(2) == 1) {}
  void update(int64_t done, int64_t steps_done, int64_t steps) {
    if (!enabled_) return;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    // `done` videos finished, plus the current batch's share while it is still sampling (the update after
    // a batch passes done = its end and steps_done = steps: counted once).
    const double running =
        steps_done < steps ? static_cast<double>(steps_done) / static_cast<double>(steps) * static_cast<double>(batch_)
                           : 0.0;
    const double fraction = std::min(1.0, (static_cast<double>(done) + running) / static_cast<double>(total_));
    const double eta = fraction > 0 ? elapsed / fraction * (1 - fraction) : 0.0;
    const int width = 24, filled = static_cast<int>(fraction * width);
    const std::string line =
        fmt::format("[{}{}] {}/{} videos | step {}/{} | {} s/video | ETA {}:{:02}", std::string(filled, '#'),
                    std::string(width - filled, '.'), done, total_, steps_done, steps,
                    done > 0 ? fmt::format("{:.2f}", elapsed / static_cast<double>(done)) : std::string("-"),
                    static_cast<int>(eta) / 60, static_cast<int>(eta) % 60);
    if (tty_) {
      std::cerr << "\r" << line << std::flush;
    } else if (steps_done == steps || elapsed - last_line_s_ >= 30.0) {
      std::cerr << line << "\n";
      last_line_s_ = elapsed;
    }
  }
  void set_batch(int64_t batch) { batch_ = batch; }
  void finish() {
    if (enabled_ && tty_) std::cerr << "\n";
  }

 private:
  int64_t total_, batch_ = 1;
  bool enabled_, tty_;
  double last_line_s_ = 0.0;  // when the last line was written (not on a terminal)
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// With --png, each video's frames also as frames/<stem>/000.png, 001.png, ...
void write_png_frames(const std::string& out_dir, const std::string& stem, const torch::Tensor& frames) {
  auto frame_dir = megaslide::io::join_path(megaslide::io::join_path(out_dir, "frames"), stem);
  megaslide::io::make_directories(frame_dir);
  for (int64_t t = 0; t < frames.size(0); ++t)
    megaslide::io::write_png(megaslide::io::join_path(frame_dir, fmt::format("{:03}.png", t)), frames[t]);
  // Frames past this video's, left by a longer video of the same name, would read as part of it.
  for (int64_t t = frames.size(0);; ++t) {
    const std::string stale = megaslide::io::join_path(frame_dir, fmt::format("{:03}.png", t));
    if (!megaslide::io::path_exists(stale) || megaslide::io::is_directory(stale)) break;
    std::remove(stale.c_str());
  }
}

// The videos in [start, end) of one batch: consecutive videos with the same size and settings (a prompt
// file's lines may each have their own), at most `batch_size`.
size_t batch_end(const std::vector<megaslide::ValidationVideo>& videos, size_t start, int64_t batch_size) {
  size_t end = start + 1;
  while (end < videos.size() && end - start < static_cast<size_t>(batch_size) &&
         megaslide::same_sampling_settings(videos[start], videos[end]))
    ++end;
  return end;
}

std::vector<megaslide::io::SampleJob> jobs_of(const std::vector<megaslide::ValidationVideo>& videos) {
  std::vector<megaslide::io::SampleJob> jobs;
  for (const auto& v : videos) jobs.push_back(v.job);
  return jobs;
}

// A warning naming the prompts the text encoder reads only the beginning of (`limit` tokens; `tokens` counts a
// prompt's): what follows the cut does not change their videos, and they were cut without a word.
void warn_cut_prompts(const std::vector<megaslide::ValidationVideo>& videos, int64_t limit, const std::string& encoder,
                      const std::function<int64_t(const std::string&)>& tokens) {
  std::set<std::string> seen;
  int64_t cut = 0, longest = 0;
  std::string example;
  for (const auto& v : videos) {
    if (!seen.insert(v.job.prompt).second) continue;
    const int64_t n = tokens(v.job.prompt);
    if (n <= limit) continue;
    ++cut;
    if (n > longest) longest = n, example = v.job.prompt;
  }
  if (cut == 0) return;
  if (example.size() > 60) example = megaslide::io::utf8_prefix(example, 60) + "...";
  std::cerr << fmt::format(
      "megaslide-sample: warning: {} prompt(s) are longer than the {} tokens {} reads; each is cut there, and what "
      "follows does not change its videos (the longest, {} tokens: '{}')\n",
      cut, limit, encoder, longest, example);
}

// Wan's flags.
struct WanFlags {
  std::string text_encoder, tokenizer, vae, image_encoder, negative_prompt;
  bool negative_prompt_set = false;
  double shift = -1.0;       // < 0: the config's diffusion.shift
  double guidance_2 = -1.0;  // < 0: the config's diffusion.guidance_scale_2 (Wan2.2's low-noise expert)
  bool latents = false;
  std::string image;         // image-to-video: the image the videos start from (a prompt line's --i overrides it)
  std::string lora, lora_2;  // LoRA files merged into the DiT (Wan2.2: the high-noise expert, the low-noise one)
  std::string expert_2;      // Wan2.2: the other expert's weights for a run that fine-tuned one and names none
  double lora_scale = 1.0, lora_2_scale = -1.0;
  bool no_ema = false;  // a LoRA run's checkpoint: its trained adapters, not their EMA
};

// Whether --lora's `path` names a LoRA run's checkpoint (its folder, its `latest` file, the run folder), not a file.
bool is_lora_checkpoint(const std::string& path) {
  return !path.empty() && (megaslide::io::is_directory(path) || megaslide::is_checkpoint_pointer(path));
}

// Merges the LoRA file `path` — or a LoRA run's checkpoint: the adapters of `expert` ("high", "low"; "" for one DiT)
// — into `model`'s DiT at `scale`: its resident parts now, each block read on demand as it is read. Says on stderr
// what was merged and returns the file or checkpoint read; a file that is not this model's LoRA is `flag`'s usage
// error.
std::string merge_lora(megaslide::WanModel& model, const std::string& path, double scale, const std::string& flag,
                       const std::string& expert, bool ema) {
  std::vector<std::string> names;
  for (const auto& p : model.dit->named_parameters(true)) names.push_back(p.key());
  megaslide::WanLora lora;
  const bool checkpoint = is_lora_checkpoint(path);
  try {
    lora = checkpoint ? megaslide::read_lora_checkpoint(path, expert, ema) : megaslide::read_wan_lora(path, names);
    megaslide::merge_wan_lora(*model.dit, lora, scale);
  } catch (const megaslide::WanLoraError& e) {
    throw megaslide::tools::UsageError(flag + ": " + megaslide::error_message(e));
  }
  // Wan2.2's experts are alike in shape: a file of the other expert merges without an error, and wrongly.
  if (!lora.expert.empty() && !expert.empty() && lora.expert != expert)
    std::cerr << fmt::format(
        "megaslide-sample: warning: {} '{}' says it adapts Wan2.2's {}-noise expert, and is merged into the {}-noise "
        "one (--lora is the high-noise expert's, --lora-2 the low-noise one's): swap them unless that is meant\n",
        flag, path, lora.expert, expert);
  if (model.block)
    model.block = [inner = model.block, lora, scale](int64_t l) {
      auto block = inner(l);
      megaslide::merge_wan_lora(*block, lora, scale, "blocks." + std::to_string(l) + ".");
      return block;
    };
  int64_t rank = 0;
  bool lokr = false;
  for (const auto& [weight, a] : lora.adapters) {
    rank = std::max(rank, a.rank());
    lokr = lokr || a.lokr();
  }
  std::cerr << fmt::format("megaslide-sample: {} '{}' merged at scale {} ({}, {} adapters, rank {}, {})\n", flag, path,
                           scale,
                           checkpoint ? "the adapters of " + lora.source  // its ema.safetensors or master.safetensors
                                      : std::string(megaslide::to_string(lora.layout)) + " layout",
                           lora.adapters.size(), rank, lokr ? "LoKr" : "LoRA");
  return checkpoint ? lora.source : path;
}

// --threads (or OMP_NUM_THREADS, or the cores available) applied to LibTorch; the plan for the log.
megaslide::ThreadPlan apply_sampling_threads(int64_t threads, torch::Device device) {
  megaslide::ThreadRequest request;
  request.intra_op = static_cast<int>(threads);
  request.intra_op_from = "--threads";
  request.device = device;
  const char* omp = std::getenv("OMP_NUM_THREADS");
  auto plan = megaslide::plan_threads(request, megaslide::available_cores(), omp ? omp : "");
  megaslide::apply_threads(plan);
  return plan;
}

// One batch's videos: pixels [B, 3, T, H, W] in [-1, 1] on the CPU; Wan's normalised latents as well.
struct SampledBatch {
  torch::Tensor pixels, latents;
};
// Samples the videos of one batch (same size and settings as `first`'s) for their prompts and seeds.
using SampleBatch = std::function<SampledBatch(
    const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
    const megaslide::ValidationVideo& first, const std::function<void(int64_t, int64_t)>& on_step)>;

// What the videos are written with.
struct VideoOutput {
  std::string out_dir;
  int64_t batch_size = 4, fps = 8, crf = 17, upscale = 1;
  bool png = false, latents = false, progress = true, resume = false;
};

// The latents file of a video: its video's stem with the extension, or where that would be longer than the layout's
// names (a long prompt's: the extension is 8 bytes longer than ".mp4"), the layout's own bounded name for it.
std::string latents_file_name(const megaslide::io::SampleJob& job) {
  const std::string name = job.file.substr(0, job.file.size() - 4) + ".safetensors";
  return name.size() <= megaslide::io::kMaxFileNameBytes
             ? name
             : megaslide::io::vbench_file_name(job.prompt, job.index, "safetensors");
}

// Which of `jobs` an earlier run left in the folder that this one keeps: with --resume, those its index.json lists
// with this run's settings (io::earlier_samples) whose files are all there (the video, and its latents and frames
// when this run writes them); an index of other settings is refused. Without --resume none, and a warning names
// how many files of the same names this run replaces.
std::vector<bool> earlier_videos_kept(const std::vector<megaslide::io::SampleJob>& jobs, const VideoOutput& out,
                                      const megaslide::io::SamplingRecord& record) {
  namespace io = megaslide::io;
  std::vector<bool> kept(jobs.size(), false);
  const std::string index = io::join_path(out.out_dir, "index.json");
  const std::string videos_dir = io::join_path(out.out_dir, io::kVideosFolder);
  const auto video = [&](size_t i) { return io::join_path(videos_dir, jobs[i].file); };
  std::optional<io::EarlierSamples> earlier;
  std::string unreadable;
  if (io::path_exists(index) && !io::is_directory(index)) {
    try {
      earlier = io::earlier_samples(io::read_file(index), jobs, record);
    } catch (const std::exception& e) {
      unreadable = e.what();
    }
  }
  if (!out.resume) {
    size_t replaced = 0;
    for (size_t i = 0; i < jobs.size(); ++i) replaced += io::path_exists(video(i)) ? 1 : 0;
    if (replaced > 0)
      std::cerr << fmt::format(
          "megaslide-sample: warning: this run replaces {} video{} of the same name{} in {}{}\n", replaced,
          replaced == 1 ? "" : "s", replaced == 1 ? "" : "s", videos_dir,
          earlier && earlier->count() > 0
              ? fmt::format(" ({} of them sampled with this run's settings: --resume keeps those)", earlier->count())
              : "");
    return kept;
  }
  if (!unreadable.empty())
    throw megaslide::tools::UsageError("--resume: '" + index + "' is " + unreadable +
                                       ": without --resume this run samples every video again");
  if (!earlier) {
    std::cerr << fmt::format("megaslide-sample: --resume: {} holds no index.json: sampling all {} video{}\n",
                             out.out_dir, jobs.size(), jobs.size() == 1 ? "" : "s");
    return kept;
  }
  if (!earlier->differs.empty())
    throw megaslide::tools::UsageError(
        fmt::format("--resume: the videos in {} cannot be kept: {}; without --resume this run replaces them, or give "
                    "another --out",
                    out.out_dir, earlier->differs));
  size_t missing = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!earlier->kept[i]) continue;
    const auto stem = jobs[i].file.substr(0, jobs[i].file.size() - 4);
    kept[i] = io::path_exists(video(i)) &&
              (!out.latents ||
               io::path_exists(io::join_path(io::join_path(out.out_dir, "latents"), latents_file_name(jobs[i])))) &&
              (!out.png || io::is_directory(io::join_path(io::join_path(out.out_dir, "frames"), stem)));
    missing += kept[i] ? 0 : 1;
  }
  const size_t count = static_cast<size_t>(std::count(kept.begin(), kept.end(), true));
  std::cerr << fmt::format(
      "megaslide-sample: --resume: kept {} of {} video{} already in {} (index.json){}; sampling {}\n", count,
      jobs.size(), jobs.size() == 1 ? "" : "s", out.out_dir,
      missing > 0 ? fmt::format("; {} it lists lack a file and are sampled again", missing) : "",
      count == jobs.size() ? std::string("none") : fmt::format("the other {}", jobs.size() - count));
  return kept;
}

// Samples `videos` batch by batch and writes DIR/videos/*.mp4 (and frames, latents) and index.json.
void write_videos(const std::vector<megaslide::ValidationVideo>& videos, const VideoOutput& out,
                  const megaslide::io::SamplingRecord& record, const SampleBatch& sample_batch) {
  const auto video_options = megaslide::io::VideoWriteOptions().fps(out.fps).crf(out.crf);
  const std::string videos_dir = megaslide::io::join_path(out.out_dir, megaslide::io::kVideosFolder);
  const std::string latents_dir = megaslide::io::join_path(out.out_dir, "latents");
  megaslide::io::make_directories(videos_dir);
  if (out.latents) megaslide::io::make_directories(latents_dir);
  const auto jobs = jobs_of(videos);
  // index.json describes the videos written, batch by batch: an earlier run's is removed just before the first of
  // its videos is replaced, so a run stopped part-way (a full disk, Ctrl-C) leaves an index of its own videos, and
  // one that fails before writing any leaves the earlier run as it was. With --resume it lists the earlier run's
  // videos this run keeps beside its own, in the order of the prompt file: rewritten to the kept ones alone before
  // sampling starts (the others' files stay until replaced, unlisted).
  const std::string index = megaslide::io::join_path(out.out_dir, "index.json");
  std::vector<bool> written = earlier_videos_kept(jobs, out, record);
  bool earlier_index_removed = out.resume;
  const auto write_index = [&] {
    std::vector<megaslide::io::SampleJob> listed;
    for (size_t i = 0; i < jobs.size(); ++i)
      if (written[i]) listed.push_back(jobs[i]);
    megaslide::io::write_file_atomically(index, megaslide::io::index_json(listed, record));
  };
  // The videos to sample, in order (their positions in `videos`).
  std::vector<megaslide::ValidationVideo> todo;
  std::vector<size_t> position;
  for (size_t i = 0; i < videos.size(); ++i)
    if (!written[i]) todo.push_back(videos[i]), position.push_back(i);
  // --resume: the index lists the kept videos alone before any is replaced, so a run stopped part-way never lists
  // a video (or its frames, its latents) that was being written again.
  if (out.resume && !todo.empty()) write_index();
  SampleProgress progress(static_cast<int64_t>(todo.size()), out.progress);
  try {
    for (size_t start = 0, end = 0; start < todo.size(); start = end) {
      end = batch_end(todo, start, out.batch_size);
      std::vector<std::string> prompts;
      std::vector<uint64_t> seeds;
      for (size_t i = start; i < end; ++i) prompts.push_back(todo[i].job.prompt), seeds.push_back(todo[i].job.seed);
      progress.set_batch(static_cast<int64_t>(end - start));
      int64_t steps = 0;
      const auto batch = sample_batch(prompts, seeds, todo[start], [&](int64_t done, int64_t total) {
        steps = total;
        if (done < total) progress.update(static_cast<int64_t>(start), done, total);
      });
      for (size_t i = start; i < end; ++i) {
        const auto b = static_cast<int64_t>(i - start);
        const auto& job = todo[i].job;
        auto frames = megaslide::io::to_rgb_frames(batch.pixels[b], out.upscale);
        if (!earlier_index_removed) megaslide::io::remove_tree(index), earlier_index_removed = true;
        megaslide::io::write_mp4(megaslide::io::join_path(videos_dir, job.file), frames, video_options);
        const auto stem = job.file.substr(0, job.file.size() - 4);
        if (out.latents)
          megaslide::io::write_safetensors(megaslide::io::join_path(latents_dir, latents_file_name(job)),
                                           {{"latents", batch.latents[b].to(torch::kCPU).contiguous()}},
                                           {{"prompt", job.prompt}, {"seed", std::to_string(job.seed)}});
        if (out.png) write_png_frames(out.out_dir, stem, frames);
      }
      for (size_t i = start; i < end; ++i) written[position[i]] = true;
      if (end < todo.size()) write_index();
      progress.update(static_cast<int64_t>(end), steps, steps);
    }
  } catch (...) {
    progress.finish();  // the error on a line of its own
    throw;
  }
  progress.finish();
  write_index();
  std::cerr << fmt::format("megaslide-sample: wrote {} video{}{} and {}\n", todo.size(), todo.size() == 1 ? "" : "s",
                           todo.size() < jobs.size() ? fmt::format(" (and kept {})", jobs.size() - todo.size()) : "",
                           index);
}

// --image's frame [H, W, 3] uint8 as the first frame of videos of height x width (io::fit_image), saying on
// stderr what was done.
torch::Tensor image_at_video_size(const torch::Tensor& frame, const std::string& path, int64_t height, int64_t width) {
  std::string done;
  auto image = megaslide::io::fit_image(frame, height, width, &done);
  if (!done.empty()) std::cerr << fmt::format("megaslide-sample: --image '{}' {}\n", path, done);
  return image;
}

// The Wan model's pipeline and the batches it samples (docs/wan.md).
SampleBatch wan_sampler(megaslide::WanModel model, const WanFlags& wan,
                        const std::vector<megaslide::ValidationVideo>& videos, const std::string& out_dir,
                        const std::string& source, const std::string& sampler, int64_t steps, double guidance,
                        torch::Device device, const std::string& streamed, const std::string& compute_dtype,
                        megaslide::io::SamplingRecord& record) {
  // Image-to-video's images, read before anything large is loaded: each video's (a prompt line's --i, else
  // --image) is named for an image-to-video DiT, and every one decodes. file -> [H, W, 3] uint8.
  const bool conditioned = megaslide::wan_image_to_video(model.config.model.wan);
  std::map<std::string, torch::Tensor> files;
  for (const auto& v : videos) {
    const std::string path = v.job.image.value_or(wan.image);
    if (path.empty() && conditioned)
      throw megaslide::tools::UsageError(
          "--image: '" + source +
          "' generates video from an image (Wan image-to-video): give --image FILE, or --i FILE on each prompt line");
    if (path.empty() || files.count(path)) continue;
    if (!conditioned && model.low_noise)
      throw megaslide::tools::UsageError(
          std::string(v.job.image ? "--prompts: --i" : "--image") + ": '" + source +
          "' is Wan2.2's two text-to-video experts, which start from no image: image-to-video takes an image-to-video "
          "model (Wan2.1 I2V, Wan2.2 I2V-A14B) or one text-to-video DiT (the first frame kept clean, as TI2V-5B)");
    try {
      files[path] = megaslide::io::read_video(path)[0].contiguous();
    } catch (const std::exception& e) {
      // The reader calls a file of another extension a video; this one was given as an image.
      std::string message = megaslide::error_message(e);
      if (message.rfind("video '", 0) == 0) message.replace(0, 5, "image");
      throw megaslide::tools::UsageError((v.job.image ? "--prompts: --i: " : "--image: ") + message);
    }
    std::cerr << "megaslide-sample: image-to-video from '" << path << "' ("
              << (conditioned ? "its latents and, with an image branch, CLIP's tokens condition every step"
                              : "its latent the first frame, kept clean, as Wan2.2 TI2V samples")
              << ")\n";
  }
  if (!wan.lora.empty()) {
    // Two experts: --lora is the high-noise one's (a run's checkpoint: its high-noise expert's adapters).
    record.lora = {{merge_lora(model, wan.lora, wan.lora_scale, "--lora", model.low_noise ? "high" : "", !wan.no_ema),
                    wan.lora_scale}};
    // A run that trained both experts' adapters: the low-noise expert's are --lora-2's to merge.
    if (model.low_noise && wan.lora_2.empty() && is_lora_checkpoint(wan.lora)) {
      bool both = false;
      try {
        both = megaslide::checkpoint_config(megaslide::find_checkpoint(wan.lora)).model.wan.expert == "both";
      } catch (const std::exception&) {
      }
      if (both)
        std::cerr << "megaslide-sample: note: --lora '" << wan.lora
                  << "' trained both experts' adapters; only the high-noise expert's are merged: add --lora-2 "
                  << wan.lora << " for the low-noise expert's\n";
    }
  }
  if (!wan.lora_2.empty()) {
    if (!model.low_noise)
      throw megaslide::tools::UsageError("--lora-2: the low-noise expert's LoRA, but '" + source +
                                         "' is one DiT, not Wan2.2's two experts");
    const double scale = wan.lora_2_scale < 0 ? wan.lora_scale : wan.lora_2_scale;
    record.lora_2 = {{merge_lora(*model.low_noise, wan.lora_2, scale, "--lora-2", "low", !wan.no_ema), scale}};
  }
  // The run's size in pixels (a run trained from a videos cache keeps its data sizes in pixels; a
  // prompt file's line may give its own, checked when the videos were planned).
  const auto size = megaslide::run_video_size(model.config);
  auto options = megaslide::WanSampleOptions::from_config(model.config);
  if (!sampler.empty()) options.kind(megaslide::parse_flow_sampler(sampler));
  if (steps > 0) options.steps(steps);
  if (guidance >= 0) options.guidance_scale(guidance);
  if (wan.shift >= 0) options.shift(wan.shift);
  if (wan.guidance_2 >= 0) {
    if (options.boundary_ratio() == 0)
      throw megaslide::tools::UsageError("--guidance-2: the low-noise expert's guidance scale, but '" + source +
                                         "' is one DiT, not Wan2.2's two experts");
    options.guidance_scale_2(wan.guidance_2);
  }
  if (wan.negative_prompt_set) options.negative_prompt(wan.negative_prompt);

  const auto dtype = megaslide::resolve_compute_dtype(compute_dtype, device);
  megaslide::WanPipelineRequest request;
  request.text_encoder = wan.text_encoder;
  request.tokenizer = wan.tokenizer;
  request.vae = wan.vae;
  request.image_encoder = wan.image_encoder;
  request.device = device;
  request.stream = megaslide::parse_stream_choice(streamed);
  request.compute_dtype = megaslide::offload::parse_compute_dtype(dtype.dtype);
  // Wan2.2's two experts, as the videos depend on both (a run's expert and the partner it samples with).
  std::vector<std::string> experts;
  if (model.low_noise && !model.source.empty() && !model.low_noise->source.empty())
    experts = {megaslide::io::absolute_path(model.source), megaslide::io::absolute_path(model.low_noise->source)};
  megaslide::OpenedWanPipeline opened;
  try {
    opened = megaslide::open_wan_pipeline(std::move(model), request);
  } catch (const megaslide::WanPipelineError& e) {
    const std::string flag = e.component() == "vae"             ? "--vae"
                             : e.component() == "tokenizer"     ? "--tokenizer"
                             : e.component() == "image_encoder" ? "--image-encoder"
                                                                : "--text-encoder";
    throw megaslide::tools::UsageError(flag + ": " + megaslide::error_message(e));
  } catch (const std::invalid_argument& e) {  // components that do not fit each other
    throw megaslide::tools::UsageError(megaslide::error_message(e));
  }
  warn_cut_prompts(videos, options.text_tokens(), "umT5",
                   [&](const std::string& prompt) { return opened.pipeline->prompt_tokens(prompt, options); });
  record.sampler = options.kind() == megaslide::FlowSamplerKind::kUniPC ? "unipc" : "euler";
  record.steps = options.steps();
  record.guidance_scale = options.guidance_scale();
  record.eta = 0.0;
  record.boundary_ratio = options.boundary_ratio();
  record.guidance_scale_2 = options.guidance_scale_2() < 0 ? options.guidance_scale() : options.guidance_scale_2();
  record.compute_dtype = dtype.dtype;
  record.device = device.str();
  record.dit = opened.dit_streamed         ? "blocks streamed"
               : opened.experts_take_turns ? "resident, the experts taking turns"
                                           : "resident";
  record.shift = options.shift();
  record.negative_prompt = options.negative_prompt();
  record.size = {size.frames, size.height, size.width};
  for (const auto& [what, file] : opened.encoder_files)
    record.encoders.emplace_back(what, megaslide::io::absolute_path(file));
  if (!experts.empty()) record.experts = experts;
  if (options.boundary_ratio() > 0)
    std::cerr << fmt::format(
        "megaslide-sample: two experts: the high-noise one for t >= {} (guidance {}), the low-noise one below "
        "(guidance {})\n",
        options.boundary_ratio() * 1000, options.guidance_scale(), record.guidance_scale_2);
  const auto own_size = std::count_if(videos.begin(), videos.end(), [&](const megaslide::ValidationVideo& v) {
    return v.job.frames || v.job.height || v.job.width;
  });
  std::cerr << fmt::format(
      "megaslide-sample: Wan {} -> {} video{} of {} frames {}x{}{} in {} ({} {} steps, shift {}, guidance {}, device "
      "{}, "
      "DiT {}, umT5 {}, compute dtype {} ({}))\n",
      source, videos.size(), videos.size() == 1 ? "" : "s", size.frames, size.width, size.height,
      own_size > 0 ? fmt::format(" ({} of them at their prompt line's size)", own_size) : std::string(), out_dir,
      record.sampler, options.steps(), options.shift(), options.guidance_scale(), device.str(), record.dit,
      opened.text_encoder_streamed ? "layers streamed" : "resident", dtype.dtype, dtype.reason);
  // Image-to-video: each video's image (a prompt line's --i, else --image) at its size. Wan2.1 / Wan2.2 I2V (the
  // image as conditioning channels): its conditioning (the VAE's latents, CLIP's tokens); Wan2.2 TI2V: the first
  // frame [3, H, W] in [-1, 1], its latent kept clean.
  using ImageKey = std::pair<std::string, std::vector<int64_t>>;  // (file, the video's latent shape)
  std::map<ImageKey, torch::Tensor> images;
  std::map<ImageKey, megaslide::WanImageCondition> conditions;
  for (const auto& v : videos) {
    const std::string path = v.job.image.value_or(wan.image);
    if (path.empty()) continue;  // text-to-video (an image-to-video DiT's videos all have one: checked above)
    const ImageKey key{path, v.shape};
    if (images.count(key) || conditions.count(key)) continue;
    const std::string what = v.job.image ? "--prompts: --i" : "--image";
    const int64_t height = v.job.height.value_or(size.height), width = v.job.width.value_or(size.width);
    auto fitted = image_at_video_size(files[path], path, height, width);
    if (!conditioned) {
      images[key] = fitted;
      continue;
    }
    try {
      auto condition = opened.pipeline->image_condition(fitted, files[path], v.shape);
      condition.latents = condition.latents.cpu();  // held in host memory; each batch moves its own
      if (condition.image.defined()) condition.image = condition.image.cpu();
      conditions[key] = std::move(condition);
    } catch (const std::invalid_argument& e) {
      throw megaslide::tools::UsageError(what + ": " + megaslide::error_message(e));
    }
  }
  return [pipeline = opened.pipeline, options, images, conditions, image = wan.image](
             const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
             const megaslide::ValidationVideo& first, const std::function<void(int64_t, int64_t)>& on_step) {
    auto batch_options = options;  // a prompt file line's own steps, guidance and negative prompt
    if (first.job.steps) batch_options.steps(*first.job.steps);
    if (first.job.guidance_scale) batch_options.guidance_scale(*first.job.guidance_scale);
    if (first.job.negative_prompt) batch_options.negative_prompt(*first.job.negative_prompt);
    const ImageKey key{first.job.image.value_or(image), first.shape};
    SampledBatch batch;
    if (conditions.count(key))
      batch.latents =
          pipeline->sample_image_to_video(prompts, seeds, conditions.at(key), batch_options, on_step, first.shape);
    else if (images.count(key))
      batch.latents = pipeline->sample_from_image(prompts, seeds, images.at(key), batch_options, on_step, first.shape);
    else batch.latents = pipeline->sample(prompts, seeds, batch_options, on_step, first.shape);
    batch.pixels = pipeline->decode(batch.latents);
    return batch;
  };
}

// The DiT family's generator and the batches it samples.
SampleBatch dit_sampler(megaslide::TextToVideoModel model, const std::vector<megaslide::ValidationVideo>& videos,
                        int64_t samples_per_prompt, const std::string& out_dir, const std::string& sampler,
                        int64_t steps, const std::string& spacing, double guidance, double eta, torch::Device device,
                        const std::string& streamed, const std::string& compute_dtype, const std::string& threads,
                        megaslide::io::SamplingRecord& record) {
  const auto dtype = megaslide::resolve_compute_dtype(compute_dtype, device);
  const std::string slow = megaslide::compute_dtype_warning(
      dtype.dtype, device, "use --compute-dtype auto (fp32 on this CPU) to sample faster");
  if (!slow.empty()) std::cerr << "megaslide-sample: warning: " << slow << "\n";
  bool stream = false;
  auto denoiser = megaslide::sampling_denoiser(model.dit, device, megaslide::parse_stream_choice(streamed),
                                               megaslide::offload::parse_compute_dtype(dtype.dtype), &stream);
  auto generator = std::make_shared<megaslide::TextToVideo>(std::move(model), device, denoiser);
  auto options = generator->default_options().kind(megaslide::parse_sampler_kind(sampler)).eta(eta);
  if (steps > 0) options.steps(steps);
  if (!spacing.empty()) options.timestep_spacing(megaslide::parse_timestep_spacing(spacing));
  if (guidance >= 0) options.guidance_scale(guidance);
  warn_cut_prompts(
      videos, generator->config().data.max_text_tokens,
      generator->config().model.text_encoder.kind == "clip" ? "CLIP's text encoder" : "the built-in text encoder",
      [&](const std::string& prompt) { return generator->prompt_tokens(prompt); });
  record.sampler = megaslide::to_string(options.kind());
  record.steps = options.steps();
  record.guidance_scale = options.guidance_scale();
  record.eta = options.eta();
  record.compute_dtype = dtype.dtype;
  record.device = device.str();
  record.dit = stream ? "blocks streamed" : "resident";
  const auto size = megaslide::run_video_size(generator->config());
  record.size = {size.frames, size.height, size.width};
  record.timestep_spacing = megaslide::to_string(options.timestep_spacing());
  std::cerr << fmt::format(
      "megaslide-sample: {} prompt(s) x {} -> {} videos in {} ({} {} steps {}, guidance {}, device {}, {}, "
      "compute dtype {} ({}), {})\n",
      videos.size() / static_cast<size_t>(samples_per_prompt), samples_per_prompt, videos.size(), out_dir,
      record.sampler, record.steps, record.timestep_spacing, record.guidance_scale, record.device, record.dit,
      dtype.dtype, dtype.reason, threads);
  return [generator, options](const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                              const megaslide::ValidationVideo& first,
                              const std::function<void(int64_t, int64_t)>& on_step) {
    auto batch_options = options;  // a prompt file line's own steps and guidance
    if (first.job.steps) batch_options.steps(*first.job.steps);
    if (first.job.guidance_scale) batch_options.guidance_scale(*first.job.guidance_scale);
    SampledBatch batch;
    batch.pixels = generator->generate(prompts, seeds, batch_options, on_step, first.shape,
                                       first.job.negative_prompt.value_or(""));
    return batch;
  };
}

// The names a Wan DiT's weights without a run's config use (a Wan run's --export-weights: diffusers' file or folder;
// Wan-AI's and ComfyUI's files); nullopt for anything else: a MegaSlide weights file, checkpoint or run folder, or
// no weights at all (what reads `path` then names what it is not).
std::optional<std::string> wan_dit_weights_naming(const std::string& path) {
  try {
    if (megaslide::io::is_directory(path)) {
      if (megaslide::io::path_exists(megaslide::io::join_path(path, "manifest.json")) ||
          megaslide::io::path_exists(megaslide::io::join_path(path, "checkpoints")))
        return std::nullopt;
    } else {
      const auto metadata = megaslide::io::read_safetensors_header(path).metadata;
      const auto format = metadata.find("format");
      if (format != metadata.end() && format->second == "megaslide.weights") return std::nullopt;
    }
    return megaslide::to_string(megaslide::WanWeights::open(path).naming());
  } catch (const std::exception&) {
    return std::nullopt;  // not safetensors (a checkpoint's `latest`, say), or not a Wan DiT
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megaslide-sample: text-to-video sampling into VBench's layout (docs/sampling.md)"};
  std::string checkpoint, config_path, prompts_path, out_dir, sampler, device_spec = "auto", streamed = "auto",
                                                                       compute_dtype = "auto";
  std::vector<std::string> overrides;
  WanFlags wan;
  int64_t samples_per_prompt = 5, batch_size = 4, fps = 0, crf = 17, upscale = 1, threads = 0;
  int64_t steps = 0;       // 0: the checkpoint config's diffusion.sample_steps
  std::string spacing;     // empty: the checkpoint config's diffusion.timestep_spacing
  double guidance = -1.0;  // < 0: the checkpoint config's diffusion.guidance_scale
  double eta = 0.0;
  uint64_t seed = 0;
  bool png = false, no_progress = false, no_ema = false, resume = false;
  app.add_option("--checkpoint", checkpoint,
                 "weights file (safetensors) written by megaslide-train --export-weights, a training checkpoint folder "
                 "(RUN_DIR/checkpoints/step-NNNNNNN), its `latest` file (RUN_DIR/checkpoints/latest) or a run folder "
                 "(its latest "
                 "checkpoint); a Wan run's as well")
      ->check(megaslide::tools::non_empty_path());
  app.add_option(
         "--config", config_path,
         "Wan: a run config (model.arch wan) whose model.wan.weights are published weights (a diffusers repository, "
         "Wan-AI's or ComfyUI's file); data.frames/height/width give the latents' size. Instead of --checkpoint")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--set", overrides, "with --config: override a config value, e.g. --set data.frames=21 (repeatable)");
  app.add_option(
      "--text-encoder", wan.text_encoder,
      "Wan: umT5's weights (transformers' folder, a diffusers repository's text_encoder/, or ComfyUI's "
      "umt5_xxl_fp16.safetensors); default: text_encoder/ of the diffusers repository model.wan.weights names. A "
      "DiT-family checkpoint with CLIP: CLIP's folder, in place of the one its config names");
  app.add_option("--tokenizer", wan.tokenizer,
                 "Wan: umT5's spiece.model, or a folder holding it (default: found from --text-encoder)");
  app.add_option(
      "--vae", wan.vae,
      "Wan: the Wan VAE (diffusers' vae/ folder or ComfyUI's wan_2.1_vae.safetensors); default: vae/ of the diffusers "
      "repository model.wan.weights names. A DiT-family checkpoint with the SD VAE: its folder, in place of the one "
      "its config names");
  app.add_option("--negative-prompt", wan.negative_prompt,
                 "Wan: the negative prompt of guidance (default: Wan2.1's, docs/wan.md)")
      ->each([&wan](const std::string&) { wan.negative_prompt_set = true; });
  app.add_option("--shift", wan.shift, "Wan: the flow sampler's shift (default: the config's diffusion.shift)")
      ->check(megaslide::tools::finite_real(0.0));
  app.add_option("--guidance-2", wan.guidance_2,
                 "Wan2.2: the low-noise expert's guidance scale (default: the config's diffusion.guidance_scale_2, "
                 "else --guidance)")
      ->check(megaslide::tools::finite_real(0.0));
  app.add_option("--image", wan.image,
                 "Wan image-to-video: the image the videos start from (an image file; a prompt line's --i overrides "
                 "it). Wan2.1 / Wan2.2 I2V take it as conditioning (and need it), Wan2.2 TI2V as its clean first "
                 "latent frame (docs/wan.md). An image of another size than the videos' is center-cropped to their "
                 "aspect ratio (when it differs by more than 1%) and resized (antialiased bilinear), said on stderr");
  app.add_option("--lora", wan.lora,
                 "Wan: a LoRA merged into the DiT (Wan2.2's two experts: the high-noise one) — diffusers'/PEFT's "
                 "file, ComfyUI's or musubi-tuner's layout, or a LoRA run's checkpoint folder, its latest file or the "
                 "run folder (its trained adapters; docs/wan.md)");
  app.add_option("--lora-scale", wan.lora_scale, "Wan: the LoRA's weight (default 1)")
      ->check(megaslide::tools::finite_real(-100.0));
  app.add_option("--lora-2", wan.lora_2, "Wan2.2: a LoRA merged into the low-noise expert");
  app.add_option(
         "--expert-2", wan.expert_2,
         "Wan2.2: the other expert's weights (a weights file, a diffusers folder, or the two-expert repository, "
         "whose other expert is taken) for a run that fine-tuned one expert and names no partner (its "
         "model.wan.weights_2 is empty); each expert denoises its own timesteps")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--lora-2-scale", wan.lora_2_scale, "Wan2.2: --lora-2's weight (default --lora-scale)")
      ->check(megaslide::tools::finite_real(-100.0));
  app.add_option("--image-encoder", wan.image_encoder,
                 "Wan2.1 I2V: CLIP ViT-H's image encoder (diffusers' image_encoder/ folder or ComfyUI's "
                 "clip_vision_h.safetensors); default: the config's model.image_encoder.weights, else image_encoder/ "
                 "of the diffusers repository model.wan.weights names");
  app.add_flag(
      "--latents", wan.latents,
      "Wan: also write each video's latents (normalised, before the VAE) as DIR/latents/{prompt}-{index}.safetensors");
  app.add_option("--prompts", prompts_path,
                 "prompt file, one prompt per line (VBench's prompt files work as they are); a line may end in its own "
                 "settings: "
                 "--w WIDTH --h HEIGHT --f FRAMES (pixels), --d SEED, --s STEPS, --g GUIDANCE, --n NEGATIVE PROMPT, "
                 "--i IMAGE (Wan image-to-video) (docs/sampling.md); '#' starts a comment line")
      ->required();
  app.add_option("--samples-per-prompt", samples_per_prompt,
                 "videos per line of the prompt file (a prompt's videos are numbered 0, 1, ... across its lines; a "
                 "line's --d seed "
                 "gives its videos seeds d, d+1, ...)")
      ->transform(megaslide::tools::integer_in(1, 100000))
      ->capture_default_str();
  app.add_option("--out", out_dir, "output folder: DIR/videos/*.mp4, DIR/index.json")
      ->required()
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--sampler", sampler, "ddpm (ancestral, the default) or ddim; Wan: unipc (the default) or euler")
      ->check(CLI::IsMember({"ddpm", "ddim", "unipc", "euler"}));
  app.add_option("--steps", steps,
                 "sampling steps, respaced over the training timesteps (default: the config's diffusion.sample_steps)")
      ->transform(megaslide::tools::integer_in(1));
  app.add_option(
         "--timestep-spacing", spacing,
         "which timesteps the steps visit, as diffusers' timestep_spacing: linspace, leading or trailing (default: the "
         "config's diffusion.timestep_spacing)")
      ->check(CLI::IsMember({"linspace", "leading", "trailing"}));
  app.add_option("--guidance", guidance,
                 "classifier-free guidance scale (default: the config's diffusion.guidance_scale)")
      ->check(megaslide::tools::finite_real(0.0));
  app.add_option("--eta", eta, "DDIM eta (0 deterministic, 1 ancestral variance)")
      ->check(megaslide::tools::finite_real(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--seed", seed, "base seed: each video's seed derives from (seed, prompt, index)")
      ->transform(megaslide::tools::unsigned_integer())
      ->capture_default_str();
  app.add_option("--batch-size", batch_size, "videos sampled together")
      ->transform(megaslide::tools::integer_in(1, 4096))
      ->capture_default_str();
  app.add_option("--fps", fps,
                 "frames per second of the MP4s (default 8; Wan: the run's data.fps for a video dataset, else Wan-AI's "
                 "sample_fps: 24 for Wan2.2 TI2V-5B, 16 otherwise)")
      ->transform(megaslide::tools::integer_in(1, 240));
  app.add_option("--crf", crf, "libx264 constant rate factor (0 best .. 51 worst)")
      ->transform(megaslide::tools::integer_in(0, 51))
      ->capture_default_str();
  app.add_option("--upscale", upscale, "repeat pixels N times in each direction (small models' frames are tiny)")
      ->transform(megaslide::tools::integer_in(1, 64))
      ->capture_default_str();
  app.add_flag(
      "--no-ema", no_ema,
      "a checkpoint of a run with train.ema_decay: sample its trained weights (model.safetensors), not the EMA of them "
      "(model_ema.safetensors, the default); a LoRA run's checkpoint given to --lora/--lora-2: its trained adapters "
      "(master.safetensors), not their EMA (ema.safetensors, the default)");
  app.add_flag("--png", png, "also write every frame as DIR/frames/{prompt}-{index}/NNN.png");
  app.add_flag("--resume", resume,
               "continue an interrupted run into the same --out: keep the videos its index.json lists with this run's "
               "settings (refused if they differ) and sample the rest");
  app.add_option("--device", device_spec, "auto, cpu, cuda or cuda:N")->capture_default_str();
  app.add_option(
         "--streamed", streamed,
         "stream the DiT's blocks (Wan: and umT5's layers) through the WeightStreamer: on, off, or auto (each when its "
         "weights exceed half the device's free memory; never on the CPU)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--compute-dtype,--stream-dtype", compute_dtype,
                 "the blocks' weights and activations, resident or streamed: auto (bf16 on a GPU, fp16 on one without "
                 "bf16; on the CPU bf16 where it has AVX512-BF16 or AMX, else fp32), fp32, bf16 or fp16")
      ->check(CLI::IsMember({"auto", "fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--threads", threads, "LibTorch intra-op threads (0: the cores available to this process)")
      ->transform(megaslide::tools::integer_in(0, 4096));
  app.add_flag("--no-progress", no_progress, "no progress bar");
  app.add_flag_callback(
      "--allow-nonfinite-weights", [] { megaslide::io::set_nonfinite_weights_allowed(true); },
      "load weights that hold NaN or infinite values instead of refusing them");
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;

  // Everything that can be checked is checked before anything is written.
  std::vector<megaslide::ValidationVideo> videos;
  megaslide::TextToVideoModel model;
  torch::Device device = torch::kCPU;
  std::optional<megaslide::WanModel> wan_model;
  std::string source = checkpoint;
  return megaslide::tools::run_tool("megaslide-sample", [&] {
    megaslide::tools::checking_input([&] {
      if (checkpoint.empty() == config_path.empty())
        throw std::invalid_argument("give one of --checkpoint and --config");
      if (!overrides.empty() && config_path.empty()) throw std::invalid_argument("--set applies to --config");
      if (no_ema && checkpoint.empty() && !is_lora_checkpoint(wan.lora) && !is_lora_checkpoint(wan.lora_2))
        throw std::invalid_argument(
            "--no-ema chooses between a checkpoint's weights and their EMA: it needs --checkpoint, or --lora or "
            "--lora-2 naming a LoRA run's checkpoint");
      wan.no_ema = no_ema;
      // Every video's file name is decided here, before any work (bounded, safe and unique; io/vbench_layout.h).
      // A line without settings that repeats an earlier such line is sampled once, as VBench's prompt
      // files expect; a line with its own settings always gets its videos.
      std::vector<megaslide::io::PromptSpec> specs;
      std::set<std::string> plain;
      for (auto& spec : megaslide::io::read_prompt_specs(prompts_path)) {
        const bool settings =
            spec.has_size() || spec.steps || spec.seed || spec.guidance || spec.negative || spec.image.has_value();
        if (!settings && !plain.insert(spec.prompt).second) continue;
        specs.push_back(std::move(spec));
      }
      megaslide::io::check_output_folder(out_dir, "--out");
      megaslide::tools::check_output_outside_run_folders(out_dir, "--out");
      megaslide::tools::check_device_flag(device_spec);
      device = megaslide::resolve_device(device_spec);
      // A Wan DiT's weights without a run's config are published weights: say how those sample.
      if (!checkpoint.empty())
        if (const auto naming = wan_dit_weights_naming(checkpoint))
          throw std::invalid_argument(
              "--checkpoint '" + checkpoint + "' is a Wan DiT's weights (" + *naming +
              " names) without a run's config: sample it as published weights, with --config RUN.yaml --set "
              "model.wan.weights=" +
              checkpoint +
              " (a Wan2.2 low-noise expert's: model.wan.weights_2, beside its high-noise partner) and umT5 and the VAE "
              "from --text-encoder, --tokenizer and --vae unless the config names them (docs/sampling.md); a run's "
              "own checkpoint samples with --checkpoint");
      // A weights file as it is; a checkpoint folder, its `latest` file or a run folder: the checkpoint's
      // bf16 weights file, checked against its manifest (docs/checkpoints.md).
      // A checkpoint of a run with train.ema_decay: its EMA of the weights unless --no-ema.
      const std::string ema_weights =
          checkpoint.empty() || no_ema ? std::string() : megaslide::find_ema_weights(checkpoint);
      const std::string weights = checkpoint.empty()     ? std::string()
                                  : !ema_weights.empty() ? ema_weights
                                                         : megaslide::find_weights(checkpoint);
      // A LoRA run's checkpoint holds its adapters, not a model: say how to sample it.
      if (!weights.empty() && megaslide::holds_lora_adapters(weights) == std::optional<bool>(true))
        throw std::invalid_argument(
            "--checkpoint '" + checkpoint + "': " + weights +
            " holds a LoRA run's adapters, not a model: write the model with the adapters merged in (megaslide-train "
            "--config RUN.yaml --resume CHECKPOINT --export-merged FILE) and sample FILE; a Wan LoRA run's checkpoint "
            "also goes with --lora on the base model (--config RUN/config.yaml --lora RUN)");
      if (!weights.empty()) source = weights;  // the file sampled (index.json records it)
      if (!ema_weights.empty()) {
        source = ema_weights;
        std::cerr << "megaslide-sample: sampling the EMA of the weights (" << ema_weights
                  << "; --no-ema samples the trained weights)\n";
      }
      if (!config_path.empty()) {
        const auto config = megaslide::load_run_config(config_path, overrides);
        if (config.model.arch != megaslide::Architecture::kWan)
          throw std::invalid_argument(
              "--config '" + config_path + "': model.arch is " + megaslide::to_string(config.model.arch) +
              "; --config is for Wan's published weights, sample the DiT family with --checkpoint");
        if (!wan.expert_2.empty())
          throw std::invalid_argument(
              "--expert-2 names a checkpoint's missing partner; with --config set "
              "model.wan.weights_2 (the low-noise expert) instead");
        wan_model = megaslide::wan_model_from_config(config, config_path, /*blocks_on_demand=*/true);
        source = config.model.wan.weights;
        // One of Wan2.2's experts alone denoises only its own timesteps: sampled for all of them it gives wrong videos.
        const auto& w = wan_model->config.model.wan;
        if ((w.expert == "high" || w.expert == "low") && !wan_model->low_noise)
          throw std::invalid_argument(
              "--config '" + config_path + "': model.wan.expert is " + w.expert + ": Wan2.2's " + w.expert +
              "-noise expert alone denoises only its own timesteps, and no other expert is named: set "
              "model.wan.weights_2 to the low-noise expert's weights (model.wan.weights the high-noise one's)");
      } else if (megaslide::is_wan_weights_file(weights)) {
        // A run that fine-tuned one of Wan2.2's experts samples with the other one, as it was trained to: the one
        // its config names, or --expert-2's. Alone it would denoise timesteps it was never trained on.
        auto trained = megaslide::load_wan_model(weights, /*blocks_on_demand=*/true);
        auto& w = trained.config.model.wan;
        const std::string expert = w.expert;
        const bool one_expert = expert == "high" || expert == "low";
        if (!wan.expert_2.empty()) {
          if (!one_expert)
            throw std::invalid_argument("--expert-2: '" + checkpoint +
                                        "' is not a run that fine-tuned one of Wan2.2's experts (its model.wan.expert "
                                        "is '" +
                                        w.expert + "')");
          if (!megaslide::io::path_exists(wan.expert_2))
            throw std::invalid_argument("--expert-2: '" + wan.expert_2 + "' does not exist");
          // A two-expert repository (or Wan-AI's folder of both) gives the partner the run needs: its other expert.
          std::string partner = wan.expert_2;
          try {
            const auto experts = megaslide::find_wan_experts(wan.expert_2);
            if (!experts.low.empty()) partner = expert == "high" ? experts.low : experts.high;
          } catch (const std::exception& e) {
            throw std::invalid_argument("--expert-2: " + megaslide::error_message(e));
          }
          // wan_untrained_expert's fields: the low-noise partner in weights_2, the high-noise one in weights (a low
          // run's weights_2, the trained expert's own name, kept where it has one).
          if (expert == "high") {
            w.weights_2 = partner;
          } else {
            if (w.weights_2.empty()) w.weights_2 = weights;
            w.weights = partner;
          }
        } else if (one_expert && megaslide::wan_untrained_expert(w).empty()) {
          throw std::invalid_argument(
              "--checkpoint '" + checkpoint + "': the run fine-tuned Wan2.2's " + w.expert +
              "-noise expert alone (its config names no other expert: model.wan.weights_2 is empty), and that "
              "expert denoises only its own timesteps: give the " +
              (w.expert == "high" ? "low" : "high") + "-noise expert's weights with --expert-2 FILE");
        }
        wan_model = megaslide::with_untrained_expert(std::move(trained), /*blocks_on_demand=*/true);
        if (wan_model->low_noise && one_expert)
          std::cerr << "megaslide-sample: the run fine-tuned Wan2.2's " << expert
                    << "-noise expert; sampling it with the other one, '"
                    << megaslide::wan_untrained_expert(wan_model->config.model.wan) << "'\n";
      }
      const bool is_wan = wan_model.has_value();
      const bool lora_scales = app.count("--lora-scale") > 0 || app.count("--lora-2-scale") > 0;
      if (!is_wan && (!wan.tokenizer.empty() || wan.negative_prompt_set || wan.shift >= 0 || wan.guidance_2 >= 0 ||
                      wan.latents || !wan.image.empty() || !wan.image_encoder.empty() || !wan.lora.empty() ||
                      !wan.lora_2.empty() || lora_scales || !wan.expert_2.empty()))
        throw std::invalid_argument(
            "--tokenizer, --image-encoder, --negative-prompt, --shift, --guidance-2, --image, "
            "--lora, --lora-2, --lora-scale, --lora-2-scale, --expert-2 and --latents are for Wan models; '" +
            checkpoint + "' is not one");
      if (app.count("--lora-scale") > 0 && wan.lora.empty())
        throw std::invalid_argument("--lora-scale weighs --lora's file, and no --lora was given");
      if (app.count("--lora-2-scale") > 0 && wan.lora_2.empty())
        throw std::invalid_argument("--lora-2-scale weighs --lora-2's file, and no --lora-2 was given");
      if (app.count("--shift") > 0 && !(wan.shift > 0))
        throw std::invalid_argument(fmt::format("--shift: expected a number > 0, got {}", wan.shift));
      if (is_wan && app.count("--eta") > 0)
        throw std::invalid_argument("--eta is DDIM's; Wan samples with flow matching (unipc or euler), which has none");
      if (is_wan && (sampler == "ddpm" || sampler == "ddim"))
        throw std::invalid_argument("--sampler " + sampler + ": Wan samples with flow matching: unipc or euler");
      if (!is_wan && (sampler == "unipc" || sampler == "euler"))
        throw std::invalid_argument("--sampler " + sampler +
                                    " is for Wan models: this model samples with ddpm or ddim");
      if (is_wan && !spacing.empty())
        throw std::invalid_argument("--timestep-spacing is for the DiT family's DDPM/DDIM samplers, not Wan's");
      if (is_wan) {
        if (steps > 0 && steps > wan_model->config.diffusion.timesteps)
          throw std::invalid_argument(fmt::format("--steps {} exceeds the model's {} training timesteps", steps,
                                                  wan_model->config.diffusion.timesteps));
      } else {
        if (sampler.empty()) sampler = "ddpm";
        if (sampler == "ddpm" && app.count("--eta") > 0)
          throw std::invalid_argument("--eta is DDIM's (--sampler ddim); the DDPM sampler has none");
        model = megaslide::load_weights(weights);  // on the CPU; moved below, whole or all but the blocks
        // A latent model's frozen CLIP and VAE, from the folders its config names (or --text-encoder and --vae name
        // instead: a checkpoint moved, or whose relative paths were written from another folder), on the device.
        auto& frozen = model.config.model;
        if (!wan.text_encoder.empty()) {
          if (frozen.text_encoder.kind != "clip")
            throw std::invalid_argument("--text-encoder: '" + checkpoint + "' trained its own caption encoder (" +
                                        frozen.text_encoder.kind + "), not CLIP's: it takes none");
          frozen.text_encoder.weights = wan.text_encoder;
          frozen.text_encoder.vocab.clear();  // found in (or beside) the folder given, not where the config said
        }
        if (!wan.vae.empty()) {
          if (frozen.vae.kind != "sd")
            throw std::invalid_argument("--vae: '" + checkpoint + "' is a pixel-space model: it takes no VAE");
          frozen.vae.weights = wan.vae;
        }
        const bool replaced = !wan.text_encoder.empty() || !wan.vae.empty();
        model.frozen = megaslide::FrozenEncoders::load(
            model.config, device, weights + (replaced ? " (its config, with --text-encoder/--vae)" : " (its config)"));
        if (steps > model.config.diffusion.timesteps)
          throw std::invalid_argument(fmt::format("--steps {} exceeds the model's {} training timesteps", steps,
                                                  model.config.diffusion.timesteps));
      }
      // Every video's file name, size and settings are decided here, before any work (bounded, safe and
      // unique names; io/vbench_layout.h), each line's size checked against what the model can take.
      const auto& config = is_wan ? wan_model->config : model.config;
      videos = megaslide::plan_prompt_videos(config, specs, samples_per_prompt, seed);
      // The built-in caption encoder's vocabulary is fixed (the structured-motion words and a few common ones): a
      // prompt's other words sample as <unk>, which is said rather than left to be guessed from the videos. Only the
      // words the encoder reads (data.max_text_tokens, less <bos>) are looked at.
      if (!is_wan && config.model.text_encoder.kind == "builtin") {
        const megaslide::CaptionTokenizer tokenizer;
        std::set<std::string> said;
        for (const auto& v : videos) {
          if (!said.insert(v.job.prompt).second) continue;
          std::vector<std::string> unknown;
          for (const auto& w : tokenizer.unknown_words(v.job.prompt, nullptr, config.data.max_text_tokens - 1))
            if (std::find(unknown.begin(), unknown.end(), w) == unknown.end()) unknown.push_back(w);
          if (unknown.empty()) continue;
          std::string listed;
          for (const auto& w : unknown) listed += (listed.empty() ? "'" : ", '") + w + "'";
          std::cerr << "megaslide-sample: warning: prompt '" << v.job.prompt << "': " << listed
                    << (unknown.size() == 1 ? " is" : " are")
                    << " not in the built-in caption encoder's vocabulary (the structured-motion words) and "
                       "samples as <unk>\n";
        }
      }
      const auto run_size = megaslide::run_video_size(config);
      for (const auto& v : videos) {
        const int64_t height = v.job.height.value_or(run_size.height), width = v.job.width.value_or(run_size.width);
        const std::string what = v.job.height || v.job.width ? fmt::format("'{}' (prompt file line) is", v.job.prompt)
                                                             : "the model's frames are";
        if (height * upscale % 2 != 0 || width * upscale % 2 != 0)
          throw std::invalid_argument(
              fmt::format("{} {}x{} (W x H); H.264 needs even sizes: use --upscale 2", what, width, height));
        if (is_wan && v.job.steps && *v.job.steps > config.diffusion.timesteps)
          throw std::invalid_argument(
              fmt::format("'{}' (prompt file line): --s {} exceeds the model's {} training timesteps", v.job.prompt,
                          *v.job.steps, config.diffusion.timesteps));
        // A name under --out that is taken by a folder, a link or a device fails here, not after hours of sampling.
        const std::string stem = v.job.file.substr(0, v.job.file.size() - 4);
        megaslide::io::check_replaceable_output(
            megaslide::io::join_path(megaslide::io::join_path(out_dir, megaslide::io::kVideosFolder), v.job.file));
        if (wan.latents)
          megaslide::io::check_replaceable_output(
              megaslide::io::join_path(megaslide::io::join_path(out_dir, "latents"), latents_file_name(v.job)));
        const std::string frames = megaslide::io::join_path(megaslide::io::join_path(out_dir, "frames"), stem);
        if (png && megaslide::io::path_exists(frames) && !megaslide::io::is_directory(frames))
          throw std::invalid_argument("--png: '" + frames + "' exists and is not a folder");
      }
      megaslide::io::check_replaceable_output(megaslide::io::join_path(out_dir, "index.json"));
      // An earlier run's videos this run does not replace stay beside its own, and a scorer of the folder reads both.
      const std::string videos_dir = megaslide::io::join_path(out_dir, megaslide::io::kVideosFolder);
      if (megaslide::io::is_directory(videos_dir)) {
        std::set<std::string> ours;
        for (const auto& v : videos) ours.insert(v.job.file);
        std::vector<std::string> others;
        for (const auto& file : megaslide::io::list_files(videos_dir, "mp4"))
          if (!ours.count(file)) others.push_back(file);
        if (!others.empty())
          std::cerr << fmt::format(
              "megaslide-sample: warning: {} holds {} video(s) this run does not write (an earlier run's, such as "
              "'{}'); they stay, index.json will list only this run's, and megaslide-eval or VBench scoring the "
              "folder reads them all: use another --out, or remove them\n",
              videos_dir, others.size(), others.front());
      }
    });

    megaslide::tools::survive_file_size_limit();

    megaslide::tools::remove_temporaries_on_fatal_signals();
    const auto thread_plan = apply_sampling_threads(threads, device);
    VideoOutput output;
    output.out_dir = out_dir;
    output.batch_size = batch_size;
    output.fps = fps != 0 ? fps : wan_model ? megaslide::wan_video_fps(wan_model->config) : 8;
    output.crf = crf;
    output.upscale = upscale;
    output.png = png;
    output.latents = wan.latents;
    output.resume = resume;
    output.progress = !no_progress;
    megaslide::io::SamplingRecord record{
        megaslide::io::absolute_path(source), "", 0, 0.0, 0.0, seed, output.fps, upscale};
    record.crf = crf;
    if (!wan.image.empty()) record.image = megaslide::io::absolute_path(wan.image);
    const SampleBatch sample_batch =
        wan_model ? wan_sampler(std::move(*wan_model), wan, videos, out_dir, source, sampler, steps, guidance, device,
                                streamed, compute_dtype, record)
                  : dit_sampler(std::move(model), videos, samples_per_prompt, out_dir, sampler, steps, spacing,
                                guidance, eta, device, streamed, compute_dtype, thread_plan.describe(), record);
    write_videos(videos, output, record, sample_batch);
    return 0;
  });
}
