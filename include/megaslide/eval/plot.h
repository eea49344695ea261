// Line plots as PNG files, drawn by gnuplot (the Debian package gnuplot-nox; tools/bootstrap.sh
// installs it).
//
// render_plot(spec, "DIR/name.png") writes three files side by side and keeps them:
//   DIR/name.dat   the data, one block per series ("x,y" lines, a "# series" comment first, blocks
//                  separated by two blank lines, gnuplot's `index`); a missing point is written "?";
//                  a line series' points with no plottable neighbour (which a line would not show) are a
//                  block of their own too, drawn as markers of the series' colour
//   DIR/name.gp    the gnuplot script that draws name.png from name.dat (`gnuplot name.gp` in DIR
//                  renders it again, after editing either file)
//   DIR/name.png   the image (pngcairo terminal; several panels stack vertically)
// then runs gnuplot on the script and checks its exit status and that the PNG was written. An earlier
// name.png is kept aside while gnuplot runs and put back when it fails.
//
// Errors throw PlotError: gnuplot not found (the message names the package to install), gnuplot
// failing (its exit status and what it printed), or a file that cannot be written.
// Thread-safety: plain functions; concurrent calls must write different files.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace megaslide {

class PlotError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PlotSeries {
  std::string title;
  std::vector<double> x, y;  // same length; a non-finite y is a gap (written "?")
};

struct PlotPanel {
  std::string title, xlabel, ylabel;
  bool log_x = false, log_y = false;
  bool points = true;  // draw markers as well as lines
  std::vector<PlotSeries> series;
  // The y axis starts at 0 (sizes, byte counts: a constant is a flat line at its height, not the middle
  // of gnuplot's ±1 % autoscale); otherwise it fits the data. Ignored with log_y.
  bool y_from_zero = false;
};

struct PlotSpec {
  std::string title;  // over the whole figure (may be empty)
  std::vector<PlotPanel> panels;
  int width = 900;         // pixels
  int panel_height = 420;  // pixels per panel
};

struct PlotOptions {
  // The gnuplot program: a name looked up on PATH or a path. Empty: $MEGASLIDE_GNUPLOT if set, else "gnuplot".
  std::string gnuplot;
};

struct PlotFiles {
  std::string png, data, script;
};

// The gnuplot executable options.gnuplot names, resolved on PATH; throws PlotError naming the
// package (gnuplot-nox) when there is none.
std::string find_gnuplot(const PlotOptions& options = {});

// Draws `spec` into `png_path` (which must end in ".png"); see the file comment. Throws PlotError.
PlotFiles render_plot(const PlotSpec& spec, const std::string& png_path, const PlotOptions& options = {});

// True when `path` exists, begins with the 8-byte PNG signature and ends with the IEND chunk (a file cut short
// by a full disk does not).
bool is_png_file(const std::string& path);

}  // namespace megaslide
