// CLIP's vision tower as Wan2.1 image-to-video uses it: the preprocessing against transformers'
// CLIPImageProcessor (PIL backend) and PIL's Image.resize, the penultimate hidden states against
// CLIPVisionModel on a tiny random model in diffusers' folder and ComfyUI's single-file layouts
// (tests/fixtures/clip_vision, tools/make_fixtures.py section_clip_vision); bad folders and files named in
// the errors; the real ViT-H/14 when MEGASLIDE_CLIP_VISION_WEIGHTS points at one.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/fp8.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/video.h"
#include "clip_fp8_copy.h"
#include "megaslide/model/clip_vision_encoder.h"
#include "error_checks.h"

using megaslide::ClipImagePreprocessing;
using megaslide::ClipVisionEncoder;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/clip_vision/";
const char* const kImages[] = {"landscape", "portrait", "small"};

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-clip-vision-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

const std::map<std::string, torch::Tensor>& reference() {
  static const auto tensors = [] {
    std::map<std::string, torch::Tensor> out;
    for (auto& [name, t] : megaslide::io::read_safetensors(kFixtures + "reference.safetensors").tensors) out[name] = t;
    return out;
  }();
  return tensors;
}

const torch::Tensor& fixture(const std::string& name) {
  auto it = reference().find(name);
  if (it == reference().end()) throw std::runtime_error("fixture tensor '" + name + "' is missing");
  return it->second;
}

ClipImagePreprocessing fixture_preprocessing() {
  return ClipImagePreprocessing::read(kFixtures + "image_processor/preprocessor_config.json");
}

double max_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// |ours − transformers| ≤ 1e-4 · max(1, max |transformers|): fp32 through 3 layers, summed in another order.
void expect_close(const torch::Tensor& ours, const torch::Tensor& reference, const std::string& what) {
  ASSERT_EQ(ours.sizes(), reference.sizes()) << what;
  EXPECT_EQ(ours.scalar_type(), torch::kFloat32) << what;
  const double scale = std::max(1.0, reference.abs().max().item<double>());
  const double error = max_difference(ours, reference) / scale;
  std::cout << what << ": largest difference " << error << " of the output's scale " << scale << "\n";
  EXPECT_LT(error, 1e-4) << what;
}

template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& needles) {
  megaslide::testing::expect_error_naming<megaslide::ClipVisionError>(std::forward<Fn>(fn), needles);
}

megaslide::io::NamedTensors fixture_weights() {
  return megaslide::io::read_safetensors(kFixtures + "image_encoder/model.safetensors").tensors;
}

}  // namespace

// Exact equality: the resize is PIL's integer arithmetic and the rest the same float32 operations.
TEST(ClipVision, PreprocessingIsClipImageProcessors) {
  const auto p = fixture_preprocessing();
  EXPECT_EQ(p.shortest_edge, 30);
  EXPECT_EQ(p.crop_height, 28);
  EXPECT_EQ(p.crop_width, 28);
  EXPECT_EQ(p.resample, 3);
  for (const std::string name : kImages) {
    auto ours = megaslide::clip_preprocess(fixture("image." + name), p);
    const auto& theirs = fixture("pixel_values." + name);
    ASSERT_EQ(ours.sizes(), theirs.sizes()) << name;
    std::cout << name << ": largest difference " << max_difference(ours, theirs) << "\n";
    EXPECT_TRUE(torch::equal(ours, theirs)) << name << ": largest difference " << max_difference(ours, theirs);
  }
  // The shortest edge to 30 and the long edge truncated: 30·49/39 = 37.69 and 30·54/43 = 37.67 give 37, not 38;
  // the crop offsets (37 − 28)/2 = 4.5 floor to 4.
  EXPECT_EQ(megaslide::clip_resized_size(39, 49, p), (std::pair<int64_t, int64_t>{30, 37}));
  EXPECT_EQ(megaslide::clip_resized_size(54, 43, p), (std::pair<int64_t, int64_t>{37, 30}));
  EXPECT_EQ(megaslide::clip_resized_size(20, 25, p), (std::pair<int64_t, int64_t>{30, 37}));  // upscaled
  // OpenAI's defaults at the model's size; and no resize, where the crop pads the 20x25 image with zeros.
  EXPECT_TRUE(torch::equal(megaslide::clip_preprocess(fixture("image.landscape"), ClipImagePreprocessing::defaults(28)),
                           fixture("default.pixel_values.landscape")));
  auto no_resize = p;
  no_resize.do_resize = false;
  EXPECT_TRUE(
      torch::equal(megaslide::clip_preprocess(fixture("image.small"), no_resize), fixture("pad.pixel_values.small")));
}

