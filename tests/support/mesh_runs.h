// "N ranks train as one rank does": the check every model family and
// parallel feature repeats (test_qwen2/qwen3/mistral/gemma2_jobs/mixtral/
// qwen2_moe, ...). One copy here: run a job spec in-process at a mesh,
// read what it wrote, and compare two runs step by step.
#pragma once
#include <string>
#include <vector>

namespace trainrun::test {

// What a training run left: rank 0's per-step training losses and the
// final weights (output.dir/model.safetensors, the logical whole model).
struct MeshRun {
  std::vector<double> losses;
  std::vector<float> weights;
};

// Parses the job spec YAML, resolves its model's shape (presets and
// init_from directories), trains it with `world` ranks as threads of this
// process (run_ranks_inprocess: real Gloo, real store) and reads back the
// losses and the final weights. Throws what a rank threw.
MeshRun train_mesh(const std::string& yaml, int world);

// A 4-step synthetic job for `model` (a YAML flow map, e.g. "{arch: qwen3,
// n_layer: 2, ...}") at the mesh tp x pp x dp (dp = world / (tp*pp)), with
// `strategy` sharding and optionally sequence parallelism, writing to
// `out`. Global batch 8 of micro-batches 2: every mesh up to 4 ranks sees
// the same sequences in the same order, so the losses must agree.
std::string small_mesh_job(const std::string& model, const std::string& out, int tp, int pp,
                           const std::string& strategy, bool sequence_parallel = false);

// `got` trained as `want` did: the same number of steps, every step's loss
// within `tol` relative, and the final weights within `tol` (norm-wise
// relative error). Prints "WHAT: losses first .. last, final weights rel
// err E" so the figures are in the test log.
void check_same_run(const std::string& what, const MeshRun& got, const MeshRun& want, double tol = 1e-5);

}  // namespace trainrun::test
