// AdapterPipeline (adapter_pipeline.h).
#include "core/train/adapter_pipeline.h"

#include "core/common/error.h"

namespace trainrun {

// LoraAdapters acquires unit `layer` (the global layer) of what it is bound
// to; this chunk's adapter units are its blocks', numbered 1..layers as its
// network numbers them (PipelineChunk::units of the adapters' plan).
class AdapterPipeline::GlobalLayers final : public UnitAccess {
 public:
  GlobalLayers(UnitAccess& chunk, const PipelineStage& stage) : chunk_(chunk), stage_(stage) {}
  const void* acquire_params(int layer) override { return chunk_.acquire_params(local(layer)); }
  void release_params(int layer) override { chunk_.release_params(local(layer)); }
  float* unit_grads(int layer) override { return chunk_.unit_grads(local(layer)); }
  void grads_done(int layer) override { chunk_.grads_done(local(layer)); }
  void begin_pass(bool backward_pass, bool backward_follows) override {
    chunk_.begin_pass(backward_pass, backward_follows);
  }

 private:
  int local(int layer) const {
    TR_CHECK(layer >= stage_.first_layer && layer < stage_.first_layer + stage_.layers, "adapter pipeline: layer ",
             layer, " is not one of this stage's (", stage_.first_layer, "..", stage_.first_layer + stage_.layers - 1,
             "); a stage network must call the adapters with global layers (a bug)");
    return 1 + layer - stage_.first_layer;
  }
  UnitAccess& chunk_;
  PipelineStage stage_;
};

AdapterPipeline::AdapterPipeline(PipelineStageStore& base, const PipelineStagePlan& base_plan, LoraAdapters& adapters,
                                 PipelineStageStore& adapter_store, const PipelineStagePlan& adapter_plan, Backend* be)
    : base_(base), base_plan_(base_plan), adapter_store_(adapter_store) {
  TR_CHECK(base_plan.chunks().size() == adapter_plan.chunks().size(), "adapter pipeline: the base has ",
           base_plan.chunks().size(), " chunks, the adapters ", adapter_plan.chunks().size(), " (a bug)");
  for (size_t c = 0; c < base_plan.chunks().size(); ++c) {
    const PipelineStage& s = base_plan.chunks()[c].stage;
    const PipelineStage& a = adapter_plan.chunks()[c].stage;
    TR_CHECK(s.first_layer == a.first_layer && s.layers == a.layers, "adapter pipeline: chunk ", c,
             " has base layers ", s.first_layer, "+", s.layers, " but adapter layers ", a.first_layer, "+", a.layers,
             " (a bug)");
    layers_.push_back(std::make_unique<GlobalLayers>(adapter_store.chunk_access(int(c)), s));
    // The model's layout, not the stage's: AdaptedUnitAccess sizes its
    // scratch for what a frozen network writes, knowing unit 0 as the
    // embedding (a later stage's unit 0 is a block); every block and the
    // head are as large there as here.
    access_.push_back(std::make_unique<AdaptedUnitAccess>(base.chunk_access(int(c)), base_plan.outer_layout(),
                                                          adapters, *layers_.back(), be));
    access_.back()->set_stage(s);
  }
}

AdapterPipeline::~AdapterPipeline() = default;

UnitAccess& AdapterPipeline::chunk_access(int chunk) { return *access_.at(size_t(chunk)); }

void AdapterPipeline::begin_step() {
  base_.begin_step();
  adapter_store_.begin_step();
}

void AdapterPipeline::end_backward() {
  base_.end_backward();           // releases the base's units (no gradients: nothing to reduce)
  adapter_store_.end_backward();  // the adapters' reductions, once per step
}

void AdapterPipeline::end_forward_only() {
  base_.end_forward_only();
  adapter_store_.end_forward_only();
}

void AdapterPipeline::for_each_base_block(const std::function<void(int, const void*)>& f) {
  for (size_t c = 0; c < base_plan_.chunks().size(); ++c) {
    const PipelineStage& s = base_plan_.chunks()[c].stage;
    UnitAccess& u = base_.chunk_access(int(c));
    for (int j = 0; j < s.layers; ++j) {
      f(s.first_layer + j, u.acquire_params(1 + j));
      u.release_params(1 + j);
    }
  }
  base_.end_forward_only();  // the stage store holds what it gathered until a pass ends
}

}  // namespace trainrun
