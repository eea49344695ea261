// Errors as one line for people: what a tool's `main` prints when it turns an exception into an exit
// code. LibTorch's c10::Error carries a C++ stack trace of 20-30 lines after its message; users need
// the message (what was asked, what is available), which this returns without the trace. And which
// failures are the user's input to change (exit 2) rather than a failure of the work (exit 1).
//
// Thread-safety: pure functions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace megaslide {

// Marks an exception type as bad input: a config, a flag, a checkpoint, a dataset or a weights file that
// is missing, malformed or does not fit, named in the message; a tool exits 2 for it and 1 for every
// other failure (tools/tool_support.h: run_tool). Mixed in beside the type's std::runtime_error base,
// so `catch (const std::exception&)` still sees one std::exception:
//   class ConfigError : public std::runtime_error, public InputError { ... };
class InputError {
 public:
  virtual ~InputError() = default;

 protected:
  InputError() = default;
  InputError(const InputError&) = default;
  InputError& operator=(const InputError&) = default;
};

// Bad input given by a command-line flag (an output path it names that cannot be written): the message names
// the flag.
class FlagError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

// True when `e` is bad input (its type derives from InputError).
inline bool is_input_error(const std::exception& e) { return dynamic_cast<const InputError*>(&e) != nullptr; }

// e.what(), or for a c10::Error (TORCH_CHECK, allocation failures, CUDA errors) its message without
// the stack trace, with runs of white space (newlines included) folded to one space.
std::string error_message(const std::exception& e);

// True for an allocation failure (std::bad_alloc, c10::OutOfMemoryError, "not enough memory" from
// LibTorch's CPU allocator): a tool adds what to change.
bool is_out_of_memory(const std::exception& e);

// The Levenshtein distance of `a` and `b` (an error's "did you mean" for a misspelt key or flag). Inline: the
// config parser's fuzz build links no LibTorch.
inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace megaslide
