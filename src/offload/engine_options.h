// Internal to the library (not installed): the streamed engine's options from a run config — one
// mapping for every trainer built on StackTrainer (the DiT family's and Wan's), so a new setting reaches
// both. The config's `auto` values must already be resolved (compute dtype, threads).
#pragma once

#include "megaslide/config/run_config.h"
#include "megaslide/offload/stack_trainer.h"

namespace megaslide {

offload::StackTrainerOptions engine_options(const RunConfig& config, torch::Device device);

}  // namespace megaslide
