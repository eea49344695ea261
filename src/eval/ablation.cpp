#include "megaslide/eval/ablation.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/types.h>

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>

#include "megaslide/io/files.h"
#include "megaslide/util/cpu_memory_counter.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/run_outputs.h"
#include "megaslide/train/trainer.h"
#include "megaslide/util/device.h"

namespace megaslide {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;

// --- measuring device memory ----------------------------------------------------------------------

// Peak device memory of one step: reset() before it, peak_bytes() after.
class MemoryMeter {
 public:
  explicit MemoryMeter(torch::Device device) : device_(device) {
    if (!device_.is_cuda()) util::cpu_memory_counter();
  }
#ifdef MEGASLIDE_WITH_CUDA
  // "cuda" without an index means the current device.
  c10::DeviceIndex cuda_index() const { return device_.has_index() ? device_.index() : c10::cuda::current_device(); }
#endif
  void reset() {
#ifdef MEGASLIDE_WITH_CUDA
    if (device_.is_cuda()) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_index());
      return;
    }
#endif
    auto& c = util::cpu_memory_counter();
    c.reset_peak();
    start_ = c.live();
  }
  // GPU: the allocator's peak of allocated bytes since reset(). CPU: `persistent_device_bytes` (state
  // that lives across steps on the device) plus the most bytes live since reset() beyond those at reset().
  int64_t peak_bytes(int64_t persistent_device_bytes) const {
#ifdef MEGASLIDE_WITH_CUDA
    if (device_.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index());
      return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
    }
#endif
    return persistent_device_bytes + std::max<int64_t>(0, util::cpu_memory_counter().peak() - start_);
  }
  void release_cache() {
#ifdef MEGASLIDE_WITH_CUDA
    if (device_.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  }

 private:
  torch::Device device_;
  int64_t start_ = 0;
};

// --- running one variant --------------------------------------------------------------------------

struct VariantRun {
  std::string name;
  RunConfig config;
  std::vector<StepMetrics> steps;
  std::vector<int64_t> peak_bytes;  // per step, measured (MemoryMeter)
  bool oom = false;
  std::string oom_reason;
  std::string device;

  // Steps after the first (warm-up), or all when there is only one.
  std::vector<StepMetrics> timed() const {
    if (steps.size() <= 1) return steps;
    return {steps.begin() + 1, steps.end()};
  }
  template <typename Get>
  double mean_timed(Get get) const {
    const auto t = timed();
    double s = 0.0;
    for (const auto& m : t) s += static_cast<double>(get(m));
    return t.empty() ? std::numeric_limits<double>::quiet_NaN() : s / static_cast<double>(t.size());
  }
  int64_t max_peak() const {
    int64_t p = 0;
    for (size_t i = steps.size() > 1 ? 1 : 0; i < peak_bytes.size(); ++i) p = std::max(p, peak_bytes[i]);
    return p;
  }
};

using Progress = std::function<void(const std::string&)>;

