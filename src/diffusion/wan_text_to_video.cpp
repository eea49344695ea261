#include "megaslide/diffusion/wan_text_to_video.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <utility>

#include "io/pretrained.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/clip_vision_encoder.h"
#include "megaslide/model/dit_weights.h"
#include "megaslide/model/encoder_settings.h"
#include "megaslide/model/wan_weights.h"

namespace megaslide {

const char* const kWanNegativePrompt =
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，"
    "残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱"
    "的背景，"
    "三条腿，背景人很多，倒着走";

WanSampleOptions WanSampleOptions::from_config(const RunConfig& config) {
  return WanSampleOptions()
      .steps(config.diffusion.sample_steps)
      .shift(config.diffusion.shift)
      .guidance_scale(config.diffusion.guidance_scale)
      .guidance_scale_2(config.diffusion.guidance_scale_2)
      // Two experts: named in weights_2, or trained together (expert both, with or without weights).
      .boundary_ratio(config.model.wan.weights_2.empty() && config.model.wan.expert != "both"
                          ? 0.0
                          : config.model.wan.boundary_ratio)
      .text_tokens(config.data.max_text_tokens);
}

int64_t wan_video_fps(const RunConfig& config) {
  if (config.data.dataset == "videos" && config.data.fps > 0)
    return std::max<int64_t>(1, static_cast<int64_t>(std::llround(config.data.fps)));
  return config.model.vae.downscale == 16 || config.model.wan.out_channels == 48 ? 24 : 16;
}

FlowSamplerOptions WanSampleOptions::flow() const {
  return FlowSamplerOptions()
      .kind(kind())
      .steps(steps())
      .shift(shift())
      .guidance_scale(guidance_scale())
      .boundary_ratio(boundary_ratio())
      .guidance_scale_2(guidance_scale_2());
}

namespace {

// The parameters of block l's attention and FFN (what is streamed, and what a compute dtype applies to).
std::set<const void*> streamed_parameter_set(WanTransformer& model) {
  std::set<const void*> out;
  for (const auto& block : *model->blocks)
    for (const auto& p : block->as<WanBlockImpl>()->streamed().parameters(true)) out.insert(p.unsafeGetTensorImpl());
  return out;
}

// The forward pass both denoisers share: fp32 prologue and head, blocks in the tokens' dtype `dt`.
template <typename RunBlock>
torch::Tensor wan_predict(WanTransformer& model, torch::Device device, c10::ScalarType dt, const torch::Tensor& x,
                          const torch::Tensor& timesteps, const torch::Tensor& text, const torch::Tensor& image,
                          const RunBlock& run_block) {
  torch::NoGradGuard no_grad;
  auto e = model->embed(x.to(device, torch::kFloat32), timesteps.to(device, torch::kFloat32),
                        text.to(device, torch::kFloat32),
                        image.defined() ? image.to(device, torch::kFloat32) : torch::Tensor());
  auto h = e.tokens.to(dt);
  e.ctx.context = e.ctx.context.to(dt);
  const int64_t L = static_cast<int64_t>(model->blocks->size());
  for (int64_t l = 0; l < L; ++l) h = run_block(l, h, e.ctx);
  return model->head(h.to(torch::kFloat32), e.temb, e.ctx.grid).to(torch::kFloat32);
}

bool is_meta_block(WanTransformer model, int64_t l) {
  const auto params = model->blocks[l]->parameters(true);
  return !params.empty() && params.front().is_meta();
}

// Block l's initial weights as WanTransformer's constructor draws them from the default CPU generator,
// blocks asked for in order; the caller's generator state is kept.
class InOrderBlockDraws {
 public:
  InOrderBlockDraws(WanTransformer model, torch::Tensor first_state)
      : model_(std::move(model)), state_(std::move(first_state)) {}
  WanBlock draw(int64_t l) {
    TORCH_CHECK(l == next_, "Wan blocks on demand: block ", l, " asked for, but the blocks are read in order and ",
                next_, " is next");
    auto generator = at::detail::getDefaultCPUGenerator();
    const auto saved = generator.get_state();
    generator.set_state(state_);
    WanBlock block = model_->new_block(torch::kCPU);
    state_ = generator.get_state();
    generator.set_state(saved);
    ++next_;
    return block;
  }

