// HostParamStore: layout (per-block flat buffers, parameters as views at packed offsets), memory
// (page-aligned without CUDA, zeroed through first_touch, owned by the views), the memory report per
// state dtype and accumulation, and the error a too-large model gets.
#include "megaslide/offload/host_param_store.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <string>
#include <vector>

#include "megaslide/offload/cpu_adamw.h"

namespace {

using megaslide::offload::BlockSpec;
using megaslide::offload::HostMemoryError;
using megaslide::offload::HostParamStore;
using megaslide::offload::HostParamStoreOptions;

std::vector<BlockSpec> two_blocks() {
  return {{"blocks.0", {{"attn.qkv.weight", {48, 16}}, {"attn.qkv.bias", {48}}, {"mlp.fc1.weight", {3, 5, 7}}}},
          {"blocks.1", {{"norm.weight", {17}}, {"scalar", {}}}}};
}

TEST(HostParamStore, FlatBuffersAreTheConcatenationOfTheParameters) {
  HostParamStore store(two_blocks());
  ASSERT_EQ(store.num_blocks(), 2);
  EXPECT_EQ(store.block_numel(0), 48 * 16 + 48 + 3 * 5 * 7);
  EXPECT_EQ(store.block_numel(1), 17 + 1);
  EXPECT_EQ(store.master(0).scalar_type(), torch::kFloat);
  EXPECT_EQ(store.exp_avg(0).scalar_type(), torch::kFloat);
  EXPECT_EQ(store.exp_avg_sq(0).scalar_type(), torch::kFloat);
  EXPECT_EQ(store.compute(0).scalar_type(), torch::kBFloat16);
  // At accumulation 1 the gradient lands in the compute copy's buffer: no buffer of its own.
  EXPECT_TRUE(store.gradient_in_compute_buffer());
  EXPECT_EQ(store.grad(0).data_ptr(), store.compute(0).data_ptr());
  EXPECT_EQ(store.master(1).sizes(), torch::IntArrayRef({18}));

  const auto bias = store.param(0, "attn.qkv.bias");
  EXPECT_EQ(bias.offset, 48 * 16);
  EXPECT_EQ(bias.master.sizes(), torch::IntArrayRef({48}));
  EXPECT_EQ(store.param(0, "mlp.fc1.weight").master.sizes(), torch::IntArrayRef({3, 5, 7}));
  EXPECT_EQ(store.param(1, "scalar").master.dim(), 0);

  // A write through a parameter's view lands in the block's flat buffer at its offset, and the
  // flat tensors handed out on different calls are the same memory.
  bias.master.fill_(3.5f);
  bias.grad.fill_(-2.0f);
  EXPECT_EQ(store.master(0)[48 * 16].item<float>(), 3.5f);
  EXPECT_EQ(store.master(0)[48 * 16 + 47].item<float>(), 3.5f);
  EXPECT_EQ(store.master(0)[48 * 16 - 1].item<float>(), 0.f);
  EXPECT_EQ(store.master(0)[48 * 16 + 48].item<float>(), 0.f);
  EXPECT_EQ(store.compute(0)[48 * 16].item<float>(), -2.0f);
  EXPECT_EQ(store.master(0).data_ptr(), store.master(0).data_ptr());
}

// Every buffer starts at zero and page-aligned, zeroed through first_touch: here from two threads over
// two halves of each block, as CpuAdamW's pool would (every byte was garbage before: the store does not
// zero anything itself when first_touch is given).
TEST(HostParamStore, BuffersStartZeroedThroughFirstTouchAndPageAligned) {
  for (auto state : {megaslide::offload::StateDtype::kFloat32, megaslide::offload::StateDtype::kInt8}) {
    for (bool separate_grad : {false, true}) {
      HostParamStoreOptions options;
      options.state_dtype = state;
      options.separate_grad = separate_grad;
      std::atomic<int64_t> touched{0};
      options.first_touch = [&](int64_t numel, const std::function<void(int64_t, int64_t)>& zero) {
        std::thread other([&] { zero(numel / 2, numel); });
        zero(0, numel / 2);
        other.join();
        touched += numel;
      };
      HostParamStore store(two_blocks(), options);
      EXPECT_EQ(touched.load(), store.block_numel(0) + store.block_numel(1));
      EXPECT_EQ(store.pinned(), torch::cuda::is_available());
      for (int64_t b = 0; b < store.num_blocks(); ++b) {
        std::vector<torch::Tensor> buffers{store.master(b), store.exp_avg(b), store.exp_avg_sq(b), store.compute(b),
                                           store.grad(b)};
        if (state == megaslide::offload::StateDtype::kInt8) {
          buffers.push_back(store.exp_avg_scale(b));
          buffers.push_back(store.exp_avg_sq_scale(b));
        }
        for (const torch::Tensor& t : buffers) {
          EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4096, 0u) << "block " << b;
          EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0) << "block " << b;
          EXPECT_TRUE(t.is_contiguous());
        }
      }
    }
  }
}

