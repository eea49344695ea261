#include "megaslide/util/errors.h"

#include <c10/util/Exception.h>

#include <new>

namespace megaslide {

std::string error_message(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string raw = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  std::string out;
  bool space = false;
  for (char c : raw) {
    if (c == '\n' || c == '\r' || c == '\t' || c == ' ') {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr || dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr)
    return true;
  const std::string m = error_message(e);
  // LibTorch's CPU allocator says "not enough memory" or "can't allocate memory" (its posix_memalign path).
  return m.find("not enough memory") != std::string::npos || m.find("out of memory") != std::string::npos ||
         m.find("can't allocate memory") != std::string::npos;
}

}  // namespace megaslide