// Trains `config` for config.train.steps steps with the trainer offload.enabled picks, measuring each
// step's peak device memory. `budget_bytes` (CPU only, 0 = none): a step above it stops the run as "oom".
VariantRun train_variant(const std::string& suite, const std::string& name, const RunConfig& config,
                         int64_t budget_bytes, const Progress& progress) {
  VariantRun run;
  run.name = name;
  run.config = config;
  const torch::Device device = resolve_device(config.train.device);
  run.device = device.str();
  MemoryMeter meter(device);
  auto say = [&](const std::string& line) {
    if (progress) progress(fmt::format("[{}] {}: {}", suite, name, line));
  };
  try {
    // The trainer as a training run builds it (train/trainer.h).
    const ModelFamily& family = model_family(config.model.arch);
    const RunConfig resolved = family.resolve(config, suite + " ablation");
    TrainerRequest request;
    request.config = &resolved;
    request.requested = &config;
    request.source = suite + " ablation";
    const auto trainer = std::make_unique<Trainer>(request);
    // Device state that lives across steps (CPU accounting; on a GPU the allocator sees it all); a
    // step's gradients and activations are its own allocations.
    const int64_t persistent = trainer->persistent_device_bytes();
    say(fmt::format("{} {} trainer, {} tokens/sample, device {}, {} step{}", family.name(),
                    trainer->streams() ? "streamed (host AdamW)" : "resident (device AdamW)",
                    trainer->tokens_per_sample(), run.device, config.train.steps, config.train.steps == 1 ? "" : "s"));
    double seconds = 0.0;  // the steps so far, for the variant's ETA
    for (int64_t i = 0; i < config.train.steps; ++i) {
      meter.reset();
      StepMetrics m = trainer->step();
      const int64_t peak = meter.peak_bytes(persistent);
      run.steps.push_back(m);
      run.peak_bytes.push_back(peak);
      seconds += m.step_time_s;
      const double eta = seconds / static_cast<double>(i + 1) * static_cast<double>(config.train.steps - i - 1);
      say(fmt::format("step {}/{} loss {:.5f} {:.3f} s/step peak {:.1f} MiB, this variant's ETA {}", m.step,
                      config.train.steps, m.loss, m.step_time_s, static_cast<double>(peak) / kMiB, clock_time(eta)));
      if (!device.is_cuda() && budget_bytes > 0 && peak > budget_bytes) {
        run.oom = true;
        run.oom_reason = fmt::format("measured peak {:.1f} MiB > budget {:.1f} MiB", static_cast<double>(peak) / kMiB,
                                     static_cast<double>(budget_bytes) / kMiB);
        say("oom: " + run.oom_reason);
        break;
      }
    }
    trainer->synchronize();
  } catch (const c10::OutOfMemoryError& e) {
    run.oom = true;
    const std::string what = e.what_without_backtrace();
    run.oom_reason = "CUDA out of memory: " + what.substr(0, what.find('\n'));
    say("oom: " + run.oom_reason);
  }
  meter.release_cache();
  return run;
}

// Each suite's runs: a name and the overrides that make it (on top of the suite's base overrides).
using Variants = std::vector<std::pair<std::string, std::vector<std::string>>>;

// memory-scaling's models. dense3d-materialized writes the N x N scores out (O(N²) memory); dense3d
// runs LibTorch's fused attention (no N x N matrix kept where a fused kernel exists).
Variants scaling_models() {
  return {{"dense3d", {"model.arch=dense3d", "model.dense_attention=fused"}},
          {"dense3d-materialized", {"model.arch=dense3d", "model.dense_attention=materialized"}},
          {"swin", {"model.arch=swin"}},
          {"megaslide", {"model.arch=megaslide"}}};
}

Variants offsets_variants() {
  return {{"learned", {"model.arch=megaslide", "model.dsa_offsets=learned"}},
          {"zero", {"model.arch=megaslide", "model.dsa_offsets=zero"}},
          {"frozen", {"model.arch=megaslide", "model.dsa_offsets=frozen"}},
          {"swin", {"model.arch=swin"}}};
}

// The two runs of streaming and optimizer-location.
Variants paired_variants(const std::string& suite) {
  if (suite == "streaming")
    return {{"async", {"offload.enabled=true", "offload.mode=async"}},
            {"sync", {"offload.enabled=true", "offload.mode=sync"}}};
  return {{"host", {"offload.enabled=true", "offload.compute_dtype=fp32"}}, {"device", {"offload.enabled=false"}}};
}

RunConfig make_config(const std::string& suite, AblationSize size, const std::vector<std::string>& variant,
                      const AblationOptions& options) {
  std::vector<std::string> overrides = ablation_base_overrides(suite, size);
  overrides.insert(overrides.end(), variant.begin(), variant.end());
  overrides.push_back("train.device=" + options.device);
  overrides.insert(overrides.end(), options.overrides.begin(), options.overrides.end());
  // `auto` resolved here, so every run of a suite (and its record) uses the dtype the device runs fast.
  return resolve_auto_settings(
      parse_run_config("", fmt::format("megaslide-ablate --suite {} ({})", suite, to_string(size)), overrides));
}

