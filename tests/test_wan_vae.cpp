// The Wan 2.1 and Wan 2.2 VAEs against diffusers' AutoencoderKLWan, each on a tiny random model of
// non-default sizes (tests/fixtures/wan_vae/ and tests/fixtures/wan22_vae/, tools/make_fixtures.py wan_vae and
// wan22_vae): the latent distribution and decoding of 1, 5 and 9 frames (the temporal feature cache across
// chunks), the per-channel normalisation, diffusers' tiled encode and decode on frames that are not a multiple
// of the tile; the single file with the original Wan names (rename table, sizes inferred from shapes); bad
// folders and files named in the errors; and, when MEGASLIDE_WAN_VAE_WEIGHTS / MEGASLIDE_WAN22_VAE_WEIGHTS
// point at a download, a round trip through the real VAE.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <functional>
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

std::map<std::string, torch::Tensor> reference(const std::string& fixtures = kFixtures) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : megaslide::io::read_safetensors(fixtures + "/reference.safetensors").tensors) out[name] = t;
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
  // A Wan 2.2 config over Wan 2.1 weights: the first tensor of the residual layout is missing.
  wrong = config;
  wrong["is_residual"] = true;
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error(dir, "diffusion_pytorch_model.safetensors': no tensor 'encoder.down_blocks.0.resnets.0.norm1.gamma'");
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

namespace {

// A downloaded Wan VAE at `path` (z_dim latents, `downscale` pixels a latent): a smooth moving pattern of 5
// frames of 64 x 64 survives encode + decode with a PSNR above 25 dB (random weights would not).
void expect_real_round_trip(const std::string& path, int64_t z_dim, int64_t downscale) {
  auto vae = WanVae::load(path);
  EXPECT_EQ(vae.config().z_dim, z_dim);
  EXPECT_EQ(vae.config().spatial_downscale(), downscale);
  auto t = torch::arange(5, torch::kFloat32).view({1, 1, 5, 1, 1});
  auto yy = torch::linspace(-1, 1, 64).view({1, 1, 1, 64, 1}), xx = torch::linspace(-1, 1, 64).view({1, 1, 1, 1, 64});
  auto video =
      torch::cat({torch::sin(3 * xx + yy + 0.2 * t), torch::cos(2 * yy - xx - 0.1 * t), xx * yy + 0 * t}, 1) * 0.8;
  auto z = vae.encode(video);
  ASSERT_EQ(z.sizes(), (std::vector<int64_t>{1, z_dim, 2, 64 / downscale, 64 / downscale}));
  std::cout << "normalised latent std " << z.std().item<double>() << " (about 1 for Wan's VAE)\n";
  auto back = vae.decode(z);
  const double mse = (back - video).pow(2).mean().item<double>();
  const double psnr = 10 * std::log10(4.0 / mse);
  std::cout << "round trip PSNR " << psnr << " dB\n";
  EXPECT_GT(psnr, 25.0);
}

}  // namespace

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
  expect_real_round_trip(path, 16, 8);
}

// ---------------------------------------------------------------------------------------------------------------
// Wan 2.2's VAE (is_residual, 2×2 patches): a tiny random model with base width 4, decoder width 2, widths
// ×[2, 1, 2, 1] (every level's shortcut regroups channels), time downsampled at levels 0 and 2, z_dim 8.

namespace {

const std::string kFixtures22 = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan22_vae";
const std::string kTiny22 = kFixtures22 + "/tiny";
const std::string kSingleFile22 = kFixtures22 + "/wan2.2_vae_tiny.safetensors";

// The single file carries no latent statistics and z_dim 8 has no published ones: the folder's.
WanVae load_single_file22(const std::string& path = kSingleFile22) {
  const auto folder = WanVae::load(kTiny22);
  return WanVae::load(path, folder.config().latents_mean, folder.config().latents_std);
}

}  // namespace

