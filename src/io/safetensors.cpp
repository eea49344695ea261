#include "megaslide/io/safetensors.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors_ranges.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

namespace megaslide::io {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace {

// The reference implementation refuses headers above 100 MB; so do we (a corrupt length must not make
// us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeName {
  const char* name;
  torch::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", torch::kFloat64},
    {"F32", torch::kFloat32},
    {"F16", torch::kFloat16},
    {"BF16", torch::kBFloat16},
    {"I64", torch::kInt64},
    {"I32", torch::kInt32},
    {"I16", torch::kInt16},
    {"I8", torch::kInt8},
    {"U8", torch::kUInt8},
    {"BOOL", torch::kBool},
    // fp8 (io/fp8.h): published fp8 checkpoints hold float8_e4m3fn, some float8_e5m2.
    {"F8_E4M3", torch::kFloat8_e4m3fn},
    {"F8_E5M2", torch::kFloat8_e5m2},
};

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw SafetensorsError("safetensors file '" + path + "': " + problem);
}

[[noreturn]] void fail_tensor(const std::string& path, const std::string& name, const std::string& problem) {
  throw SafetensorsError("safetensors file '" + path + "': tensor '" + name + "': " + problem);
}

class File {
 public:
  explicit File(const std::string& path) : path_(path) {
    try {
      fd_ = open_input_file(path);
    } catch (const IoError& e) {
      fail(path, e.what());
    }
  }
  ~File() { ::close(fd_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail(path_, std::string("cannot stat: ") + std::strerror(errno));
    return static_cast<uint64_t>(st.st_size);
  }

  void read_at(void* out, uint64_t bytes, uint64_t offset) const {
    auto* p = static_cast<char*>(out);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, std::min<uint64_t>(bytes, 1ull << 30), static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(path_, std::string("read failed: ") + std::strerror(errno));
      if (n == 0) fail(path_, "file ended early (truncated?)");
      p += n, bytes -= static_cast<uint64_t>(n), offset += static_cast<uint64_t>(n);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
};

SafetensorsHeader parse_header(const std::string& path, const File& file) {
  const uint64_t file_size = file.size();
  if (file_size < 8)
    fail(path, "file is " + std::to_string(file_size) + " bytes, shorter than the 8-byte header length");
  unsigned char length_bytes[8];
  file.read_at(length_bytes, 8, 0);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length_bytes[i];
  // A safetensors file opens with the little-endian length of its JSON header, then the header, which
  // begins with '{'. Anything else is said plainly first: a user who hands us the wrong file (a
  // checkpoint's `latest` pointer, a video) needs that, not the arithmetic.
  const auto opening = [&] {
    std::string shown;
    for (unsigned char c : length_bytes) shown += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '.';
    return "; it begins with '" + shown + "'";
  };
  if (n > file_size - 8)
    fail(path, "not a safetensors file (or a truncated one): its first 8 bytes, read as the header length, say " +
                   std::to_string(n) + " but only " + std::to_string(file_size - 8) + " bytes follow" + opening());
  if (n > kMaxHeaderBytes) fail(path, "header length " + std::to_string(n) + " is above the 100 MB limit");
  std::string text(n, '\0');
  file.read_at(text.data(), n, 8);
  if (n == 0 || text[0] != '{')
    fail(path, "not a safetensors file: the header after the 8-byte length does not begin with '{'" + opening());

  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&
               e) {  // parse_error, and out_of_range for a number that overflows (found by fuzz.safetensors)
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) fail(path, "header is not a JSON object");

  SafetensorsHeader header;
  header.data_start = 8 + n;
  const uint64_t data_size = file_size - header.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, "__metadata__ is not a JSON object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail(path, "__metadata__ value of '" + m.key() + "' is not a string");
        header.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) fail_tensor(path, name, "entry is not a JSON object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail_tensor(path, name, "missing string 'dtype'");
    if (!v.contains("shape") || !v["shape"].is_array()) fail_tensor(path, name, "missing array 'shape'");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      fail_tensor(path, name, "missing 'data_offsets' [begin, end]");
    SafetensorsEntry e;
    e.name = name;
    try {
      e.dtype = safetensors_dtype(v["dtype"].get<std::string>());
    } catch (const SafetensorsError& err) {
      fail_tensor(path, name, err.what());
    }
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned())
        fail_tensor(path, name, "shape " + v["shape"].dump() + " has an entry that is not a non-negative integer");
      const auto size = d.get<uint64_t>();
      if (size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
      e.shape.push_back(static_cast<int64_t>(size));
      if (size != 0 && numel > std::numeric_limits<uint64_t>::max() / size) overflow = true;
      numel *= size;
    }
    for (const auto& o : v["data_offsets"])
      if (!o.is_number_unsigned())
        fail_tensor(path, name, "data_offsets " + v["data_offsets"].dump() + " are not non-negative integers");
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    if (e.begin > e.end) fail_tensor(path, name, "data_offsets " + v["data_offsets"].dump() + " run backwards");
    if (e.end > data_size)
      fail_tensor(path, name,
                  "data_offsets " + v["data_offsets"].dump() + " reach past the data section (" +
                      std::to_string(data_size) + " bytes; truncated file?)");
    const auto itemsize = static_cast<uint64_t>(c10::elementSize(e.dtype));
    if (overflow || numel > std::numeric_limits<uint64_t>::max() / itemsize || numel * itemsize != e.end - e.begin)
      fail_tensor(path, name,
                  "shape " + v["shape"].dump() + " of " + v["dtype"].get<std::string>() + " needs " +
                      (overflow ? std::string("more than 2^64") : std::to_string(numel * itemsize)) +
                      " bytes but data_offsets hold " + std::to_string(e.end - e.begin));
    header.entries.push_back(std::move(e));
  }
  std::sort(header.entries.begin(), header.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // As the reference implementation requires: the tensors cover the data section exactly, back to back
  // (a gap or trailing bytes mean the file is not what its header says: damaged, or appended to).
  uint64_t covered = 0;
  for (size_t i = 0; i < header.entries.size(); ++i) {
    const auto& cur = header.entries[i];
    if (i > 0 && cur.begin < header.entries[i - 1].end)
      fail_tensor(path, cur.name, "bytes overlap those of tensor '" + header.entries[i - 1].name + "'");
    if (cur.begin != covered)
      fail_tensor(path, cur.name,
                  "data starts at byte " + std::to_string(cur.begin) + " of the data section, expected " +
                      std::to_string(covered) + " (a gap between tensors)");
    covered = cur.end;
  }
  if (covered != data_size)
    fail(path, "the tensors cover " + std::to_string(covered) + " bytes of the data section but it holds " +
                   std::to_string(data_size) + " (trailing bytes)");
  return header;
}

}  // namespace

