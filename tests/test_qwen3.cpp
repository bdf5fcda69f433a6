// model.head_dim (heads not C/NH wide) on the shared Llama network, and
// Qwen3 (core/model/qwen3/), on the CPU backend:
//  - a Llama with head_dim != C/NH: logits, loss and every parameter
//    gradient against transformers (4.44's MistralForCausalLM with no
//    window: the class of that version that reads head_dim), export ->
//    from_pretrained, model.init_from -> `trainrun generate` against
//    transformers' greedy generate, tp2 / tp2 x dp2 against one rank, the
//    decoder against the full forward, the arena estimate;
//  - (Qwen3 cases below.)
// Error metric: norm-wise relative error per tensor (ref::rel_err).
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/model/model_spec.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "parallel/sharding/sharding.h"
#include "tests/support/device_io.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using ref::Vec;
using Tokens = std::vector<int32_t>;

namespace {

Tokens rand_tokens(size_t n, int V, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  Tokens t(n);
  for (auto& x : t) x = d(gen);
  return t;
}

std::vector<float> f32_of(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  const SafeTensor* t = f.find(name);
  if (!t) FAIL(path << " has no tensor '" << name << "'");
  return t->as_f32();
}

// A tiny shape of a family: `family` is hf_qwen3.py's --family.
struct Shape {
  std::string family;  // "llama-head-dim" | "qwen3"
  int L, C, NH, NKV, HD, F, V, T;
  bool tied;
  double rope_theta = 1e6, eps = 1e-6;
};

ModelConfig config_of(const Shape& s) {
  ModelConfig c;
  c.arch = s.family == "qwen3" ? "qwen3" : "llama";
  c.L = s.L, c.C = s.C, c.NH = s.NH, c.NKV = s.NKV, c.head_dim = s.HD, c.F = s.F, c.V = s.V, c.T = s.T;
  c.tied = s.tied;
  c.rope_theta = s.rope_theta;
  c.norm_eps = s.eps;
  c.init_std = 0.3;
  return c;
}

// The python that runs hf_qwen3.py for a family ("" when it is absent).
std::string family_python(const Shape& s) { return test::hf_python(); }

test::RunResult hf_script(const Shape& s, const std::string& args) {
  return test::run_command("OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 '" + family_python(s) + "' '" +
                           test::source_dir() + "/scripts/reference/hf_qwen3.py' " + args + " --family " + s.family);
}

// A random HF model of the shape in DIR/model; with a batch, its reference
// logits, loss and gradients in DIR/ref.safetensors.
std::string hf_random(const Shape& s, const test::TempDir& dir, const Tokens* in = nullptr, const Tokens* tg = nullptr,
                      int B = 0) {
  std::ostringstream a;
  a << "random --out '" << (dir / "model") << "' --layers " << s.L << " --hidden " << s.C << " --heads " << s.NH
    << " --kv-heads " << s.NKV << " --head-dim " << s.HD << " --intermediate " << s.F << " --vocab " << s.V
    << " --max-positions " << s.T << " --rope-theta " << s.rope_theta << " --eps " << s.eps
    << (s.tied ? " --tie" : "");
  if (in) {
    SafeTensorFile batch;
    batch.tensors.push_back(make_tensor("inputs", "I32", {B, s.T}, in->data()));
    batch.tensors.push_back(make_tensor("targets", "I32", {B, s.T}, tg->data()));
    write_safetensors(dir / "batch.safetensors", batch);
    a << " --batch '" << (dir / "batch.safetensors") << "' --out-ref '" << (dir / "ref.safetensors") << "'";
  }
  const test::RunResult r = hf_script(s, a.str());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return dir / "model";
}

struct RunOut {
  std::vector<float> losses, logits, grads;
};

// A forward-only pass (logits) and one forward + backward (dloss_scale
// 1/(B*T)) into a zeroed gradient.
RunOut run_model(const ModelArch& arch, const std::vector<float>& params, const Tokens& in, const Tokens& tg, int B,
                 int T) {
  auto be = make_cpu_backend(2);
  const ParamLayout& lay = arch.layout();
  const int V = arch.config().V;
  auto net = arch.make_network(be.get(), B, false);
  DeviceBuffer p = test::upload_act(be.get(), params);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  be->zero(g.get(), size_t(lay.total) * 4);
  DeviceBuffer din = test::upload_i32(be.get(), in), dtg = test::upload_i32(be.get(), tg);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  RunOut r;
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, false, 1.0f);
  const int ldv = net->logits_stride();
  const std::vector<float> padded = test::download_act(be.get(), net->logits(), size_t(B) * T * ldv);
  for (int n = 0; n < B * T; ++n)
    r.logits.insert(r.logits.end(), padded.begin() + size_t(n) * ldv, padded.begin() + size_t(n) * ldv + V);
  net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
  net->backward(units);
  r.losses = test::download_f32(be.get(), net->losses(), size_t(B) * T);
  r.grads = test::download_f32(be.get(), g.get(), size_t(lay.total));
  return r;
}

