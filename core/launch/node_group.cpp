// The agents of a multi-node job; see node_group.h for the protocol (the
// shared-directory files and the first contact are in node_contact.cpp).
//
// Store keys (all under "trainrun/", apart from the workers' "attempt<N>/"):
//   marker             node 0's nonce of this run (the shared-directory check)
//   attempt            the attempt node 0 is at (an agent started late adopts it)
//   final              node 0's exit code once the job ended for good
//   preempted          the first node that got SIGTERM/SIGUSR1 while the nodes
//                      met, a sentence for the log (every node then exits 75)
//   heard/<node>       that node saw "preempted" (node 0 keeps the store up for it)
//   hb/<node>          heartbeat counters
//   a<k>/node/<node>   "host nproc [ip:port]" of each agent that joined attempt k
//                      (ip:port: its liveness socket, which node 0 connects to)
//   a<k>/abort         the first failure of attempt k, a sentence for the log
//   a<k>/done/<node>   exit code of each node whose workers ended
#include "core/launch/node_group.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/common/debug_hooks.h"
#include "core/common/error.h"
#include "core/common/log.h"
#include "core/train/preemption.h"
#include "parallel/rendezvous/net_address.h"

namespace trainrun {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

bool failure_is_consequence(const std::string& error_text) {
  for (const char* sign : {"lost the connection to a peer", "Connection closed by peer", "Connection reset by peer",
                           "timed out", "did not arrive within", "rendezvous store"})
    if (error_text.find(sign) != std::string::npos) return true;
  return false;
}

namespace {


std::string seconds_text(milliseconds d) {
  std::ostringstream os;
  os << double(d.count()) / 1000.0 << " s";
  return os.str();
}

std::string ranks_text(int first, int count) {
  return count == 1 ? "rank " + std::to_string(first)
                    : "ranks " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

// A failure that looks like the consequence of another rank's (a lost
// peer, a timed-out collective) is announced only if nobody announced a
// cause (or node 0 declared a node lost) within this long: a little more
// than the node timeout, at most this.
constexpr milliseconds kMaxConsequenceDelay(10000);

// The heartbeat period: a fifth of the node timeout, within [0.1 s, 1 s].
milliseconds heartbeat_interval(milliseconds node_timeout) {
  return std::clamp(node_timeout / 5, milliseconds(100), milliseconds(1000));
}

// A listening socket on `addr`, port 0 (close-on-exec: workers must not
// hold it), or -1.
int listen_liveness(const std::string& addr, std::string* where) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (::inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1) return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 64) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  *where = addr + ":" + std::to_string(ntohs(a.sin_port));
  return fd;
}

// A connection to "ip:port" within 1 s, or -1.
int connect_liveness(const std::string& where) {
  const auto colon = where.rfind(':');
  if (colon == std::string::npos) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(std::atoi(where.c_str() + colon + 1)));
  if (::inet_pton(AF_INET, where.substr(0, colon).c_str(), &a.sin_addr) != 1) return -1;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
  if (errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int err = 1;
    socklen_t len = sizeof err;
    if (::poll(&p, 1, 1000) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) return fd;
  }
  ::close(fd);
  return -1;
}

// Whether the peer of a liveness connection has gone (EOF or an error).
bool liveness_lost(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) != 1) return false;
  char b;
  const ssize_t n = ::recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace

milliseconds node_timeout(const JobSpec& job) {
  return std::max(milliseconds(1000), milliseconds(int64_t(job.parallel.timeout_s * 500)));
}

// ---- NodeGroup --------------------------------------------------------------------------

