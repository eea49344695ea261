// megaslide-ablate: the paper's ablations (docs/ablations.md); each suite writes SUITE.csv, SUITE.md
// and SUITE.png into --out.
//
//   megaslide-ablate --suite memory-scaling --out ablations --quick          # minutes on 2 CPU cores
//   megaslide-ablate --suite all --out ablations --device cuda               # the full sizes, on a GPU
//   megaslide-ablate --suite offsets --out a --quick --set train.steps=20     # any config key, every run
//
// Exit codes: 0 done, 2 bad flags or overrides (nothing run), 1 any other failure.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <regex>

#include "megaslide/megaslide.h"
#include "tool_support.h"

int main(int argc, char** argv) {
  CLI::App app{"megaslide-ablate: the paper's ablation studies, measured (docs/ablations.md)"};
  std::string suite, out_dir, device = "auto", size_name;
  bool quick = false;
  double budget = 0.0;
  std::vector<std::string> overrides;
  std::string suites = "all";
  for (const auto& s : megaslide::ablation_suites()) suites += " | " + s;
  app.add_option("--suite", suite, suites)->required();
  app.add_option("--out", out_dir, "output folder (created)")->required()->check(megaslide::tools::non_empty_path());
  app.add_flag("--quick", quick, "the small sizes that run on a few CPU cores in minutes (same as --size quick)");
  app.add_option("--size", size_name, "test | quick | full (default full: the paper's sizes, for a GPU)");
  app.add_option("--device", device, "auto | cpu | cuda | cuda:N (default auto)");
  app.add_option("--memory-budget-gib", budget,
                 "memory-scaling on the CPU: a measured peak above this is recorded as oom (default: per size)")
      ->check(megaslide::tools::finite_real(0.0));
  app.add_option("--set", overrides, "override a config key in every run, e.g. --set train.steps=20 (repeatable)");
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;

  megaslide::AblationOptions options;
  std::vector<std::string> names;
  return megaslide::tools::run_tool("megaslide-ablate", [&] {
    megaslide::tools::checking_input([&] {
      try {
        if (quick && !size_name.empty() && size_name != "quick")
          throw std::invalid_argument("--quick and --size " + size_name + " disagree");
        options.size = quick               ? megaslide::AblationSize::kQuick
                       : size_name.empty() ? megaslide::AblationSize::kFull
                                           : megaslide::parse_ablation_size(size_name);
        megaslide::tools::check_device_flag(device);
        names = suite == "all" ? megaslide::ablation_suites() : std::vector<std::string>{suite};
        megaslide::io::check_output_folder(out_dir, "--out");
        // An unknown suite, or an override that breaks any run's config, stops here, before anything runs.
        for (const auto& n : names) {
          megaslide::ablation_base_overrides(n, options.size);  // throws on an unknown suite
          auto checked = options;
          checked.suite = n;
          checked.device = device;
          checked.overrides = overrides;
          megaslide::check_ablation_configs(checked);
        }
      } catch (const std::invalid_argument& e) {
        // The suites are listed where the suite is what is wrong.
        const auto known = megaslide::ablation_suites();
        const bool bad_suite = suite != "all" && std::find(known.begin(), known.end(), suite) == known.end();
        const std::string message = megaslide::error_message(e);
        const bool varied = message.find(" suite varies ") != std::string::npos;
        throw megaslide::tools::UsageError(message + (bad_suite ? " (suites: " + suites + ")"
                                                      : suite == "all" && varied
                                                          ? " (--suite all: run the other suites on their own with it)"
                                                          : std::string()));
      }
    });
    megaslide::tools::survive_file_size_limit();
    megaslide::tools::remove_temporaries_on_fatal_signals();
    options.out_dir = out_dir;
    options.device = device;
    options.memory_budget_gib = budget;
    options.overrides = overrides;
    options.progress = [](const std::string& line) { std::cerr << line << std::endl; };
    std::string effective = device;  // a --set train.device=... is applied after --device and wins
    for (const auto& o : overrides)
      if (o.rfind("train.device=", 0) == 0) effective = o.substr(std::string("train.device=").size());
    bool on_gpu = false;
    try {
      on_gpu = megaslide::resolve_device(effective).is_cuda();
    } catch (const std::exception&) {  // a device the runs themselves will refuse, naming it
    }
    if (options.size == megaslide::AblationSize::kFull && !on_gpu)
      std::cerr << "megaslide-ablate: warning: --size full runs the paper's sizes, made for a GPU: on the CPU a step "
                   "takes seconds and a suite hours; --size quick runs the same comparisons small\n";
    for (const auto& n : names) {
      options.suite = n;
      const auto report = megaslide::run_ablation(options);
      std::cerr << fmt::format("[{}] done on {}:\n", n, report.device) << report.summary.markdown();
      std::cout << report.csv_path << "\n" << report.markdown_path << "\n" << report.png_path << "\n";
    }
    return 0;
  });
}
