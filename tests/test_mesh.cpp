// The resolved device mesh in words: every rank's (pp, dp_replicate,
// dp_shard, tp) coordinates and the groups, as logged at start and written
// into job.resolved.yaml (which must still load as the same job), compact
// for meshes of thousands of ranks; and a real tp2 x dp2 run's log and file.
#include <catch2/catch.hpp>
#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/config/job_spec.h"
#include "parallel/mesh/device_mesh.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;
using Catch::Matchers::Contains;

TEST_CASE("mesh: rank coordinates and groups at tp2 x dp2, and compact for many ranks", "[mesh]") {
  const MeshDims d = plan_mesh(4, 2, 1, "full_shard", 1);
  CHECK(describe_rank_coords(d) == "0->(0,0,0,0) 1->(0,0,0,1) 2->(0,0,1,0) 3->(0,0,1,1)");
  CHECK(describe_mesh_groups(d) == "tp [0, 1] [2, 3]; dp_shard [0, 2] [1, 3]");
  CHECK(mesh_groups(d, MeshDim::tp) == std::vector<std::vector<int>>{{0, 1}, {2, 3}});
  // hybrid_shard 2 x 2 with tp2 over 8 ranks: dp_replicate is the outer dp dim.
  const MeshDims h = plan_mesh(8, 2, 1, "hybrid_shard", 2);
  CHECK(describe_rank_coords(h) ==
        "0->(0,0,0,0) 1->(0,0,0,1) 2->(0,0,1,0) 3->(0,0,1,1) 4->(0,1,0,0) 5->(0,1,0,1) 6->(0,1,1,0) 7->(0,1,1,1)");
  CHECK(describe_mesh_groups(h) == "tp [0, 1] [2, 3] [4, 5] [6, 7]; dp_shard [0, 2] [1, 3] [4, 6] [5, 7]; "
                                   "dp_replicate [0, 4] [1, 5] [2, 6] [3, 7]");
  // 8192 ranks (1024 nodes of 8) at tp8: one short line, first and last ranks.
  const MeshDims big = plan_mesh(8192, 8, 1, "full_shard", 1);
  const std::string line = describe_rank_coords(big);
  CHECK(line.size() < 400);
  CHECK_THAT(line, Contains("0->(0,0,0,0) ") && Contains(" ... ") && Contains("8191->(0,0,1023,7)") &&
                       Contains("8192 ranks; rank = ((pp * dp_replicate_size + dp_replicate)"));
  CHECK(describe_mesh_groups(big).size() < 600);
  CHECK_THAT(describe_mesh_groups(big), Contains("dp_shard [0, 8, ..., 8184] [1, 9, ..., 8185]") && Contains("... (1024 groups of 8)") && Contains("[7, 15, ..., 8191] (8 groups of 1024)"));
  CHECK_THAT(resolved_mesh_yaml(big, false), Contains("listed: false") && !Contains("\n  ranks:"));
}

TEST_CASE("mesh: job.resolved.yaml's resolved_mesh section loads back as the same job", "[mesh][config]") {
  const std::string spec = "model: {n_layer: 2, n_head: 4, n_embd: 16, vocab_size: 23, seq_len: 8}\n"
                           "data: {format: synthetic}\n"
                           "parallel: {tensor_parallel: 2, sequence_parallel: true}\n";
  const JobSpec job = parse_job_spec(spec, "job.yaml");
  const std::string yaml = job_spec_to_yaml(job) + resolved_mesh_yaml(plan_mesh(4, 2, 1, "full_shard", 1), true);
  CHECK_THAT(yaml, Contains("\nresolved_mesh:\n  world: 4\n  dims: {pp: 1, dp_replicate: 1, dp_shard: 2, tp: 2}\n"
                            "  dp: 2\n  sequence_parallel: true\n"));
  CHECK_THAT(yaml, Contains("  groups:\n    tp: [[0, 1], [2, 3]]\n    dp_shard: [[0, 2], [1, 3]]\n"
                            "    dp_replicate: [[0], [1], [2], [3]]\n    pp: [[0], [1], [2], [3]]\n"));
  CHECK_THAT(yaml, Contains("  ranks:\n    0: [0,0,0,0]\n    1: [0,0,0,1]\n    2: [0,0,1,0]\n    3: [0,0,1,1]\n"));
  CHECK(job_spec_to_yaml(parse_job_spec(yaml, "job.resolved.yaml")) == job_spec_to_yaml(job));
  // Not a map: refused, naming the key and that it is not a setting.
  try {
    parse_job_spec(spec + "resolved_mesh: 4\n", "job.yaml");
    FAIL("a scalar resolved_mesh was accepted");
  } catch (const std::exception& e) {
    CHECK_THAT(e.what(), Contains("resolved_mesh") && Contains("must be a map") && Contains("not a setting"));
  }
  // Only at the top level.
  CHECK_THROWS_WITH(parse_job_spec(spec + "train: {resolved_mesh: {}}\n", "job.yaml"),
                    Contains("train.resolved_mesh: unknown key"));
}

