#include "megaslide/eval/plot.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <memory>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "megaslide/io/files.h"

namespace megaslide {
namespace {

constexpr const char* kInstallHint =
    "install the Debian package gnuplot-nox (apt-get install gnuplot-nox; tools/bootstrap.sh does it), "
    "or point MEGASLIDE_GNUPLOT at a gnuplot binary";

bool executable(const std::string& path) { return access(path.c_str(), X_OK) == 0 && !io::is_directory(path); }

// Text as one line: control characters (a newline would end a script command or a data comment)
// become spaces.
std::string one_line(const std::string& s) {
  std::string out;
  for (char c : s) out += static_cast<unsigned char>(c) < 0x20 || c == 0x7f ? ' ' : c;
  return out;
}

// Text (a run's path, a series name) as a gnuplot string expression that gnuplot takes as data only.
// gnuplot runs the command in `backquotes` wherever they appear in a line — inside "double-quoted"
// strings too — except inside 'single-quoted' strings, which also undergo no backslash processing and
// no @macro expansion. A single quote itself is joined in as sprintf('%c',39): the doubled '' that
// gnuplot documents fails at the start of a string in gnuplot 5.4, and a "'" in double quotes throws
// its quote tracking off (the rest of the line is then open to @macro expansion). Control characters
// become spaces (a newline would end the command). Tested by printing hostile text back through
// gnuplot itself (tests/test_plot.cpp).
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : one_line(s)) {
    if (c == '\'') out += "'.sprintf('%c',39).'";
    else out += c;
  }
  return out + "'";
}

std::string basename_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string dirname_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool plottable(const PlotPanel& panel, const PlotSeries& s, size_t i) {
  if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) return false;
  if (panel.log_y && s.y[i] <= 0) return false;
  if (panel.log_x && s.x[i] <= 0) return false;
  return true;
}

// Runs `program script` in `dir`; returns the exit status (-1: did not exit normally) and its output.
int run_in(const std::string& dir, const std::string& program, const std::string& script, const std::string& log_path,
           std::string& output) {
  std::unique_ptr<io::OutputFile> log;
  try {
    log = std::make_unique<io::OutputFile>(log_path, /*append=*/false);
  } catch (const io::IoError& e) {
    throw PlotError(e.what());
  }
  const int log_fd = log->fd();
  const pid_t pid = fork();
  if (pid < 0) throw PlotError(fmt::format("cannot start gnuplot: fork failed: {}", std::strerror(errno)));
  if (pid == 0) {
    // The child: only async-signal-safe calls until exec.
    if (chdir(dir.c_str()) != 0) _exit(126);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    const int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
    char* const argv[] = {const_cast<char*>(program.c_str()), const_cast<char*>(script.c_str()), nullptr};
    execv(program.c_str(), argv);
    _exit(127);
  }
  log.reset();
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw PlotError(fmt::format("waiting for gnuplot failed: {}", std::strerror(errno)));
  }
  try {
    output = io::read_file(log_path);
  } catch (const io::IoError&) {
    output.clear();
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

std::string find_gnuplot(const PlotOptions& options) {
  std::string name = options.gnuplot;
  if (name.empty()) {
    const char* env = std::getenv("MEGASLIDE_GNUPLOT");
    name = env != nullptr && *env != '\0' ? env : "gnuplot";
  }
  if (name.find('/') != std::string::npos) {
    if (executable(name)) return name;
    throw PlotError(fmt::format("gnuplot not found: '{}' is not an executable file; {}", name, kInstallHint));
  }
  const char* path_env = std::getenv("PATH");
  std::stringstream path(path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(path, dir, ':')) {
    const std::string candidate = io::join_path(dir.empty() ? "." : dir, name);
    if (executable(candidate)) return candidate;
  }
  throw PlotError(fmt::format("gnuplot not found: no '{}' on PATH; {}", name, kInstallHint));
}

bool is_png_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[8] = {};
  if (!in.read(head, 8)) return false;
  static const unsigned char kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (std::memcmp(head, kSignature, 8) != 0) return false;
  // Whole: it ends with the IEND chunk (its length 0, its name, its CRC), which a file cut short (a full disk)
  // lacks.
  static const unsigned char kEnd[12] = {0, 0, 0, 0, 'I', 'E', 'N', 'D', 0xae, 0x42, 0x60, 0x82};
  char tail[12] = {};
  in.seekg(-12, std::ios::end);
  return in.read(tail, 12) && std::memcmp(tail, kEnd, 12) == 0;
}

