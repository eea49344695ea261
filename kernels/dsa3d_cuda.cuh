// What both 3D-DSA CUDA files share (kernels/dsa3d.cu, kernels/dsa3d_tiled.cu): the conversions between
// the storage types and the accumulation type, and the dtype dispatch with the GPU's 16-bit types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "attention/dsa3d_params.h"

namespace megaslide::ops::detail {
namespace {

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }

// Round to nearest even, as LibTorch's conversions.
template <typename T>
__device__ __forceinline__ T from_acc(float x);
template <>
__device__ __forceinline__ float from_acc<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) {
  return __float2half_rn(x);
}
template <typename T>
__device__ __forceinline__ T from_acc(double x) {
  return T(x);
}

template <typename T>
__device__ __forceinline__ T zero_of() {
  if constexpr (std::is_same_v<T, double>) return 0.0;
  else return from_acc<T>(0.0f);
}

// f(scalar_t{}, acc_t{}) for `dtype`, with __nv_bfloat16 and __half as the 16-bit storage types.
template <typename F>
void dtype_switch(DsaDtype dtype, F&& f) {
  dispatch_dtype<__nv_bfloat16, __half>(dtype, static_cast<F&&>(f));
}

}  // namespace
}  // namespace megaslide::ops::detail
