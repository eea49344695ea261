// Data parallelism over c10d (train/distributed.h): the launcher's environment, Gloo collectives between
// ranks, each rank's slice of the global batch, and megaslide-train with several ranks on localhost
// against one process with the same global batch.
#include "megaslide/train/distributed.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "megaslide/attention/context_parallel.h"
#include "megaslide/io/files.h"
#include "megaslide/model/attention.h"
#include "megaslide/model/deformable_slide_attention.h"
#include "megaslide/train/dit_batches.h"
#include "run_tool.h"
#include "tiny_wan.h"
#include "video_fixture.h"

using namespace megaslide;
using megaslide::io::join_path;

namespace {

std::function<const char*(const char*)> env_of(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

std::string launch_error(const std::map<std::string, std::string>& vars) {
  try {
    read_launch_env(env_of(vars));
  } catch (const DistributedError& e) {
    return e.what();
  }
  return "";
}

std::string fresh_dir(const std::string& name) {
  auto dir = "/tmp/megaslide-test-dist-" + name + "-" + std::to_string(::getpid());
  io::remove_tree(dir);
  return dir;
}

std::vector<double> logged(const std::string& run_dir, const char* key) {
  std::ifstream in(join_path(run_dir, "metrics.jsonl"));
  std::vector<double> values;
  std::string line;
  while (std::getline(in, line)) values.push_back(nlohmann::json::parse(line)[key].get<double>());
  return values;
}

std::vector<double> logged_losses(const std::string& run_dir) { return logged(run_dir, "loss"); }

size_t line_count(const std::string& path) {
  std::ifstream in(path);
  size_t n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

std::string smoke() { return std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml"; }

// The resident trainer in fp32 on the CPU, one thread a rank (2 cores), 5 steps, no checkpoints.
std::string resident_args(int64_t batch) {
  return "--config " + smoke() +
         " --set offload.enabled=false --set train.device=cpu --set train.threads=1 --set train.steps=5" +
         " --set train.checkpoint_every=0 --set output.progress=false --set diffusion.caption_dropout=0.5 --set "
         "train.batch_size=" +
         std::to_string(batch);
}

megaslide::testing::ToolResult train(const std::string& args) {
  return megaslide::testing::run_tool("megaslide-train", args);
}

// Resumes `run_dir`'s step-3 checkpoint (`args`: the run's flags) on each world size of `worlds` and expects the
// logged losses from step `from` on (0-based) to be `expected`'s within 1e-5.
void expect_resumes_at(const std::string& args, const std::string& run_dir, const std::vector<int64_t>& worlds,
                       const std::vector<double>& expected, size_t from) {
  for (const int64_t world : worlds) {
    auto resumed =
        train(args + " --run-dir " + run_dir + " --resume " + join_path(run_dir, "checkpoints/step-0000003") +
              (world == 1 ? "" : " --nproc-per-node " + std::to_string(world)));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const auto got = logged_losses(run_dir);
    ASSERT_EQ(got.size(), 5u) << world << " ranks";
    for (size_t i = from; i < 5; ++i) EXPECT_NEAR(got[i], expected[i], 1e-5) << world << " ranks, step " << i + 1;
  }
}

// The streamed CPU-master trainer in fp32 on the CPU (the ranks' host state sharded), 5 steps.
std::string streamed_args(int64_t batch, const std::string& extra = "") {
  return "--config " + smoke() + " --set offload.enabled=true --set offload.compute_dtype=fp32 --set train.device=cpu" +
         " --set train.threads=1 --set train.steps=5 --set train.checkpoint_every=0 --set output.progress=false" +
         " --set diffusion.caption_dropout=0.5 --set train.batch_size=" + std::to_string(batch) + " " + extra;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A number that follows `key` in the run log's first line holding it ("HostParamStore: 1234 parameters").
int64_t logged_integer(const std::string& run_dir, const std::string& key) {
  const std::string text = read_text(join_path(run_dir, "train.log"));
  const auto at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stoll(text.substr(at + key.size()));
}

// The "total" row of the host memory table in the run log: bytes of the host store (rank 0's).
int64_t logged_host_bytes(const std::string& run_dir) { return logged_integer(run_dir, "  total"); }

// Every file under `dir` (the lock file aside: every run that takes the folder writes its pid there)
// with its bytes.
std::map<std::string, std::string> tree_listing(const std::string& dir, const std::string& under = "") {
  std::map<std::string, std::string> out;
  for (const auto& name : io::list_directory(join_path(dir, under))) {
    const std::string rel = under.empty() ? name : join_path(under, name);
    if (io::is_directory(join_path(dir, rel))) {
      for (auto& entry : tree_listing(dir, rel)) out.insert(std::move(entry));
    } else if (name != ".lock") {
      out[rel] = read_text(join_path(dir, rel));
    }
  }
  return out;
}

// Runs body(rank, communicator) on `ranks` Gloo ranks, threads of this process, and returns each rank's error (""
// where body returned).
std::vector<std::string> on_gloo_communicators(int64_t ranks, const std::function<void(int64_t, Communicator&)>& body) {
  const int64_t port = free_local_port();
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  auto rank_main = [&](int64_t rank) {
    try {
      LaunchEnv env;
      env.rank = rank, env.world_size = ranks, env.master_addr = "127.0.0.1", env.master_port = port;
      Communicator comm(env, "gloo", 30.0, torch::kCPU);
      body(rank, comm);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(rank)] = e.what();
    }
  };
  std::vector<std::thread> others;
  for (int64_t r = 1; r < ranks; ++r) others.emplace_back(rank_main, r);
  rank_main(0);
  for (auto& t : others) t.join();
  return errors;
}

// Runs body(rank, group) on `ranks` Gloo ranks that form one context-parallel group (on_gloo_communicators).
std::vector<std::string> on_gloo_ranks(int64_t ranks, const std::function<void(int64_t, CommunicatorFrames&)>& body) {
  return on_gloo_communicators(ranks, [&](int64_t rank, Communicator& comm) {
    CommunicatorFrames group(comm);
    body(rank, group);
  });
}

// The property: data parallelism's gradient average (average_gradients_over_ranks) stops every rank when their counts
// of gradients differ — also the rank whose count is the counts' mean (9, 10 and 11 over 3 ranks) — before it
// reduces buffers that would not line up; equal counts average the gradients and the loss.
TEST(DataParallel, RanksWithOtherCountsOfGradientsAllStop) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  for (const std::vector<int64_t>& counts : {std::vector<int64_t>{9, 10, 11}, std::vector<int64_t>{10, 10, 10}}) {
    const bool equal = counts[0] == counts[2];
    SCOPED_TRACE(equal ? "equal counts" : "9, 10 and 11");
    std::vector<double> grads(3, 0.0), losses(3, 0.0);
    const auto errors = on_gloo_communicators(3, [&](int64_t rank, Communicator& comm) {
      std::vector<at::Tensor> params;
      for (int64_t i = 0; i < counts[static_cast<size_t>(rank)]; ++i) {
        auto p = torch::zeros({2}).requires_grad_();
        p.mutable_grad() = torch::full({2}, static_cast<double>(rank + 1), torch::kFloat);
        params.push_back(p);
      }
      double loss = static_cast<double>(rank);
      average_gradients_over_ranks(comm, params, loss, torch::kCPU);
      grads[static_cast<size_t>(rank)] = params.back().grad()[0].item<double>();
      losses[static_cast<size_t>(rank)] = loss;
    });
    for (size_t r = 0; r < 3; ++r) {
      if (equal) {
        EXPECT_EQ(errors[r], "") << "rank " << r;
        EXPECT_EQ(grads[r], 2.0) << "rank " << r;
        EXPECT_EQ(losses[r], 1.0) << "rank " << r;
      } else {
        EXPECT_NE(errors[r].find("every rank must train the same parameters"), std::string::npos)
            << "rank " << r << ": " << errors[r];
      }
    }
  }
}

// The ranks' pieces `got[rank][i]` joined along dimension 1 (their frames, in rank order) are `whole` within 1e-12.
void expect_pieces_join_to(const std::vector<std::vector<torch::Tensor>>& got, size_t i, const torch::Tensor& whole,
                           const std::string& what) {
  std::vector<torch::Tensor> parts;
  for (const auto& g : got) parts.push_back(g[i]);
  EXPECT_LT((torch::cat(parts, 1) - whole).abs().max().item<double>(), 1e-12) << what;
}

// A module over a context-parallel group is the module on the whole grid: `forward_cp(module, x_r, group)` runs a
// clone of `whole` on each of `ranks` Gloo ranks with its frames of `x` [B, N, D] (`per_frame` tokens a frame, split
// by `split`), backs its rows of `dout` through it, and the joined outputs and input gradients must be `expected`
// and `dx`, and every parameter's gradients summed over the ranks `whole`'s (whose backward ran), within 1e-12.
void expect_module_over_group_is_whole(
    torch::nn::Module& whole, int64_t ranks, const torch::Tensor& x, const torch::Tensor& dout, int64_t per_frame,
    const ops::FrameSplit& split, const torch::Tensor& expected, const torch::Tensor& dx,
    const std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor&, CommunicatorFrames&)>& forward_cp) {
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (int64_t r = 0; r < ranks; ++r) {
    modules.push_back(whole.clone());
    modules.back()->zero_grad();
  }
  std::vector<std::vector<torch::Tensor>> got(static_cast<size_t>(ranks));
  const auto errors = on_gloo_ranks(ranks, [&](int64_t rank, CommunicatorFrames& group) {
    auto xl = x.narrow(1, split.begin(rank) * per_frame, split.size(rank) * per_frame).clone().requires_grad_();
    const auto out = forward_cp(*modules[static_cast<size_t>(rank)], xl, group);
    (out * dout.narrow(1, split.begin(rank) * per_frame, split.size(rank) * per_frame)).sum().backward();
    got[static_cast<size_t>(rank)] = {out.detach(), xl.grad()};
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  expect_pieces_join_to(got, 0, expected, "out");
  expect_pieces_join_to(got, 1, dx, "dx");
  for (const auto& item : whole.named_parameters()) {
    auto sum = torch::zeros_like(item.value());
    for (auto& m : modules) sum += m->named_parameters()[item.key()].grad();
    EXPECT_LT((sum - item.value().grad()).abs().max().item<double>(), 1e-12) << item.key();
  }
}

}  // namespace

TEST(LaunchEnv, NoLauncherIsOneProcess) {
  const auto env = read_launch_env(env_of({}));
  EXPECT_FALSE(env.distributed());
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.launcher, "none");
}

TEST(LaunchEnv, ReadsTorchrunsVariables) {
  const auto env = read_launch_env(env_of({{"RANK", "5"},
                                           {"WORLD_SIZE", "8"},
                                           {"LOCAL_RANK", "1"},
                                           {"LOCAL_WORLD_SIZE", "4"},
                                           {"MASTER_ADDR", "node-0"},
                                           {"MASTER_PORT", "29611"}}));
  EXPECT_EQ(env.launcher, "torchrun");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.master_addr, "node-0");
  EXPECT_EQ(env.master_port, 29611);
  EXPECT_FALSE(env.agent_store);
  // torchrun's elastic agent serves the store itself: rank 0 joins it instead of binding the port again.
  EXPECT_TRUE(
      read_launch_env(
          env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}}))
          .agent_store);
  // The same variables set by megaslide-train --nproc-per-node for its ranks: logged as what started them.
  EXPECT_EQ(
      read_launch_env(
          env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MEGASLIDE_LOCAL_LAUNCH", "1"}}))
          .launcher,
      "megaslide-train --nproc-per-node");
}

