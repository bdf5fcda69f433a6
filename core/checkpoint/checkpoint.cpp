#include "core/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"
#include "core/io/safetensors.h"
#include "core/model/model_io.h"
#include "core/train/planner.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace trainrun {

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

// 2: per-segment xxhash64 ("segments"); 1: one xxhash64 per file (still loaded).
constexpr int kFormatVersion = 2;
// The largest range one hash covers: what a rank loading a resharded
// checkpoint reads beyond its own ranges, at most, to verify them.
constexpr uint64_t kSegmentBytes = uint64_t(64) << 20;
// I/O granularity: each piece is hashed right before it is written or right
// after it is read, while it is still in the CPU cache.
constexpr size_t kIoChunk = size_t(4) << 20;
// A rank's error text in first_error_of_all (longer ones are cut).
constexpr size_t kErrorBytes = 1024;

const char* const kFileNames[2] = {"model.safetensors", "optimizer.safetensors"};

using Segment = Checkpointer::Segment;

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

bool parse_step_name(const std::string& name, int64_t* step) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return false;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  *step = std::stoll(name.substr(5));
  return true;
}

// The two files' headers: F32 tensors in the flat layout's order, so
// global element g of kind k sits at a fixed offset every rank can compute.
std::string model_header(const ModelArch& arch, const ParamLayout&) { return model_file_header(arch); }

std::string optimizer_header(const ParamLayout& lay) {
  std::vector<SafeTensorEntry> es;
  for (const char* prefix : {"exp_avg.", "exp_avg_sq."})
    for (const auto& t : lay.tensors) es.push_back({prefix + t.name, "F32", t.shape, uint64_t(t.numel) * 4});
  return encode_safetensors_header(es, {{"format", "trainrun-adamw"}});
}

// An XXH64 state that frees itself.
class Hasher {
 public:
  Hasher() : st_(XXH64_createState()) {
    if (!st_) throw std::bad_alloc();
    reset();
  }
  ~Hasher() { XXH64_freeState(st_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void reset() { XXH64_reset(st_, 0); }
  void update(const void* p, size_t n) { XXH64_update(st_, p, n); }
  uint64_t digest() const { return XXH64_digest(st_); }

 private:
  XXH64_state_t* st_;
};

std::string hex64(uint64_t h) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

bool parse_hex64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 16 || s.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) return false;
  *out = std::stoull(s, nullptr, 16);
  return true;
}

// pwrite()s [data, data + bytes) at `off`, hashing it on the way in
// segments of at most kSegmentBytes, appended to `segs`.
void hashed_pwrite(int fd, const char* data, uint64_t bytes, uint64_t off, const std::string& path, Hasher& h,
                   std::vector<Segment>& segs) {
  while (bytes > 0) {
    const uint64_t n = std::min(bytes, kSegmentBytes);
    h.reset();
    for (uint64_t done = 0; done < n;) {
      const size_t c = size_t(std::min<uint64_t>(n - done, kIoChunk));
      h.update(data + done, c);
      pwrite_all(fd, data + done, c, off_t(off + done), path);
      done += c;
    }
    segs.push_back({off, n, h.digest()});
    data += n;
    off += n;
    bytes -= n;
  }
}

// pread()s [off, off + bytes) into `dst` in cache-sized pieces, feeding `h`.
void hashed_pread(int fd, char* dst, uint64_t bytes, uint64_t off, const std::string& path, Hasher& h) {
  for (uint64_t done = 0; done < bytes;) {
    const size_t c = size_t(std::min<uint64_t>(bytes - done, kIoChunk));
    pread_all(fd, dst + done, c, off_t(off + done), path);
    h.update(dst + done, c);
    done += c;
  }
}

std::string mismatch(const std::string& name, const Segment& s, uint64_t have) {
  return name + ": checksum mismatch in bytes [" + std::to_string(s.offset) + ", " + std::to_string(s.offset + s.bytes) +
         ") (xxhash64 " + hex64(have) + ", manifest " + hex64(s.hash) + "); the file is corrupt";
}

// A data file as the manifest describes it.
struct FileEntry {
  std::string name;
  uint64_t size = 0;
  std::vector<Segment> segments;  // sorted, tiling [0, size)
};

