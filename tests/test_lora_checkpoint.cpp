// Adapter checkpoints (core/train/adapter_training + core/checkpoint): an
// adapter run's checkpoints hold the adapters and their AdamW state, not
// the frozen base; a resume re-reads the base from model.init_from, checks
// its fingerprint, and continues exactly (same losses, same adapter) on the
// same or another rank layout. Every checkpoint carries a PEFT copy
// (step_N/adapter) equal to what the run writes at that step.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/io/safetensors.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/hf_reference.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
namespace fs = std::filesystem;

namespace {

// A tiny random Llama (base/) from peft_lora.py; the adapters start fresh.
void make_base(const TempDir& tmp) {
  const auto r = run_reference_script("peft_lora.py", "make --arch llama --out '" + tmp.path() +
                                                          "' --r 4 --alpha 8 --targets q_proj,v_proj,down_proj");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
}

// 4 steps of LoRA with dropout (its mask is a function of the step: a
// resume must draw the same masks) on synthetic data. `extra`: YAML lines.
JobSpec job(const std::string& base, const std::string& out, const std::string& strategy, int rank = 4,
            const std::vector<std::string>& overrides = {}) {
  const std::string yaml =
      "model:\n  init_from: '" + base + "'\n  seq_len: 8\n"
      "  adapter: {type: lora, rank: " + std::to_string(rank) + ", alpha: 8, dropout: 0.1,\n"
      "            target_modules: [q_proj, v_proj, down_proj]}\n"
      "data: {format: synthetic, synthetic: {branching: 3}}\n"
      "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 4, lr: 1.0e-2,\n"
      "        warmup_steps: 0, schedule: cosine, eval_interval: 0, eval_steps: 1, log_interval: 1, weight_decay: 0.1}\n"
      "checkpoint: {interval: 2}\n"
      "output: {dir: '" + out + "', sample_tokens: 0}\n"
      "parallel: {sharding: " + strategy + ", timeout_s: 60" +
      (strategy == "hybrid_shard" ? ", shard_group_size: 1" : "") + "}\n";
  return parse_job_spec(yaml, "job.yaml", overrides);
}

std::vector<float> tensors_of(const std::string& file) {
  const SafeTensorFile f = read_safetensors(file);
  std::vector<float> out;
  for (const SafeTensor& t : f.tensors) {
    const std::vector<float> v = t.as_f32();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

void check_same_run(const std::string& got, const std::string& want, double tol) {
  const std::vector<double> lg = losses_of(got), lw = losses_of(want);
  REQUIRE(lg.size() == lw.size());
  for (size_t i = 0; i < lg.size(); ++i) CHECK(std::fabs(lg[i] - lw[i]) <= tol * std::fabs(lw[i]));
  CHECK(max_abs_diff(tensors_of(got + "/adapter/adapter_model.safetensors"),
                     tensors_of(want + "/adapter/adapter_model.safetensors")) <= tol);
}

}  // namespace

TEST_CASE("lora checkpoints: adapters only, a PEFT copy inside, exact resume that reshards", "[lora][checkpoint]") {
  TempDir tmp("lora_ckpt");
  make_base(tmp);
  const std::string base = tmp / "base";
  const std::string straight = tmp / "straight";
  test::run_ranks_inprocess(job(base, straight, "no_shard"), 1);
  REQUIRE(losses_of(straight).size() == 4);

  // What a checkpoint holds: the adapters (a header + 4 bytes per adapter
  // element, a fraction of the base), their two moments, and adapter/.
  const std::string step2 = straight + "/checkpoints/step_00000002", step4 = straight + "/checkpoints/step_00000004";
  REQUIRE(file_exists(step2 + "/manifest.json"));
  const SafeTensorFile ckpt_model = read_safetensors(step4 + "/model.safetensors");
  size_t adapter_numel = 0;
  for (const SafeTensor& t : ckpt_model.tensors) {
    CHECK(t.name.find("lora_") != std::string::npos);
    adapter_numel += t.as_f32().size();
  }
  const uintmax_t base_bytes = fs::file_size(base + "/model.safetensors");
  CHECK(fs::file_size(step4 + "/model.safetensors") < base_bytes / 4);
  CHECK(fs::file_size(step4 + "/optimizer.safetensors") < 2 * adapter_numel * 4 + 65536);
  const std::string manifest = read_file(step4 + "/manifest.json");
  CHECK(manifest.find("\"base_fingerprint\": \"xxhash64 ") != std::string::npos);
  // The PEFT copy of step 4 is the run's final adapter, value for value.
  REQUIRE(file_exists(step4 + "/adapter/adapter_config.json"));
  CHECK(tensors_of(step4 + "/adapter/adapter_model.safetensors") ==
        tensors_of(straight + "/adapter/adapter_model.safetensors"));
  // ... and the checkpoint's model file equals it too (our names, peft's values).
  CHECK(max_abs_diff(tensors_of(step4 + "/model.safetensors"),
                     tensors_of(straight + "/adapter/adapter_model.safetensors")) == 0.0f);

  SECTION("stopped at step 2 and resumed on the same layout: bit-identical") {
    const std::string split = tmp / "split";
    test::run_ranks_inprocess(job(base, split, "no_shard", 4, {"train.exit_interval=2"}), 1);
    REQUIRE(latest_of(split) == "step_00000002");
    test::run_ranks_inprocess(job(base, split, "no_shard"), 1);
    check_same_run(split, straight, 0.0);
  }
  SECTION("async checkpoints, saved on 2 ranks (full_shard), resumed on 1 (no_shard)") {
    const std::string split = tmp / "split2";
    test::run_ranks_inprocess(
        job(base, split, "full_shard", 4, {"train.exit_interval=2", "checkpoint.async=true"}), 2);
    REQUIRE(latest_of(split) == "step_00000002");
    test::run_ranks_inprocess(job(base, split, "no_shard"), 1);
    check_same_run(split, straight, 1e-5);
  }
  SECTION("saved on 1 rank, resumed on 2 (hybrid_shard)") {
    const std::string split = tmp / "split3";
    test::run_ranks_inprocess(job(base, split, "no_shard", 4, {"train.exit_interval=2"}), 1);
    test::run_ranks_inprocess(job(base, split, "hybrid_shard"), 2);
    check_same_run(split, straight, 1e-5);
  }
}

TEST_CASE("lora checkpoints: another base, another adapter shape or a whole-model checkpoint is an error",
          "[lora][checkpoint]") {
  TempDir tmp("lora_ckpt_bad");
  make_base(tmp);
  const std::string base = tmp / "base", run = tmp / "run";
  test::run_ranks_inprocess(job(base, run, "no_shard", 4, {"train.exit_interval=2"}), 1);
  REQUIRE(latest_of(run) == "step_00000002");

  SECTION("a base whose weights changed (same shapes)") {
    const std::string other = tmp / "other_base";
    fs::copy(base, other, fs::copy_options::recursive);
    {
      // One byte in the middle of the weights: a different base of the same architecture.
      std::fstream f(other + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
      const auto size = fs::file_size(other + "/model.safetensors");
      f.seekg(std::streamoff(size / 2));
      char c = 0;
      f.read(&c, 1);
      c = char(c ^ 0x40);
      f.seekp(std::streamoff(size / 2));
      f.write(&c, 1);
    }
    CHECK_THROWS_WITH(test::run_ranks_inprocess(job(other, run, "no_shard"), 1),
                      Catch::Contains("step_00000002 was saved with the base model.init_from '" + base + "' (xxhash64 ") &&
                          Catch::Contains("but this job's base '" + other + "' is xxhash64 ") &&
                          Catch::Contains("point model.init_from at the original base"));
    // A copy of the same base elsewhere resumes: the fingerprint is of the bytes, not the path.
    const std::string copy = tmp / "copy_base";
    fs::copy(base, copy, fs::copy_options::recursive);
    test::run_ranks_inprocess(job(copy, run, "no_shard"), 1);
    CHECK(losses_of(run).size() == 4);
  }
  SECTION("another model.base_dtype (an NF4 base is another function)") {
    CHECK_THROWS_WITH(test::run_ranks_inprocess(job(base, run, "no_shard", 4, {"model.base_dtype=nf4"}), 1),
                      Catch::Contains("model.base_dtype = \"fp32\" but this job has \"nf4\""));
  }
  SECTION("another rank") {
    CHECK_THROWS_WITH(test::run_ranks_inprocess(job(base, run, "no_shard", 8), 1),
                      Catch::Contains("model.adapter r = 4 but this job has 8"));
  }
  SECTION("a whole-model job resuming an adapter checkpoint, and tools given the adapter checkpoint") {
    JobSpec full = job(base, run, "no_shard");
    full.model.adapter = ModelSpec::AdapterSpec{};
    CHECK_THROWS_WITH(test::run_ranks_inprocess(full, 1), Catch::Contains("was saved with model.adapter"));
    const auto r = run_trainrun("generate --checkpoint '" + run + "/checkpoints/step_00000002' --prompt 1 --max-tokens 4");
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.out + r.err, Catch::Contains("holds LoRA adapters") && Catch::Contains("generate --adapter"));
  }
}
