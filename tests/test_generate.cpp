// Sampling with a KV cache (core/model/gpt2/gpt2_decoder.h, core/train/generate.h):
//  - the decoder's logits equal the full forward's at every position, for a
//    chunked prefill longer than one chunk and for single-token steps, on
//    the plain and the row-padded (GPU-like) logits path;
//  - past the model's context the cache refills from the newest half of the
//    sequence, exactly as a full-recompute sampler following that rule;
//  - the end-of-run sample of a sharded multi-rank run (every rank decoding
//    together, units gathered per step) is the same text `trainrun generate`
//    samples from the written weights with the same seed.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "core/model/gpt2/gpt2.h"
#include "core/model/gpt2/gpt2_arch.h"
#include "core/model/gpt2/gpt2_decoder.h"
#include "core/train/generate.h"
#include "kernels/backend.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

std::vector<float> random_weights(const GPT2Config& cfg, unsigned seed, float stddev = 0.15f) {
  const ParamLayout lay = make_gpt2_layout(cfg);
  std::vector<float> flat(size_t(lay.total));
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, stddev);
  for (const auto& t : lay.tensors) {
    const bool gain = t.name.find("ln_") != std::string::npos && t.name.find(".weight") != std::string::npos;
    for (int64_t i = 0; i < t.numel; ++i) flat[size_t(t.offset + i)] = (gain ? 1.0f : 0.0f) + n(rng);
  }
  return flat;
}

// A model on a CPU backend with its weights in one flat buffer.
struct Loaded {
  std::unique_ptr<Backend> be;
  ParamLayout lay;
  DeviceBuffer params;
  std::unique_ptr<FlatUnitAccess> units;
  Loaded(const GPT2Config& cfg, const std::vector<float>& flat, int logits_align)
      : be(make_cpu_backend(2, logits_align)), lay(make_gpt2_layout(cfg)) {
    params = DeviceBuffer(be.get(), flat.size() * 4);
    be->copy_to_device(params.get(), flat.data(), flat.size() * 4);
    units = std::make_unique<FlatUnitAccess>(lay, params.get(), nullptr, be->act_dtype());
  }
};

// The last position's logits from a full forward over `seq` (no cache).
std::vector<float> full_forward_last(Loaded& m, const GPT2Config& cfg, const std::vector<int32_t>& seq) {
  GPT2 model(cfg, m.be.get(), 1, false);
  DeviceBuffer in(m.be.get(), seq.size() * 4);
  m.be->copy_to_device(in.get(), seq.data(), seq.size() * 4);
  model.forward(*m.units, in.as<int32_t>(), nullptr, 1, int(seq.size()), false, 0.0f);
  std::vector<float> row(size_t(model.logits_stride()));
  m.be->copy_to_host(row.data(), static_cast<const float*>(model.logits()) + (seq.size() - 1) * row.size(),
                     row.size() * 4);
  row.resize(size_t(cfg.V));
  return row;
}

using test::rel_err;

std::vector<int32_t> tokens(int n, int V, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = int32_t(rng() % unsigned(V));
  return v;
}

}  // namespace

TEST_CASE("generate: the KV-cached decoder gives the full forward's logits at every step", "[generate]") {
  // T above the decoder's chunk so the prompt is prefilled in two chunks
  // (the second one at pos > 0 with several rows), odd sizes throughout.
  const GPT2Config cfg = GPT2Config::of(2, 3, 24, 53, GPT2Decoder::kChunk + 40);
  const std::vector<float> flat = random_weights(cfg, 5);
  for (int align : {1, 64}) {
    INFO("logits rows padded to " << align);
    Loaded m(cfg, flat, align);
    std::vector<int32_t> seq = tokens(GPT2Decoder::kChunk + 14, cfg.V, 6);
    GPT2Decoder dec(cfg, m.be.get(), cfg.T);
    std::vector<float> logits;
    dec.feed(*m.units, seq.data(), int(seq.size()), logits);
    CHECK(dec.position() == int(seq.size()));
    double worst = rel_err(logits, full_forward_last(m, cfg, seq));
    for (int step = 0; step < 6; ++step) {
      const int32_t next = int32_t((step * 17 + 3) % cfg.V);
      seq.push_back(next);
      dec.feed(*m.units, &next, 1, logits);
      worst = std::max(worst, rel_err(logits, full_forward_last(m, cfg, seq)));
    }
    INFO("worst relative error of the logits, cached vs full forward: " << worst);
    CHECK(worst < 1e-5);
  }
  // Feeding past the capacity is refused, naming the numbers.
  Loaded m(cfg, flat, 1);
  GPT2Decoder small(cfg, m.be.get(), 4);
  std::vector<float> logits;
  const std::vector<int32_t> five = tokens(5, cfg.V, 7);
  CHECK_THROWS_WITH(small.feed(*m.units, five.data(), 5, logits), Contains("capacity of 4"));
}