// --- output ---------------------------------------------------------------------------------------

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return "nan";
  return fmt::format("{:.{}f}", v, digits);
}
std::string general(double v) {
  if (!std::isfinite(v)) return "nan";
  return fmt::format("{:.6g}", v);
}
// Enough digits to tell every fp32 value apart (losses are fp32 values; the suites compare them).
std::string exact(double v) {
  if (!std::isfinite(v)) return "nan";
  return fmt::format("{:.9g}", v);
}
// Three significant digits (timings span microseconds to minutes).
std::string sig3(double v) {
  if (!std::isfinite(v)) return "nan";
  return fmt::format("{:.3g}", v);
}
std::string mib(int64_t bytes) { return fixed(static_cast<double>(bytes) / kMiB, 2); }

void write_csv(const std::string& path, const AblationTable& t) {
  std::string text;
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t i = 0; i < cells.size(); ++i) text += (i ? "," : "") + cells[i];
    text += "\n";
  };
  line(t.columns);
  for (const auto& r : t.rows) line(r);
  try {
    io::write_file_atomically(path, text);
  } catch (const io::IoError& e) {
    throw std::runtime_error(std::string("ablation output: ") + e.what());
  }
}

std::vector<double> running_mean(const std::vector<double>& v, size_t window) {
  std::vector<double> out(v.size());
  double sum = 0.0;
  for (size_t i = 0; i < v.size(); ++i) {
    sum += v[i];
    if (i >= window) sum -= v[i - window];
    out[i] = sum / static_cast<double>(std::min(i + 1, window));
  }
  return out;
}

PlotSeries step_series(const VariantRun& r, const std::string& title,
                       const std::function<double(const StepMetrics&)>& get) {
  PlotSeries s{title, {}, {}};
  for (const auto& m : r.steps) {
    s.x.push_back(static_cast<double>(m.step));
    s.y.push_back(get(m));
  }
  return s;
}

double max_abs_loss_difference(const VariantRun& a, const VariantRun& b) {
  double d = 0.0;
  const size_t n = std::min(a.steps.size(), b.steps.size());
  for (size_t i = 0; i < n; ++i) d = std::max(d, std::abs(a.steps[i].loss - b.steps[i].loss));
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : d;
}

struct SuiteOutput {
  AblationTable csv, summary;
  PlotSpec plot;
};

// --- the suites -----------------------------------------------------------------------------------

std::vector<int64_t> scaling_frames(AblationSize size) {
  switch (size) {
    case AblationSize::kTest:
      return {4, 8, 16, 32};
    case AblationSize::kQuick:
      return {4, 8, 16, 32, 64, 128};
    case AblationSize::kFull:
      return {16, 32, 64, 128, 256};
  }
  return {};
}

