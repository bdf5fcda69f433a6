// Strategy dispatch for make_param_store.
#include "parallel/sharding/sharding.h"

#include "core/common/error.h"

namespace trainrun {

std::unique_ptr<ParamStore> make_replicated_param_store(const ParamLayout& layout, Backend* be,
                                                        Communicator* comm, const OffloadOptions& offload);
std::unique_ptr<ParamStore> make_sharded_param_store(const std::string& strategy, const ParamLayout& layout,
                                                     Backend* be, Communicator* world, int group,
                                                     const CommFactory& factory, const HybridComms* hybrid_comms,
                                                     const OffloadOptions& offload);

std::unique_ptr<ParamStore> make_param_store(const std::string& strategy, const ParamLayout& layout,
                                             Backend* be, Communicator* world, int shard_group_size,
                                             const CommFactory& factory, const HybridComms* hybrid_comms,
                                             const OffloadOptions& offload) {
  if (strategy == "no_shard") return make_replicated_param_store(layout, be, world, offload);
  if (strategy == "shard_grad_op" || strategy == "full_shard" || strategy == "hybrid_shard") {
    int group = world->world_size();
    if (strategy == "hybrid_shard" && shard_group_size > 0) group = shard_group_size;
    return make_sharded_param_store(strategy, layout, be, world, group, factory, hybrid_comms, offload);
  }
  TR_FAIL("parallel.sharding: unknown strategy '", strategy,
          "'; use no_shard, shard_grad_op, full_shard or hybrid_shard");
}

}  // namespace trainrun
