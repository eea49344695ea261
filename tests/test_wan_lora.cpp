// LoRA files of a Wan DiT (model/wan_lora.h) against diffusers and PEFT on the tiny Wan fixture
// (tests/fixtures/wan_lora/, tools/make_fixtures.py wan_lora):
//   - a LoRA trained by PEFT and saved by WanPipeline.save_lora_weights, read here and merged into the base,
//     gives the DiT's output with the adapter loaded in diffusers within 1e-5 (fp32), at scale 1 and 0.6;
//   - every layout (diffusers/PEFT, ComfyUI's original names, musubi-tuner's) written here reads back to the
//     same adapters, bit for bit, alpha included; the diffusers layout written here has the names and adapter
//     config of diffusers' own file;
//   - files that are not this model's LoRA are refused naming the file and the tensor;
//   - PEFT's LoKr adapters (tests/fixtures/wan_lokr/, tools/make_fixtures.py wan_lokr) merged here give PEFT's
//     output within 1e-5, and every layout reads them back with the same update, ComfyUI's with LyCORIS' scale.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <iostream>
#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_lora.h"
#include "megaslide/model/wan_weights.h"

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/";
const std::string kLora = kFixtures + "wan_lora/lora.safetensors";

std::string scratch(const std::string& name) {
  const auto dir = "/tmp/megaslide-test-wan-lora-" + std::to_string(::getpid());
  megaslide::io::make_directories(dir);
  return megaslide::io::join_path(dir, name);
}

// The wan fixture's model "a" as published (diffusers' layout).
megaslide::WanTransformer base_model() {
  auto weights = megaslide::WanWeights::open(kFixtures + "wan/a/diffusers");
  megaslide::RunConfig c;
  c.model.arch = megaslide::Architecture::kWan;
  c.model.wan = weights.architecture(megaslide::WanConfig());
  megaslide::WanTransformer model(megaslide::WanOptions::from_config(c));
  megaslide::load_wan_weights(weights, *model);
  model->eval();
  return model;
}

std::vector<std::string> names_of(megaslide::WanTransformer& model) {
  std::vector<std::string> out;
  for (const auto& p : model->named_parameters(true)) out.push_back(p.key());
  return out;
}

std::map<std::string, torch::Tensor> reference() {
  std::map<std::string, torch::Tensor> r;
  for (auto& [k, v] : megaslide::io::read_safetensors(kFixtures + "wan_lora/reference.safetensors").tensors) r[k] = v;
  return r;
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

torch::Tensor output(megaslide::WanTransformer& model, const std::map<std::string, torch::Tensor>& r) {
  torch::NoGradGuard no_grad;
  return model->forward(r.at("x"), r.at("timesteps"), r.at("text"));
}

}  // namespace

// The property: diffusers' own LoRA file (PEFT's lora_A / lora_B, r 4, alpha 6 in the adapter metadata) merged
// into the base computes the output diffusers computes with the adapter loaded, within 1e-5 (fp32), at adapter
// weight 1 and 0.6; the base alone computes diffusers' output without it.
TEST(WanLora, DiffusersFileMergedGivesDiffusersOutputWithTheAdapter) {
  const auto r = reference();
  auto base = base_model();
  EXPECT_LT(max_diff(output(base, r), r.at("out_base")), 1e-5);
  const auto lora = megaslide::read_wan_lora(kLora, names_of(base));
  EXPECT_EQ(lora.layout, megaslide::LoraLayout::kDiffusers);
  ASSERT_EQ(lora.adapters.size(), 20u) << "2 blocks x (4 + 4 attention projections, 2 FFN linears)";
  for (const auto& [weight, a] : lora.adapters) {
    EXPECT_EQ(a.rank(), 4) << weight;
    EXPECT_EQ(a.alpha, 6.0) << weight;
  }
  EXPECT_TRUE(lora.adapters.count("blocks.1.attn2.to_out.0.weight"));
  EXPECT_TRUE(lora.adapters.count("blocks.0.ffn.net.0.proj.weight"));
  for (const double scale : {1.0, 0.6}) {
    auto model = base_model();
    EXPECT_EQ(megaslide::merge_wan_lora(*model, lora, scale), 20);
    const auto out = output(model, r);
    EXPECT_LT(max_diff(out, r.at(scale == 1.0 ? "out" : "out_0.6")), 1e-5) << scale;
    EXPECT_GT(max_diff(out, r.at("out_base")), 1e-2) << "the adapter changes the output";
  }
}

