// The Wan 2.1 VAE against diffusers' AutoencoderKLWan on a tiny random model of non-default sizes
// (tests/fixtures/wan_vae/, tools/make_fixtures.py wan_vae): the latent distribution and decoding of 1, 5 and
// 9 frames (the temporal feature cache across chunks), the per-channel normalisation, diffusers' tiled
// encode and decode on frames that are not a multiple of the tile; the single file with the original Wan
// names (rename table, sizes inferred from shapes); bad folders and files named in the errors; and, when
// MEGASLIDE_WAN_VAE_WEIGHTS points at a download, a round trip through the real VAE.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan_vae.h"

using megaslide::WanVae;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan_vae";
const std::string kTiny = kFixtures + "/tiny";
const std::string kSingleFile = kFixtures + "/wan_2.1_vae_tiny.safetensors";

std::map<std::string, torch::Tensor> reference() {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : megaslide::io::read_safetensors(kFixtures + "/reference.safetensors").tensors) out[name] = t;
  return out;
}

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-wan-vae-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

// |ours − reference| ≤ 1e-4 · max(1, max |reference|) (fp32).
void expect_close(const torch::Tensor& ours, const torch::Tensor& ref, const std::string& what,
                  double tolerance = 1e-4) {
  ASSERT_EQ(ours.sizes(), ref.sizes()) << what;
  const double scale = std::max(1.0, ref.abs().max().item<double>());
  const double error = (ours.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs().max().item<double>() / scale;
  std::cout << what << ": largest difference " << error << " of the output's scale " << scale << "\n";
  EXPECT_LT(error, tolerance) << what;
}

torch::Tensor config_stat(const WanVae& vae, bool mean) {
  const auto& v = mean ? vae.config().latents_mean : vae.config().latents_std;
  return torch::tensor(v, torch::kFloat64).to(torch::kFloat32).view({1, -1, 1, 1, 1});
}

}  // namespace

