// `trainrun bench pipeline` (bench_pipeline.h).
#include "core/train/bench_pipeline.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include "core/common/error.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

struct JobResult {
  double ms = 0, wait = 0;
};

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
  std::ostringstream y;
  y << "backend: cpu\n"
    << "model: {arch: gpt2, n_layer: " << o.layers << ", n_head: 4, n_embd: " << o.width
    << ", vocab_size: 512, seq_len: " << o.seq_len << "}\n"
    << "data: {format: synthetic, synthetic: {vocab: 512}}\n"
    << "train: {global_batch_size: " << gbs << ", micro_batch_size: " << o.micro_batch << ", max_steps: " << o.steps
    << ", warmup_steps: 1, log_interval: 1, eval_interval: 0}\n"
    << "parallel: {nproc_per_node: " << pp << ", pipeline_parallel: " << pp << ", pipeline_schedule: " << schedule
    << ", pipeline_virtual_stages: " << v << ", sharding: no_shard, timeout_s: 120}\n"
    << "checkpoint: {final: false}\n"
    << "output: {dir: '" << (dir / "run").string() << "', sample_tokens: 0}\n";
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
  return {median(ms), median(wait)};
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
  std::printf("%-18s %4s %10s %10s %12s %10s\n", "schedule", "v", "bubble", "formula", "step ms", "vs pp1");
  std::printf("%-18s %4s %10s %10s %12.1f %10s\n", "pp1 (one rank)", "-", "-", "-", base.ms, "1.00x");
  struct Row {
    const char* kind;
    int v;
    double formula;
  };
  const std::vector<Row> rows = {{"gpipe", 1, double(p - 1) / m},
                                 {"1f1b", 1, double(p - 1) / m},
                                 {"interleaved_1f1b", 2, double(p - 1) / (2.0 * m)},
                                 {"zero_bubble", 1, double(p - 1) / (3.0 * m)}};
  for (const Row& r : rows) {
    if (r.v > 1 && (m % p != 0 || m < p * r.v || o.layers < p * r.v)) continue;
    const JobResult j = run_job(o, dir, p, r.kind, r.v);
    const double bubble = j.wait < 1 ? j.wait / (1 - j.wait) : 0;
    std::printf("%-18s %4d %9.1f%% %9.1f%% %12.1f %9.2fx\n", r.kind, r.v, 100 * bubble, 100 * r.formula, j.ms,
                base.ms / j.ms);
    std::fflush(stdout);
  }
  std::printf("bubble: measured idle / busy share of the step (the ranks' mean wait w as w / (1 - w)); formula: "
              "(p-1)/m, (p-1)/(v m), (p-1)/(3m); vs pp1: pp1's step time / this one's\n");
  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}

}  // namespace trainrun
