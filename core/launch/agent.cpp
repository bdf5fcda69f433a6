// The agent: spawn, watch, report, tear down, restart. See agent.h for the
// contract; the notes here are about the how.
//
// One thread. Everything the agent waits for is a file descriptor: the
// workers' output pipes and a signalfd carrying SIGINT/SIGTERM/SIGUSR1 and
// SIGCHLD, so a single poll() loop sees every event in order, with no signal
// handler and no race between "a worker died" and "the user pressed Ctrl-C".
// Those signals are blocked before the store's server thread starts, so that
// thread inherits the mask and can never be the one that receives them.
//
// Workers are forked and exec'd (/proc/self/exe, i.e. this very binary even
// if the file was replaced since). Each is the leader of its own process
// group, so a signal to -pid reaches anything it spawned, and a Ctrl-C in the
// terminal reaches only the agent, which decides what the workers get. Each
// has PR_SET_PDEATHSIG=SIGKILL, so a worker never outlives an agent that was
// itself SIGKILLed. A worker is reaped only after its group got SIGKILL
// (waitid WNOWAIT first): while the zombie leader exists its pgid cannot be
// reused, so the group kill cannot hit an unrelated process.
#include "core/launch/agent.h"
#include "parallel/pipeline/schedule.h"
#include "core/train/preemption.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>
#include <sstream>
#include <vector>

#include "core/common/debug_hooks.h"
#include "core/common/error.h"
#include "core/common/log.h"
#include "core/launch/launch_mode.h"
#include "core/launch/node_group.h"
#include "core/model/model_spec.h"
#include "core/model/tensor_parallel.h"
#include "core/train/progress.h"
#include "core/train/trainer.h"
#include "parallel/rendezvous/store.h"
#include "parallel/topology/topology_launch.h"

extern char** environ;

namespace trainrun {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// A line longer than this is cut into pieces (a worker printing a huge blob
// without a newline must not grow the agent's memory without bound).
constexpr size_t kMaxLine = 64 * 1024;
// After the first failure, how long the agent keeps collecting other
// failures before it sends SIGTERM. Peers of a failed rank usually fail a
// moment later ("connection closed by rank 2"); waiting this long lets the
// first one finish writing its error file, so the report blames the right
// rank, and costs nothing that matters next to the grace period.
constexpr auto kSettle = std::chrono::milliseconds(500);

// The variables the agent sets for every worker; inherited values are dropped.
const char* const kContractVars[] = {"RANK",
                                     "LOCAL_RANK",
                                     "WORLD_SIZE",
                                     "LOCAL_WORLD_SIZE",
                                     "GROUP_RANK",
                                     "GROUP_WORLD_SIZE",
                                     "MASTER_ADDR",
                                     "MASTER_PORT",
                                     "TRAINRUN_STORE_SECRET",
                                     "TRAINRUN_RESTART_COUNT",
                                     "TRAINRUN_MAX_RESTARTS",
                                     "TRAINRUN_ERROR_FILE",
                                     "TRAINRUN_AGENT_ECHO"};

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::max(0.0, s)));
}

std::string sig_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// "exit code 1" / "killed by signal SIGKILL (9)" — the words of the report.
std::string describe_status(int st) {
  if (WIFEXITED(st)) return "exit code " + std::to_string(WEXITSTATUS(st));
  if (WIFSIGNALED(st)) {
    const int s = WTERMSIG(st);
    return "killed by signal " + sig_name(s) + " (" + std::to_string(s) + ")" + (WCOREDUMP(st) ? ", core dumped" : "");
  }
  return "wait status " + std::to_string(st);
}

bool status_ok(int st) { return WIFEXITED(st) && WEXITSTATUS(st) == 0; }

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

std::string fmt_seconds(double s) {
  std::ostringstream os;
  os << std::setprecision(3) << s << " s";
  return os.str();
}

// State 'T' (stopped by a signal) or 't' (stopped by a tracer) in /proc/<pid>/stat.
bool is_suspended(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto paren = s.rfind(')');  // the command name may contain spaces or ')'
  if (paren == std::string::npos || paren + 2 >= s.size()) return false;
  return s[paren + 2] == 'T' || s[paren + 2] == 't';
}

void write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // a closed terminal or a full disk must not stop the agent
    p += w;
    n -= size_t(w);
  }
}

// Rank 0's live status line, relayed through its pipe as a marked line
// (core/train/progress.h) and drawn here in place when this agent's stderr
// is a terminal. Every other line written to stderr erases it first; the
// next status update draws it again underneath.
struct StatusRelay {
  bool on = false;
  bool drawn = false;
  int width = 0;
};
StatusRelay g_status;

void erase_status() {
  if (!g_status.drawn) return;
  write_all(2, "\r\033[K", 4);
  g_status.drawn = false;
}

void draw_status(std::string s) {
  if (g_status.width > 1 && int(s.size()) > g_status.width - 1) s.resize(size_t(g_status.width - 1));
  s = "\r\033[K" + s;
  write_all(2, s.data(), s.size());
  g_status.drawn = true;
}

// TRAINRUN_PROGRESS as the user set it: live, or auto on a terminal.
bool relay_status_line() {
  const char* v = std::getenv("TRAINRUN_PROGRESS");
  const std::string m = v ? v : "";
  return m == "live" || ((m.empty() || m == "auto") && ::isatty(2));
}

// The agent's own lines. Written with write(2), unbuffered, so they
// interleave with the echoed worker lines in the order things happened.
void say(const std::string& line) {
  erase_status();
  const std::string s = "trainrun: " + line + "\n";
  write_all(2, s.data(), s.size());
}

void signal_group(pid_t pid, int sig) {
  // The group reaches what the worker spawned; the pid alone covers the
  // window in which the child has not yet become a group leader.
  if (::kill(-pid, sig) != 0) ::kill(pid, sig);
}

// The error message a worker wrote after the time (see run_worker).
std::string read_error_text(const std::string& path) {
  std::ifstream f(path);
  std::string first, rest, line;
  std::getline(f, first);
  while (std::getline(f, line)) rest += line + "\n";
  return rest;
}

