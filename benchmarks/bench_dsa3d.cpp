// bench_dsa3d: the fused 3D-DSA kernels against their anchors.
//
// CPU (default): forward + backward (B = 1, M = 4 heads, d = 32, kernel 3x7x7, float32): time and peak
// memory of the row kernel (kCpu), the tiled kernel (kCpuTiled, the host twin of the CUDA tiled
// kernel) and the grid_sample reference at 8x32x32 tokens, both fused kernels at 16x32x32 (linear
// scaling), and global attention (SDPA) at both sizes and at 4x32x32 (4K tokens). Then d = 64 (M = 4) at 4K
// and 8K tokens: the fused kernel against SDPA, and its forward's FLOP rates (the formulation's and the executed)
// against the machine's FMA peak, measured in the same run (register-resident FMA chains on every thread). Peak memory
// is measured, not computed: a counting wrapper around LibTorch's CPU allocator records the most bytes live at once
// during forward + backward beyond the inputs. The last line is one JSON object with fused_vs_reference_fwd_bwd_speedup
// (target >= 5), fused_vs_reference_peak_mem_ratio (<= 0.1), scaling_2x_tokens_time_ratio (<= 2.2),
// fused_vs_sdpa_4k_d32 and _d64 (>= 1), d64_fwd_peak_fraction (>= 0.3, the formulation's FLOPs) and
// tiled_vs_row_cpu_fwd_bwd_speedup.
//
// CUDA (--cuda): bfloat16, offsets uniform in ±(1, 3, 3) tokens (the module's default range, all of
// it), at (B=1, 16x64x64 tokens, M=16, d=64, 3x7x7) and (8x32x32, M=4, d=32, 3x7x7): forward and
// forward + backward of the tiled kernel (default and deterministic), the row kernel, and flash SDPA
// over the same tokens, timed with CUDA events (warm-up, median of --reps); achieved TFLOP/s and
// ratios; the last line is one JSON object. About 30 s on an H200.
//
//   build/bin/bench_dsa3d                 # the CPU figures (LibTorch's thread count)
//   build/bin/bench_dsa3d --threads 1     # ... on one thread
//   build/bin/bench_dsa3d --kernels-only  # row vs tiled CPU kernel only, interleaved (a few minutes)
//   build/bin/bench_dsa3d --smoke-shape --threads 1 --reps 15
//                                         # the row kernel at the README smoke model's shape (seconds); with
//                                         # --bf16, in bf16 (what the trainer computes in where `auto` picks bf16)
//   build/bin/bench_dsa3d --isa avx2      # the fused CPU kernels' AVX2 loops (and the AVX2 FMA peak) on a CPU
//                                         # that also has AVX-512: baseline, avx2, avx512 or avx512bf16
//                                         # (default: CPUID's)
//   build/bin/bench_dsa3d --bf16-dots     # bf16 inputs at d = 64 (by rows): the AVX512-BF16 loops against the
//                                         # AVX-512 loops, alternated in one run (skipped without AVX512-BF16)
//   build/bin/bench_dsa3d --cuda          # the GPU figures (benchmarks/gpu/check.sh runs this)
#include <c10/core/CPUAllocator.h>
#include <torch/cuda.h>
#include <torch/types.h>

#ifdef MEGASLIDE_WITH_CUDA
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime.h>

#include "../src/attention/dsa3d_tile.h"
#endif

#include <algorithm>
#include <array>
#include <thread>
#include <memory>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../src/attention/dsa3d_math.h"
#include "../src/attention/dsa3d_params.h"
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
  double ms = 0;            // median forward + backward
  int64_t saved_bytes = 0;  // held between forward and backward
  int64_t peak_bytes = 0;   // peak beyond the inputs during forward + backward
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

std::string fmt_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// --kernels-only: the row and tiled CPU kernels alone, interleaved run by run (so load from other
// processes hits both alike), forward + backward at both sizes; no reference, no SDPA.
int cpu_kernels_mode(int reps, const Memory& memory) {
  const torch::Device device(torch::kCPU);
  std::printf("bench_dsa3d --kernels-only (cpu, float32, forward+backward, median of %d interleaved, %d threads)\n",
              reps, torch::get_num_threads());
  std::string json =
      "{\"bench\":\"dsa3d_cpu_kernels\",\"threads\":" + std::to_string(torch::get_num_threads()) + ",\"cases\":[";
  int index = 0;
  for (const Case& c :
       {Case{"8x32x32", 1, 8, 32, 32, 4, 32, {3, 7, 7}}, Case{"16x32x32", 1, 16, 32, 32, 4, 32, {3, 7, 7}}}) {
    auto in = make_inputs(c, device);
    std::vector<double> row, tiled;
    for (int i = 0; i < reps + 1; ++i) {
      for (auto impl : {ops::DsaImpl::kCpu, ops::DsaImpl::kCpuTiled}) {
        clear_grads(in);
        const auto start = std::chrono::steady_clock::now();
        ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, impl).backward(in.dout);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        if (i > 0) (impl == ops::DsaImpl::kCpu ? row : tiled).push_back(ms);
      }
    }
    std::sort(row.begin(), row.end());
    std::sort(tiled.begin(), tiled.end());
    const double r = row[row.size() / 2], t = tiled[tiled.size() / 2];
    std::printf("%-10s row %9.1f ms   tiled %9.1f ms   tiled vs row %.2fx\n", c.name.c_str(), r, t, r / t);
    json += std::string(index++ ? "," : "") + "{\"name\":\"" + c.name + "\",\"row_ms\":" + fmt_double(r) +
            ",\"tiled_ms\":" + fmt_double(t) + ",\"tiled_vs_row\":" + fmt_double(r / t) + "}";
  }
  std::printf("%s]}\n", json.c_str());
  (void)memory;
  return 0;
}

// The fused CPU kernels' loops that inputs of `dtype` run on (the AVX512-BF16 loops are the AVX-512 ones but for bf16).
const char* loops_name(ops::detail::DsaDtype dtype) {
  return ops::detail::to_string(ops::detail::dsa3d_cpu_loops(dtype));
}

// q, k, v and dout in bf16 (offsets and bias stay float32), as the trainer's blocks hand them over with bf16 compute.
void to_bf16(Inputs& in) {
  for (torch::Tensor* t : {&in.q, &in.k, &in.v}) *t = t->detach().to(torch::kBFloat16).requires_grad_(true);
  in.dout = in.dout.to(torch::kBFloat16);
}