// The property: a LoRA written here in each layout reads back as the same adapters (down, up bit for bit;
// alpha), so merging it gives the same weights; the diffusers file written here names its tensors as diffusers'
// own file does and stores the same rank, alpha and target modules in the adapter metadata.
TEST(WanLora, EveryLayoutReadsBackTheSameAdapters) {
  auto base = base_model();
  const auto names = names_of(base);
  const auto lora = megaslide::read_wan_lora(kLora, names);
  for (const auto layout :
       {megaslide::LoraLayout::kDiffusers, megaslide::LoraLayout::kComfyUi, megaslide::LoraLayout::kMusubi}) {
    SCOPED_TRACE(megaslide::to_string(layout));
    const auto path = scratch(std::string(megaslide::to_string(layout)) + ".safetensors");
    megaslide::save_wan_lora(path, lora, layout);
    const auto back = megaslide::read_wan_lora(path, names);
    EXPECT_EQ(back.layout, layout);
    ASSERT_EQ(back.adapters.size(), lora.adapters.size());
    for (const auto& [weight, a] : lora.adapters) {
      const auto& b = back.adapters.at(weight);
      EXPECT_TRUE(torch::equal(a.down, b.down) && torch::equal(a.up, b.up)) << weight;
      EXPECT_EQ(a.alpha, b.alpha) << weight;
    }
    const auto file = megaslide::io::read_safetensors(path);
    for (const auto& [name, t] : file.tensors) {
      if (layout == megaslide::LoraLayout::kMusubi) EXPECT_EQ(name.rfind("lora_unet_blocks_", 0), 0u) << name;
      if (layout == megaslide::LoraLayout::kComfyUi) {
        EXPECT_EQ(name.rfind("diffusion_model.blocks.", 0), 0u) << name;
        EXPECT_EQ(name.find("attn1"), std::string::npos) << name << ": original names (self_attn)";
      }
    }
  }
  // The diffusers layout: diffusers' names exactly, and its adapter config.
  const auto ours = megaslide::io::read_safetensors(scratch("diffusers.safetensors"));
  const auto theirs = megaslide::io::read_safetensors(kLora);
  std::set<std::string> our_names, their_names;
  for (const auto& [name, t] : ours.tensors) our_names.insert(name);
  for (const auto& [name, t] : theirs.tensors) their_names.insert(name);
  EXPECT_EQ(our_names, their_names);
  const auto a = nlohmann::json::parse(ours.metadata.at("lora_adapter_metadata"));
  const auto b = nlohmann::json::parse(theirs.metadata.at("lora_adapter_metadata"));
  for (const char* key : {"transformer.r", "transformer.lora_alpha", "transformer.use_rslora", "transformer.peft_type"})
    EXPECT_EQ(a.at(key), b.at(key)) << key;
  auto targets = [](const nlohmann::json& j) {
    auto v = j.at("transformer.target_modules").get<std::vector<std::string>>();
    return std::set<std::string>(v.begin(), v.end());
  };
  EXPECT_EQ(targets(a), targets(b));

  // Names without a prefix (Wan's original module names, as some trainers write ComfyUI's LoRA; diffusers' without
  // "transformer."): the same adapters.
  for (const std::string prefix : {"diffusion_model.", "transformer."}) {
    SCOPED_TRACE(prefix);
    const auto file = megaslide::io::read_safetensors(
        scratch(prefix == "transformer." ? "diffusers.safetensors" : "comfyui.safetensors"));
    megaslide::io::NamedTensors stripped;
    for (const auto& [name, t] : file.tensors) {
      ASSERT_EQ(name.rfind(prefix, 0), 0u) << name;
      stripped.emplace_back(name.substr(prefix.size()), t);
    }
    const auto path = scratch("unprefixed.safetensors");
    megaslide::io::write_safetensors(path, stripped, file.metadata);  // diffusers' alpha is in its metadata
    const auto back = megaslide::read_wan_lora(path, names);
    ASSERT_EQ(back.adapters.size(), lora.adapters.size());
    for (const auto& [weight, a] : lora.adapters) {
      const auto& b = back.adapters.at(weight);
      EXPECT_TRUE(torch::equal(a.down, b.down) && torch::equal(a.up, b.up)) << weight;
      EXPECT_EQ(a.alpha, b.alpha) << weight;
    }
  }
}

