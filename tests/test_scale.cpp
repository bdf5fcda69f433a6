// What real runs at scale depend on, checked on the CPU with tiny models
// (and one 102M-parameter one):
//  - a collective that fails after its call returned (NCCL's way) stops the
//    step before the optimizer update and before any checkpoint commit, with
//    an error naming the group, rank and step; the last good checkpoint
//    resumes to the same losses as an uninterrupted run;
//  - a parameter store destroyed while an exception unwinds drops its queued
//    collectives instead of running them (against members already gone, or
//    waiting out their timeouts);
//  - the final weights are written by every rank for its own ranges: one
//    rank's failure fails every rank at once and leaves no file behind;
//  - no rank's host memory exceeds its backend share by more than a third
//    of one model copy (the whole model is never gathered), on a 102M model.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <regex>
#include <sstream>
#include <thread>

#include "core/model/gpt2/gpt2.h"
#include "kernels/backend.h"
#include "parallel/sharding/sharding.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Matchers::Contains;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::vector<std::string> loss_lines(const std::string& metrics) {
  std::vector<std::string> out;
  std::istringstream in(metrics);
  for (std::string l; std::getline(in, l);) {
    const size_t a = l.find("\"loss\":");
    if (a == std::string::npos) continue;
    out.push_back(l.substr(0, l.find(',', a)));  // {"step":N,...,"loss":X
  }
  return out;
}

std::string hybrid_job(const std::string& run, int steps) {
  return "model: {n_layer: 2, n_head: 2, n_embd: 16, vocab_size: 32, seq_len: 16}\n"
         "data: {format: synthetic}\n"
         "train: {global_batch_size: 8, micro_batch_size: 1, max_steps: " + std::to_string(steps) +
         ", log_interval: 1, eval_interval: 0, eval_steps: 1, warmup_steps: 1}\n"
         "parallel: {nproc_per_node: 4, sharding: hybrid_shard, shard_group_size: 2, timeout_s: 60}\n"
         "checkpoint: {interval: 1}\n"
         "output: {dir: '" + run + "', sample_tokens: 0}\n";
}

}  // namespace

TEST_CASE("scale: a replica all-reduce that fails after returning stops the step before its update and commit",
          "[scale][faults]") {
  test::TempDir dir("scale");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml", hybrid_job(run, 5));
  // Rank 1's replica group (ranks 1 and 3) loses its step-3 gradient all-reduce.
  const auto t0 = Clock::now();
  auto r = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_COMM_FAULT=dp_replicate:1:3 '" + test::trainrun_binary() +
                             "' --config '" + dir / "job.yaml" + "'");
  const double took = seconds_since(t0);
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(took < 30);  // well inside parallel.timeout_s: nobody waits out a collective
  CHECK_THAT(r.err, Contains("rank 1") && Contains("group dp_replicate") && Contains("step 3") &&
                        Contains("injected failure"));
  // Steps 1 and 2 were committed; step 3's half-reduced state never was.
  CHECK(fs::exists(run + "/checkpoints/step_00000002/manifest.json"));
  CHECK_FALSE(fs::exists(run + "/checkpoints/step_00000003"));
  CHECK(test::read_file(run + "/checkpoints/latest") == "step_00000002\n");

  // The last good checkpoint resumes; the run ends with the losses of a run
  // that never failed.
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("resume: loaded") && Contains("step_00000002"));
  const std::string clean = dir / "clean";
  test::write_file(dir / "clean.yaml", hybrid_job(clean, 5));
  r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir / "clean.yaml" + "'");
  REQUIRE(r.exit_code == 0);
  const auto resumed = loss_lines(test::read_file(run + "/metrics.jsonl"));
  const auto uninterrupted = loss_lines(test::read_file(clean + "/metrics.jsonl"));
  REQUIRE(uninterrupted.size() == 5);
  CHECK(resumed == uninterrupted);
}

namespace {

// Two ranks' worth of a communicator inside one process: this is rank 0 and
// "the peer" contributes zeros. Every reduce-scatter takes `delay`, and each
// call is counted with the time it started.
class SlowComm final : public Communicator {
 public:
  explicit SlowComm(std::chrono::milliseconds delay) : delay_(delay) {}
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::string name() const override { return "slow-test"; }
  void all_reduce(float*, int64_t, ReduceOp) override {}
  void reduce_scatter(float* out, const float* in, int64_t n, ReduceOp) override {
    starts.push_back(Clock::now());
    std::this_thread::sleep_for(delay_);
    std::copy(in, in + n, out);
  }
  void all_gather(void* out, const void* in, size_t bytes) override {
    std::memcpy(out, in, bytes);
    std::memset(static_cast<char*>(out) + bytes, 0, bytes);
  }
  void broadcast(void*, size_t, int) override {}
  void barrier() override {}
  std::vector<Clock::time_point> starts;  // written by the store's comm thread only

 private:
  std::chrono::milliseconds delay_;
};

}  // namespace

TEST_CASE("scale: a sharded store destroyed while unwinding drops its queued collectives", "[scale][faults]") {
  const GPT2Config cfg = GPT2Config::of(6, 2, 16, 32, 8);
  auto be = make_cpu_backend(1);
  SlowComm comm(std::chrono::milliseconds(300));
  const ParamLayout lay = make_gpt2_layout(cfg);
  Clock::time_point destroying;
  try {
    auto store = make_param_store("full_shard", lay, be.get(), &comm, 0, nullptr);
    // A backward's reduce-scatters, head first: each is queued on the comm
    // thread (the store lets two wait at a time, so some run meanwhile).
    for (int u = int(lay.units.size()) - 1; u >= 1; --u) {
      store->unit_grads(u);
      store->grads_done(u);
    }
    destroying = Clock::now();
    throw Error("a collective failed (test)");  // the store is destroyed while this unwinds
  } catch (const Error&) {
  }
  const double took = seconds_since(destroying);
  size_t after = 0;
  for (const auto& t : comm.starts) after += t >= destroying;
  INFO("reduce-scatters started after destruction began: " << after << "; destruction took " << took << " s");
  CHECK(after == 0);
  CHECK(took < 0.5);  // at most the one in progress (300 ms), never the queue
}

