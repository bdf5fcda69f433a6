// The benchmark model at tp 1 vs tp N on the CPU (see bench_tp.h).
#include "core/train/bench_tp.h"

#include <omp.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/config/job_spec.h"
#include "core/model/model.h"
#include "core/model/model_spec.h"
#include "core/model/tensor_parallel.h"
#include "core/train/trainer.h"
#include "parallel/rendezvous/store.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

// configs/bench_cpu.yaml's model and batch (GPT-2 L=4 C=256, B=8 x T=256),
// so the figures match the README's other CPU benchmarks.
const char* kBenchModel =
    "model: {n_layer: 4, n_head: 4, n_embd: 256, vocab_size: 4096, seq_len: 256}\n"
    "data: {format: synthetic, synthetic: {vocab: 4096, branching: 8}}\n"
    "train: {global_batch_size: 8, micro_batch_size: 8, lr: 1.0e-3, min_lr: 1.0e-3, schedule: constant,\n"
    "        warmup_steps: 1, eval_interval: 0, eval_steps: 1}\n";

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// One mesh: `ranks` threads, each a trainer; rank 0's metrics.jsonl read back.
TpStepRow run_mesh(const JobSpec& base, int tp, int steps, int threads, const fs::path& dir) {
  JobSpec job = base;
  job.parallel.tensor_parallel = tp;
  job.parallel.nproc_per_node = tp;
  job.parallel.sharding = "no_shard";  // dp 1 either way: only TP differs
  job.train.max_steps = steps;
  job.train.log_interval = 1;
  job.train.global_batch_size = job.train.micro_batch_size;  // one micro-batch per step
  job.train.global_batch_tokens = 0;
  job.checkpoint.interval = 0;
  job.checkpoint.final = "false";
  job.output.dir = (dir / ("tp" + std::to_string(tp))).string();
  job.output.sample_tokens = 0;
  job.backend = "cpu";
  TpStepRow row;
  row.tp = tp;
  row.ranks = tp;
  row.threads_per_rank = std::max(1, threads / tp);
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  std::vector<std::string> errors(static_cast<size_t>(tp));
  std::vector<std::thread> ranks;
  for (int r = 0; r < tp; ++r) {
    ranks.emplace_back([&, r] {
      omp_set_num_threads(row.threads_per_rank);  // this rank's share of the cores
      WorkerInfo w;
      w.rank = r;
      w.world = tp;
      w.local_rank = r;
      w.local_world = tp;
      w.master_port = server.port();
      w.secret = secret;
      try {
        run_training(job, w);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < tp; ++r)
    TR_CHECK(errors[size_t(r)].empty(), "bench comm: the tp", tp, " run failed on rank ", r, ": ", errors[size_t(r)]);
  std::ifstream in(fs::path(job.output.dir) / "metrics.jsonl");
  TR_CHECK(in, "bench comm: the tp", tp, " run wrote no metrics.jsonl in ", job.output.dir);
  std::vector<double> ms, tp_ms;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (j.at("step").get<int>() < 2 && steps > 1) continue;  // the first step warms up
    ms.push_back(j.at("ms_per_step").get<double>());
    tp_ms.push_back(j.contains("tp_comm_ms") ? j.at("tp_comm_ms").get<double>() : 0.0);
  }
  row.step_ms = median(ms);
  row.tp_comm_ms = median(tp_ms);
  row.tp_comm_fraction = row.step_ms > 0 ? std::clamp(row.tp_comm_ms / row.step_ms, 0.0, 1.0) : 0;
  return row;
}

}  // namespace

std::vector<TpStepRow> run_tp_step_bench(const TpStepBenchOptions& o, std::string* description) {
  TR_CHECK(o.tp >= 2, "bench comm: --tp must be at least 2 for the TP step rows (got ", o.tp, ")");
  TR_CHECK(o.steps >= 1, "bench comm: --tp-steps must be at least 1 (got ", o.steps, ")");
  JobSpec job = o.config.empty() ? parse_job_spec(kBenchModel, "the CPU benchmark model (configs/bench_cpu.yaml)")
                                 : load_resolved_job_spec(o.config, {});
  job.parallel.offload = "none";
  job.parallel.sequence_parallel = "false";
  const auto arch = make_model_arch(ModelConfig::from_spec(job.model));
  check_tensor_parallel(arch->config(), o.tp);  // names the model keys when it does not split
  if (description)
    *description = arch->describe() + ", micro-batch " + std::to_string(job.train.micro_batch_size) +
                   (o.config.empty() ? " (configs/bench_cpu.yaml)" : " (" + o.config + ")");
  const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  char tmpl[] = "/tmp/trainrun-bench-tp-XXXXXX";
  TR_CHECK(mkdtemp(tmpl), "bench comm: cannot make a scratch directory under /tmp");
  const fs::path dir = tmpl;
  std::vector<TpStepRow> rows;
  // The runs' own info lines (setup, memory) would bury the table; their
  // warnings and errors still show.
  const LogLevel level = log_level();
  if (level < LogLevel::Warn) set_log_level(LogLevel::Warn);
  try {
    rows.push_back(run_mesh(job, 1, o.steps, threads, dir));
    rows.push_back(run_mesh(job, o.tp, o.steps, threads, dir));
  } catch (...) {
    set_log_level(level);
    std::error_code ec;
    fs::remove_all(dir, ec);
    throw;
  }
  set_log_level(level);
  std::error_code ec;
  fs::remove_all(dir, ec);
  return rows;
}

std::string format_tp_step_table(const std::vector<TpStepRow>& rows, const std::string& description) {
  std::ostringstream o;
  o << "# training steps, " << description << ": tp1 vs tp" << (rows.empty() ? 0 : rows.back().tp)
    << " (dp 1, Gloo, ranks are threads sharing the cores; tp comm: host time inside TP activation collectives)\n";
  char buf[160];
  std::snprintf(buf, sizeof buf, "%-8s %6s %14s %12s %14s %12s\n", "mesh", "ranks", "threads/rank", "step (ms)",
                "tp comm (ms)", "tp comm %");
  o << buf;
  for (const auto& r : rows) {
    std::snprintf(buf, sizeof buf, "%-8s %6d %14d %12.1f %14.1f %11.1f%%\n", ("tp" + std::to_string(r.tp)).c_str(),
                  r.ranks, r.threads_per_rank, r.step_ms, r.tp_comm_ms, 100 * r.tp_comm_fraction);
    o << buf;
  }
  return o.str();
}

}  // namespace trainrun
