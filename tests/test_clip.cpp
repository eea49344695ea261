// CLIP: the tokenizer's ids against transformers' CLIPTokenizer on 105 prompts (every VBench dimension,
// punctuation, numbers, contractions, unicode, emoji, long and empty prompts) with the real vocabulary and a
// tiny one in transformers' file format; the text encoder's outputs against transformers' CLIPTextModel on
// tiny random models in the published layouts (tests/fixtures/clip*, tools/make_fixtures.py); bad folders
// and files named in the errors; real downloads when MEGASLIDE_CLIP_WEIGHTS points at one.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"
#include "megaslide/io/safetensors.h"
#include "clip_fp8_copy.h"
#include "megaslide/model/clip_text_encoder.h"
#include "megaslide/model/clip_tokenizer.h"

using megaslide::ClipTextEncoder;
using megaslide::ClipTokenizer;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-clip-" + std::to_string(::getpid()) + "-" + name;
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

// OpenAI's merges file as tools/bootstrap.sh fetches it (.deps/clip/), or MEGASLIDE_CLIP_BPE.
std::string openai_bpe_path() {
  if (const char* env = std::getenv("MEGASLIDE_CLIP_BPE")) return env;
  return std::string(MEGASLIDE_SOURCE_DIR) + "/.deps/clip/bpe_simple_vocab_16e6.txt";
}

// The first prompt whose ids or mask differ, with both id lists; empty when all agree.
std::string first_difference(const std::vector<std::string>& prompts, const megaslide::ClipTokens& ours,
                             const torch::Tensor& ids, const torch::Tensor& mask) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto n = static_cast<int64_t>(i);
    if (!torch::equal(ours.ids[n], ids[n]) || !torch::equal(ours.mask[n], mask[n])) {
      std::ostringstream s;
      s << "prompt " << i << " '" << prompts[i] << "'\n  ours:         " << ours.ids[n]
        << "\n  transformers: " << ids[n];
      return s.str();
    }
  }
  return "";
}

}  // namespace

TEST(ClipTokenizer, IdsAreTransformersWithTheRealVocabulary) {
  const auto path = openai_bpe_path();
  ASSERT_TRUE(megaslide::io::path_exists(path))
      << path << " is missing: tools/bootstrap.sh fetches CLIP's vocabulary there "
      << "(or set MEGASLIDE_CLIP_BPE)";
  auto tokenizer = ClipTokenizer::from_openai_bpe(path);
  EXPECT_EQ(tokenizer.vocab_size(), 49408);
  EXPECT_EQ(tokenizer.start_id(), 49406);
  EXPECT_EQ(tokenizer.end_id(), 49407);
  auto f = read_fixture(kFixtures + "clip_tokenizer/ids.safetensors");
  const auto prompts = nlohmann::json::parse(f.metadata.at("prompts")).get<std::vector<std::string>>();
  ASSERT_GE(prompts.size(), 100u);
  auto ours = tokenizer.encode(prompts, 77);
  EXPECT_EQ(first_difference(prompts, ours, f.tensors.at("ids"), f.tensors.at("mask")), "");
  // Hand-checked landmarks: "a" is 320, "photo" 1125 (with </w>), the empty prompt is start, end, padding.
  EXPECT_EQ(tokenizer.encode_text("a photo"), (std::vector<int64_t>{320, 1125}));
  auto empty = tokenizer.encode({""}, 77);
  EXPECT_EQ(empty.ids[0][0].item<int64_t>(), 49406);
  EXPECT_EQ(empty.ids[0][1].item<int64_t>(), 49407);
  EXPECT_EQ(empty.mask[0].sum().item<int64_t>(), 2);
}

TEST(ClipTokenizer, TransformersFilesOfATinyVocabulary) {
  // vocab.json + merges.txt as transformers writes them, with only 120 merges: most words stay in pieces.
  auto tokenizer = ClipTokenizer::from_folder(kFixtures + "clip_tokenizer/tiny");
  EXPECT_EQ(tokenizer.vocab_size(), 512 + 120 + 2);
  auto f = read_fixture(kFixtures + "clip_tokenizer/ids.safetensors");
  const auto prompts = nlohmann::json::parse(f.metadata.at("prompts")).get<std::vector<std::string>>();
  EXPECT_EQ(
      first_difference(prompts, tokenizer.encode(prompts, 77), f.tensors.at("tiny.ids"), f.tensors.at("tiny.mask")),
      "");
}

