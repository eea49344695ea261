// StreamedDenoiser: sampling with the DiT's blocks streamed through the WeightStreamer gives the videos
// resident sampling gives (bit for bit in fp32 on the CPU, for the same weights and seeds), holds at
// most two blocks' weights on the "device" (the CPU's slots), leaves the block modules empty between
// calls, and uploads every block once per model call unless its slot still holds it; bf16 streaming
// stays close. Also the --streamed auto|on|off decision.
#include "megaslide/diffusion/streamed_denoiser.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <iostream>

#include "megaslide/diffusion/text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/model/dit_weights.h"

using megaslide::StreamedDenoiser;
using megaslide::StreamedDenoiserOptions;

namespace {

megaslide::RunConfig small_config(int64_t layers) {
  megaslide::RunConfig c;
  c.model.arch = megaslide::Architecture::kDense3D;
  c.model.patch = {1, 2, 2};
  c.model.hidden = 16;
  c.model.layers = layers;
  c.model.heads = 2;
  c.model.text_dim = 8;
  c.data.channels = 3;
  c.data.frames = 2;
  c.data.height = 4;
  c.data.width = 4;
  c.data.max_text_tokens = 4;
  return c;
}

// A model with every parameter random (a fresh DiT is the identity and outputs zeros).
megaslide::TextToVideoModel random_model(const megaslide::RunConfig& config, uint64_t seed) {
  torch::manual_seed(seed);
  megaslide::CaptionTokenizer tokenizer;
  megaslide::TextToVideoModel m{config, megaslide::DiT(megaslide::DiTOptions::from_config(config)),
                                megaslide::TextEncoder(megaslide::TextEncoderOptions(
                                    tokenizer.vocab_size(), config.model.text_dim, config.data.max_text_tokens))};
  torch::NoGradGuard no_grad;
  for (auto& p : m.dit->parameters()) p.copy_(torch::randn_like(p) * 0.3);
  return m;
}

megaslide::Conditioning random_text(int64_t batch, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({batch, 3, 8}), torch::ones({batch, 3}, torch::kBool)};
}

int64_t block_bytes(megaslide::DiT& dit, int64_t l, int64_t itemsize) {
  int64_t n = 0;
  for (const auto& p : dit->blocks[l]->parameters()) n += p.numel();
  return n * itemsize;
}

}  // namespace

TEST(StreamedDenoiser, Fp32StreamingSamplesExactlyTheResidentVideosWithTwoBlocksOnTheDevice) {
  // Three blocks: more than the two slots, so blocks are evicted and uploaded again on every call.
  auto config = small_config(3);
  auto resident_model = random_model(config, 1), streamed_model = random_model(config, 1);  // same weights
  const int64_t L = 3;
  std::vector<int64_t> bytes;
  int64_t total = 0, largest = 0;
  for (int64_t l = 0; l < L; ++l) {
    bytes.push_back(block_bytes(streamed_model.dit, l, 4));
    total += bytes.back();
    largest = std::max(largest, bytes.back());
  }
  megaslide::ResidentDenoiser resident(resident_model.dit);
  StreamedDenoiser streamed(streamed_model.dit, StreamedDenoiserOptions{});
  for (const auto& p : streamed_model.dit->blocks->parameters())
    ASSERT_EQ(p.numel(), 0) << "the blocks' weights live in the denoiser";
  EXPECT_EQ(streamed.host_weight_bytes(), total);
  EXPECT_EQ(streamed.streamer().device_weight_bytes(), 2 * largest) << "two slots as large as the largest block";

  megaslide::DDPMSchedule train(1000, megaslide::BetaSchedule::kLinear);
  auto cond = random_text(2, 2), uncond = random_text(1, 3);
  const int64_t steps = 6;
  for (auto kind : {megaslide::SamplerKind::kDDPM, megaslide::SamplerKind::kDDIM}) {
    auto opts = megaslide::SamplerOptions().kind(kind).steps(steps).guidance_scale(7.5);
    auto a = megaslide::sample(resident, train, opts, {3, 2, 4, 4}, {5, 6}, cond, uncond, torch::kCPU);
    auto& stats = streamed.streamer().stats();
    const int64_t copies_before = stats.h2d_copies, hits_before = stats.cache_hits;
    auto b = megaslide::sample(streamed, train, opts, {3, 2, 4, 4}, {5, 6}, cond, uncond, torch::kCPU);
    ASSERT_GT(a.abs().max().item<double>(), 0.1) << "the model must produce something";
    EXPECT_TRUE(torch::equal(a, b)) << megaslide::to_string(kind) << ": streamed and resident differ by "
                                    << (a - b).abs().max().item<double>();
    // One model call per step (cond and uncond batched); each acquires every block once: an upload, or
    // a cache hit when the block's slot still holds it. With 3 blocks and 2 slots, block 0 and block 2
    // share slot 0, so at least 2 of the 3 blocks are uploaded again on every call.
    EXPECT_EQ((stats.h2d_copies - copies_before) + (stats.cache_hits - hits_before), steps * L);
    EXPECT_GE(stats.h2d_copies - copies_before, steps * 2);
  }
  EXPECT_EQ(streamed.streamer().max_resident_blocks(), 2) << "never more than the two slots, and both were used";
  for (const auto& p : streamed_model.dit->blocks->parameters())
    EXPECT_EQ(p.numel(), 0) << "blocks are unbound between calls";
}

