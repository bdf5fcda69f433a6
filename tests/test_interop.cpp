// Hugging Face interop (`trainrun export`, model.init_from) against the real
// transformers package (the repo's .venv, scripts/reference/hf_gpt2.py):
// export -> import is bit-exact; GPT2LMHeadModel.from_pretrained loads an
// export cleanly and computes our logits; a save_pretrained directory loads
// with model.init_from and computes transformers' logits, through a real
// multi-rank training job; bad directories get errors that name the problem.
// Also `trainrun bench checkpoint` end to end on a tiny model.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/checkpoint/bench_checkpoint.h"
#include "core/checkpoint/hf_interop.h"
#include "core/io/safetensors.h"
#include "core/model/gpt2/gpt2.h"
#include "core/model/model_io.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/sharding.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

GPT2Config small_cfg(int L, int NH, int C, int V, int T) { return GPT2Config::of(L, NH, C, V, T); }

// Every parameter random (LayerNorm gains around 1), so a transposed or
// swapped tensor cannot go unnoticed.
std::vector<float> random_flat(const GPT2Config& cfg, unsigned seed) {
  const ParamLayout lay = make_gpt2_layout(cfg);
  std::vector<float> flat(size_t(lay.total));
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.1f);
  for (const auto& t : lay.tensors) {
    const bool gain = t.name.find("ln_") != std::string::npos && t.name.find(".weight") != std::string::npos;
    for (int64_t i = 0; i < t.numel; ++i) flat[size_t(t.offset + i)] = (gain ? 1.0f : 0.0f) + n(rng);
  }
  return flat;
}

std::vector<int32_t> random_tokens(int n, int V, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int32_t(rng() % unsigned(V));
  return v;
}

void write_batch(const std::string& path, const std::vector<int32_t>& inputs, int B, int T) {
  SafeTensorFile f;
  f.tensors.push_back(make_tensor("inputs", "I32", {B, T}, inputs.data()));
  write_safetensors(path, f);
}

// Our logits (B,T,V) from GPT2::forward over a no_shard ParamStore.
std::vector<float> cpp_logits(const GPT2Config& cfg, const std::vector<float>& flat, const std::vector<int32_t>& in,
                              int B) {
  auto be = make_cpu_backend();
  auto comm = make_single_communicator();
  GPT2 model(cfg, be.get(), B, false);
  auto store = make_param_store("no_shard", model.layout(), be.get(), comm.get(), 0, nullptr);
  store->load_full_params(flat);
  DeviceBuffer din(be.get(), in.size() * 4);
  be->copy_to_device(din.get(), in.data(), in.size() * 4);
  model.forward(*store, din.as<int32_t>(), nullptr, B, cfg.T, false, 0.0f);
  std::vector<float> logits(in.size() * size_t(cfg.V));
  be->copy_to_host(logits.data(), model.logits(), logits.size() * 4);
  return logits;
}

using test::rel_err;

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

using test::hf_python;

