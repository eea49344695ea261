// Wan2.1 (model.arch: wan) behind train/model_family.h, trained by the Trainer (train/trainer.h) in
// either mode on latent videos and text embeddings held in memory (WanLatentData).
//
//   prologue (resident, fp32):  patch_embedding, condition_embedder (time, text) -> tokens, tproj, context,
//                               the RoPE tables
//   stack (streamed):           the blocks' attn1, attn2 and ffn weights (WanBlock::streamed()), in
//                               offload.compute_dtype, checkpointed at block boundaries
//   resident fp32 per block:    scale_shift_table and norm2 — diffusers keeps them in fp32
//                               (_keep_in_fp32_modules); they stay on the device in fp32, are read by the
//                               streamed block's forward and updated with the prologue and epilogue
//   epilogue (resident, fp32):  head (scale_shift_table, proj_out), unpatchify, MSE against the target
//
// Objective: diffusion.objective flow (x_t = (1 − σ)·x0 + σ·ε, target ε − x0, timestep σ·T; σ as
// diffusion.shift and diffusion.timestep_sampling say; diffusion/flow_matching.h) or ddpm (DDPMSchedule
// with diffusion.prediction). Random streams, shared by both modes so that they see the same batches: the
// sample order from an EpochSampler(train.seed), caption dropout from an mt19937_64 (the text of a dropped
// sample becomes the empty prompt's embedding), then image-to-video's image dropout from the same stream (one
// draw per sample, after the captions'), σ (or t) then noise from a CPU generator seeded by
// train.seed. Initialisation: the weights of the model WanTransformer builds on the CPU in fp32 after
// torch::manual_seed(train.seed), overwritten by model.wan.weights when set (the 3D-DSA retrofit's
// parameters allowed missing), then by train.init_from's tensors when given; both modes start from
// identical weights. The resident mode builds exactly that. The streamed mode never holds every block in
// fp32: it replays WanTransformer's drawing order part by part (WanTransformerImpl::initialise_prologue,
// WanBlockDraws, initialise_head, restoring the generator's state at each part), and each block, drawn,
// overwritten from the memory-mapped weights (converted from bf16, fp16 or fp32) and from train.init_from,
// goes into the host store before the next is made (at most StackTrainerOptions::init_threads blocks at
// once): the same weights bit for bit.
//
// Checkpoints (train/checkpoint.h) name every parameter as diffusers does ("blocks.3.attn1.to_q.weight"),
// in both modes.
//
// Wan2.2's two experts trained in one run (model.wan.expert both): two DiTs of one architecture, the
// high-noise one's parameters named "transformer." + diffusers' name and the low-noise one's
// "transformer_2." + its name (the folders of diffusers' repository), each a part of the model
// (FamilyModel::parts) trained on the steps WanBatchSource::draw_expert gives it; streamed, one stack of
// both experts' blocks (the high-noise expert's first) of which a step streams its expert's only, both
// experts' prologues and heads resident. The high-noise expert is initialised as one DiT is, the
// low-noise one likewise after torch::manual_seed(train.seed + 1), before their weights overwrite them.
// Thread-safety: one thread drives a trainer.
#pragma once

#include <torch/types.h>

#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/data/bucket_sampler.h"
#include "megaslide/data/structured_motion.h"
#include "megaslide/data/video_manifest.h"
#include "megaslide/diffusion/ddpm.h"
#include "megaslide/diffusion/flow_matching.h"
#include "megaslide/diffusion/loss_weighting.h"
#include "megaslide/model/wan.h"
#include "megaslide/offload/stack_trainer.h"
#include "megaslide/offload/streamed_model.h"

namespace megaslide {

class LatentCache;

// Latent videos and their text embeddings: in memory (load, or set directly), or in a megaslide-cache folder's
// memory-mapped shards (from_cache), each batch reading its own items, so that host memory does not grow with the
// dataset. rows() and sizes() read either way.
struct WanLatentData {
  // In memory (the tensors below; undefined when the items are a cache's): float32, bf16 or fp16 — load's are
  // read-only views into the file's memory map in the dtype it stores, which rows() converts batch by batch.
  // [N, C, T, H, W]: Wan VAE latents (normalised as Wan's pipeline does); undefined when the items have several
  // shapes (buckets below)
  torch::Tensor latents;
  torch::Tensor text;  // [N, L, text_dim]: umT5 embeddings, zero past the prompt (Wan's convention)
  // Image-to-video (wan_image_to_video): each clip's conditioning video's latents [N, C, T, H, W]
  // (WanVae::encode_image_video of its image) and, for an image branch (model.wan.image_dim > 0), its image
  // tokens [N, Li, image_dim] (CLIP's penultimate hidden states).
  torch::Tensor image_latents, image_embeds;
  // Items of several clip shapes (latents and image_latents undefined): item i is row row_of[i] of bucket
  // bucket_of[i]'s tensors, which hold that bucket's items in item order.
  struct Bucket {
    torch::Tensor latents, image_latents;  // [n_b, C, T_b, H_b, W_b]
  };
  std::vector<Bucket> buckets;
  std::vector<int64_t> row_of;
  // A cache's items (from_cache): item i is the cache's item cache_items[i], read from its shards by rows(); the
  // tensors above are undefined and `buckets` is empty.
  std::shared_ptr<const LatentCache> cache;
  std::vector<int64_t> cache_items;
  // Either way:
  torch::Tensor empty_text;        // [L, text_dim]: the empty prompt's embedding (caption dropout); optional
  std::vector<int64_t> bucket_of;  // several clip shapes (data.buckets): each item's bucket; else empty
  // From a cache: each item's caption, and the items left out (the cache's bad items, and those that failed
  // their CRC-32 here).
  std::vector<std::string> captions;
  std::vector<BadItem> bad;

