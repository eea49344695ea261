// Wan text to video (diffusion/wan_text_to_video.h) and megaslide-sample on Wan, against diffusers'
// WanPipeline on tiny models (tests/fixtures/wan_pipeline/, tools/make_fixtures.py wan_pipeline: the umt5
// and wan_vae fixtures and a tiny DiT sized to them):
//   - Wan's prompt cleaning equals diffusers' prompt_clean on a prompt set (and tests/test_ftfy.cpp on a few
//     hundred more); ftfy's character-wise steps alone, composed as before ftfy_fix_text, still equal the same
//     steps composed from ftfy's functions in Python;
//   - the text embeddings, the sampled latents (UniPC and Euler, with guidance against Wan's negative
//     prompt) and the decoded video equal WanPipeline's within 1e-4 (fp32);
//   - the streamed DiT equals the resident one bit for bit (fp32 and bf16);
//   - the blocks read on demand (meta skeleton, one block at a time) are the whole load's, including the
//     3D-DSA retrofit's drawn parameters, and stream to the same predictions bit for bit;
//   - megaslide-sample writes playable H.264 MP4s in VBench's layout with the expected frame count and
//     size, from published weights (--config) and from a Wan weights file (--checkpoint), resident and
//     streamed, deterministic per seed, whose latents equal umT5 -> flow_sample -> the DiT composed here;
//   - bad paths are one-line errors with exit code 2, nothing written.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <unistd.h>

#include "megaslide/diffusion/wan_text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/video.h"
#include "megaslide/io/vbench_layout.h"
#include "megaslide/model/dit_weights.h"
#include "megaslide/model/encoder_settings.h"
#include "megaslide/model/wan_lora.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/run_outputs.h"
#include "megaslide/train/wan_validation.h"
#include "run_tool.h"

