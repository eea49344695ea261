// NvmeFile: the NVMe tier's scratch file (docs/offload.md, "The NVMe tier"): one file of a fixed size in a
// folder the user names (offload.nvme_dir), read and written in large aligned pieces.
//
// I/O: with O_DIRECT where the filesystem accepts it (the page cache is bypassed: reading or writing a
// block's state takes no host memory beyond the caller's buffer), else buffered (tmpfs, some network
// filesystems; direct() says which). Requests are split into pieces of `chunk_bytes` kept in flight
// together: through io_uring (liburing) when the build has it and the kernel allows it, else by pread /
// pwrite on `threads` threads (engine() says which). With O_DIRECT, buffers, offsets and lengths must be
// multiples of kNvmeAlignment.
//
// Crash safety: the file is unlinked as soon as it is open, so it never outlives the process (a kill
// leaves no stale state behind; the space returns when the descriptor closes). Its whole size is
// reserved up front (posix_fallocate), so a disk too small for the state fails at start, naming the
// folder, the bytes asked for and the bytes free; a write that fails later (a failing disk) throws
// NvmeError naming the file, the offset and the system's reason.
//
// Threading: read() and write() may be called from several threads at once (each request has its own
// ring or threads); the object must outlive them.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "megaslide/util/errors.h"

namespace megaslide::offload {

constexpr int64_t kNvmeAlignment = 4096;

// An I/O failure of the NVMe tier (a full or failing disk, a folder that cannot hold the file).
class NvmeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The state file does not fit where offload.nvme_dir points (a disk too small, a file size limit): found when the
// file is reserved, before the first step, and the config's to change (a tool exits 2).
class NvmeSpaceError : public NvmeError, public InputError {
 public:
  using NvmeError::NvmeError;
};

struct NvmeFileOptions {
  int64_t chunk_bytes = int64_t{8} << 20;  // one request's pieces (a multiple of kNvmeAlignment)
  int queue_depth = 16;                    // io_uring: pieces in flight per request
  int threads = 4;                         // pread/pwrite: threads per request
  bool direct = true;                      // try O_DIRECT (falls back to buffered where refused)
  bool io_uring = true;                    // try io_uring (falls back to pread/pwrite where refused)
  // A testing aid: writes past this many bytes in total fail as a full disk would (ENOSPC); -1: never. The
  // environment variables MEGASLIDE_TEST_NVME_FAIL_AT_WRITE=n (the n-th write, 1-based, and every later one
  // fail so) and MEGASLIDE_TEST_NVME_KILL_AT_WRITE=n (the process is killed, SIGKILL, halfway through the n-th
  // write) are how the tests stop a whole run on a full disk and in the middle of a write-back.
  int64_t fail_writes_after_bytes = -1;
};

class NvmeFile {
 public:
  // Creates a file of `bytes` (rounded up to kNvmeAlignment) in `dir`, named after `name`, unlinked at once and
  // reserved in full. Throws NvmeError when the folder is missing or not writable, NvmeSpaceError when the disk
  // lacks the space or the file would pass the process's file size limit.
  NvmeFile(const std::string& dir, const std::string& name, int64_t bytes, NvmeFileOptions options = {});
  ~NvmeFile();
  NvmeFile(const NvmeFile&) = delete;
  NvmeFile& operator=(const NvmeFile&) = delete;

  // Reads / writes `bytes` at `offset`, returning when all of it is done. Throws NvmeError naming what failed.
  void read(int64_t offset, void* dst, int64_t bytes) const;
  void write(int64_t offset, const void* src, int64_t bytes) const;

  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }  // the name it had (unlinked)
  bool direct() const { return direct_; }
  const char* engine() const;  // "io_uring" or "pread"

  // The folder's free bytes (statvfs), or -1 when unknown.
  static int64_t free_bytes(const std::string& dir);

 private:
  void transfer(bool write, int64_t offset, char* buffer, int64_t bytes) const;
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
  bool direct_ = false;
  bool uring_ = false;
  NvmeFileOptions options_;
  mutable std::atomic<int64_t> written_{0};  // for fail_writes_after_bytes
  mutable std::atomic<int64_t> writes_{0};   // for MEGASLIDE_TEST_NVME_KILL_AT_WRITE
  int64_t kill_at_write_ = -1, fail_at_write_ = -1;
};

// Whether this build has io_uring (liburing).
bool nvme_io_uring_built();

}  // namespace megaslide::offload