  bool bucketed() const { return !bucket_of.empty(); }
  int64_t num_buckets() const;
  int64_t size() const;
  // The rows of `name` — "latents", "text", "image_latents" or "image_embeds" — of `items`, in that order, as a new
  // float32 tensor [items.size(), ...] on the CPU; undefined when the data has no such tensor. Items of one batch
  // of latents or image latents share a clip shape (one bucket). Throws std::invalid_argument for another name or
  // an item out of range, DatasetError when a cache's shard cannot be read.
  torch::Tensor rows(const std::string& name, const std::vector<int64_t>& items) const;
  // The sizes [n, ...] of `name` over its n items, without reading them: for the latents and image latents of
  // bucketed data those of bucket `bucket` (which must then be given), for the rest every item's (`bucket` is
  // ignored). nullopt when the data has no such tensor or the bucket no item. Throws std::invalid_argument (in
  // memory) or DatasetError (a cache), naming the first item whose shape differs.
  std::optional<std::vector<int64_t>> sizes(const std::string& name, int64_t bucket = -1) const;
  // Item i's latents [C, T, H, W] and (image-to-video) its image latents, read as rows() reads.
  torch::Tensor item_latents(int64_t i) const { return rows("latents", {i})[0]; }
  torch::Tensor item_image_latents(int64_t i) const { return rows("image_latents", {i})[0]; }
  // Maps a safetensors file holding "latents", "text" and optionally "empty_text", "image_latents" and
  // "image_embeds" (float32, bf16 or fp16): the tensors are views into the map (the page cache holds what is read,
  // and drops it under memory pressure), each scanned once for NaN and infinities; empty_text is copied as float32.
  // The file must not be truncated while the run lives. Errors (std::invalid_argument) name the file and the tensor.
  static WanLatentData load(const std::string& path);
  // The items of a megaslide-cache folder made through umT5 and the Wan VAE (data/latent_cache.h), in item
  // order, left in its mapped shards (above): latents, umT5 text, the empty prompt's as empty_text (held) and for
  // image-to-video the image's. `config` is the run's (data.dataset: videos, pixel sizes): the cache is opened with
  // its checks (encoders, decode settings, stale items), and every item is checked against its CRC-32s once,
  // here; one that fails is left out as a bad item, as a run of the DiT family skips it, within
  // data.max_bad_fraction. With data.buckets each item's bucket is the cache's. Throws DatasetError.
  static WanLatentData from_cache(const RunConfig& config, const std::string& dir);
  // Checks the shapes against a config (data.channels/frames/height/width, model.wan.text_dim; bucketed: the
  // channels, each bucket's sizes being the cache's); throws std::invalid_argument naming what differs (DatasetError
  // where a cache's items disagree among themselves).
  void check(const RunConfig& config) const;
};

// The config Wan's trainer is given for a run over data.dataset: videos (pixel sizes in data.*, umT5 and
// the Wan VAE named, read from data.cache): data.dataset latent-tensors with the latents' shape
// (model_sample_shape) in data.channels/frames/height/width and no encoders — the trainer works on
// latents either way. A config of data.dataset latent-tensors is returned unchanged.
RunConfig wan_latent_config(const RunConfig& config);

// One micro-batch.
// With diffusion.first_frame_clean > 0 (Wan2.2 TI2V's image-to-video), a sample drawn as image-to-video
// (probability first_frame_clean, one CPU-generator draw per sample after the noise) has x0's first latent
// frame in xt, that frame's tokens at timestep 0 in per-token timesteps [B, N] (every other token at the
// sample's), and loss_mask 0 on it: its loss is the mean over the frames left (wan_training_loss).
struct WanBatch {
  torch::Tensor x0, noise, xt;  // [B, C, T, H, W]
  torch::Tensor timesteps;      // [B] float32, what the model is given (σ·T, or the DDPM timestep); [B, N] per token
  torch::Tensor target;         // [B, C, T, H, W]
  torch::Tensor text;           // [B, L, text_dim]
  torch::Tensor loss_mask;      // [B, 1, T, 1, 1] float32 (first_frame_clean > 0), else undefined
  torch::Tensor
      loss_weight;  // [B] float32: each sample's weight in the loss (diffusion.loss_weighting), else undefined
  // Image-to-video: wan_image_condition of the image latents [B, 4 + C, T, H, W] (zero for a sample whose
  // image is dropped: diffusion.image_dropout), and the image tokens [B, Li, image_dim] of an image branch
  // (likewise zero); undefined for text-to-video.
  torch::Tensor condition, image;
  // The DiT's input: xt, then the conditioning channels (image-to-video).
  torch::Tensor input() const { return condition.defined() ? at::cat({xt, condition.to(xt.scalar_type())}, 1) : xt; }
};

// The training loss of a prediction [B, C, T, H, W] for `target`: the mean squared error; with loss_mask,
// each sample's mean over the elements it keeps (each kept frame's every channel and pixel), averaged over
// the samples (so the same for any split of the batch), in fp32; with loss_weight each sample's mean times its
// weight.
torch::Tensor wan_training_loss(const torch::Tensor& prediction, const torch::Tensor& target,
                                const torch::Tensor& loss_mask, const torch::Tensor& loss_weight = {});

class WanBatchSource {
 public:
  WanBatchSource(const RunConfig& config, WanLatentData data);
  WanBatch next(torch::Device device);
  int64_t size() const { return data_.size(); }
  // The streams' position (JSON) and its restoration, as DiffusionBatchSource's.
  std::string state() const;
  void restore(const std::string& state);
  // Data parallelism, as DiffusionBatchSource::take_slice: next() returns the rank-th contiguous
  // 1/world_size of each global batch of train.batch_size items, every draw (order, caption dropout, σ or
  // t, noise) made for the whole global batch in the single-process order. Throws std::invalid_argument
  // unless world_size divides train.batch_size and 0 <= rank < world_size.
  void take_slice(int64_t rank, int64_t world_size);
  // model.wan.expert both, before each step: which of Wan2.2's experts the step trains — 0, the high-noise
  // one, with the probability the run's σ distribution puts at or above model.wan.boundary_ratio
  // (flow_sigma_cdf), else 1, the low-noise one — drawn from the σ generator (one float64), and the σ
  // of the step's batches restricted to that expert's side: each expert sees its own timesteps exactly
  // as when it is trained alone, and the σ of all steps together follow the run's distribution.
  size_t draw_expert();

