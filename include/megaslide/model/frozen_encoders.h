// The frozen encoders a run config names (docs/conditioning.md): CLIP's text encoder
// (model.text_encoder.kind: clip) and the Stable Diffusion VAE (model.vae.kind: sd), loaded from their
// folders, checked against the config and run without gradients on the run's device — never trained.
//
//   text:  prompts -> CLIP tokens (data.max_text_tokens, at most 77) -> last_hidden_state [B, L, width]
//          float32 and the tokenizer's mask [B, L] bool; the width must be model.text_dim.
//   video: pixels [B, 3, T, H, W] in [-1, 1] -> scaled latents [B, latent_channels, T, H/ds, W/ds]
//          (the latent mean, frame by frame in chunks of model.vae.frames_per_batch), and back (decoded
//          whole or in model.vae.tile_size tiles, clamped to [-1, 1]). latent_channels and the
//          downscale ds must be model.vae.latent_channels and model.vae.downscale.
//
// Loading throws ConfigError naming the config key (model.text_encoder.weights, model.vae.weights,
// model.text_dim, model.vae.latent_channels, ...) and the folder's own message for bad files.
// Thread-safety: one thread at a time.
#pragma once

#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/model/clip_text_encoder.h"
#include "megaslide/model/clip_tokenizer.h"
#include "megaslide/model/sd_vae.h"

namespace megaslide {

class FrozenEncoders {
 public:
  // The encoders `config` names on `device` (nullptr when it names none: the built-in text encoder and
  // no VAE). `source` names the config in messages.
  static std::shared_ptr<FrozenEncoders> load(const RunConfig& config, torch::Device device, const std::string& source);

  bool has_text() const { return text_.has_value(); }
  bool has_vae() const { return vae_.has_value(); }
  // CLIP embeddings and mask on the device (needs has_text()).
  std::pair<torch::Tensor, torch::Tensor> encode_text(const std::vector<std::string>& prompts) const;
  // CLIP's tokens for `prompt` with its start and end tokens, before encode_text cuts them to data.max_text_tokens.
  int64_t prompt_tokens(const std::string& prompt) const;
  // Pixels (any device) -> scaled latents on the device; latents -> pixels in [-1, 1] (needs has_vae()).
  torch::Tensor encode_video(const torch::Tensor& pixels) const;
  torch::Tensor decode_video(const torch::Tensor& latents) const;
  torch::Device device() const { return device_; }

 private:
  FrozenEncoders(const RunConfig& config, torch::Device device) : config_(config), device_(device) {}
  RunConfig config_;
  torch::Device device_;
  std::optional<ClipTokenizer> tokenizer_;
  std::optional<ClipTextEncoder> text_;
  std::optional<SdVae> vae_;
};

}  // namespace megaslide
