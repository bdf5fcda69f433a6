// The /sys source. Everything is read under a root directory, so tests point
// it at a fixture tree (tests/fixtures/topology/sysfs/*) and `trainrun topo
// --sysfs-root DIR` can describe a tree copied from another machine.
//
// What it reads:
//   sys/devices/system/node/node<N>/{cpulist,meminfo}   NUMA nodes
//   sys/devices/system/cpu/cpu<N>/topology/thread_siblings_list   SMT siblings
//   sys/bus/pci/devices/<bdf> -> ../../../devices/pci<dom:bus>/<bridges...>/<bdf>
//        {vendor,device,class,numa_node,local_cpulist,config}
//   sys/class/infiniband/<hca>/{device,ports/<p>/{link_layer,rate,state}}
//   sys/class/net/<if>/{device,type,speed,operstate}
//
// The PCI path of a device (its root complex and the bridges above it) gives
// the nvidia-smi link level between any two devices, the same rules
// nvidia-smi and NCCL use: same bridge -> PIX, deeper common bridge -> PXB,
// same root complex -> PHB, same NUMA node -> NODE, else SYS. NVLink is not
// visible here; NVML adds it (merge_topology).
//
// ACS: P2P between GPUs below one PCIe switch stays in the switch unless the
// switch's downstream ports have ACS Request/Completion Redirect on, which
// sends it up to the root complex (slow, and a known cause of NCCL hangs).
// The ACS Control register lives in the PCI config space extended
// capability 0x000D; reading past the first 64 bytes of `config` needs root,
// so without root the state is "unknown".
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "core/common/error.h"
#include "parallel/topology/topology_sources.h"

