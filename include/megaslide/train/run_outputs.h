// What a training run leaves behind and shows while it runs:
//   DIR/config.yaml    the resolved config (the file plus every --set), readable by --config
//   DIR/metrics.jsonl  one JSON object per step
//   DIR/train.log      the run's log (also echoed to the terminal)
//   DIR/tensorboard/   TensorBoard event files (output.tensorboard: true; io/event_file.h)
// and a live progress line (step/total, loss, it/s, ETA).
//
// RunDirectory is created only once the config has loaded, so a bad config writes nothing.
// Thread-safety: one thread writes a run's outputs.
#pragma once

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/train/step_metrics.h"
#include "megaslide/io/files.h"

namespace megaslide {

// Raised when a run's output folder or files cannot be written; names the path and the reason.
class OutputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RunDirectory {
 public:
  // Creates `path` (and parents) and writes config.yaml. Throws OutputError.
  RunDirectory(const std::string& path, const RunConfig& resolved);
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const;

 private:
  std::string path_;
};

class MetricsWriter {
 public:
  // Truncates `path`; or, with keep_through_step >= 0 (a resumed run), keeps its lines of steps up to
  // that one and appends. Throws OutputError.
  explicit MetricsWriter(const std::string& path, int64_t keep_through_step = -1);
  void write(const StepMetrics& m);  // one line, flushed
  // A resumed run: the lines it dropped that were not its last ("line 12"): not JSON, or without a step — a file
  // edited or damaged, not torn by a crash (which tears the last line only, dropped without a word).
  const std::vector<std::string>& dropped() const { return dropped_; }

 private:
  std::string path_;
  std::vector<std::string> dropped_;
  std::unique_ptr<io::OutputFile> out_;
};

// TensorBoard's view of a run (output.tensorboard): one event file per start of the run in DIR (a resumed
// run adds a file, opened with a session START at its first step, so TensorBoard shows the steps of an
// abandoned history past the checkpoint no more; TensorBoard reads the folder's files together). At start the resolved
// config as text (tag "config"); each step the scalars metrics.jsonl holds (train/loss, train/lr, train/grad_norm,
// throughput/samples_per_s, throughput/tokens_per_s, throughput/mfu, time/step_s, time/data_wait_s,
// time/optimizer_s, time/exposed_transfer_s, memory/peak_device_bytes, transfer/h2d_bytes,
// transfer/d2h_bytes, exchange/bytes, train/loss_scale, train/skipped_total; those a run does not
// measure are left out); and each validation video as one PNG strip of up to 8 of its frames, evenly
// spaced (tag "validation/{file name}"). Throws OutputError naming the folder when it cannot be written.
class TensorBoardLog {
 public:
  TensorBoardLog(const std::string& dir, const RunConfig& resolved, int64_t first_step);
  ~TensorBoardLog();
  void step(const StepMetrics& m);
  // The videos `files` (names inside `folder`/videos) written at `step`.
  void videos(int64_t step, const std::string& folder, const std::vector<std::string>& files);
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The run log: a file plus the terminal (stderr), or the file alone with echo false.
class TrainLog {
 public:
  explicit TrainLog(const std::string& path, bool append = false, bool echo = true);
  ~TrainLog();
  void info(const std::string& message);
  void warn(const std::string& message);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Progress on stderr: a line rewritten in place on a terminal; elsewhere one line every `every` steps.
class ProgressLine {
 public:
  // `first_step`: the steps already done when the run starts (a resumed run's checkpoint step).
  ProgressLine(int64_t total_steps, int64_t every, bool enabled, int64_t first_step = 0);
  void update(const StepMetrics& m);
  void finish();

 private:
  int64_t total_, every_, first_step_;
  bool enabled_, tty_;
  std::chrono::steady_clock::time_point start_;
  double loss_ema_ = 0.0;
  std::map<std::string, double> part_ema_;  // Wan2.2's two experts: each one's own (their losses differ in scale)
};

// The bytes a parameter of the model keeps in host memory for the run `resolved` (auto settings resolved), and what
// they are (--dry-run --json's host_state_bytes): full fine-tuning keeps the fp32 master and AdamW's two moments as
// optimizer.state_dtype keeps them (int8: a code and one fp32 scale per 256), the compute-dtype copy the blocks
// stream from and the fp32 EMA (train.ema_decay), or with offload.state_tier: nvme the compute copy alone; a LoRA run
// only the frozen model: its blocks in the compute dtype,
// or fp8 with lora.base_dtype: fp8, when streamed, in fp32 when resident (its adapters are on the device and small).
struct HostStatePerParameter {
  double bytes = 0.0;
  double master_and_moments = 0.0;  // of `bytes`: the fp32 master and AdamW's moments held in host memory (the
                                    // NVMe tier: not in `bytes`, what its file holds a parameter, EMA included)
  std::string what;                 // "fp32 weights, AdamW moments (fp32), a bf16 compute copy"
};
HostStatePerParameter host_state_per_parameter(const RunConfig& resolved);

// `megaslide-train --dry-run --json`: the model built on the meta device (nothing allocated):
// {"arch", "params", "params_per_block", "prologue_params", "epilogue_params", "layers",
//  "tokens_per_sample", "host_state_bytes" (params x host_state_per_parameter: 14 B with fp32 moments and bf16
//  compute, DESIGN.md §6), "device" (train.device), "compute_dtype" (offload.compute_dtype with `auto` resolved for
//  that device: train/auto_settings.h)}.
std::string dry_run_json(const RunConfig& config);

// "1.23 M", "28.4 B": a count in engineering units for logs.
std::string human_count(double n);
// "1:05", "2:03:04": seconds (rounded, at least 0) as a clock reads them, for an ETA.
std::string clock_time(double seconds);

}  // namespace megaslide
