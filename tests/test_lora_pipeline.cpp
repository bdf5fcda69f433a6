// LoRA / DoRA adapters under pipeline parallelism (core/train/adapter_pipeline.h)
// on the CPU backend: each stage holds its own blocks' adapters and its part
// of the frozen base, and a pp2 run (gpipe, 1f1b, zero_bubble with its split
// backward, interleaved_1f1b with 2 virtual stages per rank, and pp2 x dp2
// under full_shard) trains what 1 rank trains: the same losses and the same
// final adapter. The adapter a pp2 run writes is one logical PEFT file that
// peft loads with trainrun's logits, and its checkpoints resume at pp1 and
// back. Bases: tiny random HF Llama (untied head) and GPT-2 (tied, so the
// last stage holds a frozen copy of the embedding) from peft_lora.py.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "tests/support/adapted_model.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

namespace {

constexpr int kRank = 4;
constexpr double kAlpha = 8;

// peft_lora.py's base (and a peft-written adapter, A and B random) in tmp.
void make_base(const TempDir& tmp, const PeftCase& c, int layers = 2) {
  make_peft_case(c, kRank, kAlpha, tmp, "", layers);
}

struct Run {
  std::string adapter = "lora";  // lora | dora
  bool from_peft = true;         // model.adapter.init_from: the peft-written adapter (else trainrun's init)
  std::string targets = llama_case().targets;
  std::string strategy = "no_shard";
  int pp = 1, virtual_stages = 1;
  std::string schedule = "1f1b";
  int max_steps = 3;
  std::vector<std::string> overrides;
};

// 4 sequences a step in micro-batches of 1, dropout 0.1 (its masks are a
// function of the global row: a stage draws what 1 rank draws), AdamW at
// lr 1e-2 with weight decay and a grad clip that bites (the clip sees the
// norm summed over the stages).
JobSpec job(const TempDir& tmp, const std::string& out, const Run& r) {
  std::string adapter = "type: " + r.adapter;
  if (r.from_peft) adapter += ", init_from: '" + tmp / "adapter" + "'";
  const std::string yaml =
      "model:\n  init_from: '" + tmp / "base" + "'\n  seq_len: 8\n"
      "  adapter: {" + adapter + ", rank: 4, alpha: 8, dropout: 0.1, target_modules: [" + r.targets + "]}\n"
      "data: {format: synthetic, synthetic: {branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: " + std::to_string(r.max_steps) +
      ", lr: 1.0e-2,\n"
      "        warmup_steps: 0, schedule: cosine, eval_interval: 0, eval_steps: 1, log_interval: 1,\n"
      "        weight_decay: 0.1, grad_clip: 0.05}\n"
      "output: {dir: '" + out + "', sample_tokens: 0}\n"
      "parallel: {sharding: " + r.strategy + ", timeout_s: 60, pipeline_parallel: " + std::to_string(r.pp) +
      ", pipeline_schedule: " + r.schedule + ", pipeline_virtual_stages: " + std::to_string(r.virtual_stages) + "}\n";
  return parse_job_spec(yaml, "job.yaml", r.overrides);
}

std::vector<TrainSummary> train(const TempDir& tmp, const std::string& name, const Run& r, int world) {
  return run_ranks_inprocess(job(tmp, tmp / name, r), world);
}

std::vector<float> adapter_of(const std::string& run_dir) { return adapter_file(run_dir + "/adapter"); }

// Within `tol` relative: every loss, and every adapter element (relative to
// the adapter's largest magnitude, so an element near zero is not held to
// a relative bound its rounding cannot meet).
void check_same_run(const std::string& got, const std::string& want, double tol) {
  const std::vector<double> lg = losses_of(got), lw = losses_of(want);
  REQUIRE(!lw.empty());
  REQUIRE(lg.size() == lw.size());
  for (size_t i = 0; i < lg.size(); ++i) {
    INFO("step " << i + 1 << ": " << lg[i] << " vs " << lw[i]);
    CHECK(std::fabs(lg[i] - lw[i]) <= tol * std::fabs(lw[i]));
  }
  const std::vector<float> ag = adapter_of(got), aw = adapter_of(want);
  REQUIRE(ag.size() == aw.size());
  double scale = 0, diff = 0;
  for (size_t i = 0; i < aw.size(); ++i) {
    scale = std::max(scale, double(std::fabs(aw[i])));
    diff = std::max(diff, double(std::fabs(ag[i] - aw[i])));
  }
  INFO("adapter: max |diff| " << diff << " of max |value| " << scale);
  CHECK(diff <= tol * scale);
}

}  // namespace

