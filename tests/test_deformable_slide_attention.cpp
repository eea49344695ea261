// DeformableSlideAttention3D: by default it runs the fused 3D-DSA kernel, which gives the same output
// and parameter gradients as the grid_sample reference, and the module trains through it.
#include "megaslide/model/deformable_slide_attention.h"
#include "megaslide/model/dit.h"
#include "trainers.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/types.h>
#include <torch/optim/adam.h>
#include <torch/cuda.h>

#ifdef MEGASLIDE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <deque>
#include <memory>
#include <set>
#include <string>

using namespace megaslide::testing;
using megaslide::Trainer;

namespace {

using megaslide::DeformableSlideAttention3D;
using megaslide::DeformableSlideAttention3DImpl;
using megaslide::DeformableSlideAttentionOptions;
using megaslide::TokenGrid;
namespace ops = megaslide::ops;

// Names of every autograd node reachable from t's grad_fn.
std::set<std::string> graph_node_names(const torch::Tensor& t) {
  std::set<std::string> names;
  std::deque<std::shared_ptr<torch::autograd::Node>> todo{t.grad_fn()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto node = todo.front();
    todo.pop_front();
    if (!node || !seen.insert(node.get()).second) continue;
    names.insert(node->name());
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function);
  }
  return names;
}

bool has_node(const std::set<std::string>& names, const std::string& fragment) {
  for (const auto& n : names)
    if (n.find(fragment) != std::string::npos) return true;
  return false;
}

// A module with a non-zero offset network (so offsets and their gradients are exercised) and bias.
DeformableSlideAttention3D make_module(ops::DsaImpl impl) {
  torch::manual_seed(3);
  DeformableSlideAttention3D m(DeformableSlideAttentionOptions(8, 2).kernel({3, 3, 3}).groups(2).impl(impl));
  torch::NoGradGuard no_grad;
  m->offset_pw->weight.normal_(0, 0.3);
  m->rel_bias.normal_(0, 0.5);
  return m;
}

}  // namespace

// The default (kAuto) module runs ops::dsa3d's fused CPU kernel (its autograd node is in the graph);
// kReference runs grid_sample instead.
TEST(DeformableSlideAttention, DefaultUsesTheFusedKernel) {
  const TokenGrid grid{2, 4, 5};
  auto fused = make_module(ops::DsaImpl::kAuto);
  EXPECT_EQ(fused->options.impl(), ops::DsaImpl::kAuto);
  auto x = torch::randn({1, grid.numel(), 8});
  const auto names = graph_node_names(fused->forward(x, grid));
  EXPECT_TRUE(has_node(names, "FusedDsa3d"));
  EXPECT_FALSE(has_node(names, "GridSampler"));
  const auto ref_names = graph_node_names(make_module(ops::DsaImpl::kReference)->forward(x, grid));
  EXPECT_FALSE(has_node(ref_names, "FusedDsa3d"));
  EXPECT_TRUE(has_node(ref_names, "GridSampler"));
}

// Same weights, float64: output and the gradient of every parameter (offset network and bias
// included) agree between the fused and the reference path to 1e-10 (round-off). The grid
// 2x4x5 is smaller than the kernel along t, so the kernel shrinks (sub-window of the bias).
TEST(DeformableSlideAttention, FusedAndReferenceGiveTheSameGradients) {
  const TokenGrid grid{2, 4, 5};
  auto fused = make_module(ops::DsaImpl::kCpu);
  auto ref = make_module(ops::DsaImpl::kReference);
  fused->to(torch::kDouble);
  ref->to(torch::kDouble);
  torch::manual_seed(4);
  auto x = torch::randn({2, grid.numel(), 8}, torch::kDouble);
  auto target = torch::randn({2, grid.numel(), 8}, torch::kDouble);
  auto out_f = fused->forward(x, grid), out_r = ref->forward(x, grid);
  EXPECT_LE((out_f - out_r).abs().max().item<double>(), 1e-10);
  ((out_f - target).pow(2).sum()).backward();
  ((out_r - target).pow(2).sum()).backward();
  const auto pf = fused->named_parameters(), pr = ref->named_parameters();
  ASSERT_EQ(pf.size(), pr.size());
  for (const auto& item : pf) {
    const auto& gf = item.value().grad();
    const auto& gr = pr[item.key()].grad();
    ASSERT_TRUE(gf.defined() && gr.defined()) << item.key();
    EXPECT_LE((gf - gr).abs().max().item<double>(), 1e-10) << item.key();
  }
  EXPECT_GT(fused->offset_pw->weight.grad().abs().max().item<double>(), 1e-6);  // offsets do get gradient
}

