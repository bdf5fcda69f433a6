// Helpers for the topology tests (test_topology.cpp, test_topology_decisions.cpp):
// fixture paths and short ways to read and decide.
#pragma once
#include <catch2/catch.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "parallel/topology/topology.h"
#include "parallel/topology/topology_decide.h"
#include "parallel/topology/topology_sources.h"
#include "tests/support/testutil.h"

namespace trainrun::test {

inline std::string topo_fixture(const std::string& name) {
  return source_dir() + "/tests/fixtures/topology/" + name;
}
inline topo::Topology smi(const std::string& name) { return topo::make_nvidia_smi_source(topo_fixture(name))->read(); }
inline topo::Topology sysfs(const std::string& name) { return topo::read_sysfs_topology(topo_fixture("sysfs/" + name)); }

inline topo::Decisions decide_for(const topo::Topology& t, int nproc = 0, const std::string& backend = "auto") {
  topo::DecisionInputs in;
  in.nproc = nproc;
  in.backend = backend;
  return topo::decide(t, in);
}

// The value a decision gives a variable, or "<unset>".
inline std::string env_of(const topo::Decisions& d, const std::string& name) {
  const topo::EnvSetting* e = d.find_env(name);
  return e ? e->value : "<unset>";
}

// `nvidia-smi topo -m` as we print it reads back as the same links, NICs
// and CPU affinities.
inline void check_printed_matrix_reads_back(const topo::Topology& t) {
  const topo::Topology back = topo::parse_nvidia_smi_topo(topo::format_link_matrix(t), "printed");
  CHECK(back.links == t.links);
  REQUIRE(back.nics.size() == t.nics.size());
  for (size_t n = 0; n < t.nics.size(); ++n) {
    CHECK(back.nics[n].name == t.nics[n].name);
    CHECK(back.nics[n].gpu_links == t.nics[n].gpu_links);
    CHECK(back.nics[n].nic_links == t.nics[n].nic_links);
  }
  for (size_t g = 0; g < t.gpus.size(); ++g) {
    CHECK(back.gpus[g].cpus == t.gpus[g].cpus);
    CHECK(back.gpus[g].numa_node == t.gpus[g].numa_node);
  }
}

inline std::vector<int> gpus_of(const topo::Decisions& d) {
  std::vector<int> out;
  for (const auto& r : d.ranks) out.push_back(r.gpu);
  return out;
}

inline std::string link(const topo::Topology& t, int a, int b) { return topo::link_code(t.links[size_t(a)][size_t(b)]); }

// The error message of f(), or "" when it does not throw.
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace trainrun::test
