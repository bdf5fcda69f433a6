// Context parallelism in the networks and the trainer (issue 27): GPT-2
// and Llama (GQA 2:1) computing T / cp rows per sequence with attention
// through the cp group, against the one-rank network and the one-rank run.
//   - the networks: losses and step-1 gradients at cp2 and cp4, ring and
//     all_to_all, causal and with documents (random lengths, documents
//     longer than a chunk, boundaries on chunk edges), with activation
//     checkpointing; their activation arenas at cp4 against one rank's;
//     the models cp cannot compute yet refused by name;
//   - the trainer: 5-step losses and final weights at cp2 / cp4 (both
//     modes), with document masks, cp2 x tp2, cp2 x dp2 full_shard, cp2 x
//     pp2, with checkpointing and offload; a cp2 checkpoint resumed at cp1
//     and back;
//   - the stores' mesh (cp folded into dp);
//   - `plan`: the per-rank arena formula against the networks', the cp rows
//     and the mesh it recommends for Llama 3.1 8B at T = 131072;
//   - a rank killed inside the ring (the real binary and its agent).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/model/model_shape.h"
#include "core/train/planner.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "parallel/context/cp_attention.h"
#include "parallel/context/sequence_split.h"
#include "parallel/mesh/device_mesh.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/cp_runs.h"
#include "tests/support/cp_docs.h"
#include "tests/support/device_io.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
using Catch::Matchers::Contains;

namespace {

// ---- the networks against the one-rank network ------------------------------------------------

ModelConfig tiny(const std::string& arch, int T = 32) {
  ModelConfig c;
  c.arch = arch;
  c.L = 2, c.NH = 4, c.C = 16, c.V = 23, c.T = T;
  if (arch == "llama") c.NKV = 2, c.F = 24, c.tied = false;
  return c;
}

}  // namespace

TEST_CASE("cp: the networks at cp2 and cp4 (ring, all_to_all) give the one-rank losses and step-1 gradients, "
          "causal and with documents", "[cp][network]") {
  double worst_loss = 0, worst_grad = 0;
  for (const char* a : {"gpt2", "llama"}) {
    const auto arch = make_model_arch(tiny(a));
    for (bool docs : {false, true}) {
      const Batch b = make_batch(32, docs, 5);
      const NetResult ref = one_rank(*arch, b);
      for (int cp : {2, 4})
        for (const char* mode : {"ring", "all_to_all"}) {
          const NetResult got = cp_ranks(*arch, b, cp, mode);
          const double el = max_rel(got.losses, ref.losses), eg = max_rel(got.grads, ref.grads);
          INFO(a << " cp" << cp << " " << mode << (docs ? " documents" : " causal") << ": losses max rel err " << el
                 << ", gradients " << eg);
          CHECK(el <= 1e-5);
          CHECK(eg <= 1e-5);
          worst_loss = std::max(worst_loss, el), worst_grad = std::max(worst_grad, eg);
        }
    }
  }
  WARN("networks under cp: losses max rel err " << worst_loss << ", step-1 gradients " << worst_grad);
}

TEST_CASE("cp: activation checkpointing composes (the recompute goes round the ring again)", "[cp][network]") {
  for (const char* a : {"gpt2", "llama"}) {
    const auto arch = make_model_arch(tiny(a));
    const Batch b = make_batch(32, true, 9);
    const NetResult ref = one_rank(*arch, b);
    for (const char* mode : {"ring", "all_to_all"}) {
      const NetResult got = cp_ranks(*arch, b, 2, mode, /*ckpt=*/true);
      INFO(a << " " << mode);
      CHECK(max_rel(got.losses, ref.losses) <= 1e-5);
      CHECK(max_rel(got.grads, ref.grads) <= 1e-5);
    }
  }
}

TEST_CASE("cp: a rank's activation arena at cp4 is at most 0.3x the one-rank network's", "[cp][network][memory]") {
  for (const char* a : {"gpt2", "llama"}) {
    for (const char* mode : {"ring", "all_to_all"}) {
      ModelConfig c = tiny(a, 256);
      c.C = 64;
      const auto arch = make_model_arch(c);
      const Batch b = make_batch(256, false, 3);
      const NetResult ref = one_rank(*arch, b), got = cp_ranks(*arch, b, 4, mode);
      const double ratio = double(got.act_bytes) / double(ref.act_bytes);
      INFO(a << " " << mode << ": cp4 rank 0 " << got.act_bytes << " bytes, one rank " << ref.act_bytes << " (ratio "
             << ratio << ")");
      CHECK(ratio <= 0.3);
      WARN(a << " T=256 C=64 " << mode << ": activations per rank at cp4 " << got.act_bytes << " B vs one rank "
             << ref.act_bytes << " B = " << ratio << "x");
    }
  }
}

