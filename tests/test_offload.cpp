// parallel.offload: cpu against offload none. Ranks run as threads of this
// process (a real store, Gloo, the comm thread), as in test_sharding.cpp.
// The CPU backend runs the offload path for real: the optimizer state sits
// in separate host buffers, every unit's reduce-scattered gradient is
// copied out through the backend and added on the host, host AdamW updates
// it and the parameters are copied back. Host AdamW is the backend's AdamW
// bit for bit (test_host_adamw.cpp), so the losses and weights must be
// bit-identical, not merely close.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/model/model_io.h"
#include "core/train/trainer.h"
#include "kernels/backend.h"
#include "parallel/sharding/offload.h"
#include "parallel/sharding/sharding.h"
#include "tests/support/checkpoint_jobs.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;

namespace {

// test_sharding.cpp's model: units that 3 and 4 ranks do not divide (padding).
std::string job_yaml(const std::string& dir, const std::string& strategy, int group, const std::string& offload) {
  return "model: {n_layer: 2, n_head: 2, n_embd: 18, vocab_size: 23, seq_len: 12}\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
         "train: {global_batch_size: 12, micro_batch_size: 1, max_steps: 6, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 2, eval_interval: 0, log_interval: 1, grad_clip: 0.5, weight_decay: 0.1}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", shard_group_size: " + std::to_string(group) +
         ", timeout_s: 60, offload: " + offload + (offload == "nvme" ? ", offload_dir: '" + dir + "/nvme'" : "") +
         "}\n";
}

struct RunOut {
  std::vector<double> losses;
  std::vector<float> weights;
  std::vector<TrainSummary> per_rank;
};

RunOut run(int world, const std::string& strategy, int group, const std::string& offload) {
  test::TempDir dir("offload");
  const int mb = world == 3 ? 2 : 3;  // accumulation at every world but 4
  JobSpec job = parse_job_spec(job_yaml(dir.path(), strategy, group, offload), "job.yaml",
                               {"train.micro_batch_size=" + std::to_string(mb)});
  RunOut out;
  out.per_rank = test::run_ranks_inprocess(job, world);
  out.losses = out.per_rank[0].losses;
  load_model_safetensors(dir / "model.safetensors", out.weights);
  return out;
}

}  // namespace

TEST_CASE("offload cpu and nvme: losses and weights bit-identical to offload none, 1-4 ranks x every strategy",
          "[offload]") {
  for (const char* strategy : {"no_shard", "shard_grad_op", "full_shard", "hybrid_shard"}) {
    for (int world : {1, 2, 3, 4}) {
      const int group = std::string(strategy) == "hybrid_shard" ? (world % 2 == 0 ? 2 : world) : 0;
      SECTION(std::string(strategy) + " world " + std::to_string(world)) {
        const RunOut none = run(world, strategy, group, "none");
        const RunOut cpu = run(world, strategy, group, "cpu");
        const RunOut nvme = run(world, strategy, group, "nvme");
        REQUIRE(none.losses.size() == 6);
        REQUIRE(none.losses.back() < none.losses.front());
        CHECK(cpu.losses == none.losses);
        CHECK(cpu.weights == none.weights);
        CHECK(nvme.losses == none.losses);
        CHECK(nvme.weights == none.weights);
        for (int r = 0; r < world; ++r) {
          INFO("rank " << r);
          // The device holds no optimizer state; the host holds 16 bytes per
          // element of the rank's state (master, 2 moments, gradient).
          CHECK(cpu.per_rank[r].optimizer_bytes == 0);
          CHECK(none.per_rank[r].optimizer_bytes > 0);
          CHECK(none.per_rank[r].host_bytes == 0);
          CHECK(cpu.per_rank[r].host_bytes == none.per_rank[r].optimizer_bytes * 2);
          CHECK(nvme.per_rank[r].optimizer_bytes == 0);
        }
      }
    }
  }
}