namespace {

using megaslide::io::join_path;

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";
const std::string kReference = kFixtures + "wan_pipeline/reference.safetensors";
const std::string kTransformer = kFixtures + "wan_pipeline/transformer";
const std::string kUmt5 = kFixtures + "umt5/hf";
const std::string kTokenizer = kFixtures + "umt5/tokenizer";
const std::string kVae = kFixtures + "wan_vae/tiny";

struct Reference {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> meta;
  nlohmann::json json(const std::string& key) const { return nlohmann::json::parse(meta.at(key)); }
};

const Reference& reference() {
  static const Reference r = [] {
    auto f = megaslide::io::read_safetensors(kReference);
    Reference out;
    for (auto& [k, v] : f.tensors) out.tensors[k] = v;
    out.meta = f.metadata;
    return out;
  }();
  return r;
}

std::string scratch() {
  static const std::string dir = [] {
    auto d = "/tmp/megaslide-test-wan-sample-" + std::to_string(::getpid());
    megaslide::io::remove_tree(d);
    megaslide::io::make_directories(d);
    return d;
  }();
  return dir;
}
class RemoveScratch : public ::testing::Environment {
 public:
  void TearDown() override { megaslide::io::remove_tree(scratch()); }
};
const ::testing::Environment* const kRemoveScratch = ::testing::AddGlobalTestEnvironment(new RemoveScratch);

// A Wan run config of the fixture DiT's sizes: latents 16 x 2 x 4 x 6 (5 frames of 32 x 48).
std::string config_yaml(const std::string& weights) {
  return "model:\n  arch: wan\n  wan:\n    dim: 16\n    layers: 2\n    heads: 2\n    ffn_dim: 32\n    freq_dim: 16\n   "
         " text_dim: 24\n"
         "    patch: [1, 2, 2]\n    in_channels: 16\n    out_channels: 16\n    qk_norm: true\n    cross_attn_norm: "
         "true\n"
         "    eps: 1.0e-6\n    weights: \"" +
         weights +
         "\"\n"
         "data:\n  dataset: latent-tensors\n  channels: 16\n  frames: 2\n  height: 4\n  width: 6\n  max_text_tokens: "
         "512\n"
         "diffusion:\n  objective: flow\n  timesteps: 1000\n  shift: 5.0\n  sample_steps: 4\n  guidance_scale: 5.0\n"
         "offload:\n  enabled: false\n";
}

megaslide::RunConfig fixture_config() { return megaslide::parse_run_config(config_yaml(kTransformer), "test config"); }

std::shared_ptr<megaslide::WanTextToVideo> pipeline(std::shared_ptr<megaslide::WanDenoiser> denoiser = nullptr) {
  auto model = megaslide::wan_model_from_config(fixture_config(), "test config");
  if (!denoiser) denoiser = std::make_shared<megaslide::ResidentWanDenoiser>(model.dit, torch::kCPU);
  return std::make_shared<megaslide::WanTextToVideo>(model.config, megaslide::Umt5Encoder::load(kUmt5),
                                                     megaslide::Umt5Tokenizer::from_file(kTokenizer + "/spiece.model"),
                                                     denoiser, megaslide::WanVae::load(kVae));
}

megaslide::WanSampleOptions reference_options(megaslide::FlowSamplerKind kind) {
  const auto s = reference().json("sampling");
  return megaslide::WanSampleOptions()
      .kind(kind)
      .steps(s.at("steps").get<int64_t>())
      .shift(s.at("shift").get<double>())
      .guidance_scale(s.at("guidance").get<double>())
      .negative_prompt(reference().meta.at("negative_prompt"));
}

const megaslide::offload::StreamerStats& streamer_stats(const megaslide::StreamedWanDenoiser& d) {
  return d.streamer().stats();
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace

TEST(WanPromptClean, EqualsDiffusersPromptClean) {
  auto prompts = reference().json("clean_prompts").get<std::vector<std::string>>();
  prompts.push_back(reference().meta.at("negative_prompt"));
  const auto expected = reference().json("clean_expected");
  const auto with_ftfy = reference().json("clean_prompt_clean");
  ASSERT_EQ(prompts.size(), expected.size());
  ASSERT_EQ(prompts.size(), with_ftfy.size());
  std::vector<size_t> ftfy_differs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(megaslide::wan_prompt_clean(prompts[i]), with_ftfy[i].get<std::string>())
        << "prompt " << i << ": " << prompts[i];
    // The old helper: only ftfy's character-wise steps, as the same steps composed in Python give them.
    EXPECT_EQ(megaslide::wan_clean(
                  megaslide::html_unescape(megaslide::html_unescape(megaslide::ftfy_character_fixes(prompts[i])))),
              expected[i].get<std::string>())
        << "prompt " << i << ": " << prompts[i];
    if (expected[i] != with_ftfy[i]) ftfy_differs.push_back(i);
  }
  // Where the rest of ftfy.fix_text matters (so the first check covers it): C1 controls and line separators
  // (2), a third unescape of text without '<' (4), quotes uncurled after its own unescaping (7), mojibake (14).
  EXPECT_EQ(ftfy_differs, (std::vector<size_t>{2, 4, 7, 14}));
  EXPECT_EQ(std::string(megaslide::kWanNegativePrompt), reference().meta.at("negative_prompt"));
  EXPECT_EQ(megaslide::wan_prompt_clean(megaslide::kWanNegativePrompt).find("\xEF\xBC\x8C"),
            std::string::npos);  // no U+FF0C left
}

TEST(WanPromptClean, HtmlUnescapeEdgeCases) {
  using megaslide::html_unescape;
  EXPECT_EQ(html_unescape("&amp;amp;"), "&amp;");
  EXPECT_EQ(html_unescape("&#x1F600;"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(html_unescape("&#99999999999999999999;"), "\xEF\xBF\xBD");  // huge: U+FFFD, no overflow
  EXPECT_EQ(html_unescape("&notit;"), "\xC2\xACit;");                   // longest prefix without ';'
  EXPECT_EQ(html_unescape("&"), "&");
  EXPECT_EQ(html_unescape("&#"), "&#");
  EXPECT_EQ(html_unescape("&#x"), "&#x");
  EXPECT_EQ(html_unescape("x&#x41"), "xA");
}

TEST(WanTextToVideo, EmbeddingsEqualWanPipelines) {
  const auto& ref = reference();
  auto prompts = ref.json("prompts").get<std::vector<std::string>>();
  prompts.push_back(ref.meta.at("negative_prompt"));
  auto p = pipeline();
  const auto embeds = p->encode(prompts, megaslide::WanSampleOptions());
  const auto& expected = ref.tensors.at("prompt_embeds");
  const int64_t used = expected.size(1);
  ASSERT_EQ(embeds.sizes(), (std::vector<int64_t>{3, 512, 24}));
  EXPECT_LT(max_diff(embeds.narrow(1, 0, used), expected), 1e-4);
  EXPECT_EQ(embeds.narrow(1, used, 512 - used).abs().max().item<float>(), 0.0f);  // Wan's zeros past the prompt
}

// The property: a run trained from a videos cache keeps its data sizes in pixels (data.dataset: videos,
// 5 frames of 32 x 48 here); sampling it makes latents of those videos' size (2 x 4 x 6), not latents of
// the pixel sizes taken as latent sizes (a 9x64x64 run used to sample 33x512x512 videos).
TEST(WanTextToVideo, ARunOfVideosSamplesAtItsVideosSize) {
  const auto latent = pipeline()->latent_shape();
  auto videos = fixture_config();
  videos.data.dataset = "videos";
  videos.data.channels = 3, videos.data.frames = 5, videos.data.height = 32, videos.data.width = 48;
  videos.model.vae.kind = "wan";
  videos.model.vae.latent_channels = 16;
  videos.model.vae.downscale = 8;
  auto model = megaslide::wan_model_from_config(fixture_config(), "test config");
  const megaslide::WanTextToVideo from_videos(
      videos, megaslide::Umt5Encoder::load(kUmt5), megaslide::Umt5Tokenizer::from_file(kTokenizer + "/spiece.model"),
      std::make_shared<megaslide::ResidentWanDenoiser>(model.dit, torch::kCPU), megaslide::WanVae::load(kVae));
  EXPECT_EQ(from_videos.latent_shape(), latent);
  EXPECT_EQ(latent, (std::vector<int64_t>{16, 2, 4, 6}));
}

// The property: a Wan DiT on the Wan2.2 VAE's latents (TI2V-5B's pipeline; here the tiny random Wan2.2-style
// VAE of tests/fixtures/wan22_vae, z_dim 8) samples at its latent size and decodes to 16 pixels a latent and
// 1 + 4(t − 1) frames; a config whose model.vae.downscale is not the VAE's is refused naming the key.
TEST(WanTextToVideo, TheWan22VaeDecodesSixteenPixelsALatent) {
  const std::string yaml =
      "model:\n  arch: wan\n  wan: {dim: 16, layers: 1, heads: 2, ffn_dim: 32, freq_dim: 16, text_dim: 24, patch: "
      "[1, 2, 2], in_channels: 8, out_channels: 8}\n  vae: {downscale: 16}\n"
      "data: {dataset: latent-tensors, channels: 8, frames: 2, height: 2, width: 4, max_text_tokens: 512}\n"
      "diffusion: {objective: flow, shift: 5.0, sample_steps: 2, guidance_scale: 5.0}\n";
  const auto config = megaslide::parse_run_config(yaml, "test");
  torch::manual_seed(3);
  megaslide::WanTransformer dit(megaslide::WanOptions::from_config(config));
  const std::string vae = kFixtures + "wan22_vae/tiny";
  auto make = [&](const megaslide::RunConfig& c) {
    return megaslide::WanTextToVideo(
        c, megaslide::Umt5Encoder::load(kUmt5), megaslide::Umt5Tokenizer::from_file(kTokenizer + "/spiece.model"),
        std::make_shared<megaslide::ResidentWanDenoiser>(dit, torch::kCPU), megaslide::WanVae::load(vae));
  };
  auto pipeline = make(config);
  const auto latents = pipeline.sample({"a fox in snow"}, {4}, megaslide::WanSampleOptions::from_config(config));
  EXPECT_EQ(latents.sizes(), (std::vector<int64_t>{1, 8, 2, 2, 4}));
  EXPECT_EQ(pipeline.decode(latents).sizes(), (std::vector<int64_t>{1, 3, 5, 32, 64}));
  auto wrong = config;
  wrong.model.vae.downscale = 8;
  try {
    make(wrong);
    ADD_FAILURE() << "a downscale of 8 was accepted for the Wan2.2 VAE";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("set model.vae.downscale: 16"), std::string::npos) << e.what();
  }
}

// The property: Wan2.2 TI2V's image-to-video (tests/fixtures/ti2v_pipeline: diffusers' WanImageToVideoPipeline
// with expand_timesteps on a tiny DiT, the Wan2.2-style VAE and umT5) — the first latent frame the image's,
// clean in every model input with its tokens at timestep 0 — samples diffusers' latents within 1e-4 (fp32,
// UniPC and Euler, guidance); the first frame is the image's latent; an image of another size is refused.
// The property: a Wan run's videos play at the rate its clips were sampled at (data.fps of a video dataset), else at
// Wan-AI's sample_fps for the model: 24 for TI2V-5B (the Wan2.2 VAE: 16 pixels a latent, 48 channels), 16 otherwise.
TEST(WanTextToVideo, VideosPlayAtTheModelsOrTheDatasFrameRate) {
  const auto config = [](const std::vector<std::string>& overrides) {
    return megaslide::parse_run_config(config_yaml(kTransformer), "test", overrides);
  };
  EXPECT_EQ(megaslide::wan_video_fps(config({})), 16);
  EXPECT_EQ(megaslide::wan_video_fps(config({"model.vae.downscale=16"})), 24);
  auto ti2v = config({});
  ti2v.model.wan.out_channels = 48;
  EXPECT_EQ(megaslide::wan_video_fps(ti2v), 24);
  auto videos = config({});
  videos.data.dataset = "videos";
  videos.data.fps = 8;
  EXPECT_EQ(megaslide::wan_video_fps(videos), 8);
  videos.data.fps = 0;  // every frame_stride-th frame: the model's rate
  EXPECT_EQ(megaslide::wan_video_fps(videos), 16);
}

TEST(WanTextToVideo, ImageToVideoKeepsTheFirstFrameAsTi2vDoes) {
  const std::string dir = kFixtures + "ti2v_pipeline";
  Reference ref;
  {
    auto f = megaslide::io::read_safetensors(dir + "/reference.safetensors");
    for (auto& [k, v] : f.tensors) ref.tensors[k] = v;
    ref.meta = f.metadata;
  }
  const auto s = ref.json("sampling");
  const std::string yaml = "model:\n  arch: wan\n  wan: {weights: " + dir +
                           "/transformer, in_channels: 8, out_channels: 8}\n  vae: {downscale: 16}\n"
                           "data: {dataset: latent-tensors, channels: 8, frames: 3, height: 4, width: 6, "
                           "max_text_tokens: 512}\n"
                           "diffusion: {objective: flow}\n";
  auto model = megaslide::wan_model_from_config(megaslide::parse_run_config(yaml, "test"), "test");
  megaslide::WanTextToVideo pipeline(model.config, megaslide::Umt5Encoder::load(kUmt5),
                                     megaslide::Umt5Tokenizer::from_file(kTokenizer + "/spiece.model"),
                                     std::make_shared<megaslide::ResidentWanDenoiser>(model.dit, torch::kCPU),
                                     megaslide::WanVae::load(kFixtures + "wan22_vae/tiny"));
  const auto& image = ref.tensors.at("image");
  for (auto [kind, name] : {std::pair{megaslide::FlowSamplerKind::kUniPC, "unipc"},
                            std::pair{megaslide::FlowSamplerKind::kEuler, "euler"}}) {
    auto o = megaslide::WanSampleOptions::from_config(model.config)
                 .kind(kind)
                 .steps(s.at("steps").get<int64_t>())
                 .shift(s.at("shift").get<double>())
                 .guidance_scale(s.at("guidance").get<double>())
                 .negative_prompt(ref.meta.at("negative_prompt"));
    const auto latents =
        pipeline.sample_from_image({ref.meta.at("prompt")}, {std::stoull(ref.meta.at("seed"))}, image, o);
    EXPECT_LT(max_diff(latents, ref.tensors.at(std::string(name) + ".latents")), 1e-4) << name;
    const auto first = pipeline.vae().encode(image.view({1, 3, 1, image.size(1), image.size(2)}));
    EXPECT_LT(max_diff(latents.narrow(2, 0, 1), first), 1e-6) << name;
  }
  EXPECT_THROW(pipeline.sample_from_image({"a"}, {1}, image.narrow(1, 0, 32), megaslide::WanSampleOptions()),
               std::invalid_argument);
}

TEST(WanTextToVideo, LatentsAndVideoEqualWanPipelinesForUniPCAndEuler) {
  const auto& ref = reference();
  const auto prompts = ref.json("prompts").get<std::vector<std::string>>();
  const auto seeds = ref.json("seeds").get<std::vector<uint64_t>>();
  auto p = pipeline();
  for (auto [kind, name] : {std::pair{megaslide::FlowSamplerKind::kUniPC, "unipc"},
                            std::pair{megaslide::FlowSamplerKind::kEuler, "euler"}}) {
    // Both prompts in one batch: each sample depends on its own seed only.
    const auto latents = p->sample(prompts, seeds, reference_options(kind));
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto& expected = ref.tensors.at(std::string(name) + "." + std::to_string(i) + ".latents");
      const double d = max_diff(latents.narrow(0, static_cast<int64_t>(i), 1), expected);
      EXPECT_LT(d, 1e-4) << name << " prompt " << i;
    }
  }
  const auto latents = p->sample({prompts[0]}, {seeds[0]}, reference_options(megaslide::FlowSamplerKind::kUniPC));
  // The decode of WanPipeline's own latents is its video (the VAE's denormalisation and decode); the whole
  // chain's video is as close as the latents' last-bit differences, amplified by the tiny VAE, allow.
  EXPECT_LT(max_diff(p->decode(ref.tensors.at("unipc.0.latents")), ref.tensors.at("unipc.0.video")), 1e-4);
  EXPECT_LT(max_diff(p->decode(latents), ref.tensors.at("unipc.0.video")), 2e-3)
      << "latents " << max_diff(latents, ref.tensors.at("unipc.0.latents"));
  // The guidance is really applied: without it the latents are far from WanPipeline's.
  const auto unguided =
      p->sample({prompts[0]}, {seeds[0]}, reference_options(megaslide::FlowSamplerKind::kUniPC).guidance_scale(1.0));
  EXPECT_GT(max_diff(unguided, ref.tensors.at("unipc.0.latents")), 1e-2);
}

TEST(WanTextToVideo, StreamedDenoiserEqualsResidentBitForBit) {
  auto config = fixture_config();
  torch::manual_seed(3);
  const auto x = torch::randn({2, 16, 2, 4, 6});
  const auto t = torch::tensor({937.0f, 15.0f});
  const auto text = torch::randn({2, 7, 24});
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    megaslide::ResidentWanDenoiser resident(megaslide::wan_model_from_config(config, "test").dit, torch::kCPU, dtype);
    megaslide::StreamedDenoiserOptions so;
    so.compute_dtype = dtype;
    megaslide::StreamedWanDenoiser streamed(megaslide::wan_model_from_config(config, "test").dit, so);
    const auto a = resident.predict(x, t, text), b = streamed.predict(x, t, text);
    EXPECT_TRUE(torch::equal(a, b)) << dtype << ": " << max_diff(a, b);
    EXPECT_TRUE(torch::equal(b, streamed.predict(x, t, text)));  // the slots are reused correctly
    const auto& stats = streamer_stats(streamed);
    EXPECT_EQ(stats.h2d_copies + stats.cache_hits, 4);  // 2 blocks x 2 calls through the (emulated async) streams
    EXPECT_GE(stats.h2d_copies, 2);
  }
  // fp32 resident = the module's own forward.
  auto model = megaslide::wan_model_from_config(config, "test").dit;
  torch::NoGradGuard no_grad;
  const auto direct = model->forward(x, t, text);
  EXPECT_TRUE(torch::equal(megaslide::ResidentWanDenoiser(model, torch::kCPU).predict(x, t, text), direct));
}

