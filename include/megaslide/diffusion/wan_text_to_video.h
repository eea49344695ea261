// Wan2.1 text to video (model.arch: wan), as diffusers' WanPipeline and Wan's own generate.py compute it:
//
//   prompts ─ wan_prompt_clean ─ umT5 tokenizer (512 tokens) ─ umT5 encoder, embeddings past each prompt zeroed
//   x_1 ~ N(0, I) per seed ─ flow sampler (UniPC or Euler, shift) with classifier-free guidance against the
//   negative prompt's embeddings:  v̂ = v(x, t, negative) + s·(v(x, t, prompt) − v(x, t, negative))
//   ─ normalised latents [B, 16, t, h, w] ─ Wan VAE: z·std + mean, decode ─ pixels [B, 3, 1 + 4(t − 1), 8h, 8w]
//
// Defaults (WanSampleOptions), from Wan2.1's generate.py and wan/configs (t2v): 50 steps, shift 5.0,
// guidance 5.0, the UniPC solver, the Chinese negative prompt of shared_config.py (kWanNegativePrompt),
// 512 text tokens. diffusers' WanPipeline has the same steps and guidance; its negative prompt defaults to
// "" and its shift is its scheduler config's flow_shift. Checked against WanPipeline(output_type="latent")
// on tiny models (tests/test_wan_sample.cpp, tests/fixtures/wan_pipeline/).
//
// The DiT runs through a WanDenoiser: ResidentWanDenoiser holds it whole on the device; StreamedWanDenoiser
// keeps each block's attention and FFN weights (WanBlock::streamed()) in host RAM in the compute dtype and
// streams them block by block through the WeightStreamer (the StreamedDenoiser's scheme for the DiT
// family). In both, the patch and condition embeddings, the head, and each block's scale_shift_table and
// norm2 stay fp32 (diffusers' _keep_in_fp32_modules); the blocks' matrices and the tokens between blocks
// are in the compute dtype. With the same compute dtype both give the same output (bit for bit on the CPU).
//
// Start-up without a full fp32 copy: load_wan_model and wan_model_from_config with blocks_on_demand build
// the DiT with meta blocks (WanOptions::block_device(torch::kMeta)) and a WanModel::block source that
// reads one block at a time from the memory-mapped weights; StreamedWanDenoiser(WanModel, ...) fills each
// block's compute-dtype host buffer from it, so that the host holds the compute-dtype blocks, the fp32
// resident parts and one fp32 block at a time (plus the mapping's page cache), never the whole fp32 DiT.
//
// Weights held elsewhere: StreamedWanDenoiser over WanBlockWeights streams each block from a host buffer it
// does not own — a streamed trainer's host store (train/wan_validation.h samples a Wan run's current weights
// so, without a copy of the DiT).
//
// Ownership: the denoisers take over the module they are given (StreamedWanDenoiser empties its blocks'
// streamed parameters), except StreamedWanDenoiser over WanBlockWeights, which shares the module and the
// buffers: it leaves the resident parts where they are and the blocks' streamed parameters empty, as a
// streamed trainer keeps them between its steps. Thread-safety: one thread drives a pipeline.
#pragma once

#include <torch/types.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/diffusion/flow_matching.h"
#include "megaslide/model/umt5_encoder.h"
#include "megaslide/model/umt5_tokenizer.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_vae.h"
#include "megaslide/diffusion/streamed_denoiser.h"
#include "megaslide/offload/weight_streamer.h"
#include "megaslide/util/errors.h"

namespace megaslide {

// Wan2.1's default negative prompt (shared_config.py's sample_neg_prompt), UTF-8.
extern const char* const kWanNegativePrompt;

struct WanSampleOptions {
  TORCH_ARG(FlowSamplerKind, kind) = FlowSamplerKind::kUniPC;
  TORCH_ARG(int64_t, steps) = 50;
  TORCH_ARG(double, shift) = 5.0;
  TORCH_ARG(double, guidance_scale) = 5.0;
  // Wan2.2's two experts: the low-noise expert's scale (-1: guidance_scale) from the first step whose
  // timestep is below boundary_ratio x 1000 (0: one DiT). FlowSamplerOptions says how.
  TORCH_ARG(double, guidance_scale_2) = -1.0;
  TORCH_ARG(double, boundary_ratio) = 0.0;
  TORCH_ARG(std::string, negative_prompt) = kWanNegativePrompt;
  TORCH_ARG(int64_t, text_tokens) = 512;  // umT5 tokens per prompt (Wan's text_len)
  TORCH_ARG(bool, clean_prompts) = true;  // wan_prompt_clean before tokenizing, as WanPipeline does

