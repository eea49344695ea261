// The NVMe tier (offload.state_tier: nvme; docs/offload.md): the scratch file's I/O, the host store that
// pages a block's state in and out around its update, and the trainer on it — the RAM tier's numbers bit for
// bit, checkpoints either tier resumes, and a run stopped by a full disk or killed mid-write-back.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/offload/nvme_file.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/trainer.h"
#include "run_tool.h"
#include "trainers.h"

using namespace megaslide;
using offload::NvmeError;
using offload::NvmeFile;
using offload::NvmeFileOptions;

namespace {

std::string scratch(const std::string& name) {
  const std::string dir = "/tmp/megaslide-test-nvme-" + name + "-" + std::to_string(::getpid());
  io::remove_tree(dir);
  io::make_directories(dir);
  return dir;
}

std::shared_ptr<char> aligned_bytes(int64_t n) {
  void* p = nullptr;
  EXPECT_EQ(posix_memalign(&p, offload::kNvmeAlignment, static_cast<size_t>(n)), 0);
  return {static_cast<char*>(p), [](char* q) { std::free(q); }};
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

// Property: what is written comes back byte for byte, through io_uring and pread/pwrite, with and without
// O_DIRECT, in pieces that do not divide the request; the file is gone from its folder while still in use.
TEST(NvmeFile, WritesAndReadsBackEveryByteWithEachEngine) {
  const std::string dir = scratch("file");
  const int64_t pages = 41, bytes = pages * offload::kNvmeAlignment;
  std::mt19937 rng(7);
  for (const bool uring : {true, false}) {
    for (const bool direct : {true, false}) {
      NvmeFileOptions o;
      o.io_uring = uring;
      o.direct = direct;
      o.chunk_bytes = 3 * offload::kNvmeAlignment;
      o.queue_depth = 4;
      o.threads = 3;
      NvmeFile file(dir, "round-trip.bin", bytes - 100, o);  // rounded up to whole pages
      SCOPED_TRACE(std::string(file.engine()) + (file.direct() ? " O_DIRECT" : " buffered"));
      EXPECT_EQ(file.size(), bytes);
      if (!uring || !offload::nvme_io_uring_built()) EXPECT_STREQ(file.engine(), "pread");
      if (!direct) EXPECT_FALSE(file.direct());
      EXPECT_FALSE(io::path_exists(file.path())) << "the scratch file must be unlinked at once";
      auto data = aligned_bytes(bytes), back = aligned_bytes(bytes);
      for (int64_t i = 0; i < bytes; ++i) data.get()[i] = static_cast<char>(rng());
      file.write(0, data.get(), bytes);
      // A second write over part of it, then the whole read back.
      for (int64_t i = 0; i < 7 * offload::kNvmeAlignment; ++i) data.get()[20 * offload::kNvmeAlignment + i] ^= 0x5a;
      file.write(20 * offload::kNvmeAlignment, data.get() + 20 * offload::kNvmeAlignment, 7 * offload::kNvmeAlignment);
      file.read(0, back.get(), bytes);
      EXPECT_EQ(std::memcmp(data.get(), back.get(), static_cast<size_t>(bytes)), 0);
    }
  }
  io::remove_tree(dir);
}

// Property: a folder that is not there, a disk too small for the state (an input error), a file size limit below it
// (named as the limit) and a write the disk refuses each stop with a message naming what is wrong and where.
TEST(NvmeFile, AMissingFolderATooSmallDiskAndAFailedWriteAreNamed) {
  const std::string dir = scratch("errors");
  const std::string missing = message_of([&] { NvmeFile(dir + "/nope", "x.bin", 4096); });
  EXPECT_NE(missing.find("offload.nvme_dir"), std::string::npos) << missing;
  EXPECT_NE(missing.find(dir + "/nope"), std::string::npos) << missing;
  const std::string huge = message_of([&] { NvmeFile(dir, "huge.bin", int64_t{1} << 60); });
  EXPECT_NE(huge.find("cannot reserve"), std::string::npos) << huge;
  EXPECT_NE(huge.find("free"), std::string::npos) << huge;
  // A disk too small is the config's to change (a tool exits 2), found before anything is written.
  try {
    NvmeFile(dir, "huge2.bin", int64_t{1} << 60);
    ADD_FAILURE() << "reserved 2^60 bytes";
  } catch (const offload::NvmeSpaceError& e) {
    EXPECT_TRUE(is_input_error(e));
  }
  // A file size limit (`ulimit -f`) below the file is named as that, not as the disk's free space.
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  rlimit low = before;
  low.rlim_cur = 8192;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &low), 0);
  const std::string limited = message_of([&] { NvmeFile(dir, "limited.bin", 16 * 4096); });
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(limited.find("file size limit"), std::string::npos) << limited;
  EXPECT_NE(limited.find("8192"), std::string::npos) << limited;
  EXPECT_EQ(limited.find("Free space there"), std::string::npos) << limited;
  NvmeFileOptions o;
  o.fail_writes_after_bytes = 4096;
  NvmeFile file(dir, "full.bin", 4 * 4096, o);
  auto data = aligned_bytes(2 * 4096);
  std::memset(data.get(), 1, 2 * 4096);
  const std::string full = message_of([&] { file.write(4096, data.get(), 2 * 4096); });
  EXPECT_NE(full.find("disk is full"), std::string::npos) << full;
  EXPECT_NE(full.find(file.path()), std::string::npos) << full;
  io::remove_tree(dir);
}

