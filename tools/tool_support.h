// What every megaslide-* driver shares: flag checks built on the library's one numeric parser
// (util/numbers.h), so that a flag takes exactly the numbers a config key takes (no nan, no inf, no
// 1e400); the one way a tool turns errors into its exit code and message (run_tool); and the process
// settings a long-running tool needs.
#pragma once

#include <CLI/CLI.hpp>

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/io/files.h"
#include "megaslide/util/cpu_tensor_cache.h"
#include "megaslide/util/errors.h"
#include "megaslide/util/numbers.h"

namespace megaslide::tools {

// Bad input a tool finds itself (flags that disagree, a file that does not fit): exit 2.
class UsageError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

// Parses the flags: nullopt to go on, else the exit code: 0 for --help and --version (CLI11 prints them), 2 for a
// bad flag, with one line on stderr as run_tool writes errors, "NAME: MESSAGE (--help lists the flags)": CLI11's
// message, or the first unknown flag with the known one nearest to it, or a misspelt or missing subcommand with
// the choices.
inline std::optional<int> parse_flags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::string name = argc > 0 && argv[0] != nullptr ? argv[0] : "megaslide";
    if (const auto slash = name.find_last_of('/'); slash != std::string::npos) name = name.substr(slash + 1);
    std::string message = e.what();
    for (char& c : message)
      if (c == '\n') c = ' ';
    const auto subcommands = app.get_subcommands([](CLI::App*) { return true; });
    // A misspelt flag: CLI11 names a required flag first ("--config is required" for --confg), or lists the
    // misspelt flag with its value; name the flag, and the nearest one the tool knows.
    // The flags of the subcommand given (every subcommand's when none was: a flag of one is known, and then
    // CLI11's message stands).
    std::vector<std::string> known;
    auto add_names = [&known](const CLI::App& a) {
      for (const auto* option : a.get_options())
        for (const auto& n : option->get_lnames()) known.push_back("--" + n);
    };
    add_names(app);
    bool any_parsed = false;
    for (const auto* sub : subcommands) any_parsed = any_parsed || sub->parsed();
    for (const auto* sub : subcommands)
      if (!any_parsed || sub->parsed()) add_names(*sub);
    // What CLI11 reads as a long flag: "--" and a name of letters, digits, '_', '-' and '.' (a value such as
    // "-- blurry" is a value).
    const auto long_flag = [](const std::string& arg) {
      if (arg.size() < 3 || arg.compare(0, 2, "--") != 0 || !std::isalnum(static_cast<unsigned char>(arg[2])))
        return false;
      for (size_t k = 2; k < arg.size() && arg[k] != '='; ++k)
        if (!std::isalnum(static_cast<unsigned char>(arg[k])) && arg[k] != '_' && arg[k] != '-' && arg[k] != '.')
          return false;
      return true;
    };
    for (int i = 1; i < argc && argv[i] != nullptr && std::string(argv[i]) != "--"; ++i) {
      const std::string arg = argv[i];
      if (!long_flag(arg)) continue;
      const std::string flag = arg.substr(0, arg.find('='));
      if (std::find(known.begin(), known.end(), flag) != known.end()) continue;
      message = "unknown flag '" + flag + "'";
      std::string nearest;
      size_t best = 3;  // near misses only
      for (const auto& k : known)
        if (const size_t d = edit_distance(flag, k); d < best) best = d, nearest = k;
      if (!nearest.empty()) message += " (did you mean " + nearest + "?)";
      break;
    }
    // A tool of subcommands: CLI11 says "A subcommand is required" for a misspelt one too; name it and the choices.
    std::string choices;
    bool named = false;
    for (size_t i = 0; i < subcommands.size(); ++i) {
      choices += (i == 0 ? "" : i + 1 == subcommands.size() ? " or " : ", ") + subcommands[i]->get_name();
      named = named || subcommands[i]->parsed();
    }
    if (!choices.empty() && !named) {
      if (argc > 1 && argv[1] != nullptr && argv[1][0] != '-')
        message = "unknown subcommand '" + std::string(argv[1]) + "': give " + choices;
      else if (argc < 2) message = "a subcommand is needed: " + choices;
    }
    std::cerr << name + ": " + message + " (--help lists the flags)\n"
              << std::flush;  // one write: ranks' lines stay whole
    return 2;
  }
}