test::RunResult hf_script(const std::string& args) {
  return test::run_command("HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 '" + hf_python() + "' '" + test::source_dir() +
                           "/scripts/reference/hf_gpt2.py' " + args);
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

std::string load_error(const ModelSpec& m) {
  try {
    load_init_from(m);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

ModelSpec spec_for(const GPT2Config& c, const std::string& dir) {
  ModelSpec m;
  m.n_layer = c.L;
  m.n_head = c.NH;
  m.n_embd = c.C;
  m.vocab_size = c.V;
  m.seq_len = c.T;
  m.init_from = dir;
  return m;
}

std::string job_yaml(const std::string& run, const std::string& init_from, int max_steps, int nproc,
                     const std::string& sharding = "full_shard") {
  return "model: {n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 37, seq_len: 12, init_from: '" + init_from + "'}\n"
         "data: {format: synthetic, synthetic: {vocab: 37, branching: 3}}\n"
         // lr 1e-30: one real optimizer step that cannot move an fp32 weight
         // of size ~0.1, so the final weights must be exactly the loaded ones.
         "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: " + std::to_string(max_steps) +
         ", lr: 1.0e-30, min_lr: 0, warmup_steps: 0, schedule: constant, weight_decay: 0, grad_clip: 0,\n"
         "        eval_steps: 1, log_interval: 1}\n"
         "output: {dir: '" + run + "', sample_tokens: 0}\n"
         "parallel: {nproc_per_node: " + std::to_string(nproc) + ", sharding: " + sharding + ", timeout_s: 60}\n";
}

}  // namespace

TEST_CASE("interop: export then import is bit-identical and uses the Hugging Face layout", "[interop]") {
  test::TempDir dir("interop");
  const GPT2Config cfg = small_cfg(2, 2, 16, 37, 9);
  const std::vector<float> flat = random_flat(cfg, 1);
  const std::string out = dir / "hf";
  export_hf(out, cfg, flat);

  const json c = read_json(out + "/config.json");
  CHECK(c["model_type"] == "gpt2");
  CHECK(c["architectures"] == json::array({"GPT2LMHeadModel"}));
  CHECK(c["n_layer"] == 2);
  CHECK(c["n_head"] == 2);
  CHECK(c["n_embd"] == 16);
  CHECK(c["vocab_size"] == 37);
  CHECK(c["n_positions"] == 9);
  CHECK(c["n_ctx"] == 9);
  CHECK(c["activation_function"] == "gelu_new");
  CHECK(c["layer_norm_epsilon"].get<double>() == 1e-5);
  CHECK(c["tie_word_embeddings"] == true);
  CHECK(c["scale_attn_weights"] == true);
  CHECK(c["resid_pdrop"].get<double>() == 0.0);
  CHECK(c["bos_token_id"].is_null());  // a 37-token vocab has no <|endoftext|> at 50256

  // Conv1D layout: HF's (in, out) is the transpose of our (out, in).
  const SafeTensorFile f = read_safetensors(out + "/model.safetensors");
  CHECK(f.metadata.at("format") == "pt");
  CHECK(f.find("lm_head.weight") == nullptr);  // tied to wte, as save_pretrained writes it
  const ParamLayout lay = make_gpt2_layout(cfg);
  CHECK(f.tensors.size() == lay.tensors.size());
  for (const char* name : {"transformer.h.1.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                           "transformer.h.1.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"}) {
    INFO(name);
    const ParamTensor& t = lay.get(name);
    const SafeTensor* st = f.find(name);
    REQUIRE(st);
    REQUIRE(st->shape == std::vector<int64_t>{t.shape[1], t.shape[0]});
    const std::vector<float> v = st->as_f32();
    bool ok = true;
    for (int64_t i = 0; i < t.shape[0]; ++i)
      for (int64_t j = 0; j < t.shape[1]; ++j)
        ok = ok && v[size_t(j * t.shape[0] + i)] == flat[size_t(t.offset + i * t.shape[1] + j)];
    CHECK(ok);
  }
  CHECK(f.find("transformer.wte.weight")->shape == std::vector<int64_t>{37, 16});

  std::vector<float> back;
  const GPT2Config cfg2 = load_hf(out, back);
  CHECK(cfg2.L == cfg.L);
  CHECK(cfg2.NH == cfg.NH);
  CHECK(cfg2.C == cfg.C);
  CHECK(cfg2.V == cfg.V);
  CHECK(cfg2.T == cfg.T);
  CHECK(bit_equal(back, flat));

  SECTION("a second export replaces the first") {
    const std::vector<float> other = random_flat(cfg, 2);
    export_hf(out, cfg, other);
    load_hf(out, back);
    CHECK(bit_equal(back, other));
    for (const auto& e : fs::directory_iterator(dir.path()))  // no temporary or moved-aside folder left
      CHECK(e.path().filename() == "hf");
  }
  SECTION("a directory holding anything else is refused, not deleted") {
    test::write_file(out + "/notes.txt", "mine");
    try {
      export_hf(out, cfg, flat);
      FAIL("export into a directory with other files succeeded");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Contains("notes.txt") && Contains("choose a new or empty directory"));
    }
    CHECK(test::read_file(out + "/notes.txt") == "mine");
  }
}

TEST_CASE("interop: trainrun export writes a Hugging Face directory from a run or a checkpoint", "[interop]") {
  test::TempDir dir("interop");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml",
                   "model: {n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 37, seq_len: 12}\n"
                   "data: {format: synthetic, synthetic: {vocab: 37, branching: 3}}\n"
                   "train: {global_batch_size: 4, micro_batch_size: 4, max_steps: 3, warmup_steps: 0, eval_steps: 1}\n"
                   "output: {dir: '" + run + "', sample_tokens: 0}\n");
  auto r = test::run_command("OMP_NUM_THREADS=2 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string ck = run + "/checkpoints/step_00000003";
  REQUIRE(test::file_exists(ck + "/model.safetensors"));
  std::vector<float> ours;
  const GPT2Config cfg = load_model_safetensors(ck + "/model.safetensors", ours);

  // A run directory means its latest checkpoint.
  r = test::run_trainrun("export --checkpoint '" + run + "' --format safetensors --out '" + dir / "hf" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out == dir / "hf" + "\n");
  std::vector<float> back;
  const GPT2Config c2 = load_hf(dir / "hf", back);
  CHECK(c2.T == cfg.T);
  CHECK(bit_equal(back, ours));
  // A .safetensors file too (the run's final weights: the same step here).
  r = test::run_trainrun("export --checkpoint '" + run + "/model.safetensors' --out '" + dir / "hf2" + "'");
  REQUIRE(r.exit_code == 0);
  load_hf(dir / "hf2", back);
  CHECK(bit_equal(back, ours));

  // Usage errors exit 2, errors 1 with the reason.
  r = test::run_trainrun("export --checkpoint '" + run + "' --format pytorch --out '" + dir / "x" + "'");
  CHECK(r.exit_code == 2);
  r = test::run_trainrun("export --checkpoint '" + dir / "nope" + "' --out '" + dir / "x" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("does not exist"));
  // A damaged checkpoint is not exported.
  {
    std::fstream f(ck + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  r = test::run_trainrun("export --checkpoint '" + ck + "' --out '" + dir / "x" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("export: checkpoint '" + ck + "' is damaged") && Contains("checksum"));
  CHECK(!test::file_exists(dir / "x"));
  // Nor sampled from: generate checks the same checksums (directly, and
  // through the run directory whose latest it is).
  for (const std::string& where : {ck, run}) {
    r = test::run_trainrun("generate --checkpoint '" + where + "' --prompt hi --max-tokens 4");
    INFO(where);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("generate: checkpoint '" + ck + "' is damaged") && Contains("checksum"));
    CHECK(r.out.empty());
  }
}

TEST_CASE("interop: transformers loads the export and reproduces trainrun's logits", "[interop][transformers]") {
  test::TempDir dir("interop");
  // Odd sizes: 3 heads of 8, a vocab and context that are not powers of two.
  const GPT2Config cfg = small_cfg(3, 3, 24, 61, 13);
  const std::vector<float> flat = random_flat(cfg, 3);
  export_hf(dir / "hf", cfg, flat);
  const int B = 3;
  const std::vector<int32_t> in = random_tokens(B * cfg.T, cfg.V, 4);
  write_batch(dir / "batch.safetensors", in, B, cfg.T);
  auto r = hf_script("logits --model '" + dir / "hf" + "' --batch '" + dir / "batch.safetensors" + "' --out '" +
                     dir / "logits.safetensors" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::vector<float> theirs = read_safetensors(dir / "logits.safetensors").find("logits")->as_f32();
  const std::vector<float> ours = cpp_logits(cfg, flat, in, B);
  const double e = rel_err(ours, theirs);
  INFO("relative error of the logits, trainrun vs transformers: " << e);
  CHECK(e <= 1e-4);
}

TEST_CASE("interop: a save_pretrained model loads with model.init_from and gives transformers' logits",
          "[interop][transformers]") {
  test::TempDir dir("interop");
  const std::string hf = dir / "hf";
  const GPT2Config cfg = small_cfg(2, 2, 16, 37, 12);
  const int B = 2;
  const std::vector<int32_t> in = random_tokens(B * cfg.T, cfg.V, 5);
  write_batch(dir / "batch.safetensors", in, B, cfg.T);
  auto r = hf_script("random --out '" + hf + "' --n-layer 2 --n-head 2 --n-embd 16 --vocab 37 --n-positions 12 "
                     "--seed 7 --batch '" + dir / "batch.safetensors" + "' --logits '" + dir / "logits.safetensors" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE(test::file_exists(hf + "/model.safetensors"));

  // The loader alone.
  const std::vector<float> flat = load_init_from(spec_for(cfg, hf));
  const std::vector<float> theirs = read_safetensors(dir / "logits.safetensors").find("logits")->as_f32();
  const double e = rel_err(cpp_logits(cfg, flat, in, B), theirs);
  INFO("relative error of the logits, trainrun vs transformers: " << e);
  CHECK(e <= 1e-4);

  // Through a real job: 2 ranks, full_shard, one step that cannot move the
  // weights; then export the result: the tensors equal transformers' file.
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job_yaml(run, hf, 1, 2));
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("model.init_from: initial weights from"));
  std::vector<float> trained;
  load_model_safetensors(run + "/model.safetensors", trained);
  CHECK(bit_equal(trained, flat));
  r = test::run_trainrun("export --checkpoint '" + run + "' --out '" + dir / "back" + "'");
  REQUIRE(r.exit_code == 0);
  const SafeTensorFile a = read_safetensors(hf + "/model.safetensors"), b = read_safetensors(dir / "back/model.safetensors");
  for (const auto& t : a.tensors) {
    INFO(t.name);
    const SafeTensor* u = b.find(t.name);
    REQUIRE(u);
    CHECK(u->shape == t.shape);
    CHECK(u->data == t.data);
  }

  // Each rank reads only the ranges it holds, under every strategy that
  // splits them differently: the loaded weights are the same.
  for (const auto& [sharding, ranks] : std::vector<std::pair<std::string, int>>{{"shard_grad_op", 3}, {"no_shard", 2}}) {
    INFO(sharding << " over " << ranks << " ranks");
    const std::string run2 = dir / ("run_" + sharding);
    test::write_file(dir / "job_s.yaml", job_yaml(run2, hf, 1, ranks, sharding));
    r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job_s.yaml" +
                          "' --set train.global_batch_size=" + std::to_string(2 * ranks));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<float> w;
    load_model_safetensors(run2 + "/model.safetensors", w);
    CHECK(bit_equal(w, flat));
  }

  // A resumed checkpoint takes precedence over init_from (and says so).
  test::write_file(dir / "job.yaml", job_yaml(run, hf, 2, 1));
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("resume: loaded") && Contains("model.init_from: not used"));
}

TEST_CASE("interop: model.init_from accepts the variants transformers writes", "[interop]") {
  test::TempDir dir("interop");
  const GPT2Config cfg = small_cfg(2, 2, 16, 37, 12);
  const std::vector<float> flat = random_flat(cfg, 8);
  const std::string base = dir / "base";
  export_hf(base, cfg, flat);
  const SafeTensorFile st = read_safetensors(base + "/model.safetensors");
  auto variant = [&](const std::string& name, const std::function<void(SafeTensorFile&)>& edit) {
    const std::string d = dir / name;
    fs::create_directories(d);
    fs::copy_file(base + "/config.json", d + "/config.json");
    SafeTensorFile f = st;
    edit(f);
    write_safetensors(d + "/model.safetensors", f);
    return d;
  };

  SECTION("GPT2Model names (no transformer. prefix), a tied lm_head copy and the old attn.bias buffers") {
    const std::string d = variant("bare", [&](SafeTensorFile& f) {
      for (auto& t : f.tensors) t.name = t.name.substr(12);
      SafeTensor head = *f.find("wte.weight");
      head.name = "lm_head.weight";
      f.tensors.push_back(head);
      std::vector<float> mask(144, 1.0f);
      f.tensors.push_back(make_f32_tensor("h.0.attn.bias", {1, 1, 12, 12}, mask.data()));
    });
    CHECK(bit_equal(load_init_from(spec_for(cfg, d)), flat));
  }
  SECTION("a sharded save (model.safetensors.index.json)") {
    const std::string d = dir / "sharded";
    fs::create_directories(d);
    fs::copy_file(base + "/config.json", d + "/config.json");
    SafeTensorFile p1, p2;
    json idx = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
    for (size_t i = 0; i < st.tensors.size(); ++i) {
      (i % 2 ? p2 : p1).tensors.push_back(st.tensors[i]);
      idx["weight_map"][st.tensors[i].name] = i % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
    }
    p1.metadata = p2.metadata = {{"format", "pt"}};
    write_safetensors(d + "/model-00001-of-00002.safetensors", p1);
    write_safetensors(d + "/model-00002-of-00002.safetensors", p2);
    test::write_file(d + "/model.safetensors.index.json", idx.dump());
    CHECK(bit_equal(load_init_from(spec_for(cfg, d)), flat));
  }
  SECTION("half-precision weights are widened") {
    const std::string d = variant("bf16", [&](SafeTensorFile& f) {
      for (auto& t : f.tensors) {
        std::vector<uint16_t> h(size_t(t.numel()));
        const std::vector<float> v = t.as_f32();
        for (size_t i = 0; i < h.size(); ++i) {
          uint32_t u;
          std::memcpy(&u, &v[i], 4);
          h[i] = uint16_t(u >> 16);  // truncation: exactly representable back in fp32
        }
        t = make_tensor(t.name, "BF16", t.shape, h.data());
      }
    });
    const std::vector<float> got = load_init_from(spec_for(cfg, d));
    REQUIRE(got.size() == flat.size());
    for (size_t i = 0; i < got.size(); i += 97) CHECK(std::fabs(got[i] - flat[i]) <= std::fabs(flat[i]) / 64);
  }
  SECTION("model.seq_len shorter than n_positions keeps the first rows of wpe") {
    ModelSpec m = spec_for(cfg, base);
    m.seq_len = 8;
    const std::vector<float> got = load_init_from(m);
    GPT2Config shorter = cfg;
    shorter.T = 8;
    const ParamLayout from = make_gpt2_layout(cfg), to = make_gpt2_layout(shorter);
    REQUIRE(int64_t(got.size()) == to.total);
    for (const auto& t : to.tensors) {
      INFO(t.name);
      CHECK(std::memcmp(got.data() + t.offset, flat.data() + from.get(t.name).offset, size_t(t.numel) * 4) == 0);
    }
  }
}

TEST_CASE("interop: bad init_from directories are refused with errors that name the problem", "[interop][bad]") {
  test::TempDir dir("interop");
  const GPT2Config cfg = small_cfg(2, 2, 16, 37, 12);
  const std::vector<float> flat = random_flat(cfg, 9);
  const std::string good = dir / "good";
  export_hf(good, cfg, flat);
  const json config = read_json(good + "/config.json");
  const SafeTensorFile st = read_safetensors(good + "/model.safetensors");
  auto make = [&](const std::string& name, const std::function<void(json&)>& edit_config,
                  const std::function<void(SafeTensorFile&)>& edit_tensors) {
    const std::string d = dir / name;
    fs::create_directories(d);
    json c = config;
    edit_config(c);
    test::write_file(d + "/config.json", c.dump(2));
    SafeTensorFile f = st;
    edit_tensors(f);
    write_safetensors(d + "/model.safetensors", f);
    return d;
  };
  auto no_config_edit = [](json&) {};
  auto no_tensor_edit = [](SafeTensorFile&) {};
  ModelSpec m = spec_for(cfg, good);
  REQUIRE(load_error(m).empty());

  struct Case {
    const char* what;
    std::string dir;
    ModelSpec spec;
    std::vector<std::string> expect;
  };
  auto with = [&](const std::function<void(ModelSpec&)>& f, const std::string& d) {
    ModelSpec s = spec_for(cfg, d);
    f(s);
    return s;
  };
  auto same = [](ModelSpec&) {};
  const std::string no_config = dir / "no_config";
  fs::create_directories(no_config);
  fs::copy_file(good + "/model.safetensors", no_config + "/model.safetensors");
  const std::string bin_only = dir / "bin_only";
  fs::create_directories(bin_only);
  fs::copy_file(good + "/config.json", bin_only + "/config.json");
  test::write_file(bin_only + "/pytorch_model.bin", "PK");
  // Our own (nn.Linear layout) weights under HF's config: the classic mix-up.
  const std::string linear = dir / "linear";
  fs::create_directories(linear);
  fs::copy_file(good + "/config.json", linear + "/config.json");
  save_model_safetensors(linear + "/model.safetensors", cfg, flat);

  std::vector<Case> cases = {
      {"missing directory", dir / "nope", with(same, dir / "nope"), {"model.init_from", "does not exist"}},
      {"missing config.json", no_config, with(same, no_config), {"has no config.json", "save_pretrained"}},
      {"not gpt2", make("llama", [](json& c) { c["model_type"] = "llama"; }, no_tensor_edit),
       with([](ModelSpec& s) { s.arch = "gpt2"; }, dir / "llama"), {"model_type \"llama\"", "only \"gpt2\""}},
      {"vocab mismatch", good, with([](ModelSpec& s) { s.vocab_size = 256; }, good),
       {"vocab_size = 37 (config.json) but model.vocab_size is 256", "set model.vocab_size: 37"}},
      {"width mismatch", good, with([](ModelSpec& s) { s.n_embd = 32; }, good),
       {"n_embd = 16 (config.json) but model.n_embd is 32"}},
      {"depth mismatch", good, with([](ModelSpec& s) { s.n_layer = 3; }, good),
       {"n_layer = 2 (config.json) but model.n_layer is 3"}},
      {"context longer than the position table", good, with([](ModelSpec& s) { s.seq_len = 16; }, good),
       {"n_positions = 12", "model.seq_len is 16"}},
      {"exact GELU", make("erf", [](json& c) { c["activation_function"] = "gelu"; }, no_tensor_edit),
       with(same, dir / "erf"), {"activation_function = \"gelu\"", "tanh approximation"}},
      {"untied head in config", make("untied", [](json& c) { c["tie_word_embeddings"] = false; }, no_tensor_edit),
       with(same, dir / "untied"), {"tie_word_embeddings = false"}},
      {"missing tensor",
       make("missing", no_config_edit,
            [](SafeTensorFile& f) {
              f.tensors.erase(std::remove_if(f.tensors.begin(), f.tensors.end(),
                                             [](const SafeTensor& t) { return t.name == "transformer.h.1.mlp.c_fc.bias"; }),
                              f.tensors.end());
            }),
       with(same, dir / "missing"), {"has no tensor 'transformer.h.1.mlp.c_fc.bias'"}},
      {"nn.Linear layout instead of Conv1D", linear, with(same, linear),
       {"'transformer.h.0.attn.c_attn.weight' has shape (48, 16)", "implies (16, 48)", "Conv1D"}},
      {"an lm_head that differs from wte",
       make("head", no_config_edit,
            [](SafeTensorFile& f) {
              SafeTensor h = *f.find("transformer.wte.weight");
              h.name = "lm_head.weight";
              h.data[0] ^= 1;
              f.tensors.push_back(h);
            }),
       with(same, dir / "head"), {"lm_head.weight differs from transformer.wte.weight"}},
      {"an lm_head that differs from wte in its last element",
       make("head_end", no_config_edit,
            [](SafeTensorFile& f) {
              SafeTensor h = *f.find("transformer.wte.weight");
              h.name = "lm_head.weight";
              h.data[h.data.size() - 4] ^= 1;
              f.tensors.push_back(h);
            }),
       with(same, dir / "head_end"), {"lm_head.weight differs from transformer.wte.weight"}},
      {"pytorch_model.bin only", bin_only, with(same, bin_only), {"no model.safetensors", "safe_serialization=True"}},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    const std::string err = load_error(c.spec);
    INFO(err);
    REQUIRE(!err.empty());
    CHECK_THAT(err, Contains("model.init_from"));
    for (const auto& e : c.expect) CHECK_THAT(err, Contains(e));
  }

  // Through the CLI: exit code 1 and the message, before any training.
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job_yaml(run, good, 1, 1));
  auto r = test::run_command("'" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" +
                             "' --set model.vocab_size=40 --set data.synthetic.vocab=37");
  CHECK(r.exit_code == 1);
  // Now refused at job load (the shape is resolved there), naming the file, both values and the --set.
  CHECK_THAT(r.err, Contains("config.json' has vocab_size = 37 but model.vocab_size is 40 (--set model.vocab_size=40)"));
  CHECK(!test::file_exists(run + "/metrics.jsonl"));
  r = test::run_command("'" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "' --set model.init_from='" +
                        no_config + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("has no config.json"));
  // Two full_shard ranks each read only their own ranges: the last rows of
  // wte are rank 1's, so only rank 1 sees the untied head, and both stop at
  // once with its message (nobody waits out a collective).
  test::write_file(dir / "job2.yaml", job_yaml(run, dir / "head_end", 1, 2));
  const auto t0 = std::chrono::steady_clock::now();
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job2.yaml" + "'");
  CHECK(r.exit_code == 1);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
  CHECK_THAT(r.err, Contains("lm_head.weight differs from transformer.wte.weight") && Contains("(rank 1)"));
  CHECK(!test::file_exists(run + "/metrics.jsonl"));
}