// Property: the blocks read on demand (a meta skeleton, one block at a time from the mapped weights) are
// the old whole load's, parameter for parameter (WanTransformer's constructor, then load_wan_weights): from
// published weights, from published weights without the 3D-DSA retrofit's parameters (which keep the
// values the constructor draws for them), and from a Wan weights file; and the streamed denoiser built
// block by block from them predicts what the one built from the whole model does, bit for bit; so does the
// resident denoiser that reads them one by one onto its device.
TEST(WanTextToVideo, BlocksOnDemandAreTheWholeLoadsAndStreamTheSame) {
  auto expect_same = [](const megaslide::WanTransformer& a, const megaslide::WanTransformer& b,
                        const std::string& what) {
    const auto pa = a->named_parameters(true), pb = b->named_parameters(true);
    ASSERT_EQ(pa.size(), pb.size()) << what;
    for (const auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << what << ": " << p.key();
  };
  for (const bool dsa : {false, true}) {
    auto config = fixture_config();
    if (dsa) {
      config.model.self_attention = "dsa3d";
      config.model.dsa_kernel = {3, 3, 3};
    }
    const std::string what = dsa ? "dsa3d" : "dense";
    torch::manual_seed(21);
    megaslide::WanTransformer old(
        megaslide::WanOptions::from_config(megaslide::with_wan_architecture_from_weights(config)));
    const auto kept =
        megaslide::load_wan_weights(megaslide::WanWeights::open(kTransformer), *old,
                                    dsa ? megaslide::wan_dsa_parameter_globs() : std::vector<std::string>{});
    EXPECT_EQ(kept.empty(), !dsa) << what;  // the retrofit's parameters are really drawn, not read
    torch::manual_seed(21);
    auto whole = megaslide::wan_model_from_config(config, "test");
    expect_same(old, whole.dit, what + " whole");
    torch::manual_seed(21);
    auto on_demand = megaslide::wan_model_from_config(config, "test", /*blocks_on_demand=*/true);
    ASSERT_TRUE(on_demand.block) << what;
    EXPECT_TRUE(on_demand.dit->blocks[1]->parameters().front().is_meta()) << what;
    on_demand.load_blocks();
    expect_same(old, on_demand.dit, what + " on demand");
  }
  // Streamed from blocks read on demand = streamed from the whole model, from published weights and from a
  // Wan weights file.
  auto model = megaslide::wan_model_from_config(fixture_config(), "test");
  megaslide::io::NamedTensors params;
  for (const auto& p : model.dit->named_parameters(true)) params.emplace_back(p.key(), p.value());
  auto run_config = model.config;
  run_config.model.wan.weights.clear();
  const auto weights = join_path(scratch(), "on-demand.safetensors");
  megaslide::save_weights(weights, run_config, params, torch::kFloat32);
  torch::manual_seed(3);
  const auto x = torch::randn({2, 16, 2, 4, 6});
  const auto t = torch::tensor({937.0f, 15.0f});
  const auto text = torch::randn({2, 7, 24});
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    megaslide::StreamedDenoiserOptions so;
    so.compute_dtype = dtype;
    megaslide::StreamedWanDenoiser whole(megaslide::wan_model_from_config(fixture_config(), "test").dit, so);
    megaslide::StreamedWanDenoiser published(megaslide::wan_model_from_config(fixture_config(), "test", true), so);
    megaslide::StreamedWanDenoiser from_file(megaslide::load_wan_model(weights, true), so);
    EXPECT_EQ(published.host_weight_bytes(), whole.host_weight_bytes());
    const auto a = whole.predict(x, t, text);
    EXPECT_TRUE(torch::equal(a, published.predict(x, t, text))) << dtype;
    EXPECT_TRUE(torch::equal(a, from_file.predict(x, t, text))) << dtype;
    // Resident, read block by block onto the device = resident from the whole model.
    megaslide::ResidentWanDenoiser resident_whole(megaslide::wan_model_from_config(fixture_config(), "test").dit,
                                                  torch::kCPU, dtype);
    megaslide::ResidentWanDenoiser resident_on_demand(megaslide::wan_model_from_config(fixture_config(), "test", true),
                                                      torch::kCPU, dtype);
    megaslide::ResidentWanDenoiser resident_from_file(megaslide::load_wan_model(weights, true), torch::kCPU, dtype);
    const auto r = resident_whole.predict(x, t, text);
    EXPECT_TRUE(torch::equal(r, resident_on_demand.predict(x, t, text))) << dtype;
    EXPECT_TRUE(torch::equal(r, resident_from_file.predict(x, t, text))) << dtype;
  }
  // A meta skeleton without its block source is an error, not a silent empty model.
  auto skeleton = megaslide::wan_model_from_config(fixture_config(), "test", true);
  EXPECT_THROW(megaslide::StreamedWanDenoiser(skeleton.dit, megaslide::StreamedDenoiserOptions()), c10::Error);
  EXPECT_THROW(megaslide::ResidentWanDenoiser(skeleton.dit, torch::kCPU), c10::Error);
}

