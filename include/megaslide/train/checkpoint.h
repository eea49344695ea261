// Training checkpoints: everything needed to continue a run exactly where it stopped.
//
// Layout, under a run directory:
//   DIR/checkpoints/step-0000200/model.safetensors       bf16 weights, the weights-file format
//                                                         (model/dit_weights.h): megaslide-sample reads it
//                               master.safetensors      fp32 master weights  } keyed by parameter name:
//                               exp_avg.safetensors     AdamW m              } "blocks.3.mlp.fc1.weight",
//                               exp_avg_sq.safetensors  AdamW v              } "text_encoder.tokens.weight"
//                                 (m and v of the streamed blocks in optimizer.state_dtype: fp32, bf16, or
//                                 int8 codes with their fp32 group scales as "<name>#scale"; the resident
//                                 parts' in fp32)
//                               ema.safetensors         fp32 EMA of the weights (train.ema_decay), keyed
//                                                       like master.safetensors
//                               model_ema.safetensors   the EMA as a bf16 weights file (what megaslide-sample
//                                                       reads by default when it is there)
//                               trainer_state.json      step, AdamW step count, loss scale, skip
//                                                       counters, data position and RNG states, the
//                                                       resolved config (YAML)
//                               shards/rank-00001-of-00004.safetensors   a sharded run (several ranks
//                                                       of the streamed trainer): each rank's shard of
//                                                       the blocks' flat master, m and v ("blocks.3#master",
//                                                       …, "blocks.3#ema" with EMA); master/exp_avg/exp_avg_sq/ema then
//                                                       hold the resident parameters only, and trainer_state.json the
//                                                       blocks' flat layouts ("shards")
//                               manifest.json           written last: every file's size and CRC-32
//   DIR/checkpoints/latest                              the name of the newest complete checkpoint
//
// Saving is atomic at every level: the files go into a hidden temporary folder, each written to a
// temporary name, fsynced and renamed; the manifest is written last; the folder is then renamed to
// step-NNNNNNN and `latest` replaced by an atomic rename. A crash at any moment leaves the previous
// checkpoint (and `latest`, which still names it) intact; a half-written folder is never named by
// `latest`, has no manifest, and is ignored and cleaned up by the next save.
//
// Loading trusts nothing: the manifest must list every file with the right size and CRC-32, the
// state's config must describe the same model and data as the run's, and each tensor file must hold
// exactly the trainer's parameters with their shapes. Every failure is a CheckpointError naming the
// file and, where there is one, the tensor or the key.
//
// Thread-safety: plain functions; one thread saves or loads a run's checkpoints at a time.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/util/errors.h"

namespace torch::optim {
class AdamW;
}

namespace megaslide {

class CheckpointError : public io::IoError, public InputError {
 public:
  using io::IoError::IoError;
};

// What a trainer puts into a checkpoint and takes back from one. Tensor lists are parallel: the same
// names in the same order, fp32, CPU (for the streamed trainer, views into its host store).
struct TrainingState {
  int64_t step = 0;             // optimizer steps done (the run's step counter)
  int64_t optimizer_steps = 0;  // AdamW updates taken (steps minus skipped ones): bias correction
  // A model trained one part per step (FamilyModel::parts): the updates each part took, in parts() order
  // (their bias correction); empty otherwise.
  std::vector<int64_t> part_steps;
  double loss_scale = 1.0;    // fp16 dynamic loss scale (1 otherwise)
  int64_t clean_steps = 0;    // fp16: steps since the scale last changed
  int64_t skipped_steps = 0;  // non-finite steps skipped so far
  int64_t consecutive_skips = 0;
  std::string data_state;  // DiffusionBatchSource::state(): data position and RNG states (JSON)
  io::NamedTensors master, exp_avg, exp_avg_sq;
  // int8 moments (optimizer.state_dtype: int8): exp_avg / exp_avg_sq hold the codes, these the fp32
  // group scales of the same parameters (named as they are; empty otherwise). Written into the moment
  // files as "<name>#scale".
  io::NamedTensors exp_avg_scale, exp_avg_sq_scale;
  // EMA of the weights (train.ema_decay; empty without): fp32, parallel to `master` (the same names).
  io::NamedTensors ema;
  // Whether `ema` (and the shards' `ema`) hold an EMA: a trainer that keeps one sets it; load_checkpoint
  // sets it to whether the checkpoint held the EMA asked for (one saved without EMA: false, the tensors
  // untouched), and a trainer loading a state without one starts its EMA from the loaded weights.
  bool ema_valid = false;

