// The planner (`trainrun plan`): model shapes, the memory model held against
// measured peak memory of real CPU runs (within 15%), the 70B question, and
// the command's errors.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/config/job_spec.h"
#include "core/config/model_presets.h"
#include "core/model/gpt2/gpt2.h"
#include "core/model/model_shape.h"
#include "core/model/tensor_parallel.h"
#include "core/train/planner.h"
#include "parallel/pipeline/schedule.h"
#include "core/train/trainer.h"
#include "kernels/backend.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

GPT2Config gpt2(int L, int NH, int C, int V, int T) { return GPT2Config::of(L, NH, C, V, T); }

// The model a job with this shape trains (through its model.* fields).
std::unique_ptr<ModelArch> arch_of(const GPT2Config& c) {
  ModelSpec s;
  s.n_layer = c.L;
  s.n_head = c.NH;
  s.n_embd = c.C;
  s.vocab_size = c.V;
  s.seq_len = c.T;
  return make_model_arch(ModelConfig::from_spec(s));
}

// A PlanRequest with PlanRequest's defaults but for the fields a test
// names, e.g. request_for("gpt2-1.5b").gpu("a100", "40GiB").gpus(8).batch(4, 64).
struct RequestBuilder {
  PlanRequest req;
  // GPU type and, as --gpu-memory reads it, its memory ("" = the GPU's).
  RequestBuilder& gpu(const std::string& type, const std::string& memory = "") {
    req.gpu = type;
    if (!memory.empty()) req.gpu_memory = parse_bytes(memory, "--gpu-memory");
    return *this;
  }
  RequestBuilder& gpus(int per_node, int nodes = 1) {
    req.gpus_per_node = per_node;
    req.nodes = nodes;
    return *this;
  }
  RequestBuilder& batch(int micro, int global) {
    req.micro_batch = micro;
    req.global_batch = global;
    return *this;
  }
  RequestBuilder& checkpointing() {
    req.checkpointing = true;
    return *this;
  }
  RequestBuilder& job_strategy(const std::string& strategy) {
    req.job_strategy = strategy;
    return *this;
  }
  operator PlanRequest() const { return req; }
};

RequestBuilder request_for(const std::string& shape) {
  RequestBuilder b;
  b.req.model = parse_model_shape(shape);
  return b;
}

std::string describe(const std::string& shape) { return make_model_arch(parse_model_shape(shape))->describe(); }

// One CPU training run; ranks are threads of this process, each a full
// trainer with its own backend (so its own peak counter), talking Gloo over
// loopback as in tests/test_sharding.cpp. Returns rank 0's last
// metrics.jsonl record.
//
// One OpenMP thread per rank: the planner models collectives that keep pace
// with compute (NCCL on NVLink, or Gloo with a core to itself). When every
// core is busy with compute, the comm thread falls behind, and full-size
// gradient buckets queue up for reduce-scatter (parallel/sharding/sharding_sharded.cpp
// does not bound them), which measures up to ~20% above the model on a
// 2-core machine.
nlohmann::json run_job(const std::string& yaml_body, int world) {
  test::TempDir dir("plan");
  const JobSpec job = parse_job_spec(yaml_body + "output: {dir: '" + dir.path() + "', sample_tokens: 0}\n", "job.yaml");
  test::run_ranks_inprocess(job, world, /*omp_threads_per_rank=*/1);
  std::istringstream in(test::read_file(dir / "metrics.jsonl"));
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return nlohmann::json::parse(last);
}

}  // namespace

TEST_CASE("planner: gpt2 shapes have make_gpt2_layout's units and parameter count", "[planner]") {
  for (auto c : {gpt2(2, 2, 18, 23, 12), gpt2(4, 4, 128, 256, 128), gpt2(12, 12, 768, 50257, 1024)}) {
    const auto m = make_model_arch(parse_model_shape("gpt2:L=" + std::to_string(c.L) + ",C=" + std::to_string(c.C) +
                                                     ",heads=" + std::to_string(c.NH) + ",V=" + std::to_string(c.V) +
                                                     ",T=" + std::to_string(c.T)));
    const ParamLayout lay = make_gpt2_layout(c);
    REQUIRE(m->layout().units.size() == lay.units.size());
    for (size_t i = 0; i < lay.units.size(); ++i) CHECK(m->layout().units[i].numel == lay.units[i].numel);
    CHECK(m->num_parameters() == lay.total);
    // GPT-2's closed form: L (12C^2 + 13C) blocks + (V + T) C embeddings + 2C final LayerNorm.
    const int64_t C = c.C;
    CHECK(m->num_parameters() == c.L * (12 * C * C + 13 * C) + (c.V + c.T) * C + 2 * C);
  }
}

TEST_CASE("planner: llama shapes count parameters like the published models", "[planner]") {
  // Llama 3 70B: 70,553,706,496 parameters (Meta's model card: 70B; the HF
  // checkpoint's exact count); Llama 2 7B: 6,738,415,616.
  CHECK(parse_model_shape("llama3.1-70b").num_parameters() == 70553706496LL);
  CHECK(parse_model_shape("llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096").num_parameters() ==
        70553706496LL);
  CHECK(parse_model_shape("llama2-7b").num_parameters() == 6738415616LL);
  // Presets take overrides; aliases from HF configs are accepted.
  const ModelConfig m = parse_model_shape("llama3.1-70b:T=4096");
  CHECK(m.T == 4096);
  CHECK(m.NKV == 8);
  CHECK(describe("llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,"
                 "vocab_size=100,seq_len=16") == "llama L=2 C=64 heads=4 kv_heads=4 ffn=128 V=100 T=16");
}

TEST_CASE("planner: the activation model is the model's arena, byte for byte", "[planner]") {
  auto be = make_cpu_backend(1);
  for (auto c : {gpt2(2, 2, 18, 23, 12), gpt2(3, 4, 64, 300, 40), gpt2(1, 1, 32, 256, 7)}) {
    for (int B : {1, 3}) {
      for (bool ckpt : {false, true}) {
        GPT2 model(c, be.get(), B, ckpt);
        INFO("L=" << c.L << " C=" << c.C << " B=" << B << " ckpt=" << ckpt);
        CHECK(estimate_activation_bytes(*arch_of(c), B, ckpt, DeviceModel::cpu()) == double(model.activation_bytes()));
      }
    }
  }
}