TEST(WanTextToVideo, StreamedEqualsResidentOnTheGpu_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  // On a GPU: CUDA streams and pinned host weights. Equal to the resident denoiser within float rounding
  // (kernels may differ for weights read from the slot's views), and the pipeline's latents match
  // WanPipeline's as on the CPU.
  auto config = fixture_config();
  torch::manual_seed(3);
  const auto x = torch::randn({2, 16, 2, 4, 6});
  const auto t = torch::tensor({937.0f, 15.0f});
  const auto text = torch::randn({2, 7, 24});
  megaslide::ResidentWanDenoiser resident(megaslide::wan_model_from_config(config, "test").dit, torch::kCUDA);
  megaslide::StreamedDenoiserOptions so;
  so.device = torch::kCUDA;
  megaslide::StreamedWanDenoiser streamed(megaslide::wan_model_from_config(config, "test").dit, so);
  EXPECT_LT(max_diff(resident.predict(x, t, text).cpu(), streamed.predict(x, t, text).cpu()), 1e-5);
  const auto& ref = reference();
  auto p = pipeline(
      std::make_shared<megaslide::StreamedWanDenoiser>(megaslide::wan_model_from_config(config, "test").dit, so));
  const auto latents = p->sample({ref.json("prompts")[0].get<std::string>()}, {ref.json("seeds")[0].get<uint64_t>()},
                                 reference_options(megaslide::FlowSamplerKind::kUniPC));
  EXPECT_LT(max_diff(latents.cpu(), ref.tensors.at("unipc.0.latents")), 1e-4);
}

namespace {

using Result = megaslide::testing::ToolResult;
Result run(const std::string& args) { return megaslide::testing::run_tool("megaslide-sample", args); }

std::string write(const std::string& name, const std::string& text) {
  auto p = join_path(scratch(), name);
  megaslide::io::write_file_atomically(p, text);
  return p;
}

const std::string kEncoders = " --text-encoder " + kUmt5 + " --tokenizer " + kTokenizer + " --vae " + kVae;

// The latents megaslide-sample --latents saved beside video `file` ("name.mp4") in `out_dir`.
torch::Tensor saved_latents(const std::string& out_dir, const std::string& file) {
  const std::string stem = file.substr(0, file.size() - 4);
  return megaslide::io::read_safetensors(join_path(join_path(out_dir, "latents"), stem + ".safetensors"))
      .tensors.at(0)
      .second;
}

// The latents umT5 -> flow_sample -> the DiT give, composed here without WanTextToVideo.
torch::Tensor composed_latents(const std::string& prompt, uint64_t seed, int64_t steps) {
  auto model = megaslide::wan_model_from_config(fixture_config(), "test");
  const auto t5 = megaslide::Umt5Encoder::load(kUmt5);
  const auto tok = megaslide::Umt5Tokenizer::from_file(kTokenizer + "/spiece.model");
  auto embed = [&](const std::string& p) {
    auto ids = tok.encode({megaslide::wan_prompt_clean(p)}, 512);
    return t5.embed(ids.ids, ids.mask);
  };
  megaslide::Conditioning cond{embed(prompt), {}}, uncond{embed(megaslide::kWanNegativePrompt), {}};
  auto fn = [&](const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text, const torch::Tensor&) {
    return model.dit->forward(x, t, text);
  };
  return megaslide::flow_sample(fn, megaslide::FlowSamplerOptions().steps(steps).shift(5.0).guidance_scale(5.0),
                                {16, 2, 4, 6}, {seed}, cond, uncond, torch::kCPU)[0];
}

}  // namespace

TEST(MegaslideSampleWan, WritesPlayableVBenchVideosWhoseLatentsAreTheComposedPipelines) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto config = write("wan.yaml", config_yaml(kTransformer));
  const auto prompts = write("prompts.txt", "a red blob moves left quickly\ncats &amp; dogs on the beach\n");
  const auto out = join_path(scratch(), "config-run");
  const std::string common =
      " --prompts " + prompts + " --samples-per-prompt 2 --steps 3 --no-progress --compute-dtype fp32 --latents";
  auto r = run("--config " + config + kEncoders + common + " --batch-size 3 --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;

  const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json")));
  ASSERT_EQ(index.at("videos").size(), 4u);
  EXPECT_EQ(index.at("sampler"), "unipc");
  EXPECT_EQ(index.at("steps"), 3);
  EXPECT_EQ(index.at("guidance_scale"), 5.0);
  EXPECT_EQ(index.at("fps"), 16);
  // The other settings that change the videos are recorded too.
  EXPECT_EQ(index.at("compute_dtype"), "fp32");
  EXPECT_EQ(index.at("device"), "cpu");
  EXPECT_EQ(index.at("crf"), 17);
  EXPECT_TRUE(index.at("shift").is_number()) << index.dump();
  EXPECT_TRUE(index.at("negative_prompt").is_string()) << index.dump();
  EXPECT_FALSE(index.contains("lora"));
  for (const auto& v : index.at("videos")) {
    const std::string file = v.at("file");
    megaslide::io::VideoInfo info;
    const auto frames = megaslide::io::read_video(join_path(join_path(out, "videos"), file), &info);
    EXPECT_EQ(frames.sizes(), (std::vector<int64_t>{5, 32, 48, 3})) << file;  // 1 + 4·(2 − 1) frames of 8·4 x 8·6
    EXPECT_EQ(info.codec, "h264");
    // The latents before the VAE equal umT5 -> flow_sample -> the DiT for this prompt and seed.
    const auto latents = saved_latents(out, file);
    const auto composed = composed_latents(v.at("prompt"), v.at("seed").get<uint64_t>(), 3);
    EXPECT_LT(max_diff(latents, composed), 1e-4) << file;
  }

  // Deterministic per seed: a rerun (another batch size, blocks streamed) writes the same videos and latents.
  const auto again = join_path(scratch(), "config-run-again");
  r = run("--config " + config + kEncoders + common + " --batch-size 1 --streamed on --out " + again);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("blocks streamed"), std::string::npos) << r.output;
  for (const auto& v : index.at("videos")) {
    const std::string file = v.at("file");
    auto latents = [&](const std::string& dir) { return saved_latents(dir, file); };
    EXPECT_LT(max_diff(latents(out), latents(again)), 1e-4) << file;
  }

  // A Wan run's weights file (what its checkpoints hold) samples the same model: the same latents.
  auto model = megaslide::wan_model_from_config(fixture_config(), "test");
  megaslide::io::NamedTensors params;
  for (const auto& p : model.dit->named_parameters(true)) params.emplace_back(p.key(), p.value());
  auto run_config = model.config;
  run_config.model.wan.weights.clear();
  const auto weights = join_path(scratch(), "wan.safetensors");
  megaslide::save_weights(weights, run_config, params, torch::kFloat32);
  ASSERT_TRUE(megaslide::is_wan_weights_file(weights));
  const auto from_checkpoint = join_path(scratch(), "checkpoint-run");
  r = run("--checkpoint " + weights + kEncoders + common + " --batch-size 3 --out " + from_checkpoint);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const auto& v : index.at("videos")) {
    const std::string file = v.at("file");
    auto latents = [&](const std::string& dir) { return saved_latents(dir, file); };
    EXPECT_LT(max_diff(latents(out), latents(from_checkpoint)), 1e-4) << file;
    EXPECT_EQ(megaslide::io::read_video(join_path(join_path(from_checkpoint, "videos"), file)).size(0), 5) << file;
  }
}

