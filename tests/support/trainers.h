// Trainers for the tests (train/trainer.h): a config's trainer in one mode, and Wan's over latent data
// held in memory.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>

#include "megaslide/io/safetensors.h"
#include "megaslide/train/dit_family.h"
#include "megaslide/train/trainer.h"
#include "megaslide/train/wan_family.h"

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
  io::NamedTensors tensors{{"latents", data.latents}, {"text", data.text}};
  if (data.empty_text.defined()) tensors.emplace_back("empty_text", data.empty_text);
  if (data.image_latents.defined()) tensors.emplace_back("image_latents", data.image_latents);
  if (data.image_embeds.defined()) tensors.emplace_back("image_embeds", data.image_embeds);
  io::write_safetensors(path, tensors);
  config.data.tensors = path;
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove{path};
  return make_trainer(config, communicator);
}

}  // namespace megaslide::testing