std::string safetensors_dtype_name(torch::ScalarType dtype) {
  for (const auto& d : kDtypes)
    if (d.type == dtype) return d.name;
  throw SafetensorsError(std::string("safetensors: no dtype name for ") + c10::toString(dtype));
}

torch::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  std::string supported;
  for (const auto& d : kDtypes) supported += (supported.empty() ? "" : " ") + std::string(d.name);
  throw SafetensorsError("unsupported dtype '" + name + "' (supported: " + supported + ")");
}

namespace {
// The dtype a tensor is written in: `cast` when given and the tensor is floating, else its own.
c10::ScalarType written_dtype(const torch::Tensor& t, std::optional<c10::ScalarType> cast) {
  return cast && t.is_floating_point() ? *cast : t.scalar_type();
}

// The header text (padded to 8 bytes) for `tensors` written in written_dtype.
std::string layout(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata,
                   std::optional<c10::ScalarType> cast) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(!name.empty() && name != "__metadata__", "write_safetensors: invalid tensor name '", name, "'");
    TORCH_CHECK(names.insert(name).second, "write_safetensors: tensor name '", name, "' appears twice");
    TORCH_CHECK(tensor.defined(), "write_safetensors: tensor '", name, "' is undefined");
    const auto dtype = written_dtype(tensor, cast);
    const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * static_cast<uint64_t>(c10::elementSize(dtype));
    header[name] = {{"dtype", safetensors_dtype_name(dtype)},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string prefix;
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) prefix.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return prefix + text;
}

