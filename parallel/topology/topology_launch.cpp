// `trainrun topo` and the agent's launch plan. See topology_launch.h.
#include "parallel/topology/topology_launch.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <nlohmann/json.hpp>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/model/model_spec.h"
#include "parallel/topology/topology_decide.h"
#include "parallel/topology/topology_sources.h"

namespace trainrun::topo {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

CpuList process_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  CpuList out;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

// CUDA_VISIBLE_DEVICES as set, including set but empty (which hides every
// GPU, unlike unset); nullptr when unset.
const char* cuda_visible_devices() { return std::getenv("CUDA_VISIBLE_DEVICES"); }

// The decision inputs that CUDA_VISIBLE_DEVICES gives. False when it names
// GPUs the description cannot map (the placement then cannot know which GPU
// a rank gets).
bool apply_visible(const VisibleGpus& v, DecisionInputs* in) {
  in->no_visible_gpus = v.set && v.none();
  if (v.set && v.unmapped.empty()) in->visible_gpus = v.gpus;
  return v.unmapped.empty();
}

std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

const char* env_lookup(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  return v && *v ? v : nullptr;
}

}  // namespace

int run_topo_command(const TopoCommandOptions& o, std::ostream& out) {
  const int given = int(!o.nvidia_smi_file.empty()) + int(!o.topology_file.empty()) + int(!o.sysfs_root.empty());
  TR_CHECK(given <= 1, "topo: use at most one of --nvidia-smi-topo, --topology and --sysfs-root");
  TR_CHECK(o.tp >= 0, "topo: --tp must be at least 1 (got ", o.tp, ")");
  // --config: the job's mesh and node (flags given here win).
  TR_CHECK(o.cp >= 0, "topo: --cp must be at least 1 (got ", o.cp, ")");
  int tp = o.tp, cp = o.cp, nproc = o.nproc;
  std::string topology_file = o.topology_file;
  if (!o.config.empty()) {
    const JobSpec job = load_resolved_job_spec(o.config, {});
    if (tp == 0) tp = job.parallel.tensor_parallel;
    if (cp == 0 && job.parallel.context_parallel > 1) cp = job.parallel.context_parallel;
    if (nproc == 0 && job.parallel.nproc_per_node > 0) nproc = job.parallel.nproc_per_node;
    if (given == 0) topology_file = job.parallel.topology_file;
  }
  Topology t;
  DecisionInputs in;
  in.nproc = nproc;
  if (!topology_file.empty()) {
    t = load_topology(topology_file);
  } else if (!o.nvidia_smi_file.empty()) {
    t = make_nvidia_smi_source(o.nvidia_smi_file)->read();
  } else if (!o.sysfs_root.empty()) {
    t = read_sysfs_topology(o.sysfs_root);
  } else {
    // This machine: what this process may use matters for the binding.
    t = detect_local_topology("/");
    in.allowed_cpus = process_cpus();
    if (t.gpu_count() > 0) apply_visible(resolve_visible_gpus(t, cuda_visible_devices(), "this machine"), &in);
  }
  Decisions d = decide(t, in);
  // TP groups: tp consecutive ranks (the mesh's innermost dimension).
  std::string tp_section;
  json tp_json = json::array();
  if (tp > 0) {
    std::ostringstream os;
    os << "  tensor-parallel groups (tp " << tp << ", " << d.nproc << " rank" << (d.nproc == 1 ? "" : "s")
       << " on this node; a group is " << tp << " consecutive ranks):\n";
    for (const TpGroup& g : tp_groups(t, d, tp)) {
      os << "    " << describe_tp_group(g) << "\n";
      tp_json.push_back({{"ranks", g.ranks}, {"gpus", g.gpus}, {"link", tp_link_name(g.kind)},
                         {"slowest", g.kind == TpLinkKind::NVLink || g.kind == TpLinkKind::PCIe ? link_code(g.slowest) : ""}});
    }
    tp_section = os.str();
    const std::string w = tp_groups_warning(t, d, tp);
    if (!w.empty()) d.warnings.push_back({"tp_link", w});
  }
  // CP groups: cp ranks tp apart (the mesh's next dimension out).
  json cp_json = json::array();
  if (cp > 0) {
    std::ostringstream os;
    const int ctp = std::max(1, tp);
    os << "  context-parallel groups (cp " << cp << " at tp " << ctp << "; a group is " << cp << " ranks " << ctp
       << " apart, the ring's K/V passes between them):\n";
    for (const TpGroup& g : cp_groups(t, d, cp, ctp)) {
      os << "    " << describe_tp_group(g) << "\n";
      cp_json.push_back({{"ranks", g.ranks}, {"gpus", g.gpus}, {"link", tp_link_name(g.kind)}});
    }
    tp_section += os.str();
  }
  if (!o.save_file.empty()) {
    save_topology(t, o.save_file);
    TR_LOG_INFO("topo: description saved to ", o.save_file, " (load it with --topology or parallel.topology_file)");
  }
  if (o.json) {
    json j{{"description", topology_to_json(t)}, {"decisions", decisions_to_json(d)}};
    if (tp > 0) j["tp_groups"] = {{"tp", tp}, {"groups", tp_json}};
    if (cp > 0) j["cp_groups"] = {{"cp", cp}, {"tp", std::max(1, tp)}, {"groups", cp_json}};
    out << j.dump(2) << "\n";
  } else {
    out << format_topology_report(t, d, tp_section);
  }
  return 0;
}