TEST(LaunchEnv, ReadsSlurmsVariablesAndDefaultsThePort) {
  const auto env = read_launch_env(env_of({{"SLURM_PROCID", "3"},
                                           {"SLURM_NTASKS", "4"},
                                           {"SLURM_LOCALID", "1"},
                                           {"SLURM_NTASKS_PER_NODE", "2"},
                                           {"MASTER_ADDR", "gpu-17"}}));
  EXPECT_EQ(env.launcher, "slurm");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_port, 29500);
  // Ranks per node from Slurm's compressed SLURM_TASKS_PER_NODE ("2(x3),1": three nodes of 2, one of 1) at
  // this node's SLURM_NODEID, or the count all nodes share; 1 when it cannot be read.
  auto local = [&](std::map<std::string, std::string> vars) {
    vars.insert({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "7"}, {"MASTER_ADDR", "a"}});
    return read_launch_env(env_of(vars)).local_world_size;
  };
  EXPECT_EQ(local({{"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_NODEID", "1"}}), 2);
  EXPECT_EQ(local({{"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_NODEID", "3"}}), 1);
  EXPECT_EQ(local({{"SLURM_TASKS_PER_NODE", "2(x3),1"}}), 1);  // nodes differ and no node id: unknown
  EXPECT_EQ(local({{"SLURM_TASKS_PER_NODE", "4(x2)"}}), 4);
  EXPECT_EQ(local({{"SLURM_TASKS_PER_NODE", "3"}}), 3);
  EXPECT_EQ(local({{"SLURM_NTASKS_PER_NODE", "4(x2)"}, {"SLURM_TASKS_PER_NODE", "1"}}), 4);
  for (const char* bad : {"", "x", "2(x", "2(x0)", "0", "2,,1", "2,", "(x2)"})
    EXPECT_EQ(local({{"SLURM_TASKS_PER_NODE", bad}}), 1) << bad;
  // torchrun's variables win when both are present (torchrun inside a Slurm allocation).
  const auto both = read_launch_env(
      env_of({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}));
  EXPECT_EQ(both.launcher, "torchrun");
  EXPECT_EQ(both.world_size, 2);
}

// The property: a launch environment that cannot be right is one error naming the variable.
TEST(LaunchEnv, BadValuesAreErrorsNamingTheVariable) {
  EXPECT_NE(launch_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}})
                .find("RANK=2 is outside [0, WORLD_SIZE=2)"),
            std::string::npos);
  EXPECT_NE(launch_error({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK=x is not an integer"), std::string::npos);
  EXPECT_NE(launch_error({{"RANK", "0"}}).find("RANK and WORLD_SIZE"), std::string::npos);
  EXPECT_NE(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT"),
            std::string::npos);
  const auto slurm = launch_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}});
  EXPECT_NE(slurm.find("MASTER_ADDR is not set"), std::string::npos) << slurm;
  EXPECT_NE(slurm.find("scontrol show hostnames"), std::string::npos) << slurm;
}

TEST(LaunchEnv, RanksTakeTheGpuOfTheirLocalRank) {
  LaunchEnv env;
  env.world_size = 4, env.rank = 3, env.local_rank = 1;
  EXPECT_EQ(rank_device_spec("cuda", env), "cuda:1");
  EXPECT_EQ(rank_device_spec("cuda:3", env), "cuda:3");
  EXPECT_EQ(rank_device_spec("cpu", env), "cpu");
  LaunchEnv one;
  EXPECT_EQ(rank_device_spec("cuda", one), "cuda");
}

TEST(LaunchEnv, NcclOnTheCpuIsAConfigError) {
  DistributedConfig d;
  if (gloo_available()) EXPECT_EQ(resolve_backend(d, torch::kCPU, "test"), "gloo");
  d.backend = "nccl";
  try {
    resolve_backend(d, torch::kCPU, "test");
    FAIL() << "nccl on the CPU was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("distributed.backend"), std::string::npos) << e.what();
  }
}

// The property: Gloo sums (and takes maxima) over the ranks in place, two ranks as two threads.
TEST(Communicator, GlooAllReduceSumsAndMaximaOverTwoRanks) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const int64_t port = free_local_port();
  torch::manual_seed(3);
  const std::vector<torch::Tensor> inputs{torch::randn({37, 5}), torch::randn({37, 5})};
  std::vector<torch::Tensor> sums(2), maxima(2);
  std::vector<std::string> errors(2);
  auto rank_main = [&](int64_t rank) {
    try {
      LaunchEnv env;
      env.rank = rank, env.world_size = 2, env.master_addr = "127.0.0.1", env.master_port = port;
      Communicator comm(env, "gloo", 30.0, torch::kCPU);
      std::vector<torch::Tensor> s{inputs[rank].clone()}, m{inputs[rank].clone()};
      comm.all_reduce_sum(s);
      comm.all_reduce_max(m);
      comm.barrier();
      sums[rank] = s[0], maxima[rank] = m[0];
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(torch::allclose(sums[r], inputs[0] + inputs[1], 0, 1e-6)) << "rank " << r;
    EXPECT_TRUE(torch::equal(maxima[r], torch::maximum(inputs[0], inputs[1]))) << "rank " << r;
  }
}

// The property: Gloo groups of one process issue their collectives from several threads at once without
// corrupting LibTorch's per-process flight recorder (its 2.11 release adds a group to a map outside its lock on the
// group's first collective: a crash in a map insertion, once in ~20 runs of the halo-exchange test below, before
// the communicator issued its Gloo calls under one lock). Each round, two single-rank communicators and their
// block exchanges' groups, four groups, make their first collectives together (without the lock one run of this
// test in three crashed).
TEST(Communicator, GlooGroupsOfOneProcessIssueFromManyThreadsAtOnce) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  constexpr int kCommunicators = 2, kGroups = 2 * kCommunicators, kRounds = 14;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::unique_ptr<Communicator>> comms;
    std::vector<offload::ShardExchange*> exchanges;  // held by their communicators
    for (int c = 0; c < kCommunicators; ++c) {
      LaunchEnv env;
      env.rank = 0, env.world_size = 1, env.master_addr = "127.0.0.1", env.master_port = free_local_port();
      comms.push_back(std::make_unique<Communicator>(env, "gloo", 30.0, torch::kCPU));
      exchanges.push_back(comms.back()->shard_exchange().get());
    }
    std::atomic<int> ready{0};
    std::vector<std::string> errors(kGroups);
    std::vector<double> sums(kGroups, 0.0);
    auto body = [&](int g) {
      try {
        ++ready;
        while (ready.load() < kGroups) std::this_thread::yield();
        std::vector<at::Tensor> t{at::full({3}, static_cast<double>(g + 1), at::kDouble)};
        if (g < kCommunicators) {
          comms[static_cast<size_t>(g)]->all_reduce_sum(t);
        } else {
          const auto out = at::empty({3}, at::kDouble);
          exchanges[static_cast<size_t>(g - kCommunicators)]->all_gather(t[0], out);
          t[0] = out;
        }
        sums[static_cast<size_t>(g)] = t[0].sum().item<double>();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(g)] = e.what();
      }
    };
    std::vector<std::thread> threads;
    for (int g = 0; g < kGroups; ++g) threads.emplace_back(body, g);
    for (auto& t : threads) t.join();
    for (int g = 0; g < kGroups; ++g) {
      ASSERT_EQ(errors[static_cast<size_t>(g)], "") << "round " << round << ", group " << g;
      EXPECT_EQ(sums[static_cast<size_t>(g)], 3.0 * (g + 1)) << "round " << round << ", group " << g;
    }
  }
}