// The HF model's weights into our flat layout, by name.
std::vector<float> flat_from_hf(const ModelArch& arch, const std::string& wpath) {
  const SafeTensorFile w = read_safetensors(wpath);
  const ParamLayout& lay = arch.layout();
  std::vector<float> params(size_t(lay.total));
  for (const auto& t : lay.tensors) {
    const SafeTensor* s = w.find(arch.hf_tensor(t).name);
    if (!s) FAIL(wpath << " has no tensor '" << t.name << "'");
    REQUIRE(s->shape == t.shape);
    const std::vector<float> v = s->as_f32();
    std::copy(v.begin(), v.end(), params.begin() + t.offset);
  }
  return params;
}

// Logits, loss and every parameter gradient against transformers; returns
// the worst gradient error (printed with the others).
void check_against_hf(const Shape& s) {
  const int B = 2, T = s.T;
  const auto arch = make_model_arch(config_of(s));
  std::printf("%s (%s)\n", arch->describe().c_str(), s.family.c_str());
  INFO(arch->describe());
  test::TempDir dir("qwen3_hf");
  const Tokens in = rand_tokens(size_t(B) * T, s.V, 11), tg = rand_tokens(size_t(B) * T, s.V, 12);
  const std::string model = hf_random(s, dir, &in, &tg, B);
  const std::vector<float> params = flat_from_hf(*arch, model + "/model.safetensors");
  const std::string rpath = dir / "ref.safetensors";
  const SafeTensorFile ref = read_safetensors(rpath);
  const RunOut run = run_model(*arch, params, in, tg, B, T);

  const std::vector<float> hl = f32_of(ref, "logits", rpath);
  const double logit_err = ref::rel_err(Vec(run.logits.begin(), run.logits.end()), Vec(hl.begin(), hl.end()));
  double loss = 0;
  for (float x : run.losses) loss += x;
  loss /= double(run.losses.size());
  const double hf_loss = f32_of(ref, "loss", rpath)[0];
  const double loss_err = std::abs(loss - hf_loss) / hf_loss;
  std::printf("  logits rel err %.3e, loss %.6f (HF %.6f) rel err %.3e\n", logit_err, loss, hf_loss, loss_err);
  CHECK(logit_err <= 1e-5);
  CHECK(loss_err <= 1e-5);
  double worst = 0;
  std::string worst_name;
  for (const auto& t : arch->layout().tensors) {
    const std::vector<float> g = f32_of(ref, "grad." + arch->hf_tensor(t).name, rpath);
    REQUIRE(int64_t(g.size()) == t.numel);
    const double e = ref::rel_err(Vec(run.grads.begin() + t.offset, run.grads.begin() + t.offset + t.numel),
                                  Vec(g.begin(), g.end()));
    std::printf("  %-44s rel err %.3e\n", t.name.c_str(), e);
    if (!(e <= worst)) worst = e, worst_name = t.name;
  }
  INFO("worst gradient " << worst_name << ": " << worst);
  CHECK(worst <= 1e-5);
}

