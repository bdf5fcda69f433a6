// The end-of-run model file (<output.dir>/model.safetensors), written the
// way checkpoints are: no rank ever gathers the model.
//
// Rank 0 creates <path>.tmp.<pid> with the fp32 header (the flat layout's
// tensors in order, model_file_header) and reserves its full size;
// every rank then pwrites its ParamStore::write_ranges() of the fp32 master
// weights at their global offsets, in pieces of at most kFinalWeightsPiece
// bytes (so a rank holds its shard plus one piece), fsyncs, and reports
// through the rendezvous store; rank 0 renames the file into place once
// every rank reported "ok". A failure on any rank (disk full, a short
// write, anything thrown) reaches every rank as an Error naming that rank
// and the file, the temporary file is removed and an older model.safetensors
// is left as it was.
#pragma once
#include <chrono>
#include <cstddef>
#include <string>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "parallel/sharding/sharding.h"
#include "parallel/rendezvous/store.h"

namespace trainrun {

constexpr size_t kFinalWeightsPiece = size_t(64) << 20;

// How long a rank waits for the others while a model-sized file is written:
// disk-bound, so far longer than a collective: 10x parallel.timeout_s, at
// least 10 minutes.
int64_t disk_wait_timeout_ms(const JobSpec& job);

// Collective over the job's ranks. `store` may be null for a single rank.
// `timeout` bounds each wait for another rank (writing is disk-bound: use a
// checkpoint-sized timeout, not a collective's).
void save_final_weights(const std::string& path, const ModelArch& arch, ParamStore& ps, int rank, int world,
                        Store* store, const std::string& key_prefix, std::chrono::milliseconds timeout);

}  // namespace trainrun
