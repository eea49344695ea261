#include "megaslide/offload/host_param_store.h"

#include "megaslide/io/fp8.h"

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "offload/adamw_kernels.h"
#include "offload/state_pager.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace megaslide::offload {
namespace {

constexpr int64_t kPageBytes = 4096;

int64_t element_bytes(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

void check_options(const HostParamStoreOptions& o) {
  TORCH_CHECK(o.compute_dtype == at::kBFloat16 || o.compute_dtype == at::kHalf || o.compute_dtype == at::kFloat,
              "HostParamStore: compute_dtype must be BFloat16, Half or Float, got ", o.compute_dtype);
  TORCH_CHECK(o.shard_count >= 1 && o.shard_rank >= 0 && o.shard_rank < o.shard_count, "HostParamStore: shard rank ",
              o.shard_rank, " is outside [0, ", o.shard_count, ")");
  TORCH_CHECK(o.shard_count == 1 || o.state_dtype != StateDtype::kInt8,
              "HostParamStore: int8 moments cannot be sharded over ranks (their groups start at each parameter's first "
              "element); use optimizer.state_dtype fp32 or bf16 with several ranks");
  TORCH_CHECK(!o.frozen || (o.shard_count == 1 && !o.separate_grad && !o.ema),
              "HostParamStore: a frozen store holds the weights only (no shards, gradient buffer or EMA)");
  TORCH_CHECK(o.frozen_dtype == c10::ScalarType::Undefined || (o.frozen && o.frozen_dtype == at::kFloat8_e4m3fn),
              "HostParamStore: frozen_dtype must be Float8_e4m3fn, for a frozen store, got ", o.frozen_dtype);
  TORCH_CHECK(o.state_tier == StateTier::kRam || !o.frozen,
              "HostParamStore: a frozen store has no optimizer state to keep on NVMe (offload.state_tier nvme)");
  TORCH_CHECK(o.state_tier == StateTier::kRam || (!o.nvme_dir.empty() && o.nvme_blocks_in_flight >= 1),
              "HostParamStore: the NVMe tier needs nvme_dir (offload.nvme_dir) and nvme_blocks_in_flight >= 1, got '",
              o.nvme_dir, "' and ", o.nvme_blocks_in_flight);
}

int64_t param_numel(const BlockSpec& block, const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) {
    TORCH_CHECK(d >= 0, "HostParamStore: parameter '", p.name, "' of block '", block.name,
                "' has a negative dimension in shape ", c10::IntArrayRef(p.shape));
    TORCH_CHECK(!__builtin_mul_overflow(n, d, &n), "HostParamStore: parameter '", p.name, "' of block '", block.name,
                "' has more than 2^63 elements (shape ", c10::IntArrayRef(p.shape), ")");
  }
  return n;
}

int64_t block_numel_of(const BlockSpec& block) {
  int64_t total = 0;
  std::set<std::string> names;
  for (const auto& p : block.params) {
    TORCH_CHECK(names.insert(p.name).second, "HostParamStore: block '", block.name, "' declares parameter '", p.name,
                "' twice; names must be unique within a block");
    TORCH_CHECK(!__builtin_add_overflow(total, param_numel(block, p), &total), "HostParamStore: block '", block.name,
                "' has more than 2^63 elements");
  }
  return total;
}

bool cuda_pinning_available(const HostParamStoreOptions& o) {
#ifdef MEGASLIDE_WITH_CUDA
  return o.pin_if_cuda && torch::cuda::is_available();
#else
  (void)o;
  return false;
#endif
}

struct HostMemory {
  int64_t available_bytes = -1;  // MemAvailable: what can be allocated without swapping
  int64_t total_bytes = -1;
};

HostMemory host_memory() {
  HostMemory m;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") m.available_bytes = kib * 1024;
    if (key == "MemTotal:") m.total_bytes = kib * 1024;
  }
  const long page = sysconf(_SC_PAGESIZE);
  if (m.available_bytes < 0 && page > 0) m.available_bytes = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
  if (m.total_bytes < 0 && page > 0) m.total_bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * page;
  return m;
}

// "1.50 GiB", "1.00 PiB": binary units, the largest that keeps the number >= 1.
std::string human_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, units[unit]);
}

