// Topology, the description and its sources: nvidia-smi text, /sys trees,
// a fake NVML, saved files; and the `trainrun topo` command. The decisions
// and the agent are in test_topology_decisions.cpp.
//
// Fixtures (tests/fixtures/topology): nvidia-smi outputs in the formats of a
// DGX H100 (tabs and a space-aligned copy), a DGX A100, an 8-GPU PCIe box
// over two sockets, a 4-GPU box with a NIC per GPU, NVLink-bridged pairs and
// a 2-GPU workstation; fake /sys trees (make_sysfs_fixtures.py).
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/support/topology_testutil.h"

using namespace trainrun;
using namespace trainrun::topo;
using namespace trainrun::test;
using Catch::Matchers::Contains;
using json = nlohmann::json;

namespace {

std::string fixture(const std::string& name) { return topo_fixture(name); }

// `text` with line `line` (1-based) replaced.
std::string replace_line(const std::string& text, int line, const std::string& with) {
  std::istringstream in(text);
  std::string out, l;
  for (int n = 1; std::getline(in, l); ++n) out += (n == line ? with : l) + "\n";
  return out;
}

const char* const kSmiFixtures[] = {"dgx_h100.txt",          "dgx_h100_spaces.txt",       "dgx_a100.txt",
                                    "pcie_8gpu_2socket.txt", "pcie_4gpu_nic_per_gpu.txt", "pcie_nvlink_pairs.txt",
                                    "workstation_2gpu.txt"};

}  // namespace

// ---- the description ------------------------------------------------------------------------------

