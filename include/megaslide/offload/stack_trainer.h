// StreamedStackTrainer: full-parameter training of any StreamedModel whose block stack does not fit
// on the device (DESIGN.md §2). The engine under the streamed Trainer (train/trainer.h); use it directly for your own
// block stack (docs/offload.md).
//
// State: every block's fp32 master weights, AdamW moments (fp32, bf16 or int8: state_dtype) and
// transfer buffer live in a HostParamStore (host RAM; only the transfer buffer is pinned when CUDA
// runs; with state_tier kNvme the masters, moments and EMA live on an NVMe disk, paged in around each
// block's update); the device holds two weight slots, two gradient slots (WeightStreamer), the block-boundary
// activations of the micro-batch in flight, and the resident prologue/epilogue with their LibTorch
// AdamW state. At accumulation 1 there is no gradient buffer: a block's gradient is copied into its
// transfer buffer, whose compute copy is not needed again until the block's update rewrites it (a
// skipped update rounds it back from the master). Accumulation adds an fp32 gradient buffer (4 B per
// parameter) and two pinned staging buffers of one block each.
//
// Construction: block by block (load_initial_weights), so a model whose blocks are skeletons on the
// meta device (StreamedModel::initial_block) never exists in full anywhere but the store.
//
// One micro-batch: prologue (autograd) -> blocks forward without grad, keeping only each block's input
// -> epilogue and loss -> for l = L-1 … 0: recompute block l from its input with grad, backward into
// the slot's flat gradient buffer, copy that buffer to the host (D2H stream) -> prologue backward with
// the summed gradients of the block inputs. A block's host update starts only once its gradient copy
// has landed (it waits on the copy's event).
// Updates: CpuAdamW on a host thread. When nothing needs every gradient first (grad_clip = 0 and no
// fp16 loss scaling), block l's update starts as soon as its last gradient is on the host, while the
// device goes on with block l-1 ("immediate"). Otherwise ("deferred") the updates run after the
// backward, in block order, overlapped with the next step's forward: block l's upload waits only for
// block l's update. kSync mode runs every copy and update in line (bit-identical results).
//
// fp16 compute: dynamic loss scaling; a non-finite gradient anywhere skips the whole step (no
// update, AdamW step count unchanged) and halves the scale; loss_scale_window clean steps double it.
// Non-finite gradients in any precision skip the step (StackStepResult::skipped): with deferred updates
// nothing is updated; with immediate updates, which start before the global norm is known, the host
// checks each block's gradient before updating it, and the first non-finite block and every block after
// it in the step are left alone (blocks already updated keep their finite update), as is the resident
// part. A non-finite loss makes every gradient non-finite, so such a step updates nothing in either mode.
//
// Parameters of a block that received no gradient in a step (unused by the forward) are left alone by
// the update, as torch::optim::AdamW leaves parameters without a gradient: no weight decay, no moments.
//
// Data parallelism over R ranks (options.exchange; docs/distributed.md): each rank runs this schedule on
// its own micro-batches and keeps the whole compute copy of every block but only its shard of the
// masters and moments (HostParamStore sharding). Once a block's gradient of the step is on the host, a
// host task reduce-scatters it (the sum over the ranks; each rank receives its shard, with a count of the
// ranks whose gradient held a non-finite value), the rank's CpuAdamW updates its shard with the
// gradient divided by R (the gradient of the mean loss over the global batch), and an all-gather puts
// every rank's updated shard into every rank's compute copy before the block's next upload. The
// resident parameters' gradients and the losses are summed over the ranks (one all-reduce on the
// driving thread), so the clip coefficient, the skip decision and the resident AdamW step are the
// same on every rank. int8 moments are refused with several ranks.
//
// EMA of the weights (options.ema_decay > 0): an fp32 exponential moving average of every parameter —
// the blocks' in the host store beside their masters (sharded like them), the resident parameters' on
// the device beside them. Each block's EMA is updated on the host task right after its AdamW update
// (one more pass over the block: 12 B per parameter read and written), the resident parameters' after
// their AdamW step: the EMA follows the masters exactly as they are updated (a step skipped as a whole
// updates no EMA; with immediate updates the blocks updated before a non-finite one are, as their
// masters). ema_decay_at gives the decay, from the AdamW step count.
//
// Memory: the trainer owns the store, the streamer and the resident optimizer; it shares ownership
// of the model. After construction the blocks' own parameter tensors are empty: their values live in
// the store (block_master).
// Threading: one thread drives the trainer; it runs one host worker thread plus CpuAdamW's pool.
#pragma once

