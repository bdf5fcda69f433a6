// The shared-memory link (make_shm_communicator): what a pipeline boundary
// sends arrives byte for byte, in order, through rings smaller than the
// messages; a disagreeing receive, a silent peer and a dead peer are
// Errors naming it; nothing is left in /dev/shm; ranks in two PID
// namespaces take Gloo. Also the pipeline's sender thread over such a link:
// an unwinding step drops the sends still queued.
#include <catch2/catch.hpp>
#include <dirent.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/common/error.h"
#include "parallel/comm/communicator.h"
#include "parallel/pipeline/sender.h"
#include "parallel/rendezvous/store.h"

using namespace trainrun;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

struct Server {
  std::string secret = make_job_secret();
  TcpStoreServer srv{"127.0.0.1", 0, secret};
  std::unique_ptr<Store> client() { return connect_tcp_store("127.0.0.1", srv.port(), secret, 10s); }
};

std::string fresh(const std::string& tag) {
  static int n = 0;
  return "shm/" + tag + "/" + std::to_string(n++) + "/";
}

// fn(rank, link) on two threads, each with its own store client and link;
// returns each rank's error text ("" = none).
std::vector<std::string> run_pair(Server& s, const std::function<void(int, Communicator&)>& fn,
                                  std::chrono::milliseconds timeout = 20s, size_t ring = 64 << 10) {
  const std::string prefix = fresh("pair");
  std::vector<std::string> err(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      try {
        auto store = s.client();
        auto link = make_shm_communicator(*store, prefix, r, timeout, ring);
        fn(r, *link);
      } catch (const std::exception& e) {
        err[size_t(r)] = e.what();
      }
    });
  for (auto& t : th) t.join();
  return err;
}

std::vector<std::string> our_shm_files(pid_t pid = ::getpid()) {
  std::vector<std::string> out;
  const std::string mine = "trainrun-" + std::to_string(pid) + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, mine.c_str(), mine.size()) == 0) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

uint8_t byte_of(size_t msg, size_t i) { return uint8_t((i * 131 + msg * 7 + (i >> 9)) & 0xff); }

}  // namespace

TEST_CASE("shm link: messages from 0 bytes to 40x the ring arrive whole, in order, with their tags", "[shm]") {
  Server s;
  const std::vector<size_t> sizes = {0, 1, 15, 4095, 65536, 65537, 1 << 20, 40 << 16};
  const auto err = run_pair(s, [&](int r, Communicator& c) {
    CHECK(c.world_size() == 2);
    CHECK(c.name() == "shm");
    for (size_t m = 0; m < sizes.size(); ++m) {
      std::vector<uint8_t> buf(sizes[m]);
      if (r == 0) {
        for (size_t i = 0; i < buf.size(); ++i) buf[i] = byte_of(m, i);
        c.send(buf.data(), buf.size(), 1, uint32_t(100 + m));
      } else {
        c.recv(buf.data(), buf.size(), 0, uint32_t(100 + m));
        size_t bad = 0;
        for (size_t i = 0; i < buf.size(); ++i) bad += buf[i] != byte_of(m, i);
        if (bad) throw std::runtime_error("message " + std::to_string(m) + ": " + std::to_string(bad) + " bytes wrong");
      }
    }
    c.barrier();
  });
  CHECK(err[0] == "");
  CHECK(err[1] == "");
  CHECK(our_shm_files().empty());
}

TEST_CASE("shm link: both ranks send_recv messages larger than the ring at once without hanging", "[shm]") {
  Server s;
  const size_t n = 3 << 20;  // 48x the 64 KiB ring, both ways at the same time
  const auto err = run_pair(s, [&](int r, Communicator& c) {
    for (int round = 0; round < 3; ++round) {
      std::vector<uint8_t> out(n), in(n);
      for (size_t i = 0; i < n; ++i) out[i] = byte_of(size_t(r * 10 + round), i);
      c.send_recv(out.data(), n, 1 - r, in.data(), n, 1 - r, uint32_t(round));
      for (size_t i = 0; i < n; ++i)
        if (in[i] != byte_of(size_t((1 - r) * 10 + round), i)) throw std::runtime_error("send_recv: wrong byte");
    }
  });
  CHECK(err[0] == "");
  CHECK(err[1] == "");
}

