// Qwen2 / Qwen2.5 (core/model/qwen2/: Llama's network with q/k/v biases)
// against transformers 4.44.2's Qwen2ForCausalLM (scripts/reference/hf_qwen2.py),
// in fp32 on tiny random models whose every parameter is perturbed (the
// q/k/v biases nonzero):
//  - logits, loss and every parameter gradient (the biases' included);
//  - the layout: biases adjacent after q|k|v, zero at init, split over
//    tensor parallelism by heads (a replicated KV head's bias on both ranks);
//  - model.init_from with model.arch auto (bit for bit), greedy `generate`
//    against transformers' greedy generate, and an export that
//    from_pretrained reloads with our logits;
//  - 1 rank equals dp2 (full_shard), tp2 (NKV 1 < tp: KV heads and their
//    biases replicated) and pp2 (1f1b) over 4 steps from that directory;
//  - config.json that asks for maths trainrun does not implement is refused by name;
//  - the presets are qwen2 and `plan` plans qwen2.5-72b (their counts: test_config).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/checkpoint/hf_interop.h"
#include "core/config/model_presets.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/model/model_spec.h"
#include "core/model/tensor_parallel.h"
#include "kernels/backend.h"
#include "tests/support/adapted_model.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/mesh_runs.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using test::hf_python;

namespace {

const char* kScript = "hf_qwen2.py";

std::vector<int32_t> rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

std::vector<float> f32_of(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  const SafeTensor* t = f.find(name);
  if (!t) FAIL(path << " has no tensor '" << name << "'");
  return t->as_f32();
}

// `hf_qwen2.py random` into DIR (with --batch: the reference pass too).
void hf_random(const std::string& dir, int L, int NH, int NKV, int C, int F, int V, int T, bool tied,
               const std::string& batch = "", const std::string& out_ref = "") {
  char args[768];
  std::snprintf(args, sizeof args,
                "random --out '%s' --layers %d --hidden %d --heads %d --kv-heads %d --intermediate %d --vocab %d "
                "--max-positions %d --seed 5%s",
                dir.c_str(), L, C, NH, NKV, F, V, T, tied ? " --tie" : "");
  std::string a = args;
  if (!batch.empty()) a += " --batch '" + batch + "' --out-ref '" + out_ref + "'";
  const test::RunResult r = test::run_reference_script(kScript, a);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
}

// HF's tensors in our flat layout, by name (nn.Linear layout: no transpose).
std::vector<float> hf_flat(const ModelArch& arch, const std::string& dir) {
  const std::string path = dir + "/model.safetensors";
  const SafeTensorFile w = read_safetensors(path);
  std::vector<float> flat(size_t(arch.layout().total));
  for (const auto& t : arch.layout().tensors) {
    const SafeTensor* s = w.find(arch.hf_tensor(t).name);
    if (!s) FAIL(path << " has no tensor '" << t.name << "'");
    REQUIRE(s->shape == t.shape);
    const std::vector<float> v = s->as_f32();
    std::copy(v.begin(), v.end(), flat.begin() + t.offset);
  }
  return flat;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

ModelConfig qwen2_cfg(int NH, int NKV, bool tied) {
  ModelConfig c;
  c.arch = "qwen2";
  c.L = 2, c.NH = NH, c.NKV = NKV, c.C = 32, c.F = 40, c.V = 37, c.T = 9;
  c.tied = tied;
  c.norm_eps = 1e-6;
  c.rope_theta = 1e6;
  return c;
}

}  // namespace

TEST_CASE("qwen2: logits, loss and every gradient (biases included) match transformers' Qwen2ForCausalLM",
          "[qwen2][hf]") {
  struct Case { int NH, NKV; bool tied; };
  for (const Case k : {Case{4, 2, true}, Case{4, 1, false}}) {
    const ModelConfig cfg = qwen2_cfg(k.NH, k.NKV, k.tied);
    const auto arch = make_model_arch(cfg);
    INFO(arch->describe());
    std::printf("%s\n", arch->describe().c_str());
    REQUIRE(arch->config().qkv_bias);
    const int B = 2, T = cfg.T, V = cfg.V;
    test::TempDir dir("qwen2_hf");
    const std::vector<int32_t> in = rand_tokens(size_t(B) * T, V, 11), tg = rand_tokens(size_t(B) * T, V, 12);
    {
      SafeTensorFile batch;
      batch.tensors.push_back(make_tensor("inputs", "I32", {B, T}, in.data()));
      batch.tensors.push_back(make_tensor("targets", "I32", {B, T}, tg.data()));
      write_safetensors(dir / "batch.safetensors", batch);
    }
    hf_random(dir / "model", cfg.L, k.NH, k.NKV, cfg.C, cfg.F, V, T, k.tied, dir / "batch.safetensors",
              dir / "ref.safetensors");
    const std::vector<float> params = hf_flat(*arch, dir / "model");
    const ParamLayout& lay = arch->layout();

    auto be = make_cpu_backend(2);
    auto net = arch->make_network(be.get(), B, false);
    DeviceBuffer p = test::upload_act(be.get(), params);
    DeviceBuffer g(be.get(), size_t(lay.total) * 4);
    be->zero(g.get(), size_t(lay.total) * 4);
    DeviceBuffer din = test::upload_i32(be.get(), in), dtg = test::upload_i32(be.get(), tg);
    FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
    net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, false, 1.0f);
    const std::vector<float> logits = test::download_act(be.get(), net->logits(), size_t(B) * T * V);
    net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
    net->backward(units);
    const std::vector<float> losses = test::download_f32(be.get(), net->losses(), size_t(B) * T);
    const std::vector<float> grads = test::download_f32(be.get(), g.get(), size_t(lay.total));

    const std::string rpath = dir / "ref.safetensors";
    const SafeTensorFile ref = read_safetensors(rpath);
    const double logit_err = rel(logits, f32_of(ref, "logits", rpath));
    double loss = 0;
    for (float x : losses) loss += x;
    loss /= double(losses.size());
    const double hf_loss = f32_of(ref, "loss", rpath)[0];
    std::printf("  logits rel err %.3e, loss %.6f (HF %.6f) rel err %.3e\n", logit_err, loss, hf_loss,
                std::abs(loss - hf_loss) / hf_loss);
    CHECK(logit_err <= 1e-5);
    CHECK(std::abs(loss - hf_loss) / hf_loss <= 1e-5);
    int biases = 0;
    double worst = 0;
    for (const auto& t : lay.tensors) {
      const std::vector<float> want = f32_of(ref, "grad." + arch->hf_tensor(t).name, rpath);
      REQUIRE(int64_t(want.size()) == t.numel);
      const std::vector<float> got(grads.begin() + t.offset, grads.begin() + t.offset + t.numel);
      const double e = rel(got, want);
      worst = std::max(worst, e);
      std::printf("  %-40s rel err %.3e\n", t.name.c_str(), e);
      INFO(t.name);
      CHECK(e <= 1e-5);
      if (t.name.find("_proj.bias") != std::string::npos) {
        ++biases;
        double n2 = 0;
        for (float x : want) n2 += double(x) * x;
        CHECK(n2 > 0);  // the bias gradient is a real check, not 0 == 0
      }
    }
    CHECK(biases == 3 * cfg.L);
    std::printf("  worst gradient rel err %.3e\n", worst);
  }
}