// One run of the row kernel (kCpu): its forward under no-grad, then forward + backward; milliseconds of each.
std::pair<double, double> time_row_kernel(Inputs& in, const std::array<int64_t, 3>& kernel) {
  auto start = std::chrono::steady_clock::now();
  {
    torch::NoGradGuard no_grad;
    ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, kernel, ops::DsaImpl::kCpu);
  }
  const double f = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  clear_grads(in);
  start = std::chrono::steady_clock::now();
  ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, kernel, ops::DsaImpl::kCpu).backward(in.dout);
  return {f, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count()};
}

// --smoke-shape: the row kernel at the shape of the README's smoke model's blocks (B = 4, 8x8x8 tokens, 2 heads of
// d = 8 in one group, 3x5x5: the per-sample loops), forward under no-grad and forward + backward, after a warm-up;
// the fastest and the median of the runs. The loops' own figure, without the trainer around them. bf16: to_bf16's
// inputs.
int smoke_shape_mode(int reps, bool bf16) {
  const Case c{"smoke", 4, 8, 8, 8, 2, 8, {3, 5, 5}};
  auto in = make_inputs(c, torch::Device(torch::kCPU));
  if (bf16) to_bf16(in);
  std::vector<double> forward, both;
  for (int i = 0; i < reps + 1; ++i) {
    const auto [f, fb] = time_row_kernel(in, c.kernel);
    if (i > 0) forward.push_back(f), both.push_back(fb);
  }
  std::sort(forward.begin(), forward.end());
  std::sort(both.begin(), both.end());
  std::printf(
      "bench_dsa3d --smoke-shape (cpu %s loops, %s, %d threads, %d runs): forward %.2f ms (median %.2f), "
      "forward + backward %.2f ms (median %.2f)\n",
      loops_name(bf16 ? ops::detail::DsaDtype::kBFloat16 : ops::detail::DsaDtype::kFloat32),
      bf16 ? "bfloat16" : "float32", torch::get_num_threads(), reps, forward[0], forward[forward.size() / 2], both[0],
      both[both.size() / 2]);
  std::printf(
      "{\"bench\":\"dsa3d_smoke_shape\",\"isa\":\"%s\",\"dtype\":\"%s\",\"threads\":%d,\"forward_ms\":%s,"
      "\"forward_backward_ms\":%s}\n",
      loops_name(bf16 ? ops::detail::DsaDtype::kBFloat16 : ops::detail::DsaDtype::kFloat32),
      bf16 ? "bfloat16" : "float32", torch::get_num_threads(), fmt_double(forward[0]).c_str(),
      fmt_double(both[0]).c_str());
  return 0;
}

// --bf16-dots: bf16 q, k, v and dout (offsets and bias float32) at B = 1, 4x32x32 tokens, 4 heads of d = 64 in one
// group, 3x7x7 (both directions by distinct corner rows), the row kernel's forward under no-grad and forward +
// backward, with the AVX-512 loops (the anchor) and the AVX512-BF16 loops (their rows' q·k and dout·v as bf16 pairs)
// alternated run by run after a warm-up of each; medians, and the anchor's over the AVX512-BF16 loops' time; then
// global SDPA in bf16 over the same tokens (forward under no-grad, and forward + backward), the AVX512-BF16 loops'
// speed against it.
int bf16_dots_mode(int reps) {
  namespace detail = ops::detail;
  try {
    detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAvx512Bf16);
  } catch (const std::invalid_argument&) {
    std::printf("bench_dsa3d --bf16-dots: skipped, this CPU lacks AVX512-BF16\n");
    std::printf("{\"bench\":\"dsa3d_bf16_dots\",\"skipped\":\"no avx512_bf16\"}\n");
    return 0;
  }
  const Case c{"bf16 d64", 1, 4, 32, 32, 4, 64, {3, 7, 7}};
  Inputs in = make_inputs(c, torch::Device(torch::kCPU));
  to_bf16(in);
  const detail::Dsa3dCpuIsa isas[2] = {detail::Dsa3dCpuIsa::kAvx512, detail::Dsa3dCpuIsa::kAvx512Bf16};
  std::vector<double> forward[2], both[2];
  for (int i = 0; i < reps + 1; ++i)
    for (int a = 0; a < 2; ++a) {
      detail::set_dsa3d_cpu_isa(isas[a]);
      const auto [f, fb] = time_row_kernel(in, c.kernel);
      if (i > 0) forward[a].push_back(f), both[a].push_back(fb);
    }
  detail::set_dsa3d_cpu_isa(detail::Dsa3dCpuIsa::kAuto);
  const auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    const size_t n = x.size();
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
  };
  const double f0 = median(forward[0]), f1 = median(forward[1]), b0 = median(both[0]), b1 = median(both[1]);
  // Dense attention over the same tokens in the same dtype: LibTorch's bf16 SDPA runs its products through oneDNN,
  // on AMX tiles where the CPU has them (the float32 comparison of the default mode cannot show that).
  std::vector<double> sdpa_forward, sdpa_both;
  {
    torch::manual_seed(0);
    const auto opts = torch::TensorOptions().dtype(torch::kBFloat16);
    const int64_t N = c.T * c.H * c.W;
    auto q = torch::randn({c.B, c.M, N, c.d}, opts).requires_grad_(true), k = torch::randn_like(q).requires_grad_(true),
         v = torch::randn_like(q).requires_grad_(true);
    const auto dout = torch::randn_like(q);
    for (int i = 0; i < reps + 1; ++i) {
      auto start = std::chrono::steady_clock::now();
      {
        torch::NoGradGuard no_grad;
        at::scaled_dot_product_attention(q, k, v);
      }
      const double f = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
      start = std::chrono::steady_clock::now();
      at::scaled_dot_product_attention(q, k, v).backward(dout);
      const double fb = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (i > 0) sdpa_forward.push_back(f), sdpa_both.push_back(fb);
    }
  }
  const double sf = median(sdpa_forward), sb = median(sdpa_both);
  std::printf(
      "bench_dsa3d --bf16-dots (bf16, 4x32x32 tokens, 4 heads of d = 64, 3x7x7, %d threads, %d runs each, medians):\n"
      "  forward            avx512 %8.2f ms   avx512bf16 %8.2f ms   %.2fx\n"
      "  forward + backward avx512 %8.2f ms   avx512bf16 %8.2f ms   %.2fx\n"
      "  global SDPA in bf16 over the same tokens: forward %.2f ms, forward + backward %.2f ms; the avx512bf16 loops "
      "against it (>1: fused faster): forward %.2fx, forward + backward %.2fx\n",
      torch::get_num_threads(), reps, f0, f1, f0 / f1, b0, b1, b0 / b1, sf, sb, sf / f1, sb / b1);
  std::printf(
      "{\"bench\":\"dsa3d_bf16_dots\",\"threads\":%d,\"avx512_forward_ms\":%s,\"avx512bf16_forward_ms\":%s,"
      "\"avx512_forward_backward_ms\":%s,\"avx512bf16_forward_backward_ms\":%s,\"forward_speedup\":%s,"
      "\"forward_backward_speedup\":%s,\"sdpa_bf16_forward_ms\":%s,\"sdpa_bf16_forward_backward_ms\":%s,"
      "\"fused_vs_sdpa_bf16_forward\":%s,\"fused_vs_sdpa_bf16_forward_backward\":%s}\n",
      torch::get_num_threads(), fmt_double(f0).c_str(), fmt_double(f1).c_str(), fmt_double(b0).c_str(),
      fmt_double(b1).c_str(), fmt_double(f0 / f1).c_str(), fmt_double(b0 / b1).c_str(), fmt_double(sf).c_str(),
      fmt_double(sb).c_str(), fmt_double(sf / f1).c_str(), fmt_double(sb / b1).c_str());
  return 0;
}

