// LoRA around any family's model (train/model_family.h with_lora; docs/lora.md): the family builds its
// model as for full fine-tuning, this wrapper freezes it and trains adapters on its blocks' Linear layers.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <set>
#include <stdexcept>

#include "megaslide/io/files.h"
#include "megaslide/model/lora.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/model_family.h"
#include "megaslide/train/trainer.h"
#include "megaslide/util/errors.h"

namespace megaslide {

namespace {

void freeze(const at::Tensor& p) {
  if (p.defined() && p.requires_grad()) p.set_requires_grad(false);
}

// The family's stack with its blocks frozen: the adapters are the resident parameters, attached to each
// block the engine builds.
class LoraStack final : public offload::StreamedModel {
 public:
  LoraStack(std::shared_ptr<offload::StreamedModel> inner, std::shared_ptr<LoraAdapters> adapters,
            std::vector<std::string> prefixes)
      : inner_(std::move(inner)), adapters_(std::move(adapters)), prefixes_(std::move(prefixes)) {}
  int64_t num_blocks() const override { return inner_->num_blocks(); }
  torch::nn::Module& block(int64_t index) override { return inner_->block(index); }
  torch::Tensor forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) override {
    return inner_->forward_block(index, x, inputs);
  }
  std::vector<torch::Tensor> resident_parameters() override {
    std::vector<torch::Tensor> out;
    for (auto& [name, p] : adapters_->parameters()) out.push_back(p);
    return out;
  }
  std::shared_ptr<torch::nn::Module> initial_block(int64_t index) override { return inner_->initial_block(index); }
  void adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> block) override {
    inner_->adopt_block(index, block);
    adapters_->attach(*block, prefixes_[static_cast<size_t>(index)]);
  }

 private:
  std::shared_ptr<offload::StreamedModel> inner_;
  std::shared_ptr<LoraAdapters> adapters_;
  std::vector<std::string> prefixes_;  // block l's parameters' names start with prefixes_[l]
};

class LoraModel final : public FamilyModel {
 public:
  LoraModel(std::unique_ptr<FamilyModel> inner, const ModelRequest& request)
      : inner_(std::move(inner)), config_(*request.config), source_(request.source) {
    const auto options = LoraOptions::from_config(config_.lora);
    adapters_ = std::make_shared<LoraAdapters>(options, request.device, derive_seed(config_.train.seed, 0x4c6f5241));
    std::string example;  // a block's Linear layers, for the error of targets that match none
    const auto note_linears = [&example](torch::nn::Module& module, const std::string& prefix) {
      if (!example.empty()) return;
      for (const auto& item : module.named_modules("", false))
        if (std::dynamic_pointer_cast<LinearImpl>(item.value()))
          example += (example.empty() ? "" : ", ") + prefix + item.key() + ".weight";
    };
    if (request.streamed) {
      auto stack = inner_->stack();
      std::vector<std::string> prefixes;
      for (int64_t l = 0; l < stack->num_blocks(); ++l) {
        prefixes.push_back(inner_->block_name(l) + ".");
        note_linears(stack->block(l), prefixes.back());
        adapters_->add(stack->block(l), prefixes.back());  // a meta skeleton's shapes; attached again once built
      }
      for (auto& p : stack->resident_parameters()) freeze(p);
      stack_ = std::make_shared<LoraStack>(stack, adapters_, std::move(prefixes));
    } else {
      const auto blocks = inner_->block_modules();
      if (blocks.empty())
        throw ConfigError(source_, "lora.rank",
                          "is " + std::to_string(options.rank) + ", but model.arch " + to_string(config_.model.arch) +
                              " has no LoRA");
      for (const auto& [prefix, module] : blocks) {
        note_linears(*module, prefix);
        adapters_->add(*module, prefix);
      }
      for (auto& [name, p] : inner_->named_parameters()) freeze(p);
    }
    if (adapters_->size() == 0) {
      std::string targets, globbed;  // a module name as PEFT's target_modules give it ("to_q") is a glob here
      for (const auto& t : options.targets) {
        targets += (targets.empty() ? "" : ", ") + t;
        if (t.find_first_of("*?[") == std::string::npos) globbed += (globbed.empty() ? "\"*" : ", \"*") + t + "*\"";
      }
      throw ConfigError(
          source_, "lora.targets",
          fmt::format("[{}] match no Linear layer of the blocks; the first block's are: {}{}", targets,
                      example.empty() ? "none" : example,
                      globbed.empty() ? std::string()
                                      : "; each target is a glob of a whole weight name, as listed: [" + globbed +
                                            "] for the modules PEFT's target_modules would name"));
    }
    if (request.init_from) init_from(request);
  }

