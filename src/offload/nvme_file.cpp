#include "megaslide/offload/nvme_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "megaslide/util/numbers.h"

#ifdef MEGASLIDE_WITH_IO_URING
#include <liburing.h>
#endif

namespace megaslide::offload {
namespace {

std::string human(int64_t bytes) { return bytes < 0 ? "unknown" : human_bytes(static_cast<double>(bytes)); }

int64_t round_up(int64_t n) { return (n + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment; }

#ifdef MEGASLIDE_WITH_IO_URING
bool io_uring_usable() {
  io_uring ring;
  if (io_uring_queue_init(2, &ring, 0) != 0) return false;
  io_uring_queue_exit(&ring);
  return true;
}
#endif

}  // namespace

bool nvme_io_uring_built() {
#ifdef MEGASLIDE_WITH_IO_URING
  return true;
#else
  return false;
#endif
}

int64_t NvmeFile::free_bytes(const std::string& dir) {
  struct statvfs s {};
  if (::statvfs(dir.c_str(), &s) != 0) return -1;
  return static_cast<int64_t>(s.f_bavail) * static_cast<int64_t>(s.f_frsize);
}

NvmeFile::NvmeFile(const std::string& dir, const std::string& name, int64_t bytes, NvmeFileOptions options)
    : path_(dir + "/" + name), size_(round_up(std::max<int64_t>(bytes, 0))), options_(options) {
  if (options_.chunk_bytes <= 0 || options_.chunk_bytes % kNvmeAlignment != 0 || options_.queue_depth < 1 ||
      options_.threads < 1)
    throw NvmeError(
        fmt::format("NvmeFile: chunk_bytes {} must be a positive multiple of {}; queue_depth and threads "
                    "at least 1",
                    options_.chunk_bytes, kNvmeAlignment));
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw NvmeError(
        fmt::format("offload.nvme_dir '{}' is not a folder ({}); create it on the NVMe disk that will hold "
                    "the optimizer state",
                    dir, std::strerror(errno)));
  const int base = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  if (options_.direct) {
    fd_ = ::open(path_.c_str(), base | O_DIRECT, 0600);
    direct_ = fd_ >= 0;
  }
  if (fd_ < 0) fd_ = ::open(path_.c_str(), base, 0600);
  if (fd_ < 0)
    throw NvmeError(
        fmt::format("offload.nvme_dir '{}': cannot create the state file '{}': {}", dir, path_, std::strerror(errno)));
  ::unlink(path_.c_str());  // scratch: gone with the process, whatever ends it
  if (size_ > 0) {
    const int rc = ::posix_fallocate(fd_, 0, size_);
    if (rc == EOPNOTSUPP || rc == EINVAL) {
      if (::ftruncate(fd_, size_) != 0) {
        const int e = errno;
        ::close(fd_);
        throw NvmeError(fmt::format("offload.nvme_dir '{}': cannot size the state file to {} bytes: {}", dir, size_,
                                    std::strerror(e)));
      }
    } else if (rc != 0) {
      ::close(fd_);
      rlimit limit{};
      if (rc == EFBIG && ::getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY &&
          static_cast<uint64_t>(size_) > static_cast<uint64_t>(limit.rlim_cur))
        throw NvmeSpaceError(fmt::format(
            "offload.nvme_dir '{}': cannot reserve {} bytes ({}) for the optimizer state: this process may write "
            "files of at most {} bytes (its file size limit, `ulimit -f`): raise the limit, or keep the state in "
            "RAM (offload.state_tier: ram)",
            dir, size_, human(size_), static_cast<uint64_t>(limit.rlim_cur)));
      const std::string message = fmt::format(
          "offload.nvme_dir '{}': cannot reserve {} bytes ({}) for the optimizer state: {}; the folder's disk has {} "
          "free. Free space there, point offload.nvme_dir at a larger disk, or keep the state in RAM "
          "(offload.state_tier: ram)",
          dir, size_, human(size_), std::strerror(rc), human(free_bytes(dir)));
      if (rc == ENOSPC || rc == EFBIG) throw NvmeSpaceError(message);
      throw NvmeError(message);
    }
  }
#ifdef MEGASLIDE_WITH_IO_URING
  uring_ = options_.io_uring && io_uring_usable();
#endif
  if (const char* fail = std::getenv("MEGASLIDE_TEST_NVME_FAIL_AT_WRITE")) fail_at_write_ = std::atoll(fail);
  if (const char* kill = std::getenv("MEGASLIDE_TEST_NVME_KILL_AT_WRITE")) kill_at_write_ = std::atoll(kill);
}

NvmeFile::~NvmeFile() {
  if (fd_ >= 0) ::close(fd_);
}

const char* NvmeFile::engine() const { return uring_ ? "io_uring" : "pread"; }

void NvmeFile::read(int64_t offset, void* dst, int64_t bytes) const {
  transfer(false, offset, static_cast<char*>(dst), bytes);
}

void NvmeFile::write(int64_t offset, const void* src, int64_t bytes) const {
  transfer(true, offset, static_cast<char*>(const_cast<void*>(src)), bytes);
}

void NvmeFile::transfer(bool write, int64_t offset, char* buffer, int64_t bytes) const {
  if (bytes <= 0) return;
  const char* what = write ? "writing" : "reading";
  if (offset < 0 || offset + bytes > size_)
    throw NvmeError(
        fmt::format("NvmeFile {}: {} bytes at offset {} lie outside the file's {} bytes", path_, bytes, offset, size_));
  if (direct_ && (offset % kNvmeAlignment != 0 || bytes % kNvmeAlignment != 0 ||
                  reinterpret_cast<uintptr_t>(buffer) % kNvmeAlignment != 0))
    throw NvmeError(
        fmt::format("NvmeFile {}: O_DIRECT needs {}-byte aligned buffers, offsets and lengths ({} bytes at "
                    "offset {})",
                    path_, kNvmeAlignment, bytes, offset));
  const auto fail = [&](int64_t at, int error) {
    throw NvmeError(fmt::format("the NVMe tier's state file {} failed {} {} bytes at offset {}: {}{}", path_, what,
                                bytes, at, std::strerror(error),
                                error == ENOSPC ? " (the disk is full: free space in offload.nvme_dir)" : ""));
  };
  if (write && options_.fail_writes_after_bytes >= 0 &&
      written_.fetch_add(bytes) + bytes > options_.fail_writes_after_bytes)
    fail(offset, ENOSPC);
  const int64_t write_number = write ? ++writes_ : 0;
  if (write && fail_at_write_ > 0 && write_number >= fail_at_write_) fail(offset, ENOSPC);
  if (write && kill_at_write_ > 0 && write_number == kill_at_write_) {  // the testing aid: half written, then killed
    const int64_t half = bytes / 2 / kNvmeAlignment * kNvmeAlignment;
    if (half > 0 && ::pwrite(fd_, buffer, static_cast<size_t>(half), static_cast<off_t>(offset)) < 0) std::abort();
    ::raise(SIGKILL);
  }
  const int64_t chunk = options_.chunk_bytes;
  const int64_t pieces = (bytes + chunk - 1) / chunk;
#ifdef MEGASLIDE_WITH_IO_URING
  if (uring_) {
    io_uring ring;
    const unsigned depth = static_cast<unsigned>(std::min<int64_t>(options_.queue_depth, pieces));
    if (const int rc = io_uring_queue_init(depth, &ring, 0); rc != 0) fail(offset, -rc);
    struct Piece {
      int64_t done = 0, length = 0, offset = 0;
    };
    std::vector<Piece> piece(static_cast<size_t>(pieces));
    for (int64_t i = 0; i < pieces; ++i) piece[i] = {0, std::min(chunk, bytes - i * chunk), i * chunk};
    int64_t next = 0, in_flight = 0, failed_at = -1;
    int error = 0;
    const auto submit = [&](int64_t i) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      Piece& p = piece[i];
      char* at = buffer + p.offset + p.done;
      const auto len = static_cast<unsigned>(p.length - p.done);
      if (write) io_uring_prep_write(sqe, fd_, at, len, static_cast<uint64_t>(offset + p.offset + p.done));
      else io_uring_prep_read(sqe, fd_, at, len, static_cast<uint64_t>(offset + p.offset + p.done));
      io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(i));
      ++in_flight;
    };
    while (next < pieces && in_flight < depth) submit(next++);
    io_uring_submit(&ring);
    while (in_flight > 0) {
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) {
        error = -rc, failed_at = offset;
        break;
      }
      const auto i = static_cast<int64_t>(io_uring_cqe_get_data64(cqe));
      const int res = cqe->res;
      io_uring_cqe_seen(&ring, cqe);
      --in_flight;
      if (res < 0 || (res == 0 && !write)) {  // a read of 0 bytes: past the end
        if (error == 0) error = res < 0 ? -res : EIO, failed_at = offset + piece[i].offset + piece[i].done;
        continue;
      }
      if (res == 0) {  // a write of nothing: the disk takes no more
        if (error == 0) error = ENOSPC, failed_at = offset + piece[i].offset + piece[i].done;
        continue;
      }
      piece[i].done += res;
      if (error != 0) continue;
      if (piece[i].done < piece[i].length) submit(i);  // short: the rest
      else if (next < pieces) submit(next++);
      io_uring_submit(&ring);
    }
    io_uring_queue_exit(&ring);
    if (error != 0) fail(failed_at, error);
    return;
  }
#endif
  // pread/pwrite: pieces taken in turn by `threads` threads.
  std::atomic<int64_t> next{0};
  std::mutex m;
  int error = 0;
  int64_t failed_at = -1;
  const auto worker = [&] {
    for (int64_t i = next++; i < pieces; i = next++) {
      int64_t done = 0, length = std::min(chunk, bytes - i * chunk);
      while (done < length) {
        char* at = buffer + i * chunk + done;
        const off_t where = static_cast<off_t>(offset + i * chunk + done);
        const ssize_t n = write ? ::pwrite(fd_, at, static_cast<size_t>(length - done), where)
                                : ::pread(fd_, at, static_cast<size_t>(length - done), where);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          std::lock_guard<std::mutex> lock(m);
          if (error == 0) error = n < 0 ? errno : (write ? ENOSPC : EIO), failed_at = where;
          next = pieces;
          return;
        }
        done += n;
      }
    }
  };
  const int threads = static_cast<int>(std::min<int64_t>(options_.threads, pieces));
  std::vector<std::thread> pool;
  for (int k = 1; k < threads; ++k) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (error != 0) fail(failed_at, error);
}

}  // namespace megaslide::offload