TEST_CASE("shm link: a receive that expects another tag or size is an Error naming both", "[shm]") {
  Server s;
  auto err = run_pair(s, [&](int r, Communicator& c) {
    c.set_step(4);
    int x = 7;
    if (r == 0) c.send(&x, 4, 1, 5);
    else c.recv(&x, 4, 0, 6);
  });
  CHECK(err[0] == "");
  CHECK_THAT(err[1], Contains("step 4") && Contains("tag 5") && Contains("expects tag 6") && Contains("rank 0"));
  err = run_pair(s, [&](int r, Communicator& c) {
    int64_t x = 7;
    if (r == 0) c.send(&x, 8, 1, 1);
    else c.recv(&x, 4, 0, 1);
  });
  CHECK_THAT(err[1], Contains("8 bytes") && Contains("expects tag 1 and 4 bytes"));
  // Collectives and bad peers are refused.
  err = run_pair(s, [&](int r, Communicator& c) {
    float f = 1;
    if (r == 0) c.all_reduce(&f, 1, ReduceOp::Sum);
    else c.send(&f, 4, 2);
  });
  CHECK_THAT(err[0], Contains("only sends and receives"));
  CHECK_THAT(err[1], Contains("peer 2 is not a rank"));
}

TEST_CASE("shm link: a peer that never sends times out naming it, one that exited is named at once", "[shm]") {
  Server s;
  const auto t0 = std::chrono::steady_clock::now();
  const auto err = run_pair(s, [&](int r, Communicator& c) {
    float x = 0;
    if (r == 1) c.recv(&x, 4, 0, 3);
    else std::this_thread::sleep_for(1500ms);  // alive, silent
  }, 600ms);
  CHECK_THAT(err[1], Contains("timed out") && Contains("waiting for rank 0"));
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);

  // Rank 0 in a child process that maps the link and exits without a word.
  const std::string prefix = fresh("dead");
  const pid_t child = ::fork();
  if (child == 0) {
    try {
      auto store = s.client();
      auto link = make_shm_communicator(*store, prefix, 0, 10s);
      ::_exit(0);
    } catch (...) {
      ::_exit(3);
    }
  }
  REQUIRE(child > 0);
  std::string msg;
  std::thread reaper([&] {
    int st = 0;
    ::waitpid(child, &st, 0);
  });
  const auto t1 = std::chrono::steady_clock::now();
  try {
    auto store = s.client();
    auto link = make_shm_communicator(*store, prefix, 1, 30s);
    float x = 0;
    link->recv(&x, 4, 0, 1);
  } catch (const Error& e) {
    msg = e.what();
  }
  reaper.join();
  CHECK_THAT(msg, Contains("rank 0 (pid " + std::to_string(child) + ") has exited"));
  CHECK(std::chrono::steady_clock::now() - t1 < 10s);  // not the 30 s timeout
  CHECK(our_shm_files(child).empty());
}

TEST_CASE("shm link: a pipeline link is shared memory on one host, Gloo when TRAINRUN_PIPELINE_SHM=0", "[shm]") {
  Server s;
  for (const bool force_gloo : {false, true}) {
    INFO("TRAINRUN_PIPELINE_SHM=" << (force_gloo ? "0" : "(unset)"));
    if (force_gloo) ::setenv("TRAINRUN_PIPELINE_SHM", "0", 1);
    else ::unsetenv("TRAINRUN_PIPELINE_SHM");
    const std::string prefix = fresh("p2p");
    std::vector<std::string> err(2), kind(2);
    std::vector<int> shm(2, -1);
    std::vector<std::thread> th;
    for (int r = 0; r < 2; ++r)
      th.emplace_back([&, r] {
        try {
          auto store = s.client();
          bool is_shm = false;
          auto link = make_p2p_link_communicator(*store, prefix, r, "127.0.0.1", 20s, &is_shm);
          shm[size_t(r)] = is_shm;
          kind[size_t(r)] = link->name();
          std::vector<float> v(1000, float(r));
          if (r == 0) link->send(v.data(), v.size() * 4, 1, 9);
          else link->recv(v.data(), v.size() * 4, 0, 9);
          if (v[999] != 0.0f) throw std::runtime_error("wrong data");
        } catch (const std::exception& e) {
          err[size_t(r)] = e.what();
        }
      });
    for (auto& t : th) t.join();
    CHECK(err[0] == "");
    CHECK(err[1] == "");
    CHECK(kind[0] == (force_gloo ? "gloo" : "shm"));
    CHECK(kind[1] == kind[0]);
    CHECK(shm[0] == (force_gloo ? 0 : 1));
  }
  ::unsetenv("TRAINRUN_PIPELINE_SHM");
}

