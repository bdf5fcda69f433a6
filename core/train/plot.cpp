#include "core/train/plot.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/common/error.h"
#include "core/common/log.h"

extern char** environ;

namespace fs = std::filesystem;

namespace trainrun {

namespace {

struct Point {
  double step, value;
};

struct Series {
  std::vector<Point> loss, val, tps, mfu;
  size_t records = 0;
};

// A resumed run appends records from its checkpoint's step on: points at or
// after the step where the record sequence went back are the abandoned
// future and are replaced.
void add_point(std::vector<Point>& s, double step, double v) {
  while (!s.empty() && s.back().step >= step) s.pop_back();
  s.push_back({step, v});
}

Series read_metrics(const fs::path& file) {
  std::ifstream f(file, std::ios::binary);
  TR_CHECK(f, "plot: cannot read '", file.string(), "'");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  std::vector<std::string> lines;
  {
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
  }
  const bool ends_clean = text.empty() || text.back() == '\n';
  Series s;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (l.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    bool ok = true;
    try {
      j = nlohmann::json::parse(l);
    } catch (const std::exception&) {
      ok = false;
    }
    ok = ok && j.is_object() && j.contains("step") && j["step"].is_number();
    if (!ok) {
      // A run killed mid-write leaves a torn last line: not worth failing for.
      if (i + 1 == lines.size() && !ends_clean) {
        TR_LOG_WARN("plot: ", file.string(), ":", i + 1, ": skipping an incomplete last record");
        continue;
      }
      TR_FAIL("plot: ", file.string(), ":", i + 1,
              ": not a metrics record (a JSON object with a numeric \"step\"); is this a trainrun metrics.jsonl?");
    }
    ++s.records;
    const double step = j["step"].get<double>();
    auto num = [&](const char* k, std::vector<Point>& out) {
      if (j.contains(k) && j[k].is_number()) {
        const double v = j[k].get<double>();
        if (std::isfinite(v)) add_point(out, step, v);
      }
    };
    num("loss", s.loss);
    num("val_loss", s.val);
    num("tokens_per_sec", s.tps);
    num("mfu", s.mfu);
  }
  return s;
}

// gnuplot single-quoted string: only ' needs escaping (as '').
std::string gp_quote(const std::string& s) {
  std::string o = "'";
  for (char c : s) o += c == '\'' ? std::string("''") : std::string(1, c);
  return o + "'";
}

void datablock(std::ostringstream& o, const char* name, const std::vector<Point>& pts, double scale = 1) {
  o << "$" << name << " << EOD\n";
  char buf[96];
  for (const auto& p : pts) {
    std::snprintf(buf, sizeof buf, "%.0f %.9g\n", p.step, p.value * scale);
    o << buf;
  }
  o << "EOD\n";
}

std::string style(size_t n) { return n <= 60 ? "linespoints pt 7 ps 0.5" : "lines"; }

}  // namespace

std::string plot_script(const std::string& run_dir, const std::string& image, const std::string& format) {
  const fs::path dir(run_dir);
  const fs::path metrics = dir / "metrics.jsonl";
  TR_CHECK(fs::is_directory(dir), "plot: '", run_dir, "' is not a directory; give a run's output.dir");
  TR_CHECK(fs::exists(metrics), "plot: no metrics.jsonl in '", run_dir,
           "'; give a run's output.dir (it has metrics.jsonl once the first step is logged)");
  const Series s = read_metrics(metrics);
  TR_CHECK(!s.loss.empty(), "plot: ", metrics.string(), " has no loss values to plot (", s.records, " records)");
  TR_CHECK(format == "svg" || format == "png", "plot: unknown format '", format, "'; use svg or png");

  std::string title = fs::absolute(dir).lexically_normal().filename().string();
  if (title.empty()) title = fs::absolute(dir).lexically_normal().parent_path().filename().string();
  std::ostringstream o;
  o << "# trainrun plot of " << metrics.string() << " (" << s.records << " records).\n"
    << "# Edit and rerun: gnuplot plot.gp\n";
  // noenhanced: run names like my_run must not turn into subscripts.
  if (format == "svg")
    o << "set terminal svg size 960,760 dynamic noenhanced font 'sans,12' background rgb 'white'\n";
  else
    o << "set terminal pngcairo size 1200,950 noenhanced font 'sans,11' background rgb 'white'\n";
  o << "set output " << gp_quote(image) << "\n";
  datablock(o, "loss", s.loss);
  datablock(o, "val", s.val);
  datablock(o, "tps", s.tps);
  datablock(o, "mfu", s.mfu, 100.0);
  const Point last = s.loss.back();
  char sub[160];
  std::snprintf(sub, sizeof sub, "%s: %.0f steps, last loss %.4f", title.c_str(), last.step, last.value);
  std::string head = sub;
  if (!s.val.empty()) {
    auto best = std::min_element(s.val.begin(), s.val.end(), [](auto& a, auto& b) { return a.value < b.value; });
    std::snprintf(sub, sizeof sub, ", best val loss %.4f (step %.0f)", best->value, best->step);
    head += sub;
  }
  o << "set multiplot layout 2,1 title " << gp_quote(head) << "\n"
    << "set grid lc rgb '#dddddd'\n"
    << "set key top right\n"
    << "set xlabel 'step'\n"
    << "set title 'loss'\n"
    << "set ylabel 'loss (nats/token)'\n"
    << "plot $loss using 1:2 with " << style(s.loss.size()) << " lw 2 lc rgb '#1f77b4' title 'train'";
  if (!s.val.empty()) o << ", \\\n     $val using 1:2 with linespoints pt 7 ps 0.8 lw 2 lc rgb '#d62728' title 'val'";
  o << "\n";
  o << "set title 'throughput'\n"
    << "set ylabel 'tokens/s'\n"
    << "set format y '%.1s%c'\n"
    << "set yrange [0:*]\n";
  if (!s.tps.empty()) {
    if (!s.mfu.empty()) {
      o << "set ytics nomirror\n"
        << "set y2tics\n"
        << "set y2range [0:*]\n"
        << "set y2label 'MFU (%)'\n";
    }
    o << "plot $tps using 1:2 with " << style(s.tps.size()) << " lw 2 lc rgb '#2ca02c' title 'tokens/s'";
    if (!s.mfu.empty())
      o << ", \\\n     $mfu using 1:2 axes x1y2 with " << style(s.mfu.size())
        << " lw 1.5 dt 2 lc rgb '#9467bd' title 'MFU (%)'";
    o << "\n";
  }
  o << "unset multiplot\n";
  return o.str();
}

std::string plot_run(const std::string& run_dir, const PlotOptions& opt) {
  const fs::path dir(run_dir);
  const std::string image = opt.output.empty() ? (dir / ("plot." + opt.format)).string() : opt.output;
  const std::string script = plot_script(run_dir, image, opt.format);
  const fs::path script_path = dir / "plot.gp";
  {
    std::ofstream f(script_path);
    f << script;
    TR_CHECK(f.good(), "plot: cannot write '", script_path.string(), "'; check that the directory is writable");
  }
  std::string prog = opt.gnuplot;
  if (prog.empty()) {
    const char* env = std::getenv("TRAINRUN_GNUPLOT");
    prog = env && *env ? env : "gnuplot";
  }
  // posix_spawnp, not fork: the trainer is multi-threaded (OpenMP, the comm
  // thread) and spawn is the safe way to start a program from there.
  int pipefd[2];
  TR_CHECK_ERRNO(::pipe2(pipefd, O_CLOEXEC) == 0, "plot: cannot create a pipe");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
  std::string a0 = prog, a1 = script_path.string();
  char* argv[] = {a0.data(), a1.data(), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, prog.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(pipefd[1]);
  if (rc != 0) {
    ::close(pipefd[0]);
    TR_FAIL("plot: cannot run '", prog, "': ", std::strerror(rc),
            rc == ENOENT ? "; install gnuplot (Debian: apt-get install gnuplot-nox, or scripts/install-deps.sh) "
                           "or point TRAINRUN_GNUPLOT at it"
                         : "",
            "; the script is ready in ", script_path.string());
  }
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(pipefd[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (out.size() < 8192) out.append(buf, size_t(n));
  }
  ::close(pipefd[0]);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
  if (!ok) {
    const std::string how = WIFEXITED(st) ? "exit code " + std::to_string(WEXITSTATUS(st))
                                          : "signal " + std::to_string(WTERMSIG(st));
    TR_FAIL("plot: ", prog, " failed on ", script_path.string(), " (", how, ")", out.empty() ? "" : ":\n" + out);
  }
  std::error_code ec;
  TR_CHECK(fs::exists(image, ec) && fs::file_size(image, ec) > 0, "plot: ", prog, " wrote no image to '", image, "'",
           out.empty() ? "" : ":\n" + out);
  return image;
}

}  // namespace trainrun
