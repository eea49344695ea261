// Numbers from text, and sizes multiplied out, checked: the one place where MegaSlide turns a config
// value or a command-line flag into a number, and where it decides whether a size is one any machine
// could hold.
//
// Parsing accepts exactly one decimal number and nothing else (no surrounding text, no "nan", "inf" or
// hex); a number whose magnitude is beyond what the type holds (1e400, 99999999999999999999) or a
// non-zero real too small for a double (1e-400) is refused with a sentence saying so, never rounded
// to infinity or zero and never an exception of the standard library (std::stod's out_of_range).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>

#include "megaslide/util/errors.h"

namespace megaslide {

// A text that is not the number asked for; what() is a phrase that completes "KEY: ", e.g.
// "expected a number > 0, got '1e400' (beyond the largest double, about 1.8e308)".
class NumberError : public std::invalid_argument, public InputError {
 public:
  using std::invalid_argument::invalid_argument;
};

// A whole decimal integer ("[+-]?[0-9]+") in int64's range. `expected` describes what the caller
// wants ("an integer >= 1") and opens the message. Throws NumberError.
int64_t parse_integer(const std::string& text, const std::string& expected);

// A whole non-negative decimal integer ("+?[0-9]+") in uint64's range (seeds). Throws NumberError.
uint64_t parse_unsigned(const std::string& text, const std::string& expected);

// A finite decimal real ("1", "-2.5", ".5", "3e-4"); refuses overflow, underflow of a non-zero value,
// nan, inf and anything else. Throws NumberError.
double parse_real(const std::string& text, const std::string& expected);

// The product of non-negative factors, or nullopt when it exceeds int64's range.
std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors);

// The most bytes any one machine could hold, for refusing sizes that no machine could run: 1 PiB,
// about 30x the largest single-host memory sold today (32 TB). A size above it is a typo or an
// overflow, never a plan.
constexpr int64_t kMaxMachineBytes = int64_t{1} << 50;

// "1.2 TB", "980 MB": bytes for messages (decimal units, three significant digits).
std::string human_bytes(double bytes);

}  // namespace megaslide
