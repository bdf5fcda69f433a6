#include "core/checkpoint/bench_checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <vector>

#include "core/checkpoint/checkpoint.h"
#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/common/log.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/sharding.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace trainrun {

namespace {

constexpr size_t kChunk = size_t(16) << 20;  // large enough that syscall overhead is noise

double secs(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string fs_type(const std::string& dir) {
  struct statfs s;
  if (::statfs(dir.c_str(), &s) != 0) return "unknown";
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53: return "ext2/3/4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x794C7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0x2FC12FC1: return "zfs";
    case 0x0BD00BD0: return "lustre";
    case 0x65735546: return "fuse";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "0x%lx", static_cast<unsigned long>(s.f_type));
      return buf;
    }
  }
}

// Ask the kernel to evict the file's (clean, fsynced) pages from the cache.
void drop_cache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// Fraction of the file's pages in the page cache (mincore), -1 if unknown.
double resident_fraction(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size <= 0) {
    ::close(fd);
    return -1;
  }
  void* p = ::mmap(nullptr, size_t(size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return -1;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size_t(size) + page - 1) / page);
  double frac = -1;
  if (::mincore(p, size_t(size), vec.data()) == 0) {
    size_t n = 0;
    for (unsigned char c : vec) n += c & 1;
    frac = double(n) / double(vec.size());
  }
  ::munmap(p, size_t(size));
  return frac;
}

// Sequential write of `bytes` from `src` (repeated) in kChunk writes, then
// fsync: the disk's streaming write speed as a checkpoint would see it.
double disk_write(const std::string& path, int64_t bytes, const std::vector<char>& src) {
  auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TR_CHECK_ERRNO(fd >= 0, "bench checkpoint: cannot create '", path, "'");
  try {
    for (int64_t off = 0; off < bytes; off += int64_t(src.size()))
      pwrite_all(fd, src.data(), size_t(std::min<int64_t>(bytes - off, int64_t(src.size()))), off, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  TR_CHECK_ERRNO(::fsync(fd) == 0, "bench checkpoint: cannot fsync '", path, "'");
  ::close(fd);
  return secs(t0);
}

double disk_read(const std::string& path, std::vector<char>& buf) {
  auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TR_CHECK_ERRNO(fd >= 0, "bench checkpoint: cannot open '", path, "'");
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      TR_FAIL("bench checkpoint: cannot read '", path, "'");
    }
    if (n == 0) break;
  }
  ::close(fd);
  return secs(t0);
}

int64_t dir_bytes(const std::string& dir) {
  int64_t b = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) b += int64_t(e.file_size());
  return b;
}

// Removes the scratch folder however the bench ends.
struct ScratchDir {
  std::string path;
  ~ScratchDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

// Restores the log level (the bench silences the Checkpointer's info lines).
struct QuietLog {
  LogLevel saved = log_level();
  QuietLog() { set_log_level(LogLevel::Warn); }
  ~QuietLog() { set_log_level(saved); }
};

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(s[i]);
  }
  return out;
}

// 5. tensor parallelism: a tp2 Llama trained one step by this binary (two
// ranks), which then writes its one checkpoint; rank 0's log line says how
// long the save took and how many pwrites it made (row_exchange.h: whole
// rows, not one pwrite per row of a row-parallel slice).
void tp2_rows(const std::string& scratch) {
  const std::string model =
      "{arch: llama, n_layer: 4, n_head: 16, n_kv_head: 4, n_embd: 1024, ffn_dim: 2816, vocab_size: 32000, "
      "seq_len: 16, tie_embeddings: false}";
  const std::string dir = scratch + "/tp2", yaml = scratch + "/tp2.yaml", log = scratch + "/tp2.log";
  write_file_synced(yaml, "model: " + model + "\ndata: {format: synthetic, synthetic: {vocab: 32000, branching: 8}}\n"
                          "train: {global_batch_size: 1, micro_batch_size: 1, max_steps: 1, warmup_steps: 0, "
                          "eval_interval: 0, log_interval: 1}\n"
                          "output: {dir: '" + dir + "', sample_tokens: 0}\n"
                          "parallel: {nproc_per_node: 2, tensor_parallel: 2, sharding: full_shard}\n"
                          "checkpoint: {final: true, keep_last: 0}\n");
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  std::cerr << "bench checkpoint: a tp2 Llama, one step and its checkpoint (two ranks of this binary) ...\n";
  const int rc = std::system(("'" + self + "' --config '" + yaml + "' > '" + log + "' 2>&1").c_str());
  TR_CHECK(rc == 0, "bench checkpoint: the tp2 run failed (exit ", rc, "); see ", log);
  std::ifstream in(log);
  const std::string key = "checkpoint: step 1 written; training blocked ";
  double secs_blocked = -1;
  long long writes = -1;
  for (std::string l; std::getline(in, l);) {
    const auto at = l.find(key);
    if (at == std::string::npos) continue;
    secs_blocked = std::atof(l.c_str() + at + key.size());
    const auto w = l.find(" s, ", at);
    if (w != std::string::npos) writes = std::atoll(l.c_str() + w + 4);
  }
  TR_CHECK(secs_blocked >= 0, "bench checkpoint: no checkpoint line in ", log);
  const double gb = double(dir_bytes(dir + "/checkpoints/step_00000001")) / 1e9;
  std::printf("\ntensor parallelism: %s at tp2 x dp1 (2 ranks of this binary, full_shard), one checkpoint\n",
              model.c_str());
  std::printf("%-52s %9s %8s %9s\n", "", "seconds", "GB/s", "pwrites");
  std::printf("%-52s %9.3f %8.2f %9lld\n", "checkpoint save at tp2 (rank 0, async off)", secs_blocked, gb / secs_blocked,
              writes);
  std::fflush(stdout);
}

}  // namespace

