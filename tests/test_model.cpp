// The model interface (core/model/model.h): the registry and its errors,
// ModelConfig's validation (every message names the model.* key), the
// tensor-parallel split of every tensor, counter-based init by slices,
// the file metadata and manifest round trips, model.arch in the job spec
// (auto follows init_from's model_type), and a resume from a
// format-2 manifest without "arch".
#include <catch2/catch.hpp>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/checkpoint/hf_interop.h"
#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/model/gpt2/gpt2.h"
#include "core/model/gpt2/gpt2_arch.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/model/model_shape.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using json = nlohmann::ordered_json;
using Split = ParamTensor::Split;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {  // trainrun::Error, or run_ranks_inprocess' summary
    return e.what();
  }
  return "";
}

ModelConfig llama(int L, int NH, int NKV, int C, int F, int V, int T, bool tied) {
  ModelConfig c;
  c.arch = "llama";
  c.L = L;
  c.NH = NH;
  c.NKV = NKV;
  c.C = C;
  c.F = F;
  c.V = V;
  c.T = T;
  c.tied = tied;
  c.rope_theta = 500000;
  return c;
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

}  // namespace

TEST_CASE("model: the registry names an unknown architecture and the known ones", "[model]") {
  ModelConfig c = GPT2Config::of(2, 2, 16, 29, 8);
  c.arch = "gpt3";
  CHECK(error_of([&] { make_model_arch(c); }) == "model.arch: unknown architecture 'gpt3'; known: gpt2, llama, qwen2, qwen3, phi3, mixtral, qwen2_moe, qwen3_moe, mistral, gemma2");
  CHECK(model_arch_names() ==
        std::vector<std::string>{"gpt2", "llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "mistral",
                                 "gemma2"});
  CHECK(arch_for_hf_model_type("gpt2") == "gpt2");
  CHECK(arch_for_hf_model_type("llama") == "llama");
  CHECK(arch_for_hf_model_type("phi3") == "phi3");
  CHECK(arch_for_hf_model_type("qwen2") == "qwen2");
  CHECK(arch_for_hf_model_type("mistral") == "mistral");
  CHECK(arch_for_hf_model_type("falcon").empty());
  c.arch = "gpt2";
  const auto a = make_model_arch(c);
  CHECK(a->name() == "gpt2");
  CHECK(a->describe() == "gpt2 L=2 C=16 heads=2 V=29 T=8");
  // Defaults resolved: gpt2 has NH key/value heads and a 4C MLP.
  CHECK(a->config().NKV == 2);
  CHECK(a->config().F == 64);
  const auto l = make_model_arch(llama(2, 4, 2, 32, 48, 50, 16, true));
  CHECK(l->describe() == "llama L=2 C=32 heads=4 kv_heads=2 ffn=48 V=50 T=16 tied=1");
}

