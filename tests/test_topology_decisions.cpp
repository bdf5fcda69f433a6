// Topology decisions from fixtures (rank -> GPU, CPU affinity and NUMA
// policy, NCCL environment, hybrid_shard group, warnings) and what the agent
// applies when it launches a job.
#include <sched.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/config/job_spec.h"
#include "core/launch/launch_mode.h"
#include "parallel/topology/topology_launch.h"
#include "tests/support/process_util.h"
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

std::string job(const test::TempDir& dir, int nproc, const std::string& parallel_extra, int global_batch = 4) {
  const std::string path = dir / "job.yaml";
  test::write_file(path, "model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 16, seq_len: 16}\n"
                         "data: {format: synthetic}\n"
                         "train: {global_batch_size: " + std::to_string(global_batch) +
                         ", micro_batch_size: 1, max_steps: 1, log_interval: 1, "
                         "eval_interval: 0, warmup_steps: 1}\n"
                         "output: {dir: '" + dir / "run" + "', sample_tokens: 0}\n"
                         "parallel: {nproc_per_node: " + std::to_string(nproc) + ", timeout_s: 60" +
                         parallel_extra + "}\n");
  return path;
}

// The environment of an agent launched "on" a node that a topology file
// describes. The tests' own CUDA_VISIBLE_DEVICES is empty
// (tests/support/hide_gpus.cpp), which hides every GPU, so these runs unset
// it (visible "-") or set their own; the count then comes from the file.
// TRAINRUN_CUDA_LIB names no file, so the workers stay on the CPU backend
// even on a GPU machine, where the CUDA_VISIBLE_DEVICES the topology gives
// them would otherwise name real GPUs.
std::string gpu_node_env(const std::string& visible) {
  return std::string("env ") + (visible == "-" ? "-u CUDA_VISIBLE_DEVICES" : "CUDA_VISIBLE_DEVICES='" + visible + "'") +
         " TRAINRUN_CUDA_LIB=/nonexistent/libtrainrun_cuda.so ";
}

// `trainrun topo --save` of the DGX H100 paste: 8 GPUs, GPU0-3 on NUMA node
// 0 and GPU4-7 on node 1.
std::string saved_dgx_h100(const test::TempDir& dir) {
  const std::string saved = dir / "dgx_h100.json";
  const auto r = test::run_trainrun("topo --save '" + saved + "' --nvidia-smi-topo '" + topo_fixture("dgx_h100.txt") + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return saved;
}

std::string cpus_text(const CpuList& cpus) {
  std::string s;
  for (int c : cpus) s += (s.empty() ? "" : ",") + std::to_string(c);
  return s;
}

// Each rank's log (TRAINRUN_DEBUG_PRINT_ENV=1) against the agent's
// decisions in topology.json: its place in the job, its GPU (entry
// LOCAL_RANK of the CUDA_VISIBLE_DEVICES every worker gets) and the CPUs it
// was bound to (all of this process's CPUs where the decision leaves it
// unbound). Returns the GPU of each rank.
std::vector<std::string> check_worker_placement(const test::TempDir& dir, int nproc, const std::string& visible) {
  const json t = json::parse(test::read_file(dir / "run/topology.json"));
  REQUIRE(t["decisions"]["ranks"].size() == size_t(nproc));
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  CpuList mine;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) mine.push_back(c);
  std::vector<std::string> gpus;
  for (int rank = 0; rank < nproc; ++rank) {
    const json& d = t["decisions"]["ranks"][size_t(rank)];
    const std::string log = test::read_file(dir / ("run/logs/rank" + std::to_string(rank) + ".log"));
    INFO("rank " << rank << " log:\n" << log);
    const std::string r = std::to_string(rank), n = std::to_string(nproc);
    CHECK_THAT(log, Contains("RANK=" + r + " LOCAL_RANK=" + r + " WORLD_SIZE=" + n + " LOCAL_WORLD_SIZE=" + n + " "));
    const std::string gpu = std::to_string(d["gpu"].get<int>());
    CHECK_THAT(log, Contains("worker GPU: " + gpu + " (entry LOCAL_RANK=" + r + " of CUDA_VISIBLE_DEVICES=" + visible +
                             ")\n"));
    const CpuList decided = parse_cpulist(d["cpus"].get<std::string>());
    CHECK_THAT(log, Contains("worker placement: CPUs=" + cpus_text(decided.empty() ? mine : decided) + "\n"));
    gpus.push_back(gpu);
  }
  return gpus;
}

}  // namespace