TEST(ClipTokenizer, CutsAndPadsToTheLengthAsked) {
  auto tokenizer = ClipTokenizer::from_folder(kFixtures + "clip_tokenizer/tiny");
  auto t = tokenizer.encode({"a b c d e f", "a"}, 5);
  ASSERT_EQ(t.ids.sizes(), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(t.ids[0][0].item<int64_t>(), tokenizer.start_id());
  EXPECT_EQ(t.ids[0][4].item<int64_t>(), tokenizer.end_id());  // cut: the end token kept
  EXPECT_EQ(t.mask[0].sum().item<int64_t>(), 5);
  EXPECT_EQ(t.mask[1].sum().item<int64_t>(), 3);
  EXPECT_THROW(tokenizer.encode({"a"}, 1), c10::Error);
}

TEST(ClipTokenizer, BadVocabulariesAreNamed) {
  auto dir = temp_dir("vocab");
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error (expected one mentioning '" << needle << "')";
    } catch (const megaslide::ClipTokenizerError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { ClipTokenizer::from_folder(dir); }, "holds no CLIP vocabulary");
  megaslide::io::write_file_atomically(dir + "/vocab.json", "{not json");
  megaslide::io::write_file_atomically(dir + "/merges.txt", "#version: 0.2\n");
  expect_error([&] { ClipTokenizer::from_folder(dir); }, dir + "/vocab.json");
  // A merge whose result is not in the vocabulary.
  const auto tiny = megaslide::io::read_file(kFixtures + "clip_tokenizer/tiny/vocab.json");
  megaslide::io::write_file_atomically(dir + "/vocab.json", tiny);
  megaslide::io::write_file_atomically(dir + "/merges.txt", "#version: 0.2\nq z</w>\n");
  expect_error([&] { ClipTokenizer::from_folder(dir); }, "not in the vocabulary");
  megaslide::io::write_file_atomically(dir + "/merges.txt", "#version: 0.2\nonlyonefield\n");
  expect_error([&] { ClipTokenizer::from_folder(dir); }, "line 2");
  megaslide::io::remove_tree(dir);
}

namespace {
// |ours − reference| ≤ 1e-4 · max(1, max |reference|) (fp32).
void expect_close(const torch::Tensor& ours, const torch::Tensor& reference, const std::string& what) {
  ASSERT_EQ(ours.sizes(), reference.sizes()) << what;
  const double scale = std::max(1.0, reference.abs().max().item<double>());
  const double error = (ours.to(torch::kFloat64) - reference.to(torch::kFloat64)).abs().max().item<double>() / scale;
  std::cout << what << ": largest difference " << error << " of the output's scale " << scale << "\n";
  EXPECT_LT(error, 1e-4) << what;
}
}  // namespace

// Both published layouts: a text-only folder (transformers 5's names, quick-GELU, pooling at the first
// end token) and a whole CLIPModel (text_model.* beside a vision tower, erf GELU, legacy eos_token_id 2).
TEST(ClipTextEncoder, OutputsAreTransformersOnTinyModels) {
  auto f = read_fixture(kFixtures + "clip/reference.safetensors");
  const auto& ids = f.tensors.at("ids");
  auto tokenizer = ClipTokenizer::from_folder(kFixtures + "clip");
  const auto prompts = nlohmann::json::parse(f.metadata.at("prompts")).get<std::vector<std::string>>();
  EXPECT_TRUE(torch::equal(tokenizer.encode(prompts, 77).ids, ids));
  for (const std::string model : {"text_only", "full_model"}) {
    auto encoder = ClipTextEncoder::load(kFixtures + "clip/" + model);
    EXPECT_EQ(encoder.config().hidden_size, 32);
    EXPECT_EQ(encoder.config().num_hidden_layers, 3);
    auto out = encoder.forward(ids);
    expect_close(out.last_hidden_state, f.tensors.at(model + ".last_hidden_state"), model + " last_hidden_state");
    expect_close(out.pooled, f.tensors.at(model + ".pooled"), model + " pooled");
  }
}

