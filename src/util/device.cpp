#include "megaslide/util/device.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>
#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace megaslide {

c10::Device resolve_device(const std::string& spec) {
  if (spec == "auto") return torch::cuda::is_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  c10::Device device(spec);
  if (!device.is_cuda()) return device;
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  TORCH_CHECK(count > 0, "device '", spec, "': no CUDA GPU is visible; use cpu or auto");
  TORCH_CHECK(!device.has_index() || device.index() < count, "device '", spec, "': only ", count,
              " GPU(s) are visible (cuda:0", count > 1 ? " to cuda:" + std::to_string(count - 1) : std::string(), ")");
  if (device.has_index()) return device;
#ifdef MEGASLIDE_WITH_CUDA
  return c10::Device(c10::kCUDA, c10::cuda::current_device());  // "cuda" is the current GPU, with its index
#else
  return c10::Device(c10::kCUDA, 0);
#endif
}

}  // namespace megaslide
