// megaslide-plan: what one training step of a run config needs and moves, and how fast it can be, on
// a given machine (docs/planner.md). Allocates nothing: the model is built on the meta device.
//
//   megaslide-plan --config configs/105b.yaml [--hardware h200|h100nvl|FILE] [--world-size R] [--context-parallel N]
//   [--set key.path=value
//   ...] [--json]
//
// Exit codes: 0 the plan was printed (whether or not the run fits: see fits_device / fits_host),
// 2 bad flags, config or hardware profile (one message naming the file and key), 1 any other failure.
#include <CLI/CLI.hpp>

#include <iostream>

#include "megaslide/megaslide.h"
#include "tool_support.h"

int main(int argc, char** argv) {
  CLI::App app{"megaslide-plan: host and device memory, PCIe bytes, FLOPs and the step-time bound of a run"};
  std::string config_path, hardware = "h200";
  std::vector<std::string> overrides;
  bool json = false;
  int64_t world_size = 1;
  app.add_option("--config", config_path, "run config (YAML), e.g. configs/105b.yaml")->required();
  app.add_option(
      "--hardware", hardware,
      "a built-in profile (h200, h100nvl, hgx-h200, rtx4090, workstation-24gb, workstation-48gb) or a hardware "
      "profile YAML file (default h200; docs/planner.md)");
  app.add_option("--world-size", world_size,
                 "data-parallel ranks R (default 1): plan one rank of R, the global train.batch_size split over them")
      ->transform(megaslide::tools::integer_in(1));
  int64_t context_parallel = 1;
  app.add_option("--context-parallel", context_parallel,
                 "context parallelism N (distributed.context_parallel): groups of N ranks share each sample's frames; "
                 "--world-size defaults to N")
      ->transform(megaslide::tools::integer_in(1));
  app.add_option("--set", overrides, "override a config value, e.g. --set data.frames=64 (repeatable)");
  app.add_flag("--json", json, "print one JSON object");
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;
  return megaslide::tools::run_tool("megaslide-plan", [&] {
    const bool cp_flag = app.count("--context-parallel") > 0;
    if (cp_flag) overrides.push_back("distributed.context_parallel=" + std::to_string(context_parallel));
    const auto config = megaslide::load_run_config(config_path, overrides);
    // The smallest world of a context-parallel run is one group (the flag's or the config's).
    if (app.count("--world-size") == 0) world_size = config.distributed.context_parallel;
    const auto profile = megaslide::tools::checking_input(
        [&] { return megaslide::plan::load_hardware_profile(hardware); }, "--hardware: ");
    megaslide::plan::StepPlan plan;
    try {
      plan = megaslide::plan::plan_step(config, profile, world_size, config_path);
    } catch (const megaslide::ConfigError& e) {
      // A group size from the flag is the flag's problem; a batch the ranks do not divide names --world-size.
      if (cp_flag && e.key() == "distributed.context_parallel")
        throw megaslide::tools::UsageError("--context-parallel: " + e.problem());
      throw;
    }
    std::cout << (json ? megaslide::plan::to_json(plan) + "\n" : megaslide::plan::to_table(plan));
    return 0;
  });
}
