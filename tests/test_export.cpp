// `trainrun export` (core/checkpoint/hf_export.cpp) and HF directories as
// --checkpoint of export and generate, against transformers 4.44.2 (the
// repo's .venv, scripts/reference/hf_llama.py and hf_gpt2.py):
//  - random tiny LlamaForCausalLMs made by transformers (GQA 4:1 and 3:1...,
//    llama3 rope scaling, tied and untied, odd sizes) -> model.init_from ->
//    a short 2-rank full_shard fine-tune -> export: from_pretrained loads it
//    cleanly and its logits are trainrun's own for the checkpoint's weights
//    (<= 1e-5 relative); config.json carries the source's context and token
//    ids; generation_config.json and the tokenizer files are copied;
//  - --dtype bf16 reloads as the fp32 export rounded by torch (bit for bit);
//  - --max-shard-size: shards + an index save_pretrained's way, which
//    reloads, and re-exports (an HF directory as the source) byte-identical;
//  - generate --checkpoint HF_DIR (Llama, sharded; GPT-2) equals
//    transformers' greedy generate;
//  - bad flags, a foreign --out, broken HF directories: clear errors, exit
//    codes, nothing written;
//  - the export streams: a 600 MB model exports in a process whose peak RSS
//    stays far below the model's size.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "core/checkpoint/hf_interop.h"
#include "core/io/safetensors.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "tests/support/hf_reference.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using test::hf_python;
using test::run_reference_script;

json read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f);
  return json::parse(f);
}

std::vector<int32_t> random_tokens(int n, int V, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int32_t(rng() % unsigned(V));
  return v;
}

using test::hf_logits_of;
using test::logits_of;
using test::rel_err;

struct LlamaVariant {
  const char* name;
  int L, NH, NKV, C, F, V;
  bool tied, scaled;
};

std::string make_hf_llama(const test::TempDir& dir, const LlamaVariant& v, const std::string& extra = "") {
  const std::string out = dir / (std::string("src_") + v.name);
  std::ostringstream a;
  a << "random --out '" << out << "' --layers " << v.L << " --hidden " << v.C << " --heads " << v.NH
    << " --kv-heads " << v.NKV << " --intermediate " << v.F << " --vocab " << v.V
    << " --max-positions 64 --rope-theta 10000 --eps 1e-5 --seed 7" << (v.tied ? " --tie" : "")
    << (v.scaled ? " --rope-scaling-factor 4 --low-freq-factor 1 --high-freq-factor 4 --original-max-positions 8"
                 : "")
    << extra;
  const auto r = run_reference_script("hf_llama.py", a.str());
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return out;
}

// A fine-tune of `src` (init_from): 3 real AdamW steps, 2 ranks, full_shard.
std::string fine_tune(const test::TempDir& dir, const LlamaVariant& v, const std::string& src) {
  const std::string run = dir / (std::string("run_") + v.name);
  std::ostringstream y;
  // The job's model.* describe the weights it starts from (checked against config.json).
  y << "model: {arch: llama, n_layer: " << v.L << ", n_head: " << v.NH << ", n_kv_head: " << v.NKV
    << ", n_embd: " << v.C << ", ffn_dim: " << v.F << ", vocab_size: " << v.V
    << ", seq_len: 12, rope_theta: 10000, norm_eps: 1.0e-5, tie_embeddings: " << (v.tied ? "true" : "false")
    << (v.scaled ? ", rope_scaling: {type: llama3, factor: 4, low_freq_factor: 1, high_freq_factor: 4, "
                   "original_max_position_embeddings: 8}"
                 : "")
    << ", init_from: '" << src << "'}\n"
    << "data: {format: synthetic, synthetic: {vocab: " << v.V << ", branching: 3}}\n"
    << "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 3, lr: 1.0e-2, warmup_steps: 0, "
       "eval_steps: 1, log_interval: 1}\n"
    << "output: {dir: '" << run << "', sample_tokens: 0}\n"
    << "checkpoint: {interval: 3}\n"
    << "parallel: {nproc_per_node: 2, sharding: full_shard, timeout_s: 60}\n";
  test::write_file(dir / (std::string("job_") + v.name + ".yaml"), y.str());
  const auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" +
                                   dir / (std::string("job_") + v.name + ".yaml") + "' 2>&1");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  return run;
}