TEST_CASE("generate: past the model's context the cache refills from the newest half", "[generate]") {
  const GPT2Config cfg = GPT2Config::of(2, 2, 16, 29, 12);
  // Large weights: attention far from uniform, so the next token depends on
  // the whole window (with small ones it follows the last token alone, and
  // a wrong window would go unnoticed).
  const std::vector<float> flat = random_weights(cfg, 8, 0.8f);
  Loaded m(cfg, flat, 1);
  SampleOptions so;
  so.max_tokens = 40;  // more than three windows
  so.top_k = 1;
  const std::vector<int32_t> prompt = {3, 1, 4};
  const std::vector<int32_t> got = sample_tokens(m.be.get(), *m.units, GPT2Arch(cfg), prompt, so);
  REQUIRE(got.size() == prompt.size() + 40);
  // The same rule by full recomputation: the context is seq[start:], and
  // when it already holds T tokens the next one starts a window of the
  // newest T/2.
  std::vector<int32_t> seq = prompt;
  size_t start = 0;
  for (int i = 0; i < so.max_tokens; ++i) {
    const std::vector<int32_t> ctx(seq.begin() + long(start), seq.end());
    const std::vector<float> l = full_forward_last(m, cfg, ctx);
    seq.push_back(int32_t(std::max_element(l.begin(), l.end()) - l.begin()));
    if (seq.size() - start > size_t(cfg.T)) start = seq.size() - size_t(cfg.T / 2);
  }
  CHECK(got == seq);
}

TEST_CASE("generate: a sharded run's end-of-run sample is what generate samples from its weights", "[generate]") {
  test::TempDir dir("generate");
  for (const auto& [strategy, ranks] : std::vector<std::pair<std::string, int>>{{"full_shard", 2}, {"shard_grad_op", 3}}) {
    INFO(strategy << " over " << ranks << " ranks");
    const std::string run = dir / (strategy + "_run");
    test::write_file(dir / "job.yaml",
                     "model: {n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 256, seq_len: 32}\n"
                     "data: {format: synthetic}\n"
                     "train: {global_batch_size: 6, micro_batch_size: 1, max_steps: 4, warmup_steps: 1, seed: 42}\n"
                     "parallel: {nproc_per_node: " + std::to_string(ranks) + ", sharding: " + strategy +
                     ", timeout_s: 60}\n"
                     "checkpoint: {final: 'false'}\n"
                     "output: {dir: '" + run + "', sample_tokens: 45, sample_prompt: 'ab'}\n");
    auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    // 2 + 45 > T = 32: the sample outgrew the context and refilled the cache.
    auto g = test::run_trainrun("generate --checkpoint '" + run + "/model.safetensors' --prompt ab --max-tokens 45 "
                                "--temperature 0.8 --top-k 40 --seed 42");
    INFO(g.err);
    REQUIRE(g.exit_code == 0);
    REQUIRE(g.out.size() == 47);
    const std::string log = test::read_file(run + "/logs/rank0.log");
    CHECK(log.find("sample:\n" + g.out) != std::string::npos);
  }
}

