#include "megaslide/diffusion/streamed_denoiser.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include <map>
#include <set>
#include <string>

#include "megaslide/offload/host_param_store.h"

namespace megaslide {

namespace {
// What both constructions check first: a model with blocks and a compute dtype the streamer takes. Returns the
// number of blocks.
int64_t checked_block_count(const DiT& model, c10::ScalarType dt) {
  TORCH_CHECK(model, "StreamedDenoiser: the model is null");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "StreamedDenoiser: compute dtype must be Float, BFloat16 or Half, got ", dt);
  const int64_t L = static_cast<int64_t>(model->blocks->size());
  TORCH_CHECK(L >= 1, "StreamedDenoiser: the model has no blocks");
  return L;
}
}  // namespace

StreamedBlockWeights stored_block_weights(const offload::HostParamStore& store, int64_t block,
                                          const torch::nn::Module& module) {
  StreamedBlockWeights w;
  w.flat = store.master_uploaded() ? store.master(block) : store.compute(block);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& spec : store.block_spec(block).params) shapes.emplace(spec.name, spec.shape);
  for (const auto& item : module.named_parameters(true)) {
    w.offsets.push_back(store.param(block, item.key()).offset);
    w.shapes.push_back(shapes.at(item.key()));
  }
  return w;
}

void check_lent_streamer(const StreamedDenoiserOptions& options, const std::vector<at::Tensor>& host, const char* who) {
  const auto* lent = options.lent_streamer;
  TORCH_CHECK(lent != nullptr, who, ": no lent streamer");
  const auto& o = lent->options();
  TORCH_CHECK(o.device == options.device && o.compute_dtype == options.compute_dtype && o.mode == options.mode, who,
              ": the lent streamer runs ", o.compute_dtype, " on ", o.device, " (", offload::to_string(o.mode),
              "), the denoiser ", options.compute_dtype, " on ", options.device, " (", offload::to_string(options.mode),
              ")");
  const int64_t first = options.lent_first_block, n = static_cast<int64_t>(host.size());
  TORCH_CHECK(first >= 0 && first + n <= lent->num_blocks(), who, ": blocks [", first, ", ", first + n,
              ") of a lent streamer of ", lent->num_blocks());
  const auto transfer = o.transfer_dtype == at::ScalarType::Undefined ? o.compute_dtype : o.transfer_dtype;
  for (int64_t l = 0; l < n; ++l) {
    const auto& h = host[static_cast<size_t>(l)];
    TORCH_CHECK(h.numel() == lent->block_numel(first + l) && h.scalar_type() == transfer, who, ": block ", l, " has ",
                h.numel(), " weights of ", h.scalar_type(), ", the lent streamer's block ", first + l, " ",
                lent->block_numel(first + l), " of ", transfer);
  }
}

DenoiserPass::DenoiserPass(offload::WeightStreamer& slots, const StreamedDenoiserOptions& options,
                           const std::vector<at::Tensor>& host)
    : first_(options.lent_streamer ? options.lent_first_block : 0),
      pass_(
          slots, [&host, first = first_](int64_t l) { return host[static_cast<size_t>(l - first)]; }, first_,
          first_ + static_cast<int64_t>(host.size()), options.lent_streamer != nullptr) {}

void adopt_borrowed_blocks(torch::nn::Module& model, std::vector<std::vector<offload::FlatParam>>& streamed,
                           const StreamedDenoiserOptions& options, const char* who) {
  std::set<const void*> in_blocks;
  for (const auto& block : streamed)
    for (const auto& p : block) in_blocks.insert(p.param.unsafeGetTensorImpl());
  for (const auto& p : model.parameters(true))
    if (!in_blocks.count(p.unsafeGetTensorImpl()))
      TORCH_CHECK(p.device() == options.device && p.scalar_type() == at::kFloat, who,
                  ": the resident parameters must be fp32 on ", options.device, ", got one ", p.scalar_type(), " on ",
                  p.device());
  torch::NoGradGuard no_grad;
  const auto empty = torch::TensorOptions().dtype(options.compute_dtype).device(options.device);
  for (auto& block : streamed)
    for (auto& p : block) p.param.set_data(torch::empty({0}, empty));
  model.eval();
}

StreamedDenoiser::StreamedDenoiser(DiT model, StreamedDenoiserOptions options)
    : model_(std::move(model)), options_(options) {
  const auto dt = options_.compute_dtype;
  const int64_t L = checked_block_count(model_, dt);
  bool pin = false;
#ifdef MEGASLIDE_WITH_CUDA
  pin = options_.device.is_cuda() && options_.pin_host_memory;
#endif
  torch::NoGradGuard no_grad;
  const auto empty = torch::TensorOptions().dtype(dt).device(options_.device);
  std::vector<int64_t> numels;
  params_.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    auto& block = *model_->blocks[l];
    TORCH_CHECK(block.named_buffers(true).size() == 0, "StreamedDenoiser: block ", l,
                " registers buffers, which streamed blocks do not support (see offload/streamed_model.h)");
    int64_t n = 0;
    for (const auto& item : block.named_parameters(true)) {
      TORCH_CHECK(item.value().numel() > 0, "StreamedDenoiser: block ", l, "'s parameter '", item.key(),
                  "' is empty (is this DiT already streamed by another denoiser?)");
      params_[l].push_back({item.value(), n, item.value().numel(), item.value().sizes().vec()});
      n += item.value().numel();
    }
    TORCH_CHECK(n > 0, "StreamedDenoiser: block ", l, " has no parameters");
    auto flat = torch::empty({n}, torch::TensorOptions().dtype(dt).pinned_memory(pin));
    for (auto& p : params_[l]) {
      flat.narrow(0, p.offset, p.numel).copy_(p.param.detach().reshape({-1}).to(torch::kCPU, dt));
      p.param.set_data(torch::empty({0}, empty));
    }
    host_.push_back(flat);
    numels.push_back(n);
  }
  // The resident parts: everything that is not a block.
  model_->move_non_block_parts(options_.device);
  model_->eval();
  make_streamer(numels);
}