// Every filter PIL implements with separable weights, downscaled (the support widened) and upscaled.
TEST(ClipVision, ResizeIsPilsForEveryFilter) {
  const char* names[] = {"", "LANCZOS", "BILINEAR", "BICUBIC", "BOX", "HAMMING"};
  for (int resample = 1; resample <= 5; ++resample)
    for (const std::string image : {"landscape", "small"}) {
      const auto& theirs = fixture("resize." + std::to_string(resample) + "." + image);
      auto ours = megaslide::resize_like_pil(fixture("image." + image), theirs.size(0), theirs.size(1), resample);
      ASSERT_EQ(ours.sizes(), theirs.sizes());
      EXPECT_TRUE(torch::equal(ours, theirs)) << names[resample] << " " << image << " to " << theirs.sizes()
                                              << ": largest difference " << max_difference(ours, theirs);
    }
  EXPECT_TRUE(torch::equal(megaslide::resize_like_pil(fixture("image.small"), 20, 25, 3), fixture("image.small")));
  EXPECT_THROW(megaslide::resize_like_pil(fixture("image.small"), 10, 10, 0), c10::Error);  // NEAREST
}

// The PNGs a pipeline user would pass read back (through FFmpeg) as the fixture's pixels.
TEST(ClipVision, FixturePngsReadAsTheImages) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg: PNGs cannot be read";
  for (const std::string name : kImages) {
    auto frames = megaslide::io::read_video(kFixtures + name + ".png");
    ASSERT_EQ(frames.size(0), 1) << name;
    EXPECT_TRUE(torch::equal(frames[0], fixture("image." + name))) << name;
  }
}

// diffusers' image_encoder/ (vision_model.* names, fp16) with the sibling image_processor/.
TEST(ClipVision, PenultimateHiddenStatesAreTransformers) {
  auto encoder = ClipVisionEncoder::load(kFixtures + "image_encoder");
  const auto& c = encoder.config();
  EXPECT_EQ(c.hidden_size, 24);
  EXPECT_EQ(c.intermediate_size, 40);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.image_size, 28);
  EXPECT_EQ(c.patch_size, 7);
  EXPECT_EQ(c.hidden_act, "gelu");
  EXPECT_NE(encoder.preprocessing_source().find("image_processor/preprocessor_config.json"), std::string::npos);
  EXPECT_EQ(encoder.preprocessing().shortest_edge, 30);
  for (const std::string name : kImages) {
    expect_close(encoder.forward(fixture("pixel_values." + name)).penultimate, fixture("penultimate." + name),
                 name + " penultimate");
    expect_close(encoder.encode(fixture("image." + name)), fixture("penultimate." + name), name + " encode");
  }
  const auto& pixels = fixture("pixel_values.landscape");
  expect_close(encoder.hidden_state(pixels, 0), fixture("hidden_states_0.landscape"), "hidden_states[0]");
  expect_close(encoder.hidden_state(pixels, -1), fixture("hidden_states_last.landscape"), "hidden_states[-1]");
  expect_close(encoder.hidden_state(pixels, 3), fixture("hidden_states_last.landscape"), "hidden_states[3]");
  EXPECT_THROW(encoder.hidden_state(pixels, 4), c10::Error);
  EXPECT_THROW(encoder.forward(torch::zeros({1, 3, 30, 30})), c10::Error);  // not the model's image size
  // Wan's first and last frames together: one batch.
  auto both = encoder.encode(std::vector<torch::Tensor>{fixture("image.landscape"), fixture("image.portrait")});
  ASSERT_EQ(both.sizes(), (std::vector<int64_t>{2, 17, 24}));
  expect_close(both[1].unsqueeze(0), fixture("penultimate.portrait"), "batch of two, second");
}

