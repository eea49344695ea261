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
  std::string config_path, run_dir, export_weights;
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
    megaslide::ResidentTrainer trainer(config);
    log.info(fmt::format("config {} -> run dir {}", config_path, dir.path()));
    log.info(fmt::format("model {} ({} parameters, text encoder included), {} tokens per sample, device {}, {} steps",
                         megaslide::to_string(config.model.arch), megaslide::human_count(trainer.parameter_count()),
                         trainer.tokens_per_sample(), trainer.device().str(), config.train.steps));

    megaslide::ProgressLine progress(config.train.steps, config.train.log_every, config.output.progress);
    double first_loss = 0.0, window = 0.0;
    for (int64_t i = 0; i < config.train.steps; ++i) {
      const auto m = trainer.step();
      metrics.write(m);
      progress.update(m);
      if (m.step == 1) first_loss = m.loss;
      if (config.train.sample_every > 0 && m.step % config.train.sample_every == 0) {
        const auto samples = dir.file(fmt::format("samples/step-{:07}", m.step));
        const auto files = megaslide::write_validation_samples(samples, config, trainer.model(), trainer.text_encoder());
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
    log.info(fmt::format("done: first loss {:.5f}; metrics in {}", first_loss, dir.file("metrics.jsonl")));
    if (!export_weights.empty()) {
      megaslide::save_weights(export_weights, trainer.config(), trainer.model(), trainer.text_encoder());
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
