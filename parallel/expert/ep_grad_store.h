// The gradient reduction of an expert-parallel rank's parameter store
// (issue 28): the store holds an ep rank's local layout (dense tensors +
// its n/E experts; core/model/moe/expert_parallel_plan.h) and is built over
// the "expert data-parallel" group (the dp ranks with the same ep index,
// dp/E of them), so it reduces every local gradient over that group. An
// expert's gradient needs no more: only that group holds the expert. A
// dense tensor's gradient must be summed over the whole dp group, which is
// the ep group x the expert-dp group: this wrapper first sums its dense
// pieces over the ep group (the dense pieces sit at the same local offsets
// on every ep rank), then lets the inner store reduce as usual.
//
// When: a sharded inner store (shard_grad_op, full_shard, hybrid_shard)
// reduces each unit's gradient at grads_done, once per micro-batch, from a
// buffer that holds that micro-batch only, so the ep sum runs just before
// it. A replicated one (no_shard) accumulates the micro-batches and reduces
// at finish_grads, so the ep sum runs there, over every unit, once.
// Gradients are normalised by the global batch's target tokens in the loss,
// not by the group sizes, so sums are all that is needed.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "parallel/sharding/sharding.h"

namespace trainrun {

// `dense`: the local (start, count) ranges summed over `ep` (sorted; the
// plan's complement of expert_ranges()); `layout`: the inner store's local
// layout (the units' offsets). On ep rank > 0 the inner store's grad norm
// skips them (ep rank 0 counts them). `ep` must outlive the store.
std::unique_ptr<ParamStore> make_expert_grad_store(std::unique_ptr<ParamStore> inner, const ParamLayout& layout,
                                                   std::vector<std::pair<int64_t, int64_t>> dense, Communicator* ep);

}  // namespace trainrun
