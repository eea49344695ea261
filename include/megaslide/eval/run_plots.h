// Curves of a training run: reads RUN_DIR/metrics.jsonl (one JSON object per step, written by
// megaslide-train's MetricsWriter, train/run_outputs.h) and draws, with render_plot (eval/plot.h):
//   OUT/loss.png        loss per step (and its running mean over 10% of the run)
//   OUT/throughput.png  tokens/s and samples/s per step
//   OUT/memory.png      peak_device_bytes per step, and the bytes moved host->device and
//                       device->host per step when the run moved any (the streamed trainer)
// each beside its .dat and .gp files.
//
// A missing or unreadable file, a line that is not a JSON object, or one without a number where a
// field needs one, throws MetricsFileError naming the file, the line number and the problem.
// Thread-safety: plain functions.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "megaslide/eval/plot.h"
#include "megaslide/train/step_metrics.h"
#include "megaslide/util/errors.h"

namespace megaslide {

class MetricsFileError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

// Every step of a metrics.jsonl file. Required per line: step, loss, step_time_s, tokens_per_s,
// samples_per_s; the others (h2d_bytes, d2h_bytes, peak_device_bytes, ...) default to 0. A last line cut short
// (no newline, not JSON: a full disk or a kill mid-write) is left out.
std::vector<StepMetrics> read_metrics_jsonl(const std::string& path);

// Draws the run in `run_dir` into `out_dir` (created; empty: `run_dir`/plots). Returns the PNG paths.
// Throws MetricsFileError or PlotError.
std::vector<std::string> plot_run(const std::string& run_dir, const std::string& out_dir = "",
                                  const PlotOptions& options = {});

}  // namespace megaslide
