// Checkpoints: atomic, verified, logical (reshardable), optionally async.
//
// <output.dir>/checkpoints/step_<8 digits>/
//   model.safetensors      fp32 master weights, HF GPT-2 names, the flat
//                          layout's order (so it is also a model file that
//                          `generate` and the safetensors package read)
//   optimizer.safetensors  exp_avg.<name>..., then exp_avg_sq.<name>...
//   manifest.json          format version, step, tokens, data cursor, the
//                          resolved job spec, world size + strategy at save
//                          time, the layout, seeds, and size + xxhash64 of
//                          every file
// <output.dir>/checkpoints/latest   the name of the newest complete one
//
// Every rank pwrite()s the ranges it is responsible for (ParamStore::
// write_ranges, a partition of the model) at their global offsets, so the
// files never depend on the world size: a checkpoint written by N ranks
// loads on M under any strategy. Commit protocol: rank 0 creates the files
// in a temporary directory; all ranks write + fsync and report through the
// rendezvous store; rank 0 checksums, writes the manifest, fsyncs, renames
// the directory into place and only then updates `latest`. A crash at any
// point leaves the previous checkpoint as `latest`; stale temporary
// directories are removed at the next start.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/gpt2.h"
#include "parallel/communicator.h"
#include "parallel/sharding.h"
#include "parallel/store.h"

namespace trainrun {

// Everything besides the tensors that shapes the future of a run.
struct TrainState {
  int64_t step = 0;     // optimizer steps completed
  int64_t cursor = 0;   // global sample index of the next training batch
  int64_t tokens = 0;   // tokens seen
};

class Checkpointer {
 public:
  // store may be null for a single-rank run.
  Checkpointer(const JobSpec& job, const GPT2Config& cfg, const ParamLayout& layout, int rank, int world,
               Store* store, Communicator* comm, std::string key_prefix);
  ~Checkpointer();

  // Rank 0: remove temporary directories left by a crash.
  void clean_stale();
  // Collective. Snapshots the state; writes it now (sync) or in a background
  // thread (async). Returns the seconds training was blocked.
  double save(ParamStore& ps, const TrainState& st);
  // Learn the rank's ranges; with async, allocate the host snapshot now.
  void prepare(ParamStore& ps);
  // Wait for an in-flight async save (and apply checkpoint.on_error).
  void wait();
  // Collective. Resolves checkpoint.resume and loads; false when nothing to load.
  bool load(ParamStore& ps, TrainState& st);

  // Verifies a checkpoint directory (manifest, sizes, checksums); returns ""
  // when good, else what is wrong. Public for tests and `trainrun` tools.
  static std::string verify(const std::string& dir);

 private:
  void write_and_commit(int64_t step, const TrainState& st, const std::vector<std::vector<float>>& parts);
  void commit_rank0(int64_t step, const TrainState& st, const std::string& tmp, const std::string& final_dir);
  void retention();
  void ensure_snapshot_buffers();
  void handle_failure(const std::string& what);
  std::string choose_resume_dir();

  const JobSpec& job_;
  GPT2Config cfg_;
  const ParamLayout& layout_;
  int rank_, world_;
  Store* store_;
  Communicator* comm_;
  std::string prefix_;
  std::string root_;  // <output.dir>/checkpoints
  std::vector<ParamStore::Range> write_ranges_;
  std::vector<ParamStore::Range> held_ranges_;
  std::vector<std::vector<float>> snapshot_ = std::vector<std::vector<float>>(3);
  std::thread bg_;
  std::string bg_error_;
};

}  // namespace trainrun
