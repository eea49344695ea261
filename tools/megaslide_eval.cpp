// megaslide-eval: scores every MP4 of a sample folder (VBench's temporal flickering and a frame-to-frame
// consistency score, docs/sampling.md), writes one JSON file and prints a table.
//
//   megaslide-eval DIR [--json FILE]
//
// DIR is a megaslide-sample output folder (its videos/ and index.json), its videos/ folder, or any
// folder of MP4s. The JSON goes to FILE; without --json to SAMPLE_DIR/eval.json beside the videos
// folder (never into it: VBench reads that folder and must find only videos there). Exit codes: 0 done,
// 2 bad flags, an unwritable --json path, or a folder without readable MP4s (nothing written), 1 any
// other failure.
#include <CLI/CLI.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "megaslide/megaslide.h"
#include "tool_support.h"

int main(int argc, char** argv) {
  CLI::App app{"megaslide-eval: per-video metrics for a folder of MP4s (docs/sampling.md)"};
  std::string folder, json_path;
  app.add_option("DIR", folder, "a megaslide-sample --out folder, its videos/ folder, or any folder of .mp4 files")
      ->required()
      ->check(megaslide::tools::non_empty_path());
  app.add_option("--json", json_path, "where the JSON goes (default: eval.json beside the videos folder)")
      ->check(megaslide::tools::non_empty_path());
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;
  megaslide::tools::survive_file_size_limit();
  megaslide::tools::remove_temporaries_on_fatal_signals();
  return megaslide::tools::run_tool("megaslide-eval", [&] {
    megaslide::eval::FolderEvaluation evaluation;
    megaslide::tools::checking_input([&] {
      const auto sample =
          megaslide::tools::checking_input([&] { return megaslide::io::find_sample_folder(folder); }, "DIR: ");
      // A bare folder of MP4s keeps its JSON in it, as before; a sample folder keeps it beside videos/.
      if (json_path.empty()) json_path = megaslide::io::join_path(sample.root, "eval.json");
      megaslide::io::check_output_file(json_path, "--json");
      // Progress on stderr: one line, rewritten on a terminal; every tenth of the videos otherwise.
      const bool tty = ::isatty(STDERR_FILENO) == 1;
      const auto start = std::chrono::steady_clock::now();
      evaluation = megaslide::eval::evaluate_folder(folder, [&](int64_t done, int64_t total) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const std::string line =
            fmt::format("[eval] {}/{} videos, {:.1f} s/video, ETA {:.0f} s", done, total, s / static_cast<double>(done),
                        s / static_cast<double>(done) * static_cast<double>(total - done));
        if (tty) std::cerr << "\r" << line << "\x1b[K" << (done == total ? "\n" : "") << std::flush;
        else if (done == total || done % std::max<int64_t>(1, total / 10) == 0) std::cerr << line << "\n";
      });
    });
    megaslide::io::write_file_atomically(json_path, megaslide::eval::to_json(evaluation));
    std::cout << megaslide::eval::to_table(evaluation);
    if (!evaluation.deep_videos.empty())
      std::cerr << "megaslide-eval: warning: " << evaluation.deep_videos.size()
                << " videos have more than 8 bits a component (the first: '" << evaluation.deep_videos.front()
                << "'): OpenCV's bundled FFmpeg dithers them down to 8 bits, this build's may not, so their scores may "
                   "differ from VBench's (docs/sampling.md)\n";
    std::cerr << "megaslide-eval: " << evaluation.videos.size() << " videos scored; JSON in " << json_path << "\n";
    return 0;
  });
}
