// `trainrun bench comm`: collective bandwidth over the job's communicator
// type, nccl-tests style. algbw = bytes / time; busbw = algbw * factor, with
// factor 2(n-1)/n for all_reduce and (n-1)/n for reduce_scatter and
// all_gather (bytes = the full vector: for reduce_scatter the input, for
// all_gather the output), so busbw is comparable to the link bandwidth.
#pragma once
#include <cstdint>
#include <string>

namespace trainrun {

struct CommBenchOptions {
  std::string backend = "cpu";    // cpu (Gloo over loopback TCP) | cuda (NCCL)
  int nproc = 2;                  // ranks (threads of this process for the CPU backend)
  int64_t min_bytes = 1024;
  int64_t max_bytes = 256ll << 20;
  int iters = 0;                  // 0 = adaptive (fewer for large sizes)
  double timeout_s = 120;
  // TP-sized rows: bf16 all_reduce, all_gather and reduce_scatter of one
  // micro-batch's activations (micro_batch x seq_len x n_embd values, the
  // benchmark model's by default: 8 x 256 x 256) over `tp` ranks, the
  // sizes a tensor-parallel layer moves 4 times per block (see README).
  int tp = 2;                     // 0 = no TP rows
  int64_t tp_values = 8 * 256 * 256;
  std::string tp_shape = "8 x 256 x 256 (configs/bench_cpu.yaml)";
};

// Prints the table to stdout; returns 0.
int run_comm_bench(const CommBenchOptions& opts);

}  // namespace trainrun
