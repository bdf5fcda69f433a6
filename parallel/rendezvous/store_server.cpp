// TcpStoreServer: one background thread runs a poll() loop over the listening
// socket, a wake-up pipe and every client. Blocking requests (get, wait) never
// block the loop: they are parked on their connection and answered when a
// later set/add/compare_set creates the keys, or with Timeout at the client's
// deadline. The protocol is described in store_proto.h.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/common/error.h"
#include "core/common/log.h"
#include "parallel/rendezvous/store.h"
#include "parallel/rendezvous/store_proto.h"

namespace trainrun {

using namespace store_proto;

namespace {
// A peer that connects must present the secret this quickly; otherwise it is
// dropped, so half-open or stray connections do not accumulate.
constexpr Millis kHelloTimeout = std::chrono::seconds(10);

bool parse_int64(const std::vector<uint8_t>& v, int64_t* out) {
  std::string s(v.begin(), v.end());
  if (s.empty() || s.size() > 20) return false;
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = x;
  return true;
}

std::string quote_value(const std::vector<uint8_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 40; ++i) s += (v[i] >= 32 && v[i] < 127) ? char(v[i]) : '?';
  if (v.size() > 40) s += "...";
  return "'" + s + "'";
}
}  // namespace

struct TcpStoreServer::Impl {
  std::string address;
  int port = 0;
  std::string secret;
  int listen_fd = -1;
  int wake_rd = -1, wake_wr = -1;
  std::atomic<bool> stop{false};
  std::thread thread;

  // ---- state owned by the loop thread ----
  struct Conn {
    int fd = -1;
    std::string peer;
    bool authed = false;
    Clock::time_point hello_deadline;
    std::vector<uint8_t> in;
    std::vector<uint8_t> out;
    size_t out_pos = 0;
    bool closing = false;  // close once `out` is flushed (after a Rejected reply)
    bool dead = false;
    // The parked get/wait, if any. Watch registration follows `cursor`: the
    // connection is listed under keys[cursor], the first key not yet seen, so
    // each set only touches the waiters that could advance (O(keys) overall
    // even when 1000 ranks wait for 1000 keys).
    bool pending = false;
    uint64_t pending_seq = 0;
    uint8_t pending_op = 0;
    std::vector<std::string> keys;
    size_t cursor = 0;
    Clock::time_point deadline;
  };
  struct Watch {
    uint64_t conn;
    uint64_t seq;
  };
  std::map<uint64_t, Conn> conns;
  uint64_t next_conn_id = 1;
  uint64_t next_seq = 1;
  // Written only by the loop thread, in handle_request, under data_mu;
  // keys() reads it from other threads under the same lock.
  std::unordered_map<std::string, std::vector<uint8_t>> data;
  mutable std::mutex data_mu;
  std::unordered_map<std::string, std::vector<Watch>> watchers;
  Clock::time_point accept_paused_until{};
  bool unparked = false;  // a parked request was answered during this sweep

  void run();
  void loop_once();
  void accept_all();
  void read_conn(uint64_t id, Conn& c);
  void process_input(uint64_t id, Conn& c);
  void handle_hello(Conn& c, Reader& r);
  void handle_request(uint64_t id, Conn& c, Reader& r);
  void send(Conn& c, std::vector<uint8_t>& frame);
  void flush(Conn& c);
  void drop(Conn& c, const std::string& why_warn);
  void park(uint64_t id, Conn& c, uint8_t op, std::vector<std::string> keys, uint64_t timeout_ms);
  bool advance(uint64_t id, Conn& c);  // true if all keys present (and replied)
  void unwatch(uint64_t id, Conn& c);
  void notify(const std::string& key);
  void expire(Clock::time_point now);
  void close_all();
};

// ---- public API -----------------------------------------------------------------

