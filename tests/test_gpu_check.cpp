// scripts/gpu-check.sh, the plan of the first GPU call, run here with stub
// binaries (GPU_CHECK_BIN) and deadlines of seconds: a step that hangs is
// cut at its cap (a training run with SIGKILL, never the TERM it would take
// as a preemption and answer with a checkpoint; a step that ignores TERM
// with the -k KILL), the call ends by its global deadline, and every step's
// summary line is in summary.txt. And the real plan fits one device call.
#include <catch2/catch.hpp>

#include <chrono>
#include <string>

#include "tests/support/testutil.h"

using namespace trainrun::test;

namespace {

// A stub trainrun: training runs print a throughput line, except the
// Llama-1B one, which hangs (and records a TERM if it gets one); `bench
// kernels` hangs ignoring TERM when STUB_BENCH_HANGS is set.
const char* kStubTrainrun = R"SH(#!/usr/bin/env bash
for a in "$@"; do
  case "$a" in
    *llama3_1b*)
      trap 'echo TERM >> "$STUB_DIR/training_got_term"' TERM
      while true; do sleep 0.1; done ;;
  esac
done
if [[ "$1" == bench && -n "${STUB_BENCH_HANGS:-}" ]]; then
  trap '' TERM
  while true; do sleep 0.1; done
fi
[[ "$1" == --version ]] && { echo "trainrun stub"; exit 0; }
echo "step 30/30 | loss 3.1 | 1234.5 tok/s"
)SH";
const char* kStubTests = R"SH(#!/usr/bin/env bash
echo "All tests passed (7 assertions in 3 test cases)"
)SH";

struct Call {
  RunResult r;
  double seconds;
  std::string summary;
};

Call run_check(const TempDir& dir, const std::string& env) {
  write_file(dir / "bin/trainrun", kStubTrainrun);
  write_file(dir / "bin/test_cuda_ops", kStubTests);
  run_command("chmod +x '" + dir / "bin/trainrun" + "' '" + dir / "bin/test_cuda_ops" + "'");
  const auto t0 = std::chrono::steady_clock::now();
  Call c;
  c.r = run_command("cd '" + dir.path() + "' && OUT='" + dir / "out" + "' TMPDIR='" + dir.path() + "' STUB_DIR='" +
                    dir.path() + "' GPU_CHECK_BIN='" + dir / "bin" + "' " + env + " bash '" + source_dir() +
                    "/scripts/gpu-check.sh' run");
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  c.summary = file_exists(dir / "out/summary.txt") ? read_file(dir / "out/summary.txt") : "";
  return c;
}

}  // namespace

TEST_CASE("gpu-check: a hung training run is killed at its cap (no TERM), the deadline skips the rest, and every "
          "step's summary is written",
          "[gpu_check]") {
  TempDir dir("gpucheck");
  // Deadline 8 s, caps 4 s, 1 s kill grace: the Llama run hangs from ~0 s to
  // its cap (4 s), then bench_kernels has 8 - 4 - 1 = 3 s < 5 s: skipped.
  const Call c = run_check(dir, "GPU_CHECK_BUDGET_S=8 GPU_CHECK_CAP_S=4 GPU_CHECK_KILL_S=1 GPU_CHECK_MIN_STEP_S=5");
  INFO(c.r.out << c.r.err << "\nsummary.txt:\n" << c.summary);
  CHECK(c.r.exit_code == 1);       // a step timed out: not a passing check
  CHECK(c.seconds < 8 + 2);        // the deadline, and a little for bash
  for (const char* line : {"setup          PASS", "ops_small      PASS", "ops_wide       PASS", "train_vs_cpu   PASS",
                           "llama_1b       TIMEOUT", "bench_kernels  SKIPPED"})
    CHECK_THAT(c.summary, Catch::Contains(line));
  CHECK_THAT(c.summary, Catch::Contains("gpt2_124m      PASS") && Catch::Contains("1234.5 tok/s, MFU"));
  CHECK_THAT(c.summary, Catch::Contains("rc=137"));   // SIGKILL at the cap
  CHECK(!file_exists(dir / "training_got_term"));  // never a TERM: no preemption checkpoint
  CHECK_THAT(c.summary, Catch::Contains("== gpu-check run done"));
}

TEST_CASE("gpu-check: a step that ignores TERM is killed KILL_S after its cap, and the steps after it still run",
          "[gpu_check]") {
  TempDir dir("gpucheck");
  // Caps 2 s: llama killed at 2 s; bench kernels ignores the TERM at its
  // 2 s cap and is killed 1 s later; all within the 20 s deadline.
  const Call c = run_check(dir, "STUB_BENCH_HANGS=1 GPU_CHECK_BUDGET_S=20 GPU_CHECK_CAP_S=2 GPU_CHECK_KILL_S=1 "
                                "GPU_CHECK_MIN_STEP_S=1");
  INFO(c.r.out << c.r.err << "\nsummary.txt:\n" << c.summary);
  CHECK(c.seconds < 2 + 2 + 1 + 4);
  CHECK_THAT(c.summary, Catch::Contains("llama_1b       TIMEOUT"));
  CHECK_THAT(c.summary, Catch::Contains("bench_kernels  TIMEOUT"));
  CHECK_THAT(c.summary, Catch::Contains("gpt2_124m      PASS"));
}

TEST_CASE("gpu-check: --dry-run lists both calls' steps and their totals fit one device call (<= 540 s)",
          "[gpu_check]") {
  for (const char* mode : {"run", "run2"}) {
    INFO(mode);
    const RunResult r = run_command("bash '" + source_dir() + "/scripts/gpu-check.sh' --dry-run " + mode);
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.out, Catch::Contains("setup"));
    // The total the script prints, checked here against the limit too.
    const size_t at = r.out.find("total ");
    REQUIRE(at != std::string::npos);
    const int total = std::stoi(r.out.substr(at + 6));
    CHECK(total > 0);
    CHECK(total <= 540);
  }
  // A plan over the limit is refused (the check is not a constant 0).
  const RunResult over = run_command("GPU_CHECK_CAP_S=200 bash '" + source_dir() + "/scripts/gpu-check.sh' --dry-run run");
  CHECK(over.exit_code == 1);
}
