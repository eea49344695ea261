// megaslide-plot: loss, throughput, memory and optimizer (learning rate, gradient norm) curves of a training run as
// PNGs (gnuplot).
//
//   megaslide-plot runs/smoke                 # -> runs/smoke/plots/{loss,throughput,memory,optimizer}.png
//   megaslide-plot runs/smoke --out figs/     # elsewhere
//
// Exit codes: 0 done, 2 bad flags or a bad/missing metrics.jsonl, 1 any other failure (e.g. no gnuplot).
#include <CLI/CLI.hpp>

#include <iostream>

#include "megaslide/megaslide.h"
#include "tool_support.h"

int main(int argc, char** argv) {
  CLI::App app{"megaslide-plot: draw a run's metrics.jsonl as PNGs (docs/ablations.md)"};
  std::string run_dir, out_dir;
  app.add_option("RUN_DIR", run_dir, "a megaslide-train run folder (holds metrics.jsonl)")
      ->required()
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--out", out_dir, "where the PNGs go (default: RUN_DIR/plots)")
      ->check(megaslide::tools::non_empty_path());
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;
  megaslide::tools::survive_file_size_limit();
  megaslide::tools::remove_temporaries_on_fatal_signals();
  return megaslide::tools::run_tool("megaslide-plot", [&] {
    megaslide::tools::checking_input([&] {
      const std::string own = megaslide::io::join_path(run_dir, "plots");
      megaslide::io::check_output_folder(out_dir.empty() ? own : out_dir, "--out");
      // Not into what a training run writes (its checkpoints/, another run's plots/): the run's own plots/ only.
      if (!out_dir.empty() && megaslide::tools::real_file_path(out_dir) != megaslide::tools::real_file_path(own))
        megaslide::tools::check_output_outside_run_folders(out_dir, "--out");
    });
    for (const auto& png : megaslide::plot_run(run_dir, out_dir)) std::cout << png << "\n";
    return 0;
  });
}
