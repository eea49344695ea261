#include "megaslide/model/dit_weights.h"
#include "megaslide/io/finite_weights.h"

#include <map>
#include <set>

#include "megaslide/util/build_info.h"

namespace megaslide {

namespace {
constexpr const char* kFormat = "megaslide.weights";
constexpr const char* kFormatVersion = "1";

void add_module(io::NamedTensors& out, const std::string& prefix, const torch::nn::Module& module,
                torch::ScalarType dtype) {
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    out.emplace_back(prefix + p.key(), p.value().detach().to(torch::kCPU, dtype));
}
}  // namespace

io::NamedTensors weights_tensors(DiT& dit, TextEncoder& text_encoder, torch::ScalarType dtype) {
  io::NamedTensors out;
  add_module(out, "dit.", *dit, dtype);
  if (text_encoder) add_module(out, "text_encoder.", *text_encoder, dtype);  // none with CLIP (frozen)
  return out;
}

io::WrittenFile save_weights(const std::string& path, const RunConfig& config, const io::NamedTensors& parameters,
                             torch::ScalarType dtype) {
  std::map<std::string, std::string> metadata{{"format", kFormat},
                                              {"format_version", kFormatVersion},
                                              {"config", to_yaml(config)},
                                              {"megaslide_version", version()}};
  // The tensors are cast one at a time as they are written: exporting a model whose masters fill host
  // RAM needs one tensor's copy, not the model's.
  io::NamedTensors tensors;
  tensors.reserve(parameters.size());
  for (const auto& [name, value] : parameters) {
    const bool text = name.rfind("text_encoder.", 0) == 0;
    tensors.emplace_back(text ? name : "dit." + name, value);
  }
  return io::write_safetensors(path, tensors, metadata, dtype);
}

void save_weights(const std::string& path, const RunConfig& config, DiT& dit, TextEncoder& text_encoder,
                  torch::ScalarType dtype) {
  io::NamedTensors parameters;
  for (const auto& p : dit->named_parameters(/*recurse=*/true)) parameters.emplace_back(p.key(), p.value());
  if (text_encoder)
    for (const auto& p : text_encoder->named_parameters(/*recurse=*/true))
      parameters.emplace_back("text_encoder." + p.key(), p.value());
  save_weights(path, config, parameters, dtype);
}

TextToVideoModel load_weights(const std::string& path, torch::Device device, torch::ScalarType dtype) {
  auto file = io::read_safetensors(path);
  auto meta = [&](const std::string& key) -> std::string {
    auto it = file.metadata.find(key);
    if (it == file.metadata.end())
      throw WeightsError("weights file '" + path + "': __metadata__ has no '" + key +
                         "' (not a megaslide weights file)");
    return it->second;
  };
  if (meta("format") != kFormat)
    throw WeightsError("weights file '" + path + "': __metadata__.format is '" + meta("format") + "', expected '" +
                       kFormat + "'");
  if (meta("format_version") != kFormatVersion)
    throw WeightsError("weights file '" + path + "': format_version '" + meta("format_version") +
                       "' is not supported (this build reads " + kFormatVersion + ")");

  TextToVideoModel model;
  model.config = parse_saved_run_config(meta("config"), path + " (__metadata__.config)");
  CaptionTokenizer tokenizer;
  model.dit = DiT(DiTOptions::from_config(model.config));
  if (model.config.model.text_encoder.kind == "builtin")  // CLIP is frozen: loaded from its own folder, not stored here
    model.text_encoder = TextEncoder(
        TextEncoderOptions(tokenizer.vocab_size(), model.config.model.text_dim, model.config.data.max_text_tokens));

  std::map<std::string, torch::Tensor> by_name(file.tensors.begin(), file.tensors.end());
  std::set<std::string> used;
  auto fill = [&](const std::string& prefix, torch::nn::Module& module) {
    torch::NoGradGuard no_grad;
    for (auto& p : module.named_parameters(true)) {
      const std::string name = prefix + p.key();
      auto it = by_name.find(name);
      if (it == by_name.end()) throw WeightsError("weights file '" + path + "': tensor '" + name + "' is missing");
      if (it->second.sizes() != p.value().sizes())
        throw WeightsError("weights file '" + path + "': tensor '" + name + "' has shape " +
                           c10::str(it->second.sizes()) + ", the model built from its config needs " +
                           c10::str(p.value().sizes()));
      if (!it->second.is_floating_point())
        throw WeightsError("weights file '" + path + "': tensor '" + name + "' is " +
                           c10::toString(it->second.scalar_type()) + ", expected a floating-point type");
      const auto values = it->second.contiguous();
      try {
        io::require_finite(values.data_ptr(), values.numel(), values.scalar_type(), path, name);
      } catch (const io::NonFiniteWeightsError& e) {
        throw WeightsError(std::string("weights file ") + e.what());
      }
      p.value().copy_(values);
      used.insert(name);
    }
  };
  fill("dit.", *model.dit);
  if (model.text_encoder) fill("text_encoder.", *model.text_encoder);
  for (const auto& [name, tensor] : file.tensors)
    if (!used.count(name))
      throw WeightsError("weights file '" + path + "': tensor '" + name +
                         "' is not a parameter of the model its config describes");

  model.dit->to(device, dtype);
  if (model.text_encoder) model.text_encoder->to(device, dtype);
  model.dit->eval();
  if (model.text_encoder) model.text_encoder->eval();
  return model;
}

}  // namespace megaslide