TEST_CASE("topology: link codes and CPU lists", "[topology]") {
  Link l;
  for (const char* code : {"X", "NV1", "NV12", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"}) {
    REQUIRE(parse_link_code(code, &l));
    CHECK(link_code(l) == code);
  }
  REQUIRE(parse_link_code("SOC", &l));  // older nvidia-smi
  CHECK(link_code(l) == "SYS");
  for (const char* bad : {"NV", "NV0", "NVX", "nv4", "PCI", "", "NV123"}) CHECK_FALSE(parse_link_code(bad, &l));
  CHECK(link_distance(Link{LinkKind::NVLink, 18}) < link_distance(Link{LinkKind::NVLink, 4}));
  CHECK(link_distance(Link{LinkKind::NVLink, 1}) < link_distance(Link{LinkKind::PIX, 0}));
  CHECK(link_distance(Link{LinkKind::Node, 0}) < link_distance(Link{LinkKind::Sys, 0}));

  CHECK(parse_cpulist("0-3,8,10-11") == CpuList{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpulist(" 4,0-1\n") == CpuList{0, 1, 4});
  CHECK(parse_cpulist("N/A").empty());
  CHECK(format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11");
  CHECK(format_cpulist(parse_cpulist("0-55,112-167")) == "0-55,112-167");
  CHECK_THAT(error_of([] { parse_cpulist("0-x"); }), Contains("'0-x' is not a CPU list"));
  CHECK_THAT(error_of([] { parse_cpulist("5-2"); }), Contains("runs backwards"));
  CHECK(normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0");
  CHECK(normalize_bus_id("18:00.0") == "0000:18:00.0");
}

TEST_CASE("topology: nvidia-smi DGX H100 with NIC legend and GPU NUMA ID", "[topology]") {
  const Topology t = smi("dgx_h100.txt");
  REQUIRE(t.gpu_count() == 8);
  for (int a = 0; a < 8; ++a)
    for (int b = 0; b < 8; ++b) CHECK(link(t, a, b) == (a == b ? "X" : "NV18"));
  CHECK(t.nvswitch);
  REQUIRE(t.nics.size() == 12);
  CHECK(t.nics[0].name == "mlx5_0");
  CHECK(t.nics[11].name == "mlx5_11");
  CHECK(t.nics[0].kind == NicKind::Rdma);
  CHECK(link_code(t.nics[3].gpu_links[1]) == "PIX");
  CHECK(link_code(t.nics[1].nic_links[2]) == "PIX");  // the dual-port storage card
  CHECK(nearest_gpus(t.nics[9]) == std::vector<int>{5});
  CHECK(format_cpulist(t.gpus[0].cpus) == "0-55,112-167");
  CHECK(t.gpus[3].numa_node == 0);
  CHECK(t.gpus[4].numa_node == 1);
  REQUIRE(t.numa_nodes.size() == 2);
  CHECK(format_cpulist(t.numa_nodes[1].cpus) == "56-111,168-223");
}

TEST_CASE("topology: nvidia-smi tab and space separated copies give one description", "[topology]") {
  json a = topology_to_json(smi("dgx_h100.txt")), b = topology_to_json(smi("dgx_h100_spaces.txt"));
  a.erase("sources");
  b.erase("sources");
  CHECK(a == b);
}

TEST_CASE("topology: nvidia-smi DGX A100 with mlx5 columns and eight NUMA nodes", "[topology]") {
  const Topology t = smi("dgx_a100.txt");
  REQUIRE(t.gpu_count() == 8);
  CHECK(link(t, 0, 7) == "NV12");
  CHECK(t.nvswitch);
  REQUIRE(t.nics.size() == 10);
  CHECK(t.nics[4].name == "mlx5_4");
  CHECK(link_code(t.nics[0].gpu_links[1]) == "PXB");
  CHECK(link_code(t.nics[0].gpu_links[2]) == "SYS");
  CHECK(nearest_gpus(t.nics[4]).size() == 8);  // storage: equally far from all
  CHECK(t.gpus[0].numa_node == 3);
  CHECK(t.numa_nodes.size() == 4);  // only the nodes that hold a GPU are known
}

TEST_CASE("topology: nvidia-smi PCIe boxes and a workstation", "[topology]") {
  const Topology p8 = smi("pcie_8gpu_2socket.txt");
  CHECK(link(p8, 0, 1) == "PIX");
  CHECK(link(p8, 0, 2) == "NODE");
  CHECK(link(p8, 0, 4) == "SYS");
  CHECK_FALSE(p8.nvswitch);
  REQUIRE(p8.nics.size() == 1);
  CHECK(p8.nics[0].name == "mlx5_0");

  const Topology pairs = smi("pcie_nvlink_pairs.txt");
  CHECK(link(pairs, 0, 1) == "NV4");
  CHECK(link(pairs, 1, 2) == "NODE");
  CHECK_FALSE(pairs.nvswitch);  // 4 links to one peer: a bridge, not a switch
  CHECK(nvlink_islands(pairs) == std::vector<std::vector<int>>{{0, 1}, {2, 3}});

  const Topology ws = smi("workstation_2gpu.txt");
  CHECK(link(ws, 0, 1) == "PHB");
  CHECK(ws.numa_nodes.empty());
  CHECK(ws.gpus[1].numa_node == -1);
  CHECK(format_cpulist(ws.gpus[1].cpus) == "0-31");

  const Topology n4 = smi("pcie_4gpu_nic_per_gpu.txt");
  for (int g = 0; g < 4; ++g) CHECK(nearest_gpus(n4.nics[size_t(g)]) == std::vector<int>{g});
}

TEST_CASE("topology: malformed nvidia-smi text is an error naming the file and line", "[topology]") {
  const std::string good = test::read_file(fixture("dgx_a100.txt"));
  auto err = [](const std::string& text) { return error_of([&] { parse_nvidia_smi_topo(text, "topo.txt"); }); };
  CHECK(err(good).empty());
  // Line 4 is GPU2's row; line 1 the header.
  CHECK_THAT(err(replace_line(good, 4, "GPU2\tNV12\tNV12\t X \tNV12")),
             Contains("topo.txt:4: row GPU2 has 4 cells, expected 20 (18 device columns + CPU Affinity, NUMA Affinity"));
  std::string bad_code = good;
  bad_code.replace(bad_code.find("NV12", bad_code.find("\nGPU2\t")), 4, "NVX");
  CHECK_THAT(err(bad_code), Contains("topo.txt:4: row GPU2, column GPU0: unknown link code 'NVX'; expected X, NV<n>"));
  CHECK_THAT(err(replace_line(good, 9, "")), Contains("topo.txt:1: the matrix is not square: 18 columns but 7 rows"));
  CHECK_THAT(err(replace_line(good, 9, "")), Contains("no row for GPU7"));
  std::string asym = good;
  asym.replace(asym.find("PXB", asym.find("\nGPU1\t")), 3, "PIX");
  CHECK_THAT(err(asym), Contains("topo.txt:10: the matrix is not symmetric: GPU1-mlx5_0 is PIX but mlx5_0-GPU1 is PXB"));
  std::string diag = good;
  diag.replace(diag.find(" X ", diag.find("\nGPU3\t")), 3, "NV12");
  CHECK_THAT(err(diag), Contains("topo.txt:5: row GPU3, column GPU3: 'NV12'; X belongs exactly on the diagonal"));
  CHECK_THAT(err(replace_line(good, 2, "GPUX\t X")),
             Contains("topo.txt:2: row 'GPUX' does not match any column"));
  std::string affinity = good;
  affinity.replace(affinity.find("48-63,176-191"), 13, "48-63,x");
  CHECK_THAT(err(affinity), Contains("topo.txt:2: GPU0, CPU Affinity: '48-63,x' is not a CPU list"));
  CHECK_THAT(err("GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-...)\n"),
             Contains("topo.txt: no header line starting with GPU0; expected the output of `nvidia-smi topo -m`"));
  CHECK_THAT(err("\tGPU0\tGPU2\nGPU0\t X \tPIX\nGPU2\tPIX\t X \n"), Contains("topo.txt:1: column GPU2 is out of order"));
  CHECK_THAT(error_of([] { make_nvidia_smi_source("/nonexistent/topo.txt")->read(); }),
             Contains("cannot open '/nonexistent/topo.txt'"));
}

TEST_CASE("topology: the printed matrix reads back as the same links", "[topology]") {
  for (const char* name : kSmiFixtures) {
    INFO(name);
    const Topology t = smi(name);
    check_printed_matrix_reads_back(t);
  }
}

TEST_CASE("topology: a saved description loads back unchanged", "[topology]") {
  test::TempDir dir("topo");
  std::vector<Topology> all;
  for (const char* name : kSmiFixtures) all.push_back(smi(name));
  all.push_back(sysfs("pcie_2socket"));
  all.push_back(sysfs("cpu_only_2numa"));
  for (size_t i = 0; i < all.size(); ++i) {
    INFO(i);
    const std::string path = dir / ("t" + std::to_string(i) + ".json");
    save_topology(all[i], path);
    const Topology back = load_topology(path);
    CHECK(topology_to_json(back) == topology_to_json(all[i]));
    CHECK(json(decisions_to_json(decide_for(back))) == json(decisions_to_json(decide_for(all[i]))));
  }
}

TEST_CASE("topology: malformed description files are errors naming the file and place", "[topology]") {
  const std::string good = topology_to_json(smi("pcie_nvlink_pairs.txt")).dump(2);
  auto err = [](const std::string& text) { return error_of([&] { parse_topology_json(text, "t.json"); }); };
  CHECK(err(good).empty());
  CHECK_THAT(err("{\n  \"format\": \"trainrun-topology\",\n  \"version\": 1,\n  oops\n}"),
             Contains("t.json:4:3: malformed JSON (syntax error"));
  CHECK_THAT(err("{\"format\": \"something-else\", \"version\": 1}"), Contains("t.json: format is 'something-else'"));
  CHECK_THAT(err("{\"format\": \"trainrun-topology\", \"version\": 7}"), Contains("t.json: version 7 is not supported"));
  CHECK_THAT(err("[1, 2]"), Contains("t.json: the top level must be a JSON object"));
  json j = json::parse(good);
  j.erase("links");
  CHECK_THAT(err(j.dump()), Contains("t.json: links is missing"));
  j = json::parse(good);
  j["links"][1][2] = "NV?";
  CHECK_THAT(err(j.dump()), Contains("t.json: links[1][2]: unknown link \"NV?\""));
  j = json::parse(good);
  j["links"][1].erase(3);
  CHECK_THAT(err(j.dump()), Contains("t.json: row GPU1 of the link matrix has 3 entries, expected 4"));
  j = json::parse(good);
  j["links"][0][1] = "PIX";
  CHECK_THAT(err(j.dump()), Contains("t.json: link GPU0-GPU1 is PIX but GPU1-GPU0 is NV4; the matrix must be symmetric"));
  j = json::parse(good);
  j["gpus"][2]["numa_node"] = "zero";
  CHECK_THAT(err(j.dump()), Contains("t.json: gpus[2].numa_node: expected an integer, got \"zero\""));
  j = json::parse(good);
  j["gpus"][0]["cpus"] = "0-";
  CHECK_THAT(err(j.dump()), Contains("t.json: gpus[0].cpus: '0-' is not a CPU list"));
  CHECK_THAT(error_of([] { load_topology("/nonexistent/t.json"); }), Contains("cannot open '/nonexistent/t.json'"));
}

// ---- /sys -----------------------------------------------------------------------------------------

TEST_CASE("topology: sysfs of a two-socket PCIe box", "[topology]") {
  const Topology t = sysfs("pcie_2socket");
  CHECK(t.host == "pcie-lab-01");
  REQUIRE(t.numa_nodes.size() == 2);
  CHECK(format_cpulist(t.numa_nodes[1].cpus) == "4-7,12-15");
  CHECK(t.numa_nodes[0].cores.size() == 4);
  CHECK(t.numa_nodes[0].cores[1] == CpuList{1, 9});
  CHECK(t.numa_nodes[0].memory_mib == 131841236 / 1024);
  REQUIRE(t.gpu_count() == 4);
  CHECK(t.gpus[0].name == "NVIDIA L40S");
  CHECK(t.gpus[3].name == "NVIDIA RTX A6000");  // class 0x0300 (VGA) counts too
  CHECK(t.gpus[0].compute_capability == "8.9");
  CHECK(t.gpus[1].pci_bus_id == "0000:1b:00.0");
  CHECK(t.gpus[1].pci_path == std::vector<std::string>{"0000:17:00.0", "0000:18:00.0", "0000:19:10.0"});
  CHECK(t.gpus[3].numa_node == 1);
  CHECK(format_cpulist(t.gpus[3].cpus) == "4-7,12-15");
  CHECK(link(t, 0, 1) == "PIX");   // one switch
  CHECK(link(t, 0, 2) == "NODE");  // two host bridges, one socket
  CHECK(link(t, 0, 3) == "SYS");
  REQUIRE(t.nics.size() == 2);  // lo, docker0 and the HCA's IPoIB netdev are not NICs of their own
  const Nic& ib = t.nics[0];
  CHECK(ib.name == "mlx5_0");
  CHECK(ib.kind == NicKind::InfiniBand);
  CHECK(ib.speed_mbps == 200000);
  CHECK(ib.state == "up");
  CHECK(ib.netdev == "ibp28s0");
  CHECK(ib.numa_node == 0);
  CHECK(link_code(ib.gpu_links[0]) == "PIX");
  CHECK(link_code(ib.gpu_links[2]) == "NODE");
  CHECK(link_code(ib.gpu_links[3]) == "SYS");
  const Nic& eth = t.nics[1];
  CHECK(eth.name == "ens1f0");
  CHECK(eth.kind == NicKind::Ethernet);
  CHECK(eth.speed_mbps == 10000);
  CHECK(link_code(eth.gpu_links[3]) == "NODE");
  REQUIRE(t.bridge("0000:19:08.0"));
  CHECK(t.bridge("0000:19:08.0")->acs == AcsState::Enabled);
  CHECK_THAT(t.bridge("0000:19:08.0")->acs_detail, Contains("ReqRedir+ CmpltRedir+"));
  CHECK(t.bridge("0000:18:00.0")->acs == AcsState::Disabled);  // no ACS capability
  CHECK(t.bridge("0000:ae:00.0")->acs == AcsState::Disabled);  // capability, all off
  CHECK(t.bridge("0000:17:00.0")->acs == AcsState::Unknown);   // 64 bytes: not root
}

TEST_CASE("topology: sysfs of a CPU-only node and of this machine", "[topology]") {
  const Topology t = sysfs("cpu_only_2numa");
  CHECK(t.gpu_count() == 0);
  REQUIRE(t.numa_nodes.size() == 2);
  CHECK(format_cpulist(t.numa_nodes[0].cpus) == "0-3");
  REQUIRE(t.nics.size() == 1);
  CHECK(t.nics[0].name == "eth0");  // virtio: the PCI function is above the netdev's device
  CHECK(t.nics[0].pci_bus_id == "0000:00:03.0");

  const Topology here = detect_local_topology("/");
  CHECK_FALSE(here.numa_nodes.empty());
  CHECK_FALSE(here.numa_nodes[0].cpus.empty());
  CHECK_THAT(error_of([] { read_sysfs_topology("/nonexistent-root"); }),
             Contains("'/nonexistent-root/sys' is not a directory"));
}

// ---- NVML -----------------------------------------------------------------------------------------

namespace {

// A fake NVML: `gpus` GPUs on buses 0x18, 0x2a, ...; each with `switch_links`
// NVLinks to NVSwitch, or `pair_links` direct links to its neighbour (0-1, 2-3).
struct FakeNvml {
  static inline int gpus = 0, switch_links = 0, pair_links = 0, init_rc = 0;
  static inline const char* name = "NVIDIA H100 80GB HBM3";
  static NvmlDevice handle(unsigned i) { return reinterpret_cast<NvmlDevice>(uintptr_t(i + 1)); }
  static unsigned index(NvmlDevice d) { return unsigned(reinterpret_cast<uintptr_t>(d) - 1); }
  static void bus(unsigned i, NvmlPciInfo* p) {
    std::snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", 0x18 + 0x12 * i);
  }
  static NvmlApi api() {
    NvmlApi a;
    a.init = [] { return init_rc; };
    a.shutdown = [] { return 0; };
    a.error_string = [](int) { return "Driver Not Loaded"; };
    a.device_count = [](unsigned* n) { return *n = unsigned(gpus), 0; };
    a.device_by_index = [](unsigned i, NvmlDevice* d) { return *d = handle(i), 0; };
    a.name = [](NvmlDevice, char* buf, unsigned n) { return std::snprintf(buf, n, "%s", name), 0; };
    a.uuid = [](NvmlDevice d, char* buf, unsigned n) {
      return std::snprintf(buf, n, "GPU-%08u-aaaa-bbbb", index(d)), 0;
    };
    a.pci_info = [](NvmlDevice d, NvmlPciInfo* p) { return bus(index(d), p), 0; };
    a.memory = [](NvmlDevice, NvmlMemory* m) { return m->total = 81559ull << 20, 0; };
    a.cuda_cc = [](NvmlDevice, int* ma, int* mi) { return *ma = 9, *mi = 0, 0; };
    a.common_ancestor = [](NvmlDevice x, NvmlDevice y, int* level) {
      return *level = index(x) / 4 == index(y) / 4 ? 40 : 50, 0;  // NODE within a socket of 4
    };
    a.nvlink_state = [](NvmlDevice, unsigned l, int* on) {
      if (l >= unsigned(switch_links + pair_links)) return 2;  // NVML_ERROR_INVALID_ARGUMENT
      return *on = 1, 0;
    };
    a.nvlink_remote_type = [](NvmlDevice, unsigned, int* type) { return *type = switch_links ? 2 : 0, 0; };
    a.nvlink_remote_pci = [](NvmlDevice d, unsigned, NvmlPciInfo* p) { return bus(index(d) ^ 1u, p), 0; };
    return a;
  }
};

}  // namespace

TEST_CASE("topology: NVML source counts NVLinks and finds NVSwitch", "[topology]") {
  FakeNvml::gpus = 8, FakeNvml::switch_links = 18, FakeNvml::pair_links = 0, FakeNvml::init_rc = 0;
  Topology t = make_nvml_source(FakeNvml::api())->read();
  REQUIRE(t.gpu_count() == 8);
  CHECK(link(t, 0, 7) == "NV18");
  CHECK(t.nvswitch);
  CHECK(t.gpus[1].name == "NVIDIA H100 80GB HBM3");
  CHECK(t.gpus[1].pci_bus_id == "0000:2a:00.0");
  CHECK(t.gpus[1].memory_mib == 81559);
  CHECK(t.gpus[1].compute_capability == "9.0");
  CHECK(t.gpus[1].uuid == "GPU-00000001-aaaa-bbbb");  // what CUDA_VISIBLE_DEVICES=GPU-... names
  CHECK(env_of(decide_for(t), "NCCL_NVLS_ENABLE") == "1");

  FakeNvml::gpus = 4, FakeNvml::switch_links = 0, FakeNvml::pair_links = 4;
  t = make_nvml_source(FakeNvml::api())->read();
  CHECK(link(t, 0, 1) == "NV4");
  CHECK(link(t, 0, 2) == "NODE");  // from the common ancestor
  CHECK_FALSE(t.nvswitch);

  FakeNvml::init_rc = 9;  // NVML_ERROR_DRIVER_NOT_LOADED: a note, not an error
  t = make_nvml_source(FakeNvml::api())->read();
  CHECK(t.gpu_count() == 0);
  REQUIRE(t.notes.size() == 1);
  CHECK_THAT(t.notes[0], Contains("nvmlInit failed: Driver Not Loaded (9)"));

  NvmlApi none;
  std::string why;
  CHECK_FALSE(load_nvml(&none, &why, "libnvidia-ml-not-here.so.1"));
  CHECK_THAT(why, Contains("cannot load libnvidia-ml-not-here.so.1"));
}

namespace {
std::vector<Gpu> two_gpus(const std::string& bus0, const std::string& bus1) {
  std::vector<Gpu> g(2);
  g[0].index = 0;
  g[0].pci_bus_id = bus0;
  g[1].index = 1;
  g[1].pci_bus_id = bus1;
  return g;
}
}  // namespace

TEST_CASE("topology: the CUDA peer probe maps CUDA order to GPUs by bus id and needs both directions",
          "[topology]") {
  const auto gpus = two_gpus("0000:18:00.0", "0000:1b:00.0");
  // CUDA lists the GPUs in the other order (upper-case hex, as the runtime
  // prints it); 1B -> 18 works, 18 -> 1B does not.
  PeerProbe p = parse_peer_probe_output("bus 0000:1B:00.0 0000:18:00.0\n1 1\n0 1\n", gpus);
  REQUIRE(p.ran);
  CHECK(p.ok == std::vector<std::vector<int>>{{1, 0}, {0, 1}});
  p = parse_peer_probe_output("bus 0000:1B:00.0 0000:18:00.0\n1 1\n1 1\n", gpus);
  REQUIRE(p.ran);
  CHECK(p.ok == std::vector<std::vector<int>>{{1, 1}, {1, 1}});
  // Malformed or mismatched output: not ran, with the reason.
  p = parse_peer_probe_output("", gpus);
  CHECK_FALSE(p.ran);
  CHECK_THAT(p.why, Contains("printed nothing"));
  p = parse_peer_probe_output("0 1\n", gpus);
  CHECK_THAT(p.why, Contains("does not start with 'bus'"));
  p = parse_peer_probe_output("bus 0000:18:00.0 0000:1b:00.0\n1 1\n1\n", gpus);
  CHECK_THAT(p.why, Contains("row 1 has 1 values, expected 2"));
  p = parse_peer_probe_output("bus 0000:18:00.0 0000:1b:00.0\n1 1\n", gpus);
  CHECK_THAT(p.why, Contains("printed 1 rows for 2 GPUs"));
  p = parse_peer_probe_output("bus 0000:18:00.0 0000:99:00.0\n1 1\n1 1\n", gpus);
  CHECK_FALSE(p.ran);
  CHECK_THAT(p.why, Contains("GPU 1 (bus id '0000:1b:00.0') is not among the 2 GPUs CUDA sees"));
}

TEST_CASE("topology: the CUDA peer probe runs a child with a timeout and reports its failures", "[topology]") {
  test::TempDir dir("probe");
  const auto gpus = two_gpus("0000:18:00.0", "0000:1b:00.0");
  // Fewer than two GPUs: nothing to run.
  CHECK_THAT(probe_cuda_peer_access({gpus[0]}).why, Contains("fewer than two GPUs"));
  // From a program that is not trainrun (this test), it does not exec itself.
  PeerProbe p = probe_cuda_peer_access(gpus);
  CHECK_FALSE(p.ran);
  CHECK_THAT(p.why, Contains("not probed from this program"));
  // A stand-in for `trainrun probe-p2p`; the child must not see
  // CUDA_VISIBLE_DEVICES (the topology covers every GPU of the node).
  auto script = [&](const std::string& name, const std::string& body) {
    const std::string path = dir / name;
    test::write_file(path, "#!/bin/sh\n" + body);
    REQUIRE(std::system(("chmod +x " + path).c_str()) == 0);
    return path;
  };
  ::setenv("CUDA_VISIBLE_DEVICES", "1", 1);
  p = probe_cuda_peer_access(gpus, script("ok.sh", "[ -z \"${CUDA_VISIBLE_DEVICES+x}\" ] || exit 9\n"
                                                     "echo 'bus 0000:18:00.0 0000:1b:00.0'; echo '1 1'; echo '1 1'\n"));
  INFO(p.why);
  CHECK(p.ran);
  CHECK(p.ok == std::vector<std::vector<int>>{{1, 1}, {1, 1}});
  p = probe_cuda_peer_access(gpus, script("fail.sh", "echo 'no GPU' >&2; exit 3\n"));
  CHECK_FALSE(p.ran);
  CHECK_THAT(p.why, Contains("probe-p2p failed (exit 3)"));
  p = probe_cuda_peer_access(gpus, script("hang.sh", "exec sleep 30\n"), 1);
  CHECK_FALSE(p.ran);
  CHECK_THAT(p.why, Contains("timed out after 1 s") && Contains("NCCL_P2P_DISABLE"));
  p = probe_cuda_peer_access(gpus, dir / "missing");
  CHECK_FALSE(p.ran);
  CHECK_THAT(p.why, Contains("cannot start"));
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);  // as hide_gpus.cpp left it
}

TEST_CASE("topology: NVML fills in what sysfs cannot see", "[topology]") {
  Topology t = sysfs("pcie_2socket");
  Topology nvml;
  nvml.sources = {"nvml"};
  nvml.gpus = t.gpus;
  nvml.gpus[0].name = nvml.gpus[1].name = "NVIDIA L40S (driver name)";
  nvml.gpus[0].memory_mib = 46068;
  nvml.gpus[0].uuid = "GPU-5c2e0000";
  nvml.links = t.links;
  nvml.links[0][1] = nvml.links[1][0] = Link{LinkKind::NVLink, 4};
  nvml.gpus[0].pci_bus_id = "00000000:1A:00.0";  // NVML's spelling
  merge_topology(t, nvml);
  CHECK(link(t, 0, 1) == "NV4");
  CHECK(link(t, 0, 3) == "SYS");  // PCIe levels stay the sysfs ones
  CHECK(t.gpus[0].name == "NVIDIA L40S (driver name)");
  CHECK(t.gpus[0].memory_mib == 46068);
  CHECK(t.gpus[0].uuid == "GPU-5c2e0000");  // sysfs has none
  CHECK(t.sources == std::vector<std::string>{"sysfs:" + fixture("sysfs/pcie_2socket"), "nvml"});
  CHECK_NOTHROW(validate_topology(t, "merged"));
}

// ---- the command and the agent ----------------------------------------------------------------------

TEST_CASE("topology: trainrun topo on this machine describes the CPU-only node", "[topology][cli]") {
  const auto r = test::run_trainrun("topo");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("no GPUs found"));
  CHECK_THAT(r.out, Contains("NUMA nodes:\n  node 0: CPUs "));
  CHECK_THAT(r.out, Contains("decisions for 1 rank (cpu backend)"));
  CHECK_THAT(r.out, Contains("warnings:"));
  const auto j = test::run_trainrun("topo --json --nproc 2");
  REQUIRE(j.exit_code == 0);
  const json out = json::parse(j.out);
  CHECK(out["description"]["gpus"].empty());
  CHECK(out["decisions"]["ranks"].size() == 2);
}

TEST_CASE("topology: trainrun topo prints matrix, placement, decisions and warnings", "[topology][cli]") {
  const auto r = test::run_trainrun("topo --nvidia-smi-topo '" + fixture("pcie_8gpu_2socket.txt") + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tCPU Affinity\tNUMA Affinity\n"));
  CHECK_THAT(r.out, Contains("GPU0\t X \tPIX\tNODE\tNODE\tSYS"));
  CHECK_THAT(r.out, Contains("NIC Legend:\n\n  NIC0: mlx5_0"));
  CHECK_THAT(r.out, Contains("node 1: CPUs 20-39,60-79; GPUs 4,5,6,7"));
  CHECK_THAT(r.out, Contains("decisions for 8 ranks (cuda backend)"));
  CHECK_THAT(r.out, Contains("NCCL_IB_HCA==mlx5_0\n        why: the RDMA NICs nearest"));
  CHECK_THAT(r.out, Contains("[no_nvlink] no NVLink between the 8 GPUs in use"));
  CHECK_THAT(r.out, Contains("~10x lower all-reduce bandwidth"));
  const auto r2 = test::run_trainrun("topo --nproc 2 --nvidia-smi-topo '" + fixture("pcie_8gpu_2socket.txt") + "'");
  CHECK_THAT(r2.out, Contains("decisions for 2 ranks (cuda backend):\n  rank -> GPU: 0->0 1->1"));
}

TEST_CASE("topology: trainrun topo --save and --topology round-trip", "[topology][cli]") {
  test::TempDir dir("topo");
  const std::string saved = dir / "h100.json";
  const auto a = test::run_trainrun("topo --json --save '" + saved + "' --nvidia-smi-topo '" + fixture("dgx_h100.txt") + "'");
  INFO(a.err);
  REQUIRE(a.exit_code == 0);
  CHECK_THAT(a.err, Contains("description saved to " + saved));
  const auto b = test::run_trainrun("topo --json --topology '" + saved + "'");
  REQUIRE(b.exit_code == 0);
  const json ja = json::parse(a.out), jb = json::parse(b.out);
  CHECK(ja == jb);
  CHECK(jb["description"]["gpus"].size() == 8);
  CHECK(jb["decisions"]["hybrid_shard_group"] == 8);
  const auto s = test::run_trainrun("topo --save '" + dir / "pcie.json" + "' --sysfs-root '" + fixture("sysfs/pcie_2socket") + "'");
  REQUIRE(s.exit_code == 0);
  CHECK_THAT(s.out, Contains("[acs] PCIe ACS is enabled"));
  CHECK(test::run_trainrun("topo --topology '" + dir / "pcie.json" + "'").out == s.out);
}

TEST_CASE("topology: trainrun topo rejects bad input with exit code 1", "[topology][cli]") {
  test::TempDir dir("topo");
  const std::string ragged = dir / "ragged.txt";
  test::write_file(ragged, "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU1\tNV4\n");
  auto r = test::run_trainrun("topo --nvidia-smi-topo '" + ragged + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("trainrun: error: " + ragged + ":3: row GPU1 has 1 cells, expected 3"));
  r = test::run_trainrun("topo --nvidia-smi-topo '" + dir / "missing.txt" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("cannot open '" + dir / "missing.txt" + "'"));
  const std::string bad_json = dir / "bad.json";
  test::write_file(bad_json, "{\n  \"format\": \"trainrun-topology\",\n  \"gpus\": [,]\n}\n");
  r = test::run_trainrun("topo --topology '" + bad_json + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains(bad_json + ":3:12: malformed JSON"));
  r = test::run_trainrun("topo --sysfs-root '" + dir / "nothing" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("--sysfs-root must be a directory that contains sys/"));
  r = test::run_trainrun("topo --topology a.json --nvidia-smi-topo b.txt");
  CHECK(r.exit_code == 2);  // a usage error
}


TEST_CASE("topology: trainrun topo --tp shows the TP groups, their link and a warning off NVLink", "[topology][cli][tp]") {
  // NVLink pairs (0-1, 2-3) joined by PCIe: tp2 stays on NVLink, tp4 spans PCIe.
  auto r = test::run_trainrun("topo --tp 2 --nvidia-smi-topo '" + fixture("pcie_nvlink_pairs.txt") + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("tensor-parallel groups (tp 2, 4 ranks on this node") &&
                        Contains("ranks 0-1 (GPUs 0,1): NVLink (NV4)") && Contains("ranks 2-3 (GPUs 2,3): NVLink (NV4)"));
  CHECK_THAT(r.out, !Contains("[tp_link]"));
  r = test::run_trainrun("topo --tp 4 --nvidia-smi-topo '" + fixture("pcie_nvlink_pairs.txt") + "'");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("ranks 0-3 (GPUs 0,1,2,3): PCIe (NODE)"));
  CHECK_THAT(r.out, Contains("[tp_link] parallel.tensor_parallel 4: TP group ranks 0-3 (GPUs 0,1,2,3): PCIe (NODE). "
                             "TP does 4 activation collectives per layer per micro-batch") &&
                        Contains("Put TP inside an NVLink island (islands here: GPUs 0-1, 2-3) or lower "
                                 "parallel.tensor_parallel to 2"));
  // A DGX (NVSwitch): every group of 8 is NVLink.
  r = test::run_trainrun("topo --tp 8 --nvidia-smi-topo '" + fixture("dgx_h100.txt") + "'");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("ranks 0-7 (GPUs 0,1,2,3,4,5,6,7): NVLink (NV18)") && !Contains("[tp_link]"));
  // A PCIe-only box: every group is PCIe, and the advice says there is no island.
  r = test::run_trainrun("topo --tp 2 --nvidia-smi-topo '" + fixture("pcie_8gpu_2socket.txt") + "'");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("ranks 0-1 (GPUs 0,1): PCIe") && Contains("(this node has none: TP over PCIe is all it can do)"));
  // 3 ranks per node at tp 2: the last group continues on the next node.
  r = test::run_trainrun("topo --tp 2 --nproc 3 --nvidia-smi-topo '" + fixture("dgx_h100.txt") + "'");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("rank 2 (GPU 2): cross-node (continues on the next node's ranks)") &&
                        Contains("over the network") && Contains("a degree that divides the ranks per node"));
  // JSON carries the groups.
  r = test::run_trainrun("topo --json --tp 4 --nvidia-smi-topo '" + fixture("pcie_nvlink_pairs.txt") + "'");
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("tp_groups").at("tp") == 4);
  CHECK(j.at("tp_groups").at("groups").at(0).at("link") == "PCIe");
  CHECK(j.at("tp_groups").at("groups").at(0).at("ranks") == std::vector<int>{0, 1, 2, 3});
}

