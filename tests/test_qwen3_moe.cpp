// Qwen3-MoE (core/model/qwen3_moe/: Qwen3's attention, heads head_dim wide
// with qk-norm, and a mixture of experts without a shared expert in every
// block) against transformers 4.51.3's Qwen3MoeForCausalLM
// (scripts/reference/hf_qwen3_moe.py in .venv-hf-next; skipped where that
// venv is absent), in fp32 on tiny random models whose every parameter is
// perturbed:
//  - logits, the loss with the load-balancing loss and every gradient
//    (the router's, q_norm/k_norm's), without renormalisation
//    (norm_topk_prob false, Qwen3MoeConfig's default) and with it;
//  - model.init_from (arch auto) bit for bit, greedy `generate` against
//    transformers', export then from_pretrained with our logits;
//  - 1 rank equals dp2 (full_shard) and tp2 over 4 steps from that directory;
//  - config.json maths trainrun does not implement is refused by name;
//  - the qwen3-30b-a3b preset: 30.5B parameters, 3.3B active.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/config/job_spec.h"
#include "core/config/model_presets.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/model/model_spec.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/mesh_runs.h"
#include "tests/support/moe_hf.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

const char* kScript = "hf_qwen3_moe.py";

// Where .venv-hf-next cannot import Qwen3MoeForCausalLM the transformers
// cases skip (CTest: SKIP_REGULAR_EXPRESSION in CMakeLists.txt), naming it.
bool have_next() {
  static const bool ok = [] {
    const std::string py = test::source_dir() + "/.venv-hf-next/bin/python";
    return test::file_exists(py) &&
           test::run_command("'" + py + "' -c 'from transformers import Qwen3MoeForCausalLM'").exit_code == 0;
  }();
  return ok;
}
#define QWEN3_MOE_HF_OR_SKIP()                                                                                   \
  if (!have_next()) {                                                                                            \
    WARN("SKIPPED: no transformers with Qwen3: " << test::source_dir()                                           \
                                                 << "/.venv-hf-next cannot import Qwen3MoeForCausalLM; run "      \
                                                    "scripts/install-deps.sh --test (transformers 4.51.3)");      \
    return;                                                                                                      \
  }

// Qwen3-MoE's tiny model: 6 experts of 16, top-3, heads 12 wide (not C/NH = 8).
struct Shape : test::MoeShape {
  Shape() { arch = "qwen3_moe", HD = 12, E = 6, K = 3, seed = 7; }
};
ModelConfig cfg_of(const Shape& s) { return test::moe_config(s); }
void hf_random(const std::string& dir, const Shape& s, const std::string& batch = "", const std::string& out_ref = "") {
  test::hf_moe_random(dir, s, batch, out_ref);
}

}  // namespace

TEST_CASE("qwen3_moe: logits, loss with the load-balancing loss and every gradient match transformers' "
          "Qwen3MoeForCausalLM", "[qwen3_moe][hf]") {
  QWEN3_MOE_HF_OR_SKIP();
  Shape a;  // norm_topk_prob false (Qwen3MoeConfig's default), untied, heads 12 wide (not C/NH = 8)
  Shape b;  // renormalised (the published configs), tied, 4 experts top-2, heads C/NH wide
  b.E = 4, b.K = 2, b.HD = 8, b.norm = true, b.tied = true, b.aux = 0.05;
  for (const Shape& s : {a, b}) {
    const auto arch = make_model_arch(cfg_of(s));
    INFO(arch->describe());
    std::printf("%s\n", arch->describe().c_str());
    REQUIRE(arch->config().qk_norm);
    REQUIRE(!arch->config().qkv_bias);
    const int B = 2, T = s.T, V = s.V;
    test::TempDir dir("qwen3_moe_hf");
    const std::vector<int32_t> in = test::random_tokens(size_t(B) * T, V, 11),
                               tg = test::random_tokens(size_t(B) * T, V, 12);
    test::write_token_batch(dir / "batch.safetensors", in, tg, B, T);
    hf_random(dir / "model", s, dir / "batch.safetensors", dir / "ref.safetensors");
    const test::NetworkRun ours = test::run_network(*arch, test::flat_from_hf(*arch, dir / "model"), in, tg, B, T);
    const std::string rpath = dir / "ref.safetensors";
    const SafeTensorFile ref = read_safetensors(rpath);
    const double logit_err = test::rel_err(ours.logits, test::tensor_f32(ref, "logits", rpath));
    const double hf_loss = test::tensor_f32(ref, "loss", rpath)[0], hf_aux = test::tensor_f32(ref, "aux_term", rpath)[0];
    std::printf("  logits rel err %.3e, loss %.7f (HF %.7f, of which aux_coef * aux %.7f) rel err %.3e\n", logit_err,
                ours.loss, hf_loss, hf_aux, std::abs(ours.loss - hf_loss) / hf_loss);
    CHECK(logit_err <= 1e-5);
    CHECK(std::abs(ours.loss - hf_loss) / hf_loss <= 1e-5);
    CHECK(hf_aux > 1e-3 * hf_loss);  // the aux term is large enough that leaving it out would fail the loss check
    double worst = 0;
    std::string worst_name;
    int checked = 0;
    for (const auto& t : arch->layout().tensors) {
      const std::vector<float> want = test::tensor_f32(ref, "grad." + arch->hf_tensor(t).name, rpath);
      REQUIRE(int64_t(want.size()) == t.numel);
      const std::vector<float> got(ours.grads.begin() + t.offset, ours.grads.begin() + t.offset + t.numel);
      const double e = test::rel_err(got, want);
      if (!(e <= worst)) worst = e, worst_name = t.name;
      INFO(t.name);
      CHECK(e <= 1e-5);
      for (const char* part : {"mlp.gate.", "q_norm.", "k_norm."})
        if (t.name.find(part) != std::string::npos) {
          ++checked;
          std::printf("  %-48s rel err %.3e\n", t.name.c_str(), e);
          double n2 = 0;
          for (float x : want) n2 += double(x) * x;
          CHECK(n2 > 0);
        }
    }
    CHECK(checked == 3 * s.L);
    std::printf("  worst gradient rel err %.3e (%s) over %zu tensors\n", worst, worst_name.c_str(),
                arch->layout().tensors.size());
  }
}

