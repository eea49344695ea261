// Weights with a NaN or an infinity are broken (a diverged run, a bad conversion): sampling from them
// writes black videos with exit 0, and fine-tuning from them trains nothing. Every reader of weights —
// the DiT weights file, train.init_from, Wan's weights, the pretrained encoders — scans each tensor as it
// is read (require_finite) and refuses such a tensor naming the file, the tensor and the first bad
// element, unless the process allows them (the tools' --allow-nonfinite-weights).
//
// Thread-safety: require_finite is a pure function of its arguments and the process-wide setting, which
// is an atomic flag (set it before loading).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "megaslide/util/errors.h"

namespace megaslide::io {

class NonFiniteWeightsError : public std::runtime_error, public InputError {
 public:
  explicit NonFiniteWeightsError(const std::string& what, int64_t element = -1, int64_t count = 0)
      : std::runtime_error(what), element(element), count(count) {}
  int64_t element, count;  // require_finite's: the first bad element of the tensor's `count` (-1: not said)
};

// Whether weights with NaN or infinite values are loaded anyway (default false).
void set_nonfinite_weights_allowed(bool allowed);
bool nonfinite_weights_allowed();

// The index of the first element of [data, data + n) of `dtype` that is NaN or infinite, or -1 when
// there is none (or the dtype is not floating point). About memory speed: the exponent bits alone.
int64_t first_nonfinite(const void* data, int64_t n, c10::ScalarType dtype);

// Throws NonFiniteWeightsError naming `file` and `tensor` when the tensor's data holds a NaN or an
// infinity, unless nonfinite_weights_allowed().
void require_finite(const void* data, int64_t n, c10::ScalarType dtype, const std::string& file,
                    const std::string& tensor);

}  // namespace megaslide::io
