// The Gloo communicator: collectives over TCP between CPU ranks.
//
// Bootstrap: every rank creates a gloo tcp device bound to `host`, publishes
// its pair addresses in the rendezvous store under `prefix` and connects a
// full mesh (one TCP connection per peer). all_reduce, all_gather, broadcast
// and barrier are Gloo's own algorithms; reduce_scatter is our ring (see
// RingReduceScatter below for why).
//
// Errors: every wait has the communicator's timeout. Gloo reports failures as
// gloo::IoException / gloo::EnforceNotMet with a "[file:line] ..." message;
// we translate them into a trainrun::Error that names the operation, the step,
// this rank, the peer when known and the timeout, so the agent's "which rank
// failed first, and how" report is readable without Gloo's source at hand.
// After a failure the Gloo context is broken (a timed-out Gloo wait closes
// every connection of the context), so the communicator refuses further
// calls with an Error that repeats the first failure.
//
// Not thread-safe: one thread at a time per communicator, and all ranks must
// issue the same collectives in the same order (as with NCCL). Several
// communicators (different prefixes) can live in one process; each has its
// own tcp device (listening socket + event-loop thread).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "parallel/comm/communicator.h"

#if defined(TRAINRUN_HAVE_GLOO)
#include <csignal>

#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#endif

namespace trainrun {

#if !defined(TRAINRUN_HAVE_GLOO)

std::unique_ptr<Communicator> make_gloo_communicator(Store&, const std::string& prefix, int rank, int world,
                                                     const std::string&, std::chrono::milliseconds) {
  TR_FAIL("gloo communicator (prefix '", prefix, "', rank ", rank, " of ", world,
          "): this trainrun was built without Gloo; install libgloo-dev and rebuild, or run a single rank");
}

#else

namespace {

// "2 s", "1.5 s", "250 ms": timeouts as a person would write them.
std::string format_duration(std::chrono::milliseconds d) {
  const auto ms = d.count();
  if (ms < 1000) return detail::cat(ms, " ms");
  if (ms % 1000 == 0) return detail::cat(ms / 1000, " s");
  std::ostringstream os;
  os.precision(3);
  os << (static_cast<double>(ms) / 1000.0) << " s";
  return os.str();
}

// Gloo prefixes its messages with "[/build/path/file.cc:123] " (or "[enforce
// fail at ...] "); that location means nothing to a user, so drop it.
std::string strip_gloo_location(std::string msg) {
  while (!msg.empty() && msg.front() == '[') {
    auto end = msg.find("] ");
    if (end == std::string::npos) break;
    msg.erase(0, end + 2);
  }
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  return msg;
}

bool contains_ci(const std::string& hay, const char* needle) {
  std::string h = hay, n = needle;
  std::transform(h.begin(), h.end(), h.begin(), [](unsigned char c) { return std::tolower(c); });
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  return h.find(n) != std::string::npos;
}

// trainrun::Store -> gloo::rendezvous::Store, so Gloo's full-mesh bootstrap
// runs over our rendezvous store. Gloo's get() has no timeout argument; we
// use the communicator's. Keys this rank set are remembered so they can be
// removed once every rank has connected (see make_gloo_communicator).
class GlooStoreBridge : public gloo::rendezvous::Store {
 public:
  GlooStoreBridge(trainrun::Store& store, std::chrono::milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(key, std::vector<uint8_t>(data.begin(), data.end()));
    set_keys_.push_back(key);
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(key, timeout_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_.wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    // Gloo passes its context timeout here, which is ours.
    store_.wait(keys, timeout.count() > 0 ? timeout : timeout_);
  }

  const std::vector<std::string>& set_keys() const { return set_keys_; }

 private:
  trainrun::Store& store_;
  std::chrono::milliseconds timeout_;
  std::vector<std::string> set_keys_;
};

// Element-wise reductions. Written out (rather than gloo::sum/gloo::max) so
// the arithmetic is plain fp32 without reassociation, and Max propagates NaN
// (a NaN gradient must not vanish in a max-reduced norm).
inline float max_nan(float a, float b) { return (std::isnan(a) || a >= b) ? a : b; }

void reduce_sum(float* c, const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) c[i] = a[i] + b[i];
}
void reduce_max(float* c, const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) c[i] = max_nan(a[i], b[i]);
}

// Our ring's messages get their own slot prefix so they can never be matched
// with Gloo's own collectives (prefixes 0x01..0x08 in gloo/types.h).
constexpr uint8_t kRingReduceScatterSlotPrefix = 0x7e;
constexpr uint8_t kPointToPointSlotPrefix = 0x7d;

// Largest piece of one rank's slice that travels through the ring at once:
// bounds the scratch memory at 2 * kRingPieceFloats * 4 bytes (4 MiB) no
// matter how large the gradient is, while keeping messages big enough that
// per-message overhead is negligible.
constexpr int64_t kRingPieceFloats = int64_t(512) << 10;

enum class FailKind { Timeout, PeerLost, EarlierTimeout, Other };

FailKind classify(const std::string& msg) {
  if (contains_ci(msg, "Application timeout caused pair closure")) return FailKind::EarlierTimeout;
  if (contains_ci(msg, "timed out") || contains_ci(msg, "timeout")) return FailKind::Timeout;
  if (contains_ci(msg, "closed") || contains_ci(msg, "reset by peer") || contains_ci(msg, "broken pipe") ||
      contains_ci(msg, "read error") || contains_ci(msg, "write error") || contains_ci(msg, "connection refused"))
    return FailKind::PeerLost;
  return FailKind::Other;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> ctx, std::string prefix,
                   std::chrono::milliseconds timeout)
      : ctx_(std::move(ctx)), prefix_(std::move(prefix)), timeout_(timeout) {}

