// The launcher (core/launch/agent.cpp) end to end: the real binary as agent
// and workers on tiny synthetic jobs. Every job writes under its own TempDir,
// whose path is in every process's command line (the agent's --config, the
// workers' job.resolved.yaml), so "nothing left behind" is checked by
// scanning /proc for that path, and a worker of a given rank is found by its
// command line plus RANK in its environment.
//
// Workers run with OMP_NUM_THREADS=1 (two or three processes share a small
// machine; more threads would only make them fight). Every wait has a
// deadline: a launcher bug makes a test fail, never hang.
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "parallel/rendezvous/store.h"
#include "tests/support/process_util.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

struct JobOpts {
  int nproc = 2;
  std::string sharding = "full_shard";
  int steps = 4;
  int log_interval = 1;
  double timeout_s = 60;
  std::string launcher;  // extra "launcher:" YAML, e.g. "{max_restarts: 1}"
};

// global_batch_size 6 = 1 micro-batch x {6, 3, 2} accumulation x {1, 2, 3}
// ranks: the same global batch for every world size we test.
std::string job_yaml(const std::string& run_dir, const JobOpts& o) {
  std::ostringstream y;
  y << "model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 16, seq_len: 16}\n"
    << "data: {format: synthetic}\n"
    << "train: {global_batch_size: 6, micro_batch_size: 1, max_steps: " << o.steps
    << ", log_interval: " << o.log_interval << ", eval_interval: 0, warmup_steps: 1}\n"
    << "output: {dir: '" << run_dir << "', sample_tokens: 0}\n"
    << "parallel: {nproc_per_node: " << o.nproc << ", sharding: " << o.sharding << ", timeout_s: " << o.timeout_s
    << "}\n";
  if (!o.launcher.empty()) y << "launcher: " << o.launcher << "\n";
  return y.str();
}

// Writes <dir>/job.yaml for a run in <dir>/run and returns the config path.
std::string make_job(const test::TempDir& dir, const JobOpts& o) {
  const std::string path = dir / "job.yaml";
  test::write_file(path, job_yaml(dir / "run", o));
  return path;
}

using test::losses;
using test::processes_mentioning;
using test::training_started;
using test::wait_until;
using test::worker_pid;

// The agent started in the background (for the tests that signal it or its
// workers while it runs); stdout/stderr go to files in the test dir.
class BackgroundRun : public test::BackgroundProcess {
 public:
  BackgroundRun(const test::TempDir& dir, const std::string& config, std::vector<std::string> extra_env = {})
      : BackgroundProcess({test::trainrun_binary(), "--config", config}, agent_env(extra_env), dir / "agent.out",
                          dir / "agent.err") {}

 private:
  static std::vector<std::string> agent_env(const std::vector<std::string>& extra_env) {
    std::vector<std::string> add = {"OMP_NUM_THREADS=1"};
    add.insert(add.end(), extra_env.begin(), extra_env.end());
    return test::environment_with({"OMP_NUM_THREADS"}, add);
  }
};

// A long job; wait for it with training_started(): from then on all workers
// are past the rendezvous and inside the step loop.
std::string start_long_job(const test::TempDir& dir, JobOpts o) {
  o.steps = 1000000;
  o.log_interval = 1000000;  // only step 1 is logged
  return make_job(dir, o);
}

std::string with_omp1(const std::string& cmd) { return "OMP_NUM_THREADS=1 " + cmd; }

int closed_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);  // nothing listens there now
  return ntohs(a.sin_port);
}

}  // namespace

// The "same math everywhere" contract through the launcher: N worker
// processes under a sharding strategy log the same losses as one process.
TEST_CASE("launcher: 2 and 3 workers train like 1 process", "[launcher]") {
  const std::string sharding = GENERATE(as<std::string>{}, "no_shard", "full_shard");
  INFO("sharding: " << sharding);
  test::TempDir base("launch1");
  JobOpts o;
  o.nproc = 1;
  o.sharding = sharding;
  const auto ref = test::run_command(with_omp1("'" + test::trainrun_binary() + "' --config '" + make_job(base, o) + "'"));
  REQUIRE(ref.exit_code == 0);
  const std::vector<double> want = losses(base / "run/metrics.jsonl");
  REQUIRE(want.size() == size_t(o.steps));

  for (int nproc : {2, 3}) {
    INFO("workers: " << nproc);
    test::TempDir dir("launch");
    o.nproc = nproc;
    const auto r = test::run_command(with_omp1("'" + test::trainrun_binary() + "' --config '" + make_job(dir, o) + "'"));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    for (int rank = 0; rank < nproc; ++rank)
      CHECK(test::file_exists(dir / ("run/logs/rank" + std::to_string(rank) + ".log")));
    CHECK(r.err.find("[rank 0] step 1/") != std::string::npos);
    CHECK(r.err.find("[rank 1]") == std::string::npos);  // other ranks only go to their logs
    CHECK(r.err.find("all " + std::to_string(nproc) + " workers finished") != std::string::npos);
    const std::vector<double> got = losses(dir / "run/metrics.jsonl");
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-5));
    CHECK(processes_mentioning(dir.path()).empty());
  }
}

