// A training run from start (or a checkpoint) to its last step: the loop megaslide-train drives, in
// the library so that other drivers and the tests run exactly the same thing.
//
//   config -> `auto` settings resolved for this machine (train/auto_settings.h), once
//          -> trainer (streamed CPU-master, or resident with offload.enabled: false)
//          -> [--resume: resolve, verify and load the checkpoint — nothing is written before this
//              succeeds]
//          -> run dir (config.yaml, train.log and metrics.jsonl, appended on resume after dropping
//             lines past the checkpoint's step)
//          -> steps, each logged; every train.checkpoint_every steps a checkpoint (train/checkpoint.h),
//             train.keep_last kept; validation videos every train.sample_every steps;
//             a stop request (SIGINT/SIGTERM in megaslide-train) ends the run after the current step
//             with a checkpoint; a final checkpoint after the last step when checkpointing is on.
//
// Non-finite steps are skipped by the trainers and counted; train.max_consecutive_skips skipped steps
// in a row stop the run with NonFiniteError (after saving nothing: the last good checkpoint stays
// `latest`).
//
// Thread-safety: one thread runs a TrainingRun; `stop_requested` may be set from a signal handler.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/model/wan_weights.h"

namespace megaslide {

// Too many consecutive non-finite steps.
class NonFiniteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TrainingRunOptions {
  std::string config_source = "config";  // for the log
  std::string resume;                    // "", "latest" or a checkpoint folder
  std::string trace_path;                // Chrome trace of step `trace_step` (streamed trainer)
  int64_t trace_step = 2;
  std::string export_weights;  // bf16 weights file written after the last step
  std::string export_ema;      // ... of the EMA of the weights (train.ema_decay)
  // A LoRA run (lora.rank > 0): the frozen model's weights with the adapters merged in, as a full weights file
  // (bf16; Trainer::merged_lora_weights). A run without LoRA is refused naming lora.rank.
  std::string export_merged;
  // The layout of the exports: a Wan's weights in ComfyUI's single file(s) instead of diffusers' layout
  // (model/wan_weights.h); refused for another model.arch and for the 3D-DSA retrofit (ComfyUI could not
  // load its offset networks), before anything is written.
  WanWeightsLayout export_layout = WanWeightsLayout::kDiffusers;
  // With `resume`: load the checkpoint, write the exports above from it and return. Nothing is trained and nothing
  // else is written into the run folder (no log, metrics or checkpoint; `latest` stays as it is; its lock is held
  // meanwhile), no validation video is planned, and train.steps may be below the checkpoint's step. The messages go
  // to TrainingRunResult::exported and ::warnings.
  bool export_only = false;
  const std::atomic<int>* stop_requested = nullptr;  // non-zero: save and stop after the current step
};

struct TrainingRunResult {
  int64_t first_step = 0;             // steps already done when the run started (the checkpoint's step)
  int64_t steps_done = 0;             // steps done when it ended
  int stop_signal = 0;                // the value of *stop_requested that ended the run early, else 0
  std::string last_checkpoint;        // the newest checkpoint written by this run ("" if none)
  std::vector<std::string> exported;  // "weights written to FILE", ... (also in the run's log unless export_only)
  std::vector<std::string> warnings;  // export_only: what the run's log would have warned of on resuming
};

// Runs (or resumes) `config` (its `auto` settings resolved first). Before anything is written: the run folder is taken
// with a RunFolderGuard (train/run_folder.h) held until the run ends; --trace and --export-weights are checked as
// output files; train.device must exist; the run must fit this machine's memory (memory_shortfall); a resumed run's
// checkpoint must be verified and below train.steps (equal: the run is complete and nothing is trained). Throws
// ConfigError / CheckpointError / RunFolderError for bad input (before writing anything), OutputError when the run
// folder cannot be written, NonFiniteError as above.
TrainingRunResult run_training(const RunConfig& config, const TrainingRunOptions& options);

// "" when a lower bound of the host memory `config` needs (fp32 weights and AdamW moments when
// `state_in_host_memory` — the streamed trainer, or any trainer on the CPU —, one batch of video, the
// data order; counted on the meta device) fits `available_bytes`, else one sentence with the figures.
// The bound undercounts on purpose: only a run that cannot possibly fit is refused.
// `state_shards`: the ranks on other machines sharing the sharded streamed trainer's state (this
// machine keeps 1/state_shards of it).
std::string memory_shortfall(const RunConfig& config, int64_t available_bytes, bool state_in_host_memory = true,
                             int64_t state_shards = 1);

}  // namespace megaslide
