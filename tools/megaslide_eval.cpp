// megaslide-eval: scores every MP4 in a folder (VBench's temporal flickering and a frame-to-frame
// consistency score, docs/sampling.md), writes a JSON and prints a table.
//
//   megaslide-eval DIR [--json FILE]      (default FILE: DIR/eval.json)
//
// Exit codes: 0 done, 2 bad flags or a folder without readable MP4s (nothing written), 1 any other failure.
#include <CLI/CLI.hpp>

#include <iostream>

#include "megaslide/megaslide.h"

int main(int argc, char** argv) {
  CLI::App app{"megaslide-eval: per-video metrics for a folder of MP4s (docs/sampling.md)"};
  std::string folder, json_path;
  app.add_option("DIR", folder, "folder of .mp4 files (e.g. megaslide-sample --out)")->required();
  app.add_option("--json", json_path, "where the JSON goes (default: DIR/eval.json)");
  app.set_version_flag("--version", megaslide::build_summary());
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (json_path.empty()) json_path = megaslide::io::join_path(folder, "eval.json");

  megaslide::eval::FolderEvaluation evaluation;
  try {
    evaluation = megaslide::eval::evaluate_folder(folder);
  } catch (const std::exception& e) {
    std::cerr << "megaslide-eval: " << e.what() << "\n";
    return 2;
  }
  try {
    megaslide::io::write_file_atomically(json_path, megaslide::eval::to_json(evaluation));
    std::cout << megaslide::eval::to_table(evaluation);
    std::cerr << "megaslide-eval: " << evaluation.videos.size() << " videos scored; JSON in " << json_path << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "megaslide-eval: " << e.what() << "\n";
    return 1;
  }
}
