// Loading a checkpoint (Checkpointer::load, see checkpoint.h): picking the
// candidate checkpoint.resume allows, verifying every rank's part as it is
// read, agreeing on the outcome, going live.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>

#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/format.h"
#include "core/common/debug_hooks.h"
#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"
#include "core/train/planner.h"

namespace fs = std::filesystem;

namespace trainrun {

using namespace ckpt;

namespace {

// Host memory one rank may use to stage a checkpoint while verifying it:
// TRAINRUN_CKPT_STAGE_LIMIT (bytes) when set, else half of MemAvailable
// shared by the ranks of this node (LOCAL_WORLD_SIZE), so that every rank of
// a node staging at once still leaves half the memory free.
uint64_t staging_limit_bytes() {
  if (const char* v = std::getenv("TRAINRUN_CKPT_STAGE_LIMIT"); v && *v) {
    char* end = nullptr;
    const unsigned long long b = std::strtoull(v, &end, 10);
    TR_CHECK(end && *end == 0, "environment variable TRAINRUN_CKPT_STAGE_LIMIT='", v,
             "' is not a number of bytes");
    return b;
  }
  uint64_t avail_kib = 0;
  std::ifstream mi("/proc/meminfo");
  for (std::string key; mi >> key;) {
    uint64_t kib = 0;
    std::string unit;
    mi >> kib >> unit;
    if (key == "MemAvailable:") {
      avail_kib = kib;
      break;
    }
  }
  if (avail_kib == 0) return uint64_t(4) << 30;  // unknown: a modest default
  int local = 1;
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE")) local = std::max(1, std::atoi(v));
  return avail_kib * 1024 / 2 / uint64_t(local);
}

// A rank's error text in first_error_of_all (longer ones are cut).
constexpr size_t kErrorBytes = 1024;

}  // namespace

// checkpoint.resume: never in a directory that already holds an earlier
// run's checkpoints: this run starts fresh, but its checkpoints must not
// mix with those (retention keeps the highest step numbers and would delete
// the new run's at once; `latest` and auto-resume go by step number too).
// Nothing is deleted: the earlier checkpoints move aside, next to it.
void Checkpointer::set_aside_earlier_checkpoints() {
  std::error_code ec;
  if (!fs::is_directory(root_, ec)) return;
  int64_t newest = -1;
  bool any = false;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    int64_t s;
    const std::string name = e.path().filename().string();
    if (name == "latest" || (e.is_directory() && parse_step_name(name, &s))) any = true;
    if (e.is_directory() && parse_step_name(name, &s)) newest = std::max(newest, s);
  }
  if (!any) return;
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  std::string dest = root_ + ".before-" + stamp;
  for (int k = 2; fs::exists(dest, ec); ++k) dest = root_ + ".before-" + stamp + "-" + std::to_string(k);
  fs::rename(root_, dest, ec);
  TR_CHECK(!ec, "checkpoint.resume: never: cannot move the earlier run's checkpoints out of the way (", root_, " -> ",
           dest, "): ", ec.message(), "; move or delete them, or use a new output.dir");
  TR_LOG_WARN("checkpoint.resume: never: ", root_, " held checkpoints of an earlier run",
              newest >= 0 ? " (newest: " + step_name(newest) + ")" : std::string(), "; moved them to ", dest,
              " so that this run's checkpoints do not mix with them");
}

std::vector<std::string> Checkpointer::resume_candidates() {
  const std::string& r = job_.checkpoint.resume;
  if (r == "never") return {};
  if (r != "auto") return {r};
  if (!fs::exists(root_)) return {};
  std::vector<int64_t> steps;
  for (const auto& e : fs::directory_iterator(root_)) {
    int64_t s;
    if (e.is_directory() && parse_step_name(e.path().filename().string(), &s)) steps.push_back(s);
  }
  std::sort(steps.rbegin(), steps.rend());
  std::vector<std::string> dirs;
  for (int64_t s : steps) dirs.push_back(root_ + "/" + step_name(s));
  return dirs;
}

