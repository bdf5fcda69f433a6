// Expert parallelism's two-part parameter store (ep_split_store.h).
#include "parallel/expert/ep_split_store.h"

#include <algorithm>

#include "core/common/error.h"
#include "parallel/sharding/buffer_pool.h"
#include "parallel/tensor/tp_param_store.h"

namespace trainrun {

namespace {

using Range = ParamStore::Range;

// A contiguous run of a local unit that one part holds contiguously.
struct Piece {
  int64_t at = 0;       // offset in the local unit
  int part = 0;         // 0 dense, 1 experts
  int64_t part_at = 0;  // offset in that part's unit
  int64_t count = 0;
};

struct LocalUnit {
  int64_t numel = 0;
  int dense_u = -1, expert_u = -1;  // the unit in each part (-1: none)
  bool through = false;             // the dense part's unit is this unit, whole
  std::vector<Piece> pieces;
  void* params = nullptr;           // assembled (mixed units), while acquired
  int holders = 0;
  float* grads = nullptr;           // assembled gradient, from first use to grads_done
};

class ExpertSplitStore final : public ParamStore {
 public:
  ExpertSplitStore(const ParamLayout& local, std::unique_ptr<ParamStore> dense, const TensorParallelPlan& dense_plan,
                   std::unique_ptr<ParamStore> experts, const TensorParallelPlan& expert_plan, Communicator* ep,
                   Backend* be)
      : single_(make_single_communicator()), inner_{dense.get(), experts.get()}, plans_{&dense_plan, &expert_plan},
        be_(be), pool_(be), es_(dtype_size(be->act_dtype())) {
    TR_CHECK(ep != nullptr, "expert parallelism: no ep communicator for the experts' store (a bug)");
    parts_[0] = make_tensor_parallel_store(std::move(dense), dense_plan, single_.get());
    parts_[1] = make_tensor_parallel_store(std::move(experts), expert_plan, ep);
    const ParamLayout& dense_layout = dense_plan.local_layout();
    const ParamLayout& expert_layout = expert_plan.local_layout();
    expert_units_ = int(expert_layout.units.size());
    TR_CHECK(dense_layout.units.size() == local.units.size(),
             "expert parallelism: the dense part has ", dense_layout.units.size(), " units, the local layout ",
             local.units.size(), " (a bug)");
    const ParamLayout* layouts[2] = {&dense_layout, &expert_layout};
    units_.resize(local.units.size());
    int64_t covered = 0;
    // The parts keep the local order: one cursor each, so a model of tens of
    // thousands of tensors is matched in one pass, not by name searches.
    size_t next[2] = {0, 0};
    for (const ParamTensor& t : local.tensors) {
      LocalUnit& U = units_[size_t(t.unit)];
      U.numel = local.units[size_t(t.unit)].numel;
      auto at_cursor = [&](int k) {
        return next[k] < layouts[k]->tensors.size() && layouts[k]->tensors[next[k]].name == t.name;
      };
      TR_CHECK(at_cursor(0) || at_cursor(1), "expert parallelism: tensor ", t.name, " is not the next tensor of "
               "either part of the rank's store (a bug)");
      const int part = at_cursor(0) ? 0 : 1;
      const ParamTensor& p = layouts[part]->tensors[next[part]++];
      TR_CHECK(p.numel == t.numel, "expert parallelism: tensor ", t.name, " has ", p.numel, " elements in its part, ",
               t.numel, " in the local layout (a bug)");
      int& pu = part == 0 ? U.dense_u : U.expert_u;
      TR_CHECK(pu < 0 || pu == p.unit, "expert parallelism: unit ", local.units[size_t(t.unit)].name,
               " spans two units of one part (a bug)");
      TR_CHECK(part == 1 || p.unit == t.unit, "expert parallelism: the dense part's units are not the local layout's "
               "(a bug)");
      pu = p.unit;
      const Piece piece{t.offset - local.units[size_t(t.unit)].offset, part,
                        p.offset - layouts[part]->units[size_t(p.unit)].offset, t.numel};
      if (!U.pieces.empty()) {
        Piece& b = U.pieces.back();
        if (b.part == piece.part && b.at + b.count == piece.at && b.part_at + b.count == piece.part_at) {
          b.count += piece.count;
          covered += piece.count;
          continue;
        }
      }
      U.pieces.push_back(piece);
      covered += piece.count;
    }
    TR_CHECK(covered == local.total && dense_layout.total + expert_layout.total == local.total,
             "expert parallelism: the two parts do not cover the local layout (a bug)");
    for (size_t u = 0; u < units_.size(); ++u) {
      LocalUnit& U = units_[u];
      TR_CHECK(U.dense_u == int(u), "expert parallelism: unit ", local.units[u].name, " has no dense tensor (a bug)");
      U.through = U.pieces.size() == 1 && U.pieces[0].part == 0 && U.numel == dense_layout.units[u].numel;
    }
    // Checkpoint ranges: both parts', by global offset, each contiguous.
    // A part's wrapper folds equally spaced runs into one strided range (a
    // no_shard dense part: every block's attention and router between the
    // experts); the two parts' ranges then interleave, and the stores
    // around this one (pipeline stage, TP) take contiguous ranges from
    // their inner store (sharding.h). So each strided range is cut into
    // its rows: one per block at most, never per element.
    auto rows_of = [](const Range& r, auto&& add) {
      for (int64_t i = 0; i < r.reps; ++i) add(Range{r.global + i * (r.reps > 1 ? r.stride : 0), r.count});
    };
    for (int part = 0; part < 2; ++part) {
      for (const Range& r : parts_[part]->held_ranges()) rows_of(r, [&](const Range& x) { held_.push_back({x, part}); });
      for (const Range& r : parts_[part]->write_ranges()) rows_of(r, [&](const Range& x) { write_.push_back(x); });
    }
    auto by_global = [](const Range& a, const Range& b) { return a.global < b.global; };
    std::sort(held_.begin(), held_.end(), [&](const Held& a, const Held& b) { return by_global(a.r, b.r); });
    std::sort(write_.begin(), write_.end(), by_global);
    for (size_t i = 1; i < held_.size(); ++i)
      TR_CHECK(held_[i - 1].r.end() <= held_[i].r.global, "expert parallelism: the dense and expert parts both hold "
               "global element ", held_[i].r.global, " (a bug)");
  }