TEST_CASE("qwen2: biases adjacent after q|k|v, zero at init, split by heads over tensor parallelism", "[qwen2]") {
  const auto arch = make_model_arch(qwen2_cfg(4, 1, false));
  const ParamLayout& lay = arch->layout();
  const ParamTensor& w = lay.get("model.layers.1.self_attn.v_proj.weight");
  const ParamTensor& qb = lay.get("model.layers.1.self_attn.q_proj.bias");
  const ParamTensor& kb = lay.get("model.layers.1.self_attn.k_proj.bias");
  const ParamTensor& vb = lay.get("model.layers.1.self_attn.v_proj.bias");
  CHECK(qb.offset == w.offset + w.numel);  // one bias vector for the fused GEMM
  CHECK(kb.offset == qb.offset + 32);
  CHECK(vb.offset == kb.offset + 8);
  CHECK(!qb.decay);
  CHECK(lay.find("model.layers.0.self_attn.o_proj.bias") == nullptr);
  std::vector<float> p(size_t(lay.total));
  arch->init_params(7, 0, lay.total, p.data());
  for (const ParamTensor* t : {&qb, &kb, &vb})
    for (int64_t i = 0; i < t->numel; ++i) REQUIRE(p[size_t(t->offset + i)] == 0.0f);
  // tp2 with one KV head: each rank holds half of q's bias and all of k's and v's.
  for (int r = 0; r < 2; ++r) {
    const TensorParallelPlan plan(*arch, 2, r);
    CHECK(plan.local_layout().get("model.layers.0.self_attn.q_proj.bias").shape == std::vector<int64_t>{16});
    CHECK(plan.local_layout().get("model.layers.0.self_attn.k_proj.bias").shape == std::vector<int64_t>{8});
  }
  const TensorParallelPlan r1(*arch, 2, 1);
  const ParamTensor& lq = r1.local_layout().get("model.layers.0.self_attn.q_proj.bias");
  CHECK(r1.local_of(lay.get("model.layers.0.self_attn.q_proj.bias").offset + 16) == lq.offset);  // heads 2,3
}

