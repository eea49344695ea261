#include "megaslide/offload/host_param_store.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "offload/adamw_kernels.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace megaslide::offload {
namespace {

constexpr int64_t kPageBytes = 4096;

int64_t element_bytes(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

void check_options(const HostParamStoreOptions& o) {
  TORCH_CHECK(o.compute_dtype == at::kBFloat16 || o.compute_dtype == at::kHalf,
              "HostParamStore: compute_dtype must be BFloat16 or Half, got ", o.compute_dtype);
  TORCH_CHECK(o.grad_dtype == at::kBFloat16 || o.grad_dtype == at::kHalf || o.grad_dtype == at::kFloat,
              "HostParamStore: grad_dtype must be BFloat16, Half or Float, got ", o.grad_dtype);
}

int64_t param_numel(const BlockSpec& block, const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) {
    TORCH_CHECK(d >= 0, "HostParamStore: parameter '", p.name, "' of block '", block.name,
                "' has a negative dimension in shape ", c10::IntArrayRef(p.shape));
    TORCH_CHECK(!__builtin_mul_overflow(n, d, &n), "HostParamStore: parameter '", p.name, "' of block '",
                block.name, "' has more than 2^63 elements (shape ", c10::IntArrayRef(p.shape), ")");
  }
  return n;
}

int64_t block_numel_of(const BlockSpec& block) {
  int64_t total = 0;
  std::set<std::string> names;
  for (const auto& p : block.params) {
    TORCH_CHECK(names.insert(p.name).second, "HostParamStore: block '", block.name, "' declares parameter '",
                p.name, "' twice; names must be unique within a block");
    TORCH_CHECK(!__builtin_add_overflow(total, param_numel(block, p), &total), "HostParamStore: block '",
                block.name, "' has more than 2^63 elements");
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
  std::string machine = mem.available_bytes >= 0
                            ? fmt::format("this machine has {} bytes ({}) available (MemAvailable, of {} total)",
                                          mem.available_bytes, human_bytes(mem.available_bytes), human_bytes(mem.total_bytes))
                            : "this machine's available memory could not be read";
  throw HostMemoryError(
      fmt::format("HostParamStore: {}: the training state needs {} bytes ({}; {:.0f} B per parameter x {} "
                  "parameters in {} blocks: fp32 master, m and v, {} compute copy, {} gradient), but {}. "
                  "Use a smaller model (fewer or narrower blocks), or a machine with more RAM (at least {}).",
                  what_failed, plan.total_bytes(), human_bytes(plan.total_bytes()), per_param, plan.num_params,
                  plan.num_blocks, c10::toString(o.compute_dtype), c10::toString(o.grad_dtype), machine,
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

// Zeroed memory of `bytes`, page-locked when `pinned`; nullptr on failure.
void* allocate_host(int64_t bytes, bool pinned) {
  void* ptr = nullptr;
#ifdef MEGASLIDE_WITH_CUDA
  if (pinned) {
    if (cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error so later CUDA calls do not see it
      return nullptr;
    }
    std::memset(ptr, 0, static_cast<size_t>(bytes));
    return ptr;
  }
#endif
  (void)pinned;
  const int64_t rounded = (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
  if (posix_memalign(&ptr, kPageBytes, static_cast<size_t>(rounded)) != 0) return nullptr;
  std::memset(ptr, 0, static_cast<size_t>(rounded));
  return ptr;
}

}  // namespace

struct HostParamStore::Block {
  int64_t numel = 0;
  std::vector<int64_t> offsets;  // per parameter, in elements
  at::Tensor master, exp_avg, exp_avg_sq, compute, grad;
};

std::string MemoryReport::to_string() const {
  const double n = num_params > 0 ? static_cast<double>(num_params) : 1.0;
  std::string out = fmt::format("HostParamStore: {} parameters in {} blocks, {} memory\n", num_params, num_blocks,
                                pinned ? "pinned (page-locked)" : "pageable, page-aligned");
  out += fmt::format("  {:<27} {:>18} {:>14} {:>10}\n", "component", "bytes", "GiB", "B/param");
  const auto row = [&](const std::string& name, int64_t bytes) {
    out += fmt::format("  {:<27} {:>18} {:>14.3f} {:>10.2f}\n", name, bytes,
                       static_cast<double>(bytes) / (1024.0 * 1024 * 1024), static_cast<double>(bytes) / n);
  };
  row("fp32 master", master_bytes);
  row("fp32 exp_avg (m)", exp_avg_bytes);
  row("fp32 exp_avg_sq (v)", exp_avg_sq_bytes);
  row(fmt::format("{} compute copy", compute_dtype == at::kBFloat16 ? "bf16" : "fp16"), compute_bytes);
  row("persistent total", persistent_bytes());
  const char* grad_name = grad_dtype == at::kFloat ? "fp32" : grad_dtype == at::kHalf ? "fp16" : "bf16";
  row(fmt::format("{} gradient (transient)", grad_name), grad_bytes);
  row("total", total_bytes());
  return out;
}

MemoryReport HostParamStore::plan(const std::vector<BlockSpec>& blocks, const HostParamStoreOptions& options) {
  check_options(options);
  MemoryReport r;
  r.num_blocks = static_cast<int64_t>(blocks.size());
  for (const auto& b : blocks) r.num_params += block_numel_of(b);
  r.master_bytes = r.exp_avg_bytes = r.exp_avg_sq_bytes = 4 * r.num_params;
  r.compute_bytes = element_bytes(options.compute_dtype) * r.num_params;
  r.grad_bytes = element_bytes(options.grad_dtype) * r.num_params;
  r.compute_dtype = options.compute_dtype;
  r.grad_dtype = options.grad_dtype;
  r.pinned = cuda_pinning_available(options);
  return r;
}

HostParamStore::HostParamStore(std::vector<BlockSpec> blocks, HostParamStoreOptions options)
    : specs_(std::move(blocks)), options_(options) {
  const MemoryReport plan_report = plan(specs_, options_);  // validates the spec
  pinned_ = plan_report.pinned;
  // Refuse up front rather than let the kernel's overcommit hand out memory that the zeroing below
  // (or the first optimizer step) would then get the process OOM-killed for.
  const HostMemory mem = host_memory();
  if (mem.available_bytes >= 0 && plan_report.total_bytes() > mem.available_bytes) {
    throw_out_of_memory(plan_report, options_, "not enough host memory");
  }

  const auto make_buffer = [&](int64_t numel, c10::ScalarType dtype, const char* component,
                               const std::string& block_name) {
    const auto tensor_options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    if (numel == 0) return at::empty({0}, tensor_options);
    const int64_t bytes = numel * element_bytes(dtype);
    void* ptr = allocate_host(bytes, pinned_);
    if (ptr == nullptr) {
      throw_out_of_memory(plan_report, options_,
                          fmt::format("allocating {} bytes for block '{}' component '{}' failed{}", bytes, block_name, component,
                                      pinned_ ? " (page-locked with cudaHostAlloc: the locked-memory limit, `ulimit -l` or the "
                                                "container's memlock setting, may be what ran out)"
                                              : ""));
    }
    const bool pinned = pinned_;
    return at::from_blob(ptr, {numel}, [pinned](void* p) { free_host(p, pinned); }, tensor_options);
  };

  blocks_.reserve(specs_.size());
  for (const auto& spec : specs_) {
    auto block = std::make_shared<Block>();
    for (const auto& p : spec.params) {
      block->offsets.push_back(block->numel);
      block->numel += param_numel(spec, p);
    }
    block->master = make_buffer(block->numel, at::kFloat, "master", spec.name);
    block->exp_avg = make_buffer(block->numel, at::kFloat, "exp_avg", spec.name);
    block->exp_avg_sq = make_buffer(block->numel, at::kFloat, "exp_avg_sq", spec.name);
    block->compute = make_buffer(block->numel, options_.compute_dtype, "compute", spec.name);
    block->grad = make_buffer(block->numel, options_.grad_dtype, "grad", spec.name);
    blocks_.push_back(std::move(block));
  }
}

HostParamStore::~HostParamStore() = default;

const BlockSpec& HostParamStore::block_spec(int64_t block) const {
  TORCH_CHECK(block >= 0 && block < num_blocks(), "HostParamStore: block ", block, " out of range [0, ",
              num_blocks(), ")");
  return specs_[block];
}

int64_t HostParamStore::block_numel(int64_t block) const {
  block_spec(block);
  return blocks_[block]->numel;
}

MemoryReport HostParamStore::memory_report() const {
  MemoryReport r = plan(specs_, options_);
  r.pinned = pinned_;
  return r;
}

at::Tensor HostParamStore::master(int64_t block) const { return (block_spec(block), blocks_[block]->master); }
at::Tensor HostParamStore::exp_avg(int64_t block) const { return (block_spec(block), blocks_[block]->exp_avg); }
at::Tensor HostParamStore::exp_avg_sq(int64_t block) const {
  return (block_spec(block), blocks_[block]->exp_avg_sq);
}
at::Tensor HostParamStore::compute(int64_t block) const { return (block_spec(block), blocks_[block]->compute); }
at::Tensor HostParamStore::grad(int64_t block) const { return (block_spec(block), blocks_[block]->grad); }

HostParamStore::ParamViews HostParamStore::param(int64_t block, const std::string& name) const {
  const BlockSpec& spec = block_spec(block);
  const Block& b = *blocks_[block];
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (spec.params[i].name != name) continue;
    const auto& shape = spec.params[i].shape;
    const int64_t offset = b.offsets[i];
    const int64_t numel = param_numel(spec, spec.params[i]);
    const auto view = [&](const at::Tensor& flat) { return flat.narrow(0, offset, numel).view(shape); };
    return ParamViews{view(b.master), view(b.exp_avg), view(b.exp_avg_sq), view(b.compute), view(b.grad), offset};
  }
  std::ostringstream names;
  for (const auto& p : spec.params) names << (names.tellp() > 0 ? ", " : "") << p.name;
  TORCH_CHECK(false, "HostParamStore: block ", block, " ('", spec.name, "') has no parameter '", name,
              "'; it has: ", names.str());
}

void HostParamStore::set_param(int64_t block, const std::string& name, const at::Tensor& value) {
  ParamViews v = param(block, name);
  TORCH_CHECK(value.sizes() == v.master.sizes(), "HostParamStore::set_param: '", name, "' of block ", block,
              " has shape ", v.master.sizes(), ", got a value of shape ", value.sizes());
  v.master.copy_(value);
  // Round with the optimizer's own conversion so a freshly loaded copy has exactly the bits a step
  // would have written.
  const float* src = v.master.data_ptr<float>();
  auto* dst = static_cast<uint16_t*>(v.compute.data_ptr());
  const bool bf16 = options_.compute_dtype == at::kBFloat16;
  for (int64_t i = 0, n = v.master.numel(); i < n; ++i) {
    dst[i] = bf16 ? detail::float_to_bf16_bits(src[i]) : detail::float_to_fp16_bits(src[i]);
  }
}

}  // namespace megaslide::offload
