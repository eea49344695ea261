// TableCache: small constant tensors that depend only on a few sizes (the Swin window mask, the DiT's
// sin-cos position table), built once per key on the CPU and kept on their device, instead of being
// rebuilt and copied to the device in every forward. Internal to libmegaslide.
//
// Thread-safe (one mutex). The copy to the device is a blocking one (pageable source), so a table is
// complete before any stream reads it; the tables are never written afterwards.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <deque>
#include <functional>
#include <mutex>
#include <vector>

namespace megaslide::detail {

class TableCache {
 public:
  explicit TableCache(size_t capacity) : capacity_(capacity) {}

  // The table for `key` on `device` as `dtype`: build() (a CPU tensor) the first time, the kept tensor
  // after. The `capacity` most recently built tables are kept.
  at::Tensor get(const std::vector<int64_t>& key, c10::Device device, c10::ScalarType dtype,
                 const std::function<at::Tensor()>& build) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& e : entries_)
      if (e.key == key && e.device == device && e.dtype == dtype) return e.table;
    at::Tensor table = build().to(device, dtype).contiguous();
    entries_.push_front({key, device, dtype, table});
    if (entries_.size() > capacity_) entries_.pop_back();
    return table;
  }

 private:
  struct Entry {
    std::vector<int64_t> key;
    c10::Device device;
    c10::ScalarType dtype;
    at::Tensor table;
  };
  size_t capacity_;
  std::mutex mutex_;
  std::deque<Entry> entries_;
};

}  // namespace megaslide::detail