namespace {
// A store on the NVMe tier in `dir`: two blocks in flight, with an EMA.
offload::HostParamStoreOptions nvme_store_options(const std::string& dir) {
  offload::HostParamStoreOptions o;
  o.state_tier = offload::StateTier::kNvme;
  o.nvme_dir = dir;
  o.nvme_blocks_in_flight = 2;
  o.ema = true;
  return o;
}
}  // namespace

// Property: on the NVMe tier a block's state exists in memory only while leased (the accessors refuse it
// otherwise), what a write lease leaves is what the next lease reads — across more blocks than there are
// buffers, read ahead in any order — and host memory holds the buffers, not the state.
TEST(HostParamStore, TheNvmeTierHoldsABlocksStateOnlyWhileLeasedAndKeepsWhatWasWritten) {
  const std::string dir = scratch("store");
  std::vector<offload::BlockSpec> blocks;
  for (int64_t l = 0; l < 5; ++l) blocks.push_back({"blocks." + std::to_string(l), {{"w", {33 + l, 17}}, {"b", {17}}}});
  offload::HostParamStore store(blocks, nvme_store_options(dir));
  ASSERT_TRUE(store.paged());
  EXPECT_THROW(store.master(0), c10::Error);
  EXPECT_FALSE(store.param(0, "w").master.defined());
  std::vector<torch::Tensor> w;
  for (int64_t l = 0; l < 5; ++l) {
    w.push_back(torch::randn({33 + l, 17}));
    store.set_param(l, "w", w.back());
  }
  for (int64_t l = 0; l < 5; ++l) {
    const auto lease = store.acquire_state(l);
    store.exp_avg(l).fill_(static_cast<float>(l) + 0.5f);
    store.ema(l).copy_(store.master(l));
  }
  for (int64_t l = 4; l >= 0; --l) store.prefetch_state(l);
  for (int64_t l = 4; l >= 0; --l) {
    const auto lease = store.acquire_state(l, /*write=*/false);
    const auto v = store.param(l, "w");
    EXPECT_TRUE(torch::equal(v.master, w[l])) << "block " << l;
    EXPECT_TRUE(torch::equal(v.ema, w[l])) << "block " << l;
    EXPECT_TRUE(torch::equal(v.compute, w[l].to(at::kBFloat16))) << "block " << l;
    EXPECT_TRUE(store.exp_avg(l).eq(static_cast<float>(l) + 0.5f).all().item<bool>()) << "block " << l;
    EXPECT_TRUE(store.exp_avg_sq(l).eq(0).all().item<bool>()) << "block " << l;
  }
  store.flush_state();
  const auto stats = store.nvme_stats();
  const auto report = store.memory_report();
  EXPECT_GT(stats.read_bytes, 0);
  EXPECT_GE(stats.write_bytes, report.nvme_bytes) << "every block was written at least once";
  EXPECT_EQ(report.nvme_buffer_bytes, 2 * report.largest_region_bytes);
  EXPECT_EQ(report.total_bytes(), report.nvme_buffer_bytes + report.compute_bytes);
  EXPECT_GT(report.state_bytes(), report.nvme_buffer_bytes);
  EXPECT_NE(report.to_string().find("[on NVMe]"), std::string::npos) << report.to_string();
  // More buffers asked for than there are blocks are as many as the blocks (1024 of them would hold 1024 blocks'
  // state for a model of 5).
  auto many = nvme_store_options(dir);
  many.nvme_blocks_in_flight = 1024;
  EXPECT_EQ(offload::HostParamStore::plan(blocks, many).nvme_buffer_bytes, 5 * report.largest_region_bytes);
  io::remove_tree(dir);
}

