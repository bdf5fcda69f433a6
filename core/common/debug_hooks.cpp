#include "core/common/debug_hooks.h"

#include <time.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "core/common/log.h"

namespace trainrun {

namespace {

std::atomic<int64_t> g_failure_ns{0};

// -1 when unset or not an integer (a typo must not inject a failure into rank 0).
int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return end && *end == 0 ? int(x) : -1;
}

struct FailPlan {
  int rank = -1, step = 1;
  bool once = false;
};

const FailPlan& plan() {
  static const FailPlan p = [] {
    FailPlan f;
    f.rank = env_int("TRAINRUN_DEBUG_FAIL_RANK", -1);
    f.step = env_int("TRAINRUN_DEBUG_FAIL_STEP", 1);
    f.once = env_int("TRAINRUN_DEBUG_FAIL_ONCE", 0) == 1;
    return f;
  }();
  return p;
}

// "a:b:c" -> {"a", "b", "c"}
std::vector<std::string> split_colons(const std::string& s) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == ':')
      out.emplace_back();
    else
      out.back() += c;
  }
  return out;
}

}  // namespace

int64_t monotonic_now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void note_failure_now() {
  int64_t expected = 0;
  g_failure_ns.compare_exchange_strong(expected, monotonic_now_ns());
}

int64_t noted_failure_ns() { return g_failure_ns.load(); }

int64_t debug_env_ms(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return end && *end == 0 && x > 0 ? int64_t(x) : 0;
}

void debug_fail_hook(int rank, int step) {
  const FailPlan& p = plan();
  if (p.rank < 0 || rank != p.rank || step != p.step) return;
  if (p.once && env_int("TRAINRUN_RESTART_COUNT", 0) != 0) return;
  // Noted at the throw, not at the catch: unwinding closes this rank's
  // connections, so its peers may fail (and be noticed) before it exits.
  note_failure_now();
  TR_FAIL("injected failure (TRAINRUN_DEBUG_FAIL_RANK=", p.rank, ", TRAINRUN_DEBUG_FAIL_STEP=", p.step,
          "): rank ", rank, " fails at step ", step);
}

void debug_ckpt_throw_hook(int rank, const std::string& where) {
  const char* v = std::getenv("TRAINRUN_DEBUG_CKPT_THROW");
  if (!v || !*v) return;
  const std::vector<std::string> f = split_colons(v);
  TR_CHECK(f.size() == 3 && (f[2] == "error" || f[2] == "std" || f[2] == "bad_alloc" || f[2] == "other"),
           "environment variable TRAINRUN_DEBUG_CKPT_THROW='", v,
           "' is not <rank>:<step or load>:<error|std|bad_alloc|other>");
  if (f[0] != std::to_string(rank) || f[1] != where) return;
  note_failure_now();
  const std::string what = "injected failure (TRAINRUN_DEBUG_CKPT_THROW=" + std::string(v) + ") on rank " +
                           std::to_string(rank) + (where == "load" ? " in the checkpoint load" : " in checkpoint step " + where);
  TR_LOG_WARN("debug: ", what, " (", f[2], ")");
  if (f[2] == "error") throw Error(what);
  if (f[2] == "std") throw std::runtime_error(what);
  if (f[2] == "bad_alloc") throw std::bad_alloc();
  throw 42;  // "other": not a std::exception at all
}

void debug_ckpt_kill_hook(const char* point, int64_t step) {
  const char* v = std::getenv("TRAINRUN_DEBUG_CKPT_KILL");
  if (!v || !*v) return;
  const std::vector<std::string> f = split_colons(v);
  if (f.size() != 2 || f[0] != point || f[1] != std::to_string(step)) return;
  TR_LOG_WARN("debug: SIGKILL at '", point, "' of checkpoint step ", step, " (TRAINRUN_DEBUG_CKPT_KILL)");
  std::raise(SIGKILL);
}

void debug_offload_kill_hook(int64_t step) {
  const char* v = std::getenv("TRAINRUN_DEBUG_OFFLOAD_KILL");
  const char* rank = std::getenv("RANK");
  if (!v || !*v || !rank) return;
  const std::vector<std::string> f = split_colons(v);
  if (f.size() != 2 || f[0] != rank || f[1] != std::to_string(step)) return;
  TR_LOG_WARN("debug: SIGKILL in the nvme optimizer step of step ", step, " on rank ", rank,
              " (TRAINRUN_DEBUG_OFFLOAD_KILL)");
  std::raise(SIGKILL);
}

void debug_cp_kill_hook() {
  const char* v = std::getenv("TRAINRUN_DEBUG_CP_KILL");
  const char* rank = std::getenv("RANK");
  if (!v || !*v || !rank) return;
  static std::atomic<int64_t> forwards{0};
  const int64_t n = ++forwards;
  const std::vector<std::string> f = split_colons(v);
  if (f.size() != 2 || f[0] != rank || f[1] != std::to_string(n)) return;
  TR_LOG_WARN("debug: SIGKILL inside ring attention forward ", n, " on rank ", rank, " (TRAINRUN_DEBUG_CP_KILL)");
  std::raise(SIGKILL);
}

void debug_ep_kill_hook() {
  const char* v = std::getenv("TRAINRUN_DEBUG_EP_KILL");
  const char* rank = std::getenv("RANK");
  if (!v || !*v || !rank) return;
  static std::atomic<int64_t> dispatches{0};
  const int64_t n = ++dispatches;
  const std::vector<std::string> f = split_colons(v);
  if (f.size() != 2 || f[0] != rank || f[1] != std::to_string(n)) return;
  TR_LOG_WARN("debug: SIGKILL at expert dispatch ", n, " on rank ", rank, " (TRAINRUN_DEBUG_EP_KILL)");
  std::raise(SIGKILL);
}

int64_t debug_init_from_delay_ms(int rank) {
  const char* v = std::getenv("TRAINRUN_DEBUG_INIT_FROM_DELAY_MS");
  if (!v || !*v) return 0;
  const std::vector<std::string> f = split_colons(v);
  if (f.size() != 2 || f[0] != std::to_string(rank)) return 0;
  const int64_t ms = std::atoll(f[1].c_str());
  if (ms <= 0) return 0;
  TR_LOG_WARN("debug: rank ", rank, " waits ", ms, " ms before reading model.init_from (TRAINRUN_DEBUG_INIT_FROM_DELAY_MS)");
  return ms;
}

int64_t debug_ckpt_sleep_ms(int64_t step) {
  const char* only = std::getenv("TRAINRUN_DEBUG_CKPT_SLEEP_STEP");
  if (only && *only && std::atoll(only) != step) return 0;
  return debug_env_ms("TRAINRUN_DEBUG_CKPT_SLEEP_MS");
}

}  // namespace trainrun
