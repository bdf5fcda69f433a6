// Several nodes on one machine (core/launch/node_group.h): each "node" is a
// trainrun agent with 2 CPU workers, started with --nnodes/--node-rank (or a
// fake srun environment). Two kinds of "hosts":
//
//   loopback    both agents on this machine's 127.0.0.1 (runs anywhere)
//   namespaces  two Linux network namespaces joined by a veth pair, with
//               10.231.7.1/24 and 10.231.7.2/24 inside them only, so the
//               link between the "hosts" can be taken down. Needs root and
//               `ip netns`; skipped with a WARN saying why where they are not
//               there. NetnsPair removes the namespaces (and the veth pair
//               with them) in its destructor, which runs on a failed
//               REQUIRE too; a crashed earlier run's namespaces are removed
//               first.
//
// Every job writes under its own TempDir, whose path is in every process's
// command line, so "nothing left behind" is a /proc scan for that path.
// Workers run with OMP_NUM_THREADS=1; every wait has a deadline.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/common/error.h"
#include "core/launch/node_group.h"
#include "tests/support/process_util.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

struct JobOpts {
  int steps = 4;
  int log_interval = 1;
  double timeout_s = 20;
  int checkpoint_interval = 0;
  std::string sharding = "full_shard";
  std::string launcher = "{grace_period_s: 2}";
};

// global_batch_size 8 = 1 micro-batch x 2 accumulation x 4 ranks (2 nodes x 2)
// = 8 accumulation x 1 rank for the reference.
std::string job_yaml(const std::string& run_dir, int nproc, const JobOpts& o) {
  std::ostringstream y;
  y << "model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 16, seq_len: 16}\n"
    << "data: {format: synthetic}\n"
    << "train: {global_batch_size: 8, micro_batch_size: 1, max_steps: " << o.steps
    << ", log_interval: " << o.log_interval << ", eval_interval: 0, warmup_steps: 1}\n"
    << "output: {dir: '" << run_dir << "', sample_tokens: 0}\n"
    << "parallel: {nproc_per_node: " << nproc << ", sharding: " << o.sharding << ", timeout_s: " << o.timeout_s
    << "}\n"
    << "launcher: " << o.launcher << "\n";
  if (o.checkpoint_interval > 0) y << "checkpoint: {interval: " << o.checkpoint_interval << "}\n";
  return y.str();
}

std::string make_job(const test::TempDir& dir, const std::string& name, int nproc, const JobOpts& o,
                     const std::string& run = "run") {
  const std::string path = dir / name;
  test::write_file(path, job_yaml(dir / run, nproc, o));
  return path;
}

using test::losses;
using test::processes_mentioning;
using test::training_started;
using test::wait_until;

// The single-process run of the same job: what every layout must reproduce.
std::vector<double> reference_losses(const test::TempDir& dir, const JobOpts& o) {
  const std::string cfg = make_job(dir, "ref.yaml", 1, o, "ref");
  const auto r = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + cfg + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return losses(dir / "ref/metrics.jsonl");
}

void check_same_losses(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(std::abs(got[i] - want[i]) <= 1e-5 * std::max(1.0, std::abs(want[i])));
  }
}

// A free TCP port on loopback (nobody listens there now; the store binds it
// with SO_REUSEADDR). `lo` > 0 searches upwards from there.
int free_port(int lo = 0) {
  for (int attempt = 0; attempt < 2000; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(lo > 0 ? lo + attempt : 0));
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      socklen_t len = sizeof a;
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
      close(fd);
      return ntohs(a.sin_port);
    }
    close(fd);
  }
  return -1;
}

// One agent ("node") started in the background; its stderr goes to a file.
// `prefix` runs it through another program (ip netns exec NS).
class Node : public test::BackgroundProcess {
 public:
  Node(const test::TempDir& dir, const std::string& name, const std::vector<std::string>& prefix,
       const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {})
      : BackgroundProcess(node_argv(prefix, args), node_env(extra_env), dir / (name + ".err.out"),
                          dir / (name + ".err")) {}

 private:
  static std::vector<std::string> node_argv(const std::vector<std::string>& prefix,
                                            const std::vector<std::string>& args) {
    std::vector<std::string> argv = prefix;
    argv.push_back(test::trainrun_binary());
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }
  static std::vector<std::string> node_env(const std::vector<std::string>& extra_env) {
    std::vector<std::string> add = {"OMP_NUM_THREADS=1"};
    add.insert(add.end(), extra_env.begin(), extra_env.end());
    return test::environment_with({"OMP_NUM_THREADS", "TRAINRUN_STORE_SECRET"}, add);
  }
};

