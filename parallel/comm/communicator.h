// Communicator: the collectives the sharded trainer needs. Buffers are in the
// backend's memory (host memory for the CPU backend / Gloo; device memory for
// NCCL). Ordering contract with the backend's ops: a collective sees every op
// enqueued before the call, and every op enqueued after the call sees its
// result. Gloo gets this by running synchronously on the host; NCCL by
// stream order (events between the compute and comm streams), returning
// before the collective has finished on the GPU, so callers must not read a
// device result on the host except through the backend (copy_to_host waits
// for the compute stream). Host-pointer arguments are always complete when
// the call returns. Every collective has a timeout; on expiry or a dead peer
// a trainrun::Error names the operation, the current step (set_step) and the
// peer when known, e.g. "all_gather (step 12, rank 1 of 4): timed out after
// 30 s waiting for rank 2". Gloo throws it from the call; NCCL's watchdog
// aborts the communicator and the next call on it throws (at the latest the
// trainer's per-step loss all-reduce, a host-staged call that waits).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <cstring>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "parallel/rendezvous/store.h"

namespace trainrun {

enum class ReduceOp { Sum, Avg, Max };

class EnqueueOrder;  // parallel/comm/enqueue_order.h

// A collective whose result the compute stream has not been told to wait
// for yet (see Communicator::all_gather_deferred).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // Ops enqueued on the compute stream from now on run after the
  // collective. Call it before reading the result or handing its buffer on.
  virtual void order_compute_after() = 0;
  // A point after the collective's completion that another stream (a
  // backend's copy, Backend::copy_to_host_chunks) can wait on without the
  // compute stream (NCCL: the event recorded after it). Null: none; order
  // on the compute stream (order_compute_after) instead.
  virtual std::shared_ptr<void> ready_point() const { return nullptr; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;  // "gloo", "nccl"
  // In place, fp32.
  virtual void all_reduce(float* buf, int64_t count, ReduceOp op) = 0;
  // in: world_size * count_per_rank fp32 values (the full vector, rank r's
  // slice at offset r*count_per_rank); out: count_per_rank values, the
  // reduction of rank r's slice across all ranks. Works for any world size.
  virtual void reduce_scatter(float* out, const float* in, int64_t count_per_rank, ReduceOp op) = 0;
  // in: bytes_per_rank; out: world_size * bytes_per_rank, rank r's at r*bytes_per_rank.
  // `in` may alias out + rank*bytes_per_rank (in-place all-gather).
  virtual void all_gather(void* out, const void* in, size_t bytes_per_rank) = 0;
  // A point in the compute stream's order, taken now (NCCL: an event
  // recorded on it; null where calls are synchronous). A deferred collective
  // given one starts after it rather than after everything enqueued by the
  // time the (communication) thread issues it, so compute that the compute
  // thread enqueues meanwhile runs alongside instead of ahead of it.
  virtual std::shared_ptr<void> compute_point() { return nullptr; }
  // all_gather whose completion the compute stream waits for only at the
  // returned handle's order_compute_after(), so compute enqueued in between
  // overlaps it (the sharded store's prefetch). `out` must not be touched by
  // the compute stream until then. It reads `in` and writes `out` after
  // `after` (a compute_point()), or, when null, after everything enqueued on
  // the compute stream so far. Null handle: it already completed (every
  // synchronous communicator, and the default).
  virtual std::unique_ptr<PendingCollective> all_gather_deferred(void* out, const void* in, size_t bytes_per_rank,
                                                                 const std::shared_ptr<void>& after = nullptr) {
    (void)after;
    all_gather(out, in, bytes_per_rank);
    return nullptr;
  }
  // reduce_scatter whose completion the compute stream waits for only at
  // the handle's order_compute_after(): until then `out` must not be read
  // and `in` must not be written by the compute stream; `after` as above.
  // Null: completed.
  virtual std::unique_ptr<PendingCollective> reduce_scatter_deferred(float* out, const float* in,
                                                                     int64_t count_per_rank, ReduceOp op,
                                                                     const std::shared_ptr<void>& after = nullptr) {
    (void)after;
    reduce_scatter(out, in, count_per_rank, op);
    return nullptr;
  }
  virtual void broadcast(void* buf, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // in: world_size blocks of bytes_per_rank, block j for rank j; out:
  // world_size blocks, block i from rank i (context parallelism's Ulysses
  // exchange, expert dispatch). in and out must not overlap. Gloo, the
  // single-rank and the shared-memory pair implement it; NCCL as grouped
  // send/recv. The default is an Error naming the communicator.
  virtual void all_to_all(void* out, const void* in, size_t bytes_per_rank);
  // all_to_all with a size per peer (expert parallelism's token dispatch and
  // combine: how many rows go to each expert's rank changes every step).
  // in: world_size blocks back to back, block j send_bytes[j] long, for
  // rank j; out: world_size blocks back to back, block i recv_bytes[i] long,
  // from rank i. recv_bytes[i] here must equal send_bytes[me] on rank i: the
  // caller learns the sizes first (one all_to_all of the counts), as every
  // MoE dispatch does, so no size travels twice. Zero sizes are fine. in and
  // out must not overlap. A size that disagrees with its peer's is an Error
  // where the transport can see it (the shared-memory pair's frame, NCCL's
  // and Gloo's transfers), never a silent short read. The default is an
  // Error naming the communicator.
  virtual void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes);

  // bf16 (bit patterns) all_reduce and reduce_scatter, for activations and
  // act-dtype gradients (tensor parallelism on the GPU). all_gather moves
  // bytes and needs no variant. NCCL reduces natively in bf16; the default,
  // for communicators over host memory (Gloo), widens to fp32, runs the
  // fp32 collective (its fixed order) and rounds once to nearest even, so
  // every rank gets the same bits.
  virtual void all_reduce_bf16(uint16_t* buf, int64_t count, ReduceOp op);
  virtual void reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t count_per_rank, ReduceOp op);

