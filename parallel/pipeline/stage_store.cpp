// The pipeline rank's parameter store (stage_store.h).
#include "parallel/pipeline/stage_store.h"

#include <algorithm>

#include "core/common/error.h"
#include "parallel/sharding/frozen_store.h"  // LoadingParamStore

namespace trainrun {

namespace {

using Range = ParamStore::Range;

struct Mapped {
  Range outer;
  int64_t local = 0;
};

class StageStore;

// What one chunk's network sees: its unit numbers mapped onto the stage layout.
class ChunkAccess final : public UnitAccess {
 public:
  ChunkAccess(StageStore& s, const PipelineChunk& c) : s_(s), c_(c) {}
  const void* acquire_params(int unit) override;
  void release_params(int unit) override;
  float* unit_grads(int unit) override;
  void grads_done(int unit) override;
  void begin_pass(bool backward_pass, bool backward_follows) override;

 private:
  int map(int unit) const {
    TR_CHECK(unit >= 0 && unit < int(c_.units.size()) && c_.units[size_t(unit)] >= 0, "pipeline: virtual stage ",
             c_.virtual_stage, " has no unit ", unit, " (a bug)");
    return c_.units[size_t(unit)];
  }
  StageStore& s_;
  const PipelineChunk& c_;
};

class StageStore final : public PipelineStageStore, public ReaderLoadable {
 public:
  StageStore(std::unique_ptr<ParamStore> inner, const PipelineStagePlan& plan, Communicator* pp, Backend* be,
             bool reshard, bool frozen)
      : inner_(std::move(inner)), plan_(plan), pp_(pp), be_(be), reshard_(reshard), frozen_(frozen) {
    TR_CHECK(plan.ranks() == 1 || (pp_ && pp_->world_size() == plan.ranks()), "pipeline: the pp communicator has ",
             pp_ ? pp_->world_size() : 0, " ranks but the plan ", plan.ranks(), " (a bug)");
    const size_t n = plan.stage_layout().units.size();
    held_.assign(n, nullptr);
    deferred_.assign(n, false);
    for (const PipelineChunk& c : plan.chunks()) access_.push_back(std::make_unique<ChunkAccess>(*this, c));
    held_map_ = map_ranges(inner_->held_ranges(), false);
    write_map_ = map_ranges(inner_->write_ranges(), true);
    for (const Mapped& m : held_map_) held_ranges_.push_back(m.outer);
    for (const Mapped& m : write_map_) write_ranges_.push_back(m.outer);
    by_outer_ = held_map_;
    std::sort(by_outer_.begin(), by_outer_.end(),
              [](const Mapped& a, const Mapped& b) { return a.outer.global < b.outer.global; });
  }

  // ---- the stage networks' access --------------------------------------------
  UnitAccess& chunk_access(int chunk) override { return *access_.at(size_t(chunk)); }
  const void* acquire(int su) {
    if (reshard_) {
      ++acquires_;
      return inner_->acquire_params(su);
    }
    if (!held_[size_t(su)]) {
      held_[size_t(su)] = inner_->acquire_params(su);
      ++acquires_;
    }
    return held_[size_t(su)];
  }
  void release(int su) {
    if (reshard_) inner_->release_params(su);
  }
  float* grads(int su) { return inner_->unit_grads(su); }
  void done(int su) {
    // The tied units wait for end_backward's sum in any case; without
    // reshard every unit's reduction waits for the step's last microbatch.
    if (reshard_ && su != plan_.tied_copy_unit() && !(plan_.tied() && su == plan_.embedding_unit())) {
      ++reductions_;
      inner_->grads_done(su);
      return;
    }
    deferred_[size_t(su)] = true;
  }

  // The stage units chunk c's network acquires in this pass, in its order
  // (core/model/gpt2|llama: forward the embedding on the first stage, the
  // blocks, then the head and, tied, the embedding it reads; backward the
  // tied embedding and the head on the last stage, then the blocks in
  // reverse; the first stage's embedding gradient needs no gather), so the
  // inner store gathers each one while the one before it computes. Without
  // it the stage order is unknown to the inner store and nothing is
  // prefetched: every gather is exposed.
  void begin_chunk_pass(const PipelineChunk& c, bool backward) {
    std::vector<int> order;  // network unit numbers
    const int layers = c.stage.layers;
    const bool tied_head = c.stage.last && plan_.tied();
    if (!backward) {
      if (c.stage.first) order.push_back(0);
      for (int l = 1; l <= layers; ++l) order.push_back(l);
      if (c.stage.last) order.push_back(layers + 1);
      if (tied_head) order.push_back(0);
    } else {
      if (tied_head) order.push_back(0);
      if (c.stage.last) order.push_back(layers + 1);
      for (int l = layers; l >= 1; --l) order.push_back(l);
    }
    std::vector<int> mapped;
    for (int u : order)
      if (u >= 0 && u < int(c.units.size()) && c.units[size_t(u)] >= 0) mapped.push_back(c.units[size_t(u)]);
    inner_->begin_pass_in_order(mapped);
  }

