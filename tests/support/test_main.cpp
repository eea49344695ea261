// gtest main shared by every test program: fixes LibTorch's thread count so timings and reductions do
// not depend on how many other tests run beside this one on a 2-core machine, and removes the scratch
// files of a run whose tests all passed.
#include <gtest/gtest.h>
#include <torch/types.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "megaslide/io/files.h"

namespace {

// Whether `name` carries `pid` as a whole token: "-<pid>" followed by the end, '-' or '.'.
bool names_process(const std::string& name, const std::string& pid) {
  const std::string token = "-" + pid;
  for (auto pos = name.find(token); pos != std::string::npos; pos = name.find(token, pos + 1)) {
    const auto end = pos + token.size();
    if (end == name.size() || name[end] == '-' || name[end] == '.') return true;
  }
  return false;
}

// The tests name their scratch files /tmp/megaslide-test-<what>-<pid>[-<name>] (or .<ext>) after their own
// process; CTest runs each test case as a process of its own. Once every case of this process has passed,
// what it left there goes; a failing case's files stay for a look, and MEGASLIDE_KEEP_TEST_FILES=1 keeps
// them always.
void remove_own_scratch_files() {
  const char* keep = std::getenv("MEGASLIDE_KEEP_TEST_FILES");
  if (keep != nullptr && std::string(keep) != "" && std::string(keep) != "0") return;
  const std::string pid = std::to_string(::getpid());
  std::vector<std::string> names;
  try {
    names = megaslide::io::list_directory("/tmp");
  } catch (const std::exception&) {
    return;  // nothing of this process's can be there either
  }
  for (const auto& name : names) {
    if (name.rfind("megaslide-test-", 0) != 0 || !names_process(name, pid)) continue;
    try {
      megaslide::io::remove_tree("/tmp/" + name);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "note: a test's scratch file stays: %s\n", e.what());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  torch::set_num_threads(1);
  const int result = RUN_ALL_TESTS();
  if (result == 0) remove_own_scratch_files();
  return result;
}
