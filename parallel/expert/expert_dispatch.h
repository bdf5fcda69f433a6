// Expert parallelism's token exchange (parallel.expert_parallel: E).
// The ep group is E consecutive ranks of one data-parallel group (the
// trainer builds it; consecutive so the all-to-all stays inside a node);
// ep rank i runs experts [i*n/E, (i+1)*n/E) of every MoE layer, for the
// tokens of every rank of its group.
//
// One layer's exchange, after the local routing and the permute into
// expert order (xp: this rank's N*K rows sorted by expert, so the rows for
// ep rank j's experts are one contiguous block):
//   plan      one all_to_all of the per-expert row counts (every rank
//             learns what it receives, and from whom, before any row moves)
//   dispatch  all_to_all_v of xp's blocks to their owners, then the
//             received blocks reordered from [source][local expert] to
//             [local expert][source]: the grouped GEMM's expert order
//   combine   the mirror: [local expert][source] back to [source][expert],
//             all_to_all_v back; each row lands where it left xp.
// The backward uses the same plan: dispatch for the output gradient,
// combine for the input gradient. Row blocks move with copy_device (one
// per (source, expert): never a per-row loop), counts on the host. On the
// CUDA backend the rows never leave the device: NCCL's all_to_all_v is a
// group of ncclSend/ncclRecv on device pointers, stream-ordered with the
// compute stream (no host sync around it); only the counts are staged.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "parallel/comm/communicator.h"

namespace trainrun {

// What a network needs to run its experts split (null: every expert local).
struct ExpertParallel {
  Communicator* comm = nullptr;  // the ep group; its rank is this rank's ep index
  // The parameters hold only this rank's experts (ExpertParallelPlan's
  // local layout, issue 28): expert e0 + l sits at local slot l.
  bool split_storage = false;
  int size() const { return comm ? comm->world_size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
};

class ExpertDispatch {
 public:
  // n_experts: the layer's experts (a multiple of the group's size).
  ExpertDispatch(Backend& be, const ExpertParallel& ep, int n_experts);

  struct Plan {
    // rows (not bytes) per peer: sent to / received from ep rank j
    std::vector<size_t> send_rows, recv_rows;
    // from_src[s*El + l]: rows ep rank s sends for local expert l
    std::vector<int32_t> from_src;
    // (El+1) row offsets of the local experts in the received, expert-ordered rows
    std::vector<int32_t> local_offsets;
    int64_t recv_total = 0;
  };
  int local_experts() const { return El_; }
  int first_expert() const { return ep_.rank() * El_; }
  // host_offsets: (E+1) this rank's expert-order offsets (moe_permute's).
  // Collective over the ep group.
  Plan plan(const int32_t* host_offsets) const;
  // xp (send rows, expert order) -> out (plan.recv_total rows, local expert
  // order); staging holds recv_total rows. row_bytes: one row's bytes.
  void dispatch(const Plan& p, const void* xp, void* staging, void* out, size_t row_bytes) const;
  // in (recv_total rows, local expert order) -> yp (the send rows, where
  // dispatch took them from); staging holds recv_total rows.
  void combine(const Plan& p, const void* in, void* staging, void* yp, size_t row_bytes) const;

 private:
  // Reorders recv_total rows between [source][expert] and [expert][source].
  void reorder(const Plan& p, const void* src, void* dst, size_t row_bytes, bool to_expert_major) const;
  Backend& be_;
  ExpertParallel ep_;
  int E_, El_;
};

}  // namespace trainrun