TEST_CASE("generate: a text sample_prompt for a non-byte vocab skips the end-of-run sample, it does not fail the job",
          "[generate]") {
  // A BPE-data run (vocab 64 here) with the default-looking prompt "The ":
  // the sample cannot encode it (no tokenizer in the run). It is said at
  // setup and at the end, and the job still ends 0 with its weights; ids work.
  test::TempDir dir("generate_text_prompt");
  for (const std::string tp : {"1", "2"}) {
    INFO("tensor_parallel " << tp);
    const std::string run = dir / ("run" + tp);
    test::write_file(dir / "job.yaml",
                     "model: {arch: llama, n_layer: 1, n_head: 2, n_kv_head: 2, n_embd: 16, ffn_dim: 32, "
                     "vocab_size: 64, seq_len: 16}\n"
                     "data: {format: synthetic}\n"
                     "train: {global_batch_size: 2, micro_batch_size: 1, max_steps: 2, warmup_steps: 1}\n"
                     "parallel: {nproc_per_node: " + tp + ", tensor_parallel: " + tp + ", timeout_s: 60}\n"
                     "checkpoint: {final: 'false'}\n"
                     "output: {dir: '" + run + "', sample_tokens: 5, sample_prompt: 'The '}\n");
    auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(test::file_exists(run + "/model.safetensors"));
    // One worker runs in process (its log is stderr); two write logs/rank0.log.
    const std::string log = tp == "1" ? r.err : test::read_file(run + "/logs/rank0.log");
    const size_t first = log.find("sample: skipped: output.sample_prompt 'The ' is text");
    REQUIRE(first != std::string::npos);
    CHECK(log.find("vocab is 64 (not bytes)", first) != std::string::npos);
    CHECK(log.find("sample: skipped: output.sample_prompt", first + 1) != std::string::npos);  // at setup and at the end
    CHECK(log.find("sample:\n") == std::string::npos);
    // Token ids are a prompt such a model can take.
    auto ids = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" +
                                 "' --set output.sample_prompt='1 2' --set output.dir='" + run + "_ids'");
    INFO(ids.err);
    REQUIRE(ids.exit_code == 0);
    const std::string ids_log = tp == "1" ? ids.err : test::read_file(run + "_ids/logs/rank0.log");
    CHECK(ids_log.find("sample") != std::string::npos);
    CHECK(ids_log.find("sample: skipped") == std::string::npos);
  }
}

TEST_CASE("generate: a stop token ends the sample right after it, as transformers stops at eos", "[generate]") {
  const GPT2Config cfg = GPT2Config::of(2, 2, 16, 29, 12);
  const std::vector<float> flat = random_weights(cfg, 8, 0.8f);
  Loaded m(cfg, flat, 1);
  SampleOptions so;
  so.max_tokens = 8;
  so.top_k = 1;
  const std::vector<int32_t> prompt = {3, 1, 4};
  const std::vector<int32_t> full = sample_tokens(m.be.get(), *m.units, GPT2Arch(cfg), prompt, so);
  REQUIRE(full.size() == prompt.size() + 8);
  // Stop at the third sampled token (the first of its value).
  const int32_t stop = full[prompt.size() + 2];
  size_t first = prompt.size();
  while (full[first] != stop) ++first;
  so.stop_tokens = {stop};
  const std::vector<int32_t> got = sample_tokens(m.be.get(), *m.units, GPT2Arch(cfg), prompt, so);
  CHECK(got == std::vector<int32_t>(full.begin(), full.begin() + long(first) + 1));
}

TEST_CASE("generate: vocab_limit keeps samples inside the tokenizer's vocab of a padded model vocab",
          "[generate]") {
  // V = 61 padded, a tokenizer of 40: without the limit a random model
  // samples ids >= 40 (checked, so the case can fail); with it, never, at a
  // high temperature and greedy alike.
  const GPT2Config cfg = GPT2Config::of(2, 2, 16, 61, 24);
  const std::vector<float> flat = random_weights(cfg, 5, 1.5f);
  Loaded m(cfg, flat, 1);
  SampleOptions so;
  so.max_tokens = 20;
  so.temperature = 3.0;
  const std::vector<int32_t> prompt = {3, 1, 4};
  int outside = 0;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    so.seed = seed;
    for (int32_t t : sample_tokens(m.be.get(), *m.units, GPT2Arch(cfg), prompt, so)) outside += t >= 40;
  }
  REQUIRE(outside > 0);
  so.vocab_limit = 40;
  for (int top_k : {0, 1, 5}) {
    so.top_k = top_k;
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      so.seed = seed;
      for (int32_t t : sample_tokens(m.be.get(), *m.units, GPT2Arch(cfg), prompt, so)) {
        INFO("top_k " << top_k << ", seed " << seed);
        CHECK(t < 40);
      }
    }
  }
}

