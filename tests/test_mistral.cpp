// Mistral (core/model/mistral/: Llama's network with a sliding window on
// every layer) against transformers 4.44.2's MistralForCausalLM with eager
// attention (scripts/reference/hf_mistral.py), in fp32 on tiny random models
// whose every parameter is perturbed, always with sequences longer than the
// window (T = 24, sliding_window 7; 12 and 5 in the multi-rank runs):
//  - logits, loss and every parameter gradient, also with head_dim != C/NH;
//  - document masks: a packed sequence's logits are each document's alone;
//  - the KV-cached decoder: a ring of W rows per layer, its logits the full
//    forward's at every position past the window;
//  - model.init_from with model.arch auto (bit for bit), greedy `generate`
//    for more tokens than the window against transformers' greedy generate,
//    an export that from_pretrained reloads with our logits, the window in
//    trainrun's own files;
//  - 1 rank equals dp2 (full_shard), tp2 and pp2 over 4 steps;
//  - config.json and job specs that ask for what is not implemented, or
//    disagree about the window, are refused by name;
//  - the preset is a mistral and `plan` plans it.
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
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

const char* kScript = "hf_mistral.py";

// The families' shared helpers (tests/support/hf_reference.h).
using test::random_tokens;
using test::write_token_batch;
std::vector<int32_t> rand_tokens(size_t n, int V, uint64_t seed) { return random_tokens(n, V, seed); }
std::vector<float> f32_of(const SafeTensorFile& f, const std::string& name, const std::string& path) {
  return test::tensor_f32(f, name, path);
}
std::vector<float> hf_flat(const ModelArch& arch, const std::string& dir) { return test::flat_from_hf(arch, dir); }

struct Shape {
  int L = 2, NH = 4, NKV = 2, C = 32, F = 40, V = 37, T = 24, window = 7, head_dim = 0;
};

ModelConfig config_of(const Shape& s) {
  ModelConfig c;
  c.arch = "mistral";
  c.L = s.L, c.NH = s.NH, c.NKV = s.NKV, c.C = s.C, c.F = s.F, c.V = s.V, c.T = s.T;
  c.head_dim = s.head_dim;
  c.sliding_window = s.window;
  c.tied = false;
  c.norm_eps = 1e-5;
  c.rope_theta = 1e6;
  return c;
}

// `hf_mistral.py random` into DIR (with --batch: the reference pass too).
void hf_random(const std::string& dir, const Shape& s, const std::string& batch = "", const std::string& out_ref = "") {
  char args[768];
  std::snprintf(args, sizeof args,
                "random --out '%s' --layers %d --hidden %d --heads %d --kv-heads %d --intermediate %d --vocab %d "
                "--max-positions %d --window %d --head-dim %d --seed 5",
                dir.c_str(), s.L, s.C, s.NH, s.NKV, s.F, s.V, s.T, s.window, s.head_dim);
  std::string a = args;
  if (!batch.empty()) a += " --batch '" + batch + "' --out-ref '" + out_ref + "'";
  const test::RunResult r = test::run_reference_script(kScript, a);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
}

// Our logits (B,T,V) with a document mask (doc_start per row; pos = t - doc_start).
std::vector<float> masked_logits(const ModelArch& arch, const std::vector<float>& params, const std::vector<int32_t>& in,
                                 const std::vector<int32_t>& doc_start, int B, int T) {
  auto be = make_cpu_backend(2);
  auto net = arch.make_network(be.get(), B, false);
  const ParamLayout& lay = arch.layout();
  DeviceBuffer p = test::upload_act(be.get(), params), g(be.get(), size_t(lay.total) * 4);
  std::vector<int32_t> pos(in.size());
  for (size_t i = 0; i < in.size(); ++i) pos[i] = int32_t(i % size_t(T)) - doc_start[i];
  DeviceBuffer din = test::upload_i32(be.get(), in), dds = test::upload_i32(be.get(), doc_start),
               dpos = test::upload_i32(be.get(), pos);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  net->forward(units, din.as<int32_t>(), nullptr, B, T, false, 1.0f, DocumentMask{dds.as<int32_t>(), dpos.as<int32_t>()});
  return test::download_act(be.get(), net->logits(), size_t(B) * T * arch.config().V);
}

}  // namespace

