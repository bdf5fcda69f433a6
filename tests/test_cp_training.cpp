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

struct Batch {
  int B = 2, T = 32;
  std::vector<int32_t> in, tgt, doc_start, pos;  // (B,T); doc_start/pos empty = no documents
};

Batch make_batch(int T, bool docs, uint64_t seed) {
  Batch b;
  b.T = T;
  std::mt19937_64 gen(seed);
  b.in.resize(size_t(b.B) * T);
  b.tgt.resize(b.in.size());
  for (auto& x : b.in) x = int32_t(gen() % 23);
  for (auto& x : b.tgt) x = int32_t(gen() % 23);
  if (docs) {
    b.doc_start = make_cp_docs(b.B, T, seed + 1);
    b.pos.resize(b.in.size());
    for (size_t i = 0; i < b.pos.size(); ++i) b.pos[i] = int32_t(i % size_t(T)) - b.doc_start[i];
  }
  return b;
}

struct NetResult {
  std::vector<float> losses;  // (B,T) global order
  std::vector<float> grads;   // whole model, summed over the cp ranks
  size_t act_bytes = 0;       // rank 0's network
  double waited = 0;          // rank 0's wait on the cp group
};

std::vector<float> init_params(const ModelArch& arch) {
  std::vector<float> p(size_t(arch.layout().total));
  arch.init_params(42, 0, arch.layout().total, p.data());
  return p;
}

// One network's forward + backward on (B, rows) of `in` (its rows), loss
// scaled by the whole batch's tokens as the trainer does.
struct OneNet {
  std::vector<float> losses, grads;
  size_t act_bytes = 0;
  double waited = 0;
};
OneNet run_net(const ModelArch& arch, const std::vector<float>& params, const Batch& b, int rows,
               const std::vector<int32_t>& in, const std::vector<int32_t>& tgt, const std::vector<int32_t>& doc,
               const std::vector<int32_t>& pos, bool ckpt, const ContextParallel* cp) {
  auto be = make_cpu_backend(1);
  DeviceBuffer p = upload_f32(be.get(), params);
  DeviceBuffer g(be.get(), params.size() * 4);
  auto net = arch.make_network(be.get(), b.B, ckpt, nullptr, nullptr, cp);
  FlatUnitAccess units(arch.layout(), p.get(), g.as<float>(), DType::F32);
  DeviceBuffer din = upload_i32(be.get(), in), dtgt = upload_i32(be.get(), tgt);
  DeviceBuffer ddoc = upload_i32(be.get(), doc), dpos = upload_i32(be.get(), pos);
  DocumentMask docs;
  if (!doc.empty()) docs = DocumentMask{ddoc.as<int32_t>(), dpos.as<int32_t>(), cp ? b.doc_start.data() : nullptr};
  net->forward(units, din.as<int32_t>(), dtgt.as<int32_t>(), b.B, rows, true, 1.0f / float(b.B * b.T), docs);
  net->backward(units);
  OneNet r;
  r.losses = download_f32(be.get(), net->losses(), size_t(b.B) * rows);
  r.grads = download_f32(be.get(), g.get(), params.size());
  r.act_bytes = net->activation_bytes();
  return r;
}

NetResult one_rank(const ModelArch& arch, const Batch& b, bool ckpt = false) {
  const OneNet r = run_net(arch, init_params(arch), b, b.T, b.in, b.tgt, b.doc_start, b.pos, ckpt, nullptr);
  return NetResult{r.losses, r.grads, r.act_bytes, 0};
}

