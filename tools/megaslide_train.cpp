// megaslide-train: trains a DiT from a run config (the loop is megaslide::run_training).
//
//   megaslide-train --config configs/smoke.yaml [--run-dir DIR] [--set key.path=value ...]
//   megaslide-train --config configs/smoke.yaml --run-dir DIR --resume latest|CHECKPOINT_DIR
//   megaslide-train --config configs/105b.yaml --dry-run --json
//   megaslide-train --config configs/smoke.yaml --export-weights model.safetensors   (after training, bf16)
//   megaslide-train --config configs/smoke.yaml --run-dir DIR --resume latest --export-weights model.safetensors
//                                                  (the checkpoint's weights, no training)
//   megaslide-train --config C --run-dir DIR --resume latest --export-weights wan_ft.safetensors --export-layout
//   comfyui
//                                                  (a Wan's weights as ComfyUI's single file)
//   megaslide-train --config C --nproc-per-node 2                               (2 local ranks; docs/distributed.md)
//   torchrun --nproc-per-node 8 --no-python megaslide-train --config C ...      (or srun: Slurm's environment)
//
// SIGINT/SIGTERM/SIGHUP/SIGUSR1: the current step finishes, a checkpoint is saved, and the run exits with 128 +
// the signal's number (130, 143, 129, 138); a second signal stops at once. SIGPIPE is ignored (a write to a dead peer's
// socket or a closed pipe fails with an error instead). With --nproc-per-node the process starts the ranks and returns
// the first failing rank's exit code. Exit codes: 0 done, 2 bad config, flags, output path or checkpoint, a run folder
// in use by another run or holding a finished one, a device or a memory size this machine does not have (nothing
// written), 1 any other failure (including too many non-finite steps and a failed final save),
// 130/143/129/138 stopped by a signal after saving.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <map>
#include <tuple>

#include "megaslide/megaslide.h"
#include "tool_support.h"