// ---- text in and out through the model's tokenizer.json ----------------------------------

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/data/tokenizer/tokenizer.h"

namespace {
uint32_t Tokenizer_vocab_of(const std::string& path) { return Tokenizer::load(path).vocab_size(); }
}  // namespace

TEST_CASE("generate: the prompt and the output go through the model's tokenizer.json, as transformers' greedy",
          "[generate][tokenizer][hf]") {
  test::TempDir dir("gen_tok");
  const std::string py = test::hf_python();
  // A Llama-3-style tokenizer trained offline on text the test writes, and a
  // random Llama with its vocab.
  std::string corpus;
  for (int i = 0; i < 200; ++i)
    corpus += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 17) + "\nHello there, friend.\n";
  test::write_file(dir / "corpus.txt", corpus);
  test::RunResult r = test::run_command("'" + py + "' '" + test::source_dir() +
                                        "/scripts/reference/hf_tokenizer.py' make --dir '" + dir / "tok" +
                                        "' --corpus '" + dir / "corpus.txt" + "' --vocab 300");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const int vocab = int(Tokenizer_vocab_of(dir / "tok/llama3.json"));
  const std::string model = dir / "model";
  r = test::run_command("OMP_NUM_THREADS=1 '" + py + "' '" + test::source_dir() +
                        "/scripts/reference/hf_llama.py' random --out '" + model +
                        "' --layers 2 --hidden 16 --heads 4 --kv-heads 2 --intermediate 24 --vocab " +
                        std::to_string(vocab) + " --max-positions 64 --rope-theta 10000 --seed 5");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  std::filesystem::copy_file(dir / "tok/llama3.json", model + "/tokenizer.json");

  const std::string prompt = "the quick brown fox";
  const test::RunResult want = test::run_command("OMP_NUM_THREADS=1 '" + py + "' '" + test::source_dir() +
                                                 "/scripts/reference/hf_llama.py' generate-text --model '" + model +
                                                 "' --prompt '" + prompt + "' --max-new-tokens 6");
  INFO(want.err);
  REQUIRE(want.exit_code == 0);
  const test::RunResult got = test::run_trainrun("generate --checkpoint '" + model + "' --prompt '" + prompt +
                                                 "' --top-k 1 --max-tokens 6");
  INFO(got.err);
  REQUIRE(got.exit_code == 0);
  CHECK(got.out == want.out + "\n");
  CHECK_THAT(want.out, Catch::Matchers::StartsWith("<|begin_of_text|>the quick brown fox"));
  CHECK_THAT(got.err, Contains("tokenizer " + model + "/tokenizer.json"));

  // --chat: the prompt as a user turn of the Llama 3 template, then the assistant's header.
  const test::RunResult chat = test::run_trainrun("generate --checkpoint '" + model +
                                                  "' --prompt Hello --system 'Be brief.' --chat --top-k 1 --max-tokens 3");
  INFO(chat.err);
  REQUIRE(chat.exit_code == 0);
  // No chat_template beside the tokenizer: the llama3 built-in, Meta's Llama 3.1 template.
  CHECK_THAT(chat.out, Catch::Matchers::StartsWith(
                           "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                           "December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
                           "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n"));

  // Bad: a tokenizer larger than the model's vocab; --chat without a tokenizer; --system without --chat.
  r = test::run_command("OMP_NUM_THREADS=1 '" + py + "' '" + test::source_dir() +
                        "/scripts/reference/hf_llama.py' random --out '" + dir / "small" +
                        "' --layers 1 --hidden 16 --heads 4 --kv-heads 2 --intermediate 24 --vocab 100"
                        " --max-positions 64 --seed 5");
  REQUIRE(r.exit_code == 0);
  const test::RunResult big = test::run_trainrun("generate --checkpoint '" + dir / "small" + "' --tokenizer '" +
                                                 dir / "tok/llama3.json" + "' --prompt hi --max-tokens 1");
  CHECK(big.exit_code != 0);
  CHECK_THAT(big.err, Contains("has " + std::to_string(vocab) + " tokens but the model's vocab is 100"));
  const test::RunResult nochat =
      test::run_trainrun("generate --checkpoint '" + dir / "small" + "' --prompt '1 2' --chat --max-tokens 1");
  CHECK(nochat.exit_code != 0);
  CHECK_THAT(nochat.err, Contains("generate --chat: no tokenizer.json with the model"));
  const test::RunResult sys =
      test::run_trainrun("generate --checkpoint '" + model + "' --prompt hi --system x --max-tokens 1");
  CHECK(sys.exit_code != 0);
  CHECK_THAT(sys.err, Contains("--chat-template and --system apply to --chat"));
}