TEST_CASE("interop: trainrun bench checkpoint prints write and read GB/s next to the disk's", "[interop][bench]") {
  CHECK(parse_param_count("124M") == 124000000);
  CHECK(parse_param_count("1.5B") == 1500000000);
  CHECK(parse_param_count("350k") == 350000);
  CHECK(parse_param_count("20000") == 20000);
  CHECK_THROWS_AS(parse_param_count("lots"), Error);
  CHECK_THROWS_AS(parse_param_count("12X"), Error);
  const GPT2Config g = bench_model_for(124000000);
  CHECK(g.L == 12);
  CHECK(g.C == 768);  // GPT-2 small
  CHECK(g.V == 50257);
  for (int64_t n : {int64_t(20000), int64_t(300000), int64_t(5000000), int64_t(2000000000)}) {
    const GPT2Config c = bench_model_for(n);
    INFO(n << " -> " << c.num_parameters());
    CHECK(c.C % c.NH == 0);
    CHECK(std::fabs(double(c.num_parameters()) - double(n)) / double(n) < 0.1);
  }

  test::TempDir dir("interop");
  auto r = test::run_trainrun("bench checkpoint --params 300K --dir '" + dir.path() + "' --repeat 1");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  for (const char* row : {"disk: sequential write", "disk: sequential read", "checkpoint save, async off",
                          "async on: save() returns", "async on: background write", "checkpoint load",
                          "page cache before reads", "checkpoint save at tp2 (rank 0, async off)"})
    CHECK_THAT(r.out, Contains(row));  // the tp2 row: the only run of it (docs/benchmarks.md's example skips it)
  CHECK(fs::is_empty(dir.path()));  // the scratch folder is gone
  r = test::run_trainrun("bench checkpoint --params many --dir '" + dir.path() + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("--params 'many'"));
}