  // Point to point, for pipeline stages: sends send_bytes of send_buf to
  // rank send_to and receives recv_bytes into recv_buf from rank recv_from
  // (-1 skips a side), posting both before waiting for either, so a stage
  // that sends forward and receives from behind in one call cannot
  // deadlock with its neighbours whatever order they call in. `tag` tells
  // apart messages between the same pair (the receive matches the send
  // with the same tag). Buffers are in the backend's memory, as for the
  // collectives; NCCL is stream-ordered, Gloo blocks. Every wait has the
  // timeout, and its error names the peer.
  virtual void send_recv(const void* send_buf, size_t send_bytes, int send_to, void* recv_buf, size_t recv_bytes,
                         int recv_from, uint32_t tag = 0);
  void send(const void* buf, size_t bytes, int to, uint32_t tag = 0) {
    send_recv(buf, bytes, to, nullptr, 0, -1, tag);
  }
  void recv(void* buf, size_t bytes, int from, uint32_t tag = 0) { send_recv(nullptr, 0, -1, buf, bytes, from, tag); }
  // True when send/recv (and send_deferred) only enqueue work on the GPU and
  // return without waiting for the peer (NCCL in its default mode): the
  // caller may issue them from its compute thread. False (Gloo, blocking
  // NCCL): a send waits until the peer takes it.
  virtual bool stream_ordered() const { return false; }
  // A send whose completion the compute stream waits for only at the
  // handle's order_compute_after(): it reads `buf` after `after` (a
  // compute_point(); null: everything enqueued on the compute stream so
  // far), and until order_compute_after() the compute stream must not
  // overwrite `buf`. Null handle: it already completed (every synchronous
  // communicator, and the default, which sends here).
  virtual std::unique_ptr<PendingCollective> send_deferred(const void* buf, size_t bytes, int to, uint32_t tag = 0,
                                                           const std::shared_ptr<void>& after = nullptr) {
    (void)after;
    send(buf, bytes, to, tag);
    return nullptr;
  }
  // A receive posted ahead of its use (a pipeline stage's next input, once
  // the slot's last reader is enqueued): it writes `buf` after `after` (a
  // compute_point(); null: everything enqueued on the compute stream so
  // far), and the compute stream waits for it only at the handle's
  // order_compute_after(); until then the compute stream must not touch
  // `buf`. Null handle: it already completed (the default receives here).
  virtual std::unique_ptr<PendingCollective> recv_deferred(void* buf, size_t bytes, int from, uint32_t tag = 0,
                                                           const std::shared_ptr<void>& after = nullptr) {
    (void)after;
    recv(buf, bytes, from, tag);
    return nullptr;
  }
  // What the next calls are for, in the caller's words ("pipeline (step 3):
  // sending the activation of microbatch 2 between stage 0 (rank 0) and
  // stage 1 (rank 1)"): a stream-ordered communicator, whose failures surface
  // after the call has returned (NCCL's watchdog), puts it in their message.
  // Empty: none. One thread uses a communicator that it labels.
  virtual void set_op_label(const std::string& label) { op_label_ = label; }
  const std::string& op_label() const { return op_label_; }
  // Throws the Error of a collective that failed after its call had
  // returned (NCCL: an async error or the watchdog's abort of a
  // stream-ordered collective), first waiting for the collectives already
  // issued to finish. Callers run it before anything that must not act on a
  // half-reduced result: the optimizer step, a checkpoint commit. A
  // synchronous communicator (Gloo) reports failures from the call itself,
  // so for it there is nothing to check.
  virtual void check_health() {}
  // For error messages: the training step in progress, and the group this
  // communicator serves ("world", "dp_shard0", "dp_replicate1"; empty: unnamed).
  virtual void set_step(int64_t step) { step_ = step; }
  int64_t step() const { return step_; }
  virtual void set_group(const std::string& group) { group_ = group; }
  const std::string& group() const { return group_; }
  // The rank's cross-group call order this communicator takes turns in
  // (enqueue_order.h); null: none. A CommWorker that issues this
  // communicator's calls reserves its tasks' turns in it.
  virtual EnqueueOrder* enqueue_order() const { return nullptr; }

