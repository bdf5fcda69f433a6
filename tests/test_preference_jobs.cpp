// Preference tuning jobs (train.objective dpo | ipo | orpo;
// core/train/preference.h), run by the trainrun binary on tiny GPT-2s:
// TRL's metric names in metrics.jsonl and TensorBoard; step 1 of dpo is
// log 2 (the precomputed reference equals the live policy); 1 rank == 2 and
// 4 ranks, no_shard and tp2; the sidecar read back, recomputed for another
// model, refused on resume without it and resumed exactly with it;
// adapter_off == precompute under LoRA (DoRA, QLoRA start at log 2); ipo
// and orpo train; a tiny model learns a fixed chosen pattern; the refusals.
// The formulas, prepare and the network's gradient: tests/test_preference.cpp.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <tuple>
#include <fstream>
#include <filesystem>
#include <map>
#include <random>
#include <nlohmann/json.hpp>

#include "core/config/job_spec.h"
#include "core/data/dataset.h"
#include "core/data/preference_pairs.h"
#include "tests/support/preference_data.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using json = nlohmann::json;

using test::PrefPair;
using test::read_metrics;
using test::random_pairs;
using test::run_job;
using test::write_pref_dir;
using Pair = test::PrefPair;

namespace {
// A 16-pair data set and a tiny GPT-2 job on it; `extra` YAML lines appended.
struct JobDir {
  test::TempDir d{"prefjob"};
  JobDir() {
    std::filesystem::create_directories(d / "data");
    write_pref_dir(d / "data", random_pairs(16, 32, 3, 8), 32);
  }
  std::string yaml(const std::string& run, const std::string& extra) const {
    const std::string path = d / (run + ".yaml");
    test::write_file(path, "model: {arch: gpt2, n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 32, seq_len: 16}\n"
                           "data: {format: llmc, train: '" + (d / "data") + "/train_*.bin'}\n"
                           "train: {objective: dpo, dpo_beta: 0.1, global_batch_size: 32, micro_batch_size: 8, "
                           "max_steps: 3, lr: 1.0e-2, warmup_steps: 0, log_interval: 1, eval_interval: 0, "
                           "grad_clip: 0}\n"
                           "output: {dir: '" + (d / run) + "', sample_tokens: 0}\n" + extra);
    return path;
  }
};

void check_same(const std::vector<std::map<std::string, double>>& a, const std::vector<std::map<std::string, double>>& b,
                const std::string& what) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (const char* k : {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                          "logps/chosen", "logps/rejected", "grad_norm"}) {
      // At z = 0 (step 1: policy == reference) a pair's "chosen reward >
      // rejected reward" compares rounding noise (TP's sums differ in the
      // last bits): the share is not a figure to compare there.
      if (std::string(k) == "rewards/accuracies" && std::fabs(b[i].at("rewards/margins")) < 1e-6) continue;
      INFO(what << " step " << i + 1 << " " << k << ": " << a[i].at(k) << " vs " << b[i].at(k));
      const double e = std::fabs(a[i].at(k) - b[i].at(k)) / (1e-3 + std::fabs(b[i].at(k)));
      CHECK(e <= 2e-5);
      worst = std::max(worst, e);
    }
  std::printf("  %s: %zu steps, max relative difference %.1e\n", what.c_str(), a.size(), worst);
}
}  // namespace

