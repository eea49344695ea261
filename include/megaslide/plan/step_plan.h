// StepPlan: what one training step of a run config needs and moves, computed without allocating
// anything (the model is built on the meta device), and the lower bound on its time on a given
// machine (DESIGN.md §6; `megaslide-plan`, docs/planner.md).
//
// Exact (equal to what the trainer allocates and measures, tested against the streamed Trainer):
//   - host RAM by component: HostParamStore's master, m, v (and int8 scales), transfer buffers and
//     accumulation gradients, plus the accumulation staging buffers (StreamedStackTrainer,
//     grad_accum_steps > 1), the start-up peak and the page-locked bytes (tested against the store and
//     against the resident set size of a real run);
//   - bytes over PCIe per step each way (WeightStreamer's counters: every upload a slot cache miss,
//     every gradient one copy);
//   - the device components the trainer itself accounts on the CPU: weight and gradient slots,
//     resident prologue/epilogue with gradient and AdamW state, block-boundary checkpoints.
// Modelled (an analytic count of the tensors autograd keeps, documented in docs/planner.md; not yet
// checked against a GPU allocator): the activations and workspace of recomputing one block, the
// prologue/epilogue activations, the shared block inputs. CUDA context, cuBLAS workspace and
// allocator fragmentation are outside the model, as they are outside the measured allocator peak.
//
// Time: model FLOPs as model_flops_per_step (recompute not counted), executed FLOPs with the
// recompute; the step can be no faster than the largest of compute/peak, H2D/PCIe, D2H/PCIe and the
// host optimizer's memory traffic/DRAM bandwidth (async), or their sum (offload.mode: sync).
//
// LoRA (lora.rank > 0; model/lora.h, docs/planner.md "LoRA"): the blocks are frozen. The streamed trainer's
// store is the transfer buffer alone, holding the frozen weights in the compute dtype (HostParamStore's
// `frozen`; no master, moments, gradient, EMA or staging, never sharded); the device keeps the two weight
// slots and no gradient slots, the adapters (for each Linear of the blocks whose weight's name matches
// lora.targets, down [r, in] and up [out, r] — LoKr: W1 and W2 or its two factors — counted from the
// meta-device model as LoraAdapters::add creates them) with fp32 weight, gradient, AdamW m and v (and EMA), and the
// family's own resident parameters frozen in fp32 (weights only). PCIe: no downloads; the uploads of full fine-tuning's
// schedule, less the two blocks a step finds still in the slots from the previous one (no update invalidated them); no
// host optimizer. Model FLOPs are the LoRA wrapper's 2/3 of the family's (no weight gradients of the base); the
// executed FLOPs keep the recompute and the attention's whole backward (input gradients) and add the adapters' own.
//
// The NVMe tier (offload.state_tier: nvme): the store's master, moments, scales and EMA are counted on the disk
// (HostParamStore's regions, exactly), host RAM keeps the in-flight buffers; every step reads and writes back
// each updated block's region, timed at the profile's nvme_gbps (reads plus writes) beside the other terms.
//
// Data parallelism (world_size R > 1, docs/planner.md "Several ranks"): every figure is one rank's. The
// global batch train.batch_size splits into R per-rank batches (the device plan and the FLOPs use
// B/R); the streamed trainer shards each block's fp32 master and AdamW moments over the ranks (rank r owns
// the contiguous [min(n, r·s), min(n, r·s + s)) of a block of n elements, s = ceil(n/R); the plan
// counts rank 0's, the largest) while every rank keeps the whole transfer buffer; the resident trainer
// keeps everything on every rank. The exchange (reduce-scatter of the gradients and all-gather of the
// compute copies, or the resident trainer's all-reduce) is counted per rank with a ring's bytes on the
// wire and timed at the profile's network_gbps. R = 1 is the single-process plan, unchanged.
//
// Context parallelism (distributed.context_parallel = n > 1 dividing R, docs/distributed.md "Context parallelism"):
// data parallelism over R / n groups (the batch splits R / n ways); every rank of a group holds ceil(T / n) of each
// sample's T token frames (rank 0's share, the largest), and the device plan and the FLOPs are those tokens' (3D-DSA:
// plus the attention over the halo frames' zero queries). Each attention exchanges activations with the group over
// the profile's device_link_gbps, blocking the compute (so the compute term is compute + context): Ulysses'
// all-to-all for dense attention (4·(n − 1)/n of the rank's q, k, v and output), a halo of key/value frames for
// 3D-DSA (⌊kt/2⌋ + ⌊temporal range⌋ + 1 frames from each neighbour, and one frame of the offset network's input),
// the frames of the windows crossing the slab's edges for Swin (at most window − 1 each way), in every forward, the
// streamed trainer's recompute and the backward.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/plan/hardware_profile.h"