TEST_CASE("planner: predicted peak memory is within 15% of measured CPU runs", "[planner]") {
  struct Case {
    std::string name;
    GPT2Config cfg;
    std::string strategy;
    int world, group, micro_batch, accum;
    bool ckpt;
  };
  const std::vector<Case> cases = {
      {"small no_shard x1", gpt2(2, 4, 64, 256, 64), "no_shard", 1, 0, 4, 1, false},
      {"wide no_shard x1", gpt2(4, 8, 256, 2048, 64), "no_shard", 1, 0, 4, 2, false},
      {"full_shard x2", gpt2(4, 4, 96, 512, 32), "full_shard", 2, 0, 8, 1, false},
      {"shard_grad_op x2, checkpointing", gpt2(3, 8, 128, 1000, 64), "shard_grad_op", 2, 0, 2, 1, true},
      {"full_shard x4, checkpointing", gpt2(6, 2, 64, 300, 128), "full_shard", 4, 0, 2, 1, true},
      {"hybrid_shard x4 groups of 2", gpt2(4, 4, 80, 700, 48), "hybrid_shard", 4, 2, 4, 1, false},
      {"long context full_shard x2", gpt2(2, 4, 64, 256, 256), "full_shard", 2, 0, 2, 1, false},
  };
  double worst = 0;
  std::ostringstream table;
  table << "planner vs measured peak (rank 0, CPU backend):\n";
  for (const auto& c : cases) {
    const auto& m = c.cfg;
    std::ostringstream y;
    y << "model: {n_layer: " << m.L << ", n_head: " << m.NH << ", n_embd: " << m.C << ", vocab_size: " << m.V
      << ", seq_len: " << m.T << "}\n"
      << "data: {format: synthetic, synthetic: {vocab: " << std::min(m.V, 64) << ", branching: 3}}\n"
      << "train: {global_batch_size: " << c.micro_batch * c.world * c.accum << ", micro_batch_size: " << c.micro_batch
      << ", max_steps: 3, warmup_steps: 1, log_interval: 1, eval_interval: 0, eval_steps: 1,"
      << " activation_checkpointing: " << (c.ckpt ? "blocks" : "none") << "}\n"
      << "parallel: {sharding: " << c.strategy << ", shard_group_size: " << c.group << ", timeout_s: 60}\n";
    const auto rec = run_job(y.str(), c.world);
    Sharding s;
    s.strategy = c.strategy;
    s.world = c.world;
    s.group = c.strategy == "no_shard" ? 1 : c.strategy == "hybrid_shard" ? c.group : c.world;
    const MemoryBreakdown pred = estimate_memory(*arch_of(m), s, c.micro_batch, c.ckpt, DeviceModel::cpu());
    const double measured = rec.at("mem_peak_bytes").get<double>();
    const double err = (pred.total() - measured) / measured;
    worst = std::max(worst, std::fabs(err));
    char line[256];
    std::snprintf(line, sizeof line, "  %-34s predicted %9.0f KiB  measured %9.0f KiB  %+6.2f%%\n", c.name.c_str(),
                  pred.total() / 1024, measured / 1024, 100 * err);
    table << line;
    INFO(c.name << ": " << line << rec.dump());
    if (std::getenv("PLANNER_DEBUG"))
      std::printf("%s: comm pred %.0f meas %.0f; workspace pred %.0f meas %.0f\n", c.name.c_str(), pred.comm,
                  rec.at("mem_comm_bytes").get<double>(), pred.workspace, rec.at("mem_workspace_bytes").get<double>());
    // The persistent categories are exact: they are sizes, not timings.
    CHECK(pred.params == rec.at("mem_params_bytes").get<double>());
    CHECK(pred.grads == rec.at("mem_grads_bytes").get<double>());
    CHECK(pred.optimizer == rec.at("mem_optimizer_bytes").get<double>());
    CHECK(pred.activations == rec.at("mem_activations_bytes").get<double>());
    CHECK(std::fabs(err) <= 0.15);
  }
  table << "  worst: " << 100 * worst << "%\n";
  WARN(table.str());
}

TEST_CASE("planner: the largest micro-batch that fits is the largest that fits", "[planner]") {
  const PlanRequest req = request_for("gpt2-1.5b").gpu("a100", "40GiB").gpus(8).batch(4, 64);
  const Plan p = make_plan(req);
  const auto arch = make_model_arch(req.model);
  REQUIRE(p.rows.size() == 4);
  for (const auto& row : p.rows) {
    INFO(row.sharding.strategy);
    REQUIRE(row.max_micro_batch > 0);
    CHECK(estimate_memory(*arch, row.sharding, row.max_micro_batch, false, DeviceModel::gpu()).total() <= p.capacity);
    CHECK(estimate_memory(*arch, row.sharding, row.max_micro_batch + 1, false, DeviceModel::gpu()).total() > p.capacity);
    CHECK(row.fits == (row.mem.total() <= p.capacity));
    CHECK(row.step_s >= row.compute_s);
    CHECK(row.mfu > 0);
    CHECK(row.mfu <= req.compute_efficiency + 1e-9);
  }
  // Sharding more state leaves room for bigger micro-batches.
  CHECK(p.rows[2].max_micro_batch >= p.rows[1].max_micro_batch);
  CHECK(p.rows[1].max_micro_batch >= p.rows[0].max_micro_batch);
}

TEST_CASE("planner: a 70B Llama does not train on 8 x 80 GB even with full sharding and checkpointing", "[planner]") {
  PlanRequest req = request_for("llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096")
                        .gpu("h100", "80GiB")
                        .gpus(8)
                        .batch(1, 8)
                        .checkpointing()
                        .job_strategy("full_shard");
  const Plan p = make_plan(req);
  const PlanRow& fs = p.rows[2];
  REQUIRE(fs.sharding.strategy == "full_shard");
  CHECK_FALSE(fs.fits);
  CHECK(fs.max_micro_batch == 0);
  // 18 bytes of sharded state per parameter (fp32 master, bf16 copy, fp32
  // grad, two fp32 moments) over 8 GPUs: ~148 GiB before any activation.
  const double state = fs.mem.params + fs.mem.grads + fs.mem.optimizer;
  CHECK(state / double(1ull << 30) == Approx(18.0 * 70553706496.0 / 8 / double(1ull << 30)).epsilon(0.001));
  CHECK_THAT(p.verdict, Contains("DOES NOT FIT") && Contains("Smallest cluster of these nodes where full_shard fits"));
  // The same question on 3 nodes: it fits.
  req.nodes = 3;
  const Plan p3 = make_plan(req);
  CHECK(p3.rows[2].fits);
  CHECK_THAT(p3.verdict, Contains("FITS"));
  // no_shard never fits a 70B model on one GPU.
  CHECK_FALSE(p.rows[0].fits);
}

TEST_CASE("planner: trainrun plan answers the 70B question from the command line", "[planner]") {
  auto r = test::run_trainrun(
      "plan --model llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096 --gpus 8 --gpu-memory 80GiB "
      "--activation-checkpointing blocks");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("70.554B parameters") && Contains("1 node x 8 H100 SXM 80GB: 80.0 GiB") &&
                        Contains("activation checkpointing on (blocks)"));
  for (const char* s : {"\nno_shard ", "\nshard_grad_op ", "\nfull_shard ", "\nhybrid_shard "}) CHECK_THAT(r.out, Contains(s));
  CHECK_THAT(r.out, Contains("with full_shard and activation checkpointing on 1 x 8 H100 SXM 80GB (80.0 GiB each), "
                             "micro-batch 1: DOES NOT FIT"));
  CHECK_THAT(r.out, !Contains("\nnote "));  // 8 sequences split over 8 GPUs
  WARN(r.out);
  // A batch the launcher would refuse is said so, next to the batch line.
  r = test::run_trainrun("plan --model gpt2-124m --micro-batch 4 --global-batch 6");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("note      6 sequences do not split into micro-batches of 4 over 8 GPUs: a job would be "
                             "refused at launch; the figures assume 32 (use a multiple of 32)"));
}

// A GPT-2 124M job on 8 GPUs, global batch 64, for `plan --config`.
static std::string gpt2_124m_job(int micro_batch, const std::string& parallel) {
  return "model: {n_layer: 12, n_head: 12, n_embd: 768, vocab_size: 50257, seq_len: 1024}\n"
         "data: {format: synthetic}\n"
         "train: {global_batch_size: 64, micro_batch_size: " + std::to_string(micro_batch) + "}\n"
         "parallel: {nproc_per_node: 8, " + parallel + "}\n";
}

TEST_CASE("planner: trainrun plan reads a job spec and marks its strategy", "[planner]") {
  test::TempDir dir("planjob");
  test::write_file(dir / "job.yaml", gpt2_124m_job(8, "sharding: shard_grad_op"));
  auto r = test::run_trainrun("plan --config " + dir / "job.yaml" + " --gpu h200");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("gpt2 L=12 C=768 heads=12 V=50257 T=1024: 124.4M parameters") &&
                        Contains("\nshard_grad_op * ") && Contains("(* the job's parallel.sharding)") &&
                        Contains("micro-batch 8 x 1024 tokens, 64 sequences per step") && Contains("H200 SXM 141GB") &&
                        Contains("with shard_grad_op without activation checkpointing") && Contains(": FITS"));
  // --set overrides the job's fields, as for a run.
  r = test::run_trainrun("plan --config " + dir / "job.yaml" + " --set train.micro_batch_size=4");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("micro-batch 4 x 1024 tokens"));
}

