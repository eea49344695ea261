// megaslide-ablate's suites (eval/ablation.h) at the test size: each writes its CSV (parsed and checked
// here), its markdown table and a PNG; the OOM path records "oom" instead of failing; the driver's
// exit codes. The PNGs need gnuplot (tools/bootstrap.sh installs gnuplot-nox); without it these tests
// fail with the message naming the package.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <map>

#include "megaslide/eval/ablation.h"
#include "megaslide/eval/plot.h"
#include "megaslide/io/files.h"
#include "run_tool.h"

using megaslide::AblationTable;

namespace {

std::string fresh_dir(const std::string& name) {
  auto dir = "/tmp/megaslide-test-ablation-" + name + "-" + std::to_string(::getpid());
  megaslide::io::remove_tree(dir);
  return dir;
}

megaslide::AblationOptions test_options(const std::string& suite, const std::string& dir) {
  megaslide::AblationOptions o;
  o.suite = suite;
  o.out_dir = dir;
  o.size = megaslide::AblationSize::kTest;
  o.device = "cpu";
  return o;
}

size_t column(const AblationTable& t, const std::string& name) {
  for (size_t i = 0; i < t.columns.size(); ++i)
    if (t.columns[i] == name) return i;
  ADD_FAILURE() << "no column " << name;
  return 0;
}

// The three files exist, the PNG by its signature, and the markdown holds every summary row.
void expect_outputs(const megaslide::AblationReport& r) {
  EXPECT_TRUE(megaslide::is_png_file(r.png_path)) << r.png_path;
  const auto md = megaslide::io::read_file(r.markdown_path);
  for (const auto& row : r.summary.rows) EXPECT_NE(md.find("| " + row[0] + " |"), std::string::npos) << md;
  EXPECT_NE(md.find("| --- |"), std::string::npos) << md;
}

// Per-step CSV rows of one variant: step -> loss.
std::map<int64_t, double> losses(const AblationTable& t, const std::string& variant) {
  std::map<int64_t, double> out;
  const size_t v = 0, step = column(t, "step"), loss = column(t, "loss");
  for (const auto& r : t.rows)
    if (r[v] == variant) out[std::stoll(r[step])] = std::stod(r[loss]);
  return out;
}

}  // namespace

// memory-scaling: one row per (model, frames); every peak is positive, grows with frames and is at least
// the trainer's own accounting (which leaves attention workspaces out); with the N x N scores written
// out, dense attention's peak grows faster with the token count than MegaSlide's local attention's
// (N² against N·K).
TEST(Ablation, MemoryScalingMeasuresEveryModelAndFrameCount) {
  const auto dir = fresh_dir("memory");
  const auto report = megaslide::run_ablation(test_options("memory-scaling", dir));
  expect_outputs(report);
  const auto t = megaslide::read_ablation_csv(report.csv_path);
  ASSERT_EQ(t.rows.size(), 16u);  // 4 models x 4 frame counts
  const size_t arch = column(t, "arch"), frames = column(t, "frames"), status = column(t, "status"),
               peak = column(t, "peak_device_bytes"), time = column(t, "step_time_s"),
               accounted = column(t, "trainer_accounted_bytes");
  std::map<std::string, std::map<int64_t, double>> by_model;
  for (const auto& r : t.rows) {
    ASSERT_EQ(r[status], "ok") << r[arch] << " " << r[frames];
    const double p = std::stod(r[peak]);
    EXPECT_GT(std::stod(r[time]), 0);
    EXPECT_GE(p, std::stod(r[accounted])) << r[arch] << " " << r[frames];
    by_model[r[arch]][std::stoll(r[frames])] = p;
  }
  ASSERT_EQ(by_model.size(), 4u);
  for (const auto& [name, points] : by_model) {
    ASSERT_EQ(points.size(), 4u) << name;
    EXPECT_GT(points.rbegin()->second, points.begin()->second) << name << ": peak grows with frames";
  }
  auto growth = [&](const std::string& m) { return by_model[m].rbegin()->second / by_model[m].begin()->second; };
  EXPECT_GT(growth("dense3d-materialized"), growth("megaslide"));
}