// Property: the state file is new, so a block's state starts as zeros and is not read from the disk until it
// has been written back once; a block written back and evicted is read again, with what was written.
TEST(HostParamStore, ANewNvmeStoresBlocksStartAsZerosWithoutAReadFromTheDisk) {
  const std::string dir = scratch("zeros");
  std::vector<offload::BlockSpec> blocks;
  for (int64_t l = 0; l < 4; ++l) blocks.push_back({"blocks." + std::to_string(l), {{"w", {40 + l, 9}}}});
  offload::HostParamStore store(blocks, nvme_store_options(dir));
  for (int64_t l = 0; l < 4; ++l) {
    const auto lease = store.acquire_state(l, /*write=*/false);
    for (const auto& part : {store.master(l), store.exp_avg(l), store.exp_avg_sq(l), store.ema(l)})
      EXPECT_TRUE(part.eq(0).all().item<bool>()) << "block " << l;
  }
  std::vector<torch::Tensor> w;
  for (int64_t l = 0; l < 4; ++l) {
    w.push_back(torch::randn({40 + l, 9}));
    store.set_param(l, "w", w.back());
  }
  store.flush_state();
  const auto before = store.nvme_stats();
  EXPECT_EQ(before.read_bytes, 0) << "no block had been written back when it was acquired";
  EXPECT_GE(before.write_bytes, store.memory_report().nvme_bytes) << "set_param wrote every block back";
  for (int64_t l = 0; l < 4; ++l) {
    const auto lease = store.acquire_state(l, /*write=*/false);
    EXPECT_TRUE(torch::equal(store.param(l, "w").master, w[l])) << "block " << l;
    EXPECT_TRUE(store.exp_avg(l).eq(0).all().item<bool>()) << "block " << l;
  }
  EXPECT_GT(store.nvme_stats().read_bytes, 0) << "the blocks evicted after their write-back were read again";
  io::remove_tree(dir);
}

// Property: with more threads acquiring than there are buffers, each block is read from the disk once: a block
// read for an acquire that waits stays in its buffer until that acquire has it (the I/O thread evicted it for the
// next waiting acquire before its own woke, and read it again: many reads of one block before).
TEST(HostParamStore, BlocksReadForWaitingAcquiresAreNotEvictedBeforeTheyWake) {
  const std::string dir = scratch("waiters");
  constexpr int64_t kBlocks = 12;
  std::vector<offload::BlockSpec> blocks;
  for (int64_t l = 0; l < kBlocks; ++l) blocks.push_back({"blocks." + std::to_string(l), {{"w", {64, 33}}}});
  offload::HostParamStore store(blocks, nvme_store_options(dir));  // 2 buffers
  std::vector<torch::Tensor> w;
  for (int64_t l = 0; l < kBlocks; ++l) {
    w.push_back(torch::randn({64, 33}));
    store.set_param(l, "w", w.back());  // written back: the next acquire reads from the disk
  }
  store.flush_state();
  const int64_t region = store.memory_report().largest_region_bytes;  // every block's (the same shapes)
  for (int round = 0; round < 3; ++round) {
    const auto before = store.nvme_stats();
    std::atomic<int> ready{0};
    std::vector<int> same(kBlocks, 0);
    std::vector<std::thread> threads;
    for (int64_t l = 0; l < kBlocks; ++l)
      threads.emplace_back([&, l] {
        ++ready;
        while (ready.load() < kBlocks) std::this_thread::yield();
        const auto lease = store.acquire_state(l, /*write=*/false);
        same[static_cast<size_t>(l)] = torch::equal(store.param(l, "w").master, w[static_cast<size_t>(l)]);
      });
    for (auto& t : threads) t.join();
    for (int64_t l = 0; l < kBlocks; ++l) EXPECT_TRUE(same[static_cast<size_t>(l)]) << "block " << l;
    const int64_t reads = (store.nvme_stats().read_bytes - before.read_bytes) / region;
    // At most the two blocks left in the buffers by the previous round are not read again.
    EXPECT_LE(reads, kBlocks) << "round " << round;
    EXPECT_GE(reads, kBlocks - 2) << "round " << round;
  }
  io::remove_tree(dir);
}