// The machine's fp32 FMA peak as measured here: every thread runs independent chains of vector fused
// multiply-adds held in registers (AVX-512 where the CPU has it, else AVX2 + FMA), all threads at once; GFLOP/s
// counting an FMA as 2. What a kernel can at most execute, the denominator of the fraction-of-peak target.
// N-lane vectors (GCC's vector extension): acc * a + b contracts to one FMA instruction (GNU mode's
// -ffp-contract=fast), and the loop is inlined into each ISA's entry point below.
template <int N>
struct FloatLanes {
  typedef float V __attribute__((vector_size(4 * N)));
};
// chains_for: 16 where the unit has 32 vector registers (AVX-512), 12 where it has 16 (AVX2, SSE): the chains and the
// two operands must stay in registers (16 chains on AVX2 spilled and measured 80 of its 132 GFLOP/s a core here);
// either count covers the FMA latency times the FMA units.
constexpr int chains_for(int lanes) { return lanes == 16 ? 16 : 12; }
template <int N>
__attribute__((always_inline)) inline float fma_chains(int64_t iterations) {
  using V = typename FloatLanes<N>::V;
  V acc[chains_for(N)];
  for (int i = 0; i < chains_for(N); ++i) acc[i] = V{} + 1e-3f * static_cast<float>(i);
  const V a = V{} + 0.999f, b = V{} + 1e-3f;
  for (int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < chains_for(N); ++i) acc[i] = acc[i] * a + b;
  float sum = 0.f;
  for (int i = 0; i < chains_for(N); ++i)
    for (int l = 0; l < N; ++l) sum += acc[i][l];
  return sum;
}
__attribute__((target("avx512f"))) float fma_chains_avx512(int64_t iterations) { return fma_chains<16>(iterations); }
__attribute__((target("avx2,fma"))) float fma_chains_avx2(int64_t iterations) { return fma_chains<8>(iterations); }
// A CPU with neither: SSE's 4 lanes, a multiply and an add for each FMA (the baseline x86-64 has no FMA).
float fma_chains_sse(int64_t iterations) { return fma_chains<4>(iterations); }

// The vector unit fma_peak_gflops measures: the one of the fused kernels' forced instruction set (--isa), else
// AVX-512, else AVX2 with FMA, else SSE.
int forced_lanes = 0;
int peak_lanes() {
  if (forced_lanes > 0) return forced_lanes;
  if (__builtin_cpu_supports("avx512f")) return 16;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 8 : 4;
}
const char* peak_unit() {
  const int lanes = peak_lanes();
  return lanes == 16 ? "AVX-512" : lanes == 8 ? "AVX2" : "SSE, no FMA";
}

// The best of three runs (a descheduled thread only lowers a run), taken before any LibTorch parallel work, whose
// OpenMP threads would still be spinning beside it.
double fma_peak_gflops(int threads) {
  const int lanes = peak_lanes();
  const int64_t iterations = 20'000'000;
  const double flops_per_thread = 2.0 * chains_for(lanes) * lanes * static_cast<double>(iterations);
  double best = 0.0;
  for (int run = 0; run < 3; ++run) {
    std::vector<float> sinks(threads);
    std::vector<std::thread> pool;
    const auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        sinks[t] = lanes == 16  ? fma_chains_avx512(iterations)
                   : lanes == 8 ? fma_chains_avx2(iterations)
                                : fma_chains_sse(iterations);
      });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    volatile float sink = 0.f;
    for (float x : sinks) sink = sink + x;
    best = std::max(best, flops_per_thread * threads / s / 1e9);
  }
  return best;
}

// d = 64 (M = 4 heads, kernel 3x7x7, float32) at 4K and 8K tokens: the fused kernel kAuto runs on the CPU against
// global SDPA over the same tokens (forward + backward), and its forward's FLOP rates against the measured FMA peak:
//   formulation  3D-DSA as defined, per (token, head, sample): the key and value rows interpolated from 8 corners
//                over d, one dot and one accumulation over d: 36·d FLOPs (what the per-sample loops execute);
//   executed     what the loops that ran executed: by distinct corner row (a group's heads × d >= 128 channels),
//                per (token, group) 4·L FLOPs per distinct corner row (q·k and the value sum over its L channels)
//                and 32 per sample and head (the logit from 8 corner products, the rows' coefficients);
//   attention-equivalent  dense attention over the same K keys: 4·d.
// The 30 % target is on the formulation's FLOPs, a fixed amount of work (so it is a time target); the executed
// rate says how busy the vector units are.
struct D64Result {
  std::string name;
  int64_t tokens = 0;
  double fwd_ms = 0, fwd_bwd_ms = 0, sdpa_ms = 0, formulation_gflops = 0, executed_gflops = 0, attention_gflops = 0;
  double rows_per_token = 0;  // distinct corner rows of nonzero weight per (token, group), 0 where none counted
};

