// What differs between model families, behind one seam: a family completes and checks its config, and
// builds its model for the one Trainer (train/trainer.h), which owns everything the families share —
// the two modes (resident, streamed), the schedule, metrics, skip counting, checkpoint state, data
// parallelism, train.init_from's protocol and the trace. A new family is one file of train/
// implementing FamilyModel and ModelFamily, returned by model_family() for its model.arch.
//
//   DiT family (megaslide, dense3d, swin): train/dit_family.cpp
//   Wan:                                   train/wan_family.cpp
//
// Thread-safety: a FamilyModel is driven by the thread that drives its Trainer (a streamed stack's
// initial_block may be called from the engine's initialisation threads, StreamedModel says how);
// ModelFamily objects are stateless singletons.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/attention/context_parallel.h"
#include "megaslide/config/run_config.h"
#include "megaslide/data/video_manifest.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan_lora.h"
#include "megaslide/offload/streamed_model.h"
#include "megaslide/train/init_from.h"
#include "megaslide/util/errors.h"

namespace megaslide {

class Trainer;

// What one micro-batch adds to its step's metrics.
struct MicroBatchStats {
  double data_wait_s = 0.0;  // time spent waiting for its data
  int64_t tokens = 0;        // tokens per sample of its bucket (the largest bucket's when the data has one size)
};

// train.init_from as the family builds its model: called once with every trained parameter's name and
// shape (as checkpoints name them) and the globs of the parameters the family allows to keep their
// initialisation (besides train.init_allow_missing), before any weight reaches the device or the host
// store; the family reads the returned plan's tensors into its fp32 initial weights as it builds them
// (a streamed model block by block, so no second copy of the model exists). Throws InitFromError.
using InitPlanner =
    std::function<InitPlan(const ParameterShapes& shapes, const std::vector<std::string>& may_stay_initial)>;

// A family's validation data source made by `make` (from ModelRequest::validation_data): what it refuses as bad
// input is the config's ConfigError naming train.val_data, so that the run stops before its first step.
template <typename Make>
auto make_validation_source(const std::string& source, Make&& make) {
  try {
    return std::forward<Make>(make)();
  } catch (const std::exception& e) {
    if (!is_input_error(e)) throw;
    throw ConfigError(source, "train.val_data", "the validation data: " + error_message(e));
  }
}

// What the Trainer hands a family to build its model.
struct ModelRequest {
  const RunConfig* config = nullptr;     // resolved (auto settings, ModelFamily::resolve)
  const RunConfig* requested = nullptr;  // as given, before auto settings (the log says why `auto` chose)
  std::string source;                    // where the config came from (errors name it)
  torch::Device device = torch::kCPU;    // the training device
  bool streamed = false;                 // offload.enabled: the blocks stream through the engine
  InitPlanner init_from;                 // a fresh run with train.init_from, else empty
  bool validation = false;               // this rank writes validation videos (train.sample_every > 0)
  // train.val_every > 0, on the rank that measures the validation loss (rank 0): the validation data's config
  // (validation_data_config); null otherwise.
  const RunConfig* validation_data = nullptr;
  // Context parallelism (distributed.context_parallel > 1): the group this rank shares its samples with. Each
  // micro-batch's sample frames are split over it (FrameSplit::balanced of the token frames); the family runs
  // this rank's frames and returns their context_parallel_loss. Null: whole samples.
  ops::FrameExchange* context_group = nullptr;
};

// The training loss of `prediction` for `target` [B, C, T, H, W] in fp32: the mean squared error (diffusion_loss);
// with `loss_mask` ([B, 1, T, 1, 1] float) each sample's mean over the elements it keeps, averaged over the
// samples (the same for any split of the batch). Over a context-parallel group (`cp` active; docs/distributed.md,
// "Context parallelism") `prediction` holds this rank's token frames cp.begin()… of the whole video's
// (`patch_frames` latent frames each) and the result is the group size × this rank's part of the whole video's
// loss: summed over the group, the parts are the whole loss, so the mean over the world that data parallelism
// takes of every rank's loss and gradients is the single process's. With `sample_weights` ([B] float32,
// diffusion.loss_weighting) each sample's mean counts times its weight.
at::Tensor context_parallel_loss(const at::Tensor& prediction, const at::Tensor& target, const at::Tensor& loss_mask,
                                 const ops::ContextShard& cp = {}, int64_t patch_frames = 1,
                                 const at::Tensor& sample_weights = {});

// A part of a model trained on its own steps (Wan2.2's two experts, model.wan.expert: both): each step
// trains one part, which the family picks; the step's gradient and update reach that part only (the
// others' weights, moments and EMA untouched, their blocks not streamed), and each part's AdamW counts
// its own updates (bias correction and the EMA's warm-up as if the part were trained alone).
struct ModelPart {
  std::string name;                        // for the log and the metrics ("high")
  std::string prefix;                      // its parameters' names start with it (named_parameters)
  int64_t first_block = 0, end_block = 0;  // streamed: its blocks [first_block, end_block) of stack()
};

// One family's model, its data and its outputs, as the Trainer trains it in one mode.
class FamilyModel {
 public:
  virtual ~FamilyModel() = default;