NodeGroup::NodeGroup(const JobSpec& job, const LaunchPlan& plan, const StopPoll& stop)
    : job_(job), plan_(plan), stop_(stop), node_timeout_(node_timeout(job)) {
  const EnvMap env = current_environment();
  const auto timeout = milliseconds(int64_t(job.parallel.timeout_s * 1000));
  if (plan_.node_rank == 0) {
    secret_ = secret_for_new_store(env);
    // All interfaces: the address other nodes dial may not be the one this
    // host's name resolves to here (Debian maps it to 127.0.1.1). The
    // secret guards the port.
    server_ = std::make_unique<TcpStoreServer>("", plan_.master_port, secret_);
    try {
      store_ = connect_tcp_store(plan_.master_addr, plan_.master_port, secret_, milliseconds(5000), node_timeout_);
    } catch (const Error& e) {
      TR_FAIL("node 0 cannot reach its own rendezvous store at ", plan_.master_addr, ":", plan_.master_port, " (",
              e.what(), "); is launcher.master_addr (--master-addr) an address of this host?");
    }
    publish_rendezvous(*store_, job.output.dir, secret_, plan_.host, plan_.master_addr, plan_.master_port);
  } else {
    Node0Contact c = contact_node0(job.output.dir, plan_.master_addr, plan_.master_port, env, timeout, node_timeout_,
                                   "node " + std::to_string(plan_.node_rank) + " (host " + plan_.host + ")", stop_);
    store_ = std::move(c.store);
    secret_ = c.secret;
  }
  auto gloo = env.find("TRAINRUN_GLOO_HOST");
  bind_addr_ =
      gloo != env.end() && !gloo->second.empty() ? gloo->second : worker_bind_address(plan_.master_addr, &bind_note_);
  hosts_.assign(size_t(plan_.nnodes), "");
  live_addrs_.assign(size_t(plan_.nnodes), "");
  consequence_delay_ = std::min(kMaxConsequenceDelay, node_timeout_ + 2 * heartbeat_interval(node_timeout_));
  // Node 0 holds a connection to every other agent's liveness socket: an
  // agent that exits or is killed closes it at once, long before its
  // heartbeats are missed. (A partition closes nothing: the heartbeats
  // catch that.)
  if (plan_.node_rank > 0) live_fd_ = listen_liveness(bind_addr_, &live_addr_);
  int p[2];
  TR_CHECK_ERRNO(::pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0, "launcher: pipe2");
  event_rd_ = p[0];
  event_wr_ = p[1];
}

NodeGroup::~NodeGroup() {
  stop_watch();
  ::close(event_rd_);
  ::close(event_wr_);
  if (live_fd_ >= 0) ::close(live_fd_);
  for (int fd : accepted_) ::close(fd);
}

std::string NodeGroup::key(const std::string& rest) const {
  return "trainrun/a" + std::to_string(attempt_) + "/" + rest;
}

std::string NodeGroup::node_label(int node) const {
  std::string s = "node " + std::to_string(node) + " (";
  if (size_t(node) < hosts_.size() && !hosts_[size_t(node)].empty()) s += "host " + hosts_[size_t(node)] + ", ";
  return s + ranks_text(node * plan_.nproc_per_node, plan_.nproc_per_node) + ")";
}

