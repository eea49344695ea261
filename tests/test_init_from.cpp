// train.init_from: a weights file, a checkpoint folder (and its run folder) and a bare safetensors file
// with the trainers' names all match; missing, unexpected and mis-shaped tensors are all listed at once
// and refused; train.init_allow_missing lets named parameters keep their initialisation; a dense model's
// fused qkv feeds a 3D-DSA model's q, k, v; both trainers start from exactly the file's values, and a
// run started from a checkpoint's weights continues at that run's loss.
#include "megaslide/train/init_from.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <regex>

#include "megaslide/model/dit_weights.h"
#include "trainers.h"
#include "megaslide/train/checkpoint.h"

using namespace megaslide::testing;
using megaslide::Trainer;

using megaslide::InitFromError;
using megaslide::RunConfig;

namespace {

std::string temp_dir(const std::string& name) {
  const std::string dir = "/tmp/megaslide-test-init-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(dir);
  megaslide::io::make_directories(dir);
  return dir;
}

RunConfig smoke(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets{"train.device=cpu",
                                "offload.enabled=false",
                                "train.batch_size=2",
                                "train.steps=20",
                                "data.frames=4",
                                "data.height=8",
                                "data.width=8",
                                "model.dsa_kernel=[3,3,3]",
                                "offload.compute_dtype=fp32"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return megaslide::parse_run_config("", "test", sets);
}

std::string refusal(const std::string& path, const megaslide::ParameterShapes& shapes,
                    const std::vector<std::string>& allow = {}) {
  try {
    megaslide::plan_init_from(path, shapes, allow);
  } catch (const InitFromError& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

}  // namespace

TEST(InitFrom, NamePatterns) {
  EXPECT_TRUE(megaslide::name_matches("blocks.*.attn.offset_*", "blocks.12.attn.offset_pw.weight"));
  EXPECT_TRUE(megaslide::name_matches("*rel_bias", "blocks.0.attn.rel_bias"));
  EXPECT_TRUE(megaslide::name_matches("t_mod.weight", "t_mod.weight"));
  EXPECT_FALSE(megaslide::name_matches("blocks.*.attn.q.*", "blocks.0.attn.qkv.weight"));
  EXPECT_FALSE(megaslide::name_matches("t_mod.weight", "t_mod.weight2"));
  EXPECT_TRUE(megaslide::name_matches("*", ""));
}

TEST(InitFrom, MissingUnexpectedAndMisshapedAreAllListedAndRefused) {
  const auto dir = temp_dir("strict");
  megaslide::Trainer trainer = resident_trainer(smoke());
  const auto shapes = parameter_shapes(trainer);
  // The trainer's own names, bare: accepted, every parameter matched.
  auto state = trainer.training_state();
  megaslide::io::write_safetensors(dir + "/bare.safetensors", state.master);
  const auto plan = megaslide::plan_init_from(dir + "/bare.safetensors", shapes, {});
  EXPECT_EQ(plan.tensors.size(), shapes.size());
  EXPECT_TRUE(plan.kept.empty());
  // One missing, one extra, one of the wrong shape, one not floating point: all four named in one message.
  auto bad = state.master;
  const std::string gone = bad[3].first, reshaped = bad[5].first, integral = bad[6].first;
  bad.erase(bad.begin() + 3);
  bad[4].second = torch::zeros({3, 3});
  bad[5].second = bad[5].second.to(torch::kInt32);
  bad.emplace_back("blocks.9.extra.weight", torch::zeros({2}));
  megaslide::io::write_safetensors(dir + "/bad.safetensors", bad);
  const auto what = refusal(dir + "/bad.safetensors", shapes);
  for (const auto& name : {gone, reshaped, integral, std::string("blocks.9.extra.weight")})
    EXPECT_NE(what.find(name), std::string::npos) << name << " not named in:\n" << what;
  EXPECT_NE(what.find("missing from the file (1)"), std::string::npos) << what;
  EXPECT_NE(what.find("in the file but not in the model (1)"), std::string::npos) << what;
  EXPECT_NE(what.find("wrong shape or dtype (2)"), std::string::npos) << what;
  EXPECT_NE(refusal(dir + "/nothing.safetensors", shapes).find("does not exist"), std::string::npos);
  // The hint names the missing parameter as a glob of train.init_allow_missing, its block index a '*'.
  const std::string glob = std::regex_replace(gone, std::regex("(^|\\.)[0-9]+(?=\\.|$)"), "$1*");
  EXPECT_NE(what.find("train.init_allow_missing, e.g. [\"" + glob + "\"]"), std::string::npos) << glob << "\n" << what;
  megaslide::io::remove_tree(dir);
}

// The property: a Wan DiT's published weights that train.init_from does not read — Wan-AI's and ComfyUI's original
// names, diffusers' folder — are refused with the advice to start from them with model.wan.weights, which reads
// them; a file of other names gets no such advice.
TEST(InitFrom, PublishedWanWeightsAreSentToModelWanWeights) {
  megaslide::Trainer trainer = resident_trainer(smoke());
  const auto shapes = parameter_shapes(trainer);
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures";
  for (const auto& [path, layout] : std::vector<std::pair<std::string, std::string>>{
           {fixtures + "/wan/a/comfyui.safetensors", "Wan's original names"},
           {fixtures + "/wan_pipeline/transformer", "diffusers' folder"}}) {
    const auto what = refusal(path, shapes);
    EXPECT_NE(what.find("is a Wan DiT's weights (" + layout), std::string::npos) << what;
  }
  const auto dir = temp_dir("other");
  megaslide::io::write_safetensors(dir + "/other.safetensors", {{"a.weight", torch::zeros({2})}});
  EXPECT_EQ(refusal(dir + "/other.safetensors", shapes).find("model.wan.weights"), std::string::npos);
  megaslide::io::remove_tree(dir);
}

TEST(InitFrom, AllowMissingKeepsTheInitialisationOfNamedParameters) {
  const auto dir = temp_dir("allow");
  megaslide::Trainer trainer = resident_trainer(smoke());
  const auto state = trainer.training_state();
  megaslide::io::NamedTensors without_offsets;
  for (const auto& [name, t] : state.master)
    if (name.find(".attn.offset_") == std::string::npos && name.find(".attn.rel_bias") == std::string::npos)
      without_offsets.emplace_back(name, t + 1.0);  // values the model does not have
  megaslide::io::write_safetensors(dir + "/w.safetensors", without_offsets);
  const auto what = refusal(dir + "/w.safetensors", parameter_shapes(trainer));
  EXPECT_NE(what.find("blocks.0.attn.offset_pw.weight"), std::string::npos) << what;
  const std::vector<std::string> allow{"blocks.*.attn.offset_*", "blocks.*.attn.rel_bias"};
  const auto plan = megaslide::plan_init_from(dir + "/w.safetensors", parameter_shapes(trainer), allow);
  EXPECT_EQ(plan.kept.size(), 2u * 5u);  // per block: offset_dw weight and bias, offset_pw weight and bias, rel_bias
  megaslide::Trainer started = trainer_from(smoke(), dir + "/w.safetensors", allow);
  const auto after = started.training_state();
  for (size_t i = 0; i < after.master.size(); ++i) {
    const auto& [name, t] = after.master[i];
    const bool kept = std::find(plan.kept.begin(), plan.kept.end(), name) != plan.kept.end();
    // Kept parameters hold the same seeded initialisation as `trainer`; loaded ones the file's values.
    EXPECT_TRUE(torch::equal(t, kept ? state.master[i].second : state.master[i].second + 1.0)) << name;
  }
  megaslide::io::remove_tree(dir);
}

TEST(InitFrom, ADenseModelsFusedQkvFeedsDsaQueriesKeysAndValues) {
  const auto dir = temp_dir("qkv");
  megaslide::Trainer dense = resident_trainer(smoke({"model.arch=dense3d"}));
  megaslide::save_weights(dir + "/dense.safetensors", dense.config(), dit_module(dense), dit_text_encoder(dense));
  const std::vector<std::string> allow{"blocks.*.attn.offset_*", "blocks.*.attn.rel_bias"};
  megaslide::Trainer dsa = trainer_from(smoke(), dir + "/dense.safetensors", allow);
  EXPECT_EQ(dsa.init_plan().kept.size(), 2u * 5u);
  auto dense_params = dit_module(dense)->named_parameters();
  auto dsa_params = dit_module(dsa)->named_parameters();
  const int64_t D = dsa.config().model.hidden;
  for (int64_t l = 0; l < dsa.config().model.layers; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".attn.";
    const auto fused =
        dense_params[p + "qkv.weight"].to(torch::kBFloat16).to(torch::kFloat32);  // the weights file is bf16
    for (int k = 0; k < 3; ++k)
      EXPECT_TRUE(
          torch::equal(dsa_params[p + std::string(1, "qkv"[k]) + ".weight"], fused.slice(0, k * D, (k + 1) * D)))
          << p << k;
    EXPECT_TRUE(torch::equal(dsa_params[p + "proj.weight"],
                             dense_params[p + "proj.weight"].to(torch::kBFloat16).to(torch::kFloat32)));
  }
  megaslide::io::remove_tree(dir);
}

TEST(InitFrom, BothTrainersStartFromACheckpointsMastersAndContinueAtItsLoss) {
  const auto dir = temp_dir("trainers");
  auto config = smoke({"output.run_dir=" + dir + "/run"});
  // Run A: 6 steps, checkpoint.
  megaslide::Trainer a = resident_trainer(config);
  double last_loss = 0.0;
  for (int i = 0; i < 6; ++i) last_loss = a.step().loss;
  const auto state = a.training_state();
  const auto checkpoint = megaslide::save_checkpoint(config.output.run_dir, config, state);
  // A fresh run of each trainer from the checkpoint folder, the run folder, and its checkpoints/latest pointer: the
  // masters bit for bit.
  for (bool streamed : {false, true}) {
    for (const std::string& source :
         {checkpoint, config.output.run_dir, config.output.run_dir + "/checkpoints/latest"}) {
      auto c = config;
      c.offload.enabled = streamed;
      megaslide::Trainer t = trainer_from(c, source);
      ASSERT_EQ(t.streams(), streamed);
      megaslide::TrainingState started = t.training_state();
      for (auto& [name, tensor] : started.master) tensor = tensor.clone();
      ASSERT_EQ(started.master.size(), state.master.size());
      std::map<std::string, torch::Tensor> saved(state.master.begin(), state.master.end());
      for (const auto& [name, t] : started.master)
        EXPECT_TRUE(torch::equal(t, saved.at(name))) << name << (streamed ? " streamed" : " resident");
    }
  }
  // The started run's first loss is run A's weights' loss on the first batch: what a trainer holding A's
  // whole state, with the data streams rewound to the start, computes.
  megaslide::Trainer b = trainer_from(config, checkpoint);
  const double started_loss = b.step().loss;
  megaslide::Trainer rewound = resident_trainer(config);
  auto rewound_state = state;
  rewound_state.data_state = megaslide::DiffusionBatchSource(config).state();
  rewound.load_training_state(rewound_state);
  const double expected = rewound.step().loss;
  megaslide::Trainer fresh = resident_trainer(config);
  const double fresh_loss = fresh.step().loss;
  std::cout << "first-batch loss: run A's weights " << expected << ", started from its checkpoint " << started_loss
            << ", random start " << fresh_loss << " (run A's last step: " << last_loss << ")\n";
  EXPECT_EQ(started_loss, expected);
  EXPECT_NE(started_loss, fresh_loss);
  megaslide::io::remove_tree(dir);
}

TEST(InitFrom, AnExportedBf16WeightsFileStartsARunAtTheExportedWeightsLoss) {
  const auto dir = temp_dir("exported");
  auto config = smoke();
  megaslide::Trainer a = resident_trainer(config);
  for (int i = 0; i < 6; ++i) a.step();
  megaslide::save_weights(dir + "/a.safetensors", config, dit_module(a),
                          dit_text_encoder(a));  // bf16, as --export-weights
  megaslide::Trainer b = trainer_from(config, dir + "/a.safetensors");
  // Every parameter is A's rounded to bf16.
  const auto started = b.training_state(), saved = a.training_state();
  for (size_t i = 0; i < saved.master.size(); ++i)
    EXPECT_TRUE(torch::equal(started.master[i].second, saved.master[i].second.to(torch::kBFloat16).to(torch::kFloat32)))
        << saved.master[i].first;
  // The first loss is A's weights' loss on that batch, within what bf16 rounding of the weights moves it.
  megaslide::Trainer rewound = resident_trainer(config);
  auto state = saved;
  state.data_state = megaslide::DiffusionBatchSource(config).state();
  rewound.load_training_state(state);
  const double expected = rewound.step().loss, got = b.step().loss;
  std::cout << "first-batch loss: A's fp32 weights " << expected << ", started from A's bf16 export " << got << "\n";
  EXPECT_NEAR(got, expected, 1e-2 * expected);
  megaslide::io::remove_tree(dir);
}