  io::NamedTensors named_parameters() override { return adapters_->parameters(); }
  std::string block_name(int64_t l) const override { return inner_->block_name(l); }
  std::vector<ModelPart> parts() const override { return inner_->parts(); }
  size_t begin_step() override { return inner_->begin_step(); }
  std::shared_ptr<offload::StreamedModel> stack() override { return stack_; }
  void blocks_built() override {
    inner_->blocks_built();
    // What the engine built and the family drew after the blocks (tables adopted with each block, a head)
    // is frozen too.
    for (auto& [name, p] : inner_->named_parameters()) freeze(p);
  }

  at::Tensor loss(MicroBatchStats& stats) override {
    next_draw();
    return inner_->loss(stats);
  }
  offload::StackInput prologue(MicroBatchStats& stats) override {
    next_draw();
    return inner_->prologue(stats);
  }
  at::Tensor epilogue(const at::Tensor& last_hidden) override { return inner_->epilogue(last_hidden); }

  // The family's data position and the count of micro-batches the dropout masks were drawn for.
  std::string data_state() const override {
    return nlohmann::json{{"data", inner_->data_state()}, {"lora_micro_batches", micro_batches_}}.dump();
  }
  void restore_data(const std::string& state) override {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(state);
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(std::string("the LoRA run's data state is not JSON: ") + e.what());
    }
    if (!j.is_object() || !j.contains("data") || !j["data"].is_string() || !j.contains("lora_micro_batches") ||
        !j["lora_micro_batches"].is_number_unsigned())
      throw std::invalid_argument(
          "the data state is not a LoRA run's ({\"data\": ..., \"lora_micro_batches\": N}): was the checkpoint "
          "saved by a full fine-tuning run?");
    inner_->restore_data(j["data"].get<std::string>());
    micro_batches_ = j["lora_micro_batches"].get<uint64_t>();
  }
  void take_slice(int64_t rank, int64_t world_size) override {
    inner_->take_slice(rank, world_size);
    rank_ = static_cast<uint64_t>(rank);
    world_ = static_cast<uint64_t>(world_size);
  }
  std::string describe_data(int64_t steps) const override { return inner_->describe_data(steps); }
  std::vector<BadItem> take_new_bad_items() override { return inner_->take_new_bad_items(); }

  int64_t tokens_per_sample() const override { return inner_->tokens_per_sample(); }
  // The frozen weights' gradients are not computed: the forward and the input gradients, 2/3 of a full
  // step's FLOPs (the adapters' own are negligible next to them).
  double flops_per_step() const override { return inner_->flops_per_step() * 2.0 / 3.0; }

  void describe(std::vector<std::string>& info, std::vector<std::string>& warnings) const override {
    const auto& o = adapters_->options();
    int64_t trained = 0;
    for (const auto& [name, p] : adapters_->parameters()) trained += p.numel();
    std::string targets;
    for (const auto& t : o.targets) targets += (targets.empty() ? "" : ", ") + t;
    info.push_back(fmt::format(
        "{}: rank {}, alpha {} (scale {}), {}: {} adapters on the Linear layers matching [{}], {} trained parameters; "
        "the model's weights frozen{}",
        o.lokr() ? "LoKr" : "LoRA", o.rank, o.alpha_or_rank(), o.scale(),
        o.lokr() ? fmt::format("factor {}", o.factor) : fmt::format("dropout {}, init {}", o.dropout, o.init),
        adapters_->size(), targets, trained,
        stack_ ? " (its blocks streamed H2D only: no gradient copies, no host optimizer)" : ""));
    if (!init_source_.empty()) info.push_back("the adapters start from " + init_source_);
    inner_->describe(info, warnings);
  }
  std::vector<std::string> write_validation(const std::string& folder, Trainer& trainer) override {
    return inner_->write_validation(folder, trainer);
  }
  double validation_loss(Trainer& trainer) override { return inner_->validation_loss(trainer); }
  void write_weights(const std::string& path, const io::NamedTensors& weights) override {
    save_lora_weights(path, config_, weights, LoraLayout::kDiffusers);
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> block_modules() override {
    return inner_->block_modules();
  }
  FamilyModel& base() override { return inner_->base(); }

 private:
  void next_draw() { adapters_->set_draw(micro_batches_++ * world_ + rank_); }

  // train.init_from: a LoRA file (any layout read_lora reads) or a LoRA run's checkpoint (folder).
  void init_from(const ModelRequest& request) {
    const std::string& path = config_.train.init_from;
    const auto params = adapters_->parameters();
    torch::NoGradGuard no_grad;
    if (io::is_directory(path) || is_checkpoint_pointer(path)) {  // a LoRA run's checkpoint
      ParameterShapes shapes;
      for (const auto& [name, p] : params) shapes.emplace_back(name, p.sizes().vec());
      std::map<std::string, at::Tensor> by_name(params.begin(), params.end());
      for (const auto& [name, source] : request.init_from(shapes, {}).tensors) source.read_into(by_name.at(name));
      return;
    }
    if (!inner_->parts().empty())
      throw InitFromError("train.init_from '" + path +
                          "': a LoRA file starts one DiT's adapters; for two experts give a LoRA run's checkpoint "
                          "folder");
    const auto weights = adapters_->weights();
    std::map<std::string, LoraAdapter> file;
    try {
      file = read_wan_lora(path, weights).adapters;
    } catch (const WanLoraError& e) {
      throw InitFromError(std::string("train.init_from: ") + e.what());
    }
    // The file's adapters must have our adapters' tensors, of the same shapes (the same type, rank and
    // factorization); its update is taken exactly: the part it is linear in rescaled by its scale over ours
    // (alpha may differ).
    std::map<std::string, LoraAdapter> ours = lora_adapters_of(params, adapters_->options());
    const auto shapes = [](const LoraAdapter& a) {
      std::string out;
      for (const auto& [suffix, t] : a.tensors()) out += (out.empty() ? "" : ", ") + suffix + " " + c10::str(t.sizes());
      return out;
    };
    std::vector<std::string> problems;
    std::set<std::string> kinds;  // the file's adapters that do not fit: "LoRA of rank 4"
    for (auto& [weight, a] : file) {
      const auto it = ours.find(weight);
      if (it == ours.end()) {
        problems.push_back("unexpected: an adapter of '" + weight + "' (not in lora.targets)");
        continue;
      }
      if (shapes(a) != shapes(it->second)) {
        const std::string kind = fmt::format("{} of rank {}", a.lokr() ? "LoKr" : "LoRA", a.rank());
        kinds.insert(kind);
        problems.push_back(fmt::format("'{}': the file's {} ({}); lora.type {}, rank {} and factor {} make {}", weight,
                                       kind, shapes(a), config_.lora.type, config_.lora.rank, config_.lora.factor,
                                       shapes(it->second)));
      }
    }
    for (const auto& weight : weights)
      if (!file.count(weight)) problems.push_back("missing: an adapter of '" + weight + "'");
    if (!problems.empty()) {
      // A model's hundreds of adapters: what they have in common first, then a few of them.
      std::string text = fmt::format("train.init_from '{}' does not fit the adapters ({} problem{})", path,
                                     problems.size(), problems.size() == 1 ? "" : "s");
      if (kinds.size() == 1)
        text += fmt::format("; the file's adapters are {}, where lora.type {} and lora.rank {} make others",
                            *kinds.begin(), config_.lora.type, config_.lora.rank);
      constexpr size_t kShown = 6;
      for (size_t i = 0; i < problems.size() && i < kShown; ++i) text += "\n  " + problems[i];
      if (problems.size() > kShown) text += fmt::format("\n  ... and {} more", problems.size() - kShown);
      throw InitFromError(text);
    }
    std::map<std::string, at::Tensor> by_name(params.begin(), params.end());
    const double ours_scale = adapters_->options().scale();
    for (auto& [weight, a] : file) {
      a.scaled_part() = a.scaled_part() * (a.scale() / ours_scale);
      const std::string layer = weight.substr(0, weight.size() - std::string(".weight").size());
      for (const auto& [suffix, t] : a.tensors()) by_name.at(layer + "." + suffix).copy_(t);
    }
    init_source_ =
        fmt::format("the {} file {} ({} adapters)", adapters_->options().lokr() ? "LoKr" : "LoRA", path, file.size());
  }

  std::unique_ptr<FamilyModel> inner_;
  const RunConfig config_;
  const std::string source_;
  std::shared_ptr<LoraAdapters> adapters_;
  std::shared_ptr<offload::StreamedModel> stack_;  // streamed
  uint64_t micro_batches_ = 0, rank_ = 0, world_ = 1;
  std::string init_source_;
};

}  // namespace

