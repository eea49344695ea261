#include "megaslide/io/files.h"

#include <fcntl.h>
#include <dirent.h>
#include <ftw.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc >= 2.28)
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include <immintrin.h>

namespace megaslide::io {

namespace {
[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw IoError(what + " '" + path + "': " + std::strerror(errno));
}

std::string parent_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

const char* kind_of(mode_t mode) {
  return S_ISDIR(mode)                    ? "a folder"
         : S_ISCHR(mode) || S_ISBLK(mode) ? "a device"
         : S_ISFIFO(mode)                 ? "a pipe (FIFO)"
         : S_ISSOCK(mode)                 ? "a socket"
         : S_ISLNK(mode)                  ? "a symbolic link"
                                          : "not a regular file";
}

// The process's file-mode creation mask, read without changing it (umask(2) can only set it, which
// would race with other threads creating files): Linux's /proc/self/status "Umask:", else 022.
mode_t process_umask() {
  FILE* f = std::fopen("/proc/self/status", "re");
  unsigned value = 022;
  if (f != nullptr) {
    char line[256];
    while (std::fgets(line, sizeof line, f) != nullptr)
      if (std::sscanf(line, "Umask: %o", &value) == 1) break;
    std::fclose(f);
  }
  return static_cast<mode_t>(value & 0777);
}

// Writes all of [data, data + bytes) to fd; false with errno set on failure.
bool write_all(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd, p + done, std::min<size_t>(bytes - done, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}
}  // namespace

int open_input_file(const std::string& path, bool allow_pipe) {
  // O_NONBLOCK: opening a FIFO without a writer must not hang; cleared below for the reads.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) fail("cannot open", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    fail("cannot read", path);
  }
  if (!S_ISREG(st.st_mode) && !(allow_pipe && S_ISFIFO(st.st_mode))) {
    ::close(fd);
    throw IoError("'" + path + "' is " + kind_of(st.st_mode) + ", not a file (only regular files are read)");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

void check_input_file(const std::string& path) { ::close(open_input_file(path)); }

void check_replaceable_output(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail("cannot inspect", path);
  }
  if (!S_ISREG(st.st_mode))
    throw IoError("'" + path + "' exists and is " + kind_of(st.st_mode) +
                  "; MegaSlide writes only over regular files (remove it or name another output)");
}

namespace {
// The registered temporary files: state 0 free, 1 being filled, 2 registered (read by remove_temporary_files, which
// may run in a signal handler: lock-free atomics and a fixed array, no allocation).
constexpr size_t kTemporaryPathMax = 4096;
struct TemporarySlot {
  std::atomic<int> state{0};
  char path[kTemporaryPathMax];
};
std::array<TemporarySlot, 64> g_temporaries;
static_assert(std::atomic<int>::is_always_lock_free);

void register_temporary(const std::string& name) {
  if (name.size() >= kTemporaryPathMax) return;
  for (auto& slot : g_temporaries) {
    int free = 0;
    if (!slot.state.compare_exchange_strong(free, 1)) continue;
    std::memcpy(slot.path, name.c_str(), name.size() + 1);
    slot.state.store(2);
    return;
  }
}
}  // namespace

void forget_temporary(const std::string& name) {
  for (auto& slot : g_temporaries)
    if (slot.state.load() == 2 && name == slot.path) {
      slot.state.store(0);
      return;
    }
}

void remove_temporary_files() noexcept {
  for (auto& slot : g_temporaries)
    if (slot.state.load() == 2) ::unlink(slot.path);
}

namespace {
// The registered mappings, in arrays that static storage zero-initialises (no constructor runs, and a path's pages
// are touched only once its slot is used): state 0 free, 1 being changed, 2 registered. A slot's generation is odd
// while its fields are written and changes with each registration and removal, so a reader (a signal handler among
// them: atomics, fixed arrays, no allocation) keeps what it read only when the generation was even and the same
// before and after.
constexpr size_t kMappings = 4096, kMappingPathMax = 1024;
std::atomic<int> g_mapping_state[kMappings];
std::atomic<uint32_t> g_mapping_generation[kMappings];
std::atomic<const char*> g_mapping_begin[kMappings];
std::atomic<size_t> g_mapping_bytes[kMappings];
char g_mapping_path[kMappings][kMappingPathMax];
char g_fault_path[kMappingPathMax];  // mapped_file_at's answer, copied out of its slot
}  // namespace

void register_mapping(const void* base, size_t bytes, const std::string& path) {
  if (base == nullptr || bytes == 0 || path.size() >= kMappingPathMax) return;
  for (size_t i = 0; i < kMappings; ++i) {
    int free = 0;
    if (!g_mapping_state[i].compare_exchange_strong(free, 1)) continue;
    g_mapping_generation[i].fetch_add(1);  // odd: being written
    g_mapping_begin[i].store(static_cast<const char*>(base));
    g_mapping_bytes[i].store(bytes);
    std::memcpy(g_mapping_path[i], path.c_str(), path.size() + 1);
    g_mapping_generation[i].fetch_add(1);
    g_mapping_state[i].store(2);
    return;
  }
}

void forget_mapping(const void* base) {
  for (size_t i = 0; i < kMappings; ++i) {
    if (g_mapping_state[i].load() != 2 || g_mapping_begin[i].load() != base) continue;
    int registered = 2;
    if (!g_mapping_state[i].compare_exchange_strong(registered, 1)) continue;
    g_mapping_generation[i].fetch_add(2);
    g_mapping_state[i].store(0);
    return;
  }
}

const char* mapped_file_at(const void* address) noexcept {
  const auto* a = static_cast<const char*>(address);
  for (size_t i = 0; i < kMappings; ++i) {
    if (g_mapping_state[i].load() != 2) continue;
    const uint32_t before = g_mapping_generation[i].load();
    const char* begin = g_mapping_begin[i].load();
    const size_t bytes = g_mapping_bytes[i].load();
    if ((before & 1) != 0 || a < begin || a >= begin + bytes) continue;
    size_t n = 0;
    for (; n + 1 < kMappingPathMax && g_mapping_path[i][n] != '\0'; ++n) g_fault_path[n] = g_mapping_path[i][n];
    g_fault_path[n] = '\0';
    if (g_mapping_generation[i].load() == before && g_mapping_state[i].load() == 2) return g_fault_path;
  }
  return nullptr;
}

int create_temporary_beside(const std::string& path, std::string& name) {
  std::string pattern = path + ".XXXXXX.tmp";
  const int fd = ::mkostemps(pattern.data(), 4, O_CLOEXEC);  // O_CREAT | O_EXCL: never through a link
  if (fd < 0) fail("cannot create a temporary file beside", path);
  if (::fchmod(fd, 0644 & ~process_umask()) != 0) {
    const int saved = errno;
    ::close(fd);
    ::unlink(pattern.c_str());
    errno = saved;
    fail("cannot set the mode of", pattern);
  }
  name = pattern;
  register_temporary(name);
  return fd;
}

namespace {
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
}  // namespace

std::unique_ptr<FileLock> FileLock::try_acquire(const std::string& path, const std::string& who, std::string* holder) {
  // The file may be unlinked by a refused holder cleaning up after itself between our open and our
  // flock: then we would hold a lock on a file no one else can find. Locking, then checking that the
  // name still leads to the locked file, closes that gap.
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) fail("cannot open the lock file", path);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      const std::string note = error == EWOULDBLOCK ? holder_of(fd) : "";
      ::close(fd);
      if (error == EWOULDBLOCK) {
        if (holder != nullptr) *holder = note;
        return nullptr;
      }
      errno = error;
      fail("cannot lock", path);
    }
    struct stat held {
    }, named{};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino) {
      const std::string note =
          "pid " + std::to_string(::getpid()) + " on host " + this_host() + " since " + now_text() + " (" + who + ")\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, note.data(), note.size(), 0) != static_cast<ssize_t>(note.size())) {
        // The lock holds without the note; only the message of a refused holder would lack the pid.
      }
      return std::unique_ptr<FileLock>(new FileLock(path, fd));
    }
    ::close(fd);
  }
  throw IoError("the lock file '" + path + "' keeps being replaced; is another program removing it?");
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);
}

