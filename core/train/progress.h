// What a person watching a run sees, and what the run leaves behind for
// them: the live status line (or plain log lines), MFU, memory by category,
// metrics.jsonl records, TensorBoard scalars, the end-of-run summary and plot.
//
// The trainer makes one RunReporter per worker and hands it each step's
// figures; the reporter decides what to print and write. Rank 0 reports,
// other ranks only keep their counters (TRAINRUN_LOG_ALL_RANKS=1 makes every
// rank print, for debugging).
//
// Live vs plain: when rank 0's stderr is a terminal, one status line is
// redrawn in place every step (step/total, loss, tokens/s, MFU, memory,
// elapsed, ETA) and the log_interval lines scroll above it; otherwise
// (Slurm logs, CI) only the plain lines are printed, with the same fields.
// TRAINRUN_PROGRESS=live|plain|auto overrides the detection.
// Under the agent a worker's output is a pipe, so when the agent's own
// stderr is a terminal it starts rank 0 with TRAINRUN_PROGRESS=relay: the
// status line then travels as a line starting with kStatusLineMarker, which
// the agent draws in place on its terminal and keeps out of the rank's log
// (core/launch/agent.cpp).
//
// Why hand-written: Debian packages no C or C++ progress-bar library (only
// Go, Perl, Python and Ruby ones; `indicators` is not packaged), and the
// whole mechanism is "\r", "erase line" and a width clip.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/train/planner.h"
#include "kernels/backend.h"

namespace trainrun {

class MetricsWriter;
class ParamStore;
class TensorBoardWriter;

// ---- peak FLOP/s (the MFU denominator) -------------------------------------------------

struct PeakFlops {
  double flops = 0;    // per device (per rank)
  std::string source;  // "H100 SXM 80GB bf16 dense (datasheet)", "measured: fp32 sgemm 1024^3, 2 threads"
};

// Best FLOP/s of the backend's matmul_forward on n x n x n products (a few
// repetitions after a warm-up). Allocates 3 n^2 buffers on `be`.
double measure_matmul_flops(Backend& be, int n);

// The peak a rank of this backend is measured against: the datasheet's
// dense bf16 figure when the backend names a known GPU (A100/H100/H200),
// else a measurement. The CPU backend's peak is OpenBLAS sgemm at the
// current OpenMP thread count, measured once per process on a scratch CPU
// backend (so the training backend's memory counters stay untouched) and
// cached; ~0.1-0.3 s.
PeakFlops device_peak_flops(Backend& be);

// ---- memory -----------------------------------------------------------------------------

// A rank's measured bytes: the categories of MemoryBreakdown (planner.h),
// with `workspace` = the backend's peak minus the named categories
// (inputs, scratch, pooled buffers beyond their live peak), so the
// categories add up to `peak`.
struct MemoryReport {
  MemoryBreakdown by_category;
  double peak = 0;         // backend peak_bytes()
  double in_use = 0;       // backend bytes_in_use()
  double host = 0;         // parallel.offload's host memory (not in the device's categories)
  double disk = 0;         // parallel.offload nvme: bytes of its state files
};
MemoryReport measure_memory(const Backend& be, const ParamStore& params, const Network& model);
std::string describe_memory(const MemoryReport& m);  // "peak 45.1 MiB: params 1.2 MiB, grads ..."

// ---- the reporter ---------------------------------------------------------------------------

// First byte of a relayed status line (ASCII record separator: never in a log line).
constexpr char kStatusLineMarker = '\x1e';
// Columns of the terminal on stderr ($COLUMNS, else 120, when it says nothing).
int terminal_width();

struct ProgressOptions {
  enum class Mode { Auto, Live, Plain, Relay } mode = Mode::Auto;
  bool all_ranks = false;    // every rank prints (debugging)
  bool rank_prefix = true;   // "[rank N] " on all_ranks lines; off under the agent, which adds its own
  bool plot = true;          // draw plot.svg at the end (rank 0)
  bool tensorboard = true;   // <output.dir>/tb event files (rank 0)
  // TRAINRUN_PROGRESS=auto|live|plain|relay, TRAINRUN_LOG_ALL_RANKS=1,
  // TRAINRUN_AGENT_ECHO=1 (set by the agent: it prefixes and echoes the lines),
  // TRAINRUN_PLOT=0, TRAINRUN_TENSORBOARD=0. Throws Error on other values.
  static ProgressOptions from_env();
};

// One step's figures, as the trainer has them.
struct StepReport {
  int step = 0;                  // 1-based, the step just finished
  double loss = 0, lr = 0, grad_norm = 0;
  double step_seconds = 0;       // the training step (not eval)
  double comm_wait_seconds = 0;  // of which waiting on collectives
  double tp_comm_seconds = -1;   // of which inside TP activation collectives (tensor_parallel > 1); < 0: no TP
  double val_loss = -1;          // >= 0 when this step was evaluated
  double bubble = -1;            // pipeline: the ranks' mean share of the step spent waiting on peers; -1 = none
  bool last = false;             // the last step this process runs (max_steps, or an early exit)
  // More figures under their own names, in metrics.jsonl and TensorBoard
  // (the preference objectives' rewards/chosen, ... as TRL names them).
  std::vector<std::pair<std::string, double>> extra;
};

class RunReporter {
 public:
  struct Context {
    const JobSpec* job = nullptr;
    const ModelArch* arch = nullptr;     // the model's description (FLOPs per token for MFU)
    Backend* backend = nullptr;
    const ParamStore* params = nullptr;
    const Network* network = nullptr;   // its activation bytes
    int rank = 0, world = 1;
    int64_t tokens_per_step = 0;
    double entropy_floor = -1;          // the data's loss floor, when known
    double val_tokens_per_byte = -1;    // data.val's tokens per byte of text (prepare.json); > 0: val bits per byte
    MetricsWriter* metrics = nullptr;   // rank 0's metrics.jsonl (the trainer owns it)
    // > 0: the model FLOPs per token instead of arch->flops_per_token(), and
    // how they are counted (model.adapter: the frozen base's forward and
    // input gradient, 4N, plus 6 per adapter parameter).
    double flops_per_token = 0;
    std::string flops_formula;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  };
  explicit RunReporter(const Context& ctx, const ProgressOptions& opt = ProgressOptions::from_env());
  ~RunReporter();

