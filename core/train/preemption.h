// Graceful stop on SIGTERM / SIGUSR1 / SIGINT (what Slurm and the agent send
// before a time limit or on Ctrl-C): the handler only sets a flag; at the
// next step boundary the ranks all-reduce it (so they agree even if only
// one got the signal), save a checkpoint and exit with kExitRequeue
// ("checkpointed, please requeue") — or 130 for SIGINT.
//
// From process start. main() installs the handlers before it parses the
// command line, so a preemption signal that comes while a job is still
// starting (parsing, detecting the topology, waiting for the other nodes)
// never kills the process with 128+signal: it is noted, and whoever is in
// charge at that point acts on it. An agent, or a process training alone,
// exits at once with kExitRequeue and says the job was preempted before
// training started (nothing to checkpoint); a worker with peers trains on
// to the first step boundary, where all ranks agree to stop together (they
// may not all have seen the signal, and a rank that left early would make
// the others wait out parallel.timeout_s). The agent keeps the three
// signals blocked across the exec of a worker, so they stay pending until
// the worker's main() has its handlers. Commands that do not train get the
// default actions back (restore_default_stop_handlers).
#pragma once
#include <string>

namespace trainrun {

// sysexits.h EX_TEMPFAIL: "temporary failure; the user is invited to retry".
constexpr int kExitRequeue = 75;

// Installs the handlers (idempotent). main(), workers and in-process runs call it.
void install_stop_handlers();
// Unblocks SIGTERM/SIGUSR1/SIGINT in the calling thread (an agent hands
// them to its workers blocked; see above): one held back is delivered now.
void unblock_stop_signals();
// For commands that do not train: the default actions again, and a stop
// signal that already came is raised again, so it ends the process as it
// would have without the handlers.
void restore_default_stop_handlers();
// 0, or the signal number that asked this process to stop.
int stop_signal_received();
// For tests running several trainers as threads of one process.
void reset_stop_signal();

// "SIGUSR1".
std::string stop_signal_name(int sig);
// The exit code of a process stopped by `sig`: 130 for SIGINT (the user
// stopped it), kExitRequeue for SIGTERM/SIGUSR1 (preempted: please requeue).
int exit_code_for_stop_signal(int sig);
// The line that says a stop signal ended the job before training started,
// e.g. "received SIGUSR1 while node 1 of 2 waited for the other nodes: the
// job was preempted before training started (nothing to checkpoint);
// exiting with code 75 (please requeue)". `when`: " while ..." or "".
std::string stopped_before_training(int sig, const std::string& when);

}  // namespace trainrun
