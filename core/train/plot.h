// `trainrun plot <output.dir>` and the end-of-run plot: loss and val-loss
// curves over steps, and throughput (tokens/s, MFU), from metrics.jsonl, to
// <output.dir>/plot.svg (or .png).
//
// Why gnuplot (Debian's gnuplot-nox, run as a program) and not our own
// drawing code: the issue asks for no plot code that a well-kept Debian
// package provides better. Looked at:
//  - gnuplot 5.4 (gnuplot-nox, maintained, no X dependency): axes, "nice"
//    tick selection, legends, a second y axis, multiplot, SVG and PNG
//    (cairo) terminals: everything a readable chart needs, from a short
//    script.
//  - GNU plotutils' libplot (libplot-dev 2.6, last release 2009): a
//    low-level pen API; axes, ticks and legends would still be ours.
//  - hand-written SVG: would re-implement exactly what gnuplot does well.
//  - matplotlib: Python in the loop, which the design rules out.
// Running it as a separate program keeps it out of the link: trainrun runs
// without it and only plotting needs it (a clear error says how to install
// it). The script is left next to the image as plot.gp with the data
// inline, so a user can restyle the chart and rerun `gnuplot plot.gp`.
#pragma once
#include <string>

namespace trainrun {

struct PlotOptions {
  std::string format = "svg";  // svg | png
  std::string output;          // default <run_dir>/plot.<format>
  // The gnuplot program: $TRAINRUN_GNUPLOT, else "gnuplot" on PATH.
  std::string gnuplot;
};

// Returns the image path. Throws Error naming the file and what to do: no
// such directory, no metrics.jsonl, a malformed record (a torn last line of
// a killed run is skipped), no loss values, no gnuplot, gnuplot failing.
std::string plot_run(const std::string& run_dir, const PlotOptions& opt = {});

// The gnuplot script for a run directory's metrics (data inline), writing
// to `image`. Exposed for tests.
std::string plot_script(const std::string& run_dir, const std::string& image, const std::string& format);

}  // namespace trainrun
