// RunConfig: every class of bad value is refused with a message naming the source, the key path and
// what was expected; good files and overrides load; the resolved YAML reads back to the same config.
#include "megaslide/config/run_config.h"
#include "megaslide/train/auto_settings.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>
#include <fstream>

using megaslide::ConfigError;
using megaslide::parse_run_config;

namespace {

const std::string kSource = "test.yaml";

// Parses and expects a ConfigError whose key and message contain the given parts.
void expect_error(const std::string& yaml, const std::vector<std::string>& overrides, const std::string& key,
                  const std::string& message_part) {
  try {
    parse_run_config(yaml, kSource, overrides);
    FAIL() << "expected a ConfigError for key " << key;
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), key) << e.what();
    EXPECT_NE(std::string(e.what()).find(message_part), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(RunConfig, EmptyFileGivesDefaults) {
  auto c = parse_run_config("", kSource);
  EXPECT_EQ(c.model.hidden, 16);
  EXPECT_EQ(c.model.arch, megaslide::Architecture::kMegaSlide);
}

TEST(RunConfig, UnknownKeyIsNamedWithSuggestion) {
  expect_error("model:\n  hiden: 32\n", {}, "model.hiden", "did you mean model.hidden");
  expect_error("modle:\n  hidden: 32\n", {}, "modle", "unknown section");
  // The message lists every section there is.
  expect_error("modle:\n  hidden: 32\n", {}, "modle",
               "sections are model, data, diffusion, train, offload, optimizer, lora, output, distributed");
}

// The property: a seed is any unsigned 64-bit integer, and nothing outside that range or sign.
TEST(RunConfig, SeedsTakeTheWholeUnsigned64BitRange) {
  EXPECT_EQ(parse_run_config("", kSource, {"train.seed=9223372036854775808"}).train.seed, uint64_t{1} << 63);
  EXPECT_EQ(parse_run_config("", kSource, {"data.seed=18446744073709551615"}).data.seed, ~uint64_t{0});
  expect_error("", {"train.seed=18446744073709551616"}, "train.seed", "beyond the unsigned 64-bit integer range");
  expect_error("", {"train.seed=-1"}, "train.seed", "expected an integer in [0, 18446744073709551615], got '-1'");
  expect_error("train:\n  seed: 1.5\n", {}, "train.seed", "expected an integer in [0,");
}

TEST(RunConfig, WrongTypeIsRefused) {
  expect_error("model:\n  hidden: thirty\n", {}, "model.hidden", "expected an integer");
  expect_error("model:\n  hidden: 1.5\n", {}, "model.hidden", "expected an integer");
  expect_error("train:\n  lr: fast\n", {}, "train.lr", "expected a number");
  expect_error("model:\n  patch: 2\n", {}, "model.patch", "expected a list of 3");
  expect_error("offload:\n  enabled: maybe\n", {}, "offload.enabled", "expected true or false");
  expect_error("model:\n  dsa_offsets: maybe\n", {}, "model.dsa_offsets", "expected one of learned | zero | frozen");
  expect_error("model: 3\n", {}, "model", "expected a section");
  expect_error("model:\n  arch: resnet\n", {}, "model.arch", "megaslide | dense3d | swin");
}

TEST(RunConfig, OutOfRangeIsRefused) {
  expect_error("model:\n  hidden: -3\n", {}, "model.hidden", "expected an integer >= 1, got -3");
  expect_error("train:\n  beta2: 1.0\n", {}, "train.beta2", "in [0, 1)");
  expect_error("diffusion:\n  caption_dropout: 1.5\n", {}, "diffusion.caption_dropout", "in [0, 1]");
  expect_error("model:\n  dsa_kernel: [3, 6, 7]\n", {}, "model.dsa_kernel", "odd");
  expect_error("train:\n  device: tpu\n", {}, "train.device", "auto | cpu | cuda");
}

TEST(RunConfig, InconsistentValuesAreRefused) {
  expect_error("model:\n  hidden: 18\n  heads: 4\n", {}, "model.hidden", "multiple of model.heads (4)");
  expect_error("model:\n  patch: [2, 2, 2]\ndata:\n  frames: 7\n", {}, "data.frames", "temporal patch");
  expect_error("data:\n  width: 15\n", {}, "data.width", "model.patch[2] = 2");
  expect_error("model:\n  heads: 4\n  hidden: 16\n  dsa_groups: 3\n", {}, "model.dsa_groups", "divisor of model.heads");
  expect_error("diffusion:\n  beta_start: 0.1\n  beta_end: 0.01\n", {}, "diffusion.beta_end",
               "above diffusion.beta_start");
  expect_error("offload:\n  compute_dtype: fp8\n", {}, "offload.compute_dtype", "bf16 | fp16 | fp32");
  expect_error("train:\n  grad_accum_steps: 0\n", {}, "train.grad_accum_steps", "an integer in [1, 65536]");
}

TEST(RunConfig, SetOverridesAnyFieldAndIsNamedInErrors) {
  auto c = parse_run_config(
      "model:\n  hidden: 16\n", kSource,
      {"model.hidden=32", "model.patch=[1,4,4]", "data.height=32", "train.lr=1e-4", "model.arch=swin"});
  EXPECT_EQ(c.model.hidden, 32);
  EXPECT_EQ(c.model.patch, (std::array<int64_t, 3>{1, 4, 4}));
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-4);
  EXPECT_EQ(c.model.arch, megaslide::Architecture::kSwin);
  try {
    parse_run_config("", kSource, {"model.hidden=-3"});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "model.hidden");
    EXPECT_EQ(e.source(), "--set model.hidden=-3");
  }
  expect_error("", {"model.hiddenn=3"}, "model.hiddenn", "unknown key");
  try {
    parse_run_config("", kSource, {"model.hidden"});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("key.path=value"), std::string::npos);
  }
}

