// umT5 (Wan's text encoder): the SentencePiece tokenizer's ids against transformers' T5Tokenizer (umT5's
// tokenizer class) on 116 prompts (VBench, punctuation, unicode, emoji, special tokens written in the text,
// a prompt cut at 512 tokens) with a tiny spiece.model trained offline, and on 3134 texts whose best
// segmentation is not unique (transformers' tie-break); the encoder's hidden states against
// transformers' UMT5EncoderModel on a tiny random model of non-default sizes in three layouts
// (transformers' single file, sharded with an index, ComfyUI's fp16 file with the tokenizer inside)
// (tests/fixtures/umt5*, tools/make_fixtures.py); bad files named in the errors; the real tokenizer when
// MEGASLIDE_UMT5_TOKENIZER points at one.
#include <torch/cuda.h>
#include <gtest/gtest.h>
#include <c10/util/Logging.h>  // FLAGS_caffe2_use_fatal_for_enforce
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/umt5_encoder.h"
#include "megaslide/model/umt5_tokenizer.h"

using megaslide::Umt5Encoder;
using megaslide::Umt5Tokenizer;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-umt5-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

struct Fixture {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

Fixture read_fixture(const std::string& path) {
  auto f = megaslide::io::read_safetensors(path);
  Fixture out;
  for (auto& [name, t] : f.tensors) out.tensors[name] = t;
  out.metadata = f.metadata;
  return out;
}

std::vector<std::string> json_strings(const std::string& text) {
  return nlohmann::json::parse(text).get<std::vector<std::string>>();
}

// The first prompt whose ids or mask differ, with both id lists (up to the first padding); empty when all agree.
std::string first_difference(const std::vector<std::string>& prompts, const megaslide::Umt5Tokens& ours,
                             const torch::Tensor& ids, const torch::Tensor& mask) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto n = static_cast<int64_t>(i);
    if (!torch::equal(ours.ids[n], ids[n].to(torch::kLong)) || !torch::equal(ours.mask[n], mask[n].to(torch::kLong))) {
      const int64_t len = std::max(ours.mask[n].sum().item<int64_t>(), mask[n].to(torch::kLong).sum().item<int64_t>());
      std::ostringstream s;
      s << "prompt " << i << " '" << prompts[i] << "'\n  ours:         " << ours.ids[n].slice(0, 0, len)
        << "\n  transformers: " << ids[n].slice(0, 0, len);
      return s.str();
    }
  }
  return "";
}

