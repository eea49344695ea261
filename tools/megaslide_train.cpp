// megaslide-train: trains a DiT from a run config.
//
//   megaslide-train --config configs/smoke.yaml [--run-dir DIR] [--set key.path=value ...]
//   megaslide-train --config configs/105b.yaml --dry-run --json
//   megaslide-train --config configs/smoke.yaml --export-weights model.safetensors   (the final weights, bf16)
//
// Exit codes: 0 done, 2 bad config or flags (nothing written), 1 any other failure.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>

#include "megaslide/megaslide.h"

int main(int argc, char** argv) {
  CLI::App app{"megaslide-train: full-parameter training of video DiTs (docs/training.md)"};
  std::string config_path, run_dir, trace_path, export_weights;
  int64_t trace_step = 2;
  std::vector<std::string> overrides;
  bool dry_run = false, json = false;
  app.add_option("--config", config_path, "run config (YAML), e.g. configs/smoke.yaml")->required();
  app.add_option("--set", overrides, "override a config value, e.g. --set train.steps=50 (repeatable)");
  app.add_option("--run-dir", run_dir, "where outputs go (default: output.run_dir of the config)");
  app.add_option("--export-weights", export_weights,
                 "after training, write the weights (bf16) and the resolved config to this safetensors file "
                 "(megaslide-sample --checkpoint reads it)");
  app.add_flag("--dry-run", dry_run, "build the model on the meta device, print its size, train nothing");
  app.add_flag("--json", json, "with --dry-run: print one JSON object");
  app.add_option("--trace", trace_path, "write a Chrome-trace JSON of one step (streamed trainer; opens in Perfetto)");
  app.add_option("--trace-step", trace_step, "which step --trace records (default 2: after warm-up)")->check(CLI::PositiveNumber);
  app.set_version_flag("--version", megaslide::build_summary());
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  megaslide::RunConfig config;
  try {
    if (!run_dir.empty()) overrides.push_back("output.run_dir=" + run_dir);
    config = megaslide::load_run_config(config_path, overrides);
  } catch (const megaslide::ConfigError& e) {
    std::cerr << "megaslide-train: " << e.what() << "\n";
    return 2;
  }
  if (!export_weights.empty()) {
    const auto slash = export_weights.find_last_of('/');
    const std::string parent = slash == std::string::npos ? "." : export_weights.substr(0, std::max<size_t>(slash, 1));
    if (!megaslide::io::is_directory(parent)) {
      std::cerr << "megaslide-train: --export-weights " << export_weights << ": folder '" << parent << "' does not exist\n";
      return 2;
    }
  }

  try {
    if (dry_run) {
      const std::string summary = megaslide::dry_run_json(config);
      if (json) {
        std::cout << summary << "\n";
      } else {
        std::cout << megaslide::build_summary() << "\n" << summary << "\n";
      }
      return 0;
    }

    megaslide::RunDirectory dir(config.output.run_dir, config);
    megaslide::TrainLog log(dir.file("train.log"));
    megaslide::MetricsWriter metrics(dir.file("metrics.jsonl"));
    log.info(megaslide::build_summary());
    // The streamed CPU-master trainer by default; the resident loop is the reference (offload.enabled: false).
    std::unique_ptr<megaslide::CPUMasterVideoDiT> streamed;
    std::unique_ptr<megaslide::ResidentTrainer> resident;
    if (config.offload.enabled) streamed = std::make_unique<megaslide::CPUMasterVideoDiT>(config);
    else resident = std::make_unique<megaslide::ResidentTrainer>(config);
    if (!trace_path.empty() && !streamed) log.warn("--trace records the streamed trainer only (offload.enabled: true); ignored");
    const int64_t params = streamed ? streamed->parameter_count() : resident->parameter_count();
    const int64_t tokens = streamed ? streamed->tokens_per_sample() : resident->tokens_per_sample();
    const auto device = streamed ? streamed->device() : resident->device();
    log.info(fmt::format("config {} -> run dir {}", config_path, dir.path()));
    log.info(fmt::format("model {} ({} parameters, text encoder included), {} tokens per sample, device {}, {} steps",
                         megaslide::to_string(config.model.arch), megaslide::human_count(params), tokens, device.str(),
                         config.train.steps));
    if (streamed) {
      log.info(fmt::format("trainer: streamed CPU-master (offload.mode {}, compute {}, grad_accum_steps {}); host memory at start:\n{}",
                           config.offload.mode, config.offload.compute_dtype, config.train.grad_accum_steps,
                           streamed->host_memory_report()));
    } else {
      log.info("trainer: resident reference loop (offload.enabled: false)");
    }

    // What sampling and --export-weights read: the resident trainer's own modules, or for the streamed
    // trainer a CPU copy of the model filled from the host masters when needed.
    megaslide::DiT snapshot_dit{nullptr};
    megaslide::TextEncoder snapshot_text{nullptr};
    auto current_model = [&]() -> std::pair<megaslide::DiT&, megaslide::TextEncoder&> {
      if (resident) return {resident->model(), resident->text_encoder()};
      if (!snapshot_dit) {
        snapshot_dit = megaslide::DiT(megaslide::DiTOptions::from_config(config));
        snapshot_text = megaslide::TextEncoder(megaslide::TextEncoderOptions(
            megaslide::CaptionTokenizer().vocab_size(), config.model.text_dim, config.data.max_text_tokens));
      }
      streamed->copy_weights_to(snapshot_dit, snapshot_text);
      return {snapshot_dit, snapshot_text};
    };

    megaslide::ProgressLine progress(config.train.steps, config.train.log_every, config.output.progress);
    double first_loss = 0.0, window = 0.0;
    for (int64_t i = 0; i < config.train.steps; ++i) {
      if (streamed && !trace_path.empty() && i + 1 == std::min(trace_step, config.train.steps)) {
        streamed->trace_next_step(trace_path);
      }
      const auto m = streamed ? streamed->step() : resident->step();
      metrics.write(m);
      progress.update(m);
      if (m.step == 1) first_loss = m.loss;
      if (config.train.sample_every > 0 && m.step % config.train.sample_every == 0) {
        const auto samples = dir.file(fmt::format("samples/step-{:07}", m.step));
        auto [dit, text] = current_model();
        const auto files = megaslide::write_validation_samples(samples, config, dit, text);
        log.info(fmt::format("step {}: {} validation videos in {}", m.step, files.size(), samples));
      }
      window += m.loss;
      if (m.step % config.train.log_every == 0 || m.step == config.train.steps) {
        const int64_t n = (m.step - 1) % config.train.log_every + 1;
        log.info(fmt::format("step {}/{} loss {:.5f} (mean of last {}: {:.5f}) lr {:.3g} grad_norm {:.3f} {:.3f} s/step",
                             m.step, config.train.steps, m.loss, n, window / n, m.lr, m.grad_norm, m.step_time_s));
        window = 0.0;
      }
    }
    progress.finish();
    if (streamed) streamed->synchronize();
    if (streamed && !trace_path.empty()) log.info(fmt::format("trace of step {} in {}", std::min(trace_step, config.train.steps), trace_path));
    log.info(fmt::format("done: first loss {:.5f}; metrics in {}", first_loss, dir.file("metrics.jsonl")));
    if (!export_weights.empty()) {
      auto [dit, text] = current_model();
      megaslide::save_weights(export_weights, config, dit, text);
      log.info(fmt::format("weights written to {}", export_weights));
    }
    return 0;
  } catch (const megaslide::OutputError& e) {
    std::cerr << "megaslide-train: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "megaslide-train: " << e.what() << "\n";
    return 1;
  }
}