SuiteOutput memory_scaling(const AblationOptions& o, std::string& device) {
  const double budget_gib = o.memory_budget_gib > 0 ? o.memory_budget_gib : default_memory_budget_gib(o.size);
  const auto budget = static_cast<int64_t>(budget_gib * kGiB);
  SuiteOutput out;
  out.csv.columns = {"arch",
                     "frames",
                     "tokens",
                     "status",
                     "peak_device_bytes",
                     "peak_device_mib",
                     "step_time_s",
                     "trainer_accounted_bytes",
                     "device"};
  out.summary.columns = {"frames", "tokens"};
  // The models: name and overrides. dense3d-materialized writes the N x N scores out (O(N²) memory);
  // dense3d runs LibTorch's fused attention (no N x N matrix kept where a fused kernel exists).
  const Variants models = scaling_models();
  for (const auto& [a, unused] : models) {
    out.summary.columns.push_back(a + " peak MiB");
    out.summary.columns.push_back(a + " s/step");
  }
  const auto frames = scaling_frames(o.size);
  std::map<std::pair<std::string, int64_t>, std::pair<std::string, std::string>> cells;  // (model, frames) -> (MiB, s)
  PlotPanel memory{"peak device memory", "frames", "MiB", true, true, true, {}};
  PlotPanel time{"step time", "frames", "seconds per step", true, true, true, {}};
  std::map<int64_t, int64_t> tokens_of;
  for (const auto& [a, model_overrides] : models) {
    PlotSeries mem_series{a, {}, {}}, time_series{a, {}, {}};
    bool exceeded = false;
    for (int64_t f : frames) {
      auto variant = model_overrides;
      variant.push_back("data.frames=" + std::to_string(f));
      const auto config = make_config("memory-scaling", o.size, variant, o);
      const int64_t tokens = (config.data.frames / config.model.patch[0]) *
                             (config.data.height / config.model.patch[1]) * (config.data.width / config.model.patch[2]);
      tokens_of[f] = tokens;
      const std::string name = fmt::format("{} frames={}", a, f);
      VariantRun run;
      if (exceeded) {
        run.oom = true;
        run.name = name;
        run.device = resolve_device(config.train.device).str();
        if (o.progress)
          o.progress(fmt::format("[memory-scaling] {}: oom (not run: fewer frames already exceeded the budget)", name));
      } else {
        run = train_variant("memory-scaling", name, config, budget, o.progress);
      }
      device = run.device;
      mem_series.x.push_back(static_cast<double>(f));
      time_series.x.push_back(static_cast<double>(f));
      if (run.oom) {
        exceeded = true;
        out.csv.rows.push_back(
            {a, std::to_string(f), std::to_string(tokens), "oom", "oom", "oom", "oom", "oom", run.device});
        cells[{a, f}] = {"oom", "oom"};
        mem_series.y.push_back(std::numeric_limits<double>::quiet_NaN());
        time_series.y.push_back(std::numeric_limits<double>::quiet_NaN());
      } else {
        const int64_t peak = run.max_peak();
        const double step_time = run.mean_timed([](const StepMetrics& m) { return m.step_time_s; });
        out.csv.rows.push_back({a, std::to_string(f), std::to_string(tokens), "ok", std::to_string(peak), mib(peak),
                                general(step_time), std::to_string(run.steps.back().peak_device_bytes), run.device});
        cells[{a, f}] = {mib(peak), sig3(step_time)};
        mem_series.y.push_back(static_cast<double>(peak) / kMiB);
        time_series.y.push_back(step_time);
      }
    }
    memory.series.push_back(mem_series);
    time.series.push_back(time_series);
  }
  for (int64_t f : frames) {
    std::vector<std::string> row{std::to_string(f), std::to_string(tokens_of[f])};
    for (const auto& [a, unused] : models) {
      const auto& c = cells[{a, f}];
      row.push_back(c.first);
      row.push_back(c.second);
    }
    out.summary.rows.push_back(row);
  }
  const std::string where = device.rfind("cuda", 0) == 0
                                ? "GPU allocator peak"
                                : fmt::format("CPU, counted; budget {} GiB", general(budget_gib));
  out.plot = PlotSpec{fmt::format("memory-scaling ({}, {})", to_string(o.size), where), {memory, time}};
  return out;
}

int64_t suite_steps(const std::string& suite, AblationSize size) {
  const std::map<std::string, std::array<int64_t, 3>> steps{
      {"offsets", {4, 100, 200}}, {"streaming", {3, 8, 20}}, {"optimizer-location", {3, 8, 20}}};
  return steps.at(suite)[static_cast<size_t>(size)];
}