// The segments of one "files" entry: format 2's list, or format 1's
// whole-file hash as one segment. Throws Error naming the file and the flaw.
FileEntry file_entry(const std::string& name, const json& info) {
  FileEntry f;
  f.name = name;
  TR_CHECK(info.is_object() && info.contains("size") && info.at("size").is_number_unsigned(), "manifest.json: files.",
           name, " has no valid size");
  f.size = info.at("size").get<uint64_t>();
  if (info.contains("segments")) {
    TR_CHECK(info.at("segments").is_array(), "manifest.json: files.", name, ".segments is not a list");
    for (const json& j : info.at("segments")) {
      Segment s;
      TR_CHECK(j.is_object() && j.contains("offset") && j.at("offset").is_number_unsigned() && j.contains("bytes") &&
                   j.at("bytes").is_number_unsigned() && j.contains("xxhash64") && j.at("xxhash64").is_string() &&
                   parse_hex64(j.at("xxhash64").get<std::string>(), &s.hash),
               "manifest.json: files.", name, ".segments has an entry that is not {offset, bytes, xxhash64}: ",
               j.dump());
      s.offset = j.at("offset").get<uint64_t>();
      s.bytes = j.at("bytes").get<uint64_t>();
      f.segments.push_back(s);
    }
  } else {
    Segment s;
    TR_CHECK(info.contains("xxhash64") && info.at("xxhash64").is_string() &&
                 parse_hex64(info.at("xxhash64").get<std::string>(), &s.hash),
             "manifest.json: files.", name, " has neither segments nor an xxhash64");
    s.bytes = f.size;
    f.segments.push_back(s);
  }
  // Gaps would be bytes nobody verifies; overlaps cannot come from a save.
  std::sort(f.segments.begin(), f.segments.end(),
            [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
  uint64_t at = 0;
  for (const Segment& s : f.segments) {
    TR_CHECK(s.offset == at && s.bytes > 0, "manifest.json: the segments of ", name, " do not tile the file (bytes ",
             at, " onwards)");
    at += s.bytes;
  }
  TR_CHECK(at == f.size, "manifest.json: the segments of ", name, " cover ", at, " of its ", f.size, " bytes");
  return f;
}

// Everything about a checkpoint directory that needs no data read: the
// manifest, its format, every file there at its size. "" when good (and
// the manifest in *out), else what is wrong.
std::string check_manifest(const std::string& dir, json* out, std::vector<FileEntry>* files) {
  try {
    std::ifstream f(dir + "/manifest.json");
    if (!f) return "manifest.json is missing";
    json m;
    try {
      m = json::parse(f);
    } catch (const std::exception& e) {
      return std::string("manifest.json is not valid JSON (") + e.what() + ")";
    }
    if (!m.is_object() || !m.contains("format_version") || !m["format_version"].is_number_integer() ||
        m["format_version"].get<int>() < 1 || m["format_version"].get<int>() > kFormatVersion)
      return "manifest.json has an unsupported format_version";
    std::vector<FileEntry> fs_;
    if (!m.contains("files") || !m.at("files").is_object()) return "manifest.json has no files";
    for (const auto& [name, info] : m.at("files").items()) {
      const std::string path = dir + "/" + name;
      if (!fs::exists(path)) return name + " is missing";
      FileEntry e = file_entry(name, info);
      const uint64_t have = fs::file_size(path);
      if (have != e.size)
        return name + " has " + std::to_string(have) + " bytes, the manifest says " + std::to_string(e.size) +
               " (truncated?)";
      fs_.push_back(std::move(e));
    }
    for (const char* name : kFileNames)
      if (std::none_of(fs_.begin(), fs_.end(), [&](const FileEntry& e) { return e.name == name; }))
        return std::string("manifest.json does not list ") + name;
    if (out) *out = std::move(m);
    if (files) *files = std::move(fs_);
    return "";
  } catch (const std::exception& e) {
    return std::string("unreadable: ") + e.what();
  }
}

int64_t ckpt_timeout_ms(const JobSpec& job) {
  // Writing a large checkpoint to a slow filesystem can take far longer than
  // a collective; give it 10x the collective timeout, at least 10 minutes.
  return std::max<int64_t>(600'000, int64_t(job.parallel.timeout_s * 10'000));
}


}  // namespace