// Export -> from_pretrained gives our logits; model.init_from of the HF
// directory through a 2-rank full_shard job keeps it bit for bit, and
// `trainrun generate` on the result continues a prompt as transformers'
// greedy generate does.
void check_interop(const Shape& s) {
  const auto arch = make_model_arch(config_of(s));
  INFO(arch->describe());
  test::TempDir dir("qwen3_io");
  const std::string model = hf_random(s, dir);
  const std::vector<float> want = flat_from_hf(*arch, model + "/model.safetensors");

  // export, then from_pretrained in transformers: the same logits.
  const std::string out = dir / "export";
  export_hf(out, arch->config(), want);
  const Tokens in = rand_tokens(size_t(2) * s.T, s.V, 5);
  const std::vector<float> ours = test::logits_of(*arch, want, in, 2, s.T);
  SafeTensorFile batch;
  batch.tensors.push_back(make_tensor("inputs", "I32", {2, s.T}, in.data()));
  write_safetensors(dir / "lbatch.safetensors", batch);
  const test::RunResult lr = hf_script(s, "logits --model '" + out + "' --batch '" + (dir / "lbatch.safetensors") +
                                              "' --out '" + (dir / "logits.safetensors") + "'");
  INFO(lr.err);
  REQUIRE(lr.exit_code == 0);
  const std::vector<float> theirs = read_safetensors(dir / "logits.safetensors").find("logits")->as_f32();
  const double e = ref::rel_err(Vec(ours.begin(), ours.end()), Vec(theirs.begin(), theirs.end()));
  std::printf("  export -> from_pretrained logits rel err %.3e\n", e);
  CHECK(e <= 1e-5);

  // model.init_from (model.arch auto from model_type), 2 ranks, lr 1e-30.
  const std::string run = dir / "run";
  const std::string yaml =
      "model: {init_from: '" + model + "', seq_len: " + std::to_string(s.T) + "}\n"
      "data: {format: synthetic, synthetic: {vocab: " + std::to_string(s.V) + ", branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 1, lr: 1.0e-30, min_lr: 0, warmup_steps: 0,\n"
      "        schedule: constant, weight_decay: 0, grad_clip: 0, eval_steps: 1, log_interval: 1}\n"
      "output: {dir: '" + run + "', sample_tokens: 0}\n"
      "parallel: {sharding: full_shard, timeout_s: 60}\n";
  const JobSpec job = parse_job_spec(yaml, "job.yaml", {});
  JobSpec resolved = job;
  resolve_model_shape(resolved, false);
  CHECK(ModelConfig::from_spec(resolved.model).arch == arch->name());
  CHECK(ModelConfig::from_spec(resolved.model).head_size() == s.HD);
  (void)test::run_ranks_inprocess(job, 2);
  std::vector<float> trained;
  const ModelConfig c = load_model_safetensors(run + "/model.safetensors", trained);
  CHECK(c.arch == arch->name());
  CHECK(c.head_size() == s.HD);
  REQUIRE(trained.size() == want.size());
  CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

  const std::string prompt = "5 17 2 28 0";
  const int steps = s.T - 5;
  const test::RunResult hf_gen =
      hf_script(s, "generate --model '" + model + "' --prompt '" + prompt + "' --max-new-tokens " + std::to_string(steps));
  INFO(hf_gen.err);
  REQUIRE(hf_gen.exit_code == 0);
  const test::RunResult our_gen = test::run_trainrun("generate --checkpoint '" + run + "/model.safetensors' --prompt '" +
                                                     prompt + "' --max-tokens " + std::to_string(steps) + " --top-k 1");
  INFO(our_gen.err);
  REQUIRE(our_gen.exit_code == 0);
  std::printf("  generate: ours '%s' transformers '%s'\n", our_gen.out.c_str(), hf_gen.out.c_str());
  CHECK(our_gen.out == hf_gen.out);
}