double max_error(const torch::Tensor& ours, const torch::Tensor& ref) {
  return (ours.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs().max().item<double>();
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

void copy_file(const std::string& from, const std::string& to) {
  megaslide::io::write_file_atomically(to, megaslide::io::read_file(from));
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Tokenizer
// ------------------------------------------------------------------------------------------------

TEST(Umt5Tokenizer, IdsAreTransformersOnTheTinyModel) {
  ASSERT_TRUE(megaslide::umt5_tokenizer_supported()) << "built without SentencePiece (libsentencepiece-dev)";
  auto tokenizer = Umt5Tokenizer::from_file(kFixtures + "umt5_tokenizer/spiece.model");
  EXPECT_EQ(tokenizer.piece(0), "<pad>");
  EXPECT_EQ(tokenizer.piece(1), "</s>");
  EXPECT_EQ(tokenizer.piece(2), "<unk>");
  auto f = read_fixture(kFixtures + "umt5_tokenizer/ids.safetensors");
  const auto prompts = json_strings(f.metadata.at("prompts"));
  ASSERT_GE(prompts.size(), 100u);
  const auto& ids = f.tensors.at("ids");
  ASSERT_EQ(ids.size(1), 512);
  // The fixture exercises what it is meant to: unknown characters, a prompt cut at 512, special tokens.
  EXPECT_GT(ids.eq(Umt5Tokenizer::kUnk).any(1).sum().item<int64_t>(), 10);
  EXPECT_GE(f.tensors.at("mask").to(torch::kLong).sum(1).eq(512).sum().item<int64_t>(), 1);
  auto ours = tokenizer.encode(prompts, 512);
  EXPECT_TRUE(torch::equal(ours.ids, ids.to(torch::kLong)) &&
              torch::equal(ours.mask, f.tensors.at("mask").to(torch::kLong)))
      << first_difference(prompts, ours, ids, f.tensors.at("mask"));
}

// How many of a flat-ids fixture's texts (its metadata "prompts"; ids[offsets[i]:offsets[i + 1]], as
// tools/make_fixtures.py writes umt5_ties and umt5_bytefallback/random) `tokenizer` gives other ids for
// than transformers; the first three are reported.
static int texts_with_other_ids(const Umt5Tokenizer& tokenizer, const std::string& fixture, size_t expected_texts) {
  auto f = read_fixture(fixture);
  const auto texts = json_strings(f.metadata.at("prompts"));
  const auto ids = f.tensors.at("ids").to(torch::kLong);
  const auto offsets = f.tensors.at("offsets").to(torch::kLong);
  EXPECT_EQ(texts.size(), expected_texts);
  EXPECT_EQ(offsets.numel(), static_cast<int64_t>(texts.size()) + 1);
  if (offsets.numel() != static_cast<int64_t>(texts.size()) + 1) return -1;
  int differ = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto n = static_cast<int64_t>(i);
    const auto theirs = ids.slice(0, offsets[n].item<int64_t>(), offsets[n + 1].item<int64_t>());
    const auto ours = torch::tensor(tokenizer.encode_text(texts[i]), torch::kLong);
    if (torch::equal(ours, theirs)) continue;
    if (++differ <= 3) ADD_FAILURE() << "'" << texts[i] << "': ours " << ours << " transformers " << theirs;
  }
  return differ;
}

// A SentencePiece model trained with byte fallback (as mT5's is) spells a character outside its
// vocabulary in byte pieces; transformers' T5Tokenizer, which WanPipeline runs, gives <unk> for it
// (consecutive ones one <unk>) and matches a written-out "<0x41>" as that piece. The fixture's 126
// prompts include emoji, rare scripts and written-out byte pieces; SentencePiece's own ids differ from
// transformers' on 55 of them.
TEST(Umt5Tokenizer, ByteFallbackModelGivesTransformersIds) {
  ASSERT_TRUE(megaslide::umt5_tokenizer_supported()) << "built without SentencePiece (libsentencepiece-dev)";
  auto tokenizer = Umt5Tokenizer::from_file(kFixtures + "umt5_bytefallback/spiece.model");
  ASSERT_EQ(tokenizer.vocab_size(), 613);
  ASSERT_EQ(tokenizer.piece(243), "<0xF0>");  // the model has byte pieces
  auto f = read_fixture(kFixtures + "umt5_bytefallback/ids.safetensors");
  const auto prompts = json_strings(f.metadata.at("prompts"));
  const auto& ids = f.tensors.at("ids");
  // The fixture holds what the test is about: characters outside the vocabulary (<unk> in transformers'
  // ids), and written-out "<0xHH>" text, which transformers matches as the byte pieces (ids 3..258).
  EXPECT_GT(ids.eq(Umt5Tokenizer::kUnk).any(1).sum().item<int64_t>(), 30);
  const auto bytes = ids.ge(3).logical_and(ids.le(258));
  EXPECT_GE(bytes.sum().item<int64_t>(), 4) << "the written-out <0xHH> prompts";
  auto ours = tokenizer.encode(prompts, 512);
  EXPECT_TRUE(torch::equal(ours.ids, ids.to(torch::kLong)) &&
              torch::equal(ours.mask, f.tensors.at("mask").to(torch::kLong)))
      << first_difference(prompts, ours, ids, f.tensors.at("mask"));
  // "a cat <cat emoji> chases": SentencePiece gives its four bytes, transformers one <unk>.
  const auto cat = tokenizer.encode_text("a cat \U0001F431 chases");
  EXPECT_EQ(std::count(cat.begin(), cat.end(), Umt5Tokenizer::kUnk), 1);
  EXPECT_EQ(std::count_if(cat.begin(), cat.end(), [](int64_t id) { return id >= 3 && id <= 258; }), 0);
}

// 600 random strings over what tells SentencePiece's segmentation and transformers' apart — pieces of
// the vocabulary, white space of every kind (tabs, U+3000, no-break spaces: words split there), literal
// "▁" (a word that starts with one gets no other), characters outside the vocabulary, written-out byte
// pieces, special tokens — tokenized by the byte-fallback model: transformers' ids, every one.
TEST(Umt5Tokenizer, RandomTextOfTheByteFallbackModelIsTransformers) {
  const auto tokenizer = Umt5Tokenizer::from_file(kFixtures + "umt5_bytefallback/spiece.model");
  EXPECT_EQ(texts_with_other_ids(tokenizer, kFixtures + "umt5_bytefallback/random.safetensors", 600), 0) << "of 600";
}

// SentencePiece runs in a module of its own (model/sentencepiece_module.h): with the tokenizer loaded and used,
// LibTorch's flags are as LibTorch set them, so a failed CAFFE_ENFORCE — here a CPU allocation of a petabyte —
// throws c10::Error (linked into the process, SentencePiece's absl flag had set
// FLAGS_caffe2_use_fatal_for_enforce and the allocation aborted the process). The library itself no longer
// needs libsentencepiece.
TEST(Umt5Tokenizer, SentencePieceLeavesLibTorchsFlagsAlone) {
  EXPECT_FALSE(FLAGS_caffe2_use_fatal_for_enforce) << "before any tokenizer";
  const auto tokenizer = Umt5Tokenizer::from_file(kFixtures + "umt5_tokenizer/spiece.model");
  EXPECT_GT(tokenizer.encode_text("a red fox in the snow").size(), 0u);
  EXPECT_FALSE(FLAGS_caffe2_use_fatal_for_enforce) << "after loading SentencePiece";
  EXPECT_THROW(torch::empty({int64_t{1} << 48}, torch::kFloat32), c10::Error);
  std::ifstream maps("/proc/self/maps");
  std::string line, libraries;
  while (std::getline(maps, line))
    if (line.find("libsentencepiece") != std::string::npos) libraries += line + "\n";
  EXPECT_NE(libraries.find("libsentencepiece"), std::string::npos) << "the module brought SentencePiece in";
}

// Where several segmentations have the same total score (pieces of one root — "a", "aa", "aaa" — in
// another order), the tie is broken as transformers breaks it (the tokenizers library's unigram search),
// not as SentencePiece's library does: Debian's 0.1.97 picks another order on 63 of these 3134 texts.
TEST(Umt5Tokenizer, TiesAreBrokenAsTransformersBreaksThem) {
  const auto tokenizer = Umt5Tokenizer::from_file(kFixtures + "umt5_tokenizer/spiece.model");
  EXPECT_EQ(texts_with_other_ids(tokenizer, kFixtures + "umt5_ties/ids.safetensors", 3134), 0) << "of 3134";
}

TEST(Umt5Tokenizer, EndTokenPaddingAndCutting) {
  auto tokenizer = Umt5Tokenizer::from_file(kFixtures + "umt5_tokenizer/spiece.model");
  auto t = tokenizer.encode({"", "a cat", std::string(2000, 'x') + " y"}, 16);
  // The empty prompt is </s> alone.
  EXPECT_EQ(t.ids[0][0].item<int64_t>(), Umt5Tokenizer::kEos);
  EXPECT_EQ(t.mask[0].sum().item<int64_t>(), 1);
  EXPECT_TRUE(t.ids[0].slice(0, 1).eq(Umt5Tokenizer::kPad).all().item<bool>());
  // Text, then </s>, then <pad> with mask 0.
  const auto text = tokenizer.encode_text("a cat");
  const auto n = static_cast<int64_t>(text.size());
  ASSERT_GE(n, 1);
  for (int64_t j = 0; j < n; ++j) EXPECT_EQ(t.ids[1][j].item<int64_t>(), text[static_cast<size_t>(j)]);
  EXPECT_EQ(t.ids[1][n].item<int64_t>(), Umt5Tokenizer::kEos);
  EXPECT_EQ(t.mask[1].sum().item<int64_t>(), n + 1);
  // Cut: 15 text tokens and </s> last.
  EXPECT_EQ(t.mask[2].sum().item<int64_t>(), 16);
  EXPECT_EQ(t.ids[2][15].item<int64_t>(), Umt5Tokenizer::kEos);
  // Special tokens written in the text are those tokens.
  EXPECT_EQ(tokenizer.encode_text("</s><pad><unk>"), (std::vector<int64_t>{1, 0, 2}));
}

TEST(Umt5Tokenizer, WanCleanIsPythonsWhitespaceClean) {
  auto f = read_fixture(kFixtures + "umt5_tokenizer/ids.safetensors");
  const auto prompts = json_strings(f.metadata.at("prompts"));
  const auto cleaned = json_strings(f.metadata.at("cleaned"));
  ASSERT_EQ(prompts.size(), cleaned.size());
  int changed = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(megaslide::wan_clean(prompts[i]), cleaned[i]) << "prompt " << i;
    changed += prompts[i] != cleaned[i];
  }
  EXPECT_GE(changed, 5);  // tabs, newlines, no-break and ideographic spaces, leading and trailing runs
}

TEST(Umt5Tokenizer, RealModelWhenGiven) {
  const char* path = std::getenv("MEGASLIDE_UMT5_TOKENIZER");
  if (path == nullptr)
    GTEST_SKIP() << "MEGASLIDE_UMT5_TOKENIZER is not set (umT5's spiece.model, or a folder holding it)";
  auto tokenizer = Umt5Tokenizer::find(path);
  EXPECT_GE(tokenizer.vocab_size(), 256000);
  EXPECT_LE(tokenizer.vocab_size(), 256384);
  // With transformers' ids for the same model (tools/make_fixtures.py --umt5-ids SPIECE OUT), all must agree.
  const char* ids_path = std::getenv("MEGASLIDE_UMT5_TOKENIZER_IDS");
  if (ids_path == nullptr) {
    std::cout
        << "[ info ] MEGASLIDE_UMT5_TOKENIZER_IDS is not set: only the special tokens and the size were checked\n";
    return;
  }
  auto f = read_fixture(ids_path);
  const auto prompts = json_strings(f.metadata.at("prompts"));
  auto ours = tokenizer.encode(prompts, f.tensors.at("ids").size(1));
  EXPECT_EQ(first_difference(prompts, ours, f.tensors.at("ids"), f.tensors.at("mask")), "");
}

TEST(Umt5Tokenizer, BadFilesAreNamed) {
  auto dir = temp_dir("badtok");
  EXPECT_NE(error_of([&] { Umt5Tokenizer::from_file(dir + "/none.model"); }).find(dir + "/none.model"),
            std::string::npos);
  megaslide::io::write_file_atomically(dir + "/garbage.model", "this is not a protobuf");
  const auto garbage = error_of([&] { Umt5Tokenizer::from_file(dir + "/garbage.model"); });
  EXPECT_NE(garbage.find(dir + "/garbage.model"), std::string::npos) << garbage;
  EXPECT_NE(garbage.find("not a SentencePiece model"), std::string::npos) << garbage;
  const auto empty = error_of([&] { Umt5Tokenizer::find(dir); });
  EXPECT_NE(empty.find("no SentencePiece model found"), std::string::npos) << empty;
  EXPECT_NE(empty.find(dir + "/spiece.model"), std::string::npos) << empty;
  megaslide::io::remove_tree(dir);
}

// ------------------------------------------------------------------------------------------------
// Encoder
// ------------------------------------------------------------------------------------------------

class Umt5EncoderGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = read_fixture(kFixtures + "umt5/reference.safetensors");
    ids_ = ref_.tensors.at("ids").to(torch::kLong);
    mask_ = ref_.tensors.at("mask").to(torch::kLong);
  }
  Fixture ref_;
  torch::Tensor ids_, mask_;
};