// The property: 3D-DSA over a context-parallel group (attention/context_parallel.h), the frames split over 2 and 3
// Gloo ranks (threads) at frame counts no rank count divides, is the single-rank operator on the whole grid: the
// outputs and the gradients of q, k, v and the offsets within 1e-12 in float64, and the bias' summed over the
// ranks. Temporal offsets reach 2.6 frames, past the model's default range of 1 (the halo is sized from the
// offsets given); kernels of 3 and 5 frames, one longer than the grid.
TEST(ContextParallel, Dsa3dHaloExchangeIsTheSingleRankOperator) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  struct Case {
    int64_t ranks, frames, kt;
  };
  for (const Case c : {Case{2, 7, 3}, Case{3, 8, 3}, Case{3, 7, 5}, Case{2, 4, 5}}) {
    SCOPED_TRACE(std::to_string(c.ranks) + " ranks, " + std::to_string(c.frames) + " frames, kt " +
                 std::to_string(c.kt));
    const int64_t B = 2, H = 4, W = 5, M = 2, d = 4, G = 1;
    const std::array<int64_t, 3> kernel{c.kt, 3, 3};
    const auto ke = ops::effective_kernel(kernel, {c.frames, H, W});
    const int64_t K = ke[0] * ke[1] * ke[2];
    torch::manual_seed(11);
    const auto opts = torch::TensorOptions().dtype(torch::kDouble);
    const auto q = torch::randn({B, c.frames, H, W, M, d}, opts), k = torch::randn_like(q), v = torch::randn_like(q);
    const auto reach = torch::tensor({2.6, 1.5, 1.5}, opts);
    const auto offsets = (torch::rand({B, c.frames, H, W, G, K, 3}, opts) * 2 - 1) * reach;
    const auto bias = torch::randn({M, K}, opts), dout = torch::randn_like(q);
    // The whole grid on one rank.
    std::vector<torch::Tensor> whole{q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(),
                                     offsets.clone().requires_grad_(), bias.clone().requires_grad_()};
    const auto expected = ops::dsa3d(whole[0], whole[1], whole[2], whole[3], whole[4], kernel, ops::DsaImpl::kCpu);
    (expected * dout).sum().backward();
    // The frames split over the ranks: the halo's reach measured on the offsets, or a bound given beforehand
    // (the offsets' own range, or a looser one); a bound the offsets exceed (0) must give another result where
    // it leaves a rank's halo short (kernels of 3 frames: with 5 the slab of a 2-frame rank already spans the grid).
    const auto split = ops::FrameSplit::balanced(c.frames, c.ranks);
    const auto on_ranks = [&](std::optional<double> reach_bound) {
      std::vector<std::vector<torch::Tensor>> got(static_cast<size_t>(c.ranks));
      const auto errors = on_gloo_ranks(c.ranks, [&](int64_t rank, CommunicatorFrames& group) {
        const auto mine = [&](const torch::Tensor& t) {
          return t.narrow(1, split.begin(rank), split.size(rank)).clone().requires_grad_();
        };
        auto ql = mine(q), kl = mine(k), vl = mine(v), ol = mine(offsets);
        auto bl = bias.clone().requires_grad_();
        const auto out = ops::dsa3d_context_parallel(ql, kl, vl, ol, bl, kernel, split, group, ops::DsaImpl::kCpu,
                                                     false, reach_bound);
        (out * dout.narrow(1, split.begin(rank), split.size(rank))).sum().backward();
        got[static_cast<size_t>(rank)] = {out.detach(), ql.grad(), kl.grad(), vl.grad(), ol.grad(), bl.grad()};
      });
      for (const auto& e : errors) EXPECT_EQ(e, "");
      return got;
    };
    const char* names[] = {"out", "dq", "dk", "dv", "d(offsets)"};
    const torch::Tensor reference[] = {expected.detach(), whole[0].grad(), whole[1].grad(), whole[2].grad(),
                                       whole[3].grad()};
    for (const std::optional<double> bound :
         {std::optional<double>(), std::optional<double>(2.6), std::optional<double>(ops::offset_reach_bound(4.0))}) {
      SCOPED_TRACE(bound ? "reach bound " + std::to_string(*bound) : std::string("reach measured"));
      const auto got = on_ranks(bound);
      for (size_t i = 0; i < 5; ++i) expect_pieces_join_to(got, i, reference[i], names[i]);
      auto dbias = torch::zeros_like(bias);
      for (const auto& g : got) dbias += g[5];
      EXPECT_LT((dbias - whole[4].grad()).abs().max().item<double>(), 1e-12) << "d(bias)";
    }
    if (c.kt != 3) continue;
    const auto short_halo = on_ranks(0.0);
    double differs = 0;
    for (int64_t r = 0; r < c.ranks; ++r)
      differs = std::max(
          differs, (short_halo[static_cast<size_t>(r)][0] - expected.detach().narrow(1, split.begin(r), split.size(r)))
                       .abs()
                       .max()
                       .item<double>());
    EXPECT_GT(differs, 1e-6) << "a halo too short for the offsets changed nothing: the bound is not what sizes it";
  }
}

// The property: the 3D-DSA module (the paper's block attention: q, k, v, the offset network's depthwise 3×3×3
// convolution over time, the attention, the projection) over a context-parallel group of 2 and 3 Gloo ranks is the
// module on the whole grid: its outputs, the input's gradient and every parameter's gradient summed over the ranks
// within 1e-12 in float64, with trained-looking offsets (the offset network's output layer random, the temporal
// range 2.5 frames) and with the fixed (frozen) offset network.
TEST(ContextParallel, TheDsaModuleOverAGroupIsTheModuleOnTheWholeGrid) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  for (const auto [ranks, offsets] :
       {std::pair{2, DsaOffsets::kLearned}, std::pair{3, DsaOffsets::kLearned}, std::pair{3, DsaOffsets::kFrozen}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks, offsets " + to_string(offsets));
    const int64_t B = 2, D = 8, T = 7, H = 4, W = 5;
    const TokenGrid grid{T, H, W};
    torch::manual_seed(17);
    DeformableSlideAttention3D whole(
        DeformableSlideAttentionOptions(D, 2).kernel({3, 3, 3}).offset_range({2.5, 1.0, 1.0}).offsets(offsets));
    {
      torch::NoGradGuard no_grad;
      for (auto& p : whole->parameters()) p.normal_(0, 0.5);
    }
    whole->to(torch::kDouble);
    const auto x = torch::randn({B, grid.numel(), D}, torch::kDouble), dout = torch::randn_like(x);
    auto xw = x.clone().requires_grad_();
    const auto expected = whole->forward(xw, grid);
    (expected * dout).sum().backward();
    const auto split = ops::FrameSplit::balanced(T, ranks);
    const int64_t per_frame = H * W;
    expect_module_over_group_is_whole(
        *whole, ranks, x, dout, per_frame, split, expected.detach(), xw.grad(),
        [&](torch::nn::Module& m, const torch::Tensor& xl, CommunicatorFrames& group) {
          return dynamic_cast<DeformableSlideAttention3DImpl&>(m).forward_context_parallel(xl, grid, split, group);
        });
  }
}

// The property: the DiT family's dense and window attentions over a context-parallel group of 2 and 3 Gloo ranks
// are the modules on the whole grid — outputs, the input's gradient and every parameter's gradient summed over the
// ranks within 1e-12 in float64: global attention through Ulysses, and Swin's windows (unshifted, and shifted with
// the roll's wrapped frames) whose time windows cross the ranks' boundaries, at frame counts no rank count divides,
// windows of 3 frames over 7 and 8, and one window longer than the grid.
TEST(ContextParallel, DenseAndWindowModulesOverAGroupAreTheModulesOnTheWholeGrid) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  struct Case {
    std::string kind;  // dense | window | shifted
    int64_t ranks, frames, window_t;
  };
  for (const Case& c :
       {Case{"dense", 2, 7, 0}, Case{"dense", 3, 8, 0}, Case{"window", 3, 8, 3}, Case{"shifted", 2, 7, 3},
        Case{"shifted", 3, 8, 3}, Case{"shifted", 3, 11, 4}, Case{"shifted", 2, 3, 5}}) {
    SCOPED_TRACE(c.kind + ", " + std::to_string(c.ranks) + " ranks, " + std::to_string(c.frames) + " frames, window " +
                 std::to_string(c.window_t));
    const int64_t B = 2, D = 12, H = 4, W = 5;
    const TokenGrid grid{c.frames, H, W};
    torch::manual_seed(19);
    std::shared_ptr<torch::nn::Module> whole;
    if (c.kind == "dense") {
      whole = GlobalSelfAttention(SelfAttentionOptions(D, 6)).ptr();
    } else {
      whole =
          ShiftedWindowAttention3D(WindowAttentionOptions(D, 3).window({c.window_t, 3, 2}).shifted(c.kind == "shifted"))
              .ptr();
    }
    whole->to(torch::kDouble);
    const auto forward = [&](torch::nn::Module& m, const torch::Tensor& x) {
      if (auto* g = dynamic_cast<GlobalSelfAttentionImpl*>(&m)) return g->forward(x, grid);
      return dynamic_cast<ShiftedWindowAttention3DImpl&>(m).forward(x, grid);
    };
    const auto forward_cp = [&](torch::nn::Module& m, const torch::Tensor& x, const ops::FrameSplit& split,
                                ops::FrameExchange& group) {
      if (auto* g = dynamic_cast<GlobalSelfAttentionImpl*>(&m))
        return g->forward_context_parallel(x, grid, split, group);
      return dynamic_cast<ShiftedWindowAttention3DImpl&>(m).forward_context_parallel(x, grid, split, group);
    };
    const auto x = torch::randn({B, grid.numel(), D}, torch::kDouble), dout = torch::randn_like(x);
    auto xw = x.clone().requires_grad_();
    const auto expected = forward(*whole, xw);
    (expected * dout).sum().backward();
    const auto split = ops::FrameSplit::balanced(c.frames, c.ranks);
    const int64_t per_frame = H * W;
    expect_module_over_group_is_whole(*whole, c.ranks, x, dout, per_frame, split, expected.detach(), xw.grad(),
                                      [&](torch::nn::Module& m, const torch::Tensor& xl, CommunicatorFrames& group) {
                                        return forward_cp(m, xl, split, group);
                                      });
  }
}