// Distinct corner rows of nonzero weight summed over every (token, group) of `offsets` ([B, T, H, W, G, K, 3]):
// the rows the CPU loops by distinct corner row read per token, from the same corners (dsa3d_math::token_corners).
double distinct_corner_rows(const Case& c, const torch::Tensor& offsets) {
  const auto ke = ops::effective_kernel(c.kernel, {c.T, c.H, c.W});
  const auto off = offsets.detach().contiguous().to(torch::kFloat);
  const int64_t G = off.size(4), K = off.size(5), N = c.T * c.H * c.W;
  const float* o = off.data_ptr<float>();
  std::vector<int64_t> seen(N, -1);
  double rows = 0;
  int64_t stamp = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g, ++stamp) {
        const int64_t t = n / (c.H * c.W), h = (n / c.W) % c.H, w = n % c.W;
        const float* x = o + ((b * N + n) * G + g) * K * 3;
        for (int64_t j = 0; j < K; ++j) {
          int64_t index[8];
          float weight[8];
          megaslide::dsa3d_math::token_corners<float>(t, h, w, j, x[3 * j], x[3 * j + 1], x[3 * j + 2], c.T, c.H, c.W,
                                                      ke[0], ke[1], ke[2], index, weight);
          for (int q = 0; q < 8; ++q)
            if (weight[q] != 0.f && seen[index[q]] != stamp) {
              seen[index[q]] = stamp;
              rows += 1;
            }
        }
      }
  return rows;
}

std::vector<D64Result> d64_cases(int reps, const Memory& memory) {
  const torch::Device device(torch::kCPU);
  std::vector<D64Result> out;
  for (const Case& c :
       {Case{"4x32x32", 1, 4, 32, 32, 4, 64, {3, 7, 7}}, Case{"8x32x32", 1, 8, 32, 32, 4, 64, {3, 7, 7}}}) {
    auto in = make_inputs(c, device);
    D64Result r;
    r.name = c.name;
    r.tokens = c.T * c.H * c.W;
    const auto impl = ops::resolve_impl(ops::DsaImpl::kAuto, device);
    std::vector<double> fwd;
    {
      torch::NoGradGuard no_grad;
      for (int i = 0; i < reps + 1; ++i) {
        const auto start = std::chrono::steady_clock::now();
        ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, impl);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        if (i > 0) fwd.push_back(ms);
      }
    }
    std::sort(fwd.begin(), fwd.end());
    r.fwd_ms = fwd[fwd.size() / 2];
    r.fwd_bwd_ms = measure(in, c, impl, reps, memory, device).ms;
    const torch::Tensor in_offsets = in.offsets.detach();
    in = Inputs{};
    r.sdpa_ms = measure_sdpa(c, torch::kFloat, reps, memory, device).ms;
    const auto ke = ops::effective_kernel(c.kernel, {c.T, c.H, c.W});
    const double samples = static_cast<double>(c.B * r.tokens * c.M * ke[0] * ke[1] * ke[2]);  // × heads
    r.formulation_gflops = samples * 36.0 * static_cast<double>(c.d) / (r.fwd_ms * 1e6);
    r.attention_gflops = samples * 4.0 * static_cast<double>(c.d) / (r.fwd_ms * 1e6);
    const int64_t G = in_offsets.size(4), L = c.M / G * c.d;  // a group's channels
    if (impl == ops::DsaImpl::kCpu && L >= ops::detail::kCpuForwardRowsMinChannels) {
      const double rows = distinct_corner_rows(c, in_offsets);  // over every (token, group)
      r.rows_per_token = rows / static_cast<double>(c.B * r.tokens * G);
      r.executed_gflops = (rows * 4.0 * static_cast<double>(L) + samples * 32.0) / (r.fwd_ms * 1e6);
    } else if (impl == ops::DsaImpl::kCpu) {
      r.executed_gflops = r.formulation_gflops;  // the per-sample loops execute the formulation
    }                                            // else (the tiled twin) not counted: 0
    out.push_back(r);
  }
  return out;
}