// The decoder's logits against the full forward's last row, a prefill then
// one token at a time.
void check_decoder(const ModelConfig& cfg) {
  const auto arch = make_model_arch(cfg);
  INFO(arch->describe());
  auto be = make_cpu_backend(2);
  const ParamLayout& lay = arch->layout();
  std::vector<float> params(size_t(lay.total));
  arch->init_params(7, 0, lay.total, params.data());
  DeviceBuffer p = test::upload_act(be.get(), params);
  FlatUnitAccess units(lay, p.get(), nullptr, be->act_dtype());
  const int prefill = 4, cap = cfg.T;
  auto dec = arch->make_decoder(be.get(), cap);
  CHECK(dec->bytes() == arch->decoder_bytes_needed(*be, cap));
  auto net = arch->make_network(be.get(), 1, false);
  const Tokens seq = rand_tokens(size_t(cap), cfg.V, 21);
  std::vector<float> got;
  double worst = 0;
  for (int n = prefill; n <= cap; ++n) {
    if (n == prefill)
      dec->feed(units, seq.data(), n, got);
    else
      dec->feed(units, seq.data() + n - 1, 1, got);
    DeviceBuffer din = test::upload_i32(be.get(), Tokens(seq.begin(), seq.begin() + n));
    net->forward(units, din.as<int32_t>(), nullptr, 1, n, false, 0.0f);
    const int ldv = net->logits_stride();
    const std::vector<float> all = test::download_act(be.get(), net->logits(), size_t(n) * ldv);
    const Vec want(all.begin() + size_t(n - 1) * ldv, all.begin() + size_t(n - 1) * ldv + cfg.V);
    worst = std::max(worst, ref::rel_err(Vec(got.begin(), got.end()), want));
  }
  std::printf("decoder %s: worst rel err %.3e\n", arch->describe().c_str(), worst);
  CHECK(worst <= 1e-5);
}

// Training through the job spec at a mesh: the losses and final weights.
struct MeshRun {
  std::vector<double> losses;
  std::vector<float> weights;
};

MeshRun run_mesh(const std::string& model, int world, int tp, int pp, const std::string& strategy) {
  test::TempDir dir("qwen3_mesh");
  const std::string yaml =
      "model: " + model + "\n"
      "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
      "train: {global_batch_size: 8, micro_batch_size: 2, max_steps: 4, lr: 3.0e-3, min_lr: 3.0e-4, warmup_steps: 1,\n"
      "        eval_interval: 0, log_interval: 1, grad_clip: 0.3}\n"
      "output: {dir: '" + dir.path() + "', sample_tokens: 0}\n"
      "parallel: {sharding: " + strategy + ", tensor_parallel: " + std::to_string(tp) +
      ", pipeline_parallel: " + std::to_string(pp) + ", timeout_s: 60}\n";
  const JobSpec job = parse_job_spec(yaml, "job.yaml", {});
  MeshRun out;
  out.losses = test::run_ranks_inprocess(job, world)[0].losses;
  (void)load_model_safetensors(dir / "model.safetensors", out.weights);
  return out;
}

void check_same_run(const MeshRun& got, const MeshRun& want) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    INFO("step " << i + 1 << ": " << got.losses[i] << " vs " << want.losses[i]);
    CHECK(std::fabs(got.losses[i] - want.losses[i]) <= 1e-5 * std::fabs(want.losses[i]));
  }
  REQUIRE(got.weights.size() == want.weights.size());
  const double e = ref::rel_err(Vec(got.weights.begin(), got.weights.end()), Vec(want.weights.begin(), want.weights.end()));
  INFO("final weights rel err " << e);
  CHECK(e <= 1e-5);
}

}  // namespace

// ---- model.head_dim on the Llama network ---------------------------------------------------

TEST_CASE("head_dim: a Llama with heads wider and narrower than C/NH matches transformers", "[qwen3][head_dim][hf]") {
  // 4 heads of 12 on C 32 (attention width 48 > C), GQA 2:1, untied; 4 heads
  // of 6 (24 < C), GQA 4:1, tied.
  check_against_hf({"llama-head-dim", 2, 32, 4, 2, 12, 40, 37, 9, false});
  check_against_hf({"llama-head-dim", 2, 32, 4, 1, 6, 40, 37, 9, true});
}

TEST_CASE("head_dim: export, init_from and greedy generate agree with transformers", "[qwen3][head_dim][hf]") {
  check_interop({"llama-head-dim", 2, 32, 4, 2, 12, 40, 37, 12, false});
}

