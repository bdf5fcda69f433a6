// Gemma 2 as a user runs it (core/model/gemma2/), CPU backend: the job spec
// (model.attn_softcap, final_softcap, query_scale, sliding_window) and its
// refusals by name, the presets and `trainrun plan`, the Hugging Face side
// through the CLI (export -> transformers' from_pretrained, model.init_from
// with model.arch auto, `trainrun generate` against transformers' greedy
// generate, transformers 4.44.2 eager through scripts/reference/hf_gemma2.py),
// and the meshes: dp2 full_shard, tp2 (the vocab-parallel cross-entropy
// through the final cap), tp2 + sequence parallelism and pp2 train as one
// rank does, with caps that bite.
// The network's maths against transformers (logits, loss, every gradient),
// the ops and the decoder: tests/test_gemma2.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/config/job_spec.h"
#include "core/config/model_presets.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/model/model_shape.h"
#include "core/model/model_spec.h"
#include "core/model/tensor_parallel.h"
#include "core/train/planner.h"
#include "kernels/backend_factory.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/mesh_runs.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using ref::Vec;
using Tokens = std::vector<int32_t>;
using json = nlohmann::ordered_json;

namespace {

Tokens rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  Tokens t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  return json::parse(f);
}

// The tiny Gemma 2 of these cases: heads 16 wide on n_embd 32, GQA 2:1,
// caps small enough to bite, the window = seq_len (the ops have no window yet).
ModelConfig tiny() {
  ModelConfig c;
  c.arch = "gemma2";
  c.L = 2, c.C = 32, c.NH = 4, c.NKV = 2, c.head_dim = 16, c.F = 48, c.V = 96, c.T = 16;
  c.norm_eps = 1e-6;
  c.attn_softcap = 1.5f;
  c.final_softcap = 3.f;
  c.query_scale = 12;
  c.sliding_window = 16;
  return c;
}

// Training through the job spec at a mesh (tests/support/mesh_runs).
test::MeshRun run_mesh(const std::string& model, int world, int tp, int pp, const std::string& strategy,
                       bool sp = false) {
  test::TempDir dir("gemma2_mesh");
  return test::train_mesh(test::small_mesh_job(model, dir.path(), tp, pp, strategy, sp), world);
}

}  // namespace

