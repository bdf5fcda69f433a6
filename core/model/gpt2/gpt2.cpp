// GPT-2 parameter layout, deterministic init, forward and backward over the
// Backend interface. No tensor memory is touched on the host here.
#include "core/model/gpt2/gpt2.h"

#include <algorithm>
#include <cmath>

#include "core/common/error.h"
#include "core/model/init_rng.h"
#include "core/model/tensor_parallel.h"

namespace trainrun {

ParamLayout make_gpt2_layout(const GPT2Config& cfg) {
  using S = ParamTensor::Split;
  const int64_t C = cfg.C, V = cfg.V, T = cfg.T;
  LayoutBuilder b;
  b.begin_unit("embeddings");
  b.add("transformer.wte.weight", {V, C}, true, S::Vocab);
  b.add("transformer.wpe.weight", {T, C}, true, S::Replicated);
  b.end_unit();
  for (int l = 0; l < cfg.L; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    b.begin_unit("block " + std::to_string(l));
    b.add(p + "ln_1.weight", {C}, false, S::Replicated);
    b.add(p + "ln_1.bias", {C}, false, S::Replicated);
    b.add(p + "attn.c_attn.weight", {3 * C, C}, true, S::Column, 3, cfg.NH);  // q | k | v, each split by heads
    b.add(p + "attn.c_attn.bias", {3 * C}, false, S::Column, 3, cfg.NH);
    b.add(p + "attn.c_proj.weight", {C, C}, true, S::Row, 1, cfg.NH);
    b.add(p + "attn.c_proj.bias", {C}, false, S::Replicated);
    b.add(p + "ln_2.weight", {C}, false, S::Replicated);
    b.add(p + "ln_2.bias", {C}, false, S::Replicated);
    b.add(p + "mlp.c_fc.weight", {4 * C, C}, true, S::Column);
    b.add(p + "mlp.c_fc.bias", {4 * C}, false, S::Column);
    b.add(p + "mlp.c_proj.weight", {C, 4 * C}, true, S::Row);
    b.add(p + "mlp.c_proj.bias", {C}, false, S::Replicated);
    b.end_unit();
  }
  b.begin_unit("head");
  b.add("transformer.ln_f.weight", {C}, false, S::Replicated);
  b.add("transformer.ln_f.bias", {C}, false, S::Replicated);
  b.end_unit();
  b.tie("lm_head.weight", "transformer.wte.weight");  // the LM head reuses wte
  return b.finish();
}

// ---- init ------------------------------------------------------------------------

void gpt2_init_params(const GPT2Config& cfg, const ParamLayout& layout, uint64_t seed, int64_t begin,
                      int64_t end, float* out) {
  // GPT-2 init: N(0, std) for matrices and embeddings, std/sqrt(2L) for the
  // two residual projections (keeps the residual stream's variance flat with
  // depth), zero biases, LayerNorm weight 1.
  const double resid_std = cfg.init_std / std::sqrt(2.0 * cfg.L);
  const uint64_t s = splitmix64(seed);
  for (const auto& t : layout.tensors) {
    int64_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.numel);
    if (lo >= hi) continue;
    const std::string& n = t.name;
    auto ends_with = [&](const char* suf) {
      size_t k = std::char_traits<char>::length(suf);
      return n.size() >= k && n.compare(n.size() - k, k, suf) == 0;
    };
    bool is_ln = n.find("ln_") != std::string::npos;
    for (int64_t i = lo; i < hi; ++i) {
      float v;
      if (is_ln) v = ends_with(".weight") ? 1.0f : 0.0f;
      else if (ends_with(".bias")) v = 0.0f;
      else if (ends_with("c_proj.weight")) v = float(resid_std * normal_at(s, uint64_t(i)));
      else v = float(cfg.init_std * normal_at(s, uint64_t(i)));
      out[i - begin] = v;
    }
  }
}

