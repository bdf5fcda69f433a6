// `trainrun bench offload`: parallel.offload's costs, measured in one run
// next to what this machine can do:
//   disk        sequential O_DIRECT write and read of a file under --dir
//               (16 MiB requests, one at a time, fdatasync after the
//               write): the bound of the nvme path on this file system
//   nvme        HostOptimizerState over --params elements on the CPU
//               backend, for each I/O engine built in (io_uring, pool):
//               the step (reads master, m, v, grad; writes master, m, v:
//               28 bytes per element), the grad norm (reads 4) and the
//               gradient's landing (writes 4; reads 4 more after the first
//               micro-batch; or, summed on the device under accumulation,
//               written once per step), each as GB/s and as a share of the disk's
//               time for the same bytes (reads at the read speed plus
//               writes at the write speed)
//   step time   the CPU benchmark model (--config, configs/bench_cpu.yaml)
//               run by this binary with parallel.offload none, cpu and nvme:
//               the median ms/step after the first three steps
// Prints tables; nothing is asserted (benchmarks are not timed tests).
#pragma once
#include <string>

namespace trainrun {

struct OffloadBenchOptions {
  std::string params = "32M";   // elements of the shard (512 MiB of state on disk)
  std::string dir = "/tmp";     // where the state file and the disk probe go (a scratch folder inside)
  int repeat = 3;               // timed runs per row (median)
  std::string config = "configs/bench_cpu.yaml";  // the step-time model ("" skips the step-time table)
  int steps = 10;               // steps per step-time run
};

int run_offload_bench(const OffloadBenchOptions& opts);

}  // namespace trainrun