// Rank 1 in a new PID namespace (its pid there, 1, is another process
// here), sharing this /dev/shm. Before, the pair's identity (boot, /dev/shm)
// matched, the link was shared memory, and each side's liveness check was
// kill() on a pid from the other namespace: a dead peer could look alive,
// or a live one dead. Now the identity includes the PID namespace, and the
// pair takes Gloo.
TEST_CASE("shm link: ranks in different PID namespaces take Gloo, whose peer check needs no pid", "[shm]") {
  Server s;
  const std::string prefix = fresh("pidns");
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(ready[0]);
    const bool entered = ::unshare(CLONE_NEWPID) == 0 || ::unshare(CLONE_NEWUSER | CLONE_NEWPID) == 0;
    const char word = entered ? 'y' : 'n';
    if (::write(ready[1], &word, 1) != 1 || !entered) ::_exit(77);
    const pid_t inner = ::fork();  // the first process of the new namespace (its pid 1)
    if (inner == 0) {
      try {
        auto store = s.client();
        bool is_shm = true;
        auto link = make_p2p_link_communicator(*store, prefix, 1, "127.0.0.1", 20s, &is_shm);
        std::vector<float> v(1000, 0.0f);
        link->recv(v.data(), v.size() * 4, 0, 9);
        if (v[999] != 7.0f) ::_exit(12);
        ::_exit(is_shm ? 10 : 11);
      } catch (...) {
        ::_exit(13);
      }
    }
    int st = 0;
    ::waitpid(inner, &st, 0);
    ::_exit(WIFEXITED(st) ? WEXITSTATUS(st) : 14);
  }
  REQUIRE(child > 0);
  ::close(ready[1]);
  char word = 'n';
  const bool got = ::read(ready[0], &word, 1) == 1;
  ::close(ready[0]);
  if (!got || word != 'y') {
    int st = 0;
    ::waitpid(child, &st, 0);
    WARN("cannot create a PID namespace here (unshare CLONE_NEWPID refused): the cross-namespace case is untested");
    return;
  }
  bool is_shm = true;
  std::string kind, err;
  try {
    auto store = s.client();
    auto link = make_p2p_link_communicator(*store, prefix, 0, "127.0.0.1", 20s, &is_shm);
    kind = link->name();
    std::vector<float> v(1000, 7.0f);
    link->send(v.data(), v.size() * 4, 1, 9);
  } catch (const std::exception& e) {
    err = e.what();
  }
  int st = 0;
  REQUIRE(::waitpid(child, &st, 0) == child);
  CHECK(err == "");
  CHECK_FALSE(is_shm);
  CHECK(kind == "gloo");
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 11);  // rank 1: Gloo too, and the message arrived
}

// A pipeline link's sender thread (parallel/pipeline/sender.h) with nine
// sends queued on a shared-memory link whose peer never reads: the first
// blocks (64 KiB through a 4 KiB ring) until the 1 s timeout. The step
// "fails" meanwhile and the sender is destroyed, as when a rank unwinds.
// Before, the destructor ran every queued send, each waiting out its own
// timeout (about 9 s); now the queued ones are dropped at once.
TEST_CASE("pipeline sender: an unwinding step drops its queued sends instead of running each to its timeout",
          "[shm][pp]") {
  Server s;
  const std::string prefix = fresh("sender");
  constexpr auto kTimeout = 1000ms;
  constexpr int kSends = 9;
  std::atomic<bool> leave{false};
  std::string peer_err;
  std::thread peer([&] {  // maps the link, then stays alive and silent
    try {
      auto store = s.client();
      auto link = make_shm_communicator(*store, prefix, 1, 30s, 4096);
      while (!leave) std::this_thread::sleep_for(10ms);
    } catch (const std::exception& e) {
      peer_err = e.what();
    }
  });
  std::vector<std::shared_future<void>> done;
  double unwind_s = 0;
  {
    auto store = s.client();
    auto link = make_shm_communicator(*store, prefix, 0, kTimeout, 4096);
    std::vector<char> msg(64 << 10, 'x');
    auto sender = std::make_unique<PipelineSender>(0, 1);
    for (int i = 0; i < kSends; ++i)
      done.push_back(sender->post(link.get(), 0, 1, msg.data(), msg.size(), uint32_t(i),
                                  "send_act mb" + std::to_string(i)));
    std::this_thread::sleep_for(100ms);  // the first send is in flight, blocked on the silent peer
    // The injected failure: the step unwinds with sends queued.
    const auto t0 = std::chrono::steady_clock::now();
    sender.reset();
    unwind_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    leave = true;
  }
  peer.join();
  CHECK(peer_err == "");
  REQUIRE(done.size() == size_t(kSends));
  CHECK_THROWS_WITH(done[0].get(), Contains("timed out"));  // the one in flight ended on its own timeout
  for (int i = 1; i < kSends; ++i) {
    INFO("send " << i);
    CHECK_THROWS_WITH(done[size_t(i)].get(), Contains("send_act mb" + std::to_string(i)) &&
                                                 Contains("dropped unsent: the step is unwinding"));
  }
  // The one send in flight (at most its 1 s timeout), not nine of them.
  CHECK(unwind_s < 3.0);
}