TEST_CASE("offload nvme: the disk sees the gradient once per step, whatever the number of micro-batches",
          "[offload]") {
  // 12 sequences a step over 2 ranks: 1, 2 or 6 micro-batches per rank.
  // Every byte written to the state files (the init, the gradient, the
  // step's master and moments) is counted. With accumulation the gradient
  // is summed on the device and lands once: the same bytes for 2 and 6.
  // One micro-batch lands each unit's reduction as it comes (no device
  // copy), whole pages: at most one page more per unit where two units'
  // shards share a page.
  std::map<int, uint64_t> written;
  for (const char* strategy : {"full_shard", "shard_grad_op"}) {
    for (int mb : {6, 3, 1}) {
      INFO(strategy << ", micro-batch " << mb);
      test::TempDir dir("offload_accum");
      const std::vector<std::string> sets = {"train.micro_batch_size=" + std::to_string(mb), "train.max_steps=3"};
      const JobSpec job = parse_job_spec(job_yaml(dir.path(), strategy, 0, "nvme"), "job.yaml", sets);
      const uint64_t before = HostOptimizerState::nvme_bytes_written();
      const auto ranks = test::run_ranks_inprocess(job, 2);
      written[mb] = HostOptimizerState::nvme_bytes_written() - before;
      // Equal to offload none at the same micro-batch, bit for bit.
      test::TempDir ref("offload_accum_none");
      const auto none =
          test::run_ranks_inprocess(parse_job_spec(job_yaml(ref.path(), strategy, 0, "none"), "job.yaml", sets), 2);
      CHECK(ranks[0].losses == none[0].losses);
      CHECK(test::weights_of(dir.path()) == test::weights_of(ref.path()));
    }
    const JobSpec job = parse_job_spec(job_yaml("/tmp", strategy, 0, "nvme"), "job.yaml");
    const size_t units = make_model_arch(ModelConfig::from_spec(job.model))->layout().units.size();
    INFO(strategy << ": bytes written over 3 steps: " << written[6] << " with 1 micro-batch, " << written[3]
                  << " with 2, " << written[1] << " with 6; " << units << " units");
    CHECK(written[1] > 0);
    CHECK(written[3] == written[1]);
    CHECK(written[6] >= written[1]);
    CHECK(written[6] <= written[1] + units * 4096 * 2 /*ranks*/ * 3 /*steps*/);
  }
}

TEST_CASE("offload cpu: metrics.jsonl reports host bytes and zero device optimizer bytes", "[offload]") {
  test::TempDir dir("offload_metrics");
  JobSpec job = parse_job_spec(job_yaml(dir.path(), "full_shard", 0, "cpu"), "job.yaml", {"train.max_steps=2"});
  test::run_ranks_inprocess(job, 2);
  std::ifstream f(dir / "metrics.jsonl");
  std::string line, last;
  while (std::getline(f, line))
    if (line.find("\"mem_host_bytes\"") != std::string::npos) last = line;
  REQUIRE(!last.empty());
  CHECK_THAT(last, Contains("\"mem_optimizer_bytes\":0"));
}

TEST_CASE("offload nvme: a shard of several I/O chunks, the files removed, bytes reported", "[offload]") {
  // A model whose shard spans more than one kChunk (1M elements), so the
  // double-buffered read / update / write pipeline really overlaps chunks.
  test::TempDir dir("offload_nvme");
  auto yaml = [&](const std::string& offload) {
    return "model: {n_layer: 1, n_head: 4, n_embd: 256, vocab_size: 4096, seq_len: 16}\n"
           "data: {format: synthetic, synthetic: {vocab: 64, branching: 3}}\n"
           "train: {global_batch_size: 2, micro_batch_size: 2, max_steps: 3, warmup_steps: 1, log_interval: 1,\n"
           "        eval_interval: 0, grad_clip: 1.0, weight_decay: 0.1}\n"
           "output: {dir: '" + dir.path() + "/" + offload + "', sample_tokens: 0}\n"
           "parallel: {sharding: no_shard, timeout_s: 60, offload: " + offload + ", offload_dir: '" + dir.path() +
           "/state'}\n";
  };
  const auto none = test::run_ranks_inprocess(parse_job_spec(yaml("none"), "job.yaml", {}), 1);
  const auto nvme = test::run_ranks_inprocess(parse_job_spec(yaml("nvme"), "job.yaml", {}), 1);
  CHECK(nvme[0].losses == none[0].losses);
  CHECK(test::weights_of(dir / "nvme") == test::weights_of(dir / "none"));
  // Nothing is left in offload_dir (the state file is unlinked once open).
  REQUIRE(std::filesystem::is_directory(dir / "state"));
  CHECK(std::filesystem::is_empty(dir / "state"));
  std::ifstream f(dir / "nvme/metrics.jsonl");
  std::string line, last;
  while (std::getline(f, line)) last = line;
  CHECK_THAT(last, Contains("\"mem_nvme_bytes\"") && Contains("\"mem_optimizer_bytes\":0"));
}