// The property: a run whose model.wan.weights is a diffusers repository takes umT5 and the Wan VAE from its
// text_encoder/ and vae/ (the VAE's latent channels and downscale from its config.json) when it needs them —
// validation videos, megaslide-cache over videos — and names none itself, as megaslide-sample does; the resolved
// config passes validation's check without the keys. A run that needs neither, or names its own, is left as it is.
TEST(WanRepository, TrainingAndCachingTakeTheEncodersSamplingFinds) {
  const std::string repo = join_path(scratch(), "repository");
  megaslide::io::make_directories(repo);
  for (const auto& [link, target] : std::vector<std::pair<std::string, std::string>>{
           {"transformer", kTransformer}, {"text_encoder", kUmt5}, {"tokenizer", kTokenizer}, {"vae", kVae}})
    ASSERT_EQ(::symlink(target.c_str(), join_path(repo, link).c_str()), 0) << link;
  const auto config = [&](const std::vector<std::string>& overrides) {
    return megaslide::parse_run_config(config_yaml(repo), "test config", overrides);
  };
  const auto validating = megaslide::with_wan_architecture_from_weights(config({"train.sample_every=5"}));
  EXPECT_EQ(validating.model.text_encoder.kind, "umt5");
  EXPECT_EQ(validating.model.text_encoder.weights, join_path(repo, "text_encoder"));
  EXPECT_EQ(validating.model.vae.kind, "wan");
  EXPECT_EQ(validating.model.vae.weights, join_path(repo, "vae"));
  EXPECT_EQ(validating.model.vae.latent_channels, 16);
  EXPECT_EQ(validating.model.vae.downscale, 8);
  EXPECT_NO_THROW(megaslide::check_wan_validation_config(validating, "test config"));
  // Without the repository's encoders the same run is refused, naming the key.
  EXPECT_THROW(megaslide::check_wan_validation_config(config({"train.sample_every=5"}), "test config"),
               megaslide::ConfigError);

  auto caching = config({});
  caching.data.dataset = "videos";
  std::vector<std::string> taken;
  caching = megaslide::with_wan_repository_encoders(caching, &taken);
  EXPECT_EQ(caching.model.text_encoder.kind, "umt5");
  EXPECT_EQ(caching.model.vae.kind, "wan");
  ASSERT_EQ(taken.size(), 2u);
  EXPECT_NE(taken[1].find("16 latent channels, downscale 8"), std::string::npos) << taken[1];

  const auto unneeded = megaslide::with_wan_architecture_from_weights(config({}));
  EXPECT_EQ(unneeded.model.text_encoder.kind, "builtin") << "latent tensors without validation need no umT5";
  EXPECT_EQ(unneeded.model.vae.kind, "none");
  const auto own = megaslide::with_wan_architecture_from_weights(
      config({"train.sample_every=5", "model.text_encoder.kind=umt5", "model.text_encoder.weights=/elsewhere/t5"}));
  EXPECT_EQ(own.model.text_encoder.weights, "/elsewhere/t5") << "the config's own encoder is kept";
  EXPECT_EQ(own.model.vae.weights, join_path(repo, "vae"));
}

TEST(MegaslideSampleWan, BadPathsAreOneLineErrorsWithExitCode2AndWriteNothing) {
  const auto config = write("wan-bad.yaml", config_yaml(kTransformer));
  const auto prompts = write("prompts-bad.txt", "a prompt\n");
  const auto out = join_path(scratch(), "never");
  auto expect_refused = [&](const std::string& args, const std::string& names) {
    auto r = run("--config " + config + " --prompts " + prompts + " --out " + out + " --no-progress " + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(names), std::string::npos) << args << "\n" << r.output;
    EXPECT_FALSE(megaslide::io::path_exists(out)) << args;
  };
  expect_refused("--tokenizer " + kTokenizer + " --vae " + kVae, "--text-encoder: Wan sampling needs umT5");
  expect_refused("--text-encoder /nonexistent/t5" + std::string(" --vae ") + kVae,
                 "--text-encoder: '/nonexistent/t5' does not exist");
  expect_refused("--text-encoder " + kUmt5 + " --tokenizer " + kTokenizer + " --vae " + kFixtures + "umt5/hf",
                 "--vae: ");
  expect_refused(kEncoders + " --sampler ddim", "Wan samples with flow matching");
  expect_refused(kEncoders + " --set model.wan.weights=/nonexistent/wan", "model.wan.weights");
  expect_refused(kEncoders + " --guidance-2 3", "--guidance-2: the low-noise expert's guidance scale");
  expect_refused(kEncoders + " --eta 0.5", "--eta is DDIM's");  // was ignored: the same video
  expect_refused(kEncoders + " --lora-scale 0.5", "no --lora was given");
  expect_refused(kEncoders + " --shift 0", "--shift: expected a number > 0, got 0");  // failed after --out existed
  // A Wan DiT's weights file (diffusers', as a Wan run's --export-weights writes, or ComfyUI's) has no run config:
  // --checkpoint says how to sample it (it said the file's format was not megaslide.weights, or with Wan's flags
  // that the file "is not one").
  // The folder of diffusers' layout too; and without --text-encoder, --tokenizer and --vae it says they are needed.
  for (const std::string file :
       {kTransformer + "/diffusion_pytorch_model.safetensors", kTransformer, kFixtures + "wan/a/comfyui.safetensors"}) {
    auto r = run("--checkpoint " + file + " --prompts " + prompts + " --out " + out + " --no-progress" + kEncoders);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("is a Wan DiT's weights"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("from --text-encoder, --tokenizer and --vae unless the config names them"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("--config RUN.yaml --set model.wan.weights=" + file), std::string::npos) << r.output;
    EXPECT_FALSE(megaslide::io::path_exists(out));
  }
}

// The property: a prompt long enough that its video's name is at the layout's cap (240 bytes) still gets its latents
// file (the name's extension 8 bytes longer than ".mp4" once made the temporary file's name too long: the run failed
// after sampling, leaving a video no index listed), and every video's latents file is named before any work.
TEST(MegaslideSampleWan, LatentsOfALongPromptAreWrittenBesideItsVideo) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto config = write("wan-long.yaml", config_yaml(kTransformer));
  const std::string prompt = "a red blob moves left " + std::string(400, 'x');
  const auto prompts = write("prompts-long.txt", prompt + "\n");
  const auto out = join_path(scratch(), "long-run");
  auto r = run("--config " + config + kEncoders + " --prompts " + prompts +
               " --samples-per-prompt 1 --steps 1 --no-progress --compute-dtype fp32 --latents --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json")));
  ASSERT_EQ(index.at("videos").size(), 1u);
  const std::string video = index.at("videos")[0].at("file");
  EXPECT_EQ(video.size(), megaslide::io::kMaxFileNameBytes);
  const auto latents = megaslide::io::list_files(join_path(out, "latents"), "safetensors");
  ASSERT_EQ(latents.size(), 1u);
  EXPECT_LE(latents[0].size(), megaslide::io::kMaxFileNameBytes);
  EXPECT_EQ(megaslide::io::read_safetensors(join_path(join_path(out, "latents"), latents[0])).metadata.at("prompt"),
            prompt);
}

