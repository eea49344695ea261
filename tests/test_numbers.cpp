// util/numbers.h: the one numeric parser of configs and flags, and checked size products.
#include "megaslide/util/numbers.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

using namespace megaslide;

namespace {
std::string problem_of_real(const std::string& text) {
  try {
    parse_real(text, "a number");
  } catch (const NumberError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// The property: a decimal number is read exactly as strtod reads it; anything a double cannot hold
// (1e400 overflows, 1e-400 underflows to zero) is refused with a NumberError that says why, never
// rounded to inf or 0 and never std::out_of_range (what std::stod throws, which aborted the tools).
TEST(Numbers, RealsBeyondADoubleAreRefusedWithTheReason) {
  EXPECT_EQ(parse_real("1e-3", "x"), 1e-3);
  EXPECT_EQ(parse_real("-2.5", "x"), -2.5);
  EXPECT_EQ(parse_real(".5", "x"), 0.5);
  EXPECT_EQ(parse_real("7.", "x"), 7.0);
  EXPECT_EQ(parse_real("0e-400", "x"), 0.0) << "zero written with a tiny exponent is still zero";
  EXPECT_EQ(parse_real("1.7976931348623157e308", "x"), std::numeric_limits<double>::max());
  EXPECT_NE(problem_of_real("1e400").find("beyond the largest double"), std::string::npos) << problem_of_real("1e400");
  EXPECT_NE(problem_of_real("-1e400").find("beyond the largest double"), std::string::npos);
  EXPECT_NE(problem_of_real("1e-400").find("too close to zero"), std::string::npos) << problem_of_real("1e-400");
  EXPECT_NE(problem_of_real("4e-320").find("too close to zero"), std::string::npos) << "a subnormal loses digits";
  for (const char* bad : {"nan", "NaN", "inf", "-inf", "infinity", "0x10", "1e", "e5", ".", "", " 1", "1 ", "1,5",
                          "--1", "1e+", "\xff"}) {
    EXPECT_NE(problem_of_real(bad), "") << "accepted '" << bad << "'";
    EXPECT_NE(problem_of_real(bad).find("expected a number"), std::string::npos) << problem_of_real(bad);
  }
}

TEST(Numbers, IntegersBeyondInt64AreRefusedWithTheReason) {
  EXPECT_EQ(parse_integer("9223372036854775807", "x"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(parse_integer("-9223372036854775808", "x"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(parse_integer("+12", "x"), 12);
  try {
    parse_integer("99999999999999999999", "an integer >= 1");
    ADD_FAILURE() << "accepted";
  } catch (const NumberError& e) {
    EXPECT_NE(std::string(e.what()).find("expected an integer >= 1, got '99999999999999999999'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("64-bit"), std::string::npos) << e.what();
  }
  for (const char* bad : {"1.0", "1e3", "", "-", "0x1", " 1", "12a"})
    EXPECT_THROW(parse_integer(bad, "x"), NumberError) << bad;
}

TEST(Numbers, CheckedProductSaysWhenItOverflows) {
  EXPECT_EQ(checked_product({3, 8, 16, 16}), 3 * 8 * 16 * 16);
  EXPECT_EQ(checked_product({}), 1);
  EXPECT_EQ(checked_product({0, std::numeric_limits<int64_t>::max(), 5}), 0);
  EXPECT_EQ(checked_product({int64_t{1} << 31, int64_t{1} << 31}), int64_t{1} << 62);
  EXPECT_FALSE(checked_product({int64_t{1} << 32, int64_t{1} << 31}).has_value());
  EXPECT_FALSE(checked_product({999999999999, 999999999999}).has_value());
  EXPECT_FALSE(checked_product({-1, 2}).has_value());
  EXPECT_EQ(human_bytes(2.4e12), "2.4 TB");
  EXPECT_EQ(human_bytes(512), "512 B");
}
