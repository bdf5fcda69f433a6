// A pipeline link's sender thread (used by the executor, executor.cpp).
//
// Posts the sends of one outgoing link in order on a thread of its own, so
// the compute thread never waits for a peer to take a message it does not
// need yet (communicators whose send waits for the peer: Gloo, blocking
// NCCL). It is the only user of its link (links.h). One thread per link,
// not one for all: a send that waits for one peer must not hold up the
// sends to another, which the schedule check does not model (one shared
// thread hung pp4 interleaved_1f1b: rank 2's gradient to rank 1 queued
// behind its activation to rank 3, which rank 3 took only after that
// gradient's chain let it reuse its slot). Per link is also what NCCL's
// stream per link does, so both runtimes wait on the same things.
//
// Unwinding: a step ends by waiting for every send it posted, so a sender
// destroyed with sends still queued is one whose step failed (this rank
// threw, or a peer is gone). Those sends are dropped, their futures failed,
// not run: each could block up to the link's timeout on a peer that will
// never take it, and a rank must report its error and leave promptly. The
// send in flight, if any, ends first (its buffer outlives the sender).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/common/trace.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

class PipelineSender {
 public:
  // `global_rank`: for the tests' record of link uses; `tid`: its trace row.
  PipelineSender(int global_rank, int tid);
  // Drops the queued sends (their futures throw Error), waits for the one in flight.
  ~PipelineSender();
  PipelineSender(const PipelineSender&) = delete;
  PipelineSender& operator=(const PipelineSender&) = delete;

  // `link`: the outgoing link to pp rank `to` (the peer is its rank 1);
  // `buf` must stay valid until the future is ready. `label` names the
  // trace span and, when dropped, the send.
  std::shared_future<void> post(Communicator* link, int from, int to, const void* buf, size_t bytes, uint32_t tag,
                                std::string label);

  StepTracer* tracer = nullptr;  // set between steps only

 private:
  struct Job {
    Communicator* link;
    int from, to;  // pp ranks, for the tests' record of who used which link
    const void* buf;
    size_t bytes;
    uint32_t tag;
    std::shared_ptr<std::promise<void>> done;
    std::string label;  // the trace span's name
  };
  void loop();

  int rank_;
  int tid_;  // its row in the trace
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> q_;
  bool stop_ = false;
  std::thread th_;  // last: started once the rest is built
};

}  // namespace trainrun