TEST_CASE("gemma2: init_from (arch auto), `trainrun export` -> from_pretrained and `trainrun generate` agree with "
          "transformers",
          "[gemma2][hf]") {
  const ModelConfig shape = tiny();
  test::TempDir dir("gemma2_io");
  const std::string model = dir / "model";
  std::ostringstream a;
  a << "random --out '" << model << "' --layers " << shape.L << " --hidden " << shape.C << " --heads " << shape.NH
    << " --kv-heads " << shape.NKV << " --head-dim " << shape.head_dim << " --intermediate " << shape.F << " --vocab "
    << shape.V << " --max-positions " << shape.T << " --attn-softcap " << shape.attn_softcap << " --final-softcap "
    << shape.final_softcap << " --query-scalar " << shape.query_scale << " --window " << shape.sliding_window;
  const test::RunResult r = test::run_reference_script("hf_gemma2.py", a.str());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);

  // transformers' directory as trainrun reads it: every Gemma 2 value comes through.
  std::vector<float> want;
  const ModelConfig cfg = load_hf(model, want, "test");
  const auto arch = make_model_arch(cfg);
  CHECK(arch->name() == "gemma2");
  CHECK(arch->config().head_size() == 16);
  CHECK(cfg.attn_softcap == shape.attn_softcap);
  CHECK(cfg.final_softcap == shape.final_softcap);
  CHECK(cfg.query_scale == shape.query_scale);
  CHECK(cfg.sliding_window == shape.sliding_window);

  // model.init_from (model.arch auto from model_type), 2 ranks full_shard, lr 1e-30: the weights stay bit for bit.
  const std::string run = dir / "run";
  const std::string yaml =
      "model: {init_from: '" + model + "'}\n"
      "data: {format: synthetic, synthetic: {vocab: 96, branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 1, lr: 1.0e-30, min_lr: 0, warmup_steps: 0,\n"
      "        schedule: constant, weight_decay: 0, grad_clip: 0, eval_steps: 1, log_interval: 1}\n"
      "output: {dir: '" + run + "', sample_tokens: 0}\n"
      "parallel: {sharding: full_shard, timeout_s: 60}\n";
  const JobSpec job = parse_job_spec(yaml, "job.yaml", {});
  JobSpec resolved = job;
  resolve_model_shape(resolved, false);
  CHECK(resolved.model.arch == "gemma2");
  CHECK(resolved.model.attn_softcap == 1.5);
  CHECK(resolved.model.final_softcap == 3.0);
  CHECK(resolved.model.query_scale == 12.0);
  CHECK(resolved.model.sliding_window == 16);
  CHECK(resolved.model.seq_len == 16);  // max_position_embeddings
  (void)test::run_ranks_inprocess(job, 2);
  std::vector<float> trained;
  const ModelConfig back = load_model_safetensors(run + "/model.safetensors", trained);
  CHECK(back.arch == "gemma2");  // our metadata carries Gemma 2's values
  CHECK(back.attn_softcap == shape.attn_softcap);
  CHECK(back.final_softcap == shape.final_softcap);
  CHECK(back.query_scale == shape.query_scale);
  CHECK(back.sliding_window == shape.sliding_window);
  REQUIRE(trained.size() == want.size());
  CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

  // `trainrun export` of the run: config.json as Gemma2Config has it, and from_pretrained gives our logits.
  const std::string out = dir / "export";
  const test::RunResult ex = test::run_trainrun("export --checkpoint '" + run + "' --out '" + out + "'");
  INFO(ex.err);
  REQUIRE(ex.exit_code == 0);
  const json c = read_json(out + "/config.json");
  CHECK(c["model_type"] == "gemma2");
  CHECK(c["architectures"][0] == "Gemma2ForCausalLM");
  CHECK(c["attn_logit_softcapping"] == 1.5);
  CHECK(c["final_logit_softcapping"] == 3.0);
  CHECK(c["query_pre_attn_scalar"] == 12.0);
  CHECK(c["sliding_window"] == 16);
  CHECK(c["hidden_activation"] == "gelu_pytorch_tanh");
  CHECK(c["head_dim"] == 16);
  const Tokens in = rand_tokens(size_t(2) * shape.T, shape.V, 5);
  const std::vector<float> ours = test::logits_of(*arch, want, in, 2, shape.T);
  SafeTensorFile batch;
  batch.tensors.push_back(make_tensor("inputs", "I32", {2, shape.T}, in.data()));
  write_safetensors(dir / "lbatch.safetensors", batch);
  // (transformers' greedy generate on the source directory in the same python start.)
  const std::string prompt = "5 17 2 28 0";
  const int steps = shape.T - 5;
  const test::RunResult lr = test::run_reference_script(
      "hf_gemma2.py", "logits --model '" + out + "' --batch '" + (dir / "lbatch.safetensors") + "' --out '" +
                          (dir / "logits.safetensors") + "' --prompt '" + prompt + "' --generate-model '" + model +
                          "' --max-new-tokens " + std::to_string(steps));
  INFO(lr.err);
  REQUIRE(lr.exit_code == 0);
  const std::vector<float> theirs = read_safetensors(dir / "logits.safetensors").find("logits")->as_f32();
  const double e = ref::rel_err(Vec(ours.begin(), ours.end()), Vec(theirs.begin(), theirs.end()));
  double absmax = 0;
  for (float x : ours) absmax = std::max(absmax, double(std::abs(x)));
  std::printf("  export -> from_pretrained logits rel err %.3e (max |logit| %.3f, cap %.1f)\n", e, absmax,
              double(shape.final_softcap));
  CHECK(e <= 1e-5);
  CHECK(absmax > 0.5 * shape.final_softcap);  // the weights are large enough for the cap to matter

  const test::RunResult gen = test::run_trainrun("generate --checkpoint '" + run + "/model.safetensors' --prompt '" +
                                                 prompt + "' --max-tokens " + std::to_string(steps) + " --top-k 1");
  INFO(gen.err);
  REQUIRE(gen.exit_code == 0);
  std::printf("  generate: ours '%s' transformers '%s'\n", gen.out.c_str(), lr.out.c_str());
  CHECK(gen.out == lr.out);
}

