// RunConfig: the typed form of a run's YAML file (configs/*.yaml).
//
// A run file has nine sections — model, data, diffusion, train, offload, optimizer, lora, output, distributed —
// whose keys map one to one onto the fields below (the key path `model.hidden` is RunConfig::model.hidden).
// Loading checks every key: an unknown key, a value of the wrong type, an out-of-range or inconsistent value
// each raise ConfigError naming the source (file or --set), the key path and what was expected. Nothing is
// written by loading; callers create output folders only after a config has loaded.
//
// Thread-safety: plain values; the functions here are pure.
#pragma once

#include <array>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "megaslide/util/errors.h"

namespace megaslide {

// A bad configuration value. what() is the whole message, e.g.
//   "configs/smoke.yaml: model.hidden: expected an integer >= 1, got -3"
class ConfigError : public std::runtime_error, public InputError {
 public:
  ConfigError(std::string source, std::string key, std::string problem);
  const std::string& source() const { return source_; }
  const std::string& key() const { return key_; }
  const std::string& problem() const { return problem_; }

 private:
  std::string source_, key_, problem_;
};

// Which self-attention every block uses; the three DiTs of the paper.
enum class Architecture {
  kMegaSlide,  // 3D Deformable Slide Attention ("megaslide")
  kDense3D,    // global scaled-dot-product attention over all tokens ("dense3d")
  kSwin,       // 3D shifted windows ("swin")
  kWan,        // Wan2.1's video DiT, its hyper-parameters under model.wan ("wan"; model/wan.h)
};
const char* to_string(Architecture arch);

// Where 3D-DSA's sampling offsets Δ come from (model.dsa_offsets); the paper's offset ablation.
enum class DsaOffsets {
  kLearned,  // the offset network, trained ("learned"; its last layer starts at zero, so Δ starts at 0)
  kZero,     // no offset network, Δ = 0: fixed neighbourhood attention ("zero")
  kFrozen,   // a randomly initialised offset network that is never trained: fixed, input-dependent Δ ("frozen")
};
const char* to_string(DsaOffsets offsets);

// Wan2.1's hyper-parameters (model.arch: wan; model/wan.h), named as Wan's own config.json names them.
// The defaults are diffusers' WanTransformer3DModel defaults (the 14B model); configs/wan2.1-t2v-*.yaml
// set every value. With `weights` set, the values come from the weights' config.json (or their tensor
// shapes) when the run starts (model/wan_weights.h).
struct WanConfig {
  int64_t dim = 5120;
  int64_t layers = 40;
  int64_t heads = 40;
  int64_t ffn_dim = 13824;
  int64_t freq_dim = 256;                 // sinusoidal timestep features
  int64_t text_dim = 4096;                // width of the text embeddings (umT5-XXL: 4096)
  std::array<int64_t, 3> patch{1, 2, 2};  // (pt, ph, pw)
  // The DiT's input channels: out_channels for text-to-video; for image-to-video (Wan2.1 I2V, Wan2.2 I2V-A14B:
  // 36) 2 x out_channels + 4: the noisy latents, the 4-channel mask of the kept first frame and the latents of
  // the conditioning video (the image, then black frames), concatenated (wan_image_to_video).
  int64_t in_channels = 16;
  int64_t out_channels = 16;    // the latents' channels (= data.channels, the VAE's z_dim)
  bool qk_norm = true;          // RMSNorm over q and k (across heads)
  bool cross_attn_norm = true;  // affine LayerNorm before the cross-attention
  double eps = 1e-6;
  // Wan2.1 I2V's image branch: the width of the CLIP image tokens (1280 for ViT-H/14) that the image
  // embedder maps into the cross-attention's context, with their own key and value projections. 0: none
  // (text-to-video). Needs the image-to-video input channels (in_channels).
  int64_t image_dim = 0;
  std::string weights;  // published weights to start from ("": random initialisation)
  // Wan2.2's two experts (T2V-A14B, I2V-A14B; model/wan_weights.h): the low-noise expert's weights when
  // `weights` names only the high-noise one (ComfyUI's two files); found in a two-expert repository
  // (diffusers' transformer_2/, Wan-AI's low_noise_model/) when `weights` names it. "": one DiT.
  std::string weights_2;
  // The switch between the experts: the high-noise one for timesteps t >= boundary_ratio x 1000, the
  // low-noise one below. 0: the repository's (diffusers' model_index.json) or Wan-AI's (0.875 for
  // text-to-video, 0.9 for image-to-video) when there are two experts.
  double boundary_ratio = 0.0;
  // The expert a run fine-tunes (Wan2.2; without weights a randomly initialised DiT trained on that expert's
  // timesteps, as a plan or a test may want): "" (one DiT), high (the timesteps t >= boundary_ratio x 1000: σ
  // drawn only there) or low (below). The trained weights are model.wan.weights for high, and for low
  // model.wan.weights_2 when there are two experts (else model.wan.weights: one expert's own file). The other
  // expert is not trained; it makes the validation videos with the trained one. both: the two experts in one
  // run, each step one of them (train/wan_family.h).
  std::string expert;
};

// The prompt encoder (model.text_encoder, docs/conditioning.md): the small built-in caption encoder,
// trained with the DiT, or CLIP's (DiT family) or umT5's (Wan, cached) loaded from `weights`, frozen.
struct TextEncoderConfig {
  std::string kind = "builtin";  // builtin | clip | umt5 (Wan)
  std::string weights;  // clip: the folder (config.json, model.safetensors, the vocabulary); umt5: folder or file
  std::string vocab;    // clip: vocab.json + merges.txt folder or OpenAI's bpe file; umt5: spiece.model; "" = found
  std::string dtype = "fp32";  // clip's weights and compute: fp32 | bf16 (outputs are fp32)
};

// The video codec (model.vae): none (the DiT works on pixels) or the Stable Diffusion VAE (DiT family) or
// the Wan VAE (Wan, cached) loaded from `weights` and frozen (the model works on its latents).
struct VaeConfig {
  std::string kind = "none";     // none | sd | wan (Wan)
  std::string weights;           // sd: the folder (config.json, diffusion_pytorch_model.safetensors)
  int64_t latent_channels = 4;   // sd: must equal config.json's latent_channels (checked when loaded)
  int64_t downscale = 8;         // sd: pixels per latent along each side, 2^(levels - 1) (checked when loaded)
  int64_t frames_per_batch = 8;  // frames per VAE call (encode and decode)
  std::string dtype = "fp32";    // weights and compute: fp32 | bf16 (outputs are fp32)
  int64_t tile_size = 0;         // decode (wan: encode) in tiles of this many pixels (0 = whole frames)
  double tile_overlap = 0.25;    // fraction of a tile its neighbours overlap and blend
};

// Wan2.1 I2V's image encoder (model.image_encoder): CLIP ViT-H/14's vision tower, frozen; its penultimate
// hidden states are the DiT's image tokens (model.wan.image_dim > 0 only).
struct ImageEncoderConfig {
  // diffusers' image_encoder/ folder (preprocessing from its image_processor/ sibling) or ComfyUI's
  // clip_vision_h.safetensors; "": the image_encoder/ of the diffusers repository model.wan.weights names.
  std::string weights;
  std::string dtype = "fp32";  // weights and compute: fp32 | bf16 (outputs are fp32)
};

struct ModelConfig {
  Architecture arch = Architecture::kMegaSlide;
  std::array<int64_t, 3> patch{1, 2, 2};  // (pt, ph, pw)
  int64_t hidden = 16;
  int64_t layers = 2;
  int64_t heads = 2;
  double mlp_ratio = 4.0;
  int64_t text_dim = 16;  // width of the text encoder's token embeddings
  std::array<int64_t, 3> dsa_kernel{3, 7, 7};
  int64_t dsa_groups = 1;                                 // offset groups G; heads % G == 0
  std::array<double, 3> dsa_offset_range{1.0, 3.0, 3.0};  // tanh range per axis (t, h, w), tokens
  DsaOffsets dsa_offsets = DsaOffsets::kLearned;          // learned | zero | frozen (the offset ablation)
  std::string dense_attention = "fused";                  // dense3d: fused (SDPA) | materialized (N x N scores kept)
  std::array<int64_t, 3> swin_window{3, 16, 16};          // in tokens (t, h, w)
  // The fixed 3D sin-cos position embedding added to the tokens: auto (dense3d and swin, not megaslide: the
  // design's 3D-DSA has its relative-position bias only) | sincos | none.
  std::string position_embedding = "auto";
  // model.arch wan only: the blocks' self-attention, Wan's global attention ("dense") or 3D-DSA over the
  // latent token grid with Wan's own projections ("dsa3d", the retrofit; dsa_* keys above apply).
  std::string self_attention = "dense";
  WanConfig wan;
  TextEncoderConfig text_encoder;    // text_dim must equal the encoder's width (clip: checked when loaded)
  VaeConfig vae;                     // the DiT's samples: pixels, or latents of the VAE
  ImageEncoderConfig image_encoder;  // Wan2.1 image-to-video
};

struct DataConfig {
  std::string dataset = "structured-motion";  // structured-motion | videos (docs/data.md) | latent-tensors (Wan)
  int64_t channels = 3;
  int64_t frames = 8;
  int64_t height = 16;
  int64_t width = 16;
  int64_t num_clips = 512;       // clips in one epoch of the synthetic dataset
  int64_t max_text_tokens = 12;  // captions are padded or cut to this many tokens
  uint64_t seed = 1234;          // structured-motion: the clips; videos: the augmentation draws
  // videos: where the items are (one of manifest or root) and how they are decoded.
  std::string manifest;  // CSV (WebVid or Open-Sora columns) or JSONL; "" = none
  std::string root;      // a folder of videos with a same-stem .txt caption each
  std::string video_path_template = "{page_dir}/{videoid}.mp4";  // WebVid CSV: the file of a row
  double fps = 0.0;  // sample frames at this rate; 0 = every frame_stride-th frame
  int64_t frame_stride = 1;
  std::string clip_start = "random";  // random | center
  std::string crop = "center";        // center | random
  std::vector<std::array<int64_t, 3>>
      buckets;                     // [frames, height, width] each; empty = one bucket of frames x height x width
  double max_bad_fraction = 0.05;  // more bad items than this stops the run, listing them
  std::string cache;               // a folder written by megaslide-cache: read instead of decoding
  int64_t workers = 1;             // background loader threads (each single-threaded); 0 = load in line
  int64_t prefetch = 2;            // batches loaded ahead of the step that needs them
  // dataset latent-tensors (model.arch wan): one safetensors file of latents [N, C, T, H, W], text
  // [N, L, text_dim] and optionally empty_text [L, text_dim]; for image-to-video image_latents
  // [N, C, T, H, W] and (model.wan.image_dim > 0) image_embeds [N, Li, image_dim] (train/wan_family.h).
  std::string tensors;
  // Wan image-to-video (wan_image_to_video): the frame of each clip (0-based, below data.frames) whose image
  // conditions it, unless the item names an image of its own (docs/data.md).
  int64_t image_frame = 0;
};

struct DiffusionConfig {
  int64_t timesteps = 1000;
  std::string beta_schedule = "linear";  // linear | cosine
  double beta_start = 1e-4;
  double beta_end = 0.02;
  double caption_dropout = 0.1;  // probability of training on the empty prompt (for CFG)
  // Wan2.2 TI2V's image-to-video (model.arch wan, flow): the probability that a sample trains as
  // image-to-video — its first latent frame clean in the input, that frame's tokens at timestep 0 (per-token
  // timesteps) and left out of the loss; 0: every sample text-to-video.
  double first_frame_clean = 0.0;
  // Wan image-to-video: the probability that a sample trains without its image (the conditioning latents,
  // their mask and the CLIP tokens all zero), as caption_dropout drops the text.
  double image_dropout = 0.0;
  std::string prediction = "epsilon";  // what the model predicts and the loss compares: epsilon | v | x0
  int64_t sample_steps = 30;
  std::string timestep_spacing = "linspace";  // linspace | leading | trailing (sampler.h)
  double guidance_scale = 7.5;
  // Wan2.2's low-noise expert's guidance scale (model.wan.weights_2); -1: diffusion.guidance_scale.
  double guidance_scale_2 = -1.0;
  // ddpm: the DDPM objective above (prediction, beta schedule); flow: flow matching as Wan trains it
  // (diffusion/flow_matching.h): x_t = (1 − σ)·x0 + σ·ε, target ε − x0, timestep σ·timesteps.
  std::string objective = "ddpm";
  double shift = 1.0;                         // flow: σ → shift·σ / (1 + (shift − 1)·σ)
  std::string timestep_sampling = "uniform";  // flow: uniform | logit_normal (σ = sigmoid(N(logit_mean, logit_std)))
  double logit_mean = 0.0;
  double logit_std = 1.0;
  // Each sample's weight in the training loss (diffusion/loss_weighting.h): none, min_snr (ddpm: Min-SNR-γ with
  // γ = snr_gamma), sigma_sqrt or cosmap (flow).
  std::string loss_weighting = "none";
  double snr_gamma = 5.0;
};

struct TrainConfig {
  int64_t steps = 200;
  int64_t batch_size = 4;
  double lr = 1e-3;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int64_t warmup_steps = 10;
  std::string lr_schedule = "cosine";  // cosine | constant
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double grad_clip = 1.0;  // global-norm clip; 0 disables
  double ema_decay = 0.0;  // EMA of the weights, decay min(ema_decay, n/(n+9)) at update n > 1; 0 = none
  uint64_t seed = 0;
  std::string device = "auto";       // auto | cpu | cuda | cuda:N
  int64_t threads = 0;               // LibTorch intra-op threads; 0 = from the cores available (train/auto_settings.h)
  int64_t log_every = 10;            // lines in train.log (metrics.jsonl gets every step)
  int64_t grad_accum_steps = 1;      // micro-batches of batch_size per optimizer step
  double loss_scale_init = 65536.0;  // fp16 compute only: initial dynamic loss scale
  int64_t loss_scale_window = 1000;  // fp16: steps without overflow before the scale doubles
  double peak_tflops = 0.0;          // MFU denominator on a GPU; 0 = measure a matmul at start
  int64_t sample_every = 0;          // validation videos every N steps (RUN_DIR/samples/step-NNNNNNN/); 0 = never
  std::string sample_prompts;        // the validation videos' prompt file (io::read_prompt_specs: per-line size, seed,
                                     // steps, guidance, negative prompt); "" = the data's first captions
  // The validation loss (docs/training.md, "Validation loss"): every val_every steps (0 = never) the training loss
  // of the current weights over val_batches micro-batches of the validation data — the training data's config with
  // val_data's data.* overrides ("data.cache=/data/val"; none: the training data) — the same draws each time.
  int64_t val_every = 0;
  int64_t val_batches = 4;
  std::vector<std::string> val_data;
  int64_t checkpoint_every = 0;       // checkpoint every N steps and after the last (RUN_DIR/checkpoints/); 0 = never
  int64_t keep_last = 3;              // complete checkpoints kept (the newest); 0 = all
  int64_t max_consecutive_skips = 5;  // stop after this many non-finite steps in a row; 0 = never stop
  std::string init_from;  // start from these weights (weights file, checkpoint folder, safetensors); "" = random
  std::vector<std::string> init_allow_missing;  // parameter-name patterns (* any run) that init_from may lack
};

struct OffloadConfig {
  // The Trainer's streamed CPU-master mode (train/trainer.h); false runs the resident reference loop.
  bool enabled = true;
  std::string mode = "async";           // async | sync (every copy and update in line: the ablation)
  std::string compute_dtype = "auto";   // auto (train/auto_settings.h) | bf16 | fp16 (dynamic loss scaling) | fp32
  int64_t optimizer_threads = 0;        // CpuAdamW threads; 0 = from the cores available (train/auto_settings.h)
  double emulated_copy_delay_ms = 0.0;  // testing aid: CPU async copies land this much later (docs/offload.md)
  // Where the streamed trainer keeps the blocks' fp32 masters, AdamW moments and EMA (docs/offload.md, "The
  // NVMe tier"): ram | nvme (a scratch file in nvme_dir, each block's state read ahead of its update and
  // written back after it; the same numbers as ram, bit for bit).
  std::string state_tier = "ram";
  std::string nvme_dir;               // state_tier nvme: a folder on the NVMe disk (the file is removed at exit)
  int64_t nvme_blocks_in_flight = 2;  // state_tier nvme: blocks' state in host memory at once (>= 2)
  // Where the streamed trainer keeps the block-boundary checkpoints between the forward and the backward
  // (docs/offload.md, "Activation checkpoints on the host"): device | host (every block's input but the last
  // copied D2H during the forward and back H2D ahead of its block's backward, in page-locked buffers).
  std::string activations = "device";
};

struct OptimizerConfig {
  // How the streamed trainer keeps AdamW's m and v on the host: fp32 | bf16 | int8 (block-wise, 256
  // elements per fp32 scale; offload/cpu_adamw.h). The resident loop keeps fp32 (LibTorch's AdamW).
  std::string state_dtype = "fp32";
};

struct LoraConfig {
  // LoRA on the Linear layers of the model's blocks (model/lora.h, docs/lora.md): rank 0 trains every
  // parameter (full fine-tuning); rank r > 0 freezes the model and trains, for each targeted Linear
  // W [out, in], down [r, in] and up [out, r]: y = x W^T + b + (alpha / r) · up · down · dropout(x).
  // type lokr trains PEFT's LoKr instead: y = x W^T + b + (alpha / r) · x kron(W1, W2)^T, W1 [out_l, in_m] and
  // W2 [out_k, in_n] from the factorizations of out and in (`factor`), W2 as w2_a [out_k, r] · w2_b [r, in_n]
  // when r < max(out_k, in_n) / 2, else trained whole.
  std::string type = "lora";  // lora | lokr
  int64_t rank = 0;
  double alpha = 0.0;                        // 0: alpha = rank (scale 1)
  double dropout = 0.0;                      // on the adapter's input, in training
  std::vector<std::string> targets = {"*"};  // globs (* any run) over the Linear weights' names in the blocks
  std::string init = "default";              // default (PEFT's: down Kaiming-uniform, up 0) | gaussian (down N(0, 1/r))
  // LoKr: PEFT's decompose_factor; -1 factors each dimension into the two divisors nearest its square root,
  // f > 0 into (f, dim / f) where f divides it
  int64_t factor = -1;
  // How the streamed trainer keeps the frozen blocks in host RAM and uploads them: compute (the compute
  // dtype) | fp8 (float8_e4m3fn with a per-tensor scale: half bf16's bytes each way; a published fp8
  // file's weights kept as they are)
  std::string base_dtype = "compute";
};

struct OutputConfig {
  std::string run_dir = "runs/default";
  bool progress = true;      // live progress line on a terminal
  bool tensorboard = false;  // TensorBoard event files in RUN_DIR/tensorboard (train/run_outputs.h)
};

struct DistributedConfig {
  // Several processes (ranks) training one model (train/distributed.h, docs/distributed.md). How many and
  // which rank this process is come from the launcher's environment, not from here.
  std::string backend = "auto";  // auto (nccl on GPUs, gloo on the CPU) | nccl | gloo
  double timeout_s = 300.0;      // rendezvous and every collective; a rank gone for this long stops the others
  bool rank_logs = false;        // ranks other than 0 also write RUN_DIR/logs/rank-N.log
  // Context parallelism: groups of this many consecutive ranks share each sample, its frames split among them
  // (attention over the group: Ulysses for dense attention, a halo exchange for 3D-DSA); data parallelism over
  // the world size / context_parallel groups. Must divide the world size. 1: none.
  int64_t context_parallel = 1;
};

struct RunConfig {
  ModelConfig model;
  DataConfig data;
  DiffusionConfig diffusion;
  TrainConfig train;
  OffloadConfig offload;
  OptimizerConfig optimizer;
  LoraConfig lora;
  OutputConfig output;
  DistributedConfig distributed;
  // The keys its text and --set overrides gave (parse_run_config), whatever their values: not a setting of the run
  // (not saved, not compared), what a message about a value the config chose may go by.
  std::set<std::string> given;
};

// The shape [C, T, H, W] of the DiT's samples: the video's (data.channels x frames x height x width),
// or the VAE's latents' (latent_channels x frames (wan: 1 + (frames-1)/4) x height/ds x width/ds).
std::array<int64_t, 4> model_sample_shape(const RunConfig& config);

// Whether the model's blocks attend with 3D-DSA: the MegaSlide DiT, or Wan with model.self_attention: dsa3d.
bool uses_dsa3d(const ModelConfig& model);

// Whether a Wan DiT of `wan` generates video from an image (Wan2.1 I2V, Wan2.2 I2V-A14B): its input is the
// noisy latents, the first-frame mask (4 channels) and the conditioning video's latents, in_channels =
// 2 x out_channels + 4. The conditioning channels (mask and latents) are wan_condition_channels.
bool wan_image_to_video(const WanConfig& wan);
int64_t wan_condition_channels(const WanConfig& wan);

// A video's size in pixels.
struct VideoSize {
  int64_t frames = 0, height = 0, width = 0;
};
// The run's videos' size in pixels: data.frames x height x width, or for Wan's latent tensors what the
// Wan VAE decodes them to (4(T − 1) + 1 frames, H and W times model.vae.downscale).
VideoSize run_video_size(const RunConfig& config);
// model_sample_shape for videos of `size` instead of the data's (a validation prompt's own size).
// Throws std::invalid_argument saying which axis the model cannot take and what it needs (the Wan
// VAE's 1 + 4k frames, the VAE's downscale times the patch, the patch).
std::array<int64_t, 4> model_sample_shape_at(const RunConfig& config, VideoSize size);

// Loads `path`, applies `overrides` ("key.path=value", YAML scalars or flow sequences such as
// "[1,2,2]") in order, then validates. Throws ConfigError.
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Whether `spec` is a device a config (train.device) or a --device flag may name: auto, cpu, cuda or cuda:N
// (LibTorch's parser also takes meta, xla, cpu:3 and the like, which fail later).
bool is_device_spec(const std::string& spec);

// Parses YAML text (the source name is used in messages only).
RunConfig parse_run_config(const std::string& yaml_text, const std::string& source,
                           const std::vector<std::string>& overrides = {});
// A config MegaSlide saved (a checkpoint's, a weights file's): as parse_run_config, without the checks of values
// older versions accepted and saved (control characters in text, data.root or data.manifest beside another dataset,
// offset ranges past 10^4 tokens, 3D-DSA kernels past twice the token grid), so that their files keep loading.
RunConfig parse_saved_run_config(const std::string& yaml_text, const std::string& source);

// Checks ranges and cross-field consistency; throws ConfigError naming `source`. With model.wan.weights set,
// Wan's sizes are the weights' (with_wan_architecture_from_weights reads them, then checks again with
// `wan_sizes_resolved`): until then the checks that need them are left out.
void validate(const RunConfig& config, const std::string& source, bool wan_sizes_resolved = false);

// The resolved config as YAML that parse_run_config reads back to an equal config.
std::string to_yaml(const RunConfig& config);

// Every key path the schema knows, in file order (for docs and error hints).
std::vector<std::string> config_keys();

// The keys whose values differ between two configs, in file order (empty when they are equal).
std::vector<std::string> differing_keys(const RunConfig& a, const RunConfig& b);
// The value of `key` in `config` as one line of YAML ("" for an unknown key).
std::string config_value_text(const RunConfig& config, const std::string& key);

// The config of a run's validation loss (train.val_every > 0): `config` with train.val_data's overrides applied (each
// "data.KEY=VALUE"; none: the training data), captions and images never dropped (diffusion.caption_dropout and
// image_dropout 0), train.val_data and val_every cleared. Throws ConfigError naming train.val_data and `source`.
RunConfig validation_data_config(const RunConfig& config, const std::string& source);

// Settings of `config` (resolved) that the run will not use, one warning line each: keys set away from their defaults
// that belong to a mode the config does not turn on (lora.* with lora.rank 0, offload.nvme_* with the RAM tier,
// train.init_allow_missing without train.init_from, train.sample_prompts with train.sample_every 0, the videos'
// frame sampling with another dataset, train.loss_scale_init without fp16), and a train.warmup_steps above
// train.steps (the learning rate never reaches train.lr).
std::vector<std::string> unused_settings(const RunConfig& config);

}  // namespace megaslide
