// The protobuf wire encoding of the TensorBoard event messages io/event_file.h writes and reads
// (src/io/tensorboard_event.proto names their fields: TensorFlow's field numbers), written out here
// instead of through a protobuf library: Debian's libsentencepiece, which the umT5 tokenizer loads,
// carries and exports its own protobuf 3.14 runtime, and a process that also loads Debian's libprotobuf
// 3.21 aborts in sentencepiece's version check (measured: every Umt5Tokenizer test). These messages
// need six wire operations. tests/event_protobuf/test_event_protobuf.cpp checks this encoder and decoder against the
// classes Debian's protoc generates from the .proto, linked with Debian's libprotobuf-lite in a program
// of their own.
//
// Header-only and free of LibTorch and of the rest of the library, so that check can include it alone.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace megaslide::io::events {

// One Event: the version event (file_version), a session START (restart_step), or summary values.
struct Value {
  std::string tag;
  enum class Kind { kScalar, kImage, kText, kOther } kind = Kind::kOther;
  float scalar = 0;
  int64_t height = 0, width = 0;  // image
  std::string data;               // image: the encoded image; text: the text
};
struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;  // non-empty: the version event
  bool session_start = false;
  std::vector<Value> values;
};

namespace wire {
enum Type : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

inline void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
inline void key(std::string& out, uint32_t field, Type type) {
  varint(out, (static_cast<uint64_t>(field) << 3) | type);
}
// int32/int64/enum fields: a negative value is its 64-bit two's complement (10 bytes), as protobuf does.
inline void integer(std::string& out, uint32_t field, int64_t v) {
  key(out, field, kVarint);
  varint(out, static_cast<uint64_t>(v));
}
inline void bytes(std::string& out, uint32_t field, const std::string& data) {
  key(out, field, kBytes);
  varint(out, data.size());
  out += data;
}
inline void fixed64(std::string& out, uint32_t field, double v) {
  key(out, field, kFixed64);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, 8);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}
inline void fixed32(std::string& out, uint32_t field, float v) {
  key(out, field, kFixed32);
  uint32_t bits = 0;
  std::memcpy(&bits, &v, 4);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}

// Reads one message's fields in order; every malformed input is a std::runtime_error.
class Reader {
 public:
  explicit Reader(const std::string& data) : data_(data) {}
  bool next(uint32_t& field, Type& type) {
    if (pos_ == data_.size()) return false;
    const uint64_t k = varint();
    field = static_cast<uint32_t>(k >> 3);
    type = static_cast<Type>(k & 7);
    if (field == 0) throw std::runtime_error("field number 0");
    return true;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) throw std::runtime_error("a varint runs past the end");
      const auto b = static_cast<unsigned char>(data_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    throw std::runtime_error("a varint longer than 10 bytes");
  }
  std::string bytes() {
    const uint64_t n = varint();
    if (n > data_.size() - pos_) throw std::runtime_error("a length-delimited field runs past the end");
    std::string out = data_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return out;
  }
  double fixed64() {
    const uint64_t bits = little(8);
    double v;
    std::memcpy(&v, &bits, 8);
    return v;
  }
  float fixed32() {
    const auto bits = static_cast<uint32_t>(little(4));
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  }
  void skip(Type type) {
    switch (type) {
      case kVarint:
        varint();
        break;
      case kFixed64:
        little(8);
        break;
      case kBytes:
        bytes();
        break;
      case kFixed32:
        little(4);
        break;
      default:
        throw std::runtime_error("wire type " + std::to_string(static_cast<int>(type)) + " (groups are not used here)");
    }
  }

 private:
  uint64_t little(int n) {
    if (static_cast<size_t>(n) > data_.size() - pos_) throw std::runtime_error("a fixed-size field runs past the end");
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(data_[pos_++])) << (8 * i);
    return v;
  }
  const std::string& data_;
  size_t pos_ = 0;
};
}  // namespace wire

