// Communicator tests: W ranks run as threads of this process, each with its
// own Gloo communicator (its own tcp device on 127.0.0.1) bootstrapped
// through one in-process store. Catch2 assertions are not thread-safe, so the
// rank threads only compute and record; the checks run on the main thread.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/common/error.h"
#include "parallel/comm/communicator.h"
#include "parallel/rendezvous/store.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace std::chrono_literals;

namespace {

// A trainrun::Store in memory: a map guarded by a mutex, with a condition
// variable for the blocking get/wait. Enough for threads of one process.
class MemStore : public Store {
 public:
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    std::lock_guard<std::mutex> lk(m_);
    kv_[key] = value;
    cv_.notify_all();
  }
  std::vector<uint8_t> get(const std::string& key, Millis timeout) override {
    std::unique_lock<std::mutex> lk(m_);
    if (!cv_.wait_for(lk, timeout, [&] { return kv_.count(key) > 0; }))
      TR_FAIL("store: key '", key, "' did not appear within ", timeout.count(), " ms");
    return kv_[key];
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lk(m_);
    auto& v = kv_[key];
    int64_t cur = v.empty() ? 0 : std::stoll(std::string(v.begin(), v.end()));
    cur += delta;
    std::string s = std::to_string(cur);
    v.assign(s.begin(), s.end());
    cv_.notify_all();
    return cur;
  }
  std::vector<uint8_t> compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired) override {
    std::lock_guard<std::mutex> lk(m_);
    auto it = kv_.find(key);
    if ((it == kv_.end() && expected.empty()) || (it != kv_.end() && it->second == expected)) {
      kv_[key] = desired;
      cv_.notify_all();
      return desired;
    }
    return it == kv_.end() ? std::vector<uint8_t>{} : it->second;
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lk(m_);
    return kv_.count(key) > 0;
  }
  bool remove(const std::string& key) override {
    std::lock_guard<std::mutex> lk(m_);
    return kv_.erase(key) > 0;
  }
  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    std::unique_lock<std::mutex> lk(m_);
    auto all = [&] {
      for (auto& k : keys)
        if (!kv_.count(k)) return false;
      return true;
    };
    if (!cv_.wait_for(lk, timeout, all)) {
      std::string missing;
      for (auto& k : keys)
        if (!kv_.count(k)) missing += " '" + k + "'";
      TR_FAIL("store: keys", missing, " did not appear within ", timeout.count(), " ms");
    }
  }
  size_t size() {
    std::lock_guard<std::mutex> lk(m_);
    return kv_.size();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> kv_;
};

// A fresh prefix per group, so groups never see each other's keys.
std::string fresh_prefix(const std::string& tag) {
  static std::atomic<int> n{0};
  return "test/" + tag + "/" + std::to_string(n++);
}