 private:
  WanTransformer model_;
  torch::Tensor state_;
  int64_t next_ = 0;
};

// A meta-block skeleton of the DiT `options` describes, and the draws its blocks would have had: the
// generator state after the prologue's draws, as in WanTransformer's constructor.
std::pair<WanTransformer, std::shared_ptr<InOrderBlockDraws>> wan_skeleton(WanOptions options) {
  auto generator = at::detail::getDefaultCPUGenerator();
  const auto start = generator.get_state();
  WanTransformer dit(options.block_device(torch::kMeta));
  const auto after = generator.get_state();
  generator.set_state(start);
  dit->initialise_prologue();  // the constructor's first draws again: the blocks' draws start where these end
  auto draws = std::make_shared<InOrderBlockDraws>(dit, generator.get_state());
  generator.set_state(after);
  return {dit, draws};
}

}  // namespace

void WanModel::load_blocks() {
  if (!block) return;
  for (int64_t l = 0; l < static_cast<int64_t>(dit->blocks->size()); ++l)
    if (is_meta_block(dit, l)) dit->replace_block(l, block(l));
  block = nullptr;
  dit->eval();
}

namespace {
// A block's streamed parameters (attention and FFN) converted in place to the compute dtype.
void streamed_to(WanBlockImpl& block, c10::ScalarType compute_dtype) {
  if (compute_dtype == at::kFloat) return;
  for (auto& p : block.streamed().parameters(true)) p.set_data(p.detach().to(compute_dtype));
}
}  // namespace

ResidentWanDenoiser::ResidentWanDenoiser(WanTransformer model, torch::Device device, c10::ScalarType compute_dtype,
                                         bool parked)
    : model_(std::move(model)), device_(device), compute_dtype_(compute_dtype), parked_(parked && !device.is_cpu()) {
  TORCH_CHECK(model_, "ResidentWanDenoiser: the model is null");
  for (int64_t l = 0; l < static_cast<int64_t>(model_->blocks->size()); ++l)
    TORCH_CHECK(!is_meta_block(model_, l), "ResidentWanDenoiser: block ", l,
                " is a meta skeleton (WanModel::load_blocks reads it)");
  TORCH_CHECK(compute_dtype == at::kFloat || compute_dtype == at::kBFloat16 || compute_dtype == at::kHalf,
              "ResidentWanDenoiser: compute dtype must be Float, BFloat16 or Half, got ", compute_dtype);
  torch::NoGradGuard no_grad;
  model_->to(parked_ ? torch::Device(torch::kCPU) : device_);
  model_->eval();
  for (const auto& block : *model_->blocks) streamed_to(*block->as<WanBlockImpl>(), compute_dtype_);
}

namespace {
// The blocks of a model loaded with blocks_on_demand, read one by one onto `device` in `compute_dtype`.
WanTransformer blocks_onto(WanModel model, torch::Device device, c10::ScalarType compute_dtype) {
  TORCH_CHECK(model.dit, "ResidentWanDenoiser: the model is null");
  if (!model.block) return model.dit;
  torch::NoGradGuard no_grad;
  for (int64_t l = 0; l < static_cast<int64_t>(model.dit->blocks->size()); ++l) {
    if (!is_meta_block(model.dit, l)) continue;
    WanBlock block = model.block(l);
    block->to(device);
    streamed_to(*block, compute_dtype);
    model.dit->replace_block(l, block);
  }
  model.block = nullptr;  // the weights' mapping closed
  return model.dit;
}
}  // namespace

ResidentWanDenoiser::ResidentWanDenoiser(WanModel model, torch::Device device, c10::ScalarType compute_dtype,
                                         bool parked)
    : ResidentWanDenoiser(blocks_onto(std::move(model), parked ? torch::Device(torch::kCPU) : device, compute_dtype),
                          device, compute_dtype, parked) {}

void ResidentWanDenoiser::park() {
  if (parked_ || device_.is_cpu()) return;
  torch::NoGradGuard no_grad;
  model_->to(torch::kCPU);
  parked_ = true;
}

torch::Tensor ResidentWanDenoiser::predict(const torch::Tensor& x, const torch::Tensor& timesteps,
                                           const torch::Tensor& text, const torch::Tensor& image) {
  if (parked_) {
    torch::NoGradGuard no_grad;
    model_->to(device_);
    parked_ = false;
  }
  return wan_predict(model_, device_, compute_dtype_, x, timesteps, text, image,
                     [&](int64_t l, const torch::Tensor& h, const WanBlockContext& ctx) {
                       return model_->blocks[l]->as<WanBlockImpl>()->forward(h, ctx);
                     });
}

StreamedWanDenoiser::StreamedWanDenoiser(WanTransformer model, StreamedDenoiserOptions options)
    : model_(std::move(model)), options_(options) {
  build({});
}

namespace {
// What both of StreamedWanDenoiser's constructions check first: a model with blocks and a compute dtype
// the streamer takes. Returns the number of blocks.
int64_t checked_block_count(const WanTransformer& model, c10::ScalarType dt) {
  TORCH_CHECK(model, "StreamedWanDenoiser: the model is null");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "StreamedWanDenoiser: compute dtype must be Float, BFloat16 or Half, got ", dt);
  const int64_t L = static_cast<int64_t>(model->blocks->size());
  TORCH_CHECK(L >= 1, "StreamedWanDenoiser: the model has no blocks");
  return L;
}
}  // namespace

StreamedWanDenoiser::StreamedWanDenoiser(WanModel model, StreamedDenoiserOptions options)
    : model_(std::move(model.dit)), options_(options) {
  build(model.block);
}

StreamedWanDenoiser::StreamedWanDenoiser(WanTransformer model, std::vector<WanBlockWeights> blocks,
                                         StreamedDenoiserOptions options)
    : model_(std::move(model)), options_(options) {
  const auto dt = options_.compute_dtype;
  const int64_t L = checked_block_count(model_, dt);
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == L, "StreamedWanDenoiser: ", blocks.size(),
              " blocks of weights for a model of ", L, " blocks");
  params_.resize(static_cast<size_t>(L));
  bool first_fp8 = false;
  for (int64_t l = 0; l < L; ++l) {
    auto& w = blocks[static_cast<size_t>(l)];
    const bool fp8 = w.scales.defined();
    if (l == 0) first_fp8 = fp8;
    TORCH_CHECK(w.flat.defined() && w.flat.dim() == 1 && w.flat.device().is_cpu() &&
                    w.flat.scalar_type() == (fp8 ? at::kFloat8_e4m3fn : dt),
                "StreamedWanDenoiser: block ", l, "'s weights must be a 1-D host tensor of the compute dtype ", dt,
                " (or float8_e4m3fn with scales)");
    const auto named = model_->blocks[l]->as<WanBlockImpl>()->streamed().named_parameters(true);
    TORCH_CHECK(!fp8 || w.scales.numel() == static_cast<int64_t>(named.size()), "StreamedWanDenoiser: block ", l,
                " has ", named.size(), " streamed parameters and ", w.scales.numel(), " fp8 scales");
    TORCH_CHECK(fp8 == first_fp8, "StreamedWanDenoiser: every block's weights or none are fp8");
    TORCH_CHECK(!fp8 || w.exact.empty() || w.exact.size() == named.size(), "StreamedWanDenoiser: block ", l, " has ",
                named.size(), " streamed parameters and ", w.exact.size(), " exact values");
    // A lent streamer's owner upcasts the blocks with its own scales: the denoiser needs none on the device.
    if (fp8 && !options_.lent_streamer) {
      scales_.push_back(w.scales.to(torch::kFloat).to(options_.device));
      std::vector<torch::Tensor> exact;
      for (const auto& e : w.exact) exact.push_back(e.defined() ? e.to(options_.device) : torch::Tensor());
      exact_.push_back(std::move(exact));
    }
    TORCH_CHECK(named.size() == w.offsets.size() && named.size() == w.shapes.size(), "StreamedWanDenoiser: block ", l,
                " has ", named.size(), " streamed parameters, its weights describe ", w.offsets.size());
    for (size_t i = 0; i < named.size(); ++i) {
      const int64_t numel = c10::multiply_integers(w.shapes[i]);
      TORCH_CHECK(w.offsets[i] >= 0 && w.offsets[i] + numel <= w.flat.numel(), "StreamedWanDenoiser: block ", l,
                  "'s parameter '", named[i].key(), "' lies outside its ", w.flat.numel(), " weights");
      params_[static_cast<size_t>(l)].push_back({named[i].value(), w.offsets[i], numel, w.shapes[i]});
    }
    host_.push_back(w.flat);
  }
  adopt_borrowed_blocks(*model_, params_, options_, "StreamedWanDenoiser");
  make_streamer();
}