  int rank() const override { return ctx_->rank; }
  int world_size() const override { return ctx_->size; }
  std::string name() const override { return "gloo"; }

  void all_reduce(float* buf, int64_t count, ReduceOp op) override {
    const char* what = "all_reduce";
    check_usable(what);
    TR_CHECK(count >= 0, where(what), ": negative count ", count);
    if (count == 0) return;
    if (world_size() > 1) {
      guarded(what, -1, [&] {
        gloo::AllreduceOptions opts(ctx_);
        opts.setOutput(buf, static_cast<size_t>(count));
        // Gloo's ring all-reduce reduces each segment on one rank and then
        // forwards the finished segment, so every rank ends with the same
        // bits, and the schedule is fixed, so runs are reproducible.
        opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
        if (op == ReduceOp::Max) {
          opts.setReduceFunction([](void* c, const void* a, const void* b, size_t n) {
            reduce_max(static_cast<float*>(c), static_cast<const float*>(a), static_cast<const float*>(b), n);
          });
        } else {
          opts.setReduceFunction([](void* c, const void* a, const void* b, size_t n) {
            reduce_sum(static_cast<float*>(c), static_cast<const float*>(a), static_cast<const float*>(b), n);
          });
        }
        opts.setTimeout(timeout_);
        gloo::allreduce(opts);
      });
    }
    if (op == ReduceOp::Avg) scale_avg(buf, count);
  }