TEST_CASE("cp: a sequence length that does not split into 2 x cp chunks is refused by name", "[cp][network]") {
  // (The sliding window, soft-cap and query scale compute under cp: test_cp_window.)
  ModelConfig odd = tiny("gpt2", 30);  // not a multiple of 2 x cp
  const auto errors = run_gloo_group(2, "cp0", std::chrono::seconds(10), [&](Communicator& comm) {
    ContextParallel ctx;
    ctx.comm = &comm;
    auto arch = make_model_arch(odd);
    auto be1 = make_cpu_backend(1);
    (void)arch->make_network(be1.get(), 1, false, nullptr, nullptr, &ctx);
  });
  CHECK_THAT(errors[0], Contains("model.seq_len 30 is not a multiple of 2 x parallel.context_parallel (4)"));
}

// ---- the stores' mesh -------------------------------------------------------------------------

TEST_CASE("cp: the stores' mesh folds cp into dp: its dp group is the job mesh's dp x cp ranks", "[cp][mesh]") {
  for (const char* sharding : {"no_shard", "full_shard", "hybrid_shard"}) {
    const MeshDims job = plan_mesh(16, 2, 1, sharding, std::string(sharding) == "hybrid_shard" ? 2 : 1, 2);
    const MeshDims folded = fold_context_parallel(job);
    INFO(sharding << ": " << job.describe() << " -> " << folded.describe());
    CHECK(folded.cp == 1);
    CHECK(folded.world() == 16);
    CHECK(folded.dp() == job.dp() * 2);
    for (int r = 0; r < 16; ++r) {
      const DeviceMesh f(folded, r), m(job, r);
      // The folded dp group = every rank of the job mesh with this rank's pp and tp.
      std::vector<int> want;
      for (int q = 0; q < 16; ++q) {
        const DeviceMesh o(job, q);
        if (o.coord(MeshDim::tp) == m.coord(MeshDim::tp) && o.coord(MeshDim::pp) == m.coord(MeshDim::pp))
          want.push_back(q);
      }
      CHECK(f.dp_group_ranks() == want);
      CHECK(f.dp_coord() == m.dp_coord() * 2 + m.coord(MeshDim::cp));  // the trainer's data index and cp index
      CHECK(f.coord(MeshDim::tp) == m.coord(MeshDim::tp));
    }
  }
  const MeshDims none = plan_mesh(8, 2, 1, "full_shard", 1, 1);
  CHECK(fold_context_parallel(none).describe() == none.describe());
}

// ---- the trainer against the one-rank run -----------------------------------------------------

namespace {

const char* kGpt2 = "{arch: gpt2, n_layer: 2, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 16}";
const char* kLlama = "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 23, "
                     "seq_len: 16, tie_embeddings: false}";


}  // namespace

TEST_CASE("cp: gpt2 and llama GQA train at cp2 and cp4 (ring, all_to_all) as one rank does", "[cp][train]") {
  for (const char* model : {kGpt2, kLlama}) {
    const Run ref = run_job(model, 1, false, {});
    REQUIRE(ref.losses.size() == 5);
    CHECK(ref.losses.back() < ref.losses.front());
    for (int cp : {2, 4})
      for (const char* mode : {"ring", "all_to_all"}) {
        INFO(model << " cp" << cp << " " << mode);
        check_same_run("cp", run_job(model, cp, false, cp_sets(cp, mode)), ref);
      }
  }
}

