// StepPlan: what one training step of a run config needs and moves, computed without allocating
// anything (the model is built on the meta device), and the lower bound on its time on a given
// machine (DESIGN.md §6; `megaslide-plan`, docs/planner.md).
//
// Exact (equal to what the trainer allocates and measures, tested against CPUMasterVideoDiT):
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
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/plan/hardware_profile.h"

namespace megaslide::plan {

// Host RAM of the streamed trainer, bytes (docs/offload.md's budget per parameter, line by line).
struct HostMemoryPlan {
  int64_t master = 0;                 // fp32
  int64_t exp_avg = 0, exp_avg_sq = 0;  // optimizer.state_dtype: fp32, bf16 or int8
  int64_t scales = 0;                 // int8 state: fp32 scale per 256 elements of each parameter, m and v
  int64_t compute = 0;                // the transfer buffer: compute copy, and the gradient at accumulation 1
  int64_t grad = 0;                   // fp32 gradient sums, accumulation only
  int64_t staging = 0;                // accumulation: two D2H landing buffers of one block (pinned)
  int64_t pinned = 0;                 // page-locked where CUDA runs: the transfer buffer (and an
                                      // uploaded fp32 master), the staging buffers
  // While the trainer is built: the store next to the fp32 initial weights of the blocks being loaded
  // into it (two at a time); no full-model copy exists.
  int64_t construction_peak = 0;
  int64_t state() const { return master + exp_avg + exp_avg_sq + scales + compute + grad; }  // HostParamStore
  int64_t steady() const { return state() + staging; }
  int64_t peak() const { return construction_peak > steady() ? construction_peak : steady(); }
};

// Device memory, bytes (the allocator's view: what peak_device_bytes measures on a GPU).
struct DeviceMemoryPlan {
  int64_t weight_slots = 0;          // 2 x largest block, compute dtype
  int64_t gradient_slots = 0;        // 2 x largest block, compute dtype
  int64_t resident_state = 0;        // prologue + epilogue + caption encoder: fp32 weights, grad, m, v
  int64_t checkpoints = 0;           // every block's input kept by the forward, plus the last output
  int64_t block_inputs = 0;          // shared block inputs (t_mod, text) in the compute dtype, with grads
  int64_t prologue_epilogue = 0;     // fp32 activations of the resident parts (batch, x_0, the head's graph)
  int64_t recompute_saved = 0;       // tensors autograd keeps while one block is recomputed with grad
  int64_t recompute_workspace = 0;   // its backward's transients (3D-DSA fused: fp32 dk/dv scratch)
  int64_t recompute_saved_reference = 0;  // 3D-DSA only: the same with the grid_sample reference
  int64_t recompute_workspace_reference = 0;
  int64_t peak() const {
    return weight_slots + gradient_slots + resident_state + checkpoints + block_inputs + prologue_epilogue +
           recompute_saved + recompute_workspace;
  }
  // What StreamedStackTrainer reports as peak_device_bytes when the device is the CPU.
  int64_t trainer_cpu_accounting() const { return weight_slots + gradient_slots + resident_state + checkpoints; }
};

struct TransferPlan {
  int64_t h2d_bytes = 0, d2h_bytes = 0;  // per optimizer step (all micro-batches)
  int64_t h2d_copies = 0, d2h_copies = 0, cache_hits = 0;
};

struct TimePlan {
  double model_flops = 0.0;     // model_flops_per_step (the MFU numerator)
  double executed_flops = 0.0;  // plus the checkpointing recompute (a second forward of the blocks)
  int64_t optimizer_bytes = 0;  // host memory traffic of CpuAdamW and gradient accumulation per step
  double compute_s = 0.0, h2d_s = 0.0, d2h_s = 0.0, optimizer_s = 0.0;
  double lower_bound_s = 0.0;
  std::string bottleneck;      // "compute" | "h2d" | "d2h" | "host optimizer"
  bool overlapped = true;      // async: the bound is the max; sync: the sum
  double mfu_upper_bound = 0.0;  // model_flops / (lower_bound_s · peak)
};

struct StepPlan {
  // The run.
  std::string arch;
  bool streamed = true;  // offload.enabled
  std::string compute_dtype, mode;
  std::string state_dtype;  // optimizer.state_dtype (fp32 for the resident loop)
  int64_t layers = 0, hidden = 0, batch_size = 0, grad_accum_steps = 0, tokens_per_sample = 0;
  std::vector<int64_t> token_grid;  // t, h, w
  // Parameters.
  int64_t params = 0;               // the DiT (as megaslide-train --dry-run)
  int64_t text_encoder_params = 0;  // the caption encoder (resident)
  int64_t streamed_params = 0;      // every block
  int64_t resident_params = 0;      // prologue + epilogue + caption encoder
  int64_t params_per_block = 0;     // largest block
  HardwareProfile hardware;
  HostMemoryPlan host;
  DeviceMemoryPlan device;
  TransferPlan transfer;
  TimePlan time;
  bool fits_device = false, fits_host = false;
  std::vector<std::string> advice;  // what to change when it does not fit (empty when it does)
};

// The plan of `config` on `hardware`. Throws ConfigError for an invalid config.
StepPlan plan_step(const RunConfig& config, const HardwareProfile& hardware);

// One JSON object: params, host_state_bytes, device_peak_bytes, h2d_bytes_per_step,
// d2h_bytes_per_step, step_time_lower_bound_s, bottleneck, fits_device, fits_host, and every
// component (docs/planner.md lists the keys).
std::string to_json(const StepPlan& plan);
// A table for people.
std::string to_table(const StepPlan& plan);

}  // namespace megaslide::plan