// ---- activations --------------------------------------------------------------------
GPT2::GPT2(const GPT2Config& cfg_in, Backend* be, int maxB, bool activation_checkpointing, const TensorParallel* tp,
           const PipelineStage* stage, const ContextParallel* cp)
    : cfg_(stage_config(cfg_in, stage)), layout_(make_gpt2_layout(cfg_)), stage_(stage ? *stage : PipelineStage{}),
      be_(be), maxB_(maxB), ckpt_(activation_checkpointing), tp_(tp && tp->plan ? tp : nullptr) {
  const GPT2Config& cfg = cfg_;
  TR_CHECK(cfg.L >= 1, "GPT2: a pipeline stage needs at least one block (a bug)");
  TR_CHECK(cfg.C % cfg.NH == 0, "model.n_embd (", cfg.C, ") must be divisible by model.n_head (", cfg.NH, ")");
  NH_ = cfg.NH;
  F_ = 4 * cfg.C;
  VL_ = v_valid_ = cfg.V;
  if (tp_) {
    const TpLocalShape& s = tp_->plan->shape();
    NH_ = s.NH;
    F_ = s.F;
    VL_ = s.V_local;
    v_begin_ = s.v_begin;
    v_valid_ = s.v_valid;
    adds_row_bias_ = s.rank == 0;
    sp_ = tp_->sequence_parallel && s.tp > 1;
    layout_ = tp_->plan->local_layout();
  }
  Q_ = NH_ * cfg.head_size();
  if (cp && cp->size() > 1) {
    check_context_parallel_model(cfg, *cp);
    cpa_ = std::make_unique<CpAttention>(*be, *cp, maxB, cfg.T, NH_, NH_, cfg.head_size());
  }
  const size_t es = dtype_size(be->act_dtype());
  // Context parallelism: this rank's T / cp rows of each sequence.
  const int64_t rows_per_seq = cpa_ ? cpa_->local_rows() : cfg.T;
  const int64_t N = int64_t(maxB) * rows_per_seq, C = cfg.C, Q = Q_, F = F_;
  // Sequence parallelism: the residual stream, the LayerNorms' outputs and
  // statistics and the residual gradient hold this rank's 1/T of the rows.
  // A column layer reads its LayerNorm output all-gathered into the shared
  // (N, C) buffer (forward, and again for its weight gradient in backward,
  // as Megatron does), so no (N, C) activation is kept per layer.
  const int64_t NR = sp_ ? (N + tp_->plan->size() - 1) / tp_->plan->size() : N;
  // One arena; every buffer starts on a 64-byte boundary. The transient
  // buffers (arena_plan.h) hold nothing a later call reads: the recompute
  // set under checkpointing is refilled before each block's backward, the
  // rest is backward and collective scratch.
  shared_ = stage_.shared_scratch;
  ArenaPlan& plan = plan_;
  auto req = [&](void* slot, size_t bytes) { plan.add(static_cast<void**>(slot), bytes); };
  auto tmp = [&](void* slot, size_t bytes) { plan.add_transient(static_cast<void**>(slot), bytes); };
  req(&encoded_, NR * C * es);  // the stage's input: received asynchronously
  res3_.assign(cfg.L, nullptr);
  for (int l = 0; l < cfg.L; ++l) req(&res3_[l], NR * C * es);
  layers_.resize(ckpt_ ? 1 : cfg.L);
  auto layer_buf = [&](void* slot, size_t bytes) { ckpt_ ? tmp(slot, bytes) : req(slot, bytes); };
  for (auto& a : layers_) {
    layer_buf(&a.ln1, NR * C * es);
    layer_buf(&a.ln1_mean, NR * 4);
    layer_buf(&a.ln1_rstd, NR * 4);
    layer_buf(&a.qkv, N * 3 * Q * es);
    layer_buf(&a.atty, N * Q * es);
    layer_buf(&a.att, (cpa_ ? CpAttention::saved_floats(maxB, cfg.T, cp->size(), NH_)
                            : be->attention_saved_floats(maxB, cfg.T, NH_)) * 4);
    layer_buf(&a.res2, NR * C * es);
    layer_buf(&a.ln2, NR * C * es);
    layer_buf(&a.ln2_mean, NR * 4);
    layer_buf(&a.ln2_rstd, NR * 4);
    layer_buf(&a.fch, N * F * es);
    layer_buf(&a.fch_gelu, N * F * es);
  }
  ldv_ = be->logits_stride(VL_);  // rows padded on the GPU (kernels/backend.h)
  if (stage_.last) {  // a pipeline stage before the last has no head: no logits
    req(&lnf_, NR * C * es);
    req(&lnf_mean_, NR * 4);
    req(&lnf_rstd_, NR * 4);
    req(&logits_, N * ldv_ * es);  // dlogits from forward to backward
    req(&losses_, N * 4);
  }
  if (tp_ && stage_.last) {
    req(&ce_rowmax_, N * 4);
    req(&ce_stats_, 2 * N * 4);
  }
  req(&dres_, NR * C * es);  // the stage's output gradient in, input gradient out (sent asynchronously)
  if (sp_) {
    tmp(&sp_rows_, NR * C * es);
    tmp(&dres_full_, N * C * es);
    tmp(&norm_grad_, 2 * C * 4);
  }
  tmp(&dbuf_c_, N * C * es);
  tmp(&dbuf_3c_, N * 3 * Q * es);
  tmp(&dbuf_4c_, N * F * es);
  if (stage_.split_backward) {
    TR_CHECK(!ckpt_, "parallel.pipeline_schedule: zero_bubble with train.activation_checkpointing: blocks is not "
                     "supported (the weight step needs every block's inputs); use 1f1b or turn checkpointing off");
    kept_.resize(cfg.L);
    for (auto& k : kept_) {  // from backward_input to backward_weight
      req(&k.d_fcproj, N * C * es);
      req(&k.d_fc, N * F * es);
      req(&k.d_attproj, N * C * es);
      req(&k.d_qkv, N * 3 * Q * es);
    }
  }
  arena_ = shared_ ? plan.allocate_kept(be) : plan.allocate(be);
  act_bytes_ = shared_ ? plan.kept_total() : plan.total;
  tpc_.tp = tp_;
  tpc_.be = be;
  tpc_.C = cfg.C;
  tpc_.sp = sp_;
  tpc_.norm_len = 2 * cfg.C;  // weight | bias: adjacent in every LayerNorm of the layout
  wire_scratch();
}