namespace {

// The tiny run of a family (tests/support/trainers.h; "dit" with 3 blocks), streamed, on `tier`, with `extra`.
RunConfig tiny(const std::string& family, const std::string& tier, const std::string& dir,
               const std::vector<std::string>& extra) {
  std::vector<std::string> sets{"offload.enabled=true", "offload.state_tier=" + tier, "offload.nvme_dir=" + dir};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return megaslide::testing::tiny_run_config(family, dir, sets, /*layers=*/3);
}

using megaslide::testing::trainer_of;

// Every tensor of the training state, the blocks as their flat buffers (held one at a time on the NVMe tier).
std::map<std::string, torch::Tensor> full_state(Trainer& trainer) {
  TrainingState s = trainer.training_state();
  std::map<std::string, torch::Tensor> out;
  std::set<std::string> in_blocks;
  if (s.shards) {
    for (size_t l = 0; l < s.shards->blocks.size(); ++l) {
      const auto held = s.shards->held(static_cast<int64_t>(l), TrainingState::BlockShards::Access::kRead);
      const auto& b = held.block;
      for (const auto& [name, shape] : b.params) in_blocks.insert(b.name + "." + name);
      const std::pair<const char*, const torch::Tensor*> parts[] = {
          {"#master", &b.master}, {"#exp_avg", &b.exp_avg},       {"#exp_avg_sq", &b.exp_avg_sq},
          {"#ema", &b.ema},       {"#m_scale", &b.exp_avg_scale}, {"#v_scale", &b.exp_avg_sq_scale}};
      for (const auto& [suffix, t] : parts)
        if (t->defined()) out[b.name + suffix] = t->clone();
    }
  }
  const std::pair<const char*, const io::NamedTensors*> lists[] = {
      {"master:", &s.master}, {"exp_avg:", &s.exp_avg}, {"exp_avg_sq:", &s.exp_avg_sq}, {"ema:", &s.ema}};
  for (const auto& [prefix, list] : lists)
    for (const auto& [name, t] : *list)
      if (!in_blocks.count(name)) out[prefix + name] = t.clone();
  return out;
}

void expect_same_state(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name << " differs";
  }
}

struct Variant {
  std::string family;
  std::vector<std::string> sets;
  std::string name;
};

class NvmeTier : public ::testing::TestWithParam<Variant> {};

}  // namespace

