// megaslide-train end to end: exit codes, the files a run writes, and that a bad config writes nothing.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "run_tool.h"
#include "tiny_wan.h"
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <regex>

#include "megaslide/config/run_config.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/video.h"

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
  // A misspelt flag is named with the nearest one (CLI11 said "--config is required" for --confg, and listed
  // "/tmp/x --run-dirr" as unexpected arguments).
  auto misspelt = run("--confg " + smoke());
  EXPECT_EQ(misspelt.code, 2);
  EXPECT_NE(misspelt.output.find("unknown flag '--confg' (did you mean --config?)"), std::string::npos)
      << misspelt.output;
  misspelt = run("--config " + smoke() + " --run-dirr=/tmp/x");
  EXPECT_NE(misspelt.output.find("unknown flag '--run-dirr' (did you mean --run-dir?)"), std::string::npos)
      << misspelt.output;
  // A value that is no flag name ("-- blurry", as a negative prompt might be) is not taken for one.
  misspelt = run("--trace '-- x'");
  EXPECT_EQ(misspelt.output.find("unknown flag"), std::string::npos) << misspelt.output;
  EXPECT_NE(misspelt.output.find("--config is required"), std::string::npos) << misspelt.output;
  auto r = run("--config /nonexistent.yaml");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("/nonexistent.yaml"), std::string::npos) << r.output;
}

TEST(MegaslideTrain, DryRunPrintsTheModelSizeAsJson) {
  const std::string big = "--config " + std::string(MEGASLIDE_SOURCE_DIR) +
                          "/configs/105b.yaml --dry-run --json --set offload.compute_dtype=bf16";
  auto r = run(big);
  ASSERT_EQ(r.code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_NEAR(j["params"].get<double>() / 1e9, 105.0, 2.0);
  EXPECT_EQ(j["tokens_per_sample"].get<int64_t>(), 256 * 68 * 120);
  // Host state: 4 B master + 2 x 4 B moments + 2 B bf16 copy; int8 moments 1 B each and a 4 B scale per 256.
  EXPECT_EQ(j["host_state_bytes"].get<int64_t>(), 14 * j["params"].get<int64_t>());
  r = run(big + " --set optimizer.state_dtype=int8");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NEAR(nlohmann::json::parse(r.output)["host_state_bytes"].get<double>() / j["params"].get<double>(),
              8.0 + 8.0 / 256, 1e-6);
  EXPECT_GT(j["params_per_block"].get<int64_t>(), 0);
  EXPECT_TRUE(j["unused_settings"].empty()) << j.dump();
  // Settings the run would not use are listed, as its train.log would warn.
  r = run(big + " --set lora.alpha=8");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["unused_settings"][0],
            "lora.alpha: set, but lora.rank is 0 (full fine-tuning, no LoRA): ignored");
  // The NVMe tier: the bf16 compute copy, plus offload.nvme_blocks_in_flight blocks' master and moments (12 B a
  // parameter, each part's region rounded up to 4 KiB) in host memory (the buffers were left out).
  r = run(big + " --set offload.state_tier=nvme --set offload.nvme_dir=/tmp --set offload.nvme_blocks_in_flight=3");
  ASSERT_EQ(r.code, 0) << r.output;
  const double nvme = nlohmann::json::parse(r.output)["host_state_bytes"].get<double>();
  const double buffers = 3.0 * 12.0 * j["params_per_block"].get<double>();
  EXPECT_NEAR(nvme, 2.0 * j["params"].get<double>() + buffers, 3 * 5 * 4096.0);
  // Without --json: the same figures for people, no JSON.
  r = run("--config " + std::string(MEGASLIDE_SOURCE_DIR) + "/configs/105b.yaml --dry-run");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find('{'), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model megaslide: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(std::to_string(256 * 68 * 120) + " tokens a sample"), std::string::npos) << r.output;
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
  // The tool installs the CPU tensor cache (tools/tool_support.h), and the log's last lines say what it did.
  std::smatch cache;
  ASSERT_TRUE(std::regex_search(log_text, cache,
                                std::regex("CPU tensor cache at the end: ([0-9]+) of ([0-9]+) allocations of [^ ]+ "
                                           "[^ ]+ or more served from spare blocks, [^ ]+ [^ ]+ of spare blocks held")))
      << log_text;
  EXPECT_LE(std::stoll(cache[1]), std::stoll(cache[2]));
  megaslide::io::remove_tree(dir);
}

