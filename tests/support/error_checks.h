// Checks of the errors bad input gets: thrown as the expected class, naming every given fragment.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace megaslide::testing {

// `f()` throws an Error whose what() holds every one of `fragments`.
template <typename Error, typename Fn>
void expect_error_naming(Fn&& f, const std::vector<std::string>& fragments) {
  try {
    f();
    ADD_FAILURE() << "no error (expected one naming '" << (fragments.empty() ? "" : fragments.front()) << "')";
  } catch (const Error& e) {
    for (const auto& fragment : fragments)
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace megaslide::testing