// Property: a run on the NVMe tier is the RAM tier's bit for bit — every loss and gradient norm over 3
// steps, and every master, moment (with int8 scales) and EMA after them — with immediate and deferred
// updates, clipping, accumulation, fp16 loss scaling, fp32 compute and each moment dtype; its steps read and
// write each block's state once.
TEST_P(NvmeTier, IsTheRamTierBitForBit) {
  const Variant& v = GetParam();
  const std::string dir = scratch("same-" + v.name);
  auto ram = trainer_of(tiny(v.family, "ram", dir, v.sets));
  auto nvme = trainer_of(tiny(v.family, "nvme", dir, v.sets));
  const auto& store = nvme->engine()->store();
  ASSERT_TRUE(store.paged());
  ASSERT_FALSE(ram->engine()->store().paged());
  const auto before = store.nvme_stats();
  const int steps = 3;
  for (int i = 0; i < steps; ++i) {
    const auto a = ram->step(), b = nvme->step();
    EXPECT_EQ(a.loss, b.loss) << "step " << i + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << i + 1;
    EXPECT_EQ(a.skipped, b.skipped) << "step " << i + 1;
    EXPECT_TRUE(b.nvme);
    EXPECT_FALSE(a.nvme);
  }
  // A step's figures count the reads that completed during it: the reads ahead of deferred updates land in
  // this step's or the next one's, as the I/O thread is scheduled. Over the run, once its I/O is done, each
  // block's state was read at least in the first step and at most once a step (4 KiB-aligned regions).
  nvme->synchronize();
  const auto after = store.nvme_stats();
  const int64_t file_bytes = store.memory_report().nvme_bytes;
  EXPECT_GE(after.read_bytes - before.read_bytes, file_bytes);
  EXPECT_LE(after.read_bytes - before.read_bytes, steps * file_bytes);
  expect_same_state(full_state(*ram), full_state(*nvme));
  io::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Variants, NvmeTier,
    ::testing::Values(Variant{"dit", {"offload.compute_dtype=bf16", "train.grad_clip=0"}, "dit_immediate"},
                      Variant{"wan", {"offload.compute_dtype=bf16", "train.grad_clip=0"}, "wan_immediate"},
                      Variant{"dit",
                              {"offload.compute_dtype=bf16", "train.grad_clip=1.0", "train.grad_accum_steps=2",
                               "train.ema_decay=0.9"},
                              "dit_clip_accumulation_ema"},
                      Variant{"wan",
                              {"offload.compute_dtype=fp32", "train.grad_clip=0.5", "optimizer.state_dtype=int8"},
                              "wan_fp32_int8"},
                      Variant{"dit", {"offload.compute_dtype=fp16", "optimizer.state_dtype=bf16"}, "dit_fp16_bf16"}),
    [](const auto& info) { return info.param.name; });

// Property: a checkpoint saved on either tier resumes on either tier bit for bit: the resumed run's next
// losses and final state are those of the run that was never stopped (RAM tier); loading it onto the NVMe
// tier writes the state file without reading it.
TEST(NvmeTierCheckpoints, EitherTiersCheckpointResumesOnEitherTierBitExactly) {
  const std::string dir = scratch("resume");
  const std::vector<std::string> sets{"offload.compute_dtype=bf16", "train.grad_clip=1.0", "train.ema_decay=0.9",
                                      "optimizer.state_dtype=int8"};
  const RunConfig ram_config = tiny("dit", "ram", dir, sets), nvme_config = tiny("dit", "nvme", dir, sets);
  auto whole = trainer_of(ram_config);
  std::vector<double> losses;
  for (int i = 0; i < 4; ++i) losses.push_back(whole->step().loss);
  const auto expected = full_state(*whole);
  for (const auto& [from, to] :
       std::vector<std::pair<std::string, std::string>>{{"nvme", "ram"}, {"ram", "nvme"}, {"nvme", "nvme"}}) {
    SCOPED_TRACE(from + " -> " + to);
    const RunConfig& save_config = from == "nvme" ? nvme_config : ram_config;
    const RunConfig& load_config = to == "nvme" ? nvme_config : ram_config;
    const std::string run_dir = dir + "/run-" + from + "-" + to;
    std::string path;
    {
      auto first = trainer_of(save_config);
      for (int i = 0; i < 2; ++i) first->step();
      path = save_checkpoint(run_dir, save_config, first->training_state());
    }
    auto second = trainer_of(load_config);
    second->synchronize();
    const auto built = second->engine()->store().nvme_stats();
    TrainingState into = second->training_state();
    load_checkpoint(path, load_config, into);
    second->load_training_state(into);
    second->synchronize();
    const auto loaded = second->engine()->store().nvme_stats();
    if (to == "nvme") {
      // The checkpoint overwrites every block's state: the scratch file is written, never read, by the load.
      EXPECT_EQ(loaded.read_bytes - built.read_bytes, 0);
      EXPECT_GE(loaded.write_bytes - built.write_bytes, second->engine()->store().memory_report().nvme_bytes);
    }
    for (int i = 2; i < 4; ++i) {
      const auto m = second->step();
      EXPECT_EQ(m.loss, losses[i]) << "step " << i + 1;
      if (to != "nvme" || i != 2) continue;
      // The first step's NVMe figures leave out the I/O before it (the initial load, the resume's writes): they are
      // at most what the tier did since.
      const auto now = second->engine()->store().nvme_stats();
      EXPECT_LE(m.nvme_write_bytes, now.write_bytes - loaded.write_bytes);
      EXPECT_LE(m.nvme_read_bytes, now.read_bytes - loaded.read_bytes);
      EXPECT_LE(m.nvme_write_s, now.write_s - loaded.write_s);
      EXPECT_LE(m.nvme_wait_s, now.wait_s - loaded.wait_s);
    }
    expect_same_state(expected, full_state(*second));
  }
  io::remove_tree(dir);
}

