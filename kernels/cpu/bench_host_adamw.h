// `trainrun bench optimizer`: the host AdamW of parallel.offload, measured
// next to what the memory system can do and next to PyTorch, in one run:
//   triad        a[i] = b[i] + s*c[i] over three arrays (STREAM's triad,
//                counted as STREAM does: 12 bytes per element), the bound
//                of a streaming kernel on this machine and thread count
//   host AdamW   host_adamw_update over --params elements: parameters/s and
//                the bytes it moves (28 per parameter: reads w, g, m, v;
//                writes w, m, v) as GB/s and as a share of the triad
//   scalar       the same with the scalar kernel (what the vector ISA buys)
//   torch        torch.optim.AdamW on CPU tensors of the same size and
//                thread count (torch.set_num_threads), foreach=True, and
//                fused=True where the installed version supports it on the
//                CPU, run by `python3` (skipped with a note when torch
//                cannot be imported)
// Every row is the median of --repeat timed runs after one warm-up.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace trainrun {

struct OptimizerBenchOptions {
  std::string params = "32M";       // elements of the shard: 32M = 512 MB of state
  std::vector<int> threads{1, 2};   // thread counts, one table row group each
  int repeat = 5;
  std::string python = "/usr/bin/python3";  // the interpreter that has torch ("" skips it): Debian's python3-torch
};

int run_optimizer_bench(const OptimizerBenchOptions& opts);

}  // namespace trainrun