int cpu_mode(int reps, const Memory& memory) {
  const torch::Device device(torch::kCPU);
  // B = 1, M = 4 heads, d = 32, kernel (3, 7, 7); 8×32×32 tokens, then twice that.
  const Case base{"8x32x32", 1, 8, 32, 32, 4, 32, {3, 7, 7}};
  const Case twice{"16x32x32", 1, 16, 32, 32, 4, 32, {3, 7, 7}};
  std::printf("bench_dsa3d (cpu, float32, forward+backward, median, %d threads; fused CPU kernels' loops: %s)\n",
              torch::get_num_threads(), loops_name(ops::detail::DsaDtype::kFloat32));
  const double peak = fma_peak_gflops(torch::get_num_threads());  // first: no OpenMP thread spins beside it

  auto in = make_inputs(base, device);
  // The reference runs ~10 s a pass here: one timed pass after the memory pass (which warms it up).
  const Measurement ref = measure(in, base, ops::DsaImpl::kReference, 1, memory, device);
  const Measurement row = measure(in, base, ops::DsaImpl::kCpu, reps, memory, device);
  const Measurement tiled = measure(in, base, ops::DsaImpl::kCpuTiled, reps, memory, device);
  auto error = [&](const Measurement& m) {
    return std::max(
        {max_rel_error(m.out, ref.out), max_rel_error(m.dq, ref.dq), max_rel_error(m.doffsets, ref.doffsets)});
  };
  const double row_err = error(row), tiled_err = error(tiled);
  in = Inputs{};
  auto in2 = make_inputs(twice, device);
  const Measurement row2 = measure(in2, twice, ops::DsaImpl::kCpu, reps, memory, device);
  const Measurement tiled2 = measure(in2, twice, ops::DsaImpl::kCpuTiled, reps, memory, device);
  in2 = Inputs{};
  const Measurement sdpa = measure_sdpa(base, torch::kFloat, 1, memory, device);
  const Measurement sdpa2 = measure_sdpa(twice, torch::kFloat, 1, memory, device);

  auto mib = [](int64_t b) { return double(b) / (1 << 20); };
  std::printf("%-10s %-24s %10s %12s\n", "tokens", "variant", "ms", "peak MiB");
  std::printf("%-10s %-24s %10.1f %12.1f\n", "8x32x32", "reference (grid_sample)", ref.ms, mib(ref.peak_bytes));
  std::printf("%-10s %-24s %10.1f %12.1f\n", "8x32x32", "row kernel (cpu)", row.ms, mib(row.peak_bytes));
  std::printf("%-10s %-24s %10.1f %12.1f\n", "8x32x32", "tiled kernel (cpu_tiled)", tiled.ms, mib(tiled.peak_bytes));
  std::printf("%-10s %-24s %10.1f %12.1f\n", "8x32x32", "global sdpa", sdpa.ms, mib(sdpa.peak_bytes));
  std::printf("%-10s %-24s %10.1f %12.1f\n", "16x32x32", "row kernel (cpu)", row2.ms, mib(row2.peak_bytes));
  std::printf("%-10s %-24s %10.1f %12.1f\n", "16x32x32", "tiled kernel (cpu_tiled)", tiled2.ms, mib(tiled2.peak_bytes));
  std::printf("%-10s %-24s %10.1f %12.1f\n", "16x32x32", "global sdpa", sdpa2.ms, mib(sdpa2.peak_bytes));

  // d = 32 at 4K tokens against SDPA, then the d = 64 cases and the machine's FMA peak.
  const Case half{"4x32x32", 1, 4, 32, 32, 4, 32, {3, 7, 7}};
  auto in_half = make_inputs(half, device);
  const auto auto_impl = ops::resolve_impl(ops::DsaImpl::kAuto, device);
  const Measurement fus_half = measure(in_half, half, auto_impl, reps, memory, device);
  in_half = Inputs{};
  const Measurement sdpa_half = measure_sdpa(half, torch::kFloat, reps, memory, device);
  std::printf("%-10s %-24s %10.1f %12.1f\n", "4x32x32", "fused (kAuto)", fus_half.ms, mib(fus_half.peak_bytes));
  std::printf("%-10s %-24s %10.1f %12.1f\n", "4x32x32", "global sdpa", sdpa_half.ms, mib(sdpa_half.peak_bytes));
  const auto d64 = d64_cases(reps, memory);
  std::printf("\nd = 64 (M 4, 3x7x7), fused kernel kAuto runs; FMA peak measured here %.1f GFLOP/s (%d threads, %s)\n",
              peak, torch::get_num_threads(), peak_unit());
  std::printf("%-10s %10s %12s %10s %12s %22s %22s %22s %12s\n", "tokens", "fwd ms", "fwd+bwd ms", "sdpa ms", "vs sdpa",
              "formulation GFLOP/s", "executed GFLOP/s", "attention-equiv.", "rows/token");
  for (const auto& r : d64)
    std::printf("%-10s %10.1f %12.1f %10.1f %11.2fx %12.1f (%4.1f%%) %12.1f (%4.1f%%) %12.1f (%4.1f%%) %12.1f\n",
                r.name.c_str(), r.fwd_ms, r.fwd_bwd_ms, r.sdpa_ms, r.sdpa_ms / r.fwd_bwd_ms, r.formulation_gflops,
                100 * r.formulation_gflops / peak, r.executed_gflops, 100 * r.executed_gflops / peak,
                r.attention_gflops, 100 * r.attention_gflops / peak, r.rows_per_token);
  const double vs_sdpa_4k_d32 = sdpa_half.ms / fus_half.ms, vs_sdpa_4k_d64 = d64[0].sdpa_ms / d64[0].fwd_bwd_ms;
  const double peak_fraction_d64 = d64[0].formulation_gflops / peak;
  const bool tiled_auto = auto_impl == ops::DsaImpl::kCpuTiled;
  std::printf(
      "fused vs global SDPA (forward + backward, >1: fused faster): 4K tokens d 32 %.2fx, d 64 %.2fx; 8K d 32 "
      "%.2fx, d 64 %.2fx; 16K d 32 %.2fx\n",
      vs_sdpa_4k_d32, vs_sdpa_4k_d64, sdpa.ms / (tiled_auto ? tiled.ms : row.ms), d64[1].sdpa_ms / d64[1].fwd_bwd_ms,
      sdpa2.ms / (tiled_auto ? tiled2.ms : row2.ms));

  // The targets apply to the kernel kAuto runs on the CPU.
  const bool auto_tiled = ops::resolve_impl(ops::DsaImpl::kAuto, device) == ops::DsaImpl::kCpuTiled;
  const Measurement& fus = auto_tiled ? tiled : row;
  const Measurement& fus2 = auto_tiled ? tiled2 : row2;
  const double speedup = ref.ms / fus.ms;
  const double mem_ratio = double(fus.peak_bytes) / double(ref.peak_bytes);
  const double scaling = fus2.ms / fus.ms;
  const double tiled_vs_row = row.ms / tiled.ms;
  const bool met = speedup >= 5 && mem_ratio <= 0.1 && scaling <= 2.2 && vs_sdpa_4k_d32 >= 1 && vs_sdpa_4k_d64 >= 1 &&
                   peak_fraction_d64 >= 0.3;
  std::printf(
      "kAuto runs the %s kernel: speedup %.2fx (target >= 5), peak memory ratio %.4f (target <= 0.1), 2x "
      "tokens time ratio %.2f (target <= 2.2), vs SDPA at 4K tokens %.2fx (d 32) and %.2fx (d 64) (target >= 1), "
      "d 64 forward: the formulation's FLOPs at %.1f%% of the FMA peak (target >= 30%%; executed %.1f%%, "
      "attention-equivalent %.1f%%): targets %s. "
      "Tiled vs row kernel %.2fx; max relative error vs reference: row %.1e, tiled %.1e\n",
      auto_tiled ? "tiled" : "row", speedup, mem_ratio, scaling, vs_sdpa_4k_d32, vs_sdpa_4k_d64,
      100 * peak_fraction_d64, 100 * d64[0].executed_gflops / peak, 100 * d64[0].attention_gflops / peak,
      met ? "met" : "NOT met", tiled_vs_row, row_err, tiled_err);
  std::printf(
      "{\"bench\":\"dsa3d\",\"device\":\"cpu\",\"isa\":\"%s\",\"threads\":%d,\"dtype\":\"float32\",\"B\":1,\"M\":4,"
      "\"d\":32,"
      "\"kernel\":[3,7,7],\"tokens\":8192,\"auto_kernel\":\"%s\",\"reference_ms\":%.3f,\"row_ms\":%.3f,\"tiled_ms\":%."
      "3f,"
      "\"row_2x_tokens_ms\":%.3f,\"tiled_2x_tokens_ms\":%.3f,\"sdpa_ms\":%.3f,\"sdpa_2x_tokens_ms\":%.3f,"
      "\"reference_peak_bytes\":%lld,\"row_peak_bytes\":%lld,\"tiled_peak_bytes\":%lld,\"sdpa_peak_bytes\":%lld,"
      "\"row_max_rel_err\":%.3e,\"tiled_max_rel_err\":%.3e,\"tiled_vs_row_cpu_fwd_bwd_speedup\":%.3f,"
      "\"fused_vs_reference_fwd_bwd_speedup\":%.3f,\"fused_vs_reference_peak_mem_ratio\":%.5f,"
      "\"scaling_2x_tokens_time_ratio\":%.3f,\"fused_vs_sdpa_4k_d32\":%.3f,\"fused_vs_sdpa_4k_d64\":%.3f,"
      "\"fused_vs_sdpa_8k_d64\":%.3f,\"fma_peak_gflops\":%.2f,\"d64_fwd_formulation_gflops\":%.2f,"
      "\"d64_fwd_executed_gflops\":%.2f,\"d64_fwd_rows_per_token\":%.1f,\"d64_fwd_peak_fraction\":%.4f,"
      "\"d64_fwd_executed_peak_fraction\":%.4f,\"d64_fwd_attention_equivalent_gflops\":%.2f,\"targets_met\":%s}\n",
      loops_name(ops::detail::DsaDtype::kFloat32), torch::get_num_threads(), auto_tiled ? "cpu_tiled" : "cpu", ref.ms,
      row.ms, tiled.ms, row2.ms, tiled2.ms, sdpa.ms, sdpa2.ms, (long long)ref.peak_bytes, (long long)row.peak_bytes,
      (long long)tiled.peak_bytes, (long long)sdpa.peak_bytes, row_err, tiled_err, tiled_vs_row, speedup, mem_ratio,
      scaling, vs_sdpa_4k_d32, vs_sdpa_4k_d64, d64[1].sdpa_ms / d64[1].fwd_bwd_ms, peak, d64[0].formulation_gflops,
      d64[0].executed_gflops, d64[0].rows_per_token, peak_fraction_d64, d64[0].executed_gflops / peak,
      d64[0].attention_gflops, met ? "true" : "false");
  return 0;
}