OutputFile::OutputFile(const std::string& path, bool append) : path_(path) {
  check_replaceable_output(path);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY | (append ? O_APPEND : O_TRUNC),
               0644);
  if (fd_ < 0) fail("cannot open for writing", path);
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {  // replaced by something else since the check
    ::close(fd_);
    fd_ = -1;
    throw IoError("'" + path + "' is not a regular file; MegaSlide writes only regular files");
  }
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(const void* data, size_t bytes) {
  if (!write_all(fd_, data, bytes)) fail("cannot write", path_);
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_symlink(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

std::string join_path(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (!b.empty() && b.front() == '/') return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::string relative_path_note(const std::string& path) {
  if (path.empty() || path[0] == '/') return "";
  try {
    return " (a relative path, read from " + absolute_path(".") + ")";
  } catch (const IoError&) {
    return " (a relative path)";
  }
}

std::string absolute_path(const std::string& path) {
  if (path.empty()) return path;
  std::string full = path;
  if (full.front() != '/') {
    std::vector<char> cwd(4096);
    while (::getcwd(cwd.data(), cwd.size()) == nullptr) {
      if (errno != ERANGE) throw IoError(std::string("cannot read the working directory: ") + std::strerror(errno));
      cwd.resize(cwd.size() * 2);
    }
    full = join_path(cwd.data(), path);
  }
  std::vector<std::string> parts;
  for (size_t begin = 0; begin <= full.size();) {
    size_t end = full.find('/', begin);
    if (end == std::string::npos) end = full.size();
    const std::string part = full.substr(begin, end - begin);
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(part);
    }
    begin = end + 1;
  }
  std::string out;
  for (const auto& part : parts) out += "/" + part;
  return out.empty() ? "/" : out;
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  const std::string parent = parent_of(path);
  if (parent != path && parent != "." && parent != "/") make_directories(parent);
  if (::mkdir(path.c_str(), 0755) != 0 && !(errno == EEXIST && is_directory(path)))
    fail("cannot create directory", path);
}

void remove_tree(const std::string& path) {
  if (!path_exists(path)) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) fail("cannot remove", path);
}

void write_file_atomically(const std::string& path, const std::string& content, FileGroup* group) {
  auto out = std::make_unique<AtomicFileWriter>(path);
  out->write(content.data(), content.size());
  FileGroup::commit_or_add(std::move(out), group);
}

void rename_durably(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail("cannot rename '" + from + "' to", to);
  int dir = ::open(parent_of(to).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);  // best effort: makes the rename itself durable
    ::close(dir);
  }
}