// ComfyUI's single file (fp16, visual_projection beside the tower, no config): sizes inferred, the width's
// heads and activation given (24 is not a width ComfyUI ships), CLIP's default preprocessing at 28.
TEST(ClipVision, ComfyUiSingleFileLoadsTheSameModel) {
  megaslide::ClipVisionFileHints hints;
  hints.num_attention_heads = 4;
  hints.hidden_act = "gelu";
  auto comfy = ClipVisionEncoder::load(kFixtures + "clip_vision_tiny.safetensors", torch::kCPU, torch::kFloat32, hints);
  auto folder = ClipVisionEncoder::load(kFixtures + "image_encoder");
  const auto &a = comfy.config(), &b = folder.config();
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.image_size, b.image_size);
  EXPECT_EQ(a.patch_size, b.patch_size);
  EXPECT_EQ(a.num_channels, b.num_channels);
  EXPECT_EQ(comfy.parameter_count(), folder.parameter_count());
  EXPECT_EQ(comfy.preprocessing_source(), "");
  EXPECT_EQ(comfy.preprocessing().shortest_edge, 28);
  EXPECT_EQ(comfy.preprocessing().crop_height, 28);
  const auto& pixels = fixture("pixel_values.portrait");
  EXPECT_TRUE(torch::equal(comfy.forward(pixels).penultimate, folder.forward(pixels).penultimate));
  expect_close(comfy.encode(fixture("image.landscape")), fixture("default.penultimate.landscape"),
               "ComfyUI file, defaults");
}

// A CLIPConfig (vision_config nested) with transformers 5's unprefixed names in fp32, and no preprocessor
// config anywhere near: CLIP's defaults at the model's image size.
TEST(ClipVision, ClipConfigAndUnprefixedNamesLoad) {
  auto root = temp_dir("clipconfig");
  const auto dir = root + "/encoder";
  megaslide::io::make_directories(dir);
  auto vision = nlohmann::json::parse(megaslide::io::read_file(kFixtures + "image_encoder/config.json"));
  nlohmann::json config = {{"model_type", "clip"}, {"vision_config", vision}, {"text_config", {{"hidden_size", 16}}}};
  megaslide::io::write_file_atomically(dir + "/config.json", config.dump());
  megaslide::io::NamedTensors renamed;
  for (auto& [name, t] : fixture_weights())
    renamed.emplace_back(name.substr(std::string("vision_model.").size()), t.to(torch::kFloat32));
  megaslide::io::write_safetensors(dir + "/model.safetensors", renamed);
  auto encoder = ClipVisionEncoder::load(dir);
  EXPECT_EQ(encoder.config().hidden_size, 24);
  EXPECT_EQ(encoder.preprocessing_source(), "");
  EXPECT_EQ(encoder.preprocessing().shortest_edge, 28);
  expect_close(encoder.forward(fixture("pixel_values.small")).penultimate, fixture("penultimate.small"),
               "CLIPConfig, fp32");
  megaslide::io::remove_tree(root);
}