void StreamedWanDenoiser::make_streamer() {
  if (options_.lent_streamer) {  // fp8 blocks: the lent streamer's owner upcasts them as it would its own
    check_lent_streamer(options_, host_, "StreamedWanDenoiser");
    slots_ = options_.lent_streamer;
    return;
  }
  std::vector<int64_t> numels;
  for (const auto& h : host_) numels.push_back(h.numel());
  offload::WeightStreamerOptions o{options_.device, options_.compute_dtype, options_.mode};
  if (!scales_.empty()) {
    o.gradients = false;
    o.transfer_dtype = at::kFloat8_e4m3fn;
  }
  streamer_ = std::make_unique<offload::WeightStreamer>(numels, o);
  slots_ = streamer_.get();
  if (!scales_.empty())
    streamer_->set_upcast([this](int64_t l, const at::Tensor& raw, const at::Tensor& weights) {
      std::vector<int64_t> offsets, sizes;
      for (const auto& p : params_[static_cast<size_t>(l)]) {
        offsets.push_back(p.offset);
        sizes.push_back(p.numel);
      }
      offload::upcast_fp8_block(raw, weights, offsets, sizes, scales_[static_cast<size_t>(l)],
                                exact_[static_cast<size_t>(l)]);
    });
}

void StreamedWanDenoiser::build(const std::function<WanBlock(int64_t)>& block_source) {
  const auto dt = options_.compute_dtype;
  const int64_t L = checked_block_count(model_, dt);
  bool pin = false;
#ifdef MEGASLIDE_WITH_CUDA
  pin = options_.device.is_cuda() && options_.pin_host_memory;
#endif
  torch::NoGradGuard no_grad;
  const auto empty = torch::TensorOptions().dtype(dt).device(options_.device);
  params_.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    if (is_meta_block(model_, l)) {  // read from the weights now: one fp32 block at a time
      TORCH_CHECK(block_source, "StreamedWanDenoiser: block ", l, " is a meta skeleton and no block source was given");
      model_->replace_block(l, block_source(l));
    }
    auto& streamed = model_->blocks[l]->as<WanBlockImpl>()->streamed();
    int64_t n = 0;
    for (const auto& item : streamed.named_parameters(true)) {
      TORCH_CHECK(item.value().numel() > 0, "StreamedWanDenoiser: block ", l, "'s parameter '", item.key(),
                  "' is empty (is this model already streamed by another denoiser?)");
      params_[l].push_back({item.value(), n, item.value().numel(), item.value().sizes().vec()});
      n += item.value().numel();
    }
    auto flat = torch::empty({n}, torch::TensorOptions().dtype(dt).pinned_memory(pin));
    for (auto& p : params_[l]) {
      flat.narrow(0, p.offset, p.numel).copy_(p.param.detach().reshape({-1}).to(torch::kCPU, dt));
      p.param.set_data(torch::empty({0}, empty));  // the fp32 copy is freed block by block
    }
    host_.push_back(flat);
  }
  // Everything else stays resident in fp32: the prologue, the head, each block's scale_shift_table and norm2.
  const auto streamed = streamed_parameter_set(model_);
  for (auto& p : model_->parameters(true))
    if (!streamed.count(p.unsafeGetTensorImpl())) p.set_data(p.detach().to(options_.device));
  model_->eval();
  make_streamer();
}

StreamedWanDenoiser::~StreamedWanDenoiser() {
  try {
    if (slots_) slots_->synchronize();
  } catch (...) {
  }
}

int64_t StreamedWanDenoiser::host_weight_bytes() const {
  int64_t n = 0;
  for (const auto& h : host_) n += static_cast<int64_t>(h.nbytes());
  return n;
}

torch::Tensor StreamedWanDenoiser::predict(const torch::Tensor& x, const torch::Tensor& timesteps,
                                           const torch::Tensor& text, const torch::Tensor& image) {
  const auto empty = torch::TensorOptions().dtype(options_.compute_dtype).device(options_.device);
  DenoiserPass blocks(*slots_, options_, host_);
  return wan_predict(model_, options_.device, options_.compute_dtype, x, timesteps, text, image,
                     [&](int64_t l, const torch::Tensor& h, const WanBlockContext& ctx) {
                       return blocks.run(l, [&](const torch::Tensor& weights) {
                         offload::BoundParams bound(params_[static_cast<size_t>(l)], weights, empty);
                         return model_->blocks[l]->as<WanBlockImpl>()->forward(h, ctx);
                       });
                     });
}

bool is_wan_weights_file(const std::string& path) {
  const auto header = io::read_safetensors_header(path);
  const auto format = header.metadata.find("format");
  const auto config = header.metadata.find("config");
  if (format == header.metadata.end() || format->second != "megaslide.weights" || config == header.metadata.end())
    return false;
  return parse_saved_run_config(config->second, path + " (__metadata__.config)").model.arch == Architecture::kWan;
}

