// `trainrun bench pipeline`: each pipeline schedule's measured bubble next
// to its formula, and its step time against one rank (pp1) at the same
// global batch, on the CPU backend with one core per stage.
//
// Every row is a real job: this binary re-run on a small GPT-2 (synthetic
// data, OMP_NUM_THREADS=1 per rank) for a few steps, with a vocabulary of
// 64 so the last stage's head and loss (which the formulas leave out) stay
// under 1% of a stage; the first steps
// (warm-up) are left out and the medians of the rest are shown. The
// measured bubble is 1 - the ranks' mean compute / the slowest rank's span
// of the schedule, timed on the compute stream (metrics.jsonl's
// pipeline_bubble, w; PipelineExecutor::last_step_times), shown as idle / busy =
// w / (1 - w) so it reads against the formulas: (p-1)/m for gpipe and 1f1b,
// (p-1)/(v m) interleaved, (p-1)/(3m) ZB-H1 (which assumes F = B = W).
// The steps after the warm-up are traced (output.trace_steps) and three
// more columns come from those traces:
//  - model: each schedule simulated with the measured mean time per
//    (stage, op) and free p2p (simulate_pipeline_schedule with costs): the
//    bubble the stage costs alone give (uneven stages; ZB-H1's BW cheaper
//    than F), so model - formula is the stage costs' share;
//  - replay: each traced step replayed with every action's own measured
//    time (replay_pipeline_schedule) and free p2p, the median over the
//    steps: what a runtime with no overhead would have measured over the
//    very same ops, whose times vary from one microbatch to the next (a
//    slow op makes its peer wait, and the waits do not cancel), so
//    replay - model is the op-time noise's share;
//  - runtime: the measured bubble minus the replay's, step by step (the
//    median): what the runtime itself adds (transfers, thread hand-offs,
//    stages that start the step apart), the part a faster runtime could
//    remove; and "op cv", the noise: stdev / mean of one op's times.
#pragma once
#include <map>
#include <string>
#include <tuple>

#include "parallel/pipeline/schedule.h"

namespace trainrun {

struct PipelineBenchOptions {
  int stages = 2;         // p (ranks; one core each)
  int microbatches = 8;   // m (the accumulation count)
  int steps = 8;          // steps per job; the first 2 are warm-up
  int layers = 8, width = 256, seq_len = 128, micro_batch = 2;  // the GPT-2 measured
};

int run_pipeline_bench(const PipelineBenchOptions& o);

// A run's trace.json (output.trace_steps, core/common/trace.h) read back:
// the compute spans' times, in ms. Spans are named "<op> mb<m> stage <s>"
// (op: forward, backward, backward_input, backward_weight) and carry their
// step in args.step. A file that is missing or not such a trace is an
// Error naming it.
struct PipelineTraceTimes {
  // step -> (virtual stage, op, microbatch) -> ms
  std::map<int, std::map<std::tuple<int, PipeOp, int>, double>> steps;
  std::map<std::pair<int, PipeOp>, double> mean;  // per (stage, op), over every traced step
  // The ops' time noise: stdev / mean of each (stage, op)'s instances,
  // averaged over the (stage, op)s that ran at least twice.
  double cv = 0;
};
PipelineTraceTimes read_pipeline_trace(const std::string& path);

// Each traced step of `t` replayed on `s` (replay_pipeline_schedule, free
// p2p): step -> its bubble as idle / busy. A step whose trace lacks one of
// the schedule's compute actions is an Error naming the action.
std::map<int, double> replay_traced_steps(const PipelineSchedule& s, const PipelineTraceTimes& t);

}  // namespace trainrun