// The property: train.val_every measures the validation loss every N steps and after the last one, into
// metrics.jsonl (val_loss on those steps only) and the log, the same for the same weights whatever the data
// order before; held-out data (train.val_data) gives other values; val_data that is not data.KEY=VALUE, or
// names data the run cannot read, stops the run before its first step, naming train.val_data (exit 2).
TEST(MegaslideTrain, ValidationLossIsMeasuredEveryNStepsAndLogged) {
  auto dir = fresh_dir("val");
  const std::string base =
      "--config " + smoke() + " --set train.steps=5 --set train.val_every=2 --set train.val_batches=2";
  const auto val_losses = [](const std::string& run_dir) {
    std::ifstream metrics(join_path(run_dir, "metrics.jsonl"));
    std::string line;
    std::map<int, double> val;
    while (std::getline(metrics, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.contains("val_loss")) val[j["step"].get<int>()] = j["val_loss"].get<double>();
    }
    return val;
  };
  auto r = run(base + " --run-dir " + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  auto val = val_losses(dir);
  ASSERT_EQ(val.size(), 3u) << "steps 2, 4 and 5";
  for (const int step : {2, 4, 5}) {
    ASSERT_TRUE(val.count(step)) << step;
    EXPECT_TRUE(std::isfinite(val[step]) && val[step] > 0) << val[step];
  }
  const auto log = megaslide::io::read_file(join_path(dir, "train.log"));
  EXPECT_NE(log.find("validation loss every 2 steps and after the last: 2 batches of 4 of the training data"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find(fmt::format("step 4: validation loss {:.5f} (2 batches of 4,", val[4])), std::string::npos) << log;
  // Held out: other clips (structured-motion's data.seed), other values.
  auto held = fresh_dir("val-held");
  r = run(base + " --set 'train.val_data=[data.seed=777]' --run-dir " + held);
  ASSERT_EQ(r.code, 0) << r.output;
  auto held_val = val_losses(held);
  ASSERT_EQ(held_val.size(), 3u);
  EXPECT_GT(std::abs(held_val[2] - val[2]), 1e-6 * val[2]) << "the held-out data's loss differs";
  // Refused before the first step, naming the key.
  for (const std::string& bad : {"'train.val_data=[train.lr=1]'", "'train.val_data=[data.dataset=videos]'"}) {
    auto refused = fresh_dir("val-bad");
    r = run(base + " --set " + bad + " --run-dir " + refused);
    EXPECT_EQ(r.code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("train.val_data"), std::string::npos) << r.output;
    EXPECT_FALSE(megaslide::io::path_exists(join_path(refused, "metrics.jsonl"))) << bad;
    megaslide::io::remove_tree(refused);
  }
  megaslide::io::remove_tree(dir);
  megaslide::io::remove_tree(held);
}

// The property: train.sample_prompts gives each validation video its line's size, seed, steps,
// guidance and negative prompt (recorded in index.json), a repeated prompt the next VBench index, the
// other lines the run's size and settings; a line the model cannot sample refuses the run before
// anything is written, naming the key, the file and the line.
TEST(MegaslideTrain, ValidationPromptFileSetsEachVideosSizeSeedAndSettings) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  const auto dir = fresh_dir("prompt-file");
  megaslide::io::make_directories(dir);
  const auto prompts = join_path(dir, "prompts.txt");
  megaslide::io::write_file_atomically(
      prompts,
      "# two sizes of one prompt\n"
      "a red square moves left --f 4 --h 12 --w 20 --d 7 --s 3 --g 2.5 --n a blue square\n"
      "a red square moves left\n");
  const auto run_dir = join_path(dir, "run");
  auto r = run("--config " + smoke() + " --run-dir " + run_dir +
               " --set train.steps=2 --set train.sample_every=2 --set diffusion.sample_steps=2" +
               " --set train.sample_prompts=" + prompts);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto samples = join_path(run_dir, "samples/step-0000002");
  const auto index = nlohmann::json::parse(megaslide::io::read_file(join_path(samples, "index.json")));
  const auto& videos = index.at("videos");
  ASSERT_EQ(videos.size(), 2u) << index.dump();
  EXPECT_EQ(index.at("steps").get<int64_t>(), 2);  // the run's
  const auto& own = videos[0];
  EXPECT_EQ(own.at("prompt").get<std::string>(), "a red square moves left");
  EXPECT_EQ(own.at("index").get<int64_t>(), 0);
  EXPECT_EQ(own.at("seed").get<uint64_t>(), 7u);
  EXPECT_EQ(own.at("steps").get<int64_t>(), 3);
  EXPECT_EQ(own.at("guidance_scale").get<double>(), 2.5);
  EXPECT_EQ(own.at("negative_prompt").get<std::string>(), "a blue square");
  EXPECT_EQ(own.at("frames").get<int64_t>(), 4);
  const auto& plain = videos[1];
  EXPECT_EQ(plain.at("index").get<int64_t>(), 1);
  EXPECT_EQ(plain.at("file").get<std::string>(), "a red square moves left-1.mp4");
  EXPECT_FALSE(plain.contains("steps") || plain.contains("frames") || plain.contains("negative_prompt"))
      << plain.dump();
  megaslide::io::VideoInfo info;
  EXPECT_EQ(megaslide::io::read_video(join_path(samples, "videos/" + own.at("file").get<std::string>()), &info).sizes(),
            (std::vector<int64_t>{4, 12, 20, 3}));
  EXPECT_EQ(
      megaslide::io::read_video(join_path(samples, "videos/" + plain.at("file").get<std::string>()), &info).sizes(),
      (std::vector<int64_t>{8, 16, 16, 3}));  // smoke.yaml's clips
  const auto log = megaslide::io::read_file(join_path(run_dir, "train.log"));
  EXPECT_NE(log.find("(from " + prompts + ")"), std::string::npos) << log;

  // An odd width cannot be patched (model.patch [1, 2, 2]): refused before the run folder exists.
  megaslide::io::write_file_atomically(prompts, "a red square moves left\na blue square moves up --w 15\n");
  const auto refused = join_path(dir, "refused");
  r = run("--config " + smoke() + " --run-dir " + refused +
          " --set train.sample_every=2 --set train.sample_prompts=" + prompts);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("train.sample_prompts"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("line 2: this model cannot sample 8x16x15"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(refused));
  megaslide::io::remove_tree(dir);
}

namespace {
std::vector<std::string> logged_losses(const std::string& run_dir) {
  std::vector<std::string> out;
  std::ifstream in(join_path(run_dir, "metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].dump());
  return out;
}

size_t line_count(const std::string& path) {
  std::ifstream in(path);
  size_t n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

// Starts megaslide-train with `args` in a child process whose stdout and stderr go to `log`, the signals in
// `disposition` first set so (SIG_IGN: as a script's background job or nohup leaves them). Returns its pid.
pid_t start_train(const std::string& log, const std::vector<std::string>& args,
                  const std::vector<std::pair<int, sighandler_t>>& disposition = {}) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  std::freopen(log.c_str(), "w", stderr);
  std::freopen(log.c_str(), "a", stdout);
  for (const auto& [signal, handler] : disposition) std::signal(signal, handler);
  const std::string bin = std::string(MEGASLIDE_BINARY_DIR) + "/bin/megaslide-train";
  std::vector<char*> argv{const_cast<char*>(bin.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv(bin.c_str(), argv.data());
  ::_exit(127);
}
}  // namespace

// The property: a run stopped part-way by SIGTERM, then by SIGHUP (a closed terminal) and resumed each time logs
// the uninterrupted run's losses exactly. Each signal lets the current step finish, saves a checkpoint and exits
// with 128 + its number.
TEST(MegaslideTrain, SigtermSavesAndResumeReproducesTheUninterruptedLosses) {
  const std::string args =
      "--config " + smoke() + " --set train.steps=24 --set output.progress=false --set train.threads=1";
  const auto whole = fresh_dir("sigterm-whole"), parts = fresh_dir("sigterm-parts");
  ASSERT_EQ(run(args + " --run-dir " + whole).code, 0);

  // The child's output, named after this test's process (so test_main removes it once the test passes).
  const std::string log = "/tmp/megaslide-test-sigterm-" + std::to_string(::getpid()) + ".log";
  const auto metrics = join_path(parts, "metrics.jsonl");
  // Runs the tool (resuming when asked) until `lines` steps are logged, then sends `signal`.
  const auto stop_with = [&](int signal, size_t lines, bool resume) {
    const std::string exported = join_path(parts, "w.safetensors");  // (a fresh run: its export is said unwritten)
    const pid_t pid = start_train(
        log,
        {"--config", smoke(), "--run-dir", parts, "--set", "train.steps=24", "--set", "output.progress=false", "--set",
         "train.threads=1", resume ? "--resume" : "--export-weights", resume ? "latest" : exported},
        {{SIGHUP, SIG_DFL}});  // as from a terminal, even where the tests run under nohup
    ASSERT_GE(pid, 0);
    for (int i = 0; i < 6000 && line_count(metrics) < lines; ++i) ::usleep(10000);
    ::kill(pid, signal);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 128 + signal);
    const size_t stopped_at = line_count(metrics);
    ASSERT_GE(stopped_at, lines);
    ASSERT_LT(stopped_at, 24u) << "the run ended before the signal; the test proves nothing";
    EXPECT_TRUE(megaslide::io::is_directory(join_path(
        parts,
        "checkpoints/step-" + std::string(7 - std::to_string(stopped_at).size(), '0') + std::to_string(stopped_at))));
  };
  stop_with(SIGTERM, 5, false);
  EXPECT_NE(
      megaslide::io::read_file(join_path(parts, "train.log")).find("; not written (they come after the last step"),
      std::string::npos)
      << "the stopped run says its --export-weights was not written";
  EXPECT_FALSE(megaslide::io::path_exists(join_path(parts, "w.safetensors")));
  stop_with(SIGHUP, line_count(metrics) + 3, true);

  auto r = run(args + " --run-dir " + parts + " --resume latest");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(logged_losses(parts), logged_losses(whole));
  megaslide::io::remove_tree(whole);
  megaslide::io::remove_tree(parts);
}

// The property: a stop signal the tool was started ignoring (SIGINT for a job a script starts with `&`, SIGHUP under
// nohup) stays ignored while it trains: the run goes on to its last step and exits 0, having said so at its start.
TEST(MegaslideTrain, SignalsTheRunWasStartedIgnoringStayIgnored) {
  const auto dir = fresh_dir("ignored");
  const std::string log = "/tmp/megaslide-test-ignored-" + std::to_string(::getpid()) + ".log";
  const pid_t pid = start_train(log,
                                {"--config", smoke(), "--run-dir", dir, "--set", "train.steps=40", "--set",
                                 "output.progress=false", "--set", "train.threads=1", "--set", "train.log_every=1"},
                                {{SIGINT, SIG_IGN}, {SIGHUP, SIG_IGN}});
  ASSERT_GE(pid, 0);
  const auto metrics = join_path(dir, "metrics.jsonl");
  for (int i = 0; i < 6000 && line_count(metrics) < 3; ++i) ::usleep(10000);
  const size_t when = line_count(metrics);
  ::kill(pid, SIGINT);
  ::kill(pid, SIGHUP);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << megaslide::io::read_file(log);
  EXPECT_EQ(WEXITSTATUS(status), 0) << megaslide::io::read_file(log);
  EXPECT_LT(when, 40u) << "the run ended before the signals; the test proves nothing";
  EXPECT_EQ(line_count(metrics), 40u);
  EXPECT_NE(megaslide::io::read_file(log).find(
                "SIGINT, SIGHUP ignored (this process was started ignoring them, as a script's background job or nohup "
                "is); SIGTERM or SIGUSR1 stop the run with a checkpoint"),
            std::string::npos)
      << "the run says that Ctrl-C does nothing, and what stops it";
  megaslide::io::remove_tree(dir);
}

// The property: a data file the run reads through a memory map, truncated in place while the run reads it (a user
// rewriting it, rsync --inplace), ends the run by SIGBUS as before — but with a line naming the file and what to do,
// where it used to die without a word.
TEST(MegaslideTrain, AMappedFileTruncatedUnderTheRunIsNamed) {
  const auto dir = fresh_dir("sigbus");
  const std::string config = megaslide::testing::write_tiny_wan(dir + "/data", 8);
  const std::string tensors = dir + "/data/latents.safetensors";
  const std::string log = "/tmp/megaslide-test-sigbus-" + std::to_string(::getpid()) + ".log";
  const pid_t pid = start_train(log, {"--config", config, "--run-dir", dir + "/run", "--set", "train.steps=1000000",
                                      "--set", "train.checkpoint_every=0", "--set", "train.threads=1", "--set",
                                      "train.log_every=1", "--set", "offload.enabled=false"});
  ASSERT_GE(pid, 0);
  const auto metrics = join_path(dir + "/run", "metrics.jsonl");
  for (int i = 0; i < 6000 && line_count(metrics) < 3; ++i) ::usleep(10000);
  ASSERT_GE(line_count(metrics), 3u) << megaslide::io::read_file(log);
  ASSERT_EQ(::truncate(tensors.c_str(), 0), 0);
  int status = 0;
  pid_t ended = 0;
  for (int i = 0; i < 3000 && (ended = ::waitpid(pid, &status, WNOHANG)) == 0; ++i) ::usleep(10000);
  if (ended == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the run went on reading a truncated file\n" << megaslide::io::read_file(log);
  }
  ASSERT_TRUE(WIFSIGNALED(status)) << megaslide::io::read_file(log);
  EXPECT_EQ(WTERMSIG(status), SIGBUS);
  EXPECT_NE(megaslide::io::read_file(log).find("the file '" + tensors +
                                               "' read through a memory map lost the bytes being read (SIGBUS)"),
            std::string::npos)
      << megaslide::io::read_file(log);
  megaslide::io::remove_tree(dir);
  ::unlink(log.c_str());
}

// The property: a run whose metrics can no longer be written (a full disk; here a file size limit that its metrics
// reach and its checkpoint files do not) stops as a signal would, saving a checkpoint of the step it trained, and
// says where; resumed from it, the run trains to its last step.
TEST(MegaslideTrain, AFailedMetricsWriteSavesACheckpointBeforeStopping) {
  const auto dir = fresh_dir("metrics-full");
  const std::string args = "--config " + smoke() +
                           " --set model.hidden=8 --set model.text_dim=8 --set model.heads=1 --set model.layers=1 "
                           "--set train.threads=1 --set output.progress=false --run-dir " +
                           dir;
  ASSERT_EQ(run(args + " --set train.steps=80 --set train.checkpoint_every=80").code, 0);
  const auto metrics = join_path(dir, "metrics.jsonl");
  struct stat st {};
  ASSERT_EQ(::stat(metrics.c_str(), &st), 0);
  const rlim_t limit = static_cast<rlim_t>(st.st_size) + 2048;  // the metrics reach it within steps
  ASSERT_LT(megaslide::io::read_file(join_path(dir, "checkpoints/step-0000080/master.safetensors")).size(), limit)
      << "the checkpoint's files must fit under the limit for the test to mean anything";
  const std::string log = "/tmp/megaslide-test-metrics-full-" + std::to_string(::getpid()) + ".log";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::freopen(log.c_str(), "w", stderr);
    std::freopen(log.c_str(), "a", stdout);
    const rlimit r{limit, limit};
    ::setrlimit(RLIMIT_FSIZE, &r);
    std::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead of ending the process
    const std::string command = std::string(MEGASLIDE_BINARY_DIR) + "/bin/megaslide-train " + args +
                                " --set train.steps=120 --set train.checkpoint_every=80 --resume latest";
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const std::string output = megaslide::io::read_file(log);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 1) << output;
  const auto at = output.find("writing the run's metrics of step ");
  ASSERT_NE(at, std::string::npos) << output;
  const int64_t step = std::stoll(output.substr(at + 34));
  EXPECT_GT(step, 80);
  EXPECT_LT(step, 120);
  const std::string checkpoint = fmt::format("checkpoints/step-{:07}", step);
  EXPECT_NE(output.find("is in checkpoint " + join_path(dir, checkpoint)), std::string::npos) << output;
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "checkpoints/latest")).rfind(fmt::format("step-{:07}", step), 0),
            0u);
  const auto resumed = run(args + " --set train.steps=120 --set train.checkpoint_every=80 --resume latest");
  EXPECT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(logged_losses(dir).size(), 119u) << "every step's line but the one whose write failed";
  megaslide::io::remove_tree(dir);
}

TEST(MegaslideTrain, CorruptCheckpointExitsTwoNamingTheFileAndChangesNothing) {
  const auto dir = fresh_dir("corrupt");
  const std::string args =
      "--config " + smoke() +
      " --set train.steps=6 --set train.checkpoint_every=3 --set output.progress=false --run-dir " + dir;
  ASSERT_EQ(run(args).code, 0);
  const auto metrics = megaslide::io::read_file(join_path(dir, "metrics.jsonl"));
  const auto log = megaslide::io::read_file(join_path(dir, "train.log"));
  const auto file = join_path(dir, "checkpoints/step-0000006/exp_avg.safetensors");
  std::string bytes = megaslide::io::read_file(file);
  bytes[bytes.size() - 3] ^= 1;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  auto r = run(args + " --resume latest");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("exp_avg.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("corrupted"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "metrics.jsonl")), metrics);
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "train.log")), log);
  // A fresh run into the same folder is refused too: it would overwrite the run.
  r = run(args);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--resume latest"), std::string::npos) << r.output;
  // A resume to an earlier checkpoint, with another config, whose log is a folder now: refused before its config.yaml
  // is rewritten or `latest` rolled back.
  const auto config_yaml = megaslide::io::read_file(join_path(dir, "config.yaml"));
  const auto latest = megaslide::io::read_file(join_path(dir, "checkpoints/latest"));
  megaslide::io::remove_tree(join_path(dir, "train.log"));
  megaslide::io::make_directories(join_path(dir, "train.log"));
  r = run(args + " --set train.lr=0.5 --resume " + join_path(dir, "checkpoints/step-0000003"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("train.log' is a folder"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "config.yaml")), config_yaml);
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "checkpoints/latest")), latest);
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "metrics.jsonl")), metrics);
  megaslide::io::remove_tree(dir);
}

