#include "megaslide/util/cpu_tensor_cache.h"

#include "megaslide/util/cpu_resources.h"
#include "megaslide/util/numbers.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <mutex>
#include <vector>

namespace megaslide::util {

namespace {

constexpr size_t kHeader = 64;                // keeps the data 64-byte aligned, as LibTorch's is
constexpr size_t kGranule = size_t{1} << 20;  // large blocks' sizes are rounded up to whole MiB

class CpuTensorCache final : public c10::Allocator {
 public:
  CpuTensorCache(c10::Allocator* base, int64_t cap, int64_t min_block)
      : base_(base), cap_(cap), min_block_(min_block) {}

  c10::DataPtr allocate(size_t n) override {
    TORCH_CHECK(n <= std::numeric_limits<size_t>::max() - kHeader - kGranule, "CPU allocation of ", n,
                " bytes: beyond what any machine holds");
    const size_t want = n + kHeader;
    const bool large = want >= static_cast<size_t>(min_block_);
    const size_t bytes = large ? (want + kGranule - 1) / kGranule * kGranule : want;
    if (large) {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto [first, last] = by_size_.equal_range(bytes);
      if (first != last) {
        const auto it = std::prev(last);  // the most recently freed of the size: likeliest still in a cache
        char* block = take(it->second);
        ++hits_;
        return wrap(block);
      }
      ++misses_;
    }
    c10::DataPtr inner;
    try {
      inner = base_->allocate(bytes);
    } catch (const c10::Error&) {
      if (!large || trim() == 0) throw;
      inner = base_->allocate(bytes);  // once more with the spare blocks returned
    }
    auto* block = static_cast<char*>(inner.get());
    if (block == nullptr) return inner;  // not reached: every request asks the base for at least the header
    auto* header = reinterpret_cast<Header*>(block);
    header->bytes = large ? bytes : 0;
    header->context = inner.get_context();
    header->deleter = inner.get_deleter();
    inner.release_context();
    return wrap(block);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CpuTensorCache::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  int64_t trim() {
    std::vector<char*> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [age, spare] : by_age_) blocks.push_back(spare.block);
      by_age_.clear();
      by_size_.clear();
      cached_ = 0;
    }
    for (char* block : blocks) free_block(block);
    return static_cast<int64_t>(blocks.size());
  }
  CpuTensorCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {cap_, min_block_, cached_, hits_, misses_};
  }
  static CpuTensorCache* instance;

 private:
  struct Header {
    size_t bytes;  // the size class of a large block; 0 for the others
    void* context;
    c10::DeleterFnPtr deleter;
  };
  static_assert(sizeof(Header) <= kHeader, "the header must fit in front of the data");

  static c10::DataPtr wrap(char* block) {
    void* data = block + kHeader;
    return {data, data, &CpuTensorCache::release, c10::Device(c10::DeviceType::CPU)};
  }
  static void free_block(char* block) {
    const Header header = *reinterpret_cast<Header*>(block);
    if (header.deleter != nullptr) header.deleter(header.context);
  }
  static void release(void* ptr) {
    if (ptr == nullptr) return;
    char* block = static_cast<char*>(ptr) - kHeader;
    const size_t bytes = reinterpret_cast<Header*>(block)->bytes;
    std::vector<char*> evicted;
    if (bytes != 0 && static_cast<int64_t>(bytes) <= instance->cap_) {
      CpuTensorCache& c = *instance;
      std::lock_guard<std::mutex> lock(c.mutex_);
      // The oldest spare blocks make room: sizes the work no longer asks for age out.
      while (c.cached_ + static_cast<int64_t>(bytes) > c.cap_) evicted.push_back(c.take(c.by_age_.begin()->first));
      const uint64_t age = c.next_age_++;
      c.by_age_.emplace(age, Spare{bytes, block});
      c.by_size_.emplace(bytes, age);
      c.cached_ += static_cast<int64_t>(bytes);
      block = nullptr;
    }
    for (char* old : evicted) free_block(old);
    if (block != nullptr) free_block(block);
  }
  // Removes the spare block of that age from both indexes and returns it; mutex_ held.
  char* take(uint64_t age) {
    const auto it = by_age_.find(age);
    const Spare spare = it->second;
    by_age_.erase(it);
    const auto [first, last] = by_size_.equal_range(spare.bytes);
    for (auto s = first; s != last; ++s)
      if (s->second == age) {
        by_size_.erase(s);
        break;
      }
    cached_ -= static_cast<int64_t>(spare.bytes);
    return spare.block;
  }

