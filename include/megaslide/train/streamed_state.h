// The training state of a StreamedStackTrainer, whatever model family it streams: the streamed Trainer's
// (train/trainer.h) protocol for checkpoints and resuming.
//
// Names: the resident parameters as the family names them (`resident`, in its order), then every
// block parameter as block_name(l) + "." + its name in the block's streamed module (block_name(l) is
// "blocks.<l>" unless the family names them otherwise: FamilyModel::block_name). The blocks' master, m and v
// are views into the host store (nothing copied); the resident parameters' are CPU copies.
// TrainingState::shards describes the blocks' flat buffers (sharded over several ranks the blocks are
// there only: checkpoints keep a shard per rank and any world size resumes them).
//
// Threading: the thread that drives the trainer; every function synchronizes the engine first. Sharded,
// every rank calls them at the same point.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/io/safetensors.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/train/checkpoint.h"

namespace megaslide {

// The parameters and AdamW state (with the engine's counters: optimizer steps, loss scale, clean
// steps); the caller fills the run's own counters (step, skips, data position).
using BlockNames = std::function<std::string(int64_t block)>;
TrainingState streamed_training_state(offload::StreamedStackTrainer& engine, const io::NamedTensors& resident,
                                      const BlockNames& block_name = {});

// Restores what streamed_training_state saved (any order of names; int8 moments with their scales; a
// sharded store from TrainingState::shards, in place when it is this engine's own), then reloads the
// blocks' compute copies and the engine's counters. Errors (c10::Error) name `who` and the tensor.
// `adam_steps` gives a resident parameter's AdamW step count by its name (a model of parts: its part's;
// empty: state.optimizer_steps).
void load_streamed_training_state(offload::StreamedStackTrainer& engine, const io::NamedTensors& resident,
                                  const TrainingState& state, const std::string& who, const BlockNames& block_name = {},
                                  const std::function<int64_t(const std::string&)>& adam_steps = {});

}  // namespace megaslide
