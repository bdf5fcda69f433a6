// The TCP store client (connect_tcp_store), wait_for_ranks, make_job_secret
// and the socket helpers shared with the server (store_server.cpp). The wire
// protocol is described in store_proto.h.
#include "parallel/rendezvous/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/common/error.h"
#include "core/common/log.h"
#include "parallel/rendezvous/store_proto.h"

namespace trainrun {

// ---- helpers shared with the server ------------------------------------------------

namespace store_proto {

std::string format_duration(Millis d) {
  long long ms = d.count();
  if (ms < 1000) return std::to_string(ms) + " ms";
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", double(ms) / 1000.0);
  return buf;
}

std::string format_peer(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

bool resolve_ipv4(const std::string& host, int port, bool passive, sockaddr_in* out, std::string* err) {
  *out = sockaddr_in{};
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() && passive) {
    out->sin_addr.s_addr = htonl(INADDR_ANY);
    return true;
  }
  if (::inet_pton(AF_INET, host.c_str(), &out->sin_addr) == 1) return true;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) {
    *err = std::string("cannot resolve host name '") + host + "': " + (rc ? ::gai_strerror(rc) : "no IPv4 address");
    if (res) ::freeaddrinfo(res);
    return false;
  }
  out->sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return true;
}

bool secrets_equal(const std::string& a, const std::string& b) {
  // No early exit: the time taken must not reveal how long a prefix matched.
  size_t n = std::max(a.size(), b.size());
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | (x ^ y);
  }
  return diff == 0;
}

int poll_ms_until(Clock::time_point t) {
  auto now = Clock::now();
  if (t <= now) return 0;
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(t - now).count();
  long long ms = (us + 999) / 1000;
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

}  // namespace store_proto

using namespace store_proto;

// ---- client -----------------------------------------------------------------------

namespace {

// Bound on a non-blocking request's round trip (set, add, ...): the server
// answers these at once, so silence this long means it or the network is gone.
constexpr Millis kIoTimeout = std::chrono::seconds(60);
// Added to a get/wait's own timeout on the client side: the server answers
// Timeout at the deadline, and the client only gives up on the connection if
// even that answer does not come.
constexpr Millis kReplyGrace = std::chrono::seconds(5);
// The handshake reply gets at least this long even when connect_timeout is
// nearly used up by retries.
constexpr Millis kMinHandshake = std::chrono::seconds(2);

std::string quote_keys(const std::vector<std::string>& keys, size_t max_listed = 16) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < max_listed; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > max_listed) s += ", ... (" + std::to_string(keys.size() - max_listed) + " more)";
  return s;
}

Clock::time_point deadline_after(Millis timeout, Millis extra) {
  Millis t = std::min(std::max(timeout, Millis(0)), kMaxWait);
  return Clock::now() + t + extra;
}

class TcpStoreClient : public Store {
 public:
  TcpStoreClient(int fd, std::string where, Millis io_timeout)
      : fd_(fd), where_(std::move(where)), io_timeout_(io_timeout) {}
  ~TcpStoreClient() override {
    if (fd_ >= 0) ::close(fd_);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    Writer w;
    w.u8(kSet).str(key).vec(value);
    expect_ok(call("set('" + key + "')", w, deadline_after(io_timeout_, Millis(0))));
  }

  std::vector<uint8_t> get(const std::string& key, Millis timeout) override {
    Writer w;
    w.u8(kGet).str(key).u64(wire_timeout(timeout));
    std::string what = "get('" + key + "')";
    Reply r = call(what, w, deadline_after(timeout, kReplyGrace));
    if (r.status == kTimeout)
      throw StoreTimeoutError(detail::cat("store ", what, ": key '", key, "' did not appear within ",
                                          format_duration(timeout), " (rendezvous store at ", where_, ")"));
    expect_ok(r);
    return r.body().vec();
  }