[[noreturn]] void throw_out_of_memory(const MemoryReport& plan, const HostParamStoreOptions& o,
                                      const std::string& what_failed) {
  const HostMemory mem = host_memory();
  const double per_param = plan.num_params > 0 ? static_cast<double>(plan.total_bytes()) / plan.num_params : 0;
  std::string machine =
      mem.available_bytes >= 0
          ? fmt::format("this machine has {} bytes ({}) available (MemAvailable, of {} total)", mem.available_bytes,
                        human_bytes(mem.available_bytes), human_bytes(mem.total_bytes))
          : "this machine's available memory could not be read";
  throw HostMemoryError(
      fmt::format("HostParamStore: {}: the training state needs {} bytes ({}; {:.2f} B per parameter x {} "
                  "parameters in {} blocks: fp32 master, {} m and v, {} transfer buffer{}{}), but {}. "
                  "Use a smaller model (fewer or narrower blocks), or a machine with more RAM (at least {}).",
                  what_failed, plan.total_bytes(), human_bytes(plan.total_bytes()), per_param, plan.num_params,
                  plan.num_blocks, to_string(o.state_dtype), c10::toString(o.compute_dtype),
                  o.separate_grad ? ", fp32 gradient" : "", o.ema ? ", fp32 EMA" : "", machine,
                  human_bytes(plan.total_bytes() + (mem.total_bytes - std::max<int64_t>(mem.available_bytes, 0)))),
      plan.total_bytes(), mem.available_bytes);
}

void free_host(void* ptr, bool pinned) {
#ifdef MEGASLIDE_WITH_CUDA
  if (pinned) {
    cudaFreeHost(ptr);
    return;
  }
#endif
  (void)pinned;
  std::free(ptr);
}

// Memory of `bytes`, page-locked when `pinned`, not yet zeroed (first_touch does it); nullptr on failure.
void* allocate_host(int64_t bytes, bool pinned) {
  void* ptr = nullptr;
#ifdef MEGASLIDE_WITH_CUDA
  if (pinned) {
    if (cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error so later CUDA calls do not see it
      return nullptr;
    }
    return ptr;
  }
#endif
  (void)pinned;
  const int64_t rounded = (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
  if (posix_memalign(&ptr, kPageBytes, static_cast<size_t>(rounded)) != 0) return nullptr;
  return ptr;
}

}  // namespace

StateTier parse_state_tier(const std::string& name) {
  if (name == "ram") return StateTier::kRam;
  if (name == "nvme") return StateTier::kNvme;
  TORCH_CHECK(false, "offload.state_tier must be ram or nvme, got '", name, "'");
}
const char* to_string(StateTier tier) { return tier == StateTier::kNvme ? "nvme" : "ram"; }

ShardRange shard_range(int64_t numel, int64_t rank, int64_t count) {
  TORCH_CHECK(numel >= 0 && count >= 1 && rank >= 0 && rank < count, "shard_range: rank ", rank, " of ", count,
              " ranks, ", numel, " elements");
  const int64_t stride = shard_stride(numel, count);
  const int64_t begin = std::min(numel, rank * stride);
  return {begin, std::min(numel, begin + stride)};
}

struct HostParamStore::Block {
  int64_t numel = 0;
  // The NVMe tier: each state component's byte offset in the block's region (-1: none) and the region's bytes.
  int64_t sections[6] = {-1, -1, -1, -1, -1, -1};
  int64_t region = 0;
  ShardRange shard;                    // this rank's elements of master and moments
  std::vector<int64_t> offsets;        // per parameter, in elements
  std::vector<int64_t> group_offsets;  // per parameter, its first int8 group
  int64_t groups = 0;
  at::Tensor master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, compute, grad, ema;
  at::Tensor scales;                   // fp8 frozen weights: per parameter
  at::Tensor exact;                    // fp8 frozen weights: the vectors in fp32
  std::vector<int64_t> exact_offsets;  // per parameter: its offset in `exact`, -1 for an fp8 one
};

