// safetensors: the byte layout is the format's (checked against hand-built bytes), every dtype round
// trips bit for bit (fp8 included), a file the Python package wrote with fp8 tensors reads back bit for bit,
// every kind of corrupt file is refused with the file and the tensor named, and a range reader serves
// element ranges of any tensor.
#include "megaslide/io/safetensors.h"
#include "megaslide/io/safetensors_ranges.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>

using megaslide::io::NamedTensors;
using megaslide::io::SafetensorsError;

namespace {

std::string temp_path(const std::string& name) {
  return "/tmp/megaslide-test-st-" + std::to_string(::getpid()) + "-" + name;
}

std::string le64(uint64_t n) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return s;
}

// A file from a header text and data bytes, built by hand (not by the writer under test).
std::string write_raw(const std::string& name, const std::string& header, const std::string& data) {
  auto path = temp_path(name);
  megaslide::io::write_file_atomically(path, le64(header.size()) + header + data);
  return path;
}

// Expects reading `path` to throw a SafetensorsError whose message names the file and contains `needle`.
void expect_refused(const std::string& path, const std::string& needle) {
  try {
    megaslide::io::read_safetensors(path);
    ADD_FAILURE() << "read_safetensors accepted " << path;
  } catch (const SafetensorsError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
  }
}

}  // namespace

TEST(Safetensors, ByteLayoutIsTheFormats) {
  // One F32 tensor [2] = {1, -2}: 8-byte little-endian header length, the JSON header padded with spaces
  // to a multiple of 8, then the IEEE-754 little-endian bytes 00 00 80 3f and 00 00 00 c0.
  auto bytes = megaslide::io::encode_safetensors({{"w", torch::tensor({1.0f, -2.0f})}});
  const std::string json = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const size_t padded = (json.size() + 7) / 8 * 8;
  ASSERT_EQ(bytes.size(), 8 + padded + 8);
  EXPECT_EQ(bytes.substr(0, 8), le64(padded));
  EXPECT_EQ(bytes.substr(8, json.size()), json);
  EXPECT_EQ(bytes.substr(8 + json.size(), padded - json.size()), std::string(padded - json.size(), ' '));
  const unsigned char data[8] = {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0};
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + padded, data, 8), 0);
}

TEST(Safetensors, EveryDtypeRoundTripsBitForBit) {
  torch::manual_seed(11);
  NamedTensors tensors{
      {"f64", torch::randn({3, 5}, torch::kFloat64)},
      {"f32", torch::randn({7}, torch::kFloat32)},
      {"f16", torch::randn({2, 3, 4}, torch::kFloat16)},
      {"bf16", torch::randn({5, 1}, torch::kBFloat16)},
      {"i64", torch::randint(-1000000, 1000000, {4}, torch::kInt64)},
      {"i32", torch::randint(-1000, 1000, {3}, torch::kInt32)},
      {"u8", torch::randint(0, 256, {6}, torch::kUInt8)},
      {"bool", torch::randint(0, 2, {5}, torch::kInt64).to(torch::kBool)},
      // Every bit pattern of the fp8 dtypes, NaNs included (io/fp8.h).
      {"f8_e4m3", torch::arange(256, torch::kInt32).to(torch::kUInt8).view({16, 16}).view(torch::kFloat8_e4m3fn)},
      {"f8_e5m2", torch::arange(256, torch::kInt32).to(torch::kUInt8).flip(0).view(torch::kFloat8_e5m2)},
      {"scalar", torch::tensor(3.5, torch::kFloat32)},
      {"empty", torch::empty({0, 3}, torch::kFloat32)},
      {"strided", torch::randn({4, 6}).t()},  // non-contiguous input
  };
  auto path = temp_path("roundtrip.safetensors");
  megaslide::io::write_safetensors(path, tensors, {{"note", "hello"}, {"config", "model:\n  hidden: 16\n"}});
  auto file = megaslide::io::read_safetensors(path);
  EXPECT_EQ(file.metadata.at("note"), "hello");
  EXPECT_EQ(file.metadata.at("config"), "model:\n  hidden: 16\n");
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, expected] = tensors[i];
    EXPECT_EQ(file.tensors[i].first, name);  // written back to back in order, read in offset order
    const auto& got = file.tensors[i].second;
    EXPECT_EQ(got.scalar_type(), expected.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), expected.sizes()) << name;
    const bool fp8 = got.scalar_type() == torch::kFloat8_e4m3fn || got.scalar_type() == torch::kFloat8_e5m2;
    EXPECT_TRUE(fp8 ? torch::equal(got.view(torch::kUInt8), expected.view(torch::kUInt8)) : torch::equal(got, expected))
        << name;  // (fp8 has no equal kernel: the bytes)
  }
  auto header = megaslide::io::read_safetensors_header(path);
  EXPECT_EQ(header.entries.size(), tensors.size());
  for (const auto& e : header.entries) {
    if (e.name == "f8_e4m3") EXPECT_EQ(megaslide::io::safetensors_dtype_name(e.dtype), "F8_E4M3");
    if (e.name == "f8_e5m2") EXPECT_EQ(megaslide::io::safetensors_dtype_name(e.dtype), "F8_E5M2");
  }
  EXPECT_EQ(header.data_start % 8, 0u);
  megaslide::io::remove_tree(path);
}

