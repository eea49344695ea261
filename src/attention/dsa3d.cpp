#include "megaslide/attention/dsa3d.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "attention/dsa3d_params.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace megaslide::ops {

std::array<int64_t, 3> effective_kernel(std::array<int64_t, 3> kernel, std::array<int64_t, 3> volume) {
  return {std::min(kernel[0], volume[0]), std::min(kernel[1], volume[1]), std::min(kernel[2], volume[2])};
}

torch::Tensor dsa3d_base_positions(std::array<int64_t, 3> volume, std::array<int64_t, 3> kernel,
                                   const torch::TensorOptions& options) {
  auto ke = effective_kernel(kernel, volume);
  auto opts = options.dtype(torch::kFloat32);
  // Per axis: start(p) + j for p in [0, S), j in [0, k): shape [S, k].
  std::array<torch::Tensor, 3> axis;
  for (int a = 0; a < 3; ++a) {
    auto p = torch::arange(volume[a], opts.dtype(torch::kLong));
    auto start = torch::clamp(p - ke[a] / 2, 0, volume[a] - ke[a]);
    axis[a] = (start.unsqueeze(1) + torch::arange(ke[a], opts.dtype(torch::kLong)).unsqueeze(0)).to(opts);
  }
  const int64_t T = volume[0], H = volume[1], W = volume[2];
  const int64_t kt = ke[0], kh = ke[1], kw = ke[2];
  auto pt = axis[0].view({T, 1, 1, kt, 1, 1}).expand({T, H, W, kt, kh, kw});
  auto ph = axis[1].view({1, H, 1, 1, kh, 1}).expand({T, H, W, kt, kh, kw});
  auto pw = axis[2].view({1, 1, W, 1, 1, kw}).expand({T, H, W, kt, kh, kw});
  return torch::stack({pt, ph, pw}, -1).reshape({T, H, W, kt * kh * kw, 3});
}

namespace {

struct Shapes {
  int64_t B, T, H, W, M, d, G, K;
  std::array<int64_t, 3> kernel;  // effective
};

Shapes check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& offsets, const std::optional<torch::Tensor>& bias,
                    std::array<int64_t, 3> kernel) {
  TORCH_CHECK(q.dim() == 6, "dsa3d: q must be [B, T, H, W, M, d], got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "dsa3d: k ", k.sizes(), " and v ", v.sizes(),
              " must have q's shape ", q.sizes());
  TORCH_CHECK(q.is_floating_point(), "dsa3d: q, k, v must be floating point, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "dsa3d: q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device() && offsets.device() == q.device(),
              "dsa3d: q, k, v and offsets must be on one device, got ", q.device(), ", ", k.device(), ", ", v.device(),
              ", ", offsets.device());
  for (int a = 0; a < 3; ++a)
    TORCH_CHECK(kernel[a] >= 1 && kernel[a] % 2 == 1, "dsa3d: kernel sizes must be odd and positive, got (", kernel[0],
                ", ", kernel[1], ", ", kernel[2], ")");
  Shapes s{};
  s.B = q.size(0), s.T = q.size(1), s.H = q.size(2), s.W = q.size(3), s.M = q.size(4), s.d = q.size(5);
  s.kernel = effective_kernel(kernel, {s.T, s.H, s.W});
  s.K = s.kernel[0] * s.kernel[1] * s.kernel[2];
  TORCH_CHECK(offsets.dim() == 7 && offsets.size(0) == s.B && offsets.size(1) == s.T && offsets.size(2) == s.H &&
                  offsets.size(3) == s.W && offsets.size(6) == 3,
              "dsa3d: offsets must be [B, T, H, W, G, K, 3] = [", s.B, ", ", s.T, ", ", s.H, ", ", s.W, ", G, ", s.K,
              ", 3], got ", offsets.sizes());
  s.G = offsets.size(4);
  TORCH_CHECK(s.G >= 1 && s.M % s.G == 0, "dsa3d: offset groups G = ", s.G, " must divide the heads M = ", s.M);
  TORCH_CHECK(offsets.size(5) == s.K, "dsa3d: offsets carry K = ", offsets.size(5), " samples but the kernel (",
              kernel[0], ", ", kernel[1], ", ", kernel[2], ") on a ", s.T, "x", s.H, "x", s.W, " volume has K = ", s.K,
              " (effective kernel (", s.kernel[0], ", ", s.kernel[1], ", ", s.kernel[2], "))");
  TORCH_CHECK(offsets.is_floating_point(), "dsa3d: offsets must be floating point, got ", offsets.scalar_type());
  if (bias) {
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == s.M && bias->size(1) == s.K, "dsa3d: bias must be [M, K] = [", s.M,
                ", ", s.K, "], got ", bias->sizes());
    TORCH_CHECK(bias->device() == q.device(), "dsa3d: bias is on ", bias->device(), " but q is on ", q.device());
  }
  return s;
}

}  // namespace