// Runs fn(comm) on W threads, one communicator each; rethrows the first
// exception (by rank) after all threads have finished.
void run_group(Store& store, int W, const std::function<void(Communicator&)>& fn,
               std::chrono::milliseconds timeout = 30s, const std::string& tag = "g") {
  const std::string prefix = fresh_prefix(tag);
  std::vector<std::exception_ptr> errors(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm = make_gloo_communicator(store, prefix, r, W, "127.0.0.1", timeout);
        fn(*comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Test data. Integer-valued floats (small magnitudes) make every fp32 sum
// exact, so Sum can be checked for equality; "real" values are arbitrary
// positive floats (no cancellation), checked to 1e-6 relative.
float int_val(int r, int64_t i) { return static_cast<float>(((i * 37 + r * 11) % 41) - 20); }
float real_val(int r, int64_t i) {
  uint64_t h = static_cast<uint64_t>(i) * 6364136223846793005ull + static_cast<uint64_t>(r + 1) * 1442695040888963407ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 32;
  return 0.5f + static_cast<float>(h % 1000003) / 1000003.0f;  // [0.5, 1.5)
}

bool close_rel(double got, double want, double tol = 1e-6) {
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

const int64_t kCounts[] = {1, 7, 1000, 100003};

}  // namespace

TEST_CASE("communicator: single rank, world 1, ops are copies or no-ops", "[communicator]") {
  auto c = make_single_communicator();
  CHECK(c->rank() == 0);
  CHECK(c->world_size() == 1);
  std::vector<float> v = {1.5f, -2.f, 3.f};
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
    c->all_reduce(v.data(), 3, op);
    CHECK(v == std::vector<float>{1.5f, -2.f, 3.f});
  }
  std::vector<float> out(3, 0.f);
  c->reduce_scatter(out.data(), v.data(), 3, ReduceOp::Avg);
  CHECK(out == v);
  std::vector<char> g(4, 0);
  c->all_gather(g.data(), "abcd", 4);
  CHECK(std::string(g.begin(), g.end()) == "abcd");
  c->all_gather(g.data(), g.data(), 4);  // in place
  CHECK(std::string(g.begin(), g.end()) == "abcd");
  c->broadcast(g.data(), 4, 0);
  CHECK_THROWS_AS(c->broadcast(g.data(), 4, 1), Error);
  c->barrier();
}

TEST_CASE("communicator: gloo all_reduce: sum, avg, max for W = 1..5", "[communicator]") {
  MemStore store;
  for (int W = 1; W <= 5; ++W) {
    for (int64_t n : kCounts) {
      INFO("W=" << W << " count=" << n);
      // results[op][rank]
      std::vector<std::vector<std::vector<float>>> results(4, std::vector<std::vector<float>>(W));
      run_group(store, W, [&](Communicator& c) {
        const int r = c.rank();
        std::vector<float> a(n), b(n), m(n), s(n);
        for (int64_t i = 0; i < n; ++i) {
          a[i] = b[i] = m[i] = int_val(r, i);
          s[i] = real_val(r, i);
        }
        c.all_reduce(a.data(), n, ReduceOp::Sum);
        c.all_reduce(b.data(), n, ReduceOp::Avg);
        c.all_reduce(m.data(), n, ReduceOp::Max);
        c.all_reduce(s.data(), n, ReduceOp::Sum);
        results[0][r] = a;
        results[1][r] = b;
        results[2][r] = m;
        results[3][r] = s;
      });
      bool sum_ok = true, avg_ok = true, max_ok = true, real_ok = true, identical = true;
      for (int r = 0; r < W; ++r) {
        for (int k = 0; k < 4; ++k) identical = identical && same_bits(results[k][r], results[k][0]);
        for (int64_t i = 0; i < n; ++i) {
          float sum = 0.f, mx = -INFINITY;
          double rsum = 0.0;
          for (int q = 0; q < W; ++q) {
            sum += int_val(q, i);
            mx = std::max(mx, int_val(q, i));
            rsum += real_val(q, i);
          }
          sum_ok = sum_ok && results[0][r][i] == sum;
          avg_ok = avg_ok && results[1][r][i] == sum / static_cast<float>(W);
          max_ok = max_ok && results[2][r][i] == mx;
          real_ok = real_ok && close_rel(results[3][r][i], rsum);
        }
      }
      CHECK(sum_ok);
      CHECK(avg_ok);
      CHECK(max_ok);
      CHECK(real_ok);
      CHECK(identical);  // every rank ends with the same bits
    }
  }
}

TEST_CASE("communicator: gloo reduce_scatter: rank r gets slice r, any W, against a naive reference", "[communicator]") {
  MemStore store;
  for (int W = 1; W <= 5; ++W) {
    for (int64_t n : kCounts) {
      INFO("W=" << W << " count_per_rank=" << n);
      // out[run][op][rank]: ops Sum(int), Avg(int), Max(int), Sum(real); two runs for determinism.
      std::vector<std::vector<std::vector<std::vector<float>>>> out(
          2, std::vector<std::vector<std::vector<float>>>(4, std::vector<std::vector<float>>(W)));
      for (int run = 0; run < 2; ++run) {
        run_group(store, W, [&](Communicator& c) {
          const int r = c.rank();
          std::vector<float> in_i(W * n), in_r(W * n);
          for (int64_t i = 0; i < W * n; ++i) {
            in_i[i] = int_val(r, i);
            in_r[i] = real_val(r, i);
          }
          const ReduceOp ops[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Sum};
          for (int k = 0; k < 4; ++k) {
            std::vector<float> o(n, std::nanf(""));
            c.reduce_scatter(o.data(), k == 3 ? in_r.data() : in_i.data(), n, ops[k]);
            out[run][k][r] = o;
          }
        });
      }
      bool sum_ok = true, avg_ok = true, max_ok = true, real_ok = true, deterministic = true;
      for (int r = 0; r < W; ++r) {
        for (int k = 0; k < 4; ++k) deterministic = deterministic && same_bits(out[0][k][r], out[1][k][r]);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t i = r * n + j;  // rank r's slice of the full vector
          float sum = 0.f, mx = -INFINITY;
          double rsum = 0.0;
          for (int q = 0; q < W; ++q) {
            sum += int_val(q, i);
            mx = std::max(mx, int_val(q, i));
            rsum += real_val(q, i);
          }
          sum_ok = sum_ok && out[0][0][r][j] == sum;
          avg_ok = avg_ok && close_rel(out[0][1][r][j], static_cast<double>(sum) / W);
          max_ok = max_ok && out[0][2][r][j] == mx;
          real_ok = real_ok && close_rel(out[0][3][r][j], rsum);
        }
      }
      CHECK(sum_ok);
      CHECK(avg_ok);
      CHECK(max_ok);
      CHECK(real_ok);
      CHECK(deterministic);  // same inputs, same bits, run after run
    }
  }
}

TEST_CASE("communicator: gloo reduce_scatter: a large count goes round the ring in pieces", "[communicator]") {
  MemStore store;
  const int W = 3;
  const int64_t n = (int64_t(8) << 20) / W;  // 2796202 per rank: about 8 Mi floats in, several ring pieces
  std::vector<std::vector<float>> out(W), avg(W), all(W);
  run_group(store, W, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<float> in(W * n);
    for (int64_t i = 0; i < W * n; ++i) in[i] = int_val(r, i);
    out[r].assign(n, 0.f);
    c.reduce_scatter(out[r].data(), in.data(), n, ReduceOp::Sum);
    // In place: the result overwrites this rank's own slice of the input.
    c.reduce_scatter(in.data() + r * n, in.data(), n, ReduceOp::Avg);
    avg[r].assign(in.begin() + r * n, in.begin() + (r + 1) * n);
    // And a large all_reduce (Gloo's segmented ring) for good measure.
    std::vector<float> big(W * n);
    for (int64_t i = 0; i < W * n; ++i) big[i] = int_val(r, i);
    c.all_reduce(big.data(), W * n, ReduceOp::Sum);
    all[r] = std::move(big);
  });
  bool ok = true, avg_ok = true, all_ok = true;
  for (int r = 0; r < W; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = r * n + j;
      const float sum = int_val(0, i) + int_val(1, i) + int_val(2, i);
      ok = ok && out[r][j] == sum;
      avg_ok = avg_ok && avg[r][j] == sum / 3.0f;
      all_ok = all_ok && all[0][i] == sum;
    }
  CHECK(ok);
  CHECK(avg_ok);
  CHECK(all_ok);
  CHECK(same_bits(all[1], all[0]));
  CHECK(same_bits(all[2], all[0]));
}

