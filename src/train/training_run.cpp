#include "megaslide/train/training_run.h"

#include <fmt/format.h>
#include <torch/cuda.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "megaslide/data/video_manifest.h"
#include "megaslide/diffusion/text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/model/wan.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/distributed.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/run_folder.h"
#include "megaslide/train/run_outputs.h"
#include "megaslide/train/trainer.h"
#include "megaslide/util/build_info.h"
#include "megaslide/util/cpu_resources.h"
#include "megaslide/util/cpu_tensor_cache.h"
#include "megaslide/util/device.h"
#include "megaslide/util/errors.h"
#include "megaslide/util/numbers.h"

namespace megaslide {

// The families (train/model_family.h): a new one adds its line here.
const ModelFamily& model_family(Architecture arch) { return arch == Architecture::kWan ? wan_family() : dit_family(); }

namespace {

// The run log on rank 0; other ranks write RUN_DIR/logs/rank-N.log with distributed.rank_logs, else
// nothing (their errors reach their own stderr).
class RankLog {
 public:
  void open(const std::string& path, bool append, bool echo = true) {
    log_ = std::make_unique<TrainLog>(path, append, echo);
  }
  void info(const std::string& message) {
    if (log_) log_->info(message);
  }
  void warn(const std::string& message) {
    if (log_) log_->warn(message);
  }

 private:
  std::unique_ptr<TrainLog> log_;
};

}  // namespace

namespace {
// The bytes of a checkpoint folder's files (its shards included) and the seconds since `started`, for the log:
// "681.4 MB in 0.74 s, 0.92 GB/s".
std::string bytes_and_rate(const std::string& checkpoint, std::chrono::steady_clock::time_point started) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  uint64_t bytes = 0;
  try {
    for (const std::string& folder : {checkpoint, io::join_path(checkpoint, "shards")}) {
      if (!io::is_directory(folder)) continue;
      for (const auto& name : io::list_directory(folder))
        if (!io::is_directory(io::join_path(folder, name))) bytes += io::file_size(io::join_path(folder, name));
    }
  } catch (const io::IoError&) {
    return fmt::format("{:.2f} s", seconds);  // a figure for the log only: never a reason to stop the run
  }
  return fmt::format("{} in {:.2f} s, {}/s", human_bytes(static_cast<double>(bytes)), seconds,
                     human_bytes(static_cast<double>(bytes) / std::max(seconds, 1e-9)));
}

// What memory_shortfall counts a parameter: the fp32 master and AdamW's moments, as optimizer.state_dtype keeps them
// in the streamed trainer (12 B in fp32) and in fp32 in the resident loop; a LoRA run's frozen model alone, or the
// NVMe tier's compute copy alone (host_state_per_parameter).
HostStatePerParameter state_lower_bound(const RunConfig& config) {
  const HostStatePerParameter held = host_state_per_parameter(config);
  // (whole on every rank: master_and_moments 0, the NVMe tier's being on disk)
  if (config.lora.rank > 0 || (config.offload.enabled && config.offload.state_tier == "nvme"))
    return {held.bytes, 0.0, held.what};
  if (config.offload.enabled)
    return {held.master_and_moments, held.master_and_moments,
            "fp32 weights and AdamW moments (" + config.optimizer.state_dtype + ")"};
  return {12.0, 12.0, "fp32 weights and AdamW moments"};
}
}  // namespace

std::string memory_shortfall(const RunConfig& config, int64_t available_bytes, bool state_in_host_memory,
                             int64_t state_shards) {
  // A lower bound of what a trainer holds in host memory before its first step: fp32 weights and
  // AdamW's two fp32 moments (12 B a parameter; the streamed trainer adds a compute copy) where they
  // live in host memory (a LoRA run's frozen model, or the NVMe tier's compute copy, instead: state_lower_bound),
  // one batch of video in fp32 and the data sampler's order. The real need is
  // larger (activations, the streamed trainer's buffers: megaslide-plan counts them); only a run that
  // cannot fit even this bound is refused, so that it fails here in one line instead of swapping or
  // being killed later.
  const int64_t params = count_run_parameters(config).total;
  const auto& d = config.data;
  const HostStatePerParameter held = state_lower_bound(config);
  // The frozen model or the compute copy is whole on every rank; the masters and moments are sharded.
  const bool small = held.master_and_moments == 0.0;
  const double per_param = held.bytes;
  const std::string& what = held.what;
  const int64_t state = state_in_host_memory
                            ? std::llround(static_cast<double>(params) * per_param /
                                           static_cast<double>(small ? 1 : std::max<int64_t>(1, state_shards)))
                            : 0;  // validate() bounded one DiT's params * 14 below kMaxMachineBytes (2^50): no overflow
  const int64_t batch = config.train.batch_size * d.channels * d.frames * d.height * d.width * 4;
  const int64_t order = d.dataset == "structured-motion" ? d.num_clips * 8 : 0;  // other data: their items'
  const int64_t needed = state + batch + order;
  if (available_bytes <= 0 || needed <= available_bytes) return "";
  return fmt::format(
      "this run needs at least {} of memory ({} parameters x {:g} B of {} in host memory = {}; one batch of "
      "video, train.batch_size {} x {}x{}x{}x{} in fp32 = {}; the sampler's order of data.num_clips {} = {}) but this "
      "machine has {}: make the model, the batch or the video smaller (megaslide-plan --config ... shows where "
      "memory goes)",
      human_bytes(static_cast<double>(needed)), human_count(static_cast<double>(params)), per_param, what,
      human_bytes(static_cast<double>(state)), config.train.batch_size, d.channels, d.frames, d.height, d.width,
      human_bytes(static_cast<double>(batch)), d.num_clips, human_bytes(static_cast<double>(order)),
      human_bytes(static_cast<double>(available_bytes)));
}