  int64_t add(const std::string& key, int64_t delta) override {
    Writer w;
    w.u8(kAdd).str(key).u64(static_cast<uint64_t>(delta));
    Reply r = call("add('" + key + "')", w, deadline_after(io_timeout_, Millis(0)));
    expect_ok(r);
    return static_cast<int64_t>(r.body().u64());
  }

  std::vector<uint8_t> compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                   const std::vector<uint8_t>& desired) override {
    Writer w;
    w.u8(kCompareSet).str(key).vec(expected).vec(desired);
    Reply r = call("compare_set('" + key + "')", w, deadline_after(io_timeout_, Millis(0)));
    expect_ok(r);
    return r.body().vec();
  }

  bool check(const std::string& key) override {
    Writer w;
    w.u8(kCheck).str(key);
    Reply r = call("check('" + key + "')", w, deadline_after(io_timeout_, Millis(0)));
    expect_ok(r);
    return r.body().u8() != 0;
  }

  bool remove(const std::string& key) override {
    Writer w;
    w.u8(kRemove).str(key);
    Reply r = call("remove('" + key + "')", w, deadline_after(io_timeout_, Millis(0)));
    expect_ok(r);
    return r.body().u8() != 0;
  }

  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    if (keys.empty()) return;
    Writer w;
    w.u8(kWait).u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) w.str(k);
    w.u64(wire_timeout(timeout));
    std::string what = keys.size() == 1 ? "wait('" + keys[0] + "')" : "wait(" + std::to_string(keys.size()) + " keys)";
    Reply r = call(what, w, deadline_after(timeout, kReplyGrace));
    if (r.status == kTimeout) {
      Reader b = r.body();
      uint32_t n = b.u32();
      std::vector<std::string> missing;
      for (uint32_t i = 0; i < n; ++i) missing.push_back(b.str());
      throw StoreTimeoutError(detail::cat("store wait: ", missing.size(), " of ", keys.size(), " key",
                                          keys.size() == 1 ? "" : "s", " still missing after ",
                                          format_duration(timeout), ": ", quote_keys(missing),
                                          " (rendezvous store at ", where_, ")"));
    }
    expect_ok(r);
  }

  // Sends Hello and checks the answer; called once by connect_tcp_store.
  void handshake(const std::string& secret, Clock::time_point deadline) {
    Writer w;
    w.u8(kHello).u32(kMagic).u32(kVersion).str(secret);
    std::string why;
    if (!send_all(w.frame(), deadline, &why) || !recv_frame(deadline, &why)) {
      if (why == "connection closed")
        TR_FAIL("the rendezvous store at ", where_,
                " closed the connection during the handshake: it may have rejected our secret (check "
                "TRAINRUN_STORE_SECRET matches the node-0 agent's) or another program is listening on that port");
      TR_FAIL("handshake with the rendezvous store at ", where_, " failed: ", why,
              "; is the node-0 agent running and MASTER_ADDR/MASTER_PORT right?");
    }
    Reader r(buf_.data(), buf_.size());
    uint8_t status = r.u8();
    if (status == kOk) return;
    TR_CHECK(status == kRejected, "the rendezvous store at ", where_, " sent an unexpected handshake reply (",
             int(status), "); is another program listening on that port?");
    uint8_t reason = r.u8();
    std::string text = r.str();
    if (reason == kWrongSecret)
      TR_FAIL("the rendezvous store at ", where_,
              " rejected our secret; check TRAINRUN_STORE_SECRET (every worker must get the secret of the job "
              "whose agent hosts the store; is another job using the same MASTER_PORT?)");
    TR_FAIL("the rendezvous store at ", where_, " rejected the connection: ", text);
  }

 private:
  // Owns its payload: the shared receive buffer is reused by the next call
  // as soon as the lock is released.
  struct Reply {
    uint8_t status = 0;
    std::string what;
    std::vector<uint8_t> payload;
    Reader body() const {  // positioned after the status byte
      Reader r(payload.data(), payload.size());
      r.u8();
      return r;
    }
  };

  static uint64_t wire_timeout(Millis t) {
    return static_cast<uint64_t>(std::min(std::max(t, Millis(0)), kMaxWait).count());
  }

  // One request/response round trip. The mutex serialises callers: the
  // protocol has one request in flight per connection. A reply that does not
  // arrive by `deadline`, or a closed connection, leaves the stream in an
  // unknown state, so the client is marked broken and later calls fail fast.
  Reply call(const std::string& what, Writer& w, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    TR_CHECK(broken_.empty(), "store ", what, ": the connection to the rendezvous store at ", where_,
             " was lost earlier (", broken_, ")");
    std::string why;
    if (!send_all(w.frame(), deadline, &why) || !recv_frame(deadline, &why)) {
      broken_ = why;
      if (why == "no reply in time")
        TR_FAIL("store ", what, ": no reply from the rendezvous store at ", where_,
                " in time; is the node-0 agent alive and the network between the nodes up?");
      TR_FAIL("store ", what, ": lost the connection to the rendezvous store at ", where_, " (", why,
              "); did the node-0 agent exit?");
    }
    Reply rep;
    rep.what = what;
    rep.payload = std::move(buf_);
    buf_.clear();
    rep.status = Reader(rep.payload.data(), rep.payload.size()).u8();
    return rep;
  }

  void expect_ok(const Reply& r) {
    if (r.status == kOk) return;
    if (r.status == kFailed) {
      Reader b = r.body();
      TR_FAIL("store ", r.what, ": ", b.str());
    }
    TR_FAIL("store ", r.what, ": unexpected reply status ", int(r.status), " from the rendezvous store at ", where_);
  }

  // Waits for the socket to be ready; false (with *why) at the deadline.
  bool wait_ready(short events, Clock::time_point deadline, std::string* why) {
    for (;;) {
      pollfd p{fd_, events, 0};
      int rc = ::poll(&p, 1, poll_ms_until(deadline));
      if (rc > 0) return true;
      if (rc == 0) {
        *why = "no reply in time";
        return false;
      }
      if (errno != EINTR) {
        *why = detail::errno_string();
        return false;
      }
    }
  }

  bool send_all(const std::vector<uint8_t>& data, Clock::time_point deadline, std::string* why) {
    size_t off = 0;
    while (off < data.size()) {
      ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += size_t(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!wait_ready(POLLOUT, deadline, why)) return false;
        continue;
      }
      *why = n < 0 && errno == EPIPE ? "connection closed" : detail::errno_string();
      return false;
    }
    return true;
  }

  bool recv_exact(uint8_t* p, size_t len, Clock::time_point deadline, std::string* why) {
    size_t off = 0;
    while (off < len) {
      ssize_t n = ::recv(fd_, p + off, len - off, 0);
      if (n > 0) {
        off += size_t(n);
        continue;
      }
      if (n == 0) {
        *why = "connection closed";
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait_ready(POLLIN, deadline, why)) return false;
        continue;
      }
      *why = errno == ECONNRESET ? "connection closed" : detail::errno_string();
      return false;
    }
    return true;
  }

  bool recv_frame(Clock::time_point deadline, std::string* why) {
    uint8_t hdr[4];
    if (!recv_exact(hdr, 4, deadline, why)) return false;
    uint32_t len = read_be32(hdr);
    if (len == 0 || len > kMaxFrameBytes) {
      *why = "corrupt reply (length " + std::to_string(len) + ")";
      return false;
    }
    buf_.resize(len);
    return recv_exact(buf_.data(), len, deadline, why);
  }

  int fd_;
  std::string where_;
  Millis io_timeout_;
  std::mutex mu_;
  std::string broken_;  // why the connection is unusable; empty while healthy
  std::vector<uint8_t> buf_;
};