TcpStoreServer::TcpStoreServer(const std::string& bind_addr, int port, const std::string& secret)
    : impl_(std::make_unique<Impl>()) {
  TR_CHECK(!secret.empty(),
           "rendezvous store: refusing to serve with an empty secret; generate one with make_job_secret() "
           "(workers read it from TRAINRUN_STORE_SECRET)");
  TR_CHECK(port >= 0 && port <= 65535, "rendezvous store: port ", port, " is out of range (0-65535)");
  Impl& m = *impl_;
  m.secret = secret;
  sockaddr_in addr{};
  std::string err;
  TR_CHECK(resolve_ipv4(bind_addr, port, true, &addr, &err), "rendezvous store: cannot bind to '", bind_addr,
           "': ", err, "; set MASTER_ADDR to an IPv4 address or host name of this node");
  // CLOEXEC everywhere: the agent forks workers, which must not inherit the
  // listening socket (a worker outliving the agent would keep the port busy).
  m.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  TR_CHECK_ERRNO(m.listen_fd >= 0, "rendezvous store: socket()");
  int one = 1;
  ::setsockopt(m.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  std::string where = (bind_addr.empty() ? std::string("0.0.0.0") : bind_addr) + ":" + std::to_string(port);
  if (::bind(m.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    int e = errno;
    ::close(m.listen_fd);
    errno = e;
    TR_CHECK_ERRNO(false, "rendezvous store: cannot bind ", where,
                   e == EADDRINUSE ? " (another job or a stale agent may hold MASTER_PORT; pick another port)"
                                   : "");
  }
  if (::listen(m.listen_fd, SOMAXCONN) != 0) {
    int e = errno;
    ::close(m.listen_fd);
    errno = e;
    TR_CHECK_ERRNO(false, "rendezvous store: listen on ", where);
  }
  sockaddr_in bound{};
  socklen_t len = sizeof bound;
  ::getsockname(m.listen_fd, reinterpret_cast<sockaddr*>(&bound), &len);
  m.port = ntohs(bound.sin_port);
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &bound.sin_addr, buf, sizeof buf);
  m.address = buf;
  int p[2];
  if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) {
    int e = errno;
    ::close(m.listen_fd);
    errno = e;
    TR_CHECK_ERRNO(false, "rendezvous store: pipe2()");
  }
  m.wake_rd = p[0];
  m.wake_wr = p[1];
  m.thread = std::thread([&m] { m.run(); });
  TR_LOG_DEBUG("rendezvous store listening on ", m.address, ":", m.port);
}

TcpStoreServer::~TcpStoreServer() {
  Impl& m = *impl_;
  m.stop = true;
  char b = 1;
  ssize_t ignored = ::write(m.wake_wr, &b, 1);
  (void)ignored;
  if (m.thread.joinable()) m.thread.join();
  m.close_all();
  ::close(m.wake_rd);
  ::close(m.wake_wr);
}

std::vector<std::string> TcpStoreServer::keys(const std::string& prefix) const {
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(impl_->data_mu);
    for (const auto& kv : impl_->data)
      if (kv.first.compare(0, prefix.size(), prefix) == 0) out.push_back(kv.first);
  }
  std::sort(out.begin(), out.end());
  return out;
}

int TcpStoreServer::port() const { return impl_->port; }
const std::string& TcpStoreServer::address() const { return impl_->address; }

// ---- the loop ---------------------------------------------------------------------

void TcpStoreServer::Impl::run() {
  try {
    while (!stop.load()) loop_once();
  } catch (const std::exception& e) {
    // Should not happen; if it does, close every client so that they fail
    // now with "connection closed" instead of waiting out their timeouts.
    TR_LOG_WARN("rendezvous store stopped: ", e.what());
  }
  close_all();
}

void TcpStoreServer::Impl::close_all() {
  for (auto& kv : conns)
    if (kv.second.fd >= 0) ::close(kv.second.fd);
  conns.clear();
  watchers.clear();
  if (listen_fd >= 0) ::close(listen_fd);
  listen_fd = -1;
}