  // ---- UnitAccess: the local units ------------------------------------------------------
  const void* acquire_params(int unit) override {
    LocalUnit& U = units_[size_t(unit)];
    if (U.through) return parts_[0]->acquire_params(U.dense_u);
    if (U.holders++ > 0) return U.params;
    // Each part's unit is released as soon as its pieces are copied: the
    // copies are on the compute stream, as the network's own reads of a
    // unit it releases would be, so the part's buffer reuse is ordered
    // after them the same way.
    const char* src[2] = {static_cast<const char*>(parts_[0]->acquire_params(U.dense_u)),
                          U.expert_u >= 0 ? static_cast<const char*>(parts_[1]->acquire_params(U.expert_u)) : nullptr};
    U.params = pool_.get(size_t(U.numel) * es_);
    char* dst = static_cast<char*>(U.params);
    for (const Piece& p : U.pieces)
      be_->copy_device(dst + p.at * int64_t(es_), src[p.part] + p.part_at * int64_t(es_), size_t(p.count) * es_);
    parts_[0]->release_params(U.dense_u);
    if (U.expert_u >= 0) parts_[1]->release_params(U.expert_u);
    return U.params;
  }
  void release_params(int unit) override {
    LocalUnit& U = units_[size_t(unit)];
    if (U.through) return parts_[0]->release_params(U.dense_u);
    TR_CHECK(U.holders > 0, "expert parallelism: unit ", unit, " released more often than acquired (a bug)");
    if (--U.holders == 0) {
      pool_.put(U.params, size_t(U.numel) * es_);
      U.params = nullptr;
    }
  }
  float* unit_grads(int unit) override {
    LocalUnit& U = units_[size_t(unit)];
    if (U.through) return parts_[0]->unit_grads(U.dense_u);
    if (!U.grads) {
      U.grads = static_cast<float*>(pool_.get(size_t(U.numel) * 4));
      be_->zero(U.grads, size_t(U.numel) * 4);
    }
    return U.grads;
  }
  void grads_done(int unit) override {
    LocalUnit& U = units_[size_t(unit)];
    if (U.through) return parts_[0]->grads_done(U.dense_u);
    if (U.grads) {  // added, not copied: no_shard accumulates micro-batches in the parts' buffers
      float* dst[2] = {parts_[0]->unit_grads(U.dense_u), U.expert_u >= 0 ? parts_[1]->unit_grads(U.expert_u) : nullptr};
      for (const Piece& p : U.pieces) be_->accumulate(dst[p.part] + p.part_at, U.grads + p.at, p.count);
      pool_.put(U.grads, size_t(U.numel) * 4);
      U.grads = nullptr;
    }
    // The same order on every rank: the dense part's reduction, then the experts'.
    parts_[0]->grads_done(U.dense_u);
    if (U.expert_u >= 0) parts_[1]->grads_done(U.expert_u);
  }
  // The order of the coming acquires, so each part queues its gathers
  // behind the one in use. The dense part has the model's units and its
  // pass rules (the embeddings kept from the forward for the tied head);
  // the expert part's unit 0 is the first MoE block, not the embeddings,
  // so its order is spelled out: every block forward, every block back.
  // Given to the inner stores: the global-coordinate wrappers do not pass
  // begin_pass_in_order on.
  void begin_pass(bool backward_pass, bool backward_follows) override {
    inner_[0]->begin_pass(backward_pass, backward_follows);
    std::vector<int> order(expert_units_);
    for (int i = 0; i < expert_units_; ++i) order[size_t(i)] = backward_pass ? expert_units_ - 1 - i : i;
    inner_[1]->begin_pass_in_order(order);
  }
  void begin_pass_in_order(const std::vector<int>& units) override {
    std::vector<int> experts;
    for (int u : units)
      if (units_[size_t(u)].expert_u >= 0) experts.push_back(units_[size_t(u)].expert_u);
    inner_[0]->begin_pass_in_order(units);  // the dense part's units are the local ones
    inner_[1]->begin_pass_in_order(experts);
  }