TEST(RunConfig, ResolvedYamlReadsBackEqual) {
  auto c = parse_run_config("", kSource,
                            {"model.hidden=48", "model.heads=3", "train.lr=0.00012345", "data.seed=99",
                             "model.dsa_offset_range=[0.5, 2.25, 2.25]", "output.run_dir=some/where"});
  auto again = parse_run_config(megaslide::to_yaml(c), "resolved");
  EXPECT_EQ(megaslide::to_yaml(again), megaslide::to_yaml(c));
  EXPECT_EQ(again.model.hidden, 48);
  EXPECT_DOUBLE_EQ(again.train.lr, 0.00012345);
  EXPECT_EQ(again.data.seed, 99u);
  EXPECT_DOUBLE_EQ(again.model.dsa_offset_range[1], 2.25);
  EXPECT_EQ(again.output.run_dir, "some/where");
}

TEST(RunConfig, MissingFileIsNamed) {
  try {
    megaslide::load_run_config("/nonexistent/run.yaml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/run.yaml"), std::string::npos);
  }
}

TEST(RunConfig, MalformedYamlIsNamed) {
  try {
    parse_run_config("model:\n  hidden: [1, 2\n", kSource);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not valid YAML"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("tab"), std::string::npos) << "no tab here: " << e.what();
  }
  // A tab in the indentation (YAML allows spaces only) is named with its line.
  try {
    parse_run_config("train:\n  lr: 0.1\n\tsteps: 5\n", kSource);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("line 3 is indented with a tab"), std::string::npos) << e.what();
  }
}

TEST(RunConfig, EveryShippedConfigLoads) {
  int loaded = 0;
  const std::string dir = std::string(MEGASLIDE_SOURCE_DIR) + "/configs";
  DIR* d = opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* entry = readdir(d)) {
    const std::string name = entry->d_name;
    if (name.size() < 5 || name.substr(name.size() - 5) != ".yaml") continue;
    EXPECT_NO_THROW(megaslide::load_run_config(dir + "/" + name)) << name;
    ++loaded;
  }
  closedir(d);
  EXPECT_GE(loaded, 6);
}

TEST(RunConfig, EveryKeyIsDocumented) {
  std::ifstream in(std::string(MEGASLIDE_SOURCE_DIR) + "/docs/configs.md");
  ASSERT_TRUE(in.good());
  std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& key : megaslide::config_keys())
    EXPECT_NE(doc.find("`" + key + "`"), std::string::npos) << key << " is missing from docs/configs.md";
}

// The property: a number a double or an int64 cannot hold, in a file or in --set, is a ConfigError
// naming the key (exit 2 in the tools), never std::out_of_range from std::stod (which aborted them).
TEST(RunConfig, NumbersBeyondTheirTypeAreConfigErrorsNamingTheKey) {
  expect_error("", {"train.lr=1e400"}, "train.lr", "beyond the largest double");
  expect_error("", {"train.lr=1e-400"}, "train.lr", "too close to zero");
  expect_error("train:\n  lr: 1e400\n", {}, "train.lr", "beyond the largest double");
  expect_error("train:\n  lr: 1e-400\n", {}, "train.lr", "too close to zero");
  expect_error("diffusion:\n  beta_start: 1e-400\n", {}, "diffusion.beta_start", "too close to zero");
  expect_error("", {"model.dsa_offset_range=[1, 1e400, 1]"}, "model.dsa_offset_range", "beyond the largest double");
  expect_error("", {"model.hidden=99999999999999999999"}, "model.hidden", "64-bit");
  expect_error("", {"train.guidance=nan"}, "train.guidance", "unknown key");
  expect_error("", {"diffusion.guidance_scale=nan"}, "diffusion.guidance_scale", "got 'nan'");
  expect_error("", {"diffusion.guidance_scale=.inf"}, "diffusion.guidance_scale", "got '.inf'");
}

TEST(RunConfig, RepeatedKeysAndSectionsAreRefused) {
  expect_error("model:\n  hidden: 16\n  hidden: 32\n", {}, "model.hidden", "appears twice");
  expect_error("model:\n  hidden: 16\ntrain:\n  steps: 3\nmodel:\n  layers: 3\n", {}, "model", "appears twice");
}

