// The training state of a StreamedStackTrainer, whatever model family it streams: one protocol for
// checkpoints, resuming and train.init_from, shared by every family's streamed trainer
// (CPUMasterVideoDiT, WanTrainer); and their one way of running an engine step into StepMetrics.
//
// Names: the resident parameters as the family names them (`resident`, in its order), then every
// block parameter as "blocks.<l>.<name in the block's streamed module>". The blocks' master, m and v
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
#include "megaslide/train/init_from.h"
#include "megaslide/train/resident_trainer.h"

namespace megaslide {

// The parameters and AdamW state (with the engine's counters: optimizer steps, loss scale, clean
// steps); the caller fills the run's own counters (step, skips, data position).
TrainingState streamed_training_state(offload::StreamedStackTrainer& engine, const io::NamedTensors& resident);

// Restores what streamed_training_state saved (any order of names; int8 moments with their scales; a
// sharded store from TrainingState::shards, in place when it is this engine's own), then reloads the
// blocks' compute copies and the engine's counters. Errors (c10::Error) name `who` and the tensor.
void load_streamed_training_state(offload::StreamedStackTrainer& engine, const io::NamedTensors& resident, const TrainingState& state,
                                  const std::string& who);

// Every parameter's name and shape, as streamed_training_state names them (train.init_from's matching).
ParameterShapes streamed_parameter_shapes(const offload::StreamedStackTrainer& engine, const io::NamedTensors& resident);

// Loads a matched init_from plan: the resident parameters on the device, the blocks' masters tensor by
// tensor straight into the host store (sharded: each value through a temporary), then their compute
// copies refreshed.
void streamed_init_from(offload::StreamedStackTrainer& engine, const io::NamedTensors& resident, const InitPlan& plan);

// Runs one engine step (`run`: engine.step with the family's prologue and epilogue) and returns what
// the engine measured as StepMetrics: loss, gradient norm, skip, times, transfers, exchange, peak device
// memory, the loss scale with fp16 compute. With `trace_path` set, the step is recorded into a Chrome
// trace written there after the step's host updates, and `trace_path` cleared. The caller fills the
// run's own fields (step, lr, skip counters, throughput, MFU).
StepMetrics traced_engine_step(offload::StreamedStackTrainer& engine, std::string& trace_path,
                               const std::function<offload::StackStepResult()>& run);

// FamilyTrainer::persistent_device_bytes of a streamed trainer: its weight and gradient slots, and its
// resident parameters with their two AdamW moments (and their EMA with train.ema_decay).
int64_t streamed_persistent_device_bytes(offload::StreamedStackTrainer& engine);

// Counts `m`'s skip into the trainer's counters and copies them into `m`.
void count_skip(StepMetrics& m, int64_t& skipped_total, int64_t& consecutive_skips);

}  // namespace megaslide
