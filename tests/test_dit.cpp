// The DiT family: shapes, adaLN-Zero identity at initialisation, gradient reach, and parameter counts
// of the big configs (built on the meta device) against a closed-form count of the architecture.
#include "megaslide/model/dit.h"

#include <gtest/gtest.h>

using namespace megaslide;

namespace {

DiTOptions tiny(Architecture arch) {
  return DiTOptions()
      .arch(arch)
      .in_channels(3)
      .patch({1, 2, 2})
      .hidden(16)
      .layers(2)
      .heads(2)
      .text_dim(8)
      .dsa_kernel({3, 3, 3})
      .swin_window({2, 2, 2});
}

struct Inputs {
  torch::Tensor x, t, text, mask;
};

Inputs inputs(int64_t B = 2) {
  Inputs in;
  in.x = torch::randn({B, 3, 4, 8, 6});
  in.t = torch::randint(0, 1000, {B}, torch::kLong);
  in.text = torch::randn({B, 5, 8});
  in.mask = torch::ones({B, 5}, torch::kBool);
  in.mask.index_put_({0, 4}, false);
  return in;
}

const Architecture kAll[] = {Architecture::kMegaSlide, Architecture::kDense3D, Architecture::kSwin};

}  // namespace

TEST(DiT, OutputHasInputShapeForEveryAttention) {
  for (auto arch : kAll) {
    torch::manual_seed(0);
    DiT model(tiny(arch));
    auto in = inputs();
    auto eps = model(in.x, in.t, in.text, in.mask);
    EXPECT_EQ(eps.sizes(), in.x.sizes()) << to_string(arch);
    EXPECT_FALSE(eps.isnan().any().item<bool>()) << to_string(arch);
  }
}

TEST(DiT, EveryBlockIsTheIdentityAtInitialisation) {
  for (auto arch : kAll) {
    torch::manual_seed(1);
    DiT model(tiny(arch));
    auto in = inputs();
    auto e = model->embed(in.x, in.t, in.text, in.mask);
    for (size_t i = 0; i < model->blocks->size(); ++i) {
      auto h = torch::randn_like(e.tokens);
      auto out = model->blocks[i]->as<DiTBlockImpl>()->forward(h, e.ctx);
      EXPECT_TRUE(torch::equal(out, h)) << to_string(arch) << " block " << i;
    }
    // And the untrained model predicts zero noise (zero-initialised final projection).
    EXPECT_EQ(model(in.x, in.t, in.text, in.mask).abs().max().item<float>(), 0.0f) << to_string(arch);
  }
}

TEST(DiT, EveryParameterReceivesAGradient) {
  for (auto arch : kAll) {
    torch::manual_seed(2);
    DiT model(tiny(arch));
    {
      // Zero-initialised weights would block the gradient of everything upstream of them; give every
      // parameter a random value so that a missing connection shows as a zero gradient.
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.normal_(0.0, 0.3);
    }
    auto in = inputs();
    model(in.x, in.t, in.text, in.mask).pow(2).mean().backward();
    for (const auto& item : model->named_parameters()) {
      const auto& g = item.value().grad();
      ASSERT_TRUE(g.defined()) << to_string(arch) << " " << item.key();
      EXPECT_GT(g.abs().sum().item<double>(), 0.0) << to_string(arch) << " " << item.key();
    }
  }
}

TEST(DiT, RejectsVideosThatAreNotWholePatches) {
  DiT model(tiny(Architecture::kDense3D));
  auto in = inputs();
  EXPECT_THROW(model(torch::randn({2, 3, 4, 7, 6}), in.t, in.text, in.mask), c10::Error);
  EXPECT_THROW(model(torch::randn({2, 4, 4, 8, 6}), in.t, in.text, in.mask), c10::Error);
}

namespace {

// Closed-form parameter count of one block, from the architecture (docs/architecture.md).
int64_t block_formula(const DiTOptions& o) {
  const int64_t D = o.hidden(), Dt = o.text_dim(), M = o.heads();
  const int64_t h = static_cast<int64_t>(std::llround(D * o.mlp_ratio()));
  int64_t n = 4 * (D * D + D);  // self-attention q, k, v, out (dsa) or qkv + proj
  if (o.arch() == Architecture::kMegaSlide) {
    const auto& k = o.dsa_kernel();
    const int64_t K = k[0] * k[1] * k[2], G = o.dsa_groups();
    n += 27 * D + D;                 // depthwise 3x3x3 offset conv
    n += D * G * K * 3 + G * K * 3;  // pointwise offset projection
    n += M * K;                      // relative-position bias
  }
  n += 2 * D;                                             // cross-attention LayerNorm
  n += (D * D + D) + (Dt * 2 * D + 2 * D) + (D * D + D);  // cross-attention q, kv, out
  n += (D * h + h) + (h * D + D);                         // MLP
  n += 6 * D;                                             // modulation table
  return n;
}

int64_t total_formula(const DiTOptions& o) {
  const int64_t D = o.hidden(), C = o.in_channels();
  const auto& p = o.patch();
  const int64_t P = p[0] * p[1] * p[2] * C;
  const int64_t prologue = (P * D + D) + (o.frequency_dim() * D + D) + (D * D + D) + (D * 6 * D + 6 * D);
  const int64_t epilogue = 2 * D + (D * P + P);
  return o.layers() * block_formula(o) + prologue + epilogue;
}

}  // namespace