// The property: a denoiser over blocks kept outside it (a streamed trainer's host store: one flat buffer per block,
// each parameter at its own offset, here in reverse order with gaps between them) predicts exactly what the resident
// DiT does in fp32, streams from those buffers without a copy (a change to a buffer shows in the next prediction),
// leaves the module's blocks empty, and refuses weights of another dtype or a parameter outside its buffer.
TEST(StreamedDenoiser, BlocksKeptOutsideItPredictWhatTheResidentDiTDoes) {
  auto config = small_config(3);
  auto resident_model = random_model(config, 4), borrowed_model = random_model(config, 4);  // same weights
  const auto describe = [&](megaslide::DiT& dit, torch::ScalarType dtype) {
    std::vector<megaslide::StreamedBlockWeights> blocks;
    for (int64_t l = 0; l < 3; ++l) {
      megaslide::StreamedBlockWeights w;
      const auto named = dit->blocks[l]->named_parameters(true);
      int64_t at = 5;  // a gap before the first, between each
      std::vector<int64_t> offsets(named.size());
      for (size_t i = named.size(); i-- > 0;) offsets[i] = at, at += named[i].value().numel() + 3;
      w.flat = torch::full({at}, std::nan(""), dtype);
      for (size_t i = 0; i < named.size(); ++i) {
        w.flat.narrow(0, offsets[i], named[i].value().numel()).copy_(named[i].value().detach().reshape({-1}));
        w.offsets.push_back(offsets[i]);
        w.shapes.push_back(named[i].value().sizes().vec());
      }
      blocks.push_back(std::move(w));
    }
    return blocks;
  };
  auto blocks = describe(borrowed_model.dit, torch::kFloat);
  const auto first_block = blocks[0].flat;
  {  // refusals: bf16 buffers for an fp32 denoiser, a parameter past its buffer's end
    auto other = random_model(config, 4);
    EXPECT_THROW(StreamedDenoiser(other.dit, describe(other.dit, torch::kBFloat16), StreamedDenoiserOptions{}),
                 c10::Error);
    auto outside = describe(other.dit, torch::kFloat);
    outside[1].offsets.back() = outside[1].flat.numel();
    EXPECT_THROW(StreamedDenoiser(other.dit, std::move(outside), StreamedDenoiserOptions{}), c10::Error);
  }
  megaslide::ResidentDenoiser resident(resident_model.dit);
  StreamedDenoiser borrowed(borrowed_model.dit, std::move(blocks), StreamedDenoiserOptions{});
  for (const auto& p : borrowed_model.dit->blocks->parameters()) ASSERT_EQ(p.numel(), 0);
  torch::manual_seed(9);
  const auto x = torch::randn({2, 3, 2, 4, 4}), t = torch::tensor({10, 700}, torch::kInt64);
  const auto cond = random_text(2, 2);
  torch::NoGradGuard no_grad;
  const auto a = resident.predict(x, t, cond.text, cond.mask), b = borrowed.predict(x, t, cond.text, cond.mask);
  ASSERT_GT(a.abs().max().item<double>(), 0.1);
  EXPECT_TRUE(torch::equal(a, b)) << "differ by " << (a - b).abs().max().item<double>();
  // The borrowed buffer itself: the next prediction reads it (block 0 is uploaded again: 3 blocks share 2 slots, so
  // slot 0 holds block 2 after a call).
  first_block.mul_(0.5);
  EXPECT_FALSE(torch::equal(borrowed.predict(x, t, cond.text, cond.mask), b));
}

TEST(StreamedDenoiser, TextToVideoThroughAWeightsFileStreamedEqualsResident) {
  // As megaslide-sample loads it: the same weights file, resident or streamed, same prompts and seeds.
  auto config = small_config(2);
  auto model = random_model(config, 4);
  const auto path = "/tmp/megaslide-test-streamed-denoiser-" + std::to_string(::getpid()) + ".safetensors";
  megaslide::save_weights(path, config, model.dit, model.text_encoder, torch::kFloat32);
  auto resident_model = megaslide::load_weights(path), streamed_model = megaslide::load_weights(path);
  megaslide::io::remove_tree(path);
  megaslide::TextToVideo resident(resident_model, torch::kCPU);
  auto denoiser = std::make_shared<StreamedDenoiser>(streamed_model.dit, StreamedDenoiserOptions{});
  megaslide::TextToVideo streamed(streamed_model, torch::kCPU, denoiser);
  auto opts = resident.default_options().steps(5);
  const std::vector<std::string> prompts{"a red blob moves left", "the scene darkens from the top"};
  auto a = resident.generate(prompts, {3, 4}, opts);
  auto b = streamed.generate(prompts, {3, 4}, opts);
  ASSERT_GT((a[0] - a[1]).abs().max().item<double>(), 1e-3) << "different prompts and seeds give different videos";
  EXPECT_TRUE(torch::equal(a, b)) << (a - b).abs().max().item<double>();
  // Two blocks fit the two slots: after the first call every block is a cache hit.
  EXPECT_EQ(denoiser->streamer().stats().h2d_copies, 2);
}

