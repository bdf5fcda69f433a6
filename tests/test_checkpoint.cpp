// Checkpoints: exact resume, resharding, refusal of incompatible jobs,
// corruption detection with fallback, crash safety (kill -9 mid-write),
// a full disk, async writes and retention.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/checkpoint/checkpoint.h"
#include "core/config/job_spec.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using test::latest_of;
using test::losses_of;
using test::weights_of;
namespace fs = std::filesystem;

namespace {

// XOR `mask` into the byte at `offset` (from the end when negative).
void flip_bits(const std::string& path, std::streamoff offset, char mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  const auto dir = offset < 0 ? std::ios::end : std::ios::beg;
  f.seekg(offset, dir);
  char c = 0;
  f.read(&c, 1);
  c ^= mask;
  f.seekp(offset, dir);
  f.write(&c, 1);
}

std::string job_yaml(const std::string& dir, const std::string& strategy, const std::string& extra = "") {
  return test::checkpoint_job_yaml(dir, strategy, extra);
}

JobSpec job_for(const std::string& dir, const std::string& strategy, int world, std::vector<std::string> sets = {}) {
  return test::checkpoint_job(dir, strategy, world, std::move(sets));
}

double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(a[i] - b[i]) / std::fabs(b[i]));
  return m;
}

}  // namespace

TEST_CASE("checkpoint: 10 steps + resume + 10 steps is bit-identical to 20 steps, every strategy", "[checkpoint]") {
  for (const char* strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    for (int world : {1, 2}) {
      SECTION(std::string(strategy) + " world " + std::to_string(world)) {
        test::TempDir dir("ckpt");
        test::run_ranks_inprocess(job_for(dir / "straight", strategy, world), world);
        test::run_ranks_inprocess(job_for(dir / "resumed", strategy, world, {"train.exit_interval=10"}), world);
        REQUIRE(latest_of(dir / "resumed") == "step_00000010");
        REQUIRE(losses_of(dir / "resumed").size() == 10);
        test::run_ranks_inprocess(job_for(dir / "resumed", strategy, world), world);
        const auto a = losses_of(dir / "straight"), b = losses_of(dir / "resumed");
        REQUIRE(a.size() == 20);
        CHECK(a == b);  // bit-identical: same world size, same arithmetic
        CHECK(weights_of(dir / "straight") == weights_of(dir / "resumed"));
        CHECK(latest_of(dir / "resumed") == "step_00000020");
      }
    }
  }
}

TEST_CASE("checkpoint: async writes give the same checkpoint and an exact resume", "[checkpoint]") {
  test::TempDir dir("ckpt");
  test::run_ranks_inprocess(job_for(dir / "straight", "full_shard", 2), 2);
  auto s = test::run_ranks_inprocess(
      job_for(dir / "async", "full_shard", 2, {"train.exit_interval=10", "checkpoint.async=true", "checkpoint.interval=5"}), 2);
  CHECK(s[0].checkpoint_blocked_seconds < 5.0);
  test::run_ranks_inprocess(job_for(dir / "async", "full_shard", 2, {"checkpoint.async=true"}), 2);
  CHECK(losses_of(dir / "straight") == losses_of(dir / "async"));
  CHECK(weights_of(dir / "straight") == weights_of(dir / "async"));
  // Host memory: one piece at a time, never a whole snapshot. A rank of 2
  // writes about half of the P elements; a snapshot of master, m and v is
  // 12 bytes each (6P bytes), one piece at most one unit's shard of fp32.
  const size_t P = weights_of(dir / "straight").size();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << s[r].checkpoint_host_bytes << " bytes of host buffers for " << P << " parameters");
    CHECK(s[r].checkpoint_host_bytes > 0);
    CHECK(s[r].checkpoint_host_bytes <= 2 * P);
  }
}

