// Internal interface between CpuAdamW (src/offload/cpu_adamw.cpp) and its per-ISA kernels.
//
// The kernels see plain pointers and floats only: the files that define them are compiled with
// per-file ISA flags (-mavx512f ..., -mavx2 ...) and must not include LibTorch headers, whose inline
// functions would otherwise be emitted with AVX-512 code and could be picked by the linker for
// callers on machines without it (an ODR violation that crashes only on old CPUs).
//
// Every kernel applies, per element i in [begin, end), exactly this sequence of fp32 operations,
// so every path gives the same bits. It is LibTorch's AdamW (torch/csrc/api/src/optim/adamw.cpp) as
// its CPU kernels execute it: exp_avg.mul_(beta1).add_(grad, 1 - beta1) and
// exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2) each end in one fused multiply-add there, so
// they do here, which makes m and v bit-identical to LibTorch's (docs/cpu-adamw.md):
//   g  = float(grad[i]) * grad_scale
//   p  = master[i] * decay                        decay = 1 - lr * weight_decay
//   m  = fma(g, one_minus_beta1, exp_avg[i] * beta1)
//   v  = fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2)
//   d  = sqrt(v) / sqrt_bias_correction2 + eps
//   p  = p + (neg_step_size * m) / d              neg_step_size = -lr / bias_correction1
//   compute[i] = round_to_nearest_even(p)         bf16 or fp16, NaN kept (c10's bit patterns)
#pragma once

#include <cstdint>

namespace megaslide::offload::detail {

enum class GradType : int { kFloat32, kBFloat16, kFloat16 };
enum class ComputeType : int { kNone, kBFloat16, kFloat16 };

struct AdamWKernelParams {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;
  GradType grad_type = GradType::kFloat32;
  void* compute = nullptr;  // may be null when compute_type == kNone
  ComputeType compute_type = ComputeType::kNone;
  int64_t numel = 0;
  // Write the compute copy with non-temporal (streaming) stores where it is 32-byte aligned: on a
  // block far larger than the caches nobody reads the copy before it is evicted, and a streaming
  // store skips the read-for-ownership an ordinary store pays (2 of the 28 B per parameter).
  bool stream_compute = false;

  float grad_scale = 1.f;
  float decay = 1.f;
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float sqrt_bias_correction2 = 1.f;
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;
};

// Updates elements [begin, end) of the arrays in `p`. Any split of [0, numel) gives the same bits:
// no element's result depends on another element or on where a range starts.
void adamw_scalar(const AdamWKernelParams& p, int64_t begin, int64_t end);
void adamw_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end);
void adamw_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end);

// The memory roofline for AdamW's access pattern: reads and rewrites master, exp_avg and exp_avg_sq
// in place, reads the 16-bit gradient and writes the 16-bit compute copy, with one add per array
// (x += g * grad_scale; grad_scale = 0 leaves the data as it was). Same bytes as adamw_*, none of its
// arithmetic. Requires grad_type and compute_type to be 16-bit.
void stream_probe_scalar(const AdamWKernelParams& p, int64_t begin, int64_t end);
void stream_probe_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end);
void stream_probe_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end);

// CPUID (and OS register-state) checks for the instruction sets each kernel needs, and the two that say
// the CPU does bf16 arithmetic natively (util/cpu_resources.h's cpu_bf16_support asks these).
bool cpu_has_avx512();       // avx512f + avx512bw + avx512vl
bool cpu_has_avx2();         // avx2 + fma + f16c
bool cpu_has_avx512_bf16();  // cpu_has_avx512() + avx512_bf16 (VCVTNE2PS2BF16, VDPBF16PS)
bool cpu_has_amx_bf16();     // amx-bf16 + amx-tile, tile state enabled by the OS

// Exact scalar conversions shared by the scalar kernel and the vector kernels' definitions of
// rounding. bf16 rounding is c10::BFloat16's (nearest even; NaN -> 0x7FC0); fp16 rounding is
// c10::Half's software path (nearest even, subnormals kept; NaN -> sign | 0x7E00).
uint16_t float_to_bf16_bits(float f);
uint16_t float_to_fp16_bits(float f);
float bf16_bits_to_float(uint16_t h);
float fp16_bits_to_float(uint16_t h);

}  // namespace megaslide::offload::detail

// Calls KERNEL<GradType, ComputeType>(p, begin, end) for the run-time types in p: the types are
// template parameters so the per-element loop carries no branch on them.
#define MEGASLIDE_ADAMW_DISPATCH(KERNEL, p, begin, end)                                   \
  switch (static_cast<int>(p.grad_type) * 3 + static_cast<int>(p.compute_type)) {         \
    case 0: return KERNEL<GradType::kFloat32, ComputeType::kNone>(p, begin, end);         \
    case 1: return KERNEL<GradType::kFloat32, ComputeType::kBFloat16>(p, begin, end);     \
    case 2: return KERNEL<GradType::kFloat32, ComputeType::kFloat16>(p, begin, end);      \
    case 3: return KERNEL<GradType::kBFloat16, ComputeType::kNone>(p, begin, end);        \
    case 4: return KERNEL<GradType::kBFloat16, ComputeType::kBFloat16>(p, begin, end);    \
    case 5: return KERNEL<GradType::kBFloat16, ComputeType::kFloat16>(p, begin, end);     \
    case 6: return KERNEL<GradType::kFloat16, ComputeType::kNone>(p, begin, end);         \
    case 7: return KERNEL<GradType::kFloat16, ComputeType::kBFloat16>(p, begin, end);     \
    default: return KERNEL<GradType::kFloat16, ComputeType::kFloat16>(p, begin, end);     \
  }