// The property: a file that is not a LoRA of this model is refused naming the file and the tensor: a module
// the model lacks, a missing half, halves of different ranks, DoRA.
TEST(WanLora, FilesThatAreNotThisModelsLoraAreNamed) {
  auto base = base_model();
  const auto names = names_of(base);
  auto refusal = [&](const megaslide::io::NamedTensors& tensors) -> std::string {
    const auto path = scratch("bad.safetensors");
    megaslide::io::write_safetensors(path, tensors);
    try {
      megaslide::read_wan_lora(path, names);
    } catch (const megaslide::WanLoraError& e) {
      return e.what();
    }
    return "";
  };
  const auto down = torch::zeros({4, 24}), up = torch::zeros({24, 4});
  auto problem = refusal(
      {{"transformer.blocks.7.attn1.to_q.lora_A.weight", down}, {"transformer.blocks.7.attn1.to_q.lora_B.weight", up}});
  EXPECT_NE(problem.find("transformer.blocks.7.attn1.to_q"), std::string::npos) << problem;
  EXPECT_NE(problem.find("bad.safetensors"), std::string::npos) << problem;
  problem = refusal({{"transformer.blocks.0.attn1.to_q.lora_A.weight", down}});
  EXPECT_NE(problem.find("no up"), std::string::npos) << problem;
  problem = refusal({{"transformer.blocks.0.attn1.to_q.lora_A.weight", down},
                     {"transformer.blocks.0.attn1.to_q.lora_B.weight", torch::zeros({24, 3})}});
  EXPECT_NE(problem.find("[r, in]"), std::string::npos) << problem;
  problem = refusal({{"diffusion_model.blocks.0.self_attn.q.lora_down.weight", down},
                     {"diffusion_model.blocks.0.self_attn.q.lora_up.weight", up},
                     {"diffusion_model.blocks.0.self_attn.q.dora_scale", torch::ones({24})}});
  EXPECT_NE(problem.find("DoRA"), std::string::npos) << problem;
  // A shape the model's weight does not have is refused when merged.
  megaslide::WanLora wide;
  wide.source = "wide.safetensors";
  auto& too_wide = wide.adapters["blocks.0.attn1.to_q.weight"];
  too_wide.down = torch::zeros({4, 25});
  too_wide.up = torch::zeros({24, 4});
  too_wide.alpha = 4.0;
  try {
    megaslide::merge_wan_lora(*base, wide);
    FAIL() << "a 24 x 25 update merged into a 24 x 24 weight";
  } catch (const megaslide::WanLoraError& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.attn1.to_q.weight"), std::string::npos) << e.what();
  }
}

namespace {

const std::string kLokr = kFixtures + "wan_lokr/";

std::map<std::string, torch::Tensor> lokr_reference() {
  std::map<std::string, torch::Tensor> r;
  for (auto& [k, v] : megaslide::io::read_safetensors(kLokr + "reference.safetensors").tensors) r[k] = v;
  return r;
}

}  // namespace

// The property: lokr_factorization is PEFT's (the examples its factorization() documents, and the fixture
// model's widths: 24 -> (4, 6), 40 -> (5, 8), with factor 4: (4, 10)).
TEST(WanLora, LokrFactorizationIsPefts) {
  using P = std::pair<int64_t, int64_t>;
  EXPECT_EQ(megaslide::lokr_factorization(256), P(16, 16));
  EXPECT_EQ(megaslide::lokr_factorization(128), P(8, 16));
  EXPECT_EQ(megaslide::lokr_factorization(127), P(1, 127));
  EXPECT_EQ(megaslide::lokr_factorization(128, 4), P(4, 32));
  EXPECT_EQ(megaslide::lokr_factorization(24), P(4, 6));
  EXPECT_EQ(megaslide::lokr_factorization(40), P(5, 8));
  EXPECT_EQ(megaslide::lokr_factorization(40, 4), P(4, 10));
  EXPECT_EQ(megaslide::lokr_factorization(5120), P(64, 80));
}

