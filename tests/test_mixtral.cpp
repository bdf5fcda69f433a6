// Mixtral (core/model/mixtral/: Llama's network with a sparse mixture of
// experts in every block's MLP; core/model/moe/) against transformers
// 4.44.2's MixtralForCausalLM (scripts/reference/hf_mixtral.py), in fp32 on
// tiny random models whose every parameter is perturbed:
//  - logits, the loss with the load-balancing loss (output_router_logits,
//    router_aux_loss_coef) and every parameter gradient, the router's included;
//  - the KV-cached decoder equals the full forward;
//  - a router that sends every token to one expert (the other experts get
//    no rows) computes the dense Llama MLP of that expert, forward and
//    backward, with the load-balancing loss at its maximum E * 1 * 1/E = 1;
//  - the router z-loss's gradient against finite differences;
//  - model.init_from with model.arch auto (bit for bit), greedy `generate`
//    against transformers' greedy generate, and an export that
//    from_pretrained reloads with our logits;
//  - config.json maths trainrun does not implement is refused by name;
//  - the mixtral-8x7b preset and the job spec's MoE fields.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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
#include "core/model/model_spec.h"
#include "kernels/backend.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/mesh_runs.h"
#include "tests/support/moe_hf.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

const char* kScript = "hf_mixtral.py";

using test::flat_from_hf;
using test::random_tokens;
using test::tensor_f32;
std::vector<int32_t> rand_tokens(size_t n, int V, uint64_t seed) { return random_tokens(n, V, seed); }
std::vector<float> f32_of(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  return tensor_f32(f, name, path);
}
std::vector<float> hf_flat(const ModelArch& arch, const std::string& dir) { return flat_from_hf(arch, dir); }

// Mixtral's tiny model: 4 experts (F = 24 wide, as every Mixtral expert), top-2.
struct Shape : test::MoeShape {
  Shape() { arch = "mixtral", F = 24; }
};
ModelConfig mixtral_cfg(const Shape& s) { return test::moe_config(s); }
void hf_random(const std::string& dir, const Shape& s, const std::string& batch = "", const std::string& out_ref = "") {
  test::hf_moe_random(dir, s, batch, out_ref);
}

double rel(const std::vector<float>& a, const std::vector<float>& b) { return test::rel_err(a, b); }

using Pass = test::NetworkRun;
Pass run_pass(const ModelArch& arch, const std::vector<float>& params, const std::vector<int32_t>& in,
              const std::vector<int32_t>& tg, int B, int T, bool ckpt = false) {
  return test::run_network(arch, params, in, tg, B, T, ckpt);
}

}  // namespace

TEST_CASE("mixtral: logits, loss with the load-balancing loss and every gradient match transformers' "
          "MixtralForCausalLM", "[mixtral][hf]") {
  Shape a;                     // 4 experts, top-2, untied
  Shape b;                     // 3 experts, top-1 (the renormalised weight is 1: the router learns only from aux), tied
  b.E = 3, b.K = 1, b.tied = true, b.NKV = 4, b.aux = 0.05;
  for (const Shape& s : {a, b}) {
    const ModelConfig cfg = mixtral_cfg(s);
    const auto arch = make_model_arch(cfg);
    INFO(arch->describe());
    std::printf("%s\n", arch->describe().c_str());
    const int B = 2, T = s.T, V = s.V;
    test::TempDir dir("mixtral_hf");
    const std::vector<int32_t> in = rand_tokens(size_t(B) * T, V, 11), tg = rand_tokens(size_t(B) * T, V, 12);
    test::write_token_batch(dir / "batch.safetensors", in, tg, B, T);
    hf_random(dir / "model", s, dir / "batch.safetensors", dir / "ref.safetensors");
    const std::vector<float> params = hf_flat(*arch, dir / "model");
    const Pass ours = run_pass(*arch, params, in, tg, B, T);

    const std::string rpath = dir / "ref.safetensors";
    const SafeTensorFile ref = read_safetensors(rpath);
    const double logit_err = rel(ours.logits, f32_of(ref, "logits", rpath));
    const double hf_loss = f32_of(ref, "loss", rpath)[0], hf_aux = f32_of(ref, "aux_term", rpath)[0];
    std::printf("  logits rel err %.3e, loss %.7f (HF %.7f, of which aux_coef * aux %.7f) rel err %.3e\n", logit_err,
                ours.loss, hf_loss, hf_aux, std::abs(ours.loss - hf_loss) / hf_loss);
    CHECK(logit_err <= 1e-5);
    CHECK(std::abs(ours.loss - hf_loss) / hf_loss <= 1e-5);
    CHECK(hf_aux > 1e-3 * hf_loss);  // the aux term is in the comparison, not lost under the tolerance
    double worst = 0;
    int routers = 0;
    for (const auto& t : arch->layout().tensors) {
      const std::vector<float> want = f32_of(ref, "grad." + arch->hf_tensor(t).name, rpath);
      REQUIRE(int64_t(want.size()) == t.numel);
      const std::vector<float> got(ours.grads.begin() + t.offset, ours.grads.begin() + t.offset + t.numel);
      const double e = rel(got, want);
      worst = std::max(worst, e);
      INFO(t.name);
      CHECK(e <= 1e-5);
      if (t.name.find("block_sparse_moe.gate.") != std::string::npos) {
        ++routers;
        std::printf("  %-44s rel err %.3e\n", t.name.c_str(), e);
        double n2 = 0;
        for (float x : want) n2 += double(x) * x;
        CHECK(n2 > 0);  // a real check: the router learns (from the weights, or top-1 from aux alone)
      }
    }
    CHECK(routers == s.L);
    std::printf("  worst gradient rel err %.3e over %zu tensors\n", worst, arch->layout().tensors.size());
  }
}