std::unique_ptr<FamilyModel> with_lora(std::unique_ptr<FamilyModel> model, const ModelRequest& request) {
  return std::make_unique<LoraModel>(std::move(model), request);
}

std::vector<std::string> lora_weights_files(const std::string& path, const RunConfig& config) {
  return config.model.arch == Architecture::kWan ? wan_comfyui_files(path, config.model.wan)
                                                 : std::vector<std::string>{path};
}

WanLora read_lora_checkpoint(const std::string& path, const std::string& expert, bool ema) {
  std::string checkpoint, source;
  RunConfig config;
  io::NamedTensors masters;
  try {
    checkpoint = find_checkpoint(path);
    verify_checkpoint(checkpoint);
    config = checkpoint_config(checkpoint);
    if (config.model.arch != Architecture::kWan || config.lora.rank <= 0)
      throw WanLoraError("'" + path + "': checkpoint " + checkpoint + " is not a Wan LoRA run's (its model.arch is " +
                         to_string(config.model.arch) + ", lora.rank " + std::to_string(config.lora.rank) + ")");
    // Its adapters sit on the frozen model it started from: one that train.init_from names is not the sampler's.
    const std::optional<bool> adapters_from =
        config.train.init_from.empty() ? std::optional<bool>(true) : holds_lora_adapters(config.train.init_from);
    if (adapters_from != std::optional<bool>(true))
      throw WanLoraError("'" + path + "': the run's adapters sit on the model its train.init_from " +
                         (adapters_from ? "names ('" + config.train.init_from + "')"
                                        : "'" + config.train.init_from +
                                              "' may name (it cannot be read to tell whether it started the adapters "
                                              "or the model)") +
                         ", not on model.wan.weights: sample the merged model instead (megaslide-train --config "
                         "RUN/config.yaml --resume " +
                         checkpoint + " --export-merged FILE)");
    const std::string ema_file = io::join_path(checkpoint, "ema.safetensors");
    source = ema && io::path_exists(ema_file) ? ema_file : io::join_path(checkpoint, "master.safetensors");
    masters = io::read_safetensors(source).tensors;
  } catch (const WanLoraError&) {
    throw;
  } catch (const std::exception& e) {
    throw WanLoraError("'" + path + "': " + error_message(e));
  }
  // Two experts trained together: each DiT's adapters under its prefix.
  std::string prefix;
  if (config.model.wan.expert == "both") prefix = expert == "low" ? "transformer_2." : "transformer.";
  else if (!expert.empty() && expert != config.model.wan.expert &&
           !(expert == "high" && config.model.wan.expert.empty()))
    throw WanLoraError("'" + path + "': the run trained " +
                       (config.model.wan.expert.empty() ? std::string("one DiT")
                                                        : "the " + config.model.wan.expert + "-noise expert") +
                       ", not the " + expert + "-noise expert's adapters");
  WanLora lora;
  lora.source = source;
  lora.expert = config.model.wan.expert == "both" ? (expert == "low" ? "low" : "high") : config.model.wan.expert;
  for (auto& [weight, adapter] : lora_adapters_of(masters, LoraOptions::from_config(config.lora)))
    if (weight.rfind(prefix, 0) == 0) lora.adapters.emplace(weight.substr(prefix.size()), std::move(adapter));
  if (lora.adapters.empty())
    throw WanLoraError("'" + path + "': checkpoint " + checkpoint + " holds no adapters" +
                       (prefix.empty() ? std::string() : " under " + prefix));
  return lora;
}

