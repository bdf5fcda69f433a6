// How `trainrun --config job.yaml` was started, decided once from the
// environment and the command line, and logged as the first line of a run:
//
//   in-process      one worker, no agent (nproc_per_node 1, or 0 resolving
//                   to 1 on a node without GPUs; no restarts)
//   local agent     one node: an agent spawns nproc_per_node workers
//   node agent      one agent per node of a multi-node job, either under
//                   `srun --ntasks-per-node=1` (node rank SLURM_NODEID, node
//                   count SLURM_NNODES) or torchrun-style static rendezvous
//                   (--nnodes N --node-rank K --master-addr A --master-port P)
//   Slurm worker    `srun --ntasks-per-node=<gpus>`: every task is one worker
//                   (RANK = SLURM_PROCID, LOCAL_RANK = SLURM_LOCALID,
//                   WORLD_SIZE = SLURM_NTASKS), no agent; rank 0 hosts the store
//   outside worker  RANK/WORLD_SIZE already set (torchrun or similar)
//
// With several nodes the store lives on node 0: its address is
// launcher.master_addr when set (--master-addr), else under Slurm the first
// host of the step's node list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST,
// expanded by parallel/rendezvous/hostlist.h); its port is launcher.master_port when set
// (--master-port), else under Slurm kSlurmPortBase + SLURM_JOB_ID %
// kSlurmPortSpan (two jobs sharing a node get different ports unless their
// ids are 10000 apart), else kStaticPort. "Set" for the address means other
// than the default 127.0.0.1 or given on the command line.
//
// Everything here is a pure function of (job, flags, environment, host name),
// so the tests drive it with fake SLURM_* environments, except that an
// agent's parallel.nproc_per_node: 0 counts the GPUs of the node's topology
// (resolve_nproc_per_node below; a parallel.topology_file makes that pure too).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/config/job_spec.h"

namespace trainrun {

using EnvMap = std::map<std::string, std::string>;
EnvMap current_environment();

constexpr int kSlurmPortBase = 20000;
constexpr int kSlurmPortSpan = 10000;
constexpr int kStaticPort = 29500;  // torchrun's default

// The store port of a Slurm job: kSlurmPortBase + id % kSlurmPortSpan.
// Array tasks have their own numeric SLURM_JOB_ID; anything else non-numeric
// is hashed into the same range.
int slurm_port_for_job(const std::string& job_id);

// Slurm's per-node task counts ("2(x3),1" = 2, 2, 2, 1), as in
// SLURM_STEP_TASKS_PER_NODE. Throws trainrun::Error on anything else.
std::vector<int> expand_tasks_per_node(const std::string& spec);

// torchrun's static rendezvous flags. --nnodes, --master-addr and
// --master-port are job spec fields too (launcher.*): overrides() turns them
// into --set overrides, so the resolved spec records them. The node rank is
// per node and stays out of the spec.
struct LaunchFlags {
  int nnodes = 0;           // --nnodes; 0 = not given
  int node_rank = -1;       // --node-rank; -1 = not given
  std::string master_addr;  // --master-addr; "" = not given
  int master_port = -1;     // --master-port; -1 = not given
  std::vector<std::string> overrides() const;
  bool any() const { return nnodes > 0 || node_rank >= 0 || !master_addr.empty() || master_port >= 0; }
};

enum class LaunchMode { InProcess, LocalAgent, NodeAgent, SlurmWorker, OutsideWorker };
const char* launch_mode_name(LaunchMode m);

struct LaunchPlan {
  LaunchMode mode = LaunchMode::InProcess;
  std::string slurm_job_id;       // "" outside Slurm
  std::string host;               // this host's name
  int nnodes = 1, node_rank = 0;  // node_rank = GROUP_RANK
  int nproc_per_node = 1;         // workers this node runs (agent) or tasks on it (Slurm worker)
  // This process's place (Slurm and outside workers; agents derive theirs per worker).
  int rank = 0, local_rank = 0, world = 1, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                   // 0 = the single-node agent picks a free one
  std::string addr_source, port_source;  // where they came from, for the log
  std::vector<std::string> warnings;     // logged as WARN after the plan
  // How parallel.nproc_per_node: 0 became nproc_per_node (logged after the
  // plan); empty when the spec gave the count or srun's tasks set it.
  std::string nproc_reason;

  bool multi_node() const { return nnodes > 1; }
  bool agent() const { return mode == LaunchMode::LocalAgent || mode == LaunchMode::NodeAgent; }
  int first_rank() const { return node_rank * nproc_per_node; }
  int world_size() const { return agent() ? nnodes * nproc_per_node : world; }
  // One line: the mode, this node's/process's place, and where the store is.
  std::string describe() const;
};

// Workers per node for an agent: parallel.nproc_per_node when > 0. For 0:
// 1 with backend: cpu, else one per GPU this process may use, counted in the
// node's topology (parallel.topology_file, else this machine's, detected
// once per process: topo::count_gpu_workers) narrowed by `env`'s
// CUDA_VISIBLE_DEVICES, and 1 without a GPU. `why` is "" for an explicit
// count, else "parallel.nproc_per_node: 0 -> 8 workers, one per GPU (...)".
// Throws for a CUDA_VISIBLE_DEVICES entry that names no GPU of the node.
struct WorkerCount {
  int nproc = 1;
  std::string why;
};
WorkerCount resolve_nproc_per_node(const JobSpec& job, const EnvMap& env);

// Throws trainrun::Error for contradictions (a node rank past the node
// count, flags next to RANK/WORLD_SIZE, launcher.nnodes vs SLURM_NNODES...).
LaunchPlan plan_launch(const JobSpec& job, const LaunchFlags& flags, const EnvMap& env, const std::string& host);

// gethostname(), "localhost" if that fails.
std::string this_host_name();

}  // namespace trainrun
