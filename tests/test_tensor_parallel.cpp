// Tensor parallelism (issue #14): the local layouts (every global element
// held and owned as the plan says), the vocab-parallel ops of the CPU
// backend against the single-rank ops they split, whole training runs at
// tp2 / tp4 / tp2 x dp2 under every sharding strategy against one rank
// (Llama GQA 2:1 and 4:1, tied and untied, GPT-2, a vocabulary that needs
// padding, also to lcm(tp, 64) as on CUDA), resume chains across meshes
// and strategies, strided checkpoint segments (layout, damage, malformed
// manifests), the end-of-run sample at tp2, and the bad meshes' messages.
#include <catch2/catch.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/checkpoint/checkpoint.h"
#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/model/model_shape.h"
#include "core/model/tensor_parallel.h"
#include "core/train/trainer.h"
#include "core/io/safetensors.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/device_io.h"
#include "tests/support/inprocess.h"
#include "tests/support/sample_run.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

namespace {

ModelConfig llama_cfg(int NH, int NKV, int F, int V, bool tied) {
  ModelConfig c;
  c.arch = "llama";
  c.L = 2;
  c.NH = NH;
  c.NKV = NKV;
  c.C = 16;
  c.F = F;
  c.V = V;
  c.T = 8;
  c.tied = tied;
  return c;
}

// For every global element: how many ranks hold it and how many own it.
void check_coverage(const ModelArch& arch, int tp) {
  const int64_t total = arch.layout().total;
  std::vector<int> held(size_t(total), 0), owned(size_t(total), 0);
  for (int r = 0; r < tp; ++r) {
    const TensorParallelPlan plan(arch, tp, r);
    int64_t local = 0;
    for (const TpRun& run : plan.runs()) {
      REQUIRE(run.local == local);  // the runs tile the local vector in order
      local += run.count;
      if (run.global < 0) {
        CHECK(!run.owner);
        continue;
      }
      for (int64_t i = 0; i < run.count; ++i) {
        ++held[size_t(run.global + i)];
        if (run.owner) ++owned[size_t(run.global + i)];
        CHECK(plan.local_of(run.global + i) == run.local + i);
      }
    }
    CHECK(local == plan.local_layout().total);
  }
  for (int64_t g = 0; g < total; ++g) {
    INFO("global element " << g);
    REQUIRE(owned[size_t(g)] == 1);  // written once, counted once in the norm
    REQUIRE(held[size_t(g)] >= 1);
  }
}

}  // namespace

TEST_CASE("tp: local layouts hold every element, each owned by exactly one rank", "[tp]") {
  SECTION("llama GQA 2:1 at tp2 (KV heads split), padded vocab") {
    auto arch = make_model_arch(llama_cfg(4, 2, 24, 23, false));
    const TensorParallelPlan p(*arch, 2, 1);
    const ParamLayout& l = p.local_layout();
    CHECK(l.get("model.layers.0.self_attn.q_proj.weight").shape == std::vector<int64_t>{8, 16});
    CHECK(l.get("model.layers.0.self_attn.k_proj.weight").shape == std::vector<int64_t>{4, 16});
    CHECK(l.get("model.layers.0.self_attn.o_proj.weight").shape == std::vector<int64_t>{16, 8});
    CHECK(l.get("model.layers.0.mlp.down_proj.weight").shape == std::vector<int64_t>{16, 12});
    CHECK(l.get("model.embed_tokens.weight").shape == std::vector<int64_t>{12, 16});  // 23 -> 24 rows
    CHECK(p.shape().v_begin == 12);
    CHECK(p.shape().v_valid == 11);
    CHECK(p.shape().kv_replicas == 1);
    // The second rank's k rows are global k rows 4..7.
    const ParamTensor& kg = arch->layout().get("model.layers.0.self_attn.k_proj.weight");
    const ParamTensor& kl = l.get("model.layers.0.self_attn.k_proj.weight");
    CHECK(p.local_of(kg.offset + 4 * 16) == kl.offset);
    check_coverage(*arch, 2);
  }
  SECTION("llama GQA 4:1 at tp2 and tp4 (one KV head replicated)") {
    auto arch = make_model_arch(llama_cfg(4, 1, 24, 23, true));
    for (int tp : {2, 4}) {
      const TensorParallelPlan p(*arch, tp, tp - 1);
      CHECK(p.shape().NKV == 1);
      CHECK(p.shape().kv_replicas == tp);
      check_coverage(*arch, tp);
    }
  }
  SECTION("gpt2 at tp2 and tp4: q|k|v split block by block") {
    auto arch = make_model_arch(ModelConfig::of(2, 4, 16, 23, 8));
    const TensorParallelPlan p(*arch, 2, 1);
    const ParamTensor& g = arch->layout().get("transformer.h.1.attn.c_attn.weight");
    const ParamTensor& l = p.local_layout().get("transformer.h.1.attn.c_attn.weight");
    CHECK(l.shape == std::vector<int64_t>{24, 16});
    // Local rows 8..15 are k's second half: global rows 16 + 8 = 24.. of (48, 16).
    CHECK(p.local_of(g.offset + 24 * 16) == l.offset + 8 * 16);
    for (int tp : {2, 4}) check_coverage(*arch, tp);
  }
}