TEST_CASE("planner: model shapes take the Hugging Face config names too", "[planner]") {
  const ModelConfig a = parse_model_shape("gpt2:L=2,C=64,heads=4,V=100,T=16");
  const ModelConfig b =
      parse_model_shape("gpt2:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,vocab_size=100,n_positions=16");
  const ModelConfig c = parse_model_shape("gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=100,n_ctx=16");
  const ModelConfig d = parse_model_shape("llama:L=2,C=64,heads=4,ffn=128,V=100,max_position_embeddings=32");
  CHECK(b.num_parameters() == a.num_parameters());
  CHECK(b.T == 16);
  CHECK(c.num_parameters() == a.num_parameters());
  CHECK(d.T == 32);
}

TEST_CASE("planner: byte sizes parse with their units", "[planner]") {
  CHECK(parse_bytes("80GiB", "x") == 80.0 * (1ull << 30));
  CHECK(parse_bytes("80GB", "x") == 80e9);
  CHECK(parse_bytes("141 GB", "x") == 141e9);
  CHECK(parse_bytes("81559MiB", "x") == 81559.0 * (1 << 20));
  CHECK(parse_bytes("80g", "x") == 80.0 * (1ull << 30));
  CHECK(parse_bytes("1.5TiB", "x") == 1.5 * (1ull << 40));
}

TEST_CASE("planner: bad input to plan gets a clear error and exit code", "[planner]") {
  test::TempDir dir("planbad");
  test::write_file(dir / "job.yaml", "model: {n_layer: 2}\ndata: {format: synthetic}\n");
  test::write_file(dir / "bad.yaml", "model: {n_layr: 2}\n");
  struct Case {
    std::string args;
    int code;
    std::string message;
  };
  const std::string llama = "--model llama:L=80,C=8192,heads=64,kv_heads=8,ffn=28672,V=128256,T=4096 ";
  const std::vector<Case> cases = {
      {"plan", 2, "plan needs --config job.yaml or --model SHAPE"},
      {"plan --model gpt2 --set train.lr=1", 2, "--set needs --config"},
      {"plan --config " + dir / "nope.yaml", 2, "File does not exist"},
      {"plan --config " + dir / "bad.yaml", 1, "model.n_layr: unknown key; did you mean 'model.n_layer'?"},
      {"plan --model gpt3:L=2", 1, "--model 'gpt3:L=2': unknown architecture or preset 'gpt3'; did you mean 'gpt2'?"},
      {"plan --model llama3.1-8bb", 1, "unknown architecture or preset 'llama3.1-8bb'; did you mean 'llama3.1-8b'?"},
      {"plan --model llama:L=2,C=64,heads=4,V=100,T=16", 1, "ffn is required for llama"},
      {"plan --model gpt2:L=2,C=64,heads=4,V=100,T=16,layres=3", 1, "unknown key 'layres'; did you mean 'L'?"},
      {"plan --model gpt2:L=two,C=64,heads=4,V=100,T=16", 1, "L='two' is not a whole number"},
      {"plan --model gpt2:L=2,C=65,heads=4,V=100,T=16", 1, "C (65) must be divisible by heads (4)"},
      {"plan --model gpt2:L=2,C=64,heads=4,V=100,T=16,kv_heads=2", 1, "gpt2 has no grouped-query attention"},
      {"plan --model llama:L=2,C=64,heads=4,kv_heads=3,ffn=8,V=100,T=16", 1, "heads (4) must be a multiple of kv_heads (3)"},
      {"plan --model gpt2:L=0,C=64,heads=4,V=100,T=16", 1, "L must be at least 1 (got 0)"},
      {"plan --model gpt2:L=2,C64", 1, "'C64' is not KEY=VALUE"},
      {"plan " + llama + "--gpu-memory 80", 1, "--gpu-memory: '80' has no unit; write e.g. 80GiB"},
      {"plan " + llama + "--gpu-memory lots", 1, "--gpu-memory: 'lots' is not a size"},
      {"plan " + llama + "--gpu-memory 80GX", 1, "--gpu-memory: unknown unit 'gx'"},
      {"plan " + llama + "--gpu-memory -5GB", 1, "must be positive"},
      {"plan " + llama + "--gpu tpu", 1, "--gpu: unknown GPU 'tpu' (known: a100, h100, h200); for one of these with "
                                         "another memory size, add --gpu-memory"},
      {"plan " + llama + "--gpus 0", 2, "--gpus: Value 0 not in range"},
      {"plan " + llama + "--nodes -1", 2, "--nodes"},
      {"plan " + llama + "--activation-checkpointing yes", 2, "--activation-checkpointing: yes not in {none,blocks}"},
      {"plan --config " + dir / "job.yaml --set parallel.sharding=hybrid_shard --set parallel.shard_group_size=3 --gpus 8", 1,
       "parallel.shard_group_size (3) must divide the GPU count (8)"},
  };
  for (const auto& c : cases) {
    auto r = test::run_trainrun(c.args);
    INFO(c.args << "\n" << r.err);
    CHECK(r.exit_code == c.code);
    CHECK_THAT(r.err, Contains(c.message));
    CHECK(r.out.empty());
  }
}

TEST_CASE("planner: plan --model takes the model.preset names, and plan --config a job with model.preset",
          "[planner][preset]") {
  auto r = test::run_trainrun("plan --model llama3.1-70b --gpus 8");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("llama L=80 C=8192 heads=64 kv_heads=8 ffn=28672 V=128256 T=8192") &&
                        Contains("70.554B parameters"));
  // Issue 30 item 4: a name that fits more than one release is refused with
  // the exact names (llama3-8b was an alias of Llama 3.1's row, RoPE scaling
  // x8 included, which Meta-Llama-3-8B does not have).
  for (const std::string amb : {"llama3-8b", "llama3-70b"}) {
    r = test::run_trainrun("plan --model " + amb + " --gpus 8");
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("--model '" + amb + "': '" + amb + "' is ambiguous") &&
                          Contains("which Llama 3 release") &&
                          Contains(amb == "llama3-8b" ? "llama3.1-8b (meta-llama/Llama-3.1-8B)"
                                                      : "llama3.1-70b (meta-llama/Llama-3.1-70B)"));
    CHECK_THROWS_WITH(parse_model_shape(amb), Contains("is ambiguous"));
  }
  // A family without a size lists every size; one of its point releases too.
  CHECK_THROWS_WITH(parse_model_shape("llama3"),
                    Contains("llama3.2-1b (meta-llama/Llama-3.2-1B), llama3.2-3b (meta-llama/Llama-3.2-3B), "
                             "llama3.1-8b (meta-llama/Llama-3.1-8B), llama3.1-70b (meta-llama/Llama-3.1-70B)"));
  CHECK_THROWS_WITH(parse_model_shape("llama3.2"), Contains("llama3.2-1b") && Contains("llama3.2-3b") &&
                                                       !Contains("llama3.1-8b"));
  CHECK(ambiguous_preset_message("llama3.1-8b").empty());
  CHECK(ambiguous_preset_message("llama3.1-7b").empty());  // no such size: a typo, with a suggestion below
  // A preset brings its Llama details, which the shape text has no keys for.
  const ModelConfig one = parse_model_shape("llama3.2-1b:T=2048");
  CHECK(one.T == 2048);
  CHECK(one.tied);
  CHECK(one.rope_theta == 500000);
  CHECK(one.rope_scaling_type == "llama3");
  CHECK(one.rope_scaling.factor == 32);
  // A typo gets the nearest name.
  r = test::run_trainrun("plan --model llama3.1-7b");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("unknown architecture or preset 'llama3.1-7b'; did you mean 'llama3.1-8b'?"));

  test::TempDir dir("plan_preset");
  test::write_file(dir / "job.yaml", "model: {preset: llama3.1-8b, seq_len: 4096}\ndata: {format: synthetic}\n"
                                     "train: {micro_batch_size: 1, global_batch_size: 8}\n");
  r = test::run_trainrun("plan --config '" + dir / "job.yaml" + "' --gpus 8");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("llama L=32 C=4096 heads=32 kv_heads=8 ffn=14336 V=128256 T=4096") &&
                        Contains("8.030B parameters"));
  CHECK_THAT(r.err, Contains("model.seq_len: 4096 (preset llama3.1-8b has 8192)"));
  CHECK_THAT(r.err, !Contains("model.adapter"));

  // An adapter job plans as one (tests/test_planner_adapter.cpp has the model).
  test::write_file(dir / "lora.yaml", "model: {preset: llama3.1-8b, seq_len: 4096, adapter: {type: lora, rank: 16}}\n"
                                      "data: {format: synthetic}\ntrain: {micro_batch_size: 1, global_batch_size: 8}\n");
  r = test::run_trainrun("plan --config '" + dir / "lora.yaml" + "' --gpus 8");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("adapter   lora r=16 on all-linear: 41.9M trainable parameters"));
}

