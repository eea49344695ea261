// util/cpu_resources.h: native bf16 detection (CPUID, checked against the kernel's own /proc/cpuinfo flags,
// and oneDNN's ISA cap), and the cores available to a process — the affinity mask capped by the cgroup
// v2 / v1 CPU quota of the process's cgroup and its ancestors — on fake cgroup trees.
#include "megaslide/util/cpu_resources.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "megaslide/io/files.h"

using megaslide::available_cores;
using megaslide::cpu_bf16_support;
using megaslide::io::join_path;

namespace {

// A folder of fake cgroup files, removed at the end of the test.
class FakeCgroups {
 public:
  explicit FakeCgroups(const std::string& name)
      : root_("/tmp/megaslide-test-cgroup-" + name + "-" + std::to_string(::getpid())) {
    megaslide::io::remove_tree(root_);
    megaslide::io::make_directories(root_);
  }
  ~FakeCgroups() { megaslide::io::remove_tree(root_); }
  void write(const std::string& relative, const std::string& text) {
    const std::string path = join_path(root_, relative);
    megaslide::io::make_directories(path.substr(0, path.find_last_of('/')));
    std::ofstream(path) << text;
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

std::set<std::string> proc_cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string w; words >> w;) flags.insert(w);
    return flags;
  }
  return {};
}

}  // namespace

TEST(CpuResources, CgroupV2QuotaIsTheTightestOfTheCgroupAndItsAncestors) {
  FakeCgroups fs("v2");
  fs.write("cgroup.controllers", "cpu memory\n");
  fs.write("a/cpu.max", "max 100000\n");
  fs.write("a/b/cpu.max", "150000 100000\n");  // 1.5 CPUs
  auto c = available_cores(8, "0::/a/b\n", fs.root());
  EXPECT_DOUBLE_EQ(c.quota_cpus, 1.5);
  EXPECT_EQ(c.cores, 2) << "a fractional quota rounds up";
  EXPECT_EQ(c.quota_file, join_path(fs.root(), "a/b/cpu.max"));
  EXPECT_NE(c.describe().find("quota 1.5 CPUs"), std::string::npos) << c.describe();

  fs.write("a/cpu.max", "50000 100000\n");  // the parent grants half a CPU: it bounds the child
  c = available_cores(8, "0::/a/b\n", fs.root());
  EXPECT_DOUBLE_EQ(c.quota_cpus, 0.5);
  EXPECT_EQ(c.cores, 1);
  EXPECT_EQ(c.quota_file, join_path(fs.root(), "a/cpu.max"));

  fs.write("a/cpu.max", "max 100000\n");
  fs.write("a/b/cpu.max", "max 100000\n");
  c = available_cores(8, "0::/a/b\n", fs.root());
  EXPECT_EQ(c.quota_cpus, 0);
  EXPECT_EQ(c.cores, 8) << "no quota: the affinity mask decides";
  EXPECT_NE(c.describe().find("no cgroup CPU quota"), std::string::npos) << c.describe();

  fs.write("a/b/cpu.max", "1600000 100000\n");  // 16 CPUs of quota on 8 CPUs of affinity
  EXPECT_EQ(available_cores(8, "0::/a/b\n", fs.root()).cores, 8);

  // Inside a cgroup namespace the process sees itself at "/" and its cgroup is the mount's root.
  fs.write("cpu.max", "200000 100000\n");
  c = available_cores(16, "0::/\n", fs.root());
  EXPECT_EQ(c.cores, 2);
}

TEST(CpuResources, CgroupV2OnAHybridMachineLivesUnderUnified) {
  FakeCgroups fs("hybrid");
  fs.write("unified/cgroup.controllers", "\n");
  fs.write("unified/job/cpu.max", "300000 100000\n");
  EXPECT_EQ(available_cores(8, "0::/job\n", fs.root()).cores, 3);
}