int64_t read_error_time(const std::string& path) {
  std::ifstream f(path);
  long long ns = 0;
  if (f >> ns) return ns;
  return 0;
}

struct Worker {
  int rank = 0;     // global: node_rank * nproc_per_node + local
  int local = 0;    // LOCAL_RANK, the index in the agent's table
  pid_t pid = -1;
  int out_fd = -1;  // read end of the worker's stdout+stderr pipe (non-blocking)
  int log_fd = -1;  // logs/rank<N>.log
  std::string log_path, error_file;
  std::string partial;  // output after the last newline
  std::deque<std::string> tail;
  bool running = false;
  int status = 0;
  Clock::time_point ended_at;
  bool ended_before_stop = false;  // ended before the agent asked anyone to stop
  bool was_suspended = false;      // in state T when the teardown began
  bool got_sigkill = false;
  int64_t error_ns = 0;            // from its error file: when it hit its error
};

enum class Phase { Running, Settling, Stopping };

class Agent {
 public:
  Agent(const JobSpec& job, std::string spec_path, int nproc, topo::LaunchTopology topo, LaunchPlan plan)
      : job_(job), spec_path_(std::move(spec_path)), nproc_(nproc), host_(host_name()), topo_(std::move(topo)),
        plan_(std::move(plan)) {}
  ~Agent();
  int run();

 private:
  int run_nodes();
  int conclude(int attempt, int max_restarts);
  int pending_stop_signal();
  void on_node_events();
  std::string node_prefix() const;
  void spawn_all(int attempt, int port, const std::string& secret);
  void spawn_one(Worker& w, const std::vector<std::string>& env);
  void supervise();
  void read_signals();
  void on_signal(int sig);
  void drain(Worker& w);
  void emit(Worker& w, std::string line);
  void reap();
  void begin_stop(int sig);
  void kill_remaining(const std::string& why);
  bool any_running() const;
  int first_failure() const;
  void report_failure(int first) const;
  void close_logs();

  const JobSpec& job_;
  const std::string spec_path_;
  const int nproc_;
  bool echo_all_ranks_ = false;  // TRAINRUN_LOG_ALL_RANKS=1: echo every rank's lines, not only rank 0's
  const std::string host_;
  // Per-rank CPU/NUMA placement and the decided environment. A node agent
  // of a multi-node job decides it in run_nodes(), once output.dir is known
  // to be there (node 0 creates it).
  topo::LaunchTopology topo_;
  const LaunchPlan plan_;            // this node's place in the job (launch_mode.h)
  std::unique_ptr<NodeGroup> group_;  // the other nodes' agents (multi-node jobs only)
  std::string remote_failure_;       // why another node stopped the job (multi-node)
  std::vector<Worker> w_;
  int sfd_ = -1;
  Phase phase_ = Phase::Running;
  Clock::time_point settle_until_, kill_at_;
  int64_t stop_ns_ = 0;  // CLOCK_MONOTONIC when the stop signals went out
  bool killed_ = false;
  bool failed_ = false;
  int stop_signal_ = 0;  // the signal that told the agent to stop (0: none)
};

Agent::~Agent() {
  // Only reached with live workers when something threw mid-job: never
  // leave them behind.
  for (Worker& w : w_) {
    if (!w.running) continue;
    signal_group(w.pid, SIGKILL);
    int st;
    while (::waitpid(w.pid, &st, 0) < 0 && errno == EINTR) {
    }
    w.running = false;
  }
  for (Worker& w : w_)
    if (w.out_fd >= 0) ::close(w.out_fd), w.out_fd = -1;
  close_logs();
}

void Agent::close_logs() {
  erase_status();  // the workers are gone: their status line goes too
  for (Worker& w : w_)
    if (w.log_fd >= 0) ::close(w.log_fd), w.log_fd = -1;
}

bool Agent::any_running() const {
  return std::any_of(w_.begin(), w_.end(), [](const Worker& w) { return w.running; });
}

// ---- spawning ----------------------------------------------------------------------

// The child side of fork(): only async-signal-safe calls until execve (the
// agent has other threads, e.g. the store's). Everything was prepared by
// the parent.
[[noreturn]] void exec_worker(pid_t agent, int out_wr, char* const* argv, char* const* envp,
                              const topo::WorkerPlacement* place) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != agent) ::_exit(125);  // the agent died before prctl took effect
  const int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0 && devnull != 0) ::dup2(devnull, 0);
  ::dup2(out_wr, 1);
  ::dup2(out_wr, 2);
  // Whatever the agent's caller left open (a test harness's pipes) is not
  // the worker's business.
  ::close_range(3, ~0U, 0);
  // exec keeps an ignored disposition: SIGPIPE is ignored by the agent, and
  // a shell may have started the agent with SIGINT ignored (a background
  // job). Workers must react to what the agent forwards.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int s : {SIGPIPE, SIGINT, SIGTERM, SIGUSR1}) ::sigaction(s, &dfl, nullptr);
  // The agent blocks several signals and exec keeps the mask: unblock all
  // but the stop signals. Those stay blocked through exec, so one forwarded
  // before the worker's main() has its handlers waits, pending, instead of
  // killing the worker (main() unblocks them; core/train/preemption.h).
  sigset_t stops;
  sigemptyset(&stops);
  for (int s : {SIGINT, SIGTERM, SIGUSR1}) sigaddset(&stops, s);
  ::sigprocmask(SIG_SETMASK, &stops, nullptr);
  // CPU affinity and the NUMA memory policy survive exec; set them here so
  // the worker's first allocation already lands on its node.
  if (place) topo::apply_worker_placement(*place);
  ::execve("/proc/self/exe", argv, envp);
  static const char msg[] = "trainrun: cannot exec the worker (/proc/self/exe)\n";
  ssize_t ignored = ::write(2, msg, sizeof msg - 1);
  (void)ignored;
  ::_exit(127);
}