 private:
  RunConfig config_;
  WanLatentData data_;
  EpochSampler sampler_;                              // one clip shape
  std::optional<BucketBatchSampler> bucket_sampler_;  // several (WanLatentData::bucketed): a batch from one
  bool flow_;
  FlowMatchingOptions flow_options_;
  DDPMSchedule schedule_;
  Prediction prediction_;
  LossWeighting loss_weighting_;
  std::mt19937_64 caption_rng_;
  at::Generator generator_;
  int64_t slice_rank_ = 0, slice_count_ = 1;
};

// Wan as a StreamedModel. BlockInputs: tensors {tproj, context}; info: the token grid and RoPE tables.
// Either over a whole model (its blocks' weights are the initial ones), or over a model whose blocks are
// a meta skeleton (WanOptions::block_device(torch::kMeta)) with a `builder` that returns block l's
// initial weights on the CPU: the engine then builds the blocks one at a time (StreamedModel::initial_block,
// possibly from several threads), and adopt_block moves each block's resident fp32 parameters
// (scale_shift_table, norm2) to `resident_device` and swaps the block into the model.
class WanStack : public offload::StreamedModel {
 public:
  using BlockBuilder = std::function<WanBlock(int64_t index)>;
  explicit WanStack(WanTransformer model, BlockBuilder builder = {}, torch::Device resident_device = torch::kCPU)
      : model_(std::move(model)), builder_(std::move(builder)), resident_device_(resident_device) {}
  int64_t num_blocks() const override { return static_cast<int64_t>(model_->blocks->size()); }
  torch::nn::Module& block(int64_t index) override;
  torch::Tensor forward_block(int64_t index, const torch::Tensor& x, const offload::BlockInputs& inputs) override;
  std::vector<torch::Tensor> resident_parameters() override;
  std::shared_ptr<torch::nn::Module> initial_block(int64_t index) override;
  void adopt_block(int64_t index, std::shared_ptr<torch::nn::Module> block) override;
  // Every parameter not streamed, by its model name (prologue, the blocks' fp32 tables and norm2, head).
  std::vector<std::pair<std::string, torch::Tensor>> named_resident_parameters();
  WanTransformer& model() { return model_; }