TEST_CASE("mixtral: activation checkpointing gives the same loss and gradients", "[mixtral]") {
  const auto arch = make_model_arch(mixtral_cfg(Shape{}));
  std::vector<float> params(size_t(arch->layout().total));
  arch->init_params(3, 0, arch->layout().total, params.data());
  const int B = 2, T = 9;
  const std::vector<int32_t> in = rand_tokens(size_t(B) * T, 37, 1), tg = rand_tokens(size_t(B) * T, 37, 2);
  const Pass a = run_pass(*arch, params, in, tg, B, T, false), b = run_pass(*arch, params, in, tg, B, T, true);
  CHECK(a.loss == b.loss);  // the recompute routes again but does not count the statistics twice
  CHECK(rel(b.grads, a.grads) == 0.0);
}

TEST_CASE("mixtral: the KV-cached decoder's logits equal the full forward's", "[mixtral][decoder]") {
  const auto arch = make_model_arch(mixtral_cfg(Shape{}));
  const ParamLayout& lay = arch->layout();
  std::vector<float> params(size_t(lay.total));
  arch->init_params(3, 0, lay.total, params.data());
  // A router at the scale of its inputs: tokens spread over the experts.
  std::mt19937_64 gen(8);
  std::normal_distribution<float> d(0.f, 1.0f);
  for (const auto& t : lay.tensors)
    if (t.name.find("block_sparse_moe.gate.") != std::string::npos)
      for (int64_t i = 0; i < t.numel; ++i) params[size_t(t.offset + i)] = d(gen);
  const int T = arch->config().T, V = arch->config().V;
  const std::vector<int32_t> seq = rand_tokens(size_t(T), V, 4);
  const std::vector<float> full = test::logits_of(*arch, params, seq, 1, T);
  auto be = make_cpu_backend(2);
  auto dec = arch->make_decoder(be.get(), T);
  DeviceBuffer p = test::upload_act(be.get(), params);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  std::vector<float> got;
  const int prefill = 3;
  dec->feed(units, seq.data(), prefill, got);  // a prefill, then one token at a time
  for (int t = prefill - 1; t < T; ++t) {
    if (t >= prefill) dec->feed(units, seq.data() + t, 1, got);
    const std::vector<float> want(full.begin() + size_t(t) * V, full.begin() + size_t(t + 1) * V);
    INFO("position " << t);
    CHECK(rel(got, want) <= 1e-5);
  }
  CHECK(arch->decoder_bytes_needed(*be, T) == dec->bytes());
}

