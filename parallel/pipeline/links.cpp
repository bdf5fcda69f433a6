// The pipeline's point-to-point links (links.h).
#include "parallel/pipeline/links.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <tuple>

#include "core/common/error.h"

namespace trainrun {

namespace {
// Above every tag the executor uses ((microbatch x stages + boundary) x 2 + direction).
constexpr uint32_t kHandshakeTag = 0xfffffff0u;
}  // namespace

std::vector<std::pair<int, int>> pipeline_link_pairs(const PipelineSchedule& s) {
  std::set<std::pair<int, int>> pairs;
  for (int r = 0; r < s.ranks; ++r)
    for (const PipeAction& a : s.actions[size_t(r)])
      if ((a.op == PipeOp::SendAct || a.op == PipeOp::SendGrad) && a.peer != r) pairs.insert({r, a.peer});
  return {pairs.begin(), pairs.end()};
}

std::string pipeline_link_prefix(const std::string& pp_group, int from, int to) {
  return pp_group + ".link" + std::to_string(from) + "to" + std::to_string(to) + "/";
}

PipelineLinks::PipelineLinks(const PipelineSchedule& s, int pp_rank, const std::string& pp_group,
                             const GroupCommFactory& factory)
    : rank_(pp_rank) {
  // Why this order cannot deadlock: building a link blocks both of its
  // ranks until both have joined it (Gloo's full-mesh connect, NCCL's
  // ncclCommInitRank), and each rank builds its links in the order of one
  // list that is the same on every rank (pipeline_link_pairs, sorted). Take
  // the first link in that list that is not yet built: each of its two
  // ranks has finished every earlier link it belongs to (all are built, by
  // the choice of the first), so both are at this one, and it completes.
  // By induction every link is built. A per-rank order (say "my sends
  // first") would not do: at pp2 rank 0 would wait in 0 -> 1 while rank 1
  // waits in 1 -> 0.
  for (const auto& [from, to] : pipeline_link_pairs(s)) {
    if (from != pp_rank && to != pp_rank) continue;
    const std::string prefix = pipeline_link_prefix(pp_group, from, to);
    std::unique_ptr<Communicator> c = factory(prefix, from == pp_rank ? 0 : 1, 2);
    TR_CHECK(c && c->world_size() == 2, "pipeline: the link from pp rank ", from, " to pp rank ", to,
             " did not get a 2-rank communicator (a bug)");
    c->set_group(prefix.substr(0, prefix.size() - 1));  // "pp0.link0to1": named in its errors
    // One message over it now, in the same order, for two reasons: NCCL
    // connects a pair lazily at its first send/recv, which waits on the
    // host for the peer (done here, where both ends are known to be, not at
    // some first use mid-step where the other end may be busy elsewhere);
    // and a link that does not work fails here, named, before step 1.
    const int32_t want = 0x11c0000 + from * 1000 + to;
    int32_t got = 0;
    try {
      if (from == pp_rank) c->send(&want, sizeof want, 1, kHandshakeTag);
      else c->recv(&got, sizeof got, 0, kHandshakeTag);
    } catch (const std::exception& e) {
      TR_FAIL("pipeline: the link from pp rank ", from, " to pp rank ", to, " (", c->group(),
              ") failed its first message: ", e.what());
    }
    TR_CHECK(from == pp_rank || got == want, "pipeline: the link from pp rank ", from, " to pp rank ", to,
             " delivered ", got, " instead of ", want, " (a bug)");
    links_.push_back(Link{from, to, std::move(c)});
  }
}

PipelineLinks::~PipelineLinks() {
  while (!links_.empty()) links_.pop_back();
}

Communicator* PipelineLinks::to(int peer) const {
  for (const Link& l : links_)
    if (l.from == rank_ && l.to == peer) return l.comm.get();
  return nullptr;
}

Communicator* PipelineLinks::from(int peer) const {
  for (const Link& l : links_)
    if (l.from == peer && l.to == rank_) return l.comm.get();
  return nullptr;
}

bool PipelineLinks::stream_ordered() const {
  if (links_.empty()) return false;
  for (const Link& l : links_)
    if (!l.comm->stream_ordered()) return false;
  return true;
}

void PipelineLinks::check_health() {
  for (Link& l : links_) l.comm->check_health();
}

void PipelineLinks::set_step(int64_t step) {
  for (Link& l : links_) l.comm->set_step(step);
}

// ---- tests: who used which link ---------------------------------------------------

bool PipelineLinkUse::operator<(const PipelineLinkUse& o) const {
  return std::tie(rank, from, to, send, thread) < std::tie(o.rank, o.from, o.to, o.send, o.thread);
}

namespace {
std::mutex g_use_mu;
std::atomic<bool> g_recording{false};
std::set<PipelineLinkUse> g_uses;
}  // namespace

void set_pipeline_link_recording(bool on) {
  std::lock_guard<std::mutex> lk(g_use_mu);
  g_recording = on;
  g_uses.clear();
}

std::vector<PipelineLinkUse> recorded_pipeline_link_uses() {
  std::lock_guard<std::mutex> lk(g_use_mu);
  return {g_uses.begin(), g_uses.end()};
}

void record_pipeline_link_use(int rank, int from, int to, bool send) {
  if (!g_recording) return;  // the common case: no lock taken
  std::lock_guard<std::mutex> lk(g_use_mu);
  if (!g_recording) return;
  g_uses.insert(PipelineLinkUse{rank, from, to, send, std::this_thread::get_id()});
}

}  // namespace trainrun
