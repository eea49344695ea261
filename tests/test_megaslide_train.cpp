// megaslide-train end to end: exit codes, the files a run writes, and that a bad config writes nothing.
#include <gtest/gtest.h>

#include "run_tool.h"
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <unistd.h>
#include <fstream>

#include "megaslide/config/run_config.h"
#include "megaslide/io/files.h"

using megaslide::io::join_path;

namespace {

using Result = megaslide::testing::ToolResult;

Result run(const std::string& args) { return megaslide::testing::run_tool("megaslide-train", args); }

std::string smoke() { return std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml"; }

std::string fresh_dir(const std::string& name) {
  auto dir = "/tmp/megaslide-test-" + name + "-" + std::to_string(::getpid());
  megaslide::io::remove_tree(dir);
  return dir;
}

}  // namespace

TEST(MegaslideTrain, BadValueExitsTwoNamingTheKeyAndWritesNothing) {
  auto dir = fresh_dir("bad");
  auto r = run("--config " + smoke() + " --set model.hidden=-3 --run-dir " + dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.hidden"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(dir));
}

TEST(MegaslideTrain, BadFlagOrMissingConfigExitsTwo) {
  EXPECT_EQ(run("--config " + smoke() + " --no-such-flag").code, 2);
  EXPECT_EQ(run("").code, 2);
  auto r = run("--config /nonexistent.yaml");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("/nonexistent.yaml"), std::string::npos) << r.output;
}

TEST(MegaslideTrain, DryRunPrintsTheModelSizeAsJson) {
  auto r = run("--config " + std::string(MEGASLIDE_SOURCE_DIR) + "/configs/105b.yaml --dry-run --json");
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_NEAR(j["params"].get<double>() / 1e9, 105.0, 2.0);
  EXPECT_EQ(j["tokens_per_sample"].get<int64_t>(), 256 * 68 * 120);
  EXPECT_EQ(j["host_state_bytes"].get<int64_t>(), 14 * j["params"].get<int64_t>());
  EXPECT_GT(j["params_per_block"].get<int64_t>(), 0);
}

TEST(MegaslideTrain, ShortRunWritesConfigMetricsAndLog) {
  auto dir = fresh_dir("run");
  auto r = run("--config " + smoke() + " --run-dir " + dir + " --set train.steps=3 --set train.log_every=1");
  ASSERT_EQ(r.code, 0) << r.output;
  // The resolved config reads back, with the overrides in it.
  auto config = megaslide::load_run_config(join_path(dir, "config.yaml"));
  EXPECT_EQ(config.train.steps, 3);
  EXPECT_EQ(config.output.run_dir, dir);
  std::ifstream metrics(join_path(dir, "metrics.jsonl"));
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    auto j = nlohmann::json::parse(line);
    for (const char* key : {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"})
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
    EXPECT_EQ(j["step"].get<int>(), ++lines);
  }
  EXPECT_EQ(lines, 3);
  std::ifstream log(join_path(dir, "train.log"));
  std::string log_text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(log_text.find("step 3/3"), std::string::npos) << log_text;
  megaslide::io::remove_tree(dir);
}
