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
//   m  = fma(g, one_minus_beta1, m_old * beta1)
//   v  = fma(one_minus_beta2 * g, g, v_old * beta2)
//   u  = sqrt(v)
//   d  = u / sqrt_bias_correction2 + eps
//   p  = p + (neg_step_size * m) / d              neg_step_size = -lr / bias_correction1
//   compute[i] = round_to_nearest_even(p)         bf16 or fp16, NaN kept (c10's bit patterns)
//
// The moments are stored in one of three state types (AdamWKernelParams::state_type):
//   kFloat32   m_old = exp_avg[i], v_old = exp_avg_sq[i]; m and v stored as they are.
//   kBFloat16  m_old, v_old widened from bf16 (exact); m and v stored rounded to nearest even.
//   kInt8      block-wise quantised in groups of kQuantGroup elements; group q covers elements
//              [q·kQuantGroup, (q+1)·kQuantGroup) counted from element 0 of the arrays (the last group
//              of the arrays may be shorter), with one fp32 scale per group and moment:
//                m: int8 codes in [-127, 127],  m_old = float(code) * exp_avg_scale[q]
//                v: its square root as uint8 codes in [0, 255] (unsigned: v >= 0; the root halves the
//                   dynamic range 8 bits must cover, and the step needs sqrt(v) anyway),
//                   u_old = float(code) * exp_avg_sq_scale[q],  v_old = u_old * u_old
//              After the group's elements are updated (each with its exact new m and v, as above), the
//              group is re-quantised from amax_m = max |m| and amax_u = max u over the group:
//                scale_m = amax_m / 127,  code = clamp(rint(m * (127 / amax_m)), -127, 127)
//                scale_u = amax_u / 255,  code = clamp(rint(u * (255 / amax_u)), 0, 255), and at least
//                                         1 where u > 0 (a nonzero v is never stored as 0, which would
//                                         leave eps alone in the next step's denominator)
//              (codes 0 and scale 0 when the amax is 0; rint rounds to nearest even). The maxima are
//              exact and the per-group scalars are computed by the same fp32 operations in every path.
//              A range handed to a kernel must start on a group boundary (begin % kQuantGroup == 0).
// The gradient may be the compute copy itself (grad == compute, same 16-bit dtype): every path reads
// an element's gradient before it writes that element's copy.
#pragma once

#include "util/cpu_features.h"
#include <cstdint>
#include <type_traits>

namespace megaslide::offload::detail {

enum class GradType : int { kFloat32, kBFloat16, kFloat16 };
enum class ComputeType : int { kNone, kBFloat16, kFloat16 };
enum class StateType : int { kFloat32, kBFloat16, kInt8 };

// Elements per quantisation group of kInt8 state (one fp32 scale per group and moment).
constexpr int64_t kQuantGroup = 256;

struct AdamWKernelParams {
  float* master = nullptr;
  void* exp_avg = nullptr;            // float, bf16 bits or int8 codes (state_type)
  void* exp_avg_sq = nullptr;         // float, bf16 bits or uint8 codes of sqrt(v)
  float* exp_avg_scale = nullptr;     // kInt8: one per group
  float* exp_avg_sq_scale = nullptr;  // kInt8: one per group
  StateType state_type = StateType::kFloat32;
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

// Updates elements [begin, end) of the arrays in `p`. Any split of [0, numel) (on group boundaries for
// kInt8 state) gives the same bits: no element's result depends on another element outside its group
// or on where a range starts.
void adamw_scalar(const AdamWKernelParams& p, int64_t begin, int64_t end);
void adamw_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end);
void adamw_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end);

// The memory roofline for AdamW's access pattern: reads and rewrites master, exp_avg and exp_avg_sq
// (in their state type, kInt8 with its group scales) in place, reads the 16-bit gradient and writes the
// 16-bit compute copy, with one add per array (x += g * grad_scale, through fp32 for narrow state;
// grad_scale = 0 leaves the data as it was). Same bytes as adamw_*, none of its arithmetic. Requires
// grad_type and compute_type to be 16-bit.
void stream_probe_scalar(const AdamWKernelParams& p, int64_t begin, int64_t end);
void stream_probe_avx2(const AdamWKernelParams& p, int64_t begin, int64_t end);
void stream_probe_avx512(const AdamWKernelParams& p, int64_t begin, int64_t end);

// The instruction sets each kernel needs (util/cpu_features.h).
using megaslide::cpu_has_amx_bf16;
using megaslide::cpu_has_avx2;
using megaslide::cpu_has_avx512;
using megaslide::cpu_has_avx512_bf16;

// Exact scalar conversions shared by the scalar kernel and the vector kernels' definitions of
// rounding. bf16 rounding is c10::BFloat16's (nearest even; NaN -> 0x7FC0); fp16 rounding is
// c10::Half's software path (nearest even, subnormals kept; NaN -> sign | 0x7E00).
uint16_t float_to_bf16_bits(float f);
uint16_t float_to_fp16_bits(float f);
float bf16_bits_to_float(uint16_t h);
float fp16_bits_to_float(uint16_t h);

// Calls fn(G{}, C{}, S{}) with std::integral_constant tags for the run-time types in p, so a kernel's
// per-element loop carries no branch on them:
//   dispatch(p, [&](auto g, auto c, auto s) { kernel<g.value, c.value, s.value>(p, begin, end); });
template <typename Fn>
inline void dispatch(const AdamWKernelParams& p, Fn&& fn) {
  using std::integral_constant;
  const auto with_state = [&](auto g, auto c) {
    switch (p.state_type) {
      case StateType::kFloat32:
        return fn(g, c, integral_constant<StateType, StateType::kFloat32>{});
      case StateType::kBFloat16:
        return fn(g, c, integral_constant<StateType, StateType::kBFloat16>{});
      default:
        return fn(g, c, integral_constant<StateType, StateType::kInt8>{});
    }
  };
  const auto with_compute = [&](auto g) {
    switch (p.compute_type) {
      case ComputeType::kNone:
        return with_state(g, integral_constant<ComputeType, ComputeType::kNone>{});
      case ComputeType::kBFloat16:
        return with_state(g, integral_constant<ComputeType, ComputeType::kBFloat16>{});
      default:
        return with_state(g, integral_constant<ComputeType, ComputeType::kFloat16>{});
    }
  };
  switch (p.grad_type) {
    case GradType::kFloat32:
      return with_compute(integral_constant<GradType, GradType::kFloat32>{});
    case GradType::kBFloat16:
      return with_compute(integral_constant<GradType, GradType::kBFloat16>{});
    default:
      return with_compute(integral_constant<GradType, GradType::kFloat16>{});
  }
}

}  // namespace megaslide::offload::detail
