// What every megaslide-* driver shares: flag checks built on the library's one numeric parser
// (util/numbers.h), so that a flag takes exactly the numbers a config key takes (no nan, no inf, no
// 1e400), and the process settings a long-running tool needs.
#pragma once

#include <CLI/CLI.hpp>

#include <csignal>
#include <limits>
#include <string>

#include "megaslide/util/numbers.h"

namespace megaslide::tools {

// A finite real in [lo, hi] (CLI11's own checks let "nan" through: every comparison with it is false).
inline CLI::Validator finite_real(double lo = -std::numeric_limits<double>::infinity(),
                                  double hi = std::numeric_limits<double>::infinity()) {
  std::string expected = "a finite number";
  if (lo > -std::numeric_limits<double>::infinity()) expected += " >= " + CLI::detail::to_string(lo);
  if (hi < std::numeric_limits<double>::infinity()) expected += " <= " + CLI::detail::to_string(hi);
  return CLI::Validator(
      [lo, hi, expected](std::string& text) -> std::string {
        try {
          const double v = parse_real(text, expected);
          if (v < lo || v > hi) return "expected " + expected + ", got '" + text + "'";
          return "";
        } catch (const NumberError& e) {
          return e.what();
        }
      },
      "FINITE");
}

// An integer in [lo, hi], read by the library's parser: one that overflows int64 is an error, not the
// largest int64 (which CLI11's own conversion lets through) or a wrapped value.
inline CLI::Validator integer_in(int64_t lo = std::numeric_limits<int64_t>::min(), int64_t hi = std::numeric_limits<int64_t>::max()) {
  std::string expected = "an integer";
  if (lo > std::numeric_limits<int64_t>::min()) expected += " >= " + std::to_string(lo);
  if (hi < std::numeric_limits<int64_t>::max()) expected += " <= " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, expected](std::string& text) -> std::string {
        try {
          const int64_t v = parse_integer(text, expected);
          if (v < lo || v > hi) return "expected " + expected + ", got '" + text + "'";
          text = std::to_string(v);  // what CLI11 converts next: plain decimal (it would read "010" as octal)
          return "";
        } catch (const NumberError& e) {
          return e.what();
        }
      },
      "INTEGER");
}

// A path flag that was given must name something: an empty string ("--out ''") would silently mean
// the current folder or the default.
inline CLI::Validator non_empty_path() {
  return CLI::Validator([](std::string& text) -> std::string { return text.empty() ? "an empty path names nothing" : ""; },
                        "PATH");
}

// A file-size limit (ulimit -f) must turn into a failed write(2) with EFBIG, which the library reports
// and survives (a failed checkpoint save keeps the previous one), not into SIGXFSZ, whose default
// action kills the process without a word.
inline void survive_file_size_limit() { std::signal(SIGXFSZ, SIG_IGN); }

}  // namespace megaslide::tools