#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/offload/cpu_adamw.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/offload/shard_exchange.h"
#include "megaslide/offload/step_trace.h"
#include "megaslide/offload/streamed_model.h"
#include "megaslide/offload/weight_streamer.h"

namespace torch::optim {
class AdamW;
}

namespace megaslide::offload {

// "bf16" | "fp16" | "fp32".
c10::ScalarType parse_compute_dtype(const std::string& name);

// The decay of the n-th EMA update (n >= 1) for train.ema_decay `decay`: 0 at n = 1 (the EMA becomes the
// weights after the first update), then min(decay, n / (n + 9)) — diffusers' EMAModel's default warm-up.
double ema_decay_at(double decay, int64_t update);
// ema ← decay · ema + (1 − decay) · value, element by element: at::lerp's arithmetic (fp32 tensors of one
// shape on one device; the CPU path is a plain loop, safe on any thread).
void ema_update(const at::Tensor& ema, const at::Tensor& value, double decay);

// optimizer.step() of a LibTorch AdamW, run by `kernel` (CpuAdamW's fused pass, which follows LibTorch's
// arithmetic operation for operation: m and v bit for bit, the weights within an ulp or two, because LibTorch's
// vectorised sqrt is not correctly rounded; docs/cpu-adamw.md) when every parameter with a gradient is a contiguous
// fp32 CPU tensor with a contiguous fp32 gradient, no group uses amsgrad and every group's betas, eps and
// weight decay are `kernel`'s; otherwise LibTorch's own step. The state stays LibTorch's (AdamWParamState:
// step, exp_avg, exp_avg_sq, created at a parameter's first update as LibTorch creates it), so checkpoints
// and optimizer.state() see no difference. LibTorch's step is one pass per operation over every tensor; the
// fused pass reads and writes each element once (docs/cpu-adamw.md). Returns whether the fused pass ran (false:
// LibTorch's step did).
bool step_on_host(torch::optim::AdamW& optimizer, CpuAdamW& kernel);

// The host store a StreamedStackTrainer allocates for this compute dtype, accumulation and state dtype
// (also what megaslide-plan counts): a transfer buffer in the compute dtype that holds the compute copy
// and, at accumulation 1, each block's gradient between its backward and its update (fp32 compute
// uploads the master; the buffer then holds only gradients); with accumulation a separate fp32
// gradient buffer sums the micro-batches.
HostParamStoreOptions host_store_options(c10::ScalarType compute_dtype, int64_t grad_accum_steps,
                                         StateDtype state_dtype = StateDtype::kFloat32);

// Writes every block's initial weights into `store`, one block at a time: StreamedModel::initial_block
// (or the block's own parameters) converted to fp32 master and rounded compute copy, the built module's
// parameters then emptied and the module handed to StreamedModel::adopt_block; so at most `threads`
// blocks' initial weights exist at once besides the store. The result does not depend on `threads`
// (a block's weights depend only on the model and its index).
void load_initial_weights(StreamedModel& model, HostParamStore& store, int threads);

struct StackTrainerOptions {
  torch::Device device = torch::kCPU;
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;  // BFloat16, Half (loss scaling) or Float
  StreamMode mode = StreamMode::kAsync;
  AdamWOptions adamw;                             // lr here is unused: step() takes each step's lr
  int optimizer_threads = 1;                      // CpuAdamW threads
  StateDtype state_dtype = StateDtype::kFloat32;  // how AdamW's m and v are kept on the host
  int init_threads = 2;                           // blocks initialised at once at construction (load_initial_weights)
  double grad_clip = 0.0;                         // global-norm clip over every parameter; 0 disables
  int64_t grad_accum_steps = 1;                   // micro-batches per step (each loss divided by this)
  double loss_scale_init = 65536.0;               // fp16 only
  int64_t loss_scale_window = 1000;               // fp16 only
  bool pin_host_memory = true;                    // page-lock the host state when CUDA runs
  // CPU async mode only (a testing aid): every emulated copy starts this many milliseconds late, so a
  // reader that does not wait for its copy reads the poison the copy's destination holds until then.
  double emulated_copy_delay_ms = 0.0;
  // Data parallelism: the ranks' communication (nullptr: one process). It must outlive the trainer.
  std::shared_ptr<ShardExchange> exchange;
  // > 0: keep an fp32 EMA of every parameter with this decay (ema_decay_at; train.ema_decay).
  double ema_decay = 0.0;
  // The blocks' parameters are frozen (LoRA's base): the store holds their weights in the compute dtype
  // only (HostParamStoreOptions::frozen), they stream H2D only — no gradient slots, no D2H, no host
  // AdamW, no exchange of blocks between ranks — and only the resident parameters train. Those may be
  // read inside the blocks (LoRA's adapters): their gradients accumulate through each block's recompute.
  bool frozen_blocks = false;
  // Frozen blocks only: Float8_e4m3fn keeps them as fp8 in host RAM (1 B per parameter and a scale per
  // tensor, HostParamStoreOptions::frozen_dtype), uploads the fp8 bytes — half bf16's — and upcasts them
  // to the compute dtype on the device. Undefined (the default): the compute dtype.
  c10::ScalarType frozen_dtype = c10::ScalarType::Undefined;
  // Where the blocks' masters, moments and EMA live (offload.state_tier; HostParamStore's NVMe tier): kNvme keeps
  // them in a scratch file in nvme_dir, nvme_blocks_in_flight blocks' state in host memory at once (>= 2: one
  // updated while the next is read and the last written back). Each block's state is read ahead of its update
  // (queued when the update is, in the order updates run) and written back after it; results are the RAM
  // tier's, bit for bit. Not with frozen blocks.
  StateTier state_tier = StateTier::kRam;
  std::string nvme_dir;
  int64_t nvme_blocks_in_flight = 2;
  NvmeFileOptions nvme;
  // Activation checkpoints on the host (offload.activations: host): the input of every block but the last is
  // copied D2H on the D2H stream as the forward reaches it, into a page-locked host buffer of its own (kept
  // from step to step), and its device copy freed; each block's backward finds its input restored H2D on the
  // H2D stream while the block after it (in the backward's order) computes. The device holds 3 block inputs
  // at most instead of every one; the results are the device mode's, bit for bit.
  bool host_activations = false;
};

// The part of the stack a step trains (StreamedStackTrainer::step): a model whose parts are trained on
// different steps (Wan2.2's two experts, train/model_family.h) streams only blocks [begin, end) of the
// step's part; every other block keeps its master, moments and EMA untouched and is not uploaded.
// Updates of the step take AdamW step number `adam_step` (its bias correction and the EMA's warm-up):
// the part's own count of updates + 1, so each part is updated as if it were trained alone.
struct StepBlocks {
  int64_t begin = 0;
  int64_t end = -1;       // -1: the last block
  int64_t adam_step = 0;  // 0: optimizer_steps() + 1
};

struct StackStepResult {
  double loss = 0.0;       // mean of the micro-batch losses
  double grad_norm = 0.0;  // global, unscaled, before clipping (inf/nan on an fp16 overflow)
  double loss_scale = 1.0;
  bool skipped = false;
  int64_t h2d_bytes = 0, d2h_bytes = 0;
  double exposed_transfer_s = 0.0, optimizer_wait_s = 0.0, optimizer_s = 0.0;
  int64_t peak_device_bytes = 0;  // GPU: allocator peak; CPU: slots + resident state + activations kept
  double step_time_s = 0.0;
  // Sharded (several ranks): bytes this step's block exchanges take from this rank (reduce-scatter
  // inputs + all-gather outputs, ≈ 2 × compute-dtype bytes × streamed parameters), counted as they
  // are queued, and the host task thread's seconds inside such collectives that finished during this
  // step (some of a step's run while the next one computes).
  int64_t exchange_bytes = 0;
  double exchange_s = 0.0;
  // The NVMe tier: this step's reads and write-backs of the blocks' state (bytes, the I/O thread's seconds; a
  // step's write-backs may finish during the next step) and the seconds updates waited for a read.
  int64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  double nvme_read_s = 0.0, nvme_write_s = 0.0, nvme_wait_s = 0.0;
};

class StreamedStackTrainer {
 public:
  // Runs under autograd once per micro-batch: the resident prologue (draw the micro-batch here).
  using Prologue = std::function<StackInput()>;
  // Runs under autograd: the resident epilogue from the last block's output (dtype of
  // StackInput::hidden, a leaf) to the micro-batch's scalar loss.
  using Epilogue = std::function<torch::Tensor(const torch::Tensor& last_hidden)>;

