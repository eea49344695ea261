#include "megaslide/model/lora.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>

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

}  // namespace

LoraOptions LoraOptions::from_config(const LoraConfig& c) {
  LoraOptions o;
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
    auto down = at::empty({r, in}, at::kFloat);
    if (options_.init == "gaussian") down.normal_(0.0, 1.0 / static_cast<double>(r), g);
    else down.uniform_(-1.0 / std::sqrt(static_cast<double>(in)), 1.0 / std::sqrt(static_cast<double>(in)), g);
    auto up = at::zeros({out, r}, at::kFloat);
    auto adapter =
        std::make_shared<LoraLinear>(down.to(device_).requires_grad_(true), up.to(device_).requires_grad_(true),
                                     options_.scale(), options_.dropout, draw_, derive_seed(seed, 1));
    linear->adapter = adapter;
    by_weight_.emplace(weight, std::move(adapter));
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
    linear->adapter = it->second;
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
    const auto& a = by_weight_.at(weight);
    out.emplace_back(layer + ".lora_A.weight", a->down);
    out.emplace_back(layer + ".lora_B.weight", a->up);
  }
  return out;
}

std::vector<std::string> LoraAdapters::weights() const { return order_; }

std::string lora_base_weight(const std::string& parameter, char* half) {
  for (const char h : {'A', 'B'}) {
    const std::string tail = std::string(".lora_") + h + ".weight";
    if (parameter.size() > tail.size() && parameter.compare(parameter.size() - tail.size(), tail.size(), tail) == 0) {
      if (half != nullptr) *half = h;
      return parameter.substr(0, parameter.size() - tail.size()) + ".weight";
    }
  }
  return "";
}

}  // namespace megaslide
