// The small jobs the checkpoint tests run (test_checkpoint*.cpp) and what
// they read back from a run directory.
#pragma once
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun::test {

// A 2-layer GPT-2 whose units do not divide evenly by 3 or 4 ranks, 20
// steps on synthetic data, accumulation at world 1-2; `extra` is appended
// to the YAML.
std::string checkpoint_job_yaml(const std::string& dir, const std::string& strategy, const std::string& extra = "");
// That job for `world` ranks (a micro-batch that divides its 12 sequences),
// with --set style overrides.
JobSpec checkpoint_job(const std::string& dir, const std::string& strategy, int world,
                       std::vector<std::string> sets = {});

std::vector<double> losses_of(const std::string& run_dir);   // metrics.jsonl, in order
std::vector<float> weights_of(const std::string& run_dir);   // model.safetensors
std::string latest_of(const std::string& run_dir);           // checkpoints/latest, "" if none

}  // namespace trainrun::test