TEST_CASE("launcher: workers get the torchrun environment contract", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 3;
  o.steps = 1;
  const std::string cfg = make_job(dir, o);
  // OMP_NUM_THREADS unset: the agent gives each worker its share of the cores.
  const auto r = test::run_command("env -u OMP_NUM_THREADS TRAINRUN_DEBUG_PRINT_ENV=1 '" + test::trainrun_binary() +
                                   "' --config '" + cfg + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  const int omp = std::max(1, CPU_COUNT(&set) / 3);
  std::string port;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string log = test::read_file(dir / ("run/logs/rank" + std::to_string(rank) + ".log"));
    INFO("rank " << rank << " log:\n" << log);
    const std::string r_s = std::to_string(rank);
    CHECK(log.find("RANK=" + r_s + " LOCAL_RANK=" + r_s + " WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 GROUP_RANK=0 "
                   "GROUP_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=") != std::string::npos);
    CHECK(log.find("TRAINRUN_RESTART_COUNT=0 OMP_NUM_THREADS=" + std::to_string(omp) + " ") != std::string::npos);
    CHECK(log.find("TRAINRUN_STORE_SECRET=<32 chars>") != std::string::npos);  // there, but never printed
    // Every rank dials the same store.
    const auto at = log.find("MASTER_PORT=");
    REQUIRE(at != std::string::npos);
    const std::string p = log.substr(at, log.find(' ', at) - at);
    if (rank == 0) port = p;
    CHECK(p == port);
    CHECK(p != "MASTER_PORT=0");
  }
  // A user's own OMP_NUM_THREADS is kept.
  test::TempDir dir2("launch");
  const auto r2 = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_PRINT_ENV=1 '" + test::trainrun_binary() +
                                    "' --config '" + make_job(dir2, o) + "'");
  REQUIRE(r2.exit_code == 0);
  CHECK(test::read_file(dir2 / "run/logs/rank2.log").find("OMP_NUM_THREADS=1 ") != std::string::npos);
}

// A process that an outside launcher (torchrun, srun) already placed is a
// worker: it must train in-process, not spawn workers of its own.
TEST_CASE("launcher: with RANK or WORLD_SIZE set trainrun is a worker and not an agent", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 3;
  o.steps = 1;
  const auto r = test::run_command("OMP_NUM_THREADS=1 RANK=0 WORLD_SIZE=1 '" + test::trainrun_binary() +
                                   "' --config '" + make_job(dir, o) + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(!test::file_exists(dir / "run/logs"));
  CHECK(r.err.find("starting 3 workers") == std::string::npos);
  CHECK(losses(dir / "run/metrics.jsonl").size() == 1);
}

TEST_CASE("launcher: a bad batch split is reported once before any worker starts", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 4;  // 6 sequences do not split over 4 ranks
  const auto r = test::run_command(with_omp1("'" + test::trainrun_binary() + "' --config '" + make_job(dir, o) + "'"));
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("train.global_batch_size (6 sequences) must be a multiple of train.micro_batch_size (1) x "
                   "world size (4 workers)") != std::string::npos);
  CHECK(!test::file_exists(dir / "run/logs"));
}

TEST_CASE("launcher: an error in one worker stops the job and the report names it first", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 3;
  o.steps = 6;
  const auto t0 = Clock::now();
  const auto r = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_FAIL_RANK=1 TRAINRUN_DEBUG_FAIL_STEP=3 '" +
                                   test::trainrun_binary() + "' --config '" + make_job(dir, o) + "'");
  INFO(r.err);
  CHECK(r.exit_code == 1);
  // The peers fail a moment later ("lost the connection"); rank 1 is the cause.
  CHECK(r.err.find("trainrun: error: rank 1 (pid ") != std::string::npos);
  CHECK(r.err.find(", host ") != std::string::npos);
  CHECK(r.err.find(") failed first: exit code 1\n") != std::string::npos);
  CHECK(r.err.find("lines of " + dir.path() + "/run/logs/rank1.log:") != std::string::npos);
  CHECK(r.err.find("[rank 1] trainrun: error: injected failure") != std::string::npos);
  CHECK(r.err.find("rank 1 fails at step 3") != std::string::npos);
  // Every other rank is accounted for.
  for (const char* other : {"rank 0 (pid ", "rank 2 (pid "}) CHECK(r.err.find(other) != std::string::npos);
  CHECK(test::read_file(dir / "run/logs/rank1.log").find("injected failure") != std::string::npos);
  CHECK(processes_mentioning(dir.path()).empty());
  CHECK(Clock::now() - t0 < 15s);  // no grace period is waited out: the peers fail by themselves
}