void GPT2::wire_scratch() {
  tpc_.rows_buf = sp_rows_;
  tpc_.full_buf = dres_full_;
  tpc_.norm_buf = norm_grad_;
}

GPT2::~GPT2() = default;

size_t GPT2::activation_bytes() const { return act_bytes_ + (cpa_ ? cpa_->workspace_bytes() : 0); }

void GPT2::bind_transient(void* scratch) {
  TR_CHECK(shared_ && scratch, "GPT2: bind_transient needs a stage built with shared_scratch and a buffer (a bug)");
  plan_.bind_transient(scratch);
  wire_scratch();
  bound_ = true;
}

// Pointers into one block unit's parameters (act dtype) or gradients (fp32).
namespace {
template <typename P>
struct BlockPtrs {
  P ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
};
template <typename P, typename Base>
BlockPtrs<P> block_ptrs(Base base, const GPT2BlockOffsets& o, size_t esize) {
  auto at = [&](int64_t off) { return reinterpret_cast<P>(reinterpret_cast<uintptr_t>(base) + off * esize); };
  return {at(o.ln1w), at(o.ln1b), at(o.qkvw), at(o.qkvb), at(o.attprojw), at(o.attprojb),
          at(o.ln2w), at(o.ln2b), at(o.fcw), at(o.fcb), at(o.fcprojw), at(o.fcprojb)};
}
}  // namespace

