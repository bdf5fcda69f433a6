// The launcher: `trainrun --config job.yaml` on one node, torchrun-style.
//
// The agent (this process) hosts the rendezvous store, re-executes its own
// binary once per worker as `trainrun worker --config <run dir>/job.resolved.yaml`
// with the torchrun environment contract, collects every worker's
// stdout+stderr into <output.dir>/logs/rank<N>.log (echoing rank 0 to its own
// stderr as "[rank 0] ..."), forwards SIGINT/SIGTERM/SIGUSR1, and when one
// worker fails stops the rest, reports which rank failed first and how, and
// restarts the job if launcher.max_restarts allows.
//
// Signals: SIGINT, SIGTERM and SIGUSR1 to the agent are forwarded to every
// worker (as torchrun does); workers still running launcher.grace_period_s
// later get SIGKILL, and the agent exits 128+signal (75 when every worker
// saved a checkpoint on SIGTERM/SIGUSR1). A stop signal before any worker
// started (while starting up or waiting for the other nodes) ends the agent
// at once: 75 for SIGTERM/SIGUSR1, "preempted before training started
// (nothing to checkpoint)", 130 for SIGINT. A second SIGINT/SIGTERM
// kills the workers at once. A worker that fails (non-zero exit or a signal)
// makes the agent SIGTERM the others (after a 0.5 s settle window, so the
// report can tell cause from consequence), SIGKILL them after the grace
// period, print
//   trainrun: error: rank 2 (pid 1234, host H) failed first: exit code 1
//   trainrun: last 20 lines of <output.dir>/logs/rank2.log:
//   [rank 2] ...
//   trainrun: stopped rank 0 (pid 1233): killed by signal SIGTERM (15)
//   trainrun: rank 1 (pid 1235) also failed: exit code 1 (see .../rank1.log)
// and exit 1, or restart every worker (a fresh store and secret per attempt).
// "Failed first" uses each worker's error file (TRAINRUN_ERROR_FILE, written
// by run_worker with the CLOCK_MONOTONIC time of the failure); a worker
// killed by a signal before any stop was sent counts as the cause.
//
// Environment of every worker:
//   RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the node
//   rank, 0 on one node), GROUP_WORLD_SIZE (nodes), MASTER_ADDR, MASTER_PORT
//   (the store), TRAINRUN_GLOO_HOST (several nodes: the local address that
//   reaches node 0, unless set),
//   TRAINRUN_STORE_SECRET (fresh per attempt), TRAINRUN_RESTART_COUNT,
//   TRAINRUN_MAX_RESTARTS, TRAINRUN_ERROR_FILE (where the worker writes its
//   error), OMP_NUM_THREADS (cores / workers, at least 1, unless already set).
// plus the topology's decisions (parallel/topology/topology_launch.h): NCCL_*,
// CUDA_VISIBLE_DEVICES, TRAINRUN_SHARD_GROUP_SIZE, each unless already set;
// each worker is bound to its CPUs and NUMA node before exec, and the
// decisions are written to <output.dir>/topology.json.
//
// Debug hooks (environment, for tests): TRAINRUN_DEBUG_PRINT_ENV=1 makes a
// worker log the contract it received and where it was placed (its GPU:
// entry LOCAL_RANK of CUDA_VISIBLE_DEVICES, and its CPUs); TRAINRUN_DEBUG_IGNORE_SIGTERM=1 makes
// it ignore SIGTERM; TRAINRUN_DEBUG_FAIL_* are in debug_hooks.h.
#pragma once
#include <string>

#include "core/config/job_spec.h"
#include "core/launch/launch_mode.h"

namespace trainrun {

// Runs the job as the agent of the node `plan` places it on (plan_launch in
// launch_mode.h, which decides whether an agent runs at all and how many
// workers it starts: plan.nproc_per_node, parallel.nproc_per_node: 0
// already resolved). `resolved_spec_path` is the job.resolved.yaml the
// workers load (already written). Returns the process exit code: 0 when
// every worker finished, 1 after a failure (a report is printed), 128+signal
// when stopped by SIGINT/SIGTERM/SIGUSR1. Throws trainrun::Error for
// problems before any worker started (bad batch split, store bind). With
// several nodes (core/launch/node_group.h) node 0's agent hosts the store
// for the whole job and the others join it; each spawns its
// plan.nproc_per_node workers as ranks node_rank * nproc + local; a failure
// on any node stops every node; node k>0 writes its topology to
// <output.dir>/node<k>/topology.json and never writes job.resolved.yaml
// (its workers load node 0's).
int run_agent(const JobSpec& job, const LaunchPlan& plan, const std::string& resolved_spec_path);

// The hidden `trainrun worker --config <path>` subcommand: loads the spec,
// reads its place from the environment and trains. On an error it writes
// TRAINRUN_ERROR_FILE (if set) and rethrows.
int run_worker(const std::string& resolved_spec_path);

}  // namespace trainrun
