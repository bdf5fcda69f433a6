// The parameter store of an expert-parallel rank (issue 28): two stores
// behind one UnitAccess, as Megatron-Core keeps dense and expert
// parameters in separate buffers with their own data-parallel groups.
//
//   dense    every dense tensor (attention, norms, router, shared expert,
//            embeddings, head), sharded by parallel.sharding over the
//            whole data-parallel group: a dense gradient is reduced
//            (-scattered) over every rank that computed it, in one
//            collective per unit, and its state is 1/W per rank
//   experts  this rank's n_experts / ep experts, sharded over the expert
//            data-parallel group (the dp ranks with the same ep index, the
//            only ones that hold and compute them)
//
// Each part is wrapped into global coordinates (parallel/tensor/
// tp_param_store.h over ExpertParallelPlan's dense_plan / expert_plan), so
// checkpoints, init_from and the model file see one logical model:
// held_ranges and write_ranges are the two parts' ranges merged by global
// offset, and a state range is served by the part that holds it. The grad
// norm is the dense part's (complete over dp) plus the experts' (summed
// over the ep group by their wrapper). "Global" is whatever the plan was
// cut from: the model, or under tensor / pipeline parallelism this rank's
// TP slice or stage, whose own wrapper then maps it on.
//
// The network reads one buffer per unit in the rank's local layout (dense
// tensors and its experts interleaved in layout order, as
// ExpertParallelPlan::local_layout). A unit held by one part alone (the
// embeddings, the head) passes straight through. A mixed unit (a block:
// attention, router, experts) is assembled on acquire: one device copy
// per contiguous piece (2-3 per block) into a pooled buffer, released
// with the unit; its gradient is written by the network into a pooled
// fp32 buffer and added piece by piece into the two parts' unit
// gradients at grads_done, before they reduce. The cost is a copy of
// each acquired block's parameters and one of its gradients (device
// bandwidth, no communication), and buffers for the blocks in flight
// (ShardMemory::comm_buffers: the pools' peaks).
#pragma once
#include <memory>

#include "core/model/tensor_parallel.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

// `local`: the layout the network reads. `dense` / `experts`: stores over
// dense_plan.local_layout() (every unit of `local`, over the whole dp
// group) / expert_plan.local_layout() (the units with an expert tensor,
// over the expert-dp group), whose tensors (by name) partition `local`'s;
// the plans map them to the coordinates this store speaks (the layout
// `local` was cut from: the model's, a TP slice or a pipeline stage).
// `ep`: the ep group (sums the experts' grad norm). A norm skip set on
// this store (set_grad_norm_skip, in those coordinates: a wrapping TP or
// pipeline store's replicas) reaches each part's store through its plan.
// The layouts, plans and `ep` must outlive the store.
std::unique_ptr<ParamStore> make_expert_split_store(const ParamLayout& local, std::unique_ptr<ParamStore> dense,
                                                    const TensorParallelPlan& dense_plan,
                                                    std::unique_ptr<ParamStore> experts,
                                                    const TensorParallelPlan& expert_plan, Communicator* ep,
                                                    Backend* be);

}  // namespace trainrun
