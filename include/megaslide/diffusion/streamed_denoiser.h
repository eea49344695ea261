// StreamedDenoiser: sampling a DiT whose blocks do not fit the device (DESIGN.md §2, §7). The
// blocks' weights stay in host RAM and visit the device block by block through a WeightStreamer — the
// same two device slots, streams and events the streamed trainer uses — forward only: no gradients, no
// optimizer state, no fp32 masters (only the compute-dtype copy the blocks run in). The prologue (patch,
// timestep and position embeddings, t_mod) and the epilogue (final layer) stay resident in fp32.
//
//   predict(x, t, text): prologue -> for l: prefetch(l+1) ‖ bind slot views, block l, unbind -> epilogue
//
// With compute dtype fp32 the output equals ResidentDenoiser's over the same DiT (tested bit for bit on
// the CPU); bf16/fp16 compute rounds the block weights and activations as the streamed trainer does.
//
// Ownership: the denoiser shares the DiT module and takes over its blocks' weights: at construction
// each block's parameters are copied into one flat host buffer per block (compute dtype; page-locked
// when the device is a GPU) and the module's own block parameters become empty tensors, so the DiT must
// not be run by anything else afterwards. The resident parts are moved to the device.
// Threading: one thread drives it (Denoiser's contract).
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/diffusion/sampler.h"
#include "megaslide/model/dit.h"
#include "megaslide/offload/weight_streamer.h"

namespace megaslide {

struct StreamedDenoiserOptions {
  torch::Device device = torch::kCPU;
  c10::ScalarType compute_dtype =
      c10::ScalarType::Float;  // Float, BFloat16 or Half: the blocks' weights and activations
  offload::StreamMode mode = offload::StreamMode::kAsync;
  bool pin_host_memory = true;  // page-lock the host weights when the device is a GPU
  // Run in the two device slots of this streamer, owned elsewhere (a streamed trainer's, lent between its
  // steps: StreamedStackTrainer::lend_streamer), instead of allocating two more; the denoiser's block l is its
  // block lent_first_block + l, uploaded from the denoiser's host weights for it (offload::StreamedForward's
  // lent pass). It must outlive the denoiser, have its device, compute dtype and mode, hold each block's numel
  // in the host weights' dtype (fp8 blocks: upcast by the owner's upcast), and have no block acquired while the
  // denoiser predicts.
  offload::WeightStreamer* lent_streamer = nullptr;
  int64_t lent_first_block = 0;
};

// Block l's weights kept outside the denoiser (a streamed trainer's host store): `flat` is a 1-D host tensor in
// the compute dtype, and parameter i of the block (in named_parameters order) is flat[offsets[i], offsets[i] +
// numel(shapes[i])) viewed as shapes[i].
struct StreamedBlockWeights {
  torch::Tensor flat;
  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> shapes;
};

namespace offload {
class HostParamStore;
}

// Block `block` of a streamed trainer's host store as a denoiser streams it without a copy: the compute copy, or the
// fp32 masters where the trainer uploads those (fp32 compute), each parameter of `module` (the block's streamed
// part, in named_parameters order) at its offset in it.
StreamedBlockWeights stored_block_weights(const offload::HostParamStore& store, int64_t block,
                                          const torch::nn::Module& module);

// For a denoiser over borrowed blocks (StreamedBlockWeights): checks that every parameter of `model` outside
// `streamed` (the blocks' streamed parameters) is fp32 on options.device, then empties the streamed ones (bound to
// slot views only while their block runs) and sets the model to eval mode. `who` names the denoiser in errors.
void adopt_borrowed_blocks(torch::nn::Module& model, std::vector<std::vector<offload::FlatParam>>& streamed,
                           const StreamedDenoiserOptions& options, const char* who);

class StreamedDenoiser final : public Denoiser {
 public:
  StreamedDenoiser(DiT model, StreamedDenoiserOptions options);
  // Streams `blocks` (one per block of `model`) as they are, without a copy: they must stay alive and unchanged
  // while the denoiser predicts. `model`'s resident parts (everything but its blocks) must already be fp32 on
  // options.device; its blocks' parameters may be empty (a streamed trainer's). Sets the model to eval mode.
  StreamedDenoiser(DiT model, std::vector<StreamedBlockWeights> blocks, StreamedDenoiserOptions options);
  ~StreamedDenoiser() override;

  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& text,
                        const torch::Tensor& text_mask) override;

  const offload::WeightStreamer& streamer() const { return *slots_; }  // its own, or the lent one
  // Bytes of the blocks' weights held on the host (compute dtype).
  int64_t host_weight_bytes() const;
  const StreamedDenoiserOptions& options() const { return options_; }

 private:
  DiT model_;
  StreamedDenoiserOptions options_;
  std::vector<std::vector<offload::FlatParam>> params_;    // per block
  std::vector<torch::Tensor> host_;                        // per block: flat weights, compute dtype
  std::unique_ptr<offload::WeightStreamer> streamer_;      // null with a lent streamer
  offload::WeightStreamer* slots_ = nullptr;               // streamer_ or the lent one
  void make_streamer(const std::vector<int64_t>& numels);  // or takes the lent one
};

// Checks that options.lent_streamer can stream `host`'s blocks (host[l] is its block lent_first_block + l:
// the device, compute dtype, mode and each block's numel and dtype). `who` names the denoiser in errors.
void check_lent_streamer(const StreamedDenoiserOptions& options, const std::vector<at::Tensor>& host, const char* who);
// One forward pass of a denoiser's blocks through its slots (its own streamer, or the lent one): run(l, body) streams
// the denoiser's block l (offload::StreamedForward::run), the window of a lent streamer's blocks or its own.
class DenoiserPass {
 public:
  DenoiserPass(offload::WeightStreamer& slots, const StreamedDenoiserOptions& options,
               const std::vector<at::Tensor>& host);
  template <typename Body>
  auto run(int64_t l, Body&& body) {
    return pass_.run(first_ + l, std::forward<Body>(body));
  }

 private:
  int64_t first_;
  offload::StreamedForward pass_;
};

// --streamed auto|on|off of megaslide-sample. "on" / "off" decide; "auto" streams when the DiT's weights
// (at `weight_bytes`) exceed `fraction` of the device's free memory, and never on the CPU (its "device"
// is host memory: streaming would only copy).
enum class StreamChoice { kAuto, kOn, kOff };
StreamChoice parse_stream_choice(const std::string& name);  // "auto" | "on" | "off"
bool should_stream(StreamChoice choice, torch::Device device, int64_t weight_bytes, double fraction = 0.5);
// Free memory of a CUDA device in bytes (cudaMemGetInfo); throws for other devices or without CUDA.
int64_t free_device_memory(torch::Device device);

}  // namespace megaslide
