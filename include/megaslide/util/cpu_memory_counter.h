// Counts the bytes LibTorch's CPU allocator holds live, and their peak: how benchmarks and the ablation
// suites measure memory where there is no GPU allocator with statistics.
//
// The first call to cpu_memory_counter() wraps the CPU allocator (c10::SetCPUAllocator) for the rest of
// the process: a tensor allocated through it may outlive any scope, and its deleter reads the counter,
// so the counter is never removed or freed. Only allocations made after that call are counted. The
// wrapper's pointers are "simple" (context == data), as LibTorch's raw_allocate requires; each keeps its
// size and the base allocator's deleter in 64 bytes in front of the data (no lock, no table).
//
// Thread-safety: allocation and release may happen on any thread; live() and peak() are atomic reads.
#pragma once

#include <cstdint>

namespace megaslide::util {

class CpuMemoryCounter {
 public:
  virtual ~CpuMemoryCounter() = default;
  virtual int64_t live() const = 0;  // bytes allocated and not yet released
  virtual int64_t peak() const = 0;  // the most bytes live at once since the last reset_peak()
  virtual void reset_peak() = 0;     // peak := live
};

// The process's counter, installed on first use.
CpuMemoryCounter& cpu_memory_counter();

}  // namespace megaslide::util
