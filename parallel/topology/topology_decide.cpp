// Decisions from a topology description. Every function here is pure: the
// description and the inputs in, decisions with reasons out. See
// topology_decide.h for the list; the notes below are about the choices.
#include "parallel/topology/topology_decide.h"
#include "parallel/topology/topology_decide_internal.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

namespace trainrun::topo {

using namespace detail;

namespace {

// ---- rank -> GPU --------------------------------------------------------------------------

// Lower is better: NVLink islands spanned, the worst link between two
// chosen GPUs, NUMA nodes spanned, the sum of all pair distances, then the
// indices themselves (prefer GPU0.. when all else is equal).
std::vector<int> subset_score(const Topology& t, const std::vector<int>& island, const std::vector<int>& s) {
  std::set<int> islands, numa;
  int worst = 0, total = 0;
  for (size_t a = 0; a < s.size(); ++a) {
    islands.insert(island[size_t(s[a])]);
    numa.insert(t.gpus[size_t(s[a])].numa_node);
    for (size_t b = a + 1; b < s.size(); ++b) {
      const int dist = link_distance(t.links[size_t(s[a])][size_t(s[b])]);
      worst = std::max(worst, dist);
      total += dist;
    }
  }
  std::vector<int> score = {int(islands.size()), worst, int(numa.size()), total};
  score.insert(score.end(), s.begin(), s.end());
  return score;
}

// Ranks of one NVLink island stay contiguous, and inside it ranks of one
// NUMA node; groups are ordered by their lowest GPU index, so using every
// GPU of a well-numbered node keeps rank r on GPU r.
std::vector<int> order_gpus(const Topology& t, const std::vector<int>& island, std::vector<int> chosen) {
  std::map<int, int> island_min;
  std::map<std::pair<int, int>, int> numa_min;
  for (int g : chosen) {
    const int is = island[size_t(g)], nn = t.gpus[size_t(g)].numa_node;
    island_min[is] = island_min.count(is) ? std::min(island_min[is], g) : g;
    numa_min[{is, nn}] = numa_min.count({is, nn}) ? std::min(numa_min[{is, nn}], g) : g;
  }
  auto key = [&](int g) {
    const int is = island[size_t(g)];
    return std::make_tuple(island_min[is], numa_min[{is, t.gpus[size_t(g)].numa_node}], g);
  };
  std::sort(chosen.begin(), chosen.end(), [&](int a, int b) { return key(a) < key(b); });
  return chosen;
}

void choose_gpus(const Topology& t, const DecisionInputs& in, Decisions& d) {
  const int G = t.gpu_count(), N = d.nproc;
  const std::vector<int> island = island_of(t);
  std::vector<int> order;
  if (!in.visible_gpus.empty()) {
    for (int g : in.visible_gpus)
      if (g >= 0 && g < G) order.push_back(g);
    if (order.size() != in.visible_gpus.size())
      d.warnings.push_back({"visible_gpus", "CUDA_VISIBLE_DEVICES=" + join(in.visible_gpus) +
                                                " names GPUs this node does not have (it has " + std::to_string(G) +
                                                "); only " + join(order) + " are used"});
    d.gpu_order_reason = "CUDA_VISIBLE_DEVICES is set by the user: rank r uses the r-th GPU it lists";
  }
  if (order.empty() && N >= G) {
    std::vector<int> all(static_cast<size_t>(G));
    std::iota(all.begin(), all.end(), 0);
    order = order_gpus(t, island, all);
    std::vector<int> identity = all;
    d.gpu_order_reason = order == identity
                             ? "one rank per GPU in index order (PCI bus order, as nvidia-smi numbers them)"
                             : "one rank per GPU, reordered so that the ranks of one NVLink island, then of one "
                               "NUMA node, are contiguous (neighbouring ranks talk the most)";
  } else if (order.empty()) {
    // Fewer ranks than GPUs: the best N-subset, by exhaustive search. Nodes
    // have at most 16 GPUs (C(16, 8) = 12870 subsets); the search stops at
    // 20000 so that a description with many more GPUs cannot stall a launch.
    std::vector<int> best, pick(static_cast<size_t>(N));
    std::vector<bool> mask(size_t(G), false);
    std::fill(mask.begin(), mask.begin() + N, true);
    long tries = 0;
    std::vector<int> best_score;
    do {
      pick.clear();
      for (int g = 0; g < G; ++g)
        if (mask[size_t(g)]) pick.push_back(g);
      const std::vector<int> score = subset_score(t, island, pick);
      if (best.empty() || score < best_score) best = pick, best_score = score;
    } while (++tries < 20000 && std::prev_permutation(mask.begin(), mask.end()));
    order = order_gpus(t, island, best);
    int worst = 0;
    for (int a : best)
      for (int b : best)
        if (a != b) worst = std::max(worst, link_distance(t.links[size_t(a)][size_t(b)]));
    std::string worst_code = "X";
    for (int a : best)
      for (int b : best)
        if (a != b && link_distance(t.links[size_t(a)][size_t(b)]) == worst) worst_code = link_code(t.links[size_t(a)][size_t(b)]);
    d.gpu_order_reason = std::to_string(N) + " of " + std::to_string(G) +
                         " GPUs: the set spanning the fewest NVLink islands, with the best worst-case link (" +
                         worst_code + ") and the fewest NUMA nodes";
  }
  if (N > int(order.size()))
    d.warnings.push_back({"more_ranks_than_gpus", std::to_string(N) + " ranks on " + std::to_string(order.size()) +
                                                      " GPUs: ranks share GPUs round-robin, which only makes sense "
                                                      "for debugging; set parallel.nproc_per_node to at most " +
                                                      std::to_string(order.size())});
  for (int r = 0; r < N; ++r) d.ranks.push_back(RankPlacement{r, order[size_t(r) % order.size()], {}, -1});
}

// ---- CPUs and memory -----------------------------------------------------------------------

// The CPUs grouped by physical core. Known from /sys; otherwise guessed from
// the usual Linux numbering, where a node's list is its first hardware
// threads then their SMT siblings ("0-55,112-167"); else one thread a core.
std::vector<CpuList> core_groups(const Topology& t, const CpuList& cpus, bool* guessed) {
  std::vector<CpuList> out;
  size_t covered = 0;
  for (const NumaNode& n : t.numa_nodes)
    for (const CpuList& core : n.cores) {
      CpuList c = intersect(core, cpus);
      if (!c.empty()) covered += c.size(), out.push_back(c);
    }
  if (covered == cpus.size() && !out.empty()) {
    std::sort(out.begin(), out.end());
    return out;
  }
  out.clear();
  std::vector<CpuList> ranges;
  for (size_t i = 0; i < cpus.size(); ++i) {
    if (i == 0 || cpus[i] != cpus[i - 1] + 1) ranges.emplace_back();
    ranges.back().push_back(cpus[i]);
  }
  // Siblings missing at the end (an offline CPU: "64-127,192-254") leave
  // those cores with one thread.
  if (ranges.size() == 2 && ranges[1].size() <= ranges[0].size() && ranges[1].size() > 1) {
    *guessed = true;
    for (size_t i = 0; i < ranges[0].size(); ++i)
      out.push_back(i < ranges[1].size() ? CpuList{ranges[0][i], ranges[1][i]} : CpuList{ranges[0][i]});
    return out;
  }
  for (int c : cpus) out.push_back({c});
  return out;
}

// Splits whole cores among k ranks: exclusive shares while there are enough
// cores, round-robin sharing beyond that.
std::vector<CpuList> split_cores(const std::vector<CpuList>& cores, int k, bool* shared) {
  std::vector<CpuList> out(static_cast<size_t>(k));
  const size_t C = cores.size();
  if (C == 0) return out;
  for (int i = 0; i < k; ++i) {
    CpuList cpus;
    if (C >= size_t(k)) {
      for (size_t c = size_t(i) * C / size_t(k); c < size_t(i + 1) * C / size_t(k); ++c)
        cpus.insert(cpus.end(), cores[c].begin(), cores[c].end());
    } else {
      *shared = true;
      cpus = cores[size_t(i) % C];
    }
    std::sort(cpus.begin(), cpus.end());
    out[size_t(i)] = cpus;
  }
  return out;
}

// Assigns each rank to a group of ranks that share one CPU domain, then
// splits each domain's cores among its ranks.
void split_domains(const Topology& t, Decisions& d, const std::vector<std::pair<std::string, CpuList>>& domain_of,
                   bool* guessed, bool* shared) {
  std::map<std::string, std::vector<int>> members;
  for (size_t r = 0; r < domain_of.size(); ++r)
    if (!domain_of[r].second.empty()) members[domain_of[r].first].push_back(int(r));
  for (const auto& [key, ranks] : members) {
    const CpuList& cpus = domain_of[size_t(ranks[0])].second;
    const auto shares = split_cores(core_groups(t, cpus, guessed), int(ranks.size()), shared);
    for (size_t i = 0; i < ranks.size(); ++i) d.ranks[size_t(ranks[i])].cpus = shares[i];
  }
}

void place_cpus(const Topology& t, const DecisionInputs& in, Decisions& d) {
  if (!in.bind_cpus) {
    d.affinity_reason = "not bound: parallel.cpu_affinity is none, so the OS places the workers";
    d.numa_policy_reason = "the kernel's default (memory on the node that first touches it)";
    return;
  }
  // Every CPU the description knows of (a GPU's CPU Affinity may be all we
  // know: older nvidia-smi prints no NUMA column).
  CpuList all;
  for (const NumaNode& n : t.numa_nodes) all.insert(all.end(), n.cpus.begin(), n.cpus.end());
  for (const Gpu& g : t.gpus) all.insert(all.end(), g.cpus.begin(), g.cpus.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  const CpuList allowed = in.allowed_cpus.empty() ? all : in.allowed_cpus;
  const bool multi_numa = t.numa_nodes.size() >= 2;
  bool guessed = false, shared = false, unbound = false;
  std::vector<std::pair<std::string, CpuList>> domain(d.ranks.size());
  if (d.backend == "cuda") {
    for (size_t r = 0; r < d.ranks.size(); ++r) {
      const Gpu& g = t.gpus[size_t(d.ranks[r].gpu)];
      const NumaNode* node = t.numa(g.numa_node);
      const CpuList local = node ? intersect(node->cpus, allowed) : intersect(g.cpus, allowed);
      if (local.empty()) {
        unbound = true;
        continue;
      }
      domain[r] = {node ? "numa" + std::to_string(node->id) : "cpus" + format_cpulist(g.cpus), local};
      if (node && multi_numa) d.ranks[r].numa_node = node->id;
    }
    split_domains(t, d, domain, &guessed, &shared);
    d.affinity_reason =
        "each rank gets an exclusive share of the cores of its GPU's NUMA node (whole physical cores; ranks on one "
        "node split it): the host side of the job (data, launches, pinned copies) runs next to the GPU's PCIe root "
        "and no two ranks compete for a core";
    if (unbound)
      d.affinity_reason += "; ranks whose GPU's CPUs are unknown (or outside the CPUs this process may use) are not bound";
  } else {
    // CPU backend: ranks over NUMA nodes in proportion to their cores, then
    // cores split inside each node; fewer ranks than nodes get whole nodes.
    std::vector<std::pair<int, CpuList>> nodes;
    for (const NumaNode& n : t.numa_nodes) {
      CpuList c = intersect(n.cpus, allowed);
      if (!c.empty()) nodes.push_back({n.id, c});
    }
    if (nodes.empty() && !allowed.empty()) nodes.push_back({-1, allowed});
    const int N = d.nproc, K = int(nodes.size());
    if (K > 0 && N >= K) {
      size_t total = 0;
      for (auto& n : nodes) total += n.second.size();
      std::vector<int> count(static_cast<size_t>(K));
      std::vector<std::pair<double, int>> frac;
      int given = 0;
      for (int k = 0; k < K; ++k) {
        const double q = double(N) * double(nodes[size_t(k)].second.size()) / double(total);
        count[size_t(k)] = int(q);
        given += int(q);
        frac.push_back({-(q - int(q)), k});
      }
      std::sort(frac.begin(), frac.end());
      for (int i = 0; given < N; ++i, ++given) ++count[size_t(frac[size_t(i) % frac.size()].second)];
      int r = 0;
      for (int k = 0; k < K; ++k)
        for (int i = 0; i < count[size_t(k)]; ++i, ++r) {
          domain[size_t(r)] = {"node" + std::to_string(nodes[size_t(k)].first), nodes[size_t(k)].second};
          if (multi_numa) d.ranks[size_t(r)].numa_node = nodes[size_t(k)].first;
        }
      split_domains(t, d, domain, &guessed, &shared);
      d.affinity_reason = multi_numa ? "CPU backend: ranks spread over the NUMA nodes in proportion to their cores, "
                                       "each with an exclusive share of whole cores of its node"
                                     : "CPU backend: each rank gets an exclusive share of whole cores, so its OpenMP "
                                       "threads never compete with another rank's";
    } else if (K > 0) {
      for (int r = 0; r < N; ++r) {
        CpuList cpus;
        std::vector<int> ids;
        for (int k = 0; k < K; ++k)
          if (k * N / K == r) cpus.insert(cpus.end(), nodes[size_t(k)].second.begin(), nodes[size_t(k)].second.end()), ids.push_back(nodes[size_t(k)].first);
        std::sort(cpus.begin(), cpus.end());
        d.ranks[size_t(r)].cpus = cpus;
        if (multi_numa && ids.size() == 1) d.ranks[size_t(r)].numa_node = ids[0];
      }
      d.affinity_reason = "CPU backend: fewer ranks than NUMA nodes, so each rank gets whole nodes (its OpenMP "
                          "threads use every core it is given)";
    }
  }
  if (guessed)
    d.affinity_reason += "; SMT siblings guessed from the CPU numbering (first threads, then their siblings)";
  if (shared)
    d.warnings.push_back({"cpu_oversubscribed", std::to_string(d.nproc) + " ranks but only " +
                                                    std::to_string(allowed.size()) +
                                                    " CPUs to bind them to: some ranks share a core, and each runs "
                                                    "slower than it would alone"});
  d.numa_policy_reason =
      multi_numa ? "memory preferred on the rank's NUMA node (MPOL_PREFERRED, not bind: a full node spills over "
                   "instead of failing); ranks spanning several nodes keep the kernel's default"
                 : "one NUMA node: nothing to choose (the kernel's default)";
}

// ---- hybrid_shard --------------------------------------------------------------------------

void hybrid_group(const Topology& t, Decisions& d) {
  d.hybrid_shard_group = d.nproc;
  if (d.backend != "cuda") {
    d.hybrid_shard_reason = "CPU backend: the node (shared memory) is the fastest domain, so shard over its ranks";
    return;
  }
  const std::vector<int> island = island_of(t);
  // Consecutive runs of ranks in one island.
  std::vector<int> runs;
  std::vector<int> seen;
  int prev = -1;
  bool contiguous = true, any_nvlink = false;
  for (const RankPlacement& r : d.ranks) {
    const int is = island[size_t(r.gpu)];
    if (is != prev) {
      if (std::find(seen.begin(), seen.end(), is) != seen.end()) contiguous = false;
      seen.push_back(is);
      runs.push_back(0);
      prev = is;
    }
    ++runs.back();
  }
  for (size_t i = 0; i < runs.size(); ++i) any_nvlink = any_nvlink || runs[i] > 1;
  if (!any_nvlink) {
    d.hybrid_shard_reason = "no NVLink between the GPUs in use: the node is the shard group (ranks per node)";
    return;
  }
  const bool equal = std::all_of(runs.begin(), runs.end(), [&](int n) { return n == runs[0]; });
  if (runs.size() == 1) {
    d.hybrid_shard_reason = "all " + std::to_string(d.nproc) +
                            " ranks are one NVLink island" + (t.nvswitch ? " (NVSwitch)" : "") +
                            ": shard across it, replicate across nodes";
  } else if (contiguous && equal && d.nproc % runs[0] == 0) {
    d.hybrid_shard_group = runs[0];
    d.hybrid_shard_reason = "the NVLink island: " + std::to_string(runs.size()) + " islands of " +
                            std::to_string(runs[0]) +
                            " GPUs; sharding stays on NVLink, replication (one all-reduce per step) crosses PCIe";
  } else {
    d.hybrid_shard_reason = "NVLink islands of unequal size (" + join(runs) +
                            " ranks) cannot be equal shard groups: the node is the shard group";
  }
}

}  // namespace

const EnvSetting* Decisions::find_env(const std::string& name) const {
  for (const EnvSetting& e : env)
    if (e.name == name) return &e;
  return nullptr;
}

bool Decisions::has_warning(const std::string& code) const {
  return std::any_of(warnings.begin(), warnings.end(), [&](const TopologyWarning& w) { return w.code == code; });
}

Decisions decide(const Topology& t, const DecisionInputs& in) {
  Decisions d;
  const int G = t.gpu_count();
  // The GPUs CUDA will show the workers: every one, the user's
  // CUDA_VISIBLE_DEVICES that exist, or none when it hides them all.
  int usable = G;
  if (in.no_visible_gpus)
    usable = 0;
  else if (!in.visible_gpus.empty())
    usable = int(std::count_if(in.visible_gpus.begin(), in.visible_gpus.end(), [&](int g) { return g >= 0 && g < G; }));
  const bool want_cuda = in.backend == "cuda" || (in.backend == "auto" && usable > 0);
  d.backend = want_cuda && usable > 0 ? "cuda" : "cpu";
  if (want_cuda && usable == 0)
    d.warnings.push_back({"no_gpus", std::string("backend: cuda was requested but ") +
                                         (G > 0 ? "CUDA_VISIBLE_DEVICES hides every GPU" : "no GPUs were found") +
                                         "; placing ranks as for the CPU backend"});
  d.nproc = in.nproc > 0 ? in.nproc : d.backend == "cuda" ? usable : 1;
  if (d.backend == "cuda") {
    choose_gpus(t, in, d);
  } else {
    for (int r = 0; r < d.nproc; ++r) d.ranks.push_back(RankPlacement{r, -1, {}, -1});
    d.gpu_order_reason = G == 0                ? "no GPUs: every rank runs on the CPU backend"
                         : in.no_visible_gpus ? "CUDA_VISIBLE_DEVICES hides every GPU: every rank runs on the CPU backend"
                                              : "CPU backend: GPUs are not used";
  }
  place_cpus(t, in, d);
  if (d.backend == "cuda") nccl_env(t, d);
  hybrid_group(t, d);
  warn(t, d);
  return d;
}

std::vector<EnvChoice> plan_worker_env(const std::vector<EnvSetting>& decided,
                                       const std::function<const char*(const std::string&)>& lookup) {
  std::vector<EnvChoice> out;
  for (const EnvSetting& e : decided) {
    EnvChoice c{e.name, e.value, e.reason, false, ""};
    const char* user = lookup(e.name);
    if (user) c.user_set = true, c.user_value = user;
    out.push_back(c);
  }
  return out;
}

}  // namespace trainrun::topo