TEST_CASE("mistral: logits, loss and every gradient match transformers' MistralForCausalLM past the window",
          "[mistral][hf]") {
  Shape gqa;
  Shape nemo;  // Nemo's kind: head_dim (12) not C/NH (8), one KV head
  nemo.NKV = 1;
  nemo.head_dim = 12;
  for (const Shape& s : {gqa, nemo}) {
    const ModelConfig cfg = config_of(s);
    const auto arch = make_model_arch(cfg);
    INFO(arch->describe());
    std::printf("%s\n", arch->describe().c_str());
    const int B = 2, T = s.T, V = s.V;
    test::TempDir dir("mistral_hf");
    const std::vector<int32_t> in = rand_tokens(size_t(B) * T, V, 11), tg = rand_tokens(size_t(B) * T, V, 12);
    write_token_batch(dir / "batch.safetensors", in, tg, B, T);
    hf_random(dir / "model", s, dir / "batch.safetensors", dir / "ref.safetensors");
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
    // (A forward for backward leaves dlogits in the logits buffer.)
    net->forward(units, din.as<int32_t>(), dtg.as<int32_t>(), B, T, true, 1.0f / float(B * T));
    net->backward(units);
    const std::vector<float> losses = test::download_f32(be.get(), net->losses(), size_t(B) * T);
    const std::vector<float> grads = test::download_f32(be.get(), g.get(), size_t(lay.total));

    const std::string rpath = dir / "ref.safetensors";
    const SafeTensorFile ref = read_safetensors(rpath);
    const std::vector<float> hf_logits = f32_of(ref, "logits", rpath);
    const double logit_err = test::rel_err(logits, hf_logits);
    double loss = 0;
    for (float x : losses) loss += x;
    loss /= double(losses.size());
    const double hf_loss = f32_of(ref, "loss", rpath)[0];
    std::printf("  logits rel err %.3e, loss %.6f (HF %.6f) rel err %.3e\n", logit_err, loss, hf_loss,
                std::abs(loss - hf_loss) / hf_loss);
    CHECK(logit_err <= 1e-5);
    CHECK(std::abs(loss - hf_loss) / hf_loss <= 1e-5);
    double worst = 0;
    for (const auto& t : lay.tensors) {
      const std::vector<float> want = f32_of(ref, "grad." + arch->hf_tensor(t).name, rpath);
      REQUIRE(int64_t(want.size()) == t.numel);
      const std::vector<float> got(grads.begin() + t.offset, grads.begin() + t.offset + t.numel);
      const double e = test::rel_err(got, want);
      worst = std::max(worst, e);
      INFO(t.name);
      CHECK(e <= 1e-5);
    }
    std::printf("  worst gradient rel err %.3e over %zu tensors\n", worst, lay.tensors.size());
    // The window bites: the same weights without it give other logits.
    ModelConfig full = cfg;
    full.sliding_window = 0;
    const double unwindowed = test::rel_err(test::logits_of(*make_model_arch(full), params, in, B, T), hf_logits);
    std::printf("  without the window: logits rel err %.3e\n", unwindowed);
    CHECK(unwindowed > 1e-2);
  }
}

TEST_CASE("mistral: with document masks a packed sequence's logits are each document's alone in transformers",
          "[mistral][hf][document_mask]") {
  const Shape s;  // window 7, T 24: documents of 15 and 9 rows, both longer than the window
  const auto arch = make_model_arch(config_of(s));
  test::TempDir dir("mistral_docs");
  hf_random(dir / "model", s);
  const std::vector<float> params = hf_flat(*arch, dir / "model");
  const int T = s.T, split = 15;
  const std::vector<int32_t> in = rand_tokens(size_t(T), s.V, 21);
  std::vector<int32_t> ds(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) ds[size_t(t)] = t < split ? 0 : split;
  const std::vector<float> ours = masked_logits(*arch, params, in, ds, 1, T);
  const std::vector<int32_t> a(in.begin(), in.begin() + split), b(in.begin() + split, in.end());
  std::vector<float> theirs = test::hf_logits_of(kScript, dir / "model", a, 1, split, dir);
  const std::vector<float> second = test::hf_logits_of(kScript, dir / "model", b, 1, T - split, dir);
  theirs.insert(theirs.end(), second.begin(), second.end());
  const double e = test::rel_err(ours, theirs);
  std::printf("  packed [15 | 9] vs each alone: logits rel err %.3e\n", e);
  CHECK(e <= 1e-5);
}