TEST(MegaslideTrain, ExportWeightsFromACheckpointWritesTheBf16WeightsFile) {
  const auto dir = fresh_dir("export");
  const std::string args =
      "--config " + smoke() +
      " --set train.steps=4 --set train.checkpoint_every=2 --set output.progress=false --run-dir " + dir;
  ASSERT_EQ(run(args).code, 0);
  const auto out = dir + "/exported.safetensors";
  // An earlier export killed with SIGKILL left its temporary file beside the output: the export names it.
  megaslide::io::write_file_atomically(out + ".Ab3xYz.tmp", std::string(1000, 'x'));
  auto r = run(args + " --resume " + join_path(dir, "checkpoints/step-0000004") + " --export-weights " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: '" + out + ".Ab3xYz.tmp' (1e-06 GB) is the unfinished file of an earlier write"),
            std::string::npos)
      << r.output;
  const auto header = megaslide::io::read_safetensors_header(out);
  EXPECT_EQ(header.metadata.at("format"), "megaslide.weights");
  bool has_block = false;
  for (const auto& e : header.entries) {
    EXPECT_EQ(e.dtype, torch::kBFloat16) << e.name;
    has_block |= e.name == "dit.blocks.0.attn.q.weight";
  }
  EXPECT_TRUE(has_block);
  EXPECT_EQ(megaslide::io::read_file(out),
            megaslide::io::read_file(join_path(dir, "checkpoints/step-0000004/model.safetensors")));
  megaslide::io::remove_tree(dir);
}

namespace {
// A smoke model trained 12 steps, its weights in `dir`/base.safetensors: a frozen base whose blocks pass gradients
// to LoRA adapters (a fresh model's zero-initialised gates would not).
std::string trained_smoke_base(const std::string& dir) {
  const std::string file = dir + "/base.safetensors";
  EXPECT_EQ(run("--config " + smoke() +
                " --set train.steps=12 --set train.checkpoint_every=0 --set output.progress=false --run-dir " + dir +
                " --export-weights " + file)
                .code,
            0);
  return file;
}
}  // namespace