// The block from its qkv projection to the MLP's output projection. On entry
// acts(l).ln1 holds ln1(res_in) (the caller fuses it with the previous
// block's residual add); on exit dbuf_c_ holds the MLP output, whose residual
// add the caller fuses with the next LayerNorm (the next block's ln1, or lnf).
//
// Tensor parallelism: qkv and fc are this rank's columns (whole heads),
// attn.c_proj and mlp.c_proj give partial sums that are all-reduced; their
// (replicated) biases are added once, by TP rank 0, into its partial sum.
void GPT2::block_forward(const void* p, int l, const void* res_in, int B, int T) {
  const int N = B * T, C = cfg_.C, Q = Q_, F = F_;
  auto w = block_ptrs<const void*>(p, GPT2BlockOffsets(C, Q, F), dtype_size(be_->act_dtype()));
  LayerActs& a = acts(l);
  const int gl = stage_.first_layer + l;  // adapters are numbered by the global layer
  const void* x_qkv = tpc_.full_rows(a.ln1, N);
  be_->matmul_forward(a.qkv, x_qkv, w.qkvw, w.qkvb, N, C, 3 * Q);
  if (ad_) ad_->forward(gl, 0, x_qkv, a.qkv, 3 * Q, N);
  if (cpa_)
    cpa_->forward(a.atty, a.att, a.qkv);
  else
    be_->attention_forward(a.atty, a.att, a.qkv, B, T, Q, NH_, docs_.doc_start);
  be_->matmul_forward(dbuf_c_, a.atty, w.attprojw, adds_row_bias_ ? w.attprojb : nullptr, N, Q, C);
  if (ad_) ad_->forward(gl, 1, a.atty, dbuf_c_, C, N);
  const void* attn_out = tpc_.reduce_out(dbuf_c_, N);
  be_->residual_layernorm_forward(a.res2, a.ln2, a.ln2_mean, a.ln2_rstd, res_in, attn_out, w.ln2w,
                                  w.ln2b, tpc_.rows(N), C);
  const void* x_fc = tpc_.full_rows(a.ln2, N);
  be_->matmul_gelu_forward(a.fch_gelu, a.fch, x_fc, w.fcw, w.fcb, N, C, F);
  if (ad_) {
    // An adapter on c_fc adds to the pre-activation: the GELU is applied
    // again over the sum (the fused GEMM's output is overwritten).
    ad_->forward(gl, 2, x_fc, a.fch, F, N);
    be_->gelu_forward(a.fch_gelu, a.fch, int64_t(N) * F);
  }
  be_->matmul_forward(dbuf_c_, a.fch_gelu, w.fcprojw, adds_row_bias_ ? w.fcprojb : nullptr, N, F, C);
  if (ad_) ad_->forward(gl, 3, a.fch_gelu, dbuf_c_, C, N);
  (void)tpc_.reduce_out(dbuf_c_, N);  // -> mlp_out()
}

void GPT2::tp_sum(void* buf, int64_t n) {
  if (tp_) tp_->all_reduce(buf, n, be_->act_dtype());
}