namespace {

Shape init_shape() {
  Shape s;
  s.L = 2, s.NH = 4, s.NKV = 2, s.HD = 8, s.C = 16, s.F = 24, s.E = 4, s.K = 2, s.FE = 12, s.V = 29, s.T = 12;
  s.norm = true;
  return s;
}
std::string job_yaml(const std::string& hf, const std::string& out, const std::string& arch, int steps,
                     const std::string& parallel, const std::string& lr = "3.0e-3") {
  return "model: {arch: " + arch + ", init_from: '" + hf + "', seq_len: 12}\n"
         "data: {format: synthetic, synthetic: {vocab: 29, branching: 3}}\n"
         "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: " + std::to_string(steps) +
         ", lr: " + lr + ", min_lr: 0,\n"
         "        warmup_steps: 0, schedule: constant, grad_clip: 0.3, eval_steps: 1, log_interval: 1}\n"
         "output: {dir: '" + out + "', sample_tokens: 0}\n"
         "parallel: {" + parallel + "timeout_s: 60}\n";
}

}  // namespace

TEST_CASE("qwen3_moe: init_from (arch auto) bit for bit, greedy generate, export, dp2 and tp2 train as one rank",
          "[qwen3_moe][hf][init_from]") {
  QWEN3_MOE_HF_OR_SKIP();
  test::TempDir dir("qwen3_moe_init");
  const std::string hf = dir / "hf";
  hf_random(hf, init_shape());
  const std::string run = dir / "run";
  JobSpec job = parse_job_spec(job_yaml(hf, run, "auto", 1, "sharding: full_shard, ", "1.0e-30"), "job.yaml", {});
  resolve_model_shape(job, false);
  const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
  REQUIRE(arch->name() == "qwen3_moe");
  CHECK(arch->config().moe.ffn == 12);
  CHECK(arch->config().moe.shared_ffn == 0);
  CHECK(arch->config().moe.norm_topk_prob);
  CHECK(arch->config().head_size() == 8);
  const std::vector<float> want = test::flat_from_hf(*arch, hf);
  const std::vector<float> loaded = load_init_from(job.model);
  REQUIRE(loaded.size() == want.size());
  CHECK(std::memcmp(loaded.data(), want.data(), want.size() * 4) == 0);
  (void)test::run_ranks_inprocess(job, 2);
  std::vector<float> trained;
  CHECK(load_model_safetensors(run + "/model.safetensors", trained).arch == "qwen3_moe");
  REQUIRE(trained.size() == want.size());
  CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

  // (A prompt whose continuation varies: "5 17 2 28 0" continues with 0s here.)
  test::check_cli_generate_equals_hf(kScript, hf, run, "3 9 21 14 7", 7);

  const nlohmann::json c = test::check_cli_export_equals_hf(kScript, *arch, trained, run, dir / "export", 29, dir);
  CHECK(c["model_type"] == "qwen3_moe");
  CHECK(c["architectures"][0] == "Qwen3MoeForCausalLM");
  CHECK(c["moe_intermediate_size"] == 12);
  CHECK(c["head_dim"] == 8);
  CHECK(c["norm_topk_prob"] == true);
  CHECK(!c.contains("shared_expert_intermediate_size"));

  // Training from that directory: dp2 (full_shard) and tp2 (KV heads split) follow the one-rank run.
  const test::MeshRun ref = test::train_mesh(job_yaml(hf, dir / "one", "qwen3_moe", 4, "sharding: no_shard, "), 1);
  REQUIRE(ref.losses.size() == 4);
  CHECK(test::rel_err(ref.weights, want) > 1e-4);
  test::check_same_run("dp2", test::train_mesh(job_yaml(hf, dir / "dp2", "qwen3_moe", 4, "sharding: full_shard, "), 2),
                       ref);
  test::check_same_run("tp2",
                       test::train_mesh(job_yaml(hf, dir / "tp2", "qwen3_moe", 4, "tensor_parallel: 2, "), 2), ref);
}

