// The rendezvous store: TcpStoreServer + connect_tcp_store, wait_for_ranks,
// the secret handshake, failure messages, and Gloo bootstrapping through
// GlooStoreAdapter. Every test runs a real server on 127.0.0.1 with port 0.
//
// Catch2 v2 assertions are not thread-safe, so worker threads only record
// what happened and the test thread asserts after join().
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "parallel/rendezvous/store.h"
#include "parallel/rendezvous/store_proto.h"
#if TRAINRUN_HAVE_GLOO
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include "parallel/rendezvous/gloo_store.h"
#endif

using namespace trainrun;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kSecret = "test-secret-0123456789abcdef";


std::unique_ptr<Store> client(const TcpStoreServer& server) {
  return connect_tcp_store("127.0.0.1", server.port(), kSecret, 5s);
}

long ms_since(Clock::time_point t0) {
  return static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Redirects fd 2 into a temp file so a test can read the server's warnings.
class StderrCapture {
 public:
  StderrCapture() {
    std::fflush(stderr);
    tmp_ = std::tmpfile();
    saved_ = ::dup(2);
    ::dup2(::fileno(tmp_), 2);
  }
  ~StderrCapture() { finish(); }
  std::string finish() {
    if (saved_ < 0) return out_;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
    std::rewind(tmp_);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, tmp_)) > 0) out_.append(buf, n);
    std::fclose(tmp_);
    return out_;
  }

 private:
  FILE* tmp_ = nullptr;
  int saved_ = -1;
  std::string out_;
};

// A plain TCP connection, for speaking to the server without the client.
int raw_connect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

// Reads until EOF (or 2 s pass); returns everything received.
std::vector<uint8_t> read_until_eof(int fd, bool* got_eof) {
  std::vector<uint8_t> all;
  *got_eof = false;
  auto deadline = Clock::now() + 2s;
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    uint8_t buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      *got_eof = true;
      break;
    }
    all.insert(all.end(), buf, buf + n);
  }
  return all;
}

}  // namespace

TEST_CASE("store: port 0 binds a real port and the address is reported", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  CHECK(server.port() > 0);
  CHECK(server.port() <= 65535);
  CHECK(server.address() == "127.0.0.1");
  auto s = client(server);
  s->set("k", store_bytes("v"));
  CHECK(store_text(s->get("k", 1s)) == "v");
}

TEST_CASE("store: set and get across two clients on threads", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  std::string got_a, got_b, err;
  std::thread ta([&] {
    try {
      auto s = client(server);
      s->set("from_a", store_bytes("hello from a"));
      got_a = store_text(s->get("from_b", 5s));
    } catch (const std::exception& e) {
      err += e.what();
    }
  });
  std::thread tb([&] {
    try {
      auto s = client(server);
      s->set("from_b", store_bytes(std::string("bin\0ary", 7)));
      got_b = store_text(s->get("from_a", 5s));
    } catch (const std::exception& e) {
      err += e.what();
    }
  });
  ta.join();
  tb.join();
  CHECK(err.empty());
  CHECK(got_a == std::string("bin\0ary", 7));  // values are bytes, not C strings
  CHECK(got_b == "hello from a");
  // Overwrite and an empty value.
  auto s = client(server);
  s->set("from_a", {});
  CHECK(s->get("from_a", 1s).empty());
  CHECK(s->check("from_a"));
}

TEST_CASE("store: get blocks until another client sets the key, without blocking other clients", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto waiter = client(server);
  auto other = client(server);
  std::string got, err;
  long waited_ms = -1;
  std::thread t([&] {
    auto t0 = Clock::now();
    try {
      got = store_text(waiter->get("late", 5s));
    } catch (const std::exception& e) {
      err = e.what();
    }
    waited_ms = ms_since(t0);
  });
  std::this_thread::sleep_for(150ms);
  // While `late` is missing, the server still serves other clients at once.
  auto t0 = Clock::now();
  other->set("unrelated", store_bytes("x"));
  CHECK(store_text(other->get("unrelated", 1s)) == "x");
  CHECK(ms_since(t0) < 500);  // generous: the point is "not until `late` appears"
  other->set("late", store_bytes("finally"));
  t.join();
  CHECK(err.empty());
  CHECK(got == "finally");  // only exists after the set, so get did block
  CHECK(waited_ms < 2000);
}

