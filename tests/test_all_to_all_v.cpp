// Communicator::all_to_all_v (expert parallelism's token dispatch and
// combine, issue 28): a size per peer, zero sizes, on Gloo (W 2-4), the single
// rank and the shared-memory pair; sizes that disagree with the peer's and a
// peer that goes away are Errors that name the collective and the rank, not
// hangs or short reads. The NCCL version (grouped send/recv at the packed
// offsets) is compiled; not yet run on a GPU.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "parallel/comm/communicator.h"
#include "parallel/rendezvous/store.h"
#include "tests/support/inprocess.h"

using namespace trainrun;
using namespace trainrun::test;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

// How many bytes rank `from` sends to rank `to`: uneven in both directions
// (at W 2: 0->0 16, 0->1 4, 1->0 8, 1->1 24), and from W 3 with zeros (a
// rank that routes nothing to another's experts, one that keeps nothing).
size_t bytes_between(int from, int to, int W) {
  if (W > 2 && ((from == W - 1 && to == 0) || (from == 1 && to == 1))) return 0;
  return size_t((3 + from * 5 + to * 11) % 7 + 1) * 4;
}

uint8_t byte_of(int from, int to, size_t k) { return uint8_t(from * 61 + to * 17 + k * 3); }

void check_a2av(Communicator& c) {
  const int W = c.world_size(), r = c.rank();
  std::vector<size_t> send(static_cast<size_t>(W)), recv(static_cast<size_t>(W));
  std::vector<uint8_t> in;
  size_t recv_total = 0;
  for (int p = 0; p < W; ++p) {
    send[size_t(p)] = bytes_between(r, p, W);
    recv[size_t(p)] = bytes_between(p, r, W);
    recv_total += recv[size_t(p)];
    for (size_t k = 0; k < send[size_t(p)]; ++k) in.push_back(byte_of(r, p, k));
  }
  std::vector<uint8_t> out(recv_total + 8, 0xee);  // 8 guard bytes: nothing may land past the blocks
  c.all_to_all_v(out.data(), recv.data(), in.data(), send.data());
  size_t at = 0;
  for (int p = 0; p < W; ++p)
    for (size_t k = 0; k < recv[size_t(p)]; ++k, ++at)
      if (out[at] != byte_of(p, r, k))
        throw std::runtime_error("all_to_all_v: rank " + std::to_string(r) + " got a wrong byte " +
                                 std::to_string(k) + " from rank " + std::to_string(p));
  for (size_t g = recv_total; g < out.size(); ++g)
    if (out[g] != 0xee) throw std::runtime_error("all_to_all_v wrote past its output on rank " + std::to_string(r));
}

// Runs fn on both ranks of a shared-memory pair; each rank's error text.
std::vector<std::string> run_shm_pair(const std::function<void(Communicator&)>& fn, std::chrono::milliseconds timeout) {
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  std::vector<std::string> errors(2);
  std::vector<std::thread> pair;
  for (int r = 0; r < 2; ++r)
    pair.emplace_back([&, r] {
      try {
        auto store = connect_tcp_store("127.0.0.1", server.port(), secret, 30s);
        fn(*make_shm_communicator(*store, "shm_a2av", r, timeout));
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : pair) t.join();
  return errors;
}

}  // namespace

TEST_CASE("all_to_all_v: uneven and zero sizes reach the right rank on Gloo, one rank and the shm pair",
          "[communicator][moe]") {
  for (int W : {2, 3, 4}) {
    INFO("gloo W " << W);
    for (const auto& e : run_gloo_group(W, "a2av", 30s, check_a2av)) CHECK(e == "");
  }
  check_a2av(*make_single_communicator());
  for (const auto& e : run_shm_pair(check_a2av, 30s)) CHECK(e == "");
}

TEST_CASE("all_to_all_v: every size zero still completes (a step where no token leaves its rank)",
          "[communicator][moe]") {
  auto nothing = [](Communicator& c) {
    std::vector<size_t> zero(size_t(c.world_size()), 0);
    c.all_to_all_v(nullptr, zero.data(), nullptr, zero.data());
    c.barrier();  // the group is still in step
  };
  for (const auto& e : run_gloo_group(3, "a2av0", 30s, nothing)) CHECK(e == "");
  for (const auto& e : run_shm_pair(nothing, 30s)) CHECK(e == "");
}

TEST_CASE("all_to_all_v: a size that disagrees with the peer's is an Error naming the collective",
          "[communicator][moe]") {
  // Rank 0 expects 8 bytes from rank 1, which sends 4.
  auto disagree = [](Communicator& c) {
    std::vector<uint8_t> in(12, 1), out(16, 0);
    std::vector<size_t> send{4, 4}, recv{4, 4};
    if (c.rank() == 0) recv[1] = 8;
    c.all_to_all_v(out.data(), recv.data(), in.data(), send.data());
  };
  const auto shm = run_shm_pair(disagree, 5s);
  INFO(shm[0]);
  CHECK_THAT(shm[0], Contains("all_to_all_v") || Contains("send_recv"));
  CHECK_THAT(shm[0], Contains("4 bytes") && Contains("expects tag"));
  const auto gloo = run_gloo_group(2, "a2avbad", 3s, disagree);
  INFO(gloo[0] << " | " << gloo[1]);
  CHECK_THAT(gloo[0] + gloo[1], Contains("all_to_all_v"));
  // A single rank's own block is checked before anything moves.
  std::vector<uint8_t> b(4);
  const size_t s = 4, r2 = 2;
  CHECK_THROWS_WITH(make_single_communicator()->all_to_all_v(b.data(), &r2, b.data(), &s),
                    Contains("receives 2 bytes from itself but sends 4"));
}

TEST_CASE("all_to_all_v: a peer that goes away mid-exchange is named within the timeout", "[communicator][moe]") {
  double secs = -1;
  const auto errors = run_gloo_group(3, "a2avlost", 2s, [&](Communicator& c) {
    c.set_step(7);
    if (c.rank() == 2) return;  // leaves without taking part
    std::vector<size_t> sizes{16, 16, 16};
    std::vector<uint8_t> in(48, 3), out(48);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c.all_to_all_v(out.data(), sizes.data(), in.data(), sizes.data());
    } catch (...) {
      if (c.rank() == 0) secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      throw;
    }
  });
  INFO(errors[0] << " | " << errors[1]);
  CHECK(errors[2] == "");
  for (int r : {0, 1}) {
    CHECK_THAT(errors[size_t(r)], Contains("all_to_all_v (step 7, rank " + std::to_string(r) + " of 3"));
  }
  CHECK(secs >= 0);
  CHECK(secs < 10);
}
