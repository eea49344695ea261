#include "megaslide/train/run_folder.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include "megaslide/io/files.h"
#include "megaslide/train/checkpoint.h"

namespace megaslide {

namespace {

constexpr const char* kLockName = ".lock";

int64_t logged_steps(const std::string& metrics) {
  std::istringstream in;
  try {
    in.str(io::read_file(metrics));  // a regular file only: a FIFO planted there is refused, not waited on
  } catch (const io::IoError& e) {
    return 0;
  }
  int64_t n = 0;
  std::string line;
  while (std::getline(in, line)) n += line.find_first_not_of(" \t\r") != std::string::npos;
  return n;
}

}  // namespace

std::string describe_existing_run(const std::string& run_dir) {
  const std::string metrics = io::join_path(run_dir, "metrics.jsonl");
  std::string latest;
  try {
    latest = latest_checkpoint(run_dir);
  } catch (const std::exception&) {
    const auto complete = complete_checkpoints(run_dir);
    latest = io::join_path(run_dir, "checkpoints/latest") + " (unreadable" +
             (complete.empty() ? std::string(")") : "; the newest complete checkpoint is " + complete.back() + ")");
  }
  const bool has_files = io::path_exists(metrics) || io::path_exists(io::join_path(run_dir, "config.yaml")) ||
                         io::path_exists(io::join_path(run_dir, "train.log")) ||
                         io::path_exists(io::join_path(run_dir, "checkpoints"));
  if (!has_files) return "";
  const auto logged = io::path_exists(metrics) ? logged_steps(metrics) : 0;
  std::string text = io::path_exists(metrics)
                         ? fmt::format("a run with {} step{} logged in metrics.jsonl", logged, logged == 1 ? "" : "s")
                         : std::string("a run's files");
  if (!latest.empty()) return text + ", latest checkpoint " + latest;
  const auto complete = complete_checkpoints(run_dir);
  if (!complete.empty())  // `latest` missing or a broken link: the checkpoints are still there, by name
    return text + ", no `latest` pointer but complete checkpoints up to " + complete.back();
  return text + ", no checkpoint";
}

std::string RunFolderGuard::lock_path() const { return io::join_path(run_dir_, kLockName); }

RunFolderGuard::RunFolderGuard(const std::string& run_dir, bool resuming) : run_dir_(run_dir) {
  if (run_dir_.empty()) throw RunFolderError("the run folder is an empty path (--run-dir or output.run_dir)");
  if (io::path_exists(run_dir_) && !io::is_directory(run_dir_))
    throw RunFolderError("run folder '" + run_dir_ + "' is a file, not a folder; choose another --run-dir");
  for (std::string p = run_dir_; !io::path_exists(p);) {
    created_.push_back(p);
    const std::string parent = io::parent_path(p);
    if (parent == p || parent == "." || parent == "/") break;
    p = parent;
  }
  try {
    io::make_directories(run_dir_);
  } catch (const io::IoError& e) {
    throw RunFolderError(fmt::format("run folder '{}': {}", run_dir_, e.what()));
  }
  const std::string lock = lock_path();
  std::string holder;
  try {
    lock_ = io::FileLock::try_acquire(lock, "megaslide-train", &holder);
  } catch (const io::IoError& e) {
    throw RunFolderError(fmt::format("run folder '{}': {}", run_dir_, e.what()));
  }
  if (!lock_)
    throw RunFolderError(
        fmt::format("run folder '{}' is in use by another run: {} (lock file {}); wait for it to end, or "
                    "choose another --run-dir",
                    run_dir_, holder, lock));

  if (!resuming) {
    const std::string existing = describe_existing_run(run_dir_);
    if (!existing.empty()) {
      const bool has_latest = existing.find("latest checkpoint") != std::string::npos;
      const auto complete = has_latest ? std::vector<std::string>{} : complete_checkpoints(run_dir_);
      const std::string message =
          has_latest ? fmt::format(
                           "run folder '{}' already holds a run ({}); continue it with --resume latest, or choose "
                           "another --run-dir",
                           run_dir_, existing)
          : !complete.empty()
              ? fmt::format(
                    "run folder '{}' already holds a run ({}); continue it with --resume {}, or choose another "
                    "--run-dir",
                    run_dir_, existing, complete.back())
              : fmt::format(
                    "run folder '{}' already holds a run ({}: it saved none, stopped before its first or trained with "
                    "train.checkpoint_every: 0, so it cannot be continued); choose another --run-dir, or delete the "
                    "folder to train there again",
                    run_dir_, existing);
      lock_.reset();  // the destructor does not run for a constructor that throws
      throw RunFolderError(message);
    }
  }
}

RunFolderGuard::~RunFolderGuard() {
  if (!lock_) return;
  if (!started_ && !created_.empty()) {
    // Nothing of the run was written: take back the folders this guard made, its parents too (rmdir fails,
    // harmlessly, when anything else is in one).
    ::unlink(lock_path().c_str());
    for (const auto& folder : created_) ::rmdir(folder.c_str());
  }
  lock_.reset();
}

}  // namespace megaslide
