#include "megaslide/train/distributed.h"

// The c10d headers declare ProcessGroupGloo / ProcessGroupNCCL only under USE_C10D_GLOO / USE_C10D_NCCL,
// which LibTorch's CMake flags define (the wheel's libraries hold both). ProcessGroupGloo.hpp includes
// Gloo's own headers (Debian's libgloo-dev: declarations only; the code is the wheel's): a build without
// them (MEGASLIDE_WITH_GLOO unset) has NCCL only.
#ifdef MEGASLIDE_WITH_GLOO
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
// ProcessGroupNCCL.hpp includes nccl.h: MEGASLIDE_WITH_NCCL is set (src/CMakeLists.txt) only where CUDA is
// compiled in and the header of the NCCL that LibTorch loads was found; Communicator checks at run time
// that the two agree (nccl_version_mismatch).
#ifdef MEGASLIDE_WITH_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <dlfcn.h>
#endif

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>
#include <fmt/format.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <cstdlib>
#include <exception>
#include <thread>

#include "megaslide/util/errors.h"

namespace megaslide {

namespace {

int64_t env_integer(const char* name, const char* value) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used == std::string(value).size()) return v;
  } catch (const std::exception&) {
  }
  throw DistributedError(fmt::format("launch environment: {}={} is not an integer", name, value));
}

// Slurm's tasks per node in its compressed form, "2(x3),1" = {2, 2, 2, 1}; empty when the text is not
// of that form.
std::vector<int64_t> slurm_tasks_per_node(const std::string& text) {
  std::vector<int64_t> out;
  size_t i = 0;
  auto number = [&](int64_t& value) {
    const size_t start = i;
    value = 0;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) && i - start < 9)
      value = value * 10 + (text[i++] - '0');
    return i > start && (i == text.size() || !std::isdigit(static_cast<unsigned char>(text[i])));
  };
  while (i < text.size()) {
    int64_t count = 0, repeat = 1;
    if (!number(count) || count < 1) return {};
    if (text.compare(i, 2, "(x") == 0) {
      i += 2;
      if (!number(repeat) || repeat < 1 || i >= text.size() || text[i] != ')') return {};
      ++i;
    }
    if (out.size() + static_cast<size_t>(repeat) > 100000) return {};
    out.insert(out.end(), static_cast<size_t>(repeat), count);
    if (i < text.size() && text[i++] != ',') return {};
    if (i == text.size() && text.back() == ',') return {};
  }
  return out;
}

}  // namespace

LaunchEnv read_launch_env(const std::function<const char*(const char*)>& getenv_fn) {
  auto get = [&](const char* name) -> const char* {
    const char* v = getenv_fn ? getenv_fn(name) : std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  auto integer = [&](const char* name, int64_t fallback) {
    const char* v = get(name);
    return v == nullptr ? fallback : env_integer(name, v);
  };
  LaunchEnv env;
  const char *rank_name = "RANK", *world_name = "WORLD_SIZE";
  if (get("RANK") != nullptr || get("WORLD_SIZE") != nullptr) {
    // The same variables from megaslide-train --nproc-per-node (which marks its children) or torchrun.
    env.launcher = get("MEGASLIDE_LOCAL_LAUNCH") != nullptr ? "megaslide-train --nproc-per-node" : "torchrun";
    const char* agent = get("TORCHELASTIC_USE_AGENT_STORE");
    env.agent_store = agent != nullptr && (std::string(agent) == "True" || std::string(agent) == "1");
    if (get("RANK") == nullptr || get("WORLD_SIZE") == nullptr)
      throw DistributedError("launch environment: RANK and WORLD_SIZE must be set together (torchrun sets both)");
    env.rank = integer("RANK", 0);
    env.world_size = integer("WORLD_SIZE", 1);
    env.local_rank = integer("LOCAL_RANK", env.rank);
    env.local_world_size = integer("LOCAL_WORLD_SIZE", 1);
  } else if (get("SLURM_PROCID") != nullptr && get("SLURM_NTASKS") != nullptr) {
    env.launcher = "slurm";
    rank_name = "SLURM_PROCID", world_name = "SLURM_NTASKS";
    env.rank = integer("SLURM_PROCID", 0);
    env.world_size = integer("SLURM_NTASKS", 1);
    env.local_rank = integer("SLURM_LOCALID", 0);
    // Tasks on this node: SLURM_NTASKS_PER_NODE (set with --ntasks-per-node), else SLURM_TASKS_PER_NODE
    // (always set), both in Slurm's compressed form ("2(x3),1"); this node's entry by SLURM_NODEID, or the
    // count every node shares. Unreadable: 1 (the ranks' thread and memory budgets then count one rank
    // per machine).
    const int64_t node = get("SLURM_NODEID") != nullptr ? integer("SLURM_NODEID", -1) : -1;
    for (const char* name : {"SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      const auto counts = get(name) != nullptr ? slurm_tasks_per_node(get(name)) : std::vector<int64_t>{};
      if (counts.empty()) continue;
      if (node >= 0 && node < static_cast<int64_t>(counts.size())) {
        env.local_world_size = counts[static_cast<size_t>(node)];
        break;
      }
      if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts.front(); })) {
        env.local_world_size = counts.front();
        break;
      }
    }
  } else {
    return env;
  }
  if (env.world_size < 1)
    throw DistributedError(fmt::format("launch environment: {}={} must be at least 1", world_name, env.world_size));
  if (env.rank < 0 || env.rank >= env.world_size)
    throw DistributedError(fmt::format("launch environment: {}={} is outside [0, {}={})", rank_name, env.rank,
                                       world_name, env.world_size));
  if (env.local_rank < 0)
    throw DistributedError(fmt::format("launch environment: the local rank {} is negative", env.local_rank));
  env.master_port = integer("MASTER_PORT", 29500);
  if (env.master_port < 1 || env.master_port > 65535)
    throw DistributedError(fmt::format("launch environment: MASTER_PORT={} is not a TCP port", env.master_port));
  if (const char* addr = get("MASTER_ADDR")) env.master_addr = addr;
  else if (env.world_size == 1) env.master_addr = "127.0.0.1";
  else
    throw DistributedError(fmt::format(
        "launch environment: {} ranks ({}) but MASTER_ADDR is not set: it names rank 0's host{}", env.world_size,
        env.launcher,
        env.launcher == "slurm"
            ? " (in the job script: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1))"
            : ""));
  return env;
}