// On a grid smaller than the kernel the offsets are those of the kernel's centre sub-window, scaled
// per axis by the range (1, 2, 3): equal to an explicit index_select of the full kernel's offsets and
// a multiplication by the range as a tensor (what the module no longer builds in its forward).
TEST(DeformableSlideAttention, SmallGridOffsetsAreTheCentreWindowScaledByTheRange) {
  torch::manual_seed(6);
  const TokenGrid grid{2, 3, 9};
  DeformableSlideAttention3D m(DeformableSlideAttentionOptions(8, 2).kernel({3, 5, 7}).offset_range({1.0, 2.0, 3.0}));
  {
    torch::NoGradGuard no_grad;
    m->offset_pw->weight.normal_(0, 0.5);
  }
  auto x = torch::randn({2, grid.numel(), 8});
  const auto eff = ops::effective_kernel({3, 5, 7}, grid.dims());
  ASSERT_EQ(eff, (std::array<int64_t, 3>{2, 3, 7}));
  std::vector<int64_t> index;
  for (int64_t t = 0; t < eff[0]; ++t)
    for (int64_t h = 0; h < eff[1]; ++h)
      for (int64_t w = 0; w < eff[2]; ++w)
        index.push_back(((0 + t) * 5 + (1 + h)) * 7 + w);  // centred: (3-2)/2, (5-3)/2
  torch::NoGradGuard no_grad;
  auto volume = x.view({2, grid.t, grid.h, grid.w, 8}).permute({0, 4, 1, 2, 3});
  auto o = m->offset_pw(torch::gelu(m->offset_dw(volume)).permute({0, 2, 3, 4, 1})).view({2, 2, 3, 9, 1, 105, 3});
  auto expected = torch::tanh(o.index_select(5, torch::tensor(index))) * torch::tensor({1.0f, 2.0f, 3.0f});
  const auto got = m->offsets(x, grid);
  ASSERT_EQ(got.sizes(), expected.sizes());
  EXPECT_TRUE(torch::allclose(got, expected, 0, 1e-7)) << (got - expected).abs().max().item<double>();
}

// Training through the fused path: 30 Adam steps fitting a fixed target lower the loss, and the
// zero-initialised offset network leaves zero (its gradient flows through d(offsets)).
TEST(DeformableSlideAttention, TrainsThroughTheFusedKernel) {
  torch::manual_seed(5);
  const TokenGrid grid{3, 4, 4};
  DeformableSlideAttention3D m(DeformableSlideAttentionOptions(8, 2).kernel({3, 3, 3}));
  auto x = torch::randn({2, grid.numel(), 8});
  auto target = torch::randn({2, grid.numel(), 8});
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(m->forward(x, grid), target);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.9 * first);
  EXPECT_GT(m->offset_pw->weight.abs().max().item<double>(), 0.0);
  EXPECT_GT(m->rel_bias.abs().max().item<double>(), 0.0);
}

namespace {

// Block 0's offsets for a fixed input, from a DiT trained by either trainer.
torch::Tensor block0_offsets(megaslide::DiT& dit, const megaslide::RunConfig& c) {
  const TokenGrid grid = dit->token_grid(c.data.frames, c.data.height, c.data.width);
  torch::manual_seed(7);
  auto x = torch::randn({1, grid.numel(), c.model.hidden});
  torch::NoGradGuard no_grad;
  return dit->blocks[0]->as<megaslide::DiTBlockImpl>()->dsa_attn->offsets(x, grid).clone();
}

bool has_offset_parameters(megaslide::DiT& dit) {
  for (const auto& item : dit->named_parameters(true))
    if (item.key().find("offset") != std::string::npos) return true;
  return false;
}

megaslide::RunConfig offsets_config(const std::string& mode) {
  // Weight decay on: AdamW would move any parameter, even one without gradient, in the streamed trainer.
  return megaslide::parse_run_config(
      "", "test",
      {"model.dsa_offsets=" + mode, "train.device=cpu", "train.lr=1e-2", "train.weight_decay=0.1",
       "train.warmup_steps=0", "train.batch_size=2", "offload.optimizer_threads=1"});
}

}  // namespace

