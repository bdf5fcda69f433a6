// Expert parallelism's storage split (expert_parallel_plan.h).
#include "core/model/moe/expert_parallel_plan.h"

#include <algorithm>
#include <cstdlib>

#include "core/common/error.h"

namespace trainrun {

int expert_of_tensor(const std::string& name) {
  static const std::string key = ".experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos) return -1;
  const size_t b = at + key.size(), e = name.find('.', b);
  if (e == std::string::npos || e == b) return -1;
  int id = 0;
  for (size_t i = b; i < e; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    id = id * 10 + (name[i] - '0');
  }
  return id;
}

namespace {
// Appends (s, n) to ascending ranges, merging with the last when adjacent.
void push_range(std::vector<std::pair<int64_t, int64_t>>& out, int64_t s, int64_t n) {
  if (!out.empty() && out.back().first + out.back().second == s) out.back().second += n;
  else out.push_back({s, n});
}
}  // namespace

ExpertParallelPlan::ExpertParallelPlan(const ParamLayout& global, int n_experts, int ep, int rank)
    : global_(global), n_experts_(n_experts), ep_(ep), rank_(rank) {
  TR_CHECK(ep >= 1 && n_experts > 0 && n_experts % ep == 0, "parallel.expert_parallel ", ep,
           " must divide model.n_experts (", n_experts, "): every ep rank holds n_experts / expert_parallel "
           "whole experts; use a divisor of ", n_experts);
  TR_CHECK(rank >= 0 && rank < ep, "expert parallelism: ep rank ", rank, " is outside the group of ", ep, " (a bug)");
  const int e0 = first_expert(), e1 = e0 + local_experts();
  LayoutBuilder b;
  int unit = -1;
  int64_t local_off = 0;
  bool any_expert = false;
  for (const ParamTensor& t : global_.tensors) {
    const int e = expert_of_tensor(t.name);
    if (e >= n_experts) TR_FAIL("expert parallelism: tensor ", t.name, " names expert ", e, " but model.n_experts is ",
                                n_experts, " (a bug in the layout)");
    any_expert |= e >= 0;
    if (t.unit != unit) {
      if (unit >= 0) b.end_unit();
      // Units stay in order, one for one (an empty unit cannot happen: every
      // block holds its attention, which is dense).
      for (int u = unit + 1; u < t.unit; ++u) {
        b.begin_unit(global_.units[size_t(u)].name);
        b.end_unit();
      }
      unit = t.unit;
      b.begin_unit(global_.units[size_t(unit)].name);
    }
    if (e >= 0 && (e < e0 || e >= e1)) continue;  // another ep rank's expert
    b.add(t.name, t.shape, t.decay, t.split, t.split_blocks, t.split_units);
    TpRun r;
    r.local = local_off;
    r.global = t.offset;
    r.count = t.numel;
    runs_.push_back(r);
    expert_run_.push_back(e >= 0);
    local_off += t.numel;
  }
  if (unit >= 0) b.end_unit();
  TR_CHECK(any_expert, "parallel.expert_parallel ", ep, ": the model's layout has no routed-expert tensor "
           "(\".experts.<e>.\"); expert parallelism needs a mixture-of-experts model (model.n_experts > 0)");
  for (const ParamTie& tie : global_.ties) b.tie(tie.name, tie.tensor);
  local_ = b.finish();
  TR_CHECK(local_.total == local_off && local_.units.size() == global_.units.size(),
           "expert parallelism: the local layout lost a unit or an element (a bug)");
  // The two parts, each unit's tensors in local order (one builder per
  // part), in one pass over the local tensors (a 256-expert model has tens
  // of thousands), each tensor's global offset carried along from runs_.
  std::vector<char> has_dense(local_.units.size(), 0), has_expert(local_.units.size(), 0);
  for (size_t i = 0; i < local_.tensors.size(); ++i)
    (expert_run_[i] ? has_expert : has_dense)[size_t(local_.tensors[i].unit)] = 1;
  LayoutBuilder dense_b, expert_b;
  std::vector<int64_t> dense_global, expert_global;
  int part_unit = -1;
  auto end_unit = [&] {
    if (part_unit < 0) return;
    dense_b.end_unit();
    if (has_expert[size_t(part_unit)]) expert_b.end_unit();
  };
  for (size_t i = 0; i < local_.tensors.size(); ++i) {
    const ParamTensor& t = local_.tensors[i];
    for (; part_unit < t.unit;) {  // units in order, none skipped (every unit has a tensor)
      end_unit();
      ++part_unit;
      const ParamUnit& U = local_.units[size_t(part_unit)];
      TR_CHECK(has_dense[size_t(part_unit)], "expert parallelism: unit ", U.name, " holds only routed experts (a bug in "
               "the layout: every unit has dense tensors)");
      dense_b.begin_unit(U.name);
      if (has_expert[size_t(part_unit)]) expert_b.begin_unit(U.name);
    }
    (expert_run_[i] ? expert_b : dense_b).add(t.name, t.shape, t.decay, t.split, t.split_blocks, t.split_units);
    (expert_run_[i] ? expert_global : dense_global).push_back(runs_[i].global);
  }
  end_unit();
  TR_CHECK(part_unit + 1 == int(local_.units.size()), "expert parallelism: a unit of the layout has no tensor (a bug)");
  for (const ParamTie& tie : global_.ties) dense_b.tie(tie.name, tie.tensor);
  // Each part's runs into the global vector, one per tensor, all owned.
  auto plan_of = [&](ParamLayout part, const std::vector<int64_t>& global_at, int group, int pos) {
    std::vector<TpRun> runs;
    for (size_t i = 0; i < part.tensors.size(); ++i) {
      TpRun r;
      r.local = part.tensors[i].offset;
      r.global = global_at[i];
      r.count = part.tensors[i].numel;
      runs.push_back(r);
    }
    TpLocalShape shape;
    shape.tp = group;
    shape.rank = pos;
    return std::make_shared<TensorParallelPlan>(global_, part, std::move(runs), shape);
  };
  dense_plan_ = plan_of(dense_b.finish(), dense_global, 1, 0);
  expert_plan_ = plan_of(expert_b.finish(), expert_global, ep, rank);
  TR_CHECK(dense_layout().total + expert_layout().total == local_.total,
           "expert parallelism: the dense and expert parts do not add up to the local layout (a bug)");
}

int64_t ExpertParallelPlan::local_of(int64_t g) const {
  // runs_ ascend in global offset too (tensors are visited in flat order).
  auto it = std::upper_bound(runs_.begin(), runs_.end(), g,
                             [](int64_t v, const TpRun& r) { return v < r.global + r.count; });
  if (it == runs_.end() || g < it->global) return -1;
  return it->local + (g - it->global);
}

std::vector<std::pair<int64_t, int64_t>> ExpertParallelPlan::held_global() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const TpRun& r : runs_) push_range(out, r.global, r.count);
  return out;
}

std::vector<std::pair<int64_t, int64_t>> ExpertParallelPlan::expert_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t i = 0; i < runs_.size(); ++i)
    if (expert_run_[i]) push_range(out, runs_[i].local, runs_[i].count);
  return out;
}

}  // namespace trainrun
