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

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <set>

#include "megaslide/megaslide.h"
#include "tool_support.h"

namespace {

// "[#####.....] 12/40 videos | 1.3 s/video | ETA 0:36" on stderr: rewritten in place on a terminal,
// one line per batch otherwise.
class SampleProgress {
 public:
  SampleProgress(int64_t total, bool enabled) : total_(total), enabled_(enabled), tty_(::isatty(2) == 1) {}
  void update(int64_t done, int64_t steps_done, int64_t steps) {
    if (!enabled_) return;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    // `done` videos finished, plus the current batch's share while it is still sampling (the update after
    // a batch passes done = its end and steps_done = steps: counted once).
    const double running = steps_done < steps ? static_cast<double>(steps_done) / static_cast<double>(steps) * static_cast<double>(batch_) : 0.0;
    const double fraction = std::min(1.0, (static_cast<double>(done) + running) / static_cast<double>(total_));
    const double eta = fraction > 0 ? elapsed / fraction * (1 - fraction) : 0.0;
    const int width = 24, filled = static_cast<int>(fraction * width);
    const std::string line = fmt::format("[{}{}] {}/{} videos | step {}/{} | {:.2f} s/video | ETA {}:{:02}", std::string(filled, '#'),
                                         std::string(width - filled, '.'), done, total_, steps_done, steps,
                                         done > 0 ? elapsed / static_cast<double>(done) : 0.0, static_cast<int>(eta) / 60,
                                         static_cast<int>(eta) % 60);
    if (tty_) std::cerr << "\r" << line << std::flush;
    else if (steps_done == steps) std::cerr << line << "\n";
  }
  void set_batch(int64_t batch) { batch_ = batch; }
  void finish() {
    if (enabled_ && tty_) std::cerr << "\n";
  }

