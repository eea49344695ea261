// bench_cpu_adamw: one AdamW step over 64 M parameters with 2 threads, in one run:
//   - CpuAdamW::step_block as the streamed trainer runs it at accumulation 1: the bf16 gradient read from
//     the block's compute-copy buffer and the new bf16 copy written over it, master updated in fp32, the
//     moments m and v in each optimizer.state_dtype — fp32, bf16, int8 (with its group scales) — and, for
//     fp32 moments, with ordinary stores forced for comparison;
//   - torch::optim::AdamW::step on the same values (fp32 parameter, fp32 gradient), the anchor;
//   - CpuAdamW::stream_probe on the same arrays for each state dtype: the same bytes with trivial
//     arithmetic, the memory roofline, measured with ordinary and with streaming stores for the copy;
//     the faster of the two is the roofline.
// Bytes per parameter and step (DESIGN.md §6): read and write master (8), m and v (4 x 4 fp32, 4 x 2
// bf16, 4 x 1 int8 plus 16 B of scales per 256), read the bf16 gradient (2), write the bf16 copy (2):
// 28, 20 and 16.06. Each timing is the fastest of --reps runs, interleaved so that load from other
// processes hits all of them alike. The last line is one JSON object (fp32 keys unprefixed, the others
// prefixed bf16_ and int8_).
//
// --path picks the SIMD path (auto: the widest the CPU has), so one machine times AVX-512 and AVX2 alike.
// When the Python it finds (MEGASLIDE_PYTHON, else python3) imports deepspeed, DeepSpeed's DeepSpeedCPUAdam runs
// on the same sizes and threads beside ours (its own fp32-gradient path, and the trainer's bf16 path with the
// casts it needs); otherwise the run says it skipped it, and why (--deepspeed 0 skips it).
//
//   build/bin/bench_cpu_adamw [--params N] [--threads T] [--reps R] [--torch-reps R] [--path auto|avx512|avx2|scalar]
//                             [--deepspeed 0|1]
#include <fcntl.h>
#include <poll.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <torch/types.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/offload/cpu_adamw.h"
#include "megaslide/offload/host_param_store.h"