TEST(CpuResources, CgroupV1QuotaFromCfsQuotaAndPeriod) {
  FakeCgroups fs("v1");
  const std::string cgroup = "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n0::/\n";
  fs.write("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  fs.write("cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  fs.write("cpu,cpuacct/docker/cpu.cfs_period_us", "100000\n");
  fs.write("cpu,cpuacct/docker/cpu.cfs_quota_us", "-1\n");
  fs.write("cpu,cpuacct/docker/x/cpu.cfs_period_us", "100000\n");
  fs.write("cpu,cpuacct/docker/x/cpu.cfs_quota_us", "300000\n");
  auto c = available_cores(64, cgroup, fs.root());
  EXPECT_DOUBLE_EQ(c.quota_cpus, 3.0);
  EXPECT_EQ(c.cores, 3);
  EXPECT_EQ(c.quota_file, join_path(fs.root(), "cpu,cpuacct/docker/x/cpu.cfs_quota_us"));

  fs.write("cpu,cpuacct/docker/x/cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(available_cores(64, cgroup, fs.root()).cores, 64) << "-1: no quota";

  // A cgroup namespace: the process's path does not exist under the mount, whose root is its cgroup.
  FakeCgroups ns("v1ns");
  ns.write("cpu/cpu.cfs_period_us", "100000\n");
  ns.write("cpu/cpu.cfs_quota_us", "100000\n");
  EXPECT_EQ(available_cores(4, "3:cpu:/kubepods/pod1/c1\n", ns.root()).cores, 1);
}

TEST(CpuResources, UnreadableOrMalformedQuotaFilesSetNoQuota) {
  FakeCgroups fs("bad");
  fs.write("cgroup.controllers", "cpu\n");
  for (const char* text : {"", "garbage\n", "-5 100000\n", "100000 0\n", "1e999 100000\n", "max\n"}) {
    fs.write("j/cpu.max", text);
    const auto c = available_cores(4, "0::/j\n", fs.root());
    EXPECT_EQ(c.quota_cpus, 0) << "'" << text << "'";
    EXPECT_EQ(c.cores, 4) << "'" << text << "'";
  }
  EXPECT_EQ(available_cores(4, "no colons here\n\n", fs.root()).cores, 4);
  EXPECT_EQ(available_cores(4, "0::/j\n", "/nonexistent-cgroup-root").cores, 4);
  EXPECT_EQ(available_cores(0, "", fs.root()).cores, 1) << "at least one core";
}

TEST(CpuResources, ThisProcessGetsItsAffinityMaskAtMost) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const auto c = available_cores();
  EXPECT_EQ(c.affinity_cpus, CPU_COUNT(&set));
  EXPECT_GE(c.cores, 1);
  EXPECT_LE(c.cores, c.affinity_cpus);
  std::cout << "this process: " << c.describe() << "\n";
}

TEST(CpuResources, NativeBf16DecisionAndOneDnnCap) {
  EXPECT_TRUE(cpu_bf16_support(true, false, "").native);
  EXPECT_FALSE(cpu_bf16_support(false, false, "").native);
  EXPECT_FALSE(cpu_bf16_support(true, false, "AVX2").native) << "oneDNN capped below AVX512-BF16 emulates bf16";
  EXPECT_FALSE(cpu_bf16_support(true, true, "avx512_core_vnni").native) << "names are case-insensitive";
  EXPECT_TRUE(cpu_bf16_support(true, false, "avx512_core_bf16").native);
  EXPECT_FALSE(cpu_bf16_support(false, true, "AVX512_CORE_BF16").native) << "that cap keeps AMX off";
  EXPECT_TRUE(cpu_bf16_support(false, true, "AVX512_CORE_AMX").native);
  EXPECT_TRUE(cpu_bf16_support(false, true, "ALL").native);
  EXPECT_TRUE(cpu_bf16_support(true, false, "NOT_AN_ISA").native) << "oneDNN ignores a name it does not know";
  EXPECT_EQ(cpu_bf16_support(false, false, "").describe(), "no AVX512-BF16 or AMX-BF16");
  EXPECT_EQ(cpu_bf16_support(true, false, "").describe(), "AVX512-BF16");
  EXPECT_EQ(cpu_bf16_support(true, true, "").describe(), "AVX512-BF16 and AMX-BF16");
  EXPECT_EQ(cpu_bf16_support(true, false, "AVX2").describe(),
            "AVX512-BF16, but ONEDNN_MAX_CPU_ISA=AVX2 keeps LibTorch from it");
}

// CPUID against an independent reader: the kernel lists avx512_bf16 and amx_bf16 in /proc/cpuinfo only for
// features the CPU has and the OS enabled.
TEST(CpuResources, CpuidAgreesWithTheKernelsCpuFlags) {
  const auto flags = proc_cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no flags line in /proc/cpuinfo";
  const auto s = cpu_bf16_support();
  EXPECT_EQ(s.avx512_bf16, flags.count("avx512_bf16") == 1);
  EXPECT_EQ(s.amx_bf16, flags.count("amx_bf16") == 1 && flags.count("amx_tile") == 1);
  if (std::getenv("ONEDNN_MAX_CPU_ISA") == nullptr && std::getenv("DNNL_MAX_CPU_ISA") == nullptr)
    EXPECT_EQ(s.native, s.avx512_bf16 || s.amx_bf16);
  std::cout << "this CPU: " << s.describe() << "\n";
}
