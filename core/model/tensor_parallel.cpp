// Tensor parallelism's local layouts (tensor_parallel.h).
#include "core/model/tensor_parallel.h"

#include <chrono>

#include <algorithm>
#include <numeric>

#include "core/common/error.h"

namespace trainrun {

void check_tensor_parallel(const ModelConfig& c, int T) {
  TR_CHECK(T >= 1, "parallel.tensor_parallel: ", T, " (must be at least 1; 1 = off)");
  if (T == 1) return;
  TR_CHECK(c.NH % T == 0, "model.n_head (", c.NH, ") is not divisible by parallel.tensor_parallel (", T,
           "); every rank of a tensor-parallel group needs whole attention heads: use a degree that divides ", c.NH);
  const int kv = c.kv_heads();
  TR_CHECK(kv % T == 0 || T % kv == 0, "model.n_kv_head (", kv, ") and parallel.tensor_parallel (", T,
           ") do not fit: key/value heads are split when n_kv_head is a multiple of the degree, and replicated when "
           "the degree is a multiple of n_kv_head (model.n_head ", c.NH,
           "); change parallel.tensor_parallel or model.n_kv_head");
  const int F = c.F > 0 ? c.F : 4 * c.C;
  TR_CHECK(F % T == 0, "model.ffn_dim (", F, ") is not divisible by parallel.tensor_parallel (", T,
           "); the MLP's columns split evenly over the group: use a degree that divides ", F);
  const int Vl = (c.V + T - 1) / T;
  TR_CHECK(c.V - (T - 1) * Vl >= 1, "model.vocab_size (", c.V, ") is too small for parallel.tensor_parallel (", T,
           "): padded to ", Vl * T, ", the last rank would hold no real token; use a smaller degree");
}

namespace {

// The local piece of one global tensor: its local shape and runs (local
// offsets relative to the tensor's local start).
struct Piece {
  std::vector<int64_t> shape;
  std::vector<TpRun> runs;
};

// Which units of a split dim this rank holds: [u0, u0+nu), owner or a replica.
struct UnitSlice {
  int64_t u0 = 0, nu = 0;
  bool owner = true;
};

UnitSlice slice_units(const ParamTensor& t, int64_t units, int T, int r) {
  if (units % T == 0) return {r * (units / T), units / T, true};
  TR_CHECK(T % units == 0, "tensor parallelism: ", t.name, " has ", units, " units along its split dim, which ",
           "neither divide nor are divided by parallel.tensor_parallel (", T, ")");
  const int per = T / int(units);
  return {r / per, 1, r % per == 0};
}

Piece split_tensor(const ParamTensor& t, int T, int r, int V_local, int v_valid) {
  using S = ParamTensor::Split;
  Piece p;
  p.shape = t.shape;
  auto run = [&](int64_t local, int64_t global, int64_t count, bool owner) {
    if (count > 0) p.runs.push_back({local, global, count, owner});
  };
  switch (t.split) {
    case S::Replicated:
      run(0, t.offset, t.numel, r == 0);
      break;
    case S::Column: {
      const int64_t D = t.shape[0], inner = t.numel / D, b = t.split_blocks;
      const int64_t rows_per_block = D / b;
      const int64_t units = t.split_units > 0 ? t.split_units : rows_per_block;
      const int64_t unit_rows = rows_per_block / units;
      const UnitSlice s = slice_units(t, units, T, r);
      const int64_t local_rows = s.nu * unit_rows;
      int64_t at = 0;
      for (int64_t k = 0; k < b; ++k) {
        run(at, t.offset + (k * rows_per_block + s.u0 * unit_rows) * inner, local_rows * inner, s.owner);
        at += local_rows * inner;
      }
      p.shape[0] = b * local_rows;
      break;
    }
    case S::Row: {
      const int64_t out = t.shape[0], in = t.shape[1];
      const int64_t units = t.split_units > 0 ? t.split_units : in;
      const int64_t unit_cols = in / units;
      const UnitSlice s = slice_units(t, units, T, r);
      const int64_t cols = s.nu * unit_cols;
      for (int64_t i = 0; i < out; ++i) run(i * cols, t.offset + i * in + s.u0 * unit_cols, cols, s.owner);
      p.shape[1] = cols;
      break;
    }
    case S::Vocab: {
      const int64_t C = t.numel / t.shape[0];
      run(0, t.offset + int64_t(r) * V_local * C, int64_t(v_valid) * C, true);
      run(int64_t(v_valid) * C, -1, int64_t(V_local - v_valid) * C, false);  // padding rows
      p.shape[0] = V_local;
      break;
    }
  }
  return p;
}

}  // namespace

int vocab_pad_multiple(int tp, int backend_align) {
  TR_CHECK(tp >= 1 && backend_align >= 1, "vocab padding: tp ", tp, ", backend alignment ", backend_align, " (a bug)");
  return std::lcm(tp, backend_align);
}

TensorParallelPlan::TensorParallelPlan(const ModelArch& arch, int tp, int rank, int backend_align)
    : global_(arch.layout()) {
  const ModelConfig& c = arch.config();
  check_tensor_parallel(c, tp);
  TR_CHECK(rank >= 0 && rank < tp, "tensor parallelism: rank ", rank, " outside a group of ", tp, " (a bug)");
  TpLocalShape& s = shape_;
  s.tp = tp;
  s.rank = rank;
  s.NH = c.NH / tp;
  const int kv = c.kv_heads();
  s.NKV = kv % tp == 0 ? kv / tp : 1;
  s.kv_replicas = kv % tp == 0 ? 1 : tp / kv;
  const int F = c.F > 0 ? c.F : 4 * c.C;
  s.F = F / tp;
  // The padded vocabulary: a multiple of the TP degree (equal shards) and
  // of the backend's row alignment (CUDA: 64, for its GEMM tiles and
  // vectorised logits rows). A rank's shard may then be all padding when
  // the vocabulary is small; it still runs every collective.
  const int multiple = vocab_pad_multiple(tp, backend_align);
  s.V_pad = (c.V + multiple - 1) / multiple * multiple;
  s.V_local = s.V_pad / tp;
  s.v_begin = rank * s.V_local;
  s.v_valid = std::max(0, std::min(s.V_local, c.V - s.v_begin));
  split_layout();
}

TensorParallelPlan::TensorParallelPlan(const ParamLayout& global, const TpLocalShape& shape)
    : shape_(shape), global_(global) {
  TR_CHECK(shape.tp >= 1 && shape.rank >= 0 && shape.rank < shape.tp, "tensor parallelism: rank ", shape.rank,
           " outside a group of ", shape.tp, " (a bug)");
  split_layout();
}

TensorParallelPlan::TensorParallelPlan(const ParamLayout& global, const ParamLayout& local, std::vector<TpRun> runs,
                                       const TpLocalShape& shape)
    : shape_(shape), global_(global), local_(local), runs_(std::move(runs)) {
  TR_CHECK(shape.tp >= 1 && shape.rank >= 0 && shape.rank < shape.tp, "parallelism plan: rank ", shape.rank,
           " outside a group of ", shape.tp, " (a bug)");
  int64_t at = 0;
  for (const TpRun& r : runs_) {
    TR_CHECK(r.local == at, "parallelism plan: the runs do not cover the local layout in order at ", at, " (a bug)");
    at += r.count;
  }
  TR_CHECK(at == local_.total, "parallelism plan: the runs cover ", at, " of ", local_.total, " local elements (a bug)");
  for (size_t i = 0; i < runs_.size(); ++i)
    if (runs_[i].global >= 0) by_global_.push_back(i);
  std::sort(by_global_.begin(), by_global_.end(),
            [&](size_t a, size_t b2) { return runs_[a].global < runs_[b2].global; });
}

void TensorParallelPlan::split_layout() {
  const TpLocalShape& s = shape_;
  const int tp = s.tp, rank = s.rank;
  LayoutBuilder b;
  int unit = -1;
  int64_t local_off = 0;
  for (const ParamTensor& t : global_.tensors) {
    if (t.unit != unit) {
      if (unit >= 0) b.end_unit();
      unit = t.unit;
      b.begin_unit(global_.units[size_t(unit)].name);
    }
    Piece p = split_tensor(t, tp, rank, s.V_local, s.v_valid);
    b.add(t.name, p.shape, t.decay, t.split, t.split_blocks, t.split_units);
    int64_t n = 0;
    for (TpRun& r : p.runs) {
      r.local += local_off;
      n += r.count;
      runs_.push_back(r);
    }
    int64_t numel = 1;
    for (auto d : p.shape) numel *= d;
    TR_CHECK(n == numel, "tensor parallelism: the runs of ", t.name, " do not cover its local shape (a bug)");
    local_off += numel;
  }
  if (unit >= 0) b.end_unit();
  for (const ParamTie& tie : global_.ties) b.tie(tie.name, tie.tensor);
  local_ = b.finish();
  for (size_t i = 0; i < runs_.size(); ++i)
    if (runs_[i].global >= 0) by_global_.push_back(i);
  std::sort(by_global_.begin(), by_global_.end(),
            [&](size_t a, size_t b2) { return runs_[a].global < runs_[b2].global; });
}

std::vector<TpRun> TensorParallelPlan::runs_in(int64_t begin, int64_t count) const {
  std::vector<TpRun> out;
  const int64_t end = begin + count;
  // First run ending after begin.
  auto it = std::upper_bound(runs_.begin(), runs_.end(), begin,
                             [](int64_t v, const TpRun& r) { return v < r.local + r.count; });
  for (; it != runs_.end() && it->local < end; ++it) {
    const int64_t lo = std::max(begin, it->local), hi = std::min(end, it->local + it->count);
    TpRun r = *it;
    r.global = it->global < 0 ? -1 : it->global + (lo - it->local);
    r.local = lo;
    r.count = hi - lo;
    out.push_back(r);
  }
  return out;
}

int64_t TensorParallelPlan::local_of(int64_t g) const {
  auto it = std::upper_bound(by_global_.begin(), by_global_.end(), g,
                             [&](int64_t v, size_t i) { return v < runs_[i].global + runs_[i].count; });
  if (it == by_global_.end()) return -1;
  const TpRun& r = runs_[*it];
  if (g < r.global) return -1;
  return r.local + (g - r.global);
}

std::vector<std::pair<int64_t, int64_t>> TensorParallelPlan::non_owner_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const TpRun& r : runs_) {
    if (r.owner) continue;
    if (!out.empty() && out.back().first + out.back().second == r.local) out.back().second += r.count;
    else out.push_back({r.local, r.count});
  }
  return out;
}