// Per-step rows of several runs (loss curves and timings).
AblationTable per_step_csv(const std::string& variant_column, const std::vector<VariantRun>& runs) {
  AblationTable t;
  t.columns = {variant_column,     "step",        "loss",      "grad_norm", "step_time_s",       "exposed_transfer_s",
               "optimizer_wait_s", "optimizer_s", "h2d_bytes", "d2h_bytes", "peak_device_bytes", "device"};
  for (const auto& r : runs) {
    for (size_t i = 0; i < r.steps.size(); ++i) {
      const auto& m = r.steps[i];
      t.rows.push_back({r.name, std::to_string(m.step), exact(m.loss), exact(m.grad_norm), general(m.step_time_s),
                        general(m.exposed_transfer_s), general(m.optimizer_wait_s), general(m.optimizer_s),
                        std::to_string(m.h2d_bytes), std::to_string(m.d2h_bytes), std::to_string(r.peak_bytes[i]),
                        r.device});
    }
  }
  return t;
}

SuiteOutput offsets(const AblationOptions& o, std::string& device) {
  const int64_t steps = suite_steps("offsets", o.size);
  const Variants variants = offsets_variants();
  std::vector<VariantRun> runs;
  for (const auto& [name, overrides] : variants) {
    auto v = overrides;
    v.push_back("train.steps=" + std::to_string(steps));
    runs.push_back(train_variant("offsets", name, make_config("offsets", o.size, v, o), 0, o.progress));
    device = runs.back().device;
  }
  SuiteOutput out;
  out.csv = per_step_csv("variant", runs);
  // The steps the runs took (a --set train.steps overrides the suite's).
  const size_t taken = runs.front().steps.size();
  const size_t tail = std::max<size_t>(1, taken / 4);
  const size_t window = std::max<size_t>(1, taken / 10);
  out.summary.columns = {"variant",  "first loss", fmt::format("mean loss, last {} steps", tail),
                         "min loss", "vs learned", "s/step"};
  double learned_tail = 0.0;
  PlotPanel panel{
      fmt::format("loss (running mean over {} steps)", window), "step", "loss (ε-MSE)", false, false, false, {}};
  for (const auto& r : runs) {
    double tail_sum = 0.0, min_loss = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < r.steps.size(); ++i) {
      if (i + tail >= r.steps.size()) tail_sum += r.steps[i].loss;
      min_loss = std::min(min_loss, r.steps[i].loss);
    }
    const double tail_mean = tail_sum / static_cast<double>(std::min(tail, r.steps.size()));
    if (r.name == "learned") learned_tail = tail_mean;
    out.summary.rows.push_back(
        {r.name, fixed(r.steps.front().loss, 4), fixed(tail_mean, 4), fixed(min_loss, 4),
         r.name == "learned" ? "—" : fmt::format("{:+.1f}%", 100.0 * (tail_mean / learned_tail - 1.0)),
         sig3(r.mean_timed([](const StepMetrics& m) { return m.step_time_s; }))});
    auto s = step_series(r, r.name, [](const StepMetrics& m) { return m.loss; });
    s.y = running_mean(s.y, window);
    panel.series.push_back(s);
  }
  out.plot =
      PlotSpec{fmt::format("offsets ({}): learned vs fixed offsets vs Swin windows", to_string(o.size)), {panel}};
  return out;
}