// A Stable Diffusion text_encoder/ folder: a flat config with text_model.* names.
TEST(ClipTextEncoder, TextModelPrefixedNamesLoad) {
  auto dir = temp_dir("prefixed");
  megaslide::io::NamedTensors renamed;
  for (auto& [name, t] : megaslide::io::read_safetensors(kFixtures + "clip/text_only/model.safetensors").tensors)
    renamed.emplace_back("text_model." + name, t);
  megaslide::io::write_safetensors(dir + "/model.safetensors", renamed);
  megaslide::io::write_file_atomically(dir + "/config.json",
                                       megaslide::io::read_file(kFixtures + "clip/text_only/config.json"));
  auto f = read_fixture(kFixtures + "clip/reference.safetensors");
  expect_close(ClipTextEncoder::load(dir).forward(f.tensors.at("ids")).last_hidden_state,
               f.tensors.at("text_only.last_hidden_state"), "prefixed");
  megaslide::io::remove_tree(dir);
}

TEST(ClipTextEncoder, BadFoldersAreNamed) {
  auto dir = temp_dir("bad");
  auto expect_error = [](const std::string& d, const std::string& needle) {
    try {
      ClipTextEncoder::load(d);
      ADD_FAILURE() << "no error for " << d << " (expected one mentioning '" << needle << "')";
    } catch (const megaslide::io::IoError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(dir + "/missing", "is not a folder");
  expect_error(dir, "no config.json");
  const auto config = nlohmann::json::parse(megaslide::io::read_file(kFixtures + "clip/text_only/config.json"));
  megaslide::io::write_file_atomically(dir + "/config.json", config.dump());
  expect_error(dir, "no weights file (expected model.safetensors)");
  auto weights = megaslide::io::read_safetensors(kFixtures + "clip/text_only/model.safetensors").tensors;
  // config.json disagreeing with the weights: a wider model.
  auto wide = config;
  wide["hidden_size"] = 40;
  megaslide::io::write_file_atomically(dir + "/config.json", wide.dump());
  megaslide::io::write_safetensors(dir + "/model.safetensors", weights);
  expect_error(dir, "'embeddings.token_embedding.weight' has shape [634, 32], expected [634, 40]");
  // Fewer layers in the config than in the weights.
  auto shallow = config;
  shallow["num_hidden_layers"] = 2;
  megaslide::io::write_file_atomically(dir + "/config.json", shallow.dump());
  expect_error(dir, "more than the 2 layers");
  // A missing tensor and a tensor of the wrong dtype.
  megaslide::io::write_file_atomically(dir + "/config.json", config.dump());
  megaslide::io::NamedTensors missing, integer;
  for (auto& [name, t] : weights) {
    if (name != "encoder.layers.1.mlp.fc2.bias") missing.emplace_back(name, t);
    integer.emplace_back(name, name == "final_layer_norm.weight" ? t.to(torch::kInt32) : t);
  }
  megaslide::io::write_safetensors(dir + "/model.safetensors", missing);
  expect_error(dir, "no tensor 'encoder.layers.1.mlp.fc2.bias'");
  megaslide::io::write_safetensors(dir + "/model.safetensors", integer);
  expect_error(dir, "'final_layer_norm.weight' is I32, expected floating point");
  wide["hidden_act"] = "relu";
  megaslide::io::write_file_atomically(dir + "/config.json", wide.dump());
  expect_error(dir, "hidden_act \"relu\" is not supported");
  megaslide::io::remove_tree(dir);
}

// The real model, when downloaded: MEGASLIDE_CLIP_WEIGHTS=DIR (openai/clip-vit-large-patch14, or a Stable
// Diffusion checkpoint's text_encoder/ with its tokenizer/ beside it or inside).
TEST(ClipTextEncoder, RealWeightsWhenDownloaded) {
  const char* dir = std::getenv("MEGASLIDE_CLIP_WEIGHTS");
  if (dir == nullptr) {
    std::cout
        << "\n*** SKIPPED: MEGASLIDE_CLIP_WEIGHTS is not set, so CLIP ViT-L/14's real weights were NOT tested ***\n\n";
    GTEST_SKIP() << "MEGASLIDE_CLIP_WEIGHTS not set: real CLIP weights not tested";
  }
  auto encoder = ClipTextEncoder::load(dir);
  EXPECT_EQ(encoder.config().hidden_size, 768);
  EXPECT_EQ(encoder.config().num_hidden_layers, 12);
  EXPECT_EQ(encoder.config().num_attention_heads, 12);
  auto reference = ClipTokenizer::from_openai_bpe(openai_bpe_path());
  auto f = read_fixture(kFixtures + "clip_tokenizer/ids.safetensors");
  const auto prompts = nlohmann::json::parse(f.metadata.at("prompts")).get<std::vector<std::string>>();
  std::string vocab_dir = dir;
  if (!ClipTokenizer::folder_has_vocabulary(vocab_dir)) vocab_dir = std::string(dir) + "/..";
  if (ClipTokenizer::folder_has_vocabulary(vocab_dir)) {
    auto tokenizer = ClipTokenizer::from_folder(vocab_dir);
    EXPECT_EQ(first_difference(prompts, tokenizer.encode(prompts, 77), f.tensors.at("ids"), f.tensors.at("mask")), "")
        << "the downloaded vocabulary disagrees with the bootstrap's";
  }
  auto tokens = reference.encode({"a photo of a cat", "a photo of a dog", "an astronaut riding a horse"}, 77);
  auto out = encoder.forward(tokens.ids);
  ASSERT_EQ(out.last_hidden_state.sizes(), (std::vector<int64_t>{3, 77, 768}));
  EXPECT_TRUE(torch::isfinite(out.last_hidden_state).all().item<bool>());
  // Related prompts are closer than unrelated ones in the pooled embedding.
  auto cos = [&](int a, int b) { return torch::cosine_similarity(out.pooled[a], out.pooled[b], 0).item<double>(); };
  std::cout << "pooled cosine: cat/dog " << cos(0, 1) << ", cat/astronaut " << cos(0, 2) << "\n";
  EXPECT_GT(cos(0, 1), cos(0, 2));
}

// The property: with fp8 weights (model.text_encoder.dtype: fp8) CLIP's text encoder keeps each layer matrix as
// float8_e4m3fn with one fp32 scale (its weights take 3 B less per matrix element and 4 B more per matrix) and
// computes bit for bit what it computes, in fp32, from a folder holding those matrices' dequantized values, as
// from a folder in ComfyUI's scaled fp8 layout.
TEST(ClipTextEncoder, Fp8WeightsComputeAsTheirDequantizedValues) {
  const auto source = kFixtures + "clip/text_only";
  const auto dir = temp_dir("fp8");
  int64_t matrices = 0, elements = 0;
  megaslide::testing::write_fp8_values_copy(source, dir + "/values", matrices, elements);
  EXPECT_EQ(matrices, 3 * 6) << "three layers: q, k, v, out_proj, fc1, fc2";
  const auto ids = read_fixture(kFixtures + "clip/reference.safetensors").tensors.at("ids");
  const auto reference = ClipTextEncoder::load(dir + "/values");
  const auto fp8 = ClipTextEncoder::load(source, torch::kCPU, torch::kFloat32, /*fp8=*/true);
  EXPECT_TRUE(fp8.fp8());
  EXPECT_EQ(fp8.parameter_count(), reference.parameter_count());
  EXPECT_EQ(fp8.weight_bytes(), reference.weight_bytes() - 3 * elements + 4 * matrices);
  const auto a = fp8.forward(ids), b = reference.forward(ids);
  EXPECT_TRUE(torch::equal(a.last_hidden_state, b.last_hidden_state));
  EXPECT_TRUE(torch::equal(a.pooled, b.pooled));
  // A folder in ComfyUI's scaled fp8 layout (F8_E4M3 matrices, <layer>.scale_weight) reads as data x scale.
  megaslide::io::NamedTensors scaled;
  for (auto& [name, t] : megaslide::io::read_safetensors(source + "/model.safetensors").tensors) {
    if (name.rfind("encoder.layers.", 0) != 0 || name.find("layer_norm") != std::string::npos ||
        name.compare(name.size() - 7, 7, ".weight") != 0) {
      scaled.emplace_back(name, t);
      continue;
    }
    const auto q = megaslide::quantize_fp8(t.to(torch::kFloat32), megaslide::Fp8Scaling::kPerTensor);
    scaled.emplace_back(name, q.data);
    scaled.emplace_back(name.substr(0, name.size() - 7) + ".scale_weight", q.scale);
  }
  megaslide::io::make_directories(dir + "/scaled");
  megaslide::io::write_safetensors(dir + "/scaled/model.safetensors", scaled);
  megaslide::io::write_file_atomically(dir + "/scaled/config.json", megaslide::io::read_file(source + "/config.json"));
  EXPECT_TRUE(torch::equal(ClipTextEncoder::load(dir + "/scaled").forward(ids).last_hidden_state, b.last_hidden_state))
      << "the scaled fp8 folder's values";
  megaslide::io::remove_tree(dir);
}