// A read of a memory-mapped file whose bytes went missing — a cache shard or weights file truncated or rewritten in
// place by another process while this one reads it — ends the process with SIGBUS, which said nothing: one line names
// the file (io::mapped_file_at) and what to do, the temporaries are removed, and the process ends by SIGBUS as it
// would have (write(2) alone: async-signal-safe).
inline void on_mapped_file_fault(int signal, siginfo_t* info, void*) {
  static std::atomic<bool> said{false};  // threads faulting at once: one says it
  if (!said.exchange(true)) {
    megaslide::io::remove_temporary_files();
    // A page of a mapping past its file's end is BUS_ADRERR; SIGBUS sent by kill(2), an alignment fault or a
    // hardware memory error is another si_code, and no file's doing.
    const bool mapped = info != nullptr && info->si_code == BUS_ADRERR;
    const char* file = mapped ? megaslide::io::mapped_file_at(info->si_addr) : nullptr;
    const char* what =
        !mapped ? "ended by SIGBUS (not a read of a memory-mapped file)\n"
                : " read through a memory map lost the bytes being read (SIGBUS): it was truncated or rewritten in "
                  "place while this process read it. Replace such a file (a cache shard, weights) by writing a new one "
                  "and renaming it over the old, never in place; a training run resumes from its last checkpoint\n";
    for (const char* part : {"\n", static_cast<const char*>(program_invocation_short_name), ": ",
                             !mapped           ? ""
                             : file != nullptr ? "the file '"
                                               : "a file",
                             file != nullptr ? file : "", file != nullptr ? "'" : "", what})
      if (::write(STDERR_FILENO, part, std::strlen(part)) < 0) break;
  }
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}
inline void report_mapped_file_faults() {
  struct sigaction action {};
  action.sa_sigaction = on_mapped_file_fault;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, nullptr);
}

// A tool's work after its flags, with LibTorch's CPU allocator behind the cache of large blocks that
// MEGASLIDE_CPU_TENSOR_CACHE sets (util/cpu_tensor_cache.h; a bad value is bad input): returns what `body`
// returns, or turns what it throws into one line on
// stderr, "NAME: message" (without LibTorch's stack trace), and the exit code: 2 for bad input (an
// InputError: a config, a flag, a checkpoint, a dataset, a weights file; nothing was written), 1 for any
// other failure, with what to change when it was out of memory (`oom_hint`, a sentence).
template <typename Body>
int run_tool(const std::string& name, Body&& body, const std::string& oom_hint = "") {
  try {
    util::install_cpu_tensor_cache_from_environment();
    report_mapped_file_faults();
    return std::forward<Body>(body)();
  } catch (const std::exception& e) {
    const bool oom = is_out_of_memory(e);
    // One write of the whole line: the ranks of a launched run print theirs at once, and pieces interleaved.
    std::cerr << name + ": " + error_message(e) +
                     (oom && !oom_hint.empty() ? " (out of memory: " + oom_hint + ")" : "") + "\n"
              << std::flush;
    return is_input_error(e) ? 2 : 1;
  }
}

// Runs checks of the tool's input before any work (reading the files it names, loading the models):
// whatever they throw is bad input (exit 2 through run_tool), its message after `context` ("--vae: ",
// or "" for none); running out of memory stays a failure (exit 1).
template <typename Checks>
decltype(auto) checking_input(Checks&& checks, const std::string& context = "") {
  try {
    return std::forward<Checks>(checks)();
  } catch (const std::exception& e) {
    if ((is_input_error(e) && context.empty()) || is_out_of_memory(e)) throw;
    throw UsageError(context + error_message(e));
  }
}