void apply_worker_placement(const WorkerPlacement& p) noexcept {
  if (p.bind_cpus && ::sched_setaffinity(0, sizeof p.cpus, &p.cpus) != 0) {
    static const char msg[] = "trainrun: warning: cannot bind this worker to its CPUs; it runs unbound\n";
    ssize_t ignored = ::write(2, msg, sizeof msg - 1);
    (void)ignored;
  }
  if (p.preferred_node >= 0) {
    // MPOL_PREFERRED = 1 (linux/mempolicy.h). maxnode counts one past the
    // mask's bits: the kernel reads maxnode - 1 of them.
    const long rc = ::syscall(SYS_set_mempolicy, 1, p.node_mask, sizeof p.node_mask * 8 + 1);
    if (rc != 0) {
      static const char msg[] = "trainrun: warning: cannot set this worker's NUMA memory policy; using the default\n";
      ssize_t ignored = ::write(2, msg, sizeof msg - 1);
      (void)ignored;
    }
  }
}

const NodeTopology& node_topology(const JobSpec& job) {
  // Keyed by the file ("" = this machine): the description of a node does
  // not change while one trainrun process plans and launches its workers.
  static std::mutex mu;
  static std::map<std::string, NodeTopology> known;
  std::lock_guard<std::mutex> lock(mu);
  const std::string& file = job.parallel.topology_file;
  if (auto it = known.find(file); it != known.end()) return it->second;
  NodeTopology n;
  if (!file.empty()) {
    // The user's file: an error in it stops the job before any worker starts.
    n.topology = load_topology(file);
    n.source = "parallel.topology_file " + file;
  } else {
    n.source = "the topology detected on this machine";
    try {
      n.topology = detect_local_topology("/");
    } catch (const Error& e) {
      n.detect_error = e.what();
    }
  }
  return known.emplace(file, std::move(n)).first->second;
}

GpuWorkers count_gpu_workers(const JobSpec& job, const char* visible) {
  const NodeTopology& node = node_topology(job);
  GpuWorkers w;
  if (!node.detect_error.empty()) {
    w.why = "1 worker: topology detection failed (" + node.detect_error + "), so no GPU was counted; set "
            "parallel.nproc_per_node or parallel.topology_file";
    return w;
  }
  const Topology& t = node.topology;
  const int G = t.gpu_count();
  if (G == 0) {
    w.why = "1 worker: no GPU in " + node.source;
    return w;
  }
  const VisibleGpus v = resolve_visible_gpus(t, visible, node.source);
  const std::string var = visible ? "CUDA_VISIBLE_DEVICES=" + std::string(visible) : "";
  if (v.none()) {
    w.why = "1 worker: CUDA_VISIBLE_DEVICES='" + std::string(visible) + "' hides every GPU (of the " +
            std::to_string(G) + " in " + node.source + ")";
    return w;
  }
  w.nproc = v.count;
  const std::string workers = std::to_string(w.nproc) + (w.nproc == 1 ? " worker, one per GPU (" : " workers, one per GPU (");
  if (!v.set)
    w.why = workers + std::to_string(G) + " GPUs in " + node.source + "; CUDA_VISIBLE_DEVICES unset)";
  else if (v.unmapped.empty())
    w.why = workers + var + " selects GPU" + (v.gpus.size() == 1 ? " " : "s ") + join_ints(v.gpus) + " of the " +
            std::to_string(G) + " in " + node.source + ")";
  else
    w.why = workers + var + ": " + v.unmapped + ")";
  return w;
}

