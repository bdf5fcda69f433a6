// DoRA's path through LoraAdapters (lora.h): weight-decomposed low-rank
// adaptation as peft 0.12 computes it (tuners/lora/dora.py,
// DoraLinearLayer.forward), per target linear W (out, in):
//
//   xd    = dropout(x)                                      (N, in)
//   norm  = ||W + s B A||_row, held constant                (out)   no gradient
//   g     = m / norm                                        (out)
//   y    += (g - 1) * (xd W^T) + g * s * (xd A^T B^T)       (N, out) no bias in this term
//
// and its backward, with dy the GEMM's output gradient:
//
//   dm    += sum_n dy * (xd W^T + s xd A^T B^T) / norm
//   dxw    = (g - 1) dy,  dxba = g s dy
//   dB    += dxba^T (xd A^T),  dxa = dxba B,  dA += dxa^T xd
//   dx    += mask(dxw W + dxa A)            (mask: dropout's, when on)
//
// GPT-2's Conv1D (peft's fan_in_fan_out) changes nothing here: trainrun
// stores every block weight (out, in), and peft's norm is over the output
// rows of the transposed weight alike.
//
// Cost (a first version): xd W^T is not the base GEMM's output (that one
// saw x, not dropout(x), and carries the bias), so forward and backward
// each recompute it, and the backward adds dxw W to dx: an adapted linear
// runs 5 (N x out x in) GEMMs a step instead of LoRA's 2 (the frozen base's
// forward and input gradient), 2.5x its base cost. With dropout 0 the
// forward could reuse the base output less its bias; not done yet. The norm
// costs an (out x r x in) GEMM and a pass over W per target and pass, small
// beside the N-row GEMMs.
#include <algorithm>
#include <cmath>

#include "core/common/error.h"
#include "core/model/adapter/lora.h"