namespace {
// The DiT whose tensors in `file` are named `prefix` + its parameter names.
WanModel load_wan_dit(const RunConfig& config, const std::string& weights_file,
                      const std::shared_ptr<io::MappedWeights>& file, const std::string& prefix,
                      std::set<std::string>& used, bool blocks_on_demand) {
  WanModel out;
  out.config = config;
  out.source = weights_file;
  auto skeleton = wan_skeleton(WanOptions::from_config(out.config));
  out.dit = skeleton.first;
  auto take = [file, weights_file](const std::string& name, torch::Tensor& p) {
    try {
      p.copy_(file->take(name, p.sizes().vec(), torch::kFloat32, "by the Wan model its config describes"));
    } catch (const std::exception& e) {
      throw WeightsError("weights file '" + weights_file + "': " + e.what());
    }
  };
  torch::NoGradGuard no_grad;
  for (auto& p : out.dit->named_parameters(true)) {
    const std::string name = prefix + p.key();
    if (!file->has(name)) throw WeightsError("weights file '" + weights_file + "': tensor '" + name + "' is missing");
    if (file->shape(name) != p.value().sizes().vec())
      throw WeightsError("weights file '" + weights_file + "': tensor '" + name + "' has shape " +
                         c10::str(c10::IntArrayRef(file->shape(name))) + ", the Wan model its config describes has " +
                         c10::str(p.value().sizes()));
    if (!p.value().is_meta()) take(name, p.value());  // the prologue, the head; the blocks below or on demand
    used.insert(name);
  }
  auto draws = skeleton.second;
  out.block = [draws, take, prefix](int64_t l) {
    WanBlock block = draws->draw(l);
    torch::NoGradGuard no_grad;
    for (auto& p : block->named_parameters(true))
      take(prefix + "blocks." + std::to_string(l) + "." + p.key(), p.value());
    return block;
  };
  if (!blocks_on_demand) out.load_blocks();
  out.dit->eval();
  return out;
}
}  // namespace

WanModel load_wan_model(const std::string& weights_file, bool blocks_on_demand) {
  const auto header = io::read_safetensors_header(weights_file);
  const auto config_text = header.metadata.find("config");
  if (config_text == header.metadata.end())
    throw WeightsError("weights file '" + weights_file +
                       "': __metadata__ has no 'config' (not a megaslide weights file)");
  const RunConfig config = parse_saved_run_config(config_text->second, weights_file + " (__metadata__.config)");
  if (config.model.arch != Architecture::kWan)
    throw WeightsError("weights file '" + weights_file + "': its config's model.arch is " +
                       to_string(config.model.arch) + ", not wan");
  auto file = std::make_shared<io::MappedWeights>(weights_file);
  std::set<std::string> used;
  // A run that trained Wan2.2's two experts (model.wan.expert both) holds both, named by their
  // repository folders: the high-noise expert's "transformer.", the low-noise one's "transformer_2.".
  const bool both = config.model.wan.expert == "both";
  WanModel out = load_wan_dit(config, weights_file, file, both ? "dit.transformer." : "dit.", used, blocks_on_demand);
  if (both)
    out.low_noise = std::make_shared<WanModel>(
        load_wan_dit(config, weights_file, file, "dit.transformer_2.", used, blocks_on_demand));
  for (const auto& name : file->names())
    if (!used.count(name))
      throw WeightsError("weights file '" + weights_file + "': tensor '" + name +
                         "' is not a parameter of the Wan model its config describes");
  return out;
}

namespace {
// One DiT of `config` (resolved) from published weights at `path`: the prologue and head read now, the blocks
// on demand (or all now).
WanModel load_wan_expert(const RunConfig& config, const std::string& path, bool blocks_on_demand) {
  WanModel out;
  out.config = config;
  auto weights = std::make_shared<WanWeights>(WanWeights::open(path));
  auto skeleton = wan_skeleton(WanOptions::from_config(out.config));
  out.dit = skeleton.first;
  std::vector<std::string> allow_missing;
  if (config.model.self_attention == "dsa3d") allow_missing = wan_dsa_parameter_globs();
  // load_wan_weights' check on the whole model (the skeleton has every shape), then the reads: the
  // prologue and head now, the blocks on demand; a parameter allowed missing keeps its drawn value.
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  for (const auto& p : out.dit->named_parameters(true)) expected.emplace_back(p.key(), p.value().sizes().vec());
  weights->check(expected, allow_missing);
  torch::NoGradGuard no_grad;
  for (auto& p : out.dit->named_parameters(true))
    if (!p.value().is_meta() && weights->has(p.key())) p.value().copy_(weights->read(p.key(), torch::kFloat32));
  auto draws = skeleton.second;
  out.block = [draws, weights](int64_t l) {
    WanBlock block = draws->draw(l);
    torch::NoGradGuard no_grad;
    for (auto& p : block->named_parameters(true)) {
      const std::string name = "blocks." + std::to_string(l) + "." + p.key();
      if (weights->has(name)) p.value().copy_(weights->read(name, torch::kFloat32));
    }
    return block;
  };
  if (!blocks_on_demand) out.load_blocks();
  out.source = path;
  out.dit->eval();
  return out;
}
}  // namespace

WanModel load_untrained_expert(const RunConfig& config, bool blocks_on_demand) {
  const std::string other = wan_untrained_expert(config.model.wan);
  if (other.empty())
    throw std::invalid_argument("the run trains no Wan2.2 expert beside another: there is no untrained expert");
  RunConfig dense = config;
  dense.model.self_attention = "dense";  // the published expert, as it was trained (not the run's retrofit)
  return load_wan_expert(dense, other, blocks_on_demand);
}

WanModel with_untrained_expert(WanModel trained, bool blocks_on_demand) {
  const auto& w = trained.config.model.wan;
  const std::string other = wan_untrained_expert(w);
  if (other.empty()) return trained;
  WanModel partner;
  try {
    partner = load_untrained_expert(trained.config, blocks_on_demand);
  } catch (const std::exception& e) {
    throw WeightsError("weights file '" + trained.source + "' fine-tuned Wan2.2's " + w.expert +
                       "-noise expert; the other expert it samples with, '" + other + "', cannot be read: " + e.what());
  }
  if (w.expert == "high") {
    trained.low_noise = std::make_shared<WanModel>(std::move(partner));
    return trained;
  }
  partner.config = trained.config;  // the run's settings (its sampling defaults) for the pair
  partner.low_noise = std::make_shared<WanModel>(std::move(trained));
  return partner;
}