TEST_CASE("communicator: gloo all_gather: out of place and in place for W = 1..5", "[communicator]") {
  MemStore store;
  for (int W = 1; W <= 5; ++W) {
    for (size_t bytes : {size_t(1), size_t(13), size_t(4099), size_t(1) << 20}) {
      INFO("W=" << W << " bytes_per_rank=" << bytes);
      std::vector<std::vector<uint8_t>> oop(W), inp(W);
      run_group(store, W, [&](Communicator& c) {
        const int r = c.rank();
        std::vector<uint8_t> mine(bytes);
        for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<uint8_t>(r * 31 + i * 7);
        std::vector<uint8_t> out(W * bytes, 0xee);
        c.all_gather(out.data(), mine.data(), bytes);
        oop[r] = out;
        std::vector<uint8_t> out2(W * bytes, 0xee);
        std::memcpy(out2.data() + r * bytes, mine.data(), bytes);
        c.all_gather(out2.data(), out2.data() + r * bytes, bytes);
        inp[r] = out2;
      });
      std::vector<uint8_t> want(W * bytes);
      for (int q = 0; q < W; ++q)
        for (size_t i = 0; i < bytes; ++i) want[q * bytes + i] = static_cast<uint8_t>(q * 31 + i * 7);
      for (int r = 0; r < W; ++r) {
        CHECK(oop[r] == want);
        CHECK(inp[r] == want);
      }
    }
  }
}

TEST_CASE("communicator: gloo broadcast from a non-zero root, and barrier, for W = 1..5", "[communicator]") {
  MemStore store;
  for (int W = 1; W <= 5; ++W) {
    INFO("W=" << W);
    const int root = W - 1;
    std::vector<std::vector<uint8_t>> got(W);
    std::vector<std::atomic<int>> arrived(W);
    std::vector<int> seen_before_leaving(W, 0);
    run_group(store, W, [&](Communicator& c) {
      const int r = c.rank();
      std::vector<uint8_t> buf(10007);
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(r == root ? i * 13 + 5 : 0);
      c.broadcast(buf.data(), buf.size(), root);
      got[r] = buf;
      // Barrier: nobody leaves before everybody has arrived.
      arrived[r].store(1);
      c.barrier();
      int n = 0;
      for (int q = 0; q < W; ++q) n += arrived[q].load();
      seen_before_leaving[r] = n;
    });
    std::vector<uint8_t> want(10007);
    for (size_t i = 0; i < want.size(); ++i) want[i] = static_cast<uint8_t>(i * 13 + 5);
    for (int r = 0; r < W; ++r) {
      CHECK(got[r] == want);
      CHECK(seen_before_leaving[r] == W);
    }
  }
}

