#include "core/train/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <omp.h>
#include <sstream>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/train/data_text.h"
#include "core/train/metrics.h"
#include "core/train/plot.h"
#include "core/train/tensorboard.h"
#include "parallel/sharding/sharding.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace trainrun {

namespace {

std::string fixed(double v, int prec) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string hms(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = int64_t(s + 0.5);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(t / 3600), (long long)(t / 60 % 60),
                (long long)(t % 60));
  return buf;
}

// 13200 -> "13.2k", for the status line where width is scarce.
std::string short_count(double v) {
  if (v >= 1e9) return fixed(v / 1e9, 2) + "G";
  if (v >= 1e6) return fixed(v / 1e6, v >= 1e7 ? 1 : 2) + "M";
  if (v >= 1e4) return fixed(v / 1e3, 1) + "k";
  return fixed(v, 0);
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string flops_str(double f) {
  if (f >= 1e12) return fixed(f / 1e12, 1) + " TFLOP/s";
  return fixed(f / 1e9, 1) + " GFLOP/s";
}

bool env_flag(const char* name, bool dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  const std::string s = v;
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  TR_FAIL("environment variable ", name, "='", s, "' is not a boolean; use 1 or 0");
}

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      if (c != std::string::npos) {
        std::string v = line.substr(c + 1);
        v.erase(0, v.find_first_not_of(" \t"));
        return v;
      }
    }
  return "unknown cpu";
}

// $XDG_CACHE_HOME/trainrun/cpu_peak.tsv (else ~/.cache/...): "key<TAB>flops"
// lines. Returns max(measured, cached) and stores it. Any I/O problem just
// means no cache: MFU is a report, never a reason to fail a run.
double remember_best_peak(const std::string& key, double measured) {
  fs::path dir;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) dir = x;
  else if (const char* h = std::getenv("HOME"); h && *h) dir = fs::path(h) / ".cache";
  else return measured;
  dir /= "trainrun";
  const fs::path file = dir / "cpu_peak.tsv";
  std::vector<std::pair<std::string, double>> rows;
  double best = measured;
  {
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) {
      const size_t tab = line.rfind('\t');
      if (tab == std::string::npos) continue;
      const std::string k = line.substr(0, tab);
      const double v = std::atof(line.c_str() + tab + 1);
      if (!(v > 0)) continue;
      if (k == key) best = std::max(best, v);
      else rows.push_back({k, v});
    }
  }
  rows.push_back({key, best});
  std::error_code ec;
  fs::create_directories(dir, ec);
  // Write aside and rename: concurrent ranks never see a half-written file.
  const fs::path tmp = dir / ("cpu_peak.tsv." + std::to_string(::getpid()) + ".tmp");
  {
    std::ofstream out(tmp);
    for (const auto& [k, v] : rows) out << k << '\t' << fixed(v, 0) << '\n';
    if (!out) return best;
  }
  fs::rename(tmp, file, ec);
  if (ec) fs::remove(tmp, ec);
  return best;
}

}  // namespace