// Calls sink(data, bytes) for each tensor in turn, converted to a contiguous CPU tensor of its written
// dtype just before (contiguous CPU tensors of that dtype, like the host store's views, are not copied):
// at most one converted tensor exists at a time.
template <typename Sink>
void for_each_payload(const NamedTensors& tensors, std::optional<c10::ScalarType> cast, Sink&& sink) {
  for (const auto& [name, tensor] : tensors) {
    const auto t = tensor.detach().to(torch::kCPU, written_dtype(tensor, cast)).contiguous();
    sink(t.data_ptr(), static_cast<size_t>(t.numel()) * static_cast<size_t>(t.element_size()));
  }
}
}  // namespace

std::string encode_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::string out = layout(tensors, metadata, std::nullopt);
  for_each_payload(tensors, std::nullopt,
                   [&](const void* data, size_t bytes) { out.append(static_cast<const char*>(data), bytes); });
  return out;
}

WrittenFile write_safetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata, std::optional<c10::ScalarType> cast,
                              FileGroup* group) {
  const std::string head = layout(tensors, metadata, cast);
  auto out = std::make_unique<AtomicFileWriter>(path);
  out->write(head.data(), head.size());
  for_each_payload(tensors, cast, [&](const void* data, size_t bytes) { out->write(data, bytes); });
  const WrittenFile written{out->bytes_written(), out->crc32()};
  FileGroup::commit_or_add(std::move(out), group);
  return written;
}

WrittenFile write_safetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata,
                              const std::function<torch::Tensor(size_t index)>& fetch) {
  const std::string head = layout(tensors, metadata, std::nullopt);
  AtomicFileWriter out(path);
  out.write(head.data(), head.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor& declared = tensors[i].second;
    const torch::Tensor t = fetch(i).detach().to(torch::kCPU).contiguous();
    TORCH_CHECK(t.scalar_type() == declared.scalar_type() && t.sizes() == declared.sizes(), "write_safetensors: '",
                tensors[i].first, "' was declared ", declared.scalar_type(), " ", declared.sizes(), " but fetched as ",
                t.scalar_type(), " ", t.sizes());
    out.write(t.data_ptr(), static_cast<size_t>(t.numel()) * static_cast<size_t>(t.element_size()));
  }
  out.commit();
  return {out.bytes_written(), out.crc32()};
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  File file(path);
  return parse_header(path, file);
}

