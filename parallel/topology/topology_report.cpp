// What `trainrun topo` prints, and the JSON of the decisions (for --json and
// <output.dir>/topology.json). The text is for people: the matrix as
// nvidia-smi prints it, where things sit, then every decision with its
// reason, then the warnings.
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "parallel/topology/topology_decide.h"

namespace trainrun::topo {

using json = nlohmann::json;

json decisions_to_json(const Decisions& d) {
  json j;
  j["backend"] = d.backend;
  j["nproc"] = d.nproc;
  j["ranks"] = json::array();
  for (const RankPlacement& r : d.ranks) {
    json o = {{"rank", r.rank}, {"cpus", format_cpulist(r.cpus)}, {"numa_node", r.numa_node}};
    if (r.gpu >= 0) o["gpu"] = r.gpu;
    j["ranks"].push_back(o);
  }
  j["gpu_order_reason"] = d.gpu_order_reason;
  j["affinity_reason"] = d.affinity_reason;
  j["numa_policy_reason"] = d.numa_policy_reason;
  j["env"] = json::array();
  for (const EnvSetting& e : d.env) j["env"].push_back({{"name", e.name}, {"value", e.value}, {"reason", e.reason}});
  j["left_to_default"] = json::array();
  for (const EnvSetting& e : d.kept) j["left_to_default"].push_back({{"name", e.name}, {"reason", e.reason}});
  j["hybrid_shard_group"] = d.hybrid_shard_group;
  j["hybrid_shard_reason"] = d.hybrid_shard_reason;
  j["warnings"] = json::array();
  for (const TopologyWarning& w : d.warnings) j["warnings"].push_back({{"code", w.code}, {"message", w.message}});
  return j;
}

std::string format_link_matrix(const Topology& t) {
  std::ostringstream os;
  const size_t G = t.gpus.size(), N = t.nics.size();
  auto cell = [](const Link& l) { return l.kind == LinkKind::Self ? std::string(" X ") : link_code(l); };
  for (size_t g = 0; g < G; ++g) os << "\tGPU" << g;
  for (size_t n = 0; n < N; ++n) os << "\tNIC" << n;
  os << "\tCPU Affinity\tNUMA Affinity\n";
  for (size_t g = 0; g < G; ++g) {
    os << "GPU" << g;
    for (size_t h = 0; h < G; ++h) os << "\t" << cell(t.links[g][h]);
    for (size_t n = 0; n < N; ++n) os << "\t" << cell(t.nics[n].gpu_links[g]);
    const Gpu& gpu = t.gpus[g];
    os << "\t" << (gpu.cpus.empty() ? "N/A" : format_cpulist(gpu.cpus)) << "\t"
       << (gpu.numa_node >= 0 ? std::to_string(gpu.numa_node) : "N/A") << "\n";
  }
  for (size_t n = 0; n < N; ++n) {
    os << "NIC" << n;
    for (size_t g = 0; g < G; ++g) os << "\t" << cell(t.nics[n].gpu_links[g]);
    for (size_t m = 0; m < N; ++m)
      os << "\t" << (t.nics[n].nic_links.empty() ? (n == m ? " X " : "?") : cell(t.nics[n].nic_links[m]));
    os << "\n";
  }
  os << "\nLegend:\n\n"
        "  X    = Self\n"
        "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
        "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n"
        "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n"
        "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n"
        "  PIX  = Connection traversing at most a single PCIe bridge\n"
        "  NV#  = Connection traversing a bonded set of # NVLinks\n";
  if (N > 0) {
    os << "\nNIC Legend:\n\n";
    for (size_t n = 0; n < N; ++n) os << "  NIC" << n << ": " << t.nics[n].name << "\n";
  }
  return os.str();
}

namespace {

std::string gib(int64_t mib) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(mib >= 10 * 1024 ? 0 : 1) << double(mib) / 1024.0 << " GiB";
  return os.str();
}

std::string speed(int64_t mbps) {
  if (mbps <= 0) return "speed unknown";
  if (mbps % 1000 == 0) return std::to_string(mbps / 1000) + " Gb/s";
  return std::to_string(mbps) + " Mb/s";
}

// Long reasons wrapped under their decision.
void why(std::ostringstream& os, const std::string& text, const std::string& indent = "      ") {
  std::istringstream words(text);
  std::string line = indent + "why: ", w;
  const size_t start = line.size();
  while (words >> w) {
    if (line.size() > start && line.size() + 1 + w.size() > 110) {
      os << line << "\n";
      line = indent + "     ";
    }
    if (line.size() > start && line.back() != ' ') line += ' ';
    line += w;
  }
  os << line << "\n";
}

}  // namespace