TEST_CASE("mixtral: a router that sends every token to one expert computes that expert's dense MLP", "[mixtral]") {
  // Router weights 0: every probability is 1/E, the tie goes to expert 0,
  // and with top-1 its renormalised weight is 1: the block is Llama's with
  // expert 0's weights. Experts 1 and 2 get no rows (no GEMM, gradient 0).
  Shape s;
  s.E = 3, s.K = 1, s.aux = 0.25;
  const auto moe = make_model_arch(mixtral_cfg(s));
  ModelConfig dense_cfg = mixtral_cfg(s);
  dense_cfg.arch = "llama";
  dense_cfg.moe = MoeConfig{};
  const auto dense = make_model_arch(dense_cfg);
  std::vector<float> pm(size_t(moe->layout().total)), pd(size_t(dense->layout().total));
  moe->init_params(9, 0, moe->layout().total, pm.data());
  auto moe_name = [](const std::string& dense_name) {
    for (const auto& [from, to] : {std::pair<std::string, std::string>{"mlp.gate_proj", "block_sparse_moe.experts.0.w1"},
                                   {"mlp.up_proj", "block_sparse_moe.experts.0.w3"},
                                   {"mlp.down_proj", "block_sparse_moe.experts.0.w2"}}) {
      const size_t at = dense_name.find(from);
      if (at != std::string::npos) return dense_name.substr(0, at) + to + dense_name.substr(at + from.size());
    }
    return dense_name;
  };
  for (const auto& t : dense->layout().tensors) {
    const ParamTensor& m = moe->layout().get(moe_name(t.name));
    std::copy_n(pm.begin() + m.offset, t.numel, pd.begin() + t.offset);
  }
  for (const auto& t : moe->layout().tensors)
    if (t.name.find("block_sparse_moe.gate.") != std::string::npos) std::fill_n(pm.begin() + t.offset, t.numel, 0.f);
  const int B = 2, T = s.T;
  const std::vector<int32_t> in = rand_tokens(size_t(B) * T, s.V, 5), tg = rand_tokens(size_t(B) * T, s.V, 6);
  const Pass a = run_pass(*moe, pm, in, tg, B, T), b = run_pass(*dense, pd, in, tg, B, T);
  std::printf("one expert: logits rel err %.3e, loss %.7f vs dense %.7f + aux_coef * 1\n", rel(a.logits, b.logits),
              a.loss, b.loss);
  CHECK(rel(a.logits, b.logits) <= 1e-6);
  CHECK(std::abs(a.loss - (b.loss + s.aux * 1.0)) <= 1e-6 * b.loss);  // aux = E * (1) * (1/E) = 1
  for (const auto& t : dense->layout().tensors) {
    const ParamTensor& m = moe->layout().get(moe_name(t.name));
    const std::vector<float> got(a.grads.begin() + m.offset, a.grads.begin() + m.offset + m.numel);
    const std::vector<float> want(b.grads.begin() + t.offset, b.grads.begin() + t.offset + t.numel);
    INFO(t.name << " vs " << m.name);
    CHECK(rel(got, want) <= 1e-6);
  }
  for (const auto& t : moe->layout().tensors) {
    if (t.name.find("experts.1.") == std::string::npos && t.name.find("experts.2.") == std::string::npos) continue;
    INFO(t.name);
    for (int64_t i = 0; i < t.numel; ++i) REQUIRE(a.grads[size_t(t.offset + i)] == 0.f);
  }
}

