// A pipeline rank's stage layout (stage_plan.h).
#include "parallel/pipeline/stage_plan.h"

#include <algorithm>

#include "core/common/error.h"

namespace trainrun {

PipelineStagePlan::PipelineStagePlan(const ParamLayout& outer, int pp, int virtual_stages, int rank,
                                     const std::vector<int>& split)
    : outer_(outer), pp_(pp), v_(virtual_stages), rank_(rank) {
  const int stages = pp * virtual_stages;
  TR_CHECK(pp >= 1 && virtual_stages >= 1 && rank >= 0 && rank < pp && int(split.size()) == stages,
           "pipeline: stage plan for rank ", rank, " of ", pp, " with ", virtual_stages, " chunks and ", split.size(),
           " virtual stages (a bug)");
  int L = 0;
  for (int n : split) L += n;
  // A model layout (embeddings, blocks, head) or a blocks-only one (the
  // adapters': one unit per block, lora.h).
  const bool ends = int(outer.units.size()) == L + 2;
  TR_CHECK(ends || int(outer.units.size()) == L, "pipeline: the layout has ", outer.units.size(),
           " units; a pipeline needs embeddings, ", L, " blocks and a head, or ", L, " blocks only (a bug)");
  const int block0 = ends ? 1 : 0;  // the outer unit of block 0
  if (ends) {
    const ParamUnit& emb = outer.units.front();
    for (const ParamTie& t : outer.ties) {
      const ParamTensor& to = outer.get(t.tensor);
      if (to.offset >= emb.offset && to.offset < emb.offset + emb.numel) tied_ = true;
    }
  }
  std::vector<int> first_layer(size_t(stages), 0);
  for (int s = 1; s < stages; ++s) first_layer[size_t(s)] = first_layer[size_t(s - 1)] + split[size_t(s - 1)];

  LayoutBuilder b;
  int next_unit = 0;
  std::vector<int> outer_of;  // stage unit -> outer unit
  std::vector<bool> owned;
  auto add_unit = [&](int ou, bool owner, const std::string& name) {
    const ParamUnit& u = outer.units[size_t(ou)];
    b.begin_unit(name);
    for (const ParamTensor& t : outer.tensors)
      if (t.unit == ou) b.add(t.name, t.shape, t.decay, t.split, t.split_blocks, t.split_units);
    b.end_unit();
    (void)u;
    outer_of.push_back(ou);
    owned.push_back(owner);
    return next_unit++;
  };
  for (int c = 0; c < virtual_stages; ++c) {
    PipelineChunk ch;
    ch.virtual_stage = rank + c * pp;
    const int vs = ch.virtual_stage;
    ch.stage.first_layer = first_layer[size_t(vs)];
    ch.stage.layers = split[size_t(vs)];
    ch.stage.first = vs == 0;
    ch.stage.last = vs == stages - 1;
    ch.units.assign(size_t(ch.stage.layers + 2), -1);
    if (ch.stage.first && ends) ch.units[0] = embedding_unit_ = add_unit(0, true, outer.units[0].name);
    for (int j = 0; j < ch.stage.layers; ++j) {
      const int ou = block0 + ch.stage.first_layer + j;
      ch.units[size_t(1 + j)] = add_unit(ou, true, outer.units[size_t(ou)].name);
    }
    if (ch.stage.last && ends) {
      ch.units[size_t(ch.stage.layers + 1)] = add_unit(L + 1, true, outer.units[size_t(L + 1)].name);
      if (tied_ && !ch.stage.first)
        ch.units[0] = tied_copy_unit_ = add_unit(0, false, outer.units[0].name + " (the tied LM head's copy)");
    }
    chunks_.push_back(ch);
  }
  layout_ = b.finish();
  for (size_t u = 0; u < layout_.units.size(); ++u) {
    const ParamUnit& lu = layout_.units[u];
    const ParamUnit& ou = outer.units[size_t(outer_of[u])];
    TR_CHECK(lu.numel == ou.numel, "pipeline: stage unit '", lu.name, "' has ", lu.numel, " elements, the model's ",
             ou.numel, " (a bug)");
    runs_.push_back({lu.offset, ou.offset, lu.numel, owned[u]});
  }
}

std::vector<StageRun> PipelineStagePlan::runs_in(int64_t begin, int64_t count) const {
  std::vector<StageRun> out;
  const int64_t end = begin + count;
  for (const StageRun& r : runs_) {
    const int64_t lo = std::max(begin, r.local), hi = std::min(end, r.local + r.count);
    if (lo >= hi) continue;
    out.push_back({lo, r.outer + (lo - r.local), hi - lo, r.owner});
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> PipelineStagePlan::norm_skip(
    const std::vector<std::pair<int64_t, int64_t>>& outer_skip) const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const StageRun& r : runs_) {
    if (!r.owner) {
      out.push_back({r.local, r.count});
      continue;
    }
    for (const auto& [s0, n] : outer_skip) {
      const int64_t lo = std::max(s0, r.outer), hi = std::min(s0 + n, r.outer + r.count);
      if (lo < hi) out.push_back({r.local + (lo - r.outer), hi - lo});
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace trainrun
