// The benchmark model as a full fine-tune and with adapters (see bench_lora.h).
#include "core/train/bench_lora.h"

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
#include "core/train/planner.h"
#include "core/train/trainer.h"
#include "parallel/rendezvous/store.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// One run of `job` on one rank (this thread); its summary, and the median
// ms/step and the peak bytes from metrics.jsonl.
LoraBenchRow run_once(const JobSpec& job, const std::string& what) {
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  WorkerInfo w;
  w.master_port = server.port();
  w.secret = secret;
  const TrainSummary sum = run_training(job, w);
  std::ifstream in(fs::path(job.output.dir) / "metrics.jsonl");
  TR_CHECK(in, "bench lora: the ", what, " run wrote no metrics.jsonl in ", job.output.dir);
  std::vector<double> ms;
  LoraBenchRow row;
  row.what = what;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (j.at("step").get<int>() > 2) ms.push_back(j.at("ms_per_step").get<double>());
    if (j.contains("mem_peak_bytes")) row.peak_bytes = std::max(row.peak_bytes, j.at("mem_peak_bytes").get<double>());
  }
  row.step_ms = median(ms);
  row.tokens_per_s = row.step_ms > 0 ? double(job.train.derived_global_batch_size()) * job.model.seq_len * 1000.0 / row.step_ms : 0;
  row.optimizer_bytes = double(sum.optimizer_bytes);
  row.grads_bytes = double(sum.grads_bytes);
  row.params_bytes = double(sum.params_bytes);
  return row;
}

}  // namespace

std::vector<LoraBenchRow> run_lora_bench(const LoraBenchOptions& o, std::string* description) {
  TR_CHECK(o.steps >= 3, "bench lora: --steps must be at least 3 (the median skips the first 2; got ", o.steps, ")");
  TR_CHECK(o.rounds >= 1, "bench lora: --rounds must be at least 1 (got ", o.rounds, ")");
  TR_CHECK(fs::exists(o.config), "bench lora: --config '", o.config,
           "' does not exist (run from the repository root, or name configs/bench_cpu.yaml's path)");
  JobSpec base = load_resolved_job_spec(o.config, {});
  base.backend = "cpu";
  base.parallel.nproc_per_node = 1;
  base.parallel.offload = "none";
  base.train.max_steps = o.steps;
  base.train.log_interval = 1;
  base.checkpoint.interval = 0;
  base.checkpoint.final = "false";
  base.output.sample_tokens = 0;
  base.model.adapter = {};
  AdapterRequest req;
  req.type = o.adapter;
  req.rank = o.rank;
  req.target_modules = o.target_modules;
  const auto arch = make_model_arch(ModelConfig::from_spec(base.model));
  check_adapter_request(req, *arch);  // names a bad --adapter, --rank or module before anything runs
  JobSpec adapted = base;
  adapted.model.adapter.type = o.adapter;
  adapted.model.adapter.rank = o.rank;
  adapted.model.adapter.alpha = 2.0 * o.rank;
  adapted.model.adapter.target_modules = o.target_modules;
  const std::string adapter_name = o.adapter + " r=" + std::to_string(o.rank) + " " + o.target_modules;
  std::vector<int> threads = o.threads;
  if (threads.empty()) {
    threads.push_back(1);
    const int all = int(std::max(1u, std::thread::hardware_concurrency()));
    if (all > 1) threads.push_back(all);
  }
  for (int t : threads) TR_CHECK(t >= 1, "bench lora: --threads ", t, " must be >= 1");
  if (description)
    *description = arch->describe() + ", micro-batch " + std::to_string(base.train.micro_batch_size) + ", global batch " +
                   std::to_string(base.train.derived_global_batch_size()) + " (" + o.config + "), " +
                   std::to_string(o.steps) + " steps, median ms/step of steps 3-" + std::to_string(o.steps) +
                   ", the lower of " + std::to_string(o.rounds) + " rounds";
  char tmpl[] = "/tmp/trainrun-bench-lora-XXXXXX";
  TR_CHECK(mkdtemp(tmpl), "bench lora: cannot make a scratch directory under /tmp");
  const fs::path dir = tmpl;
  std::vector<LoraBenchRow> best(2 * threads.size());  // per thread count: full, adapter
  // The runs' own info lines would bury the table; their warnings and errors still show.
  const LogLevel level = log_level();
  if (level < LogLevel::Warn) set_log_level(LogLevel::Warn);
  const int omp_before = omp_get_max_threads();
  try {
    for (size_t ti = 0; ti < threads.size(); ++ti)
      for (int round = 0; round < o.rounds; ++round)
        for (int k = 0; k < 2; ++k) {
          // The CPU backend takes the caller's OpenMP thread count (and gives it to OpenBLAS).
          omp_set_num_threads(threads[ti]);
          JobSpec job = k == 0 ? base : adapted;
          job.output.dir =
              (dir / ((k == 0 ? "full" : "adapter") + std::to_string(threads[ti]) + "_" + std::to_string(round))).string();
          LoraBenchRow row = run_once(job, k == 0 ? "full fine-tune" : adapter_name);
          row.threads = threads[ti];
          LoraBenchRow& b = best[2 * ti + size_t(k)];
          if (b.step_ms == 0 || (row.step_ms > 0 && row.step_ms < b.step_ms)) b = row;
        }
  } catch (...) {
    omp_set_num_threads(omp_before);
    set_log_level(level);
    std::error_code ec;
    fs::remove_all(dir, ec);
    throw;
  }
  omp_set_num_threads(omp_before);
  set_log_level(level);
  std::error_code ec;
  fs::remove_all(dir, ec);
  for (size_t i = 0; i < best.size(); i += 2) {
    best[i].trainable = best[i].total = arch->num_parameters();
    best[i + 1].trainable = adapter_params_per_block(*arch, req) * arch->config().L;
    best[i + 1].total = arch->num_parameters() + best[i + 1].trainable;
  }
  return best;
}

