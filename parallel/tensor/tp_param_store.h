// The parameter store of a tensor-parallel rank: the data-parallel store
// (any sharding strategy, over the dp group) holds this rank's TP slice in
// the plan's local layout; this wrapper speaks global coordinates to
// everything outside (checkpoints, the final model file, model.init_from),
// so files stay logical and any mesh loads any other.
//
//   held_ranges / write_ranges  the inner store's local ranges cut into runs
//                               of the global vector (tensor_parallel.h);
//                               writes only where this rank is the owner, so
//                               replicated tensors are written by TP rank 0
//                               and padding never
//   init_params                 every element from the arch's counter-based
//                               init at its global index: any mesh starts
//                               from the same weights
//   grad_norm_squared           the inner norm without non-owned elements,
//                               summed over the TP group
#pragma once
#include <memory>

#include "core/model/tensor_parallel.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

// `inner` is built over plan.local_layout(); `tp` is the TP group's
// communicator (its size is plan.size()).
std::unique_ptr<ParamStore> make_tensor_parallel_store(std::unique_ptr<ParamStore> inner,
                                                       const TensorParallelPlan& plan, Communicator* tp);

}  // namespace trainrun