TEST_CASE("gemma2: the job spec describes Gemma 2, what is inconsistent is refused by name", "[gemma2][config]") {
  auto spec = [](const std::string& model) {
    return parse_job_spec("model: " + model + "\ndata: {format: synthetic}\n", "job.yaml", {});
  };
  const std::string tiny_spec = "{arch: gemma2, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 32, head_dim: 16, "
                                "ffn_dim: 48, vocab_size: 96, seq_len: 16, norm_eps: 1.0e-6, "
                                "attn_softcap: 1.5, final_softcap: 3, query_scale: 12, sliding_window: 16";
  const JobSpec job = spec(tiny_spec + ", tie_embeddings: true}");
  const ModelConfig c = ModelConfig::from_spec(job.model);
  CHECK(c.arch == "gemma2");
  CHECK(c.attn_softcap == 1.5f);
  CHECK(c.final_softcap == 3.f);
  CHECK(c.query_scale == 12);
  CHECK(c.sliding_window == 16);
  const auto arch = make_model_arch(c);
  CHECK(arch->config().post_norms);  // the arch's maths, not fields
  CHECK(arch->config().window_period == 2);
  const ModelSpec back = arch->config().to_spec();
  CHECK(back.attn_softcap == 1.5);
  CHECK(back.final_softcap == 3);
  CHECK(back.query_scale == 12);
  CHECK(back.sliding_window == 16);
  // job.resolved.yaml carries them: it parses back to the same model.
  const JobSpec again = parse_job_spec(job_spec_to_yaml(job), "job.resolved.yaml", {});
  CHECK(again.model.attn_softcap == 1.5);
  CHECK(again.model.sliding_window == 16);

  // Values the other families do not have: refused, naming the key and the arch.
  CHECK_THROWS_WITH(ModelConfig::from_spec(spec("{arch: llama, ffn_dim: 8, attn_softcap: 50}").model),
                    Contains("model.attn_softcap: 50; llama has no attn_softcap") && Contains("model.arch: gemma2"));
  CHECK_THROWS_WITH(ModelConfig::from_spec(spec("{arch: qwen3, ffn_dim: 8, head_dim: 8, final_softcap: 30}").model),
                    Contains("model.final_softcap: 30; qwen3 has no final_softcap"));
  CHECK_THROWS_WITH(ModelConfig::from_spec(spec("{arch: llama, ffn_dim: 8, query_scale: 144}").model),
                    Contains("model.query_scale: 144; llama has no query_scale"));
  CHECK_THROWS_WITH(ModelConfig::from_spec(spec("{arch: gpt2, sliding_window: 64}").model),
                    Contains("model.sliding_window: 64; gpt2 has no sliding window"));
  CHECK_THROWS_WITH(ModelConfig::from_spec(spec("{arch: llama, ffn_dim: 8, sliding_window: 64}").model),
                    Contains("model.sliding_window: 64; llama has no sliding window"));
  CHECK_THROWS_WITH(spec("{arch: gemma2, final_softcap: -1}"), Contains("model.final_softcap"));
  CHECK_THROWS_WITH(make_model_arch(ModelConfig::from_spec(spec(tiny_spec + ", tie_embeddings: false}").model)),
                    Contains("model.tie_embeddings: false; Gemma 2's LM head is always the token embedding"));

  // model.init_from: a set value that is not the directory's is an error naming both.
  test::TempDir dir("gemma2_spec");
  std::ofstream(dir / "config.json") << arch->hf_config_json().dump();
  auto resolve = [&](const std::string& extra) {
    JobSpec j = spec("{init_from: '" + dir.path() + "'" + extra + "}");
    resolve_model_shape(j, false);
    return j;
  };
  const JobSpec from_dir = resolve("");
  CHECK(from_dir.model.arch == "gemma2");
  CHECK(from_dir.model.attn_softcap == 1.5);
  CHECK(from_dir.model.query_scale == 12);
  CHECK(from_dir.model.sliding_window == 16);
  CHECK_THROWS_WITH(resolve(", attn_softcap: 2"),
                    Contains("has attn_logit_softcapping = 1.5 but model.attn_softcap is 2"));
  CHECK_THROWS_WITH(resolve(", sliding_window: 8"), Contains("has sliding_window = 16 but model.sliding_window is 8"));
  // config.json values out of range: the file and the key are named.
  for (const auto& [key, value] : {std::pair<const char*, json>{"attn_logit_softcapping", -1.0},
                                   std::pair<const char*, json>{"query_pre_attn_scalar", 0},
                                   std::pair<const char*, json>{"sliding_window", 3.5},
                                   std::pair<const char*, json>{"final_logit_softcapping", "30"}}) {
    test::TempDir bad("gemma2_badcfg");
    json cj = arch->hf_config_json();
    cj[key] = value;
    std::ofstream(bad / "config.json") << cj.dump();
    INFO(key);
    CHECK_THROWS_WITH(read_hf_model_config(bad.path(), "model.init_from"),
                      Contains(bad.path() + "/config.json': " + key));
  }
  // The load's own check (hf_interop: the job's arch against config.json's), naming the key.
  ModelConfig other = c;
  other.final_softcap = 30.f;
  CHECK_THROWS_WITH(make_model_arch(other)->check_init_from(c, dir.path()),
                    Contains("final_logit_softcapping = 3 (config.json) but model.final_softcap is 30"));
  other = c;
  other.query_scale = 0;  // = head_dim 16, not 12
  CHECK_THROWS_WITH(make_model_arch(other)->check_init_from(c, dir.path()),
                    Contains("query_pre_attn_scalar = 12 (config.json) but model.query_scale is 16"));

  // Our files: the metadata reads back; a missing key is named; the manifest compares them.
  const std::map<std::string, std::string> meta = arch->file_metadata();
  const ModelConfig m = config_from_file_metadata(meta, "m.safetensors");
  CHECK(m.arch == "gemma2");
  CHECK(m.final_softcap == 3.f);
  CHECK(m.query_scale == 12);
  std::map<std::string, std::string> cut = meta;
  cut.erase("final_softcap");
  CHECK_THROWS_WITH(config_from_file_metadata(cut, "m.safetensors"),
                    Contains("m.safetensors: missing __metadata__ key 'final_softcap'"));
  other = c;
  other.attn_softcap = 50.f;
  CHECK_THAT(manifest_model_mismatch(*make_model_arch(other), arch->manifest_model()),
             Contains("model.attn_softcap = 1.5 but this job has 50"));
}

