// The planner's adapter runs (`trainrun plan --adapter lora|dora --rank R
// --base-dtype ...`, and `plan --config` of an adapter job): the memory
// model held against real CPU runs category by category (and against the
// run's own `memory (rank ...)` and `mfu:` lines), the frozen base in nf4
// byte for byte, the 70B statements the docs print, the TP split, bad
// input, and the `bench lora` smoke run.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/config/job_spec.h"
#include "core/model/adapter/nf4.h"
#include "core/model/model_shape.h"
#include "core/model/model_spec.h"
#include "core/train/planner.h"
#include "core/train/trainer.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

AdapterRequest adapter(const std::string& type, int rank, const std::string& targets = "all-linear",
                       const std::string& base_dtype = "auto") {
  AdapterRequest a;
  a.type = type;
  a.rank = rank;
  a.target_modules = targets;
  a.base_dtype = base_dtype;
  return a;
}

Sharding sharding(const std::string& strategy, int world, int group) {
  Sharding s;
  s.strategy = strategy;
  s.world = world;
  s.group = strategy == "no_shard" ? 1 : strategy == "hybrid_shard" ? group : world;
  return s;
}

nlohmann::json last_metrics(const std::string& dir) {
  std::istringstream in(test::read_file(dir + "/metrics.jsonl"));
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return nlohmann::json::parse(last);
}

// A tiny adapter job (synthetic data, 2 steps, a random base).
std::string job_yaml(const std::string& model, const std::string& adapter_line, const std::string& strategy, int group,
                     int world, int micro_batch, bool ckpt) {
  return "model: {" + model + ",\n  adapter: {" + adapter_line + "}}\n" +
         "data: {format: synthetic, synthetic: {vocab: 64, branching: 3}}\n"
         "train: {global_batch_size: " + std::to_string(micro_batch * world) + ", micro_batch_size: " +
         std::to_string(micro_batch) + ", max_steps: 2, warmup_steps: 1, log_interval: 1, eval_interval: 0, "
         "eval_steps: 1, activation_checkpointing: " + (ckpt ? "blocks" : "none") + "}\n" +
         "parallel: {sharding: " + strategy + ", shard_group_size: " + std::to_string(group) +
         ", nproc_per_node: " + std::to_string(world) + ", timeout_s: 60}\n";
}

}  // namespace

// "When the planner says fits, it must be true": every byte the planner
// counts for an adapter run is the run's (the frozen base, the adapters'
// parameters, gradients and moments, the arena exactly), and its total is
// the backend's measured peak within 10%.
TEST_CASE("planner adapters: the memory model is a real run's category by category", "[planner][adapter]") {
  struct Case {
    std::string name, model, adapter_line;
    AdapterRequest req;
    std::string strategy;
    int world, group, micro_batch;
    bool ckpt;
  };
  const std::string gpt2 = "n_layer: 2, n_head: 4, n_embd: 64, vocab_size: 256, seq_len: 32";
  const std::string llama =
      "arch: llama, n_layer: 3, n_head: 4, n_kv_head: 2, n_embd: 64, ffn_dim: 160, vocab_size: 300, seq_len: 24, "
      "tie_embeddings: false";
  const std::vector<Case> cases = {
      {"gpt2 lora r8 no_shard x1", gpt2, "type: lora, rank: 8, alpha: 16", adapter("lora", 8), "no_shard", 1, 0, 4,
       false},
      {"llama lora r4 full_shard x2, checkpointing", llama, "type: lora, rank: 4, alpha: 8", adapter("lora", 4),
       "full_shard", 2, 0, 2, true},
      {"gpt2 dora r4 c_attn shard_grad_op x2", gpt2, "type: dora, rank: 4, alpha: 8, target_modules: [c_attn]",
       adapter("dora", 4, "c_attn"), "shard_grad_op", 2, 0, 2, false},
      {"llama dora r2 hybrid_shard x4 groups of 2", llama,
       "type: dora, rank: 2, alpha: 4, target_modules: [q_proj, v_proj, down_proj]",
       adapter("dora", 2, "q_proj,v_proj,down_proj"), "hybrid_shard", 4, 2, 2, false},
  };
  std::ostringstream table;
  table << "planner vs a real adapter run (rank 0, CPU backend):\n";
  for (const Case& c : cases) {
    INFO(c.name);
    test::TempDir dir("plan_adapter");
    const std::string yaml = job_yaml(c.model, c.adapter_line, c.strategy, c.group, c.world, c.micro_batch, c.ckpt);
    const JobSpec job = parse_job_spec(yaml + "output: {dir: '" + dir.path() + "', sample_tokens: 0}\n", "job.yaml");
    const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
    const MemoryBreakdown pred =
        estimate_adapter_memory(*arch, c.req, sharding(c.strategy, c.world, c.group), c.micro_batch, c.ckpt, DeviceModel::cpu());
    const std::vector<TrainSummary> sums = test::run_ranks_inprocess(job, c.world, /*omp_threads_per_rank=*/1);
    const TrainSummary& s = sums.at(0);
    const auto rec = last_metrics(dir.path());
    INFO(rec.dump());
    // The frozen store (the run's own "params" category is the base's).
    CHECK(pred.base == rec.at("mem_params_bytes").get<double>());
    // The summary adds the adapters' parameters; gradients and moments are theirs only.
    CHECK(pred.base + pred.params == double(s.params_bytes));
    CHECK(pred.grads == double(s.grads_bytes));
    CHECK(pred.optimizer == double(s.optimizer_bytes));
    CHECK(pred.activations == rec.at("mem_activations_bytes").get<double>());
    const double peak = rec.at("mem_peak_bytes").get<double>();
    const double err = (pred.total() - peak) / peak;
    char line[300];
    std::snprintf(line, sizeof line,
                  "  %-44s predicted %8.0f KiB  measured %8.0f KiB  %+6.2f%%  (comm %.0f / %.0f, workspace %.0f / %.0f)\n",
                  c.name.c_str(), pred.total() / 1024, peak / 1024, 100 * err, pred.comm,
                  rec.at("mem_comm_bytes").get<double>(), pred.workspace, rec.at("mem_workspace_bytes").get<double>());
    table << line;
    INFO(line);
    // Never below what the run used (a "fits" must hold), and close to it;
    // one rank, with nothing gathered, to the byte.
    CHECK(pred.total() >= peak);
    if (c.world == 1) CHECK(pred.total() == peak);
    CHECK(err <= 0.10);
  }
  WARN(table.str());
}

