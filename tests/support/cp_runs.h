// Context-parallel runs for the tests (test_cp_training, test_cp_window):
// a network's forward + backward at one rank and over a cp group of Gloo
// threads (losses in global order, gradients summed over the cp ranks as
// the stores' reduction forms them), and whole jobs through the in-process
// trainer, compared with the one-rank run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "parallel/context/cp_attention.h"
#include "tests/support/mesh_runs.h"

namespace trainrun::test {

// ---- the networks ----

struct Batch {
  int B = 2, T = 32;
  std::vector<int32_t> in, tgt, doc_start, pos;  // (B,T); doc_start/pos empty = no documents
};

// B = 2 sequences of T random tokens below V; docs: make_cp_docs's documents.
Batch make_batch(int T, bool docs, uint64_t seed, int V = 23);

struct NetResult {
  std::vector<float> losses;  // (B,T) global order
  std::vector<float> grads;   // whole model, summed over the cp ranks
  size_t act_bytes = 0;       // rank 0's network
  double waited = 0;          // rank 0's wait on the cp group
};

std::vector<float> init_params(const ModelArch& arch);  // seed 42
NetResult one_rank(const ModelArch& arch, const Batch& b, bool ckpt = false);
NetResult cp_ranks(const ModelArch& arch, const Batch& b, int cp, const std::string& mode, bool ckpt = false);
double max_rel(const std::vector<float>& got, const std::vector<float>& ref);  // max |got - ref| / max |ref|

// ---- the trainer ----

// A 5-step job on synthetic data (vocab 23) of `model` (a YAML flow map), global batch 2 in micro-batches of 1.
std::string cp_job(const std::string& dir, const std::string& model, bool docs);
using Run = MeshRun;  // losses and final weights (tests/support/mesh_runs.h)

// run_job: the job at `world` in-process ranks with `sets`; its losses and final model.safetensors.
Run run_job(const std::string& model, int world, bool docs, const std::vector<std::string>& sets);
// parallel.context_parallel=cp and parallel.cp_mode=mode after `more`.
std::vector<std::string> cp_sets(int cp, const std::string& mode, std::vector<std::string> more = {});

}  // namespace trainrun::test