// A budget between the smallest and the largest peak measured without one: the runs above it are
// "oom" rows (and larger frame counts of that model are not run), the suite does not fail, and the
// runs below it are measured.
TEST(Ablation, MemoryScalingRecordsOomUnderABudget) {
  const auto free_report = megaslide::run_ablation(test_options("memory-scaling", fresh_dir("oom-free")));
  const auto free_table = megaslide::read_ablation_csv(free_report.csv_path);
  double lo = INFINITY, hi = 0;
  for (const auto& r : free_table.rows) {
    const double p = std::stod(r[column(free_table, "peak_device_bytes")]);
    lo = std::min(lo, p), hi = std::max(hi, p);
  }
  ASSERT_GT(hi, 1.5 * lo);  // room for a budget some runs exceed and some do not
  const double budget = std::sqrt(lo * hi);
  auto o = test_options("memory-scaling", fresh_dir("oom"));
  o.memory_budget_gib = budget / (1024.0 * 1024.0 * 1024.0);
  const auto report = megaslide::run_ablation(o);
  expect_outputs(report);
  const auto t = megaslide::read_ablation_csv(report.csv_path);
  ASSERT_EQ(t.rows.size(), 16u);
  const size_t arch = column(t, "arch"), frames = column(t, "frames"), status = column(t, "status"),
               peak = column(t, "peak_device_bytes");
  int oom = 0, ok = 0;
  std::map<std::string, bool> seen_oom;
  for (const auto& r : t.rows) {
    if (r[status] == "oom") {
      ++oom;
      EXPECT_EQ(r[peak], "oom");
      seen_oom[r[arch]] = true;
    } else {
      ++ok;
      EXPECT_FALSE(seen_oom[r[arch]]) << r[arch] << " " << r[frames]
                                      << ": measured after a smaller frame count was oom";
      EXPECT_LE(std::stod(r[peak]), budget);
    }
  }
  EXPECT_GT(oom, 0);
  EXPECT_GT(ok, 0);
  EXPECT_NE(megaslide::io::read_file(report.markdown_path).find("oom"), std::string::npos);
}

// offsets: a loss curve per variant (learned, zero, frozen, swin), every step present and finite.
TEST(Ablation, OffsetsWritesALossCurvePerVariant) {
  const auto dir = fresh_dir("offsets");
  const auto report = megaslide::run_ablation(test_options("offsets", dir));
  expect_outputs(report);
  const auto t = megaslide::read_ablation_csv(report.csv_path);
  for (const char* v : {"learned", "zero", "frozen", "swin"}) {
    const auto l = losses(t, v);
    ASSERT_EQ(l.size(), 4u) << v;
    for (const auto& [step, loss] : l) EXPECT_TRUE(std::isfinite(loss) && loss > 0) << v << " step " << step;
  }
  EXPECT_EQ(report.summary.rows.size(), 4u);
}

// streaming: sync mode runs every copy and update in line with the same arithmetic, so both modes give
// bit-identical losses; both moved the same bytes.
TEST(Ablation, StreamingAsyncAndSyncGiveTheSameLosses) {
  const auto dir = fresh_dir("streaming");
  const auto report = megaslide::run_ablation(test_options("streaming", dir));
  expect_outputs(report);
  const auto t = megaslide::read_ablation_csv(report.csv_path);
  const auto a = losses(t, "async"), s = losses(t, "sync");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a, s);  // the CSV holds 9 significant digits, enough for every fp32 loss
  const auto& diff = report.summary.rows.at(1).at(10);
  EXPECT_EQ(diff.substr(0, 2), "0 ") << report.summary.columns.at(10) << ": " << diff;  // computed from the doubles
  const size_t h2d = column(t, "h2d_bytes");
  for (const auto& r : t.rows) EXPECT_GT(std::stoll(r[h2d]), 0);
}

// optimizer-location: the streamed trainer with fp32 compute (AdamW on the host) and the resident one
// (AdamW on the device) agree in loss to float rounding (the tolerance test_cpu_master_trainer uses),
// and both report optimizer time.
TEST(Ablation, OptimizerLocationHostAndDeviceAgree) {
  const auto dir = fresh_dir("optimizer");
  const auto report = megaslide::run_ablation(test_options("optimizer-location", dir));
  expect_outputs(report);
  const auto t = megaslide::read_ablation_csv(report.csv_path);
  const auto host = losses(t, "host"), device = losses(t, "device");
  ASSERT_EQ(host.size(), 3u);
  ASSERT_EQ(device.size(), 3u);
  for (const auto& [step, loss] : host)
    EXPECT_NEAR(loss, device.at(step), 1e-5 * std::max(1.0, std::abs(loss))) << step;
  // Host updates are deferred (clipping) and overlap the next step, so a step's optimizer_s counts the
  // updates that finished during it: one step may show 0 under load, the run as a whole may not.
  const size_t opt = column(t, "optimizer_s");
  std::map<std::string, double> total;
  for (const auto& r : t.rows) {
    EXPECT_GE(std::stod(r[opt]), 0) << r[0] << " step " << r[1];
    total[r[0]] += std::stod(r[opt]);
  }
  EXPECT_GT(total["host"], 0);
  EXPECT_GT(total["device"], 0);
}

