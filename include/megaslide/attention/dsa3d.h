// 3D Deformable Slide Attention (3D-DSA), the operator (docs/3d-dsa.md, DESIGN.md §5).
//
// Tokens lie on a T×H×W grid; each query attends to K = kt·kh·kw points sampled from the keys and
// values by trilinear interpolation. Point j of offset group g for the token at p = (t, h, w) is
//     P = clamp(start(p) + r_j + offsets[b, p, g, j], 0, S - 1)        (per axis, t, h, w order)
// where start(p) = clamp(p - ⌊k/2⌋, 0, S - k) places the regular k-window inside the volume (the
// window centre clamped away from the border) and r_j ∈ [0, k) is the j-th regular offset (row-major
// over kt, kh, kw). Integer coordinates are token centres. Then, for head m in group g = m / (M / G),
//     a_j = softmax_j(q · k̃_j / sqrt(d) + bias[m, j]),   out = Σ_j a_j ṽ_j.
// With zero offsets this is non-causal neighbourhood attention (NATTEN's definition).
//
// Kernel larger than the volume: an axis shorter than its kernel size uses a kernel of the axis'
// length (effective_kernel()); offsets and bias then carry that smaller K.
//
// Implementations (DsaImpl), one API: `reference` is stock LibTorch ops with grid_sample and
// materialises the sampled keys and values (N·K·d elements per head), as the paper's code; the fused
// kernels never do (log-sum-exp saved, samples recomputed in the backward; O(N·d) extra memory):
// `cpu` and `cuda` walk each query's samples (online softmax), `cpu_tiled` and `cuda_tiled` work on
// tiles of 16 queries in score space (S = Q·K_haloᵀ and out = P'·V_halo as dense matrix products,
// tensor cores on the GPU for bfloat16/float16; docs/3d-dsa.md). All are differentiable w.r.t. q, k,
// v, offsets and bias; the fused ones through a torch::autograd::Function that saves q, k, v, offsets,
// bias, out and the log-sum-exp (no double backward). Half-precision inputs accumulate in float32.
// `deterministic` makes the fused backward bit-identical across runs and thread counts (slower; see
// docs/3d-dsa.md); the reference ignores it. The tiled forwards are deterministic in both modes; in
// the default mode the tiled backwards add dK, dV per thread (CPU) or with atomics (CUDA).
//
// Gradient conventions (the fused kernels match the reference's autograd): the position of a sample
// gets a gradient only strictly inside the volume, 0 < x < S-1 per axis (torch::clamp passes the
// boundary, grid_sample's border padding does not); at an integer position the trilinear derivative
// is the right difference (floor-based corners, as grid_sample).
//
// Memory: the caller owns every tensor; the result is a new tensor.
// Thread-safety: a pure function; calls on different tensors may run concurrently. CUDA work runs on
// the current LibTorch stream.
#pragma once

#include <torch/types.h>

#include <array>
#include <optional>

namespace megaslide::ops {

enum class DsaImpl {
  kAuto,       // CPU tensors: kCpu. CUDA tensors: kCudaTiled for bfloat16/float16 where it runs
               // (head size d <= 128, its shared-memory tables fit), else kCuda (d <= 256), else the
               // reference (also for CUDA tensors in a build without kernels/, and other devices)
  kReference,  // stock LibTorch ops with grid_sample (differentiable through autograd)
  kCpu,        // fused CPU kernel, one query row at a time (at::parallel_for over tokens)
  kCuda,       // fused CUDA kernel, one warp per query row; builds with MEGASLIDE_WITH_CUDA, d <= 256
  kCpuTiled,   // tiled CPU kernel: the host twin of kCudaTiled
  kCudaTiled,  // tiled CUDA kernel (tensor cores for bfloat16/float16); d <= 128
};

// "auto", "reference", "cpu", "cuda", "cpu_tiled", "cuda_tiled".
const char* to_string(DsaImpl impl);

// The implementation kAuto resolves to for tensors on `device`, before the shape checks above (CUDA:
// kCudaTiled).
DsaImpl resolve_impl(DsaImpl impl, const torch::Device& device);

// The kernel actually used on a T×H×W volume: min(kernel[a], size[a]) per axis.
std::array<int64_t, 3> effective_kernel(std::array<int64_t, 3> kernel, std::array<int64_t, 3> volume);

// Regular (zero-offset) sample positions of every token: [T, H, W, K, 3] (t, h, w), float32.
torch::Tensor dsa3d_base_positions(std::array<int64_t, 3> volume, std::array<int64_t, 3> kernel,
                                   const torch::TensorOptions& options = {});

// q, k, v:  [B, T, H, W, M, d]  (floating point, same dtype and device)
// offsets:  [B, T, H, W, G, K, 3] in token units, (t, h, w) order, G divides M
// bias:     [M, K] relative-position bias, or nullopt
// kernel:   (kt, kh, kw), odd sizes; shrinks per axis to the volume (see above)
// returns   [B, T, H, W, M, d] in q's dtype
torch::Tensor dsa3d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& offsets, const std::optional<torch::Tensor>& bias,
                    std::array<int64_t, 3> kernel, DsaImpl impl = DsaImpl::kAuto, bool deterministic = false);

// The grid_sample implementation, for tests and as the autograd reference.
torch::Tensor dsa3d_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& offsets, const std::optional<torch::Tensor>& bias,
                              std::array<int64_t, 3> kernel);

}  // namespace megaslide::ops
