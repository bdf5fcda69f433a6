// Graceful stop on SIGTERM / SIGUSR1 / SIGINT (what Slurm and the agent send
// before a time limit or on Ctrl-C): the handler only sets a flag; at the
// next step boundary the ranks all-reduce it (so they agree even if only
// one got the signal), save a checkpoint and exit with kExitRequeue
// ("checkpointed, please requeue") — or 130 for SIGINT.
#pragma once

namespace trainrun {

// sysexits.h EX_TEMPFAIL: "temporary failure; the user is invited to retry".
constexpr int kExitRequeue = 75;

// Installs the handlers (idempotent). Workers and in-process runs call it.
void install_stop_handlers();
// 0, or the signal number that asked this process to stop.
int stop_signal_received();
// For tests running several trainers as threads of one process.
void reset_stop_signal();

}  // namespace trainrun
