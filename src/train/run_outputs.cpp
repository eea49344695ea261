#include "megaslide/train/run_outputs.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string_view>

#include "megaslide/io/event_file.h"
#include "megaslide/io/files.h"
#include "megaslide/io/vbench_layout.h"
#include "megaslide/io/video.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/offload/cpu_adamw.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/wan_family.h"

namespace megaslide {

RunDirectory::RunDirectory(const std::string& path, const RunConfig& resolved) : path_(path) {
  try {
    io::make_directories(path_);
    io::write_file_atomically(file("config.yaml"), to_yaml(resolved));
  } catch (const io::IoError& e) {
    throw OutputError(std::string("run directory: ") + e.what());
  }
}

std::string RunDirectory::file(const std::string& name) const { return io::join_path(path_, name); }

MetricsWriter::MetricsWriter(const std::string& path, int64_t keep_through_step) : path_(path) {
  if (keep_through_step >= 0 && io::path_exists(path)) {
    // A resumed run: keep the lines of steps up to the checkpoint (the run may have gone further
    // before it stopped), rewritten atomically, then append.
    std::string kept;
    std::istringstream in(io::read_file(path));
    std::string line;
    std::vector<int64_t> unreadable;  // line numbers
    int64_t number = 0, last = 0;
    while (std::getline(in, line)) {
      ++number;
      if (line.empty()) continue;
      last = number;
      try {
        const auto j = nlohmann::json::parse(line);
        if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) {
          unreadable.push_back(number);
          continue;
        }
        if (j["step"].get<int64_t>() <= keep_through_step) kept += line + "\n";
      } catch (const nlohmann::json::exception&) {
        unreadable.push_back(number);
      }
    }
    // The last line torn by a crash is expected; any other is said (resume's caller logs it).
    for (const int64_t n : unreadable)
      if (n != last) dropped_.push_back("line " + std::to_string(n));
    try {
      io::write_file_atomically(path, kept);
    } catch (const io::IoError& e) {
      throw OutputError(e.what());
    }
  }
  try {
    out_ = std::make_unique<io::OutputFile>(path, /*append=*/keep_through_step >= 0);
  } catch (const io::IoError& e) {
    throw OutputError(e.what());
  }
}

void MetricsWriter::write(const StepMetrics& m) {
  nlohmann::json j{{"step", m.step},
                   {"loss", m.loss},
                   {"lr", m.lr},
                   {"grad_norm", m.grad_norm},
                   {"step_time_s", m.step_time_s},
                   {"tokens_per_s", m.tokens_per_s},
                   {"samples_per_s", m.samples_per_s},
                   {"h2d_bytes", m.h2d_bytes},
                   {"d2h_bytes", m.d2h_bytes},
                   {"exposed_transfer_s", m.exposed_transfer_s},
                   {"optimizer_wait_s", m.optimizer_wait_s},
                   {"optimizer_s", m.optimizer_s},
                   {"peak_device_bytes", m.peak_device_bytes},
                   {"data_wait_s", m.data_wait_s}};
  if (m.mfu > 0) j["mfu"] = m.mfu;
  if (m.loss_scale > 0) j["loss_scale"] = m.loss_scale;
  if (m.exchange_bytes > 0) {  // several ranks: the streamed trainer's shard exchange, the resident all-reduce
    j["exchange_bytes"] = m.exchange_bytes;
    j["exchange_s"] = m.exchange_s;
  }
  if (m.nvme) {  // the NVMe tier
    j["nvme_read_bytes"] = m.nvme_read_bytes;
    j["nvme_write_bytes"] = m.nvme_write_bytes;
    j["nvme_read_s"] = m.nvme_read_s;
    j["nvme_write_s"] = m.nvme_write_s;
    j["nvme_wait_s"] = m.nvme_wait_s;
  }
  if (!m.part.empty()) j["part"] = m.part;
  if (m.val_loss) j["val_loss"] = *m.val_loss;
  j["skipped"] = m.skipped;
  j["skipped_total"] = m.skipped_total;
  try {
    out_->write(j.dump() + "\n");
  } catch (const io::IoError& e) {
    throw OutputError(e.what());
  }
}

namespace {
double wall_time_now() {
  return static_cast<double>(
             std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
                 .count()) *
         1e-6;
}
}  // namespace

struct TensorBoardLog::Impl {
  std::unique_ptr<io::EventFileWriter> events;
};