TEST_CASE("cp: with document masks (random lengths, documents across chunks) cp trains as one rank does",
          "[cp][train][docmask]") {
  for (const char* model : {kGpt2, kLlama}) {
    const Run ref = run_job(model, 1, true, {});
    const Run nodocs = run_job(model, 1, false, {});
    CHECK(std::fabs(ref.losses.back() - nodocs.losses.back()) > 1e-4);  // the mask changes the run
    {
      INFO(model << " cp2 ring");
      check_same_run("cp", run_job(model, 2, true, cp_sets(2, "ring")), ref);
    }
    {
      INFO(model << " cp4 all_to_all");
      check_same_run("cp", run_job(model, 4, true, cp_sets(4, "all_to_all")), ref);
    }
  }
}

TEST_CASE("cp: cp2 x tp2 (and SP), cp2 x dp2 full_shard and hybrid_shard, cp2 x pp2, and with checkpointing and offload, train as one rank does",
          "[cp][train]") {
  for (const char* model : {kGpt2, kLlama}) {
    const Run ref = run_job(model, 1, true, {});
    {
      INFO(model << " cp2 x tp2 (ring)");
      check_same_run("cp", run_job(model, 4, true, cp_sets(2, "ring", {"parallel.tensor_parallel=2"})), ref);
    }
    {
      INFO(model << " cp2 x tp2 with sequence parallelism (all_to_all)");
      check_same_run("cp", run_job(model, 4, true,
                         cp_sets(2, "all_to_all", {"parallel.tensor_parallel=2", "parallel.sequence_parallel=true"})),
                 ref);
    }
    {
      INFO(model << " cp2 x dp2 full_shard");
      check_same_run("cp", run_job(model, 4, true, cp_sets(2, "ring", {"parallel.sharding=full_shard"})), ref);
    }
    {
      INFO(model << " cp2 x dp2 hybrid_shard (shard groups of 1 dp rank x its 2 cp ranks)");
      check_same_run("cp", run_job(model, 4, true,
                         cp_sets(2, "ring", {"parallel.sharding=hybrid_shard", "parallel.shard_group_size=1"})),
                 ref);
    }
    {
      INFO(model << " cp2 x pp2 (1f1b, ring)");
      check_same_run("cp", run_job(model, 4, true, cp_sets(2, "ring", {"parallel.pipeline_parallel=2"})), ref);
    }
    {
      INFO(model << " cp2 full_shard, activation checkpointing, optimizer offloaded to the host");
      check_same_run("cp", run_job(model, 2, true,
                         cp_sets(2, "ring", {"parallel.sharding=full_shard", "train.activation_checkpointing=blocks",
                                             "parallel.offload=cpu"})),
                 ref);
    }
  }
}

TEST_CASE("cp: adapter dropout, preference objectives and MoE under cp are refused by name before step 1", "[cp][train]") {
  const std::string model = "{arch: llama, n_layer: 1, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, "
                            "vocab_size: 23, seq_len: 16}";
  struct Case { std::vector<std::string> sets; std::string says; };
  for (const Case& k : {Case{{"model.adapter.type=lora", "model.adapter.dropout=0.05"},
                             "with model.adapter.dropout 0.05: adapter dropout under context parallelism"},
                        Case{{"train.objective=dpo"}, "with train.objective dpo: preference objectives under context"},
                        Case{{"model.arch=mixtral", "model.n_experts=2", "model.n_experts_per_tok=1"},
                             "with a mixture of experts (model.arch mixtral)"}}) {
    TempDir dir("cp_refused");
    std::vector<std::string> sets = k.sets;
    sets.push_back("parallel.context_parallel=2");
    const JobSpec job = parse_job_spec(cp_job(dir.path(), model, false), "job.yaml", sets);
    const auto out = run_ranks_inprocess_outcomes(job, 2);
    for (const auto& r : out) {
      INFO(r.error);
      CHECK_THAT(r.error, Contains("parallel.context_parallel 2 " + k.says));
      CHECK(r.summary.losses.empty());
    }
  }
}