// Property: a LoRA run whose frozen model starts from train.init_from resumes bit for bit: its checkpoint holds the
// adapters alone, and the resumed run takes the frozen model from train.init_from again (it once started from the
// random initialisation instead, and its losses jumped); a resume without train.init_from, or with another
// lora.alpha, is refused naming it.
TEST(MegaslideTrain, ALoraRunOnAnInitFromBaseResumesBitExactly) {
  const auto dir = fresh_dir("lora-init-resume");
  const std::string args = "--config " + smoke() +
                           " --set lora.rank=2 --set train.init_from=" + trained_smoke_base(dir + "-base") +
                           " --set train.steps=6 --set train.checkpoint_every=3 --set output.progress=false";
  ASSERT_EQ(run(args + " --run-dir " + dir + "-whole").code, 0);
  ASSERT_EQ(run(args + " --run-dir " + dir + " --set train.steps=3").code, 0);
  // The frozen model's file gone: refused naming train.init_from (it once went on with a random frozen model).
  const std::string base = dir + "-base/base.safetensors";
  ASSERT_EQ(std::rename(base.c_str(), (base + ".away").c_str()), 0);
  auto refused = run(args + " --run-dir " + dir + " --resume latest");
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_NE(refused.output.find("train.init_from '" + base + "' cannot be read"), std::string::npos) << refused.output;
  // Another model file named at the resume: said (here by the export-only path, which trains nothing).
  ASSERT_EQ(std::rename((base + ".away").c_str(), (base + ".other").c_str()), 0);
  auto other = run(args + " --run-dir " + dir + " --resume latest --set train.init_from=" + base +
                   ".other --export-merged " + dir + "-base/merged.safetensors");
  EXPECT_EQ(other.code, 0) << other.output;
  EXPECT_NE(other.output.find("warning: train.init_from is " + base + ".other here but was " + base), std::string::npos)
      << other.output;
  ASSERT_EQ(std::rename((base + ".other").c_str(), base.c_str()), 0);
  // No train.init_from at the resume (the adapters would sit on a fresh random model), or another lora.alpha (the
  // adapters' scale): refused, naming them.
  refused = run(args + " --run-dir " + dir + " --resume latest --set train.init_from=");
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_NE(refused.output.find("train.init_from was '" + base + "' when it was saved and is empty here"),
            std::string::npos)
      << refused.output;
  refused = run(args + " --run-dir " + dir + " --resume latest --set lora.alpha=8");
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_NE(refused.output.find("lora.alpha is 2 (0: the rank) in the checkpoint but 8"), std::string::npos)
      << refused.output;
  // The alpha 0 stood for (the rank), spelled out: the same scale, resumed.
  const auto r = run(args + " --run-dir " + dir + " --resume latest --set lora.alpha=2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("the frozen model (a LoRA checkpoint holds the adapters alone) initialised from"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(logged_losses(dir), logged_losses(dir + "-whole"));
  for (const char* suffix : {"", "-whole", "-base"}) megaslide::io::remove_tree(dir + suffix);
}

// Property: --resume CHECKPOINT --export-merged writes that checkpoint's model with its adapters merged and trains
// nothing: the run folder is left byte for byte as it was (no step trained or saved, `latest` not moved back, the log
// and metrics untouched), the file from step 2 differs from the one from step 4, and exporting step 2 again gives
// the same bytes.
TEST(MegaslideTrain, ExportMergedFromAnEarlierCheckpointTrainsNothingAndLeavesTheRunAsItWas) {
  const auto dir = fresh_dir("export-merged");
  const std::string args = "--config " + smoke() +
                           " --set lora.rank=4 --set train.init_from=" + trained_smoke_base(dir + "-base") +
                           " --set train.steps=4 --set train.checkpoint_every=2 --set train.warmup_steps=0"
                           " --set output.progress=false --run-dir " +
                           dir;
  ASSERT_EQ(run(args).code, 0);
  const auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const std::string& name : {"train.log", "metrics.jsonl", "config.yaml", "checkpoints/latest"})
      files[name] = megaslide::io::read_file(join_path(dir, name));
    for (const auto& name : megaslide::io::list_directory(join_path(dir, "checkpoints"))) files["ls " + name] = "";
    for (const auto& name : megaslide::io::list_directory(dir)) files["ls/ " + name] = "";
    return files;
  };
  const auto before = snapshot();
  const auto export_from = [&](const std::string& step, const std::string& out) {
    const auto r =
        run(args + " --resume " + join_path(dir, "checkpoints/step-000000" + step) + " --export-merged " + out);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("step-000000" + step), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step 3"), std::string::npos) << "trained: " << r.output;
    return megaslide::io::read_file(out);
  };
  const std::string from_2 = export_from("2", dir + "-merged-2.safetensors");
  EXPECT_TRUE(snapshot() == before);
  const std::string from_4 = export_from("4", dir + "-merged-4.safetensors");
  EXPECT_TRUE(from_2 != from_4) << "the adapters of step 2 and step 4 merged into the same weights";
  EXPECT_TRUE(export_from("2", dir + "-merged-2b.safetensors") == from_2);
  EXPECT_TRUE(snapshot() == before);
  for (const char* suffix : {"-merged-2.safetensors", "-merged-4.safetensors", "-merged-2b.safetensors"})
    std::remove((dir + suffix).c_str());
  megaslide::io::remove_tree(dir);
  megaslide::io::remove_tree(dir + "-base");
}

TEST(MegaslideTrain, StreamedOnEmulatedAsyncStreamsMatchesTheResidentLoop) {
  // The streamed trainer with fp32 compute on emulated asynchronous streams (every copy 2 ms late, its
  // destination NaN until it lands) against the resident loop: the losses of 15 steps agree within 1e-5
  // relative, with immediate (grad_clip 0) and deferred (grad_clip 1) updates.
  for (const char* clip : {"0", "1"}) {
    SCOPED_TRACE(std::string("grad_clip ") + clip);
    const std::string common =
        " --config " + smoke() + " --set train.steps=15 --set train.log_every=1 --set train.device=cpu" +
        " --set train.threads=1 --set train.checkpoint_every=0 --set output.progress=false --set train.grad_clip=" +
        clip;
    auto dir_s = fresh_dir(std::string("emul-s") + clip), dir_r = fresh_dir(std::string("emul-r") + clip);
    auto s = run(common +
                 " --set offload.compute_dtype=fp32 --set offload.mode=async --set offload.emulated_copy_delay_ms=2" +
                 " --run-dir " + dir_s);
    ASSERT_EQ(s.code, 0) << s.output;
    auto r = run(common + " --set offload.enabled=false --run-dir " + dir_r);
    ASSERT_EQ(r.code, 0) << r.output;
    const auto ls = megaslide::io::read_file(join_path(dir_s, "metrics.jsonl"));
    const auto lr = megaslide::io::read_file(join_path(dir_r, "metrics.jsonl"));
    std::vector<double> a, b;
    for (auto pair : {std::make_pair(&ls, &a), std::make_pair(&lr, &b)}) {
      size_t pos = 0;
      while (pos < pair.first->size()) {
        const size_t end = pair.first->find('\n', pos);
        const auto line = pair.first->substr(pos, end - pos);
        if (!line.empty()) pair.second->push_back(nlohmann::json::parse(line).at("loss").get<double>());
        pos = end == std::string::npos ? pair.first->size() : end + 1;
      }
    }
    ASSERT_EQ(a.size(), 15u);
    ASSERT_EQ(b.size(), 15u);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << "step " << i + 1;
    megaslide::io::remove_tree(dir_s);
    megaslide::io::remove_tree(dir_r);
  }
}

namespace {
// What `auto` must resolve to on this machine's CPU, from the kernel's CPU flags (not from the code
// under test): bf16 where the CPU has AVX512-BF16 or AMX-BF16 and oneDNN is not capped, else fp32.
std::string expected_cpu_auto_dtype() {
  const std::string cpuinfo = megaslide::io::read_file("/proc/cpuinfo");
  const bool native =
      cpuinfo.find(" avx512_bf16") != std::string::npos || cpuinfo.find(" amx_bf16") != std::string::npos;
  const bool capped = std::getenv("ONEDNN_MAX_CPU_ISA") != nullptr || std::getenv("DNNL_MAX_CPU_ISA") != nullptr;
  return native && !capped ? "bf16" : "fp32";
}

// Sets an environment variable for the programs a test starts; restores it when destroyed.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() { had_ ? ::setenv(name_, old_.c_str(), 1) : ::unsetenv(name_); }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};
}  // namespace

