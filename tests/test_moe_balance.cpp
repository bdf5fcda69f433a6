// Aux-loss-free balancing (model.moe_balance: bias; DeepSeek-V3;
// core/model/moe/moe_config.h): a per-layer, per-expert bias on the router
// probabilities for the top-k choice only, moved after each optimizer step
// by rate * sign(mean load - load). On a tiny Mixtral whose router is
// skewed (every token's embedding shares a channel the router's expert 0
// row reads, so expert 0 wins every token):
//  - the last forward's max/mean load (metrics.jsonl) drops over 5 steps
//    with the bias and stays at E without it (the weights frozen, lr 1e-30);
//  - the bias is in the checkpoint: 2 steps, resume, 2 more equals 4
//    straight, losses, weights and the manifest's bias, at dp2; a bias of
//    the wrong size in a manifest is refused;
//  - bad values are refused by name: the rate, a dense model;
//  - at pp2 (gpipe, 1f1b) each stage counts its layers' load and the bias is pp1's;
//  - the biased choice op itself: the bias chooses, the weights stay the
//    probabilities (renormalised over the chosen).
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/model/model_spec.h"
#include "kernels/backend.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/inprocess.h"
#include "tests/support/mesh_runs.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

constexpr int kE = 4;

// A Mixtral (1 layer, 4 experts, top-1) whose router prefers expert 0 for
// every token, exported as a Hugging Face directory for model.init_from.
std::string skewed_mixtral(const test::TempDir& dir) {
  ModelConfig c;
  c.arch = "mixtral";
  c.L = 1, c.NH = 2, c.NKV = 2, c.C = 16, c.F = 16, c.V = 29, c.T = 12;
  c.tied = false;
  c.moe.n_experts = kE, c.moe.top_k = 1, c.moe.ffn = 16;
  const auto arch = make_model_arch(c);
  std::vector<float> flat(size_t(arch->layout().total));
  arch->init_params(3, 0, arch->layout().total, flat.data());
  for (const auto& t : arch->layout().tensors) {
    const std::string hf = arch->hf_tensor(t).name;
    if (hf == "model.embed_tokens.weight")
      for (int v = 0; v < c.V; ++v) flat[size_t(t.offset + int64_t(v) * c.C)] += 0.1f;  // channel 0 of every token
    if (hf == "model.layers.0.block_sparse_moe.gate.weight") {
      // Rows of std ~1 (50 x init_std) spread the tokens' scores; expert 0's reads the shared channel.
      for (int64_t i = 0; i < t.numel; ++i) flat[size_t(t.offset + i)] *= 50.0f;
      flat[size_t(t.offset)] = 1.0f;
    }
  }
  const std::string out = dir / "hf";
  export_hf(out, arch->config(), flat);
  return out;
}

std::string job_yaml(const std::string& hf, const std::string& out, int steps, const std::string& model_extra,
                     const std::string& lr, const std::string& parallel = "", int batch = 4, int micro = 2) {
  return "model: {arch: mixtral, init_from: '" + hf + "', seq_len: 12" + model_extra + "}\n"
         "data: {format: synthetic, synthetic: {vocab: 29, branching: 3}}\n"
         "train: {global_batch_size: " + std::to_string(batch) + ", micro_batch_size: " + std::to_string(micro) +
         ", max_steps: " + std::to_string(steps) + ", lr: " + lr +
         ", min_lr: 0,\n"
         "        warmup_steps: 0, schedule: constant, grad_clip: 0.5, eval_interval: 0, log_interval: 1}\n"
         "checkpoint: {interval: 2}\n"
         "output: {dir: '" + out + "', sample_tokens: 0}\n"
         "parallel: {" + parallel + "timeout_s: 60}\n";
}

// max/mean tokens per expert of layer 0's last forward, step by step (metrics.jsonl).
std::vector<double> load_ratio(const std::string& run) {
  std::vector<double> r;
  std::ifstream f(run + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("moe_layer0_tokens_max"))
      r.push_back(j["moe_layer0_tokens_max"].get<double>() / j["moe_layer0_tokens_mean"].get<double>());
  }
  return r;
}

nlohmann::json manifest(const std::string& run, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "/checkpoints/step_%08d", step);
  std::ifstream f(run + name + "/manifest.json");
  REQUIRE(f.good());
  return nlohmann::json::parse(f);
}