std::string rank_device_spec(const std::string& train_device, const LaunchEnv& env) {
  if (!env.distributed()) return train_device;
  if (train_device == "cuda" || (train_device == "auto" && torch::cuda::is_available()))
    return fmt::format("cuda:{}", env.local_rank);
  return train_device == "auto" ? "cpu" : train_device;
}

std::string resolve_backend(const DistributedConfig& config, c10::Device device, const std::string& source) {
  const std::string backend = config.backend == "auto" ? (device.is_cuda() ? "nccl" : "gloo") : config.backend;
  if (backend == "gloo" && !gloo_available())
    throw ConfigError(
        source, "distributed.backend",
        "gloo is not in this build (Gloo's headers, Debian's libgloo-dev, were missing when it was built)" +
            std::string(device.is_cuda() ? "; use nccl or auto" : ""));
  if (backend == "nccl") {
    if (!nccl_available())
      throw ConfigError(
          source, "distributed.backend",
          "nccl is not in this build (it needs CUDA and NCCL's header, nccl.h, when it is built); use gloo or auto");
    if (!device.is_cuda())
      throw ConfigError(source, "distributed.backend",
                        "nccl reduces GPU tensors but train.device is " + device.str() + "; use gloo or auto");
  }
  return backend;
}

#ifdef MEGASLIDE_WITH_GLOO
namespace {
// The address other ranks reach this one at: this host's name, or loopback on one machine.
std::shared_ptr<::gloo::transport::Device> gloo_device(const LaunchEnv& env) {
  return env.master_addr == "127.0.0.1" || env.master_addr == "localhost"
             ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
             : c10d::ProcessGroupGloo::createDefaultDevice();
}
}  // namespace
#endif

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> group;
  LaunchEnv env;
  c10::Device device = c10::kCPU;
};

Communicator::Communicator(const LaunchEnv& env, const std::string& backend, double timeout_s, c10::Device device)
    : impl_(std::make_unique<Impl>()),
      rank_(env.rank),
      world_size_(env.world_size),
      backend_(backend),
      timeout_s_(timeout_s) {
  impl_->env = env;
  impl_->device = device;
  // A rank's GPU is its current device, whichever backend: LibTorch's calls that name none (the trainer's
  // synchronize, the timing of steps, the NCCL group) then use it, not GPU 0.
  if (device.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  try {
    if (env.meets_nobody()) {
      // A group of one process meets nobody: its store is in memory. (A TCPStore's every connection has LibTorch
      // look up the peer's host name, and a resolver that drops queries coming fast stalled one rendezvous in
      // about 35 of a tight loop for its 5 s timeout.)
      c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
      store->setTimeout(timeout);
      impl_->store = std::move(store);
    } else {
      c10d::TCPStoreOptions options;
      options.port = static_cast<uint16_t>(env.master_port);
      // Under torchrun the agent's store already listens on the port (rank 0 binding it as well failed with a
      // warning on every run): join it.
      options.isServer = env.rank == 0 && !env.agent_store;
      options.numWorkers = static_cast<size_t>(env.world_size);
      options.waitWorkers = true;
      options.timeout = timeout;
      impl_->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    }
    if (env.agent_store) {
      // The agent's store outlives a restart of the ranks: this attempt's keys under their own prefix.
      const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
      impl_->store = c10::make_intrusive<c10d::PrefixStore>(
          std::string("megaslide/attempt-") + (restarts ? restarts : "0"), impl_->store);
    }
    if (backend == "gloo") {
#ifdef MEGASLIDE_WITH_GLOO
      auto gloo = c10d::ProcessGroupGloo::Options::create(timeout);
      gloo->devices.push_back(gloo_device(env));
      impl_->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, static_cast<int>(env.rank),
                                                                 static_cast<int>(env.world_size), gloo);
#else
      throw DistributedError(
          "this build has no Gloo backend (Gloo's headers, Debian's libgloo-dev, were missing when it was built); use "
          "nccl");
#endif
    } else if (backend == "nccl") {
#ifdef MEGASLIDE_WITH_NCCL
      TORCH_CHECK(device.is_cuda(), "the nccl backend needs a GPU device, got ", device.str());
      if (const std::string why = nccl_version_mismatch(); !why.empty()) throw DistributedError(why);
      c10::cuda::set_device(device.index());
      // NCCL's Work::wait only orders the current stream after the operation: without blocking waits a rank that
      // stopped (an error, a kill) leaves the others blocked at their next host read until NCCL's watchdog ends
      // the process, without the DistributedError naming the failure (run_all_reduce, exchange, barrier). With
      // them wait() blocks and throws on a timeout or a failed peer. Read when the group is built; a value the
      // user set is kept.
      ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
      auto nccl = c10d::ProcessGroupNCCL::Options::create();
      nccl->timeout = timeout;
      impl_->group = c10::make_intrusive<c10d::ProcessGroupNCCL>(impl_->store, static_cast<int>(env.rank),
                                                                 static_cast<int>(env.world_size), nccl);
#else
      throw DistributedError(
          "this build has no nccl backend (it needs CUDA and NCCL's header, nccl.h, when it is built)");
#endif
    } else {
      throw DistributedError("unknown distributed backend '" + backend + "' (expected gloo or nccl)");
    }
  } catch (const DistributedError&) {
    throw;
  } catch (const std::exception& e) {
    if (env.meets_nobody())
      throw DistributedError(
          fmt::format("rank 0 of 1: building the {} group of one process failed: {}", backend, error_message(e)));
    throw DistributedError(
        fmt::format("rank {} of {}: rendezvous at {}:{} ({}) failed within distributed.timeout_s ({} s): {}", env.rank,
                    env.world_size, env.master_addr, env.master_port, backend, timeout_s, error_message(e)));
  }
}

