// io/files.h: reading files users name (regular files only, capped), output paths checked before any
// work, and the atomic exchange of two folders.
#include "megaslide/io/files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>

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
  EXPECT_NE(error_of([&] { read_input_file(join_path(dir, "small.yaml"), 10); }).find("more than the 10"), std::string::npos);
  EXPECT_NE(error_of([&] { read_input_file(join_path(dir, "missing"), 10); }).find("missing"), std::string::npos);
  // A FIFO is read only where pipes are allowed (prompt files from a shell's <(...)).
  const auto fifo = join_path(dir, "fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { read_input_file(fifo, 100); }).find("is a pipe"), std::string::npos);
  remove_tree(dir);
}

TEST(Files, OutputPathsAreCheckedWithoutCreatingAnything) {
  const auto dir = fresh("output");
  EXPECT_EQ(error_of([&] { check_output_file(join_path(dir, "t.json"), "--trace"); }), "");
  EXPECT_NE(error_of([&] { check_output_file(join_path(dir, "missing/d/t.json"), "--trace"); }).find("does not exist"), std::string::npos);
  EXPECT_FALSE(path_exists(join_path(dir, "missing"))) << "a check creates nothing";
  EXPECT_NE(error_of([&] { check_output_file(dir, "--export-weights"); }).find("is a folder"), std::string::npos);
  EXPECT_NE(error_of([&] { check_output_file("", "--out"); }).find("empty path"), std::string::npos);
  EXPECT_EQ(error_of([&] { check_output_folder(join_path(dir, "a/b/c"), "--out"); }), "");
  EXPECT_FALSE(path_exists(join_path(dir, "a")));
  write_file_atomically(join_path(dir, "file"), "x");
  EXPECT_NE(error_of([&] { check_output_folder(join_path(dir, "file/sub"), "--out"); }).find("is a file"), std::string::npos);
  EXPECT_NE(error_of([&] { check_output_file(join_path(dir, "file/t.json"), "--trace"); }).find("a file is in its place"), std::string::npos);
  EXPECT_NE(error_of([&] { check_output_folder("", "--run-dir"); }).find("--run-dir: an empty path"), std::string::npos);
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