TEST(Safetensors, ReadsAHandBuiltFileWithEntriesOutOfOrder) {
  // Header order differs from data order, and metadata comes last: both are allowed by the format.
  std::string data = le64(42) + std::string("\x01\x00\x02\x00", 4);  // I64 [1] = 42, then I16 [2] = {1, 2}
  auto path = write_raw(
      "handbuilt.safetensors",
      R"({"b":{"dtype":"I16","shape":[2],"data_offsets":[8,12]},"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"__metadata__":{"k":"v"}})",
      data);
  auto file = megaslide::io::read_safetensors(path);
  ASSERT_EQ(file.tensors.size(), 2u);
  EXPECT_EQ(file.tensors[0].first, "a");
  EXPECT_EQ(file.tensors[0].second.item<int64_t>(), 42);
  EXPECT_EQ(file.tensors[1].first, "b");
  EXPECT_TRUE(torch::equal(file.tensors[1].second, torch::tensor({1, 2}, torch::kInt16)));
  EXPECT_EQ(file.metadata.at("k"), "v");
}

TEST(Safetensors, RefusesCorruptFilesNamingFileAndTensor) {
  const std::string f32x2 = std::string(8, '\0');
  expect_refused(temp_path("missing-file"), "cannot open");
  {
    auto path = temp_path("tiny");
    megaslide::io::write_file_atomically(path, "abc");
    expect_refused(path, "shorter than the 8-byte header length");
  }
  {
    auto path = temp_path("huge-header");
    megaslide::io::write_file_atomically(path, le64(1000) + "{}");
    expect_refused(
        path, "not a safetensors file (or a truncated one): its first 8 bytes, read as the header length, say 1000");
  }
  expect_refused(write_raw("badjson", R"({"w": {"dtype": "F32",)", f32x2), "not valid JSON");
  expect_refused(write_raw("notobject", "[1, 2]", ""),
                 "not a safetensors file: the header after the 8-byte length does not begin with");
  expect_refused(write_raw("dtype", R"({"w":{"dtype":"F8_E8M0","shape":[8],"data_offsets":[0,8]}})", f32x2),
                 "tensor 'w': unsupported dtype 'F8_E8M0' (supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL F8_E4M3 "
                 "F8_E5M2)");
  expect_refused(write_raw("range", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", f32x2),
                 "reach past the data section");
  expect_refused(write_raw("count", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f32x2),
                 "needs 12 bytes");
  expect_refused(write_raw("backwards", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", f32x2),
                 "run backwards");
  expect_refused(write_raw("negative", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2),
                 "not a non-negative integer");
  expect_refused(
      write_raw(
          "overlap",
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          f32x2),
      "overlap");
  expect_refused(write_raw("missingkey", R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", f32x2),
                 "tensor 'w': missing array 'shape'");
  expect_refused(write_raw("meta", R"({"__metadata__":{"k":3}})", ""), "__metadata__ value of 'k'");
  expect_refused(write_raw("bool", R"({"m":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x07"),
                 "bytes other than 0 and 1");
  {
    // A valid file cut short: the last tensor's bytes are missing.
    auto bytes = megaslide::io::encode_safetensors({{"a", torch::ones({4})}, {"b", torch::ones({4})}});
    auto path = temp_path("truncated");
    megaslide::io::write_file_atomically(path, bytes.substr(0, bytes.size() - 3));
    expect_refused(path, "tensor 'b'");
  }
}

// The property: a file the safetensors package wrote (tests/fixtures/fp8/, tools/make_fixtures.py fp8:
// safetensors.torch.save_file, which orders tensors by alignment and name) reads back bit for bit — its
// F8_E4M3 and F8_E5M2 tensors as float8_e4m3fn and float8_e5m2 holding the bit patterns stored beside them
// as U8, the empty fp8 marker and the 0-dim scale ComfyUI's fp8_scaled files carry — whole, into targets
// and by ranges.
TEST(Safetensors, ReadsFp8FromThePythonPackageBitForBit) {
  const std::string path = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/fp8/safetensors_package.safetensors";
  std::map<std::string, torch::Tensor> t;
  for (auto& [name, tensor] : megaslide::io::read_safetensors(path).tensors) t[name] = tensor;
  ASSERT_EQ(t.size(), 7u);
  ASSERT_EQ(t.at("e4m3fn").scalar_type(), torch::kFloat8_e4m3fn);
  ASSERT_EQ(t.at("e5m2").scalar_type(), torch::kFloat8_e5m2);
  EXPECT_EQ(t.at("e4m3fn").sizes(), (std::vector<int64_t>{4, 64}));
  EXPECT_TRUE(torch::equal(t.at("e4m3fn").view(torch::kUInt8), t.at("e4m3fn.bits")));
  EXPECT_TRUE(torch::equal(t.at("e5m2").view(torch::kUInt8), t.at("e5m2.bits")));
  EXPECT_TRUE(torch::equal(t.at("e4m3fn.bits").reshape({-1}), torch::arange(256, torch::kInt32).to(torch::kUInt8)));
  EXPECT_EQ(t.at("scaled_fp8").scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_EQ(t.at("scaled_fp8").sizes(), (std::vector<int64_t>{0}));
  EXPECT_EQ(t.at("scale_weight").dim(), 0);
  EXPECT_EQ(t.at("scale_weight").item<float>(), 0.0123f);
  EXPECT_EQ(t.at("bf16").scalar_type(), torch::kBFloat16);
  // Values: e4m3fn 0x38 is 1.0, 0x7e 448, 0xfe -448; e5m2 0x7b is 57344, 0x7c +inf.
  const auto e4m3fn = t.at("e4m3fn").reshape({-1}).to(torch::kFloat32);
  EXPECT_EQ(e4m3fn[0x38].item<float>(), 1.0f);
  EXPECT_EQ(e4m3fn[0x7e].item<float>(), 448.0f);
  EXPECT_EQ(e4m3fn[0xfe].item<float>(), -448.0f);
  EXPECT_TRUE(std::isnan(e4m3fn[0x7f].item<float>()));
  const auto e5m2 = t.at("e5m2").to(torch::kFloat32);  // stored 255 down to 0
  EXPECT_EQ(e5m2[255 - 0x7b].item<float>(), 57344.0f);
  EXPECT_TRUE(std::isinf(e5m2[255 - 0x7c].item<float>()));

  auto into = torch::empty({4, 64}, torch::kFloat8_e4m3fn);
  megaslide::io::read_safetensors_into(path, {{"e4m3fn", into}}, /*allow_extra=*/true);
  EXPECT_TRUE(torch::equal(into.view(torch::kUInt8), t.at("e4m3fn.bits")));
  auto range = torch::empty({10}, torch::kFloat8_e5m2);
  megaslide::io::read_safetensors_range_into(path, "e5m2", 100, range);
  EXPECT_TRUE(torch::equal(range.view(torch::kUInt8), t.at("e5m2.bits").slice(0, 100, 110)));
}

TEST(Safetensors, WriterRefusesDuplicateNames) {
  EXPECT_THROW(megaslide::io::encode_safetensors({{"a", torch::ones({1})}, {"a", torch::ones({1})}}), c10::Error);
  EXPECT_THROW(megaslide::io::encode_safetensors({{"__metadata__", torch::ones({1})}}), c10::Error);
}

// A range reader parses the header once and serves any range of any tensor of the file: each range equals
// the same elements of the tensor read whole; ranges outside a tensor, a missing tensor or another dtype are
// refused naming the file and the tensor; the reader keeps working after a refused read.
TEST(Safetensors, RangeReaderReadsAnyRangeOfAnyTensor) {
  torch::manual_seed(5);
  const NamedTensors tensors{{"a", torch::randn({7, 5})},
                             {"b", torch::arange(0, 100, torch::kLong)},
                             {"c", torch::randn({3}).to(torch::kBFloat16)}};
  const auto path = temp_path("ranges.safetensors");
  megaslide::io::write_safetensors(path, tensors);
  megaslide::io::SafetensorsRangeReaders files;
  const auto& reader = files(path);
  EXPECT_EQ(&reader, &files(path)) << "one reader per file";
  for (const auto& [name, whole] : tensors) {
    const auto flat = whole.reshape({-1});
    for (int64_t begin = 0; begin <= flat.numel(); begin += 3)
      for (int64_t end = begin; end <= flat.numel(); end += 4) {
        auto target = torch::empty({end - begin}, flat.options());
        reader.read_into(name, begin, target);
        EXPECT_TRUE(torch::equal(target, flat.slice(0, begin, end))) << name << " [" << begin << ", " << end << ")";
      }
  }
  auto refused = [&](auto&& read, const std::string& needle) {
    try {
      read();
      ADD_FAILURE() << "accepted; expected '" << needle << "'";
    } catch (const SafetensorsError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  refused([&] { reader.read_into("a", 30, torch::empty({6})); }, "elements [30, 36) were asked for");
  refused([&] { reader.read_into("a", -1, torch::empty({1})); }, "'a'");
  refused([&] { reader.read_into("z", 0, torch::empty({1})); }, "'z': missing");
  refused([&] { reader.read_into("b", 0, torch::empty({1})); }, "dtype is I64, expected F32");
  auto target = torch::empty({2});
  reader.read_into("a", 33, target);
  EXPECT_TRUE(torch::equal(target, tensors[0].second.reshape({-1}).slice(0, 33, 35)));
  refused([&] { megaslide::io::SafetensorsRangeReader(path + ".missing"); }, "cannot open");
  std::remove(path.c_str());
}