Communicator::~Communicator() {
  // A process group with communicators of its own (NCCL's) is shut down before it is destroyed, as
  // LibTorch asks: normally by shutdown(), which may wait for the other ranks; while an exception unwinds
  // (a rank failed, the others may be gone) by abort(), which does not wait.
  if (impl_ && impl_->group) {
    try {
      if (std::uncaught_exceptions() > 0) impl_->group->abort();
      else impl_->group->shutdown();
    } catch (const std::exception&) {
      // Nothing to do at teardown: the process is ending its use of the group either way.
    }
  }
}

namespace {

std::vector<uint8_t> store_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
std::string store_text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

}  // namespace

std::string Communicator::text_from_rank0(const std::string& name, const std::string& mine) {
  if (world_size_ == 1) return mine;
  const std::string key = "megaslide/rank0-text/" + name;
  try {
    if (rank_ == 0) {
      impl_->store->set(key, store_bytes(mine));
      return mine;
    }
    return store_text(impl_->store->get(key));
  } catch (const std::exception& e) {
    throw DistributedError(
        fmt::format("rank {} of {}: exchanging {} with rank 0 failed within distributed.timeout_s ({} s): {}", rank_,
                    world_size_, name, timeout_s_, error_message(e)));
  }
}

void Communicator::run_on_rank0(const std::string& what, const std::function<void()>& work) {
  if (world_size_ == 1) return work();
  run_with_heartbeats(what, rank_ == 0 ? work : std::function<void()>());
}

void Communicator::run_on_every_rank(const std::string& what, const std::function<void()>& work) {
  if (world_size_ == 1) return work();
  run_with_heartbeats(what, work);
}

namespace {

// A key of the store bumped every `every` from a thread of its own until stop(): how the other ranks see that this one
// is alive while it works or waits.
class Heartbeat {
 public:
  Heartbeat(c10d::Store& store, std::string key, std::chrono::milliseconds every)
      : thread_([this, &store, key = std::move(key), every] {
          for (int64_t n = 1;; ++n) {
            // A failed beat is retried at the next one (a store that fails for good fails the waiting ranks too).
            try {
              store.set(key, store_bytes(std::to_string(n)));
              std::lock_guard<std::mutex> lock(mutex_);
              error_.clear();
            } catch (const std::exception& e) {
              std::lock_guard<std::mutex> lock(mutex_);
              error_ = error_message(e);
            } catch (...) {
              std::lock_guard<std::mutex> lock(mutex_);
              error_ = "an exception that is not a std::exception";
            }
            std::unique_lock<std::mutex> lock(mutex_);
            if (wake_.wait_for(lock, every, [&] { return stop_; })) return;
          }
        }) {}
  ~Heartbeat() { stop(); }
  // Ends the beats; returns why the last one failed ("" when it did not).
  std::string stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
    return error_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::string error_;
  std::thread thread_;  // last: started once the members it uses exist
};

// Another rank's failure, told to this one: an input error (exit 2) where that rank's was one.
class RankInputError final : public DistributedError, public InputError {
 public:
  using DistributedError::DistributedError;
};

// A rank's outcome in the store: "ok", or "E" / "I" (an input error) and the message.
std::string outcome_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return (is_input_error(e) ? "I" : "E") + error_message(e);
  } catch (...) {
    return "Ean exception that is not a std::exception";
  }
}

}  // namespace

