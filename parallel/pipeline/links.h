// The pipeline's point-to-point links: one 2-rank communicator per ordered
// pair of pp ranks (from -> to) that the schedule sends on, used in one
// direction only.
//
// Why one per direction: the executor sends from one place per link (its
// sender thread on Gloo, the compute thread on NCCL) and receives on the
// compute thread.
// Over one shared communicator the two would use it from two threads at
// once (a Gloo context is not documented as thread-safe) and, on NCCL, a
// receive waiting for its peer would hold up every send queued behind it on
// the same stream. With a link per direction, on the sending rank only the
// send path uses a link and on the receiving rank only the compute thread,
// so no communicator is ever used from two threads, and on NCCL each link
// has its own stream (make_nccl_communicator's own_stream).
//
// Which links: r -> r+1 (activations) and r+1 -> r (gradients) for every
// r; interleaved_1f1b also wraps P-1 -> 0 (a rank's last chunk feeds the
// first rank's next chunk) and 0 -> P-1. At pp2 that is 0 -> 1 and 1 -> 0.
// The list is read off the schedule's send actions, so it is exactly the
// pairs that carry messages. Inside a link, rank 0 is `from` and rank 1 is
// `to`.
//
// The pp group's communicator stays for what else uses it (the tied
// embedding's gradient sum, the stage store).
#pragma once
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "parallel/comm/communicator.h"
#include "parallel/mesh/device_mesh.h"
#include "parallel/pipeline/schedule.h"

namespace trainrun {

// Every (from, to) pair of pp ranks that some send action of `s` uses,
// sorted: the same list on every rank.
std::vector<std::pair<int, int>> pipeline_link_pairs(const PipelineSchedule& s);

// The store prefix (and group name) of link from -> to of the pp group
// `pp_group` ("pp0"): "pp0.link0to1/". Unique per pp group and per link; the
// factory adds the attempt ("attempt<k>/") as for every mesh group.
std::string pipeline_link_prefix(const std::string& pp_group, int from, int to);

class PipelineLinks {
 public:
  // This rank's links: those it sends or receives on, each built through
  // `factory` (prefix, rank in the link, 2), in the order of
  // pipeline_link_pairs on every rank (links.cpp says why that cannot
  // deadlock).
  PipelineLinks(const PipelineSchedule& s, int pp_rank, const std::string& pp_group, const GroupCommFactory& factory);
  ~PipelineLinks();

  // The link this rank sends to pp rank `peer` on (its peer in the link is
  // rank 1), and the one it receives from `peer` on (its peer: rank 0).
  // Null when the schedule never uses it.
  Communicator* to(int peer) const;
  Communicator* from(int peer) const;
  // Every link is stream-ordered (NCCL): sends can be issued from the
  // compute thread without waiting for the peer. False when there are none.
  bool stream_ordered() const;
  void set_step(int64_t step);
  // Every link's Communicator::check_health: a stream-ordered (NCCL) link
  // whose receive or send the watchdog aborted reports it here, with its
  // label (peer, microbatch, step), instead of the step going on over a
  // half-written buffer. Gloo and shm links fail in the call itself.
  void check_health();

 private:
  struct Link {
    int from, to;
    std::unique_ptr<Communicator> comm;
  };
  int rank_;
  std::vector<Link> links_;  // in creation order; destroyed in reverse
};

// Tests: each use of a link communicator, (global rank, link from -> to,
// send or receive, the thread that made the call), recorded while on.
struct PipelineLinkUse {
  int rank = -1, from = -1, to = -1;
  bool send = false;
  std::thread::id thread;
  bool operator<(const PipelineLinkUse& o) const;
};
void set_pipeline_link_recording(bool on);
std::vector<PipelineLinkUse> recorded_pipeline_link_uses();  // each distinct use once
// Called by the executor at every link call (a no-op unless recording).
void record_pipeline_link_use(int rank, int from, int to, bool send);

}  // namespace trainrun
