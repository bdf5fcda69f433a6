// `trainrun bench pipeline` (bench_pipeline.h).
#include "core/train/bench_pipeline.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/train/planner.h"
#include "parallel/pipeline/schedule.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

struct JobResult {
  double ms = 0;
  std::map<int, double> wait;  // step -> pipeline_bubble (w, the idle share)
  PipelineTraceTimes trace;    // pp > 1
};

// A bubble as the idle share of ranks x span (what the trainer and the
// simulator give) -> idle / busy, the formulas' ratio.
double idle_over_busy(double share) { return share < 1 ? share / (1 - share) : 0; }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double field(const std::string& line, const std::string& key) {
  const auto p = line.find("\"" + key + "\":");
  return p == std::string::npos ? -1 : std::atof(line.c_str() + p + key.size() + 3);
}

JobResult run_job(const PipelineBenchOptions& o, const fs::path& dir, int pp, const std::string& schedule, int v) {
  const int gbs = o.microbatches * o.micro_batch;
  // Every step after the warm-up is traced: the model's op times are their means.
  std::string traced;
  for (int k = 3; k <= o.steps; ++k) traced += (k > 3 ? ", " : "") + std::to_string(k);
  std::ostringstream y;
  y << "backend: cpu\n"
    << "model: {arch: gpt2, n_layer: " << o.layers << ", n_head: 4, n_embd: " << o.width
    << ", vocab_size: 64, seq_len: " << o.seq_len << "}\n"
    << "data: {format: synthetic, synthetic: {vocab: 64}}\n"
    << "train: {global_batch_size: " << gbs << ", micro_batch_size: " << o.micro_batch << ", max_steps: " << o.steps
    << ", warmup_steps: 1, log_interval: 1, eval_interval: 0}\n"
    << "parallel: {nproc_per_node: " << pp << ", pipeline_parallel: " << pp << ", pipeline_schedule: " << schedule
    << ", pipeline_virtual_stages: " << v << ", sharding: no_shard, timeout_s: 120}\n"
    << "checkpoint: {final: false}\n"
    << "output: {dir: '" << (dir / "run").string() << "', sample_tokens: 0, trace_steps: [" << traced << "]}\n";
  fs::remove_all(dir / "run");
  {
    std::ofstream f(dir / "job.yaml");
    f << y.str();
  }
  // This binary (the shell std::system runs would be /proc/self/exe there).
  static const std::string self = fs::read_symlink("/proc/self/exe").string();
  const std::string cmd = "OMP_NUM_THREADS=1 TRAINRUN_PLOT=0 TRAINRUN_TENSORBOARD=0 '" + self + "' --config '" +
                          (dir / "job.yaml").string() + "' > '" + (dir / "log.txt").string() + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  TR_CHECK(rc == 0, "bench pipeline: the ", schedule, " job (pp", pp, ") failed (exit ", rc, "); see ",
           (dir / "log.txt").string());
  std::ifstream m(dir / "run" / "metrics.jsonl");
  std::vector<double> ms;
  JobResult res;
  for (std::string line; std::getline(m, line);) {
    const int step = int(field(line, "step"));
    if (step <= 2) continue;  // warm-up
    ms.push_back(field(line, "ms_per_step"));
    if (field(line, "pipeline_bubble") >= 0) res.wait[step] = field(line, "pipeline_bubble");
  }
  TR_CHECK(!ms.empty(), "bench pipeline: no steps after the warm-up in ", (dir / "run/metrics.jsonl").string(),
           "; raise --steps");
  res.ms = median(ms);
  if (pp > 1) res.trace = read_pipeline_trace((dir / "run" / "trace.json").string());
  return res;
}

}  // namespace

PipelineTraceTimes read_pipeline_trace(const std::string& path) {
  std::ifstream f(path);
  TR_CHECK(f, "bench pipeline: no trace at ", path, " (the job ran without output.trace_steps?)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    TR_FAIL("bench pipeline: ", path, " is not JSON: ", e.what());
  }
  TR_CHECK(j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array(), "bench pipeline: ", path,
           " has no traceEvents array (not a trainrun trace)");
  PipelineTraceTimes t;
  std::map<std::pair<int, PipeOp>, std::vector<double>> all;
  for (const auto& ev : j["traceEvents"]) {
    if (ev.value("ph", "") != "X" || ev.value("cat", "") != "compute") continue;
    const std::string name = ev.value("name", "");
    const size_t mb = name.find(" mb"), st = name.find(" stage ");
    // The one-rank trainer's spans ("forward mb3") name no stage: not a pipeline's.
    if (mb == std::string::npos || st == std::string::npos) continue;
    const std::string what = detail::cat("bench pipeline: ", path, ": span '", name, "'");
    TR_CHECK(ev.contains("dur") && ev.contains("args") && ev["args"].contains("step"), what,
             " has no dur or args.step");
    PipeOp op;
    TR_CHECK(pipe_op_from_span_name(name.substr(0, mb), &op), what, ": unknown compute span '", name.substr(0, mb),
             "'");
    const int micro = std::atoi(name.c_str() + mb + 3), stage = std::atoi(name.c_str() + st + 7);
    const double ms = ev["dur"].get<double>() / 1000.0;
    t.steps[ev["args"]["step"].get<int>()][{stage, op, micro}] = ms;
    all[{stage, op}].push_back(ms);
  }
  TR_CHECK(!t.steps.empty(), "bench pipeline: ", path, " holds no pipeline compute spans");
  int n = 0;
  for (const auto& [k, v] : all) {
    double sum = 0, sq = 0;
    for (double x : v) sum += x;
    const double mean = sum / double(v.size());
    t.mean[k] = mean;
    if (v.size() < 2 || mean <= 0) continue;
    for (double x : v) sq += (x - mean) * (x - mean);
    t.cv += std::sqrt(sq / double(v.size())) / mean;
    ++n;
  }
  if (n > 0) t.cv /= n;
  return t;
}