TEST_CASE("mistral: the decoder's cache is a ring of W rows and its logits are the full forward's", "[mistral][decoder]") {
  const Shape s;
  const auto arch = make_model_arch(config_of(s));
  const ParamLayout& lay = arch->layout();
  std::vector<float> params(size_t(lay.total));
  arch->init_params(3, 0, lay.total, params.data());
  std::mt19937_64 gen(8);
  std::normal_distribution<float> d(0.f, 0.05f);
  for (float& x : params) x += d(gen);  // away from the init's symmetries
  const int T = s.T, V = s.V;
  const std::vector<int32_t> seq = rand_tokens(size_t(T), V, 4);
  const std::vector<float> full = test::logits_of(*arch, params, seq, 1, T);
  auto be = make_cpu_backend(2);
  // The cache holds W = 7 positions per layer, not the capacity's 24.
  ModelConfig unwindowed = config_of(s);
  unwindowed.sliding_window = 0;
  const int64_t kv_row = int64_t(s.NKV) * (s.C / s.NH) * 4;  // one position's k (or v) of one layer, fp32
  CHECK(int64_t(make_model_arch(unwindowed)->decoder_bytes_needed(*be, T)) -
            int64_t(arch->decoder_bytes_needed(*be, T)) ==
        int64_t(s.L) * 2 * (T - s.window) * kv_row);
  auto dec = arch->make_decoder(be.get(), T);
  DeviceBuffer p = test::upload_act(be.get(), params);
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  FlatUnitAccess units(lay, p.get(), g.as<float>(), be->act_dtype());
  const int prefill = 10;  // longer than the ring: its first queries need keys the chunk overwrites
  std::vector<float> got;
  dec->feed(units, seq.data(), prefill, got);
  double worst = 0;
  for (int t = prefill - 1; t < T; ++t) {
    if (t >= prefill) dec->feed(units, seq.data() + t, 1, got);
    const std::vector<float> want(full.begin() + size_t(t) * V, full.begin() + size_t(t + 1) * V);
    INFO("position " << t);
    worst = std::max(worst, test::rel_err(got, want));
    CHECK(test::rel_err(got, want) <= 1e-5);
  }
  std::printf("  decoder vs forward, positions %d..%d: worst logits rel err %.3e\n", prefill - 1, T - 1, worst);
}