// Sizes multiplied out: a product no machine could hold, or one that overflows 64 bits, is refused
// with the factors named — never an overflowed negative size, never a hang building a huge model.
TEST(RunConfig, SizesNoMachineCouldHoldAreRefusedNamingTheFactors) {
  expect_error("", {"model.layers=999999999999"}, "model.layers", "expected an integer in [1, 10000]");
  expect_error("", {"model.layers=10000", "model.hidden=1048576", "model.heads=2"}, "model.layers",
               "more than any machine holds");
  expect_error("", {"data.frames=4096", "data.height=65536", "data.width=65536", "train.batch_size=4096"},
               "train.batch_size", "more than any machine holds");
  expect_error("", {"data.frames=2147483648", "data.height=2147483648", "data.width=2147483648"}, "train.batch_size",
               "overflows 64 bits");
  expect_error("", {"model.dsa_kernel=[999999999, 999999999, 999999999]"}, "model.dsa_kernel",
               "more than any machine holds");
  expect_error("",
               {"model.arch=dense3d", "model.dense_attention=materialized", "data.frames=256", "data.height=1024",
                "data.width=1024"},
               "model.dense_attention", "more than any machine holds");
  expect_error("", {"data.num_clips=9223372036854775807"}, "data.num_clips", "more than any machine holds");
  expect_error("", {"model.text_dim=9223372036854775807"}, "model.layers", "more than any machine holds");
  // The largest shipped config still loads (checked in EveryShippedConfigLoads as well).
  EXPECT_NO_THROW(parse_run_config("", kSource, {"model.layers=104", "model.hidden=8192", "model.heads=64"}));
}

TEST(RunConfig, ConfigThatIsNotARegularFileIsRefusedWithoutReadingIt) {
  for (const std::string path : {std::string("/dev/zero"), std::string("/tmp")}) {
    try {
      megaslide::load_run_config(path);
      ADD_FAILURE() << path << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("not a file"), std::string::npos) << e.what();
    }
  }
  // Its own name: test_asan runs this case too, maybe at the same time.
  const std::string big = "/tmp/megaslide-test-big-config-" + std::to_string(::getpid()) + ".yaml";
  {
    std::ofstream out(big);
    out << "model:\n  hidden: 16\n" << std::string(2 << 20, '#') << "\n";
  }
  try {
    megaslide::load_run_config(big);
    ADD_FAILURE() << "a 2 MiB config was read";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("more than the"), std::string::npos) << e.what();
  }
  std::remove(big.c_str());
}

// The property: diffusion.loss_weighting takes the weights of the run's objective — min_snr (with snr_gamma > 0)
// for ddpm, sigma_sqrt and cosmap for flow — and refuses the others naming the key and what fits; a config
// without the key (an older run's) is unweighted.
TEST(RunConfig, LossWeightingFitsTheObjective) {
  const std::string wan =
      "model:\n  arch: wan\n  wan:\n    dim: 48\n    heads: 4\n    in_channels: 4\n    out_channels: 4\ndata:\n  "
      "dataset: latent-tensors\n  channels: 4\n";
  EXPECT_EQ(parse_run_config("", kSource).diffusion.loss_weighting, "none");
  const auto c = parse_run_config("", kSource, {"diffusion.loss_weighting=min_snr", "diffusion.snr_gamma=2.5"});
  EXPECT_EQ(c.diffusion.loss_weighting, "min_snr");
  EXPECT_EQ(c.diffusion.snr_gamma, 2.5);
  EXPECT_EQ(parse_run_config(megaslide::to_yaml(c), "resolved").diffusion.snr_gamma, 2.5);
  EXPECT_NO_THROW(parse_run_config(wan, kSource, {"diffusion.loss_weighting=min_snr"}));  // Wan with ddpm
  for (const std::string flow : {"sigma_sqrt", "cosmap"})
    EXPECT_NO_THROW(parse_run_config(wan, kSource, {"diffusion.objective=flow", "diffusion.loss_weighting=" + flow}));
  expect_error(wan, {"diffusion.objective=flow", "diffusion.loss_weighting=min_snr"}, "diffusion.loss_weighting",
               "diffusion.objective flow takes sigma_sqrt or cosmap");
  expect_error("", {"diffusion.loss_weighting=cosmap"}, "diffusion.loss_weighting",
               "diffusion.objective ddpm takes min_snr");
  expect_error("", {"diffusion.loss_weighting=snr"}, "diffusion.loss_weighting", "min_snr");
  expect_error("", {"diffusion.snr_gamma=0"}, "diffusion.snr_gamma", "(0, ");
}