TEST_CASE("planner: offload's device and host bytes are the store's, byte for byte", "[planner][offload]") {
  struct Case {
    std::string strategy;
    int world, group;
  };
  for (const Case& c : {Case{"no_shard", 1, 0}, Case{"shard_grad_op", 2, 0}, Case{"full_shard", 2, 0},
                        Case{"hybrid_shard", 4, 2}}) {
    INFO(c.strategy << " x" << c.world);
    const GPT2Config m = gpt2(2, 4, 64, 256, 32);
    std::ostringstream y;
    y << "model: {n_layer: " << m.L << ", n_head: " << m.NH << ", n_embd: " << m.C << ", vocab_size: " << m.V
      << ", seq_len: " << m.T << "}\n"
      << "data: {format: synthetic, synthetic: {vocab: 64, branching: 3}}\n"
      << "train: {global_batch_size: " << 2 * c.world << ", micro_batch_size: 2, max_steps: 2, warmup_steps: 1,"
      << " log_interval: 1, eval_interval: 0, eval_steps: 1}\n"
      << "parallel: {sharding: " << c.strategy << ", shard_group_size: " << c.group
      << ", timeout_s: 60, offload: cpu}\n";
    const auto rec = run_job(y.str(), c.world);
    Sharding s;
    s.strategy = c.strategy;
    s.world = c.world;
    s.group = c.strategy == "no_shard" ? 1 : c.strategy == "hybrid_shard" ? c.group : c.world;
    s.offload = true;
    const MemoryBreakdown pred = estimate_memory(*arch_of(m), s, 2, false, DeviceModel::cpu());
    CHECK(pred.params == rec.at("mem_params_bytes").get<double>());
    CHECK(pred.grads == rec.at("mem_grads_bytes").get<double>());
    CHECK(pred.optimizer == 0);
    CHECK(rec.at("mem_optimizer_bytes").get<double>() == 0);
    CHECK(offload_host_bytes_per_rank(*arch_of(m), s) == rec.at("mem_host_bytes").get<double>());
  }
}

TEST_CASE("planner: Llama 3 70B on 8 x 80 GB trains with offload cpu, and says how much host memory", "[planner][offload]") {
  PlanRequest req =
      request_for("llama3.1-70b").gpu("a100", "80GB").gpus(8).batch(1, 8).checkpointing().job_strategy("full_shard");
  const Plan none = make_plan(req);
  REQUIRE(none.rows[2].sharding.strategy == "full_shard");
  CHECK_FALSE(none.rows[2].fits);
  CHECK_THAT(none.verdict, Contains("DOES NOT FIT"));
  req.offload = "cpu";
  const Plan cpu = make_plan(req);
  const PlanRow& fs = cpu.rows[2];
  CHECK(fs.fits);
  CHECK(fs.mem.optimizer == 0);
  CHECK(fs.mem.grads == 0);
  // 16 bytes per parameter (fp32 master, two moments, fp32 gradient) on the
  // host: 1.13 TB for the node (the shards' padding is negligible).
  CHECK(fs.host_bytes_per_node == Approx(16.0 * 70553706496.0).epsilon(1e-6));
  CHECK(fs.offload_s > 0);
  CHECK(fs.step_s > none.rows[2].step_s);  // offload costs time
  CHECK_THAT(cpu.verdict, Contains("with parallel.offload: cpu, FITS") && Contains("GiB of host memory per node"));
  // With a node of 512 GB the host memory does not hold it.
  req.host_memory = 512e9;
  const Plan small = make_plan(req);
  CHECK_FALSE(small.rows[2].fits);
  CHECK_THAT(small.verdict, Contains("DOES NOT FIT in host memory") && Contains("--offload nvme"));
  // nvme: only the I/O buffers on the host (10 chunks of 1M fp32 and 2
  // pages per rank); master weights, moments and gradient on the disks:
  // per element 32 bytes per step plus 8 per micro-batch after the first
  // and 4 for the first (the gradient's read-modify-write).
  req.offload = "nvme";
  const Plan nvme = make_plan(req);
  CHECK(nvme.rows[2].fits);
  CHECK(nvme.rows[2].host_bytes_per_node == Approx(8 * (10.0 * (1 << 20) + 2048) * 4));
  const double elems_node = fs.host_bytes_per_node / 16;
  CHECK(nvme.rows[2].nvme_bytes_per_step == Approx(elems_node * (32 + 8.0 * nvme.rows[2].accum - 4)));
  CHECK(nvme.rows[2].nvme_bytes_per_step > 0);
  // From the command line.
  auto r = test::run_trainrun("plan --model llama3.1-70b --gpu a100 --gpu-memory 80GB --activation-checkpointing blocks --offload cpu");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("offload   cpu:") && Contains("with parallel.offload: cpu, FITS"));
  r = test::run_trainrun("plan --model llama3.1-70b --gpu a100 --gpu-memory 80GB --activation-checkpointing blocks");
  CHECK_THAT(r.out, Contains("DOES NOT FIT"));
}

// ---- tensor parallelism ------------------------------------------------------------------

TEST_CASE("planner: the TP activation model is each TP rank's arena, byte for byte", "[planner][tp]") {
  auto be = make_cpu_backend(1);
  std::vector<ModelConfig> shapes = {parse_model_shape("gpt2:L=2,C=32,heads=4,V=100,T=8"),
                                     parse_model_shape("llama:L=2,C=32,heads=4,kv_heads=2,ffn=48,V=101,T=8"),
                                     parse_model_shape("llama:L=3,C=32,heads=4,kv_heads=1,ffn=64,V=64,T=16"),
                                     parse_model_shape("qwen2:L=3,C=32,heads=4,kv_heads=1,ffn=64,V=64,T=16")};
  for (const ModelConfig& c : shapes) {
    const auto arch = make_model_arch(c);
    for (int tp : {2, 4}) {
      for (bool sp : {false, true}) {
        for (bool ckpt : {false, true}) {
          for (int B : {1, 3}) {
            if (sp && (B * c.T) % tp != 0) continue;  // SP splits the rows evenly
            const TensorParallelPlan plan(*arch, tp, 1);
            TensorParallel ctx;
            ctx.plan = &plan;
            ctx.sequence_parallel = sp;
            const auto net = arch->make_network(be.get(), B, ckpt, &ctx);
            INFO(arch->describe() << " tp" << tp << " sp=" << sp << " ckpt=" << ckpt << " B=" << B);
            CHECK(estimate_tp_activation_bytes(*arch, tp, sp, B, ckpt, DeviceModel::cpu()) ==
                  double(net->activation_bytes()));
          }
        }
      }
    }
    // tp 1 is the existing model.
    CHECK(estimate_tp_activation_bytes(*arch, 1, false, 2, false, DeviceModel::cpu()) ==
          estimate_activation_bytes(*arch, 2, false, DeviceModel::cpu()));
  }
}

