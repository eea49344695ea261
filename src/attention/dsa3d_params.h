// The backend interface of the fused 3D-DSA kernels: plain structs of pointers and sizes, no
// at::Tensor. The API layer (src/attention/dsa3d.cpp) checks shapes, dtypes and devices, makes every
// tensor contiguous, allocates outputs and accumulators, and calls one of the functions below.
//
// Layouts (all contiguous, row-major):
//   q, k, v, out, dout, dq     [B, T, H, W, M, d]   in `dtype`
//   dk, dv                     [B, T, H, W, M, d]   in acc_t (float, or double for float64), zeroed
//   offsets, doffsets          [B, T, H, W, G, K, 3] in acc_t (doffsets: written, not accumulated)
//   bias, dbias                [M, K]               in acc_t; bias may be null (then dbias is null);
//                                                   dbias is accumulated (zeroed by the caller)
//   lse                        [B, T, H, W, M]      in acc_t
// (kt, kh, kw) is the effective kernel (every size <= its axis), K = kt·kh·kw.
#pragma once

#include <cstdint>
#include <string>

#include "dsa3d_math.h"  // MEGASLIDE_HD

struct CUstream_st;  // cudaStream_t without the CUDA headers (same declaration as driver_types.h)

namespace megaslide::ops::detail {

enum class DsaDtype { kFloat32, kFloat64, kBFloat16, kFloat16 };

// The one dtype dispatch of every backend: f(scalar_t{}, acc_t{}) with the storage type of `dtype` and
// its accumulation type (float, or double for float64). The 16-bit storage types are the backend's:
// c10::BFloat16 and c10::Half on the CPU, __nv_bfloat16 and __half on the GPU (kernels/dsa3d_cuda.cuh).
template <typename BFloat16, typename Half, typename F>
void dispatch_dtype(DsaDtype dtype, F&& f) {
  switch (dtype) {
    case DsaDtype::kFloat32:
      return f(float{}, float{});
    case DsaDtype::kFloat64:
      return f(double{}, double{});
    case DsaDtype::kBFloat16:
      return f(BFloat16{}, float{});
    case DsaDtype::kFloat16:
      return f(Half{}, float{});
  }
}

struct Dsa3dShape {
  DsaDtype dtype = DsaDtype::kFloat32;
  int64_t B = 0, T = 0, H = 0, W = 0, M = 0, d = 0, G = 0;
  int64_t kt = 0, kh = 0, kw = 0, K = 0;
  double scale = 1.0;  // 1/sqrt(d)
  MEGASLIDE_HD int64_t tokens() const { return T * H * W; }
};

struct Dsa3dForwardParams {
  Dsa3dShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* offsets = nullptr;
  const void* bias = nullptr;  // optional
  void* out = nullptr;
  void* lse = nullptr;
};

struct Dsa3dBackwardParams {
  Dsa3dShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* offsets = nullptr;
  const void* bias = nullptr;  // optional
  const void* out = nullptr;
  const void* lse = nullptr;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;  // accumulated (must be zero on entry)
  void* dv = nullptr;  // accumulated (must be zero on entry)
  void* doffsets = nullptr;
  void* dbias = nullptr;  // written; null when bias is null
  // Bit-identical results whatever the thread count or scheduling (docs/3d-dsa.md, "Determinism").
  bool deterministic = false;
  // CUDA deterministic mode only: [B, T, H, W, M, K] acc_t scratch for the per-sample probabilities
  // and logit gradients (allocated by the API layer; null otherwise).
  void* prob_scratch = nullptr;
  void* dlogit_scratch = nullptr;
  // CPU only: the tokens (tiled kernel: the tiles) are cut into cpu_chunks chunks run in parallel
  // (default mode), and cpu_scratch holds dsa3d_cpu_scratch_elements() zeroed acc_t for the partial
  // sums (null when that is 0).
  int64_t cpu_chunks = 1;
  void* cpu_scratch = nullptr;
  // Tiled kernels, deterministic mode: max |offsets| per axis (t, h, w), which bounds every tile's
  // halo; it sets the tile colours of the ordered dK/dV merge. A NaN or infinite bound means
  // "unbounded" (one tile per colour: correct and serial).
  double offset_bound[3] = {0, 0, 0};
  // CUDA tiled only: [B · tiles, M, K] acc_t for the per-tile dbias partials (null when bias is null).
  void* tile_scratch = nullptr;
  // CUDA tiled only, where a group has several heads (G < M): each head is its own block, so the
  // group's d(offsets) is a sum over its heads. Default mode: accumulated by atomics into doffsets
  // (which must then be zero on entry, `doffsets_accumulated`). Deterministic mode: [B, N, M, K, 3]
  // acc_t per-head partials here, summed in head order by a second kernel (null otherwise).
  bool doffsets_accumulated = false;
  void* offset_scratch = nullptr;
};

// CUDA tiled backward: how d(offsets) is summed over the heads of a group (see offset_scratch).
inline bool dsa3d_cuda_tiled_accumulates_doffsets(const Dsa3dShape& s, bool deterministic) {
  return !deterministic && s.G < s.M;
}
inline bool dsa3d_cuda_tiled_needs_offset_scratch(const Dsa3dShape& s, bool deterministic) {
  return deterministic && s.G < s.M;
}

// acc_t elements of CPU backward scratch. Default mode: (chunks - 1) · (2·B·N·M·d + M·K), the dk, dv
// and dbias partials of every chunk but the first (which accumulates into the outputs). Deterministic
// mode: (B - 1) · M·K, the dbias partials of every batch entry but the first.
inline int64_t dsa3d_cpu_scratch_elements(const Dsa3dShape& s, bool deterministic, int64_t chunks) {
  const int64_t bias = s.M * s.K;
  if (deterministic) return s.B > 1 ? (s.B - 1) * bias : 0;
  return (chunks - 1) * (2 * s.B * s.tokens() * s.M * s.d + bias);
}

// Testing aid: while on, the API fills the outputs a backend must write in full (out, lse, dq,
// d(offsets)) with NaN before calling it, so an element a kernel never writes shows up as NaN.
void dsa3d_set_poison_outputs(bool on);
bool dsa3d_poison_outputs();

// CPU backend (src/attention/dsa3d_cpu.cpp): at::parallel_for over tokens. A group's heads × d channels from which
// the backward and the forward read each distinct corner row once per (token, group) instead of once per sample
// and corner (the loops by distinct corner row); fewer channels run the per-sample loops.
constexpr int64_t kCpuBackwardRowsMinChannels = 64;
constexpr int64_t kCpuForwardRowsMinChannels = 128;
void dsa3d_forward_cpu(const Dsa3dForwardParams& p);

void dsa3d_backward_cpu(const Dsa3dBackwardParams& p);

// The instruction set the fused CPU kernels (dsa3d_forward_cpu, dsa3d_backward_cpu) run their loops with:
// the widest CPUID allows unless forced. Forcing one this CPU lacks throws; kAuto restores CPUID's choice.
// Tests force each in turn; every path is checked against the same reference. kAvx512Bf16: the AVX-512 loops, with
// bfloat16 inputs taking each head's q·k and dout·v of the distinct corner rows (the loops by row) as bf16 pairs
// summed by VDPBF16PS; other dtypes and the per-sample loops run the AVX-512 loops unchanged.
enum class Dsa3dCpuIsa { kAuto, kBaseline, kAvx2, kAvx512, kAvx512Bf16 };
void set_dsa3d_cpu_isa(Dsa3dCpuIsa isa);
Dsa3dCpuIsa dsa3d_cpu_isa();  // the one in use, never kAuto
// The loops inputs of `dtype` run on: dsa3d_cpu_isa(), except kAvx512 for kAvx512Bf16 with any but bf16 inputs (the
// same loops there). What logs and benchmarks name.
Dsa3dCpuIsa dsa3d_cpu_loops(DsaDtype dtype);
const char* to_string(Dsa3dCpuIsa isa);
// x[i] = e^x[i] as the fused CPU forward takes its softmax numerators on the instruction set in use (fp32: vectors of
// samples, within about 1 ulp of expf; 0 below -87, NaN for NaN). For tests.
void dsa3d_cpu_exp(float* x, int64_t n);
// The trilinear sample at the unclamped position (xt, xh, xw) of a T×H×W volume as the fused CPU backward computes it
// on the instruction set in use (AVX2, AVX-512: a sample's corners in vector lanes): dsa3d_math::trilinear_sample's
// bits. For tests.
void dsa3d_cpu_sample(float xt, float xh, float xw, int64_t T, int64_t H, int64_t W, dsa3d_math::Sample<float>& out);

// CUDA backend (kernels/dsa3d.cu), compiled when MEGASLIDE_WITH_CUDA: launches on `stream`, checks
// every launch. Head size d <= kCudaMaxHeadDim.
constexpr int64_t kCudaMaxHeadDim = 256;
void dsa3d_forward_cuda(const Dsa3dForwardParams& p, CUstream_st* stream);
void dsa3d_backward_cuda(const Dsa3dBackwardParams& p, CUstream_st* stream);

// Tiled kernels (docs/3d-dsa.md, "Tiled kernels"; the shared math is attention/dsa3d_tile.h).
// CPU twin (src/attention/dsa3d_tiled_cpu.cpp): any shape the API accepts.
void dsa3d_forward_cpu_tiled(const Dsa3dForwardParams& p);
void dsa3d_backward_cpu_tiled(const Dsa3dBackwardParams& p);
// Tiles of the tile grid of a shape (the first dimension of tile_scratch is B · tiles).
int64_t dsa3d_tile_count(const Dsa3dShape& s);

// CUDA (kernels/dsa3d_tiled.cu): tensor cores for bfloat16/float16, CUDA cores for float32/float64
// (the same tile algorithm, exact enough to test it in float64). Head size d <= kCudaTiledMaxHeadDim.
constexpr int64_t kCudaTiledMaxHeadDim = 128;
// Empty when the tiled CUDA kernels can run `s` on `device`; otherwise why not, naming the limit
// (head size, or the shared memory the K-sized tables need against the device's limit).
std::string dsa3d_cuda_tiled_unsupported(const Dsa3dShape& s, int device);
void dsa3d_forward_cuda_tiled(const Dsa3dForwardParams& p, CUstream_st* stream);
void dsa3d_backward_cuda_tiled(const Dsa3dBackwardParams& p, CUstream_st* stream);

}  // namespace megaslide::ops::detail