// The driver: bad suite, size, device or override exits 2 before running; a suite run writes its files.
TEST(MegaslideAblate, ExitCodesAndOutputs) {
  const auto dir = fresh_dir("tool");
  auto r = megaslide::testing::run_tool("megaslide-ablate", "--suite nope --out " + dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown ablation suite 'nope'"), std::string::npos) << r.output;
  r = megaslide::testing::run_tool("megaslide-ablate", "--suite streaming --size huge --out " + dir);
  EXPECT_EQ(r.code, 2) << r.output;
  r = megaslide::testing::run_tool("megaslide-ablate", "--suite streaming --device tpu --out " + dir);
  EXPECT_EQ(r.code, 2) << r.output;
  r = megaslide::testing::run_tool("megaslide-ablate",
                                   "--suite streaming --size test --set model.hidden=-3 --out " + dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("model.hidden"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(dir));
  r = megaslide::testing::run_tool("megaslide-ablate", "--suite streaming --size test --device cpu --out " + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("[streaming] async: step 3/3"), std::string::npos) << r.output;  // progress lines
  EXPECT_TRUE(megaslide::is_png_file(dir + "/streaming.png"));
  EXPECT_TRUE(megaslide::io::path_exists(dir + "/streaming.csv"));
  EXPECT_TRUE(megaslide::io::path_exists(dir + "/streaming.md"));
}

// Every suite's base config loads at every size (the full sizes are only run on a GPU, so this is
// where a bad key or an inconsistent value in them is caught).
TEST(Ablation, EverySuiteConfigLoadsAtEverySize) {
  for (const auto& suite : megaslide::ablation_suites()) {
    for (auto size :
         {megaslide::AblationSize::kTest, megaslide::AblationSize::kQuick, megaslide::AblationSize::kFull}) {
      EXPECT_NO_THROW(megaslide::parse_run_config("", suite, megaslide::ablation_base_overrides(suite, size)))
          << suite << " " << megaslide::to_string(size);
    }
  }
  EXPECT_THROW(megaslide::ablation_base_overrides("nope", megaslide::AblationSize::kTest), std::invalid_argument);
  // Every run's config, not only the base one, at every size; an override that only a variant breaks
  // (memory-scaling's 4-frame run cannot take a temporal patch of 8) is refused before anything runs.
  for (const auto& suite : megaslide::ablation_suites()) {
    for (auto size :
         {megaslide::AblationSize::kTest, megaslide::AblationSize::kQuick, megaslide::AblationSize::kFull}) {
      megaslide::AblationOptions o;
      o.suite = suite;
      o.size = size;
      o.device = "cpu";
      EXPECT_NO_THROW(megaslide::check_ablation_configs(o)) << suite << " " << megaslide::to_string(size);
    }
  }
  megaslide::AblationOptions bad;
  bad.suite = "memory-scaling";
  bad.size = megaslide::AblationSize::kQuick;
  bad.device = "cpu";
  bad.overrides = {"model.patch=[8,2,2]"};
  EXPECT_THROW(megaslide::check_ablation_configs(bad), megaslide::ConfigError);
  EXPECT_THROW(megaslide::parse_ablation_size("huge"), std::invalid_argument);
}

// A --set of a key the suite varies from run to run is refused, naming it: set for every run, the table's rows
// would all be one run under the variants' labels (offsets' "learned", "zero" and "frozen" all zero offsets).
TEST(Ablation, ASetOfTheKeyASuiteVariesIsRefused) {
  const std::vector<std::pair<std::string, std::string>> varied{{"offsets", "model.dsa_offsets=zero"},
                                                                {"offsets", "model.arch=swin"},
                                                                {"memory-scaling", "data.frames=4"},
                                                                {"memory-scaling", "model.dense_attention=fused"},
                                                                {"streaming", "offload.mode=sync"},
                                                                {"optimizer-location", "offload.enabled=false"},
                                                                {"optimizer-location", "offload.compute_dtype=bf16"}};
  for (const auto& [suite, setting] : varied) {
    megaslide::AblationOptions o;
    o.suite = suite;
    o.size = megaslide::AblationSize::kTest;
    o.device = "cpu";
    o.overrides = {"train.steps=2", setting};
    try {
      megaslide::check_ablation_configs(o);
      ADD_FAILURE() << suite << " took --set " << setting;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--set " + setting + ": the " + suite + " suite varies"), std::string::npos)
          << e.what();
    }
  }
  // The keys it does not vary are every run's, as before.
  megaslide::AblationOptions o;
  o.suite = "offsets";
  o.size = megaslide::AblationSize::kTest;
  o.device = "cpu";
  o.overrides = {"train.steps=2", "data.frames=4", "offload.mode=sync"};
  EXPECT_NO_THROW(megaslide::check_ablation_configs(o));
  // The tool exits 2 before anything runs, without the list of suites (the suite is not what is wrong).
  const auto dir = fresh_dir("varied");
  const auto r = megaslide::testing::run_tool(
      "megaslide-ablate", "--suite offsets --size test --device cpu --set model.dsa_offsets=zero --out " + dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("varies model.dsa_offsets"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("(suites:"), std::string::npos) << r.output;
  EXPECT_FALSE(megaslide::io::path_exists(dir));
}