TEST_CASE("mesh: a tp2 x dp2 run logs the mesh and writes it into job.resolved.yaml", "[mesh][tp]") {
  TempDir dir("mesh_run");
  write_file(dir / "job.yaml",
             "backend: cpu\n"
             "model: {arch: llama, n_layer: 2, n_head: 4, n_kv_head: 2, n_embd: 16, ffn_dim: 24, vocab_size: 23, "
             "seq_len: 8}\n"
             "data: {format: synthetic}\n"
             "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 2, log_interval: 1, eval_interval: 0, "
             "eval_steps: 1, warmup_steps: 1}\n"
             "parallel: {nproc_per_node: 4, tensor_parallel: 2, sharding: full_shard, timeout_s: 60}\n"
             "output: {dir: '" + dir / "run" + "', sample_tokens: 0}\n");
  const auto r = run_command("OMP_NUM_THREADS=1 '" + trainrun_binary() + "' --config '" + dir / "job.yaml" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string log = read_file(dir / "run/logs/rank0.log");
  CHECK_THAT(log, Contains("mesh: pp1 x dp_replicate1 x dp_shard2 x tp2 (4 ranks;"));
  CHECK_THAT(log, Contains("mesh: rank -> (pp, dp_replicate, dp_shard, tp): 0->(0,0,0,0) 1->(0,0,0,1) 2->(0,0,1,0) "
                           "3->(0,0,1,1)"));
  CHECK_THAT(log, Contains("mesh: groups: tp [0, 1] [2, 3]; dp_shard [0, 2] [1, 3]"));
  // Logged once (rank 0), not by every rank.
  CHECK_THAT(read_file(dir / "run/logs/rank1.log"), !Contains("mesh: rank ->"));
  const std::string yaml = read_file(dir / "run/job.resolved.yaml");
  CHECK_THAT(yaml, Contains("\nresolved_mesh:\n  world: 4\n  dims: {pp: 1, dp_replicate: 1, dp_shard: 2, tp: 2}\n"));
  CHECK_THAT(yaml, Contains("    tp: [[0, 1], [2, 3]]\n    dp_shard: [[0, 2], [1, 3]]\n"));
  CHECK_THAT(yaml, Contains("    3: [0,0,1,1]\n"));
  CHECK_FALSE(file_exists(dir / "run/.job.resolved.yaml.tmp"));
  // metrics.jsonl: rank 0's time inside TP collectives, and its share of the step.
  std::istringstream metrics(read_file(dir / "run/metrics.jsonl"));
  int records = 0;
  for (std::string line; std::getline(metrics, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    INFO(line);
    REQUIRE(j.contains("tp_comm_ms"));
    CHECK(j.at("tp_comm_ms").get<double>() > 0);
    CHECK(j.at("tp_comm_fraction").get<double>() >= 0);
    CHECK(j.at("tp_comm_fraction").get<double>() <= 1);
    CHECK(j.at("tp_comm_ms").get<double>() <= j.at("ms_per_step").get<double>());
    ++records;
  }
  CHECK(records == 2);
  // The file is still a job spec: validate loads it (the section ignored).
  const auto v = run_trainrun("validate --config '" + dir / "run/job.resolved.yaml" + "'");
  INFO(v.err);
  CHECK(v.exit_code == 0);
  CHECK_THAT(v.out, Contains("tensor_parallel: 2") && !Contains("resolved_mesh"));
}

// Issue 30 item 17: under full_shard (dp_replicate 1) the flattened dp group
// is the dp_shard group, under no_shard the dp_replicate one; a second
// communicator over the same ranks (on NCCL: its own GPU buffers and
// stream) is not built. Only hybrid_shard with both dims > 1 has a dp group
// of its own.
TEST_CASE("mesh: the dp group reuses the dp_shard or dp_replicate communicator when they are the same ranks",
          "[mesh]") {
  struct Case {
    const char* sharding;
    int world, tp, pp, group;
    int expect_built;
    MeshDim same_as;  // the dim whose communicator dp() is; tp = a dp communicator of its own
  };
  for (const Case& c : {Case{"full_shard", 4, 2, 1, 1, 2, MeshDim::dp_shard},       // tp, dp_shard
                        Case{"shard_grad_op", 8, 1, 2, 1, 2, MeshDim::dp_shard},    // dp_shard, pp
                        Case{"no_shard", 4, 2, 1, 1, 2, MeshDim::dp_replicate},     // tp, dp_replicate
                        Case{"hybrid_shard", 8, 2, 1, 2, 4, MeshDim::tp},           // tp, shard, replicate, dp
                        Case{"hybrid_shard", 8, 2, 1, 4, 2, MeshDim::dp_shard}}) {  // one group: = full_shard
    INFO(c.sharding << " world " << c.world << " tp" << c.tp << " pp" << c.pp << " group " << c.group);
    const MeshDims dims = plan_mesh(c.world, c.tp, c.pp, c.sharding, c.group);
    for (int r = 0; r < c.world; ++r) {
      int made = 0;
      std::vector<std::string> prefixes;
      const MeshComms comms(DeviceMesh(dims, r), [&](const std::string& prefix, int, int) {
        ++made;
        prefixes.push_back(prefix);
        return make_single_communicator();  // counted, never used
      });
      INFO("rank " << r);
      CHECK(made == c.expect_built);
      CHECK(comms.built() == c.expect_built);
      REQUIRE(comms.dp() != nullptr);
      if (c.same_as == MeshDim::tp) {
        CHECK(comms.dp() != comms.comm(MeshDim::dp_shard));
        CHECK(comms.dp() != comms.comm(MeshDim::dp_replicate));
        CHECK(std::count(prefixes.begin(), prefixes.end(), DeviceMesh(dims, r).dp_group_name() + "/") == 1);
      } else {
        CHECK(comms.dp() == comms.comm(c.same_as));
      }
    }
  }
}

// Issue 30 item 2: hybrid_shard's default group is the dp ranks of a node
// (or NVLink island), at most dp and a divisor of it; plan_mesh takes it
// for every pipeline degree a node allows.
TEST_CASE("mesh: the default hybrid_shard group divides the dp group at every pp degree", "[mesh]") {
  CHECK(default_hybrid_shard_group(8, 1, 8) == 8);   // one node, pp1: the node
  CHECK(default_hybrid_shard_group(8, 2, 4) == 4);   // tp2: 4 dp ranks per node
  CHECK(default_hybrid_shard_group(4, 1, 2) == 2);   // one node of 4 at pp2: dp 2
  CHECK(default_hybrid_shard_group(8, 2, 2) == 2);   // tp2 x pp2 on 8: dp 2
  CHECK(default_hybrid_shard_group(8, 1, 16) == 8);  // 2 nodes at pp1 ... or 4 nodes at pp2: a node each
  CHECK(default_hybrid_shard_group(6, 1, 4) == 2);   // 6 ranks a node, dp 4: the largest common divisor
  for (int nodes : {1, 2, 4})
    for (int per_node : {4, 8})
      for (int tp : {1, 2})
        for (int pp : {1, 2, 4}) {
          const int world = nodes * per_node;
          if (world % (tp * pp) != 0) continue;
          const int dp = world / (tp * pp);
          const int g = default_hybrid_shard_group(per_node, tp, dp);
          INFO(nodes << " x " << per_node << " tp" << tp << " pp" << pp << ": group " << g);
          const MeshDims d = plan_mesh(world, tp, pp, "hybrid_shard", g);
          CHECK(d.dp_shard * d.dp_replicate == dp);
          CHECK(g * tp <= per_node);  // a shard group never leaves a node
        }
}

// Issue 27: cp sits between dp_shard and tp (tp innermost), so a cp group is
// cp ranks tp apart; a mesh without cp reads exactly as before.
TEST_CASE("mesh: cp is a dimension between dp_shard and tp, its groups tp apart", "[mesh][cp]") {
  const MeshDims d = plan_mesh(16, 2, 1, "full_shard", 1, 2);  // dp_shard4 x cp2 x tp2
  CHECK((d.pp == 1 && d.dp_shard == 4 && d.cp == 2 && d.tp == 2 && d.world() == 16));
  CHECK(d.describe() == "pp1 x dp_replicate1 x dp_shard4 x cp2 x tp2");
  const DeviceMesh m(d, 7);  // (0,0,1,1,1)
  CHECK(m.coord(MeshDim::cp) == 1);
  CHECK(m.coord(MeshDim::dp_shard) == 1);
  CHECK(m.coord(MeshDim::tp) == 1);
  CHECK(m.rank_at(0, 0, 1, 1, 1) == 7);
  CHECK_THROWS_WITH(m.rank_at(0, 0, 1, 1), Contains("rank_at without a cp coordinate"));
  CHECK(m.group_ranks(MeshDim::cp) == std::vector<int>{5, 7});
  CHECK(m.group_ranks(MeshDim::tp) == std::vector<int>{6, 7});
  CHECK(m.group_ranks(MeshDim::dp_shard) == std::vector<int>{3, 7, 11, 15});  // at its own cp and tp index
  CHECK(m.group_name(MeshDim::cp) == "cp3");   // dp_shard 1, tp 1: 1 * 2 + 1
  CHECK(m.dp_group_name() == "dp3");           // (cp 1, tp 1)
  CHECK(mesh_groups(d, MeshDim::cp) ==
        std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK_THAT(describe_mesh_groups(d), Contains("tp [0, 1] [2, 3]") && Contains("; cp [0, 2] [1, 3] [4, 6]") &&
                                          Contains("; dp_shard [0, 4, 8, 12]"));
  CHECK_THAT(describe_rank_coords(d), Contains("7->(0,0,1,1,1) ") && Contains("15->(0,0,3,1,1)"));
  const std::string y = resolved_mesh_yaml(d, false);
  CHECK_THAT(y, Contains("dims: {pp: 1, dp_replicate: 1, dp_shard: 4, cp: 2, tp: 2}") &&
                    Contains("    cp: [[0, 2], [1, 3], [4, 6]") && Contains("[pp, dp_replicate, dp_shard, cp, tp]") &&
                    Contains("    7: [0,0,1,1,1]\n") && Contains("* cp_size + cp) * tp_size + tp"));
  // Every dim's groups still partition the ranks, under one name per group.
  for (MeshDim dim : {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::cp, MeshDim::tp}) {
    std::vector<int> seen(16, 0);
    for (const auto& g : mesh_groups(d, dim)) {
      for (int r : g) {
        seen[size_t(r)]++;
        CHECK(DeviceMesh(d, r).group_name(dim) == DeviceMesh(d, g[0]).group_name(dim));
      }
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  }
  // A bad world names the cp factor; without cp the message is unchanged.
  CHECK_THROWS_WITH(plan_mesh(12, 2, 1, "full_shard", 1, 4),
                    Contains("parallel.tensor_parallel (2) x parallel.pipeline_parallel (1) x "
                             "parallel.context_parallel (4) = 8"));
  CHECK_THROWS_WITH(plan_mesh(16, 2, 1, "hybrid_shard", 3, 2),
                    Contains("dp = 16 ranks / (tensor_parallel 2 x pipeline_parallel 1 x context_parallel 2) = 4"));
  CHECK_THROWS_WITH(plan_mesh(4, 1, 1, "full_shard", 1, 0), Contains("parallel.context_parallel: 0"));
  // MeshComms builds the cp communicator (after tp, before dp_shard), under the group's name.
  for (int r = 0; r < 16; ++r) {
    std::vector<std::string> prefixes;
    const MeshComms comms(DeviceMesh(d, r), [&](const std::string& prefix, int rank, int world) {
      prefixes.push_back(prefix + std::to_string(rank) + "/" + std::to_string(world));
      return make_single_communicator();
    });
    const DeviceMesh mr(d, r);
    REQUIRE(prefixes.size() == 3);  // tp, cp, dp_shard (= dp)
    CHECK(prefixes[1] == mr.group_name(MeshDim::cp) + "/" + std::to_string(mr.coord(MeshDim::cp)) + "/2");
    CHECK(comms.comm(MeshDim::cp) != nullptr);
    CHECK(comms.dp() == comms.comm(MeshDim::dp_shard));
  }
}

TEST_CASE("mesh: trainrun topo --cp shows the context-parallel groups", "[mesh][cp]") {
  const auto r = run_trainrun("topo --nproc 8 --tp 2 --cp 2 --json");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  REQUIRE(j.contains("cp_groups"));
  CHECK(j["cp_groups"]["cp"] == 2);
  std::vector<std::vector<int>> groups;
  for (const auto& g : j["cp_groups"]["groups"]) groups.push_back(g["ranks"].get<std::vector<int>>());
  CHECK(groups == std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  const auto text = run_trainrun("topo --nproc 4 --cp 4");
  REQUIRE(text.exit_code == 0);
  CHECK_THAT(text.out, Contains("context-parallel groups (cp 4 at tp 1") && Contains("ranks 0-3"));
}