void Agent::spawn_one(Worker& w, const std::vector<std::string>& env) {
  std::vector<std::string> args = {"trainrun", "worker", "--config", spec_path_};
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_copy = env;
  for (auto& e : env_copy) envp.push_back(e.data());
  envp.push_back(nullptr);

  int p[2];
  TR_CHECK_ERRNO(::pipe2(p, O_CLOEXEC) == 0, "launcher: cannot create the output pipe of rank ", w.rank);
  ::fcntl(p[0], F_SETFL, ::fcntl(p[0], F_GETFL) | O_NONBLOCK);
  const topo::WorkerPlacement* place =
      size_t(w.local) < topo_.placement.size() ? &topo_.placement[size_t(w.local)] : nullptr;
  const pid_t agent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) exec_worker(agent, p[1], argv.data(), envp.data(), place);
  const int fork_errno = errno;
  ::close(p[1]);
  if (pid < 0) {
    ::close(p[0]);
    errno = fork_errno;
    TR_CHECK_ERRNO(false, "launcher: cannot start worker rank ", w.rank, " (fork)");
  }
  ::setpgid(pid, pid);  // also in the child: whichever runs first
  w.pid = pid;
  w.out_fd = p[0];
  w.running = true;
}

void Agent::spawn_all(int attempt, int port, const std::string& secret) {
  const fs::path logs = fs::path(job_.output.dir) / "logs";
  std::error_code ec;
  fs::create_directories(logs, ec);
  TR_CHECK(!ec, "launcher: cannot create '", logs.string(), "': ", ec.message(), "; check that output.dir is writable");

  std::vector<std::string> common;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (std::none_of(std::begin(kContractVars), std::end(kContractVars), [&](const char* v) { return name == v; }))
      common.push_back(kv);
  }
  // OMP_NUM_THREADS (unless the user set it): each worker's own share of
  // the CPUs: the CPUs its placement binds it to, else an equal split.
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const bool set_omp = !omp || !*omp;
  // Several nodes: ranks are global (node_rank * nproc + local), the world
  // is every node's workers, and each worker binds the interface that
  // reaches node 0 (TRAINRUN_GLOO_HOST, unless the user set it).
  const std::string world = std::to_string(plan_.nnodes * nproc_), local_world = std::to_string(nproc_);
  if (group_ && !std::getenv("TRAINRUN_GLOO_HOST")) common.push_back("TRAINRUN_GLOO_HOST=" + group_->bind_addr());
  for (const std::string& kv : std::vector<std::string>{"WORLD_SIZE=" + world, "LOCAL_WORLD_SIZE=" + local_world,
        "GROUP_RANK=" + std::to_string(plan_.node_rank), "GROUP_WORLD_SIZE=" + std::to_string(plan_.nnodes),
        "MASTER_ADDR=" + plan_.master_addr, "MASTER_PORT=" + std::to_string(port),
        "TRAINRUN_STORE_SECRET=" + secret, "TRAINRUN_RESTART_COUNT=" + std::to_string(attempt),
        "TRAINRUN_MAX_RESTARTS=" + std::to_string(job_.launcher.max_restarts)})
    common.push_back(kv);
  // NCCL_* and friends from the topology; names the user set are not in here.
  common.insert(common.end(), topo_.env.begin(), topo_.env.end());

  w_.assign(size_t(nproc_), Worker{});
  for (int r = 0; r < nproc_; ++r) {
    Worker& w = w_[size_t(r)];
    w.rank = plan_.first_rank() + r;
    w.local = r;
    w.log_path = (logs / ("rank" + std::to_string(w.rank) + ".log")).string();
    w.error_file = (logs / ("rank" + std::to_string(w.rank) + ".error")).string();
    fs::remove(w.error_file, ec);  // a stale one would confuse first_failure()
    // The first attempt starts fresh logs; restarts append, after a marker,
    // so the failed attempt's lines stay readable.
    w.log_fd = ::open(w.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (attempt == 0 ? O_TRUNC : 0),
                      0644);
    TR_CHECK_ERRNO(w.log_fd >= 0, "launcher: cannot open '", w.log_path, "'");
    if (attempt > 0) {
      const std::string mark = "---- trainrun: restart " + std::to_string(attempt) + " of " +
                               std::to_string(job_.launcher.max_restarts) + " ----\n";
      write_all(w.log_fd, mark.data(), mark.size());
    }
  }
  for (Worker& w : w_) {
    std::vector<std::string> env = common;
    if (w.rank == 0 && g_status.on) {
      // Its stderr is our pipe: it sends the status line for us to draw.
      env.erase(std::remove_if(env.begin(), env.end(),
                               [](const std::string& kv) { return kv.rfind("TRAINRUN_PROGRESS=", 0) == 0; }),
                env.end());
      env.push_back("TRAINRUN_PROGRESS=relay");
    }
    if (set_omp) {
      int threads = std::max(1, usable_cpus() / nproc_);
      if (size_t(w.local) < topo_.placement.size() && topo_.placement[size_t(w.local)].bind_cpus)
        threads = std::max(1, CPU_COUNT(&topo_.placement[size_t(w.local)].cpus));
      env.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
    }
    env.push_back("TRAINRUN_AGENT_ECHO=1");  // this agent prefixes the lines it echoes
    env.push_back("RANK=" + std::to_string(w.rank));
    env.push_back("LOCAL_RANK=" + std::to_string(w.local));
    env.push_back("TRAINRUN_ERROR_FILE=" + w.error_file);
    spawn_one(w, env);  // on a throw, ~Agent kills and reaps those already started
  }
}

// ---- output -------------------------------------------------------------------------