TEST_CASE("scale: a rank that fails writing the final weights fails every rank at once, leaving no file",
          "[scale][faults]") {
  test::TempDir dir("scale");
  const std::string run = dir / "run";
  test::write_file(dir / "job.yaml",
                   "model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 32, seq_len: 16}\n"
                   "data: {format: synthetic}\n"
                   "train: {global_batch_size: 6, micro_batch_size: 1, max_steps: 2, eval_steps: 1, warmup_steps: 1}\n"
                   "parallel: {nproc_per_node: 3, sharding: full_shard, timeout_s: 60}\n"
                   "checkpoint: {final: 'false'}\n"
                   "output: {dir: '" + run + "', sample_tokens: 0}\n");
  const auto t0 = Clock::now();
  auto r = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_FINAL_WEIGHTS_FAIL_RANK=1 '" +
                             test::trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(seconds_since(t0) < 30);
  CHECK_THAT(r.err, Contains("final weights") && Contains("rank 1: injected failure") &&
                        Contains("model.safetensors"));
  CHECK_FALSE(fs::exists(run + "/model.safetensors"));
  for (const auto& e : fs::directory_iterator(run))
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
}

namespace {
// One 1-step full_shard job on 4 ranks; each rank's (backend peak, process
// peak RSS) from its log's "memory at the end" line.
std::vector<std::pair<double, double>> rank_memory(const std::string& dir, int L, int C, int V) {
  const std::string run = dir + "/run";
  test::write_file(dir + "/job.yaml",
                   "model: {n_layer: " + std::to_string(L) + ", n_head: 16, n_embd: " + std::to_string(C) +
                       ", vocab_size: " + std::to_string(V) + ", seq_len: 32}\n"
                   "data: {format: synthetic, synthetic: {vocab: 512}}\n"
                   "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 1, eval_steps: 1, warmup_steps: 0}\n"
                   "parallel: {nproc_per_node: 4, sharding: full_shard, timeout_s: 600}\n"
                   "output: {dir: '" + run + "', sample_tokens: 0}\n");
  auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir + "/job.yaml'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::regex line(R"(memory at the end \(rank (\d)\): backend peak (\d+) bytes .*process peak RSS (\d+) bytes)");
  std::vector<std::pair<double, double>> out;
  for (int k = 0; k < 4; ++k) {
    const std::string log = test::read_file(run + "/logs/rank" + std::to_string(k) + ".log");
    std::smatch m;
    REQUIRE(std::regex_search(log, m, line));
    out.push_back({std::stod(m[2]), std::stod(m[3])});
  }
  return out;
}
}  // namespace

TEST_CASE("scale: a 102M GPT-2 on 4 full_shard ranks: no rank's host memory holds the model", "[scale][memory]") {
  // The issue's acceptance bound: every rank's peak RSS (VmHWM) <= its
  // backend peak + 35% of one fp32 model copy + the process's fixed cost.
  // Gathering the model at the end (as before) put each rank one whole
  // copy over its backend peak. The fixed cost (binary, libraries, Gloo,
  // allocator) is measured, not assumed: the same job on a 0.2M model
  // gives it, plus 64 MB for the allocator's noise. Then a 102M model
  // (the 354M one's width and vocabulary, 4 layers: 408 MB in fp32) shows
  // the same invariant: a whole copy (408 MB) is far past the bound's
  // 0.35 copy + 64 MB (207 MB), as it was past 0.35 copy + 300 MB at 354M.
  test::TempDir dir("scale");
  std::filesystem::create_directories(dir / "tiny");
  std::filesystem::create_directories(dir / "big");
  double fixed = 0;
  for (const auto& [backend, rss] : rank_memory(dir / "tiny", 2, 64, 512)) fixed = std::max(fixed, rss - backend);
  const int L = 4, C = 1024, V = 50304;
  const double model_bytes = 4.0 * double(GPT2Config::of(L, 16, C, V, 32).num_parameters());
  CHECK(model_bytes > 4e8);
  const auto ranks = rank_memory(dir / "big", L, C, V);
  REQUIRE(ranks.size() == 4);
  for (size_t k = 0; k < ranks.size(); ++k) {
    const auto [backend, rss] = ranks[k];
    const double bound = backend + 0.35 * model_bytes + fixed + 64e6;
    std::printf("  rank %zu: peak RSS %.3f GB, backend peak %.3f GB, over it %.0f MB (fixed cost %.0f MB, bound %.0f "
                "MB over, a whole copy %.0f MB)\n",
                k, rss / 1e9, backend / 1e9, (rss - backend) / 1e6, fixed / 1e6, (bound - backend) / 1e6,
                model_bytes / 1e6);
    INFO("rank " << k << ": peak RSS " << rss / 1e9 << " GB, backend peak " << backend / 1e9 << " GB, bound "
                 << bound / 1e9 << " GB");
    CHECK(rss <= bound);
  }
  // The weights were written (every rank's ranges) and read back as a model.
  CHECK(fs::file_size(dir / "big/run/model.safetensors") > size_t(model_bytes));
}