std::map<int, double> replay_traced_steps(const PipelineSchedule& s, const PipelineTraceTimes& t) {
  std::map<int, double> out;
  for (const auto& [step, ops] : t.steps) {
    const double share = replay_pipeline_schedule(s, [&, step = step](const PipeAction& a) {
      const auto it = ops.find({a.stage, a.op, a.microbatch});
      TR_CHECK(it != ops.end(), "bench pipeline: the trace of step ", step, " has no ", pipe_op_name(a.op),
               " of microbatch ", a.microbatch, " on stage ", a.stage, " (a ", s.kind, " schedule with ", s.ranks,
               " ranks, ", s.virtual_stages, " virtual stages, ", s.microbatches, " microbatches)");
      return it->second;
    }, 0.0).bubble;
    out[step] = idle_over_busy(share);
  }
  return out;
}

int run_pipeline_bench(const PipelineBenchOptions& o) {
  const int p = o.stages, m = o.microbatches;
  TR_CHECK(p >= 2 && m >= p && o.steps >= 3 && o.layers >= 2 * p, "bench pipeline: needs --stages >= 2, "
           "--microbatches >= stages, --steps >= 3 and layers >= 2 x stages");
  const fs::path dir = fs::temp_directory_path() / ("trainrun-bench-pipeline-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::printf("pipeline bench: gpt2 L=%d C=%d T=%d, micro-batch %d, m=%d microbatches, p=%d stages (one core "
              "each), %d steps (first 2 left out), CPU backend\n",
              o.layers, o.width, o.seq_len, o.micro_batch, m, p, o.steps);
  const JobResult base = run_job(o, dir, 1, "1f1b", 1);
  std::printf("%-18s %3s %8s %8s %8s %8s %8s %7s %9s %7s  %s\n", "schedule", "v", "bubble", "formula", "model",
              "replay", "runtime", "op cv", "step ms", "vs pp1",
              "measured ms per op and stage (mean of the steps after the warm-up)");
  std::printf("%-18s %3s %8s %8s %8s %8s %8s %7s %9.1f %7s\n", "pp1 (one rank)", "-", "-", "-", "-", "-", "-", "-",
              base.ms, "1.00x");
  struct Row {
    const char* kind;
    int v;
  };
  const std::vector<Row> rows = {{"gpipe", 1}, {"1f1b", 1}, {"interleaved_1f1b", 2}, {"zero_bubble", 1}};
  auto pct = [](double x) {  // x < 0: none
    char b[32];
    if (x < 0) return std::string("-");
    std::snprintf(b, sizeof b, "%.1f%%", 100 * x);
    return std::string(b);
  };
  auto points = [](double x) {  // percentage points, signed
    char b[32];
    std::snprintf(b, sizeof b, "%+.1f", 100 * x);
    return std::string(b);
  };
  for (const Row& r : rows) {
    if (r.v > 1 && (m % p != 0 || m < p * r.v || o.layers < p * r.v)) continue;
    const JobResult j = run_job(o, dir, p, r.kind, r.v);
    const PipelineSchedule sched = make_pipeline_schedule(r.kind, p, r.v, m);
    std::vector<double> measured, replayed, runtime;
    for (const auto& [step, w] : j.wait) measured.push_back(idle_over_busy(w));
    std::string costs;
    for (const auto& [k, ms] : j.trace.mean)
      costs += detail::cat(" ", pipe_op_name(k.second), k.first, "=", int(ms * 10 + 0.5) / 10.0);
    double model = -1;
    try {
      const double share = simulate_pipeline_schedule(sched, [&](int stage, PipeOp op) {
        const auto it = j.trace.mean.find({stage, op});
        TR_CHECK(it != j.trace.mean.end(), "bench pipeline: the trace has no ", pipe_op_name(op), " on stage ", stage);
        return it->second;
      }, 0.0).bubble;
      model = idle_over_busy(share);
      for (const auto& [step, b] : replay_traced_steps(sched, j.trace)) {
        replayed.push_back(b);
        const auto w = j.wait.find(step);
        if (w != j.wait.end()) runtime.push_back(idle_over_busy(w->second) - b);
      }
    } catch (const Error& e) {
      costs += detail::cat(" (no model: ", e.what(), ")");
    }
    const double formula = pipeline_bubble_formula(r.kind, p, r.v, m);
    std::printf("%-18s %3d %8s %8s %8s %8s %8s %7s %9.1f %6.2fx  %s\n", r.kind, r.v, pct(median(measured)).c_str(),
                pct(formula).c_str(), pct(model).c_str(), pct(replayed.empty() ? -1 : median(replayed)).c_str(),
                runtime.empty() ? "-" : points(median(runtime)).c_str(),
                pct(j.trace.cv).c_str(), j.ms, base.ms / j.ms, costs.c_str());
    std::fflush(stdout);
  }
  std::printf("bubble: measured idle / busy of the step (the ranks' mean wait w as w / (1 - w)), median over the "
              "steps; formula: (p-1)/m, (p-1)/(v m), (p-1)/(3m) (equal stages, F = BI = BW, free p2p); model: the "
              "schedule simulated with the measured mean op time per stage and free p2p; replay: each traced step "
              "replayed with every op's own measured time and free p2p (a runtime with no overhead over the same "
              "ops; replay - model is the op-time noise's share); runtime: bubble - replay, step by step, in points "
              "(what the runtime adds); op cv: stdev / mean of one op's times; vs pp1: pp1's step time / this one's\n");
  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}

}  // namespace trainrun
