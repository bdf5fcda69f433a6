// Tensor-parallel parameter store (tp_param_store.h).
#include "parallel/tensor/tp_param_store.h"

#include <algorithm>

#include "core/common/error.h"
#include "parallel/sharding/frozen_store.h"

namespace trainrun {

namespace {

// A piece of the global vector (contiguous, or strided: a slice of an
// inner dim, one run per row) and where it starts in the inner (local)
// store, whose copy holds the runs back to back.
using Range = ParamStore::Range;

struct Mapped {
  Range global;
  int64_t local = 0;
};

// Base: ParamStore, or LoadingParamStore for an inner store that quantizes
// as it loads (LoadingTensorParallelStore below).
template <class Base>
class TensorParallelStore : public Base {
 public:
  TensorParallelStore(std::unique_ptr<ParamStore> inner, const TensorParallelPlan& plan, Communicator* tp)
      : inner_(std::move(inner)), plan_(plan), tp_(tp) {
    TR_CHECK(tp_ && tp_->world_size() == plan.size(), "tensor parallelism: the TP communicator has ",
             tp_ ? tp_->world_size() : 0, " ranks but the plan ", plan.size(), " (a bug)");
    inner_->set_grad_norm_skip(plan.non_owner_ranges());
    held_ = map_ranges(inner_->held_ranges(), false);
    write_ = map_ranges(inner_->write_ranges(), true);
    for (const Mapped& m : held_) held_ranges_.push_back(m.global);
    for (const Mapped& m : write_) write_ranges_.push_back(m.global);
    by_global_ = held_;
    std::sort(by_global_.begin(), by_global_.end(),
              [](const Mapped& a, const Mapped& b) { return a.global.global < b.global.global; });
    // for_local finds a global element by the one piece whose span holds it.
    for (size_t i = 1; i < by_global_.size(); ++i)
      TR_CHECK(by_global_[i - 1].global.end() <= by_global_[i].global.global,
               "tensor parallelism: this rank's pieces of the global layout interleave at element ",
               by_global_[i].global.global, " (a bug)");
  }

  // ---- UnitAccess: the local units, as the network reads them --------------
  const void* acquire_params(int unit) override { return inner_->acquire_params(unit); }
  void release_params(int unit) override { inner_->release_params(unit); }
  float* unit_grads(int unit) override { return inner_->unit_grads(unit); }
  void grads_done(int unit) override { inner_->grads_done(unit); }
  void begin_pass(bool backward_pass, bool backward_follows) override {
    inner_->begin_pass(backward_pass, backward_follows);
  }

  void init_params(const ModelArch& arch, uint64_t seed) override {
    TR_CHECK(arch.layout().total == plan_.global_layout().total, "init_params: the model (", arch.layout().total,
             " parameters) is not the one the tensor-parallel plan was built for (", plan_.global_layout().total, ")");
    // Element by global index: the same weights on every mesh. Padding rows are zero.
    std::vector<float> buf;
    for (const Range& r : inner_->held_ranges()) {
      buf.assign(size_t(r.count), 0.0f);
      for (const TpRun& run : plan_.runs_in(r.global, r.count))
        if (run.global >= 0) arch.init_params(seed, run.global, run.global + run.count, buf.data() + (run.local - r.global));
      inner_->write_state_range(0, r, buf.data());
    }
    inner_->params_updated();
  }
  void zero_grads() override { inner_->zero_grads(); }
  void finish_grads() override { inner_->finish_grads(); }
  double grad_norm_squared() override {
    float local = float(inner_->grad_norm_squared());  // owned elements only (set_grad_norm_skip)
    tp_->all_reduce(&local, 1, ReduceOp::Sum);
    return local;
  }
  void optimizer_step(const AdamWParams& p, int step, float grad_scale) override {
    inner_->optimizer_step(p, step, grad_scale);
  }
  void load_full_params(const std::vector<float>& flat) override {
    TR_CHECK(int64_t(flat.size()) == plan_.global_layout().total, "load_full_params: got ", flat.size(),
             " values for a model of ", plan_.global_layout().total);
    std::vector<float> local(size_t(plan_.local_layout().total), 0.0f);
    for (const TpRun& r : plan_.runs())
      if (r.global >= 0) std::copy(flat.begin() + r.global, flat.begin() + r.global + r.count, local.begin() + r.local);
    inner_->load_full_params(local);
  }

