#include "megaslide/offload/cpu_adamw.h"

#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "offload/adamw_kernels.h"
#include "megaslide/util/cpu_resources.h"
#include "offload/tile_pool.h"

namespace megaslide::offload {
namespace {

using detail::AdamWKernelParams;
using detail::ComputeType;
using detail::GradType;
using detail::StateType;

// Threads take contiguous runs of whole tiles. 4096 elements is 16 KiB of each fp32 array and 8 KiB of
// each 16-bit one, so every thread's range starts on a page boundary of every array (when the arrays
// are page-aligned, as HostParamStore's are): no two threads share a cache line or a page, and each
// thread's five streams stay sequential for the hardware prefetchers. Results do not depend on it.
constexpr int64_t kTileElements = 4096;
// Below this a block is updated on the calling thread alone. Waking a sleeping worker was measured at
// ~50 us on this project's loaded 2-core machines, about what one thread takes for 256 K elements
// (7 MB of traffic at ~40 GB/s, faster still in cache).
constexpr int64_t kMinParallelElements = 64 * kTileElements;

using KernelFn = void (*)(const AdamWKernelParams&, int64_t, int64_t);

KernelFn adamw_kernel(SimdPath path) {
  switch (path) {
    case SimdPath::kAvx512:
      return detail::adamw_avx512;
    case SimdPath::kAvx2:
      return detail::adamw_avx2;
    default:
      return detail::adamw_scalar;
  }
}

KernelFn probe_kernel(SimdPath path) {
  switch (path) {
    case SimdPath::kAvx512:
      return detail::stream_probe_avx512;
    case SimdPath::kAvx2:
      return detail::stream_probe_avx2;
    default:
      return detail::stream_probe_scalar;
  }
}

GradType grad_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return GradType::kFloat32;
    case c10::ScalarType::BFloat16:
      return GradType::kBFloat16;
    case c10::ScalarType::Half:
      return GradType::kFloat16;
    default:
      TORCH_CHECK(false, "CpuAdamW: gradient dtype ", t, " is not supported; expected BFloat16, Half or Float");
  }
}

ComputeType compute_type(const void* compute, c10::ScalarType t) {
  if (compute == nullptr) return ComputeType::kNone;
  switch (t) {
    case c10::ScalarType::BFloat16:
      return ComputeType::kBFloat16;
    case c10::ScalarType::Half:
      return ComputeType::kFloat16;
    default:
      TORCH_CHECK(false, "CpuAdamW: compute-copy dtype ", t, " is not supported; expected BFloat16 or Half");
  }
}

// kAuto streams large blocks, unless the gradient is the compute copy itself: then each line of the
// copy has just been read, so a streaming store saves no read-for-ownership and only evicts the line.
bool streaming(CopyStores stores, int64_t numel, bool grad_is_compute) {
  return stores == CopyStores::kStreaming ||
         (stores == CopyStores::kAuto && numel >= kStreamingMinElements && !grad_is_compute);
}

StateType state_type(StateDtype t) {
  switch (t) {
    case StateDtype::kFloat32:
      return StateType::kFloat32;
    case StateDtype::kBFloat16:
      return StateType::kBFloat16;
    case StateDtype::kInt8:
      return StateType::kInt8;
  }
  TORCH_CHECK(false, "CpuAdamW: unknown state dtype");
}

void check_state_pointers(const AdamWBlockState& s) {
  TORCH_CHECK(s.numel >= 0, "CpuAdamW: numel must be >= 0, got ", s.numel);
  if (s.numel == 0) return;
  TORCH_CHECK(s.master != nullptr && s.exp_avg != nullptr && s.exp_avg_sq != nullptr && s.grad != nullptr,
              "CpuAdamW: master, exp_avg, exp_avg_sq and grad must be non-null for numel ", s.numel);
  TORCH_CHECK(s.state_dtype != StateDtype::kInt8 || (s.exp_avg_scale != nullptr && s.exp_avg_sq_scale != nullptr),
              "CpuAdamW: int8 state needs exp_avg_scale and exp_avg_sq_scale (", state_groups(s.numel),
              " groups each for numel ", s.numel, ")");
}

// The arrays and sizes of a block as the kernels take them (scalars are the caller's to fill).
AdamWKernelParams kernel_arrays(const AdamWBlockState& s) {
  AdamWKernelParams p;
  p.master = s.master;
  p.exp_avg = s.exp_avg;
  p.exp_avg_sq = s.exp_avg_sq;
  p.exp_avg_scale = s.exp_avg_scale;
  p.exp_avg_sq_scale = s.exp_avg_sq_scale;
  p.state_type = state_type(s.state_dtype);
  p.grad = s.grad;
  p.grad_type = grad_type(s.grad_dtype);
  p.compute = s.compute;
  p.numel = s.numel;
  return p;
}

}  // namespace

class CpuAdamW::Pool : public detail::TilePool {
 public:
  using detail::TilePool::TilePool;

