#include "core/launch/debug_hooks.h"

#include <time.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "core/common/error.h"

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

}  // namespace trainrun
