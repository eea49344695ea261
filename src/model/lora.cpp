#include "megaslide/model/lora.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/kron.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>

#include <array>
#include <cmath>
#include <mutex>
#include <stdexcept>

#include "megaslide/util/glob.h"

namespace megaslide {

namespace {

// FNV-1a: a name's hash that is the same on every platform and run.
uint64_t name_hash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

// A generator on `device` that starts at `seed` (CUDA: a clone of the device's default generator, reseeded).
at::Generator generator_at(torch::Device device, uint64_t seed) {
  if (device.is_cpu()) return at::detail::createCPUGenerator(seed);
  auto base = at::globalContext().defaultGenerator(device);
  at::Generator g;
  {
    std::lock_guard<std::mutex> lock(base.mutex());
    g = base.clone();
  }
  g.set_current_seed(seed);
  return g;
}

// An adapter's tensors by their names' suffixes (PEFT's).
const std::array<std::pair<const char*, at::Tensor LoraAdapter::*>, 8> kParts = {{
    {"lora_A.weight", &LoraAdapter::down},
    {"lora_B.weight", &LoraAdapter::up},
    {"lokr_w1", &LoraAdapter::w1},
    {"lokr_w1_a", &LoraAdapter::w1_a},
    {"lokr_w1_b", &LoraAdapter::w1_b},
    {"lokr_w2", &LoraAdapter::w2},
    {"lokr_w2_a", &LoraAdapter::w2_a},
    {"lokr_w2_b", &LoraAdapter::w2_b},
}};

// Kaiming-uniform with a = sqrt(5), as PEFT and LibTorch draw Linear weights: U(±1 / sqrt(fan_in)).
at::Tensor kaiming_uniform(at::Tensor t, at::Generator& g) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(t.size(1)));
  return t.uniform_(-bound, bound, g);
}

}  // namespace

LoraOptions LoraOptions::from_config(const LoraConfig& c) {
  LoraOptions o;
  o.type = c.type;
  o.factor = c.factor;
  o.rank = c.rank;
  o.alpha = c.alpha;
  o.dropout = c.dropout;
  o.targets = c.targets;
  o.init = c.init;
  return o;
}

LoraLinear::LoraLinear(at::Tensor down_, at::Tensor up_, double scale_, double dropout_,
                       std::shared_ptr<std::atomic<uint64_t>> draw, uint64_t seed)
    : down(std::move(down_)),
      up(std::move(up_)),
      scale(scale_),
      dropout(dropout_),
      draw_(std::move(draw)),
      seed_(seed) {}

torch::Tensor LoraLinear::apply(const torch::Tensor& x, const torch::Tensor& y, bool training) const {
  torch::Tensor h = x;
  if (training && dropout > 0) {
    auto g = generator_at(x.device(), derive_seed(seed_, draw_->load()));
    auto keep = at::empty_like(x).bernoulli_(1.0 - dropout, g);
    h = x * keep.div_(1.0 - dropout);
  }
  const auto dt = x.scalar_type();
  return y + at::linear(at::linear(h, down.to(dt)), up.to(dt)) * scale;
}

LokrLinear::LokrLinear(at::Tensor w1_, at::Tensor w2_, at::Tensor w2_a_, at::Tensor w2_b_, double scale_)
    : w1(std::move(w1_)), w2(std::move(w2_)), w2_a(std::move(w2_a_)), w2_b(std::move(w2_b_)), scale(scale_) {}

torch::Tensor LokrLinear::apply(const torch::Tensor& x, const torch::Tensor& y, bool /*training*/) const {
  const auto dt = x.scalar_type();
  const auto W2 = w2.defined() ? w2.to(dt) : at::matmul(w2_a.to(dt), w2_b.to(dt));  // [out_k, in_n]
  auto sizes = x.sizes().vec();
  sizes.back() = w1.size(1);
  sizes.push_back(W2.size(1));
  // x kron(W1, W2)^T = (W1 · X · W2^T) flattened, X = x as [.., in_m, in_n]: two GEMMs over the rows.
  const auto z = at::matmul(x.reshape(sizes), W2.t());                              // [.., in_m, out_k]
  const auto u = at::matmul(z.transpose(-1, -2), w1.to(dt).t()).transpose(-1, -2);  // [.., out_l, out_k]
  return y + u.reshape(y.sizes()) * scale;
}