// Each rank bumps its heartbeat while its `work` runs (rank 0 for the whole call), then writes its outcome. Rank 0
// gathers them — waiting for each rank while its heartbeat moves — and writes the call's outcome: ok, the first
// failure it found, or a rank that stopped answering. The other ranks wait for that one key while rank 0's heartbeat
// moves, so the store's traffic grows with the ranks, not their square. On a failure rank 0, which may hold the store,
// stays until every rank has read it, failed itself, or stopped answering.
void Communicator::run_with_heartbeats(const std::string& what, const std::function<void()>& work) {
  const std::string key = fmt::format("megaslide/rank-work/{}", heartbeat_runs_++);
  const auto rank_key = [&](int64_t r, const char* name) { return fmt::format("{}/{}/{}", key, name, r); };
  const std::string outcome_key = key + "/outcome";
  // Beats often enough that a waiting rank sees several within its timeout.
  const auto beat_every =
      std::chrono::milliseconds(std::clamp<int64_t>(static_cast<int64_t>(timeout_s_ * 1000.0 / 8.0), 10, 5000));
  const auto poll = std::min<std::chrono::milliseconds>(beat_every, std::chrono::milliseconds(500));
  auto& store = *impl_->store;
  const auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  // A rank's heartbeat as a waiting rank follows it: unchanged for timeout_s, the rank stopped answering.
  struct Watched {
    std::string beat;
    std::chrono::steady_clock::time_point changed = std::chrono::steady_clock::now();
  };
  const auto still = [&](int64_t r, Watched& w) {
    if (store.check({rank_key(r, "beat")})) {
      std::string now = store_text(store.get(rank_key(r, "beat")));
      if (now != w.beat) w.beat = std::move(now), w.changed = std::chrono::steady_clock::now();
    }
    return seconds_since(w.changed) > timeout_s_;
  };

  std::optional<Heartbeat> beat;
  if (work || rank_ == 0) beat.emplace(store, rank_key(rank_, "beat"), beat_every);
  std::exception_ptr failure;
  std::string mine = "ok";
  if (work) {
    try {
      work();
    } catch (...) {
      failure = std::current_exception();
      mine = outcome_of(failure);
    }
  }
  // The call's outcome as this rank reports it: "rank R of W: <outcome> (<what>)", an input error where it was one.
  const auto throw_outcome = [&](const std::string& outcome) {
    const std::string message = fmt::format("rank {} of {}: {} ({})", rank_, world_size_, outcome.substr(1), what);
    if (outcome[0] == 'I') throw RankInputError(message);
    throw DistributedError(message);
  };

  if (rank_ != 0) {
    if (beat)
      if (const std::string error = beat->stop(); !error.empty() && !failure)
        mine = "Eits heartbeat failed: " + error;  // rank 0 would take it for a rank that stopped answering
    try {
      store.set(rank_key(rank_, "done"), store_bytes(mine));
    } catch (const std::exception& e) {
      if (failure) std::rethrow_exception(failure);
      throw DistributedError(fmt::format("rank {} of {}: telling rank 0 that {} finished failed: {}", rank_,
                                         world_size_, what, error_message(e)));
    }
    if (failure) std::rethrow_exception(failure);  // its own failure is what it reports; rank 0 tells the others
    try {
      Watched rank0;
      while (true) {
        if (store.check({outcome_key})) {
          const std::string outcome = store_text(store.get(outcome_key));
          if (outcome == "ok") return;
          try {
            store.set(rank_key(rank_, "seen"), store_bytes("1"));
          } catch (const std::exception&) {
            // The outcome is what to report.
          }
          throw_outcome(outcome);
        }
        if (still(0, rank0))
          throw DistributedError(fmt::format(
              "rank {} of {}: rank 0 stopped answering during {} (no heartbeat for distributed.timeout_s = {} s)",
              rank_, world_size_, what, timeout_s_));
        std::this_thread::sleep_for(poll);
      }
    } catch (const DistributedError&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("rank {} of {}: waiting for rank 0's {} failed (rank 0 stopped?): {}", rank_,
                                         world_size_, what, error_message(e)));
    }
  }

  // Rank 0: every other rank's outcome, each waited for while its heartbeat moves; the first failure is the call's.
  std::string outcome = failure ? mine.substr(0, 1) + "rank 0 failed: " + mine.substr(1) : "ok";
  // Each other rank as rank 0 follows it through both phases: its heartbeat, and its outcome once written.
  struct Rank {
    int64_t rank;
    Watched watched;
    std::optional<std::string> done;
    bool stopped = false;  // declared stopped answering
  };
  std::vector<Rank> ranks;
  for (int64_t r = 1; r < world_size_; ++r) ranks.push_back({r, Watched{}, std::nullopt});
  const auto read_done = [&](Rank& r) {
    if (!r.done && store.check({rank_key(r.rank, "done")})) r.done = store_text(store.get(rank_key(r.rank, "done")));
    return r.done.has_value();
  };
  try {
    for (bool pending = true; outcome == "ok" && pending;) {
      pending = false;
      for (auto& r : ranks) {
        if (outcome != "ok") break;
        if (read_done(r)) {
          if (*r.done != "ok")
            outcome = r.done->substr(0, 1) + fmt::format("rank {} failed: {}", r.rank, r.done->substr(1));
        } else if (still(r.rank, r.watched)) {
          r.stopped = true;
          outcome = fmt::format("Erank {} stopped answering during {} (no heartbeat for distributed.timeout_s = {} s)",
                                r.rank, what, timeout_s_);
        } else {
          pending = true;
        }
      }
      if (outcome == "ok" && pending) std::this_thread::sleep_for(poll);
    }
    store.set(outcome_key, store_bytes(outcome));
    const auto told_at = std::chrono::steady_clock::now();
    if (outcome != "ok") {
      // Stay (the store may be this process's) until each other rank has read the outcome, failed itself, or stopped
      // answering (its heartbeat still for timeout_s while it works; a rank that finished reads within a poll).
      const auto told = [&](Rank& r) {
        if (r.stopped) return true;
        if (read_done(r)) {
          return *r.done != "ok" || store.check({rank_key(r.rank, "seen")}) || seconds_since(told_at) > timeout_s_;
        }
        return r.stopped = still(r.rank, r.watched);
      };
      for (bool pending = true; pending;) {
        pending = false;
        for (auto& r : ranks) pending = !told(r) || pending;
        if (pending) std::this_thread::sleep_for(poll);
      }
    }
  } catch (const std::exception& e) {
    if (failure) std::rethrow_exception(failure);
    throw DistributedError(
        fmt::format("rank 0 of {}: waiting for the other ranks' {} failed: {}", world_size_, what, error_message(e)));
  }
  const std::string beat_error = beat->stop();
  if (failure) std::rethrow_exception(failure);
  if (outcome != "ok") throw_outcome(outcome);
  if (!beat_error.empty())
    throw DistributedError(fmt::format("rank 0 of {}: the heartbeat of {} failed: {}", world_size_, what, beat_error));
}

