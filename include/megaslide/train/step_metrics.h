// What one training step measured (train/trainer.h): the metrics.jsonl line, the progress line and the
// TensorBoard scalars of a run (train/run_outputs.h), read back by the plots (eval/run_plots.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace megaslide {

struct StepMetrics {
  int64_t step = 0;   // 1-based: the number of optimizer steps taken so far
  double loss = 0.0;  // mean over the step's micro-batches
  double lr = 0.0;
  double grad_norm = 0.0;  // global L2 norm before clipping (of the unscaled gradient)
  double step_time_s = 0.0;
  double tokens_per_s = 0.0;
  double samples_per_s = 0.0;
  // Streamed trainer only (zero for the resident loop, which moves nothing), except optimizer_s:
  int64_t h2d_bytes = 0;            // weights copied host -> device this step
  int64_t d2h_bytes = 0;            // gradients copied device -> host this step
  double exposed_transfer_s = 0.0;  // time the compute stream waited on copies (CPU: the copies' own time)
  double optimizer_wait_s = 0.0;    // time the compute side waited for a block's host update
  double optimizer_s = 0.0;         // streamed: host AdamW time (all CpuAdamW calls that finished during this step);
                                    // resident: gradient clipping + torch::optim::AdamW step on the device
  int64_t peak_device_bytes = 0;    // GPU: allocator peak this step (streamed); CPU: the trainer's own accounting
  double mfu = 0.0;                 // GPU only: model FLOPs / (step time x peak); 0 elsewhere
  double loss_scale = 0.0;          // fp16 only: the loss scale used this step
  bool skipped = false;             // a non-finite loss or gradient (fp16: an overflow) skipped the update
  int64_t skipped_total = 0;        // steps skipped so far in the run
  int64_t consecutive_skips = 0;    // skipped steps in a row, ending with this one
  double data_wait_s = 0.0;         // time the step waited for its data (the loader, or rendering in line)
  // The streamed trainer sharded over several ranks: bytes this rank handed to the block exchange
  // (reduce-scatter + all-gather) and its host thread's seconds in those collectives; 0 otherwise.
  int64_t exchange_bytes = 0;
  double exchange_s = 0.0;
  // The streamed trainer on the NVMe tier (offload.state_tier: nvme): the step's reads and write-backs of the
  // blocks' state (bytes, and the I/O thread's seconds at them) and the seconds updates waited for a read.
  bool nvme = false;
  int64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  double nvme_read_s = 0.0, nvme_write_s = 0.0, nvme_wait_s = 0.0;
  // A model trained one part per step (FamilyModel::parts: Wan2.2's experts): the part this step trained.
  std::string part;
  // train.val_every: the validation loss of the weights after this step (docs/training.md, "Validation loss");
  // absent on the other steps.
  std::optional<double> val_loss;
};

}  // namespace megaslide