namespace {

using Clock = std::chrono::steady_clock;
using megaslide::offload::AdamWBlockState;
using megaslide::offload::CpuAdamW;

template <typename Fn>
double time_s(Fn&& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

int64_t int_flag(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::strtoll(argv[i + 1], nullptr, 10);
  return fallback;
}

const char* string_flag(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

// DeepSpeed's CPU Adam (deepspeed.ops.adam.DeepSpeedCPUAdam, adamw_mode) on the same sizes, in the Python the
// benchmark finds (MEGASLIDE_PYTHON, else python3), with the same threads (OMP_NUM_THREADS): its own path (fp32
// parameter, fp32 gradient) and the trainer's (a bf16 gradient widened to fp32 first, the bf16 compute copy
// written after), the best of `reps` each. Exit status 3 when deepspeed cannot be imported, 4 when its optimizer
// fails (its extension does not build here, ...), with the reason on the last line of its output. The first use
// compiles DeepSpeed's extension (about a minute; it is cached afterwards); the run is stopped after
// kDeepSpeedTimeoutS.
constexpr const char* kDeepSpeedScript = R"PY(
import json, sys, time
n, threads, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
try:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    import deepspeed
except Exception as e:  # not installed
    print((f"{type(e).__name__}: {e}".splitlines() or [""])[0])
    sys.exit(3)
def fail(e):  # the extension does not build here, or the optimizer fails
    print((f"{type(e).__name__}: {e}".splitlines() or [""])[0])
    sys.exit(4)
try:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    g32 = torch.randn(n) * 1e-3
    g16 = g32.to(torch.bfloat16)
    copy = torch.empty(n, dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, adamw_mode=True)
    p.grad = g32
    opt.step()  # the state's first touch, untimed
    def best(fn):
        times = []
        for _ in range(reps):
            t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
        return min(times)
    def fp32_step():
        p.grad = g32
        opt.step()
    def trainer_path():
        p.grad = g16.float()
        opt.step()
        copy.copy_(p.detach())
    print(json.dumps({"deepspeed": deepspeed.__version__, "fp32_grad_s": best(fp32_step),
                      "bf16_casts_s": best(trainer_path)}))
except Exception as e:
    fail(e)
)PY";

constexpr int kDeepSpeedTimeoutS = 900;

struct DeepSpeedTimes {
  bool ran = false;
  std::string message;  // why not, or its version
  double fp32_grad_s = 0, bf16_casts_s = 0;
};

DeepSpeedTimes run_deepspeed(int64_t n, int threads, int reps) {
  DeepSpeedTimes out;
  char path[] = "/tmp/bench-cpu-adamw-deepspeed-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) {
    out.message = "cannot write its script to /tmp";
    return out;
  }
  const std::string script = kDeepSpeedScript;
  const bool written = ::write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  ::close(fd);
  // The interpreter and the arguments go to execvp as they are: no shell sees them.
  const char* python_env = std::getenv("MEGASLIDE_PYTHON");
  const std::string python = python_env != nullptr && *python_env ? python_env : "python3";
  const std::string args[] = {python, path, std::to_string(n), std::to_string(threads), std::to_string(reps)};
  // The child's environment, built before fork (the child only calls async-signal-safe functions): this
  // process's, with OMP_NUM_THREADS set to the benchmark's threads.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, "OMP_NUM_THREADS=", 16) != 0) env_strings.emplace_back(*e);
  env_strings.push_back("OMP_NUM_THREADS=" + args[3]);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  char* argv[] = {const_cast<char*>(args[0].c_str()), const_cast<char*>(args[1].c_str()),
                  const_cast<char*>(args[2].c_str()), const_cast<char*>(args[3].c_str()),
                  const_cast<char*>(args[4].c_str()), nullptr};
  std::string output;
  int status = -1;
  bool timed_out = false;
  int fds[2];
  if (written && ::pipe(fds) == 0) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(fds[1], STDOUT_FILENO);
      const int null = ::open("/dev/null", O_WRONLY);  // the extension's build log
      if (null >= 0) ::dup2(null, STDERR_FILENO);
      ::close(fds[0]);
      ::execvpe(argv[0], argv, envp.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    if (pid > 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kDeepSpeedTimeoutS);
      char buffer[4096];
      for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
        pollfd pfd{fds[0], POLLIN, 0};
        if (left <= 0 || ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1000))) < 0) {
          if (left <= 0) timed_out = true;
          if (left <= 0 || errno != EINTR) break;
          continue;
        }
        if (pfd.revents == 0) continue;
        const ssize_t got = ::read(fds[0], buffer, sizeof buffer);
        if (got <= 0) break;
        output.append(buffer, got);
      }
      if (timed_out) ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    ::close(fds[0]);
  }
  std::remove(path);
  while (!output.empty() && (output.back() == '\n' || output.back() == '\r')) output.pop_back();
  const auto last_line =
      output.substr(output.find_last_of('\n') == std::string::npos ? 0 : output.find_last_of('\n') + 1);
  const auto result = nlohmann::json::parse(last_line, nullptr, /*allow_exceptions=*/false);
  const bool numbers = result.is_object() && result.contains("fp32_grad_s") && result["fp32_grad_s"].is_number() &&
                       result.contains("bf16_casts_s") && result["bf16_casts_s"].is_number();
  if (status == 0 && numbers) {
    out.ran = true;
    out.fp32_grad_s = result["fp32_grad_s"].get<double>();
    out.bf16_casts_s = result["bf16_casts_s"].get<double>();
    const auto& version = result.contains("deepspeed") ? result["deepspeed"] : nlohmann::json();
    out.message = version.is_string() ? version.get<std::string>() : version.dump();
  } else if (timed_out) {
    out.message = "its run took over " + std::to_string(kDeepSpeedTimeoutS) + " s and was stopped";
  } else if (WIFSIGNALED(status)) {
    out.message = "its run was ended by signal " + std::to_string(WTERMSIG(status));
  } else {
    const std::string why =
        last_line.empty() ? "no output; exit status " + std::to_string(WEXITSTATUS(status)) : last_line;
    out.message = WIFEXITED(status) && WEXITSTATUS(status) == 127 ? "no Python at '" + python + "'"
                  : WIFEXITED(status) && WEXITSTATUS(status) == 3 ? "deepspeed is not importable here (" + why + ")"
                                                                  : "its run failed (" + why + ")";
  }
  return out;
}

}  // namespace

using megaslide::offload::StateDtype;