TEST_CASE("offload nvme: a short read and a full disk name the path", "[offload]") {
  test::TempDir dir("offload_io");
  const std::string path = dir / "short.state";
  std::ofstream(path) << "0123456789";
  const int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  char buf[64];
  pread_full(fd, path, buf, 10, 0);  // all there
  try {
    pread_full(fd, path, buf, 64, 0);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains("short read of " + path) && Contains("resume from the last checkpoint"));
  }
  ::close(fd);
  // /dev/full answers every write with ENOSPC.
  const int full = ::open("/dev/full", O_WRONLY);
  if (full >= 0) {
    try {
      pwrite_full(full, "/dev/full", buf, 64, 0);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK_THAT(std::string(e.what()), Contains("the disk of /dev/full is full") && Contains("parallel.offload_dir"));
    }
    ::close(full);
  }
}

TEST_CASE("offload: resume across offload settings continues exactly", "[offload]") {
  // 10 steps without offload, then 10 with, against 20 without; and the
  // reverse. The checkpoint is the same logical state either way.
  test::TempDir dir("offload_resume");
  for (const char* strategy : {"no_shard", "full_shard"}) {
    for (int world : {1, 2}) {
      SECTION(std::string(strategy) + " x" + std::to_string(world)) {
        const std::string straight = dir / (std::string("straight_") + strategy + std::to_string(world));
        test::run_ranks_inprocess(test::checkpoint_job(straight, strategy, world), world);
        for (const auto& [first, second] :
             {std::pair<std::string, std::string>{"none", "cpu"}, {"cpu", "none"}, {"nvme", "cpu"}, {"none", "nvme"}}) {
          INFO(first << " then " << second);
          const std::string resumed =
              dir / (std::string("resumed_") + strategy + std::to_string(world) + first + "_" + second);
          const std::string odir = "parallel.offload_dir=" + dir / "state";
          test::run_ranks_inprocess(test::checkpoint_job(resumed, strategy, world,
                                                         {"train.exit_interval=10", "parallel.offload=" + first, odir}),
                                    world);
          REQUIRE(test::latest_of(resumed) == "step_00000010");
          test::run_ranks_inprocess(
              test::checkpoint_job(resumed, strategy, world, {"parallel.offload=" + second, odir}), world);
          CHECK(test::losses_of(resumed) == test::losses_of(straight));
          CHECK(test::weights_of(resumed) == test::weights_of(straight));
        }
      }
    }
  }
}

TEST_CASE("offload: bad inputs name the key or path", "[offload]") {
  test::TempDir dir("offload_bad");
  const std::string base = job_yaml(dir.path(), "full_shard", 0, "none");
  // nvme without offload_dir: the spec's validation names the key.
  try {
    parse_job_spec(base, "job.yaml", {"parallel.offload=nvme"});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains("parallel.offload_dir") && Contains("nvme"));
  }
  // An unknown mode names the key and the choices.
  try {
    parse_job_spec(job_yaml(dir.path(), "full_shard", 0, "gpu"), "job.yaml", {});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains("parallel.offload"));
  }
  // An unwritable directory: the error names it (read-only parent; root
  // ignores permissions, so the check is skipped there).
  if (geteuid() != 0) {
    const std::string ro = dir / "ro";
    std::filesystem::create_directories(ro);
    chmod(ro.c_str(), 0500);
    try {
      check_offload_dir(ro + "/state");
      FAIL("no error");
    } catch (const Error& e) {
      CHECK_THAT(std::string(e.what()), Contains(ro + "/state") && Contains("parallel.offload_dir"));
    }
    try {
      check_offload_dir(ro);
      FAIL("no error");
    } catch (const Error& e) {
      CHECK_THAT(std::string(e.what()), Contains("'" + ro + "' is not writable"));
    }
    chmod(ro.c_str(), 0700);
  }
  // A file where the directory should be.
  const std::string file = dir / "file";
  std::ofstream(file) << "x";
  try {
    check_offload_dir(file);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains(file));
  }
  check_offload_dir(dir / "ok");  // a writable one passes
}