TEST(WanVae, ConfigComesFromConfigJson) {
  auto vae = WanVae::load(kTiny);
  const auto& c = vae.config();
  EXPECT_EQ(c.base_dim, 4);
  EXPECT_EQ(c.decoder_base_dim, 2);
  EXPECT_EQ(c.z_dim, 16);
  EXPECT_EQ(c.num_res_blocks, 1);
  EXPECT_EQ(c.dim_mult, (std::vector<int64_t>{1, 2, 2, 2}));
  EXPECT_EQ(c.temporal_downsample, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(c.spatial_downscale(), 8);
  EXPECT_EQ(c.temporal_downscale(), 4);
  EXPECT_DOUBLE_EQ(c.latents_mean[0], -0.2554);
  EXPECT_DOUBLE_EQ(c.latents_std[15], 0.8252);
}

// 1 frame (the first chunk alone), 5 (first + one chunk of 4, batch 2) and 9 (first + two chunks): encode's
// mean and log-variance and decode's video as diffusers computes them.
TEST(WanVae, EncodeAndDecodeAreDiffusersFor1And5And9Frames) {
  auto vae = WanVae::load(kTiny);
  auto r = reference();
  for (const char* f : {"f1", "f5", "f9"}) {
    const std::string p = f;
    auto [mean, logvar] = vae.encode_distribution(r.at(p + ".videos"));
    expect_close(mean, r.at(p + ".mean"), p + " latent mean");
    expect_close(logvar, r.at(p + ".logvar"), p + " latent log-variance");
    expect_close(vae.decode_unscaled(r.at(p + ".latents")), r.at(p + ".decoded"), p + " decode");
  }
}

TEST(WanVae, NormalisedLatentsUseThePerChannelMeanAndStd) {
  auto vae = WanVae::load(kTiny);
  auto r = reference();
  const auto mean = config_stat(vae, true), std = config_stat(vae, false);
  // encode gives (μ − mean)/std per channel; decode undoes it.
  expect_close(vae.encode(r.at("f5.videos")), (r.at("f5.mean") - mean) / std, "normalised encode");
  expect_close(vae.decode((r.at("f9.latents") - mean) / std), r.at("f9.decoded"), "normalised decode");
  // A sample is μ + exp(logvar/2)·ε with ε from the given generator.
  auto eps = torch::randn(r.at("f1.mean").sizes(), at::detail::createCPUGenerator(5), torch::kFloat32);
  expect_close(vae.encode(r.at("f1.videos"), true, at::detail::createCPUGenerator(5)),
               ((r.at("f1.mean") + (0.5 * r.at("f1.logvar")).exp() * eps) - mean) / std, "sampled encode");
}

// diffusers' tiled_encode / tiled_decode with 16-pixel tiles every 8 pixels on 40×24 frames (3×5 tiles, the
// last ones cut short). On a random model the mid-block attention sees the whole frame, so tiles change the
// result: the comparison with diffusers' tiled outputs is what pins the blending, and whole-frame tiles give
// exactly the untiled result.
TEST(WanVae, TiledEncodeAndDecodeAreDiffusersTiled) {
  auto vae = WanVae::load(kTiny);
  auto r = reference();
  const megaslide::WanVaeTiling tiling{16, 8};
  auto tiled_mean = vae.encode_distribution(r.at("tiled.videos"), tiling).first;
  expect_close(tiled_mean, r.at("tiled.mean"), "tiled encode");
  auto tiled_video = vae.decode_unscaled(r.at("tiled.latents"), tiling);
  expect_close(tiled_video, r.at("tiled.decoded"), "tiled decode");
  expect_close(vae.encode_distribution(r.at("tiled.videos")).first, r.at("tiled.untiled_mean"), "untiled encode");
  expect_close(vae.decode_unscaled(r.at("tiled.latents")), r.at("tiled.untiled_decoded"), "untiled decode");
  EXPECT_GT((tiled_mean - r.at("tiled.untiled_mean")).abs().max().item<double>(), 0.1)
      << "tiling changes nothing: the test is trivial";
  // A tile as large as the frame is the untiled computation.
  const megaslide::WanVaeTiling whole{40, 32};
  EXPECT_TRUE(
      torch::equal(vae.decode_unscaled(r.at("tiled.latents"), whole), vae.decode_unscaled(r.at("tiled.latents"))));
  EXPECT_THROW(vae.decode_unscaled(r.at("tiled.latents"), megaslide::WanVaeTiling{12, 8}), c10::Error)
      << "tile not a multiple of 8";
}

TEST(WanVae, SingleFileWithOriginalNamesIsTheSameModel) {
  auto folder = WanVae::load(kTiny);
  auto file = WanVae::load(kSingleFile);
  const auto& c = file.config();
  EXPECT_EQ(c.base_dim, 4);
  EXPECT_EQ(c.decoder_base_dim, 2);
  EXPECT_EQ(c.num_res_blocks, 1);
  EXPECT_EQ(c.dim_mult, (std::vector<int64_t>{1, 2, 2, 2}));
  EXPECT_EQ(c.temporal_downsample, (std::vector<bool>{true, false, true}));
  // No statistics in a single file: Wan 2.1's published ones.
  EXPECT_DOUBLE_EQ(c.latents_mean[0], -0.7571);
  EXPECT_DOUBLE_EQ(c.latents_std[15], 1.9160);
  EXPECT_EQ(file.parameter_count(), folder.parameter_count());
  EXPECT_EQ(folder.original_name("decoder.up_blocks.1.upsamplers.0.resample.1.weight"),
            "decoder.upsamples.5.resample.1.weight");
  EXPECT_EQ(folder.original_name("decoder.up_blocks.2.resnets.0.conv_shortcut.bias"),
            "decoder.upsamples.6.shortcut.bias");
  EXPECT_EQ(folder.original_name("encoder.mid_block.resnets.1.norm2.gamma"), "encoder.middle.2.residual.3.gamma");
  auto r = reference();
  auto [mean, logvar] = file.encode_distribution(r.at("f5.videos"));
  expect_close(mean, r.at("f5.mean"), "single file: latent mean");
  expect_close(logvar, r.at("f5.logvar"), "single file: latent log-variance");
  expect_close(file.decode_unscaled(r.at("f9.latents")), r.at("f9.decoded"), "single file: decode");
}

TEST(WanVae, BadInputIsNamed) {
  auto dir = temp_dir("bad");
  auto expect_error = [&](const std::string& path, const std::string& needle) {
    try {
      WanVae::load(path);
      ADD_FAILURE() << "no error (expected one mentioning '" << needle << "')";
    } catch (const megaslide::io::IoError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(dir + "/nothing.safetensors", "no such file or folder");
  expect_error(dir, "no config.json");
  auto config = nlohmann::json::parse(megaslide::io::read_file(kTiny + "/config.json"));
  megaslide::io::write_file_atomically(dir + "/config.json", config.dump());
  expect_error(dir, "no weights file (expected diffusion_pytorch_model.safetensors)");
  auto weights = megaslide::io::read_safetensors(kTiny + "/diffusion_pytorch_model.safetensors").tensors;
  megaslide::io::write_safetensors(dir + "/diffusion_pytorch_model.safetensors", weights);
  EXPECT_NO_THROW(WanVae::load(dir));
  // The config disagreeing with the weights: the first tensor whose shape differs is named.
  auto wrong = config;
  wrong["base_dim"] = 8;
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error(
      dir, "tensor 'encoder.conv_in.weight' has shape [4, 3, 3, 3, 3], expected [8, 3, 3, 3, 3] (from config.json)");
  wrong = config;
  wrong["num_res_blocks"] = 2;
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error(dir, "no tensor 'encoder.down_blocks.1.norm1.gamma'");
  wrong = config;
  wrong["is_residual"] = true;
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error(dir, "\"is_residual\": only false");
  wrong = config;
  wrong["latents_std"] = {1.0, 2.0};
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error(dir, "must have z_dim (16) entries, got 16 and 2");
  wrong = config;
  wrong["temperal_downsample"] = {true, false};
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error(dir, "\"temperal_downsample\" must have one entry per level but the last (3), got 2");
  megaslide::io::write_file_atomically(dir + "/config.json", config.dump());
  // A tensor of the wrong dtype.
  auto bad_dtype = weights;
  for (auto& [name, t] : bad_dtype)
    if (name == "decoder.conv_out.bias") t = t.to(torch::kInt32);
  megaslide::io::write_safetensors(dir + "/diffusion_pytorch_model.safetensors", bad_dtype);
  expect_error(dir, "tensor 'decoder.conv_out.bias' is I32, expected floating point");
  // Single files: diffusers' names without the config, a missing original tensor, a truncated file.
  expect_error(kTiny + "/diffusion_pytorch_model.safetensors", "has diffusers' tensor names");
  megaslide::io::NamedTensors original;
  for (auto& [name, t] : megaslide::io::read_safetensors(kSingleFile).tensors)
    if (name != "decoder.upsamples.2.time_conv.weight") original.emplace_back(name, t);
  megaslide::io::write_safetensors(dir + "/vae.safetensors", original);
  expect_error(dir + "/vae.safetensors", "no tensor 'decoder.upsamples.2.time_conv.weight'");
  const auto bytes = megaslide::io::read_file(kSingleFile);
  megaslide::io::write_file_atomically(dir + "/cut.safetensors", bytes.substr(0, bytes.size() / 2));
  expect_error(dir + "/cut.safetensors", "cut.safetensors");
  megaslide::io::remove_tree(dir);
}

TEST(WanVae, BadVideosAreRefused) {
  auto vae = WanVae::load(kTiny);
  EXPECT_THROW(vae.encode(torch::zeros({1, 3, 4, 16, 16})), c10::Error) << "4 frames is not 1 + 4k";
  EXPECT_THROW(vae.encode(torch::zeros({1, 3, 5, 12, 16})), c10::Error) << "H not a multiple of 8";
  EXPECT_THROW(vae.encode(torch::zeros({1, 4, 5, 16, 16})), c10::Error) << "4 channels";
  EXPECT_THROW(vae.decode(torch::zeros({1, 8, 2, 2, 2})), c10::Error) << "8 latent channels";
}

// The real VAE, when downloaded: MEGASLIDE_WAN_VAE_WEIGHTS=DIR (the vae/ folder of
// Wan-AI/Wan2.1-T2V-1.3B-Diffusers) or FILE (ComfyUI's wan_2.1_vae.safetensors). A smooth moving pattern
// survives encode + decode (PSNR above 25 dB); random weights would not.
TEST(WanVae, RealWeightsWhenDownloaded) {
  const char* path = std::getenv("MEGASLIDE_WAN_VAE_WEIGHTS");
  if (path == nullptr) {
    std::cout
        << "\n*** SKIPPED: MEGASLIDE_WAN_VAE_WEIGHTS is not set, so the Wan VAE's real weights were NOT tested ***\n\n";
    GTEST_SKIP() << "MEGASLIDE_WAN_VAE_WEIGHTS not set: real Wan VAE weights not tested";
  }
  auto vae = WanVae::load(path);
  EXPECT_EQ(vae.config().z_dim, 16);
  EXPECT_EQ(vae.config().spatial_downscale(), 8);
  auto t = torch::arange(5, torch::kFloat32).view({1, 1, 5, 1, 1});
  auto yy = torch::linspace(-1, 1, 64).view({1, 1, 1, 64, 1}), xx = torch::linspace(-1, 1, 64).view({1, 1, 1, 1, 64});
  auto video =
      torch::cat({torch::sin(3 * xx + yy + 0.2 * t), torch::cos(2 * yy - xx - 0.1 * t), xx * yy + 0 * t}, 1) * 0.8;
  auto z = vae.encode(video);
  ASSERT_EQ(z.sizes(), (std::vector<int64_t>{1, 16, 2, 8, 8}));
  std::cout << "normalised latent std " << z.std().item<double>() << " (about 1 for Wan's VAE)\n";
  auto back = vae.decode(z);
  const double mse = (back - video).pow(2).mean().item<double>();
  const double psnr = 10 * std::log10(4.0 / mse);
  std::cout << "round trip PSNR " << psnr << " dB\n";
  EXPECT_GT(psnr, 25.0);
}