  std::vector<Range> held_ranges() const override { return held_ranges_; }
  std::vector<Range> write_ranges() const override { return write_ranges_; }
  std::vector<float> get_state(int kind) override {
    size_t n = 0;
    for (const Range& r : held_ranges_) n += size_t(r.numel());
    std::vector<float> out(n);
    size_t at = 0;
    for (const Range& r : held_ranges_) {
      copy_state_range(kind, r, out.data() + at);
      at += size_t(r.numel());
    }
    return out;
  }
  void copy_state_range(int kind, const Range& r, float* out) override {
    for_local(r, "copy_state_range", [&](const Range& local, int64_t at) { inner_->copy_state_range(kind, local, out + at); });
  }
  void write_state_range(int kind, const Range& r, const float* in) override {
    for_local(r, "write_state_range", [&](const Range& local, int64_t at) { inner_->write_state_range(kind, local, in + at); });
  }
  void params_updated() override { inner_->params_updated(); }
  void set_state(int kind, const std::vector<float>& host) override {
    size_t at = 0;
    for (const Range& r : held_ranges_) {
      TR_CHECK(at + size_t(r.numel()) <= host.size(), "set_state: too few values");
      write_state_range(kind, r, host.data() + at);
      at += size_t(r.numel());
    }
    TR_CHECK(at == host.size(), "set_state: ", host.size(), " values for ", at, " held");
    if (kind == 0) inner_->params_updated();
  }

  void set_step(int64_t step) override {
    inner_->set_step(step);
    tp_->set_step(step);
  }
  void check_comms() override {
    inner_->check_comms();
    tp_->check_health();
  }
  ShardMemory memory() const override { return inner_->memory(); }
  double take_comm_wait_seconds() override { return inner_->take_comm_wait_seconds(); }
  std::string strategy() const override { return inner_->strategy(); }

 protected:
  // Local ranges -> the global pieces they hold, in the same order:
  // adjacent runs merged where both sides are contiguous, then runs of
  // equal length, equally spaced in the global vector and back to back
  // locally (a row-parallel weight's rows) folded into one strided range.
  // owners_only: drop what another rank writes (replicas) and padding.
  std::vector<Mapped> map_ranges(const std::vector<Range>& local, bool owners_only) const {
    std::vector<Mapped> out;
    for (const Range& r : local) {
      // Never merged across the inner store's ranges: it serves each of
      // them on its own (a sharded unit's slice).
      const size_t first = out.size();
      for (const TpRun& run : plan_.runs_in(r.global, r.count)) {
        if (run.global < 0 || (owners_only && !run.owner)) continue;
        if (out.size() > first) {
          Mapped& b = out.back();
          if (b.global.reps == 1 && b.global.global + b.global.count == run.global &&
              b.local + b.global.count == run.local) {
            b.global.count += run.count;
            continue;
          }
        }
        out.push_back({{run.global, run.count}, run.local});
      }
      // Fold equally spaced runs (each entry is still contiguous here,
      // except the strided ones this loop builds).
      size_t w = first;
      for (size_t i = first; i < out.size(); ++i) {
        const Mapped& m = out[i];
        if (w > first) {
          Range& b = out[w - 1].global;
          const bool next_local = out[w - 1].local + b.numel() == m.local;
          const bool same_len = b.count == m.global.count;
          const int64_t gap = m.global.global - (b.reps == 1 ? b.global : b.global + (b.reps - 1) * b.stride);
          if (next_local && same_len && gap > b.count && (b.reps == 1 || gap == b.stride)) {
            b.stride = gap;
            ++b.reps;
            continue;
          }
        }
        out[w++] = m;
      }
      out.resize(w);
    }
    return out;
  }
  // Calls f(local range, offset in r's host copy) for the local pieces of
  // global range r (contiguous or strided), pieces adjacent on both sides
  // merged, never across two of this store's pieces (the inner store
  // serves each of its ranges on its own): a held strided range, or rows
  // of one, is one local range, one call.
  template <typename F>
  void for_local(const Range& r, const char* what, F f) {
    if (r.reps > 1) {  // the common case: rows of one held strided piece, without a search per row
      auto it = std::upper_bound(by_global_.begin(), by_global_.end(), r.global,
                                 [](int64_t v, const Mapped& m) { return v < m.global.global; });
      if (it != by_global_.begin()) {
        const Mapped& m = *std::prev(it);
        const Range& h = m.global;
        if (h.reps > 1 && h.stride == r.stride && h.count == r.count && (r.global - h.global) % h.stride == 0 &&
            r.end() <= h.end()) {
          f(Range{m.local + (r.global - h.global) / h.stride * h.count, r.numel()}, 0);
          return;
        }
      }
    }
    Range pending{-1, 0};
    int64_t pending_at = 0;
    const Mapped* pending_of = nullptr;
    for (int64_t rep = 0; rep < r.reps; ++rep) {
      int64_t g = r.global + rep * r.stride;
      const int64_t end = g + r.count;
      int64_t at = rep * r.count;
      while (g < end) {
        auto it = std::upper_bound(by_global_.begin(), by_global_.end(), g,
                                   [](int64_t v, const Mapped& m) { return v < m.global.global; });
        TR_CHECK(it != by_global_.begin(), what, ": global element ", g,
                 " is not held by this tensor-parallel rank (a bug)");
        const Mapped& m = *std::prev(it);
        const int64_t row = m.global.reps > 1 ? (g - m.global.global) / m.global.stride : 0;
        const int64_t rs = m.global.global + row * m.global.stride;
        TR_CHECK(g < m.global.end() && g < rs + m.global.count, what, ": global element ", g,
                 " is not held by this tensor-parallel rank (a bug)");
        const int64_t n = std::min(end, rs + m.global.count) - g;
        const int64_t local = m.local + row * m.global.count + (g - rs);
        if (pending.count > 0 && pending_of == &m && pending.global + pending.count == local &&
            pending_at + pending.count == at) {
          pending.count += n;
        } else {
          if (pending.count > 0) f(pending, pending_at);
          pending = Range{local, n};
          pending_at = at;
          pending_of = &m;
        }
        g += n;
        at += n;
      }
    }
    if (pending.count > 0) f(pending, pending_at);
  }