TEST_CASE("lora pipeline: pp2 (gpipe, 1f1b, zero_bubble, and x dp2 full_shard) trains what 1 rank trains, and peft loads the pp2 adapter",
          "[lora][pipeline][peft]") {
  // Llama LoRA from a peft-written adapter; GPT-2 (tied head) DoRA from
  // trainrun's own init, so each stage inits its blocks' magnitudes from its
  // part of the base.
  for (const PeftCase& c : {llama_case(), gpt2_case(true)}) {
    INFO(c.name());
    TempDir tmp("lora_pp_" + c.arch);
    Run r;
    r.targets = c.targets;
    if (c.dora) {
      r.adapter = "dora";
      r.from_peft = false;
    }
    make_base(tmp, c);
    const std::vector<TrainSummary> one = train(tmp, "pp1", r, 1);
    r.pp = 2;
    for (const std::string schedule : {"gpipe", "1f1b", "zero_bubble"}) {
      INFO(schedule);
      r.schedule = schedule;
      train(tmp, "pp2_" + schedule, r, 2);
      check_same_run(tmp / ("pp2_" + schedule), tmp / "pp1", 1e-5);
    }
    if (!c.dora) {
      // pp2 x dp2 under full_shard (4 ranks): each rank holds half its
      // stage's base and half its stage's adapters.
      Run sharded = r;
      sharded.schedule = "1f1b";
      sharded.strategy = "full_shard";
      const std::vector<TrainSummary> four = train(tmp, "pp2dp2", sharded, 4);
      check_same_run(tmp / "pp2dp2", tmp / "pp1", 1e-5);
      for (const TrainSummary& s : four) CHECK(s.params_bytes < one[0].params_bytes * 0.4);
    }
    // The pp2 run's adapter is one PEFT file (every stage's blocks) that
    // peft loads, computing trainrun's logits with it.
    const std::string written = tmp / "pp2_1f1b/adapter";
    AdaptedModel m(tmp / "base", options_for(c, kRank, kAlpha), nullptr, written);
    const std::vector<int32_t> in = tokens(5, m.arch->config().V);
    const std::vector<float> ours = m.logits(in);
    CHECK(max_abs_diff(ours, peft_logits(tmp / "base", written, in, tmp)) <= 1e-5f);
    // ... and the adapters trained away from peft's (random A and B) start.
    if (r.from_peft) {
      AdaptedModel start(tmp / "base", options_for(c, kRank, kAlpha), nullptr, tmp / "adapter");
      CHECK(max_abs_diff(ours, start.logits(in)) > 1e-3f);
    }
  }
}

TEST_CASE("lora pipeline: interleaved_1f1b (pp2 x 2 virtual stages) and 1f1b with activation checkpointing on a 4-layer Llama equal 1 rank",
          "[lora][pipeline]") {
  TempDir tmp("lora_pp_interleaved");
  make_base(tmp, llama_case(), 4);
  Run r;
  train(tmp, "pp1", r, 1);
  r.pp = 2;
  r.virtual_stages = 2;
  r.schedule = "interleaved_1f1b";
  train(tmp, "pp2v2", r, 2);
  check_same_run(tmp / "pp2v2", tmp / "pp1", 1e-5);
  // With activation checkpointing the backward recomputes each block's
  // forward, adapters and dropout masks included, from its microbatch's rows.
  r.virtual_stages = 1;
  r.schedule = "1f1b";
  r.overrides = {"train.activation_checkpointing=blocks"};
  train(tmp, "pp2_ckpt", r, 2);
  check_same_run(tmp / "pp2_ckpt", tmp / "pp1", 1e-5);
}

TEST_CASE("lora pipeline: a pp2 checkpoint resumes at pp1 and a pp1 checkpoint at pp2", "[lora][pipeline][checkpoint]") {
  TempDir tmp("lora_pp_ckpt");
  make_base(tmp, llama_case());
  Run r;
  r.max_steps = 4;
  r.overrides = {"checkpoint.interval=2"};
  train(tmp, "straight", r, 1);
  // One loop, not SECTIONs: a section would rerun the base and the straight run.
  for (const bool pp2_first : {true, false}) {
    INFO((pp2_first ? "saved at pp2 (zero_bubble), resumed at pp1" : "saved at pp1, resumed at pp2 (1f1b)"));
    const std::string dir = pp2_first ? "from_pp2" : "from_pp1";
    Run first = r, second = r;
    first.overrides.push_back("train.exit_interval=2");
    (pp2_first ? first : second).pp = 2;
    first.schedule = "zero_bubble";
    train(tmp, dir, first, first.pp);
    REQUIRE(latest_of(tmp / dir) == "step_00000002");
    train(tmp, dir, second, second.pp);
    check_same_run(tmp / dir, tmp / "straight", 1e-5);
  }
}
