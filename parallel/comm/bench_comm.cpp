// Collective benchmark. Ranks are threads of one process, each with its own
// communicator and its own buffers: the same code path as separate worker
// processes (the store, Gloo's sockets or NCCL's transports), without the
// launcher. --backend cpu: Gloo over loopback TCP, host buffers. --backend
// cuda: NCCL, one GPU per rank (thread r drives GPU r), device buffers; the
// collectives are stream-ordered, so each timing ends with a device sync.
// Times are the slowest rank's mean per iteration (what a training step
// waits for), after a barrier and a warmup iteration.
#include "parallel/comm/bench_comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "core/common/error.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "parallel/comm/communicator.h"
#include "parallel/rendezvous/store.h"

namespace trainrun {

namespace {

using Clock = std::chrono::steady_clock;

// Host memcpy bandwidth (read + write counted once, as a copy of `bytes`).
double memcpy_gbps(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  std::memcpy(b.data(), a.data(), bytes);  // fault the pages in
  int iters = int(std::max<size_t>(3, (1ull << 30) / bytes));
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) std::memcpy(b.data(), a.data(), bytes);
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return double(bytes) * iters / s / 1e9;
}

std::string human(int64_t b) {
  char buf[32];
  if (b >= (1 << 20)) std::snprintf(buf, sizeof buf, "%lld MiB", (long long)(b >> 20));
  else std::snprintf(buf, sizeof buf, "%lld KiB", (long long)(b >> 10));
  return buf;
}


// The activation collectives of a TP group: `tp` ranks, bf16, one
// micro-batch's b*t*d values (the all_reduce's vector; the all_gather's
// output and the reduce_scatter's input, so each rank holds 1/tp of it,
// as under sequence parallelism). Gloo has no bf16 sum: the Communicator
// widens to fp32 around it (parallel/comm/communicator.h), which these
// rows include, as training does.
void run_tp_rows(const CommBenchOptions& o, bool nccl, std::chrono::milliseconds timeout) {
  const int W = o.tp;
  if (nccl) {
    std::string why;
    const int gpus = cuda_device_count(&why);
    TR_CHECK(W <= gpus, "bench comm: --tp ", W, " needs one GPU per rank but ", gpus, " are visible");
  }
  const int64_t count = std::max<int64_t>(W, o.tp_values / W * W);
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  const char* ops[] = {"tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"};
  std::vector<std::vector<double>> secs(3, std::vector<double>(size_t(W)));
  std::vector<std::string> errors(static_cast<size_t>(W));
  const int iters = o.iters > 0 ? o.iters : int(std::clamp<int64_t>((64ll << 20) / (count * 2), 3, 50)) * (nccl ? 4 : 1);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = connect_tcp_store("127.0.0.1", server.port(), secret, timeout);
        std::unique_ptr<Backend> be;
        std::unique_ptr<Communicator> comm;
        std::vector<uint16_t> hbuf, hout;
        DeviceBuffer dbuf, dout;
        uint16_t *buf, *out;
        if (nccl) {
          be = make_backend("cuda", r, nullptr);
          comm = make_nccl_communicator(be.get(), store.get(), "benchtp/", r, W, timeout);
          dbuf = DeviceBuffer(be.get(), size_t(count) * 2);
          dout = DeviceBuffer(be.get(), size_t(count) * 2);
          buf = static_cast<uint16_t*>(dbuf.get());
          out = static_cast<uint16_t*>(dout.get());
        } else {
          comm = make_gloo_communicator(*store, "benchtp/", r, W, "127.0.0.1", timeout);
          hbuf.assign(size_t(count), 0x3f80);  // bf16 1.0
          hout.assign(size_t(count), 0);
          buf = hbuf.data();
          out = hout.data();
        }
        for (int op = 0; op < 3; ++op) {
          auto run_once = [&] {
            if (op == 0) comm->all_reduce_bf16(buf, count, ReduceOp::Sum);
            else if (op == 1) comm->all_gather(out, buf, size_t(count / W) * 2);
            else comm->reduce_scatter_bf16(out, buf, count / W, ReduceOp::Sum);
          };
          run_once();
          comm->barrier();
          if (be) be->synchronize();
          const auto t0 = Clock::now();
          for (int i = 0; i < iters; ++i) run_once();
          if (be) be->synchronize();
          secs[size_t(op)][size_t(r)] = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
        }
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < W; ++r) TR_CHECK(errors[size_t(r)].empty(), "bench comm: TP rows, rank ", r, ": ", errors[size_t(r)]);
  std::printf("# TP activation collectives: bf16, %d ranks, micro-batch x seq_len x n_embd = %s = %lld values "
              "(%s); a TP layer does 4 per block per micro-batch%s\n",
              W, o.tp_shape.c_str(), (long long)count, human(count * 2).c_str(),
              nccl ? "" : "; Gloo sums in fp32 (bf16 widened around it)");
  std::printf("%-18s %10s %12s %12s %12s\n", "op", "size", "time (us)", "algbw GB/s", "busbw GB/s");
  for (int op = 0; op < 3; ++op) {
    const double factor = op == 0 ? 2.0 * (W - 1) / W : double(W - 1) / W;
    const double t = *std::max_element(secs[size_t(op)].begin(), secs[size_t(op)].end());
    const double algbw = double(count) * 2 / t / 1e9;
    std::printf("%-18s %10s %12.1f %12.4g %12.4g\n", ops[op], human(count * 2).c_str(), t * 1e6, algbw, algbw * factor);
  }
}

}  // namespace