TEST_CASE("generate --chat: the model's own chat template, greedy, as apply_chat_template + transformers' generate",
          "[generate][chat][hf]") {
  test::TempDir dir("gen_chat");
  const std::string py = test::hf_python();
  // A byte-level tokenizer with the templates' special tokens (saved by
  // transformers: tokenizer.json + tokenizer_config.json), its config given
  // Qwen2.5's template, and a random Llama over its vocab.
  const std::string model = dir / "model";
  test::RunResult r = test::run_command("'" + py + "' '" + test::source_dir() +
                                        "/scripts/reference/hf_chat_template.py' tokenizer '" + dir / "tok" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const int vocab = int(Tokenizer_vocab_of(dir / "tok/tokenizer.json"));
  r = test::run_command("OMP_NUM_THREADS=1 '" + py + "' '" + test::source_dir() +
                        "/scripts/reference/hf_llama.py' random --out '" + model +
                        "' --layers 2 --hidden 16 --heads 4 --kv-heads 2 --intermediate 24 --vocab " +
                        std::to_string(vocab) + " --max-positions 128 --rope-theta 10000 --seed 7");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  for (const char* f : {"tokenizer.json", "special_tokens_map.json"})
    std::filesystem::copy_file(dir / "tok/" + f, model + "/" + f);
  nlohmann::json config = nlohmann::json::parse(test::read_file(dir / "tok/tokenizer_config.json"));
  config["chat_template"] = test::read_file(test::source_dir() + "/tests/fixtures/chat_templates/qwen2.5.jinja");
  test::write_file(model + "/tokenizer_config.json", config.dump());

  for (const std::string system : {"", "Be brief."}) {
    INFO("system: " << system);
    const test::RunResult want = test::run_command(
        "OMP_NUM_THREADS=1 '" + py + "' '" + test::source_dir() + "/scripts/reference/hf_llama.py' generate-chat --model '" +
        model + "' --prompt 'Hello there' --system '" + system + "' --stop '<|im_end|>' --max-new-tokens 8");
    INFO(want.err);
    REQUIRE(want.exit_code == 0);
    const test::RunResult got = test::run_trainrun("generate --checkpoint '" + model + "' --prompt 'Hello there' --chat" +
                                                   (system.empty() ? "" : " --system '" + system + "'") +
                                                   " --top-k 1 --max-tokens 8");
    INFO(got.err);
    REQUIRE(got.exit_code == 0);
    CHECK(got.out == want.out + "\n");
    CHECK_THAT(got.err, Contains("chat template " + model + "/tokenizer_config.json chat_template"));
    CHECK_THAT(want.out, Catch::Matchers::StartsWith(system.empty() ? "<|im_start|>system\nYou are Qwen"
                                                                     : "<|im_start|>system\nBe brief.<|im_end|>"));
  }
}
