// megaslide-encode end to end on the tiny reference models (tests/fixtures/clip, vae, umt5, wan_vae): its
// files hold what transformers and diffusers computed; bad input exits 2 naming it and writes nothing.
#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan_vae.h"
#include "run_tool.h"

using megaslide::testing::run_tool;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";

std::string temp_dir() {
  auto d = "/tmp/megaslide-test-encode-" + std::to_string(::getpid());
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

std::map<std::string, torch::Tensor> tensors(const std::string& path) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : megaslide::io::read_safetensors(path).tensors) out[name] = t;
  return out;
}

double relative_error(const torch::Tensor& ours, const torch::Tensor& ref) {
  const double scale = std::max(1.0, ref.abs().max().item<double>());
  return (ours.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs().max().item<double>() / scale;
}

}  // namespace

TEST(MegaslideEncode, TextWritesTransformersIdsAndEmbeddings) {
  auto dir = temp_dir();
  auto file = megaslide::io::read_safetensors(kFixtures + "clip/reference.safetensors");
  const auto prompts = nlohmann::json::parse(file.metadata.at("prompts")).get<std::vector<std::string>>();
  std::string text;
  for (const auto& p : prompts) text += p + "\n";
  megaslide::io::write_file_atomically(dir + "/prompts.txt", text);
  auto ref = tensors(kFixtures + "clip/reference.safetensors");
  auto r = run_tool("megaslide-encode", "text --text-encoder clip --weights " + kFixtures + "clip/full_model --vocab " +
                                            kFixtures + "clip --prompts " + dir + "/prompts.txt --out " + dir +
                                            "/text.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  auto out = tensors(dir + "/text.safetensors");
  EXPECT_TRUE(torch::equal(out.at("ids"), ref.at("ids")));
  EXPECT_TRUE(torch::equal(out.at("mask"), ref.at("mask")));
  EXPECT_LT(relative_error(out.at("embeddings"), ref.at("full_model.last_hidden_state")), 1e-4);
  EXPECT_LT(relative_error(out.at("pooled"), ref.at("full_model.pooled")), 1e-4);
  // One prompt per encoder call (--batch: memory bounded by it; all prompts went in one call) gives the same.
  ASSERT_GT(prompts.size(), 1u);
  r = run_tool("megaslide-encode", "text --text-encoder clip --weights " + kFixtures + "clip/full_model --vocab " +
                                       kFixtures + "clip --batch 1 --prompts " + dir + "/prompts.txt --out " + dir +
                                       "/one.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  // Progress by batch, not a terminal here: a line for each twentieth of the prompts (each one, with this few).
  const auto n = std::to_string(prompts.size());
  EXPECT_NE(r.output.find("[encode] 1/" + n + " prompts, "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[encode] " + n + "/" + n + " prompts, "), std::string::npos) << r.output;
  auto one = tensors(dir + "/one.safetensors");
  EXPECT_LT(relative_error(one.at("embeddings"), ref.at("full_model.last_hidden_state")), 1e-4);
  EXPECT_LT(relative_error(one.at("pooled"), ref.at("full_model.pooled")), 1e-4);
  // --ids-only needs no model.
  r = run_tool("megaslide-encode", "text --ids-only --vocab " + kFixtures + "clip --prompts " + dir +
                                       "/prompts.txt --out " + dir + "/ids.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  auto ids = tensors(dir + "/ids.safetensors");
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_TRUE(torch::equal(ids.at("ids"), ref.at("ids")));
  megaslide::io::remove_tree(dir);
}

TEST(MegaslideEncode, Umt5TextWritesWansEmbeddings) {
  auto dir = temp_dir();
  auto file = megaslide::io::read_safetensors(kFixtures + "umt5/reference.safetensors");
  const auto prompts = nlohmann::json::parse(file.metadata.at("prompts")).get<std::vector<std::string>>();
  std::string text;
  for (const auto& p : prompts) text += p + "\n";
  megaslide::io::write_file_atomically(dir + "/prompts.txt", text);
  auto ref = tensors(kFixtures + "umt5/reference.safetensors");
  // The diffusers-style root (text_encoder/ shards + tokenizer/) and ComfyUI's single file.
  for (const auto& [weights, hidden] : std::vector<std::pair<std::string, std::string>>{
           {"umt5/sharded", "hf.hidden"}, {"umt5/comfy_umt5_fp16.safetensors", "comfy.hidden"}}) {
    auto r = run_tool("megaslide-encode", "text --text-encoder umt5 --max-length 40 --batch 2 --weights " + kFixtures +
                                              weights + " --prompts " + dir + "/prompts.txt --out " + dir +
                                              "/umt5.safetensors");
    ASSERT_EQ(r.code, 0) << r.output;
    auto out = tensors(dir + "/umt5.safetensors");
    EXPECT_TRUE(torch::equal(out.at("ids"), ref.at("ids").to(torch::kLong))) << weights;
    EXPECT_TRUE(torch::equal(out.at("mask"), ref.at("mask").to(torch::kLong))) << weights;
    ASSERT_EQ(out.at("embeddings").sizes(), ref.at(hidden).sizes());
    EXPECT_LT((out.at("embeddings") - ref.at(hidden)).abs().max().item<double>(), 1e-4) << weights;
  }
  // Wan's default length: 512 tokens, embeddings zero past the prompt.
  auto r = run_tool("megaslide-encode", "text --text-encoder umt5 --weights " + kFixtures + "umt5/hf --prompts " + dir +
                                            "/prompts.txt --out " + dir + "/wan.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  auto out = tensors(dir + "/wan.safetensors");
  EXPECT_EQ(out.at("embeddings").sizes(), (std::vector<int64_t>{static_cast<int64_t>(prompts.size()), 512, 24}));
  const auto& emb = out.at("embeddings");
  const auto& mask = out.at("mask");
  EXPECT_GT(mask.sum(1).max().item<int64_t>(), 40);  // the long prompt, cut at 40 above, is whole here
  EXPECT_TRUE(emb.masked_select(mask.eq(0).unsqueeze(-1).expand_as(emb)).eq(0).all().item<bool>());
  EXPECT_TRUE(emb.abs().sum(-1).masked_select(mask.eq(1)).gt(0).all().item<bool>());
  megaslide::io::remove_tree(dir);
}

TEST(MegaslideEncode, VaeEncodeAndDecodeWriteDiffusersOutputs) {
  auto dir = temp_dir();
  auto ref = tensors(kFixtures + "vae/reference.safetensors");
  const std::string vae = "--vae sd --weights " + kFixtures + "vae/tiny";
  megaslide::io::write_safetensors(dir + "/images.safetensors", {{"x", ref.at("images")}});
  auto r = run_tool("megaslide-encode",
                    "vae-encode " + vae + " --in " + dir + "/images.safetensors --out " + dir + "/latents.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/latents.safetensors").at("y"), ref.at("mean") * 0.3), 1e-4);
  // One image per VAE call (all went in one call) gives the same.
  ASSERT_GT(ref.at("images").size(0), 1);
  r = run_tool("megaslide-encode", "vae-encode " + vae + " --frames-per-batch 1 --in " + dir +
                                       "/images.safetensors --out " + dir + "/one.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/one.safetensors").at("y"), ref.at("mean") * 0.3), 1e-4);
  megaslide::io::write_safetensors(dir + "/z.safetensors", {{"x", ref.at("latents") * 0.3}});
  r = run_tool("megaslide-encode",
               "vae-decode " + vae + " --in " + dir + "/z.safetensors --out " + dir + "/decoded.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/decoded.safetensors").at("y"), ref.at("decoded")), 1e-4);
  megaslide::io::write_safetensors(dir + "/zt.safetensors", {{"x", ref.at("tiled.latents") * 0.3}});
  r = run_tool("megaslide-encode",
               "vae-decode " + vae + " --tile 16 --in " + dir + "/zt.safetensors --out " + dir + "/tiled.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/tiled.safetensors").at("y"), ref.at("tiled.decoded")), 1e-4);
  megaslide::io::remove_tree(dir);
}

