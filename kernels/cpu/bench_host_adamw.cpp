// `trainrun bench optimizer`; what it measures is in bench_host_adamw.h.
#include "kernels/cpu/bench_host_adamw.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include "core/common/error.h"
#include "core/common/text.h"
#include "kernels/cpu/host_adamw.h"

namespace trainrun {

namespace {

using Clock = std::chrono::steady_clock;

template <typename Fn>
double median_seconds(int repeat, Fn fn) {
  fn();  // warm-up: first touch of the pages, thread pool start
  std::vector<double> t;
  for (int r = 0; r < repeat; ++r) {
    auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct AlignedFloats {
  explicit AlignedFloats(int64_t n) {
    void* p = nullptr;
    TR_CHECK(posix_memalign(&p, 64, size_t(n) * 4) == 0, "bench optimizer: out of memory allocating ", n * 4,
             " bytes; use a smaller --params");
    ptr.reset(static_cast<float*>(p));
  }
  float* get() const { return ptr.get(); }
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> ptr;
};

// Parallel first touch, so pages land where the threads that use them run.
void fill(float* x, int64_t n, float value, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) x[i] = value + float(i % 97) * 1e-3f;
}

double triad_gbs(int64_t n, int threads, int repeat) {
  AlignedFloats a(n), b(n), c(n);
  fill(a.get(), n, 0, threads);
  fill(b.get(), n, 1, threads);
  fill(c.get(), n, 2, threads);
  float* A = a.get();
  const float* B = b.get();
  const float* C = c.get();
  const float s = 3.0f;
  double t = median_seconds(repeat, [&] {
#pragma omp parallel for simd schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) A[i] = B[i] + s * C[i];
  });
  return 12.0 * double(n) / t / 1e9;
}

// The PyTorch peer, as a script on stdin of python3; prints "<mode> <seconds>"
// lines or "skip <why>".
const char* kTorchScript = R"PY(
import sys, time, inspect
n, threads, repeat = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
try:
    import torch
except Exception as e:
    print("skip torch not importable:", type(e).__name__); sys.exit(0)
torch.set_num_threads(threads)
print("version", torch.__version__)
modes = ["foreach"]
if "fused" in inspect.signature(torch.optim.AdamW).parameters: modes.append("fused")
for mode in modes:
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    kw = {mode: True}
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
        opt.step()
    except Exception as e:
        print("unsupported", mode, str(e).splitlines()[0][:80]); continue
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter(); opt.step(); ts.append(time.perf_counter() - t0)
    ts.sort()
    print(mode, ts[len(ts) // 2])
)PY";

std::vector<std::string> run_torch(const std::string& python, int64_t n, int threads, int repeat) {
  std::vector<std::string> lines;
  char path[] = "/tmp/trainrun_bench_torch_XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) return {"skip cannot create a temporary file"};
  close(fd);
  {
    std::ofstream f(path);
    f << kTorchScript;
  }
  std::ostringstream cmd;
  cmd << python << " " << path << " " << n << " " << threads << " " << repeat << " 2>&1";
  FILE* p = popen(cmd.str().c_str(), "r");
  if (!p) {
    std::remove(path);
    return {"skip cannot run " + python};
  }
  char buf[512];
  while (fgets(buf, sizeof buf, p)) {
    std::string s(buf);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    lines.push_back(s);
  }
  int rc = pclose(p);
  std::remove(path);
  if (rc != 0 && lines.empty()) lines.push_back("skip " + python + " exited with status " + std::to_string(rc));
  return lines;
}

}  // namespace

int run_optimizer_bench(const OptimizerBenchOptions& opts) {
  const int64_t n = parse_param_count(opts.params);
  TR_CHECK(n >= 1024, "bench optimizer: --params ", opts.params, " is too small (at least 1K)");
  const HostIsa best = host_adamw_best_isa();
  std::printf("host AdamW over %lld parameters (%.0f MB of fp32 state: w, g, m, v), best kernel %s, median of %d\n",
              (long long)n, 16.0 * n / 1e6, host_isa_name(best), opts.repeat);
  std::printf("%-8s %-22s %14s %10s %10s %12s\n", "threads", "what", "params/s", "GB/s", "% triad", "vs torch best");
  AlignedFloats w(n), g(n), m(n), v(n);
  for (int threads : opts.threads) {
    TR_CHECK(threads >= 1, "bench optimizer: --threads must be >= 1");
    fill(w.get(), n, 0.5f, threads);
    fill(g.get(), n, 0.01f, threads);
    fill(m.get(), n, 0.0f, threads);
    fill(v.get(), n, 0.0f, threads);
    const double triad = triad_gbs(n, threads, opts.repeat);
    HostAdamWArgs a;
    a.weight_decay = 0.1f;
    auto rate = [&](HostIsa isa) {
      const double t = median_seconds(opts.repeat, [&] {
        host_adamw_update(w.get(), g.get(), m.get(), v.get(), n, a, threads, isa);
        ++a.step;
      });
      return double(n) / t;
    };
    const double fast = rate(best);
    const double scalar = rate(HostIsa::Scalar);
    double torch_best = 0;
    std::vector<std::pair<std::string, double>> torch_rows;
    std::string torch_note;
    if (!opts.python.empty()) {
      for (const std::string& line : run_torch(opts.python, n, threads, opts.repeat)) {
        std::istringstream is(line);
        std::string mode;
        is >> mode;
        double secs = 0;
        if (mode == "foreach" || mode == "fused") {
          if (is >> secs && secs > 0) {
            torch_rows.push_back({"torch " + mode, double(n) / secs});
            torch_best = std::max(torch_best, double(n) / secs);
          }
        } else if (mode == "version") {
          is >> torch_note;
          torch_note = "torch " + torch_note;
        } else if (!line.empty()) {
          torch_rows.push_back({line, 0});
        }
      }
    }
    auto row = [&](const std::string& what, double params_s, bool ours) {
      const double gbs = 28.0 * params_s / 1e9;
      char vs[32] = "";
      if (ours && torch_best > 0) std::snprintf(vs, sizeof vs, "%.2fx", params_s / torch_best);
      std::printf("%-8d %-22s %14.3e %10.2f %9.0f%% %12s\n", threads, what.c_str(), params_s, gbs,
                  100.0 * gbs / triad, vs);
    };
    std::printf("%-8d %-22s %14s %10.2f %9s%% %12s\n", threads, "triad (STREAM)", "-", triad, "100", "");
    row(std::string("host AdamW ") + host_isa_name(best), fast, true);
    row("host AdamW scalar", scalar, true);
    for (const auto& [what, params_s] : torch_rows) {
      if (params_s > 0) row(what, params_s, false);
      else std::printf("%-8d %s\n", threads, what.c_str());
    }
    if (!torch_note.empty()) std::printf("%-8d (%s, torch.set_num_threads(%d))\n", threads, torch_note.c_str(), threads);
  }
  return 0;
}

}  // namespace trainrun