void Agent::emit(Worker& w, std::string line) {
  if (!line.empty() && line[0] == kStatusLineMarker) {
    // Rank 0's status line: drawn, never logged (the log has the plain lines).
    if (w.rank == 0 && g_status.on) draw_status(line.substr(1));
    return;
  }
  line += '\n';
  if (w.log_fd >= 0) write_all(w.log_fd, line.data(), line.size());
  line.pop_back();
  // Rank 0's lines reach the terminal; with TRAINRUN_LOG_ALL_RANKS=1 every
  // rank's do (each worker's own log file has them all regardless).
  if (w.rank == 0 || echo_all_ranks_) {
    erase_status();
    const std::string echo = "[rank " + std::to_string(w.rank) + "] " + line + "\n";
    write_all(2, echo.data(), echo.size());
  }
  const size_t keep = size_t(std::max(0, job_.launcher.log_tail_lines));
  if (keep == 0) return;
  w.tail.push_back(std::move(line));
  while (w.tail.size() > keep) w.tail.pop_front();
}

// Reads whatever is in the pipe now. At EOF the fd is closed and the last
// unterminated line emitted.
void Agent::drain(Worker& w) {
  char buf[65536];
  while (w.out_fd >= 0) {
    const ssize_t n = ::read(w.out_fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;  // EAGAIN: nothing more for now
    if (n == 0) {
      ::close(w.out_fd);
      w.out_fd = -1;
      if (!w.partial.empty()) emit(w, std::move(w.partial)), w.partial.clear();
      return;
    }
    w.partial.append(buf, size_t(n));
    size_t start = 0;
    for (size_t nl; (nl = w.partial.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(w, w.partial.substr(start, nl - start));
    w.partial.erase(0, start);
    while (w.partial.size() >= kMaxLine) {
      emit(w, w.partial.substr(0, kMaxLine));
      w.partial.erase(0, kMaxLine);
    }
  }
}

// ---- watching -----------------------------------------------------------------------

void Agent::reap() {
  for (Worker& w : w_) {
    if (!w.running) continue;
    siginfo_t info{};
    int st = 0;
    if (::waitid(P_PID, id_t(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
      if (errno != ECHILD) continue;  // EINTR: next round
      st = 255 << 8;  // reaped behind our back (cannot happen): count it as a failure, never wait forever
    } else if (info.si_pid != w.pid) {
      continue;  // still running
    } else {
      // Exited but not yet reaped: its group id is still reserved, so this
      // reaches only what it left behind.
      ::kill(-w.pid, SIGKILL);
      while (::waitpid(w.pid, &st, 0) < 0 && errno == EINTR) {
      }
    }
    w.running = false;
    w.status = st;
    w.ended_at = Clock::now();
    w.ended_before_stop = phase_ != Phase::Stopping;
    w.error_ns = read_error_time(w.error_file);
    drain(w);  // everything it wrote is in the pipe by now
    if (w.out_fd >= 0) {
      // A leftover of its group (just SIGKILLed) may still hold the pipe;
      // what is not there now is not waited for.
      ::close(w.out_fd);
      w.out_fd = -1;
      if (!w.partial.empty()) emit(w, std::move(w.partial)), w.partial.clear();
    }
    // kExitRequeue is not a failure: the ranks agreed to checkpoint and stop
    // (a signal reached the workers directly, e.g. from Slurm).
    const bool requeue = WIFEXITED(st) && WEXITSTATUS(st) == kExitRequeue;
    if (!status_ok(st) && !requeue && phase_ == Phase::Running && stop_signal_ == 0) {
      failed_ = true;
      phase_ = Phase::Settling;
      settle_until_ = Clock::now() + std::min<Clock::duration>(kSettle, seconds(job_.launcher.grace_period_s));
    }
    // The other nodes stop their workers too (the heartbeat thread tells
    // them). A rank that only lost its peers lets the node of the cause
    // speak first; a cause found while settling replaces it.
    if (group_ && !status_ok(st) && !requeue && phase_ == Phase::Settling && stop_signal_ == 0 &&
        remote_failure_.empty()) {
      const bool consequence = !WIFSIGNALED(st) && failure_is_consequence(read_error_text(w.error_file));
      group_->announce_failure(group_->node_label(plan_.node_rank) + " failed: rank " + std::to_string(w.rank) +
                                   " (pid " + std::to_string(w.pid) + ") ended with " + describe_status(st) +
                                   "; that node's agent output and " + w.log_path + " say why",
                               consequence);
    }
  }
}

// Asks every running worker to stop with `sig`; SIGKILL follows after the grace period.
void Agent::begin_stop(int sig) {
  phase_ = Phase::Stopping;
  stop_ns_ = monotonic_now_ns();
  kill_at_ = Clock::now() + seconds(job_.launcher.grace_period_s);
  for (Worker& w : w_) {
    if (!w.running) continue;
    w.was_suspended = is_suspended(w.pid);
    signal_group(w.pid, sig);
    // A suspended worker would sit on the signal until SIGKILL; let it act now.
    signal_group(w.pid, SIGCONT);
  }
}

void Agent::kill_remaining(const std::string& why) {
  killed_ = true;
  for (Worker& w : w_) {
    if (!w.running) continue;
    say("rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") " + why + ": sending SIGKILL");
    w.got_sigkill = true;
    signal_group(w.pid, SIGKILL);
  }
}

void Agent::on_signal(int sig) {
  if (sig == SIGCHLD) return;  // reap() looks at every worker after each wake-up
  const int n = int(std::count_if(w_.begin(), w_.end(), [](const Worker& w) { return w.running; }));
  if (stop_signal_ == 0) {
    stop_signal_ = sig;
    say("received " + sig_name(sig) + ": forwarding it to " + std::to_string(n) + " worker" + (n == 1 ? "" : "s") +
        " (SIGKILL after " + fmt_seconds(job_.launcher.grace_period_s) + ")");
    if (phase_ != Phase::Stopping) {
      begin_stop(sig);
    } else {
      for (Worker& w : w_)
        if (w.running) signal_group(w.pid, sig), signal_group(w.pid, SIGCONT);
    }
    return;
  }
  // A second Ctrl-C means "now".
  if ((sig == SIGINT || sig == SIGTERM) && !killed_) kill_remaining("received " + sig_name(sig) + " again");
}

void Agent::read_signals() {
  signalfd_siginfo si[16];
  for (;;) {
    const ssize_t n = ::read(sfd_, si, sizeof si);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    for (size_t i = 0; i < size_t(n) / sizeof(signalfd_siginfo); ++i) on_signal(int(si[i].ssi_signo));
  }
}

void Agent::supervise() {
  phase_ = Phase::Running;
  killed_ = false;
  failed_ = false;
  stop_ns_ = 0;
  std::vector<pollfd> fds;
  std::vector<Worker*> owners;
  while (any_running()) {
    const auto now = Clock::now();
    auto wait = std::chrono::milliseconds(1000);  // a safety net; events wake us sooner
    auto until = [&](Clock::time_point t) {
      return std::chrono::duration_cast<std::chrono::milliseconds>(t - now) + std::chrono::milliseconds(1);
    };
    if (phase_ == Phase::Settling) wait = std::min(wait, until(settle_until_));
    if (phase_ == Phase::Stopping && !killed_) wait = std::min(wait, until(kill_at_));
    fds.assign(1, pollfd{sfd_, POLLIN, 0});
    owners.assign(1, nullptr);
    for (Worker& w : w_)
      if (w.out_fd >= 0) fds.push_back(pollfd{w.out_fd, POLLIN, 0}), owners.push_back(&w);
    if (group_) fds.push_back(pollfd{group_->event_fd(), POLLIN, 0}), owners.push_back(nullptr);
    const int n = ::poll(fds.data(), fds.size(), int(std::max<int64_t>(0, wait.count())));
    if (n > 0) {
      if (fds[0].revents) read_signals();
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) owners[i] ? drain(*owners[i]) : on_node_events();
    }
    reap();
    const auto t = Clock::now();
    if (phase_ == Phase::Settling && (t >= settle_until_ || !any_running())) begin_stop(SIGTERM);
    if (phase_ == Phase::Stopping && !killed_ && t >= kill_at_ && any_running())
      kill_remaining("still running " + fmt_seconds(job_.launcher.grace_period_s) + " after being asked to stop");
  }
}

// ---- the report -----------------------------------------------------------------------

// Which rank failed first. Candidates are the workers that failed on their
// own: before the agent asked anyone to stop, or (by their error file's
// clock) before that moment. A death by signal among them wins (a kill -9 or
// a crash is a cause; its peers' "connection closed" is an effect); else the
// earliest error time; else the first the agent saw.
int Agent::first_failure() const {
  int best = -1;
  auto rank_of = [](const Worker& w) {
    if (WIFSIGNALED(w.status) && w.ended_before_stop) return 0;
    if (w.error_ns > 0) return 1;
    return 2;
  };
  // Returns an index into w_ (the local rank), not the global rank.
  for (const Worker& w : w_) {
    if (status_ok(w.status)) continue;
    const bool own = w.ended_before_stop || (w.error_ns > 0 && stop_ns_ > 0 && w.error_ns < stop_ns_);
    if (!own) continue;
    if (best < 0) { best = w.local; continue; }
    const Worker& b = w_[size_t(best)];
    const int kw = rank_of(w), kb = rank_of(b);
    if (kw != kb) { if (kw < kb) best = w.local; continue; }
    const bool earlier = kw == 1 ? w.error_ns < b.error_ns : w.ended_at < b.ended_at;
    if (earlier) best = w.local;
  }
  return best;
}

void Agent::report_failure(int first) const {
  // Several nodes: the job's first failure may be another node's; this
  // node's workers then failed in its wake or were only stopped.
  const bool remote = !remote_failure_.empty();
  if (remote) say("error: the job failed on another node: " + remote_failure_);
  if (first < 0 && remote) {
    for (const Worker& w : w_)
      say("stopped rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ", " + node_prefix() +
          "): " + describe_status(w.status) + (w.got_sigkill ? " after the grace period" : ""));
    return;
  }
  if (first < 0) {  // cannot happen: failed_ implies a failed worker
    say("error: a worker failed");
    return;
  }
  const Worker& f = w_[size_t(first)];
  say(std::string(remote ? "on this node, " : "error: ") + "rank " + std::to_string(f.rank) + " (pid " +
      std::to_string(f.pid) + ", host " + host_ + (group_ ? ", " + node_prefix() : std::string()) + ") failed " +
      (remote ? "next" : "first") + ": " + describe_status(f.status));
  if (job_.launcher.log_tail_lines <= 0) {
    say("its output is in " + f.log_path);
  } else if (f.tail.empty()) {
    say("rank " + std::to_string(f.rank) + " wrote nothing (" + f.log_path + " is empty)");
  } else {
    say("last " + std::to_string(f.tail.size()) + (f.tail.size() == 1 ? " line of " : " lines of ") + f.log_path + ":");
    std::string text;
    for (const std::string& line : f.tail) text += "[rank " + std::to_string(f.rank) + "] " + line + "\n";
    write_all(2, text.data(), text.size());
  }
  for (const Worker& w : w_) {
    if (&w == &f) continue;
    const std::string who = "rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ")";
    if (status_ok(w.status) && w.ended_before_stop) {
      say(who + " had already finished (exit code 0)");
    } else if (w.ended_before_stop || (w.error_ns > 0 && w.error_ns < stop_ns_)) {
      say(who + " also failed: " + describe_status(w.status) + " (see " + w.log_path + ")");
    } else {
      std::string s = "stopped " + who + ": " + describe_status(w.status);
      if (w.got_sigkill) s += " after the " + fmt_seconds(job_.launcher.grace_period_s) + " grace period";
      if (w.was_suspended) s += "; it was suspended (SIGSTOP or a debugger) when the job failed";
      say(s);
    }
  }
}

// ---- the job ------------------------------------------------------------------------------

// Blocks the signals the agent handles (before any thread exists, so every
// thread inherits the mask), ignores SIGPIPE, and restores all of it on exit.
class SignalScope {
 public:
  SignalScope() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGINT, SIGTERM, SIGUSR1, SIGCHLD}) sigaddset(&set, s);
    TR_CHECK(::pthread_sigmask(SIG_BLOCK, &set, &old_mask_) == 0, "launcher: cannot block signals");
    fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    TR_CHECK_ERRNO(fd_ >= 0, "launcher: signalfd");
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ign, &old_pipe_);
  }
  ~SignalScope() {
    ::close(fd_);
    ::sigaction(SIGPIPE, &old_pipe_, nullptr);
    ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
  }
  int fd() const { return fd_; }

 private:
  sigset_t old_mask_;
  struct sigaction old_pipe_ {};
  int fd_ = -1;
};