// A finite real in [lo, hi] (CLI11's own checks let "nan" through: every comparison with it is false).
inline CLI::Validator finite_real(double lo = -std::numeric_limits<double>::infinity(),
                                  double hi = std::numeric_limits<double>::infinity()) {
  std::string expected = "a finite number";
  if (lo > -std::numeric_limits<double>::infinity()) expected += " >= " + CLI::detail::to_string(lo);
  if (hi < std::numeric_limits<double>::infinity()) expected += " <= " + CLI::detail::to_string(hi);
  return CLI::Validator(
      [lo, hi, expected](std::string& text) -> std::string {
        try {
          const double v = parse_real(text, expected);
          if (v < lo || v > hi) return "expected " + expected + ", got '" + text + "'";
          return "";
        } catch (const NumberError& e) {
          return e.what();
        }
      },
      "FINITE");
}

// An integer in [lo, hi], read by the library's parser: one that overflows int64 is an error, not the
// largest int64 (which CLI11's own conversion lets through) or a wrapped value. Add it with ->transform(): it
// rewrites the text as plain decimal, which ->check() would discard (CLI11 then reads "010" as octal 8).
inline CLI::Validator integer_in(int64_t lo = std::numeric_limits<int64_t>::min(),
                                 int64_t hi = std::numeric_limits<int64_t>::max()) {
  std::string expected = "an integer";
  if (lo > std::numeric_limits<int64_t>::min()) expected += " >= " + std::to_string(lo);
  if (hi < std::numeric_limits<int64_t>::max()) expected += " <= " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, expected](std::string& text) -> std::string {
        try {
          const int64_t v = parse_integer(text, expected);
          if (v < lo || v > hi) return "expected " + expected + ", got '" + text + "'";
          text = std::to_string(v);  // what CLI11 converts next: plain decimal (it would read "010" as octal)
          return "";
        } catch (const NumberError& e) {
          return e.what();
        }
      },
      "INTEGER");
}

// An unsigned 64-bit integer (a seed: the whole range a config's seeds and a prompt line's --d take), decimal as
// integer_in writes it.
inline CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          text = std::to_string(parse_unsigned(text, "an integer >= 0 and < 2^64"));
          return "";
        } catch (const NumberError& e) {
          return e.what();
        }
      },
      "UINT64");
}

// A path flag that was given must name something: an empty string ("--out ''") would silently mean
// the current folder or the default.
inline CLI::Validator non_empty_path() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text.empty()) return "an empty path names nothing";
        // "--run-dir --dry-run": the path was left out and the next flag taken for it (a run went into ./--dry-run).
        const size_t dashes = text.rfind("--", 0) == 0 ? 2 : text[0] == '-' ? 1 : 0;
        if (dashes > 0 && text.size() > dashes && std::isalpha(static_cast<unsigned char>(text[dashes])))
          return "'" + text +
                 "' is written as a flag is: is the path missing? (give a path that starts with "
                 "'-' as ./" +
                 text + ")";
        return "";
      },
      "PATH");
}

// A file-size limit (ulimit -f) must turn into a failed write(2) with EFBIG, which the library reports
// and survives (a failed checkpoint save keeps the previous one), not into SIGXFSZ, whose default
// action kills the process without a word.
inline void survive_file_size_limit() { std::signal(SIGXFSZ, SIG_IGN); }

// A signal that ends the process (Ctrl-C, kill, a closed terminal, a batch system's warning) first removes the
// temporary files being written (io::remove_temporary_files): an export or a save stopped halfway leaves no
// model-sized `*.XXXXXX.tmp` beside its output. The process then ends by the same signal, as it would have. A
// SIGHUP the process was started ignoring (nohup) stays ignored.
inline void end_by_signal_removing_temporaries(int signal) {
  megaslide::io::remove_temporary_files();
  // One line saying why the tool ended (write(2) alone: async-signal-safe).
  const char* name = signal == SIGINT    ? "SIGINT"
                     : signal == SIGTERM ? "SIGTERM"
                     : signal == SIGHUP  ? "SIGHUP"
                     : signal == SIGUSR1 ? "SIGUSR1"
                     : signal == SIGQUIT ? "SIGQUIT"
                                         : "a signal";
  for (const char* part : {"\n", static_cast<const char*>(program_invocation_short_name), ": stopped by ", name,
                           "; the file being written was removed, the files already written stay\n"})
    if (::write(STDERR_FILENO, part, std::strlen(part)) < 0) break;
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}
inline void remove_temporaries_on_fatal_signals() {
  for (const int signal : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGQUIT}) {
    struct sigaction current {};
    if (::sigaction(signal, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) continue;
    std::signal(signal, end_by_signal_removing_temporaries);
  }
}