// model.dsa_offsets: "zero" has no offset network and Δ = 0; "frozen" has non-zero offsets that are not
// parameters and stay exactly the same while both trainers train (weight decay included); the two
// trainers build the same frozen offsets (seeded by block index). "learned" offsets start at zero
// and move when trained.
TEST(DeformableSlideAttention, ZeroAndFrozenOffsetsStayFixedWhileTraining) {
  {
    const auto c = offsets_config("zero");
    megaslide::Trainer t = resident_trainer(c);
    EXPECT_FALSE(has_offset_parameters(dit_module(t)));
    for (int i = 0; i < 3; ++i) t.step();
    EXPECT_EQ(block0_offsets(dit_module(t), c).abs().max().item<double>(), 0.0);
  }
  {
    const auto c = offsets_config("frozen");
    megaslide::Trainer resident = resident_trainer(c);
    megaslide::Trainer streamed = streamed_trainer(c);
    EXPECT_FALSE(has_offset_parameters(dit_module(resident)));
    const auto before = block0_offsets(dit_module(resident), c);
    EXPECT_GT(before.abs().max().item<double>(), 0.1);  // genuinely deformed, not zero
    EXPECT_TRUE(torch::equal(before, block0_offsets(dit_module(streamed), c)));
    for (int i = 0; i < 3; ++i) resident.step(), streamed.step();
    streamed.synchronize();
    EXPECT_TRUE(torch::equal(before, block0_offsets(dit_module(resident), c)));
    EXPECT_TRUE(torch::equal(before, block0_offsets(dit_module(streamed), c)));
  }
  {
    const auto c = offsets_config("learned");
    megaslide::Trainer t = resident_trainer(c);
    EXPECT_TRUE(has_offset_parameters(dit_module(t)));
    EXPECT_EQ(block0_offsets(dit_module(t), c).abs().max().item<double>(), 0.0);  // zero-initialised last layer
    for (int i = 0; i < 3; ++i) t.step();
    EXPECT_GT(block0_offsets(dit_module(t), c).abs().max().item<double>(), 0.0);
  }
}

// ---- CUDA (skipped without a GPU) -----------------------------------------------------------------------

// The module's forward does no host-to-device copy and no host sync: it can be captured in a CUDA
// graph (a pageable host-to-device copy during capture is an error) and replayed, giving the eager
// result. Float32 (the row kernel) and bfloat16 (the tiled kernel), on a grid smaller than the kernel
// (sub-window path) and a larger one; offset range (1, 3, 3) (per-axis scaling).
TEST(DeformableSlideAttention, ForwardCapturesInACudaGraph_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
#ifndef MEGASLIDE_WITH_CUDA
  GTEST_SKIP() << "a build without CUDA kernels";
#else
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const TokenGrid grid : {TokenGrid{2, 5, 6}, TokenGrid{4, 8, 8}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " grid " + std::to_string(grid.t) + "x" +
                   std::to_string(grid.h) + "x" + std::to_string(grid.w));
      torch::manual_seed(7);
      DeformableSlideAttention3D m(
          DeformableSlideAttentionOptions(32, 2).kernel({3, 7, 7}).offset_range({1.0, 3.0, 3.0}));
      {
        torch::NoGradGuard no_grad;
        m->offset_pw->weight.normal_(0, 0.3);
      }
      m->to(torch::kCUDA, dtype);
      torch::NoGradGuard no_grad;
      auto x = torch::randn({2, grid.numel(), 32}, torch::TensorOptions().device(torch::kCUDA).dtype(dtype));
      const auto eager = m->forward(x, grid).clone();  // also the warm-up (kernel attributes set once)
      at::cuda::CUDAStream stream = at::cuda::getStreamFromPool();
      torch::Tensor captured;
      at::cuda::CUDAGraph graph;
      {
        at::cuda::CUDAStreamGuard guard(stream);
        graph.capture_begin();
        captured = m->forward(x, grid);
        graph.capture_end();
      }
      graph.replay();
      torch::cuda::synchronize();
      EXPECT_TRUE(torch::allclose(captured.to(torch::kFloat), eager.to(torch::kFloat), 1e-3, 1e-3));
    }
  }
#endif
}