namespace megaslide::plan {

// Host RAM of the streamed trainer, bytes (docs/offload.md's budget per parameter, line by line).
struct HostMemoryPlan {
  int64_t master = 0;                   // fp32
  int64_t exp_avg = 0, exp_avg_sq = 0;  // optimizer.state_dtype: fp32, bf16 or int8
  int64_t scales = 0;                   // int8 state: fp32 scale per 256 elements of each parameter, m and v
  int64_t compute = 0;                  // the transfer buffer: compute copy, and the gradient at accumulation 1
  int64_t grad = 0;                     // fp32 gradient sums, accumulation only
  int64_t ema = 0;                      // train.ema_decay: the fp32 EMA of the masters (this rank's shard)
  int64_t exchange = 0;                 // world_size > 1: two scratch buffers of R·s_max elements of the
                         // exchange dtype (compute; fp32 with accumulation), s_max = ceil(largest block / R)
  int64_t staging = 0;  // accumulation: two D2H landing buffers of one block (pinned)
  int64_t pinned = 0;   // page-locked where CUDA runs: the transfer buffer (and an
                        // uploaded fp32 master), the staging buffers
  // While the trainer is built: the store next to the fp32 initial weights of the blocks being loaded
  // into it (two at a time); no full-model copy exists.
  int64_t construction_peak = 0;
  // One of Wan2.2's experts trained with validation videos (model.wan.expert, train.sample_every): the
  // other expert's blocks in the compute dtype, read from its weights while the videos are made.
  int64_t other_expert = 0;
  // The NVMe tier (offload.state_tier: nvme): master, moments, scales and EMA (the figures above) are on the
  // disk; host RAM holds nvme_buffers of them instead (min(offload.nvme_blocks_in_flight, blocks) × the largest
  // block's 4 KiB-aligned region).
  bool state_on_nvme = false;
  int64_t nvme_buffers = 0;
  // offload.activations: host: a page-locked buffer for the input of every block but the last (in pinned too).
  int64_t activations = 0;
  int64_t state() const {
    return (state_on_nvme ? nvme_buffers : master + exp_avg + exp_avg_sq + scales + ema) + compute + grad + exchange;
  }  // HostParamStore
  int64_t steady() const { return state() + staging + activations; }
  int64_t peak() const {
    const int64_t validation = steady() + other_expert;
    return construction_peak > validation ? construction_peak : validation;
  }
};

// Device memory, bytes (the allocator's view: what peak_device_bytes measures on a GPU).
struct DeviceMemoryPlan {
  int64_t weight_slots = 0;               // 2 x largest block, compute dtype
  int64_t gradient_slots = 0;             // 2 x largest block, compute dtype (LoRA: none)
  int64_t resident_state = 0;             // prologue + epilogue + caption encoder: fp32 weights, grad, m, v (+ EMA)
                                          // (LoRA: the adapters')
  int64_t frozen_resident = 0;            // LoRA: the family's resident parameters (resident loop: every
                                          // parameter), frozen fp32 weights only
  int64_t checkpoints = 0;                // every block's input kept by the forward, plus the last output
  int64_t block_inputs = 0;               // shared block inputs (t_mod, text) in the compute dtype, with grads
  int64_t prologue_epilogue = 0;          // fp32 activations of the resident parts (batch, x_0, the head's graph)
  int64_t recompute_saved = 0;            // tensors autograd keeps while one block is recomputed with grad
  int64_t recompute_workspace = 0;        // its backward's transients (3D-DSA fused: fp32 dk/dv scratch)
  int64_t recompute_saved_reference = 0;  // 3D-DSA only: the same with the grid_sample reference
  int64_t recompute_workspace_reference = 0;
  // Context parallelism: one attention's received activations and their gradients (the halo, or Ulysses' other
  // ranks' shares), in flight while it runs.
  int64_t context_buffers = 0;
  // LoRA: of recompute_saved (and the reference's), what the adapters add: each adapted Linear's r-wide
  // down output (LoKr: its first GEMM's [in_m, out_k] output) and its weights cast to the compute dtype,
  // with lora.dropout its mask and dropped input.
  int64_t lora_saved = 0;
  // The resident trainer with world_size > 1: the flat fp32 buffer of every gradient that one all-reduce
  // sums (average_gradients_over_ranks, train/distributed.h). It exists after the backward, when the activations are
  // gone, so the peak takes the larger of the two.
  int64_t gradient_all_reduce = 0;
  int64_t activations() const {
    return checkpoints + block_inputs + prologue_epilogue + recompute_saved + recompute_workspace + context_buffers;
  }
  int64_t peak() const {
    return weight_slots + gradient_slots + resident_state + frozen_resident +
           std::max(activations(), gradient_all_reduce);
  }
  // The same with the grid_sample 3D-DSA reference (0 when there is none).
  int64_t peak_reference() const {
    if (recompute_saved_reference == 0) return 0;
    const int64_t a = activations() - recompute_saved - recompute_workspace + recompute_saved_reference +
                      recompute_workspace_reference;
    return weight_slots + gradient_slots + resident_state + frozen_resident + std::max(a, gradient_all_reduce);
  }
  // What StreamedStackTrainer reports as peak_device_bytes when the device is the CPU (the parameters its
  // optimizer holds: not the frozen ones).
  int64_t trainer_cpu_accounting() const { return weight_slots + gradient_slots + resident_state + checkpoints; }
};

struct TransferPlan {
  int64_t h2d_bytes = 0, d2h_bytes = 0;  // per optimizer step (all micro-batches)
  int64_t h2d_copies = 0, d2h_copies = 0, cache_hits = 0;
  // The first step's uploads: h2d_bytes, except with frozen blocks (LoRA), whose later steps find the
  // two blocks the previous step ended with still in the slots (h2d_bytes is such a step's).
  int64_t first_step_h2d_bytes = 0;
  // offload.activations: host: the block inputs saved D2H in each forward and restored H2D in each backward
  // (bytes each way per step, all micro-batches; in h2d_bytes and d2h_bytes, and their copies in the counts).
  int64_t activation_bytes = 0;
};

// The collectives of one optimizer step of a data-parallel run (world_size > 1), per rank. Streamed
// trainer: a reduce-scatter of every block's gradient (the exchange dtype: the compute dtype, fp32 with
// accumulation) and an all-gather of every block's updated compute copy, on the host over Gloo; resident
// trainer: one all-reduce of every gradient in fp32. LoRA (either trainer): one all-reduce of the step's
// adapters' fp32 gradients, nothing of the frozen blocks.
struct ExchangePlan {
  int64_t payload_bytes = 0;  // the buffers reduced or gathered: (exchange + compute bytes) per streamed
                              // parameter; resident: 4 per trained parameter
  int64_t wire_bytes = 0;     // a ring's bytes each rank sends (and receives): (R − 1) chunks of ceil(n/R) elements
                              // per reduce-scatter or all-gather of n elements, twice that per all-reduce
  int64_t collectives = 0;    // per step: two per block (streamed) or one (resident)
};

struct TimePlan {
  double model_flops = 0.0;     // model_flops_per_step (the MFU numerator)
  double executed_flops = 0.0;  // plus the checkpointing recompute (a second forward of the blocks)
  int64_t optimizer_bytes = 0;  // host memory traffic of CpuAdamW and gradient accumulation per step
  double compute_s = 0.0, h2d_s = 0.0, d2h_s = 0.0, optimizer_s = 0.0;
  double exchange_s = 0.0;  // world_size > 1: the exchange's bytes on the wire / network_gbps
  double nvme_s = 0.0;      // the NVMe tier: the step's reads and write-backs of the state / nvme_gbps
  double context_s = 0.0;   // context parallelism: the activations exchanged per step / device_link_gbps
  double lower_bound_s = 0.0;
  std::string bottleneck;        // "compute" | "h2d" | "d2h" | "host optimizer" | "exchange" | "nvme"
  bool overlapped = true;        // async: the bound is the max; sync (and the resident trainer's all-reduce,
                                 // which follows its backward): the sum
  bool exchange_after = false;   // LoRA, streamed, world_size > 1: the adapters' all-reduce follows the
                                 // backward, so async bounds at the largest other term + the exchange
  double lora_flops = 0.0;       // LoRA: the adapters' executed FLOPs (in executed_flops, not in model_flops)
  double mfu_upper_bound = 0.0;  // model_flops / (lower_bound_s · peak)
};

struct StepPlan {
  // The run.
  std::string arch;
  bool streamed = true;  // offload.enabled
  std::string compute_dtype, mode;
  std::string state_dtype;  // optimizer.state_dtype (fp32 for the resident loop)
  bool ema = false;         // train.ema_decay > 0: an fp32 EMA of every parameter (host store / resident parts)
  int64_t layers = 0, hidden = 0, batch_size = 0, grad_accum_steps = 0, tokens_per_sample = 0;
  int64_t world_size = 1;           // ranks; every figure below is one rank's
  int64_t batch_size_per_rank = 0;  // batch_size / (world_size / context_parallel)
  // Context parallelism (distributed.context_parallel > 1): the group size, this rank's token frames and tokens of
  // each sample (rank 0's: the most), what the attention exchanges ("Ulysses all-to-all", "3D-DSA halo",
  // "window halo"), the halo's frames (both neighbours'; 0 for Ulysses) and the bytes each rank sends per step (as
  // many received).
  int64_t context_parallel = 1;
  int64_t token_frames_per_rank = 0, tokens_per_rank = 0;
  std::string context_exchange;
  int64_t context_halo_frames = 0;
  int64_t context_bytes = 0;
  std::vector<int64_t> token_grid;  // t, h, w
  // Parameters.
  int64_t params = 0;                   // the DiT (as megaslide-train --dry-run)
  int64_t text_encoder_params = 0;      // the caption encoder (resident)
  int64_t streamed_params = 0;          // every block
  int64_t resident_params = 0;          // prologue + epilogue + caption encoder
  int64_t params_per_block = 0;         // largest block
  int64_t sharded_params_per_rank = 0;  // streamed: rank 0's shard of every block, Σ ceil(n_b / world_size) (LoRA: 0)
  HardwareProfile hardware;
  HostMemoryPlan host;                     // one rank's
  int64_t host_state_bytes_all_ranks = 0;  // streamed, world_size > 1: the stores of all ranks together
  DeviceMemoryPlan device;
  TransferPlan transfer;
  ExchangePlan exchange;
  TimePlan time;
  // LoRA (lora.rank > 0; 0: full fine-tuning). params, streamed_params and resident_params stay the
  // model's (all frozen); the trained parameters are the adapters.
  int64_t lora_rank = 0;
  std::string lora_type = "lora";         // lora.type: lora | lokr
  std::string lora_base_dtype;            // the frozen blocks' host copy: the compute dtype, or fp8 (lora.base_dtype)
  double lora_alpha = 0.0;                // alpha (0 in the config: the rank)
  std::vector<std::string> lora_targets;  // lora.targets
  int64_t lora_adapters = 0;              // adapted Linear layers (both Wan2.2 experts' with expert both)
  int64_t lora_params = 0;                // trained: Σ r·(in + out) over them (LoKr: W1's and W2's)
  // Wan2.2: the expert trained (model.wan.expert: high or low; "" for one DiT) and its boundary. The plan
  // is that expert's; the other one's state is not in host RAM.
  std::string wan_expert;
  double boundary_ratio = 0.0;
  // The NVMe tier (offload.state_tier: nvme; docs/planner.md "The NVMe tier"): the state file on the disk, and
  // what a step reads and writes back of it (each updated block's region once: accumulation amortises it over
  // the micro-batches). fits_nvme: the file fits the profile's nvme_bytes (true when the profile gives none).
  std::string state_tier = "ram";
  int64_t nvme_file_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
  // offload.activations (docs/planner.md, "Activation checkpoints on the host"): device | host.
  std::string activations = "device";
  bool fits_nvme = true;
  bool fits_device = false, fits_host = false;
  std::vector<std::string> advice;  // what to change when it does not fit (empty when it does)
};

// The plan of one rank of `config` on `hardware` with `world_size` data-parallel ranks (1: one process).
// Throws ConfigError, naming `source` (the config's file) and the key, for an invalid config, and with
// world_size > 1 for a train.batch_size the ranks do not divide, for a distributed.context_parallel they do
// not divide and for int8 AdamW moments with the streamed trainer (the sharded store keeps fp32 or bf16).
StepPlan plan_step(const RunConfig& config, const HardwareProfile& hardware, int64_t world_size = 1,
                   const std::string& source = "megaslide-plan");

// What a LoRA run (lora.rank > 0) trains: its adapters' parameters (StepPlan::lora_params; both Wan2.2 experts'
// with expert both; Wan's sizes from model.wan.weights when set); 0 for full fine-tuning. Throws ConfigError when
// lora.targets match no Linear layer, naming `source` (megaslide-train --dry-run prints it beside train's
// dry_run_json).
int64_t lora_trained_parameters(const RunConfig& config, const std::string& source = "megaslide-plan");

// One JSON object: params, host_state_bytes, device_peak_bytes, h2d_bytes_per_step,
// d2h_bytes_per_step, step_time_lower_bound_s, bottleneck, fits_device, fits_host, and every
// component (docs/planner.md lists the keys); with world_size > 1 also world_size,
// batch_size_per_rank, host_state_bytes_per_rank, exchange_bytes_per_step and the exchange's others.
std::string to_json(const StepPlan& plan);
// A table for people.
std::string to_table(const StepPlan& plan);

}  // namespace megaslide::plan
