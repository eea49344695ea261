#include "megaslide/model/wan_lora.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
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

// PEFT's target_modules entries that adapt the modules `adapted` of a model whose block Linear layers are `linears`
// and nothing else: for each adapted module the shortest of its name inside its attention ("to_q"), inside its block
// ("attn1.to_q") and its whole name that ends no module left unadapted (PEFT adapts every module whose name is a
// target or ends with "." + a target). Without `linears`, the first form.
std::set<std::string> peft_targets(const std::set<std::string>& adapted, const std::vector<std::string>& linears) {
  std::set<std::string> out;
  const auto ends = [](const std::string& name, const std::string& target) {
    return name == target || ends_with(name, "." + target);
  };
  for (const auto& module : adapted) {
    std::vector<std::string> candidates{peft_target(module)};
    if (starts_with(module, "blocks.")) candidates.push_back(module.substr(module.find('.', 7) + 1));
    candidates.push_back(module);
    std::string chosen = candidates.front();
    if (!linears.empty())
      for (const auto& c : candidates) {
        chosen = c;
        if (std::all_of(linears.begin(), linears.end(),
                        [&](const std::string& l) { return !ends(l, c) || adapted.count(l) > 0; }))
          break;
      }
    out.insert(chosen);
  }
  return out;
}

// PEFT's per-module override (rank_pattern, alpha_pattern): a key naming the module (its end) wins over `value`.
double pattern_value(const nlohmann::json& config, const std::string& key, const std::string& module, double value) {
  const auto pattern = config.value(key, nlohmann::json::object());
  for (auto it = pattern.begin(); it != pattern.end(); ++it)
    if (module == it.key() || ends_with(module, "." + it.key())) value = it.value().get<double>();
  return value;
}

// LyCORIS' rank of a LoKr adapter in the ComfyUI and musubi layouts: the decomposed factor's (w2_b's rows, else
// w1_b's); 0 when W1 and W2 are both whole (scale 1).
int64_t lycoris_rank(const LoraAdapter& a) {
  return a.w2_b.defined() ? a.w2_b.size(0) : a.w1_b.defined() ? a.w1_b.size(0) : 0;
}

