// bench_dsa3d: the fused 3D-DSA kernel against its anchor, the grid_sample reference, forward +
// backward, at a few sizes. Prints per case the time of each, the speedup (reference / fused), and
// the memory each needs beyond its inputs, measured through LibTorch's allocator (CPU: a counting
// wrapper around LibTorch's CPU allocator; GPU: the caching allocator's statistics):
//   saved  bytes held between forward and backward (output + what autograd keeps);
//   peak   the most bytes allocated at once during forward + backward (gradients included).
// det_ms is the fused kernel's deterministic mode (docs/3d-dsa.md, "Determinism"). max_err is the
// largest error of out, dq and d(offsets) relative to the reference's largest value.
// The last line is one JSON object with every figure.
//
//   build/bin/bench_dsa3d                 # fused CPU vs reference on the CPU (LibTorch's thread count)
//   build/bin/bench_dsa3d --threads 1     # ... on one thread
//   build/bin/bench_dsa3d --cuda          # fused CUDA vs reference on the GPU (builds with kernels/)
//   build/bin/bench_dsa3d --reps 5 --quick
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "megaslide/attention/dsa3d.h"

namespace {

namespace ops = megaslide::ops;

// Wraps LibTorch's CPU allocator and counts live bytes and their peak.
class TrackingCpuAllocator final : public c10::Allocator {
 public:
  explicit TrackingCpuAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* context = new Context{std::move(inner), static_cast<int64_t>(n), this};
    const int64_t now = current_ += static_cast<int64_t>(n);
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return {data, context, &TrackingCpuAllocator::release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;
    int64_t bytes;
    TrackingCpuAllocator* owner;
  };
  static void release(void* ptr) {
    auto* context = static_cast<Context*>(ptr);
    context->owner->current_ -= context->bytes;
    delete context;
  }
  c10::Allocator* base_;
  std::atomic<int64_t> current_{0}, peak_{0};
};

TrackingCpuAllocator* cpu_tracker = nullptr;

struct Memory {
  int64_t current() const {
#ifdef MEGASLIDE_WITH_CUDA
    if (cuda) return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
#endif
    return cpu_tracker->current();
  }
  int64_t peak() const {
#ifdef MEGASLIDE_WITH_CUDA
    if (cuda) return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak;
#endif
    return cpu_tracker->peak();
  }
  void reset_peak() const {
#ifdef MEGASLIDE_WITH_CUDA
    if (cuda) return c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
    cpu_tracker->reset_peak();
  }
  bool cuda = false;
};

struct Case {
  std::string name;
  int64_t B, T, H, W, M, d;
  std::array<int64_t, 3> kernel;
};

struct Inputs {
  torch::Tensor q, k, v, offsets, bias, dout;
};

Inputs make_inputs(const Case& c, const torch::Device& device) {
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(device);
  const auto ke = ops::effective_kernel(c.kernel, {c.T, c.H, c.W});
  const int64_t K = ke[0] * ke[1] * ke[2];
  Inputs in;
  in.q = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts).requires_grad_(true);
  in.k = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts).requires_grad_(true);
  in.v = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts).requires_grad_(true);
  // Offsets between tokens (a trained offset network's are): all 8 corners of every sample are read.
  in.offsets = (torch::rand({c.B, c.T, c.H, c.W, 1, K, 3}, opts) * 3.0 - 1.5).requires_grad_(true);
  in.bias = (0.1 * torch::randn({c.M, K}, opts)).requires_grad_(true);
  in.dout = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts);
  return in;
}

void sync(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

struct Measurement {
  double ms = 0;             // median forward + backward
  int64_t saved_bytes = 0;   // held between forward and backward
  int64_t peak_bytes = 0;    // peak beyond the inputs during forward + backward
  torch::Tensor out, dq, doffsets;
};

void clear_grads(Inputs& in) {
  for (auto* t : {&in.q, &in.k, &in.v, &in.offsets, &in.bias}) t->mutable_grad() = torch::Tensor();
}

Measurement measure(Inputs& in, const Case& c, ops::DsaImpl impl, int reps, const Memory& memory,
                    const torch::Device& device, bool deterministic = false) {
  Measurement r;
  // Memory, on a separate run.
  {
    clear_grads(in);
    sync(device);
    const int64_t before = memory.current();
    memory.reset_peak();
    auto out = ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, impl, deterministic);
    sync(device);
    r.saved_bytes = memory.current() - before;
    out.backward(in.dout);
    sync(device);
    r.peak_bytes = memory.peak() - before;
    r.out = out.detach();
    r.dq = in.q.grad().clone();
    r.doffsets = in.offsets.grad().clone();
  }
  std::vector<double> times;
  for (int i = 0; i < reps + 1; ++i) {  // the first run warms up
    clear_grads(in);
    sync(device);
    const auto start = std::chrono::steady_clock::now();
    ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, impl, deterministic).backward(in.dout);
    sync(device);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  r.ms = times[times.size() / 2];
  return r;
}

