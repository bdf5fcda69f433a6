// The executor's buffer policy (slots.h).
#include "parallel/pipeline/slots.h"

#include <algorithm>
#include <map>

#include "core/common/error.h"

namespace trainrun {

PipelineSlotPlan plan_pipeline_slots(const PipelineSchedule& s, int rank) {
  const int P = s.ranks;
  const size_t chunks = size_t(s.virtual_stages);
  const bool split = s.kind == "zero_bubble";
  const auto& list = s.actions[size_t(rank)];
  auto chunk_of = [&](int stage) { return size_t((stage - rank) / P); };
  PipelineSlotPlan plan;
  // Slots per chunk: the most microbatches open on it at any point.
  std::vector<int> live(chunks, 0);
  plan.slots_per_chunk.assign(chunks, 1);
  std::vector<std::map<int, bool>> open(chunks);
  for (const PipeAction& a : list) {
    const size_t c = chunk_of(a.stage);
    if (c >= chunks) continue;  // not this rank's stage: check_pipeline_schedule names it
    if (a.op == PipeOp::RecvAct || a.op == PipeOp::F) {
      if (!open[c][a.microbatch]) {
        open[c][a.microbatch] = true;
        plan.slots_per_chunk[c] = std::max(plan.slots_per_chunk[c], ++live[c]);
      }
    } else if (a.op == PipeOp::B || a.op == PipeOp::BW) {
      if (open[c].erase(a.microbatch)) --live[c];
    }
  }
  // Then the allocation, action by action.
  std::vector<std::vector<int>> last_send(chunks), busy_mb(chunks);  // per slot: its last send (-1), its microbatch (-1)
  for (size_t c = 0; c < chunks; ++c) {
    last_send[c].assign(size_t(plan.slots_per_chunk[c]), -1);
    busy_mb[c].assign(size_t(plan.slots_per_chunk[c]), -1);
  }
  plan.slot.assign(list.size(), -1);
  plan.waits.assign(list.size(), {});
  for (size_t i = 0; i < list.size(); ++i) {
    const PipeAction& a = list[i];
    const size_t c = chunk_of(a.stage);
    if (c >= chunks) continue;
    auto& mbs = busy_mb[c];
    int k = int(std::find(mbs.begin(), mbs.end(), a.microbatch) - mbs.begin());
    if (k == int(mbs.size())) {
      k = int(std::find(mbs.begin(), mbs.end(), -1) - mbs.begin());
      TR_CHECK(k < int(mbs.size()), "pipeline: stage ", a.stage, " holds more microbatches than its ", mbs.size(),
               " activation sets (rank ", rank, ", action ", i, ": ", pipe_op_name(a.op), " mb", a.microbatch, ")");
      mbs[size_t(k)] = a.microbatch;
      if (last_send[c][size_t(k)] >= 0) plan.waits[i].push_back(last_send[c][size_t(k)]);  // taken over
      last_send[c][size_t(k)] = -1;
    }
    plan.slot[i] = k;
    // A send to this rank itself (a one-rank interleaved list, never run by
    // the executor) would be a local copy, done when issued: nothing to wait for.
    const bool send = (a.op == PipeOp::SendAct || a.op == PipeOp::SendGrad) && a.peer != rank;
    if (send) {
      if (last_send[c][size_t(k)] >= 0) plan.waits[i].push_back(last_send[c][size_t(k)]);  // one out per slot
      last_send[c][size_t(k)] = int(i);
    }
    const bool first = a.stage == 0;
    const bool frees = (a.op == PipeOp::B && first) || (a.op == PipeOp::SendGrad && !split) || a.op == PipeOp::BW;
    if (frees) mbs[size_t(k)] = -1;
  }
  return plan;
}

std::vector<int> plan_receive_posts(const PipelineSchedule& s, int rank, const PipelineSlotPlan& slots,
                                    bool takeover_early) {
  const int P = s.ranks;
  const auto& list = s.actions[size_t(rank)];
  auto chunk_of = [&](int stage) { return (stage - rank) / P; };
  std::vector<int> post(list.size());
  std::map<std::pair<int, int>, int> last_on_slot;  // (chunk, slot) -> the last action on it so far
  std::map<std::pair<int, int>, int> owner;         // (chunk, slot) -> its microbatch
  std::map<int, int> last_post_from;                // peer -> the post point of its last receive
  for (size_t i = 0; i < list.size(); ++i) {
    const PipeAction& a = list[i];
    post[i] = int(i);
    const std::pair<int, int> key{chunk_of(a.stage), slots.slot[i]};
    const bool recv = a.op == PipeOp::RecvAct || a.op == PipeOp::RecvGrad;
    if (recv && slots.slot[i] >= 0) {
      auto own = owner.find(key);
      const bool takeover = own == owner.end() || own->second != a.microbatch;
      auto last = last_on_slot.find(key);
      int at = last == last_on_slot.end() ? -1 : last->second;
      if (takeover && !takeover_early) at = int(i);
      const int peer = (a.op == PipeOp::RecvAct ? a.stage - 1 : a.stage + 1) % P;
      if (auto lp = last_post_from.find(peer); lp != last_post_from.end()) at = std::max(at, lp->second);
      post[i] = std::min(at, int(i));
      last_post_from[peer] = post[i];
    }
    if (slots.slot[i] >= 0) {
      last_on_slot[key] = int(i);
      owner[key] = a.microbatch;
    }
  }
  return post;
}

}  // namespace trainrun
