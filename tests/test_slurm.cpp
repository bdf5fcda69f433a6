// Slurm without Slurm: the hostlist parser (parallel/rendezvous/hostlist.h), the launch
// mode detection from fake SLURM_* environments (core/launch/launch_mode.h),
// and the "direct workers" mode end to end, two trainrun processes given
// the environment srun would give two tasks of one node.
//
// The real-cluster check (slurmctld + slurmd on this machine, sbatch,
// scancel --signal=USR1, requeue) is scripts/slurm/local-cluster-test.sh;
// the last test here runs it (as root, where Slurm is installed or may be).
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "core/config/job_spec.h"
#include "core/launch/launch_mode.h"
#include "core/launch/node_group.h"
#include "parallel/rendezvous/hostlist.h"
#include "tests/support/process_util.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Strings = std::vector<std::string>;

namespace {

std::string hostlist_error(const std::string& list) {
  try {
    expand_hostlist(list);
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

JobSpec job_with(const std::string& extra) {
  return parse_job_spec("model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 16, seq_len: 16}\n"
                        "data: {format: synthetic}\n"
                        "train: {global_batch_size: 16, micro_batch_size: 1}\n" +
                            extra,
                        "job.yaml");
}

// What srun gives task `procid` of a step with `ntasks` tasks on `nnodes` nodes.
EnvMap srun_env(int ntasks, int nnodes, int procid, int nodeid, int localid, const std::string& per_node,
                const std::string& nodelist, const std::string& job_id = "4242") {
  return EnvMap{{"SLURM_JOB_ID", job_id},
                {"SLURM_STEP_ID", "0"},
                {"SLURM_NTASKS", std::to_string(ntasks)},
                {"SLURM_STEP_NUM_TASKS", std::to_string(ntasks)},
                {"SLURM_NNODES", std::to_string(nnodes)},
                {"SLURM_STEP_NUM_NODES", std::to_string(nnodes)},
                {"SLURM_PROCID", std::to_string(procid)},
                {"SLURM_NODEID", std::to_string(nodeid)},
                {"SLURM_LOCALID", std::to_string(localid)},
                {"SLURM_STEP_TASKS_PER_NODE", per_node},
                {"SLURM_JOB_NODELIST", nodelist},
                {"SLURM_STEP_NODELIST", nodelist}};
}

std::string plan_error(const JobSpec& job, const LaunchFlags& f, const EnvMap& env) {
  try {
    plan_launch(job, f, env, "h");
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

using test::losses;

int free_port() {
  // A port the kernel just handed out and nobody listens on now; the store
  // binds it with SO_REUSEADDR.
  const auto r = test::run_command("python3 -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\",0)); "
                                   "print(s.getsockname()[1])'");
  return std::atoi(r.out.c_str());
}

}  // namespace

// ---- hostlists ------------------------------------------------------------------------------

TEST_CASE("slurm: hostlist expands ranges, lists and zero padding", "[slurm]") {
  CHECK(expand_hostlist("node01") == Strings{"node01"});
  CHECK(expand_hostlist("node[01-04,07]") == Strings{"node01", "node02", "node03", "node04", "node07"});
  CHECK(expand_hostlist("gpu-a[1-2],gpu-b3") == Strings{"gpu-a1", "gpu-a2", "gpu-b3"});
  CHECK(expand_hostlist("n[8-11]") == Strings{"n8", "n9", "n10", "n11"});
  CHECK(expand_hostlist("n[08-11]") == Strings{"n08", "n09", "n10", "n11"});
  CHECK(expand_hostlist("n[098-101]") == Strings{"n098", "n099", "n100", "n101"});
  CHECK(expand_hostlist("node[7]") == Strings{"node7"});
  CHECK(expand_hostlist("node[3,1,2]") == Strings{"node3", "node1", "node2"});  // Slurm's order is kept
  CHECK(expand_hostlist("n1,n1") == Strings{"n1", "n1"});
  CHECK(expand_hostlist("[1-3]") == Strings{"1", "2", "3"});
  CHECK(expand_hostlist("10.0.0.[1-2],login.example.org") == Strings{"10.0.0.1", "10.0.0.2", "login.example.org"});
  CHECK(expand_hostlist("a[1-2]x,b") == Strings{"a1x", "a2x", "b"});
  CHECK(expand_hostlist("n[0-0]") == Strings{"n0"});
}

TEST_CASE("slurm: hostlist expands several bracket groups as a product", "[slurm]") {
  CHECK(expand_hostlist("rack[1-2]-node[01-02]") ==
        Strings{"rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"});
  CHECK(expand_hostlist("a[1-2]b[3,5]c,z[9-10]") == Strings{"a1b3c", "a1b5c", "a2b3c", "a2b5c", "z9", "z10"});
  CHECK(expand_hostlist("r[1-3]n[1-2]").size() == 6);
  CHECK(first_host("rack[2-3]-node[07-08],x") == "rack2-node07");
}

TEST_CASE("slurm: malformed hostlists get exact messages", "[slurm]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "hostlist '': the list is empty (expected host names such as node[01-04],gpu7)"},
      {"node[1-2", "hostlist 'node[1-2': '[' at column 5 has no matching ']'"},
      {"node[1-", "hostlist 'node[1-': '[' at column 5 has no matching ']'"},
      {"node1-2]", "hostlist 'node1-2]': ']' at column 8 has no matching '['"},
      {"node[[1-2]]",
       "hostlist 'node[[1-2]]': '[' at column 6 inside the brackets opened at column 5 (brackets do not nest)"},
      {"node[5-3]",
       "hostlist 'node[5-3]': reversed range 5-3 at column 6 (the upper bound must not be below the lower bound)"},
      {"node[]", "hostlist 'node[]': empty brackets at column 5 (expected numbers such as [1-4,7])"},
      {"node[1,,2]", "hostlist 'node[1,,2]': missing number at column 8 (in the brackets opened at column 5)"},
      {"node[,1]", "hostlist 'node[,1]': missing number at column 6 (in the brackets opened at column 5)"},
      {"node[1-]", "hostlist 'node[1-]': range at column 6 has no upper bound"},
      {"node[a-b]",
       "hostlist 'node[a-b]': unexpected 'a' at column 6 (inside brackets only numbers, '-' and ',' are allowed)"},
      {"node[1-2x]",
       "hostlist 'node[1-2x]': unexpected 'x' at column 9 (inside brackets only numbers, '-' and ',' are allowed)"},
      {"a,,b", "hostlist 'a,,b': empty host name at column 3 (two commas in a row?)"},
      {",a", "hostlist ',a': the list starts with ',' (expected a host name at column 1)"},
      {"a,", "hostlist 'a,': ',' at column 2 is not followed by a host name"},
      {"a b", "hostlist 'a b': whitespace at column 2 (hosts are separated by commas, without spaces)"},
      {"n[99999999999999999999]", "hostlist 'n[99999999999999999999]': number at column 3 is too large"},
      {"n[1-99999999]", "hostlist 'n[1-99999999]': expands to more than 1048576 hosts; is a range mistyped?"},
      {"a[1-2000]b[1-2000]", "hostlist 'a[1-2000]b[1-2000]': expands to more than 1048576 hosts; is a range mistyped?"},
      {"n[0-18446744073709551615]",
       "hostlist 'n[0-18446744073709551615]': expands to more than 1048576 hosts; is a range mistyped?"},
  };
  for (const auto& [list, message] : cases) {
    INFO("list: '" << list << "'");
    CHECK(hostlist_error(list) == message);
  }
  CHECK_THROWS_WITH(first_host("node[1-2"), "hostlist 'node[1-2': '[' at column 5 has no matching ']'");
}

TEST_CASE("slurm: Slurm's tasks per node expand", "[slurm]") {
  CHECK(expand_tasks_per_node("8") == std::vector<int>{8});
  CHECK(expand_tasks_per_node("8(x2)") == std::vector<int>{8, 8});
  CHECK(expand_tasks_per_node("2(x3),1") == std::vector<int>{2, 2, 2, 1});
  for (const char* bad : {"", "x", "2(x)", "2(3)", "2,", ",2", "2(x2", "1 2"}) {
    INFO(bad);
    CHECK_THROWS_WITH(expand_tasks_per_node(bad), "tasks per node '" + std::string(bad) +
                                                     "' is not in Slurm's form (e.g. 8 or 2(x3),1)");
  }
}

TEST_CASE("slurm: the store port comes from the job id in a fixed range", "[slurm]") {
  CHECK(slurm_port_for_job("4242") == 24242);
  CHECK(slurm_port_for_job("123456") == 23456);
  CHECK(slurm_port_for_job("123457") != slurm_port_for_job("123456"));  // two jobs sharing a node
  for (const char* id : {"0", "9999", "10000", "987654321", "not-a-number"}) {
    const int p = slurm_port_for_job(id);
    CHECK(p >= kSlurmPortBase);
    CHECK(p < kSlurmPortBase + kSlurmPortSpan);
  }
}

// ---- launch mode detection ----------------------------------------------------------------------

TEST_CASE("slurm: outside Slurm one worker trains in-process and several get a local agent", "[slurm]") {
  LaunchPlan p = plan_launch(job_with("parallel: {nproc_per_node: 1}\n"), {}, {}, "h");
  CHECK(p.mode == LaunchMode::InProcess);
  CHECK(p.nnodes == 1);
  CHECK(p.describe() == "in-process: one worker, no agent, on h");
  p = plan_launch(job_with("parallel: {nproc_per_node: 4}\n"), {}, {}, "h");
  CHECK(p.mode == LaunchMode::LocalAgent);
  CHECK(p.world_size() == 4);
  CHECK(p.describe() ==
        "one node: an agent runs 4 workers on h; rendezvous store 127.0.0.1:<free port> (address: "
        "launcher.master_addr; port: picked at start)");
  p = plan_launch(job_with("parallel: {nproc_per_node: 1}\nlauncher: {max_restarts: 2}\n"), {}, {}, "h");
  CHECK(p.mode == LaunchMode::LocalAgent);  // restarts need a supervisor
}

TEST_CASE("slurm: srun with one task per node runs one agent per node", "[slurm]") {
  const JobSpec job = job_with("parallel: {nproc_per_node: 8}\n");
  const LaunchPlan p = plan_launch(job, {}, srun_env(2, 2, 1, 1, 0, "1(x2)", "gpu-a[07-08]"), "gpu-a08");
  CHECK(p.mode == LaunchMode::NodeAgent);
  CHECK(p.slurm_job_id == "4242");
  CHECK(p.nnodes == 2);
  CHECK(p.node_rank == 1);
  CHECK(p.nproc_per_node == 8);
  CHECK(p.first_rank() == 8);
  CHECK(p.world_size() == 16);
  CHECK(p.master_addr == "gpu-a07");
  CHECK(p.master_port == 24242);
  CHECK(p.describe() ==
        "Slurm job 4242, one agent per node (srun --ntasks-per-node=1): node 1 of 2 on gpu-a08, 8 workers per node "
        "(ranks 8-15 of 16); rendezvous store gpu-a07:24242 (address: first host of SLURM_STEP_NODELIST "
        "'gpu-a[07-08]'; port: from SLURM_JOB_ID 4242)");
  // Node 0 of the same step agrees on the store.
  const LaunchPlan p0 = plan_launch(job, {}, srun_env(2, 2, 0, 0, 0, "1(x2)", "gpu-a[07-08]"), "gpu-a07");
  CHECK(p0.node_rank == 0);
  CHECK(p0.master_addr == p.master_addr);
  CHECK(p0.master_port == p.master_port);
  // Without SLURM_NODEID the task id is the node id (one task per node).
  EnvMap env = srun_env(3, 3, 2, 0, 0, "1(x3)", "n[1-3]");
  env.erase("SLURM_NODEID");
  CHECK(plan_launch(job, {}, env, "n3").node_rank == 2);
  // Only SLURM_JOB_NODELIST (older Slurm): still node 0's host.
  env = srun_env(2, 2, 1, 1, 0, "1(x2)", "x");
  env.erase("SLURM_STEP_NODELIST");
  env["SLURM_JOB_NODELIST"] = "rack[1-2]-n[5-6]";
  CHECK(plan_launch(job, {}, env, "h").master_addr == "rack1-n5");
}

TEST_CASE("slurm: srun with several tasks per node makes each task a worker", "[slurm]") {
  const JobSpec job = job_with("parallel: {nproc_per_node: 0}\n");
  LaunchPlan p = plan_launch(job, {}, srun_env(16, 2, 9, 1, 1, "8(x2)", "node[01-02]"), "node02");
  CHECK(p.mode == LaunchMode::SlurmWorker);
  CHECK(p.rank == 9);
  CHECK(p.local_rank == 1);
  CHECK(p.world == 16);
  CHECK(p.local_world == 8);
  CHECK(p.node_rank == 1);
  CHECK(p.nnodes == 2);
  CHECK(p.master_addr == "node01");
  CHECK(p.master_port == 24242);
  CHECK(p.warnings.empty());
  CHECK(p.describe() ==
        "Slurm job 4242, direct workers (srun --ntasks-per-node=8, no agent): rank 9 of 16, local rank 1 of 8 on "
        "node 1 of 2 (node02); rendezvous store node01:24242 (address: first host of SLURM_STEP_NODELIST "
        "'node[01-02]'; port: from SLURM_JOB_ID 4242)");
  // Uneven nodes: 3 tasks on node 0, 1 on node 1.
  p = plan_launch(job, {}, srun_env(4, 2, 3, 1, 0, "3,1", "a,b"), "b");
  CHECK(p.local_world == 1);
  CHECK(p.master_addr == "a");
  // One node: the tasks meet on loopback, on the job's port.
  p = plan_launch(job, {}, srun_env(4, 1, 2, 0, 2, "4", "n7"), "n7");
  CHECK(p.mode == LaunchMode::SlurmWorker);
  CHECK(p.master_addr == "127.0.0.1");
  CHECK(p.master_port == 24242);
  // The spec's worker count does not apply: srun decided.
  p = plan_launch(job_with("parallel: {nproc_per_node: 2}\n"), {}, srun_env(16, 2, 9, 1, 1, "8(x2)", "n[1-2]"), "n2");
  REQUIRE(p.warnings.size() == 1);
  CHECK(p.warnings[0] == "parallel.nproc_per_node (2) is not used: srun started 8 tasks on this node, each one worker");
}

TEST_CASE("slurm: a configured master address and port win over Slurm's", "[slurm]") {
  const EnvMap env = srun_env(2, 2, 1, 1, 0, "1(x2)", "n[1-2]");
  LaunchPlan p = plan_launch(job_with("launcher: {master_addr: 10.1.2.3, master_port: 31000}\n"), {}, env, "n2");
  CHECK(p.master_addr == "10.1.2.3");
  CHECK(p.master_port == 31000);
  CHECK(p.addr_source == "launcher.master_addr");
  CHECK(p.port_source == "launcher.master_port");
  // --master-addr 127.0.0.1 is a choice (every node is this machine), not the default.
  LaunchFlags f;
  f.master_addr = "127.0.0.1";
  f.master_port = 31001;
  JobSpec job = job_with("");
  job.launcher.master_port = 31001;  // what f.overrides() does through --set
  p = plan_launch(job, f, env, "n2");
  CHECK(p.master_addr == "127.0.0.1");
  CHECK(p.addr_source == "--master-addr");
  CHECK(p.port_source == "--master-port");
}

TEST_CASE("slurm: --nnodes and --node-rank outside Slurm give a static rendezvous", "[slurm]") {
  LaunchFlags f;
  f.nnodes = 2;
  f.node_rank = 1;
  f.master_addr = "10.0.0.1";
  JobSpec job = parse_job_spec("data: {format: synthetic}\nparallel: {nproc_per_node: 2}\n", "job.yaml",
                               f.overrides());
  CHECK(job.launcher.nnodes == 2);
  CHECK(job.launcher.master_addr == "10.0.0.1");
  const LaunchPlan p = plan_launch(job, f, {}, "hostB");
  CHECK(p.mode == LaunchMode::NodeAgent);
  CHECK(p.slurm_job_id.empty());
  CHECK(p.first_rank() == 2);
  CHECK(p.master_port == kStaticPort);
  CHECK(p.describe() ==
        "static rendezvous (--nnodes/--node-rank): node 1 of 2 on hostB, 2 workers per node (ranks 2-3 of 4); "
        "rendezvous store 10.0.0.1:29500 (address: --master-addr; port: the default)");
  // Loopback with several nodes works only when every node is this machine: said so.
  LaunchFlags g;
  g.nnodes = 2;
  g.node_rank = 0;
  const LaunchPlan q = plan_launch(
      parse_job_spec("data: {format: synthetic}\n", "job.yaml", g.overrides()), g, {}, "h");
  REQUIRE(q.warnings.size() == 1);
  CHECK(q.warnings[0].find("launcher.master_addr is 127.0.0.1 with 2 nodes: every node must be this machine") == 0);
  // --node-rank inside an srun step: the flags win (static rendezvous).
  const LaunchPlan r = plan_launch(job, f, srun_env(2, 2, 0, 0, 0, "1(x2)", "n[1-2]"), "h");
  CHECK(r.mode == LaunchMode::NodeAgent);
  CHECK(r.node_rank == 1);
  CHECK(r.master_addr == "10.0.0.1");
}

TEST_CASE("slurm: contradictions in the launch are errors that say what to do", "[slurm]") {
  LaunchFlags f;
  f.nnodes = 2;
  JobSpec two = job_with("launcher: {nnodes: 2}\n");
  CHECK(plan_error(two, f, {}) ==
        "launcher.nnodes is 2: pass --node-rank K on every node (0 on the node whose agent hosts the rendezvous "
        "store, 1..1 on the others), or run under `srun --ntasks-per-node=1`");
  f.node_rank = 2;
  CHECK(plan_error(two, f, {}) == "--node-rank 2 is not below the node count (2, launcher.nnodes / --nnodes)");
  CHECK(plan_error(job_with("launcher: {nnodes: 4}\n"), {}, srun_env(2, 2, 0, 0, 0, "1(x2)", "n[1-2]")) ==
        "launcher.nnodes is 4 but this Slurm step runs on 2 nodes (SLURM_NNODES); set launcher.nnodes to 0 (take "
        "Slurm's count) or match the allocation");
  LaunchFlags g;
  g.node_rank = 0;
  CHECK(plan_error(job_with(""), g, EnvMap{{"RANK", "1"}, {"WORLD_SIZE", "2"}}) ==
        "--nnodes/--node-rank/--master-addr/--master-port make trainrun the launcher, but RANK/WORLD_SIZE in the "
        "environment say an outside launcher already started this process as a worker; use one or the other");
  CHECK(plan_error(job_with(""), {}, srun_env(2, 2, 0, 0, 0, "1(x2)", "n[1-2")) ==
        "hostlist 'n[1-2': '[' at column 2 has no matching ']'");
  EnvMap bad = srun_env(2, 2, 0, 0, 0, "1(x2)", "n[1-2]");
  bad["SLURM_NODEID"] = "two";
  CHECK(plan_error(job_with(""), {}, bad) == "environment variable SLURM_NODEID='two' is not a valid count or index");
}

TEST_CASE("slurm: the batch script of a multi-node allocation warns that only one node is used", "[slurm]") {
  // sbatch runs the script on the first node, outside any srun step.
  const EnvMap env{{"SLURM_JOB_ID", "77"}, {"SLURM_NNODES", "4"}, {"SLURM_JOB_NODELIST", "n[1-4]"}};
  const LaunchPlan p = plan_launch(job_with("parallel: {nproc_per_node: 2}\n"), {}, env, "n1");
  CHECK(p.mode == LaunchMode::LocalAgent);
  REQUIRE(p.warnings.size() == 1);
  CHECK(p.warnings[0] ==
        "this is the batch script of a 4-node Slurm allocation, not an srun step: only this node is used; start "
        "trainrun with `srun --ntasks-per-node=1 trainrun ...` to use every node");
  // A one-node srun step is a one-node job, with Slurm's id in the log.
  const LaunchPlan q = plan_launch(job_with("parallel: {nproc_per_node: 2}\n"), {}, srun_env(1, 1, 0, 0, 0, "1", "n1"),
                                   "n1");
  CHECK(q.mode == LaunchMode::LocalAgent);
  CHECK(q.describe().find("Slurm job 4242, one node: an agent runs 2 workers on n1") == 0);
}

TEST_CASE("slurm: RANK and WORLD_SIZE from an outside launcher make a worker", "[slurm]") {
  const EnvMap env{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                   {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.9.9.9"}, {"MASTER_PORT", "29400"},
                   // torchrun inside an srun step: RANK wins over SLURM_*.
                   {"SLURM_JOB_ID", "5"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "2"}};
  const LaunchPlan p = plan_launch(job_with(""), {}, env, "h");
  CHECK(p.mode == LaunchMode::OutsideWorker);
  CHECK(p.rank == 3);
  CHECK(p.world == 4);
  CHECK(p.local_rank == 1);
  CHECK(p.node_rank == 1);
  CHECK(p.master_addr == "10.9.9.9");
  CHECK(p.describe() == "worker started by an outside launcher (RANK=3 WORLD_SIZE=4 from the environment) on h");
}

// ---- direct workers end to end ------------------------------------------------------------------

// Two processes with what `srun --ntasks-per-node=2` gives the two tasks of
// one node: each is a worker, rank 0 hosts the store, and together they
// train exactly like one process.
TEST_CASE("slurm: direct workers from a fake srun environment train like one process", "[slurm]") {
  test::TempDir dir("slurmw");
  const std::string yaml =
      "model: {n_layer: 1, n_head: 2, n_embd: 16, vocab_size: 16, seq_len: 16}\n"
      "data: {format: synthetic}\n"
      "train: {global_batch_size: 4, micro_batch_size: 1, max_steps: 3, log_interval: 1, eval_interval: 0, "
      "warmup_steps: 1}\n"
      "parallel: {nproc_per_node: 1, sharding: full_shard, timeout_s: 20}\n";
  test::write_file(dir / "ref.yaml", yaml + "output: {dir: '" + dir.path() + "/ref', sample_tokens: 0}\n");
  test::write_file(dir / "job.yaml", yaml + "output: {dir: '" + dir.path() + "/run', sample_tokens: 0}\n");
  const auto ref = test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + dir.path() +
                                     "/ref.yaml'");
  REQUIRE(ref.exit_code == 0);
  const int port = free_port();
  REQUIRE(port > 0);
  auto task = [&](int procid) {
    return "env -u TRAINRUN_STORE_SECRET OMP_NUM_THREADS=1 SLURM_JOB_ID=31337 SLURM_STEP_ID=0 SLURM_NTASKS=2 "
           "SLURM_NNODES=1 SLURM_PROCID=" +
           std::to_string(procid) + " SLURM_LOCALID=" + std::to_string(procid) +
           " SLURM_NODEID=0 SLURM_STEP_TASKS_PER_NODE=2 SLURM_JOB_NODELIST=localhost '" + test::trainrun_binary() +
           "' --config '" + dir.path() + "/job.yaml' --master-port " + std::to_string(port);
  };
  // Rank 1 first: it must wait for rank 0's store and files.
  const auto r = test::run_command("(" + task(1) + " > '" + dir.path() + "/r1.out' 2> '" + dir.path() +
                                   "/r1.err'; echo $? > '" + dir.path() + "/r1.rc') & sleep 0.3; " + task(0) +
                                   "; rc=$?; wait; exit $rc");
  const std::string err1 = test::read_file(dir / "r1.err");
  INFO("rank 0:\n" << r.err << "\nrank 1:\n" << err1);
  REQUIRE(r.exit_code == 0);
  CHECK(test::read_file(dir / "r1.rc") == "0\n");
  CHECK(r.err.find("launch: Slurm job 31337, direct workers (srun --ntasks-per-node=2, no agent): rank 0 of 2, "
                   "local rank 0 of 2 on node 0 of 1") != std::string::npos);
  CHECK(err1.find("rank 1 of 2, local rank 1 of 2") != std::string::npos);
  // The secret went through output.dir, readable by this user only.
  struct stat st {};
  REQUIRE(stat((dir.path() + "/run/.trainrun/store.secret").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(stat((dir.path() + "/run/.trainrun").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  const std::vector<double> want = losses(dir / "ref/metrics.jsonl"), got = losses(dir / "run/metrics.jsonl");
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-5));
}

// ---- a real Slurm ---------------------------------------------------------------------------------

// Starts munged + slurmctld + slurmd on this machine (scratch config, free
// ports), submits scripts/slurm/train.sbatch (one agent) and
// multinode.sbatch (direct workers) with a CPU job, and checks training and
// USR1 -> checkpoint -> exit 75 -> scripts/slurm/requeue -> resume; about
// 25 s. Runs as root where Debian's Slurm is installed; with
// TRAINRUN_SLURM_CLUSTER_TEST=1 the script installs it (apt) first.
TEST_CASE("slurm: a local Slurm cluster runs the sbatch scripts through preemption and requeue", "[slurm]") {
  const char* on = std::getenv("TRAINRUN_SLURM_CLUSTER_TEST");
  const bool asked = on && std::string(on) == "1";
  if (geteuid() != 0) {
    WARN("skipped: the local Slurm cluster test needs root (it starts munged, slurmctld and slurmd)");
    return;
  }
  const bool installed =
      test::run_command("command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged")
          .exit_code == 0;
  if (!installed && !asked) {
    WARN("skipped: Slurm is not installed; TRAINRUN_SLURM_CLUSTER_TEST=1 lets scripts/slurm/local-cluster-test.sh "
         "install Debian's slurmctld, slurmd, slurm-client and munge");
    return;
  }
  const auto r = test::run_command("bash '" + test::source_dir() + "/scripts/slurm/local-cluster-test.sh' '" +
                                   test::trainrun_binary() + "' 2>&1");
  INFO(r.out);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("local-cluster-test: agent: OK (USR1 -> checkpoint -> exit 75 -> requeue -> resumed") !=
        std::string::npos);
  CHECK(r.out.find("local-cluster-test: direct: OK (USR1 -> checkpoint -> exit 75 -> requeue -> resumed") !=
        std::string::npos);
}
