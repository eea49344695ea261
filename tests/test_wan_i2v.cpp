// Image-to-video with the image as conditioning channels (Wan2.1 I2V, Wan2.2 I2V-A14B), against diffusers'
// WanImageToVideoPipeline and WanTransformer3DModel on tiny models (tests/fixtures/i2v_pipeline/ and wan_i2v/,
// tools/make_fixtures.py):
//   - the conditioning (the first-frame mask, the VAE's latents of the image followed by black frames), CLIP's
//     image tokens (Wan2.1 I2V) and the sampled latents of Wan2.1 I2V and of Wan2.2 I2V's two experts equal the
//     pipeline's within 1e-4 (fp32; UniPC and Euler; resident and streamed);
//   - the streamed trainer's gradients of a 12-channel DiT with the image branch are autograd's on diffusers';
//   - training with image conditioning: the streamed trainer equals the resident loop; the batches carry the
//     mask and the image's latents, and image dropout zeroes them (and the image tokens) for the dropped samples;
//   - configs and data that cannot train image-to-video are refused naming the key or tensor.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "megaslide/diffusion/wan_text_to_video.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/video.h"
#include "megaslide/model/wan_weights.h"
#include "trainers.h"

namespace {

using megaslide::RunConfig;
using megaslide::WanLatentData;
using megaslide::testing::wan_trainer;

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";
const std::string kI2v = kFixtures + "i2v_pipeline";
const std::string kUmt5 = kFixtures + "umt5/hf";
const std::string kTokenizer = kFixtures + "umt5/tokenizer";
const std::string kVae = kFixtures + "wan_vae/tiny";

struct Reference {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> meta;
  nlohmann::json sampling() const { return nlohmann::json::parse(meta.at("sampling")); }
};

Reference read_reference(const std::string& path) {
  auto f = megaslide::io::read_safetensors(path);
  Reference out;
  for (auto& [k, v] : f.tensors) out.tensors[k] = v;
  out.meta = f.metadata;
  return out;
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble).cpu() - b.to(torch::kDouble).cpu()).abs().max().item<double>();
}

// A Wan config of the i2v_pipeline fixture's latents (16 x 2 x 4 x 6: 5 frames of 32 x 48) over `weights`.
RunConfig pipeline_config(const std::string& weights) {
  return megaslide::parse_run_config("", "test",
                                     {"model.arch=wan", "model.wan.weights=" + weights, "data.dataset=latent-tensors",
                                      "data.channels=16", "data.frames=2", "data.height=4", "data.width=6",
                                      "data.max_text_tokens=512", "diffusion.objective=flow", "offload.enabled=false"});
}

// The pipeline's other components: the umt5 and wan_vae fixtures.
megaslide::WanPipelineRequest fixture_request(megaslide::StreamChoice stream) {
  megaslide::WanPipelineRequest request;
  request.text_encoder = kUmt5;
  request.tokenizer = kTokenizer;
  request.vae = kVae;
  request.stream = stream;
  return request;
}

}  // namespace