// The run prints its own figures: the planner's, formatted alike.
TEST_CASE("planner adapters: a run's memory and mfu lines carry the planner's figures", "[planner][adapter]") {
  test::TempDir dir("plan_adapter_log");
  const std::string model = "n_layer: 2, n_head: 4, n_embd: 64, vocab_size: 256, seq_len: 32";
  test::write_file(dir / "job.yaml", job_yaml(model, "type: lora, rank: 8, alpha: 16", "no_shard", 0, 1, 4, false) +
                                         "output: {dir: '" + dir / "run" + "', sample_tokens: 0}\n");
  auto r = test::run_trainrun("--config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const JobSpec job = load_resolved_job_spec(dir / "job.yaml", {});
  const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
  const AdapterRequest a = adapter("lora", 8);
  const MemoryBreakdown pred = estimate_adapter_memory(*arch, a, sharding("no_shard", 1, 0), 4, false, DeviceModel::cpu());
  CHECK_THAT(r.err, Contains("memory (rank 0, adapters, no_shard): params " + format_bytes(pred.params) + ", grads " +
                             format_bytes(pred.grads) + ", optimizer " + format_bytes(pred.optimizer)));
  CHECK_THAT(r.err, Contains("memory (rank 0, no_shard, frozen): params " + format_bytes(pred.base) +
                             ", grads 0 B, optimizer 0 B, activations " + format_bytes(pred.activations)));
  char mflop[64];
  std::snprintf(mflop, sizeof mflop, "mfu: %.2f MFLOP per token (4N frozen base", adapter_flops_per_token(*arch, a) / 1e6);
  CHECK_THAT(r.err, Contains(mflop));
  // peft's print_trainable_parameters figure is the planner's count.
  const int64_t trainable = adapter_params_per_block(*arch, a) * arch->config().L;
  // A (8, in) + B (out, 8) on c_attn (64 -> 192), attn.c_proj (64 -> 64), c_fc (64 -> 256), mlp.c_proj (256 -> 64).
  CHECK(trainable == 2 * 8 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64)));
  CHECK_THAT(r.err, Contains("trainable params: " + std::to_string(trainable / 1000) + "," +
                             std::to_string(trainable % 1000 + 1000).substr(1)));
}

