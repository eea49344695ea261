// The gnuplot helper (eval/plot.h), reading metrics.jsonl and megaslide-plot (eval/run_plots.h).
// These tests need gnuplot (tools/bootstrap.sh installs gnuplot-nox); without it they fail with the
// helper's message naming the package, they do not skip.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>

#include "megaslide/eval/plot.h"
#include "megaslide/eval/run_plots.h"
#include "megaslide/io/files.h"
#include "run_tool.h"

using megaslide::io::join_path;

namespace {

std::string fresh_dir(const std::string& name) {
  auto dir = "/tmp/megaslide-test-plot-" + name + "-" + std::to_string(::getpid());
  megaslide::io::remove_tree(dir);
  megaslide::io::make_directories(dir);
  return dir;
}

megaslide::PlotSpec two_panels() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  megaslide::PlotPanel a{
      "panel a", "x", "y", false, false, true, {{"line", {1, 2, 3}, {1, 4, 9}}, {"gap", {1, 2, 3}, {2, nan, 6}}}};
  megaslide::PlotPanel b{"panel b (log y)", "x", "y", false, true, true, {{"only bad points", {1, 2}, {0.0, -1.0}}}};
  return megaslide::PlotSpec{"figure", {a, b}};
}

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

}  // namespace

// A plot leaves the PNG (whole: its signature and its end), the data and the script; the data holds the points and a
// gap as "?"; a panel with no plottable point (log scale, y <= 0) still renders.
TEST(Plot, WritesPngDataAndScriptBesideEachOther) {
  const auto dir = fresh_dir("render");
  const auto files = megaslide::render_plot(two_panels(), join_path(dir, "fig.png"));
  EXPECT_TRUE(megaslide::is_png_file(files.png));
  {  // the same PNG cut short (a full disk) is not a PNG file
    const auto bytes = megaslide::io::read_file(files.png);
    megaslide::io::write_file_atomically(join_path(dir, "cut.png"), bytes.substr(0, bytes.size() / 2));
    EXPECT_FALSE(megaslide::is_png_file(join_path(dir, "cut.png")));
  }
  EXPECT_EQ(files.data, join_path(dir, "fig.dat"));
  EXPECT_EQ(files.script, join_path(dir, "fig.gp"));
  const auto data = megaslide::io::read_file(files.data);
  EXPECT_NE(data.find("3,9\n"), std::string::npos) << data;
  EXPECT_NE(data.find("2,?\n"), std::string::npos) << data;
  const auto script = megaslide::io::read_file(files.script);
  EXPECT_NE(script.find("'fig.dat' index 0"), std::string::npos) << script;
  EXPECT_NE(script.find("no data"), std::string::npos) << script;  // panel b has nothing to draw
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "fig.gnuplot.log")));
}

// The kept script re-renders the PNG on its own when run in its folder (what a user does).
TEST(Plot, KeptScriptRendersAgain) {
  const auto dir = fresh_dir("rerender");
  const auto files = megaslide::render_plot(two_panels(), join_path(dir, "fig.png"));
  ASSERT_EQ(::unlink(files.png.c_str()), 0);
  const std::string cmd = "cd " + dir + " && " + megaslide::find_gnuplot() + " fig.gp 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_TRUE(megaslide::is_png_file(files.png));
}

// No gnuplot: the error names the package to install.
TEST(Plot, MissingGnuplotNamesThePackage) {
  const auto dir = fresh_dir("missing");
  megaslide::PlotOptions o;
  o.gnuplot = "/nonexistent/gnuplot";
  try {
    megaslide::render_plot(two_panels(), join_path(dir, "fig.png"), o);
    FAIL() << "expected PlotError";
  } catch (const megaslide::PlotError& e) {
    EXPECT_NE(std::string(e.what()).find("gnuplot-nox"), std::string::npos) << e.what();
  }
  o.gnuplot = "no-such-gnuplot-program";
  EXPECT_THROW(megaslide::find_gnuplot(o), megaslide::PlotError);
}