// The property: Wan2.2 I2V-A14B's two 36-channel experts from diffusers' layout (boundary 0.9 from
// model_index.json) give WanImageToVideoPipeline's conditioning (mask, then the VAE's latents of the image and
// black frames) within 1e-5 and its sampled latents within 1e-4, UniPC and Euler, resident and streamed.
TEST(WanImageToVideo, Wan22ExpertsEqualWanImageToVideoPipeline) {
  const auto ref = read_reference(kI2v + "/reference.safetensors");
  const auto s = ref.sampling();
  const auto image = ref.tensors.at("image");  // [32, 48, 3] uint8, the PNG's pixels
  for (const auto stream : {megaslide::StreamChoice::kOff, megaslide::StreamChoice::kOn}) {
    SCOPED_TRACE(stream == megaslide::StreamChoice::kOn ? "streamed" : "resident");
    auto model = megaslide::wan_model_from_config(pipeline_config(kI2v + "/wan22"), "test", /*blocks_on_demand=*/true);
    ASSERT_TRUE(model.low_noise);
    EXPECT_EQ(model.config.model.wan.in_channels, 36);
    EXPECT_TRUE(megaslide::wan_image_to_video(model.config.model.wan));
    EXPECT_EQ(model.config.model.wan.boundary_ratio, 0.9);
    auto request = fixture_request(stream);
    const auto options = megaslide::WanSampleOptions::from_config(model.config);
    auto opened = megaslide::open_wan_pipeline(std::move(model), request);
    const auto fitted = megaslide::io::fit_image(image, 32, 48);
    const auto condition = opened.pipeline->image_condition(fitted, image);
    EXPECT_FALSE(condition.image.defined()) << "Wan2.2 I2V has no image encoder";
    const auto& expected_condition = ref.tensors.at("wan22.condition");
    EXPECT_LT(max_diff(megaslide::wan_image_condition(condition.latents), expected_condition), 1e-5);
    EXPECT_THROW(opened.pipeline->sample({ref.meta.at("prompt")}, {1}, options), std::invalid_argument)
        << "an image-to-video DiT needs its image";
    for (auto [kind, name] : {std::pair{megaslide::FlowSamplerKind::kUniPC, "unipc"},
                              std::pair{megaslide::FlowSamplerKind::kEuler, "euler"}}) {
      auto o = options;
      o.kind(kind)
          .steps(s.at("wan22.steps").get<int64_t>())
          .shift(s.at("shift").get<double>())
          .guidance_scale(s.at("wan22.guidance_scale").get<double>())
          .guidance_scale_2(s.at("wan22.guidance_scale_2").get<double>())
          .negative_prompt(ref.meta.at("negative_prompt"));
      const auto latents = opened.pipeline->sample_image_to_video({ref.meta.at("prompt")},
                                                                  {std::stoull(ref.meta.at("seed"))}, condition, o);
      EXPECT_LT(max_diff(latents, ref.tensors.at(std::string("wan22.") + name + ".latents")), 1e-4) << name;
    }
  }
}

// The property: Wan2.1 I2V's DiT (36 channels, the image branch) with CLIP's image encoder gives
// WanImageToVideoPipeline's image tokens (the PNG through the C++ CLIPImageProcessor and CLIPVisionModel's
// penultimate hidden states) within 1e-5, its conditioning within 1e-5 and its sampled latents within 1e-4, UniPC
// and Euler, resident and streamed; a pipeline without the image encoder cannot make the condition.
TEST(WanImageToVideo, Wan21EqualsWanImageToVideoPipelineWithClipImageTokens) {
  const auto ref = read_reference(kI2v + "/reference.safetensors");
  const auto s = ref.sampling();
  const auto image = ref.tensors.at("image");
  for (const auto stream : {megaslide::StreamChoice::kOff, megaslide::StreamChoice::kOn}) {
    SCOPED_TRACE(stream == megaslide::StreamChoice::kOn ? "streamed" : "resident");
    auto model = megaslide::wan_model_from_config(pipeline_config(kI2v + "/wan21/transformer"), "test");
    EXPECT_EQ(model.config.model.wan.image_dim, 24);
    auto request = fixture_request(stream);
    const auto options = megaslide::WanSampleOptions::from_config(model.config);
    auto without = request;
    EXPECT_THROW(megaslide::open_wan_pipeline(model, without), megaslide::WanPipelineError)
        << "no image encoder: neither given nor in a repository";
    request.image_encoder = kFixtures + "clip_vision/image_encoder";
    auto opened = megaslide::open_wan_pipeline(std::move(model), request);
    ASSERT_TRUE(opened.pipeline->has_image_encoder());
    const auto condition = opened.pipeline->image_condition(megaslide::io::fit_image(image, 32, 48), image);
    ASSERT_TRUE(condition.image.defined());
    EXPECT_LT(max_diff(condition.image, ref.tensors.at("wan21.image_embeds")), 1e-5);
    EXPECT_LT(max_diff(megaslide::wan_image_condition(condition.latents), ref.tensors.at("wan21.condition")), 1e-5);
    for (auto [kind, name] : {std::pair{megaslide::FlowSamplerKind::kUniPC, "unipc"},
                              std::pair{megaslide::FlowSamplerKind::kEuler, "euler"}}) {
      auto o = options;
      o.kind(kind)
          .steps(s.at("wan21.steps").get<int64_t>())
          .shift(s.at("shift").get<double>())
          .guidance_scale(s.at("wan21.guidance_scale").get<double>())
          .negative_prompt(ref.meta.at("negative_prompt"));
      const auto latents = opened.pipeline->sample_image_to_video({ref.meta.at("prompt")},
                                                                  {std::stoull(ref.meta.at("seed"))}, condition, o);
      EXPECT_LT(max_diff(latents, ref.tensors.at(std::string("wan21.") + name + ".latents")), 1e-4) << name;
      // The image tokens take part: without them (zeros) the latents differ.
      auto blank = condition;
      blank.image = torch::zeros_like(condition.image);
      EXPECT_GT(max_diff(opened.pipeline->sample_image_to_video({ref.meta.at("prompt")},
                                                                {std::stoull(ref.meta.at("seed"))}, blank, o),
                         latents),
                1e-3)
          << name;
    }
  }
}

