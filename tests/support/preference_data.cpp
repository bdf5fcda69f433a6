#include "tests/support/preference_data.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/data/dataset.h"
#include "core/data/preference_pairs.h"

namespace trainrun::test {

using json = nlohmann::json;

// ---- data written directly (no tokenizer): one shard, masks, .pairs, prepare.json ----


void write_pref_dir(const std::string& dir, const std::vector<PrefPair>& pairs, int vocab) {
  std::vector<uint32_t> tok;
  std::vector<uint8_t> mask;
  PairIndexWriter idx(dir + "/train.pairs");
  for (const PrefPair& p : pairs) {
    idx.add({int64_t(tok.size()), int64_t(p.c.tok.size()), int64_t(p.r.tok.size())});
    for (const PrefSide* s : {&p.c, &p.r}) {
      tok.insert(tok.end(), s->tok.begin(), s->tok.end());
      mask.insert(mask.end(), s->mask.begin(), s->mask.end());
    }
  }
  idx.commit();
  write_llmc_shard(dir + "/train_000000.bin", tok, 1);
  write_file(dir + "/train_000000.mask", std::string(mask.begin(), mask.end()));
  uint32_t mx = 0;
  for (uint32_t t : tok) mx = std::max(mx, t);
  const json meta = {{"format", "preference"},
                     {"vocab_size", vocab},
                     {"document_start_id", 1},
                     {"shards", {{"train_000000.bin", {{"tokens", tok.size()}, {"max_token_id", mx}}}}}};
  write_file(dir + "/prepare.json", meta.dump());
}

// Pair i: a prompt of 1-3 tokens after the separator 1, responses of 1-3
// tokens; mask 1 on the responses. Tokens 2..V-1; sides fit `max_side`.
std::vector<PrefPair> random_pairs(int n, int V, uint64_t seed, int max_side) {
  std::mt19937_64 g(seed);
  auto tokn = [&] { return uint32_t(2 + g() % uint64_t(V - 2)); };
  std::vector<PrefPair> out;
  for (int i = 0; i < n; ++i) {
    PrefPair p;
    const int np = 1 + int(g() % 3);
    std::vector<uint32_t> prompt = {1};
    for (int k = 0; k < np; ++k) prompt.push_back(tokn());
    for (PrefSide* s : {&p.c, &p.r}) {
      const int nr = 1 + int(g() % uint64_t(std::max(1, std::min(3, max_side - np - 1))));
      s->tok = prompt;
      s->mask.assign(prompt.size(), 0);
      for (int k = 0; k < nr; ++k) {
        s->tok.push_back(tokn());
        s->mask.push_back(1);
      }
    }
    out.push_back(p);
  }
  return out;
}

std::vector<std::map<std::string, double>> read_metrics(const std::string& run_dir) {
  std::vector<std::map<std::string, double>> out;
  std::ifstream f(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    std::map<std::string, double> m;
    const json j = json::parse(line);  // items() of a temporary would dangle
    for (auto& [k, v] : j.items())
      if (v.is_number()) m[k] = v.get<double>();
    out.push_back(m);
  }
  return out;
}

RunResult run_job(const std::string& yaml_path, const std::string& sets) {
  return run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() + "' --config '" + yaml_path + "' " + sets +
                           " 2>&1");
}

}  // namespace trainrun::test