TEST_CASE("communicator: gloo: two communicators on different prefixes coexist in one process", "[communicator]") {
  MemStore store;
  const int W = 3;
  const std::string pa = fresh_prefix("a"), pb = fresh_prefix("b");
  std::vector<std::exception_ptr> errors(W);
  std::vector<float> sa(W), sb(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      try {
        auto a = make_gloo_communicator(store, pa, r, W, "127.0.0.1", 30s);
        auto b = make_gloo_communicator(store, pb, r, W, "127.0.0.1", 30s);
        float x = static_cast<float>(r + 1), y = static_cast<float>(10 * (r + 1));
        a->all_reduce(&x, 1, ReduceOp::Sum);
        b->all_reduce(&y, 1, ReduceOp::Sum);
        a->barrier();
        sa[r] = x;
        sb[r] = y;
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int r = 0; r < W; ++r) {
    CHECK(sa[r] == 6.f);
    CHECK(sb[r] == 60.f);
  }
  // Each communicator removes its bootstrap keys once every rank has connected.
  CHECK(store.size() == 0);
}

TEST_CASE("communicator: gloo reduce_scatter: a rank that never arrives makes the others throw a clear Error", "[communicator]") {
  MemStore store;
  const int W = 3;
  const int absent = 2;
  const std::string prefix = fresh_prefix("fail");
  std::vector<std::string> msgs(W), second(W);
  std::vector<double> secs(W, -1.0);
  std::vector<std::exception_ptr> unexpected(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      try {
        auto c = make_gloo_communicator(store, prefix, r, W, "127.0.0.1", 1s);
        c->set_step(12);
        if (r == absent) {
          // Hung: never calls the collective, then goes away.
          std::this_thread::sleep_for(4s);
          return;
        }
        std::vector<float> in(W * 1000, 1.f), out(1000);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          c->reduce_scatter(out.data(), in.data(), 1000, ReduceOp::Sum);
        } catch (const Error& e) {
          msgs[r] = e.what();
        }
        secs[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        try {
          c->all_reduce(out.data(), 1000, ReduceOp::Sum);  // the communicator is now unusable
        } catch (const Error& e) {
          second[r] = e.what();
        }
      } catch (...) {
        unexpected[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : unexpected)
    if (e) std::rethrow_exception(e);
  for (int r = 0; r < W; ++r) {
    if (r == absent) continue;
    INFO("rank " << r << ": " << msgs[r]);
    CHECK_THAT(msgs[r], Catch::Contains("reduce_scatter"));
    CHECK_THAT(msgs[r], Catch::Contains("step 12"));
    CHECK_THAT(msgs[r], Catch::Contains("rank " + std::to_string(r) + " of 3"));
    CHECK_THAT(msgs[r], Catch::Contains("timed out"));
    CHECK_THAT(msgs[r], Catch::Contains("1 s"));
    // Well before the absent rank wakes up (4 s) and closes its connections:
    // the timeout, not the disconnect, ended the wait.
    CHECK(secs[r] >= 0.0);
    CHECK(secs[r] < 3.0);
    CHECK_THAT(second[r], Catch::Contains("unusable"));
  }
  // Rank 0 waits on its ring predecessor, the absent rank: it must say so.
  CHECK_THAT(msgs[0], Catch::Contains("rank 2"));
}

TEST_CASE("communicator: gloo: a peer that exits mid-collective is named, and Gloo's own collectives time out too", "[communicator]") {
  MemStore store;
  // Rank 1 goes away (destroys its communicator) while rank 0 waits on it in
  // the ring; with a 20 s timeout, rank 0 must learn it from the closed
  // connection, long before the timeout.
  std::string lost;
  double lost_secs = -1.0;
  run_group(store, 2, [&](Communicator& c) {
    c.set_step(3);
    if (c.rank() == 1) {
      std::this_thread::sleep_for(300ms);
      return;
    }
    std::vector<float> in(2 * 64, 1.f), out(64);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c.reduce_scatter(out.data(), in.data(), 64, ReduceOp::Sum);
    } catch (const Error& e) {
      lost = e.what();
    }
    lost_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }, 20s, "lost");
  INFO(lost);
  CHECK_THAT(lost, Catch::Contains("reduce_scatter (step 3, rank 0 of 2)"));
  CHECK_THAT(lost, Catch::Contains("lost the connection to rank 1"));
  CHECK(lost_secs < 10.0);

  // all_gather is Gloo's algorithm: the peer is not known, the rest is.
  std::string timed;
  run_group(store, 2, [&](Communicator& c) {
    c.set_step(5);
    if (c.rank() == 1) {
      std::this_thread::sleep_for(1500ms);
      return;
    }
    std::vector<uint8_t> out(2 * 16);
    try {
      c.all_gather(out.data(), out.data(), 16);
    } catch (const Error& e) {
      timed = e.what();
    }
  }, 500ms, "ag");
  INFO(timed);
  CHECK_THAT(timed, Catch::Contains("all_gather (step 5, rank 0 of 2): timed out after 500 ms"));
}

TEST_CASE("communicator: gloo: a rank that never joins the rendezvous is named", "[communicator]") {
  MemStore store;
  std::string msg;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    make_gloo_communicator(store, fresh_prefix("alone"), 0, 2, "127.0.0.1", 500ms);
  } catch (const Error& e) {
    msg = e.what();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(msg);
  CHECK_THAT(msg, Catch::Contains("rank 1 of 2 did not arrive"));
  CHECK_THAT(msg, Catch::Contains("500 ms"));
  CHECK(secs < 5.0);
}

TEST_CASE("communicator: gloo: bad arguments are rejected with an Error", "[communicator]") {
  MemStore store;
  CHECK_THROWS_AS(make_gloo_communicator(store, "x", 2, 2, "127.0.0.1", 1s), Error);
  CHECK_THROWS_AS(make_gloo_communicator(store, "x", 0, 0, "127.0.0.1", 1s), Error);
  std::string msg;
  run_group(store, 2, [&](Communicator& c) {
    try {
      char b = 0;
      c.broadcast(&b, 1, 5);
    } catch (const Error& e) {
      if (c.rank() == 0) msg = e.what();
    }
  });
  CHECK_THAT(msg, Catch::Contains("broadcast"));
  CHECK_THAT(msg, Catch::Contains("root 5"));
}

using Catch::Matchers::Contains;

TEST_CASE("communicator: trainrun bench comm prints the nccl-tests style table, and refuses what it cannot run",
          "[communicator]") {
  // --tp 0: the TP rows have their own test (below).
  auto r = test::run_trainrun("bench comm --nproc 2 --min-bytes 4096 --max-bytes 65536 --iters 3 --tp 0");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("backend cpu (gloo, TCP loopback), 2 ranks") && Contains("host memcpy bandwidth"));
  // Three ops x three sizes (4, 16, 64 KiB), each row with finite positive figures.
  int rows = 0;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("all_reduce", 0) != 0 && line.rfind("reduce_scatter", 0) != 0 && line.rfind("all_gather", 0) != 0)
      continue;
    ++rows;
    std::istringstream f(line);
    std::string op, num, unit;
    double t = 0, algbw = 0, busbw = 0;
    f >> op >> num >> unit >> t >> algbw >> busbw;
    INFO(line);
    CHECK(t > 0);
    CHECK(algbw > 0);
    CHECK(busbw > 0);
  }
  CHECK(rows == 9);
  // NCCL needs a GPU per rank: a clear error here (the tests hide the GPUs).
  r = test::run_trainrun("bench comm --backend cuda --nproc 2");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("bench comm: --backend cuda: no usable GPU"));
  r = test::run_trainrun("bench comm --backend tpu");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--backend"));
}