TEST(ClipVision, BadFoldersAndFilesAreNamed) {
  auto dir = temp_dir("bad");
  const auto weights = fixture_weights();
  const auto config = megaslide::io::read_file(kFixtures + "image_encoder/config.json");
  auto write_folder = [&](const megaslide::io::NamedTensors& tensors, const std::string& config_text) {
    megaslide::io::write_file_atomically(dir + "/config.json", config_text);
    megaslide::io::write_safetensors(dir + "/model.safetensors", tensors);
  };
  expect_error([&] { ClipVisionEncoder::load(dir + "/missing"); }, {dir + "/missing", "no such folder or file"});
  // A missing tensor, a tensor of the wrong shape, more layers than config.json says.
  megaslide::io::NamedTensors missing, wrong;
  for (auto& [name, t] : weights) {
    if (name != "vision_model.encoder.layers.1.self_attn.k_proj.bias") missing.emplace_back(name, t);
    wrong.emplace_back(name, name == "vision_model.embeddings.position_embedding.weight" ? t.slice(0, 0, 12) : t);
  }
  write_folder(missing, config);
  expect_error([&] { ClipVisionEncoder::load(dir); },
               {dir + "/model.safetensors", "no tensor 'vision_model.encoder.layers.1.self_attn.k_proj.bias'"});
  write_folder(wrong, config);
  expect_error([&] { ClipVisionEncoder::load(dir); },
               {dir + "/model.safetensors",
                "'vision_model.embeddings.position_embedding.weight' has shape [12, 24], "
                "expected [17, 24]"});
  auto shallow = nlohmann::json::parse(config);
  shallow["num_hidden_layers"] = 2;
  write_folder(weights, shallow.dump());
  expect_error([&] { ClipVisionEncoder::load(dir); }, {dir, "more than the 2 layers"});
  auto relu = nlohmann::json::parse(config);
  relu["hidden_act"] = "relu";
  write_folder(weights, relu.dump());
  expect_error([&] { ClipVisionEncoder::load(dir); }, {dir + "/config.json", "hidden_act \"relu\" is not supported"});
  // A preprocessor config with a filter that is not implemented, beside the weights.
  write_folder(weights, config);
  auto processor =
      nlohmann::json::parse(megaslide::io::read_file(kFixtures + "image_processor/preprocessor_config.json"));
  processor["resample"] = 0;
  megaslide::io::write_file_atomically(dir + "/preprocessor_config.json", processor.dump());
  expect_error([&] { ClipVisionEncoder::load(dir); }, {dir + "/preprocessor_config.json", "\"resample\""});
  processor["resample"] = 3;
  processor["size"] = {{"shortest_edge", 30}, {"longest_edge", 40}};
  megaslide::io::write_file_atomically(dir + "/preprocessor_config.json", processor.dump());
  expect_error([&] { ClipVisionEncoder::load(dir); }, {dir + "/preprocessor_config.json", "longest_edge"});
  // Single files: a width ComfyUI does not ship (no hints), a missing tensor, OpenCLIP's names.
  const auto file = dir + "/clip_vision.safetensors";
  megaslide::io::write_safetensors(file, weights);
  expect_error([&] { ClipVisionEncoder::load(file); }, {file, "width 24", "ClipVisionFileHints"});
  megaslide::ClipVisionFileHints hints;
  hints.num_attention_heads = 4;
  hints.hidden_act = "gelu";
  megaslide::io::write_safetensors(file, missing);
  expect_error([&] { ClipVisionEncoder::load(file, torch::kCPU, torch::kFloat32, hints); },
               {file, "no tensor 'vision_model.encoder.layers.1.self_attn.k_proj.bias'"});
  megaslide::io::write_safetensors(file, wrong);
  expect_error([&] { ClipVisionEncoder::load(file, torch::kCPU, torch::kFloat32, hints); },
               {file, "'vision_model.embeddings.position_embedding.weight' has 12 positions"});
  hints.num_attention_heads = 5;
  megaslide::io::write_safetensors(file, weights);
  expect_error([&] { ClipVisionEncoder::load(file, torch::kCPU, torch::kFloat32, hints); },
               {file, "not a multiple of num_attention_heads 5"});
  megaslide::io::write_safetensors(file, {{"visual.class_embedding", torch::zeros({24})}});
  expect_error([&] { ClipVisionEncoder::load(file); }, {file, "OpenCLIP"});
  megaslide::io::remove_tree(dir);
}