TEST_CASE("gemma2: the presets are the published models and plan", "[gemma2][plan]") {
  struct P { const char* name; int64_t params; int L, head_dim; double query_scale; };
  // The parameter counts of google/gemma-2-{2b,9b,27b} (model.safetensors'
  // totals: 2.61B, 9.24B, 27.2B); 27B's query_pre_attn_scalar is 144 = n_embd / n_head, not its head_dim 128.
  for (const P p : {P{"gemma2-2b", 2614341888, 26, 256, 256}, P{"gemma2-9b", 9241705984, 42, 256, 256},
                    P{"gemma2-27b", 27227128320, 46, 128, 144}}) {
    INFO(p.name);
    const ModelPreset* preset = find_model_preset(p.name);
    REQUIRE(preset);
    const auto arch = make_model_arch(ModelConfig::from_spec(preset->spec));
    const ModelConfig& c = arch->config();
    CHECK(arch->name() == "gemma2");
    CHECK(arch->num_parameters() == p.params);
    CHECK(c.L == p.L);
    CHECK(c.head_size() == p.head_dim);
    CHECK(c.query_scale == p.query_scale);
    CHECK(c.attn_softcap == 50.f);
    CHECK(c.final_softcap == 30.f);
    CHECK(c.sliding_window == 4096);
    CHECK(c.T == 4096);  // the window: longer sequences wait for the windowed attention ops
    CHECK(c.tied);
    const test::RunResult r = test::run_trainrun(std::string("plan --model ") + p.name + " --gpus 8");
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("gemma2 L=" + std::to_string(p.L)));
  }
  // A job spec with the preset: every Gemma 2 value filled; an explicit one wins.
  JobSpec job = parse_job_spec("model: {preset: gemma2-9b, final_softcap: 0}\ndata: {format: synthetic}\n", "job.yaml",
                               {});
  resolve_model_shape(job, false);
  CHECK(job.model.arch == "gemma2");
  CHECK(job.model.attn_softcap == 50);
  CHECK(job.model.final_softcap == 0);
  CHECK(job.model.query_scale == 256);
  CHECK(job.model.sliding_window == 4096);
  CHECK(job.model.seq_len == 4096);
}