TEST_CASE("communicator: trainrun bench comm adds TP-sized bf16 rows and tp1 vs tp2 training steps", "[communicator][tp]") {
  test::TempDir dir("bench_tp");
  // A small model so the test is quick: 2 x 8 x 32 activations per micro-batch.
  test::write_file(dir / "job.yaml", "model: {n_layer: 2, n_head: 4, n_embd: 32, vocab_size: 64, seq_len: 8}\n"
                                     "data: {format: synthetic, synthetic: {vocab: 64, branching: 3}}\n"
                                     "train: {micro_batch_size: 2, global_batch_size: 2}\n");
  auto r = test::run_trainrun("bench comm --nproc 2 --min-bytes 4096 --max-bytes 4096 --iters 2 --tp 2 --tp-steps 3 "
                              "--tp-config '" + dir / "job.yaml" + "'");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("# TP activation collectives: bf16, 2 ranks, micro-batch x seq_len x n_embd = 2 x 8 x 32 (") &&
                        Contains(" = 512 values (1 KiB)"));
  int tp_rows = 0, step_rows = 0;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    INFO(line);
    if (line.rfind("tp_", 0) == 0) {
      ++tp_rows;
      std::istringstream f(line);
      std::string op, num, unit;
      double t = 0, algbw = 0, busbw = 0;
      f >> op >> num >> unit >> t >> algbw >> busbw;
      CHECK((op == "tp_all_reduce" || op == "tp_all_gather" || op == "tp_reduce_scatter"));
      CHECK(num + " " + unit == "1 KiB");
      CHECK(t > 0);
      CHECK(busbw > 0);
    } else if (line.rfind("tp1 ", 0) == 0 || line.rfind("tp2 ", 0) == 0) {
      ++step_rows;
      std::istringstream f(line);
      std::string mesh, pct;
      int ranks = 0, threads = 0;
      double step_ms = 0, tp_ms = -1;
      f >> mesh >> ranks >> threads >> step_ms >> tp_ms >> pct;
      CHECK(ranks == (mesh == "tp1" ? 1 : 2));
      CHECK(step_ms > 0);
      const double fraction = std::stod(pct.substr(0, pct.size() - 1)) / 100;
      CHECK(fraction >= 0);
      CHECK(fraction <= 1);
      if (mesh == "tp1") CHECK(tp_ms == 0);
      else CHECK(tp_ms > 0);  // two ranks really exchanged activations
    }
  }
  CHECK(tp_rows == 3);
  CHECK(step_rows == 2);
  CHECK_THAT(r.out, Contains("# training steps, gpt2 L=2 C=32 heads=4 V=64 T=8, micro-batch 2 (") &&
                        Contains("tp1 vs tp2"));
  // Bad input: a degree the model does not split, a missing job, a negative step count.
  r = test::run_trainrun("bench comm --nproc 2 --min-bytes 4096 --max-bytes 4096 --tp 3 --tp-config '" + dir / "job.yaml" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("model.n_head (4) is not divisible by parallel.tensor_parallel (3)"));
  r = test::run_trainrun("bench comm --tp-config '" + dir / "missing.yaml" + "'");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--tp-config"));
  r = test::run_trainrun("bench comm --tp-steps -1");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--tp-steps"));
}