TEST_CASE("store: get times out with a message naming the key", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto s = client(server);
  auto t0 = Clock::now();
  std::string msg;
  try {
    s->get("never/0", 200ms);
  } catch (const StoreTimeoutError& e) {
    msg = e.what();
  }
  long took = ms_since(t0);
  CHECK_THAT(msg, Catch::Contains("'never/0'") && Catch::Contains("200 ms"));
  CHECK(took >= 190);
  CHECK(took < 1500);
  // The connection is still usable after a timeout.
  s->set("after", store_bytes("ok"));
  CHECK(store_text(s->get("after", 1s)) == "ok");
}

TEST_CASE("store: add from 8 threads concurrently gives the exact total", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  constexpr int kThreads = 8, kAdds = 200;
  std::atomic<int> errors{0};
  std::vector<std::thread> ts;
  auto shared = client(server);  // half the threads share one client (it serialises calls)
  for (int i = 0; i < kThreads; ++i)
    ts.emplace_back([&, i] {
      try {
        std::unique_ptr<Store> own;
        Store* s = shared.get();
        if (i % 2 == 0) {
          own = client(server);
          s = own.get();
        }
        for (int k = 0; k < kAdds; ++k) s->add("counter", 1);
        s->add("weighted", i + 1);
      } catch (const std::exception&) {
        ++errors;
      }
    });
  for (auto& t : ts) t.join();
  CHECK(errors == 0);
  auto s = client(server);
  CHECK(s->add("counter", 0) == kThreads * kAdds);
  CHECK(store_text(s->get("counter", 1s)) == std::to_string(kThreads * kAdds));  // decimal text
  CHECK(s->add("weighted", -36) == 0);
  CHECK(s->add("fresh", -5) == -5);  // created at 0
  s->set("not_a_number", store_bytes("abc"));
  CHECK_THAT(error_of([&] { s->add("not_a_number", 1); }),
             Catch::Contains("'not_a_number'") && Catch::Contains("not an integer"));
}

TEST_CASE("store: compare_set semantics", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto s = client(server);
  // Absent key + empty expected: set.
  CHECK(store_text(s->compare_set("leader", {}, store_bytes("rank0"))) == "rank0");
  // Present, expected does not match: unchanged, returns the current value.
  CHECK(store_text(s->compare_set("leader", {}, store_bytes("rank1"))) == "rank0");
  CHECK(store_text(s->compare_set("leader", store_bytes("rank7"), store_bytes("rank1"))) == "rank0");
  // Present and matching: swapped.
  CHECK(store_text(s->compare_set("leader", store_bytes("rank0"), store_bytes("rank2"))) == "rank2");
  CHECK(store_text(s->get("leader", 1s)) == "rank2");
  // Absent key + non-empty expected: stays absent.
  CHECK(s->compare_set("ghost", store_bytes("x"), store_bytes("y")).empty());
  CHECK_FALSE(s->check("ghost"));
}

TEST_CASE("store: compare_set wakes a waiting get", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto a = client(server);
  auto b = client(server);
  std::string got;
  std::thread t([&] {
    try {
      got = store_text(a->get("cas", 3s));
    } catch (...) {
    }
  });
  std::this_thread::sleep_for(50ms);
  b->compare_set("cas", {}, store_bytes("won"));
  t.join();
  CHECK(got == "won");
}

TEST_CASE("store: remove and check", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto s = client(server);
  CHECK_FALSE(s->check("k"));
  CHECK_FALSE(s->remove("k"));
  s->set("k", store_bytes("v"));
  CHECK(s->check("k"));
  CHECK(s->remove("k"));
  CHECK_FALSE(s->check("k"));
  CHECK_THROWS_AS(s->get("k", 50ms), StoreTimeoutError);
}

// What a job leaves in the store (the checkpoint tests count a run's
// leftovers this way): every kind of write shows, a remove takes it away,
// a failed compare_set on an absent key creates nothing.
TEST_CASE("store: the server lists the keys it holds under a prefix", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto s = client(server);
  CHECK(server.keys().empty());
  s->set("a/2", store_bytes("x"));
  s->add("a/1", 1);
  s->compare_set("a/3", {}, store_bytes("y"));
  s->compare_set("a/4", store_bytes("not there"), store_bytes("z"));
  s->set("b", store_bytes("x"));
  CHECK(server.keys("a/") == std::vector<std::string>{"a/1", "a/2", "a/3"});
  CHECK(server.keys() == std::vector<std::string>{"a/1", "a/2", "a/3", "b"});
  s->remove("a/2");
  CHECK(server.keys("a/") == std::vector<std::string>{"a/1", "a/3"});
  CHECK(server.keys("c").empty());
  // Read while other clients write: consistent snapshots, no race (TSan).
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    auto w = client(server);
    for (int i = 0; !stop; ++i) {
      w->set("w/" + std::to_string(i % 50), store_bytes("v"));
      w->remove("w/" + std::to_string((i + 25) % 50));
    }
  });
  size_t most = 0;
  for (int i = 0; i < 200; ++i) most = std::max(most, server.keys("w/").size());
  CHECK(most <= 50);
  stop = true;
  writer.join();
}

