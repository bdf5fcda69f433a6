// Detection: run the sources in order of trust and merge what they found.
//
// On a live machine /sys is the base (it always exists and knows NUMA, the
// PCI tree, NICs and ACS) and NVML fills in what /sys cannot see: GPU names
// and memory, and NVLink. A saved description (`--topology FILE`,
// parallel.topology_file) replaces detection altogether: it is how a user
// corrects a machine we misread, and how tests describe machines we do not
// have.
#include <unistd.h>

#include <algorithm>

#include "core/common/error.h"
#include "parallel/topology/topology_sources.h"

namespace trainrun::topo {

namespace {

class FileSource : public TopologySource {
 public:
  explicit FileSource(std::string path) : path_(std::move(path)) {}
  std::string name() const override { return "file:" + path_; }
  Topology read() override { return load_topology(path_); }

 private:
  std::string path_;
};

}  // namespace

std::unique_ptr<TopologySource> make_file_source(const std::string& path) {
  return std::make_unique<FileSource>(path);
}

void merge_topology(Topology& base, const Topology& extra) {
  base.sources.insert(base.sources.end(), extra.sources.begin(), extra.sources.end());
  base.notes.insert(base.notes.end(), extra.notes.begin(), extra.notes.end());
  if (base.host.empty()) base.host = extra.host;
  if (base.numa_nodes.empty()) base.numa_nodes = extra.numa_nodes;
  base.nvswitch = base.nvswitch || extra.nvswitch;
  base.nvswitch_devices = std::max(base.nvswitch_devices, extra.nvswitch_devices);

  if (base.gpus.empty() && !extra.gpus.empty()) {
    // /sys saw no GPUs (a container without the PCI tree) but NVML did:
    // take them; NIC distances to them are then unknown.
    base.gpus = extra.gpus;
    base.links = extra.links;
    for (Nic& n : base.nics) n.gpu_links.assign(base.gpus.size(), Link{});
  } else if (!extra.gpus.empty()) {
    // Match by PCI bus id; index i of extra -> index of base.
    std::vector<int> map(extra.gpus.size(), -1);
    for (size_t e = 0; e < extra.gpus.size(); ++e)
      for (size_t b = 0; b < base.gpus.size(); ++b)
        if (!extra.gpus[e].pci_bus_id.empty() &&
            normalize_bus_id(extra.gpus[e].pci_bus_id) == normalize_bus_id(base.gpus[b].pci_bus_id))
          map[e] = int(b);
    for (size_t e = 0; e < extra.gpus.size(); ++e) {
      if (map[e] < 0) {
        base.notes.push_back("GPU " + extra.gpus[e].pci_bus_id + " (" + extra.sources.front() +
                             ") was not found in the base description; ignored");
        continue;
      }
      Gpu& g = base.gpus[size_t(map[e])];
      const Gpu& x = extra.gpus[e];
      // NVML's names are the driver's ("NVIDIA H100 80GB HBM3"): better than
      // a PCI-id table.
      if (!x.name.empty()) g.name = x.name;
      if (g.uuid.empty()) g.uuid = x.uuid;
      if (g.memory_mib == 0) g.memory_mib = x.memory_mib;
      if (g.compute_capability.empty()) g.compute_capability = x.compute_capability;
      if (g.numa_node < 0) g.numa_node = x.numa_node;
      if (g.cpus.empty()) g.cpus = x.cpus;
    }
    for (size_t a = 0; a < extra.gpus.size(); ++a)
      for (size_t b = 0; b < extra.gpus.size(); ++b) {
        if (map[a] < 0 || map[b] < 0 || a == b) continue;
        const Link& x = extra.links[a][b];
        Link& l = base.links[size_t(map[a])][size_t(map[b])];
        if (x.kind == LinkKind::NVLink || l.kind == LinkKind::Unknown) l = x;
      }
  }
  bool added_nic = false;
  for (const Nic& n : extra.nics) {
    const bool known = std::any_of(base.nics.begin(), base.nics.end(), [&](const Nic& b) { return b.name == n.name; });
    if (!known && n.gpu_links.size() == base.gpus.size()) base.nics.push_back(n), added_nic = true;
  }
  if (added_nic)  // distances between NICs from different sources are unknown
    for (Nic& n : base.nics) n.nic_links.clear();
  if (base.bridges.empty()) base.bridges = extra.bridges;
  if (base.p2p.empty() && extra.p2p.size() == base.gpus.size()) {
    base.p2p = extra.p2p;
    base.p2p_source = extra.p2p_source;
  }
}

Topology detect_topology(std::vector<std::unique_ptr<TopologySource>> sources) {
  TR_CHECK(!sources.empty(), "topology: no source to detect from");
  Topology t = sources.front()->read();
  for (size_t i = 1; i < sources.size(); ++i) merge_topology(t, sources[i]->read());
  validate_topology(t, "the detected topology");
  return t;
}

Topology detect_local_topology(const std::string& sysfs_root) {
  std::vector<std::unique_ptr<TopologySource>> sources;
  sources.push_back(make_sysfs_source(sysfs_root));
  sources.push_back(make_nvml_source());
  Topology t = detect_topology(std::move(sources));
  const PeerProbe probe = t.gpu_count() > 1 ? probe_cuda_peer_access(t.gpus) : PeerProbe{};
  if (probe.ran && probe.ok.size() == t.gpus.size()) {
    t.p2p = probe.ok;
    t.p2p_source = "cuda";
  } else if (t.gpu_count() > 1) {
    t.notes.push_back("CUDA peer probe: " + probe.why);
  }
  if (t.host.empty()) {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) == 0) t.host = buf;
  }
  return t;
}

}  // namespace trainrun::topo