StreamedDenoiser::StreamedDenoiser(DiT model, std::vector<StreamedBlockWeights> blocks, StreamedDenoiserOptions options)
    : model_(std::move(model)), options_(options) {
  const auto dt = options_.compute_dtype;
  const int64_t L = checked_block_count(model_, dt);
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == L, "StreamedDenoiser: ", blocks.size(),
              " blocks of weights for a model of ", L, " blocks");
  std::vector<int64_t> numels;
  params_.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const auto& w = blocks[static_cast<size_t>(l)];
    TORCH_CHECK(w.flat.defined() && w.flat.dim() == 1 && w.flat.device().is_cpu() && w.flat.scalar_type() == dt,
                "StreamedDenoiser: block ", l, "'s weights must be a 1-D host tensor of the compute dtype ", dt);
    const auto& block = *model_->blocks[l];
    TORCH_CHECK(block.named_buffers(true).size() == 0, "StreamedDenoiser: block ", l,
                " registers buffers, which streamed blocks do not support (see offload/streamed_model.h)");
    const auto named = block.named_parameters(true);
    TORCH_CHECK(named.size() == w.offsets.size() && named.size() == w.shapes.size(), "StreamedDenoiser: block ", l,
                " has ", named.size(), " parameters, its weights describe ", w.offsets.size());
    for (size_t i = 0; i < named.size(); ++i) {
      const int64_t numel = c10::multiply_integers(w.shapes[i]);
      TORCH_CHECK(w.offsets[i] >= 0 && w.offsets[i] + numel <= w.flat.numel(), "StreamedDenoiser: block ", l,
                  "'s parameter '", named[i].key(), "' lies outside its ", w.flat.numel(), " weights");
      params_[static_cast<size_t>(l)].push_back({named[i].value(), w.offsets[i], numel, w.shapes[i]});
    }
    host_.push_back(w.flat);
    numels.push_back(w.flat.numel());
  }
  adopt_borrowed_blocks(*model_, params_, options_, "StreamedDenoiser");
  make_streamer(numels);
}

void StreamedDenoiser::make_streamer(const std::vector<int64_t>& numels) {
  if (options_.lent_streamer) {
    check_lent_streamer(options_, host_, "StreamedDenoiser");
    slots_ = options_.lent_streamer;
    return;
  }
  streamer_ = std::make_unique<offload::WeightStreamer>(
      numels, offload::WeightStreamerOptions{options_.device, options_.compute_dtype, options_.mode});
  slots_ = streamer_.get();
}

StreamedDenoiser::~StreamedDenoiser() {
  try {
    if (slots_) slots_->synchronize();
  } catch (...) {
  }
}

int64_t StreamedDenoiser::host_weight_bytes() const {
  int64_t n = 0;
  for (const auto& h : host_) n += static_cast<int64_t>(h.nbytes());
  return n;
}

torch::Tensor StreamedDenoiser::predict(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                                        const torch::Tensor& text_mask) {
  torch::NoGradGuard no_grad;
  const auto dt = options_.compute_dtype;
  const auto empty = torch::TensorOptions().dtype(dt).device(options_.device);
  auto e = model_->embed(x.to(options_.device), t.to(options_.device), text.to(options_.device),
                         text_mask.defined() ? text_mask.to(options_.device) : text_mask);
  BlockContext ctx = e.ctx;
  ctx.t_mod = ctx.t_mod.to(dt);
  ctx.text = ctx.text.to(dt);
  auto h = e.tokens.to(dt);
  DenoiserPass blocks(*slots_, options_, host_);
  for (int64_t l = 0; l < static_cast<int64_t>(host_.size()); ++l)
    h = blocks.run(l, [&](const torch::Tensor& weights) {
      offload::BoundParams bound(params_[static_cast<size_t>(l)], weights, empty);
      return model_->blocks[l]->as<DiTBlockImpl>()->forward(h, ctx);
    });
  return model_->head(h.to(e.tokens.scalar_type()), e.t_emb, e.ctx.grid);
}

StreamChoice parse_stream_choice(const std::string& name) {
  if (name == "auto") return StreamChoice::kAuto;
  if (name == "on") return StreamChoice::kOn;
  if (name == "off") return StreamChoice::kOff;
  TORCH_CHECK(false, "--streamed: expected auto, on or off, got '", name, "'");
}

int64_t free_device_memory(torch::Device device) {
#ifdef MEGASLIDE_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    size_t free = 0, total = 0;
    const auto err = cudaMemGetInfo(&free, &total);
    TORCH_CHECK(err == cudaSuccess, "free_device_memory: cudaMemGetInfo failed on ", device, ": ",
                cudaGetErrorString(err));
    return static_cast<int64_t>(free);
  }
#endif
  TORCH_CHECK(false, "free_device_memory: ", device, " is not a CUDA device (or this build has no CUDA)");
}

bool should_stream(StreamChoice choice, torch::Device device, int64_t weight_bytes, double fraction) {
  switch (choice) {
    case StreamChoice::kOn:
      return true;
    case StreamChoice::kOff:
      return false;
    case StreamChoice::kAuto:
      break;
  }
  if (!device.is_cuda()) return false;
  return static_cast<double>(weight_bytes) > fraction * static_cast<double>(free_device_memory(device));
}

}  // namespace megaslide
