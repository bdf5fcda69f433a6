// Preemption (SIGTERM / SIGUSR1 as Slurm sends before a time limit) and
// non-finite steps: both are decisions every rank must take together.
#include <catch2/catch.hpp>

#include <chrono>
#include <fstream>
#include <thread>

#include <csignal>

#include "core/config/job_spec.h"
#include "core/train/preemption.h"
#include "core/train/trainer.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

std::string job(const std::string& run, int nproc, int steps, const std::string& extra = "") {
  return "model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 16, seq_len: 16}\n"
         "data: {format: synthetic}\n"
         "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: " + std::to_string(steps) +
         ", warmup_steps: 2, log_interval: 1, eval_interval: 0}\n"
         "output: {dir: '" + run + "', sample_tokens: 0}\n"
         "parallel: {nproc_per_node: " + std::to_string(nproc) + ", sharding: full_shard, timeout_s: 30}\n"
         "launcher: {grace_period_s: 20}\n" + extra;
}

std::vector<int> steps_in(const std::string& metrics) {
  std::vector<int> out;
  std::ifstream f(metrics);
  for (std::string l; std::getline(f, l);) out.push_back(std::stoi(l.substr(l.find("\"step\":") + 7)));
  return out;
}

// Starts the job in the background (with `env`, "NAME=value ..."), waits
// until its output contains `want`, sends `sig` to the launched process and
// returns its exit code.
int run_and_signal_at(const std::string& cfg, const std::string& log, const std::string& sig, const std::string& want,
                      const std::string& env = "") {
  test::TempDir t("sig");
  const std::string rc = t / "rc";
  test::run_command("( " + env + " OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config " + cfg + " > " + log +
                    " 2>&1; echo $? > " + rc + " ) & echo $! > " + t / "pid");
  bool seen = false;
  for (int i = 0; i < 600 && !seen; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    seen = test::read_file(log).find(want) != std::string::npos;
  }
  REQUIRE(seen);
  // The subshell's child is trainrun itself (the agent or the single worker).
  test::run_command("pkill -" + sig + " -P $(cat " + t / "pid" + ")");
  for (int i = 0; i < 600 && !test::file_exists(rc); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE(test::file_exists(rc));
  return std::stoi(test::read_file(rc));
}

// ... once rank 0 has logged `step`.
int run_and_signal(const std::string& cfg, const std::string& log, const std::string& sig, int step) {
  return run_and_signal_at(cfg, log, sig, "step " + std::to_string(step) + "/");
}

}  // namespace

TEST_CASE("preemption: SIGTERM or SIGUSR1 to the agent checkpoints, exits 75, and the next start resumes", "[preemption]") {
  for (const char* sig : {"TERM", "USR1"}) {
    SECTION(sig) {
      test::TempDir dir("preempt");
      const std::string run = dir / "run";
      test::write_file(dir / "job.yaml", job(run, 2, 3000));
      const int code = run_and_signal(dir / "job.yaml", dir / "out.txt", sig, 5);
      const std::string out = test::read_file(dir / "out.txt");
      INFO(out);
      CHECK(code == 75);
      CHECK_THAT(out, Contains("saving a checkpoint at step") && Contains("checkpointed, please requeue"));
      std::string latest = test::read_file(run + "/checkpoints/latest");
      REQUIRE(latest.rfind("step_", 0) == 0);
      const int saved = std::stoi(latest.substr(5));
      CHECK(saved >= 5);
      CHECK(saved < 3000);
      // Requeue: the same command resumes; finish quickly by lowering max_steps.
      auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml" +
                                 " --set train.max_steps=" + std::to_string(saved + 3));
      CHECK(r.exit_code == 0);
      CHECK_THAT(r.err, Contains("resume: loaded " + run + "/checkpoints/" + latest.substr(0, 13)));
      auto steps = steps_in(run + "/metrics.jsonl");
      REQUIRE(steps.size() == size_t(saved + 3));
      for (size_t i = 0; i < steps.size(); ++i) CHECK(steps[i] == int(i) + 1);
    }
  }
}

TEST_CASE("preemption: a single in-process worker stops the same way", "[preemption]") {
  test::TempDir dir("preempt");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job(run, 1, 100000));
  const int code = run_and_signal(dir / "job.yaml", dir / "out.txt", "USR1", 3);
  INFO(test::read_file(dir / "out.txt"));
  CHECK(code == 75);
  CHECK(test::file_exists(run + "/checkpoints/latest"));
  CHECK(!test::file_exists(run + "/model.safetensors"));  // skipped: the checkpoint is what matters
}