// nf4 = nf4::stored_bytes of every block linear's weight (4 bits + an 8-bit
// absmax code per 64 + an fp32 scale per 256 absmaxes + the offset), the
// rest (embeddings, norms, head) in bf16: by hand for Llama 3.1 70B.
TEST_CASE("planner adapters: an nf4 base is the block linears' NF4 bytes and the rest in bf16", "[planner][adapter]") {
  const auto arch = make_model_arch(parse_model_shape("llama3.1-70b"));
  const double C = 8192, F = 28672, KV = 1024, V = 128256, L = 80;
  auto nf4 = [](double n) {
    const double blocks = std::ceil(n / 64), runs = std::ceil(blocks / 256);
    return std::ceil(n / 2) + blocks + 4 * runs + 4;  // packed codes, absmax codes, scales, offset
  };
  const double linears = L * (2 * nf4(C * C) + 2 * nf4(KV * C) + 3 * nf4(F * C));
  const double rest = 2.0 * (2 * V * C + C + L * 2 * C);  // embed, lm_head, final norm, two norms per block
  CHECK(adapter_base_bytes(*arch, adapter("lora", 16, "all-linear", "nf4"), DeviceModel::gpu()) == linears + rest);
  // ~0.52 bytes per linear weight, against 2 in bf16.
  CHECK(adapter_base_bytes(*arch, adapter("lora", 16, "all-linear", "bf16"), DeviceModel::gpu()) ==
        2.0 * double(arch->num_parameters()));
  CHECK(adapter_base_bytes(*arch, adapter("lora", 16, "all-linear", "auto"), DeviceModel::gpu()) ==
        2.0 * double(arch->num_parameters()));
  CHECK(adapter_base_bytes(*arch, adapter("lora", 16, "all-linear", "auto"), DeviceModel::cpu()) ==
        4.0 * double(arch->num_parameters()));
  // r=16 on every linear: peft's count for this model.
  CHECK(adapter_params_per_block(*arch, adapter("lora", 16)) * 80 == 207093760);
}

// The two statements, from the plan's own figures (docs/planner.md prints them).
TEST_CASE("planner adapters: Llama-3.1 70B LoRA r=16 fits 8 x 80 GB without offload", "[planner][adapter]") {
  PlanRequest req;
  req.model = parse_model_shape("llama3.1-70b");  // T 8192
  req.gpu = "h100";
  req.gpu_memory = 80 * kGiB;
  req.gpus_per_node = 8;
  req.micro_batch = 1;
  req.global_batch = 8;
  req.checkpointing = true;
  req.adapter = adapter("lora", 16);
  const Plan p = make_plan(req);
  const PlanRow& fs = p.rows[2];
  REQUIRE(fs.sharding.strategy == "full_shard");
  WARN(render_plan(p));
  CHECK(fs.fits);
  CHECK(fs.host_bytes_per_node == 0);
  // The base in bf16 over 8 ranks; the adapters' 18 bytes per parameter over 8.
  CHECK(fs.mem.base / kGiB == Approx(2.0 * 70553706496.0 / 8 / kGiB).epsilon(0.001));
  CHECK((fs.mem.params + fs.mem.grads + fs.mem.optimizer) == Approx(18.0 * 207093760 / 8).epsilon(0.001));
  CHECK_THAT(p.verdict, Contains("with lora adapters (r=16, all-linear, 207.1M trainable) on a frozen bf16 base") &&
                            Contains("with full_shard and activation checkpointing") && Contains("FITS"));
  // The same run as a full fine-tune does not fit (docs/planner.md's first example).
  req.adapter = AdapterRequest{};
  CHECK_FALSE(make_plan(req).rows[2].fits);
}

TEST_CASE("planner adapters: QLoRA 70B fits one 80 GB GPU with checkpointing at T=2048", "[planner][adapter]") {
  PlanRequest req;
  req.model = parse_model_shape("llama3.1-70b:T=2048");
  req.gpu = "h100";
  req.gpu_memory = 80 * kGiB;
  req.gpus_per_node = 1;
  req.micro_batch = 1;
  req.global_batch = 16;
  req.checkpointing = true;
  req.adapter = adapter("lora", 16, "all-linear", "nf4");
  const Plan p = make_plan(req);
  WARN(render_plan(p));
  for (const PlanRow& row : p.rows) {
    INFO(row.sharding.strategy);
    CHECK(row.fits);  // one GPU: every strategy holds the whole base
    CHECK(row.max_micro_batch >= 1);
  }
  const PlanRow& ns = p.rows[0];
  CHECK(ns.mem.base / kGiB < 40);  // ~0.52 B per linear weight
  CHECK_THAT(p.verdict, Contains("on a frozen nf4 base") && Contains("FITS"));
  // Without checkpointing, or in bf16, it does not.
  req.checkpointing = false;
  CHECK_FALSE(make_plan(req).rows[0].fits);
  req.checkpointing = true;
  req.adapter.base_dtype = "bf16";
  CHECK_FALSE(make_plan(req).rows[0].fits);
}