TEST_CASE("checkpoint: resharding across world sizes and strategies continues the run", "[checkpoint]") {
  struct Case { int from_world; const char* from; int to_world; const char* to; };
  for (const Case& c : {Case{4, "full_shard", 1, "full_shard"}, Case{2, "full_shard", 3, "full_shard"},
                        Case{1, "no_shard", 4, "full_shard"}, Case{2, "full_shard", 2, "no_shard"},
                        Case{4, "hybrid_shard", 2, "shard_grad_op"}}) {
    SECTION(std::to_string(c.from_world) + " " + c.from + " to " + std::to_string(c.to_world) + " " + c.to) {
      test::TempDir dir("ckpt");
      test::run_ranks_inprocess(job_for(dir / "straight", "no_shard", 1), 1);
      std::vector<std::string> hy;
      if (std::string(c.from) == "hybrid_shard") hy.push_back("parallel.shard_group_size=2");
      auto first = hy;
      first.push_back("train.exit_interval=10");
      test::run_ranks_inprocess(job_for(dir / "r", c.from, c.from_world, first), c.from_world);
      test::run_ranks_inprocess(job_for(dir / "r", c.to, c.to_world), c.to_world);
      const auto a = losses_of(dir / "straight"), b = losses_of(dir / "r");
      REQUIRE(b.size() == 20);
      INFO("worst relative loss difference " << max_rel(b, a));
      CHECK(max_rel(b, a) <= 1e-5);
    }
  }
}

TEST_CASE("checkpoint: an incompatible model is refused, harmless changes are logged", "[checkpoint]") {
  test::TempDir dir("ckpt");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job_yaml(run, "no_shard"));
  auto r = test::run_trainrun("--config " + dir / "job.yaml" + " --set train.exit_interval=5");
  REQUIRE(r.exit_code == 0);
  r = test::run_trainrun("--config " + dir / "job.yaml" + " --set model.n_embd=20");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("model.n_embd = 18 but this job has 20") && Contains("checkpoint.resume: never"));
  CHECK(latest_of(run) == "step_00000005");  // nothing was lost
  r = test::run_trainrun("--config " + dir / "job.yaml" + " --set train.lr=1e-3 --set train.min_lr=1e-4");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("resume: train.lr changed from 0.003 to 0.001 (allowed)"));
  CHECK_THAT(r.err, Contains("resume: loaded"));
  // resume: never starts from scratch even though checkpoints exist.
  r = test::run_trainrun("--config " + dir / "job.yaml" + " --set checkpoint.resume=never --set train.max_steps=3 --set train.warmup_steps=1");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, !Contains("resume: loaded"));
}

// resume: never where an earlier, longer run left checkpoints: the new run's
// must not mix with them (retention by step number would delete the new
// step_00000005 at once and `latest` would dangle). They move aside instead.
TEST_CASE("checkpoint: resume never moves an earlier run's checkpoints aside, losing nothing", "[checkpoint]") {
  test::TempDir dir("ckpt");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job_yaml(run, "no_shard", "checkpoint: {interval: 10, keep_last: 3}\n"));
  const std::string base = "--config " + dir / "job.yaml" + " --set train.warmup_steps=1";
  REQUIRE(test::run_trainrun(base + " --set train.max_steps=30").exit_code == 0);
  REQUIRE(latest_of(run) == "step_00000030");
  auto r = test::run_trainrun(base + " --set train.max_steps=5 --set checkpoint.resume=never");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("checkpoint.resume: never: " + run + "/checkpoints held checkpoints of an earlier run "
                             "(newest: step_00000030); moved them to " + run + "/checkpoints.before-"));
  CHECK(latest_of(run) == "step_00000005");
  CHECK(test::file_exists(run + "/checkpoints/step_00000005/manifest.json"));
  CHECK(!test::file_exists(run + "/checkpoints/step_00000030"));
  std::string moved;
  for (const auto& e : fs::directory_iterator(run))
    if (e.path().filename().string().rfind("checkpoints.before-", 0) == 0) moved = e.path().string();
  REQUIRE(!moved.empty());
  CHECK(test::file_exists(moved + "/step_00000030/manifest.json"));
  CHECK(Checkpointer::verify(moved + "/step_00000030").empty());
  // auto now continues the new run, not the old one.
  r = test::run_trainrun(base + " --set train.max_steps=8");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("resume: loaded " + run + "/checkpoints/step_00000005"));
}

