// StreamedStackTrainer, the streamed engine on its own (offload/stack_trainer.h), over block stacks that
// are not a DiT: a user-defined stack trains (the docs' example), parameters without a gradient stay
// unchanged, a non-finite gradient with immediate updates restores the compute copies, and the
// gradient norm reaches the host in one read. Copies are delayed 2 ms on the emulated streams, so an
// update that reads a gradient before its copy lands reads NaN (test_cpu_master_trainer.cpp says how).
#include "megaslide/offload/stack_trainer.h"

#include <ATen/record_function.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <vector>

#include "../docs/examples/residual_mlp_stack.h"
#include "megaslide/io/files.h"
#include "stack_checks.h"

using namespace megaslide;

// Immediate updates (bf16, no clipping) meet a non-finite gradient in the block they are about to
// update: that block and every later one are skipped by the host task itself, which must also give
// each of them its compute copy back (the gradient sat there).
TEST(StreamedStackTrainer, ANonFiniteGradientWithImmediateUpdatesRestoresTheCopies) {
  torch::manual_seed(3);
  auto stack = std::make_shared<example::ResidualMlpStack>(/*depth=*/4, /*dim=*/16, torch::kCPU);
  megaslide::offload::StackTrainerOptions options;
  options.emulated_copy_delay_ms = 2.0;
  megaslide::offload::StreamedStackTrainer trainer(stack, options);
  ASSERT_FALSE(trainer.deferred_updates());
  auto x = torch::randn({32, 16});
  auto y = torch::randn({32, 1});
  example::train_step(trainer, *stack, x, y, 1e-3);
  trainer.synchronize();
  std::vector<torch::Tensor> masters;
  for (int64_t l = 0; l < 4; ++l) masters.push_back(trainer.store().master(l).clone());
  auto bad = x.clone();
  bad[0][0] = std::numeric_limits<float>::infinity();
  const auto r = example::train_step(trainer, *stack, bad, y, 1e-3);
  EXPECT_TRUE(r.skipped);
  trainer.synchronize();
  for (int64_t l = 0; l < 4; ++l) EXPECT_TRUE(torch::equal(trainer.store().master(l), masters[l])) << "block " << l;
  megaslide::testing::expect_compute_copies_are_the_masters(trainer);
  const auto next = example::train_step(trainer, *stack, x, y, 1e-3);
  EXPECT_TRUE(std::isfinite(next.loss) && !next.skipped);
}

