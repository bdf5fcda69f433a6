// `trainrun bench moe` (bench_moe.h).
#include "core/train/bench_moe.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <random>
#include <sstream>

#include "core/common/error.h"
#include "core/model/model.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"

namespace trainrun {

namespace {

using Clock = std::chrono::steady_clock;

ModelConfig bench_config(const MoeBenchOptions& o, bool moe) {
  ModelConfig c;
  c.arch = moe ? "mixtral" : "llama";
  c.L = o.layers, c.NH = o.heads, c.NKV = o.kv_heads, c.C = o.width, c.V = 512, c.T = o.seq_len;
  c.tied = false;
  c.F = moe ? o.expert_ffn : o.top_k * o.expert_ffn;  // K experts of F = one MLP of K x F per token
  if (moe) {
    c.moe.n_experts = o.experts;
    c.moe.top_k = o.top_k;
    c.moe.ffn = o.expert_ffn;
    c.moe.aux_loss_coef = 0.001;  // as a training job computes it (MixtralConfig's default)
  }
  return c;
}

MoeBenchRow measure(const ModelArch& arch, const MoeBenchOptions& o) {
  auto be = make_cpu_backend(omp_get_max_threads());
  const ModelConfig& c = arch.config();
  std::vector<float> host(size_t(arch.layout().total));
  arch.init_params(1, 0, arch.layout().total, host.data());
  DeviceBuffer params(be.get(), host.size() * 4), grads(be.get(), host.size() * 4);
  be->copy_to_device(params.get(), host.data(), host.size() * 4);
  auto net = arch.make_network(be.get(), o.batch, false);
  FlatUnitAccess units(arch.layout(), params.get(), grads.as<float>(), DType::F32);
  const size_t n = size_t(o.batch) * size_t(c.T);
  std::mt19937_64 gen(7);
  std::vector<int32_t> in(n), tgt(n);
  for (auto& t : in) t = int32_t(gen() % uint64_t(c.V));
  for (auto& t : tgt) t = int32_t(gen() % uint64_t(c.V));
  DeviceBuffer din(be.get(), n * 4), dtgt(be.get(), n * 4);
  be->copy_to_device(din.get(), in.data(), n * 4);
  be->copy_to_device(dtgt.get(), tgt.data(), n * 4);
  std::vector<double> ms;
  for (int s = 0; s < o.steps; ++s) {
    const auto t0 = Clock::now();
    net->forward(units, din.as<int32_t>(), dtgt.as<int32_t>(), o.batch, c.T, true, 1.0f / float(n));
    net->backward(units);
    be->synchronize();
    ms.push_back(1e3 * std::chrono::duration<double>(Clock::now() - t0).count());
  }
  ms.erase(ms.begin());  // warm-up: first touches of the arena, OpenBLAS's buffers
  std::sort(ms.begin(), ms.end());
  MoeBenchRow r;
  r.model = arch.describe();
  r.params = arch.num_parameters();
  r.active = arch.matmul_parameters();
  r.step_ms = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  r.tokens_per_s = double(n) / (r.step_ms / 1e3);
  return r;
}

}  // namespace

std::vector<MoeBenchRow> run_moe_bench(const MoeBenchOptions& o) {
  TR_CHECK(o.steps >= 2, "bench moe: --steps ", o.steps, " must be at least 2 (the first is warm-up)");
  TR_CHECK(o.top_k >= 1 && o.top_k <= o.experts, "bench moe: --top-k ", o.top_k, " must be in 1..--experts (",
           o.experts, ")");
  TR_CHECK(o.width % o.heads == 0, "bench moe: --width ", o.width, " is not a multiple of the ", o.heads,
           " heads; use a multiple of ", o.heads);
  std::vector<MoeBenchRow> rows;
  for (bool moe : {false, true}) rows.push_back(measure(*make_model_arch(bench_config(o, moe)), o));
  return rows;
}

std::string format_moe_table(const std::vector<MoeBenchRow>& rows, const MoeBenchOptions& o) {
  std::ostringstream s;
  s << "mixture of experts vs dense on the CPU: " << o.experts << " experts top-" << o.top_k << " of ffn "
    << o.expert_ffn << " vs one MLP of " << o.top_k * o.expert_ffn << "; " << o.batch << " x " << o.seq_len
    << " tokens per step, fp32, " << omp_get_max_threads() << " OpenMP threads; medians of " << o.steps - 1
    << " steps (forward + backward)\n";
  s << "| model | parameters | active (matmul) | step (ms) | tokens/s | step / dense |\n";
  s << "|---|---:|---:|---:|---:|---:|\n";
  s << std::fixed;
  for (const MoeBenchRow& r : rows)
    s << "| " << r.model << " | " << r.params << " | " << r.active << " | " << std::setprecision(2) << r.step_ms
      << " | " << std::setprecision(0) << r.tokens_per_s << " | " << std::setprecision(2)
      << r.step_ms / rows.front().step_ms << " |\n";
  return s.str();
}

}  // namespace trainrun
