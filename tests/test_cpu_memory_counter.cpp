// util::cpu_memory_counter(): the bytes LibTorch's CPU allocator holds live and their peak; and
// util::install_cpu_tensor_cache, the cache of large blocks in front of that allocator.
#include <gtest/gtest.h>
#include <c10/core/CPUAllocator.h>
#include <torch/types.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/util/cpu_memory_counter.h"
#include "megaslide/util/cpu_tensor_cache.h"
#include "megaslide/util/errors.h"
#include "megaslide/util/numbers.h"
#include "run_tool.h"

using megaslide::util::cpu_memory_counter;

TEST(CpuMemoryCounter, CountsLiveBytesAndThePeakOfCpuTensors) {
  auto& counter = cpu_memory_counter();
  const int64_t before = counter.live();
  counter.reset_peak();
  {
    auto a = torch::empty({1 << 20}, torch::kFloat32);  // 4 MiB
    EXPECT_EQ(counter.live() - before, 4 << 20);
    {
      auto b = torch::ones({1 << 19}, torch::kFloat64);  // 4 MiB more, released below
      EXPECT_EQ(counter.live() - before, 8 << 20);
      EXPECT_EQ(b.sum().item<double>(), 1 << 19);  // the memory is usable as allocated
    }
    EXPECT_EQ(counter.live() - before, 4 << 20);
    a.fill_(2.f);
    EXPECT_EQ(a.sum().item<float>(), 2.f * (1 << 20));
  }
  EXPECT_EQ(counter.live(), before);
  EXPECT_GE(counter.peak() - before, 8 << 20);
  EXPECT_LT(counter.peak() - before, (8 << 20) + (1 << 16));  // reductions may take a little scratch
  counter.reset_peak();
  EXPECT_EQ(counter.peak(), counter.live());
}

TEST(CpuMemoryCounter, RawAllocationsRoundTrip) {
  // raw_allocate needs "simple" pointers (context == data); the counter's must free through raw_deleter.
  auto& counter = cpu_memory_counter();
  const int64_t before = counter.live();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  void* p = allocator->raw_allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(counter.live() - before, 1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);  // LibTorch's alignment is kept
  allocator->raw_deallocate(p);
  EXPECT_EQ(counter.live(), before);
}

// --- util::install_cpu_tensor_cache: a cache of large blocks in front of the CPU allocator ---------------
// (each test runs in a process of its own, so each installs the cache first, with its own cap)

namespace cache = megaslide::util;

int64_t mib(int64_t n) { return n << 20; }
// A float tensor of `bytes` bytes (less the 64-byte header, so that it fills whole MiB).
torch::Tensor block_of(int64_t bytes) { return torch::empty({(bytes - 64) / 4}, torch::kFloat32); }

TEST(CpuTensorCache, AFreedLargeBlockServesTheNextRequestOfItsSize) {
  ASSERT_TRUE(cache::install_cpu_tensor_cache(mib(64), mib(1)));
  EXPECT_FALSE(cache::install_cpu_tensor_cache(mib(1), mib(1))) << "a second install changes nothing";
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cap_bytes, mib(64));
  void* first = nullptr;
  {
    auto a = block_of(mib(4));
    first = a.data_ptr();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    EXPECT_EQ(cache::cpu_tensor_cache_stats()->misses, 1);
  }
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, mib(4));
  auto b = torch::empty({mib(4) / 4 - 1000}, torch::kFloat32);  // rounds up to the same 4 MiB
  EXPECT_EQ(b.data_ptr(), first);
  auto s = cache::cpu_tensor_cache_stats();
  EXPECT_EQ(s->hits, 1);
  EXPECT_EQ(s->cached_bytes, 0);
  b.fill_(3.f);  // the block is usable memory
  EXPECT_EQ(b.sum().item<float>(), 3.f * static_cast<float>(b.numel()));
  auto c = block_of(mib(4));  // nothing spare now: the base allocator serves it
  EXPECT_NE(c.data_ptr(), first);
  { auto small = torch::ones({1000}); }  // below min_block_bytes: not counted, not kept
  s = cache::cpu_tensor_cache_stats();
  EXPECT_EQ(s->hits, 1);
  EXPECT_EQ(s->misses, 2);
  EXPECT_EQ(s->cached_bytes, 0);
}