namespace {

// LibTorch 2.11's flight recorder (c10d::FlightRecorder, one per process) files a Gloo group under its id in a map
// before it takes its own lock, when the group enqueues its first collective: two groups of one process enqueueing
// at once (a rank's step group and its block exchange's group, or ranks run as threads) corrupt that map — a crash
// or an endless loop in its tree. A Gloo call only enqueues its work (the group's own threads run it), so each is
// issued under this one lock and waited for outside it. (NCCL's recorder is another one, with one group a process.)
std::mutex& gloo_enqueue_mutex() {
  static std::mutex mutex;
  return mutex;
}

template <typename Issue>
c10::intrusive_ptr<c10d::Work> issue(bool gloo, Issue&& call) {
  if (!gloo) return call();
  std::lock_guard<std::mutex> lock(gloo_enqueue_mutex());
  return call();
}

void run_all_reduce(c10d::Backend& group, const std::string& backend, c10::Device device,
                    std::vector<at::Tensor>& tensors, c10d::ReduceOp op, const char* what, int64_t rank,
                    int64_t world_size, double timeout_s) {
  try {
    for (auto& t : tensors) {
      const bool staged = t.is_cpu() != (backend == "gloo");
      std::vector<at::Tensor> io{staged ? t.to(backend == "gloo" ? c10::Device(at::kCPU) : device) : t};
      c10d::AllreduceOptions options;
      options.reduceOp = op;
      issue(backend == "gloo", [&] { return group.allreduce(io, options); })->wait();
      if (staged) t.copy_(io[0]);
    }
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format(
        "rank {} of {}: {} failed (a rank stopped, or none answered within distributed.timeout_s = {} s): {}", rank,
        world_size, what, timeout_s, error_message(e)));
  }
}

}  // namespace

void Communicator::all_reduce_sum(std::vector<at::Tensor>& tensors) {
  run_all_reduce(*impl_->group, backend_, impl_->device, tensors, c10d::ReduceOp::SUM, "all-reduce (sum)", rank_,
                 world_size_, timeout_s_);
}

void Communicator::all_reduce_max(std::vector<at::Tensor>& tensors) {
  run_all_reduce(*impl_->group, backend_, impl_->device, tensors, c10d::ReduceOp::MAX, "all-reduce (max)", rank_,
                 world_size_, timeout_s_);
}

void Communicator::exchange(const std::vector<std::pair<int64_t, at::Tensor>>& sends,
                            const std::vector<std::pair<int64_t, at::Tensor>>& recvs) {
  const bool gloo = backend_ == "gloo";
  const auto staged = [&](const at::Tensor& t) { return t.is_cpu() != gloo; };
  const c10::Device side = gloo ? c10::Device(at::kCPU) : impl_->device;
  // NCCL runs each send and receive as an operation of its own, and a send waits on the GPU until its peer's
  // receive runs: two ranks that each send to the other before receiving (a halo exchange, Ulysses' all-to-all)
  // would wait for each other until the watchdog's timeout. Coalesced, the exchange's sends and receives run as
  // one operation (what torch's batch_isend_irecv does). Gloo buffers its sends and does not coalesce.
  const bool coalesce = impl_->group->supportsCoalescing();
  try {
    // Every check and staging copy before the first operation: nothing can throw inside a coalesced group but the
    // operations themselves (a group left open would swallow the thread's next collective).
    std::vector<std::vector<at::Tensor>> sent, received;
    sent.reserve(sends.size());
    received.reserve(recvs.size());
    for (const auto& [peer, t] : sends) {
      TORCH_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, "Communicator::exchange: no peer ", peer);
      sent.push_back({staged(t) ? t.to(side).contiguous() : t.contiguous()});
    }
    for (const auto& [peer, t] : recvs) {
      TORCH_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, "Communicator::exchange: no peer ", peer);
      TORCH_CHECK(t.is_contiguous(), "Communicator::exchange: a receive buffer must be contiguous");
      received.push_back({staged(t) ? at::empty(t.sizes(), t.options().device(side)) : t});
    }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    if (coalesce) impl_->group->startCoalescing();
    try {
      for (size_t i = 0; i < sends.size(); ++i)
        works.push_back(issue(gloo, [&] { return impl_->group->send(sent[i], static_cast<int>(sends[i].first), 0); }));
      for (size_t i = 0; i < recvs.size(); ++i)
        works.push_back(
            issue(gloo, [&] { return impl_->group->recv(received[i], static_cast<int>(recvs[i].first), 0); }));
    } catch (...) {
      if (coalesce) impl_->group->endCoalescing();  // the group closed before the error goes on
      throw;
    }
    if (coalesce) {
      auto group = impl_->group->endCoalescing();
      TORCH_CHECK(group || (sends.empty() && recvs.empty()),
                  "Communicator::exchange: the backend's coalesced group returned no work to wait for");
      works.push_back(std::move(group));
    }
    for (auto& w : works)
      if (w) w->wait();  // a coalesced operation's own work is null: the group's is the last
    for (size_t i = 0; i < recvs.size(); ++i)
      if (staged(recvs[i].second)) recvs[i].second.copy_(received[i][0]);
  } catch (const std::exception& e) {
    throw DistributedError(
        fmt::format("rank {} of {}: a point-to-point exchange failed (a rank stopped, or none answered within "
                    "distributed.timeout_s = {} s): {}",
                    rank_, world_size_, timeout_s_, error_message(e)));
  }
}

