// TensorBoard event files (io/event_file.h): TFRecord framing with CRC-32C around Event messages in the
// protobuf wire encoding (src/io/event_encoding.h says why that is written out rather than linked).
#include "megaslide/io/event_file.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "megaslide/io/files.h"

#include "io/event_encoding.h"

namespace megaslide::io {

namespace {

// The reflected CRC-32C table (polynomial 0x82F63B78).
const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

uint64_t get_le(const std::string& in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(in[at + static_cast<size_t>(i)])) << (8 * i);
  return v;
}

// One TFRecord around `data`, appended to `out`.
void append_record(std::string& out, const std::string& data) {
  std::string length;
  put_le(length, data.size(), 8);
  out += length;
  put_le(out, masked_crc32c(crc32c(length.data(), length.size())), 4);
  out += data;
  put_le(out, masked_crc32c(crc32c(data.data(), data.size())), 4);
}

}  // namespace

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  const auto& table = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < bytes; ++i) crc = table[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

struct EventFileWriter::Impl {
  std::unique_ptr<OutputFile> file;
  std::string path;

  void write(const events::Event& e) {
    std::string record;
    append_record(record, events::encode(e));
    file->write(record);  // one write: the record whole
  }
};

namespace {
events::Event event_at(int64_t step, double wall_time) {
  events::Event e;
  e.step = step;
  e.wall_time = wall_time;
  return e;
}
}  // namespace

EventFileWriter::EventFileWriter(const std::string& dir) : impl_(std::make_unique<Impl>()) {
  make_directories(dir);
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(now).count();
  impl_->path = join_path(dir, "events.out.tfevents." + std::to_string(seconds) + "." + host + "." +
                                   std::to_string(::getpid()) + ".megaslide");
  impl_->file = std::make_unique<OutputFile>(impl_->path, /*append=*/false);
  auto version =
      event_at(0, static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(now).count()) * 1e-6);
  version.file_version = "brain.Event:2";
  impl_->write(version);
}

EventFileWriter::~EventFileWriter() = default;

const std::string& EventFileWriter::path() const { return impl_->path; }

void EventFileWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                              double wall_time) {
  if (values.empty()) return;
  auto e = event_at(step, wall_time);
  for (const auto& [tag, value] : values) {
    events::Value v;
    v.tag = tag;
    v.kind = events::Value::Kind::kScalar;
    v.scalar = static_cast<float>(value);
    e.values.push_back(std::move(v));
  }
  impl_->write(e);
}

void EventFileWriter::image(const std::string& tag, int64_t step, const std::string& png, int64_t height, int64_t width,
                            double wall_time) {
  auto e = event_at(step, wall_time);
  events::Value v;
  v.tag = tag;
  v.kind = events::Value::Kind::kImage;
  v.height = height;
  v.width = width;
  v.data = png;
  e.values.push_back(std::move(v));
  impl_->write(e);
}

void EventFileWriter::text(const std::string& tag, int64_t step, const std::string& text, double wall_time) {
  auto e = event_at(step, wall_time);
  events::Value v;
  v.tag = tag;
  v.kind = events::Value::Kind::kText;
  v.data = text;
  e.values.push_back(std::move(v));
  impl_->write(e);
}

void EventFileWriter::restart(int64_t step, double wall_time) {
  auto e = event_at(step, wall_time);
  e.session_start = true;
  impl_->write(e);
}

std::vector<EventRecord> read_event_file(const std::string& path) {
  const std::string bytes = read_file(path);
  std::vector<EventRecord> out;
  size_t at = 0;
  while (at < bytes.size()) {
    const auto bad = [&](const std::string& what) {
      throw IoError("event file '" + path + "': the record at byte " + std::to_string(at) + " " + what);
    };
    if (bytes.size() - at < 12) bad("is cut short (no length)");
    const uint64_t length = get_le(bytes, at, 8);
    if (masked_crc32c(crc32c(bytes.data() + at, 8)) != get_le(bytes, at + 8, 4))
      bad("has a length whose CRC-32C does not match");
    if (length > bytes.size() - at - 12 || bytes.size() - at - 12 - length < 4) bad("is cut short (its data)");
    const std::string data = bytes.substr(at + 12, length);
    if (masked_crc32c(crc32c(data.data(), data.size())) != get_le(bytes, at + 12 + length, 4))
      bad("has data whose CRC-32C does not match");
    events::Event e;
    try {
      e = events::decode(data);
    } catch (const std::runtime_error& error) {
      bad(std::string("is not an Event message: ") + error.what());
    }
    EventRecord head;
    head.wall_time = e.wall_time;
    head.step = e.step;
    if (!e.file_version.empty()) {
      head.file_version = e.file_version;
      out.push_back(head);
    }
    if (e.session_start) {
      head.kind = "restart";
      out.push_back(head);
    }
    for (const auto& v : e.values) {
      EventRecord r = head;
      r.tag = v.tag;
      r.kind = v.kind == events::Value::Kind::kScalar  ? "scalar"
               : v.kind == events::Value::Kind::kImage ? "image"
               : v.kind == events::Value::Kind::kText  ? "text"
                                                       : "other";
      r.scalar = v.scalar;
      r.data = v.data;
      r.height = v.height;
      r.width = v.width;
      out.push_back(std::move(r));
    }
    at += 12 + length + 4;
  }
  return out;
}

}  // namespace megaslide::io