namespace {

int64_t groups_of(const BlockSpec& block) {
  int64_t g = 0;
  for (const auto& p : block.params) g += state_groups(param_numel(block, p));
  return g;
}

// Sharded, no rank holds a whole master (and on the NVMe tier the master is not in memory): the transfer
// buffer then holds the whole compute copy (fp32 too).
bool uploads_master(const HostParamStoreOptions& o) {
  return o.compute_dtype == at::kFloat && o.shard_count == 1 && !o.frozen && o.state_tier == StateTier::kRam;
}
bool nvme_tier(const HostParamStoreOptions& o) { return o.state_tier == StateTier::kNvme; }
bool fp8_store(const HostParamStoreOptions& o) { return o.frozen_dtype == at::kFloat8_e4m3fn; }
c10::ScalarType transfer_dtype_of(const HostParamStoreOptions& o) {
  return fp8_store(o) ? o.frozen_dtype : o.compute_dtype;
}
bool has_transfer_buffer(const HostParamStoreOptions& o) { return o.frozen || !uploads_master(o) || !o.separate_grad; }

int64_t aligned(int64_t bytes) { return (bytes + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment; }

// The NVMe tier's region of a block whose shard has `owned` elements in `groups` int8 groups: each
// component's offset (sections, -1 when absent) and the region's bytes, every component 4 KiB-aligned.
int64_t region_layout(int64_t owned, int64_t groups, const HostParamStoreOptions& o, int64_t sections[6]) {
  const int64_t state = state_element_bytes(o.state_dtype);
  const bool int8 = o.state_dtype == StateDtype::kInt8;
  const int64_t bytes[6] = {
      4 * owned, state * owned, state * owned, int8 ? 4 * groups : -1, int8 ? 4 * groups : -1, o.ema ? 4 * owned : -1};
  int64_t offset = 0;
  for (int part = 0; part < 6; ++part) {
    sections[part] = bytes[part] < 0 ? -1 : offset;
    offset += bytes[part] < 0 ? 0 : aligned(bytes[part]);
  }
  return offset;
}

const char* dtype_name(c10::ScalarType t) { return t == at::kFloat ? "fp32" : t == at::kHalf ? "fp16" : "bf16"; }

}  // namespace

std::string MemoryReport::to_string() const {
  const double n = num_params > 0 ? static_cast<double>(num_params) : 1.0;
  std::string out =
      fmt::format("HostParamStore: {} parameters in {} blocks; {} bytes page-locked{}{}\n", num_params, num_blocks,
                  pinned_bytes, pinned ? "" : " (no CUDA: everything pageable, page-aligned)",
                  shard_count > 1 ? fmt::format("; master and moments: this rank's shard of {}", shard_count) : "");
  // The rows, then the table: the first column as wide as its longest name.
  std::vector<std::pair<std::string, int64_t>> rows;
  const auto row = [&](const std::string& name, int64_t bytes) { rows.emplace_back(name, bytes); };
  const auto table = [&] {
    size_t width = 48;
    for (const auto& [name, bytes] : rows) width = std::max(width, name.size());
    out += fmt::format("  {:<{}} {:>18} {:>14} {:>10}\n", "component", width, "bytes", "GiB", "B/param");
    for (const auto& [name, bytes] : rows)
      out += fmt::format("  {:<{}} {:>18} {:>14.3f} {:>10.3f}\n", name, width, bytes,
                         static_cast<double>(bytes) / (1024.0 * 1024 * 1024), static_cast<double>(bytes) / n);
    return out;
  };
  if (frozen) {
    row(fmt::format("{} frozen weights (uploaded; no master, moments or gradient)",
                    fp8 ? "fp8 e4m3fn" : dtype_name(compute_dtype)),
        compute_bytes);
    if (fp8) row("fp32 scales of the fp8 weights (one per parameter tensor)", scale_bytes);
    if (fp8) row("fp32 vectors kept exact (biases, norm weights)", exact_bytes);
    row("total", total_bytes());
    return table();
  }
  const char* state = offload::to_string(state_dtype);
  const bool nvme = state_tier == StateTier::kNvme;
  const std::string where = nvme ? " [on NVMe]" : "";
  row(std::string(compute_dtype == at::kFloat && shard_count == 1 && !nvme ? "fp32 master (uploaded)" : "fp32 master") +
          where,
      master_bytes);
  row(fmt::format("{} exp_avg (m){}", state, where), exp_avg_bytes);
  row(fmt::format("{} exp_avg_sq (v{}){}", state, state_dtype == StateDtype::kInt8 ? ": sqrt codes" : "", where),
      exp_avg_sq_bytes);
  if (scale_bytes > 0) row("int8 group scales (fp32, m and v)" + where, scale_bytes);
  if (compute_bytes > 0) {
    row(fmt::format("{} transfer buffer ({})", dtype_name(compute_dtype),
                    compute_dtype == at::kFloat && shard_count == 1 && !nvme ? "gradient"
                    : separate_grad                                          ? "compute copy"
                                                                             : "compute copy / gradient"),
        compute_bytes);
  }
  if (grad_bytes > 0) row("fp32 gradient (accumulation)", grad_bytes);
  if (ema_bytes > 0) row("fp32 EMA of the weights" + where, ema_bytes);
  if (nvme) {
    row("NVMe tier: state file on disk (4 KiB-aligned regions)", nvme_bytes);
    const int64_t buffers = largest_region_bytes > 0 ? nvme_buffer_bytes / largest_region_bytes : 0;
    row(fmt::format("NVMe tier: in-flight buffers ({} block{}' state)", buffers, buffers == 1 ? "" : "s"),
        nvme_buffer_bytes);
  }
  row(nvme ? "total in host memory" : "total", total_bytes());
  return table();
}

MemoryReport HostParamStore::plan(const std::vector<BlockSpec>& blocks, const HostParamStoreOptions& options) {
  check_options(options);
  MemoryReport r;
  r.num_blocks = static_cast<int64_t>(blocks.size());
  int64_t groups = 0, owned = 0;  // owned: master and moment elements this rank keeps
  for (const auto& b : blocks) {
    const int64_t n = block_numel_of(b);
    const int64_t mine = shard_range(n, options.shard_rank, options.shard_count).size();
    r.num_params += n;
    owned += mine;
    groups += groups_of(b);
    if (nvme_tier(options)) {
      int64_t sections[6];
      const int64_t region = region_layout(mine, groups_of(b), options, sections);
      r.nvme_bytes += region;
      r.largest_region_bytes = std::max(r.largest_region_bytes, region);
    }
  }
  r.state_tier = options.state_tier;
  // No more buffers than blocks: with as many, every block's state stays in memory.
  r.nvme_buffer_bytes =
      nvme_tier(options) ? std::min(options.nvme_blocks_in_flight, r.num_blocks) * r.largest_region_bytes : 0;
  if (options.frozen) owned = 0;  // the transfer buffer alone
  groups = options.frozen ? 0 : groups;
  const int64_t state_bytes = state_element_bytes(options.state_dtype);
  r.master_bytes = 4 * owned;
  r.exp_avg_bytes = r.exp_avg_sq_bytes = state_bytes * owned;
  r.scale_bytes = options.state_dtype == StateDtype::kInt8 ? 2 * 4 * groups : 0;
  r.compute_bytes = has_transfer_buffer(options) ? element_bytes(transfer_dtype_of(options)) * r.num_params : 0;
  if (fp8_store(options)) {
    int64_t tensors = 0;
    for (const auto& b : blocks) {
      tensors += static_cast<int64_t>(b.params.size());
      for (const auto& p : b.params)
        if (p.shape.size() < 2) r.exact_bytes += 4 * param_numel(b, p);
    }
    r.scale_bytes = 4 * tensors;
  }
  r.grad_bytes = options.separate_grad ? 4 * r.num_params : 0;
  r.ema_bytes = options.ema ? 4 * owned : 0;
  r.pinnable_bytes = r.compute_bytes + (uploads_master(options) ? r.master_bytes : 0);
  r.compute_dtype = options.compute_dtype;
  r.state_dtype = options.state_dtype;
  r.separate_grad = options.separate_grad;
  r.shard_count = options.shard_count;
  r.frozen = options.frozen;
  r.fp8 = fp8_store(options);
  r.pinned = cuda_pinning_available(options);
  r.pinned_bytes = r.pinned ? r.pinnable_bytes : 0;
  return r;
}

HostParamStore::HostParamStore(std::vector<BlockSpec> blocks, HostParamStoreOptions options)
    : specs_(std::move(blocks)), options_(std::move(options)) {
  const MemoryReport plan_report = plan(specs_, options_);  // validates the spec
  pinned_ = plan_report.pinned;
  // Refuse up front rather than let the kernel's overcommit hand out memory that the zeroing below
  // (or the first optimizer step) would then get the process OOM-killed for.
  const HostMemory mem = host_memory();
  if (mem.available_bytes >= 0 && plan_report.total_bytes() > mem.available_bytes) {
    throw_out_of_memory(plan_report, options_, "not enough host memory");
  }

  const auto make_buffer = [&](int64_t numel, c10::ScalarType dtype, bool pinned, const char* component,
                               const std::string& block_name) {
    const auto tensor_options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    if (numel == 0) return at::empty({0}, tensor_options);
    const int64_t bytes = numel * element_bytes(dtype);
    void* ptr = allocate_host(bytes, pinned);
    if (ptr == nullptr) {
      throw_out_of_memory(
          plan_report, options_,
          fmt::format("allocating {} bytes for block '{}' component '{}' failed{}", bytes, block_name, component,
                      pinned ? " (page-locked with cudaHostAlloc: the locked-memory limit, `ulimit -l` or the "
                               "container's memlock setting, may be what ran out)"
                             : ""));
    }
    return at::from_blob(
        ptr, {numel}, [pinned](void* p) { free_host(p, pinned); }, tensor_options);
  };

  const StateDtype state = options_.state_dtype;
  const bool paged_state = nvme_tier(options_);
  const c10::ScalarType m_dtype = state == StateDtype::kFloat32    ? at::kFloat
                                  : state == StateDtype::kBFloat16 ? at::kBFloat16
                                                                   : at::kChar;
  const c10::ScalarType v_dtype = state == StateDtype::kFloat32    ? at::kFloat
                                  : state == StateDtype::kBFloat16 ? at::kBFloat16
                                                                   : at::kByte;
  blocks_.reserve(specs_.size());
  for (const auto& spec : specs_) {
    auto block = std::make_shared<Block>();
    for (const auto& p : spec.params) {
      const int64_t n = param_numel(spec, p);
      block->offsets.push_back(block->numel);
      block->group_offsets.push_back(block->groups);
      block->numel += n;
      block->groups += state_groups(n);
    }
    block->shard = shard_range(block->numel, options_.shard_rank, options_.shard_count);
    const int64_t owned = options_.frozen ? 0 : block->shard.size();
    if (paged_state) block->region = region_layout(owned, block->groups, options_, block->sections);
    if (!paged_state) {
      block->master = make_buffer(owned, at::kFloat, pinned_ && uploads_master(options_), "master", spec.name);
      block->exp_avg = make_buffer(owned, m_dtype, false, "exp_avg", spec.name);
      block->exp_avg_sq = make_buffer(owned, v_dtype, false, "exp_avg_sq", spec.name);
    }
    if (state == StateDtype::kInt8 && !options_.frozen && !paged_state) {
      block->exp_avg_scale = make_buffer(block->groups, at::kFloat, false, "exp_avg_scale", spec.name);
      block->exp_avg_sq_scale = make_buffer(block->groups, at::kFloat, false, "exp_avg_sq_scale", spec.name);
    }
    if (has_transfer_buffer(options_)) {
      block->compute = make_buffer(block->numel, transfer_dtype_of(options_), pinned_, "compute", spec.name);
    }
    if (fp8_store(options_)) {
      block->scales = make_buffer(static_cast<int64_t>(spec.params.size()), at::kFloat, false, "scales", spec.name);
      int64_t exact = 0;  // the vectors, packed in declaration order
      for (const auto& p : spec.params) {
        block->exact_offsets.push_back(p.shape.size() < 2 ? exact : -1);
        if (p.shape.size() < 2) exact += param_numel(spec, p);
      }
      block->exact = make_buffer(exact, at::kFloat, false, "exact", spec.name);
      block->scales.fill_(1.f);
      block->exact.zero_();
    }
    if (options_.separate_grad) block->grad = make_buffer(block->numel, at::kFloat, false, "grad", spec.name);
    if (options_.ema && !paged_state) block->ema = make_buffer(owned, at::kFloat, false, "ema", spec.name);

    // First touch: every byte of the block zeroed by whoever options_.first_touch says.
    const Block& b = *block;
    const std::function<void(int64_t, int64_t)> zero = [&b, &spec](int64_t begin, int64_t end) {
      const auto clear = [](const at::Tensor& t, int64_t from, int64_t to) {
        if (!t.defined() || t.numel() == 0 || to <= from) return;
        const int64_t size = t.element_size();
        std::memset(static_cast<char*>(t.data_ptr()) + from * size, 0, static_cast<size_t>((to - from) * size));
      };
      // Master and moments hold the shard: the part of [begin, end) inside it, in shard coordinates.
      const int64_t from = std::max(begin, b.shard.begin) - b.shard.begin,
                    to = std::min(end, b.shard.end) - b.shard.begin;
      for (const at::Tensor* t : {&b.master, &b.exp_avg, &b.exp_avg_sq, &b.ema}) clear(*t, from, to);
      for (const at::Tensor* t : {&b.compute, &b.grad}) clear(*t, begin, end);
      if (!b.exp_avg_scale.defined()) return;
      // The scales of the groups that start in [begin, end).
      for (size_t i = 0; i < b.offsets.size(); ++i) {
        const int64_t first = b.offsets[i], n = param_numel(spec, spec.params[i]);
        for (int64_t g = 0; g * kStateQuantGroup < n; ++g) {
          const int64_t start = first + g * kStateQuantGroup;
          if (start < begin || start >= end) continue;
          b.exp_avg_scale.data_ptr<float>()[b.group_offsets[i] + g] = 0.f;
          b.exp_avg_sq_scale.data_ptr<float>()[b.group_offsets[i] + g] = 0.f;
        }
      }
    };
    if (options_.first_touch) options_.first_touch(block->numel, zero);
    else zero(0, block->numel);
    blocks_.push_back(std::move(block));
  }
  if (paged_state) {  // the file starts as zeros: masters and moments zero, as in RAM
    std::vector<int64_t> regions;
    for (const auto& b : blocks_) regions.push_back(b->region);
    const std::string name = fmt::format("megaslide-state-{}-rank{}.bin", ::getpid(), options_.shard_rank);
    pager_ = std::make_unique<detail::StatePager>(
        std::make_unique<NvmeFile>(options_.nvme_dir, name, plan_report.nvme_bytes, options_.nvme), regions,
        std::min(options_.nvme_blocks_in_flight, static_cast<int64_t>(regions.size())));
  }
}

HostParamStore::~HostParamStore() = default;

const BlockSpec& HostParamStore::block_spec(int64_t block) const {
  TORCH_CHECK(block >= 0 && block < num_blocks(), "HostParamStore: block ", block, " out of range [0, ", num_blocks(),
              ")");
  return specs_[block];
}

int64_t HostParamStore::block_numel(int64_t block) const {
  block_spec(block);
  return blocks_[block]->numel;
}

ShardRange HostParamStore::shard(int64_t block) const { return (block_spec(block), blocks_[block]->shard); }

MemoryReport HostParamStore::memory_report() const {
  MemoryReport r = plan(specs_, options_);
  r.pinned = pinned_;
  r.pinned_bytes = pinned_ ? r.pinnable_bytes : 0;
  return r;
}

at::Tensor HostParamStore::state_part(int64_t block, int part) const {
  const Block& b = *blocks_[(block_spec(block), block)];
  if (!pager_) {
    const at::Tensor* parts[6] = {&b.master, &b.exp_avg, &b.exp_avg_sq, &b.exp_avg_scale, &b.exp_avg_sq_scale, &b.ema};
    return *parts[part];
  }
  char* memory = b.sections[part] < 0 ? nullptr : pager_->memory(block);
  if (memory == nullptr) return {};
  const StateDtype state = options_.state_dtype;
  const c10::ScalarType moment = state == StateDtype::kFloat32    ? at::kFloat
                                 : state == StateDtype::kBFloat16 ? at::kBFloat16
                                                                  : at::kChar;
  const c10::ScalarType dtypes[6] = {at::kFloat, moment,     moment == at::kChar ? at::kByte : moment,
                                     at::kFloat, at::kFloat, at::kFloat};
  const int64_t numel = part == 3 || part == 4 ? b.groups : b.shard.size();
  return at::from_blob(memory + b.sections[part], {numel}, at::TensorOptions().dtype(dtypes[part]).device(at::kCPU));
}

at::Tensor HostParamStore::held_part(int64_t block, int part, const char* who) const {
  at::Tensor t = state_part(block, part);
  TORCH_CHECK(t.defined() || !pager_ || blocks_[block]->sections[part] < 0, "HostParamStore::", who, ": block ", block,
              "'s state is on the NVMe tier and not in memory; hold it with acquire_state first");
  return t;
}

at::Tensor HostParamStore::master(int64_t block) const { return held_part(block, 0, "master"); }
at::Tensor HostParamStore::exp_avg(int64_t block) const { return held_part(block, 1, "exp_avg"); }
at::Tensor HostParamStore::exp_avg_sq(int64_t block) const { return held_part(block, 2, "exp_avg_sq"); }
at::Tensor HostParamStore::exp_avg_scale(int64_t block) const { return held_part(block, 3, "exp_avg_scale"); }
at::Tensor HostParamStore::exp_avg_sq_scale(int64_t block) const { return held_part(block, 4, "exp_avg_sq_scale"); }
at::Tensor HostParamStore::ema(int64_t block) const { return held_part(block, 5, "ema"); }

HostParamStore::StateLease& HostParamStore::StateLease::operator=(StateLease&& other) noexcept {
  if (this != &other) {
    this->~StateLease();
    store_ = other.store_;
    block_ = other.block_;
    other.store_ = nullptr;
  }
  return *this;
}

HostParamStore::StateLease::~StateLease() {
  if (store_ == nullptr) return;
  try {
    store_->pager_->release(block_);
  } catch (...) {  // kept by the pager: its next call rethrows it
  }
  store_ = nullptr;
}

HostParamStore::StateLease HostParamStore::acquire_state(int64_t block, bool write) const {
  block_spec(block);
  if (!pager_) return {};
  pager_->acquire(block, write);
  return StateLease(this, block);
}

HostParamStore::StateLease HostParamStore::acquire_state_to_overwrite(int64_t block) const {
  block_spec(block);
  if (!pager_) return {};
  pager_->acquire(block, /*write=*/true, /*overwrite=*/true);
  return StateLease(this, block);
}

void HostParamStore::prefetch_state(int64_t block) const {
  block_spec(block);
  if (pager_) pager_->prefetch(block);
}

void HostParamStore::flush_state() const {
  if (pager_) pager_->flush();
}

HostParamStore::NvmeStats HostParamStore::nvme_stats() const {
  if (!pager_) return {};
  const detail::PagerStats p = pager_->stats();
  return {p.read_bytes, p.write_bytes, p.read_s, p.write_s, p.wait_s};
}

const NvmeFile* HostParamStore::nvme_file() const { return pager_ ? &pager_->file() : nullptr; }

void HostParamStore::set_trace(StepTrace* trace) const {
  if (pager_) pager_->set_trace(trace);
}

bool HostParamStore::master_uploaded() const { return uploads_master(options_); }
at::Tensor HostParamStore::scales(int64_t block) const { return (block_spec(block), blocks_[block]->scales); }
c10::ScalarType HostParamStore::transfer_dtype() const { return transfer_dtype_of(options_); }
at::Tensor HostParamStore::compute(int64_t block) const { return (block_spec(block), blocks_[block]->compute); }
at::Tensor HostParamStore::grad(int64_t block) const {
  block_spec(block);
  return options_.separate_grad ? blocks_[block]->grad : blocks_[block]->compute;
}

HostParamStore::ParamViews HostParamStore::views(int64_t block, size_t i) const {
  const BlockSpec& spec = specs_[block];
  const Block& b = *blocks_[block];
  const auto& shape = spec.params[i].shape;
  const int64_t offset = b.offsets[i];
  const int64_t numel = param_numel(spec, spec.params[i]);
  const auto view = [&](const at::Tensor& flat) {
    return flat.defined() ? flat.narrow(0, offset, numel).view(shape) : at::Tensor();
  };
  const auto owned_view = [&](const at::Tensor& flat) {
    return sharded() || options_.frozen ? at::Tensor() : view(flat);
  };
  ParamViews v{owned_view(state_part(block, 0)),
               owned_view(state_part(block, 1)),
               owned_view(state_part(block, 2)),
               view(b.compute),
               view(grad(block)),
               {},
               {},
               offset,
               b.group_offsets[i],
               owned_view(state_part(block, 5)),
               {}};
  if (b.exact.defined() && b.exact_offsets[i] >= 0) v.exact = b.exact.narrow(0, b.exact_offsets[i], numel).view(shape);
  const at::Tensor m_scale = state_part(block, 3), v_scale = state_part(block, 4);
  if (m_scale.defined()) {
    v.exp_avg_scale = m_scale.narrow(0, b.group_offsets[i], state_groups(numel));
    v.exp_avg_sq_scale = v_scale.narrow(0, b.group_offsets[i], state_groups(numel));
  }
  return v;
}

HostParamStore::ParamViews HostParamStore::param(int64_t block, const std::string& name) const {
  const BlockSpec& spec = block_spec(block);
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (spec.params[i].name == name) return views(block, i);
  }
  std::ostringstream names;
  for (const auto& p : spec.params) names << (names.tellp() > 0 ? ", " : "") << p.name;
  TORCH_CHECK(false, "HostParamStore: block ", block, " ('", spec.name, "') has no parameter '", name,
              "'; it has: ", names.str());
}

