// Decisions, part two: the NCCL environment and the warnings. Pure
// functions of the description, like the rest of topology_decide.h.
//
// NCCL is left to its own defaults unless the topology gives a reason: it
// tunes itself well, and every forced knob is one more thing that goes stale
// when the hardware changes. What we do set: NVLS on NVSwitch Hopper nodes,
// P2P over NVLink only when every pair has it, P2P off only when a probe
// saw it broken, exact NIC names, the socket interface and cross-NIC when
// no NIC is near a GPU.
#include <algorithm>
#include <cctype>
#include <map>
#include <regex>
#include <set>

#include "parallel/topology/topology_decide_internal.h"

namespace trainrun::topo::detail {

namespace {

bool hopper_or_newer(const Topology& t, int g, std::string* how) {
  const Gpu& gpu = t.gpus[size_t(g)];
  if (!gpu.compute_capability.empty()) {
    *how = "compute capability " + gpu.compute_capability;
    return std::atoi(gpu.compute_capability.c_str()) >= 9;
  }
  static const std::regex hopper("(H100|H200|H800|H20\\b|GH200|B100|B200|GB200)");
  if (!gpu.name.empty()) {
    *how = gpu.name;
    return std::regex_search(gpu.name, hopper);
  }
  // Name unknown (nvidia-smi text): NVLink 4 gives a Hopper GPU 18 links,
  // which is what an NVSwitch pair shows; A100 shows 12.
  for (int h = 0; h < t.gpu_count(); ++h)
    if (h != g && t.links[size_t(g)][size_t(h)].kind == LinkKind::NVLink) {
      const int n = t.links[size_t(g)][size_t(h)].nvlinks;
      *how = "model inferred from NV" + std::to_string(n) + " through NVSwitch: Hopper has 18 NVLinks per GPU, A100 12";
      return t.nvswitch && n >= 18;
    }
  *how = "model unknown";
  return false;
}

// nvidia-smi 525+ heads NIC columns NIC<n> and maps them to devices in a
// "NIC Legend"; a paste without the legend leaves only that placeholder,
// which is no HCA's name.
bool placeholder_nic_name(const std::string& name) {
  return name.size() > 3 && name.compare(0, 3, "NIC") == 0 &&
         std::all_of(name.begin() + 3, name.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

// Each used GPU's closest RDMA NICs (that are not down).
std::map<int, std::vector<int>> nearest_rdma(const Topology& t, const std::vector<int>& used) {
  std::map<int, std::vector<int>> out;
  for (int g : used) {
    int best = 1 << 30;
    for (size_t n = 0; n < t.nics.size(); ++n)
      if (is_rdma(t.nics[n].kind) && t.nics[n].state != "down")
        best = std::min(best, link_distance(t.nics[n].gpu_links[size_t(g)]));
    for (size_t n = 0; n < t.nics.size(); ++n)
      if (is_rdma(t.nics[n].kind) && t.nics[n].state != "down" &&
          link_distance(t.nics[n].gpu_links[size_t(g)]) == best)
        out[g].push_back(int(n));
  }
  return out;
}

}  // namespace

// ---- NCCL ------------------------------------------------------------------------------------

void nccl_env(const Topology& t, Decisions& d) {
  const std::vector<int> used = used_gpus(d);
  auto set = [&](const std::string& n, const std::string& v, const std::string& why) { d.env.push_back({n, v, why}); };
  auto keep = [&](const std::string& n, const std::string& why) { d.kept.push_back({n, "", why}); };

  // Which physical GPUs the ranks see, in rank order.
  std::vector<int> order;
  for (const RankPlacement& r : d.ranks)
    if (std::find(order.begin(), order.end(), r.gpu) == order.end()) order.push_back(r.gpu);
  set("CUDA_DEVICE_ORDER", "PCI_BUS_ID",
      "GPU indices here are nvidia-smi's (PCI bus order); CUDA's default order is fastest-first");
  set("CUDA_VISIBLE_DEVICES", join(order),
      "the GPUs chosen above, in rank order: each worker uses device LOCAL_RANK of this list");

  bool all_nvlink = used.size() >= 2, any_nvlink = false;
  for (int a : used)
    for (int b : used) {
      if (a == b) continue;
      const bool nv = t.links[size_t(a)][size_t(b)].kind == LinkKind::NVLink;
      all_nvlink = all_nvlink && nv;
      any_nvlink = any_nvlink || nv;
    }

  // NVLink SHARP: all-reduce computed in the NVSwitch (NVSwitch gen 3, Hopper+).
  if (used.size() >= 2 && t.nvswitch) {
    std::string how;
    if (hopper_or_newer(t, used[0], &how))
      set("NCCL_NVLS_ENABLE", "1",
          "NVSwitch with Hopper-class GPUs (" + how + "): NVLink SHARP reduces in the switch, which frees SMs and "
          "raises all-reduce bandwidth. NCCL enables it by itself when the driver and fabric manager support it; "
          "set explicitly so the choice is recorded, and a user's 0 still wins");
    else
      keep("NCCL_NVLS_ENABLE", "NVLink SHARP needs third-generation NVSwitch and Hopper GPUs (" + how + ")");
  }

  // P2P: disabled only on evidence that it is broken.
  std::vector<std::string> broken;
  if (!t.p2p.empty())
    for (int a : used)
      for (int b : used)
        if (a < b && (t.p2p[size_t(a)][size_t(b)] == 0 || t.p2p[size_t(b)][size_t(a)] == 0))
          broken.push_back("GPU" + std::to_string(a) + "-GPU" + std::to_string(b));
  if (!broken.empty())
    set("NCCL_P2P_DISABLE", "1",
        "the " + t.p2p_source + " peer probe found P2P broken between " + join(broken, ", ") +
            ": NCCL would hang or corrupt data over it; traffic goes through host memory instead");
  else if (all_nvlink)
    set("NCCL_P2P_LEVEL", "NVL",
        "every pair of GPUs in use has NVLink: P2P over NVLink only, never over a PCIe path");
  else
    keep("NCCL_P2P_LEVEL",
         std::string(any_nvlink ? "NVLink pairs use NVLink P2P; " : "") +
             "NCCL's default (P2P within a PCIe switch tree, through host memory beyond) fits a PCIe node" +
             (t.p2p.empty() ? "; P2P was not probed, so it is not disabled" : "; the peer probe found P2P working"));

  keep("NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS",
       "NCCL sizes its channels from the topology it detects itself; forcing a count only pays off once measured "
       "(trainrun bench comm)");

  // NICs for inter-node traffic.
  const auto near = nearest_rdma(t, used);
  std::vector<std::string> hcas;
  std::vector<std::string> per_gpu;
  for (int g : used) {
    if (!near.count(g)) continue;
    std::vector<std::string> names;
    for (int n : near.at(g)) {
      names.push_back(t.nics[size_t(n)].name);
      if (std::find(hcas.begin(), hcas.end(), t.nics[size_t(n)].name) == hcas.end()) hcas.push_back(t.nics[size_t(n)].name);
    }
    per_gpu.push_back("GPU" + std::to_string(g) + "->" + join(names, "+") + " (" +
                      link_code(t.nics[size_t(near.at(g)[0])].gpu_links[size_t(g)]) + ")");
  }
  std::vector<std::string> unnamed;
  for (const std::string& h : hcas)
    if (placeholder_nic_name(h)) unnamed.push_back(h);
  if (!unnamed.empty()) {
    keep("NCCL_IB_HCA", "the RDMA NICs nearest the GPUs in use are " + join(per_gpu, ", ") +
                            ", but the nvidia-smi text names them only " + join(unnamed, ", ") +
                            " (no \"NIC Legend\" maps them to devices such as mlx5_0), so NCCL picks HCAs itself; "
                            "include the NIC Legend, or run `trainrun topo` on the node");
  } else if (!hcas.empty()) {
    std::vector<std::string> left_out;
    for (const Nic& n : t.nics)
      if (is_rdma(n.kind) && std::find(hcas.begin(), hcas.end(), n.name) == hcas.end()) left_out.push_back(n.name);
    set("NCCL_IB_HCA", "=" + join(hcas),
        "the RDMA NICs nearest the GPUs in use: " + join(per_gpu, ", ") +
            (left_out.empty() ? "" : "; left out (no GPU's nearest, e.g. storage): " + join(left_out, ", ")) +
            "; '=' makes NCCL match names exactly (mlx5_1 would otherwise also match mlx5_10)");
  } else {
    keep("NCCL_IB_HCA", "no InfiniBand/RoCE NIC: NCCL uses TCP sockets between nodes");
  }

  // The socket interface (bootstrap, and TCP traffic without RDMA): the
  // fastest Ethernet interface that is up, else an RDMA NIC's IP interface.
  const Nic* sock = nullptr;
  for (const Nic& n : t.nics) {
    if (n.netdev.empty() || n.state == "down") continue;
    auto rank_of = [&](const Nic& x) {
      const int g0 = used.empty() ? -1 : used[0];
      return std::make_tuple(x.kind == NicKind::Ethernet ? 0 : 1, -x.speed_mbps,
                             g0 >= 0 ? link_distance(x.gpu_links[size_t(g0)]) : 0);
    };
    if (!sock || rank_of(n) < rank_of(*sock)) sock = &n;
  }
  if (sock)
    set("NCCL_SOCKET_IFNAME", "=" + sock->netdev,
        (sock->kind == NicKind::Ethernet ? "the fastest Ethernet interface that is up (" : "the IP interface of RDMA NIC " + sock->name + " (") +
            (sock->speed_mbps ? std::to_string(sock->speed_mbps / 1000) + " Gb/s" : "speed unknown") +
            "); NCCL's own guess may pick a docker or virtual bridge");
  else
    keep("NCCL_SOCKET_IFNAME", "no physical network interface found; NCCL picks one (it skips lo and docker*)");

  // Rails: with a NIC next to every GPU the fabric is usually rail-aligned,
  // which NCCL's default (2: same NIC when it can) already respects.
  int rdma = 0;
  for (const Nic& n : t.nics) rdma += is_rdma(n.kind) ? 1 : 0;
  if (rdma >= 2 && !near.empty()) {
    size_t close = 0;
    for (const auto& [g, ns] : near)
      close += link_distance(t.nics[size_t(ns[0])].gpu_links[size_t(g)]) <= link_distance(Link{LinkKind::PXB, 0});
    if (close == near.size())
      keep("NCCL_CROSS_NIC", "each GPU has its own NIC within a PCIe switch (a rail layout): NCCL's default (2) "
                             "keeps a ring on one rail when it can");
    else if (close == 0)
      set("NCCL_CROSS_NIC", "1",
          "no NIC is within a PCIe switch of any GPU in use, so keeping rings on one NIC per rail buys nothing; "
          "let NCCL use any NIC");
    else
      keep("NCCL_CROSS_NIC", "some GPUs have a NIC within a PCIe switch and some do not: NCCL's default (2) "
                             "weighs rails against distance ring by ring");
  }
}

// ---- warnings ---------------------------------------------------------------------------------

void warn(const Topology& t, Decisions& d) {
  const std::vector<int> used = used_gpus(d);
  auto add = [&](const char* code, const std::string& msg) { d.warnings.push_back({code, msg}); };
  // ACS: bridges below the common ancestor of two GPUs, on either side.
  std::map<std::string, std::set<std::string>> acs_on, acs_unknown;
  for (int a : used)
    for (int b : used) {
      const Gpu& ga = t.gpus[size_t(a)];
      const Gpu& gb = t.gpus[size_t(b)];
      if (a >= b || ga.root_complex.empty() || ga.root_complex != gb.root_complex) continue;
      size_t common = 0;
      while (common < ga.pci_path.size() && common < gb.pci_path.size() && ga.pci_path[common] == gb.pci_path[common])
        ++common;
      if (common == 0) continue;  // they meet at the root complex: P2P goes through it anyway
      const std::string pair = "GPU" + std::to_string(a) + "-GPU" + std::to_string(b);
      for (const Gpu* g : {&ga, &gb})
        for (size_t k = common; k < g->pci_path.size(); ++k) {
          const PciBridge* br = t.bridge(g->pci_path[k]);
          if (br && br->acs == AcsState::Enabled) acs_on[g->pci_path[k]].insert(pair);
          else if (!br || br->acs == AcsState::Unknown) acs_unknown[g->pci_path[k]].insert(pair);
        }
    }
  auto describe = [](const std::map<std::string, std::set<std::string>>& m) {
    std::vector<std::string> parts;
    for (const auto& [bdf, pairs] : m) parts.push_back(bdf + " (" + join(std::vector<std::string>(pairs.begin(), pairs.end()), ", ") + ")");
    return join(parts, "; ");
  };
  if (!acs_on.empty())
    add("acs", "PCIe ACS is enabled on bridges between GPUs: " + describe(acs_on) +
                   ". Peer-to-peer traffic is redirected up to the CPU root complex: slow, and a known cause of NCCL "
                   "hangs. Disable ACS on them (as root: setpci -s <bridge> ECAP_ACS+0x6.w=0000, or in the BIOS) "
                   "unless VMs need it for device isolation");
  if (!acs_unknown.empty())
    add("acs_unknown", "the ACS state of bridges between GPUs is unknown: " + describe(acs_unknown) +
                           ". Reading PCI config space needs root: run `trainrun topo` as root, or check "
                           "`sudo lspci -vvv | grep ACSCtl` for ReqRedir+/CmpltRedir+");

  // NVLink.
  if (used.size() >= 2) {
    const auto islands = nvlink_islands(t);
    std::vector<std::string> in_use;
    for (const auto& is : islands) {
      std::vector<int> u;
      for (int g : is)
        if (std::find(used.begin(), used.end(), g) != used.end()) u.push_back(g);
      if (!u.empty()) in_use.push_back("{" + join(u) + "}");
    }
    if (in_use.size() == used.size()) {
      if (t.nvswitch_devices > 0)
        add("nvlink_unknown", std::to_string(t.nvswitch_devices) +
                                  " NVSwitch chips are on the PCI bus but the NVLink state is unknown (NVML did not "
                                  "load); the decisions assume PCIe only. Check the driver with `nvidia-smi topo -m`");
      else
        add("no_nvlink", "no NVLink between the " + std::to_string(used.size()) +
                             " GPUs in use: collectives run over PCIe; expect ~10x lower all-reduce bandwidth than "
                             "over NVLink (e.g. ~20 GB/s vs ~200+ GB/s bus bandwidth)");
    } else if (in_use.size() > 1) {
      add("nvlink_partial", "the GPUs in use form " + std::to_string(in_use.size()) + " NVLink islands " +
                                join(in_use, " ") +
                                ": traffic between islands goes over PCIe, ~10x slower than over NVLink");
    }
  }

  // Sockets: GPUs that talk across the CPU interconnect without NVLink.
  std::vector<std::string> sys_pairs;
  for (int a : used)
    for (int b : used)
      if (a < b && t.links[size_t(a)][size_t(b)].kind == LinkKind::Sys) {
        // nvidia-smi also reports SYS between GPUs of one NUMA node on some
        // boards; those pairs are not split across sockets.
        const int na = t.gpus[size_t(a)].numa_node, nb = t.gpus[size_t(b)].numa_node;
        if (na < 0 || nb < 0 || na != nb) sys_pairs.push_back("GPU" + std::to_string(a) + "-GPU" + std::to_string(b));
      }
  if (!sys_pairs.empty()) {
    std::map<int, std::vector<int>> by_node;
    for (int g : used) by_node[t.gpus[size_t(g)].numa_node].push_back(g);
    std::vector<std::string> sides;
    for (const auto& [node, gs] : by_node)
      sides.push_back((node >= 0 ? "NUMA " + std::to_string(node) : std::string("NUMA unknown")) + ": GPUs " + join(gs));
    add("split_sockets", "the GPUs in use are split across CPU sockets (" + join(sides, "; ") + "): " +
                             std::to_string(sys_pairs.size()) +
                             " GPU pairs talk across the CPU interconnect (SYS), the slowest path; "
                             "with fewer ranks, keep them on one socket");
  }

  // NICs beyond a PCIe switch: GPUDirect RDMA is off by default (NCCL_NET_GDR_LEVEL=PXB).
  const auto near = nearest_rdma(t, used);
  std::vector<std::string> far;
  for (const auto& [g, ns] : near) {
    const Link& l = t.nics[size_t(ns[0])].gpu_links[size_t(g)];
    if (link_distance(l) > link_distance(Link{LinkKind::PXB, 0}))
      far.push_back("GPU" + std::to_string(g) + " (nearest " + t.nics[size_t(ns[0])].name + ": " + link_code(l) + ")");
  }
  if (!far.empty())
    add("nic_far", "no RDMA NIC within a PCIe switch of " + join(far, ", ") +
                       ": GPUDirect RDMA is off at that distance, so inter-node traffic of those GPUs is staged "
                       "through host memory (lower bandwidth, more CPU); put a NIC next to each GPU pair");

  std::set<std::string> models;
  for (int g : used)
    if (!t.gpus[size_t(g)].name.empty()) models.insert(t.gpus[size_t(g)].name);
  if (models.size() > 1)
    add("mixed_gpus", "mixed GPU models in use (" + join(std::vector<std::string>(models.begin(), models.end()), ", ") +
                          "): every step waits for the slowest GPU, and their memory sizes may differ");
}

}  // namespace trainrun::topo::detail