TEST(ClipVision, RandomModelsHaveTheConfiguredShapes) {
  megaslide::ClipVisionConfig c;
  c.hidden_size = 16, c.intermediate_size = 20, c.num_hidden_layers = 2, c.num_attention_heads = 2;
  c.image_size = 20, c.patch_size = 6;  // 3x3 patches, the last 2 pixels of each side unused (as the conv)
  auto encoder = ClipVisionEncoder::random(c, 7);
  EXPECT_EQ(encoder.preprocessing().crop_height, 20);
  auto out = encoder.encode(torch::randint(0, 256, {31, 17, 3}, torch::kUInt8));
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 10, 16}));
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  EXPECT_GT(out.std().item<double>(), 0.1);
}

TEST(ClipVision, PenultimateOnTheGpuIsTheCpus_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto cpu = ClipVisionEncoder::load(kFixtures + "image_encoder");
  auto gpu = ClipVisionEncoder::load(kFixtures + "image_encoder", torch::kCUDA);
  auto reference = cpu.encode(fixture("image.portrait"));
  expect_close(gpu.encode(fixture("image.portrait")).cpu(), reference, "CUDA fp32");
  auto bf16 = ClipVisionEncoder::load(kFixtures + "image_encoder", torch::kCUDA, torch::kBFloat16);
  auto out = bf16.encode(fixture("image.portrait")).cpu();
  const double error = max_difference(out, reference) / std::max(1.0, reference.abs().max().item<double>());
  std::cout << "CUDA bf16: largest difference " << error << "\n";
  EXPECT_LT(error, 5e-2);
}

// The real model, when downloaded: MEGASLIDE_CLIP_VISION_WEIGHTS=PATH (a Wan2.1 I2V diffusers repo's
// image_encoder/, or ComfyUI's clip_vision_h.safetensors).
TEST(ClipVision, RealWeightsWhenDownloaded) {
  const char* path = std::getenv("MEGASLIDE_CLIP_VISION_WEIGHTS");
  if (path == nullptr) {
    std::cout << "\n*** SKIPPED: MEGASLIDE_CLIP_VISION_WEIGHTS is not set, so CLIP ViT-H/14's real weights were NOT "
                 "tested ***\n\n";
    GTEST_SKIP() << "MEGASLIDE_CLIP_VISION_WEIGHTS not set: real CLIP vision weights not tested";
  }
  auto encoder = ClipVisionEncoder::load(path);
  EXPECT_EQ(encoder.config().hidden_size, 1280);
  EXPECT_EQ(encoder.config().num_hidden_layers, 32);
  EXPECT_EQ(encoder.config().num_attention_heads, 16);
  EXPECT_EQ(encoder.config().image_size, 224);
  auto out = encoder.encode(fixture("image.landscape"));
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 257, 1280}));
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
}

// The property: with fp8 weights (model.image_encoder.dtype: fp8) CLIP's image encoder keeps each layer matrix as
// float8_e4m3fn with one fp32 scale (its weights take 3 B less per matrix element and 4 B more per matrix) and
// computes bit for bit what it computes, in fp32, from a folder holding those matrices' dequantized values.
TEST(ClipVision, Fp8WeightsComputeAsTheirDequantizedValues) {
  const auto source = kFixtures + "image_encoder";
  const auto dir = temp_dir("fp8");
  int64_t matrices = 0, elements = 0;
  megaslide::testing::write_fp8_values_copy(source, dir + "/values", matrices, elements);
  const auto reference = ClipVisionEncoder::load(dir + "/values");
  EXPECT_EQ(matrices, 6 * reference.config().num_hidden_layers);
  const auto fp8 = ClipVisionEncoder::load(source, torch::kCPU, torch::kFloat32, {}, /*fp8=*/true);
  EXPECT_TRUE(fp8.fp8());
  EXPECT_EQ(fp8.weight_bytes(), reference.weight_bytes() - 3 * elements + 4 * matrices);
  const auto& c = reference.config();
  torch::manual_seed(11);
  const auto pixels = torch::randn({2, c.num_channels, c.image_size, c.image_size});
  EXPECT_TRUE(torch::equal(fp8.forward(pixels).penultimate, reference.forward(pixels).penultimate));
  EXPECT_TRUE(torch::equal(fp8.hidden_state(pixels, -1), reference.hidden_state(pixels, -1)));
  megaslide::io::remove_tree(dir);
}
