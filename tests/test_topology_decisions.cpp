// Topology decisions from fixtures (rank -> GPU, CPU affinity and NUMA
// policy, NCCL environment, hybrid_shard group, warnings) and what the agent
// applies when it launches a job.
#include <catch2/catch.hpp>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/support/topology_testutil.h"

using namespace trainrun;
using namespace trainrun::topo;
using namespace trainrun::test;
using Catch::Matchers::Contains;
using json = nlohmann::json;

// ---- decisions -------------------------------------------------------------------------------------

TEST_CASE("topology: decisions for a DGX H100", "[topology]") {
  const Decisions d = decide_for(smi("dgx_h100.txt"));
  CHECK(d.backend == "cuda");
  CHECK(gpus_of(d) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(format_cpulist(d.ranks[0].cpus) == "0-13,112-125");  // a quarter of socket 0, SMT siblings kept together
  CHECK(format_cpulist(d.ranks[7].cpus) == "98-111,210-223");
  CHECK(d.ranks[5].numa_node == 1);
  CHECK(env_of(d, "NCCL_NVLS_ENABLE") == "1");
  CHECK_THAT(d.find_env("NCCL_NVLS_ENABLE")->reason, Contains("NVSwitch with Hopper-class GPUs"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "NVL");
  CHECK(env_of(d, "NCCL_IB_HCA") == "=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11");
  CHECK_THAT(d.find_env("NCCL_IB_HCA")->reason, Contains("left out (no GPU's nearest, e.g. storage): mlx5_1, mlx5_2, mlx5_7, mlx5_8"));
  CHECK(env_of(d, "NCCL_CROSS_NIC") == "<unset>");  // a rail layout: NCCL's default
  CHECK(env_of(d, "CUDA_VISIBLE_DEVICES") == "0,1,2,3,4,5,6,7");
  CHECK(env_of(d, "NCCL_P2P_DISABLE") == "<unset>");
  CHECK(d.hybrid_shard_group == 8);
  CHECK(d.warnings.empty());
  for (const EnvSetting& e : d.env) CHECK_FALSE(e.reason.empty());
  for (const EnvSetting& e : d.kept) CHECK_FALSE(e.reason.empty());
}

TEST_CASE("topology: decisions for a DGX A100", "[topology]") {
  const Decisions d = decide_for(smi("dgx_a100.txt"));
  CHECK(env_of(d, "NCCL_NVLS_ENABLE") == "<unset>");  // NVSwitch gen 2: no SHARP
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "NVL");
  CHECK(env_of(d, "NCCL_IB_HCA") == "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_6,mlx5_7,mlx5_8,mlx5_9");
  CHECK(format_cpulist(d.ranks[0].cpus) == "48-55,176-183");
  CHECK(format_cpulist(d.ranks[1].cpus) == "56-63,184-191");
  CHECK(d.ranks[2].numa_node == 1);
  CHECK(d.hybrid_shard_group == 8);
  CHECK(d.warnings.empty());  // split over sockets, but every pair has NVLink
}

TEST_CASE("topology: decisions for an 8-GPU PCIe box over two sockets", "[topology]") {
  const Topology t = smi("pcie_8gpu_2socket.txt");
  const Decisions d = decide_for(t);
  CHECK(d.has_warning("no_nvlink"));
  CHECK(d.has_warning("split_sockets"));
  CHECK(d.has_warning("nic_far"));
  CHECK_FALSE(d.has_warning("acs"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "<unset>");
  CHECK(env_of(d, "NCCL_IB_HCA") == "=mlx5_0");
  CHECK(d.hybrid_shard_group == 8);
  CHECK(format_cpulist(d.ranks[4].cpus) == "20-24,60-64");
  // Fewer ranks: the GPUs of one socket, then of one switch.
  const Decisions d4 = decide_for(t, 4);
  CHECK(gpus_of(d4) == std::vector<int>{0, 1, 2, 3});
  CHECK_FALSE(d4.has_warning("split_sockets"));
  CHECK(format_cpulist(d4.ranks[0].cpus) == "0-4,40-44");
  CHECK(gpus_of(decide_for(t, 2)) == std::vector<int>{0, 1});
  CHECK(env_of(decide_for(t, 2), "CUDA_VISIBLE_DEVICES") == "0,1");
}

TEST_CASE("topology: decisions for a box with a NIC per GPU", "[topology]") {
  const Decisions d = decide_for(smi("pcie_4gpu_nic_per_gpu.txt"));
  CHECK(env_of(d, "NCCL_IB_HCA") == "=mlx5_0,mlx5_1,mlx5_2,mlx5_3");
  CHECK_FALSE(d.has_warning("nic_far"));
  CHECK(env_of(d, "NCCL_CROSS_NIC") == "<unset>");
  CHECK(gpus_of(decide_for(smi("pcie_4gpu_nic_per_gpu.txt"), 2)) == std::vector<int>{0, 1});
  // The same NICs far from every GPU: rings may use any NIC.
  Topology far = smi("pcie_4gpu_nic_per_gpu.txt");
  for (Nic& n : far.nics)
    for (Link& l : n.gpu_links) l = Link{LinkKind::Sys, 0};
  const Decisions df = decide_for(far);
  CHECK(env_of(df, "NCCL_CROSS_NIC") == "1");
  CHECK(df.has_warning("nic_far"));
}

TEST_CASE("topology: decisions for NVLink-bridged pairs", "[topology]") {
  const Topology t = smi("pcie_nvlink_pairs.txt");
  const Decisions d = decide_for(t);
  CHECK(d.hybrid_shard_group == 2);  // the NVLink island
  CHECK_THAT(d.hybrid_shard_reason, Contains("2 islands of 2 GPUs"));
  CHECK(d.has_warning("nvlink_partial"));
  CHECK_FALSE(d.has_warning("no_nvlink"));
  CHECK(env_of(d, "NCCL_P2P_LEVEL") == "<unset>");
  CHECK(d.ranks[0].numa_node == -1);  // one NUMA node: no policy
  const Decisions d2 = decide_for(t, 2);
  CHECK(gpus_of(d2) == std::vector<int>{0, 1});
  CHECK(env_of(d2, "NCCL_P2P_LEVEL") == "NVL");
  CHECK(d2.warnings.empty());
  // Islands interleaved in PCI order are made contiguous in rank order.
  Topology x = t;
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b)
      x.links[size_t(a)][size_t(b)] = a == b ? Link{LinkKind::Self, 0} : a % 2 == b % 2 ? Link{LinkKind::NVLink, 4} : Link{LinkKind::Node, 0};
  const Decisions dx = decide_for(x);
  CHECK(gpus_of(dx) == std::vector<int>{0, 2, 1, 3});
  CHECK(dx.hybrid_shard_group == 2);
  CHECK(env_of(dx, "CUDA_VISIBLE_DEVICES") == "0,2,1,3");
}

TEST_CASE("topology: decisions for the sysfs PCIe box warn about ACS and mixed GPUs", "[topology]") {
  const Decisions d = decide_for(sysfs("pcie_2socket"));
  REQUIRE(d.has_warning("acs"));
  for (const auto& w : d.warnings)
    if (w.code == "acs") {
      CHECK_THAT(w.message, Contains("0000:19:08.0 (GPU0-GPU1); 0000:19:10.0 (GPU0-GPU1)"));
      CHECK_THAT(w.message, Contains("setpci -s <bridge> ECAP_ACS+0x6.w=0000"));
    }
  CHECK_FALSE(d.has_warning("acs_unknown"));  // unknown bridges are not between GPUs
  CHECK(d.has_warning("mixed_gpus"));
  CHECK(d.has_warning("nic_far"));
  CHECK(env_of(d, "NCCL_SOCKET_IFNAME") == "=ens1f0");
  CHECK(env_of(d, "NCCL_IB_HCA") == "=mlx5_0");
  CHECK(d.ranks[0].cpus == CpuList{0, 8});  // three ranks share socket 0's four cores
  CHECK(d.ranks[2].cpus == CpuList{2, 3, 10, 11});
  CHECK(format_cpulist(d.ranks[3].cpus) == "4-7,12-15");
  // A bridge between GPUs whose state could not be read.
  Topology t = sysfs("pcie_2socket");
  for (PciBridge& b : t.bridges) b.acs = AcsState::Unknown;
  CHECK(decide_for(t).has_warning("acs_unknown"));
  // NVSwitch chips but no NVML: say so rather than "no NVLink".
  t.nvswitch_devices = 4;
  CHECK(decide_for(t).has_warning("nvlink_unknown"));
  CHECK_FALSE(decide_for(t).has_warning("no_nvlink"));
}

TEST_CASE("topology: the CPU backend spreads ranks over NUMA nodes and cores", "[topology]") {
  const Topology t = sysfs("cpu_only_2numa");
  const Decisions d4 = decide_for(t, 4);
  CHECK(d4.backend == "cpu");
  REQUIRE(d4.ranks.size() == 4);
  const char* want[] = {"0-1", "2-3", "4-5", "6-7"};
  for (int r = 0; r < 4; ++r) {
    CHECK(format_cpulist(d4.ranks[size_t(r)].cpus) == want[r]);
    CHECK(d4.ranks[size_t(r)].numa_node == r / 2);
    CHECK(d4.ranks[size_t(r)].gpu == -1);
  }
  CHECK(d4.env.empty());
  CHECK(d4.hybrid_shard_group == 4);
  const Decisions d3 = decide_for(t, 3);
  CHECK(format_cpulist(d3.ranks[1].cpus) == "2-3");
  CHECK(format_cpulist(d3.ranks[2].cpus) == "4-7");
  const Decisions d1 = decide_for(t, 1);  // one rank: the whole machine, no single node preferred
  CHECK(format_cpulist(d1.ranks[0].cpus) == "0-7");
  CHECK(d1.ranks[0].numa_node == -1);
  CHECK(decide_for(t, 9).has_warning("cpu_oversubscribed"));
  DecisionInputs in;
  in.nproc = 2;
  in.allowed_cpus = {0, 1, 4, 5};  // a cgroup / taskset
  Decisions da = decide(t, in);
  CHECK(format_cpulist(da.ranks[0].cpus) == "0-1");
  CHECK(format_cpulist(da.ranks[1].cpus) == "4-5");
  in.bind_cpus = false;
  da = decide(t, in);
  CHECK(da.ranks[0].cpus.empty());
  CHECK_THAT(da.affinity_reason, Contains("not bound"));
  // A GPU machine asked for the CPU backend places ranks as on a CPU node.
  CHECK(decide_for(smi("dgx_h100.txt"), 2, "cpu").env.empty());
  CHECK(decide_for(t, 1, "cuda").has_warning("no_gpus"));
}

TEST_CASE("topology: user-set CUDA_VISIBLE_DEVICES, broken P2P and too many ranks", "[topology]") {
  const Topology t = smi("dgx_h100.txt");
  DecisionInputs in;
  in.nproc = 2;
  in.visible_gpus = {3, 2};
  const Decisions d = decide(t, in);
  CHECK(gpus_of(d) == std::vector<int>{3, 2});
  CHECK_THAT(d.gpu_order_reason, Contains("CUDA_VISIBLE_DEVICES is set by the user"));
  in.visible_gpus = {1, 9};
  CHECK(decide(t, in).has_warning("visible_gpus"));
  CHECK(decide_for(t, 10).has_warning("more_ranks_than_gpus"));

  Topology p = smi("pcie_8gpu_2socket.txt");
  p.p2p.assign(8, std::vector<int>(8, 1));
  CHECK(env_of(decide_for(p), "NCCL_P2P_DISABLE") == "<unset>");
  p.p2p[0][1] = p.p2p[1][0] = 0;
  p.p2p_source = "cuda";
  const Decisions broken = decide_for(p);
  CHECK(env_of(broken, "NCCL_P2P_DISABLE") == "1");
  CHECK_THAT(broken.find_env("NCCL_P2P_DISABLE")->reason, Contains("cuda peer probe found P2P broken between GPU0-GPU1"));
  CHECK(env_of(decide_for(p, 2, "auto"), "NCCL_P2P_DISABLE") == "1");
  CHECK(json(decisions_to_json(decide_for(p))) == json(decisions_to_json(decide_for(p))));  // pure
}

TEST_CASE("topology: variables the user set win over the decided ones", "[topology]") {
  const Decisions d = decide_for(smi("dgx_h100.txt"));
  const auto env = plan_worker_env(d.env, [](const std::string& name) -> const char* {
    return name == "NCCL_IB_HCA" ? "mlx5_7" : nullptr;
  });
  REQUIRE(env.size() == d.env.size());
  for (const EnvChoice& c : env) {
    INFO(c.name);
    CHECK(c.user_set == (c.name == "NCCL_IB_HCA"));
    if (c.user_set) CHECK(c.user_value == "mlx5_7");
  }
}

namespace {

std::string job(const test::TempDir& dir, int nproc, const std::string& parallel_extra) {
  const std::string path = dir / "job.yaml";
  test::write_file(path, "model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 16, seq_len: 16}\n"
                         "data: {format: synthetic}\n"
                         "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 1, log_interval: 1, "
                         "eval_interval: 0, warmup_steps: 1}\n"
                         "output: {dir: '" + dir / "run" + "', sample_tokens: 0}\n"
                         "parallel: {nproc_per_node: " + std::to_string(nproc) + ", timeout_s: 60" +
                         parallel_extra + "}\n");
  return path;
}

}  // namespace

TEST_CASE("topology: the agent binds workers and writes topology.json", "[topology][launcher]") {
  test::TempDir dir("topo");
  // OMP_NUM_THREADS unset: each worker gets as many threads as CPUs it is bound to.
  const auto r = test::run_command("env -u OMP_NUM_THREADS TRAINRUN_DEBUG_PRINT_ENV=1 '" + test::trainrun_binary() +
                                   "' --config '" + job(dir, 2, "") + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("topology: 0 GPUs"));
  const json t = json::parse(test::read_file(dir / "run/topology.json"));
  CHECK(t["description"]["format"] == "trainrun-topology");
  REQUIRE(t["decisions"]["ranks"].size() == 2);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string cpus = t["decisions"]["ranks"][size_t(rank)]["cpus"].get<std::string>();
    const std::string log = test::read_file(dir / ("run/logs/rank" + std::to_string(rank) + ".log"));
    INFO(log);
    CHECK(!cpus.empty());
    std::string listed;
    for (int c : parse_cpulist(cpus)) listed += (listed.empty() ? "" : ",") + std::to_string(c);
    CHECK_THAT(log, Contains("worker placement: CPUs=" + listed + "\n"));
    CHECK_THAT(log, Contains(" OMP_NUM_THREADS=" + std::to_string(parse_cpulist(cpus).size()) + " "));
  }
}

