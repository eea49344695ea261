// WeightStreamer: two slots, caching, byte accounting and gradient copies, on the CPU (in line in sync
// mode, emulated streams with copy threads and poisoned destinations in async mode) and, when a GPU is
// present, on three CUDA streams.
#include "megaslide/offload/weight_streamer.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <chrono>
#include <stdexcept>

using namespace megaslide::offload;

namespace {
std::vector<at::Tensor> host_blocks(const std::vector<int64_t>& numels, c10::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (size_t l = 0; l < numels.size(); ++l) out.push_back(torch::randn({numels[l]}).to(dtype));
  return out;
}

// A forward then a backward sweep as the trainer runs them.
void sweep(WeightStreamer& s, const std::vector<at::Tensor>& host, std::vector<at::Tensor>* seen = nullptr) {
  const int64_t L = s.num_blocks();
  s.prefetch(0, host[0]);
  for (int64_t l = 0; l < L; ++l) {
    auto w = s.acquire(l);
    if (seen) seen->push_back(w.clone());
    s.release(l);
    if (l + 1 < L) s.prefetch(l + 1, host[l + 1]);
  }
  for (int64_t l = L - 1; l >= 0; --l) {
    if (l == L - 1) s.prefetch(l, host[l]);
    s.acquire(l);
    s.release(l);
    if (l > 0) s.prefetch(l - 1, host[l - 1]);
  }
}

void check_streams(torch::Device device, StreamMode mode, double delay_ms = 0.0) {
  torch::manual_seed(3);
  const std::vector<int64_t> numels{1000, 777, 1000, 1000, 5, 1000, 1000, 999};
  auto host = host_blocks(numels, at::kBFloat16);
  WeightStreamer s(numels, {device, at::kBFloat16, mode, delay_ms});
  std::vector<at::Tensor> seen;
  sweep(s, host, &seen);
  s.synchronize();
  for (size_t l = 0; l < numels.size(); ++l) EXPECT_TRUE(torch::equal(seen[l].cpu(), host[l])) << "block " << l;
  // The forward copies every block; the backward reuses the two the forward left in the slots.
  int64_t total = 0;
  for (auto n : numels) total += 2 * n;
  EXPECT_EQ(s.stats().h2d_bytes, 2 * total - 2 * (999 + 1000));
  EXPECT_EQ(s.stats().cache_hits, 2);
  EXPECT_LE(s.max_resident_blocks(), 2);
  EXPECT_EQ(s.device_weight_bytes(), 2 * 1000 * 2);
}
}  // namespace

TEST(WeightStreamer, ForwardAndBackwardSweepsSeeEachBlocksWeightsAndCountBytes) {
  check_streams(torch::kCPU, StreamMode::kAsync);
  check_streams(torch::kCPU, StreamMode::kAsync, /*delay_ms=*/3.0);  // acquire must wait for late copies
  check_streams(torch::kCPU, StreamMode::kSync);
}

TEST(WeightStreamer, EmulatedCopyDestinationHoldsPoisonUntilItLands) {
  // CPU async mode: the D2H copy runs on its own thread 100 ms late; until then its destination is NaN,
  // so a reader that skips GradCopy::wait reads garbage, as it would on a GPU.
  std::vector<int64_t> numels{64};
  auto host = host_blocks(numels, at::kFloat);
  WeightStreamer s(numels, {torch::kCPU, at::kFloat, StreamMode::kAsync, /*emulated_copy_delay_ms=*/100.0});
  s.prefetch(0, host[0]);
  s.acquire(0);
  s.gradient_buffer(0).copy_(torch::arange(64, torch::kFloat));
  auto dst = torch::zeros({64});
  auto copy = s.offload_gradient(0, dst);
  EXPECT_TRUE(dst.isnan().all().item<bool>()) << "not yet landed: poison";
  copy.wait();
  EXPECT_TRUE(torch::equal(dst, torch::arange(64, torch::kFloat))) << "landed: the gradient";
  s.release(0);
}

TEST(WeightStreamer, FirstUploadIntoASlotWaitsForComputeQueuedBeforeTheSlotsWereMade) {
  // The slots' memory may be what the caching allocator took back from tensors that kernels queued on
  // the compute stream still use; the first upload into each slot must wait for that work as later ones
  // wait for release(). Emulated streams whose compute lane runs 300 ms behind the host: an upload
  // ordered after the compute work queued when the streamer was made lands no earlier than 300 ms after
  // that; an unordered one lands at once.
  constexpr double kLagMs = 300.0;
  std::vector<int64_t> numels{64, 64};
  auto host = host_blocks(numels, at::kFloat);
  const auto made = std::chrono::steady_clock::now();
  WeightStreamerOptions options{torch::kCPU, at::kFloat, StreamMode::kAsync};
  options.emulated_compute_lag_ms = kLagMs;
  WeightStreamer s(numels, options);
  for (int64_t l = 0; l < 2; ++l) {
    s.prefetch(l, host[l]);
    auto w = s.acquire(l);  // the calling thread waits for the upload to land
    const double landed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - made).count();
    EXPECT_GE(landed_ms, kLagMs) << "slot " << l
                                 << "'s first upload did not wait for the compute work queued before it";
    EXPECT_TRUE(torch::equal(w, host[l])) << "slot " << l;
    s.release(l);
  }
}