void TcpStoreServer::Impl::loop_once() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  fds.push_back({wake_rd, POLLIN, 0});
  Clock::time_point now = Clock::now();
  bool accepting = now >= accept_paused_until;
  fds.push_back({accepting ? listen_fd : -1, POLLIN, 0});
  Clock::time_point next = now + std::chrono::seconds(60);
  if (!accepting) next = std::min(next, accept_paused_until);
  for (auto& kv : conns) {
    Conn& c = kv.second;
    short ev = c.closing ? 0 : POLLIN;
    if (c.out_pos < c.out.size()) ev |= POLLOUT;
    fds.push_back({c.fd, ev, 0});
    ids.push_back(kv.first);
    if (!c.authed) next = std::min(next, c.hello_deadline);
    if (c.pending) next = std::min(next, c.deadline);
  }
  int rc = ::poll(fds.data(), fds.size(), poll_ms_until(next));
  if (rc < 0) {
    TR_CHECK_ERRNO(errno == EINTR, "rendezvous store: poll()");
    return;
  }
  if (fds[0].revents) {
    char buf[64];
    while (::read(wake_rd, buf, sizeof buf) > 0) {
    }
    if (stop.load()) return;
  }
  if (fds[1].revents) accept_all();
  for (size_t i = 0; i < ids.size(); ++i) {
    const pollfd& p = fds[i + 2];
    if (!p.revents) continue;
    auto it = conns.find(ids[i]);
    if (it == conns.end() || it->second.dead) continue;
    Conn& c = it->second;
    if (p.revents & POLLOUT) flush(c);
    if (!c.dead && (p.revents & (POLLIN | POLLHUP | POLLERR))) read_conn(ids[i], c);
  }
  // A reply can unpark a connection that has more requests queued (a
  // pipelining client), so keep processing until nothing moves.
  do {
    unparked = false;
    for (auto& kv : conns)
      if (!kv.second.dead) process_input(kv.first, kv.second);
  } while (unparked);
  expire(Clock::now());
  for (auto it = conns.begin(); it != conns.end();) {
    Conn& c = it->second;
    if (c.closing && !c.dead && c.out_pos >= c.out.size()) {
      ::shutdown(c.fd, SHUT_WR);
      c.dead = true;
    }
    if (c.dead) {
      unwatch(it->first, c);
      ::close(c.fd);
      it = conns.erase(it);
    } else {
      ++it;
    }
  }
}

void TcpStoreServer::Impl::accept_all() {
  for (;;) {
    sockaddr_in peer{};
    socklen_t len = sizeof peer;
    int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) return;
      // Out of descriptors: the pending connection stays in the backlog and
      // poll() would report it again at once, so pause accepting briefly.
      TR_LOG_WARN("rendezvous store: accept() failed: ", detail::errno_string(), "; retrying in 1 s");
      accept_paused_until = Clock::now() + std::chrono::seconds(1);
      return;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Conn c;
    c.fd = fd;
    c.peer = format_peer(peer);
    c.hello_deadline = Clock::now() + kHelloTimeout;
    conns.emplace(next_conn_id++, std::move(c));
  }
}

void TcpStoreServer::Impl::read_conn(uint64_t id, Conn& c) {
  uint8_t buf[65536];
  for (;;) {
    ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n > 0) {
      c.in.insert(c.in.end(), buf, buf + n);
      if (static_cast<size_t>(n) < sizeof buf) break;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0 && errno == EINTR) continue;
    // EOF or error: the client went away (normal at the end of a job).
    if (!c.authed && !c.closing)
      drop(c, "rejected store client " + c.peer + ": closed the connection without sending the secret");
    else
      drop(c, "");
    return;
  }
  process_input(id, c);
}

void TcpStoreServer::Impl::process_input(uint64_t id, Conn& c) {
  size_t pos = 0;
  while (!c.dead && !c.closing && !c.pending && c.in.size() - pos >= 4) {
    uint32_t len = read_be32(c.in.data() + pos);
    uint32_t limit = c.authed ? kMaxFrameBytes : kMaxHelloBytes;
    if (len > limit) {
      if (!c.authed) {
        // Not our protocol (or a hostile peer): no secret, so reject.
        Writer w;
        w.u8(kRejected).u8(kBadHello).str("the first message was not a trainrun store handshake");
        send(c, w.frame());
        c.closing = true;
        TR_LOG_WARN("rejected store client ", c.peer, ": no secret (the first message is not a trainrun handshake)");
      } else {
        drop(c, "rendezvous store: dropping client " + c.peer + ": message of " + std::to_string(len) +
                    " bytes exceeds the limit");
      }
      break;
    }
    if (c.in.size() - pos - 4 < len) break;
    Reader r(c.in.data() + pos + 4, len);
    pos += 4 + size_t(len);
    try {
      if (!c.authed)
        handle_hello(c, r);
      else
        handle_request(id, c, r);
    } catch (const Error& e) {
      drop(c, "rendezvous store: dropping client " + c.peer + ": " + e.what());
    }
  }
  if (pos > 0 && !c.dead) c.in.erase(c.in.begin(), c.in.begin() + pos);
}