// int8 state: codes of one byte per element, and one fp32 scale per moment for each 256-element group
// of each parameter (groups never straddle two parameters).
TEST(HostParamStore, Int8StateHasPerParameterGroups) {
  HostParamStoreOptions options;
  options.state_dtype = megaslide::offload::StateDtype::kInt8;
  HostParamStore store({{"b", {{"w", {300}}, {"bias", {7}}, {"big", {2, 256}}}}}, options);
  EXPECT_EQ(store.exp_avg(0).scalar_type(), torch::kChar);
  EXPECT_EQ(store.exp_avg_sq(0).scalar_type(), torch::kByte);
  EXPECT_EQ(store.exp_avg_scale(0).numel(), 2 + 1 + 2);
  const auto bias = store.param(0, "bias"), big = store.param(0, "big");
  EXPECT_EQ(bias.group_offset, 2);
  EXPECT_EQ(bias.exp_avg_scale.numel(), 1);
  EXPECT_EQ(big.group_offset, 3);
  EXPECT_EQ(big.exp_avg_sq_scale.numel(), 2);
  const auto r = store.memory_report();
  EXPECT_EQ(r.exp_avg_bytes, 819);
  EXPECT_EQ(r.scale_bytes, 2 * 4 * 5);
  EXPECT_EQ(r.total_bytes(), 819 * (4 + 1 + 1 + 2) + 40);
}

TEST(HostParamStore, ViewsKeepTheMemoryAliveAfterTheStoreIsGone) {
  torch::Tensor master, weight;
  {
    HostParamStore store(two_blocks());
    store.master(1).fill_(1.25f);
    master = store.master(1);
    weight = store.param(1, "norm.weight").master;
  }
  EXPECT_EQ(master.sum().item<float>(), 1.25f * 18);
  weight.fill_(2.f);  // would be a use-after-free under ASan if the view did not own its buffer
  EXPECT_EQ(master[0].item<float>(), 2.f);
}

// docs/offload.md's budget: 14 B per parameter with fp32 moments and a bf16 transfer buffer that also
// takes the gradient (fp32 master 4, m 4, v 4, copy 2), 10 with bf16 moments, 8 with int8 moments plus
// two fp32 scales per 256 elements; accumulation adds a 4 B fp32 gradient; fp32 compute a 4 B transfer
// buffer (the gradient) and none with accumulation. Only the transfer buffer is pinnable (and an uploaded
// fp32 master).
TEST(HostParamStore, MemoryReportMatchesTheBudgetPerParameter) {
  using megaslide::offload::StateDtype;
  HostParamStore store(two_blocks());
  const int64_t n = store.block_numel(0) + store.block_numel(1);
  const auto r = store.memory_report();
  EXPECT_EQ(r.num_blocks, 2);
  EXPECT_EQ(r.num_params, n);
  EXPECT_EQ(r.master_bytes, 4 * n);
  EXPECT_EQ(r.exp_avg_bytes, 4 * n);
  EXPECT_EQ(r.exp_avg_sq_bytes, 4 * n);
  EXPECT_EQ(r.compute_bytes, 2 * n);
  EXPECT_EQ(r.grad_bytes, 0);
  EXPECT_EQ(r.scale_bytes, 0);
  EXPECT_EQ(r.total_bytes(), 14 * n);
  EXPECT_EQ(r.pinnable_bytes, 2 * n);
  EXPECT_EQ(r.pinned_bytes, torch::cuda::is_available() ? 2 * n : 0);

  const std::string table = r.to_string();
  for (const char* row : {"fp32 master", "fp32 exp_avg (m)", "fp32 exp_avg_sq (v)",
                          "bf16 transfer buffer (compute copy / gradient)", "total", "14.000"}) {
    EXPECT_NE(table.find(row), std::string::npos) << "missing '" << row << "' in\n" << table;
  }

  // plan() gives the same figures without allocating.
  EXPECT_EQ(HostParamStore::plan(two_blocks()).total_bytes(), r.total_bytes());
  const auto plan = [&](StateDtype state, c10::ScalarType compute, bool separate_grad) {
    HostParamStoreOptions o;
    o.state_dtype = state;
    o.compute_dtype = compute;
    o.separate_grad = separate_grad;
    return HostParamStore::plan(two_blocks(), o);
  };
  // Groups: 768 + 48 + 105 elements -> 3 + 1 + 1 groups in block 0, 17 + 1 -> 1 + 1 in block 1.
  const int64_t scales = 2 * 4 * 7;
  EXPECT_EQ(plan(StateDtype::kBFloat16, torch::kBFloat16, false).total_bytes(), 10 * n);
  EXPECT_EQ(plan(StateDtype::kInt8, torch::kBFloat16, false).total_bytes(), 8 * n + scales);
  EXPECT_EQ(plan(StateDtype::kFloat32, torch::kBFloat16, true).total_bytes(), 18 * n);
  EXPECT_EQ(plan(StateDtype::kInt8, torch::kHalf, true).grad_bytes, 4 * n);
  EXPECT_EQ(plan(StateDtype::kFloat32, torch::kFloat, false).total_bytes(), 16 * n);
  EXPECT_EQ(plan(StateDtype::kFloat32, torch::kFloat, false).pinnable_bytes, 8 * n);
  EXPECT_EQ(plan(StateDtype::kFloat32, torch::kFloat, true).compute_bytes, 0);
  EXPECT_EQ(plan(StateDtype::kFloat32, torch::kFloat, true).total_bytes(), 16 * n);
  // The same layout, allocated, reports the same.
  HostParamStoreOptions int8;
  int8.state_dtype = StateDtype::kInt8;
  EXPECT_EQ(HostParamStore(two_blocks(), int8).memory_report().total_bytes(), 8 * n + scales);
}