TEST_CASE("interop: trainrun generate (KV cache) continues a prompt as transformers' greedy generate does",
          "[interop][transformers][generate]") {
  test::TempDir dir("interop");
  // Within n_positions (transformers cannot go past it); odd sizes.
  const GPT2Config cfg = small_cfg(3, 3, 24, 61, 40);
  const std::vector<float> flat = random_flat(cfg, 11);
  export_hf(dir / "hf", cfg, flat);
  save_model_safetensors(dir / "model.safetensors", cfg, flat);
  const std::string prompt = "5 17 2 40 33 8 1";
  auto hf = hf_script("generate --model '" + dir / "hf" + "' --prompt '" + prompt + "' --max-new-tokens 30");
  INFO(hf.err);
  REQUIRE(hf.exit_code == 0);
  auto ours = test::run_trainrun("generate --checkpoint '" + dir / "model.safetensors" + "' --prompt '" + prompt +
                                 "' --max-tokens 30 --top-k 1");
  INFO(ours.err);
  REQUIRE(ours.exit_code == 0);
  CHECK_THAT(ours.err, Contains("tokens/s"));
  CHECK(ours.out == hf.out);
  // 7 + 30 ids on the line.
  std::istringstream is(ours.out);
  int n = 0;
  for (std::string t; is >> t;) ++n;
  CHECK(n == 37);
}