CommunicatorFrames::CommunicatorFrames(Communicator& communicator, int64_t first, int64_t size)
    : communicator_(communicator), first_(first), size_(size < 0 ? communicator.world_size() : size) {
  TORCH_CHECK(first_ >= 0 && size_ >= 1 && first_ + size_ <= communicator.world_size() && rank() >= 0 && rank() < size_,
              "CommunicatorFrames: ranks [", first_, ", ", first_ + size_, ") of ", communicator.world_size(),
              " do not hold rank ", communicator.rank());
}

void CommunicatorFrames::exchange(const std::vector<std::pair<int64_t, at::Tensor>>& sends,
                                  const std::vector<std::pair<int64_t, at::Tensor>>& recvs) {
  if (first_ == 0) return communicator_.exchange(sends, recvs);
  auto shifted = [&](const std::vector<std::pair<int64_t, at::Tensor>>& list) {
    auto out = list;
    for (auto& [peer, tensor] : out) peer += first_;
    return out;
  };
  communicator_.exchange(shifted(sends), shifted(recvs));
}

std::pair<std::string, std::string> world_size_problem(const RunConfig& config, int64_t world_size) {
  if (world_size <= 1) return {};
  if (config.offload.enabled && config.optimizer.state_dtype == "int8")
    return {
        "optimizer.state_dtype",
        fmt::format("is int8, whose moments cannot be sharded over the {} ranks launched (their quantisation groups "
                    "start at each parameter's first element): use fp32 or bf16 (docs/distributed.md)",
                    world_size)};
  if (const std::string problem = context_parallel_problem(config, world_size); !problem.empty())
    return {"distributed.context_parallel", problem};
  // Data parallelism runs over the groups of distributed.context_parallel ranks (each group shares its slice).
  const int64_t slices = world_size / config.distributed.context_parallel;
  if (config.train.batch_size % slices != 0)
    return {"train.batch_size",
            fmt::format("is {}, the global batch, which must split evenly over the {} {}: set a multiple of {}",
                        config.train.batch_size, slices,
                        slices == world_size ? "ranks" : "data-parallel groups of ranks", slices)};
  return {};
}

std::string context_parallel_problem(const RunConfig& config, int64_t world_size, int64_t token_frames) {
  const int64_t n = config.distributed.context_parallel;
  if (n == 1) return "";
  if (world_size % n != 0)
    return fmt::format(
        "{} does not divide the {} ranks of this run (groups of {} ranks share each sample; data "
        "parallelism runs over the world size / {} groups)",
        n, world_size, n, n);
  const bool wan = config.model.arch == Architecture::kWan;
  const bool dense = wan ? config.model.self_attention != "dsa3d" : config.model.arch == Architecture::kDense3D;
  const int64_t heads = wan ? config.model.wan.heads : config.model.heads;
  // The heads are the config's (before the ranks start, once); a Wan's weights give its own, checked with the frames.
  const bool heads_known = token_frames >= 0 || !wan || config.model.wan.weights.empty();
  if (heads_known && dense && heads % n != 0)
    return fmt::format(
        "{} does not divide the model's {} attention heads: dense attention over a context-parallel "
        "group (Ulysses) gives each rank heads / {}",
        n, heads, n);
  if (token_frames < 0) return "";
  if (token_frames < n)
    return fmt::format("{} ranks cannot share a sample of {} token frames (each rank needs one)", n, token_frames);
  return "";
}

double CommunicatorFrames::max(double value) {
  std::vector<at::Tensor> t{at::full({1}, value, at::kDouble)};
  communicator_.all_reduce_max(t);
  return t[0].item<double>();
}

void Communicator::barrier() {
  try {
    issue(backend_ == "gloo", [&] { return impl_->group->barrier(); })->wait();
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format(
        "rank {} of {}: barrier failed (a rank stopped, or none answered within distributed.timeout_s = {} s): {}",
        rank_, world_size_, timeout_s_, error_message(e)));
  }
}

namespace {

// The block exchange: host tensors over a Gloo group of their own (the host channel), the step
// channel through the communicator. 16-bit tensors travel as they are where Gloo reduces them, else
// widened to fp32 (decided at the first exchange, the same on every rank: same build, same dtype).
class GlooShardExchange : public offload::ShardExchange {
 public:
  GlooShardExchange(Communicator& step, c10::intrusive_ptr<c10d::Backend> group, double timeout_s)
      : step_(step), group_(std::move(group)), timeout_s_(timeout_s) {}
  int64_t rank() const override { return step_.rank(); }
  int64_t world_size() const override { return step_.world_size(); }

