// The Stable Diffusion VAE against diffusers' AutoencoderKL on a tiny random model of non-default sizes
// (tests/fixtures/vae/, tools/make_fixtures.py vae): the latent distribution, decoding, and diffusers'
// tiled decode; legacy attention names; frame-by-frame video helpers; bad folders named in the errors;
// and, when MEGASLIDE_SD_VAE_WEIGHTS points at a download, a round trip through the real VAE.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/sd_vae.h"

using megaslide::SdVae;

namespace {

const std::string kTiny = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/vae/tiny";

std::map<std::string, torch::Tensor> reference() {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] :
       megaslide::io::read_safetensors(std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/vae/reference.safetensors")
           .tensors)
    out[name] = t;
  return out;
}

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-vae-" + std::to_string(::getpid()) + "-" + name;
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

}  // namespace

TEST(SdVae, EncodeAndDecodeAreDiffusers) {
  auto vae = SdVae::load(kTiny);
  EXPECT_EQ(vae.config().latent_channels, 3);
  EXPECT_EQ(vae.config().downscale(), 4);
  EXPECT_DOUBLE_EQ(vae.config().scaling_factor, 0.3);
  auto r = reference();
  auto [mean, logvar] = vae.encode_distribution(r.at("images"));
  expect_close(mean, r.at("mean"), "latent mean");
  expect_close(logvar, r.at("logvar"), "latent log-variance");
  expect_close(vae.decode_unscaled(r.at("latents")), r.at("decoded"), "decode");
  // The scaled forms: encode gives mean·scaling_factor, decode undoes it.
  expect_close(vae.encode(r.at("images")), r.at("mean") * 0.3, "scaled encode");
  expect_close(vae.decode(r.at("latents") * 0.3), r.at("decoded"), "scaled decode");
  // A sample is mean + exp(logvar / 2)·ε with ε from the given generator.
  auto g = at::detail::createCPUGenerator(5);
  auto eps = torch::randn(mean.sizes(), at::detail::createCPUGenerator(5), torch::kFloat32);
  expect_close(vae.encode(r.at("images"), true, g), (r.at("mean") + (0.5 * r.at("logvar")).exp() * eps) * 0.3,
               "sampled encode");
}

TEST(SdVae, TiledDecodeIsDiffusersTiledDecode) {
  auto vae = SdVae::load(kTiny);
  auto r = reference();
  const auto& z = r.at("tiled.latents");
  auto tiled = vae.decode_tiled(z * 0.3, megaslide::VaeTiling{16, 0.25});
  expect_close(tiled, r.at("tiled.decoded"), "tiled decode");
  // Tiling changes the result (each tile sees only its own latents): the comparison above is not trivial.
  EXPECT_GT((tiled - r.at("tiled.untiled")).abs().max().item<double>(), 0.1);
  expect_close(vae.decode(z * 0.3), r.at("tiled.untiled"), "untiled decode");
  // Latents within one tile decode untiled.
  EXPECT_TRUE(torch::equal(vae.decode_tiled(r.at("latents").slice(2, 0, 4).slice(3, 0, 4), {16, 0.25}),
                           vae.decode(r.at("latents").slice(2, 0, 4).slice(3, 0, 4))));
  // Every tile size and overlap gives the frames' size, also where tile · (1 - overlap) is not a whole number of
  // latents (diffusers' arithmetic then made 17×26 of a 16×24 decode at tile 12).
  const int64_t f = vae.config().downscale();
  for (const int64_t tile : {2 * f, 3 * f, 5 * f})
    for (const double overlap : {0.0, 0.25, 0.4})
      EXPECT_EQ(vae.decode_tiled(z * 0.3, megaslide::VaeTiling{tile, overlap}).sizes(),
                (std::vector<int64_t>{z.size(0), 3, z.size(2) * f, z.size(3) * f}))
          << "tile " << tile << ", overlap " << overlap;
}

TEST(SdVae, LegacyAttentionNamesLoad) {
  auto dir = temp_dir("legacy");
  const std::map<std::string, std::string> legacy{
      {"to_q", "query"}, {"to_k", "key"}, {"to_v", "value"}, {"to_out.0", "proj_attn"}};
  megaslide::io::NamedTensors renamed;
  int renamed_count = 0;
  for (auto& [name, t] : megaslide::io::read_safetensors(kTiny + "/diffusion_pytorch_model.safetensors").tensors) {
    std::string n = name;
    for (const auto& [current, old] : legacy) {
      const auto at = n.find(".attentions.0." + current + ".");
      if (at != std::string::npos) n.replace(at + 14, current.size(), old), ++renamed_count;
    }
    renamed.emplace_back(n, t);
  }
  EXPECT_EQ(renamed_count, 16);  // 4 projections × weight and bias × encoder and decoder
  megaslide::io::write_safetensors(dir + "/diffusion_pytorch_model.safetensors", renamed);
  megaslide::io::write_file_atomically(dir + "/config.json", megaslide::io::read_file(kTiny + "/config.json"));
  auto r = reference();
  expect_close(SdVae::load(dir).decode_unscaled(r.at("latents")), r.at("decoded"), "legacy names");
  megaslide::io::remove_tree(dir);
}