// An earlier write of `path` that had no chance to clean up (SIGKILL, the OOM killer, a power cut) left its temporary
// file beside it, `NAME.XXXXXX.tmp` (io::create_temporary_beside): model-sized for an export. Says which are there and
// how large, once per file, so that they can be removed — not removed here, as another process may be writing one.
inline void warn_of_leftover_temporaries(const std::string& path, const std::string& tool) {
  const auto slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  std::vector<std::string> names;
  try {
    names = io::list_directory(folder);
  } catch (const std::exception&) {
    return;  // a folder that cannot be listed is the write's own error to report
  }
  for (const auto& name : names) {
    if (name.size() != base.size() + 11 || name.compare(0, base.size() + 1, base + ".") != 0 ||
        name.compare(name.size() - 4, 4, ".tmp") != 0)
      continue;
    const std::string file = io::join_path(folder, name);
    double bytes = 0;
    try {
      bytes = static_cast<double>(io::file_size(file));
    } catch (const std::exception&) {
    }
    std::cerr << fmt::format(
        "{}: warning: '{}' ({:.3g} GB) is the unfinished file of an earlier write of '{}' that was killed before it "
        "could remove it; remove it unless another process is writing that file now\n",
        tool, file, bytes / 1e9, path);
  }
}

// A --device flag as train.device takes it: auto, cpu, cuda or cuda:N (LibTorch's parser would take meta, xla, cpu:3
// and the like, and fail later). UsageError otherwise, naming the flag.
inline void check_device_flag(const std::string& spec, const std::string& flag = "--device") {
  if (!is_device_spec(spec)) throw UsageError(flag + ": expected auto, cpu, cuda or cuda:N, got '" + spec + "'");
}

// `path` as the file system names it, for comparing output paths with inputs: its nearest existing folder through
// links, the rest as written ("" stays "").
inline std::string real_file_path(const std::string& path) {
  if (path.empty()) return path;
  const std::string absolute = io::absolute_path(path);
  for (auto slash = absolute.find_last_of('/'); slash != std::string::npos && slash > 0;
       slash = absolute.find_last_of('/', slash - 1)) {
    char* folder = ::realpath(absolute.substr(0, slash).c_str(), nullptr);
    if (folder == nullptr) continue;
    const std::string out = std::string(folder) + absolute.substr(slash);
    std::free(folder);
    return out;
  }
  return absolute;
}

// Refuses (UsageError) an output `path` (`flag`'s) that is one of `inputs` ({path, what names it in the message}),
// or inside one that is a folder (one that exists as a folder, or whose path ends in '/' whether it exists yet or
// not): writing it would destroy what the command reads or writes there.
inline void check_output_is_no_input(const std::string& path, const std::string& flag,
                                     const std::vector<std::pair<std::string, std::string>>& inputs) {
  const std::string real = real_file_path(path);
  for (const auto& [input, what] : inputs) {
    if (input.empty()) continue;
    const bool slash = input.back() == '/', folder = slash || io::is_directory(input);
    const std::string in = real_file_path(slash ? input.substr(0, input.size() - 1) : input);
    if (real == in)
      throw UsageError(flag + " '" + path + "' is " + what + ": writing it would destroy it; give another path");
    if (folder && real.rfind(in + "/", 0) == 0)
      throw UsageError(flag + " '" + path + "' is inside " + what +
                       ": writing there would destroy it; give a path outside it");
  }
}

// The names in a training run's folder that its runs write (docs/training.md, "Run folder"); those ending in '/' are
// folders.
inline const std::vector<std::string>& run_folder_entries() {
  static const std::vector<std::string> names{".lock",    "config.yaml", "train.log", "metrics.jsonl", "checkpoints/",
                                              "samples/", "plots/",      "logs/",     "tensorboard/"};
  return names;
}