namespace {

// The wan_i2v fixture's sizes: 12 channels in (4 noisy, 4 mask, 4 image latents), 4 out, image_dim 10;
// latents 4 x 3 x 4 x 6, text 7 x 20, 5 image tokens.
RunConfig i2v_config(std::vector<std::string> overrides = {}) {
  const std::string yaml = R"(
model:
  arch: wan
  wan: {dim: 24, layers: 2, heads: 2, ffn_dim: 40, freq_dim: 16, text_dim: 20, patch: [1, 2, 2], in_channels: 12, out_channels: 4, image_dim: 10}
data: {dataset: latent-tensors, channels: 4, frames: 3, height: 4, width: 6, max_text_tokens: 7}
diffusion: {objective: flow, shift: 3.0, caption_dropout: 0.0}
train: {steps: 50, batch_size: 2, lr: 0.002, warmup_steps: 0, lr_schedule: constant, grad_clip: 1.0, device: cpu, seed: 5}
offload: {compute_dtype: fp32, mode: async, emulated_copy_delay_ms: 2}
)";
  return megaslide::parse_run_config(yaml, "test", overrides);
}

WanLatentData i2v_data(int64_t n = 4) {
  WanLatentData d;
  torch::manual_seed(43);
  auto t = torch::arange(3).view({1, 1, 3, 1, 1}).to(torch::kFloat32);
  auto w = torch::arange(6).view({1, 1, 1, 1, 6}).to(torch::kFloat32);
  auto phase = torch::arange(n).view({n, 1, 1, 1, 1}).to(torch::kFloat32);
  d.latents = torch::sin(0.7 * w + 0.3 * t + phase).expand({n, 4, 3, 4, 6}).contiguous();
  d.text = torch::randn({n, 7, 20});
  d.empty_text = torch::zeros({7, 20});
  d.image_latents = d.latents + 0.1 * torch::randn(d.latents.sizes());
  d.image_embeds = torch::randn({n, 5, 10});
  return d;
}

}  // namespace