// Under TP the base and the adapters split like the layers they wrap:
// column-parallel linears (q, k, v, gate, up) split B's rows, row-parallel
// ones (o, down) A's columns; the other factor stays whole on every rank.
TEST_CASE("planner adapters: tensor parallelism splits the base and the adapters like their layers", "[planner][adapter][tp]") {
  PlanRequest req;
  req.model = parse_model_shape("llama:L=4,C=512,heads=8,kv_heads=4,ffn=1536,V=1000,T=256");
  req.gpus_per_node = 2;
  req.micro_batch = 1;
  req.global_batch = 2;
  req.adapter = adapter("lora", 8);
  const Plan p = make_plan(req);
  const PlanRow* tp2 = nullptr;
  for (const auto& row : p.tp_rows)
    if (row.tp == 2 && row.sharding.strategy == "no_shard") tp2 = &row;
  REQUIRE(tp2);
  const double C = 512, KV = 256, F = 1536, r = 8, L = 4;
  // q, k, v, gate, up: A (r, C) whole, B (out/2, r); o: A (r, C/2), B (C, r); down: A (r, F/2), B (C, r).
  const double per_block = r * (C + C / 2) + 2 * r * (C + KV / 2) + r * (C / 2 + C) + 2 * r * (C + F / 2) + r * (F / 2 + C);
  CHECK(tp2->mem.optimizer == 8 * L * per_block);
  // The base: every block linear halves, norms stay whole; the vocabulary splits.
  const double linears = C * C * 2 + KV * C * 2 + F * C * 3;
  const double base = 2 * (L * (linears / 2 + 2 * C) + 2 * (1000.0 / 2) * C + C);
  CHECK(tp2->mem.base == Approx(base).epsilon(1e-3));
  CHECK_THAT(render_plan(p), Contains("base"));
}

// A pipeline stage holds its own base units and its blocks' adapters.
TEST_CASE("planner adapters: a pipeline stage holds its units of the base and its blocks' adapters", "[planner][adapter][pp]") {
  PlanRequest req;
  req.model = parse_model_shape("llama:L=4,C=512,heads=8,kv_heads=4,ffn=1536,V=1000,T=256");
  req.gpus_per_node = 2;
  req.micro_batch = 1;
  req.global_batch = 8;
  req.adapter = adapter("lora", 8);
  const Plan p = make_plan(req);
  const PlanRow* pp2 = nullptr;
  for (const auto& row : p.pp_rows)
    if (row.tp == 1 && row.pp == 2) pp2 = &row;
  REQUIRE(pp2);
  REQUIRE(pp2->dp == 1);
  const double C = 512, KV = 256, F = 1536, V = 1000, r = 8;
  const double block = 2 * C + 2 * C * C + 2 * KV * C + 3 * F * C;  // two norms, q, o, k, v, gate, up, down
  // Stage 0: the embedding and blocks 0-1; stage 1: blocks 2-3, the final norm and the head (bf16).
  const double stage0 = 2 * (V * C + 2 * block), stage1 = 2 * (2 * block + C + V * C);
  CHECK(pp2->mem.base == (pp2->worst_stage == 0 ? stage0 : stage1));
  // Two blocks' adapters: 8 bytes of moments per element.
  const double per_block = r * (2 * (C + C) + 2 * (C + KV) + 2 * (C + F) + (F + C));
  CHECK(pp2->mem.optimizer == 8 * 2 * per_block);
}