TEST_CASE("tp: TpCollectives::vocab_cross_entropy over one rank is the plain cross-entropy, its all-reduces timed",
          "[tp][cpu_ops]") {
  auto be = make_cpu_backend(1);
  const int N = 6, V = 11;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> logits(size_t(N) * V);
  for (auto& x : logits) x = nd(rng);
  std::vector<int32_t> tgt = {0, 10, 3, -1, 7, 5};  // -1: ignored
  DeviceBuffer d_tgt = upload_i32(be.get(), tgt);
  // The reference: the backend's fused op on a copy (it writes dlogits in place).
  DeviceBuffer ref_logits = upload_f32(be.get(), logits), ref_loss(be.get(), N * 4);
  be->softmax_cross_entropy(ref_loss.as<float>(), ref_logits.get(), ref_logits.get(), d_tgt.as<int32_t>(), N, V, V,
                            0.5f);
  const auto arch = make_model_arch(parse_model_shape("gpt2:L=1,C=8,heads=2,V=11,T=4"));
  const TensorParallelPlan plan(*arch, 1, 0);
  const auto comm = make_single_communicator();
  TensorParallel ctx;
  ctx.plan = &plan;
  ctx.comm = comm.get();
  TpCollectives tpc;
  tpc.tp = &ctx;
  tpc.be = be.get();
  DeviceBuffer d_logits = upload_f32(be.get(), logits), loss(be.get(), N * 4), rowmax(be.get(), N * 4),
      stats(be.get(), 2 * N * 4);
  tpc.vocab_cross_entropy(loss.as<float>(), d_logits.get(), d_logits.get(), d_tgt.as<int32_t>(), rowmax.as<float>(),
                          stats.as<float>(), 0, N, V, V, 0.5f);
  const auto a = download_f32(be.get(), loss.get(), N), b = download_f32(be.get(), ref_loss.get(), N);
  const auto ga = download_f32(be.get(), d_logits.get(), size_t(N) * V);
  const auto gb = download_f32(be.get(), ref_logits.get(), size_t(N) * V);
  for (int i = 0; i < N; ++i) CHECK(a[size_t(i)] == Approx(b[size_t(i)]).epsilon(1e-6));
  for (size_t i = 0; i < ga.size(); ++i) CHECK(ga[i] == Approx(gb[i]).margin(1e-7));
  // Its max and sum all-reduces count in the TP collective time (tp_comm_ms).
  CHECK(ctx.comm_calls == 2);
}

TEST_CASE("tp: models that do not split are errors naming the keys", "[tp]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(check_tensor_parallel(llama_cfg(4, 2, 24, 23, true), 3),
                    Contains("model.n_head (4) is not divisible by parallel.tensor_parallel (3)"));
  CHECK_THROWS_WITH(check_tensor_parallel(llama_cfg(6, 3, 24, 23, true), 2),
                    Contains("model.n_kv_head (3) and parallel.tensor_parallel (2) do not fit") &&
                        Contains("model.n_head 6"));
  CHECK_THROWS_WITH(check_tensor_parallel(llama_cfg(4, 2, 22, 23, true), 4),
                    Contains("model.ffn_dim (22) is not divisible by parallel.tensor_parallel (4)"));
  CHECK_THROWS_WITH(check_tensor_parallel(llama_cfg(4, 2, 24, 5, true), 4),
                    Contains("model.vocab_size (5) is too small for parallel.tensor_parallel (4)"));
  CHECK_NOTHROW(check_tensor_parallel(llama_cfg(4, 1, 24, 23, true), 4));
}

// ---- the vocab-parallel ops against the single-rank ops they split ----------------------