Checkpointer::Checkpointer(const JobSpec& job, const ModelArch& arch, int rank, int world, Store* store,
                           Communicator* comm, std::string key_prefix)
    : job_(job), arch_(arch), layout_(arch.layout()), rank_(rank), world_(world), store_(store), comm_(comm),
      prefix_(std::move(key_prefix)), root_((fs::path(job.output.dir) / "checkpoints").string()) {
  TR_CHECK(world == 1 || store, "checkpoint: a multi-rank job needs the rendezvous store");
}

Checkpointer::~Checkpointer() {
  if (bg_.joinable()) bg_.join();
}

void Checkpointer::clean_stale() {
  if (rank_ != 0 || !fs::exists(root_)) return;
  for (const auto& e : fs::directory_iterator(root_)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".old-", 0) == 0) {
      std::error_code ec;
      fs::remove_all(e.path(), ec);
      TR_LOG_WARN("checkpoint: removed '", e.path().string(), "' left by an interrupted write");
    }
  }
}

double Checkpointer::save(ParamStore& ps, const TrainState& st) {
  auto t0 = Clock::now();
  wait();  // one save in flight at a time
  if (write_ranges_.empty() && held_ranges_.empty()) {
    write_ranges_ = ps.write_ranges();
    held_ranges_ = ps.held_ranges();
  }
  // Snapshot: this rank's write ranges of master, m, v, copied straight
  // into host buffers kept across saves (allocating and faulting in fresh
  // buffers every time cost seconds per GB; reusing them is a plain copy).
  ensure_snapshot_buffers();
  for (int kind = 0; kind < 3; ++kind) {
    size_t pos = 0;
    for (const auto& w : write_ranges_) {
      ps.copy_state_range(kind, w, snapshot_[kind].data() + pos);
      pos += size_t(w.count);
    }
  }
  const int64_t step = st.step;
  if (job_.checkpoint.async == "true") {
    bg_ = std::thread([this, step, st] {
      try {
        write_and_commit(step, st, snapshot_);
      } catch (const std::exception& e) {
        bg_error_ = e.what();
      }
    });
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
  try {
    write_and_commit(step, st, snapshot_);
  } catch (const Error& e) {
    handle_failure(e.what());
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Checkpointer::prepare(ParamStore& ps) {
  write_ranges_ = ps.write_ranges();
  held_ranges_ = ps.held_ranges();
  // Async saves snapshot into these while training runs: fault them in now,
  // not inside the first save's blocked window.
  if (job_.checkpoint.async == "true") ensure_snapshot_buffers();
}

void Checkpointer::ensure_snapshot_buffers() {
  size_t n = 0;
  for (const auto& w : write_ranges_) n += size_t(w.count);
  for (auto& b : snapshot_)
    if (b.size() != n) b.assign(n, 0.0f);
}

void Checkpointer::wait() {
  if (bg_.joinable()) bg_.join();
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

void Checkpointer::write_and_commit(int64_t step, const TrainState& st, const std::vector<std::vector<float>>& parts) {
  const std::string key = prefix_ + "ckpt/" + std::to_string(step) + "/";
  const auto timeout = std::chrono::milliseconds(ckpt_timeout_ms(job_));
  const std::string final_dir = root_ + "/" + step_name(step);
  const std::string tmp = root_ + "/.tmp-" + step_name(step);
  const std::string mhdr = model_header(arch_, layout_), ohdr = optimizer_header(layout_);
  const std::string mpath = tmp + "/model.safetensors", opath = tmp + "/optimizer.safetensors";

  // 1. rank 0 lays out the directory and the files at full size.
  std::string setup_error;
  if (rank_ == 0) {
    try {
      std::error_code ec;
      fs::create_directories(root_, ec);
      TR_CHECK(!ec, "checkpoint: cannot create '", root_, "': ", ec.message());
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp, ec);
      TR_CHECK(!ec, "checkpoint: cannot create '", tmp, "': ", ec.message());
      for (const auto& [path, hdr, elems] :
           {std::tuple{mpath, mhdr, layout_.total}, std::tuple{opath, ohdr, 2 * layout_.total}}) {
        write_file_synced(path, hdr);
        // Reserve the blocks now (posix_fallocate), so a full disk or a
        // file-size limit shows up here, before any rank writes, rather
        // than as a short write later; fall back to a sparse truncate
        // where the filesystem cannot preallocate.
        const off_t total = off_t(hdr.size() + elems * 4);
        int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
        TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
        int rc = ::posix_fallocate(fd, 0, total);
        ::close(fd);
        if (rc == EINVAL || rc == EOPNOTSUPP) rc = ::truncate(path.c_str(), total) == 0 ? 0 : errno;
        errno = rc;
        TR_CHECK_ERRNO(rc == 0, "cannot allocate ", total, " bytes for '", path, "' (disk full or file size limit?)");
      }
    } catch (const Error& e) {
      setup_error = e.what();
      std::error_code ec;
      fs::remove_all(tmp, ec);  // never leave a half-made directory behind
    }
    if (store_) store_->set(key + "ready", store_bytes(setup_error.empty() ? "ok" : setup_error));
  } else {
    setup_error = store_text(store_->get(key + "ready", timeout));
    if (setup_error == "ok") setup_error.clear();
  }
  if (!setup_error.empty()) TR_FAIL("checkpoint step ", step, " could not be written: ", setup_error);

  // 2. every rank writes its ranges at their global offsets, hashing them on
  //    the way (segments per file), and fsyncs.
  std::vector<std::vector<Segment>> mine(2);
  std::string status = "ok";
  try {
    Hasher h;
    for (int kind = 0; kind < 3; ++kind) {
      const int file = kind == 0 ? 0 : 1;
      const std::string& path = file == 0 ? mpath : opath;
      const int64_t base = int64_t(kind == 0 ? mhdr.size() : ohdr.size()) + (kind == 2 ? layout_.total * 4 : 0);
      if (parts[kind].empty()) continue;
      int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
      size_t pos = 0;
      try {
        for (const auto& r : write_ranges_) {
          hashed_pwrite(fd, reinterpret_cast<const char*>(parts[kind].data() + pos), uint64_t(r.count) * 4,
                        uint64_t(base + r.global * 4), path, h, mine[file]);
          pos += size_t(r.count);
        }
        TR_CHECK_ERRNO(::fsync(fd) == 0, "cannot fsync '", path, "'");
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
    }
  } catch (const Error& e) {
    status = std::string("rank ") + std::to_string(rank_) + ": " + e.what();
  }
  if (store_) {
    // The segments go first: "written" tells rank 0 they are there.
    json segs = json::array();
    for (int file = 0; file < 2; ++file)
      for (const Segment& g : mine[file]) segs.push_back({file, g.offset, g.bytes, hex64(g.hash)});
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
      if (store_) {
        std::vector<std::string> keys;
        for (int r = 0; r < world_; ++r) keys.push_back(key + "written/" + std::to_string(r));
        store_->wait(keys, timeout);
        for (int r = 0; r < world_; ++r) {
          std::string s = store_text(store_->get(keys[r], timeout));
          TR_CHECK(s == "ok", s);
        }
        for (int r = 1; r < world_; ++r) {
          const std::string text = store_text(store_->get(key + "segments/" + std::to_string(r), timeout));
          try {
            for (const json& g : json::parse(text)) {
              uint64_t hash = 0;
              const int file = g.at(0).get<int>();
              TR_CHECK((file == 0 || file == 1) && parse_hex64(g.at(3).get<std::string>(), &hash), "bad entry");
              all[size_t(file)].push_back({g.at(1).get<uint64_t>(), g.at(2).get<uint64_t>(), hash});
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
    } catch (const std::exception& e) {
      outcome = e.what();
      std::error_code ec;
      fs::remove_all(tmp, ec);  // never leave a half-written directory behind
    }
    if (store_) store_->set(key + "committed", store_bytes(outcome));
  } else {
    outcome = store_text(store_->get(key + "committed", timeout));
  }
  if (outcome != "ok") TR_FAIL("checkpoint step ", step, " could not be written: ", outcome);
}

void Checkpointer::commit_rank0(int64_t step, const TrainState& st, const std::string& tmp,
                                const std::string& final_dir, std::vector<std::vector<Segment>> segments) {
  json m;
  m["format_version"] = kFormatVersion;
  m["step"] = st.step;
  m["tokens_seen"] = st.tokens;
  m["data_cursor"] = st.cursor;
  m["world_size"] = world_;
  m["sharding"] = job_.parallel.sharding;
  m["model"] = arch_.manifest_model();
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
  const uint64_t sizes[2] = {model_header(arch_, layout_).size() + uint64_t(layout_.total) * 4,
                             optimizer_header(layout_).size() + uint64_t(layout_.total) * 8};
  json files = json::object();
  for (int f = 0; f < 2; ++f) {
    auto& segs = segments[size_t(f)];
    std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
    json list = json::array();
    uint64_t at = 0;
    for (const Segment& g : segs) {
      TR_CHECK(g.offset == at, "checkpoint: the ranges written to ", kFileNames[f], " do not tile it (",
               g.offset < at ? "overlap" : "gap", " at byte ", std::min(at, g.offset),
               "); the strategy's write_ranges are not a partition of the model (a bug)");
      list.push_back({{"offset", g.offset}, {"bytes", g.bytes}, {"xxhash64", hex64(g.hash)}});
      at += g.bytes;
    }
    TR_CHECK(at == sizes[f], "checkpoint: the ranges written to ", kFileNames[f], " cover ", at, " of its ", sizes[f],
             " bytes; the strategy's write_ranges are not a partition of the model (a bug)");
    files[kFileNames[f]] = {{"size", sizes[f]}, {"segments", list}};
  }
  m["files"] = files;
  m["job_spec"] = job_spec_to_yaml(job_);
  const char* only = std::getenv("TRAINRUN_DEBUG_CKPT_SLEEP_STEP");
  const char* ms = std::getenv("TRAINRUN_DEBUG_CKPT_SLEEP_MS");
  if (ms && (!only || std::atoll(only) == step)) {
    // Tests: widen the window between "data written" and "committed" so a
    // kill -9 lands in it.
    TR_LOG_INFO("checkpoint: debug pause of ", ms, " ms before committing step ", step);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(ms)));
  }
  write_file_synced(tmp + "/manifest.json", m.dump(2) + "\n");
  fsync_path(tmp);
  std::error_code ec;
  if (fs::exists(final_dir)) {  // re-saving a step (e.g. after a resume): move the old one aside first
    const std::string old = root_ + "/.old-" + step_name(step);
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    TR_CHECK(!ec, "cannot move aside '", final_dir, "': ", ec.message());
  }
  fs::rename(tmp, final_dir, ec);
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

std::string Checkpointer::verify(const std::string& dir) {
  std::vector<FileEntry> files;
  std::string why = check_manifest(dir, nullptr, &files);
  if (!why.empty()) return why;
  try {
    Hasher h;
    std::vector<char> buf(kIoChunk);
    for (const FileEntry& f : files) {
      const std::string path = dir + "/" + f.name;
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      // The segments tile the file: one sequential pass hashes them all.
      for (const Segment& g : f.segments) {
        h.reset();
        for (uint64_t done = 0; done < g.bytes;) {
          const size_t c = size_t(std::min<uint64_t>(g.bytes - done, buf.size()));
          try {
            pread_all(fd, buf.data(), c, off_t(g.offset + done), path);
          } catch (...) {
            ::close(fd);
            throw;
          }
          h.update(buf.data(), c);
          done += c;
        }
        if (h.digest() != g.hash) {
          ::close(fd);
          return mismatch(f.name, g, h.digest());
        }
      }
      ::close(fd);
    }
    return "";
  } catch (const std::exception& e) {
    return std::string("unreadable: ") + e.what();
  }
}

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

std::string Checkpointer::read_verified(const std::string& dir, std::vector<std::vector<float>>* out) {
  try {
    std::vector<FileEntry> files;
    const std::string why = check_manifest(dir, nullptr, &files);
    if (!why.empty()) return why;
    size_t held = 0;
    for (const auto& r : held_ranges_) held += size_t(r.count);
    if (out) {
      out->assign(3, {});
      for (auto& v : *out) v.resize(held);
    }
    const uint64_t mbase = model_header(arch_, layout_).size(), obase = optimizer_header(layout_).size();
    Hasher h;
    std::vector<char> scratch;
    for (int f = 0; f < 2; ++f) {
      const FileEntry& fe = *std::find_if(files.begin(), files.end(),
                                          [&](const FileEntry& e) { return e.name == kFileNames[f]; });
      // Where this rank's bytes of the file go: its held ranges of the
      // file's kinds, in file order.
      struct Dest {
        uint64_t off, bytes;
        char* dst;
      };
      std::vector<Dest> dests;
      for (int kind : f == 0 ? std::vector<int>{0} : std::vector<int>{1, 2}) {
        const uint64_t base = (f == 0 ? mbase : obase) + (kind == 2 ? uint64_t(layout_.total) * 4 : 0);
        size_t pos = 0;
        for (const auto& r : held_ranges_) {
          dests.push_back({base + uint64_t(r.global) * 4, uint64_t(r.count) * 4,
                           out ? reinterpret_cast<char*>((*out)[size_t(kind)].data() + pos) : nullptr});
          pos += size_t(r.count);
        }
      }
      std::sort(dests.begin(), dests.end(), [](const Dest& a, const Dest& b) { return a.off < b.off; });
      if (!dests.empty() && dests.back().off + dests.back().bytes > fe.size)
        return fe.name + " has " + std::to_string(fe.size) + " bytes, too few for this model (it needs " +
               std::to_string(dests.back().off + dests.back().bytes) + "); was it written by another model?";
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
        size_t d = 0;
        for (const Segment& g : fe.segments) {
          const uint64_t end = g.offset + g.bytes;
          while (d < dests.size() && dests[d].off + dests[d].bytes <= g.offset) ++d;
          const bool overlaps = d < dests.size() && dests[d].off < end;
          if (!overlaps && !(rank_ == 0 && g.offset < header_end)) continue;
          // Walk the segment: pieces inside a destination are read straight
          // into it, the rest into scratch (verified, then dropped).
          h.reset();
          size_t k = d;
          if (!out) {  // verify only: the whole segment through scratch
            for (uint64_t at = g.offset; at < end;) {
              const uint64_t n = std::min<uint64_t>(end - at, kIoChunk);
              scratch.resize(std::max<size_t>(scratch.size(), size_t(n)));
              hashed_pread(fd, scratch.data(), n, at, path, h);
              at += n;
            }
          }
          for (uint64_t at = out ? g.offset : end; at < end;) {
            while (k < dests.size() && dests[k].off + dests[k].bytes <= at) ++k;
            if (k < dests.size() && dests[k].off <= at) {
              const uint64_t n = std::min(end, dests[k].off + dests[k].bytes) - at;
              hashed_pread(fd, dests[k].dst + (at - dests[k].off), n, at, path, h);
              at += n;
            } else {
              const uint64_t stop = k < dests.size() ? std::min(end, dests[k].off) : end;
              const uint64_t n = std::min<uint64_t>(stop - at, kIoChunk);
              scratch.resize(std::max<size_t>(scratch.size(), size_t(n)));
              hashed_pread(fd, scratch.data(), n, at, path, h);
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
  } catch (const std::exception& e) {
    return std::string("unreadable: ") + e.what();
  }
}

void Checkpointer::load_kind_by_kind(const std::string& dir, ParamStore& ps) {
  size_t held = 0;
  for (const auto& r : held_ranges_) held += size_t(r.count);
  std::vector<float> buf(held);
  const uint64_t mbase = model_header(arch_, layout_).size(), obase = optimizer_header(layout_).size();
  for (int kind = 0; kind < 3; ++kind) {
    const std::string path = dir + "/" + kFileNames[kind == 0 ? 0 : 1];
    const uint64_t base = (kind == 0 ? mbase : obase) + (kind == 2 ? uint64_t(layout_.total) * 4 : 0);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TR_CHECK_ERRNO(fd >= 0, "checkpoint: cannot open '", path, "'");
    try {
      size_t pos = 0;
      for (const auto& r : held_ranges_) {
        pread_all(fd, reinterpret_cast<char*>(buf.data() + pos), size_t(r.count) * 4,
                  off_t(base + uint64_t(r.global) * 4), path);
        pos += size_t(r.count);
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

bool Checkpointer::load(ParamStore& ps, TrainState& st) {
  held_ranges_ = ps.held_ranges();
  write_ranges_ = ps.write_ranges();
  // Rank 0 names a candidate that passes the checks needing no data (the
  // manifest, the files and their sizes); every rank then reads its part,
  // verifying it on the way, into staging buffers; only when no rank found
  // a bad segment does anything reach the model and the optimizer.
  // checkpoint.resume: auto falls back to the next older candidate.
  const bool is_auto = job_.checkpoint.resume == "auto";
  std::vector<std::string> candidates;
  size_t next = 0;
  bool listed = false;
  for (;;) {
    std::vector<char> msg(4096, 0);
    if (rank_ == 0) {
      std::string text;
      char status = 'N';
      try {
        if (!listed) {
          if (job_.checkpoint.resume == "never") set_aside_earlier_checkpoints();
          candidates = resume_candidates();
          listed = true;
        }
        while (next < candidates.size()) {
          const std::string dir = candidates[next++];
          const std::string why = check_manifest(dir, nullptr, nullptr);
          if (why.empty()) {
            text = dir;
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
      }
      TR_CHECK(text.size() < msg.size() - 2, "checkpoint path too long");
      msg[0] = status;
      std::memcpy(msg.data() + 1, text.data(), text.size());
    }
    comm_->broadcast(msg.data(), msg.size(), 0);
    const std::string text(msg.data() + 1);
    if (msg[0] == 'E') TR_FAIL(text);
    if (msg[0] == 'N') return false;
    const std::string dir = text;

    std::ifstream f(dir + "/manifest.json");
    json m = json::parse(f);
    const std::string changed = manifest_model_mismatch(arch_, m.at("model"));
    TR_CHECK(changed.empty(), "checkpoint ", dir, " was saved with ", changed,
             "; the model shape cannot change on resume (use a new output.dir or checkpoint.resume: never)");

    // One pass (verify while reading into staging, then go live) needs the
    // rank's three state kinds in host memory at once. Where that would not
    // fit comfortably (big hybrid_shard/no_shard ranks, several per node),
    // verify first and then load kind by kind: one more read of the data,
    // a third of the memory.
    size_t held = 0;
    for (const auto& r : held_ranges_) held += size_t(r.count);
    const uint64_t need = uint64_t(held) * 4 * 3, limit = staging_limit_bytes();
    const bool staged_load = need <= limit;
    std::vector<std::vector<float>> staged;
    const std::string why = first_error_of_all(read_verified(dir, staged_load ? &staged : nullptr));
    if (!why.empty()) {
      TR_CHECK(is_auto, "checkpoint.resume: '", dir, "' cannot be loaded: ", why);
      if (rank_ == 0)
        TR_LOG_WARN("checkpoint: skipping ", dir, ": ", why, "; falling back to the previous checkpoint");
      continue;
    }
    if (rank_ == 0) {
      const json& t = m.at("train");
      auto note = [&](const char* key, const json& now) {
        if (t.contains(key) && t.at(key) != now)
          TR_LOG_INFO("resume: train.", key, " changed from ", t.at(key).dump(), " to ", now.dump(), " (allowed)");
      };
      note("lr", job_.train.lr);
      note("min_lr", job_.train.min_lr);
      note("max_steps", job_.train.max_steps);
      note("warmup_steps", job_.train.warmup_steps);
      note("schedule", job_.train.schedule);
      note("weight_decay", job_.train.weight_decay);
      note("global_batch_size", job_.train.global_batch_size);
      note("micro_batch_size", job_.train.micro_batch_size);
    }
    // Verified everywhere: now it may go live.
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
    st.step = m.at("step").get<int64_t>();
    st.cursor = m.at("data_cursor").get<int64_t>();
    st.tokens = m.at("tokens_seen").get<int64_t>();
    if (rank_ == 0)
      TR_LOG_INFO("resume: loaded ", dir, " (step ", st.step, ", ", st.tokens, " tokens; saved by ",
                  m.at("world_size").get<int>(), " ranks with ", m.at("sharding").get<std::string>(), ", loaded on ",
                  world_, " ranks with ", job_.parallel.sharding, ")");
    return true;
  }
}

}  // namespace trainrun