std::vector<std::string> node_args(const std::string& cfg, int node_rank, const std::string& addr, int port,
                                   int nnodes = 2) {
  return {"--config", cfg, "--nnodes", std::to_string(nnodes), "--node-rank", std::to_string(node_rank),
          "--master-addr", addr, "--master-port", std::to_string(port)};
}

// ---- two "hosts" in network namespaces ----------------------------------------------------

std::string shell(const std::string& cmd, int* rc = nullptr) {
  const auto r = test::run_command(cmd);
  if (rc) *rc = r.exit_code;
  return r.out + r.err;
}

class NetnsPair {
 public:
  // "" when namespaces can be used here, else why not.
  static std::string unavailable_reason() {
    if (geteuid() != 0) return "needs root to create network namespaces (ip netns add)";
    int rc = 0;
    shell("ip -V", &rc);
    if (rc != 0) return "iproute2's `ip` is not installed";
    const std::string probe = "trmnp" + std::to_string(getpid());
    const std::string out = shell("ip netns add " + probe, &rc);
    if (rc != 0) return "`ip netns add` does not work here: " + out;
    shell("ip netns del " + probe);
    return "";
  }

  NetnsPair() {
    remove_stale();
    const std::string id = std::to_string(getpid());
    ns_[0] = "trmn" + id + "a";
    ns_[1] = "trmn" + id + "b";
    veth_[0] = "trmn" + id + "x";
    veth_[1] = "trmn" + id + "y";
    for (const std::string& cmd : std::vector<std::string>{
             "ip netns add " + ns_[0],
             "ip netns add " + ns_[1],
             "ip link add " + veth_[0] + " type veth peer name " + veth_[1],
             "ip link set " + veth_[0] + " netns " + ns_[0],
             "ip link set " + veth_[1] + " netns " + ns_[1],
             "ip -n " + ns_[0] + " addr add " + addr(0) + "/24 dev " + veth_[0],
             "ip -n " + ns_[1] + " addr add " + addr(1) + "/24 dev " + veth_[1],
             "ip -n " + ns_[0] + " link set lo up",
             "ip -n " + ns_[1] + " link set lo up",
             "ip -n " + ns_[0] + " link set " + veth_[0] + " up",
             "ip -n " + ns_[1] + " link set " + veth_[1] + " up",
         }) {
      int rc = 0;
      const std::string out = shell(cmd, &rc);
      INFO(cmd << ": " << out);
      REQUIRE(rc == 0);
    }
  }
  ~NetnsPair() {
    // Anything of ours still inside (a test that failed half-way) goes
    // first; deleting a namespace then removes the veth end inside it, and
    // with it the pair. Never throws: this runs during unwinding.
    for (const std::string& ns : ns_) {
      if (ns.empty()) continue;
      try {
        shell("for p in $(ip netns pids " + ns + "); do kill -9 $p; done; ip netns del " + ns);
      } catch (...) {
      }
    }
  }
  static std::string addr(int i) { return i == 0 ? "10.231.7.1" : "10.231.7.2"; }
  std::vector<std::string> exec_prefix(int i) const { return {"ip", "netns", "exec", ns_[i]}; }
  void link_down() {
    int rc = 0;
    const std::string out = shell("ip -n " + ns_[0] + " link set " + veth_[0] + " down", &rc);
    INFO(out);
    REQUIRE(rc == 0);
  }

 private:
  // Namespaces of an earlier run of this test that died before cleaning up.
  static void remove_stale() {
    std::istringstream in(shell("ip netns list"));
    for (std::string line; std::getline(in, line);) {
      const std::string name = line.substr(0, line.find(' '));
      if (name.rfind("trmn", 0) != 0 || name.size() < 6) continue;
      const std::string pid = name.substr(4, name.size() - 5);
      if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;
      if (kill(std::atoi(pid.c_str()), 0) == 0) continue;  // its test is still running
      shell("for p in $(ip netns pids " + name + "); do kill -9 $p; done; ip netns del " + name);
    }
  }
  std::string ns_[2], veth_[2];
};

}  // namespace

// ---- loopback ---------------------------------------------------------------------------------