  // After every step on every rank. Prints the status line / log line and
  // writes a metrics.jsonl record and TensorBoard scalars on the first step,
  // every train.log_interval steps, the last step, and every evaluated step.
  void on_step(const StepReport& r);
  // Where the latest checkpoint went, for the summary.
  void note_checkpoint(const std::string& path);
  // End of the run (rank 0 prints): the one-screen summary, then plot.svg.
  // Plotting problems are warnings: a run that trained is never failed by them.
  void finish(const std::string& model_path);

  // Figures for tests and the summary.
  double peak_flops() const { return peak_.flops; }
  const MemoryReport& memory() const { return mem_; }
  double mean_tokens_per_sec() const;
  double mfu(double tokens_per_sec) const;
  bool live() const { return live_; }
  // The status line as it would be drawn (no escapes, not clipped).
  std::string status_line() const;

 private:
  void add_router_figures(std::vector<std::pair<std::string, double>>& rec, const std::string& prefix,
                          const std::string& sep) const;
  bool printing() const { return ctx_.rank == 0 || opt_.all_ranks; }
  void draw_status(bool force);
  void clear_status();
  void print_line(const std::string& line);
  std::string elapsed_eta() const;

  Context ctx_;
  ProgressOptions opt_;
  bool live_ = false;
  bool relay_ = false;  // live, drawn by the agent: marked lines on stderr
  PeakFlops peak_;
  double flops_per_token_ = 0;
  MemoryReport mem_;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::string tb_dir_, plot_path_, last_checkpoint_;
  // counters
  int steps_done_ = 0, last_step_ = 0, first_step_ = 0;
  double train_seconds_ = 0, window_seconds_ = 0, window_comm_ = 0, window_tp_comm_ = -1;
  int window_steps_ = 0;
  double ema_step_seconds_ = 0;
  double last_loss_ = 0, best_val_ = -1;
  int best_val_step_ = 0;
  std::chrono::steady_clock::time_point first_step_end_, last_draw_;
  bool status_drawn_ = false;
  int term_width_ = 0;
};

}  // namespace trainrun