// The property: dense attention over a context-parallel group by Ulysses' all-to-alls (attention/context_parallel.h),
// the frames split over 2 and 3 Gloo ranks (threads) at frame counts no rank count divides, is scaled dot-product
// attention over the whole sequence: outputs and the gradients of q, k and v within 1e-12 in float64; heads that
// the group size does not divide are refused, naming the heads and the group.
TEST(ContextParallel, UlyssesAttentionIsTheWholeSequencesAttention) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  for (const auto [ranks, frames] : {std::pair<int64_t, int64_t>{2, 5}, {3, 7}}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks, " + std::to_string(frames) + " frames");
    const int64_t B = 2, per_frame = 6, M = 6, d = 4, N = frames * per_frame;
    torch::manual_seed(13);
    const auto opts = torch::TensorOptions().dtype(torch::kDouble);
    const auto q = torch::randn({B, N, M, d}, opts), k = torch::randn_like(q), v = torch::randn_like(q),
               dout = torch::randn_like(q);
    std::vector<torch::Tensor> whole{q.clone().requires_grad_(), k.clone().requires_grad_(),
                                     v.clone().requires_grad_()};
    const auto expected =
        at::scaled_dot_product_attention(whole[0].transpose(1, 2), whole[1].transpose(1, 2), whole[2].transpose(1, 2))
            .transpose(1, 2);
    (expected * dout).sum().backward();
    const auto split = ops::FrameSplit::balanced(frames, ranks);
    std::vector<std::vector<torch::Tensor>> got(static_cast<size_t>(ranks));
    std::vector<std::string> refusals(static_cast<size_t>(ranks));
    const auto errors = on_gloo_ranks(ranks, [&](int64_t rank, CommunicatorFrames& group) {
      const auto mine = [&](const torch::Tensor& t) {
        return t.narrow(1, split.begin(rank) * per_frame, split.size(rank) * per_frame).clone().requires_grad_();
      };
      auto ql = mine(q), kl = mine(k), vl = mine(v);
      const auto out = ops::ulysses_attention(ql, kl, vl, split, per_frame, group);
      (out * dout.narrow(1, split.begin(rank) * per_frame, split.size(rank) * per_frame)).sum().backward();
      got[static_cast<size_t>(rank)] = {out.detach(), ql.grad(), kl.grad(), vl.grad()};
      try {  // 5 heads over 2 or 3 ranks
        ops::ulysses_attention(ql.narrow(2, 0, 5), kl.narrow(2, 0, 5), vl.narrow(2, 0, 5), split, per_frame, group);
      } catch (const std::exception& e) {
        refusals[static_cast<size_t>(rank)] = e.what();
      }
    });
    for (const auto& e : errors) ASSERT_EQ(e, "");
    const char* names[] = {"out", "dq", "dk", "dv"};
    const torch::Tensor reference[] = {expected.detach(), whole[0].grad(), whole[1].grad(), whole[2].grad()};
    for (size_t i = 0; i < 4; ++i) expect_pieces_join_to(got, i, reference[i], names[i]);
    for (const auto& r : refusals) {
      EXPECT_NE(r.find("5 heads"), std::string::npos) << r;
      EXPECT_NE(r.find(std::to_string(ranks) + " ranks"), std::string::npos) << r;
    }
  }
}

// The property: work on rank 0 may take longer than distributed.timeout_s while the other ranks wait for it
// (a plain barrier would have timed out), and the ranks then go on together; work that throws on rank 0
// reaches the other ranks as a DistributedError with its message; a rank 0 that never starts the work (no
// heartbeat) ends the wait after the timeout.
TEST(Communicator, RunOnRank0OutlastsTheTimeoutWhileRank0IsAlive) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const double timeout_s = 1.5;  // rendezvous included: not tighter on a loaded machine
  auto run = [&](const std::function<void(Communicator&, int64_t)>& body) {
    const int64_t port = free_local_port();
    std::vector<std::string> errors(2);
    auto rank_main = [&](int64_t rank) {
      try {
        LaunchEnv env;
        env.rank = rank, env.world_size = 2, env.master_addr = "127.0.0.1", env.master_port = port;
        Communicator comm(env, "gloo", timeout_s, torch::kCPU);
        body(comm, rank);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    };
    std::thread other(rank_main, 1);
    rank_main(0);
    other.join();
    return errors;
  };
  // Rank 0 works for 2 timeouts, twice; then an all-reduce sums both ranks' values.
  std::vector<double> sums(2);
  auto errors = run([&](Communicator& comm, int64_t rank) {
    for (int i = 0; i < 2; ++i)
      comm.run_on_rank0("slow work",
                        [&] { std::this_thread::sleep_for(std::chrono::duration<double>(2 * timeout_s)); });
    std::vector<torch::Tensor> t{torch::full({1}, static_cast<double>(rank + 1), torch::kFloat64)};
    comm.all_reduce_sum(t);
    sums[rank] = t[0].item<double>();
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(sums[0], 3.0);
  EXPECT_EQ(sums[1], 3.0);
  // Work that throws on rank 0.
  errors = run([&](Communicator& comm, int64_t) {
    comm.run_on_rank0("the videos", [] { throw std::runtime_error("disk full"); });
  });
  EXPECT_EQ(errors[0], "disk full");
  EXPECT_NE(errors[1].find("rank 0 failed: disk full (the videos)"), std::string::npos) << errors[1];
  // Rank 0 does not come: rank 1 gives up after about the timeout.
  const auto started = std::chrono::steady_clock::now();
  errors = run([&](Communicator& comm, int64_t rank) {
    if (rank == 0) std::this_thread::sleep_for(std::chrono::duration<double>(3 * timeout_s));
    else comm.run_on_rank0("the videos", [] {});
  });
  EXPECT_NE(errors[1].find("rank 0 stopped answering during the videos"), std::string::npos) << errors[1];
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), 30.0);
}

// The property: work on every rank (a model's construction) may take one rank longer than distributed.timeout_s while
// the others wait for it, and the ranks then go on together; work that throws on one rank reaches every other rank as
// a DistributedError naming that rank and its message, without waiting out the timeout; ranks that all throw each
// report their own at once; a rank that never comes (no heartbeat) ends the others' wait after the timeout.
TEST(Communicator, RunOnEveryRankWaitsForTheSlowestWhileItIsAlive) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const double timeout_s = 1.5;  // rendezvous included: not tighter on a loaded machine
  constexpr int64_t kRanks = 3;
  std::vector<bool> input(kRanks);  // whether each rank's error was an input error (exit 2)
  auto run = [&](const std::function<void(Communicator&, int64_t)>& body) {
    const int64_t port = free_local_port();
    std::vector<std::string> errors(kRanks);
    auto rank_main = [&](int64_t rank) {
      try {
        LaunchEnv env;
        env.rank = rank, env.world_size = kRanks, env.master_addr = "127.0.0.1", env.master_port = port;
        Communicator comm(env, "gloo", timeout_s, torch::kCPU);
        body(comm, rank);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
        input[rank] = megaslide::is_input_error(e);
      }
    };
    std::vector<std::thread> others;
    for (int64_t r = 1; r < kRanks; ++r) others.emplace_back(rank_main, r);
    rank_main(0);
    for (auto& t : others) t.join();
    return errors;
  };
  // Rank 2 works for 2 timeouts, the others briefly; then an all-reduce sums the ranks' values.
  std::vector<double> sums(kRanks);
  auto errors = run([&](Communicator& comm, int64_t rank) {
    comm.run_on_every_rank("building the model", [&] {
      std::this_thread::sleep_for(std::chrono::duration<double>(rank == 2 ? 2 * timeout_s : 0.01));
    });
    std::vector<torch::Tensor> t{torch::full({1}, static_cast<double>(rank + 1), torch::kFloat64)};
    comm.all_reduce_sum(t);
    sums[rank] = t[0].item<double>();
  });
  for (int64_t r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(sums[r], 6.0) << "rank " << r;
  }
  // Rank 1's work is refused as bad input at once while rank 2 still builds for 2 timeouts: every other rank names
  // rank 1 and its message — rank 2 too, once it has built (rank 0, which holds the store, stays for it) — as an
  // input error, as rank 1's own is.
  errors = run([&](Communicator& comm, int64_t rank) {
    comm.run_on_every_rank("building the model", [&] {
      if (rank == 1) throw megaslide::ConfigError("run.yaml", "model.wan.weights", "bad weights");
      if (rank == 2) std::this_thread::sleep_for(std::chrono::duration<double>(2 * timeout_s));
    });
  });
  EXPECT_NE(errors[1].find("bad weights"), std::string::npos) << errors[1];
  for (const int64_t r : {0, 2}) {
    EXPECT_NE(errors[r].find(fmt::format("rank {} of 3: rank 1 failed: ", r)), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("bad weights (building the model)"), std::string::npos) << errors[r];
  }
  for (int64_t r = 0; r < kRanks; ++r) EXPECT_TRUE(input[r]) << "rank " << r << ": " << errors[r];
  // Every rank's work throws: each reports its own, none waits out the timeout for the others (timed from the call,
  // the rendezvous left out).
  std::vector<double> seconds(kRanks);
  errors = run([&](Communicator& comm, int64_t rank) {
    const auto called = std::chrono::steady_clock::now();
    try {
      comm.run_on_every_rank("building the model",
                             [&] { throw std::runtime_error(fmt::format("rank {}'s config", rank)); });
    } catch (...) {
      seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - called).count();
      throw;
    }
  });
  for (int64_t r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[r], fmt::format("rank {}'s config", r));
    EXPECT_LT(seconds[r], 0.8 * timeout_s) << "rank " << r << " waited for ranks that had failed themselves";
  }
  // Rank 2 does not come: rank 0 gives up after about the timeout, naming it, and tells rank 1.
  const auto started = std::chrono::steady_clock::now();
  errors = run([&](Communicator& comm, int64_t rank) {
    if (rank == 2) std::this_thread::sleep_for(std::chrono::duration<double>(3 * timeout_s));
    else comm.run_on_every_rank("building the model", [] {});
  });
  EXPECT_NE(errors[0].find("rank 2 stopped answering during building the model"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 1 of 3: rank 2 stopped answering during building the model"), std::string::npos)
      << errors[1];
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), 30.0);
}

