// Checkpoints: atomic, verified, logical (reshardable), optionally async.
//
// <output.dir>/checkpoints/step_<8 digits>/
//   model.safetensors      fp32 master weights, the layout's (HF-style) names and
//                          order (so it is also a model file that
//                          `generate` and the safetensors package read)
//   optimizer.safetensors  exp_avg.<name>..., then exp_avg_sq.<name>...
//   manifest.json          format version, step, tokens, data cursor, the
//                          resolved job spec, world size + strategy at save
//                          time, the layout, seeds, and for every file its
//                          size and the xxhash64 of each of its segments
// <output.dir>/checkpoints/latest   the name of the newest complete one
//
// Every rank pwrite()s the ranges it is responsible for (ParamStore::
// write_ranges, a partition of the model) at their global offsets, so the
// files never depend on the world size: a checkpoint written by N ranks
// loads on M under any strategy. Commit protocol: rank 0 creates the files
// in a temporary directory; all ranks write + fsync and report through the
// rendezvous store; rank 0 writes the manifest, fsyncs, renames the
// directory into place and only then updates `latest`. A crash at any point
// leaves the previous checkpoint as `latest`; stale temporary directories
// are removed at the next start.
//
// Store keys of checkpoint step S (under the attempt's prefix):
//   ckpt/S/ready          rank 0: "ok", or why it could not lay out the files
//   ckpt/S/segments/<r>   rank r: what it wrote (file, offset, bytes, xxhash64)
//   ckpt/S/written/<r>    rank r: "ok" or "rank r: what went wrong"
//   ckpt/S/committed      rank 0: "ok" or why the checkpoint was not committed
//   ckpt/S/done           a counter: ranks that have read "committed"
//   ckpt/abort            "rank r (why)": rank r stopped; no checkpoint of
//                         this attempt can complete any more
// Every rank always publishes its "written" status, whatever it caught, and
// rank 0 always publishes "committed", so no rank waits out the checkpoint
// timeout for a peer that failed. After reading "committed" a rank removes
// its own two keys and bumps "done"; the rank that brings it to the world
// size removes the rest: a finished checkpoint leaves no key behind.
//
// Abandoning. A rank whose trainer unwinds with an exception (the
// Checkpointer's destructor) or that calls abort() sets "ckpt/abort". Every
// wait of a checkpoint is sliced (kAbortPoll) and between slices checks
// that key and the rank's own abort flag, so a save in flight anywhere ends
// within about a second: rank 0 refuses to commit it (right up to the
// rename into place), the other ranks' saves fail naming the rank that
// stopped and why, and `latest` stays where it was.
//
// Re-saving a step that already exists (a run resumed from an older one):
// the old directory is renamed to .old-step_N, the new one into place, then
// `latest` moves and .old-step_N goes. A crash between the two renames
// leaves step_N missing; clean_stale() at the next start then renames
// .old-step_N back (it removes it only when step_N is there and complete).
//
// Checksums in one pass. Several ranks write disjoint ranges of one file, so
// no single writer sees a file's bytes in order, and xxhash64 does not
// compose. Each rank therefore hashes what it writes, as it writes it, in
// segments (one written range, cut into pieces of at most 64 MiB; rank 0
// adds the headers), and reports them with its "written" status; rank 0
// checks that the segments tile each file exactly and lists them in the
// manifest ("segments": offset, bytes, xxhash64). Nothing is read back.
// Loading, every rank reads the segments that overlap what it holds (rank 0
// also the headers), hashes the bytes as they arrive, and the ranks agree
// that every segment matched before any value goes into the model or the
// optimizer (they are read into host staging buffers first); a mismatch
// anywhere makes every rank drop the candidate (auto: fall back to the
// previous checkpoint). Format 1 manifests (one xxhash64 per whole file)
// still load: the whole file is then one segment.
//
// Strided ranges (format 3). A tensor-parallel rank's slice of a weight
// split along its inner dim is one run per row; ParamStore::Range carries
// it as one strided range (start, count, stride, reps) per tensor, hashed
// as strided segments, so the manifest, the store keys and every rank's
// range lists stay at a few hundred entries where one per row would be
// ~1.3M (Llama-3 70B, tp8). Written as is, such a range is one pwrite per
// run (the runs are not adjacent: nothing vectored can merge them); with a
// TP exchange communicator (set_tp_exchange) the group trades slices and
// each rank writes groups of whole rows instead (row_exchange.h), still
// hashing one strided segment per TP slice of each group.
// The segments still tile each file; the check walks every segment's runs
// in file order (a heap merge: memory per segment). Manifests without
// strided segments stay format 2.
//
// Code: format.{h,cpp} (names, headers, hashing, manifest entries, verify),
// checkpoint.cpp (the commit protocol), resume.cpp (load).
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/sharding.h"
#include "parallel/rendezvous/store.h"