  // ---- the rest: both parts ------------------------------------------------------------
  void init_params(const ModelArch& arch, uint64_t seed) override {
    for (auto& p : parts_) p->init_params(arch, seed);
  }
  void zero_grads() override {
    for (LocalUnit& U : units_)  // a pass that ended without grads_done (an error unwound it)
      if (U.grads) {
        pool_.put(U.grads, size_t(U.numel) * 4);
        U.grads = nullptr;
      }
    for (auto& p : parts_) p->zero_grads();
  }
  void finish_grads() override {
    for (auto& p : parts_) p->finish_grads();
  }
  // The dense part's norm is complete over dp; the experts' wrapper sums
  // its part over the ep group: every element of the model counts once
  // (less what a wrapping store said another rank owns: norm_skip_).
  double grad_norm_squared() override { return parts_[0]->grad_norm_squared() + parts_[1]->grad_norm_squared(); }
  // A wrapping store's skip (this store's coordinates: TP replicas, a
  // stage's tied copy), cut into each part's own layout on the innermost
  // stores (the parts' wrappers skip nothing of their own).
  void set_grad_norm_skip(std::vector<std::pair<int64_t, int64_t>> skip) override {
    ParamStore::set_grad_norm_skip(std::move(skip));
    apply_norm_skip();
  }
  void optimizer_step(const AdamWParams& p, int step, float grad_scale) override {
    for (auto& s : parts_) s->optimizer_step(p, step, grad_scale);
  }
  void load_full_params(const std::vector<float>& flat) override {
    for (auto& p : parts_) p->load_full_params(flat);
  }
  std::vector<Range> held_ranges() const override {
    std::vector<Range> out;
    for (const Held& h : held_) out.push_back(h.r);
    return out;
  }
  std::vector<Range> write_ranges() const override { return write_; }
  std::vector<float> get_state(int kind) override {
    size_t n = 0;
    for (const Held& h : held_) n += size_t(h.r.numel());
    std::vector<float> out(n);
    size_t at = 0;
    for (const Held& h : held_) {
      parts_[h.part]->copy_state_range(kind, h.r, out.data() + at);
      at += size_t(h.r.numel());
    }
    return out;
  }
  void copy_state_range(int kind, const Range& r, float* out) override {
    parts_[part_of(r, "copy_state_range")]->copy_state_range(kind, r, out);
  }
  void write_state_range(int kind, const Range& r, const float* in) override {
    parts_[part_of(r, "write_state_range")]->write_state_range(kind, r, in);
  }
  void params_updated() override {
    for (auto& p : parts_) p->params_updated();
  }
  void set_state(int kind, const std::vector<float>& host) override {
    size_t at = 0;
    for (const Held& h : held_) {
      TR_CHECK(at + size_t(h.r.numel()) <= host.size(), "set_state: ", host.size(), " values for more held");
      parts_[h.part]->write_state_range(kind, h.r, host.data() + at);
      at += size_t(h.r.numel());
    }
    TR_CHECK(at == host.size(), "set_state: ", host.size(), " values for ", at, " held");
    if (kind == 0) params_updated();
  }
  void set_step(int64_t step) override {
    for (auto& p : parts_) p->set_step(step);
  }
  void check_comms() override {
    for (auto& p : parts_) p->check_comms();
  }
  ShardMemory memory() const override {
    ShardMemory m;
    for (const auto& p : parts_) {
      const ShardMemory s = p->memory();
      m.params += s.params, m.grads += s.grads, m.optimizer += s.optimizer;
      m.comm_buffers += s.comm_buffers, m.host += s.host, m.disk += s.disk;
    }
    m.comm_buffers += pool_.peak();  // the assembled blocks
    return m;
  }
  double take_comm_wait_seconds() override {
    return parts_[0]->take_comm_wait_seconds() + parts_[1]->take_comm_wait_seconds();
  }
  std::string strategy() const override { return parts_[0]->strategy(); }

