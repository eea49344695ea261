// For command-line tests: runs one of the built megaslide-* programs (build/bin) with a shell argument
// string and returns its exit code and everything it printed (stdout and stderr together).
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace megaslide::testing {

struct ToolResult {
  int code = -1;  // the exit status, or -1 when the program did not exit normally
  std::string output;
};

inline ToolResult run_tool(const std::string& tool, const std::string& args) {
  const std::string cmd = std::string(MEGASLIDE_BINARY_DIR) + "/bin/" + tool + " " + args + " 2>&1";
  ToolResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), pipe) != nullptr) r.output += buf.data();
  const int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace megaslide::testing