TEST_CASE("model: ModelConfig validation names the model.* key", "[model]") {
  struct Case {
    const char* what;
    std::function<void(ModelConfig&)> edit;
    std::string expect;
  };
  auto gpt2 = [] { return GPT2Config::of(2, 4, 32, 50, 16); };
  const std::vector<Case> cases = {
      {"no layers", [](ModelConfig& c) { c.L = 0; }, "model.n_layer must be at least 1 (got 0)"},
      {"no heads", [](ModelConfig& c) { c.NH = 0; }, "model.n_head must be at least 1 (got 0)"},
      {"no vocab", [](ModelConfig& c) { c.V = 0; }, "model.vocab_size must be at least 1 (got 0)"},
      {"no context", [](ModelConfig& c) { c.T = -3; }, "model.seq_len must be at least 1 (got -3)"},
      {"heads not dividing", [](ModelConfig& c) { c.NH = 5; },
       "model.n_embd (32) is not divisible by model.n_head (5)"},
      {"kv heads not dividing", [](ModelConfig& c) { c.NKV = 3; },
       "model.n_head (4) is not a multiple of model.n_kv_head (3)"},
      {"gpt2 with GQA", [](ModelConfig& c) { c.NKV = 2; }, "model.n_kv_head: gpt2 has no grouped-query attention"},
      {"gpt2 with another MLP width", [](ModelConfig& c) { c.F = 100; },
       "model.ffn_dim: gpt2's MLP is 4 * model.n_embd = 128 wide"},
      {"gpt2 untied", [](ModelConfig& c) { c.tied = false; }, "model.tie_embeddings: gpt2 ties the LM head"},
      {"gpt2 with another LayerNorm eps", [](ModelConfig& c) { c.norm_eps = 1e-6; },
       "model.norm_eps: gpt2's LayerNorm uses 1e-05"},
      {"gpt2 with RoPE scaling", [](ModelConfig& c) { c.rope_scaling_type = "llama3"; },
       "model.rope_scaling.type: gpt2 has learned positions"},
      {"init std", [](ModelConfig& c) { c.init_std = 0; }, "model.init_std must be a positive number"},
      {"unknown rope scaling", [](ModelConfig& c) { c.rope_scaling_type = "yarn"; },
       "model.rope_scaling.type: unknown type 'yarn'; trainrun implements llama3"},
      {"llama without an MLP width",
       [](ModelConfig& c) {
         c.arch = "llama";
         c.tied = false;
       },
       "model.ffn_dim: llama needs its MLP width"},
      {"llama with an odd head size",
       [](ModelConfig& c) {
         c.arch = "llama";
         c.F = 64;
         c.C = 36;
       },
       "model.n_embd: the head size model.n_embd / model.n_head = 9 must be even"},
      {"llama3 scaling with inverted frequency factors",
       [](ModelConfig& c) {
         c.arch = "llama";
         c.F = 64;
         c.rope_scaling_type = "llama3";
         c.rope_scaling.high_freq_factor = 0.5;
       },
       "model.rope_scaling.high_freq_factor (0.5) must be above model.rope_scaling.low_freq_factor (1)"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    ModelConfig cfg = gpt2();
    c.edit(cfg);
    const std::string err = error_of([&] { cfg.validate(); });
    INFO(err);
    CHECK_THAT(err, Contains(c.expect));
    CHECK(err.rfind("model.", 0) == 0);  // the key comes first
    CHECK(error_of([&] { make_model_arch(cfg); }) == err);
  }
  CHECK(error_of([&] { gpt2().validate(); }).empty());
  CHECK(error_of([&] { llama(2, 4, 1, 32, 64, 50, 16, false).validate(); }).empty());
}

TEST_CASE("model: every GPT-2 tensor says how tensor parallelism splits it", "[model]") {
  const GPT2Arch arch(GPT2Config::of(3, 4, 32, 50, 16));
  const ParamLayout& lay = arch.layout();
  // By name suffix: the column layers (q|k|v as three blocks, the MLP's
  // fc) with their biases, the row layers (the two output projections)
  // with replicated biases, the vocab-split token embedding.
  const std::vector<std::tuple<std::string, Split, int>> rules = {
      {"wte.weight", Split::Vocab, 1},          {"wpe.weight", Split::Replicated, 1},
      {"ln_1.weight", Split::Replicated, 1},    {"ln_1.bias", Split::Replicated, 1},
      {"attn.c_attn.weight", Split::Column, 3}, {"attn.c_attn.bias", Split::Column, 3},
      {"attn.c_proj.weight", Split::Row, 1},    {"attn.c_proj.bias", Split::Replicated, 1},
      {"ln_2.weight", Split::Replicated, 1},    {"ln_2.bias", Split::Replicated, 1},
      {"mlp.c_fc.weight", Split::Column, 1},    {"mlp.c_fc.bias", Split::Column, 1},
      {"mlp.c_proj.weight", Split::Row, 1},     {"mlp.c_proj.bias", Split::Replicated, 1},
      {"ln_f.weight", Split::Replicated, 1},    {"ln_f.bias", Split::Replicated, 1},
  };
  REQUIRE(lay.tensors.size() == 2 + 12 * 3 + 2);
  for (const auto& t : lay.tensors) {
    INFO(t.name);
    int matched = 0;
    for (const auto& [suffix, split, blocks] : rules) {
      if (!ends_with(t.name, "." + suffix)) continue;
      ++matched;
      CHECK(split_name(t.split) == std::string(split_name(split)));
      CHECK(t.split_blocks == blocks);
    }
    CHECK(matched == 1);
    // A split dimension divides into its blocks.
    if (t.split != Split::Replicated) CHECK(t.shape[t.split == Split::Row ? 1 : 0] % t.split_blocks == 0);
  }
  // The units in visit order, and the tied head.
  REQUIRE(lay.units.size() == 5);
  CHECK(lay.units.front().name == "embeddings");
  CHECK(lay.units[1].name == "block 0");
  CHECK(lay.units.back().name == "head");
  REQUIRE(lay.ties.size() == 1);
  CHECK(lay.ties[0].name == "lm_head.weight");
  CHECK(lay.ties[0].tensor == "transformer.wte.weight");
  // Conv1D: the four projection matrices are transposed in HF files, nothing else.
  for (const auto& t : lay.tensors) {
    INFO(t.name);
    const bool conv = ends_with(t.name, "c_attn.weight") || ends_with(t.name, "c_proj.weight") ||
                      ends_with(t.name, "c_fc.weight");
    CHECK(arch.hf_tensor(t).transposed == conv);
    CHECK(arch.hf_tensor(t).name == t.name);
  }
  CHECK(arch.hf_canonical_name("transformer.h.0.ln_1.weight") == "h.0.ln_1.weight");
  CHECK(arch.hf_canonical_name("lm_head.weight") == "lm_head.weight");
}

TEST_CASE("model: Llama's layout has HF's names, its splits and the planner's units", "[model]") {
  for (bool tied : {true, false}) {
    INFO("tied " << tied);
    const ModelConfig c = llama(2, 4, 2, 32, 48, 50, 16, tied);
    const auto arch = make_model_arch(c);
    const ParamLayout& lay = arch->layout();
    const int64_t C = 32, KV = 2 * 8, F = 48, V = 50;
    REQUIRE(lay.units.size() == 4);
    CHECK(lay.units[0].numel == V * C);
    CHECK(lay.units[1].numel == C + C * C + 2 * C * KV + C * C + C + 3 * C * F);
    CHECK(lay.units[3].numel == C + (tied ? 0 : V * C));
    CHECK(lay.get("model.layers.1.self_attn.k_proj.weight").shape == std::vector<int64_t>{KV, C});
    CHECK(lay.get("model.layers.1.mlp.down_proj.weight").shape == std::vector<int64_t>{C, F});
    // q|k|v and gate|up adjacent: one fused GEMM reads each.
    const auto& q = lay.get("model.layers.0.self_attn.q_proj.weight");
    CHECK(lay.get("model.layers.0.self_attn.k_proj.weight").offset == q.offset + q.numel);
    const auto& gate = lay.get("model.layers.0.mlp.gate_proj.weight");
    CHECK(lay.get("model.layers.0.mlp.up_proj.weight").offset == gate.offset + gate.numel);
    for (const auto& t : lay.tensors) {
      INFO(t.name);
      const Split want = ends_with(t.name, "norm.weight")                                          ? Split::Replicated
                         : ends_with(t.name, "o_proj.weight") || ends_with(t.name, "down_proj.weight") ? Split::Row
                         : ends_with(t.name, "embed_tokens.weight") || t.name == "lm_head.weight"    ? Split::Vocab
                                                                                                      : Split::Column;
      CHECK(split_name(t.split) == std::string(split_name(want)));
      CHECK(t.decay == (t.shape.size() == 2));
    }
    CHECK(lay.ties.size() == (tied ? 1u : 0u));
    CHECK(arch->matmul_parameters() == lay.total - (tied ? 0 : V * C));
    // The network and the KV-cached decoder exist (tests/test_llama.cpp).
    auto be = make_cpu_backend(1);
    CHECK(arch->make_network(be.get(), 1, false) != nullptr);
    CHECK(arch->has_decoder());
    const auto dec = arch->make_decoder(be.get(), 4);
    REQUIRE(dec != nullptr);
    CHECK(dec->bytes() == arch->decoder_bytes_needed(*be, 4));
  }
}

TEST_CASE("model: init_params of any slice equals that part of the whole", "[model]") {
  const std::vector<ModelConfig> configs = {GPT2Config::of(2, 2, 16, 29, 8), llama(2, 4, 2, 16, 24, 29, 8, false),
                                            llama(1, 2, 1, 8, 12, 11, 4, true)};
  std::mt19937_64 rng(5);
  for (const auto& cfg : configs) {
    const auto arch = make_model_arch(cfg);
    INFO(arch->describe());
    const int64_t n = arch->num_parameters();
    std::vector<float> whole(static_cast<size_t>(n));
    arch->init_params(7, 0, n, whole.data());
    // The seed matters; the values are finite; norms/LN gains start at 1.
    std::vector<float> other(static_cast<size_t>(n));
    arch->init_params(8, 0, n, other.data());
    CHECK(std::memcmp(whole.data(), other.data(), size_t(n) * 4) != 0);
    CHECK(std::all_of(whole.begin(), whole.end(), [](float v) { return std::isfinite(v); }));
    for (int k = 0; k < 40; ++k) {
      int64_t a = int64_t(rng() % uint64_t(n + 1)), b = int64_t(rng() % uint64_t(n + 1));
      if (a > b) std::swap(a, b);
      if (k == 0) a = 0, b = n;
      if (k == 1) a = b = n / 2;  // empty
      std::vector<float> part(size_t(b - a) + 1, -7.0f);
      arch->init_params(7, a, b, part.data());
      INFO("[" << a << ", " << b << ")");
      CHECK(std::memcmp(part.data(), whole.data() + a, size_t(b - a) * 4) == 0);
      CHECK(part[size_t(b - a)] == -7.0f);  // nothing written past the slice
    }
  }
  // GPT-2's is gpt2_init_params, bit for bit, and the same numbers as before
  // the model interface existed (xxhash64 of the init's bytes).
  const GPT2Config g = GPT2Config::of(2, 2, 16, 29, 8);
  const auto arch = make_model_arch(g);
  const ParamLayout lay = make_gpt2_layout(g);
  std::vector<float> a(size_t(lay.total)), b(size_t(lay.total));
  arch->init_params(7, 0, lay.total, a.data());
  gpt2_init_params(g, lay, 7, 0, lay.total, b.data());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
  CHECK(XXH64(a.data(), a.size() * 4, 0) == 0xcba65ff5b63cf738ull);  // computed with the pre-interface gpt2.cpp
}

TEST_CASE("model: the file metadata rebuilds the config it came from", "[model]") {
  ModelConfig scaled = llama(3, 8, 2, 64, 96, 300, 32, true);
  scaled.rope_scaling_type = "llama3";
  scaled.rope_scaling = {32.0, 1.0, 4.0, 8192};
  scaled.norm_eps = 1e-6;
  scaled.init_std = 0.0123456789;
  const std::vector<ModelConfig> configs = {GPT2Config::of(2, 2, 16, 29, 8, 0.05), GPT2Config::of(4, 4, 128, 256, 128),
                                            llama(2, 4, 1, 32, 48, 50, 16, false), scaled};
  for (const auto& cfg : configs) {
    const auto arch = make_model_arch(cfg);
    INFO(arch->describe());
    const ModelConfig back = config_from_file_metadata(arch->file_metadata(), "f.safetensors");
    const ModelConfig& want = arch->config();
    const auto again = make_model_arch(back);
    CHECK(back.arch == want.arch);
    CHECK(again->config().L == want.L);
    CHECK(again->config().NH == want.NH);
    CHECK(again->config().NKV == want.NKV);
    CHECK(again->config().C == want.C);
    CHECK(again->config().F == want.F);
    CHECK(again->config().V == want.V);
    CHECK(again->config().T == want.T);
    CHECK(back.init_std == want.init_std);
    CHECK(back.norm_eps == want.norm_eps);
    CHECK(back.tied == want.tied);
    CHECK(back.rope_scaling_type == want.rope_scaling_type);
    if (want.arch == "llama") {
      CHECK(back.rope_theta == want.rope_theta);
      CHECK(back.rope_scaling.factor == want.rope_scaling.factor);
      CHECK(back.rope_scaling.original_max_position_embeddings == want.rope_scaling.original_max_position_embeddings);
    }
    CHECK(again->file_metadata() == arch->file_metadata());
    CHECK(manifest_model_mismatch(*again, arch->manifest_model()).empty());
  }
  // GPT-2's metadata is part of every existing checkpoint's header: exactly these keys.
  const auto g = make_model_arch(GPT2Config::of(2, 2, 16, 29, 8));
  CHECK(g->file_metadata() == std::map<std::string, std::string>{{"format", "pt"},
                                                                 {"arch", "gpt2"},
                                                                 {"n_layer", "2"},
                                                                 {"n_head", "2"},
                                                                 {"n_embd", "16"},
                                                                 {"vocab_size", "29"},
                                                                 {"seq_len", "8"},
                                                                 {"init_std", "0.020000"}});
  // Files from before "arch" was written are GPT-2; an unknown arch is named.
  auto meta = g->file_metadata();
  meta.erase("arch");
  CHECK(config_from_file_metadata(meta, "old.safetensors").arch == "gpt2");
  meta["arch"] = "mamba";
  CHECK_THAT(error_of([&] { config_from_file_metadata(meta, "x.safetensors"); }),
             Contains("x.safetensors: unsupported arch 'mamba'"));
  // Through a whole file.
  test::TempDir dir("model");
  const GPT2Config cfg = GPT2Config::of(2, 2, 16, 29, 8);
  std::vector<float> flat(size_t(cfg.num_parameters()));
  for (size_t i = 0; i < flat.size(); ++i) flat[i] = float(i % 97) * 0.01f;
  save_model_safetensors(dir / "m.safetensors", cfg, flat);
  std::vector<float> got;
  const ModelConfig back = load_model_safetensors(dir / "m.safetensors", got);
  CHECK(back.arch == "gpt2");
  CHECK(back.L == 2);
  CHECK(back.T == 8);
  CHECK(got == flat);
}

TEST_CASE("model: a manifest's model block is compared key by key, and no arch means gpt2", "[model]") {
  const auto g = make_model_arch(GPT2Config::of(2, 2, 16, 29, 8));
  json saved = g->manifest_model();
  CHECK(saved.dump() == R"({"arch":"gpt2","n_layer":2,"n_head":2,"n_embd":16,"vocab_size":29,"seq_len":8})");
  CHECK(manifest_model_mismatch(*g, saved).empty());
  saved["n_embd"] = 18;
  CHECK(manifest_model_mismatch(*g, saved) == "model.n_embd = 18 but this job has 16");
  saved = g->manifest_model();
  saved.erase("arch");  // format 2 before the arch was recorded
  CHECK(manifest_model_mismatch(*g, saved).empty());
  const auto l = make_model_arch(llama(2, 2, 2, 16, 32, 29, 8, true));
  CHECK(manifest_model_mismatch(*l, saved) == "model.arch = gpt2 but this job has llama");
  json lsaved = l->manifest_model();
  lsaved.erase("ffn_dim");
  CHECK(manifest_model_mismatch(*l, lsaved) == "model.ffn_dim is not recorded but this job has 32");
}

TEST_CASE("model: model.arch auto follows init_from's model_type, and llama trains from the spec", "[model]") {
  test::TempDir dir("model");
  ModelSpec m;
  CHECK(m.arch == "auto");
  CHECK(ModelConfig::from_spec(m).arch == "gpt2");
  m.arch = "gpt2";
  CHECK(ModelConfig::from_spec(m).arch == "gpt2");
  m.arch = "llama";
  CHECK(ModelConfig::from_spec(m).arch == "llama");
  // auto with a Hugging Face directory: its model_type.
  export_hf(dir / "gpt2", GPT2Config::of(2, 2, 16, 29, 8), std::vector<float>(size_t(GPT2Config::of(2, 2, 16, 29, 8).num_parameters())));
  m.arch = "auto";
  m.init_from = dir / "gpt2";
  CHECK(ModelConfig::from_spec(m).arch == "gpt2");
  // A llama directory resolves to llama (its import: tests/test_llama.cpp).
  std::filesystem::create_directories(dir / "llama");
  test::write_file(dir / "llama/config.json", "{\"model_type\": \"llama\"}");
  m.init_from = dir / "llama";
  CHECK(ModelConfig::from_spec(m).arch == "llama");
  for (const auto& [type, expect] : std::vector<std::pair<std::string, std::string>>{
           {"falcon", "has model_type \"falcon\", an architecture trainrun does not know"}}) {
    std::filesystem::create_directories(dir / type);
    test::write_file(dir / type + "/config.json", "{\"model_type\": \"" + type + "\"}");
    m.init_from = dir / type;
    const std::string err = error_of([&] { ModelConfig::from_spec(m); });
    CHECK_THAT(err, Contains("model.init_from: '" + dir / type + "/config.json' " + expect));
  }
  // An explicit arch that the directory is not: named both ways.
  m.arch = "gpt2";
  m.init_from = dir / "llama";
  CHECK_THAT(error_of([&] { load_init_from(m); }),
             Contains("has model_type \"llama\" but model.arch is gpt2; only \"gpt2\" can be loaded into it"));
  // An unreadable directory resolves to gpt2, and load_init_from says what is wrong.
  m.arch = "auto";
  m.init_from = dir / "nope";
  CHECK(ModelConfig::from_spec(m).arch == "gpt2");
  CHECK_THAT(error_of([&] { load_init_from(m); }), Contains("model.init_from: '" + dir / "nope" + "' does not exist"));

  // A llama run needs its MLP width; with it, it trains and samples at the end.
  test::write_file(dir / "job.yaml",
                   "model: {arch: llama, n_layer: 1, n_head: 2, n_embd: 8, vocab_size: 16, seq_len: 8}\n"
                   "data: {format: synthetic}\noutput: {dir: '" + dir / "run" + "', sample_tokens: 0}\n"
                   "parallel: {nproc_per_node: 1}\n");
  auto r = test::run_trainrun("validate --config " + dir / "job.yaml");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("arch: llama"));
  r = test::run_trainrun("--config " + dir / "job.yaml");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("model.ffn_dim: llama needs its MLP width"));
  r = test::run_trainrun("--config " + dir / "job.yaml" + " --set model.ffn_dim=12 --set train.max_steps=2"
                         " --set output.sample_tokens=5");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("model: llama L=1") && Contains("sample:\n"));
  CHECK_THAT(r.err, !Contains("sample: skipped"));
  r = test::run_trainrun("--config " + dir / "job.yaml" + " --set model.arch=gpt4");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("model.arch: unknown value 'gpt4'") && Contains("auto, gpt2, llama"));
  // plan still plans a Llama from its shape.
  r = test::run_trainrun("plan --model llama3.1-8b --gpus 8");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("llama L=32 C=4096 heads=32 kv_heads=8 ffn=14336 V=128256 T=8192"));
}