TensorBoardLog::TensorBoardLog(const std::string& dir, const RunConfig& resolved, int64_t first_step)
    : impl_(std::make_unique<Impl>()) {
  try {
    impl_->events = std::make_unique<io::EventFileWriter>(dir);
    if (first_step > 0)
      impl_->events->restart(first_step + 1, wall_time_now());  // a resumed run: its steps from here on
    impl_->events->text("config", first_step, "```yaml\n" + to_yaml(resolved) + "```\n", wall_time_now());
  } catch (const io::IoError& e) {
    throw OutputError(std::string("output.tensorboard: ") + e.what());
  }
}

TensorBoardLog::~TensorBoardLog() = default;

const std::string& TensorBoardLog::path() const { return impl_->events->path(); }

void TensorBoardLog::step(const StepMetrics& m) {
  std::vector<std::pair<std::string, double>> v{{"train/loss", m.loss},
                                                {"train/lr", m.lr},
                                                {"train/grad_norm", m.grad_norm},
                                                {"throughput/samples_per_s", m.samples_per_s},
                                                {"throughput/tokens_per_s", m.tokens_per_s},
                                                {"time/step_s", m.step_time_s},
                                                {"time/data_wait_s", m.data_wait_s},
                                                {"time/optimizer_s", m.optimizer_s},
                                                {"time/exposed_transfer_s", m.exposed_transfer_s},
                                                {"memory/peak_device_bytes", static_cast<double>(m.peak_device_bytes)},
                                                {"transfer/h2d_bytes", static_cast<double>(m.h2d_bytes)},
                                                {"transfer/d2h_bytes", static_cast<double>(m.d2h_bytes)},
                                                {"train/skipped_total", static_cast<double>(m.skipped_total)}};
  if (m.mfu > 0) v.emplace_back("throughput/mfu", m.mfu);
  if (m.loss_scale > 0) v.emplace_back("train/loss_scale", m.loss_scale);
  if (m.val_loss) v.emplace_back("validation/loss", *m.val_loss);
  if (m.exchange_bytes > 0) v.emplace_back("exchange/bytes", static_cast<double>(m.exchange_bytes));
  if (m.nvme) {
    v.emplace_back("nvme/read_bytes", static_cast<double>(m.nvme_read_bytes));
    v.emplace_back("nvme/write_bytes", static_cast<double>(m.nvme_write_bytes));
    v.emplace_back("nvme/wait_s", m.nvme_wait_s);
  }
  if (!m.part.empty()) v.emplace_back("train/loss_" + m.part, m.loss);  // one curve per expert
  try {
    impl_->events->scalars(m.step, v, wall_time_now());
  } catch (const io::IoError& e) {
    throw OutputError(std::string("output.tensorboard: ") + e.what());
  }
}

void TensorBoardLog::videos(int64_t step, const std::string& folder, const std::vector<std::string>& files) {
  for (const auto& file : files) {
    try {
      const auto frames =
          io::read_video(io::join_path(io::join_path(folder, io::kVideosFolder), file));  // [T, H, W, 3] uint8
      const int64_t T = frames.size(0), shown = std::min<int64_t>(T, 8);
      std::vector<torch::Tensor> picked;
      for (int64_t k = 0; k < shown; ++k) picked.push_back(frames[shown == 1 ? 0 : k * (T - 1) / (shown - 1)]);
      const auto strip = torch::cat(picked, 1).contiguous();  // [H, shown·W, 3]
      const std::string png = io::encode_png(strip, "the validation strip of " + file);
      impl_->events->image("validation/" + file, step, png, strip.size(0), strip.size(1), wall_time_now());
    } catch (const std::exception& e) {
      throw OutputError(fmt::format("output.tensorboard: the validation video {}: {}", file, e.what()));
    }
  }
}

namespace {
// spdlog's file sink opens its file with fopen, which follows a symbolic link at the name; this one
// writes through io::OutputFile (no link followed, 0644, regular files only).
// A write that fails (no space) is said once on stderr, by name and reason, and the run goes on: the log is the
// run's narrative, metrics.jsonl and the checkpoints its record (their failures stop the run).
class OutputFileSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  OutputFileSink(const std::string& path, bool append) : file_(path, append) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t text;
    formatter_->format(msg, text);
    try {
      file_.write(text.data(), text.size());
    } catch (const io::IoError& e) {
      if (!failed_)
        std::fprintf(stderr, "megaslide: warning: %s; the log misses lines from here on, the run goes on\n", e.what());
      failed_ = true;
    }
  }
  void flush_() override {}  // every write goes straight to the file

 private:
  io::OutputFile file_;
  bool failed_ = false;
};
}  // namespace