std::vector<HostParamStore::ParamViews> HostParamStore::params(int64_t block) const {
  std::vector<ParamViews> out;
  for (size_t i = 0; i < block_spec(block).params.size(); ++i) out.push_back(views(block, i));
  return out;
}

void HostParamStore::set_param(int64_t block, const std::string& name, const at::Tensor& value) {
  const StateLease lease = options_.frozen ? StateLease() : acquire_state(block, /*write=*/true);
  ParamViews v = param(block, name);
  if (options_.frozen) {
    TORCH_CHECK(value.sizes() == v.compute.sizes(), "HostParamStore::set_param: '", name, "' of block ", block,
                " has shape ", v.compute.sizes(), ", got a value of shape ", value.sizes());
    if (!fp8_store(options_)) {
      v.compute.copy_(value);  // rounded to nearest even
      return;
    }
    // fp8: a vector kept exact; a matrix's own fp8 bytes when it is fp8 already (scale 1), else per-tensor
    // scaling.
    const at::Tensor w = value.to(at::kCPU, at::kFloat);
    if (v.exact.defined()) {
      v.exact.copy_(w);
      return;
    }
    Fp8Tensor q = quantize_fp8(w, Fp8Scaling::kNone);
    if (!at::equal(dequantize_fp8(q), w)) q = quantize_fp8(w, Fp8Scaling::kPerTensor);
    v.compute.copy_(q.data);
    const BlockSpec& spec = specs_[block];
    for (size_t i = 0; i < spec.params.size(); ++i)
      if (spec.params[i].name == name) blocks_[block]->scales.data_ptr<float>()[i] = q.scale.item<float>();
    return;
  }
  TORCH_CHECK(value.sizes() == v.compute.sizes() || (v.master.defined() && value.sizes() == v.master.sizes()),
              "HostParamStore::set_param: '", name, "' of block ", block, " has shape ",
              (v.master.defined() ? v.master : v.compute).sizes(), ", got a value of shape ", value.sizes());
  if (!sharded()) {
    v.master.copy_(value);
    copy_master_to_compute(block, v.offset, v.offset + v.master.numel());
    return;
  }
  // Sharded: the part of the parameter in this rank's shard into the master; the whole compute copy
  // from the fp32 value, rounded as the master's own elements would be.
  const Block& b = *blocks_[block];
  const at::Tensor flat = value.to(at::kCPU, at::kFloat).contiguous().view(-1);
  const int64_t n = flat.numel();
  const int64_t from = std::max(v.offset, b.shard.begin), to = std::min(v.offset + n, b.shard.end);
  if (from < to)
    master(block).narrow(0, from - b.shard.begin, to - from).copy_(flat.narrow(0, from - v.offset, to - from));
  const float* src = flat.data_ptr<float>();
  if (options_.compute_dtype == at::kFloat) {
    std::memcpy(b.compute.data_ptr<float>() + v.offset, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  auto* dst = static_cast<uint16_t*>(b.compute.data_ptr()) + v.offset;
  const bool bf16 = options_.compute_dtype == at::kBFloat16;
  for (int64_t i = 0; i < n; ++i)
    dst[i] = bf16 ? detail::float_to_bf16_bits(src[i]) : detail::float_to_fp16_bits(src[i]);
}

void HostParamStore::copy_master_to_compute(int64_t block, int64_t begin, int64_t end) const {
  const Block& b = *blocks_[(block_spec(block), block)];
  if (options_.frozen) return;  // the weights are the copy
  TORCH_CHECK(b.shard.begin <= begin && begin <= end && end <= b.shard.end,
              "HostParamStore::copy_master_to_compute: range [", begin, ", ", end, ") is not within block ", block,
              "'s ", sharded() ? "shard [" : "elements [", b.shard.begin, ", ", b.shard.end, ")");
  const StateLease lease = acquire_state(block, /*write=*/false);
  const float* master = state_part(block, 0).data_ptr<float>();  // master[i - base] is element i of the block
  const int64_t base = b.shard.begin;
  if (options_.compute_dtype == at::kFloat) {
    if (!uploads_master(options_) && end > begin)
      std::memcpy(b.compute.data_ptr<float>() + begin, master + (begin - base),
                  static_cast<size_t>(end - begin) * sizeof(float));
    return;
  }
  // Round with the optimizer's own conversion so the copy has exactly the bits a step would have written.
  auto* dst = static_cast<uint16_t*>(b.compute.data_ptr());
  if (options_.compute_dtype == at::kBFloat16) {
    for (int64_t i = begin; i < end; ++i) dst[i] = detail::float_to_bf16_bits(master[i - base]);
  } else {
    for (int64_t i = begin; i < end; ++i) dst[i] = detail::float_to_fp16_bits(master[i - base]);
  }
}

}  // namespace megaslide::offload