// The property: the ranks' slices, side by side, are the single-process batch — the same clips, caption
// dropout, timesteps and noise for every item of the global batch, batch after batch.
TEST(DiffusionBatchSource, RankSlicesConcatenateToTheSingleProcessBatch) {
  const auto config = parse_run_config("", "test",
                                       {"data.frames=4", "data.height=8", "data.width=8", "data.num_clips=16",
                                        "train.batch_size=6", "diffusion.caption_dropout=0.5", "train.device=cpu"});
  DiffusionBatchSource whole(config);
  std::vector<std::unique_ptr<DiffusionBatchSource>> ranks;
  for (int64_t r = 0; r < 3; ++r) {
    ranks.push_back(std::make_unique<DiffusionBatchSource>(config));
    ranks.back()->take_slice(r, 3);
  }
  for (int batch = 0; batch < 4; ++batch) {  // 24 items: crosses an epoch of 16 clips
    const auto w = whole.next(torch::kCPU);
    std::vector<DiffusionBatch> parts;
    for (auto& r : ranks) parts.push_back(r->next(torch::kCPU));
    auto cat = [&](auto field) {
      std::vector<torch::Tensor> pieces;
      for (auto& p : parts) pieces.push_back(field(p));
      return torch::cat(pieces);
    };
    EXPECT_EQ(parts[0].x0.size(0), 2);
    EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.x0; }), w.x0)) << "batch " << batch;
    EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.noise; }), w.noise)) << "batch " << batch;
    EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.timesteps; }), w.timesteps)) << "batch " << batch;
    EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.xt; }), w.xt)) << "batch " << batch;
    EXPECT_TRUE(torch::equal(cat([](auto& b) { return b.text_ids; }), w.text_ids)) << "batch " << batch;
  }
  DiffusionBatchSource odd(config);
  EXPECT_THROW(odd.take_slice(0, 4), std::invalid_argument);  // 6 items do not split over 4 ranks
}

// The same with a folder of videos, where each rank's loader decodes only its rows: side by side they are
// the single process's batch, the corrupt files' stand-ins included.
TEST(DiffusionBatchSource, RankSlicesOfAVideoFolderConcatenateToTheSingleProcessBatch) {
  megaslide::testing::VideoFixture fx("dist-slices", 6);
  const auto config =
      parse_run_config("", "test",
                       {"data.dataset=videos", "data.manifest=" + fx.dir + "/opensora.csv", "data.frames=4",
                        "data.height=16", "data.width=16", "data.frame_stride=2", "data.max_bad_fraction=0.5",
                        "data.workers=1", "train.batch_size=4", "diffusion.caption_dropout=0.5", "train.device=cpu"});
  DiffusionBatchSource whole(config);
  std::vector<std::unique_ptr<DiffusionBatchSource>> ranks;
  for (int64_t r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<DiffusionBatchSource>(config));
    ranks.back()->take_slice(r, 2);
  }
  for (int batch = 0; batch < 3; ++batch) {
    const auto w = whole.next(torch::kCPU);
    const auto a = ranks[0]->next(torch::kCPU), b = ranks[1]->next(torch::kCPU);
    EXPECT_EQ(a.x0.size(0), 2);
    EXPECT_TRUE(torch::equal(torch::cat({a.x0, b.x0}), w.x0)) << "batch " << batch;
    EXPECT_TRUE(torch::equal(torch::cat({a.xt, b.xt}), w.xt)) << "batch " << batch;
    EXPECT_TRUE(torch::equal(torch::cat({a.text_ids, b.text_ids}), w.text_ids)) << "batch " << batch;
  }
}

// The property: 2 and 3 Gloo ranks on localhost train with the losses and gradient norms of one process
// with the same global batch (fp32; the ranks' gradients are averaged in another order of additions:
// within 1e-5).
TEST(DistributedTraining, RanksReproduceTheSingleProcessLosses) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  for (int64_t ranks : {2, 3}) {
    const int64_t batch = 6;
    const auto one = fresh_dir("one-" + std::to_string(ranks)), many = fresh_dir("many-" + std::to_string(ranks));
    auto r1 = train(resident_args(batch) + " --run-dir " + one);
    ASSERT_EQ(r1.code, 0) << r1.output;
    auto rn = train(resident_args(batch) + " --run-dir " + many + " --nproc-per-node " + std::to_string(ranks));
    ASSERT_EQ(rn.code, 0) << rn.output;
    const auto a = logged_losses(one), b = logged_losses(many);
    ASSERT_EQ(a.size(), 5u);
    ASSERT_EQ(b.size(), 5u) << "rank 0 alone writes metrics.jsonl, one line a step";
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5) << ranks << " ranks, step " << i + 1;
    // The gradient norm before clipping too: AdamW is blind to a gradient's scale, so a sum over the
    // ranks not divided by their number would leave the losses nearly unchanged but not this.
    const auto na = logged(one, "grad_norm"), nb = logged(many, "grad_norm");
    ASSERT_EQ(nb.size(), na.size());
    for (size_t i = 0; i < na.size(); ++i) EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << ranks << " ranks, step " << i + 1;
    std::ifstream log(join_path(many, "train.log"));
    std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("data parallel: " + std::to_string(ranks) + " ranks (gloo backend"), std::string::npos) << text;
    // The all-reduce's bytes a step: every trained parameter's fp32 gradient (the smoke model's 25 066).
    for (const double bytes : logged(many, "exchange_bytes")) EXPECT_EQ(bytes, 4.0 * 25066) << ranks << " ranks";
    io::remove_tree(one);
    io::remove_tree(many);
  }
}

// The property: a checkpoint of a 2-rank run resumes on 1 and on 3 ranks with the losses of the
// uninterrupted single-process run (the resident trainer's state is the same on every rank).
TEST(DistributedTraining, CheckpointResumesAtAnotherWorldSize) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const std::string args = resident_args(6) + " --set train.checkpoint_every=3";
  const auto whole = fresh_dir("whole"), parts = fresh_dir("parts");
  ASSERT_EQ(train(args + " --run-dir " + whole).code, 0);
  auto r = train(args + " --run-dir " + parts + " --nproc-per-node 2");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto expected = logged_losses(whole);
  ASSERT_EQ(expected.size(), 5u);
  expect_resumes_at(args, parts, {1, 3}, expected, 0);
  io::remove_tree(whole);
  io::remove_tree(parts);
}

TEST(DistributedTraining, UnevenBatchAndShardedInt8MomentsAreRefusedNamingTheKey) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto dir = fresh_dir("refused");
  auto uneven = train(resident_args(5) + " --run-dir " + dir + " --nproc-per-node 2");
  EXPECT_EQ(uneven.code, 2) << uneven.output;
  EXPECT_NE(uneven.output.find("train.batch_size"), std::string::npos) << uneven.output;
  auto int8 = train(streamed_args(4, "--set optimizer.state_dtype=int8") + " --run-dir " + dir + " --nproc-per-node 2");
  EXPECT_EQ(int8.code, 2) << int8.output;
  EXPECT_NE(int8.output.find("optimizer.state_dtype"), std::string::npos) << int8.output;
  // Named as coming from the file with the overrides, once, before any rank starts: the batch above, and heads that
  // dense attention's context-parallel group does not divide (each rank said it before).
  EXPECT_NE(uneven.output.find("with --set overrides: train.batch_size"), std::string::npos) << uneven.output;
  auto heads = train(resident_args(4) + " --set model.arch=dense3d --set model.heads=1" +
                     " --set distributed.context_parallel=2 --run-dir " + dir + " --nproc-per-node 2");
  EXPECT_EQ(heads.code, 2) << heads.output;
  const std::string said = "does not divide the model's 1 attention heads";
  const auto first = heads.output.find(said);
  EXPECT_NE(first, std::string::npos) << heads.output;
  EXPECT_EQ(heads.output.find(said, first + 1), std::string::npos) << "said once: " << heads.output;
  EXPECT_EQ(heads.output.find("rank 1"), std::string::npos) << "no rank started: " << heads.output;
  // A run folder that holds a run is refused before the ranks start too (rank 1 saw only rank 0 gone).
  const auto taken = fresh_dir("refused-taken");
  ASSERT_EQ(train(resident_args(4) + " --set train.steps=1 --run-dir " + taken).code, 0);
  auto again = train(resident_args(4) + " --run-dir " + taken + " --nproc-per-node 2");
  EXPECT_EQ(again.code, 2) << again.output;
  EXPECT_NE(again.output.find("already holds a run"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("rank 1"), std::string::npos) << "no rank started: " << again.output;
  io::remove_tree(taken);
  io::remove_tree(dir);
}

// The property: the streamed trainer over 2 and 3 Gloo ranks, its masters and moments sharded, logs the
// losses and gradient norms of one process with the same global batch (fp32, within 1e-5) — with
// block updates as gradients land (no clipping), with clipping (updates after the global norm), and
// with gradient accumulation; and each rank hands the block exchange 2 × 4 B per streamed parameter a
// step (a reduce-scatter of the gradient, an all-gather of the weights) plus padding.
TEST(DistributedTraining, ShardedStreamedRanksReproduceTheSingleProcessLosses) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  struct Case {
    int64_t ranks;
    std::string extra;
  };
  for (const Case& c : {Case{2, "--set train.grad_clip=0"}, Case{3, "--set train.grad_clip=0.05"},
                        Case{2, "--set train.grad_clip=0.5 --set train.grad_accum_steps=2"}}) {
    const auto one = fresh_dir("s-one"), many = fresh_dir("s-many");
    auto r1 = train(streamed_args(6, c.extra) + " --run-dir " + one);
    ASSERT_EQ(r1.code, 0) << r1.output;
    auto rn = train(streamed_args(6, c.extra) + " --run-dir " + many + " --nproc-per-node " + std::to_string(c.ranks));
    ASSERT_EQ(rn.code, 0) << rn.output;
    const auto a = logged_losses(one), b = logged_losses(many);
    ASSERT_EQ(a.size(), 5u);
    ASSERT_EQ(b.size(), 5u);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(a[i], b[i], 1e-5) << c.ranks << " ranks " << c.extra << ", step " << i + 1;
    const auto na = logged(one, "grad_norm"), nb = logged(many, "grad_norm");
    for (size_t i = 0; i < na.size(); ++i)
      EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << c.ranks << " ranks " << c.extra << ", step " << i + 1;
    const int64_t streamed = logged_integer(many, "HostParamStore: ");
    ASSERT_GT(streamed, 0);
    for (double bytes : logged(many, "exchange_bytes")) {
      EXPECT_GE(bytes, 2.0 * 4 * static_cast<double>(streamed));
      EXPECT_LE(bytes, 2.0 * 4 * static_cast<double>(streamed) * 1.01 + 64.0 * static_cast<double>(c.ranks));
    }
    io::remove_tree(one);
    io::remove_tree(many);
  }
}

