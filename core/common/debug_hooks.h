// Fault injection for the tests, driven by environment variables (in core/common
// because the launcher, the checkpoint code and parallel/ all use it)
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
//
// Checkpoint faults (core/checkpoint; read at every use, so in-process tests
// may set and unset them between runs):
//
//   TRAINRUN_DEBUG_CKPT_THROW=<rank>:<where>:<kind>
//       rank <rank> throws inside a checkpoint. <where> is a step number
//       (the save of that step, as the rank starts writing its ranges) or
//       "load" (Checkpointer::load: rank 0 while it picks the checkpoint to
//       resume, before it tells the others; any other rank just before it
//       reads its part). <kind> is what is thrown: error (trainrun::Error),
//       std (std::runtime_error), bad_alloc (std::bad_alloc) or other (an
//       int: not a std::exception at all)
//   TRAINRUN_DEBUG_CKPT_KILL=<point>:<step>
//       the committing rank raises SIGKILL at <point> of the commit of step
//       <step>; points: moved_aside (re-saving a step that exists: the old
//       directory has been renamed to .old-step_N, the new one is not in
//       place yet)
//   TRAINRUN_DEBUG_CKPT_SLEEP_MS=N, TRAINRUN_DEBUG_CKPT_SLEEP_STEP=S
//       the committing rank pauses N ms between "every rank wrote its part"
//       and the commit (of step S only, when set), so a test can kill or
//       fail something inside that window; the pause ends early when the
//       checkpoint is abandoned
//   TRAINRUN_DEBUG_CKPT_TIMEOUT_MS=N
//       a checkpoint's store waits give up after N ms instead of the default
//       (10 x parallel.timeout_s, at least 10 minutes), so a test of an error
//       path that should answer at once fails in bounded time if it hangs
//
// Start-up skew (core/train/trainer.cpp):
//
//   TRAINRUN_DEBUG_INIT_FROM_DELAY_MS=<rank>:<ms>
//       rank <rank> waits <ms> before it reads its part of model.init_from:
//       a slow shared filesystem, for the test that the ranks then agree
//       through the store with the disk timeout, not the collective one
//
// Offload faults (parallel/sharding/offload.cpp):
//
//   TRAINRUN_DEBUG_OFFLOAD_KILL=<rank>:<step>
//       the worker whose RANK is <rank> raises SIGKILL inside the nvme
//       optimizer step of training step <step>, right after the first
//       chunk's write was submitted (state I/O in flight)
//   TRAINRUN_DEBUG_OFFLOAD_NO_URING=1
//       io_uring_queue_init is treated as refused by the kernel (EPERM), so
//       the nvme path takes its logged pread/pwrite fallback
//
// Context-parallel faults (parallel/context/ring_attention.cpp):
//
//   TRAINRUN_DEBUG_CP_KILL=<rank>:<n>
//       the worker whose RANK is <rank> raises SIGKILL inside its n-th ring
//       attention forward (1-based, counted over the process: layers and
//       micro-batches), at its first ring step, holding its K/V block
//       before it passes it on: its ring peers are then blocked on it
//
// Expert-parallel faults (parallel/expert/expert_dispatch.cpp):
//
//   TRAINRUN_DEBUG_EP_KILL=<rank>:<n>
//       the worker whose RANK is <rank> raises SIGKILL at its n-th expert
//       dispatch (1-based, counted over the process: layers, micro-batches,
//       forward and backward), just before its all_to_all_v: its ep peers
//       are then blocked on its rows
//
// Each logs a "debug: ..." line when it fires.
#pragma once
#include <cstdint>
#include <string>

namespace trainrun {

// Called by the trainer at the start of every step (1-based). Throws
// trainrun::Error when this rank is the one told to fail at this step.
void debug_fail_hook(int rank, int step);

// TRAINRUN_DEBUG_CKPT_THROW: throws the configured kind when `rank` and
// `where` (a step number, or "load") match it.
void debug_ckpt_throw_hook(int rank, const std::string& where);

// TRAINRUN_DEBUG_CKPT_KILL: raises SIGKILL when `point` and `step` match it.
void debug_ckpt_kill_hook(const char* point, int64_t step);

// TRAINRUN_DEBUG_OFFLOAD_KILL: raises SIGKILL when this process's RANK and
// `step` match it.
void debug_offload_kill_hook(int64_t step);

// TRAINRUN_DEBUG_CP_KILL: counts this process's ring forwards and raises
// SIGKILL at the one it names on this RANK.
void debug_cp_kill_hook();

// TRAINRUN_DEBUG_EP_KILL: counts this process's expert dispatches and
// raises SIGKILL at the one it names on this RANK.
void debug_ep_kill_hook();

// TRAINRUN_DEBUG_INIT_FROM_DELAY_MS: the milliseconds when `rank` is the
// one it names (logged), else 0.
int64_t debug_init_from_delay_ms(int rank);

// TRAINRUN_DEBUG_CKPT_SLEEP_MS when it applies to `step`, else 0.
int64_t debug_ckpt_sleep_ms(int64_t step);

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