// The property: the validation loss's data (train.val_data) is the training data's config with data.* overrides
// applied, no caption or image dropped; an entry that is not data.KEY=VALUE, or a data config the run could not
// take, is refused naming train.val_data; val_batches and val_data without val_every are named as unused.
TEST(RunConfig, ValidationDataIsTheTrainingDataWithItsOverrides) {
  auto c = parse_run_config("", kSource, {"train.val_every=10", "train.val_data=[data.seed=99, data.num_clips=8]"});
  EXPECT_EQ(c.train.val_batches, 4);
  const auto v = megaslide::validation_data_config(c, kSource);
  EXPECT_EQ(v.data.seed, 99u);
  EXPECT_EQ(v.data.num_clips, 8);
  EXPECT_EQ(v.diffusion.caption_dropout, 0.0);
  EXPECT_TRUE(v.train.val_data.empty());
  EXPECT_EQ(v.train.val_every, 0);
  EXPECT_EQ(v.model.hidden, c.model.hidden);
  EXPECT_EQ(parse_run_config(megaslide::to_yaml(c), "resolved").train.val_data, c.train.val_data);
  expect_error("", {"train.val_data=[train.lr=1]"}, "train.val_data", "expected data.KEY=VALUE");
  expect_error("", {"train.val_data=[data.seed]"}, "train.val_data", "expected data.KEY=VALUE");
  expect_error("", {"train.val_data=[data.channels=4]"}, "train.val_data", "what the model takes");
  // With train.val_every set, the validation data's whole config is checked with the run's.
  expect_error("", {"train.val_every=5", "train.val_data=[data.frames=0]"}, "train.val_data",
               "entry data.frames=0: data.frames: expected an integer >= 1");
  try {
    megaslide::validation_data_config(parse_run_config("", kSource, {"train.val_data=[data.frames=0]"}), kSource);
    ADD_FAILURE() << "a validation data config with data.frames 0 was taken";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "train.val_data") << e.what();
    EXPECT_NE(std::string(e.what()).find("data.frames"), std::string::npos) << e.what();
  }
  // A run given --set names its source "FILE with --set overrides": said once, and the entry still named.
  const std::string with_sets = std::string(kSource) + " with --set overrides";
  try {
    megaslide::validation_data_config(parse_run_config("", kSource, {"train.val_data=[data.frames=0]"}), with_sets);
    ADD_FAILURE() << "a validation data config with data.frames 0 was taken";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find("overrides with --set overrides"), std::string::npos) << what;
    EXPECT_NE(what.find("entry data.frames=0: data.frames"), std::string::npos) << what;
  }
  const auto unused =
      megaslide::unused_settings(parse_run_config("", kSource, {"train.val_batches=2", "diffusion.snr_gamma=3"}));
  ASSERT_EQ(unused.size(), 2u);
  EXPECT_NE(unused[0].find("train.val_batches: set, but train.val_every is 0"), std::string::npos) << unused[0];
  EXPECT_NE(unused[1].find("diffusion.snr_gamma: set, but diffusion.loss_weighting is none"), std::string::npos)
      << unused[1];
}

// The property: Wan's hyper-parameters are a nested mapping (model.wan.*), set from a file or with
// --set model.wan.KEY=..., and the resolved YAML (which writes only the keys of the run's model family)
// reads back to the same config.
TEST(RunConfig, WanKeysNestAndReadBack) {
  auto c = megaslide::load_run_config(std::string(MEGASLIDE_SOURCE_DIR) + "/configs/wan2.1-t2v-1.3b.yaml",
                                      {"model.wan.heads=24"});
  EXPECT_EQ(c.model.arch, megaslide::Architecture::kWan);
  EXPECT_EQ(c.model.wan.dim, 1536);
  EXPECT_EQ(c.model.wan.heads, 24);
  EXPECT_EQ(c.diffusion.objective, "flow");
  const std::string yaml = megaslide::to_yaml(c);
  EXPECT_NE(yaml.find("  wan:\n    dim: 1536"), std::string::npos) << yaml;
  EXPECT_EQ(yaml.find("hidden:"), std::string::npos) << "DiT keys are not written for a Wan config";
  auto again = parse_run_config(yaml, "resolved");
  EXPECT_EQ(megaslide::to_yaml(again), yaml);
  EXPECT_EQ(again.model.wan.heads, 24);
  // And a DiT config does not write Wan's keys.
  EXPECT_EQ(megaslide::to_yaml(parse_run_config("", kSource)).find("wan:"), std::string::npos);
}