TEST_CASE("model: a format-2 manifest without an arch resumes as gpt2, bit for bit", "[model][checkpoint]") {
  test::TempDir dir("model");
  auto job = [&](const std::string& run, std::vector<std::string> sets) {
    return parse_job_spec("model: {n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 23, seq_len: 8}\n"
                          "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
                          "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 6, warmup_steps: 1,\n"
                          "        eval_interval: 0, eval_steps: 1, log_interval: 1}\n"
                          "output: {dir: '" + run + "', sample_tokens: 0}\n"
                          "parallel: {sharding: full_shard, timeout_s: 60}\n",
                          "job.yaml", sets);
  };
  const auto straight = test::run_ranks_inprocess(job(dir / "straight", {}), 2);
  test::run_ranks_inprocess(job(dir / "resumed", {"train.exit_interval=3"}), 2);
  const std::string manifest = dir / "resumed/checkpoints/step_00000003/manifest.json";
  json m = json::parse(test::read_file(manifest));
  REQUIRE(m["model"]["arch"] == "gpt2");
  m["model"].erase("arch");
  test::write_file(manifest, m.dump(2) + "\n");
  const auto resumed = test::run_ranks_inprocess(job(dir / "resumed", {}), 2);
  REQUIRE(straight[0].losses.size() == 6);
  REQUIRE(resumed[0].losses.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(resumed[0].losses[size_t(i)] == straight[0].losses[size_t(3 + i)]);
  std::vector<float> a, b;
  load_model_safetensors(dir / "straight/model.safetensors", a);
  load_model_safetensors(dir / "resumed/model.safetensors", b);
  CHECK(a == b);
  // Another architecture's checkpoint is refused, naming both.
  m["model"]["arch"] = "llama";
  test::write_file(manifest, m.dump(2) + "\n");
  test::write_file(dir / "resumed/checkpoints/latest", "step_00000003\n");
  std::filesystem::remove_all(dir / "resumed/checkpoints/step_00000006");
  JobSpec again = job(dir / "resumed", {});
  CHECK_THAT(error_of([&] { test::run_ranks_inprocess(again, 1); }),
             Contains("was saved with model.arch = llama but this job has gpt2"));
}

TEST_CASE("model: gpt2 refuses Llama's shape fields instead of ignoring them", "[model]") {
  auto error_of = [](const std::function<void(ModelSpec&)>& edit) {
    ModelSpec m;
    m.arch = "gpt2";
    edit(m);
    try {
      ModelConfig::from_spec(m);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error_of([](ModelSpec&) {}).empty());
  CHECK(error_of([](ModelSpec& m) { m.n_kv_head = m.n_head; }).empty());  // the same as gpt2's own
  CHECK(error_of([](ModelSpec& m) { m.ffn_dim = 4 * m.n_embd; }).empty());
  CHECK(error_of([](ModelSpec& m) { m.tie_embeddings = "true"; }).empty());
  CHECK_THAT(error_of([](ModelSpec& m) { m.n_kv_head = 2; }),
             Catch::Matchers::Contains("model.n_kv_head: 2; gpt2 has no grouped-query attention"));
  CHECK_THAT(error_of([](ModelSpec& m) { m.ffn_dim = 100; }),
             Catch::Matchers::Contains("model.ffn_dim: 100; gpt2's MLP is 4 * n_embd = 512"));
  CHECK_THAT(error_of([](ModelSpec& m) { m.tie_embeddings = "false"; }),
             Catch::Matchers::Contains("model.tie_embeddings: false"));
  CHECK_THAT(error_of([](ModelSpec& m) { m.rope_scaling.type = "llama3"; }),
             Catch::Matchers::Contains("model.rope_scaling.type: llama3; gpt2 has learned positions"));
}