TEST_CASE("sequence parallelism keeps 1/T of every per-layer activation outside attention and the MLP",
          "[planner][tp][sp]") {
  // Per layer the residual stream (after attention, after the MLP), both
  // norms' outputs and their statistics live outside attention and the MLP:
  // with SP a rank keeps only its N/T rows of each (the norm outputs are
  // all-gathered again where a column layer reads them). Measured on the
  // networks' own arenas as the per-layer growth (L=4 minus L=2, halved).
  auto be = make_cpu_backend(1);
  for (const char* shape : {"gpt2:C=32,heads=4,V=100,T=16", "llama:C=32,heads=4,kv_heads=2,ffn=48,V=101,T=16"}) {
    for (int tp : {2, 4}) {
      const int B = 4, N = B * 16, C = 32, NR = N / tp;
      auto per_layer = [&](bool sp) {
        double bytes[2];
        for (int i = 0; i < 2; ++i) {
          const auto arch = make_model_arch(parse_model_shape(std::string(shape) + ",L=" + std::to_string(2 + 2 * i)));
          const TensorParallelPlan plan(*arch, tp, 0);
          TensorParallel ctx;
          ctx.plan = &plan;
          ctx.sequence_parallel = sp;
          bytes[i] = double(arch->make_network(be.get(), B, false, &ctx)->activation_bytes());
        }
        return (bytes[1] - bytes[0]) / 2;
      };
      const bool llama = std::string(shape).rfind("llama", 0) == 0;
      const double stats = llama ? 2 : 4;  // RMSNorm: rstd x 2 norms; LayerNorm: mean, rstd x 2
      INFO(shape << " tp" << tp);
      // 4 (rows, C) fp32 activations and the statistics, each N -> N/T rows.
      CHECK(per_layer(false) - per_layer(true) == 4.0 * (N - NR) * C * 4 + stats * (N - NR) * 4);
    }
  }
}

TEST_CASE("planner: a tp2 row's memory and time are the hand-computed ones", "[planner][tp]") {
  // GPT-2 L=2 C=64 heads=4 V=256 T=32 on 2 GPUs: tp2 x dp1 no_shard.
  // dp1: two micro-batches per step.
  const PlanRequest req = request_for("gpt2:L=2,C=64,heads=4,V=256,T=32").gpu("h100").gpus(2).batch(2, 4);
  const Plan p = make_plan(req);
  const PlanRow* row = nullptr;
  for (const auto& r : p.tp_rows)
    if (r.tp == 2 && r.sharding.strategy == "no_shard") row = &r;
  REQUIRE(row);
  CHECK(row->dp == 1);
  CHECK(row->accum == 2);
  // One TP rank's parameters: per block the replicated LayerNorms (2 x 2C)
  // and row-parallel biases (2 x C), and half of c_attn (3C x C + 3C),
  // attn c_proj's weight (C x C), c_fc (4C x C + 4C) and mlp c_proj's
  // weight (C x 4C); half the (tied) token embedding, the whole position
  // table and the final LayerNorm.
  const double C = 64, V = 256, T = 32;
  const double block = 4 * C + 2 * C + (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C) / 2;
  const double P = 2 * block + V * C / 2 + T * C + 2 * C;
  CHECK(row->mem.params == 6 * P);  // fp32 master + bf16 copy
  CHECK(row->mem.grads == 4 * P);
  CHECK(row->mem.optimizer == 8 * P);
  // TP traffic: (4 per block + embedding + head) all-reduces of B*T*C bf16
  // values per micro-batch, ring 2(T-1)/T, at 80% of 450 GB/s.
  const double bytes = 2 * T * C * 2;
  CHECK(tp_collectives_per_micro_batch(req.model, false) == 10);
  CHECK(tp_collectives_per_micro_batch(req.model, true) == 14);
  CHECK(row->tp_comm_s == Approx(2 * 10 * 2.0 * (2 - 1) / 2 * bytes / (450e9 * 0.8)).epsilon(1e-12));
  // Compute: half of each micro-batch's FLOPs per GPU.
  const auto arch = make_model_arch(req.model);
  CHECK(row->compute_s == Approx(2 * 2 * T * arch->flops_per_token() / 2 / (989.4e12 * 0.45)).epsilon(1e-12));
  CHECK(row->step_s == Approx(row->compute_s + row->tp_comm_s).epsilon(1e-12));  // dp1: no dp traffic
  CHECK(row->tp_link == "NVLink");
}

TEST_CASE("planner: TP degrees the model cannot split are not offered, and say why", "[planner][tp]") {
  // 12 heads: tp 8 does not divide them.
  const PlanRequest req = request_for("gpt2:L=2,C=96,heads=12,V=256,T=32").gpus(8);
  const Plan p = make_plan(req);
  bool saw8 = false;
  for (const auto& n : p.tp_not_offered)
    if (n.first == 8) {
      saw8 = true;
      CHECK_THAT(n.second, Contains("model.n_head (12) is not divisible by parallel.tensor_parallel (8)"));
    }
  CHECK(saw8);
  for (const auto& r : p.tp_rows) CHECK(r.tp != 8);
  CHECK(std::any_of(p.tp_rows.begin(), p.tp_rows.end(), [](const PlanRow& r) { return r.tp == 4; }));
  auto r = test::run_trainrun("plan --model gpt2:L=2,C=96,heads=12,V=256,T=32 --gpus 8");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("tp8: not offered: model.n_head (12) is not divisible by parallel.tensor_parallel (8)") &&
                        Contains("\ntp4 x dp2  full_shard ") && !Contains("\ntp8 x "));
  // Llama 3 8B's 8 KV heads split at tp 8; 6 GPUs only take tp 2.
  r = test::run_trainrun("plan --model llama3.1-8b --gpus 6");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("tp4: not offered: does not divide the 6 GPUs") && Contains("tp8: not offered: more than the 6 GPUs"));
}

TEST_CASE("planner: Llama 3 70B on 8 x 80 GB gets a mesh that fits", "[planner][tp]") {
  PlanRequest req = request_for("llama3.1-70b").gpu("h100", "80GiB").gpus(8).batch(1, 8).checkpointing();
  // No mesh holds 18 bytes x 70.6B / 8 of state in 80 GiB: it says so.
  Plan p = make_plan(req);
  CHECK_FALSE(p.has_recommendation);
  CHECK_THAT(p.recommendation, Contains("recommended: none") && Contains("--offload cpu"));
  // With the optimizer state on the host it does, at tp1 and on TP meshes.
  req.offload = "cpu";
  p = make_plan(req);
  REQUIRE(p.has_recommendation);
  CHECK(p.recommended.fits);
  CHECK(p.recommended.mem.total() <= p.capacity);
  CHECK_THAT(p.recommendation, Contains("with parallel.offload cpu: fits in 80.0 GiB with"));
  CHECK(p.tp_not_offered.empty());
  // A TP rank offloads its slice: tp2 x dp4 full_shard holds what tp1 x dp8
  // full_shard holds (the same 1/8 of the state per GPU, up to padding).
  const PlanRow* tp1 = nullptr;
  const PlanRow* tp2 = nullptr;
  for (const auto& r : p.rows)
    if (r.sharding.strategy == "full_shard") tp1 = &r;
  for (const auto& r : p.tp_rows)
    if (r.tp == 2 && r.sharding.strategy == "full_shard") tp2 = &r;
  REQUIRE(tp1);
  REQUIRE(tp2);
  CHECK(tp1->host_bytes_per_node > 1e12);  // 16 bytes x 70.6B = 1.13 TB on the node
  CHECK(tp2->host_bytes_per_node == Approx(tp1->host_bytes_per_node).epsilon(0.001));
  CHECK(tp2->mem.optimizer == 0);
  CHECK(tp2->offload_s > 0);
  CHECK_THAT(render_plan(p), Contains("tp2 x dp4  full_shard ") && Contains("host 1051.3 GiB/node"));
  // On 4 nodes it trains without offload, and the fastest fitting mesh keeps TP inside a node.
  req.offload = "none";
  req.nodes = 4;
  req.global_batch = 32;
  p = make_plan(req);
  REQUIRE(p.has_recommendation);
  CHECK(p.recommended.fits);
  for (const auto& r : p.rows)
    if (r.fits) CHECK(p.recommended.step_s <= r.step_s);
  for (const auto& r : p.tp_rows)
    if (r.fits && r.tp_link == "NVLink") CHECK(p.recommended.step_s <= r.step_s);
  CHECK(p.recommended.tp <= 8);
  CHECK((p.recommended.tp == 1 || p.recommended.tp_link == "NVLink"));
  CHECK_THAT(p.recommendation, Contains("GiB free") && Contains("meshes that fit"));
  WARN(render_plan(p));
}