  void begin_step() override {
    acquires_ = reductions_ = 0;
  }
  void end_backward() override {
    sum_tied_grads();
    for (int su = int(deferred_.size()) - 1; su >= 0; --su) {
      if (!deferred_[size_t(su)]) continue;
      deferred_[size_t(su)] = false;
      ++reductions_;
      inner_->grads_done(su);
    }
    release_held();
    last_acquires_ = acquires_;
    last_reductions_ = reductions_;
  }
  void end_forward_only() override { release_held(); }
  bool tied_copies_identical(uint64_t* hash_out) override {
    if (!plan_.tied() || plan_.ranks() == 1) return true;
    const int su = plan_.tied_copy_unit() >= 0 ? plan_.tied_copy_unit() : plan_.embedding_unit();
    if (su < 0) return true;
    const int peer = plan_.tied_copy_unit() >= 0 ? 0 : plan_.ranks() - 1;
    const ParamUnit& u = plan_.stage_layout().units[size_t(su)];
    // FNV-1a over the bits of this rank's shard of the unit (both stages
    // shard the unit alike: same size, same dp group position).
    uint64_t h = 1469598103934665603ull;
    std::vector<float> buf;
    for (const Range& r : inner_->held_ranges()) {
      const int64_t lo = std::max(r.global, u.offset), hi = std::min(r.global + r.count, u.offset + u.numel);
      if (lo >= hi) continue;
      buf.resize(size_t(hi - lo));
      inner_->copy_state_range(0, Range{lo, hi - lo}, buf.data());
      const unsigned char* b = reinterpret_cast<const unsigned char*>(buf.data());
      for (size_t i = 0; i < buf.size() * 4; ++i) h = (h ^ b[i]) * 1099511628211ull;
    }
    if (hash_out) *hash_out = h;
    // Through backend buffers: the communicator moves device memory.
    DeviceBuffer mine(be_, 8), theirs(be_, 8);
    be_->copy_to_device(mine.get(), &h, 8);
    pp_->send_recv(mine.get(), 8, peer, theirs.get(), 8, peer, kPipelineTiedGradTag - 1);
    uint64_t other = 0;
    be_->copy_to_host(&other, theirs.get(), 8);
    return other == h;
  }
  int acquires_last_step() const override { return last_acquires_; }
  int reductions_last_step() const override { return last_reductions_; }

  // ---- UnitAccess of the store itself: not how a pipeline computes ------------
  const void* acquire_params(int) override { not_here("acquire_params"); }
  void release_params(int) override { not_here("release_params"); }
  float* unit_grads(int) override { not_here("unit_grads"); }
  void grads_done(int) override { not_here("grads_done"); }

