// Glob patterns over parameter names (train.init_from's allow lists, the 3D-DSA retrofit's new
// parameters).
#pragma once

#include <string>

namespace megaslide {

// Glob match of a parameter name: '*' matches any run of characters (dots included), everything else
// itself.
inline bool name_matches(const std::string& pattern, const std::string& name) {
  // Iterative glob with backtracking to the last '*'.
  size_t p = 0, n = 0, star = std::string::npos, resume = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p, ++n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace megaslide
