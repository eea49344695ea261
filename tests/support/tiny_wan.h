// A tiny Wan run for the command-line tests: its config file and its latent tensors, written into a
// folder.
#pragma once

#include <torch/types.h>

#include <fstream>
#include <string>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"

namespace megaslide::testing {

// `n` latent videos [4, frames, 6, 8] (smooth waves whose phase depends on the clip), a random text embedding
// per clip [7, 20] (bf16), the empty prompt's zeros; a Wan of 2 blocks of width 24 trained on them with
// flow matching, 30 steps of batches of 2 on the CPU, bf16 compute when streamed. Returns the config's path.
inline std::string write_tiny_wan(const std::string& dir, int64_t n = 4, int64_t frames = 3) {
  io::make_directories(dir);
  auto t = torch::arange(frames).view({1, 1, frames, 1, 1}).to(torch::kFloat32);
  auto h = torch::arange(6).view({1, 1, 1, 6, 1}).to(torch::kFloat32);
  auto w = torch::arange(8).view({1, 1, 1, 1, 8}).to(torch::kFloat32);
  auto phase = torch::arange(n).view({n, 1, 1, 1, 1}).to(torch::kFloat32);
  auto c = torch::arange(4).view({1, 4, 1, 1, 1}).to(torch::kFloat32);
  torch::manual_seed(42);
  const std::string tensors = io::join_path(dir, "latents.safetensors");
  io::write_safetensors(tensors, {{"latents", torch::sin(0.7 * w + 0.5 * h + 0.3 * t + phase + c)},
                                  {"text", torch::randn({n, 7, 20}).to(torch::kBFloat16)},
                                  {"empty_text", torch::zeros({7, 20})}});
  const std::string config = io::join_path(dir, "wan.yaml");
  std::ofstream(config)
      << "model:\n  arch: wan\n  wan: {dim: 24, layers: 2, heads: 2, ffn_dim: 40, freq_dim: 16, text_dim: 20, "
         "patch: [1, 2, 2], in_channels: 4, out_channels: 4}\n"
         "data: {dataset: latent-tensors, tensors: "
      << tensors << ", channels: 4, frames: " << frames
      << ", height: 6, width: 8, "
         "max_text_tokens: 7}\n"
         "diffusion: {objective: flow, shift: 3.0, caption_dropout: 0.1}\n"
         "train: {steps: 30, batch_size: 2, lr: 0.003, warmup_steps: 0, lr_schedule: constant, grad_clip: 1.0, "
         "device: cpu, seed: 5, checkpoint_every: 15, log_every: 10}\n"
         "offload: {compute_dtype: bf16}\noutput: {progress: false}\n";
  return config;
}

}  // namespace megaslide::testing