namespace trainrun {

namespace ckpt {
struct RowExchangeBuffers;
class Hasher;
}

// Everything besides the tensors that shapes the future of a run.
struct TrainState {
  int64_t step = 0;     // optimizer steps completed
  int64_t cursor = 0;   // global sample index of the next training batch
  int64_t tokens = 0;   // tokens seen
  // model.moe_balance: bias: the (layers, E) expert bias (identical on every
  // rank: the load it follows is all-reduced), in the manifest; empty = none.
  std::vector<float> moe_expert_bias;
};

// What a checkpoint holds, and how a resume checks it: a whole model's
// state (of_model: the arch's layout, file header and manifest block), or
// the adapters on a frozen base (core/train/adapter_training: the adapter
// layout, a manifest block naming the base and its fingerprint, and the
// PEFT directory written inside every checkpoint).
struct CheckpointSubject {
  const ParamLayout* layout = nullptr;  // must outlive the Checkpointer
  std::string model_header;             // model.safetensors' header (its tensors in layout order)
  std::string manifest_model;           // the manifest's "model" block, as JSON text
  // "" when a manifest's saved "model" block can be resumed into this one,
  // else what differs ("model.n_layer = 2 but this job has 4").
  std::function<std::string(const nlohmann::ordered_json& saved)> mismatch;
  static CheckpointSubject of_model(const ModelArch& arch);
};

class Checkpointer {
 public:
  // store may be null for a single-rank run.
  // `arch` (the model: its layout, file header and manifest block) must
  // outlive the Checkpointer.
  Checkpointer(const JobSpec& job, const ModelArch& arch, int rank, int world, Store* store, Communicator* comm,
               std::string key_prefix);
  Checkpointer(const JobSpec& job, CheckpointSubject subject, int rank, int world, Store* store, Communicator* comm,
               std::string key_prefix);
  // Waits for an async save in flight; during exception unwinding it first
  // abandons it (abort()), so a failing rank never waits behind its save.
  ~Checkpointer();

  // Abandons the save in flight, if any, and every later one of this
  // attempt on every rank (see "Abandoning" above); `why` goes into the
  // other ranks' messages ("rank 1 (why)"). Returns once this rank's
  // background save has ended (within about a second). Never throws.
  void abort(const std::string& why);

  // Rank 0: remove temporary directories left by a crash; put back a step
  // that a crash left moved aside (.old-step_N) while it was re-saved.
  // Never throws: what goes wrong fails the next load() on every rank.
  void clean_stale();
  // Collective. Snapshots the state; writes it now (sync) or in a background
  // thread (async). Returns the seconds training was blocked.
  // `extra`: files besides the state, written by rank 0 into the
  // checkpoint's temporary directory before its manifest (so they commit
  // with it): the adapters' PEFT directory. It runs on the thread that
  // writes (a background one for async saves), so it must own its data.
  double save(ParamStore& ps, const TrainState& st, std::function<void(const std::string& dir)> extra = {});
  // Tensor parallelism: a host communicator of this rank's TP group used
  // only by checkpoints, so that its row-parallel slices are written as
  // whole rows (row_exchange.h) instead of one pwrite per row. Set before
  // prepare(); null (the default) or size 1: every rank writes its own runs.
  void set_tp_exchange(Communicator* tp) { tp_exchange_ = tp; }
  // Learn the rank's ranges (collective over the TP exchange, when set).
  void prepare(ParamStore& ps);
  // Async: the background save reads the live state piece by piece (no
  // whole snapshot in host memory), so the trainer calls this before
  // anything changes master weights or moments (the optimizer step): it
  // blocks until the save in flight has read all of them. Returns the
  // seconds it blocked (training's share of an async save); 0 when none.
  double before_state_change();
  // The most host memory this rank's saves have held for the state (bytes):
  // one piece of at most one segment (kSegmentBytes), whatever the shard.
  size_t host_buffer_bytes() const { return host_bytes_peak_; }
  // pwrite calls of checkpoint data made in this process so far (every
  // rank of an in-process test): the tests hold "O(tensors), not O(rows)".
  static uint64_t write_calls();
  // Wait for an in-flight async save (and apply checkpoint.on_error).
  void wait();
  // Collective. Resolves checkpoint.resume and loads; false when nothing to load.
  bool load(ParamStore& ps, TrainState& st);

  // Verifies a checkpoint directory (manifest, sizes, checksums: every
  // byte is read once); returns "" when good, else what is wrong. Public for
  // tests and `trainrun` tools. With `only` (file names, "model.safetensors"),
  // the checksums of just those files are read: a tool that reads only the
  // weights (export, generate) verifies what it reads, not the optimizer
  // file, twice the model's size (every file must still be listed and sized).
  static std::string verify(const std::string& dir, const std::vector<std::string>& only = {});

