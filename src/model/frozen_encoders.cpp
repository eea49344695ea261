#include "megaslide/model/frozen_encoders.h"

#include "megaslide/io/files.h"
#include "megaslide/model/encoder_settings.h"

namespace megaslide {

std::shared_ptr<FrozenEncoders> FrozenEncoders::load(const RunConfig& config, torch::Device device,
                                                     const std::string& source) {
  const auto& te = config.model.text_encoder;
  const auto& v = config.model.vae;
  if (te.kind != "clip" && v.kind != "sd") return nullptr;
  std::shared_ptr<FrozenEncoders> out(new FrozenEncoders(config, device));
  auto fail = [&](const std::string& key, const std::string& problem) { throw ConfigError(source, key, problem); };
  // A relative path is read from the current folder (not the config's): said, with where that was.
  const auto missing = [](const std::string& path) {
    return "'" + path + "' is not a folder" + io::relative_path_note(path);
  };
  if (te.kind == "clip") {
    if (!io::is_directory(te.weights))
      fail("model.text_encoder.weights",
           missing(te.weights) + " (CLIP's text encoder: config.json + model.safetensors)");
    try {
      out->text_.emplace(
          ClipTextEncoder::load(te.weights, device, frozen_encoder_dtype(te.dtype, device), te.dtype == "fp8"));
    } catch (const std::exception& e) {
      fail("model.text_encoder.weights", e.what());
    }
    try {
      out->tokenizer_.emplace(ClipTokenizer::find(te.vocab, te.weights));
    } catch (const ClipTokenizerError& e) {
      fail(
          "model.text_encoder.vocab",
          std::string(e.what()) +
              (te.vocab.empty() ? "; set model.text_encoder.vocab to its folder or to bpe_simple_vocab_16e6.txt" : ""));
    }
    const auto& tc = out->text_->config();
    if (tc.hidden_size != config.model.text_dim)
      fail("model.text_dim",
           "is " + std::to_string(config.model.text_dim) + " but the CLIP text encoder in '" + te.weights + "' is " +
               std::to_string(tc.hidden_size) +
               " wide (config.json hidden_size): set model.text_dim: " + std::to_string(tc.hidden_size));
    if (config.data.max_text_tokens > tc.max_position_embeddings)
      fail("data.max_text_tokens", "is " + std::to_string(config.data.max_text_tokens) +
                                       " but the CLIP text encoder in '" + te.weights + "' has " +
                                       std::to_string(tc.max_position_embeddings) + " positions");
    if (out->tokenizer_->vocab_size() > tc.vocab_size)
      fail("model.text_encoder.vocab", "the vocabulary has " + std::to_string(out->tokenizer_->vocab_size()) +
                                           " tokens but the CLIP text encoder in '" + te.weights + "' embeds " +
                                           std::to_string(tc.vocab_size) + ": not this model's vocabulary");
  }
  if (v.kind == "sd") {
    if (!io::is_directory(v.weights))
      fail("model.vae.weights",
           missing(v.weights) + " (the SD VAE: config.json + diffusion_pytorch_model.safetensors)");
    try {
      out->vae_.emplace(SdVae::load(v.weights, device, frozen_encoder_dtype(v.dtype, device)));
    } catch (const std::exception& e) {
      fail("model.vae.weights", e.what());
    }
    const auto& vc = out->vae_->config();
    if (vc.latent_channels != v.latent_channels)
      fail("model.vae.latent_channels",
           "is " + std::to_string(v.latent_channels) + " (the DiT's input channels) but the VAE in '" + v.weights +
               "' has " + std::to_string(vc.latent_channels) +
               " latent channels (config.json latent_channels): set model.vae.latent_channels: " +
               std::to_string(vc.latent_channels));
    if (vc.downscale() != v.downscale)
      fail("model.vae.downscale", "is " + std::to_string(v.downscale) + " but the VAE in '" + v.weights + "' maps " +
                                      std::to_string(vc.downscale()) + " pixels to a latent (" +
                                      std::to_string(vc.block_out_channels.size()) +
                                      " levels): set model.vae.downscale: " + std::to_string(vc.downscale()));
    if (vc.in_channels != config.data.channels || vc.out_channels != config.data.channels)
      fail("data.channels", "is " + std::to_string(config.data.channels) + " but the VAE in '" + v.weights + "' maps " +
                                std::to_string(vc.in_channels) + "-channel images");
  }
  return out;
}

int64_t FrozenEncoders::prompt_tokens(const std::string& prompt) const {
  TORCH_CHECK(tokenizer_.has_value(), "FrozenEncoders::prompt_tokens: the config names no CLIP text encoder");
  return static_cast<int64_t>(tokenizer_->encode_text(prompt).size()) + 2;
}

std::pair<torch::Tensor, torch::Tensor> FrozenEncoders::encode_text(const std::vector<std::string>& prompts) const {
  TORCH_CHECK(text_.has_value(), "FrozenEncoders::encode_text: the config names no CLIP text encoder");
  torch::NoGradGuard no_grad;
  const auto tokens = tokenizer_->encode(prompts, config_.data.max_text_tokens);
  auto out = text_->forward(tokens.ids.to(device_));
  return {out.last_hidden_state.to(torch::kFloat32), tokens.mask.to(device_).to(torch::kBool)};
}

torch::Tensor FrozenEncoders::encode_video(const torch::Tensor& pixels) const {
  TORCH_CHECK(vae_.has_value(), "FrozenEncoders::encode_video: the config names no VAE");
  torch::NoGradGuard no_grad;
  return vae_->encode_video(pixels.to(device_, torch::kFloat32), config_.model.vae.frames_per_batch)
      .to(torch::kFloat32);
}

torch::Tensor FrozenEncoders::decode_video(const torch::Tensor& latents) const {
  TORCH_CHECK(vae_.has_value(), "FrozenEncoders::decode_video: the config names no VAE");
  torch::NoGradGuard no_grad;
  const auto& v = config_.model.vae;
  std::optional<VaeTiling> tiling;
  if (v.tile_size > 0) tiling = VaeTiling{v.tile_size, v.tile_overlap};
  return vae_->decode_video(latents.to(device_, torch::kFloat32), v.frames_per_batch, tiling)
      .to(torch::kFloat32)
      .clamp(-1.0, 1.0);
}

}  // namespace megaslide