 public:
  // The defaults above with a run config's diffusion.sample_steps, diffusion.shift, diffusion.guidance_scale
  // (and guidance_scale_2, model.wan.boundary_ratio with two experts) and data.max_text_tokens.
  static WanSampleOptions from_config(const RunConfig& config);
  FlowSamplerOptions flow() const;
};

// The frame rate a Wan run's videos play at: the rate its clips were sampled at (data.fps of data.dataset: videos),
// else Wan-AI's sample_fps for the model — 24 for Wan2.2 TI2V-5B (on the Wan2.2 VAE: model.vae.downscale 16, 48
// latent channels), 16 otherwise.
int64_t wan_video_fps(const RunConfig& config);

// The Wan DiT's output (the flow velocity) for its input x [B, in_channels, T, H, W] at timesteps [B] (float)
// and text [B, L, text_dim], with `image` [B, Li, image_dim] the image tokens of a DiT with an image branch
// (Wan2.1 I2V; undefined otherwise); float32 out, on the denoiser's device. Called under NoGradGuard.
class WanDenoiser {
 public:
  virtual ~WanDenoiser() = default;
  virtual torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                                const torch::Tensor& image) = 0;
  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text) {
    return predict(x, timesteps, text, torch::Tensor());
  }
  virtual torch::Device device() const = 0;
  // Moves what the denoiser keeps on a GPU to host memory until its next predict, which moves it back (a
  // no-op where it keeps nothing there: a streamed denoiser's slots are small, a CPU's weights stay).
  virtual void park() {}
};

class ResidentWanDenoiser final : public WanDenoiser {
 public:
  // Moves `model` to `device`; with a compute dtype other than Float converts the blocks' streamed
  // parameters to it in place. `parked`: the model stays in host memory (converted there) until the first
  // predict moves it (an expert that takes turns and does not run first: no round trip through the device).
  ResidentWanDenoiser(WanTransformer model, torch::Device device,
                      c10::ScalarType compute_dtype = c10::ScalarType::Float, bool parked = false);
  // The same from a model loaded with blocks_on_demand: each block is read (fp32 on the CPU), moved to
  // `device` (parked: kept on the CPU) and converted before the next is read, so the host holds one block in
  // fp32, not the DiT.
  ResidentWanDenoiser(struct WanModel model, torch::Device device,
                      c10::ScalarType compute_dtype = c10::ScalarType::Float, bool parked = false);
  using WanDenoiser::predict;
  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                        const torch::Tensor& image) override;
  torch::Device device() const override { return device_; }
  void park() override;  // the whole model to the CPU (its dtypes kept)
  bool parked() const { return parked_; }

 private:
  WanTransformer model_;
  torch::Device device_;
  c10::ScalarType compute_dtype_;
  bool parked_ = false;
};

// Wan2.2's two experts as one denoiser: `high` for timesteps t >= boundary_ratio x 1000, `low` below (every
// call's timesteps are one step's, all equal). Both on one device. WanTextToVideo::sample sets the boundary
// from its options before each sampling (0: the high-noise expert throughout). With park_inactive, the
// expert not asked is parked (WanDenoiser::park) before the other predicts: two resident experts that do
// not fit the device together take turns on it (one move each way per switch, as Wan-AI's offload_model).
class WanExpertsDenoiser final : public WanDenoiser {
 public:
  WanExpertsDenoiser(std::shared_ptr<WanDenoiser> high, std::shared_ptr<WanDenoiser> low, double boundary_ratio,
                     bool park_inactive = false);
  using WanDenoiser::predict;
  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                        const torch::Tensor& image) override;
  torch::Device device() const override { return high_->device(); }
  // In [0, 1); 0: the high-noise expert for every timestep.
  void boundary_ratio(double ratio);

 private:
  std::shared_ptr<WanDenoiser> high_, low_;
  double boundary_ratio_ = 0.0;
  bool park_inactive_ = false;
};

struct WanModel;

// Block l's streamed weights kept outside a denoiser (a streamed trainer's host store): `flat` is a 1-D
// host tensor in the compute dtype, and parameter i of the block's streamed() module (in named_parameters
// order) is flat[offsets[i], offsets[i] + numel(shapes[i])) viewed as shapes[i]. An fp8 frozen base
// (lora.base_dtype: fp8): `flat` is float8_e4m3fn, `scales` holds parameter i's fp32 scale at i and exact[i]
// a vector's exact value (undefined for an fp8 parameter); the blocks are uploaded as fp8 and upcast on the
// device.
struct WanBlockWeights : StreamedBlockWeights {
  torch::Tensor scales;
  std::vector<torch::Tensor> exact;
};

