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

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

// What the holder wrote into the lock file (read through our own descriptor: the same file).
std::string holder_of(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string text = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text.empty() ? "a process that has not yet written its pid and host" : text;
}

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
    latest = io::join_path(run_dir, "checkpoints/latest") + " (unreadable)";
  }
  const bool has_files = io::path_exists(metrics) || io::path_exists(io::join_path(run_dir, "config.yaml")) ||
                         io::path_exists(io::join_path(run_dir, "train.log")) || io::path_exists(io::join_path(run_dir, "checkpoints"));
  if (!has_files) return "";
  std::string text = io::path_exists(metrics) ? fmt::format("a run with {} steps logged in metrics.jsonl", logged_steps(metrics))
                                              : std::string("a run's files");
  text += latest.empty() ? ", no checkpoint" : ", latest checkpoint " + latest;
  return text;
}

std::string RunFolderGuard::lock_path() const { return io::join_path(run_dir_, kLockName); }

RunFolderGuard::RunFolderGuard(const std::string& run_dir, bool resuming) : run_dir_(run_dir) {
  if (run_dir_.empty()) throw RunFolderError("the run folder is an empty path (--run-dir or output.run_dir)");
  if (io::path_exists(run_dir_) && !io::is_directory(run_dir_))
    throw RunFolderError("run folder '" + run_dir_ + "' is a file, not a folder; choose another --run-dir");
  created_ = !io::path_exists(run_dir_);
  io::make_directories(run_dir_);
  const std::string lock = lock_path();
  // The file may be unlinked by a refused run cleaning up after itself between our open and our
  // flock: then we would hold a lock on a file no one else can find. Locking, then checking that the
  // name still leads to the locked file, closes that gap.
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) throw RunFolderError(fmt::format("run folder '{}': cannot open the lock file {}: {}", run_dir_, lock, std::strerror(errno)));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      const std::string holder = error == EWOULDBLOCK ? holder_of(fd) : "";
      ::close(fd);
      if (error == EWOULDBLOCK)
        throw RunFolderError(fmt::format("run folder '{}' is in use by another run: {} (lock file {}); wait for it to end, or "
                                         "choose another --run-dir",
                                         run_dir_, holder, lock));
      throw RunFolderError(fmt::format("run folder '{}': cannot lock {}: {}", run_dir_, lock, std::strerror(error)));
    }
    struct stat held {}, named {};
    if (::fstat(fd, &held) == 0 && ::stat(lock.c_str(), &named) == 0 && held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
      fd_ = fd;
    } else {
      ::close(fd);
    }
  }
  if (fd_ < 0) throw RunFolderError(fmt::format("run folder '{}': the lock file {} keeps being replaced; is another program removing it?", run_dir_, lock));
  const std::string holder = fmt::format("pid {} on host {} since {} (megaslide-train)\n", ::getpid(), this_host(), now_text());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, holder.data(), holder.size(), 0) != static_cast<ssize_t>(holder.size())) {
    // The lock holds without the note; only the message of a refused run would lack the pid.
  }

  if (!resuming) {
    const std::string existing = describe_existing_run(run_dir_);
    if (!existing.empty()) {
      const bool has_checkpoint = existing.find("latest checkpoint") != std::string::npos;
      const std::string message =
          has_checkpoint ? fmt::format("run folder '{}' already holds a run ({}); continue it with --resume latest, or choose another "
                                       "--run-dir",
                                       run_dir_, existing)
                         : fmt::format("run folder '{}' already holds a run ({}: train.checkpoint_every was 0, so it cannot be "
                                       "continued); choose another --run-dir, or delete the folder to train there again",
                                       run_dir_, existing);
      ::close(fd_);  // the destructor does not run for a constructor that throws
      fd_ = -1;
      throw RunFolderError(message);
    }
  }
}

RunFolderGuard::~RunFolderGuard() {
  if (fd_ < 0) return;
  if (!started_ && created_) {
    // Nothing of the run was written: take back the folder this guard made (rmdir fails, harmlessly,
    // when anything else is in it).
    ::unlink(lock_path().c_str());
    ::rmdir(run_dir_.c_str());
  }
  ::close(fd_);
}

}  // namespace megaslide
