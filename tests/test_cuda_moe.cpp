// The CUDA backend's mixture-of-experts ops (kernels/cuda/cuda_moe.cpp)
// against the CPU backend's (kernels/cpu/cpu_moe.cpp, the numerical
// reference), on fresh random inputs, with the routings that break a naive
// kernel: an expert no token chose, every token on one expert, exact ties in
// the router's scores (ties go to the lower expert id), E above the warp
// width (128 experts), and odd channel counts (the unvectorised paths).
// Then a tiny Mixtral and a tiny Qwen2-MoE train 5 steps on both backends,
// and at ep2 over NCCL (2 GPUs) against the CPU's one-rank run.
//
// The harness is tests/support/cuda_compare.h (test_cuda_ops.cpp's): inputs
// hold the same values on both backends, GPU outputs are poisoned with NaN
// first, accumulated outputs are pre-filled. Tolerances: kF32 for fp32
// outputs from identical inputs, kBf16 for one bf16 rounding, kLoss for the
// loss curves; the integer outputs (top-k ids, positions, offsets) and the
// permuted copy must be equal exactly: the order of the permute is part of
// the contract (stable: within an expert, pair order).
//
// Without a usable GPU every case prints "SKIPPED: no usable GPU: <reason>"
// and CTest counts it as skipped. Not yet run on a GPU (docs/gpu-results.md).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/model/model_spec.h"
#include "core/train/trainer.h"
#include "kernels/backend.h"
#include "tests/support/cuda_compare.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::cuda_cmp;

namespace {

std::vector<int32_t> read_i32(Backend* be, const void* p, size_t n) {
  std::vector<int32_t> v(n);
  be->copy_to_host(v.data(), p, n * 4);
  be->synchronize();
  return v;
}

// An int32 output on both backends, the GPU's poisoned (-1 everywhere).
struct IntOut {
  DeviceBuffer c, g;
  size_t n;
  IntOut(Pair& p, size_t count) : c(p.cpu.get(), std::max<size_t>(1, count) * 4), g(p.gpu.get(), std::max<size_t>(1, count) * 4), n(count) {
    poison(p.gpu.get(), g.get(), g.bytes());
  }
  int32_t* cp() const { return c.as<int32_t>(); }
  int32_t* gp() const { return g.as<int32_t>(); }
};

void check_equal_ints(const std::string& what, Pair& p, const IntOut& o) {
  const auto want = read_i32(p.cpu.get(), o.c.get(), o.n), got = read_i32(p.gpu.get(), o.g.get(), o.n);
  size_t diff = 0;
  for (size_t i = 0; i < o.n; ++i) diff += got[i] != want[i];
  std::printf("  %-58s %zu of %zu differ\n", what.c_str(), diff, o.n);
  INFO(what << ": " << diff << " of " << o.n << " int32 values differ from the CPU's");
  CHECK(diff == 0);
}

}  // namespace