TEST_CASE("checkpoint: damaged checkpoints are detected and auto-resume falls back", "[checkpoint]") {
  struct Damage { const char* name; std::function<void(const std::string&)> apply; const char* message; };
  std::vector<Damage> damages = {
      {"truncated model file", [](const std::string& d) { fs::resize_file(d + "/model.safetensors", fs::file_size(d + "/model.safetensors") - 100); },
       "model.safetensors has"},
      {"bit flip in the optimizer file", [](const std::string& d) { flip_bits(d + "/optimizer.safetensors", 2000, 0x10); },
       "optimizer.safetensors: checksum mismatch"},
      {"missing manifest", [](const std::string& d) { fs::remove(d + "/manifest.json"); }, "manifest.json is missing"},
      {"missing data file", [](const std::string& d) { fs::remove(d + "/model.safetensors"); }, "model.safetensors is missing"},
      {"garbage manifest", [](const std::string& d) { test::write_file(d + "/manifest.json", "{not json"); }, "not valid JSON"},
  };
  for (const auto& dmg : damages) {
    SECTION(dmg.name) {
      test::TempDir dir("ckpt");
      const std::string run = dir / "run";
      test::write_file(dir / "job.yaml", job_yaml(run, "full_shard", "checkpoint: {interval: 5}\n"));
      REQUIRE(test::run_trainrun("--config " + dir / "job.yaml" + " --set train.exit_interval=10").exit_code == 0);
      REQUIRE(latest_of(run) == "step_00000010");
      dmg.apply(run + "/checkpoints/step_00000010");
      CHECK_THAT(Checkpointer::verify(run + "/checkpoints/step_00000010"), Contains(dmg.message));
      CHECK(Checkpointer::verify(run + "/checkpoints/step_00000005").empty());
      // auto: warns, names the file, falls back to step 5 and trains on.
      auto r = test::run_trainrun("--config " + dir / "job.yaml");
      INFO(r.err);
      CHECK(r.exit_code == 0);
      CHECK_THAT(r.err, Contains("skipping " + run + "/checkpoints/step_00000010") && Contains(dmg.message));
      CHECK_THAT(r.err, Contains("resume: loaded " + run + "/checkpoints/step_00000005"));
      // An explicit path to a damaged checkpoint is an error, not a fallback.
      dmg.apply(run + "/checkpoints/step_00000020");
      r = test::run_trainrun("--config " + dir / "job.yaml" + " --set checkpoint.resume=" + run + "/checkpoints/step_00000020");
      CHECK(r.exit_code == 1);
      CHECK_THAT(r.err, Contains("checkpoint.resume") && Contains(dmg.message));
    }
  }
}

// A byte only rank 1 reads (the tail of the last unit is rank 1's under
// full_shard) is damaged: rank 1 finds it while reading, every rank drops
// the checkpoint together, and the run resumes from the previous one as
// if nothing had happened (the final weights equal an unbroken run's).
TEST_CASE("checkpoint: a bad segment one rank reads makes every rank fall back", "[checkpoint]") {
  test::TempDir dir("ckpt");
  test::run_ranks_inprocess(job_for(dir / "straight", "full_shard", 2), 2);
  const std::vector<std::string> every5 = {"checkpoint.interval=5"};
  auto first = every5;
  first.push_back("train.exit_interval=10");
  test::run_ranks_inprocess(job_for(dir / "r", "full_shard", 2, first), 2);
  REQUIRE(latest_of(dir / "r") == "step_00000010");
  const std::string bad = dir / "r/checkpoints/step_00000010/model.safetensors";
  flip_bits(bad, -8, 0x01);
  CHECK_THAT(Checkpointer::verify(dir / "r/checkpoints/step_00000010"), Contains("model.safetensors: checksum mismatch"));
  test::run_ranks_inprocess(job_for(dir / "r", "full_shard", 2, every5), 2);
  CHECK(weights_of(dir / "straight") == weights_of(dir / "r"));
  CHECK(latest_of(dir / "r") == "step_00000020");
}

