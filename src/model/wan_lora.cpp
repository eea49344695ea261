#include "megaslide/model/wan_lora.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <set>
#include <stdexcept>

#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_weights.h"

namespace megaslide {

namespace {

constexpr const char* kMetadataKey = "lora_adapter_metadata";  // diffusers' LORA_ADAPTER_METADATA_KEY

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

std::string strip_weight(const std::string& name) {
  return ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : name;
}

// musubi-tuner's module name of an original name: "lora_unet_" + the name without ".weight", '.' -> '_'.
std::string musubi_module(const std::string& original_weight) {
  std::string m = strip_weight(original_weight);
  for (auto& ch : m)
    if (ch == '.') ch = '_';
  return "lora_unet_" + m;
}

// PEFT's target_modules entry of a module: its name inside a block, without the attention's own prefix
// ("blocks.3.attn1.to_q" -> "to_q", "blocks.3.ffn.net.0.proj" -> "ffn.net.0.proj"); other modules whole.
std::string peft_target(const std::string& module) {
  if (!starts_with(module, "blocks.")) return module;
  std::string inside = module.substr(module.find('.', 7) + 1);
  for (const char* attn : {"attn1.", "attn2."})
    if (starts_with(inside, attn)) inside = inside.substr(6);
  return inside;
}

// One adapter's tensors as read, by module key (diffusers, original or musubi naming without the suffix).
struct Halves {
  at::Tensor down, up, alpha;
};

}  // namespace

double LoraAdapter::scale() const {
  const double r = static_cast<double>(rank());
  return rslora ? alpha / std::sqrt(r) : alpha / r;
}

at::Tensor LoraAdapter::delta() const { return at::matmul(up.to(at::kFloat), down.to(at::kFloat)) * scale(); }

const char* to_string(LoraLayout layout) {
  switch (layout) {
    case LoraLayout::kDiffusers:
      return "diffusers";
    case LoraLayout::kComfyUi:
      return "comfyui";
    case LoraLayout::kMusubi:
      return "musubi";
  }
  return "?";
}

LoraLayout parse_lora_layout(const std::string& name) {
  if (name == "diffusers") return LoraLayout::kDiffusers;
  if (name == "comfyui") return LoraLayout::kComfyUi;
  if (name == "musubi") return LoraLayout::kMusubi;
  throw std::invalid_argument("unknown LoRA layout '" + name + "' (diffusers, comfyui or musubi)");
}

WanLora read_wan_lora(const std::string& path, const std::vector<std::string>& weight_names) {
  io::SafetensorsFile file;
  try {
    file = io::read_safetensors(path);
  } catch (const io::IoError& e) {
    throw WanLoraError(e.what());
  }
  auto fail = [&](const std::string& problem) { throw WanLoraError("LoRA '" + path + "': " + problem); };
  if (file.tensors.empty()) fail("holds no tensors");
  WanLora lora;
  lora.source = path;
  const std::string& first = file.tensors.front().first;
  lora.layout = starts_with(first, "lora_unet_")         ? LoraLayout::kMusubi
                : starts_with(first, "diffusion_model.") ? LoraLayout::kComfyUi
                                                         : LoraLayout::kDiffusers;
  // Module key (without the lora_A / lora_down suffix) -> the base weight's diffusers name.
  std::map<std::string, std::string> module_of;
  for (const auto& name : weight_names) {
    if (!ends_with(name, ".weight")) continue;
    if (lora.layout == LoraLayout::kDiffusers) {
      module_of["transformer." + strip_weight(name)] = name;
      continue;
    }
    const std::string original = wan_original_name(name);
    if (original.empty()) continue;
    module_of[lora.layout == LoraLayout::kMusubi ? musubi_module(original)
                                                 : "diffusion_model." + strip_weight(original)] = name;
  }
  std::map<std::string, Halves> halves;
  for (auto& [name, t] : file.tensors) {
    if (name.find("dora_scale") != std::string::npos || name.find("magnitude") != std::string::npos)
      fail("tensor '" + name + "' is DoRA's; DoRA adapters are not supported");
    std::string module, part;
    for (const char* suffix : {".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight", ".alpha"})
      if (ends_with(name, suffix)) {
        module = name.substr(0, name.size() - std::string(suffix).size());
        part = suffix;
      }
    if (module.empty())
      fail("tensor '" + name + "' is not a LoRA tensor (.lora_A/.lora_B/.lora_down/.lora_up .weight or .alpha)");
    if (!module_of.count(module))
      fail("tensor '" + name + "' adapts '" + module + "', which is not a weight of this Wan model");
    if (!t.is_floating_point()) fail("tensor '" + name + "' is not floating point");
    auto& h = halves[module];
    (part == ".alpha"                                          ? h.alpha
     : part == ".lora_A.weight" || part == ".lora_down.weight" ? h.down
                                                               : h.up) = t.to(at::kFloat);
  }
  // diffusers' adapter config: alpha (and per-module alpha_pattern), rsLoRA; none: alpha = r.
  nlohmann::json config;
  if (file.metadata.count(kMetadataKey)) {
    try {
      config = nlohmann::json::parse(file.metadata.at(kMetadataKey));
    } catch (const nlohmann::json::exception& e) {
      fail(std::string("metadata '") + kMetadataKey + "' is not JSON: " + e.what());
    }
    if (config.value("transformer.use_dora", false)) fail("its adapter config says use_dora: DoRA is not supported");
    const auto bias = config.value("transformer.lora_bias", false);
    if (bias) fail("its adapter config says lora_bias: LoRA biases are not supported");
  }
  for (auto& [module, h] : halves) {
    if (!h.down.defined() || !h.up.defined())
      fail("'" + module + "' has " + (h.down.defined() ? "no up (lora_B / lora_up)" : "no down (lora_A / lora_down)") +
           " weight");
    if (h.down.dim() != 2 || h.up.dim() != 2 || h.up.size(1) != h.down.size(0))
      fail(fmt::format("'{}': down {} and up {} are not [r, in] and [out, r]", module, c10::str(h.down.sizes()),
                       c10::str(h.up.sizes())));
    LoraAdapter a;
    a.down = h.down.contiguous();
    a.up = h.up.contiguous();
    a.alpha = static_cast<double>(a.rank());
    if (h.alpha.defined()) {
      if (h.alpha.numel() != 1) fail("'" + module + ".alpha' is not a scalar");
      a.alpha = h.alpha.item<double>();
    } else if (!config.is_null()) {
      a.alpha = config.value("transformer.lora_alpha", a.alpha);
      a.rslora = config.value("transformer.use_rslora", false);
      const auto pattern = config.value("transformer.alpha_pattern", nlohmann::json::object());
      // PEFT's alpha_pattern: a key matching the module's name (its end) overrides lora_alpha.
      const std::string bare = module.substr(std::string("transformer.").size());
      for (auto it = pattern.begin(); it != pattern.end(); ++it)
        if (bare == it.key() || ends_with(bare, "." + it.key())) a.alpha = it.value().get<double>();
    }
    lora.adapters[module_of.at(module)] = std::move(a);
  }
  return lora;
}

io::WrittenFile save_wan_lora(const std::string& path, const WanLora& lora, LoraLayout layout) {
  io::NamedTensors tensors;
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  if (layout == LoraLayout::kDiffusers) {
    // PEFT's config as WanPipeline.save_lora_weights stores it: one rank and alpha, per-module alphas in
    // alpha_pattern when they differ (ranks are read from the shapes).
    std::set<std::string> targets;
    double alpha = lora.adapters.empty() ? 1.0 : lora.adapters.begin()->second.alpha;
    const bool rslora = !lora.adapters.empty() && lora.adapters.begin()->second.rslora;
    nlohmann::json alpha_pattern = nlohmann::json::object();
    int64_t rank = lora.adapters.empty() ? 1 : lora.adapters.begin()->second.rank();
    for (const auto& [weight, a] : lora.adapters) {
      if (a.rslora != rslora)
        throw WanLoraError("LoRA '" + path + "': rsLoRA and plain adapters cannot share one diffusers file");
      const std::string module = strip_weight(weight);
      tensors.emplace_back("transformer." + module + ".lora_A.weight", a.down);
      tensors.emplace_back("transformer." + module + ".lora_B.weight", a.up);
      if (a.alpha != alpha) alpha_pattern[module] = a.alpha;
      targets.insert(peft_target(module));
    }
    nlohmann::ordered_json config;
    config["transformer.alpha_pattern"] = alpha_pattern;
    config["transformer.lora_alpha"] = alpha;
    config["transformer.peft_type"] = "LORA";
    config["transformer.r"] = rank;
    config["transformer.target_modules"] = std::vector<std::string>(targets.begin(), targets.end());
    config["transformer.use_dora"] = false;
    config["transformer.use_rslora"] = rslora;
    metadata[kMetadataKey] = config.dump(2);
  } else {
    for (const auto& [weight, a] : lora.adapters) {
      const std::string original = wan_original_name(weight);
      if (original.empty())
        throw WanLoraError("LoRA '" + path + "': '" + weight + "' has no original Wan name (the " + to_string(layout) +
                           " layout names weights as Wan-AI's files do)");
      if (a.rslora)
        throw WanLoraError("LoRA '" + path + "': an rsLoRA adapter ('" + weight + "') cannot be written in the " +
                           to_string(layout) + " layout (its alpha means alpha / r)");
      const std::string module =
          layout == LoraLayout::kMusubi ? musubi_module(original) : "diffusion_model." + strip_weight(original);
      tensors.emplace_back(module + ".lora_down.weight", a.down);
      tensors.emplace_back(module + ".lora_up.weight", a.up);
      tensors.emplace_back(module + ".alpha", at::scalar_tensor(a.alpha, at::kFloat));
    }
  }
  metadata["megaslide.lora_layout"] = to_string(layout);
  return io::write_safetensors(path, tensors, metadata, at::kFloat);
}

int64_t merge_wan_lora(torch::nn::Module& module, const WanLora& lora, double scale, const std::string& prefix) {
  std::map<std::string, at::Tensor> params;
  for (auto& p : module.named_parameters(true)) params.emplace(prefix + p.key(), p.value());
  torch::NoGradGuard no_grad;
  int64_t merged = 0;
  for (const auto& [weight, a] : lora.adapters) {
    if (!starts_with(weight, prefix)) continue;
    auto it = params.find(weight);
    if (it == params.end()) throw WanLoraError("LoRA '" + lora.source + "': the model has no weight '" + weight + "'");
    auto& w = it->second;
    if (w.dim() != 2 || w.size(0) != a.up.size(0) || w.size(1) != a.down.size(1))
      throw WanLoraError(fmt::format("LoRA '{}': '{}' is {} but the adapter makes [{}, {}]", lora.source, weight,
                                     c10::str(w.sizes()), a.up.size(0), a.down.size(1)));
    if (w.is_meta()) continue;  // a block read on demand: merged when it is read (prefix "blocks.N.")
    w.copy_((w.to(at::kFloat) + scale * a.delta().to(w.device())).to(w.scalar_type()));
    ++merged;
  }
  return merged;
}

}  // namespace megaslide