TEST_CASE("qwen2: the KV-cached decoder's logits (biases in its q|k|v GEMM) equal the full forward's", "[qwen2][decoder]") {
  const auto arch = make_model_arch(qwen2_cfg(4, 2, false));
  const ParamLayout& lay = arch->layout();
  std::vector<float> params(size_t(lay.total));
  arch->init_params(3, 0, lay.total, params.data());
  // Biases as large as the weights' effect: a decoder that dropped them would be far off.
  std::mt19937_64 gen(8);
  std::normal_distribution<float> d(0.f, 0.5f);
  for (const auto& t : lay.tensors)
    if (t.name.find("_proj.bias") != std::string::npos)
      for (int64_t i = 0; i < t.numel; ++i) params[size_t(t.offset + i)] = d(gen);
  const int T = arch->config().T;
  const std::vector<int32_t> seq = rand_tokens(size_t(T), arch->config().V, 4);
  const std::vector<float> full = test::logits_of(*arch, params, seq, 1, T);
  auto be = make_cpu_backend(2);
  auto dec = arch->make_decoder(be.get(), T);
  DeviceBuffer p = test::upload_act(be.get(), params);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  const int V = arch->config().V, prefill = 3;
  std::vector<float> got;
  dec->feed(units, seq.data(), prefill, got);  // a prefill, then one token at a time
  for (int t = prefill - 1; t < T; ++t) {
    if (t >= prefill) dec->feed(units, seq.data() + t, 1, got);
    const std::vector<float> want(full.begin() + size_t(t) * V, full.begin() + size_t(t + 1) * V);
    INFO("position " << t);
    CHECK(rel(got, want) <= 1e-5);
  }
}