  void reduce_scatter_sum(const at::Tensor& input, const at::Tensor& output) override {
    run("reduce-scatter of a block's gradient", input, output, [&](at::Tensor& in, at::Tensor& out) {
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      issue(true, [&] { return group_->_reduce_scatter_base(out, in, options); })->wait();
    });
  }
  void all_gather(const at::Tensor& input, const at::Tensor& output) override {
    run("all-gather of a block's weights", input, output, [&](at::Tensor& in, at::Tensor& out) {
      issue(true, [&] { return group_->_allgather_base(out, in); })->wait();
    });
  }
  void all_reduce_sum(std::vector<at::Tensor>& tensors) override { step_.all_reduce_sum(tensors); }

 private:
  // Runs `collective(in, out)` on `input` and `output`, or, for a 16-bit dtype Gloo refuses (its
  // reductions cover fp32/fp64 and, in recent releases, fp16/bf16), on fp32 copies from then on.
  template <typename Collective>
  void run(const char* what, const at::Tensor& input, const at::Tensor& output, Collective&& collective) {
    const auto attempt = [&] {
      at::Tensor in = input, out = output;
      if (widen_16bit_ && input.element_size() == 2) {
        in = input.to(at::kFloat);
        out = at::empty({output.numel()}, in.options());
      }
      collective(in, out);
      if (!out.is_same(output)) output.copy_(out);
    };
    try {
      try {
        attempt();
      } catch (const c10::Error& e) {
        if (widen_16bit_ || input.element_size() != 2 || std::string(e.what()).find("type") == std::string::npos) throw;
        widen_16bit_ = true;
        attempt();
      }
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format(
          "rank {} of {}: {} failed (a rank stopped, or none answered within distributed.timeout_s = {} s): {}", rank(),
          world_size(), what, timeout_s_, error_message(e)));
    }
  }
  Communicator& step_;
  c10::intrusive_ptr<c10d::Backend> group_;
  double timeout_s_;
  bool widen_16bit_ = false;
};

}  // namespace

std::shared_ptr<offload::ShardExchange> Communicator::shard_exchange() {
  if (exchange_) return exchange_;
#ifdef MEGASLIDE_WITH_GLOO
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000.0));
  try {
    auto gloo = c10d::ProcessGroupGloo::Options::create(timeout);
    const auto& env = impl_->env;
    gloo->devices.push_back(gloo_device(env));
    auto store = c10::make_intrusive<c10d::PrefixStore>("megaslide-shards", impl_->store);
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank_),
                                                             static_cast<int>(world_size_), gloo);
    exchange_ = std::make_shared<GlooShardExchange>(*this, group, timeout_s_);
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format(
        "rank {} of {}: setting up the block exchange (a Gloo group) failed within distributed.timeout_s ({} s): {}",
        rank_, world_size_, timeout_s_, error_message(e)));
  }
  return exchange_;
#else
  throw DistributedError(
      "the sharded streamed trainer exchanges host shards over Gloo, which this build lacks (Gloo's headers, Debian's "
      "libgloo-dev, were missing when it was built)");
#endif
}

bool nccl_available() {
#ifdef MEGASLIDE_WITH_NCCL
  return true;
#else
  return false;
#endif
}

namespace {
std::string nccl_version_text(int code) {
  // NCCL_VERSION_CODE since 2.9: major·10000 + minor·100 + patch.
  return fmt::format("{}.{}.{}", code / 10000, code / 100 % 100, code % 100);
}
}  // namespace

std::string nccl_header_version() {
#ifdef MEGASLIDE_WITH_NCCL
  return nccl_version_text(NCCL_VERSION_CODE);
#else
  return {};
#endif
}

std::string nccl_loaded_version() {
#ifdef MEGASLIDE_WITH_NCCL
  // libnccl.so.2 is loaded with libtorch_cuda (its NEEDED entry); this build does not link it itself.
  using GetVersion = int (*)(int*);
  auto get = reinterpret_cast<GetVersion>(::dlsym(RTLD_DEFAULT, "ncclGetVersion"));
  int code = 0;
  if (get == nullptr || get(&code) != 0) return {};
  return nccl_version_text(code);
#else
  return {};
#endif
}

std::string nccl_version_mismatch() {
  const std::string header = nccl_header_version(), loaded = nccl_loaded_version();
  if (header.empty() || loaded.empty()) return {};
  auto major_minor = [](const std::string& v) { return v.substr(0, v.rfind('.')); };
  if (major_minor(header) == major_minor(loaded)) return {};
  return fmt::format(
      "this build was compiled with NCCL {}'s header but LibTorch loads NCCL {}: ProcessGroupNCCL's options "
      "(ncclConfig_t) would be laid out by one and read by the other. Reconfigure with "
      "-DMEGASLIDE_NCCL_INCLUDE_DIR=<the include folder of NCCL {}> (for a pip torch: nvidia/nccl/include "
      "beside the torch folder) and rebuild (docs/building.md)",
      header, loaded, loaded);
}

bool gloo_available() {
#ifdef MEGASLIDE_WITH_GLOO
  return true;
#else
  return false;
#endif
}

int64_t free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw DistributedError("cannot open a socket to find a free port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  if (!ok) throw DistributedError("cannot bind a socket on 127.0.0.1 to find a free port");
  return ntohs(addr.sin_port);
}

namespace {
volatile sig_atomic_t g_forward_signal = 0;
void remember_signal(int signal) { g_forward_signal = signal; }

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}
}  // namespace

