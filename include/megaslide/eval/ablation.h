// The paper's ablations as runnable suites (docs/ablations.md). Each suite trains small variants of
// one base config with the project's trainers and writes into the output folder
//   SUITE.csv   every measurement (one row per run, or per step for loss curves)
//   SUITE.md    the summary as a markdown table
//   SUITE.png   a plot (render_plot, eval/plot.h; SUITE.dat and SUITE.gp beside it)
//
// Suites:
//   memory-scaling      peak device memory and step time against data.frames for dense3d (LibTorch's
//                       fused attention), dense3d-materialized (model.dense_attention: materialized,
//                       the N x N scores kept), swin and megaslide (streamed trainer), named so in the
//                       CSV's arch column. A run that does not fit is recorded "oom": on a
//                       GPU the caching allocator's c10::OutOfMemoryError is caught; on the CPU a run
//                       whose measured peak exceeds the memory budget is "oom" (and larger frame counts
//                       of that model are not run). CPU peak = the device-side state that lives across
//                       steps (the streamer's weight and gradient slots, resident weights and AdamW
//                       moments) + the most bytes live at once during a step beyond those at its start,
//                       counted by a wrapper around LibTorch's CPU allocator (so attention workspaces
//                       are included). GPU peak = the caching allocator's peak during the step.
//   offsets             loss curves of megaslide with model.dsa_offsets learned | zero | frozen and of
//                       swin, on the structured-motion data, same seeds.
//   streaming           offload.mode async vs sync: step time, exposed transfer time, optimizer wait,
//                       and the per-step losses of both (sync is defined to give identical results).
//   optimizer-location  AdamW on the host (streamed trainer, CpuAdamW, fp32 compute) vs on the device
//                       (the resident Trainer, torch::optim::AdamW on the training device): step time,
//                       optimizer time, peak device memory, and the per-step losses of both.
// Sizes: kTest (seconds, for the tests), kQuick (minutes on 2 CPU cores), kFull (the paper's sizes,
// for a GPU). Timings exclude each run's first step (warm-up).
//
// Errors: an unknown suite, bad overrides (ConfigError) or an output folder that cannot be written
// throw before anything runs; a failing trainer (other than an OOM as above) propagates.
// Thread-safety: one suite at a time per process (the CPU memory counter is process-wide).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/eval/plot.h"

namespace megaslide {

enum class AblationSize { kTest, kQuick, kFull };
const char* to_string(AblationSize size);
AblationSize parse_ablation_size(const std::string& name);  // test | quick | full; throws std::invalid_argument

struct AblationOptions {
  std::string suite;  // one of ablation_suites()
  std::string out_dir;
  AblationSize size = AblationSize::kFull;
  std::string device = "auto";         // train.device of every run: auto | cpu | cuda | cuda:N
  double memory_budget_gib = 0.0;      // memory-scaling on the CPU: above it is "oom"; 0 = the size's default
  std::vector<std::string> overrides;  // "key.path=value", applied to every run after the suite's own
  std::function<void(const std::string&)> progress;  // one line per run/measurement; may be empty
  PlotOptions plot;
};

struct AblationTable {
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
  std::string markdown() const;  // a GitHub markdown table
};

struct AblationReport {
  std::string suite;
  std::string csv_path, markdown_path, png_path;
  AblationTable summary;  // what SUITE.md holds
  std::string device;     // where it ran ("cpu", "cuda:0")
};

// The suite names, in the order --suite all runs them.
std::vector<std::string> ablation_suites();

// The config of every run of a suite starts from this (before the variant's and the user's
// overrides): a tiny MegaSlideDiT for kTest/kQuick, the paper's size for kFull.
std::vector<std::string> ablation_base_overrides(const std::string& suite, AblationSize size);

// Builds the config of every run of options.suite at options.size (with options.device and
// options.overrides) and throws ConfigError naming the first that does not load: what run_ablation and
// megaslide-ablate check before anything runs or is written.
void check_ablation_configs(const AblationOptions& options);

// The default CPU memory budget of memory-scaling at a size, in GiB.
double default_memory_budget_gib(AblationSize size);

// Runs one suite; see the file comment.
AblationReport run_ablation(const AblationOptions& options);

// Reads a CSV written by run_ablation (header + rows, no quoting needed by its values).
AblationTable read_ablation_csv(const std::string& path);

}  // namespace megaslide
