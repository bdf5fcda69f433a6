#include "core/train/preemption.h"

#include <csignal>
#include <initializer_list>

namespace trainrun {

namespace {
volatile std::sig_atomic_t g_stop = 0;
extern "C" void on_stop_signal(int sig) { g_stop = sig; }
}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking I/O in the step resumes; the flag is read at the boundary
  for (int s : {SIGTERM, SIGUSR1, SIGINT}) {
    // A signal someone deliberately ignores (nohup, a test) stays ignored.
    struct sigaction old {};
    ::sigaction(s, nullptr, &old);
    if (old.sa_handler == SIG_IGN) continue;
    ::sigaction(s, &sa, nullptr);
  }
}

int stop_signal_received() { return g_stop; }
void reset_stop_signal() { g_stop = 0; }

}  // namespace trainrun
