// Fault injection for the launcher's tests, driven by environment variables
// so that the real binary can be made to fail in a chosen rank at a chosen
// step without a special build:
//
//   TRAINRUN_DEBUG_FAIL_RANK=1   the rank that fails (unset: no failure)
//   TRAINRUN_DEBUG_FAIL_STEP=3   the 1-based training step it fails at (default 1)
//   TRAINRUN_DEBUG_FAIL_ONCE=1   fail only in the first attempt
//                                (TRAINRUN_RESTART_COUNT unset or 0), so a
//                                restarted job gets past it
//
// The failure is a trainrun::Error thrown from the step loop, i.e. exactly
// what a real error (a bad batch, a diverged loss) looks like to the worker
// and the agent.
//
// Pauses that hold a job in its start-up, so a test can send a signal there:
//
//   TRAINRUN_DEBUG_START_DELAY_MS=N  `trainrun --config` waits N ms right after
//                                    the launch line, before anything watches
//                                    signals but the handlers main() installed
//   TRAINRUN_DEBUG_JOIN_DELAY_MS=N   a node agent waits N ms before it
//                                    announces itself at the rendezvous
//                                    (NodeGroup::join); a stop signal ends the wait
//
// Each logs a "debug: ..." line when it starts waiting.
#pragma once
#include <cstdint>

namespace trainrun {

// Called by the trainer at the start of every step (1-based). Throws
// trainrun::Error when this rank is the one told to fail at this step.
void debug_fail_hook(int rank, int step);

// The milliseconds in environment variable `name` (the pauses above); 0
// when unset or not a positive integer.
int64_t debug_env_ms(const char* name);

// When this worker process first hit a failure, as CLOCK_MONOTONIC
// nanoseconds, or 0 if nothing was noted. The worker's error file carries it
// so the agent can tell which rank failed first even when several die within
// the same instant (the others usually fail *because* the first one left).
void note_failure_now();
int64_t noted_failure_ns();
int64_t monotonic_now_ns();

}  // namespace trainrun