  // The streamed trainer's blocks as flat buffers (offload/host_param_store.h: a block's parameters
  // packed in declaration order): this rank's elements [begin, end) of each block's master, m and v.
  // world_size > 1 (a sharded run): the lists above hold the resident parameters only, and a checkpoint
  // keeps one shard file per rank. One process: the lists hold the blocks too (views of the same
  // memory) and the checkpoint is keyed by parameter name. Loading fills these ranges from a checkpoint
  // of either kind and any world size (re-sharding).
  // The NVMe tier (`hold` set): a block's state is in memory only while held, so the blocks are in the
  // shards only (not in the lists), their tensors are undefined and hold(l) gives them; the checkpoint is
  // the shard layout of one rank (with int8 moments' scales), which either tier resumes.
  struct BlockShards {
    int64_t rank = 0, world_size = 1;
    struct Block {
      std::string name;   // "blocks.3"
      int64_t numel = 0;  // the whole block's elements
      int64_t begin = 0, end = 0;
      std::vector<std::pair<std::string, std::vector<int64_t>>> params;  // the flat layout, in order
      torch::Tensor master, exp_avg, exp_avg_sq;                         // end - begin elements each
      torch::Tensor ema;                                                 // with EMA (end - begin), else undefined
      // int8 moments, one process: the block's group scales (offload::state_groups of each parameter,
      // concatenated); undefined otherwise.
      torch::Tensor exp_avg_scale, exp_avg_sq_scale;
    };
    std::vector<Block> blocks;
    // Sharded: the blocks' whole compute copies by parameter name ("blocks.3.attn.q.weight"), which
    // every rank holds: model.safetensors is written from them.
    io::NamedTensors weights;
    // Sharded with EMA: block l's whole EMA (flat, the compute dtype) put together from every rank's
    // shard — a collective every rank calls for the same blocks in the same order
    // (StreamedStackTrainer::gathered_block_ema); gather_ema_weights calls it.
    std::function<torch::Tensor(int64_t block)> gather_ema;
    // The NVMe tier: block l's tensors (a Block with them defined), valid while `lease` lives. kWrite: what is
    // written into them is kept; kOverwrite: the same, and the caller writes every element of every tensor of
    // the Block, so their old values need not be read. Empty: the Block's own tensors are always valid.
    enum class Access { kRead, kWrite, kOverwrite };
    struct Held {
      std::shared_ptr<void> lease;
      Block block;
    };
    std::function<Held(int64_t block, Access access)> hold;
    // Block l's tensors: hold(l, access) or the Block itself.
    Held held(int64_t block, Access access) const;
    // What the Blocks' memory belongs to (a trainer's parameter store), or null: a state loaded into the
    // trainer it came from is already in place.
    const void* owner = nullptr;
  };
  std::optional<BlockShards> shards;
};

// Several ranks saving one checkpoint together: an in-place sum of a vector over the ranks (a
// collective every rank calls at the same points).
using RankSum = std::function<void(std::vector<int64_t>&)>;

// LibTorch AdamW's state of one parameter as CPU fp32 copies (zeros and step 0 before its first
// update), and its restoration (the state is created when missing): how the trainers put their
// LibTorch-updated parameters into a TrainingState.
struct AdamWMoments {
  torch::Tensor exp_avg, exp_avg_sq;
  int64_t step = 0;
};
AdamWMoments adamw_moments(torch::optim::AdamW& optimizer, const torch::Tensor& param);
void set_adamw_moments(torch::optim::AdamW& optimizer, const torch::Tensor& param, const torch::Tensor& exp_avg,
                       const torch::Tensor& exp_avg_sq, int64_t step);

// The EMA of `state` (ema_valid) as weights by parameter name: `state.ema` of one process; sharded, the
// resident parameters' and every block's EMA put together block by block (every rank calls this at the
// same point; only where `keep` are the blocks kept, so the other ranks hold one block at a time).
io::NamedTensors gather_ema_weights(const TrainingState& state, bool keep);

// "step-0000200".
std::string checkpoint_name(int64_t step);

// Writes a checkpoint of `state` under run_dir/checkpoints, points `latest` at it and returns its path.
// An existing checkpoint of the same step is replaced only once the new one is complete. On failure
// (no space, unwritable folder…) throws CheckpointError saying so and what is still intact; the
// temporary folder is removed and `latest` still names the previous checkpoint.
//
// A sharded state (state.shards with world_size > 1): every rank calls this at the same step with its
// own state and `sum`; rank 0 prepares the folder and writes everything but the shards, each rank its
// shard file, and every rank returns or throws the same way (a rank that failed is named).
std::string save_checkpoint(const std::string& run_dir, const RunConfig& config, const TrainingState& state,
                            const RankSum& sum = nullptr);

// Checks, before a run trains, that its checkpoints can be saved: creates run_dir/checkpoints and, in it, the
// temporary folder and file names a save of `step` uses, then removes them (and the folder, when it made it).
// Throws CheckpointError naming the
// folder and the system's reason (read-only, not ours to write, the path too long) where they cannot be made.
void check_checkpoints_writable(const std::string& run_dir, int64_t step);

// Removes the oldest complete checkpoints beyond the newest `keep_last` (0 keeps all), never the one
// `latest` names, and what interrupted saves left (temporary folders, `latest`'s temporary files). Returns
// the removed paths.
std::vector<std::string> prune_checkpoints(const std::string& run_dir, int64_t keep_last);

// The checkpoint folder `spec` names: "latest" (run_dir/checkpoints/latest), or anything
// find_checkpoint accepts. Throws CheckpointError when there is none.
std::string resolve_checkpoint(const std::string& run_dir, const std::string& spec);

// The checkpoint folder a path names, whichever of the names a user types it is: a checkpoint folder
// (RUN/checkpoints/step-NNNNNNN), the `latest` pointer file (RUN/checkpoints/latest), the checkpoints
// folder, or a run folder (its checkpoints/latest). Throws CheckpointError saying which it is not.
std::string find_checkpoint(const std::string& spec);
// Whether `path` is a `latest` pointer file (whatever its name): a small file holding a checkpoint's name.
bool is_checkpoint_pointer(const std::string& path);

// What a sampler reads for `spec`: a weights file as it is (megaslide-train --export-weights; a checkpoint's own
// file, beside the manifest that lists it, checked against it), or the checked model.safetensors of the checkpoint
// find_checkpoint finds. Throws CheckpointError.
std::string find_weights(const std::string& spec);
// The checked model_ema.safetensors (the EMA of the weights, train.ema_decay) of the checkpoint `spec`
// names, or "" when `spec` is a weights file or the checkpoint has no EMA. Throws CheckpointError.
std::string find_ema_weights(const std::string& spec);

// The newest checkpoint `latest` names, or "" when the run has none. Reads at most a few bytes.
std::string latest_checkpoint(const std::string& run_dir);

// The complete checkpoint folders of a run (RUN/checkpoints/step-NNNNNNN holding a manifest), oldest first:
// what a run whose `latest` is missing or a broken link can still be resumed from by name.
std::vector<std::string> complete_checkpoints(const std::string& run_dir);

// The step a checkpoint's manifest records.
int64_t checkpoint_step(const std::string& path);

// Rolling back: a run resumed from an older checkpoint of its own folder first points `latest` at it
// (one atomic rename), before it writes anything else, so that a crash at any later moment leaves
// `latest` on a complete checkpoint of the history the folder's logs now describe. Newer checkpoints
// of the abandoned history stay until this run saves their step again (replaced atomically) or
// passes them (then pruned as older ones). Returns whether `latest` moved.
bool roll_back_latest(const std::string& run_dir, const std::string& checkpoint);
// Whether `checkpoint` is a checkpoint folder of run_dir's own (RUN/checkpoints/NAME, however spelled: a trailing
// slash, "." or "..", links).
bool is_checkpoint_of(const std::string& run_dir, const std::string& checkpoint);

// Settings that a checkpoint allows to change but that make the continuation differ from an
// uninterrupted run (train.threads: LibTorch's CPU reductions split by thread count; a train section that
// moves the next step's learning rate, such as more train.steps under the cosine), one sentence each; empty
// when the resumed run continues bit for bit.
// `training` false (an export that trains nothing): what only a continued run would meet (the learning rate) is
// left out.
std::vector<std::string> resume_warnings(const std::string& path, const RunConfig& config, bool training = true);

namespace detail {
// Test seam: called at each durable stage of save_checkpoint — "complete" (the new checkpoint is whole
// in its temporary folder), "moved-aside" (only where the file system cannot exchange: the old copy of
// the same step renamed away), "in-place" (the new one has its final name), "latest" (`latest` names
// it). A test throws from it to stop a save exactly there, as a crash would. Empty: none (default).
void set_save_checkpoint_observer(std::function<void(const std::string& stage)> observer);
}  // namespace detail

// Verifies the manifest (every file present, sizes and CRC-32s), parses the state and checks that its
// config is compatible with `config` (model, data and diffusion sections, offload.compute_dtype; the
// train section may differ, e.g. more steps), then reads master, m and v straight into `into`'s tensors,
// whose names and shapes must match the files exactly. Fills `into`'s counters and data_state.
// into.shards: the blocks' ranges are filled from per-parameter files or from the shard files of any
// number of ranks (the blocks' layouts must match); a checkpoint of the same world size is read in
// place, bit for bit.
void load_checkpoint(const std::string& path, const RunConfig& config, TrainingState& into);

// The resolved config a checkpoint folder was saved with (its trainer_state.json). Throws CheckpointError.
RunConfig checkpoint_config(const std::string& path);
// A Wan LoRA checkpoint holds the adapters alone: refuses (CheckpointError naming the key) a `config` that resumes it
// — to train, or to merge (--export-merged) — without the weights file of the frozen model it was saved with
// (model.wan.weights, weights_2), unless its train.init_from names the model. Exporting the adapters alone needs none.
void check_frozen_base_kept(const std::string& path, const RunConfig& config);

// Checks a checkpoint's manifest and every file's size and checksum; returns the path of its
// model.safetensors.
std::string verify_checkpoint(const std::string& path);

// Checks the manifest and model.safetensors only (what sampling reads); returns that file's path.
std::string checkpoint_weights(const std::string& path);

// `--resume` plus `--export-weights`: copies the checkpoint's bf16 weights file (the weights-file
// format, model/dit_weights.h) to `out`, checking its size and CRC-32 as it copies (one read, only of that
// file), without building a trainer; a Wan run's checkpoint is written as --export-weights writes Wan's
// weights instead (diffusers' names, save_wan_weights), after its checksum is verified. `ema`: the
// checkpoint's EMA (model_ema.safetensors) instead; a checkpoint without one is a CheckpointError.
// `layout` (megaslide-train --export-layout): a Wan checkpoint's weights in ComfyUI's single file instead
// (save_wan_comfyui_weights; `out` names it, or the two experts' files by wan_comfyui_files); a layout other
// than diffusers for a checkpoint that is not a Wan run's is a CheckpointError; `comfyui_differences` (when
// given) then receives what ComfyUI would read differently of the checkpoint's model (wan_comfyui_differences).
// Returns the checkpoint's path.
std::string export_checkpoint_weights(const std::string& run_dir, const std::string& spec, const std::string& out,
                                      bool ema = false, WanWeightsLayout layout = WanWeightsLayout::kDiffusers,
                                      std::vector<std::string>* comfyui_differences = nullptr);

}  // namespace megaslide