namespace {

// Where a rank's bytes of one file go: one held range of one kind, in
// file bytes (reps runs of `bytes`, `stride` apart; reps 1: contiguous).
// A rank's ranges never interleave (each is a tensor's slice, and a
// strided one covers consecutive rows), so sorted by offset their spans
// [off, end()) are disjoint.
struct Dest {
  uint64_t off = 0, bytes = 0, stride = 0, reps = 1;
  char* dst = nullptr;
  uint64_t end() const { return off + (reps - 1) * stride + bytes; }
};

// The piece of [at, stop) that starts at `at`: inside one run of a
// destination (*into = where it goes) or up to the next destination byte
// (*into = null: read, verified, dropped). `dests` sorted by offset.
uint64_t next_piece(const std::vector<Dest>& dests, uint64_t at, uint64_t stop, char** into) {
  *into = nullptr;
  auto it = std::upper_bound(dests.begin(), dests.end(), at, [](uint64_t v, const Dest& d) { return v < d.off; });
  uint64_t next = it == dests.end() ? stop : std::min(stop, it->off);  // the next destination's start
  if (it != dests.begin()) {
    const Dest& d = *std::prev(it);
    if (at < d.end()) {
      const uint64_t row = d.reps > 1 ? (at - d.off) / d.stride : 0;
      const uint64_t rs = d.off + row * d.stride;
      if (at < rs + d.bytes) {
        if (d.dst) *into = d.dst + row * d.bytes + (at - rs);
        return std::min(stop, rs + d.bytes) - at;
      }
      next = std::min(next, rs + d.stride);  // the gap up to the next run
    }
  }
  return next - at;
}

// Whether segment g may hold bytes of a destination: exact for contiguous
// pieces and for strided ones of the same stride (columns overlap), by
// span otherwise (then a segment may be read only to be verified).
bool may_overlap(const Segment& g, const std::vector<Dest>& dests) {
  auto it = std::upper_bound(dests.begin(), dests.end(), g.offset, [](uint64_t v, const Dest& d) { return v < d.off; });
  if (it != dests.begin()) --it;
  for (; it != dests.end() && it->off < g.end(); ++it) {
    const Dest& d = *it;
    if (d.end() <= g.offset) continue;
    if (g.reps > 1 && d.reps > 1 && g.stride == d.stride) {
      // Rows of one tensor: compare the columns, g's first relative to d's.
      const int64_t s = int64_t(g.stride), diff = int64_t(g.offset) - int64_t(d.off);
      const uint64_t m = uint64_t(((diff % s) + s) % s);
      if (m < d.bytes || m + g.bytes > g.stride) return true;
      continue;
    }
    return true;
  }
  return false;
}

}  // namespace