TEST_CASE("tp: vocab-parallel embedding and cross-entropy summed over ranks are the single-rank ops",
          "[tp][cpu_ops]") {
  auto be = make_cpu_backend(2);
  const int B = 3, T = 5, C = 7, V = 19, N = B * T;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng);
    return v;
  };
  std::vector<int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[size_t(i)] = int32_t(rng() % V);
  tok[4] = -1;  // an ignored target (cross-entropy)
  std::vector<int32_t> in = tok;
  in[4] = 3;
  const std::vector<float> wte = randv(size_t(V) * C), wpe = randv(size_t(T) * C), dout = randv(size_t(N) * C);
  DeviceBuffer d_in = upload_i32(be.get(), in), d_tok = upload_i32(be.get(), tok);
  DeviceBuffer d_wte = upload_f32(be.get(), wte), d_wpe = upload_f32(be.get(), wpe), d_dout = upload_f32(be.get(), dout);

  // Single rank.
  DeviceBuffer out(be.get(), size_t(N) * C * 4), dwte(be.get(), size_t(V) * C * 4), dwpe(be.get(), size_t(T) * C * 4);
  be->encoder_forward(out.get(), d_in.as<int32_t>(), d_wte.get(), d_wpe.get(), B, T, C);
  be->encoder_backward(dwte.as<float>(), dwpe.as<float>(), d_dout.get(), d_in.as<int32_t>(), B, T, C);
  const auto want_out = download_f32(be.get(), out.get(), size_t(N) * C);
  const auto want_dwte = download_f32(be.get(), dwte.get(), size_t(V) * C);
  const auto want_dwpe = download_f32(be.get(), dwpe.get(), size_t(T) * C);

  const std::vector<float> logits = randv(size_t(N) * V);
  DeviceBuffer d_logits = upload_f32(be.get(), logits), losses(be.get(), N * 4), dlog(be.get(), size_t(N) * V * 4);
  be->softmax_cross_entropy(losses.as<float>(), dlog.get(), d_logits.get(), d_tok.as<int32_t>(), N, V, V, 0.25f);
  const auto want_loss = download_f32(be.get(), losses.get(), N);
  const auto want_dlog = download_f32(be.get(), dlog.get(), size_t(N) * V);

  // Three "ranks" of 7 rows (the last holds 5 real ones), the all-reduces done here.
  const int R = 3, VL = 7;
  std::vector<float> got_out(size_t(N) * C, 0.0f), got_dwpe;
  std::vector<float> rowmax(N, -INFINITY), stats(2 * size_t(N), 0.0f);
  std::vector<std::vector<float>> part_logits(R);
  for (int r = 0; r < R; ++r) {
    const int v0 = r * VL, nv = std::min(VL, V - v0);
    std::vector<float> slice(wte.begin() + size_t(v0) * C, wte.begin() + size_t(v0 + nv) * C);
    DeviceBuffer d_slice = upload_f32(be.get(), slice);
    DeviceBuffer o(be.get(), size_t(N) * C * 4), g(be.get(), size_t(nv) * C * 4), gp(be.get(), size_t(T) * C * 4);
    be->vocab_embedding_forward(o.get(), d_in.as<int32_t>(), d_slice.get(), r == 0 ? d_wpe.get() : nullptr, v0, nv, B,
                                T, C);
    const auto ho = download_f32(be.get(), o.get(), size_t(N) * C);
    for (size_t i = 0; i < ho.size(); ++i) got_out[i] += ho[i];
    be->vocab_embedding_backward(g.as<float>(), gp.as<float>(), d_dout.get(), d_in.as<int32_t>(), v0, nv, B, T, C);
    const auto hg = download_f32(be.get(), g.get(), size_t(nv) * C);
    for (size_t i = 0; i < hg.size(); ++i) CHECK(hg[i] == want_dwte[size_t(v0) * C + i]);
    got_dwpe = download_f32(be.get(), gp.get(), size_t(T) * C);
    CHECK(got_dwpe == want_dwpe);

    // Logits: this rank's columns, rows VL apart (padding columns present, never read).
    part_logits[size_t(r)].assign(size_t(N) * VL, 1e30f);
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < nv; ++j) part_logits[size_t(r)][size_t(n) * VL + j] = logits[size_t(n) * V + v0 + j];
    DeviceBuffer dl = upload_f32(be.get(), part_logits[size_t(r)]), mx(be.get(), N * 4);
    be->vocab_ce_max(mx.as<float>(), dl.get(), N, nv, VL);
    const auto hm = download_f32(be.get(), mx.get(), N);
    for (int n = 0; n < N; ++n) rowmax[size_t(n)] = std::max(rowmax[size_t(n)], hm[size_t(n)]);
  }
  for (size_t i = 0; i < got_out.size(); ++i) CHECK(got_out[i] == Approx(want_out[i]).epsilon(1e-6));
  DeviceBuffer d_max = upload_f32(be.get(), rowmax);
  for (int r = 0; r < R; ++r) {
    const int v0 = r * VL, nv = std::min(VL, V - v0);
    DeviceBuffer dl = upload_f32(be.get(), part_logits[size_t(r)]), st(be.get(), 2 * size_t(N) * 4);
    be->vocab_ce_sumexp(st.as<float>(), dl.get(), d_tok.as<int32_t>(), d_max.as<float>(), v0, N, nv, VL);
    const auto hs = download_f32(be.get(), st.get(), 2 * size_t(N));
    for (size_t i = 0; i < hs.size(); ++i) stats[i] += hs[i];
  }
  DeviceBuffer d_stats = upload_f32(be.get(), stats);
  for (int r = 0; r < R; ++r) {
    const int v0 = r * VL, nv = std::min(VL, V - v0);
    DeviceBuffer dl = upload_f32(be.get(), part_logits[size_t(r)]), ls(be.get(), N * 4);
    be->vocab_ce_finish(ls.as<float>(), dl.get(), dl.get(), d_tok.as<int32_t>(), d_max.as<float>(), d_stats.as<float>(),
                        v0, N, nv, VL, 0.25f);
    const auto hl = download_f32(be.get(), ls.get(), N);
    const auto hd = download_f32(be.get(), dl.get(), size_t(N) * VL);
    for (int n = 0; n < N; ++n) {
      INFO("rank " << r << " row " << n);
      CHECK(hl[size_t(n)] == Approx(want_loss[size_t(n)]).epsilon(1e-5).margin(1e-6));
      for (int j = 0; j < nv; ++j)
        CHECK(hd[size_t(n) * VL + j] == Approx(want_dlog[size_t(n) * V + v0 + j]).margin(1e-6));
      for (int j = nv; j < VL; ++j) CHECK(hd[size_t(n) * VL + j] == 1e30f);  // padding columns untouched
    }
  }
}

// ---- training runs against one rank ----------------------------------------------------------

namespace {

// Gradient clipping on (the global norm must count every element once),
// accumulation on, a vocabulary of 23 (padded to 24 at tp2 and tp4).
std::string tp_job(const std::string& dir, const std::string& model, const std::string& strategy, int tp, int group,
                   int steps = 6, int data_vocab = 23) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: " + std::to_string(data_vocab) + ", branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 2, max_steps: " + std::to_string(steps) + ", lr: 3.0e-3,\n"
         "        min_lr: 3.0e-4, warmup_steps: 2, eval_interval: 3, eval_steps: 1, log_interval: 1, grad_clip: 0.3}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", shard_group_size: " + std::to_string(group) +
         ", tensor_parallel: " + std::to_string(tp) + ", timeout_s: 60}\n";
}

std::string llama_model(int nkv, const std::string& tie) {
  return "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: " + std::to_string(nkv) +
         ", n_embd: 16, ffn_dim: 24, vocab_size: 23, seq_len: 8, tie_embeddings: " + tie + "}";
}
const char* kGpt2Model = "{arch: gpt2, n_layer: 2, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 8}";

struct Run {
  std::vector<double> losses;
  std::vector<float> weights;
};

Run run_tp(const std::string& model, int world, int tp, const std::string& strategy, int group = 0,
           const std::vector<std::string>& sets = {}) {
  TempDir dir("tp");
  const JobSpec job = parse_job_spec(tp_job(dir.path(), model, strategy, tp, group), "job.yaml", sets);
  Run out;
  out.losses = run_ranks_inprocess(job, world)[0].losses;
  (void)load_model_safetensors(dir / "model.safetensors", out.weights);
  return out;
}

void check_same(const Run& got, const Run& ref) {
  REQUIRE(got.losses.size() == ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    INFO("step " << i + 1 << ": " << got.losses[i] << " vs " << ref.losses[i]);
    CHECK(std::fabs(got.losses[i] - ref.losses[i]) <= 1e-5 * std::fabs(ref.losses[i]));
  }
  REQUIRE(got.weights.size() == ref.weights.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.weights.size(); ++i) {
    num += (double(got.weights[i]) - ref.weights[i]) * (double(got.weights[i]) - ref.weights[i]);
    den += double(ref.weights[i]) * ref.weights[i];
  }
  INFO("final weights rel err " << std::sqrt(num / den));
  CHECK(std::sqrt(num / den) <= 1e-5);
}

