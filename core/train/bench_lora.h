// `trainrun bench lora`: what adapters save on the CPU benchmark model
// (configs/bench_cpu.yaml), measured in one run: the same model, batch and
// steps trained as a full fine-tune and with LoRA (r 16 on every block
// linear by default), at each thread count (default 1 and every core: the
// adapters add many small GEMMs, whose OpenMP barriers cost more the more
// threads share a loaded machine), alternating, two rounds, the lower
// median step time of each kept (a burst of load from elsewhere hits one
// round, rarely both). Per run: trainable parameters, median ms/step and tokens/s, the
// optimizer state (AdamW moments), gradients and parameters the run
// allocated (its TrainSummary: for LoRA the frozen base plus the adapters'
// fp32 master) and the backend's peak; then LoRA / full as ratios.
// Prints a table; nothing is asserted (benchmarks are not timed tests).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace trainrun {

struct LoraBenchOptions {
  std::string config = "configs/bench_cpu.yaml";  // the model, batch and data
  std::string adapter = "lora";                   // lora | dora
  int rank = 16;
  std::string target_modules = "all-linear";
  int steps = 8;    // steps per run; the median skips the first 2
  int rounds = 2;   // full and adapter runs, alternating
  std::vector<int> threads;  // OpenMP threads per pair of runs; empty = 1 and every core
};

struct LoraBenchRow {
  std::string what;              // "full fine-tune", "lora r=16 all-linear"
  int threads = 1;
  int64_t trainable = 0, total = 0;
  double step_ms = 0, tokens_per_s = 0;
  double optimizer_bytes = 0, grads_bytes = 0, params_bytes = 0, peak_bytes = 0;
};

std::vector<LoraBenchRow> run_lora_bench(const LoraBenchOptions& o, std::string* description);
std::string format_lora_bench_table(const std::vector<LoraBenchRow>& rows, const std::string& description);

}  // namespace trainrun
