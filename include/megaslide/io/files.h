// Small file-system helpers on POSIX calls.
//
// Why not std::filesystem: the LibTorch wheel's libtorch.so exports its own copies of std::filesystem
// operations, which win symbol resolution over the system libstdc++ and crash in some calls
// (remove_all on a non-empty folder dereferences a null function). Every MegaSlide binary links
// libtorch.so, so MegaSlide does not call std::filesystem operations at all (docs/building.md).
//
// Errors throw IoError naming the path and the system's reason. Thread-safety: plain functions.
#pragma once

#include <stdexcept>
#include <string>

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

}  // namespace megaslide::io