std::pair<int64_t, int64_t> lokr_factorization(int64_t dim, int64_t factor) {
  if (factor > 0 && dim % factor == 0) return {factor, dim / factor};
  if (factor == -1) factor = dim;
  // PEFT's search: the next divisor m (and n = dim / m) while m < n and m <= factor.
  int64_t m = 1, n = dim;
  while (m < n) {
    int64_t next = m + 1;
    while (dim % next != 0) ++next;
    if (next > factor) break;
    m = next;
    n = dim / next;
  }
  if (m > n) std::swap(m, n);
  return {m, n};
}

double LoraAdapter::scale() const {
  const double r = static_cast<double>(rank());
  if (r <= 0) throw std::logic_error("LoraAdapter::scale: the adapter has no rank");
  return rslora ? alpha / std::sqrt(r) : alpha / r;
}

int64_t LoraAdapter::out_features() const {
  if (!lokr()) return up.size(0);
  return (w1.defined() ? w1.size(0) : w1_a.size(0)) * (w2.defined() ? w2.size(0) : w2_a.size(0));
}

int64_t LoraAdapter::in_features() const {
  if (!lokr()) return down.size(1);
  return (w1.defined() ? w1.size(1) : w1_b.size(1)) * (w2.defined() ? w2.size(1) : w2_b.size(1));
}

at::Tensor LoraAdapter::delta() const {
  const auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
  if (!lokr()) return at::matmul(f(up), f(down)) * scale();
  const auto W1 = w1.defined() ? f(w1) : at::matmul(f(w1_a), f(w1_b));
  const auto W2 = w2.defined() ? f(w2) : at::matmul(f(w2_a), f(w2_b));
  return at::kron(W1, W2) * scale();
}

io::NamedTensors LoraAdapter::tensors() const {
  io::NamedTensors out;
  for (const auto& [suffix, member] : kParts)
    if ((this->*member).defined()) out.emplace_back(suffix, this->*member);
  return out;
}

bool LoraAdapter::set(const std::string& suffix, at::Tensor t) {
  for (const auto& [name, member] : kParts)
    if (suffix == name) {
      this->*member = std::move(t);
      return true;
    }
  return false;
}

at::Tensor& LoraAdapter::scaled_part() { return !lokr() ? up : w1.defined() ? w1 : w1_a; }

LoraAdapters::LoraAdapters(LoraOptions options, torch::Device device, uint64_t seed)
    : options_(std::move(options)), device_(device), seed_(seed), draw_(std::make_shared<std::atomic<uint64_t>>(0)) {
  if (options_.rank < 1) throw std::invalid_argument("LoraAdapters: rank must be >= 1");
}