namespace {

// The model.* of the `hf_random(dir, 2, 4, 1, 16, 24, 29, 12, tied)` directory.
std::string qwen2_job(const std::string& hf, const std::string& out, const std::string& arch, int steps,
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

TEST_CASE("qwen2: init_from (arch auto) bit for bit, greedy generate and export against transformers",
          "[qwen2][hf][init_from]") {
  test::TempDir dir("qwen2_init");
  const std::string hf = dir / "hf";
  hf_random(hf, 2, 4, 1, 16, 24, 29, 12, true);
  const std::string run = dir / "run";
  // lr 1e-30: one real optimizer step that cannot move a weight of ~0.1.
  JobSpec job = parse_job_spec(qwen2_job(hf, run, "auto", 1, "sharding: full_shard, ", "1.0e-30"), "job.yaml", {});
  resolve_model_shape(job, false);  // config.json's shape, as the launcher resolves it before the workers start
  const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
  REQUIRE(arch->name() == "qwen2");
  CHECK(arch->config().tied);
  CHECK(arch->config().rope_theta == 1e6);
  const std::vector<float> want = hf_flat(*arch, hf);
  const std::vector<float> loaded = load_init_from(job.model);
  REQUIRE(loaded.size() == want.size());
  CHECK(std::memcmp(loaded.data(), want.data(), want.size() * 4) == 0);
  (void)test::run_ranks_inprocess(job, 2);
  std::vector<float> trained;
  CHECK(load_model_safetensors(run + "/model.safetensors", trained).arch == "qwen2");
  REQUIRE(trained.size() == want.size());
  CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

  // Greedy generate (our KV-cached decoder, biases in its q|k|v GEMM).
  test::check_cli_generate_equals_hf(kScript, hf, run, "5 17 2 28 0", 7);

  // Export, then from_pretrained: transformers' logits are ours.
  const nlohmann::json c = test::check_cli_export_equals_hf(kScript, *arch, trained, run, dir / "export", 29, dir);
  CHECK(c["model_type"] == "qwen2");
  CHECK(c["architectures"][0] == "Qwen2ForCausalLM");
  CHECK(c["use_sliding_window"] == false);
}

TEST_CASE("qwen2: dp2 (full_shard), tp2 (a KV head and its biases replicated) and pp2 train as one rank does",
          "[qwen2][tp][pp]") {
  test::TempDir dir("qwen2_mesh");
  const std::string hf = dir / "hf";
  hf_random(hf, 2, 4, 1, 16, 24, 29, 12, false);
  auto run = [&](const std::string& name, int world, const std::string& parallel) {
    return test::train_mesh(qwen2_job(hf, dir / name, "qwen2", 4, parallel), world);
  };
  const test::MeshRun ref = run("one", 1, "sharding: no_shard, ");
  REQUIRE(ref.losses.size() == 4);
  const auto start = hf_flat(*make_model_arch(read_hf_model_config(hf, "test")), hf);
  CHECK(rel(ref.weights, start) > 1e-4);  // the steps moved the weights
  test::check_same_run("dp2", run("dp2", 2, "sharding: full_shard, "), ref);
  test::check_same_run("tp2", run("tp2", 2, "sharding: no_shard, tensor_parallel: 2, "), ref);
  test::check_same_run("pp2", run("pp2", 2, "sharding: no_shard, pipeline_parallel: 2, pipeline_schedule: 1f1b, "), ref);
}

TEST_CASE("qwen2: config.json maths trainrun does not implement is refused by name", "[qwen2][hf]") {
  test::TempDir dir("qwen2_refuse");
  auto write = [&](const std::string& name, const nlohmann::json& extra) {
    nlohmann::json c = {{"model_type", "qwen2"}, {"num_hidden_layers", 2}, {"hidden_size", 16},
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
  // Published Qwen2.5 configs name a window and leave it off: accepted, full attention.
  const ModelConfig ok = read_hf_model_config(
      write("off", {{"use_sliding_window", false}, {"sliding_window", 32}, {"rope_scaling", nullptr}}), "x");
  CHECK(ok.arch == "qwen2");
  CHECK(ok.norm_eps == 1e-6);  // Qwen2Config's default, not Llama's
  // A window no layer uses (max_window_layers >= num_hidden_layers) changes nothing.
  CHECK(error(write("unused", {{"use_sliding_window", true}, {"sliding_window", 8}, {"max_window_layers", 2}})) == "");
  CHECK_THAT(error(write("window", {{"use_sliding_window", true}, {"sliding_window", 8}, {"max_window_layers", 1}})),
             Contains("use_sliding_window = true (sliding_window 8 on layers 1..1") && Contains("not implemented"));
  CHECK_THAT(error(write("yarn", {{"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}}}})),
             Contains("rope_scaling.type = \"yarn\""));
  CHECK_THAT(error(write("dynamic", {{"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}})),
             Contains("rope_scaling.rope_type = \"dynamic\""));
  CHECK_THAT(error(write("mrope", {{"use_mrope", true}})), Contains("use_mrope = true"));
  CHECK_THAT(error(write("head_dim", {{"head_dim", 8}})), Contains("head_dim = 8") && Contains("= 4"));
  CHECK_THAT(error(write("act", {{"hidden_act", "gelu"}})), Contains("hidden_act = \"gelu\""));
  // A qwen2 directory is not a llama one.
  CHECK_THAT([&] {
    try {
      (void)read_hf_model_config(dir / "off", "model.init_from", "llama");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  }(), Contains("model_type \"qwen2\" but model.arch is llama"));
  // A llama3 rope_scaling in the job spec is not Qwen2's.
  ModelConfig c = qwen2_cfg(4, 2, true);
  c.rope_scaling_type = "llama3";
  c.rope_scaling.factor = 8;
  c.rope_scaling.original_max_position_embeddings = 8;
  CHECK_THROWS_WITH(make_model_arch(c), Contains("model.rope_scaling.type: llama3; qwen2"));
}

TEST_CASE("qwen2: the presets are qwen2 models and plan plans them", "[qwen2][plan]") {
  // Their parameter counts are the published ones: test_config's "every preset has ...".
  for (const char* name : {"qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b"}) {
    INFO(name);
    const ModelPreset* preset = find_model_preset(name);
    REQUIRE(preset);
    const auto arch = make_model_arch(ModelConfig::from_spec(preset->spec));
    CHECK(arch->name() == "qwen2");
    CHECK(arch->config().qkv_bias);
    CHECK(arch->config().rope_theta == 1e6);
  }
  const test::RunResult r = test::run_trainrun("plan --model qwen2.5-72b --gpus 8");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("qwen2 L=80 C=8192 heads=64 kv_heads=8 ffn=29568 V=152064"));
}

TEST_CASE("qwen2: LoRA on every linear (q/k/v with their biases) equals peft's", "[qwen2][lora][peft]") {
  test::TempDir tmp("qwen2_lora");
  const test::PeftCase c{"qwen2", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", false};
  test::make_peft_case(c, 4, 8.0, tmp);
  test::AdaptedModel m(tmp / "base", test::options_for(c, 4, 8.0), nullptr, tmp / "adapter");
  REQUIRE(m.arch->name() == "qwen2");
  const int V = m.arch->config().V;
  const std::vector<int32_t> in = test::tokens(1, V), tgt = test::tokens(2, V);
  // Logits, loss and every adapter gradient against peft's (the frozen biases in the base's q|k|v GEMM).
  CHECK(m.ad->targets().size() == 7 * 2);  // 7 linears x 2 blocks
  CHECK(test::check_equals_peft(m, tmp / "base", tmp / "adapter", tmp, in, tgt) == int(m.ad->targets().size()) * 2);
}