void GPT2::forward(UnitAccess& units, const int32_t* inputs, const int32_t* targets, int B, int T,
                   bool for_backward, float dloss_scale, DocumentMask docs) {
  TR_CHECK(B >= 1 && B <= maxB_ && T >= 1 && T <= cfg_.T, "model.forward: batch (", B, ",", T,
           ") exceeds the buffers (", maxB_, ",", cfg_.T, ")");
  TR_CHECK(!cpa_ || T == cpa_->local_rows(), "model.forward: under context parallelism T is this rank's ",
           cpa_ ? cpa_->local_rows() : 0, " rows per sequence, not ", T, " (a bug)");
  TR_CHECK(!for_backward || targets || !stage_.last, "model.forward: for_backward needs targets");
  TR_CHECK(!shared_ || bound_, "GPT2: a shared_scratch stage computed before bind_transient (a bug)");
  B_ = B;
  T_ = T;
  inputs_ = inputs;
  docs_ = cpa_ ? cpa_->begin_batch(B, docs) : docs;
  ad_ = units.adapters();
  frozen_ = units.base_frozen();
  const int N = B * T, C = cfg_.C, L = cfg_.L;
  const size_t es = dtype_size(be_->act_dtype());
  TR_CHECK(!sp_ || N % tp_->plan->size() == 0, "parallel.sequence_parallel: the micro-batch's ", N,
           " tokens (train.micro_batch_size x model.seq_len) do not split over parallel.tensor_parallel (",
           tp_ ? tp_->plan->size() : 1, "); make micro_batch_size x seq_len a multiple of it");
  const int NR = tpc_.rows(N);

  units.begin_pass(false, for_backward);
  // A pipeline stage after the first finds its input at stage_input() (encoded_).
  if (stage_.first) embed(units, inputs, B, T);

  // Residual stream: res3_[l] = res2 + mlp(ln2(res2)) of block l. Its add is
  // fused with the LayerNorm that reads it next: block l+1's ln1, or lnf.
  const GPT2BlockOffsets off(C, Q_, F_);
  for (int l = 0; l < L; ++l) {
    const void* p = units.acquire_params(1 + l);
    if (ad_) ad_->begin_block(stage_.first_layer + l, false);
    auto w = block_ptrs<const void*>(p, off, es);
    LayerActs& a = acts(l);
    if (l == 0)
      be_->layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, encoded_, w.ln1w, w.ln1b, NR, C);
    else
      be_->residual_layernorm_forward(res3_[l - 1], a.ln1, a.ln1_mean, a.ln1_rstd, acts(l - 1).res2,
                                      mlp_out(), w.ln1w, w.ln1b, NR, C);
    block_forward(p, l, l == 0 ? encoded_ : res3_[l - 1], B, T);
    if (ad_) ad_->end_block(stage_.first_layer + l, false);
    units.release_params(1 + l);
  }
  if (!stage_.last) {
    // The stage's output (stage_output()): the residual add no LayerNorm follows here.
    be_->residual_forward(res3_[L - 1], acts(L - 1).res2, mlp_out(), int64_t(NR) * C);
    return;
  }
  head_forward(units, targets, N, for_backward, dloss_scale);
}

void GPT2::embed(UnitAccess& units, const int32_t* inputs, int B, int T) {
  const int N = B * T, C = cfg_.C, NR = tpc_.rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  const char* emb = static_cast<const char*>(units.acquire_params(0));
  const void* wte = emb;
  const void* wpe = emb + int64_t(VL_) * C * es;
  if (tp_) {
    // Vocab-parallel: this rank's rows (zeros for the others' tokens), the
    // positions added by rank 0, summed over the group.
    if (sp_) {
      be_->vocab_embedding_forward(dbuf_c_, inputs, wte, adds_row_bias_ ? wpe : nullptr, v_begin_, v_valid_, B, T, C,
                                   docs_.pos);
      be_->copy_device(encoded_, tpc_.reduce_out(dbuf_c_, N), size_t(NR) * C * es);
    } else {
      be_->vocab_embedding_forward(encoded_, inputs, wte, adds_row_bias_ ? wpe : nullptr, v_begin_, v_valid_, B, T,
                                   C, docs_.pos);
      tp_sum(encoded_, int64_t(N) * C);
    }
  } else {
    be_->encoder_forward(encoded_, inputs, wte, wpe, B, T, C, docs_.pos);
  }
  units.release_params(0);
}

