// The cross-group enqueue order (parallel/comm/enqueue_order.h): every rank
// issues the calls of all its communicators in one order that every rank
// shares, so NCCL communicators on their own streams cannot wait on each
// other in a cycle. Checked with the recorder (comm_record.h) on whole
// training runs at tp2 x dp2 and pp2 x dp2, where the sharded store's comm
// thread and the compute thread both issue calls; and the ticket lock
// itself, with a comm thread that is slow to start its task.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <mutex>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/config/job_spec.h"
#include "parallel/comm/comm_record.h"
#include "parallel/comm/comm_worker.h"
#include "parallel/comm/enqueue_order.h"
#include "tests/support/inprocess.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

TEST_CASE("enqueue order: a task submitted before a direct call runs first, whichever thread is ready first",
          "[comm][order]") {
  EnqueueOrder order;
  CommWorker worker;
  worker.set_order(&order);
  std::mutex mu;
  std::vector<std::string> seen;
  auto note = [&](const std::string& s) {
    std::lock_guard<std::mutex> lk(mu);
    seen.push_back(s);
  };
  for (int round = 0; round < 3; ++round) {
    // The task is submitted first but sleeps before it "enqueues"; the
    // direct call after it must still wait for its turn.
    auto f = worker.submit([&, round] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      note("task" + std::to_string(round));
    });
    {
      EnqueueOrder::Turn t(&order);
      note("direct" + std::to_string(round));
      EnqueueOrder::Turn nested(&order);  // nested in the caller's turn: no new ticket, no wait
    }
    f.get();
  }
  CHECK(seen == std::vector<std::string>{"task0", "direct0", "task1", "direct1", "task2", "direct2"});
  CHECK(order.tickets_issued() == 6);
}

TEST_CASE("enqueue order: a dropped task gives its turn back (no later call waits for it)", "[comm][order]") {
  EnqueueOrder order;
  std::atomic<bool> ran{false};
  {
    CommWorker worker;
    worker.set_order(&order);
    std::promise<void> gate, started;
    std::shared_future<void> open = gate.get_future().share();
    auto first = worker.submit([open, &started] {
      started.set_value();
      open.wait();
    });
    started.get_future().wait();  // running, so cancel_pending drops only the second
    worker.submit([&] { ran = true; });  // queued behind `first`, dropped below
    worker.cancel_pending();
    gate.set_value();
    first.get();
  }
  CHECK(!ran);
  // Both tickets are done: a new call gets its turn at once.
  std::atomic<bool> got{false};
  std::thread t([&] {
    EnqueueOrder::Turn turn(&order);
    got = true;
  });
  t.join();
  CHECK(got);
}

namespace {

std::string job_yaml(const std::string& dir, const std::string& mesh) {
  return "model: {arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 23, "
         "seq_len: 8}\n"
         "data: {format: synthetic, synthetic: {vocab: 23, branching: 3}}\n"
         "train: {global_batch_size: 8, micro_batch_size: 1, max_steps: 3, lr: 3.0e-3, eval_interval: 2, "
         "eval_steps: 1, log_interval: 1, grad_clip: 0.3}\n"
         "output: {dir: '" + dir + "', sample_tokens: 0}\n"
         "parallel: {sharding: full_shard, timeout_s: 60, " + mesh + "}\n";
}

struct RecordEnv {
  RecordEnv() { ::setenv("TRAINRUN_DEBUG_COMM_RECORD", "1", 1); take_comm_records(); }
  ~RecordEnv() { ::unsetenv("TRAINRUN_DEBUG_COMM_RECORD"); take_comm_records(); }
};

// The calls of `rank` on communicators other than the Gloo pipeline links
// (which send from sender threads outside the order, by design).
std::vector<CommRecord> ordered_calls(const std::map<int, std::vector<CommRecord>>& all, int rank) {
  std::vector<CommRecord> out;
  auto it = all.find(rank);
  if (it == all.end()) return out;
  for (const CommRecord& r : it->second)
    if (r.group.find(".link") == std::string::npos) out.push_back(r);
  return out;
}

std::vector<std::string> keys(const std::vector<CommRecord>& calls, const std::set<std::string>& groups = {}) {
  std::vector<std::string> k;
  for (const CommRecord& r : calls)
    if (groups.empty() || groups.count(r.group)) k.push_back(r.group + "|" + r.key());
  return k;
}

// For every two ranks: the calls on the groups both belong to come in the
// same order on both (a cycle between two ranks needs two shared groups
// seen in opposite orders), and `same_program` ranks issue the same
// sequence of (group kind, op, bytes).
void check_orders(int world, const std::vector<std::vector<int>>& same_program) {
  const auto all = take_comm_records();
  REQUIRE(int(all.size()) == world);
  std::vector<std::vector<CommRecord>> calls(world);
  std::vector<std::set<std::string>> groups(world);
  for (int r = 0; r < world; ++r) {
    calls[r] = ordered_calls(all, r);
    for (const CommRecord& c : calls[r]) groups[r].insert(c.group);
    INFO("rank " << r);
    CHECK(groups[r].size() >= 3);  // world, and the mesh's groups
  }
  for (int a = 0; a < world; ++a)
    for (int b = a + 1; b < world; ++b) {
      std::set<std::string> shared;
      for (const std::string& g : groups[a])
        if (groups[b].count(g)) shared.insert(g);
      if (shared.size() < 2) continue;
      INFO("ranks " << a << " and " << b << ", " << shared.size() << " shared groups");
      const auto ka = keys(calls[a], shared), kb = keys(calls[b], shared);
      REQUIRE(ka.size() == kb.size());
      for (size_t i = 0; i < ka.size(); ++i) {
        INFO("call " << i);
        REQUIRE(ka[i] == kb[i]);
      }
    }
  for (const auto& ranks : same_program) {
    std::vector<std::string> k0;
    for (const CommRecord& c : calls[ranks[0]]) k0.push_back(c.key());
    for (size_t i = 1; i < ranks.size(); ++i) {
      std::vector<std::string> ki;
      for (const CommRecord& c : calls[ranks[i]]) ki.push_back(c.key());
      INFO("rank " << ranks[0] << " vs rank " << ranks[i]);
      REQUIRE(ki.size() == k0.size());
      for (size_t j = 0; j < k0.size(); ++j) {
        INFO("call " << j);
        REQUIRE(ki[j] == k0[j]);
      }
    }
  }
}

}  // namespace

TEST_CASE("enqueue order: at tp2 x dp2 (full_shard) every rank issues its tp, dp and world calls in one order",
          "[comm][order][tp]") {
  RecordEnv env;
  TempDir dir("order");
  const JobSpec job = parse_job_spec(job_yaml(dir.path(), "tensor_parallel: 2"), "job.yaml");
  run_ranks_inprocess(job, 4);
  // tp innermost: tp groups {0,1} {2,3}, dp groups {0,2} {1,3}; every rank
  // runs the same program.
  check_orders(4, {{0, 1, 2, 3}});
}

TEST_CASE("enqueue order: at pp2 x dp2 (full_shard, 1f1b) every rank issues its pp, dp and world calls in one order",
          "[comm][order][pp]") {
  RecordEnv env;
  TempDir dir("order");
  const JobSpec job = parse_job_spec(job_yaml(dir.path(), "pipeline_parallel: 2, pipeline_schedule: 1f1b"), "job.yaml");
  run_ranks_inprocess(job, 4);
  // pp outermost: stage 0 is ranks 0 and 1, stage 1 ranks 2 and 3; the
  // ranks of a stage run the same program.
  check_orders(4, {{0, 1}, {2, 3}});
}
