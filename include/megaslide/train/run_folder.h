// RunFolderGuard: the one guard between a training run and its run folder. While a run lives it holds
// an advisory lock on RUN_DIR/.lock (flock(2), exclusive, never waited for), so a second run into the
// same folder is refused at once instead of tearing metrics.jsonl and replacing the first run's
// checkpoints; and a fresh run (no --resume) is refused when the folder already holds a run, finished
// or not, with checkpoints or without, so that nothing written by an earlier run is overwritten.
//
//   RUN_DIR/.lock   "pid 12345 on host gpu-7 since 2026-11-30 20:15:03 (megaslide-train)": the last
//                   holder; the lock itself is the kernel's, released when the process ends in any way
//                   (exit, crash, kill -9), so a stale file never blocks a later run.
//
// A refusal is a RunFolderError (bad input: megaslide-train exits 2) naming the folder and, for a
// busy folder, the holder's pid and host as it wrote them. flock is advisory: it guards MegaSlide
// runs against each other, not against other programs writing into the folder; on a network file
// system it holds across hosts only where the file system implements flock (NFSv4 on Linux does).
//
// Thread-safety: one guard per run; it owns a file descriptor (close-on-exec, so child processes
// such as gnuplot do not inherit the lock).
#pragma once

#include <memory>

#include "megaslide/io/files.h"
#include "megaslide/util/errors.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace megaslide {

class RunFolderError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

class RunFolderGuard {
 public:
  // Creates `run_dir` when missing, takes the lock and, when !resuming, refuses a folder that already
  // holds a run (config.yaml, metrics.jsonl, train.log or checkpoints/). Throws RunFolderError, or
  // io::IoError when the folder cannot be created.
  RunFolderGuard(const std::string& run_dir, bool resuming);
  // Releases the lock. A guard whose run never started (see started()) also removes the folder it
  // created, when it is still empty but for the lock file: a refused run leaves nothing behind.
  ~RunFolderGuard();
  RunFolderGuard(const RunFolderGuard&) = delete;
  RunFolderGuard& operator=(const RunFolderGuard&) = delete;

  // The run has written into the folder: keep it whatever happens next.
  void started() { started_ = true; }
  const std::string& path() const { return run_dir_; }
  std::string lock_path() const;

 private:
  std::string run_dir_;
  std::unique_ptr<io::FileLock> lock_;
  std::vector<std::string>
      created_;  // the folders this guard made (the run folder and its missing parents), deepest first
  bool started_ = false;
};

// What the folder holds of an earlier run ("" when nothing): e.g. "a run of 200 steps (metrics.jsonl)
// with checkpoints (latest: RUN/checkpoints/step-0000200)". Used for the refusal's message.
std::string describe_existing_run(const std::string& run_dir);

}  // namespace megaslide
