#include "core/train/preemption.h"

#include <pthread.h>
#include <string.h>

#include <csignal>
#include <initializer_list>

namespace trainrun {

namespace {
volatile std::sig_atomic_t g_stop = 0;
extern "C" void on_stop_signal(int sig) { g_stop = sig; }

constexpr int kStopSignals[] = {SIGTERM, SIGUSR1, SIGINT};
}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking I/O in the step resumes; the flag is read at the boundary
  for (int s : kStopSignals) {
    // A signal someone deliberately ignores (nohup, a test) stays ignored.
    struct sigaction old {};
    ::sigaction(s, nullptr, &old);
    if (old.sa_handler == SIG_IGN) continue;
    ::sigaction(s, &sa, nullptr);
  }
}

void unblock_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kStopSignals) sigaddset(&set, s);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

void restore_default_stop_handlers() {
  for (int s : kStopSignals) {
    struct sigaction old {};
    ::sigaction(s, nullptr, &old);
    if (old.sa_handler != on_stop_signal) continue;
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(s, &dfl, nullptr);
  }
  if (g_stop != 0) ::raise(g_stop);
}

int stop_signal_received() { return g_stop; }
void reset_stop_signal() { g_stop = 0; }

std::string stop_signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

int exit_code_for_stop_signal(int sig) { return sig == SIGINT ? 128 + SIGINT : kExitRequeue; }

std::string stopped_before_training(int sig, const std::string& when) {
  const int code = exit_code_for_stop_signal(sig);
  if (sig == SIGINT)
    return "received SIGINT" + when + ": stopped before training started (nothing to checkpoint); exiting with code " +
           std::to_string(code);
  return "received " + stop_signal_name(sig) + when +
         ": the job was preempted before training started (nothing to checkpoint); exiting with code " +
         std::to_string(code) + " (please requeue)";
}

}  // namespace trainrun