// offload.compute_dtype: auto (the shipped default) is resolved once: config.yaml, train.log and --dry-run
// name the concrete dtype, and a resume of a checkpoint saved with another dtype is refused naming both.
TEST(MegaslideTrain, AutoComputeDtypeIsResolvedIntoConfigLogAndDryRunAndAResumeWithAnotherIsRefused) {
  const std::string expected = expected_cpu_auto_dtype();
  const std::string cpu = "--config " + smoke() + " --set train.device=cpu --set output.progress=false";
  auto r = run(cpu + " --dry-run --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output).at("compute_dtype"), expected) << r.output;
  r = run(cpu + " --set offload.compute_dtype=fp16 --dry-run --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output).at("compute_dtype"), "fp16") << "explicit settings are kept";

  const auto dir = fresh_dir("auto-dtype");
  r = run(cpu + " --set train.steps=2 --set train.warmup_steps=1 --run-dir " + dir);  // (a warm-up it finishes)
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(megaslide::load_run_config(join_path(dir, "config.yaml")).offload.compute_dtype, expected);
  const auto log = megaslide::io::read_file(join_path(dir, "train.log"));
  EXPECT_NE(log.find("compute dtype " + expected + " (auto: the CPU has"), std::string::npos) << log;
  EXPECT_NE(log.find("threads: LibTorch intra-op"), std::string::npos) << log;
  EXPECT_EQ(log.find("[warning]"), std::string::npos) << log;
  megaslide::io::remove_tree(dir);

  // Saved with fp16 (never what auto picks on a CPU), resumed with auto: refused, both dtypes named.
  const std::string saved = cpu + " --set train.steps=2 --set train.checkpoint_every=2 --run-dir " + dir;
  r = run(saved + " --set offload.compute_dtype=fp16");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto metrics = megaslide::io::read_file(join_path(dir, "metrics.jsonl"));
  r = run(cpu + " --set train.steps=3 --run-dir " + dir + " --resume latest");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("offload.compute_dtype is fp16 in the checkpoint but " + expected), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--set offload.compute_dtype=fp16"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "metrics.jsonl")), metrics) << "nothing written";
  megaslide::io::remove_tree(dir);

  // The resident loop computes in fp32: its dry run says so, train.log names a bf16 or fp16 it is given as ignored,
  // and its checkpoint resumes with `auto` whatever dtype its config recorded.
  r = run(cpu + " --set offload.enabled=false --dry-run --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output).at("compute_dtype"), "fp32") << r.output;
  r = run(saved + " --set offload.enabled=false --set offload.compute_dtype=fp16");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(megaslide::io::read_file(join_path(dir, "train.log"))
                .find("offload.compute_dtype: fp16, but offload.enabled is false (the resident reference loop "
                      "computes in fp32): ignored"),
            std::string::npos);
  r = run(cpu + " --set train.steps=3 --set offload.enabled=false --run-dir " + dir + " --resume latest");
  EXPECT_EQ(r.code, 0) << r.output;
  megaslide::io::remove_tree(dir);
}

// An explicit bf16 on a CPU without native bf16 (here: oneDNN capped to AVX2, as LibTorch runs on such a
// CPU) still trains, with one warning line saying how much slower it is and how to switch; auto picks fp32.
TEST(MegaslideTrain, ExplicitBf16OnACpuWithoutNativeBf16TrainsWithOneWarning) {
  ScopedEnv cap("ONEDNN_MAX_CPU_ISA", "AVX2");
  const std::string cpu = "--config " + smoke() + " --set train.device=cpu --set output.progress=false";
  auto r = run(cpu + " --dry-run --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output).at("compute_dtype"), "fp32");
  const auto dir = fresh_dir("bf16-warning");
  r = run(cpu + " --set train.steps=1 --set train.warmup_steps=0 --set offload.compute_dtype=bf16 --run-dir " + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto log = megaslide::io::read_file(join_path(dir, "train.log"));
  size_t warnings = 0;
  for (size_t at = log.find("[warning]"); at != std::string::npos; at = log.find("[warning]", at + 1)) ++warnings;
  EXPECT_EQ(warnings, 1u) << log;
  EXPECT_NE(log.find("bf16 compute on a CPU without native bf16 arithmetic"), std::string::npos) << log;
  EXPECT_NE(log.find("slower than in fp32"), std::string::npos) << log;
  EXPECT_NE(log.find("set offload.compute_dtype: auto"), std::string::npos) << log;
  EXPECT_NE(log.find("compute dtype bf16 (as configured)"), std::string::npos) << log;
  megaslide::io::remove_tree(dir);
}

namespace {
// A refusal for people: one clear line (no LibTorch stack trace), exit 2, quickly.
void expect_refused(const Result& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << "a stack trace reached the user:\n"
                                                                       << r.output;
  EXPECT_LE(std::count(r.output.begin(), r.output.end(), '\n'), 2) << r.output;
}
}  // namespace

TEST(MegaslideTrain, OutOfRangeNumbersExitTwoNamingTheKeyNotAbort) {
  expect_refused(run("--config " + smoke() + " --dry-run --set train.lr=1e400"), "train.lr");
  expect_refused(run("--config " + smoke() + " --dry-run --set train.lr=1e-400"), "train.lr");
  expect_refused(run("--config " + smoke() + " --dry-run --set model.layers=999999999999"), "model.layers");
}

// --dry-run names each file or folder the config gives that the run would open before its first step and that is
// not there (key, path, and that a relative one was read from the current folder), still exiting 0: it also plans
// models whose weights are not there yet. Present ones and ones the run would not open are not named.
TEST(MegaslideTrain, DryRunNamesTheMissingFilesTheRunWouldStopAt) {
  const std::string base = "--config " + smoke() + " --dry-run";
  auto r = run(base + " --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(nlohmann::json::parse(r.output).at("missing_paths").empty()) << r.output;
  r = run(base +
          " --json --set data.dataset=videos --set data.root=nothere-videos --set "
          "train.init_from=/nonexistent/w.safetensors --set train.sample_prompts=/nonexistent/p.txt");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto missing = nlohmann::json::parse(r.output).at("missing_paths");
  ASSERT_EQ(missing.size(), 2u) << r.output << " (train.sample_prompts: no validation videos, so not opened)";
  EXPECT_EQ(missing[0].get<std::string>().rfind("data.root: 'nothere-videos' does not exist (a relative path, read "
                                                "from /",
                                                0),
            0u)
      << missing[0];
  EXPECT_EQ(missing[1].get<std::string>().rfind("train.init_from: '/nonexistent/w.safetensors' does not exist: ", 0),
            0u)
      << missing[1];
  r = run(base + " --set data.dataset=videos --set data.root=nothere-videos --set data.cache=/nonexistent/cache");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: data.cache: '/nonexistent/cache' does not exist: the run would stop there"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("warning: data.root: 'nothere-videos'"), std::string::npos)
      << "a cache's run reads the listing too: " << r.output;
  // A folder the run needs that is a file; the NVMe tier's folder.
  r = run(base + " --set data.dataset=videos --set data.root=" + smoke() +
          " --set offload.state_tier=nvme --set offload.nvme_dir=/nonexistent/nvme");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: data.root: '" + smoke() + "' is not a folder: the run would stop there"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("warning: offload.nvme_dir: '/nonexistent/nvme' does not exist"), std::string::npos)
      << r.output;
  // The validation data's own files (train.val_data), each named once: a path the training data reads too is the
  // training data's line.
  r = run(base +
          " --json --set data.dataset=videos --set data.root=/nonexistent/videos --set train.val_every=5 --set "
          "'train.val_data=[data.cache=/nonexistent/val-cache]'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto with_val = nlohmann::json::parse(r.output).at("missing_paths");
  ASSERT_EQ(with_val.size(), 2u) << r.output;
  EXPECT_EQ(with_val[0].get<std::string>().rfind("data.root: '/nonexistent/videos' does not exist", 0), 0u) << r.output;
  EXPECT_EQ(with_val[1].get<std::string>().rfind(
                "train.val_data (data.cache): '/nonexistent/val-cache' does not exist: the run would stop there", 0),
            0u)
      << r.output;
}

TEST(MegaslideTrain, ConfigThatIsAFolderOrADeviceIsRefused) {
  expect_refused(run("--config /tmp --dry-run"), "is a folder");
  expect_refused(run("--config /dev/zero --dry-run"), "is a device");
}

TEST(MegaslideTrain, EmptyOrUnwritableOutputPathsAreRefusedBeforeTheFirstStep) {
  const auto dir = fresh_dir("outputs");
  expect_refused(run("--config " + smoke() + " --run-dir ''"), "--run-dir");
  // A path left out, the next flag taken for it: it trained into ./--dry-run and exported into a file named --set.
  expect_refused(run("--config " + smoke() + " --run-dir --dry-run"), "'--dry-run' is written as a flag is");
  expect_refused(run("--config " + smoke() + " --run-dir " + dir + " --export-weights --set train.steps=2"),
                 "--export-weights");
  // The flag's error, not the config file's: the message starts with the flag.
  expect_refused(run("--config " + smoke() + " --run-dir " + dir + " --trace /nonexistent/d/t.json"),
                 "megaslide-train: --trace '/nonexistent/d/t.json': folder '/nonexistent/d' does not exist");
  EXPECT_FALSE(megaslide::io::path_exists(dir)) << "a refused run leaves no folder";
  // Nor the parents it made for its folder, refused after making them (LoRA targets that match no layer).
  expect_refused(run("--config " + smoke() + " --set lora.rank=2 --set 'lora.targets=[nothing*]' --run-dir " +
                     join_path(dir, "a/b/run")),
                 "lora.targets");
  EXPECT_FALSE(megaslide::io::path_exists(dir)) << "a refused run leaves no parent folder it made";
  megaslide::io::make_directories(dir + "-existing");
  expect_refused(run("--config " + smoke() + " --run-dir " + dir + " --export-weights " + dir + "-existing"),
                 "is a folder");
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "metrics.jsonl"))) << "refused before training";
  megaslide::io::remove_tree(dir + "-existing");
  megaslide::io::remove_tree(dir);
}

// The property: an output file that would destroy an input or the run's own files is refused before anything is
// written (exit 2, naming both): --export-weights at the --config file (it became a safetensors file), the same file
// for two exports (the EMA replaced the weights), a file under the run's checkpoints/ or the run's config.yaml,
// --trace at the config, a file the config reads; --dry-run refuses the flags of a run it would drop; and an export
// into the run folder itself, with --resume naming the run folder, is written.
TEST(MegaslideTrain, OutputsThatWouldReplaceInputsOrEachOtherAreRefused) {
  const auto dir = fresh_dir("clobber");
  megaslide::io::make_directories(dir);
  const std::string config = join_path(dir, "run.yaml");
  const std::string text = megaslide::io::read_file(smoke());
  megaslide::io::write_file_atomically(config, text);
  const std::string run_dir = join_path(dir, "run");
  const std::string base = "--config " + config + " --run-dir " + run_dir + " --set train.steps=2";
  expect_refused(run(base + " --export-weights " + config), "is --config's file");
  expect_refused(run(base + " --trace " + config), "is --config's file");
  expect_refused(run(base + " --set train.ema_decay=0.9 --export-weights " + dir + "/w.safetensors --export-ema " +
                     dir + "/./w.safetensors"),
                 "is also --export-weights's file");
  expect_refused(run(base + " --export-weights " + run_dir + "/config.yaml"), "the run folder's config.yaml");
  expect_refused(run(base + " --export-weights " + run_dir + "/checkpoints/step-0000002/model.safetensors"),
                 "inside the run folder's checkpoints/");
  EXPECT_EQ(megaslide::io::read_file(config), text) << "the config is as it was";
  EXPECT_FALSE(megaslide::io::path_exists(run_dir)) << "refused before the run folder exists";
  expect_refused(run("--config " + config + " --dry-run --resume latest --export-weights " + dir + "/w.safetensors"),
                 "--dry-run describes the run and writes nothing; it does not take --resume, --export-weights");
  // A file the config reads (here train.sample_prompts') is refused as an output too.
  const std::string prompts = join_path(dir, "prompts.txt");
  megaslide::io::write_file_atomically(prompts, "a red blob\n");
  expect_refused(run(base + " --set train.sample_prompts=" + prompts + " --export-weights " + prompts),
                 "is train.sample_prompts's file");
  // Exports into the run folder itself stay allowed, with --resume naming the checkpoint by the run folder too.
  ASSERT_EQ(run(base + " --set train.checkpoint_every=2 --set train.warmup_steps=1").code, 0);
  const auto exported = run(base + " --resume " + run_dir + " --export-weights " + run_dir + "/w.safetensors");
  EXPECT_EQ(exported.code, 0) << exported.output;
  EXPECT_TRUE(megaslide::io::path_exists(run_dir + "/w.safetensors"));
  expect_refused(
      run(base + " --resume " + run_dir + " --export-weights " + run_dir + "/checkpoints/step-0000002/w.safetensors"),
      "is inside the run folder's checkpoints/");
  // The run's lock file, and another run folder's files (an export from this run into that one's metrics, checkpoints
  // or lock: its next resume would read them as its own, or a second run would train there beside it).
  expect_refused(run(base + " --export-weights " + run_dir + "/.lock"), "the run folder's .lock");
  const std::string other = dir + "/other";
  const std::string other_base = "--config " + config + " --run-dir " + other + " --set train.steps=2";
  for (const std::string target : {run_dir + "/metrics.jsonl", run_dir + "/.lock", run_dir + "/checkpoints/latest",
                                   run_dir + "/samples/step-0000002/w.safetensors"})
    expect_refused(run(other_base + " --export-weights " + target), "of the training run folder '");
  EXPECT_TRUE(megaslide::io::path_exists(run_dir + "/metrics.jsonl"));
  EXPECT_EQ(megaslide::io::read_file(run_dir + "/checkpoints/latest").rfind("step-0000002", 0), 0u);
  EXPECT_EQ(run(other_base + " --export-weights " + run_dir + "/w2.safetensors").code, 0)
      << "a file of its own in another run's folder stays allowed";
  megaslide::io::make_directories(run_dir + "/samples/mine");
  EXPECT_EQ(run("--config " + config + " --run-dir " + dir + "/third --set train.steps=2 --export-weights " + run_dir +
                "/samples/mine/w.safetensors")
                .code,
            0)
      << "and one in a folder of its own under samples/";
  megaslide::io::remove_tree(dir);
}

// The property: a path given as a flag is the path, not YAML ('exp #3' is not 'exp'); one that is not
// UTF-8, or an output that is a device, is refused before the first step with nothing written; and
// symbolic links planted at the names a run's files used to be staged under are never followed (their
// victim untouched, the links left as they were).
TEST(MegaslideTrain, FlagPathsAreTakenAsTheyAreAndNoPlantedLinkIsFollowed) {
  const auto base = fresh_dir("paths");
  megaslide::io::make_directories(base);
  const auto dir = join_path(base, "exp #3");
  const auto victim = join_path(base, "victim");
  megaslide::io::write_file_atomically(victim, "precious\n");
  const std::string args = "--config " + smoke() + " --run-dir '" + dir +
                           "' --set train.checkpoint_every=2 --set train.threads=1 "
                           "--set output.progress=false --set train.batch_size=2";
  auto r = run(args + " --set train.steps=2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(megaslide::io::path_exists(join_path(dir, "metrics.jsonl"))) << "the run trained into 'exp #3'";
  EXPECT_FALSE(megaslide::io::path_exists(join_path(base, "exp"))) << "not into 'exp'";
  // Links planted at the old fixed temporary names, then a resume that rewrites `latest`, config.yaml,
  // metrics.jsonl and exports the weights.
  for (const char* name : {"checkpoints/latest.tmp", "config.yaml.tmp", "metrics.jsonl.tmp"})
    ASSERT_EQ(::symlink(victim.c_str(), join_path(dir, name).c_str()), 0) << name;
  ASSERT_EQ(::symlink(victim.c_str(), join_path(base, "w.safetensors.tmp").c_str()), 0);
  r = run(args + " --set train.steps=4 --resume latest");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(megaslide::io::path_exists(join_path(dir, "checkpoints/step-0000004")));
  r = run(args + " --set train.steps=4 --resume latest --export-weights '" + join_path(base, "w.safetensors") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(megaslide::io::path_exists(join_path(base, "w.safetensors")));
  EXPECT_EQ(megaslide::io::read_file(victim), "precious\n");
  for (const auto& link : {join_path(dir, "checkpoints/latest.tmp"), join_path(dir, "config.yaml.tmp"),
                           join_path(dir, "metrics.jsonl.tmp"), join_path(base, "w.safetensors.tmp")}) {
    char target[4096] = {};
    EXPECT_GT(::readlink(link.c_str(), target, sizeof target - 1), 0) << link << " is still the planted link";
  }
  const auto before = megaslide::io::list_directory(base);
  r = run("--config " + smoke() + " --run-dir '" + join_path(base, "r-\xff") + "' --set train.steps=1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("output.run_dir"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not UTF-8"), std::string::npos) << r.output;
  r = run("--config " + smoke() + " --run-dir '" + join_path(base, "r2") +
          "' --set train.steps=1 --export-weights /dev/full");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("is a device"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::list_directory(base), before) << "the refused runs wrote nothing";
  megaslide::io::remove_tree(base);
}

// The property: a run that needs more memory than the machine has, or a device it does not have, is
// refused in one line before anything is allocated or written.
TEST(MegaslideTrain, ImpossibleSizesAndMissingDevicesAreOneLineRefusals) {
  const auto dir = fresh_dir("sizes");
  expect_refused(run("--config " + smoke() + " --run-dir " + dir + " --set model.hidden=20000 --set model.heads=2"),
                 "this machine has");
  expect_refused(run("--config " + smoke() + " --run-dir " + dir + " --set train.batch_size=99999999"),
                 "this machine has");
  if (!torch::cuda::is_available())
    expect_refused(run("--config " + smoke() + " --run-dir " + dir + " --set train.device=cuda"), "no CUDA GPU");
  EXPECT_FALSE(megaslide::io::path_exists(dir));
}

TEST(MegaslideTrain, RerunIntoAFinishedRunWithoutCheckpointsIsRefused) {
  const auto dir = fresh_dir("rerun");
  const std::string args =
      "--config " + smoke() + " --run-dir " + dir + " --set train.steps=2 --set output.progress=false";
  ASSERT_EQ(run(args).code, 0);
  const auto metrics = megaslide::io::read_file(join_path(dir, "metrics.jsonl"));
  const auto r = run(args);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("already holds a run"), std::string::npos) << r.output;
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "metrics.jsonl")), metrics);
  megaslide::io::remove_tree(dir);
}

// ulimit -f: the trainer must survive SIGXFSZ, report the failed save and keep what it had (the unit
// test of save_checkpoint ignores the signal itself; this is the real process with its default).
TEST(MegaslideTrain, FileSizeLimitIsAReportedFailedSaveNotASilentKill) {
  const auto dir = fresh_dir("ulimit");
  const std::string cmd = "bash -c 'ulimit -f 48; exec " + std::string(MEGASLIDE_BINARY_DIR) +
                          "/bin/megaslide-train --config " + smoke() + " --run-dir " + dir +
                          " --set train.steps=2 --set train.checkpoint_every=1 --set output.progress=false' 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) output += buf;
  const int status = ::pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_NE(WEXITSTATUS(status), 128 + SIGXFSZ) << "killed by SIGXFSZ without a word:\n" << output;
  EXPECT_EQ(WEXITSTATUS(status), 1) << output;
  EXPECT_NE(output.find("File too large"), std::string::npos) << output;
  EXPECT_NE(output.find("could not save the final checkpoint"), std::string::npos) << output;
  megaslide::io::remove_tree(dir);
}

namespace {

using megaslide::testing::write_tiny_wan;

std::vector<double> wan_losses(const std::string& run_dir) {
  std::vector<double> out;
  std::ifstream in(join_path(run_dir, "metrics.jsonl"));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

double mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0.0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s / static_cast<double>(end - begin);
}

}  // namespace

// The property: megaslide-train trains a tiny Wan from a latent-tensors file — streamed CPU-master (bf16
// blocks) and resident — and the loss falls (mean of steps 21–30 below 0.85× that of steps 1–10); the
// streamed run resumed from its step-15 checkpoint logs the uninterrupted run's losses bit for bit;
// train.init_from a Wan run folder starts a fresh run from its latest checkpoint, and from a run of
// another size fails with exit 2 naming the mismatched tensors.
TEST(MegaslideTrain, WanTrainsFromLatentTensorsAndResumesBitExactly) {
  const auto dir = fresh_dir("wan");
  const auto config = write_tiny_wan(dir);
  const std::string args = "--config " + config;
  for (const char* mode : {"streamed", "resident"}) {
    const auto run_dir = join_path(dir, mode);
    auto r =
        run(args + " --run-dir " + run_dir + (std::string(mode) == "resident" ? " --set offload.enabled=false" : ""));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto losses = wan_losses(run_dir);
    ASSERT_EQ(losses.size(), 30u) << mode;
    std::cout << mode << ": mean loss, steps 1-10: " << mean(losses, 0, 10) << ", steps 21-30: " << mean(losses, 20, 30)
              << "\n";
    EXPECT_LT(mean(losses, 20, 30), 0.85 * mean(losses, 0, 10)) << mode;
  }
  // The streamed run again from its step-15 checkpoint (its later checkpoints are replaced as it goes).
  const auto streamed = join_path(dir, "streamed");
  const auto whole = wan_losses(streamed);
  auto r = run(args + " --run-dir " + streamed + " --resume " + join_path(streamed, "checkpoints/step-0000015"));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto resumed = wan_losses(streamed);
  ASSERT_EQ(resumed.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(resumed[i], whole[i]) << "step " << i + 1;

  const auto init = join_path(dir, "init");
  r = run(args + " --run-dir " + init + " --set train.steps=2 --set train.init_from=" + join_path(dir, "streamed"));
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream log(join_path(init, "train.log"));
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("initialised from " + join_path(dir, "streamed/checkpoints/step-0000030")), std::string::npos)
      << text;
  EXPECT_EQ(text.find("starts from random weights"), std::string::npos) << "a model to start from: " << text;
  // Started from trained weights: the first loss is far below the fresh run's first loss.
  EXPECT_LT(wan_losses(init).at(0), 0.8 * whole.at(0));
  r = run(args + " --run-dir " + join_path(dir, "wide") +
          " --set model.wan.ffn_dim=48 --set train.init_from=" + join_path(dir, "streamed"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("ffn"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "wide")));
  megaslide::io::remove_tree(dir);
}

// The property: --trace on a streamed Wan run writes a Chrome trace of the step asked for, with the
// stream lanes' events (uploads, compute, host AdamW of each block), and the log says where it is.
TEST(MegaslideTrain, TraceRecordsAStreamedWanStep) {
  const auto dir = fresh_dir("wan-trace");
  const auto config = write_tiny_wan(join_path(dir, "data"));
  const auto trace = join_path(dir, "step.json");
  auto r = run("--config " + config + " --run-dir " + join_path(dir, "run") +
               " --set train.steps=3 --set train.checkpoint_every=0" + " --trace " + trace + " --trace-step 2");
  ASSERT_EQ(r.code, 0) << r.output;
  // A fresh Wan run without weights, and one that keeps none: each said before the first step, marked as warnings.
  EXPECT_NE(r.output.find("warning: model.wan.weights is empty and train.init_from names no model"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("warning: train.checkpoint_every is 0 and there is no --export-weights"), std::string::npos)
      << r.output;
  std::ifstream in(trace);
  ASSERT_TRUE(in.good()) << r.output;
  const auto j = nlohmann::json::parse(in);
  std::set<std::string> names;
  for (const auto& e : j.at("traceEvents"))
    if (e.at("ph") == "X") names.insert(e.at("name").get<std::string>());
  for (const char* expected : {"adamw block 0", "adamw block 1"})
    EXPECT_TRUE(names.count(expected)) << expected << " in " << j.dump().substr(0, 2000);
  EXPECT_GT(names.size(), 4u);
  std::ifstream log(join_path(dir, "run/train.log"));
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("trace of step 2 in " + trace), std::string::npos) << text;
  EXPECT_EQ(text.find("ignored"), std::string::npos) << text;
  megaslide::io::remove_tree(dir);
}

// The property: a FIFO named as any input (weights to start from, latent tensors, a checkpoint) is refused
// within a second with exit 2 naming it, not waited on for ever (SIGTERM did not end such a wait).
TEST(MegaslideTrain, FifosNamedAsInputsAreRefusedAtOnce) {
  const auto base = fresh_dir("fifos");
  megaslide::io::make_directories(base);
  const auto fifo = join_path(base, "weights.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto wan = write_tiny_wan(join_path(base, "wan"));
  for (const std::string& input :
       {"--config " + smoke() + " --set train.init_from=" + fifo, "--config " + wan + " --set data.tensors=" + fifo,
        "--config " + smoke() + " --resume " + fifo}) {
    const auto start = std::chrono::steady_clock::now();
    const auto r = run(input + " --run-dir " + join_path(base, "run") + " --set train.steps=1");
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10)) << input;
    EXPECT_EQ(r.code, 2) << input << "\n" << r.output;
    EXPECT_NE(r.output.find(fifo), std::string::npos) << input << "\n" << r.output;
    EXPECT_FALSE(megaslide::io::path_exists(join_path(base, "run/metrics.jsonl"))) << input;
  }
  megaslide::io::remove_tree(base);
}

