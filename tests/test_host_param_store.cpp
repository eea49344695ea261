// HostParamStore: layout (per-block flat buffers, parameters as views at packed offsets), memory
// (page-aligned without CUDA, zeroed, owned by the views), the memory report against DESIGN.md §6,
// and the error a too-large model gets.
#include "megaslide/offload/host_param_store.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
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
  EXPECT_EQ(store.grad(0).scalar_type(), torch::kBFloat16);
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
  EXPECT_EQ(store.grad(0)[48 * 16].item<float>(), -2.0f);
  EXPECT_EQ(store.master(0).data_ptr(), store.master(0).data_ptr());
}

TEST(HostParamStore, BuffersStartZeroedAndPageAlignedWithoutCuda) {
  HostParamStore store(two_blocks());
  if (torch::cuda::is_available()) {
    EXPECT_TRUE(store.pinned());
  } else {
    EXPECT_FALSE(store.pinned());
  }
  for (int64_t b = 0; b < store.num_blocks(); ++b) {
    for (const torch::Tensor& t :
         {store.master(b), store.exp_avg(b), store.exp_avg_sq(b), store.compute(b), store.grad(b)}) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4096, 0u) << "block " << b;
      EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0) << "block " << b;
      EXPECT_TRUE(t.is_contiguous());
    }
  }
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

// DESIGN.md §6: 14 B per parameter persistent (bf16 weight 2, fp32 master 4, m 4, v 4) plus a
// transient bf16 gradient (2).
TEST(HostParamStore, MemoryReportMatchesTheDesignModel) {
  HostParamStore store(two_blocks());
  const int64_t n = store.block_numel(0) + store.block_numel(1);
  const auto r = store.memory_report();
  EXPECT_EQ(r.num_blocks, 2);
  EXPECT_EQ(r.num_params, n);
  EXPECT_EQ(r.master_bytes, 4 * n);
  EXPECT_EQ(r.exp_avg_bytes, 4 * n);
  EXPECT_EQ(r.exp_avg_sq_bytes, 4 * n);
  EXPECT_EQ(r.compute_bytes, 2 * n);
  EXPECT_EQ(r.grad_bytes, 2 * n);
  EXPECT_EQ(r.persistent_bytes(), 14 * n);
  EXPECT_EQ(r.total_bytes(), 16 * n);

  const std::string table = r.to_string();
  for (const char* row : {"fp32 master", "exp_avg (m)", "exp_avg_sq (v)", "bf16 compute copy", "persistent total",
                          "bf16 gradient (transient)", "14.00", "16.00"}) {
    EXPECT_NE(table.find(row), std::string::npos) << "missing '" << row << "' in\n" << table;
  }

  // plan() gives the same figures without allocating; an fp32 gradient costs 4 B.
  const auto planned = HostParamStore::plan(two_blocks());
  EXPECT_EQ(planned.total_bytes(), r.total_bytes());
  HostParamStoreOptions fp32_grad;
  fp32_grad.grad_dtype = torch::kFloat;
  EXPECT_EQ(HostParamStore::plan(two_blocks(), fp32_grad).grad_bytes, 4 * n);
}

// A 105 B-parameter-class request on a small machine: the error must give the bytes asked for, the
// bytes the machine has, and what to change, and must come before anything is allocated.
TEST(HostParamStore, AbsurdSizeFailsWithBytesAskedBytesAvailableAndAdvice) {
  const int64_t n = int64_t{1} << 46;  // 64 Ti parameters: 1 PiB at 16 B each
  try {
    HostParamStore store({{"huge", {{"weight", {n}}}}});
    FAIL() << "a 1 PiB store was allocated";
  } catch (const HostMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.requested_bytes(), 16 * n);
    EXPECT_NE(msg.find(std::to_string(16 * n)), std::string::npos) << msg;  // bytes asked for
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
  HostParamStoreOptions fp32_compute;
  fp32_compute.compute_dtype = torch::kFloat;
  expect_error({{"b", {{"w", {4}}}}}, fp32_compute, "compute_dtype must be BFloat16 or Half");

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

// The store's flat buffers are exactly what CpuAdamW's tensor overload takes: one call per block.
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
    adamw.step_block(store.master(b), store.exp_avg(b), store.exp_avg_sq(b), store.grad(b), store.compute(b), 1,
                     1e-3);
  }
  EXPECT_FALSE(torch::equal(store.master(0), master0));
  EXPECT_TRUE(torch::equal(store.compute(0), store.master(0).to(torch::kBFloat16)));
  EXPECT_GT(store.exp_avg_sq(1).min().item<float>(), 0.f);
}

}  // namespace