double max_rel_error(const torch::Tensor& a, const torch::Tensor& e) {
  return ((a - e).abs().max() / e.abs().max()).item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  bool use_cuda = false, quick = false;
  int reps = 3, threads = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cuda")) use_cuda = true;
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--cuda] [--reps N] [--threads N] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (threads > 0) torch::set_num_threads(threads);
  if (use_cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_dsa3d: --cuda given but no CUDA device is available\n");
    return 1;
  }
#ifndef MEGASLIDE_WITH_CUDA
  if (use_cuda) {
    std::fprintf(stderr, "bench_dsa3d: this build has no CUDA kernels\n");
    return 1;
  }
#endif
  const torch::Device device = use_cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const ops::DsaImpl fused = use_cuda ? ops::DsaImpl::kCuda : ops::DsaImpl::kCpu;
  Memory memory;
  memory.cuda = use_cuda;
  static TrackingCpuAllocator tracker(c10::GetCPUAllocator());
  cpu_tracker = &tracker;
  c10::SetCPUAllocator(&tracker, /*priority*/ 100);

  std::vector<Case> cases{{"8x16x16 k3x7x7", 1, 8, 16, 16, 4, 32, {3, 7, 7}},
                          {"8x16x16 k3x3x3", 1, 8, 16, 16, 4, 32, {3, 3, 3}},
                          {"4x32x32 k3x5x5", 1, 4, 32, 32, 4, 32, {3, 5, 5}}};
  if (use_cuda)
    cases.push_back({"16x64x64 k3x7x7", 1, 16, 64, 64, 8, 64, {3, 7, 7}});
  if (quick) cases.resize(1);

  std::printf("bench_dsa3d: fused %s vs grid_sample reference, float32, forward+backward, median of %d, %d threads\n",
              ops::to_string(fused), reps, torch::get_num_threads());
  std::printf("%-18s %6s %4s %10s %10s %8s %10s %12s %12s %12s %12s %9s\n", "case", "N", "K", "ref_ms", "fused_ms",
              "speedup", "det_ms", "ref_saved", "fused_saved", "ref_peak", "fused_peak", "max_err");
  std::string json = std::string("{\"bench\":\"dsa3d\",\"device\":\"") + (use_cuda ? "cuda" : "cpu") +
                     "\",\"threads\":" + std::to_string(torch::get_num_threads()) + ",\"dtype\":\"float32\",\"cases\":[";
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    auto in = make_inputs(c, device);
    const auto ke = ops::effective_kernel(c.kernel, {c.T, c.H, c.W});
    const int64_t N = c.B * c.T * c.H * c.W, K = ke[0] * ke[1] * ke[2];
    const Measurement ref = measure(in, c, ops::DsaImpl::kReference, reps, memory, device);
    const Measurement fus = measure(in, c, fused, reps, memory, device);
    const Measurement det = measure(in, c, fused, reps, memory, device, /*deterministic*/ true);
    const double err = std::max({max_rel_error(fus.out, ref.out), max_rel_error(fus.dq, ref.dq),
                                 max_rel_error(fus.doffsets, ref.doffsets), max_rel_error(det.dq, ref.dq)});
    const double speedup = ref.ms / fus.ms;
    // What the reference materialises by construction: sampled k and v, N·K·M·d float32 each.
    const int64_t sampled_kv_bytes = 2 * N * K * c.M * c.d * 4;
    auto mib = [](int64_t b) { return double(b) / (1 << 20); };
    std::printf("%-18s %6lld %4lld %10.1f %10.1f %7.2fx %10.1f %8.1f MiB %8.1f MiB %8.1f MiB %8.1f MiB %9.1e\n",
                c.name.c_str(), (long long)N, (long long)K, ref.ms, fus.ms, speedup, det.ms, mib(ref.saved_bytes),
                mib(fus.saved_bytes), mib(ref.peak_bytes), mib(fus.peak_bytes), err);
    char entry[768];
    std::snprintf(entry, sizeof entry,
                  "%s{\"name\":\"%s\",\"B\":%lld,\"T\":%lld,\"H\":%lld,\"W\":%lld,\"M\":%lld,\"d\":%lld,\"K\":%lld,"
                  "\"ref_ms\":%.3f,\"fused_ms\":%.3f,\"speedup\":%.3f,\"fused_deterministic_ms\":%.3f,\"ref_saved_bytes\":%lld,"
                  "\"fused_saved_bytes\":%lld,\"ref_peak_extra_bytes\":%lld,\"fused_peak_extra_bytes\":%lld,"
                  "\"ref_sampled_kv_bytes\":%lld,\"max_rel_err\":%.3e}",
                  i ? "," : "", c.name.c_str(), (long long)c.B, (long long)c.T, (long long)c.H, (long long)c.W,
                  (long long)c.M, (long long)c.d, (long long)K, ref.ms, fus.ms, speedup, det.ms, (long long)ref.saved_bytes,
                  (long long)fus.saved_bytes, (long long)ref.peak_bytes, (long long)fus.peak_bytes,
                  (long long)sampled_kv_bytes, err);
    json += entry;
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  return 0;
}
