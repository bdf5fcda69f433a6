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
#include "parallel/topology/topology.h"

namespace trainrun::topo {

// ---- trainrun topo ------------------------------------------------------------------------

struct TopoCommandOptions {
  std::string nvidia_smi_file;  // --nvidia-smi-topo FILE
  std::string topology_file;    // --topology FILE (a saved description)
  std::string sysfs_root;       // --sysfs-root DIR
  std::string save_file;        // --save FILE
  int nproc = 0;                // --nproc N; 0 = one per GPU, 1 without
  bool json = false;            // --json
  int tp = 0;                   // --tp N: show the TP groups; 0 = the job's parallel.tensor_parallel (else none)
  int cp = 0;                   // --cp N: show the context-parallel groups; 0 = the job's parallel.context_parallel (else none)
  std::string config;           // --config job.yaml: tensor_parallel, context_parallel, nproc_per_node, topology_file
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

// The node's description for a job: job.parallel.topology_file when set,
// else this machine's (detect_local_topology). Read once per process and
// kept: the launch plan counts GPUs in it (parallel.nproc_per_node: 0) and
// the agent places its workers with the same one, so /sys, NVML and the CUDA
// peer probe run once. A bad topology_file throws (every time); a failed
// detection is kept as `detect_error` with an empty description.
struct NodeTopology {
  Topology topology;
  std::string source;        // "parallel.topology_file /x.json" or "the topology detected on this machine"
  std::string detect_error;  // why detection failed; empty when it worked
};
const NodeTopology& node_topology(const JobSpec& job);

// parallel.nproc_per_node: 0 on this node, backend auto or cuda: one worker
// per GPU this process may use, i.e. node_topology()'s GPUs narrowed by
// CUDA_VISIBLE_DEVICES (`cuda_visible_devices`, nullptr = unset; see
// resolve_visible_gpus), and 1 without a GPU. `why` says how it was counted,
// for the launch log. Throws for a CUDA_VISIBLE_DEVICES entry that names no
// GPU of the description.
struct GpuWorkers {
  int nproc = 1;
  std::string why;  // "8 workers, one per GPU (8 GPUs in parallel.topology_file /x.json; CUDA_VISIBLE_DEVICES unset)"
};
GpuWorkers count_gpu_workers(const JobSpec& job, const char* cuda_visible_devices);

// Decides for `nproc` local workers on node_topology(job), logs the
// decisions and warnings, writes <output.dir>/topology.json. Detection
// problems are warnings (the job runs unbound); a bad topology_file, or a
// CUDA_VISIBLE_DEVICES naming a GPU it does not have, is an error.
LaunchTopology prepare_launch_topology(const JobSpec& job, int nproc);

}  // namespace trainrun::topo