// Wan2.2's two experts (tests/fixtures/wan22_experts/, tools/make_fixtures.py wan22_experts: two tiny random
// experts in diffusers' layout, model_index.json with boundary_ratio 0.875, WanPipeline with transformer_2).
namespace {

const std::string kExperts = kFixtures + "wan22_experts";

// A run config of the experts' data sizes; the architecture, the second expert and the boundary come from
// the weights.
megaslide::RunConfig experts_config(const std::string& weights, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets{"model.arch=wan",
                                "model.wan.weights=" + weights,
                                "data.dataset=latent-tensors",
                                "data.channels=16",
                                "data.frames=2",
                                "data.height=4",
                                "data.width=6",
                                "data.max_text_tokens=512",
                                "diffusion.objective=flow",
                                "offload.enabled=false"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return megaslide::parse_run_config("", "test", sets);
}

Reference experts_reference() {
  auto f = megaslide::io::read_safetensors(kExperts + "/reference.safetensors");
  Reference out;
  for (auto& [k, v] : f.tensors) out.tensors[k] = v;
  out.meta = f.metadata;
  return out;
}

}  // namespace

// The property: the two-expert model from diffusers' Wan2.2 layout samples WanPipeline's latents within 1e-4
// (fp32; UniPC and Euler, each expert with its guidance scale, the switch at boundary_ratio x 1000 inside
// the schedule), resident and streamed; the same model with boundary_ratio 0 samples the high-noise expert
// alone (and that differs from the two experts' by far more: the second expert is really used).
TEST(Wan22Experts, TwoExpertPipelineEqualsWanPipelineForUniPCAndEuler) {
  const auto ref = experts_reference();
  const auto s = ref.json("sampling");
  for (const auto stream : {megaslide::StreamChoice::kOff, megaslide::StreamChoice::kOn}) {
    SCOPED_TRACE(stream == megaslide::StreamChoice::kOn ? "streamed" : "resident");
    auto model = megaslide::wan_model_from_config(experts_config(kExperts), "test", /*blocks_on_demand=*/true);
    ASSERT_TRUE(model.low_noise);
    EXPECT_EQ(model.config.model.wan.boundary_ratio, s.at("boundary_ratio").get<double>());
    EXPECT_EQ(model.config.model.wan.heads, 3) << "the architecture from the experts' config.json";
    megaslide::WanPipelineRequest request;
    request.text_encoder = kUmt5;
    request.tokenizer = kTokenizer;
    request.vae = kVae;
    request.stream = stream;
    const auto options = megaslide::WanSampleOptions::from_config(model.config);
    auto opened = megaslide::open_wan_pipeline(std::move(model), request);
    EXPECT_EQ(opened.dit_streamed, stream == megaslide::StreamChoice::kOn);
    for (auto [kind, name] : {std::pair{megaslide::FlowSamplerKind::kUniPC, "unipc"},
                              std::pair{megaslide::FlowSamplerKind::kEuler, "euler"}}) {
      auto o = options;
      o.kind(kind)
          .steps(s.at("steps").get<int64_t>())
          .shift(s.at("shift").get<double>())
          .guidance_scale(s.at("guidance_scale").get<double>())
          .guidance_scale_2(s.at("guidance_scale_2").get<double>())
          .negative_prompt(ref.meta.at("negative_prompt"));
      EXPECT_EQ(o.boundary_ratio(), 0.875);
      const uint64_t seed = std::stoull(ref.meta.at("seed"));
      const auto latents = opened.pipeline->sample({ref.meta.at("prompt")}, {seed}, o);
      const auto& expected = ref.tensors.at(std::string(name) + ".latents");
      EXPECT_LT(max_diff(latents, expected), 1e-4) << name;
      const auto high_only = opened.pipeline->sample({ref.meta.at("prompt")}, {seed}, o.boundary_ratio(0.0));
      EXPECT_LT(max_diff(high_only, ref.tensors.at(std::string(name) + ".high_only.latents")), 1e-4) << name;
      EXPECT_GT(max_diff(high_only, expected), 0.1) << name;
    }
  }
}

// The property: Wan2.2's layouts users download load to identical tensors — diffusers' repository
// (transformer/, transformer_2/, model_index.json), Wan-AI's (high_noise_model/, low_noise_model/ with the
// original names and Wan's config.json; the boundary is Wan-AI's 0.875 for text-to-video) and ComfyUI's two
// single files (original names under model.diffusion_model., named by model.wan.weights and weights_2; the
// heads given) — and what a config cannot mean is refused naming its key.
TEST(Wan22Experts, TheThreeLayoutsLoadTheSameTensors) {
  const auto dir = join_path(scratch(), "wan22-layouts");
  const auto wan_ai = join_path(dir, "Wan2.2-T2V-A14B");
  const nlohmann::json original_config = {{"_class_name", "WanModel"},
                                          {"model_type", "t2v"},
                                          {"dim", 24},
                                          {"ffn_dim", 40},
                                          {"freq_dim", 16},
                                          {"in_dim", 16},
                                          {"out_dim", 16},
                                          {"num_heads", 3},
                                          {"num_layers", 3},
                                          {"text_dim", 24},
                                          {"eps", 1e-6},
                                          {"patch_size", {1, 2, 2}},
                                          {"qk_norm", true},
                                          {"cross_attn_norm", true}};
  std::vector<std::string> comfy;
  for (const auto& [expert, folder] :
       {std::pair{"transformer", "high_noise_model"}, {"transformer_2", "low_noise_model"}}) {
    const auto tensors =
        megaslide::io::read_safetensors(join_path(join_path(kExperts, expert), "diffusion_pytorch_model.safetensors"))
            .tensors;
    megaslide::io::NamedTensors original, prefixed;
    for (const auto& [name, t] : tensors) {
      const std::string o = megaslide::wan_original_name(name);
      ASSERT_FALSE(o.empty()) << name;
      original.emplace_back(o, t);
      prefixed.emplace_back("model.diffusion_model." + o, t.to(torch::kBFloat16).to(torch::kFloat32));
    }
    megaslide::io::make_directories(join_path(wan_ai, folder));
    megaslide::io::write_safetensors(join_path(join_path(wan_ai, folder), "diffusion_pytorch_model.safetensors"),
                                     original);
    megaslide::io::write_file_atomically(join_path(join_path(wan_ai, folder), "config.json"), original_config.dump(2));
    comfy.push_back(
        join_path(dir, std::string("wan2.2_t2v_") + (comfy.empty() ? "high" : "low") + "_noise.safetensors"));
    megaslide::io::write_safetensors(comfy.back(), prefixed);
  }
  auto params = [](const megaslide::WanModel& m) {
    std::map<std::string, torch::Tensor> out;
    for (const auto& p : m.dit->named_parameters(true)) out["high." + p.key()] = p.value();
    for (const auto& p : m.low_noise->dit->named_parameters(true)) out["low." + p.key()] = p.value();
    return out;
  };
  const auto diffusers = megaslide::wan_model_from_config(experts_config(kExperts), "test");
  const auto from_wan_ai = megaslide::wan_model_from_config(experts_config(wan_ai), "test");
  const auto from_comfy = megaslide::wan_model_from_config(
      experts_config(comfy[0], {"model.wan.weights_2=" + comfy[1], "model.wan.dim=24", "model.wan.heads=3"}), "test");
  EXPECT_EQ(from_wan_ai.config.model.wan.weights_2, join_path(wan_ai, "low_noise_model"));
  EXPECT_EQ(from_wan_ai.config.model.wan.boundary_ratio, 0.875);
  EXPECT_EQ(from_comfy.config.model.wan.boundary_ratio, 0.875);
  const auto a = params(diffusers), b = params(from_wan_ai), c = params(from_comfy);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.size(), c.size());
  for (const auto& [name, t] : a) {
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
    EXPECT_TRUE(torch::equal(t.to(torch::kBFloat16).to(torch::kFloat32), c.at(name))) << name;  // ComfyUI's in bf16
  }
  EXPECT_FALSE(torch::equal(a.at("high.proj_out.weight"), a.at("low.proj_out.weight"))) << "two different experts";