// tp2 (world 2), tp4 (world 4), and tp2 x dp2 (world 4) under every strategy.
void check_meshes(const std::string& model) {
  const Run ref = run_tp(model, 1, 1, "no_shard");
  REQUIRE(ref.losses.size() == 6);
  CHECK(ref.losses.back() < ref.losses.front());
  {
    INFO("tp2");
    check_same(run_tp(model, 2, 2, "full_shard"), ref);
  }
  {
    INFO("tp4");
    check_same(run_tp(model, 4, 4, "no_shard"), ref);
  }
  for (const char* strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    INFO("tp2 x dp2, " << strategy);
    check_same(run_tp(model, 4, 2, strategy, std::string(strategy) == "hybrid_shard" ? 1 : 0), ref);
  }
}

}  // namespace

TEST_CASE("tp: llama GQA 2:1 at tp2, tp4 and tp2 x dp2 trains as one rank does", "[tp][llama]") {
  for (const char* tie : {"false", "true"}) {
    INFO("tie_embeddings " << tie);
    check_meshes(llama_model(2, tie));
  }
}

TEST_CASE("tp: llama GQA 4:1 (KV head replicated) at tp2, tp4 and tp2 x dp2 trains as one rank does",
          "[tp][llama]") {
  for (const char* tie : {"true", "false"}) {
    INFO("tie_embeddings " << tie);
    check_meshes(llama_model(1, tie));
  }
}

TEST_CASE("tp: gpt2 at tp2, tp4 and tp2 x dp2 trains as one rank does", "[tp][gpt2]") { check_meshes(kGpt2Model); }

TEST_CASE("tp: sequence parallelism at tp2, tp4 and tp2 x dp2 trains as one rank does", "[tp][sp]") {
  // The mutation check of issue #14: without the all-reduce of the norm
  // weights' gradients (TpCollectives::norm_grad_done) every case here fails.
  const std::vector<std::string> sp = {"parallel.sequence_parallel=true"};
  for (const std::string& model :
       {llama_model(2, "false"), llama_model(2, "true"), llama_model(1, "false"), llama_model(1, "true"),
        std::string(kGpt2Model)}) {
    {
      INFO(model);
      const Run ref = run_tp(model, 1, 1, "no_shard");
      {
        INFO("tp2 + SP");
        check_same(run_tp(model, 2, 2, "full_shard", 0, sp), ref);
      }
      {
        INFO("tp4 + SP, activation checkpointing");
        std::vector<std::string> sets = sp;
        sets.push_back("train.activation_checkpointing=blocks");
        check_same(run_tp(model, 4, 4, "shard_grad_op", 0, sets), ref);
      }
      {
        INFO("tp2 x dp2 + SP, hybrid_shard");
        check_same(run_tp(model, 4, 2, "hybrid_shard", 1, sp), ref);
      }
    }
  }
}

TEST_CASE("tp: a tp2 checkpoint resumes on tp1 and a tp1 one on tp2 (logical checkpoints)", "[tp][checkpoint]") {
  for (const char* model : {kGpt2Model, "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 1, n_embd: 16, ffn_dim: 24, "
                                        "vocab_size: 23, seq_len: 8, tie_embeddings: false}"}) {
    INFO(model);
    const Run straight = run_tp(model, 1, 1, "full_shard");
    for (int first_tp : {2, 1}) {
      const int second_tp = 3 - first_tp;
      INFO("tp" << first_tp << " -> tp" << second_tp);
      TempDir dir("tp_resume");
      const JobSpec a = parse_job_spec(tp_job(dir.path(), model, "full_shard", first_tp, 0), "job.yaml",
                                       {"train.exit_interval=3"});
      run_ranks_inprocess(a, first_tp);
      REQUIRE(latest_of(dir.path()) == "step_00000003");
      const JobSpec b = parse_job_spec(tp_job(dir.path(), model, "full_shard", second_tp, 0), "job.yaml");
      run_ranks_inprocess(b, second_tp);
      Run resumed;
      resumed.losses = losses_of(dir.path());
      (void)load_model_safetensors(dir / "model.safetensors", resumed.weights);
      check_same(resumed, straight);
    }
  }
}