#ifdef MEGASLIDE_WITH_CUDA
// Dense bfloat16 tensor-core peak of an H100/H200 SXM (NVIDIA's datasheet figure without sparsity), the
// denominator of the "fraction of peak" columns: a stated constant, not a measurement.
constexpr double kTensorCorePeakTflops = 989.0;

// Median milliseconds of `reps` runs of f after one warm-up, timed with CUDA events on the current stream.
template <typename F>
double cuda_median_ms(int reps, F&& f) {
  f();
  torch::cuda::synchronize();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(start, stream);
    f();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct CudaCase {
  std::string name;
  int64_t B, T, H, W, M, d;
  std::array<int64_t, 3> kernel;
  bool row_backward;  // time the row kernel's backward too (its atomics make it slow at the large size)
};

struct Timing {
  double fwd_ms = -1, fwd_bwd_ms = -1;
};

Timing time_dsa(const CudaCase& c, Inputs& in, ops::DsaImpl impl, bool deterministic, bool with_backward, int reps) {
  Timing t;
  {
    torch::NoGradGuard no_grad;
    t.fwd_ms =
        cuda_median_ms(reps, [&] { ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, impl, deterministic); });
  }
  if (with_backward)
    t.fwd_bwd_ms = cuda_median_ms(reps, [&] {
      clear_grads(in);
      ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, impl, deterministic).backward(in.dout);
    });
  return t;
}

// Executed matrix-product FLOPs of the tiled kernel on these offsets: per (tile, head) 2·16·HV·dp for
// each product over the tile's exact halo HV (forward: S and P'·V; backward adds S, T, dV, dK, dQ).
std::pair<double, double> tiled_flops(const CudaCase& c, const torch::Tensor& offsets) {
  namespace tile = megaslide::dsa3d_tile;
  const auto ke = ops::effective_kernel(c.kernel, {c.T, c.H, c.W});
  const auto geo = tile::make_geometry(int(c.T), int(c.H), int(c.W), int(ke[0]), int(ke[1]), int(ke[2]));
  const auto off = offsets.detach().to(torch::kCPU, torch::kFloat).contiguous();
  const float* o = off.data_ptr<float>();
  double halo_keys = 0;  // Σ over (batch, tile) of HV (G = 1 here)
  for (int64_t b = 0; b < c.B; ++b)
    for (int tl = 0; tl < geo.tiles(); ++tl) {
      int lo[3] = {INT32_MAX, INT32_MAX, INT32_MAX}, hi[3] = {-1, -1, -1};
      for (int q = 0; q < tile::TileShape::kQueries; ++q) {
        const auto qr = tile::tile_query(geo, tl, q);
        if (!qr.valid) continue;
        const float* base = o + (b * geo.tokens() + qr.token) * geo.K * 3;
        for (int j = 0; j < geo.K; ++j) tile::halo_include(tile::sample_point<float>(geo, qr, j, base + 3 * j), lo, hi);
      }
      halo_keys += tile::make_halo(lo, hi).volume();
    }
  const double dp = double((c.d + 15) / 16 * 16);
  const double product = 2.0 * tile::TileShape::kQueries * halo_keys * dp * double(c.M);
  return {2 * product, 7 * product};  // forward: S, P'V; backward: S, T, dV, dK, dQ
}

// Global attention over the same tokens with LibTorch's flash kernel (other SDPA backends disabled):
// [B, M, N, d] bfloat16; forward and forward + backward.
Timing time_flash(const CudaCase& c, int reps, bool& ran) {
  const int64_t N = c.T * c.H * c.W;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(0);
  auto q = torch::randn({c.B, c.M, N, c.d}, opts).requires_grad_(true);
  auto k = torch::randn({c.B, c.M, N, c.d}, opts).requires_grad_(true);
  auto v = torch::randn({c.B, c.M, N, c.d}, opts).requires_grad_(true);
  auto dout = torch::randn({c.B, c.M, N, c.d}, opts);
  auto& ctx = at::globalContext();
  const bool mem = ctx.userEnabledMemEfficientSDP(), math = ctx.userEnabledMathSDP(), cudnn = ctx.userEnabledCuDNNSDP();
  ctx.setSDPUseMemEfficient(false), ctx.setSDPUseMath(false), ctx.setSDPUseCuDNN(false);
  Timing t;
  ran = true;
  try {
    {
      torch::NoGradGuard no_grad;
      t.fwd_ms = cuda_median_ms(reps, [&] { at::scaled_dot_product_attention(q, k, v); });
    }
    t.fwd_bwd_ms = cuda_median_ms(reps, [&] {
      for (auto* x : {&q, &k, &v}) x->mutable_grad() = torch::Tensor();
      at::scaled_dot_product_attention(q, k, v).backward(dout);
    });
  } catch (const c10::Error& e) {
    std::printf("flash SDPA unavailable: %s\n", e.what_without_backtrace());
    ran = false;
  }
  ctx.setSDPUseMemEfficient(mem), ctx.setSDPUseMath(math), ctx.setSDPUseCuDNN(cudnn);
  return t;
}

