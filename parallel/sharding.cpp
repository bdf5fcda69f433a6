// Strategy dispatch for make_param_store.
#include "parallel/sharding.h"

#include "core/common/error.h"

namespace trainrun {

std::unique_ptr<ParamStore> make_replicated_param_store(const ParamLayout& layout, Backend* be,
                                                        Communicator* comm);

std::unique_ptr<ParamStore> make_param_store(const std::string& strategy, const ParamLayout& layout,
                                             Backend* be, Communicator* world, int shard_group_size) {
  // With one rank every strategy is the same computation; use the simplest.
  if (strategy == "no_shard" || world->world_size() == 1) return make_replicated_param_store(layout, be, world);
  TR_FAIL("parallel.sharding: strategy '", strategy, "' is not implemented yet for ", world->world_size(),
          " ranks; use no_shard");
}

}  // namespace trainrun