// Whether `folder` holds a training run: its config with its log, metrics or checkpoints (a cache folder has a lock
// file too).
inline bool is_run_folder(const std::string& folder) {
  const auto has = [&](const char* name) { return io::path_exists(io::join_path(folder, name)); };
  return has("config.yaml") && (has("train.log") || has("metrics.jsonl") || has("checkpoints"));
}

// Refuses (UsageError) an output `path` (`flag`'s) that is a file or folder a training run writes in its folder, of
// any run: its lock, config, log or metrics, anything in its checkpoints/ or plots/ (which its saves, pruning and
// megaslide-plot replace or remove), a validation step's samples/step-*, a rank's logs/rank-*.log, TensorBoard's
// tensorboard/events.*. A file of its own elsewhere in a run folder (RUN/final.safetensors, RUN/samples/mine/) is fine.
inline void check_output_outside_run_folders(const std::string& path, const std::string& flag) {
  const std::string real = real_file_path(path);
  for (auto slash = real.find_last_of('/'); slash != std::string::npos && slash > 0;
       slash = real.find_last_of('/', slash - 1)) {
    const std::string folder = real.substr(0, slash), rest = real.substr(slash + 1);
    const auto next = rest.find('/');
    const std::string entry = rest.substr(0, next), below = next == std::string::npos ? "" : rest.substr(next + 1);
    const std::string inner = below.substr(0, below.find('/'));
    const auto starts = [](const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; };
    const bool written =
        entry == ".lock" || entry == "config.yaml" || entry == "train.log" || entry == "metrics.jsonl" ||
        entry == "checkpoints" || entry == "plots" || (entry == "samples" && starts(inner, "step-")) ||
        (entry == "logs" && starts(inner, "rank-")) || (entry == "tensorboard" && starts(inner, "events."));
    if (!written || !is_run_folder(folder)) continue;
    throw UsageError(
        fmt::format("{} '{}' is {} the training run folder '{}', which that run writes: give a path "
                    "outside it",
                    flag, path, below.empty() ? entry + " of" : "inside " + entry + "/ of", folder));
  }
}

// "1:05", "2:03:09": a duration for progress lines.
inline std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// Progress of work counted in items on stderr, "[cache] 120/400 items, 3.2 items/s, elapsed 0:37, ETA 1:27":
// rewritten in place on a terminal; elsewhere (a log file) one line each twentieth of the work and one at the end.
// The rate counts what this process did (`done_here`), so that work kept from an earlier run does not inflate it.
class CountProgress {
 public:
  CountProgress(std::string tag, std::string unit)
      : tag_(std::move(tag)),
        unit_(std::move(unit)),
        tty_(::isatty(STDERR_FILENO) != 0),
        start_(std::chrono::steady_clock::now()) {}
  ~CountProgress() { end_line(); }
  CountProgress(const CountProgress&) = delete;
  CountProgress& operator=(const CountProgress&) = delete;

  void update(int64_t done, int64_t total, int64_t done_here) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double rate = s > 0 ? static_cast<double>(done_here) / s : 0.0;
    const std::string eta = rate > 0 ? clock_text(static_cast<double>(total - done) / rate) : "?";
    const std::string line = fmt::format("[{}] {}/{} {}, {:.1f} {}/s, elapsed {}, ETA {}", tag_, done, total, unit_,
                                         rate, unit_, clock_text(s), eta);
    if (tty_) {
      std::cerr << "\r" + line + "\x1b[K" << std::flush;
      line_open_ = true;
    } else if (done == total || done - last_report_ >= std::max<int64_t>(1, total / 20)) {
      std::cerr << line + "\n" << std::flush;
      last_report_ = done;
    }
  }
  void update(int64_t done, int64_t total) { update(done, total, done); }
  // A message on a line of its own, the progress line (on a terminal) rewritten after it by the next update.
  void message(const std::string& text) { std::cerr << (tty_ ? "\r\x1b[K" : "") + text + "\n" << std::flush; }
  // Ends an open terminal line, before a summary or an error.
  void end_line() {
    if (line_open_) std::cerr << "\n" << std::flush;
    line_open_ = false;
  }

 private:
  std::string tag_, unit_;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  int64_t last_report_ = -1;
  bool line_open_ = false;
};

}  // namespace megaslide::tools