// What is wrong with a LoKr adapter's tensors ("" when they make one): W1 and W2 each whole or as two factors.
std::string lokr_problem(const LoraAdapter& a) {
  if (a.down.defined() || a.up.defined()) return "mixes LoRA (lora_A / lora_B) and LoKr tensors";
  for (const bool first : {true, false}) {
    const std::string whole = first ? "lokr_w1" : "lokr_w2", factors = whole + "_a and " + whole + "_b";
    const auto& t = first ? a.w1 : a.w2;
    const auto& fa = first ? a.w1_a : a.w2_a;
    const auto& fb = first ? a.w1_b : a.w2_b;
    if (t.defined() == (fa.defined() || fb.defined()) || fa.defined() != fb.defined())
      return "needs " + whole + " or " + factors + " (exactly one of them)";
    if (t.defined() && t.dim() != 2) return whole + " is not a matrix";
    if (fa.defined() && (fa.dim() != 2 || fb.dim() != 2 || fa.size(1) != fb.size(0)))
      return factors + " (" + c10::str(fa.sizes()) + ", " + c10::str(fb.sizes()) + ") do not multiply";
  }
  return "";
}

}  // namespace

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
  if (file.metadata.count("expert")) {
    const std::string& expert = file.metadata.at("expert");
    if (expert == "high_noise" || expert == "low_noise") lora.expert = expert.substr(0, expert.find('_'));
  }
  const std::string& first = file.tensors.front().first;
  // The layout by the first name's prefix; names with none (bare module names) are Wan's original ones or
  // diffusers', whichever the first name is.
  const bool unprefixed = !starts_with(first, "lora_unet_") && !starts_with(first, "diffusion_model.") &&
                          !starts_with(first, "transformer.");
  lora.layout = starts_with(first, "lora_unet_")         ? LoraLayout::kMusubi
                : starts_with(first, "diffusion_model.") ? LoraLayout::kComfyUi
                                                         : LoraLayout::kDiffusers;
  // Module key (without the lora_A / lora_down suffix) -> the base weight's diffusers name.
  std::map<std::string, std::string> module_of;
  for (const auto& name : weight_names) {
    if (!ends_with(name, ".weight")) continue;
    if (lora.layout == LoraLayout::kDiffusers) {
      module_of[(unprefixed ? "" : "transformer.") + strip_weight(name)] = name;
      if (!unprefixed) continue;
    }
    const std::string original = wan_original_name(name);
    if (original.empty()) continue;
    module_of[lora.layout == LoraLayout::kMusubi ? musubi_module(original)
              : unprefixed                       ? strip_weight(original)
                                                 : "diffusion_model." + strip_weight(original)] = name;
  }
  const std::string read_as = unprefixed ? "names without a prefix, read as Wan's original or diffusers' module names"
                              : lora.layout == LoraLayout::kMusubi  ? "musubi-tuner's names (lora_unet_…)"
                              : lora.layout == LoraLayout::kComfyUi ? "ComfyUI's names (diffusion_model.…)"
                                                                    : "diffusers' names (transformer.…)";
  std::map<std::string, LoraAdapter> read;  // by module key
  std::map<std::string, at::Tensor> alphas;
  // The file's suffixes and the adapter's part each names: PEFT's (lora_suffixes()), ComfyUI's and musubi's
  // lora_down / lora_up, and ".alpha" (part "").
  static const std::vector<std::pair<std::string, std::string>> kSuffixes = [] {
    std::vector<std::pair<std::string, std::string>> out{
        {".lora_down.weight", "lora_A.weight"}, {".lora_up.weight", "lora_B.weight"}, {".alpha", ""}};
    for (const auto& s : lora_suffixes()) out.emplace_back("." + s, s);
    return out;
  }();
  for (auto& [name, t] : file.tensors) {
    if (name.find("dora_scale") != std::string::npos || name.find("magnitude") != std::string::npos)
      fail("tensor '" + name + "' is DoRA's; DoRA adapters are not supported");
    if (ends_with(name, ".lokr_t2"))
      fail("tensor '" + name + "' is a LoKr Tucker core (a convolution's); the DiT's Linear layers have none");
    std::string module, part;
    bool known = false;
    for (const auto& [suffix, ours] : kSuffixes)
      if (ends_with(name, suffix)) {
        module = name.substr(0, name.size() - suffix.size());
        part = ours;
        known = true;
      }
    if (!known)
      fail("tensor '" + name +
           "' is not a LoRA or LoKr tensor (.lora_A/.lora_B/.lora_down/.lora_up .weight, .lokr_w1/.lokr_w2 [_a/_b] "
           "or .alpha)");
    if (!module_of.count(module))
      fail("tensor '" + name + "' adapts '" + module + "', which is not a weight of this Wan model (the file's " +
           read_as + ", from its first tensor '" + first + "')");
    if (!t.is_floating_point()) fail("tensor '" + name + "' is not floating point");
    if (part.empty()) alphas[module] = t.to(at::kFloat);
    else read[module].set(part, t.to(at::kFloat).contiguous());
  }
  for (const auto& [module, alpha] : alphas)
    if (!read.count(module)) fail("'" + module + ".alpha' belongs to no adapter");
  // diffusers' adapter config (PEFT's): alpha, per-module alpha_pattern (LoKr: r and rank_pattern too), rsLoRA.
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
  for (auto& [module, a] : read) {
    const auto alpha = alphas.find(module);
    if (alpha != alphas.end() && alpha->second.numel() != 1) fail("'" + module + ".alpha' is not a scalar");
    // The module's name in PEFT's config (diffusers' layout): without "transformer.".
    const std::string bare = starts_with(module, "transformer.") ? module.substr(12) : module;
    if (a.lokr()) {
      const auto problem = lokr_problem(a);
      if (!problem.empty()) fail("'" + module + "' " + problem);
      if (alpha != alphas.end() && lycoris_rank(a) > 0) {  // LyCORIS: alpha over the decomposed factor's rank
        a.alpha = alpha->second.item<double>();
        a.lokr_rank = lycoris_rank(a);
      } else if (alpha == alphas.end() && !config.is_null()) {  // PEFT's config
        a.lokr_rank = static_cast<int64_t>(
            pattern_value(config, "transformer.rank_pattern", bare, config.value("transformer.r", 1.0)));
        if (a.lokr_rank < 1) fail("its adapter config gives '" + module + "' rank " + std::to_string(a.lokr_rank));
        a.alpha = pattern_value(config, "transformer.alpha_pattern", bare,
                                config.value("transformer.alpha", static_cast<double>(a.lokr_rank)));
      } else {  // scale 1: LyCORIS' when W1 and W2 are both whole, and a file without alpha's
        a.alpha = 1.0;
        a.lokr_rank = 1;
      }
    } else {
      if (!a.down.defined() || !a.up.defined())
        fail("'" + module + "' has " +
             (a.down.defined() ? "no up (lora_B / lora_up)" : "no down (lora_A / lora_down)") + " weight");
      if (a.down.dim() != 2 || a.up.dim() != 2 || a.up.size(1) != a.down.size(0))
        fail(fmt::format("'{}': down {} and up {} are not [r, in] and [out, r]", module, c10::str(a.down.sizes()),
                         c10::str(a.up.sizes())));
      a.alpha = static_cast<double>(a.rank());
      if (alpha != alphas.end()) {
        a.alpha = alpha->second.item<double>();
      } else if (!config.is_null()) {
        a.alpha =
            pattern_value(config, "transformer.alpha_pattern", bare, config.value("transformer.lora_alpha", a.alpha));
        a.rslora = config.value("transformer.use_rslora", false);
      }
    }
    lora.adapters[module_of.at(module)] = std::move(a);
  }
  return lora;
}

