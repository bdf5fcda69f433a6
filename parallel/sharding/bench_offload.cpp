// `trainrun bench offload`; see bench_offload.h.
#include "parallel/sharding/bench_offload.h"

#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/common/error.h"
#include "core/common/text.h"
#include "kernels/backend.h"
#include "parallel/sharding/offload.h"

namespace trainrun {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double median_seconds(int repeat, const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Sequential O_DIRECT write (then fdatasync) and read of `bytes` in 16 MiB
// requests, `depth` of them in flight (one thread each, block k on thread
// k % depth, so the file is still swept in order): GB/s each. Depth 1 is
// what dd measures; io_uring keeps several requests in flight, and many
// disks (NVMe, virtio) only reach their rate that way, so the reference
// for "% of disk" is the faster of depth 1 and depth kProbeDepth.
constexpr int kProbeDepth = 8;
std::pair<double, double> disk_speed(const std::string& path, size_t bytes, int repeat, int depth) {
  constexpr size_t kBlock = size_t(16) << 20;
  std::vector<std::unique_ptr<void, decltype(&std::free)>> bufs;
  for (int d = 0; d < depth; ++d) {
    void* p = nullptr;
    TR_CHECK(posix_memalign(&p, 4096, kBlock) == 0, "bench offload: cannot allocate the I/O buffer");
    std::memset(p, 0x5a, kBlock);
    bufs.emplace_back(p, &std::free);
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  TR_CHECK(fd >= 0, "bench offload: cannot open '", path, "' with O_DIRECT (", std::strerror(errno),
           "); name a --dir on a local disk");
  ::unlink(path.c_str());
  auto sweep = [&](bool write) {
    std::vector<std::thread> th;
    for (int d = 0; d < depth; ++d)
      th.emplace_back([&, d] {
        void* p = bufs[size_t(d)].get();
        for (size_t off = size_t(d) * kBlock; off < bytes; off += size_t(depth) * kBlock) {
          const size_t n = std::min(kBlock, bytes - off);
          if (write) pwrite_full(fd, path, p, n, off);
          else pread_full(fd, path, p, n, off);
        }
      });
    for (auto& t : th) t.join();
  };
  const double w = median_seconds(repeat, [&] {
    sweep(true);
    ::fdatasync(fd);
  });
  const double r = median_seconds(repeat, [&] { sweep(false); });
  ::close(fd);
  return {double(bytes) / w / 1e9, double(bytes) / r / 1e9};
}

// Median ms/step after the first three steps of metrics.jsonl.
double median_step_ms(const std::string& metrics) {
  std::ifstream f(metrics);
  std::vector<double> ms;
  for (std::string l; std::getline(f, l);) {
    const auto s = l.find("\"step\":"), m = l.find("\"ms_per_step\":");
    if (s == std::string::npos || m == std::string::npos) continue;
    if (std::atoi(l.c_str() + s + 7) > 3) ms.push_back(std::atof(l.c_str() + m + 14));
  }
  if (ms.empty()) return 0;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int run_offload_bench(const OffloadBenchOptions& o) {
  const int64_t n = parse_param_count(o.params);
  TR_CHECK(n >= 1 << 20, "bench offload: --params ", o.params, " is too small (at least 1M)");
  TR_CHECK(o.repeat >= 1 && o.steps >= 5, "bench offload: --repeat must be >= 1 and --steps >= 5");
  const std::string scratch = o.dir + "/trainrun-bench-offload-" + std::to_string(getpid());
  check_offload_dir(scratch);
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{scratch};
  const int threads = omp_get_max_threads();

  // 1. the disk, with the state file's size and access pattern
  const size_t state_bytes = size_t(n) * 16;
  const auto [w1, r1] = disk_speed(scratch + "/probe", state_bytes, o.repeat, 1);
  const auto [wq, rq] = disk_speed(scratch + "/probe", state_bytes, o.repeat, kProbeDepth);
  const double disk_w = std::max(w1, wq), disk_r = std::max(r1, rq);  // the reference below
  std::printf("disk under %s: %.0f MiB sequential O_DIRECT, 16 MiB requests, median of %d\n", o.dir.c_str(),
              state_bytes / 1048576.0, o.repeat);
  std::printf("  %-40s %8.2f GB/s\n  %-40s %8.2f GB/s\n", "write (then fdatasync), 1 in flight", w1,
              "read, 1 in flight", r1);
  std::printf("  %-40s %8.2f GB/s\n  %-40s %8.2f GB/s\n", ("write (then fdatasync), " + std::to_string(kProbeDepth) +
              " in flight").c_str(), wq, ("read, " + std::to_string(kProbeDepth) + " in flight").c_str(), rq);
  std::printf("  %% of disk below: against the faster of each (write %.2f, read %.2f GB/s)\n\n", disk_w, disk_r);

  // 2. the nvme state, per engine
  auto be = make_cpu_backend(threads);
  std::vector<float> dev_grad(size_t(n), 0.001f), dev_act(size_t(n), 0.0f);
  std::printf("parallel.offload: nvme over %lld elements (%.0f MiB on disk), chunk %lld, %d host threads, median of %d\n",
              (long long)n, 16.0 * n / 1048576.0, (long long)(int64_t(1) << 20), threads, o.repeat);
  std::printf("  %-10s %-42s %9s %10s\n", "engine", "what (bytes per element)", "GB/s", "% of disk");
  std::vector<IoChoice> engines = {IoChoice::Pool};
  if (io_uring_built_in()) engines.insert(engines.begin(), IoChoice::Uring);
  for (IoChoice io : engines) {
    OffloadOptions opts;
    opts.mode = OffloadMode::Nvme;
    opts.dir = scratch;
    opts.io = io;
    std::unique_ptr<HostOptimizerState> h;
    try {
      h = std::make_unique<HostOptimizerState>(be.get(), n, opts);
    } catch (const Error& e) {
      std::printf("  %-10s skipped: %s\n", io == IoChoice::Uring ? "io_uring" : "pool", e.what());
      continue;
    }
    const std::vector<OffloadSegment> seg = {{0, n, 0.1f}};
    int step = 0;
    auto row = [&](const char* what, double secs, double read_b, double write_b) {
      const double bytes = (read_b + write_b) * double(n);
      const double disk_s = read_b * double(n) / (disk_r * 1e9) + write_b * double(n) / (disk_w * 1e9);
      std::printf("  %-10s %-42s %9.2f %9.0f%%\n", h->io_engine(), what, bytes / secs / 1e9, 100.0 * disk_s / secs);
    };
    h->zero_grads();
    h->add_grad_from_device(0, dev_grad.data(), n);
    row("step (read 16, write 12)", median_seconds(o.repeat, [&] {
          h->step(seg, 1e-4f, 0.9f, 0.95f, 1e-8f, ++step, 1.0f, dev_act.data());
        }), 16, 12);
    row("grad norm (read 4)", median_seconds(o.repeat, [&] { (void)h->grad_sum_squares({{0, n}}); }), 4, 0);
    row("grad, first micro-batch (write 4)", median_seconds(o.repeat, [&] {
          h->zero_grads();
          h->add_grad_from_device(0, dev_grad.data(), n);
        }), 0, 4);
    row("grad, later micro-batch (read 4, write 4)",
        median_seconds(o.repeat, [&] { h->add_grad_from_device(0, dev_grad.data(), n); }), 4, 4);
    // With accumulation the store sums micro-batches on the device and
    // lands the shard once per step (offload_keeps_device_grad): this row,
    // not the one above, is what a step of several micro-batches costs.
    row("grad, summed on device, landed once (write 4)",
        median_seconds(o.repeat, [&] { h->grad_from_device(dev_grad.data(), n); }), 0, 4);
  }
  std::printf("\n");

  // 3. step time on the benchmark model, this binary, one rank
  if (o.config.empty()) return 0;
  TR_CHECK(fs::exists(o.config), "bench offload: --config '", o.config,
           "' does not exist (run from the repository root, or name configs/bench_cpu.yaml's path; \"\" skips)");
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  // Two rounds, none / cpu / nvme each, the lower median of the two per
  // mode: a burst of load from elsewhere on a shared machine hits one
  // round, rarely both.
  std::printf("step time: %s, %d steps, median ms/step of steps 4-%d, the lower of 2 rounds (one rank, %d threads)\n",
              o.config.c_str(), o.steps, o.steps, threads);
  std::printf("  %-14s %10s %10s\n", "offload", "ms/step", "vs none");
  const char* modes[] = {"none", "cpu", "nvme"};
  double best[3] = {0, 0, 0};
  for (int round = 0; round < 2; ++round)
    for (int k = 0; k < 3; ++k) {
      const std::string mode = modes[k];
      const std::string out = scratch + "/run_" + mode + std::to_string(round);
      const std::string cmd = "'" + self + "' --config '" + o.config + "' --set output.dir=" + out +
                              " --set train.max_steps=" + std::to_string(o.steps) +
                              " --set train.log_interval=1 --set parallel.nproc_per_node=1 --set parallel.offload=" +
                              mode + (mode == "nvme" ? " --set parallel.offload_dir=" + scratch + "/state" : "") + " > " +
                              out + ".log 2>&1";
      const int rc = std::system(cmd.c_str());
      TR_CHECK(rc == 0, "bench offload: the ", mode, " run failed (exit ", rc, "); see ", out, ".log");
      const double ms = median_step_ms(out + "/metrics.jsonl");
      if (ms > 0 && (best[k] == 0 || ms < best[k])) best[k] = ms;
    }
  for (int k = 0; k < 3; ++k) {
    char vs[32] = "";
    if (k > 0 && best[0] > 0) std::snprintf(vs, sizeof vs, "%+.1f%%", 100.0 * (best[k] / best[0] - 1));
    std::printf("  %-14s %10.1f %10s\n", modes[k], best[k], vs);
  }
  return 0;
}

}  // namespace trainrun
