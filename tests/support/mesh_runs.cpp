#include "tests/support/mesh_runs.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>

#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "core/model/model_io.h"
#include "core/model/model_spec.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

namespace trainrun::test {

MeshRun train_mesh(const std::string& yaml, int world) {
  JobSpec job = parse_job_spec(yaml, "job.yaml", {});
  resolve_model_shape(job, false);
  MeshRun out;
  out.losses = run_ranks_inprocess(job, world)[0].losses;
  (void)load_model_safetensors(job.output.dir + "/model.safetensors", out.weights);
  return out;
}

std::string small_mesh_job(const std::string& model, const std::string& out, int tp, int pp,
                           const std::string& strategy, bool sequence_parallel) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 2, max_steps: 4, lr: 3.0e-3, min_lr: 3.0e-4, "
         "warmup_steps: 1,\n"
         "        eval_interval: 0, log_interval: 1, grad_clip: 0.3}\n"
         "output: {dir: '" + out + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", tensor_parallel: " + std::to_string(tp) +
         ", pipeline_parallel: " + std::to_string(pp) +
         ", sequence_parallel: " + (sequence_parallel ? "true" : "false") + ", timeout_s: 60}\n";
}

void check_same_run(const std::string& what, const MeshRun& got, const MeshRun& want, double tol) {
  INFO(what);
  REQUIRE(!want.losses.empty());
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    INFO("step " << i + 1 << ": " << got.losses[i] << " vs " << want.losses[i]);
    CHECK(std::fabs(got.losses[i] - want.losses[i]) <= tol * std::fabs(want.losses[i]));
  }
  REQUIRE(got.weights.size() == want.weights.size());
  const double e = rel_err(got.weights, want.weights);
  std::printf("%s: losses %.6f .. %.6f, final weights rel err %.3e\n", what.c_str(), got.losses.front(),
              got.losses.back(), e);
  INFO("final weights rel err " << e);
  CHECK(e <= tol);
}

}  // namespace trainrun::test