// config.json's sizes; in/out_channels there count the patchified channels (12), the config the video's (3);
// random() of that config has the loaded model's tensors.
TEST(Wan22Vae, ConfigComesFromConfigJson) {
  auto vae = WanVae::load(kTiny22);
  const auto& c = vae.config();
  EXPECT_TRUE(c.is_residual);
  EXPECT_EQ(c.patch_size, 2);
  EXPECT_EQ(c.base_dim, 4);
  EXPECT_EQ(c.decoder_base_dim, 2);
  EXPECT_EQ(c.z_dim, 8);
  EXPECT_EQ(c.num_res_blocks, 1);
  EXPECT_EQ(c.in_channels, 3);
  EXPECT_EQ(c.out_channels, 3);
  EXPECT_EQ(c.dim_mult, (std::vector<int64_t>{2, 1, 2, 1}));
  EXPECT_EQ(c.temporal_downsample, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(c.encoder_downscale(), 8);
  EXPECT_EQ(c.spatial_downscale(), 16);
  EXPECT_EQ(c.temporal_downscale(), 4);
  ASSERT_EQ(c.latents_mean.size(), 8u);
  EXPECT_DOUBLE_EQ(c.latents_mean[0], 0.0541);
  EXPECT_DOUBLE_EQ(c.latents_std[7], 0.9651);
  // random() builds the same architecture: every tensor, the same sizes.
  EXPECT_EQ(WanVae::random(c).parameter_count(), vae.parameter_count());
}

// 1 frame (the first chunk alone; the decoder's repeating shortcut drops its first frame), 5 (first + one chunk
// of 4, batch 2) and 9 (first + two chunks): encode's mean and log-variance and decode's video as diffusers
// computes them, within 1e-4 in fp32; and the normalisation with the 8 per-channel statistics.
TEST(Wan22Vae, EncodeAndDecodeAreDiffusersFor1And5And9Frames) {
  auto vae = WanVae::load(kTiny22);
  auto r = reference(kFixtures22);
  for (const char* f : {"f1", "f5", "f9"}) {
    const std::string p = f;
    auto [mean, logvar] = vae.encode_distribution(r.at(p + ".videos"));
    expect_close(mean, r.at(p + ".mean"), p + " latent mean");
    expect_close(logvar, r.at(p + ".logvar"), p + " latent log-variance");
    expect_close(vae.decode_unscaled(r.at(p + ".latents")), r.at(p + ".decoded"), p + " decode");
  }
  const auto mean = config_stat(vae, true), std = config_stat(vae, false);
  expect_close(vae.encode(r.at("f5.videos")), (r.at("f5.mean") - mean) / std, "normalised encode");
  expect_close(vae.decode((r.at("f9.latents") - mean) / std), r.at("f9.decoded"), "normalised decode");
}

// diffusers' tiled encode (tile 16, stride 8, measured on the patchified frame: 2 × 3 tiles of 32 × 48 pixels)
// and tiled decode (tile 32, stride 16 pixels: 2 × 3 tiles of 2 × 3 latents), within 1e-4; the tiles change the
// result (the mid-block attention sees only its tile), so the comparison pins the blending; a tile as large as
// the frame is the untiled computation; tiles of the wrong unit are refused.
TEST(Wan22Vae, TiledEncodeAndDecodeAreDiffusersTiled) {
  auto vae = WanVae::load(kTiny22);
  auto r = reference(kFixtures22);
  const megaslide::WanVaeTiling encode_tiling{16, 8}, decode_tiling{32, 16};
  auto [tiled_mean, tiled_logvar] = vae.encode_distribution(r.at("tiled.videos"), encode_tiling);
  expect_close(tiled_mean, r.at("tiled.mean"), "tiled encode: mean");
  expect_close(tiled_logvar, r.at("tiled.logvar"), "tiled encode: log-variance");
  auto untiled_mean = vae.encode_distribution(r.at("tiled.videos")).first;
  expect_close(untiled_mean, r.at("tiled.untiled_mean"), "untiled encode");
  EXPECT_GT((tiled_mean - untiled_mean).abs().max().item<double>(), 0.1) << "encode tiling changes nothing";
  auto tiled_video = vae.decode_unscaled(r.at("tiled.latents"), decode_tiling);
  expect_close(tiled_video, r.at("tiled.decoded"), "tiled decode");
  auto untiled_video = vae.decode_unscaled(r.at("tiled.latents"));
  EXPECT_GT((tiled_video - untiled_video).abs().max().item<double>(), 0.1) << "decode tiling changes nothing";
  EXPECT_TRUE(torch::equal(vae.decode_unscaled(r.at("tiled.latents"), megaslide::WanVaeTiling{48, 32}), untiled_video));
  EXPECT_TRUE(
      torch::equal(vae.encode_distribution(r.at("tiled.videos"), megaslide::WanVaeTiling{48, 16}).first, untiled_mean));
  EXPECT_THROW(vae.decode_unscaled(r.at("tiled.latents"), megaslide::WanVaeTiling{24, 8}), c10::Error)
      << "decode tiles must be multiples of 16 pixels";
  EXPECT_THROW(vae.encode_distribution(r.at("tiled.videos"), megaslide::WanVaeTiling{12, 8}), c10::Error)
      << "encode tiles must be multiples of 8 patches";
}

// The single file with Wan 2.2's original names (written by make_fixtures' own rename) is the same model: every
// diffusers tensor has, through the rename table, an identical tensor in the file; the sizes inferred from its
// shapes are config.json's; outputs are bitwise those of the folder. Without statistics it is refused, z_dim 8
// having no published ones; a z_dim 48 file takes Wan 2.2's published statistics.
TEST(Wan22Vae, SingleFileWithOriginalNamesIsTheSameModel) {
  auto folder = WanVae::load(kTiny22);
  auto diffusers_tensors = megaslide::io::read_safetensors(kTiny22 + "/diffusion_pytorch_model.safetensors").tensors;
  std::map<std::string, torch::Tensor> original;
  for (auto& [name, t] : megaslide::io::read_safetensors(kSingleFile22).tensors) original[name] = t;
  ASSERT_EQ(diffusers_tensors.size(), original.size());
  for (const auto& [name, t] : diffusers_tensors) {
    const auto o = folder.original_name(name);
    ASSERT_FALSE(o.empty()) << name << " is not in the rename table";
    ASSERT_TRUE(original.count(o)) << name << " -> " << o << " is not in the file";
    EXPECT_TRUE(torch::equal(original.at(o), t)) << name << " -> " << o;
  }
  EXPECT_EQ(folder.original_name("encoder.down_blocks.2.downsampler.time_conv.weight"),
            "encoder.downsamples.2.downsamples.1.time_conv.weight");
  EXPECT_EQ(folder.original_name("decoder.up_blocks.1.upsampler.resample.1.bias"),
            "decoder.upsamples.1.upsamples.2.resample.1.bias");
  EXPECT_EQ(folder.original_name("decoder.up_blocks.3.resnets.0.conv_shortcut.weight"),
            "decoder.upsamples.3.upsamples.0.shortcut.weight");

  auto file = load_single_file22();
  const auto &a = file.config(), &b = folder.config();
  EXPECT_TRUE(a.is_residual);
  EXPECT_EQ(a.patch_size, 2);
  EXPECT_EQ(a.in_channels, 3);
  EXPECT_EQ(a.out_channels, 3);
  EXPECT_EQ(a.base_dim, b.base_dim);
  EXPECT_EQ(a.decoder_base_dim, b.decoder_base_dim);
  EXPECT_EQ(a.z_dim, b.z_dim);
  EXPECT_EQ(a.num_res_blocks, b.num_res_blocks);
  EXPECT_EQ(a.dim_mult, b.dim_mult);
  EXPECT_EQ(a.temporal_downsample, b.temporal_downsample);
  EXPECT_EQ(file.parameter_count(), folder.parameter_count());
  auto r = reference(kFixtures22);
  EXPECT_TRUE(torch::equal(file.encode(r.at("f5.videos")), folder.encode(r.at("f5.videos"))));
  EXPECT_TRUE(torch::equal(file.decode_unscaled(r.at("f9.latents")), folder.decode_unscaled(r.at("f9.latents"))));
  // With z_dim 48, as Wan 2.2's, the file takes Wan 2.2's published statistics: the z-sized tensors redrawn.
  auto dir = temp_dir("z48");
  const int64_t z = 48;
  megaslide::io::NamedTensors z48;
  for (auto& [name, t] : original) {
    auto shape = t.sizes().vec();
    if (name == "encoder.head.2.weight" || name == "encoder.head.2.bias" || name == "conv1.weight" ||
        name == "conv1.bias")
      shape[0] = 2 * z;
    if (name == "conv1.weight") shape[1] = 2 * z;
    if (name == "conv2.weight" || name == "conv2.bias") shape[0] = z;
    if (name == "conv2.weight" || name == "decoder.conv1.weight") shape[1] = z;
    z48.emplace_back(name, shape == t.sizes().vec() ? t : torch::randn(shape) * 0.1);
  }
  megaslide::io::write_safetensors(dir + "/wan2.2_vae.safetensors", z48);
  auto published = WanVae::load(dir + "/wan2.2_vae.safetensors");
  EXPECT_EQ(published.config().z_dim, 48);
  EXPECT_DOUBLE_EQ(published.config().latents_mean[0], -0.2289);
  EXPECT_DOUBLE_EQ(published.config().latents_std[47], 0.7744);
  EXPECT_EQ(published.encode(r.at("f1.videos")).sizes(), (std::vector<int64_t>{1, 48, 1, 1, 2}));
  megaslide::io::remove_tree(dir);
  try {
    WanVae::load(kSingleFile22);
    ADD_FAILURE() << "a z_dim 8 single file loaded without latent statistics";
  } catch (const megaslide::io::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("wan2.2_vae_tiny.safetensors': z_dim 8: a single file carries no "
                                         "latents_mean/latents_std, and Wan 2.2's published ones are for z_dim 48"),
              std::string::npos)
        << e.what();
  }
}

