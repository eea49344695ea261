// Small file-system helpers on POSIX calls.
//
// Why not std::filesystem: the LibTorch wheel's libtorch.so exports its own copies of std::filesystem
// operations, which win symbol resolution over the system libstdc++ and crash in some calls
// (remove_all on a non-empty folder dereferences a null function). Every MegaSlide binary links
// libtorch.so, so MegaSlide does not call std::filesystem operations at all (docs/building.md).
//
// Errors throw IoError naming the path and the system's reason. Thread-safety: plain functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace megaslide::io {

class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// Whether `path` is a symbolic link itself (whether or not what it names exists).
bool is_symlink(const std::string& path);
std::string join_path(const std::string& a, const std::string& b);
// `path` from the root: a relative one joined to the working directory, then "." and ".." components and repeated
// or trailing slashes removed (lexically: links are not followed). "" stays "". Throws IoError when the working
// directory cannot be read.
std::string absolute_path(const std::string& path);
// For an error about a path a config or a flag gave: " (a relative path, read from CWD)" when `path` is relative
// (CWD the working directory), else "".
std::string relative_path_note(const std::string& path);

// mkdir -p.
void make_directories(const std::string& path);

// rm -rf; a missing path is not an error.
void remove_tree(const std::string& path);

// Writes `content` to `path` so that readers see the old file or the new one, never a torn one (through
// AtomicFileWriter, below).
class FileGroup;
// `group` given: finished into it, replaced when the group is published.
void write_file_atomically(const std::string& path, const std::string& content, FileGroup* group = nullptr);

// Reads a whole regular file (through open_input_file: a FIFO or a device is refused, not read).
std::string read_file(const std::string& path);

// The one checked open of a file a user names for reading — weights, checkpoints, configs, captions,
// manifests, tensors: a regular file, or with allow_pipe also a FIFO such as a shell's <(...). A FIFO
// (otherwise), a device, a socket or a folder is refused at once with an IoError naming the path and
// what it is: the open is non-blocking, so a FIFO without a writer cannot hang it. Returns a file
// descriptor the caller closes (close-on-exec, blocking again).
int open_input_file(const std::string& path, bool allow_pipe = false);
// The same check for readers that open the path themselves (FFmpeg): opened, checked, closed.
void check_input_file(const std::string& path);

// Reads a file a user named (a config, a prompt file, a checkpoint's `latest` or manifest): only a
// regular file — or, with allow_pipe, a FIFO such as a shell's <(...) — is read, and no more than
// max_bytes of it. A folder, a device (/dev/zero), a socket or a longer file is refused with an
// IoError naming the path and what it is; nothing beyond max_bytes + 1 bytes is ever read, so no
// input can make the reader run out of memory.
std::string read_input_file(const std::string& path, uint64_t max_bytes, bool allow_pipe = false);

// Output paths checked before any work, so that a run never fails at its end for a path it could
// have refused at its start. Each throws IoError naming `flag` (e.g. "--out"), the path and the
// problem:
//  - check_output_file: `path` is not empty and not an existing folder; its folder exists and is
//    writable; if it exists it is a regular file (check_replaceable_output).
//  - check_output_folder: `path` is not empty; it is a writable folder, or can be created as one
//    (its nearest existing ancestor is a writable folder).
// "Writable": a file can be created there — one is (.megaslide-write-check-XXXXXX), and removed at once; access(2)
// alone says yes to root where nothing can be created (/proc). Nothing else is created.
void check_output_file(const std::string& path, const std::string& flag);
void check_output_folder(const std::string& path, const std::string& flag);

// The folder part of a path ("." for a bare name, "/" for a file at the root).
std::string parent_path(const std::string& path);

// Size of a regular file in bytes; throws IoError when it cannot be read.
uint64_t file_size(const std::string& path);

// Names in a folder (not "." or ".."), sorted; throws IoError when it cannot be listed.
std::vector<std::string> list_directory(const std::string& path);

// rename(2) plus an fsync of the destination's folder, so the rename survives a crash.
void rename_durably(const std::string& from, const std::string& to);

// Swaps two existing paths (files or folders) in one atomic step (renameat2 RENAME_EXCHANGE), then
// fsyncs their folder: at every moment each name holds one complete object. Returns false, changing
// nothing, where the file system cannot exchange (then the caller falls back to renames); throws
// IoError for any other failure.
bool exchange_durably(const std::string& a, const std::string& b);

// CRC-32 (the IEEE polynomial of zlib, PNG and Python's zlib.crc32): pass the previous value to
// continue a running checksum. With x86's carry-less multiply (PCLMULQDQ, which CPUID reports on every
// x86-64 CPU since 2010) about 16 GB/s on one core of a Zen 5 EPYC, 6.4 times its table loop, which
// other CPUs run.
uint32_t crc32(const void* data, size_t bytes, uint32_t previous = 0);
namespace detail {
// The two ways crc32 computes, for tests: the table loop, and the folding by carry-less products (call it only
// where crc32_clmul_supported()).
uint32_t crc32_table(const void* data, size_t bytes, uint32_t previous);
uint32_t crc32_clmul(const void* data, size_t bytes, uint32_t previous);
bool crc32_clmul_supported();
}  // namespace detail
// Reads `path` front to back in pieces of up to 4 MiB, handing each to `piece`.
void read_in_pieces(const std::string& path, const std::function<void(const char* data, size_t bytes)>& piece);
// The CRC-32 of a whole file.
uint32_t file_crc32(const std::string& path);