TEST(CpuTensorCache, TheOldestSpareBlocksMakeRoomWithinTheCap) {
  ASSERT_TRUE(cache::install_cpu_tensor_cache(mib(12), mib(1)));
  void *pa = nullptr, *pb = nullptr, *pc = nullptr;
  {
    auto a = block_of(mib(5)), b = block_of(mib(3)), c = block_of(mib(2));
    pa = a.data_ptr();
    pb = b.data_ptr();
    pc = c.data_ptr();
  }  // freed c, b, a in that order (locals die in reverse): the oldest spare block is c's
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, mib(10));
  { auto d = block_of(mib(4)); }  // 10 + 4 > 12: c's 2 MiB go back, then 8 + 4 fit
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, mib(12));
  auto c = block_of(mib(2));
  EXPECT_NE(c.data_ptr(), pc) << "the oldest block was kept";
  auto a = block_of(mib(5)), b = block_of(mib(3));
  EXPECT_EQ(a.data_ptr(), pa);
  EXPECT_EQ(b.data_ptr(), pb);
  { auto huge = block_of(mib(13)); }  // larger than the cap: back to the C library at once
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, mib(4));
  cache::trim_cpu_tensor_cache();
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, 0);
}

TEST(CpuTensorCache, AFailedAllocationReturnsTheSpareBlocksAndAsksAgain) {
  ASSERT_TRUE(cache::install_cpu_tensor_cache(mib(64), mib(1)));
  { auto a = block_of(mib(8)); }
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, mib(8));
  // A petabyte: the base allocator refuses it, the cache lets go of its spare block and the second
  // request fails too, with LibTorch's own error.
  try {
    torch::empty({int64_t{1} << 48}, torch::kFloat32);
    ADD_FAILURE() << "a petabyte was allocated";
  } catch (const c10::Error& e) {
    EXPECT_TRUE(megaslide::is_out_of_memory(e)) << "the tools' out-of-memory hint misses: " << e.what();
  }
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, 0);
  auto b = block_of(mib(8));  // and the cache goes on working
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->misses, 3);
}

TEST(CpuTensorCache, ACounterInstalledAfterItCountsLiveTensorsNotSpareBlocks) {
  ASSERT_TRUE(cache::install_cpu_tensor_cache(mib(64), mib(1)));
  auto& counter = cpu_memory_counter();
  const int64_t before = counter.live();
  {
    auto a = block_of(mib(4));
    EXPECT_EQ(counter.live() - before, mib(4) - 64);
  }
  EXPECT_EQ(counter.live(), before);
  // The cache keeps the block: the counter's own 64-byte header made it 4 MiB + 64, so 5 MiB.
  EXPECT_EQ(cache::cpu_tensor_cache_stats()->cached_bytes, mib(5));
}

TEST(CpuTensorCache, TheEnvironmentSetsTheCapAndABadValueIsNamed) {
  const char* name = "MEGASLIDE_CPU_TENSOR_CACHE";
  unsetenv(name);
  EXPECT_EQ(cache::cpu_tensor_cache_cap_from_environment(), cache::default_cpu_tensor_cache_cap());
  EXPECT_GT(cache::default_cpu_tensor_cache_cap(), 0);
  EXPECT_LE(cache::default_cpu_tensor_cache_cap(), int64_t{4} << 30);
  for (const auto& [text, cap] :
       std::vector<std::pair<std::string, int64_t>>{{"auto", cache::default_cpu_tensor_cache_cap()},
                                                    {"", cache::default_cpu_tensor_cache_cap()},
                                                    {"off", 0},
                                                    {"0", 0},
                                                    {"512", mib(512)},
                                                    {"+7", mib(7)}}) {
    setenv(name, text.c_str(), 1);
    EXPECT_EQ(cache::cpu_tensor_cache_cap_from_environment(), cap) << "'" << text << "'";
  }
  for (const std::string bad : {"x", "-1", "1.5", "1e3", "4GiB", " 5", "99999999999999999999", "1099511627777"}) {
    setenv(name, bad.c_str(), 1);
    try {
      cache::cpu_tensor_cache_cap_from_environment();
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const megaslide::NumberError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(name) + ": expected auto, off or a cap in MiB"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("'" + bad + "'"), std::string::npos) << e.what();
    }
  }
  // Every tool installs the cache through run_tool, so each refuses a bad value as bad input: exit 2, one line.
  setenv(name, "lots", 1);
  const auto r = megaslide::testing::run_tool("megaslide-plan", "--config configs/smoke.yaml");
  unsetenv(name);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output,
            "megaslide-plan: MEGASLIDE_CPU_TENSOR_CACHE: expected auto, off or a cap in MiB (a whole number >= "
            "0), got 'lots'\n");
}
