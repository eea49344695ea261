// How a run config's frozen encoders run, shared by the trainers' data paths (FrozenEncoders,
// megaslide-cache's encoders) and Wan's validation videos, so that all of them run an encoder alike.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/model/wan_vae.h"

namespace megaslide {

// The dtype an encoder runs in for model.text_encoder.dtype / model.vae.dtype `name` on `device`: bf16
// applies on a GPU; on a CPU (slow there, and nothing to gain) the encoders run in fp32. fp8 (umT5's
// matrices kept in 8 bits, Umt5Encoder::load's `fp8`) computes as bf16 does.
torch::ScalarType frozen_encoder_dtype(const std::string& name, torch::Device device);

// model.vae.tile_size and tile_overlap as the Wan VAE's tiling (nullopt: whole frames): the overlap
// rounded down to whole latents (model.vae.downscale pixels), the stride at least one latent.
std::optional<WanVaeTiling> wan_vae_tiling(const VaeConfig& vae);

// Wan2.1 I2V's CLIP image encoder: model.image_encoder.weights, else the image_encoder/ folder of the diffusers
// repository model.wan.weights names; "" when neither is there.
std::string wan_image_encoder_path(const RunConfig& config);

// `config` with the frozen encoders a Wan run needs — umT5 and the Wan VAE for megaslide-cache over data.dataset:
// videos, and for validation videos (train.sample_every > 0) — taken from the diffusers repository model.wan.weights
// names where the config names none (model.text_encoder.kind builtin without weights or vocab: umT5 from
// text_encoder/; model.vae.kind none without weights: the Wan VAE from vae/, model.vae.latent_channels and downscale
// from its config.json), as megaslide-sample finds them. Called by with_wan_architecture_from_weights; `taken` gets
// one line per encoder taken. Throws ConfigError naming model.vae.weights when vae/config.json does not read.
RunConfig with_wan_repository_encoders(const RunConfig& config, std::vector<std::string>* taken = nullptr);

}  // namespace megaslide
