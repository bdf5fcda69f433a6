// `trainrun bench cp` (bench_cp.h).
#include "core/train/bench_cp.h"

#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include "core/common/error.h"
#include "core/model/model.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "parallel/comm/forwarding_communicator.h"
#include "parallel/context/cp_attention.h"
#include "parallel/context/sequence_split.h"
#include "parallel/rendezvous/store.h"

namespace trainrun {

namespace {

using Clock = std::chrono::steady_clock;

// The cp group with a clock on the calls the cp attention makes.
class TimedCommunicator final : public ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  void send_recv(const void* send_buf, size_t send_bytes, int send_to, void* recv_buf, size_t recv_bytes,
                 int recv_from, uint32_t tag) override {
    const auto t0 = Clock::now();
    ForwardingCommunicator::send_recv(send_buf, send_bytes, send_to, recv_buf, recv_bytes, recv_from, tag);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  void all_to_all(void* out, const void* in, size_t bytes_per_rank) override {
    const auto t0 = Clock::now();
    ForwardingCommunicator::all_to_all(out, in, bytes_per_rank);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  }
  double seconds = 0;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

ModelConfig bench_model(const CpBenchOptions& o) {
  ModelConfig c;
  c.arch = "llama";
  c.L = o.layers, c.NH = o.heads, c.NKV = o.kv_heads, c.C = o.width, c.F = 2 * o.width, c.V = 512, c.T = o.T;
  c.tied = false;
  return c;
}

// This thread's CPU seconds: what a rank computed, whatever else the machine runs.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

struct RankTimes {
  std::vector<double> step_s, wait_s, cpu_s;
  size_t act_bytes = 0;
};

// One rank: `steps` forward + backward passes of one sequence (its rows).
RankTimes run_rank(const ModelArch& arch, const CpBenchOptions& o, TimedCommunicator* comm, const std::string& mode) {
  omp_set_num_threads(1);
  auto be = make_cpu_backend(1);
  const ModelConfig& c = arch.config();
  const int cp = comm ? comm->world_size() : 1;
  std::vector<float> host(size_t(arch.layout().total));
  arch.init_params(1, 0, arch.layout().total, host.data());
  DeviceBuffer params(be.get(), host.size() * 4), grads(be.get(), host.size() * 4);
  be->copy_to_device(params.get(), host.data(), host.size() * 4);
  ContextParallel ctx;
  ctx.comm = comm;
  ctx.mode = mode;
  auto net = arch.make_network(be.get(), 1, false, nullptr, nullptr, cp > 1 ? &ctx : nullptr);
  FlatUnitAccess units(arch.layout(), params.get(), grads.as<float>(), DType::F32);
  // The same tokens (and documents) on every rank: the whole sequence, then this rank's rows.
  std::mt19937_64 gen(7);
  std::vector<int32_t> in(size_t(c.T)), tgt(size_t(c.T)), doc(size_t(c.T), 0), pos(size_t(c.T));
  for (auto& t : in) t = int32_t(gen() % uint64_t(c.V));
  for (auto& t : tgt) t = int32_t(gen() % uint64_t(c.V));
  for (int t = 0, start = 0; t < c.T; ++t) {
    if (o.documents && t > 0 && gen() % 512 == 0) start = t;  // documents of ~512 tokens
    doc[size_t(t)] = start;
  }
  const int rows = c.T / cp;
  std::vector<int32_t> lin = in, ltgt = tgt, ldoc = doc;
  for (int t = 0; t < c.T; ++t) pos[size_t(t)] = t - doc[size_t(t)];
  std::vector<int32_t> lpos = pos;
  if (cp > 1) {
    const SequenceSplit split(c.T, cp, comm->rank());
    lin.resize(size_t(rows)), ltgt.resize(size_t(rows));
    split_rows(in.data(), lin.data(), 1, 4, split);
    split_rows(tgt.data(), ltgt.data(), 1, 4, split);
    const LocalDocumentMask m = split_document_mask(doc.data(), 1, split);
    ldoc = m.doc_start, lpos = m.pos;
  }
  auto upload = [&](const std::vector<int32_t>& v) {
    DeviceBuffer d(be.get(), v.size() * 4);
    be->copy_to_device(d.get(), v.data(), v.size() * 4);
    return d;
  };
  DeviceBuffer din = upload(lin), dtgt = upload(ltgt), ddoc = upload(ldoc), dpos = upload(lpos);
  DocumentMask docs;
  if (o.documents) docs = DocumentMask{ddoc.as<int32_t>(), dpos.as<int32_t>(), cp > 1 ? doc.data() : nullptr};
  RankTimes r;
  r.act_bytes = net->activation_bytes();
  for (int s = 0; s < o.steps; ++s) {
    if (comm) comm->barrier();  // the ranks start each step together
    const double waited = comm ? comm->seconds : 0;
    const auto t0 = Clock::now();
    const double c0 = thread_cpu_seconds();
    net->forward(units, din.as<int32_t>(), dtgt.as<int32_t>(), 1, rows, true, 1.0f / float(c.T), docs);
    net->backward(units);
    r.step_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    r.wait_s.push_back(comm ? comm->seconds - waited : 0);
    r.cpu_s.push_back(thread_cpu_seconds() - c0);
  }
  return r;
}

}  // namespace

std::vector<CpBenchRow> run_cp_bench(const CpBenchOptions& o, std::string* model_description) {
  TR_CHECK(o.steps >= 2, "bench cp: --steps ", o.steps, " must be at least 2 (the first is warm-up)");
  TR_CHECK(o.mode == "ring" || o.mode == "all_to_all", "bench cp: --mode '", o.mode, "' is not ring or all_to_all");
  const auto arch = make_model_arch(bench_model(o));
  if (model_description) *model_description = arch->describe();
  std::vector<CpBenchRow> rows;
  for (int cp : o.cps) {
    TR_CHECK(cp >= 1 && o.T % (2 * cp) == 0, "bench cp: --seq-len ", o.T, " is not a multiple of 2 x cp (", 2 * cp,
             ", --cp ", cp, "): context parallelism splits a sequence into 2 x cp equal chunks; use a multiple of ",
             2 * cp);
    std::vector<RankTimes> times(static_cast<size_t>(cp));
    if (cp == 1) {
      times[0] = run_rank(*arch, o, nullptr, o.mode);
    } else {
      const std::string secret = make_job_secret();
      TcpStoreServer server("127.0.0.1", 0, secret);
      std::vector<std::string> errors(static_cast<size_t>(cp));
      std::vector<std::thread> threads;
      for (int r = 0; r < cp; ++r)
        threads.emplace_back([&, r] {
          try {
            auto store = connect_tcp_store("127.0.0.1", server.port(), secret, std::chrono::seconds(60));
            auto inner = make_gloo_communicator(*store, "cp0/", r, cp, "127.0.0.1", std::chrono::seconds(300));
            inner->set_group("cp0");
            TimedCommunicator comm(std::move(inner));
            times[size_t(r)] = run_rank(*arch, o, &comm, o.mode);
          } catch (const std::exception& e) {
            errors[size_t(r)] = e.what();
          }
        });
      for (auto& t : threads) t.join();
      for (int r = 0; r < cp; ++r) TR_CHECK(errors[size_t(r)].empty(), "bench cp: cp", cp, " rank ", r, ": ", errors[size_t(r)]);
    }
    const RankTimes& t = times[0];
    CpBenchRow row;
    row.cp = cp;
    row.step_ms = 1e3 * median(std::vector<double>(t.step_s.begin() + 1, t.step_s.end()));
    row.wait_ms = 1e3 * median(std::vector<double>(t.wait_s.begin() + 1, t.wait_s.end()));
    row.wait_fraction = row.step_ms > 0 ? row.wait_ms / row.step_ms : 0;
    row.cpu_ms = 1e3 * median(std::vector<double>(t.cpu_s.begin() + 1, t.cpu_s.end()));
    row.tokens_per_s = row.step_ms > 0 ? o.T / (row.step_ms / 1e3) : 0;
    row.activation_mib = double(t.act_bytes) / (1 << 20);
    rows.push_back(row);
  }
  return rows;
}

std::string format_cp_table(const std::vector<CpBenchRow>& rows, const std::string& model_description,
                            const CpBenchOptions& o) {
  std::ostringstream s;
  s << "context parallelism on the CPU: " << model_description << ", one sequence of " << o.T << " tokens per step"
    << (o.documents ? " (random documents)" : "") << ", cp_mode " << o.mode
    << "; ranks are threads with one core each, Gloo over loopback; medians of " << o.steps - 1 << " steps\n";
  s << "| cp | step (ms) | waiting on K/V (ms) | share of step | rank 0 CPU time (ms) | tokens/s | activations per rank (MiB) |\n";
  s << "|---:|---:|---:|---:|---:|---:|---:|\n";
  s << std::fixed;
  for (const CpBenchRow& r : rows)
    s << "| " << r.cp << " | " << std::setprecision(0) << r.step_ms << " | " << std::setprecision(1) << r.wait_ms
      << " | " << std::setprecision(1) << 100 * r.wait_fraction << "% | " << std::setprecision(0) << r.cpu_ms << " | "
      << r.tokens_per_s
      << " | " << std::setprecision(1) << r.activation_mib << " |\n";
  return s.str();
}

}  // namespace trainrun