test::RunResult export_cmd(const std::string& args) { return test::run_trainrun("export " + args); }

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> s;
  for (const auto& e : fs::directory_iterator(dir)) s.insert(e.path().filename().string());
  return s;
}

// The siblings of --out: no temporary or moved-aside directory left behind.
void check_no_leftovers(const std::string& parent) {
  for (const auto& e : fs::directory_iterator(parent)) {
    const std::string n = e.path().filename().string();
    INFO(n);
    CHECK(n.find(".tmp-") == std::string::npos);
    CHECK(n.find(".old-") == std::string::npos);
  }
}

}  // namespace

TEST_CASE("export: a fine-tuned Llama reloads in transformers with trainrun's logits", "[export][llama][hf]") {
  const std::vector<LlamaVariant> variants = {
      {"gqa4_untied_scaled", 2, 4, 1, 16, 24, 29, false, true},
      {"gqa3_tied", 3, 6, 2, 36, 20, 41, true, false},
      {"gqa2_untied", 1, 4, 2, 24, 40, 33, false, false},
  };
  for (const auto& v : variants) {
    DYNAMIC_SECTION(v.name) {
      test::TempDir dir("export_llama");
      const std::string src = make_hf_llama(dir, v);
      // Tokenizer files the export must copy, byte for byte (their content is
      // not read: any bytes).
      const bool with_tokenizer = !v.tied;
      if (with_tokenizer) {
        test::write_file(src + "/tokenizer.json", "{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\"}}\n");
        test::write_file(src + "/tokenizer_config.json", "{\"model_max_length\": 64}\n");
        test::write_file(src + "/special_tokens_map.json", "{\"bos_token\": \"<s>\"}\n");
      }
      const std::string run = fine_tune(dir, v, src);
      const std::string out = dir / "hf";
      auto r = export_cmd("--checkpoint '" + run + "' --out '" + out + "'");
      INFO(r.err);
      REQUIRE(r.exit_code == 0);

      // The checkpoint's weights, which the fine-tune moved away from the source's.
      std::vector<float> flat;
      const ModelConfig cfg = load_model_safetensors(run + "/checkpoints/step_00000003/model.safetensors", flat);
      const auto arch = make_model_arch(cfg);
      std::vector<float> src_flat;
      load_hf(src, src_flat);
      CHECK(rel_err(flat, src_flat) > 1e-3);

      const json c = read_json(out + "/config.json");
      CHECK(c["architectures"] == json::array({"LlamaForCausalLM"}));
      CHECK(c["model_type"] == "llama");
      CHECK(c["num_hidden_layers"] == v.L);
      CHECK(c["num_attention_heads"] == v.NH);
      CHECK(c["num_key_value_heads"] == v.NKV);
      CHECK(c["hidden_size"] == v.C);
      CHECK(c["intermediate_size"] == v.F);
      CHECK(c["vocab_size"] == v.V);
      CHECK(c["head_dim"] == v.C / v.NH);
      CHECK(c["tie_word_embeddings"] == v.tied);
      CHECK(c["hidden_act"] == "silu");
      CHECK(c["torch_dtype"] == "float32");
      // Carried over from the source, not our training seq_len (12) or nulls.
      CHECK(c["max_position_embeddings"] == 64);
      CHECK(c["bos_token_id"] == 1);
      CHECK(c["eos_token_id"] == 2);
      if (v.scaled) {
        CHECK(c["rope_scaling"]["rope_type"] == "llama3");
        CHECK(c["rope_scaling"]["original_max_position_embeddings"] == 8);
      } else {
        CHECK(c["rope_scaling"].is_null());
      }
      CHECK(test::read_file(out + "/generation_config.json") == test::read_file(src + "/generation_config.json"));
      std::set<std::string> want = {"config.json", "generation_config.json", "model.safetensors"};
      if (with_tokenizer) {
        for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
          want.insert(f);
          CHECK(test::read_file(out + "/" + f) == test::read_file(src + "/" + f));
        }
      }
      CHECK(entries(out) == want);
      check_no_leftovers(dir.path());

      // transformers computes trainrun's logits for these weights.
      const int B = 2, T = 12;
      const std::vector<int32_t> in = random_tokens(B * T, v.V, 5);
      const std::vector<float> theirs = hf_logits_of("hf_llama.py", out, in, B, T, dir);
      const double e = rel_err(logits_of(*arch, flat, in, B, T), theirs);
      std::printf("export %s: logits relative error trainrun vs transformers %.3e\n", v.name, e);
      CHECK(e <= 1e-5);

      // bf16: what transformers loads is the fp32 export rounded by torch, bit for bit.
      r = export_cmd("--checkpoint '" + run + "' --out '" + dir / "hf16" + "' --dtype bf16");
      REQUIRE(r.exit_code == 0);
      CHECK(read_json(dir / "hf16/config.json")["torch_dtype"] == "bfloat16");
      for (const auto& t : read_safetensors(dir / "hf16/model.safetensors").tensors) CHECK(t.dtype == "BF16");
      r = run_reference_script("hf_llama.py", "same-bf16 --fp32 '" + out + "' --bf16 '" + dir / "hf16" + "'");
      INFO(r.err);
      CHECK(r.exit_code == 0);

      // Sharded: every file at most 1000 bytes of tensors unless one tensor
      // alone is larger, the index lists each tensor in the file that holds it.
      r = export_cmd("--checkpoint '" + run + "/checkpoints/step_00000003' --out '" + dir / "hfsh" +
                     "' --max-shard-size 1KB");
      INFO(r.err);
      REQUIRE(r.exit_code == 0);
      const json idx = read_json(dir / "hfsh/model.safetensors.index.json");
      std::set<std::string> files;
      for (const auto& [k, f] : idx["weight_map"].items()) files.insert(f.get<std::string>());
      REQUIRE(files.size() > 2);
      uint64_t total = 0;
      size_t tensors = 0;
      for (const auto& f : files) {
        INFO(f);
        CHECK(f.size() == std::string("model-00001-of-00009.safetensors").size());
        CHECK(f.find("-of-" + std::string(5 - std::to_string(files.size()).size(), '0') +
                     std::to_string(files.size()) + ".safetensors") != std::string::npos);
        const SafeTensorFile s = read_safetensors(dir / "hfsh/" + f);
        uint64_t bytes = 0;
        for (const auto& t : s.tensors) {
          CHECK(idx["weight_map"][t.name] == f);
          bytes += t.data.size();
          ++tensors;
        }
        CHECK((bytes <= 1000 || s.tensors.size() == 1));
        total += bytes;
      }
      CHECK(idx["metadata"]["total_size"] == total);
      CHECK(tensors == idx["weight_map"].size());
      CHECK(tensors == arch->layout().tensors.size());
      CHECK(!test::file_exists(dir / "hfsh/model.safetensors"));
      const std::vector<float> sharded = hf_logits_of("hf_llama.py", dir / "hfsh", in, B, T, dir);
      CHECK(rel_err(sharded, theirs) == 0.0);

      // An HF directory as the source: the sharded one back into one file is
      // the first export, byte for byte, and carries the tokenizer along.
      r = export_cmd("--checkpoint '" + dir / "hfsh" + "' --out '" + dir / "again" + "'");
      INFO(r.err);
      REQUIRE(r.exit_code == 0);
      CHECK(test::read_file(dir / "again/model.safetensors") == test::read_file(out + "/model.safetensors"));
      CHECK(test::read_file(dir / "again/config.json") == test::read_file(out + "/config.json"));
      CHECK(entries(dir / "again") == want);

      // generate --checkpoint HF_DIR (sharded here) is transformers' greedy.
      const std::string prompt = "5 17 2 28 0";
      const auto theirs_gen = run_reference_script(
          "hf_llama.py", "generate --model '" + dir / "hfsh" + "' --prompt '" + prompt + "' --max-new-tokens 7");
      REQUIRE(theirs_gen.exit_code == 0);
      const auto ours_gen = test::run_trainrun("generate --checkpoint '" + dir / "hfsh" + "' --prompt '" + prompt +
                                               "' --max-tokens 7 --top-k 1");
      INFO(ours_gen.err);
      REQUIRE(ours_gen.exit_code == 0);
      CHECK(ours_gen.out == theirs_gen.out);
      // The tokenizer.json here is the test's stand-in, not a tokenizer: generate says so and reads ids.
      if (test::file_exists(dir / "hfsh/tokenizer.json"))
        CHECK_THAT(ours_gen.err, Contains("generate: not using " + dir / "hfsh/tokenizer.json"));
    }
  }
}