 private:
  WanTransformer model_;
  BlockBuilder builder_;
  torch::Device resident_device_;
  std::mutex built_mutex_;
  std::map<int64_t, WanBlock> built_;  // built by initial_block, not yet adopted
};

// Wan's blocks as WanTransformer's construction draws them, one at a time and in any order, without
// drawing the whole model: reset() draws block 0 … L−1 in turn from LibTorch's default CPU generator, so
// block l is drawn from the generator's state where block l starts, recorded as the blocks are drawn (in
// order, each block is drawn once; a block asked for ahead of its predecessors draws them first and keeps
// them, at most one each, for their own request). Construct it where the blocks start (the default
// generator just past the prologue: WanTransformerImpl::initialise_prologue); after every block was
// drawn, restore_state_after_blocks() sets the default generator where reset() draws the head.
// Thread-safety: draw() may be called from several threads, for several models (the draws of every
// WanBlockDraws are serialised: the default generator is process-wide, and nothing else may draw from
// it meanwhile).
class WanBlockDraws {
 public:
  explicit WanBlockDraws(WanTransformer model);
  WanBlock draw(int64_t index);  // on the CPU, fp32
  void restore_state_after_blocks();

 private:
  WanTransformer model_;
  std::vector<torch::Tensor> states_;  // states_[l]: the generator where block l's draw starts
  std::map<int64_t, WanBlock> kept_;
};

// Model FLOPs of one Wan training step (forward + backward, recompute not counted), as
// model_flops_per_step counts the DiT family's: 6 per weight and token for every linear map (the
// cross-attention's k and v and the text embedder over the text tokens, everything else over the video
// tokens), attention as 12·N·keys·D per layer (4 forward, 8 backward), keys = N (dense) or the 3D-DSA
// kernel's volume, plus the text tokens of the cross-attention (and Wan2.1 I2V's 257 image tokens, over which
// its image branch runs).
double wan_model_flops_per_step(const RunConfig& config);

// Wan's prologue and epilogue of one micro-batch through a WanStack of `model` (the stack's input, then
// the loss of the last block's output); the micro-batch is kept between the two.
struct WanStackSplit {
  explicit WanStackSplit(WanTransformer model_, ops::FrameExchange* group_ = nullptr)
      : model(std::move(model_)), group(group_) {}
  WanTransformer model;
  ops::FrameExchange* group = nullptr;  // context parallelism: each sample's frames split over it (else null)
  torch::Tensor target, temb, loss_mask, loss_weight;
  TokenGrid grid;        // this rank's frames' token grid
  ops::ContextShard cp;  // and where they are in the sample's (inactive without a group)
  offload::StackInput prologue(const WanBatch& batch);
  torch::Tensor epilogue(const torch::Tensor& last_hidden);
  // The resident model's loss of `batch`: prologue, every block, epilogue.
  torch::Tensor loss(const WanBatch& batch);
};

// One step of `engine` (built over a WanStack of `model`) with the prologue, stack and epilogue the streamed
// runs; `next_batch` supplies each micro-batch (on the engine's device). For custom loops and tests.
offload::StackStepResult wan_streamed_step(offload::StreamedStackTrainer& engine, WanTransformer& model,
                                           const std::function<WanBatch()>& next_batch, double lr);

// Moves a registered parameter's data to `device` in place (its identity, and so the module's and any
// optimizer's references to it, kept).
void move_parameter(torch::Tensor& p, torch::Device device);

// Throws ConfigError naming model.wan.expert when `resolved` (with_wan_architecture_from_weights) has
// Wan2.2's two experts but does not say which one the run fine-tunes (high, low or both), sets expert both
// with one DiT's weights, or sets one expert whose validation videos would lack the other one
// (train.sample_every > 0 with one expert's own file).
void check_expert_training(const RunConfig& resolved, const std::string& source);

class Trainer;

// Wan's model inside a Trainer of model.arch wan (throws std::invalid_argument for another family's):
// resident, the trained module itself; streamed, its blocks are the engine's (their weights are in the
// host store: Trainer::weight_views); with Wan2.2's two experts trained together, the one the last step
// trained. wan_experts: every trained DiT (two experts: the high-noise one, then the low-noise one, whose
// streamed blocks follow the high-noise one's in the engine's store). And the parameters model.wan.weights
// left at their initialisation (the 3D-DSA retrofit's, from a dense checkpoint; prefixed as named_parameters).
WanTransformer& wan_module(Trainer& trainer);
std::vector<WanTransformer> wan_experts(Trainer& trainer);
std::vector<std::string> wan_initialised_parameters(Trainer& trainer);

}  // namespace megaslide