  // Splits [0, numel) into contiguous whole-tile ranges, one per worker, and runs fn(begin, end) on them
  // (on the calling thread alone below kMinParallelElements).
  template <typename Fn>
  void for_ranges(int64_t numel, Fn&& fn) {
    if (numel < kMinParallelElements || num_threads() == 1) {
      if (numel > 0) fn(int64_t{0}, numel);
      return;
    }
    const int64_t tiles = (numel + kTileElements - 1) / kTileElements;
    const int64_t workers = num_threads();
    run([&](int w) {
      const int64_t begin = std::min(numel, tiles * w / workers * kTileElements);
      const int64_t end = std::min(numel, tiles * (w + 1) / workers * kTileElements);
      if (begin < end) fn(begin, end);
    });
  }
  void for_tiles(const AdamWKernelParams& p, KernelFn kernel) {
    for_ranges(p.numel, [&](int64_t begin, int64_t end) { kernel(p, begin, end); });
  }
};

StateDtype parse_state_dtype(const std::string& name) {
  if (name == "fp32") return StateDtype::kFloat32;
  if (name == "bf16") return StateDtype::kBFloat16;
  if (name == "int8") return StateDtype::kInt8;
  TORCH_CHECK(false, "optimizer.state_dtype: expected fp32, bf16 or int8, got '", name, "'");
}

const char* to_string(StateDtype dtype) {
  switch (dtype) {
    case StateDtype::kFloat32:
      return "fp32";
    case StateDtype::kBFloat16:
      return "bf16";
    case StateDtype::kInt8:
      return "int8";
  }
  return "unknown";
}

int64_t state_element_bytes(StateDtype dtype) {
  return dtype == StateDtype::kFloat32 ? 4 : dtype == StateDtype::kBFloat16 ? 2 : 1;
}

const char* to_string(SimdPath path) {
  switch (path) {
    case SimdPath::kAuto:
      return "auto";
    case SimdPath::kAvx512:
      return "avx512";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kScalar:
      return "scalar";
  }
  return "unknown";
}

SimdPath CpuAdamW::detect() {
  if (detail::cpu_has_avx512()) return SimdPath::kAvx512;
  if (detail::cpu_has_avx2()) return SimdPath::kAvx2;
  return SimdPath::kScalar;
}

bool CpuAdamW::supported(SimdPath path) {
  switch (path) {
    case SimdPath::kAvx512:
      return detail::cpu_has_avx512();
    case SimdPath::kAvx2:
      return detail::cpu_has_avx2();
    default:
      return true;
  }
}

CpuAdamW::CpuAdamW(AdamWOptions options, int num_threads, SimdPath path) : options_(options) {
  TORCH_CHECK(options.beta1 >= 0 && options.beta1 < 1, "CpuAdamW: beta1 must be in [0, 1), got ", options.beta1);
  TORCH_CHECK(options.beta2 >= 0 && options.beta2 < 1, "CpuAdamW: beta2 must be in [0, 1), got ", options.beta2);
  TORCH_CHECK(options.eps >= 0, "CpuAdamW: eps must be >= 0, got ", options.eps);
  TORCH_CHECK(options.weight_decay >= 0, "CpuAdamW: weight_decay must be >= 0, got ", options.weight_decay);
  TORCH_CHECK(num_threads >= 0, "CpuAdamW: num_threads must be >= 0 (0 = the cores available), got ", num_threads);
  TORCH_CHECK(supported(path), "CpuAdamW: SIMD path '", to_string(path),
              "' was forced but this CPU does not support it; use SimdPath::kAuto (this CPU: '", to_string(detect()),
              "')");
  path_ = path == SimdPath::kAuto ? detect() : path;
  if (num_threads == 0) num_threads = available_cores().cores;
  pool_ = std::make_unique<Pool>(num_threads);
}

CpuAdamW::~CpuAdamW() = default;

int CpuAdamW::num_threads() const { return pool_->num_threads(); }

void CpuAdamW::for_each_range(int64_t numel, const std::function<void(int64_t begin, int64_t end)>& fn) {
  TORCH_CHECK(numel >= 0, "CpuAdamW::for_each_range: numel must be >= 0, got ", numel);
  pool_->for_ranges(numel, fn);
}

