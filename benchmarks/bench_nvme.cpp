// bench_nvme: the NVMe tier's throughput (offload.state_tier: nvme; docs/offload.md) against the disk's own
// O_DIRECT sequential rate, measured in the same run on the same folder.
//
// Anchor: one file written and then read in 64 MiB O_DIRECT requests, one at a time (pwrite/pread), as large
// as the tier's traffic; its write and read rates give the time the tier's bytes would take at the disk's
// sequential rate. The tier: a HostParamStore on the NVMe tier with --blocks blocks of --block-mib MiB of
// optimizer state each (fp32 master and moments), --in-flight buffers, cycled as the trainer cycles them:
// every block read ahead in update order, held (as an update would), released and written back, --passes
// times. Ratio = the anchor's time for the tier's bytes / the tier's time (the target: >= 0.8). The last line is
// one JSON object; exit status 1 when the ratio is under 0.8.
//
//   build/bin/bench_nvme [--dir /tmp] [--blocks 8] [--block-mib 256] [--in-flight 2] [--passes 3]
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/offload/host_param_store.h"
#include "megaslide/offload/nvme_file.h"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct DiskRate {
  double write_gbps = 0, read_gbps = 0;
  bool direct = false;
};

// The disk's sequential rate: `bytes` written then read back in 64 MiB O_DIRECT requests, one at a time.
DiskRate disk_rate(const std::string& dir, int64_t bytes) {
  const int64_t request = int64_t{64} << 20;
  const std::string path = dir + "/bench-nvme-anchor-" + std::to_string(::getpid()) + ".bin";
  DiskRate r;
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  r.direct = fd >= 0;
  if (fd < 0) fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) {
    std::perror(path.c_str());
    std::exit(2);
  }
  ::unlink(path.c_str());
  void* buffer = nullptr;
  if (posix_memalign(&buffer, megaslide::offload::kNvmeAlignment, static_cast<size_t>(request)) != 0) std::exit(2);
  std::memset(buffer, 0x5a, static_cast<size_t>(request));
  const int64_t n = (bytes + request - 1) / request;
  auto start = Clock::now();
  for (int64_t i = 0; i < n; ++i)
    if (::pwrite(fd, buffer, static_cast<size_t>(request), static_cast<off_t>(i * request)) != request) std::exit(3);
  ::fdatasync(fd);
  r.write_gbps = static_cast<double>(n * request) / seconds_since(start) / 1e9;
  start = Clock::now();
  for (int64_t i = 0; i < n; ++i)
    if (::pread(fd, buffer, static_cast<size_t>(request), static_cast<off_t>(i * request)) != request) std::exit(3);
  r.read_gbps = static_cast<double>(n * request) / seconds_since(start) / 1e9;
  ::close(fd);
  std::free(buffer);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp";
  int64_t blocks = 8, block_mib = 256, in_flight = 2, passes = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    else if (flag == "--blocks") blocks = std::atoll(argv[i + 1]);
    else if (flag == "--block-mib") block_mib = std::atoll(argv[i + 1]);
    else if (flag == "--in-flight") in_flight = std::atoll(argv[i + 1]);
    else if (flag == "--passes") passes = std::atoll(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_nvme: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  // fp32 master, m and v: 12 B a parameter, so a block of block_mib MiB of state has block_mib · 2^20 / 12 of them.
  const int64_t params = block_mib * (int64_t{1} << 20) / 12;
  std::vector<megaslide::offload::BlockSpec> specs;
  for (int64_t l = 0; l < blocks; ++l) specs.push_back({"blocks." + std::to_string(l), {{"w", {params}}}});
  megaslide::offload::HostParamStoreOptions o;
  o.state_tier = megaslide::offload::StateTier::kNvme;
  o.nvme_dir = dir;
  o.nvme_blocks_in_flight = in_flight;
  o.pin_if_cuda = false;
  megaslide::offload::HostParamStore store(specs, o);
  const auto report = store.memory_report();
  const auto* file = store.nvme_file();
  std::printf("bench_nvme: %lld blocks of %.1f MiB of state in %s (%s, %s), %lld in flight, %lld passes\n",
              static_cast<long long>(blocks), static_cast<double>(report.largest_region_bytes) / (1 << 20), dir.c_str(),
              file->engine(), file->direct() ? "O_DIRECT" : "buffered: the filesystem refuses O_DIRECT",
              static_cast<long long>(in_flight), static_cast<long long>(passes));
  // A first pass writes every region once (the file is fresh); the timed passes follow the trainer's cycle.
  for (int64_t l = 0; l < blocks; ++l) store.acquire_state(l);
  store.flush_state();
  const auto before = store.nvme_stats();
  const auto start = Clock::now();
  for (int64_t pass = 0; pass < passes; ++pass) {
    for (int64_t l = 0; l < blocks; ++l) store.prefetch_state(l);
    for (int64_t l = 0; l < blocks; ++l) store.acquire_state(l, /*write=*/true);  // held, then written back
  }
  store.flush_state();
  const double tier_s = seconds_since(start);
  const auto after = store.nvme_stats();
  const int64_t read = after.read_bytes - before.read_bytes, written = after.write_bytes - before.write_bytes;

  const DiskRate disk = disk_rate(dir, report.nvme_bytes);
  const double anchor_s =
      static_cast<double>(read) / (disk.read_gbps * 1e9) + static_cast<double>(written) / (disk.write_gbps * 1e9);
  const double ratio = anchor_s / tier_s;
  std::printf("disk (64 MiB %s requests, one at a time): write %.3f GB/s, read %.3f GB/s\n",
              disk.direct ? "O_DIRECT" : "buffered", disk.write_gbps, disk.read_gbps);
  std::printf(
      "tier: %lld B read + %lld B written in %.3f s (%.3f GB/s); waits %.3f s; the disk's rate would take "
      "%.3f s: ratio %.3f (target >= 0.8)\n",
      static_cast<long long>(read), static_cast<long long>(written), tier_s,
      static_cast<double>(read + written) / tier_s / 1e9, after.wait_s - before.wait_s, anchor_s, ratio);
  std::printf(
      "{\"bench\": \"nvme\", \"engine\": \"%s\", \"direct\": %s, \"blocks\": %lld, \"region_bytes\": %lld, "
      "\"in_flight\": %lld, \"read_bytes\": %lld, \"write_bytes\": %lld, \"tier_s\": %.6f, \"disk_write_gbps\": %.4f, "
      "\"disk_read_gbps\": %.4f, \"anchor_s\": %.6f, \"ratio\": %.4f}\n",
      file->engine(), file->direct() ? "true" : "false", static_cast<long long>(blocks),
      static_cast<long long>(report.largest_region_bytes), static_cast<long long>(in_flight),
      static_cast<long long>(read), static_cast<long long>(written), tier_s, disk.write_gbps, disk.read_gbps, anchor_s,
      ratio);
  return ratio >= 0.8 ? 0 : 1;
}
