// One pipeline rank's share of the model: which layers each of its chunks
// computes, the parameter layout it holds, and where every element of that
// layout sits in the model's (logical) layout.
//
// The model's layout (ModelArch::layout(), or a tensor-parallel rank's
// local layout: tensor_parallel.h) has the units embeddings, block
// 0..L-1, head. Rank r of P with v chunks holds virtual stages r, r + P,
// ..., r + (v-1) P (schedule.h); chunk c computes the blocks the split
// gives virtual stage r + c P, the first virtual stage also the embedding
// and the last the final norm and head. A head tied to the token embedding
// (GPT-2, Llama with tie_embeddings) needs the embedding unit on the last
// stage too: that rank holds a copy of it as one more unit of its layout,
// which it loads from checkpoints but never writes (the first stage owns
// the element), and which the grad norm leaves out; the pipeline store
// sums the copy's gradient with the first stage's every step
// (stage_store.h), so both stay identical.
//
// The stage layout keeps the model layout's tensors, names, shapes and
// decay flags, in stage order; the parameter store shards it over the
// rank's dp group as it would a whole model.
//
// A blocks-only layout (units block 0..L-1, no embeddings or head: the
// LoRA adapters', core/model/adapter/lora.h) splits the same way: each
// chunk gets its blocks' units, numbered 1..layers in PipelineChunk::units
// as the stage network numbers them, and no embedding, head or tie.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/model/model.h"

namespace trainrun {

struct PipelineChunk {
  int virtual_stage = 0;
  PipelineStage stage;  // its layers, first / last
  // The stage network's unit index (0 embeddings or the tied head's copy,
  // 1..layers its blocks, layers + 1 head) -> the stage layout's unit; -1
  // where the chunk has no such unit.
  std::vector<int> units;
};

// A contiguous piece of the stage layout's flat vector and where it is in
// the model layout's.
struct StageRun {
  int64_t local = 0, outer = 0, count = 0;
  bool owner = true;  // false: the tied embedding's copy on the last stage
};

class PipelineStagePlan {
 public:
  // outer: the model layout (units embeddings, L blocks, head) or a
  // blocks-only one (L units); split: the
  // layers of each of pp * v virtual stages (split_pipeline_layers).
  PipelineStagePlan(const ParamLayout& outer, int pp, int virtual_stages, int rank, const std::vector<int>& split);

  const ParamLayout& stage_layout() const { return layout_; }
  const ParamLayout& outer_layout() const { return outer_; }
  const std::vector<PipelineChunk>& chunks() const { return chunks_; }
  int ranks() const { return pp_; }
  int rank() const { return rank_; }
  // Every unit of the stage layout as one run, in stage order.
  const std::vector<StageRun>& runs() const { return runs_; }
  // The runs covering stage-local [begin, begin + count), cut to it.
  std::vector<StageRun> runs_in(int64_t begin, int64_t count) const;
  // The stage unit holding the embedding the tied head reads on this rank
  // when this rank is the last stage and not the first (-1 otherwise), and
  // whether the model's head is tied at all.
  int tied_copy_unit() const { return tied_copy_unit_; }
  int embedding_unit() const { return embedding_unit_; }  // the first stage's (owned) embedding unit, else -1
  bool tied() const { return tied_; }
  // Stage-local (start, count) ranges: the tied copy (never counted in the
  // grad norm: the first stage counts it) plus outer ranges `outer_skip`
  // (the TP store's non-owned elements) where this rank holds them. Sorted.
  std::vector<std::pair<int64_t, int64_t>> norm_skip(const std::vector<std::pair<int64_t, int64_t>>& outer_skip) const;

 private:
  ParamLayout outer_, layout_;
  int pp_ = 1, v_ = 1, rank_ = 0;
  std::vector<PipelineChunk> chunks_;
  std::vector<StageRun> runs_;
  int tied_copy_unit_ = -1, embedding_unit_ = -1;
  bool tied_ = false;
};

}  // namespace trainrun