// Property: the NVMe tier's I/O between steps that Trainer::outside_steps wraps (a checkpoint's save, validation
// videos) is no step's: the steps' write figures and that work's writes add up to no more than the tier wrote. Were
// the work's writes (every block written three times) counted in the next step, the sum would exceed it by them.
TEST(NvmeTierCheckpoints, IoBetweenStepsIsNoStepsFigure) {
  const std::string dir = scratch("outside");
  auto trainer = trainer_of(tiny("dit", "nvme", dir, {"offload.compute_dtype=bf16", "train.grad_clip=0"}));
  trainer->synchronize();
  const auto& store = trainer->engine()->store();
  const auto start = store.nvme_stats();
  const auto first = trainer->step();
  int64_t outside = 0;
  trainer->outside_steps([&] {
    const auto before = store.nvme_stats();
    for (int pass = 0; pass < 3; ++pass)
      for (int64_t l = 0; l < store.num_blocks(); ++l) {
        const auto lease = store.acquire_state(l, /*write=*/true);
      }
    store.flush_state();
    outside = store.nvme_stats().write_bytes - before.write_bytes;
  });
  ASSERT_GE(outside, 3 * store.memory_report().nvme_bytes);
  const auto second = trainer->step();
  const auto now = store.nvme_stats();
  EXPECT_LE(first.nvme_write_bytes + second.nvme_write_bytes + outside, now.write_bytes - start.write_bytes);
  EXPECT_GT(second.nvme_write_bytes + first.nvme_write_bytes, 0) << "the steps' own write-backs are still counted";
  io::remove_tree(dir);
}