// Refuses (IoError) an output path that exists and is not a regular file — a device such as /dev/full,
// a FIFO, a socket, a folder or a symbolic link: MegaSlide replaces or appends to regular files only.
void check_replaceable_output(const std::string& path);

// A file created next to `path` for this process alone: `path.XXXXXX.tmp` with six random
// characters, created exclusively (O_EXCL: never an existing name, never through a symbolic link
// planted there), mode 0644 less the umask. Returns the descriptor; `name` receives the name. The name
// is registered for remove_temporary_files() until forget_temporary(name) (once it is renamed or removed).
int create_temporary_beside(const std::string& path, std::string& name);
void forget_temporary(const std::string& name);
// Removes every registered temporary file (unlink only: async-signal-safe). A signal handler that ends the
// process calls it, so that Ctrl-C during a model-sized write leaves no `*.XXXXXX.tmp` behind. (Up to 64 names
// are registered at once; more are created, and not removed this way.)
void remove_temporary_files() noexcept;

// The files this process reads through a memory map (weights, cache shards), for naming the one whose bytes went
// missing: a mapped file truncated or rewritten in place by another process turns a read of its lost pages into
// SIGBUS. register_mapping after mmap, forget_mapping before munmap; mapped_file_at(address) is the path of the
// registered mapping holding `address` (copied into a static buffer: one caller at a time), or nullptr
// (async-signal-safe: a signal handler calls it). Up to 4096 mappings of paths shorter than 1024 bytes are registered
// at once; others are mapped, not named.
void register_mapping(const void* base, size_t bytes, const std::string& path);
void forget_mapping(const void* base);
const char* mapped_file_at(const void* address) noexcept;

// Writes a file so that readers see the old file or the complete new one, never a torn one:
// bytes go to a temporary file beside it (create_temporary_beside); commit() fsyncs, renames over
// `path` and fsyncs the folder. If commit() is never reached (an error, an exception), the destructor
// removes the temporary file and `path` is untouched. `path` itself must be absent or a regular file
// (check_replaceable_output). Keeps the size and the CRC-32 of what it wrote. Errors are IoError
// naming the path and the system's reason (no space, file too large, read-only…).
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  void write(const void* data, size_t bytes);
  void commit();  // finish(), then the rename over `path`
  // fsyncs and closes the temporary file, complete but not yet renamed (a FileGroup renames it with the others).
  void finish();
  uint64_t bytes_written() const { return bytes_; }
  uint32_t crc32() const { return crc_; }

 private:
  friend class FileGroup;
  void publish();  // the rename of a finished file
  std::string path_, tmp_;
  int fd_ = -1;
  bool finished_ = false;  // closed, its temporary file not yet renamed
  uint64_t bytes_ = 0;
  uint32_t crc_ = 0;
};

// Files replaced together (an export of several files: two experts, a weights file and its config.json): each
// is written whole to its temporary file and finished (AtomicFileWriter::finish), and publish() renames them
// all, in the order added, only once every one is written. Until then (an error, a full disk, an exception)
// every path keeps its old content, and the destructor removes the temporary files. The renames run one after
// another: one that fails (renames within a folder hardly do) leaves the earlier ones done. Every new file sits
// beside its old one until publish(): the disk must hold both sets.
class FileGroup {
 public:
  FileGroup() = default;
  FileGroup(const FileGroup&) = delete;
  FileGroup& operator=(const FileGroup&) = delete;
  void add(std::unique_ptr<AtomicFileWriter> finished);
  void publish();
  // `out`, written: committed now when `group` is null, else finished into it.
  static void commit_or_add(std::unique_ptr<AtomicFileWriter> out, FileGroup* group);

 private:
  std::vector<std::unique_ptr<AtomicFileWriter>> files_;
};

// An exclusive advisory lock (flock(2), never waited for) on the file `path`, created 0644 if missing
// and never through a symbolic link, held until destruction; the holder's note "pid N on host H since
// T (who)" is written into it. The lock is the kernel's: it ends with the process in any way (exit,
// crash, kill -9), so a stale file never blocks a later holder. try_acquire returns null when another
// process holds it, with that holder's note in `holder`; other failures throw IoError.
class FileLock {
 public:
  static std::unique_ptr<FileLock> try_acquire(const std::string& path, const std::string& who, std::string* holder);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  FileLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// A file this program writes in place — a log it appends to, a file it truncates and rewrites: opened
// without following a symbolic link at its name (O_NOFOLLOW), created with mode 0644 less the umask (never
// world-writable, even under umask 000), refused when the path exists and is not a regular file.
// Closes on destruction.
class OutputFile {
 public:
  OutputFile(const std::string& path, bool append);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  // Writes all of `data` (IoError naming the path on failure).
  void write(const void* data, size_t bytes);
  void write(const std::string& text) { write(text.data(), text.size()); }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace megaslide::io