torch::Tensor dsa3d_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& offsets, const std::optional<torch::Tensor>& bias,
                              std::array<int64_t, 3> kernel) {
  const Shapes s = check_inputs(q, k, v, offsets, bias, kernel);
  const int64_t N = s.T * s.H * s.W, Mg = s.M / s.G;
  // Half-precision inputs are computed in float32 (sample coordinates need more than bf16's 8 bits).
  const auto dtype = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat32;

  const auto off = offsets.to(dtype);
  // Sample positions in token units, clamped into the volume: [B, T, H, W, G, K, 3].
  auto base = dsa3d_base_positions({s.T, s.H, s.W}, s.kernel, off.options());
  auto upper = torch::tensor({double(s.T - 1), double(s.H - 1), double(s.W - 1)}, off.options());
  auto positions = torch::clamp(base.view({1, s.T, s.H, s.W, 1, s.K, 3}) + off, torch::zeros_like(upper), upper);

  // grid_sample's normalised coordinates (align_corners=True: -1 and 1 are the first and last token
  // centres) in (x, y, z) = (w, h, t) order. ATen maps them back to token units as ((g + 1) / 2)·(S - 1),
  // a round trip that is exact only when S - 1 is a power of two: otherwise an integer position can
  // come back a rounding below itself, and grid_sample then takes the left instead of the right
  // difference there (the fused kernels' convention, and what every sample does at zero offsets).
  // So each axis is padded (replicating its last token) to S' = 2^e + 1 >= S tokens: g = P·2^(1-e) - 1
  // and its unnormalisation are exact for every integer P (and round-off away from integers). Positions
  // stay clamped to [0, S - 1], so the padding only ever meets zero-weight corners; its replicated
  // values make the derivative at P = S - 1 zero, as the kernels' border rule.
  std::array<int64_t, 3> padded{};
  std::vector<double> scale_values(3);
  for (int a = 0; a < 3; ++a) {
    const int64_t S = std::array<int64_t, 3>{s.T, s.H, s.W}[a];
    int64_t span = 1;  // S' - 1: the smallest power of two >= S - 1 (1 for S <= 2)
    while (span < S - 1) span *= 2;
    padded[a] = span + 1;
    scale_values[a] = 2.0 / static_cast<double>(span);  // a power of two: exact
  }
  auto scale = torch::tensor(scale_values, off.options());
  auto grid = (positions * scale - 1.0).flip({-1});  // [B, T, H, W, G, K, 3]
  grid = grid.permute({0, 4, 1, 2, 3, 5, 6}).reshape({s.B * s.G, N, s.K, 1, 3}).to(dtype);

  // Feature maps per group, padded: [B*G, Mg*d, T', H', W'].
  auto as_volume = [&](const torch::Tensor& x) {
    auto volume = x.reshape({s.B, s.T, s.H, s.W, s.G, Mg * s.d})
                      .permute({0, 4, 5, 1, 2, 3})
                      .reshape({s.B * s.G, Mg * s.d, s.T, s.H, s.W});
    if (padded == std::array<int64_t, 3>{s.T, s.H, s.W}) return volume;
    return at::replication_pad3d(volume, {0, padded[2] - s.W, 0, padded[1] - s.H, 0, padded[0] - s.T});
  };
  auto sample = [&](const torch::Tensor& x) {
    auto y = torch::grid_sampler(as_volume(x.to(dtype)), grid, /*bilinear*/ 0, /*border*/ 1, /*align_corners*/ true);
    return y.view({s.B, s.G, Mg, s.d, N, s.K});  // N·K·d per head: the reference's memory cost
  };
  auto k_sampled = sample(k), v_sampled = sample(v);

  auto qg = q.to(dtype).reshape({s.B, N, s.G, Mg, s.d}).permute({0, 2, 3, 1, 4});  // [B, G, Mg, N, d]
  auto logits = torch::einsum("bgmnd,bgmdnk->bgmnk", {qg, k_sampled}) / std::sqrt(static_cast<double>(s.d));
  if (bias) logits = logits + bias->to(dtype).view({1, s.G, Mg, 1, s.K});
  auto attn = torch::softmax(logits, -1);
  auto out = torch::einsum("bgmnk,bgmdnk->bgmnd", {attn, v_sampled});  // [B, G, Mg, N, d]
  return out.permute({0, 3, 1, 2, 4}).reshape({s.B, s.T, s.H, s.W, s.M, s.d}).to(q.scalar_type());
}