struct TrainLog::Impl {
  std::shared_ptr<spdlog::logger> logger;
};

namespace {
// The console's "%*": "warning: " or "error: " before a message of that level, nothing before the others.
class LevelPrefix final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string_view prefix = msg.level == spdlog::level::warn  ? "warning: "
                                    : msg.level >= spdlog::level::err ? "error: "
                                                                      : "";
    dest.append(prefix.data(), prefix.data() + prefix.size());
  }
  std::unique_ptr<spdlog::custom_flag_formatter> clone() const override { return std::make_unique<LevelPrefix>(); }
};
}  // namespace

TrainLog::TrainLog(const std::string& path, bool append, bool echo) : impl_(std::make_unique<Impl>()) {
  try {
    std::shared_ptr<spdlog::sinks::sink> file;
    try {
      file = std::make_shared<OutputFileSink>(path, append);
    } catch (const io::IoError& e) {
      throw OutputError(std::string("cannot open the log: ") + e.what());
    }
    auto console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    file->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
    // On a terminal the progress bar stays on its line without a newline: a log line first clears it
    // (the next step redraws the bar below) instead of continuing it. A warning or an error says so ("warning: "),
    // as the file's [warning] does.
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<LevelPrefix>('*').set_pattern(isatty(STDERR_FILENO) == 1 ? "\r\033[K%*%v" : "%*%v");
    console->set_formatter(std::move(formatter));
    impl_->logger = echo ? std::make_shared<spdlog::logger>("megaslide", spdlog::sinks_init_list{file, console})
                         : std::make_shared<spdlog::logger>("megaslide", file);
    impl_->logger->flush_on(spdlog::level::info);
  } catch (const spdlog::spdlog_ex& e) {
    throw OutputError("cannot open the log '" + path + "': " + e.what());
  }
}

TrainLog::~TrainLog() = default;
void TrainLog::info(const std::string& message) { impl_->logger->info(message); }
void TrainLog::warn(const std::string& message) { impl_->logger->warn(message); }

ProgressLine::ProgressLine(int64_t total_steps, int64_t every, bool enabled, int64_t first_step)
    : total_(total_steps),
      every_(std::max<int64_t>(every, 1)),
      first_step_(first_step),
      enabled_(enabled),
      tty_(isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()) {}

