#include "megaslide/train/dit_family.h"

#include <algorithm>
#include <string>

namespace megaslide {

torch::Tensor DiTStack::forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) {
  TORCH_CHECK(inputs.tensors.size() == 3, "DiTStack: expected block inputs {t_mod, text, text_mask}");
  BlockContext ctx;
  const auto& info = std::any_cast<const DiTStackInfo&>(inputs.info);
  ctx.grid = info.grid;
  ctx.cp = info.cp;
  ctx.t_mod = inputs.tensors[0];
  ctx.text = inputs.tensors[1];
  ctx.text_mask = inputs.tensors[2];
  return model_->blocks[index]->as<DiTBlockImpl>()->forward(x, ctx);
}

std::vector<std::pair<std::string, torch::Tensor>> DiTStack::named_resident_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model_->named_parameters(true))
    if (item.key().rfind("blocks.", 0) != 0) out.emplace_back(item.key(), item.value());
  if (text_encoder_)
    for (const auto& item : text_encoder_->named_parameters(true))
      out.emplace_back("text_encoder." + item.key(), item.value());
  return out;
}

std::shared_ptr<torch::nn::Module> DiTStack::initial_block(int64_t index) {
  const auto params = model_->blocks[index]->parameters();
  if (params.empty() || !params.front().is_meta()) return nullptr;
  auto block = model_->initial_block(index, torch::kCPU);
  if (init_ != nullptr) {  // train.init_from's tensors of this block, into its fp32 initial weights
    const std::string prefix = "blocks." + std::to_string(index) + ".";
    torch::NoGradGuard no_grad;
    auto params = block->named_parameters(true);
    for (const auto& [name, source] : init_->tensors)
      if (name.rfind(prefix, 0) == 0) source.read_into(params[name.substr(prefix.size())]);
  }
  return block.ptr();
}

void DiTStack::adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> block) {
  auto dit_block = std::dynamic_pointer_cast<DiTBlockImpl>(block);
  TORCH_CHECK(dit_block != nullptr, "DiTStack::adopt_block: block ", index, " is not a DiTBlock");
  model_->replace_block(index, DiTBlock(dit_block));
}

std::vector<torch::Tensor> DiTStack::resident_parameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : named_resident_parameters()) out.push_back(p);
  return out;
}

double model_flops_per_step(const RunConfig& config) {
  const auto count = count_dit_parameters(DiTOptions::from_config(config));
  const auto& m = config.model;
  const auto shape = model_sample_shape(config);
  const TokenGrid grid{shape[1] / m.patch[0], shape[2] / m.patch[1], shape[3] / m.patch[2]};
  const double N = static_cast<double>(grid.numel());
  const double B = static_cast<double>(config.train.batch_size * config.train.grad_accum_steps);
  double keys = N;  // dense
  if (m.arch == Architecture::kSwin) {
    keys = static_cast<double>(std::min(m.swin_window[0], grid.t) * std::min(m.swin_window[1], grid.h) *
                               std::min(m.swin_window[2], grid.w));
  } else if (m.arch == Architecture::kMegaSlide) {
    keys = static_cast<double>(std::min(m.dsa_kernel[0], grid.t) * std::min(m.dsa_kernel[1], grid.h) *
                               std::min(m.dsa_kernel[2], grid.w));
  }
  keys += static_cast<double>(config.data.max_text_tokens);  // cross-attention
  const double attention = 12.0 * static_cast<double>(m.layers) * B * N * keys * static_cast<double>(m.hidden);
  return 6.0 * static_cast<double>(count.total) * B * N + attention;
}

}  // namespace megaslide