int launch_local_ranks(const std::vector<std::string>& argv, int64_t nproc, int64_t master_port, double grace_s) {
  if (nproc < 1) throw DistributedError(fmt::format("--nproc-per-node must be at least 1, got {}", nproc));
  if (master_port == 0) master_port = free_local_port();
  std::vector<pid_t> children;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (int64_t rank = 0; rank < nproc; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t c : children) ::kill(c, SIGKILL);
      for (pid_t c : children) ::waitpid(c, nullptr, 0);
      throw DistributedError("fork failed while starting local rank " + std::to_string(rank));
    }
    if (pid == 0) {
      // Its own process group, so that a terminal's Ctrl-C reaches the launcher alone, which passes it on
      // once (a second signal would stop a rank without its checkpoint); and it ends with the launcher.
      ::setpgid(0, 0);
      struct sigaction term {};  // a SIGTERM it inherits ignored would not end it: then SIGKILL
      ::sigaction(SIGTERM, nullptr, &term);
      ::prctl(PR_SET_PDEATHSIG, term.sa_handler == SIG_IGN ? SIGKILL : SIGTERM);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(master_port).c_str(), 1);
      ::setenv("MEGASLIDE_LOCAL_LAUNCH", "1", 1);
      ::execv("/proc/self/exe", args.data());
      ::_exit(127);
    }
    children.push_back(pid);
  }
  // The signals megaslide-train stops on with a checkpoint (SIGHUP: the terminal closed; SIGUSR1: a batch
  // system's warning before its time limit), passed on to every rank; a signal the launcher was started ignoring
  // (SIGHUP under nohup, SIGINT for a job started with `&`) stays ignored, here and in the ranks, which inherit it.
  const int forwarded[4] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1};
  struct sigaction forward {
  }, old[4]{};
  forward.sa_handler = remember_signal;
  sigemptyset(&forward.sa_mask);
  for (int i = 0; i < 4; ++i) {
    ::sigaction(forwarded[i], nullptr, &old[i]);
    if (old[i].sa_handler == SIG_IGN) continue;
    ::sigaction(forwarded[i], &forward, nullptr);
  }

  int result = 0;
  size_t running = children.size();
  std::vector<bool> done(children.size(), false);
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  bool terminating = false;
  while (running > 0) {
    if (g_forward_signal != 0) {
      for (size_t i = 0; i < children.size(); ++i)
        if (!done[i]) ::kill(children[i], g_forward_signal);
      g_forward_signal = 0;
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t i = 0; i < children.size(); ++i) {
        if (children[i] != pid || done[i]) continue;
        done[i] = true;
        --running;
        const int code = exit_code(status);
        if (code != 0 && result == 0) {
          result = code;
          if (!terminating) {
            terminating = true;
            for (size_t j = 0; j < children.size(); ++j)
              if (!done[j]) ::kill(children[j], SIGTERM);
            kill_deadline =
                std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
          }
        }
      }
      continue;
    }
    if (terminating && std::chrono::steady_clock::now() > kill_deadline) {
      for (size_t j = 0; j < children.size(); ++j)
        if (!done[j]) ::kill(children[j], SIGKILL);
      kill_deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int i = 0; i < 4; ++i) ::sigaction(forwarded[i], &old[i], nullptr);
  return result;
}

}  // namespace megaslide

namespace megaslide {

int64_t average_gradients_over_ranks(Communicator& communicator, const std::vector<at::Tensor>& parameters,
                                     double& loss_sum, c10::Device device) {
  // One flat buffer of every defined gradient: one collective a step, not one per parameter.
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters)
    if (p.grad().defined()) grads.push_back(p.grad());
  std::vector<at::Tensor> pieces;
  for (auto& g : grads) pieces.push_back(g.reshape({-1}));
  std::vector<at::Tensor> flat{at::cat(pieces)};
  // The loss, and the count of defined gradients with its square (the counts must agree on every rank, else the
  // ranks' buffers would not line up: they all do exactly when the sums are R times this rank's count and square),
  // in float64 on the device (NCCL reduces GPU tensors only).
  const double n = static_cast<double>(grads.size());
  auto host = at::empty({3}, at::kDouble);
  host[0] = loss_sum;
  host[1] = n;
  host[2] = n * n;
  std::vector<at::Tensor> scalars{host.to(device)};
  communicator.all_reduce_sum(scalars);
  const double ranks = static_cast<double>(communicator.world_size());
  const auto sums = scalars[0].cpu();
  const double defined = sums[1].item<double>();
  TORCH_CHECK(defined == ranks * n && sums[2].item<double>() == ranks * n * n, "data parallelism: this rank has ",
              grads.size(), " parameters with a gradient but the ranks together have ", defined,
              "; every rank must train the same parameters");
  communicator.all_reduce_sum(flat);
  loss_sum = sums[0].item<double>() / ranks;
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat[0].narrow(0, offset, g.numel()).view(g.sizes()).div_(ranks));
    offset += g.numel();
  }
  return static_cast<int64_t>(flat[0].nbytes());
}

void check_batch_slice(int64_t batch_size, int64_t rank, int64_t world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument(fmt::format("rank {} is outside a world of {} ranks", rank, world_size));
  if (batch_size % world_size != 0)
    throw std::invalid_argument(
        fmt::format("train.batch_size {} does not split evenly over {} ranks: set it to a multiple of {}", batch_size,
                    world_size, world_size));
}

}  // namespace megaslide