// Two runs of the same model and data that should give the same losses: timings and the loss check.
SuiteOutput paired(const AblationOptions& o, std::string& device, const std::string& suite, const std::string& column) {
  const Variants variants = paired_variants(suite);
  const int64_t steps = suite_steps(suite, o.size);
  std::vector<VariantRun> runs;
  for (const auto& [name, overrides] : variants) {
    auto v = overrides;
    v.push_back("train.steps=" + std::to_string(steps));
    runs.push_back(train_variant(suite, name, make_config(suite, o.size, v, o), 0, o.progress));
    device = runs.back().device;
  }
  SuiteOutput out;
  out.csv = per_step_csv(column, runs);
  const double diff = max_abs_loss_difference(runs[0], runs[1]);
  double loss_scale = 0.0;
  for (const auto& m : runs[0].steps) loss_scale = std::max(loss_scale, std::abs(m.loss));
  const double t0 = runs[0].mean_timed([](const StepMetrics& m) { return m.step_time_s; });
  out.summary.columns = {column,
                         "trainer",
                         "s/step",
                         "exposed transfer s/step",
                         "optimizer wait s/step",
                         "optimizer s/step",
                         "H2D MiB/step",
                         "D2H MiB/step",
                         "peak device MiB",
                         "step time vs first",
                         "max abs Δ loss vs first",
                         "final loss"};
  for (const auto& r : runs) {
    const double t = r.mean_timed([](const StepMetrics& m) { return m.step_time_s; });
    out.summary.rows.push_back(
        {r.name,
         r.config.offload.enabled ? "streamed, " + r.config.offload.compute_dtype : std::string("resident, fp32"),
         sig3(t), sig3(r.mean_timed([](const StepMetrics& m) { return m.exposed_transfer_s; })),
         sig3(r.mean_timed([](const StepMetrics& m) { return m.optimizer_wait_s; })),
         sig3(r.mean_timed([](const StepMetrics& m) { return m.optimizer_s; })),
         fixed(r.mean_timed([](const StepMetrics& m) { return static_cast<double>(m.h2d_bytes); }) / kMiB, 2),
         fixed(r.mean_timed([](const StepMetrics& m) { return static_cast<double>(m.d2h_bytes); }) / kMiB, 2),
         mib(r.max_peak()), fmt::format("{:.2f}x", t / t0),
         &r == &runs[0] ? "—" : fmt::format("{:.3g} (losses up to {:.3g})", diff, loss_scale),
         fixed(r.steps.back().loss, 5)});
  }
  PlotPanel time{"step time", "step", "seconds", false, false, true, {}};
  PlotPanel opt{"optimizer time (optimizer_s) and exposed transfer time", "step", "seconds", false, false, true, {}};
  PlotPanel loss{
      fmt::format("loss (max |Δ| between the two: {:.3g})", diff), "step", "loss (ε-MSE)", false, false, true, {}};
  for (const auto& r : runs) {
    time.series.push_back(step_series(r, r.name, [](const StepMetrics& m) { return m.step_time_s; }));
    opt.series.push_back(step_series(r, r.name + " optimizer", [](const StepMetrics& m) { return m.optimizer_s; }));
    opt.series.push_back(
        step_series(r, r.name + " exposed transfer", [](const StepMetrics& m) { return m.exposed_transfer_s; }));
    loss.series.push_back(step_series(r, r.name, [](const StepMetrics& m) { return m.loss; }));
  }
  out.plot = PlotSpec{fmt::format("{} ({})", suite, to_string(o.size)), {time, opt, loss}};
  return out;
}

}  // namespace

const char* to_string(AblationSize size) {
  switch (size) {
    case AblationSize::kTest:
      return "test";
    case AblationSize::kQuick:
      return "quick";
    case AblationSize::kFull:
      return "full";
  }
  return "?";
}

AblationSize parse_ablation_size(const std::string& name) {
  if (name == "test") return AblationSize::kTest;
  if (name == "quick") return AblationSize::kQuick;
  if (name == "full") return AblationSize::kFull;
  throw std::invalid_argument("ablation size: expected test | quick | full, got '" + name + "'");
}

std::vector<std::string> ablation_suites() { return {"memory-scaling", "offsets", "streaming", "optimizer-location"}; }

double default_memory_budget_gib(AblationSize size) {
  // CPU only (a GPU's own memory is the budget there): a small accelerator for the small sizes. At
  // kQuick the written-out N x N scores of dense3d-materialized exceed it at the largest frame count
  // while every other model fits (docs/ablations.md has the measured peaks); at kTest everything fits.
  switch (size) {
    case AblationSize::kTest:
      return 1.0;
    case AblationSize::kQuick:
      return 0.5;
    case AblationSize::kFull:
      return 64.0;
  }
  return 0.0;
}

