#include "offload/state_pager.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

namespace megaslide::offload::detail {
namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
}  // namespace

StatePager::StatePager(std::unique_ptr<NvmeFile> file, std::vector<int64_t> regions, int64_t slots)
    : file_(std::move(file)), regions_(std::move(regions)), blocks_(regions_.size()) {
  if (slots < 1) throw NvmeError(fmt::format("offload.nvme_blocks_in_flight must be at least 1, got {}", slots));
  int64_t offset = 0;
  for (int64_t r : regions_) {
    offsets_.push_back(offset);
    offset += r;
    slot_bytes_ = std::max(slot_bytes_, r);
  }
  if (offset > file_->size())
    throw NvmeError(fmt::format("StatePager: the regions take {} bytes, the file has {}", offset, file_->size()));
  for (int64_t s = 0; s < slots; ++s) {
    void* p = nullptr;
    if (slot_bytes_ > 0 && posix_memalign(&p, kNvmeAlignment, static_cast<size_t>(slot_bytes_)) != 0)
      throw NvmeError(
          fmt::format("the NVMe tier could not allocate its in-flight buffer {} of {} bytes "
                      "(offload.nvme_blocks_in_flight {}); lower it or free host memory",
                      s, slot_bytes_, slots));
    slot_memory_.emplace_back(static_cast<char*>(p), [](char* q) { std::free(q); });
    slot_owner_.push_back(-1);
  }
  thread_ = std::thread([this] { run(); });
}

StatePager::~StatePager() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void StatePager::set_trace(StepTrace* trace) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_ = trace;
}

void StatePager::check_failure() const {
  if (failure_) std::rethrow_exception(failure_);
}

int64_t StatePager::free_slot(bool urgent) {
  for (size_t s = 0; s < slot_owner_.size(); ++s)
    if (slot_owner_[s] < 0) return static_cast<int64_t>(s);
  // A resident block nobody holds, released clean: evicted (it is on disk as it is). A prefetched block
  // not yet acquired only for an acquire that waits.
  for (size_t s = 0; s < slot_owner_.size(); ++s) {
    Block& b = blocks_[slot_owner_[s]];
    if (b.state == State::kResident && b.holders == 0 && b.waiters == 0 && !b.dirty && (urgent || !b.expected)) {
      b.state = State::kDisk;
      b.slot = -1;
      b.expected = false;
      slot_owner_[s] = -1;
      return static_cast<int64_t>(s);
    }
  }
  return -1;
}

void StatePager::prefetch(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_failure();
  Block& b = blocks_.at(block);
  if (b.state == State::kDisk) {
    b.state = State::kQueued;
    reads_.push_back(block);
    changed_.notify_all();
  }
  if (b.state == State::kWriting) b.urgent = true;  // kept in its slot once written
  if (b.state != State::kResident || b.holders == 0) b.expected = true;
}

char* StatePager::acquire(int64_t block, bool write, bool overwrite) {
  std::unique_lock<std::mutex> lock(mutex_);
  Block& b = blocks_.at(block);
  // Not in memory and not being read yet: its read becomes a zero fill.
  if (write && overwrite && (b.state == State::kDisk || b.state == State::kQueued)) b.discard = true;
  const auto start = Clock::now();
  struct Waiting {  // counted in b.waiters from the first wait until this acquire returns or throws
    Block& b;
    bool on = false;
    ~Waiting() {
      if (on) --b.waiters;
    }
  } waiting{b};
  for (;;) {
    check_failure();
    if (b.state == State::kResident) {
      ++b.holders;
      b.dirty = b.dirty || write;
      b.expected = false;
      if (waiting.on) stats_.wait_s += seconds(start, Clock::now());
      return slot_memory_[b.slot].get();
    }
    if (!waiting.on) {
      waiting.on = true;
      ++b.waiters;
    }
    if (b.state == State::kDisk) {
      b.state = State::kQueued;
      b.urgent = true;
      reads_.push_front(block);
      changed_.notify_all();
    } else if (!b.urgent) {
      b.urgent = true;  // queued (first in line now), being read, or being written (then kept)
      if (b.state == State::kQueued) {
        reads_.erase(std::find(reads_.begin(), reads_.end(), block));
        reads_.push_front(block);
      }
      changed_.notify_all();
    }
    changed_.wait(lock);
  }
}

void StatePager::release(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block& b = blocks_.at(block);
  if (b.state != State::kResident || b.holders <= 0)
    throw NvmeError(fmt::format("StatePager: block {} released without being held", block));
  if (--b.holders > 0) return;
  if (b.dirty) {
    b.state = State::kWriting;
    writes_.push_back(block);
  }
  changed_.notify_all();
}

char* StatePager::memory(int64_t block) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Block& b = blocks_.at(block);
  return b.state == State::kResident && b.holders > 0 ? slot_memory_[b.slot].get() : nullptr;
}

void StatePager::flush() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return failure_ || (writes_.empty() && busy_ == 0); });
  check_failure();
}

PagerStats StatePager::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void StatePager::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    int64_t slot = -1;
    changed_.wait(lock, [&] {
      if (stop_ || failure_ || !writes_.empty()) return true;
      if (reads_.empty()) return false;
      slot = free_slot(blocks_[reads_.front()].urgent);
      return slot >= 0;
    });
    if (stop_ || failure_) return;
    const bool write = !writes_.empty();
    int64_t l;
    if (write) {
      l = writes_.front();
      writes_.pop_front();
      if (slot >= 0) slot = -1;  // a slot found for a read stays free
    } else {
      l = reads_.front();
      reads_.pop_front();
      Block& b = blocks_[l];
      b.state = State::kReading;
      b.slot = slot;
      slot_owner_[slot] = l;
    }
    Block& b = blocks_[l];
    char* memory = slot_memory_[b.slot].get();
    // A region never written back is zeros on disk; an overwriting acquire needs no read.
    const bool zeros = !write && (!b.written || b.discard);
    StepTrace* trace = trace_;
    ++busy_;
    lock.unlock();
    const double t0 = trace != nullptr ? trace->now_s() : 0.0;
    const auto start = Clock::now();
    std::exception_ptr error;
    try {
      if (write) file_->write(offsets_[l], memory, regions_[l]);
      else if (zeros) std::memset(memory, 0, static_cast<size_t>(regions_[l]));
      else file_->read(offsets_[l], memory, regions_[l]);
    } catch (...) {
      error = std::current_exception();
    }
    const double took = seconds(start, Clock::now());
    if (trace != nullptr && !zeros)
      trace->add(TraceLane::kNvme, fmt::format("{} block {}", write ? "write" : "read", l), t0, trace->now_s() - t0);
    lock.lock();
    --busy_;
    if (error) {
      failure_ = error;
      changed_.notify_all();
      return;
    }
    if (write) {
      stats_.write_bytes += regions_[l], stats_.write_s += took, ++stats_.writes;
      b.dirty = false;
      b.written = true;
      if (b.urgent || b.waiters > 0) {  // an acquire waits: the slot holds the state as written
        b.state = State::kResident;
        b.urgent = false;
      } else {
        b.state = State::kDisk;
        slot_owner_[b.slot] = -1;
        b.slot = -1;
      }
    } else {
      if (!zeros) stats_.read_bytes += regions_[l], stats_.read_s += took, ++stats_.reads;
      b.discard = false;
      b.state = State::kResident;
      b.urgent = false;
      b.holders = 0;
      b.dirty = false;
    }
    changed_.notify_all();
  }
}

}  // namespace megaslide::offload::detail