PlotFiles render_plot(const PlotSpec& spec, const std::string& png_path, const PlotOptions& options) {
  if (png_path.size() < 5 || png_path.compare(png_path.size() - 4, 4, ".png") != 0)
    throw PlotError(fmt::format("plot file '{}': expected a name ending in .png", png_path));
  if (spec.panels.empty()) throw PlotError(fmt::format("plot '{}': nothing to draw (no panels)", png_path));
  const std::string program = find_gnuplot(options);
  const std::string stem = png_path.substr(0, png_path.size() - 4);
  PlotFiles files{png_path, stem + ".dat", stem + ".gp"};
  const std::string dir = dirname_of(png_path);

  std::string data, script;
  int block = 0;
  // Every piece of text that did not come from this file reaches the script through quoted() (or, in
  // this comment, one_line(): gnuplot ignores the rest of a line after '#').
  script +=
      fmt::format("# Draws {} from {}: cd into this folder and run: gnuplot {}\n", one_line(basename_of(files.png)),
                  one_line(basename_of(files.data)), one_line(basename_of(files.script)));
  script += fmt::format("set terminal pngcairo size {},{} noenhanced font \",10\"\n", spec.width,
                        spec.panel_height * static_cast<int>(spec.panels.size()));
  script += fmt::format("set output {}\n", quoted(basename_of(files.png)));
  script += "set datafile separator \",\"\nset datafile missing \"?\"\nset grid\nset key top right\n";
  const bool multi = spec.panels.size() > 1 || !spec.title.empty();
  if (multi) {
    script += fmt::format("set multiplot layout {},1{}\n", spec.panels.size(),
                          spec.title.empty() ? "" : " title " + quoted(spec.title));
  }
  for (const auto& panel : spec.panels) {
    script += fmt::format("set title {}\nset xlabel {}\nset ylabel {}\n", quoted(panel.title), quoted(panel.xlabel),
                          quoted(panel.ylabel));
    script += panel.log_y ? "set logscale y\n" : "unset logscale y\n";
    script += panel.y_from_zero && !panel.log_y ? "set yrange [0:*]\n" : "set yrange [*:*]\n";
    script += panel.log_x ? "set logscale x\n" : "unset logscale x\n";
    std::vector<std::string> plots;
    int line_type = 0;  // each series' colour, named so that its isolated points below take the same
    for (const auto& s : panel.series) {
      ++line_type;
      if (s.x.size() != s.y.size())
        throw PlotError(fmt::format("plot '{}': series '{}' has {} x values and {} y values", png_path, s.title,
                                    s.x.size(), s.y.size()));
      data += fmt::format("# {} | {}\n", one_line(panel.title), one_line(s.title));
      bool any = false;
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (plottable(panel, s, i)) {
          data += fmt::format("{},{}\n", s.x[i], s.y[i]);
          any = true;
        } else {
          data += fmt::format("{},?\n", std::isfinite(s.x[i]) ? fmt::format("{}", s.x[i]) : std::string("?"));
        }
      }
      data += "\n\n";
      if (any) {
        plots.push_back(fmt::format("{} index {} using 1:2 with {} linetype {} title {}",
                                    quoted(basename_of(files.data)), block,
                                    panel.points ? "linespoints pointsize 0.8" : "lines", line_type, quoted(s.title)));
      }
      ++block;
      if (panel.points || !any) continue;
      // Lines draw no point without a plottable neighbour (a one-step run, a value between skipped steps): such
      // points are drawn as markers of the series' colour.
      std::string isolated;
      for (size_t i = 0; i < s.x.size(); ++i)
        if (plottable(panel, s, i) && (i == 0 || !plottable(panel, s, i - 1)) &&
            (i + 1 == s.x.size() || !plottable(panel, s, i + 1)))
          isolated += fmt::format("{},{}\n", s.x[i], s.y[i]);
      if (isolated.empty()) continue;
      data += fmt::format("# {} | {}, points without a neighbour\n{}\n\n", one_line(panel.title), one_line(s.title),
                          isolated);
      plots.push_back(fmt::format("{} index {} using 1:2 with points linetype {} pointtype 7 pointsize 0.6 notitle",
                                  quoted(basename_of(files.data)), block, line_type));
      ++block;
    }
    if (plots.empty()) {
      // gnuplot refuses a plot without a valid point; an empty panel says so instead.
      script +=
          "unset logscale\nset label 1 \"no data\" at graph 0.5, graph 0.5 center\nplot [0:1][0:1] 1/0 notitle\n"
          "unset label 1\n";
    } else {
      script += "plot ";
      for (size_t i = 0; i < plots.size(); ++i) script += (i ? ", \\\n     " : "") + plots[i];
      script += "\n";
    }
  }
  if (multi) script += "unset multiplot\n";
  script += "unset output\n";

  try {
    io::write_file_atomically(files.data, data);
    io::write_file_atomically(files.script, script);
  } catch (const io::IoError& e) {
    throw PlotError(std::string("plot: ") + e.what());
  }
  // A PNG left from an earlier render must not pass for this one; it is put back if this one fails.
  const std::string previous = png_path + ".previous";
  const bool had_previous = ::rename(files.png.c_str(), previous.c_str()) == 0;
  const auto restore_previous = [&] {
    if (had_previous) ::rename(previous.c_str(), files.png.c_str());
    else ::unlink(files.png.c_str());
  };
  const std::string log_path = stem + ".gnuplot.log";
  std::string output;
  int code = 0;
  try {
    code = run_in(dir, program, basename_of(files.script), log_path, output);
  } catch (...) {
    restore_previous();
    throw;
  }
  if (code != 0) {
    restore_previous();
    throw PlotError(fmt::format("gnuplot ({}) failed on {} with exit status {}{}{}", program, files.script, code,
                                code == 127 ? " (could not be executed)" : "",
                                output.empty() ? std::string() : ":\n" + output));
  }
  ::unlink(log_path.c_str());
  if (!is_png_file(files.png)) {
    restore_previous();  // a file cut short must not pass for the picture
    throw PlotError(
        fmt::format("gnuplot ran on {} but {} is not a whole PNG file (is the disk full?; gnuplot printed: {})",
                    files.script, files.png, output.empty() ? "nothing" : output));
  }
  if (had_previous) ::unlink(previous.c_str());
  return files;
}

}  // namespace megaslide