TEST_CASE("cp: checkpoints stay logical: a cp2 run resumes at cp1 and a cp1 run at cp2", "[cp][checkpoint]") {
  const Run straight = run_job(kLlama, 1, false, {});
  for (int first : {2, 1}) {
    const int second = 3 - first;
    INFO("cp" << first << " -> cp" << second);
    TempDir dir("cp_resume");
    auto sets = [&](int cp, std::vector<std::string> more) {
      return cp > 1 ? cp_sets(cp, "ring", more) : more;
    };
    run_ranks_inprocess(parse_job_spec(cp_job(dir.path(), kLlama, false), "job.yaml",
                                       sets(first, {"train.exit_interval=3", "parallel.sharding=full_shard"})),
                        first);
    REQUIRE(latest_of(dir.path()) == "step_00000003");
    run_ranks_inprocess(parse_job_spec(cp_job(dir.path(), kLlama, false), "job.yaml",
                                       sets(second, {"parallel.sharding=full_shard"})),
                        second);
    Run resumed;
    resumed.losses = losses_of(dir.path());
    (void)load_model_safetensors(dir / "model.safetensors", resumed.weights);
    check_same_run("cp", resumed, straight);
  }
}

// ---- the planner -------------------------------------------------------------------------------

TEST_CASE("cp: the planner's per-rank activation arena is the cp network's on the CPU", "[cp][planner]") {
  for (const char* a : {"gpt2", "llama"})
    for (const char* mode : {"ring", "all_to_all"})
      for (int cp : {2, 4})
        for (bool ckpt : {false, true}) {
          const auto arch = make_model_arch(tiny(a));
          const Batch b = make_batch(32, false, 1);
          const NetResult got = cp_ranks(*arch, b, cp, mode, ckpt);
          INFO(a << " " << mode << " cp" << cp << (ckpt ? " checkpointing" : ""));
          CHECK(estimate_cp_activation_bytes(*arch, cp, mode, b.B, ckpt, DeviceModel::cpu()) ==
                double(got.act_bytes));
        }
}

TEST_CASE("cp: plan has cp rows (activations per rank, the ring's K/V time) and recommends cp when only a split "
          "sequence fits (Llama 3.1 8B at T=131072 and 262144 on 8 x 80 GB)", "[cp][planner]") {
  PlanRequest req;
  req.model = parse_model_shape("llama3.1-8b:T=131072");
  req.gpu = "h100";
  req.gpus_per_node = 8;
  req.micro_batch = 1;
  req.global_batch = 8;
  req.checkpointing = true;
  const Plan plan = make_plan(req);
  std::vector<PlanRow> tp1;  // the cp x tp rows: test_cp_window
  for (const PlanRow& r : plan.cp_rows)
    if (r.tp == 1) tp1.push_back(r);
  REQUIRE(tp1.size() == 3);  // cp2, cp4, cp8
  double last_act = 1e300;
  for (const PlanRow& r : tp1) {
    INFO("cp" << r.cp << ": activations " << r.mem.activations / (1 << 30) << " GiB, ring " << r.cp_ring_s << " s");
    CHECK(r.mem.activations < last_act);  // more ranks, fewer rows each
    last_act = r.mem.activations;
    // The ring's bytes over NVLink at the bus efficiency, for the step's micro-batches.
    const double bytes = cp_ring_bytes_per_micro_batch(req.model, r.cp, 1, true, 2);
    CHECK(r.cp_ring_s == Approx(r.accum * bytes / (plan.gpu.nvlink_bytes_per_s * req.bus_efficiency)));
    CHECK(r.cp_link == "NVLink");
  }
  // Per layer and micro-batch at cp8: 7 bf16 K/V blocks forward (twice: the recompute), 7 backward and 8 fp32
  // dK/dV; a block is 16384 rows x 2 x 8 KV heads x 128.
  const double block = 16384.0 * 2 * 8 * 128;
  CHECK(cp_ring_bytes_per_micro_batch(req.model, 8, 1, true, 2) == 32 * (2 * 7 * block * 2 + 7 * block * 2 + 8 * block * 4));
  // With flash attention (no T x T term on one rank either) the arena at cp4 is still <= 0.3x one rank's.
  const auto arch8b = make_model_arch(req.model);
  const double one = estimate_activation_bytes(*arch8b, 1, true, DeviceModel::gpu());
  const double cp4 = estimate_cp_activation_bytes(*arch8b, 4, "ring", 1, true, DeviceModel::gpu());
  INFO("Llama 3.1 8B T=131072, bf16, checkpointing: one rank " << one / (1 << 30) << " GiB, cp4 " << cp4 / (1 << 30)
                                                               << " GiB");
  CHECK(cp4 <= 0.3 * one);
  WARN("Llama 3.1 8B T=131072 (GPU model): activations at cp4 " << cp4 / one << "x one rank's");
  // Nothing at tp 1 holds a 131072-token sequence's activations; every cp row does. A whole-sequence
  // mesh fits too (tp4), so that is recommended: cp only when none does (its overlap is unmeasured).
  for (const PlanRow& r : plan.rows) CHECK_FALSE(r.fits);
  for (const PlanRow& r : plan.cp_rows) CHECK(r.fits);
  CHECK_THAT(plan.verdict, Contains("Split over 2 ranks (parallel.context_parallel: 2) the sequence fits"));
  REQUIRE(plan.has_recommendation);
  CHECK(plan.recommended.cp == 1);
  CHECK(plan.recommended.tp == 4);
  const std::string text = render_plan(plan);
  CHECK_THAT(text, Contains("context parallel (cp x tp x dp = 8 GPUs") && Contains("K/V ring"));
  WARN(text);
  // At T = 262144 only cp4 and cp8 hold it: the fewest cp ranks that fit.
  req.model = parse_model_shape("llama3.1-8b:T=262144");
  const Plan longer = make_plan(req);
  REQUIRE(longer.has_recommendation);
  CHECK(longer.recommended.cp == 4);
  CHECK_THAT(longer.recommendation, Contains("recommended: cp4 x dp2 full_shard over dp x cp") &&
                                        Contains("each sequence split over 4 ranks"));
}