class StreamedWanDenoiser final : public WanDenoiser {
 public:
  StreamedWanDenoiser(WanTransformer model, StreamedDenoiserOptions options);
  // `model.dit`'s meta blocks are read from `model.block` one at a time, in order, into the host buffers.
  StreamedWanDenoiser(WanModel model, StreamedDenoiserOptions options);
  // Streams `blocks` (one per block of `model`, flat in options.compute_dtype) as they are, without a copy:
  // they must stay alive and unchanged while the denoiser predicts. `model`'s resident parts (prologue,
  // head, the blocks' scale_shift_table and norm2) must already be fp32 on options.device; its blocks'
  // streamed parameters may be empty (a streamed trainer's). Sets the model to eval mode.
  StreamedWanDenoiser(WanTransformer model, std::vector<WanBlockWeights> blocks, StreamedDenoiserOptions options);
  ~StreamedWanDenoiser() override;
  using WanDenoiser::predict;
  torch::Tensor predict(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& text,
                        const torch::Tensor& image) override;
  torch::Device device() const override { return options_.device; }
  const offload::WeightStreamer& streamer() const { return *slots_; }  // its own, or the lent one
  int64_t host_weight_bytes()
      const;  // the blocks' streamed weights on the host (compute dtype; borrowed ones included)

 private:
  WanTransformer model_;
  StreamedDenoiserOptions options_;
  std::vector<std::vector<offload::FlatParam>> params_;
  std::vector<torch::Tensor> host_;
  std::vector<torch::Tensor> scales_;                  // fp8 blocks of its own streamer: per block, on the device
  std::vector<std::vector<torch::Tensor>> exact_;      // ... and their vectors kept exact
  std::unique_ptr<offload::WeightStreamer> streamer_;  // null with a lent streamer
  offload::WeightStreamer* slots_ = nullptr;           // streamer_ or the lent one
  void build(const std::function<WanBlock(int64_t)>& block_source);
  void make_streamer();
};

// A Wan DiT and the run config it belongs to.
struct WanModel {
  RunConfig config;
  WanTransformer dit{nullptr};
  std::string source;  // the file or folder the weights came from
  // Set when dit's blocks are meta skeletons (loaded with blocks_on_demand): block(l) returns block l's
  // weights, fp32 on the CPU, as a new WanBlock for WanTransformerImpl::replace_block (the weights' mapping
  // stays open while it is set). Blocks must be asked for in order 0, 1, ... (each once): a block's
  // parameters the weights lack (the 3D-DSA retrofit's) take the values WanTransformer's constructor
  // would have drawn for them.
  std::function<WanBlock(int64_t)> block;
  // Wan2.2's low-noise expert (model.wan.weights_2; the same architecture, loaded the same way), or null.
  std::shared_ptr<WanModel> low_noise;
  // Reads every meta block into dit (the whole DiT in fp32 on the CPU) and clears `block`.
  void load_blocks();
};

// True when `path` is a megaslide weights file (model/dit_weights.h: a Wan run's checkpoint model.safetensors
// or an exported file) whose embedded config has model.arch wan; reads the header only.
bool is_wan_weights_file(const std::string& path);
// The Wan DiT of a megaslide weights file ("dit.<name>" tensors, the config in its metadata), fp32 on the
// CPU; of a run that trained Wan2.2's two experts (model.wan.expert both), the high-noise one
// ("dit.transformer.<name>") with the low-noise one ("dit.transformer_2.<name>") as WanModel::low_noise.
// Throws WeightsError naming the file and the tensor. With blocks_on_demand the blocks are meta
// skeletons read by WanModel::block (names and shapes are all checked here).
WanModel load_wan_model(const std::string& weights_file, bool blocks_on_demand = false);
// The Wan DiT `config` describes, with model.wan.weights (published weights: model/wan_weights.h) loaded
// into it, fp32 on the CPU, and with two experts (Wan2.2) the low-noise one as WanModel::low_noise. The
// config must name the weights (ConfigError otherwise, naming model.wan.weights or model.wan.weights_2).
// With blocks_on_demand as above.
WanModel wan_model_from_config(const RunConfig& config, const std::string& source, bool blocks_on_demand = false);
// The Wan2.2 expert a run of `config` (resolved: with_wan_architecture_from_weights; model.wan.expert set)
// does not train, read from its published weights (wan_untrained_expert) as published — dense attention,
// whatever the run's self_attention: the prologue and head now, the blocks on demand or all now. Throws
// WanWeightsError naming the file and tensor; std::invalid_argument when the run has no such expert.
WanModel load_untrained_expert(const RunConfig& config, bool blocks_on_demand);
// A run's model (load_wan_model) that fine-tuned one of Wan2.2's experts, paired with the expert it did not
// train (its config's model.wan.weights or weights_2: wan_untrained_expert) as wan_model_from_config pairs
// published experts: the high-noise one first, the low-noise one as low_noise. Returned unchanged when the
// run trained no expert or had none beside it. Throws WeightsError naming the partner's path when it
// cannot be read.
WanModel with_untrained_expert(WanModel trained, bool blocks_on_demand);

