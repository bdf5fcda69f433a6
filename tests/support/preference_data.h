// Preference pairs for tests (tests/test_preference*.cpp): data written
// directly in prepare --format preference's layout (no tokenizer), and what
// the jobs leave (metrics.jsonl records).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tests/support/testutil.h"

namespace trainrun::test {

struct PrefSide {
  std::vector<uint32_t> tok;
  std::vector<uint8_t> mask;
};
struct PrefPair {
  PrefSide c, r;  // chosen, rejected
};

// One shard + .mask, train.pairs and a prepare.json of format preference
// (document_start_id 1) in `dir`.
void write_pref_dir(const std::string& dir, const std::vector<PrefPair>& pairs, int vocab);
// Pair i: the separator 1, a prompt of 1-3 tokens, responses of 1-3 tokens
// (mask 1 on them), tokens 2..V-1; each side at most `max_side` tokens.
std::vector<PrefPair> random_pairs(int n, int V, uint64_t seed, int max_side);
// Every numeric field of every line of <run_dir>/metrics.jsonl.
std::vector<std::map<std::string, double>> read_metrics(const std::string& run_dir);
// The trainrun binary on a job spec (stdout and stderr together), OMP_NUM_THREADS=1.
RunResult run_job(const std::string& yaml_path, const std::string& sets = "");

}  // namespace trainrun::test
