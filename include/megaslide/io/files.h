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
std::string join_path(const std::string& a, const std::string& b);

// mkdir -p.
void make_directories(const std::string& path);

// rm -rf; a missing path is not an error.
void remove_tree(const std::string& path);

// Writes `content` to `path` so that readers see the old file or the new one, never a torn one:
// write to `path.tmp`, fsync, rename over `path`, fsync the folder.
void write_file_atomically(const std::string& path, const std::string& content);

std::string read_file(const std::string& path);

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
//    writable (nothing is created).
//  - check_output_folder: `path` is not empty; it is a writable folder, or can be created as one
//    (its nearest existing ancestor is a writable folder; nothing is created).
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
// continue a running checksum. About 1–2 GB/s per core.
uint32_t crc32(const void* data, size_t bytes, uint32_t previous = 0);
// Reads `path` front to back in pieces of up to 4 MiB, handing each to `piece`.
void read_in_pieces(const std::string& path, const std::function<void(const char* data, size_t bytes)>& piece);
// The CRC-32 of a whole file.
uint32_t file_crc32(const std::string& path);

// Writes a file so that readers see the old file or the complete new one, never a torn one:
// bytes go to `path.tmp`; commit() fsyncs, renames over `path` and fsyncs the folder. If commit() is
// never reached (an error, an exception), the destructor removes the temporary file and `path` is
// untouched. Keeps the size and the CRC-32 of what it wrote. Errors are IoError naming the path and
// the system's reason (no space, file too large, read-only…).
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  void write(const void* data, size_t bytes);
  void commit();
  uint64_t bytes_written() const { return bytes_; }
  uint32_t crc32() const { return crc_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
  uint32_t crc_ = 0;
};

}  // namespace megaslide::io