TEST_CASE("gemma2: the TP planner's activation model is each TP rank's arena (post norms, GeGLU)",
          "[gemma2][planner][tp]") {
  auto be = make_cpu_backend(1);
  const auto arch = make_model_arch(tiny());
  for (int tp : {2, 4})
    for (bool sp : {false, true})
      for (bool ckpt : {false, true}) {
        const int B = 2;
        const TensorParallelPlan plan(*arch, tp, 1);
        TensorParallel ctx;
        ctx.plan = &plan;
        ctx.sequence_parallel = sp;
        const auto net = arch->make_network(be.get(), B, ckpt, &ctx);
        INFO("tp" << tp << " sp=" << sp << " ckpt=" << ckpt);
        CHECK(estimate_tp_activation_bytes(*arch, tp, sp, B, ckpt, DeviceModel::cpu()) ==
              double(net->activation_bytes()));
      }
}

TEST_CASE("gemma2: dp2 full_shard, tp2 (vocab-parallel cross-entropy through the final cap), tp2+sp and pp2 train as "
          "one rank does",
          "[gemma2][tp][pp][sharding]") {
  // vocab 23: tp2 splits it 12 | 11 (a padded shard). init_std 0.5 makes the
  // scores and logits large enough that both caps bite (checked below).
  auto model = [](const std::string& caps) {
    return "{arch: gemma2, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, head_dim: 8, ffn_dim: 24, vocab_size: 23, "
           "seq_len: 8, tie_embeddings: true, init_std: 0.5, query_scale: 6, sliding_window: 8, " + caps + "}";
  };
  const std::string capped = model("attn_softcap: 0.5, final_softcap: 1.0");
  const test::MeshRun one = run_mesh(capped, 1, 1, 1, "no_shard");
  REQUIRE(one.losses.size() == 4);
  std::printf("  one rank: losses %.6f %.6f %.6f %.6f\n", one.losses[0], one.losses[1], one.losses[2], one.losses[3]);
  CHECK(one.losses.back() < one.losses.front());
  {  // The caps bite: without them the same run computes other losses.
    const test::MeshRun uncapped = run_mesh(model("attn_softcap: 0, final_softcap: 0"), 1, 1, 1, "no_shard");
    std::printf("  without the caps: first loss %.6f (capped %.6f)\n", uncapped.losses[0], one.losses[0]);
    CHECK(std::fabs(uncapped.losses[0] - one.losses[0]) > 0.05 * one.losses[0]);
  }
  struct Mesh { const char* what; int world, tp, pp; const char* strategy; bool sp; };
  const Mesh meshes[] = {{"dp2 full_shard", 2, 1, 1, "full_shard", false},
                         {"tp2", 2, 2, 1, "no_shard", false},
                         {"tp2 + sequence parallelism", 2, 2, 1, "no_shard", true},
                         {"pp2", 2, 1, 2, "no_shard", false}};
  for (const Mesh& m : meshes) {
    test::check_same_run(m.what, run_mesh(capped, m.world, m.tp, m.pp, m.strategy, m.sp), one);
  }
}