WanModel wan_model_from_config(const RunConfig& config, const std::string& source, bool blocks_on_demand) {
  if (config.model.arch != Architecture::kWan)
    throw ConfigError(source, "model.arch", std::string("is ") + to_string(config.model.arch) + ", not wan");
  if (config.model.wan.weights.empty())
    throw ConfigError(
        source, "model.wan.weights",
        "is empty: sampling needs the DiT's weights (a Wan download, or use a run's checkpoint; a LoRA run on a "
        "randomly initialised base: its megaslide-train --export-merged file, with --checkpoint)");
  WanModel out;
  std::string key = "model.wan.weights";
  try {
    const RunConfig resolved = with_wan_architecture_from_weights(config);
    out = load_wan_expert(resolved, resolved.model.wan.weights, blocks_on_demand);
    if (!resolved.model.wan.weights_2.empty()) {  // Wan2.2: the low-noise expert
      key = "model.wan.weights_2";
      out.low_noise =
          std::make_shared<WanModel>(load_wan_expert(resolved, resolved.model.wan.weights_2, blocks_on_demand));
    }
  } catch (const ConfigError&) {
    throw;
  } catch (const std::exception& e) {
    throw ConfigError(source, key, e.what());
  }
  out.source = config.model.wan.weights;
  return out;
}

WanExpertsDenoiser::WanExpertsDenoiser(std::shared_ptr<WanDenoiser> high, std::shared_ptr<WanDenoiser> low,
                                       double boundary_ratio, bool park_inactive)
    : high_(std::move(high)), low_(std::move(low)), park_inactive_(park_inactive) {
  TORCH_CHECK(high_ && low_, "WanExpertsDenoiser: two experts needed");
  TORCH_CHECK(high_->device() == low_->device(), "WanExpertsDenoiser: the experts are on ", high_->device(), " and ",
              low_->device());
  this->boundary_ratio(boundary_ratio);
}

void WanExpertsDenoiser::boundary_ratio(double ratio) {
  TORCH_CHECK(ratio >= 0 && ratio < 1, "WanExpertsDenoiser: boundary_ratio ", ratio, " is not in [0, 1)");
  boundary_ratio_ = ratio;
}

torch::Tensor WanExpertsDenoiser::predict(const torch::Tensor& x, const torch::Tensor& timesteps,
                                          const torch::Tensor& text, const torch::Tensor& image) {
  // diffusers' WanPipeline: the high-noise expert where t >= boundary_ratio x num_train_timesteps.
  // The step's timestep (per-token timesteps: the noisy tokens', the largest).
  const bool low = boundary_ratio_ > 0 && timesteps[0].max().item<double>() < boundary_ratio_ * 1000.0;
  if (park_inactive_) (low ? high_ : low_)->park();
  return (low ? low_ : high_)->predict(x, timesteps, text, image);
}

WanTextToVideo::WanTextToVideo(RunConfig config, Umt5Encoder text_encoder, Umt5Tokenizer tokenizer,
                               std::shared_ptr<WanDenoiser> denoiser, WanVae vae)
    : config_(std::move(config)),
      text_encoder_(std::move(text_encoder)),
      tokenizer_(std::move(tokenizer)),
      denoiser_(std::move(denoiser)),
      vae_(std::move(vae)) {
  TORCH_CHECK(denoiser_, "WanTextToVideo: no denoiser");
  if (text_encoder_.config().d_model != config_.model.wan.text_dim)
    throw std::invalid_argument(
        "the umT5 encoder '" + text_encoder_.source() + "' is " + std::to_string(text_encoder_.config().d_model) +
        " wide but the Wan DiT's model.wan.text_dim is " + std::to_string(config_.model.wan.text_dim));
  if (tokenizer_.vocab_size() > text_encoder_.config().vocab_size)
    throw std::invalid_argument("the umT5 tokenizer '" + tokenizer_.source() + "' has " +
                                std::to_string(tokenizer_.vocab_size()) + " pieces, the encoder's embedding only " +
                                std::to_string(text_encoder_.config().vocab_size));
  if (vae_.config().z_dim != config_.model.wan.out_channels)
    throw std::invalid_argument("the Wan VAE has " + std::to_string(vae_.config().z_dim) +
                                " latent channels but the DiT's model.wan.out_channels is " +
                                std::to_string(config_.model.wan.out_channels));
  if (vae_.config().spatial_downscale() != config_.model.vae.downscale)
    throw std::invalid_argument("the Wan VAE maps " + std::to_string(vae_.config().spatial_downscale()) +
                                " pixels to a latent but the config's model.vae.downscale is " +
                                std::to_string(config_.model.vae.downscale) +
                                ": set model.vae.downscale: " + std::to_string(vae_.config().spatial_downscale()) +
                                " (16 for Wan2.2's VAE, 8 for Wan2.1's)");
}

std::vector<int64_t> WanTextToVideo::latent_shape() const {
  // The DiT's samples: a latent dataset's sizes, or the latents of a videos dataset's pixel sizes (a run
  // trained from a videos cache keeps data.frames/height/width in pixels).
  const auto shape = model_sample_shape(config_);
  return {config_.model.wan.out_channels, shape[1], shape[2], shape[3]};
}

int64_t WanTextToVideo::prompt_tokens(const std::string& prompt, const WanSampleOptions& options) const {
  return static_cast<int64_t>(
             tokenizer_.encode_text(options.clean_prompts() ? wan_prompt_clean(prompt) : prompt).size()) +
         1;
}