TEST_CASE("preference jobs: TRL's metric names, step 1 is log 2 (precomputed == live reference), 1 rank == 2 and 4 "
          "ranks, sharding strategies and tp2, the sidecar is reused, recomputed, or refused on resume",
          "[preference][train]") {
  JobDir j;
  auto run = [&](const std::string& name, const std::string& extra, const std::string& sets = "") {
    const auto r = run_job(j.yaml(name, extra), sets);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    return std::make_pair(read_metrics(j.d / name), r.out);
  };
  const auto [one, log1] = run("r1", "parallel: {nproc_per_node: 1}\n");
  CHECK_THAT(log1, Contains("reference: computing 16 pairs' log-probs") && Contains("it does not exist"));
  REQUIRE(one.size() == 3);
  for (const char* k : {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                        "logps/rejected"})
    CHECK(one[0].count(k) == 1);
  // Step 1: the policy is the starting weights, which the precomputed
  // reference was made from: z = 0, loss log 2, rewards 0.
  CHECK(std::fabs(one[0].at("loss") - std::log(2.0)) < 1e-6);
  CHECK(std::fabs(one[0].at("rewards/chosen")) < 1e-6);
  CHECK(std::fabs(one[0].at("rewards/margins")) < 1e-6);
  CHECK(one[2].at("loss") < one[0].at("loss"));  // it trains
  // TensorBoard has the same names.
  std::string tb;
  for (const auto& e : std::filesystem::directory_iterator(j.d / "r1/tb")) tb += test::read_file(e.path());
  CHECK_THAT(tb, Contains("rewards/accuracies") && Contains("logps/rejected"));

  // The sidecar is in the run's own directory (never beside the shared
  // data), and a run in a directory that holds one keyed to this data and
  // model reads it back...
  namespace fs = std::filesystem;
  const std::string sidecar = j.d / "r1/train.reference_logps";
  REQUIRE(test::file_exists(sidecar));
  CHECK(!test::file_exists(j.d / "data/train.reference_logps"));
  const std::string kept1 = test::read_file(sidecar);
  auto seed_dir = [&](const std::string& run, const std::string& bytes) {
    fs::create_directories(j.d / run);
    test::write_file(j.d / (run + "/train.reference_logps"), bytes);
    return std::string(j.d / (run + "/train.reference_logps"));
  };
  const std::string sc1b = seed_dir("r1b", kept1);
  const auto [again, log2] = run("r1b", "parallel: {nproc_per_node: 1}\n");
  CHECK_THAT(log2, Contains("reference: 16 pairs' log-probs from " + sc1b));
  check_same(again, one, "sidecar read back vs computed");
  // ... and recomputes it, saying why, for another model (here: another seed).
  seed_dir("r1d", kept1);
  const auto r = run_job(j.yaml("r1d", "parallel: {nproc_per_node: 1}\n"), "--set train.seed=7");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("reference: computing") && Contains("it was made for data") && Contains("this job has"));
  // A damaged sidecar is refused by name, never used or silently replaced:
  // one cut short (a torn write) and one holding a NaN.
  std::string nan_bytes = kept1;
  const double nan = std::nan("");
  std::memcpy(&nan_bytes[40 + 3 * 8], &nan, 8);  // pair 1's rejected log-prob
  for (const auto& [name, bytes, what] :
       {std::make_tuple(std::string("cut"), kept1.substr(0, kept1.size() - 12), std::string("bytes of log-probs")),
        std::make_tuple(std::string("nan"), nan_bytes, std::string("pair 1's rejected log-prob is nan"))}) {
    const std::string sc = seed_dir(name, bytes);
    const auto b = run_job(j.yaml(name, "parallel: {nproc_per_node: 1}\n"), "--set launcher.max_restarts=0");
    INFO(name << "\n" << b.out);
    CHECK(b.exit_code != 0);
    CHECK_THAT(b.out, Contains("the reference log-probs '" + sc + "' are damaged") && Contains(what) &&
                          Contains("Delete the file to recompute them"));
    CHECK(test::read_file(sc) == bytes);  // left as it was, for a look
  }

  const std::string mb2 = "--set train.micro_batch_size=2", mb4 = "--set train.micro_batch_size=4";
  check_same(run("r1m2", "parallel: {nproc_per_node: 1}\n", mb2).first, one, "1 rank, 4 micro-batches vs 1");
  // 2 and 4 ranks compute the reference themselves (each its share of the pairs).
  const auto [two, log_two] = run("r2", "parallel: {nproc_per_node: 2}\n", mb4);
  CHECK_THAT(log_two, Contains("reference: computing 16 pairs"));
  check_same(two, one, "2 ranks full_shard");
  check_same(run("r4", "parallel: {nproc_per_node: 4}\n", mb2).first, one, "4 ranks full_shard");
  check_same(run("r2ns", "parallel: {nproc_per_node: 2, sharding: no_shard}\n", mb4).first, one, "2 ranks no_shard");
  check_same(run("tp2", "parallel: {nproc_per_node: 2, tensor_parallel: 2}\n").first, one, "tp2");
  // Pipelines: the last stage weights each microbatch's gradient in the
  // executor's hook, and records the reference pass (computed here).
  const auto [pp, log_pp] = run("pp2", "parallel: {nproc_per_node: 2, pipeline_parallel: 2}\n", mb4);
  CHECK_THAT(log_pp, Contains("reference: computing 16 pairs"));
  check_same(pp, one, "pp2 1f1b");
  check_same(run("pp2g", "parallel: {nproc_per_node: 2, pipeline_parallel: 2, pipeline_schedule: gpipe}\n", mb4).first,
             one, "pp2 gpipe");
  check_same(run("pp2dp2", "parallel: {nproc_per_node: 4, pipeline_parallel: 2}\n", mb4).first, one, "pp2 x dp2");

  // A resumed run must not recompute the reference from trained weights.
  const std::string y = j.yaml("res", "parallel: {nproc_per_node: 1}\ncheckpoint: {interval: 1}\n");
  auto first = run_job(y, "--set train.exit_interval=2");
  INFO(first.out);
  REQUIRE(first.exit_code == 0);
  const std::string res_sidecar = j.d / "res/train.reference_logps";
  const std::string kept = test::read_file(res_sidecar);
  std::filesystem::remove(res_sidecar);
  const auto resumed = run_job(y, "--set train.exit_interval=2 --set launcher.max_restarts=0");
  INFO(resumed.out);
  CHECK(resumed.exit_code != 0);
  CHECK_THAT(resumed.out, Contains("train.reference precompute: resuming") && Contains(res_sidecar) &&
                              Contains("it does not exist") && Contains("starting weights"));
  test::write_file(res_sidecar, kept);
  // Another job on the same data, with another model and seq_len, runs
  // before the first resumes: it keeps its own reference, and the first
  // resumes with its own.
  const auto other = run_job(j.yaml("other", "parallel: {nproc_per_node: 1}\n"),
                             "--set model.n_embd=64 --set model.seq_len=24 --set train.max_steps=1");
  INFO(other.out);
  REQUIRE(other.exit_code == 0);
  CHECK_THAT(other.out, Contains("reference: computing 16 pairs"));
  CHECK(test::read_file(j.d / "other/train.reference_logps") != kept);
  CHECK(test::read_file(res_sidecar) == kept);
  // The resumed run reads its file and continues the run exactly: its step
  // 3 is the uninterrupted run's.
  const auto ok = run_job(y, "--set launcher.max_restarts=0");
  INFO(ok.out);
  REQUIRE(ok.exit_code == 0);
  CHECK_THAT(ok.out, Contains("reference: 16 pairs' log-probs from"));
  const auto res = read_metrics(j.d / "res");
  REQUIRE(res.size() == 3);
  check_same({res[2]}, {one[2]}, "resumed at step 2 vs uninterrupted, step 3");
}