SafetensorsFile read_safetensors(const std::string& path) {
  File file(path);
  auto header = parse_header(path, file);
  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  for (const auto& e : header.entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    if (e.end > e.begin) file.read_at(t.data_ptr(), e.end - e.begin, header.data_start + e.begin);
    if (e.dtype == torch::kBool && t.numel() > 0) {
      // A bool byte other than 0 or 1 is undefined behaviour in C++; refuse it.
      auto bytes = t.view(torch::kUInt8);
      if (bytes.gt(1).any().item<bool>()) fail_tensor(path, e.name, "BOOL data holds bytes other than 0 and 1");
    }
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace megaslide::io

namespace megaslide::io {

namespace {
std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
}  // namespace

void read_safetensors_into(const std::string& path, const NamedTensors& targets, bool allow_extra) {
  File file(path);
  const auto header = parse_header(path, file);
  std::map<std::string, const SafetensorsEntry*> entries;
  for (const auto& e : header.entries) entries[e.name] = &e;
  std::set<std::string> expected;
  for (const auto& [name, target] : targets) {
    expected.insert(name);
    auto it = entries.find(name);
    if (it == entries.end())
      fail_tensor(path, name, "missing (the file has " + std::to_string(entries.size()) + " tensors)");
    const auto& e = *it->second;
    if (e.dtype != target.scalar_type())
      fail_tensor(
          path, name,
          "dtype is " + safetensors_dtype_name(e.dtype) + ", expected " + safetensors_dtype_name(target.scalar_type()));
    if (e.shape != target.sizes().vec())
      fail_tensor(path, name, "shape is " + shape_string(e.shape) + ", expected " + shape_string(target.sizes().vec()));
    TORCH_CHECK(target.device().is_cpu() && target.is_contiguous(), "read_safetensors_into: the target of '", name,
                "' must be a contiguous CPU tensor");
    if (e.end > e.begin) file.read_at(target.data_ptr(), e.end - e.begin, header.data_start + e.begin);
  }
  if (allow_extra) return;
  for (const auto& e : header.entries)
    if (!expected.count(e.name))
      fail_tensor(path, e.name, "is not expected here (an extra tensor: wrong file or model?)");
}

struct SafetensorsRangeReader::Impl {
  File file;
  SafetensorsHeader header;
  std::map<std::string, const SafetensorsEntry*> entries;
  explicit Impl(const std::string& path) : file(path), header(parse_header(path, file)) {
    for (const auto& e : header.entries) entries[e.name] = &e;
  }
};

SafetensorsRangeReader::SafetensorsRangeReader(const std::string& path)
    : path_(path), impl_(std::make_unique<Impl>(path)) {}
SafetensorsRangeReader::SafetensorsRangeReader(SafetensorsRangeReader&&) noexcept = default;
SafetensorsRangeReader& SafetensorsRangeReader::operator=(SafetensorsRangeReader&&) noexcept = default;
SafetensorsRangeReader::~SafetensorsRangeReader() = default;

void SafetensorsRangeReader::read_into(const std::string& name, int64_t offset, const at::Tensor& target) const {
  const auto it = impl_->entries.find(name);
  if (it == impl_->entries.end())
    fail_tensor(path_, name, "missing (the file has " + std::to_string(impl_->entries.size()) + " tensors)");
  const SafetensorsEntry& entry = *it->second;
  if (entry.dtype != target.scalar_type())
    fail_tensor(path_, name,
                "dtype is " + safetensors_dtype_name(entry.dtype) + ", expected " +
                    safetensors_dtype_name(target.scalar_type()));
  const auto element = static_cast<uint64_t>(target.element_size());
  const uint64_t numel = (entry.end - entry.begin) / element;
  if (offset < 0 || static_cast<uint64_t>(offset + target.numel()) > numel)
    fail_tensor(path_, name,
                "has " + std::to_string(numel) + " elements; elements [" + std::to_string(offset) + ", " +
                    std::to_string(offset + target.numel()) + ") were asked for");
  TORCH_CHECK(target.device().is_cpu() && target.is_contiguous(), "SafetensorsRangeReader: the target of '", name,
              "' must be a contiguous CPU tensor");
  if (target.numel() > 0)
    impl_->file.read_at(target.data_ptr(), static_cast<uint64_t>(target.numel()) * element,
                        impl_->header.data_start + entry.begin + static_cast<uint64_t>(offset) * element);
}

const SafetensorsRangeReader& SafetensorsRangeReaders::operator()(const std::string& path) {
  auto it = readers_.find(path);
  if (it == readers_.end()) it = readers_.emplace(path, SafetensorsRangeReader(path)).first;
  return it->second;
}

void read_safetensors_range_into(const std::string& path, const std::string& name, int64_t offset,
                                 const torch::Tensor& target) {
  SafetensorsRangeReader(path).read_into(name, offset, target);
}

}  // namespace megaslide::io