std::string error_of(const std::string& yaml, int world) {
  try {
    JobSpec job = parse_job_spec(yaml, "job.yaml", {});
    resolve_model_shape(job, false);
    (void)test::run_ranks_inprocess(job, world);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("moe balance: the expert bias evens a skewed router's load, off it stays skewed, bad values are refused",
          "[moe][balance]") {
  test::TempDir dir("moe_balance");
  const std::string hf = skewed_mixtral(dir);
  const std::string bias = ", moe_balance: bias, moe_bias_update_rate: 0.05, router_aux_loss_coef: 0";
  // One micro-batch of 16 sequences a step: the logged load is the step's, the one the bias follows.
  const int steps = 12;
  (void)test::train_mesh(job_yaml(hf, dir / "off", steps, ", router_aux_loss_coef: 0", "1.0e-30", "", 16, 16), 1);
  (void)test::train_mesh(job_yaml(hf, dir / "on", steps, bias, "1.0e-30", "", 16, 16), 1);
  const std::vector<double> off = load_ratio(dir / "off"), on = load_ratio(dir / "on");
  REQUIRE(off.size() == size_t(steps));
  REQUIRE(on.size() == size_t(steps));
  std::printf("max/mean load by step, bias off:");
  for (double x : off) std::printf(" %.2f", x);
  std::printf("\n                       bias on: ");
  for (double x : on) std::printf(" %.2f", x);
  std::printf("\n");
  // Step 1 routes before any update: the same skew both ways.
  CHECK(on[0] == off[0]);
  CHECK(off[0] > 2.0);
  // Over the last 4 steps (the same batches both ways): the bias has evened the load, without it the
  // frozen router is as skewed as at the start.
  double on_last = 0, off_last = 0;
  for (int s = steps - 4; s < steps; ++s) on_last += on[size_t(s)] / 4, off_last += off[size_t(s)] / 4;
  std::printf("last 4 steps' mean max/mean: bias on %.3f, off %.3f\n", on_last, off_last);
  CHECK(off_last > 0.85 * off[0]);
  CHECK(on_last < 0.75 * off_last);
  // The bias is in every checkpoint: expert 0's went down, the others' up.
  const nlohmann::json m = manifest(dir / "on", steps);
  REQUIRE(m.contains("moe_expert_bias"));
  const std::vector<float> b = m["moe_expert_bias"].get<std::vector<float>>();
  REQUIRE(b.size() == size_t(kE));
  std::printf("bias after %d steps: %.2f %.2f %.2f %.2f\n", steps, b[0], b[1], b[2], b[3]);
  CHECK(*std::min_element(b.begin(), b.end()) < 0);
  CHECK(*std::max_element(b.begin(), b.end()) > 0);
  CHECK(!manifest(dir / "off", steps).contains("moe_expert_bias"));

  // Bad values, by name.
  CHECK_THAT(error_of(job_yaml(hf, dir / "bad1", 1, ", moe_balance: bias, moe_bias_update_rate: 0", "1.0e-3"), 1),
             Contains("model.moe_bias_update_rate"));
  CHECK_THAT(error_of(job_yaml(hf, dir / "bad2", 1, ", moe_balance: bias, moe_bias_update_rate: -0.1", "1.0e-3"), 1),
             Contains("model.moe_bias_update_rate"));
  CHECK_THAT(error_of(job_yaml(hf, dir / "bad3", 1, ", moe_balance: biased", "1.0e-3"), 1),
             Contains("model.moe_balance") && Contains("aux_loss"));
  CHECK_THAT(error_of("model: {arch: llama, n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 29, seq_len: 12, "
                      "moe_balance: bias}\ndata: {format: synthetic}\noutput: {dir: '" + std::string(dir / "bad4") +
                      "'}\n", 1),
             Contains("model.moe_balance: bias; llama has no experts to balance"));
}

TEST_CASE("moe balance: the expert bias at pp2 with gpipe and 1f1b equals pp1 in losses and weights and every layer bias",
          "[moe][balance][pp]") {
  // 2 layers, one a stage: each stage counts its layer's load, the step's
  // all-reduce hands every rank both layers', and the bias (in the
  // checkpoint's manifest) must be pp1's. 4 micro-batches a step.
  test::TempDir dir("moe_balance_pp");
  auto yaml = [&](const std::string& name, const std::string& parallel) {
    return "model: {arch: mixtral, n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 29, seq_len: 12, ffn_dim: 16, "
           "n_experts: 4, n_experts_per_tok: 2, router_aux_loss_coef: 0, moe_balance: bias, "
           "moe_bias_update_rate: 0.05}\n"
           "data: {format: synthetic, synthetic: {vocab: 29, branching: 3}}\n"
           "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 3, lr: 3.0e-3, min_lr: 0, warmup_steps: 0, "
           "schedule: constant, grad_clip: 0.5, eval_interval: 0, log_interval: 1}\n"
           "checkpoint: {interval: 3}\n"
           "output: {dir: '" + std::string(dir / name) + "', sample_tokens: 0}\n"
           "parallel: {" + parallel + "timeout_s: 60}\n";
  };
  const test::MeshRun ref = test::train_mesh(yaml("pp1", ""), 1);
  const std::vector<float> want = manifest(dir / "pp1", 3)["moe_expert_bias"].get<std::vector<float>>();
  REQUIRE(want.size() == size_t(2 * kE));
  std::printf("pp1 bias after 3 steps:");
  for (float v : want) std::printf(" %.2f", v);
  std::printf("\n");
  // Both layers' biases moved (else the comparison below could not tell a lost layer).
  for (int l = 0; l < 2; ++l)
    CHECK(std::any_of(want.begin() + l * kE, want.begin() + (l + 1) * kE, [](float v) { return v != 0.f; }));
  for (const char* schedule : {"gpipe", "1f1b"}) {
    INFO(schedule);
    const std::string name = std::string("pp2_") + schedule;
    test::check_same_run(name, test::train_mesh(yaml(name, std::string("pipeline_parallel: 2, pipeline_schedule: ") +
                                                              schedule + ", "), 2), ref);
    CHECK(manifest(dir / name, 3)["moe_expert_bias"].get<std::vector<float>>() == want);
  }
}

TEST_CASE("moe balance: the expert bias resumes, 2 + 2 steps equal 4 at dp2", "[moe][balance][checkpoint]") {
  test::TempDir dir("moe_balance_resume");
  const std::string hf = skewed_mixtral(dir);
  const std::string bias = ", moe_balance: bias, moe_bias_update_rate: 0.05";
  const test::MeshRun straight =
      test::train_mesh(job_yaml(hf, dir / "straight", 4, bias, "3.0e-3", "sharding: full_shard, "), 2);
  (void)test::train_mesh(job_yaml(hf, dir / "broken", 2, bias, "3.0e-3", "sharding: full_shard, "), 2);
  const test::MeshRun resumed =
      test::train_mesh(job_yaml(hf, dir / "broken", 4, bias, "3.0e-3", "sharding: full_shard, "), 2);
  const std::vector<double> all = test::losses_of(dir / "broken");
  REQUIRE(all.size() == 4);
  test::check_same_run("resumed", test::MeshRun{all, resumed.weights}, straight, 0);
  const auto b1 = manifest(dir / "straight", 4)["moe_expert_bias"].get<std::vector<float>>();
  const auto b2 = manifest(dir / "broken", 4)["moe_expert_bias"].get<std::vector<float>>();
  CHECK(b1 == b2);
  CHECK(b1 != std::vector<float>(kE, 0.f));

  // A checkpoint whose bias does not fit the model is refused, naming both sizes.
  const std::string bad = dir / "tampered";
  (void)test::train_mesh(job_yaml(hf, bad, 2, bias, "3.0e-3", "sharding: full_shard, "), 2);
  nlohmann::json m = manifest(bad, 2);
  m["moe_expert_bias"] = {0.1, 0.2};
  std::ofstream(bad + "/checkpoints/step_00000002/manifest.json") << m.dump(2);
  std::string err;
  try {
    (void)test::train_mesh(job_yaml(hf, bad, 4, bias, "3.0e-3", "sharding: full_shard, "), 2);
  } catch (const std::exception& e) {
    err = e.what();
  }
  CHECK_THAT(err, Contains("moe_expert_bias has 2 values") && Contains("1 layers x 4 experts need 4"));
}

TEST_CASE("moe balance: the biased top-k op chooses by probs + bias and weighs by probs", "[moe][balance]") {
  auto be = make_cpu_backend(1);
  // 2 tokens, 3 experts, top-2.
  const std::vector<float> probs = {0.5f, 0.3f, 0.2f, 0.1f, 0.6f, 0.3f}, bias = {-0.4f, 0.0f, 0.05f};
  std::vector<int32_t> idx(4);
  std::vector<float> w(4);
  be->moe_route_select_biased(idx.data(), w.data(), probs.data(), bias.data(), 2, 3, 2, false);
  // token 0: scores 0.1 0.3 0.25 -> experts 1, 2 weighed 0.3, 0.2; token 1: 0.-0.3 0.6 0.35 -> 1, 2.
  CHECK(idx == std::vector<int32_t>{1, 2, 1, 2});
  CHECK(w == std::vector<float>{0.3f, 0.2f, 0.6f, 0.3f});
  be->moe_route_select_biased(idx.data(), w.data(), probs.data(), bias.data(), 2, 3, 2, true);
  CHECK(w[0] == Approx(0.6f));
  CHECK(w[1] == Approx(0.4f));
}