 protected:
  // "all_reduce (step 12, rank 1 of 4, group dp_replicate1)": where an error happened.
  std::string describe(const std::string& op) const {
    std::string s = op + " (" + (step_ >= 0 ? "step " + std::to_string(step_) : std::string("before the first step")) +
                    ", rank " + std::to_string(rank()) + " of " + std::to_string(world_size());
    if (!group_.empty()) s += ", group " + group_;
    return s + ")";
  }
  int64_t step_ = -1;
  std::string group_;
  std::string op_label_;
};

// The defaults of Communicator's optional calls. Inline (like every other
// member) so the class has no out-of-line virtual function and the CUDA
// plugin, which does not link the core library, gets its vtable too.
namespace comm_detail {
inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
}  // namespace comm_detail

inline void Communicator::all_reduce_bf16(uint16_t* buf, int64_t count, ReduceOp op) {
  TR_CHECK(count >= 0, describe("all_reduce_bf16"), ": negative count ", count);
  std::vector<float> f(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) f[size_t(i)] = comm_detail::bf16_to_f32(buf[i]);
  all_reduce(f.data(), count, op);
  for (int64_t i = 0; i < count; ++i) buf[i] = comm_detail::f32_to_bf16(f[size_t(i)]);
}

inline void Communicator::reduce_scatter_bf16(uint16_t* out, const uint16_t* in, int64_t count_per_rank, ReduceOp op) {
  TR_CHECK(count_per_rank >= 0, describe("reduce_scatter_bf16"), ": negative count ", count_per_rank);
  const size_t n = size_t(count_per_rank), total = n * size_t(world_size());
  std::vector<float> fin(total), fout(n);
  for (size_t i = 0; i < total; ++i) fin[i] = comm_detail::bf16_to_f32(in[i]);
  reduce_scatter(fout.data(), fin.data(), count_per_rank, op);
  for (size_t i = 0; i < n; ++i) out[i] = comm_detail::f32_to_bf16(fout[i]);
}

inline void Communicator::all_to_all(void*, const void*, size_t) {
  TR_FAIL(describe("all_to_all"), ": the ", name(), " communicator has no all_to_all");
}

inline void Communicator::all_to_all_v(void*, const size_t*, const void*, const size_t*) {
  TR_FAIL(describe("all_to_all_v"), ": the ", name(), " communicator has no all_to_all_v");
}

inline void Communicator::send_recv(const void*, size_t, int send_to, void*, size_t, int recv_from, uint32_t) {
  if (send_to < 0 && recv_from < 0) return;
  TR_FAIL(describe("send_recv"), ": the ", name(), " communicator has no point-to-point transfers");
}

// The first error any rank of `comm` reports, agreed by all of them in one
// all-gather: "" when every rank passed "", else the lowest rank's text with
// "(rank r)" appended. For steps that some ranks may fail alone (reading
// their part of a file) before the next collective.
std::string first_error_of_ranks(Communicator& comm, const std::string& mine);

// Gloo over TCP. Bootstraps through `store` under `prefix` (so several
// communicators, e.g. hybrid_shard's two groups, can share one store).
// `rank` and
// `world` are the caller's position within the group. `host` is the address
// the transport binds (e.g. "127.0.0.1").
std::unique_ptr<Communicator> make_gloo_communicator(Store& store, const std::string& prefix, int rank,
                                                     int world, const std::string& host,
                                                     std::chrono::milliseconds timeout);

// Two ranks on one host, point to point only (send/recv/send_recv and
// barrier; the collectives are errors): a ring per direction in one shared
// mapping (parallel/comm/shm_communicator.cpp), for pipeline links.
// Bootstraps through `store` under `prefix`; `rank` is 0 or 1. Messages
// between the pair arrive in the order sent: a receive whose next message
// has another tag or size is an Error. A wait that passes `timeout`, or
// whose peer process has exited, is an Error naming the peer.
std::unique_ptr<Communicator> make_shm_communicator(Store& store, const std::string& prefix, int rank,
                                                    std::chrono::milliseconds timeout,
                                                    size_t ring_bytes = size_t(4) << 20);

// A pipeline link between two ranks of the CPU backend: the shared-memory
// link when both see the same /dev/shm (same boot, same tmpfs mount), else
// Gloo over TCP (`host` is the address Gloo binds). Both ranks decide alike
// (they exchange what they see through `store`); TRAINRUN_PIPELINE_SHM=0
// forces Gloo. `shared_memory` (optional) says which one it is.
std::unique_ptr<Communicator> make_p2p_link_communicator(Store& store, const std::string& prefix, int rank,
                                                         const std::string& host, std::chrono::milliseconds timeout,
                                                         bool* shared_memory = nullptr);

// A single-rank communicator (every op is a copy or a no-op).
std::unique_ptr<Communicator> make_single_communicator();

}  // namespace trainrun