// What the attempt that just ended means: the exit code of the agent, or
// -1 to restart. Prints the report.
int Agent::conclude(int attempt, int max_restarts) {
  int code = -1;
  // Several nodes: when another node's failure came first, it is the cause.
  if (group_ && failed_ && remote_failure_.empty()) remote_failure_ = group_->settle_failure();
  if (stop_signal_ != 0) {
    // A failure that was being handled when the signal came is still
    // worth reporting, but the user's stop wins over a restart.
    // Workers that saved a checkpoint on the signal exit kExitRequeue;
    // when all did, so does the agent: "checkpointed, please requeue".
    const bool all_checkpointed = std::all_of(w_.begin(), w_.end(), [](const Worker& w) {
      return WIFEXITED(w.status) && WEXITSTATUS(w.status) == kExitRequeue;
    });
    if (failed_ && !all_checkpointed) report_failure(first_failure());
    if (all_checkpointed && stop_signal_ != SIGINT) {
      code = kExitRequeue;
      say("stopped by " + sig_name(stop_signal_) + " after every worker saved a checkpoint; exiting with code " +
          std::to_string(code) + " (checkpointed, please requeue)");
    } else {
      code = 128 + stop_signal_;
      say("stopped by " + sig_name(stop_signal_) + "; all " + std::to_string(nproc_) +
          " workers are gone; exiting with code " + std::to_string(code));
    }
  } else if (!failed_) {
    const bool all_checkpointed = std::all_of(w_.begin(), w_.end(), [](const Worker& w) {
      return WIFEXITED(w.status) && WEXITSTATUS(w.status) == kExitRequeue;
    });
    if (all_checkpointed) {
      code = kExitRequeue;
      say("all " + std::to_string(nproc_) + " workers saved a checkpoint and stopped; exiting with code " +
          std::to_string(code) + " (checkpointed, please requeue)");
    } else {
      say("all " + std::to_string(nproc_) + " workers finished");
      code = 0;
    }
  } else {
    report_failure(first_failure());
    if (attempt < max_restarts) {
      say("restarting all workers (restart " + std::to_string(attempt + 1) + " of " +
          std::to_string(max_restarts) + ")");
    } else {
      if (max_restarts > 0)
        say("no restarts left (launcher.max_restarts: " + std::to_string(max_restarts) + "); giving up");
      code = 1;
    }
  }
  return code;
}