int NodeGroup::join(int attempt) {
  const int me = plan_.node_rank;
  if (me == 0) {
    store_->set("trainrun/attempt", store_bytes(std::to_string(attempt)));
  } else if (store_->check("trainrun/attempt")) {
    // An agent started again on a node that died joins the job where it is.
    const int current = std::atoi(store_text(store_->get("trainrun/attempt", milliseconds(1000))).c_str());
    if (current > attempt) {
      TR_LOG_INFO("launcher: the job is at attempt ", current, " (restart ", current, "); node ", me, " joins it");
      attempt = current;
    }
  }
  attempt_ = attempt;
  // A stop signal here: a preemption (SIGTERM/SIGUSR1) is announced, so the
  // nodes still meeting stop too instead of waiting out parallel.timeout_s.
  auto interrupted = [&](int sig) {
    if (sig != SIGINT) {
      try {
        store_->compare_set("trainrun/preempted", {},
                            store_bytes("node " + std::to_string(me) + " (host " + plan_.host + ") received " +
                                  stop_signal_name(sig) + " while the nodes were meeting"));
      } catch (const Error&) {
      }
    }
    return LaunchInterrupted{sig, ""};
  };
  // Another node's preemption, once seen, is acknowledged (node 0 keeps
  // its store up until every node that joined has seen it).
  auto preempted_elsewhere = [&]() -> std::string {
    if (!store_->check("trainrun/preempted")) return "";
    const std::string why = store_text(store_->get("trainrun/preempted", milliseconds(1000)));
    store_->set("trainrun/heard/" + std::to_string(me), store_bytes("1"));
    return why;
  };
  if (attempt == 0) {
    if (const int64_t ms = debug_env_ms("TRAINRUN_DEBUG_JOIN_DELAY_MS")) {
      TR_LOG_INFO("debug: node ", me, " waits ", ms, " ms before joining (TRAINRUN_DEBUG_JOIN_DELAY_MS)");
      if (const int sig = sleep_unless_stopped(milliseconds(ms), stop_)) throw interrupted(sig);
    }
  }
  store_->set(key("node/" + std::to_string(me)), store_bytes(plan_.host + " " + std::to_string(plan_.nproc_per_node) +
                                                       (live_addr_.empty() ? "" : " " + live_addr_)));
  std::vector<std::string> keys;
  for (int j = 0; j < plan_.nnodes; ++j) keys.push_back(key("node/" + std::to_string(j)));
  const auto timeout = milliseconds(int64_t(job_.parallel.timeout_s * 1000));
  const auto start = Clock::now();
  TR_LOG_INFO("launcher: node ", me, " of ", plan_.nnodes, " is waiting for the other nodes at the rendezvous store ",
              plan_.master_addr, ":", plan_.master_port, " (parallel.timeout_s: ", seconds_text(timeout), ")");
  for (;;) {
    if (stop_) {
      if (const int sig = stop_()) throw interrupted(sig);
    }
    if (std::string why = preempted_elsewhere(); !why.empty()) throw LaunchInterrupted{0, why};
    if (store_->check("trainrun/final"))
      TR_FAIL("node 0 ended the job (exit code ", store_text(store_->get("trainrun/final", milliseconds(1000))),
              ") before node ", me, " joined attempt ", attempt, "; nothing to restart");
    if (store_->check(key("abort"))) TR_FAIL(store_text(store_->get(key("abort"), milliseconds(1000))));
    try {
      store_->wait(keys, milliseconds(200));
      // A node preempted just now (its key was already there) starts no
      // workers: this one must not start workers that would wait for them.
      if (std::string why = preempted_elsewhere(); !why.empty()) throw LaunchInterrupted{0, why};
      break;
    } catch (const StoreTimeoutError&) {
    }
    if (Clock::now() - start < timeout) continue;
    std::vector<int> missing;
    for (int j = 0; j < plan_.nnodes; ++j)
      if (!store_->check(keys[size_t(j)])) missing.push_back(j);
    if (missing.empty()) break;
    std::string list;
    for (size_t i = 0; i < missing.size(); ++i)
      list += (i ? (i + 1 == missing.size() ? " and " : ", ") : "") + node_label(missing[i]);
    const std::string msg =
        list + (missing.size() == 1 ? " did" : " did") + " not join " +
        (attempt == 0 ? std::string("the job") : "restart " + std::to_string(attempt)) + " within " +
        seconds_text(timeout) + " (parallel.timeout_s; node " + std::to_string(me) +
        " waited at the rendezvous store " + plan_.master_addr + ":" + std::to_string(plan_.master_port) +
        "); start trainrun on every node with the same --nnodes/--master-addr/--master-port (under Slurm: srun "
        "--ntasks-per-node=1) and check that those nodes reach this address";
    // The nodes that are here stop now rather than at their own timeout.
    try {
      store_->compare_set(key("abort"), {}, store_bytes(msg));
    } catch (const Error&) {
    }
    TR_FAIL(msg);
  }
  for (int j = 0; j < plan_.nnodes; ++j) {
    // "host nproc [liveness ip:port]"
    std::istringstream v(store_text(store_->get(keys[size_t(j)], milliseconds(1000))));
    int nproc = 0;
    v >> hosts_[size_t(j)] >> nproc >> live_addrs_[size_t(j)];
    TR_CHECK(nproc == plan_.nproc_per_node, node_label(j), " runs ", nproc, " workers but node ", me, " runs ",
             plan_.nproc_per_node, "; every node must run the same number (parallel.nproc_per_node)");
  }
  return attempt;
}

void NodeGroup::post_event(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(what);
  }
  const char b = 1;
  ssize_t ignored = ::write(event_wr_, &b, 1);
  (void)ignored;
}