// ---- a rank killed inside the ring --------------------------------------------------------------

TEST_CASE("cp: a rank killed inside the ring ends the job in < 40 s with no worker left", "[cp][fault]") {
  TempDir dir("cp_kill");
  write_file(dir / "job.yaml",
             "backend: cpu\nmodel: " + std::string(kLlama) + "\n"
             "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
             "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 4, eval_interval: 0, warmup_steps: 0}\n"
             "parallel: {nproc_per_node: 2, context_parallel: 2, timeout_s: 30}\n"
             "output: {dir: '" + dir / "run" + "', sample_tokens: 0}\n");
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 1's 3rd ring forward: step 1, micro-batch 2, layer 1, holding its K/V.
  const auto r = run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_CP_KILL=1:3 '" + trainrun_binary() + "' --config '" +
                             dir / "job.yaml" + "'");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.err);
  CHECK(r.exit_code != 0);
  CHECK(s < 40);
  CHECK_THAT(r.err, Contains("rank 1") && Contains("killed by signal SIGKILL"));
  CHECK_THAT(read_file(dir / "run/logs/rank1.log"), Contains("SIGKILL inside ring attention forward 3"));
  // Its peer names the ring, the cp group and the step it lost it in.
  CHECK_THAT(r.err, Contains("ring attention forward (cp group cp0, cp rank 0 of 2, ring step 1 of 2)") &&
                        Contains("send_recv (step 1, rank 0 of 2, group cp0)") && Contains("lost the connection to rank 1"));
  // No worker is left: the agent reaped both (the bracket keeps pgrep from matching itself).
  const auto left = run_command("pgrep -f '" + dir.path() + "/job[.]yaml' || true");
  CHECK(left.out.empty());
  WARN("a rank killed inside the ring: the job ended in " << s << " s");
}

// ---- bench cp --------------------------------------------------------------------------------

TEST_CASE("cp: `trainrun bench cp` prints a row per degree with the K/V share, and refuses a length that does "
          "not split", "[cp][bench]") {
  const auto ok = run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() +
                              "' bench cp --seq-len 64 --cp 1,2 --steps 2 --layers 1 --width 16");
  INFO(ok.out << ok.err);
  REQUIRE(ok.exit_code == 0);
  CHECK_THAT(ok.out, Contains("one sequence of 64 tokens per step, cp_mode ring"));
  CHECK_THAT(ok.out, Contains("| cp | step (ms) | waiting on K/V (ms) | share of step |"));
  CHECK_THAT(ok.out, Contains("\n| 1 | ") && Contains("| 0.0 | 0.0% |"));  // one rank waits on nobody
  CHECK_THAT(ok.out, Contains("\n| 2 | "));
  const auto bad = run_command("'" + trainrun_binary() + "' bench cp --seq-len 66 --cp 1,2 --steps 2");
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.out + bad.err, Contains("bench cp: --seq-len 66 is not a multiple of 2 x cp (4, --cp 2)"));
}
