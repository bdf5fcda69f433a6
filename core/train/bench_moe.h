// `trainrun bench moe`: one training step (forward + backward) of a small
// mixture of experts (a Mixtral: E experts of ffn F, top-K) against the
// dense Llama of equal active parameters (the same attention, one MLP of
// K x F: per token the same matmul work but the router), on one rank of
// the CPU backend. What the ratio shows is the MoE MLP's overhead on the
// CPU: routing, the permute into expert order and back, and E smaller
// GEMMs (one per expert) in place of one large one.
#pragma once
#include <string>
#include <vector>

namespace trainrun {

struct MoeBenchOptions {
  int experts = 8, top_k = 2;  // E, K
  int layers = 2, width = 128, heads = 4, kv_heads = 2;
  int expert_ffn = 256;         // each expert's width F (the dense MLP's is K x F)
  int seq_len = 256, batch = 4;  // tokens per step: batch x seq_len
  int steps = 4;                // per model (the first, warm-up, is not counted)
};

struct MoeBenchRow {
  std::string model;            // the arch's describe()
  long long params = 0, active = 0;  // every parameter; those one token's matmuls use (matmul_parameters)
  double step_ms = 0;           // median forward + backward
  double tokens_per_s = 0;
};

// Rows: the dense model, then the mixture of experts.
std::vector<MoeBenchRow> run_moe_bench(const MoeBenchOptions& o);
std::string format_moe_table(const std::vector<MoeBenchRow>& rows, const MoeBenchOptions& o);

}  // namespace trainrun
