// The CUDA peer probe's parent side: runs `trainrun probe-p2p` in a child
// and maps its answer onto the topology's GPUs (see topology_sources.h).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <sstream>

#include "core/common/error.h"
#include "core/common/text.h"
#include "parallel/topology/topology_sources.h"

extern char** environ;

namespace trainrun::topo {

namespace {

// Spawns argv with CUDA_VISIBLE_DEVICES removed (the topology covers every
// GPU of the node), collects stdout until exit or the deadline (then kills).
// Returns false with *why on failure.
bool run_child(const std::vector<std::string>& args, int timeout_s, std::string* out, std::string* why) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    *why = std::string("pipe: ") + std::strerror(errno);
    return false;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; e && *e; ++e)
    if (std::strncmp(*e, "CUDA_VISIBLE_DEVICES=", 21) != 0) envp.push_back(*e);
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    *why = "cannot start " + args[0] + ": " + std::strerror(rc);
    return false;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  bool timed_out = false;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int r = ::poll(&p, 1, int(std::min<int64_t>(left.count(), 1000)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: the child is done
    out->append(buf, size_t(n));
  }
  ::close(fds[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) {
    *why = "timed out after " + std::to_string(timeout_s) +
           " s (a P2P copy may hang on this machine: check ACS and the IOMMU, or set NCCL_P2P_DISABLE=1)";
    return false;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *why = args[0] + " probe-p2p failed (" +
           (WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status))
                              : "signal " + std::to_string(WTERMSIG(status))) +
           "); see its message above";
    return false;
  }
  return true;
}

}  // namespace

PeerProbe parse_peer_probe_output(const std::string& out, const std::vector<Gpu>& gpus) {
  PeerProbe p;
  std::istringstream is(out);
  std::string line, word;
  if (!std::getline(is, line)) {
    p.why = "probe-p2p printed nothing";
    return p;
  }
  std::istringstream head(line);
  head >> word;
  if (word != "bus") {
    p.why = "probe-p2p output does not start with 'bus': '" + line + "'";
    return p;
  }
  std::vector<std::string> bus;
  while (head >> word) bus.push_back(ascii_lower(word));
  const size_t n = bus.size();
  std::vector<std::vector<int>> cuda_ok;
  while (cuda_ok.size() < n && std::getline(is, line)) {
    std::istringstream row(line);
    std::vector<int> r;
    int v;
    while (row >> v) r.push_back(v);
    if (r.size() != n) {
      p.why = "probe-p2p row " + std::to_string(cuda_ok.size()) + " has " + std::to_string(r.size()) +
              " values, expected " + std::to_string(n);
      return p;
    }
    cuda_ok.push_back(r);
  }
  if (cuda_ok.size() != n) {
    p.why = "probe-p2p printed " + std::to_string(cuda_ok.size()) + " rows for " + std::to_string(n) + " GPUs";
    return p;
  }
  // Topology GPU i is CUDA device cuda_of[i] (CUDA's order may differ from
  // NVML's PCI order unless CUDA_DEVICE_ORDER=PCI_BUS_ID).
  std::vector<size_t> cuda_of(gpus.size());
  for (size_t i = 0; i < gpus.size(); ++i) {
    const std::string want = ascii_lower(gpus[i].pci_bus_id);
    auto it = want.empty() ? bus.end() : std::find(bus.begin(), bus.end(), want);
    if (it == bus.end()) {
      p.why = "GPU " + std::to_string(i) + " (bus id '" + gpus[i].pci_bus_id + "') is not among the " +
              std::to_string(n) + " GPUs CUDA sees";
      return p;
    }
    cuda_of[i] = size_t(it - bus.begin());
  }
  p.ok.assign(gpus.size(), std::vector<int>(gpus.size(), 0));
  for (size_t i = 0; i < gpus.size(); ++i)
    for (size_t j = 0; j < gpus.size(); ++j) {
      // One number per pair: P2P must work both ways for NCCL's rings.
      const size_t a = cuda_of[i], b = cuda_of[j];
      p.ok[i][j] = cuda_ok[a][b] && cuda_ok[b][a] ? 1 : 0;
    }
  p.ran = true;
  return p;
}

PeerProbe probe_cuda_peer_access(const std::vector<Gpu>& gpus, const std::string& exe_in, int timeout_s) {
  PeerProbe p;
  if (gpus.size() < 2) {
    p.why = "fewer than two GPUs: nothing to probe";
    return p;
  }
  std::string exe = exe_in;
  if (exe.empty()) {
    char path[4096] = {};
    const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
    exe = n > 0 ? std::string(path, size_t(n)) : "";
    const std::string base = exe.substr(exe.find_last_of('/') + 1);
    if (base.rfind("trainrun", 0) != 0) {
      p.why = "not probed from this program (only the trainrun binary runs `trainrun probe-p2p`)";
      return p;
    }
  }
  std::string out;
  if (!run_child({exe, "probe-p2p"}, timeout_s, &out, &p.why)) return p;
  return parse_peer_probe_output(out, gpus);
}

}  // namespace trainrun::topo