// One connection attempt, bounded by the deadline. Returns the fd or -1 with *err.
int try_connect(const sockaddr_in& addr, Clock::time_point deadline, std::string* err) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = detail::errno_string();
    return -1;
  }
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  if (rc != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    do {
      rc = ::poll(&p, 1, poll_ms_until(deadline));
    } while (rc < 0 && errno == EINTR);
    if (rc == 0) {
      *err = "connection attempt timed out";
      ::close(fd);
      return -1;
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
      *err = std::strerror(soerr);
      ::close(fd);
      return -1;
    }
  } else if (rc != 0) {
    *err = detail::errno_string();
    ::close(fd);
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // Keepalive lets a long get/wait notice a node that vanished without a FIN.
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  return fd;
}

}  // namespace

std::unique_ptr<Store> connect_tcp_store(const std::string& host, int port, const std::string& secret,
                                         Millis connect_timeout, Millis io_timeout) {
  TR_CHECK(port > 0 && port <= 65535, "rendezvous store: port ", port,
           " is out of range (1-65535); check MASTER_PORT");
  const std::string where = host + ":" + std::to_string(port);
  const auto start = Clock::now();
  const auto deadline = deadline_after(connect_timeout, Millis(0));
  // The server may start after us (workers on other nodes race the node-0
  // agent), so refused/unreachable/unresolvable are retried until the deadline
  // with a growing pause.
  Millis pause(20);
  std::string last_err;
  int fd = -1;
  for (;;) {
    sockaddr_in addr{};
    if (resolve_ipv4(host, port, false, &addr, &last_err)) fd = try_connect(addr, deadline, &last_err);
    if (fd >= 0) break;
    auto now = Clock::now();
    if (now >= deadline) {
      auto waited = std::chrono::duration_cast<Millis>(now - start);
      TR_FAIL("cannot reach the rendezvous store at ", where, " after ", format_duration(waited), ": ", last_err,
              "; is the node-0 agent running and MASTER_ADDR/MASTER_PORT right?");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, Millis(500));
  }
  auto client = std::make_unique<TcpStoreClient>(fd, where, io_timeout > Millis(0) ? io_timeout : kIoTimeout);
  client->handshake(secret, std::max(deadline, Clock::now() + kMinHandshake));
  return client;
}