TEST_CASE("export: a Llama trained from scratch gets a minimal generation_config and no tokenizer",
          "[export][llama]") {
  test::TempDir dir("export_scratch");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml",
                   "model: {arch: llama, n_layer: 1, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 31, "
                   "seq_len: 8}\n"
                   "data: {format: synthetic, synthetic: {vocab: 31, branching: 3}}\n"
                   "train: {global_batch_size: 2, micro_batch_size: 2, max_steps: 1, warmup_steps: 0, eval_steps: 1}\n"
                   "output: {dir: '" + run + "', sample_tokens: 0}\n");
  auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" +
                             "' 2>&1");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  r = export_cmd("--checkpoint '" + run + "/model.safetensors' --out '" + dir / "hf" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(entries(dir / "hf") == std::set<std::string>{"config.json", "generation_config.json", "model.safetensors"});
  const json c = read_json(dir / "hf/config.json");
  CHECK(c["max_position_embeddings"] == 8);
  CHECK(c["bos_token_id"].is_null());
  CHECK(read_json(dir / "hf/generation_config.json") == json{{"_from_model_config", true}});
  // transformers loads it and computes our logits.
  std::vector<float> flat;
  const auto arch = make_model_arch(load_model_safetensors(run + "/model.safetensors", flat));
  const std::vector<int32_t> in = random_tokens(8, 31, 1);
  CHECK(rel_err(logits_of(*arch, flat, in, 1, 8), hf_logits_of("hf_llama.py", dir / "hf", in, 1, 8, dir)) <= 1e-5);

  // A job whose init_from directory is gone exports too, without its tokenizer.
  const std::string src = make_hf_llama(dir, {"gone", 1, 4, 2, 16, 24, 31, true, false});
  test::write_file(src + "/tokenizer.json", "{}");
  test::write_file(dir / "job2.yaml", "model: {arch: llama, n_layer: 1, n_head: 4, n_kv_head: 2, n_embd: 16, "
                                      "ffn_dim: 24, vocab_size: 31, seq_len: 8, rope_theta: 10000, norm_eps: 1.0e-5, "
                                      "tie_embeddings: true, init_from: '" + src + "'}\n"
                                      "data: {format: synthetic, synthetic: {vocab: 31, branching: 3}}\n"
                                      "train: {global_batch_size: 2, micro_batch_size: 2, max_steps: 1, "
                                      "warmup_steps: 0, eval_steps: 1}\n"
                                      "output: {dir: '" + dir / "run2" + "', sample_tokens: 0}\n");
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job2.yaml" + "' 2>&1");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  fs::remove_all(src);
  r = export_cmd("--checkpoint '" + dir / "run2" + "' --out '" + dir / "hf2" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("model.init_from '" + src + "' is gone"));
  CHECK(entries(dir / "hf2") == std::set<std::string>{"config.json", "generation_config.json", "model.safetensors"});
}

