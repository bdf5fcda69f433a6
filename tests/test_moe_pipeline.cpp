// The router losses under pipeline parallelism (core/model/moe/moe_mlp.h,
// LlamaNetwork's stage messages): the load-balancing loss is
// E sum_e f_e P_e over the tokens of every layer, so it does not split into
// per-stage sums; each stage carries the running statistics (2E+1 fp32)
// forward after its activation rows, the last stage computes both losses,
// and the E-value aux gradient rides back after the gradient rows. A tiny
// Mixtral and a tiny Qwen2-MoE (shared expert, no renormalisation; 2
// layers, one a stage, aux 0.02 and z 0.001) at pp2 with gpipe and 1f1b,
// and pp2 x dp2 full_shard, must train as one rank does over 5 steps:
// every step's loss (cross-entropy + the router losses) and the final
// weights <= 1e-5; and the router figures rank 0 writes to metrics.jsonl
// (the aux and z losses on the last stage, each layer's busiest expert on
// its stage, summed into the step's all-reduce) are pp1's at pp2.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/mesh_runs.h"
#include "tests/support/testutil.h"

using namespace trainrun;

namespace {

// Global batch 8 of micro-batches 2: 4 micro-batches a step at pp2, 2 a rank at pp2 x dp2.
std::string job(const std::string& out, const std::string& model, const std::string& parallel) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 64, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 2, max_steps: 5, lr: 3.0e-3, min_lr: 0, warmup_steps: 0, "
         "schedule: constant, grad_clip: 0.3, eval_interval: 0, log_interval: 1}\n"
         "output: {dir: '" + out + "', sample_tokens: 0}\n"
         "parallel: {" + parallel + "timeout_s: 60}\n";
}

// Every step's router figures in metrics.jsonl: aux, z, layer 0's and layer 1's busiest expert's tokens.
std::vector<std::vector<double>> router_figures(const std::string& run) {
  std::vector<std::vector<double>> out;
  std::istringstream in(test::read_file(run + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("moe_aux_loss"))
      out.push_back({j["moe_aux_loss"].get<double>(), j["moe_z_loss"].get<double>(),
                     j["moe_layer0_tokens_max"].get<double>(), j["moe_layer1_tokens_max"].get<double>()});
  }
  return out;
}

}  // namespace

TEST_CASE("moe pipeline: router aux and z losses at pp2 with gpipe and 1f1b and pp2 x dp2 train as one rank does",
          "[moe][pp]") {
  test::TempDir dir("moe_pp");
  const std::string common = "n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 32, ffn_dim: 24, vocab_size: 64, "
                             "seq_len: 16, n_experts: 4, n_experts_per_tok: 2, router_aux_loss_coef: 0.02, "
                             "router_z_loss_coef: 0.001";
  for (const std::string& model : {"{arch: mixtral, " + common + "}",
                                   "{arch: qwen2_moe, " + common + ", moe_ffn_dim: 16, shared_expert_ffn_dim: 24}"}) {
    INFO(model);
    const std::string arch = model.substr(7, model.find(',') - 7);
    const test::MeshRun ref = test::train_mesh(job(dir / (arch + "_pp1"), model, "sharding: no_shard, "), 1);
    REQUIRE(ref.losses.size() == 5);
    const auto want = router_figures(dir / (arch + "_pp1"));
    REQUIRE(want.size() == 5);
    for (const char* schedule : {"gpipe", "1f1b"}) {
      const std::string name = arch + "_pp2_" + schedule;
      test::check_same_run(arch + " pp2 " + schedule,
                           test::train_mesh(job(dir / name, model, std::string("sharding: no_shard, pipeline_parallel: 2, "
                                                                               "pipeline_schedule: ") + schedule + ", "), 2),
                           ref);
      const auto got = router_figures(dir / name);
      REQUIRE(got.size() == want.size());
      // Steps 1-4: the last run's step ends with the validation pass, whose
      // forward one rank's network reports at step 5 (a pipeline reports
      // the training step's figures: the executor's eval does not reach them).
      for (size_t i = 0; i + 1 < want.size(); ++i)
        for (size_t k = 0; k < 4; ++k) {
          INFO(name << " step " << i + 1 << " figure " << k);
          CHECK(got[i][k] == Approx(want[i][k]).epsilon(1e-6));
        }
      std::printf("%s: aux loss step 1 %.6f (pp1 %.6f), step 4 %.6f (pp1 %.6f)\n", name.c_str(), got[0][0], want[0][0],
                  got[3][0], want[3][0]);
    }
    test::check_same_run(arch + " pp2 x dp2",
                         test::train_mesh(job(dir / (arch + "_pp2dp2"), model,
                                              "sharding: full_shard, pipeline_parallel: 2, pipeline_schedule: 1f1b, "),
                                          4),
                         ref);
  }
}