TEST_CASE("head_dim: the decoder equals the full forward, and the arena estimate is the network's", "[qwen3][head_dim]") {
  for (const int hd : {12, 6}) {
    ModelConfig c = config_of({"llama-head-dim", 2, 32, 4, 2, hd, 40, 37, 12, hd == 6});
    check_decoder(c);
    const auto arch = make_model_arch(c);
    auto be = make_cpu_backend(1);
    for (bool ckpt : {false, true})
      for (int B : {1, 3}) {
        auto net = arch->make_network(be.get(), B, ckpt);
        CHECK(arch->activation_bytes(B, ckpt, ActivationDevice{4, true, 1}) == double(net->activation_bytes()));
      }
  }
}

TEST_CASE("head_dim: tp2 and tp2 x dp2 train as one rank does", "[qwen3][head_dim][tp]") {
  const std::string model = "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, head_dim: 6, ffn_dim: 24, "
                            "vocab_size: 23, seq_len: 8, tie_embeddings: false}";
  const MeshRun one = run_mesh(model, 1, 1, 1, "no_shard");
  REQUIRE(one.losses.size() == 4);
  CHECK(one.losses.back() < one.losses.front());
  {
    INFO("tp2");
    check_same_run(run_mesh(model, 2, 2, 1, "no_shard"), one);
  }
  {
    INFO("tp2 x dp2 full_shard");
    check_same_run(run_mesh(model, 4, 2, 1, "full_shard"), one);
  }
}

TEST_CASE("head_dim: config.json, our metadata and the job spec carry it; bad values are refused", "[qwen3][head_dim]") {
  ModelConfig c = config_of({"llama-head-dim", 2, 32, 4, 2, 12, 40, 37, 12, false});
  const auto arch = make_model_arch(c);
  CHECK(arch->layout().get("model.layers.0.self_attn.q_proj.weight").shape == std::vector<int64_t>{48, 32});
  CHECK(arch->layout().get("model.layers.0.self_attn.k_proj.weight").shape == std::vector<int64_t>{24, 32});
  CHECK(arch->layout().get("model.layers.0.self_attn.o_proj.weight").shape == std::vector<int64_t>{32, 48});
  CHECK(arch->hf_config_json()["head_dim"] == 12);
  const ModelConfig back = config_from_file_metadata(arch->file_metadata(), "m.safetensors");
  CHECK(back.head_dim == 12);
  CHECK(arch->manifest_model()["head_dim"] == 12);
  // The default spelled out is the default: older files and manifests stay equal.
  c.head_dim = 8;
  CHECK(make_model_arch(c)->file_metadata().count("head_dim") == 0);
  CHECK(manifest_model_mismatch(*make_model_arch(c), make_model_arch(config_of({"llama-head-dim", 2, 32, 4, 2, 0, 40,
                                                                                37, 12, false}))->manifest_model()) == "");
  CHECK_THAT(manifest_model_mismatch(*make_model_arch(c), arch->manifest_model()), Contains("model.head_dim = 12"));
  // The job spec: model.head_dim.
  const JobSpec job = parse_job_spec("model: {arch: llama, n_layer: 1, n_head: 4, n_embd: 32, head_dim: 12, ffn_dim: 8}\n"
                                     "data: {format: synthetic}\n", "job.yaml", {});
  CHECK(ModelConfig::from_spec(job.model).head_size() == 12);
  CHECK(ModelConfig::from_spec(job.model).to_spec().head_dim == 12);
  c.head_dim = 7;
  CHECK_THROWS_WITH(make_model_arch(c), Contains("model.head_dim") && Contains("7") && Contains("even"));
  c.head_dim = 0;
  c.C = 30;
  CHECK_THROWS_WITH(make_model_arch(c), Contains("model.n_embd") && Contains("model.head_dim"));
  c.head_dim = 6;
  CHECK_NOTHROW(make_model_arch(c));
  ModelConfig g = ModelConfig::of(1, 4, 32, 37, 8);
  g.head_dim = 12;
  CHECK_THROWS_WITH(make_model_arch(g), Contains("model.head_dim") && Contains("gpt2"));
}