// Where staging the three state kinds would take too much host memory, the
// load verifies first and then reads one kind at a time into the live state:
// the same exact resume, and a bad segment is still caught before anything
// goes live (a limit of 1 byte forces that path here).
TEST_CASE("checkpoint: the memory-bounded load (verify, then kind by kind) resumes exactly and still falls back",
          "[checkpoint]") {
  struct Limit {
    Limit() { ::setenv("TRAINRUN_CKPT_STAGE_LIMIT", "1", 1); }
    ~Limit() { ::unsetenv("TRAINRUN_CKPT_STAGE_LIMIT"); }
  } limit;
  for (const char* strategy : {"full_shard", "hybrid_shard"}) {
    INFO(strategy);
    test::TempDir dir("ckpt");
    test::run_ranks_inprocess(job_for(dir / "straight", strategy, 2), 2);
    const std::vector<std::string> every5 = {"checkpoint.interval=5"};
    auto first = every5;
    first.push_back("train.exit_interval=10");
    test::run_ranks_inprocess(job_for(dir / "r", strategy, 2, first), 2);
    REQUIRE(latest_of(dir / "r") == "step_00000010");
    flip_bits(dir / "r/checkpoints/step_00000010/optimizer.safetensors", -16, 0x02);
    test::run_ranks_inprocess(job_for(dir / "r", strategy, 2, every5), 2);
    CHECK(losses_of(dir / "straight") == losses_of(dir / "r"));
    CHECK(weights_of(dir / "straight") == weights_of(dir / "r"));
    CHECK(latest_of(dir / "r") == "step_00000020");
  }
  ::setenv("TRAINRUN_CKPT_STAGE_LIMIT", "lots", 1);
  test::TempDir dir("ckpt");
  test::run_ranks_inprocess(job_for(dir / "r", "no_shard", 1, {"train.exit_interval=10"}), 1);
  CHECK_THROWS_WITH(test::run_ranks_inprocess(job_for(dir / "r", "no_shard", 1), 1),
                    Contains("TRAINRUN_CKPT_STAGE_LIMIT='lots' is not a number of bytes"));
}

// Checkpoints written before per-segment checksums (format 1: one xxhash64
// per whole file) still verify and resume.
TEST_CASE("checkpoint: a format 1 manifest (whole-file xxhash64) still verifies and loads", "[checkpoint]") {
  test::TempDir dir("ckpt");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job_yaml(run, "full_shard", "checkpoint: {interval: 5}\n"));
  REQUIRE(test::run_trainrun("--config " + dir / "job.yaml" + " --set train.exit_interval=10").exit_code == 0);
  for (const char* step : {"step_00000005", "step_00000010"}) {
    const std::string ck = run + "/checkpoints/" + step;
    auto m = nlohmann::ordered_json::parse(test::read_file(ck + "/manifest.json"));
    REQUIRE(m["format_version"] == 2);
    REQUIRE(m["files"]["model.safetensors"].contains("segments"));
    m["format_version"] = 1;
    for (const char* name : {"model.safetensors", "optimizer.safetensors"}) {
      const std::string data = test::read_file(ck + "/" + name);
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx",
                    static_cast<unsigned long long>(XXH64(data.data(), data.size(), 0)));
      m["files"][name] = {{"size", data.size()}, {"xxhash64", hex}};
    }
    test::write_file(ck + "/manifest.json", m.dump(2) + "\n");
    CHECK(Checkpointer::verify(ck).empty());
  }
  // Damage the newest: detected with the same words, and auto falls back.
  flip_bits(run + "/checkpoints/step_00000010/optimizer.safetensors", 5000, 0x40);
  CHECK_THAT(Checkpointer::verify(run + "/checkpoints/step_00000010"), Contains("optimizer.safetensors: checksum mismatch"));
  auto r = test::run_trainrun("--config " + dir / "job.yaml");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("skipping " + run + "/checkpoints/step_00000010") && Contains("checksum mismatch"));
  CHECK_THAT(r.err, Contains("resume: loaded " + run + "/checkpoints/step_00000005"));
  CHECK(latest_of(run) == "step_00000020");
}