// Folders and files that do not hold this model are refused with the path, the key or tensor, and what was
// expected.
TEST(Wan22Vae, BadInputIsNamed) {
  auto dir = temp_dir("bad22");
  auto expect_error = [&](const std::function<void()>& load, const std::string& needle) {
    try {
      load();
      ADD_FAILURE() << "no error (expected one mentioning '" << needle << "')";
    } catch (const megaslide::io::IoError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto load_dir = [&] { WanVae::load(dir); };
  const auto config = nlohmann::json::parse(megaslide::io::read_file(kTiny22 + "/config.json"));
  auto weights = megaslide::io::read_safetensors(kTiny22 + "/diffusion_pytorch_model.safetensors").tensors;
  megaslide::io::write_safetensors(dir + "/diffusion_pytorch_model.safetensors", weights);
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    auto wrong = config;
    wrong[key] = value;
    megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  };
  with("base_dim", 4);
  EXPECT_NO_THROW(WanVae::load(dir));
  // A Wan 2.1 config over Wan 2.2 weights: the flat layout's first tensor is missing, the file named.
  with("is_residual", false);
  expect_error(load_dir, "diffusion_pytorch_model.safetensors': no tensor 'encoder.down_blocks.0.norm1.gamma'");
  with("patch_size", nullptr);
  expect_error(load_dir, "\"scale_factor_spatial\" 16 disagrees with dim_mult (4 levels and patch_size 1: 8)");
  with("patch_size", "2");
  expect_error(load_dir, "\"patch_size\" must be null or a positive integer, got \"2\"");
  with("in_channels", 10);
  expect_error(load_dir, "\"in_channels\" 10 and \"out_channels\" 12 must be multiples of patch_size² (4)");
  with("dim_mult", {2, 1, 2, 3});
  expect_error(load_dir, "encoder level 3: 8 channels unfolded ×1 do not average down to 12");
  with("decoder_base_dim", 4);
  expect_error(load_dir, "tensor 'decoder.conv_in.weight' has shape [2, 8, 3, 3, 3], expected [4, 8, 3, 3, 3]");
  with("latents_mean", std::vector<double>(48, 0.0));
  expect_error(load_dir, "must have z_dim (8) entries, got 48 and 8");
  // Statistics given of the wrong size.
  expect_error(
      [&] {
        WanVae::load(kTiny22, {0.0, 1.0}, {1.0, 1.0});
      },
      "with the latent statistics given: \"latents_mean\" and \"latents_std\" must have z_dim (8) entries");

  // Single files: a tensor missing, a tensor of Wan 2.1's shape (the upsampler halving the width), a truncated file.
  const auto stats = WanVae::load(kTiny22).config();
  auto load_file = [&](const std::string& path) {
    return [&, path] { WanVae::load(path, stats.latents_mean, stats.latents_std); };
  };
  megaslide::io::NamedTensors original;
  for (auto& [name, t] : megaslide::io::read_safetensors(kSingleFile22).tensors)
    if (name != "decoder.upsamples.0.upsamples.2.time_conv.weight") original.emplace_back(name, t);
  megaslide::io::write_safetensors(dir + "/missing.safetensors", original);
  expect_error(load_file(dir + "/missing.safetensors"),
               "missing.safetensors': no tensor 'decoder.upsamples.0.upsamples.2.time_conv.weight'");
  original.clear();
  for (auto& [name, t] : megaslide::io::read_safetensors(kSingleFile22).tensors)
    original.emplace_back(name, name == "decoder.upsamples.1.upsamples.2.resample.1.weight" ? t.narrow(0, 0, 2) : t);
  megaslide::io::write_safetensors(dir + "/halved.safetensors", original);
  expect_error(
      load_file(dir + "/halved.safetensors"),
      "halved.safetensors': tensor 'decoder.upsamples.1.upsamples.2.resample.1.weight' has shape [2, 4, 3, 3], "
      "expected [4, 4, 3, 3]");
  const auto bytes = megaslide::io::read_file(kSingleFile22);
  megaslide::io::write_file_atomically(dir + "/cut.safetensors", bytes.substr(0, bytes.size() / 2));
  expect_error(load_file(dir + "/cut.safetensors"), "cut.safetensors");
  megaslide::io::remove_tree(dir);
}

// Videos must be 1 + 4k frames of multiples of 16 pixels with 3 channels; latents must have z_dim channels.
TEST(Wan22Vae, BadVideosAreRefused) {
  auto vae = WanVae::load(kTiny22);
  EXPECT_NO_THROW(vae.encode(torch::zeros({1, 3, 1, 16, 16})));
  EXPECT_THROW(vae.encode(torch::zeros({1, 3, 1, 24, 16})), c10::Error) << "H not a multiple of 16";
  EXPECT_THROW(vae.encode(torch::zeros({1, 12, 1, 16, 16})), c10::Error) << "patchified channels";
  EXPECT_THROW(vae.encode(torch::zeros({1, 3, 3, 16, 16})), c10::Error) << "3 frames is not 1 + 4k";
  EXPECT_THROW(vae.decode(torch::zeros({1, 16, 1, 1, 1})), c10::Error) << "16 latent channels";
}

// The real Wan 2.2 VAE, when downloaded: MEGASLIDE_WAN22_VAE_WEIGHTS=DIR (the vae/ folder of
// Wan-AI/Wan2.2-TI2V-5B-Diffusers) or FILE (ComfyUI's wan2.2_vae.safetensors). A smooth moving pattern survives
// encode + decode (PSNR above 25 dB); random weights would not.
TEST(Wan22Vae, RealWeightsWhenDownloaded) {
  const char* path = std::getenv("MEGASLIDE_WAN22_VAE_WEIGHTS");
  if (path == nullptr) {
    std::cout << "\n*** SKIPPED: MEGASLIDE_WAN22_VAE_WEIGHTS is not set, so the Wan 2.2 VAE's real weights were NOT "
                 "tested ***\n\n";
    GTEST_SKIP() << "MEGASLIDE_WAN22_VAE_WEIGHTS not set: real Wan 2.2 VAE weights not tested";
  }
  expect_real_round_trip(path, 48, 16);
}