std::vector<std::string> ablation_base_overrides(const std::string& suite, AblationSize size) {
  const auto suites = ablation_suites();
  if (std::find(suites.begin(), suites.end(), suite) == suites.end())
    throw std::invalid_argument("unknown ablation suite '" + suite + "'");
  std::vector<std::string> o{"output.progress=false",      "train.log_every=1000", "train.weight_decay=0.0",
                             "train.lr_schedule=constant", "train.seed=0",         "data.seed=1234"};
  auto add = [&](std::initializer_list<const char*> more) { o.insert(o.end(), more.begin(), more.end()); };
  if (size == AblationSize::kFull) {
    // The paper's §10 sizes (H100 NVL experiments); for a GPU with a large host RAM.
    if (suite == "memory-scaling") {
      add({"model.patch=[1,8,8]", "model.hidden=2048", "model.layers=12", "model.heads=32", "model.text_dim=4096",
           "model.dsa_kernel=[3,7,7]", "data.height=64", "data.width=64", "train.batch_size=1", "train.steps=3",
           "train.lr=1e-4", "train.warmup_steps=0", "data.num_clips=64"});
    } else if (suite == "offsets") {
      add({"model.patch=[1,8,8]", "model.hidden=512", "model.layers=4", "model.heads=8", "model.text_dim=512",
           "model.dsa_kernel=[3,7,7]", "data.frames=256", "data.height=64", "data.width=64", "train.batch_size=1",
           "train.lr=1e-4", "train.warmup_steps=10", "data.num_clips=512"});
    } else {
      add({"model.patch=[1,8,8]", "model.hidden=2048", "model.layers=12", "model.heads=32", "model.text_dim=4096",
           "model.dsa_kernel=[3,7,7]", "data.frames=16", "data.height=64", "data.width=64", "train.batch_size=1",
           "train.lr=1e-4", "train.warmup_steps=0", "data.num_clips=64"});
    }
    return o;
  }
  const bool test = size == AblationSize::kTest;
  add({"model.patch=[1,2,2]", "model.heads=2", "model.text_dim=16", "model.dsa_kernel=[3,5,5]",
       "model.swin_window=[3,4,4]", "data.height=16", "data.width=16", "data.frames=8", "data.num_clips=64",
       "train.lr=3e-3", "train.warmup_steps=2", "offload.optimizer_threads=1"});
  if (suite == "memory-scaling") {
    add({"model.hidden=16", "train.batch_size=1", "train.steps=2"});
    o.push_back(test ? "model.layers=1" : "model.layers=2");
  } else if (suite == "offsets") {
    add({"model.hidden=16", "model.layers=2", "train.batch_size=4"});
  } else {
    // Enough weight per block that copies and updates show in the timings.
    o.push_back(test ? "model.hidden=16" : "model.hidden=64");
    o.push_back(test ? "model.layers=2" : "model.layers=4");
    o.push_back(test ? "train.batch_size=1" : "train.batch_size=2");
    o.push_back(test ? "model.heads=2" : "model.heads=4");
  }
  return o;
}

std::string AblationTable::markdown() const {
  std::string s = "|";
  for (const auto& c : columns) s += " " + c + " |";
  s += "\n|";
  for (size_t i = 0; i < columns.size(); ++i) s += " --- |";
  s += "\n";
  for (const auto& r : rows) {
    s += "|";
    for (const auto& c : r) s += " " + c + " |";
    s += "\n";
  }
  return s;
}

AblationTable read_ablation_csv(const std::string& path) {
  std::istringstream in(io::read_file(path));  // the checked open: a regular file only
  AblationTable t;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (!line.empty() && line.back() == ',') cells.emplace_back();
    if (n == 1) {
      t.columns = cells;
    } else {
      if (cells.size() != t.columns.size())
        throw std::runtime_error(
            fmt::format("{}:{}: {} cells, the header has {}", path, n, cells.size(), t.columns.size()));
      t.rows.push_back(cells);
    }
  }
  if (t.columns.empty()) throw std::runtime_error("'" + path + "' is empty");
  return t;
}