TEST_CASE("planner: TP never goes over PCIe when the node has NVLink, even when it looks faster", "[planner][tp]") {
  PlanRequest req = request_for("llama3.1-8b").gpu("a100").gpus(4).batch(1, 4);
  // A node where tp 4 crosses PCIe but the planner is told PCIe is fast:
  // the tp4 rows become the fastest, yet are not recommended.
  req.tp_links = {{2, "NVLink", 300e9, ""}, {4, "PCIe", 1e15, ""}};
  req.topology_has_nvlink = true;
  req.compute_efficiency = 0.45;
  Plan p = make_plan(req);
  const PlanRow* fastest = nullptr;
  for (const auto& r : p.tp_rows)
    if (r.fits && (!fastest || r.step_s < fastest->step_s)) fastest = &r;
  REQUIRE(fastest);
  REQUIRE(fastest->tp == 4);
  REQUIRE(p.has_recommendation);
  CHECK(p.recommended.tp_link != "PCIe");
  CHECK_THAT(p.recommendation, Contains("Not tp4 x dp1") && Contains("would put TP over PCIe while this node has NVLink"));
  // A node with no NVLink at all: PCIe is all there is, and allowed.
  req.topology_has_nvlink = false;
  p = make_plan(req);
  REQUIRE(p.has_recommendation);
  CHECK(p.recommended.tp == 4);
  CHECK_THAT(p.recommendation, Contains("tp runs over PCIe (this node has no NVLink"));
}

TEST_CASE("planner: plan reads the TP links from a topology and marks the job's mesh", "[planner][tp][cli]") {
  const std::string fx = std::string(TRAINRUN_SOURCE_DIR) + "/tests/fixtures/topology/";
  auto r = test::run_trainrun("plan --model llama3.1-8b --gpu a100 --nvidia-smi-topo '" + fx + "pcie_nvlink_pairs.txt' "
                              "--activation-checkpointing blocks");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  // 4 GPUs from the topology; tp 2 on the NVLink pairs (4 links), tp 4 over PCIe.
  CHECK_THAT(r.out, Contains("1 node x 4 A100") && Contains("TP links from " + fx + "pcie_nvlink_pairs.txt") &&
                        Contains("  tp2: NVLink, 100 GB/s (NV4 between its GPUs)") &&
                        Contains("  tp4: PCIe, 25 GB/s (ranks 0-3 (GPUs 0,1,2,3): PCIe (NODE))"));
  CHECK_THAT(r.out, Contains("\ntp4 x dp1  full_shard ") && Contains("tp8: not offered: more than the 4 GPUs"));
  CHECK_THAT(r.out, Contains("\nrecommended: ") && !Contains("recommended: tp4"));
  // A DGX: every degree on NVLink (NV18, capped at the GPU's 450 GB/s).
  r = test::run_trainrun("plan --model llama3.1-8b --nvidia-smi-topo '" + fx + "dgx_h100.txt'");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("  tp8: NVLink, 450 GB/s (NV18 between its GPUs)"));
  // The job's mesh is marked; its topology_file is read.
  test::TempDir dir("plan_tp");
  REQUIRE(test::run_trainrun("topo --save '" + dir / "pairs.json" + "' --nvidia-smi-topo '" + fx + "pcie_nvlink_pairs.txt'")
              .exit_code == 0);
  test::write_file(dir / "job.yaml", "model: {preset: llama3.2-1b, seq_len: 2048}\ndata: {format: synthetic}\n"
                                     "train: {micro_batch_size: 1, global_batch_size: 4}\n"
                                     "parallel: {tensor_parallel: 2, sequence_parallel: true, sharding: full_shard, "
                                     "topology_file: '" + dir / "pairs.json" + "'}\n");
  r = test::run_trainrun("plan --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("\ntp2 x dp2  full_shard * ") && Contains("(* the job's parallel.tensor_parallel") &&
                        Contains("; sequence parallel)") && Contains("TP links from " + dir / "pairs.json"));
  // Bad input.
  r = test::run_trainrun("plan --model llama3.1-8b --topology '" + dir / "missing.json" + "'");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--topology"));
  r = test::run_trainrun("plan --model llama3.1-8b --topology '" + dir / "pairs.json" + "' --nvidia-smi-topo '" + fx +
                         "dgx_h100.txt'");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("excludes"));
  // A description without GPUs (a CPU node's sysfs fixture) cannot say where TP goes.
  REQUIRE(test::run_trainrun("topo --save '" + dir / "cpu.json" + "' --sysfs-root '" + fx + "sysfs/cpu_only_2numa'").exit_code == 0);
  r = test::run_trainrun("plan --model llama3.1-8b --topology '" + dir / "cpu.json" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("has no GPUs; plan needs a GPU node's description"));
}

// ---- pipeline parallelism -------------------------------------------------------------

TEST_CASE("planner: the bubble formulas per schedule, and the schedules' simulated idle time", "[planner][pp]") {
  CHECK(pipeline_bubble_formula("1f1b", 4, 1, 8) == Approx(3.0 / 8));
  CHECK(pipeline_bubble_formula("gpipe", 4, 1, 8) == Approx(3.0 / 8));
  CHECK(pipeline_bubble_formula("interleaved_1f1b", 4, 2, 8) == Approx(3.0 / 16));
  CHECK(pipeline_bubble_formula("zero_bubble", 4, 1, 8) == Approx(3.0 / 24));
  CHECK(pipeline_bubble_formula("1f1b", 1, 1, 8) == 0);
  CHECK_THROWS_WITH(pipeline_bubble_formula("zb", 2, 1, 4), Contains("unknown schedule 'zb'"));
  // The formula is idle / busy; the simulator (unit costs) gives idle /
  // (idle + busy): the two agree for every schedule.
  struct K { std::string kind; int p, v, m; };
  for (const K& k : std::vector<K>{{"1f1b", 4, 1, 8}, {"gpipe", 4, 1, 8}, {"interleaved_1f1b", 4, 2, 8},
                                   {"zero_bubble", 4, 1, 8}, {"1f1b", 2, 1, 6}}) {
    const PipelineStats st = simulate_pipeline_schedule(make_pipeline_schedule(k.kind, k.p, k.v, k.m));
    INFO(k.kind << " p" << k.p << " v" << k.v << " m" << k.m);
    CHECK(st.bubble / (1 - st.bubble) == Approx(pipeline_bubble_formula(k.kind, k.p, k.v, k.m)).epsilon(1e-9));
  }
}

