// Topology where it is used: the `trainrun topo` command, and the launch
// plan the agent applies to its workers (core/launch/agent.cpp).
//
// The agent detects the node once per job (or loads parallel.topology_file),
// decides (topology_decide.h), writes description + decisions +
// the resulting worker environment to <output.dir>/topology.json, and then
// for each worker: adds the decided environment (a variable already in the
// agent's environment wins and is logged), and between fork and exec binds
// the child to its CPUs and sets its NUMA memory policy.
#pragma once
#include <sched.h>

#include <ostream>
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun::topo {

// ---- trainrun topo ------------------------------------------------------------------------

struct TopoCommandOptions {
  std::string nvidia_smi_file;  // --nvidia-smi-topo FILE
  std::string topology_file;    // --topology FILE (a saved description)
  std::string sysfs_root;       // --sysfs-root DIR
  std::string save_file;        // --save FILE
  int nproc = 0;                // --nproc N; 0 = one per GPU, 1 without
  bool json = false;            // --json
};
// Prints the report (or JSON) to `out`; returns the exit code. Throws
// trainrun::Error for bad input (the caller prints it and exits 1).
int run_topo_command(const TopoCommandOptions& o, std::ostream& out);

// ---- launching workers --------------------------------------------------------------------

// Prepared by the agent; applied in the child between fork and exec, where
// only async-signal-safe calls are allowed (so everything is precomputed).
struct WorkerPlacement {
  bool bind_cpus = false;
  cpu_set_t cpus;
  int preferred_node = -1;          // MPOL_PREFERRED node; -1 = leave the default
  unsigned long node_mask[16] = {};  // 1024 nodes, the mask for set_mempolicy
};
// Raw syscalls only; a failure is reported on fd 2 (the worker's log) and
// the worker runs unbound.
void apply_worker_placement(const WorkerPlacement& p) noexcept;

struct LaunchTopology {
  std::vector<WorkerPlacement> placement;  // per local rank; empty = no binding
  std::vector<std::string> env;            // NAME=VALUE for every worker (user-set names excluded)
};

// Detects (or loads job.parallel.topology_file), decides for `nproc` local
// workers, logs the decisions and warnings, writes <output.dir>/topology.json.
// Detection problems are warnings (the job runs unbound); a bad
// topology_file is an error.
LaunchTopology prepare_launch_topology(const JobSpec& job, int nproc);

}  // namespace trainrun::topo
