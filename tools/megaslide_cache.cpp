// megaslide-cache: decodes a video dataset once, runs the config's VAE and text encoder over it (the
// pixel codec and the built-in tokenizer, CLIP and the SD VAE, or umT5 and the Wan VAE) and writes the
// latents and text tensors as sharded safetensors (data/latent_cache.h, docs/data.md); training reads
// them with data.cache: DIR.
//
//   megaslide-cache --config run.yaml [--out DIR] [--set key.path=value ...] [--shard-items N] [--threads N]
//
// --out defaults to the config's data.cache. Killed, it resumes when run again: finished shards are
// verified and kept. Exit codes: 0 done, 2 bad config, flags or dataset (or a folder holding another
// config's cache), 1 any other failure.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <iostream>

#include "megaslide/megaslide.h"
#include "tool_support.h"

int main(int argc, char** argv) {
  CLI::App app{"megaslide-cache: a video dataset's latents and text tensors, written once for training (docs/data.md)"};
  std::string config_path, out;
  std::vector<std::string> overrides;
  int64_t shard_items = 64, threads = 0;
  app.add_option("--config", config_path, "run config (YAML) with data.dataset: videos")->required();
  app.add_option("--out", out, "the cache folder (default: data.cache of the config)")
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--set", overrides, "override a config value, e.g. --set data.frames=16 (repeatable)");
  app.add_option("--shard-items", shard_items, "items per shard file (default 64)")
      ->transform(megaslide::tools::integer_in(1, int64_t{1} << 40));
  app.add_option("--threads", threads, "decoding threads (default: data.workers, at least 1)")
      ->transform(megaslide::tools::integer_in(0, 4096));
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;
  megaslide::tools::survive_file_size_limit();
  megaslide::tools::remove_temporaries_on_fatal_signals();

  return megaslide::tools::run_tool("megaslide-cache", [&] {
    auto config = megaslide::load_run_config(config_path, overrides);
    // Wan: the sizes of model.wan.weights (as megaslide-train reads them) before the encoders are checked
    // against them.
    if (config.model.arch == megaslide::Architecture::kWan) {
      std::vector<std::string> taken;  // umT5 and the VAE of a diffusers repository, where the config names none
      megaslide::tools::checking_input([&] { megaslide::with_wan_repository_encoders(config, &taken); },
                                       config_path + ": model.wan.weights: ");
      config = megaslide::tools::checking_input([&] { return megaslide::with_wan_architecture_from_weights(config); },
                                                config_path + ": model.wan.weights: ");
      for (const auto& line : taken)
        std::cerr << "megaslide-cache: " << line << " (the diffusers repository model.wan.weights names)\n";
    }
    // The checks again on the sizes the weights gave (an image-to-video DiT's data.image_frame, its encoders).
    megaslide::validate(config, config_path + " (with model.wan.weights' architecture)");
    if (config.data.dataset != "videos")
      throw megaslide::tools::UsageError(config_path + ": data.dataset is '" + config.data.dataset +
                                         "'; only data.dataset: videos is cached");
    if (out.empty()) out = config.data.cache;
    if (out.empty()) throw megaslide::tools::UsageError("no output folder: pass --out DIR or set data.cache");

    const auto start = std::chrono::steady_clock::now();
    megaslide::CacheBuildOptions options;
    options.out = out;
    options.shard_items = shard_items;
    options.threads = threads > 0 ? threads : std::max<int64_t>(1, config.data.workers);
    megaslide::tools::CountProgress progress("cache", "items");
    options.on_progress = [&](int64_t done, int64_t total, int64_t done_here) {
      progress.update(done, total, done_here);
    };
    options.on_warning = [&](const std::string& message) { progress.message("megaslide-cache: " + message); };
    // An error ends the progress line (its destructor) before run_tool prints it on a line of its own.
    const auto r = megaslide::build_latent_cache(config, options);
    progress.end_line();
    const std::string kept = r.shards_reused > 0 ? fmt::format(", {} with {} items kept from an earlier run",
                                                               r.shards_reused, r.items_reused)
                                                 : "";
    std::cerr << fmt::format("megaslide-cache: {} items in {} ({} shards written{}); {} bad items; {:.1f} s\n", r.items,
                             out, r.shards, kept, r.bad.size(),
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return 0;
  });
}