TEST_CASE("cuda moe: router softmax, top-k (ties to the lower id), its backward, stats and aux loss equal the CPU's",
          "[cuda][moe]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct Shape { int N, E, K; bool renorm; };
  for (const Shape s : {Shape{111, 8, 2, true}, Shape{37, 60, 4, false}, Shape{19, 128, 8, true}}) {
    const std::string tag = shape({{"N", s.N}, {"E", s.E}, {"K", s.K}, {"renorm", s.renorm}});
    const int N = s.N, E = s.E, K = s.K;
    Vec logits = randn(size_t(N) * E, 100 + E, 2.0f);
    std::fill_n(logits.begin(), E, 0.5f);             // token 0: every score tied -> ids 0..K-1
    for (int e = 0; e < E; ++e) logits[size_t(E) + e] = -1.f;
    logits[size_t(E) + 3] = logits[size_t(E) + E - 1] = 4.f;  // token 1: a tie for first -> 3 before E-1
    const Twin x(p, logits, true);
    Twin probs = out_twin(p, size_t(N) * E, false), lse = out_twin(p, N, false), w = out_twin(p, size_t(N) * K, false);
    IntOut idx(p, size_t(N) * K);
    p.cpu->moe_route_forward(probs.cf(), lse.cf(), idx.cp(), w.cf(), x.c(), N, E, K, s.renorm);
    p.gpu->moe_route_forward(probs.gf(), lse.gf(), idx.gp(), w.gf(), x.g(), N, E, K, s.renorm);
    check_close("route probs, " + tag, probs.read_gpu(p), probs.read_cpu(p), kF32);
    check_close("route lse, " + tag, lse.read_gpu(p), lse.read_cpu(p), kF32);
    check_equal_ints("route top-k ids, " + tag, p, idx);
    check_close("route weights, " + tag, w.read_gpu(p), w.read_cpu(p), kF32);
    const auto ids = read_i32(p.gpu.get(), idx.g.get(), idx.n);
    for (int j = 0; j < K; ++j) CHECK(ids[size_t(j)] == j);  // the all-tied token
    CHECK(ids[size_t(K)] == 3);
    CHECK(ids[size_t(K) + 1] == E - 1);

    // The backward from the CPU's routing on both sides (so only the op differs).
    const Twin cprobs(p, probs.read_cpu(p), false), clse(p, lse.read_cpu(p), false);
    const Tok cidx(p, read_i32(p.cpu.get(), idx.c.get(), idx.n));
    const Twin dw(p, randn(size_t(N) * K, 7), false), aux(p, randn(E, 8, 0.1f), false);
    for (const bool with_aux : {false, true}) {
      Twin dl = out_twin(p, size_t(N) * E, true);
      p.cpu->moe_route_backward(dl.c(), dw.cf(), cprobs.cf(), clse.cf(), cidx.cp(), with_aux ? aux.cf() : nullptr,
                                0.3f, N, E, K, s.renorm);
      p.gpu->moe_route_backward(dl.g(), dw.gf(), cprobs.gf(), clse.gf(), cidx.gp(), with_aux ? aux.gf() : nullptr,
                                0.3f, N, E, K, s.renorm);
      check_close("route backward dlogits" + std::string(with_aux ? " +aux" : "") + ", " + tag, dl.read_gpu(p),
                  dl.read_cpu(p), kBf16);
    }

    // Stats accumulate (pre-filled); the counts must be exact.
    Twin stats(p, randn(size_t(2 * E + 1), 9), false);
    p.cpu->moe_router_stats(stats.cf(), cprobs.cf(), clse.cf(), cidx.cp(), N, E, K);
    p.gpu->moe_router_stats(stats.gf(), cprobs.gf(), clse.gf(), cidx.gp(), N, E, K);
    const Vec sg = stats.read_gpu(p), sc = stats.read_cpu(p);
    check_close("router stats (counts, prob sums, lse^2), " + tag, sg, sc, kF32);
    CHECK(Vec(sg.begin(), sg.begin() + E) == Vec(sc.begin(), sc.begin() + E));

    // The losses over "two layers" of these tokens, from the CPU's stats.
    const Twin cst(p, sc, false);
    Twin out = out_twin(p, 2, false), agrad = out_twin(p, E, false);
    Twin losses(p, randn(N, 10), false);
    p.cpu->moe_aux_loss(out.cf(), agrad.cf(), losses.cf(), N, cst.cf(), 2 * int64_t(N), E, 0.02f, 0.001f, 0.5f);
    p.gpu->moe_aux_loss(out.gf(), agrad.gf(), losses.gf(), N, cst.gf(), 2 * int64_t(N), E, 0.02f, 0.001f, 0.5f);
    check_close("aux loss [aux, z], " + tag, out.read_gpu(p), out.read_cpu(p), kF32);
    check_close("aux loss per-token losses +=, " + tag, losses.read_gpu(p), losses.read_cpu(p), kF32);
    check_close("aux loss gradient on the probabilities, " + tag, agrad.read_gpu(p), agrad.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda moe: permute order and offsets, unpermute and both backwards equal the CPU's (an empty expert, all "
          "tokens on one expert)",
          "[cuda][moe]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct Routing { std::string what; int N, K, E, C; std::vector<int32_t> idx; };
  std::vector<Routing> cases;
  {
    Routing r{"random, expert 3 unused, C 40 (16-byte packs)", 111, 2, 8, 40, {}};
    std::mt19937 gen(5);
    std::vector<int> experts = {0, 1, 2, 4, 5, 6, 7};
    for (int t = 0; t < r.N; ++t) {
      std::shuffle(experts.begin(), experts.end(), gen);
      r.idx.push_back(experts[0]), r.idx.push_back(experts[1]);
    }
    cases.push_back(r);
  }
  cases.push_back({"every token on expert 5 (K 1), C 19 (scalar path)", 37, 1, 8, 19, std::vector<int32_t>(37, 5)});
  {
    Routing r{"every token on experts 5 and 2 (the rest empty), C 64", 53, 2, 8, 64, {}};
    for (int t = 0; t < r.N; ++t) r.idx.push_back(t % 2 ? 5 : 2), r.idx.push_back(t % 2 ? 2 : 5);
    cases.push_back(r);
  }
  for (const Routing& r : cases) {
    const int N = r.N, K = r.K, E = r.E, C = r.C;
    const size_t R = size_t(N) * K;
    const Tok idx(p, r.idx);
    const Twin x(p, randn(size_t(N) * C, 20), true);
    IntOut pos(p, R), offsets(p, size_t(E) + 1);
    Twin xp = out_twin(p, R * C, true);
    p.cpu->moe_permute(pos.cp(), offsets.cp(), xp.c(), idx.cp(), x.c(), N, K, E, C);
    p.gpu->moe_permute(pos.gp(), offsets.gp(), xp.g(), idx.gp(), x.g(), N, K, E, C);
    check_equal_ints("permute positions, " + r.what, p, pos);
    check_equal_ints("permute offsets, " + r.what, p, offsets);
    CHECK(rel_err(xp.read_gpu(p), xp.read_cpu(p)) == 0);  // a copy: bit for bit

    const Tok cpos(p, read_i32(p.cpu.get(), pos.c.get(), R));
    Twin dx(p, randn(size_t(N) * C, 21), true);  // accumulates
    const Twin dxp(p, randn(R * C, 22), true);
    p.cpu->moe_permute_backward(dx.c(), dxp.c(), cpos.cp(), N, K, C);
    p.gpu->moe_permute_backward(dx.g(), dxp.g(), cpos.gp(), N, K, C);
    check_close("permute backward dx +=, " + r.what, dx.read_gpu(p), dx.read_cpu(p), kBf16);

    const Twin yp(p, randn(R * C, 23), true), w(p, randn(R, 24), false);
    Twin out = out_twin(p, size_t(N) * C, true);
    p.cpu->moe_unpermute_forward(out.c(), yp.c(), cpos.cp(), w.cf(), N, K, C);
    p.gpu->moe_unpermute_forward(out.g(), yp.g(), cpos.gp(), w.gf(), N, K, C);
    check_close("unpermute forward, " + r.what, out.read_gpu(p), out.read_cpu(p), kBf16);

    const Twin dout(p, randn(size_t(N) * C, 25), true);
    Twin dyp = out_twin(p, R * C, true), dw = out_twin(p, R, false);
    p.cpu->moe_unpermute_backward(dyp.c(), dw.cf(), dout.c(), yp.c(), cpos.cp(), w.cf(), N, K, C);
    p.gpu->moe_unpermute_backward(dyp.g(), dw.gf(), dout.g(), yp.g(), cpos.gp(), w.gf(), N, K, C);
    check_close("unpermute backward dyp, " + r.what, dyp.read_gpu(p), dyp.read_cpu(p), kBf16);
    check_close("unpermute backward dw, " + r.what, dw.read_gpu(p), dw.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda moe: grouped expert GEMM forward and backward equal the CPU's per-expert GEMMs", "[cuda][moe]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  struct Case { std::vector<int32_t> counts; int IC, OC; };
  for (const Case& k : {Case{{5, 0, 37, 1, 0, 20}, 40, 24}, Case{{0, 0, 63, 0, 0, 0}, 19, 37},
                        Case{{3, 9, 1, 0, 11, 2}, 64, 128}}) {
    const int E = int(k.counts.size()), IC = k.IC, OC = k.OC;
    std::vector<int32_t> off(size_t(E) + 1, 0);
    std::partial_sum(k.counts.begin(), k.counts.end(), off.begin() + 1);
    const size_t R = size_t(off.back());
    std::string counts;
    for (int32_t c : k.counts) counts += (counts.empty() ? "" : ",") + std::to_string(c);
    const std::string tag = "rows " + counts + " " + shape({{"IC", IC}, {"OC", OC}});
    const Tok offsets(p, off);
    const Twin in(p, randn(R * IC, 30), true), w(p, randn(size_t(E) * OC * IC, 31, 0.2f), true);
    Twin out = out_twin(p, R * OC, true);
    p.cpu->moe_expert_matmul_forward(out.c(), in.c(), w.c(), offsets.cp(), E, IC, OC);
    p.gpu->moe_expert_matmul_forward(out.g(), in.g(), w.g(), offsets.gp(), E, IC, OC);
    check_close("grouped GEMM forward, " + tag, out.read_gpu(p), out.read_cpu(p), kBf16);

    const Twin dout(p, randn(R * OC, 32), true);
    Twin din = out_twin(p, R * IC, true);
    Twin dw(p, randn(size_t(E) * OC * IC, 33), false);  // accumulates; an empty expert's stays as it was
    p.cpu->moe_expert_matmul_backward(din.c(), dw.cf(), dout.c(), in.c(), w.c(), offsets.cp(), E, IC, OC);
    p.gpu->moe_expert_matmul_backward(din.g(), dw.gf(), dout.g(), in.g(), w.g(), offsets.gp(), E, IC, OC);
    check_close("grouped GEMM backward din, " + tag, din.read_gpu(p), din.read_cpu(p), kBf16);
    check_close("grouped GEMM backward dw +=, " + tag, dw.read_gpu(p), dw.read_cpu(p), kF32);
    // dw alone (din null, as the first layer's input gradient that nobody needs).
    p.cpu->moe_expert_matmul_backward(nullptr, dw.cf(), dout.c(), in.c(), nullptr, offsets.cp(), E, IC, OC);
    p.gpu->moe_expert_matmul_backward(nullptr, dw.gf(), dout.g(), in.g(), nullptr, offsets.gp(), E, IC, OC);
    check_close("grouped GEMM backward dw only, " + tag, dw.read_gpu(p), dw.read_cpu(p), kF32);
  }
}

TEST_CASE("cuda moe: the shared expert's sigmoid gate forward (+=) and backward equal the CPU's", "[cuda][moe]") {
  CUDA_TEST_OR_SKIP();
  Pair p;
  for (const int C : {19, 64}) {
    const int N = 111;
    const std::string tag = shape({{"N", N}, {"C", C}});
    const Twin y(p, randn(size_t(N) * C, 40), true), g(p, randn(N, 41, 3.0f), true);
    Twin out(p, randn(size_t(N) * C, 42), true);  // accumulates
    p.cpu->moe_sigmoid_gate_forward(out.c(), y.c(), g.c(), N, C);
    p.gpu->moe_sigmoid_gate_forward(out.g(), y.g(), g.g(), N, C);
    check_close("sigmoid gate forward +=, " + tag, out.read_gpu(p), out.read_cpu(p), kBf16);
    const Twin dout(p, randn(size_t(N) * C, 43), true);
    Twin dy = out_twin(p, size_t(N) * C, true), dg = out_twin(p, N, true);
    p.cpu->moe_sigmoid_gate_backward(dy.c(), dg.c(), dout.c(), y.c(), g.c(), N, C);
    p.gpu->moe_sigmoid_gate_backward(dy.g(), dg.g(), dout.g(), y.g(), g.g(), N, C);
    check_close("sigmoid gate backward dy, " + tag, dy.read_gpu(p), dy.read_cpu(p), kBf16);
    check_close("sigmoid gate backward dg, " + tag, dg.read_gpu(p), dg.read_cpu(p), kBf16);
  }
}

namespace {
// parallel: extra "key: v, " entries of the parallel map (ep runs).
std::string moe_job(const std::string& dir, const std::string& backend, const std::string& model,
                    const std::string& parallel = "") {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 61, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 4, max_steps: 5, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 1, eval_interval: 0, eval_steps: 1, log_interval: 1, grad_clip: 1.0}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: no_shard, " + parallel + "timeout_s: 60}\n"
         "backend: " + backend + "\n";
}
TrainSummary train_moe(const std::string& backend, const std::string& model) {
  test::TempDir dir("cuda_moe_train");
  return run_training(parse_job_spec(moe_job(dir.path(), backend, model), "job.yaml"), WorkerInfo{});
}
}  // namespace

TEST_CASE("cuda moe: 5 steps of a tiny Mixtral and Qwen2-MoE (aux and z losses on) track the CPU backend's losses",
          "[cuda][moe][train]") {
  CUDA_TEST_OR_SKIP();
  const std::string common = "n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 64, vocab_size: 61, seq_len: 32, "
                             "router_aux_loss_coef: 0.02, router_z_loss_coef: 0.001";
  for (const std::string& model :
       {"{arch: mixtral, " + common + ", ffn_dim: 64, n_experts: 4, n_experts_per_tok: 2}",
        "{arch: qwen2_moe, " + common + ", ffn_dim: 64, moe_ffn_dim: 32, shared_expert_ffn_dim: 48, n_experts: 6, "
        "n_experts_per_tok: 3}"}) {
    const TrainSummary cpu = train_moe("cpu", model), gpu = train_moe("cuda", model);
    REQUIRE(gpu.losses.size() == cpu.losses.size());
    double worst = 0;
    for (size_t i = 0; i < cpu.losses.size(); ++i)
      worst = std::max(worst, std::fabs(gpu.losses[i] - cpu.losses[i]) / std::fabs(cpu.losses[i]));
    std::printf("  %-58s max rel diff %.3e (tol %.0e); loss %.4f -> %.4f (cpu %.4f -> %.4f)\n",
                model.substr(0, 58).c_str(), worst, kLoss, gpu.losses.front(), gpu.losses.back(), cpu.losses.front(),
                cpu.losses.back());
    INFO(model);
    CHECK(worst <= kLoss);
  }
}

TEST_CASE("cuda moe: ep2 over NCCL (grouped send/recv token exchange) matches the CPU's one-rank run, also with every "
          "token on one expert",
          "[cuda][moe][ep][train]") {
  CUDA_TEST_OR_SKIP_BELOW(2);
  // Mixtral (4 experts, top-2: ep rank r runs experts 2r, 2r+1), and the
  // same at top-1 from a checkpoint whose routers are 0 (every probability
  // 1/4, the tie to expert 0: ep rank 0 receives every row of the group in
  // the first step, ep rank 1 none, so rank 0's landing buffers grow past
  // the balanced plan; test_expert_parallel's case on the CPU).
  const std::string common = "n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 64, vocab_size: 61, seq_len: 32, "
                             "ffn_dim: 64, n_experts: 4, router_aux_loss_coef: 0.02, router_z_loss_coef: 0.001";
  const std::string top2 = "{arch: mixtral, " + common + ", n_experts_per_tok: 2}";
  test::TempDir hf("cuda_ep_hf");
  {
    JobSpec shape = parse_job_spec(moe_job(hf.path(), "cpu", top2), "job.yaml");
    resolve_model_shape(shape, false);
    const ModelConfig cfg = ModelConfig::from_spec(shape.model);
    const auto arch = make_model_arch(cfg);
    std::vector<float> w(size_t(arch->layout().total));
    arch->init_params(3, 0, arch->layout().total, w.data());
    for (const ParamTensor& t : arch->layout().tensors)
      if (t.name.find("block_sparse_moe.gate.") != std::string::npos) std::fill_n(w.begin() + t.offset, t.numel, 0.f);
    export_hf(hf / "model", cfg, w);
  }
  const std::string one = "{arch: mixtral, init_from: '" + (hf / "model") + "', n_experts_per_tok: 1, "
                          "router_aux_loss_coef: 0.02, router_z_loss_coef: 0.001}";
  auto job = [](const std::string& dir, const std::string& backend, const std::string& model,
                const std::string& parallel) {
    JobSpec j = parse_job_spec(moe_job(dir, backend, model, parallel), "job.yaml");
    resolve_model_shape(j, false);
    return j;
  };
  for (const std::string& model : {top2, one}) {
    INFO(model);
    test::TempDir cpu_dir("cuda_ep_cpu"), gpu_dir("cuda_ep_nccl");
    const TrainSummary cpu = run_training(job(cpu_dir.path(), "cpu", model, ""), WorkerInfo{});
    // Thread r is rank r on GPU r; ep2 inside dp2 (the dp reduction adds each expert's gradient from its rank).
    const std::vector<TrainSummary> out =
        test::run_ranks_inprocess(job(gpu_dir.path(), "cuda", model, "expert_parallel: 2, "), 2);
    REQUIRE(out[0].losses.size() == cpu.losses.size());
    double worst = 0;
    for (size_t i = 0; i < cpu.losses.size(); ++i)
      worst = std::max(worst, std::fabs(out[0].losses[i] - cpu.losses[i]) / std::fabs(cpu.losses[i]));
    std::printf("  ep2 over NCCL, %s: max rel diff %.3e against the CPU (tol %.0e)\n",
                model == one ? "top-1, every token on expert 0" : "top-2", worst, kLoss);
    CHECK(worst <= kLoss);
  }
}