namespace {
// Adds the scope's host time to the context's TP collective clock.
struct TpCommClock {
  const TensorParallel* tp;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  explicit TpCommClock(const TensorParallel* t) : tp(t) {}
  ~TpCommClock() {
    tp->comm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++tp->comm_calls;
  }
};
}  // namespace

void TensorParallel::all_reduce(void* buf, int64_t n, DType dt) const {
  if (!comm || n == 0) return;
  const TpCommClock clock(this);
  if (dt == DType::F32) comm->all_reduce(static_cast<float*>(buf), n, ReduceOp::Sum);
  else comm->all_reduce_bf16(static_cast<uint16_t*>(buf), n, ReduceOp::Sum);
}

void* TpCollectives::my_rows(void* full, int N) const {
  if (!sp) return full;
  return static_cast<char*>(full) + int64_t(tp->plan->rank()) * rows(N) * C * dtype_size(be->act_dtype());
}

void TpCollectives::vocab_cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                                        float* rowmax, float* stats, int v_begin, int N, int v_valid, int ldv,
                                        float dloss_scale, float cap) const {
  be->vocab_ce_max(rowmax, logits, N, v_valid, ldv);
  {
    const TpCommClock clock(tp);
    tp->comm->all_reduce(rowmax, N, ReduceOp::Max);
  }
  be->vocab_ce_sumexp(stats, logits, targets, rowmax, v_begin, N, v_valid, ldv);
  {
    const TpCommClock clock(tp);
    tp->comm->all_reduce(stats, 2 * int64_t(N), ReduceOp::Sum);
  }
  be->vocab_ce_finish(losses, dlogits, logits, targets, rowmax, stats, v_begin, N, v_valid, ldv, dloss_scale, cap);
}

