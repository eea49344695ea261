// WeightStreamer: two slots, caching, byte accounting and gradient copies, on the CPU (streams are
// no-ops there) and, when a GPU is present, on three CUDA streams.
#include "megaslide/offload/weight_streamer.h"

#include <gtest/gtest.h>

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

void check_streams(torch::Device device, StreamMode mode) {
  torch::manual_seed(3);
  const std::vector<int64_t> numels{1000, 777, 1000, 1000, 5, 1000, 1000, 999};
  auto host = host_blocks(numels, at::kBFloat16);
  WeightStreamer s(numels, {device, at::kBFloat16, mode});
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
  check_streams(torch::kCPU, StreamMode::kSync);
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
  EXPECT_THROW(s.prefetch(2, host[2]), c10::Error);  // slot 0 still holds acquired block 0
  EXPECT_THROW(s.prefetch(1, host[1].to(at::kHalf)), c10::Error);  // wrong dtype
  EXPECT_THROW(WeightStreamer({10, 0}, {}), c10::Error);
}

TEST(WeightStreamer, ThreeStreams_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  check_streams(torch::Device(torch::kCUDA, 0), StreamMode::kAsync);
  check_streams(torch::Device(torch::kCUDA, 0), StreamMode::kSync);
}