// A 105 B-parameter-class request on a small machine: the error must give the bytes asked for, the
// bytes the machine has, and what to change, and must come before anything is allocated.
TEST(HostParamStore, AbsurdSizeFailsWithBytesAskedBytesAvailableAndAdvice) {
  const int64_t n = int64_t{1} << 46;  // 64 Ti parameters: 896 TiB at 14 B each
  try {
    HostParamStore store({{"huge", {{"weight", {n}}}}});
    FAIL() << "a 1 PiB store was allocated";
  } catch (const HostMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.requested_bytes(), 14 * n);
    EXPECT_NE(msg.find(std::to_string(14 * n)), std::string::npos) << msg;  // bytes asked for
    EXPECT_GT(e.available_bytes(), 0);
    EXPECT_NE(msg.find(std::to_string(e.available_bytes())), std::string::npos) << msg;  // bytes it has
    EXPECT_NE(msg.find("available"), std::string::npos) << msg;
    EXPECT_NE(msg.find("smaller model"), std::string::npos) << msg;  // what to change
    EXPECT_NE(msg.find("more RAM"), std::string::npos) << msg;
  }
}

TEST(HostParamStore, RejectsInvalidSpecsNamingTheParameter) {
  const auto expect_error = [](std::vector<BlockSpec> blocks, HostParamStoreOptions options,
                               const std::string& fragment) {
    try {
      HostParamStore store(std::move(blocks), options);
      ADD_FAILURE() << "expected an error mentioning '" << fragment << "'";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(fragment), std::string::npos)
          << e.what_without_backtrace();
    }
  };
  expect_error({{"b", {{"w", {4, -1}}}}}, {}, "parameter 'w' of block 'b' has a negative dimension");
  expect_error({{"b", {{"w", {4}}, {"w", {2}}}}}, {}, "declares parameter 'w' twice");
  HostParamStoreOptions fp64_compute;
  fp64_compute.compute_dtype = torch::kDouble;
  expect_error({{"b", {{"w", {4}}}}}, fp64_compute, "compute_dtype must be BFloat16, Half or Float");

  HostParamStore store(two_blocks());
  EXPECT_THROW(store.master(2), c10::Error);
  try {
    store.param(1, "nope");
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("has no parameter 'nope'; it has: norm.weight, scalar"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(HostParamStore, SetParamWritesMasterAndItsRoundedCopy) {
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    HostParamStoreOptions options;
    options.compute_dtype = dtype;
    HostParamStore store(two_blocks(), options);
    torch::manual_seed(2);
    const torch::Tensor value = torch::randn({3, 5, 7}, torch::kDouble);
    store.set_param(0, "mlp.fc1.weight", value);
    const auto p = store.param(0, "mlp.fc1.weight");
    EXPECT_TRUE(torch::equal(p.master, value.to(torch::kFloat)));
    EXPECT_TRUE(torch::equal(p.compute, value.to(torch::kFloat).to(dtype)));  // c10's rounding
    EXPECT_THROW(store.set_param(0, "mlp.fc1.weight", torch::zeros({105})), c10::Error);
  }
}

// The store's flat buffers are exactly what CpuAdamW's tensor overload takes: one call per block, the
// gradient read from the compute buffer it lands in and the new copy written over it.
TEST(HostParamStore, FeedsCpuAdamWBlockByBlock) {
  HostParamStore store(two_blocks());
  torch::manual_seed(4);
  for (int64_t b = 0; b < store.num_blocks(); ++b) {
    store.master(b).copy_(torch::randn({store.block_numel(b)}));
    store.grad(b).copy_(torch::randn({store.block_numel(b)}));
  }
  const torch::Tensor master0 = store.master(0).clone();
  megaslide::offload::CpuAdamW adamw({}, 2);
  for (int64_t b = 0; b < store.num_blocks(); ++b) {
    adamw.step_block(store.master(b), store.exp_avg(b), store.exp_avg_sq(b), store.grad(b), store.compute(b), 1, 1e-3);
  }
  EXPECT_FALSE(torch::equal(store.master(0), master0));
  EXPECT_TRUE(torch::equal(store.compute(0), store.master(0).to(torch::kBFloat16)));
  EXPECT_GT(store.exp_avg_sq(1).min().item<float>(), 0.f);
}

// copy_master_to_compute rounds a range of the copy from the master, as CpuAdamW and set_param do.
TEST(HostParamStore, CopyMasterToComputeRoundsARange) {
  HostParamStore store(two_blocks());
  torch::manual_seed(6);
  store.master(0).copy_(torch::randn({store.block_numel(0)}));
  store.compute(0).fill_(7.f);
  store.copy_master_to_compute(0, 10, 100);
  EXPECT_TRUE(torch::equal(store.compute(0).narrow(0, 10, 90), store.master(0).narrow(0, 10, 90).to(torch::kBFloat16)));
  EXPECT_EQ(store.compute(0)[9].item<float>(), 7.f);
  EXPECT_EQ(store.compute(0)[100].item<float>(), 7.f);
  EXPECT_THROW(store.copy_master_to_compute(0, 10, store.block_numel(0) + 1), c10::Error);
}

}  // namespace

