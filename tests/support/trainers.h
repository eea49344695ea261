// Trainers for the tests (train/trainer.h): a config's trainer in one mode, and Wan's over latent data
// held in memory.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/dit_family.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/trainer.h"
#include "megaslide/train/wan_family.h"
#include "tiny_wan.h"

namespace megaslide::testing {

// The trainer of `config` with offload.enabled set: the resident reference loop or the streamed one.
inline Trainer resident_trainer(RunConfig config, Communicator* communicator = nullptr) {
  config.offload.enabled = false;
  return make_trainer(config, communicator);
}
inline Trainer streamed_trainer(RunConfig config, Communicator* communicator = nullptr) {
  config.offload.enabled = true;
  return make_trainer(config, communicator);
}

// Every trained parameter's name and shape, as train.init_from matches them.
inline ParameterShapes parameter_shapes(Trainer& trainer) {
  ParameterShapes out;
  for (const auto& [name, p] : trainer.weight_views()) out.emplace_back(name, p.sizes().vec());
  return out;
}

// The trainer of `config` started from `path` (train.init_from) with `allow_missing` (train.init_allow_missing).
inline Trainer trainer_from(RunConfig config, const std::string& path,
                            const std::vector<std::string>& allow_missing = {}) {
  config.train.init_from = path;
  config.train.init_allow_missing = allow_missing;
  return make_trainer(config);
}

// Wan's trainer of `config` (its mode as offload.enabled says) over `data`, written for it to a file of
// its own (data.tensors), which is removed once the trainer holds the data.
inline Trainer wan_trainer(RunConfig config, const WanLatentData& data, Communicator* communicator = nullptr) {
  static int counter = 0;
  const std::string path =
      "/tmp/megaslide-test-wan-data-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".safetensors";
  // Every item, whether held in memory or read from a cache (one clip size).
  std::vector<int64_t> items(static_cast<size_t>(data.size()));
  std::iota(items.begin(), items.end(), int64_t{0});
  io::NamedTensors tensors;
  for (const char* name : {"latents", "text", "image_latents", "image_embeds"})
    if (auto rows = data.rows(name, items); rows.defined()) tensors.emplace_back(name, rows);
  if (data.empty_text.defined()) tensors.emplace_back("empty_text", data.empty_text);
  io::write_safetensors(path, tensors);
  config.data.tensors = path;
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove{path};
  return make_trainer(config, communicator);
}

// The tiny run of a family, resolved as the driver resolves it: "dit" (3D-DSA, `layers` blocks of hidden 16
// on 4x8x8 frames, batch 2) or "wan" (write_tiny_wan's 2 blocks of width 24, written into `dir`), on the
// CPU with one thread and one optimizer thread, no checkpoints or videos; `sets` are applied after these.
inline RunConfig tiny_run_config(const std::string& family, const std::string& dir,
                                 const std::vector<std::string>& sets, int layers = 2) {
  std::vector<std::string> all{"offload.optimizer_threads=1", "train.checkpoint_every=0", "train.sample_every=0",
                               "train.device=cpu", "train.threads=1"};
  if (family != "wan")
    for (const std::string& s : std::vector<std::string>{
             "model.arch=megaslide", "model.layers=" + std::to_string(layers), "model.hidden=16", "model.heads=2",
             "model.text_dim=16", "model.dsa_kernel=[3,3,3]", "data.frames=4", "data.height=8", "data.width=8",
             "data.num_clips=16", "train.batch_size=2", "train.lr=3e-3", "train.warmup_steps=0", "train.seed=3"})
      all.push_back(s);
  all.insert(all.end(), sets.begin(), sets.end());
  const RunConfig config =
      family == "wan" ? load_run_config(write_tiny_wan(dir), all) : parse_run_config("", "test", all);
  return model_family(config.model.arch).resolve(resolve_auto_settings(config), "test");
}

// The trainer of `config` (resolved; `requested` as given, null: `config`) that measures the validation loss of
// `validation` (validation_data_config), as the training run builds rank 0's.
inline Trainer trainer_with_validation(const RunConfig& config, const RunConfig& validation,
                                       const RunConfig* requested = nullptr) {
  TrainerRequest request;
  request.config = &config;
  request.requested = requested != nullptr ? requested : &config;
  request.source = "test";
  request.validation_data = &validation;
  return Trainer(request);
}

// The one trainer of `config` (already resolved), as the driver builds it.
inline std::unique_ptr<Trainer> trainer_of(const RunConfig& config) {
  TrainerRequest request;
  request.config = &config;
  request.requested = &config;
  request.source = "test";
  return std::make_unique<Trainer>(request);
}

}  // namespace megaslide::testing