// Event as tensorboard_event.proto defines it (proto3: fields at their default are left out, but a oneof
// member that is set is written, whatever its value).
inline std::string encode(const Event& e) {
  using namespace wire;
  std::string out;
  if (e.wall_time != 0) fixed64(out, 1, e.wall_time);
  if (e.step != 0) integer(out, 2, e.step);
  if (!e.file_version.empty()) {
    bytes(out, 3, e.file_version);
    return out;
  }
  if (e.session_start) {
    std::string log;
    integer(log, 1, 1);  // SessionLog.status = START
    bytes(out, 6, log);
    return out;
  }
  std::string summary;
  for (const auto& v : e.values) {
    std::string value;
    if (!v.tag.empty()) bytes(value, 1, v.tag);
    if (v.kind == Value::Kind::kScalar) {
      fixed32(value, 2, v.scalar);
    } else if (v.kind == Value::Kind::kImage) {
      std::string image;
      if (v.height != 0) integer(image, 1, v.height);
      if (v.width != 0) integer(image, 2, v.width);
      integer(image, 3, 3);  // colorspace RGB
      if (!v.data.empty()) bytes(image, 4, v.data);
      bytes(value, 4, image);
    } else if (v.kind == Value::Kind::kText) {
      std::string dim, shape, tensor, plugin, metadata;
      integer(dim, 1, 1);
      bytes(shape, 2, dim);
      integer(tensor, 1, 7);  // DT_STRING
      bytes(tensor, 2, shape);
      bytes(tensor, 8, v.data);
      bytes(value, 8, tensor);
      bytes(plugin, 1, "text");
      bytes(metadata, 1, plugin);
      bytes(value, 9, metadata);
    }
    bytes(summary, 1, value);
  }
  bytes(out, 5, summary);
  return out;
}

namespace detail {
inline void expect(wire::Type got, wire::Type want, const char* what) {
  if (got != want)
    throw std::runtime_error(std::string(what) + " has wire type " + std::to_string(static_cast<int>(got)));
}

// Calls field(number, type, reader) for each field of a length-delimited message.
template <typename Field>
void each_field(const std::string& message, Field&& field) {
  wire::Reader r(message);
  uint32_t number;
  wire::Type type;
  while (r.next(number, type)) field(number, type, r);
}

inline Value decode_value(const std::string& message) {
  using namespace wire;
  Value v;
  each_field(message, [&v](uint32_t number, Type type, Reader& r) {
    if (number == 1) {
      expect(type, kBytes, "Value.tag");
      v.tag = r.bytes();
    } else if (number == 2) {
      expect(type, kFixed32, "Value.simple_value");
      v.kind = Value::Kind::kScalar;
      v.scalar = r.fixed32();
    } else if (number == 4) {  // Image
      expect(type, kBytes, "Value.image");
      v.kind = Value::Kind::kImage;
      each_field(r.bytes(), [&v](uint32_t n, Type t, Reader& i) {
        if (n == 1 && t == kVarint) v.height = static_cast<int64_t>(i.varint());
        else if (n == 2 && t == kVarint) v.width = static_cast<int64_t>(i.varint());
        else if (n == 4 && t == kBytes) v.data = i.bytes();
        else i.skip(t);
      });
    } else if (number == 8) {  // Tensor: a text's string_val
      expect(type, kBytes, "Value.tensor");
      each_field(r.bytes(), [&v](uint32_t n, Type t, Reader& tensor) {
        if (n == 8 && t == kBytes) v.kind = Value::Kind::kText, v.data = tensor.bytes();
        else tensor.skip(t);
      });
    } else {
      r.skip(type);
    }
  });
  return v;
}
}  // namespace detail

// The inverse of encode, for any valid encoding of these messages (fields in any order, unknown ones
// skipped). Throws std::runtime_error for a malformed one.
inline Event decode(const std::string& data) {
  using namespace wire;
  using detail::expect;
  Event e;
  detail::each_field(data, [&e](uint32_t number, Type type, Reader& r) {
    if (number == 1) {
      expect(type, kFixed64, "Event.wall_time");
      e.wall_time = r.fixed64();
    } else if (number == 2) {
      expect(type, kVarint, "Event.step");
      e.step = static_cast<int64_t>(r.varint());
    } else if (number == 3) {
      expect(type, kBytes, "Event.file_version");
      e.file_version = r.bytes();
    } else if (number == 5) {  // Summary: its values
      expect(type, kBytes, "Event.summary");
      detail::each_field(r.bytes(), [&e](uint32_t n, Type t, Reader& s) {
        if (n != 1) return s.skip(t);
        expect(t, kBytes, "Summary.value");
        e.values.push_back(detail::decode_value(s.bytes()));
      });
    } else if (number == 6) {  // SessionLog: status START
      expect(type, kBytes, "Event.session_log");
      detail::each_field(r.bytes(), [&e](uint32_t n, Type t, Reader& l) {
        if (n == 1 && t == kVarint) e.session_start = l.varint() == 1;
        else l.skip(t);
      });
    } else {
      r.skip(type);
    }
  });
  return e;
}

}  // namespace megaslide::io::events
