// The commit protocol (see checkpoint.h): snapshot, every rank's parallel
// write, rank 0's commit, abandoning, retention, and the clean-up at start.
// The format lives in format.{h,cpp}, loading in resume.cpp.
#include "core/checkpoint/checkpoint.h"

#include "core/checkpoint/final_weights.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <functional>
#include <future>
#include <thread>

#include "core/checkpoint/format.h"
#include "core/common/debug_hooks.h"
#include "core/checkpoint/row_exchange.h"
#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace trainrun {

using namespace ckpt;
using Range = ParamStore::Range;

namespace {

int64_t ckpt_timeout_ms(const JobSpec& job) {
  if (const int64_t ms = debug_env_ms("TRAINRUN_DEBUG_CKPT_TIMEOUT_MS")) return ms;  // tests
  return disk_wait_timeout_ms(job);  // the final weights wait as long (final_weights.h)
}

// What a member of a TP group that writes whole rows says when it stopped
// only because a peer failed (the commit then reports the peer's message).
constexpr const char* kPeerStopped = "a rank of this rank's tensor-parallel group could not write its part";

// How often a checkpoint's waits look for the abort key: the bound on how
// long a save in flight outlives its abandonment.
constexpr auto kAbortPoll = std::chrono::milliseconds(200);

// A checkpoint abandoned on purpose (Checkpointer::abort, here or on
// another rank), as opposed to one that failed.
class CheckpointAborted : public Error {
 public:
  using Error::Error;
};

}  // namespace

CheckpointSubject CheckpointSubject::of_model(const ModelArch& arch) {
  CheckpointSubject s;
  s.layout = &arch.layout();
  s.model_header = ckpt::model_header(arch, arch.layout());
  s.manifest_model = arch.manifest_model().dump();
  s.mismatch = [&arch](const nlohmann::ordered_json& saved) { return manifest_model_mismatch(arch, saved); };
  return s;
}

Checkpointer::Checkpointer(const JobSpec& job, const ModelArch& arch, int rank, int world, Store* store,
                           Communicator* comm, std::string key_prefix)
    : Checkpointer(job, CheckpointSubject::of_model(arch), rank, world, store, comm, std::move(key_prefix)) {}

Checkpointer::Checkpointer(const JobSpec& job, CheckpointSubject subject, int rank, int world, Store* store,
                           Communicator* comm, std::string key_prefix)
    : job_(job), subject_(std::move(subject)), layout_(*subject_.layout), rank_(rank), world_(world), store_(store),
      comm_(comm),
      prefix_(std::move(key_prefix)), root_((fs::path(job.output.dir) / "checkpoints").string()),
      uncaught_at_start_(std::uncaught_exceptions()) {
  TR_CHECK(world == 1 || store, "checkpoint: a multi-rank job needs the rendezvous store");
}

Checkpointer::~Checkpointer() {
  // Unwinding: this rank's trainer failed. Its save in flight (or a peer's
  // synchronous save waiting for it) must not hold anyone up.
  if (std::uncaught_exceptions() > uncaught_at_start_)
    abort("its training failed (that rank's own error says why)");
  if (bg_.joinable()) bg_.join();
}

void Checkpointer::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (abort_why_.empty()) abort_why_ = "rank " + std::to_string(rank_) + " stopped: " + why;
  }
  aborted_ = true;
  if (store_ && world_ > 1) {
    try {
      // The first rank to stop names the cause; later ones keep it.
      store_->compare_set(abort_key(), {}, store_bytes("rank " + std::to_string(rank_) + " stopped: " + why));
    } catch (...) {
      // The store is gone too: peers learn of it from their own waits.
    }
  }
  if (bg_.joinable()) bg_.join();
  if (!bg_error_.empty()) {
    TR_LOG_WARN(bg_error_);
    bg_error_.clear();
  }
}

void Checkpointer::clean_stale() {
  if (rank_ != 0) return;
  // Only rank 0 gets here, and its peers are about to meet it in load():
  // what goes wrong is reported there, to every rank, not thrown now.
  try {
    clean_stale_rank0();
  } catch (...) {
    clean_error_ = "checkpoint: cannot clean up " + root_ + " after an interrupted write: " + current_exception_text();
  }
}