TEST_F(Umt5EncoderGolden, TransformersSingleFileWithinOneInTenThousand) {
  auto e = Umt5Encoder::load(kFixtures + "umt5/hf");
  EXPECT_EQ(e.config().d_model, 24);
  EXPECT_EQ(e.config().d_kv, 10);
  EXPECT_EQ(e.config().relative_attention_num_buckets, 12);
  EXPECT_EQ(e.config().relative_attention_max_distance, 20);
  EXPECT_LT(max_error(e.embed(ids_, mask_), ref_.tensors.at("hf.hidden")), 1e-4);
  EXPECT_LT(max_error(e.forward(ids_), ref_.tensors.at("hf.hidden_unmasked")), 1e-4);
  // The padding matters (the masked and unmasked outputs differ), and embed() zeroes past the prompt.
  EXPECT_GT(max_error(e.forward(ids_) * mask_.unsqueeze(-1), ref_.tensors.at("hf.hidden")), 1e-2);
  auto embedded = e.embed(ids_, mask_);
  EXPECT_TRUE(embedded.masked_select(mask_.eq(0).unsqueeze(-1).expand_as(embedded)).eq(0).all().item<bool>());
}

TEST_F(Umt5EncoderGolden, ShardedFolderAndDiffusersRoot) {
  for (const auto& path : {kFixtures + "umt5/sharded/text_encoder", kFixtures + "umt5/sharded",
                           kFixtures + "umt5/sharded/text_encoder/model.safetensors.index.json"}) {
    auto e = Umt5Encoder::load(path);
    EXPECT_NE(e.source().find("model.safetensors.index.json"), std::string::npos) << path;
    EXPECT_LT(max_error(e.embed(ids_, mask_), ref_.tensors.at("hf.hidden")), 1e-4) << path;
  }
  // The tokenizer from a checkpoint's text_encoder/ is ../tokenizer/spiece.model: the ids of the fixture;
  // found the same from the folder, its index file or one of its shards (what --weights may name).
  const auto prompts = json_strings(ref_.metadata.at("prompts"));
  for (const std::string weights : {"", "/model.safetensors.index.json", "/model-00001-of-00002.safetensors"}) {
    auto tokenizer = Umt5Tokenizer::find(kFixtures + "umt5/sharded/text_encoder" + weights);
    EXPECT_NE(tokenizer.source().find("text_encoder/../tokenizer/spiece.model"), std::string::npos)
        << weights << ": " << tokenizer.source();
    auto t = tokenizer.encode(prompts, ids_.size(1));
    EXPECT_TRUE(torch::equal(t.ids, ids_)) << weights;
    EXPECT_TRUE(torch::equal(t.mask, mask_)) << weights;
  }
}