TEST_CASE("offload: the host memory check and the memlock warning say what to do", "[offload]") {
  try {
    check_offload_host_memory(size_t(1130) * 1000 * 1000 * 1000, size_t(512) * 1000 * 1000 * 1000, 8);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains("needs 1.13 TB of host memory on this node") &&
                                          Contains("it has 512 GB") && Contains("use parallel.offload: nvme or more nodes"));
  }
  check_offload_host_memory(100, 200, 1);
  check_offload_host_memory(100, 0, 1);  // unknown: not checked
  CHECK(memlock_warning(1 << 20, uint64_t(8) << 20).empty());
  CHECK_THAT(memlock_warning(size_t(64) << 30, uint64_t(8) << 20),
             Contains("RLIMIT_MEMLOCK") && Contains("ulimit -l") && Contains("unpinned"));
  CHECK(host_memory_available() > 0);
}

// ---- the state itself against the device path (issue #17's remaining parts) ----

namespace {

std::vector<float> random_vec(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Restores TRAINRUN_OFFLOAD_IO when a test is done with it.
struct IoEnv {
  explicit IoEnv(const char* v) {
    if (v) setenv("TRAINRUN_OFFLOAD_IO", v, 1);
    else unsetenv("TRAINRUN_OFFLOAD_IO");
  }
  ~IoEnv() { unsetenv("TRAINRUN_OFFLOAD_IO"); }
};

}  // namespace

TEST_CASE("offload: host state = the device path bit for bit (cpu, nvme on io_uring and on the pool, many chunks)",
          "[offload]") {
  // n spans 10 chunks of 1024 and 2 threads' static blocks that straddle
  // chunks; the units are added in backward order, twice per step
  // (accumulation), and unit {4100, 3000} only at step 1, so its pages hold
  // a stale gradient on disk afterwards that must read as zero.
  auto be = make_cpu_backend(2);
  const int64_t n = 10037;
  struct Unit {
    int64_t off, n;
  };
  const std::vector<Unit> units = {{0, 1500}, {1500, 2600}, {4100, 3000}, {7100, 2937}};
  const std::vector<std::pair<int64_t, int64_t>> skip = {{100, 50}, {3000, 2000}, {9000, 10}};
  const std::vector<OffloadSegment> segments = {{0, 4100, 0.1f}, {4100, 3000, 0.0f}, {7100, 2937, 0.1f}};
  test::TempDir dir("offload_state");
  struct Cfg {
    const char* name;
    OffloadMode mode;
    IoChoice io;
  };
  std::vector<Cfg> cfgs = {{"cpu", OffloadMode::Cpu, IoChoice::Auto}, {"nvme pool", OffloadMode::Nvme, IoChoice::Pool}};
  if (io_uring_built_in()) cfgs.push_back({"nvme io_uring", OffloadMode::Nvme, IoChoice::Uring});
  else WARN("liburing is not built in: the io_uring engine is not tested");
  for (const Cfg& cfg : cfgs) {
    SECTION(cfg.name) {
      OffloadOptions o;
      o.mode = cfg.mode;
      o.dir = dir / "state";
      o.threads = 2;
      o.chunk_elements = 1024;  // the step walks 10 chunks, the norm 3 (4 chunks each)
      o.io = cfg.io;
      HostOptimizerState h(be.get(), n, o);
      if (cfg.mode == OffloadMode::Nvme) CHECK(std::string(h.io_engine()) == (cfg.io == IoChoice::Pool ? "pool" : "io_uring"));
      // The device path's state (the CPU backend's buffers are host memory).
      std::vector<float> master = random_vec(n, 1, -1, 1), m = random_vec(n, 2, -0.1f, 0.1f),
                         v = random_vec(n, 3, 0, 0.01f), grad(n, 0.0f), act(n, 0.0f);
      h.write_state(0, 0, master.data(), n);
      h.write_state(1, 0, m.data(), n);
      h.write_state(2, 0, v.data(), n);
      for (int step = 1; step <= 3; ++step) {
        INFO("step " << step);
        h.zero_grads();
        std::fill(grad.begin(), grad.end(), 0.0f);
        for (int micro = 0; micro < 2; ++micro)
          for (int u = int(units.size()) - 1; u >= 0; --u) {
            if (u == 2 && step > 1) continue;
            const std::vector<float> g = random_vec(size_t(units[u].n), uint32_t(100 * step + 10 * micro + u), -1, 1);
            be->accumulate(grad.data() + units[u].off, g.data(), units[u].n);
            h.add_grad_from_device(units[u].off, g.data(), units[u].n);
          }
        // The norm, whole and with skipped ranges (tensor parallelism).
        float whole = 0;
        be->sum_squares(&whole, grad.data(), n);
        CHECK(h.grad_sum_squares({{0, n}}) == whole);
        float parts = 0;
        sum_squares_skipping(be.get(), &parts, grad.data(), 0, n, skip);
        CHECK(h.grad_sum_squares(unskipped_pieces(0, n, skip)) == parts);
        CHECK(parts < whole);
        for (const OffloadSegment& s : segments)
          be->adamw_update(master.data() + s.off, master.data() + s.off, grad.data() + s.off, m.data() + s.off,
                           v.data() + s.off, s.n, 1e-2f, 0.9f, 0.95f, 1e-8f, s.weight_decay, step, 0.7f);
        h.step(segments, 1e-2f, 0.9f, 0.95f, 1e-8f, step, 0.7f, act.data());
        CHECK(act == master);
        std::vector<float> got(n);
        h.read_state(0, 0, got.data(), n);
        CHECK(got == master);
        h.read_state(1, 0, got.data(), n);
        CHECK(got == m);
        h.read_state(2, 0, got.data(), n);
        CHECK(got == v);
      }
      // A replicated gradient (no_shard, hybrid_shard) replaces it whole.
      const std::vector<float> g = random_vec(size_t(n), 7, -2, 2);
      h.grad_from_device(g.data(), n);
      float want = 0;
      be->sum_squares(&want, g.data(), n);
      CHECK(h.grad_sum_squares({{0, n}}) == want);
      if (cfg.mode == OffloadMode::Nvme) {
        CHECK(h.host_bytes() == offload_nvme_host_bytes(1024));  // bounded, not 16 bytes per element
        CHECK(h.disk_bytes() == 4 * size_t(10240) * 4);           // 4 kinds of 10037 rounded up to pages
        CHECK(std::filesystem::is_empty(o.dir));  // unlinked as soon as it was open
      }
    }
  }
}

TEST_CASE("offload nvme: io_uring and the pread/pwrite pool train to the same bits as offload none", "[offload]") {
  for (const char* strategy : {"no_shard", "full_shard"}) {
    SECTION(strategy) {
      const RunOut none = run(2, strategy, 0, "none");
      RunOut pool, uring;
      {
        IoEnv env("pool");
        pool = run(2, strategy, 0, "nvme");
      }
      {
        IoEnv env(io_uring_built_in() ? "uring" : nullptr);
        uring = run(2, strategy, 0, "nvme");
      }
      CHECK(pool.losses == none.losses);
      CHECK(pool.weights == none.weights);
      CHECK(uring.losses == none.losses);
      CHECK(uring.weights == none.weights);
    }
  }
}

TEST_CASE("offload nvme: a kernel that refuses io_uring falls back to the pool, or fails when uring was asked for",
          "[offload]") {
  if (!io_uring_built_in()) {
    WARN("liburing is not built in: nothing to fall back from");
    return;
  }
  auto be = make_cpu_backend(1);
  test::TempDir dir("offload_refuse");
  OffloadOptions o;
  o.mode = OffloadMode::Nvme;
  o.dir = dir.path();
  o.threads = 1;
  setenv("TRAINRUN_DEBUG_OFFLOAD_NO_URING", "1", 1);
  {
    HostOptimizerState h(be.get(), 5000, o);
    CHECK(std::string(h.io_engine()) == "pool");
  }
  o.io = IoChoice::Uring;
  CHECK_THROWS_WITH(HostOptimizerState(be.get(), 5000, o),
                    Contains("TRAINRUN_OFFLOAD_IO=uring: the kernel refused an io_uring ring") &&
                        Contains("Operation not permitted"));
  unsetenv("TRAINRUN_DEBUG_OFFLOAD_NO_URING");
  HostOptimizerState h(be.get(), 5000, o);
  CHECK(std::string(h.io_engine()) == "io_uring");
}

TEST_CASE("offload: TRAINRUN_OFFLOAD_IO takes auto, uring, pool and names itself otherwise", "[offload]") {
  CHECK(parse_io_choice("") == IoChoice::Auto);
  CHECK(parse_io_choice("pool") == IoChoice::Pool);
  CHECK(parse_io_choice("uring") == IoChoice::Uring);
  CHECK_THROWS_WITH(parse_io_choice("threads"), Contains("TRAINRUN_OFFLOAD_IO") && Contains("auto, uring, pool"));
  IoEnv env("bogus");
  test::TempDir dir("offload_ioenv");
  JobSpec job = parse_job_spec(job_yaml(dir.path(), "full_shard", 0, "nvme"), "job.yaml", {"train.max_steps=1"});
  CHECK_THROWS_WITH(test::run_ranks_inprocess(job, 1), Contains("TRAINRUN_OFFLOAD_IO: 'bogus'"));
}

// ---- tensor parallelism ------------------------------------------------------

namespace {

// Gradient clipping on, so the host norm must count every element once:
// GPT-2 (replicated LayerNorms and biases) and Llama with one KV head
// (replicated across the TP group at tp2), a vocabulary padded at tp2.
std::string tp_offload_yaml(const std::string& dir, const std::string& model, const std::string& strategy, int tp,
                            int group, const std::string& offload) {
  return "model: " + model + "\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 2, max_steps: 4, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 2, eval_interval: 0, log_interval: 1, grad_clip: 0.3, weight_decay: 0.1}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: " + strategy + ", shard_group_size: " + std::to_string(group) +
         ", tensor_parallel: " + std::to_string(tp) + ", timeout_s: 60, offload: " + offload +
         (offload == "nvme" ? ", offload_dir: '" + dir + "/nvme'" : "") + "}\n";
}

}  // namespace

TEST_CASE("offload cpu and nvme with tensor parallelism: tp2 and tp2 x dp2 train as offload none does", "[offload][tp]") {
  const std::string gpt2 = "{arch: gpt2, n_layer: 2, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 8}";
  const std::string llama = "{arch: llama, n_layer: 2, n_head: 4, n_kv_head: 1, n_embd: 16, ffn_dim: 24, "
                            "vocab_size: 23, seq_len: 8, tie_embeddings: false}";
  struct Mesh {
    int world;
    const char* strategy;
    int group;
  };
  for (const auto& [name, model] : {std::pair<std::string, std::string>{"gpt2", gpt2}, {"llama kv1", llama}}) {
    for (const Mesh& mesh : {Mesh{2, "full_shard", 0}, Mesh{4, "no_shard", 0}, Mesh{4, "shard_grad_op", 0},
                             Mesh{4, "full_shard", 0}, Mesh{4, "hybrid_shard", 1}}) {
      SECTION(name + " world " + std::to_string(mesh.world) + " tp2 " + mesh.strategy) {
        auto go = [&](const std::string& offload) {
          test::TempDir dir("offload_tp");
          const JobSpec job =
              parse_job_spec(tp_offload_yaml(dir.path(), model, mesh.strategy, 2, mesh.group, offload), "job.yaml", {});
          RunOut out;
          out.per_rank = test::run_ranks_inprocess(job, mesh.world);
          out.losses = out.per_rank[0].losses;
          load_model_safetensors(dir / "model.safetensors", out.weights);
          return out;
        };
        const RunOut none = go("none");
        REQUIRE(none.losses.size() == 4);
        for (const char* offload : {"cpu", "nvme"}) {
          INFO("offload " << offload);
          const RunOut got = go(offload);
          REQUIRE(got.losses.size() == none.losses.size());
          for (size_t i = 0; i < none.losses.size(); ++i) {
            INFO("step " << i + 1 << ": " << got.losses[i] << " vs " << none.losses[i]);
            CHECK(std::fabs(got.losses[i] - none.losses[i]) <= 1e-6 * std::fabs(none.losses[i]));
          }
          // In fact the same bits: host AdamW and the host norm are the device path's.
          CHECK(got.losses == none.losses);
          CHECK(got.weights == none.weights);
          for (const TrainSummary& r : got.per_rank) CHECK(r.optimizer_bytes == 0);
        }
      }
    }
  }
}

// ---- kill -9 in the middle of an nvme step, then a resume -----------------------

namespace {

// step -> loss of a run's metrics.jsonl; a resumed run's lines replace the
// lost run's for the steps it repeats.
std::map<int, double> losses_by_step(const std::string& run_dir) {
  std::map<int, double> out;
  std::ifstream f(run_dir + "/metrics.jsonl");
  for (std::string l; std::getline(f, l);) {
    const auto s = l.find("\"step\":"), p = l.find("\"loss\":");
    if (s != std::string::npos && p != std::string::npos) out[std::stoi(l.substr(s + 7))] = std::stod(l.substr(p + 7));
  }
  return out;
}

}  // namespace

TEST_CASE("offload nvme: a worker killed by SIGKILL mid-step leaves no state files, and the resume continues exactly",
          "[offload]") {
  // Two worker processes (the agent's), full_shard, a checkpoint every 4
  // steps; rank 1 raises SIGKILL inside the optimizer step of step 6, after
  // the first chunk's write of its state file was submitted.
  test::TempDir dir("offload_kill");
  const std::string run = dir / "run", state = dir / "state";
  test::write_file(dir / "job.yaml", test::checkpoint_job_yaml(run, "full_shard", "checkpoint: {interval: 4}\n"));
  const std::string trainrun = "OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config " + dir / "job.yaml" +
                               " --set parallel.nproc_per_node=2 --set train.max_steps=10 --set parallel.offload=nvme"
                               " --set parallel.offload_dir=" + state;
  auto r = test::run_command(trainrun + " --set output.dir=" + dir / "straight");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  r = test::run_command("TRAINRUN_DEBUG_OFFLOAD_KILL=1:6 " + trainrun);
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("rank 1 (pid ") && Contains("killed by signal SIGKILL (9)") &&
                       Contains("debug: SIGKILL in the nvme optimizer step of step 6 on rank 1"));
  // The state files were unlinked when opened: nothing is left, on either rank.
  REQUIRE(std::filesystem::is_directory(state));
  CHECK(std::filesystem::is_empty(state));
  REQUIRE(test::latest_of(run) == "step_00000004");
  // The resume loads step 4 and ends where the uninterrupted run ended.
  r = test::run_command(trainrun);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("resume: loaded " + run + "/checkpoints/step_00000004"));
  CHECK(std::filesystem::is_empty(state));
  const std::map<int, double> straight = losses_by_step(dir / "straight"), resumed = losses_by_step(run);
  REQUIRE(straight.size() == 10);
  CHECK(resumed == straight);
  CHECK(test::weights_of(run) == test::weights_of(dir / "straight"));
}