namespace {

// One stage of a resume chain: `world` ranks at `tp` continue the run in
// `dir` for 2 steps (or to the end).
void run_stage(const std::string& dir, const std::string& model, const std::string& strategy, int world, int tp,
               bool last, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = extra;
  if (!last) sets.push_back("train.exit_interval=2");
  const int group = strategy == "hybrid_shard" ? (world / tp > 1 ? 1 : 1) : 0;
  run_ranks_inprocess(parse_job_spec(tp_job(dir, model, strategy, tp, group), "job.yaml", sets), world);
}

Run resumed_run(const std::string& dir) {
  Run r;
  r.losses = losses_of(dir);
  (void)load_model_safetensors(dir + "/model.safetensors", r.weights);
  return r;
}

const char* kLlama41 = "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 1, n_embd: 16, ffn_dim: 24, "
                       "vocab_size: 23, seq_len: 8, tie_embeddings: false}";

nlohmann::json read_manifest(const std::string& ckpt_dir) {
  std::ifstream in(ckpt_dir + "/manifest.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

}  // namespace

TEST_CASE("tp: resume chains across meshes: tp2 -> tp1 -> tp4 and tp2 x dp2 -> dp4 -> tp4", "[tp][checkpoint]") {
  for (const char* model : {kGpt2Model, kLlama41}) {
    INFO(model);
    const Run straight = run_tp(model, 1, 1, "no_shard");
    {
      INFO("tp2 (full_shard) -> tp1 (no_shard) -> tp4 (shard_grad_op, async checkpoints)");
      TempDir dir("tp_chain");
      run_stage(dir.path(), model, "full_shard", 2, 2, false);
      REQUIRE(latest_of(dir.path()) == "step_00000002");
      run_stage(dir.path(), model, "no_shard", 1, 1, false);
      REQUIRE(latest_of(dir.path()) == "step_00000004");
      run_stage(dir.path(), model, "shard_grad_op", 4, 4, true, {"checkpoint.async=true"});
      check_same(resumed_run(dir.path()), straight);
    }
    for (const char* strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
      INFO("tp2 x dp2 -> dp4 -> tp4, all " << strategy);
      TempDir dir("tp_chain");
      run_stage(dir.path(), model, strategy, 4, 2, false, {"checkpoint.async=true"});
      REQUIRE(latest_of(dir.path()) == "step_00000002");
      run_stage(dir.path(), model, strategy, 4, 1, false);
      REQUIRE(latest_of(dir.path()) == "step_00000004");
      run_stage(dir.path(), model, strategy, 4, 4, true);
      check_same(resumed_run(dir.path()), straight);
    }
  }
}

TEST_CASE("tp: a row-parallel slice is one strided range per tensor, and a damaged run is found", "[tp][checkpoint]") {
  // Llama at tp2: o_proj and down_proj are split along their inner dim, so
  // each rank holds one run per row. The manifest lists them as strided
  // segments (not one per row), and every byte is still covered once.
  TempDir dir("tp_strided");
  run_stage(dir.path(), kLlama41, "full_shard", 2, 2, false, {"checkpoint.interval=1"});
  REQUIRE(latest_of(dir.path()) == "step_00000002");
  const std::string ck = dir.path() + "/checkpoints/step_00000002";
  REQUIRE(Checkpointer::verify(ck).empty());
  const nlohmann::json m = read_manifest(ck);
  CHECK(m.at("format_version").get<int>() == 3);
  int strided = 0, segments = 0;
  uint64_t runs = 0;
  nlohmann::json victim;
  for (const auto& g : m.at("files").at("model.safetensors").at("segments")) {
    ++segments;
    if (g.contains("reps")) {
      ++strided;
      runs += g.at("reps").get<uint64_t>();
      CHECK(g.at("stride").get<uint64_t>() > g.at("bytes").get<uint64_t>());
      if (victim.is_null()) victim = g;
    }
  }
  // Per layer: o_proj (16 rows of 16) and down_proj (16 rows of 24), each
  // split in two: 4 strided segments of 16 runs per layer; gate|up's two
  // row blocks of each rank fold into one strided segment of 2 runs too.
  CHECK(strided >= 2 * 4);
  CHECK(runs >= 2 * 4 * 16);
  INFO(segments << " segments");
  CHECK(segments < 40);  // one per row would be 128 for these alone

  // A flipped byte in the third run of a strided segment: verify names the
  // strided segment, and a resume at tp4 drops this checkpoint and falls
  // back to step 1 (then ends as an unbroken run does).
  REQUIRE(!victim.is_null());
  const uint64_t off = victim.at("offset").get<uint64_t>() + 2 * victim.at("stride").get<uint64_t>() + 1;
  {
    std::fstream f(ck + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(off));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(std::streamoff(off));
    f.write(&c, 1);
  }
  const std::string why = Checkpointer::verify(ck);
  CHECK_THAT(why, Catch::Contains("model.safetensors: checksum mismatch") && Catch::Contains("runs of"));
  run_stage(dir.path(), kLlama41, "full_shard", 4, 4, true, {"checkpoint.interval=1"});
  const Run straight = run_tp(kLlama41, 1, 1, "no_shard");
  Run got;
  (void)load_model_safetensors(dir.path() + "/model.safetensors", got.weights);
  got.losses = straight.losses;  // the metrics file holds the replayed step twice
  check_same(got, straight);
}

TEST_CASE("tp: a tp2 checkpoint is written in whole rows, O(tensors) pwrites, and loads on 1 rank and tp2 x dp2",
          "[tp][checkpoint]") {
  // o_proj and down_proj are row-parallel: 64 rows per layer each, one run
  // per row on each tp2 rank. The TP group trades slices so that each
  // rank writes whole rows: the pwrites count ranges, not rows.
  const std::string model =
      "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 64, ffn_dim: 96, vocab_size: 23, seq_len: 8}";
  ModelConfig cfg = llama_cfg(4, 2, 96, 23, false);
  cfg.C = 64;
  const std::unique_ptr<ModelArch> arch = make_model_arch(cfg);
  const int64_t tensors = int64_t(arch->layout().tensors.size());
  int64_t runs = 0;  // the pieces of the global layout one tp2 rank holds: ~ one per row-parallel row
  for (const TpRun& r : TensorParallelPlan(*arch, 2, 0).runs()) runs += r.global >= 0;
  const int64_t bound = 2 /*ranks*/ * 3 /*kinds*/ * 2 * tensors;
  REQUIRE(2 * 3 * runs > 2 * bound);  // one pwrite per run would break the bound

  TempDir dir("tp_rows");
  const uint64_t before = Checkpointer::write_calls();
  run_stage(dir.path(), model, "full_shard", 2, 2, false);
  const uint64_t calls = Checkpointer::write_calls() - before;
  REQUIRE(latest_of(dir.path()) == "step_00000002");  // the one checkpoint of the run
  INFO(calls << " pwrites for 2 ranks, " << tensors << " tensors, " << runs << " runs a rank");
  CHECK(calls <= uint64_t(bound));
  const std::string ck = dir.path() + "/checkpoints/step_00000002";
  REQUIRE(Checkpointer::verify(ck).empty());
  // The manifest still has a strided segment per TP slice (a same-mesh
  // loader reads only its own): written whole, hashed by slice.
  int strided = 0;
  const nlohmann::json manifest = read_manifest(ck);
  for (const auto& g : manifest.at("files").at("model.safetensors").at("segments")) strided += g.contains("reps");
  CHECK(strided >= 2 * 2 * 2);  // 2 layers x (o_proj, down_proj) x 2 slices

  // It loads on other meshes and continues as the unbroken run does.
  const Run straight = run_tp(model, 1, 1, "no_shard");
  TempDir other("tp_rows_dp");
  std::filesystem::copy(dir.path(), other.path(), std::filesystem::copy_options::recursive |
                                                      std::filesystem::copy_options::overwrite_existing);
  run_stage(dir.path(), model, "no_shard", 1, 1, true);
  check_same(resumed_run(dir.path()), straight);
  run_stage(other.path(), model, "full_shard", 4, 2, true);
  check_same(resumed_run(other.path()), straight);
}

TEST_CASE("tp: a rank that fails inside a whole-row checkpoint stops its TP peer at once, not at a timeout",
          "[tp][checkpoint]") {
  // Rank 1 throws as its write of step 2 begins; rank 0 would otherwise wait
  // in the first row exchange for the communicator's timeout (60 s here).
  TempDir dir("tp_rows_fail");
  ::setenv("TRAINRUN_DEBUG_CKPT_THROW", "1:2:error", 1);
  const auto out = run_ranks_inprocess_outcomes(
      parse_job_spec(tp_job(dir.path(), kLlama41, "full_shard", 2, 0), "job.yaml", {"train.exit_interval=2"}), 2);
  ::unsetenv("TRAINRUN_DEBUG_CKPT_THROW");
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << " ended after " << out[r].seconds << " s: " << out[r].error);
    CHECK_THAT(out[r].error, Catch::Contains("checkpoint step 2 could not be written: rank 1: injected failure"));
    CHECK(out[r].seconds < 30);
  }
  CHECK(latest_of(dir.path()).empty());
}

