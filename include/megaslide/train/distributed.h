// Several processes (ranks) training one model: how a process learns its place from the launcher, the
// process group the ranks talk through, and `megaslide-train --nproc-per-node N`, which starts the local
// ranks itself. The communication is LibTorch's c10d (TCPStore rendezvous, ProcessGroupGloo on the CPU,
// ProcessGroupNCCL on GPUs); nothing here moves bytes by itself. docs/distributed.md.
//
//   LaunchEnv  — rank, world size, local rank and the rendezvous address, read from torchrun's variables
//                (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or Slurm's (SLURM_PROCID,
//                SLURM_NTASKS, SLURM_LOCALID, with MASTER_ADDR/MASTER_PORT from the job script); one
//                process when neither is set.
//   Communicator — one process group: in-place sum all-reduce, barrier. Every rank must make the same
//                calls in the same order. shard_exchange() adds the second group a sharded streamed
//                trainer exchanges block shards through, from its host task thread. A peer that dies or stalls makes
//                the call throw DistributedError within distributed.timeout_s; it never hangs past it.
//
// Thread-safety: one thread drives a Communicator. Tensors passed in are owned by the caller and must
// stay alive and untouched until the call returns (every call here waits for its collective).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/attention/context_parallel.h"
#include "megaslide/config/run_config.h"
#include "megaslide/offload/shard_exchange.h"

namespace megaslide {

// A collective that failed (a peer died, a timeout, a rendezvous that never completed) or a launcher
// environment that does not make sense. The message names the rank and what it was doing.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;        // the process's index on its node: picks its GPU
  int64_t local_world_size = 1;  // ranks on this node (LOCAL_WORLD_SIZE; Slurm's SLURM_NTASKS_PER_NODE or
                                 // SLURM_TASKS_PER_NODE, "2(x3),1" read at SLURM_NODEID); 1 if unknown
  std::string master_addr;       // rank 0's host, where the TCPStore listens
  int64_t master_port = 0;
  std::string launcher = "none";  // none | torchrun | megaslide-train --nproc-per-node | slurm
  // torchrun's elastic agent already serves the rendezvous store at master_port
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 too, joins it as a client.
  bool agent_store = false;
  bool distributed() const { return world_size > 1; }
  // One process and no launcher's store to join: it meets nobody, so its store is in memory (Communicator).
  bool meets_nobody() const { return world_size == 1 && !agent_store; }
};

// Reads the launcher's variables through `getenv` (std::getenv by default). torchrun's take precedence
// over Slurm's. Throws DistributedError naming the variable for a value that is not an integer, a rank
// outside [0, world size), or a multi-rank launch without MASTER_ADDR (Slurm: set it in the job script,
// docs/distributed.md); MASTER_PORT defaults to 29500 as in torchrun.
LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv = nullptr);

// The training device of this rank: with several ranks, train.device auto or cuda means cuda:LOCAL_RANK
// (an explicit cuda:N is kept); otherwise train.device as given.
std::string rank_device_spec(const std::string& train_device, const LaunchEnv& env);

// distributed.backend resolved for a device: auto -> nccl on a GPU, gloo on the CPU. Throws ConfigError
// (key distributed.backend) for nccl on the CPU or in a build without CUDA.
std::string resolve_backend(const DistributedConfig& config, c10::Device device, const std::string& source);

class Communicator {
 public:
  // Rendezvous through a TCPStore at env.master_addr:env.master_port (rank 0 serves it) and build the
  // process group of `backend` (gloo | nccl). Waits for every rank up to `timeout_s`, then throws
  // DistributedError. A group of one process without a launcher's store keeps its store in memory (no socket).
  Communicator(const LaunchEnv& env, const std::string& backend, double timeout_s, c10::Device device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const std::string& backend() const { return backend_; }

  // In place: every tensor becomes the element-wise sum over the ranks (same shapes and dtypes on every
  // rank). NCCL reduces GPU tensors and Gloo CPU tensors; a tensor on the other side goes through a
  // copy.
  void all_reduce_sum(std::vector<at::Tensor>& tensors);
  // In place: the element-wise maximum over the ranks.
  void all_reduce_max(std::vector<at::Tensor>& tensors);
  // Point to point: posts every send (peer rank, tensor) and every receive (peer rank, tensor filled in place)
  // at once, then waits for all of them. Each send meets its peer's receive of the same size and dtype, one
  // message each way per pair and call; tensors contiguous (Gloo: device tensors go through host copies).
  void exchange(const std::vector<std::pair<int64_t, at::Tensor>>& sends,
                const std::vector<std::pair<int64_t, at::Tensor>>& recvs);
  void barrier();
  // Rank 0's `mine` on every rank (through the rendezvous store; rank 0 gets its own back). Every rank
  // calls it at the same point with the same `name`. Throws DistributedError after the timeout.
  std::string text_from_rank0(const std::string& name, const std::string& mine);
  // Runs `work` on rank 0 while the other ranks wait for it, however long it takes (validation videos can
  // outlast a collective's timeout): while `work` runs, rank 0 bumps a heartbeat in the rendezvous store
  // every few seconds; a waiting rank throws DistributedError when the heartbeat stops for
  // distributed.timeout_s (rank 0 died or stalled) or when `work` threw on rank 0 (its message included;
  // rank 0 rethrows what `work` threw). `what` names the work in the errors. Every rank calls it at the
  // same point; rank 0 returns once every rank has come (a barrier).
  void run_on_rank0(const std::string& what, const std::function<void()>& work);
  // Runs `work` on every rank, each taking as long as it takes (a rank's share of a model's construction can be
  // slower than another's: its disk, rank 0's validation encoders), then waits for every other rank's: each rank
  // bumps a heartbeat while its `work` runs; rank 0 gathers the outcomes and tells the others. A rank throws
  // DistributedError when another's heartbeat stops for distributed.timeout_s before it finished, or when another's
  // `work` threw (its rank and message included; an InputError too where that one was); a rank rethrows what its
  // own `work` threw. Every rank calls it at the same point.
  void run_on_every_rank(const std::string& what, const std::function<void()>& work);
  // The block exchange of a streamed trainer sharded over these ranks (offload/shard_exchange.h): its
  // step channel is this communicator; its host channel a second process group, Gloo over TCP with
  // either backend (the block shards live in host memory), made at the first call — a collective:
  // every rank calls it at the same point. It shares this communicator's state and must not outlive it.
  // Throws DistributedError when the rendezvous fails or the build has no Gloo.
  std::shared_ptr<offload::ShardExchange> shard_exchange();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t rank_ = 0, world_size_ = 1;
  std::string backend_;
  double timeout_s_ = 0.0;
  // run_on_rank0 and run_on_every_rank: `work` where it is given (else nothing), then the wait for every other rank's.
  void run_with_heartbeats(const std::string& what, const std::function<void()>& work);
  int64_t heartbeat_runs_ = 0;  // run_on_rank0 and run_on_every_rank calls so far: each call's store keys are its own
  std::shared_ptr<offload::ShardExchange> exchange_;
};

// A context-parallel group of 3D-DSA and Ulysses (attention/context_parallel.h) over a Communicator (which must
// outlive it): its ranks [first, first + size), group rank r being communicator rank first + r (all of them by
// default). The frames go point to point within the group; max() reduces over the whole communicator (at least the
// group's maximum, which is all a halo's width needs; every rank of the communicator calls it at the same point, as
// every group runs the same model), so the groups need no process groups of their own.
class CommunicatorFrames final : public ops::FrameExchange {
 public:
  explicit CommunicatorFrames(Communicator& communicator, int64_t first = 0, int64_t size = -1);
  int64_t rank() const override { return communicator_.rank() - first_; }
  int64_t size() const override { return size_; }
  void exchange(const std::vector<std::pair<int64_t, at::Tensor>>& sends,
                const std::vector<std::pair<int64_t, at::Tensor>>& recvs) override;
  double max(double value) override;

