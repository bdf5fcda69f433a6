#include "tests/support/sample_run.h"

#include <algorithm>

#include <catch2/catch.hpp>

namespace trainrun::test {

SampleRun run_with_sample(const TempDir& dir, const std::string& model, const std::string& parallel_key, int degree) {
  SampleRun s;
  const std::string n = std::to_string(degree);
  s.run = dir / (parallel_key + n);
  write_file(dir / "job.yaml",
             "model: " + model + "\n"
             // Token ids, not bytes (V != 256): a sampled NUL byte would end the log line.
             "data: {format: synthetic, synthetic: {vocab: 61}}\n"
             "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 4, warmup_steps: 1, seed: 42}\n"
             "parallel: {nproc_per_node: " + n + ", " + parallel_key + ": " + n +
             ", sharding: full_shard, timeout_s: 60}\n"
             "checkpoint: {final: 'false'}\n"
             "output: {dir: '" + s.run + "', sample_tokens: 30, sample_prompt: '7 3'}\n");
  const auto r = run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto g = run_trainrun("generate --checkpoint '" + s.run + "/model.safetensors' --prompt '7 3' --max-tokens 30 "
                              "--temperature 0.8 --top-k 40 --seed 42");
  INFO(g.err);
  REQUIRE(g.exit_code == 0);
  REQUIRE(std::count(g.out.begin(), g.out.end(), ' ') >= 31);  // the prompt and 30 ids
  // One rank runs in-process (its log is stderr), more under the agent (logs/rank0.log).
  s.log = r.err + (file_exists(s.run + "/logs/rank0.log") ? read_file(s.run + "/logs/rank0.log") : "");
  s.generated = g.out;
  return s;
}

}  // namespace trainrun::test