TEST_CASE("tp: a manifest whose strided segments are malformed or do not tile the file is refused, naming it",
          "[tp][checkpoint]") {
  TempDir dir("tp_strided_bad");
  run_stage(dir.path(), kLlama41, "full_shard", 2, 2, false);
  const std::string ck = dir.path() + "/checkpoints/step_00000002";
  REQUIRE(Checkpointer::verify(ck).empty());
  const nlohmann::json good = read_manifest(ck);
  size_t at = 0;  // the first strided segment of model.safetensors
  const auto& segs = good.at("files").at("model.safetensors").at("segments");
  while (at < segs.size() && !segs[at].contains("reps")) ++at;
  REQUIRE(at < segs.size());
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"stride missing", [](nlohmann::json& g) { g.erase("stride"); }, "strided entry without a valid stride and reps"},
      {"reps zero", [](nlohmann::json& g) { g["reps"] = 0; }, "strided entry without a valid stride and reps"},
      {"one run short", [](nlohmann::json& g) { g["reps"] = g["reps"].get<uint64_t>() - 1; }, "do not tile the file: gap"},
      {"runs that overlap", [](nlohmann::json& g) { g["stride"] = g["bytes"].get<uint64_t>() - 4; }, "runs overlap"},
      {"a stride that lands on another rank's bytes",
       [](nlohmann::json& g) { g["stride"] = g["stride"].get<uint64_t>() + 4; }, "do not tile the file"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    nlohmann::json m = good;
    c.edit(m["files"]["model.safetensors"]["segments"][at]);
    write_file(ck + "/manifest.json", m.dump(2));
    const std::string why = Checkpointer::verify(ck);
    CHECK_THAT(why, Catch::Contains("model.safetensors") && Catch::Contains(c.message));
  }
  write_file(ck + "/manifest.json", good.dump(2));
  CHECK(Checkpointer::verify(ck).empty());
}

namespace {

// TRAINRUN_CPU_LOGITS_ALIGN for one scope (the in-process ranks share the
// environment): the CPU backend then pads as the CUDA backend does.
struct LogitsAlign {
  explicit LogitsAlign(int n) { ::setenv("TRAINRUN_CPU_LOGITS_ALIGN", std::to_string(n).c_str(), 1); }
  ~LogitsAlign() { ::unsetenv("TRAINRUN_CPU_LOGITS_ALIGN"); }
};

std::string with_vocab(std::string model, int v) {
  const std::string key = "vocab_size: 23";
  model.replace(model.find(key), key.size(), "vocab_size: " + std::to_string(v));
  return model;
}

Run run_padded(const std::string& model, int world, int tp, const std::string& strategy, int vocab, int group = 0) {
  TempDir dir("tp_pad");
  const JobSpec job = parse_job_spec(tp_job(dir.path(), model, strategy, tp, group, 6, vocab), "job.yaml");
  Run out;
  out.losses = run_ranks_inprocess(job, world)[0].losses;
  (void)load_model_safetensors(dir / "model.safetensors", out.weights);
  // Exactly vocab_size rows on disk: the final model file and the checkpoint.
  for (const std::string& f : {dir / "model.safetensors", dir / "checkpoints/step_00000006/model.safetensors"}) {
    INFO(f);
    const SafeTensorFile st = read_safetensors(f);
    for (const char* name : {"model.embed_tokens.weight", "transformer.wte.weight", "lm_head.weight"})
      if (const SafeTensor* t = st.find(name)) {
        INFO(name);
        CHECK(t->shape.at(0) == vocab);
      }
  }
  return out;
}

}  // namespace

