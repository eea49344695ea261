#include "megaslide/eval/run_plots.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "megaslide/io/files.h"

namespace megaslide {
namespace {

// A measured value. JSON has no NaN or infinity: the trainer writes a non-finite value (the loss and
// grad_norm of a skipped step) as null, read back here as NaN, which the plots draw as a gap.
double number(const nlohmann::json& j, const char* key, bool required, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) {
    if (required) throw MetricsFileError(fmt::format("{}: missing field \"{}\"", where, key));
    return 0.0;
  }
  if (it->is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (!it->is_number())
    throw MetricsFileError(fmt::format("{}: field \"{}\" is not a number: {}", where, key, it->dump()));
  const double v = it->get<double>();
  if (!std::isfinite(v)) throw MetricsFileError(fmt::format("{}: field \"{}\" is not finite", where, key));
  return v;
}

// A count (a step, bytes): a finite whole number, not negative, never null.
int64_t count(const nlohmann::json& j, const char* key, bool required, const std::string& where) {
  auto it = j.find(key);
  if (it != j.end() && !it->is_number())
    throw MetricsFileError(fmt::format("{}: field \"{}\" is not a number: {}", where, key, it->dump()));
  const double v = number(j, key, required, where);
  if (std::abs(v) > 9.0e18)
    throw MetricsFileError(fmt::format("{}: field \"{}\" is out of range: {}", where, key, it->dump()));
  if (v < 0) throw MetricsFileError(fmt::format("{}: field \"{}\" is negative: {}", where, key, it->dump()));
  if (v != std::floor(v))
    throw MetricsFileError(fmt::format("{}: field \"{}\" is not a whole number: {}", where, key, it->dump()));
  return static_cast<int64_t>(v);
}

}  // namespace

std::vector<StepMetrics> read_metrics_jsonl(const std::string& path) {
  if (io::is_directory(path))
    throw MetricsFileError(fmt::format("{}: is a folder, expected a metrics.jsonl file", path));
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw MetricsFileError(
        fmt::format("{}: is not a regular file (a device or a pipe), expected a metrics.jsonl file", path));
  std::ifstream in(path);
  if (!in) throw MetricsFileError(fmt::format("{}: cannot open (does the run folder hold a metrics.jsonl?)", path));
  std::vector<StepMetrics> steps;
  std::string line;
  int64_t number_of_line = 0;
  while (std::getline(in, line)) {
    ++number_of_line;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path, number_of_line);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      // A last line without its newline was cut short (a full disk, a kill mid-write): left out, as a resume
      // drops it. A whole line that is not JSON is an error.
      if (in.eof()) break;
      throw MetricsFileError(fmt::format("{}: not valid JSON ({})", where, e.what()));
    } catch (const nlohmann::json::exception& e) {  // a number past double's range (1e400), and the like
      throw MetricsFileError(fmt::format("{}: not valid JSON ({})", where, e.what()));
    }
    if (!j.is_object())
      throw MetricsFileError(fmt::format("{}: expected a JSON object per line, got {}", where, j.type_name()));
    StepMetrics m;
    m.step = count(j, "step", true, where);
    m.loss = number(j, "loss", true, where);
    m.step_time_s = number(j, "step_time_s", true, where);
    m.tokens_per_s = number(j, "tokens_per_s", true, where);
    m.samples_per_s = number(j, "samples_per_s", true, where);
    m.lr = number(j, "lr", false, where);
    m.grad_norm = number(j, "grad_norm", false, where);
    m.h2d_bytes = count(j, "h2d_bytes", false, where);
    m.d2h_bytes = count(j, "d2h_bytes", false, where);
    m.exposed_transfer_s = number(j, "exposed_transfer_s", false, where);
    m.optimizer_wait_s = number(j, "optimizer_wait_s", false, where);
    m.optimizer_s = number(j, "optimizer_s", false, where);
    m.peak_device_bytes = count(j, "peak_device_bytes", false, where);
    m.mfu = number(j, "mfu", false, where);
    if (j.contains("val_loss")) m.val_loss = number(j, "val_loss", true, where);
    if (j.contains("part")) {
      if (!j["part"].is_string()) throw MetricsFileError(fmt::format("{}: \"part\" is not a string", where));
      m.part = j["part"].get<std::string>();
    }
    steps.push_back(m);
  }
  if (in.bad()) throw MetricsFileError(fmt::format("{}: read error after line {}", path, number_of_line));
  if (steps.empty()) throw MetricsFileError(fmt::format("{}: no steps (the file is empty)", path));
  return steps;
}