// A gnuplot that exits non-zero is an error with the status, and no PNG passes for a result.
TEST(Plot, FailingGnuplotIsAnError) {
  const auto dir = fresh_dir("failing");
  megaslide::PlotOptions o;
  o.gnuplot = "/bin/false";
  try {
    megaslide::render_plot(two_panels(), join_path(dir, "fig.png"), o);
    FAIL() << "expected PlotError";
  } catch (const megaslide::PlotError& e) {
    EXPECT_NE(std::string(e.what()).find("exit status 1"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "fig.png")));
  EXPECT_THROW(megaslide::render_plot(two_panels(), join_path(dir, "fig.jpg")), megaslide::PlotError);
  // A failing render keeps the picture an earlier one drew.
  megaslide::render_plot(two_panels(), join_path(dir, "fig.png"));
  const std::string before = megaslide::io::read_file(join_path(dir, "fig.png"));
  EXPECT_THROW(megaslide::render_plot(two_panels(), join_path(dir, "fig.png"), o), megaslide::PlotError);
  EXPECT_EQ(megaslide::io::read_file(join_path(dir, "fig.png")), before);
  EXPECT_FALSE(megaslide::io::path_exists(join_path(dir, "fig.png.previous")));
}

// metrics.jsonl problems name the file and the line; only a torn last line is passed over.
TEST(RunPlots, BadMetricsNameFileAndLine) {
  const auto dir = fresh_dir("bad-metrics");
  const auto path = join_path(dir, "metrics.jsonl");
  const std::string good = R"({"step":1,"loss":1.0,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})";
  auto expect_error = [&](const std::string& text, const std::string& needle) {
    write(path, text);
    try {
      megaslide::read_metrics_jsonl(path);
      ADD_FAILURE() << "expected MetricsFileError for: " << text;
    } catch (const megaslide::MetricsFileError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(good + "\n{not json\n", path + ":2: not valid JSON");
  expect_error(good + "\n[1,2]\n", path + ":2: expected a JSON object");
  expect_error(R"({"step":1,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})",
               path + ":1: missing field \"loss\"");
  expect_error(good + "\n" + R"({"step":2,"loss":"low","step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})",
               path + ":2: field \"loss\" is not a number");
  expect_error("", "no steps");
  expect_error(good + "\n" + R"({"step":2,"loss":1e400,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})" + "\n",
               path + ":2: not valid JSON");  // past double's range
  expect_error(
      good + "\n" +
          R"({"step":2,"loss":1,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1,"peak_device_bytes":-5})",
      path + ":2: field \"peak_device_bytes\" is negative");
  expect_error(R"({"step":2.7,"loss":1,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})",
               path + ":1: field \"step\" is not a whole number");
  EXPECT_THROW(megaslide::read_metrics_jsonl(join_path(dir, "absent.jsonl")), megaslide::MetricsFileError);
  write(path, good + "\n\n" + good + "\n");  // blank lines are skipped
  EXPECT_EQ(megaslide::read_metrics_jsonl(path).size(), 2u);
  // A last line cut short (no newline: a full disk, a kill mid-write) is left out; the same text with its newline
  // is an error.
  write(path, good + "\n" + good + "\n" + good.substr(0, 20));
  EXPECT_EQ(megaslide::read_metrics_jsonl(path).size(), 2u);
  expect_error(good + "\n" + good.substr(0, 20) + "\n", path + ":2: not valid JSON");
}

