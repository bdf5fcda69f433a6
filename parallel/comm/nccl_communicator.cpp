// The NCCL communicator: collectives between GPU ranks. Compiled only into
// libtrainrun_cuda.so (see kernels/backend_factory.h), reached through
// trainrun::make_nccl_communicator.
//
// Bootstrap: rank 0 creates the NCCL unique id and publishes it in the
// rendezvous store under "<prefix>nccl_unique_id"; the others wait for it
// (with the communicator's timeout) and the last rank to read it removes it.
// The communicator is created non-blocking (ncclConfig_t.blocking = 0), so
// neither init nor a collective can hang the process: we poll.
//
// Streams: every communicator of more than one rank has a stream of its
// own (the review of 12b972a found all mesh groups sharing the backend's
// comm stream, enqueued from the compute thread (TP) and the sharded
// store's comm thread (DP): their order on that one stream could differ
// between ranks, a cycle that hangs every rank). The order in which a rank
// enqueues on its communicators is the program order of its compute thread
// on every rank (parallel/comm/enqueue_order.h: a ticket lock per rank that
// the trainer wraps every communicator in; tested on the CPU with the
// recorder of comm_record.h), and the same lock keeps two host threads from
// enqueueing NCCL work at once. A collective runs on its stream after an event
// recorded on the compute stream (so it sees every op enqueued before the
// call), inside ncclGroupStart/End. On device buffers it is stream-ordered:
// an event recorded after it on the comm stream is waited on by the compute
// stream (cudaStreamWaitEvent), so everything enqueued after the call sees
// its output, and the call returns as soon as the work is enqueued: no host
// sync in the step. Buffers released after the call go back to the caching
// allocator, whose next user enqueues on the compute stream, behind that
// wait. all_gather_deferred is the exception that gives overlap: the
// compute stream waits for it only where the sharded store acquires the
// unit, so the block in between runs alongside the next unit's all-gather;
// reduce_scatter_deferred likewise lets a unit's gradient reduction run
// alongside the next unit's backward (the store waits, accumulates and
// recycles the buffer when it takes the next reduction).
// TRAINRUN_NCCL_BLOCKING=1 makes every call wait on the host until its
// collective has finished.
//
// Watchdog: a thread per communicator polls the pending collectives' events
// (oldest first) and ncclCommGetAsyncError. When NCCL reports an error, or a
// collective exceeds the timeout, it aborts the communicator with
// ncclCommAbort (which makes the NCCL kernels exit, so the GPU does not stay
// hung) and records an Error naming the operation, the step, this rank and
// the timeout; the next call on the communicator (at the latest the trainer's
// per-step loss all-reduce, whose host-staged result is waited for) throws
// it, and every later call repeats it. Host-staged calls, barrier() and
// blocking mode wait inline, with the same checks.
//
// Pipeline links (make_nccl_communicator with own_stream): a 2-rank
// communicator that carries one direction between two pipeline stages; like
// every communicator it runs on its own stream, so a receive that waits for
// its peer holds up neither the FSDP collectives nor the other links. send_deferred is its send:
// the compute stream waits for it only where the executor is about to
// overwrite the buffer (slot reuse) and at the end of the step. The
// caller's op label (set_op_label: the step, the microbatch, the peer
// stage) goes into every message, the watchdog's abort included.
//
// Host pointers (e.g. the trainer's loss scalar) are staged through a
// device buffer. A world of one needs no NCCL at all: copies on the compute
// stream.
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "core/common/error.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/plugin_log.h"
#include "parallel/comm/communicator.h"

namespace trainrun::cuda {

namespace {

using Clock = std::chrono::steady_clock;

std::string seconds(std::chrono::milliseconds d) {
  if (d.count() % 1000 == 0) return detail::cat(d.count() / 1000, " s");
  return detail::cat(d.count(), " ms");
}

bool is_device_pointer(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
  }
  return ncclSum;
}

// The compute stream's wait for one deferred collective (its own event,
// recorded after the collective on the communicator's stream). The event
// is shared: ready_point() hands it to another stream's wait (offload's
// copy stream), and it is destroyed with its last holder; a wait already
// enqueued on it stays valid (CUDA releases it once the GPU has passed).
class DeferredWait final : public PendingCollective {
 public:
  DeferredWait(CudaBackend* be, cudaEvent_t ev)
      : be_(be), ev_(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }) {}
  void order_compute_after() override {
    if (!ev_) return;
    be_->make_current();
    TR_CUDA_CHECK(cudaStreamWaitEvent(be_->compute_stream(), static_cast<cudaEvent_t>(ev_.get()), 0));
    ev_.reset();
  }
  std::shared_ptr<void> ready_point() const override { return ev_; }