  // ---- ParamStore -----------------------------------------------------------------
  void init_params(const ModelArch& arch, uint64_t seed) override {
    TR_CHECK(arch.layout().total == plan_.outer_layout().total, "init_params: the model (", arch.layout().total,
             " parameters) is not the one the pipeline plan was built for (", plan_.outer_layout().total, ")");
    if (load_if_quantizing([&](int64_t g, int64_t n, int64_t stride, int64_t reps, float* out) {
          for (int64_t k = 0; k < reps; ++k) arch.init_params(seed, g + k * stride, g + k * stride + n, out + k * n);
        }))
      return;
    std::vector<float> buf;
    for (const Range& r : inner_->held_ranges()) {
      buf.assign(size_t(r.count), 0.0f);
      for (const StageRun& run : plan_.runs_in(r.global, r.count))
        arch.init_params(seed, run.outer, run.outer + run.count, buf.data() + (run.local - r.global));
      inner_->write_state_range(0, r, buf.data());
    }
    inner_->params_updated();
  }
  void zero_grads() override { inner_->zero_grads(); }
  void finish_grads() override { inner_->finish_grads(); }
  double grad_norm_squared() override {
    // Every element once: the tied copy is the first stage's, and what the
    // tensor-parallel store above said another TP rank owns (norm_skip_, in
    // the model layout) is left out here, where the stage layout is known.
    inner_->set_grad_norm_skip(plan_.norm_skip(norm_skip_));
    float local = float(inner_->grad_norm_squared());
    if (pp_) pp_->all_reduce(&local, 1, ReduceOp::Sum);
    return local;
  }
  void optimizer_step(const AdamWParams& p, int step, float grad_scale) override {
    inner_->optimizer_step(p, step, grad_scale);
  }
  void load_full_params(const std::vector<float>& flat) override {
    TR_CHECK(int64_t(flat.size()) == plan_.outer_layout().total, "load_full_params: got ", flat.size(),
             " values for a model of ", plan_.outer_layout().total);
    std::vector<float> local(size_t(plan_.stage_layout().total), 0.0f);
    for (const StageRun& r : plan_.runs())
      std::copy(flat.begin() + r.outer, flat.begin() + r.outer + r.count, local.begin() + r.local);
    inner_->load_full_params(local);
  }
  // An inner store that quantizes as it loads (the NF4 base) reads
  // stage-local offsets: each of its reads maps onto the model's.
  bool load_if_quantizing(const FlatReader& read) override {
    auto* loading = dynamic_cast<LoadingParamStore*>(inner_.get());
    if (!loading) return false;
    // A read of `reps` runs `stride` apart is one run at a time here: a
    // stage's NF4 tensors are whole (no TP slice under pipeline stages), so
    // the NF4 store asks for reps 1.
    loading->load_from([&](int64_t local, int64_t count, int64_t stride, int64_t reps, float* out) {
      for (int64_t k = 0; k < reps; ++k) {
        const int64_t at = local + k * stride;
        int64_t covered = 0;
        for (const StageRun& run : plan_.runs_in(at, count)) {
          read(run.outer, run.count, run.count, 1, out + k * count + (run.local - at));
          covered += run.count;
        }
        TR_CHECK(covered == count, "pipeline: stage elements [", at, ", ", at + count, ") are not all in the "
                 "stage's runs (a bug)");
      }
    });
    return true;
  }
  std::vector<Range> held_ranges() const override { return held_ranges_; }
  std::vector<Range> write_ranges() const override { return write_ranges_; }
  std::vector<float> get_state(int kind) override {
    size_t n = 0;
    for (const Range& r : held_ranges_) n += size_t(r.count);
    std::vector<float> out(n);
    size_t at = 0;
    for (const Range& r : held_ranges_) {
      copy_state_range(kind, r, out.data() + at);
      at += size_t(r.count);
    }
    return out;
  }
  void copy_state_range(int kind, const Range& r, float* out) override {
    for_local(r, "copy_state_range", [&](const Range& l, int64_t at) { inner_->copy_state_range(kind, l, out + at); });
  }
  void write_state_range(int kind, const Range& r, const float* in) override {
    for_local(r, "write_state_range", [&](const Range& l, int64_t at) { inner_->write_state_range(kind, l, in + at); });
  }
  void params_updated() override { inner_->params_updated(); }
  void set_state(int kind, const std::vector<float>& host) override {
    size_t at = 0;
    for (const Range& r : held_ranges_) {
      TR_CHECK(at + size_t(r.count) <= host.size(), "set_state: too few values");
      write_state_range(kind, r, host.data() + at);
      at += size_t(r.count);
    }
    TR_CHECK(at == host.size(), "set_state: ", host.size(), " values for ", at, " held");
    if (kind == 0) inner_->params_updated();
  }
  void set_step(int64_t step) override {
    inner_->set_step(step);
    if (pp_) pp_->set_step(step);
  }
  void check_comms() override {
    inner_->check_comms();
    if (pp_) pp_->check_health();
  }
  ShardMemory memory() const override { return inner_->memory(); }
  double take_comm_wait_seconds() override { return inner_->take_comm_wait_seconds(); }
  std::string strategy() const override { return inner_->strategy(); }

 private:
  [[noreturn]] static void not_here(const char* what) {
    TR_FAIL("pipeline store: ", what, " goes through chunk_access() under pipeline parallelism (a bug)");
  }