std::vector<std::string> plot_run(const std::string& run_dir, const std::string& out_dir, const PlotOptions& options) {
  const std::string metrics_path = io::join_path(run_dir, "metrics.jsonl");
  const auto steps = read_metrics_jsonl(metrics_path);
  const std::string out = out_dir.empty() ? io::join_path(run_dir, "plots") : out_dir;
  find_gnuplot(options);  // fail before writing anything when gnuplot is missing
  try {
    io::make_directories(out);
  } catch (const io::IoError& e) {
    throw PlotError(std::string("plot output folder: ") + e.what());
  }

  std::vector<double> x;
  for (const auto& m : steps) x.push_back(static_cast<double>(m.step));
  auto column = [&](auto get) {
    std::vector<double> v;
    for (const auto& m : steps) v.push_back(static_cast<double>(get(m)));
    return v;
  };
  const std::string name = run_dir;
  std::vector<std::string> pngs;

  // Loss, with a trailing running mean over a tenth of the run (at least one step); a run that trains one
  // part per step (Wan2.2's experts) has one loss curve and mean per part: their losses differ in scale.
  {
    std::vector<std::string> parts;
    for (const auto& m : steps)
      if (std::find(parts.begin(), parts.end(), m.part) == parts.end()) parts.push_back(m.part);
    PlotPanel panel{"loss: " + name, "step", "loss (MSE against the objective's target)", false, false, false, {}};
    for (const auto& part : parts) {
      std::vector<double> px, loss;
      for (const auto& m : steps)
        if (m.part == part) px.push_back(static_cast<double>(m.step)), loss.push_back(m.loss);
      const size_t window = std::max<size_t>(1, loss.size() / 10);
      std::vector<double> mean(loss.size());
      double sum = 0.0;
      size_t finite = 0;  // skipped steps (loss NaN) are left out of the mean, not allowed to poison it
      for (size_t i = 0; i < loss.size(); ++i) {
        if (std::isfinite(loss[i])) sum += loss[i], ++finite;
        if (i >= window && std::isfinite(loss[i - window])) sum -= loss[i - window], --finite;
        mean[i] = finite > 0 ? sum / static_cast<double>(finite) : std::numeric_limits<double>::quiet_NaN();
      }
      const std::string of = part.empty() ? "" : " (" + part + ")";
      panel.series.push_back({"loss" + of, px, loss});
      panel.series.push_back({fmt::format("running mean over {} steps{}", window, of), px, mean});
    }
    std::vector<double> vx, val;  // train.val_every: the validation loss where it was measured
    for (const auto& m : steps)
      if (m.val_loss) vx.push_back(static_cast<double>(m.step)), val.push_back(*m.val_loss);
    if (!val.empty()) panel.series.push_back({"validation loss", vx, val});
    pngs.push_back(render_plot(PlotSpec{"", {panel}}, io::join_path(out, "loss.png"), options).png);
  }
  // Throughput.
  {
    PlotPanel tokens{"throughput: " + name,
                     "step",
                     "tokens/s",
                     false,
                     false,
                     true,
                     {{"tokens/s", x, column([](const StepMetrics& m) { return m.tokens_per_s; })}}};
    PlotPanel samples{"", "step", "samples/s", false, false, true, {{"samples/s", x, column([](const StepMetrics& m) {
                                                                       return m.samples_per_s;
                                                                     })}}};
    pngs.push_back(render_plot(PlotSpec{"", {tokens, samples}}, io::join_path(out, "throughput.png"), options).png);
  }
  // Memory and transfers.
  {
    const double MiB = 1024.0 * 1024.0;
    PlotPanel peak{"device memory: " + name,
                   "step",
                   "MiB",
                   false,
                   false,
                   true,
                   {{"peak_device_bytes", x, column([&](const StepMetrics& m) { return m.peak_device_bytes / MiB; })}}};
    peak.y_from_zero = true;
    PlotSpec spec{"", {peak}};
    const bool moved = std::any_of(steps.begin(), steps.end(),
                                   [](const StepMetrics& m) { return m.h2d_bytes > 0 || m.d2h_bytes > 0; });
    if (moved) {
      spec.panels.push_back(PlotPanel{
          "bytes moved per step",
          "step",
          "MiB",
          false,
          false,
          true,
          {{"host -> device (h2d_bytes)", x, column([&](const StepMetrics& m) { return m.h2d_bytes / MiB; })},
           {"device -> host (d2h_bytes)", x, column([&](const StepMetrics& m) { return m.d2h_bytes / MiB; })}}});
      spec.panels.back().y_from_zero = true;
    }
    pngs.push_back(render_plot(spec, io::join_path(out, "memory.png"), options).png);
  }
  // The optimizer: the learning rate of each step and the gradient norm before clipping.
  {
    PlotPanel lr{
        "learning rate: " + name, "step", "lr", false, false, false, {{"lr", x, column([](const StepMetrics& m) {
                                                                         return m.lr;
                                                                       })}}};
    lr.y_from_zero = true;
    PlotPanel norm{"gradient norm (before clipping)",
                   "step",
                   "grad_norm",
                   false,
                   true,
                   true,
                   {{"grad_norm", x, column([](const StepMetrics& m) { return m.grad_norm; })}}};
    pngs.push_back(render_plot(PlotSpec{"", {lr, norm}}, io::join_path(out, "optimizer.png"), options).png);
  }
  return pngs;
}

}  // namespace megaslide