TEST_CASE("multinode: two agents on loopback train like one process", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  const std::vector<double> want = reference_losses(dir, o);
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  const auto t0 = Clock::now();
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port));  // the non-zero node may start first
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port));
  const int c0 = n0.wait(30s), c1 = n1.wait(10s);
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  REQUIRE(c0 == 0);
  REQUIRE(c1 == 0);
  CHECK(n0.err().find("launch: static rendezvous (--nnodes/--node-rank): node 0 of 2") != std::string::npos);
  CHECK(n0.err().find("trainrun: starting 2 workers on ") != std::string::npos);
  CHECK(n0.err().find("as node 0 of 2 (ranks 0-1 of 4; rendezvous store 127.0.0.1:" + std::to_string(port)) !=
        std::string::npos);
  CHECK(n1.err().find("as node 1 of 2 (ranks 2-3 of 4;") != std::string::npos);
  CHECK(n1.err().find("trainrun: all 2 workers finished") != std::string::npos);
  for (int r = 0; r < 4; ++r) CHECK(test::file_exists(dir / ("run/logs/rank" + std::to_string(r) + ".log")));
  CHECK(test::read_file(dir / "run/logs/rank2.log").find("LOCAL") == std::string::npos);  // sanity: a log, not env
  check_same_losses(losses(dir / "run/metrics.jsonl"), want);
  CHECK(test::file_exists(dir / "run/topology.json"));
  CHECK(test::file_exists(dir / "run/node1/topology.json"));
  CHECK(Clock::now() - t0 < 30s);
  CHECK(processes_mentioning(dir.path()).empty());
}

TEST_CASE("multinode: workers of node 1 get global ranks and the node in their environment", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 1;
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port), {"TRAINRUN_DEBUG_PRINT_ENV=1"});
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port), {"TRAINRUN_DEBUG_PRINT_ENV=1"});
  const int c0 = n0.wait(30s), c1 = n1.wait(10s);
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  REQUIRE(c0 == 0);
  REQUIRE(c1 == 0);
  const std::string log3 = test::read_file(dir / "run/logs/rank3.log");
  INFO(log3);
  CHECK(log3.find("RANK=3 LOCAL_RANK=1 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 GROUP_WORLD_SIZE=2 "
                  "MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                  std::to_string(port)) != std::string::npos);
  CHECK(log3.find("TRAINRUN_STORE_SECRET=<32 chars>") != std::string::npos);
  // Node 1 never wrote the resolved spec: its workers loaded node 0's.
  CHECK(n1.err().find("job: ") == std::string::npos);
}

// hybrid_shard with shard_group_size 0: shard inside each node (the 2 ranks
// of a node hold half the parameters each), replicate across the 2 nodes.
TEST_CASE("multinode: hybrid_shard shards inside a node and replicates across nodes", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.sharding = "hybrid_shard";
  const std::vector<double> want = reference_losses(dir, o);
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port));
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port));
  const int c0 = n0.wait(30s), c1 = n1.wait(10s);
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  REQUIRE(c0 == 0);
  REQUIRE(c1 == 0);
  // 3824 parameters: a group of 2 keeps 1912 floats per rank (7.5 KiB); a
  // group of all 4 ranks would keep 956 (3.7 KiB).
  for (int r : {0, 2}) {
    const std::string log = test::read_file(dir / ("run/logs/rank" + std::to_string(r) + ".log"));
    INFO(log);
    CHECK(log.find("memory (rank " + std::to_string(r) + ", hybrid_shard): params 7.5 KiB") != std::string::npos);
  }
  for (const char* topo : {"run/topology.json", "run/node1/topology.json"})
    CHECK(test::read_file(dir / topo).find("TRAINRUN_SHARD_GROUP_SIZE") != std::string::npos);
  check_same_losses(losses(dir / "run/metrics.jsonl"), want);
}