void GPT2::head_forward(UnitAccess& units, const int32_t* targets, int N, bool for_backward, float dloss_scale) {
  const int C = cfg_.C, L = cfg_.L, NR = tpc_.rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  const char* emb = nullptr;
  const char* head = static_cast<const char*>(units.acquire_params(L + 1));
  be_->residual_layernorm_forward(res3_[L - 1], lnf_, lnf_mean_, lnf_rstd_, acts(L - 1).res2,
                                  mlp_out(), head, head + C * es, NR, C);
  units.release_params(L + 1);
  emb = static_cast<const char*>(units.acquire_params(0));  // tied LM head
  be_->lm_head_forward(logits_, tpc_.full_rows(lnf_, N), emb, N, C, v_valid_, ldv_);
  units.release_params(0);
  if (!targets) return;
  void* dlogits = for_backward ? logits_ : nullptr;
  if (!tp_) {
    be_->softmax_cross_entropy(losses_, dlogits, logits_, targets, N, cfg_.V, ldv_, dloss_scale);
    return;
  }
  // Vocab-parallel cross-entropy: the row max and the sum of exponentials
  // (and the target's logit, from its owner) are all-reduced; the logits
  // are never gathered.
  tpc_.vocab_cross_entropy(losses_, dlogits, logits_, targets, ce_rowmax_, ce_stats_, v_begin_, N, v_valid_, ldv_,
                           dloss_scale);
}

// Backward through one block. On entry dres holds dL/d(block output); on
// exit dL/d(block input). Parameter grads accumulate into g.
// Tensor parallelism: the replicated biases' gradients come from the same
// (all-reduced) dres on every rank, so the replicas stay equal; the input
// gradients of the column layers (fc, qkv) are all-reduced.
void GPT2::block_backward(const void* p, float* g, int l, const void* res_in, void* dres, int B, int T,
                          const KeptGrads* keep) {
  const int N = B * T, C = cfg_.C, Q = Q_, F = F_, NR = tpc_.rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  const GPT2BlockOffsets off(C, Q, F);
  auto w = block_ptrs<const void*>(p, off, es);
  auto dw = block_ptrs<float*>(g, off, 4);
  LayerActs& a = acts(l);
  // zero_bubble's input step: no weight/bias gradients here (null skips
  // them), their output gradients kept for block_weight_grads.
  // A frozen base (adapters): no weight/bias gradients for its linears either.
  auto W = [&](float* x) { return keep || frozen_ ? nullptr : x; };
  const int gl = stage_.first_layer + l;
  auto kept = [&](void* dst, const void* src, int64_t n) {
    if (keep && !frozen_) be_->copy_device(dst, src, size_t(n) * es);  // a frozen base: backward_weight needs none
  };
  // MLP: res_out = res2 + fcproj(gelu(fc(ln2(res2))))
  const void* dmlp = tpc_.full_rows(dres, N);
  if (keep) kept(keep->d_fcproj, dmlp, int64_t(N) * C);
  if (ad_) {
    // Adapters: d gelu-output = the base's + the adapter's, then the GELU's
    // backward (the fused dgelu GEMM would apply it to the base's share only).
    be_->matmul_backward(dbuf_4c_, W(dw.fcprojw), W(dw.fcprojb), dmlp, a.fch_gelu, w.fcprojw, N, F, C);
    ad_->backward(gl, 3, a.fch_gelu, dmlp, C, dbuf_4c_, N);
    be_->gelu_backward(dbuf_4c_, a.fch, dbuf_4c_, int64_t(N) * F);
  } else {
    be_->matmul_backward_dgelu(dbuf_4c_, W(dw.fcprojw), W(dw.fcprojb), dmlp, a.fch_gelu, w.fcprojw, a.fch, N, F, C);
  }
  if (keep) kept(keep->d_fc, dbuf_4c_, int64_t(N) * F);
  // (full_rows: dres's gathered copy is consumed; the buffer takes ln2's.)
  const void* x_fc = tpc_.full_rows(a.ln2, N);
  be_->matmul_backward(dbuf_c_, W(dw.fcw), W(dw.fcb), dbuf_4c_, x_fc, w.fcw, N, C, F);
  if (ad_) ad_->backward(gl, 2, x_fc, dbuf_4c_, F, dbuf_c_, N);
  const void* dln2 = tpc_.reduce_out(dbuf_c_, N);
  float* g2 = tpc_.norm_grad(dw.ln2w);  // ln2w | ln2b (adjacent)
  be_->layernorm_backward(dres, g2, g2 + C, dln2, a.res2, w.ln2w, a.ln2_mean, a.ln2_rstd, NR, C);
  tpc_.norm_grad_done(dw.ln2w);
  // Attention: res2 = res_in + attproj(attn(qkv(ln1(res_in))))
  const void* dattn = tpc_.full_rows(dres, N);
  if (keep) kept(keep->d_attproj, dattn, int64_t(N) * C);
  be_->matmul_backward(dbuf_c_, W(dw.attprojw), W(dw.attprojb), dattn, a.atty, w.attprojw, N, Q, C);
  if (ad_) ad_->backward(gl, 1, a.atty, dattn, C, dbuf_c_, N);
  if (cpa_)
    cpa_->backward(dbuf_3c_, dbuf_c_, a.qkv, a.atty, a.att);
  else
    be_->attention_backward(dbuf_3c_, dbuf_c_, a.qkv, a.atty, a.att, B, T, Q, NH_, docs_.doc_start);
  if (keep) kept(keep->d_qkv, dbuf_3c_, int64_t(N) * 3 * Q);
  const void* x_qkv = tpc_.full_rows(a.ln1, N);
  be_->matmul_backward(dbuf_c_, W(dw.qkvw), W(dw.qkvb), dbuf_3c_, x_qkv, w.qkvw, N, C, 3 * Q);
  if (ad_) ad_->backward(gl, 0, x_qkv, dbuf_3c_, 3 * Q, dbuf_c_, N);
  const void* dln1 = tpc_.reduce_out(dbuf_c_, N);
  float* g1 = tpc_.norm_grad(dw.ln1w);  // ln1w | ln1b
  be_->layernorm_backward(dres, g1, g1 + C, dln1, res_in, w.ln1w, a.ln1_mean, a.ln1_rstd, NR, C);
  tpc_.norm_grad_done(dw.ln1w);
}