TEST_F(Umt5EncoderGolden, ComfyUiSingleFileWithItsTokenizer) {
  const auto file = kFixtures + "umt5/comfy_umt5_fp16.safetensors";
  auto e = Umt5Encoder::load(file);
  EXPECT_EQ(e.config().num_layers, 3);
  EXPECT_EQ(e.config().num_heads, 3);
  EXPECT_EQ(e.config().d_ff, 40);
  EXPECT_EQ(e.config().relative_attention_max_distance, 128);
  EXPECT_LT(max_error(e.embed(ids_, mask_), ref_.tensors.at("comfy.hidden")), 1e-4);
  auto tokenizer = Umt5Tokenizer::find(file);
  EXPECT_NE(tokenizer.source().find("spiece_model"), std::string::npos);
  auto t = tokenizer.encode(json_strings(ref_.metadata.at("prompts")), ids_.size(1));
  EXPECT_TRUE(torch::equal(t.ids, ids_));
}

// The file of the memory mapping that holds `address` in this process (/proc/self/maps), or "" (anonymous memory).
std::string mapped_file_of(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const auto a = reinterpret_cast<uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    unsigned long long begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx", &begin, &end) != 2 || a < begin || a >= end) continue;
    const auto slash = line.find('/');
    return slash == std::string::npos ? "" : line.substr(slash);
  }
  return "";
}