TEST_CASE("topology: parallel.topology_file drives the agent and user variables win", "[topology][launcher]") {
  test::TempDir dir("topo");
  const std::string saved = dir / "pairs.json";
  save_topology(smi("pcie_nvlink_pairs.txt"), saved);
  // cpu_affinity none: the fixture's CPUs are not this machine's.
  const std::string cfg = job(dir, 4, ", sharding: hybrid_shard, cpu_affinity: none, topology_file: '" + saved + "'");
  const auto r = test::run_command("OMP_NUM_THREADS=1 CUDA_DEVICE_ORDER=FASTEST_FIRST '" + test::trainrun_binary() +
                                   "' --config '" + cfg + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("topology: CUDA_DEVICE_ORDER=FASTEST_FIRST is set in the environment and wins"));
  CHECK_THAT(r.err, Contains("TRAINRUN_SHARD_GROUP_SIZE=2"));
  CHECK_THAT(r.err, Contains("warning: topology: the GPUs in use form 2 NVLink islands"));
  const json t = json::parse(test::read_file(dir / "run/topology.json"));
  bool saw_group = false;
  for (const json& e : t["worker_env"]) {
    if (e["name"] == "CUDA_DEVICE_ORDER") CHECK(e["set_by"] == "user");
    if (e["name"] == "TRAINRUN_SHARD_GROUP_SIZE") saw_group = e["value"] == "2" && e["set_by"] == "topology";
  }
  CHECK(saw_group);
  CHECK(t["decisions"]["ranks"][0]["cpus"] == "");

  // A bad file stops the job before any worker starts.
  test::TempDir dir2("topo");
  test::write_file(dir2 / "broken.json", "{\n  not json");
  const auto bad = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" +
                                     job(dir2, 2, ", topology_file: '" + dir2 / "broken.json" + "'") + "'");
  CHECK(bad.exit_code == 1);
  CHECK_THAT(bad.err, Contains(dir2 / "broken.json" + ":2:"));
  CHECK_THAT(bad.err, Contains("malformed JSON"));
  CHECK_FALSE(test::file_exists(dir2 / "run/logs"));

  // One worker (no agent): the file places nothing, but a missing one is
  // still an error, not silently ignored; a good one is loaded and named.
  test::TempDir dir3("topo");
  const auto missing = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" +
                                         job(dir3, 1, ", topology_file: '" + dir3 / "nope.json" + "'") + "'");
  CHECK(missing.exit_code == 1);
  CHECK_THAT(missing.err, Contains("topology: cannot open '" + dir3 / "nope.json" + "'"));
  CHECK_FALSE(test::file_exists(dir3 / "run/model.safetensors"));
  const auto one = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" +
                                     job(dir3, 1, ", topology_file: '" + saved + "'") + "'");
  INFO(one.err);
  CHECK(one.exit_code == 0);
  CHECK_THAT(one.err, Contains("topology: " + saved + " is used by the agent's placement"));
}
