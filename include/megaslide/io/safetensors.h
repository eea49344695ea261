// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
//
//   [8 bytes: N, unsigned little-endian] [N bytes: JSON header] [tensor bytes, little-endian, row-major]
//   header = {"NAME": {"dtype": "F32", "shape": [2, 3], "data_offsets": [BEGIN, END]}, ...,
//             "__metadata__": {"key": "string value", ...}}            (metadata optional)
//   BEGIN/END are byte offsets into the data section that follows the header.
//
// Dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, and the fp8 dtypes F8_E4M3 (torch's
// float8_e4m3fn) and F8_E5M2 (float8_e5m2), read and written as their bytes (io/fp8.h turns them into
// floating tensors).
// Writing lays tensors out back to back in the order given, pads the header with spaces to a multiple
// of 8 bytes (as the reference implementation does) and replaces the file atomically.
// Reading validates everything before it trusts it: the header length against the file size, the JSON,
// every entry's dtype and shape, offsets within the data section, END - BEGIN = numel × itemsize, no two
// tensors overlapping. Every error is a SafetensorsError naming the file and, where there is one, the
// tensor. Tensors are read straight from the file into freshly allocated CPU tensors (pread, no copy of
// the whole file), which the caller owns.
//
// The host is little-endian (x86-64, aarch64); the implementation refuses to build otherwise.
// Thread-safety: plain functions; concurrent calls on different files are safe.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/util/errors.h"

namespace megaslide::io {

class SafetensorsError : public IoError, public InputError {
 public:
  using IoError::IoError;
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype = torch::kFloat32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in data-offset order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // file offset of the data section (8 + N)
};

// "F32" <-> torch::kFloat32 and so on; unknown names or types throw SafetensorsError.
std::string safetensors_dtype_name(torch::ScalarType dtype);
torch::ScalarType safetensors_dtype(const std::string& name);

// Size and CRC-32 (io::crc32) of a file as written.
struct WrittenFile {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

// Writes `tensors` (any device, any layout; names unique, not "__metadata__") to `path`, streaming
// them tensor by tensor: each is converted (to the CPU, contiguous, and to `cast` when given and the
// tensor is floating) just before it is written, so at most one converted tensor exists at a time, and
// contiguous CPU tensors of the written dtype are written without a copy. Atomic
// (io::AtomicFileWriter): on any error `path` keeps its old content.
// `group` given: finished into it, replaced when the group is published (io::FileGroup).
WrittenFile write_safetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {},
                              std::optional<c10::ScalarType> cast = std::nullopt, FileGroup* group = nullptr);

// The same with each tensor's value produced as it is written: `tensors` give the names, dtypes and shapes
// (meta tensors will do) and fetch(i) returns tensor i's value, of that dtype and shape, just before it is
// written (dropped before the next fetch): a file larger than memory, written from state paged in piece by piece.
WrittenFile write_safetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata,
                              const std::function<torch::Tensor(size_t index)>& fetch);

// The bytes write_safetensors would write (tests build corrupt files from them).
std::string encode_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

// Reads and validates only the header (cheap: the tensors are not read).
SafetensorsHeader read_safetensors_header(const std::string& path);

struct SafetensorsFile {
  NamedTensors tensors;  // CPU tensors, in data-offset order
  std::map<std::string, std::string> metadata;
};
SafetensorsFile read_safetensors(const std::string& path);

// Reads the file's tensors straight into `targets` (contiguous CPU tensors, e.g. views into a host
// store), which must match it exactly: every target name present with the target's dtype and shape,
// and no other tensor in the file (unless `allow_extra`). Errors name the file and the tensor. On error,
// targets read before the bad one have been overwritten: callers load into state they can discard.
void read_safetensors_into(const std::string& path, const NamedTensors& targets, bool allow_extra = false);

// Reads elements [offset, offset + target.numel()) of tensor `name`, taken flat, into `target` (a
// contiguous CPU tensor of the file's dtype). Errors name the file and the tensor.
void read_safetensors_range_into(const std::string& path, const std::string& name, int64_t offset,
                                 const torch::Tensor& target);

}  // namespace megaslide::io
