// Expert parallelism's view of a model's storage (issue 28): what one rank
// of an expert-parallel group of E ranks holds, and where each element of
// it sits in the global (logical) model. The counterpart of
// TensorParallelPlan (core/model/tensor_parallel.h), and built the same
// way so the same kind of wrapper can speak global coordinates:
//
//   expert tensors  (every name with ".experts.<e>."): ep rank i holds the
//                   experts [i*n/E, (i+1)*n/E) of every MoE layer, whole,
//                   and is their only holder in its expert group
//   everything else (attention, norms, the router, Qwen2-MoE's shared
//                   expert, embeddings, head): "dense", used by every rank
//
// The local layout has the global layout's units, in order, and each
// unit's tensors in order, less the other ranks' experts (names stay the
// global ones, so HF names and checkpoints need no renaming).
//
// Storage (parallel/expert/ep_split_store.h): the local layout is what the
// network reads, one unit buffer per unit; behind it two stores hold the
// two parts, each sharded by parallel.sharding over its own group, as
// Megatron-Core keeps dense and expert parameters in separate buffers:
//
//   dense_layout()   the dense tensors of every unit, sharded over the
//                    whole data-parallel group (W ranks), as a model
//                    without experts would be: their gradients reduce over
//                    every rank that computed them
//   expert_layout()  this rank's experts, only the units that have
//                    experts, sharded over the "expert data-parallel"
//                    group (the W / E dp ranks with the same ep index, the
//                    only ranks that hold and compute these experts)
//
// dense_plan() and expert_plan() map each part to the global layout
// (TensorParallelPlan's runs: every run owned), so a global-coordinate
// store wrapper (parallel/tensor/tp_param_store.h) serves checkpoints,
// init_from and model files for each part.
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
  // The two parts (above). dense_layout() has every unit of the global
  // layout (each holds dense tensors: a block's attention, the embeddings)
  // and the layout's ties; expert_layout() the units with experts, in order.
  // The plan must outlive the stores built over them.
  const ParamLayout& dense_layout() const { return dense_plan_->local_layout(); }
  const ParamLayout& expert_layout() const { return expert_plan_->local_layout(); }
  // dense_layout() -> global as a group of one (tp 1): a store over it,
  // wrapped with a single-rank communicator, speaks global coordinates.
  const TensorParallelPlan& dense_plan() const { return *dense_plan_; }
  // expert_layout() -> global over the ep group: wrapped with the ep
  // group's communicator, its grad norm sums every expert once.
  const TensorParallelPlan& expert_plan() const { return *expert_plan_; }

 private:
  ParamLayout global_, local_;
  int n_experts_ = 0, ep_ = 1, rank_ = 0;
  std::vector<TpRun> runs_;
  std::vector<bool> expert_run_;  // per run: an expert tensor
  std::shared_ptr<TensorParallelPlan> dense_plan_, expert_plan_;
};

// The routed expert a tensor belongs to ("...experts.5.w1.weight" -> 5),
// or -1 for any other tensor (Qwen2-MoE's "shared_expert." is not one).
int expert_of_tensor(const std::string& name);

}  // namespace trainrun
