#include "core/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/io/safetensors.h"
#include "core/model/model_io.h"
#include "core/common/log.h"

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace trainrun {

namespace {

constexpr int kFormatVersion = 1;

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
std::string model_header(const GPT2Config& cfg, const ParamLayout& lay) {
  std::vector<SafeTensorEntry> es;
  for (const auto& t : lay.tensors) es.push_back({t.name, "F32", t.shape, uint64_t(t.numel) * 4});
  return encode_safetensors_header(es, gpt2_safetensors_metadata(cfg));
}

std::string optimizer_header(const ParamLayout& lay) {
  std::vector<SafeTensorEntry> es;
  for (const char* prefix : {"exp_avg.", "exp_avg_sq."})
    for (const auto& t : lay.tensors) es.push_back({prefix + t.name, "F32", t.shape, uint64_t(t.numel) * 4});
  return encode_safetensors_header(es, {{"format", "trainrun-adamw"}});
}

// Size and xxhash64 of a whole file.
std::pair<uint64_t, std::string> file_digest(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  uint64_t size = 0;
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      XXH64_freeState(st);
      ::close(fd);
      TR_FAIL("cannot read '", path, "'");
    }
    if (n == 0) break;
    XXH64_update(st, buf.data(), size_t(n));
    size += uint64_t(n);
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH64_digest(st)));
  XXH64_freeState(st);
  ::close(fd);
  return {size, hex};
}

int64_t ckpt_timeout_ms(const JobSpec& job) {
  // Writing a large checkpoint to a slow filesystem can take far longer than
  // a collective; give it 10x the collective timeout, at least 10 minutes.
  return std::max<int64_t>(600'000, int64_t(job.parallel.timeout_s * 10'000));
}

std::string str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

}  // namespace