namespace {

// (step, loss) of a run's metrics.jsonl.
std::vector<std::pair<int64_t, double>> step_losses(const std::string& metrics) {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    out.emplace_back(j.at("step").get<int64_t>(), j.at("loss").get<double>());
  }
  return out;
}

// megaslide-train run with `cwd` as the working folder.
Result run_in(const std::string& cwd, const std::string& args) {
  const std::string cmd =
      "cd '" + cwd + "' && " + std::string(MEGASLIDE_BINARY_DIR) + "/bin/megaslide-train " + args + " 2>&1";
  Result r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) r.output += buf;
  const int status = ::pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace

// The property: checkpoints written before the family seam (commit 2c2de03's megaslide-train; fixture
// tests/fixtures/checkpoints_2c2de03/, README.md there says how) resume today — the DiT family streamed
// and resident, and Wan streamed, each saved at step 2 of a 4-step run — and the resumed run goes on as
// the old uninterrupted run did: the losses of steps 3 and 4 equal the old run's within 1e-5 (fp32
// compute; another CPU may round sums differently), and the step-4 fp32 masters are the old run's to
// within 1e-3 of how far steps 3-4 moved them.
TEST(MegaslideTrain, CheckpointsWrittenBeforeTheFamilySeamResumeAndContinueTheOldRun) {
  const std::string fixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/checkpoints_2c2de03";
  struct Case {
    const char* name;
    const char* config;
    const char* extra;
  };
  // Run in the fixture's folder: the Wan run names its data.tensors relative to it, as it was saved.
  const std::vector<Case> cases = {
      {"dit", "dit.yaml", ""}, {"dit-resident", "dit.yaml", " --set offload.enabled=false"}, {"wan", "wan.yaml", ""}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto old_run = join_path(fixtures, c.name);
    const auto dir = fresh_dir(std::string("old-") + c.name);
    auto r = run_in(fixtures, std::string("--config ") + c.config + " --run-dir " + dir + c.extra + " --resume " +
                                  join_path(old_run, "step-0000002"));
    ASSERT_EQ(r.code, 0) << r.output;
    const auto old_losses = step_losses(join_path(old_run, "metrics.jsonl"));
    const auto new_losses = step_losses(join_path(dir, "metrics.jsonl"));
    ASSERT_EQ(old_losses.size(), 4u);
    ASSERT_EQ(new_losses.size(), 2u) << r.output;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(new_losses[i].first, old_losses[i + 2].first);
      EXPECT_NEAR(new_losses[i].second, old_losses[i + 2].second, 1e-5 * std::abs(old_losses[i + 2].second))
          << "step " << new_losses[i].first;
    }
    const auto old_master = megaslide::io::read_safetensors(join_path(old_run, "step-4-master.safetensors"));
    const auto new_master =
        megaslide::io::read_safetensors(join_path(dir, "checkpoints/step-0000004/master.safetensors"));
    ASSERT_EQ(new_master.tensors.size(), old_master.tensors.size());
    const auto start = megaslide::io::read_safetensors(join_path(old_run, "step-0000002/master.safetensors"));
    std::map<std::string, torch::Tensor> resumed(new_master.tensors.begin(), new_master.tensors.end());
    std::map<std::string, torch::Tensor> at_step2(start.tensors.begin(), start.tensors.end());
    // Steps 3-4 moved the weights by `moved`; the resumed run ends within 1e-3 of that distance of the old
    // run's end (measured here: 0, bit for bit). A resume that lost the moments, the step count or the
    // learning-rate schedule ends a distance comparable to `moved` away; another CPU's rounding, amplified
    // by AdamW's normalisation where a gradient is near zero, stays far below it.
    double off2 = 0.0, moved2 = 0.0;
    for (const auto& [name, old] : old_master.tensors) {
      ASSERT_TRUE(resumed.count(name) && at_step2.count(name)) << name;
      off2 += (resumed[name].to(torch::kDouble) - old.to(torch::kDouble)).pow(2).sum().item<double>();
      moved2 += (old.to(torch::kDouble) - at_step2[name].to(torch::kDouble)).pow(2).sum().item<double>();
    }
    ASSERT_GT(moved2, 0.0);
    EXPECT_LE(std::sqrt(off2), 1e-3 * std::sqrt(moved2)) << "the resumed run's step-4 masters are not the old run's";
    megaslide::io::remove_tree(dir);
  }
}