TEST_CASE("export: a relative model.init_from is found from any cwd (the resolved spec holds it absolute)",
          "[export][llama]") {
  test::TempDir dir("export_relative");
  make_hf_llama(dir, {"rel", 1, 4, 2, 16, 24, 31, true, false});
  test::write_file(dir / "src_rel/tokenizer_config.json", "{\"model_max_length\": 64}\n");
  test::write_file(dir / "job.yaml", "model: {arch: llama, init_from: 'src_rel', seq_len: 8}\n"
                                     "data: {format: synthetic, synthetic: {vocab: 31, branching: 3}}\n"
                                     "train: {global_batch_size: 2, micro_batch_size: 2, max_steps: 1, "
                                     "warmup_steps: 0, eval_steps: 1}\n"
                                     "output: {dir: 'run', sample_tokens: 0}\n");
  // The job runs in `dir` (init_from relative to it); export runs elsewhere.
  auto r = test::run_command("cd '" + dir.path() + "' && OMP_NUM_THREADS=1 '" + test::trainrun_binary() +
                             "' --config job.yaml 2>&1");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(test::read_file(dir / "run/job.resolved.yaml"), Contains(dir / "src_rel"));
  r = export_cmd("--checkpoint '" + dir / "run" + "' --out '" + dir / "hf" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(test::read_file(dir / "hf/tokenizer_config.json") == "{\"model_max_length\": 64}\n");
}

TEST_CASE("export: GPT-2 from a Hugging Face directory, re-exported as bf16 shards, and generate from it",
          "[export][gpt2][hf]") {
  test::TempDir dir("export_gpt2");
  const std::string src = dir / "src";
  auto r = run_reference_script("hf_gpt2.py", "random --out '" + src + "' --n-layer 2 --n-head 3 --n-embd 24 "
                                              "--vocab 53 --n-positions 16 --seed 4");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  test::write_file(src + "/vocab.json", "{\"a\": 0}");
  test::write_file(src + "/merges.txt", "#version: 0.2\n");
  r = export_cmd("--checkpoint '" + src + "' --out '" + dir / "hf" + "' --dtype bf16 --max-shard-size 4KiB");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json idx = read_json(dir / "hf/model.safetensors.index.json");
  std::set<std::string> files;
  for (const auto& [k, f] : idx["weight_map"].items()) files.insert(f.get<std::string>());
  CHECK(files.size() > 1);
  CHECK(test::read_file(dir / "hf/vocab.json") == "{\"a\": 0}");
  CHECK(test::read_file(dir / "hf/merges.txt") == "#version: 0.2\n");
  // Read back: the source's weights rounded to bf16 (round to nearest even).
  std::vector<float> want, got;
  load_hf(src, want);
  load_hf(dir / "hf", got);
  REQUIRE(got.size() == want.size());
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &want[i], 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float w;
    std::memcpy(&w, &u, 4);
    bad += std::memcmp(&w, &got[i], 4) != 0;
  }
  CHECK(bad == 0);
  // transformers loads it (tied head, Conv1D layouts) and agrees with trainrun on the bf16 weights.
  const auto arch = make_model_arch(read_hf_model_config(dir / "hf", "test"));
  const std::vector<int32_t> in = random_tokens(2 * 16, 53, 9);
  const double e = rel_err(logits_of(*arch, got, in, 2, 16), hf_logits_of("hf_gpt2.py", dir / "hf", in, 2, 16, dir));
  CHECK(e <= 1e-5);
  // generate --checkpoint HF_DIR (GPT-2) is transformers' greedy.
  const auto theirs =
      run_reference_script("hf_gpt2.py", "generate --model '" + src + "' --prompt '3 9 27' --max-new-tokens 9");
  REQUIRE(theirs.exit_code == 0);
  const auto ours = test::run_trainrun("generate --checkpoint '" + src + "' --prompt '3 9 27' --max-tokens 9 --top-k 1");
  INFO(ours.err);
  REQUIRE(ours.exit_code == 0);
  CHECK(ours.out == theirs.out);
}

