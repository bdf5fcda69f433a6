// A tiny job's end-of-run sample (output.sample_tokens) at some tensor- or
// pipeline-parallel degree, and `trainrun generate` on the same final
// weights with the same seed: the tp and pp sample tests
// (test_tensor_parallel.cpp, test_pipeline_runtime.cpp) hold every mesh's
// sample to one rank's and to generate's.
#pragma once
#include <string>

#include "tests/support/testutil.h"

namespace trainrun::test {

struct SampleRun {
  std::string run;        // the run directory (DIR/<parallel_key><degree>)
  std::string log;        // the binary's stderr, then logs/rank0.log where the agent ran the ranks
  std::string generated;  // generate's stdout on run/model.safetensors: the prompt "7 3" and 30 ids
};

// MODEL (a YAML flow map of vocab_size 61) trained 4 steps on synthetic
// token ids by the binary on `degree` local ranks with parallel.PARALLEL_KEY
// (tensor_parallel or pipeline_parallel) = degree, sampling 30 tokens after
// "7 3" at the end (temperature 0.8, top-k 40, seed 42, as generate here).
// The job file is DIR/job.yaml. Fails the test when either command fails.
SampleRun run_with_sample(const TempDir& dir, const std::string& model, const std::string& parallel_key, int degree);

}  // namespace trainrun::test