TEST_CASE("preference jobs under LoRA: the adapters-off reference equals the precomputed one, step by step, ipo and "
          "orpo train", "[preference][train]") {
  JobDir j;
  const std::string lora = "parallel: {nproc_per_node: 1}\n";
  auto run = [&](const std::string& name, const std::string& sets) {
    const auto r = run_job(j.yaml(name, lora), "--set model.adapter.type=lora --set model.adapter.rank=4 " + sets);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    return std::make_pair(read_metrics(j.d / name), r.out);
  };
  // LoRA's B starts at zero: the adapters-off network is the starting
  // policy, which the precompute pass ran; every step's reference is equal.
  const auto [pre, log_pre] = run("pre", "--set train.reference=precompute");
  const auto [off, log_off] = run("off", "--set train.reference=adapter_off");
  CHECK_THAT(log_pre, Contains("reference: computing 16 pairs"));
  CHECK_THAT(log_off, !Contains("reference: computing"));
  check_same(off, pre, "adapter_off vs precompute (LoRA)");
  CHECK(std::fabs(off[0].at("loss") - std::log(2.0)) < 1e-6);
  CHECK(off[2].at("loss") < off[0].at("loss"));
  // dp2 with the live reference.
  const auto r2 = run_job(j.yaml("off2", "parallel: {nproc_per_node: 2}\n"),
                          "--set model.adapter.type=lora --set model.adapter.rank=4 --set train.reference=adapter_off "
                          "--set train.micro_batch_size=4");
  INFO(r2.out);
  REQUIRE(r2.exit_code == 0);
  check_same(read_metrics(j.d / "off2"), off, "adapter_off: 2 ranks vs 1");

  // DoRA (its magnitudes start at ||W||) and QLoRA (the reference is the
  // NF4 base): the adapters-off reference is the starting policy too.
  for (const std::string sets : {std::string("--set model.adapter.type=dora"), std::string("--set model.base_dtype=nf4")}) {
    const bool dora = sets.find("dora") != std::string::npos;
    const auto [m, log] = run(dora ? "dora" : "qlora", "--set train.reference=adapter_off " + sets);
    INFO(sets);
    CHECK_THAT(log, Contains(dora ? "adapter: dora" : "frozen nf4"));
    REQUIRE(m.size() == 3);
    CHECK(std::fabs(m[0].at("loss") - std::log(2.0)) < 1e-5);
    CHECK(m[2].at("loss") < m[0].at("loss"));
  }
  for (const std::string obj : {"ipo", "orpo"}) {
    const auto m = run(obj, "--set train.objective=" + obj).first;
    INFO(obj);
    REQUIRE(m.size() == 3);
    CHECK(m[2].at("loss") < m[0].at("loss"));
    if (obj == "orpo") CHECK(m[0].count("nll_loss") == 1);
  }
  // ORPO's metrics as TRL's ORPOTrainer logs them, on a batch of one pair,
  // where the logged means are that pair's values: with a_c, a_r its
  // length-averaged log-probs (logps/*), log_odds_chosen is the log odds
  // ratio lo = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)),
  // log_odds_ratio is log sigmoid(lo), nll_loss is -a_c, and the loss is
  // nll_loss - beta log_odds_ratio.
  {
    const auto m = run("orpo1", "--set train.objective=orpo --set train.global_batch_size=2 "
                                "--set train.micro_batch_size=2 --set train.max_steps=1").first;
    REQUIRE(m.size() == 1);
    REQUIRE(m[0].count("log_odds_ratio") == 1);
    REQUIRE(m[0].count("log_odds_chosen") == 1);
    const double ac = m[0].at("logps/chosen"), ar = m[0].at("logps/rejected"), beta = 0.1;
    const double lo = (ac - ar) - (std::log1p(-std::exp(ac)) - std::log1p(-std::exp(ar)));
    const double ls = lo >= 0 ? -std::log1p(std::exp(-lo)) : lo - std::log1p(std::exp(lo));
    INFO("a_c " << ac << " a_r " << ar << " lo " << lo << " log sigmoid(lo) " << ls << "; logged log_odds_chosen "
                << m[0].at("log_odds_chosen") << " log_odds_ratio " << m[0].at("log_odds_ratio") << " nll_loss "
                << m[0].at("nll_loss") << " loss " << m[0].at("loss"));
    auto close = [](double a, double b) { return std::fabs(a - b) <= 1e-5 * (1 + std::fabs(b)); };
    CHECK(close(m[0].at("log_odds_chosen"), lo));
    CHECK(close(m[0].at("log_odds_ratio"), ls));
    CHECK(close(m[0].at("nll_loss"), -ac));
    CHECK(close(m[0].at("loss"), -ac - beta * ls));
    CHECK(std::fabs(lo - ls) > 1e-3);  // the two metrics are told apart
    std::printf("  orpo, one pair: log_odds_chosen %.6g (lo %.6g), log_odds_ratio %.6g (log sigmoid %.6g)\n",
                m[0].at("log_odds_chosen"), lo, m[0].at("log_odds_ratio"), ls);
  }
}

