// Launch mode detection; see launch_mode.h for the modes and the rules.
#include "core/launch/launch_mode.h"

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <functional>

#include "core/common/error.h"
#include "parallel/rendezvous/hostlist.h"
#include "parallel/topology/topology_launch.h"

extern char** environ;

namespace trainrun {

namespace {

const std::string* find_env(const EnvMap& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() || it->second.empty() ? nullptr : &it->second;
}

// The first of `names` that is set, as an int; `dflt` when none is.
int env_int(const EnvMap& env, std::initializer_list<const char*> names, int dflt) {
  for (const char* n : names) {
    const std::string* v = find_env(env, n);
    if (!v) continue;
    char* end = nullptr;
    errno = 0;
    const long x = std::strtol(v->c_str(), &end, 10);
    TR_CHECK(end && *end == 0 && errno == 0 && x >= 0 && x <= 1 << 24, "environment variable ", n, "='", *v,
             "' is not a valid count or index");
    return int(x);
  }
  return dflt;
}

std::string env_str(const EnvMap& env, std::initializer_list<const char*> names, const char** which = nullptr) {
  for (const char* n : names) {
    if (const std::string* v = find_env(env, n)) {
      if (which) *which = n;
      return *v;
    }
  }
  return "";
}

std::string ranks_text(int first, int count) {
  return count == 1 ? "rank " + std::to_string(first)
                    : "ranks " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

// The store's address and port for a job spread over several processes that
// cannot tell each other a port picked at run time.
void resolve_store(LaunchPlan& p, const JobSpec& job, const LaunchFlags& flags, const EnvMap& env, bool slurm) {
  const bool addr_set = !flags.master_addr.empty() || job.launcher.master_addr != "127.0.0.1";
  if (addr_set) {
    p.master_addr = job.launcher.master_addr;
    p.addr_source = flags.master_addr.empty() ? "launcher.master_addr" : "--master-addr";
  } else if (slurm && p.nnodes > 1) {
    const char* which = nullptr;
    const std::string list = env_str(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}, &which);
    TR_CHECK(!list.empty(), "Slurm step of ", p.nnodes,
             " nodes without SLURM_JOB_NODELIST: cannot tell which host is node 0; set launcher.master_addr "
             "(--master-addr)");
    p.master_addr = first_host(list);
    p.addr_source = std::string("first host of ") + which + " '" + list + "'";
  } else {
    p.master_addr = "127.0.0.1";
    p.addr_source = "the default";
    if (p.nnodes > 1)
      p.warnings.push_back("launcher.master_addr is 127.0.0.1 with " + std::to_string(p.nnodes) +
                           " nodes: every node must be this machine; pass --master-addr <node 0's address> "
                           "otherwise");
  }
  if (job.launcher.master_port != 0) {
    p.master_port = job.launcher.master_port;
    p.port_source = flags.master_port >= 0 ? "--master-port" : "launcher.master_port";
  } else if (slurm) {
    p.master_port = slurm_port_for_job(p.slurm_job_id);
    p.port_source = "from SLURM_JOB_ID " + p.slurm_job_id;
  } else {
    p.master_port = kStaticPort;
    p.port_source = "the default";
  }
}

void check_nnodes(const JobSpec& job, int slurm_nnodes) {
  TR_CHECK(job.launcher.nnodes == 0 || job.launcher.nnodes == slurm_nnodes, "launcher.nnodes is ", job.launcher.nnodes,
           " but this Slurm step runs on ", slurm_nnodes,
           " nodes (SLURM_NNODES); set launcher.nnodes to 0 (take Slurm's count) or match the allocation");
}

}  // namespace

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

std::string this_host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

int slurm_port_for_job(const std::string& job_id) {
  uint64_t id = 0;
  bool numeric = !job_id.empty();
  for (char c : job_id) {
    if (!std::isdigit(static_cast<unsigned char>(c))) {
      numeric = false;
      break;
    }
    id = id * 10 + uint64_t(c - '0');
  }
  if (!numeric) id = std::hash<std::string>{}(job_id);
  return kSlurmPortBase + int(id % kSlurmPortSpan);
}

std::vector<int> expand_tasks_per_node(const std::string& spec) {
  std::vector<int> out;
  size_t i = 0;
  auto bad = [&] { TR_FAIL("tasks per node '", spec, "' is not in Slurm's form (e.g. 8 or 2(x3),1)"); };
  if (spec.empty()) bad();
  while (i < spec.size()) {
    auto number = [&] {
      if (i >= spec.size() || !std::isdigit(static_cast<unsigned char>(spec[i]))) bad();
      long v = 0;
      while (i < spec.size() && std::isdigit(static_cast<unsigned char>(spec[i]))) {
        v = v * 10 + (spec[i++] - '0');
        if (v > 1 << 24) bad();
      }
      return int(v);
    };
    const int n = number();
    int times = 1;
    if (i < spec.size() && spec[i] == '(') {
      if (spec.compare(i, 2, "(x") != 0) bad();
      i += 2;
      times = number();
      if (i >= spec.size() || spec[i] != ')') bad();
      ++i;
    }
    if (out.size() + size_t(times) > (1u << 20)) bad();
    out.insert(out.end(), size_t(times), n);
    if (i < spec.size()) {
      if (spec[i] != ',') bad();
      if (++i == spec.size()) bad();
    }
  }
  return out;
}

std::vector<std::string> LaunchFlags::overrides() const {
  std::vector<std::string> o;
  if (nnodes > 0) o.push_back("launcher.nnodes=" + std::to_string(nnodes));
  if (!master_addr.empty()) o.push_back("launcher.master_addr=" + master_addr);
  if (master_port >= 0) o.push_back("launcher.master_port=" + std::to_string(master_port));
  return o;
}

const char* launch_mode_name(LaunchMode m) {
  switch (m) {
    case LaunchMode::InProcess: return "in-process";
    case LaunchMode::LocalAgent: return "local agent";
    case LaunchMode::NodeAgent: return "node agent";
    case LaunchMode::SlurmWorker: return "Slurm worker";
    case LaunchMode::OutsideWorker: return "outside worker";
  }
  return "?";
}

std::string LaunchPlan::describe() const {
  const std::string slurm = slurm_job_id.empty() ? "" : "Slurm job " + slurm_job_id + ", ";
  const std::string store = "rendezvous store " + master_addr + ":" +
                            (master_port ? std::to_string(master_port) : std::string("<free port>")) +
                            " (address: " + addr_source +
                            "; port: " + (port_source.empty() ? "picked at start" : port_source) + ")";
  switch (mode) {
    case LaunchMode::InProcess: return slurm + "in-process: one worker, no agent, on " + host;
    case LaunchMode::LocalAgent:
      return slurm + "one node: an agent runs " + std::to_string(nproc_per_node) + " worker" +
             (nproc_per_node == 1 ? "" : "s") + " on " + host + "; " + store;
    case LaunchMode::NodeAgent:
      return slurm +
             (slurm_job_id.empty() ? "static rendezvous (--nnodes/--node-rank)"
                                   : "one agent per node (srun --ntasks-per-node=1)") +
             ": node " + std::to_string(node_rank) + " of " + std::to_string(nnodes) + " on " + host + ", " +
             std::to_string(nproc_per_node) + " workers per node (" + ranks_text(first_rank(), nproc_per_node) +
             " of " + std::to_string(world_size()) + "); " + store;
    case LaunchMode::SlurmWorker:
      return slurm + "direct workers (srun --ntasks-per-node=" + std::to_string(local_world) + ", no agent): rank " +
             std::to_string(rank) + " of " + std::to_string(world) + ", local rank " + std::to_string(local_rank) +
             " of " + std::to_string(local_world) + " on node " + std::to_string(node_rank) + " of " +
             std::to_string(nnodes) + " (" + host + "); " + store;
    case LaunchMode::OutsideWorker:
      return "worker started by an outside launcher (RANK=" + std::to_string(rank) +
             " WORLD_SIZE=" + std::to_string(world) + " from the environment) on " + host;
  }
  return "?";
}

WorkerCount resolve_nproc_per_node(const JobSpec& job, const EnvMap& env) {
  WorkerCount n;
  if (job.parallel.nproc_per_node > 0) {
    n.nproc = job.parallel.nproc_per_node;
    return n;
  }
  const std::string head = "parallel.nproc_per_node: 0 -> ";
  if (job.backend == "cpu") {
    n.why = head + "1 worker (backend: cpu; set parallel.nproc_per_node for several CPU workers)";
    return n;
  }
  auto it = env.find("CUDA_VISIBLE_DEVICES");
  const topo::GpuWorkers g = topo::count_gpu_workers(job, it == env.end() ? nullptr : it->second.c_str());
  n.nproc = g.nproc;
  n.why = head + g.why;
  return n;
}

LaunchPlan plan_launch(const JobSpec& job, const LaunchFlags& flags, const EnvMap& env, const std::string& host) {
  LaunchPlan p;
  p.host = host;
  p.master_addr = job.launcher.master_addr;
  p.master_port = job.launcher.master_port;
  p.addr_source = "launcher.master_addr";
  p.port_source = job.launcher.master_port ? "launcher.master_port" : "";
  // This node's workers, counted only where an agent will start them
  // (counting GPUs may mean detecting the topology).
  auto count_workers = [&] {
    const WorkerCount n = resolve_nproc_per_node(job, env);
    p.nproc_per_node = n.nproc;
    p.nproc_reason = n.why;
    return n.nproc > 1 || job.launcher.max_restarts > 0;  // an agent is needed
  };

  // 1. Someone else already placed this process.
  if (find_env(env, "RANK") || find_env(env, "WORLD_SIZE")) {
    TR_CHECK(!flags.any(),
             "--nnodes/--node-rank/--master-addr/--master-port make trainrun the launcher, but RANK/"
             "WORLD_SIZE in the environment say an outside launcher already started this process as a worker; "
             "use one or the other");
    p.mode = LaunchMode::OutsideWorker;
    p.world = env_int(env, {"WORLD_SIZE"}, 1);
    p.rank = env_int(env, {"RANK"}, 0);
    p.local_rank = env_int(env, {"LOCAL_RANK"}, p.rank);
    p.local_world = env_int(env, {"LOCAL_WORLD_SIZE"}, p.world);
    p.node_rank = env_int(env, {"GROUP_RANK"}, 0);
    p.master_addr = env_str(env, {"MASTER_ADDR"});
    if (p.master_addr.empty()) p.master_addr = "127.0.0.1";
    p.master_port = env_int(env, {"MASTER_PORT"}, 0);
    return p;
  }

  // 2. A task of an srun step (the batch script itself is not one: it has no step id).
  const std::string job_id = env_str(env, {"SLURM_JOB_ID", "SLURM_JOBID"});
  const bool in_step = !job_id.empty() && (find_env(env, "SLURM_STEP_ID") || find_env(env, "SLURM_STEPID"));
  if (in_step && flags.node_rank < 0) {
    p.slurm_job_id = job_id;
    const int ntasks = env_int(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"}, 1);
    const int nnodes = env_int(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"}, 1);
    const int procid = env_int(env, {"SLURM_PROCID"}, 0);
    const int nodeid = env_int(env, {"SLURM_NODEID"}, ntasks > nnodes ? 0 : procid);
    TR_CHECK(nnodes >= 1 && nodeid < nnodes, "SLURM_NODEID=", nodeid, " is not below SLURM_NNODES=", nnodes);
    TR_CHECK(procid < ntasks, "SLURM_PROCID=", procid, " is not below SLURM_NTASKS=", ntasks);
    check_nnodes(job, nnodes);
    p.nnodes = nnodes;
    p.node_rank = nodeid;
    if (ntasks > nnodes) {
      // Several tasks per node: each task is a worker.
      p.mode = LaunchMode::SlurmWorker;
      p.rank = procid;
      p.world = ntasks;
      p.local_rank = env_int(env, {"SLURM_LOCALID"}, 0);
      const std::string per_node = env_str(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
      if (!per_node.empty()) {
        const std::vector<int> counts = expand_tasks_per_node(per_node);
        TR_CHECK(size_t(nodeid) < counts.size(), "SLURM_STEP_TASKS_PER_NODE='", per_node, "' has no entry for node ",
                 nodeid);
        p.local_world = counts[size_t(nodeid)];
      } else {
        p.local_world = ntasks / nnodes;
      }
      TR_CHECK(p.local_rank < p.local_world, "SLURM_LOCALID=", p.local_rank, " is not below the ", p.local_world,
               " tasks of this node");
      if (job.parallel.nproc_per_node > 0 && job.parallel.nproc_per_node != p.local_world)
        p.warnings.push_back("parallel.nproc_per_node (" + std::to_string(job.parallel.nproc_per_node) +
                             ") is not used: srun started " + std::to_string(p.local_world) +
                             " tasks on this node, each one worker");
      p.nproc_per_node = p.local_world;
      resolve_store(p, job, flags, env, true);
      return p;
    }
    // One task per node: each task is this node's agent.
    const bool want_agent = count_workers();
    if (nnodes > 1) {
      p.mode = LaunchMode::NodeAgent;
      resolve_store(p, job, flags, env, true);
    } else {
      p.mode = want_agent ? LaunchMode::LocalAgent : LaunchMode::InProcess;
    }
    return p;
  }

  // 3. Static: one node, or --nnodes/--node-rank on every node.
  if (!job_id.empty() && !in_step && job.launcher.nnodes <= 1 && !flags.any()) {
    const int alloc = env_int(env, {"SLURM_NNODES", "SLURM_JOB_NUM_NODES"}, 1);
    if (alloc > 1)
      p.warnings.push_back("this is the batch script of a " + std::to_string(alloc) +
                           "-node Slurm allocation, not an srun step: only this node is used; start trainrun with "
                           "`srun --ntasks-per-node=1 trainrun ...` to use every node");
  }
  const int nnodes = job.launcher.nnodes > 0 ? job.launcher.nnodes : 1;
  TR_CHECK(nnodes == 1 || flags.node_rank >= 0, "launcher.nnodes is ", nnodes,
           ": pass --node-rank K on every node (0 on the node whose agent hosts the rendezvous store, 1..", nnodes - 1,
           " on the others), or run under `srun --ntasks-per-node=1`");
  const int node_rank = flags.node_rank >= 0 ? flags.node_rank : 0;
  TR_CHECK(node_rank < nnodes, "--node-rank ", node_rank, " is not below the node count (", nnodes,
           ", launcher.nnodes / --nnodes)");
  p.nnodes = nnodes;
  p.node_rank = node_rank;
  const bool want_agent = count_workers();
  if (nnodes > 1) {
    p.mode = LaunchMode::NodeAgent;
    resolve_store(p, job, flags, env, false);
  } else {
    p.mode = want_agent ? LaunchMode::LocalAgent : LaunchMode::InProcess;
    if (!flags.master_addr.empty()) p.addr_source = "--master-addr";
    if (flags.master_port >= 0) p.port_source = "--master-port";
  }
  return p;
}

}  // namespace trainrun