// The property: a key of the other model family is refused naming the key to use, and Wan's cross-key
// rules (channels, head size, objective) are checked.
TEST(RunConfig, WanAndDiTKeysDoNotMix) {
  const std::string wan =
      "model:\n  arch: wan\n  wan:\n    dim: 48\n    heads: 4\n    in_channels: 4\n    out_channels: 4\ndata:\n  "
      "dataset: latent-tensors\n  channels: 4\n";
  EXPECT_NO_THROW(parse_run_config(wan, kSource));
  expect_error(wan, {"model.hidden=32"}, "model.hidden", "set model.wan.dim");
  expect_error(wan, {"model.mlp_ratio=2"}, "model.mlp_ratio", "does not apply to model.arch wan");
  expect_error(wan, {"model.position_embedding=sincos"}, "model.position_embedding",
               "does not apply to model.arch wan");
  EXPECT_EQ(parse_run_config("", kSource, {"model.position_embedding=sincos"}).model.position_embedding, "sincos");
  expect_error("", {"model.position_embedding=rope"}, "model.position_embedding", "auto");
  expect_error("", {"model.wan.dim=32"}, "model.wan.dim", "applies to model.arch wan only");
  expect_error("", {"model.self_attention=dsa3d"}, "model.self_attention", "applies to model.arch wan only");
  expect_error(wan, {"data.channels=3"}, "data.channels", "model.wan.out_channels (4");
  // The input is the latents (text-to-video) or 2 x latents + 4 (image-to-video), nothing else.
  expect_error(wan, {"model.wan.out_channels=3", "data.channels=3"}, "model.wan.in_channels",
               "expected model.wan.out_channels (3: text-to-video) or 2 x 3 + 4 = 10");
  EXPECT_NO_THROW(parse_run_config(wan, kSource, {"model.wan.in_channels=12"}));
  expect_error(wan, {"model.wan.image_dim=1280"}, "model.wan.image_dim", "image-to-video's");
  expect_error(wan, {"model.wan.image_dim=-1"}, "model.wan.image_dim", ">= 0");
  expect_error(wan, {"model.wan.heads=16"}, "model.wan.dim", "even");
  expect_error(wan, {"model.wan.dim=50"}, "model.wan.dim", "multiple of model.wan.heads");
  expect_error(wan, {"data.height=15"}, "data.height", "model.wan.patch[1]");
  expect_error("", {"diffusion.objective=flow"}, "diffusion.objective", "model.arch wan");
  expect_error(wan, {"diffusion.objective=flow", "diffusion.prediction=v"}, "diffusion.prediction", "velocity");
  expect_error(wan, {"model.self_attention=dsa3d", "model.dsa_groups=3"}, "model.dsa_groups",
               "divisor of model.wan.heads");
  expect_error(wan, {"model.wan.qk_norm=maybe"}, "model.wan.qk_norm", "true or false");
  // Encoder weights with the kinds that read none (the data brings embeddings and latents) are refused.
  expect_error(wan, {"model.text_encoder.weights=/models/umt5"}, "model.text_encoder.weights",
               "set model.text_encoder.kind: umt5 to load umT5 from '/models/umt5'");
  expect_error(wan, {"model.vae.weights=/models/vae"}, "model.vae.weights",
               "set model.vae.kind: wan to load the Wan VAE from '/models/vae'");
  // The Wan VAE's tiles are whole latents, as the SD VAE's.
  expect_error(wan, {"model.vae.kind=wan", "model.vae.weights=/models/vae", "model.vae.tile_size=260"},
               "model.vae.tile_size", "expected a multiple of model.vae.downscale (8");
  expect_error(wan, {"model.wan.dimm=3"}, "model.wan.dimm", "did you mean model.wan.dim");
  expect_error(wan, {"data.dataset=structured-motion"}, "data.dataset",
               "expected latent-tensors (latent videos and text embeddings) or videos");
  // Wan over videos: pixel sizes in data.*, umT5 and the Wan VAE named (their latents are what the
  // patches must divide), buckets of such sizes; the DiT family refuses Wan's encoders and Wan the DiT family's.
  const std::vector<std::string> videos{
      "data.dataset=videos", "data.channels=3",     "data.manifest=x.csv",          "data.frames=5",
      "data.height=16",      "data.width=16",       "model.text_encoder.kind=umt5", "model.text_encoder.weights=u",
      "model.vae.kind=wan",  "model.vae.weights=v", "model.vae.latent_channels=4"};
  EXPECT_NO_THROW(parse_run_config(wan, kSource, videos));
  auto with = [&](std::vector<std::string> extra) {
    auto all = videos;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  expect_error(wan, with({"data.frames=6"}), "data.frames", "1 + 4k");
  expect_error(wan, with({"data.height=12"}), "data.height", "multiple of model.vae.downscale");
  expect_error(wan, with({"data.height=8"}), "data.height", "latent height");
  expect_error(wan, with({"model.vae.latent_channels=16"}), "model.vae.latent_channels", "model.wan.out_channels (4");
  expect_error(wan, with({"model.text_encoder.kind=builtin", "model.text_encoder.weights="}), "model.text_encoder.kind",
               "expected umt5");
  expect_error(wan, with({"model.vae.weights="}), "model.vae.weights", "Wan VAE");
  expect_error(wan, with({"model.text_encoder.kind=clip"}), "model.text_encoder.kind", "DiT family");
  // Buckets, each a size the Wan VAE and the patch take.
  EXPECT_NO_THROW(parse_run_config(wan, kSource, with({"data.buckets=[[5, 16, 16], [1, 16, 32]]"})));
  expect_error(wan, with({"data.buckets=[[5, 16, 16], [6, 16, 16]]"}), "data.buckets",
               "item 1: 6 frames: the Wan VAE takes 1 + 4k frames");
  expect_error(wan, with({"data.buckets=[[5, 12, 16]]"}), "data.buckets",
               "item 0: 12 x 16: not multiples of model.vae.downscale (8)");
  expect_error(wan, with({"data.buckets=[[5, 16, 8]]"}), "data.buckets", "item 0: width 8: not a multiple of 16");
  expect_error("", {"model.text_encoder.kind=umt5", "model.text_encoder.weights=u"}, "model.text_encoder.kind",
               "Wan's text encoder");
  expect_error("", {"model.vae.kind=wan", "model.vae.weights=v"}, "model.vae.kind", "Wan's VAE");
  // fp8 keeps a frozen encoder's matrices: refused for the built-in encoder (it trains), accepted for CLIP and umT5.
  expect_error("", {"model.text_encoder.dtype=fp8"}, "model.text_encoder.dtype", "built-in");
  EXPECT_NO_THROW(parse_run_config(
      "", kSource, {"model.text_encoder.kind=clip", "model.text_encoder.weights=c", "model.text_encoder.dtype=fp8"}));
  EXPECT_NO_THROW(parse_run_config(wan, kSource, with({"model.text_encoder.dtype=fp8"})));
  expect_error("", {"data.dataset=latent-tensors"}, "data.dataset", "expected structured-motion");
  expect_error("", {"data.tensors=x.safetensors"}, "data.tensors", "latent-tensors");
}

TEST(RunConfig, VideoDatasetKeysParseCheckAndReadBack) {
  const std::string yaml =
      "data:\n  dataset: videos\n  manifest: data/train.csv\n  buckets: [[8, 16, 16], [4, 16, 32]]\n  fps: 8\n"
      "  clip_start: center\n  workers: 2\n  prefetch: 3\n  cache: ''\ntrain:\n  init_from: runs/a/model.safetensors\n"
      "  init_allow_missing: [\"blocks.*.attn.offset_*\"]\n";
  const auto c = parse_run_config(yaml, kSource);
  ASSERT_EQ(c.data.buckets.size(), 2u);
  EXPECT_EQ(c.data.buckets[1], (std::array<int64_t, 3>{4, 16, 32}));
  EXPECT_EQ(c.train.init_allow_missing, (std::vector<std::string>{"blocks.*.attn.offset_*"}));
  const auto back = parse_run_config(megaslide::to_yaml(c), "resolved");
  EXPECT_EQ(megaslide::to_yaml(back), megaslide::to_yaml(c));
  EXPECT_EQ(back.data.buckets, c.data.buckets);
  EXPECT_EQ(back.data.cache, "");
  // Exactly one of manifest and root; fps or a stride; buckets divisible by the patch; only for videos.
  expect_error("data: {dataset: videos}\n", {}, "data.root", "exactly one of data.manifest");
  expect_error("data: {dataset: videos, manifest: a.csv, root: b}\n", {}, "data.manifest", "exactly one");
  expect_error("data: {dataset: videos, root: b, fps: 8, frame_stride: 2}\n", {}, "data.frame_stride",
               "either data.fps");
  expect_error("data: {dataset: videos, root: b, buckets: [[8, 15, 16]]}\n", {}, "data.buckets", "item 0: height 15");
  expect_error("data: {dataset: videos, root: b, buckets: [[8, 16]]}\n", {}, "data.buckets",
               "item 0: expected [frames, height, width]");
  expect_error("data: {buckets: [[8, 16, 16]]}\n", {}, "data.buckets", "only data.dataset: videos");
  expect_error("data: {dataset: videos, root: b, channels: 1}\n", {}, "data.channels", "expected 3");
  expect_error("train: {init_allow_missing: [a, '']}\n", {}, "train.init_allow_missing", "non-empty");
  expect_error("data: {workers: -1}\n", {}, "data.workers", "integer in [0, 256]");
}

// The property: a file holds one YAML document (a second one used to be ignored without a word; an
// explicit "---" start of the first is fine), and every value is UTF-8 text, so that a path of another
// encoding is refused at load, naming the key, not at the first checkpoint save of the run.
TEST(RunConfig, OneDocumentOfUtf8Text) {
  EXPECT_EQ(parse_run_config("--- # a run\nmodel:\n  hidden: 32\n", kSource).model.hidden, 32);
  EXPECT_EQ(parse_run_config("---\nmodel: {hidden: 32}\n...\n# done\n", kSource).model.hidden, 32);
  for (const char* text : {"model:\n  hidden: 32\n---\nmodel:\n  hidden: 64\n",
                           "model: {hidden: 32}\n...\ntrain: {lr: 1}\n", "--- {model: {hidden: 32}}\n--- {}\n"}) {
    try {
      parse_run_config(text, kSource);
      ADD_FAILURE() << "a second document was accepted: " << text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("more than one YAML document"), std::string::npos) << e.what();
    }
  }
  expect_error("output:\n  run_dir: \"runs/x\xff\"\n", {}, "output.run_dir", "not UTF-8 text (byte 0xff at offset 6)");
  expect_error("", {"data.root=caf\xc3\x28"}, "data.root", "not UTF-8");
  auto c = parse_run_config("", kSource);
  c.output.run_dir = "r-\xe9";  // set directly, as megaslide-train sets --run-dir
  try {
    megaslide::validate(c, "--run-dir");
    ADD_FAILURE() << "validate accepted a run folder that is not UTF-8";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "output.run_dir");
  }
  EXPECT_EQ(parse_run_config("data:\n  dataset: videos\n  root: \"vid\xc3\xa9os/\xe6\x97\xa5\"\n", kSource).data.root,
            "vid\xc3\xa9os/\xe6\x97\xa5");
}