TEST_CASE("preference: a tiny model learns that the chosen answer is one fixed pattern (rewards/accuracies > 0.9)",
          "[preference][train]") {
  test::TempDir d("preflearn");
  std::filesystem::create_directories(d / "data");
  // Prompts of random tokens; the chosen answer is always 5 6 7 8, the
  // rejected one four random tokens (never that pattern).
  std::mt19937_64 g(17);
  std::vector<Pair> pairs;
  for (int i = 0; i < 64; ++i) {
    Pair p;
    std::vector<uint32_t> prompt = {1};
    for (int k = 0; k < 3; ++k) prompt.push_back(uint32_t(9 + g() % 7));
    p.c.tok = p.r.tok = prompt;
    p.c.mask = p.r.mask = std::vector<uint8_t>(prompt.size(), 0);
    for (uint32_t t : {5u, 6u, 7u, 8u}) p.c.tok.push_back(t);
    for (int k = 0; k < 4; ++k) p.r.tok.push_back(uint32_t(2 + g() % 14));
    if (p.r.tok[4] == 5) p.r.tok[4] = 4;
    p.c.mask.resize(p.c.tok.size(), 1);
    p.r.mask.resize(p.r.tok.size(), 1);
    pairs.push_back(p);
  }
  write_pref_dir(d / "data", pairs, 16);
  test::write_file(d / "job.yaml", "model: {arch: gpt2, n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 16, seq_len: 16}\n"
                                   "data: {format: llmc, train: '" + (d / "data") + "/train_*.bin', document_mask: true}\n"
                                   "train: {objective: dpo, dpo_beta: 0.1, global_batch_size: 16, micro_batch_size: 16, "
                                   "max_steps: 60, lr: 3.0e-3, warmup_steps: 5, log_interval: 5, eval_interval: 0}\n"
                                   "output: {dir: '" + (d / "run") + "', sample_tokens: 0}\n"
                                   "parallel: {nproc_per_node: 1}\n");
  const auto r = run_job(d / "job.yaml");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto m = read_metrics(d / "run");
  REQUIRE(m.size() >= 3);
  const double first = m.front().at("rewards/accuracies"), last = m.back().at("rewards/accuracies");
  std::printf("  learning: rewards/accuracies %.3f at step %g -> %.3f at step %g; margins %.3f; loss %.4f -> %.4f\n",
              first, m.front().at("step"), last, m.back().at("step"), m.back().at("rewards/margins"),
              m.front().at("loss"), m.back().at("loss"));
  CHECK(last > 0.9);
  CHECK(m.back().at("rewards/margins") > 0);
  CHECK(m.back().at("loss") < 0.9 * std::log(2.0));
}