  // The first and the last stage add each other's gradient of the tied
  // embedding (the head's use of it is on the last stage, the lookup's on
  // the first), before the dp reduction: that is linear, so summing first
  // is the same sum. Both compute a + b in the same order of operands'
  // values (float addition commutes), so the two copies get identical bits.
  void sum_tied_grads() {
    if (!plan_.tied() || plan_.ranks() == 1 || frozen_) return;
    const int su = plan_.tied_copy_unit() >= 0 ? plan_.tied_copy_unit() : plan_.embedding_unit();
    if (su < 0) return;  // a middle stage
    const int peer = plan_.tied_copy_unit() >= 0 ? 0 : plan_.ranks() - 1;
    const int64_t n = plan_.stage_layout().units[size_t(su)].numel;
    float* g = inner_->unit_grads(su);
    if (!tied_tmp_.get() || tied_tmp_.bytes() < size_t(n) * 4) tied_tmp_ = DeviceBuffer(be_, size_t(n) * 4);
    try {
      pp_->send_recv(g, size_t(n) * 4, peer, tied_tmp_.get(), size_t(n) * 4, peer, kPipelineTiedGradTag);
    } catch (const Error& e) {
      TR_FAIL("pipeline: the tied embedding's gradient sum with stage ", peer, " (",
              peer == 0 ? "the first" : "the last", " stage) failed: ", e.what());
    }
    be_->accumulate(g, tied_tmp_.as<float>(), n);
  }

  void release_held() {
    // No pass follows in this step: the inner store must not keep a unit
    // for a "next" use its last order named.
    inner_->begin_pass_in_order({});
    for (size_t su = 0; su < held_.size(); ++su)
      if (held_[su]) {
        inner_->release_params(int(su));
        held_[su] = nullptr;
      }
  }

  std::vector<Mapped> map_ranges(const std::vector<Range>& local, bool owners_only) const {
    std::vector<Mapped> out;
    for (const Range& r : local)
      for (const StageRun& run : plan_.runs_in(r.global, r.count))
        if (!owners_only || run.owner) out.push_back({{run.outer, run.count}, run.local});
    return out;
  }
  template <typename F>
  void for_local(const Range& r, const char* what, F f) {
    int64_t g = r.global;
    const int64_t end = r.global + r.count;
    while (g < end) {
      auto it = std::upper_bound(by_outer_.begin(), by_outer_.end(), g,
                                 [](int64_t v, const Mapped& m) { return v < m.outer.global + m.outer.count; });
      TR_CHECK(it != by_outer_.end() && it->outer.global <= g, what, ": model element ", g,
               " is not held by pipeline stage ", plan_.rank(), " (a bug)");
      const int64_t n = std::min(end, it->outer.global + it->outer.count) - g;
      f(Range{it->local + (g - it->outer.global), n}, g - r.global);
      g += n;
    }
  }

  std::unique_ptr<ParamStore> inner_;
  const PipelineStagePlan& plan_;
  Communicator* pp_;
  Backend* be_;
  bool reshard_;
  bool frozen_;
  std::vector<std::unique_ptr<ChunkAccess>> access_;
  std::vector<const void*> held_;
  std::vector<bool> deferred_;
  int acquires_ = 0, reductions_ = 0, last_acquires_ = 0, last_reductions_ = 0;
  DeviceBuffer tied_tmp_;
  std::vector<Mapped> held_map_, write_map_, by_outer_;
  std::vector<Range> held_ranges_, write_ranges_;
};

const void* ChunkAccess::acquire_params(int unit) { return s_.acquire(map(unit)); }
void ChunkAccess::release_params(int unit) { s_.release(map(unit)); }
float* ChunkAccess::unit_grads(int unit) { return s_.grads(map(unit)); }
void ChunkAccess::grads_done(int unit) { s_.done(map(unit)); }
void ChunkAccess::begin_pass(bool backward_pass, bool) { s_.begin_chunk_pass(c_, backward_pass); }

}  // namespace

std::unique_ptr<PipelineStageStore> make_pipeline_stage_store(std::unique_ptr<ParamStore> inner,
                                                              const PipelineStagePlan& plan, Communicator* pp,
                                                              Backend* be, bool reshard, bool frozen) {
  return std::make_unique<StageStore>(std::move(inner), plan, pp, be, reshard, frozen);
}

}  // namespace trainrun