// megaslide-plot on a real 5-step smoke run of megaslide-train: three PNGs, and the memory plot has the
// transfer panel because the streamed trainer moved bytes.
TEST(MegaslidePlot, PlotsARealRun) {
  const auto dir = fresh_dir("run");
  const auto run_dir = join_path(dir, "run");
  auto train = megaslide::testing::run_tool("megaslide-train",
                                            "--config " + std::string(MEGASLIDE_SOURCE_DIR) +
                                                "/configs/smoke.yaml --set train.steps=5 "
                                                "--set train.device=cpu --set output.progress=false --run-dir " +
                                                run_dir);
  ASSERT_EQ(train.code, 0) << train.output;
  const auto out = join_path(dir, "figs");
  auto r = megaslide::testing::run_tool("megaslide-plot", run_dir + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* name : {"loss", "throughput", "memory"}) {
    EXPECT_TRUE(megaslide::is_png_file(join_path(out, std::string(name) + ".png"))) << name;
    EXPECT_TRUE(megaslide::io::path_exists(join_path(out, std::string(name) + ".gp"))) << name;
  }
  const auto memory = megaslide::io::read_file(join_path(out, "memory.dat"));
  EXPECT_NE(memory.find("host -> device"), std::string::npos) << memory;
  const auto loss = megaslide::io::read_file(join_path(out, "loss.dat"));
  int lines = 0;
  for (size_t p = loss.find("\n5,"); p != std::string::npos; p = loss.find("\n5,", p + 1)) ++lines;
  EXPECT_EQ(lines, 2) << loss;  // step 5 in the loss and in its running mean
  // Default output folder: RUN_DIR/plots.
  r = megaslide::testing::run_tool("megaslide-plot", run_dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(megaslide::is_png_file(join_path(run_dir, "plots/loss.png")));
  // Its own plots/ named with --out is that too; a run folder's checkpoints/ (which its saves and pruning replace) or
  // another run's plots/ is refused, exit 2, nothing written.
  r = megaslide::testing::run_tool("megaslide-plot", run_dir + " --out " + join_path(run_dir, "plots"));
  EXPECT_EQ(r.code, 0) << r.output;
  for (const auto& bad : {join_path(run_dir, "checkpoints"), join_path(run_dir, "checkpoints/mine")}) {
    r = megaslide::testing::run_tool("megaslide-plot", run_dir + " --out " + bad);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("the training run folder '"), std::string::npos) << r.output;
  }
  EXPECT_FALSE(megaslide::io::path_exists(join_path(run_dir, "checkpoints/loss.png")));
  EXPECT_FALSE(megaslide::io::path_exists(join_path(run_dir, "checkpoints/mine")));
}

// Bad input exits non-zero with a message naming the file (and line).
TEST(MegaslidePlot, BadInputExitsNonZero) {
  const auto dir = fresh_dir("tool-bad");
  auto r = megaslide::testing::run_tool("megaslide-plot", dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(join_path(dir, "metrics.jsonl")), std::string::npos) << r.output;
  write(join_path(dir, "metrics.jsonl"), "{\"step\":1}\n");
  r = megaslide::testing::run_tool("megaslide-plot", dir);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("metrics.jsonl:1: missing field"), std::string::npos) << r.output;
  r = megaslide::testing::run_tool("megaslide-plot", "");
  EXPECT_EQ(r.code, 2) << r.output;
}

// The property: text from outside (a run folder's path, a series name) reaches gnuplot as data only.
// gnuplot runs `backquoted` commands even inside double-quoted strings; a title holding one, or any
// other character gnuplot might interpret, must neither run anything nor change: each title string in
// the kept script prints back through gnuplot itself as exactly the text given (control characters as
// spaces).
TEST(Plot, HostileTitlesReachGnuplotAsDataOnly) {
  const auto dir = fresh_dir("hostile");
  const auto marker = join_path(dir, "pwned");
  const std::vector<std::string> titles{"x`touch " + marker + "`y",
                                        "it's \"quoted\" \\n \\\\ @macro $HOME; print 1 # not a comment",
                                        "two\nlines\tand\rcontrol",
                                        "'`touch " + marker + "2`'",
                                        "system(\"touch " + marker + "3\")",
                                        "日本語 ünïcödé",
                                        "@GPVAL_VERSION @macro ' \" ' `touch " + marker + "4` \" '",
                                        "'",
                                        "ends with a backslash \\"};
  megaslide::PlotSpec spec;
  for (const auto& t : titles) spec.panels.push_back({t, t, t, false, false, true, {{t, {1, 2}, {1, 2}}}});
  spec.title = titles[0];
  const auto files = megaslide::render_plot(spec, join_path(dir, "fig.png"));
  EXPECT_TRUE(megaslide::is_png_file(files.png));
  for (const auto& m : {marker, marker + "2", marker + "3", marker + "4"})
    EXPECT_FALSE(megaslide::io::path_exists(m)) << "gnuplot ran a command: " << m;

  // Round trip: every `set title` string of the script, printed by gnuplot, is the title given.
  const auto script = megaslide::io::read_file(files.script);
  std::string check;
  size_t found = 0;
  for (size_t p = script.find("set title "); p != std::string::npos; p = script.find("set title ", p + 1)) {
    check += "print " + script.substr(p + 10, script.find('\n', p) - p - 10) + "\n";
    ++found;
  }
  ASSERT_EQ(found, titles.size());
  write(join_path(dir, "check.gp"), check);
  const std::string out_path = join_path(dir, "check.out");
  ASSERT_EQ(std::system(("cd " + dir + " && gnuplot check.gp > check.out 2>&1").c_str()), 0);
  std::string expected;
  for (auto t : titles) {
    for (auto& c : t)
      if (static_cast<unsigned char>(c) < 0x20) c = ' ';
    expected += t + "\n";
  }
  EXPECT_EQ(megaslide::io::read_file(out_path), expected);
  for (const auto& m : {marker, marker + "2", marker + "3", marker + "4"}) EXPECT_FALSE(megaslide::io::path_exists(m));
  megaslide::io::remove_tree(dir);
}