void TcpStoreServer::Impl::handle_hello(Conn& c, Reader& r) {
  uint8_t op = r.remaining() >= 1 ? r.u8() : 0;
  uint32_t magic = r.remaining() >= 4 ? r.u32() : 0;
  Writer w;
  if (op != kHello || magic != kMagic) {
    w.u8(kRejected).u8(kBadHello).str("the first message was not a handshake carrying the job secret");
    TR_LOG_WARN("rejected store client ", c.peer, ": no secret (the first message was not a handshake)");
  } else {
    uint32_t version = r.u32();
    std::string secret = r.str();
    if (version != kVersion) {
      w.u8(kRejected).u8(kBadHello).str("store protocol version " + std::to_string(version) +
                                         " is not supported (server speaks " + std::to_string(kVersion) +
                                         "); run the same trainrun build on every node");
      TR_LOG_WARN("rejected store client ", c.peer, ": protocol version ", version, ", expected ", kVersion);
    } else if (!secrets_equal(secret, this->secret)) {
      w.u8(kRejected).u8(kWrongSecret).str("wrong secret");
      TR_LOG_WARN("rejected store client ", c.peer, ": wrong secret");
    } else {
      c.authed = true;
      w.u8(kOk);
      send(c, w.frame());
      return;
    }
  }
  send(c, w.frame());
  c.closing = true;
}

void TcpStoreServer::Impl::handle_request(uint64_t id, Conn& c, Reader& r) {
  std::lock_guard<std::mutex> lock(data_mu);
  uint8_t op = r.u8();
  Writer w;
  switch (op) {
    case kSet: {
      std::string key = r.str();
      data[key] = r.vec();
      w.u8(kOk);
      send(c, w.frame());
      notify(key);
      return;
    }
    case kGet: {
      std::string key = r.str();
      uint64_t timeout_ms = r.u64();
      park(id, c, kGet, {key}, timeout_ms);
      return;
    }
    case kAdd: {
      std::string key = r.str();
      int64_t delta = static_cast<int64_t>(r.u64());
      int64_t cur = 0;
      auto it = data.find(key);
      if (it != data.end() && !parse_int64(it->second, &cur)) {
        w.u8(kFailed).str("key '" + key + "' holds " + quote_value(it->second) + ", not an integer counter");
      } else if ((delta > 0 && cur > INT64_MAX - delta) || (delta < 0 && cur < INT64_MIN - delta)) {
        w.u8(kFailed).str("counter '" + key + "' would overflow");
      } else {
        std::string s = std::to_string(cur + delta);
        data[key] = std::vector<uint8_t>(s.begin(), s.end());
        w.u8(kOk).u64(static_cast<uint64_t>(cur + delta));
        send(c, w.frame());
        notify(key);
        return;
      }
      send(c, w.frame());
      return;
    }
    case kCompareSet: {
      std::string key = r.str();
      std::vector<uint8_t> expected = r.vec();
      std::vector<uint8_t> desired = r.vec();
      auto it = data.find(key);
      if (it == data.end()) {
        if (expected.empty()) {
          data[key] = desired;
          w.u8(kOk).vec(desired);
          send(c, w.frame());
          notify(key);
          return;
        }
        w.u8(kOk).vec({});  // still absent
      } else if (it->second == expected) {
        it->second = desired;
        w.u8(kOk).vec(desired);
      } else {
        w.u8(kOk).vec(it->second);
      }
      send(c, w.frame());
      return;
    }
    case kCheck: {
      std::string key = r.str();
      w.u8(kOk).u8(data.count(key) ? 1 : 0);
      send(c, w.frame());
      return;
    }
    case kRemove: {
      std::string key = r.str();
      w.u8(kOk).u8(data.erase(key) ? 1 : 0);
      send(c, w.frame());
      return;
    }
    case kWait: {
      uint32_t n = r.u32();
      // Each key costs at least 4 bytes on the wire: bound n before reserving.
      TR_CHECK(n <= r.remaining() / 4, "malformed wait request (", n, " keys)");
      std::vector<std::string> keys;
      keys.reserve(n);
      for (uint32_t i = 0; i < n; ++i) keys.push_back(r.str());
      uint64_t timeout_ms = r.u64();
      park(id, c, kWait, std::move(keys), timeout_ms);
      return;
    }
    default:
      w.u8(kFailed).str("unknown store request " + std::to_string(op) +
                        " (client and server builds differ? run the same trainrun on every node)");
      send(c, w.frame());
      return;
  }
}

