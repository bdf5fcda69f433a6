// The parameter store of a pipeline rank: the data-parallel store (any
// sharding strategy, over this rank's dp group) holds the stage layout
// (stage_plan.h); this wrapper speaks the model layout's coordinates to
// everything outside (checkpoints, the final model file, model.init_from,
// and the tensor-parallel store when it wraps this one), so files stay
// logical: a pp2 checkpoint loads on pp1, dp2 or tp2 and back.
//
// The stage networks reach parameters through chunk_access(c), which maps
// their unit numbers onto the stage layout and, for a whole step, keeps
// every unit acquired once (FSDP gathers it once for all microbatches) and
// holds back grads_done until end_backward() (one reduce-scatter after the
// last microbatch). With reshard (parallel.pipeline_reshard) a unit is
// acquired and released around every use instead, as without a pipeline.
//
// end_backward() first sums the tied embedding's gradient between the
// first and last stage (the copy's and the original's, over the pp group),
// so the two hold the same gradient, and AdamW keeps them identical.
//
//   held_ranges / write_ranges  the inner store's ranges cut into runs of
//                               the model layout; the tied copy is held
//                               (loaded) but never written
//   init_params                 every element from the arch's counter-based
//                               init at its model index
//   grad_norm_squared           the inner norm without the tied copy (and
//                               without what the wrapping TP store says
//                               another rank owns), summed over the pp group
#pragma once
#include <memory>

#include "parallel/pipeline/stage_plan.h"
#include "parallel/sharding/sharding.h"

namespace trainrun {

// What the executor computes through: each chunk's UnitAccess and the
// step's boundaries. A pipeline store is one; an adapter run joins two
// (the frozen base's and the adapters', core/train/adapter_pipeline.h).
class PipelineUnits {
 public:
  virtual ~PipelineUnits() = default;
  // The network-facing access of chunk c (PipelineStagePlan::chunks()).
  virtual UnitAccess& chunk_access(int chunk) = 0;
  // Before a step's first microbatch.
  virtual void begin_step() = 0;
  // After the step's last backward: the tied gradient sum, then every
  // unit's grads_done (its reduction) and release.
  virtual void end_backward() = 0;
  // After a forward-only pass (evaluation): releases what it acquired.
  virtual void end_forward_only() = 0;
};

class PipelineStageStore : public ParamStore, public PipelineUnits {
 public:
  // Calls the inner store got in the last step, for tests and the log:
  // acquires (a gather under full_shard) and grads_done (a reduce-scatter).
  virtual int acquires_last_step() const = 0;
  virtual int reductions_last_step() const = 0;
  // Whether this rank's tied embedding (the first stage's, or the last
  // stage's copy) holds the same fp32 master weights, bit for bit, as the
  // other stage's: its shard's hash exchanged with the peer of the same dp
  // and tp index (a p2p pair, not a collective of the whole group). True
  // without a tie and on a middle stage. `hash_out`: this rank's hash.
  virtual bool tied_copies_identical(uint64_t* hash_out = nullptr) = 0;
};

// inner: built over plan.stage_layout(); pp: the pipeline group's
// communicator (its size is plan.ranks(); null only when it is 1).
// frozen: the inner store is a frozen base's (frozen_store.h): it has no
// gradients, so end_backward sums no tied gradient.
std::unique_ptr<PipelineStageStore> make_pipeline_stage_store(std::unique_ptr<ParamStore> inner,
                                                              const PipelineStagePlan& plan, Communicator* pp,
                                                              Backend* be, bool reshard, bool frozen = false);

// The p2p tag of the tied-gradient exchange (the executor's tags stay below it).
constexpr uint32_t kPipelineTiedGradTag = 0x7fffffffu;

}  // namespace trainrun