// The same two agents, but placed by what `srun --ntasks-per-node=1` gives
// the tasks of a 2-node step: node rank from SLURM_NODEID, node 0 = the
// first host of SLURM_JOB_NODELIST, the port from SLURM_JOB_ID.
TEST_CASE("multinode: agents placed by a fake srun environment find node 0 from the nodelist", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 2;
  const std::vector<double> want = reference_losses(dir, o);
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port(kSlurmPortBase + int(getpid() % 5000));
  REQUIRE(port >= kSlurmPortBase);
  REQUIRE(port < kSlurmPortBase + kSlurmPortSpan);
  const std::string job_id = std::to_string(port - kSlurmPortBase + 7 * kSlurmPortSpan);
  auto env = [&](int node) {
    return std::vector<std::string>{"SLURM_JOB_ID=" + job_id, "SLURM_STEP_ID=0", "SLURM_NTASKS=2", "SLURM_NNODES=2",
                                    "SLURM_PROCID=" + std::to_string(node), "SLURM_NODEID=" + std::to_string(node),
                                    "SLURM_LOCALID=0", "SLURM_STEP_TASKS_PER_NODE=1(x2)",
                                    "SLURM_JOB_NODELIST=localhost,localhost"};
  };
  Node n0(dir, "node0", {}, {"--config", cfg}, env(0));
  Node n1(dir, "node1", {}, {"--config", cfg}, env(1));
  const int c0 = n0.wait(30s), c1 = n1.wait(10s);
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  REQUIRE(c0 == 0);
  REQUIRE(c1 == 0);
  CHECK(n1.err().find("launch: Slurm job " + job_id +
                      ", one agent per node (srun --ntasks-per-node=1): node 1 of 2") != std::string::npos);
  CHECK(n1.err().find("rendezvous store localhost:" + std::to_string(port) +
                      " (address: first host of SLURM_JOB_NODELIST 'localhost,localhost'; port: from SLURM_JOB_ID " +
                      job_id + ")") != std::string::npos);
  check_same_losses(losses(dir / "run/metrics.jsonl"), want);
}

// ---- nodes that do not come, or go ---------------------------------------------------------------

TEST_CASE("multinode: a node that never arrives fails the job naming it", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.timeout_s = 3;
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const auto t0 = Clock::now();
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", free_port()));
  const int c0 = n0.wait(20s);
  const auto took = Clock::now() - t0;
  INFO(n0.err());
  CHECK(c0 == 1);
  CHECK(n0.err().find("trainrun: error: node 1 (ranks 2-3) did not join the job within 3 s (parallel.timeout_s; "
                      "node 0 waited at the rendezvous store 127.0.0.1:") != std::string::npos);
  CHECK(took >= 2500ms);
  CHECK(took < 15s);
  CHECK(processes_mentioning(dir.path()).empty());
}

TEST_CASE("multinode: node 1 says when node 0 never comes up", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.timeout_s = 2;
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port));
  const int c1 = n1.wait(20s);
  INFO(n1.err());
  CHECK(c1 == 1);
  CHECK(n1.err().find("trainrun: error: node 0 did not come up: node 1 (host ") != std::string::npos);
  CHECK(n1.err().find("nothing answers at 127.0.0.1:" + std::to_string(port) + " (node 0's rendezvous store)") !=
        std::string::npos);
  CHECK(!test::file_exists(dir / "run/logs"));  // no worker was started
}

// Node 1's output.dir is another directory: it never sees node 0's marker.
TEST_CASE("multinode: an output.dir that is not shared stops the job with a clear error", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.timeout_s = 3;
  const std::string cfg0 = make_job(dir, "job0.yaml", 2, o, "run");
  const std::string cfg1 = make_job(dir, "job1.yaml", 2, o, "elsewhere");
  const int port = free_port();
  Node n0(dir, "node0", {}, node_args(cfg0, 0, "127.0.0.1", port));
  Node n1(dir, "node1", {}, node_args(cfg1, 1, "127.0.0.1", port));
  const int c1 = n1.wait(20s), c0 = n0.wait(20s);
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  CHECK(c1 == 1);
  CHECK(c0 == 1);
  CHECK(n1.err().find("trainrun: error: output.dir '" + dir.path() +
                      "/elsewhere' is not shared between the nodes: node 1 (host ") != std::string::npos);
  CHECK(n1.err().find("cannot see '" + dir.path() + "/elsewhere/.trainrun/node0.marker' after ") !=
        std::string::npos);
  CHECK(n1.err().find("although node 0's rendezvous store answers at 127.0.0.1:" + std::to_string(port) +
                      "; every node must see the same output.dir") != std::string::npos);
  CHECK(n0.err().find("node 1 (ranks 2-3) did not join the job within 3 s") != std::string::npos);
  CHECK(processes_mentioning(dir.path()).empty());
}

