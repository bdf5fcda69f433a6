// The agents of a multi-node job, and what they share.
//
// Node 0's agent hosts the rendezvous store for the whole job (all
// interfaces, the plan's port; one store and one secret across restarts,
// with per-attempt keys) and publishes two files in the shared output
// directory; every other agent reads them:
//
//   <output.dir>/.trainrun/          mode 0700
//     store.secret                   mode 0600, the job secret (rewritten by each run of node 0)
//     node0.marker                   a fresh nonce per run, plus node 0's host and store address
//
// The secret travels by that file, not through the command line or the
// store: the output directory has to be shared anyway (checkpoints are
// written by every rank into one directory), a 0600 file in a 0700
// directory is readable by the job's user only, like the environment of
// its processes, and it needs no set-up. A TRAINRUN_STORE_SECRET in the
// agents' environment (the sbatch scripts export one) takes precedence, so
// that a node that cannot see the directory can still reach the store and
// report it. A secret file readable by anyone else is refused.
//
// The shared-directory check: every other node waits (parallel.timeout_s)
// until it sees node 0's marker with the nonce node 0 put in the store;
// otherwise it stops with an error that says whether node 0 is up at all.
//
// While workers run, each agent heartbeats into the store from a thread,
// and node 0 holds a TCP connection to every other agent's liveness socket.
// Node 0 declares a node lost when that connection closes (the agent died:
// at once) or its heartbeat stalls for the node timeout (half of
// parallel.timeout_s, at least 1 s: a partition; the verdict comes before
// the workers' own collective timeouts, so it is the one that names the
// node); other nodes declare node 0 lost when its store closes the
// connection or stops answering for as long. An agent whose workers failed announces it in the
// store, and every other agent stops its workers. With launcher.max_restarts
// the agents meet again for the next attempt (an agent started again on a
// node that died joins the job's current attempt), and the workers resume
// from the latest checkpoint.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/config/job_spec.h"
#include "core/launch/launch_mode.h"
#include "parallel/rendezvous/store.h"

namespace trainrun {

class TcpStoreServer;

// A stop signal (SIGINT/SIGTERM/SIGUSR1) that arrived while an agent waited
// for the other nodes, or (sig 0) another node's preemption heard then
// (`elsewhere` says which). No worker runs yet: the agent exits 75 (130
// for SIGINT), saying the job was preempted before training started.
struct LaunchInterrupted {
  int sig = 0;
  std::string elsewhere;
};

// Returns a pending stop signal (0 = none); called between short waits.
using StopPoll = std::function<int()>;

struct RendezvousFiles {
  std::string dir, secret, marker;
};
RendezvousFiles rendezvous_files(const std::string& output_dir);

// Node 0 (or rank 0 of Slurm workers): a fresh nonce under
// "trainrun/marker" in its own store, then the secret file (0600) and a
// marker file with the same nonce, each through a temporary file and a
// rename; the other nodes compare the two (contact_node0) to tell this
// run's files from a stale or unshared output.dir.
void publish_rendezvous(Store& store, const std::string& output_dir, const std::string& secret,
                        const std::string& host, const std::string& store_addr, int port);

// The secret for a store hosted here: TRAINRUN_STORE_SECRET, else fresh.
std::string secret_for_new_store(const EnvMap& env);

// Every other node (or Slurm worker): waits until node 0's marker is
// visible, the store at addr:port accepts the secret (the environment's, else
// the file's) and holds the marker's nonce. `who` names this side in
// errors ("node 1 (host h2)"). Throws trainrun::Error at the timeout with
// what went wrong (output.dir not shared / node 0 not up / stale secret),
// LaunchInterrupted on a stop signal.
struct Node0Contact {
  std::unique_ptr<Store> store;
  std::string secret;
};
Node0Contact contact_node0(const std::string& output_dir, const std::string& addr, int port, const EnvMap& env,
                           std::chrono::milliseconds timeout, std::chrono::milliseconds io_timeout,
                           const std::string& who, const StopPoll& stop);

// Whether a worker's error text reads like the consequence of another
// rank's failure (a lost peer, a timed-out collective) rather than a cause.
bool failure_is_consequence(const std::string& error_text);

// Sleeps up to `d` in short slices; returns early with a stop signal from
// `stop` (0 = slept the whole time).
int sleep_unless_stopped(std::chrono::milliseconds d, const StopPoll& stop);

// Half of parallel.timeout_s, at least 1 s.
std::chrono::milliseconds node_timeout(const JobSpec& job);

class NodeGroup {
 public:
  // Node 0 starts the store and publishes the files; the others run
  // contact_node0. Create it after the agent blocked its signals (the store
  // thread and the heartbeat thread inherit the mask).
  NodeGroup(const JobSpec& job, const LaunchPlan& plan, const StopPoll& stop);
  ~NodeGroup();
  NodeGroup(const NodeGroup&) = delete;
  NodeGroup& operator=(const NodeGroup&) = delete;

