#include "megaslide/util/cpu_memory_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>

namespace megaslide::util {

namespace {

// LibTorch's CPU allocator wrapped to count (util/cpu_memory_counter.h says why it is never removed).
// Each allocation asks the base allocator for kHeader more bytes and keeps, in front of the data, what
// the release needs (the size, the base's context and deleter): no lock and no table, so counting costs
// two atomic operations per allocation. kHeader keeps the data 64-byte aligned, as LibTorch's is.
class CountingCpuAllocator final : public c10::Allocator, public CpuMemoryCounter {
 public:
  explicit CountingCpuAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n + kHeader);
    auto* block = static_cast<char*>(inner.get());
    const c10::Device device = inner.device();
    if (block == nullptr) return inner;
    auto* header = reinterpret_cast<Header*>(block);
    header->bytes = static_cast<int64_t>(n);
    header->context = inner.get_context();
    header->deleter = inner.get_deleter();
    inner.release_context();
    const int64_t now = live_ += header->bytes;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    void* data = block + kHeader;
    return {data, data, &CountingCpuAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  int64_t live() const override { return live_.load(); }
  int64_t peak() const override { return peak_.load(); }
  void reset_peak() override { peak_.store(live_.load()); }
  static CountingCpuAllocator* instance;

 private:
  struct Header {
    int64_t bytes;
    void* context;
    c10::DeleterFnPtr deleter;
  };
  static constexpr size_t kHeader = 64;
  static_assert(sizeof(Header) <= kHeader, "the header must fit in front of the data");
  static void release(void* ptr) {
    if (ptr == nullptr) return;
    const Header header = *reinterpret_cast<Header*>(static_cast<char*>(ptr) - kHeader);
    instance->live_ -= header.bytes;
    if (header.deleter != nullptr) header.deleter(header.context);
  }
  c10::Allocator* base_;
  std::atomic<int64_t> live_{0}, peak_{0};
};
CountingCpuAllocator* CountingCpuAllocator::instance = nullptr;

}  // namespace

CpuMemoryCounter& cpu_memory_counter() {
  static CountingCpuAllocator* counter = [] {
    auto* c = new CountingCpuAllocator(c10::GetCPUAllocator());  // never freed: util/cpu_memory_counter.h says why
    CountingCpuAllocator::instance = c;
    c10::SetCPUAllocator(c, /*priority=*/100);
    return c;
  }();
  return *counter;
}

}  // namespace megaslide::util