// The same, when the secret comes from the environment (the sbatch
// scripts): node 1 reaches the store, and the marker's nonce tells.
TEST_CASE("multinode: with the secret in the environment an unshared output.dir is caught by the marker",
          "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.timeout_s = 3;
  const std::string cfg0 = make_job(dir, "job0.yaml", 2, o, "run");
  const std::string cfg1 = make_job(dir, "job1.yaml", 2, o, "elsewhere");
  const int port = free_port();
  const std::vector<std::string> env = {"TRAINRUN_STORE_SECRET=0123456789abcdef0123456789abcdef"};
  Node n0(dir, "node0", {}, node_args(cfg0, 0, "127.0.0.1", port), env);
  Node n1(dir, "node1", {}, node_args(cfg1, 1, "127.0.0.1", port), env);
  const int c1 = n1.wait(20s), c0 = n0.wait(20s);
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  CHECK(c1 == 1);
  CHECK(c0 == 1);
  CHECK(n1.err().find("is not shared between the nodes: node 0's rendezvous store at 127.0.0.1:" +
                      std::to_string(port) + " says this run's marker is ") != std::string::npos);
  CHECK(n1.err().find("sees no marker in '" + dir.path() + "/elsewhere/.trainrun/node0.marker'") != std::string::npos);
}

TEST_CASE("multinode: a secret file that others can read is refused", "[multinode]") {
  test::TempDir dir("mnode");
  TcpStoreServer server("127.0.0.1", 0, "s3cret");
  {
    auto s = connect_tcp_store("127.0.0.1", server.port(), "s3cret", 2000ms);
    publish_rendezvous(*s, dir.path(), "s3cret", "h", "127.0.0.1", server.port());
  }
  const RendezvousFiles f = rendezvous_files(dir.path());
  struct stat st {};
  REQUIRE(stat(f.secret.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(stat(f.dir.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  // Readable: joins.
  Node0Contact c = contact_node0(dir.path(), "127.0.0.1", server.port(), {}, 3000ms, 2000ms, "node 1 (host h)", nullptr);
  CHECK(c.secret == "s3cret");
  // World-readable: refused at once, with the fix.
  REQUIRE(chmod(f.secret.c_str(), 0644) == 0);
  CHECK_THROWS_WITH(contact_node0(dir.path(), "127.0.0.1", server.port(), {}, 3000ms, 2000ms, "node 1", nullptr),
                    Catch::Contains("refusing the job secret in '" + f.secret + "': its mode is 0644") &&
                        Catch::Contains("but it must be 0600 and owned by this user"));
}

TEST_CASE("multinode: a failed worker on one node stops every node and names the rank", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 6;
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  const std::vector<std::string> fail = {"TRAINRUN_DEBUG_FAIL_RANK=3", "TRAINRUN_DEBUG_FAIL_STEP=3"};
  const auto t0 = Clock::now();
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port), fail);
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port), fail);
  const int c0 = n0.wait(30s), c1 = n1.wait(10s);
  const std::string e0 = n0.err(), e1 = n1.err();
  INFO("node 0:\n" << e0 << "\nnode 1:\n" << e1);
  CHECK(c0 == 1);
  CHECK(c1 == 1);
  CHECK(e1.find("trainrun: error: rank 3 (pid ") != std::string::npos);
  CHECK(e1.find(", node 1) failed first: exit code 1") != std::string::npos);
  CHECK(e1.find("[rank 3] trainrun: error: injected failure") != std::string::npos);
  // Node 0 names the node and the rank, whether it heard it from the store
  // or saw its own workers lose their peer first.
  CHECK(e0.find("node 1 (host ") != std::string::npos);
  CHECK(e0.find("ranks 2-3) failed: rank 3 (pid ") != std::string::npos);
  CHECK(Clock::now() - t0 < 25s);
  CHECK(processes_mentioning(dir.path()).empty());
}

TEST_CASE("multinode: a node that dies mid-run fails the whole job within the timeout", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 1000000;
  o.log_interval = 1000000;
  o.timeout_s = 4;
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port));
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port));
  REQUIRE(wait_until([&] { return training_started(dir); }, 25s));
  const auto t0 = Clock::now();
  REQUIRE(kill(n1.pid(), SIGKILL) == 0);  // the node's agent; its workers follow
  const int c0 = n0.wait(20s);
  const auto took = Clock::now() - t0;
  const std::string e0 = n0.err();
  INFO(e0);
  CHECK(c0 == 1);
  CHECK(n1.wait(5s) == 128 + SIGKILL);
  // Node 0's own workers lose their peers within milliseconds, but the
  // report names the cause: node 1's agent's connection closed.
  CHECK(e0.find("trainrun: error: the job failed on another node: node 1 (host ") != std::string::npos);
  CHECK(e0.find("ranks 2-3) is gone: its agent's connection to node 0 closed (the agent exited or was killed)") !=
        std::string::npos);
  // Then what happened here: node 0's ranks lost their peers, or were stopped first.
  CHECK((e0.find("on this node, rank ") != std::string::npos || e0.find("stopped rank 0 (pid ") != std::string::npos));
  CHECK(took < std::chrono::seconds(4 + 2 + 5));  // timeout + grace + slack
  CHECK(wait_until([&] { return processes_mentioning(dir.path()).empty(); }, 5s));
}