namespace {
std::atomic<int> g_stop{0};

void on_stop_signal(int signal) {
  g_stop.store(signal);
  // A second one ends the process at once, leaving no temporary file of a save or an export behind.
  std::signal(signal, megaslide::tools::end_by_signal_removing_temporaries);
}

// What an output file (`flag`'s) may not be: another output, the config, a file or folder the config reads, the
// checkpoint resumed from, or a file the run folder's training writes (its lock, config, log, metrics, checkpoints,
// samples, plots, logs and TensorBoard events), or another run folder's. Throws UsageError naming both.
void check_outputs_apart(const std::vector<std::pair<std::string, std::string>>& outputs,
                         const std::string& config_path, const megaslide::RunConfig& config,
                         const std::string& resume) {
  std::vector<std::pair<std::string, std::string>> inputs{{config_path, "--config's file"}};
  const auto& m = config.model;
  for (const auto& [path, key] :
       std::vector<std::pair<std::string, std::string>>{{config.train.init_from, "train.init_from"},
                                                        {m.wan.weights, "model.wan.weights"},
                                                        {m.wan.weights_2, "model.wan.weights_2"},
                                                        {m.text_encoder.weights, "model.text_encoder.weights"},
                                                        {m.text_encoder.vocab, "model.text_encoder.vocab"},
                                                        {m.vae.weights, "model.vae.weights"},
                                                        {m.image_encoder.weights, "model.image_encoder.weights"},
                                                        {config.data.manifest, "data.manifest"},
                                                        {config.data.tensors, "data.tensors"},
                                                        {config.data.cache, "data.cache"},
                                                        {config.train.sample_prompts, "train.sample_prompts"}})
    if (!path.empty()) inputs.emplace_back(path, key + (megaslide::io::is_directory(path) ? "'s folder" : "'s file"));
  const std::string& run = config.output.run_dir;
  for (const auto& name : megaslide::tools::run_folder_entries())  // (folders: a '/' at the end)
    inputs.emplace_back(megaslide::io::join_path(run, name), "the run folder's " + name);
  if (!resume.empty() && resume != "latest") {
    // The checkpoint itself, whichever name --resume gave it (a run folder names its latest checkpoint); one that
    // cannot be found is refused later, by the resume.
    try {
      inputs.emplace_back(megaslide::find_checkpoint(resume) + "/", "the checkpoint --resume reads");
    } catch (const std::exception&) {
    }
  }
  std::map<std::string, std::string> seen;  // real path -> flag
  for (const auto& [path, flag] : outputs) {
    if (path.empty()) continue;
    const std::string real = megaslide::tools::real_file_path(path);
    if (const auto it = seen.find(real); it != seen.end())
      throw megaslide::tools::UsageError(fmt::format(
          "{} '{}' is also {}'s file: one would replace the other; give each its own path", flag, path, it->second));
    seen.emplace(real, flag);
    megaslide::tools::check_output_is_no_input(path, flag, inputs);
    megaslide::tools::check_output_outside_run_folders(path, flag);  // another run's
  }
}

// --dry-run's look at the files and folders the config names that a run opens before its first step (the data and
// train.val_data's, train.init_from, the NVMe tier's folder; the DiT family's CLIP and VAE unless it reads a cache;
// Wan's umT5, VAE and image encoder and the prompt file only for validation videos, whose failures a run survives): one
// line for each that is not there (or is not a folder where one is needed), naming its key, where the run would stop. A
// warning, not an error: a dry run also plans a DiT whose encoders are not yet downloaded. (Wan's own weights are
// read to resolve its architecture before this: a missing one is already an error.) Nothing is read.
std::vector<std::string> missing_named_paths(const megaslide::RunConfig& c, const std::string& source) {
  std::vector<std::tuple<std::string, std::string, bool>> named;  // key, path, must be a folder
  const auto add = [&](const std::string& key, const std::string& path, bool folder = false) {
    if (!path.empty()) named.emplace_back(key, path, folder);
  };
  // The data's files: the training data's, or (`validation`) train.val_data's where it names a path of its own.
  const auto add_data = [&](const megaslide::DataConfig& d, bool validation) {
    const auto add_own = [&](const char* key, const std::string& path, bool folder = false) {
      if (!validation) return add(key, path, folder);
      if (std::none_of(named.begin(), named.end(), [&](const auto& n) { return std::get<1>(n) == path; }))
        add(fmt::format("train.val_data ({})", key), path, folder);  // one line for a path both read
    };
    if (d.dataset == "videos") {
      add_own("data.root", d.root, true);  // read with a cache too: its listing against the cache's items
      add_own("data.manifest", d.manifest);
      add_own("data.cache", d.cache, true);
    }
    if (d.dataset == "latent-tensors") add_own("data.tensors", d.tensors);
  };
  const bool wan = c.model.arch == megaslide::Architecture::kWan, videos = c.train.sample_every > 0;
  const bool cached = c.data.dataset == "videos" && !c.data.cache.empty();
  add_data(c.data, false);
  if (c.train.val_every > 0 && !c.train.val_data.empty()) {
    // The validation data's own files, read before the first step too (its overrides' errors are the config's).
    try {
      add_data(megaslide::validation_data_config(c, source).data, true);
    } catch (const megaslide::ConfigError&) {
    }
  }
  add("train.init_from", c.train.init_from);
  if (c.offload.enabled && c.offload.state_tier == "nvme") add("offload.nvme_dir", c.offload.nvme_dir, true);
  if (videos) add("train.sample_prompts", c.train.sample_prompts);
  if (wan ? videos : !cached) {
    if (c.model.text_encoder.kind != "builtin") {
      add("model.text_encoder.weights", c.model.text_encoder.weights);
      add("model.text_encoder.vocab", c.model.text_encoder.vocab);
    }
    if (c.model.vae.kind != "none") add("model.vae.weights", c.model.vae.weights);
  }
  if (wan && videos) add("model.image_encoder.weights", c.model.image_encoder.weights);
  std::vector<std::string> out;
  for (const auto& [key, path, folder] : named) {
    const bool there = megaslide::io::path_exists(path);
    if (!there || (folder && !megaslide::io::is_directory(path)))
      out.push_back(key + ": '" + path + (there ? "' is not a folder" : "' does not exist") +
                    megaslide::io::relative_path_note(path) + ": the run would stop there");
  }
  return out;
}

// --dry-run: the model's size and the run's memory in a few lines, or one JSON object.
int print_dry_run(const megaslide::RunConfig& config, const std::string& source, bool json) {
  auto j = nlohmann::json::parse(megaslide::dry_run_json(config));
  // What the run trains: the model's parameters, or a LoRA run's adapters (the planner's count).
  j["trained_params"] =
      config.lora.rank > 0 ? megaslide::plan::lora_trained_parameters(config, source) : j["params"].get<int64_t>();
  // What the run's train.log would warn about: settings it will not use.
  // As the run says them: Wan's sizes from its weights.
  j["unused_settings"] = megaslide::unused_settings(
      megaslide::resolve_auto_settings(megaslide::with_wan_architecture_from_weights(config)));
  // Files and folders it names that are not there (each "KEY: 'PATH' does not exist...").
  j["missing_paths"] = missing_named_paths(config, source);
  if (json) {
    std::cout << j.dump() << "\n";
    return 0;
  }
  const auto millions = [](const nlohmann::json& v) { return fmt::format("{:.2f} M", v.get<double>() / 1e6); };
  std::cout
      << megaslide::build_summary() << "\n"
      << fmt::format("model {}: {} parameters ({} a block x {} layers, prologue {}, epilogue {}), hidden {}\n",
                     j["arch"].get<std::string>(), millions(j["params"]), millions(j["params_per_block"]),
                     j["layers"].get<int64_t>(), millions(j["prologue_params"]), millions(j["epilogue_params"]),
                     j["hidden"].get<int64_t>())
      << fmt::format(
             "{} tokens a sample (grid {}x{}x{}), host state {:.2f} GB ({:.1f} B a parameter), device {}, compute {}\n",
             j["tokens_per_sample"].get<int64_t>(), j["token_grid"][0].get<int64_t>(),
             j["token_grid"][1].get<int64_t>(), j["token_grid"][2].get<int64_t>(),
             j["host_state_bytes"].get<double>() / 1e9,
             j["host_state_bytes"].get<double>() / std::max(1.0, j["params"].get<double>()),
             j["device"].get<std::string>(), j["compute_dtype"].get<std::string>())
      << (config.lora.rank > 0 ? fmt::format("trains {} parameters: the {} adapters of rank {} (the model frozen)\n",
                                             millions(j["trained_params"]),
                                             config.lora.type == "lokr" ? "LoKr" : "LoRA", config.lora.rank)
                               : std::string())
      << "(--json prints this as one JSON object; megaslide-plan shows memory and time on a machine)\n";
  for (const auto& line : j["unused_settings"]) std::cout << "warning: " << line.get<std::string>() << "\n";
  for (const auto& line : j["missing_paths"]) std::cout << "warning: " << line.get<std::string>() << "\n";
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  // A write to a closed socket or pipe fails with EPIPE instead of killing the process: a rank whose peer died
  // mid-collective then reports the collective's error and exits non-zero (docs/distributed.md), and a run
  // whose output pipe closed (`| tee` ended) goes on with its log and metrics files.
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"megaslide-train: full-parameter training of video DiTs (docs/training.md)"};
  std::string config_path, run_dir, trace_path, export_weights, export_ema, export_merged, resume,
      export_layout_name = "diffusers";
  int64_t trace_step = 2, nproc_per_node = 0, master_port = 0;
  std::vector<std::string> overrides;
  bool dry_run = false, json = false;
  app.add_option("--config", config_path, "run config (YAML), e.g. configs/smoke.yaml")->required();
  app.add_option("--set", overrides, "override a config value, e.g. --set train.steps=50 (repeatable)");
  app.add_option("--run-dir", run_dir, "where outputs go (default: output.run_dir of the config)")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--resume", resume,
                 "continue from a checkpoint: 'latest' (RUN_DIR/checkpoints/latest), a checkpoint folder, its `latest` "
                 "file or a "
                 "run folder (docs/checkpoints.md)")
      ->check(megaslide::tools::non_empty_path());
  app.add_option(
         "--export-weights", export_weights,
         "write the weights (bf16) and the resolved config to this safetensors file (megaslide-sample --checkpoint "
         "reads it; Wan: diffusers' file of the DiT, or ComfyUI's with --export-layout, which megaslide-sample reads "
         "as model.wan.weights): after training, or with --resume the checkpoint's weights without training; a LoRA "
         "run "
         "(lora.rank > 0) writes its adapters as a LoRA file (docs/lora.md)")
      ->check(megaslide::tools::non_empty_path());
  app.add_option(
         "--export-ema", export_ema,
         "write the EMA of the weights (train.ema_decay; bf16) to this safetensors file, as --export-weights writes "
         "the "
         "weights: after training, or with --resume the checkpoint's EMA (model_ema.safetensors) without training")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--export-merged", export_merged,
                 "a LoRA run (lora.rank > 0): write the model's weights with the adapters merged in (bf16), laid out "
                 "as --export-weights writes a full fine-tuning's (--export-layout applies): after training, or with "
                 "--resume the checkpoint's adapters on the model without training")
      ->check(megaslide::tools::non_empty_path());
  app.add_option(
         "--export-layout", export_layout_name,
         "the layout of a Wan's --export-weights, --export-ema and --export-merged (bf16): diffusers (default: "
         "diffusers' names and "
         "config.json; two experts: a diffusers repository folder), comfyui (one safetensors file for ComfyUI's "
         "Load Diffusion Model: Wan's original names under model.diffusion_model., as Comfy-Org's repackaged "
         "files have them; two experts: PATH's name with _high_noise and _low_noise before .safetensors) or "
         "comfyui-unprefixed (the same file without the prefix, as Wan-AI's and Kijai's files); the 3D-DSA "
         "retrofit is diffusers' only. A LoRA run: diffusers' LoRA layout, or ComfyUI's for both comfyui "
         "choices (one file per expert with two experts)")
      ->check(CLI::IsMember({"diffusers", "comfyui", "comfyui-unprefixed"}));
  app.add_flag("--dry-run", dry_run, "build the model on the meta device, print its size, train nothing");
  app.add_flag("--json", json, "with --dry-run: print one JSON object");
  app.add_flag_callback(
      "--allow-nonfinite-weights", [] { megaslide::io::set_nonfinite_weights_allowed(true); },
      "train.init_from and model.wan.weights: load weights that hold NaN or infinite values instead of refusing them");
  app.add_option("--trace", trace_path, "write a Chrome-trace JSON of one step (streamed trainer; opens in Perfetto)")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--trace-step", trace_step, "which step --trace records (default 2: after warm-up)")
      ->transform(megaslide::tools::integer_in(1, int64_t{1} << 40));
  app.add_option("--nproc-per-node", nproc_per_node,
                 "start this many ranks on this machine (data parallelism over c10d; docs/distributed.md)")
      ->transform(megaslide::tools::integer_in(1, 1024));
  app.add_option("--master-port", master_port,
                 "with --nproc-per-node: the rendezvous port on 127.0.0.1 (default: a free one)")
      ->transform(megaslide::tools::integer_in(1, 65535));
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;
  return megaslide::tools::run_tool(
      "megaslide-train",
      [&] {
        if (json && !dry_run)
          throw megaslide::tools::UsageError("--json applies to --dry-run (it would otherwise start a run)");
        if (dry_run) {  // it describes the run and writes nothing: a flag of a run would be silently dropped
          std::string ignored;
          for (const char* flag : {"--resume", "--export-weights", "--export-ema", "--export-merged", "--trace",
                                   "--trace-step", "--nproc-per-node"})
            if (app.count(flag) > 0) ignored += (ignored.empty() ? "" : ", ") + std::string(flag);
          if (!ignored.empty())
            throw megaslide::tools::UsageError("--dry-run describes the run and writes nothing; it does not take " +
                                               ignored);
        }
        auto config = megaslide::load_run_config(config_path, overrides);
        if (!run_dir.empty()) {  // a path, taken as it is (never parsed as YAML: 'exp #3' is not 'exp')
          config.output.run_dir = run_dir;
          megaslide::validate(config, "--run-dir");
        }
        const auto export_layout = export_layout_name == "comfyui" ? megaslide::WanWeightsLayout::kComfyUI
                                   : export_layout_name == "comfyui-unprefixed"
                                       ? megaslide::WanWeightsLayout::kComfyUIUnprefixed
                                       : megaslide::WanWeightsLayout::kDiffusers;
        if (export_layout != megaslide::WanWeightsLayout::kDiffusers) {
          if (export_weights.empty() && export_ema.empty() && export_merged.empty())
            throw megaslide::tools::UsageError(
                "--export-layout applies to --export-weights, --export-ema and --export-merged");
          if (config.model.arch != megaslide::Architecture::kWan)
            throw megaslide::tools::UsageError("--export-layout " + export_layout_name +
                                               " writes a Wan's weights in ComfyUI's layout, but model.arch is " +
                                               megaslide::to_string(config.model.arch) +
                                               ": export without --export-layout");
        }
        // Output files are checked before any work: here for the export of a checkpoint, and by
        // run_training for a run (once the run folder, which may hold the file, exists). ComfyUI's layout
        // writes one file per expert beside the path given.
        megaslide::tools::checking_input([&] {
          const auto check_export = [&](const std::string& path, const char* flag) {
            if (path.empty()) return;
            const auto files = config.lora.rank > 0 ? megaslide::lora_weights_files(path, config)
                               : export_layout == megaslide::WanWeightsLayout::kDiffusers
                                   ? std::vector<std::string>{path}
                                   : megaslide::wan_comfyui_files(path, config.model.wan);
            for (const auto& file : files) {
              if (!resume.empty() || megaslide::io::is_directory(file)) megaslide::io::check_output_file(file, flag);
              megaslide::tools::warn_of_leftover_temporaries(file, "megaslide-train");
            }
          };
          check_export(export_weights, "--export-weights");
          check_export(export_ema, "--export-ema");
          std::vector<std::pair<std::string, std::string>> outputs;
          const auto add_output = [&](const std::string& path, const char* flag) {
            if (path.empty()) return;
            const auto files =
                config.lora.rank > 0 && std::string(flag) != "--export-merged" && std::string(flag) != "--trace"
                    ? megaslide::lora_weights_files(path, config)
                : export_layout == megaslide::WanWeightsLayout::kDiffusers || std::string(flag) == "--trace"
                    ? std::vector<std::string>{path}
                    : megaslide::wan_comfyui_files(path, config.model.wan);
            for (const auto& file : files) outputs.emplace_back(file, flag);
          };
          add_output(export_weights, "--export-weights");
          add_output(export_ema, "--export-ema");
          add_output(export_merged, "--export-merged");
          add_output(trace_path, "--trace");
          check_outputs_apart(outputs, config_path, config, resume);
          if (!trace_path.empty() && app.count("--trace-step") > 0 && trace_step > config.train.steps)
            throw megaslide::tools::UsageError(
                fmt::format("--trace-step {} is past train.steps ({}): the run would end before it", trace_step,
                            config.train.steps));
        });
        megaslide::tools::survive_file_size_limit();
        megaslide::tools::remove_temporaries_on_fatal_signals();
        // Where an export went: ComfyUI's layout (and a Wan LoRA) names one file per expert.
        const auto written_to = [&](const std::string& path) {
          const bool lora = config.lora.rank > 0;
          if (export_layout == megaslide::WanWeightsLayout::kDiffusers && !lora) return path;
          std::string files;
          for (const auto& file : lora ? megaslide::lora_weights_files(path, config)
                                       : megaslide::wan_comfyui_files(path, config.model.wan))
            files += (files.empty() ? "" : " and ") + file;
          const std::string layout =
              export_layout == megaslide::WanWeightsLayout::kDiffusers ? "diffusers' layout" : "ComfyUI's layout";
          return files + (lora ? " (LoRA, " : " (") + layout + ")";
        };

        // What the run's errors name as the source of a setting: with --set, the file and the overrides together.
        const std::string source = overrides.empty() ? config_path : config_path + " with --set overrides";
        const char* launched_here = std::getenv("MEGASLIDE_LOCAL_LAUNCH");
        if (nproc_per_node > 0 && !dry_run && (launched_here == nullptr || *launched_here == '\0')) {
          if (std::getenv("RANK") != nullptr || std::getenv("SLURM_PROCID") != nullptr)
            throw megaslide::tools::UsageError(
                "--nproc-per-node starts the ranks itself, but this process was already started by a launcher "
                "(RANK or SLURM_PROCID is set): drop --nproc-per-node");
          // Checked once here: each rank would refuse it alike, one line each.
          if (const auto [key, problem] = megaslide::world_size_problem(config, nproc_per_node); !key.empty())
            throw megaslide::ConfigError(source, key, problem);
          // So is a run folder rank 0 would refuse (another run's, or in use): the other ranks would only see rank 0
          // gone. The guard leaves nothing behind (a folder it made is removed with its lock).
          // (An export of a checkpoint's files takes no lock: it writes nothing into the folder.)
          const bool export_only =
              !resume.empty() && export_merged.empty() && (!export_weights.empty() || !export_ema.empty());
          if (!export_only) {
            const megaslide::RunFolderGuard folder(config.output.run_dir, !resume.empty());
          }
          return megaslide::launch_local_ranks(std::vector<std::string>(argv, argv + argc), nproc_per_node,
                                               master_port);
        }
        if (dry_run) return print_dry_run(config, source, json);
        // With --resume an export writes the checkpoint's files and trains nothing. --export-merged needs the model
        // and its adapters: run_training loads them (export_only), checks its inputs and writes the file first.
        megaslide::TrainingRunOptions options;
        options.config_source = source;
        options.resume = resume;
        options.export_merged = export_merged;
        options.export_layout = export_layout;
        if (!resume.empty() && (!export_weights.empty() || !export_ema.empty() || !export_merged.empty())) {
          // All files or none: a checkpoint without an EMA is refused before anything is written.
          const std::string checkpoint = megaslide::resolve_checkpoint(config.output.run_dir, resume);
          if (!export_ema.empty() && megaslide::find_ema_weights(checkpoint).empty())
            throw megaslide::CheckpointError(
                "checkpoint '" + checkpoint +
                "': has no EMA of the weights (model_ema.safetensors) for --export-ema: it was saved by a run "
                "without train.ema_decay");
          if (!export_merged.empty()) {
            options.export_only = true;
            const auto result = megaslide::run_training(config, options);
            for (const auto& line : result.warnings) std::cerr << "megaslide-train: warning: " << line << "\n";
            for (const auto& line : result.exported)
              std::cerr << "megaslide-train: " << line << " (from " << checkpoint << ")\n";
          }
          // Launched ranks: rank 0 writes the checkpoint's files (the merged model above takes every rank).
          const bool writer = megaslide::tools::checking_input([] { return megaslide::read_launch_env().rank == 0; });
          // What ComfyUI would read differently of the checkpoint's model, said once (the merged export above has
          // said it).
          std::vector<std::string> differences;
          if (!export_weights.empty() && writer) {
            const auto from = megaslide::export_checkpoint_weights(config.output.run_dir, resume, export_weights,
                                                                   /*ema=*/false, export_layout, &differences);
            std::cerr << "megaslide-train: weights of " << from << " written to " << written_to(export_weights) << "\n";
          }
          if (!export_ema.empty() && writer) {
            const auto from = megaslide::export_checkpoint_weights(config.output.run_dir, resume, export_ema,
                                                                   /*ema=*/true, export_layout, &differences);
            std::cerr << "megaslide-train: EMA of the weights of " << from << " written to " << written_to(export_ema)
                      << "\n";
          }
          if (export_merged.empty())
            for (const auto& difference : differences)
              std::cerr << "megaslide-train: warning: ComfyUI will not load the exported file as this model: "
                        << difference << "\n";
          return 0;
        }
        // SIGHUP: the terminal closed (ssh dropped); SIGUSR1: a batch system's warning before its time limit
        // (Slurm's --signal=USR1@SECONDS). Each stops the run like SIGTERM, with a checkpoint; but a signal that
        // this process was started ignoring (SIGHUP under nohup, SIGINT for a job a script starts with `&`) stays
        // ignored.
        std::vector<std::string> ignored_signals, stopping_signals;
        for (const auto& [signal, name] : std::vector<std::pair<int, const char*>>{
                 {SIGINT, "SIGINT"}, {SIGTERM, "SIGTERM"}, {SIGHUP, "SIGHUP"}, {SIGUSR1, "SIGUSR1"}}) {
          struct sigaction current {};
          if (::sigaction(signal, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) {
            ignored_signals.push_back(name);
            continue;
          }
          std::signal(signal, on_stop_signal);
          stopping_signals.push_back(name);
        }
        // Ctrl-C (SIGINT) that does nothing surprises: say so once, and what stops the run instead.
        if (!ignored_signals.empty() && ignored_signals.front() == "SIGINT")
          std::cerr << fmt::format(
              "megaslide-train: {} ignored (this process was started ignoring {}, as a script's background job or "
              "nohup is); {}\n",
              fmt::join(ignored_signals, ", "), ignored_signals.size() == 1 ? "it" : "them",
              stopping_signals.empty()
                  ? std::string("nothing but SIGKILL stops the run, without a checkpoint")
                  : fmt::format("{} stop{} the run with a checkpoint", fmt::join(stopping_signals, " or "),
                                stopping_signals.size() == 1 ? "s" : ""));
        options.trace_path = trace_path;
        options.trace_step = trace_step;
        options.export_weights = export_weights;
        options.export_ema = export_ema;
        options.stop_requested = &g_stop;
        const auto result = megaslide::run_training(config, options);
        return result.stop_signal != 0 ? 128 + result.stop_signal : 0;
      },
      "megaslide-plan --config ... shows what the run needs");
}
