#include "megaslide/io/fp8.h"

#include <ATen/ATen.h>

#include <cmath>

namespace megaslide {

const char* to_string(Fp8Scaling scaling) { return scaling == Fp8Scaling::kNone ? "none" : "per-tensor"; }

bool is_fp8(c10::ScalarType dtype) {
  return dtype == c10::ScalarType::Float8_e4m3fn || dtype == c10::ScalarType::Float8_e5m2;
}

Fp8Tensor quantize_fp8(const at::Tensor& w, Fp8Scaling scaling) {
  TORCH_CHECK(w.defined(), "quantize_fp8: the weight is undefined");
  const auto dtype = w.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
              "quantize_fp8: the weight is ", dtype, ", expected float32, bf16, fp16 or float64");
  const auto ones = [&] { return at::ones({}, w.options().dtype(at::kFloat)); };
  if (scaling == Fp8Scaling::kNone) return {w.to(at::kFloat8_e4m3fn), ones()};

  // ComfyUI's arithmetic, op for op, in the weight's dtype (fp16 in float32: see the header).
  const at::Tensor x = dtype == at::kHalf ? w.to(at::kFloat) : w;
  const at::Tensor amax = x.numel() > 0 ? x.abs().amax() : at::zeros({}, x.options());
  const double amax_value = amax.item<double>();
  TORCH_CHECK(std::isfinite(amax_value), "quantize_fp8: the weight (", w.sizes(),
              ") holds a NaN or an infinity; per-tensor scaling would make every element NaN");
  at::Tensor scale = amax.div(kFp8E4m3fnMax).to(at::kFloat);
  at::Tensor inverse = scale.reciprocal().to(x.scalar_type());
  if (!std::isfinite(inverse.item<double>())) {  // amax 0 (or tiny): no scaling
    scale = ones();
    inverse = at::ones({}, x.options());
  }
  return {x.mul(inverse).to(at::kFloat8_e4m3fn), scale};
}

at::Tensor dequantize_fp8(const Fp8Tensor& t, c10::ScalarType out) {
  TORCH_CHECK(t.data.defined(), "dequantize_fp8: the data is undefined");
  TORCH_CHECK(is_fp8(t.data.scalar_type()), "dequantize_fp8: the data is ", t.data.scalar_type(),
              ", expected Float8_e4m3fn or Float8_e5m2");
  TORCH_CHECK(c10::isFloatingType(out), "dequantize_fp8: the output dtype ", out, " is not floating point");
  at::Tensor values = t.data.to(at::kFloat);
  if (t.scale.defined()) {
    TORCH_CHECK(t.scale.numel() == 1 && c10::isFloatingType(t.scale.scalar_type()),
                "dequantize_fp8: the scale must be one floating value (per-tensor), got ", t.scale.scalar_type(), " ",
                t.scale.sizes());
    values.mul_(t.scale.to(values.device(), at::kFloat).reshape({}));
  }
  return out == at::kFloat ? values : values.to(out);
}

}  // namespace megaslide
