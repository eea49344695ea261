// Weights files: the model is rebuilt from the file alone (config from __metadata__, every parameter by
// its module name), bf16 by default; files that do not describe the model are refused, naming the file
// and the tensor.
#include "megaslide/model/dit_weights.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <limits>

#include "megaslide/io/finite_weights.h"

using megaslide::WeightsError;

namespace {

std::string temp_path(const std::string& name) {
  return "/tmp/megaslide-test-weights-" + std::to_string(::getpid()) + "-" + name;
}

megaslide::RunConfig small_config(megaslide::Architecture arch) {
  megaslide::RunConfig c;
  c.model.arch = arch;
  c.model.hidden = 16;
  c.model.layers = 2;
  c.model.heads = 2;
  c.model.text_dim = 8;
  c.model.dsa_kernel = {3, 3, 3};
  c.data.frames = 4;
  c.data.height = 8;
  c.data.width = 8;
  c.data.max_text_tokens = 6;
  return c;
}

struct Built {
  megaslide::DiT dit{nullptr};
  megaslide::TextEncoder text{nullptr};
};

Built build_random(const megaslide::RunConfig& c, uint64_t seed) {
  torch::manual_seed(seed);
  Built b{megaslide::DiT(megaslide::DiTOptions::from_config(c)),
          megaslide::TextEncoder(megaslide::TextEncoderOptions(megaslide::CaptionTokenizer().vocab_size(),
                                                               c.model.text_dim, c.data.max_text_tokens))};
  torch::NoGradGuard no_grad;
  for (auto& p : b.dit->parameters()) p.copy_(torch::randn_like(p));  // no zero-initialised tensors left
  return b;
}

void expect_weights_error(const std::string& path, const std::string& needle) {
  try {
    megaslide::load_weights(path);
    ADD_FAILURE() << "load_weights accepted " << path;
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
  }
}

}  // namespace

TEST(Weights, ModelIsRebuiltFromTheFileAloneForEveryArchitecture) {
  for (auto arch :
       {megaslide::Architecture::kMegaSlide, megaslide::Architecture::kDense3D, megaslide::Architecture::kSwin}) {
    auto config = small_config(arch);
    auto b = build_random(config, 1);
    auto path = temp_path("model.safetensors");
    megaslide::save_weights(path, config, b.dit, b.text, torch::kFloat32);
    auto loaded = megaslide::load_weights(path);
    EXPECT_EQ(megaslide::to_yaml(loaded.config), megaslide::to_yaml(config));
    auto expected = b.dit->named_parameters();
    auto got = loaded.dit->named_parameters();
    ASSERT_EQ(got.size(), expected.size());
    for (const auto& p : expected) EXPECT_TRUE(torch::equal(got[p.key()], p.value())) << p.key();
    EXPECT_TRUE(torch::equal(loaded.text_encoder->tokens->weight, b.text->tokens->weight));
    EXPECT_FALSE(loaded.dit->is_training());
    megaslide::io::remove_tree(path);
  }
}

TEST(Weights, DefaultFileIsBf16KeyedByModuleNames) {
  auto config = small_config(megaslide::Architecture::kMegaSlide);
  auto b = build_random(config, 2);
  auto path = temp_path("bf16.safetensors");
  megaslide::save_weights(path, config, b.dit, b.text);
  auto header = megaslide::io::read_safetensors_header(path);
  std::map<std::string, torch::ScalarType> dtypes;
  for (const auto& e : header.entries) dtypes[e.name] = e.dtype;
  for (const char* name : {"dit.blocks.0.attn.q.weight", "dit.blocks.1.mlp.fc2.bias", "dit.patch_embed.weight",
                           "dit.final_modulation", "text_encoder.tokens.weight", "text_encoder.norm.weight"}) {
    ASSERT_TRUE(dtypes.count(name)) << name;
    EXPECT_EQ(dtypes[name], torch::kBFloat16) << name;
  }
  EXPECT_EQ(header.metadata.at("format"), "megaslide.weights");
  EXPECT_EQ(megaslide::to_yaml(megaslide::parse_run_config(header.metadata.at("config"), "metadata")),
            megaslide::to_yaml(config));
  // Loading rounds nothing further: the fp32 parameters are exactly the bf16 values.
  auto loaded = megaslide::load_weights(path);
  auto w = b.dit->named_parameters()["blocks.0.mlp.fc1.weight"];
  EXPECT_TRUE(torch::equal(loaded.dit->named_parameters()["blocks.0.mlp.fc1.weight"],
                           w.to(torch::kBFloat16).to(torch::kFloat32)));
  megaslide::io::remove_tree(path);
}