TEST_CASE("multinode: node 1 stops at once when node 0 dies", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 1000000;
  o.log_interval = 1000000;
  o.timeout_s = 20;  // nothing here may wait for it
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port));
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port));
  REQUIRE(wait_until([&] { return training_started(dir); }, 25s));
  const auto t0 = Clock::now();
  REQUIRE(kill(n0.pid(), SIGKILL) == 0);  // node 0's agent, and with it the store
  const int c1 = n1.wait(15s);
  const auto took = Clock::now() - t0;
  const std::string e1 = n1.err();
  INFO(e1);
  CHECK(c1 == 1);
  CHECK(e1.find("trainrun: error: the job failed on another node: lost the rendezvous store of node 0 (127.0.0.1:" +
                std::to_string(port) + ", host ") != std::string::npos);
  CHECK(took < 8s);
  CHECK(wait_until([&] { return processes_mentioning(dir.path()).empty(); }, 5s));
}

TEST_CASE("multinode: launcher.max_restarts restarts every node from the latest checkpoint", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 5;
  o.checkpoint_interval = 1;
  o.launcher = "{grace_period_s: 2, max_restarts: 1}";
  const std::vector<double> want = reference_losses(dir, o);
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  const std::vector<std::string> fail = {"TRAINRUN_DEBUG_FAIL_RANK=2", "TRAINRUN_DEBUG_FAIL_STEP=3",
                                         "TRAINRUN_DEBUG_FAIL_ONCE=1"};
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port), fail);
  Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port), fail);
  const int c0 = n0.wait(40s), c1 = n1.wait(10s);
  const std::string e0 = n0.err(), e1 = n1.err();
  INFO("node 0:\n" << e0 << "\nnode 1:\n" << e1);
  CHECK(c0 == 0);
  CHECK(c1 == 0);
  CHECK(e1.find("failed first: exit code 1") != std::string::npos);
  for (const std::string& e : {e0, e1}) {
    CHECK(e.find("restarting all workers (restart 1 of 1)") != std::string::npos);
    CHECK(e.find("all 2 nodes are back: starting restart 1 from the latest checkpoint") != std::string::npos);
    CHECK(e.find("all 2 workers finished") != std::string::npos);
  }
  CHECK(test::read_file(dir / "run/logs/rank0.log").find("resum") != std::string::npos);
  check_same_losses(losses(dir / "run/metrics.jsonl"), want);
  CHECK(processes_mentioning(dir.path()).empty());
}

// A node's agent dies; node 0 waits (max_restarts) and the node's agent,
// started again by hand, joins the job's current attempt.
TEST_CASE("multinode: a node started again after it died rejoins the job", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 40;
  o.log_interval = 1;
  o.timeout_s = 8;
  o.checkpoint_interval = 2;
  o.launcher = "{grace_period_s: 2, max_restarts: 1}";
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port));
  {
    Node n1(dir, "node1a", {}, node_args(cfg, 1, "127.0.0.1", port));
    REQUIRE(wait_until([&] { return test::file_exists(dir / "run/checkpoints/step_00000002"); }, 25s));
    REQUIRE(kill(n1.pid(), SIGKILL) == 0);
    CHECK(n1.wait(5s) == 128 + SIGKILL);
  }
  REQUIRE(wait_until([&] { return n0.err().find("waiting for every node to restart") != std::string::npos; }, 15s));
  Node n1(dir, "node1b", {}, node_args(cfg, 1, "127.0.0.1", port));
  const int c0 = n0.wait(60s), c1 = n1.wait(10s);
  const std::string e0 = n0.err(), e1 = n1.err();
  INFO("node 0:\n" << e0 << "\nnode 1 (again):\n" << e1);
  CHECK(c0 == 0);
  CHECK(c1 == 0);
  CHECK(e1.find("the job is at attempt 1 (restart 1); node 1 joins it") != std::string::npos);
  CHECK(e0.find("all 2 nodes are back: starting restart 1 from the latest checkpoint") != std::string::npos);
  CHECK(losses(dir / "run/metrics.jsonl").size() == size_t(o.steps));
  CHECK(processes_mentioning(dir.path()).empty());
}

