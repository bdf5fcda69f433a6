// Helpers shared by the decision files (topology_decide.cpp: ranks, CPUs,
// hybrid_shard; topology_advice.cpp: NCCL environment and warnings). Not a
// public interface.
#pragma once
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel/topology/topology_decide.h"

namespace trainrun::topo::detail {

template <typename T>
std::string join(const std::vector<T>& v, const std::string& sep = ",") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += sep;
    if constexpr (std::is_same_v<T, std::string>) s += v[i];
    else s += std::to_string(v[i]);
  }
  return s;
}

inline std::vector<int> used_gpus(const Decisions& d) {
  std::vector<int> out;
  for (const RankPlacement& r : d.ranks)
    if (r.gpu >= 0 && std::find(out.begin(), out.end(), r.gpu) == out.end()) out.push_back(r.gpu);
  return out;
}

// NVLink island number of every GPU.
inline std::vector<int> island_of(const Topology& t) {
  std::vector<int> id(size_t(t.gpu_count()), 0);
  const auto islands = nvlink_islands(t);
  for (size_t i = 0; i < islands.size(); ++i)
    for (int g : islands[i]) id[size_t(g)] = int(i);
  return id;
}

// Fill d.env / d.kept (CUDA backend only) and d.warnings.
void nccl_env(const Topology& t, Decisions& d);
void warn(const Topology& t, Decisions& d);

}  // namespace trainrun::topo::detail
