// bench_cpu_adamw: one AdamW step over 64 M parameters with 2 threads, three ways, in one run:
//   - CpuAdamW::step_block: bf16 gradient in, fp32 master/m/v updated, bf16 compute copy out (with
//     its default copy stores, and for comparison with ordinary stores forced);
//   - torch::optim::AdamW::step on the same values (fp32 parameter, fp32 gradient), the anchor;
//   - CpuAdamW::stream_probe: the same bytes with trivial arithmetic, the memory roofline, measured
//     with ordinary and with streaming stores for the copy; the faster of the two is the roofline.
// Bytes per step follow DESIGN.md §6: 28 B per parameter (read master, m, v, bf16 grad; write master,
// m, v, bf16 copy). Each timing is the fastest of --reps runs, interleaved so that load from other
// processes hits all three alike. The last line is one JSON object.
//
//   build/bin/bench_cpu_adamw [--params N] [--threads T] [--reps R] [--torch-reps R]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = int_flag(argc, argv, "--params", int64_t{64} << 20);
  const int threads = static_cast<int>(int_flag(argc, argv, "--threads", 2));
  const int reps = static_cast<int>(int_flag(argc, argv, "--reps", 20));
  const int torch_reps = static_cast<int>(int_flag(argc, argv, "--torch-reps", 5));
  const double bytes_per_step = 28.0 * static_cast<double>(n);
  const megaslide::offload::AdamWOptions options;  // LibTorch's defaults, weight decay 1e-2
  const double lr = 1e-3;

  // The optimizer state lives where the trainer keeps it: one HostParamStore block.
  megaslide::offload::HostParamStore store({{"block0", {{"weight", {n}}}}});
  torch::manual_seed(0);
  store.master(0).copy_(torch::randn({n}) * 0.02);
  store.grad(0).copy_(torch::randn({n}) * 1e-3);
  AdamWBlockState s;
  s.master = store.master(0).data_ptr<float>();
  s.exp_avg = store.exp_avg(0).data_ptr<float>();
  s.exp_avg_sq = store.exp_avg_sq(0).data_ptr<float>();
  s.grad = store.grad(0).data_ptr();
  s.grad_dtype = at::kBFloat16;
  s.compute = store.compute(0).data_ptr();
  s.compute_dtype = at::kBFloat16;
  s.numel = n;

  // The anchor on the same values: fp32 parameter, the bf16 gradient widened to fp32.
  torch::set_num_threads(threads);
  torch::Tensor param = store.master(0).clone();
  param.mutable_grad() = store.grad(0).to(torch::kFloat);
  torch::optim::AdamW torch_adamw({param}, torch::optim::AdamWOptions(lr)
                                               .betas({options.beta1, options.beta2})
                                               .eps(options.eps)
                                               .weight_decay(options.weight_decay));

  CpuAdamW adamw(options, threads);
  CpuAdamW adamw_1thread(options, 1);
  // One untimed pass each, so no page is touched for the first time inside a timing.
  int64_t step = 1;
  adamw.step_block(s, step++, lr);
  adamw.stream_probe(s);
  torch_adamw.step();

  using megaslide::offload::CopyStores;
  const auto probe = [&](CpuAdamW& optimizer, CopyStores stores) {
    optimizer.set_copy_stores(stores);
    const double t = time_s([&] { optimizer.stream_probe(s); });
    optimizer.set_copy_stores(CopyStores::kAuto);
    return t;
  };
  std::vector<double> t_adamw, t_adamw_cached, t_cached, t_streaming, t_1thread, t_torch;
  for (int r = 0; r < reps; ++r) {
    t_adamw.push_back(time_s([&] { adamw.step_block(s, step++, lr); }));
    adamw.set_copy_stores(CopyStores::kCached);
    t_adamw_cached.push_back(time_s([&] { adamw.step_block(s, step++, lr); }));
    adamw.set_copy_stores(CopyStores::kAuto);
    t_cached.push_back(probe(adamw, CopyStores::kCached));
    t_streaming.push_back(probe(adamw, CopyStores::kStreaming));
    if (r < 3) t_1thread.push_back(std::min(probe(adamw_1thread, CopyStores::kCached),
                                            probe(adamw_1thread, CopyStores::kStreaming)));
    if (r < torch_reps) t_torch.push_back(time_s([&] { torch_adamw.step(); }));
  }

  const auto gbps_of = [&](double seconds) { return bytes_per_step / seconds / 1e9; };
  const double roofline_s = std::min(best(t_cached), best(t_streaming));
  const double gbps = gbps_of(best(t_adamw));
  const double roofline_gbps = gbps_of(roofline_s);
  std::printf("CpuAdamW (%s, %d threads): %lld params, %.1f MB moved per step, best (median) of %d runs\n",
              megaslide::offload::to_string(adamw.path()), threads, static_cast<long long>(n),
              bytes_per_step / 1e6, reps);
  const auto row = [&](const char* name, const std::vector<double>& t) {
    std::printf("  %-44s %8.2f ms (%8.2f)  %6.1f GB/s\n", name, best(t) * 1e3, median(t) * 1e3, gbps_of(best(t)));
  };
  row("CpuAdamW::step_block, bf16 grad in, bf16 out", t_adamw);
  row("  the same, forced cached copy stores", t_adamw_cached);
  row("roofline: stream probe, cached copy stores", t_cached);
  row("roofline: stream probe, streaming copy stores", t_streaming);
  row("roofline: stream probe, 1 thread", t_1thread);
  row("torch::optim::AdamW::step, fp32", t_torch);
  std::printf(
      "{\"bench\":\"cpu_adamw\",\"params\":%lld,\"threads\":%d,\"path\":\"%s\",\"bytes_per_step\":%.0f,"
      "\"adamw_ms\":%.3f,\"roofline_ms\":%.3f,\"torch_adamw_ms\":%.3f,\"gbps\":%.2f,\"adamw_cached_gbps\":%.2f,"
      "\"roofline_gbps\":%.2f,"
      "\"roofline_cached_gbps\":%.2f,\"roofline_streaming_gbps\":%.2f,\"roofline_gbps_1thread\":%.2f,"
      "\"torch_adamw_gbps\":%.2f,\"speedup_vs_torch_adamw\":%.2f,\"fraction_of_roofline\":%.3f}\n",
      static_cast<long long>(n), threads, megaslide::offload::to_string(adamw.path()), bytes_per_step,
      best(t_adamw) * 1e3, roofline_s * 1e3, best(t_torch) * 1e3, gbps, gbps_of(best(t_adamw_cached)),
      roofline_gbps, gbps_of(best(t_cached)),
      gbps_of(best(t_streaming)), gbps_of(best(t_1thread)), gbps_of(best(t_torch)), best(t_torch) / best(t_adamw),
      gbps / roofline_gbps);
  return 0;
}