namespace {

std::vector<std::string> logged(const std::string& run_dir, const char* key) {
  std::vector<std::string> out;
  std::ifstream in(io::join_path(run_dir, "metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    out.push_back(j.contains(key) ? j[key].dump() : "");
  }
  return out;
}

std::string smoke_args(const std::string& run_dir, int steps) {
  return "--config " + std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml --run-dir " + run_dir +
         " --set train.steps=" + std::to_string(steps) +
         " --set output.progress=false --set train.threads=1 --set train.checkpoint_every=4 --set train.log_every=1";
}

}  // namespace

// Property: megaslide-train on the NVMe tier logs the RAM tier's losses exactly on the smoke config, with
// the tier's reads, write-backs and waits in metrics.jsonl.
TEST(NvmeTierRuns, TheSmokeRunOnNvmeLogsTheRamTiersLosses) {
  const std::string dir = scratch("smoke");
  const std::string ram = dir + "/ram", nvme = dir + "/nvme";
  auto r = megaslide::testing::run_tool("megaslide-train", smoke_args(ram, 8));
  ASSERT_EQ(r.code, 0) << r.output;
  r = megaslide::testing::run_tool(
      "megaslide-train", smoke_args(nvme, 8) + " --set offload.state_tier=nvme" + " --set offload.nvme_dir=" + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(logged(nvme, "loss"), logged(ram, "loss"));
  for (const char* key : {"nvme_read_bytes", "nvme_write_bytes", "nvme_read_s", "nvme_write_s", "nvme_wait_s"}) {
    const auto values = logged(nvme, key);
    ASSERT_EQ(values.size(), 8u);
    for (const auto& value : values) EXPECT_FALSE(value.empty()) << key << " missing from metrics.jsonl";
  }
  // Which step a read ahead of a deferred update is counted in depends on the I/O thread's timing; the run reads.
  int64_t reads = 0;
  for (const auto& value : logged(nvme, "nvme_read_bytes")) reads += std::stoll(value);
  EXPECT_GT(reads, 0);
  EXPECT_EQ(logged(ram, "nvme_read_bytes").back(), "") << "the RAM tier logs no NVMe figures";
  // train.log names the state file and how it is read and written (O_DIRECT, or buffered where refused).
  const std::string log = io::read_file(nvme + "/train.log");
  EXPECT_NE(log.find("NVMe tier: state file " + dir + "/megaslide-state-"), std::string::npos) << log;
  EXPECT_TRUE(log.find(" I/O, O_DIRECT") != std::string::npos || log.find(" I/O, buffered") != std::string::npos)
      << log;
  io::remove_tree(dir);
}

// Property: a run killed in the middle of writing a block's state back leaves its last checkpoint intact
// and resumes from it bit-exactly (the scratch file is rebuilt from the checkpoint); a disk that fills
// stops the run with a message naming the state file and the full disk, and its checkpoint stays whole.
TEST(NvmeTierRuns, AKillDuringAWriteBackResumesBitExactlyAndAFullDiskStopsTheRunCleanly) {
  const std::string dir = scratch("kill");
  const std::string whole = dir + "/whole", killed = dir + "/killed", full = dir + "/full";
  const std::string nvme = " --set offload.state_tier=nvme --set offload.nvme_dir=" + dir;
  auto r = megaslide::testing::run_tool("megaslide-train", smoke_args(whole, 10));
  ASSERT_EQ(r.code, 0) << r.output;
  // The smoke model has 2 blocks: 2 write-backs when it is loaded, then 2 a step. Write 13 is the first of
  // step 6, after the checkpoint of step 4.
  r = megaslide::testing::run_tool("megaslide-train",
                                   "--set offload.nvme_blocks_in_flight=2 " + smoke_args(killed, 10) + nvme);
  ASSERT_EQ(r.code, 0) << "a run without the kill must pass first: " << r.output;
  io::remove_tree(killed);
  const std::string command = "MEGASLIDE_TEST_NVME_KILL_AT_WRITE=13 " + std::string(MEGASLIDE_BINARY_DIR) +
                              "/bin/megaslide-train " + smoke_args(killed, 10) + nvme + " > " + dir +
                              "/killed.log 2>&1";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGKILL))
      << "the run was not killed (status " << status << ")";
  EXPECT_EQ(latest_checkpoint(killed), io::join_path(killed, "checkpoints/step-0000004"));
  r = megaslide::testing::run_tool("megaslide-train", smoke_args(killed, 10) + nvme + " --resume latest");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(logged(killed, "loss"), logged(whole, "loss"));

  // A full disk: the writes from step 6 on fail.
  const std::string full_command = "MEGASLIDE_TEST_NVME_FAIL_AT_WRITE=13 " + std::string(MEGASLIDE_BINARY_DIR) +
                                   "/bin/megaslide-train " + smoke_args(full, 10) + nvme + " > " + dir +
                                   "/full.log 2>&1";
  const int full_status = std::system(full_command.c_str());
  std::ifstream log(dir + "/full.log");
  const std::string output((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(full_status) && WEXITSTATUS(full_status) != 0) << output;
  EXPECT_NE(output.find("disk is full"), std::string::npos) << output;
  EXPECT_NE(output.find("megaslide-state-"), std::string::npos) << output;
  const std::string latest = latest_checkpoint(full);
  ASSERT_FALSE(latest.empty()) << output;
  EXPECT_NO_THROW(verify_checkpoint(latest)) << output;
  io::remove_tree(dir);
}
