// `trainrun bench pipeline` (bench_pipeline.h).
#include "core/train/bench_pipeline.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <vector>

#include "core/common/error.h"
#include "core/train/planner.h"
#include "parallel/pipeline/schedule.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

struct JobResult {
  double ms = 0, wait = 0;
  // The traced steps' compute spans: mean ms per (virtual stage, op).
  std::map<std::pair<int, PipeOp>, double> cost;
};

// output.trace_steps' file (core/common/trace.h, written by this binary, so
// its layout is known): every compute span's op, virtual stage and length,
// averaged per (stage, op). Names are "<op> mb<m> stage <s>".
std::map<std::pair<int, PipeOp>, double> compute_costs(const fs::path& trace) {
  std::ifstream f(trace);
  TR_CHECK(f, "bench pipeline: no trace at ", trace.string(), " (the job ran without output.trace_steps?)");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::map<std::pair<int, PipeOp>, std::pair<double, int>> sum;
  const std::string key = "{\"name\":\"";
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) {
    const size_t end = text.find('}', at);
    const std::string ev = text.substr(at, end - at);
    if (ev.find("\"cat\":\"compute\"") == std::string::npos) continue;
    const std::string name = ev.substr(key.size(), ev.find('"', key.size()) - key.size());
    const size_t mb = name.find(" mb"), st = name.find(" stage ");
    const size_t dur = ev.find("\"dur\":");
    if (mb == std::string::npos || st == std::string::npos || dur == std::string::npos) continue;
    const std::string op = name.substr(0, mb);
    const PipeOp o = op == "forward" ? PipeOp::F : op == "backward" ? PipeOp::B
                     : op == "backward_input" ? PipeOp::BI : PipeOp::BW;
    auto& acc = sum[{std::atoi(name.c_str() + st + 7), o}];
    acc.first += std::atof(ev.c_str() + dur + 6) / 1000.0;
    acc.second += 1;
  }
  std::map<std::pair<int, PipeOp>, double> out;
  for (const auto& [k, v] : sum) out[k] = v.first / v.second;
  return out;
}

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
  std::vector<double> ms, wait;
  for (std::string line; std::getline(m, line);) {
    if (field(line, "step") <= 2) continue;  // warm-up
    ms.push_back(field(line, "ms_per_step"));
    if (field(line, "pipeline_bubble") >= 0) wait.push_back(field(line, "pipeline_bubble"));
  }
  TR_CHECK(!ms.empty(), "bench pipeline: no steps after the warm-up in ", (dir / "run/metrics.jsonl").string(),
           "; raise --steps");
  JobResult res{median(ms), median(wait), {}};
  if (pp > 1) res.cost = compute_costs(dir / "run" / "trace.json");
  return res;
}

}  // namespace

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
  std::printf("%-18s %4s %10s %10s %10s %12s %10s  %s\n", "schedule", "v", "bubble", "formula", "model",
              "step ms", "vs pp1", "measured ms per op and stage (mean of the steps after the warm-up)");
  std::printf("%-18s %4s %10s %10s %10s %12.1f %10s\n", "pp1 (one rank)", "-", "-", "-", "-", base.ms, "1.00x");
  struct Row {
    const char* kind;
    int v;
  };
  const std::vector<Row> rows = {{"gpipe", 1}, {"1f1b", 1}, {"interleaved_1f1b", 2}, {"zero_bubble", 1}};
  for (const Row& r : rows) {
    if (r.v > 1 && (m % p != 0 || m < p * r.v || o.layers < p * r.v)) continue;
    const JobResult j = run_job(o, dir, p, r.kind, r.v);
    const double bubble = j.wait < 1 ? j.wait / (1 - j.wait) : 0;
    // The model: this schedule run with the traced step's per-stage op
    // times and free p2p; measured - model is what the runtime and the
    // transfers add, model - formula what the stage costs do (uneven
    // stages; BW cheaper than F, which ZB-H1's formula assumes equal).
    const PipelineSchedule sched = make_pipeline_schedule(r.kind, p, r.v, m);
    std::string costs;
    for (const auto& [k, ms] : j.cost)
      costs += detail::cat(" ", pipe_op_name(k.second), k.first, "=", int(ms * 10 + 0.5) / 10.0);
    double model = -1;
    try {
      const double share = simulate_pipeline_schedule(sched, [&](int stage, PipeOp op) {
        const auto it = j.cost.find({stage, op});
        TR_CHECK(it != j.cost.end(), "bench pipeline: the trace has no ", pipe_op_name(op), " on stage ", stage);
        return it->second;
      }, 0.0).bubble;
      model = share / (1 - share);
    } catch (const Error& e) {
      costs += detail::cat(" (no model: ", e.what(), ")");
    }
    std::printf("%-18s %4d %9.1f%% %9.1f%% %9.1f%% %12.1f %9.2fx  %s\n", r.kind, r.v, 100 * bubble,
                100 * pipeline_bubble_formula(r.kind, p, r.v, m), 100 * model, j.ms, base.ms / j.ms, costs.c_str());
    std::fflush(stdout);
  }
  std::printf("bubble: measured idle / busy share of the step (the ranks' mean wait w as w / (1 - w)); formula: "
              "(p-1)/m, (p-1)/(v m), (p-1)/(3m) (equal stages, F = BI = BW, free p2p); model: the schedule "
              "simulated with the measured op times per stage and free p2p, the same ratio; vs pp1: pp1's "
              "step time / this one's\n");
  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}

}  // namespace trainrun