ModelConfig bench_model_for(int64_t target) {
  // The default architecture with GPT-2's vocab and context at 12 layers
  // down to ~4M parameters; below that a byte-level model, so tiny counts
  // stay close too. The width is the multiple of 8 whose parameter count
  // (the architecture's own) is closest to the target.
  ModelConfig cfg = ModelConfig::of(12, 1, 64, 50257, 1024);
  auto count = [&](int C) {
    ModelConfig c = cfg;
    c.C = C;
    c.NH = 1;
    return c.num_parameters();
  };
  if (target < count(64)) cfg = ModelConfig::of(4, 1, 64, 256, 128);
  // The parameter count grows with the width: bisect for the first multiple
  // of 8 at or above the target, then take the closer of it and the one below.
  int lo = 1, hi = 1;  // in units of 8
  while (count(8 * hi) < target) lo = hi, hi *= 2;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (count(8 * mid) < target ? lo : hi) = mid;
  }
  const int above = 8 * hi, below = std::max(8, above - 8);
  cfg.C = std::llabs(count(below) - target) <= std::llabs(count(above) - target) ? below : above;
  cfg.NH = cfg.C % 64 == 0 ? cfg.C / 64 : cfg.C / 8;  // head size 64 as in GPT-2 where it divides
  return cfg;
}

