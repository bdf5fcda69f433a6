// One rank's order of communicator calls across all its groups.
//
// Why: a rank talks on several communicators (world, tp, dp_shard,
// dp_replicate, pp, the pipeline links) from two threads: the compute
// thread (TP collectives, the loss, the pipeline) and the sharded store's
// CommWorker (FSDP all-gathers and reduce-scatters). On NCCL each
// communicator has its own stream, but NCCL kernels of different
// communicators are not guaranteed to run concurrently, so the order in
// which a rank enqueues them must be the same on every rank, or the ranks
// wait on each other in a cycle (rank 0's TP all-reduce behind its DP
// all-gather, rank 1's DP all-gather behind its TP all-reduce: both hang
// until the watchdog). NCCL also forbids two threads enqueueing at once on
// one device without serialising them.
//
// The choice (of the two the review offered): a ticket lock per rank,
// not one comm thread per device. Every call takes a ticket in the compute
// thread's program order (a CommWorker task takes it when it is
// submitted, on the thread that submits it; a direct call when it is
// made), and runs when every earlier ticket is done. So the cross-group
// order is the program order, which every rank of the job shares, and two
// threads never enqueue at once. A comm thread owning every enqueue gives
// the same order but costs a thread hand-off on every TP collective (four
// per block per micro-batch) and moves every call's exception and stack
// to another thread; the ticket keeps each call on its own thread.
//
// Scope: the mesh groups and the world communicator always (CPU and GPU:
// the same order, so the CPU tests hold the invariant: tests/test_comm_order.cpp
// with the recorder of comm_record.h); the pipeline links only where they
// are stream-ordered (NCCL, issued from the compute thread). Gloo links
// send on per-link sender threads that block until the peer takes the
// message, by design (pipeline/executor.cpp); holding a ticket there would
// stall every other group behind a peer, and Gloo pairs have no
// cross-communicator ordering rule to keep.
//
// Liveness: a ticket is released when its call returns or throws (RAII),
// and a CommWorker task dropped unstarted releases its ticket too; every
// call below has its own timeout, so a wait for a turn is bounded by the
// earlier calls' timeouts.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>

#include "parallel/comm/communicator.h"

namespace trainrun {

class EnqueueOrder {
 public:
  // The next ticket, in the caller's program order.
  uint64_t reserve();
  // Blocks until every ticket before `t` is done; then this thread holds
  // the turn (nested calls on the same order run inside it).
  void acquire(uint64_t t);
  // `t` is done (run or dropped); later tickets may go.
  void release(uint64_t t);
  // True when the calling thread holds a turn of this order.
  bool held_by_this_thread() const;
  uint64_t tickets_issued() const;

  // Takes a ticket now and holds the turn for the scope: a call that is
  // not already inside a turn of this order.
  class Turn {
   public:
    explicit Turn(EnqueueOrder* order);
    Turn(EnqueueOrder* order, uint64_t reserved);  // a ticket reserved earlier (CommWorker)
    ~Turn();
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

   private:
    EnqueueOrder* order_ = nullptr;
    uint64_t ticket_ = 0;
    const EnqueueOrder* outer_ = nullptr;
  };

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ = 0;   // the next one reserve() hands out
  uint64_t next_turn_ = 0;     // every ticket below it is done
  std::set<uint64_t> done_;    // done out of order, above next_turn_
};

// `inner` behind `order`: every call that enqueues communication takes a
// turn (see the top). compute_point and check_health enqueue nothing and
// go straight through.
std::unique_ptr<Communicator> make_ordered_communicator(std::unique_ptr<Communicator> inner, EnqueueOrder* order);

}  // namespace trainrun