std::string num(double v) { return v < 0 ? "null" : fmt_double(v); }

int cuda_mode(int reps) {
  const torch::Device device(torch::kCUDA, 0);
  const std::vector<CudaCase> cases{{"16x64x64", 1, 16, 64, 64, 16, 64, {3, 7, 7}, false},
                                    {"8x32x32", 1, 8, 32, 32, 4, 32, {3, 7, 7}, true}};
  std::printf(
      "bench_dsa3d (cuda, bfloat16, offsets uniform in +-(1, 3, 3), CUDA events, median of %d after a warm-up)\n",
      reps);
  std::string json = "{\"bench\":\"dsa3d\",\"device\":\"cuda\",\"dtype\":\"bfloat16\",\"tensor_core_peak_tflops\":" +
                     fmt_double(kTensorCorePeakTflops) + ",\"cases\":[";
  for (size_t i = 0; i < cases.size(); ++i) {
    const CudaCase& c = cases[i];
    const int64_t N = c.T * c.H * c.W;
    const auto ke = ops::effective_kernel(c.kernel, {c.T, c.H, c.W});
    const int64_t K = ke[0] * ke[1] * ke[2];
    torch::manual_seed(0);
    const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
    Inputs in;
    in.q = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts).requires_grad_(true);
    in.k = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts).requires_grad_(true);
    in.v = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts).requires_grad_(true);
    const auto range = torch::tensor({1.0f, 3.0f, 3.0f}, opts.dtype(torch::kFloat));
    in.offsets = ((torch::rand({c.B, c.T, c.H, c.W, 1, K, 3}, opts.dtype(torch::kFloat)) * 2 - 1) * range)
                     .to(torch::kBFloat16)
                     .requires_grad_(true);
    in.bias = (0.1 * torch::randn({c.M, K}, opts)).requires_grad_(true);
    in.dout = torch::randn({c.B, c.T, c.H, c.W, c.M, c.d}, opts);

    const Timing tiled = time_dsa(c, in, ops::DsaImpl::kCudaTiled, false, true, reps);
    const Timing tiled_det = time_dsa(c, in, ops::DsaImpl::kCudaTiled, true, true, reps);
    const Timing row = time_dsa(c, in, ops::DsaImpl::kCuda, false, c.row_backward, c.row_backward ? reps : 1);
    // Agreement of the two kernels on these inputs (bfloat16 outputs and gradients).
    double agree = 0;
    {
      clear_grads(in);
      auto out_t = ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, ops::DsaImpl::kCudaTiled);
      auto out_r = ops::dsa3d(in.q, in.k, in.v, in.offsets, in.bias, c.kernel, ops::DsaImpl::kCuda);
      agree = max_rel_error(out_t.detach().to(torch::kFloat), out_r.detach().to(torch::kFloat));
      if (c.row_backward) {
        out_t.backward(in.dout);
        const auto dq_t = in.q.grad().clone(), doff_t = in.offsets.grad().clone();
        clear_grads(in);
        out_r.backward(in.dout);
        agree = std::max({agree, max_rel_error(dq_t.to(torch::kFloat), in.q.grad().to(torch::kFloat)),
                          max_rel_error(doff_t.to(torch::kFloat), in.offsets.grad().to(torch::kFloat))});
      }
      clear_grads(in);
    }
    bool flash_ran = false;
    const Timing flash = time_flash(c, reps, flash_ran);
    const auto [tiled_fwd_flop, tiled_fwd_bwd_flop] = tiled_flops(c, in.offsets);
    // Attention-equivalent FLOPs (K keys per query, as 4·N·K·d·M forward, 2.5x that backward: the
    // convention FlashAttention reports) and flash's own (N keys per query).
    const double eq_fwd = 4.0 * c.B * N * K * c.d * c.M, flash_fwd = 4.0 * c.B * N * N * c.d * c.M;
    auto tflops = [](double flop, double ms) { return ms > 0 ? flop / (ms * 1e-3) / 1e12 : -1.0; };
    const double tiled_fwd_tf = tflops(tiled_fwd_flop, tiled.fwd_ms),
                 tiled_all_tf = tflops(tiled_fwd_bwd_flop, tiled.fwd_bwd_ms);
    const double flash_fwd_tf = flash_ran ? tflops(flash_fwd, flash.fwd_ms) : -1;
    const double flash_all_tf = flash_ran ? tflops(3.5 * flash_fwd, flash.fwd_bwd_ms) : -1;
    std::printf("\n%s tokens (N = %lld), B = %lld, M = %lld, d = %lld, kernel 3x7x7 (K = %lld)\n", c.name.c_str(),
                (long long)N, (long long)c.B, (long long)c.M, (long long)c.d, (long long)K);
    std::printf("  %-28s %10s %12s %14s %14s\n", "variant", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s");
    std::printf("  %-28s %10.3f %12.3f %14.1f %14.1f   (executed matrix products; %.1f%% / %.1f%% of %.0f)\n",
                "tiled (cuda_tiled)", tiled.fwd_ms, tiled.fwd_bwd_ms, tiled_fwd_tf, tiled_all_tf,
                100 * tiled_fwd_tf / kTensorCorePeakTflops, 100 * tiled_all_tf / kTensorCorePeakTflops,
                kTensorCorePeakTflops);
    std::printf("  %-28s %10.3f %12.3f\n", "tiled, deterministic", tiled_det.fwd_ms, tiled_det.fwd_bwd_ms);
    std::printf("  %-28s %10.3f %12s\n", "row kernel (cuda)", row.fwd_ms,
                row.fwd_bwd_ms < 0 ? "not timed" : fmt_double(row.fwd_bwd_ms).c_str());
    if (flash_ran)
      std::printf("  %-28s %10.3f %12.3f %14.1f %14.1f\n", "flash SDPA, all N keys", flash.fwd_ms, flash.fwd_bwd_ms,
                  flash_fwd_tf, flash_all_tf);
    std::printf(
        "  attention-equivalent TFLOP/s of tiled (4·N·K·d·M fwd): %.1f; ratios: row/tiled fwd %.2f%s%s; "
        "deterministic/default fwd+bwd %.2f; tiled vs row max relative difference %.2e\n",
        tflops(eq_fwd, tiled.fwd_ms), row.fwd_ms / tiled.fwd_ms,
        row.fwd_bwd_ms > 0 ? (", fwd+bwd " + fmt_double(row.fwd_bwd_ms / tiled.fwd_bwd_ms)).c_str() : "",
        flash_ran ? (", flash/tiled fwd " + fmt_double(flash.fwd_ms / tiled.fwd_ms) + ", fwd+bwd " +
                     fmt_double(flash.fwd_bwd_ms / tiled.fwd_bwd_ms))
                        .c_str()
                  : "",
        tiled_det.fwd_bwd_ms / tiled.fwd_bwd_ms, agree);
    json += std::string(i ? "," : "") + "{\"name\":\"" + c.name + "\",\"tokens\":" + std::to_string(N) +
            ",\"B\":" + std::to_string(c.B) + ",\"M\":" + std::to_string(c.M) + ",\"d\":" + std::to_string(c.d) +
            ",\"K\":" + std::to_string(K) + ",\"tiled_fwd_ms\":" + num(tiled.fwd_ms) +
            ",\"tiled_fwd_bwd_ms\":" + num(tiled.fwd_bwd_ms) +
            ",\"tiled_det_fwd_bwd_ms\":" + num(tiled_det.fwd_bwd_ms) + ",\"row_fwd_ms\":" + num(row.fwd_ms) +
            ",\"row_fwd_bwd_ms\":" + num(row.fwd_bwd_ms) + ",\"flash_fwd_ms\":" + num(flash_ran ? flash.fwd_ms : -1) +
            ",\"flash_fwd_bwd_ms\":" + num(flash_ran ? flash.fwd_bwd_ms : -1) +
            ",\"tiled_fwd_tflops\":" + num(tiled_fwd_tf) + ",\"tiled_fwd_bwd_tflops\":" + num(tiled_all_tf) +
            ",\"tiled_fwd_attention_equivalent_tflops\":" + num(tflops(eq_fwd, tiled.fwd_ms)) +
            ",\"flash_fwd_tflops\":" + num(flash_fwd_tf) + ",\"flash_fwd_bwd_tflops\":" + num(flash_all_tf) +
            ",\"row_vs_tiled_fwd\":" + num(row.fwd_ms / tiled.fwd_ms) +
            ",\"flash_vs_tiled_fwd\":" + num(flash_ran ? flash.fwd_ms / tiled.fwd_ms : -1) +
            ",\"flash_vs_tiled_fwd_bwd\":" + num(flash_ran ? flash.fwd_bwd_ms / tiled.fwd_bwd_ms : -1) +
            ",\"deterministic_vs_default_fwd_bwd\":" + num(tiled_det.fwd_bwd_ms / tiled.fwd_bwd_ms) +
            ",\"tiled_vs_row_max_rel_diff\":" + fmt_double(agree) + "}";
  }
  std::printf("%s]}\n", json.c_str());
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool use_cuda = false, kernels_only = false, smoke_shape = false, bf16_dots = false, bf16 = false;
  int reps = 3, threads = 0;
  std::string isa;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cuda")) use_cuda = true;
    else if (!std::strcmp(argv[i], "--kernels-only")) kernels_only = true;
    else if (!std::strcmp(argv[i], "--smoke-shape")) smoke_shape = true;
    else if (!std::strcmp(argv[i], "--bf16-dots")) bf16_dots = true;
    else if (!std::strcmp(argv[i], "--bf16")) bf16 = true;
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--isa") && i + 1 < argc) isa = argv[++i];
    else {
      std::fprintf(
          stderr,
          "usage: %s [--cuda] [--kernels-only | --smoke-shape [--bf16] | --bf16-dots] [--reps N] [--threads N] "
          "[--isa baseline|avx2|avx512|avx512bf16]\n",
          argv[0]);
      return 2;
    }
  }
  if (!isa.empty()) {
    namespace detail = ops::detail;
    const struct {
      detail::Dsa3dCpuIsa isa;
      int lanes;
    } choices[] = {{detail::Dsa3dCpuIsa::kBaseline, 4},
                   {detail::Dsa3dCpuIsa::kAvx2, 8},
                   {detail::Dsa3dCpuIsa::kAvx512, 16},
                   {detail::Dsa3dCpuIsa::kAvx512Bf16, 16}};
    bool known = false;
    for (const auto& c : choices)
      if (isa == detail::to_string(c.isa)) {
        known = true;
        try {
          detail::set_dsa3d_cpu_isa(c.isa);
        } catch (const std::invalid_argument& e) {
          std::fprintf(stderr, "bench_dsa3d: --isa %s: %s\n", isa.c_str(), e.what());
          return 2;
        }
        forced_lanes = c.lanes;
      }
    if (!known) {
      std::fprintf(stderr, "bench_dsa3d: --isa %s: expected baseline, avx2, avx512 or avx512bf16\n", isa.c_str());
      return 2;
    }
  }
  if (threads > 0) torch::set_num_threads(threads);
  if (bf16 && !smoke_shape) {
    std::fprintf(stderr, "bench_dsa3d: --bf16 goes with --smoke-shape\n");
    return 2;
  }
  if (int(use_cuda) + int(kernels_only) + int(smoke_shape) + int(bf16_dots) > 1) {
    std::fprintf(stderr,
                 "bench_dsa3d: --cuda, --kernels-only, --smoke-shape and --bf16-dots are separate modes: one\n");
    return 2;
  }
  if (bf16_dots && !isa.empty()) {
    std::fprintf(stderr, "bench_dsa3d: --bf16-dots runs both the avx512 and avx512bf16 loops itself; drop --isa\n");
    return 2;
  }
  // These two measure no memory: LibTorch's own CPU allocator (bf16 SDPA's oneDNN path needs raw_allocate, which
  // the tracking allocator's wrapped pointers cannot serve).
  if (!use_cuda && smoke_shape) return smoke_shape_mode(reps, bf16);
  if (!use_cuda && bf16_dots) return bf16_dots_mode(reps);
  Memory memory;
  memory.cuda = use_cuda;
  static TrackingCpuAllocator tracker(c10::GetCPUAllocator());
  cpu_tracker = &tracker;
  c10::SetCPUAllocator(&tracker, /*priority*/ 100);
  if (!use_cuda) return kernels_only ? cpu_kernels_mode(reps, memory) : cpu_mode(reps, memory);
#ifdef MEGASLIDE_WITH_CUDA
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_dsa3d: --cuda given but no CUDA device is available\n");
    return 1;
  }
  return cuda_mode(reps);
#else
  std::fprintf(stderr, "bench_dsa3d: this build has no CUDA kernels (nvcc was not found at configure time)\n");
  return 1;
#endif
}