// Wan2.2 TI2V's image-to-video: the first latent frame `frame` [1, C, 1, h, w] (normalised) kept clean in every
// model input of latents of `shape` [C, T, h, w], its tokens at timestep 0 (the DiT's `patch` grid: a token's
// timestep is its first corner's). mix(x) puts the frame into latents x [B, C, T, h, w]; timesteps(t) turns
// timesteps [B] into per-token ones [B, N]. WanTextToVideo::sample_from_image and TI2V's validation videos.
class WanFirstFrame {
 public:
  WanFirstFrame(torch::Tensor frame, const std::vector<int64_t>& shape, const std::array<int64_t, 3>& patch);
  torch::Tensor mix(const torch::Tensor& x) const { return (1 - mask_) * frame_ + mask_ * x; }
  torch::Tensor timesteps(const torch::Tensor& t) const;

 private:
  torch::Tensor frame_, mask_, token_mask_;
};

// One image's conditioning for image-to-video (WanTextToVideo::sample_image_to_video).
struct WanImageCondition {
  torch::Tensor latents;  // [1 or B, C, T, H, W]: the conditioning video's normalised latents
  torch::Tensor image;    // [1 or B, Li, image_dim]: the image tokens (a DiT with an image branch), else undefined
};

class WanTextToVideo {
 public:
  // `config` gives the latents' shape (data.channels x data.frames x data.height x data.width, in latents)
  // and the DiT's sizes; the encoder's width must be model.wan.text_dim and the VAE's z_dim data.channels
  // (std::invalid_argument otherwise). umT5 and the VAE run on their own devices; the latents are
  // sampled on the denoiser's.
  WanTextToVideo(RunConfig config, Umt5Encoder text_encoder, Umt5Tokenizer tokenizer,
                 std::shared_ptr<WanDenoiser> denoiser, WanVae vae);

  // Wan's text embeddings [N, text_tokens, d_model] float32 on the denoiser's device (cleaned first when
  // options.clean_prompts()).
  torch::Tensor encode(const std::vector<std::string>& prompts, const WanSampleOptions& options) const;
  // The umT5 tokens `prompt` takes before it is cut to options.text_tokens() (cleaned as encode cleans it, with its
  // end token): more than text_tokens() means the encoder reads only its beginning.
  int64_t prompt_tokens(const std::string& prompt, const WanSampleOptions& options) const;
  // Normalised latents [B, C, T, H, W] float32 on the denoiser's device, one per (prompt, seed); `shape`:
  // the latents' [C, T, H, W] (empty: latent_shape()).
  torch::Tensor sample(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                       const WanSampleOptions& options, const std::function<void(int64_t, int64_t)>& on_step = {},
                       const std::vector<int64_t>& shape = {});
  // Image-to-video as Wan2.2's TI2V-5B does it (diffusers' WanImageToVideoPipeline with expand_timesteps): the
  // first latent frame is `image`'s ([3, H, W] in [-1, 1] at the video's pixel size, encoded by the VAE and
  // normalised), kept clean in every model input, its tokens at timestep 0 (per-token timesteps), the rest
  // sampled as `sample` does; the result's first frame is the image's latent. Throws std::invalid_argument for
  // an image of another size.
  torch::Tensor sample_from_image(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                                  const torch::Tensor& image, const WanSampleOptions& options,
                                  const std::function<void(int64_t, int64_t)>& on_step = {},
                                  const std::vector<int64_t>& shape = {});
  // Image-to-video with the image as conditioning channels (Wan2.1 I2V, Wan2.2 I2V-A14B: diffusers'
  // WanImageToVideoPipeline without expand_timesteps): every DiT call's input is the noisy latents, then
  // wan_image_condition(condition.latents); with an image branch, condition.image the image tokens, for the
  // negative prompt too (as the pipeline does). condition: one image's (batch 1, for every prompt) or one
  // per prompt. Throws std::invalid_argument for a condition of another shape, or for a text-to-video DiT.
  torch::Tensor sample_image_to_video(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                                      const WanImageCondition& condition, const WanSampleOptions& options,
                                      const std::function<void(int64_t, int64_t)>& on_step = {},
                                      const std::vector<int64_t>& shape = {});
  // The conditioning of `image` ([3, H, W] in [-1, 1] at the video's pixel size) for videos of latent `shape`
  // (empty: latent_shape()): the VAE's latents of the image followed by black frames (WanVae::encode_image_video),
  // and with an image branch the image encoder's tokens of `pixels` ([H', W', 3] uint8, the image as given:
  // CLIP preprocesses it itself; may be `image`'s own size). Throws std::invalid_argument for an image of
  // another size, and when the DiT has an image branch but the pipeline no image encoder.
  WanImageCondition image_condition(const torch::Tensor& image, const torch::Tensor& pixels,
                                    const std::vector<int64_t>& shape = {}) const;
  // Sets the image encoder an image branch needs (Wan2.1 I2V): pixels [H, W, 3] uint8 -> tokens [1, Li,
  // image_dim] float32.
  void image_encoder(std::function<torch::Tensor(const torch::Tensor&)> encoder) {
    image_encoder_ = std::move(encoder);
  }
  bool has_image_encoder() const { return static_cast<bool>(image_encoder_); }