std::vector<std::string> save_lora_weights(const std::string& path, const RunConfig& config,
                                           const io::NamedTensors& weights, LoraLayout layout) {
  const bool wan = config.model.arch == Architecture::kWan;
  if (!wan && layout != LoraLayout::kDiffusers)
    throw std::invalid_argument(std::string("the ") + to_string(layout) +
                                " LoRA layout names Wan's original weights; model.arch " +
                                to_string(config.model.arch) + " writes diffusers' layout");
  const auto adapters = lora_adapters_of(weights, LoraOptions::from_config(config.lora));  // by the adapted weight
  const auto files = lora_weights_files(path, config);
  // Two experts: each file holds its expert's adapters under its own DiT's names.
  const std::vector<std::string> prefixes =
      files.size() == 2 ? std::vector<std::string>{"transformer.", "transformer_2."} : std::vector<std::string>{""};
  // Wan's block Linear layers (the experts' are alike), for the diffusers metadata's exact target_modules.
  std::vector<std::string> block_linears;
  if (wan && layout == LoraLayout::kDiffusers) {
    const WanTransformer skeleton(WanOptions::from_config(config).device(torch::kMeta));
    for (const auto& item : skeleton->named_modules("", false))
      if (item.key().rfind("blocks.", 0) == 0 && std::dynamic_pointer_cast<LinearImpl>(item.value()))
        block_linears.push_back(item.key());
  }
  io::FileGroup group;  // both experts' files replaced together, once both are written
  for (size_t e = 0; e < files.size(); ++e) {
    WanLora lora;
    lora.block_linears = block_linears;
    // Wan2.2: which expert's DiT the file adapts (both trained together: one file each, high first).
    const auto& expert = config.model.wan.expert;
    if (wan) lora.expert = files.size() == 2 ? (e == 0 ? "high" : "low") : expert == "both" ? "" : expert;
    for (const auto& [weight, a] : adapters)
      if (weight.rfind(prefixes[e], 0) == 0) lora.adapters.emplace(weight.substr(prefixes[e].size()), a);
    save_wan_lora(files[e], lora, layout, &group);
  }
  group.publish();
  return files;
}

}  // namespace megaslide