TEST(SdVae, VideosGoFrameByFrameInAnyChunkSize) {
  auto vae = SdVae::load(kTiny);
  torch::manual_seed(7);
  auto videos = torch::rand({2, 3, 5, 8, 12}) * 2 - 1;  // [B, C, T, H, W]
  // Chunks of different sizes are convolutions over different batch sizes, for which oneDNN may pick
  // other kernels (other orders of fp32 additions, by CPU): equal within fp32 rounding, not bit for bit.
  auto z1 = vae.encode_video(videos, 1), z3 = vae.encode_video(videos, 3);
  ASSERT_EQ(z1.sizes(), (std::vector<int64_t>{2, 3, 5, 2, 3}));
  EXPECT_TRUE(torch::allclose(z1, z3, 1e-4, 1e-5)) << (z1 - z3).abs().max().item<double>();
  // Frame t of video b is the image encoding of that frame.
  const auto frame = vae.encode(videos.select(2, 4).slice(0, 1, 2))[0];
  EXPECT_TRUE(torch::allclose(z1.select(2, 4)[1], frame, 1e-4, 1e-5))
      << (z1.select(2, 4)[1] - frame).abs().max().item<double>();
  auto x = vae.decode_video(z1, 4);
  ASSERT_EQ(x.sizes(), videos.sizes());
  const auto decoded = vae.decode(z1.select(2, 2).slice(0, 0, 1))[0];
  EXPECT_TRUE(torch::allclose(x.select(2, 2)[0], decoded, 1e-4, 1e-5))
      << (x.select(2, 2)[0] - decoded).abs().max().item<double>();
  // Images a few at a time (megaslide-encode's --frames-per-batch: memory bounded by it, not by the file) are the
  // batch's encoding, and a sample's noise is the whole batch's one draw.
  const auto images = videos.select(2, 0).contiguous();
  const auto images4 = torch::cat({images, images.flip(0)});
  EXPECT_TRUE(torch::allclose(vae.encode(images4, false, std::nullopt, 3), vae.encode(images4), 1e-4, 1e-5));
  const auto sampled_whole = vae.encode(images4, true, at::detail::createCPUGenerator(11));
  const auto sampled_chunks = vae.encode(images4, true, at::detail::createCPUGenerator(11), 1);
  EXPECT_TRUE(torch::allclose(sampled_chunks, sampled_whole, 1e-4, 1e-5))
      << (sampled_chunks - sampled_whole).abs().max().item<double>();
  EXPECT_FALSE(torch::allclose(sampled_whole, vae.encode(images4), 1e-3, 1e-3)) << "--sample drew no noise";
  EXPECT_THROW(vae.encode_video(videos, 0), c10::Error);
  EXPECT_THROW(vae.encode(torch::zeros({1, 3, 6, 8})), c10::Error) << "H not a multiple of 4";
}

TEST(SdVae, BadFoldersAreNamed) {
  auto dir = temp_dir("bad");
  auto expect_error = [&](const std::string& needle) {
    try {
      SdVae::load(dir);
      ADD_FAILURE() << "no error (expected one mentioning '" << needle << "')";
    } catch (const megaslide::io::IoError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto config = nlohmann::json::parse(megaslide::io::read_file(kTiny + "/config.json"));
  megaslide::io::write_file_atomically(dir + "/config.json", config.dump());
  expect_error("no weights file (expected diffusion_pytorch_model.safetensors or model.safetensors)");
  auto weights = megaslide::io::read_safetensors(kTiny + "/diffusion_pytorch_model.safetensors").tensors;
  megaslide::io::write_safetensors(dir + "/diffusion_pytorch_model.safetensors", weights);
  auto wrong = config;
  wrong["latent_channels"] = 4;
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error("tensor 'encoder.conv_out.weight' has shape [6, 12, 3, 3], expected [8, 12, 3, 3]");
  wrong = config;
  wrong["up_block_types"] = {"UpDecoderBlock2D", "AttnUpDecoderBlock2D", "UpDecoderBlock2D"};
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error("only UpDecoderBlock2D is supported");
  wrong = config;
  wrong["norm_num_groups"] = 5;
  megaslide::io::write_file_atomically(dir + "/config.json", wrong.dump());
  expect_error("not a multiple of norm_num_groups 5");
  megaslide::io::write_file_atomically(dir + "/config.json", "[1, 2]");
  expect_error("is not a JSON object");
  megaslide::io::remove_tree(dir);
}

// The real VAE, when downloaded: MEGASLIDE_SD_VAE_WEIGHTS=DIR (stabilityai/sd-vae-ft-mse, or a Stable
// Diffusion 1.x checkpoint's vae/). A smooth image survives encode + decode (PSNR above 25 dB); a random
// latent-space model would not.
TEST(SdVae, RealWeightsWhenDownloaded) {
  const char* dir = std::getenv("MEGASLIDE_SD_VAE_WEIGHTS");
  if (dir == nullptr) {
    std::cout << "\n*** SKIPPED: MEGASLIDE_SD_VAE_WEIGHTS is not set, so the Stable Diffusion VAE's real weights were "
                 "NOT tested ***\n\n";
    GTEST_SKIP() << "MEGASLIDE_SD_VAE_WEIGHTS not set: real VAE weights not tested";
  }
  auto vae = SdVae::load(dir);
  EXPECT_EQ(vae.config().latent_channels, 4);
  EXPECT_EQ(vae.config().downscale(), 8);
  auto yy = torch::linspace(-1, 1, 64).view({1, 1, 64, 1}), xx = torch::linspace(-1, 1, 64).view({1, 1, 1, 64});
  auto image = torch::cat({torch::sin(3 * xx + yy), torch::cos(2 * yy - xx), (xx * yy)}, 1) * 0.8;
  auto z = vae.encode(image);
  ASSERT_EQ(z.sizes(), (std::vector<int64_t>{1, 4, 8, 8}));
  std::cout << "scaled latent std " << z.std().item<double>() << " (about 1 for SD's VAE)\n";
  auto back = vae.decode(z).clamp(-1, 1);
  const double mse = (back - image).pow(2).mean().item<double>();
  const double psnr = 10 * std::log10(4.0 / mse);  // peak-to-peak 2
  std::cout << "round trip PSNR " << psnr << " dB\n";
  EXPECT_GT(psnr, 25.0);
}