  auto refused = [](const megaslide::RunConfig& config, const std::string& key, const std::string& needle) {
    try {
      megaslide::wan_model_from_config(config, "test");
      ADD_FAILURE() << "accepted " << key;
    } catch (const megaslide::ConfigError& e) {
      EXPECT_EQ(e.key(), key) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const auto one = join_path(kExperts, "transformer");
  refused(experts_config(one, {"model.wan.boundary_ratio=0.9"}), "model.wan.boundary_ratio", "the weights are one DiT");
  refused(experts_config(one, {"diffusion.guidance_scale_2=3"}), "diffusion.guidance_scale_2",
          "the weights are one DiT");
  refused(experts_config(kExperts, {"model.wan.weights_2=" + kFixtures + "wan_pipeline/transformer"}),
          "model.wan.weights_2", "is not the high-noise expert's architecture");
  megaslide::io::remove_tree(dir);
}

// The property: settings of a second expert given to one DiT — a randomly initialised Wan (no weights) or
// the DiT family — are ConfigErrors naming the key when the config loads; megaslide-train --dry-run refuses
// a two-expert model that does not say which expert it trains, as training does.
TEST(Wan22Experts, SecondExpertSettingsWithoutTwoExpertsAreRefused) {
  auto refused = [](std::vector<std::string> sets, const std::string& key) {
    if (sets[0] == "model.arch=wan") sets.insert(sets.end(), {"data.dataset=latent-tensors", "data.channels=16"});
    try {
      megaslide::parse_run_config("", "test", sets);
      ADD_FAILURE() << "accepted " << key;
    } catch (const megaslide::ConfigError& e) {
      EXPECT_EQ(e.key(), key) << e.what();
    }
  };
  refused({"model.arch=wan", "model.wan.boundary_ratio=0.875"}, "model.wan.boundary_ratio");
  refused({"model.arch=wan", "diffusion.guidance_scale_2=3"}, "diffusion.guidance_scale_2");
  refused({"model.arch=wan", "model.wan.weights_2=/somewhere"}, "model.wan.weights_2");
  refused({"model.arch=megaslide", "diffusion.guidance_scale_2=3"}, "diffusion.guidance_scale_2");
  refused({"model.arch=wan", "model.wan.weights=" + kExperts, "diffusion.guidance_scale_2=-0.5"},
          "diffusion.guidance_scale_2");
  try {
    megaslide::dry_run_json(experts_config(kExperts));
    ADD_FAILURE() << "a dry run of two experts was accepted";
  } catch (const megaslide::ConfigError& e) {
    EXPECT_EQ(e.key(), "model.wan.expert") << e.what();
  }
}

// The property: megaslide-sample's index.json of two experts records the switch and the low-noise
// expert's guidance scale beside the first (a single DiT's records neither).
TEST(Wan22Experts, MegaslideSampleRecordsBothGuidanceScales) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto config = write("experts.yaml", config_yaml(kExperts));
  const auto prompts = write("experts-prompts.txt", "a red blob moves left quickly\n");
  const auto out = join_path(scratch(), "experts-run");
  auto r =
      run("--config " + config + kEncoders + " --prompts " + prompts +
          " --samples-per-prompt 1 --steps 2 --guidance 4 --guidance-2 2.5 --no-progress --compute-dtype fp32 --out " +
          out);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(out, "index.json")));
  EXPECT_EQ(index.at("guidance_scale"), 4.0);
  EXPECT_EQ(index.at("guidance_scale_2"), 2.5);
  EXPECT_EQ(index.at("boundary_ratio"), 0.875);
  EXPECT_EQ(index.at("videos").size(), 1u);
  // The two text-to-video experts start from no image: --image is refused naming it (exit 2), nothing written.
  const auto image = join_path(scratch(), "experts-image.png");
  megaslide::io::write_png(image, torch::zeros({32, 32, 3}, torch::kUInt8));
  const auto refused = join_path(scratch(), "experts-image");
  r = run("--config " + config + kEncoders + " --prompts " + prompts +
          " --samples-per-prompt 1 --steps 2 --no-progress --compute-dtype fp32 --image " + image + " --out " +
          refused);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--image: "), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(join_path(refused, "videos"))) << "nothing written";
}

namespace {
// A run's weights file (`name` in the scratch folder) of the published experts: both trained together ("both":
// transformer.*, transformer_2.*) or the high-noise one alone ("high"), under a run config that names no weights.
std::string experts_run_weights(const std::string& expert, const std::string& name) {
  const auto resolved = megaslide::with_wan_architecture_from_weights(experts_config(kExperts));
  auto pair = megaslide::wan_model_from_config(resolved, "test");
  EXPECT_TRUE(pair.low_noise);
  const std::string prefix = expert == "both" ? "transformer." : "";
  megaslide::io::NamedTensors params;
  for (const auto& p : pair.dit->named_parameters(true)) params.emplace_back(prefix + p.key(), p.value());
  if (expert == "both")
    for (const auto& p : pair.low_noise->dit->named_parameters(true))
      params.emplace_back("transformer_2." + p.key(), p.value());
  auto run_config = resolved;
  run_config.model.wan.weights.clear();
  run_config.model.wan.weights_2.clear();
  run_config.model.wan.expert = expert;
  const auto weights = join_path(scratch(), name);
  megaslide::save_weights(weights, run_config, params, torch::kFloat32);
  return weights;
}

// The flags the expert tests sample `prompts` with (6 steps, the latents kept), up to --out's value.
std::string expert_sampling_flags(const std::string& prompts) {
  return kEncoders + " --prompts " + prompts +
         " --samples-per-prompt 1 --steps 6 --shift 5 --guidance 1 --latents --no-progress --compute-dtype fp32 --out ";
}
}  // namespace

// The property: the weights file of a run that trained both experts (model.wan.expert both: the high-noise
// expert's tensors "dit.transformer.*", the low-noise one's "dit.transformer_2.*") samples with megaslide-sample
// --checkpoint as the pair: the latents of the same two experts sampled from their repository (--config).
TEST(Wan22Experts, ABothExpertsRunsWeightsFileSamplesAsThePair) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto weights = experts_run_weights("both", "both-experts.safetensors");
  const auto config = write("both-experts.yaml", config_yaml(kExperts));
  const std::string common =
      expert_sampling_flags(write("both-experts-prompts.txt", "a red blob moves left quickly\n"));
  const auto published = join_path(scratch(), "both-published"), trained = join_path(scratch(), "both-run");
  auto r = run("--config " + config + common + published);
  ASSERT_EQ(r.code, 0) << r.output;
  r = run("--checkpoint " + weights + common + trained);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(trained, "index.json")));
  EXPECT_EQ(index.at("boundary_ratio"), 0.875);
  for (const auto& v : index.at("videos")) {
    const std::string file = v.at("file");
    auto latents = [&](const std::string& dir) { return saved_latents(dir, file); };
    EXPECT_LT(max_diff(latents(published), latents(trained)), 1e-5) << file;
  }
}

// The property: a run that fine-tuned one of Wan2.2's experts and names no partner (its model.wan.weights_2 empty) is
// not sampled alone for every timestep (exit 2 naming --expert-2); with --expert-2 naming the other expert it samples
// as the published pair (latents within 1e-5), the boundary recorded. --config of one expert without
// model.wan.weights_2 is refused alike.
TEST(Wan22Experts, ALoneExpertIsSampledOnlyWithItsPartner) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto weights = experts_run_weights("high", "high-alone.safetensors");
  const auto config = write("lone-expert.yaml", config_yaml(kExperts));
  const std::string common = expert_sampling_flags(write("lone-expert-prompts.txt", "a red blob moves left quickly\n"));
  const auto published = join_path(scratch(), "lone-published"), trained = join_path(scratch(), "lone-run");
  auto r = run("--checkpoint " + weights + common + trained);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("high-noise expert alone"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--expert-2 FILE"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(trained));
  r = run("--config " + config + " --set model.wan.weights=" + kExperts + "/transformer --set model.wan.expert=high" +
          common + trained);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("set model.wan.weights_2"), std::string::npos) << r.output;

  r = run("--config " + config + common + published);
  ASSERT_EQ(r.code, 0) << r.output;
  r = run("--checkpoint " + weights + " --expert-2 " + kExperts + "/transformer_2" + common + trained);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("sampling it with the other one"), std::string::npos) << r.output;
  const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(trained, "index.json")));
  EXPECT_EQ(index.at("boundary_ratio"), 0.875);
  // The two-expert repository as --expert-2: its other expert, the low-noise one, is the partner.
  const auto from_repository = join_path(scratch(), "lone-run-repository");
  r = run("--checkpoint " + weights + " --expert-2 " + kExperts + common + from_repository);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const auto& v : index.at("videos")) {
    const std::string file = v.at("file");
    EXPECT_LT(max_diff(saved_latents(published, file), saved_latents(trained, file)), 1e-5) << file;
    EXPECT_TRUE(torch::equal(saved_latents(trained, file), saved_latents(from_repository, file))) << file;
  }
  // index.json records both experts' files and the encoders', which --resume compares: another partner is refused.
  ASSERT_EQ(index.at("experts").size(), 2u);
  EXPECT_EQ(index.at("experts")[1], megaslide::io::absolute_path(kExperts + "/transformer_2"));
  EXPECT_EQ(index.at("encoders").at("vae"), megaslide::io::absolute_path(kVae));
  r = run("--checkpoint " + weights + " --expert-2 " + kExperts + "/transformer" + common + trained + " --resume");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("experts: "), std::string::npos) << r.output;
  r = run("--checkpoint " + weights + " --expert-2 " + kExperts + common + trained + " --resume");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("kept 1 of 1 video already in"), std::string::npos) << r.output;
}

namespace {
// A denoiser that notes, at each prediction, whether its partner was parked.
class PartnerWatchingDenoiser final : public megaslide::WanDenoiser {
 public:
  using WanDenoiser::predict;
  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor&, const torch::Tensor&,
                        const torch::Tensor&) override {
    parked = false;
    ++predictions;
    partner_parked_each_time = partner_parked_each_time && partner->parked;
    return torch::zeros_like(x);
  }
  torch::Device device() const override { return torch::kCPU; }
  void park() override {
    parked = true;
    ++parks;
  }
  PartnerWatchingDenoiser* partner = nullptr;
  bool parked = false, partner_parked_each_time = true;
  int predictions = 0, parks = 0;
};
}  // namespace

