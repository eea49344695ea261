#include "megaslide/diffusion/streamed_denoiser.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace megaslide {

StreamedDenoiser::StreamedDenoiser(DiT model, StreamedDenoiserOptions options)
    : model_(std::move(model)), options_(options) {
  TORCH_CHECK(model_, "StreamedDenoiser: the model is null");
  const auto dt = options_.compute_dtype;
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "StreamedDenoiser: compute dtype must be Float, BFloat16 or Half, got ", dt);
  const int64_t L = static_cast<int64_t>(model_->blocks->size());
  TORCH_CHECK(L >= 1, "StreamedDenoiser: the model has no blocks");
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
  streamer_ = std::make_unique<offload::WeightStreamer>(
      numels, offload::WeightStreamerOptions{options_.device, dt, options_.mode});
}

StreamedDenoiser::~StreamedDenoiser() {
  try {
    if (streamer_) streamer_->synchronize();
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
  offload::StreamedForward blocks(*streamer_, [this](int64_t l) { return host_[static_cast<size_t>(l)]; });
  for (int64_t l = 0; l < streamer_->num_blocks(); ++l)
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