  StreamedStackTrainer(std::shared_ptr<StreamedModel> model, StackTrainerOptions options);
  ~StreamedStackTrainer();
  StreamedStackTrainer(const StreamedStackTrainer&) = delete;
  StreamedStackTrainer& operator=(const StreamedStackTrainer&) = delete;

  // One optimizer step of options.grad_accum_steps micro-batches at learning rate `lr`, through `blocks`
  // (all by default). A step of part of the blocks updates the resident parameters that received a
  // gradient and their EMA only.
  StackStepResult step(const Prologue& prologue, const Epilogue& epilogue, double lr, const StepBlocks& blocks = {});
  // Waits for host updates still running (deferred mode lets them overlap the next step).
  void synchronize();
  // The NVMe tier's reads and writes since `since` (store().nvme_stats() after synchronize(), before a checkpoint's
  // save or validation videos between steps) are no step's: the next step's nvme_* figures leave them out, as its
  // first step leaves out the initial load and a resume's.
  void leave_out_of_step_figures(const HostParamStore::NvmeStats& since);

  const StackTrainerOptions& options() const { return options_; }
  bool deferred_updates() const;
  int64_t optimizer_steps() const { return adam_steps_; }  // updates taken (skipped steps excluded)
  double loss_scale() const { return loss_scale_; }
  int64_t clean_steps() const { return clean_steps_; }
  // Checkpoint resume: the counters above as they were saved.
  void restore_counters(int64_t optimizer_steps, double loss_scale, int64_t clean_steps);
  // LibTorch's AdamW of the resident parameters (nullptr when there are none).
  torch::optim::AdamW* resident_optimizer();
  // After a block's masters were rewritten in place (a checkpoint read into block_master's views):
  // waits for pending updates, rounds every block's compute copy from its master and drops copies
  // cached on the device. compute_restored: restore_block_compute already did the rounding for every
  // block (a loader that held each block's state on the NVMe tier), so only the rest is done — unless a
  // restore_block_compute failed since the last reload: then every block is rounded again.
  void reload_blocks_from_masters(bool compute_restored = false);
  // Rounds block l's compute copy from its master and drops its copy cached on the device: what
  // reload_blocks_from_masters does for one block, for a loader that holds the block's state anyway
  // (HostParamStore::acquire_state). Call with no update pending (synchronize).
  void restore_block_compute(int64_t block);
  const HostParamStore& store() const { return *store_; }
  const WeightStreamer& streamer() const { return *streamer_; }
  // The streamer's two device slots lent between steps to a forward-only pass over the store's blocks (a
  // validation denoiser: StreamedDenoiserOptions::lent_streamer), so that it allocates none of its own; waits for
  // pending updates first. The pass uploads through offload::StreamedForward's lent mode, and the next step
  // uploads its blocks again.
  WeightStreamer& lend_streamer();
  int64_t streamed_parameter_count() const;
  int64_t resident_parameter_count() const;
  // Writes one parameter's value into block l's master (sharded: this rank's part) and compute copy
  // (HostParamStore::set_param; waits for pending updates first). Call reload_blocks_from_masters
  // after the last one.
  void set_block_parameter(int64_t block, const std::string& name, const torch::Tensor& value);
  // Block l's fp32 master weights, by parameter name (views into the store; call synchronize first).
  std::vector<std::pair<std::string, torch::Tensor>> block_master(int64_t block) const;