TEST(Weights, FilesThatDoNotDescribeTheModelAreRefused) {
  auto config = small_config(megaslide::Architecture::kDense3D);
  auto b = build_random(config, 3);
  auto tensors = megaslide::weights_tensors(b.dit, b.text);
  std::map<std::string, std::string> meta{
      {"format", "megaslide.weights"}, {"format_version", "1"}, {"config", megaslide::to_yaml(config)}};
  auto path = temp_path("bad.safetensors");

  auto missing = tensors;
  missing.erase(missing.begin() + 3);
  megaslide::io::write_safetensors(path, missing, meta);
  expect_weights_error(path, "tensor '" + tensors[3].first + "' is missing");

  auto extra = tensors;
  extra.emplace_back("dit.blocks.7.attn.q.weight", torch::zeros({2}));
  megaslide::io::write_safetensors(path, extra, meta);
  expect_weights_error(path, "tensor 'dit.blocks.7.attn.q.weight' is not a parameter");

  auto misshapen = tensors;
  misshapen[0].second = torch::zeros({1, 2, 3});
  megaslide::io::write_safetensors(path, misshapen, meta);
  expect_weights_error(path, "tensor '" + tensors[0].first + "' has shape [1, 2, 3]");

  megaslide::io::write_safetensors(path, tensors, {{"format", "megaslide.weights"}, {"format_version", "1"}});
  expect_weights_error(path, "no 'config'");

  auto bad_config = meta;
  bad_config["config"] = megaslide::to_yaml(config) + "bogus_section:\n  x: 1\n";
  megaslide::io::write_safetensors(path, tensors, bad_config);
  expect_weights_error(path, "bogus_section");

  megaslide::io::write_safetensors(path, tensors);
  expect_weights_error(path, "not a megaslide weights file");
  megaslide::io::remove_tree(path);
}

// The property: weights holding a NaN or an infinity are refused at load, naming the file, the tensor and
// the element (sampling from them wrote black videos with exit 0), unless the process allows them; the
// scan finds one non-finite value anywhere in any floating dtype, the strided tail included, and nothing
// in finite data.
TEST(Weights, NonFiniteWeightsAreRefusedNamingTheTensorUnlessAllowed) {
  for (auto dtype : {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kHalf}) {
    for (int64_t n : {1, 63, 64, 65, 1000}) {
      auto t = torch::randn({n}).to(dtype);
      EXPECT_EQ(megaslide::io::first_nonfinite(t.data_ptr(), n, dtype), -1) << c10::toString(dtype) << " " << n;
      for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
        for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()}) {
          auto u = t.clone();
          u[at] = bad;
          EXPECT_EQ(megaslide::io::first_nonfinite(u.data_ptr(), n, dtype), at)
              << c10::toString(dtype) << " n=" << n << " at " << at;
        }
      }
    }
  }
  auto config = small_config(megaslide::Architecture::kMegaSlide);
  auto b = build_random(config, 5);
  {
    torch::NoGradGuard no_grad;
    b.dit->named_parameters()["blocks.1.mlp.fc1.weight"].view(-1)[7] = std::numeric_limits<float>::quiet_NaN();
  }
  const auto path = temp_path("nan.safetensors");
  megaslide::save_weights(path, config, b.dit, b.text);
  expect_weights_error(path, "tensor 'dit.blocks.1.mlp.fc1.weight' holds a NaN or an infinity (element 7 of");
  megaslide::io::set_nonfinite_weights_allowed(true);
  EXPECT_NO_THROW(megaslide::load_weights(path)) << "allowed: loaded as they are";
  megaslide::io::set_nonfinite_weights_allowed(false);
  megaslide::io::remove_tree(path);
}