std::vector<std::string> NodeGroup::take_events() {
  char buf[64];
  while (::read(event_rd_, buf, sizeof buf) > 0) {
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.swap(events_);
  return out;
}

void NodeGroup::start_watch(int attempt) {
  stop_watch();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = false;
    watching_ = true;
    to_announce_.clear();
    announce_consequence_ = false;
    announce_resolved_ = false;
    winner_.clear();
    events_.clear();
    lost_.assign(size_t(plan_.nnodes), false);
  }
  attempt_ = attempt;
  peer_fds_.assign(size_t(plan_.nnodes), -1);
  if (plan_.node_rank == 0)
    for (int j = 1; j < plan_.nnodes; ++j)
      if (!live_addrs_[size_t(j)].empty()) peer_fds_[size_t(j)] = connect_liveness(live_addrs_[size_t(j)]);
  watcher_ = std::thread([this, attempt] { watch_loop(attempt); });
}

void NodeGroup::stop_watch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  for (int& fd : peer_fds_)
    if (fd >= 0) ::close(fd), fd = -1;
}

void NodeGroup::announce_failure(const std::string& what, bool consequence) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // One announcement per attempt; a cause may still replace a consequence
    // that has not gone out.
    const bool replace = !to_announce_.empty() && !announce_resolved_ && announce_consequence_ && !consequence;
    if (!to_announce_.empty() && !replace) return;
    to_announce_ = what;
    announce_consequence_ = consequence;
    announce_not_before_ = Clock::now() + (consequence ? consequence_delay_ : milliseconds(0));
  }
  cv_.notify_all();
}

bool NodeGroup::own_failure_first() {
  std::lock_guard<std::mutex> lock(mu_);
  return !winner_.empty() && winner_ == to_announce_;
}

std::string NodeGroup::settle_failure() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, consequence_delay_ + milliseconds(1000),
               [&] { return !watching_ || to_announce_.empty() || announce_resolved_; });
  if (!winner_.empty()) return winner_ == to_announce_ ? std::string() : winner_;
  // Nobody announced anything, but the heartbeat thread saw why (node 0's store is gone).
  return events_.empty() ? std::string() : events_.front();
}

void NodeGroup::watch_loop(int attempt) {
  const int me = plan_.node_rank, n = plan_.nnodes;
  const auto interval = heartbeat_interval(node_timeout_);
  const std::string abort_key = "trainrun/a" + std::to_string(attempt) + "/abort";
  auto done_key = [&](int j) { return "trainrun/a" + std::to_string(attempt) + "/done/" + std::to_string(j); };
  std::vector<int64_t> last_count(size_t(n), -1);
  std::vector<Clock::time_point> last_change(size_t(n), Clock::now());
  std::vector<bool> finished(size_t(n), false), reported(size_t(n), false);
  bool abort_seen = false;
  // Records the first failure of the attempt (whoever wrote it) and tells
  // the agent about it unless it is this node's own.
  auto saw_abort = [&](const std::string& what) {
    abort_seen = true;
    bool own;
    {
      std::lock_guard<std::mutex> lock(mu_);
      winner_ = what;
      own = what == to_announce_;
      if (!to_announce_.empty()) announce_resolved_ = true;
    }
    cv_.notify_all();
    if (!own) post_event(what);
  };
  for (;;) {
    std::string announce;
    bool announce_now = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_) break;
      if (!to_announce_.empty() && !announce_resolved_) {
        announce = to_announce_;
        announce_now = Clock::now() >= announce_not_before_;
      }
    }
    try {
      store_->add("trainrun/hb/" + std::to_string(me), 1);
      if (!abort_seen && store_->check(abort_key)) saw_abort(store_text(store_->get(abort_key, milliseconds(1000))));
      if (!abort_seen && announce_now) {
        // First writer wins: the job's failure is the node that failed first.
        saw_abort(store_text(store_->compare_set(abort_key, {}, store_bytes(announce))));
      }
      if (live_fd_ >= 0)  // node k: hold node 0's liveness connections (nothing is ever sent)
        for (int fd; (fd = ::accept4(live_fd_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) accepted_.push_back(fd);
      if (me == 0) {
        const auto now = Clock::now();
        for (int j = 1; j < n; ++j) {
          if (finished[size_t(j)] || reported[size_t(j)]) continue;
          if (store_->check(done_key(j))) {
            finished[size_t(j)] = true;
            continue;
          }
          std::string what;
          const int live = peer_fds_[size_t(j)];
          if (live >= 0 && liveness_lost(live)) {
            if (store_->check(done_key(j))) {  // it finished and exited just now
              finished[size_t(j)] = true;
              continue;
            }
            what = node_label(j) + " is gone: its agent's connection to node 0 closed (the agent exited or was killed)";
          } else {
            const int64_t c = store_->add("trainrun/hb/" + std::to_string(j), 0);
            if (c != last_count[size_t(j)]) {
              last_count[size_t(j)] = c;
              last_change[size_t(j)] = now;
            } else if (now - last_change[size_t(j)] > node_timeout_) {
              what = node_label(j) + " stopped responding: its agent sent no heartbeat for " +
                     seconds_text(std::chrono::duration_cast<milliseconds>(now - last_change[size_t(j)])) +
                     " (the node or its agent died, or the network between the nodes is down)";
            }
          }
          if (what.empty()) continue;
          reported[size_t(j)] = true;
          {
            std::lock_guard<std::mutex> lock(mu_);
            lost_[size_t(j)] = true;
          }
          const std::string first = store_text(store_->compare_set(abort_key, {}, store_bytes(what)));
          if (!abort_seen) saw_abort(first);
          if (first != what) post_event(what);  // a second loss after the first failure
        }
      }
    } catch (const std::exception& e) {
      post_event("lost the rendezvous store of node 0 (" + plan_.master_addr + ":" + std::to_string(plan_.master_port) +
                 (hosts_.empty() || hosts_[0].empty() ? "" : ", host " + hosts_[0]) + "): " + e.what() +
                 "; node 0's agent died or the network between the nodes is down");
      break;
    }
    std::unique_lock<std::mutex> lock(mu_);
    // While an announcement waits, look again soon.
    const bool pending = !to_announce_.empty() && !announce_resolved_;
    cv_.wait_for(lock, pending ? milliseconds(50) : interval, [&] {
      return stopping_ ||
             (!to_announce_.empty() && !announce_resolved_ && Clock::now() >= announce_not_before_ && !abort_seen);
    });
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    watching_ = false;
  }
  cv_.notify_all();
}