TEST_CASE("planner: per-stage memory is the stage's units and P in-flight microbatches, by hand", "[planner][pp]") {
  // GPT-2 (tied head), 4 layers over pp2: rank 0 has the embedding and
  // blocks 0-1, rank 1 blocks 2-3, the final norm and head and the tied
  // embedding's copy. no_shard over dp 1 on the GPU model: 4 + 2 bytes of
  // parameters, 4 of gradients and 8 of moments per element.
  const std::string shape = "gpt2:L=4,C=64,heads=4,V=256,T=32";
  const auto m = make_model_arch(parse_model_shape(shape));
  const auto& u = m->layout().units;
  REQUIRE(u.size() == 6);
  const double e0 = double(u[0].numel), blk = double(u[1].numel), head = double(u[5].numel);
  const DeviceModel d = DeviceModel::gpu();
  Sharding s{"no_shard", 1, 1, false};
  // One microbatch's arena for 1 and 2 blocks: what a block adds, and the rest.
  ModelConfig c1 = parse_model_shape(shape), c2 = c1;
  c1.L = 1, c2.L = 2;
  const double a1 = estimate_activation_bytes(*make_model_arch(c1), 2, false, d);
  const double a2 = estimate_activation_bytes(*make_model_arch(c2), 2, false, d);
  const double per_layer = a2 - a1, fixed = a1 - per_layer;
  REQUIRE(per_layer > 0);
  auto st = estimate_pipeline_memory(*m, 1, false, 2, "1f1b", 1, 4, s, 2, false, d);
  REQUIRE(st.size() == 2);
  CHECK(st[0].layers == 2);
  CHECK(st[0].in_flight == 2);  // 1F1B: the first stage holds P microbatches
  CHECK(st[1].in_flight == 1);
  CHECK(st[0].mem.params == Approx(6 * (e0 + 2 * blk)));
  CHECK(st[1].mem.params == Approx(6 * (2 * blk + head + e0)));  // with the tied copy
  CHECK(st[0].mem.grads == Approx(4 * (e0 + 2 * blk)));
  CHECK(st[1].mem.optimizer == Approx(8 * (2 * blk + head + e0)));
  // Each microbatch in flight has its own stage network (the executor's):
  // its 2 blocks and the rest of an arena, without the final norm, logits
  // and losses on the first stage (N = 2 x 32 rows, bf16, vocab 256),
  // less the backward scratch (dbuf_c, dqkv, the MLP hidden grad), which
  // every network of the rank shares, counted once:
  const double N = 2 * 32, head_acts = N * 64 * 2 + 2 * N * 4 + N * 256 * 2 + N * 4;
  const double scratch = N * (64 + 3 * 64 + 4 * 64) * 2;
  CHECK(st[0].mem.activations == Approx(2 * (2 * per_layer + fixed - head_acts - scratch) + scratch));
  CHECK(st[1].mem.activations == Approx(1 * (2 * per_layer + fixed - scratch) + scratch));
  // GPipe holds all m; zero_bubble 1F1B's plus the last stage's deferred
  // weight step's kept output gradients.
  st = estimate_pipeline_memory(*m, 1, false, 2, "gpipe", 1, 4, s, 2, false, d);
  CHECK(st[0].in_flight == 4);
  CHECK(st[0].mem.activations == Approx(4 * (2 * per_layer + fixed - head_acts - scratch) + scratch));
  st = estimate_pipeline_memory(*m, 1, false, 2, "zero_bubble", 1, 4, s, 2, false, d);
  // The ZB-H1 lists (explain_pipeline_schedule): rank 0 runs BI k BW k
  // back to back (1 open), rank 1 runs BI0 BI1 before BW0 (2 open).
  CHECK(st[0].deferred == 1);
  CHECK(st[1].deferred == 2);
  const double kept = N * (3 * 64 + 64 + 64 + 256) * 2;  // q|k|v, attn out, fc, mlp out (bf16)
  // Every held microbatch network keeps them for each of its blocks.
  CHECK(st[0].mem.activations ==
        Approx(st[0].in_flight * (2 * (per_layer + kept) + fixed - head_acts - scratch) + scratch));
  CHECK(st[1].mem.activations == Approx(st[1].in_flight * (2 * (per_layer + kept) + fixed - scratch) + scratch));
  // Over dp 2 with full_shard each rank holds half its stage's state.
  Sharding fs{"full_shard", 2, 2, false};
  st = estimate_pipeline_memory(*m, 1, false, 2, "1f1b", 1, 4, fs, 2, false, d);
  CHECK(st[0].mem.optimizer == Approx(8 * (std::ceil(e0 / 2) + 2 * std::ceil(blk / 2))));
}

TEST_CASE("planner: a pp row's bubble, compute and p2p are the hand-computed ones", "[planner][pp]") {
  // pp2 x dp1: 4 microbatches.
  const PlanRequest req = request_for("gpt2:L=4,C=64,heads=4,V=256,T=32").gpus(2).batch(2, 8);
  const Plan p = make_plan(req);
  const PlanRow* r = nullptr;
  for (const auto& row : p.pp_rows)
    if (row.pp == 2 && row.tp == 1) r = &row;
  REQUIRE(r);
  CHECK(r->dp == 1);
  CHECK(r->accum == 4);
  CHECK(r->bubble == Approx(1.0 / 4));
  CHECK(r->worst_stage == 0);
  const double fpt = make_model_arch(req.model)->flops_per_token();
  CHECK(r->compute_s == Approx(4 * 2 * 32 * fpt / 2 / (989.4e12 * 0.45)));
  // 4 microbatches x forward + backward x 2 x 32 x 64 bf16 over NVLink at 80%.
  CHECK(r->p2p_s == Approx(2.0 * 4 * (2 * 32 * 64 * 2) / (450e9 * 0.8)));
  CHECK(r->pp_link == "NVLink");
  CHECK(r->step_s >= r->compute_s * 1.25 + r->p2p_s);
}

TEST_CASE("planner: pipeline degrees that do not divide the layers or GPUs are not offered, and say why",
          "[planner][pp]") {
  PlanRequest req = request_for("gpt2:L=12,C=96,heads=12,V=256,T=32").gpus(8).batch(1, 64);
  Plan p = make_plan(req);
  auto why = [&](const Plan& pl, const std::string& mesh) {
    for (const auto& n : pl.pp_not_offered)
      if (n.first == mesh) return n.second;
    return std::string("(offered)");
  };
  CHECK_THAT(why(p, "pp8"), Contains("does not divide the model's 12 layers into 8 equal stages"));
  CHECK_THAT(why(p, "tp4 x pp4"), Contains("tp x pp = 16 is more than the 8 GPUs"));
  for (const auto& r : p.pp_rows) CHECK(r.pp != 8);
  CHECK(std::any_of(p.pp_rows.begin(), p.pp_rows.end(), [](const PlanRow& r) { return r.pp == 4 && r.tp == 2; }));
  // Too few microbatches for the stages: the schedule's own error.
  req.global_batch = 4;  // pp4 x dp2: 2 microbatches per step for 4 stages
  p = make_plan(req);
  CHECK_THAT(why(p, "tp1 x pp4"), Contains("microbatches") && Contains("raise --global-batch"));
  // Offload with PP: each stage's ranks offload their own units; a fully
  // sharded pipeline spreads the whole model's host state over the node's
  // GPUs, so its host memory per node is the tp1 full_shard row's.
  req.global_batch = 64;
  req.offload = "cpu";
  p = make_plan(req);
  REQUIRE(!p.pp_rows.empty());
  const auto tp1_full = std::find_if(p.rows.begin(), p.rows.end(),
                                     [](const PlanRow& r) { return r.sharding.strategy == "full_shard"; });
  REQUIRE(tp1_full != p.rows.end());
  for (const PlanRow& r : p.pp_rows) {
    INFO("tp" << r.tp << " x pp" << r.pp << " " << r.sharding.strategy);
    CHECK(r.sharding.offload);
    CHECK(r.host_bytes_per_node > 0);
    CHECK(r.offload_s > 0);
    CHECK(r.mem.optimizer == 0);  // the moments live on the host
    if (r.sharding.strategy == "full_shard" && r.tp == 1)
      CHECK(r.host_bytes_per_node == Approx(tp1_full->host_bytes_per_node).epsilon(0.02));
  }
  auto r = test::run_trainrun("plan --model gpt2:L=12,C=96,heads=12,V=256,T=32 --gpus 6 --global-batch 48");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("pp4: not offered: does not divide the 6 GPUs") && Contains("\ntp1 x pp2 x dp3 ") &&
                        Contains("pipeline parallel (tp x pp x dp = 6 GPUs; schedule 1f1b"));
}