TEST_CASE("planner adapters: plan --adapter from the command line, and plan --config of an adapter job",
          "[planner][adapter][cli]") {
  auto r = test::run_trainrun("plan --model llama3.1-70b:T=2048 --gpus 1 --gpu-memory 80GiB --adapter lora --rank 16 "
                              "--base-dtype nf4 --activation-checkpointing blocks");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("adapter   lora r=16 on all-linear: 207.1M trainable parameters (0.294%); frozen base in "
                             "nf4:") &&
                        Contains("per-GPU memory in GiB; times per optimizer step (comm t: collectives, overlapped or "
                                 "not); base: the frozen base; params, grads, optim: the adapters'") &&
                        Contains("on a frozen nf4 base with full_shard and activation checkpointing on 1 x 1 H100 SXM "
                                 "80GB (80.0 GiB each), micro-batch 1: FITS"));
  // A job's model.adapter and model.base_dtype; flags override them.
  test::TempDir dir("plan_adapter_cli");
  test::write_file(dir / "dora.yaml",
                   "model: {preset: llama3.1-8b, seq_len: 4096, adapter: {type: dora, rank: 8, target_modules: [q_proj, "
                   "v_proj]}}\ndata: {format: synthetic}\ntrain: {micro_batch_size: 1, global_batch_size: 8}\n");
  r = test::run_trainrun("plan --config '" + dir / "dora.yaml" + "' --gpus 8");
  REQUIRE(r.exit_code == 0);
  // q: 8 x (4096 + 4096) + 4096 (magnitudes), v: 8 x (4096 + 1024) + 1024, 32 blocks: 3,571,712.
  CHECK_THAT(r.out, Contains("adapter   dora r=8 on q_proj,v_proj: 3.6M trainable parameters") &&
                        Contains("frozen base in bf16") && Contains("DoRA's 3 more base-sized GEMMs"));
  r = test::run_trainrun("plan --config '" + dir / "dora.yaml" + "' --gpus 8 --adapter lora --rank 4 --base-dtype nf4");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("adapter   lora r=4 on q_proj,v_proj:") && Contains("frozen base in nf4"));
  // Without an adapter: no base column.
  r = test::run_trainrun("plan --model gpt2-124m");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, !Contains("adapter ") && !Contains(" base "));
}

TEST_CASE("planner adapters: bad input gets a clear error", "[planner][adapter][cli]") {
  struct Case {
    std::string args;
    int code;
    std::string message;
  };
  const std::string m = "plan --model llama3.1-8b ";
  const std::vector<Case> cases = {
      {m + "--adapter lora --rank 0", 1, "--rank (model.adapter.rank): 0 must be >= 1 (the LoRA rank r)"},
      {m + "--adapter lora --rank -4", 1, "--rank (model.adapter.rank): -4 must be >= 1"},
      {"plan --adapter lora --rank 16", 2,
       "plan needs --config job.yaml or --model SHAPE (--adapter lora adapts a base model: name it)"},
      {m + "--adapter lora --base-dtype fp16", 1,
       "--base-dtype (model.base_dtype): 'fp16' is not one of auto, fp32, bf16, nf4"},
      {m + "--adapter qlora", 1, "--adapter (model.adapter.type): 'qlora' is not one of lora, dora"},
      {m + "--adapter lora --target-modules q_proj,c_attn", 1, "'c_attn' matches no linear of the"},
      {m + "--rank 16", 1, "plan: --rank, --target-modules and --base-dtype describe adapters; add --adapter lora"},
      {m + "--base-dtype nf4", 1, "add --adapter lora or --adapter dora"},
  };
  for (const auto& c : cases) {
    auto r = test::run_trainrun(c.args);
    INFO(c.args << "\n" << r.err);
    CHECK(r.exit_code == c.code);
    CHECK_THAT(r.err, Contains(c.message));
    CHECK(r.out.empty());
  }
}

// A benchmark is a program that prints a table: that it runs and prints its rows.
TEST_CASE("bench lora: prints the full and adapter rows and their ratios", "[bench][adapter]") {
  test::TempDir dir("bench_lora");
  test::write_file(dir / "tiny.yaml",
                   "model: {n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 64, seq_len: 16}\n"
                   "data: {format: synthetic, synthetic: {vocab: 64, branching: 3}}\n"
                   "train: {global_batch_size: 2, micro_batch_size: 2, eval_interval: 0, eval_steps: 1}\n"
                   "output: {dir: '" + dir / "unused" + "'}\n");
  auto r = test::run_trainrun("bench lora --config '" + dir / "tiny.yaml" + "' --steps 3 --rounds 1 --rank 4 --threads 1");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  // A (4, 32) + B (out, 4) on c_attn (96), attn.c_proj (32), c_fc (128), mlp.c_proj (32).
  const int64_t trainable = 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32));
  INFO(r.out);
  CHECK_THAT(r.out, Contains("full fine-tune") && Contains("lora r=4 all-linear") && Contains("adapter / full"));
  CHECK_THAT(r.out, Contains(" " + std::to_string(trainable) + " "));
}