// The property: weights stored in the dtype the encoder computes in (the fixture's F32 file, fp32 on the CPU)
// are read from the file's memory map, not copied — a layer matrix's data lie in a mapping of that very file,
// after load() has returned and its reader is gone — and give transformers' output; weights converted to
// another dtype (bf16) are the process's own memory.
TEST_F(Umt5EncoderGolden, WeightsInTheComputeDtypeAreTheFilesMemoryNotACopy) {
  const std::string matrix = "encoder.block.1.layer.1.DenseReluDense.wo.weight";
  auto e = Umt5Encoder::load(kFixtures + "umt5/hf");
  const auto file = mapped_file_of(e.stored_weight(matrix).data_ptr());
  EXPECT_NE(file.find("umt5/hf/model.safetensors"), std::string::npos) << "mapped from '" << file << "'";
  EXPECT_LT(max_error(e.embed(ids_, mask_), ref_.tensors.at("hf.hidden")), 1e-4);
  auto converted = Umt5Encoder::load(kFixtures + "umt5/hf", torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(mapped_file_of(converted.stored_weight(matrix).data_ptr()).find("model.safetensors"), std::string::npos);
}

TEST_F(Umt5EncoderGolden, Bf16WeightsStayClose) {
  auto e = Umt5Encoder::load(kFixtures + "umt5/hf", torch::kCPU, torch::kBFloat16);
  const auto ref = ref_.tensors.at("hf.hidden");
  const double err = max_error(e.embed(ids_, mask_), ref) / ref.abs().max().item<double>();
  EXPECT_LT(err, 0.25);  // the tiny model's large random weights amplify bf16 rounding; a broken cast gives O(1)
}

TEST_F(Umt5EncoderGolden, StreamedLayersEqualResidentBitForBit) {
  // The layers' matrices through the WeightStreamer (emulated async streams on the CPU, or in line) give
  // exactly the resident encoder's output, call after call, in fp32 and bf16.
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const auto resident = Umt5Encoder::load(kFixtures + "umt5/hf", torch::kCPU, dtype);
    const auto expected = resident.embed(ids_, mask_);
    for (bool async : {true, false}) {
      auto streamed =
          Umt5Encoder::streamed(Umt5Encoder::load(kFixtures + "umt5/hf", torch::kCPU, dtype), torch::kCPU, async);
      EXPECT_TRUE(streamed.is_streamed());
      EXPECT_EQ(streamed.parameter_count(), resident.parameter_count());
      EXPECT_EQ(streamed.weight_bytes(), resident.weight_bytes());
      EXPECT_TRUE(torch::equal(streamed.embed(ids_, mask_), expected)) << dtype << " async " << async;
      EXPECT_TRUE(torch::equal(streamed.embed(ids_, mask_), expected))
          << dtype << " async " << async << ", second call";
      EXPECT_TRUE(torch::equal(streamed.forward(ids_), resident.forward(ids_))) << dtype;
    }
  }
  // A failed call leaves the streamer usable.
  auto streamed = Umt5Encoder::streamed(Umt5Encoder::load(kFixtures + "umt5/hf"), torch::kCPU);
  EXPECT_ANY_THROW(streamed.forward(ids_, mask_.narrow(1, 0, 3)));
  EXPECT_LT(max_error(streamed.embed(ids_, mask_), ref_.tensors.at("hf.hidden")), 1e-4);
}

