// What differs between model families, seen from the training run (train/training_run.h), behind one
// seam: a family completes and checks its config, builds its trainer (resident or streamed, with the
// run's train.init_from and data parallelism), describes it for the log, writes validation videos and
// its weights file. run_training schedules the phases of a run and names no family; a new family is one
// file of train/ implementing ModelFamily, returned by model_family() for its model.arch.
//
//   DiT family (megaslide, dense3d, swin): train/dit_family.cpp — ResidentTrainer or CPUMasterVideoDiT
//   Wan:                                   train/wan_family.cpp — WanTrainer (both modes)
//
// Thread-safety: a FamilyTrainer is driven by one thread; ModelFamily objects are stateless singletons.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/data/video_manifest.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/init_from.h"
#include "megaslide/train/resident_trainer.h"

namespace megaslide {

class Communicator;

// One family's trainer as the training run drives it.
class FamilyTrainer {
 public:
  virtual ~FamilyTrainer() = default;

  virtual StepMetrics step() = 0;
  virtual TrainingState training_state() = 0;  // waits for host updates still running
  // Throws std::invalid_argument when the state does not fit this trainer.
  virtual void load_training_state(const TrainingState& state) = 0;
  virtual void synchronize() = 0;

  virtual int64_t parameter_count() const = 0;   // the text encoder's included where it trains
  virtual int64_t tokens_per_sample() const = 0;
  virtual torch::Device device() const = 0;
  virtual bool streams() const = 0;  // blocks streamed through offload::StreamedStackTrainer (--trace records it)
  virtual bool sharded() const = 0;  // host state sharded over the ranks: every rank saves its shard
  virtual void trace_next_step(const std::string& path) = 0;
  // Device memory that lives across steps (what each step's own allocations add to): streamed, the
  // weight and gradient slots and the resident parameters with their two AdamW moments (and their EMA
  // with train.ema_decay); resident, every trained parameter with its two moments (and its EMA).
  virtual int64_t persistent_device_bytes() = 0;

  // The train.init_from the trainer was built with (empty path: none).
  virtual const InitPlan& init_plan() const = 0;
  // Lines for the run log after the model line: the trainer, its memory, its encoders and validation.
  virtual void describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const = 0;
  // The data's description for the log ("" for none) and the items it skipped since the last call.
  virtual std::string describe_data(int64_t /*steps*/) const { return ""; }
  virtual std::vector<BadItem> take_new_bad_items() { return {}; }

  // Validation videos of the current weights into `folder` (created); the files written. Rank 0 only,
  // and only when the trainer was built with `validation`.
  virtual std::vector<std::string> write_validation(const std::string& folder) = 0;
  // The family's weights file of the current weights (model/dit_weights.h, model/wan_weights.h).
  virtual void export_weights(const std::string& path) = 0;
  // The family's weights file of `weights`, named as training_state() names the parameters (the EMA).
  virtual void write_weights(const std::string& path, const io::NamedTensors& weights) = 0;
};

// What run_training hands a family to build its trainer.
struct TrainerRequest {
  const RunConfig* config = nullptr;     // resolved (auto settings, ModelFamily::resolve)
  const RunConfig* requested = nullptr;  // as given, before auto settings (the log says why `auto` chose)
  std::string source;                 // where the config came from (errors name it)
  bool init_from = false;             // a fresh run with train.init_from: the trainer starts from it
  bool validation = false;            // this rank writes validation videos (train.sample_every > 0)
  Communicator* communicator = nullptr;  // data parallelism, or null for one process
};

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  virtual std::string name() const = 0;
  // `config` (auto settings resolved) completed from the family's own files and checked: throws
  // ConfigError naming the key before anything of the run is written.
  virtual RunConfig resolve(const RunConfig& config, const std::string& source) const = 0;
  // The config whose data sizes are the trainer's samples (memory_shortfall sizes a batch by it).
  virtual RunConfig sample_config(const RunConfig& config) const { return config; }
  // Throws ConfigError (bad data, weights or encoders named by the config), InitFromError.
  virtual std::unique_ptr<FamilyTrainer> make_trainer(const TrainerRequest& request) const = 0;
};

const ModelFamily& dit_family();
const ModelFamily& wan_family();
// The family of model.arch.
const ModelFamily& model_family(Architecture arch);

}  // namespace megaslide