void check_ablation_configs(const AblationOptions& o) {
  // The device must exist, as megaslide-train checks train.device before the first step.
  const auto check_device = [&o](const RunConfig& config) {
    try {
      resolve_device(config.train.device);
    } catch (const c10::Error& e) {
      throw std::invalid_argument("--device " + o.device + ": " + error_message(e));
    }
  };
  // The keys the suite's runs differ in are the suite's: a --set of one would give every run its value, and the
  // table would compare one run with itself under the variants' names.
  std::set<std::string> varied;
  const Variants variants = o.suite == "memory-scaling" ? scaling_models()
                            : o.suite == "offsets"      ? offsets_variants()
                                                        : paired_variants(o.suite);
  for (const auto& variant : variants)
    for (const auto& setting : variant.second) varied.insert(setting.substr(0, setting.find('=')));
  if (o.suite == "memory-scaling") varied.insert("data.frames");
  for (const auto& setting : o.overrides) {
    const std::string key = setting.substr(0, setting.find('='));
    if (varied.count(key) > 0) {
      std::string keys;
      for (const auto& k : varied) keys += (keys.empty() ? "" : ", ") + k;
      throw std::invalid_argument(fmt::format(
          "--set {}: the {} suite varies {} from run to run ({}): set for all of them, its rows would not compare "
          "what they are named for",
          setting, o.suite, key, keys));
    }
  }
  if (o.suite == "memory-scaling") {
    for (const auto& [name, overrides] : variants)
      for (int64_t f : scaling_frames(o.size)) {
        auto v = overrides;
        v.push_back("data.frames=" + std::to_string(f));
        check_device(make_config(o.suite, o.size, v, o));
      }
    return;
  }
  for (const auto& [name, overrides] : variants) {
    auto v = overrides;
    v.push_back("train.steps=" + std::to_string(suite_steps(o.suite, o.size)));
    check_device(make_config(o.suite, o.size, v, o));
  }
}

AblationReport run_ablation(const AblationOptions& options) {
  const auto suites = ablation_suites();
  if (std::find(suites.begin(), suites.end(), options.suite) == suites.end()) {
    std::string list;
    for (const auto& s : suites) list += (list.empty() ? "" : " | ") + s;
    throw std::invalid_argument("unknown ablation suite '" + options.suite + "'; expected one of " + list);
  }
  if (options.out_dir.empty()) throw std::invalid_argument("ablation: no output folder given");
  if (options.memory_budget_gib < 0) throw std::invalid_argument("ablation: the memory budget must be >= 0 GiB");
  // Every run's config is checked, and gnuplot found, before anything runs or is written.
  check_ablation_configs(options);
  find_gnuplot(options.plot);
  try {
    io::make_directories(options.out_dir);
  } catch (const io::IoError& e) {
    throw std::runtime_error(std::string("ablation output folder: ") + e.what());
  }

  AblationReport report;
  report.suite = options.suite;
  SuiteOutput out;
  if (options.suite == "memory-scaling") {
    out = memory_scaling(options, report.device);
  } else if (options.suite == "offsets") {
    out = offsets(options, report.device);
  } else if (options.suite == "streaming") {
    out = paired(options, report.device, "streaming", "mode");
  } else {
    out = paired(options, report.device, "optimizer-location", "location");
  }
  const std::string stem = io::join_path(options.out_dir, options.suite);
  report.csv_path = stem + ".csv";
  report.markdown_path = stem + ".md";
  write_csv(report.csv_path, out.csv);
  report.summary = out.summary;
  try {
    io::write_file_atomically(report.markdown_path,
                              fmt::format("### {} ({} size, device {})\n\n{}", options.suite, to_string(options.size),
                                          report.device, out.summary.markdown()));
  } catch (const io::IoError& e) {
    throw std::runtime_error(std::string("ablation output: ") + e.what());
  }
  report.png_path = render_plot(out.plot, stem + ".png", options.plot).png;
  return report;
}

}  // namespace megaslide