Checkpointer::Checkpointer(const JobSpec& job, const GPT2Config& cfg, const ParamLayout& layout, int rank,
                           int world, Store* store, Communicator* comm, std::string key_prefix)
    : job_(job), cfg_(cfg), layout_(layout), rank_(rank), world_(world), store_(store), comm_(comm),
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
  const std::string mhdr = model_header(cfg_, layout_), ohdr = optimizer_header(layout_);
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
    if (store_) store_->set(key + "ready", bytes(setup_error.empty() ? "ok" : setup_error));
  } else {
    setup_error = str(store_->get(key + "ready", timeout));
    if (setup_error == "ok") setup_error.clear();
  }
  if (!setup_error.empty()) TR_FAIL("checkpoint step ", step, " could not be written: ", setup_error);

  // 2. every rank writes its ranges at their global offsets and fsyncs.
  std::string status = "ok";
  try {
    for (int kind = 0; kind < 3; ++kind) {
      const std::string& path = kind == 0 ? mpath : opath;
      const int64_t base = int64_t(kind == 0 ? mhdr.size() : ohdr.size()) + (kind == 2 ? layout_.total * 4 : 0);
      if (parts[kind].empty()) continue;
      int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
      size_t pos = 0;
      try {
        for (const auto& r : write_ranges_) {
          pwrite_all(fd, parts[kind].data() + pos, size_t(r.count) * 4, off_t(base + r.global * 4), path);
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
  if (store_) store_->set(key + "written/" + std::to_string(rank_), bytes(status));

  // 3. rank 0 commits; everyone learns the outcome.
  std::string outcome;
  if (rank_ == 0) {
    try {
      if (store_) {
        std::vector<std::string> keys;
        for (int r = 0; r < world_; ++r) keys.push_back(key + "written/" + std::to_string(r));
        store_->wait(keys, timeout);
        for (int r = 0; r < world_; ++r) {
          std::string s = str(store_->get(keys[r], timeout));
          TR_CHECK(s == "ok", s);
        }
      } else {
        TR_CHECK(status == "ok", status);
      }
      commit_rank0(step, st, tmp, final_dir);
      outcome = "ok";
    } catch (const std::exception& e) {
      outcome = e.what();
      std::error_code ec;
      fs::remove_all(tmp, ec);  // never leave a half-written directory behind
    }
    if (store_) store_->set(key + "committed", bytes(outcome));
  } else {
    outcome = str(store_->get(key + "committed", timeout));
  }
  if (outcome != "ok") TR_FAIL("checkpoint step ", step, " could not be written: ", outcome);
}

void Checkpointer::commit_rank0(int64_t step, const TrainState& st, const std::string& tmp,
                                const std::string& final_dir) {
  json m;
  m["format_version"] = kFormatVersion;
  m["step"] = st.step;
  m["tokens_seen"] = st.tokens;
  m["data_cursor"] = st.cursor;
  m["world_size"] = world_;
  m["sharding"] = job_.parallel.sharding;
  m["model"] = {{"arch", "gpt2"}, {"n_layer", cfg_.L}, {"n_head", cfg_.NH}, {"n_embd", cfg_.C},
                {"vocab_size", cfg_.V}, {"seq_len", cfg_.T}};
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
  json files = json::object();
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    auto [size, hash] = file_digest(tmp + "/" + f);
    files[f] = {{"size", size}, {"xxhash64", hash}};
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
  try {
    std::ifstream f(dir + "/manifest.json");
    if (!f) return "manifest.json is missing";
    json m;
    try {
      m = json::parse(f);
    } catch (const std::exception& e) {
      return std::string("manifest.json is not valid JSON (") + e.what() + ")";
    }
    if (!m.contains("format_version") || m["format_version"] != kFormatVersion)
      return "manifest.json has an unsupported format_version";
    for (const auto& [name, info] : m.at("files").items()) {
      const std::string path = dir + "/" + name;
      if (!fs::exists(path)) return name + " is missing";
      const uint64_t want = info.at("size").get<uint64_t>();
      const uint64_t have = fs::file_size(path);
      if (have != want)
        return name + " has " + std::to_string(have) + " bytes, the manifest says " + std::to_string(want) +
               " (truncated?)";
      auto [size, hash] = file_digest(path);
      if (hash != info.at("xxhash64").get<std::string>())
        return name + ": checksum mismatch (xxhash64 " + hash + ", manifest " +
               info.at("xxhash64").get<std::string>() + "); the file is corrupt";
    }
    return "";
  } catch (const std::exception& e) {
    return std::string("unreadable: ") + e.what();
  }
}

std::string Checkpointer::choose_resume_dir() {
  const std::string& r = job_.checkpoint.resume;
  if (r == "never") return "";
  if (r != "auto") {
    std::string why = verify(r);
    TR_CHECK(why.empty(), "checkpoint.resume: '", r, "' cannot be loaded: ", why);
    return r;
  }
  if (!fs::exists(root_)) return "";
  std::vector<int64_t> steps;
  for (const auto& e : fs::directory_iterator(root_)) {
    int64_t s;
    if (e.is_directory() && parse_step_name(e.path().filename().string(), &s)) steps.push_back(s);
  }
  std::sort(steps.rbegin(), steps.rend());
  for (int64_t s : steps) {
    const std::string dir = root_ + "/" + step_name(s);
    std::string why = verify(dir);
    if (why.empty()) return dir;
    TR_LOG_WARN("checkpoint: skipping ", dir, ": ", why, "; falling back to the previous checkpoint");
  }
  if (!steps.empty()) TR_LOG_WARN("checkpoint: no loadable checkpoint in ", root_, "; starting from scratch");
  return "";
}

bool Checkpointer::load(ParamStore& ps, TrainState& st) {
  // Rank 0 decides (verifying checksums once), then tells everyone.
  std::vector<char> msg(4096, 0);
  if (rank_ == 0) {
    std::string text;
    char status = 'N';
    try {
      text = choose_resume_dir();
      status = text.empty() ? 'N' : 'Y';
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
  const json& mm = m.at("model");
  auto check_same = [&](const char* key, int have) {
    int saved = mm.at(key).get<int>();
    TR_CHECK(saved == have, "checkpoint ", dir, " was saved with model.", key, " = ", saved, " but this job has ",
             have, "; the model shape cannot change on resume (use a new output.dir or checkpoint.resume: never)");
  };
  check_same("n_layer", cfg_.L);
  check_same("n_head", cfg_.NH);
  check_same("n_embd", cfg_.C);
  check_same("vocab_size", cfg_.V);
  check_same("seq_len", cfg_.T);
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

  held_ranges_ = ps.held_ranges();
  write_ranges_ = ps.write_ranges();
  const std::string mpath = dir + "/model.safetensors", opath = dir + "/optimizer.safetensors";
  const int64_t mbase = int64_t(model_header(cfg_, layout_).size());
  const int64_t obase = int64_t(optimizer_header(layout_).size());
  for (int kind = 0; kind < 3; ++kind) {
    const std::string& path = kind == 0 ? mpath : opath;
    const int64_t base = (kind == 0 ? mbase : obase) + (kind == 2 ? layout_.total * 4 : 0);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TR_CHECK_ERRNO(fd >= 0, "checkpoint: cannot open '", path, "'");
    std::vector<float> host;
    for (const auto& r : held_ranges_) {
      size_t at = host.size();
      host.resize(at + size_t(r.count));
      pread_all(fd, host.data() + at, size_t(r.count) * 4, off_t(base + r.global * 4), path);
    }
    ::close(fd);
    ps.set_state(kind, host);
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

}  // namespace trainrun