int64_t LoraAdapters::add(torch::nn::Module& module, const std::string& prefix) {
  int64_t created = 0;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (!linear) continue;
    const std::string weight = prefix + item.key() + ".weight";
    bool wanted = false;
    for (const auto& glob : options_.targets) wanted = wanted || name_matches(glob, weight);
    if (!wanted) continue;
    if (by_weight_.count(weight)) throw std::invalid_argument("LoraAdapters: '" + weight + "' is adapted twice");
    const int64_t in = linear->options.in_features(), out = linear->options.out_features(), r = options_.rank;
    const uint64_t seed = derive_seed(seed_, name_hash(weight));
    auto g = at::detail::createCPUGenerator(seed);
    const auto trained = [this](const at::Tensor& t) { return t.to(device_).requires_grad_(true); };
    Entry entry;
    if (options_.lokr()) {
      // PEFT's LoKr: W1 = 0, W2 (or its two factors) Kaiming-uniform.
      const auto [out_l, out_k] = lokr_factorization(out, options_.factor);
      const auto [in_m, in_n] = lokr_factorization(in, options_.factor);
      at::Tensor w1 = trained(at::zeros({out_l, in_m}, at::kFloat)), w2, w2_a, w2_b;
      entry.tensors.emplace_back("lokr_w1", w1);
      if (2 * r >= std::max(out_k, in_n)) {
        w2 = trained(kaiming_uniform(at::empty({out_k, in_n}, at::kFloat), g));
        entry.tensors.emplace_back("lokr_w2", w2);
      } else {
        w2_a = trained(kaiming_uniform(at::empty({out_k, r}, at::kFloat), g));
        w2_b = trained(kaiming_uniform(at::empty({r, in_n}, at::kFloat), g));
        entry.tensors.emplace_back("lokr_w2_a", w2_a);
        entry.tensors.emplace_back("lokr_w2_b", w2_b);
      }
      entry.adapter = std::make_shared<LokrLinear>(w1, w2, w2_a, w2_b, options_.scale());
    } else {
      auto down = at::empty({r, in}, at::kFloat);
      if (options_.init == "gaussian") down.normal_(0.0, 1.0 / static_cast<double>(r), g);
      else kaiming_uniform(down, g);
      down = trained(down);
      const auto up = trained(at::zeros({out, r}, at::kFloat));
      entry.tensors = {{"lora_A.weight", down}, {"lora_B.weight", up}};
      entry.adapter =
          std::make_shared<LoraLinear>(down, up, options_.scale(), options_.dropout, draw_, derive_seed(seed, 1));
    }
    linear->adapter = entry.adapter;
    by_weight_.emplace(weight, std::move(entry));
    order_.push_back(weight);
    ++created;
  }
  return created;
}

void LoraAdapters::attach(torch::nn::Module& module, const std::string& prefix) const {
  size_t attached = 0;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (!linear) continue;
    const auto it = by_weight_.find(prefix + item.key() + ".weight");
    if (it == by_weight_.end()) continue;
    linear->adapter = it->second.adapter;
    ++attached;
  }
  size_t expected = 0;
  for (const auto& name : order_) expected += name.rfind(prefix, 0) == 0 ? 1 : 0;
  if (attached != expected)
    throw std::invalid_argument("LoraAdapters::attach: the module under '" + prefix + "' has " +
                                std::to_string(attached) + " of its " + std::to_string(expected) +
                                " adapted Linear layers");
}

io::NamedTensors LoraAdapters::parameters() const {
  io::NamedTensors out;
  for (const auto& weight : order_) {
    const std::string layer = weight.substr(0, weight.size() - std::string(".weight").size());
    for (const auto& [suffix, t] : by_weight_.at(weight).tensors) out.emplace_back(layer + "." + suffix, t);
  }
  return out;
}

std::vector<std::string> LoraAdapters::weights() const { return order_; }

const std::vector<std::string>& lora_suffixes() {
  static const std::vector<std::string> suffixes = [] {
    std::vector<std::string> out;
    for (const auto& [suffix, member] : kParts) out.emplace_back(suffix);
    return out;
  }();
  return suffixes;
}

std::string lora_base_weight(const std::string& parameter, std::string* suffix) {
  for (const auto& s : lora_suffixes()) {
    const std::string tail = "." + s;
    if (parameter.size() > tail.size() && parameter.compare(parameter.size() - tail.size(), tail.size(), tail) == 0) {
      if (suffix != nullptr) *suffix = s;
      return parameter.substr(0, parameter.size() - tail.size()) + ".weight";
    }
  }
  return "";
}

std::map<std::string, LoraAdapter> lora_adapters_of(const io::NamedTensors& parameters, const LoraOptions& options) {
  std::map<std::string, LoraAdapter> out;
  for (const auto& [name, t] : parameters) {
    std::string suffix;
    const std::string weight = lora_base_weight(name, &suffix);
    if (weight.empty()) throw std::invalid_argument("'" + name + "' is not an adapter's tensor");
    auto& a = out[weight];
    a.set(suffix, t.detach().to(at::kCPU, at::kFloat).contiguous());
    a.alpha = options.alpha_or_rank();
    a.lokr_rank = options.lokr() ? options.rank : 0;
  }
  return out;
}

}  // namespace megaslide