  c10::Allocator* base_;
  const int64_t cap_, min_block_;
  std::mutex mutex_;
  struct Spare {
    size_t bytes;
    char* block;
  };
  std::map<uint64_t, Spare> by_age_;         // the spare blocks, oldest first
  std::multimap<size_t, uint64_t> by_size_;  // size class -> the ages of its spare blocks
  uint64_t next_age_ = 0;
  int64_t cached_ = 0, hits_ = 0, misses_ = 0;
};
CpuTensorCache* CpuTensorCache::instance = nullptr;

std::mutex& install_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

int64_t default_cpu_tensor_cache_cap() {
  const int64_t memory = available_memory_bytes();  // the container's limit where it has one
  return std::min<int64_t>((memory > 0 ? memory : int64_t{8} << 30) / 8, int64_t{4} << 30);
}

bool install_cpu_tensor_cache(int64_t cap_bytes, int64_t min_block_bytes) {
  TORCH_CHECK(cap_bytes >= 0 && min_block_bytes > 0, "install_cpu_tensor_cache: cap ", cap_bytes, " and minimum block ",
              min_block_bytes, " must be >= 0 and > 0");
  std::lock_guard<std::mutex> lock(install_mutex());
  if (CpuTensorCache::instance != nullptr) return false;
  // Never freed: tensors allocated through it may outlive any scope, and their deleter reads it.
  CpuTensorCache::instance = new CpuTensorCache(c10::GetCPUAllocator(), cap_bytes, min_block_bytes);
  c10::SetCPUAllocator(CpuTensorCache::instance, /*priority=*/100);
  return true;
}

std::optional<CpuTensorCacheStats> cpu_tensor_cache_stats() {
  std::lock_guard<std::mutex> lock(install_mutex());
  if (CpuTensorCache::instance == nullptr) return std::nullopt;
  return CpuTensorCache::instance->stats();
}

void trim_cpu_tensor_cache() {
  std::lock_guard<std::mutex> lock(install_mutex());
  if (CpuTensorCache::instance != nullptr) CpuTensorCache::instance->trim();
}

int64_t cpu_tensor_cache_cap_from_environment() {
  const char* name = "MEGASLIDE_CPU_TENSOR_CACHE";
  const char* value = std::getenv(name);
  const std::string text = value != nullptr ? value : "";
  if (text.empty() || text == "auto") return default_cpu_tensor_cache_cap();
  if (text == "off") return 0;
  constexpr int64_t kMiB = int64_t{1} << 20;
  int64_t mib = 0;
  try {
    mib = parse_integer(text, "auto, off or a cap in MiB (a whole number >= 0)");
  } catch (const NumberError& e) {
    throw NumberError(std::string(name) + ": " + e.what());
  }
  if (mib < 0 || mib > kMaxMachineBytes / kMiB)
    throw NumberError(std::string(name) + ": expected auto, off or a cap in MiB from 0 to " +
                      std::to_string(kMaxMachineBytes / kMiB) + ", got '" + text + "'");
  return mib * kMiB;
}

int64_t install_cpu_tensor_cache_from_environment() {
  const int64_t cap = cpu_tensor_cache_cap_from_environment();
  if (cap < kDefaultMinBlock) return 0;  // it could keep no block
  install_cpu_tensor_cache(cap);
  return cap;
}

}  // namespace megaslide::util