torch::Tensor WanTextToVideo::encode(const std::vector<std::string>& prompts, const WanSampleOptions& options) const {
  torch::NoGradGuard no_grad;
  std::vector<std::string> cleaned = prompts;
  if (options.clean_prompts())
    for (auto& p : cleaned) p = wan_prompt_clean(p);
  const auto tokens = tokenizer_.encode(cleaned, options.text_tokens());
  return text_encoder_.embed(tokens.ids.to(text_encoder_.device()), tokens.mask.to(text_encoder_.device()))
      .to(denoiser_->device(), torch::kFloat32);
}

torch::Tensor WanTextToVideo::sample(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                                     const WanSampleOptions& options,
                                     const std::function<void(int64_t, int64_t)>& on_step,
                                     const std::vector<int64_t>& shape) {
  TORCH_CHECK(prompts.size() == seeds.size() && !prompts.empty(),
              "WanTextToVideo::sample: need one seed per prompt, got ", prompts.size(), " prompts and ", seeds.size(),
              " seeds");
  if (wan_image_to_video(config_.model.wan))
    throw std::invalid_argument("this Wan DiT generates video from an image (model.wan.in_channels " +
                                std::to_string(config_.model.wan.in_channels) + "): give it one");
  Conditioning cond, uncond;
  cond.text = encode(prompts, options);
  if (options.guidance_scale() != 1.0) uncond.text = encode({options.negative_prompt()}, options);
  // Two experts: the options' boundary picks each step's (0: the high-noise expert throughout).
  if (auto* experts = dynamic_cast<WanExpertsDenoiser*>(denoiser_.get()))
    experts->boundary_ratio(options.boundary_ratio());
  else if (options.boundary_ratio() > 0)
    throw std::invalid_argument("a boundary_ratio of " + std::to_string(options.boundary_ratio()) +
                                " switches between two experts, but this pipeline's DiT is one");
  auto model = [&](const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text, const torch::Tensor&) {
    return denoiser_->predict(x, t, text);
  };
  return flow_sample(model, options.flow(), shape.empty() ? latent_shape() : shape, seeds, cond, uncond,
                     denoiser_->device(), on_step);
}

torch::Tensor WanTextToVideo::sample_from_image(const std::vector<std::string>& prompts,
                                                const std::vector<uint64_t>& seeds, const torch::Tensor& image,
                                                const WanSampleOptions& options,
                                                const std::function<void(int64_t, int64_t)>& on_step,
                                                const std::vector<int64_t>& shape) {
  TORCH_CHECK(prompts.size() == seeds.size() && !prompts.empty(),
              "WanTextToVideo::sample_from_image: need one seed per prompt, got ", prompts.size(), " prompts and ",
              seeds.size(), " seeds");
  if (dynamic_cast<WanExpertsDenoiser*>(denoiser_.get()) != nullptr || options.boundary_ratio() > 0 ||
      wan_image_to_video(config_.model.wan))
    throw std::invalid_argument(
        "image-to-video with the first frame kept clean is Wan2.2 TI2V's (one DiT whose input "
        "is the latents alone)");
  const auto latent = shape.empty() ? latent_shape() : shape;
  const int64_t s = vae_.config().spatial_downscale();
  if (image.dim() != 3 || image.size(0) != 3 || image.size(1) != latent[2] * s || image.size(2) != latent[3] * s)
    throw std::invalid_argument(
        fmt::format("the first frame is {} but the video is 3 x {} x {} (channels x height x "
                    "width)",
                    c10::str(image.sizes()), latent[2] * s, latent[3] * s));
  const auto device = denoiser_->device();
  torch::Tensor condition;
  {
    torch::NoGradGuard no_grad;
    condition = vae_.encode(image.to(vae_.device(), torch::kFloat32).view({1, 3, 1, image.size(1), image.size(2)}))
                    .to(device, torch::kFloat32);  // [1, C, 1, h, w], normalised
  }
  const WanFirstFrame first(condition, latent, config_.model.wan.patch);
  auto model = [&](const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text, const torch::Tensor&) {
    return denoiser_->predict(first.mix(x), first.timesteps(t), text);
  };
  Conditioning cond, uncond;
  cond.text = encode(prompts, options);
  if (options.guidance_scale() != 1.0) uncond.text = encode({options.negative_prompt()}, options);
  return first.mix(flow_sample(model, options.flow(), latent, seeds, cond, uncond, device, on_step));
}

WanFirstFrame::WanFirstFrame(torch::Tensor frame, const std::vector<int64_t>& shape,
                             const std::array<int64_t, 3>& patch)
    : frame_(std::move(frame)) {
  // The mask: 0 on the first latent frame, 1 elsewhere; per token, the patch grid's (its first corner).
  mask_ = torch::ones({1, 1, shape[1], shape[2], shape[3]}, torch::dtype(torch::kFloat32).device(frame_.device()));
  mask_.select(2, 0).zero_();
  token_mask_ = mask_[0][0]
                    .slice(0, 0, shape[1], patch[0])
                    .slice(1, 0, shape[2], patch[1])
                    .slice(2, 0, shape[3], patch[2])
                    .flatten();  // [N]
}

torch::Tensor WanFirstFrame::timesteps(const torch::Tensor& t) const {
  return token_mask_.unsqueeze(0) * t.to(frame_.device(), torch::kFloat32).unsqueeze(1);  // [B, N]
}

WanImageCondition WanTextToVideo::image_condition(const torch::Tensor& image, const torch::Tensor& pixels,
                                                  const std::vector<int64_t>& shape) const {
  const auto latent = shape.empty() ? latent_shape() : shape;
  const int64_t s = vae_.config().spatial_downscale();
  if (image.dim() != 3 || image.size(0) != 3 || image.size(1) != latent[2] * s || image.size(2) != latent[3] * s)
    throw std::invalid_argument(fmt::format("the image is {} but the video is 3 x {} x {} (channels x height x width)",
                                            c10::str(image.sizes()), latent[2] * s, latent[3] * s));
  WanImageCondition c;
  c.latents = vae_.encode_image_video(image.to(vae_.device(), torch::kFloat32), 1 + 4 * (latent[1] - 1),
                                      wan_vae_tiling(config_.model.vae))
                  .to(denoiser_->device(), torch::kFloat32);
  if (config_.model.wan.image_dim > 0) {
    if (!image_encoder_)
      throw std::invalid_argument("the Wan DiT has an image branch (Wan2.1 I2V) but the pipeline has no image encoder");
    TORCH_CHECK(pixels.dim() == 3 && pixels.size(2) == 3 && pixels.scalar_type() == torch::kUInt8,
                "WanTextToVideo::image_condition: expected pixels [H, W, 3] uint8, got ", pixels.scalar_type(), " ",
                pixels.sizes());
    torch::NoGradGuard no_grad;
    c.image = image_encoder_(pixels).to(denoiser_->device(), torch::kFloat32);
  }
  return c;
}

