#include "megaslide/util/numbers.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace megaslide {

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// "[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?" without <regex> (the fuzz build links this file).
bool is_decimal_real(const std::string& s) {
  size_t i = 0, n = s.size();
  if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
  size_t mantissa_digits = 0;
  while (i < n && is_digit(s[i])) ++i, ++mantissa_digits;
  if (i < n && s[i] == '.') {
    ++i;
    while (i < n && is_digit(s[i])) ++i, ++mantissa_digits;
  }
  if (mantissa_digits == 0) return false;
  if (i < n && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
    size_t exponent_digits = 0;
    while (i < n && is_digit(s[i])) ++i, ++exponent_digits;
    if (exponent_digits == 0) return false;
  }
  return i == n;
}

bool is_decimal_integer(const std::string& s) {
  size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i)
    if (!is_digit(s[i])) return false;
  return true;
}

std::string got(const std::string& expected, const std::string& text) {
  return "expected " + expected + ", got '" + text + "'";
}

}  // namespace

int64_t parse_integer(const std::string& text, const std::string& expected) {
  if (!is_decimal_integer(text)) throw NumberError(got(expected, text));
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno == ERANGE) throw NumberError(got(expected, text) + " (beyond the 64-bit integer range, about ±9.2e18)");
  return static_cast<int64_t>(v);
}

uint64_t parse_unsigned(const std::string& text, const std::string& expected) {
  if (!is_decimal_integer(text) || text[0] == '-') throw NumberError(got(expected, text));
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno == ERANGE)
    throw NumberError(got(expected, text) + " (beyond the unsigned 64-bit integer range, about 1.8e19)");
  return static_cast<uint64_t>(v);
}

double parse_real(const std::string& text, const std::string& expected) {
  if (!is_decimal_real(text)) throw NumberError(got(expected, text));
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (errno == ERANGE && std::isinf(v))
    throw NumberError(got(expected, text) + " (beyond the largest double, about 1.8e308)");
  if (errno == ERANGE || (v != 0.0 && std::fpclassify(v) == FP_SUBNORMAL)) {
    // strtod sets ERANGE on underflow and returns 0 or a subnormal: the value written is not zero but
    // cannot be held; a silent 0 would turn e.g. a learning rate of 1e-400 into "no training".
    bool nonzero_mantissa = false;
    for (char c : text) {
      if (c == 'e' || c == 'E') break;
      nonzero_mantissa |= c >= '1' && c <= '9';
    }
    if (nonzero_mantissa)
      throw NumberError(got(expected, text) +
                        " (too close to zero for a double, below about 2.2e-308; write 0 for zero)");
  }
  if (!std::isfinite(v)) throw NumberError(got(expected, text));
  return v;
}

std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  int64_t p = 1;
  for (int64_t f : factors) {
    if (f < 0) return std::nullopt;
    if (f != 0 && p > std::numeric_limits<int64_t>::max() / f) return std::nullopt;
    p *= f;
  }
  return p;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  while (std::abs(bytes) >= 1000.0 && u < 6) bytes /= 1000.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.3g %s", bytes, units[u]);
  return buf;
}

}  // namespace megaslide