TEST_CASE("export: --max-shard-size reads sizes as Hugging Face does", "[export]") {
  CHECK(parse_max_shard_size("5GB") == 5000000000ull);
  CHECK(parse_max_shard_size("5gb") == 5000000000ull);
  CHECK(parse_max_shard_size("500MB") == 500000000ull);
  CHECK(parse_max_shard_size("1.5 GB") == 1500000000ull);
  CHECK(parse_max_shard_size("10KB") == 10000ull);
  CHECK(parse_max_shard_size("2GiB") == 2147483648ull);
  CHECK(parse_max_shard_size("3MiB") == 3145728ull);
  CHECK(parse_max_shard_size("1KiB") == 1024ull);
  CHECK(parse_max_shard_size("123456") == 123456ull);
  CHECK(parse_max_shard_size("100B") == 100ull);
  for (const char* bad : {"", "GB", "5XB", "0", "0.1", "-1", "1.2.3GB", "5 G B", "five"}) {
    INFO(bad);
    try {
      parse_max_shard_size(bad);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), Contains("--max-shard-size") && Contains("5GB = 5000000000"));
    }
  }
}

TEST_CASE("export: bad flags, a foreign --out and broken HF directories fail clearly and write nothing",
          "[export][bad]") {
  test::TempDir dir("export_bad");
  const LlamaVariant v{"bad", 1, 4, 2, 16, 24, 29, false, false};
  const std::string good = make_hf_llama(dir, v);
  const std::string x = dir / "x";

  // Usage errors: exit 2, the flag and what it accepts named.
  for (const char* s : {"5XB", "0", "-1", "lots"}) {
    INFO(s);
    auto r = export_cmd("--checkpoint '" + good + "' --out '" + x + "' --max-shard-size '" + s + "'");
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains("--max-shard-size") && Contains("KB/MB/GB/TB"));
  }
  auto r = export_cmd("--checkpoint '" + good + "' --out '" + x + "' --dtype fp16");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--dtype") && Contains("fp32") && Contains("bf16"));
  CHECK(!fs::exists(x));

  // --out holding a file an export did not write: refused, the file kept.
  test::write_file(x + "/notes.txt", "mine");
  test::write_file(x + "/config.json", "{}");
  r = export_cmd("--checkpoint '" + good + "' --out '" + x + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("notes.txt") && Contains("choose a new or empty directory"));
  CHECK(test::read_file(x + "/notes.txt") == "mine");
  CHECK(test::read_file(x + "/config.json") == "{}");
  // Its own source as --out.
  r = export_cmd("--checkpoint '" + good + "' --out '" + good + "/'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("is the directory exported from"));

  // Broken HF directories: the tensor and the file named, for export and generate.
  auto broken = [&](const std::string& name, const std::function<void(SafeTensorFile&)>& edit) {
    const std::string d = dir / name;
    fs::create_directories(d);
    fs::copy_file(good + "/config.json", d + "/config.json");
    SafeTensorFile f = read_safetensors(good + "/model.safetensors");
    edit(f);
    write_safetensors(d + "/model.safetensors", f);
    return d;
  };
  auto find = [](SafeTensorFile& f, const std::string& n) -> SafeTensor& {
    for (auto& t : f.tensors)
      if (t.name == n) return t;
    FAIL("no " << n);
    return f.tensors[0];
  };
  struct Case {
    std::string dir;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {broken("missing",
              [](SafeTensorFile& f) {
                f.tensors.erase(std::remove_if(f.tensors.begin(), f.tensors.end(),
                                               [](const SafeTensor& t) { return t.name == "model.norm.weight"; }),
                                f.tensors.end());
              }),
       {"has no tensor 'model.norm.weight'"}},
      {broken("shape",
              [&](SafeTensorFile& f) {
                SafeTensor& t = find(f, "model.layers.0.self_attn.k_proj.weight");
                t.shape = {16, 8};  // (KV, C) is (8, 16)
              }),
       {"model.safetensors", "tensor 'model.layers.0.self_attn.k_proj.weight' has shape (16, 8)",
        "implies (8, 16)"}},
      {broken("dtype",
              [&](SafeTensorFile& f) {
                SafeTensor& t = find(f, "model.layers.0.mlp.up_proj.weight");
                t.dtype = "I32";
              }),
       {"model.safetensors", "tensor 'model.layers.0.mlp.up_proj.weight' has dtype I32"}},
  };
  for (const auto& k : cases) {
    INFO(k.dir);
    const std::string out = dir / "out";
    r = export_cmd("--checkpoint '" + k.dir + "' --out '" + out + "'");
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("export: "));
    for (const auto& e : k.expect) CHECK_THAT(r.err, Contains(e));
    CHECK_THAT(r.err, Contains(k.dir));
    CHECK(!fs::exists(out));
    r = test::run_trainrun("generate --checkpoint '" + k.dir + "' --prompt '1 2' --max-tokens 2");
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("generate: "));
    for (const auto& e : k.expect) CHECK_THAT(r.err, Contains(e));
    CHECK(r.out.empty());
  }
  check_no_leftovers(dir.path());
}