TEST_CASE("launcher: a worker killed by SIGKILL is reported with its signal", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 3;
  BackgroundRun agent(dir, start_long_job(dir, o));
  REQUIRE(wait_until([&] { return training_started(dir); }, 20s));
  const pid_t victim = worker_pid(dir.path(), 1);
  REQUIRE(victim > 0);
  REQUIRE(kill(victim, SIGKILL) == 0);
  const int code = agent.wait(20s);
  const std::string err = agent.err();
  INFO(err);
  CHECK(code == 1);
  CHECK(err.find("trainrun: error: rank 1 (pid " + std::to_string(victim) + ", host ") != std::string::npos);
  CHECK(err.find("failed first: killed by signal SIGKILL (9)") != std::string::npos);
  CHECK(processes_mentioning(dir.path()).empty());
}

// Like torchrun: SIGINT, SIGTERM and SIGUSR1 are forwarded to the workers,
// and the agent exits 128+signal once they are gone.
// Workers treat the forwarded signal as "checkpoint at the next step boundary
// and stop": SIGTERM/SIGUSR1 (Slurm's preemption signals) end in exit code
// 75, "checkpointed, please requeue"; SIGINT in 130.
TEST_CASE("launcher: SIGTERM or SIGINT or SIGUSR1 to the agent stops every worker", "[launcher]") {
  const int sig = GENERATE(SIGTERM, SIGINT, SIGUSR1);
  const std::string name = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGUSR1";
  INFO(name);
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 2;
  BackgroundRun agent(dir, start_long_job(dir, o));
  REQUIRE(wait_until([&] { return training_started(dir); }, 20s));
  REQUIRE(worker_pid(dir.path(), 1) > 0);
  const auto t0 = Clock::now();
  REQUIRE(kill(agent.pid(), sig) == 0);
  const int code = agent.wait(20s);
  const std::string err = agent.err();
  INFO(err);
  const int want = sig == SIGINT ? 128 + SIGINT : 75;
  CHECK(code == want);
  CHECK(err.find("received " + name + ": forwarding it to 2 workers") != std::string::npos);
  if (sig == SIGINT)
    CHECK(err.find("stopped by SIGINT; all 2 workers are gone; exiting with code 130") != std::string::npos);
  else
    CHECK(err.find("stopped by " + name + " after every worker saved a checkpoint; exiting with code 75 "
                   "(checkpointed, please requeue)") != std::string::npos);
  CHECK(err.find("saving a checkpoint at step") != std::string::npos);
  CHECK(Clock::now() - t0 < 5s);  // the workers stop at the next step boundary, no grace period waited out
  CHECK(processes_mentioning(dir.path()).empty());
}

// PR_SET_PDEATHSIG: an agent that cannot clean up still takes its workers along.
TEST_CASE("launcher: workers die with an agent killed by SIGKILL", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 2;
  BackgroundRun agent(dir, start_long_job(dir, o));
  REQUIRE(wait_until([&] { return training_started(dir); }, 20s));
  REQUIRE(worker_pid(dir.path(), 1) > 0);
  REQUIRE(kill(agent.pid(), SIGKILL) == 0);
  CHECK(agent.wait(20s) == 128 + SIGKILL);
  CHECK(wait_until([&] { return processes_mentioning(dir.path()).empty(); }, 5s));
}

TEST_CASE("launcher: a worker that ignores SIGTERM gets SIGKILL after the grace period", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 2;
  o.launcher = "{grace_period_s: 1}";
  BackgroundRun agent(dir, start_long_job(dir, o), {"TRAINRUN_DEBUG_IGNORE_SIGTERM=1"});
  REQUIRE(wait_until([&] { return training_started(dir); }, 20s));
  const auto t0 = Clock::now();
  REQUIRE(kill(agent.pid(), SIGTERM) == 0);
  const int code = agent.wait(20s);
  const auto took = Clock::now() - t0;
  const std::string err = agent.err();
  INFO(err);
  CHECK(code == 143);
  CHECK(err.find("still running 1 s after being asked to stop: sending SIGKILL") != std::string::npos);
  CHECK(took >= 900ms);
  CHECK(took < 10s);
  CHECK(processes_mentioning(dir.path()).empty());
}