std::string format_lora_bench_table(const std::vector<LoraBenchRow>& rows, const std::string& description) {
  std::ostringstream o;
  o << "# " << description << "\n"
    << "# memory: this rank's bytes as the run allocated them (optimizer: AdamW moments; grads: fp32; params: with "
       "adapters the frozen base + the adapters' fp32 master); peak: the backend's\n";
  char buf[256];
  const char* fmt_s = "%-28s %7s %12s %10s %10s %12s %11s %11s %11s\n";
  std::snprintf(buf, sizeof buf, fmt_s, "run", "threads", "trainable", "ms/step", "tok/s", "optimizer", "grads", "params",
                "peak");
  o << buf;
  auto mib = [](double b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.2f MiB", b / 1048576.0);
    return std::string(s);
  };
  auto ratio = [](double a, double b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.4fx", b > 0 ? a / b : 0.0);
    return std::string(s);
  };
  for (size_t i = 0; i + 1 < rows.size(); i += 2) {
    for (size_t k = i; k < i + 2; ++k) {
      const LoraBenchRow& r = rows[k];
      char ms[32], tps[32];
      std::snprintf(ms, sizeof ms, "%.1f", r.step_ms);
      std::snprintf(tps, sizeof tps, "%.0f", r.tokens_per_s);
      std::snprintf(buf, sizeof buf, fmt_s, r.what.c_str(), std::to_string(r.threads).c_str(),
                    std::to_string(r.trainable).c_str(), ms, tps, mib(r.optimizer_bytes).c_str(),
                    mib(r.grads_bytes).c_str(), mib(r.params_bytes).c_str(), mib(r.peak_bytes).c_str());
      o << buf;
    }
    const LoraBenchRow& f = rows[i];
    const LoraBenchRow& a = rows[i + 1];
    std::snprintf(buf, sizeof buf, fmt_s, "adapter / full", std::to_string(f.threads).c_str(),
                  ratio(double(a.trainable), double(f.trainable)).c_str(), ratio(a.step_ms, f.step_ms).c_str(),
                  ratio(a.tokens_per_s, f.tokens_per_s).c_str(), ratio(a.optimizer_bytes, f.optimizer_bytes).c_str(),
                  ratio(a.grads_bytes, f.grads_bytes).c_str(), ratio(a.params_bytes, f.params_bytes).c_str(),
                  ratio(a.peak_bytes, f.peak_bytes).c_str());
    o << buf;
  }
  return o.str();
}

}  // namespace trainrun