// megaslide-plot on a run folder whose path holds a command in backquotes: the plots are drawn, the
// command never runs.
TEST(MegaslidePlot, RunFolderPathWithBackquotesRunsNothing) {
  const auto dir = fresh_dir("inject");
  const auto marker = join_path(dir, "pwned");
  const auto run_dir = join_path(dir, "x`touch " + marker + "`y");
  megaslide::io::make_directories(run_dir);
  write(join_path(run_dir, "metrics.jsonl"),
        R"({"step":1,"loss":1.0,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})"
        "\n"
        R"({"step":2,"loss":0.5,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})"
        "\n");
  const auto r = megaslide::testing::run_tool("megaslide-plot", "'" + run_dir + "'");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(megaslide::is_png_file(join_path(run_dir, "plots/loss.png")));
  EXPECT_FALSE(megaslide::io::path_exists(marker)) << "the path's command ran";
  megaslide::io::remove_tree(dir);
}

// A skipped step is logged by the trainer with "loss" and "grad_norm" null (JSON has no NaN): the run
// still plots, with a gap at that step and a running mean the gap does not poison.
TEST(RunPlots, SkippedStepsWithNullFieldsPlot) {
  const auto dir = fresh_dir("skipped");
  write(
      join_path(dir, "metrics.jsonl"),
      R"({"step":1,"loss":1.0,"lr":0.001,"grad_norm":0.5,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1,"skipped":false})"
      "\n"
      R"({"step":2,"loss":null,"lr":0.001,"grad_norm":null,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1,"skipped":true})"
      "\n"
      R"({"step":3,"loss":0.5,"lr":0.001,"grad_norm":0.4,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1,"skipped":false})"
      "\n");
  const auto steps = megaslide::read_metrics_jsonl(join_path(dir, "metrics.jsonl"));
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_TRUE(std::isnan(steps[1].loss));
  EXPECT_TRUE(std::isnan(steps[1].grad_norm));
  const auto pngs = megaslide::plot_run(dir);
  ASSERT_EQ(pngs.size(), 4u);  // loss, throughput, memory, optimizer (lr and grad norm)
  EXPECT_EQ(pngs[3], join_path(dir, "plots/optimizer.png"));
  const auto optimizer = megaslide::io::read_file(join_path(dir, "plots/optimizer.dat"));
  EXPECT_NE(optimizer.find("\n3,0.4\n"), std::string::npos) << optimizer;
  // Sizes start at 0: a constant memory curve is a flat line at its height, not gnuplot's ±1 % autoscale.
  EXPECT_NE(megaslide::io::read_file(join_path(dir, "plots/memory.gp")).find("set yrange [0:*]"), std::string::npos);
  const auto loss = megaslide::io::read_file(join_path(dir, "plots/loss.dat"));
  EXPECT_NE(loss.find("\n2,?\n"), std::string::npos) << loss;
  EXPECT_EQ(loss.find("nan"), std::string::npos) << loss;
  // Steps 1 and 3 have no plottable neighbour, which a line would not draw: they are markers too.
  EXPECT_NE(loss.find("points without a neighbour\n1,1\n3,0.5\n"), std::string::npos) << loss;
  EXPECT_NE(megaslide::io::read_file(join_path(dir, "plots/loss.gp")).find("with points linetype 1"),
            std::string::npos);
  // A step count that is null is still an error: it is no measurement.
  write(join_path(dir, "metrics.jsonl"),
        R"({"step":null,"loss":1.0,"step_time_s":0.1,"tokens_per_s":10,"samples_per_s":1})"
        "\n");
  EXPECT_THROW(megaslide::read_metrics_jsonl(join_path(dir, "metrics.jsonl")), megaslide::MetricsFileError);
  megaslide::io::remove_tree(dir);
}