// Slurm's --signal=USR1@T reaches every task: each agent forwards it, all
// ranks agree on a step, save one checkpoint, every agent exits 75, and the
// same command resumes.
TEST_CASE("multinode: SIGUSR1 to every agent checkpoints, exits 75 and the next run resumes", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 30;
  o.log_interval = 1;
  const std::vector<double> want = reference_losses(dir, o);
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  {
    Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port));
    Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port));
    REQUIRE(wait_until([&] { return test::read_file(dir / "run/logs/rank0.log").find("step 3/") != std::string::npos; },
                       25s));
    REQUIRE(kill(n0.pid(), SIGUSR1) == 0);
    REQUIRE(kill(n1.pid(), SIGUSR1) == 0);
    const int c0 = n0.wait(20s), c1 = n1.wait(10s);
    INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
    CHECK(c0 == 75);
    CHECK(c1 == 75);
    CHECK(n0.err().find("(checkpointed, please requeue)") != std::string::npos);
  }
  CHECK(losses(dir / "run/metrics.jsonl").size() < size_t(o.steps));
  // "Requeued": the same commands again.
  Node n0(dir, "node0b", {}, node_args(cfg, 0, "127.0.0.1", port));
  Node n1(dir, "node1b", {}, node_args(cfg, 1, "127.0.0.1", port));
  const int c0 = n0.wait(40s), c1 = n1.wait(10s);
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  CHECK(c0 == 0);
  CHECK(c1 == 0);
  check_same_losses(losses(dir / "run/metrics.jsonl"), want);
  CHECK(processes_mentioning(dir.path()).empty());
}

// Preempted before training started: a SIGUSR1/SIGTERM while the nodes are
// still meeting (or while an agent is still starting) is not fatal; no
// worker runs yet, so there is nothing to checkpoint: every agent exits 75
// ("please requeue") at once, saying so, and leaves nothing behind. A node
// that is preempted there tells the nodes still waiting, which stop too.
TEST_CASE("multinode: a preemption signal while the nodes meet exits 75 on every node", "[multinode]") {
  test::TempDir dir("mnode");
  JobOpts o;
  o.timeout_s = 60;  // nothing below may wait for it
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  const int port = free_port();
  const std::string nothing = "the job was preempted before training started (nothing to checkpoint); exiting with "
                              "code 75 (please requeue)";
  auto says = [](const Node& n, const std::string& text) { return n.err().find(text) != std::string::npos; };
  const auto t0 = Clock::now();
  SECTION("SIGUSR1 to node 0 waiting for a node that has not come") {
    Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port));
    REQUIRE(wait_until([&] { return says(n0, "node 0 of 2 is waiting for the other nodes"); }, 20s));
    REQUIRE(kill(n0.pid(), SIGUSR1) == 0);
    const int c0 = n0.wait(10s);
    INFO(n0.err());
    CHECK(c0 == 75);
    CHECK(says(n0, "trainrun: received SIGUSR1 while node 0 of 2 waited for the other nodes: " + nothing));
  }
  SECTION("SIGTERM to node 1 while node 0 is late: node 0 hears of it") {
    Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port), {"TRAINRUN_DEBUG_JOIN_DELAY_MS=3000"});
    Node n1(dir, "node1", {}, node_args(cfg, 1, "127.0.0.1", port));
    REQUIRE(wait_until([&] { return says(n1, "node 1 of 2 is waiting for the other nodes"); }, 20s));
    REQUIRE(kill(n1.pid(), SIGTERM) == 0);
    const int c1 = n1.wait(10s), c0 = n0.wait(15s);
    INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
    CHECK(c1 == 75);
    CHECK(c0 == 75);
    CHECK(says(n1, "trainrun: received SIGTERM while node 1 of 2 waited for the other nodes: " + nothing));
    CHECK(says(n0, "received SIGTERM while the nodes were meeting; node 0 of 2 stops too: " + nothing));
  }
  SECTION("SIGUSR1 to a node agent still starting up") {
    Node n0(dir, "node0", {}, node_args(cfg, 0, "127.0.0.1", port), {"TRAINRUN_DEBUG_START_DELAY_MS=30000"});
    REQUIRE(wait_until([&] { return says(n0, "debug: start-up pause"); }, 20s));
    REQUIRE(kill(n0.pid(), SIGUSR1) == 0);
    const int c0 = n0.wait(10s);
    INFO(n0.err());
    CHECK(c0 == 75);
    CHECK(says(n0, "trainrun: received SIGUSR1 before any worker started: " + nothing));
  }
  CHECK(Clock::now() - t0 < 25s);
  CHECK(!test::file_exists(dir / "run/logs"));  // no worker was started
  CHECK(!test::file_exists(dir / "run/checkpoints"));
  CHECK(wait_until([&] { return processes_mentioning(dir.path()).empty(); }, 5s));
}

