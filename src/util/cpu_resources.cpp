#include "megaslide/util/cpu_resources.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

#include "megaslide/util/numbers.h"
#include "util/cpu_features.h"

namespace megaslide {

namespace {

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// What a oneDNN ISA cap admits: 0 neither, 1 AVX512-BF16 only, 2 AVX512-BF16 and AMX.
int onednn_cap_admits(const std::string& cap) {
  const std::string c = upper(cap);
  static const char* const kBelow[] = {"SSE41",           "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                       "AVX512_CORE_VNNI"};
  static const char* const kAvx512Bf16[] = {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512"};
  for (const char* name : kBelow)
    if (c == name) return 0;
  for (const char* name : kAvx512Bf16)
    if (c == name) return 1;
  return 2;  // AMX levels, ALL, DEFAULT, unset, or a name oneDNN does not know (it ignores those)
}

bool read_text(const std::string& path, std::string& text) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream s;
  s << in.rdbuf();
  text = s.str();
  return true;
}

}  // namespace

int64_t available_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  int64_t bytes = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  // A container's memory limit (cgroup v2, then v1) when it is lower than the machine's; "max", an absent or
  // unreadable file sets none.
  for (const char* limit_file : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::string text;
    if (!read_text(limit_file, text)) continue;
    try {
      const int64_t limit = parse_integer(text.substr(0, text.find_first_of(" \n")), "bytes");
      if (limit > 0 && (bytes == 0 || limit < bytes)) bytes = limit;
    } catch (const NumberError&) {  // "max": no limit from there
    }
  }
  return bytes;
}

namespace {

bool parse_positive(const std::string& word, double& value) {
  if (word.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(word.c_str(), &end);
  if (errno != 0 || end != word.c_str() + word.size() || !(v > 0) || !std::isfinite(v)) return false;
  value = v;
  return true;
}

// The quota one cgroup folder sets, in CPUs; 0 for none.
double v2_quota(const std::string& dir) {
  std::string text;
  if (!read_text(dir + "/cpu.max", text)) return 0;
  std::istringstream in(text);
  std::string quota, period;
  in >> quota >> period;
  double q = 0, p = 0;
  if (quota == "max" || !parse_positive(quota, q) || !parse_positive(period, p)) return 0;
  return q / p;
}

double v1_quota(const std::string& dir) {
  std::string quota_text, period_text;
  if (!read_text(dir + "/cpu.cfs_quota_us", quota_text) || !read_text(dir + "/cpu.cfs_period_us", period_text))
    return 0;
  std::istringstream qs(quota_text), ps(period_text);
  std::string quota, period;
  qs >> quota;  // -1: no quota
  ps >> period;
  double q = 0, p = 0;
  if (!parse_positive(quota, q) || !parse_positive(period, p)) return 0;
  return q / p;
}

// Walks from `mount + path` up to `mount` itself, keeping the smallest quota.
void walk_up(const std::string& mount, std::string path, double (*quota_of)(const std::string&), const char* file,
             CoreCount& out) {
  while (!path.empty() && path.back() == '/') path.pop_back();
  for (;;) {
    const std::string dir = mount + path;
    const double q = quota_of(dir);
    if (q > 0 && (out.quota_cpus == 0 || q < out.quota_cpus)) {
      out.quota_cpus = q;
      out.quota_file = dir + "/" + file;
    }
    if (path.empty()) break;
    const auto slash = path.find_last_of('/');
    path = slash == std::string::npos ? std::string() : path.substr(0, slash);
  }
}

int affinity_cpu_count() {
  for (int cpus = 1024; cpus <= (1 << 20); cpus *= 4) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) break;
    const size_t bytes = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(bytes, set);
    const int rc = sched_getaffinity(0, bytes, set);
    const int count = rc == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (rc == 0) return std::max(1, count);
    if (errno != EINVAL) break;  // EINVAL: the kernel's mask is larger than ours
  }
  return 1;
}

}  // namespace

std::string CpuBf16Support::describe() const {
  std::string found = avx512_bf16 && amx_bf16 ? "AVX512-BF16 and AMX-BF16"
                      : avx512_bf16           ? "AVX512-BF16"
                      : amx_bf16              ? "AMX-BF16"
                                              : "";
  if (found.empty()) return "no AVX512-BF16 or AMX-BF16";
  if (!native) return found + ", but ONEDNN_MAX_CPU_ISA=" + onednn_cap + " keeps LibTorch from it";
  return found;
}