bool exchange_durably(const std::string& a, const std::string& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;
    fail("cannot exchange '" + a + "' with", b);
  }
  for (const auto& dir_path : {parent_of(a), parent_of(b)}) {
    int dir = ::open(dir_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
      ::fsync(dir);
      ::close(dir);
    }
  }
  return true;
}

AtomicFileWriter::AtomicFileWriter(const std::string& path) : path_(path) {
  check_replaceable_output(path_);
  fd_ = create_temporary_beside(path_, tmp_);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (fd_ >= 0 || finished_) ::unlink(tmp_.c_str());
  forget_temporary(tmp_);
}

void AtomicFileWriter::write(const void* data, size_t bytes) {
  if (fd_ < 0) throw IoError("AtomicFileWriter: '" + path_ + "' was already committed");
  if (!write_all(fd_, data, bytes)) fail("cannot write", tmp_);
  crc_ = io::crc32(data, bytes, crc_);
  bytes_ += bytes;
}

void AtomicFileWriter::finish() {
  if (fd_ < 0) throw IoError("AtomicFileWriter: '" + path_ + "' was already committed");
  if (::fsync(fd_) != 0) fail("cannot flush", tmp_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int saved = errno;
    ::unlink(tmp_.c_str());
    errno = saved;
    fail("cannot flush", tmp_);
  }
  finished_ = true;
}

void AtomicFileWriter::publish() {
  if (!finished_) throw IoError("AtomicFileWriter: '" + path_ + "' is not finished, or was already renamed");
  finished_ = false;
  try {
    rename_durably(tmp_, path_);
  } catch (...) {
    ::unlink(tmp_.c_str());
    throw;
  }
}

void AtomicFileWriter::commit() {
  finish();
  publish();
}

void FileGroup::add(std::unique_ptr<AtomicFileWriter> finished) { files_.push_back(std::move(finished)); }

void FileGroup::commit_or_add(std::unique_ptr<AtomicFileWriter> out, FileGroup* group) {
  if (group == nullptr) return out->commit();
  out->finish();
  group->add(std::move(out));
}

void FileGroup::publish() {
  for (auto& file : files_) file->publish();
  files_.clear();
}

uint64_t file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail("cannot read", path);
  return static_cast<uint64_t>(st.st_size);
}

std::vector<std::string> list_directory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) fail("cannot list", path);
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