// The property: with park_inactive, whenever one expert predicts the other is parked (off the device), over
// a schedule that crosses the boundary; without it nothing is parked; a resident denoiser on the CPU has
// nothing to park.
TEST(Wan22Experts, TheInactiveExpertIsParkedWhileTheOtherPredicts) {
  for (const bool park : {true, false}) {
    auto high = std::make_shared<PartnerWatchingDenoiser>(), low = std::make_shared<PartnerWatchingDenoiser>();
    high->partner = low.get();
    low->partner = high.get();
    megaslide::WanExpertsDenoiser experts(high, low, 0.875, park);
    const auto x = torch::zeros({1, 16, 1, 2, 2}), text = torch::zeros({1, 3, 24});
    for (const double t : {999.0, 950.0, 875.0, 874.0, 500.0, 20.0})
      experts.predict(x, torch::full({1}, t, torch::kFloat32), text);
    EXPECT_EQ(high->predictions, 3);
    EXPECT_EQ(low->predictions, 3);
    EXPECT_EQ(high->partner_parked_each_time && low->partner_parked_each_time, park);
    if (!park) EXPECT_EQ(high->parks + low->parks, 0);
  }
  auto model = megaslide::wan_model_from_config(experts_config(kExperts), "test");
  megaslide::ResidentWanDenoiser resident(model.dit, torch::kCPU);
  resident.park();
  EXPECT_FALSE(resident.parked());
}

// The property: megaslide-sample --image (Wan2.2 TI2V's image-to-video) starts every video from the image: the
// saved latents' first frame is the VAE's latent of the image file as read back; an image of another size
// than the videos' is resized to theirs, and stderr says so (tests/test_megaslide_sample.cpp checks how).
TEST(MegaslideSampleWan, ImageToVideoStartsFromTheImage) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const std::string dir = kFixtures + "ti2v_pipeline";
  const auto config = write("ti2v.yaml", "model:\n  arch: wan\n  wan: {weights: " + dir +
                                             "/transformer, in_channels: 8, out_channels: 8}\n  vae: {downscale: 16}\n"
                                             "data: {dataset: latent-tensors, channels: 8, frames: 3, height: 4, "
                                             "width: 6, max_text_tokens: 512}\n"
                                             "diffusion: {objective: flow, shift: 5.0, guidance_scale: 5.0}\n");
  const auto pixels = megaslide::io::read_safetensors(dir + "/reference.safetensors").tensors;
  torch::Tensor image;
  for (const auto& [name, t] : pixels)
    if (name == "image") image = t;
  ASSERT_TRUE(image.defined());
  const auto rgb = ((image + 1) * 127.5).round().clamp(0, 255).to(torch::kUInt8).permute({1, 2, 0}).contiguous();
  const auto png = join_path(scratch(), "first.png");
  megaslide::io::write_png(png, rgb);
  const auto small = join_path(scratch(), "small.png");
  megaslide::io::write_png(small, rgb.narrow(0, 0, 32).narrow(1, 0, 48).contiguous());
  const auto prompts = write("ti2v-prompts.txt", "a red blob moves left quickly\n");
  const std::string common = "--config " + config + " --text-encoder " + kUmt5 + " --tokenizer " + kTokenizer +
                             " --vae " + kFixtures + "wan22_vae/tiny --prompts " + prompts +
                             " --samples-per-prompt 1 --steps 2 --no-progress --compute-dtype fp32 --latents";
  const auto out = join_path(scratch(), "ti2v-run");
  auto r = run(common + " --image " + png + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto files = megaslide::io::list_files(join_path(out, "latents"), "safetensors");
  ASSERT_EQ(files.size(), 1u);
  const auto latents =
      megaslide::io::read_safetensors(join_path(join_path(out, "latents"), files[0])).tensors.at(0).second;
  const auto read_back = megaslide::io::read_video(png)[0].permute({2, 0, 1}).to(torch::kFloat32) / 127.5 - 1.0;
  const auto vae = megaslide::WanVae::load(kFixtures + "wan22_vae/tiny");
  const auto first = vae.encode(read_back.view({1, 3, 1, 64, 96}));
  EXPECT_LT(max_diff(latents.narrow(1, 0, 1), first[0]), 1e-5);

  r = run(common + " --image " + small + " --out " + join_path(scratch(), "ti2v-small"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resized from 48x32 to 96x64"), std::string::npos) << r.output;
}

// The property: megaslide-sample --lora FILE --lora-scale S samples the DiT with the LoRA merged: the same latents
// (within 1e-5) as a weights file holding the base with S x the adapters' update added (here in musubi-tuner's
// layout, with adapters on block linears and on a prologue linear); a file that is not this model's LoRA and
// --lora-2 for one DiT exit 2 naming the flag.
TEST(MegaslideSampleWan, LoraSamplesAsTheWeightsWithItsUpdateMerged) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  auto model = megaslide::wan_model_from_config(fixture_config(), "test");
  megaslide::WanLora lora;
  torch::manual_seed(17);
  for (const auto& [weight, shape] :
       std::vector<std::pair<std::string, std::vector<int64_t>>>{{"blocks.0.attn1.to_q.weight", {16, 16}},
                                                                 {"blocks.1.ffn.net.2.weight", {16, 32}},
                                                                 {"condition_embedder.time_proj.weight", {96, 16}}}) {
    megaslide::LoraAdapter a;
    a.down = 0.3 * torch::randn({2, shape[1]});
    a.up = 0.3 * torch::randn({shape[0], 2});
    a.alpha = 3.0;
    lora.adapters[weight] = a;
  }
  const auto lora_file = join_path(scratch(), "adapter.safetensors");
  megaslide::save_wan_lora(lora_file, lora, megaslide::LoraLayout::kMusubi);
  lora.source = lora_file;
  EXPECT_EQ(megaslide::merge_wan_lora(*model.dit, lora, 0.5), 3);
  megaslide::io::NamedTensors params;
  for (const auto& p : model.dit->named_parameters(true)) params.emplace_back(p.key(), p.value());
  auto run_config = model.config;
  run_config.model.wan.weights.clear();
  const auto merged = join_path(scratch(), "merged.safetensors");
  megaslide::save_weights(merged, run_config, params, torch::kFloat32);

  const auto config = write("lora.yaml", config_yaml(kTransformer));
  const auto prompts = write("lora-prompts.txt", "a red blob moves left quickly\n");
  const std::string common = kEncoders + " --prompts " + prompts +
                             " --samples-per-prompt 1 --steps 2 --no-progress --compute-dtype fp32 --latents";
  const auto with_lora = join_path(scratch(), "with-lora"), from_merged = join_path(scratch(), "from-merged");
  auto r = run("--config " + config + common + " --lora " + lora_file + " --lora-scale 0.5 --out " + with_lora);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("musubi layout, 3 adapters, rank 2"), std::string::npos) << r.output;
  r = run("--checkpoint " + merged + common + " --out " + from_merged);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(with_lora, "index.json")));
  ASSERT_EQ(index.at("lora").size(), 1u) << index.dump();  // the merged file and its scale are recorded
  EXPECT_EQ(index.at("lora")[0].at("file"), lora_file);
  EXPECT_EQ(index.at("lora")[0].at("scale"), 0.5);
  for (const auto& v : index.at("videos")) {
    const std::string file = v.at("file");
    EXPECT_LT(max_diff(saved_latents(with_lora, file), saved_latents(from_merged, file)), 1e-5) << file;
  }
  r = run("--config " + config + common + " --lora " + config + " --out " + join_path(scratch(), "bad-lora"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--lora"), std::string::npos) << r.output;
  // A folder that holds no LoRA run's checkpoint.
  const auto folder = join_path(scratch(), "not-a-run");
  megaslide::io::make_directories(folder);
  r = run("--config " + config + common + " --lora " + folder + " --out " + join_path(scratch(), "folder-lora"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--lora: '" + folder + "'"), std::string::npos) << r.output;
  r = run("--config " + config + common + " --lora-2 " + lora_file + " --out " + join_path(scratch(), "lora-2"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--lora-2"), std::string::npos) << r.output;
}