void CpuAdamW::step_block(const AdamWBlockState& s, int64_t step, double lr, float grad_scale) {
  check_state_pointers(s);
  TORCH_CHECK(step >= 1, "CpuAdamW: step is 1-based (the count of steps including this one), got ", step);
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "CpuAdamW: lr must be finite and >= 0, got ", lr);
  TORCH_CHECK(std::isfinite(grad_scale), "CpuAdamW: grad_scale must be finite, got ", grad_scale);

  AdamWKernelParams p = kernel_arrays(s);
  p.compute_type = compute_type(s.compute, s.compute_dtype);
  if (p.numel == 0) return;

  // The scalars as LibTorch's AdamW forms them: in double, then rounded once to fp32 where the fp32
  // tensor op consumes them (torch/csrc/api/src/optim/adamw.cpp).
  const AdamWOptions& o = options_;
  const double bias_correction1 = 1 - std::pow(o.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(o.beta2, static_cast<double>(step));
  p.grad_scale = grad_scale;
  p.decay = static_cast<float>(1 - lr * o.weight_decay);
  p.beta1 = static_cast<float>(o.beta1);
  p.one_minus_beta1 = static_cast<float>(1 - o.beta1);
  p.beta2 = static_cast<float>(o.beta2);
  p.one_minus_beta2 = static_cast<float>(1 - o.beta2);
  p.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  p.eps = static_cast<float>(o.eps);
  p.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  p.stream_compute = streaming(copy_stores_, p.numel, p.grad == p.compute);
  pool_->for_tiles(p, adamw_kernel(path_));
}

void CpuAdamW::step_block(const at::Tensor& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                          const at::Tensor& grad, const at::Tensor& compute, int64_t step, double lr,
                          float grad_scale) {
  const auto check_state = [](const at::Tensor& t, const char* name, bool bf16_allowed) {
    TORCH_CHECK(t.defined(), "CpuAdamW: ", name, " is undefined");
    TORCH_CHECK(t.device().is_cpu(), "CpuAdamW: ", name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK(t.scalar_type() == at::kFloat || (bf16_allowed && t.scalar_type() == at::kBFloat16), "CpuAdamW: ", name,
                bf16_allowed ? " must be Float (fp32) or BFloat16, got " : " must be Float (fp32), got ",
                t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), "CpuAdamW: ", name, " must be contiguous (sizes ", t.sizes(), ", strides ",
                t.strides(), ")");
  };
  check_state(master, "master", false);
  check_state(exp_avg, "exp_avg", true);
  check_state(exp_avg_sq, "exp_avg_sq", true);
  TORCH_CHECK(exp_avg.scalar_type() == exp_avg_sq.scalar_type(), "CpuAdamW: exp_avg (", exp_avg.scalar_type(),
              ") and exp_avg_sq (", exp_avg_sq.scalar_type(), ") must have one dtype");
  const int64_t n = master.numel();
  TORCH_CHECK(exp_avg.numel() == n && exp_avg_sq.numel() == n, "CpuAdamW: exp_avg (", exp_avg.numel(),
              " elements) and exp_avg_sq (", exp_avg_sq.numel(), ") must have master's numel ", n);
  TORCH_CHECK(grad.defined(), "CpuAdamW: grad is undefined");
  TORCH_CHECK(grad.device().is_cpu(), "CpuAdamW: grad must be a CPU tensor, got ", grad.device());
  TORCH_CHECK(grad.is_contiguous(), "CpuAdamW: grad must be contiguous (sizes ", grad.sizes(), ", strides ",
              grad.strides(), ")");
  TORCH_CHECK(grad.numel() == n, "CpuAdamW: grad has ", grad.numel(), " elements, expected master's ", n);
  AdamWBlockState s;
  s.master = master.data_ptr<float>();
  s.exp_avg = exp_avg.data_ptr();
  s.exp_avg_sq = exp_avg_sq.data_ptr();
  s.state_dtype = exp_avg.scalar_type() == at::kBFloat16 ? StateDtype::kBFloat16 : StateDtype::kFloat32;
  s.grad = grad.data_ptr();
  s.grad_dtype = grad.scalar_type();
  if (compute.defined()) {
    TORCH_CHECK(compute.device().is_cpu(), "CpuAdamW: compute must be a CPU tensor, got ", compute.device());
    TORCH_CHECK(compute.is_contiguous(), "CpuAdamW: compute must be contiguous (sizes ", compute.sizes(), ", strides ",
                compute.strides(), ")");
    TORCH_CHECK(compute.numel() == n, "CpuAdamW: compute has ", compute.numel(), " elements, expected master's ", n);
    s.compute = compute.data_ptr();
    s.compute_dtype = compute.scalar_type();
  }
  s.numel = n;
  step_block(s, step, lr, grad_scale);
}

void CpuAdamW::stream_probe(const AdamWBlockState& s, float grad_scale) {
  check_state_pointers(s);
  TORCH_CHECK(s.grad_dtype == c10::ScalarType::BFloat16 || s.grad_dtype == c10::ScalarType::Half,
              "CpuAdamW::stream_probe: grad dtype must be BFloat16 or Half, got ", s.grad_dtype);
  TORCH_CHECK(s.numel == 0 || s.compute != nullptr, "CpuAdamW::stream_probe: needs a compute copy to write");
  AdamWKernelParams p = kernel_arrays(s);
  p.compute_type = ComputeType::kBFloat16;
  p.grad_scale = grad_scale;
  if (p.numel == 0) return;
  p.stream_compute = streaming(copy_stores_, p.numel, p.grad == p.compute);
  pool_->for_tiles(p, probe_kernel(path_));
}

}  // namespace megaslide::offload