  // Every trained parameter by name (as checkpoints and weights files name them), in the model's order.
  // Resident mode: the tensors the optimizer updates, on the device. Streamed mode: the same names; the
  // parameters outside the blocks are the device tensors the engine's resident optimizer updates, the
  // blocks' entries only name them — block l's parameters are block_name(l) + "." + their name in
  // stack()->block(l).
  virtual io::NamedTensors named_parameters() = 0;
  // Streamed mode: block l's name in named_parameters() and checkpoints.
  virtual std::string block_name(int64_t l) const { return "blocks." + std::to_string(l); }
  // The parts trained on separate steps (empty, the default: the whole model every step).
  virtual std::vector<ModelPart> parts() const { return {}; }
  // With parts, before each step's first micro-batch: the index of the part the step trains, the same on
  // every rank, drawn from the data's random streams (so data_state() restores the sequence).
  virtual size_t begin_step() { return 0; }
  // Streamed mode: the model as the engine streams it (its blocks' initial weights built on demand).
  virtual std::shared_ptr<offload::StreamedModel> stack() = 0;
  // Streamed mode: called once the engine has built every block (a family that draws its head after the
  // blocks does it here).
  virtual void blocks_built() {}

  // Resident mode: the next micro-batch through the whole model; its loss (the family's objective).
  virtual at::Tensor loss(MicroBatchStats& stats) = 0;
  // Streamed mode: the next micro-batch through the prologue (the stack's input), and the loss of the
  // last block's output through the epilogue.
  virtual offload::StackInput prologue(MicroBatchStats& stats) = 0;
  virtual at::Tensor epilogue(const at::Tensor& last_hidden) = 0;

  // The data's position (JSON) and its restoration (throws std::invalid_argument on a state that does not
  // fit); the rank's slice of every global batch (data parallelism: every draw made for the whole batch).
  virtual std::string data_state() const = 0;
  virtual void restore_data(const std::string& state) = 0;
  virtual void take_slice(int64_t rank, int64_t world_size) = 0;
  // The data's description for the log ("" for none) and the items it skipped since the last call.
  virtual std::string describe_data(int64_t /*steps*/) const { return ""; }
  virtual std::vector<BadItem> take_new_bad_items() { return {}; }

  virtual int64_t tokens_per_sample() const = 0;  // the largest sample's
  virtual double flops_per_step() const = 0;      // model FLOPs of one step at tokens_per_sample (MFU)

  // Lines for the run log after the trainer's: the weights, encoders and validation.
  virtual void describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const = 0;
  // Validation videos of `trainer`'s current weights into `folder` (created); the files written. Only
  // for a model built with ModelRequest::validation.
  virtual std::vector<std::string> write_validation(const std::string& folder, Trainer& trainer) = 0;
  // The validation loss of `trainer`'s current weights (train.val_every; docs/training.md, "Validation loss"):
  // the mean over train.val_batches micro-batches of the validation data (ModelRequest::validation_data), drawn
  // the same each time, of the training loss (its weighting and loss mask included), without gradients and with
  // the model in eval mode. Only for a model built with validation_data.
  virtual double validation_loss(Trainer& trainer) = 0;
  // The family's weights file of `weights` (named as named_parameters() names them).
  virtual void write_weights(const std::string& path, const io::NamedTensors& weights) = 0;

  // LoRA (lora.rank > 0; train/lora_model.h wraps the family's model):
  // Resident mode: the blocks' modules with the prefixes of their parameters' names ("blocks.3.",
  // "transformer.blocks.3."), whose Linear layers LoRA adapts. Empty (the default): the family has no
  // LoRA.
  virtual std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> block_modules() { return {}; }
  // The family's own model under any wrapper (LoRA's): what family-specific accessors cast.
  virtual FamilyModel& base() { return *this; }
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
  // Builds the model for one mode (LibTorch's default generator seeded as the family's initialisation
  // needs). Throws ConfigError (bad data, weights or encoders named by the config), InitFromError.
  virtual std::unique_ptr<FamilyModel> make_model(const ModelRequest& request) const = 0;
};

// LoRA around `model` (request.config->lora.rank > 0; train/lora_model.cpp, docs/lora.md): the family's
// parameters frozen — streamed, its blocks' weights H2D only (StackTrainerOptions::frozen_blocks) — and an
// adapter trained on each Linear of its blocks that lora.targets names; named_parameters() lists the
// adapters, write_weights writes a LoRA file. train.init_from, when the request carries one, reads a
// LoRA (FamilyModel::read_lora) or a LoRA run's checkpoint into the adapters; the family's own model is
// built without it. Throws ConfigError naming lora.targets when they match no Linear layer.
std::unique_ptr<FamilyModel> with_lora(std::unique_ptr<FamilyModel> model, const ModelRequest& request);
// A LoRA run's adapters as LoRA file(s): `weights` named as its checkpoints name them
// ("blocks.0.attn1.to_q.lora_A.weight", "...lora_B.weight"), alpha from config.lora, written in `layout`
// (model/wan_lora.h; the DiT family: diffusers' layout only, std::invalid_argument otherwise). Wan2.2's two
// experts trained together: one file per expert (wan_comfyui_files' names), each under its DiT's own names.
// Returns the files written.
std::vector<std::string> save_lora_weights(const std::string& path, const RunConfig& config,
                                           const io::NamedTensors& weights, LoraLayout layout);
// The files save_lora_weights writes for `path`.
std::vector<std::string> lora_weights_files(const std::string& path, const RunConfig& config);
// The trained adapters of a Wan LoRA run's checkpoint — a checkpoint folder, its `latest` file or the run folder (its
// latest checkpoint), verified — as a LoRA of one DiT: its fp32 adapters with the scale of the run's lora settings —
// their EMA (ema.safetensors) when the run kept one (train.ema_decay) and `ema`, else master.safetensors; `source`
// names the file read — those of the DiT `expert` names when the run trained Wan2.2's two experts together ("high" or
// "low"; "" takes the high-noise one), under the names that DiT gives its weights. Throws WanLoraError naming what the
// path is not.
WanLora read_lora_checkpoint(const std::string& path, const std::string& expert = "", bool ema = true);

const ModelFamily& dit_family();
const ModelFamily& wan_family();
// The family of model.arch.
const ModelFamily& model_family(Architecture arch);

}  // namespace megaslide