std::string format_topology_report(const Topology& t, const Decisions& d, const std::string& tp_section) {
  std::ostringstream os;
  os << "topology of " << (t.host.empty() ? "an unnamed host" : t.host);
  std::string srcs;
  for (const auto& s : t.sources) srcs += (srcs.empty() ? "" : ", ") + s;
  os << " (from " << (srcs.empty() ? "nothing" : srcs) << ")\n\n";

  if (t.gpus.empty()) {
    os << "no GPUs found: this node is described by its CPUs only (an NVIDIA GPU would show on the PCI bus as a "
          "display/3D controller of vendor 0x10de, or through NVML)\n\n";
  } else {
    os << format_link_matrix(t) << "\n";
  }

  os << "NUMA nodes:\n";
  if (t.numa_nodes.empty()) os << "  unknown\n";
  for (const NumaNode& n : t.numa_nodes) {
    os << "  node " << n.id << ": CPUs " << (n.cpus.empty() ? "unknown" : format_cpulist(n.cpus));
    if (!n.cores.empty()) os << " (" << n.cores.size() << " cores, " << n.cpus.size() << " threads)";
    if (n.memory_mib > 0) os << ", " << gib(n.memory_mib);
    std::string gpus, nics;
    for (const Gpu& g : t.gpus)
      if (g.numa_node == n.id) gpus += (gpus.empty() ? "" : ",") + std::to_string(g.index);
    for (const Nic& x : t.nics)
      if (x.numa_node == n.id) nics += (nics.empty() ? "" : ", ") + x.name;
    if (!gpus.empty()) os << "; GPUs " << gpus;
    if (!nics.empty()) os << "; NICs " << nics;
    os << "\n";
  }
  if (!t.gpus.empty()) {
    os << "GPUs:\n";
    for (const Gpu& g : t.gpus) {
      os << "  GPU" << g.index << ": " << (g.name.empty() ? "model unknown" : g.name);
      if (!g.pci_bus_id.empty()) os << ", " << g.pci_bus_id;
      if (g.memory_mib > 0) os << ", " << gib(g.memory_mib);
      if (!g.compute_capability.empty()) os << ", sm " << g.compute_capability;
      os << ", NUMA " << (g.numa_node >= 0 ? std::to_string(g.numa_node) : "unknown") << "\n";
    }
  }
  if (!t.nics.empty()) {
    os << "NICs:\n";
    for (const Nic& n : t.nics) {
      os << "  " << n.name << ": " << nic_kind_name(n.kind) << ", " << speed(n.speed_mbps);
      if (!n.state.empty()) os << ", " << n.state;
      if (!n.pci_bus_id.empty()) os << ", " << n.pci_bus_id;
      if (n.numa_node >= 0) os << ", NUMA " << n.numa_node;
      if (!n.netdev.empty() && n.netdev != n.name) os << ", interface " << n.netdev;
      const std::vector<int> near = nearest_gpus(n);
      if (!near.empty()) {
        os << ", nearest GPU";
        for (size_t i = 0; i < near.size(); ++i) os << (i ? "," : "") << near[i];
        os << " (" << link_code(n.gpu_links[size_t(near[0])]) << ")";
      }
      os << "\n";
    }
  }
  if (!t.bridges.empty()) {
    os << "PCI bridges on GPU paths (ACS):\n";
    for (const PciBridge& b : t.bridges)
      os << "  " << b.pci_bus_id << ": "
         << (b.acs == AcsState::Enabled ? "enabled" : b.acs == AcsState::Disabled ? "disabled" : "unknown") << " ("
         << b.acs_detail << ")\n";
  }
  if (!t.notes.empty()) {
    os << "notes:\n";
    for (const std::string& n : t.notes) os << "  - " << n << "\n";
  }

  os << "\ndecisions for " << d.nproc << " rank" << (d.nproc == 1 ? "" : "s") << " (" << d.backend << " backend):\n";
  os << "  rank -> GPU:";
  if (d.backend == "cuda")
    for (const RankPlacement& r : d.ranks) os << " " << r.rank << "->" << r.gpu;
  else
    os << " none";
  os << "\n";
  why(os, d.gpu_order_reason);
  os << "  CPU affinity:";
  for (const RankPlacement& r : d.ranks)
    os << " rank " << r.rank << ": " << (r.cpus.empty() ? "not bound" : format_cpulist(r.cpus)) << ";";
  os << "\n";
  why(os, d.affinity_reason);
  os << "  NUMA memory policy:";
  for (const RankPlacement& r : d.ranks)
    os << " rank " << r.rank << ": " << (r.numa_node >= 0 ? "preferred node " + std::to_string(r.numa_node) : "default") << ";";
  os << "\n";
  why(os, d.numa_policy_reason);
  os << "  environment for every worker:" << (d.env.empty() ? " nothing (no NCCL on the CPU backend)" : "") << "\n";
  for (const EnvSetting& e : d.env) {
    os << "    " << e.name << "=" << e.value << "\n";
    why(os, e.reason, "        ");
  }
  for (const EnvSetting& e : d.kept) {
    os << "    " << e.name << ": left to its default\n";
    why(os, e.reason, "        ");
  }
  os << "  hybrid_shard group: " << d.hybrid_shard_group << (d.hybrid_shard_group == 1 ? " rank\n" : " ranks\n");
  why(os, d.hybrid_shard_reason);

  os << tp_section;
  os << "\nwarnings:" << (d.warnings.empty() ? " none" : "") << "\n";
  for (const TopologyWarning& w : d.warnings) os << "  - [" << w.code << "] " << w.message << "\n";
  return os.str();
}

}  // namespace trainrun::topo