CpuBf16Support cpu_bf16_support(bool avx512_bf16, bool amx_bf16, const std::string& onednn_cap) {
  CpuBf16Support s;
  s.avx512_bf16 = avx512_bf16;
  s.amx_bf16 = amx_bf16;
  s.onednn_cap = onednn_cap;
  const int admits = onednn_cap_admits(onednn_cap);
  s.native = (avx512_bf16 && admits >= 1) || (amx_bf16 && admits >= 2);
  return s;
}

CpuBf16Support cpu_bf16_support() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr) cap = std::getenv("DNNL_MAX_CPU_ISA");
  return cpu_bf16_support(cpu_has_avx512_bf16(), cpu_has_amx_bf16(), cap ? cap : "");
}

std::string CoreCount::describe() const {
  const std::string quota = quota_cpus > 0 ? fmt::format("cgroup CPU quota {:.3g} CPUs ({})", quota_cpus, quota_file)
                                           : std::string("no cgroup CPU quota");
  return fmt::format("{} core{} (affinity mask {} CPU{}, {})", cores, cores == 1 ? "" : "s", affinity_cpus,
                     affinity_cpus == 1 ? "" : "s", quota);
}

CoreCount available_cores(int affinity_cpus, const std::string& proc_self_cgroup, const std::string& cgroup_root) {
  CoreCount out;
  out.affinity_cpus = std::max(1, affinity_cpus);
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    // "hierarchy-ID:controller-list:cgroup-path"; v2 is "0::/path".
    const auto a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (path.empty() || path[0] != '/') continue;
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      // The unified hierarchy: at the root, or under "unified" on a hybrid (v1 + v2) machine.
      std::ifstream probe(cgroup_root + "/cgroup.controllers");
      walk_up(probe ? cgroup_root : cgroup_root + "/unified", path, v2_quota, "cpu.max", out);
      continue;
    }
    std::vector<std::string> names;
    std::istringstream cs(controllers);
    for (std::string c; std::getline(cs, c, ',');) names.push_back(c);
    if (std::find(names.begin(), names.end(), "cpu") == names.end()) continue;
    // The v1 cpu hierarchy is mounted under its controller list ("cpu,cpuacct"), often also as "cpu".
    for (const std::string& mount : {cgroup_root + "/" + controllers, cgroup_root + "/cpu"}) {
      std::ifstream probe(mount + "/cpu.cfs_period_us");
      if (!probe) continue;
      // Inside a cgroup namespace the process's own cgroup is the mount's root: `path` may not exist there.
      std::ifstream own(mount + path + "/cpu.cfs_period_us");
      walk_up(mount, own ? path : std::string(), v1_quota, "cpu.cfs_quota_us", out);
      break;
    }
  }
  out.cores = out.affinity_cpus;
  if (out.quota_cpus > 0)
    out.cores = std::max(1, std::min(out.cores, static_cast<int>(std::ceil(out.quota_cpus - 1e-9))));
  return out;
}

CoreCount available_cores() {
  std::string cgroup;
  read_text("/proc/self/cgroup", cgroup);
  return available_cores(affinity_cpu_count(), cgroup, "/sys/fs/cgroup");
}

// __builtin_cpu_supports reads CPUID and, for AVX and AVX-512, also checks (XGETBV) that the OS saves
// the wider registers, so a hypervisor that hides them turns the path off.
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// AMX-BF16 from CPUID leaf 7 (EDX bit 22, with AMX-TILE bit 24), and XCR0 bits 17-18: the OS saves the
// tile configuration and data (Linux then grants them to a process on request, as oneDNN makes it).
// Read by hand: not every compiler's __builtin_cpu_supports knows "amx-bf16" (clang 14 does not).
bool cpu_has_amx_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c & (1u << 27)) == 0) return false;  // OSXSAVE: XGETBV works
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool amx = (d & (1u << 22)) != 0 && (d & (1u << 24)) != 0;
  uint32_t xcr0_low = 0, xcr0_high = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  constexpr uint32_t kTileState = (1u << 17) | (1u << 18);
  return amx && (xcr0_low & kTileState) == kTileState;
#else
  return false;
#endif
}

}  // namespace megaslide
