// The node's topology as data: which GPUs, how every pair is connected,
// which NICs sit where, which CPUs belong to which NUMA node.
//
// Detection has two phases, as in NCCL (graph/topo.cc): first build this
// serialisable description from one or more sources
// (parallel/topology/topology_sources.h: a saved file, `nvidia-smi topo -m` text,
// /sys under an injectable root, NVML, a CUDA peer probe), then turn it into
// decisions (parallel/topology/topology_decide.h) with pure functions. Because the
// description can be saved and loaded, every decision is testable from a
// fixture of a machine we do not have.
//
// Link codes are nvidia-smi's, best first:
//   X     the device itself
//   NV<n> a bonded set of n NVLinks (directly or through NVSwitch)
//   PIX   at most one PCIe bridge (two devices under the same PCIe switch)
//   PXB   several PCIe bridges, without the host bridge
//   PHB   through a PCIe host bridge (the CPU's root complex)
//   NODE  between host bridges within one NUMA node
//   SYS   across the SMP interconnect between NUMA nodes (QPI/UPI/xGMI)
// "SOC" (older nvidia-smi releases) is read as SYS.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace trainrun::topo {

// ---- links ----------------------------------------------------------------------------

enum class LinkKind { Self, NVLink, PIX, PXB, PHB, Node, Sys, Unknown };

struct Link {
  LinkKind kind = LinkKind::Unknown;
  int nvlinks = 0;  // NVLink only: how many links are bonded (NV12 -> 12)
  bool operator==(const Link& o) const { return kind == o.kind && nvlinks == o.nvlinks; }
  bool operator!=(const Link& o) const { return !(*this == o); }
};

// "X", "NV12", "PIX", ..., "?" for Unknown.
std::string link_code(const Link& l);
// Parses a code (case-sensitive, as nvidia-smi prints it); false if unknown.
bool parse_link_code(const std::string& code, Link* out);
// Smaller is closer: Self < NVLink (more links first) < PIX < ... < SYS < Unknown.
int link_distance(const Link& l);
bool is_pcie(LinkKind k);

// ---- CPU sets -------------------------------------------------------------------------

using CpuList = std::vector<int>;  // sorted, no duplicates
// Kernel cpulist syntax ("0-3,8,10-11"); an empty string or "N/A" is empty.
// Throws trainrun::Error on anything else.
CpuList parse_cpulist(const std::string& text);
std::string format_cpulist(const CpuList& cpus);  // "0-3,8,10-11"; "" for empty
CpuList intersect(const CpuList& a, const CpuList& b);

// ---- the description --------------------------------------------------------------------

struct NumaNode {
  int id = 0;
  CpuList cpus;
  int64_t memory_mib = 0;       // 0 = unknown
  std::vector<CpuList> cores;   // hardware threads grouped by physical core; empty = unknown
};

struct Gpu {
  int index = 0;                   // nvidia-smi / NVML index (PCI bus order)
  std::string name;                // "NVIDIA H100 80GB HBM3"; empty = unknown
  std::string pci_bus_id;          // "0000:18:00.0" (lower case, 4-digit domain); empty = unknown
  std::string uuid;                // "GPU-8e5c2a1f-..." (NVML); empty = unknown (nvidia-smi topo -m has none)
  int64_t memory_mib = 0;          // 0 = unknown
  int numa_node = -1;              // -1 = unknown
  CpuList cpus;                    // CPUs local to the GPU (nvidia-smi's CPU Affinity)
  std::string compute_capability;  // "9.0"; empty = unknown
  std::string root_complex;        // "pci0000:17" (sysfs only)
  std::vector<std::string> pci_path;  // bridges from the root port down to the GPU (sysfs only)
};

// Rdma: a verbs device whose link layer (InfiniBand or RoCE) is not known,
// e.g. a NIC column of `nvidia-smi topo -m`.
enum class NicKind { InfiniBand, RoCE, Rdma, Ethernet, Unknown };
std::string nic_kind_name(NicKind k);  // "infiniband", "roce", "rdma", "ethernet", "unknown"
bool is_rdma(NicKind k);               // a verbs device: what NCCL_IB_HCA selects

struct Nic {
  std::string name;        // HCA name for RDMA NICs (mlx5_0), else the interface (eth0)
  std::string pci_bus_id;  // empty = unknown
  int numa_node = -1;
  NicKind kind = NicKind::Unknown;
  int64_t speed_mbps = 0;  // 0 = unknown
  std::string netdev;      // its IP interface (IPoIB / RoCE / Ethernet); empty = none known
  std::string state;       // "up", "down" or empty (unknown)
  std::vector<Link> gpu_links;  // one per GPU, in GPU order
  std::vector<Link> nic_links;  // one per NIC, in NIC order (X for itself); empty = unknown
};

enum class AcsState { Unknown, Disabled, Enabled };
struct PciBridge {
  std::string pci_bus_id;
  AcsState acs = AcsState::Unknown;
  std::string acs_detail;  // "ReqRedir+ CmpltRedir+ ..." or why it is unknown
};

struct Topology {
  std::string host;                    // where it was described
  std::vector<std::string> sources;    // what contributed, e.g. "sysfs:/", "nvml"
  std::vector<std::string> notes;      // what a source inferred or could not read
  std::vector<NumaNode> numa_nodes;
  std::vector<Gpu> gpus;               // index i at position i
  std::vector<std::vector<Link>> links;  // G x G, Self on the diagonal, symmetric
  bool nvswitch = false;               // NVLinks go through NVSwitch (all-to-all at full bandwidth)
  int nvswitch_devices = 0;            // NVSwitch chips seen on the PCI bus (sysfs)
  std::vector<Nic> nics;
  std::vector<PciBridge> bridges;      // bridges on the PCI paths of GPUs (sysfs)
  std::vector<std::vector<int>> p2p;   // G x G: 1 P2P works, 0 broken; empty = not probed
  std::string p2p_source;              // who filled p2p ("nvml", "cuda")

  int gpu_count() const { return int(gpus.size()); }
  const NumaNode* numa(int id) const;
  const PciBridge* bridge(const std::string& bus_id) const;
};

// Structural checks every source's result and every loaded file must pass:
// a square, symmetric link matrix with Self exactly on the diagonal, GPU
// indices 0..G-1 in order, one link per GPU on each NIC (and none or one per
// NIC), unique NUMA ids.
// `where` prefixes the messages (a file name).
void validate_topology(const Topology& t, const std::string& where);

// NVLink islands: GPUs connected by NVLink, transitively. Each island is a
// sorted list of GPU indices; islands are ordered by their smallest index.
// A GPU without NVLink is an island of one.
std::vector<std::vector<int>> nvlink_islands(const Topology& t);
// The GPUs whose link to this NIC is the NIC's best one.
std::vector<int> nearest_gpus(const Nic& nic);
// "0000:18:00.0" from "00000000:18:00.0" / "0000:18:00.0" / "18:00.0" (any case).
std::string normalize_bus_id(const std::string& id);

// ---- JSON -------------------------------------------------------------------------------

// Format id and version written into every saved description.
constexpr const char* kTopologyFormat = "trainrun-topology";
constexpr int kTopologyVersion = 1;

nlohmann::json topology_to_json(const Topology& t);
// Throws trainrun::Error naming `where` and the JSON path of a bad field.
Topology topology_from_json(const nlohmann::json& j, const std::string& where);
// Files: errors name the file (and line:column for malformed JSON).
void save_topology(const Topology& t, const std::string& path);
Topology load_topology(const std::string& path);
Topology parse_topology_json(const std::string& text, const std::string& name);

}  // namespace trainrun::topo