// ---- point to point and bf16 (pipeline stages, tensor-parallel activations) ----------

TEST_CASE("communicator: gloo send_recv: a ring where every rank sends and receives at once, and tags",
          "[communicator]") {
  MemStore store;
  for (int W : {2, 3, 5}) {
    INFO("W = " << W);
    run_group(store, W, [&](Communicator& c) {
      const int r = c.rank(), next = (r + 1) % W, prev = (r + W - 1) % W;
      // Every rank calls at the same time, sending forward and receiving
      // from behind: it must not deadlock (both are posted before a wait).
      std::vector<float> out(1000 + r), in(1000 + prev);
      for (size_t i = 0; i < out.size(); ++i) out[i] = float(r * 10000 + int(i));
      c.send_recv(out.data(), out.size() * 4, next, in.data(), in.size() * 4, prev, 7);
      for (size_t i = 0; i < in.size(); ++i)
        if (in[i] != float(prev * 10000 + int(i))) throw std::runtime_error("send_recv: wrong data from the ring");
      // One-sided calls: a send is matched by the receive with its tag.
      if (W == 2) {
        int a = 11, b = 22, x = 0, y = 0;
        if (r == 0) {
          c.send(&a, 4, 1, 1);
          c.recv(&y, 4, 1, 2);
        } else {
          c.recv(&x, 4, 0, 1);
          c.send(&b, 4, 0, 2);
        }
        if ((r == 0 && y != 22) || (r == 1 && x != 11)) throw std::runtime_error("send/recv: wrong message");
      }
    });
  }
}

TEST_CASE("communicator: gloo recv from a peer that never sends fails within the timeout, naming it",
          "[communicator]") {
  MemStore store;
  std::string msg;
  run_group(store, 2, [&](Communicator& c) {
    c.set_step(3);
    float x = 0;
    if (c.rank() == 1) {
      try {
        c.recv(&x, 4, 0, 5);
      } catch (const Error& e) {
        msg = e.what();
      }
    } else {
      // Sends, but with another tag: not the message rank 1 waits for.
      try {
        c.send(&x, 4, 1, 6);
      } catch (const Error&) {
      }
    }
  }, 500ms, "p2p");
  CHECK_THAT(msg, Catch::Matchers::Contains("send_recv (step 3, rank 1 of 2)") && Catch::Matchers::Contains("rank 0"));
  // Bad peers are refused before anything is posted.
  run_group(store, 2, [&](Communicator& c) {
    float x = 0;
    bool threw = false;
    try {
      c.send(&x, 4, 2);
    } catch (const Error& e) {
      threw = std::string(e.what()).find("peer 2 is not a rank of a group of 2") != std::string::npos;
    }
    if (!threw) throw std::runtime_error("send to rank 2 of 2 was not refused");
  });
}