// A signal while the job is still starting (here: held in a debug pause
// right after the launch line, where only main()'s handlers watch) is not
// fatal: the agent, or a process training alone, exits 75 at once, saying
// there was nothing to checkpoint, and leaves nothing running.
TEST_CASE("preemption: a signal before training started exits 75 at once, nothing to checkpoint", "[preemption]") {
  for (int nproc : {1, 2}) {
    for (const char* sig : {"TERM", "USR1"}) {
      SECTION(std::to_string(nproc) + " worker(s), SIG" + sig) {
        test::TempDir dir("preempt");
        const std::string run = dir / "run";
        test::write_file(dir / "job.yaml", job(run, nproc, 3000));
        const auto t0 = std::chrono::steady_clock::now();
        const int code = run_and_signal_at(dir / "job.yaml", dir / "out.txt", sig, "debug: start-up pause",
                                           "TRAINRUN_DEBUG_START_DELAY_MS=30000");
        const std::string out = test::read_file(dir / "out.txt");
        INFO(out);
        CHECK(code == 75);
        CHECK_THAT(out, Contains(std::string("received SIG") + sig) &&
                            Contains("the job was preempted before training started (nothing to checkpoint); "
                                     "exiting with code 75 (please requeue)"));
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));  // the pause did not run out
        CHECK(!test::file_exists(run + "/checkpoints"));
        CHECK(!test::file_exists(run + "/logs"));  // no worker was started
        CHECK(test::run_command("pgrep -f '[t]rainrun.*" + dir.path() + "'").exit_code != 0);
      }
    }
  }
}

// Workers with peers that got a stop signal while setting up (model, data,
// checkpoint loading) agree before the first step and stop there: no step,
// no checkpoint, exit 75 (here two in-process ranks; the flag is the process's).
TEST_CASE("preemption: ranks that got a signal while setting up stop before the first step", "[preemption]") {
  test::TempDir dir("preempt");
  const std::string run = dir / "run";
  const JobSpec spec = parse_job_spec(job(run, 2, 50), "job.yaml");
  install_stop_handlers();
  std::raise(SIGUSR1);  // noted by the handler: the workers find it set when they start
  std::vector<TrainSummary> out;
  try {
    out = test::run_ranks_inprocess(spec, 2);
  } catch (...) {
    reset_stop_signal();
    throw;
  }
  reset_stop_signal();
  REQUIRE(out.size() == 2);
  for (const TrainSummary& s : out) {
    CHECK(s.stop_signal == SIGUSR1);
    CHECK(s.steps == 0);
    CHECK(exit_code_for(s) == 75);
  }
  CHECK(!test::file_exists(run + "/checkpoints/latest"));
  CHECK(!test::file_exists(run + "/model.safetensors"));
}

TEST_CASE("nonfinite: a NaN gradient on one rank skips the update on every rank", "[preemption]") {
  test::TempDir dir("nan");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job(run, 2, 8));
  auto r = test::run_command("TRAINRUN_DEBUG_NAN_STEP=3 TRAINRUN_DEBUG_NAN_RANK=1 OMP_NUM_THREADS=1 '" +
                             test::trainrun_binary() + "' --config " + dir / "job.yaml");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("step 3: non-finite gradient norm") &&
                        Contains("skipped the update on every rank (1 of at most 10)"));
  CHECK(steps_in(run + "/metrics.jsonl").size() == 8);
  // The weights stay finite: the poisoned step never reached them.
  auto g = test::run_trainrun("generate --checkpoint " + run + " --prompt '1 2 3' --max-tokens 4 --top-k 1");
  CHECK(g.exit_code == 0);
}

TEST_CASE("nonfinite: too many skipped steps stop the job with a clear message", "[preemption]") {
  test::TempDir dir("nan");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", job(run, 1, 8, "") );
  auto r = test::run_command("TRAINRUN_DEBUG_NAN_STEP=all OMP_NUM_THREADS=1 '" + test::trainrun_binary() +
                             "' --config " + dir / "job.yaml" + " --set train.max_skipped_steps=2");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("training stopped at step 3: 3 updates were skipped") &&
                        Contains("train.max_skipped_steps: 2"));
}