// The property: the streamed trainer's gradients of one step of a DiT with 12 input channels and the image
// branch (the image tokens reach every streamed block's cross-attention) are PyTorch autograd's on diffusers'
// WanTransformer3DModel for the same input, within 1e-4 of each gradient's scale.
TEST(WanImageToVideo, StreamedGradientsAreAutogradsOnDiffusers) {
  const std::string dir = kFixtures + "wan_i2v";
  const auto r = read_reference(dir + "/reference.safetensors").tensors;
  auto weights = megaslide::WanWeights::open(dir + "/transformer");
  megaslide::WanTransformer model(megaslide::WanOptions::from_config(i2v_config()));
  megaslide::load_wan_weights(weights, *model);
  auto stack = std::make_shared<megaslide::WanStack>(model);
  megaslide::offload::StackTrainerOptions o;
  o.compute_dtype = at::kFloat;
  o.adamw.lr = 0.0;
  megaslide::offload::StreamedStackTrainer engine(stack, o);
  const auto& x = r.at("x");  // [2, 12, 3, 4, 6]: what the fixture's model is given
  megaslide::WanBatch batch;
  batch.xt = x.narrow(1, 0, 4);
  batch.condition = x.narrow(1, 4, 8);
  batch.image = r.at("image");
  batch.timesteps = r.at("timesteps");
  batch.text = r.at("text");
  batch.target = r.at("target");
  const auto result = megaslide::wan_streamed_step(
      engine, model, [&] { return batch; }, /*lr=*/0.0);
  engine.synchronize();
  EXPECT_NEAR(result.loss, r.at("loss").item<double>(), 1e-5 * r.at("loss").item<double>());
  int compared = 0;
  const auto& store = engine.store();
  auto expect_gradient = [&](const std::string& name, const torch::Tensor& grad) {
    const auto& ref = r.at("grad." + name);
    EXPECT_LT((grad - ref).abs().max().item<double>() / std::max(1e-12, ref.abs().max().item<double>()), 1e-4) << name;
    ++compared;
  };
  for (int64_t l = 0; l < store.num_blocks(); ++l)
    for (const auto& spec : store.block_spec(l).params)
      expect_gradient("blocks." + std::to_string(l) + "." + spec.name, store.param(l, spec.name).grad);
  for (auto& [name, p] : stack->named_resident_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    expect_gradient(name, p.grad());
  }
  EXPECT_EQ(static_cast<size_t>(compared), model->parameters().size()) << "every parameter's gradient compared";
}

// The property: with image conditioning, each batch's DiT input is the noisy latents, the first-frame mask
// (1 on latent frame 0 of the 4 mask channels, 0 elsewhere) and the item's image latents, with its image tokens;
// image dropout zeroes the mask, latents and tokens of the dropped samples only (about its probability); and
// the streamed trainer equals the resident loop step after step.
TEST(WanImageToVideo, ConditionedTrainingStreamsAsTheResidentLoop) {
  {
    auto config = i2v_config({"diffusion.image_dropout=0.5", "train.batch_size=4"});
    const auto data = i2v_data();
    megaslide::WanBatchSource source(config, data);
    int64_t dropped = 0, kept = 0;
    for (int step = 0; step < 25; ++step) {
      const auto b = source.next(torch::kCPU);
      ASSERT_EQ(b.condition.sizes(), (std::vector<int64_t>{4, 8, 3, 4, 6}));
      ASSERT_EQ(b.input().size(1), 12);
      for (int64_t i = 0; i < 4; ++i) {
        if (b.condition[i].abs().sum().item<double>() == 0.0) {
          ++dropped;
          EXPECT_EQ(b.image[i].abs().sum().item<double>(), 0.0) << "the image tokens drop with the image";
          continue;
        }
        ++kept;
        const auto mask = b.condition[i].narrow(0, 0, 4);
        EXPECT_TRUE(torch::equal(mask.select(1, 0), torch::ones({4, 4, 6})));
        EXPECT_EQ(mask.narrow(1, 1, 2).abs().sum().item<double>(), 0.0);
        // The item is the one whose latents x0 holds.
        int64_t item = -1;
        for (int64_t k = 0; k < 4; ++k)
          if (torch::equal(data.latents[k], b.x0[i])) item = k;
        ASSERT_GE(item, 0);
        EXPECT_TRUE(torch::equal(b.condition[i].narrow(0, 4, 4), data.image_latents[item]));
        EXPECT_TRUE(torch::equal(b.image[i], data.image_embeds[item]));
      }
    }
    EXPECT_GT(dropped, 25);
    EXPECT_GT(kept, 25);
  }
  for (const auto& extra : std::vector<std::vector<std::string>>{{}, {"diffusion.image_dropout=0.3"}}) {
    auto streamed_config = i2v_config(extra), resident_config = i2v_config(extra);
    resident_config.offload.enabled = false;
    auto streamed = wan_trainer(streamed_config, i2v_data()), resident = wan_trainer(resident_config, i2v_data());
    ASSERT_TRUE(streamed.streams());
    double worst = 0.0;
    for (int s = 0; s < 3; ++s) {
      const auto a = streamed.step(), b = resident.step();
      EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss)) << "step " << s;
      const auto wa = streamed.master_weights(), wb = resident.master_weights();
      ASSERT_EQ(wa.size(), wb.size());
      for (size_t i = 0; i < wa.size(); ++i) worst = std::max(worst, max_diff(wa[i].second, wb[i].second));
    }
    EXPECT_LT(worst, 1e-5);
  }
}

