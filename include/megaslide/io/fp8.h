// 8-bit floating-point (fp8) base weights: the storage format of the fp8 checkpoints people download
// (ComfyUI's *_fp8_e4m3fn.safetensors and *_fp8_scaled.safetensors) and the one a frozen base may be
// held in to halve what is streamed. Only the format lives here: quantizing a weight and turning it back
// into a floating tensor; matrix products stay in bf16/fp32 on the dequantized weight.
//
// An Fp8Tensor is `data` (float8_e4m3fn, the weight's shape) and `scale` (a float32 scalar):
// weight = data × scale. Two scalings, the two kinds of published file:
//   - kNone: the plain cast data = w.to(float8_e4m3fn), scale 1 (ComfyUI's *_fp8_e4m3fn files). Exactly
//     PyTorch's cast (c10's): round to nearest even; 448 is the largest finite value, |w| in (448, 464]
//     rounds to ±448 and |w| > 464, ±inf and NaN become NaN (e4m3fn has no infinity); below 2^-6 the
//     subnormals k × 2^-9, so |w| ≤ 2^-10 becomes ±0. Weights of a few 1e-3, common in video DiTs, keep
//     only one or two significant bits: per-tensor scaling is the precise format.
//   - kPerTensor: ComfyUI's (comfy/quant_ops.py TensorCoreFP8Layout.quantize, its *_fp8_scaled files):
//     scale = amax|w| / 448 computed in w's dtype and kept as float32, data = (w × (1 / scale) in w's dtype)
//     cast as above, bit for bit what ComfyUI computes for float32, bf16 and float64 weights. Two departures,
//     both where ComfyUI's recipe breaks: fp16 weights are quantized as their float32 values (in fp16 the
//     reciprocal overflows once amax|w| < 448 / 65504 ≈ 0.0068), and an all-zero weight (amax 0, or so small
//     that 1 / scale overflows) gets scale 1 instead of NaNs.
// dequantize_fp8 is data.to(float32) × scale, then cast to the asked dtype (one rounding for bf16/fp16).
// ComfyUI's own scaled Linear multiplies in the compute dtype (bf16 × bf16-rounded scale): its weights
// differ from these by at most a bf16 rounding of the scale (2^-9 relative).
//
// Memory: every function returns fresh tensors on the input's device, owned by the caller; nothing is
// cached. Thread-safety: plain functions of their arguments; any thread, on the caller's current CUDA
// stream for CUDA tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace megaslide {

// The largest finite float8_e4m3fn value, S.1111.110 = 1.75 × 2^8.
inline constexpr double kFp8E4m3fnMax = 448.0;

enum class Fp8Scaling { kNone, kPerTensor };
const char* to_string(Fp8Scaling scaling);

struct Fp8Tensor {
  at::Tensor data;   // float8_e4m3fn (float8_e5m2 when read from a file that holds it), the weight's shape
  at::Tensor scale;  // float32 scalar (0-dim) on data's device: weight = data × scale; 1 when unscaled
};

bool is_fp8(c10::ScalarType dtype);  // float8_e4m3fn or float8_e5m2 (the dtypes safetensors files hold)

// `w` (float32, bf16, fp16 or float64; any shape, any device) as float8_e4m3fn with `scaling`, as described
// above. kPerTensor reads amax back to the host (a device synchronisation) and refuses a `w` holding NaN
// or ±inf, which would turn every element to NaN.
Fp8Tensor quantize_fp8(const at::Tensor& w, Fp8Scaling scaling);

// data.to(float32) × scale as `out` (a floating dtype), on data's device. `t.scale` may be undefined
// (scale 1) or any floating tensor of one element on any device.
at::Tensor dequantize_fp8(const Fp8Tensor& t, c10::ScalarType out = c10::ScalarType::Float);

}  // namespace megaslide
