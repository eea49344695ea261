// Errors as one line for people: what a tool's `main` prints when it turns an exception into an exit
// code. LibTorch's c10::Error carries a C++ stack trace of 20-30 lines after its message; users need
// the message (what was asked, what is available), which this returns without the trace.
//
// Thread-safety: pure functions.
#pragma once

#include <exception>
#include <string>

namespace megaslide {

// e.what(), or for a c10::Error (TORCH_CHECK, allocation failures, CUDA errors) its message without
// the stack trace, with runs of white space (newlines included) folded to one space.
std::string error_message(const std::exception& e);

// True for an allocation failure (std::bad_alloc, c10::OutOfMemoryError, "not enough memory" from
// LibTorch's CPU allocator): a tool adds what to change.
bool is_out_of_memory(const std::exception& e);

}  // namespace megaslide