// ---- parked get/wait ----------------------------------------------------------

void TcpStoreServer::Impl::park(uint64_t id, Conn& c, uint8_t op, std::vector<std::string> keys,
                                uint64_t timeout_ms) {
  c.pending = true;
  c.pending_seq = next_seq++;
  c.pending_op = op;
  c.keys = std::move(keys);
  c.cursor = 0;
  c.deadline = Clock::now() + Millis(std::min<uint64_t>(timeout_ms, uint64_t(kMaxWait.count())));
  advance(id, c);
}

bool TcpStoreServer::Impl::advance(uint64_t id, Conn& c) {
  for (;;) {
    while (c.cursor < c.keys.size() && data.count(c.keys[c.cursor])) ++c.cursor;
    if (c.cursor < c.keys.size()) {
      watchers[c.keys[c.cursor]].push_back({id, c.pending_seq});
      return false;
    }
    // Keys before the cursor may have been removed since they were seen; the
    // contract is "all present at once", so re-check before answering.
    size_t first_missing = c.keys.size();
    for (size_t i = 0; i < c.keys.size(); ++i)
      if (!data.count(c.keys[i])) {
        first_missing = i;
        break;
      }
    if (first_missing == c.keys.size()) break;
    c.cursor = first_missing;
  }
  Writer w;
  w.u8(kOk);
  if (c.pending_op == kGet) w.vec(data[c.keys[0]]);
  c.pending = false;
  c.keys.clear();
  send(c, w.frame());
  unparked = true;
  return true;
}

void TcpStoreServer::Impl::notify(const std::string& key) {
  auto it = watchers.find(key);
  if (it == watchers.end()) return;
  std::vector<Watch> ws = std::move(it->second);
  watchers.erase(it);
  for (const Watch& w : ws) {
    auto ct = conns.find(w.conn);
    if (ct == conns.end()) continue;
    Conn& c = ct->second;
    if (c.dead || !c.pending || c.pending_seq != w.seq) continue;
    advance(w.conn, c);
  }
}

void TcpStoreServer::Impl::unwatch(uint64_t id, Conn& c) {
  if (!c.pending || c.cursor >= c.keys.size()) return;
  auto it = watchers.find(c.keys[c.cursor]);
  if (it == watchers.end()) return;
  auto& v = it->second;
  v.erase(std::remove_if(v.begin(), v.end(), [&](const Watch& w) { return w.conn == id; }), v.end());
  if (v.empty()) watchers.erase(it);
}

void TcpStoreServer::Impl::expire(Clock::time_point now) {
  for (auto& kv : conns) {
    Conn& c = kv.second;
    if (c.dead) continue;
    if (!c.authed && !c.closing && now >= c.hello_deadline) {
      drop(c, "rejected store client " + c.peer + ": no secret within " + format_duration(kHelloTimeout));
      continue;
    }
    if (c.pending && now >= c.deadline) {
      unwatch(kv.first, c);
      Writer w;
      w.u8(kTimeout);
      if (c.pending_op == kWait) {
        std::vector<const std::string*> missing;
        for (const auto& k : c.keys)
          if (!data.count(k)) missing.push_back(&k);
        w.u32(static_cast<uint32_t>(missing.size()));
        for (const auto* k : missing) w.str(*k);
      }
      c.pending = false;
      c.keys.clear();
      send(c, w.frame());
    }
  }
}

// ---- output ---------------------------------------------------------------------

void TcpStoreServer::Impl::send(Conn& c, std::vector<uint8_t>& frame) {
  if (c.dead) return;
  if (c.out_pos >= c.out.size()) {
    c.out.clear();
    c.out_pos = 0;
  }
  c.out.insert(c.out.end(), frame.begin(), frame.end());
  flush(c);
}

void TcpStoreServer::Impl::flush(Conn& c) {
  while (c.out_pos < c.out.size()) {
    ssize_t n = ::send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
    if (n > 0) {
      c.out_pos += size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // poll for POLLOUT
    drop(c, "");  // peer gone
    return;
  }
  c.out.clear();
  c.out_pos = 0;
}

void TcpStoreServer::Impl::drop(Conn& c, const std::string& why_warn) {
  if (c.dead) return;
  if (!why_warn.empty()) TR_LOG_WARN(why_warn);
  c.dead = true;  // closed and erased at the end of this loop iteration
}

}  // namespace trainrun