io::WrittenFile save_wan_lora(const std::string& path, const WanLora& lora, LoraLayout layout, io::FileGroup* group) {
  io::NamedTensors tensors;
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  const bool lokr = !lora.adapters.empty() && lora.adapters.begin()->second.lokr();
  for (const auto& [weight, a] : lora.adapters)
    if (a.lokr() != lokr)
      throw WanLoraError("LoRA '" + path + "': LoRA and LoKr adapters cannot share one file ('" + weight + "' is " +
                         (a.lokr() ? "LoKr" : "LoRA") + ")");
  if (layout == LoraLayout::kDiffusers) {
    // PEFT's config as WanPipeline.save_lora_weights stores it: one rank and alpha, per-module alphas in
    // alpha_pattern when they differ (LoRA's ranks are read from the shapes; LoKr's per-module ones go in
    // rank_pattern).
    std::set<std::string> adapted;
    const double alpha = lora.adapters.empty() ? 1.0 : lora.adapters.begin()->second.alpha;
    const bool rslora = !lora.adapters.empty() && lora.adapters.begin()->second.rslora;
    nlohmann::json alpha_pattern = nlohmann::json::object(), rank_pattern = nlohmann::json::object();
    const int64_t rank = lora.adapters.empty() ? 1 : lora.adapters.begin()->second.rank();
    bool decompose_both = false, default_factors = true;
    int64_t factor = -1;  // LoKr: PEFT's decompose_factor that gives these W1 shapes
    for (const auto& [weight, a] : lora.adapters) {
      if (a.rslora != rslora)
        throw WanLoraError("LoRA '" + path + "': rsLoRA and plain adapters cannot share one diffusers file");
      const std::string module = strip_weight(weight);
      for (const auto& [suffix, t] : a.tensors()) tensors.emplace_back("transformer." + module + "." + suffix, t);
      if (a.alpha != alpha) alpha_pattern[module] = a.alpha;
      if (lokr && a.rank() != rank) rank_pattern[module] = a.rank();
      if (lokr) {
        decompose_both = decompose_both || a.w1_a.defined();
        const int64_t out_l = a.w1.defined() ? a.w1.size(0) : a.w1_a.size(0);
        const int64_t in_m = a.w1.defined() ? a.w1.size(1) : a.w1_b.size(1);
        if (out_l != lokr_factorization(a.out_features()).first || in_m != lokr_factorization(a.in_features()).first) {
          default_factors = false;
          factor = out_l;
        }
      }
      adapted.insert(module);
    }
    const std::set<std::string> targets = peft_targets(adapted, lora.block_linears);
    nlohmann::ordered_json config;
    config["transformer.alpha_pattern"] = alpha_pattern;
    if (lokr) {
      config["transformer.alpha"] = alpha;
      config["transformer.decompose_both"] = decompose_both;
      config["transformer.decompose_factor"] = default_factors ? -1 : factor;
      config["transformer.peft_type"] = "LOKR";
      config["transformer.r"] = rank;
      config["transformer.rank_pattern"] = rank_pattern;
      config["transformer.target_modules"] = std::vector<std::string>(targets.begin(), targets.end());
    } else {
      config["transformer.lora_alpha"] = alpha;
      config["transformer.peft_type"] = "LORA";
      config["transformer.r"] = rank;
      config["transformer.target_modules"] = std::vector<std::string>(targets.begin(), targets.end());
      config["transformer.use_dora"] = false;
      config["transformer.use_rslora"] = rslora;
    }
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
      if (!lokr) {
        tensors.emplace_back(module + ".lora_down.weight", a.down);
        tensors.emplace_back(module + ".lora_up.weight", a.up);
        tensors.emplace_back(module + ".alpha", at::scalar_tensor(a.alpha, at::kFloat));
        continue;
      }
      // LyCORIS' scale: alpha over the decomposed factor's rank, or 1 when W1 and W2 are whole (the scale is
      // then folded into w1).
      const int64_t r = lycoris_rank(a);
      for (const auto& [suffix, t] : a.tensors())
        tensors.emplace_back(module + "." + suffix, r == 0 && suffix == "lokr_w1" ? t * a.scale() : t);
      tensors.emplace_back(module + ".alpha",
                           at::scalar_tensor(r == 0 ? 1.0 : a.scale() * static_cast<double>(r), at::kFloat));
    }
  }
  metadata["megaslide.lora_layout"] = to_string(layout);
  if (!lora.expert.empty()) metadata["expert"] = lora.expert + "_noise";
  return io::write_safetensors(path, tensors, metadata, at::kFloat, group);
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
    if (w.dim() != 2 || w.size(0) != a.out_features() || w.size(1) != a.in_features())
      throw WanLoraError(fmt::format("LoRA '{}': '{}' is {} but the adapter makes [{}, {}]", lora.source, weight,
                                     c10::str(w.sizes()), a.out_features(), a.in_features()));
    if (w.is_meta()) continue;  // a block read on demand: merged when it is read (prefix "blocks.N.")
    w.copy_((w.to(at::kFloat) + scale * a.delta().to(w.device())).to(w.scalar_type()));
    ++merged;
  }
  return merged;
}

}  // namespace megaslide