// --vae wan from diffusers' folder and from the single file with the original names: normalised latents
// and videos as diffusers computes them, whole and tiled; bad videos exit 2.
TEST(MegaslideEncode, WanVaeEncodeAndDecodeWriteDiffusersOutputs) {
  auto dir = temp_dir() + "-wan";
  megaslide::io::remove_tree(dir);
  megaslide::io::make_directories(dir);
  auto ref = tensors(kFixtures + "wan_vae/reference.safetensors");
  auto config = nlohmann::json::parse(megaslide::io::read_file(kFixtures + "wan_vae/tiny/config.json"));
  auto stat = [](const nlohmann::json& v) {
    return torch::tensor(v.get<std::vector<double>>(), torch::kFloat64).to(torch::kFloat32).view({1, -1, 1, 1, 1});
  };
  const auto mean = stat(config["latents_mean"]), std = stat(config["latents_std"]);
  const std::string folder = "--vae wan --weights " + kFixtures + "wan_vae/tiny";
  megaslide::io::write_safetensors(dir + "/videos.safetensors", {{"x", ref.at("f5.videos")}});
  auto r = run_tool("megaslide-encode", "vae-encode " + folder + " --in " + dir + "/videos.safetensors --out " + dir +
                                            "/latents.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/latents.safetensors").at("y"), (ref.at("f5.mean") - mean) / std), 1e-4);
  // The single file takes Wan 2.1's published statistics.
  megaslide::WanVaeConfig wan21;
  const auto mean21 = torch::tensor(wan21.latents_mean, torch::kFloat64).to(torch::kFloat32).view({1, -1, 1, 1, 1});
  const auto std21 = torch::tensor(wan21.latents_std, torch::kFloat64).to(torch::kFloat32).view({1, -1, 1, 1, 1});
  megaslide::io::write_safetensors(dir + "/z.safetensors", {{"x", (ref.at("f9.latents") - mean21) / std21}});
  r = run_tool("megaslide-encode", "vae-decode --vae wan --weights " + kFixtures +
                                       "wan_vae/wan_2.1_vae_tiny.safetensors --in " + dir + "/z.safetensors --out " +
                                       dir + "/decoded.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/decoded.safetensors").at("y"), ref.at("f9.decoded")), 1e-4);
  megaslide::io::write_safetensors(dir + "/zt.safetensors", {{"x", (ref.at("tiled.latents") - mean) / std}});
  r = run_tool("megaslide-encode", "vae-decode " + folder + " --tile 16 --tile-stride 8 --in " + dir +
                                       "/zt.safetensors --out " + dir + "/tiled.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/tiled.safetensors").at("y"), ref.at("tiled.decoded")), 1e-4);
  megaslide::io::write_safetensors(dir + "/vt.safetensors", {{"x", ref.at("tiled.videos")}});
  r = run_tool("megaslide-encode", "vae-encode " + folder + " --tile 16 --tile-stride 8 --in " + dir +
                                       "/vt.safetensors --out " + dir + "/tiled_z.safetensors");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(relative_error(tensors(dir + "/tiled_z.safetensors").at("y"), (ref.at("tiled.mean") - mean) / std), 1e-4);
  const std::string out = dir + "/out.safetensors";
  auto expect_bad = [&](const std::string& args, const std::string& needle) {
    auto b = run_tool("megaslide-encode", args + " --out " + out);
    EXPECT_EQ(b.code, 2) << args << "\n" << b.output;
    EXPECT_NE(b.output.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << b.output;
    EXPECT_FALSE(megaslide::io::path_exists(out)) << args;
  };
  // Flags that would change nothing are refused.
  expect_bad("vae-decode " + folder + " --tile-overlap 0.5 --tile 16 --in " + dir + "/latents.safetensors",
             "--tile-overlap is for --vae sd with --tile");
  expect_bad("vae-decode " + folder + " --tile-stride 8 --in " + dir + "/latents.safetensors",
             "--tile-stride spaces the Wan VAE's tiles: it needs --vae wan and --tile");
  expect_bad("vae-encode " + folder + " --frames-per-batch 2 --in " + dir + "/videos.safetensors",
             "--frames-per-batch is for --vae sd");
  expect_bad("vae-encode " + folder + " --seed 3 --in " + dir + "/videos.safetensors", "--seed seeds --sample's noise");
  megaslide::io::write_safetensors(dir + "/v4.safetensors", {{"x", torch::zeros({1, 3, 4, 16, 16})}});
  expect_bad("vae-encode " + folder + " --in " + dir + "/v4.safetensors", "4 frames; the Wan VAE takes 1 + 4k frames");
  expect_bad("vae-decode " + folder + " --in " + dir + "/videos.safetensors", "expected latents [N, 16, t, h, w]");
  megaslide::io::remove_tree(dir);
}