TEST_CASE("store: wait returns when all keys exist and lists the missing ones on timeout", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto s = client(server);
  auto other = client(server);
  s->set("a", store_bytes("1"));
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    other->set("b", store_bytes("2"));
    std::this_thread::sleep_for(50ms);
    other->set("c", store_bytes("3"));
  });
  CHECK_NOTHROW(s->wait({"a", "b", "c"}, 3s));
  CHECK(s->check("c"));  // wait did not return before the last key was set
  t.join();
  CHECK_NOTHROW(s->wait({}, 10ms));

  std::string msg;
  try {
    s->wait({"a", "x/1", "b", "x/2"}, 200ms);
  } catch (const StoreTimeoutError& e) {
    msg = e.what();
  }
  CHECK_THAT(msg, Catch::Contains("'x/1', 'x/2'") && Catch::Contains("2 of 4 keys") &&
                      Catch::Contains("200 ms"));
  CHECK_THAT(msg, !Catch::Contains("'a'"));
}

TEST_CASE("store: wait_for_ranks names what, the missing ranks and the timeout", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto s = client(server);
  s->set("ready/0", store_bytes("1"));
  s->set("ready/1", store_bytes("1"));
  std::string msg = error_of([&] { wait_for_ranks(*s, "ready/", 4, 250ms, "rendezvous"); });
  CHECK(msg == "rendezvous: ranks 2, 3 of 4 did not arrive within 250 ms (waiting for key 'ready/2')");
  s->set("ready/2", store_bytes("1"));
  msg = error_of([&] { wait_for_ranks(*s, "ready/", 4, 100ms, "barrier"); });
  CHECK(msg == "barrier: rank 3 of 4 did not arrive within 100 ms (waiting for key 'ready/3')");
  // All present: returns; late arrival while waiting also counts.
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    auto c = client(server);
    c->set("ready/3", store_bytes("1"));
  });
  CHECK_NOTHROW(wait_for_ranks(*s, "ready/", 4, 3s, "rendezvous"));
  t.join();
}

TEST_CASE("store: a wrong secret is rejected, logged with the peer, and reads nothing", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto good = client(server);
  good->set("private", store_bytes("the-value"));

  StderrCapture cap;
  std::string msg = error_of([&] { connect_tcp_store("127.0.0.1", server.port(), "not-the-secret", 2s); });
  std::string log = cap.finish();
  CHECK_THAT(msg, Catch::Contains("rejected our secret") && Catch::Contains("TRAINRUN_STORE_SECRET") &&
                      Catch::Contains("127.0.0.1:" + std::to_string(server.port())));
  CHECK_THAT(log, Catch::Contains("rejected store client 127.0.0.1:") && Catch::Contains("wrong secret"));

  // A peer that skips the handshake and asks for a key directly gets a
  // rejection and a closed socket, never the value.
  StderrCapture cap2;
  int fd = raw_connect(server.port());
  store_proto::Writer w;
  w.u8(store_proto::kGet).str("private").u64(100);
  auto& frame = w.frame();
  REQUIRE(::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL) == ssize_t(frame.size()));
  bool eof = false;
  auto got = read_until_eof(fd, &eof);
  ::close(fd);
  std::string log2 = cap2.finish();
  CHECK(eof);
  CHECK(store_text(got).find("the-value") == std::string::npos);
  REQUIRE(got.size() >= 5);
  CHECK(got[4] == store_proto::kRejected);
  CHECK_THAT(log2, Catch::Contains("rejected store client 127.0.0.1:") && Catch::Contains("no secret"));

  // The server is unaffected.
  CHECK(store_text(good->get("private", 1s)) == "the-value");
}