  const std::string& secret() const { return secret_; }
  const std::string& master_addr() const { return plan_.master_addr; }
  int port() const { return plan_.master_port; }
  // The address this node's workers bind for Gloo (TRAINRUN_GLOO_HOST).
  const std::string& bind_addr() const { return bind_addr_; }
  const std::string& bind_note() const { return bind_note_; }

  // Every agent announces itself for `attempt` and waits for all nodes.
  // Returns the attempt to run: an agent started while the job is already
  // at a later attempt (a node that came back) joins that one. Throws
  // trainrun::Error naming the nodes that did not arrive, or what node 0
  // announced (it gave up, a node failed); LaunchInterrupted on a signal
  // here (announced to the others when it is SIGTERM/SIGUSR1) or on another
  // node's preemption.
  int join(int attempt);

  // The heartbeat thread for this attempt. event_fd() becomes readable when
  // it has news; take_events() returns them (each a sentence for the log).
  void start_watch(int attempt);
  int event_fd() const { return event_rd_; }
  std::vector<std::string> take_events();
  void stop_watch();

  // Tells the other agents that this node's workers failed (once per
  // attempt; the heartbeat thread sends it, so the caller never blocks on
  // the network). The first announcement in the store is the job's failure.
  // A `consequence` (failure_is_consequence) waits a moment first, so the
  // node where the cause is announces before the nodes that only lost it.
  void announce_failure(const std::string& what, bool consequence);
  // After this node's workers failed: waits (briefly) until the announcement
  // is settled and returns the job's first failure when it was another
  // node's (or node 0's store went away), else "".
  std::string settle_failure();
  // Whether the store recorded this node's failure as the attempt's first.
  bool own_failure_first();

  // After this node's workers ended with `code` (0, 75, or 1 = failed):
  // records it; node 0 then waits until every node has finished or failed
  // (the store must outlive their workers). Returns "" or why the job
  // failed elsewhere after this node finished.
  std::string finish(int code);

  // Node 0, when the job ends for good (success or no restarts left): tells
  // agents waiting for a next attempt not to wait.
  void close_job(int code);
  // Node 0, after a preemption while the nodes met: keeps its store up
  // until every node that had joined has heard of it, at most `most`.
  void wait_until_heard(std::chrono::milliseconds most);

  // "node 1 (host h2, ranks 2-3)".
  std::string node_label(int node) const;

 private:
  void watch_loop(int attempt);
  void post_event(const std::string& what);
  std::string key(const std::string& rest) const;

  const JobSpec& job_;
  const LaunchPlan plan_;
  const StopPoll stop_;
  const std::chrono::milliseconds node_timeout_;
  std::unique_ptr<TcpStoreServer> server_;  // node 0 only
  std::unique_ptr<Store> store_;            // this agent's client
  std::string secret_, bind_addr_, bind_note_;
  std::vector<std::string> hosts_;       // per node, from the join
  std::vector<std::string> live_addrs_;  // per node: its agent's liveness socket ("ip:port"; node 0: none)
  std::string live_addr_;                // this agent's (nodes > 0)
  int live_fd_ = -1;                     // listening liveness socket (nodes > 0)
  std::vector<int> accepted_;            // node 0's connections to it, held open
  std::vector<int> peer_fds_;            // node 0: a connection to each node's liveness socket
  std::chrono::milliseconds consequence_delay_{1000};
  int attempt_ = 0;

  int event_rd_ = -1, event_wr_ = -1;
  std::thread watcher_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<std::string> events_;
  bool watching_ = false;    // the heartbeat thread runs
  std::string to_announce_;  // this node's failure, to announce
  std::chrono::steady_clock::time_point announce_not_before_{};
  bool announce_consequence_ = false;  // it only lost its peers (failure_is_consequence)
  bool announce_resolved_ = false;     // announced, or another node's came first
  std::string winner_;                 // the attempt's first failure, as the store has it
  std::vector<bool> lost_;             // per node: declared lost by the heartbeat thread (node 0)
};

}  // namespace trainrun