namespace {
// Slicing-by-8 tables for the reflected IEEE polynomial 0xEDB88320.
struct Crc32Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Crc32Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

// The folding constants of crc32_clmul: x^n mod P(x) for the IEEE polynomial P (0x104C11DB7, most significant
// coefficient first), bit-reversed into the upper half of a 64-bit word (see crc32_clmul).
constexpr uint64_t folding_constant(int n) {
  uint64_t r = 1;
  for (int i = 0; i < n; ++i) {
    r <<= 1;
    if (r & (uint64_t{1} << 32)) r ^= 0x104C11DB7u;
  }
  uint64_t reversed = 0;
  for (int i = 0; i < 32; ++i)
    if (r & (uint64_t{1} << i)) reversed |= uint64_t{1} << (63 - i);
  return reversed;
}

// The carry-less product of x86's PCLMULQDQ (every x86-64 CPU since 2010 has it; the table loop is the fallback).
bool cpu_has_pclmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}

// A 128-bit block carried D bits ahead, reduced to 96 bits: the low 64 bits of `x` (its first 64 in the stream, the
// higher powers of x) times x^(D + 64) and the high 64 bits times x^D, each modulo P, with `k` = constants<D>().
#define MEGASLIDE_CLMUL __attribute__((target("pclmul,sse4.1")))
MEGASLIDE_CLMUL inline __m128i fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}
// The constants for carrying a block D bits ahead: x^(D + 64) for its first half, x^D for its second.
template <int D>
MEGASLIDE_CLMUL inline __m128i constants() {
  constexpr uint64_t kFirst = folding_constant(D + 64 - 1), kSecond = folding_constant(D - 1);
  return _mm_set_epi64x(static_cast<long long>(kSecond), static_cast<long long>(kFirst));
}
}  // namespace

namespace detail {

uint32_t crc32_table(const void* data, size_t bytes, uint32_t previous) {
  static const Crc32Tables tables;
  const auto& t = tables.t;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~previous;
  while (bytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
        t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    bytes -= 8;
  }
  while (bytes-- > 0) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

bool crc32_clmul_supported() { return cpu_has_pclmul(); }

// Folding with carry-less products. The reflected CRC reads each byte from its lowest bit, and that bit is the
// highest power of x: a 16-byte block loaded into a register has the coefficient of x^(127 - i) in bit i. The
// running register (the complement of `previous`) is added to the first 4 bytes. Four blocks are kept: each is
// carried 512 bits ahead (multiplied by x^512, modulo P) and added to the block there, so the four products in
// flight do not wait on each other; at the end the four are carried onto the last, block by block onto the
// remaining whole blocks, and the 128 bits left are the message whose remainder the table loop then takes,
// followed by the last bytes. The product of a 64-bit half by its constant must land in the same bit order: with
// the constant x^(n - 1) mod P bit-reversed into the upper half of its word, PCLMULQDQ's product of the two
// bit-reversed operands comes out as x^n times the half, in block order (the one bit it lacks is that x).
// Exactly the table's result (Checkpoint.Crc32FoldingIsTheTableLoopsAtEveryLengthAndOffset).
MEGASLIDE_CLMUL uint32_t crc32_clmul(const void* data, size_t bytes, uint32_t previous) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (bytes < 64) return crc32_table(p, bytes, previous);
  const auto load = [](const unsigned char* at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)); };
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(~previous)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  bytes -= 64;
  const __m128i k512 = constants<512>();
  for (; bytes >= 64; p += 64, bytes -= 64) {
    x0 = _mm_xor_si128(fold(x0, k512), load(p));
    x1 = _mm_xor_si128(fold(x1, k512), load(p + 16));
    x2 = _mm_xor_si128(fold(x2, k512), load(p + 32));
    x3 = _mm_xor_si128(fold(x3, k512), load(p + 48));
  }
  const __m128i k128 = constants<128>();
  __m128i x = _mm_xor_si128(_mm_xor_si128(fold(x0, constants<384>()), fold(x1, constants<256>())),
                            _mm_xor_si128(fold(x2, k128), x3));
  for (; bytes >= 16; p += 16, bytes -= 16) x = _mm_xor_si128(fold(x, k128), load(p));
  alignas(16) unsigned char block[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(block), x);
  // crc32_table takes and returns the complement of its running register: the block's starts at 0.
  return crc32_table(p, bytes, crc32_table(block, 16, ~0u));
}
#undef MEGASLIDE_CLMUL

}  // namespace detail