TEST_CASE("tp: the vocabulary pads to lcm(tp, 64) under the CUDA rule (forced on the CPU) and trains as one rank does",
          "[tp][padding]") {
  {
    // The plan: 100 rows at tp2 and tp4 pad to 128 (64 | 128); 23 at tp4
    // pads to 64, leaving ranks 2 and 3 with padding only.
    const auto arch = make_model_arch(llama_cfg(4, 2, 24, 100, false));
    CHECK(TensorParallelPlan(*arch, 2, 1, 64).shape().V_pad == 128);
    CHECK(TensorParallelPlan(*arch, 4, 3, 64).shape().V_local == 32);
    CHECK(TensorParallelPlan(*arch, 4, 3, 64).shape().v_valid == 4);
    CHECK(TensorParallelPlan(*arch, 4, 3, 1).shape().V_pad == 100);
    const auto small = make_model_arch(llama_cfg(4, 2, 24, 23, false));
    CHECK(TensorParallelPlan(*small, 4, 2, 64).shape().v_valid == 0);
    CHECK(TensorParallelPlan(*small, 2, 0, 1).shape().V_pad == 24);
    check_coverage(*arch, 4);
  }
  for (int vocab : {100, 23}) {
    for (const std::string& model : {with_vocab(llama_model(2, "false"), vocab), with_vocab(llama_model(2, "true"), vocab),
                                     with_vocab(kGpt2Model, vocab)}) {
      INFO(model);
      const Run ref = run_padded(model, 1, 1, "no_shard", vocab);  // no padding at all
      LogitsAlign align(64);
      {
        INFO("tp2, vocab padded to 64-multiple");
        check_same(run_padded(model, 2, 2, "full_shard", vocab), ref);
      }
      {
        INFO("tp4, vocab padded to 64-multiple");
        check_same(run_padded(model, 4, 4, "shard_grad_op", vocab), ref);
      }
      {
        INFO("tp2 x dp2 hybrid_shard, vocab padded to 64-multiple");
        check_same(run_padded(model, 4, 2, "hybrid_shard", vocab, 1), ref);
      }
    }
  }
}

TEST_CASE("tp: TRAINRUN_CPU_LOGITS_ALIGN that is not a number is refused, naming it", "[tp][padding]") {
  ::setenv("TRAINRUN_CPU_LOGITS_ALIGN", "sixty-four", 1);
  std::string err;
  try {
    (void)make_backend("cpu", 0, nullptr);
  } catch (const Error& e) {
    err = e.what();
  }
  ::unsetenv("TRAINRUN_CPU_LOGITS_ALIGN");
  CHECK_THAT(err, Catch::Contains("TRAINRUN_CPU_LOGITS_ALIGN") && Catch::Contains("sixty-four"));
}

TEST_CASE("tp: the end-of-run sample at tp2 is the tp1 sample and `trainrun generate`'s on the same file",
          "[tp][sample]") {
  for (const char* model :
       {"{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 32, ffn_dim: 48, vocab_size: 61, seq_len: 32}",
        "{arch: gpt2, n_layer: 2, n_head: 4, n_embd: 32, vocab_size: 61, seq_len: 32}"}) {
    INFO(model);
    TempDir dir("tp_sample");
    std::vector<std::string> samples;
    for (int tp : {1, 2}) {
      INFO("tp" << tp);
      const SampleRun s = run_with_sample(dir, model, "tensor_parallel", tp);
      if (tp == 1) {
        CHECK(s.log.find("sample:\n" + s.generated) != std::string::npos);
      } else {
        CHECK(s.log.find("sample (tensor_parallel 2, pipeline_parallel 1: rank 0 decodes " + s.run +
                         "/model.safetensors):\n" + s.generated) != std::string::npos);
        CHECK(s.log.find("sample: skipped") == std::string::npos);
      }
      samples.push_back(s.generated);
    }
    // tp1 and tp2 train to the same weights (to float rounding), so the
    // same seed samples the same text.
    CHECK(samples[0] == samples[1]);
  }
}

TEST_CASE("tp: model.init_from (a Hugging Face directory) loads at tp2 as at tp1", "[tp][interop]") {
  TempDir dir("tp_init");
  // A trained GPT-2, exported: weights that are not the init's.
  const Run first = run_tp(kGpt2Model, 1, 1, "no_shard");
  const std::string hf = dir / "hf";
  {
    TempDir run("tp_init_run");
    const JobSpec job = parse_job_spec(tp_job(run.path(), kGpt2Model, "no_shard", 1, 0), "job.yaml");
    run_ranks_inprocess(job, 1);
    const auto r = run_command("'" + trainrun_binary() + "' export --checkpoint '" + run / "model.safetensors" +
                               "' --format safetensors --out '" + hf + "'");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
  }
  const std::vector<std::string> sets = {"model.init_from=" + hf, "train.max_steps=3"};
  const Run tp1 = run_tp(kGpt2Model, 1, 1, "full_shard", 0, sets);
  const Run tp2 = run_tp(kGpt2Model, 2, 2, "full_shard", 0, sets);
  CHECK(tp1.losses.front() < first.losses.front());  // it started from the trained weights
  check_same(tp2, tp1);
}

TEST_CASE("tp: model.init_from at tp2 drops a tensor's pages once per tensor, not once per row", "[tp][interop]") {
  // Llama: o_proj and down_proj are row-parallel, so a tp2 rank reads them
  // as one run per row (64 rows each per layer here).
  const std::string model =
      "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 64, ffn_dim: 96, vocab_size: 23, seq_len: 8}";
  TempDir dir("tp_init_pages");
  const std::string hf = dir / "hf";
  {
    TempDir run("tp_init_pages_run");
    const JobSpec job = parse_job_spec(tp_job(run.path(), model, "no_shard", 1, 0, 2), "job.yaml");
    run_ranks_inprocess(job, 1);
    const auto r = run_command("'" + trainrun_binary() + "' export --checkpoint '" + run / "model.safetensors" +
                               "' --format safetensors --out '" + hf + "'");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
  }
  ModelConfig cfg = llama_cfg(4, 2, 96, 23, false);
  cfg.C = 64;
  const std::unique_ptr<ModelArch> arch = make_model_arch(cfg);
  const int64_t tensors = int64_t(arch->layout().tensors.size());
  int64_t runs = 0;  // the pieces of the global layout one tp2 rank holds: ~ one per row-parallel row
  for (const TpRun& r : TensorParallelPlan(*arch, 2, 0).runs()) runs += r.global >= 0;
  REQUIRE(runs >= 4 * tensors);  // so that one call per row would break the bound below

  const std::vector<std::string> sets = {"model.init_from=" + hf, "train.max_steps=1"};
  const Run tp1 = run_tp(model, 1, 1, "full_shard", 0, sets);
  const uint64_t before = MappedSafeTensors::drop_pages_calls();
  const Run tp2 = run_tp(model, 2, 2, "full_shard", 0, sets);
  const uint64_t calls = MappedSafeTensors::drop_pages_calls() - before;
  INFO(calls << " madvise calls for 2 ranks, " << tensors << " tensors, " << runs << " runs a rank");
  CHECK(calls >= uint64_t(tensors));         // the pages are dropped
  CHECK(calls <= uint64_t(2 * 2 * tensors));  // per tensor (and held range), per rank
  check_same(tp2, tp1);
}