TEST(DiT, BigConfigsCountTheirParametersOnTheMetaDevice) {
  struct Named {
    const char* file;
    double billions;
  };
  for (auto named : {Named{"28b.yaml", 28.0}, Named{"105b.yaml", 105.0}, Named{"medium-1.5b.yaml", 1.5},
                     Named{"h100nvl-1b.yaml", 1.0}, Named{"small-50m.yaml", 0.05}}) {
    auto config = load_run_config(std::string(MEGASLIDE_SOURCE_DIR) + "/configs/" + named.file);
    for (auto arch : kAll) {
      auto options = DiTOptions::from_config(config).arch(arch);
      auto count = count_dit_parameters(options);  // would need 420 GB for 105b if it allocated
      EXPECT_EQ(count.per_block, block_formula(options)) << named.file << " " << to_string(arch);
      EXPECT_EQ(count.total, total_formula(options)) << named.file << " " << to_string(arch);
      if (arch == Architecture::kMegaSlide) {
        // The file is named after its size: within 6 % of the name (50.9 M for small-50m).
        EXPECT_NEAR(count.total / 1e9, named.billions, 0.06 * named.billions) << named.file;
      }
    }
  }
}

TEST(DiT, MetaDeviceModelsHoldNoStorage) {
  DiT model(tiny(Architecture::kMegaSlide).hidden(4096).heads(32).layers(4).device(torch::kMeta));
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_meta());
}

TEST(DiT, ThePositionTableIsBuiltOncePerGridDeviceAndDtype) {
  // The dense and Swin DiTs add it in every step's prologue: built once, not on the CPU and copied.
  const TokenGrid grid{3, 4, 5};
  const auto a = sincos_position_table(grid, 16, torch::kCPU, torch::kFloat);
  EXPECT_TRUE(torch::equal(a, sincos_position_embedding_3d(grid, 16)));
  EXPECT_EQ(sincos_position_table(grid, 16, torch::kCPU, torch::kFloat).data_ptr(), a.data_ptr()) << "kept";
  const auto b = sincos_position_table(grid, 16, torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(b, a.to(torch::kBFloat16))) << "another dtype: its own table, rounded from the same one";
  EXPECT_EQ(sincos_position_table({3, 4, 6}, 16, torch::kCPU, torch::kFloat).size(0), 72)
      << "another grid: its own table";
}

TEST(DiT, SinCosPositionsAreDistinctPerToken) {
  auto pe = sincos_position_embedding_3d({3, 4, 5}, 16);
  ASSERT_EQ(pe.sizes(), (std::vector<int64_t>{60, 16}));
  auto distances = torch::cdist(pe, pe) + torch::eye(60) * 1e3;
  EXPECT_GT(distances.min().item<float>(), 1e-3);
}

// model.position_embedding: the tokens are the patches plus the 3D sin-cos table where it says so, the
// architecture's choice when unset (dense3d and swin add it, megaslide does not); the config's keys map to it.
TEST(DiT, ThePositionTableIsAddedWhereTheOptionsSay) {
  auto in = inputs();
  for (auto arch : kAll) {
    const bool by_default = arch != Architecture::kMegaSlide;
    for (const std::optional<bool> sincos :
         {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)}) {
      torch::manual_seed(2);
      DiT model(tiny(arch).sincos_positions(sincos));
      const auto tokens = model->embed(in.x, in.t, in.text, in.mask).tokens;
      const auto patches = model->patch_embed(in.x).flatten(2).transpose(1, 2);
      const auto table = sincos_position_embedding_3d(model->token_grid(4, 8, 6), 16);
      const auto expected = sincos.value_or(by_default) ? patches + table : patches;
      EXPECT_TRUE(torch::allclose(tokens, expected, 1e-6, 1e-6)) << to_string(arch);
    }
  }
  RunConfig c;
  c.model.position_embedding = "auto";
  EXPECT_FALSE(DiTOptions::from_config(c).sincos_positions().has_value());
  c.model.position_embedding = "sincos";
  EXPECT_EQ(DiTOptions::from_config(c).sincos_positions(), std::optional<bool>(true));
  c.model.position_embedding = "none";
  EXPECT_EQ(DiTOptions::from_config(c).sincos_positions(), std::optional<bool>(false));
}
