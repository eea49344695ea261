// StatePager: the NVMe tier's traffic for HostParamStore (docs/offload.md, "The NVMe tier"). Every block's
// persistent state (master, moments, their scales, EMA) is one region of an NvmeFile; `slots` host buffers of
// the largest region hold the blocks whose state is in memory. One I/O thread reads regions into free slots
// and writes released ones back.
//
// A block is on disk, being read, resident (with a count of holders and whether one may write), or being
// written back. acquire() returns the slot once the block is resident, reading it first when needed;
// release() drops a hold, and the last release of a block acquired for writing queues its write-back (the
// slot is free once the write is done). A block released clean stays resident until its slot is needed.
// prefetch() queues a read ahead of the acquire; reads run in the order asked, each once a slot is free.
// A prefetch only takes a slot that is free or holds a block nobody holds or expects (released clean), so
// prefetching in the order of the acquires to come never starves them; an acquire of a block that was not
// prefetched may also take the slot of a block prefetched but not yet acquired (it is read again later), but
// never that of a block read for an acquire that has not woken yet.
// Write-backs go before reads (they free slots). The file is new: a block never written back reads as zeros
// (posix_fallocate's reservation), so its first "read" fills the slot with zeros and takes no I/O.
//
// Errors: an I/O failure is kept and rethrown by every later call (the state on disk is then undefined:
// the run stops, its last checkpoint intact).
//
// Threading: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "megaslide/offload/nvme_file.h"
#include "megaslide/offload/step_trace.h"

namespace megaslide::offload::detail {

struct PagerStats {
  int64_t read_bytes = 0, write_bytes = 0, reads = 0, writes = 0;
  double read_s = 0, write_s = 0, wait_s = 0;  // the I/O thread's seconds reading / writing; acquirers' waiting
};

class StatePager {
 public:
  // regions[l]: block l's region bytes (multiples of kNvmeAlignment); `slots` >= 1.
  StatePager(std::unique_ptr<NvmeFile> file, std::vector<int64_t> regions, int64_t slots);
  ~StatePager();

  void prefetch(int64_t block);
  // overwrite (with write): the caller writes the whole region, so a block not in memory is not read; its slot
  // starts as zeros.
  char* acquire(int64_t block, bool write, bool overwrite = false);
  void release(int64_t block);
  // Waits until no read or write is queued or running; rethrows a failure.
  void flush();
  // Block l's slot while it is resident and held, else nullptr.
  char* memory(int64_t block) const;
  PagerStats stats() const;
  const NvmeFile& file() const { return *file_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t slots() const { return static_cast<int64_t>(slot_memory_.size()); }
  int64_t region_offset(int64_t block) const { return offsets_[block]; }
  void set_trace(StepTrace* trace);

 private:
  enum class State { kDisk, kQueued, kReading, kResident, kWriting };
  struct Block {
    State state = State::kDisk;
    int64_t slot = -1;
    int64_t holders = 0;
    int64_t waiters = 0;  // acquires waiting for it: once resident it stays until they have it
    bool dirty = false;
    bool expected = false;  // prefetched and not yet acquired
    bool urgent = false;    // an acquire waits for its read
    bool written = false;   // its region on disk has been written (before that it is zeros)
    bool discard = false;   // an overwriting acquire waits: fill the slot with zeros instead of reading
  };
  void run();
  int64_t free_slot(bool urgent);  // under the lock; -1 when none
  void check_failure() const;      // under the lock

  std::unique_ptr<NvmeFile> file_;
  std::vector<int64_t> regions_, offsets_;
  int64_t slot_bytes_ = 0;
  std::vector<std::shared_ptr<char>> slot_memory_;
  std::vector<int64_t> slot_owner_;  // block in each slot, -1 when free
  std::vector<Block> blocks_;
  std::deque<int64_t> reads_, writes_;
  int64_t busy_ = 0;  // I/O running now
  bool stop_ = false;
  std::exception_ptr failure_;
  PagerStats stats_;
  StepTrace* trace_ = nullptr;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::thread thread_;
};

}  // namespace megaslide::offload::detail
