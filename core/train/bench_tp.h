// `trainrun bench comm`'s tensor-parallel step rows: the benchmark model
// trained a few steps at tp 1 and at tp N on this machine (ranks are
// threads of this process talking Gloo over loopback, as in the tests),
// with the step time and the share of it spent inside TP collectives
// (TensorParallel's accumulated clock, metrics.jsonl tp_comm_ms).
#pragma once
#include <string>
#include <vector>

namespace trainrun {

struct TpStepBenchOptions {
  int tp = 2;             // the TP degree compared with tp 1
  int steps = 4;          // training steps per mesh (the first, warm-up, is not counted)
  std::string config;     // a job spec for the model and batch; "" = the CPU benchmark model (configs/bench_cpu.yaml)
  int threads = 0;        // cores shared by the ranks (OpenMP threads: threads / ranks each); 0 = all
};

struct TpStepRow {
  int tp = 1, ranks = 1, threads_per_rank = 1;
  double step_ms = 0;      // median over the counted steps
  double tp_comm_ms = 0;   // median time inside TP collectives per step (0 at tp 1)
  double tp_comm_fraction = 0;  // tp_comm_ms / step_ms, in [0, 1]
};

// Runs the model at tp 1 and tp `o.tp`; throws Error naming what failed.
std::vector<TpStepRow> run_tp_step_bench(const TpStepBenchOptions& o, std::string* model_description);
std::string format_tp_step_table(const std::vector<TpStepRow>& rows, const std::string& model_description);

}  // namespace trainrun
