// Expert parallelism's view of a model's storage (issue 28): what one rank
// of an expert-parallel group of E ranks holds, and where each element of
// it sits in the global (logical) model. The counterpart of
// TensorParallelPlan (core/model/tensor_parallel.h), and built the same
// way so the same kind of wrapper can speak global coordinates:
//
//   expert tensors  (every name with ".experts.<e>."): ep rank i holds the
//                   experts [i*n/E, (i+1)*n/E) of every MoE layer, whole,
//                   and is their only holder in its expert group (owner)
//   everything else (attention, norms, the router, Qwen2-MoE's shared
//                   expert, embeddings, head): every ep rank holds it; ep
//                   rank 0 is its owner (writes checkpoints, counts it in
//                   the grad norm), as TP's replicated tensors
//
// The local layout has the global layout's units, in order, and each
// unit's tensors in order, less the other ranks' experts (names stay the
// global ones, so HF names and checkpoints need no renaming). Its size is
// the same on every ep rank, so the dense pieces sit at the same local
// offsets on every rank: a store over the local layout shards them alike.
//
// Gradients: a dense element's gradient is summed over the whole dp group,
// an expert element's over its "expert data-parallel" group only (the dp
// ranks with the same ep index): expert_ranges() are the local ranges the
// second rule applies to.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/model/tensor_parallel.h"

namespace trainrun {

class ExpertParallelPlan {
 public:
  // Throws an Error naming parallel.expert_parallel and model.n_experts when
  // E does not divide the experts, or when the layout holds no expert tensor.
  ExpertParallelPlan(const ParamLayout& global, int n_experts, int ep, int rank);

  int size() const { return ep_; }
  int rank() const { return rank_; }
  int local_experts() const { return n_experts_ / ep_; }
  int first_expert() const { return rank_ * local_experts(); }
  const ParamLayout& local_layout() const { return local_; }
  const ParamLayout& global_layout() const { return global_; }
  // Every element of the local flat vector, in local order (one run per
  // tensor: a tensor is held whole or not at all). global is never -1.
  const std::vector<TpRun>& runs() const { return runs_; }
  // The local offset of global element g (-1 when this rank does not hold it).
  int64_t local_of(int64_t g) const;
  // The global (start, count) ranges this rank holds, ascending and merged.
  std::vector<std::pair<int64_t, int64_t>> held_global() const;
  // Local (start, count) ranges of the expert tensors, ascending and merged.
  std::vector<std::pair<int64_t, int64_t>> expert_ranges() const;
  // The rest, the dense tensors' local ranges (summed over the ep group too:
  // parallel/expert/ep_grad_store.h).
  std::vector<std::pair<int64_t, int64_t>> dense_ranges() const;
  // Local ranges this rank holds but does not own (the dense tensors on ep
  // rank > 0): the grad norm and checkpoint writes skip them.
  std::vector<std::pair<int64_t, int64_t>> non_owner_ranges() const;
  // The same split as a TensorParallelPlan over a group of ep ranks, for
  // make_tensor_parallel_store (parallel/tensor/tp_param_store.h): a store
  // over local_layout() wrapped by it answers held_ranges / write_ranges,
  // init_params, load_full_params and the state ranges in global
  // coordinates (checkpoints, init_from and the model file stay logical),
  // writes only what this rank owns, and sums the grad norm without
  // non-owned elements over the ep group. The plan must outlive the store.
  const TensorParallelPlan& storage_plan() const { return *storage_; }

 private:
  ParamLayout global_, local_;
  int n_experts_ = 0, ep_ = 1, rank_ = 0;
  std::vector<TpRun> runs_;
  std::vector<bool> expert_run_;  // per run: an expert tensor
  std::shared_ptr<TensorParallelPlan> storage_;
};

// The routed expert a tensor belongs to ("...experts.5.w1.weight" -> 5),
// or -1 for any other tensor (Qwen2-MoE's "shared_expert." is not one).
int expert_of_tensor(const std::string& name);

}  // namespace trainrun