  // EMA (options.ema_decay > 0; call synchronize first). The EMA of a resident parameter (a tensor beside
  // it on the device; undefined without EMA or for a tensor that is not a resident parameter).
  bool has_ema() const { return options_.ema_decay > 0; }
  torch::Tensor resident_ema(const torch::Tensor& param) const;
  // Every EMA set to the current weights (a resumed run whose checkpoint has none).
  void reset_ema_to_weights();
  // Sharded: block l's whole EMA in the compute dtype, put together from every rank's shard (a host
  // channel all-gather: every rank calls it for the same blocks in the same order). One process: the
  // store's EMA converted to the compute dtype.
  torch::Tensor gathered_block_ema(int64_t block);

  // Records the next step() into `trace` (nullptr: stop). Lanes: compute, H2D, D2H, optimizer.
  void set_trace(StepTrace* trace);

 private:
  struct Impl;
  struct StepRun;  // one step's schedule of phases (stack_trainer.cpp)
  std::unique_ptr<Impl> impl_;
  StackTrainerOptions options_;
  int64_t adam_steps_ = 0;
  int64_t step_calls_ = 0;  // every step(), skipped or not: tells one step's immediate updates from the next's
  double loss_scale_ = 1.0;
  int64_t clean_steps_ = 0;
  std::unique_ptr<HostParamStore> store_;
  std::unique_ptr<WeightStreamer> streamer_;
};

}  // namespace megaslide::offload