torch::Tensor WanTextToVideo::sample_image_to_video(const std::vector<std::string>& prompts,
                                                    const std::vector<uint64_t>& seeds,
                                                    const WanImageCondition& condition, const WanSampleOptions& options,
                                                    const std::function<void(int64_t, int64_t)>& on_step,
                                                    const std::vector<int64_t>& shape) {
  TORCH_CHECK(prompts.size() == seeds.size() && !prompts.empty(),
              "WanTextToVideo::sample_image_to_video: need one seed per prompt, got ", prompts.size(), " prompts and ",
              seeds.size(), " seeds");
  const auto& w = config_.model.wan;
  if (!wan_image_to_video(w))
    throw std::invalid_argument("this Wan DiT is text-to-video (model.wan.in_channels " +
                                std::to_string(w.in_channels) + " = out_channels): it takes no conditioning image");
  const auto latent = shape.empty() ? latent_shape() : shape;
  const int64_t B = static_cast<int64_t>(prompts.size());
  const auto& z = condition.latents;
  if (!z.defined() || z.dim() != 5 || (z.size(0) != 1 && z.size(0) != B) || z.sizes().slice(1).vec() != latent)
    throw std::invalid_argument(fmt::format("the conditioning latents are {}, expected [1 or {}, {}, {}, {}, {}]",
                                            z.defined() ? c10::str(z.sizes()) : "missing", B, latent[0], latent[1],
                                            latent[2], latent[3]));
  const auto& img = condition.image;
  if ((w.image_dim > 0) != img.defined() ||
      (img.defined() && (img.dim() != 3 || (img.size(0) != 1 && img.size(0) != B) || img.size(2) != w.image_dim)))
    throw std::invalid_argument(
        w.image_dim > 0 ? fmt::format("the image tokens are {}, expected [1 or {}, Li, {}] (model.wan.image_dim)",
                                      img.defined() ? c10::str(img.sizes()) : "missing", B, w.image_dim)
                        : std::string("image tokens given to a DiT without an image branch (model.wan.image_dim 0)"));
  if (auto* experts = dynamic_cast<WanExpertsDenoiser*>(denoiser_.get()))
    experts->boundary_ratio(options.boundary_ratio());
  else if (options.boundary_ratio() > 0)
    throw std::invalid_argument("a boundary_ratio of " + std::to_string(options.boundary_ratio()) +
                                " switches between two experts, but this pipeline's DiT is one");
  const auto device = denoiser_->device();
  const auto channels = wan_image_condition(z.to(device, torch::kFloat32).expand({B, -1, -1, -1, -1}));
  const auto tokens = img.defined() ? img.to(device, torch::kFloat32).expand({B, -1, -1}) : torch::Tensor();
  // The guided batch is [conditional; unconditional]: the same image for both halves.
  auto model = [&](const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text, const torch::Tensor&) {
    const int64_t halves = x.size(0) / B;
    const auto input = torch::cat({x, channels.repeat({halves, 1, 1, 1, 1})}, 1);
    return denoiser_->predict(input, t, text, tokens.defined() ? tokens.repeat({halves, 1, 1}) : torch::Tensor());
  };
  Conditioning cond, uncond;
  cond.text = encode(prompts, options);
  if (options.guidance_scale() != 1.0) uncond.text = encode({options.negative_prompt()}, options);
  return flow_sample(model, options.flow(), latent, seeds, cond, uncond, device, on_step);
}

torch::Tensor WanTextToVideo::decode(const torch::Tensor& latents) const {
  torch::NoGradGuard no_grad;
  return vae_.decode(latents.to(vae_.device(), torch::kFloat32)).to(torch::kCPU, torch::kFloat32);
}

