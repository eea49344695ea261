// train/run_folder.h: one run at a time in a run folder (an advisory lock with the holder's pid and
// host), no fresh run over an earlier one (with or without checkpoints), and a refused run leaves
// nothing behind.
#include "megaslide/train/run_folder.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "megaslide/io/files.h"
#include "run_tool.h"

using namespace megaslide;

namespace {
std::string fresh_dir(const std::string& name) {
  auto dir = "/tmp/megaslide-test-runfolder-" + name + "-" + std::to_string(::getpid());
  io::remove_tree(dir);
  return dir;
}

std::string refusal(const std::string& dir, bool resuming) {
  try {
    RunFolderGuard guard(dir, resuming);
  } catch (const RunFolderError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(RunFolder, SecondGuardIsRefusedNamingTheHoldersPidAndHost) {
  const auto dir = fresh_dir("lock");
  {
    RunFolderGuard first(dir, false);
    first.started();
    const std::string why = refusal(dir, /*resuming=*/true);
    EXPECT_NE(why.find("in use by another run"), std::string::npos) << why;
    EXPECT_NE(why.find("pid " + std::to_string(::getpid())), std::string::npos) << why;
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    EXPECT_NE(why.find(std::string("host ") + host), std::string::npos) << why;
  }
  // Released with the guard: the next run may take the folder.
  EXPECT_EQ(refusal(dir, /*resuming=*/true), "");
  io::remove_tree(dir);
}

TEST(RunFolder, LockIsHeldAcrossProcessesAndFreedWhenTheHolderDies) {
  const auto dir = fresh_dir("process");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    try {
      RunFolderGuard guard(dir, false);
      guard.started();
      const char ok = 1;
      if (::write(ready[1], &ok, 1) != 1) ::_exit(3);
      ::pause();  // holds the lock until killed
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  ::close(ready[1]);
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  const std::string why = refusal(dir, true);
  EXPECT_NE(why.find("pid " + std::to_string(child)), std::string::npos) << why;
  ::kill(child, SIGKILL);  // a crash: no destructor runs, the kernel drops the lock
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_EQ(refusal(dir, true), "") << "a dead holder's lock must not block the folder";
  ::close(ready[0]);
  io::remove_tree(dir);
}

// The property behind "a finished run is never overwritten": whatever an earlier run left (its log, its
// metrics, its config, its checkpoints), a fresh run is refused; --resume is what continues it.
TEST(RunFolder, FreshRunIntoAFolderWithAnEarlierRunIsRefusedWithOrWithoutCheckpoints) {
  const auto dir = fresh_dir("finished");
  io::make_directories(dir);
  std::ofstream(io::join_path(dir, "metrics.jsonl")) << "{\"step\":1}\n{\"step\":2}\n";
  std::string why = refusal(dir, false);
  EXPECT_NE(why.find("already holds a run"), std::string::npos) << why;
  EXPECT_NE(why.find("2 steps"), std::string::npos) << why;
  EXPECT_NE(why.find("saved none"), std::string::npos) << why;
  EXPECT_NE(why.find("train.checkpoint_every: 0"), std::string::npos) << why;
  io::make_directories(io::join_path(dir, "checkpoints/step-0000002"));
  std::ofstream(io::join_path(dir, "checkpoints/latest")) << "step-0000002\n";
  why = refusal(dir, false);
  EXPECT_NE(why.find("--resume latest"), std::string::npos) << why;
  EXPECT_EQ(refusal(dir, true), "") << "resuming is allowed";
  io::remove_tree(dir);
  // A file where the folder should be.
  std::ofstream(dir) << "x";
  EXPECT_NE(refusal(dir, false).find("is a file"), std::string::npos);
  ::unlink(dir.c_str());
}

TEST(RunFolder, RefusedRunLeavesNoFolderBehind) {
  const auto dir = fresh_dir("cleanup");
  { RunFolderGuard guard(dir, false); }  // never started: the folder it made goes with it
  EXPECT_FALSE(io::path_exists(dir));
  {
    RunFolderGuard guard(dir, false);
    guard.started();
  }
  EXPECT_TRUE(io::is_directory(dir)) << "a started run's folder stays";
  io::remove_tree(dir);
}

// End to end: two megaslide-train processes into one folder. The second is refused with exit 2 while
// the first runs, and the first's metrics.jsonl has every step once, untorn.
TEST(RunFolder, SecondTrainerIntoTheSameFolderExitsTwo) {
  const auto dir = fresh_dir("cli");
  const std::string smoke = std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml";
  const std::string bin = std::string(MEGASLIDE_BINARY_DIR) + "/bin/megaslide-train";
  const pid_t first = ::fork();
  ASSERT_GE(first, 0);
  if (first == 0) {
    std::freopen("/dev/null", "w", stderr);
    std::freopen("/dev/null", "w", stdout);
    ::execl(bin.c_str(), bin.c_str(), "--config", smoke.c_str(), "--run-dir", dir.c_str(), "--set", "train.steps=400",
            "--set", "output.progress=false", "--set", "train.threads=1", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const auto metrics = io::join_path(dir, "metrics.jsonl");
  for (int i = 0; i < 6000 && !io::path_exists(metrics); ++i) ::usleep(10000);
  ASSERT_TRUE(io::path_exists(metrics));
  const auto second = megaslide::testing::run_tool(
      "megaslide-train",
      "--config " + smoke + " --run-dir " + dir + " --resume latest --set train.steps=400 --set output.progress=false");
  EXPECT_EQ(second.code, 2) << second.output;
  EXPECT_NE(second.output.find("in use by another run"), std::string::npos) << second.output;
  EXPECT_NE(second.output.find("pid " + std::to_string(first)), std::string::npos) << second.output;
  ::kill(first, SIGTERM);
  int status = 0;
  ::waitpid(first, &status, 0);
  io::remove_tree(dir);
}