std::string Checkpointer::read_verified(const std::string& dir, std::vector<std::vector<float>>* out) {
  try {
    std::vector<FileEntry> files;
    const std::string why = check_manifest(dir, nullptr, &files);
    if (!why.empty()) return why;
    size_t held = 0;
    for (const auto& r : held_ranges_) held += size_t(r.numel());
    if (out) {
      out->assign(3, {});
      for (auto& v : *out) v.resize(held);
    }
    const uint64_t mbase = subject_.model_header.size(), obase = optimizer_header(layout_).size();
    Hasher h;
    std::vector<char> scratch;
    for (int f = 0; f < 2; ++f) {
      const FileEntry& fe = *std::find_if(files.begin(), files.end(),
                                          [&](const FileEntry& e) { return e.name == kFileNames[f]; });
      // Where this rank's bytes of the file go: its held ranges of the
      // file's kinds, in file order.
      std::vector<Dest> dests;
      for (int kind : f == 0 ? std::vector<int>{0} : std::vector<int>{1, 2}) {
        const uint64_t base = (f == 0 ? mbase : obase) + (kind == 2 ? uint64_t(layout_.total) * 4 : 0);
        size_t pos = 0;
        for (const auto& r : held_ranges_) {
          dests.push_back({base + uint64_t(r.global) * 4, uint64_t(r.count) * 4, uint64_t(r.stride) * 4,
                           uint64_t(r.reps), out ? reinterpret_cast<char*>((*out)[size_t(kind)].data() + pos) : nullptr});
          pos += size_t(r.numel());
        }
      }
      std::sort(dests.begin(), dests.end(), [](const Dest& a, const Dest& b) { return a.off < b.off; });
      uint64_t need = 0;
      for (const Dest& d : dests) need = std::max(need, d.end());
      if (need > fe.size)
        return fe.name + " has " + std::to_string(fe.size) + " bytes, too few for this model (it needs " +
               std::to_string(need) + "); was it written by another model?";
      // The segments to verify: those that overlap a destination, and on
      // rank 0 the header's (every data byte is held by some rank, so the
      // ranks together verify the whole file).
      const uint64_t header_end = f == 0 ? mbase : obase;
      const std::string path = dir + "/" + fe.name;
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      TR_CHECK_ERRNO(fd >= 0, "checkpoint: cannot open '", path, "'");
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      std::string bad;
      try {
        for (const Segment& g : fe.segments) {
          if (!may_overlap(g, dests) && !(rank_ == 0 && g.offset < header_end)) continue;
          // Walk the segment run by run: pieces inside a destination are
          // read straight into it, the rest into scratch (verified, then
          // dropped). Verify only: everything through scratch.
          h.reset();
          for (uint64_t rep = 0; rep < g.reps; ++rep) {
            const uint64_t stop = g.offset + rep * g.stride + g.bytes;
            for (uint64_t at = g.offset + rep * g.stride; at < stop;) {
              char* into = nullptr;
              uint64_t n = out ? next_piece(dests, at, stop, &into) : stop - at;
              if (!into) {
                n = std::min<uint64_t>(n, kIoChunk);
                scratch.resize(std::max<size_t>(scratch.size(), size_t(n)));
                into = scratch.data();
              }
              hashed_pread(fd, into, n, at, path, h);
              at += n;
            }
          }
          if (h.digest() != g.hash) {
            bad = mismatch(fe.name, g, h.digest());
            break;
          }
        }
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
      if (!bad.empty()) return bad;
    }
    return "";
  } catch (const std::bad_alloc&) {
    throw;  // no room to stage it: not a flaw of the checkpoint (the caller fails the load)
  } catch (const std::exception& e) {
    return std::string("unreadable: ") + e.what();
  }
}

void Checkpointer::load_kind_by_kind(const std::string& dir, ParamStore& ps) {
  size_t held = 0;
  for (const auto& r : held_ranges_) held += size_t(r.numel());
  std::vector<float> buf(held);
  const uint64_t mbase = subject_.model_header.size(), obase = optimizer_header(layout_).size();
  for (int kind = 0; kind < 3; ++kind) {
    const std::string path = dir + "/" + kFileNames[kind == 0 ? 0 : 1];
    const uint64_t base = (kind == 0 ? mbase : obase) + (kind == 2 ? uint64_t(layout_.total) * 4 : 0);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TR_CHECK_ERRNO(fd >= 0, "checkpoint: cannot open '", path, "'");
    try {
      size_t pos = 0;
      for (const auto& r : held_ranges_) {
        for (int64_t rep = 0; rep < r.reps; ++rep) {  // strided: one pread per run
          pread_all(fd, reinterpret_cast<char*>(buf.data() + pos), size_t(r.count) * 4,
                    off_t(base + uint64_t(r.global + rep * r.stride) * 4), path);
          pos += size_t(r.count);
        }
      }
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    ps.set_state(kind, buf);
  }
}

std::string Checkpointer::first_error_of_all(const std::string& mine) {
  if (world_ == 1) return mine;
  std::vector<char> in(kErrorBytes, 0), all(kErrorBytes * size_t(world_), 0);
  std::memcpy(in.data(), mine.data(), std::min(mine.size(), kErrorBytes - 1));
  comm_->all_gather(all.data(), in.data(), kErrorBytes);
  for (int r = 0; r < world_; ++r) {
    const char* p = all.data() + size_t(r) * kErrorBytes;
    if (*p) return std::string(p, strnlen(p, kErrorBytes)) + " (found by rank " + std::to_string(r) + ")";
  }
  return "";
}

std::string Checkpointer::worst_of_all(const std::string& fatal, const std::string& skip, bool* is_fatal) {
  // One gather: each rank's text behind a byte saying which kind it is.
  const std::string mine = !fatal.empty() ? "F" + fatal : !skip.empty() ? "S" + skip : "";
  std::string first_skip;
  *is_fatal = false;
  if (world_ == 1) {
    *is_fatal = !fatal.empty();
    return mine.empty() ? "" : mine.substr(1);
  }
  std::vector<char> in(kErrorBytes, 0), all(kErrorBytes * size_t(world_), 0);
  std::memcpy(in.data(), mine.data(), std::min(mine.size(), kErrorBytes - 1));
  comm_->all_gather(all.data(), in.data(), kErrorBytes);
  for (int r = 0; r < world_; ++r) {
    const char* p = all.data() + size_t(r) * kErrorBytes;
    const std::string text = *p ? std::string(p + 1, strnlen(p + 1, kErrorBytes - 1)) + " (found by rank " + std::to_string(r) + ")" : "";
    if (*p == 'F') {
      *is_fatal = true;
      return text;
    }
    if (*p == 'S' && first_skip.empty()) first_skip = text;
  }
  return first_skip;
}

bool Checkpointer::load(ParamStore& ps, TrainState& st) {
  const auto t0 = std::chrono::steady_clock::now();
  held_ranges_ = ps.held_ranges();
  write_ranges_ = ps.write_ranges();
  // Rank 0 names a candidate that passes the checks needing no data (the
  // manifest, the files and their sizes) and reads what the run needs from
  // its manifest; every rank then reads its part, verifying it on the way,
  // into staging buffers; only when no rank found a bad segment does
  // anything reach the model and the optimizer. checkpoint.resume: auto
  // falls back to the next older candidate.
  //
  // Each stage ends in a collective that carries every rank's outcome,
  // whatever it caught: a rank that fails fails all of them at once, with
  // its own message, rather than leaving them in the next collective.
  const bool is_auto = job_.checkpoint.resume == "auto";
  std::vector<std::string> candidates;
  size_t next = 0;
  bool listed = false;
  for (;;) {
    // 1. rank 0 picks; one broadcast tells every rank what (or why not).
    std::vector<char> msg(4096, 0);
    std::vector<std::string> notes;  // rank 0: changed training settings, logged once the candidate is verified
    if (rank_ == 0) {
      std::string text;
      char status = 'N';
      try {
        debug_ckpt_throw_hook(0, "load");  // tests: TRAINRUN_DEBUG_CKPT_THROW
        if (!clean_error_.empty()) TR_FAIL(clean_error_);
        if (!listed) {
          if (job_.checkpoint.resume == "never") set_aside_earlier_checkpoints();
          candidates = resume_candidates();
          listed = true;
        }
        while (next < candidates.size()) {
          const std::string dir = candidates[next++];
          json m;
          std::string why = check_manifest(dir, &m, nullptr);
          json pick;
          if (why.empty()) {
            try {
              pick = {{"dir", dir},
                      {"step", m.at("step").get<int64_t>()},
                      {"cursor", m.at("data_cursor").get<int64_t>()},
                      {"tokens", m.at("tokens_seen").get<int64_t>()},
                      {"world_size", m.at("world_size").get<int>()},
                      {"sharding", m.at("sharding").get<std::string>()}};
              if (m.contains("moe_expert_bias")) pick["moe_expert_bias"] = m.at("moe_expert_bias").get<std::vector<float>>();
              const json& mm = m.at("model");
              const std::string changed = subject_.mismatch(mm);
              if (!changed.empty())
                throw Error(detail::cat("checkpoint ", dir, " was saved with ", changed,
                                        "; a resume cannot change the model (use a new output.dir or "
                                        "checkpoint.resume: never)"));
            } catch (const Error&) {
              throw;  // a shape the job cannot take: no fallback
            } catch (const std::exception& e) {
              why = std::string("manifest.json lacks what a resume needs (") + e.what() + ")";
            }
          }
          if (why.empty()) {
            const json t = m.contains("train") ? m.at("train") : json::object();
            auto note = [&](const char* key, const json& now) {
              if (t.contains(key) && t.at(key) != now)
                notes.push_back(detail::cat("resume: train.", key, " changed from ", t.at(key).dump(), " to ",
                                            now.dump(), " (allowed)"));
            };
            note("lr", job_.train.lr);
            note("min_lr", job_.train.min_lr);
            note("max_steps", job_.train.max_steps);
            note("warmup_steps", job_.train.warmup_steps);
            note("schedule", job_.train.schedule);
            note("weight_decay", job_.train.weight_decay);
            note("global_batch_size", job_.train.global_batch_size);
            note("micro_batch_size", job_.train.micro_batch_size);
            text = pick.dump();
            status = 'Y';
            break;
          }
          TR_CHECK(is_auto, "checkpoint.resume: '", dir, "' cannot be loaded: ", why);
          TR_LOG_WARN("checkpoint: skipping ", dir, ": ", why, "; falling back to the previous checkpoint");
        }
        if (status == 'N' && is_auto && !candidates.empty())
          TR_LOG_WARN("checkpoint: no loadable checkpoint in ", root_, "; starting from scratch");
      } catch (const Error& e) {
        text = e.what();
        status = 'E';
      } catch (...) {
        text = "checkpoint: rank 0 failed while choosing the checkpoint to resume from (in " + root_ +
               "): " + current_exception_text();
        status = 'E';
      }
      if (text.size() > msg.size() - 2) {
        if (status != 'E') text = "checkpoint: the path of the checkpoint to resume is too long: " + text;
        status = 'E';
        text.resize(msg.size() - 2);
      }
      msg[0] = status;
      std::memcpy(msg.data() + 1, text.data(), text.size());
    }
    comm_->broadcast(msg.data(), msg.size(), 0);
    const std::string text(msg.data() + 1);
    if (msg[0] == 'E') TR_FAIL(text);
    if (msg[0] == 'N') return false;
    const json pick = json::parse(text);
    const std::string dir = pick.at("dir").get<std::string>();

    // 2. every rank reads and verifies its part. One pass (verify while
    // reading into staging, then go live) needs the rank's three state
    // kinds in host memory at once. Where that would not fit comfortably
    // (big hybrid_shard/no_shard ranks, several per node), verify first and
    // then load kind by kind: one more read of the data, a third of the
    // memory. A flaw in the candidate drops it (auto: the next older one);
    // anything else a rank throws fails the load on every rank.
    size_t held = 0;
    for (const auto& r : held_ranges_) held += size_t(r.numel());
    const uint64_t need = uint64_t(held) * 4 * 3;
    uint64_t limit = 0;
    bool staged_load = false;
    std::vector<std::vector<float>> staged;
    std::string fatal, flaw;
    try {
      if (rank_ != 0) debug_ckpt_throw_hook(rank_, "load");  // tests: TRAINRUN_DEBUG_CKPT_THROW
      limit = staging_limit_bytes();
      staged_load = need <= limit;
      flaw = read_verified(dir, staged_load ? &staged : nullptr);
    } catch (...) {
      fatal = "checkpoint: rank " + std::to_string(rank_) + " failed while reading its part of " + dir + ": " +
              current_exception_text();
    }
    bool is_fatal = false;
    const std::string why = worst_of_all(fatal, flaw, &is_fatal);
    if (is_fatal) TR_FAIL(why);
    if (!why.empty()) {
      TR_CHECK(is_auto, "checkpoint.resume: '", dir, "' cannot be loaded: ", why);
      if (rank_ == 0)
        TR_LOG_WARN("checkpoint: skipping ", dir, ": ", why, "; falling back to the previous checkpoint");
      continue;
    }
    if (rank_ == 0)
      for (const std::string& n : notes) TR_LOG_INFO(n);

    // 3. verified everywhere: now it may go live. The ranks agree that every
    // one of them did, so none trains on while a peer's state is half loaded.
    std::string live_error;
    try {
      if (staged_load) {
        for (int kind = 0; kind < 3; ++kind) {
          ps.set_state(kind, staged[size_t(kind)]);
          staged[size_t(kind)] = {};
        }
      } else {
        if (rank_ == 0)
          TR_LOG_INFO("resume: verified ", dir, "; loading one state kind at a time (staging all three would take ",
                      format_bytes(double(need)), " per rank, over the ", format_bytes(double(limit)),
                      " allowed)");
        load_kind_by_kind(dir, ps);
      }
    } catch (...) {
      live_error = "checkpoint: rank " + std::to_string(rank_) + " could not load its part of " + dir + ": " +
                   current_exception_text();
    }
    const std::string live = first_error_of_all(live_error);
    TR_CHECK(live.empty(), live, "; the job stops (the checkpoint itself verified and is intact)");
    st.step = pick.at("step").get<int64_t>();
    st.cursor = pick.at("cursor").get<int64_t>();
    st.tokens = pick.at("tokens").get<int64_t>();
    if (pick.contains("moe_expert_bias")) st.moe_expert_bias = pick.at("moe_expert_bias").get<std::vector<float>>();
    if (rank_ == 0)
      TR_LOG_INFO("resume: loaded ", dir, " (step ", st.step, ", ", st.tokens, " tokens; saved by ",
                  pick.at("world_size").get<int>(), " ranks with ", pick.at("sharding").get<std::string>(),
                  ", loaded on ", world_, " ranks with ", job_.parallel.sharding, "; ",
                  held_ranges_.size(), " ranges on rank 0, ",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), " s)");
    return true;
  }
}

}  // namespace trainrun
