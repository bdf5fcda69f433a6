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
