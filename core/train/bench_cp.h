// `trainrun bench cp`: one training step of a small Llama at a long
// sequence (T = 4096 by default) on one rank and split over cp ranks
// (threads of this process, Gloo over loopback, one core each), with the
// share of the cp step each rank spends inside the cp group's transfers:
// the ring's K/V (and dK/dV) send_recv, or all_to_all's exchanges. On Gloo
// those calls block, so the share is the step time the transfers (and the
// wait for the slower peer) cost; on NCCL the ring overlaps them with the
// block's attention (not measured here).
#pragma once
#include <string>
#include <vector>

namespace trainrun {

struct CpBenchOptions {
  int T = 4096;                 // sequence length
  std::vector<int> cps = {1, 2};  // the cp degrees to measure (1 = the one-rank network)
  std::string mode = "ring";    // ring | all_to_all
  int steps = 3;                // forward + backward per row (the first, warm-up, is not counted)
  int layers = 2, width = 128, heads = 4, kv_heads = 2;  // the Llama's shape (ffn 2 x width, vocab 512)
  bool documents = false;       // random documents (the ring skips what nobody may see)
};

struct CpBenchRow {
  int cp = 1;
  double step_ms = 0;       // median forward + backward of one micro-batch (rank 0)
  double wait_ms = 0;       // median time inside the cp transfers per step (rank 0)
  double wait_fraction = 0; // wait_ms / step_ms
  double cpu_ms = 0;        // median CPU time of rank 0's thread per step (its compute, less the load's effect)
  double tokens_per_s = 0;  // T / step time (the sequence, over all its ranks)
  double activation_mib = 0;  // rank 0's network arena
};

std::vector<CpBenchRow> run_cp_bench(const CpBenchOptions& o, std::string* model_description);
std::string format_cp_table(const std::vector<CpBenchRow>& rows, const std::string& model_description,
                            const CpBenchOptions& o);

}  // namespace trainrun
