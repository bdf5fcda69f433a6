// LoRA adapters: layout, init and the per-GEMM forward/backward (lora.h).
#include "core/model/adapter/lora.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "core/common/error.h"
#include "core/model/init_rng.h"

namespace trainrun {

namespace {
std::vector<std::string> split_names(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s + ",") {
    if (c == ',') {
      // trim blanks and the quotes a hand-written list may carry
      const auto b = cur.find_first_not_of(" \t'\"[");
      const auto e = cur.find_last_not_of(" \t'\"]");
      if (b != std::string::npos) out.push_back(cur.substr(b, e - b + 1));
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}
}  // namespace

LoraOptions LoraOptions::from_spec(const ModelSpec::AdapterSpec& a) {
  LoraOptions o;
  o.rank = a.rank;
  o.alpha = a.alpha;
  o.dropout = a.dropout;
  o.target_modules = a.target_modules;
  o.dora = a.type == "dora";
  return o;
}

std::vector<std::string> resolve_target_modules(const ModelArch& arch, const std::string& target_modules) {
  std::vector<std::string> known;
  for (const BlockLinear& b : arch.block_linears())
    if (std::find(known.begin(), known.end(), b.short_name()) == known.end()) known.push_back(b.short_name());
  TR_CHECK(!known.empty(), "model.adapter: the ", arch.display_name(), " architecture has no adaptable linears");
  const std::vector<std::string> asked = split_names(target_modules);
  TR_CHECK(!asked.empty(), "model.adapter.target_modules: empty; name the linears to adapt (", join(known),
           ") or all-linear");
  if (asked.size() == 1 && asked[0] == "all-linear") return known;
  std::vector<std::string> out;
  for (const std::string& n : asked) {
    TR_CHECK(std::find(known.begin(), known.end(), n) != known.end(), "model.adapter.target_modules: '", n,
             "' matches no linear of the ", arch.display_name(), " model (its block linears are ", join(known),
             "; or all-linear); fix the name");
    if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  }
  // In the arch's order, so the layout does not depend on how the list was written.
  std::vector<std::string> ordered;
  for (const std::string& k : known)
    if (std::find(out.begin(), out.end(), k) != out.end()) ordered.push_back(k);
  return ordered;
}

namespace {
// Whether several ranks of a TP group of T hold an element of t (all of a
// replicated tensor; a split one whose units, e.g. KV heads, are fewer than
// T): each of them computes a partial sum of its gradient.
bool held_by_several(const ParamTensor& t, int T) {
  using S = ParamTensor::Split;
  if (t.split == S::Replicated) return true;
  if (t.split == S::Column) {
    const int64_t units = t.split_units > 0 ? t.split_units : t.shape[0] / t.split_blocks;
    return units % T != 0;
  }
  if (t.split == S::Row) {
    const int64_t units = t.split_units > 0 ? t.split_units : t.shape[1];
    return units % T != 0;
  }
  return false;
}
}  // namespace

LoraAdapters::LoraAdapters(const ModelArch& arch, const LoraOptions& opt, Backend* be, int max_rows,
                           const TensorParallel* tp)
    : opt_(opt), scale_(opt.scaling()), tp_(tp && tp->plan && tp->plan->size() > 1 ? tp : nullptr), be_(be),
      max_rows_(max_rows) {
  TR_CHECK(opt.rank >= 1, "model.adapter.rank: ", opt.rank, " must be >= 1");
  TR_CHECK(opt.dropout >= 0 && opt.dropout < 1, "model.adapter.dropout: ", opt.dropout, " must be in [0, 1)");
  names_ = resolve_target_modules(arch, opt.target_modules);
  const int L = arch.config().L;
  const int64_t r = opt.rank;
  const std::vector<BlockLinear> lins = arch.block_linears();
  int gemms = 0;
  for (const BlockLinear& b : lins) gemms = std::max(gemms, b.gemm + 1);
  by_gemm_.assign(size_t(L), std::vector<std::vector<int>>(size_t(gemms)));
  LayoutBuilder lb;
  int64_t max_in = 0, max_out = 0;
  int tensor = 0;
  const ParamLayout& base = arch.layout();
  for (int l = 0; l < L; ++l) {
    lb.begin_unit("block " + std::to_string(l));
    int64_t in_unit = 0;
    for (const BlockLinear& b : lins) {
      if (std::find(names_.begin(), names_.end(), b.short_name()) == names_.end()) continue;
      LoraTarget t;
      t.layer = l;
      t.linear = b;
      t.module = arch.hf_block_prefix(l) + b.module;
      // Split as the base weight is (lora.h, "Tensor parallelism"): B and m
      // along out like a column-parallel weight's rows (same blocks and
      // units), A along in like a row-parallel weight's columns.
      using S = ParamTensor::Split;
      const ParamTensor& w = base.get(t.module + ".weight");
      const bool col = w.split == S::Column, row = w.split == S::Row;
      const S out_split = col ? S::Column : S::Replicated;
      const int out_blocks = col ? w.split_blocks : 1, out_units = col ? w.split_units : 0;
      lb.add(t.module + ".lora_A.weight", {r, b.in}, true, row ? S::Row : S::Replicated, 1, row ? w.split_units : 0);
      lb.add(t.module + ".lora_B.weight", {b.out, r}, true, out_split, out_blocks, out_units);
      t.row_parallel = row && tp_;
      t.in = b.in;
      t.out = b.out;
      t.out_begin = b.out_begin;
      t.a_tensor = tensor++;
      t.b_tensor = tensor++;
      t.a_off = in_unit;
      in_unit += r * b.in;
      t.b_off = in_unit;
      in_unit += b.out * r;
      if (opt.dora) {
        // peft's name in its files (the state dict's ".default.weight" dropped); decayed as A and B are.
        lb.add(t.module + ".lora_magnitude_vector", {b.out}, true, out_split, out_blocks, out_units);
        t.m_tensor = tensor++;
        t.m_off = in_unit;
        in_unit += b.out;
        // The base weight: in block l's unit (1 + l: the embeddings are unit 0), stored (out, in).
        t.base_unit = 1 + l;
        TR_CHECK(t.base_unit < int(base.units.size()), "LoraAdapters: no base unit for block ", l, " (a bug)");
        const ParamUnit& u = base.units[size_t(t.base_unit)];
        TR_CHECK(w.shape == std::vector<int64_t>({b.out, b.in}) && w.offset >= u.offset &&
                     w.offset + w.numel <= u.offset + u.numel,
                 "LoraAdapters: ", w.name, " is not the (", b.out, ", ", b.in, ") weight of base unit '", u.name,
                 "' that DoRA reads (a bug)");
        t.w_off = w.offset - u.offset;
      }
      max_in = std::max(max_in, b.in);
      max_out = std::max(max_out, b.out);
      by_gemm_[size_t(l)][size_t(b.gemm)].push_back(int(targets_.size()));
      targets_.push_back(t);
    }
    lb.end_unit();
  }
  layout_ = lb.finish();
  if (tp_) localize(arch);
  const size_t es = dtype_size(be->act_dtype());
  xd_ = DeviceBuffer(be, size_t(max_rows) * size_t(max_in) * es);
  xa_ = DeviceBuffer(be, size_t(max_rows) * size_t(r) * es);
  dxa_ = DeviceBuffer(be, size_t(max_rows) * size_t(r) * es);
  if (opt.dora) {
    base_units_.assign(base.units.size(), nullptr);
    // The norm's W + s B A is formed a slab of rows at a time, so its
    // scratch stays bounded (256 x 28672 at most on Llama 70B, 14 MiB bf16).
    norm_rows_ = int(std::min<int64_t>(max_out, 256));
    xw_ = DeviceBuffer(be, size_t(max_rows) * size_t(max_out) * es);
    xba_ = DeviceBuffer(be, size_t(max_rows) * size_t(max_out) * es);
    wd_ = DeviceBuffer(be, size_t(norm_rows_) * size_t(max_in) * es);
    norm_ = DeviceBuffer(be, size_t(max_out) * 4);
  }
}

// Tensor parallelism: this rank's slice of the adapters (split as the
// base weights are), every target's local shape and offsets, and where the
// gradients several ranks hold go for end_block's sum.
void LoraAdapters::localize(const ModelArch& arch) {
  const int T = tp_->plan->size();
  tp_plan_ = std::make_unique<TensorParallelPlan>(layout_, tp_->plan->shape());
  const ParamLayout& local = tp_plan_->local_layout();
  const ParamLayout& base = tp_->plan->local_layout();
  const std::vector<BlockLinear> lins = arch.block_linears();
  for (LoraTarget& t : targets_) {
    const int64_t uoff = local.units[size_t(t.layer)].offset;
    const ParamTensor& A = local.tensors[size_t(t.a_tensor)];
    const ParamTensor& B = local.tensors[size_t(t.b_tensor)];
    t.a_off = A.offset - uoff;
    t.b_off = B.offset - uoff;
    t.in = A.shape[1];
    t.out = B.shape[0];
    // A row-parallel target's columns: where its first local one is globally.
    if (t.row_parallel)
      t.in_begin = tp_plan_->runs_in(A.offset, 1).at(0).global - layout_.tensors[size_t(t.a_tensor)].offset;
    // Its columns in the GEMM's local output: after the local columns of
    // the linears before it in that GEMM (q | k | v, gate | up).
    const std::string prefix = arch.hf_block_prefix(t.layer);
    t.out_begin = 0;
    for (const BlockLinear& b : lins)
      if (b.gemm == t.linear.gemm && b.out_begin < t.linear.out_begin)
        t.out_begin += base.get(prefix + b.module + ".weight").shape[0];
    if (opt_.dora) {
      t.m_off = local.tensors[size_t(t.m_tensor)].offset - uoff;
      const ParamTensor& w = base.get(t.module + ".weight");
      const ParamUnit& u = base.units[size_t(t.base_unit)];
      TR_CHECK(w.shape == std::vector<int64_t>({t.out, t.in}) && w.offset >= u.offset &&
                   w.offset + w.numel <= u.offset + u.numel,
               "LoraAdapters: ", w.name, "'s local slice is not (", t.out, ", ", t.in, ") in base unit '", u.name,
               "' (a bug)");
      t.w_off = w.offset - u.offset;
    }
  }
  const int L = int(by_gemm_.size());
  reduce_copies_.assign(size_t(L), {});
  reduce_len_.assign(size_t(L), 0);
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    const ParamTensor& g = layout_.tensors[i];
    if (!held_by_several(g, T)) continue;
    const ParamTensor& lt = local.tensors[i];
    const int64_t uoff = local.units[size_t(g.unit)].offset;
    int64_t& len = reduce_len_[size_t(g.unit)];
    // The tensor's global extent in the buffer: ranks holding an element
    // put it at the same place, the others leave zeros there.
    for (const TpRun& run : tp_plan_->runs_in(lt.offset, lt.numel))
      reduce_copies_[size_t(g.unit)].push_back({run.local - uoff, len + (run.global - g.offset), run.count});
    len += g.numel;
  }
  int64_t most_unit = 1, most_reduce = 1;
  for (int l = 0; l < L; ++l) {
    most_unit = std::max(most_unit, local.units[size_t(l)].numel);
    most_reduce = std::max(most_reduce, reduce_len_[size_t(l)]);
  }
  grad_scratch_ = DeviceBuffer(be_, size_t(most_unit) * 4);
  reduce_buf_ = DeviceBuffer(be_, size_t(most_reduce) * 4);
}

// The open block's gradients (grad_scratch_) into the store's: the
// elements several ranks hold summed over the group first, in one
// all-reduce on the network's TP communicator (the compute thread, in
// block order on every rank).
void LoraAdapters::reduce_block_grads(int layer) {
  float* g = grad_scratch_.as<float>();
  const int64_t len = reduce_len_[size_t(layer)];
  if (len > 0) {
    float* buf = reduce_buf_.as<float>();
    be_->zero(buf, size_t(len) * 4);
    for (const ReduceCopy& c : reduce_copies_[size_t(layer)])
      be_->copy_device(buf + c.buf, g + c.local, size_t(c.count) * 4);
    tp_->comm->all_reduce(buf, len, ReduceOp::Sum);
    for (const ReduceCopy& c : reduce_copies_[size_t(layer)])
      be_->copy_device(g + c.local, buf + c.buf, size_t(c.count) * 4);
  }
  be_->accumulate(params_->unit_grads(layer), g, local_layout().units[size_t(layer)].numel);
}

// peft: nn.init.kaiming_uniform_(A, a=sqrt(5)): gain sqrt(2/(1+5)), bound
// gain * sqrt(3/fan_in) = 1/sqrt(in). B: zeros, so the adapted model starts
// as the base.
void LoraAdapters::init_params(uint64_t seed, int64_t begin, int64_t end, float* out) const {
  std::fill(out, out + (end - begin), 0.0f);
  const uint64_t s = splitmix64(seed ^ 0x4c6f5241ull);  // "LoRA": not the base init's stream
  for (const LoraTarget& t : targets_) {
    const ParamTensor& a = layout_.tensors[size_t(t.a_tensor)];
    const int64_t lo = std::max(begin, a.offset), hi = std::min(end, a.offset + a.numel);
    const double bound = 1.0 / std::sqrt(double(t.linear.in));
    for (int64_t i = lo; i < hi; ++i) {
      const double u = double(splitmix64(s ^ splitmix64(uint64_t(i))) >> 11) * (1.0 / 9007199254740992.0);
      out[i - begin] = float((2.0 * u - 1.0) * bound);
    }
  }
}

void LoraAdapters::begin_block(int layer, bool backward) {
  TR_CHECK(params_, "LoraAdapters: no parameter store bound (a bug)");
  TR_CHECK(layer >= 0 && layer < int(by_gemm_.size()), "LoraAdapters: layer ", layer, " out of range (a bug)");
  open_layer_ = layer;
  unit_params_ = static_cast<const char*>(params_->acquire_params(layer));
  unit_grads_ = nullptr;
  if (backward && tp_) {
    // This block's fresh gradients, summed over TP where partial (end_block).
    unit_grads_ = grad_scratch_.as<float>();
    be_->zero(unit_grads_, size_t(local_layout().units[size_t(layer)].numel) * 4);
  } else if (backward) {
    unit_grads_ = params_->unit_grads(layer);
  }
}

void LoraAdapters::end_block(int layer, bool backward) {
  TR_CHECK(layer == open_layer_, "LoraAdapters: block ", layer, " ended while ", open_layer_, " is open (a bug)");
  if (backward && tp_) reduce_block_grads(layer);
  params_->release_params(layer);
  if (backward) params_->grads_done(layer);
  open_layer_ = -1;
  unit_params_ = nullptr;
  unit_grads_ = nullptr;
}

uint64_t LoraAdapters::target_seed(const LoraTarget& t) const {
  return splitmix64(drop_seed_ ^ splitmix64(uint64_t(t.a_tensor)));  // a_tensor: unique per target
}

const void* LoraAdapters::dropped(const LoraTarget& t, const void* x, int N) {
  if (!dropout_on()) return x;
  be_->dropout_forward(xd_.get(), x, N, int(t.in), float(opt_.dropout), target_seed(t), row0_, t.linear.in,
                       t.in_begin);
  return xd_.get();
}

void LoraAdapters::forward(int layer, int gemm, const void* x, void* y, int ldy, int N) {
  TR_CHECK(layer == open_layer_ && N <= max_rows_, "LoraAdapters: forward outside its block or over ", max_rows_,
           " rows (a bug)");
  using Op = Backend::GemmOp;
  const size_t es = dtype_size(be_->act_dtype());
  const int r = opt_.rank;
  for (int ti : by_gemm_[size_t(layer)][size_t(gemm)]) {
    const LoraTarget& t = targets_[size_t(ti)];
    if (opt_.dora) {
      dora_forward(t, x, static_cast<char*>(y) + t.out_begin * es, ldy, N);
      continue;
    }
    const int in = int(t.in), out = int(t.out);
    const void* A = unit_params_ + t.a_off * es;
    const void* B = unit_params_ + t.b_off * es;
    const void* xd = dropped(t, x, N);
    be_->gemm(xa_.get(), r, false, xd, in, Op::N, A, in, Op::T, N, r, in, 1.0f, 0.0f);  // xa = xd A^T
    char* ycols = static_cast<char*>(y) + t.out_begin * es;
    be_->gemm(ycols, ldy, false, xa_.get(), r, Op::N, B, r, Op::T, N, out, r, scale_, 1.0f);  // y += s xa B^T
  }
}

void LoraAdapters::backward(int layer, int gemm, const void* x, const void* dy, int ldy, void* dx, int N) {
  TR_CHECK(layer == open_layer_ && unit_grads_ && N <= max_rows_,
           "LoraAdapters: backward outside its block's backward (a bug)");
  using Op = Backend::GemmOp;
  const size_t es = dtype_size(be_->act_dtype());
  const int r = opt_.rank;
  for (int ti : by_gemm_[size_t(layer)][size_t(gemm)]) {
    const LoraTarget& t = targets_[size_t(ti)];
    if (opt_.dora) {
      dora_backward(t, x, static_cast<const char*>(dy) + t.out_begin * es, ldy, dx, N);
      continue;
    }
    const int in = int(t.in), out = int(t.out);
    const void* A = unit_params_ + t.a_off * es;
    const void* B = unit_params_ + t.b_off * es;
    float* dA = unit_grads_ + t.a_off;
    float* dB = unit_grads_ + t.b_off;
    const char* dycols = static_cast<const char*>(dy) + t.out_begin * es;
    // Recompute dropout(x) and xa = dropout(x) A^T (nothing was kept).
    const void* xd = dropped(t, x, N);
    be_->gemm(xa_.get(), r, false, xd, in, Op::N, A, in, Op::T, N, r, in, 1.0f, 0.0f);
    be_->gemm(dB, r, true, dycols, ldy, Op::T, xa_.get(), r, Op::N, out, r, N, scale_, 1.0f);  // dB += s dy^T xa
    be_->gemm(dxa_.get(), r, false, dycols, ldy, Op::N, B, r, Op::N, N, r, out, scale_, 0.0f);  // dxa = s dy B
    be_->gemm(dA, in, true, dxa_.get(), r, Op::T, xd, in, Op::N, r, in, N, 1.0f, 1.0f);  // dA += dxa^T xd
    if (!dropout_on()) {
      be_->gemm(dx, in, false, dxa_.get(), r, Op::N, A, in, Op::N, N, in, r, 1.0f, 1.0f);  // dx += dxa A
    } else {
      // d dropout(x) = dxa A into the scratch (xd is consumed), through the same mask, added to dx.
      be_->gemm(xd_.get(), in, false, dxa_.get(), r, Op::N, A, in, Op::N, N, in, r, 1.0f, 0.0f);
      be_->dropout_forward(xd_.get(), xd_.get(), N, in, float(opt_.dropout), target_seed(t), row0_, t.linear.in,
                           t.in_begin);
      be_->residual_forward(dx, dx, xd_.get(), int64_t(N) * in);
    }
  }
}

int64_t frozen_grad_scratch_elems(const ParamLayout& base_layout) {
  int64_t most = 0;
  for (const ParamTensor& t : base_layout.tensors)
    if (t.unit != 0 && t.name != "lm_head.weight")
      most = std::max(most, t.offset - base_layout.units[size_t(t.unit)].offset + t.numel);
  return most;
}

AdaptedUnitAccess::AdaptedUnitAccess(UnitAccess& base, const ParamLayout& base_layout, LoraAdapters& adapters,
                                     UnitAccess& adapter_params, Backend* be)
    : base_(base), adapters_(adapters), adapter_params_(adapter_params), be_(be) {
  // Allocated by the first backward: a sampler never needs it.
  scratch_bytes_ = size_t(std::max<int64_t>(frozen_grad_scratch_elems(base_layout), 1)) * 4;
  adapters_.bind(&adapter_params_);
}

const void* AdaptedUnitAccess::acquire_params(int unit) {
  const void* p = base_.acquire_params(unit);
  if (!adapters_.options().dora) return p;
  if (!staged_)
    adapters_.base_acquired(unit, p);
  else if (unit >= 1 && unit <= stage_layers_)  // a stage's block (its embedding and head hold no target)
    adapters_.base_acquired(first_layer_ + unit, p);
  return p;
}

float* AdaptedUnitAccess::unit_grads(int) {
  if (!scratch_.get()) {
    scratch_ = DeviceBuffer(be_, scratch_bytes_);
    be_->zero(scratch_.get(), scratch_bytes_);
  }
  return scratch_.as<float>();
}

void AdaptedUnitAccess::begin_pass(bool backward_pass, bool backward_follows) {
  // A pipeline rank's chunks each join the adapters to their own units
  // (adapter_pipeline.h): the pass that starts is this one's.
  adapters_.bind(&adapter_params_);
  base_.begin_pass(backward_pass, backward_follows);
  adapter_params_.begin_pass(backward_pass, backward_follows);
  // What the network accumulates there is never read; zeroed once per
  // backward so it cannot grow to inf over a long run.
  if (backward_pass && scratch_.get()) be_->zero(scratch_.get(), scratch_bytes_);
}

}  // namespace trainrun