// zero_bubble's weight step: dW += dout^T inp, db += sum dout of the four
// linears, from the output gradients the input step kept and the layer's
// saved inputs (the same operands backward() gives the fused op).
void GPT2::block_weight_grads(float* g, int l, const KeptGrads& k, int N) {
  const int C = cfg_.C, Q = Q_, F = F_;
  auto dw = block_ptrs<float*>(g, GPT2BlockOffsets(C, Q, F), 4);
  const LayerActs& a = layers_[size_t(l)];
  be_->matmul_backward(nullptr, dw.fcprojw, dw.fcprojb, k.d_fcproj, a.fch_gelu, nullptr, N, F, C);
  // The LayerNorm outputs are this rank's rows under sequence parallelism: gathered again here.
  be_->matmul_backward(nullptr, dw.fcw, dw.fcb, k.d_fc, tpc_.full_rows(a.ln2, N), nullptr, N, C, F);
  be_->matmul_backward(nullptr, dw.attprojw, dw.attprojb, k.d_attproj, a.atty, nullptr, N, Q, C);
  be_->matmul_backward(nullptr, dw.qkvw, dw.qkvb, k.d_qkv, tpc_.full_rows(a.ln1, N), nullptr, N, C, 3 * Q);
}

void GPT2::backward(UnitAccess& units) { backward_pass(units, false); }

void GPT2::backward_input(UnitAccess& units) {
  TR_CHECK(stage_.split_backward, "GPT2: backward_input needs a stage built with split_backward (a bug)");
  backward_pass(units, true);
}

void GPT2::backward_weight(UnitAccess& units) {
  TR_CHECK(stage_.split_backward, "GPT2: backward_weight needs a stage built with split_backward (a bug)");
  // A frozen base (model.adapter) has no weight gradients; the adapters'
  // own ran with backward_input (adapter_pipeline.h), so none runs here.
  const bool frozen = units.base_frozen();
  for (int l = cfg_.L - 1; l >= 0; --l) {
    if (!frozen) block_weight_grads(units.unit_grads(1 + l), l, kept_[size_t(l)], B_ * T_);
    units.grads_done(1 + l);
  }
}