void Checkpointer::clean_stale_rank0() {
  if (!fs::exists(root_)) return;
  std::vector<fs::path> tmps, olds;
  for (const auto& e : fs::directory_iterator(root_)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0) tmps.push_back(e.path());
    if (name.rfind(".old-", 0) == 0) olds.push_back(e.path());
  }
  for (const fs::path& p : tmps) {
    std::error_code ec;
    fs::remove_all(p, ec);
    TR_LOG_WARN("checkpoint: removed '", p.string(), "' left by an interrupted write");
  }
  // .old-step_N: step_N was being re-saved. Until the new step_N is in place
  // and complete, the old one is the only copy of that step.
  for (const fs::path& old : olds) {
    const fs::path step_dir = old.parent_path() / old.filename().string().substr(5);
    std::error_code ec;
    if (!fs::exists(step_dir, ec)) {
      fs::rename(old, step_dir, ec);
      TR_CHECK(!ec, "checkpoint: cannot put '", old.string(), "' back as '", step_dir.string(),
               "' (a re-save of that step was interrupted): ", ec.message(), "; rename it by hand");
      fsync_path(root_);
      TR_LOG_WARN("checkpoint: restored '", step_dir.string(), "' from '", old.string(),
                  "' (a re-save of that step was interrupted before the new one was in place)");
    } else if (check_manifest(step_dir.string(), nullptr, nullptr).empty() ||
               !check_manifest(old.string(), nullptr, nullptr).empty()) {
      fs::remove_all(old, ec);
      TR_LOG_WARN("checkpoint: removed '", old.string(), "' left by an interrupted re-save (", step_dir.string(),
                  " is complete)");
    } else {
      // The new one is there but does not check out, the old one does.
      fs::remove_all(step_dir, ec);
      TR_CHECK(!ec, "checkpoint: cannot remove '", step_dir.string(), "': ", ec.message());
      fs::rename(old, step_dir, ec);
      TR_CHECK(!ec, "checkpoint: cannot put '", old.string(), "' back as '", step_dir.string(), "': ", ec.message());
      fsync_path(root_);
      TR_LOG_WARN("checkpoint: restored '", step_dir.string(), "' from '", old.string(),
                  "' (the re-saved one was incomplete)");
    }
  }
}