int run_checkpoint_bench(const CheckpointBenchOptions& o) {
  TR_CHECK(o.repeat >= 1 && o.repeat <= 100, "bench checkpoint: --repeat must be in [1, 100], got ", o.repeat);
  const int64_t target = parse_param_count(o.params);
  const ModelConfig cfg = bench_model_for(target);
  const std::unique_ptr<ModelArch> arch = make_model_arch(cfg);
  const ParamLayout& lay = arch->layout();
  const int64_t data_bytes = 3 * lay.total * 4;

  std::error_code ec;
  fs::create_directories(o.dir, ec);
  TR_CHECK(!ec && fs::is_directory(o.dir), "bench checkpoint: --dir '", o.dir, "' is not a usable directory",
           ec ? ": " + ec.message() : "");
  struct statvfs sv;
  TR_CHECK_ERRNO(::statvfs(o.dir.c_str(), &sv) == 0, "bench checkpoint: cannot stat '", o.dir, "'");
  const double free_bytes = double(sv.f_bavail) * double(sv.f_frsize);
  // At most one checkpoint and nothing else at a time, plus headroom.
  TR_CHECK(free_bytes > 1.1 * double(data_bytes), "bench checkpoint: '", o.dir, "' has ", free_bytes / 1e9,
           " GB free but a checkpoint of this model needs ", data_bytes / 1e9, " GB; lower --params or pick another --dir");

  ScratchDir scratch;
  scratch.path = (fs::absolute(o.dir) / (".trainrun-bench-checkpoint-" + std::to_string(::getpid()))).string();
  fs::remove_all(scratch.path, ec);
  fs::create_directories(scratch.path, ec);
  TR_CHECK(!ec, "bench checkpoint: cannot create '", scratch.path, "': ", ec.message());

  std::cerr << "bench checkpoint: building a model of " << with_commas(lay.total) << " parameters ...\n";
  auto be = make_cpu_backend();
  auto comm = make_single_communicator();
  auto ps = make_param_store("no_shard", lay, be.get(), comm.get(), 1, nullptr);
  ps->init_params(*arch, 1);
  std::vector<float> src_state = ps->get_state(0);
  // Moments like the weights, not zeros: no filesystem can compress them away.
  ps->set_state(1, src_state);
  ps->set_state(2, src_state);
  // The disk file gets the same kind of bytes.
  std::vector<char> chunk(kChunk);
  std::memcpy(chunk.data(), src_state.data(), std::min(chunk.size(), src_state.size() * 4));
  for (size_t i = src_state.size() * 4; i < chunk.size(); ++i) chunk[i] = char(i * 2654435761u >> 24);
  src_state = {};

  QuietLog quiet;
  std::vector<double> t_dw, t_dr, t_save, t_load, t_ablock, t_aall;
  std::vector<double> res_disk, res_ckpt;
  int64_t ckpt_bytes = 0;
  for (int rep = 0; rep < o.repeat; ++rep) {
    std::cerr << "bench checkpoint: repetition " << rep + 1 << "/" << o.repeat << "\n";
    // 1. the disk: sequential write + fsync, then a cold sequential read.
    const std::string file = scratch.path + "/disk.bin";
    t_dw.push_back(disk_write(file, data_bytes, chunk));
    drop_cache(file);
    res_disk.push_back(resident_fraction(file));
    t_dr.push_back(disk_read(file, chunk));
    fs::remove(file, ec);

    // 2. Checkpointer, async off: save() blocks training for the whole write.
    const std::string run = scratch.path + "/run";
    {
      JobSpec job;
      job.output.dir = run;
      job.checkpoint.async = "false";
      job.checkpoint.keep_last = 0;
      Checkpointer ck(job, *arch, 0, 1, nullptr, comm.get(), "");
      TrainState st;
      st.step = rep + 1;
      t_save.push_back(ck.save(*ps, st));
    }
    char step[32];
    std::snprintf(step, sizeof step, "step_%08d", rep + 1);
    const std::string ckdir = run + "/checkpoints/" + step;
    ckpt_bytes = dir_bytes(ckdir);
    for (const char* f : {"model.safetensors", "optimizer.safetensors", "manifest.json"}) drop_cache(ckdir + "/" + f);
    res_ckpt.push_back(resident_fraction(ckdir + "/optimizer.safetensors"));
    // 3. load it back (read + verify in one pass) into the same ParamStore.
    {
      JobSpec job;
      job.output.dir = run;
      job.checkpoint.resume = ckdir;
      Checkpointer ck(job, *arch, 0, 1, nullptr, comm.get(), "");
      TrainState st;
      auto t0 = Clock::now();
      TR_CHECK(ck.load(*ps, st), "bench checkpoint: the checkpoint just written did not load (internal error)");
      t_load.push_back(secs(t0));
    }
    fs::remove_all(run, ec);

    // 4. async on: save() returns once the background write has started (it
    //    streams the live state in one-segment pieces; a trainer's next
    //    optimizer step waits until it has read the state).
    {
      JobSpec job;
      job.output.dir = run;
      job.checkpoint.async = "true";
      job.checkpoint.keep_last = 0;
      Checkpointer ck(job, *arch, 0, 1, nullptr, comm.get(), "");
      ck.prepare(*ps);  // as the trainer does at start
      TrainState st;
      st.step = rep + 1;
      auto t0 = Clock::now();
      t_ablock.push_back(ck.save(*ps, st));
      ck.wait();
      t_aall.push_back(secs(t0));
    }
    fs::remove_all(run, ec);
  }

  // ---- the table --------------------------------------------------------------
  const double gb = double(ckpt_bytes) / 1e9;
  const double dw = median(t_dw), dr = median(t_dr);
  std::printf("trainrun bench checkpoint: %s, %s parameters\n", arch->describe().c_str(),
              with_commas(lay.total).c_str());
  std::printf("checkpoint: fp32 master weights + 2 AdamW moments = %.3f GB on disk (headers and manifest included)\n",
              gb);
  std::printf("directory: %s (%s); median of %d; GB = 1e9 bytes\n\n", fs::absolute(o.dir).lexically_normal().c_str(),
              fs_type(o.dir).c_str(), o.repeat);
  std::printf("%-52s %9s %8s %9s\n", "", "seconds", "GB/s", "vs disk");
  auto row = [&](const char* what, double s, double bytes_gb, double disk_s) {
    char rate[32] = "-", rel[32] = "-";
    if (bytes_gb > 0) std::snprintf(rate, sizeof rate, "%.2f", bytes_gb / s);
    if (disk_s > 0) std::snprintf(rel, sizeof rel, "%.0f%%", 100.0 * disk_s / s);
    std::printf("%-52s %9.3f %8s %9s\n", what, s, rate, rel);
  };
  const double dgb = double(data_bytes) / 1e9;
  row("disk: sequential write (16 MiB writes + fsync)", dw, dgb, 0);
  row("disk: sequential read (16 MiB reads)", dr, dgb, 0);
  row("checkpoint save, async off (= training blocked)", median(t_save), gb, dw * gb / dgb);
  row("checkpoint save, async on: save() returns", median(t_ablock), 0, 0);
  row("checkpoint save, async on: background write", median(t_aall), gb, dw * gb / dgb);
  row("checkpoint load (read + verify xxhash64, one pass)", median(t_load), gb, dr * gb / dgb);
  std::printf("\nsave = state to host in one-segment pieces + pwrite (xxhash64 on the way) + fsync + manifest + rename; "
              "load reads every file once, hashing as it reads\n");
  const double rd = median(res_disk), rc = median(res_ckpt);
  if (rd < 0 || rc < 0) {
    std::printf("page cache: residency unknown (mincore failed); read figures may come from the cache\n");
  } else {
    std::printf("page cache before reads: disk file %.0f%%, checkpoint %.0f%% resident after posix_fadvise(DONTNEED)",
                100 * rd, 100 * rc);
    if (std::max(rd, rc) > 0.1)
      std::printf(" -- this filesystem keeps them cached, so read figures are cache speed, not disk speed");
    std::printf("\n");
  }
  std::fflush(stdout);
  if (o.tp2) tp2_rows(scratch.path);
  return 0;
}

}  // namespace trainrun