std::string clock_time(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

void ProgressLine::update(const StepMetrics& m) {
  // The loss's moving average (weight 0.1 a step), from this process's first step; the rate is of the steps this
  // process ran (a resumed run's first steps are the checkpoint's).
  loss_ema_ = m.step == first_step_ + 1 ? m.loss : 0.9 * loss_ema_ + 0.1 * m.loss;
  // A step of one part (Wan2.2's two experts trained together) averages with that part's steps only.
  double average = loss_ema_;
  if (!m.part.empty()) {
    const auto it = part_ema_.find(m.part);
    average = part_ema_[m.part] = it == part_ema_.end() ? m.loss : 0.9 * it->second + 0.1 * m.loss;
  }
  if (!enabled_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = static_cast<double>(m.step - first_step_) / std::max(elapsed, 1e-9);
  const double eta = static_cast<double>(total_ - m.step) / std::max(rate, 1e-9);
  // The NVMe tier: the step's reads and write-backs as rates over the step, and the compute's wait for them.
  const std::string nvme = m.nvme && m.step_time_s > 0
                               ? fmt::format(" | NVMe {:.2g}+{:.2g} GB/s, waited {:.0f}%",
                                             static_cast<double>(m.nvme_read_bytes) / 1e9 / m.step_time_s,
                                             static_cast<double>(m.nvme_write_bytes) / 1e9 / m.step_time_s,
                                             100.0 * m.nvme_wait_s / m.step_time_s)
                               : std::string();
  const std::string line =
      fmt::format("step {:>{}}/{}{} | loss {:.4f} ({}avg {:.4f}) | {:.2f} it/s | {:.3g} tok/s{} | ETA {}", m.step,
                  std::to_string(total_).size(), total_, m.part.empty() ? "" : " [" + m.part + "]", m.loss,
                  m.part.empty() ? "" : m.part + " ", average, rate, m.tokens_per_s, nvme, clock_time(eta));
  if (tty_) {
    std::fprintf(stderr, "\r%s\033[K", line.c_str());
    std::fflush(stderr);
  } else if (m.step % every_ == 0 || m.step == total_) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

void ProgressLine::finish() {
  if (enabled_ && tty_) std::fprintf(stderr, "\n");
}

std::string human_count(double n) {
  const char* units[] = {"", " K", " M", " B", " T"};
  int u = 0;
  while (std::abs(n) >= 1000.0 && u < 4) n /= 1000.0, ++u;
  return fmt::format("{:.{}f}{}", n, u == 0 ? 0 : 2, units[u]);
}

HostStatePerParameter host_state_per_parameter(const RunConfig& resolved) {
  // The resident loop computes in fp32 whatever the config says (unused_settings warns of it).
  const std::string compute = resolved.offload.enabled ? resolved.offload.compute_dtype : "fp32";
  const double copy = compute == "fp32" ? 4.0 : 2.0;
  if (resolved.lora.rank > 0) {
    if (!resolved.offload.enabled) return {4.0, 0.0, "the frozen model's fp32 weights"};
    if (resolved.lora.base_dtype == "fp8") return {1.0, 0.0, "the frozen model's fp8 weights"};
    return {copy, 0.0, "the frozen model's " + compute + " weights"};
  }
  const auto state = offload::parse_state_dtype(resolved.optimizer.state_dtype);
  const double moment_bytes = static_cast<double>(offload::state_element_bytes(state)) +
                              (state == offload::StateDtype::kInt8 ? 4.0 / 256 : 0.0);
  // The NVMe tier keeps the masters, moments and EMA in its file (a few blocks' in RAM at a time: dry_run_json adds
  // them); master_and_moments is then what a parameter holds there.
  if (resolved.offload.enabled && resolved.offload.state_tier == "nvme")
    return {copy, 4.0 + 2.0 * moment_bytes + (resolved.train.ema_decay > 0 ? 4.0 : 0.0),
            "a " + compute + " compute copy (the masters and moments on NVMe)"};
  HostStatePerParameter out{4.0 + 2.0 * moment_bytes + copy, 4.0 + 2.0 * moment_bytes,
                            "fp32 weights, AdamW moments (" + resolved.optimizer.state_dtype + "), " +
                                (resolved.offload.enabled ? "a " + compute + " compute copy" : "fp32 gradients")};
  if (resolved.train.ema_decay > 0) {
    out.bytes += 4.0;
    out.what += ", an fp32 EMA";
  }
  return out;
}

std::string dry_run_json(const RunConfig& requested) {
  // Wan: the hyper-parameters of model.wan.weights when set (their config.json or shapes).
  const RunConfig config = with_wan_architecture_from_weights(requested);
  if (config.model.arch == Architecture::kWan) check_expert_training(config, "config");
  const bool wan = config.model.arch == Architecture::kWan;
  const auto count = count_run_parameters(config);
  const auto& p = wan ? config.model.wan.patch : config.model.patch;  // validated: the video divides into whole patches
  const auto shape = model_sample_shape(config);                      // pixels, or the VAE's latents
  const TokenGrid grid{shape[1] / p[0], shape[2] / p[1], shape[3] / p[2]};
  const auto resolved = resolve_auto_settings(config);
  const auto per = host_state_per_parameter(resolved);
  auto host_state = std::llround(per.bytes * static_cast<double>(count.total));
  // The NVMe tier's in-flight buffers: nvme_blocks_in_flight blocks' state, each rounded up to 4 KiB per part.
  const int64_t blocks =
      (wan ? config.model.wan.layers : config.model.layers) * (wan && config.model.wan.expert == "both" ? 2 : 1);
  if (resolved.offload.enabled && resolved.offload.state_tier == "nvme" && resolved.lora.rank == 0)
    host_state +=
        std::min(resolved.offload.nvme_blocks_in_flight, blocks) *
        ((std::llround(per.master_and_moments * static_cast<double>(count.per_block)) + 4 * 4096) / 4096 * 4096);
  nlohmann::json j{{"arch", to_string(config.model.arch)},
                   {"params", count.total},
                   {"params_per_block", count.per_block},
                   {"prologue_params", count.prologue},
                   {"epilogue_params", count.epilogue},
                   {"layers", wan ? config.model.wan.layers : config.model.layers},
                   {"hidden", wan ? config.model.wan.dim : config.model.hidden},
                   {"tokens_per_sample", grid.numel()},
                   {"token_grid", {grid.t, grid.h, grid.w}},
                   {"host_state_bytes", host_state},
                   {"device", config.train.device},
                   {"compute_dtype", resolved.offload.enabled ? resolved.offload.compute_dtype : "fp32"}};
  return j.dump();
}

}  // namespace megaslide