std::string NodeGroup::finish(int code) {
  const int me = plan_.node_rank;
  try {
    store_->set(key("done/" + std::to_string(me)), store_bytes(std::to_string(code)));
  } catch (const Error&) {
    return "";  // node 0 is gone; the heartbeat thread has said so
  }
  if (me != 0) return "";
  // Node 0 hosts the store: it stays until every other node's workers are
  // gone, or that node is known lost.
  const auto timeout = milliseconds(int64_t(job_.parallel.timeout_s * 1000));
  const auto start = Clock::now();
  for (;;) {
    bool settled = true;
    for (int j = 1; j < plan_.nnodes && settled; ++j) {
      bool lost;
      {
        std::lock_guard<std::mutex> lock(mu_);
        lost = lost_.size() > size_t(j) && lost_[size_t(j)];
      }
      settled = lost || store_->check(key("done/" + std::to_string(j)));
    }
    if (settled) break;
    if (Clock::now() - start > timeout)
      return "the other nodes did not report the end of their workers within " + seconds_text(timeout);
    if (sleep_unless_stopped(milliseconds(100), stop_)) break;
  }
  // This node finished; did the job? (A failure here was reported already.)
  if (code != 0 && code != 75) return "";
  if (store_->check(key("abort"))) return store_text(store_->get(key("abort"), milliseconds(1000)));
  return "";
}

void NodeGroup::wait_until_heard(milliseconds most) {
  if (plan_.node_rank != 0) return;
  const auto until = Clock::now() + most;
  try {
    for (;;) {
      bool all = true;
      for (int j = 1; j < plan_.nnodes && all; ++j)
        all = !store_->check(key("node/" + std::to_string(j))) || store_->check("trainrun/heard/" + std::to_string(j));
      if (all || Clock::now() >= until) return;
      std::this_thread::sleep_for(milliseconds(20));
    }
  } catch (const Error&) {
  }
}

void NodeGroup::close_job(int code) {
  if (plan_.node_rank != 0) return;
  try {
    store_->set("trainrun/final", store_bytes(std::to_string(code)));
  } catch (const Error&) {
  }
}

}  // namespace trainrun