TEST(WeightStreamer, ASlotsGradientIsZeroedOnlyAfterItsPreviousCopyLeft) {
  // Blocks 0 and 2 share slot 0. The gradient of block 0 is still being copied out (late) when block 2
  // asks for the slot's gradient buffer, which zeroes it: gradient_buffer must wait for the copy first,
  // or block 0's host gradient would arrive as zeros.
  std::vector<int64_t> numels{32, 32, 32};
  auto host = host_blocks(numels, at::kFloat);
  WeightStreamer s(numels, {torch::kCPU, at::kFloat, StreamMode::kAsync, /*emulated_copy_delay_ms=*/50.0});
  s.prefetch(0, host[0]);
  s.acquire(0);
  s.gradient_buffer(0).fill_(3.f);
  auto dst = torch::empty({32});
  auto copy = s.offload_gradient(0, dst);
  s.release(0);
  s.prefetch(2, host[2]);
  s.acquire(2);
  EXPECT_EQ(s.gradient_buffer(2).abs().sum().item<float>(), 0.f);
  copy.wait();
  EXPECT_TRUE(torch::equal(dst, torch::full({32}, 3.f)));
  s.release(2);
}

TEST(WeightStreamer, DeviceMemoryDoesNotGrowWithDepth) {
  for (int64_t depth : {2, 6, 24}) {
    std::vector<int64_t> numels(depth, 512);
    auto host = host_blocks(numels, at::kFloat);
    WeightStreamer s(numels, {torch::kCPU, at::kFloat, StreamMode::kAsync});
    sweep(s, host);
    sweep(s, host);
    EXPECT_EQ(s.max_resident_blocks(), 2) << depth;
    EXPECT_EQ(s.device_weight_bytes(), 2 * 512 * 4) << depth;
  }
}

TEST(WeightStreamer, InvalidatedBlocksAreCopiedAgain) {
  std::vector<int64_t> numels{64, 64};
  auto host = host_blocks(numels, at::kFloat);
  WeightStreamer s(numels, {torch::kCPU, at::kFloat, StreamMode::kAsync});
  sweep(s, host);
  const auto before = s.stats().h2d_copies;
  s.prefetch(0, host[0]);  // still valid: a hit
  EXPECT_EQ(s.stats().h2d_copies, before);
  host[0].fill_(7.f);
  s.invalidate(0);
  s.prefetch(0, host[0]);
  EXPECT_EQ(s.stats().h2d_copies, before + 1);
  EXPECT_TRUE(torch::equal(s.acquire(0), host[0]));
}

// Property: a forward pass in a lent streamer (a validation denoiser in a trainer's slots) reads its own host
// weights, never a block the owner left cached under the same index, and leaves none of its uploads for the owner
// to take as its own; a window of blocks uploads those blocks only.
TEST(WeightStreamer, ALentPassNeitherTakesNorLeavesTheOwnersUploads) {
  for (const auto mode : {StreamMode::kAsync, StreamMode::kSync}) {
    SCOPED_TRACE(to_string(mode));
    std::vector<int64_t> numels{64, 64, 64, 64};
    const auto owner = host_blocks(numels, at::kFloat);
    const auto other = host_blocks(numels, at::kFloat);  // the lent pass's weights: other values, same sizes
    WeightStreamer s(numels, {torch::kCPU, at::kFloat, mode});
    sweep(s, owner);  // the owner's backward leaves blocks 1 and 0 valid in the slots
    const auto before = s.stats().h2d_copies;
    {
      StreamedForward pass(
          s, [&](int64_t l) { return other[static_cast<size_t>(l)]; }, 0, 2, /*lent=*/true);
      for (int64_t l = 0; l < 2; ++l)
        pass.run(l, [&](const at::Tensor& w) { EXPECT_TRUE(torch::equal(w, other[l])) << "block " << l; });
    }
    EXPECT_EQ(s.stats().h2d_copies, before + 2) << "blocks 0 and 1 uploaded, nothing outside the window";
    s.prefetch(0, owner[0]);
    EXPECT_EQ(s.stats().h2d_copies, before + 3) << "the owner's block 0 is uploaded again";
    EXPECT_TRUE(torch::equal(s.acquire(0), owner[0]));
    s.release(0);
    {
      StreamedForward pass(
          s, [&](int64_t l) { return other[static_cast<size_t>(l)]; }, 2, 4, /*lent=*/true);
      for (int64_t l = 2; l < 4; ++l)
        pass.run(l, [&](const at::Tensor& w) { EXPECT_TRUE(torch::equal(w, other[l])) << "block " << l; });
    }
    EXPECT_EQ(s.stats().h2d_copies, before + 5);
    s.synchronize();
  }
}