TEST_CASE("communicator: bf16 all_reduce and reduce_scatter reduce in fp32 and round once, same bits on every rank",
          "[communicator]") {
  auto to_bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  };
  auto from_bf16 = [](uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  MemStore store;
  const int W = 3, n = 257;
  std::vector<std::vector<uint16_t>> ar(W), rs(W);
  run_group(store, W, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<uint16_t> buf(n), in(size_t(W) * n), out(n);
    for (int i = 0; i < n; ++i) buf[size_t(i)] = to_bf16(real_val(r, i));
    for (int i = 0; i < W * n; ++i) in[size_t(i)] = to_bf16(real_val(r, i));
    c.all_reduce_bf16(buf.data(), n, ReduceOp::Sum);
    c.reduce_scatter_bf16(out.data(), in.data(), n, ReduceOp::Sum);
    ar[size_t(r)] = buf;
    rs[size_t(r)] = out;
  });
  for (int i = 0; i < n; ++i) {
    // The reference: the bf16 inputs summed in fp32 (Gloo's ring order may
    // differ from this one by an fp32 ulp, far below a bf16 ulp), rounded once.
    float sum = 0;
    for (int r = 0; r < W; ++r) sum += from_bf16(to_bf16(real_val(r, i)));
    INFO("element " << i);
    CHECK(std::fabs(from_bf16(ar[0][size_t(i)]) - sum) <= std::fabs(sum) * 0x1p-8f);
    for (int r = 1; r < W; ++r) CHECK(ar[size_t(r)][size_t(i)] == ar[0][size_t(i)]);
  }
  for (int r = 0; r < W; ++r)
    for (int i = 0; i < n; ++i) {
      float sum = 0;
      for (int q = 0; q < W; ++q) sum += from_bf16(to_bf16(real_val(q, r * n + i)));
      CHECK(std::fabs(from_bf16(rs[size_t(r)][size_t(i)]) - sum) <= std::fabs(sum) * 0x1p-8f);
    }
  // One rank: the identity, also for buffers the host must not touch.
  auto single = make_single_communicator();
  std::vector<uint16_t> v = {to_bf16(1.5f), to_bf16(-2.0f)};
  single->all_reduce_bf16(v.data(), 2, ReduceOp::Sum);
  CHECK(from_bf16(v[0]) == 1.5f);
  float a = 4.0f, b = 0;
  single->send_recv(&a, 4, 0, &b, 4, 0);
  CHECK(b == 4.0f);
}

// ---- the device mesh (parallel/mesh) ------------------------------------------------

#include <set>

#include "parallel/mesh/device_mesh.h"