 private:
  int64_t total_, batch_ = 1;
  bool enabled_, tty_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// With --png, each video's frames also as frames/<stem>/000.png, 001.png, ...
void write_png_frames(const std::string& out_dir, const std::string& stem, const torch::Tensor& frames) {
  auto frame_dir = megaslide::io::join_path(megaslide::io::join_path(out_dir, "frames"), stem);
  megaslide::io::make_directories(frame_dir);
  for (int64_t t = 0; t < frames.size(0); ++t)
    megaslide::io::write_png(megaslide::io::join_path(frame_dir, fmt::format("{:03}.png", t)), frames[t]);
}

// The videos in [start, end) of one batch: consecutive videos with the same size and settings (a prompt
// file's lines may each have their own), at most `batch_size`.
size_t batch_end(const std::vector<megaslide::ValidationVideo>& videos, size_t start, int64_t batch_size) {
  size_t end = start + 1;
  while (end < videos.size() && end - start < static_cast<size_t>(batch_size) && megaslide::same_sampling_settings(videos[start], videos[end]))
    ++end;
  return end;
}

std::vector<megaslide::io::SampleJob> jobs_of(const std::vector<megaslide::ValidationVideo>& videos) {
  std::vector<megaslide::io::SampleJob> jobs;
  for (const auto& v : videos) jobs.push_back(v.job);
  return jobs;
}

// Wan's flags and what they resolve to.
struct WanFlags {
  std::string text_encoder, tokenizer, vae, negative_prompt;
  bool negative_prompt_set = false;
  double shift = -1.0;  // < 0: the config's diffusion.shift
  bool latents = false;
};

// Bad input to the Wan path: exit 2.
struct BadInput : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Samples a Wan model (docs/wan.md). Returns the exit code.
int sample_wan(megaslide::WanModel model, const WanFlags& wan, const std::vector<megaslide::ValidationVideo>& videos, const std::string& out_dir,
               const std::string& source, const std::string& sampler, int64_t steps, double guidance, uint64_t seed, int64_t batch_size,
               int64_t fps, int64_t crf, int64_t upscale, bool png, torch::Device device, const std::string& streamed,
               const std::string& compute_dtype, int64_t threads, bool no_progress) {
  std::shared_ptr<megaslide::WanTextToVideo> pipeline;
  megaslide::WanSampleOptions options;
  bool pipeline_t5_streamed = false;
  try {
    // umT5 and the VAE: the flags, or a diffusers repository's text_encoder/ and vae/ beside the DiT's weights.
    const std::string repo = model.config.model.wan.weights;
    auto beside = [&](const std::string& flag, const std::string& value, const std::string& sub, const std::string& what) {
      if (!value.empty()) return value;
      if (!repo.empty() && megaslide::io::is_directory(megaslide::io::join_path(repo, sub))) return megaslide::io::join_path(repo, sub);
      throw BadInput(flag + ": Wan sampling needs " + what + " (set " + flag + " PATH, or model.wan.weights to a diffusers repository with " + sub +
                     "/)");
    };
    const std::string t5_path = beside("--text-encoder", wan.text_encoder, "text_encoder", "umT5's weights");
    const std::string vae_path = beside("--vae", wan.vae, "vae", "the Wan VAE's weights");
    auto check_path = [](const std::string& flag, const std::string& path) {
      if (!megaslide::io::path_exists(path)) throw BadInput(flag + ": '" + path + "' does not exist");
    };
    check_path("--text-encoder", t5_path);
    check_path("--vae", vae_path);
    if (!wan.tokenizer.empty()) check_path("--tokenizer", wan.tokenizer);
    // The run's size in pixels (a run trained from a videos cache keeps its data sizes in pixels; a
    // prompt file's line may give its own, checked when the videos were planned).
    const auto size = megaslide::run_video_size(model.config);
    const int64_t frames = size.frames, height = size.height, width = size.width;
    options = megaslide::WanSampleOptions::from_config(model.config);
    if (!sampler.empty()) options.kind(megaslide::parse_flow_sampler(sampler));
    if (steps > 0) options.steps(steps);
    if (guidance >= 0) options.guidance_scale(guidance);
    if (wan.shift >= 0) options.shift(wan.shift);
    if (wan.negative_prompt_set) options.negative_prompt(wan.negative_prompt);

    megaslide::ThreadRequest thread_request;
    thread_request.intra_op = static_cast<int>(threads);
    thread_request.intra_op_from = "--threads";
    thread_request.device = device;
    const char* omp = std::getenv("OMP_NUM_THREADS");
    megaslide::apply_threads(megaslide::plan_threads(thread_request, megaslide::available_cores(), omp ? omp : ""));

    const auto t5_dtype = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;  // as Wan runs umT5 (bf16) on a GPU
    std::optional<megaslide::Umt5Encoder> t5;
    std::optional<megaslide::Umt5Tokenizer> tokenizer;
    std::optional<megaslide::WanVae> vae;
    try {
      t5.emplace(megaslide::Umt5Encoder::load(t5_path, torch::kCPU, t5_dtype));
    } catch (const std::exception& e) {
      throw BadInput(std::string("--text-encoder: ") + megaslide::error_message(e));
    }
    // umT5 (11.4 GB in bf16 for XXL) streamed layer by layer when it does not fit, as the DiT's blocks.
    pipeline_t5_streamed = megaslide::should_stream(megaslide::parse_stream_choice(streamed), device, t5->weight_bytes());
    t5.emplace(pipeline_t5_streamed ? megaslide::Umt5Encoder::streamed(std::move(*t5), device) : megaslide::Umt5Encoder::resident(std::move(*t5), device));
    try {
      tokenizer.emplace(megaslide::Umt5Tokenizer::find(wan.tokenizer.empty() ? t5_path : wan.tokenizer));
    } catch (const std::exception& e) {
      throw BadInput(std::string(wan.tokenizer.empty() ? "--text-encoder (its tokenizer; or set --tokenizer): " : "--tokenizer: ") +
                     megaslide::error_message(e));
    }
    try {
      vae.emplace(megaslide::WanVae::load(vae_path, device, torch::kFloat32));
    } catch (const std::exception& e) {
      throw BadInput(std::string("--vae: ") + megaslide::error_message(e));
    }

    int64_t weight_bytes = 0;
    for (const auto& p : model.dit->parameters()) weight_bytes += static_cast<int64_t>(p.nbytes());
    const bool stream = megaslide::should_stream(megaslide::parse_stream_choice(streamed), device, weight_bytes);
    const auto dtype = megaslide::resolve_compute_dtype(compute_dtype, device);
    const auto scalar_type = megaslide::offload::parse_compute_dtype(dtype.dtype);
    std::shared_ptr<megaslide::WanDenoiser> denoiser;
    if (stream) {
      megaslide::StreamedDenoiserOptions so;
      so.device = device;
      so.compute_dtype = scalar_type;
      denoiser = std::make_shared<megaslide::StreamedWanDenoiser>(model, so);  // block by block from the weights
      model.block = nullptr;                                                    // the weights' mapping closed
    } else {
      // Block by block onto the device: the host never holds the whole DiT in fp32.
      denoiser = std::make_shared<megaslide::ResidentWanDenoiser>(model, device, scalar_type);
      model.block = nullptr;  // the weights' mapping closed
    }
    try {
      pipeline = std::make_shared<megaslide::WanTextToVideo>(model.config, std::move(*t5), std::move(*tokenizer), denoiser, std::move(*vae));
    } catch (const std::invalid_argument& e) {
      throw BadInput(e.what());
    }
    std::cerr << fmt::format("megaslide-sample: Wan {} -> {} videos of {} frames {}x{} in {} ({} {} steps, shift {}, guidance {}, device {}, DiT {}, "
                             "umT5 {}, compute dtype {} ({}))\n",
                             source, videos.size(), frames, width, height, out_dir,
                             options.kind() == megaslide::FlowSamplerKind::kUniPC ? "unipc" : "euler", options.steps(), options.shift(),
                             options.guidance_scale(), device.str(), stream ? "blocks streamed" : "resident",
                             pipeline_t5_streamed ? "layers streamed" : "resident", dtype.dtype, dtype.reason);
  } catch (const BadInput& e) {
    std::cerr << "megaslide-sample: " << megaslide::error_message(e) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "megaslide-sample: " << megaslide::error_message(e) << "\n";
    return 1;
  }

  try {
    const auto video_options = megaslide::io::VideoWriteOptions().fps(fps).crf(crf);
    const std::string videos_dir = megaslide::io::join_path(out_dir, megaslide::io::kVideosFolder);
    const std::string latents_dir = megaslide::io::join_path(out_dir, "latents");
    megaslide::io::make_directories(videos_dir);
    if (wan.latents) megaslide::io::make_directories(latents_dir);
    const auto jobs = jobs_of(videos);
    SampleProgress progress(static_cast<int64_t>(jobs.size()), !no_progress);
    for (size_t start = 0, end = 0; start < jobs.size(); start = end) {
      end = batch_end(videos, start, batch_size);
      std::vector<std::string> prompts;
      std::vector<uint64_t> seeds;
      for (size_t i = start; i < end; ++i) prompts.push_back(jobs[i].prompt), seeds.push_back(jobs[i].seed);
      auto batch_options = options;  // a prompt file line's own steps, guidance and negative prompt
      if (jobs[start].steps) batch_options.steps(*jobs[start].steps);
      if (jobs[start].guidance_scale) batch_options.guidance_scale(*jobs[start].guidance_scale);
      if (jobs[start].negative_prompt) batch_options.negative_prompt(*jobs[start].negative_prompt);
      progress.set_batch(static_cast<int64_t>(end - start));
      auto latents = pipeline->sample(prompts, seeds, batch_options, [&](int64_t done, int64_t total) {
        if (done < total) progress.update(static_cast<int64_t>(start), done, total);
      }, videos[start].shape);
      auto pixels = pipeline->decode(latents);
      for (size_t i = start; i < end; ++i) {
        const auto b = static_cast<int64_t>(i - start);
        auto frames = megaslide::io::to_rgb_frames(pixels[b], upscale);
        megaslide::io::write_mp4(megaslide::io::join_path(videos_dir, jobs[i].file), frames, video_options);
        const auto stem = jobs[i].file.substr(0, jobs[i].file.size() - 4);
        if (wan.latents)
          megaslide::io::write_safetensors(megaslide::io::join_path(latents_dir, stem + ".safetensors"),
                                           {{"latents", latents[b].to(torch::kCPU).contiguous()}}, {{"prompt", jobs[i].prompt},
                                                                                                    {"seed", std::to_string(jobs[i].seed)}});
        if (png) write_png_frames(out_dir, stem, frames);
      }
      progress.update(static_cast<int64_t>(end), batch_options.steps(), batch_options.steps());
    }
    progress.finish();
    const megaslide::io::SamplingRecord record{source, options.kind() == megaslide::FlowSamplerKind::kUniPC ? "unipc" : "euler",
                                                 options.steps(), options.guidance_scale(), 0.0, seed, fps, upscale};
    megaslide::io::write_file_atomically(megaslide::io::join_path(out_dir, "index.json"), megaslide::io::index_json(jobs, record));
    std::cerr << fmt::format("megaslide-sample: wrote {} videos and {}\n", jobs.size(), megaslide::io::join_path(out_dir, "index.json"));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "\nmegaslide-sample: " << megaslide::error_message(e) << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megaslide-sample: text-to-video sampling into VBench's layout (docs/sampling.md)"};
  std::string checkpoint, config_path, prompts_path, out_dir, sampler, device_spec = "auto", streamed = "auto", compute_dtype = "auto";
  std::vector<std::string> overrides;
  WanFlags wan;
  int64_t samples_per_prompt = 5, batch_size = 4, fps = 0, crf = 17, upscale = 1, threads = 0;
  int64_t steps = 0;          // 0: the checkpoint config's diffusion.sample_steps
  std::string spacing;        // empty: the checkpoint config's diffusion.timestep_spacing
  double guidance = -1.0;     // < 0: the checkpoint config's diffusion.guidance_scale
  double eta = 0.0;
  uint64_t seed = 0;
  bool png = false, no_progress = false, no_ema = false;
  app.add_option("--checkpoint", checkpoint,
                 "weights file (safetensors) written by megaslide-train --export-weights, a training checkpoint folder "
                 "(RUN_DIR/checkpoints/step-NNNNNNN), its `latest` file (RUN_DIR/checkpoints/latest) or a run folder (its latest "
                 "checkpoint); a Wan run's as well")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--config", config_path,
                 "Wan: a run config (model.arch wan) whose model.wan.weights are published weights (a diffusers repository, "
                 "Wan-AI's or ComfyUI's file); data.frames/height/width give the latents' size. Instead of --checkpoint")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--set", overrides, "with --config: override a config value, e.g. --set data.frames=21 (repeatable)");
  app.add_option("--text-encoder", wan.text_encoder,
                 "Wan: umT5's weights (transformers' folder, a diffusers repository's text_encoder/, or ComfyUI's "
                 "umt5_xxl_fp16.safetensors); default: text_encoder/ of the diffusers repository model.wan.weights names");
  app.add_option("--tokenizer", wan.tokenizer, "Wan: umT5's spiece.model, or a folder holding it (default: found from --text-encoder)");
  app.add_option("--vae", wan.vae,
                 "Wan: the Wan VAE (diffusers' vae/ folder or ComfyUI's wan_2.1_vae.safetensors); default: vae/ of the diffusers "
                 "repository model.wan.weights names");
  app.add_option("--negative-prompt", wan.negative_prompt, "Wan: the negative prompt of guidance (default: Wan2.1's, docs/wan.md)")
      ->each([&wan](const std::string&) { wan.negative_prompt_set = true; });
  app.add_option("--shift", wan.shift, "Wan: the flow sampler's shift (default: the config's diffusion.shift)")
      ->check(megaslide::tools::finite_real(0.0));
  app.add_flag("--latents", wan.latents, "Wan: also write each video's latents (normalised, before the VAE) as DIR/latents/{prompt}-{index}.safetensors");
  app.add_option("--prompts", prompts_path,
                 "prompt file, one prompt per line (VBench's prompt files work as they are); a line may end in its own settings: "
                 "--w WIDTH --h HEIGHT --f FRAMES (pixels), --d SEED, --s STEPS, --g GUIDANCE, --n NEGATIVE PROMPT "
                 "(docs/sampling.md); '#' starts a comment line")->required();
  app.add_option("--samples-per-prompt", samples_per_prompt,
                 "videos per line of the prompt file (a prompt's videos are numbered 0, 1, ... across its lines; a line's --d seed "
                 "gives its videos seeds d, d+1, ...)")->check(CLI::Range(int64_t{1}, int64_t{100000}))
      ->capture_default_str();
  app.add_option("--out", out_dir, "output folder: DIR/videos/*.mp4, DIR/index.json")->required()->check(megaslide::tools::non_empty_path());
  app.add_option("--sampler", sampler, "ddpm (ancestral, the default) or ddim; Wan: unipc (the default) or euler")
      ->check(CLI::IsMember({"ddpm", "ddim", "unipc", "euler"}));
  app.add_option("--steps", steps, "sampling steps, respaced over the training timesteps (default: the config's diffusion.sample_steps)")
      ->check(CLI::PositiveNumber);
  app.add_option("--timestep-spacing", spacing,
                 "which timesteps the steps visit, as diffusers' timestep_spacing: linspace, leading or trailing (default: the "
                 "config's diffusion.timestep_spacing)")
      ->check(CLI::IsMember({"linspace", "leading", "trailing"}));
  app.add_option("--guidance", guidance, "classifier-free guidance scale (default: the config's diffusion.guidance_scale)")
      ->check(megaslide::tools::finite_real(0.0));
  app.add_option("--eta", eta, "DDIM eta (0 deterministic, 1 ancestral variance)")->check(megaslide::tools::finite_real(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--seed", seed, "base seed: each video's seed derives from (seed, prompt, index)")
      ->check(megaslide::tools::integer_in(0))
      ->capture_default_str();
  app.add_option("--batch-size", batch_size, "videos sampled together")->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  app.add_option("--fps", fps, "frames per second of the MP4s (default 8; Wan: 16, Wan2.1's sample_fps)")->check(CLI::Range(int64_t{1}, int64_t{240}));
  app.add_option("--crf", crf, "libx264 constant rate factor (0 best .. 51 worst)")->check(CLI::Range(int64_t{0}, int64_t{51}))
      ->capture_default_str();
  app.add_option("--upscale", upscale, "repeat pixels N times in each direction (small models' frames are tiny)")
      ->check(CLI::Range(int64_t{1}, int64_t{64}))
      ->capture_default_str();
  app.add_flag("--no-ema", no_ema,
               "a checkpoint of a run with train.ema_decay: sample its trained weights (model.safetensors), not the EMA of them "
               "(model_ema.safetensors, the default)");
  app.add_flag("--png", png, "also write every frame as DIR/frames/{prompt}-{index}/NNN.png");
  app.add_option("--device", device_spec, "auto, cpu, cuda or cuda:N")
      ->capture_default_str();
  app.add_option("--streamed", streamed,
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
      ->check(megaslide::tools::integer_in(0, 4096));
  app.add_flag("--no-progress", no_progress, "no progress bar");
  app.add_flag_callback("--allow-nonfinite-weights", [] { megaslide::io::set_nonfinite_weights_allowed(true); },
                        "load weights that hold NaN or infinite values instead of refusing them");
  app.set_version_flag("--version", megaslide::build_summary());
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  // Everything that can be checked is checked before anything is written.
  std::vector<megaslide::ValidationVideo> videos;
  megaslide::TextToVideoModel model;
  torch::Device device = torch::kCPU;
  bool stream = false;
  std::optional<megaslide::WanModel> wan_model;
  std::string source = checkpoint;
  try {
    if (checkpoint.empty() == config_path.empty()) throw std::invalid_argument("give one of --checkpoint and --config");
    if (!overrides.empty() && config_path.empty()) throw std::invalid_argument("--set applies to --config");
    // Every video's file name is decided here, before any work (bounded, safe and unique; io/vbench_layout.h).
    // A line without settings that repeats an earlier such line is sampled once, as VBench's prompt
    // files expect; a line with its own settings always gets its videos.
    std::vector<megaslide::io::PromptSpec> specs;
    std::set<std::string> plain;
    for (auto& spec : megaslide::io::read_prompt_specs(prompts_path)) {
      const bool settings = spec.has_size() || spec.steps || spec.seed || spec.guidance || spec.negative;
      if (!settings && !plain.insert(spec.prompt).second) continue;
      specs.push_back(std::move(spec));
    }
    megaslide::io::check_output_folder(out_dir, "--out");
    device = megaslide::resolve_device(device_spec);
    // A weights file as it is; a checkpoint folder, its `latest` file or a run folder: the checkpoint's
    // bf16 weights file, checked against its manifest (docs/checkpoints.md).
    // A checkpoint of a run with train.ema_decay: its EMA of the weights unless --no-ema.
    const std::string ema_weights = checkpoint.empty() || no_ema ? std::string() : megaslide::find_ema_weights(checkpoint);
    const std::string weights = checkpoint.empty() ? std::string() : !ema_weights.empty() ? ema_weights : megaslide::find_weights(checkpoint);
    if (!ema_weights.empty()) {
      source = ema_weights;
      std::cerr << "megaslide-sample: sampling the EMA of the weights (" << ema_weights << "; --no-ema samples the trained weights)\n";
    }
    if (!config_path.empty()) {
      const auto config = megaslide::load_run_config(config_path, overrides);
      if (config.model.arch != megaslide::Architecture::kWan)
        throw std::invalid_argument("--config '" + config_path + "': model.arch is " + megaslide::to_string(config.model.arch) +
                                    "; --config is for Wan's published weights, sample the DiT family with --checkpoint");
      wan_model = megaslide::wan_model_from_config(config, config_path, /*blocks_on_demand=*/true);
      source = config.model.wan.weights;
    } else if (megaslide::is_wan_weights_file(weights)) {
      wan_model = megaslide::load_wan_model(weights, /*blocks_on_demand=*/true);
    }
    const bool is_wan = wan_model.has_value();
    if (!is_wan && (!wan.text_encoder.empty() || !wan.tokenizer.empty() || !wan.vae.empty() || wan.negative_prompt_set || wan.shift >= 0 ||
                    wan.latents))
      throw std::invalid_argument("--text-encoder, --tokenizer, --vae, --negative-prompt, --shift and --latents are for Wan models; '" +
                                  checkpoint + "' is not one");
    if (is_wan && (sampler == "ddpm" || sampler == "ddim"))
      throw std::invalid_argument("--sampler " + sampler + ": Wan samples with flow matching: unipc or euler");
    if (!is_wan && (sampler == "unipc" || sampler == "euler"))
      throw std::invalid_argument("--sampler " + sampler + " is for Wan models: this model samples with ddpm or ddim");
    if (is_wan && !spacing.empty()) throw std::invalid_argument("--timestep-spacing is for the DiT family's DDPM/DDIM samplers, not Wan's");
    if (is_wan) {
      if (steps > 0 && steps > wan_model->config.diffusion.timesteps)
        throw std::invalid_argument(fmt::format("--steps {} exceeds the model's {} training timesteps", steps, wan_model->config.diffusion.timesteps));
    } else {
      if (fps == 0) fps = 8;
      if (sampler.empty()) sampler = "ddpm";
      model = megaslide::load_weights(weights);  // on the CPU; moved below, whole or all but the blocks
      // A latent model's frozen CLIP and VAE, from the folders its config names, on the device.
      model.frozen = megaslide::FrozenEncoders::load(model.config, device, weights + " (its config)");
      int64_t weight_bytes = 0;
      for (const auto& p : model.dit->parameters()) weight_bytes += static_cast<int64_t>(p.nbytes());
      stream = megaslide::should_stream(megaslide::parse_stream_choice(streamed), device, weight_bytes);
      if (steps > model.config.diffusion.timesteps)
        throw std::invalid_argument(fmt::format("--steps {} exceeds the model's {} training timesteps", steps, model.config.diffusion.timesteps));
    }
    // Every video's file name, size and settings are decided here, before any work (bounded, safe and
    // unique names; io/vbench_layout.h), each line's size checked against what the model can take.
    const auto& config = is_wan ? wan_model->config : model.config;
    videos = megaslide::plan_prompt_videos(config, specs, samples_per_prompt, seed);
    const auto run_size = megaslide::run_video_size(config);
    for (const auto& v : videos) {
      const int64_t height = v.job.height.value_or(run_size.height), width = v.job.width.value_or(run_size.width);
      const std::string what = v.job.height || v.job.width ? fmt::format("'{}' (prompt file line) is", v.job.prompt) : "the model's frames are";
      if (height * upscale % 2 != 0 || width * upscale % 2 != 0)
        throw std::invalid_argument(fmt::format("{} {}x{} (W x H); H.264 needs even sizes: use --upscale 2", what, width, height));
      if (is_wan && v.job.steps && *v.job.steps > config.diffusion.timesteps)
        throw std::invalid_argument(fmt::format("'{}' (prompt file line): --s {} exceeds the model's {} training timesteps", v.job.prompt,
                                                *v.job.steps, config.diffusion.timesteps));
    }
  } catch (const std::exception& e) {
    std::cerr << "megaslide-sample: " << megaslide::error_message(e) << "\n";
    return 2;
  }

  megaslide::tools::survive_file_size_limit();
  if (wan_model)
    return sample_wan(std::move(*wan_model), wan, videos, out_dir, source, sampler, steps, guidance, seed, batch_size, fps == 0 ? 16 : fps, crf,
                      upscale, png, device, streamed, compute_dtype, threads, no_progress);
  try {
    megaslide::ThreadRequest thread_request;
    thread_request.intra_op = static_cast<int>(threads);
    thread_request.intra_op_from = "--threads";
    thread_request.device = device;
    const char* omp = std::getenv("OMP_NUM_THREADS");
    const auto thread_plan = megaslide::plan_threads(thread_request, megaslide::available_cores(), omp ? omp : "");
    megaslide::apply_threads(thread_plan);
    const auto dtype = megaslide::resolve_compute_dtype(compute_dtype, device);
    const std::string slow = megaslide::compute_dtype_warning(dtype.dtype, device, "use --compute-dtype auto (fp32 on this CPU) to sample faster");
    if (!slow.empty()) std::cerr << "megaslide-sample: warning: " << slow << "\n";
    const auto scalar_type = megaslide::offload::parse_compute_dtype(dtype.dtype);
    std::shared_ptr<megaslide::Denoiser> denoiser;
    if (stream) {
      megaslide::StreamedDenoiserOptions so;
      so.device = device;
      so.compute_dtype = scalar_type;
      denoiser = std::make_shared<megaslide::StreamedDenoiser>(model.dit, so);
    } else if (scalar_type != torch::kFloat) {
      model.dit->to(device);
      denoiser = std::make_shared<megaslide::ResidentDenoiser>(model.dit, scalar_type);
    }
    megaslide::TextToVideo generator(std::move(model), device, denoiser);
    auto options = generator.default_options().kind(megaslide::parse_sampler_kind(sampler)).eta(eta);
    if (steps > 0) options.steps(steps);
    if (!spacing.empty()) options.timestep_spacing(megaslide::parse_timestep_spacing(spacing));
    if (guidance >= 0) options.guidance_scale(guidance);
    const auto video_options = megaslide::io::VideoWriteOptions().fps(fps).crf(crf);

    const std::string videos_dir = megaslide::io::join_path(out_dir, megaslide::io::kVideosFolder);
    megaslide::io::make_directories(videos_dir);
    std::cerr << fmt::format("megaslide-sample: {} prompt(s) x {} -> {} videos in {} ({} {} steps {}, guidance {}, device {}, {}, "
                             "compute dtype {} ({}), {})\n",
                             videos.size() / static_cast<size_t>(samples_per_prompt), samples_per_prompt, videos.size(), out_dir,
                             megaslide::to_string(options.kind()), options.steps(), megaslide::to_string(options.timestep_spacing()), options.guidance_scale(), device.str(),
                             stream ? "blocks streamed" : "resident", dtype.dtype, dtype.reason, thread_plan.describe());
    const auto jobs = jobs_of(videos);
    SampleProgress progress(static_cast<int64_t>(jobs.size()), !no_progress);
    for (size_t start = 0, end = 0; start < jobs.size(); start = end) {
      end = batch_end(videos, start, batch_size);
      std::vector<std::string> prompts;
      std::vector<uint64_t> seeds;
      for (size_t i = start; i < end; ++i) prompts.push_back(jobs[i].prompt), seeds.push_back(jobs[i].seed);
      auto batch_options = options;  // a prompt file line's own steps and guidance
      if (jobs[start].steps) batch_options.steps(*jobs[start].steps);
      if (jobs[start].guidance_scale) batch_options.guidance_scale(*jobs[start].guidance_scale);
      progress.set_batch(static_cast<int64_t>(end - start));
      auto pixels = generator.generate(prompts, seeds, batch_options, [&](int64_t done, int64_t total) {
        if (done < total) progress.update(static_cast<int64_t>(start), done, total);
      }, videos[start].shape, jobs[start].negative_prompt.value_or(""));
      for (size_t i = start; i < end; ++i) {
        auto frames = megaslide::io::to_rgb_frames(pixels[static_cast<int64_t>(i - start)], upscale);
        megaslide::io::write_mp4(megaslide::io::join_path(videos_dir, jobs[i].file), frames, video_options);
        if (png) write_png_frames(out_dir, jobs[i].file.substr(0, jobs[i].file.size() - 4), frames);
      }
      progress.update(static_cast<int64_t>(end), batch_options.steps(), batch_options.steps());
    }
    progress.finish();
    const megaslide::io::SamplingRecord record{source, megaslide::to_string(options.kind()), options.steps(),
                                                 options.guidance_scale(), options.eta(), seed, fps, upscale};
    megaslide::io::write_file_atomically(megaslide::io::join_path(out_dir, "index.json"), megaslide::io::index_json(jobs, record));
    std::cerr << fmt::format("megaslide-sample: wrote {} videos and {}\n", jobs.size(), megaslide::io::join_path(out_dir, "index.json"));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "\nmegaslide-sample: " << megaslide::error_message(e) << "\n";
    return 1;
  }
}