TEST_CASE("planner: plan --pp-schedule and --pp-virtual-stages, and their bad input", "[planner][pp][cli]") {
  const std::string base = "plan --model gpt2:L=8,C=64,heads=4,V=256,T=32 --gpus 4 --global-batch 32 ";
  auto r = test::run_trainrun(base + "--pp-schedule interleaved_1f1b --pp-virtual-stages 2");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("schedule interleaved_1f1b"));
  r = test::run_trainrun(base + "--pp-schedule zero_bubble");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("schedule zero_bubble") && Contains("\ntp1 x pp2 x dp2 "));
  r = test::run_trainrun(base + "--pp-schedule zb");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.out + r.err, Contains("--pp-schedule"));
  r = test::run_trainrun(base + "--pp-virtual-stages 2");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.out + r.err, Contains("--pp-virtual-stages 2: only interleaved_1f1b has chunks"));
  // zero_bubble with checkpointing is refused at load: never offered.
  r = test::run_trainrun(base + "--pp-schedule zero_bubble --activation-checkpointing blocks");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("pp2: not offered: zero_bubble with train.activation_checkpointing: blocks is refused"));
}

TEST_CASE("planner: Llama 3 70B on 2 nodes gets a tp x pp x dp recommendation and why", "[planner][pp]") {
  const PlanRequest req = request_for("llama3.1-70b").gpu("h200").gpus(8, 2).batch(1, 64).checkpointing();
  const Plan p = make_plan(req);
  REQUIRE(p.has_recommendation);
  CHECK(p.recommended.fits);
  CHECK(p.recommended.tp * p.recommended.pp * p.recommended.dp == 16);
  CHECK_FALSE(p.pp_rows.empty());
  for (const auto& r : p.pp_rows) {
    CHECK(r.pp_link == "network");  // pp outermost: a stage boundary crosses the nodes
    if (r.fits && r.tp_link != "cross-node") CHECK(p.recommended.step_s <= r.step_s);
  }
  CHECK_THAT(p.recommendation, Contains("recommended: tp"));
  WARN(render_plan(p));
  // On 4 nodes of A100 (half the network per GPU) at T 4096 the dp
  // collectives cost more than a pipeline's bubble: pp across the nodes,
  // tp inside NVLink, and the line says so.
  auto r = test::run_trainrun("plan --model llama3.1-70b:T=4096 --gpu a100 --nodes 4 --activation-checkpointing blocks "
                              "--global-batch 256");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("recommended: tp2 x pp4 x dp4 full_shard (1f1b): fits in 80.0 GiB") &&
                        Contains("pp4 stages over the network across nodes (bubble 4.7%") &&
                        Contains("tp2 inside an NVLink island") && Contains("dp4 full_shard over the rest."));
}

TEST_CASE("planner: plan --config takes the job's pipeline degree and schedule and marks its mesh", "[planner][pp][cli]") {
  test::TempDir dir("planpp");
  test::write_file(dir / "job.yaml", gpt2_124m_job(1, "pipeline_parallel: 2, pipeline_schedule: gpipe"));
  auto r = test::run_trainrun("plan --config " + dir / "job.yaml");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("schedule gpipe;") && Contains("(* the job's parallel.pipeline_parallel)"));
  // The job's mesh: tp1 x pp2 x dp4, 16 microbatches, gpipe's first stage holds all 16.
  const auto at = r.out.find("\ntp1 x pp2 x dp4 ");
  REQUIRE(at != std::string::npos);
  const std::string line = r.out.substr(at + 1, r.out.find('\n', at + 1) - at - 1);
  CHECK_THAT(line, Contains(" * ") && Contains("    16 ") && Contains("6.2%"));
  // The flag wins over the job's schedule.
  r = test::run_trainrun("plan --config " + dir / "job.yaml" + " --pp-schedule 1f1b");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("schedule 1f1b;"));
}

// The executor holds one stage network per microbatch in flight, each
// with its kept buffers, and one transient scratch they all share: the
// model must be in_flight x the stage network's kept bytes + its
// transient bytes once, byte for byte on the CPU backend (first stage
// without the head's buffers, last with), with and without checkpointing,
// under zero_bubble (the kept output gradients), and on TP ranks with
// sequence parallelism and with KV heads replicated over TP.
TEST_CASE("planner: a pipeline rank's activations are its microbatch networks' kept arenas and one shared scratch",
          "[planner][pp]") {
  auto be = make_cpu_backend(1);
  const DeviceModel d = DeviceModel::cpu();
  for (std::string shape : {"gpt2:L=4,C=64,heads=4,V=256,T=32", "llama:L=4,C=64,heads=4,kv_heads=2,ffn=128,V=256,T=32",
                            "llama:L=4,C=64,heads=4,kv_heads=1,ffn=96,V=250,T=16",
                            "qwen2:L=4,C=64,heads=4,kv_heads=1,ffn=96,V=250,T=16"}) {
    auto m = make_model_arch(parse_model_shape(shape));
    for (int tp : {1, 2}) {
      const TensorParallelPlan plan(*m, tp, tp - 1);
      for (bool sp : {false, true}) {
        if (sp && tp == 1) continue;
        for (bool ckpt : {false, true}) {
          for (const std::string kind : {"1f1b", "gpipe", "zero_bubble"}) {
            if (ckpt && kind == "zero_bubble") continue;  // refused
            const auto st = estimate_pipeline_memory(*m, tp, sp, 2, kind, 1, 4, Sharding{"no_shard", 1, 1, false}, 2,
                                                     ckpt, d);
            for (int r = 0; r < 2; ++r) {
              TensorParallel ctx;
              ctx.plan = &plan;
              ctx.sequence_parallel = sp;
              PipelineStage ps;
              ps.first_layer = 2 * r, ps.layers = 2, ps.first = r == 0, ps.last = r == 1;
              ps.split_backward = kind == "zero_bubble";
              const size_t own = m->make_network(be.get(), 2, ckpt, tp > 1 ? &ctx : nullptr, &ps)->activation_bytes();
              ps.shared_scratch = true;
              auto net = m->make_network(be.get(), 2, ckpt, tp > 1 ? &ctx : nullptr, &ps);
              INFO(shape << " tp" << tp << " sp=" << sp << " ckpt=" << ckpt << " " << kind << " rank " << r);
              // Replicated KV heads: their gradient scratch is outside a network's own
              // arena (the planner's workspace at pp1), in the shared scratch here.
              const TpLocalShape& sh = plan.shape();
              const size_t C = size_t(m->config().C), HS = C / size_t(m->config().NH);
              const size_t QKV = size_t(sh.NH + 2 * sh.NKV) * HS, NKV = size_t(m->config().kv_heads());
              // (qwen2: the q|k|v bias gradients ride after the weights', one more column each.)
              const size_t Cb = C + (m->config().qkv_bias ? 1 : 0);
              const size_t kv = tp > 1 && sh.kv_replicas > 1 ? QKV * Cb * 4 + NKV * 2 * sh.NKV * HS * Cb * 4 : 0;
              // (Llama has no position table since issue 29: no stage-dependent buffer.)
              CHECK(net->activation_bytes() + net->transient_bytes() == own + kv);
              CHECK(st[size_t(r)].kept_activations == double(net->activation_bytes()));
              CHECK(st[size_t(r)].transient_activations == double(net->transient_bytes()));
              CHECK(st[size_t(r)].mem.activations ==
                    double(st[size_t(r)].in_flight) * net->activation_bytes() + net->transient_bytes());
            }
          }
        }
      }
    }
  }
}