// Device-to-device copy bandwidth of one GPU (read + write counted once).
double device_copy_gbps(Backend& be, size_t bytes) {
  DeviceBuffer a(&be, bytes), b(&be, bytes);
  be.copy_device(b.get(), a.get(), bytes);
  be.synchronize();
  const int iters = 20;
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) be.copy_device(b.get(), a.get(), bytes);
  be.synchronize();
  return double(bytes) * iters / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
}

int run_comm_bench(const CommBenchOptions& o) {
  TR_CHECK(o.backend == "cpu" || o.backend == "cuda", "bench comm: --backend ", o.backend,
           " is not a backend; use cpu (Gloo) or cuda (NCCL)");
  TR_CHECK(o.nproc >= 1 && o.nproc <= 64, "bench comm: --nproc must be in [1, 64], got ", o.nproc);
  const bool nccl = o.backend == "cuda";
  if (nccl) {
    std::string why;
    const int gpus = cuda_device_count(&why);
    TR_CHECK(gpus > 0, "bench comm: --backend cuda: no usable GPU: ", why);
    TR_CHECK(o.nproc <= gpus, "bench comm: --backend cuda needs one GPU per rank: --nproc ", o.nproc, " but ", gpus,
             " GPU", gpus == 1 ? " is" : "s are", " visible");
  }
  TR_CHECK(o.min_bytes >= 4 && o.max_bytes >= o.min_bytes, "bench comm: bad size range");
  const int W = o.nproc;
  const auto timeout = std::chrono::milliseconds(int64_t(o.timeout_s * 1000));
  const std::string secret = make_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);

  std::vector<int64_t> sizes;
  for (int64_t b = o.min_bytes; b <= o.max_bytes; b *= 4) sizes.push_back(b);
  // per op, per size: each rank's seconds per iteration
  // send_recv: pipeline-style point to point, ranks paired (0-1, 2-3, ...)
  // in a ping-pong; its time is half the round trip (one message's latency
  // plus transfer), an odd last rank sits out.
  // send_recv (shm), CPU only: the same over the shared-memory link that
  // same-host pipeline stages use (make_shm_communicator).
  const char* ops[] = {"all_reduce", "reduce_scatter", "all_gather", "send_recv", "send_recv (shm)"};
  const int n_ops = W >= 2 ? (nccl ? 4 : 5) : 3;
  std::vector<std::vector<std::vector<double>>> secs(5, std::vector<std::vector<double>>(sizes.size(), std::vector<double>(W)));
  std::vector<std::string> errors(W);
  double copy_gbps = 0;  // NCCL: GPU 0's device copy bandwidth (rank 0 measures)

  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = connect_tcp_store("127.0.0.1", server.port(), secret, timeout);
        std::unique_ptr<Backend> be;
        std::unique_ptr<Communicator> comm;
        if (nccl) {
          be = make_backend("cuda", r, nullptr);
          comm = make_nccl_communicator(be.get(), store.get(), "bench/", r, W, timeout);
          if (r == 0) copy_gbps = device_copy_gbps(*be, size_t(256) << 20);
        } else {
          comm = make_gloo_communicator(*store, "bench/", r, W, "127.0.0.1", timeout);
        }
        std::unique_ptr<Communicator> shm;  // this rank's link to its ping-pong partner
        if (!nccl && W >= 2 && (r ^ 1) < W)
          shm = make_shm_communicator(*store, "benchshm/" + std::to_string(r / 2) + "/", r % 2, timeout);
        for (size_t si = 0; si < sizes.size(); ++si) {
          // Round to a multiple of W floats so every rank's slice is whole.
          int64_t count = std::max<int64_t>(W, sizes[si] / 4 / W * W);
          std::vector<float> hbuf, hout;
          DeviceBuffer dbuf, dout;
          float *buf, *out;
          if (nccl) {
            dbuf = DeviceBuffer(be.get(), size_t(count) * 4);
            dout = DeviceBuffer(be.get(), size_t(count) * 4);
            buf = dbuf.as<float>();
            out = dout.as<float>();
          } else {
            hbuf.assign(count, 1.0f);
            hout.assign(count, 0.0f);
            buf = hbuf.data();
            out = hout.data();
          }
          int iters = o.iters > 0 ? o.iters : int(std::clamp<int64_t>((64ll << 20) / sizes[si], 3, 50));
          if (nccl) iters *= 4;  // microseconds per call: more of them
          const int partner = r ^ 1;
          for (int op = 0; op < n_ops; ++op) {
            auto run_once = [&] {
              if (op == 0) comm->all_reduce(buf, count, ReduceOp::Sum);
              else if (op == 1) comm->reduce_scatter(out, buf, count / W, ReduceOp::Sum);
              else if (op == 2) comm->all_gather(out, buf, size_t(count / W) * 4);
              else if (partner < W) {
                Communicator& c = op == 3 ? *comm : *shm;
                const int peer = op == 3 ? partner : 1 - r % 2;
                if (r % 2 == 0) {
                  c.send(buf, size_t(count) * 4, peer, 7);
                  c.recv(out, size_t(count) * 4, peer, 7);
                } else {
                  c.recv(out, size_t(count) * 4, peer, 7);
                  c.send(out, size_t(count) * 4, peer, 7);
                }
              }
            };
            run_once();  // warmup: connections, page faults
            comm->barrier();
            if (be) be->synchronize();
            auto t0 = Clock::now();
            for (int i = 0; i < iters; ++i) run_once();
            if (be) be->synchronize();  // NCCL calls return once enqueued
            secs[op][si][r] = std::chrono::duration<double>(Clock::now() - t0).count() / iters / (op >= 3 ? 2 : 1);
          }
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < W; ++r) TR_CHECK(errors[r].empty(), "bench comm: rank ", r, ": ", errors[r]);

  const double mem = nccl ? copy_gbps : memcpy_gbps(64ull << 20);
  if (nccl) {
    std::printf("# trainrun bench comm: backend cuda (nccl), %d ranks (threads, one GPU each)\n", W);
    std::printf("# GPU 0 device-to-device copy bandwidth (256 MiB, this run): %.1f GB/s\n", mem);
  } else {
    std::printf("# trainrun bench comm: backend %s (gloo, TCP loopback), %d ranks (threads)\n", o.backend.c_str(), W);
    std::printf("# host memcpy bandwidth (64 MiB copy, this run): %.2f GB/s\n", mem);
  }
  std::printf("# busbw factor: all_reduce 2(n-1)/n, reduce_scatter and all_gather (n-1)/n, send_recv 1 (its time: "
              "one way, half a ping-pong's round trip between rank pairs 0-1, 2-3, ...)\n");
  std::printf("%-15s %10s %12s %12s %12s %10s\n", "op", "size", "time (us)", "algbw GB/s", "busbw GB/s",
              nccl ? "busbw/copy" : "busbw/memcpy");
  for (int op = 0; op < n_ops; ++op) {
    const double factor = op == 0 ? 2.0 * (W - 1) / W : op >= 3 ? 1.0 : double(W - 1) / W;
    for (size_t si = 0; si < sizes.size(); ++si) {
      const double t = *std::max_element(secs[op][si].begin(), secs[op][si].end());
      const int64_t count = std::max<int64_t>(W, sizes[si] / 4 / W * W);
      const double algbw = double(count) * 4 / t / 1e9;
      std::printf("%-15s %10s %12.1f %12.4g %12.4g %9.1f%%\n", ops[op], human(count * 4).c_str(), t * 1e6, algbw,
                  algbw * factor, 100.0 * algbw * factor / mem);
    }
  }
  if (o.tp >= 2) run_tp_rows(o, nccl, timeout);
  return 0;
}

}  // namespace trainrun