OpenedWanPipeline open_wan_pipeline(WanModel model, const WanPipelineRequest& request) {
  const std::string repo = model.config.model.wan.weights;
  // The run's own encoders (a trained run's config names what it was cached with), when they are there.
  const auto& te = model.config.model.text_encoder;
  const auto& ve = model.config.model.vae;
  auto own = [&](const std::string& component) -> std::string {
    const std::string path = component == "text_encoder" && te.kind == "umt5" ? te.weights
                             : component == "vae" && ve.kind == "wan"         ? ve.weights
                                                                              : std::string();
    return !path.empty() && io::path_exists(path) ? path : std::string();
  };
  auto path_of = [&](const std::string& component, const std::string& given, const std::string& what) {
    std::string path = given;
    if (path.empty()) path = own(component);
    if (path.empty() && !repo.empty() && io::is_directory(io::join_path(repo, component)))
      path = io::join_path(repo, component);
    if (path.empty())
      throw WanPipelineError(component, "Wan sampling needs " + what +
                                            " (none given, and model.wan.weights is not a diffusers repository with " +
                                            component + "/)");
    if (!io::path_exists(path)) throw WanPipelineError(component, "'" + path + "' does not exist");
    return path;
  };
  const std::string t5_path = path_of("text_encoder", request.text_encoder, "umT5's weights");
  const std::string vae_path = path_of("vae", request.vae, "the Wan VAE's weights");
  if (!request.tokenizer.empty() && !io::path_exists(request.tokenizer))
    throw WanPipelineError("tokenizer", "'" + request.tokenizer + "' does not exist");
  auto loading = [](const std::string& component, const std::string& prefix, auto&& load) {
    try {
      return load();
    } catch (const std::exception& e) {
      if (is_out_of_memory(e)) throw;
      throw WanPipelineError(component, prefix + error_message(e));
    }
  };

  OpenedWanPipeline out;
  out.encoder_files.emplace_back("text_encoder", t5_path);
  out.encoder_files.emplace_back("vae", vae_path);
  const auto t5_dtype = request.device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  auto t5 =
      loading("text_encoder", "", [&] { return Umt5Encoder::load(t5_path, torch::kCPU, t5_dtype, te.dtype == "fp8"); });
  // umT5 (11.4 GB in bf16 for XXL) streamed layer by layer when it does not fit, as the DiT's blocks.
  out.text_encoder_streamed = should_stream(request.stream, request.device, t5.weight_bytes());
  t5 = out.text_encoder_streamed ? Umt5Encoder::streamed(std::move(t5), request.device)
                                 : Umt5Encoder::resident(std::move(t5), request.device);
  const std::string tokenizer_path =
      !request.tokenizer.empty() || t5_path != te.weights || te.vocab.empty() || !io::path_exists(te.vocab)
          ? request.tokenizer
          : te.vocab;  // the run's own tokenizer, with its own umT5
  auto tokenizer =
      tokenizer_path.empty()
          ? loading("text_encoder",
                    "its tokenizer (or give the tokenizer on its own): ", [&] { return Umt5Tokenizer::find(t5_path); })
          : loading("tokenizer", "", [&] { return Umt5Tokenizer::find(tokenizer_path); });
  if (!tokenizer_path.empty()) out.encoder_files.emplace_back("tokenizer", tokenizer_path);
  auto vae = loading("vae", "", [&] { return WanVae::load(vae_path, request.device, torch::kFloat32); });
  // Wan2.1 I2V: CLIP's image tokens (before the DiT is taken over: a refusal leaves the model as it was).
  std::function<torch::Tensor(const torch::Tensor&)> image_encoder;
  if (model.config.model.wan.image_dim > 0) {
    // Given, else the run's own (where it exists), else the repository's image_encoder/.
    std::string clip_path = request.image_encoder;
    const std::string& own_clip = model.config.model.image_encoder.weights;
    if (clip_path.empty() && !own_clip.empty() && io::path_exists(own_clip)) clip_path = own_clip;
    if (clip_path.empty() && !repo.empty() && io::is_directory(io::join_path(repo, "image_encoder")))
      clip_path = io::join_path(repo, "image_encoder");
    if (clip_path.empty()) clip_path = own_clip;  // named but missing: said below
    if (clip_path.empty())
      throw WanPipelineError(
          "image_encoder",
          "Wan2.1 image-to-video needs CLIP ViT-H's image encoder (none given, and model.wan.weights "
          "is not a diffusers repository with image_encoder/)");
    if (!io::path_exists(clip_path)) throw WanPipelineError("image_encoder", "'" + clip_path + "' does not exist");
    auto clip = std::make_shared<ClipVisionEncoder>(loading("image_encoder", "", [&] {
      // 0.6 B parameters: fp32, or fp8 matrices with model.image_encoder.dtype: fp8
      return ClipVisionEncoder::load(clip_path, request.device, torch::kFloat32, {},
                                     model.config.model.image_encoder.dtype == "fp8");
    }));
    if (clip->config().hidden_size != model.config.model.wan.image_dim)
      throw WanPipelineError("image_encoder",
                             fmt::format("the CLIP image encoder '{}' is {} wide but the DiT's image branch takes {} "
                                         "(model.wan.image_dim)",
                                         clip_path, clip->config().hidden_size, model.config.model.wan.image_dim));
    image_encoder = [clip](const torch::Tensor& pixels) { return clip->encode(pixels); };
    out.encoder_files.emplace_back("image_encoder", clip_path);
  }

  auto weight_bytes = [](const WanModel* m) {
    int64_t bytes = 0;
    if (m != nullptr)
      for (const auto& p : m->dit->parameters()) bytes += static_cast<int64_t>(p.nbytes());
    return bytes;
  };
  const int64_t high_bytes = weight_bytes(&model), low_bytes = weight_bytes(model.low_noise.get());
  // Resident when the DiT (both experts) fits; two experts that fit one at a time take turns on the device;
  // streamed otherwise.
  const bool together = !should_stream(request.stream, request.device, high_bytes + low_bytes);
  out.experts_take_turns =
      !together && model.low_noise && !should_stream(request.stream, request.device, std::max(high_bytes, low_bytes));
  out.dit_streamed = !together && !out.experts_take_turns;
  const RunConfig config = model.config;
  auto denoiser_of = [&](WanModel m, bool parked) -> std::shared_ptr<WanDenoiser> {
    if (out.dit_streamed) {
      StreamedDenoiserOptions so;
      so.device = request.device;
      so.compute_dtype = request.compute_dtype;
      return std::make_shared<StreamedWanDenoiser>(std::move(m), so);  // block by block from the weights
    }
    return std::make_shared<ResidentWanDenoiser>(std::move(m), request.device, request.compute_dtype, parked);
  };
  const std::shared_ptr<WanModel> low = std::move(model.low_noise);
  std::shared_ptr<WanDenoiser> low_denoiser;
  // The low-noise expert first, built in host memory when the experts take turns (the high-noise expert
  // runs the first steps): it reaches the device at the switch, never before.
  if (low) low_denoiser = denoiser_of(std::move(*low), out.experts_take_turns);
  std::shared_ptr<WanDenoiser> denoiser = denoiser_of(std::move(model), false);
  if (low)
    denoiser = std::make_shared<WanExpertsDenoiser>(denoiser, low_denoiser, config.model.wan.boundary_ratio,
                                                    out.experts_take_turns);
  out.pipeline =
      std::make_shared<WanTextToVideo>(config, std::move(t5), std::move(tokenizer), denoiser, std::move(vae));
  if (image_encoder) out.pipeline->image_encoder(std::move(image_encoder));
  return out;
}

}  // namespace megaslide