const char* to_string(DsaImpl impl) {
  switch (impl) {
    case DsaImpl::kAuto:
      return "auto";
    case DsaImpl::kReference:
      return "reference";
    case DsaImpl::kCpu:
      return "cpu";
    case DsaImpl::kCuda:
      return "cuda";
    case DsaImpl::kCpuTiled:
      return "cpu_tiled";
    case DsaImpl::kCudaTiled:
      return "cuda_tiled";
  }
  return "unknown";
}

DsaImpl resolve_impl(DsaImpl impl, const torch::Device& device) {
  if (impl != DsaImpl::kAuto) return impl;
  // The tiled CPU kernel measured 0.9-1.15x the row kernel's speed (docs/3d-dsa.md): not the default.
  if (device.is_cpu()) return DsaImpl::kCpu;
#ifdef MEGASLIDE_WITH_CUDA
  if (device.is_cuda()) return DsaImpl::kCudaTiled;
#endif
  return DsaImpl::kReference;
}

namespace detail {
namespace {
std::atomic<bool> poison_outputs_flag{false};
}  // namespace
void dsa3d_set_poison_outputs(bool on) { poison_outputs_flag = on; }
bool dsa3d_poison_outputs() { return poison_outputs_flag; }
}  // namespace detail

namespace {

// ---- fused path: tensors -> params structs -> backend -------------------------------------------

torch::ScalarType accumulation_dtype(torch::ScalarType t) {
  return t == torch::kDouble ? torch::kDouble : torch::kFloat;
}

detail::DsaDtype backend_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat:
      return detail::DsaDtype::kFloat32;
    case torch::kDouble:
      return detail::DsaDtype::kFloat64;
    case torch::kBFloat16:
      return detail::DsaDtype::kBFloat16;
    case torch::kHalf:
      return detail::DsaDtype::kFloat16;
    default:
      TORCH_CHECK(false, "dsa3d: the fused kernels take float32, float64, bfloat16 or float16 inputs, got ", t);
  }
}

// Shapes of the saved tensors; the kernel is the effective one (already shrunk to the volume).
detail::Dsa3dShape backend_shape(const torch::Tensor& q, const torch::Tensor& offsets, std::array<int64_t, 3> kernel) {
  detail::Dsa3dShape s;
  s.dtype = backend_dtype(q.scalar_type());
  s.B = q.size(0), s.T = q.size(1), s.H = q.size(2), s.W = q.size(3), s.M = q.size(4), s.d = q.size(5);
  s.G = offsets.size(4);
  s.kt = kernel[0], s.kh = kernel[1], s.kw = kernel[2];
  s.K = s.kt * s.kh * s.kw;
  s.scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  return s;
}