TEST_CASE("tp: bad meshes are clear errors", "[tp]") {
  using Catch::Matchers::Contains;
  TempDir dir("tp_bad");
  SECTION("world size not divisible by tensor_parallel x pipeline_parallel") {
    const JobSpec job = parse_job_spec(tp_job(dir.path(), kGpt2Model, "full_shard", 2, 0), "job.yaml",
                                       {"train.global_batch_size=6"});
    CHECK_THROWS_WITH(run_ranks_inprocess(job, 3),
                      Contains("the world size (3 ranks) is not divisible by parallel.tensor_parallel (2)"));
  }
  SECTION("heads not divisible by the degree") {
    const JobSpec job = parse_job_spec(tp_job(dir.path(), kGpt2Model, "full_shard", 3, 0), "job.yaml",
                                       {"train.global_batch_size=6"});
    CHECK_THROWS_WITH(run_ranks_inprocess(job, 3),
                      Contains("model.n_head (4) is not divisible by parallel.tensor_parallel (3)"));
  }
  SECTION("the zero_bubble pipeline schedule with activation checkpointing is refused at load") {
    CHECK_THROWS_WITH(parse_job_spec(tp_job(dir.path(), kGpt2Model, "full_shard", 1, 0), "job.yaml",
                                     {"parallel.pipeline_parallel=2", "parallel.pipeline_schedule=zero_bubble",
                                      "train.activation_checkpointing=blocks"}),
                      Contains("parallel.pipeline_schedule") && Contains("zero_bubble with train.activation_checkpointing"));
  }
  SECTION("sequence parallelism needs the micro-batch's tokens to split over the group") {
    const JobSpec job = parse_job_spec(tp_job(dir.path(), llama_model(2, "true"), "full_shard", 2, 0), "job.yaml",
                                       {"parallel.sequence_parallel=true", "model.seq_len=7", "train.micro_batch_size=1"});
    CHECK_THROWS_WITH(run_ranks_inprocess(job, 2), Contains("tokens (train.micro_batch_size x model.seq_len) do not "
                                                            "split over parallel.tensor_parallel (2)"));
  }
  SECTION("sequence parallelism with tp1 is only a warning") {
    CHECK_NOTHROW(parse_job_spec(tp_job(dir.path(), kGpt2Model, "full_shard", 1, 0), "job.yaml",
                                 {"parallel.sequence_parallel=true"}));
  }
}

// ---- failures inside the tensor-parallel group ---------------------------------------------

namespace {
std::string tp_binary_job(const std::string& dir) {
  return "backend: cpu\n"
         "model: {arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 23, "
         "seq_len: 8}\n"
         "data: {format: synthetic}\n"
         "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 5, log_interval: 1, eval_interval: 0, "
         "eval_steps: 1, warmup_steps: 1}\n"
         "parallel: {nproc_per_node: 2, tensor_parallel: 2, sharding: full_shard, timeout_s: 60}\n"
         "output: {dir: '" + dir + "/run', sample_tokens: 0}\n";
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

TEST_CASE("tp: a failed TP collective or a dead TP peer ends the job within the timeout, naming it", "[tp][faults]") {
  using Catch::Matchers::Contains;
  TempDir dir("tp_fault");
  write_file(dir / "job.yaml", tp_binary_job(dir.path()));
  SECTION("rank 1's tp0 collective of step 2 fails after returning") {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_COMM_FAULT=tp0:1:2 '" + trainrun_binary() +
                               "' --config '" + dir / "job.yaml" + "'");
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(seconds_since(t0) < 30);  // well inside parallel.timeout_s
    // Rank 1 stops at its next TP call; rank 0, inside a tp0 collective
    // with it, loses the connection: whichever exits first, the report
    // names the group and the step, and rank 1's log the injected failure.
    CHECK_THAT(r.err, Contains("group tp0") && Contains("step 2"));
    CHECK_THAT(read_file(dir / "run/logs/rank1.log"), Contains("group tp0") && Contains("injected failure"));
  }
  SECTION("a model that does not split is refused once, before any worker starts") {
    std::string job = tp_binary_job(dir.path());
    job.replace(job.find("nproc_per_node: 2, tensor_parallel: 2"), 37, "nproc_per_node: 3, tensor_parallel: 3");
    job.replace(job.find("global_batch_size: 4"), 20, "global_batch_size: 6");
    write_file(dir / "job3.yaml", job);
    const auto r = run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() + "' --config '" + dir / "job3.yaml" + "'");
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("model.n_head (4) is not divisible by parallel.tensor_parallel (3)"));
    CHECK_FALSE(file_exists(dir / "run/logs"));
  }
  SECTION("rank 1 dies at step 2: its TP peer stops in the collective it was waiting in") {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_FAIL_RANK=1 TRAINRUN_DEBUG_FAIL_STEP=2 '" +
                               trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(seconds_since(t0) < 30);
    CHECK_THAT(r.err, Contains("rank 1 (pid ") && Contains("failed first") && Contains("rank 1 fails at step 2"));
  }
}