TEST_CASE("mixtral: the router z-loss's gradient against finite differences", "[mixtral]") {
  // No peer computes it for Mixtral (transformers has no z-loss there): the
  // loss's derivative in one router weight, by central differences in double.
  Shape s;
  s.aux = 0.0;
  ModelConfig cfg = mixtral_cfg(s);
  cfg.moe.z_loss_coef = 0.5;
  const auto arch = make_model_arch(cfg);
  std::vector<float> params(size_t(arch->layout().total));
  arch->init_params(4, 0, arch->layout().total, params.data());
  const ParamTensor& gate = arch->layout().get("model.layers.1.block_sparse_moe.gate.weight");
  std::mt19937_64 gen(3);
  std::normal_distribution<float> d(0.f, 2.0f);
  for (int64_t i = 0; i < gate.numel; ++i) params[size_t(gate.offset + i)] = d(gen);  // large logits: z bites
  const int B = 1, T = 9;
  const std::vector<int32_t> in = rand_tokens(size_t(T), s.V, 7), tg = rand_tokens(size_t(T), s.V, 8);
  const Pass base = run_pass(*arch, params, in, tg, B, T);
  ModelConfig no_z = cfg;
  no_z.moe.z_loss_coef = 0;
  const Pass without = run_pass(*make_model_arch(no_z), params, in, tg, B, T);
  CHECK(base.loss - without.loss > 0.05);  // the z term is in the loss
  for (int64_t i : {int64_t(0), int64_t(33), gate.numel - 1}) {
    const size_t at = size_t(gate.offset + i);
    const float h = 1e-2f;
    std::vector<float> p = params;
    p[at] += h;
    const double up = run_pass(*arch, p, in, tg, B, T).loss;
    p[at] -= 2 * h;
    const double down = run_pass(*arch, p, in, tg, B, T).loss;
    const double fd = (up - down) / (2 * h), an = base.grads[at];
    INFO("gate element " << i << ": analytic " << an << ", finite difference " << fd);
    CHECK(std::abs(an - fd) <= 2e-3 * std::max(1.0, std::abs(fd)) + 1e-4);
  }
}