// The property: sharded over R ranks, the R stores' shards of every block tile it exactly (contiguous
// pieces of ceil(n / R), the last ones shorter or empty), each store holds only its piece of the
// master and moments (the plan counts exactly those bytes) but the whole compute copy, and set_param
// writes each rank's part of the master and the whole copy — so the ranks' pieces side by side are one
// process's master, and every rank's copy is one process's copy.
TEST(HostParamStore, ShardsTileEachBlockAndKeepTheWholeComputeCopy) {
  using megaslide::offload::shard_range;
  for (auto dtype : {torch::kBFloat16, torch::kFloat}) {
    HostParamStoreOptions base;
    base.compute_dtype = dtype;
    HostParamStore whole(two_blocks(), base);
    torch::manual_seed(4);
    const auto value = torch::randn({3, 5, 7});
    whole.set_param(0, "mlp.fc1.weight", value);
    for (int64_t R : {2, 3, 5}) {
      std::vector<torch::Tensor> pieces;
      int64_t owned_total = 0;
      for (int64_t r = 0; r < R; ++r) {
        HostParamStoreOptions o = base;
        o.shard_rank = r, o.shard_count = R;
        HostParamStore store(two_blocks(), o);
        store.set_param(0, "mlp.fc1.weight", value);
        const auto mine = store.shard(0);
        EXPECT_EQ(mine.begin, shard_range(store.block_numel(0), r, R).begin);
        EXPECT_EQ(store.master(0).numel(), mine.size());
        EXPECT_EQ(store.exp_avg(0).numel(), mine.size());
        EXPECT_FALSE(store.param(0, "mlp.fc1.weight").master.defined());
        // fp32 compute: one process uploads its master and keeps no copy; a rank's copy is the master's values.
        const torch::Tensor expected = dtype == torch::kFloat ? whole.master(0) : whole.compute(0);
        EXPECT_TRUE(torch::equal(store.compute(0), expected)) << R << " ranks, rank " << r;
        pieces.push_back(store.master(0));
        for (int64_t l = 0; l < 2; ++l) owned_total += store.shard(l).size();
        const auto report = store.memory_report();
        EXPECT_EQ(report.master_bytes, 4 * (store.shard(0).size() + store.shard(1).size()));
        EXPECT_EQ(report.compute_bytes, static_cast<int64_t>(c10::elementSize(dtype)) * report.num_params);
      }
      EXPECT_EQ(owned_total, whole.block_numel(0) + whole.block_numel(1)) << R << " ranks";
      EXPECT_TRUE(torch::equal(torch::cat(pieces), whole.master(0))) << R << " ranks";
    }
  }
  HostParamStoreOptions int8;
  int8.state_dtype = megaslide::offload::StateDtype::kInt8;
  int8.shard_count = 2;
  EXPECT_THROW(HostParamStore(two_blocks(), int8), c10::Error);
}