TEST_F(Umt5EncoderGolden, StreamedLayersOnTheGpu_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  // CUDA streams and pinned host layers: transformers' output within 1e-4, as the resident encoder; with fp8
  // weights, the CPU's fp8 encoder's output within 1e-5.
  auto streamed = Umt5Encoder::streamed(Umt5Encoder::load(kFixtures + "umt5/hf"), torch::kCUDA);
  auto resident = Umt5Encoder::load(kFixtures + "umt5/hf", torch::kCUDA);
  EXPECT_LT(max_error(streamed.embed(ids_, mask_).cpu(), ref_.tensors.at("hf.hidden")), 1e-4);
  EXPECT_LT(max_error(streamed.embed(ids_, mask_).cpu(), resident.embed(ids_, mask_).cpu()), 1e-5);
  // fp8 weights: the fp8 bytes uploaded and upcast in the slot on the GPU give the CPU's fp8 encoder's output.
  auto fp8 =
      Umt5Encoder::streamed(Umt5Encoder::load(kFixtures + "umt5/hf", torch::kCPU, torch::kFloat32, true), torch::kCUDA);
  const auto cpu = Umt5Encoder::load(kFixtures + "umt5/hf", torch::kCPU, torch::kFloat32, true);
  EXPECT_LT(max_error(fp8.embed(ids_, mask_).cpu(), cpu.embed(ids_, mask_)), 1e-5);
}

