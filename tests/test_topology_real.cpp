// Topology from `nvidia-smi topo -m` outputs that engineers posted publicly
// (tests/fixtures/topology/real_*.txt; where each comes from, and what in it
// was derived rather than seen, is in tests/fixtures/topology/SOURCES.md).
// The fixtures record the facts of each machine (link per pair, NIC columns,
// CPU/NUMA affinity) in our own layout; these tests pin the decisions each
// machine gets and the errors for damaged copies of them.
//
// Things these real outputs showed that the documented format did not:
//   - NIC<n> columns pasted without the "NIC Legend" (names unknown);
//   - SYS between GPUs of one NUMA node (an RTX 4090 box);
//   - a NUMA node whose last SMT sibling is missing ("64-127,192-254");
//   - blank CPU Affinity / NUMA Affinity in a VM;
//   - NICs numbered against the GPUs (GPU0 next to NIC8), a NIC far from
//     every GPU, one GPU per NUMA node, strided CPU lists ("6,14,22,30").
#include <catch2/catch.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tests/support/topology_testutil.h"

using namespace trainrun;
using namespace trainrun::topo;
using namespace trainrun::test;
using Catch::Matchers::Contains;
using json = nlohmann::json;

namespace {

const char* const kRealFixtures[] = {
    "real_h100_8gpu_9nic_vm.txt",         "real_a100_8gpu_3nic_4numa.txt",   "real_rtx4090_8gpu_pcie_2socket.txt",
    "real_h100_4gpu_nic_per_gpu.txt",     "real_a6000_8gpu_nvlink_pairs.txt", "real_a100_2gpu_mlx5_names.txt",
    "real_a100_2gpu_vm_blank_affinity.txt"};

std::string text_of(const std::string& name) { return read_file(topo_fixture(name)); }

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

// 1-based number of the line whose first cell is `label` (the row of that device).
int line_of(const std::string& text, const std::string& label) {
  const auto lines = lines_of(text);
  for (size_t i = 0; i < lines.size(); ++i) {
    std::istringstream in(lines[i]);
    std::string first;
    in >> first;
    if (first == label) return int(i) + 1;
  }
  return -1;
}

// The tab-separated row of `label` with cell `col` (0 = the label) replaced, or removed when `with` is empty.
std::string edit_tab_cell(const std::string& text, const std::string& label, size_t col, const std::string& with) {
  auto lines = lines_of(text);
  const int n = line_of(text, label);
  REQUIRE(n > 0);
  std::vector<std::string> cells;
  std::istringstream in(lines[size_t(n - 1)]);
  for (std::string c; std::getline(in, c, '\t');) cells.push_back(c);
  REQUIRE(col < cells.size());
  if (with.empty()) cells.erase(cells.begin() + long(col));
  else cells[col] = with;
  std::string row;
  for (size_t i = 0; i < cells.size(); ++i) row += (i ? "\t" : "") + cells[i];
  lines[size_t(n - 1)] = row;
  return joined(lines);
}

// What the paste would have said had it kept the NIC Legend (NIC<n>: mlx5_<n>).
std::string with_nic_legend(const std::string& text, int nics) {
  std::string s = text + "\nNIC Legend:\n\n";
  for (int n = 0; n < nics; ++n) s += "  NIC" + std::to_string(n) + ": mlx5_" + std::to_string(n) + "\n";
  return s;
}

std::string err_of(const std::string& text, const std::string& name) {
  return error_of([&] { parse_nvidia_smi_topo(text, name); });
}

const EnvSetting* kept_of(const Decisions& d, const std::string& name) {
  for (const EnvSetting& e : d.kept)
    if (e.name == name) return &e;
  return nullptr;
}

std::string warning_of(const Decisions& d, const std::string& code) {
  for (const auto& w : d.warnings)
    if (w.code == code) return w.message;
  return "";
}

bool has_note(const Topology& t, const std::string& part) {
  for (const auto& n : t.notes)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

}  // namespace

// ---- 8x H100 SXM, NVSwitch, 9 NICs (NVIDIA/nccl#1453) --------------------------------------------

TEST_CASE("topology: real 8x H100 NVSwitch box with NICs numbered against the GPUs", "[topology][real]") {
  const Topology t = smi("real_h100_8gpu_9nic_vm.txt");
  REQUIRE(t.gpu_count() == 8);
  REQUIRE(t.nics.size() == 9);
  CHECK(t.nvswitch);  // NV18 to all 7 peers: more NVLinks than a GPU has, so NVSwitch
  CHECK(link(t, 0, 7) == "NV18");
  CHECK(format_cpulist(t.gpus[3].cpus) == "0-79");
  CHECK(t.gpus[4].numa_node == 1);
  // The rails run backwards: GPU0 sits next to NIC8, GPU7 next to NIC1.
  for (int g = 0; g < 8; ++g) CHECK(nearest_gpus(t.nics[size_t(8 - g)]) == std::vector<int>{g});
  CHECK(nearest_gpus(t.nics[0]).size() == 8);  // NIC0 is SYS from every GPU
  CHECK(t.nics[8].name == "NIC8");             // no NIC Legend in the paste
  CHECK(has_note(t, "NIC0, NIC1, NIC2, NIC3, NIC4, NIC5, NIC6, NIC7, NIC8: no \"NIC Legend\" entry"));

  const Decisions d = decide_for(t);
  CHECK(gpus_of(d) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(env_of(d, "NCCL_NVLS_ENABLE") == "1");
  CHECK_THAT(d.find_env("NCCL_NVLS_ENABLE")->reason, Contains("model inferred from NV18 through NVSwitch"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "NVL");
  // Each rank binds to its GPU's socket: 80 CPUs (no SMT pattern in this VM) shared by 4 ranks.
  CHECK(format_cpulist(d.ranks[0].cpus) == "0-19");
  CHECK(format_cpulist(d.ranks[3].cpus) == "60-79");
  CHECK(format_cpulist(d.ranks[4].cpus) == "80-99");
  CHECK(d.ranks[4].numa_node == 1);
  CHECK(d.hybrid_shard_group == 8);
  CHECK(d.warnings.empty());  // two sockets, but every pair has NVLink and every GPU a PIX NIC
  // Without the legend the nearest NICs are known but not their names: no NCCL_IB_HCA.
  CHECK(env_of(d, "NCCL_IB_HCA") == "<unset>");
  REQUIRE(kept_of(d, "NCCL_IB_HCA"));
  CHECK_THAT(kept_of(d, "NCCL_IB_HCA")->reason, Contains("GPU0->NIC8 (PIX), GPU1->NIC7 (PIX)"));
  CHECK_THAT(kept_of(d, "NCCL_IB_HCA")->reason, Contains("no \"NIC Legend\""));
  CHECK_THAT(kept_of(d, "NCCL_CROSS_NIC")->reason, Contains("rail layout"));

  // Fewer ranks stay on one socket.
  const Decisions d4 = decide_for(t, 4);
  CHECK(gpus_of(d4) == std::vector<int>{0, 1, 2, 3});
  CHECK(d4.ranks[3].numa_node == 0);
  CHECK(d4.hybrid_shard_group == 4);
}

TEST_CASE("topology: real 8x H100 with its NIC Legend picks the PIX NIC of each GPU", "[topology][real]") {
  // The poster set NCCL_IB_HCA=mlx5_1,...,mlx5_8 by hand; with the legend we get the same set.
  const Topology t = parse_nvidia_smi_topo(with_nic_legend(text_of("real_h100_8gpu_9nic_vm.txt"), 9), "h100.txt");
  CHECK(t.nics[8].name == "mlx5_8");
  const Decisions d = decide_for(t);
  CHECK(env_of(d, "NCCL_IB_HCA") == "=mlx5_8,mlx5_7,mlx5_6,mlx5_5,mlx5_4,mlx5_3,mlx5_2,mlx5_1");
  CHECK_THAT(d.find_env("NCCL_IB_HCA")->reason, Contains("left out (no GPU's nearest, e.g. storage): mlx5_0"));
  CHECK(env_of(decide_for(t, 2), "NCCL_IB_HCA") == "=mlx5_8,mlx5_7");
}

// ---- 8x A100 SXM, NVSwitch, 3 NICs, 4 NUMA nodes (PaddlePaddle/FastDeploy#4044) ------------------

TEST_CASE("topology: real 8x A100 NV12 box keeps NVLS off and flags GPUs without a near NIC", "[topology][real]") {
  const Topology t = smi("real_a100_8gpu_3nic_4numa.txt");
  REQUIRE(t.gpu_count() == 8);
  CHECK(t.nvswitch);
  CHECK(link(t, 2, 6) == "NV12");
  CHECK(nearest_gpus(t.nics[0]) == std::vector<int>{0, 1});  // PXB
  CHECK(nearest_gpus(t.nics[2]) == std::vector<int>{2, 3});  // PXB
  CHECK(nearest_gpus(t.nics[1]) == std::vector<int>{2, 3});  // NODE
  CHECK(t.gpus[0].numa_node == -1);                          // N/A: not in the archived copy
  CHECK(t.gpus[6].numa_node == 3);

  const Decisions d = decide_for(t);
  CHECK(env_of(d, "NCCL_NVLS_ENABLE") == "<unset>");  // NVSwitch gen 2: no NVLink SHARP
  REQUIRE(kept_of(d, "NCCL_NVLS_ENABLE"));
  CHECK_THAT(kept_of(d, "NCCL_NVLS_ENABLE")->reason, Contains("model inferred from NV12 through NVSwitch"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "NVL");
  CHECK(gpus_of(d) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(d.ranks[0].cpus.empty());  // CPUs unknown: not bound
  CHECK_THAT(d.affinity_reason, Contains("ranks whose GPU's CPUs are unknown"));
  CHECK(format_cpulist(d.ranks[3].cpus) == "20-39,100-119");
  CHECK(format_cpulist(d.ranks[4].cpus) == "40-49,120-129");  // two ranks on node 2 split its cores
  CHECK(format_cpulist(d.ranks[7].cpus) == "70-79,150-159");
  CHECK(d.ranks[6].numa_node == 3);
  CHECK(d.hybrid_shard_group == 8);
  CHECK_THAT(warning_of(d, "nic_far"),
             Contains("GPU4 (nearest NIC0: SYS), GPU5 (nearest NIC0: SYS), GPU6 (nearest NIC0: SYS), GPU7"));
  CHECK_THAT(kept_of(d, "NCCL_CROSS_NIC")->reason, Contains("some GPUs have a NIC within a PCIe switch"));
  CHECK_FALSE(d.has_warning("split_sockets"));
  // The four GPUs with a PXB NIC, and then no far-NIC warning.
  const Decisions d4 = decide_for(t, 4);
  CHECK(gpus_of(d4) == std::vector<int>{0, 1, 2, 3});
  CHECK_FALSE(d4.has_warning("nic_far"));
}

// ---- 8x RTX 4090, PCIe only, two sockets, 2 NICs (NVIDIA/go-gpuallocator#17) ---------------------

TEST_CASE("topology: real 8-GPU PCIe box over two sockets warns about NVLink and sockets", "[topology][real]") {
  const Topology t = smi("real_rtx4090_8gpu_pcie_2socket.txt");
  REQUIRE(t.gpu_count() == 8);
  CHECK(link(t, 0, 1) == "SYS");  // SYS although both sit on NUMA node 0
  CHECK(t.gpus[0].numa_node == 0);
  CHECK(t.gpus[1].numa_node == 0);
  CHECK(nearest_gpus(t.nics[0]) == std::vector<int>{6});  // PHB
  CHECK_FALSE(t.nvswitch);

  const Decisions d = decide_for(t);
  CHECK(gpus_of(d) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(d.has_warning("no_nvlink"));
  CHECK_THAT(warning_of(d, "no_nvlink"), Contains("~10x lower all-reduce bandwidth"));
  REQUIRE(d.has_warning("split_sockets"));
  // Only the 16 pairs between the sockets count, not the SYS pairs inside node 0 or node 1.
  CHECK_THAT(warning_of(d, "split_sockets"),
             Contains("(NUMA 0: GPUs 0,1,2,3; NUMA 1: GPUs 4,5,6,7): 16 GPU pairs talk across the CPU interconnect"));
  CHECK_THAT(warning_of(d, "nic_far"), Contains("GPU6 (nearest NIC0: PHB)"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "<unset>");
  CHECK(env_of(d, "NCCL_CROSS_NIC") == "1");  // no NIC within a switch of any GPU
  CHECK(env_of(d, "NCCL_IB_HCA") == "<unset>");  // NIC0/NIC1 pasted without the legend
  CHECK(d.hybrid_shard_group == 8);
  CHECK_THAT(d.hybrid_shard_reason, Contains("no NVLink"));
  CHECK(format_cpulist(d.ranks[0].cpus) == "0-13,112-125");
  CHECK(format_cpulist(d.ranks[4].cpus) == "56-69,168-181");
  CHECK(d.ranks[7].numa_node == 1);
  // Four ranks: one socket, and no socket warning for its same-node SYS pairs.
  const Decisions d4 = decide_for(t, 4);
  CHECK(gpus_of(d4) == std::vector<int>{0, 1, 2, 3});
  CHECK_FALSE(d4.has_warning("split_sockets"));
  CHECK(d4.has_warning("no_nvlink"));
  CHECK(format_cpulist(d4.ranks[3].cpus) == "42-55,154-167");
}

// ---- 4x H100, NV6 point to point, a NIC per GPU, a NUMA node per GPU (NVIDIA/nccl#1617) ---------

TEST_CASE("topology: real 4-GPU box with one NIC per GPU", "[topology][real]") {
  const Topology t = smi("real_h100_4gpu_nic_per_gpu.txt");
  REQUIRE(t.gpu_count() == 4);
  CHECK_FALSE(t.nvswitch);  // 3 peers x NV6 = 18 links: point to point, no switch needed
  for (int g = 0; g < 4; ++g) CHECK(nearest_gpus(t.nics[size_t(g)]) == std::vector<int>{g});
  CHECK(format_cpulist(t.gpus[0].cpus) == "6,14,22,30");
  CHECK(t.numa_nodes.size() == 4);

  const Decisions d = decide_for(t);
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "NVL");
  CHECK(env_of(d, "NCCL_NVLS_ENABLE") == "<unset>");
  CHECK_FALSE(kept_of(d, "NCCL_NVLS_ENABLE"));  // no NVSwitch: nothing to consider
  CHECK_THAT(kept_of(d, "NCCL_CROSS_NIC")->reason, Contains("rail layout"));
  CHECK(d.warnings.empty());
  // Every rank on its GPU's own NUMA node and its (strided) CPUs.
  const int want_numa[] = {3, 1, 7, 5};
  const char* want_cpus[] = {"6,14,22,30", "4,12,20,28", "7,15,23,31", "5,13,21,29"};
  for (int r = 0; r < 4; ++r) {
    CHECK(d.ranks[size_t(r)].gpu == r);
    CHECK(d.ranks[size_t(r)].numa_node == want_numa[r]);
    CHECK(format_cpulist(d.ranks[size_t(r)].cpus) == want_cpus[r]);
  }
  CHECK(d.hybrid_shard_group == 4);
  CHECK(gpus_of(decide_for(t, 2)) == std::vector<int>{0, 1});

  const Decisions dl = decide_for(parse_nvidia_smi_topo(with_nic_legend(text_of("real_h100_4gpu_nic_per_gpu.txt"), 4),
                                                        "h100x4.txt"));
  CHECK(env_of(dl, "NCCL_IB_HCA") == "=mlx5_0,mlx5_1,mlx5_2,mlx5_3");
  CHECK_THAT(dl.find_env("NCCL_IB_HCA")->reason, Contains("GPU0->mlx5_0 (PIX), GPU1->mlx5_1 (PIX)"));
}

// ---- 8x RTX A6000, NVLink bridges in pairs, two sockets (pytorch/pytorch#79299) ------------------

TEST_CASE("topology: real PCIe box with NVLink bridges in pairs shards over the pair", "[topology][real]") {
  const Topology t = smi("real_a6000_8gpu_nvlink_pairs.txt");
  CHECK(nvlink_islands(t) == std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(t.nics.empty());

  const Decisions d = decide_for(t);
  CHECK(d.hybrid_shard_group == 2);
  CHECK_THAT(d.hybrid_shard_reason, Contains("4 islands of 2 GPUs"));
  CHECK(d.has_warning("nvlink_partial"));
  CHECK_FALSE(d.has_warning("no_nvlink"));
  CHECK_THAT(warning_of(d, "split_sockets"), Contains("16 GPU pairs"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "<unset>");
  CHECK_THAT(kept_of(d, "NCCL_IB_HCA")->reason, Contains("no InfiniBand/RoCE NIC"));
  // NUMA 1 is 64-127,192-254: CPU 255 (the sibling of 127) is missing. Whole
  // cores still go to one rank each; core 127 has one thread.
  CHECK(format_cpulist(d.ranks[0].cpus) == "0-15,128-143");
  CHECK(format_cpulist(d.ranks[4].cpus) == "64-79,192-207");
  CHECK(format_cpulist(d.ranks[7].cpus) == "112-127,240-254");
  std::map<int, int> owner;  // physical core (first thread) -> rank
  for (const RankPlacement& r : d.ranks)
    for (int c : r.cpus) {
      const int core = c % 128;
      CHECK((!owner.count(core) || owner[core] == r.rank));
      owner[core] = r.rank;
    }

  const Decisions d2 = decide_for(t, 2);
  CHECK(gpus_of(d2) == std::vector<int>{0, 1});
  CHECK(env_of(d2, "NCCL_P2P_LEVEL") == "NVL");
  CHECK(d2.warnings.empty());
  const Decisions d4 = decide_for(t, 4);
  CHECK(gpus_of(d4) == std::vector<int>{0, 1, 2, 3});
  CHECK(d4.hybrid_shard_group == 2);
  CHECK_FALSE(d4.has_warning("split_sockets"));
  CHECK(d4.has_warning("nvlink_partial"));
}

// ---- 2x A100 SXM with 8 NICs named mlx5_<n> (InternLM/lmdeploy#1944) -----------------------------

TEST_CASE("topology: real 2x A100 with named NICs picks the PXB pair for NCCL_IB_HCA", "[topology][real]") {
  const Topology t = smi("real_a100_2gpu_mlx5_names.txt");
  REQUIRE(t.nics.size() == 8);
  CHECK(t.nics[6].name == "mlx5_6");
  CHECK_FALSE(t.nvswitch);  // two GPUs: nothing to infer
  const Decisions d = decide_for(t);
  CHECK(env_of(d, "NCCL_IB_HCA") == "=mlx5_6,mlx5_7");
  CHECK_THAT(d.find_env("NCCL_IB_HCA")->reason, Contains("GPU0->mlx5_6+mlx5_7 (PXB), GPU1->mlx5_6+mlx5_7 (PXB)"));
  CHECK_THAT(d.find_env("NCCL_IB_HCA")->reason,
             Contains("left out (no GPU's nearest, e.g. storage): mlx5_0, mlx5_1, mlx5_2, mlx5_3, mlx5_4, mlx5_5"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "NVL");
  CHECK(env_of(d, "NCCL_NVLS_ENABLE") == "<unset>");
  CHECK(d.warnings.empty());
  CHECK(d.ranks[0].numa_node == -1);  // one NUMA node known: no policy
  CHECK(format_cpulist(d.ranks[0].cpus) == "48-71,144-167");
  CHECK(format_cpulist(d.ranks[1].cpus) == "72-95,168-191");
}

// ---- 2x A100 in a VM with blank CPU/NUMA Affinity (vllm-project/vllm#19607) ----------------------

TEST_CASE("topology: real VM output with blank CPU and NUMA affinity parses", "[topology][real]") {
  const Topology t = smi("real_a100_2gpu_vm_blank_affinity.txt");
  REQUIRE(t.gpu_count() == 2);
  CHECK(link(t, 0, 1) == "NV12");
  CHECK(t.gpus[0].cpus.empty());
  CHECK(t.gpus[1].numa_node == -1);
  CHECK(t.numa_nodes.empty());
  CHECK(has_note(t, "GPU0, GPU1: CPU Affinity/NUMA Affinity left blank by nvidia-smi"));
  CHECK(nearest_gpus(t.nics[6]) == std::vector<int>{0, 1});
  const Decisions d = decide_for(t);
  CHECK(d.ranks[0].cpus.empty());
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "NVL");
  CHECK_THAT(kept_of(d, "NCCL_IB_HCA")->reason, Contains("GPU0->NIC6+NIC7 (PXB)"));
  CHECK(d.warnings.empty());
  // The tolerance is for blank affinity only: a row missing a link cell is still ragged.
  const std::string text = text_of("real_a100_2gpu_vm_blank_affinity.txt");
  auto lines = lines_of(text);
  const int n = line_of(text, "GPU1");
  std::string& row = lines[size_t(n - 1)];
  row.erase(row.find("SYS"), 8);  // one SYS cell and its padding
  CHECK_THAT(err_of(joined(lines), "vm.txt"),
             Contains("vm.txt:" + std::to_string(n) + ": row GPU1 has 10 cells, expected 13 (10 device columns + CPU "
                      "Affinity, NUMA Affinity, GPU NUMA ID)"));
}

// ---- damaged copies of the real outputs ------------------------------------------------------------

TEST_CASE("topology: real outputs with a ragged row name the line", "[topology][real]") {
  const std::string h100 = text_of("real_h100_8gpu_9nic_vm.txt");
  REQUIRE(err_of(h100, "h100.txt").empty());
  const int gpu3 = line_of(h100, "GPU3");
  CHECK(gpu3 == 6);  // a comment line, the header, GPU0..GPU2
  // GPU3's NIC3 cell lost in the paste.
  CHECK_THAT(err_of(edit_tab_cell(h100, "GPU3", 12, ""), "h100.txt"),
             Contains("h100.txt:6: row GPU3 has 19 cells, expected 20 (17 device columns + CPU Affinity, NUMA "
                      "Affinity, GPU NUMA ID); is the row cut short"));
  // A NIC row cut short.
  const int nic4 = line_of(h100, "NIC4");
  CHECK_THAT(err_of(edit_tab_cell(h100, "NIC4", 17, ""), "h100.txt"),
             Contains("h100.txt:" + std::to_string(nic4) + ": row NIC4 has 16 cells, expected 17"));
  // Two cells run together, as in pastes that lost a tab ("NODENODE").
  std::string fused = edit_tab_cell(h100, "GPU5", 14, "");
  fused = edit_tab_cell(fused, "GPU5", 13, "NODESYS");
  CHECK_THAT(err_of(fused, "h100.txt"), Contains("h100.txt:8: row GPU5 has 19 cells, expected 20"));
  // A header that lost a tab between two NIC names: the first GPU row no longer fits it.
  auto lines = lines_of(h100);
  const size_t at = lines[1].find("NIC7\tNIC8");
  REQUIRE(at != std::string::npos);
  lines[1].replace(at, 9, "NIC7NIC8");
  CHECK_THAT(err_of(joined(lines), "h100.txt"),
             Contains("h100.txt:3: row GPU0 has 20 cells, expected 19 (16 device columns"));

  // The space-aligned A6000 table.
  const std::string a6000 = text_of("real_a6000_8gpu_nvlink_pairs.txt");
  auto al = lines_of(a6000);
  const int gpu6 = line_of(a6000, "GPU6");
  std::string& row = al[size_t(gpu6 - 1)];
  row.erase(row.find("NODE"), 8);
  CHECK_THAT(err_of(joined(al), "a6000.txt"),
             Contains("a6000.txt:" + std::to_string(gpu6) + ": row GPU6 has 9 cells, expected 10 (8 device columns + "
                      "CPU Affinity, NUMA Affinity)"));
}

TEST_CASE("topology: real outputs with an unknown link code name the line and column", "[topology][real]") {
  const std::string h100 = text_of("real_h100_8gpu_9nic_vm.txt");
  const int gpu5 = line_of(h100, "GPU5");
  CHECK_THAT(err_of(edit_tab_cell(h100, "GPU5", 11, "XYZ"), "h100.txt"),
             Contains("h100.txt:" + std::to_string(gpu5) +
                      ": row GPU5, column NIC2: unknown link code 'XYZ'; expected X, NV<n>, PIX, PXB, PHB, NODE or SYS"));
  const int nic1 = line_of(h100, "NIC1");
  CHECK_THAT(err_of(edit_tab_cell(h100, "NIC1", 3, "XYZ"), "h100.txt"),
             Contains("h100.txt:" + std::to_string(nic1) + ": row NIC1, column GPU2: unknown link code 'XYZ'"));
  // Space-aligned: the 4-GPU box written with tabs, the A100 with spaces.
  const std::string a100 = text_of("real_a100_8gpu_3nic_4numa.txt");
  auto lines = lines_of(a100);
  const int gpu2 = line_of(a100, "GPU2");
  std::string& row = lines[size_t(gpu2 - 1)];
  row.replace(row.find("NODE"), 4, "XYZ ");
  CHECK_THAT(err_of(joined(lines), "a100.txt"),
             Contains("a100.txt:" + std::to_string(gpu2) + ": row GPU2, column NIC1: unknown link code 'XYZ'"));
}

TEST_CASE("topology: real outputs that are not square name the line", "[topology][real]") {
  const std::string h100 = text_of("real_h100_8gpu_9nic_vm.txt");
  // The last NIC row cut off: 17 columns, 16 rows; the header line is named.
  auto lines = lines_of(h100);
  lines.erase(lines.begin() + (line_of(h100, "NIC8") - 1));
  CHECK_THAT(err_of(joined(lines), "h100.txt"),
             Contains("h100.txt:2: the matrix is not square: 17 columns but 16 rows (no row for NIC8)"));
  // A GPU row missing in the middle.
  lines = lines_of(h100);
  lines.erase(lines.begin() + (line_of(h100, "GPU6") - 1));
  CHECK_THAT(err_of(joined(lines), "h100.txt"),
             Contains("h100.txt:2: the matrix is not square: 17 columns but 16 rows (no row for GPU6)"));
  // An extra row with no column.
  lines = lines_of(h100);
  const int nic8 = line_of(h100, "NIC8");
  lines.insert(lines.begin() + nic8, "NIC9\tSYS");
  CHECK_THAT(err_of(joined(lines), "h100.txt"),
             Contains("h100.txt:" + std::to_string(nic8 + 1) + ": row 'NIC9' does not match any column"));
  // A pair that disagrees with its mirror (one half edited).
  CHECK_THAT(err_of(edit_tab_cell(h100, "GPU7", 10, "NODE"), "h100.txt"),
             Contains("the matrix is not symmetric: GPU7-NIC1 is NODE but NIC1-GPU7 is PIX"));
}

// ---- all real fixtures ---------------------------------------------------------------------------------

TEST_CASE("topology: real fixtures survive the printed matrix and a saved description", "[topology][real]") {
  test::TempDir dir("topo-real");
  for (const char* name : kRealFixtures) {
    INFO(name);
    const Topology t = smi(name);
    check_printed_matrix_reads_back(t);
    const std::string path = dir / (std::string(name) + ".json");
    save_topology(t, path);
    const Topology loaded = load_topology(path);
    CHECK(json(decisions_to_json(decide_for(loaded))) == json(decisions_to_json(decide_for(t))));
    for (const EnvSetting& e : decide_for(t).env) CHECK_FALSE(e.reason.empty());
  }
}

TEST_CASE("topology: real trainrun topo on the H100 paste prints the decisions", "[topology][real][cli]") {
  const auto r = test::run_trainrun("topo --nvidia-smi-topo '" + topo_fixture("real_h100_8gpu_9nic_vm.txt") + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("decisions for 8 ranks (cuda backend)"));
  CHECK_THAT(r.out, Contains("NCCL_NVLS_ENABLE=1"));
  CHECK_THAT(r.out, Contains("NCCL_P2P_LEVEL=NVL"));
  const auto j = test::run_trainrun("topo --json --nproc 4 --nvidia-smi-topo '" +
                                    topo_fixture("real_rtx4090_8gpu_pcie_2socket.txt") + "'");
  REQUIRE(j.exit_code == 0);
  const json out = json::parse(j.out);
  std::set<std::string> codes;
  for (const json& w : out["decisions"]["warnings"]) codes.insert(w["code"].get<std::string>());
  CHECK(codes == std::set<std::string>{"nic_far", "no_nvlink"});
}