  // Ring reduce-scatter. Gloo's own reduce_scatter (gloo/reduce_scatter.h)
  // is a halving-doubling algorithm over a power-of-two number of ranks with
  // its own placement of results, not "rank r gets slice r for any world
  // size", which is what the sharded optimizer needs. The ring gives that for
  // every W, moves the bandwidth-optimal (W-1)/W of the data per rank, and
  // reduces each element in a fixed order: slice c's sum is accumulated as
  // ((x[c+1] + x[c+2]) + ...) + x[c] (ranks mod W), the same on every run, so
  // training is bit-reproducible for a given world size.
  //
  // Step s (0..W-2): rank r sends its running partial of slice (r-s-1) to
  // rank r+1 and receives the partial of slice (r-s-2) from rank r-1, to
  // which it adds its own contribution. After W-1 steps the partial it
  // received last is slice r, complete. Large slices go round in pieces of
  // kRingPieceFloats so scratch memory stays bounded.
  void reduce_scatter(float* out, const float* in, int64_t count_per_rank, ReduceOp op) override {
    const char* what = "reduce_scatter";
    check_usable(what);
    TR_CHECK(count_per_rank >= 0, where(what), ": negative count ", count_per_rank);
    if (count_per_rank == 0) return;
    const int W = world_size(), r = rank();
    const int64_t n = count_per_rank;
    if (W == 1) {
      if (out != in) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
      return;  // Avg over one rank is the identity
    }
    const int next = (r + 1) % W, prev = (r - 1 + W) % W;
    auto mod = [W](int64_t x) { return static_cast<int>(((x % W) + W) % W); };
    const int64_t piece = std::min(n, kRingPieceFloats);
    if (static_cast<int64_t>(scratch_.size()) < 2 * piece) scratch_.assign(static_cast<size_t>(2 * piece), 0.f);
    float* bufs[2] = {scratch_.data(), scratch_.data() + piece};
    const uint64_t slot = gloo::Slot::build(kRingReduceScatterSlotPrefix, 0);

    guarded(what, -1, [&] {
      // Gloo only sends from `in` (never writes it); its API takes void*.
      auto in_ub = ctx_->createUnboundBuffer(const_cast<float*>(in), static_cast<size_t>(W * n) * sizeof(float));
      std::unique_ptr<gloo::transport::UnboundBuffer> ub[2] = {
          ctx_->createUnboundBuffer(bufs[0], static_cast<size_t>(piece) * sizeof(float)),
          ctx_->createUnboundBuffer(bufs[1], static_cast<size_t>(piece) * sizeof(float))};
      for (int64_t o = 0; o < n; o += piece) {
        const int64_t len = std::min(piece, n - o);
        const size_t bytes = static_cast<size_t>(len) * sizeof(float);
        for (int s = 0; s < W - 1; ++s) {
          const int send_chunk = mod(r - s - 1), recv_chunk = mod(r - s - 2);
          const int rb = s & 1, sb = rb ^ 1;  // receive into one buffer while the other is sent
          gloo::transport::UnboundBuffer* sender = s == 0 ? in_ub.get() : ub[sb].get();
          const size_t send_off = s == 0 ? static_cast<size_t>(send_chunk * n + o) * sizeof(float) : 0;
          // Post both, then wait: every rank posts before it blocks, so the
          // ring cannot deadlock (a tcp send completes only once the peer
          // has posted the matching receive).
          wait_on(what, prev, [&] { ub[rb]->recv(prev, slot, 0, bytes); });
          wait_on(what, next, [&] { sender->send(next, slot, send_off, bytes); });
          wait_on(what, prev, [&] { ub[rb]->waitRecv(timeout_); });
          const float* own = in + recv_chunk * n + o;
          if (op == ReduceOp::Max) reduce_max(bufs[rb], bufs[rb], own, static_cast<size_t>(len));
          else reduce_sum(bufs[rb], bufs[rb], own, static_cast<size_t>(len));
          wait_on(what, next, [&] { sender->waitSend(timeout_); });
        }
        const float* done = bufs[(W - 2) & 1];
        std::memcpy(out + o, done, bytes);  // out may alias in's slice r: read above, written only now
      }
    });
    if (op == ReduceOp::Avg) scale_avg(out, n);
  }

