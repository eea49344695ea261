// bench_dsa3d: the fused 3D-DSA kernel against its anchor, the grid_sample reference, forward +
// backward (B = 1, M = 4 heads, d = 32, kernel 3x7x7, float32, on the CPU): time and peak memory at
// 8x32x32 tokens, the fused time at 16x32x32 tokens (linear scaling), and global attention (SDPA) at
// both sizes for comparison. Peak memory is measured, not computed: a counting wrapper around
// LibTorch's CPU allocator (the GPU: the caching allocator's statistics) records the most bytes live
// at once during forward + backward beyond the inputs. The last line is one JSON object with
// fused_vs_reference_fwd_bwd_speedup (target >= 5), fused_vs_reference_peak_mem_ratio (<= 0.1) and
// scaling_2x_tokens_time_ratio (<= 2.2).
//
//   build/bin/bench_dsa3d                 # the CPU figures (LibTorch's thread count)
//   build/bin/bench_dsa3d --threads 1     # ... on one thread
//   build/bin/bench_dsa3d --cuda          # the GPU sweep of benchmarks/gpu/dsa3d.sh
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <array>
#include <memory>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "megaslide/attention/dsa3d.h"

namespace {

namespace ops = megaslide::ops;

// Wraps LibTorch's CPU allocator and counts live bytes and their peak. Not the library's
// util::cpu_memory_counter(): that one hands out "simple" pointers (data offset behind a header, as
// raw_allocate needs), which moved the fused kernel's timings here by 10-20 % (measured 2026-11-29);
// this one passes the base allocator's pointers through untouched, so the timings are the kernel's.
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

// Global attention (LibTorch's scaled_dot_product_attention: flash kernels where it has them) on the
// same q, k, v as [B, M, N, d], forward + backward: what the dense baseline pays at this size.
Measurement measure_sdpa(const Case& c, torch::ScalarType dtype, int reps, const Memory& memory,
                         const torch::Device& device) {
  torch::manual_seed(0);
  const int64_t N = c.T * c.H * c.W;
  const auto opts = torch::TensorOptions().dtype(dtype).device(device);
  auto q = torch::randn({c.B, c.M, N, c.d}, opts).requires_grad_(true);
  auto k = torch::randn({c.B, c.M, N, c.d}, opts).requires_grad_(true);
  auto v = torch::randn({c.B, c.M, N, c.d}, opts).requires_grad_(true);
  auto dout = torch::randn({c.B, c.M, N, c.d}, opts);
  Measurement r;
  std::vector<double> times;
  for (int i = 0; i < reps + 1; ++i) {
    for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
    sync(device);
    const int64_t before = memory.current();
    memory.reset_peak();
    const auto start = std::chrono::steady_clock::now();
    at::scaled_dot_product_attention(q, k, v).backward(dout);
    sync(device);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    r.peak_bytes = memory.peak() - before;
    if (i > 0) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  r.ms = times[times.size() / 2];
  return r;
}

// Device-to-device copy bandwidth (read + write bytes per second) over a 1 GiB buffer.
double copy_gbps(const torch::Device& device) {
  auto src = torch::empty({int64_t{1} << 28}, torch::TensorOptions().dtype(torch::kFloat).device(device)).fill_(1);
  auto dst = torch::empty_like(src);
  dst.copy_(src);
  sync(device);
  const auto start = std::chrono::steady_clock::now();
  const int reps = 10;
  for (int i = 0; i < reps; ++i) dst.copy_(src);
  sync(device);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 2.0 * reps * src.numel() * src.element_size() / s / 1e9;
}

std::string fmt_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string json_or_null(const Measurement* m, double Measurement::*field) {
  return m ? fmt_double(m->*field) : "null";
}

int cpu_mode(int reps, const Memory& memory) {
  const torch::Device device(torch::kCPU);
  // The sizes: B = 1, M = 4 heads, d = 32, kernel (3, 7, 7); 8×32×32 tokens, then twice that.
  const Case base{"8x32x32", 1, 8, 32, 32, 4, 32, {3, 7, 7}};
  const Case twice{"16x32x32", 1, 16, 32, 32, 4, 32, {3, 7, 7}};
  std::printf("bench_dsa3d (cpu, float32, forward+backward, median, %d threads)\n", torch::get_num_threads());

  auto in = make_inputs(base, device);
  // The reference runs ~10 s a pass here: one timed pass after the memory pass (which warms it up).
  const Measurement ref = measure(in, base, ops::DsaImpl::kReference, 1, memory, device);
  const Measurement fus = measure(in, base, ops::DsaImpl::kCpu, reps, memory, device);
  const double err = std::max({max_rel_error(fus.out, ref.out), max_rel_error(fus.dq, ref.dq),
                               max_rel_error(fus.doffsets, ref.doffsets)});
  in = Inputs{};
  auto in2 = make_inputs(twice, device);
  const Measurement fus2 = measure(in2, twice, ops::DsaImpl::kCpu, reps, memory, device);
  in2 = Inputs{};
  const Measurement sdpa = measure_sdpa(base, torch::kFloat, 1, memory, device);
  const Measurement sdpa2 = measure_sdpa(twice, torch::kFloat, 1, memory, device);

  auto mib = [](int64_t b) { return double(b) / (1 << 20); };
  std::printf("%-10s %-22s %10s %12s\n", "tokens", "variant", "ms", "peak MiB");
  std::printf("%-10s %-22s %10.1f %12.1f\n", "8x32x32", "reference (grid_sample)", ref.ms, mib(ref.peak_bytes));
  std::printf("%-10s %-22s %10.1f %12.1f\n", "8x32x32", "fused cpu", fus.ms, mib(fus.peak_bytes));
  std::printf("%-10s %-22s %10.1f %12.1f\n", "8x32x32", "global sdpa", sdpa.ms, mib(sdpa.peak_bytes));
  std::printf("%-10s %-22s %10.1f %12.1f\n", "16x32x32", "fused cpu", fus2.ms, mib(fus2.peak_bytes));
  std::printf("%-10s %-22s %10.1f %12.1f\n", "16x32x32", "global sdpa", sdpa2.ms, mib(sdpa2.peak_bytes));

  const double speedup = ref.ms / fus.ms;
  const double mem_ratio = double(fus.peak_bytes) / double(ref.peak_bytes);
  const double scaling = fus2.ms / fus.ms;
  const bool met = speedup >= 5 && mem_ratio <= 0.1 && scaling <= 2.2;
  std::printf("speedup %.2fx (target >= 5), peak memory ratio %.4f (target <= 0.1), 2x tokens time ratio %.2f "
              "(target <= 2.2), max relative error vs reference %.1e: targets %s\n",
              speedup, mem_ratio, scaling, err, met ? "met" : "NOT met");
  std::printf(
      "{\"bench\":\"dsa3d\",\"device\":\"cpu\",\"threads\":%d,\"dtype\":\"float32\",\"B\":1,\"M\":4,\"d\":32,"
      "\"kernel\":[3,7,7],\"tokens\":8192,\"reference_ms\":%.3f,\"fused_ms\":%.3f,\"fused_2x_tokens_ms\":%.3f,"
      "\"sdpa_ms\":%.3f,\"sdpa_2x_tokens_ms\":%.3f,\"reference_peak_bytes\":%lld,\"fused_peak_bytes\":%lld,"
      "\"sdpa_peak_bytes\":%lld,\"max_rel_err\":%.3e,\"fused_vs_reference_fwd_bwd_speedup\":%.3f,"
      "\"fused_vs_reference_peak_mem_ratio\":%.5f,\"scaling_2x_tokens_time_ratio\":%.3f,\"targets_met\":%s}\n",
      torch::get_num_threads(), ref.ms, fus.ms, fus2.ms, sdpa.ms, sdpa2.ms, (long long)ref.peak_bytes,
      (long long)fus.peak_bytes, (long long)sdpa.peak_bytes, err, speedup, mem_ratio, scaling, met ? "true" : "false");
  return 0;
}

#ifdef MEGASLIDE_WITH_CUDA
// The GPU sweep of benchmarks/gpu/dsa3d.sh: 16K to 256K tokens, d = 64 and 128, bfloat16: fused 3D-DSA,
// the grid_sample reference (until it runs out of memory) and flash SDPA, forward + backward, and the
// fused forward's achieved bandwidth against a device-to-device copy measured in the same run.
int cuda_mode(int reps, const Memory& memory) {
  const torch::Device device(torch::kCUDA, 0);
  const double copy = copy_gbps(device);
  std::printf("bench_dsa3d (cuda, bfloat16, forward+backward, median of %d); device copy %.0f GB/s\n", reps, copy);
  std::printf("%-12s %4s %4s %10s %10s %10s %12s %10s\n", "tokens", "M", "d", "fused_ms", "ref_ms", "sdpa_ms",
              "fwd_GB/s", "of_copy");
  std::string json = "{\"bench\":\"dsa3d\",\"device\":\"cuda\",\"dtype\":\"bfloat16\",\"copy_gbps\":" + fmt_double(copy) +
                     ",\"cases\":[";
  bool first = true;
  for (int64_t d : {64, 128}) {
    for (auto dims : {std::array<int64_t, 3>{16, 32, 32}, std::array<int64_t, 3>{16, 64, 64}, std::array<int64_t, 3>{64, 64, 64}}) {
      const Case c{std::to_string(dims[0]) + "x" + std::to_string(dims[1]) + "x" + std::to_string(dims[2]), 1, dims[0],
                   dims[1], dims[2], 8, d, {3, 7, 7}};
      auto in = make_inputs(c, device);
      for (auto* t : {&in.q, &in.k, &in.v, &in.offsets, &in.bias})
        *t = t->detach().to(torch::kBFloat16).requires_grad_(true);
      in.dout = in.dout.to(torch::kBFloat16);
      const Measurement fus = measure(in, c, ops::DsaImpl::kCuda, reps, memory, device);
      // Fused forward alone: it reads q, k, v (k and v once per sample, mostly from cache) and offsets,
      // and writes out and lse; bytes counted once each is the least it must move.
      double fwd_ms;
      {
        torch::NoGradGuard no_grad;
        ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, ops::DsaImpl::kCuda);
        sync(device);
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, ops::DsaImpl::kCuda);
        sync(device);
        fwd_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / reps;
      }
      const double bytes = double(4 * in.q.numel() * 2 + in.offsets.numel() * 2 + c.T * c.H * c.W * c.M * 4);
      const double fwd_gbps = bytes / (fwd_ms / 1e3) / 1e9;
      std::unique_ptr<Measurement> ref;
      try {
        ref = std::make_unique<Measurement>(measure(in, c, ops::DsaImpl::kReference, 1, memory, device));
      } catch (const c10::OutOfMemoryError&) {
        c10::cuda::CUDACachingAllocator::emptyCache();
      }
      const Measurement sdpa = measure_sdpa(c, torch::kBFloat16, reps, memory, device);
      std::printf("%-12s %4lld %4lld %10.2f %10s %10.2f %12.0f %9.2f\n", c.name.c_str(), (long long)c.M, (long long)d, fus.ms,
                  ref ? fmt_double(ref->ms).c_str() : "OOM", sdpa.ms, fwd_gbps, fwd_gbps / copy);
      json += std::string(first ? "" : ",") + "{\"tokens\":" + std::to_string(c.T * c.H * c.W) + ",\"name\":\"" + c.name +
              "\",\"M\":8,\"d\":" + std::to_string(d) + ",\"fused_ms\":" + fmt_double(fus.ms) +
              ",\"reference_ms\":" + json_or_null(ref.get(), &Measurement::ms) + ",\"sdpa_ms\":" + fmt_double(sdpa.ms) +
              ",\"fused_fwd_gbps\":" + fmt_double(fwd_gbps) + ",\"fused_fwd_fraction_of_copy\":" +
              fmt_double(fwd_gbps / copy) + "}";
      first = false;
    }
  }
  std::printf("%s]}\n", json.c_str());
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool use_cuda = false;
  int reps = 3, threads = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cuda")) use_cuda = true;
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--cuda] [--reps N] [--threads N]\n", argv[0]);
      return 2;
    }
  }
  if (threads > 0) torch::set_num_threads(threads);
  Memory memory;
  memory.cuda = use_cuda;
  static TrackingCpuAllocator tracker(c10::GetCPUAllocator());
  cpu_tracker = &tracker;
  c10::SetCPUAllocator(&tracker, /*priority*/ 100);
  if (!use_cuda) return cpu_mode(reps, memory);
#ifdef MEGASLIDE_WITH_CUDA
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_dsa3d: --cuda given but no CUDA device is available\n");
    return 1;
  }
  return cuda_mode(reps, memory);
#else
  std::fprintf(stderr, "bench_dsa3d: this build has no CUDA kernels (nvcc was not found at configure time)\n");
  return 1;
#endif
}