// The property: image dropout draws from the caption dropout's stream, so a resume must keep it: a checkpoint saved
// at diffusion.image_dropout 0.3 is refused at 0.5, naming the key, and loads at 0.3.
TEST(WanImageToVideo, AResumeMustKeepTheImageDropout) {
  const std::string dir = "/tmp/megaslide-test-i2v-dropout-resume-" + std::to_string(::getpid());
  megaslide::io::remove_tree(dir);
  const auto saved_config = i2v_config({"diffusion.image_dropout=0.3"});
  auto trainer = wan_trainer(saved_config, i2v_data());
  trainer.step();
  const std::string path = megaslide::save_checkpoint(dir, saved_config, trainer.training_state());
  auto state = trainer.training_state();
  try {
    megaslide::load_checkpoint(path, i2v_config({"diffusion.image_dropout=0.5"}), state);
    ADD_FAILURE() << "a checkpoint of image_dropout 0.3 loaded at 0.5";
  } catch (const megaslide::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("diffusion.image_dropout"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(megaslide::load_checkpoint(path, saved_config, state));
  megaslide::io::remove_tree(dir);
}

// The property: what cannot train image-to-video is refused, naming the key (config) or the tensor (data).
TEST(WanImageToVideo, ConfigsAndDataThatCannotTrainAreRefused) {
  auto problem = [](std::vector<std::string> sets) -> std::string {
    try {
      i2v_config(std::move(sets));
    } catch (const megaslide::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(problem({"model.wan.in_channels=10"}).find("model.wan.in_channels"), std::string::npos);
  EXPECT_NE(problem({"model.wan.in_channels=4"}).find("model.wan.image_dim"), std::string::npos)
      << "an image branch without the image channels";
  EXPECT_NE(problem({"model.wan.in_channels=4", "model.wan.image_dim=0", "diffusion.image_dropout=0.2"})
                .find("diffusion.image_dropout"),
            std::string::npos);
  EXPECT_NE(problem({"diffusion.first_frame_clean=0.5"}).find("diffusion.first_frame_clean"), std::string::npos);
  EXPECT_NE(problem({"data.channels=12"}).find("data.channels"), std::string::npos);
  EXPECT_EQ(problem({}), "");

  auto refusal = [](RunConfig config, const WanLatentData& data) -> std::string {
    try {
      wan_trainer(std::move(config), data);
    } catch (const megaslide::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  auto no_latents = i2v_data();
  no_latents.image_latents = torch::Tensor();
  EXPECT_NE(refusal(i2v_config(), no_latents).find("image_latents"), std::string::npos);
  auto no_tokens = i2v_data();
  no_tokens.image_embeds = torch::Tensor();
  EXPECT_NE(refusal(i2v_config(), no_tokens).find("image_embeds"), std::string::npos);
  auto wide_tokens = i2v_data();
  wide_tokens.image_embeds = torch::randn({4, 5, 11});
  EXPECT_NE(refusal(i2v_config(), wide_tokens).find("image_embeds"), std::string::npos);
  EXPECT_NE(refusal(i2v_config({"model.wan.in_channels=4", "model.wan.image_dim=0"}), i2v_data()).find("image_latents"),
            std::string::npos)
      << "a text-to-video DiT given image latents";
}