TEST_CASE("store: a client connecting before the server starts retries until it is up", "[store]") {
  int port;
  {
    TcpStoreServer probe("127.0.0.1", 0, kSecret);  // find a free port, then free it
    port = probe.port();
  }
  std::string err, got;
  long took = -1;
  std::thread t([&] {
    auto t0 = Clock::now();
    try {
      auto s = connect_tcp_store("127.0.0.1", port, kSecret, 5s);
      took = ms_since(t0);
      got = store_text(s->get("hello", 2s));
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  TcpStoreServer server("127.0.0.1", port, kSecret);
  auto s = client(server);
  s->set("hello", store_bytes("world"));
  t.join();
  CHECK(err.empty());
  CHECK(got == "world");
  CHECK(took >= 100);  // it really had to retry (the server came up 300 ms later)
  CHECK(took < 3000);
}

TEST_CASE("store: an unreachable store gives an error naming host:port and what to check", "[store]") {
  int port;
  {
    TcpStoreServer probe("127.0.0.1", 0, kSecret);
    port = probe.port();
  }
  auto t0 = Clock::now();
  std::string msg = error_of([&] { connect_tcp_store("127.0.0.1", port, kSecret, 300ms); });
  CHECK(ms_since(t0) < 2000);
  CHECK_THAT(msg, Catch::StartsWith("cannot reach the rendezvous store at 127.0.0.1:" + std::to_string(port)) &&
                      Catch::Contains("Connection refused") && Catch::Contains("MASTER_ADDR/MASTER_PORT"));
}

TEST_CASE("store: a server destroyed while a client waits gives an Error, not a hang", "[store]") {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, kSecret);
  auto s = client(*server);
  std::string err;
  long took = -1;
  std::thread t([&] {
    auto t0 = Clock::now();
    try {
      s->get("never", 10s);
    } catch (const std::exception& e) {
      err = e.what();
    }
    took = ms_since(t0);
  });
  std::this_thread::sleep_for(100ms);
  auto t0 = Clock::now();
  server.reset();  // the destructor must stop the thread and close sockets promptly
  long destroy_ms = ms_since(t0);
  t.join();
  CHECK(destroy_ms < 1000);
  CHECK_THAT(err, Catch::Contains("get('never')") && Catch::Contains("lost the connection"));
  CHECK(took < 2000);
  // Later calls fail at once instead of touching a dead socket.
  CHECK_THAT(error_of([&] { s->set("x", store_bytes("y")); }), Catch::Contains("lost earlier"));
}

TEST_CASE("store: many clients waiting for all ranks (wait_for_ranks pattern)", "[store]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  constexpr int kWorld = 16;
  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < kWorld; ++r)
    ts.emplace_back([&, r] {
      try {
        auto s = client(server);
        s->set("arrive/" + std::to_string(r), store_bytes("1"));
        wait_for_ranks(*s, "arrive/", kWorld, 5s, "test barrier");
        ++ok;
      } catch (...) {
      }
    });
  for (auto& t : ts) t.join();
  CHECK(ok == kWorld);
}

TEST_CASE("store: make_job_secret is 128 random bits in hex and the server refuses an empty secret", "[store]") {
  std::string a = make_job_secret(), b = make_job_secret();
  CHECK(a.size() == 32);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(a != b);
  CHECK_THROWS_AS(TcpStoreServer("127.0.0.1", 0, ""), Error);
}

#if TRAINRUN_HAVE_GLOO
TEST_CASE("store: gloo contexts bootstrap through GlooStoreAdapter and allreduce", "[store][gloo]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  constexpr int kWorld = 2;
  std::vector<std::vector<float>> results(kWorld);
  std::vector<std::string> errors(kWorld);
  auto worker = [&](int rank) {
    try {
      auto store = connect_tcp_store("127.0.0.1", server.port(), kSecret, 5s);
      GlooStoreAdapter adapter(*store, 10s);
      gloo::rendezvous::PrefixStore prefixed("smoke/", adapter);
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto dev = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, kWorld);
      ctx->setTimeout(10s);
      ctx->connectFullMesh(prefixed, dev);
      std::vector<float> v = {1.0f + rank, 10.0f * (rank + 1), -0.5f, float(rank)};
      gloo::AllreduceOptions opts(ctx);
      opts.setOutput(v.data(), v.size());
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      gloo::allreduce(opts);
      results[rank] = v;
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::vector<std::thread> ts;
  for (int r = 0; r < kWorld; ++r) ts.emplace_back(worker, r);
  for (auto& t : ts) t.join();
  for (int r = 0; r < kWorld; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(errors[r].empty());
    CHECK(results[r] == std::vector<float>{3.0f, 30.0f, -1.0f, 1.0f});
  }
}

TEST_CASE("store: GlooStoreAdapter wait times out through the trainrun store", "[store][gloo]") {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  auto s = client(server);
  GlooStoreAdapter adapter(*s, 150ms);
  adapter.set("k", {'a', 'b'});
  CHECK(adapter.get("k") == std::vector<char>{'a', 'b'});
  CHECK_THROWS_AS(adapter.wait({"missing"}), StoreTimeoutError);
  CHECK_THROWS_AS(adapter.wait({"missing"}, 100ms), StoreTimeoutError);
}
#endif