 private:
  CudaBackend* be_;
  std::shared_ptr<void> ev_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(CudaBackend* be, ncclComm_t comm, int rank, int world, std::string prefix,
                   std::chrono::milliseconds timeout, bool own_stream)
      : be_(be), comm_(comm), rank_(rank), world_(world), prefix_(std::move(prefix)), timeout_(timeout) {
    be_->make_current();
    // A stream per communicator (see the top); `own_stream` is kept in the
    // signature for the plugin ABI and says nothing more now.
    (void)own_stream;
    if (world_ > 1) TR_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    const char* b = std::getenv("TRAINRUN_NCCL_BLOCKING");
    stream_ordered_ = !(b && *b && std::strcmp(b, "0") != 0);
    if (comm_ && world_ > 1 && stream_ordered_) watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~NcclCommunicator() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lk(wd_mu_);
        wd_stop_ = true;
      }
      wd_cv_.notify_all();
      watchdog_.join();
    }
    // Ops still in flight (an error unwinding past enqueued pipeline
    // receives and sends that no peer will match): a short grace for them
    // to finish, then abort rather than finalize, which would wait the whole
    // timeout per communicator while the agent waits to hear of the failure.
    bool drained = true;
    {
      const auto t0 = Clock::now();
      for (const Pending& p : pending_) {
        cudaError_t q;
        while ((q = cudaEventQuery(p.ev)) == cudaErrorNotReady && Clock::now() - t0 < std::chrono::seconds(5))
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (q != cudaSuccess) {
          drained = false;
          cudaGetLastError();
          break;
        }
      }
    }
    for (const Pending& p : pending_) free_events_.push_back(p.ev);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (comm_ && broken_.empty() && !drained) {
      ncclCommAbort(comm_);
    } else if (comm_ && broken_.empty()) {
      // Flush, then destroy; a peer that is gone makes finalize hang: abort then.
      ncclResult_t st = ncclCommFinalize(comm_);
      const auto t0 = Clock::now();
      while (st == ncclInProgress && Clock::now() - t0 < timeout_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess) break;
      }
      if (st == ncclSuccess) ncclCommDestroy(comm_);
      else ncclCommAbort(comm_);
    }
    if (staging_) be_->allocator().release(staging_);
    if (ready_) cudaEventDestroy(ready_);
    if (done_) cudaEventDestroy(done_);
    if (own_stream_) cudaStreamDestroy(own_stream_);  // released once its work has drained
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "nccl"; }
  bool stream_ordered() const override { return world_ > 1 && stream_ordered_ && watchdog_.joinable(); }

  void all_reduce(float* buf, int64_t count, ReduceOp op) override {
    const char* what = "all_reduce";
    check_usable(what);
    TR_CHECK(count >= 0, where(what), ": negative count ", count);
    if (count == 0 || world_ == 1) return;  // Sum, Avg and Max over one rank: the identity
    const size_t bytes = size_t(count) * 4;
    Staged s = stage(buf, bytes, true);
    // Staged (host memory): wait here, the caller reads the result next.
    run(what, [&] { return ncclAllReduce(s.dev, s.dev, size_t(count), ncclFloat, nccl_op(op), comm_, stream()); },
        s.staged);
    unstage(s, buf, bytes);
  }

  void reduce_scatter(float* out, const float* in, int64_t count_per_rank, ReduceOp op) override {
    const char* what = "reduce_scatter";
    check_usable(what);
    TR_CHECK(count_per_rank >= 0, where(what), ": negative count ", count_per_rank);
    if (count_per_rank == 0) return;
    const size_t bytes = size_t(count_per_rank) * 4;
    if (world_ == 1) return local_copy(out, in, bytes);
    // Staging: `in` (world x bytes) goes through one buffer; out lands at
    // its slice `rank` (NCCL's in-place layout), copied back to `out`.
    const size_t in_bytes = bytes * size_t(world_);
    const bool dev = is_device_pointer(in) && is_device_pointer(out);
    if (dev) {
      run(what, [&] {
        return ncclReduceScatter(in, out, size_t(count_per_rank), ncclFloat, nccl_op(op), comm_, stream());
      });
      return;
    }
    void* s = staging(in_bytes);
    copy_in(s, in, in_bytes);
    char* slice = static_cast<char*>(s) + size_t(rank_) * bytes;
    run(what, [&] {
      return ncclReduceScatter(s, slice, size_t(count_per_rank), ncclFloat, nccl_op(op), comm_, stream());
    }, true);
    copy_out(out, slice, bytes);
  }

  void all_gather(void* out, const void* in, size_t bytes_per_rank) override {
    const char* what = "all_gather";
    check_usable(what);
    if (bytes_per_rank == 0) return;
    if (world_ == 1) return local_copy(out, in, bytes_per_rank);
    const size_t out_bytes = bytes_per_rank * size_t(world_);
    if (is_device_pointer(in) && is_device_pointer(out)) {
      run(what, [&] { return ncclAllGather(in, out, bytes_per_rank, ncclInt8, comm_, stream()); });
      return;
    }
    void* s = staging(out_bytes);
    char* smine = static_cast<char*>(s) + size_t(rank_) * bytes_per_rank;
    copy_in(smine, in, bytes_per_rank);
    run(what, [&] { return ncclAllGather(smine, s, bytes_per_rank, ncclInt8, comm_, stream()); }, true);
    copy_out(out, s, out_bytes);
  }

  // Grouped ncclSend/ncclRecv with every rank (itself included), one
  // group: stream-ordered like the collectives. Host memory goes through
  // the staging buffer (input first, output after it).
  void all_to_all(void* out, const void* in, size_t bytes_per_rank) override {
    const char* what = "all_to_all";
    check_usable(what);
    if (bytes_per_rank == 0) return;
    if (world_ == 1) return local_copy(out, in, bytes_per_rank);
    const size_t total = bytes_per_rank * size_t(world_);
    auto exchange = [&](const char* src, char* dst) {
      ncclResult_t r = ncclSuccess;
      for (int p = 0; p < world_ && (r == ncclSuccess || r == ncclInProgress); ++p) {
        r = ncclSend(src + size_t(p) * bytes_per_rank, bytes_per_rank, ncclInt8, p, comm_, stream());
        if (r == ncclSuccess || r == ncclInProgress)
          r = ncclRecv(dst + size_t(p) * bytes_per_rank, bytes_per_rank, ncclInt8, p, comm_, stream());
      }
      return r;
    };
    if (is_device_pointer(in) && is_device_pointer(out)) {
      run(what, [&] { return exchange(static_cast<const char*>(in), static_cast<char*>(out)); });
      return;
    }
    char* st = static_cast<char*>(staging(2 * total));
    copy_in(st, in, total);
    run(what, [&] { return exchange(st, st + total); }, true);
    copy_out(out, st + total, total);
  }

  // As all_to_all with a size per peer: one group of ncclSend/ncclRecv at
  // the packed offsets (zero sizes included: NCCL matches them as no-ops on
  // both sides). Host memory goes through the staging buffer.
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    const char* what = "all_to_all_v";
    check_usable(what);
    std::vector<size_t> soff(size_t(world_) + 1, 0), roff(size_t(world_) + 1, 0);
    for (int p = 0; p < world_; ++p) {
      soff[size_t(p) + 1] = soff[size_t(p)] + send_bytes[p];
      roff[size_t(p) + 1] = roff[size_t(p)] + recv_bytes[p];
    }
    const size_t send_total = soff.back(), recv_total = roff.back();
    if (world_ == 1) {
      TR_CHECK(recv_bytes[0] == send_bytes[0], where(what), ": receives ", recv_bytes[0],
               " bytes from itself but sends ", send_bytes[0]);
      return local_copy(out, in, send_total);
    }
    auto exchange = [&](const char* src, char* dst) {
      ncclResult_t r = ncclSuccess;
      for (int p = 0; p < world_ && (r == ncclSuccess || r == ncclInProgress); ++p) {
        r = ncclSend(src + soff[size_t(p)], send_bytes[p], ncclInt8, p, comm_, stream());
        if (r == ncclSuccess || r == ncclInProgress)
          r = ncclRecv(dst + roff[size_t(p)], recv_bytes[p], ncclInt8, p, comm_, stream());
      }
      return r;
    };
    if ((send_total == 0 || is_device_pointer(in)) && (recv_total == 0 || is_device_pointer(out))) {
      run(what, [&] { return exchange(static_cast<const char*>(in), static_cast<char*>(out)); });
      return;
    }
    char* st = static_cast<char*>(staging(send_total + recv_total));
    copy_in(st, in, send_total);
    run(what, [&] { return exchange(st, st + send_total); }, true);
    copy_out(out, st + send_total, recv_total);
  }

  // Stream-ordered like all_gather, but the compute stream's wait is the
  // handle's (a second event recorded after the collective on the comm stream).
  std::shared_ptr<void> compute_point() override {
    if (world_ == 1 || !stream_ordered_) return nullptr;  // those calls never defer
    be_->make_current();
    cudaEvent_t ev = nullptr;
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    TR_CUDA_CHECK(cudaEventRecord(ev, be_->compute_stream()));
    // Destroyed with the last reference; a wait already enqueued on it stays valid.
    return std::shared_ptr<void>(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
  }

  std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes_per_rank,
                                                         const std::shared_ptr<void>& after) override {
    const char* what = "all_gather";
    // First: on the store's comm thread this is often the first CUDA call,
    // and cudaPointerGetAttributes (is_device_pointer) on a thread whose
    // device was never set creates a context on GPU 0 (every rank > 0 would
    // then hold one there; EXCLUSIVE_PROCESS GPUs refuse it).
    be_->make_current();
    if (!stream_ordered_ || world_ == 1 || bytes_per_rank == 0 || !is_device_pointer(in) || !is_device_pointer(out)) {
      all_gather(out, in, bytes_per_rank);
      return nullptr;
    }
    check_usable(what);
    cudaEvent_t ev = nullptr;
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    auto pending = std::make_unique<DeferredWait>(be_, ev);
    run(what, [&] { return ncclAllGather(in, out, bytes_per_rank, ncclInt8, comm_, stream()); }, false, ev,
        static_cast<cudaEvent_t>(after.get()));
    return pending;
  }

  std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in, int64_t count_per_rank,
                                                             ReduceOp op, const std::shared_ptr<void>& after) override {
    const char* what = "reduce_scatter";
    be_->make_current();  // before is_device_pointer: see all_gather_deferred
    if (!stream_ordered_ || world_ == 1 || count_per_rank <= 0 || !is_device_pointer(in) || !is_device_pointer(out)) {
      reduce_scatter(out, in, count_per_rank, op);
      return nullptr;
    }
    check_usable(what);
    cudaEvent_t ev = nullptr;
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    auto pending = std::make_unique<DeferredWait>(be_, ev);
    run(what, [&] {
      return ncclReduceScatter(in, out, size_t(count_per_rank), ncclFloat, nccl_op(op), comm_, stream());
    }, false, ev, static_cast<cudaEvent_t>(after.get()));
    return pending;
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    const char* what = "broadcast";
    check_usable(what);
    TR_CHECK(root >= 0 && root < world_, where(what), ": root ", root, " is not a rank of a group of ", world_);
    if (bytes == 0 || world_ == 1) return;
    Staged s = stage(buf, bytes, rank_ == root);
    run(what, [&] { return ncclBroadcast(s.dev, s.dev, bytes, ncclInt8, root, comm_, stream()); }, s.staged);
    unstage(s, buf, bytes);
  }

  // As the fp32 calls, reduced by NCCL in bf16.
  void all_reduce_bf16(uint16_t* buf, int64_t count, ReduceOp op) override {
    const char* what = "all_reduce_bf16";
    check_usable(what);
    TR_CHECK(count >= 0, where(what), ": negative count ", count);
    if (count == 0 || world_ == 1) return;
    const size_t bytes = size_t(count) * 2;
    Staged s = stage(buf, bytes, true);
    run(what, [&] {
      return ncclAllReduce(s.dev, s.dev, size_t(count), ncclBfloat16, nccl_op(op), comm_, stream());
    }, s.staged);
    unstage(s, buf, bytes);
  }

  void reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t count_per_rank, ReduceOp op) override {
    const char* what = "reduce_scatter_bf16";
    check_usable(what);
    TR_CHECK(count_per_rank >= 0, where(what), ": negative count ", count_per_rank);
    if (count_per_rank == 0) return;
    const size_t bytes = size_t(count_per_rank) * 2;
    if (world_ == 1) return local_copy(out, in, bytes);
    if (is_device_pointer(in) && is_device_pointer(out)) {
      run(what, [&] {
        return ncclReduceScatter(in, out, size_t(count_per_rank), ncclBfloat16, nccl_op(op), comm_, stream());
      });
      return;
    }
    const size_t in_bytes = bytes * size_t(world_);
    void* st = staging(in_bytes);
    copy_in(st, in, in_bytes);
    char* slice = static_cast<char*>(st) + size_t(rank_) * bytes;
    run(what, [&] {
      return ncclReduceScatter(st, slice, size_t(count_per_rank), ncclBfloat16, nccl_op(op), comm_, stream());
    }, true);
    copy_out(out, slice, bytes);
  }

  // ncclSend/ncclRecv in one group, so both are posted before either waits.
  // NCCL has no tags: messages between a pair match in the order they are
  // issued, which the pipeline schedules keep the same on both sides.
  void send_recv(const void* send_buf, size_t send_bytes, int send_to, void* recv_buf, size_t recv_bytes,
                 int recv_from, uint32_t) override {
    const char* what = send_to < 0 ? "recv" : recv_from < 0 ? "send" : "send_recv";
    check_usable(what);
    for (int peer : {send_to, recv_from})
      TR_CHECK(peer >= -1 && peer < world_, where(what), ": peer ", peer, " is not a rank of a group of ", world_);
    const bool sending = send_to >= 0 && send_bytes > 0, receiving = recv_from >= 0 && recv_bytes > 0;
    if (!sending && !receiving) return;
    if (send_to == rank_ || recv_from == rank_) {
      TR_CHECK(send_to == rank_ && recv_from == rank_ && send_bytes == recv_bytes, where(what),
               ": a rank sends to itself only with a matching receive from itself of the same size");
      return local_copy(recv_buf, send_buf, send_bytes);
    }
    const bool dev = (!sending || is_device_pointer(send_buf)) && (!receiving || is_device_pointer(recv_buf));
    if (dev) {
      run(what, [&] {
        ncclResult_t r = ncclSuccess;
        if (receiving) r = ncclRecv(recv_buf, recv_bytes, ncclInt8, recv_from, comm_, stream());
        if (sending && (r == ncclSuccess || r == ncclInProgress))
          r = ncclSend(send_buf, send_bytes, ncclInt8, send_to, comm_, stream());
        return r;
      });
      return;
    }
    // Host memory: both through one staging buffer, receive area first.
    const size_t roff = 0, soff = (recv_bytes + 255) / 256 * 256;
    char* st = static_cast<char*>(staging(soff + send_bytes));
    if (sending) copy_in(st + soff, send_buf, send_bytes);
    run(what, [&] {
      ncclResult_t r = ncclSuccess;
      if (receiving) r = ncclRecv(st + roff, recv_bytes, ncclInt8, recv_from, comm_, stream());
      if (sending && (r == ncclSuccess || r == ncclInProgress))
        r = ncclSend(st + soff, send_bytes, ncclInt8, send_to, comm_, stream());
      return r;
    }, true);
    if (receiving) copy_out(recv_buf, st + roff, recv_bytes);
  }

  // A send on this communicator's stream after `after` (or the compute
  // stream's current end), its completion recorded in the handle's event
  // instead of being waited for by the compute stream (as all_gather_deferred).
  std::unique_ptr<PendingCollective> send_deferred(const void* buf, size_t bytes, int to, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    const char* what = "send";
    be_->make_current();  // before is_device_pointer: see all_gather_deferred
    if (!stream_ordered() || bytes == 0 || to == rank_ || !is_device_pointer(buf)) {
      send(buf, bytes, to, tag);
      return nullptr;
    }
    check_usable(what);
    TR_CHECK(to >= 0 && to < world_, where(what), ": peer ", to, " is not a rank of a group of ", world_);
    cudaEvent_t ev = nullptr;
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    auto pending = std::make_unique<DeferredWait>(be_, ev);
    run(what, [&] { return ncclSend(buf, bytes, ncclInt8, to, comm_, stream()); }, false, ev,
        static_cast<cudaEvent_t>(after.get()));
    return pending;
  }

  // A receive posted ahead of its use (the pipeline's early receives):
  // like send_deferred, on this communicator's stream after `after`; the
  // compute stream waits for it at the handle's order_compute_after().
  std::unique_ptr<PendingCollective> recv_deferred(void* buf, size_t bytes, int from, uint32_t tag,
                                                   const std::shared_ptr<void>& after) override {
    const char* what = "recv";
    be_->make_current();  // before is_device_pointer: see all_gather_deferred
    if (!stream_ordered() || bytes == 0 || from == rank_ || !is_device_pointer(buf)) {
      recv(buf, bytes, from, tag);
      return nullptr;
    }
    check_usable(what);
    TR_CHECK(from >= 0 && from < world_, where(what), ": peer ", from, " is not a rank of a group of ", world_);
    cudaEvent_t ev = nullptr;
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    auto pending = std::make_unique<DeferredWait>(be_, ev);
    run(what, [&] { return ncclRecv(buf, bytes, ncclInt8, from, comm_, stream()); }, false, ev,
        static_cast<cudaEvent_t>(after.get()));
    return pending;
  }

  void barrier() override {
    const char* what = "barrier";
    check_usable(what);
    if (world_ == 1) return;
    void* s = staging(4);
    // A barrier is a host-side promise: wait for it here.
    run(what, [&] { return ncclAllReduce(s, s, 1, ncclFloat, ncclSum, comm_, stream()); }, true);
  }

 private:
  struct Staged {
    void* dev = nullptr;
    bool staged = false;
  };

  cudaStream_t stream() const { return own_stream_ ? own_stream_ : be_->comm_stream(); }

  // "reduce_scatter (step 12, rank 1 of 4)", then the caller's label
  // ("...: pipeline (step 12): receiving the activation of microbatch 3 ...").
  std::string where(const char* op) const {
    std::string w = describe(std::string("nccl ") + op);
    if (!op_label().empty()) w += ": " + op_label();
    return w;
  }

  // Waits until every collective issued so far has finished on the GPU (the
  // watchdog pops them; it aborts one that fails or passes the timeout),
  // then reports the first failure. Bounded: the watchdog gives up on a
  // collective after the timeout, so twice that is a bug, not a slow peer.
  void check_health() override {
    if (world_ == 1) return;
    const auto t0 = Clock::now();
    for (int polls = 0;; ++polls) {
      {
        std::lock_guard<std::mutex> lk(comm_mu_);
        if (!broken_.empty()) TR_FAIL(where("check_health"), ": an earlier collective failed: ", broken_);
      }
      {
        std::lock_guard<std::mutex> lk(wd_mu_);
        if (pending_.empty()) return;
      }
      TR_CHECK(Clock::now() - t0 < 2 * timeout_, where("check_health"), ": collectives still pending after ",
               seconds(2 * timeout_), " (the watchdog should have aborted them)");
      if (polls < 200) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  void check_usable(const char* op) {
    be_->make_current();
    std::lock_guard<std::mutex> lk(comm_mu_);
    if (!broken_.empty()) TR_FAIL(where(op), ": the communicator is unusable after an earlier failure: ", broken_);
  }

  void* staging(size_t bytes) {
    if (bytes > staging_bytes_) {
      if (staging_) be_->allocator().release(staging_);
      staging_ = be_->allocator().allocate(bytes);
      staging_bytes_ = bytes;
    }
    return staging_;
  }
  void copy_in(void* dev, const void* host, size_t bytes) {
    // The staging copy runs on the comm stream *before* run() orders that
    // stream after the compute stream, so order it here: the staging block
    // may just have been handed out by the caching allocator while a
    // compute-stream kernel (e.g. an op's Scratch) still writes it, and in
    // the mixed host/device cases `host` is device memory the compute
    // stream may still be producing. Without this the copy could race both.
    TR_CUDA_CHECK(cudaEventRecord(ready_, be_->compute_stream()));
    TR_CUDA_CHECK(cudaStreamWaitEvent(stream(), ready_, 0));
    TR_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyDefault, stream()));
  }
  void copy_out(void* host, const void* dev, size_t bytes) {
    TR_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDefault, stream()));
    TR_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }
  Staged stage(void* p, size_t bytes, bool copy_input) {
    if (is_device_pointer(p)) return {p, false};
    void* s = staging(bytes);
    if (copy_input) copy_in(s, p, bytes);
    return {s, true};
  }
  void unstage(const Staged& s, void* p, size_t bytes) {
    if (s.staged) copy_out(p, s.dev, bytes);
  }

  // World of one: a copy on the compute stream (ordered with the ops that
  // produced `in` and those that will read `out`); synchronous for host memory.
  void local_copy(void* out, const void* in, size_t bytes) {
    if (out == in) return;
    TR_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDefault, be_->compute_stream()));
    if (!is_device_pointer(out) || !is_device_pointer(in)) TR_CUDA_CHECK(cudaStreamSynchronize(be_->compute_stream()));
  }

  // Orders the comm stream after the compute stream and enqueues `enqueue`
  // as a group. Stream-ordered (the default, see the top): the compute
  // stream waits for it on the GPU, the watchdog times it, and the call
  // returns at once. `blocking` (or TRAINRUN_NCCL_BLOCKING=1): waits here,
  // with the same checks, until it has finished on the GPU.
  // `deferred`: an event to record after the collective in place of the
  // compute stream's wait (all_gather_deferred); the caller owns it.
  template <typename F>
  // `after`: a compute_point() to start after, instead of the compute
  // stream's current end.
  void run(const char* what, F&& enqueue, bool blocking = false, cudaEvent_t deferred = nullptr,
           cudaEvent_t after = nullptr) {
    const auto t0 = Clock::now();
    // Held while comm_ is used: the watchdog aborts (and clears comm_) under it.
    std::lock_guard<std::mutex> lk(comm_mu_);
    if (!broken_.empty()) TR_FAIL(where(what), ": the communicator is unusable after an earlier failure: ", broken_);
    if (after) {
      TR_CUDA_CHECK(cudaStreamWaitEvent(stream(), after, 0));
    } else {
      TR_CUDA_CHECK(cudaEventRecord(ready_, be_->compute_stream()));
      TR_CUDA_CHECK(cudaStreamWaitEvent(stream(), ready_, 0));
    }
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess || r == ncclInProgress) r = enqueue();
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = e;
    if (r != ncclSuccess && r != ncclInProgress) fail(what, detail::cat("NCCL error: ", ncclGetErrorString(r), " (",
                                                                        ncclGetLastError(comm_), ")"));
    // Non-blocking communicator: wait until the work is enqueued on the stream.
    wait_for(what, t0, [&] {
      ncclResult_t st = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(comm_, &st);
      if (q != ncclSuccess) st = q;
      if (st == ncclInProgress) return false;
      if (st != ncclSuccess)
        fail(what, detail::cat("NCCL error: ", ncclGetErrorString(st), " (", ncclGetLastError(comm_), ")"));
      return true;
    });
    if (stream_ordered_ && !blocking && watchdog_.joinable()) {
      cudaEvent_t ev = take_event();
      TR_CUDA_CHECK(cudaEventRecord(ev, stream()));
      if (deferred) {
        TR_CUDA_CHECK(cudaEventRecord(deferred, stream()));
      } else {
        TR_CUDA_CHECK(cudaStreamWaitEvent(be_->compute_stream(), ev, 0));
      }
      {
        std::lock_guard<std::mutex> wl(wd_mu_);
        pending_.push_back(Pending{ev, t0, where(what)});
      }
      wd_cv_.notify_one();
      return;
    }
    TR_CUDA_CHECK(cudaEventRecord(done_, stream()));
    if (deferred) TR_CUDA_CHECK(cudaEventRecord(deferred, stream()));  // already waited for here
    wait_for(what, t0, [&] {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return true;
      if (q != cudaErrorNotReady) throw_cuda_error(q, "cudaEventQuery (NCCL collective)", __FILE__, __LINE__);
      ncclResult_t st = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress)
        fail(what, detail::cat("NCCL error: ", ncclGetErrorString(st), " (", ncclGetLastError(comm_), ")"));
      return false;
    });
  }

  // ---- the watchdog of stream-ordered collectives --------------------------------
  struct Pending {
    cudaEvent_t ev;
    Clock::time_point t0;
    std::string where;  // "nccl all_gather (step 12, rank 1 of 4)"
  };

  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lk(wd_mu_);
      if (!free_events_.empty()) {
        cudaEvent_t e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    TR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  // This communicator's stream runs in order, so only the oldest pending collective can
  // be the one that hangs: poll it every millisecond until it completes, NCCL
  // reports an error, or it passes the timeout (then abort).
  void watchdog_loop() {
    cudaSetDevice(be_->device());
    std::unique_lock<std::mutex> lk(wd_mu_);
    while (!wd_stop_) {
      if (pending_.empty()) {
        wd_cv_.wait(lk);
        continue;
      }
      const Pending p = pending_.front();
      lk.unlock();
      std::string failure;
      const cudaError_t q = cudaEventQuery(p.ev);
      if (q != cudaSuccess) {
        if (q != cudaErrorNotReady) {
          failure = detail::cat("CUDA error while waiting: ", cudaGetErrorName(q), ": ", cudaGetErrorString(q));
          cudaGetLastError();
        } else if (Clock::now() - p.t0 > timeout_) {
          failure = detail::cat("timed out after ", seconds(timeout_),
                                "; a peer may be hung or dead (see its log), or parallel.timeout_s is too short");
        } else {
          // Skipped while a caller holds the communicator: it checks itself.
          std::unique_lock<std::mutex> cl(comm_mu_, std::try_to_lock);
          ncclResult_t st = ncclSuccess;
          if (cl.owns_lock() && comm_ && ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st != ncclSuccess &&
              st != ncclInProgress)
            failure = detail::cat("NCCL error: ", ncclGetErrorString(st), " (", ncclGetLastError(comm_), ")");
        }
      }
      if (!failure.empty()) abort_from_watchdog(p.where + ": " + failure);
      lk.lock();
      if (q == cudaSuccess || !failure.empty()) {
        // Completed; or aborted, after which every pending event completes
        // (the NCCL kernels exit) and nothing more is owed to anyone.
        if (!failure.empty()) {
          for (const Pending& x : pending_) free_events_.push_back(x.ev);
          pending_.clear();
        } else {
          pending_.pop_front();
          free_events_.push_back(p.ev);
          // The next one's clock starts when it can start (this one is
          // done; the comm stream runs them in order), not at its enqueue:
          // a host that runs ahead (a pipeline link's stream-ordered
          // receives) must not time out an op still queued behind others.
          if (!pending_.empty()) pending_.front().t0 = std::max(pending_.front().t0, Clock::now());
        }
        continue;
      }
      wd_cv_.wait_for(lk, std::chrono::milliseconds(1));
    }
  }

  void abort_from_watchdog(const std::string& msg) {
    std::lock_guard<std::mutex> lk(comm_mu_);
    if (!broken_.empty()) return;
    broken_ = msg;
    if (comm_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      broken_ += "; the NCCL communicator was aborted (ncclCommAbort)";
    }
    TR_CUDA_LOG_WARN(broken_);
  }

  // Polls `done` (spinning briefly, then sleeping up to 1 ms) until it says
  // true or the timeout passes (then: abort and fail).
  template <typename F>
  void wait_for(const char* what, Clock::time_point t0, F&& done) {
    int polls = 0;
    while (!done()) {
      if (Clock::now() - t0 > timeout_)
        fail(what, detail::cat("timed out after ", seconds(timeout_),
                               "; a peer may be hung or dead (see its log), or parallel.timeout_s is too short"));
      if (++polls < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(polls < 2000 ? 50 : 1000));
      }
    }
  }

  [[noreturn]] void fail(const char* what, const std::string& cause) {
    std::string msg = detail::cat(where(what), ": ", cause);
    if (comm_) {
      ncclCommAbort(comm_);  // frees the comm and stops its kernels; the stream drains
      comm_ = nullptr;
      msg += "; the NCCL communicator was aborted (ncclCommAbort)";
    }
    broken_ = msg;
    throw Error(msg);
  }

  CudaBackend* be_;
  ncclComm_t comm_;
  int rank_, world_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  cudaStream_t own_stream_ = nullptr;  // this communicator's (world > 1); null: the backend's comm stream (world 1: unused)
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  bool stream_ordered_ = true;
  std::mutex comm_mu_;  // guards comm_ and broken_ between the caller and the watchdog
  std::string broken_;
  // The watchdog (stream-ordered mode, world > 1).
  std::thread watchdog_;
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  bool wd_stop_ = false;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator_impl(Backend* be_base, Store* store, const std::string& prefix,
                                                          int rank, int world, std::chrono::milliseconds timeout,
                                                          bool own_stream) {
  auto* be = dynamic_cast<CudaBackend*>(be_base);
  const std::string where = detail::cat("nccl rendezvous (prefix '", prefix, "', rank ", rank, " of ", world, ")");
  TR_CHECK(be, where, ": needs the CUDA backend");
  TR_CHECK(world >= 1 && rank >= 0 && rank < world, where, ": rank out of range");
  TR_CHECK(timeout.count() > 0, where, ": timeout must be positive");
  be->make_current();
  if (world == 1) return std::make_unique<NcclCommunicator>(be, nullptr, 0, 1, prefix, timeout, false);
  TR_CHECK(store, where, ": a rendezvous store is needed for more than one rank");

  const std::string key = prefix + "nccl_unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    TR_CHECK(r == ncclSuccess, where, ": ncclGetUniqueId failed: ", ncclGetErrorString(r),
             " (check NCCL_SOCKET_IFNAME and that the network interface is up)");
    store->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id));
  } else {
    std::vector<uint8_t> v;
    try {
      v = store->get(key, timeout);
    } catch (const StoreTimeoutError&) {
      TR_FAIL(where, ": rank 0 did not publish the NCCL id within ", seconds(timeout),
              "; check that rank 0 started and reached the rendezvous");
    }
    TR_CHECK(v.size() == sizeof id, where, ": the NCCL id in the store has ", v.size(), " bytes, expected ", sizeof id);
    std::memcpy(&id, v.data(), sizeof id);
  }
  // The last rank to have read the id removes it (the store keeps no junk).
  if (store->add(key + "/readers", 1) == world) {
    store->remove(key);
    store->remove(key + "/readers");
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  const auto t0 = Clock::now();
  while (r == ncclInProgress) {
    if (Clock::now() - t0 > timeout) {
      ncclCommAbort(comm);
      TR_FAIL(where, ": ncclCommInitRank did not finish within ", seconds(timeout),
              "; another rank may not have joined (see its log); the communicator was aborted");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
  }
  if (r != ncclSuccess) {
    const std::string detail = comm ? ncclGetLastError(comm) : "";
    if (comm) ncclCommAbort(comm);
    // The common cause of invalid usage here: two ranks of the group on one
    // GPU (NCCL: "Duplicate GPU detected"), e.g. every worker pinned to
    // GPU 0 by CUDA_VISIBLE_DEVICES. trainrun gives each rank its own GPU.
    TR_FAIL(where, ": ncclCommInitRank failed: ", ncclGetErrorString(r), detail.empty() ? "" : " (" + detail + ")",
            r == ncclInvalidUsage ? "; if two ranks share a GPU (NCCL refuses duplicate GPUs in a communicator), "
                                    "give each rank its own: one worker per GPU, LOCAL_RANK r on GPU r, and no "
                                    "CUDA_VISIBLE_DEVICES that maps several workers to one device"
                                  : "");
  }
  int version = 0;
  ncclGetVersion(&version);
  TR_CUDA_LOG_DEBUG("nccl: rank ", rank, " of ", world, " ready on ", be->name(), " (prefix '", prefix, "', NCCL ",
                    version, ")");
  return std::make_unique<NcclCommunicator>(be, comm, rank, world, prefix, timeout, own_stream);
}

}  // namespace trainrun::cuda
