// build_info reports the version CMake was configured with and whether kernels/ was compiled.
#include "megaslide/util/build_info.h"

#include <gtest/gtest.h>

TEST(BuildInfo, VersionIsSemantic) {
  std::string v = megaslide::version();
  EXPECT_EQ(std::count(v.begin(), v.end(), '.'), 2) << v;
  EXPECT_NE(megaslide::build_summary().find(v), std::string::npos);
}