// The property: values that would be read as something else, or that no run could use, are refused naming the key: a
// control character in a path or name (YAML's "\0" cut the path at the NUL; a newline made a folder of two lines), a
// folder or manifest of videos beside another dataset (it trained on that one), an offset range past 10^4 tokens
// (past float's range every step was NaN), a 3D-DSA kernel more than twice the token grid (its parameters and
// offsets filled memory), a --set value of two YAML documents (the second was dropped) or a key with a space, and a
// key given twice names both lines.
TEST(RunConfig, ValuesARunCannotUseAreRefused) {
  expect_error("output:\n  run_dir: \"runs/a\\0b\"\n", {}, "output.run_dir", "control character 0x00 at byte 7");
  expect_error("output:\n  run_dir: |\n    runs/abc\n", {}, "output.run_dir", "control character 0x0A");
  expect_error("train:\n  init_from: \"w.safetensors\\0junk\"\n", {}, "train.init_from", "control character");
  expect_error("", {"lora.rank=4", "lora.targets=[\"a\\tb\"]"}, "lora.targets", "an item holds the control character");
  expect_error("", {"data.root=/videos"}, "data.root", "data.dataset is structured-motion");
  expect_error("", {"data.manifest=/m.csv"}, "data.manifest", "set data.dataset: videos");
  expect_error("", {"model.dsa_offset_range=[3.5e38, 1, 1]"}, "model.dsa_offset_range", "in [0, 10000]");
  EXPECT_NO_THROW(parse_run_config("", kSource, {"model.dsa_offset_range=[10000, 1, 1]"}));
  const auto c = parse_run_config("", kSource);
  const int64_t h = c.data.height / c.model.patch[1];  // the token grid's height
  expect_error("", {fmt::format("model.dsa_kernel=[3, {}, 3]", 2 * h + 3)}, "model.dsa_kernel",
               fmt::format("at most {} on that axis", 2 * h + 1));
  EXPECT_NO_THROW(parse_run_config("", kSource, {fmt::format("model.dsa_kernel=[3, {}, 3]", 2 * h + 1)}));
  expect_error("", {"train.steps=1\n---\n7"}, "train.steps", "more than one YAML document");
  expect_error("", {"train.steps =5"}, "", "holds white space");
  expect_error("train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n", {}, "train.steps", "on lines 2 and 4");
  expect_error("train:\n  <<: {steps: 3}\n", {}, "train", "YAML merge keys (<<) are not supported (line 2)");
}