LaunchTopology prepare_launch_topology(const JobSpec& job, int nproc) {
  LaunchTopology plan;
  const NodeTopology& node = node_topology(job);
  if (!node.detect_error.empty()) {
    TR_LOG_WARN("topology: detection failed (", node.detect_error,
                "); workers start unbound and with no NCCL settings");
    return plan;
  }
  const Topology& t = node.topology;
  DecisionInputs in;
  in.nproc = nproc;
  in.backend = job.backend;
  in.allowed_cpus = process_cpus();
  in.bind_cpus = job.parallel.cpu_affinity != "none";
  // Without a GPU in the description there is nothing to read
  // CUDA_VISIBLE_DEVICES against (and nothing to place by it).
  const char* visible = cuda_visible_devices();
  const VisibleGpus v = t.gpu_count() > 0 ? resolve_visible_gpus(t, visible, node.source) : VisibleGpus{};
  if (!apply_visible(v, &in) && in.bind_cpus) {
    TR_LOG_WARN("topology: CUDA_VISIBLE_DEVICES=", visible, " cannot be mapped onto GPUs of ", node.source, ": ",
                v.unmapped, "; workers start unbound");
    in.bind_cpus = false;
  }
  const Decisions d = decide(t, in);

  // The worker environment: decisions, plus the hybrid_shard group the
  // trainer uses when parallel.shard_group_size is 0.
  std::vector<EnvSetting> decided = d.env;
  if (job.parallel.sharding == "hybrid_shard" && job.parallel.shard_group_size == 0)
    decided.push_back({"TRAINRUN_SHARD_GROUP_SIZE", std::to_string(d.hybrid_shard_group), d.hybrid_shard_reason});
  const std::vector<EnvChoice> env = plan_worker_env(decided, env_lookup);
  json env_json = json::array();
  std::string applied;
  for (const EnvChoice& c : env) {
    if (c.user_set) {
      TR_LOG_INFO("topology: ", c.name, "=", c.user_value, " is set in the environment and wins (the topology would set ",
                  c.value, ")");
    } else {
      plan.env.push_back(c.name + "=" + c.value);
      applied += " " + c.name + "=" + c.value;
    }
    env_json.push_back({{"name", c.name},
                        {"value", c.user_set ? c.user_value : c.value},
                        {"set_by", c.user_set ? "user" : "topology"},
                        {"topology_value", c.value},
                        {"reason", c.reason}});
  }

  for (const RankPlacement& r : d.ranks) {
    WorkerPlacement p;
    CPU_ZERO(&p.cpus);
    for (int c : r.cpus)
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &p.cpus), p.bind_cpus = true;
    if (r.numa_node >= 0 && r.numa_node < int(sizeof p.node_mask * 8)) {
      p.preferred_node = r.numa_node;
      p.node_mask[size_t(r.numa_node) / (8 * sizeof(unsigned long))] |= 1UL << (size_t(r.numa_node) % (8 * sizeof(unsigned long)));
    }
    plan.placement.push_back(p);
  }

  const fs::path path = fs::path(job.output.dir) / "topology.json";
  {
    std::ofstream f(path);
    TR_CHECK(f, "launcher: cannot write '", path.string(), "'; check that output.dir is writable");
    f << json{{"description", topology_to_json(t)}, {"decisions", decisions_to_json(d)}, {"worker_env", env_json}}.dump(2)
      << "\n";
  }
  std::string binding;
  for (const RankPlacement& r : d.ranks) {
    binding += " rank " + std::to_string(r.rank);
    if (r.gpu >= 0) binding += " GPU" + std::to_string(r.gpu);
    binding += " CPUs " + (r.cpus.empty() ? std::string("unbound") : format_cpulist(r.cpus)) + ";";
  }
  TR_LOG_INFO("topology: ", t.gpu_count(), " GPUs, ", t.numa_nodes.size(), " NUMA node",
              t.numa_nodes.size() == 1 ? "" : "s", ";", binding, " details in ", path.string());
  if (!applied.empty()) TR_LOG_INFO("topology: worker environment:", applied);
  for (const TopologyWarning& w : d.warnings) TR_LOG_WARN("topology: ", w.message);
  // Tensor parallelism: where this node's TP groups sit, and the warning
  // (once per node, here rather than in every worker) when one spans PCIe.
  if (job.parallel.tensor_parallel > 1) {
    std::string groups;
    for (const TpGroup& g : tp_groups(t, d, job.parallel.tensor_parallel))
      groups += (groups.empty() ? "" : "; ") + describe_tp_group(g);
    TR_LOG_INFO("topology: TP groups: ", groups);
    const std::string w = tp_groups_warning(t, d, job.parallel.tensor_parallel, /*include_cross_node=*/false);
    if (!w.empty()) TR_LOG_WARN("topology: ", w);
  }
  return plan;
}

}  // namespace trainrun::topo