int terminal_width() {
  struct winsize ws {};
  if (::ioctl(2, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    int w = std::atoi(c);
    if (w > 0) return w;
  }
  return 120;
}

// ---- peak FLOP/s ---------------------------------------------------------------------------

double measure_matmul_flops(Backend& be, int n) {
  TR_CHECK(n >= 16, "measure_matmul_flops: n must be at least 16");
  const size_t bytes = size_t(n) * n * dtype_size(be.act_dtype());
  DeviceBuffer a(&be, bytes), b(&be, bytes), c(&be, bytes);
  // Small non-zero inputs: zeros could take a fast path, large values overflow bf16.
  std::vector<float> host(size_t(n) * n);
  for (size_t i = 0; i < host.size(); ++i) host[i] = float(int(i % 17) - 8) * (1.0f / 64);
  DeviceBuffer h32(&be, host.size() * 4);
  be.copy_to_device(h32.get(), host.data(), host.size() * 4);
  be.cast_from_f32(a.get(), h32.as<float>(), int64_t(host.size()));
  be.cast_from_f32(b.get(), h32.as<float>(), int64_t(host.size()));
  const double flop = 2.0 * n * double(n) * n;
  be.matmul_forward(c.get(), a.get(), b.get(), nullptr, n, n, n);  // warm-up: threads, caches, clocks
  be.synchronize();
  double best = 0;
  const auto t_all = Clock::now();
  for (int rep = 0; rep < 10 && (rep < 3 || since(t_all) < 0.25); ++rep) {
    const auto t0 = Clock::now();
    be.matmul_forward(c.get(), a.get(), b.get(), nullptr, n, n, n);
    be.synchronize();
    const double dt = since(t0);
    if (dt > 0) best = std::max(best, flop / dt);
  }
  return best;
}

PeakFlops device_peak_flops(Backend& be) {
  PeakFlops p;
  if (const GpuSpec* g = find_gpu_spec(be.name())) {
    p.flops = g->bf16_flops;
    p.source = g->name + " bf16 dense (datasheet)";
    return p;
  }
  if (be.name() != "cpu") {
    // A GPU the table does not know: measure, and say so.
    const int n = 4096;
    p.flops = measure_matmul_flops(be, n);
    p.source = "measured: " + std::string(dtype_name(be.act_dtype())) + " matmul " + std::to_string(n) + "^3 on " + be.name();
    return p;
  }
  const int threads = omp_get_max_threads();
  // An explicit figure wins (a datasheet value, or to compare machines).
  if (const char* v = std::getenv("TRAINRUN_CPU_PEAK_FLOPS"); v && *v) {
    char* end = nullptr;
    const double f = std::strtod(v, &end);
    TR_CHECK(end && *end == 0 && f > 0 && std::isfinite(f), "environment variable TRAINRUN_CPU_PEAK_FLOPS='", v,
             "' is not a positive number of FLOP/s per rank (e.g. 1.5e11)");
    p.flops = f;
    p.source = "TRAINRUN_CPU_PEAK_FLOPS";
    return p;
  }
  // The CPU: measured once per process and thread count (ranks of one
  // process share it). A measurement on a busy machine comes out low and
  // would inflate MFU past 100%, so the best figure ever measured on this
  // machine with this thread count is kept in a cache file and used when
  // higher: the peak converges to what the cores can do.
  static std::mutex mu;
  static std::map<int, double> cache;
  // 1024^3 keeps a few cores busy for ~20 ms a product; many cores need a
  // bigger one before OpenBLAS reaches its steady rate.
  const int n = threads > 8 ? 2048 : 1024;
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache.find(threads);
  if (it == cache.end()) {
    // A scratch backend: the trainer's backend keeps exact peak-memory
    // figures (the measurement allocates 16 MiB).
    std::unique_ptr<Backend> scratch = make_cpu_backend(threads);
    const double measured = measure_matmul_flops(*scratch, n);
    const std::string key = cpu_model_name() + " | threads " + std::to_string(threads) + " | n " + std::to_string(n);
    it = cache.emplace(threads, remember_best_peak(key, measured)).first;
  }
  p.flops = it->second;
  p.source = "measured: fp32 sgemm " + std::to_string(n) + "^3 with " + std::to_string(threads) + " thread" +
             (threads == 1 ? "" : "s") + ", best seen on this machine";
  return p;
}

// ---- memory --------------------------------------------------------------------------------

MemoryReport measure_memory(const Backend& be, const ParamStore& params, const Network& model) {
  MemoryReport r;
  const ShardMemory sm = params.memory();
  r.by_category.params = double(sm.params);
  r.by_category.grads = double(sm.grads);
  r.by_category.optimizer = double(sm.optimizer);
  r.by_category.comm = double(sm.comm_buffers);
  r.host = double(sm.host);
  r.disk = double(sm.disk);
  r.by_category.activations = double(model.activation_bytes());
  r.peak = double(be.peak_bytes());
  r.in_use = double(be.bytes_in_use());
  const double named = r.by_category.params + r.by_category.grads + r.by_category.optimizer +
                       r.by_category.comm + r.by_category.activations;
  r.by_category.workspace = std::max(0.0, r.peak - named);
  return r;
}

std::string describe_memory(const MemoryReport& m) {
  const auto& c = m.by_category;
  return "peak " + format_bytes(m.peak) + ": params " + format_bytes(c.params) + ", grads " + format_bytes(c.grads) +
         ", optimizer " + format_bytes(c.optimizer) + ", activations " + format_bytes(c.activations) +
         ", comm buffers " + format_bytes(c.comm) + ", workspace " + format_bytes(c.workspace);
}

// ---- options -------------------------------------------------------------------------------

ProgressOptions ProgressOptions::from_env() {
  ProgressOptions o;
  if (const char* v = std::getenv("TRAINRUN_PROGRESS"); v && *v) {
    const std::string s = v;
    if (s == "auto") o.mode = Mode::Auto;
    else if (s == "live") o.mode = Mode::Live;
    else if (s == "plain") o.mode = Mode::Plain;
    else if (s == "relay") o.mode = Mode::Relay;  // set by the agent for rank 0
    else TR_FAIL("environment variable TRAINRUN_PROGRESS='", s, "' is not one of auto, live, plain");
  }
  o.all_ranks = env_flag("TRAINRUN_LOG_ALL_RANKS", false);
  o.rank_prefix = !env_flag("TRAINRUN_AGENT_ECHO", false);
  o.plot = env_flag("TRAINRUN_PLOT", true);
  o.tensorboard = env_flag("TRAINRUN_TENSORBOARD", true);
  return o;
}

// ---- the reporter ------------------------------------------------------------------------------

RunReporter::RunReporter(const Context& ctx, const ProgressOptions& opt) : ctx_(ctx), opt_(opt) {
  TR_CHECK(ctx_.job && ctx_.arch && ctx_.backend && ctx_.params && ctx_.network, "RunReporter: incomplete context");
  flops_per_token_ = ctx_.flops_per_token > 0 ? ctx_.flops_per_token : ctx_.arch->flops_per_token();
  // Only rank 0 draws in place: several ranks redrawing one line would fight.
  relay_ = ctx_.rank == 0 && opt_.mode == ProgressOptions::Mode::Relay;
  live_ = ctx_.rank == 0 &&
          (opt_.mode == ProgressOptions::Mode::Live || relay_ ||
           (opt_.mode == ProgressOptions::Mode::Auto && ::isatty(2)));
  if (printing()) {
    peak_ = device_peak_flops(*ctx_.backend);
    print_line("mfu: " + fixed(flops_per_token_ / 1e6, 2) + " MFLOP per token (" +
               (ctx_.flops_formula.empty() ? std::string("6N + 12*L*C*T") : ctx_.flops_formula) + "); peak " +
               flops_str(peak_.flops) + " per rank (" + peak_.source + ")");
  }
  const fs::path out(ctx_.job->output.dir);
  if (ctx_.rank == 0 && opt_.tensorboard) {
    tb_dir_ = (out / "tb").string();
    tb_ = std::make_unique<TensorBoardWriter>(tb_dir_);
  }
  if (live_ && !relay_) {
    term_width_ = terminal_width();
    // Every log line from anywhere first erases the status line, so a
    // message from another part of the program never lands in the middle
    // of it; the next step redraws it underneath.
    set_log_prefix("\r\033[K");
  }
}

RunReporter::~RunReporter() {
  if (live_) {
    clear_status();
    set_log_prefix("");
  }
}

double RunReporter::mean_tokens_per_sec() const {
  return train_seconds_ > 0 ? double(ctx_.tokens_per_step) * steps_done_ / train_seconds_ : 0;
}

double RunReporter::mfu(double tokens_per_sec) const {
  if (peak_.flops <= 0) return 0;
  return tokens_per_sec * flops_per_token_ / (peak_.flops * ctx_.world);
}

std::string RunReporter::elapsed_eta() const {
  // ETA from wall time per step since the first step ended (it includes
  // evaluation and logging, which the remaining steps will pay too).
  double per_step = ema_step_seconds_;
  if (steps_done_ >= 2) per_step = since(first_step_end_) / (steps_done_ - 1);
  const double remaining = double(std::max(0, ctx_.job->train.max_steps - last_step_)) * per_step;
  return "elapsed " + hms(since(ctx_.start)) + " | ETA " + hms(remaining);
}

std::string RunReporter::status_line() const {
  const double tps = ema_step_seconds_ > 0 ? double(ctx_.tokens_per_step) / ema_step_seconds_ : 0;
  std::string s = "step " + std::to_string(last_step_) + "/" + std::to_string(ctx_.job->train.max_steps) +
                  " | loss " + fixed(last_loss_, 4) + " | " + short_count(tps) + " tok/s";
  if (peak_.flops > 0) s += " | MFU " + fixed(100 * mfu(tps), 1) + "%";
  s += " | mem " + format_bytes(double(ctx_.backend->peak_bytes())) + " | " + elapsed_eta();
  return s;
}

void RunReporter::draw_status(bool force) {
  if (!live_) return;
  const auto now = Clock::now();
  // At most ~10 redraws a second: a terminal is slow, steps can be fast.
  if (!force && status_drawn_ && std::chrono::duration<double>(now - last_draw_).count() < 0.1) return;
  last_draw_ = now;
  std::string s = status_line();
  if (relay_) {
    // One whole line down the pipe; the agent clips and draws it.
    s = kStatusLineMarker + s + "\n";
    std::fwrite(s.data(), 1, s.size(), stderr);
    std::fflush(stderr);
    status_drawn_ = true;
    return;
  }
  // A line wider than the terminal wraps, and "\r" then only returns to
  // the wrapped part: clip it.
  if (term_width_ > 1 && int(s.size()) > term_width_ - 1) s.resize(term_width_ - 1);
  s = "\r\033[K" + s;
  std::fwrite(s.data(), 1, s.size(), stderr);
  std::fflush(stderr);
  status_drawn_ = true;
}

void RunReporter::clear_status() {
  if (!live_ || !status_drawn_) return;
  if (relay_) {  // the agent erases it before the next line it echoes
    status_drawn_ = false;
    return;
  }
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  status_drawn_ = false;
}

void RunReporter::print_line(const std::string& line) {
  if (!printing()) return;
  const bool prefix_rank = opt_.all_ranks && opt_.rank_prefix && ctx_.world > 1;
  const std::string prefix = prefix_rank ? "[rank " + std::to_string(ctx_.rank) + "] " : "";
  // With a status line on screen the log prefix erases it first.
  TR_LOG_INFO(prefix, line);
  status_drawn_ = false;
}

void RunReporter::on_step(const StepReport& r) {
  const auto& tr = ctx_.job->train;
  ++steps_done_;
  last_step_ = r.step;
  last_loss_ = r.loss;
  train_seconds_ += r.step_seconds;
  window_seconds_ += r.step_seconds;
  window_comm_ += r.comm_wait_seconds;
  if (r.tp_comm_seconds >= 0) window_tp_comm_ = std::max(0.0, window_tp_comm_) + r.tp_comm_seconds;
  ++window_steps_;
  // The status line's throughput: smoothed over ~5 steps so it reads
  // steadily; restarted at step 2 because the first step pays for warm-up
  // (page faults, thread pools) and would drag the average for long.
  ema_step_seconds_ = steps_done_ <= 2 ? r.step_seconds : 0.8 * ema_step_seconds_ + 0.2 * r.step_seconds;
  if (steps_done_ == 1) {
    first_step_ = r.step;
    first_step_end_ = Clock::now();
    if (tb_) tb_->add_session_start(r.step);
  }
  if (r.val_loss >= 0 && (best_val_ < 0 || r.val_loss < best_val_)) {
    best_val_ = r.val_loss;
    best_val_step_ = r.step;
  }
  const bool first = steps_done_ == 1;
  const bool record = first || r.last || r.step == tr.max_steps || (tr.log_interval > 0 && r.step % tr.log_interval == 0) ||
                      r.val_loss >= 0;
  if (record) {
    // Bits per byte of val text: compares runs whose tokenizers differ.
    const double bpb = bits_per_byte(r.val_loss, ctx_.val_tokens_per_byte);
    mem_ = measure_memory(*ctx_.backend, *ctx_.params, *ctx_.network);
    const double ms = 1000 * window_seconds_ / std::max(1, window_steps_);
    const double tps = window_seconds_ > 0 ? double(ctx_.tokens_per_step) * window_steps_ / window_seconds_ : 0;
    const double u = mfu(tps);
    if (printing()) {
      // The figures the run has always logged come first and in the same
      // order (scripts grep them); the operator fields follow.
      std::string line = "step " + std::to_string(r.step) + "/" + std::to_string(tr.max_steps) + " | loss " +
                         fixed(r.loss, 4) + " | lr ";
      char lr[32];
      std::snprintf(lr, sizeof lr, "%.2e", r.lr);
      line += std::string(lr) + " | grad_norm " + fixed(r.grad_norm, 3) + " | " + fixed(ms, 1) + " ms/step | " +
              fixed(tps, 0) + " tok/s";
      if (ctx_.world > 1) line += " | comm wait " + fixed(100 * window_comm_ / std::max(1e-9, window_seconds_), 1) + "%";
      if (window_tp_comm_ >= 0)
        line += " | tp comm " + fixed(100 * window_tp_comm_ / std::max(1e-9, window_seconds_), 1) + "%";
      if (r.bubble >= 0) line += " | bubble " + fixed(100 * r.bubble, 1) + "%";
      if (peak_.flops > 0) line += " | MFU " + fixed(100 * u, 1) + "%";
      line += " | mem " + format_bytes(mem_.peak) + " | " + elapsed_eta();
      if (r.val_loss >= 0) line += " | val_loss " + fixed(r.val_loss, 4);
      if (bpb >= 0) line += " | val_bpb " + fixed(bpb, 4);
      print_line(line);
      if (first)
        print_line("memory (rank " + std::to_string(ctx_.rank) + ", " + ctx_.params->strategy() + ", after step " +
                   std::to_string(r.step) + "): " + describe_memory(mem_));
    }
    if (ctx_.rank == 0) {
      const auto& c = mem_.by_category;
      if (ctx_.metrics) {
        // step, loss, lr, grad_norm first and tokens_per_sec next, as before:
        // tools compare runs on the deterministic prefix of each record.
        std::vector<std::pair<std::string, double>> rec = {
            {"step", r.step},           {"loss", r.loss},
            {"lr", r.lr},               {"grad_norm", r.grad_norm},
            {"tokens_per_sec", tps},    {"ms_per_step", ms},
            {"mfu", u},                 {"elapsed_sec", since(ctx_.start)},
            {"mem_peak_bytes", mem_.peak},
            {"mem_params_bytes", c.params},
            {"mem_grads_bytes", c.grads},
            {"mem_optimizer_bytes", c.optimizer},
            {"mem_activations_bytes", c.activations},
            {"mem_comm_bytes", c.comm},
            {"mem_workspace_bytes", c.workspace}};
        if (mem_.host > 0) rec.push_back({"mem_host_bytes", mem_.host});
        if (mem_.disk > 0) rec.push_back({"mem_nvme_bytes", mem_.disk});
        if (r.val_loss >= 0) rec.push_back({"val_loss", r.val_loss});
        if (bpb >= 0) rec.push_back({"val_bpb", bpb});
        if (window_tp_comm_ >= 0) {
          // Rank 0's time inside TP collectives, per step over the window, and its share of the step.
          rec.push_back({"tp_comm_ms", 1000 * window_tp_comm_ / std::max(1, window_steps_)});
          rec.push_back({"tp_comm_fraction", window_tp_comm_ / std::max(1e-9, window_seconds_)});
        }
        if (r.bubble >= 0) rec.push_back({"pipeline_bubble", r.bubble});
        rec.insert(rec.end(), r.extra.begin(), r.extra.end());
        add_router_figures(rec, "moe_", "_");
        ctx_.metrics->write(rec);
      }
      if (tb_) {
        constexpr double MiB = 1024.0 * 1024.0;
        std::vector<std::pair<std::string, double>> s = {
            {"loss/train", r.loss},
            {"opt/lr", r.lr},
            {"opt/grad_norm", r.grad_norm},
            {"perf/tokens_per_sec", tps},
            {"perf/mfu", u},
            {"perf/ms_per_step", ms},
            {"memory/peak_mib", mem_.peak / MiB},
            {"memory/params_mib", c.params / MiB},
            {"memory/grads_mib", c.grads / MiB},
            {"memory/optimizer_mib", c.optimizer / MiB},
            {"memory/activations_mib", c.activations / MiB},
            {"memory/comm_mib", c.comm / MiB},
            {"memory/workspace_mib", c.workspace / MiB}};
        if (r.val_loss >= 0) s.push_back({"loss/val", r.val_loss});
        s.insert(s.end(), r.extra.begin(), r.extra.end());
        if (bpb >= 0) s.push_back({"loss/val_bpb", bpb});
        add_router_figures(s, "moe/", "/");
        tb_->add_scalars(r.step, s);
      }
    }
    window_seconds_ = window_comm_ = 0;
    if (window_tp_comm_ >= 0) window_tp_comm_ = 0;
    window_steps_ = 0;
  }
  draw_status(r.last);
}

void RunReporter::note_checkpoint(const std::string& path) { last_checkpoint_ = path; }

void RunReporter::finish(const std::string& model_path) {
  if (ctx_.rank != 0) return;
  clear_status();
  if (live_) set_log_prefix("");
  live_ = false;
  const fs::path out(ctx_.job->output.dir);
  std::string plot_note;
  if (opt_.plot && ctx_.metrics) {
    try {
      plot_path_ = plot_run(out.string());
    } catch (const Error& e) {
      TR_LOG_WARN(e.what(), " (the run itself is complete)");
      plot_note = "none (see the warning above)";
    }
  }
  std::string ckpt = last_checkpoint_;
  if (ckpt.empty()) {
    // The checkpointer's pointer to its newest complete checkpoint.
    std::ifstream latest(out / "checkpoints" / "latest");
    std::string name;
    if (latest >> name && !name.empty()) ckpt = (out / "checkpoints" / name).string();
  }
  if (steps_done_ == 0) mem_ = measure_memory(*ctx_.backend, *ctx_.params, *ctx_.network);
  const double wall = since(ctx_.start);
  const double tps = mean_tokens_per_sec();
  const int max_steps = ctx_.job->train.max_steps;
  const auto& c = mem_.by_category;
  constexpr double MiB = 1024.0 * 1024.0;
  const std::string rule(64, '-');
  std::ostringstream s;
  s << "run summary " << rule.substr(12) << "\n";
  if (steps_done_ == 0) s << "steps       none in this run (train.max_steps " << max_steps << " reached before it)";
  else s << "steps       " << last_step_ << "/" << max_steps;
  if (first_step_ > 1) s << " (resumed from the checkpoint of step " << first_step_ - 1 << ")";
  s << ", " << with_commas(int64_t(steps_done_) * ctx_.tokens_per_step) << " tokens in this run ("
    << with_commas(ctx_.tokens_per_step) << " per step)\n";
  s << "time        " << hms(wall) << " wall: " << hms(train_seconds_) << " training, "
    << hms(std::max(0.0, wall - train_seconds_)) << " setup, evaluation, saving\n";
  s << "throughput  " << with_commas(int64_t(tps + 0.5)) << " tok/s mean";
  if (peak_.flops > 0)
    s << ", MFU " << fixed(100 * mfu(tps), 1) << "% of " << flops_str(peak_.flops) << " x " << ctx_.world << " rank"
      << (ctx_.world == 1 ? "" : "s") << " (" << peak_.source << ")";
  s << "\n";
  s << "loss        final " << fixed(last_loss_, 4);
  if (best_val_ >= 0) {
    s << "; best val_loss " << fixed(best_val_, 4);
    if (const double bpb = bits_per_byte(best_val_, ctx_.val_tokens_per_byte); bpb >= 0)
      s << " (" << fixed(bpb, 4) << " bits/byte)";
    s << " at step " << best_val_step_;
  }
  if (ctx_.entropy_floor >= 0) s << "; entropy floor " << fixed(ctx_.entropy_floor, 4);
  s << "\n";
  s << "memory      rank 0 peak " << format_bytes(mem_.peak) << " (MiB: params " << fixed(c.params / MiB, 1) << ", grads "
    << fixed(c.grads / MiB, 1) << ", optimizer " << fixed(c.optimizer / MiB, 1) << ", activations "
    << fixed(c.activations / MiB, 1) << ", comm " << fixed(c.comm / MiB, 1) << ", workspace "
    << fixed(c.workspace / MiB, 1) << ")\n";
  s << "outputs     " << out.string() << "/\n";
  if (!model_path.empty()) s << "  weights     " << model_path << "\n";
  s << "  checkpoint  " << (ckpt.empty() ? "none" : ckpt) << "\n";
  if (ctx_.metrics) s << "  metrics     " << (out / "metrics.jsonl").string() << "\n";
  if (!plot_path_.empty() || !plot_note.empty())
    s << "  plot        " << (plot_path_.empty() ? plot_note : plot_path_) << "\n";
  if (tb_) s << "  tensorboard tensorboard --logdir " << tb_dir_ << "\n";
  s << rule;
  TR_LOG_INFO(s.str());
}

// Mixture of experts: the network's router figures of the step's last
// micro-batch on rank 0 (Network::RouterReport): the load-balancing and z
// losses (unscaled) and per layer the busiest expert's tokens and the mean
// per expert. metrics.jsonl: moe_aux_loss, moe_z_loss, moe_layer<l>_tokens_max /
// _tokens_mean; TensorBoard: moe/aux_loss, moe/z_loss, moe/layer<l>/load_max_over_mean.
void RunReporter::add_router_figures(std::vector<std::pair<std::string, double>>& rec, const std::string& prefix,
                                     const std::string& sep) const {
  if (!ctx_.network) return;
  const Network::RouterReport m = ctx_.network->router_report();
  if (m.max_tokens.empty()) return;
  rec.push_back({prefix + "aux_loss", m.aux_loss});
  rec.push_back({prefix + "z_loss", m.z_loss});
  for (size_t l = 0; l < m.max_tokens.size(); ++l) {
    const std::string layer = prefix + "layer" + std::to_string(l) + sep;
    if (sep == "/") {
      rec.push_back({layer + "load_max_over_mean", m.mean_tokens[l] > 0 ? m.max_tokens[l] / m.mean_tokens[l] : 0});
    } else {
      rec.push_back({layer + "tokens_max", m.max_tokens[l]});
      rec.push_back({layer + "tokens_mean", m.mean_tokens[l]});
    }
  }
}

}  // namespace trainrun