// The property: with the masters and moments sharded, each of 2 ranks holds half of them: its host
// store is the single process's minus half the master and moments (fp32 compute: 16 B a parameter for
// one process, 4 + 12/2 per rank; the whole compute copy stays on every rank).
TEST(DistributedTraining, EachRankHoldsItsShareOfTheHostState) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto one = fresh_dir("h-one"), many = fresh_dir("h-many");
  ASSERT_EQ(train(streamed_args(4, "--set train.steps=1") + " --run-dir " + one).code, 0);
  auto r = train(streamed_args(4, "--set train.steps=1") + " --run-dir " + many + " --nproc-per-node 2");
  ASSERT_EQ(r.code, 0) << r.output;
  const int64_t params = logged_integer(one, "HostParamStore: ");
  const int64_t single = logged_host_bytes(one), rank0 = logged_host_bytes(many);
  EXPECT_EQ(single, 16 * params);
  // Rank 0's shard of each block is ceil(n / 2) elements: at most one more than half of it.
  EXPECT_GE(rank0, 4 * params + 6 * params);
  EXPECT_LE(rank0, 4 * params + 6 * params + 12 * 2 /*blocks*/);
  io::remove_tree(one);
  io::remove_tree(many);
}

// The EMA of the weights (train.ema_decay) of a sharded run: each rank's shard of it in its shard file,
// put together into model_ema.safetensors; `a` and `b` are two such files whose tensors agree to within
// bf16 rounding (both rounded from fp32 EMAs that differ by float rounding only).
static void expect_same_ema_weights(const std::string& a, const std::string& b, const std::string& what) {
  const auto x = io::read_safetensors(a), y = io::read_safetensors(b);
  ASSERT_EQ(x.tensors.size(), y.tensors.size()) << what;
  for (size_t i = 0; i < x.tensors.size(); ++i) {
    ASSERT_EQ(x.tensors[i].first, y.tensors[i].first) << what;
    const auto u = x.tensors[i].second.to(torch::kFloat32), v = y.tensors[i].second.to(torch::kFloat32);
    EXPECT_TRUE(((u - v).abs() <= 0.008 * u.abs() + 1e-6).all().item<bool>()) << what << ": " << x.tensors[i].first;
  }
}

// The property: a 2-rank run's checkpoint holds one shard file per rank (listed with their checksums
// in the manifest); resumed on 2 ranks it continues bit for bit; resumed on 1 and 3 ranks it
// re-shards and follows the single-process run within 1e-5; its EMA of the weights, put together from
// the ranks' shards, is the single process's, and continues with the resumed run.
TEST(DistributedTraining, ShardedCheckpointsResumeExactlyAndAtOtherWorldSizes) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const std::string args =
      streamed_args(6, "--set train.checkpoint_every=3 --set train.grad_clip=0.05 --set train.ema_decay=0.5");
  const auto whole = fresh_dir("sc-whole"), two = fresh_dir("sc-two"), parts = fresh_dir("sc-parts");
  ASSERT_EQ(train(args + " --run-dir " + whole).code, 0);
  auto r = train(args + " --run-dir " + two + " --nproc-per-node 2");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto single = logged_losses(whole), uninterrupted = logged_losses(two);
  ASSERT_EQ(uninterrupted.size(), 5u);
  const auto checkpoint = join_path(two, "checkpoints/step-0000003");
  const std::string manifest = read_text(join_path(checkpoint, "manifest.json"));
  for (const char* shard : {"shards/rank-00000-of-00002.safetensors", "shards/rank-00001-of-00002.safetensors"}) {
    EXPECT_TRUE(io::path_exists(join_path(checkpoint, shard))) << shard;
    EXPECT_NE(manifest.find(shard), std::string::npos) << manifest;
  }
  // The EMA: every rank's shard put together is the single process's.
  expect_same_ema_weights(join_path(whole, "checkpoints/step-0000005/model_ema.safetensors"),
                          join_path(two, "checkpoints/step-0000005/model_ema.safetensors"), "2 ranks against 1");
  for (const char* world : {"2", "1", "3"}) {
    io::remove_tree(parts);
    ASSERT_EQ(std::system(("cp -r " + two + " " + parts).c_str()), 0);
    auto resumed = train(args + " --run-dir " + parts + " --resume " + join_path(parts, "checkpoints/step-0000003") +
                         (std::string(world) == "1" ? "" : std::string(" --nproc-per-node ") + world));
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const auto got = logged_losses(parts);
    ASSERT_EQ(got.size(), 5u) << world << " ranks";
    for (size_t i = 3; i < 5; ++i) {
      if (std::string(world) == "2") EXPECT_EQ(got[i], uninterrupted[i]) << "same world size, step " << i + 1;
      else EXPECT_NEAR(got[i], single[i], 1e-5) << world << " ranks, step " << i + 1;
    }
    const auto ema = join_path(parts, "checkpoints/step-0000005/model_ema.safetensors");
    if (std::string(world) == "2") {  // the same tensors, bit for bit (the files' configs name other run folders)
      const auto x = io::read_safetensors(ema),
                 y = io::read_safetensors(join_path(two, "checkpoints/step-0000005/model_ema.safetensors"));
      ASSERT_EQ(x.tensors.size(), y.tensors.size());
      for (size_t i = 0; i < x.tensors.size(); ++i)
        EXPECT_TRUE(torch::equal(x.tensors[i].second, y.tensors[i].second))
            << "the resumed EMA: " << x.tensors[i].first;
    } else
      expect_same_ema_weights(join_path(whole, "checkpoints/step-0000005/model_ema.safetensors"), ema,
                              std::string(world) + " ranks resumed");
  }
  // A modified shard is refused (its CRC-32), on any world size, and nothing in the run folder changes.
  for (const char* world : {"2", "1"}) {
    io::remove_tree(parts);
    ASSERT_EQ(std::system(("cp -r " + two + " " + parts).c_str()), 0);
    const auto shard = join_path(parts, "checkpoints/step-0000003/shards/rank-00001-of-00002.safetensors");
    std::string bytes = read_text(shard);
    bytes[bytes.size() - 7] = static_cast<char>(bytes[bytes.size() - 7] ^ 0x20);  // in the data section
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
    const auto before = tree_listing(parts);
    auto refused = train(args + " --run-dir " + parts + " --resume " + join_path(parts, "checkpoints/step-0000003") +
                         (std::string(world) == "1" ? "" : std::string(" --nproc-per-node ") + world));
    EXPECT_EQ(refused.code, 2) << refused.output;
    EXPECT_NE(refused.output.find("rank-00001-of-00002.safetensors"), std::string::npos) << refused.output;
    EXPECT_NE(refused.output.find("CRC-32"), std::string::npos) << refused.output;
    EXPECT_EQ(tree_listing(parts), before) << world << " ranks: the run folder must be untouched";
  }
  // A single-process checkpoint (keyed by parameter name) resumes on 2 ranks, sharded.
  auto resumed = train(args + " --run-dir " + whole + " --resume " + join_path(whole, "checkpoints/step-0000003") +
                       " --nproc-per-node 2");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const auto got = logged_losses(whole);
  for (size_t i = 3; i < 5; ++i) EXPECT_NEAR(got[i], single[i], 1e-5) << "1 -> 2 ranks, step " << i + 1;
  io::remove_tree(whole);
  io::remove_tree(two);
  io::remove_tree(parts);
}

// A tiny Wan (2 blocks of width 24, latents from a safetensors file) for 5 steps of global batches of 6,
// fp32 compute, one thread a rank; `mode` streamed (host state sharded over the ranks) or resident.
std::string wan_args(const std::string& config, const std::string& mode, const std::string& extra = "") {
  return "--config " + config + " --set offload.enabled=" + (mode == "streamed" ? "true" : "false") +
         " --set offload.compute_dtype=fp32 --set train.threads=1 --set train.steps=5 --set train.batch_size=6"
         " --set train.checkpoint_every=0 --set train.log_every=1 " +
         extra;
}

// The property: Wan over 2 and 3 Gloo ranks — resident (gradients all-reduced) and streamed (masters and
// moments sharded, the block exchange) — logs the losses and gradient norms of one process with the same
// global batch (caption dropout and flow-matching draws made for the whole batch), within 1e-5 over 5
// steps; a streamed 2-rank run's checkpoint holds a shard a rank and resumes on 1 and 3 ranks within 1e-5
// of the uninterrupted single process.
TEST(DistributedTraining, WanRanksReproduceTheSingleProcessAndResumeAtOtherWorldSizes) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto base = fresh_dir("wan");
  const auto config = megaslide::testing::write_tiny_wan(join_path(base, "data"), 6);
  for (const char* mode : {"resident", "streamed"}) {
    const auto one = join_path(base, std::string(mode) + "-one");
    auto r1 = train(wan_args(config, mode) + " --run-dir " + one);
    ASSERT_EQ(r1.code, 0) << r1.output;
    const auto a = logged_losses(one), na = logged(one, "grad_norm");
    ASSERT_EQ(a.size(), 5u) << mode;
    for (int64_t ranks : {2, 3}) {
      const auto many = join_path(base, std::string(mode) + "-" + std::to_string(ranks));
      auto rn = train(wan_args(config, mode) + " --run-dir " + many + " --nproc-per-node " + std::to_string(ranks));
      ASSERT_EQ(rn.code, 0) << rn.output;
      const auto b = logged_losses(many), nb = logged(many, "grad_norm");
      ASSERT_EQ(b.size(), 5u) << mode << ", " << ranks << " ranks";
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_NEAR(a[i], b[i], 1e-5) << mode << ", " << ranks << " ranks, step " << i + 1;
        EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << mode << ", " << ranks << " ranks, step " << i + 1;
      }
      EXPECT_NE(read_text(join_path(many, "train.log"))
                    .find("data parallel: " + std::to_string(ranks) + " ranks (gloo backend"),
                std::string::npos);
    }
  }
  // Resuming the sharded streamed run's step-3 checkpoint at other world sizes.
  const std::string args = wan_args(config, "streamed", "--set train.checkpoint_every=3");
  const auto two = join_path(base, "ckpt-two");
  auto r = train(args + " --run-dir " + two + " --nproc-per-node 2");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto single = logged_losses(join_path(base, "streamed-one"));
  EXPECT_TRUE(io::path_exists(join_path(two, "checkpoints/step-0000003/shards/rank-00001-of-00002.safetensors")));
  expect_resumes_at(args, two, {1, 3}, single, 3);
  io::remove_tree(base);
}