// The property: umT5 with fp8 weights (Umt5Encoder::load's fp8, model.text_encoder.dtype: fp8) keeps each layer
// matrix as float8_e4m3fn with one fp32 scale (its weights take the fp32 encoder's bytes less 3 B per matrix
// element, plus 4 B per scale, streamed as resident) and computes bit for bit what the fp32 encoder computes from
// a file holding those matrices' dequantized values: resident, and streamed (its host layers fp8, upcast in the
// slot). ComfyUI's scaled fp8 layout (F8_E4M3 matrices, <layer>.scale_weight, the scaled_fp8 marker) loads to the
// same output, in fp32 and kept in fp8.
TEST_F(Umt5EncoderGolden, Fp8WeightsComputeAsTheirDequantizedValues) {
  const std::string hf = kFixtures + "umt5/hf";
  const auto original = megaslide::io::read_safetensors(hf + "/model.safetensors");
  const auto dir = temp_dir("fp8");
  megaslide::io::NamedTensors dequantized, scaled;
  int64_t matrix_elements = 0, matrices = 0;
  for (const auto& [name, t] : original.tensors) {
    const bool matrix = (name.find(".SelfAttention.") != std::string::npos &&
                         name.find("relative_attention_bias") == std::string::npos) ||
                        name.find(".DenseReluDense.") != std::string::npos;
    if (!matrix) {
      dequantized.emplace_back(name, t);
      scaled.emplace_back(name, t);
      continue;
    }
    const auto q = megaslide::quantize_fp8(t.to(torch::kFloat32), megaslide::Fp8Scaling::kPerTensor);
    dequantized.emplace_back(name, megaslide::dequantize_fp8(q));
    scaled.emplace_back(name, q.data);
    scaled.emplace_back(name.substr(0, name.size() - 7) + ".scale_weight", q.scale);
    matrix_elements += t.numel();
    ++matrices;
  }
  EXPECT_EQ(matrices, 3 * 7) << "three gated layers: q, k, v, o, wi_0, wi_1, wo";
  scaled.emplace_back("scaled_fp8", torch::empty({0}, torch::kFloat8_e4m3fn));
  for (const auto& [folder, tensors] : {std::pair{std::string("dequantized"), dequantized}, {"scaled", scaled}}) {
    megaslide::io::make_directories(dir + "/" + folder);
    megaslide::io::write_file_atomically(dir + "/" + folder + "/config.json",
                                         megaslide::io::read_file(hf + "/config.json"));
    megaslide::io::write_safetensors(dir + "/" + folder + "/model.safetensors", tensors);
  }
  const auto reference = Umt5Encoder::load(dir + "/dequantized");
  const auto expected = reference.embed(ids_, mask_);
  std::cout << "fp8 weights against transformers' fp32 output: "
            << max_error(expected, ref_.tensors.at("hf.hidden")) /
                   ref_.tensors.at("hf.hidden").abs().max().item<double>()
            << " (relative to the largest value)\n";

  const auto fp8 = Umt5Encoder::load(hf, torch::kCPU, torch::kFloat32, /*fp8=*/true);
  EXPECT_TRUE(fp8.fp8());
  EXPECT_EQ(fp8.parameter_count(), reference.parameter_count());
  EXPECT_EQ(fp8.weight_bytes(), reference.weight_bytes() - 3 * matrix_elements + 4 * matrices);
  EXPECT_TRUE(torch::equal(fp8.embed(ids_, mask_), expected));
  for (const bool async : {true, false}) {
    const auto streamed =
        Umt5Encoder::streamed(Umt5Encoder::load(hf, torch::kCPU, torch::kFloat32, true), torch::kCPU, async);
    EXPECT_EQ(streamed.weight_bytes(), fp8.weight_bytes()) << "the host layers in fp8";
    EXPECT_TRUE(torch::equal(streamed.embed(ids_, mask_), expected)) << "async " << async;
    EXPECT_TRUE(torch::equal(streamed.embed(ids_, mask_), expected)) << "async " << async << ", second call";
  }
  EXPECT_TRUE(torch::equal(Umt5Encoder::load(dir + "/scaled").embed(ids_, mask_), expected)) << "scaled file, fp32";
  const auto kept = Umt5Encoder::load(dir + "/scaled", torch::kCPU, torch::kFloat32, true);
  EXPECT_EQ(kept.weight_bytes(), fp8.weight_bytes());
  EXPECT_TRUE(torch::equal(kept.embed(ids_, mask_), expected)) << "scaled file, kept in fp8";
  megaslide::io::remove_tree(dir);
}

TEST(Umt5Encoder, RandomXxlShapesAndParameterCount) {
  // umT5-XXL's published size: 5.68 B parameters in the encoder (embedding 1.05 B).
  const auto c = megaslide::Umt5Config::xxl();
  const int64_t per_layer = 4 * c.d_model * c.inner_dim() + c.relative_attention_num_buckets * c.num_heads +
                            2 * c.d_model + 3 * c.d_model * c.d_ff;
  EXPECT_NEAR(static_cast<double>(c.vocab_size * c.d_model + c.num_layers * per_layer + c.d_model) / 1e9, 5.68, 0.01);
  megaslide::Umt5Config small = c;
  small.vocab_size = 100, small.d_model = 16, small.d_kv = 4, small.num_heads = 2, small.d_ff = 8, small.num_layers = 2;
  auto e = Umt5Encoder::random(small, 3);
  auto ids = torch::randint(0, 100, {2, 7}, torch::kLong);
  auto out = e.forward(ids, torch::ones({2, 7}, torch::kLong));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 7, 16}));
  EXPECT_TRUE(out.isfinite().all().item<bool>());
}