// ---- two hosts in network namespaces --------------------------------------------------------------

TEST_CASE("multinode: two hosts in network namespaces train like one process", "[multinode]") {
  const std::string why = NetnsPair::unavailable_reason();
  if (!why.empty()) {
    WARN("skipped: " << why);
    return;
  }
  test::TempDir dir("mnode");
  JobOpts o;
  const std::vector<double> want = reference_losses(dir, o);
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  NetnsPair net;  // destroyed after the nodes below
  const auto t0 = Clock::now();
  Node n0(dir, "node0", net.exec_prefix(0), node_args(cfg, 0, NetnsPair::addr(0), 29500));
  Node n1(dir, "node1", net.exec_prefix(1), node_args(cfg, 1, NetnsPair::addr(0), 29500));
  const int c0 = n0.wait(30s), c1 = n1.wait(10s);
  const auto took = Clock::now() - t0;
  INFO("node 0:\n" << n0.err() << "\nnode 1:\n" << n1.err());
  REQUIRE(c0 == 0);
  REQUIRE(c1 == 0);
  // Node 1's workers reached node 0 over the veth pair, from their own address.
  CHECK(n1.err().find("rendezvous store 10.231.7.1:29500; workers bind 10.231.7.2;") != std::string::npos);
  CHECK(n0.err().find("workers bind 10.231.7.1;") != std::string::npos);
  check_same_losses(losses(dir / "run/metrics.jsonl"), want);
  WARN("namespaces: 2 nodes x 2 workers trained " << o.steps << " steps in "
                                                   << std::chrono::duration<double>(took).count() << " s");
  CHECK(processes_mentioning(dir.path()).empty());
}

TEST_CASE("multinode: a link going down fails the job within the timeout naming the node", "[multinode]") {
  const std::string why = NetnsPair::unavailable_reason();
  if (!why.empty()) {
    WARN("skipped: " << why);
    return;
  }
  test::TempDir dir("mnode");
  JobOpts o;
  o.steps = 1000000;
  o.log_interval = 1000000;
  o.timeout_s = 4;  // node timeout 2 s
  const std::string cfg = make_job(dir, "job.yaml", 2, o);
  NetnsPair net;
  Node n0(dir, "node0", net.exec_prefix(0), node_args(cfg, 0, NetnsPair::addr(0), 29500));
  Node n1(dir, "node1", net.exec_prefix(1), node_args(cfg, 1, NetnsPair::addr(0), 29500));
  REQUIRE(wait_until([&] { return training_started(dir); }, 25s));
  std::this_thread::sleep_for(300ms);
  const auto t0 = Clock::now();
  net.link_down();
  const int c0 = n0.wait(20s), c1 = n1.wait(20s);
  const auto took = Clock::now() - t0;
  const std::string e0 = n0.err(), e1 = n1.err();
  INFO("node 0:\n" << e0 << "\nnode 1:\n" << e1);
  CHECK(c0 == 1);
  CHECK(c1 == 1);
  // Node 0 names the node that went silent, with its ranks; node 1 names
  // node 0's store.
  CHECK(e0.find("trainrun: error: node 1 (host ") != std::string::npos);
  CHECK(e0.find("ranks 2-3) stopped responding: its agent sent no heartbeat for ") != std::string::npos);
  CHECK(e1.find("lost the rendezvous store of node 0 (10.231.7.1:29500") != std::string::npos);
  CHECK(took < std::chrono::seconds(4 + 2 + 6));  // parallel.timeout_s + grace period + slack
  WARN("link down: node 0 exited " << c0 << ", node 1 exited " << c1 << ", "
                                   << std::chrono::duration<double>(took).count() << " s after the link went down");
  CHECK(wait_until([&] { return processes_mentioning(dir.path()).empty(); }, 5s));
}