TEST(StreamedStackTrainer, AUserDefinedBlockStackTrains) {
  torch::manual_seed(0);
  auto stack = std::make_shared<example::ResidualMlpStack>(/*depth=*/6, /*dim=*/16, torch::kCPU);
  megaslide::offload::StackTrainerOptions options;
  options.compute_dtype = at::kFloat;
  options.grad_clip = 1.0;
  megaslide::offload::StreamedStackTrainer trainer(stack, options);
  auto x = torch::randn({64, 16});
  auto y = (x.sum(1, true) * 0.3).sin();
  double first = 0, last = 0;
  for (int i = 0; i < 60; ++i) {
    auto r = example::train_step(trainer, *stack, x, y, 3e-3);
    ASSERT_TRUE(std::isfinite(r.loss));
    if (i == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
  EXPECT_LE(trainer.streamer().max_resident_blocks(), 2);
  trainer.synchronize();
  EXPECT_NE(stack->log_scale.item<float>(), 0.f)
      << "the prologue's shared input must receive gradients from the blocks";
}

namespace {
// A block with a parameter its forward never reads, and a stack of them.
struct BlockWithUnusedImpl : torch::nn::Module {
  explicit BlockWithUnusedImpl(int64_t dim) {
    fc = register_module("fc", torch::nn::Linear(dim, dim));
    unused = register_parameter("unused", torch::randn({7}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
  torch::Tensor unused;
};
TORCH_MODULE(BlockWithUnused);

class StackWithUnused : public megaslide::offload::StreamedModel {
 public:
  StackWithUnused(int64_t depth, int64_t dim) : head(torch::nn::Linear(dim, 1)) {
    for (int64_t i = 0; i < depth; ++i) blocks.push_back(BlockWithUnused(dim));
  }
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks.size()); }
  torch::nn::Module& block(int64_t i) override { return *blocks[i]; }
  torch::Tensor forward_block(int64_t i, const torch::Tensor& x, const megaslide::offload::BlockInputs&) override {
    return blocks[i]->forward(x);
  }
  std::vector<torch::Tensor> resident_parameters() override { return head->parameters(); }
  std::vector<BlockWithUnused> blocks;
  torch::nn::Linear head;
};
}  // namespace

// The property: with gradient accumulation the global gradient norm, and so the clipped update, has the same bits
// for any offload.optimizer_threads: the host's Σ g² over a block of several million parameters (more than one
// piece of the sum) is cut by size, not by the thread count (it was: 1 and 3 threads gave other norms).
TEST(StreamedStackTrainer, TheAccumulatedGradientNormIsTheSameForAnyOptimizerThreadCount) {
  const int64_t depth = 2, dim = 1500;  // 2.25 M parameters a block: three pieces of the sum
  std::vector<std::unique_ptr<megaslide::offload::StreamedStackTrainer>> trainers;
  std::vector<std::shared_ptr<StackWithUnused>> stacks;
  for (const int threads : {1, 3}) {
    torch::manual_seed(4);
    stacks.push_back(std::make_shared<StackWithUnused>(depth, dim));
    megaslide::offload::StackTrainerOptions options;
    options.compute_dtype = at::kFloat;
    options.grad_clip = 0.5;
    options.grad_accum_steps = 2;
    options.optimizer_threads = threads;
    trainers.push_back(std::make_unique<megaslide::offload::StreamedStackTrainer>(stacks.back(), options));
  }
  torch::manual_seed(5);
  const auto x = torch::randn({4, dim}), y = torch::randn({4, 1});
  for (int k = 0; k < 2; ++k) {
    std::vector<megaslide::offload::StackStepResult> r;
    for (size_t t = 0; t < 2; ++t) {
      auto prologue = [&] {
        megaslide::offload::StackInput in;
        in.hidden = x;
        return in;
      };
      auto epilogue = [&](const torch::Tensor& h) { return torch::mse_loss(stacks[t]->head(h), y); };
      r.push_back(trainers[t]->step(prologue, epilogue, 1e-3));
    }
    EXPECT_EQ(r[0].grad_norm, r[1].grad_norm) << "step " << k + 1;
    EXPECT_GT(r[0].grad_norm, 0.5) << "step " << k + 1 << ": the clip must act";
  }
  for (auto& t : trainers) t->synchronize();
  for (int64_t l = 0; l < depth; ++l)
    EXPECT_TRUE(torch::equal(trainers[0]->store().master(l), trainers[1]->store().master(l))) << "block " << l;
}

TEST(StreamedStackTrainer, ParametersWithoutAGradientAreNotUpdated) {
  // torch::optim::AdamW skips a parameter whose gradient is undefined: no weight decay, no moment update.
  // The streamed trainer must too, although the block's flat gradient buffer holds zeros there.
  for (auto [clip, dtype, state] : {std::tuple{0.0, at::kFloat, megaslide::offload::StateDtype::kFloat32},
                                    std::tuple{1.0, at::kFloat, megaslide::offload::StateDtype::kFloat32},
                                    std::tuple{0.0, at::kBFloat16, megaslide::offload::StateDtype::kInt8},
                                    std::tuple{1.0, at::kBFloat16, megaslide::offload::StateDtype::kBFloat16}}) {
    // immediate and deferred updates; with bf16 compute the gradient lands in the compute buffer, so the
    // unused parameter's copy (zeros landed there) must be rounded back from its master
    SCOPED_TRACE(std::to_string(clip) + " " + c10::toString(dtype) + " " + megaslide::offload::to_string(state));
    torch::manual_seed(1);
    auto stack = std::make_shared<StackWithUnused>(/*depth=*/3, /*dim=*/8);
    const auto unused_before = stack->blocks[1]->unused.detach().clone();
    const auto fc_before = stack->blocks[1]->fc->weight.detach().clone();
    megaslide::offload::StackTrainerOptions options;
    options.compute_dtype = dtype;
    options.state_dtype = state;
    options.grad_clip = clip;
    options.adamw.weight_decay = 0.1;
    options.emulated_copy_delay_ms = 1.0;
    megaslide::offload::StreamedStackTrainer trainer(stack, options);
    auto x = torch::randn({16, 8});
    auto y = torch::randn({16, 1});
    for (int i = 0; i < 3; ++i) {
      auto prologue = [&] {
        megaslide::offload::StackInput in;
        in.hidden = x;
        return in;
      };
      auto epilogue = [&](const torch::Tensor& h) { return torch::mse_loss(stack->head(h), y); };
      trainer.step(prologue, epilogue, 1e-2);
    }
    trainer.synchronize();
    const auto& store = trainer.store();
    const auto unused = store.param(1, "unused");
    EXPECT_TRUE(torch::equal(unused.master, unused_before)) << "no gradient: no update, not even weight decay";
    EXPECT_EQ(unused.exp_avg.to(torch::kFloat).abs().sum().item<float>(), 0.f);
    EXPECT_EQ(unused.exp_avg_sq.to(torch::kFloat).abs().sum().item<float>(), 0.f);
    EXPECT_FALSE(torch::equal(store.param(1, "fc.weight").master, fc_before)) << "used parameters train";
    megaslide::testing::expect_compute_copies_are_the_masters(trainer);
  }
}

// The property: a step of part of the stack (StepBlocks: Wan2.2's two experts each take their own steps)
// is the step of a stack of those blocks alone — the same masters and moments bit for bit, the same bytes
// uploaded — when its AdamW step number is that part's own count of updates; the blocks outside the
// range keep their masters and moments bit for bit. Immediate and deferred updates.
namespace {
void expect_partial_steps_are_the_parts_own(torch::Device device) {
  for (const double clip : {0.0, 1.0}) {
    SCOPED_TRACE("grad_clip " + std::to_string(clip));
    torch::manual_seed(1);
    auto whole = std::make_shared<StackWithUnused>(/*depth=*/4, /*dim=*/8);
    auto part = std::make_shared<StackWithUnused>(/*depth=*/2, /*dim=*/8);
    {
      torch::NoGradGuard no_grad;
      for (int64_t l = 0; l < 2; ++l) {
        auto from = whole->blocks[l + 2]->parameters(), to = part->blocks[l]->parameters();
        for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
      }
    }
    whole->head->to(device);
    part->head->to(device);
    megaslide::offload::StackTrainerOptions options;
    options.device = device;
    options.compute_dtype = at::kFloat;
    options.grad_clip = clip;
    options.emulated_copy_delay_ms = 1.0;
    megaslide::offload::StreamedStackTrainer a(whole, options), b(part, options);
    auto x = torch::randn({16, 8}).to(device);
    auto y = torch::randn({16, 1}).to(device);
    auto prologue = [&] {
      megaslide::offload::StackInput in;
      in.hidden = x;
      return in;
    };
    auto epilogue = [&](const torch::Tensor& h) { return torch::mse_loss(h.mean(1, true), y); };  // nothing resident
    a.step(prologue, epilogue, 1e-2, {0, 2, 1});  // the first part's first update
    a.synchronize();
    std::vector<torch::Tensor> first_part;
    for (int64_t l = 0; l < 2; ++l)
      for (const auto& t : {a.store().master(l), a.store().exp_avg(l), a.store().exp_avg_sq(l)})
        first_part.push_back(t.clone());
    for (int64_t k = 1; k <= 2; ++k) {
      const auto ra = a.step(prologue, epilogue, 1e-2, {2, 4, k});  // the second part's k-th update
      const auto rb = b.step(prologue, epilogue, 1e-2);
      EXPECT_EQ(ra.loss, rb.loss) << "update " << k;
      EXPECT_EQ(ra.h2d_bytes, rb.h2d_bytes) << "update " << k;
    }
    a.synchronize();
    b.synchronize();
    for (int64_t l = 0; l < 2; ++l) {
      EXPECT_TRUE(torch::equal(a.store().master(l + 2), b.store().master(l))) << "block " << l + 2;
      EXPECT_TRUE(torch::equal(a.store().exp_avg(l + 2), b.store().exp_avg(l))) << "block " << l + 2;
      EXPECT_TRUE(torch::equal(a.store().exp_avg_sq(l + 2), b.store().exp_avg_sq(l))) << "block " << l + 2;
    }
    size_t i = 0;
    for (int64_t l = 0; l < 2; ++l)
      for (const auto& t : {a.store().master(l), a.store().exp_avg(l), a.store().exp_avg_sq(l)})
        EXPECT_TRUE(torch::equal(t, first_part[i++])) << "block " << l << " outside the steps' range";
    EXPECT_EQ(a.optimizer_steps(), 3);
    megaslide::testing::expect_compute_copies_are_the_masters(a);
  }
}
}  // namespace

TEST(StreamedStackTrainer, AStepOfPartOfTheStackIsThatPartsOwnStep) {
  expect_partial_steps_are_the_parts_own(torch::kCPU);
}

// The same on a GPU (three CUDA streams; fp32 compute, the same kernels on the same shapes in both stacks).
TEST(StreamedStackTrainer, AStepOfPartOfTheStackIsThatPartsOwnStep_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  expect_partial_steps_are_the_parts_own(torch::Device(torch::kCUDA, 0));
}

// The property: block-boundary checkpoints on the host (StackTrainerOptions::host_activations) give the device
// mode's losses, masters and moments bit for bit over 3 steps of 2 micro-batches, with immediate and deferred
// updates, and add (L - 1) block inputs each way per micro-batch to the copies. On the CPU every copy lands
// 1 ms late (a missed wait reads NaN); on a GPU the copies run on their streams while the blocks compute.
namespace {
void expect_host_activations_are_device_activations(torch::Device device, int64_t batch, int64_t dim) {
  for (const double clip : {0.0, 1.0}) {
    SCOPED_TRACE("grad_clip " + std::to_string(clip));
    const int64_t depth = 5;
    torch::manual_seed(2);
    auto on_device = std::make_shared<StackWithUnused>(depth, dim);
    torch::manual_seed(2);
    auto on_host = std::make_shared<StackWithUnused>(depth, dim);
    on_device->head->to(device);
    on_host->head->to(device);
    megaslide::offload::StackTrainerOptions options;
    options.device = device;
    options.compute_dtype = at::kFloat;
    options.grad_clip = clip;
    options.grad_accum_steps = 2;
    options.emulated_copy_delay_ms = 1.0;
    megaslide::offload::StreamedStackTrainer a(on_device, options);
    options.host_activations = true;
    megaslide::offload::StreamedStackTrainer b(on_host, options);
    auto x = torch::randn({batch, dim}).to(device);
    auto y = torch::randn({batch, 1}).to(device);
    auto prologue = [&] {
      megaslide::offload::StackInput in;
      in.hidden = x;
      return in;
    };
    auto epilogue_a = [&](const torch::Tensor& h) { return torch::mse_loss(on_device->head(h), y); };
    auto epilogue_b = [&](const torch::Tensor& h) { return torch::mse_loss(on_host->head(h), y); };
    const int64_t input_bytes = batch * dim * 4;
    for (int k = 0; k < 3; ++k) {
      const auto ra = a.step(prologue, epilogue_a, 1e-2), rb = b.step(prologue, epilogue_b, 1e-2);
      EXPECT_EQ(ra.loss, rb.loss) << "step " << k + 1;
      EXPECT_EQ(rb.h2d_bytes - ra.h2d_bytes, 2 * (depth - 1) * input_bytes);
      EXPECT_EQ(rb.d2h_bytes - ra.d2h_bytes, 2 * (depth - 1) * input_bytes);
    }
    a.synchronize();
    b.synchronize();
    for (int64_t l = 0; l < depth; ++l) {
      EXPECT_TRUE(torch::equal(a.store().master(l), b.store().master(l))) << "block " << l;
      EXPECT_TRUE(torch::equal(a.store().exp_avg_sq(l), b.store().exp_avg_sq(l))) << "block " << l;
    }
    EXPECT_TRUE(torch::equal(on_device->head->weight.cpu(), on_host->head->weight.cpu()));
  }
}
}  // namespace

TEST(StreamedStackTrainer, HostActivationsAreDeviceActivations) {
  expect_host_activations_are_device_activations(torch::kCPU, 16, 8);
}

// The same on a GPU, large enough that a block's compute outlasts its copies' issue (1024 x 1024 inputs, 4 MiB).
TEST(StreamedStackTrainer, HostActivationsAreDeviceActivations_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no GPU";
  expect_host_activations_are_device_activations(torch::Device(torch::kCUDA, 0), 1024, 1024);
}

namespace {
// How many times a scalar was read out of a tensor (Tensor::item, which on a GPU waits for the device and
// copies) on this thread while a recorder is alive.
int g_scalar_reads = 0;
class ScalarReadRecorder {
 public:
  ScalarReadRecorder() {
    g_scalar_reads = 0;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          if (std::string_view(fn.name()) == "aten::_local_scalar_dense") ++g_scalar_reads;
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
  }
  ~ScalarReadRecorder() { at::removeCallback(handle_); }
  int reads() const { return g_scalar_reads; }

 private:
  at::CallbackHandle handle_;
};

// StackWithUnused with `heads` resident linear layers after the blocks (2 resident parameters each).
class StackWithHeads : public StackWithUnused {
 public:
  StackWithHeads(int64_t depth, int64_t dim, int64_t heads) : StackWithUnused(depth, dim) {
    for (int64_t i = 0; i < heads; ++i) extra.push_back(torch::nn::Linear(dim, dim));
  }
  std::vector<torch::Tensor> resident_parameters() override {
    auto p = StackWithUnused::resident_parameters();
    for (auto& e : extra)
      for (auto& q : e->parameters()) p.push_back(q);
    return p;
  }
  torch::Tensor epilogue_loss(torch::Tensor h, const torch::Tensor& y) {
    for (auto& e : extra) h = h + torch::tanh(e(h));
    return torch::mse_loss(head(h), y);
  }
  std::vector<torch::nn::Linear> extra;
};

// Scalar reads in each of three steps of a streamed trainer over a stack with `heads` resident layers.
std::vector<int> scalar_reads_per_step(int64_t heads, double clip) {
  torch::manual_seed(2);
  auto stack = std::make_shared<StackWithHeads>(/*depth=*/3, /*dim=*/8, heads);
  megaslide::offload::StackTrainerOptions options;
  options.compute_dtype = at::kFloat;
  options.grad_clip = clip;
  megaslide::offload::StreamedStackTrainer trainer(stack, options);
  auto x = torch::randn({16, 8}), y = torch::randn({16, 1});
  std::vector<int> reads;
  for (int i = 0; i < 3; ++i) {
    ScalarReadRecorder recorder;
    auto prologue = [&] {
      megaslide::offload::StackInput in;
      in.hidden = x;
      return in;
    };
    auto r = trainer.step(
        prologue, [&](const torch::Tensor& h) { return stack->epilogue_loss(h, y); }, 1e-2);
    EXPECT_TRUE(std::isfinite(r.grad_norm));
    reads.push_back(recorder.reads());
  }
  return reads;
}
}  // namespace

TEST(StreamedStackTrainer, TheGradientNormReachesTheHostInOneReadWhateverTheResidentParameters) {
  // Each scalar read from a GPU tensor waits for the device: the global norm must fetch every block and
  // resident norm together, not one .item() per resident parameter. 2 vs 12 resident parameters: the
  // same reads per step, with and without clipping (deferred and immediate updates).
  for (double clip : {1.0, 0.0}) {
    SCOPED_TRACE("grad_clip " + std::to_string(clip));
    const auto few = scalar_reads_per_step(0, clip), many = scalar_reads_per_step(5, clip);
    EXPECT_EQ(few, many);
    for (int r : few) EXPECT_LE(r, 3) << "the loss, the block norms and the resident norms: one read each at most";
  }
}

TEST(StreamedStackTrainer, TheDocsShowTheExampleThatIsTested) {
  const std::string doc = io::read_file(std::string(MEGASLIDE_SOURCE_DIR) + "/docs/offload.md");
  const std::string code = io::read_file(std::string(MEGASLIDE_SOURCE_DIR) + "/docs/examples/residual_mlp_stack.h");
  const auto body = code.substr(code.find("namespace example {"));
  EXPECT_NE(doc.find(body), std::string::npos)
      << "docs/offload.md must include docs/examples/residual_mlp_stack.h verbatim";
}
