// model.adapter under pipeline parallelism: what a pipeline rank's stage
// networks compute through when a frozen base carries LoRA / DoRA adapters.
//
// Each stage holds only its own blocks: its part of the frozen base (the
// base's stage store over its stage layout, parallel/pipeline/stage_store.h)
// and the adapters of those blocks (the adapters' stage store over the
// adapter layout cut by the same split; that layout has one unit per block,
// so a stage's adapter units are its blocks'). A stage network numbers its
// blocks locally but calls the adapters' hooks with the global layer
// (PipelineStage::first_layer + l), so dropout masks, tensor names and
// files are those of one rank; AdapterPipeline maps the global layer back
// onto the chunk's adapter unit, and the base's local units onto the global
// ones DoRA reads W from (AdaptedUnitAccess::set_stage).
//
// zero_bubble: the networks call the adapter hooks in backward_input only
// (with the adapters' weight gradients, which share the dx path's
// dxa = s dy B), and none in backward_weight, so each runs once per
// microbatch; backward_weight then computes no frozen base gradient either.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "core/model/adapter/lora.h"
#include "parallel/pipeline/stage_plan.h"
#include "parallel/pipeline/stage_store.h"

namespace trainrun {

class AdapterPipeline final : public PipelineUnits {
 public:
  // base over base_plan (the frozen base's stage layout), adapter_store
  // over adapter_plan (the adapters' stage layout, the same split).
  AdapterPipeline(PipelineStageStore& base, const PipelineStagePlan& base_plan, LoraAdapters& adapters,
                  PipelineStageStore& adapter_store, const PipelineStagePlan& adapter_plan, Backend* be);
  ~AdapterPipeline() override;

  UnitAccess& chunk_access(int chunk) override;
  void begin_step() override;
  void end_backward() override;
  void end_forward_only() override;
  // DoRA's magnitude init: f(global layer, the base unit of that block)
  // for each block of this stage, one at a time, in the same order on every
  // rank of the stage's dp group (a sharded base gathers each); collective
  // over that group.
  void for_each_base_block(const std::function<void(int layer, const void* base_unit)>& f);

 private:
  class GlobalLayers;  // the adapters' view of one chunk: global layer -> its adapter unit
  PipelineStageStore& base_;
  const PipelineStagePlan& base_plan_;
  PipelineStageStore& adapter_store_;
  std::vector<std::unique_ptr<GlobalLayers>> layers_;        // per chunk
  std::vector<std::unique_ptr<AdaptedUnitAccess>> access_;  // per chunk
};

}  // namespace trainrun