// A stopped (SIGSTOP) worker looks like a hung one: its peers' next
// collective times out after parallel.timeout_s, and the agent must then
// take down the whole job, the stopped process included.
TEST_CASE("launcher: a stopped worker makes the others time out and the job is torn down", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 3;
  o.timeout_s = 3;
  BackgroundRun agent(dir, start_long_job(dir, o));
  REQUIRE(wait_until([&] { return training_started(dir); }, 20s));
  const pid_t stopped = worker_pid(dir.path(), 1);
  REQUIRE(stopped > 0);
  const auto t0 = Clock::now();
  REQUIRE(kill(stopped, SIGSTOP) == 0);
  const int code = agent.wait(20s);
  const auto took = Clock::now() - t0;
  const std::string err = agent.err();
  INFO(err);
  CHECK(code == 1);
  CHECK(took >= 2500ms);  // the peers waited out (about) their timeout...
  CHECK(took < 12s);      // ...and nothing waited much longer
  // The failing rank is one of the waiting peers; its error names the
  // collective and the timeout.
  CHECK((err.find("error: rank 0 (pid ") != std::string::npos || err.find("error: rank 2 (pid ") != std::string::npos));
  CHECK(err.find("timed out") != std::string::npos);
  const bool names_collective = err.find("all_gather (step") != std::string::npos ||
                                err.find("reduce_scatter (step") != std::string::npos ||
                                err.find("all_reduce (step") != std::string::npos ||
                                err.find("barrier (step") != std::string::npos;
  CHECK(names_collective);
  CHECK(err.find("stopped rank 1 (pid " + std::to_string(stopped) + ")") != std::string::npos);
  CHECK(err.find("it was suspended (SIGSTOP or a debugger)") != std::string::npos);
  CHECK(processes_mentioning(dir.path()).empty());
}

TEST_CASE("launcher: a worker that cannot reach the store names the address", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.timeout_s = 1;
  const std::string cfg = make_job(dir, o);
  const int port = closed_port();
  const auto t0 = Clock::now();
  const auto r = test::run_command("OMP_NUM_THREADS=1 RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                   std::to_string(port) + " TRAINRUN_STORE_SECRET=abc '" + test::trainrun_binary() +
                                   "' worker --config '" + cfg + "'");
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("trainrun: error: cannot reach the rendezvous store at 127.0.0.1:" + std::to_string(port)) !=
        std::string::npos);
  CHECK(Clock::now() - t0 < 10s);
}

TEST_CASE("launcher: a worker with the wrong secret is rejected by the store", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.timeout_s = 5;
  const std::string cfg = make_job(dir, o);
  TcpStoreServer store("127.0.0.1", 0, make_job_secret());
  const auto r = test::run_command("OMP_NUM_THREADS=1 RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                   std::to_string(store.port()) + " TRAINRUN_STORE_SECRET=not-the-secret '" +
                                   test::trainrun_binary() + "' worker --config '" + cfg + "'");
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("127.0.0.1:" + std::to_string(store.port())) != std::string::npos);
  CHECK(r.err.find("rejected our secret") != std::string::npos);
}

TEST_CASE("launcher: launcher.max_restarts restarts all workers after a failure", "[launcher]") {
  test::TempDir dir("launch");
  JobOpts o;
  o.nproc = 2;
  o.steps = 4;
  o.launcher = "{max_restarts: 1}";
  const std::string cfg = make_job(dir, o);
  SECTION("a failure that does not come back: the restart finishes the job") {
    const auto r = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_FAIL_RANK=1 TRAINRUN_DEBUG_FAIL_STEP=2 "
                                     "TRAINRUN_DEBUG_FAIL_ONCE=1 '" +
                                     test::trainrun_binary() + "' --config '" + cfg + "'");
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK(r.err.find("failed first: exit code 1") != std::string::npos);
    CHECK(r.err.find("trainrun: restarting all workers (restart 1 of 1)") != std::string::npos);
    CHECK(r.err.find("all 2 workers finished") != std::string::npos);
    // The log keeps the failed attempt, then the restart.
    const std::string log = test::read_file(dir / "run/logs/rank1.log");
    const auto fail = log.find("injected failure"), mark = log.find("---- trainrun: restart 1 of 1 ----");
    CHECK(fail != std::string::npos);
    CHECK(mark != std::string::npos);
    CHECK(fail < mark);
    CHECK(losses(dir / "run/metrics.jsonl").size() == size_t(o.steps));
  }
  SECTION("a failure that comes back: restarts run out, exit 1") {
    const auto r = test::run_command("OMP_NUM_THREADS=1 TRAINRUN_DEBUG_FAIL_RANK=1 TRAINRUN_DEBUG_FAIL_STEP=2 '" +
                                     test::trainrun_binary() + "' --config '" + cfg + "'");
    INFO(r.err);
    CHECK(r.exit_code == 1);
    CHECK(r.err.find("restarting all workers (restart 1 of 1)") != std::string::npos);
    CHECK(r.err.find("no restarts left (launcher.max_restarts: 1); giving up") != std::string::npos);
  }
  CHECK(processes_mentioning(dir.path()).empty());
}
