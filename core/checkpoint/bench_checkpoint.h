// `trainrun bench checkpoint`: how fast checkpoints are written and read,
// next to what the disk itself does, measured in the same run on the same
// directory:
//   disk write   one file of the checkpoint's size, 16 MiB write()s + fsync
//   disk read    that file read back sequentially in 16 MiB read()s
//   save         Checkpointer::save with checkpoint.async false: the real
//                path end to end (snapshot, pwrite with xxhash64 on the way,
//                fsync, manifest, rename, `latest`); training is blocked for all of it
//   save async   the same with async true: the time training is blocked (the
//                host snapshot) and the background write's total
//   load         Checkpointer::load (sizes, then read + verify xxhash64 in one pass)
//   tp2          a tp2 Llama (4 x 1024, 110M parameters) trained one step by
//                this binary on two ranks: its checkpoint's seconds and
//                rank 0's pwrite count (whole rows, row_exchange.h)
// The model is a GPT-2 of about --params parameters; a checkpoint holds the
// fp32 master weights and both AdamW moments (12 bytes per parameter).
//
// Reads: an unprivileged process cannot drop the page cache, but it can ask
// the kernel to evict one file's clean pages (posix_fadvise DONTNEED after
// fsync); the bench does that before every read and reports, through
// mincore(), how much of the file was still resident, since some filesystems
// (tmpfs, some network ones) ignore the request and then reads are cached.
#pragma once
#include <cstdint>
#include <string>

#include "core/common/text.h"  // parse_param_count
#include "core/model/model.h"

namespace trainrun {

struct CheckpointBenchOptions {
  std::string params = "124M";  // parameter count: 124000000, 124M, 1.5B, 350K
  std::string dir = ".";        // the directory (disk) to measure; a scratch folder is made and removed inside
  int repeat = 3;               // repetitions; the table shows medians
  bool tp2 = true;              // also a tp2 Llama's checkpoint (two ranks of this binary): seconds and pwrites
};

// A model of the default architecture (GPT-2: 12 layers, GPT-2's vocab and
// context when the count allows) whose parameter count is close to `params`.
ModelConfig bench_model_for(int64_t params);

// Prints the table to stdout (progress to stderr); returns 0.
int run_checkpoint_bench(const CheckpointBenchOptions& opts);

}  // namespace trainrun