// Runs `args` once as one process and once per layout ("--nproc-per-node N --set distributed.context_parallel=n"),
// and expects each layout's losses and gradient norms to be the single process's within 1e-5 over 5 steps.
void expect_layouts_reproduce_one_process(const std::string& base, const std::string& name, const std::string& args,
                                          const std::vector<std::pair<int64_t, int64_t>>& layouts) {
  const auto one = join_path(base, name + "-one");
  auto r1 = train(args + " --run-dir " + one);
  ASSERT_EQ(r1.code, 0) << r1.output;
  const auto a = logged_losses(one), na = logged(one, "grad_norm");
  ASSERT_EQ(a.size(), 5u) << name;
  for (const auto& [world, cp] : layouts) {
    const std::string layout = std::to_string(world) + " ranks, context parallel " + std::to_string(cp);
    const auto many = join_path(base, name + "-" + std::to_string(world) + "-" + std::to_string(cp));
    auto rn = train(args + " --run-dir " + many + " --nproc-per-node " + std::to_string(world) +
                    " --set distributed.context_parallel=" + std::to_string(cp));
    ASSERT_EQ(rn.code, 0) << name << ", " << layout << ": " << rn.output;
    const auto b = logged_losses(many), nb = logged(many, "grad_norm");
    ASSERT_EQ(b.size(), 5u) << name << ", " << layout;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i], b[i], 1e-5) << name << ", " << layout << ", step " << i + 1;
      EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << name << ", " << layout << ", step " << i + 1;
    }
    EXPECT_NE(read_text(join_path(many, "train.log"))
                  .find("context parallel: " + std::to_string(world) + " ranks in groups of " + std::to_string(cp)),
              std::string::npos)
        << name << ", " << layout;
  }
}

// The property: context parallelism — each sample's frames split over a group of ranks, attention over the group —
// trains the DiT family as one process does: the losses and gradient norms of 5 steps within 1e-5, for MegaSlideDiT's
// 3D-DSA (a halo exchange; its fixed offset network with a temporal range of 2.5 frames, so offsets reach past the
// kernel's frames into the neighbours' halo) resident over a group of 2, streamed over 3 and over 2 groups of 2
// (context × data parallelism: 4 ranks), Dense3DDiT (Ulysses) and SwinDiT (windows of 3 frames, every other block
// shifted, crossing the ranks' boundaries) over 2 and 3 ranks. 8 frames: no group size of 3 divides them.
TEST(DistributedTraining, ContextParallelDiTRanksReproduceTheSingleProcess) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto base = fresh_dir("cp-dit");
  const std::string dsa = " --set model.dsa_offsets=frozen --set model.dsa_offset_range=[2.5,3.0,3.0]";
  expect_layouts_reproduce_one_process(base, "megaslide-resident", resident_args(6) + dsa, {{2, 2}});
  expect_layouts_reproduce_one_process(base, "megaslide-streamed", streamed_args(6, dsa), {{3, 3}, {4, 2}});
  expect_layouts_reproduce_one_process(base, "dense3d", resident_args(6) + " --set model.arch=dense3d", {{2, 2}});
  expect_layouts_reproduce_one_process(
      base, "swin", streamed_args(6, "--set model.arch=swin --set model.swin_window=[3,4,4]"), {{3, 3}});
  io::remove_tree(base);
}

// The property: context parallelism trains Wan as one process does (losses and gradient norms within 1e-5 over 5
// steps): dense attention through Ulysses, resident over a group of 2 and streamed over 2 groups of 2, with Wan2.2
// TI2V's clean first frames (per-token timesteps, the masked loss whose per-sample counts span the ranks); the 3D-DSA
// retrofit through its halo, streamed over a group of 3: 3 latent frames, one each, and 6 latent frames, two each,
// with a temporal offset range of 0.5 frames, so that the halo (two frames each way: the kernel's one, the range's
// bound rounded down, one for the interpolation) reaches only the neighbours' frames on the first and last ranks. A
// streamed run over a group of 2 saves a checkpoint at step 3 that resumes with no context parallelism on 1 and on 2
// ranks within 1e-5 of the uninterrupted single process.
TEST(DistributedTraining, ContextParallelWanRanksReproduceTheSingleProcessAndResumeAcrossLayouts) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto base = fresh_dir("cp-wan");
  const auto config = megaslide::testing::write_tiny_wan(join_path(base, "data"), 6);
  const std::string clean = "--set diffusion.first_frame_clean=0.5";
  expect_layouts_reproduce_one_process(base, "resident", wan_args(config, "resident", clean), {{2, 2}});
  expect_layouts_reproduce_one_process(base, "streamed", wan_args(config, "streamed", clean), {{4, 2}});
  expect_layouts_reproduce_one_process(
      base, "dsa3d", wan_args(config, "streamed", "--set model.self_attention=dsa3d --set model.dsa_kernel=[3,3,3]"),
      {{3, 3}});
  const auto six = megaslide::testing::write_tiny_wan(join_path(base, "data-6"), 6, /*frames=*/6);
  expect_layouts_reproduce_one_process(base, "dsa3d-6",
                                       wan_args(six, "streamed",
                                                "--set model.self_attention=dsa3d --set model.dsa_kernel=[3,3,3] "
                                                "--set model.dsa_offset_range=[0.5,1.0,1.0]"),
                                       {{3, 3}});
  // A checkpoint of a run over a group of 2 resumed with no context parallelism, on 1 and on 2 ranks.
  const std::string args = wan_args(config, "streamed", clean + " --set train.checkpoint_every=3");
  const auto two = join_path(base, "ckpt");
  auto r = train(args + " --run-dir " + two + " --nproc-per-node 2 --set distributed.context_parallel=2");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto single = logged_losses(join_path(base, "streamed-one"));
  expect_resumes_at(args, two, {1, 2}, single, 3);
  io::remove_tree(base);
}

// The property: a context-parallel group that does not divide the ranks, or whose dense attention's heads it does
// not divide, is refused before anything is written, naming distributed.context_parallel.
TEST(DistributedTraining, ContextParallelGroupsThatDoNotFitAreRefusedNamingTheKey) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto dir = fresh_dir("cp-refused");
  for (const std::string& extra : {std::string(" --nproc-per-node 3 --set distributed.context_parallel=2"),
                                   std::string(" --nproc-per-node 3 --set distributed.context_parallel=3 --set "
                                               "model.arch=dense3d"),
                                   std::string(" --set distributed.context_parallel=2")}) {
    auto r = train(resident_args(6) + " --run-dir " + dir + extra);
    EXPECT_EQ(r.code, 2) << extra << ": " << r.output;
    EXPECT_NE(r.output.find("distributed.context_parallel"), std::string::npos) << extra << ": " << r.output;
    EXPECT_FALSE(io::path_exists(join_path(dir, "train.log"))) << extra;
  }
  io::remove_tree(dir);
}

// The property: LoRA and LoKr over 2 Gloo ranks — the adapters' gradients all-reduced, every rank holding the whole
// frozen model (resident, or streamed H2D only) — log the losses and gradient norms of one process with the same
// global batch within 1e-5 over 5 steps. (LoRA's dropout masks are drawn per rank and micro-batch, so a run with
// dropout is not the single process's; these runs have none.)
TEST(DistributedTraining, LoraRanksReproduceTheSingleProcess) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto base = fresh_dir("lora");
  const auto config = megaslide::testing::write_tiny_wan(join_path(base, "data"), 6);
  for (const auto& [mode, adapters] :
       std::vector<std::pair<std::string, std::string>>{{"resident", "--set lora.rank=4 --set lora.alpha=8"},
                                                        {"streamed", "--set lora.rank=4 --set lora.alpha=8"},
                                                        {"streamed", "--set lora.type=lokr --set lora.rank=3"}}) {
    const std::string name = mode + (adapters.find("lokr") != std::string::npos ? "-lokr" : "-lora");
    const std::string args = wan_args(config, mode, adapters);
    const auto one = join_path(base, name + "-one"), two = join_path(base, name + "-two");
    auto r1 = train(args + " --run-dir " + one);
    ASSERT_EQ(r1.code, 0) << r1.output;
    auto r2 = train(args + " --run-dir " + two + " --nproc-per-node 2");
    ASSERT_EQ(r2.code, 0) << r2.output;
    const auto a = logged_losses(one), b = logged_losses(two), na = logged(one, "grad_norm"),
               nb = logged(two, "grad_norm");
    ASSERT_EQ(a.size(), 5u) << name;
    ASSERT_EQ(b.size(), a.size()) << name;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i], b[i], 1e-5) << name << ", step " << i + 1;
      EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << name << ", step " << i + 1;
    }
    EXPECT_NE(read_text(join_path(two, "train.log")).find("data parallel: 2 ranks (gloo backend"), std::string::npos)
        << name;
  }
  io::remove_tree(base);
}

// The property: Wan2.2's two experts trained in one run (model.wan.expert both, two random experts) over 2
// Gloo ranks, resident and streamed, train the same expert at every step as one process (every rank draws
// it alike) and log its losses and gradient norms within 1e-5 over 8 steps; both experts are trained.
TEST(DistributedTraining, WanBothExpertsRanksTrainTheSingleProcessExperts) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto base = fresh_dir("wan-both");
  const auto config = megaslide::testing::write_tiny_wan(join_path(base, "data"), 6);
  auto parts = [](const std::string& run_dir) {
    std::ifstream in(join_path(run_dir, "metrics.jsonl"));
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("part"));
    return out;
  };
  for (const char* mode : {"resident", "streamed"}) {
    const std::string args = wan_args(config, mode, "--set model.wan.expert=both --set train.steps=8");
    const auto one = join_path(base, std::string(mode) + "-one"), two = join_path(base, std::string(mode) + "-two");
    auto r1 = train(args + " --run-dir " + one);
    ASSERT_EQ(r1.code, 0) << r1.output;
    auto r2 = train(args + " --run-dir " + two + " --nproc-per-node 2");
    ASSERT_EQ(r2.code, 0) << r2.output;
    const auto experts = parts(one);
    ASSERT_EQ(experts.size(), 8u) << mode;
    EXPECT_EQ(parts(two), experts) << mode;
    EXPECT_NE(std::count(experts.begin(), experts.end(), "high") % 8, 0) << mode << ": both experts trained";
    const auto a = logged_losses(one), b = logged_losses(two), na = logged(one, "grad_norm"),
               nb = logged(two, "grad_norm");
    ASSERT_EQ(b.size(), a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_NEAR(a[i], b[i], 1e-5) << mode << ", step " << i + 1;
      EXPECT_NEAR(na[i], nb[i], 1e-5 * na[i]) << mode << ", step " << i + 1;
    }
  }
  io::remove_tree(base);
}

