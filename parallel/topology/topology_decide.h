// Decisions: pure functions from a topology description (topology.h) to
// what the launcher does with a node, each with the reason in words.
//
//   rank -> GPU        which GPUs, in which order (NVLink island, then NUMA
//                      node contiguous), CUDA_VISIBLE_DEVICES
//   CPU affinity       each rank an exclusive share of the cores next to its
//                      GPU (CPU backend: ranks spread over NUMA nodes)
//   NUMA policy        memory preferred on the rank's node
//   NCCL environment   NVLS, P2P level, IB HCAs, socket interface, cross-NIC;
//                      knobs deliberately left to NCCL are listed with why
//   hybrid_shard       the default shard group: the NVLink island
//   warnings           ACS, no NVLink, split sockets, far NICs, mixed models
//
// Nothing here reads the machine: the agent (core/launch/agent.cpp via
// topology_launch.h) and `trainrun topo` feed a description in, and the
// tests feed fixtures.
#pragma once
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "parallel/topology/topology.h"

namespace trainrun::topo {

struct DecisionInputs {
  int nproc = 0;                  // workers on this node; 0 = one per usable GPU (1 without GPUs)
  std::string backend = "auto";   // auto | cpu | cuda (the job's `backend`)
  CpuList allowed_cpus;           // CPUs this process may run on; empty = every CPU described
  std::vector<int> visible_gpus;  // the user's CUDA_VISIBLE_DEVICES (indices, in order); empty = unset
  bool no_visible_gpus = false;   // CUDA_VISIBLE_DEVICES hides every GPU: place ranks as on a CPU node
  bool bind_cpus = true;          // false: leave placement to the OS (parallel.cpu_affinity: none)
};

struct RankPlacement {
  int rank = 0;
  int gpu = -1;        // GPU index in the description; -1 on the CPU backend
  CpuList cpus;        // the CPUs it is bound to; empty = not bound
  int numa_node = -1;  // memory preferred on this node; -1 = the kernel's default (first touch)
};

struct EnvSetting {
  std::string name, value, reason;  // value empty: left to the library's default (reason says why)
};

struct TopologyWarning {
  std::string code;     // acs, acs_unknown, no_nvlink, nvlink_partial, nvlink_unknown, split_sockets,
                        // nic_far, mixed_gpus, more_ranks_than_gpus, no_gpus, cpu_oversubscribed, visible_gpus
  std::string message;  // what, why it matters, what to do
};

struct Decisions {
  std::string backend;  // cpu | cuda, resolved
  int nproc = 1;
  std::vector<RankPlacement> ranks;
  std::string gpu_order_reason;
  std::string affinity_reason;
  std::string numa_policy_reason;
  std::vector<EnvSetting> env;   // set for every worker (value non-empty)
  std::vector<EnvSetting> kept;  // considered and left alone, with the reason
  int hybrid_shard_group = 1;
  std::string hybrid_shard_reason;
  std::vector<TopologyWarning> warnings;