TEST_CASE("topology: trainrun topo --config takes the job's parallel.tensor_parallel and topology", "[topology][cli][tp]") {
  test::TempDir dir("topo_tp");
  const std::string saved = dir / "pairs.json";
  REQUIRE(test::run_trainrun("topo --save '" + saved + "' --nvidia-smi-topo '" + fixture("pcie_nvlink_pairs.txt") + "'")
              .exit_code == 0);
  test::write_file(dir / "job.yaml", "model: {n_layer: 2, n_head: 4, n_embd: 64, vocab_size: 64, seq_len: 16}\n"
                                     "data: {format: synthetic}\n"
                                     "parallel: {tensor_parallel: 4, topology_file: '" + saved + "'}\n");
  auto r = test::run_trainrun("topo --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("tensor-parallel groups (tp 4") && Contains("[tp_link] parallel.tensor_parallel 4"));
  // --tp wins over the job's degree.
  r = test::run_trainrun("topo --tp 2 --config '" + dir / "job.yaml" + "'");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("tensor-parallel groups (tp 2") && !Contains("[tp_link]"));
  // Bad input.
  r = test::run_trainrun("topo --tp 0 --nvidia-smi-topo '" + fixture("dgx_h100.txt") + "'");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Contains("--tp"));
  test::write_file(dir / "bad.yaml", "parallel: {tensor_paralel: 2}\n");
  r = test::run_trainrun("topo --config '" + dir / "bad.yaml" + "'");
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Contains("parallel.tensor_paralel: unknown key; did you mean 'parallel.tensor_parallel'?"));
}