int Agent::run() {
  SignalScope signals;
  sfd_ = signals.fd();
  g_status.on = relay_status_line();
  {
    const char* v = std::getenv("TRAINRUN_LOG_ALL_RANKS");
    echo_all_ranks_ = v && *v && std::strcmp(v, "0") != 0;
  }
  g_status.width = g_status.on ? terminal_width() : 0;
  if (g_status.on) set_log_prefix("\r\033[K");  // the agent's logger lines erase it as well
  // A stop signal that came while this process was starting (main()'s
  // handlers noted it) ends the job here: no worker exists, nothing to save.
  if (const int sig = stop_signal_received()) {
    say(stopped_before_training(sig, " before any worker started"));
    return exit_code_for_stop_signal(sig);
  }
  if (plan_.multi_node()) return run_nodes();
  const int max_restarts = std::max(0, job_.launcher.max_restarts);
  for (int attempt = 0;; ++attempt) {
    int code = -1;
    {
      // A fresh store and secret per attempt: nothing a failed attempt left
      // in the store (half a rendezvous) can mislead the next one, and a
      // straggler of the old attempt cannot join the new one.
      const std::string secret = make_job_secret();
      TcpStoreServer store(job_.launcher.master_addr, job_.launcher.master_port, secret);
      if (attempt == 0) {
        // Blocked since SignalScope, a stop signal waits in the signalfd.
        if (const int sig = pending_stop_signal()) {
          say(stopped_before_training(sig, " before any worker started"));
          return exit_code_for_stop_signal(sig);
        }
        say("starting " + std::to_string(nproc_) + " workers on " + host_ + " (rendezvous store " +
            job_.launcher.master_addr + ":" + std::to_string(store.port()) + "; logs in " +
            (fs::path(job_.output.dir) / "logs").string() + "/rank<N>.log)");
      }
      spawn_all(attempt, store.port(), secret);
      supervise();
      close_logs();
      code = conclude(attempt, max_restarts);
    }
    if (code >= 0) return code;
  }
}

// ---- several nodes ----------------------------------------------------------------------

std::string Agent::node_prefix() const { return "node " + std::to_string(plan_.node_rank); }

// A stop signal that arrived while no worker runs (waiting for the other
// nodes): 0, or the signal. SIGCHLD is nobody's business here.
int Agent::pending_stop_signal() {
  signalfd_siginfo si[16];
  for (;;) {
    const ssize_t n = ::read(sfd_, si, sizeof si);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return 0;
    for (size_t i = 0; i < size_t(n) / sizeof(signalfd_siginfo); ++i)
      if (int(si[i].ssi_signo) != SIGCHLD) return int(si[i].ssi_signo);
  }
}

// News from the other nodes while the workers run: the first failure stops
// this node's workers (SIGTERM, SIGKILL after the grace period).
void Agent::on_node_events() {
  for (const std::string& what : group_->take_events()) {
    if (phase_ == Phase::Running && stop_signal_ == 0 && !failed_) {
      failed_ = true;
      remote_failure_ = what;
      say("error: " + what);
      say("stopping the workers of " + node_prefix() + " because the job cannot go on without that node");
      begin_stop(SIGTERM);
    } else {
      // Already stopping for a failure here: unless this node's failure is
      // the one the store recorded first, the news from elsewhere is the cause.
      if (failed_ && stop_signal_ == 0 && remote_failure_.empty() && !group_->own_failure_first())
        remote_failure_ = what;
      say(what);
    }
  }
}