namespace trainrun {

const void* LoraAdapters::base_weight(const LoraTarget& t) const {
  const void* u = base_units_[size_t(t.base_unit)];
  TR_CHECK(u, "DoRA: base unit ", t.base_unit, " (", t.module, ") was never acquired through AdaptedUnitAccess "
           "before its block's adapters ran (a bug)");
  return static_cast<const char*>(u) + t.w_off * dtype_size(be_->act_dtype());
}

void LoraAdapters::dora_norms(const LoraTarget& t, const void* W, const void* A, const void* B) {
  using Op = Backend::GemmOp;
  const size_t es = dtype_size(be_->act_dtype());
  const int r = opt_.rank, in = int(t.in), out = int(t.out);
  if (norm_hold_ == NormHold::Replay) {
    const auto it = held_norms_.find(t.a_tensor);
    TR_CHECK(it != held_norms_.end() && it->second.size() == size_t(out),
             "DoRA: no recorded norm for ", t.module, " to replay (a test bug)");
    be_->copy_to_device(norm_.get(), it->second.data(), size_t(out) * 4);
    return;
  }
  for (int o0 = 0; o0 < out; o0 += norm_rows_) {
    const int rows = std::min(norm_rows_, out - o0);
    // wd = W[o0:o0+rows] + s B[o0:o0+rows] A, as peft's weight + scaling * lora_weight.
    be_->copy_device(wd_.get(), static_cast<const char*>(W) + size_t(o0) * in * es, size_t(rows) * in * es);
    be_->gemm(wd_.get(), in, false, static_cast<const char*>(B) + size_t(o0) * r * es, r, Op::N, A, in, Op::N, rows,
              in, r, scale_, 1.0f);
    if (t.row_parallel)
      be_->row_sum_squares(norm_.as<float>() + o0, wd_.get(), rows, in);  // this rank's columns of the rows
    else
      be_->row_norms(norm_.as<float>() + o0, wd_.get(), rows, in);
  }
  if (t.row_parallel) {
    // Row-parallel under TP: the group's partial squares summed, then the root.
    tp_->comm->all_reduce(norm_.as<float>(), out, ReduceOp::Sum);
    be_->sqrt_in_place(norm_.as<float>(), out);
  }
  if (norm_hold_ == NormHold::Record) {
    std::vector<float>& h = held_norms_[t.a_tensor];
    h.resize(size_t(out));
    be_->copy_to_host(h.data(), norm_.get(), size_t(out) * 4);
  }
}

void LoraAdapters::init_magnitudes(int layer, const void* base_unit, float* flat) {
  TR_CHECK(opt_.dora, "LoraAdapters::init_magnitudes on a LoRA adapter (a bug)");
  const size_t es = dtype_size(be_->act_dtype());
  for (const LoraTarget& t : targets_) {
    if (t.layer != layer) continue;
    const int in = int(t.in), out = int(t.out);
    const void* W = static_cast<const char*>(base_unit) + t.w_off * es;
    if (!tp_) {
      be_->row_norms(norm_.as<float>(), W, out, in);
      be_->copy_to_host(flat + layout_.tensors[size_t(t.m_tensor)].offset, norm_.get(), size_t(out) * 4);
      continue;
    }
    // Tensor parallelism: this rank's squares at their global places
    // (msq_), summed over the group by finish_magnitudes. A column target's
    // rows are whole here: written by their owner alone (a KV head's
    // replicas hold the same rows); a row-parallel one's are partial on
    // every rank, and every rank adds its part.
    if (msq_.empty()) msq_.assign(size_t(layout_.total), 0.0f);
    be_->row_sum_squares(norm_.as<float>(), W, out, in);
    std::vector<float> sq(static_cast<size_t>(out));
    be_->copy_to_host(sq.data(), norm_.get(), size_t(out) * 4);
    const ParamTensor& m = local_layout().tensors[size_t(t.m_tensor)];
    for (const TpRun& run : tp_plan_->runs_in(m.offset, m.numel)) {
      if (!t.row_parallel && !run.owner) continue;
      for (int64_t i = 0; i < run.count; ++i) msq_[size_t(run.global + i)] += sq[size_t(run.local - m.offset + i)];
    }
  }
}

void LoraAdapters::finish_magnitudes(float* flat) {
  if (!tp_ || !opt_.dora) return;
  TR_CHECK(!msq_.empty(), "LoraAdapters::finish_magnitudes before init_magnitudes (a bug)");
  // Summed on the device (a NCCL group reduces device memory), once at init.
  DeviceBuffer d(be_, msq_.size() * 4);
  be_->copy_to_device(d.get(), msq_.data(), msq_.size() * 4);
  tp_->comm->all_reduce(d.as<float>(), int64_t(msq_.size()), ReduceOp::Sum);
  be_->copy_to_host(msq_.data(), d.get(), msq_.size() * 4);
  for (const LoraTarget& t : targets_) {
    const ParamTensor& m = layout_.tensors[size_t(t.m_tensor)];
    for (int64_t i = m.offset; i < m.offset + m.numel; ++i) flat[i] = std::sqrt(msq_[size_t(i)]);
  }
  msq_.clear();
}

// The pieces forward and backward both compute (backward recomputes them:
// nothing is kept between the passes): the norm, dropout(x), xa = xd A^T,
// xba = xa B^T and xw = xd W^T, into norm_, xd_ (with dropout), xa_, xba_
// and xw_.
LoraAdapters::DoraPass LoraAdapters::dora_pass(const LoraTarget& t, const void* x, int N) {
  using Op = Backend::GemmOp;
  const size_t es = dtype_size(be_->act_dtype());
  DoraPass p;
  p.r = opt_.rank, p.in = int(t.in), p.out = int(t.out);
  p.A = unit_params_ + t.a_off * es;
  p.B = unit_params_ + t.b_off * es;
  p.m = unit_params_ + t.m_off * es;
  p.W = base_weight(t);
  dora_norms(t, p.W, p.A, p.B);
  p.xd = dropped(t, x, N);
  const int r = p.r, in = p.in, out = p.out;
  be_->gemm(xa_.get(), r, false, p.xd, in, Op::N, p.A, in, Op::T, N, r, in, 1.0f, 0.0f);        // xa = xd A^T
  be_->gemm(xba_.get(), out, false, xa_.get(), r, Op::N, p.B, r, Op::T, N, out, r, 1.0f, 0.0f);  // xba = xa B^T
  be_->gemm(xw_.get(), out, false, p.xd, in, Op::N, p.W, in, Op::T, N, out, in, 1.0f, 0.0f);     // xw = xd W^T (recomputed)
  return p;
}

void LoraAdapters::dora_forward(const LoraTarget& t, const void* x, void* ycols, int ldy, int N) {
  const DoraPass p = dora_pass(t, x, N);
  be_->dora_forward(ycols, ldy, xw_.get(), xba_.get(), p.m, norm_.as<float>(), scale_, N, p.out);
}

void LoraAdapters::dora_backward(const LoraTarget& t, const void* x, const void* dycols, int ldy, void* dx, int N) {
  using Op = Backend::GemmOp;
  float* dA = unit_grads_ + t.a_off;
  float* dB = unit_grads_ + t.b_off;
  float* dm = unit_grads_ + t.m_off;
  const DoraPass p = dora_pass(t, x, N);
  const int r = p.r, in = p.in, out = p.out;
  const void *A = p.A, *B = p.B, *m = p.m, *W = p.W, *xd = p.xd;
  // dm; then xw_ := dxw = (g - 1) dy and xba_ := dxba = g s dy.
  be_->dora_backward(dm, xw_.get(), xba_.get(), dycols, ldy, m, norm_.as<float>(), scale_, N, out);
  be_->gemm(dB, r, true, xba_.get(), out, Op::T, xa_.get(), r, Op::N, out, r, N, 1.0f, 1.0f);  // dB += dxba^T xa
  be_->gemm(dxa_.get(), r, false, xba_.get(), out, Op::N, B, r, Op::N, N, r, out, 1.0f, 0.0f);  // dxa = dxba B
  be_->gemm(dA, in, true, dxa_.get(), r, Op::T, xd, in, Op::N, r, in, N, 1.0f, 1.0f);         // dA += dxa^T xd
  if (!dropout_on()) {
    be_->gemm(dx, in, false, xw_.get(), out, Op::N, W, in, Op::N, N, in, out, 1.0f, 1.0f);    // dx += dxw W
    be_->gemm(dx, in, false, dxa_.get(), r, Op::N, A, in, Op::N, N, in, r, 1.0f, 1.0f);       // dx += dxa A
  } else {
    // d dropout(x) = dxw W + dxa A into the scratch (xd is consumed), through the same mask, added to dx.
    be_->gemm(xd_.get(), in, false, xw_.get(), out, Op::N, W, in, Op::N, N, in, out, 1.0f, 0.0f);
    be_->gemm(xd_.get(), in, false, dxa_.get(), r, Op::N, A, in, Op::N, N, in, r, 1.0f, 1.0f);
    be_->dropout_forward(xd_.get(), xd_.get(), N, in, float(opt_.dropout), target_seed(t), row0_, t.linear.in,
                         t.in_begin);
    be_->residual_forward(dx, dx, xd_.get(), int64_t(N) * in);
  }
}

}  // namespace trainrun
