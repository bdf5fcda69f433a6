// Which ranks form tensor-parallel groups on a node, and over which link
// (topology_decide.h). Shared by `trainrun topo --tp`, the agent's start-of-
// job warning and `trainrun plan`'s TP bandwidth, so the three agree.
#include <algorithm>
#include <sstream>

#include "parallel/topology/topology_decide.h"

namespace trainrun::topo {

const char* tp_link_name(TpLinkKind k) {
  switch (k) {
    case TpLinkKind::Single: return "none";
    case TpLinkKind::Host: return "host";
    case TpLinkKind::NVLink: return "NVLink";
    case TpLinkKind::PCIe: return "PCIe";
    case TpLinkKind::CrossNode: return "cross-node";
    case TpLinkKind::Unknown: break;
  }
  return "unknown";
}

namespace {
// A group of this node's `ranks` (those < n; `cross_node`: more of it lives
// on the next node) and the slowest link between its GPUs.
TpGroup link_group(const Topology& t, const Decisions& d, const std::vector<int>& ranks, bool cross_node) {
  TpGroup g;
  for (int r : ranks) {
    g.ranks.push_back(r);
    if (d.backend == "cuda" && d.ranks[size_t(r)].gpu >= 0) g.gpus.push_back(d.ranks[size_t(r)].gpu);
  }
  if (ranks.size() <= 1 && !cross_node) {
    g.kind = TpLinkKind::Single;
  } else if (cross_node) {
    g.kind = TpLinkKind::CrossNode;
  } else if (d.backend != "cuda" || g.gpus.size() != g.ranks.size()) {
    g.kind = TpLinkKind::Host;
  } else {
    g.slowest = Link{LinkKind::Self, 0};
    for (size_t i = 0; i < g.gpus.size(); ++i)
      for (size_t j = i + 1; j < g.gpus.size(); ++j) {
        const int a = g.gpus[i], b = g.gpus[j];
        const Link l = (a < t.gpu_count() && b < t.gpu_count()) ? t.links[size_t(a)][size_t(b)] : Link{};
        if (link_distance(l) > link_distance(g.slowest)) g.slowest = l;
      }
    // Two ranks on one GPU (more ranks than GPUs) share its memory: as good as NVLink.
    g.kind = g.slowest.kind == LinkKind::NVLink || g.slowest.kind == LinkKind::Self ? TpLinkKind::NVLink
             : is_pcie(g.slowest.kind)                                              ? TpLinkKind::PCIe
                                                                                    : TpLinkKind::Unknown;
  }
  return g;
}
}  // namespace

std::vector<TpGroup> tp_groups(const Topology& t, const Decisions& d, int tp) {
  std::vector<TpGroup> out;
  const int n = int(d.ranks.size());
  tp = std::max(1, tp);
  for (int first = 0; first < n; first += tp) {
    std::vector<int> ranks;
    for (int r = first; r < std::min(n, first + tp); ++r) ranks.push_back(r);
    // Consecutive ranks continue on the next node's first ranks.
    TpGroup g = link_group(t, d, ranks, tp > 1 && first + tp > n);
    if (tp == 1) g.kind = TpLinkKind::Single;
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<TpGroup> cp_groups(const Topology& t, const Decisions& d, int cp, int tp) {
  std::vector<TpGroup> out;
  const int n = int(d.ranks.size());
  cp = std::max(1, cp);
  tp = std::max(1, tp);
  // The mesh (parallel/mesh/device_mesh.h): tp innermost, cp next, so a cp
  // group is cp ranks tp apart inside a block of cp x tp consecutive ranks.
  for (int first = 0; first < n; first += cp * tp)
    for (int k = 0; k < tp && first + k < n; ++k) {
      std::vector<int> ranks;
      for (int c = 0; c < cp && first + c * tp + k < n; ++c) ranks.push_back(first + c * tp + k);
      TpGroup g = link_group(t, d, ranks, cp > 1 && first + (cp - 1) * tp + k >= n);
      if (cp == 1) g.kind = TpLinkKind::Single;
      out.push_back(std::move(g));
    }
  return out;
}

namespace {
std::string span(const std::vector<int>& v) {
  if (v.empty()) return "";
  bool consecutive = true;
  for (size_t i = 1; i < v.size(); ++i) consecutive = consecutive && v[i] == v[i - 1] + 1;
  if (consecutive && v.size() > 1) return std::to_string(v.front()) + "-" + std::to_string(v.back());
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}
}  // namespace

std::string describe_tp_group(const TpGroup& g) {
  std::ostringstream os;
  os << "rank" << (g.ranks.size() == 1 ? " " : "s ") << span(g.ranks);
  if (!g.gpus.empty()) {
    os << " (GPU" << (g.gpus.size() == 1 ? " " : "s ");
    for (size_t i = 0; i < g.gpus.size(); ++i) os << (i ? "," : "") << g.gpus[i];
    os << ")";
  }
  os << ": " << tp_link_name(g.kind);
  if (g.kind == TpLinkKind::NVLink || g.kind == TpLinkKind::PCIe)
    if (g.slowest.kind != LinkKind::Self) os << " (" << link_code(g.slowest) << ")";
  if (g.kind == TpLinkKind::CrossNode) os << " (continues on the next node's ranks)";
  return os.str();
}

std::string tp_groups_warning(const Topology& t, const Decisions& d, int tp, bool include_cross_node) {
  const std::vector<TpGroup> groups = tp_groups(t, d, tp);
  std::string bad;
  bool pcie = false, cross = false;
  for (const TpGroup& g : groups) {
    if (g.kind != TpLinkKind::PCIe && !(include_cross_node && g.kind == TpLinkKind::CrossNode)) continue;
    pcie = pcie || g.kind == TpLinkKind::PCIe;
    cross = cross || g.kind == TpLinkKind::CrossNode;
    bad += (bad.empty() ? "" : "; ") + describe_tp_group(g);
  }
  if (bad.empty()) return "";
  // The largest degree below tp whose groups all stay on NVLink (or one host).
  int better = 1;
  for (int c = tp / 2; c >= 2; c /= 2) {
    bool ok = int(d.ranks.size()) % c == 0;
    for (const TpGroup& g : tp_groups(t, d, c)) ok = ok && (g.kind == TpLinkKind::NVLink || g.kind == TpLinkKind::Host);
    if (ok) {
      better = c;
      break;
    }
  }
  std::string islands;
  bool any_nvlink = false;
  for (const auto& isl : nvlink_islands(t)) {
    any_nvlink = any_nvlink || isl.size() > 1;
    islands += (islands.empty() ? "" : ", ") + span(isl);
  }
  if (!any_nvlink) islands.clear();  // islands of one GPU each: nothing to put TP inside
  std::ostringstream os;
  os << "parallel.tensor_parallel " << tp << ": TP group" << (bad.find(';') == std::string::npos ? " " : "s ") << bad
     << ". TP does 4 activation collectives per layer per micro-batch (2 forward, 2 backward, each of "
        "micro_batch x seq_len x n_embd values) between GEMMs, where nothing hides them; over "
     << (pcie && cross ? "PCIe and the network" : pcie ? "PCIe" : "the network")
     << " they run at a fraction of NVLink's bandwidth and the GPUs wait on every one. Put TP inside an NVLink island"
     << (islands.empty() ? " (this node has none: TP over PCIe is all it can do)" : " (islands here: GPUs " + islands + ")")
     << " or lower parallel.tensor_parallel" << (better > 1 ? " to " + std::to_string(better) : std::string(" to 1"))
     << (cross ? "; a degree that divides the ranks per node keeps every group on one node" : "");
  return os.str();
}

}  // namespace trainrun::topo