  std::unique_ptr<ParamStore> inner_;
  const TensorParallelPlan& plan_;
 private:
  Communicator* tp_;
  std::vector<Mapped> held_, write_, by_global_;
  std::vector<Range> held_ranges_, write_ranges_;
};

// The inner store quantizes as it loads (model.base_dtype nf4): it has no
// fp32 ranges to write, so every load goes through its load_from, with a
// reader of global coordinates turned into one of the local layout's. A
// local range's runs of equal length, equally spaced in the global vector
// (a row-parallel weight's rows), go to the outer reader as one strided
// read, so a file is not touched once per row; padding reads as zeros.
class LoadingTensorParallelStore final : public TensorParallelStore<LoadingParamStore> {
 public:
  LoadingTensorParallelStore(std::unique_ptr<ParamStore> inner, const TensorParallelPlan& plan, Communicator* tp)
      : TensorParallelStore(std::move(inner), plan, tp), loading_(dynamic_cast<LoadingParamStore*>(inner_.get())) {
    TR_CHECK(loading_, "tensor parallelism: the inner store does not load by reader (a bug)");
  }
  void load_from(const FlatReader& read) override {
    loading_->load_from([&](int64_t local, int64_t count, int64_t stride, int64_t reps, float* out) {
      for (int64_t rep = 0; rep < reps; ++rep) read_local(read, local + rep * stride, count, out + rep * count);
    });
  }
  void init_params(const ModelArch& arch, uint64_t seed) override {
    TR_CHECK(arch.layout().total == plan_.global_layout().total, "init_params: the model (", arch.layout().total,
             " parameters) is not the one the tensor-parallel plan was built for (", plan_.global_layout().total, ")");
    load_from([&](int64_t g, int64_t n, int64_t stride, int64_t reps, float* out) {
      for (int64_t r = 0; r < reps; ++r) arch.init_params(seed, g + r * stride, g + r * stride + n, out + r * n);
    });
  }
  void load_full_params(const std::vector<float>& flat) override {
    TR_CHECK(int64_t(flat.size()) == plan_.global_layout().total, "load_full_params: got ", flat.size(),
             " values for a model of ", plan_.global_layout().total);
    load_from([&](int64_t g, int64_t n, int64_t stride, int64_t reps, float* out) {
      for (int64_t r = 0; r < reps; ++r) std::copy_n(flat.begin() + g + r * stride, n, out + r * n);
    });
  }

 private:
  void read_local(const FlatReader& read, int64_t local, int64_t count, float* out) const {
    const std::vector<TpRun> runs = plan_.runs_in(local, count);
    for (size_t i = 0; i < runs.size();) {
      const TpRun& r = runs[i];
      float* to = out + (r.local - local);
      if (r.global < 0) {
        std::fill_n(to, r.count, 0.0f);
        ++i;
        continue;
      }
      // Fold the following runs of the same length at a constant global stride.
      size_t j = i + 1;
      const int64_t stride = j < runs.size() ? runs[j].global - r.global : 0;
      while (j < runs.size() && runs[j].global >= 0 && runs[j].count == r.count &&
             runs[j].global - runs[j - 1].global == stride && stride >= r.count &&
             runs[j].local == runs[j - 1].local + r.count)
        ++j;
      read(r.global, r.count, j - i > 1 ? stride : 0, int64_t(j - i), to);
      i = j;
    }
  }
  LoadingParamStore* loading_;
};

}  // namespace

std::unique_ptr<ParamStore> make_tensor_parallel_store(std::unique_ptr<ParamStore> inner,
                                                       const TensorParallelPlan& plan, Communicator* tp) {
  if (dynamic_cast<LoadingParamStore*>(inner.get()))
    return std::make_unique<LoadingTensorParallelStore>(std::move(inner), plan, tp);
  return std::make_unique<TensorParallelStore<ParamStore>>(std::move(inner), plan, tp);
}

}  // namespace trainrun