namespace trainrun::topo {

namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return "";
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string read_line(const fs::path& p) {
  std::string s = slurp(p);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

long read_long(const fs::path& p, long fallback, int base = 10) {
  const std::string s = read_line(p);
  if (s.empty()) return fallback;
  try {
    size_t used = 0;
    const long v = std::stol(s, &used, base);
    return used == s.size() ? v : fallback;
  } catch (const std::exception&) {
    return fallback;
  }
}

std::vector<std::string> list_dir(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    out.push_back(it->path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool is_bdf(const std::string& s) {
  static const std::regex re("[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\\.[0-7]");
  return std::regex_match(s, re);
}

// Where a PCI device sits: its root complex ("pci0000:17") and the bridges
// from the root port down to (not including) the device.
struct PciLoc {
  std::string bdf, root_complex;
  std::vector<std::string> chain;
  int numa_node = -1;
};

// Resolves a sysfs link (or path) to the PCI device it is, or sits below
// (a virtio netdev's device is virtio<N> under the PCI function).
bool locate(const fs::path& link, PciLoc* loc) {
  std::error_code ec;
  const fs::path real = fs::canonical(link, ec);
  if (ec) return false;
  std::vector<std::string> parts;
  bool in_devices = false;
  std::string prev;
  for (const auto& part : real) {
    const std::string s = part.string();
    if (in_devices) parts.push_back(s);
    if (prev == "sys" && s == "devices") in_devices = true;
    prev = s;
  }
  if (parts.empty() || parts[0].rfind("pci", 0) != 0) return false;
  loc->root_complex = parts[0];
  std::vector<std::string> bdfs;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (!is_bdf(parts[i])) break;  // below the PCI function (virtio<N>, net/...)
    bdfs.push_back(normalize_bus_id(parts[i]));
  }
  if (bdfs.empty()) return false;
  loc->bdf = bdfs.back();
  bdfs.pop_back();
  loc->chain = bdfs;
  return true;
}

Link pci_link(const PciLoc& a, const PciLoc& b) {
  if (a.root_complex != b.root_complex) return Link{a.numa_node == b.numa_node ? LinkKind::Node : LinkKind::Sys, 0};
  size_t common = 0;
  while (common < a.chain.size() && common < b.chain.size() && a.chain[common] == b.chain[common]) ++common;
  if (common == 0) return Link{LinkKind::PHB, 0};
  const size_t below_a = a.chain.size() - common, below_b = b.chain.size() - common;
  return Link{below_a <= 1 && below_b <= 1 ? LinkKind::PIX : LinkKind::PXB, 0};
}

// lspci's ACSCtl line, from the ACS capability in PCI config space.
PciBridge read_acs(const fs::path& dev_dir, const std::string& bdf) {
  PciBridge b;
  b.pci_bus_id = bdf;
  const std::string cfg = slurp(dev_dir / "config");
  if (cfg.size() <= 64) {
    b.acs_detail = cfg.empty() ? "no config space readable" : "PCI config space past 64 bytes is readable only by root";
    return b;
  }
  if (cfg.size() < 0x104) {
    b.acs = AcsState::Disabled;
    b.acs_detail = "no PCIe extended config space (conventional PCI): no ACS";
    return b;
  }
  auto le = [&](size_t off, int bytes) {
    uint32_t v = 0;
    for (int k = bytes - 1; k >= 0; --k) v = (v << 8) | uint8_t(cfg[off + size_t(k)]);
    return v;
  };
  size_t off = 0x100;
  for (int guard = 0; guard < 128 && off + 8 <= cfg.size(); ++guard) {
    const uint32_t header = le(off, 4);
    if (header == 0 || header == 0xffffffffu) break;
    if ((header & 0xffff) == 0x000d) {
      const uint32_t ctl = le(off + 6, 2);
      static const char* const kBits[] = {"SrcValid", "TransBlk", "ReqRedir", "CmpltRedir",
                                          "UpstreamFwd", "EgressCtrl", "DirectTrans"};
      for (int k = 0; k < 7; ++k) b.acs_detail += std::string(k ? " " : "") + kBits[k] + ((ctl >> k) & 1 ? "+" : "-");
      // Request/Completion Redirect and Egress Control are what push peer
      // traffic up to the root complex.
      b.acs = (ctl & ((1u << 2) | (1u << 3) | (1u << 5))) ? AcsState::Enabled : AcsState::Disabled;
      return b;
    }
    const size_t next = (header >> 20) & 0xffc;
    if (next < 0x100 || next <= off) break;
    off = next;
  }
  b.acs = AcsState::Disabled;
  b.acs_detail = "no ACS capability";
  return b;
}

struct NvidiaId {
  unsigned id;
  const char* name;
  const char* cc;
};
// A few common data-center and workstation parts; others show as their id.
const NvidiaId kNvidiaIds[] = {
    {0x1db1, "Tesla V100-SXM2-16GB", "7.0"},    {0x1db5, "Tesla V100-SXM2-32GB", "7.0"},
    {0x20b0, "NVIDIA A100-SXM4-40GB", "8.0"},   {0x20b2, "NVIDIA A100-SXM4-80GB", "8.0"},
    {0x20b5, "NVIDIA A100 80GB PCIe", "8.0"},   {0x20f1, "NVIDIA A100-PCIE-40GB", "8.0"},
    {0x2204, "NVIDIA GeForce RTX 3090", "8.6"}, {0x2230, "NVIDIA RTX A6000", "8.6"},
    {0x2330, "NVIDIA H100 80GB HBM3", "9.0"},   {0x2331, "NVIDIA H100 PCIe", "9.0"},
    {0x2335, "NVIDIA H200", "9.0"},             {0x2684, "NVIDIA GeForce RTX 4090", "8.9"},
    {0x26b5, "NVIDIA L40", "8.9"},              {0x26b9, "NVIDIA L40S", "8.9"},
};

}  // namespace

std::string nvidia_device_name(unsigned id) {
  for (const NvidiaId& n : kNvidiaIds)
    if (n.id == id) return n.name;
  return "";
}

std::string nvidia_compute_capability(unsigned id) {
  for (const NvidiaId& n : kNvidiaIds)
    if (n.id == id) return n.cc;
  return "";
}

namespace {

void read_numa(const fs::path& sys, Topology& t) {
  const fs::path nodes = sys / "devices/system/node";
  for (const std::string& d : list_dir(nodes)) {
    if (d.size() < 5 || d.compare(0, 4, "node") != 0 || !std::isdigit(static_cast<unsigned char>(d[4]))) continue;
    NumaNode n;
    n.id = std::stoi(d.substr(4));
    n.cpus = parse_cpulist(read_line(nodes / d / "cpulist"));
    // "Node 0 MemTotal:       263834620 kB"
    std::istringstream mi(slurp(nodes / d / "meminfo"));
    for (std::string line; std::getline(mi, line);) {
      const auto p = line.find("MemTotal:");
      if (p != std::string::npos) n.memory_mib = std::atoll(line.c_str() + p + 9) / 1024;
    }
    t.numa_nodes.push_back(n);
  }
  std::sort(t.numa_nodes.begin(), t.numa_nodes.end(), [](auto& a, auto& b) { return a.id < b.id; });
  if (t.numa_nodes.empty()) {
    // Kernels without NUMA support (and some containers) have no node
    // directory: the machine is one node.
    NumaNode n;
    n.cpus = parse_cpulist(read_line(sys / "devices/system/cpu/online"));
    if (!n.cpus.empty()) {
      t.numa_nodes.push_back(n);
      t.notes.push_back("no NUMA information in /sys (devices/system/node): treating the machine as one node");
    }
  }
  for (NumaNode& n : t.numa_nodes) {
    std::set<CpuList> cores;
    for (int c : n.cpus) {
      const std::string s = read_line(sys / ("devices/system/cpu/cpu" + std::to_string(c)) / "topology/thread_siblings_list");
      if (s.empty()) {
        cores.clear();
        break;
      }
      cores.insert(intersect(parse_cpulist(s), n.cpus));
    }
    n.cores.assign(cores.begin(), cores.end());
    std::sort(n.cores.begin(), n.cores.end(), [](auto& a, auto& b) { return a.front() < b.front(); });
  }
}

int64_t parse_ib_rate_mbps(const std::string& rate) {
  // "200 Gb/sec (4X HDR)" / "25 Gb/sec (1X EDR)" / "2.5 Gb/sec (1X SDR)"
  try {
    return int64_t(std::stod(rate) * 1000);
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

Topology read_sysfs_topology(const std::string& root_in) {
  std::string root = root_in.empty() ? "/" : root_in;
  const fs::path sys = fs::path(root) / "sys";
  TR_CHECK(fs::is_directory(sys), "topology: '", sys.string(), "' is not a directory; --sysfs-root must be a directory "
           "that contains sys/ (use / for this machine)");
  Topology t;
  t.sources.push_back("sysfs:" + root);
  t.host = read_line(fs::path(root) / "proc/sys/kernel/hostname");
  read_numa(sys, t);

  // PCI devices: GPUs, NVSwitches and every device's location.
  std::map<std::string, PciLoc> loc_of;
  const fs::path pci = sys / "bus/pci/devices";
  std::vector<PciLoc> gpu_locs;
  for (const std::string& d : list_dir(pci)) {
    PciLoc loc;
    if (!locate(pci / d, &loc)) continue;
    loc.numa_node = int(read_long(pci / d / "numa_node", -1));
    loc_of[loc.bdf] = loc;
    const long vendor = read_long(pci / d / "vendor", 0, 16);
    const long cls = read_long(pci / d / "class", 0, 16);
    if (vendor != 0x10de) continue;
    if ((cls >> 8) == 0x0680) {
      ++t.nvswitch_devices;  // NVSwitch chips show up as "bridge, other"
      continue;
    }
    if ((cls >> 8) != 0x0300 && (cls >> 8) != 0x0302) continue;  // VGA / 3D controller
    const unsigned dev_id = unsigned(read_long(pci / d / "device", 0, 16));
    Gpu g;
    g.index = int(t.gpus.size());
    g.pci_bus_id = loc.bdf;
    g.name = nvidia_device_name(dev_id);
    if (g.name.empty()) {
      std::ostringstream os;
      os << "NVIDIA GPU (device 0x" << std::hex << dev_id << ")";
      g.name = os.str();
    }
    g.compute_capability = nvidia_compute_capability(dev_id);
    g.numa_node = loc.numa_node;
    g.cpus = parse_cpulist(read_line(pci / d / "local_cpulist"));
    g.root_complex = loc.root_complex;
    g.pci_path = loc.chain;
    t.gpus.push_back(g);
    gpu_locs.push_back(loc);
  }
  const size_t G = t.gpus.size();
  t.links.assign(G, std::vector<Link>(G));
  for (size_t i = 0; i < G; ++i)
    for (size_t j = 0; j < G; ++j) t.links[i][j] = i == j ? Link{LinkKind::Self, 0} : pci_link(gpu_locs[i], gpu_locs[j]);
  if (G > 0)
    t.notes.push_back("GPU links from the PCI tree only: /sys does not show NVLink (NVML adds it when loaded)");
  if (t.nvswitch_devices > 0 && G > 0)
    t.notes.push_back(std::to_string(t.nvswitch_devices) + " NVSwitch chips on the PCI bus");

  // Bridges on the GPUs' paths and their ACS state.
  std::set<std::string> bridge_ids;
  for (const Gpu& g : t.gpus) bridge_ids.insert(g.pci_path.begin(), g.pci_path.end());
  for (const std::string& b : bridge_ids) t.bridges.push_back(read_acs(pci / b, b));

  // RDMA NICs (verbs devices), then plain Ethernet interfaces.
  std::vector<PciLoc> nic_locs;
  auto add_nic = [&](Nic n, PciLoc loc) {
    loc.numa_node = int(read_long(pci / loc.bdf / "numa_node", -1));
    n.pci_bus_id = loc.bdf;
    n.numa_node = loc.numa_node;
    for (const PciLoc& g : gpu_locs) n.gpu_links.push_back(pci_link(g, loc));
    t.nics.push_back(n);
    nic_locs.push_back(loc);
  };
  std::set<std::string> rdma_functions;
  const fs::path ib = sys / "class/infiniband";
  for (const std::string& hca : list_dir(ib)) {
    PciLoc loc;
    if (!locate(ib / hca / "device", &loc)) continue;
    Nic n;
    n.name = hca;
    n.kind = NicKind::Rdma;
    const std::vector<std::string> ports = list_dir(ib / hca / "ports");
    if (!ports.empty()) {
      const fs::path port = ib / hca / "ports" / ports.front();
      const std::string layer = read_line(port / "link_layer");
      n.kind = layer == "InfiniBand" ? NicKind::InfiniBand : layer == "Ethernet" ? NicKind::RoCE : NicKind::Rdma;
      n.speed_mbps = parse_ib_rate_mbps(read_line(port / "rate"));
      const std::string state = read_line(port / "state");  // "4: ACTIVE"
      if (!state.empty()) n.state = state.find("ACTIVE") != std::string::npos ? "up" : "down";
    }
    const std::vector<std::string> nets = list_dir(ib / hca / "device/net");
    if (!nets.empty()) n.netdev = nets.front();
    rdma_functions.insert(loc.bdf);
    add_nic(n, loc);
  }
  const fs::path net = sys / "class/net";
  for (const std::string& ifname : list_dir(net)) {
    PciLoc loc;
    // lo, bridges, veth, docker0, bonds: no device link, nothing to place.
    if (!locate(net / ifname / "device", &loc)) continue;
    if (rdma_functions.count(loc.bdf)) continue;  // the netdev of an HCA above
    Nic n;
    n.name = ifname;
    n.netdev = ifname;
    n.kind = read_long(net / ifname / "type", 1) == 32 ? NicKind::Rdma : NicKind::Ethernet;  // 32: IPoIB
    const long speed = read_long(net / ifname / "speed", 0);
    n.speed_mbps = speed > 0 ? speed : 0;
    const std::string oper = read_line(net / ifname / "operstate");
    if (oper == "up" || oper == "down") n.state = oper;
    add_nic(n, loc);
  }
  for (size_t a = 0; a < t.nics.size(); ++a)
    for (size_t b = 0; b < t.nics.size(); ++b)
      t.nics[a].nic_links.push_back(a == b ? Link{LinkKind::Self, 0} : pci_link(nic_locs[a], nic_locs[b]));
  validate_topology(t, "sysfs:" + root);
  return t;
}

namespace {

class SysfsSource : public TopologySource {
 public:
  explicit SysfsSource(std::string root) : root_(std::move(root)) {}
  std::string name() const override { return "sysfs:" + root_; }
  Topology read() override { return read_sysfs_topology(root_); }

 private:
  std::string root_;
};

}  // namespace

std::unique_ptr<TopologySource> make_sysfs_source(const std::string& root) {
  return std::make_unique<SysfsSource>(root);
}

}  // namespace trainrun::topo
