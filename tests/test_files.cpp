// io/files.h: reading files users name (regular files only, capped), output paths checked before any
// work, and the atomic exchange of two folders.
#include "megaslide/io/files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <functional>
#include <set>
#include <vector>

using namespace megaslide::io;

namespace {
std::string fresh(const std::string& name) {
  const auto dir = "/tmp/megaslide-test-files-" + name + "-" + std::to_string(::getpid());
  remove_tree(dir);
  make_directories(dir);
  return dir;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// The property: absolute_path joins a relative path to the working directory and removes ".", ".." and repeated or
// trailing slashes without following links; an absolute path needs no working directory.
TEST(Files, AbsolutePathIsLexicalFromTheRoot) {
  using megaslide::io::absolute_path;
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
  const std::string here = std::string(cwd) == "/" ? "" : cwd;
  EXPECT_EQ(absolute_path("a/./b/../c"), here + "/a/c");
  EXPECT_EQ(absolute_path("/x//y/"), "/x/y");
  EXPECT_EQ(absolute_path("/x/../../y"), "/y");
  EXPECT_EQ(absolute_path("/.."), "/");
  EXPECT_EQ(absolute_path(""), "");
}

// The property: a process ended by a signal while writing a file atomically leaves no temporary file behind when its
// handler calls remove_temporary_files() (what the tools' handlers do); without it the temporary file stays (the
// control, so the test can fail). Files written before are forgotten once committed or abandoned, so that the 64
// names the registry holds are free again (100 of them first).
TEST(Files, ASignalEndingAWriteRemovesItsTemporaryFile) {
  const auto dir = fresh("signal");
  for (int k = 0; k < 100; ++k) {
    AtomicFileWriter writer(dir + "/earlier-" + std::to_string(k));
    writer.write("x", 1);
    if (k % 2 == 0) writer.commit();
  }
  const auto temporaries = [&] {
    int64_t n = 0;
    for (const auto& name : list_directory(dir)) n += name.size() > 4 && name.substr(name.size() - 4) == ".tmp";
    return n;
  };
  for (const bool handler : {false, true}) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      if (handler)
        std::signal(SIGTERM, [](int signal) {
          remove_temporary_files();
          std::signal(signal, SIG_DFL);
          std::raise(signal);
        });
      AtomicFileWriter writer(dir + "/model.safetensors");
      const std::string bytes(1 << 20, 'x');
      writer.write(bytes.data(), bytes.size());
      std::raise(SIGTERM);
      ::_exit(0);  // not reached
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
    EXPECT_EQ(temporaries(), handler ? 0 : 1) << (handler ? "with" : "without") << " the handler";
    EXPECT_FALSE(path_exists(dir + "/model.safetensors"));
    for (const auto& name : list_directory(dir))
      if (name.size() > 4 && name.substr(name.size() - 4) == ".tmp") ::unlink((dir + "/" + name).c_str());
  }
  remove_tree(dir);
}

// The property: no input a user names can make a reader hang or fill memory — /dev/zero, a folder or
// a file past the cap is refused at once with a message naming it; a regular file under the cap (and a
// pipe where allowed) reads whole.
TEST(Files, ReadInputFileRefusesFoldersDevicesAndFilesPastTheCap) {
  const auto dir = fresh("input");
  write_file_atomically(join_path(dir, "small.yaml"), "model:\n  hidden: 16\n");
  EXPECT_EQ(read_input_file(join_path(dir, "small.yaml"), 100), "model:\n  hidden: 16\n");
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(error_of([] { read_input_file("/dev/zero", 1 << 20); }).find("'/dev/zero' is a device"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "/dev/zero must be refused, not read";
  EXPECT_NE(error_of([&] { read_input_file(dir, 1 << 20); }).find("is a folder"), std::string::npos);
  EXPECT_NE(error_of([&] { read_input_file(join_path(dir, "small.yaml"), 10); }).find("more than the 10"),
            std::string::npos);
  EXPECT_NE(error_of([&] { read_input_file(join_path(dir, "missing"), 10); }).find("missing"), std::string::npos);
  // A FIFO is read only where pipes are allowed (prompt files from a shell's <(...)).
  const auto fifo = join_path(dir, "fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { read_input_file(fifo, 100); }).find("is a pipe"), std::string::npos);
  remove_tree(dir);
}

// The property: output paths are checked before any work: missing folders, folders in the way, empty paths and
// folders nothing can be created in are refused naming the flag, and a check leaves nothing behind.
TEST(Files, OutputPathsAreCheckedWithoutCreatingAnything) {
  const auto dir = fresh("output");
  EXPECT_EQ(error_of([&] { check_output_file(join_path(dir, "t.json"), "--trace"); }), "");
  EXPECT_NE(error_of([&] { check_output_file(join_path(dir, "missing/d/t.json"), "--trace"); }).find("does not exist"),
            std::string::npos);
  EXPECT_FALSE(path_exists(join_path(dir, "missing"))) << "a check creates nothing";
  EXPECT_NE(error_of([&] { check_output_file(dir, "--export-weights"); }).find("is a folder"), std::string::npos);
  EXPECT_NE(error_of([&] { check_output_file("", "--out"); }).find("empty path"), std::string::npos);
  EXPECT_EQ(error_of([&] { check_output_folder(join_path(dir, "a/b/c"), "--out"); }), "");
  EXPECT_FALSE(path_exists(join_path(dir, "a")));
  write_file_atomically(join_path(dir, "file"), "x");
  EXPECT_NE(error_of([&] { check_output_folder(join_path(dir, "file/sub"), "--out"); }).find("is a file"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { check_output_file(join_path(dir, "file/t.json"), "--trace"); }).find("a file is in its place"),
      std::string::npos);
  EXPECT_NE(error_of([&] { check_output_folder("", "--run-dir"); }).find("--run-dir: an empty path"),
            std::string::npos);
  // Folders nothing can be created in, which access(2) passes for root: refused.
  EXPECT_NE(error_of([] { check_output_file("/proc/eval.json", "--json"); }).find("is not writable"),
            std::string::npos);
  EXPECT_NE(error_of([] { check_output_folder("/proc/ablations", "--out"); }).find("is not writable"),
            std::string::npos);
  // The write check leaves nothing behind.
  EXPECT_EQ(list_directory(dir), (std::vector<std::string>{"file"}));
  remove_tree(dir);
}

// The property: a FIFO (or a device) a user names is refused at once by the one checked open, by every
// reader that goes through it (read_file, read_in_pieces, the CRC of a file), never waited on.
TEST(Files, FifosAndDevicesAreRefusedAtOnceByEveryReader) {
  const auto dir = fresh("fifo");
  const auto fifo = join_path(dir, "weights.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  for (const std::function<void()>& read : std::vector<std::function<void()>>{
           [&] { read_file(fifo); }, [&] { file_crc32(fifo); }, [&] { ::close(open_input_file(fifo)); },
           [&] { check_input_file(fifo); }, [&] { read_file("/dev/null"); }}) {
    const auto message = error_of(read);
    EXPECT_TRUE(message.find("is a pipe") != std::string::npos || message.find("is a device") != std::string::npos)
        << message;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1)) << "refused at once, not waited on";
  EXPECT_NE(open_input_file(fifo, /*allow_pipe=*/true), -1)
      << "where pipes are allowed, the open does not block either";
  remove_tree(dir);
}

// The property: writing never goes through a symbolic link planted at the output's name or at a
// temporary name, never replaces a device, a FIFO or a folder, and never leaves a world-writable file.
TEST(Files, OutputsFollowNoPlantedLinkAndReplaceOnlyRegularFiles) {
  const auto dir = fresh("links");
  const auto victim = join_path(dir, "victim");
  write_file_atomically(victim, "precious");
  // Links at the names the writers used to take for their temporaries, and at the outputs themselves.
  for (const char* name : {"latest.tmp", "metrics.jsonl.tmp", "out.safetensors.tmp"})
    ASSERT_EQ(::symlink(victim.c_str(), join_path(dir, name).c_str()), 0);
  write_file_atomically(join_path(dir, "latest"), "step-0000002\n");
  {
    AtomicFileWriter w(join_path(dir, "out.safetensors"));
    w.write("abc", 3);
    w.commit();
  }
  ASSERT_EQ(::symlink(victim.c_str(), join_path(dir, "train.log").c_str()), 0);
  EXPECT_NE(error_of([&] { OutputFile log(join_path(dir, "train.log"), true); }).find("is a symbolic link"),
            std::string::npos);
  EXPECT_NE(error_of([&] { write_file_atomically(join_path(dir, "train.log"), "x"); }).find("is a symbolic link"),
            std::string::npos);
  EXPECT_EQ(read_file(victim), "precious") << "no write went through a link";
  for (const char* name : {"latest.tmp", "metrics.jsonl.tmp", "out.safetensors.tmp", "train.log"}) {
    struct stat st {};
    EXPECT_EQ(::lstat(join_path(dir, name).c_str(), &st), 0);
    EXPECT_TRUE(S_ISLNK(st.st_mode)) << name << " is still the planted link, untouched";
  }
  EXPECT_EQ(read_file(join_path(dir, "latest")), "step-0000002\n");
  // A device, a FIFO or a folder in the output's place is refused, never replaced.
  EXPECT_NE(error_of([] { write_file_atomically("/dev/full", "x"); }).find("is a device"), std::string::npos);
  EXPECT_NE(error_of([] { check_output_file("/dev/full", "--export-weights"); }).find("is a device"),
            std::string::npos);
  struct stat st {};
  ASSERT_EQ(::stat("/dev/full", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "/dev/full is still a device";
  const auto fifo = join_path(dir, "fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { OutputFile f(fifo, false); }).find("is a pipe"), std::string::npos);
  // Under umask 000 nothing is world-writable (0644 less the umask).
  const mode_t saved = ::umask(0);
  write_file_atomically(join_path(dir, "a"), "x");
  {
    OutputFile f(join_path(dir, "b"), true);
    f.write("y");
  }
  ::umask(saved);
  for (const char* name : {"a", "b"}) {
    ASSERT_EQ(::stat(join_path(dir, name).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0644u) << name;
  }
  // No temporary is left behind (the planted links aside).
  const std::set<std::string> planted{"latest.tmp", "metrics.jsonl.tmp", "out.safetensors.tmp"};
  for (const auto& name : list_directory(dir))
    EXPECT_TRUE(planted.count(name) > 0 || name.size() < 4 || name.compare(name.size() - 4, 4, ".tmp") != 0) << name;
  remove_tree(dir);
}

TEST(Files, ExchangeSwapsTwoFoldersAtomically) {
  const auto dir = fresh("exchange");
  make_directories(join_path(dir, "a"));
  make_directories(join_path(dir, "b"));
  write_file_atomically(join_path(dir, "a/which"), "a");
  write_file_atomically(join_path(dir, "b/which"), "b");
  ASSERT_TRUE(exchange_durably(join_path(dir, "a"), join_path(dir, "b"))) << "tmpfs and ext4 support RENAME_EXCHANGE";
  EXPECT_EQ(read_file(join_path(dir, "a/which")), "b");
  EXPECT_EQ(read_file(join_path(dir, "b/which")), "a");
  EXPECT_THROW(exchange_durably(join_path(dir, "a"), join_path(dir, "missing")), IoError);
  remove_tree(dir);
}