  const EnvSetting* find_env(const std::string& name) const;
  bool has_warning(const std::string& code) const;
};

Decisions decide(const Topology& t, const DecisionInputs& in);

// ---- which GPUs this process may use (topology_visible.cpp) ---------------------------------

// CUDA_VISIBLE_DEVICES read against a description the way CUDA reads it: a
// comma-separated list of GPU indices (nvidia-smi's, which is what the agent's
// CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA use too) or GPU UUIDs ("GPU-<hex>",
// a unique prefix is enough), in the order CUDA numbers the devices; "MIG-..."
// entries name MIG instances, of which a CUDA process uses one. Unset means
// every GPU; empty, "-1" and "NoDevFiles" (what schedulers set for a job
// without GPUs) mean none.
struct VisibleGpus {
  bool set = false;          // CUDA_VISIBLE_DEVICES is set
  int count = 0;             // the devices a CUDA process sees
  std::vector<int> gpus;     // those devices' indices in the description, in CUDA's order; empty when unmapped
  std::string unmapped;      // why they cannot be mapped onto the description (UUIDs it does not know, MIG)
  bool none() const { return count == 0; }
};
// `value` is the variable's value (nullptr = unset); `described` names the
// description in errors ("parallel.topology_file /x.json"). Throws
// trainrun::Error naming CUDA_VISIBLE_DEVICES for an entry that names no GPU
// of the description, a GPU listed twice, or an entry that is neither an
// index nor a UUID: CUDA would quietly drop it and everything after it. A
// description without GPUs has nothing to check against: callers skip it.
VisibleGpus resolve_visible_gpus(const Topology& t, const char* value, const std::string& described);

// What a worker's environment gets: the decided variables, except that a
// variable already set (by the user) always wins; those are returned with
// user_set and the user's value, so the agent can log them.
struct EnvChoice {
  std::string name, value, reason;
  bool user_set = false;
  std::string user_value;
};
std::vector<EnvChoice> plan_worker_env(const std::vector<EnvSetting>& decided,
                                       const std::function<const char*(const std::string&)>& lookup);

// ---- output (topology_report.cpp) ---------------------------------------------------------

nlohmann::json decisions_to_json(const Decisions& d);
// The link matrix as nvidia-smi prints it (tabs, NIC<n> columns with a NIC
// Legend, CPU Affinity and NUMA Affinity); parse_nvidia_smi_topo reads it back.
std::string format_link_matrix(const Topology& t);
// Everything `trainrun topo` prints: matrix, NUMA/NIC placement, every
// decision with its reason, warnings.
// `tp_section`: text printed before the warnings (`trainrun topo --tp`).
std::string format_topology_report(const Topology& t, const Decisions& d, const std::string& tp_section = "");

// ---- tensor-parallel groups (topology_tp.cpp) -----------------------------------------------

// A TP group is `tp` consecutive ranks (parallel/mesh/device_mesh.h: tp is
// the innermost mesh dimension), so on a node it is `tp` consecutive local
// ranks, placed on the GPUs decide() gave them. What matters for TP is the
// group's slowest link: its four activation collectives per layer per
// micro-batch sit between GEMMs and cannot hide behind compute.
enum class TpLinkKind {
  Single,     // tp 1: no TP traffic
  Host,       // CPU ranks of one host (Gloo over loopback)
  NVLink,     // every pair of the group's GPUs on NVLink
  PCIe,       // some pair only through PCIe (PIX ... SYS)
  CrossNode,  // the group reaches past this node's ranks (tp does not divide them)
  Unknown,    // a pair's link is unknown
};
const char* tp_link_name(TpLinkKind k);  // "none", "host", "NVLink", "PCIe", "cross-node", "unknown"

struct TpGroup {
  std::vector<int> ranks;    // local ranks on this node
  std::vector<int> gpus;     // their GPUs (empty on the CPU backend)
  TpLinkKind kind = TpLinkKind::Single;
  Link slowest;              // the slowest link between two of the group's GPUs (NVLink/PCIe)
};

// The node's TP groups for `tp` (>= 1) over the ranks of `d`.
std::vector<TpGroup> tp_groups(const Topology& t, const Decisions& d, int tp);
// The node's context-parallel groups for `cp` at tensor-parallel degree
// `tp`: cp ranks tp apart (the mesh's cp dimension sits just outside tp),
// each with its slowest link, which the ring's K/V transfers cross.
std::vector<TpGroup> cp_groups(const Topology& t, const Decisions& d, int cp, int tp);
// One line per group: "ranks 0-1 (GPUs 0,1): NVLink (NV4)".
std::string describe_tp_group(const TpGroup& g);
// The warning for groups that span PCIe or nodes (why, what to do); "" when
// every group is on NVLink or one host. Names the largest degree that would
// stay on NVLink here. include_cross_node false: only PCIe groups count (the
// agent's case: the trainer warns about groups that span nodes itself,
// since only it knows every node's ranks).
std::string tp_groups_warning(const Topology& t, const Decisions& d, int tp, bool include_cross_node = true);

}  // namespace trainrun::topo
