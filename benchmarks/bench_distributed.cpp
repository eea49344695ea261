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
//
// --mode context: what context parallelism's attention exchanges, for the config's 3D-DSA model (its hidden
// width, heads, kernel, temporal offset range and token grid; one sample of train.batch_size): the --ranks Gloo
// ranks split the frames, and each runs the attention's forward and backward over the group as 3D-DSA's halo
// exchange (ops::dsa3d_context_parallel, offsets drawn across the model's range) and as dense attention's Ulysses
// all-to-all (the anchor: what a dense model of the same size sends), --steps times after a warm-up. Per rank:
// bytes sent and seconds inside the exchanges per forward + backward, and the halo's fraction of Ulysses'.
//
//   build/bin/bench_distributed --mode context --config configs/smoke.yaml --ranks 2 --set data.frames=32
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/attention/context_parallel.h"
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

// A group's exchange that counts what goes through it: bytes sent and seconds inside.
class CountingFrames final : public megaslide::ops::FrameExchange {
 public:
  explicit CountingFrames(megaslide::ops::FrameExchange& inner) : inner_(inner) {}
  int64_t rank() const override { return inner_.rank(); }
  int64_t size() const override { return inner_.size(); }
  void exchange(const std::vector<std::pair<int64_t, at::Tensor>>& sends,
                const std::vector<std::pair<int64_t, at::Tensor>>& recvs) override {
    const auto start = std::chrono::steady_clock::now();
    inner_.exchange(sends, recvs);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (const auto& [peer, t] : sends) bytes += static_cast<int64_t>(t.nbytes());
  }
  double max(double value) override { return inner_.max(value); }
  int64_t bytes = 0;
  double seconds = 0.0;

 private:
  megaslide::ops::FrameExchange& inner_;
};

// One rank of --mode context: the halo's and Ulysses' bytes and seconds per forward + backward, averaged.
nlohmann::json measure_context(const megaslide::RunConfig& config, megaslide::Communicator& communicator, int steps) {
  namespace ops = megaslide::ops;
  megaslide::CommunicatorFrames group(communicator);
  CountingFrames counted(group);
  const auto& m = config.model;
  const auto shape = megaslide::model_sample_shape(config);
  const int64_t T = shape[1] / m.patch[0], H = shape[2] / m.patch[1], W = shape[3] / m.patch[2];
  const int64_t B = config.train.batch_size, M = m.heads, d = m.hidden / m.heads, n = communicator.world_size();
  const auto split = ops::FrameSplit::balanced(T, n);
  const int64_t r = communicator.rank(), Tr = split.size(r);
  const auto kernel = ops::effective_kernel(m.dsa_kernel, {T, H, W});
  torch::manual_seed(7 + r);
  const auto q = torch::randn({B, Tr, H, W, M, d}), k = torch::randn_like(q), v = torch::randn_like(q);
  const auto range = torch::tensor({m.dsa_offset_range[0], m.dsa_offset_range[1], m.dsa_offset_range[2]});
  const auto offsets = (torch::rand({B, Tr, H, W, 1, kernel[0] * kernel[1] * kernel[2], 3}) * 2 - 1) * range;
  const auto run = [&](bool halo) {
    auto ql = q.clone().requires_grad_(), kl = k.clone().requires_grad_(), vl = v.clone().requires_grad_();
    const auto out =
        halo ? ops::dsa3d_context_parallel(ql, kl, vl, offsets, std::nullopt, m.dsa_kernel, split, counted)
             : ops::ulysses_attention(ql.flatten(1, 3), kl.flatten(1, 3), vl.flatten(1, 3), split, H * W, counted);
    out.sum().backward();
  };
  nlohmann::json j{{"frames", Tr}, {"tokens", Tr * H * W}};
  for (const bool halo : {true, false}) {
    const char* name = halo ? "halo" : "ulysses";
    if (!halo && M % n != 0) {
      j[name] = nullptr;  // Ulysses needs the heads divisible by the group
      continue;
    }
    run(halo);  // warm-up
    counted.bytes = 0;
    counted.seconds = 0.0;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) run(halo);
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    j[name] = {{"bytes", counted.bytes / steps}, {"exchange_s", counted.seconds / steps}, {"total_s", total / steps}};
  }
  return j;
}

