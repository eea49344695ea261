// A cache of large blocks in front of LibTorch's CPU allocator.
//
// LibTorch's CPU allocator returns every freed block to the C library, which hands blocks of 32 MiB and more
// straight back to the kernel (munmap). A training step on the CPU frees and allocates the same large blocks
// every step — the weight gradients autograd computes before adding them into .grad, activations, their
// gradients — so each step took them as fresh pages again: a page fault and a page of zeroes every 4 KiB
// (on a 118 M-parameter Wan, ~67 000 faults a streamed step). The cache keeps freed blocks of at least
// `min_block_bytes` (sizes rounded up to whole MiB) and hands one back when a block of its rounded size is
// asked for again. It holds at most `cap_bytes` of spare blocks: to keep a newly freed block, it returns the
// oldest spare blocks to the C library, so sizes the work stopped asking for age out; a block larger than the
// cap goes back at once. When the base allocator fails, the cache lets go of everything it holds and asks
// once more. What it costs: up to `cap_bytes` more resident memory than the live tensors need.
//
// install_cpu_tensor_cache wraps the CPU allocator (c10::SetCPUAllocator) for the rest of the process, like
// util::cpu_memory_counter (and for the same reason never removed). Install it before the counter when both
// are wanted: the counter then counts live tensors, not the cache's spare blocks. Every allocation made
// through it carries 64 bytes in front of its data (its size class and the base allocator's deleter), so
// pointers stay "simple" (context == data) and 64-byte aligned. (As with the counter, memory taken with
// raw_allocate before the install must not be given back with raw_deallocate after it.)
//
// The megaslide-* tools install it before their work (tools/tool_support.h: run_tool), with the cap that
// MEGASLIDE_CPU_TENSOR_CACHE sets (below); a program using the library installs it itself if it wants it.
//
// Thread-safety: allocation and release may happen on any thread (one mutex, taken only for blocks of at
// least min_block_bytes); the functions below may be called from any thread.
#pragma once

#include <cstdint>
#include <optional>

namespace megaslide::util {

struct CpuTensorCacheStats {
  int64_t cap_bytes = 0;        // the most bytes of spare blocks held
  int64_t min_block_bytes = 0;  // smaller allocations bypass the cache
  int64_t cached_bytes = 0;     // spare blocks held now
  int64_t hits = 0;             // large allocations served from the cache
  int64_t misses = 0;           // large allocations the base allocator served
};

// A cap from the machine: an eighth of its memory (util::available_memory_bytes: the container's limit where
// that is lower), at most 4 GiB. The blocks a CPU step reuses take far less (a process training a 118 M-parameter
// Wan held about 0.1 GB more); on a GPU run, where large CPU tensors are incidental (a checkpoint's copies), the
// cap bounds what the cache keeps after them.
int64_t default_cpu_tensor_cache_cap();

inline constexpr int64_t kDefaultMinBlock = int64_t{8} << 20;

// Installs the cache; true the first time, false (changing nothing) once one is installed.
bool install_cpu_tensor_cache(int64_t cap_bytes, int64_t min_block_bytes = kDefaultMinBlock);

// The installed cache's figures; nullopt when none is installed.
std::optional<CpuTensorCacheStats> cpu_tensor_cache_stats();

// Returns every spare block to the base allocator (the cache stays installed).
void trim_cpu_tensor_cache();

// The cap MEGASLIDE_CPU_TENSOR_CACHE asks for: unset, empty or "auto" -> default_cpu_tensor_cache_cap();
// "off" or "0" -> 0 (no cache); a whole number N -> N MiB. Throws NumberError naming the variable otherwise.
int64_t cpu_tensor_cache_cap_from_environment();

// What every megaslide-* tool does first: installs the cache with the environment's cap unless that is below
// kDefaultMinBlock (such a cache could keep no block). Returns the cap (0: none installed by this call).
int64_t install_cpu_tensor_cache_from_environment();

}  // namespace megaslide::util