int Agent::run_nodes() {
  const std::string who = node_prefix() + " of " + std::to_string(plan_.nnodes);
  // A stop signal while the nodes meet: no worker runs, so there is nothing
  // to checkpoint. SIGTERM/SIGUSR1 (preemption) end in kExitRequeue, and the
  // other nodes still meeting hear of it through the store (NodeGroup::join)
  // and stop the same way; SIGINT in 130.
  auto interrupted = [&](const LaunchInterrupted& s, int attempt) {
    const int code = s.sig == 0 ? kExitRequeue : exit_code_for_stop_signal(s.sig);
    const std::string when = " while " + who + " waited for the other nodes";
    if (s.sig != 0 && attempt == 0) {
      say(stopped_before_training(s.sig, when));
    } else {
      const std::string what =
          attempt == 0 ? "the job was preempted before training started (nothing to checkpoint)"
                       : "no worker was running (before restart " + std::to_string(attempt) +
                             "; the latest checkpoint is where the job resumes)";
      say((s.sig != 0 ? "received " + sig_name(s.sig) + when : s.elsewhere + "; " + who + " stops too") + ": " +
          what + "; exiting with code " + std::to_string(code) + (code == kExitRequeue ? " (please requeue)" : ""));
    }
    if (group_) {
      group_->close_job(code);
      // The store lives in node 0's agent: it stays a moment, so that the
      // nodes still meeting read why the job ended rather than lose it.
      if (code == kExitRequeue) group_->wait_until_heard(std::chrono::milliseconds(2000));
    }
    return code;
  };
  try {
    group_ = std::make_unique<NodeGroup>(job_, plan_, [this] { return pending_stop_signal(); });
  } catch (const LaunchInterrupted& s) {
    return interrupted(s, 0);
  }
  if (!group_->bind_note().empty()) say("warning: " + group_->bind_note());
  // Each node describes itself: node 0 in <output.dir>/topology.json, node k
  // in <output.dir>/node<k>/topology.json (one shared directory, one file each).
  JobSpec node_job = job_;
  if (plan_.node_rank > 0) {
    node_job.output.dir = (fs::path(job_.output.dir) / ("node" + std::to_string(plan_.node_rank))).string();
    std::error_code ec;
    fs::create_directories(node_job.output.dir, ec);
    TR_CHECK(!ec, "launcher: cannot create '", node_job.output.dir, "': ", ec.message());
  }
  topo_ = topo::prepare_launch_topology(node_job, nproc_);
  const int max_restarts = std::max(0, job_.launcher.max_restarts);
  bool first = true;
  for (int attempt = 0;; ++attempt) {
    try {
      attempt = group_->join(attempt);
    } catch (const LaunchInterrupted& s) {
      return interrupted(s, attempt);
    } catch (const Error&) {
      group_->close_job(1);
      throw;
    }
    if (first)
      say("starting " + std::to_string(nproc_) + " workers on " + host_ + " as " + who + " (ranks " +
          std::to_string(plan_.first_rank()) + "-" + std::to_string(plan_.first_rank() + nproc_ - 1) + " of " +
          std::to_string(plan_.nnodes * nproc_) + "; rendezvous store " + plan_.master_addr + ":" +
          std::to_string(plan_.master_port) + "; workers bind " + group_->bind_addr() + "; logs in " +
          (fs::path(job_.output.dir) / "logs").string() + "/rank<N>.log)");
    else
      say("all " + std::to_string(plan_.nnodes) + " nodes are back: starting restart " + std::to_string(attempt) +
          " from the latest checkpoint");
    first = false;
    remote_failure_.clear();
    spawn_all(attempt, group_->port(), group_->secret());
    group_->start_watch(attempt);
    supervise();
    close_logs();
    int code = conclude(attempt, max_restarts);
    if (code < 0) {
      group_->stop_watch();
      say("waiting for every node to restart (parallel.timeout_s: " + fmt_seconds(job_.parallel.timeout_s) + ")");
      continue;
    }
    // Node 0 keeps the store up until every node's workers are gone.
    const std::string late = group_->finish(code);
    if (!late.empty()) {
      say("error: " + late);
      code = 1;
    }
    group_->stop_watch();
    group_->close_job(code);
    return code;
  }
}

// "3 (entry LOCAL_RANK=3 of CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7)", the
// debug hook's account of which GPU this worker's device LOCAL_RANK is.
std::string worker_gpu_text(const char* visible, int local_rank) {
  if (!visible) return "all GPUs visible (CUDA_VISIBLE_DEVICES unset); device LOCAL_RANK=" + std::to_string(local_rank);
  std::vector<std::string> entries;
  std::stringstream ss(visible);
  for (std::string e; std::getline(ss, e, ',');) entries.push_back(e);
  const std::string var = std::string("CUDA_VISIBLE_DEVICES=") + visible;
  if (local_rank >= 0 && size_t(local_rank) < entries.size())
    return entries[size_t(local_rank)] + " (entry LOCAL_RANK=" + std::to_string(local_rank) + " of " + var + ")";
  return "none (" + var + " has no entry LOCAL_RANK=" + std::to_string(local_rank) + ")";
}

}  // namespace

