// bench_distributed: what data parallelism of the streamed CPU-master trainer costs per step, measured
// on this machine with Gloo ranks on localhost (docs/distributed.md). It runs the config's streamed
// trainer as one process (the anchor) and as --ranks processes (its host state sharded), each for
// --steps steps after one warm-up step, and prints per rank and step:
//   exchange bytes   what the rank handed to the block exchange (reduce-scatter inputs + all-gather
//                    outputs) against 2 × compute-dtype bytes × streamed parameters (ratio ≈ 1)
//   exchange s       the host task thread's seconds inside those collectives
//   overlap          1 − optimizer_wait_s / (optimizer_s + exchange_s): the share of the host work
//                    (AdamW and the exchange) that ran while the compute side went on
//   host bytes       the rank's host store against the single process's
//   step time        against the single process's (same global batch)
// The last line is one JSON object.
//
//   build/bin/bench_distributed --config configs/smoke.yaml [--ranks 2] [--steps 5] [--set key=value ...]
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/train/trainer.h"
#include "megaslide/train/distributed.h"

namespace {

struct Figures {
  int64_t streamed_params = 0, host_bytes = 0, exchange_bytes = 0;
  double step_s = 0, exchange_s = 0, optimizer_s = 0, optimizer_wait_s = 0;
  int64_t compute_bytes = 4;  // bytes per element of the compute dtype
};

// Builds the trainer (sharded when `communicator` spans several ranks), one warm-up step, then `steps`
// steps averaged.
Figures measure(const megaslide::RunConfig& config, megaslide::Communicator* communicator, int steps) {
  megaslide::Trainer trainer = megaslide::make_trainer(config, communicator);  // offload.enabled: true
  trainer.step();
  trainer.synchronize();
  Figures f;
  f.streamed_params = trainer.engine()->streamed_parameter_count();
  f.host_bytes = trainer.engine()->store().memory_report().total_bytes();
  f.compute_bytes = static_cast<int64_t>(c10::elementSize(trainer.engine()->options().compute_dtype));
  for (int i = 0; i < steps; ++i) {
    const auto m = trainer.step();
    f.step_s += m.step_time_s / steps;
    f.exchange_bytes += m.exchange_bytes / steps;
    f.exchange_s += m.exchange_s / steps;
    f.optimizer_s += m.optimizer_s / steps;
    f.optimizer_wait_s += m.optimizer_wait_s / steps;
  }
  trainer.synchronize();
  return f;
}

nlohmann::json to_json(const Figures& f) {
  return {{"streamed_params", f.streamed_params},
          {"host_bytes", f.host_bytes},
          {"exchange_bytes", f.exchange_bytes},
          {"step_s", f.step_s},
          {"exchange_s", f.exchange_s},
          {"optimizer_s", f.optimizer_s},
          {"optimizer_wait_s", f.optimizer_wait_s},
          {"compute_bytes", f.compute_bytes}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  std::vector<std::string> overrides{"train.device=cpu", "offload.enabled=true", "train.checkpoint_every=0"};
  int64_t ranks = 2;
  int steps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--config") == 0) config_path = argv[i + 1];
    else if (std::strcmp(argv[i], "--set") == 0) overrides.push_back(argv[i + 1]);
    else if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_distributed: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (config_path.empty() || ranks < 2 || steps < 1) {
    std::fprintf(stderr,
                 "usage: bench_distributed --config FILE [--ranks R >= 2] [--steps N >= 1] [--set key=value ...]\n");
    return 2;
  }
  megaslide::RunConfig config;
  try {
    config = megaslide::load_run_config(config_path, overrides);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_distributed: %s\n", e.what());
    return 2;
  }
  const char* result_file = std::getenv("MEGASLIDE_BENCH_RESULT");
  const megaslide::LaunchEnv env = megaslide::read_launch_env();
  if (env.distributed()) {  // one rank of the sharded run, started below by launch_local_ranks
    megaslide::Communicator communicator(env, "gloo", config.distributed.timeout_s, torch::kCPU);
    const Figures f = measure(config, &communicator, steps);
    std::ofstream(fmt::format("{}.rank{}", result_file, env.rank)) << to_json(f).dump() << "\n";
    return 0;
  }
  if (!megaslide::gloo_available()) {
    std::fprintf(stderr, "bench_distributed: this build has no Gloo backend\n");
    return 1;
  }
  if (config.train.batch_size % ranks != 0) {
    std::fprintf(stderr, "bench_distributed: train.batch_size %lld does not split over %lld ranks\n",
                 static_cast<long long>(config.train.batch_size), static_cast<long long>(ranks));
    return 2;
  }
  const Figures single = measure(config, nullptr, steps);
  const std::string base = fmt::format("/tmp/bench_distributed-{}", ::getpid());
  ::setenv("MEGASLIDE_BENCH_RESULT", base.c_str(), 1);
  std::vector<std::string> args(argv, argv + argc);
  const int code = megaslide::launch_local_ranks(args, ranks, 0);
  if (code != 0) {
    std::fprintf(stderr, "bench_distributed: a rank failed (exit %d)\n", code);
    return 1;
  }
  nlohmann::json out{{"config", config_path}, {"ranks", ranks}, {"steps", steps}, {"single", to_json(single)}};
  std::printf(
      "bench_distributed: %s, %lld streamed parameters, global batch %lld, %lld Gloo ranks on localhost vs one "
      "process\n",
      config_path.c_str(), static_cast<long long>(single.streamed_params),
      static_cast<long long>(config.train.batch_size), static_cast<long long>(ranks));
  std::printf("%-6s %16s %10s %12s %10s %12s %12s\n", "rank", "exchange B", "vs 2·b·P", "exchange s", "overlap",
              "host vs 1", "step vs 1");
  for (int64_t r = 0; r < ranks; ++r) {
    const std::string path = fmt::format("{}.rank{}", base, r);
    std::ifstream in(path);
    nlohmann::json j;
    in >> j;
    std::remove(path.c_str());
    const double expected =
        2.0 * static_cast<double>(j["compute_bytes"].get<int64_t>() * j["streamed_params"].get<int64_t>());
    const double host_work = j["optimizer_s"].get<double>() + j["exchange_s"].get<double>();
    const double overlap = host_work > 0 ? 1.0 - j["optimizer_wait_s"].get<double>() / host_work : 1.0;
    j["exchange_vs_2bP"] = j["exchange_bytes"].get<double>() / expected;
    j["overlap"] = overlap;
    j["host_vs_single"] = static_cast<double>(j["host_bytes"].get<int64_t>()) / static_cast<double>(single.host_bytes);
    j["step_vs_single"] = j["step_s"].get<double>() / single.step_s;
    std::printf("%-6lld %16lld %10.4f %12.4f %10.3f %12.3f %12.3f\n", static_cast<long long>(r),
                static_cast<long long>(j["exchange_bytes"].get<int64_t>()), j["exchange_vs_2bP"].get<double>(),
                j["exchange_s"].get<double>(), overlap, j["host_vs_single"].get<double>(),
                j["step_vs_single"].get<double>());
    out["rank" + std::to_string(r)] = j;
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