namespace {
// Every rank must train the same config (a rank with another lr, seed or batch would train another
// model without a word; another model.hidden would abort rank 0 in a collective): rank 0's config as
// requested (before `auto` settings, which may differ with each machine's cores) goes to every rank,
// which compares it with its own, and all ranks learn whether any differed. A mismatch is a ConfigError
// on every rank: the differing one names the first key that differs, rank 0 the ranks that differ.
void check_ranks_run_one_config(Communicator& communicator, const RunConfig& mine, const std::string& source) {
  if (communicator.world_size() == 1) return;
  const std::string theirs_text = communicator.text_from_rank0("config", to_yaml(mine));
  std::string problem;
  try {
    const RunConfig theirs = parse_run_config(theirs_text, "rank 0's config");
    if (const auto keys = differing_keys(mine, theirs); !keys.empty())
      problem = fmt::format("{} is {} on this rank (rank {}) but {} on rank 0{}", keys.front(),
                            config_value_text(mine, keys.front()), communicator.rank(),
                            config_value_text(theirs, keys.front()),
                            keys.size() > 1 ? fmt::format(" ({} keys differ)", keys.size()) : "");
  } catch (const ConfigError& e) {
    problem = std::string("rank 0's config does not load here: ") + e.what();
  }
  std::vector<at::Tensor> flags{torch::full({static_cast<int64_t>(communicator.world_size())}, 0, torch::kInt64)};
  flags[0][communicator.rank()] = problem.empty() ? 0 : 1;
  communicator.all_reduce_sum(flags);
  const auto differ = flags[0].cpu();
  std::string ranks;
  for (int64_t r = 0; r < communicator.world_size(); ++r)
    if (differ[r].item<int64_t>() != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  if (ranks.empty()) return;
  if (!problem.empty()) throw ConfigError(source, "", problem + "; every rank must run the same config");
  throw ConfigError(source, "",
                    fmt::format("rank(s) {} run a config that differs from rank 0's (each one's error names the first "
                                "differing key); every rank must run the same config",
                                ranks));
}
}  // namespace

TrainingRunResult run_training(const RunConfig& requested, const TrainingRunOptions& options) {
  // Several ranks (train/distributed.h): the launcher's environment says which this process is. Each
  // rank trains on its GPU (train.device auto/cuda -> cuda:LOCAL_RANK); rank 0 alone writes the run
  // folder (log, metrics, checkpoints, samples, export).
  LaunchEnv launch;
  try {
    launch = read_launch_env();
  } catch (const DistributedError& e) {
    throw ConfigError(options.config_source, "", e.what());
  }
  if (options.export_only && options.resume.empty())
    throw std::invalid_argument("run_training: export_only writes a checkpoint's exports: it needs `resume`");
  if (!options.export_merged.empty() && requested.lora.rank <= 0)
    throw ConfigError(options.config_source, "lora.rank",
                      "is 0: --export-merged merges a LoRA run's adapters into its model; a full fine-tuning run "
                      "exports its weights with --export-weights");
  if (!options.export_ema.empty() && requested.train.ema_decay <= 0)
    throw ConfigError(options.config_source, "train.ema_decay",
                      "is 0: this run keeps no EMA of the weights for --export-ema to write");
  if (options.export_layout != WanWeightsLayout::kDiffusers &&
      (!options.export_weights.empty() || !options.export_ema.empty() || !options.export_merged.empty())) {
    const std::string flag = std::string("--export-layout ") + to_string(options.export_layout);
    if (requested.model.arch != Architecture::kWan)
      throw ConfigError(options.config_source, "model.arch",
                        std::string("is ") + to_string(requested.model.arch) + ": " + flag +
                            " writes a Wan's weights (model.arch wan) in ComfyUI's layout; export without it");
    if (requested.model.self_attention == "dsa3d")
      throw ConfigError(options.config_source, "model.self_attention",
                        "is dsa3d: ComfyUI could not load the 3D-DSA retrofit's offset networks "
                        "(blocks.*.attn1.offset_dw.*, offset_pw.*, rel_bias), which " +
                            flag + " would have to leave out: export diffusers' layout (--export-layout diffusers)");
  }
  // An explicit cuda:N where the node's ranks see the same GPUs: NCCL would refuse them all on that one. (Where each
  // rank sees one GPU of its own — CUDA_VISIBLE_DEVICES or Slurm's --gpus-per-task — cuda:0 is the way to name it.)
  if (launch.distributed() && launch.local_world_size > 1 && requested.train.device.rfind("cuda:", 0) == 0 &&
      requested.distributed.backend != "gloo" && torch::cuda::device_count() > 1)
    throw ConfigError(options.config_source, "train.device",
                      fmt::format("is {}, which all {} ranks of this node would use (NCCL refuses two ranks on one "
                                  "GPU): set cuda or auto, and each rank takes the GPU of its local rank",
                                  requested.train.device, launch.local_world_size));
  RunConfig per_rank = requested;
  per_rank.train.device = rank_device_spec(requested.train.device, launch);
  if (launch.distributed())
    if (const auto [key, problem] = world_size_problem(requested, launch.world_size); !key.empty())
      throw ConfigError(options.config_source, key, problem);
  // `auto` settings resolved once: config.yaml, the log and checkpoints carry the resolved values, and a
  // resume compares them with the checkpoint's.
  const ModelFamily& family = model_family(requested.model.arch);
  const RunConfig config = family.resolve(resolve_auto_settings(per_rank), options.config_source);
  const std::string& run_dir = config.output.run_dir;
  const auto& train = config.train;
  const bool writer = launch.rank == 0;  // the rank that writes the run folder
  // A validation prompt file that cannot be read or asks for what the model cannot sample refuses the
  // run here, before anything is written (the trainer plans the videos again from it).
  if (writer && train.sample_every > 0 && !train.sample_prompts.empty())
    plan_validation_videos(config, {}, options.config_source);
  TrainingRunResult result;
  std::unique_ptr<Communicator> communicator;
  // Launched ranks talk through a process group: several ranks, or the resident trainer's one rank (the
  // GPU check runs NCCL that way on its one GPU).
  if (launch.distributed() || (launch.launcher != "none" && !config.offload.enabled)) {
    torch::Device device = torch::kCPU;
    try {
      device = resolve_device(train.device);
    } catch (const c10::Error& e) {
      throw ConfigError(options.config_source, "train.device", error_message(e));
    }
    // First, so that a rank refusing its input below ends the others' waits at once (its sockets close).
    communicator =
        std::make_unique<Communicator>(launch, resolve_backend(config.distributed, device, options.config_source),
                                       config.distributed.timeout_s, device);
    check_ranks_run_one_config(*communicator, requested, options.config_source);
  }

  // Everything that can refuse the input happens before the first byte of the run is written: the run
  // folder is locked (and a fresh run refused when the folder holds one), the output paths checked,
  // the device and the memory the run needs checked, and load_checkpoint verifies the checkpoint
  // (every file read once for its checksum) before it reads a tensor.
  std::optional<RunFolderGuard> guard;
  if (writer) guard.emplace(run_dir, /*resuming=*/!options.resume.empty());
  try {
    if (!options.trace_path.empty()) io::check_output_file(options.trace_path, "--trace");
    // ComfyUI's layout (and a Wan LoRA) writes one file per expert beside the path given (wan_comfyui_files).
    const auto check_export = [&](const std::string& path, const char* flag) {
      if (config.lora.rank > 0)
        for (const auto& file : lora_weights_files(path, config)) io::check_output_file(file, flag);
      else if (options.export_layout == WanWeightsLayout::kDiffusers) io::check_output_file(path, flag);
      else
        for (const auto& file : wan_comfyui_files(path, config.model.wan)) io::check_output_file(file, flag);
    };
    if (!options.export_weights.empty()) check_export(options.export_weights, "--export-weights");
    if (!options.export_ema.empty()) check_export(options.export_ema, "--export-ema");
    if (!options.export_merged.empty()) {  // a full weights file, laid out as full fine-tuning's export
      if (options.export_layout == WanWeightsLayout::kDiffusers)
        io::check_output_file(options.export_merged, "--export-merged");
      else
        for (const auto& file : wan_comfyui_files(options.export_merged, config.model.wan))
          io::check_output_file(file, "--export-merged");
    }
  } catch (const io::IoError& e) {
    throw FlagError(e.what());  // "--export-weights 'PATH': ...": the flag's, not the config's
  }
  // The NVMe tier creates its state file in offload.nvme_dir at start: the folder must exist and take files.
  if (config.offload.enabled && config.offload.state_tier == "nvme") {
    const std::string& folder = config.offload.nvme_dir;
    if (!io::is_directory(folder))
      throw ConfigError(options.config_source, "offload.nvme_dir",
                        "'" + folder + "' is not a folder: the NVMe tier's state file is created in an existing one");
    if (::access(folder.c_str(), W_OK | X_OK) != 0)
      throw ConfigError(options.config_source, "offload.nvme_dir",
                        "'" + folder + "': this process cannot create files in it (" + std::strerror(errno) + ")");
  }
  // A save that cannot succeed (a read-only or foreign checkpoints folder, a path too long) is refused here, not
  // met at the first checkpoint after hours of training.
  if (writer && !options.export_only) {
    try {
      check_checkpoints_writable(run_dir, train.steps);
    } catch (const CheckpointError& e) {
      throw ConfigError(options.config_source, "output.run_dir", e.what());
    }
    // The run's own files are written in place or replaced: one that is a folder or a link stops the run here,
    // before any of them (config.yaml first) has changed.
    for (const char* name : {"config.yaml", "train.log", "metrics.jsonl"}) {
      const std::string path = io::join_path(run_dir, name);
      if (io::is_symlink(path) || (io::path_exists(path) && io::is_directory(path)))
        throw ConfigError(options.config_source, "output.run_dir",
                          fmt::format("'{}' is {}: the run writes its {} there; move it away", path,
                                      io::is_symlink(path) ? "a symbolic link" : "a folder", name));
    }
  }
  bool state_in_host_memory = true;
  try {
    // The resident loop keeps its weights and moments on its device; the streamed trainer in host RAM.
    const bool on_cpu = resolve_device(train.device).is_cpu();  // checked whichever trainer runs
    state_in_host_memory = config.offload.enabled || on_cpu;
  } catch (const c10::Error& e) {
    throw ConfigError(options.config_source, "train.device", error_message(e));
  }
  // The trainer's samples (Wan's are latents of the videos' cache, or data.tensors').
  const RunConfig sized = family.sample_config(config);
  // The sharded streamed trainer keeps 1/R of the weights and moments per rank; ranks on one machine share it.
  const int64_t state_shards = config.offload.enabled && launch.distributed()
                                   ? launch.world_size / std::max<int64_t>(1, launch.local_world_size)
                                   : 1;
  if (const std::string shortfall =
          memory_shortfall(sized, available_memory_bytes(), state_in_host_memory, state_shards);
      !shortfall.empty()) {
    const auto& d = sized.data;
    const double state_bytes =
        static_cast<double>(count_run_parameters(config).total) * state_lower_bound(config).bytes;
    const bool batch_dominates =
        !state_in_host_memory ||
        static_cast<double>(config.train.batch_size * d.channels * d.frames * d.height * d.width * 4) > state_bytes;
    throw ConfigError(options.config_source, batch_dominates ? "train.batch_size" : "model", shortfall);
  }
  std::string resume_path;
  if (!options.resume.empty()) {
    resume_path = resolve_checkpoint(run_dir, options.resume);
    // Another run's checkpoint starts this folder's history afresh: only in a folder without a run of its own,
    // whose metrics and checkpoints it would replace.
    // (Rank 0's check, before it writes: the other ranks would see what it writes next.)
    if (writer && !options.export_only && !is_checkpoint_of(run_dir, resume_path))
      if (const std::string existing = describe_existing_run(run_dir); !existing.empty())
        throw RunFolderError(fmt::format(
            "run folder '{}' holds a run of its own ({}), and --resume names a checkpoint of another folder ('{}'): "
            "continuing it here would replace that run's metrics and checkpoints; continue it into another "
            "--run-dir (a new or empty one), or this folder's own run with --resume latest",
            run_dir, existing, resume_path));
    const int64_t saved_step = checkpoint_step(resume_path);
    if (saved_step > train.steps && !options.export_only)
      throw ConfigError(
          options.config_source, "train.steps",
          fmt::format("is {} but checkpoint {} is already at step {}: nothing would be trained; set train.steps "
                      "above {} to continue it",
                      train.steps, resume_path, saved_step, saved_step));
  }
  // The trainer, from train.init_from on a fresh run (a resumed one continues its checkpoint; a resumed LoRA run's
  // frozen model, which its checkpoint does not hold, starts from train.init_from again). It loads the frozen
  // encoders the config names (CLIP, the VAE, umT5): bad folders or sizes that disagree with the config are the
  // config's errors.
  TrainerRequest request;
  request.config = &config;
  request.requested = &requested;
  request.source = options.config_source;
  request.init_from = !config.train.init_from.empty() && (resume_path.empty() || config.lora.rank > 0);
  request.resuming = !resume_path.empty();
  request.validation = writer && train.sample_every > 0 && !options.export_only;
  // The validation loss's data (train.val_every), on rank 0, which measures it.
  std::optional<RunConfig> validation_data;
  if (writer && train.val_every > 0 && !options.export_only)
    validation_data = validation_data_config(config, options.config_source);
  request.validation_data = validation_data ? &*validation_data : nullptr;
  request.communicator = communicator.get();
  std::unique_ptr<Trainer> trainer_holder;
  try {
    trainer_holder = std::make_unique<Trainer>(request);
  } catch (const ConfigError& e) {
    throw ConfigError(options.config_source, e.key(), e.problem());
  }
  Trainer& trainer = *trainer_holder;
  // The exports after the last step, or from the checkpoint (options.export_only): every rank takes part (a sharded
  // trainer's EMA is gathered), rank 0 writes. Returns what was written, for the log.
  const auto write_exports = [&] {
    std::vector<std::string> exported;
    const auto joined = [](const std::vector<std::string>& files) {  // "a and b": one file per expert
      std::string listed;
      for (const auto& file : files) listed += (listed.empty() ? "" : " and ") + file;
      return listed;
    };
    // ComfyUI's layout: the Wan family's weights under their original names (model/wan_weights.h).
    const auto write_export = [&](const std::string& path, const io::NamedTensors& weights) {
      if (config.lora.rank > 0) {  // the adapters: a LoRA file (per expert), ComfyUI's LoRA names for its layouts
        const bool diffusers = options.export_layout == WanWeightsLayout::kDiffusers;
        return joined(save_lora_weights(path, config, weights,
                                        diffusers ? LoraLayout::kDiffusers : LoraLayout::kComfyUi)) +
               (diffusers ? " (LoRA, diffusers' layout)" : " (LoRA, ComfyUI's layout)");
      }
      if (options.export_layout == WanWeightsLayout::kDiffusers) {
        trainer.write_weights(path, weights);
        // Wan2.2's two experts: diffusers' repository folder, whatever the path's name says.
        if (config.model.arch == Architecture::kWan && config.model.wan.expert == "both")
          return path + " (a folder: diffusers' repository of both experts, transformer/ and transformer_2/ with " +
                 "model_index.json)";
        return path;
      }
      return joined(save_wan_comfyui_weights(path, config.model.wan, weights,
                                             options.export_layout == WanWeightsLayout::kComfyUI)) +
             " (ComfyUI's layout)";
    };
    if (writer && !options.export_weights.empty()) {
      const std::string written = write_export(options.export_weights, trainer.weight_views());
      exported.push_back(fmt::format("weights written to {}", written));
    }
    if (writer && !options.export_merged.empty()) {
      const auto merged = trainer.merged_lora_weights(trainer.weight_views());
      std::string written = options.export_merged;
      if (options.export_layout == WanWeightsLayout::kDiffusers)
        trainer.write_base_weights(options.export_merged, merged);
      else
        written = joined(save_wan_comfyui_weights(options.export_merged, config.model.wan, merged,
                                                  options.export_layout == WanWeightsLayout::kComfyUI)) +
                  " (ComfyUI's layout)";
      exported.push_back(fmt::format("weights with the LoRA merged written to {}", written));
    }
    if (!options.export_ema.empty()) {
      const auto state = trainer.training_state();
      const io::NamedTensors ema =
          gather_ema_weights(state, writer);  // every rank: a sharded trainer's blocks put together
      if (writer) {
        const std::string written = write_export(options.export_ema, ema);
        exported.push_back(fmt::format("EMA of the weights written to {}", written));
      }
    }
    return exported;
  };
  std::vector<std::string> warnings;
  std::string resume_read;  // what the resume read, for the log
  // What ComfyUI assumes of Wan and this model does not, said for every export in its layouts.
  std::vector<std::string> comfyui_warnings;
  if (options.export_layout != WanWeightsLayout::kDiffusers &&
      (!options.export_weights.empty() || !options.export_ema.empty() || !options.export_merged.empty()))
    for (const auto& difference : wan_comfyui_differences(config.model.wan))
      comfyui_warnings.push_back("ComfyUI will not load the exported file as this model: " + difference);
  if (!resume_path.empty()) {
    const auto started = std::chrono::steady_clock::now();
    TrainingState state = trainer.training_state();
    if (!options.export_only || !options.export_merged.empty()) check_frozen_base_kept(resume_path, config);
    load_checkpoint(resume_path, config, state);
    try {
      trainer.load_training_state(state);
    } catch (const std::invalid_argument& e) {
      throw CheckpointError("checkpoint '" + resume_path + "': trainer_state.json: " + e.what());
    }
    result.first_step = state.step;
    resume_read = bytes_and_rate(resume_path, started);
    warnings = resume_warnings(resume_path, config, /*training=*/!options.export_only);
    if (options.export_only) {  // the checkpoint's exports: nothing trained, nothing else written
      result.warnings = std::move(warnings);
      result.warnings.insert(result.warnings.end(), comfyui_warnings.begin(), comfyui_warnings.end());
      result.exported = write_exports();
      return result;
    }
  }
  const InitPlan& init = trainer.init_plan();

  std::optional<RunDirectory> dir;
  std::optional<MetricsWriter> metrics;
  std::optional<TensorBoardLog> tensorboard;
  RankLog log;
  if (writer) {
    dir.emplace(run_dir, config);
    guard->started();
    log.open(dir->file("train.log"), /*append=*/!resume_path.empty());
    // Once the log is open (a run that cannot open it leaves `latest` as it was), before the metrics drop the lines
    // past the checkpoint (a rollback that fails leaves them).
    if (!resume_path.empty() && roll_back_latest(run_dir, resume_path))
      warnings.push_back(fmt::format(
          "rolled back: {} now names {}; the newer checkpoints of the abandoned run are replaced as this run "
          "saves their steps again",
          io::join_path(run_dir, "checkpoints/latest"), resume_path));
    metrics.emplace(dir->file("metrics.jsonl"), resume_path.empty() ? -1 : result.first_step);
    if (!metrics->dropped().empty())
      warnings.push_back(fmt::format("{}: {} {} no step's metrics (not JSON, or no \"step\"): dropped",
                                     dir->file("metrics.jsonl"), fmt::join(metrics->dropped(), ", "),
                                     metrics->dropped().size() == 1 ? "holds" : "hold"));
    if (config.output.tensorboard) tensorboard.emplace(dir->file("tensorboard"), config, result.first_step);
  }
  if (communicator) {
    communicator->barrier();  // rank 0 has taken and written the run folder
    if (!writer && config.distributed.rank_logs) {
      try {
        io::make_directories(io::join_path(run_dir, "logs"));
      } catch (const io::IoError& e) {
        throw OutputError(e.what());
      }
      log.open(io::join_path(run_dir, fmt::format("logs/rank-{}.log", launch.rank)), !resume_path.empty(),
               /*echo=*/false);
    }
  }
  log.info(build_summary());
  const int64_t cp = config.distributed.context_parallel;
  const std::string rendezvous = launch.meets_nobody()
                                     ? std::string("one process, no rendezvous")
                                     : fmt::format("rendezvous {}:{}", launch.master_addr, launch.master_port);
  if (communicator && cp == 1)
    log.info(fmt::format(
        "rank {}: data parallel: {} ranks ({} backend, launched by {}, {}), {} items of each global batch of {} per "
        "rank",
        launch.rank, communicator->world_size(), communicator->backend(), launch.launcher, rendezvous,
        train.batch_size / communicator->world_size(), train.batch_size));
  else if (communicator)
    log.info(fmt::format(
        "rank {}: context parallel: {} ranks in groups of {} ({} backend, launched by {}, {}); each group's {} items "
        "of each global batch of {} shared by its ranks, every sample's frames split among them (data parallel over "
        "{} groups)",
        launch.rank, communicator->world_size(), cp, communicator->backend(), launch.launcher, rendezvous,
        train.batch_size / (communicator->world_size() / cp), train.batch_size, communicator->world_size() / cp));
  log.info(fmt::format("config {} -> run dir {}", options.config_source, run_dir));
  log.info(fmt::format("model {} ({} {}), {} tokens per sample, device {}, {} steps", to_string(config.model.arch),
                       human_count(static_cast<double>(trainer.parameter_count())),
                       config.lora.rank > 0 ? "trained parameters: the LoRA adapters"
                       : config.model.arch != Architecture::kWan && config.model.text_encoder.kind == "builtin"
                           ? "parameters, its caption encoder included"
                           : "parameters",
                       trainer.tokens_per_sample(), trainer.device().str(), train.steps));
  std::vector<std::string> family_warnings;
  {
    std::vector<std::string> lines;
    trainer.describe(lines, family_warnings);
    for (const auto& line : lines) log.info(line);
  }
  for (const auto& w : family_warnings) log.warn(w);
  // Wan's sizes are its weights': a size the config gave otherwise is replaced, said rather than silently.
  if (config.model.arch == Architecture::kWan && !config.model.wan.weights.empty()) {
    for (const auto& key : differing_keys(requested, config)) {
      // weights_2 and boundary_ratio, left empty or 0, are found in the repository: defaults, not sizes.
      if (key.rfind("model.wan.", 0) != 0 || key == "model.wan.weights_2" || key == "model.wan.boundary_ratio" ||
          !requested.given.count(key))
        continue;
      log.warn(fmt::format("{} is {} in the config but {} in model.wan.weights: the weights' is used", key,
                           config_value_text(requested, key), config_value_text(config, key)));
    }
  }
  for (const auto& w : unused_settings(config)) log.warn(w);
  log.info(plan_threads(config, trainer.device()).describe());
  if (const auto cache = util::cpu_tensor_cache_stats())
    log.info(fmt::format("CPU tensor cache: spare blocks of {} and more kept up to {} (MEGASLIDE_CPU_TENSOR_CACHE)",
                         human_bytes(static_cast<double>(cache->min_block_bytes)),
                         human_bytes(static_cast<double>(cache->cap_bytes))));
  else log.info("CPU tensor cache: none (MEGASLIDE_CPU_TENSOR_CACHE=off, or a program that installs none)");
  if (!options.trace_path.empty() && !trainer.streams())
    log.warn("--trace records a streamed trainer only (offload.enabled: true); ignored");
  for (const auto& w : comfyui_warnings) log.warn(w);
  if (!resume_path.empty())
    log.info(
        fmt::format("resumed from {} at step {} (verified and read: {})", resume_path, result.first_step, resume_read));
  if (tensorboard)
    log.info(fmt::format("TensorBoard: {} (tensorboard --logdir {})", tensorboard->path(), dir->file("tensorboard")));
  for (const auto& w : warnings) log.warn(w);
  if (!resume_path.empty() && result.first_step == train.steps)
    log.info(fmt::format("the checkpoint is at train.steps ({}): the run is complete, nothing to train", train.steps));
  if (!init.path.empty()) {
    std::string kept;
    for (const auto& name : init.kept) kept += (kept.empty() ? "" : ", ") + name;
    log.info(fmt::format("{} from {}: {} tensors; {} parameters keep their initialisation{}{}",
                         resume_path.empty()
                             ? "initialised"
                             : "the frozen model (a LoRA checkpoint holds the adapters alone) initialised",
                         init.path, init.tensors.size(), init.kept.size(), init.kept.empty() ? "" : ": ", kept));
  } else if (!resume_path.empty() && !config.train.init_from.empty()) {
    log.info("train.init_from ignored: the run resumes from its checkpoint");
  }
  // A fresh Wan run with no model to start from (train.init_from naming a LoRA run's adapters gives none).
  if (resume_path.empty() && config.model.arch == Architecture::kWan && config.model.wan.weights.empty() &&
      (init.path.empty() || holds_lora_adapters(init.path) == std::optional<bool>(true)))
    log.warn(
        "model.wan.weights is empty and train.init_from names no model: the Wan DiT starts from random weights, a "
        "run from scratch (fine-tuning reads Wan's weights there; docs/wan.md)");
  // A run that would end with nothing of its training on disk: said before the first step, not after the last.
  if (train.checkpoint_every == 0 && options.export_weights.empty() && options.export_ema.empty() &&
      options.export_merged.empty() && result.first_step < train.steps)
    log.warn(
        "train.checkpoint_every is 0 and there is no --export-weights: this run keeps no weights unless it is "
        "stopped by a signal (which writes a checkpoint); set train.checkpoint_every (a checkpoint also after the "
        "last step) or pass --export-weights FILE");
  if (const std::string what = trainer.describe_data(train.steps); !what.empty()) log.info("data: " + what);
  auto report_bad_items = [&] {
    for (const auto& b : trainer.take_new_bad_items())
      log.warn(fmt::format("bad item skipped: {}: {}", b.path, b.reason));
  };
  report_bad_items();

  int64_t last_saved = result.first_step;
  // Sharded (the streamed trainer over several ranks): every rank saves its shard, rank 0 the rest.
  const bool sharded = trainer.sharded();
  RankSum rank_sum;
  if (sharded)
    rank_sum = [&communicator](std::vector<int64_t>& values) {
      std::vector<torch::Tensor> t{torch::tensor(values, torch::kInt64)};
      communicator->all_reduce_sum(t);
      const auto summed = t[0].cpu();
      for (size_t i = 0; i < values.size(); ++i) values[i] = summed[static_cast<int64_t>(i)].item<int64_t>();
    };
  auto save_now = [&](const char* why) {
    const TrainingState state = trainer.training_state();  // waits for host updates still running
    try {
      const auto started = std::chrono::steady_clock::now();
      result.last_checkpoint = save_checkpoint(run_dir, config, state, rank_sum);
      last_saved = state.step;
      log.info(fmt::format("step {}: checkpoint ({}) {} ({})", state.step, why, result.last_checkpoint,
                           bytes_and_rate(result.last_checkpoint, started)));
    } catch (const CheckpointError& e) {
      log.warn(e.what());
      return false;
    } catch (const DistributedError& e) {  // a rank gone while the shards were saved: that checkpoint is not there
      throw DistributedError(
          fmt::format("saving the checkpoint of step {} ({}), which is lost: {}", state.step, why, e.what()));
    }
    // The new checkpoint is saved: an old one that cannot be removed (a folder made read-only to keep it) stays.
    if (writer) {
      try {
        for (const auto& removed : prune_checkpoints(run_dir, train.keep_last))
          log.info("removed old checkpoint " + removed);
      } catch (const std::exception& e) {
        log.warn(fmt::format("removing old checkpoints (train.keep_last {}): {}; they stay, the run continues",
                             train.keep_last, e.what()));
      }
    }
    return true;
  };
  // The NVMe tier's reads of a save are left out of the next step's figures (Trainer::outside_steps).
  auto save = [&](const char* why) {
    if (!writer && !sharded) return true;  // every rank holds the same state; rank 0 saves it
    bool saved = false;
    trainer.outside_steps([&] { saved = save_now(why); });
    return saved;
  };

  const int64_t start = result.first_step;
  // The step --trace records: --trace-step, or the nearest step this run trains (a resumed run starts past it).
  const int64_t traced = std::clamp(options.trace_step, std::min(start + 1, train.steps), train.steps);
  // Work of rank 0 alone (validation, a replicated state's checkpoint), the other ranks waiting for it however long
  // it takes (Communicator::run_on_rank0) rather than in their next collective with its timeout.
  const auto on_rank0 = [&](const std::string& what, const std::function<void()>& work) {
    if (communicator) communicator->run_on_rank0(what, work);
    else work();
  };
  // Where a run that stops on an error can be resumed from, for its message: the checkpoint `latest` names (an
  // unreadable `latest`: the newest complete checkpoint).
  const auto resumable_from = [&] {
    std::string last;
    try {
      last = latest_checkpoint(run_dir);
    } catch (const std::exception&) {
      const auto complete = complete_checkpoints(run_dir);
      if (!complete.empty()) last = complete.back();
    }
    return last.empty() ? std::string("there is no checkpoint to resume from") : "the last checkpoint is " + last;
  };
  ProgressLine progress(train.steps, train.log_every, config.output.progress && writer, start);
  double window = 0.0;
  int64_t window_steps = 0;
  std::map<std::string, std::pair<double, int64_t>> part_window;  // per part: the window's sum and steps
  result.steps_done = start;
  for (int64_t i = start; i < train.steps; ++i) {
    if (trainer.streams() && !options.trace_path.empty() && i + 1 == traced)
      trainer.trace_next_step(options.trace_path);
    StepMetrics m;
    try {
      m = trainer.step();
    } catch (const DatasetError& e) {
      // Too many items failed while decoding (the dataset's check at start passed them): said in the log too,
      // with the step and the last checkpoint.
      progress.finish();
      report_bad_items();
      const std::string message = fmt::format("{}; stopped at step {} of {}: {}", e.what(), result.steps_done + 1,
                                              train.steps, resumable_from());
      log.warn(message);
      throw DatasetError(message);
    }
    report_bad_items();
    result.steps_done = m.step;
    if (train.val_every > 0 && (m.step % train.val_every == 0 || m.step == train.steps)) {
      // The validation loss on rank 0 (on_rank0). One that cannot be measured for want of memory or for bad validation
      // items is said and training goes on; anything else is an error of the run.
      auto measure = [&] {
        if (!writer) return;
        const auto started = std::chrono::steady_clock::now();
        try {
          m.val_loss = trainer.validation_loss();
          log.info(fmt::format("step {}: validation loss {:.5f} ({} batches of {}, {:.1f} s)", m.step, *m.val_loss,
                               train.val_batches, train.batch_size,
                               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()));
        } catch (const std::exception& e) {
          if (!is_out_of_memory(e) && !is_input_error(e)) throw;
          log.warn(fmt::format("step {}: the validation loss could not be measured ({}); training continues", m.step,
                               error_message(e)));
        }
      };
      on_rank0(fmt::format("the validation loss of step {}", m.step), measure);
    }
    try {
      if (metrics) metrics->write(m);
      if (tensorboard) tensorboard->step(m);
    } catch (const std::exception& e) {
      // The run's files cannot take this step (a full disk, a file size limit): stop as a signal would, with a
      // checkpoint of the state this process holds when it can be saved, so that no step is lost.
      progress.finish();
      // One process alone: with several ranks the others wait in a collective whose timeout a save could outlast.
      const bool alone = !communicator || communicator->world_size() == 1;
      bool saved = false;
      try {
        saved = alone && save("stop");
      } catch (const std::exception&) {
      }
      const std::string kept = saved ? "the trained state of step " + std::to_string(m.step) + " is in checkpoint " +
                                           result.last_checkpoint +
                                           "; continue with --resume latest once the run folder can be written"
                                     : (alone ? "no checkpoint of this step could be saved; " : "") + resumable_from();
      throw OutputError(
          fmt::format("writing the run's metrics of step {} failed: {}; {}", m.step, error_message(e), kept));
    }
    progress.update(m);
    if (m.skipped) {
      log.warn(fmt::format(
          "step {}: non-finite loss or gradient (loss {}, grad_norm {}); step skipped ({} in a row, {} in all)", m.step,
          m.loss, m.grad_norm, m.consecutive_skips, m.skipped_total));
      if (train.max_consecutive_skips > 0 && m.consecutive_skips >= train.max_consecutive_skips) {
        progress.finish();
        throw NonFiniteError(fmt::format(
            "stopping at step {}: {} consecutive steps had a non-finite loss or gradient (train.max_consecutive_skips: "
            "{}); "
            "the weights were not updated by them. Lower train.lr, raise train.warmup_steps or set train.grad_clip; {}",
            m.step, m.consecutive_skips, train.max_consecutive_skips, resumable_from()));
      }
    }
    if (train.sample_every > 0 && m.step % train.sample_every == 0) {
      // Validation videos on rank 0 (on_rank0).
      // Videos that cannot be written (no space, a read-only samples/ folder, the device's memory) are said and
      // training goes on, as for a checkpoint that cannot be saved.
      auto validate = [&] {
        if (!writer) return;
        const auto samples = dir->file(fmt::format("samples/step-{:07}", m.step));
        const auto started = std::chrono::steady_clock::now();
        try {
          std::vector<std::string> files;
          trainer.outside_steps([&] { files = trainer.write_validation(samples); });
          if (tensorboard) tensorboard->videos(m.step, samples, files);
          log.info(fmt::format("step {}: {} validation video{} in {} ({:.1f} s)", m.step, files.size(),
                               files.size() == 1 ? "" : "s", samples,
                               std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()));
        } catch (const std::exception& e) {
          log.warn(fmt::format("step {}: the validation videos could not be written ({}); training continues", m.step,
                               error_message(e)));
        }
      };
      on_rank0(fmt::format("the validation videos of step {}", m.step), validate);
    }
    window += m.loss;
    ++window_steps;
    if (!m.part.empty()) {  // Wan2.2's two experts: each one's mean too (their losses differ in scale)
      part_window[m.part].first += m.loss;
      ++part_window[m.part].second;
    }
    if (m.step % train.log_every == 0 || m.step == train.steps) {
      // The NVMe tier's traffic of the step, where it runs (the console's line says it too).
      const std::string nvme = m.nvme ? fmt::format(" nvme {:.3g} GB read {:.3g} GB written {:.3f} s waited",
                                                    static_cast<double>(m.nvme_read_bytes) / 1e9,
                                                    static_cast<double>(m.nvme_write_bytes) / 1e9, m.nvme_wait_s)
                                      : std::string();
      std::string parts;
      for (const auto& [part, sum] : part_window)
        parts += fmt::format("; {} {:.5f} over {}", part, sum.first / static_cast<double>(sum.second), sum.second);
      log.info(
          fmt::format("step {}/{}{} loss {:.5f} (mean of last {}: {:.5f}{}) lr {:.3g} grad_norm {:.3f} {:.3f} s/step{}",
                      m.step, train.steps, m.part.empty() ? "" : " [" + m.part + "]", m.loss, window_steps,
                      window / static_cast<double>(window_steps), parts, m.lr, m.grad_norm, m.step_time_s, nvme));
      window = 0.0;
      window_steps = 0;
      part_window.clear();
    }
    int stop_signal = options.stop_requested != nullptr ? options.stop_requested->load() : 0;
    if (communicator) {
      // A signal may reach the ranks after different steps: they stop after the same one.
      std::vector<torch::Tensor> flag{
          torch::tensor({static_cast<int64_t>(stop_signal)}, torch::kInt64).to(trainer.device())};
      communicator->all_reduce_max(flag);
      stop_signal = static_cast<int>(flag[0].cpu().item<int64_t>());
    }
    if (stop_signal != 0) {
      result.stop_signal = stop_signal;
      progress.finish();
      log.info(
          fmt::format("stop requested (signal {}) after step {}: saving a checkpoint", result.stop_signal, m.step));
      if (!save("stop")) throw OutputError("could not save a checkpoint before stopping (see the warning above)");
      std::string exports;  // what the run would have written after its last step, and how to have it now
      for (const auto& [flag, path] : {std::pair<const char*, std::string>{"--export-weights", options.export_weights},
                                       {"--export-ema", options.export_ema},
                                       {"--export-merged", options.export_merged}})
        if (!path.empty()) exports += fmt::format("{}{} {}", exports.empty() ? "" : ", ", flag, path);
      log.info(fmt::format("stopped at step {}; continue with --resume latest{}", m.step,
                           exports.empty() ? std::string()
                                           : "; not written (they come after the last step, or from this "
                                             "checkpoint with --resume latest and the flag): " +
                                                 exports));
      return result;
    }
    if (train.checkpoint_every > 0 && m.step % train.checkpoint_every == 0 && m.step < train.steps) {
      // A replicated state (every rank holds the same) is saved by rank 0 (on_rank0): a large model's save can
      // outlast a collective's timeout.
      if (sharded) save("periodic");  // every rank saves its shard
      else on_rank0(fmt::format("the checkpoint of step {}", m.step), [&] { save("periodic"); });
    }
  }
  progress.finish();
  trainer.synchronize();
  if (train.checkpoint_every > 0 && (last_saved != result.steps_done || result.last_checkpoint.empty()) &&
      result.steps_done > start)
    if (!save("final")) throw OutputError("could not save the final checkpoint (see the warning above)");
  if (!options.trace_path.empty() && trainer.streams())
    log.info(fmt::format("trace of step {} in {}", traced, options.trace_path));
  log.info(fmt::format("done: {} step{}; metrics in {}", result.steps_done, result.steps_done == 1 ? "" : "s",
                       io::join_path(run_dir, "metrics.jsonl")));
  if (const auto cache = util::cpu_tensor_cache_stats())
    log.info(fmt::format(
        "CPU tensor cache at the end: {} of {} allocations of {} or more served from spare blocks, {} "
        "of spare blocks held (cap {})",
        cache->hits, cache->hits + cache->misses, human_bytes(static_cast<double>(cache->min_block_bytes)),
        human_bytes(static_cast<double>(cache->cached_bytes)), human_bytes(static_cast<double>(cache->cap_bytes))));
  try {
    result.exported = write_exports();
  } catch (const std::exception& e) {
    // The trained state must outlive a failed export (no space where it goes): saved as a checkpoint, which
    // `--resume CHECKPOINT --export-…` exports again once there is room.
    std::string kept = last_saved != result.steps_done   ? ""
                       : !result.last_checkpoint.empty() ? result.last_checkpoint
                                                         : resume_path;  // trained nothing past it
    // (A sharded state saves on every rank at once: only a run of one state saves here, rank 0 alone.)
    if (kept.empty() && result.steps_done > start && !sharded && save("export failed")) kept = result.last_checkpoint;
    throw OutputError(fmt::format("{}; {}", error_message(e),
                                  kept.empty() ? std::string("no checkpoint holds the trained state")
                                               : "the trained state is in checkpoint " + kept +
                                                     ": export it again with --resume " + kept +
                                                     " and the same "
                                                     "--export-… flags"));
  }
  for (const auto& line : result.exported) log.info(line);
  return result;
}

}  // namespace megaslide