double Checkpointer::save(ParamStore& ps, const TrainState& st, std::function<void(const std::string&)> extra) {
  auto t0 = Clock::now();
  wait();  // one save in flight at a time
  extra_files_ = std::move(extra);  // read by the writing thread; the next save waits for it first
  if (write_ranges_.empty() && held_ranges_.empty()) prepare(ps);
  const int64_t step = st.step;
  if (job_.checkpoint.async == "true") {
    // No whole snapshot (12 bytes per element of the shard: 106 GB a rank
    // at 70B over 8): the background thread streams the live state to the
    // files in pieces of one segment, as a synchronous save does, while
    // this thread goes on with forward and backward, which leave master
    // weights and moments alone. The next change to them waits for the
    // pieces to be read (before_state_change).
    std::promise<void> released;
    state_read_ = released.get_future().share();
    bg_ = std::thread([this, step, st, &ps, released = std::move(released)]() mutable {
      try {
        write_and_commit(step, st, &ps, &released);
      } catch (...) {
        bg_error_ = current_exception_text();
      }
      try {
        released.set_value();  // if write_and_commit failed before it released the state
      } catch (const std::future_error&) {
      }
    });
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  // Synchronous: no snapshot; the state is streamed from the store to the
  // files in pieces of one segment (a rank holds its shard plus one piece).
  std::string failed;
  try {
    write_and_commit(step, st, &ps, nullptr);
  } catch (...) {
    failed = current_exception_text();
  }
  if (!failed.empty()) handle_failure(failed);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Checkpointer::prepare(ParamStore& ps) {
  write_ranges_ = ps.write_ranges();
  held_ranges_ = ps.held_ranges();
  whole_rows_.assign(write_ranges_.size(), -1);
  if (tp_exchange_ && tp_exchange_->world_size() > 1) {
    const RowExchangePlan plan = plan_row_exchange(write_ranges_, *tp_exchange_);
    whole_rows_ = plan.position;
    if (!row_bufs_) row_bufs_ = std::make_unique<RowExchangeBuffers>();
    if (rank_ == 0)
      TR_LOG_INFO("checkpoint: ", plan.ranges, " tensor-parallel slice(s) of rank 0 are written as whole rows by the "
                  "TP group (one pwrite per group of rows, not per row)");
  }
}

double Checkpointer::before_state_change() {
  if (!state_read_.valid()) return 0;
  const auto t0 = Clock::now();
  state_read_.wait();
  state_read_ = {};
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Checkpointer::note_host_bytes() {
  host_bytes_peak_ = std::max(host_bytes_peak_, piece_.capacity() * sizeof(float));
}

void Checkpointer::wait() {
  if (bg_.joinable()) bg_.join();
  state_read_ = {};
  if (!bg_error_.empty()) {
    std::string e;
    std::swap(e, bg_error_);
    handle_failure(e);
  }
}

void Checkpointer::handle_failure(const std::string& what) {
  std::string latest = "none";
  std::ifstream lf(root_ + "/latest");
  if (lf) std::getline(lf, latest);
  if (job_.checkpoint.on_error == "continue") {
    TR_LOG_WARN(what, "; continuing (checkpoint.on_error: continue); the latest good checkpoint is ", latest);
    return;
  }
  TR_FAIL(what, "; the latest good checkpoint (", latest,
          ") is intact; free space or fix the output directory, or set checkpoint.on_error: continue");
}

void Checkpointer::check_abort(bool ask_store_now) {
  if (aborted_) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      why = abort_why_;
    }
    // The store's key names the first rank to stop: the cause, where this
    // rank may only have stopped because of it (a collective with that rank failed).
    if (store_ && world_ > 1) {
      try {
        if (store_->check(abort_key())) why = store_text(store_->get(abort_key(), Millis(10'000)));
      } catch (...) {
        // this rank's own reason then
      }
    }
    throw CheckpointAborted("abandoned because " + why);
  }
  if (!store_ || world_ == 1) return;
  const auto now = Clock::now();
  if (!ask_store_now && now < next_abort_poll_) return;
  next_abort_poll_ = now + kAbortPoll;
  if (!store_->check(abort_key())) return;
  throw CheckpointAborted("abandoned because " + store_text(store_->get(abort_key(), Millis(10'000))));
}

void Checkpointer::await_keys(const std::vector<std::string>& keys, Clock::time_point deadline,
                              const std::string& what) {
  for (;;) {
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    try {
      store_->wait(keys, std::clamp(left, Millis(0), Millis(kAbortPoll)));
      return;
    } catch (const StoreTimeoutError&) {
      // a slice ran out: look for an abandonment, then wait on
    }
    check_abort(true);
    if (Clock::now() >= deadline) break;
  }
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!store_->check(k)) missing.push_back(k);
  if (missing.empty()) return;  // the last one came just after the deadline
  std::string list;
  for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", '" : "'") + missing[i] + "'";
  if (missing.size() > 8) list += ", ... (" + std::to_string(missing.size() - 8) + " more)";
  TR_FAIL("rank ", rank_, " waited ", ckpt_timeout_ms(job_) / 1000, " s for ", what, " (still missing: ", list,
          "); is a rank stuck writing, or did one die without a trace?");
}

std::string Checkpointer::await_text(const std::string& key, Clock::time_point deadline,
                                     const std::string& what) {
  await_keys({key}, deadline, what);
  return store_text(store_->get(key, Millis(10'000)));
}

void Checkpointer::drop_keys(int64_t step) {
  const std::string key = step_key(step);
  try {
    // Rank 0 read this rank's two keys before it published "committed".
    store_->remove(key + "segments/" + std::to_string(rank_));
    store_->remove(key + "written/" + std::to_string(rank_));
    // Every rank has read "committed" once the counter reaches the world size.
    if (store_->add(key + "done", 1) == world_)
      for (const char* k : {"ready", "committed", "done"}) store_->remove(key + k);
  } catch (...) {
    // Only bookkeeping: the checkpoint itself is settled.
    TR_LOG_WARN("checkpoint: could not remove the store keys of step ", step, ": ", current_exception_text());
  }
}

void Checkpointer::write_range(int fd, const std::string& path, int64_t base, int kind, const Range& r,
                               ParamStore& live, Hasher& h, std::vector<Segment>& segs) {
  if (r.reps > 1) {
    // Strided (a TP rank's slice of an inner dim): groups of runs, one
    // segment each, one pwrite per run.
    const uint64_t per = runs_per_segment(uint64_t(r.count) * 4);
    for (int64_t first = 0; first < r.reps; first += int64_t(per)) {
      const Range part = r.rows(first, std::min(int64_t(per), r.reps - first));
      piece_.resize(size_t(part.numel()));
      note_host_bytes();
      live.copy_state_range(kind, part, piece_.data());
      hashed_pwrite_strided(fd, reinterpret_cast<const char*>(piece_.data()), uint64_t(r.count) * 4,
                            uint64_t(r.stride) * 4, uint64_t(part.reps), uint64_t(base + part.global * 4), path, h,
                            segs);
      check_abort(false);
    }
    return;
  }
  // Pieces of exactly one segment from the range's start: the segments
  // (and their hashes) are those of one whole-range write.
  const int64_t piece = int64_t(kSegmentBytes / 4);
  piece_.resize(size_t(std::min(piece, r.count)));
  note_host_bytes();
  for (int64_t at = 0; at < r.count; at += piece) {
    const int64_t n = std::min(piece, r.count - at);
    live.copy_state_range(kind, Range{r.global + at, n}, piece_.data());
    hashed_pwrite(fd, reinterpret_cast<const char*>(piece_.data()), uint64_t(n) * 4,
                  uint64_t(base + (r.global + at) * 4), path, h, segs);
  }
}

void Checkpointer::write_and_commit(int64_t step, const TrainState& st, ParamStore* live,
                                    std::promise<void>* released) {
  const std::string key = step_key(step);
  const auto deadline = Clock::now() + std::chrono::milliseconds(ckpt_timeout_ms(job_));
  const std::string final_dir = root_ + "/" + step_name(step);
  const std::string tmp = root_ + "/.tmp-" + step_name(step);
  const std::string mhdr = subject_.model_header, ohdr = optimizer_header(layout_);
  const std::string mpath = tmp + "/model.safetensors", opath = tmp + "/optimizer.safetensors";
  const std::string me = "rank " + std::to_string(rank_);
  next_abort_poll_ = {};

  // 1. rank 0 lays out the directory and the files at full size.
  // 2. every rank writes its ranges at their global offsets, hashing them on
  //    the way (segments per file), and fsyncs.
  // Whatever goes wrong in these two, on whichever rank, ends up in that
  // rank's "written" status: rank 0 waits for every rank's.
  std::vector<std::vector<Segment>> mine(2);
  std::string status = "ok";
  try {
    std::string setup_error;
    if (rank_ == 0) {
      try {
        check_abort(true);
        std::error_code ec;
        fs::create_directories(root_, ec);
        TR_CHECK(!ec, "checkpoint: cannot create '", root_, "': ", ec.message());
        fs::remove_all(tmp, ec);
        fs::create_directories(tmp, ec);
        TR_CHECK(!ec, "checkpoint: cannot create '", tmp, "': ", ec.message());
        for (const auto& [path, hdr, elems] :
             {std::tuple{mpath, mhdr, layout_.total}, std::tuple{opath, ohdr, 2 * layout_.total}}) {
          write_file_synced(path, hdr);
          // Reserve the blocks now, so a full disk or a file-size limit
          // shows up here, before any rank writes, rather than as a short
          // write later (sparse where the filesystem cannot preallocate).
          const off_t total = off_t(hdr.size() + elems * 4);
          int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
          TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
          try {
            reserve_file_size(fd, total, path);
          } catch (...) {
            ::close(fd);
            throw;
          }
          ::close(fd);
        }
      } catch (...) {
        setup_error = current_exception_text();
        std::error_code ec;
        fs::remove_all(tmp, ec);  // never leave a half-made directory behind
      }
      if (store_) store_->set(key + "ready", store_bytes(setup_error.empty() ? "ok" : setup_error));
      if (!setup_error.empty()) TR_FAIL(setup_error);
    } else {
      setup_error = await_text(key + "ready", deadline, "rank 0 to lay out the checkpoint directory");
      // Rank 0 reports its own error; this rank has nothing to add.
      if (setup_error != "ok") TR_FAIL("rank 0 could not lay out the directory");
    }
    // A TP group that writes whole rows (row_exchange.h) meets at every
    // such range: a member that fails or is abandoned must not leave its
    // peers waiting in an exchange. Its error is held (`deferred`) until
    // the next meeting, where the group agrees to stop (agree()); without
    // one, errors propagate at once, as always.
    const bool group = tp_exchange_ && tp_exchange_->world_size() > 1 &&
                       std::any_of(whole_rows_.begin(), whole_rows_.end(), [](int64_t p) { return p >= 0; });
    std::exception_ptr deferred;
    auto guarded = [&](const std::function<void()>& fn) {
      if (!group) return fn();
      if (deferred) return;
      try {
        fn();
      } catch (...) {
        deferred = std::current_exception();
      }
    };
    const std::function<void(bool)> agree = [&](bool failed_inside) {
      guarded([&] { check_abort(false); });
      float stop = deferred || failed_inside ? 1.0f : 0.0f;
      tp_exchange_->all_reduce(&stop, 1, ReduceOp::Max);
      if (stop == 0) return;
      if (deferred) std::rethrow_exception(deferred);
      // (failed_inside: write_whole_rows rethrows this member's own error instead)
      TR_FAIL(kPeerStopped, " (that rank's error says why)");
    };
    guarded([&] { debug_ckpt_throw_hook(rank_, std::to_string(step)); });  // tests: TRAINRUN_DEBUG_CKPT_THROW
    Hasher h;
    for (int kind = 0; kind < 3; ++kind) {
      const int file = kind == 0 ? 0 : 1;
      const std::string& path = file == 0 ? mpath : opath;
      const int64_t base = int64_t(kind == 0 ? mhdr.size() : ohdr.size()) + (kind == 2 ? layout_.total * 4 : 0);
      if (write_ranges_.empty()) continue;
      int fd = -1;
      guarded([&] {
        fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
        TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
      });
      try {
        for (size_t ri = 0; ri < write_ranges_.size(); ++ri) {
          const Range& r = write_ranges_[ri];
          if (r.reps > 1 && whole_rows_[ri] >= 0) {
            // Collective over the TP group: every member is at this range.
            agree(false);
            write_whole_rows(fd, path, uint64_t(base), kind, r, whole_rows_[ri] * 3 + kind, *live, *tp_exchange_, h,
                             *row_bufs_, mine[file], agree);
            host_bytes_peak_ = std::max(host_bytes_peak_, row_bufs_->bytes());
            continue;
          }
          guarded([&] {
            check_abort(false);
            write_range(fd, path, base, kind, r, *live, h, mine[file]);
          });
        }
        guarded([&] { TR_CHECK_ERRNO(::fsync(fd) == 0, "cannot fsync '", path, "'"); });
      } catch (...) {
        if (fd >= 0) ::close(fd);
        throw;
      }
      if (fd >= 0) ::close(fd);
    }
    if (deferred) std::rethrow_exception(deferred);
  } catch (...) {
    status = me + ": " + current_exception_text();
  }
  // Every piece of the state is in the files (or never will be): an async
  // save's trainer may change it again (before_state_change).
  if (released) released->set_value();
  if (store_) {
    // The segments go first: "written" tells rank 0 they are there.
    json segs = json::array();
    for (int file = 0; file < 2; ++file)
      for (const Segment& g : mine[file]) {
        if (g.reps > 1)
          segs.push_back({file, g.offset, g.bytes, hex64(g.hash), g.stride, g.reps});
        else
          segs.push_back({file, g.offset, g.bytes, hex64(g.hash)});
      }
    store_->set(key + "segments/" + std::to_string(rank_), store_bytes(segs.dump()));
    store_->set(key + "written/" + std::to_string(rank_), store_bytes(status));
  }

  // 3. rank 0 commits; everyone learns the outcome.
  std::string outcome;
  if (rank_ == 0) {
    try {
      std::vector<std::vector<Segment>> all = mine;
      // The headers rank 0 wrote in step 1.
      all[0].push_back({0, mhdr.size(), XXH64(mhdr.data(), mhdr.size(), 0)});
      all[1].push_back({0, ohdr.size(), XXH64(ohdr.data(), ohdr.size(), 0)});
      check_abort(true);
      if (store_) {
        std::vector<std::string> keys;
        for (int r = 0; r < world_; ++r) keys.push_back(key + "written/" + std::to_string(r));
        await_keys(keys, deadline, "every rank to write its part");
        // The first rank's failure, but a rank that only stopped because a
        // TP peer failed (kPeerStopped) gives way to the peer's own message.
        std::string failed;
        for (int r = 0; r < world_; ++r) {
          const std::string s = store_text(store_->get(keys[r], Millis(10'000)));
          if (s == "ok") continue;
          if (failed.empty() || (failed.find(kPeerStopped) != std::string::npos &&
                                 s.find(kPeerStopped) == std::string::npos))
            failed = s;
        }
        TR_CHECK(failed.empty(), failed);
        for (int r = 1; r < world_; ++r) {
          const std::string text = store_text(store_->get(key + "segments/" + std::to_string(r), Millis(10'000)));
          try {
            for (const json& g : json::parse(text)) {
              uint64_t hash = 0;
              const int file = g.at(0).get<int>();
              TR_CHECK((file == 0 || file == 1) && parse_hex64(g.at(3).get<std::string>(), &hash), "bad entry");
              Segment seg{g.at(1).get<uint64_t>(), g.at(2).get<uint64_t>(), hash};
              if (g.size() == 6) {
                seg.stride = g.at(4).get<uint64_t>();
                seg.reps = g.at(5).get<uint64_t>();
              }
              all[size_t(file)].push_back(seg);
            }
          } catch (const std::exception& e) {
            TR_FAIL("rank ", r, " reported unreadable checksums for its ranges (", e.what(), ")");
          }
        }
      } else {
        TR_CHECK(status == "ok", status);
      }
      commit_rank0(step, st, tmp, final_dir, std::move(all));
      outcome = "ok";
    } catch (const CheckpointAborted& e) {
      outcome = std::string("rank 0 refused to commit it: ") + e.what();
      TR_LOG_WARN("checkpoint: step ", step, ": ", outcome, "; the latest checkpoint stays as it was");
    } catch (...) {
      outcome = current_exception_text();
    }
    if (outcome != "ok") {
      std::error_code ec;
      fs::remove_all(tmp, ec);  // never leave a half-written directory behind
    }
    if (store_) store_->set(key + "committed", store_bytes(outcome));
  } else {
    try {
      outcome = await_text(key + "committed", deadline, "rank 0 to commit");
    } catch (const CheckpointAborted& e) {
      // Not knowing the outcome, this rank leaves the keys alone.
      TR_FAIL("checkpoint step ", step, " could not be written: ", e.what());
    }
  }
  if (store_) drop_keys(step);
  if (outcome != "ok") TR_FAIL("checkpoint step ", step, " could not be written: ", outcome);
}

void Checkpointer::commit_rank0(int64_t step, const TrainState& st, const std::string& tmp,
                                const std::string& final_dir, std::vector<std::vector<Segment>> segments) {
  json m;
  // Format 3 only where it is needed (a strided segment), so a checkpoint
  // without tensor parallelism stays readable by format-2 binaries.
  bool strided = false;
  for (const auto& segs : segments)
    for (const Segment& g : segs) strided = strided || g.reps > 1;
  m["format_version"] = strided ? kFormatVersion : 2;
  m["step"] = st.step;
  m["tokens_seen"] = st.tokens;
  m["data_cursor"] = st.cursor;
  if (!st.moe_expert_bias.empty()) m["moe_expert_bias"] = st.moe_expert_bias;
  m["world_size"] = world_;
  m["sharding"] = job_.parallel.sharding;
  m["model"] = json::parse(subject_.manifest_model);
  // Randomness is counter-based (init: (seed, index); data: (seed, sample
  // index); sampling: seed), so the seeds and the cursor are the RNG state.
  m["rng"] = {{"train_seed", job_.train.seed}, {"data_seed", job_.data.synthetic.seed}};
  m["train"] = {{"lr", job_.train.lr}, {"min_lr", job_.train.min_lr}, {"max_steps", job_.train.max_steps},
                {"warmup_steps", job_.train.warmup_steps}, {"schedule", job_.train.schedule},
                {"weight_decay", job_.train.weight_decay}, {"global_batch_size", job_.train.global_batch_size},
                {"micro_batch_size", job_.train.micro_batch_size}};
  json units = json::array();
  for (const auto& u : layout_.units) units.push_back({{"name", u.name}, {"offset", u.offset}, {"numel", u.numel}});
  m["layout"] = {{"total", layout_.total}, {"units", units}};
  // The segments must tile each file exactly: a gap would be bytes nobody
  // wrote (or verifies), an overlap two ranks writing the same bytes.
  const uint64_t sizes[2] = {subject_.model_header.size() + uint64_t(layout_.total) * 4,
                             optimizer_header(layout_).size() + uint64_t(layout_.total) * 8};
  json files = json::object();
  for (int f = 0; f < 2; ++f) {
    auto& segs = segments[size_t(f)];
    std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
    const std::string flaw = tiling_error(segs, sizes[f]);
    TR_CHECK(flaw.empty(), "checkpoint: the ranges written to ", kFileNames[f], " do not tile it (", flaw,
             "); the strategy's write_ranges are not a partition of the model (a bug)");
    json list = json::array();
    for (const Segment& g : segs) {
      json e = {{"offset", g.offset}, {"bytes", g.bytes}, {"xxhash64", hex64(g.hash)}};
      if (g.reps > 1) {
        e["stride"] = g.stride;
        e["reps"] = g.reps;
      }
      list.push_back(std::move(e));
    }
    files[kFileNames[f]] = {{"size", sizes[f]}, {"segments", list}};
  }
  m["files"] = files;
  m["job_spec"] = job_spec_to_yaml(job_);
  if (const int64_t ms = debug_ckpt_sleep_ms(step)) {
    // Tests: widen the window between "data written" and "committed" so a
    // kill -9 or a failure elsewhere lands in it. An abandonment ends it.
    TR_LOG_INFO("checkpoint: debug pause of ", ms, " ms before committing step ", step);
    for (const auto until = Clock::now() + std::chrono::milliseconds(ms); Clock::now() < until;) {
      check_abort(false);
      std::this_thread::sleep_for(std::min<Clock::duration>(std::chrono::milliseconds(20), until - Clock::now()));
    }
  }
  if (extra_files_) extra_files_(tmp);
  write_file_synced(tmp + "/manifest.json", m.dump(2) + "\n");
  fsync_path(tmp);
  // The point of no return: an abandoned checkpoint never becomes visible.
  check_abort(true);
  std::error_code ec;
  const std::string old = root_ + "/.old-" + step_name(step);
  const bool resave = fs::exists(final_dir);
  if (resave) {
    // Re-saving a step (e.g. after resuming from an older one): move the
    // old one aside first. Until the new one is in place, .old-step_N is
    // that step's only copy: clean_stale() puts it back after a crash.
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    TR_CHECK(!ec, "cannot move aside '", final_dir, "': ", ec.message());
    fsync_path(root_);
    debug_ckpt_kill_hook("moved_aside", step);  // tests: TRAINRUN_DEBUG_CKPT_KILL
  }
  fs::rename(tmp, final_dir, ec);
  if (ec && resave) {
    std::error_code back;
    fs::rename(old, final_dir, back);  // the old one stays that step
  }
  TR_CHECK(!ec, "cannot rename '", tmp, "' to '", final_dir, "': ", ec.message());
  fsync_path(root_);
  // `latest` last: until here the previous checkpoint is the latest.
  write_file_synced(root_ + "/latest.tmp", step_name(step) + "\n");
  fs::rename(root_ + "/latest.tmp", root_ + "/latest", ec);
  TR_CHECK(!ec, "cannot update '", root_, "/latest': ", ec.message());
  fsync_path(root_);
  fs::remove_all(root_ + "/.old-" + step_name(step), ec);
  TR_LOG_INFO("checkpoint: saved ", final_dir);
  retention();
}

void Checkpointer::retention() {
  const auto& c = job_.checkpoint;
  std::vector<int64_t> steps;
  for (const auto& e : fs::directory_iterator(root_)) {
    int64_t s;
    if (e.is_directory() && parse_step_name(e.path().filename().string(), &s)) steps.push_back(s);
  }
  std::sort(steps.rbegin(), steps.rend());
  for (size_t i = 0; i < steps.size(); ++i) {
    const bool recent = c.keep_last == 0 || int(i) < c.keep_last;
    const bool milestone = c.keep_every > 0 && steps[i] % c.keep_every == 0;
    if (recent || milestone) continue;
    std::error_code ec;
    fs::remove_all(root_ + "/" + step_name(steps[i]), ec);
  }
}

}  // namespace trainrun