  // Normalised latents -> pixels [B, 3, T', H', W'] in [-1, 1], float32 on the CPU.
  torch::Tensor decode(const torch::Tensor& latents) const;

  const RunConfig& config() const { return config_; }
  std::vector<int64_t> latent_shape() const;  // [C, T, H, W]
  const WanVae& vae() const { return vae_; }

 private:
  RunConfig config_;
  Umt5Encoder text_encoder_;
  Umt5Tokenizer tokenizer_;
  std::shared_ptr<WanDenoiser> denoiser_;
  WanVae vae_;
  std::function<torch::Tensor(const torch::Tensor&)> image_encoder_;
};

// A sampling pipeline's component that cannot be used: which one (`component`: "text_encoder",
// "tokenizer", "vae" or "image_encoder"; a tool names its flag) and why. Bad input.
class WanPipelineError : public std::runtime_error, public InputError {
 public:
  WanPipelineError(std::string component, const std::string& problem)
      : std::runtime_error(problem), component_(std::move(component)) {}
  const std::string& component() const { return component_; }

 private:
  std::string component_;
};

// What a sampler asks of open_wan_pipeline. Empty paths: the model's config's own (model.text_encoder.weights
// and .vocab, model.vae.weights, model.image_encoder.weights: what a trained run was cached with) where those
// exist, else text_encoder/, vae/ and (Wan2.1 I2V) image_encoder/ of the diffusers repository model.wan.weights
// names; the tokenizer is found from umT5's path.
struct WanPipelineRequest {
  std::string text_encoder, tokenizer, vae, image_encoder;
  torch::Device device = torch::kCPU;
  StreamChoice stream = StreamChoice::kAuto;               // the DiT's blocks and umT5's layers, each by its own size
  c10::ScalarType compute_dtype = c10::ScalarType::Float;  // the DiT's blocks
};

struct OpenedWanPipeline {
  std::shared_ptr<WanTextToVideo> pipeline;
  bool dit_streamed = false, text_encoder_streamed = false;
  bool experts_take_turns = false;  // two resident experts, the inactive one parked in host memory
  // The frozen encoders' files read: ("text_encoder", path), ("tokenizer", path) when not found beside umT5,
  // ("vae", path), ("image_encoder", path) for Wan2.1 I2V.
  std::vector<std::pair<std::string, std::string>> encoder_files;
};

// The sampling pipeline of `model` (whole, or loaded with blocks_on_demand): umT5 (bf16 on a GPU, as Wan
// runs it; fp32 on the CPU) resident or streamed layer by layer, the VAE in fp32, and the DiT resident
// (block by block onto the device) or streamed from host buffers, in the compute dtype; with two experts
// behind a WanExpertsDenoiser: both resident when they fit together (request.stream auto: within half the
// GPU's free memory), resident taking turns on the device (the inactive one parked) when one fits,
// streamed otherwise. Throws
// WanPipelineError for a component that is missing or unreadable, std::invalid_argument for components
// that do not fit each other.
OpenedWanPipeline open_wan_pipeline(WanModel model, const WanPipelineRequest& request);

}  // namespace megaslide