NetResult cp_ranks(const ModelArch& arch, const Batch& b, int cp, const std::string& mode, bool ckpt = false) {
  const std::vector<float> params = init_params(arch);
  std::vector<OneNet> per(static_cast<size_t>(cp));
  const auto errors = run_gloo_group(cp, "cp0", std::chrono::seconds(30), [&](Communicator& comm) {
    const SequenceSplit split(b.T, cp, comm.rank());
    const int Tl = split.local_rows();
    std::vector<int32_t> in(size_t(b.B) * Tl), tgt(in.size()), doc, pos;
    split_rows(b.in.data(), in.data(), b.B, 4, split);
    split_rows(b.tgt.data(), tgt.data(), b.B, 4, split);
    if (!b.doc_start.empty()) {
      const LocalDocumentMask m = split_document_mask(b.doc_start.data(), b.B, split);
      doc = m.doc_start, pos = m.pos;
    }
    ContextParallel ctx;
    ctx.comm = &comm;
    ctx.mode = mode;
    per[size_t(comm.rank())] = run_net(arch, params, b, Tl, in, tgt, doc, pos, ckpt, &ctx);
  });
  for (const auto& e : errors) REQUIRE(e == "");
  NetResult r;
  std::vector<const void*> rows;
  for (const auto& o : per) rows.push_back(o.losses.data());
  r.losses.resize(size_t(b.B) * b.T);
  merge_rows(rows, r.losses.data(), b.B, 4, b.T, cp);
  r.grads.assign(params.size(), 0.f);
  for (const auto& o : per)  // the sum the stores' reduction over cp forms
    for (size_t i = 0; i < params.size(); ++i) r.grads[i] += o.grads[i];
  r.act_bytes = per[0].act_bytes;
  return r;
}

// max |got - ref| / max |ref|
double max_rel(const std::vector<float>& got, const std::vector<float>& ref) {
  REQUIRE(got.size() == ref.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d = std::max(d, double(std::fabs(got[i] - ref[i])));
    m = std::max(m, double(std::fabs(ref[i])));
  }
  return d / m;
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

TEST_CASE("cp: what the cp attention cannot compute is refused by name", "[cp][network]") {
  auto refused = [&](ModelConfig c) -> std::string {
    const auto errors = run_gloo_group(2, "cp0", std::chrono::seconds(10), [&](Communicator& comm) {
      ContextParallel ctx;
      ctx.comm = &comm;
      auto arch = make_model_arch(c);
      auto be1 = make_cpu_backend(1);
      (void)arch->make_network(be1.get(), 1, false, nullptr, nullptr, &ctx);
    });
    return errors[0];
  };
  ModelConfig w = tiny("llama");
  w.sliding_window = 8;
  CHECK_THAT(refused(w), Contains("model.sliding_window 8") || Contains("sliding window"));
  ModelConfig g = tiny("llama");
  g.attn_softcap = 50.f;
  CHECK_THAT(refused(g), Contains("parallel.context_parallel 2 with attention soft-capping"));
  ModelConfig odd = tiny("gpt2", 30);  // not a multiple of 2 x cp
  CHECK_THAT(refused(odd), Contains("model.seq_len 30 is not a multiple of 2 x parallel.context_parallel (4)"));
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

// Accumulation on, gradient clipping on (the norm must count each element once).
std::string cp_job(const std::string& dir, const std::string& model, bool docs) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}" +
         (docs ? ", document_mask: true, document_separator: 3" : "") + "}\n"
         "train: {global_batch_size: 2, micro_batch_size: 1, max_steps: 5, lr: 3.0e-3,\n"
         "        min_lr: 3.0e-4, warmup_steps: 2, eval_interval: 0, log_interval: 1, grad_clip: 0.3}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: no_shard, timeout_s: 60}\n";
}

struct Run {
  std::vector<double> losses;
  std::vector<float> weights;
};