TEST_CASE("interop: a GPT-2 job with only model.init_from takes config.json's shape", "[interop][transformers][spec]") {
  test::TempDir dir("interop_init_only");
  const std::string hf = dir / "hf";
  // A shape unlike every default (n_layer 4, n_head 4, n_embd 128, vocab 256).
  auto r = hf_script("random --out '" + hf + "' --n-layer 3 --n-head 2 --n-embd 24 --vocab 41 --n-positions 16 --seed 5");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string run = dir / "run";
  const std::string rest =
      "data: {format: synthetic, synthetic: {vocab: 41, branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 1, lr: 1.0e-30, min_lr: 0, warmup_steps: 0,\n"
      "        schedule: constant, weight_decay: 0, grad_clip: 0, eval_steps: 1}\n"
      "output: {dir: '" + run + "', sample_tokens: 0}\n"
      "parallel: {nproc_per_node: 2, sharding: full_shard, timeout_s: 60}\n";
  test::write_file(dir / "job.yaml", "model: {init_from: '" + hf + "', seq_len: 16}\n" + rest);
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string resolved = test::read_file(run + "/job.resolved.yaml");
  for (const char* line : {"\n  arch: gpt2 ", "\n  n_layer: 3 ", "\n  n_head: 2 ", "\n  n_embd: 24 ",
                           "\n  vocab_size: 41 ", "\n  seq_len: 16 "}) {
    INFO(line);
    CHECK(resolved.find(line) != std::string::npos);
  }
  std::vector<float> trained;
  const ModelConfig c = load_model_safetensors(run + "/model.safetensors", trained);
  CHECK((c.L == 3 && c.NH == 2 && c.C == 24 && c.V == 41 && c.T == 16));
  ModelSpec m;
  m.n_layer = 3, m.n_head = 2, m.n_embd = 24, m.vocab_size = 41, m.seq_len = 16, m.init_from = hf;
  CHECK(bit_equal(trained, load_init_from(m)));
  // plan --config sees the same shape.
  r = test::run_trainrun("plan --config '" + dir / "job.yaml" + "' --gpus 2");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("gpt2 L=3 C=24 heads=2 V=41 T=16"));

  // An explicit field that disagrees: both values, the file, where it was set.
  test::write_file(dir / "bad.yaml", "model: {init_from: '" + hf + "', n_embd: 32}\n" + rest);
  r = test::run_trainrun("--config '" + dir / "bad.yaml" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("model.init_from: '" + hf + "/config.json' has n_embd = 24 but model.n_embd is 32 (" +
                             dir / "bad.yaml" + ":1:") &&
                        Contains("remove model.n_embd to take the directory's value, or set it to 24"));
  // seq_len past n_positions.
  r = test::run_trainrun("--config '" + dir / "job.yaml" + "' --set model.seq_len=17");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("has n_positions = 16 but model.seq_len is 17 (--set model.seq_len=17); set "
                             "model.seq_len to at most 16"));
  // Refused at load: the run's files are untouched.
  CHECK(test::read_file(run + "/job.resolved.yaml") == resolved);

  // Resuming the run from another directory's shape (2 layers, not 3) is
  // refused as any changed shape is: the resolved shape is the job's.
  const std::string hf2 = dir / "hf2";
  r = hf_script("random --out '" + hf2 + "' --n-layer 2 --n-head 2 --n-embd 24 --vocab 41 --n-positions 16 --seed 6");
  REQUIRE(r.exit_code == 0);
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" +
                        "' --set model.init_from='" + hf2 + "' --set train.max_steps=2");
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.err, Contains("model.n_layer = 3 but this job has 2"));
}