#ifdef MEGASLIDE_WITH_CUDA
CUstream_st* current_stream(const torch::Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

bool is_cpu_impl(DsaImpl impl) { return impl == DsaImpl::kCpu || impl == DsaImpl::kCpuTiled; }
bool is_tiled_impl(DsaImpl impl) { return impl == DsaImpl::kCpuTiled || impl == DsaImpl::kCudaTiled; }

void run_forward(DsaImpl impl, const detail::Dsa3dForwardParams& p, const torch::Tensor& q) {
  if (impl == DsaImpl::kCpu) return detail::dsa3d_forward_cpu(p);
  if (impl == DsaImpl::kCpuTiled) return detail::dsa3d_forward_cpu_tiled(p);
#ifdef MEGASLIDE_WITH_CUDA
  const c10::cuda::CUDAGuard guard(q.device());
  if (impl == DsaImpl::kCudaTiled) return detail::dsa3d_forward_cuda_tiled(p, current_stream(q));
  return detail::dsa3d_forward_cuda(p, current_stream(q));
#else
  TORCH_CHECK(false, "dsa3d: this build has no CUDA kernels (nvcc was not found when it was configured)");
#endif
}

void run_backward(DsaImpl impl, const detail::Dsa3dBackwardParams& p, const torch::Tensor& q) {
  if (impl == DsaImpl::kCpu) return detail::dsa3d_backward_cpu(p);
  if (impl == DsaImpl::kCpuTiled) return detail::dsa3d_backward_cpu_tiled(p);
#ifdef MEGASLIDE_WITH_CUDA
  const c10::cuda::CUDAGuard guard(q.device());
  if (impl == DsaImpl::kCudaTiled) return detail::dsa3d_backward_cuda_tiled(p, current_stream(q));
  return detail::dsa3d_backward_cuda(p, current_stream(q));
#else
  TORCH_CHECK(false, "dsa3d: this build has no CUDA kernels (nvcc was not found when it was configured)");
#endif
}

void poison(const std::vector<torch::Tensor>& outputs) {
  if (!detail::dsa3d_poison_outputs()) return;
  for (const auto& t : outputs) t.fill_(std::numeric_limits<double>::quiet_NaN());
}

// Autograd for the fused kernels. Saves q, k, v, offsets, bias, out and the log-sum-exp only.
class FusedDsa3d : public torch::autograd::Function<FusedDsa3d> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_in,
                               const torch::Tensor& k_in, const torch::Tensor& v_in, const torch::Tensor& offsets,
                               const std::optional<torch::Tensor>& bias_in, int64_t kt, int64_t kh, int64_t kw,
                               bool deterministic, int64_t impl) {
    // An absent bias travels as an empty optional (autograd cannot take an undefined tensor input).
    const torch::Tensor bias = bias_in ? *bias_in : torch::Tensor();
    const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const auto acc = accumulation_dtype(q.scalar_type());
    const auto offsets_acc = offsets.to(acc).contiguous();
    const auto bias_acc = bias.defined() ? bias.to(acc).contiguous() : torch::Tensor();
    auto out = torch::empty_like(q);
    auto lse = torch::empty({q.size(0), q.size(1), q.size(2), q.size(3), q.size(4)}, q.options().dtype(acc));

    detail::Dsa3dForwardParams p;
    p.shape = backend_shape(q, offsets, {kt, kh, kw});
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
    p.offsets = offsets_acc.data_ptr();
    p.bias = bias_acc.defined() ? bias_acc.data_ptr() : nullptr;
    p.out = out.data_ptr(), p.lse = lse.data_ptr();
    poison({out, lse});
    run_forward(static_cast<DsaImpl>(impl), p, q);

    ctx->save_for_backward({q, k, v, offsets, bias, out, lse});
    ctx->saved_data["kernel"] = std::vector<int64_t>{kt, kh, kw};
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["impl"] = impl;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &offsets = saved[3], &bias = saved[4], &out = saved[5],
               &lse = saved[6];
    const auto kernel = ctx->saved_data["kernel"].toIntVector();
    const bool deterministic = ctx->saved_data["deterministic"].toBool();
    const auto impl = static_cast<DsaImpl>(ctx->saved_data["impl"].toInt());
    const auto acc = accumulation_dtype(q.scalar_type());

    auto dout = grad_outputs[0].defined() ? grad_outputs[0].to(q.scalar_type()).contiguous() : torch::zeros_like(q);
    const auto offsets_acc = offsets.to(acc).contiguous();
    const auto bias_acc = bias.defined() ? bias.to(acc).contiguous() : torch::Tensor();
    auto dq = torch::empty_like(q);
    auto dk = torch::zeros(q.sizes(), q.options().dtype(acc));
    auto dv = torch::zeros(q.sizes(), q.options().dtype(acc));
    detail::Dsa3dBackwardParams p;
    p.shape = backend_shape(q, offsets, {kernel[0], kernel[1], kernel[2]});
    // The tiled CUDA kernel runs each head in its own block: a group's d(offsets) is summed over its
    // heads, by atomics into zeros (default mode) or through per-head partials (deterministic mode).
    p.doffsets_accumulated =
        impl == DsaImpl::kCudaTiled && detail::dsa3d_cuda_tiled_accumulates_doffsets(p.shape, deterministic);
    auto doffsets = p.doffsets_accumulated ? torch::zeros(offsets.sizes(), offsets.options().dtype(acc))
                                           : torch::empty(offsets.sizes(), offsets.options().dtype(acc));
    auto dbias = bias.defined() ? torch::zeros(bias.sizes(), bias.options().dtype(acc)) : torch::Tensor();
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
    p.offsets = offsets_acc.data_ptr();
    p.bias = bias_acc.defined() ? bias_acc.data_ptr() : nullptr;
    p.out = out.data_ptr(), p.lse = lse.data_ptr(), p.dout = dout.data_ptr();
    p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr(), p.doffsets = doffsets.data_ptr();
    p.dbias = dbias.defined() ? dbias.data_ptr() : nullptr;
    p.deterministic = deterministic;
    torch::Tensor prob_scratch, dlogit_scratch;
    if (deterministic && impl == DsaImpl::kCuda) {
      std::vector<int64_t> sizes(q.sizes().begin(), q.sizes().end() - 1);
      sizes.push_back(p.shape.K);
      prob_scratch = torch::empty(sizes, q.options().dtype(acc));
      dlogit_scratch = torch::empty(sizes, q.options().dtype(acc));
      p.prob_scratch = prob_scratch.data_ptr();
      p.dlogit_scratch = dlogit_scratch.data_ptr();
    }
    poison({dq});
    if (!p.doffsets_accumulated) poison({doffsets});
    if (is_tiled_impl(impl) && deterministic) {
      // The bound of every tile's halo, for the colours of the ordered dK/dV merge (on a GPU, one
      // device-to-host copy; deterministic mode only).
      const auto bound = offsets_acc.abs().amax({0, 1, 2, 3, 4, 5}).to(torch::kCPU, torch::kDouble);
      for (int a = 0; a < 3; ++a) p.offset_bound[a] = bound[a].item<double>();
    }
    torch::Tensor offset_scratch;
    if (impl == DsaImpl::kCudaTiled && detail::dsa3d_cuda_tiled_needs_offset_scratch(p.shape, deterministic)) {
      offset_scratch = torch::empty({p.shape.B * p.shape.tokens() * p.shape.M * p.shape.K * 3}, q.options().dtype(acc));
      p.offset_scratch = offset_scratch.data_ptr();
    }
    torch::Tensor tile_scratch;
    if (impl == DsaImpl::kCudaTiled && bias.defined()) {
      tile_scratch =
          torch::empty({q.size(0) * detail::dsa3d_tile_count(p.shape), p.shape.M, p.shape.K}, q.options().dtype(acc));
      p.tile_scratch = tile_scratch.data_ptr();
    }
    torch::Tensor cpu_scratch;
    if (is_cpu_impl(impl)) {
      p.cpu_chunks = deterministic ? 1 : std::max<int64_t>(1, at::get_num_threads());
      const int64_t elements = detail::dsa3d_cpu_scratch_elements(p.shape, deterministic, p.cpu_chunks);
      if (elements > 0) {
        cpu_scratch = torch::zeros({elements}, q.options().dtype(acc));
        p.cpu_scratch = cpu_scratch.data_ptr();
      }
    }
    run_backward(impl, p, q);

    return {dq,
            dk.to(q.scalar_type()),
            dv.to(q.scalar_type()),
            doffsets.to(offsets.scalar_type()),
            dbias.defined() ? dbias.to(bias.scalar_type()) : torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor dsa3d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& offsets, const std::optional<torch::Tensor>& bias,
                    std::array<int64_t, 3> kernel, DsaImpl impl, bool deterministic) {
  const Shapes s = check_inputs(q, k, v, offsets, bias, kernel);
  DsaImpl chosen = resolve_impl(impl, q.device());
  // kAuto never fails where the reference works: what the tiled CUDA kernel does not run goes to the
  // row kernel, head sizes the row kernel lacks to the reference.
  if (impl == DsaImpl::kAuto && chosen == DsaImpl::kCudaTiled) {
    const bool half = q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf;
    bool runs = half && s.T * s.H * s.W < (int64_t{1} << 31);
#ifdef MEGASLIDE_WITH_CUDA
    runs =
        runs && detail::dsa3d_cuda_tiled_unsupported(backend_shape(q, offsets, s.kernel), q.device().index()).empty();
#endif
    if (!runs) chosen = DsaImpl::kCuda;
  }
  if (impl == DsaImpl::kAuto && chosen == DsaImpl::kCuda && s.d > detail::kCudaMaxHeadDim) chosen = DsaImpl::kReference;
  if (chosen == DsaImpl::kReference) return dsa3d_reference(q, k, v, offsets, bias, kernel);

  TORCH_CHECK(chosen == DsaImpl::kCpu || chosen == DsaImpl::kCuda || is_tiled_impl(chosen),
              "dsa3d: unknown implementation ", static_cast<int>(impl));
  const char* name = to_string(chosen);
  if (is_cpu_impl(chosen)) {
    TORCH_CHECK(q.device().is_cpu(), "dsa3d: impl '", name, "' needs CPU tensors, got q on ", q.device());
  } else {
#ifndef MEGASLIDE_WITH_CUDA
    TORCH_CHECK(false, "dsa3d: impl '", name,
                "' is not available: this build has no CUDA kernels (nvcc was not "
                "found when it was configured); use 'auto' or 'reference'");
#endif
    TORCH_CHECK(q.device().is_cuda(), "dsa3d: impl '", name, "' needs CUDA tensors, got q on ", q.device());
    TORCH_CHECK(s.d <= detail::kCudaMaxHeadDim, "dsa3d: impl 'cuda' supports head sizes d <= ", detail::kCudaMaxHeadDim,
                ", got d = ", s.d);
  }
  if (is_tiled_impl(chosen))
    TORCH_CHECK(s.T * s.H * s.W < (int64_t{1} << 31), "dsa3d: impl '", name, "' indexes tokens in int32; the volume ",
                s.T, "x", s.H, "x", s.W, " has too many");
#ifdef MEGASLIDE_WITH_CUDA
  if (chosen == DsaImpl::kCudaTiled) {
    const std::string why =
        detail::dsa3d_cuda_tiled_unsupported(backend_shape(q, offsets, s.kernel), q.device().index());
    TORCH_CHECK(why.empty(), "dsa3d: impl 'cuda_tiled' cannot run this shape: ", why);
  }
#endif
  backend_dtype(q.scalar_type());  // rejects dtypes the kernels do not take, with a message
  TORCH_CHECK(s.T >= 1 && s.H >= 1 && s.W >= 1 && s.M >= 1 && s.d >= 1,
              "dsa3d: the volume, heads and head size must be non-empty, got q ", q.sizes());
  if (bias) TORCH_CHECK(bias->is_floating_point(), "dsa3d: bias must be floating point, got ", bias->scalar_type());
  return FusedDsa3d::apply(q, k, v, offsets, bias, s.kernel[0], s.kernel[1], s.kernel[2], deterministic,
                           static_cast<int64_t>(chosen));
}

}  // namespace megaslide::ops