TEST(Umt5Encoder, BadInputIsNamed) {
  auto dir = temp_dir("bad");
  const auto hf = kFixtures + "umt5/hf";
  auto fresh = [&](const std::string& name) {
    auto d = dir + "/" + name;
    megaslide::io::make_directories(d);
    copy_file(hf + "/config.json", d + "/config.json");
    copy_file(hf + "/model.safetensors", d + "/model.safetensors");
    return d;
  };
  auto config_with = [&](const std::string& d, const std::string& key, const nlohmann::json& value) {
    auto j = nlohmann::json::parse(megaslide::io::read_file(d + "/config.json"));
    if (value.is_null()) j.erase(key);
    else j[key] = value;
    megaslide::io::write_file_atomically(d + "/config.json", j.dump());
  };
  auto expect = [&](const std::string& path, const std::string& needle) {
    const auto what = error_of([&] { Umt5Encoder::load(path); });
    EXPECT_NE(what.find(needle), std::string::npos) << "expected '" << needle << "' in: " << what;
  };
  expect(dir + "/nowhere", dir + "/nowhere");
  // config.json disagreeing with the weights.
  auto d = fresh("dmodel");
  config_with(d, "d_model", 32);
  expect(d, "tensor 'shared.weight' has shape [332, 24], expected [332, 32]");
  d = fresh("layers");
  config_with(d, "num_layers", 2);
  expect(d, "more than the 2 layers");
  d = fresh("layers4");
  config_with(d, "num_layers", 4);
  expect(d, "no tensor 'encoder.block.3.layer.0.SelfAttention.q.weight'");
  d = fresh("type");
  config_with(d, "model_type", "t5");
  expect(d, "is not umT5");
  d = fresh("act");
  config_with(d, "feed_forward_proj", "gated-swish");
  expect(d, "\"gated-swish\" is not supported");
  d = fresh("json");
  megaslide::io::write_file_atomically(d + "/config.json", "{ not json");
  expect(d, d + "/config.json' is not valid JSON");
  d = fresh("noconfig");
  megaslide::io::remove_tree(d + "/config.json");
  expect(d, "no config.json");
  // A tensor of the wrong dtype.
  d = fresh("dtype");
  {
    auto file = megaslide::io::read_safetensors(hf + "/model.safetensors");
    for (auto& [name, t] : file.tensors)
      if (name == "encoder.final_layer_norm.weight") t = t.to(torch::kInt32);
    megaslide::io::write_safetensors(d + "/model.safetensors", file.tensors);
  }
  expect(d, "tensor 'encoder.final_layer_norm.weight' is I32, expected floating point");
  // A sharded folder whose index names a missing shard.
  d = dir + "/shards";
  megaslide::io::make_directories(d);
  const auto sharded = kFixtures + "umt5/sharded/text_encoder";
  copy_file(sharded + "/config.json", d + "/config.json");
  copy_file(sharded + "/model.safetensors.index.json", d + "/model.safetensors.index.json");
  copy_file(sharded + "/model-00001-of-00002.safetensors", d + "/model-00001-of-00002.safetensors");
  expect(d, "shard '" + d + "/model-00002-of-00002.safetensors'");
  // A T5 (not umT5) single file: one relative-attention bias in the first layer only.
  {
    auto file = megaslide::io::read_safetensors(kFixtures + "umt5/comfy_umt5_fp16.safetensors");
    megaslide::io::NamedTensors kept;
    for (auto& [name, t] : file.tensors)
      if (name.find("relative_attention_bias") == std::string::npos || name.find("block.0.") != std::string::npos)
        kept.emplace_back(name, t);
    megaslide::io::write_safetensors(dir + "/t5.safetensors", kept);
  }
  expect(dir + "/t5.safetensors", "a T5 encoder, not umT5");
  megaslide::io::write_file_atomically(dir + "/junk.safetensors", "junk");
  expect(dir + "/junk.safetensors", dir + "/junk.safetensors");
  megaslide::io::remove_tree(dir);
}