// The property: config.yaml and messages show a number as the shortest text that reads back as it (train.lr 0.003,
// not 0.0030000000000000001), a whole number with ".0", and the file reads back to the same config.
TEST(RunConfig, NumbersAreWrittenAsTheirShortestText) {
  const auto c = parse_run_config("train:\n  lr: 3.0e-3\nmodel:\n  mlp_ratio: 4\n", kSource);
  EXPECT_EQ(megaslide::config_value_text(c, "train.lr"), "0.003");
  EXPECT_EQ(megaslide::config_value_text(c, "model.mlp_ratio"), "4.0");
  EXPECT_EQ(megaslide::config_value_text(c, "model.dsa_offset_range"), "[1.0, 3.0, 3.0]");
  const std::string yaml = megaslide::to_yaml(c);
  EXPECT_NE(yaml.find("lr: 0.003\n"), std::string::npos) << yaml;
  EXPECT_EQ(megaslide::config_value_text(parse_run_config("", kSource, {"train.lr=1e-5"}), "train.lr"), "1.0e-05");
  EXPECT_TRUE(megaslide::differing_keys(parse_run_config(yaml, kSource), c).empty());
}

// The property: settings of a mode the config does not turn on are named as unused (the run logs them as warnings),
// as is a warm-up the run never finishes; a config that uses what it sets has none.
TEST(RunConfig, SettingsTheRunDoesNotUseAreNamed) {
  EXPECT_TRUE(megaslide::unused_settings(parse_run_config("", kSource)).empty());
  const auto lines = megaslide::unused_settings(
      parse_run_config("", kSource,
                       {"lora.alpha=8", "lora.targets=[x*]", "train.sample_prompts=p.txt", "offload.nvme_dir=/nvme",
                        "data.fps=8", "train.steps=5", "train.warmup_steps=10"}));
  std::string all;
  for (const auto& line : lines) all += line + "\n";
  EXPECT_NE(all.find("lora.alpha, lora.targets: set, but lora.rank is 0"), std::string::npos) << all;
  EXPECT_NE(all.find("train.sample_prompts: set, but train.sample_every is 0"), std::string::npos) << all;
  EXPECT_NE(all.find("offload.nvme_dir: set, but offload.state_tier is ram"), std::string::npos) << all;
  EXPECT_NE(all.find("data.fps: set, but data.dataset is structured-motion"), std::string::npos) << all;
  EXPECT_NE(all.find("train.warmup_steps (10) is above train.steps (5)"), std::string::npos) << all;
  EXPECT_EQ(lines.size(), 5u) << all;
  // The resident loop streams nothing and computes in fp32: its offload.mode and a bf16 or fp16 compute dtype are
  // named, and `auto` resolves to fp32 for it. A videos dataset's epoch is its items: data.num_clips is named.
  const auto resident = parse_run_config(
      "", kSource, {"offload.enabled=false", "offload.mode=sync", "offload.compute_dtype=bf16", "data.num_clips=6"});
  all.clear();
  for (const auto& line : megaslide::unused_settings(resident)) all += line + "\n";
  EXPECT_NE(all.find("offload.mode: set, but offload.enabled is false"), std::string::npos) << all;
  EXPECT_NE(all.find("offload.compute_dtype: bf16, but offload.enabled is false (the resident reference loop computes "
                     "in fp32): ignored"),
            std::string::npos)
      << all;
  EXPECT_EQ(all.find("data.num_clips"), std::string::npos) << all;
  auto videos = parse_run_config("", kSource,
                                 {"offload.enabled=false", "data.dataset=videos", "data.root=/v", "data.num_clips=6"});
  all.clear();
  for (const auto& line : megaslide::unused_settings(videos)) all += line + "\n";
  EXPECT_NE(all.find("data.num_clips: set, but data.dataset is videos"), std::string::npos) << all;
  EXPECT_EQ(all.find("offload."), std::string::npos) << all;
  EXPECT_EQ(megaslide::resolve_auto_settings(videos).offload.compute_dtype, "fp32");
  // On a GPU too, where `auto` is bf16 or fp16 for the streamed trainer.
  videos.train.device = "cuda";
  EXPECT_EQ(megaslide::resolve_auto_settings(videos).offload.compute_dtype, "fp32");
  videos.offload.enabled = true;
  EXPECT_NE(megaslide::resolve_auto_settings(videos).offload.compute_dtype, "fp32");
  // The NVMe tier's buffers beyond the model's blocks are said (the store keeps as many as the blocks).
  all.clear();
  for (const auto& line : megaslide::unused_settings(parse_run_config(
           "", kSource,
           {"model.layers=3", "offload.state_tier=nvme", "offload.nvme_dir=/nvme", "offload.nvme_blocks_in_flight=8"})))
    all += line + "\n";
  EXPECT_NE(all.find("offload.nvme_blocks_in_flight (8) is above the model's 3 blocks"), std::string::npos) << all;
  // Not the default 2 the config never gave, for a model of one block.
  all.clear();
  for (const auto& line : megaslide::unused_settings(
           parse_run_config("", kSource, {"model.layers=1", "offload.state_tier=nvme", "offload.nvme_dir=/nvme"})))
    all += line + "\n";
  EXPECT_EQ(all.find("nvme_blocks_in_flight"), std::string::npos) << all;
  // A bucket beyond data.frames/height/width, which size the memory check and the plans, is said.
  all.clear();
  for (const auto& line : megaslide::unused_settings(parse_run_config(
           "", kSource, {"data.dataset=videos", "data.root=/v", "data.buckets=[[8,32,32],[1,16,16]]"})))
    all += line + "\n";
  EXPECT_NE(all.find("data.buckets [8, 32, 32] is larger than data.frames/height/width (8 x 16 x 16)"),
            std::string::npos)
      << all;
}

// The property: a config MegaSlide saved (a checkpoint's, a weights file's) loads without the checks of values older
// versions accepted and saved, so their files keep loading; a user's config with the same values is refused.
TEST(RunConfig, SavedConfigsKeepLoadingWhatOlderVersionsAccepted) {
  for (const std::string yaml :
       {std::string("data:\n  root: /old/videos\n"), std::string("model:\n  dsa_offset_range: [20000.0, 1.0, 1.0]\n"),
        std::string("model:\n  dsa_kernel: [99, 3, 3]\n"),
        std::string("train:\n  init_from: \"w.safetensors\\0junk\"\n")}) {
    EXPECT_NO_THROW(megaslide::parse_saved_run_config(yaml, "saved")) << yaml;
    EXPECT_THROW(parse_run_config(yaml, kSource), ConfigError) << yaml;
  }
}