TEST(StreamedDenoiser, Bf16StreamingStaysCloseToFp32) {
  auto config = small_config(3);
  auto m32 = random_model(config, 7), m16 = random_model(config, 7);
  megaslide::ResidentDenoiser resident(m32.dit);
  StreamedDenoiserOptions o;
  o.compute_dtype = at::kBFloat16;
  StreamedDenoiser streamed(m16.dit, o);
  torch::manual_seed(8);
  auto x = torch::randn({2, 3, 2, 4, 4});
  auto t = torch::tensor({10, 700}, torch::kLong);
  auto c = random_text(2, 9);
  torch::NoGradGuard no_grad;
  auto a = resident.predict(x, t, c.text, c.mask), b = streamed.predict(x, t, c.text, c.mask);
  EXPECT_EQ(b.scalar_type(), torch::kFloat32) << "the epilogue runs in fp32";
  EXPECT_FALSE(torch::equal(a, b)) << "bf16 must actually be used";
  // bf16 has an 8-bit mantissa (relative rounding 2^-9 ≈ 0.002 per value); over three random blocks the
  // measured relative error of the output was about 1 %; 5 % leaves room and still catches a wrong block.
  const double rel = (a - b).norm().item<double>() / a.norm().item<double>();
  std::cout << "bf16 streamed vs fp32 resident: relative error " << rel << "\n";
  EXPECT_LT(rel, 0.05) << rel;
}

// The resident sampler's bf16 mode (megaslide-sample --compute-dtype bf16 without streaming) keeps the
// streamed sampler's precision layout — bf16 blocks between fp32 embeddings and final layer — so on the
// CPU the two give the same output bit for bit, for bf16 and fp16 alike.
TEST(StreamedDenoiser, ResidentDenoiserInBf16EqualsStreamedBf16) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    auto config = small_config(3);
    auto m_resident = random_model(config, 7), m_streamed = random_model(config, 7), m32 = random_model(config, 7);
    megaslide::ResidentDenoiser resident(m_resident.dit, dtype), fp32(m32.dit);
    EXPECT_EQ(m_resident.dit->blocks[0]->parameters()[0].scalar_type(), dtype) << "the blocks are converted in place";
    EXPECT_EQ(m_resident.dit->final_proj->weight.scalar_type(), torch::kFloat32) << "the final layer stays fp32";
    StreamedDenoiserOptions o;
    o.compute_dtype = dtype;
    StreamedDenoiser streamed(m_streamed.dit, o);
    torch::manual_seed(8);
    auto x = torch::randn({2, 3, 2, 4, 4});
    auto t = torch::tensor({10, 700}, torch::kLong);
    auto c = random_text(2, 9);
    torch::NoGradGuard no_grad;
    const auto a = resident.predict(x, t, c.text, c.mask), b = streamed.predict(x, t, c.text, c.mask);
    EXPECT_EQ(a.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(a, b)) << c10::toString(dtype) << ": max difference "
                                    << (a - b).abs().max().item<double>();
    EXPECT_FALSE(torch::equal(a, fp32.predict(x, t, c.text, c.mask))) << "the reduced precision must actually be used";
  }
}

TEST(StreamedDenoiser, StreamChoice) {
  using megaslide::StreamChoice;
  EXPECT_EQ(megaslide::parse_stream_choice("auto"), StreamChoice::kAuto);
  EXPECT_EQ(megaslide::parse_stream_choice("on"), StreamChoice::kOn);
  EXPECT_EQ(megaslide::parse_stream_choice("off"), StreamChoice::kOff);
  EXPECT_THROW(megaslide::parse_stream_choice("yes"), c10::Error);
  EXPECT_TRUE(megaslide::should_stream(StreamChoice::kOn, torch::kCPU, 1));
  EXPECT_FALSE(megaslide::should_stream(StreamChoice::kOff, torch::kCPU, int64_t{1} << 50));
  EXPECT_FALSE(megaslide::should_stream(StreamChoice::kAuto, torch::kCPU, int64_t{1} << 50)) << "never on the CPU";
  EXPECT_THROW(megaslide::free_device_memory(torch::kCPU), c10::Error);
}
