#include "megaslide/io/finite_weights.h"

#include <atomic>
#include <cstring>

namespace megaslide::io {

namespace {
std::atomic<bool> g_allowed{false};

// The first element whose exponent bits are all ones (NaN or ±inf) in 64-element strides, then exact.
template <typename Bits>
int64_t first_saturated(const void* data, int64_t n, Bits mask) {
  const auto* p = static_cast<const Bits*>(data);
  constexpr int64_t kStride = 64;
  int64_t i = 0;
  for (; i + kStride <= n; i += kStride) {
    bool any = false;
    for (int64_t k = 0; k < kStride; ++k) any |= (p[i + k] & mask) == mask;
    if (any) break;
  }
  for (; i < n; ++i)
    if ((p[i] & mask) == mask) return i;
  return -1;
}
}  // namespace

void set_nonfinite_weights_allowed(bool allowed) { g_allowed.store(allowed); }
bool nonfinite_weights_allowed() { return g_allowed.load(); }

int64_t first_nonfinite(const void* data, int64_t n, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::BFloat16:
      return first_saturated<uint16_t>(data, n, 0x7f80);
    case c10::ScalarType::Half:
      return first_saturated<uint16_t>(data, n, 0x7c00);
    case c10::ScalarType::Float:
      return first_saturated<uint32_t>(data, n, 0x7f800000u);
    case c10::ScalarType::Double:
      return first_saturated<uint64_t>(data, n, 0x7ff0000000000000ull);
    case c10::ScalarType::Float8_e4m3fn:  // no infinity; NaN is S.1111.111
      return first_saturated<uint8_t>(data, n, 0x7f);
    case c10::ScalarType::Float8_e5m2:
      return first_saturated<uint8_t>(data, n, 0x7c);
    default:
      return -1;
  }
}

void require_finite(const void* data, int64_t n, c10::ScalarType dtype, const std::string& file,
                    const std::string& tensor) {
  if (nonfinite_weights_allowed()) return;
  const int64_t at = first_nonfinite(data, n, dtype);
  if (at < 0) return;
  throw NonFiniteWeightsError(
      "'" + file + "': tensor '" + tensor + "' holds a NaN or an infinity (element " + std::to_string(at) + " of " +
          std::to_string(n) +
          "): the weights are broken (a diverged run or a bad conversion); --allow-nonfinite-weights loads them anyway",
      at, n);
}

}  // namespace megaslide::io