// One state dtype's store and the timings of its kernel and its roofline.
struct StateRun {
  StateDtype dtype;
  std::unique_ptr<megaslide::offload::HostParamStore> store;
  AdamWBlockState s;
  double bytes_per_step = 0;
  std::vector<double> adamw, adamw_cached, probe_cached, probe_streaming;
};

int main(int argc, char** argv) {
  const int64_t n = int_flag(argc, argv, "--params", int64_t{64} << 20);
  const int threads = static_cast<int>(int_flag(argc, argv, "--threads", 2));
  const int reps = static_cast<int>(int_flag(argc, argv, "--reps", 20));
  const int torch_reps = static_cast<int>(int_flag(argc, argv, "--torch-reps", 5));
  using megaslide::offload::SimdPath;
  const std::string path_name = string_flag(argc, argv, "--path", "auto");
  const SimdPath paths[] = {SimdPath::kAuto, SimdPath::kAvx512, SimdPath::kAvx2, SimdPath::kScalar};
  const SimdPath* named = std::find_if(std::begin(paths), std::end(paths),
                                       [&](SimdPath p) { return path_name == megaslide::offload::to_string(p); });
  if (named == std::end(paths)) {
    std::fprintf(stderr, "bench_cpu_adamw: --path %s: expected auto, avx512, avx2 or scalar\n", path_name.c_str());
    return 2;
  }
  const SimdPath path = *named;
  if (!CpuAdamW::supported(path)) {
    std::fprintf(stderr, "bench_cpu_adamw: --path %s: this CPU lacks it\n", path_name.c_str());
    return 2;
  }
  const megaslide::offload::AdamWOptions options;  // LibTorch's defaults, weight decay 1e-2
  const double lr = 1e-3;

  // The optimizer state lives where the trainer keeps it: one HostParamStore block per state dtype, the
  // gradient in the compute copy's buffer.
  torch::manual_seed(0);
  const torch::Tensor master0 = torch::randn({n}) * 0.02, grad0 = torch::randn({n}) * 1e-3;
  std::vector<StateRun> runs;
  for (StateDtype dtype : {StateDtype::kFloat32, StateDtype::kBFloat16, StateDtype::kInt8}) {
    megaslide::offload::HostParamStoreOptions o;
    o.state_dtype = dtype;
    StateRun r{dtype, std::make_unique<megaslide::offload::HostParamStore>(
                          std::vector<megaslide::offload::BlockSpec>{{"block0", {{"weight", {n}}}}}, o)};
    auto& store = *r.store;
    store.master(0).copy_(master0);
    store.grad(0).copy_(grad0);
    r.s.master = store.master(0).data_ptr<float>();
    r.s.exp_avg = store.exp_avg(0).data_ptr();
    r.s.exp_avg_sq = store.exp_avg_sq(0).data_ptr();
    if (dtype == StateDtype::kInt8) {
      r.s.exp_avg_scale = store.exp_avg_scale(0).data_ptr<float>();
      r.s.exp_avg_sq_scale = store.exp_avg_sq_scale(0).data_ptr<float>();
    }
    r.s.state_dtype = dtype;
    r.s.grad = store.grad(0).data_ptr();
    r.s.grad_dtype = at::kBFloat16;
    r.s.compute = store.compute(0).data_ptr();
    r.s.compute_dtype = at::kBFloat16;
    r.s.numel = n;
    const double scales =
        dtype == StateDtype::kInt8 ? 2.0 * 2 * 4 * static_cast<double>(store.exp_avg_scale(0).numel()) : 0.0;
    r.bytes_per_step =
        (8.0 + 4.0 * megaslide::offload::state_element_bytes(dtype) + 2 + 2) * static_cast<double>(n) + scales;
    runs.push_back(std::move(r));
  }

  // The anchor on the same values: fp32 parameter, the bf16 gradient widened to fp32.
  torch::set_num_threads(threads);
  torch::Tensor param = master0.clone();
  param.mutable_grad() = grad0.to(torch::kBFloat16).to(torch::kFloat);
  torch::optim::AdamW torch_adamw({param}, torch::optim::AdamWOptions(lr)
                                               .betas({options.beta1, options.beta2})
                                               .eps(options.eps)
                                               .weight_decay(options.weight_decay));

  CpuAdamW adamw(options, threads, path);
  CpuAdamW adamw_1thread(options, 1, path);
  // One untimed pass each, so no page is touched for the first time inside a timing.
  int64_t step = 1;
  for (auto& r : runs) {
    adamw.step_block(r.s, step, lr);
    adamw.stream_probe(r.s);
  }
  ++step;
  torch_adamw.step();

  using megaslide::offload::CopyStores;
  const auto probe = [&](CpuAdamW& optimizer, const AdamWBlockState& s, CopyStores stores) {
    optimizer.set_copy_stores(stores);
    const double t = time_s([&] { optimizer.stream_probe(s); });
    optimizer.set_copy_stores(CopyStores::kAuto);
    return t;
  };
  std::vector<double> t_1thread, t_torch;
  for (int rep = 0; rep < reps; ++rep) {
    for (auto& r : runs) {
      r.adamw.push_back(time_s([&] { adamw.step_block(r.s, step, lr); }));
      if (r.dtype == StateDtype::kFloat32) {
        adamw.set_copy_stores(CopyStores::kCached);
        r.adamw_cached.push_back(time_s([&] { adamw.step_block(r.s, step, lr); }));
        adamw.set_copy_stores(CopyStores::kAuto);
      }
      r.probe_cached.push_back(probe(adamw, r.s, CopyStores::kCached));
      r.probe_streaming.push_back(probe(adamw, r.s, CopyStores::kStreaming));
    }
    ++step;
    if (rep < 3)
      t_1thread.push_back(std::min(probe(adamw_1thread, runs[0].s, CopyStores::kCached),
                                   probe(adamw_1thread, runs[0].s, CopyStores::kStreaming)));
    if (rep < torch_reps) t_torch.push_back(time_s([&] { torch_adamw.step(); }));
  }

  const StateRun& fp32 = runs[0];
  const auto gbps_of = [&](const StateRun& r, double seconds) { return r.bytes_per_step / seconds / 1e9; };
  const auto roofline_s = [](const StateRun& r) { return std::min(best(r.probe_cached), best(r.probe_streaming)); };
  std::printf(
      "CpuAdamW (%s, %d threads): %lld params, best (median) of %d runs; the gradient in the compute copy's buffer\n",
      megaslide::offload::to_string(adamw.path()), threads, static_cast<long long>(n), reps);
  const auto row = [&](const std::string& name, const StateRun& r, const std::vector<double>& t) {
    std::printf("  %-52s %8.2f ms (%8.2f)  %6.1f GB/s\n", name.c_str(), best(t) * 1e3, median(t) * 1e3,
                gbps_of(r, best(t)));
  };
  for (const auto& r : runs) {
    const std::string state = megaslide::offload::to_string(r.dtype);
    std::printf(" %s moments: %.2f B per parameter, %.1f MB per step\n", state.c_str(),
                r.bytes_per_step / static_cast<double>(n), r.bytes_per_step / 1e6);
    row("CpuAdamW::step_block, bf16 grad in, bf16 copy out", r, r.adamw);
    if (!r.adamw_cached.empty()) row("  the same, forced cached copy stores", r, r.adamw_cached);
    row("roofline: stream probe, cached copy stores", r, r.probe_cached);
    row("roofline: stream probe, streaming copy stores", r, r.probe_streaming);
    std::printf("  %-52s %8.3f\n", "fraction of the roofline", roofline_s(r) / best(r.adamw));
  }
  row("fp32 roofline: stream probe, 1 thread", fp32, t_1thread);
  row("torch::optim::AdamW::step, fp32 (fp32 moments' bytes)", fp32, t_torch);

  // DeepSpeed's CPU Adam beside ours, when this environment's Python has it (--deepspeed 0 skips it). Ours is
  // timed again right after it (fp32 moments), with its own path's equal — an fp32 gradient, no copy — too.
  DeepSpeedTimes ds;
  std::vector<double> ours_fp32_grad, ours_again;
  if (int_flag(argc, argv, "--deepspeed", 1) != 0) {
    ds = run_deepspeed(n, threads, std::min(reps, 10));
    if (ds.ran) {
      torch::Tensor grad32 = grad0.clone();
      AdamWBlockState s = fp32.s;
      s.grad = grad32.data_ptr<float>();
      s.grad_dtype = at::kFloat;
      s.compute = nullptr;
      for (int rep = 0; rep < std::min(reps, 10); ++rep, ++step) {
        ours_fp32_grad.push_back(time_s([&] { adamw.step_block(s, step, lr); }));
        ours_again.push_back(time_s([&] { adamw.step_block(fp32.s, step, lr); }));
      }
    }
  } else {
    ds.message = "--deepspeed 0";
  }
  if (ds.ran) {
    std::printf(" DeepSpeed %s DeepSpeedCPUAdam (adamw_mode, fp32 moments, %d threads), best of %d, then ours again:\n",
                ds.message.c_str(), threads, std::min(reps, 10));
    std::printf("  %-52s %8.2f ms\n", "DeepSpeed: fp32 grad, no copy", ds.fp32_grad_s * 1e3);
    std::printf("  %-52s %8.2f ms   ours / DeepSpeed %.2fx faster\n", "CpuAdamW: fp32 grad, no copy",
                best(ours_fp32_grad) * 1e3, ds.fp32_grad_s / best(ours_fp32_grad));
    std::printf("  %-52s %8.2f ms\n", "DeepSpeed: bf16 grad widened, step, bf16 copy written", ds.bf16_casts_s * 1e3);
    std::printf("  %-52s %8.2f ms   ours / DeepSpeed %.2fx faster\n", "CpuAdamW: bf16 grad in, bf16 copy out",
                best(ours_again) * 1e3, ds.bf16_casts_s / best(ours_again));
  } else {
    std::printf(" DeepSpeed's CPU Adam: skipped, %s\n", ds.message.c_str());
  }

  const auto& b = runs[1];
  const auto& q = runs[2];
  std::printf(
      "{\"bench\":\"cpu_adamw\",\"params\":%lld,\"threads\":%d,\"path\":\"%s\",\"bytes_per_step\":%.0f,"
      "\"adamw_ms\":%.3f,\"roofline_ms\":%.3f,\"torch_adamw_ms\":%.3f,\"gbps\":%.2f,\"adamw_cached_gbps\":%.2f,"
      "\"roofline_gbps\":%.2f,"
      "\"roofline_cached_gbps\":%.2f,\"roofline_streaming_gbps\":%.2f,\"roofline_gbps_1thread\":%.2f,"
      "\"torch_adamw_gbps\":%.2f,\"speedup_vs_torch_adamw\":%.2f,\"fraction_of_roofline\":%.3f,"
      "\"bf16_bytes_per_step\":%.0f,\"bf16_adamw_ms\":%.3f,\"bf16_gbps\":%.2f,\"bf16_roofline_gbps\":%.2f,"
      "\"bf16_fraction_of_roofline\":%.3f,\"int8_bytes_per_step\":%.0f,\"int8_adamw_ms\":%.3f,\"int8_gbps\":%.2f,"
      "\"int8_roofline_gbps\":%.2f,\"int8_fraction_of_roofline\":%.3f%s}\n",
      static_cast<long long>(n), threads, megaslide::offload::to_string(adamw.path()), fp32.bytes_per_step,
      best(fp32.adamw) * 1e3, roofline_s(fp32) * 1e3, best(t_torch) * 1e3, gbps_of(fp32, best(fp32.adamw)),
      gbps_of(fp32, best(fp32.adamw_cached)), gbps_of(fp32, roofline_s(fp32)), gbps_of(fp32, best(fp32.probe_cached)),
      gbps_of(fp32, best(fp32.probe_streaming)), gbps_of(fp32, best(t_1thread)), gbps_of(fp32, best(t_torch)),
      best(t_torch) / best(fp32.adamw), roofline_s(fp32) / best(fp32.adamw), b.bytes_per_step, best(b.adamw) * 1e3,
      gbps_of(b, best(b.adamw)), gbps_of(b, roofline_s(b)), roofline_s(b) / best(b.adamw), q.bytes_per_step,
      best(q.adamw) * 1e3, gbps_of(q, best(q.adamw)), gbps_of(q, roofline_s(q)), roofline_s(q) / best(q.adamw),
      ds.ran ? (",\"deepspeed_fp32_grad_ms\":" + std::to_string(ds.fp32_grad_s * 1e3) +
                ",\"ours_fp32_grad_ms\":" + std::to_string(best(ours_fp32_grad) * 1e3) +
                ",\"deepspeed_bf16_casts_ms\":" + std::to_string(ds.bf16_casts_s * 1e3) +
                ",\"ours_bf16_again_ms\":" + std::to_string(best(ours_again) * 1e3))
                   .c_str()
             : "");
  return 0;
}