// ---- wait_for_ranks ----------------------------------------------------------------

void wait_for_ranks(Store& store, const std::string& prefix, int world, Millis timeout, const std::string& what) {
  std::vector<std::string> keys;
  keys.reserve(world > 0 ? size_t(world) : 0);
  for (int r = 0; r < world; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store.wait(keys, timeout);
    return;
  } catch (const StoreTimeoutError&) {
    // Turn "keys missing" into ranks, which is what the user can act on.
  } catch (const Error& e) {
    TR_FAIL(what, ": ", e.what());
  }
  std::vector<int> missing;
  for (int r = 0; r < world; ++r)
    if (!store.check(keys[size_t(r)])) missing.push_back(r);
  if (missing.empty()) return;  // the last ones arrived just after the deadline
  std::string list;
  const size_t kMaxListed = 32;
  for (size_t i = 0; i < missing.size() && i < kMaxListed; ++i) list += (i ? ", " : "") + std::to_string(missing[i]);
  if (missing.size() > kMaxListed) list += ", ... (" + std::to_string(missing.size() - kMaxListed) + " more)";
  TR_FAIL(what, ": rank", missing.size() == 1 ? " " : "s ", list, " of ", world, " did not arrive within ",
          format_duration(timeout), " (waiting for key '", keys[size_t(missing[0])], "')");
}

// ---- secrets -------------------------------------------------------------------------

std::string make_job_secret() {
  unsigned char raw[16];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  TR_CHECK_ERRNO(fd >= 0, "cannot open /dev/urandom to make the job secret");
  size_t got = 0;
  while (got < sizeof raw) {
    ssize_t n = ::read(fd, raw + got, sizeof raw - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      errno = n == 0 ? EIO : e;
      TR_CHECK_ERRNO(false, "cannot read /dev/urandom to make the job secret");
    }
    got += size_t(n);
  }
  ::close(fd);
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char b : raw) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

}  // namespace trainrun