TEST(MegaslideEncode, BadInputExitsTwoNamingItAndWritesNothing) {
  auto dir = temp_dir();
  const std::string out = dir + "/out.safetensors";
  const std::string vae = "--vae sd --weights " + kFixtures + "vae/tiny --out " + out;
  auto expect_bad = [&](const std::string& args, const std::string& needle) {
    auto r = run_tool("megaslide-encode", args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << r.output;
    EXPECT_FALSE(megaslide::io::path_exists(out)) << args;
  };
  // A misspelt subcommand is named with the choices (CLI11 said only that one is required), and so is none.
  expect_bad("vae-encoder " + vae, "unknown subcommand 'vae-encoder': give text, vae-encode or vae-decode");
  expect_bad("", "a subcommand is needed: text, vae-encode or vae-decode");
  megaslide::io::write_safetensors(dir + "/z.safetensors", {{"z", torch::zeros({1, 3, 4, 4})}});
  expect_bad("vae-decode " + vae + " --in " + dir + "/z.safetensors", "has no tensor 'x' (it holds: z)");
  megaslide::io::write_safetensors(dir + "/z.safetensors", {{"x", torch::zeros({1, 4, 4, 4})}});
  expect_bad("vae-decode " + vae + " --in " + dir + "/z.safetensors",
             "tensor 'x' has shape [1, 4, 4, 4], expected [N, 3, H, W]");
  megaslide::io::write_safetensors(dir + "/z.safetensors", {{"x", torch::zeros({1, 3, 4, 4}, torch::kInt32)}});
  expect_bad("vae-decode " + vae + " --in " + dir + "/z.safetensors", "tensor 'x' is I32");
  megaslide::io::write_safetensors(dir + "/n.safetensors",
                                   {{"x", torch::full({1, 3, 8, 8}, std::numeric_limits<float>::quiet_NaN())}});
  expect_bad("vae-encode " + vae + " --in " + dir + "/n.safetensors", "holds NaN or infinite values");
  megaslide::io::write_safetensors(dir + "/i.safetensors", {{"x", torch::zeros({1, 3, 6, 8})}});
  expect_bad("vae-encode " + vae + " --in " + dir + "/i.safetensors", "multiples of 4");
  expect_bad("vae-decode " + vae + " --tile 8 --tile-stride 4 --in " + dir + "/z.safetensors",
             "--tile-stride spaces the Wan VAE's tiles");
  expect_bad("vae-decode " + vae + " --tile-overlap 0.5 --in " + dir + "/z.safetensors",
             "--tile-overlap is for --vae sd with --tile");
  expect_bad("vae-encode " + vae + " --in " + dir + "/missing.safetensors", dir + "/missing.safetensors");
  expect_bad("vae-encode --vae sd --weights " + dir + "/nowhere --out " + out + " --in " + dir + "/i.safetensors",
             dir + "/nowhere");
  megaslide::io::write_file_atomically(dir + "/p.txt", "a cat\n");
  expect_bad("text --weights " + kFixtures + "clip/text_only --prompts " + dir + "/p.txt --out " + out,
             "no CLIP vocabulary");
  expect_bad(
      "text --weights " + kFixtures + "vae/tiny --vocab " + kFixtures + "clip --prompts " + dir + "/p.txt --out " + out,
      "no weights file (expected model.safetensors)");
  expect_bad("text --weights " + kFixtures + "clip/text_only --vocab " + kFixtures + "clip --prompts " + dir +
                 "/none.txt --out " + out,
             "prompt file");
  expect_bad("text --text-encoder t5 --prompts " + dir + "/p.txt --out " + out, "--text-encoder");
  const std::string umt5 = "text --text-encoder umt5 --prompts " + dir + "/p.txt --out " + out;
  expect_bad(umt5 + " --weights " + dir + "/nowhere", dir + "/nowhere");
  expect_bad(umt5 + " --weights " + kFixtures + "umt5/hf --tokenizer " + dir + "/p.txt", "not a SentencePiece model");
  expect_bad(umt5 + " --weights " + kFixtures + "vae/tiny", "no SentencePiece model found");
  expect_bad(umt5 + " --weights " + kFixtures + "vae/tiny --tokenizer " + kFixtures + "umt5/tokenizer",
             "no weights (expected model.safetensors");
  expect_bad(umt5 + " --weights " + kFixtures + "umt5/hf --tokenizer " + kFixtures + "umt5_tokenizer/spiece.model",
             "has 700 pieces, the model's embedding only 332");
  // An --out that cannot be written is refused before the encoder runs (it was found only at the write, exit 1).
  auto r = run_tool("megaslide-encode", "text --ids-only --vocab " + kFixtures + "clip --prompts " + dir +
                                            "/p.txt --out " + dir + "/no-such-folder/ids.safetensors");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--out"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("prompt(s) ->"), std::string::npos) << "encoded before refusing:\n" << r.output;
  // An --out that is an input (it was replaced by the output, exit 0): the --in file, the prompts, a weights folder.
  const std::string in = dir + "/i.safetensors", prompts = dir + "/p.txt";
  const std::string in_bytes = megaslide::io::read_file(in), prompt_bytes = megaslide::io::read_file(prompts);
  r = run_tool("megaslide-encode",
               "vae-encode --vae sd --weights " + kFixtures + "vae/tiny --in " + in + " --out " + in);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("is the file --in reads"), std::string::npos) << r.output;
  r = run_tool("megaslide-encode",
               "text --ids-only --vocab " + kFixtures + "clip --prompts " + prompts + " --out " + prompts);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("is the file --prompts reads"), std::string::npos) << r.output;
  r = run_tool("megaslide-encode", "vae-encode --vae sd --weights " + kFixtures + "vae/tiny --in " + in + " --out " +
                                       kFixtures + "vae/tiny/out.safetensors");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("is inside the folder --weights reads"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(kFixtures + "vae/tiny/out.safetensors"));
  EXPECT_EQ(megaslide::io::read_file(in), in_bytes);
  EXPECT_EQ(megaslide::io::read_file(prompts), prompt_bytes);
  megaslide::io::remove_tree(dir);
}