 private:
  Communicator& communicator_;
  int64_t first_ = 0, size_ = 1;
};

// What is wrong with distributed.context_parallel (n) for `world_size` ranks: n must divide them and the heads of
// dense attention (Ulysses: Wan's dense attention, Dense3DDiT; a Wan whose weights give its heads only when
// `token_frames` is given) and, when a sample's token frames are given (`token_frames` >= 0), be at most that many.
// "" when nothing is; the caller reports it under its key.
std::string context_parallel_problem(const RunConfig& config, int64_t world_size, int64_t token_frames = -1);

// What stops `config` from running on `world_size` ranks, as one ConfigError-style pair: the key and the problem
// (key "" when nothing does): int8 moments (unshardable) in the streamed trainer, distributed.context_parallel
// (context_parallel_problem), and a train.batch_size that does not split over the data-parallel groups. run_training
// checks it on every rank; `megaslide-train --nproc-per-node N` once, before it starts the ranks.
std::pair<std::string, std::string> world_size_problem(const RunConfig& config, int64_t world_size);

// Data parallelism's slices of a global batch: throws std::invalid_argument unless 0 <= rank <
// world_size and world_size divides batch_size (train.batch_size, named in the message). Every family's
// batch source checks its take_slice with it.
void check_batch_slice(int64_t batch_size, int64_t rank, int64_t world_size);

// Plain data parallelism of a resident trainer (every rank holds the whole model): after a step's backward
// passes, sums the defined gradients of `parameters` (one all-reduce of one flat buffer) and `loss_sum`
// over the ranks and divides both by their number, so every rank takes the single process's AdamW step
// on the global batch, up to the order of float additions. Throws (c10::Error) when the ranks' numbers
// of defined gradients differ. `device`: where the scalars are reduced (NCCL reduces GPU tensors only).
// Returns the bytes of the gradients' buffer the all-reduce took (the step's exchange_bytes).
int64_t average_gradients_over_ranks(Communicator& communicator, const std::vector<at::Tensor>& parameters,
                                     double& loss_sum, c10::Device device);

// megaslide-train --nproc-per-node N: runs `argv` (the program's own path first) N times as local ranks
// 0..N-1 of a one-node job (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
// MASTER_PORT=`master_port`, or a free port when 0; MEGASLIDE_LOCAL_LAUNCH=1, which tells a rank it was
// started here) and waits. SIGINT/SIGTERM are passed on to every
// rank. When a rank fails the others get SIGTERM, then SIGKILL after `grace_s`. Returns the first failing
// rank's exit code (128 + signal for a rank killed by a signal), else 0. Never returns in the children.
int launch_local_ranks(const std::vector<std::string>& argv, int64_t nproc, int64_t master_port, double grace_s = 10.0);

// Whether this build has the Gloo backend (built where Gloo's headers were found: docs/building.md).
bool gloo_available();

// Whether this build has the NCCL backend (CUDA compiled in and NCCL's header found: docs/building.md).
bool nccl_available();
// "MAJOR.MINOR.PATCH" of the nccl.h this build was compiled with, and of the NCCL library LibTorch has
// loaded (empty when there is none, or no NCCL in this build).
std::string nccl_header_version();
std::string nccl_loaded_version();
// Empty when the two agree in major and minor version (or one is unknown); else the error to report:
// ProcessGroupNCCL::Options::create() is inline, so a header of another NCCL sizes ncclConfig_t
// differently from the library that fills it.
std::string nccl_version_mismatch();

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then closed).
int64_t free_local_port();

}  // namespace megaslide