// Checks that fail once here rather than once per worker (the trainer checks
// the batch split too).
static void check_launchable(const JobSpec& job, int nproc, int nnodes) {
  TR_CHECK(nproc >= 1, "parallel.nproc_per_node: ", nproc, " workers is not a job");
  const int world = nnodes * nproc;
  const int global_b = job.train.derived_global_batch_size(), mb = job.train.micro_batch_size;
  const std::string workers = nnodes == 1 ? std::to_string(world) + " workers"
                                          : std::to_string(world) + " workers: " + std::to_string(nnodes) +
                                                " nodes x " + std::to_string(nproc);
  // The mesh first (its message names the factors); the batch splits over
  // the data-parallel ranks: world / (tensor_parallel x pipeline_parallel).
  const int tp = job.parallel.tensor_parallel, pp = job.parallel.pipeline_parallel;
  const int per_replica = std::max(1, tp) * std::max(1, pp);
  TR_CHECK(world % per_replica == 0, job.source, ": mesh: the world size (", workers,
           ") is not divisible by parallel.tensor_parallel (", tp, ") x parallel.pipeline_parallel (", pp, ") = ",
           per_replica, "; run a multiple of ", per_replica, " ranks or change the degrees");
  const int dp = world / per_replica;
  // The model must split over the TP group (heads, KV heads, ffn, vocab):
  // said once here rather than by every worker.
  if (tp > 1) check_tensor_parallel(make_model_arch(ModelConfig::from_spec(job.model))->config(), tp);
  if (per_replica == 1)
    TR_CHECK(mb > 0 && global_b % (mb * world) == 0, job.source, ": train.global_batch_size (", global_b,
             " sequences) must be a multiple of train.micro_batch_size (", mb, ") x world size (", workers,
             "); change one of them so every rank gets whole micro-batches");
  else
    TR_CHECK(mb > 0 && global_b % (mb * dp) == 0, job.source, ": train.global_batch_size (", global_b,
             " sequences) must be a multiple of train.micro_batch_size (", mb, ") x data-parallel size (", dp,
             " = world size ", workers, " / (parallel.tensor_parallel ", tp, " x parallel.pipeline_parallel ", pp,
             ")); change one of them so every rank gets whole micro-batches");
  // The pipeline's microbatches are the accumulation count: enough for the
  // schedule (its message names the numbers), said once before any worker starts.
  if (pp > 1) {
    const int accum = global_b / (mb * dp);
    try {
      check_pipeline_schedule(make_pipeline_schedule(job.parallel.pipeline_schedule, pp,
                                                     job.parallel.pipeline_virtual_stages, accum));
    } catch (const Error& e) {
      TR_FAIL(job.source, ": ", e.what(), " (microbatches = train.global_batch_size ", global_b,
              " / (train.micro_batch_size ", mb, " x data-parallel size ", dp, ") = ", accum,
              "; raise global_batch_size or lower micro_batch_size)");
    }
  }
  TR_CHECK(job.launcher.grace_period_s >= 0, "launcher.grace_period_s must be >= 0");
}

int run_agent(const JobSpec& job, const LaunchPlan& plan, const std::string& resolved_spec_path) {
  if (!plan.multi_node()) {
    check_launchable(job, plan.nproc_per_node, 1);
    // Decide on the node's topology (already read if plan_launch counted
    // its GPUs), write <output.dir>/topology.json (see topology_launch.h).
    Agent agent(job, resolved_spec_path, plan.nproc_per_node, topo::prepare_launch_topology(job, plan.nproc_per_node),
                plan);
    return agent.run();
  }
  check_launchable(job, plan.nproc_per_node, plan.nnodes);
  // The topology is decided in Agent::run_nodes, after output.dir is known to be shared.
  Agent agent(job, resolved_spec_path, plan.nproc_per_node, topo::LaunchTopology{}, plan);
  return agent.run();
}

int run_worker(const std::string& resolved_spec_path) {
  try {
    // The agent resolved the model already (every field is in the file);
    // this re-checks it, without repeating the agent's log lines.
    JobSpec job = load_resolved_job_spec(resolved_spec_path, {}, /*log=*/false);
    WorkerInfo w = WorkerInfo::from_env();
    const char* deaf = std::getenv("TRAINRUN_DEBUG_IGNORE_SIGTERM");
    if (deaf && std::string(deaf) == "1") {
      // For the launcher's tests: a worker that does not stop when asked,
      // so the agent's SIGKILL after launcher.grace_period_s is exercised.
      ::signal(SIGTERM, SIG_IGN);
    }
    const char* dbg = std::getenv("TRAINRUN_DEBUG_PRINT_ENV");
    if (dbg && std::string(dbg) == "1") {
      // For the launcher's tests and for debugging a launch: the contract as
      // this process received it. The secret is only said to be there.
      std::string line = "worker environment:";
      for (const char* v : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                            "MASTER_ADDR", "MASTER_PORT", "TRAINRUN_RESTART_COUNT", "OMP_NUM_THREADS"}) {
        const char* s = std::getenv(v);
        line += std::string(" ") + v + "=" + (s ? s : "<unset>");
      }
      const char* secret = std::getenv("TRAINRUN_STORE_SECRET");
      line += std::string(" TRAINRUN_STORE_SECRET=") +
              (secret && *secret ? "<" + std::to_string(std::strlen(secret)) + " chars>" : "<unset>");
      TR_LOG_INFO(line);
      // Where the agent's topology decisions put this process. Every worker
      // of a node sees the same CUDA_VISIBLE_DEVICES (so CUDA IPC and P2P
      // between them work) and uses device LOCAL_RANK of it.
      TR_LOG_INFO("worker GPU: ", worker_gpu_text(std::getenv("CUDA_VISIBLE_DEVICES"), w.local_rank));
      cpu_set_t cpus;
      CPU_ZERO(&cpus);
      std::string placed = "worker placement: CPUs=";
      if (::sched_getaffinity(0, sizeof cpus, &cpus) == 0)
        for (int c = 0, first = 1; c < CPU_SETSIZE; ++c)
          if (CPU_ISSET(c, &cpus)) placed += (first ? "" : ",") + std::to_string(c), first = 0;
      TR_LOG_INFO(placed);
    }
    return exit_code_for(run_training(job, w));
  } catch (const std::exception& e) {
    // The agent reads the time to tell which rank failed first.
    note_failure_now();
    const char* path = std::getenv("TRAINRUN_ERROR_FILE");
    if (path && *path) {
      std::ofstream f(path, std::ios::trunc);
      f << noted_failure_ns() << "\n" << e.what() << "\n";
    }
    throw;
  }
}

}  // namespace trainrun