 private:
  struct Held {
    Range r;
    int part = 0;
  };
  // The part holding range r (inside one of held_ranges(), as the checkpoint
  // code asks: a held range or rows of one).
  int part_of(const Range& r, const char* what) const {
    auto it = std::upper_bound(held_.begin(), held_.end(), r.global,
                               [](int64_t g, const Held& h) { return g < h.r.global; });
    TR_CHECK(it != held_.begin() && r.end() <= std::prev(it)->r.end(), what, ": global elements [", r.global, ", ",
             r.end(), ") are not inside one range this expert-parallel rank holds (a bug)");
    return std::prev(it)->part;
  }

  // norm_skip_ into each part's layout, through its plan's runs.
  void apply_norm_skip() {
    for (int k = 0; k < 2; ++k) {
      std::vector<std::pair<int64_t, int64_t>> out;
      for (const TpRun& run : plans_[k]->runs()) {
        // The skip ranges overlapping [run.global, run.global + count).
        auto it = std::upper_bound(norm_skip_.begin(), norm_skip_.end(), run.global,
                                   [](int64_t g, const std::pair<int64_t, int64_t>& r) { return g < r.first; });
        if (it != norm_skip_.begin()) --it;
        for (; it != norm_skip_.end() && it->first < run.global + run.count; ++it) {
          const int64_t a = std::max(it->first, run.global), b = std::min(it->first + it->second, run.global + run.count);
          if (a < b) out.push_back({run.local + (a - run.global), b - a});
        }
      }
      std::sort(out.begin(), out.end());
      inner_[k]->set_grad_norm_skip(std::move(out));
    }
  }

  std::unique_ptr<Communicator> single_;  // the dense part's wrapper: a group of one
  std::unique_ptr<ParamStore> parts_[2];  // global-coordinate wrappers over inner_
  ParamStore* inner_[2];
  const TensorParallelPlan* plans_[2];
  Backend* be_;
  BufferPool pool_;
  size_t es_;
  std::vector<LocalUnit> units_;
  int expert_units_ = 0;
  std::vector<Held> held_;
  std::vector<Range> write_;
};

}  // namespace

std::unique_ptr<ParamStore> make_expert_split_store(const ParamLayout& local, std::unique_ptr<ParamStore> dense,
                                                    const TensorParallelPlan& dense_plan,
                                                    std::unique_ptr<ParamStore> experts,
                                                    const TensorParallelPlan& expert_plan, Communicator* ep,
                                                    Backend* be) {
  return std::make_unique<ExpertSplitStore>(local, std::move(dense), dense_plan, std::move(experts), expert_plan, ep,
                                            be);
}

}  // namespace trainrun
