// util::cpu_memory_counter(): the bytes LibTorch's CPU allocator holds live and their peak.
#include <gtest/gtest.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "megaslide/util/cpu_memory_counter.h"

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