// Backend::copy_to_host_chunks, which offload's gradient copies go
// through: the default (any backend: through copy_to_host, 4 MiB at a
// time) and the CPU's (its device memory is host memory: one chunk, no
// copy) hand every byte over once, in order, at its offset. The CUDA
// backend's (pinned landing buffers, a copy stream) is in test_cuda_ops.
TEST_CASE("offload: the chunked device->host copy hands over every byte once, in order", "[offload]") {
  auto be = make_cpu_backend(2);
  const size_t mib4 = size_t(4) << 20, bytes = 2 * mib4 + (size_t(1) << 20) + 12;  // 2 whole chunks + a part
  std::vector<unsigned char> src(bytes);
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<unsigned char>((i * 131 + i / 4096 + 7) & 0xff);
  DeviceBuffer dev(be.get(), bytes);
  be->copy_to_device(dev.get(), src.data(), bytes);
  for (bool base : {true, false}) {
    INFO((base ? "Backend's default" : "the CPU backend's"));
    std::vector<unsigned char> got(bytes, 0);
    std::vector<std::pair<size_t, size_t>> calls;
    auto sink = [&](const void* chunk, size_t off, size_t n) {
      calls.push_back({off, n});
      std::memcpy(got.data() + off, chunk, n);
    };
    if (base) be->Backend::copy_to_host_chunks(dev.get(), bytes, nullptr, sink);
    else be->copy_to_host_chunks(dev.get(), bytes, nullptr, sink);
    CHECK(got == src);
    using Calls = std::vector<std::pair<size_t, size_t>>;
    if (base) CHECK(calls == Calls{{0, mib4}, {mib4, mib4}, {2 * mib4, bytes - 2 * mib4}});
    else CHECK(calls == Calls{{0, bytes}});
    calls.clear();
    if (base) be->Backend::copy_to_host_chunks(dev.get(), 0, nullptr, sink);
    else be->copy_to_host_chunks(dev.get(), 0, nullptr, sink);
    CHECK(calls.empty());
  }
}
