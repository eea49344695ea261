#include "megaslide/attention/dsa3d.h"

#include <cmath>

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

Shapes check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& offsets,
                    const std::optional<torch::Tensor>& bias, std::array<int64_t, 3> kernel) {
  TORCH_CHECK(q.dim() == 6, "dsa3d: q must be [B, T, H, W, M, d], got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "dsa3d: k ", k.sizes(), " and v ", v.sizes(),
              " must have q's shape ", q.sizes());
  TORCH_CHECK(q.is_floating_point(), "dsa3d: q, k, v must be floating point, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "dsa3d: q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
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
  // centres) in (x, y, z) = (w, h, t) order; an axis of length 1 maps everything to its only token.
  auto scale = torch::tensor({s.T > 1 ? 2.0 / (s.T - 1) : 0.0, s.H > 1 ? 2.0 / (s.H - 1) : 0.0,
                              s.W > 1 ? 2.0 / (s.W - 1) : 0.0},
                             off.options());
  auto grid = (positions * scale - 1.0).flip({-1});                          // [B, T, H, W, G, K, 3]
  grid = grid.permute({0, 4, 1, 2, 3, 5, 6}).reshape({s.B * s.G, N, s.K, 1, 3}).to(dtype);

  // Feature maps per group: [B*G, Mg*d, T, H, W].
  auto as_volume = [&](const torch::Tensor& x) {
    return x.reshape({s.B, s.T, s.H, s.W, s.G, Mg * s.d}).permute({0, 4, 5, 1, 2, 3}).reshape({s.B * s.G, Mg * s.d, s.T, s.H, s.W});
  };
  auto sample = [&](const torch::Tensor& x) {
    auto y = torch::grid_sampler(as_volume(x.to(dtype)), grid, /*bilinear*/ 0, /*border*/ 1, /*align_corners*/ true);
    return y.view({s.B, s.G, Mg, s.d, N, s.K});  // N·K·d per head: the reference's memory cost
  };
  auto k_sampled = sample(k), v_sampled = sample(v);

  auto qg = q.to(dtype).reshape({s.B, N, s.G, Mg, s.d}).permute({0, 2, 3, 1, 4});     // [B, G, Mg, N, d]
  auto logits = torch::einsum("bgmnd,bgmdnk->bgmnk", {qg, k_sampled}) / std::sqrt(static_cast<double>(s.d));
  if (bias) logits = logits + bias->to(dtype).view({1, s.G, Mg, 1, s.K});
  auto attn = torch::softmax(logits, -1);
  auto out = torch::einsum("bgmnk,bgmdnk->bgmnd", {attn, v_sampled});       // [B, G, Mg, N, d]
  return out.permute({0, 3, 1, 2, 4}).reshape({s.B, s.T, s.H, s.W, s.M, s.d}).to(q.scalar_type());
}

torch::Tensor dsa3d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& offsets,
                    const std::optional<torch::Tensor>& bias, std::array<int64_t, 3> kernel, DsaImpl impl) {
  switch (impl) {
    case DsaImpl::kAuto:
    case DsaImpl::kReference:
      return dsa3d_reference(q, k, v, offsets, bias, kernel);
  }
  TORCH_CHECK(false, "dsa3d: unknown implementation");
}

}  // namespace megaslide::ops