  // xxhash64 of bytes [offset, offset + bytes) of one checkpoint file, or
  // (reps > 1, format 3: a rank's strided tensor-parallel slice) of the
  // `reps` runs of `bytes` bytes at offset + i*stride, hashed in order.
  struct Segment {
    uint64_t offset = 0, bytes = 0, hash = 0;
    uint64_t stride = 0, reps = 1;
    uint64_t total() const { return bytes * reps; }
    uint64_t end() const { return offset + (reps - 1) * stride + bytes; }
  };

 private:
  // Streams `live`'s write ranges to the files in pieces and commits;
  // `released` (an async save's) is set once every piece has been read.
  void write_and_commit(int64_t step, const TrainState& st, ParamStore* live, std::promise<void>* released);
  // segments: per file (model, optimizer), what every rank wrote.
  // One write range of one kind from `live`, in one-segment pieces (a
  // strided one: one pwrite per run), hashed into `segs`.
  void write_range(int fd, const std::string& path, int64_t base, int kind, const ParamStore::Range& r,
                   ParamStore& live, ckpt::Hasher& h, std::vector<Segment>& segs);
  void commit_rank0(int64_t step, const TrainState& st, const std::string& tmp, const std::string& final_dir,
                    std::vector<std::vector<Segment>> segments);
  void clean_stale_rank0();
  void retention();
  void note_host_bytes();  // after piece_ grew: the peak host_buffer_bytes() reports
  void handle_failure(const std::string& what);
  // Rank 0, resume: never: move an earlier run's checkpoints aside.
  void set_aside_earlier_checkpoints();
  // Rank 0: the checkpoint directories checkpoint.resume allows, best first.
  std::vector<std::string> resume_candidates();
  // Reads this rank's held ranges of the three state kinds from `dir` into
  // `out`, verifying what it reads; "" or what is wrong. With `out` null it
  // only verifies (hashes the same segments, keeps nothing).
  std::string read_verified(const std::string& dir, std::vector<std::vector<float>>* out);
  // After a verify-only pass: this rank's held ranges, one kind at a time,
  // straight into the live state (one kind's worth of host memory).
  void load_kind_by_kind(const std::string& dir, ParamStore& ps);
  // Collective: "" when no rank reported a problem, else the lowest rank's.
  std::string first_error_of_all(const std::string& mine);
  // Collective: the lowest rank's `fatal`, else the lowest rank's `skip`
  // (*is_fatal tells which), else "".
  std::string worst_of_all(const std::string& fatal, const std::string& skip, bool* is_fatal);

  // Abandoning (see the top of this file). Throws CheckpointAborted (an
  // Error) when this rank's abort flag is set or the store's abort key is:
  // the key is asked at most every kAbortPoll unless `ask_store_now`.
  void check_abort(bool ask_store_now);
  // Blocks until every key exists, in slices that check_abort() between
  // them; at `deadline` an Error naming `what` and the missing keys.
  void await_keys(const std::vector<std::string>& keys, std::chrono::steady_clock::time_point deadline,
                  const std::string& what);
  std::string await_text(const std::string& key, std::chrono::steady_clock::time_point deadline,
                         const std::string& what);
  // After this rank read "committed": drop its keys; the last rank drops the rest.
  void drop_keys(int64_t step);
  std::string abort_key() const { return prefix_ + "ckpt/abort"; }
  std::string step_key(int64_t step) const { return prefix_ + "ckpt/" + std::to_string(step) + "/"; }

  const JobSpec& job_;
  CheckpointSubject subject_;
  const ParamLayout& layout_;
  std::function<void(const std::string&)> extra_files_;
  int rank_, world_;
  Store* store_;
  Communicator* comm_;
  std::string prefix_;
  std::string root_;  // <output.dir>/checkpoints
  std::vector<ParamStore::Range> write_ranges_;
  std::vector<ParamStore::Range> held_ranges_;
  std::vector<float> piece_;  // a save's one-segment buffer (either thread: one save at a time)
  Communicator* tp_exchange_ = nullptr;
  std::vector<int64_t> whole_rows_;  // per write range: its place among those the TP group writes whole, or -1
  std::unique_ptr<ckpt::RowExchangeBuffers> row_bufs_;
  size_t host_bytes_peak_ = 0;
  std::shared_future<void> state_read_;  // an async save: set once it has read the whole state
  std::string clean_error_;  // rank 0: what clean_stale() could not do
  std::thread bg_;
  std::string bg_error_;
  // Abandoning: set by abort() (any thread), read by the thread that saves.
  std::atomic<bool> aborted_{false};
  std::mutex abort_mu_;
  std::string abort_why_;  // guarded by abort_mu_
  std::chrono::steady_clock::time_point next_abort_poll_{};  // the saving thread's
  int uncaught_at_start_ = 0;  // std::uncaught_exceptions() at construction
};

}  // namespace trainrun