void GPT2::backward_pass(UnitAccess& units, bool input_only) {
  const int B = B_, T = T_, N = B * T, C = cfg_.C, L = cfg_.L, NR = tpc_.rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  units.begin_pass(true, false);
  ad_ = units.adapters();
  frozen_ = units.base_frozen();
  // logits_ now holds dlogits (see forward). Tied head: grads land in the
  // embedding unit's wte gradient, which stays open until the encoder's turn.
  // A pipeline stage before the last starts from the caller's dL/d output
  // in dres_ (stage_output_grad()).
  float* gemb = nullptr;
  if (stage_.last) {
    const void* emb = units.acquire_params(0);
    gemb = units.unit_grads(0);
    // A frozen base (adapters) needs only the input gradient: the tied
    // head's weight gradient, a (V, C) GEMM, would be thrown away.
    be_->lm_head_backward(dbuf_c_, frozen_ ? nullptr : gemb, logits_, tpc_.full_rows(lnf_, N), emb, N, C, v_valid_,
                          ldv_);
    units.release_params(0);
    const void* dlnf = tpc_.reduce_out(dbuf_c_, N);  // the head is column-parallel over the vocabulary

    const char* head = static_cast<const char*>(units.acquire_params(L + 1));
    float* ghead = units.unit_grads(L + 1);
    be_->zero(dres_, size_t(NR) * C * es);
    float* gf = tpc_.norm_grad(ghead);  // lnfw | lnfb
    be_->layernorm_backward(dres_, gf, gf + C, dlnf, res3_[L - 1], head, lnf_mean_, lnf_rstd_, NR, C);
    tpc_.norm_grad_done(ghead);
    units.release_params(L + 1);
    units.grads_done(L + 1);
  }

  for (int l = L - 1; l >= 0; --l) {
    const void* p = units.acquire_params(1 + l);
    if (ad_) ad_->begin_block(stage_.first_layer + l, true);  // before the recompute, which reads the adapters
    const void* res_in = l == 0 ? encoded_ : res3_[l - 1];
    // Activation checkpointing: only block outputs (res3_) were kept; rerun
    // this block's forward (from its ln1) to refill the shared per-layer
    // scratch. The recompute ends in dbuf_c_, which backward overwrites
    // before reading, so the checkpoints stay untouched.
    if (ckpt_) {
      auto w = block_ptrs<const void*>(p, GPT2BlockOffsets(C, Q_, F_), es);
      LayerActs& a = acts(l);
      be_->layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, res_in, w.ln1w, w.ln1b, NR, C);
      block_forward(p, l, res_in, B, T);
    }
    block_backward(p, units.unit_grads(1 + l), l, res_in, dres_, B, T, input_only ? &kept_[size_t(l)] : nullptr);
    if (ad_) ad_->end_block(stage_.first_layer + l, true);
    units.release_params(1 + l);
    if (!input_only) units.grads_done(1 + l);  // else after backward_weight
  }

  // A pipeline stage after the first leaves dL/d input in dres_ (stage_input_grad()).
  if (stage_.first) {
    if (!gemb) gemb = units.unit_grads(0);
    if (frozen_) {
      // A frozen base: the embedding's gradient would be thrown away.
    } else if (tp_) {
      be_->vocab_embedding_backward(gemb, gemb + int64_t(VL_) * C, tpc_.full_rows(dres_, N), inputs_, v_begin_,
                                    v_valid_, B, T, C, docs_.pos);
    } else {
      be_->encoder_backward(gemb, gemb + int64_t(cfg_.V) * C, dres_, inputs_, B, T, C, docs_.pos);
    }
  }
  if (gemb) units.grads_done(0);
}

}  // namespace trainrun