  void all_gather(void* out, const void* in, size_t bytes_per_rank) override {
    const char* what = "all_gather";
    check_usable(what);
    if (bytes_per_rank == 0) return;
    auto* dst = static_cast<uint8_t*>(out) + static_cast<size_t>(rank()) * bytes_per_rank;
    if (dst != in) std::memmove(dst, in, bytes_per_rank);
    if (world_size() == 1) return;
    guarded(what, -1, [&] {
      // In place (no input buffer): our piece is already at out + rank*bytes.
      gloo::AllgatherOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(out), bytes_per_rank * static_cast<size_t>(world_size()));
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }

  void all_to_all(void* out, const void* in, size_t bytes_per_rank) override {
    all_to_all_as("all_to_all", out, in, bytes_per_rank);
  }

  // all_to_all under another collective's name (all_to_all_v's size exchange).
  void all_to_all_as(const char* what, void* out, const void* in, size_t bytes_per_rank) {
    check_usable(what);
    if (bytes_per_rank == 0) return;
    const size_t total = bytes_per_rank * static_cast<size_t>(world_size());
    if (world_size() == 1) return void(std::memmove(out, in, bytes_per_rank));
    guarded(what, -1, [&] {
      gloo::AlltoallOptions opts(ctx_);
      // Gloo only reads its input; its API takes a non-const pointer.
      opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), total);
      opts.setOutput(static_cast<uint8_t*>(out), total);
      opts.setTimeout(timeout_);
      gloo::alltoall(opts);
    });
  }

  // Gloo completes a receive posted longer than the message that arrives
  // (a short read, no error), so the sizes travel first: one all_to_all of
  // W counts, which on the CPU costs far less than the rows that follow. A
  // rank whose recv_bytes disagree with what its peers announce still takes
  // part in the exchange (into scratch, at the announced sizes) so the
  // others complete, then fails naming the peer and both sizes.
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    const char* what = "all_to_all_v";
    check_usable(what);
    const int W = world_size();
    if (W == 1) {
      TR_CHECK(recv_bytes[0] == send_bytes[0], where(what), ": receives ", recv_bytes[0],
               " bytes from itself but sends ", send_bytes[0]);
      if (send_bytes[0] > 0) std::memmove(out, in, send_bytes[0]);
      return;
    }
    std::vector<uint64_t> announce(send_bytes, send_bytes + W), announced(static_cast<size_t>(W));
    all_to_all_as(what, announced.data(), announce.data(), sizeof(uint64_t));
    int wrong = -1;
    std::vector<int64_t> sends(static_cast<size_t>(W)), recvs(static_cast<size_t>(W));
    size_t send_total = 0, recv_total = 0;
    for (int p = 0; p < W; ++p) {
      if (wrong < 0 && announced[size_t(p)] != recv_bytes[p]) wrong = p;
      sends[size_t(p)] = int64_t(send_bytes[p]);
      recvs[size_t(p)] = int64_t(announced[size_t(p)]);
      send_total += send_bytes[p];
      recv_total += announced[size_t(p)];
    }
    std::vector<uint8_t> scratch(wrong >= 0 ? recv_total : 0);
    // Gloo's buffers must be non-null even when every size is 0 (the
    // exchange still runs: a peer may send to us while we send nothing).
    uint8_t dummy_in = 0, dummy_out = 0;
    uint8_t* src = send_total ? static_cast<uint8_t*>(const_cast<void*>(in)) : &dummy_in;
    uint8_t* dst = wrong >= 0 ? (recv_total ? scratch.data() : &dummy_out)
                              : (recv_total ? static_cast<uint8_t*>(out) : &dummy_out);
    guarded(what, -1, [&] {
      gloo::AlltoallvOptions opts(ctx_);
      opts.setInput(src, sends);  // Gloo only reads its input; its API takes a non-const pointer
      opts.setOutput(dst, recvs);
      opts.setTimeout(timeout_);
      gloo::alltoallv(opts);
    });
    TR_CHECK(wrong < 0, where(what), ": rank ", wrong, " sends ", wrong < 0 ? 0 : announced[size_t(wrong)],
             " bytes here but this rank expects ", wrong < 0 ? 0 : recv_bytes[wrong],
             "; the ranks disagree on the sizes (exchange the counts first, from the same routing)");
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    const char* what = "broadcast";
    check_usable(what);
    TR_CHECK(root >= 0 && root < world_size(), where(what), ": root ", root, " is not a rank of a group of ",
             world_size());
    if (bytes == 0 || world_size() == 1) return;
    guarded(what, -1, [&] {
      gloo::BroadcastOptions opts(ctx_);
      opts.setOutput(static_cast<uint8_t*>(buf), bytes);
      opts.setRoot(root);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  void send_recv(const void* send_buf, size_t send_bytes, int send_to, void* recv_buf, size_t recv_bytes,
                 int recv_from, uint32_t tag) override {
    const char* what = "send_recv";
    check_usable(what);
    const int W = world_size(), r = rank();
    for (int peer : {send_to, recv_from})
      TR_CHECK(peer >= -1 && peer < W, where(what), ": peer ", peer, " is not a rank of a group of ", W);
    if (send_to == r || recv_from == r) {
      // To itself: only as a matched pair (a stage of one), a copy.
      TR_CHECK(send_to == r && recv_from == r && send_bytes == recv_bytes, where(what),
               ": a rank sends to itself only with a matching receive from itself of the same size");
      if (send_bytes) std::memmove(recv_buf, send_buf, send_bytes);
      return;
    }
    const bool sending = send_to >= 0 && send_bytes > 0, receiving = recv_from >= 0 && recv_bytes > 0;
    if (!sending && !receiving) return;
    const uint64_t slot = gloo::Slot::build(kPointToPointSlotPrefix, tag);
    guarded(what, -1, [&] {
      std::unique_ptr<gloo::transport::UnboundBuffer> sb, rb;
      // Post both before waiting (see the header): the receive first.
      if (receiving) {
        rb = ctx_->createUnboundBuffer(recv_buf, recv_bytes);
        wait_on(what, recv_from, [&] { rb->recv(recv_from, slot, 0, recv_bytes); });
      }
      if (sending) {
        // Gloo only reads a buffer it sends; its API takes void*.
        sb = ctx_->createUnboundBuffer(const_cast<void*>(send_buf), send_bytes);
        wait_on(what, send_to, [&] { sb->send(send_to, slot, 0, send_bytes); });
      }
      if (receiving) wait_on(what, recv_from, [&] { rb->waitRecv(timeout_); });
      if (sending) wait_on(what, send_to, [&] { sb->waitSend(timeout_); });
    });
  }

  void barrier() override {
    const char* what = "barrier";
    check_usable(what);
    if (world_size() == 1) return;
    guarded(what, -1, [&] {
      gloo::BarrierOptions opts(ctx_);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  // "reduce_scatter (step 12, rank 1 of 4)"
  std::string where(const char* op) const { return describe(op); }

  void check_usable(const char* op) const {
    if (!broken_.empty())
      TR_FAIL(where(op), ": the communicator is unusable after an earlier failure: ", broken_);
  }

  static void scale_avg_impl(float* buf, int64_t count, int world) {
    // Division, not multiplication by 1/W: correctly rounded, so e.g. an
    // average of identical values is exactly that value.
    const float w = static_cast<float>(world);
    for (int64_t i = 0; i < count; ++i) buf[i] /= w;
  }
  void scale_avg(float* buf, int64_t count) const {
    if (world_size() > 1) scale_avg_impl(buf, count, world_size());
  }

  // Runs a wait that involves `peer`; a Gloo failure there is reported as
  // "waiting for rank <peer>".
  template <typename F>
  void wait_on(const char* op, int peer, F&& f) {
    try {
      f();
    } catch (const trainrun::Error&) {
      throw;
    } catch (const gloo::EnforceNotMet& e) {
      fail(op, peer, e.what());
    } catch (const std::exception& e) {
      fail(op, peer, e.what());
    }
  }

  // Runs a whole collective; a Gloo failure is translated (peer unknown
  // unless an inner wait_on already named it).
  template <typename F>
  void guarded(const char* op, int peer, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    op_start_ = t0;
    wait_on(op, peer, std::forward<F>(f));
  }

  [[noreturn]] void fail(const char* op, int peer, const std::string& gloo_msg) {
    const std::string cause = strip_gloo_location(gloo_msg);
    const std::string who = peer >= 0 ? detail::cat("rank ", peer) : std::string("a peer");
    const auto elapsed =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - op_start_);
    const std::string t = format_duration(timeout_);
    std::string msg;
    switch (classify(cause)) {
      case FailKind::Timeout:
        msg = detail::cat(where(op), ": timed out after ", t, " waiting for ", who,
                          "; a peer may be hung or dead (see its log)");
        break;
      case FailKind::PeerLost:
        msg = detail::cat(where(op), ": lost the connection to ", who, " after ", format_duration(elapsed),
                          " (timeout ", t, "); ", who,
                          " probably timed out waiting for another rank, crashed or exited (see its log)");
        break;
      case FailKind::EarlierTimeout:
        msg = detail::cat(where(op), ": timed out (timeout ", t,
                          "): an operation on this communicator timed out and Gloo closed all its connections");
        break;
      case FailKind::Other:
        msg = detail::cat(where(op), ": failed while communicating with ", who, " (timeout ", t, ")");
        break;
    }
    msg += detail::cat(" [gloo: ", cause, "]");
    broken_ = msg;
    throw Error(msg);
  }

  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::vector<float> scratch_;  // ring reduce-scatter pieces (2 * piece floats)
  std::string broken_;          // first failure; non-empty = context unusable
  std::chrono::steady_clock::time_point op_start_{};
};

// Gloo writes to sockets with writev(2), which raises SIGPIPE when a peer has
// gone away; the default action would kill this worker silently instead of
// letting it report which peer died. Ignore SIGPIPE unless the program
// installed its own handler (the write then fails with EPIPE, which Gloo
// turns into an IoException that we translate).
void ignore_sigpipe_once() {
  static const bool done = [] {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)done;
}

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(Store& store, const std::string& prefix, int rank, int world,
                                                     const std::string& host, std::chrono::milliseconds timeout) {
  const std::string where =
      detail::cat("gloo rendezvous (prefix '", prefix, "', rank ", rank, " of ", world, ")");
  TR_CHECK(world >= 1, where, ": world size must be at least 1");
  TR_CHECK(rank >= 0 && rank < world, where, ": rank out of range");
  TR_CHECK(timeout.count() > 0, where, ": timeout must be positive");
  ignore_sigpipe_once();

  std::shared_ptr<gloo::transport::Device> dev;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    dev = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    TR_FAIL(where, ": cannot create a TCP transport bound to '", host,
            "' (check that it is an address of this machine): ", strip_gloo_location(e.what()));
  }

  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, world);
  ctx->setTimeout(timeout);
  GlooStoreBridge bridge(store, timeout);
  gloo::rendezvous::PrefixStore prefixed(prefix, bridge);
  try {
    ctx->connectFullMesh(prefixed, dev);
  } catch (const std::exception& e) {
    // Gloo publishes one key per rank (its rank number, under the prefix).
    // Name the ranks whose key never appeared: those are the ones to look at.
    std::string missing;
    int n_missing = 0;
    try {
      for (int r = 0; r < world; ++r) {
        if (r == rank) continue;
        bool present = false;
        for (const std::string& key : {prefix + "/" + std::to_string(r), prefix + std::to_string(r)})
          present = present || store.check(key);
        if (!present) {
          missing += detail::cat(n_missing ? ", " : "", r);
          ++n_missing;
        }
      }
    } catch (const std::exception&) {
      n_missing = 0;  // the store itself is gone; report the original failure only
    }
    const std::string cause = strip_gloo_location(e.what());
    if (n_missing > 0)
      TR_FAIL(where, ": rank", n_missing > 1 ? "s " : " ", missing, " of ", world, " did not arrive within ",
              format_duration(timeout), "; check that every worker started and reached the rendezvous (",
              cause, ")");
    TR_FAIL(where, ": could not connect to the other ranks within ", format_duration(timeout),
            " (binding '", host, "'): ", cause);
  }

  auto comm = std::make_unique<GlooCommunicator>(ctx, prefix, timeout);
  // Once every rank has passed this barrier, all of them have read every
  // address key, so each rank removes the keys it published: the store does
  // not accumulate one key per rank per communicator over a long job.
  comm->barrier();
  for (const auto& key : bridge.set_keys()) {
    try {
      store.remove(key);
    } catch (const std::exception&) {
      // Cleanup only: a store that cannot remove keys is not fatal.
    }
  }
  return comm;
}

#endif  // TRAINRUN_HAVE_GLOO

}  // namespace trainrun