// The ISSUE: `nproc_per_node: 0` is one worker per GPU, counted in the
// node's topology and narrowed by CUDA_VISIBLE_DEVICES. Pure parts first.
TEST_CASE("topology: CUDA_VISIBLE_DEVICES is read against the description", "[topology]") {
  Topology t = smi("dgx_h100.txt");
  const std::string where = "parallel.topology_file h100.json";
  auto gpus = [&](const char* v) { return resolve_visible_gpus(t, v, where).gpus; };
  auto count = [&](const char* v) { return resolve_visible_gpus(t, v, where).count; };
  CHECK(gpus(nullptr) == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK_FALSE(resolve_visible_gpus(t, nullptr, where).set);
  CHECK(gpus("2,5") == std::vector<int>{2, 5});
  CHECK(gpus(" 7, 0 ") == std::vector<int>{7, 0});  // CUDA's order is the list's
  for (const char* none : {"", " ", "-1", "NoDevFiles"}) {
    INFO("'" << none << "'");
    const VisibleGpus v = resolve_visible_gpus(t, none, where);
    CHECK(v.set);
    CHECK(v.none());
    CHECK(v.gpus.empty());
  }
  CHECK_THAT(error_of([&] { resolve_visible_gpus(t, "2,9", where); }),
             Contains("CUDA_VISIBLE_DEVICES=2,9: '9' names no GPU: parallel.topology_file h100.json has 8 GPUs "
                      "(indices 0-7); list only those, or unset CUDA_VISIBLE_DEVICES to use every GPU"));
  CHECK_THAT(error_of([&] { resolve_visible_gpus(t, "99999999999", where); }), Contains("names no GPU"));
  CHECK_THAT(error_of([&] { resolve_visible_gpus(t, "1,1", where); }),
             Contains("CUDA_VISIBLE_DEVICES=1,1: GPU 1 is listed twice"));
  CHECK_THAT(error_of([&] { resolve_visible_gpus(t, "0,,1", where); }), Contains("an empty entry"));
  CHECK_THAT(error_of([&] { resolve_visible_gpus(t, "gpu0", where); }),
             Contains("'gpu0' is neither a GPU index (indices 0-7 in parallel.topology_file h100.json) nor a GPU UUID"));
  // nvidia-smi topo -m has no UUIDs: they are counted, not placed.
  const VisibleGpus unknown = resolve_visible_gpus(t, "GPU-aaaa,GPU-bbbb", where);
  CHECK(unknown.count == 2);
  CHECK(unknown.gpus.empty());
  CHECK_THAT(unknown.unmapped, Contains("has no UUIDs"));
  // A CUDA process sees one MIG instance however many are listed.
  CHECK(count("MIG-11111111-2222,MIG-33333333-4444") == 1);
  // With UUIDs (NVML puts them in the description), by UUID or a unique prefix.
  for (Gpu& g : t.gpus) g.uuid = "GPU-" + std::to_string(g.index) + std::to_string(g.index) + "aa-5c2e";
  t = parse_topology_json(topology_to_json(t).dump(), "uuids.json");  // uuids survive a save
  CHECK(t.gpus[3].uuid == "GPU-33aa-5c2e");
  CHECK(gpus("GPU-55aa-5c2e,GPU-2") == std::vector<int>{5, 2});
  CHECK(gpus("gpu-77AA") == std::vector<int>{7});
  CHECK_THAT(error_of([&] { resolve_visible_gpus(t, "GPU-9", where); }),
             Contains("CUDA_VISIBLE_DEVICES=GPU-9: 'GPU-9' names no GPU: no GPU of parallel.topology_file h100.json "
                      "has that UUID"));
  t.gpus[1].uuid = "GPU-22ab";
  CHECK_THAT(error_of([&] { resolve_visible_gpus(t, "GPU-22", where); }),
             Contains("'GPU-22' is the start of the UUIDs of GPUs 1,2"));
  t.gpus[1].uuid = t.gpus[2].uuid;
  CHECK_THAT(error_of([&] { validate_topology(t, "dup.json"); }), Contains("dup.json: GPU2 has uuid GPU-22aa-5c2e"));
}

TEST_CASE("topology: decisions count the usable GPUs for nproc 0", "[topology]") {
  const Topology t = smi("dgx_h100.txt");
  DecisionInputs in;
  in.visible_gpus = {2, 5};
  const Decisions two = decide(t, in);
  CHECK(two.nproc == 2);
  CHECK(gpus_of(two) == std::vector<int>{2, 5});
  in.visible_gpus.clear();
  in.no_visible_gpus = true;
  const Decisions none = decide(t, in);
  CHECK(none.backend == "cpu");
  CHECK(none.nproc == 1);
  CHECK(env_of(none, "CUDA_VISIBLE_DEVICES") == "<unset>");
  CHECK_THAT(none.gpu_order_reason, Contains("CUDA_VISIBLE_DEVICES hides every GPU"));
  in.backend = "cuda";
  in.nproc = 2;
  const Decisions asked = decide(t, in);
  REQUIRE(asked.has_warning("no_gpus"));
  CHECK_THAT(asked.warnings[0].message, Contains("CUDA_VISIBLE_DEVICES hides every GPU"));
}

TEST_CASE("topology: the launch plan resolves nproc_per_node 0 from the topology file", "[topology][launcher]") {
  test::TempDir dir("topo");
  const std::string saved = dir / "h100.json";
  save_topology(smi("dgx_h100.txt"), saved);
  const JobSpec j = parse_job_spec(test::read_file(job(dir, 0, ", topology_file: '" + saved + "'", 8)), "job.yaml");
  const LaunchPlan all = plan_launch(j, {}, {}, "h");
  CHECK(all.mode == LaunchMode::LocalAgent);
  CHECK(all.nproc_per_node == 8);
  CHECK(all.nproc_reason == "parallel.nproc_per_node: 0 -> 8 workers, one per GPU (8 GPUs in parallel.topology_file " +
                                saved + "; CUDA_VISIBLE_DEVICES unset)");
  const LaunchPlan two = plan_launch(j, {}, {{"CUDA_VISIBLE_DEVICES", "2,5"}}, "h");
  CHECK(two.nproc_per_node == 2);
  CHECK(two.nproc_reason == "parallel.nproc_per_node: 0 -> 2 workers, one per GPU (CUDA_VISIBLE_DEVICES=2,5 selects "
                            "GPUs 2,5 of the 8 in parallel.topology_file " + saved + ")");
  const LaunchPlan hidden = plan_launch(j, {}, {{"CUDA_VISIBLE_DEVICES", ""}}, "h");
  CHECK(hidden.mode == LaunchMode::InProcess);
  CHECK(hidden.nproc_per_node == 1);
  CHECK_THAT(hidden.nproc_reason, Contains("0 -> 1 worker: CUDA_VISIBLE_DEVICES='' hides every GPU"));
  JobSpec cpu = j;
  cpu.backend = "cpu";
  CHECK(plan_launch(cpu, {}, {}, "h").mode == LaunchMode::InProcess);
  CHECK_THAT(plan_launch(cpu, {}, {}, "h").nproc_reason, Contains("0 -> 1 worker (backend: cpu"));
  CHECK_THAT(error_of([&] { plan_launch(j, {}, {{"CUDA_VISIBLE_DEVICES", "2,9"}}, "h"); }),
             Contains("CUDA_VISIBLE_DEVICES=2,9: '9' names no GPU"));
  // Every node of a multi-node job counts its own GPUs the same way.
  JobSpec two_nodes = j;
  two_nodes.launcher.nnodes = 2;
  two_nodes.launcher.master_addr = "10.0.0.1";
  LaunchFlags node_one;
  node_one.node_rank = 1;
  const LaunchPlan node = plan_launch(two_nodes, node_one, {{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}}, "h");
  CHECK(node.mode == LaunchMode::NodeAgent);
  CHECK(node.nproc_per_node == 4);
  CHECK(node.first_rank() == 4);
  // An explicit count is the count; a CPU-only description gives 1.
  JobSpec three = j;
  three.parallel.nproc_per_node = 3;
  CHECK(plan_launch(three, {}, {}, "h").nproc_per_node == 3);
  CHECK(plan_launch(three, {}, {}, "h").nproc_reason.empty());
  save_topology(sysfs("cpu_only_2numa"), dir / "cpu.json");
  JobSpec cpu_node = j;
  cpu_node.parallel.topology_file = dir / "cpu.json";
  CHECK(plan_launch(cpu_node, {}, {}, "h").nproc_per_node == 1);
  CHECK_THAT(plan_launch(cpu_node, {}, {}, "h").nproc_reason, Contains("0 -> 1 worker: no GPU in parallel.topology_file"));
}

TEST_CASE("topology: nproc_per_node 0 starts one worker per GPU of parallel.topology_file", "[topology][launcher]") {
  test::TempDir dir("topo");
  const std::string saved = saved_dgx_h100(dir);
  const std::string cfg = job(dir, 0, ", topology_file: '" + saved + "'", 8);
  const auto r = test::run_command(gpu_node_env("-") + "OMP_NUM_THREADS=1 TRAINRUN_DEBUG_PRINT_ENV=1 '" +
                                   test::trainrun_binary() + "' --config '" + cfg + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.err, Contains("launch: parallel.nproc_per_node: 0 -> 8 workers, one per GPU (8 GPUs in "
                             "parallel.topology_file " + saved + "; CUDA_VISIBLE_DEVICES unset)"));
  CHECK_THAT(r.err, Contains("trainrun: starting 8 workers"));
  CHECK_THAT(r.err, Contains("trainrun: all 8 workers finished"));
  // Eight workers, each on its own GPU, each bound as decided.
  std::vector<std::string> gpus = check_worker_placement(dir, 8, "0,1,2,3,4,5,6,7");
  std::sort(gpus.begin(), gpus.end());
  CHECK(gpus == std::vector<std::string>{"0", "1", "2", "3", "4", "5", "6", "7"});
  CHECK(test::losses(dir / "run/metrics.jsonl").size() == 1);
}

TEST_CASE("topology: nproc_per_node 0 follows CUDA_VISIBLE_DEVICES and backend cpu", "[topology][launcher]") {
  test::TempDir dir("topo");
  const std::string saved = saved_dgx_h100(dir);
  const std::string cfg = job(dir, 0, ", topology_file: '" + saved + "'", 8);
  const std::string run = "OMP_NUM_THREADS=1 TRAINRUN_DEBUG_PRINT_ENV=1 '" + test::trainrun_binary() + "' --config '" + cfg + "'";

  // A subset: two workers, rank 0 on GPU 2 and rank 1 on GPU 5.
  const auto two = test::run_command(gpu_node_env("2,5") + run);
  INFO(two.err);
  REQUIRE(two.exit_code == 0);
  CHECK_THAT(two.err, Contains("launch: parallel.nproc_per_node: 0 -> 2 workers, one per GPU (CUDA_VISIBLE_DEVICES=2,5 "
                               "selects GPUs 2,5 of the 8 in parallel.topology_file " + saved + ")"));
  CHECK_THAT(two.err, Contains("trainrun: all 2 workers finished"));
  CHECK(check_worker_placement(dir, 2, "2,5") == std::vector<std::string>{"2", "5"});

  // backend: cpu uses no GPU: one worker, in this process.
  test::TempDir cpu_dir("topo");
  const auto cpu = test::run_command(gpu_node_env("-") + "OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" +
                                     job(cpu_dir, 0, ", topology_file: '" + saved + "'", 8) + "' --set backend=cpu");
  INFO(cpu.err);
  REQUIRE(cpu.exit_code == 0);
  CHECK_THAT(cpu.err, Contains("launch: in-process: one worker, no agent"));
  CHECK_THAT(cpu.err, Contains("launch: parallel.nproc_per_node: 0 -> 1 worker (backend: cpu"));
  CHECK_FALSE(test::file_exists(cpu_dir / "run/logs"));
  CHECK(test::losses(cpu_dir / "run/metrics.jsonl").size() == 1);

  // A GPU the node does not have: a clear error before anything starts.
  test::TempDir bad_dir("topo");
  const auto bad = test::run_command(gpu_node_env("2,9") + "OMP_NUM_THREADS=1 '" + test::trainrun_binary() +
                                     "' --config '" + job(bad_dir, 0, ", topology_file: '" + saved + "'", 8) + "'");
  CHECK(bad.exit_code == 1);
  CHECK_THAT(bad.err, Contains("error: CUDA_VISIBLE_DEVICES=2,9: '9' names no GPU: parallel.topology_file " + saved +
                               " has 8 GPUs (indices 0-7)"));
  CHECK_FALSE(test::file_exists(bad_dir / "run/logs"));
  // The same check guards an explicit count.
  test::TempDir bad2_dir("topo");
  const auto bad2 = test::run_command(gpu_node_env("2,9") + "OMP_NUM_THREADS=1 '" + test::trainrun_binary() +
                                      "' --config '" + job(bad2_dir, 2, ", topology_file: '" + saved + "'", 8) + "'");
  CHECK(bad2.exit_code == 1);
  CHECK_THAT(bad2.err, Contains("CUDA_VISIBLE_DEVICES=2,9: '9' names no GPU"));
  CHECK_FALSE(test::file_exists(bad2_dir / "run/logs"));
}

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
  const auto r = test::run_command(gpu_node_env("-") + "OMP_NUM_THREADS=1 CUDA_DEVICE_ORDER=FASTEST_FIRST '" +
                                   test::trainrun_binary() + "' --config '" + cfg + "'");
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

TEST_CASE("topology: TP groups follow the rank -> GPU order, so tp stays inside NVLink islands", "[topology][tp]") {
  // NVLink pairs {0,2} and {1,3} interleaved in PCI order: decide() makes
  // islands contiguous in rank order, so tp2's groups of consecutive ranks
  // land on the pairs.
  Topology x = smi("pcie_nvlink_pairs.txt");
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b)
      if (a != b) x.links[size_t(a)][size_t(b)] = (a % 2 == b % 2) ? Link{LinkKind::NVLink, 4} : Link{LinkKind::Node, 0};
  const Decisions d = decide_for(x, 0, "cuda");
  const auto g2 = tp_groups(x, d, 2);
  REQUIRE(g2.size() == 2);
  CHECK(g2[0].kind == TpLinkKind::NVLink);
  CHECK(g2[1].kind == TpLinkKind::NVLink);
  CHECK(g2[0].gpus == std::vector<int>{0, 2});
  CHECK(tp_groups_warning(x, d, 2).empty());
  const auto g4 = tp_groups(x, d, 4);
  REQUIRE(g4.size() == 1);
  CHECK(g4[0].kind == TpLinkKind::PCIe);
  CHECK(link_code(g4[0].slowest) == "NODE");
  CHECK_THAT(tp_groups_warning(x, d, 4), Contains("lower parallel.tensor_parallel to 2"));
  // tp 8 over 4 ranks: the group continues on the next node; the agent
  // leaves that warning to the trainer.
  const auto g8 = tp_groups(x, d, 8);
  REQUIRE(g8.size() == 1);
  CHECK(g8[0].kind == TpLinkKind::CrossNode);
  CHECK_THAT(tp_groups_warning(x, d, 8), Contains("cross-node"));
  CHECK(tp_groups_warning(x, d, 8, /*include_cross_node=*/false).empty());
  // The CPU backend: ranks of one host, nothing to warn about.
  const Decisions cpu = decide_for(x, 4, "cpu");
  CHECK(tp_groups(x, cpu, 4)[0].kind == TpLinkKind::Host);
  CHECK(tp_groups_warning(x, cpu, 4).empty());
  // tp 1: no groups to speak of.
  CHECK(tp_groups(x, d, 1)[0].kind == TpLinkKind::Single);
}
