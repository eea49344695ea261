// The TensorBoard event encoding (src/io/event_encoding.h) against Debian's protobuf library, on the
// messages of src/io/tensorboard_event.proto (TensorFlow's field numbers): for random events of every kind
// the encoder's bytes are those the protoc-generated classes serialise (protobuf writes fields in number
// order and leaves proto3 defaults out, as the encoder does), protobuf parses them back to the same
// fields, and the decoder reads what protobuf writes. A program of its own, without libmegaslide.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "io/event_encoding.h"
#include "tensorboard_event.pb.h"

namespace events = megaslide::io::events;
namespace tb = megaslide::tensorboard;

namespace {

// Tags are proto3 `string`s, which protobuf requires to be UTF-8: printable ASCII with a few multi-byte
// characters; images and texts travel as `bytes` and may hold anything.
std::string random_tag(std::mt19937_64& rng, size_t max_length) {
  static const char* const pieces[] = {
      "a", "Z", "/", "_", "0", " ", ".", "\xc3\xa9", "\xe6\x97\xa5", "\xf0\x9f\x90\xb1"};
  std::uniform_int_distribution<size_t> length(0, max_length), pick(0, 9);
  std::string s;
  for (size_t n = length(rng); n > 0; --n) s += pieces[pick(rng)];
  return s;
}

std::string random_text(std::mt19937_64& rng, size_t max_length) {
  std::uniform_int_distribution<size_t> length(0, max_length);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(length(rng), '\0');
  for (auto& c : s) c = static_cast<char>(byte(rng));
  return s;
}

// The same event built with protobuf's classes.
tb::Event with_protobuf(const events::Event& e) {
  tb::Event p;
  p.set_wall_time(e.wall_time);
  p.set_step(e.step);
  if (!e.file_version.empty()) {
    p.set_file_version(e.file_version);
    return p;
  }
  if (e.session_start) {
    p.mutable_session_log()->set_status(tb::SessionLog::START);
    return p;
  }
  auto* summary = p.mutable_summary();
  for (const auto& v : e.values) {
    auto* value = summary->add_value();
    value->set_tag(v.tag);
    if (v.kind == events::Value::Kind::kScalar) {
      value->set_simple_value(v.scalar);
    } else if (v.kind == events::Value::Kind::kImage) {
      auto* image = value->mutable_image();
      image->set_height(static_cast<int32_t>(v.height));
      image->set_width(static_cast<int32_t>(v.width));
      image->set_colorspace(3);
      image->set_encoded_image_string(v.data);
    } else {
      auto* tensor = value->mutable_tensor();
      tensor->set_dtype(7);
      tensor->mutable_tensor_shape()->add_dim()->set_size(1);
      tensor->add_string_val(v.data);
      value->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
    }
  }
  return p;
}

events::Event random_event(std::mt19937_64& rng, int kind) {
  events::Event e;
  e.wall_time = std::uniform_real_distribution<double>(0, 2e9)(rng);
  e.step = static_cast<int64_t>(rng() % (int64_t{1} << 40));
  if (kind == 0) e.file_version = "brain.Event:2";
  if (kind == 1) e.session_start = true;
  if (kind >= 2) {
    const int n = kind == 2 ? 1 + static_cast<int>(rng() % 16) : 1;
    for (int i = 0; i < n; ++i) {
      events::Value v;
      v.tag = random_tag(rng, 40);
      if (kind == 2) {
        v.kind = events::Value::Kind::kScalar;
        v.scalar = std::uniform_real_distribution<float>(-1e6f, 1e6f)(rng);
      } else if (kind == 3) {
        v.kind = events::Value::Kind::kImage;
        v.height = 1 + static_cast<int64_t>(rng() % 4096);
        v.width = 1 + static_cast<int64_t>(rng() % 4096);
        v.data = random_text(rng, 5000);
      } else {
        v.kind = events::Value::Kind::kText;
        v.data = random_text(rng, 3000);
      }
      e.values.push_back(std::move(v));
    }
  }
  return e;
}

}  // namespace

TEST(EventEncoding, BytesAreProtobufsAndReadBackBothWays) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 400; ++i) {
    const auto e = random_event(rng, i % 5);
    const std::string ours = events::encode(e);
    const tb::Event theirs = with_protobuf(e);
    ASSERT_EQ(ours, theirs.SerializeAsString()) << "event " << i << " (kind " << i % 5 << ")";
    tb::Event parsed;
    ASSERT_TRUE(parsed.ParseFromString(ours)) << "event " << i;
    EXPECT_EQ(parsed.wall_time(), e.wall_time);
    EXPECT_EQ(parsed.step(), e.step);
    const auto back = events::decode(theirs.SerializeAsString());
    EXPECT_EQ(back.wall_time, e.wall_time);
    EXPECT_EQ(back.step, e.step);
    EXPECT_EQ(back.file_version, e.file_version);
    EXPECT_EQ(back.session_start, e.session_start);
    ASSERT_EQ(back.values.size(), e.values.size());
    for (size_t k = 0; k < e.values.size(); ++k) {
      EXPECT_EQ(back.values[k].tag, e.values[k].tag);
      EXPECT_EQ(back.values[k].kind, e.values[k].kind);
      EXPECT_EQ(back.values[k].scalar, e.values[k].scalar);
      EXPECT_EQ(back.values[k].data, e.values[k].data);
      EXPECT_EQ(back.values[k].height, e.values[k].height);
      EXPECT_EQ(back.values[k].width, e.values[k].width);
      EXPECT_EQ(parsed.summary().value(static_cast<int>(k)).tag(), e.values[k].tag);
    }
  }
}

// Values at the edges of their encodings: step 0 and 2^63 − 1, NaN and infinite scalars, empty strings.
TEST(EventEncoding, EdgeValuesAreProtobufs) {
  events::Event e;
  e.step = std::numeric_limits<int64_t>::max();
  e.wall_time = 0;
  for (const float x : {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()}) {
    events::Value v;
    v.kind = events::Value::Kind::kScalar;
    v.scalar = x;
    e.values.push_back(v);
  }
  EXPECT_EQ(events::encode(e), with_protobuf(e).SerializeAsString());
  e.step = 0;
  EXPECT_EQ(events::encode(e), with_protobuf(e).SerializeAsString());
  const auto back = events::decode(events::encode(e));
  ASSERT_EQ(back.values.size(), 6u);
  EXPECT_TRUE(std::isnan(back.values[4].scalar));
  EXPECT_TRUE(std::signbit(back.values[1].scalar));
}

// A damaged message is an error, never a crash: every truncation of an encoded event.
TEST(EventEncoding, TruncatedMessagesAreErrors) {
  std::mt19937_64 rng(5);
  const std::string data = events::encode(random_event(rng, 3));
  int refused = 0;
  for (size_t n = 0; n < data.size(); ++n) {
    try {
      events::decode(data.substr(0, n));
    } catch (const std::runtime_error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, static_cast<int>(data.size()) / 2);
}