// Rank r's JSON line, written by its process under `base`, read and removed.
nlohmann::json take_rank_result(const std::string& base, int64_t r) {
  const std::string path = fmt::format("{}.rank{}", base, r);
  std::ifstream in(path);
  nlohmann::json j;
  in >> j;
  std::remove(path.c_str());
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  std::vector<std::string> overrides{"train.device=cpu", "offload.enabled=true", "train.checkpoint_every=0"};
  int64_t ranks = 2;
  int steps = 5;
  std::string mode = "data";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--config") == 0) config_path = argv[i + 1];
    else if (std::strcmp(argv[i], "--mode") == 0) mode = argv[i + 1];
    else if (std::strcmp(argv[i], "--set") == 0) overrides.push_back(argv[i + 1]);
    else if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_distributed: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (config_path.empty() || ranks < 2 || steps < 1 || (mode != "data" && mode != "context")) {
    std::fprintf(stderr,
                 "usage: bench_distributed --config FILE [--mode data|context] [--ranks R >= 2] [--steps N >= 1] "
                 "[--set key=value ...]\n");
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
    const auto j = mode == "context" ? measure_context(config, communicator, steps)
                                     : to_json(measure(config, &communicator, steps));
    std::ofstream(fmt::format("{}.rank{}", result_file, env.rank)) << j.dump() << "\n";
    return 0;
  }
  if (!megaslide::gloo_available()) {
    std::fprintf(stderr, "bench_distributed: this build has no Gloo backend\n");
    return 1;
  }
  if (mode == "context") {
    const auto& m = config.model;
    const std::string base = fmt::format("/tmp/bench_distributed-{}", ::getpid());
    ::setenv("MEGASLIDE_BENCH_RESULT", base.c_str(), 1);
    std::vector<std::string> args(argv, argv + argc);
    if (const int code = megaslide::launch_local_ranks(args, ranks, 0); code != 0) {
      std::fprintf(stderr, "bench_distributed: a rank failed (exit %d)\n", code);
      return 1;
    }
    const auto shape = megaslide::model_sample_shape(config);
    nlohmann::json out{{"mode", "context"},
                       {"config", config_path},
                       {"ranks", ranks},
                       {"steps", steps},
                       {"token_grid", {shape[1] / m.patch[0], shape[2] / m.patch[1], shape[3] / m.patch[2]}},
                       {"hidden", m.hidden},
                       {"heads", m.heads},
                       {"batch", config.train.batch_size}};
    std::printf(
        "bench_distributed --mode context: %s, token grid %lldx%lldx%lld, hidden %lld, %lld heads, kernel "
        "%lldx%lldx%lld, "
        "temporal range %g, batch %lld, %lld Gloo ranks; per rank and attention forward + backward\n",
        config_path.c_str(), static_cast<long long>(shape[1] / m.patch[0]),
        static_cast<long long>(shape[2] / m.patch[1]), static_cast<long long>(shape[3] / m.patch[2]),
        static_cast<long long>(m.hidden), static_cast<long long>(m.heads), static_cast<long long>(m.dsa_kernel[0]),
        static_cast<long long>(m.dsa_kernel[1]), static_cast<long long>(m.dsa_kernel[2]), m.dsa_offset_range[0],
        static_cast<long long>(config.train.batch_size), static_cast<long long>(ranks));
    std::printf("%-6s %7s %14s %12s %14s %12s %12s %12s\n", "rank", "frames", "halo B", "halo s", "Ulysses B",
                "Ulysses s", "bytes ratio", "time ratio");
    for (int64_t r = 0; r < ranks; ++r) {
      nlohmann::json j = take_rank_result(base, r);
      const auto& h = j["halo"];
      const auto& u = j["ulysses"];
      if (!u.is_null()) {
        j["bytes_vs_ulysses"] = h["bytes"].get<double>() / u["bytes"].get<double>();
        j["exchange_s_vs_ulysses"] = h["exchange_s"].get<double>() / u["exchange_s"].get<double>();
      }
      std::printf("%-6lld %7lld %14lld %12.5f %14s %12s %12s %12s\n", static_cast<long long>(r),
                  static_cast<long long>(j["frames"].get<int64_t>()), static_cast<long long>(h["bytes"].get<int64_t>()),
                  h["exchange_s"].get<double>(),
                  u.is_null() ? "n/a (heads)" : std::to_string(u["bytes"].get<int64_t>()).c_str(),
                  u.is_null() ? "-" : fmt::format("{:.5f}", u["exchange_s"].get<double>()).c_str(),
                  u.is_null() ? "-" : fmt::format("{:.4f}", j["bytes_vs_ulysses"].get<double>()).c_str(),
                  u.is_null() ? "-" : fmt::format("{:.4f}", j["exchange_s_vs_ulysses"].get<double>()).c_str());
      out["rank" + std::to_string(r)] = j;
    }
    std::printf("%s\n", out.dump().c_str());
    return 0;
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
    nlohmann::json j = take_rank_result(base, r);
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