TEST_CASE("export: streams (peak RSS of a 600 MB model's export stays far below the model)", "[export][scale]") {
  // A Llama whose two 302 MB tables (V=36864, C=2048, untied) are larger
  // than the 64 MiB export pieces: one of our model files (header from the
  // layout, zero weights: ftruncate leaves them as holes, which still fault
  // into the mapping as they are read).
  test::TempDir dir("export_rss");
  ModelConfig cfg;
  cfg.arch = "llama";
  cfg.L = 1, cfg.NH = 16, cfg.NKV = 8, cfg.C = 2048, cfg.F = 64, cfg.V = 36864, cfg.T = 16;
  cfg.tied = false;
  const auto arch = make_model_arch(cfg);
  const std::string header = model_file_header(*arch);
  const std::string file = dir / "model.safetensors";
  {
    std::ofstream f(file, std::ios::binary);
    f.write(header.data(), std::streamsize(header.size()));
  }
  const uint64_t model_bytes = uint64_t(arch->layout().total) * 4;
  fs::resize_file(file, header.size() + model_bytes);
  // The child's own peak RSS (RUSAGE_CHILDREN of a fresh python that ran only it).
  const std::string cmd = "import resource, subprocess, sys\n"
                          "r = subprocess.run(['" + test::trainrun_binary() + "', 'export', '--checkpoint', '" + file +
                          "', '--out', '" + dir / "hf" + "'], stdout=subprocess.DEVNULL)\n"
                          "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n";
  test::write_file(dir / "rss.py", cmd);
  const auto r = test::run_command("python3 '" + dir / "rss.py" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  std::istringstream is(r.out);
  int rc = -1;
  uint64_t maxrss_kib = 0;
  is >> rc >> maxrss_kib;
  REQUIRE(rc == 0);
  std::printf("export of a %.0f MB model: peak RSS %.0f MB\n", model_bytes / 1e6, maxrss_kib * 1024 / 1e6);
  CHECK(fs::file_size(dir / "hf/model.safetensors") > model_bytes);
  // Holding the model would be >= 600 MB; pieces of 64 MiB (the fp32 piece
  // and its mapped source pages) are ~135 MB.
  CHECK(maxrss_kib * 1024 < model_bytes / 2);
}

TEST_CASE("export: tiny pieces (transposed row blocks, split tensors) write the same files as whole tensors",
          "[export]") {
  test::TempDir dir("export_pieces");
  // Every value distinct, so a misplaced element cannot go unnoticed.
  auto random_weights = [](const ModelArch& arch) {
    std::vector<float> flat(size_t(arch.layout().total));
    std::mt19937 rng(11);
    std::normal_distribution<float> n(0.0f, 0.1f);
    for (auto& x : flat) x = n(rng);
    return flat;
  };
  ModelConfig gpt2 = ModelConfig::of(2, 3, 24, 53, 16);
  ModelConfig llama;
  llama.arch = "llama";
  llama.L = 2, llama.NH = 4, llama.NKV = 2, llama.C = 16, llama.F = 24, llama.V = 29, llama.T = 12;
  llama.tied = false;
  for (const ModelConfig& cfg : {gpt2, llama}) {
    INFO(cfg.arch);
    const auto arch = make_model_arch(cfg);
    const std::vector<float> flat = random_weights(*arch);
    for (const char* dtype : {"fp32", "bf16"}) {
      INFO(dtype);
      HfExportOptions whole;
      whole.dtype = dtype;
      export_hf(dir / "whole", cfg, flat, whole);
      // 7 and 100 floats: pieces that split rows and tensors, and transposed
      // blocks of a few rows (GPT-2's Conv1D matrices have 24 columns).
      for (const size_t piece : {size_t(28), size_t(400)}) {
        INFO(piece);
        HfExportOptions small = whole;
        small.piece_bytes = piece;
        export_hf(dir / "small", cfg, flat, small);
        CHECK(test::read_file(dir / "small/model.safetensors") == test::read_file(dir / "whole/model.safetensors"));
      }
    }
    // And the fp32 export reads back as the weights, bit for bit.
    export_hf(dir / "hf", cfg, flat, [] {
      HfExportOptions o;
      o.piece_bytes = 28;
      return o;
    }());
    std::vector<float> back;
    load_hf(dir / "hf", back);
    REQUIRE(back.size() == flat.size());
    CHECK(std::memcmp(back.data(), flat.data(), flat.size() * 4) == 0);
  }
}

TEST_CASE("export: shards split where save_pretrained splits them (the same index, byte for byte)", "[export][hf]") {
  test::TempDir dir("export_shards");
  // save_pretrained's own sharded saves, re-exported at the same limit.
  struct Src {
    std::string name, dir;
  };
  std::vector<Src> srcs;
  for (const bool tied : {false, true}) {
    const LlamaVariant v{tied ? "tied" : "untied", 2, 4, 2, 16, 24, 29, tied, false};
    srcs.push_back({v.name, make_hf_llama(dir, v, " --max-shard-size 3KB")});
  }
  auto r = run_reference_script("hf_gpt2.py", "random --out '" + dir / "gpt2" + "' --n-layer 2 --n-head 2 --n-embd 16 "
                                    "--vocab 37 --n-positions 12 --seed 2 --max-shard-size 3KB");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  srcs.push_back({"gpt2", dir / "gpt2"});
  for (const auto& s : srcs) {
    INFO(s.name);
    REQUIRE(test::file_exists(s.dir + "/model.safetensors.index.json"));
    const std::string out = dir / ("out_" + s.name);
    r = export_cmd("--checkpoint '" + s.dir + "' --out '" + out + "' --max-shard-size 3KB");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(test::read_file(out + "/model.safetensors.index.json") ==
          test::read_file(s.dir + "/model.safetensors.index.json"));
    const json idx = read_json(out + "/model.safetensors.index.json");
    REQUIRE(idx["weight_map"].size() > 10);
    for (const auto& [name, file] : idx["weight_map"].items()) {
      INFO(name);
      // The same tensor, bit for bit, in the same shard.
      const SafeTensorFile a = read_safetensors(out + "/" + file.get<std::string>());
      const SafeTensorFile b = read_safetensors(s.dir + "/" + file.get<std::string>());
      REQUIRE(a.find(name));
      REQUIRE(b.find(name));
      CHECK(a.find(name)->shape == b.find(name)->shape);
      CHECK(a.find(name)->data == b.find(name)->data);
    }
  }
}
