// ExpertDispatch (expert_dispatch.h): counts, all_to_all_v and the block reorder.
#include "parallel/expert/expert_dispatch.h"

#include "core/common/debug_hooks.h"
#include "core/common/error.h"

namespace trainrun {

ExpertDispatch::ExpertDispatch(Backend& be, const ExpertParallel& ep, int n_experts)
    : be_(be), ep_(ep), E_(n_experts), El_(n_experts / ep.size()) {
  TR_CHECK(ep.size() >= 1 && n_experts % ep.size() == 0, "expert parallelism: ", ep.size(),
           " ranks do not divide ", n_experts, " experts (a bug: the job spec checks this)");
}

ExpertDispatch::Plan ExpertDispatch::plan(const int32_t* off) const {
  const int P = ep_.size();
  Plan p;
  p.send_rows.resize(size_t(P));
  p.recv_rows.assign(size_t(P), 0);
  // Counts per expert, in expert order: peer j's block is its El experts.
  std::vector<int32_t> counts(static_cast<size_t>(E_));
  for (int e = 0; e < E_; ++e) counts[size_t(e)] = off[e + 1] - off[e];
  for (int j = 0; j < P; ++j) p.send_rows[size_t(j)] = size_t(off[(j + 1) * El_] - off[j * El_]);
  p.from_src.resize(size_t(E_));
  ep_.comm->all_to_all(p.from_src.data(), counts.data(), size_t(El_) * sizeof(int32_t));
  p.local_offsets.assign(size_t(El_) + 1, 0);
  for (int s = 0; s < P; ++s)
    for (int l = 0; l < El_; ++l) {
      const int32_t n = p.from_src[size_t(s * El_ + l)];
      TR_CHECK(n >= 0, "expert parallelism: ep rank ", s, " says it sends ", n, " rows for expert ",
               first_expert() + l, " (a bug or a corrupted transfer)");
      p.recv_rows[size_t(s)] += size_t(n);
      p.local_offsets[size_t(l) + 1] += n;
    }
  for (int l = 0; l < El_; ++l) p.local_offsets[size_t(l) + 1] += p.local_offsets[size_t(l)];
  p.recv_total = p.local_offsets[size_t(El_)];
  return p;
}

void ExpertDispatch::reorder(const Plan& p, const void* src, void* dst, size_t rb, bool to_expert_major) const {
  const int P = ep_.size();
  // Source-major start of block (s, l) and expert-major start of the same block.
  std::vector<int64_t> src_major(size_t(P) * El_), expert_major(size_t(P) * El_);
  int64_t r = 0;
  for (int s = 0; s < P; ++s)
    for (int l = 0; l < El_; ++l) {
      src_major[size_t(s * El_ + l)] = r;
      r += p.from_src[size_t(s * El_ + l)];
    }
  for (int l = 0; l < El_; ++l) {
    int64_t at = p.local_offsets[size_t(l)];
    for (int s = 0; s < P; ++s) {
      expert_major[size_t(s * El_ + l)] = at;
      at += p.from_src[size_t(s * El_ + l)];
    }
  }
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(dst);
  for (size_t b = 0; b < src_major.size(); ++b) {
    const int64_t n = p.from_src[b];
    if (n == 0) continue;
    const int64_t from = to_expert_major ? src_major[b] : expert_major[b];
    const int64_t to = to_expert_major ? expert_major[b] : src_major[b];
    be_.copy_device(out + to * int64_t(rb), in + from * int64_t(rb), size_t(n) * rb);
  }
}

void ExpertDispatch::dispatch(const Plan& p, const void* xp, void* staging, void* out, size_t rb) const {
  const int P = ep_.size();
  std::vector<size_t> sb(static_cast<size_t>(P)), rbytes(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    sb[size_t(j)] = p.send_rows[size_t(j)] * rb;
    rbytes[size_t(j)] = p.recv_rows[size_t(j)] * rb;
  }
  // A host transport (Gloo) reads the rows the stream wrote: wait for it. A
  // stream-ordered one (NCCL) runs after an event on the compute stream and
  // the compute stream waits for it, so the copies below see its output.
  if (!ep_.comm->stream_ordered()) be_.synchronize();
  debug_ep_kill_hook();  // tests: TRAINRUN_DEBUG_EP_KILL (core/common/debug_hooks.h)
  ep_.comm->all_to_all_v(staging, rbytes.data(), xp, sb.data());
  reorder(p, staging, out, rb, true);
}

void ExpertDispatch::combine(const Plan& p, const void* in, void* staging, void* yp, size_t rb) const {
  const int P = ep_.size();
  std::vector<size_t> sb(static_cast<size_t>(P)), rbytes(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    sb[size_t(j)] = p.recv_rows[size_t(j)] * rb;
    rbytes[size_t(j)] = p.send_rows[size_t(j)] * rb;
  }
  reorder(p, in, staging, rb, false);
  if (!ep_.comm->stream_ordered()) be_.synchronize();  // as in dispatch
  ep_.comm->all_to_all_v(yp, rbytes.data(), staging, sb.data());
}

}  // namespace trainrun
