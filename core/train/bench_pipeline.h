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
// The steps after the warm-up are traced (output.trace_steps), and the
// "model" column simulates each schedule with those measured per-stage op
// times and free p2p (simulate_pipeline_schedule with costs): the bubble
// the stage costs alone give, so measured - model is the runtime's and the
// transfers' share and model - formula the stage costs'.
#pragma once
#include <string>

namespace trainrun {

struct PipelineBenchOptions {
  int stages = 2;         // p (ranks; one core each)
  int microbatches = 8;   // m (the accumulation count)
  int steps = 6;          // steps per job; the first 2 are warm-up
  int layers = 8, width = 256, seq_len = 128, micro_batch = 2;  // the GPT-2 measured
};

int run_pipeline_bench(const PipelineBenchOptions& o);

}  // namespace trainrun