TEST_CASE("preference: what a preference job cannot do is refused by name", "[preference][errors]") {
  JobDir j;
  const std::string y = j.yaml("bad", "parallel: {nproc_per_node: 1}\nlauncher: {max_restarts: 0}\n");
  struct Bad {
    std::string sets, what;
  };
  const std::vector<Bad> bad = {
      {"--set train.reference=adapter_off", "train.reference adapter_off needs model.adapter"},
      {"--set train.micro_batch_size=1", "train.micro_batch_size 1 is odd"},
      {"--set train.objective=ipo --set train.dpo_label_smoothing=0.1", "train.dpo_label_smoothing: 0.1 is for dpo"},
      {"--set parallel.nproc_per_node=2 --set parallel.pipeline_parallel=2 --set train.micro_batch_size=4 "
       "--set model.adapter.type=lora --set train.reference=adapter_off",
       "train.reference adapter_off and parallel.pipeline_parallel 2 is not supported yet"},
      {"--set data.val=" + (j.d / "data") + "/train_000000.bin", "with data.val"},
      {"--set train.objective=sft", "holds preference pairs (prepare --format preference) and train.objective is sft"},
      {"--set model.seq_len=4", "pairs do not fit a row of model.seq_len + 1 = 5 tokens"},
      {"--set data.format=synthetic", "reads preference pairs"},
      {"--set train.objective=kto", "train.objective"},
  };
  for (const Bad& b : bad) {
    const auto r = run_job(y, b.sets);
    INFO(b.sets << "\n" << r.out);
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.out, Contains(b.what));
  }
  // Data that is not preference pairs: no prepare.json of that format.
  test::write_file(j.d / "data/prepare.json", json{{"format", "chat"}}.dump());
  const auto r = run_job(y);
  INFO(r.out);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.out, Contains("is not preference data") && Contains("--format preference"));
}

TEST_CASE("configs/dpo_example.yaml parses and names the preference fields", "[preference][config]") {
  const JobSpec job = load_job_spec(test::source_dir() + "/configs/dpo_example.yaml");
  CHECK(job.train.objective == "dpo");
  CHECK(job.train.reference == "adapter_off");
  CHECK(job.model.adapter.on());
  CHECK(job.train.micro_batch_size % 2 == 0);
}