// The property: ranks whose configs differ are refused at start-up, before a step or a byte of the run:
// every rank exits 2, the differing one naming the first key that differs and both values, rank 0
// naming the ranks that differ. Ranks started as torchrun starts them (each with its own flags).
TEST(DistributedTraining, RanksWithDifferentConfigsAreRefusedNamingTheKey) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const auto dir = fresh_dir("mismatch");
  const int64_t port = free_local_port();
  const std::string bin = std::string(MEGASLIDE_BINARY_DIR) + "/bin/megaslide-train";
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (int rank = 0; rank < 2; ++rank) {
    logs.push_back(dir + "-rank" + std::to_string(rank) + ".log");
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      std::freopen(logs.back().c_str(), "w", stderr);
      std::freopen(logs.back().c_str(), "a", stdout);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      const std::string config = smoke(), lr = rank == 0 ? "train.lr=0.001" : "train.lr=0.002";
      ::execl(bin.c_str(), bin.c_str(), "--config", config.c_str(), "--run-dir", dir.c_str(), "--set", lr.c_str(),
              "--set", "train.device=cpu", "--set", "train.threads=1", "--set", "offload.enabled=false", "--set",
              "train.batch_size=2", "--set", "distributed.timeout_s=30", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  std::vector<std::string> outputs;
  for (size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    outputs.push_back(read_text(logs[r]));
    std::remove(logs[r].c_str());
  }
  EXPECT_EQ(codes, (std::vector<int>{2, 2})) << outputs[0] << outputs[1];
  EXPECT_NE(outputs[1].find("train.lr is 0.002 on this rank (rank 1) but 0.001 on rank 0"), std::string::npos)
      << outputs[1];
  EXPECT_NE(outputs[0].find("rank(s) 1 run a config that differs"), std::string::npos) << outputs[0];
  EXPECT_FALSE(io::path_exists(join_path(dir, "metrics.jsonl"))) << "nothing of the run is written";
  io::remove_tree(dir);
}

// The property: when one rank dies (SIGKILL, no goodbye), the other stops with a non-zero exit and an
// error naming the failed collective within distributed.timeout_s — it does not hang — with either
// trainer (the streamed one also waits on the block exchange of its host thread). The ranks are
// started as torchrun would start them (environment variables), without the local launcher, which
// would stop the survivor itself.
class KilledRank : public ::testing::TestWithParam<bool> {};

TEST_P(KilledRank, MakesTheOtherExitNonZeroWithinTheTimeout) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const std::string offload = std::string("offload.enabled=") + (GetParam() ? "true" : "false");
  const auto dir = fresh_dir(GetParam() ? "killed-streamed" : "killed");
  const int64_t port = free_local_port();
  const double timeout_s = 20.0;
  const std::string bin = std::string(MEGASLIDE_BINARY_DIR) + "/bin/megaslide-train";
  const std::string log0 = dir + "-rank0.log";
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string log = rank == 0 ? log0 : "/dev/null";
      std::freopen(log.c_str(), "w", stderr);
      std::freopen(log.c_str(), "a", stdout);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      const std::string config = smoke();
      const std::string timeout = "distributed.timeout_s=" + std::to_string(timeout_s);
      ::execl(bin.c_str(), bin.c_str(), "--config", config.c_str(), "--run-dir", dir.c_str(), "--set", offload.c_str(),
              "--set", "train.device=cpu", "--set", "train.threads=1", "--set", "train.steps=100000", "--set",
              "train.checkpoint_every=0", "--set", "output.progress=false", "--set", timeout.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  auto cleanup = [&] {
    for (pid_t p : pids) ::kill(p, SIGKILL);
    for (pid_t p : pids) ::waitpid(p, nullptr, 0);
    io::remove_tree(dir);
    std::remove(log0.c_str());
  };
  const auto metrics = join_path(dir, "metrics.jsonl");
  for (int i = 0; i < 6000 && line_count(metrics) < 2; ++i) ::usleep(10000);
  if (line_count(metrics) < 2) {
    cleanup();
    FAIL() << "the 2-rank run did not start training within 60 s";
  }
  ::kill(pids[1], SIGKILL);
  ::waitpid(pids[1], nullptr, 0);
  const auto killed_at = std::chrono::steady_clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = ::waitpid(pids[0], &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - killed_at < std::chrono::duration<double>(timeout_s + 30.0))
    ::usleep(20000);
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  std::ifstream in(log0);
  const std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (done == pids[0]) pids = {};  // both reaped
  else pids = {pids[0]};
  cleanup();
  ASSERT_NE(done, 0) << "rank 0 still ran " << waited_s << " s after rank 1 died (timeout " << timeout_s << " s)";
  ASSERT_TRUE(WIFEXITED(status)) << "rank 0 was killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << " (" << (WIFSIGNALED(status) ? strsignal(WTERMSIG(status)) : "?") << "):\n"
                                 << output;
  EXPECT_NE(WEXITSTATUS(status), 0) << output;
  EXPECT_LE(waited_s, timeout_s + 10.0) << output;
  EXPECT_NE(output.find("rank 0 of 2"), std::string::npos) << output;
}

INSTANTIATE_TEST_SUITE_P(DistributedTraining, KilledRank, ::testing::Values(false, true), [](const auto& info) {
  return info.param ? std::string("Streamed") : std::string("Resident");
});

// The property: in float32 the halo exchange's offset gradients are as close to the float64 gradient as one rank's on
// the whole grid. A trilinear sample's gradient jumps where its position crosses a whole frame (the left difference
// below it, the right one above), and float32 rounds a position n + Δ near a whole frame to one side or the other
// depending on n: a rank numbers its frames from its slab's first, the whole grid from frame 0, so where offsets
// are within rounding of zero (early in training) the temporal gradients of the two differ; the spatial ones,
// numbered alike, do not. Offsets of 1e-4 and 1e-2 frames (near the jumps) and 0.3 (mostly away from them).
TEST(ContextParallel, Dsa3dHaloExchangeInFloat32IsAsCloseToFloat64AsOneRank) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo backend";
  const int64_t B = 4, T = 8, H = 8, W = 8, M = 2, d = 8, G = 1, ranks = 2;
  const std::array<int64_t, 3> kernel{3, 5, 5};
  const int64_t K = 3 * 5 * 5;
  for (const double scale : {1e-4, 1e-2, 0.3}) {
    SCOPED_TRACE("offsets within " + std::to_string(scale) + " frames");
    torch::manual_seed(5);
    const auto q = torch::randn({B, T, H, W, M, d}, torch::kDouble), k = torch::randn_like(q), v = torch::randn_like(q);
    const auto offsets = (torch::rand({B, T, H, W, G, K, 3}, torch::kDouble) * 2 - 1) * scale;
    const auto bias = torch::randn({M, K}, torch::kDouble) * 0.1, dout = torch::randn_like(q);
    const auto whole = [&](torch::ScalarType dtype) {
      const auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).detach().clone().requires_grad_(); };
      std::vector<torch::Tensor> w{leaf(q), leaf(k), leaf(v), leaf(offsets), leaf(bias)};
      (ops::dsa3d(w[0], w[1], w[2], w[3], w[4], kernel, ops::DsaImpl::kCpu) * dout.to(dtype)).sum().backward();
      return w[3].grad().to(torch::kDouble);
    };
    const auto exact = whole(torch::kDouble), one_rank = whole(torch::kFloat);
    const auto split = ops::FrameSplit::balanced(T, ranks);
    std::vector<torch::Tensor> parts(static_cast<size_t>(ranks));
    const auto errors = on_gloo_ranks(ranks, [&](int64_t rank, CommunicatorFrames& group) {
      const auto mine = [&](const torch::Tensor& t) {
        return t.narrow(1, split.begin(rank), split.size(rank)).to(torch::kFloat).clone().requires_grad_();
      };
      auto ql = mine(q), kl = mine(k), vl = mine(v), ol = mine(offsets);
      auto bl = bias.to(torch::kFloat).clone().requires_grad_();
      const auto out = ops::dsa3d_context_parallel(ql, kl, vl, ol, bl, kernel, split, group, ops::DsaImpl::kCpu);
      (out * dout.narrow(1, split.begin(rank), split.size(rank)).to(torch::kFloat)).sum().backward();
      parts[static_cast<size_t>(rank)] = ol.grad().to(torch::kDouble);
    });
    for (const auto& e : errors) ASSERT_EQ(e, "");
    const auto group = torch::cat(parts, 1);
    for (int64_t c = 0; c < 3; ++c) {
      const double one_rank_error = (one_rank.select(-1, c) - exact.select(-1, c)).abs().max().item<double>();
      const double group_error = (group.select(-1, c) - exact.select(-1, c)).abs().max().item<double>();
      std::cout << "offsets within " << scale << ", component " << c << ": largest error against float64, one rank "
                << one_rank_error << ", the group " << group_error << " (largest gradient "
                << exact.select(-1, c).abs().max().item<double>() << ")\n";
      EXPECT_LE(group_error, one_rank_error + 1e-4) << "component " << c;
      if (c > 0 || scale == 0.3)  // numbered alike, or away from the jumps: float32 rounding apart
        EXPECT_LT((group.select(-1, c) - one_rank.select(-1, c)).abs().max().item<double>(), 1e-4) << "component " << c;
    }
  }
}