Run run_job(const std::string& model, int world, bool docs, const std::vector<std::string>& sets) {
  TempDir dir("cp_train");
  const JobSpec job = parse_job_spec(cp_job(dir.path(), model, docs), "job.yaml", sets);
  Run out;
  out.losses = run_ranks_inprocess(job, world, /*omp_threads_per_rank=*/1)[0].losses;
  (void)load_model_safetensors(dir / "model.safetensors", out.weights);
  return out;
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  REQUIRE(got.size() == ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

void check_same(const Run& got, const Run& ref) {
  REQUIRE(got.losses.size() == ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    INFO("step " << i + 1 << ": " << got.losses[i] << " vs " << ref.losses[i]);
    CHECK(std::fabs(got.losses[i] - ref.losses[i]) <= 1e-5 * std::fabs(ref.losses[i]));
  }
  INFO("final weights rel err " << rel_l2(got.weights, ref.weights));
  CHECK(rel_l2(got.weights, ref.weights) <= 1e-5);
}

std::vector<std::string> cp_sets(int cp, const std::string& mode, std::vector<std::string> more = {}) {
  more.push_back("parallel.context_parallel=" + std::to_string(cp));
  more.push_back("parallel.cp_mode=" + mode);
  return more;
}

}  // namespace

TEST_CASE("cp: gpt2 and llama GQA train at cp2 and cp4 (ring, all_to_all) as one rank does", "[cp][train]") {
  for (const char* model : {kGpt2, kLlama}) {
    const Run ref = run_job(model, 1, false, {});
    REQUIRE(ref.losses.size() == 5);
    CHECK(ref.losses.back() < ref.losses.front());
    for (int cp : {2, 4})
      for (const char* mode : {"ring", "all_to_all"}) {
        INFO(model << " cp" << cp << " " << mode);
        check_same(run_job(model, cp, false, cp_sets(cp, mode)), ref);
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
      check_same(run_job(model, 2, true, cp_sets(2, "ring")), ref);
    }
    {
      INFO(model << " cp4 all_to_all");
      check_same(run_job(model, 4, true, cp_sets(4, "all_to_all")), ref);
    }
  }
}

TEST_CASE("cp: cp2 x tp2 (and SP), cp2 x dp2 full_shard and hybrid_shard, cp2 x pp2, and with checkpointing and offload, train as one rank does",
          "[cp][train]") {
  for (const char* model : {kGpt2, kLlama}) {
    const Run ref = run_job(model, 1, true, {});
    {
      INFO(model << " cp2 x tp2 (ring)");
      check_same(run_job(model, 4, true, cp_sets(2, "ring", {"parallel.tensor_parallel=2"})), ref);
    }
    {
      INFO(model << " cp2 x tp2 with sequence parallelism (all_to_all)");
      check_same(run_job(model, 4, true,
                         cp_sets(2, "all_to_all", {"parallel.tensor_parallel=2", "parallel.sequence_parallel=true"})),
                 ref);
    }
    {
      INFO(model << " cp2 x dp2 full_shard");
      check_same(run_job(model, 4, true, cp_sets(2, "ring", {"parallel.sharding=full_shard"})), ref);
    }
    {
      INFO(model << " cp2 x dp2 hybrid_shard (shard groups of 1 dp rank x its 2 cp ranks)");
      check_same(run_job(model, 4, true,
                         cp_sets(2, "ring", {"parallel.sharding=hybrid_shard", "parallel.shard_group_size=1"})),
                 ref);
    }
    {
      INFO(model << " cp2 x pp2 (1f1b, ring)");
      check_same(run_job(model, 4, true, cp_sets(2, "ring", {"parallel.pipeline_parallel=2"})), ref);
    }
    {
      INFO(model << " cp2 full_shard, activation checkpointing, optimizer offloaded to the host");
      check_same(run_job(model, 2, true,
                         cp_sets(2, "ring", {"parallel.sharding=full_shard", "train.activation_checkpointing=blocks",
                                             "parallel.offload=cpu"})),
                 ref);
    }
  }
}

TEST_CASE("cp: adapters and preference objectives under cp are refused by name before step 1", "[cp][train]") {
  const std::string model = "{arch: llama, n_layer: 1, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, "
                            "vocab_size: 23, seq_len: 16}";
  struct Case { std::vector<std::string> sets; std::string says; };
  for (const Case& k : {Case{{"model.adapter.type=lora"}, "with model.adapter lora: adapters under context parallelism"},
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
    check_same(resumed, straight);
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
  REQUIRE(plan.cp_rows.size() == 3);  // cp2, cp4, cp8
  double last_act = 1e300;
  for (const PlanRow& r : plan.cp_rows) {
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
  CHECK_THAT(text, Contains("context parallel (cp x dp = 8 GPUs") && Contains("K/V ring"));
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