// The property (tests/fixtures/wan_lokr, tools/make_fixtures.py wan_lokr): PEFT's LoKr adapters, saved in diffusers'
// layout with PEFT's config in the metadata, merged into the base compute the output PEFT's LoKr forward computes,
// within 1e-5 (fp32) — whole W1 and W2, W2 as two factors, W1 as two factors (decompose_both), a decompose_factor,
// and the config's rank_pattern and alpha_pattern (to_q's r 1, ffn.net.2's alpha 2.5).
TEST(WanLora, PeftLokrFilesMergedGivePeftsOutput) {
  const auto r = lokr_reference();
  for (const std::string name : {"lokr", "lokr_decomposed"}) {
    SCOPED_TRACE(name);
    auto model = base_model();
    EXPECT_LT(max_diff(output(model, r), r.at("out_base")), 1e-5);
    const auto lora = megaslide::read_wan_lora(kLokr + name + ".safetensors", names_of(model));
    EXPECT_EQ(lora.layout, megaslide::LoraLayout::kDiffusers);
    ASSERT_EQ(lora.adapters.size(), 20u);
    for (const auto& [weight, a] : lora.adapters) EXPECT_TRUE(a.lokr()) << weight;
    const auto& q = lora.adapters.at("blocks.0.attn1.to_q.weight");
    const auto& ffn2 = lora.adapters.at("blocks.1.ffn.net.2.weight");
    if (name == "lokr") {
      EXPECT_TRUE(q.w1.defined() && q.w2.defined());
      EXPECT_TRUE(ffn2.w2_a.defined() && ffn2.w2_b.defined());
      EXPECT_EQ(q.scale(), 5.0 / 3.0);
    } else {
      EXPECT_TRUE(q.w1_a.defined() && q.w2_a.defined()) << "decompose_both at r 1";
      EXPECT_EQ(q.scale(), 4.0);
      EXPECT_EQ(ffn2.scale(), 2.5 / 3.0);
      EXPECT_EQ(ffn2.w1.size(0), 4) << "decompose_factor 4";
    }
    EXPECT_EQ(megaslide::merge_wan_lora(*model, lora), 20);
    const auto out = output(model, r);
    const double worst = max_diff(out, r.at("out_" + name));
    std::cout << name << ": merged against PEFT's LoKr output, largest difference " << worst << "\n";
    EXPECT_LT(worst, 1e-5);
    EXPECT_GT(max_diff(out, r.at("out_base")), 0.1) << "the adapter changes the output";
  }
}

// The property: LoKr adapters written here in each layout read back with the same update ΔW (within 1e-6), and
// the ComfyUI file is what ComfyUI's LoKr applies: kron(W1, W2) times alpha over the decomposed factor's rank
// (w2_b's rows, else w1_b's), or times 1 when W1 and W2 are both whole — its w1 then carries the scale.
TEST(WanLora, LokrEveryLayoutReadsBackTheSameUpdate) {
  auto base = base_model();
  const auto names = names_of(base);
  for (const std::string name : {"lokr", "lokr_decomposed"}) {
    const auto lora = megaslide::read_wan_lora(kLokr + name + ".safetensors", names);
    for (const auto layout :
         {megaslide::LoraLayout::kDiffusers, megaslide::LoraLayout::kComfyUi, megaslide::LoraLayout::kMusubi}) {
      SCOPED_TRACE(name + " as " + megaslide::to_string(layout));
      const auto path = scratch(name + "-" + megaslide::to_string(layout) + ".safetensors");
      megaslide::save_wan_lora(path, lora, layout);
      const auto back = megaslide::read_wan_lora(path, names);
      ASSERT_EQ(back.adapters.size(), lora.adapters.size());
      for (const auto& [weight, a] : lora.adapters)
        EXPECT_LT(max_diff(a.delta(), back.adapters.at(weight).delta()), 1e-6) << weight;
      if (layout != megaslide::LoraLayout::kComfyUi) continue;
      std::map<std::string, torch::Tensor> file;
      for (auto& [n, t] : megaslide::io::read_safetensors(path).tensors) file[n] = t;
      int checked = 0;
      for (const std::string module : {"blocks.0.self_attn.q", "blocks.0.self_attn.k", "blocks.1.ffn.2"}) {
        const std::string key = "diffusion_model." + module;
        const auto part = [&](const std::string& s) {
          return file.count(key + "." + s) ? file.at(key + "." + s) : torch::Tensor();
        };
        auto w1 = part("lokr_w1"), w2 = part("lokr_w2");
        int64_t dim = 0;
        if (!w1.defined()) {
          w1 = torch::matmul(part("lokr_w1_a"), part("lokr_w1_b"));
          dim = part("lokr_w1_b").size(0);
        }
        if (!w2.defined()) {
          w2 = torch::matmul(part("lokr_w2_a"), part("lokr_w2_b"));
          dim = part("lokr_w2_b").size(0);
        }
        const double scale = dim > 0 ? part("alpha").item<double>() / static_cast<double>(dim) : 1.0;
        const std::string weight = module == "blocks.1.ffn.2"         ? "blocks.1.ffn.net.2.weight"
                                   : module == "blocks.0.self_attn.q" ? "blocks.0.attn1.to_q.weight"
                                                                      : "blocks.0.attn1.to_k.weight";
        EXPECT_LT(max_diff(torch::kron(w1, w2) * scale, lora.adapters.at(weight).delta()), 1e-6) << module;
        ++checked;
      }
      EXPECT_EQ(checked, 3);
    }
  }
}