TEST_CASE("mixtral: config.json maths trainrun does not implement is refused by name", "[mixtral][hf]") {
  test::TempDir dir("mixtral_refuse");
  auto write = [&](const std::string& name, const nlohmann::json& extra) {
    nlohmann::json c = {{"model_type", "mixtral"}, {"num_hidden_layers", 2}, {"hidden_size", 16},
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
  // MixtralConfig's defaults: 8 experts, top-2, the aux loss only with output_router_logits.
  const ModelConfig ok = read_hf_model_config(write("ok", {{"sliding_window", nullptr}}), "x");
  CHECK(ok.arch == "mixtral");
  CHECK(ok.moe.n_experts == 8);
  CHECK(ok.moe.top_k == 2);
  CHECK(ok.moe.aux_loss_coef == 0.0);
  CHECK(ok.rope_theta == 1e6);
  const ModelConfig aux = read_hf_model_config(write("aux", {{"output_router_logits", true}}), "x");
  CHECK(aux.moe.aux_loss_coef == 0.001);
  CHECK_THAT(error(write("jitter", {{"router_jitter_noise", 0.1}})),
             Contains("router_jitter_noise = 0.1") && Contains("Mixtral"));
  CHECK_THAT(error(write("act", {{"hidden_act", "gelu"}})), Contains("hidden_act = \"gelu\""));
  CHECK_THAT(error(write("rope", {{"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}})),
             Contains("rope_scaling = "));
  CHECK_THAT(error(write("topk", {{"num_local_experts", 2}, {"num_experts_per_tok", 3}})),
             Contains("num_experts_per_tok (3) must be in 1..num_local_experts (2)"));
  CHECK_THAT(error(write("head_dim", {{"head_dim", 8}})), Contains("head_dim = 8") && Contains("= 4"));
  // The job side: a Mixtral needs its experts, and no shared expert.
  Shape s;
  ModelConfig c = mixtral_cfg(s);
  c.moe.n_experts = 0;
  CHECK_THROWS_WITH(make_model_arch(c), Contains("model.n_experts: mixtral needs its experts"));
  c = mixtral_cfg(s);
  c.moe.top_k = 5;
  CHECK_THROWS_WITH(make_model_arch(c), Contains("model.n_experts_per_tok: 5 must be in 1..4"));
  c = mixtral_cfg(s);
  c.moe.shared_ffn = 8;
  CHECK_THROWS_WITH(make_model_arch(c), Contains("mixtral has no shared expert"));
}

namespace {

// The model.* of the `hf_random(dir, init_shape())` directory.
Shape init_shape() {
  Shape s;
  s.L = 2, s.NH = 4, s.NKV = 1, s.C = 16, s.F = 24, s.E = 4, s.K = 2, s.V = 29, s.T = 12;
  return s;
}
std::string mixtral_job(const std::string& hf, const std::string& out, const std::string& arch, int steps,
                        const std::string& parallel, const std::string& lr = "3.0e-3", const std::string& model = "") {
  return "model: {arch: " + arch + ", init_from: '" + hf + "', seq_len: 12" + model + "}\n"
         "data: {format: synthetic, synthetic: {vocab: 29, branching: 3}}\n"
         "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: " + std::to_string(steps) +
         ", lr: " + lr + ", min_lr: 0,\n"
         "        warmup_steps: 0, schedule: constant, grad_clip: 0.3, eval_steps: 1, log_interval: 1}\n"
         "output: {dir: '" + out + "', sample_tokens: 0}\n"
         "parallel: {" + parallel + "timeout_s: 60}\n";
}

}  // namespace

TEST_CASE("mixtral: init_from (arch auto) bit for bit, greedy generate and export against transformers",
          "[mixtral][hf][init_from]") {
  test::TempDir dir("mixtral_init");
  const std::string hf = dir / "hf";
  hf_random(hf, init_shape());
  const std::string run = dir / "run";
  // lr 1e-30: one real optimizer step that cannot move a weight of ~0.1.
  JobSpec job = parse_job_spec(mixtral_job(hf, run, "auto", 1, "sharding: full_shard, ", "1.0e-30"), "job.yaml", {});
  resolve_model_shape(job, false);  // config.json's shape, as the launcher resolves it before the workers start
  const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
  REQUIRE(arch->name() == "mixtral");
  CHECK(arch->config().moe.n_experts == 4);
  CHECK(arch->config().moe.top_k == 2);
  CHECK(arch->config().moe.aux_loss_coef == 0.001);  // the job's (model.router_aux_loss_coef's default)
  const std::vector<float> want = hf_flat(*arch, hf);
  const std::vector<float> loaded = load_init_from(job.model);
  REQUIRE(loaded.size() == want.size());
  CHECK(std::memcmp(loaded.data(), want.data(), want.size() * 4) == 0);
  (void)test::run_ranks_inprocess(job, 2);
  std::vector<float> trained;
  CHECK(load_model_safetensors(run + "/model.safetensors", trained).arch == "mixtral");
  REQUIRE(trained.size() == want.size());
  CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

  // Greedy generate (our KV-cached decoder with the MoE MLP).
  test::check_cli_generate_equals_hf(kScript, hf, run, "5 17 2 28 0", 7);

  // Export, then from_pretrained: transformers' logits are ours.
  const nlohmann::json c = test::check_cli_export_equals_hf(kScript, *arch, trained, run, dir / "export", 29, dir);
  CHECK(c["model_type"] == "mixtral");
  CHECK(c["architectures"][0] == "MixtralForCausalLM");
  CHECK(c["num_local_experts"] == 4);
  CHECK(c["num_experts_per_tok"] == 2);
  CHECK(c["router_aux_loss_coef"] == 0.001);
}

TEST_CASE("mixtral: the mixtral-8x7b preset and a job spec's MoE fields", "[mixtral][config]") {
  const ModelPreset* preset = find_model_preset("mixtral-8x7b");
  REQUIRE(preset);
  const auto arch = make_model_arch(ModelConfig::from_spec(preset->spec));
  CHECK(arch->name() == "mixtral");
  CHECK(arch->config().moe.n_experts == 8);
  CHECK(arch->config().moe.top_k == 2);
  // 46.7B parameters (test_config), 12.9B of them active per token: the
  // MFU formula's N counts two experts of eight (and the LM head, not the
  // input embedding).
  CHECK(arch->matmul_parameters() == 46702792704LL - 6LL * 32 * 3 * 14336 * 4096 - 32000LL * 4096);
  // A dense family refuses experts; the experts need their count.
  auto spec_error = [](const std::string& yaml) {
    try {
      JobSpec j = parse_job_spec("data: {format: synthetic}\n" + yaml, "job.yaml", {});
      (void)make_model_arch(ModelConfig::from_spec(j.model));
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(spec_error("model: {arch: llama, ffn_dim: 64, n_experts: 4}\n"),
             Contains("model.n_experts: 4; llama has a dense MLP (0); use model.arch: mixtral"));
  CHECK_THAT(spec_error("model: {arch: mixtral, ffn_dim: 64, n_experts: 4, n_experts_per_tok: 0}\n"),
             Contains("model.n_experts_per_tok: 0 must be in 1..4"));
  CHECK_THAT(spec_error("model: {arch: mixtral, ffn_dim: 64, n_experts: 4, n_experts_per_tok: 2, "
                        "router_aux_loss_coef: -1}\n"),
             Contains("model.router_aux_loss_coef"));
}

TEST_CASE("mixtral: the router figures in metrics.jsonl and TensorBoard", "[mixtral][metrics]") {
  // A zero router: every probability 1/E, so every token's top-2 are
  // experts 0 and 1 (the ties go to the lower id): per layer each of them
  // gets all N = 12 tokens of the micro-batch, the mean is N*K/E = 6, the
  // load-balancing loss E * (1 * 1/E + 1 * 1/E) = 2 and the z-loss ln(4)^2.
  // lr 1e-30 keeps the router at zero, so every logged step has them.
  test::TempDir dir("mixtral_metrics");
  const std::string hf = dir / "hf";
  hf_random(hf, init_shape());
  {
    const std::string path = hf + "/model.safetensors";
    SafeTensorFile f = read_safetensors(path);
    SafeTensorFile z;
    for (const SafeTensor& t : f.tensors) {
      std::vector<float> v = t.as_f32();
      if (t.name.find("block_sparse_moe.gate.") != std::string::npos) std::fill(v.begin(), v.end(), 0.f);
      z.tensors.push_back(make_tensor(t.name, "F32", t.shape, v.data()));
    }
    z.metadata = f.metadata;
    write_safetensors(path, z);
  }
  const std::string run = dir / "run";
  JobSpec job = parse_job_spec(mixtral_job(hf, run, "mixtral", 2, "sharding: no_shard, ", "1.0e-30"), "job.yaml", {});
  resolve_model_shape(job, false);
  (void)test::run_ranks_inprocess(job, 1);
  std::ifstream mf(run + "/metrics.jsonl");
  std::string line;
  int records = 0;
  while (std::getline(mf, line)) {
    const nlohmann::json r = nlohmann::json::parse(line);
    INFO(line);
    ++records;
    CHECK(std::abs(r["moe_aux_loss"].get<double>() - 2.0) <= 1e-6);
    CHECK(std::abs(r["moe_z_loss"].get<double>() - std::log(4.0) * std::log(4.0)) <= 1e-5);
    for (int l = 0; l < 2; ++l) {
      CHECK(r["moe_layer" + std::to_string(l) + "_tokens_max"] == 12);
      CHECK(r["moe_layer" + std::to_string(l) + "_tokens_mean"] == 6);
    }
  }
  CHECK(records == 2);
  const std::string script =
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator as E\n"
      "import sys\n"
      "a = E(sys.argv[1]); a.Reload()\n"
      "for t in sorted(a.Tags()['scalars']):\n"
      "    if t.startswith('moe/'): print(t, ' '.join('%d:%.6g' % (e.step, e.value) for e in a.Scalars(t)))\n";
  test::write_file(dir / "read.py", script);
  const test::RunResult r = test::run_command("'" + test::hf_python() + "' " + dir / "read.py" + " " + run + "/tb");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == "moe/aux_loss 1:2 2:2\nmoe/layer0/load_max_over_mean 1:2 2:2\nmoe/layer1/load_max_over_mean 1:2 2:2\n"
                 "moe/z_loss 1:1.92181 2:1.92181\n");
}

TEST_CASE("mixtral: dp2 (full_shard) and tp2 (attention split, experts replicated) train as one rank does",
          "[mixtral][tp]") {
  test::TempDir dir("mixtral_mesh");
  const std::string hf = dir / "hf";
  Shape s = init_shape();
  s.NKV = 2;  // two KV heads: tp2 splits them
  hf_random(hf, s);
  auto run = [&](const std::string& name, int world, const std::string& parallel) {
    return test::train_mesh(mixtral_job(hf, dir / name, "mixtral", 5, parallel), world);
  };
  const test::MeshRun ref = run("one", 1, "sharding: no_shard, ");
  REQUIRE(ref.losses.size() == 5);
  CHECK(rel(ref.weights, hf_flat(*make_model_arch(read_hf_model_config(hf, "t")), hf)) > 1e-4);  // it trained
  test::check_same_run("dp2", run("dp2", 2, "sharding: full_shard, "), ref);
  test::check_same_run("tp2", run("tp2", 2, "sharding: no_shard, tensor_parallel: 2, "), ref);
  // Not yet: sequence parallelism over MoE blocks, refused by name.
  JobSpec sp = parse_job_spec(mixtral_job(hf, dir / "sp", "mixtral", 1,
                                          "sharding: no_shard, tensor_parallel: 2, sequence_parallel: true, "),
                              "job.yaml", {});
  resolve_model_shape(sp, false);
  CHECK_THROWS_WITH(test::run_ranks_inprocess(sp, 2), Contains("mixture of experts") && Contains("sequence_parallel"));
}

TEST_CASE("mixtral: pp2 (1f1b) trains as one rank does without router losses",
          "[mixtral][pp]") {
  test::TempDir dir("mixtral_pp");
  const std::string hf = dir / "hf";
  hf_random(hf, init_shape());
  const std::string no_loss = ", router_aux_loss_coef: 0";
  auto run = [&](const std::string& name, int world, const std::string& parallel) {
    return test::train_mesh(mixtral_job(hf, dir / name, "mixtral", 5, parallel, "3.0e-3", no_loss), world);
  };
  const test::MeshRun ref = run("one", 1, "sharding: no_shard, ");
  REQUIRE(ref.losses.size() == 5);
  test::check_same_run("pp2", run("pp2", 2, "sharding: no_shard, pipeline_parallel: 2, pipeline_schedule: 1f1b, "), ref);
  // With the router losses on: tests/test_moe_pipeline.cpp (their statistics ride the stage messages).
}

TEST_CASE("mixtral: our files record the experts, a file without them is refused by key", "[mixtral][files]") {
  const auto arch = make_model_arch(mixtral_cfg(Shape{}));
  std::map<std::string, std::string> meta = arch->file_metadata();
  const ModelConfig back = config_from_file_metadata(meta, "model.safetensors");
  CHECK(back.arch == "mixtral");
  CHECK(back.moe.n_experts == 4);
  CHECK(back.moe.top_k == 2);
  CHECK(back.moe.aux_loss_coef == 0.02);
  CHECK(make_model_arch(back)->layout().total == arch->layout().total);
  meta.erase("n_experts_per_tok");
  CHECK_THROWS_WITH(config_from_file_metadata(meta, "run/model.safetensors"),
                    Contains("run/model.safetensors: missing __metadata__ key 'n_experts_per_tok'"));
  meta = arch->file_metadata();
  meta["norm_topk_prob"] = "yes";
  CHECK_THROWS_WITH(config_from_file_metadata(meta, "m.safetensors"),
                    Contains("'norm_topk_prob' is not true/false: 'yes'"));
}

// ---- bench moe --------------------------------------------------------------------------------

TEST_CASE("mixtral: `trainrun bench moe` prints the dense and the MoE row of equal active parameters, and refuses a "
          "top-k beyond the experts", "[mixtral][bench]") {
  const auto ok = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() +
                                    "' bench moe --layers 1 --width 16 --expert-ffn 8 --seq-len 8 --batch 1 --steps 2");
  INFO(ok.out << ok.err);
  REQUIRE(ok.exit_code == 0);
  CHECK_THAT(ok.out, Contains("8 experts top-2 of ffn 8 vs one MLP of 16"));
  CHECK_THAT(ok.out, Contains("| model | parameters | active (matmul) | step (ms) | tokens/s | step / dense |"));
  // Active parameters: the dense MLP of 2 x 8 is what 2 experts of 8 are; the MoE adds its router (8 x 16).
  long long dense = -1, moe = -1;
  std::istringstream lines(ok.out);
  for (std::string line; std::getline(lines, line);) {
    long long params = 0, active = 0;
    const auto cells = line.find(" | ");
    if (cells == std::string::npos || std::sscanf(line.c_str() + cells, " | %lld | %lld |", &params, &active) != 2)
      continue;
    (line.find("| llama ") == 0 ? dense : moe) = active;
  }
  CHECK(dense > 0);
  CHECK(moe - dense == 8 * 16);
  CHECK_THAT(ok.out, Contains("experts=8 top_k=2") && Contains("| 1.00 |"));
  const auto bad = test::run_command("'" + test::trainrun_binary() + "' bench moe --experts 4 --top-k 5 --steps 2");
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.out + bad.err, Contains("bench moe: --top-k 5 must be in 1..--experts (4)"));
}