TEST_CASE("checkpoint: kill -9 during a checkpoint write leaves the previous one as latest", "[checkpoint]") {
  test::TempDir dir("ckpt");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", "model: {n_layer: 2, n_head: 2, n_embd: 18, vocab_size: 23, seq_len: 12}\n"
                                     "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
                                     "train: {global_batch_size: 12, micro_batch_size: 3, max_steps: 20, warmup_steps: 4, log_interval: 1}\n"
                                     "output: {dir: '" + run + "', sample_tokens: 0}\n"
                                     "checkpoint: {interval: 5}\n"
                                     "parallel: {nproc_per_node: 2, sharding: full_shard, timeout_s: 20}\n"
                                     "launcher: {grace_period_s: 2}\n");
  // Rank 0 pauses 30 s inside the commit of step 10; we SIGKILL it there.
  const std::string cmd = "TRAINRUN_DEBUG_CKPT_SLEEP_MS=30000 TRAINRUN_DEBUG_CKPT_SLEEP_STEP=10 OMP_NUM_THREADS=1 '" +
                          test::trainrun_binary() + "' --config " + dir / "job.yaml" + " > " + dir / "out.txt" + " 2>&1 & echo $!";
  auto started = test::run_command(cmd);
  bool in_window = false;
  for (int i = 0; i < 300 && !in_window; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    in_window = test::file_exists(run + "/checkpoints/.tmp-step_00000010/model.safetensors") &&
                test::read_file(run + "/logs/rank0.log").find("debug pause") != std::string::npos;
  }
  REQUIRE(in_window);
  // kill -9 the rank-0 worker (the oldest worker: the one committing). The
  // "[t]" keeps the pattern from matching the shell that runs pgrep itself.
  const std::string pattern = "'[t]rainrun worker --config " + run + "/job.resolved.yaml'";
  auto k = test::run_command("kill -9 $(pgrep -o -f " + pattern + ")");
  CHECK(k.exit_code == 0);
  const std::string any = "'[t]rainrun.*" + dir.path() + "'";
  for (int i = 0; i < 150 && test::run_command("pgrep -f " + any).exit_code == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(test::run_command("pgrep -f " + any).exit_code != 0);  // the agent tore the job down
  CHECK_THAT(test::read_file(dir / "out.txt"), Contains("rank 0") && Contains("SIGKILL"));
  CHECK(latest_of(run) == "step_00000005");
  CHECK(Checkpointer::verify(run + "/checkpoints/step_00000005").empty());
  CHECK(!test::file_exists(run + "/checkpoints/step_00000010"));
  // The next run cleans the stale temp dir and resumes from step 5.
  auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("removed") && Contains(".tmp-step_00000010"));
  CHECK_THAT(r.err, Contains("resume: loaded " + run + "/checkpoints/step_00000005"));
  CHECK(latest_of(run) == "step_00000020");
}

TEST_CASE("checkpoint: a full disk (file-size limit) fails cleanly, per checkpoint.on_error", "[checkpoint]") {
  test::TempDir dir("ckpt");
  const std::string run = dir / "run";
  // 60480 fp32 parameters: model.safetensors (~240 KB) fits under a 350 KiB
  // file-size limit (bash's ulimit -f counts KiB), optimizer.safetensors (~480 KB) does not.
  test::write_file(dir / "job.yaml", "model: {n_layer: 2, n_head: 2, n_embd: 48, vocab_size: 64, seq_len: 16}\n"
                                     "data: {format: synthetic}\n"
                                     "train: {global_batch_size: 4, micro_batch_size: 4, max_steps: 6, warmup_steps: 1, log_interval: 1}\n"
                                     "output: {dir: '" + run + "', sample_tokens: 0}\n"
                                     "checkpoint: {interval: 3}\n");
  SECTION("on_error: continue") {
    auto r = test::run_command("bash -c \"ulimit -f 350; OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config " +
                               dir / "job.yaml" + " --set checkpoint.on_error=continue\"");
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.err, Contains("optimizer.safetensors") && Contains("disk full or file size limit") &&
                          Contains("continuing (checkpoint.on_error: continue)"));
    CHECK(!test::file_exists(run + "/checkpoints/latest"));  // never pointed at a damaged checkpoint
    CHECK(!test::file_exists(run + "/checkpoints/.tmp-step_00000003"));
    CHECK(losses_of(run).size() == 6);  // training went on
  }
  SECTION("on_error: stop, after a good checkpoint") {
    // First a good checkpoint at step 3 without the limit, then the limit.
    REQUIRE(test::run_trainrun("--config " + dir / "job.yaml" + " --set train.exit_interval=3").exit_code == 0);
    auto r = test::run_command("bash -c \"ulimit -f 350; OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml" + "\"");
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("checkpoint step 6 could not be written") && Contains("the latest good checkpoint (step_00000003) is intact"));
    CHECK(latest_of(run) == "step_00000003");
    CHECK(Checkpointer::verify(run + "/checkpoints/step_00000003").empty());
  }
}

TEST_CASE("checkpoint: retention keeps the newest and the milestones", "[checkpoint]") {
  test::TempDir dir("ckpt");
  JobSpec job = job_for(dir / "run", "no_shard", 1, {"checkpoint.interval=2", "checkpoint.keep_last=2", "checkpoint.keep_every=8"});
  test::run_ranks_inprocess(job, 1);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "run/checkpoints"))
    if (e.is_directory()) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step_00000008", "step_00000016", "step_00000018", "step_00000020"});
  // generate reads the run directory's latest checkpoint.
  auto r = test::run_trainrun("generate --checkpoint " + dir / "run" + " --prompt '1 2' --max-tokens 3 --top-k 1");
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("checkpoints/step_00000020/model.safetensors"));
}