namespace {

// A job on `hf_random(dir, mesh_shape())`'s directory.
Shape mesh_shape() {
  Shape s;
  s.NKV = 1, s.C = 16, s.F = 24, s.V = 29, s.T = 12, s.window = 5;
  return s;
}
std::string mistral_job(const std::string& hf, const std::string& out, const std::string& arch, int steps,
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

TEST_CASE("mistral: init_from (arch auto) bit for bit, greedy generate past the window and export against transformers",
          "[mistral][hf][init_from]") {
  test::TempDir dir("mistral_init");
  const std::string hf = dir / "hf";
  Shape s = mesh_shape();
  s.T = 32;  // room to generate 5 + 20 tokens, the window 5
  hf_random(hf, s);
  const std::string run = dir / "run";
  // lr 1e-30: one real optimizer step that cannot move a weight of ~0.1.
  JobSpec job = parse_job_spec(mistral_job(hf, run, "auto", 1, "sharding: full_shard, ", "1.0e-30"), "job.yaml", {});
  resolve_model_shape(job, false);  // config.json's shape, as the launcher resolves it before the workers start
  CHECK(job.model.sliding_window == 5);
  const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
  REQUIRE(arch->name() == "mistral");
  CHECK(arch->config().sliding_window == 5);
  const std::vector<float> want = hf_flat(*arch, hf);
  const std::vector<float> loaded = load_init_from(job.model);
  REQUIRE(loaded.size() == want.size());
  CHECK(std::memcmp(loaded.data(), want.data(), want.size() * 4) == 0);
  (void)test::run_ranks_inprocess(job, 2);
  std::vector<float> trained;
  const ModelConfig saved = load_model_safetensors(run + "/model.safetensors", trained);
  CHECK(saved.arch == "mistral");
  CHECK(saved.sliding_window == 5);  // the window is in trainrun's own files
  REQUIRE(trained.size() == want.size());
  CHECK(std::memcmp(trained.data(), want.data(), want.size() * 4) == 0);

  // Greedy generate: 20 new tokens after a prompt of 5, four windows' worth, through the ring cache.
  test::check_cli_generate_equals_hf(kScript, hf, run, "5 17 2 28 0", 20);

  // Export, then from_pretrained: transformers' logits are ours.
  const nlohmann::json c = test::check_cli_export_equals_hf(kScript, *arch, trained, run, dir / "export", 29, dir);
  CHECK(c["model_type"] == "mistral");
  CHECK(c["architectures"][0] == "MistralForCausalLM");
  CHECK(c["sliding_window"] == 5);
}

TEST_CASE("mistral: dp2 (full_shard), tp2 and pp2 train as one rank does with seq_len past the window",
          "[mistral][tp][pp]") {
  test::TempDir dir("mistral_mesh");
  const std::string hf = dir / "hf";
  hf_random(hf, mesh_shape());
  {  // The job resolves the window from config.json: every run below is windowed.
    JobSpec job = parse_job_spec(mistral_job(hf, dir / "probe", "mistral", 4, ""), "job.yaml", {});
    resolve_model_shape(job, false);
    REQUIRE(job.model.sliding_window == 5);
  }
  auto run = [&](const std::string& name, int world, const std::string& parallel) {
    return test::train_mesh(mistral_job(hf, dir / name, "mistral", 4, parallel), world);
  };
  const test::MeshRun ref = run("one", 1, "sharding: no_shard, ");
  REQUIRE(ref.losses.size() == 4);
  test::check_same_run("dp2", run("dp2", 2, "sharding: full_shard, "), ref);
  test::check_same_run("tp2", run("tp2", 2, "sharding: no_shard, tensor_parallel: 2, "), ref);
  test::check_same_run("pp2", run("pp2", 2, "sharding: no_shard, pipeline_parallel: 2, pipeline_schedule: 1f1b, "), ref);
}

TEST_CASE("mistral: config.json and job specs that ask for what is not implemented are refused by name",
          "[mistral][hf]") {
  test::TempDir dir("mistral_refuse");
  auto write = [&](const std::string& name, const nlohmann::json& extra) {
    nlohmann::json c = {{"model_type", "mistral"}, {"num_hidden_layers", 2}, {"hidden_size", 16},
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
  // MistralConfig's defaults: a 4096 window when the key is absent, none when null.
  const ModelConfig dflt = read_hf_model_config(write("default", {}), "x");
  CHECK(dflt.arch == "mistral");
  CHECK(dflt.sliding_window == 4096);
  CHECK(dflt.norm_eps == 1e-6);
  CHECK(read_hf_model_config(write("null", {{"sliding_window", nullptr}}), "x").sliding_window == 0);
  CHECK(read_hf_model_config(write("nkv", {{"num_key_value_heads", nullptr}, {"num_attention_heads", 16}}), "x").NKV ==
        8);
  CHECK_THAT(error(write("zero", {{"sliding_window", 0}})),
             Contains("sliding_window is not a positive integer or null: 0"));
  CHECK_THAT(error(write("text", {{"sliding_window", "4096"}})),
             Contains("sliding_window is not a positive integer or null: \"4096\""));
  CHECK_THAT(error(write("rope", {{"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}})),
             Contains("rope_scaling = {") && Contains("trainrun's Mistral needs none"));
  CHECK_THAT(error(write("dropout", {{"attention_dropout", 0.1}})), Contains("attention_dropout = 0.1"));
  CHECK_THAT(error(write("act", {{"hidden_act", "gelu"}})), Contains("hidden_act = \"gelu\""));

  // A job spec's window: only mistral has one, and it must be the directory's.
  const std::string base = "data: {format: synthetic, synthetic: {vocab: 29}}\n";
  CHECK_THROWS_WITH(ModelConfig::from_spec(
                        parse_job_spec(base + "model: {arch: llama, ffn_dim: 64, sliding_window: 8}\n", "j.yaml", {}).model),
                    Contains("model.sliding_window: 8; llama has no sliding window"));
  JobSpec job = parse_job_spec(base + "model: {arch: mistral, init_from: '" + write("w8", {{"sliding_window", 8}}) +
                                   "', sliding_window: 6, seq_len: 16}\n",
                               "j.yaml", {});
  CHECK_THROWS_WITH(resolve_model_shape(job, false), Contains("model.sliding_window") && Contains("6") && Contains("8"));
  ModelConfig neg = config_of(Shape{});
  neg.sliding_window = -1;
  CHECK_THROWS_WITH(make_model_arch(neg), Contains("model.sliding_window: -1 must be 0"));
}

TEST_CASE("mistral: the preset is a mistral and plan plans it", "[mistral][plan]") {
  // Its parameter count is the published one: test_config's "every preset has ...".
  const ModelPreset* preset = find_model_preset("mistral-7b-v0.3");
  REQUIRE(preset);
  const auto arch = make_model_arch(ModelConfig::from_spec(preset->spec));
  CHECK(arch->name() == "mistral");
  CHECK(arch->config().sliding_window == 0);  // v0.3's config.json: sliding_window null
  CHECK(arch->config().rope_theta == 1e6);
  const test::RunResult r = test::run_trainrun("plan --model mistral-7b-v0.3 --gpus 8");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("mistral L=32 C=4096 heads=32 kv_heads=8 ffn=14336 V=32768"));
}