namespace {
std::string mesh_error(int world, int tp, int pp, const std::string& sharding, int group) {
  try {
    plan_mesh(world, tp, pp, sharding, group);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("mesh: the dims follow the degrees and the strategy, bad meshes name their factors", "[mesh]") {
  MeshDims d = plan_mesh(8, 2, 1, "full_shard", 0);
  CHECK((d.pp == 1 && d.dp_replicate == 1 && d.dp_shard == 4 && d.tp == 2));
  d = plan_mesh(8, 2, 1, "hybrid_shard", 2);
  CHECK((d.dp_replicate == 2 && d.dp_shard == 2 && d.tp == 2 && d.world() == 8));
  d = plan_mesh(8, 1, 2, "no_shard", 0);
  CHECK((d.pp == 2 && d.dp_replicate == 4 && d.dp_shard == 1));
  CHECK(plan_mesh(1, 1, 1, "full_shard", 0).describe() == "pp1 x dp_replicate1 x dp_shard1 x tp1");

  CHECK_THAT(mesh_error(6, 4, 1, "full_shard", 0),
             Catch::Matchers::Contains("world size (6 ranks) is not divisible by parallel.tensor_parallel (4) x "
                                       "parallel.pipeline_parallel (1) = 4"));
  CHECK_THAT(mesh_error(12, 2, 2, "full_shard", 0), Catch::Matchers::Equals(""));
  CHECK_THAT(mesh_error(8, 2, 2, "hybrid_shard", 3),
             Catch::Matchers::Contains("parallel.shard_group_size (3) must divide the data-parallel size dp = 8 "
                                       "ranks / (tensor_parallel 2 x pipeline_parallel 2) = 2"));
  CHECK_THAT(mesh_error(8, 0, 1, "full_shard", 0), Catch::Matchers::Contains("parallel.tensor_parallel: 0"));
  CHECK_THAT(mesh_error(8, 1, 0, "full_shard", 0), Catch::Matchers::Contains("parallel.pipeline_parallel: 0"));
  CHECK_THAT(mesh_error(8, 1, 1, "zero3", 0), Catch::Matchers::Contains("unknown strategy 'zero3'"));
}

TEST_CASE("mesh: tp is innermost and every dim's groups partition the ranks consistently", "[mesh]") {
  const MeshDims dims{2, 3, 2, 2};  // pp2 x dp_replicate3 x dp_shard2 x tp2 = 24 ranks
  REQUIRE(dims.world() == 24);
  // A TP group is consecutive ranks: one node, one NVLink island.
  CHECK(DeviceMesh(dims, 5).group_ranks(MeshDim::tp) == std::vector<int>{4, 5});
  CHECK(DeviceMesh(dims, 5).group_ranks(MeshDim::dp_shard) == std::vector<int>{5, 7});
  CHECK(DeviceMesh(dims, 5).group_ranks(MeshDim::dp_replicate) == std::vector<int>{1, 5, 9});
  CHECK(DeviceMesh(dims, 5).group_ranks(MeshDim::pp) == std::vector<int>{5, 17});
  CHECK(DeviceMesh(dims, 5).dp_group_ranks() == std::vector<int>{1, 3, 5, 7, 9, 11});
  for (MeshDim d : {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::tp}) {
    INFO(mesh_dim_name(d));
    std::set<std::string> names;
    std::vector<int> seen(24, 0);
    for (int r = 0; r < 24; ++r) {
      const DeviceMesh m(dims, r);
      const std::vector<int> g = m.group_ranks(d);
      REQUIRE(int(g.size()) == dims.size(d));
      CHECK(g[size_t(m.coord(d))] == r);
      names.insert(m.group_name(d));
      // Every member sees the same group under the same name, at its own index.
      for (size_t i = 0; i < g.size(); ++i) {
        const DeviceMesh o(dims, g[i]);
        CHECK(o.group_ranks(d) == g);
        CHECK(o.group_name(d) == m.group_name(d));
        CHECK(o.coord(d) == int(i));
      }
      if (m.coord(d) == 0)
        for (int x : g) seen[size_t(x)]++;
    }
    CHECK(int(names.size()) == 24 / dims.size(d));
    CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));  // a partition
  }
  CHECK_THROWS_AS(DeviceMesh(dims, 24), Error);
}

TEST_CASE("mesh: one communicator per group, a tp all-reduce sums the tp pair, a dp one the dp ranks", "[mesh]") {
  MemStore store;
  const MeshDims dims = plan_mesh(8, 2, 1, "hybrid_shard", 2);  // dp_replicate2 x dp_shard2 x tp2
  std::vector<std::exception_ptr> errors(8);
  std::vector<std::array<float, 4>> got(8);
  std::vector<std::thread> threads;
  const std::string job = fresh_prefix("mesh");
  for (int r = 0; r < 8; ++r) {
    threads.emplace_back([&, r] {
      try {
        const DeviceMesh mesh(dims, r);
        MeshComms comms(mesh, [&](const std::string& prefix, int rank, int world) {
          return make_gloo_communicator(store, job + "/" + prefix, rank, world, "127.0.0.1", 30s);
        });
        if (comms.comm(MeshDim::pp) != nullptr) throw std::runtime_error("a size-1 pp group got a communicator");
        float tp = float(r), shard = float(r), rep = float(r), dp = float(r);
        comms.comm(MeshDim::tp)->all_reduce(&tp, 1, ReduceOp::Sum);
        comms.comm(MeshDim::dp_shard)->all_reduce(&shard, 1, ReduceOp::Sum);
        comms.comm(MeshDim::dp_replicate)->all_reduce(&rep, 1, ReduceOp::Sum);
        comms.dp()->all_reduce(&dp, 1, ReduceOp::Sum);
        got[size_t(r)] = {tp, shard, rep, dp};
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int r = 0; r < 8; ++r) {
    INFO("rank " << r);
    const DeviceMesh m(dims, r);
    auto sum = [](const std::vector<int>& g) {
      float s = 0;
      for (int x : g) s += float(x);
      return s;
    };
    CHECK(got[size_t(r)][0] == sum(m.group_ranks(MeshDim::tp)));  // r^1 pairs: {0,1}, {2,3}...
    CHECK(got[size_t(r)][1] == sum(m.group_ranks(MeshDim::dp_shard)));
    CHECK(got[size_t(r)][2] == sum(m.group_ranks(MeshDim::dp_replicate)));
    CHECK(got[size_t(r)][3] == sum(m.dp_group_ranks()));
  }
  CHECK(got[0][0] == 1.0f);  // ranks 0 + 1
  CHECK(got[0][3] == 0.0f + 2 + 4 + 6);
}