void TpCollectives::gather_rows(void* full, int N) const {
  if (!sp) return;
  const TpCommClock clock(tp);
  tp->comm->all_gather(full, my_rows(full, N), size_t(rows(N)) * C * dtype_size(be->act_dtype()));
}

const void* TpCollectives::reduce_out(void* partial, int N) const {
  if (!tp) return partial;
  if (!sp) {
    tp->all_reduce(partial, int64_t(N) * C, be->act_dtype());
    return partial;
  }
  const int64_t n = int64_t(rows(N)) * C;
  const TpCommClock clock(tp);
  if (be->act_dtype() == DType::F32)
    tp->comm->reduce_scatter(static_cast<float*>(rows_buf), static_cast<const float*>(partial), n, ReduceOp::Sum);
  else
    tp->comm->reduce_scatter_bf16(static_cast<uint16_t*>(rows_buf), static_cast<const uint16_t*>(partial), n,
                                  ReduceOp::Sum);
  return rows_buf;
}

const void* TpCollectives::full_rows(const void* mine, int N) const {
  if (!sp) return mine;
  be->copy_device(my_rows(full_buf, N), mine, size_t(rows(N)) * C * dtype_size(be->act_dtype()));
  gather_rows(full_buf, N);
  return full_buf;
}

float* TpCollectives::norm_grad(float* dparams) const {
  if (!sp) return dparams;
  be->zero(norm_buf, size_t(norm_len) * 4);
  return norm_buf;
}

void TpCollectives::norm_grad_done(float* dparams) const {
  if (!sp) return;
  {
    const TpCommClock clock(tp);
    tp->comm->all_reduce(norm_buf, norm_len, ReduceOp::Sum);
  }
  be->accumulate(dparams, norm_buf, norm_len);
}

}  // namespace trainrun