// Property: a block whose acquire fails (its fp8 upcast throws, as a device out of memory would) is not left
// acquired: the slot takes the next prefetch, and the same block's next acquire upcasts it then.
TEST(WeightStreamer, AFailedAcquireLeavesTheSlotFree) {
  for (const auto mode : {StreamMode::kAsync, StreamMode::kSync}) {
    SCOPED_TRACE(to_string(mode));
    const std::vector<int64_t> numels{16, 16, 16};
    WeightStreamerOptions o{torch::kCPU, at::kFloat, mode};
    o.gradients = false;
    o.transfer_dtype = at::kFloat8_e4m3fn;
    WeightStreamer s(numels, o);
    int failures = 1;
    s.set_upcast([&](int64_t, const at::Tensor& raw, const at::Tensor& weights) {
      if (failures-- > 0) throw std::runtime_error("out of memory (simulated)");
      weights.copy_(raw.to(at::kFloat));
    });
    std::vector<at::Tensor> host;
    for (int64_t l = 0; l < 3; ++l) host.push_back(torch::full({16}, 1.0 + l).to(at::kFloat8_e4m3fn));
    s.prefetch(0, host[0]);
    EXPECT_THROW(s.acquire(0), std::runtime_error);
    EXPECT_TRUE(torch::equal(s.acquire(0), torch::full({16}, 1.f))) << "the upcast is retried";
    s.release(0);
    s.prefetch(0, host[0]);
    failures = 1;
    s.invalidate(0);
    s.prefetch(0, host[0]);
    EXPECT_THROW(s.acquire(0), std::runtime_error);
    EXPECT_NO_THROW(s.prefetch(2, host[2])) << "slot 0 is free for another block";
    EXPECT_TRUE(torch::equal(s.acquire(2), torch::full({16}, 3.f)));
    s.release(2);
    s.synchronize();
  }
}

TEST(WeightStreamer, GradientsReachTheHost) {
  std::vector<int64_t> numels{100, 50};
  auto host = host_blocks(numels, at::kHalf);
  WeightStreamer s(numels, {torch::kCPU, at::kHalf, StreamMode::kAsync});
  s.prefetch(1, host[1]);
  s.acquire(1);
  auto g = s.gradient_buffer(1);
  EXPECT_EQ(g.numel(), 50);
  EXPECT_EQ(g.abs().sum().item<double>(), 0.0);  // zeroed for the backward to accumulate into
  g.copy_(torch::arange(50).to(at::kHalf));
  auto dst = torch::empty({50}, at::kHalf);
  s.offload_gradient(1, dst).wait();
  s.release(1);
  EXPECT_TRUE(torch::equal(dst, torch::arange(50).to(at::kHalf)));
  EXPECT_EQ(s.stats().d2h_bytes, 100);
}

TEST(WeightStreamer, MisuseIsReportedClearly) {
  std::vector<int64_t> numels{10, 10, 10};
  auto host = host_blocks(numels, at::kFloat);
  WeightStreamer s(numels, {torch::kCPU, at::kFloat, StreamMode::kAsync});
  EXPECT_THROW(
      try { s.acquire(1); } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("call prefetch(block) first"), std::string::npos) << e.what();
        throw;
      },
      c10::Error);
  s.prefetch(0, host[0]);
  s.acquire(0);
  EXPECT_THROW(s.prefetch(2, host[2]), c10::Error);                // slot 0 still holds acquired block 0
  EXPECT_THROW(s.prefetch(1, host[1].to(at::kHalf)), c10::Error);  // wrong dtype
  EXPECT_THROW(WeightStreamer({10, 0}, {}), c10::Error);
}

TEST(WeightStreamer, ThreeStreams_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  check_streams(torch::Device(torch::kCUDA, 0), StreamMode::kAsync);
  check_streams(torch::Device(torch::kCUDA, 0), StreamMode::kSync);
  check_streams(torch::kCUDA, StreamMode::kAsync);  // "cuda" without an index is the current GPU
}

TEST(WeightStreamer, GradientCopiesLandBeforeWaitReturns_CUDA) {
  // A large gradient through pinned memory on the D2H stream: the host sees it only after wait().
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  const int64_t n = int64_t{1} << 24;
  std::vector<int64_t> numels{n, n};
  auto host = host_blocks(numels, at::kBFloat16);
  for (auto& h : host) h = h.pin_memory();
  WeightStreamer s(numels, {torch::kCUDA, at::kBFloat16, StreamMode::kAsync});
  for (int round = 0; round < 3; ++round) {
    const int64_t l = round % 2;
    s.prefetch(l, host[l]);
    s.acquire(l);
    auto g = s.gradient_buffer(l);
    g.copy_(torch::full({n}, static_cast<float>(round + 1), g.options()));
    auto dst = torch::empty({n}, torch::TensorOptions().dtype(at::kBFloat16).pinned_memory(true));
    dst.fill_(-1.f);
    auto copy = s.offload_gradient(l, dst);
    s.release(l);
    copy.wait();
    EXPECT_EQ(dst.to(torch::kFloat).min().item<float>(), static_cast<float>(round + 1)) << "round " << round;
    EXPECT_EQ(dst.to(torch::kFloat).max().item<float>(), static_cast<float>(round + 1)) << "round " << round;
  }
}