uint32_t crc32(const void* data, size_t bytes, uint32_t previous) {
  return cpu_has_pclmul() ? detail::crc32_clmul(data, bytes, previous) : detail::crc32_table(data, bytes, previous);
}

void read_in_pieces(const std::string& path, const std::function<void(const char* data, size_t bytes)>& piece) {
  const int fd = open_input_file(path);
  struct stat st {};
  const size_t size = ::fstat(fd, &st) == 0 ? static_cast<size_t>(st.st_size) : 0;
  std::vector<char> buffer(std::clamp<size_t>(size + 1, size_t{64} << 10, size_t{4} << 20));
  try {
    for (;;) {
      const ssize_t n = ::read(fd, buffer.data(), buffer.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot read", path);
      if (n == 0) break;
      piece(buffer.data(), static_cast<size_t>(n));
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

uint32_t file_crc32(const std::string& path) {
  uint32_t c = 0;
  read_in_pieces(path, [&c](const char* data, size_t bytes) { c = crc32(data, bytes, c); });
  return c;
}

std::string read_input_file(const std::string& path, uint64_t max_bytes, bool allow_pipe) {
  const int fd = open_input_file(path, allow_pipe);
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw IoError("'" + path + "' is " + std::to_string(st.st_size) + " bytes, more than the " +
                  std::to_string(max_bytes) + " this file may hold (is it the right file?)");
  }
  std::string out;
  std::vector<char> buffer(64 * 1024);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int saved = errno;
      ::close(fd);
      errno = saved;
      fail("cannot read", path);
    }
    if (n == 0) break;
    out.append(buffer.data(), static_cast<size_t>(n));
    if (out.size() > max_bytes) {  // a file that grew, or a pipe: stop at the cap
      ::close(fd);
      throw IoError("'" + path + "' holds more than the " + std::to_string(max_bytes) +
                    " bytes this file may hold (is it the right file?)");
    }
  }
  ::close(fd);
  return out;
}

std::string parent_path(const std::string& path) { return parent_of(path); }

namespace {
// 0 when a file can be created in `folder` (one is, and removed at once), else the errno. access(2) alone says yes to
// root for folders nothing can be created in (/proc, /sys).
int creatable_in(const std::string& folder) {
  if (::access(folder.c_str(), W_OK | X_OK) != 0) return errno;
  std::string name = join_path(folder, ".megaslide-write-check-XXXXXX");
  const int fd = ::mkstemp(name.data());
  if (fd < 0) return errno;
  ::close(fd);
  ::unlink(name.c_str());
  return 0;
}
}  // namespace

void check_output_file(const std::string& path, const std::string& flag) {
  if (path.empty()) throw IoError(flag + ": an empty path names no file");
  if (path.back() == '/' || is_directory(path))
    throw IoError(flag + " '" + path + "': is a folder; expected a file name");
  const std::string parent = parent_of(path);
  if (!is_directory(parent))
    throw IoError(flag + " '" + path + "': folder '" + parent + "' does not exist" +
                  (path_exists(parent) ? " (a file is in its place)" : ""));
  if (const int error = creatable_in(parent); error != 0)
    throw IoError(flag + " '" + path + "': folder '" + parent + "' is not writable: " + std::strerror(error));
  if (path_exists(path) && ::access(path.c_str(), W_OK) != 0)
    throw IoError(flag + " '" + path + "': the existing file is not writable: " + std::strerror(errno));
  try {
    check_replaceable_output(path);
  } catch (const IoError& e) {
    throw IoError(flag + ": " + e.what());
  }
}

void check_output_folder(const std::string& path, const std::string& flag) {
  if (path.empty()) throw IoError(flag + ": an empty path names no folder");
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  // The nearest ancestor that exists must be a folder we may write into.
  std::string existing = p;
  while (!path_exists(existing)) {
    const std::string up = parent_of(existing);
    if (up == existing) break;
    existing = up;
  }
  if (!is_directory(existing)) throw IoError(flag + " '" + path + "': '" + existing + "' is a file, not a folder");
  if (const int error = creatable_in(existing); error != 0)
    throw IoError(flag + " '" + path + "': folder '" + existing + "' is not writable: " + std::strerror(error));
}

std::string read_file(const std::string& path) {
  std::string out;
  read_in_pieces(path, [&out](const char* data, size_t bytes) { out.append(data, bytes); });
  return out;
}

}  // namespace megaslide::io
