// A frozen model's parameters (the base under model.adapter): held and
// moved like any model's under the job's strategy, but with no gradients,
// no master weights beyond the act-dtype parameters themselves, no
// optimizer state and no collectives of its own in the backward.
//
//   no_shard, shard_grad_op  every rank holds the whole model (as DDP / ZeRO-2
//                            replicate parameters)
//   full_shard               rank r holds elements [r*S, (r+1)*S) of every
//                            unit (S = ceil(numel / world)); a unit is
//                            all-gathered when acquired and freed when released
//   hybrid_shard             the same inside groups of shard_group_size
//                            consecutive ranks; each group holds a whole copy
//                            (a frozen model needs nothing across groups)
//
// The gathers run synchronously on the caller's thread over `comm`, which
// nothing else uses from another thread. Checkpoint access (held/write
// ranges, kind 0) works as on any store, so model.init_from loads it range
// by range; kinds 1 and 2 (AdamW moments) do not exist and are refused.
#pragma once
#include <memory>
#include <string>

#include "parallel/sharding/sharding.h"

namespace trainrun {

// world: the all-ranks communicator (full_shard's gathers use it; with
// hybrid_shard the groups come from `factory`, named "base_shard<i>").
std::unique_ptr<ParamStore> make_frozen_param_store(const std::string& strategy, const ParamLayout& layout,
                                                    Backend* be, Communicator* world, int shard_group_size,
                                                    const CommFactory& factory);

}  // namespace trainrun