TEST_CASE("qwen3_moe: config.json maths trainrun does not implement is refused by name, the qwen3-30b-a3b preset",
          "[qwen3_moe][hf]") {
  test::TempDir dir("qwen3_moe_refuse");
  auto write = [&](const std::string& name, const nlohmann::json& extra) {
    nlohmann::json c = {{"model_type", "qwen3_moe"}, {"num_hidden_layers", 2}, {"hidden_size", 16},
                        {"num_attention_heads", 4}, {"num_key_value_heads", 1}, {"intermediate_size", 24},
                        {"vocab_size", 29}, {"max_position_embeddings", 64}};
    for (auto it = extra.begin(); it != extra.end(); ++it) c[it.key()] = it.value();
    std::filesystem::create_directories(dir / name);
    std::ofstream(dir / name + "/config.json") << c.dump();
    return std::string(dir / name);
  };
  auto error = [&](const std::string& d) {
    try {
      (void)read_hf_model_config(d, "model.init_from");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const ModelConfig ok = read_hf_model_config(write("ok", nlohmann::json::object()), "x");
  CHECK(ok.arch == "qwen3_moe");  // Qwen3MoeConfig's defaults: 128 experts of 768, top-8, not renormalised
  CHECK(ok.moe.n_experts == 128);
  CHECK(ok.moe.top_k == 8);
  CHECK(ok.moe.ffn == 768);
  CHECK(ok.moe.shared_ffn == 0);
  CHECK(!ok.moe.norm_topk_prob);
  CHECK(ok.qk_norm);
  CHECK(ok.head_size() == 4);  // no head_dim key: hidden_size / heads (Qwen3MoeAttention), not Qwen3Config's 128
  CHECK_THAT(error(write("step", {{"decoder_sparse_step", 2}})),
             Contains("decoder_sparse_step = 2") && Contains("Qwen3-MoE"));
  CHECK_THAT(error(write("dense", {{"mlp_only_layers", {1}}})), Contains("mlp_only_layers = [1]"));
  CHECK(error(write("beyond", {{"mlp_only_layers", {5}}})).empty());  // no such layer: nothing dense
  CHECK_THAT(error(write("none", {{"num_experts", 0}})), Contains("num_experts = 0"));
  CHECK_THAT(error(write("topk", {{"num_experts", 4}, {"num_experts_per_tok", 5}})),
             Contains("num_experts_per_tok (5)") && Contains("num_experts (4)"));
  CHECK_THAT(error(write("bias", {{"attention_bias", true}})), Contains("attention_bias = true"));
  CHECK_THAT(error(write("window", {{"use_sliding_window", true}, {"sliding_window", 8}, {"max_window_layers", 0}})),
             Contains("use_sliding_window = true"));
  // A job spec asking for a shared expert on qwen3_moe names the key.
  ModelConfig shared = ok;
  shared.moe.shared_ffn = 32;
  try {
    (void)make_model_arch(shared);
    FAIL("a shared expert was accepted");
  } catch (const std::exception& e) {
    CHECK_THAT(std::string(e.what()), Contains("model.shared_expert_ffn_dim: 32") && Contains("qwen2_moe"));
  }

  const ModelPreset* preset = find_model_preset("qwen3-30b-a3b");
  REQUIRE(preset);
  const auto arch = make_model_arch(ModelConfig::from_spec(preset->spec));
  CHECK(arch->name() == "qwen3_moe");
  CHECK(arch->config().moe.norm_topk_prob);
  CHECK(arch->config().head_size() == 128);
  // The model card: 30.5B in total, 3.3B activated. Active: 8 of 128 experts per token, the attention, the
  // router, the LM head (matmul_parameters: MFU's N) and the input embedding.
  const int64_t total = arch->num_parameters(), active = arch->matmul_parameters() + 151936LL * 2048;
  std::printf("qwen3-30b-a3b: %lld parameters, %lld active with the embeddings\n", (long long)total,
              (long long)active);
  CHECK(std::llabs(total - 30500000000LL) < 50000000LL);
  CHECK(std::llabs(active - 3300000000LL) < 60000000LL);
}