// The property: --export-layout comfyui exports a Wan's weights as ComfyUI's single file after a run, and
// --export-layout comfyui-unprefixed from its checkpoint (--resume X --export-weights): the same bf16 tensors,
// under model.diffusion_model. and bare; a value the flag does not know, the layout without an export, and the
// layout for the DiT family exit 2 naming the flag, with nothing written.
TEST(MegaslideTrain, ExportLayoutComfyUIWritesComfyUIsFileAndBadUsesExitTwo) {
  const auto dir = fresh_dir("comfyui");
  const auto config = write_tiny_wan(join_path(dir, "data"));
  const std::string args =
      "--config " + config + " --set train.steps=2 --set train.checkpoint_every=2 --run-dir " + join_path(dir, "run");
  const auto prefixed = join_path(dir, "wan_ft.safetensors"), bare = join_path(dir, "wan_ft_bare.safetensors");
  auto r = run(args + " --export-weights " + prefixed + " --export-layout comfyui");
  ASSERT_EQ(r.code, 0) << r.output;
  // The tiny Wan's heads are not ComfyUI's dim / 128: every export in its layouts says so.
  const std::string differs = "ComfyUI will not load the exported file as this model: heads";
  EXPECT_NE(r.output.find(differs), std::string::npos) << r.output;
  r = run(args + " --resume latest --export-weights " + bare + " --export-layout comfyui-unprefixed");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find(differs), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(bare + " (ComfyUI's layout)"), std::string::npos) << r.output;
  const auto with_prefix = megaslide::io::read_safetensors(prefixed), without = megaslide::io::read_safetensors(bare);
  ASSERT_EQ(with_prefix.tensors.size(), without.tensors.size());
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& [name, tensor] : without.tensors) {
    EXPECT_NE(name.rfind("model.", 0), 0u) << name;
    EXPECT_EQ(tensor.scalar_type(), torch::kBFloat16) << name;
    by_name[name] = tensor;
  }
  EXPECT_TRUE(by_name.count("head.modulation") && by_name.count("blocks.1.self_attn.q.weight"));
  for (const auto& [name, tensor] : with_prefix.tensors) {
    ASSERT_EQ(name.rfind("model.diffusion_model.", 0), 0u) << name;
    const auto it = by_name.find(name.substr(std::string("model.diffusion_model.").size()));
    ASSERT_NE(it, by_name.end()) << name;
    EXPECT_TRUE(torch::equal(tensor, it->second)) << name;
  }

  const auto before = megaslide::io::list_directory(dir);
  expect_refused(run(args + " --export-weights " + join_path(dir, "x.safetensors") + " --export-layout comfy"),
                 "--export-layout");
  expect_refused(run(args + " --export-layout comfyui"), "--export-layout");
  const auto dit = "--config " + smoke() + " --run-dir " + join_path(dir, "dit");
  expect_refused(run(dit + " --export-weights " + join_path(dir, "dit.safetensors") + " --export-layout comfyui"),
                 "--export-layout comfyui");
  expect_refused(run(dit + " --resume latest --export-weights " + join_path(dir, "dit.safetensors") +
                     " --export-layout comfyui-unprefixed"),
                 "--export-layout comfyui-unprefixed");
  EXPECT_EQ(megaslide::io::list_directory(dir), before) << "the refused commands wrote nothing";
  megaslide::io::remove_tree(dir);
}
