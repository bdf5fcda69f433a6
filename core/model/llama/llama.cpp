// Llama's forward and backward over the Backend interface (llama.h). No
// tensor memory is touched on the host here, except the RoPE table's upload.
#include "core/model/llama/llama.h"

#include <algorithm>
#include <cmath>

#include "core/common/error.h"
#include "core/model/moe/moe_mlp.h"
#include "core/model/tensor_parallel.h"

namespace trainrun {

LlamaNetwork::LlamaNetwork(const ModelConfig& cfg, const ParamLayout& layout, Backend* be, int maxB,
                           bool activation_checkpointing, const TensorParallel* tp, const PipelineStage* stage,
                           const ContextParallel* cp, const ExpertParallel* ep)
    : cfg_(stage_config(cfg, stage)), stage_(stage ? *stage : PipelineStage{}), be_(be), maxB_(maxB), ckpt_(activation_checkpointing), tp_(tp && tp->plan ? tp : nullptr) {
  TR_CHECK(cfg.NKV > 0 && cfg.F > 0, "LlamaNetwork needs a Llama-shaped arch's resolved config (a bug)");
  TR_CHECK(maxB >= 1, "LlamaNetwork: micro-batch ", maxB, " must be >= 1");
  TR_CHECK(cfg_.L >= 1, "LlamaNetwork: a pipeline stage needs at least one block (a bug)");
  HS_ = cfg.head_size();
  NH_ = cfg.NH;
  NKV_ = cfg.NKV;
  NKV_global_ = cfg.NKV;
  F_ = cfg.F;
  VL_ = v_valid_ = cfg.V;
  const ParamLayout* lay = &layout;
  if (tp_) {
    // This rank's heads, MLP columns and vocabulary rows (tensor_parallel.h).
    const TpLocalShape& s = tp_->plan->shape();
    NH_ = s.NH;
    NKV_ = s.NKV;
    F_ = s.F;
    VL_ = s.V_local;
    v_begin_ = s.v_begin;
    v_valid_ = s.v_valid;
    kv_replicas_ = s.kv_replicas;
    kv_head_ = s.rank / s.kv_replicas;
    lay = &tp_->plan->local_layout();
    sp_ = tp_->sequence_parallel && s.tp > 1;
  }
  Q_ = NH_ * HS_;
  KV_ = NKV_ * HS_;
  QKV_ = Q_ + 2 * KV_;
  QN_ = cfg.qk_norm ? HS_ : 0;
  eps_ = float(cfg.norm_eps);
  // Gemma 2's maths (ModelConfig). What is not implemented yet is refused by name.
  wo_ = cfg.norm_offset ? 1.f : 0.f;
  TR_CHECK(cfg.mlp_act == "silu" || cfg.mlp_act == "gelu_tanh", "LlamaNetwork: MLP activation '", cfg.mlp_act,
           "' is not one of silu, gelu_tanh");
  // HF casts the normaliser sqrt(C) to the activation dtype (scale_act does).
  if (cfg.embed_scale) embed_scale_ = float(std::sqrt(double(cfg.C)));
  TR_CHECK(!ep || cfg.moe.on(), "parallel.expert_parallel: model.arch ", cfg.arch,
           " has a dense MLP, no experts to split; set expert_parallel to 1");
  if (cfg.moe.on()) {
    // What the MoE MLP does not compose with yet is refused by name (issue #28's later steps).
    // Tensor parallelism splits the attention; the experts are replicated
    // (every TP rank routes and computes the whole MoE MLP on the same rows,
    // so its output and input gradient need no reduction). Sequence
    // parallelism would hand the MLP 1/T of the rows: not yet.
    TR_CHECK(!sp_, "model: a mixture of experts (", cfg.arch, ") with parallel.sequence_parallel is not implemented "
                   "yet; turn sequence_parallel off (the experts are replicated over tensor parallelism)");
    // The router losses couple every layer's counts (the aux loss is
    // E sum_e f_e P_e over the tokens of all layers: it does not split into
    // per-stage sums). Under a pipeline each stage carries the running
    // statistics (2E+1 fp32: counts, probability sums, the z sum) forward
    // in the tail of its activation message, the last stage computes the
    // losses, and the E-value aux gradient rides back in the tail of the
    // gradient message (router_carry_bytes_; a middle stage passes it on
    // untouched, since its backward writes only the rows before it).
    if (stage && !(stage->first && stage->last) && (cfg.moe.aux_loss_coef != 0 || cfg.moe.z_loss_coef != 0)) {
      const size_t es = dtype_size(be->act_dtype());
      router_carry_bytes_ = (size_t(2 * cfg.moe.n_experts + 1) * 4 + es - 1) / es * es;
    }
    TR_CHECK(!(stage && stage->split_backward), "parallel.pipeline_schedule: zero_bubble with a mixture of experts "
                                                 "is not implemented yet; use 1f1b");
    // Expert parallelism: alone for now (the job spec refuses the rest by name).
    // With tensor parallelism the experts stay whole on every TP rank (the
    // TP ranks of a dp index route the same rows; each exchanges them in
    // its own ep group).
    TR_CHECK(!ep || !(cp && cp->comm), "model: parallel.expert_parallel with context parallelism is not "
                                       "implemented yet (a bug: the job spec refuses it)");
    moe_elems_ = MoeOffsets(cfg.C, cfg.moe, ep && ep->split_storage ? cfg.moe.n_experts / ep->size() : -1).total;
  }
  if (!cfg.tied) {
    const ParamTensor& h = lay->get("lm_head.weight");
    lm_head_off_ = h.offset - lay->units[h.unit].offset;
  }
  shared_ = stage_.shared_scratch;
  if (cp && cp->size() > 1) {  // parallel/context/cp_attention.h: T / cp rows per sequence here
    check_context_parallel_model(cfg, *cp);
    cpa_ = std::make_unique<CpAttention>(*be, *cp, maxB, cfg.T, NH_, NKV_, HS_);
  }
  const size_t es = dtype_size(be->act_dtype());
  const int64_t T = cfg.T, N = int64_t(maxB) * (cpa_ ? cpa_->local_rows() : T), C = cfg.C, F = F_;
  // Sequence parallelism: the residual stream, the norms' outputs and
  // statistics and the residual gradient hold this rank's 1/T of the rows.
  // A column layer reads its norm output all-gathered into dres_full_
  // (forward, and again for its weight gradient in backward, as Megatron
  // does), so no (N, C) activation is kept per layer.
  const int64_t NR = sp_ ? (N + tp_->plan->size() - 1) / tp_->plan->size() : N;
  // One arena, every buffer on a 64-byte boundary; LlamaArch::activation_bytes
  // adds up the same list. The transient buffers (arena_plan.h) hold
  // nothing a later call reads: the recompute set under checkpointing is refilled before each block's
  // backward, the rest is backward and collective scratch.
  ArenaPlan& plan = plan_;
  auto req = [&](void* slot, size_t bytes) { plan.add(static_cast<void**>(slot), bytes); };
  auto tmp = [&](void* slot, size_t bytes) { plan.add_transient(static_cast<void**>(slot), bytes); };
  req(&rope_, size_t(T) * HS_ * 4);  // (T, HS/2, 2) fp32, uploaded once below
  req(&encoded_, NR * C * es + router_carry_bytes_);  // the stage's input: received asynchronously
  res3_.assign(cfg_.L, nullptr);
  for (int l = 0; l < cfg_.L; ++l) req(&res3_[l], NR * C * es + (l == cfg_.L - 1 ? router_carry_bytes_ : 0));
  layers_.resize(ckpt_ ? 1 : cfg_.L);
  // Checkpointing: the one set is rewritten by each block's recompute
  // before its backward reads it, so nothing in it outlives a call.
  auto layer_buf = [&](void* slot, size_t bytes) { ckpt_ ? tmp(slot, bytes) : req(slot, bytes); };
  for (auto& a : layers_) {
    layer_buf(&a.ln1, NR * C * es);
    layer_buf(&a.ln1_rstd, NR * 4);
    layer_buf(&a.qkv, N * QKV_ * es);
    a.qk_pre = nullptr;
    a.qk_rstd = nullptr;
    if (QN_) {
      layer_buf(&a.qk_pre, N * (Q_ + KV_) * es);
      layer_buf(&a.qk_rstd, N * (NH_ + NKV_) * 4);
    }
    layer_buf(&a.atty, N * Q_ * es);
    layer_buf(&a.att, (cpa_ ? CpAttention::saved_floats(maxB, cfg.T, cp->size(), NH_)
                            : be->attention_gqa_saved_floats(maxB, cfg.T, NH_)) * 4);
    layer_buf(&a.res2, NR * C * es);
    layer_buf(&a.ln2, NR * C * es);
    layer_buf(&a.ln2_rstd, NR * 4);
    if (!moe_elems_) {  // the MoE MLP keeps its own (below)
      layer_buf(&a.gu, N * 2 * F * es);
      layer_buf(&a.h, N * F * es);
    }
    if (cfg.post_norms) {
      layer_buf(&a.ao, NR * C * es);
      layer_buf(&a.ao_rstd, NR * 4);
      layer_buf(&a.mo, NR * C * es);
      layer_buf(&a.mo_rstd, NR * 4);
    }
  }
  ldv_ = be->logits_stride(VL_);
  if (stage_.last) {  // a pipeline stage before the last has no head: no logits
    req(&lnf_, NR * C * es);
    req(&lnf_rstd_, NR * 4);
    req(&logits_, N * ldv_ * es);  // dlogits from forward to backward
    req(&losses_, N * 4);
  }
  if (tp_ && stage_.last) {
    req(&ce_rowmax_, N * 4);
    req(&ce_stats_, 2 * N * 4);
  }
  req(&dres_, NR * C * es + router_carry_bytes_);  // the stage's output gradient in, input gradient out (sent asynchronously)
  if (sp_) {
    tmp(&sp_rows_, NR * C * es);
    tmp(&dres_full_, N * C * es);
    tmp(&norm_grad_, C * 4);
  }
  // (N, C) gradients, and the attention output's (N, Q) one: Q > C with head_dim set.
  tmp(&dbuf_c_, N * std::max<int64_t>(C, Q_) * es);
  tmp(&dqkv_, N * QKV_ * es);
  if (!moe_elems_) tmp(&dh_, N * F * es);
  if (cfg.post_norms) tmp(&dpost_, NR * C * es);
  if (QN_ && tp_) tmp(&qk_grad_, 2 * size_t(QN_) * 4);
  if (stage_.split_backward) {
    TR_CHECK(!ckpt_, "parallel.pipeline_schedule: zero_bubble with train.activation_checkpointing: blocks is not "
                     "supported (the weight step needs every block's inputs); use 1f1b or turn checkpointing off");
    kept_.resize(cfg_.L);
    for (auto& k : kept_) {  // from backward_input to backward_weight
      req(&k.d_down, N * C * es);
      req(&k.d_o, N * C * es);
      req(&k.d_qkv, N * QKV_ * es);
    }
  }
  // Replicated KV heads: the q|k|v weight gradient's fp32 scratch, used
  // within one qkv_backward. Outside the arena on a network of its own
  // (the planner counts it as workspace); in the shared scratch otherwise.
  if (kv_replicas_ > 1) {
    // (qkv_bias: each row's bias gradient rides after the weights, summed alike.)
    const int bias = cfg.qkv_bias ? 1 : 0;
    kv_scratch_bytes_ = size_t(QKV_) * (cfg.C + bias) * 4;
    kv_slots_bytes_ = size_t(NKV_global_) * 2 * KV_ * (cfg.C + bias) * 4;
    if (shared_) {
      tmp(&kv_scratch_, kv_scratch_bytes_);
      tmp(&kv_slots_, kv_slots_bytes_);
    } else {
      kv_grad_scratch_ = DeviceBuffer(be, kv_scratch_bytes_);
      kv_grad_slots_ = DeviceBuffer(be, kv_slots_bytes_);
      kv_scratch_ = kv_grad_scratch_.as<float>();
      kv_slots_ = kv_grad_slots_.as<float>();
    }
  }
  if (moe_elems_) {
    moe_ = std::make_unique<MoeMlp>(cfg.moe, cfg.C, be, N, ckpt_ ? 1 : cfg_.L, cfg_.L, true, ep);
    if (router_carry_bytes_) moe_->set_loss_layers(cfg.L);  // the losses span every stage's layers
    moe_->plan(plan, ckpt_);
  }
  arena_ = shared_ ? plan.allocate_kept(be) : plan.allocate(be);
  act_bytes_ = shared_ ? plan.kept_total() : plan.total;
  tpc_.tp = tp_;
  tpc_.be = be;
  tpc_.C = cfg.C;
  tpc_.sp = sp_;
  tpc_.norm_len = cfg.C;
  wire_scratch();
  const RopeScaling* scaling = cfg.rope_scaling_type.empty() ? nullptr : &cfg.rope_scaling;
  const std::vector<float> table = rope_table(cfg.T, HS_, cfg.rope_theta, scaling);
  be->copy_to_device(rope_, table.data(), table.size() * 4);
}

LlamaNetwork::~LlamaNetwork() = default;

Network::RouterReport LlamaNetwork::router_report() const {
  if (!moe_) return {};
  return moe_->report(be_);
}

void LlamaNetwork::set_expert_bias(const std::vector<float>& bias) {
  if (moe_) moe_->set_bias(bias);
}

std::vector<float> LlamaNetwork::take_expert_load() { return moe_ ? moe_->take_load() : std::vector<float>{}; }

void LlamaNetwork::wire_scratch() {
  tpc_.rows_buf = sp_rows_;
  tpc_.full_buf = dres_full_;
  tpc_.norm_buf = norm_grad_;
}

void LlamaNetwork::bind_transient(void* scratch) {
  TR_CHECK(shared_ && scratch, "LlamaNetwork: bind_transient needs a stage built with shared_scratch and a buffer (a bug)");
  plan_.bind_transient(scratch);
  wire_scratch();
  bound_ = true;
}

namespace {
template <typename P>
struct BlockPtrs {
  P ln1w, qkvw, qkvb, ow, ln2w, guw, downw, qnw, knw, panw, pfnw;  // qkvb: qkv_bias only; panw, pfnw: post_norms only
};
template <typename P, typename Base>
BlockPtrs<P> block_ptrs(Base base, const LlamaBlockOffsets& o, size_t esize) {
  auto at = [&](int64_t off) { return reinterpret_cast<P>(reinterpret_cast<uintptr_t>(base) + off * esize); };
  return {at(o.ln1w), at(o.qkvw), o.has_qkvb ? at(o.qkvb) : P{}, at(o.ow), at(o.ln2w), o.guw >= 0 ? at(o.guw) : P{}, o.downw >= 0 ? at(o.downw) : P{},
          at(o.qnw), at(o.knw), o.panw >= 0 ? at(o.panw) : P{}, o.pfnw >= 0 ? at(o.pfnw) : P{}};
}
}  // namespace

// From the fused q|k|v projection to down_proj. On entry acts(l).ln1 holds
// RMSNorm(res_in) (fused by the caller with the previous residual add); on
// exit dbuf_c_ holds the MLP output, whose residual add the caller fuses
// with the next RMSNorm.
// With tensor parallelism q|k|v and gate|up are this rank's columns, and
// o_proj / down_proj (row-parallel) give partial sums, all-reduced here.
void LlamaNetwork::block_forward(const void* p, int l, const void* res_in, int B, int T) {
  const int N = B * T, C = cfg_.C, F = F_;
  auto w = block_ptrs<const void*>(p, offsets(), dtype_size(be_->act_dtype()));
  LayerActs& a = acts(l);
  const int gl = stage_.first_layer + l;  // adapters are numbered by the global layer
  const void* x_qkv = full_rows(a.ln1, N);
  be_->matmul_forward(a.qkv, x_qkv, w.qkvw, w.qkvb, N, C, QKV_);  // + q|k|v biases (qkv_bias)
  if (ad_) ad_->forward(gl, 0, x_qkv, a.qkv, QKV_, N);
  if (QN_) be_->qk_norm_forward(a.qkv, a.qk_pre, a.qk_rstd, w.qnw, w.knw, N, NH_, NKV_, HS_, eps_);
  be_->rope_forward(a.qkv, rope_, B, T, NH_, NKV_, HS_, 0, docs_.pos);
  attention_forward(a, l, B, T);
  be_->matmul_forward(dbuf_c_, a.atty, w.ow, nullptr, N, Q_, C);
  if (ad_) ad_->forward(gl, 1, a.atty, dbuf_c_, C, N);
  const void* attn_out = row_parallel_out(dbuf_c_, N);
  if (cfg_.post_norms) post_norm_forward(const_cast<void*>(attn_out), a.ao, a.ao_rstd, w.panw, rows(N));
  be_->residual_rmsnorm_forward(a.res2, a.ln2, a.ln2_rstd, res_in, attn_out, w.ln2w, rows(N), C, eps_, wo_);
  const void* x_gu = full_rows(a.ln2, N);
  if (moe_) {  // the mixture of experts in the MLP's place (core/model/moe/moe_mlp.h)
    moe_->forward(ckpt_ ? 0 : l, static_cast<const char*>(p) + offsets().moe * dtype_size(be_->act_dtype()), x_gu,
                  dbuf_c_, N, l);
  } else {
    be_->matmul_forward(a.gu, x_gu, w.guw, nullptr, N, C, 2 * F);
    if (ad_) ad_->forward(gl, 2, x_gu, a.gu, 2 * F, N);
    if (cfg_.mlp_act == "gelu_tanh")
      be_->geglu_forward(a.h, a.gu, N, F);
    else
      be_->swiglu_forward(a.h, a.gu, N, F);
    be_->matmul_forward(dbuf_c_, a.h, w.downw, nullptr, N, F, C);
    if (ad_) ad_->forward(gl, 3, a.h, dbuf_c_, C, N);
  }
  // (The MoE MLP is replicated over TP: its output is whole on every rank.)
  const void* out = moe_ ? dbuf_c_ : row_parallel_out(dbuf_c_, N);  // -> mlp_out()
  if (cfg_.post_norms) post_norm_forward(const_cast<void*>(out), a.mo, a.mo_rstd, w.pfnw, rows(N));
}

// Gemma 2's post norms: buf (NR,C) holds a sublayer's output; it is kept in
// `saved` (the norm's backward reads it) and replaced by RMSNorm(buf), which
// the caller's residual add reads.
void LlamaNetwork::post_norm_forward(void* buf, void* saved, float* rstd, const void* w, int NR) {
  be_->copy_device(saved, buf, size_t(NR) * cfg_.C * dtype_size(be_->act_dtype()));
  be_->rmsnorm_forward(buf, rstd, saved, w, NR, cfg_.C, eps_, wo_);
}


size_t LlamaNetwork::activation_bytes() const { return act_bytes_ + (cpa_ ? cpa_->workspace_bytes() : 0); }

// Attention over the whole sequence: the one-rank op, or through the cp group.
void LlamaNetwork::attention_forward(LayerActs& a, int l, int B, int T) {
  if (cpa_)
    cpa_->forward(a.atty, a.att, a.qkv, attn_opt(l));
  else
    be_->attention_gqa_forward(a.atty, a.att, a.qkv, B, T, NH_, NKV_, HS_, docs_.doc_start, attn_opt(l));
}

void LlamaNetwork::attention_backward(LayerActs& a, int l, int B, int T) {
  if (cpa_)
    cpa_->backward(dqkv_, dbuf_c_, a.qkv, a.atty, a.att, attn_opt(l));
  else
    be_->attention_gqa_backward(dqkv_, dbuf_c_, a.qkv, a.atty, a.att, B, T, NH_, NKV_, HS_, docs_.doc_start,
                                attn_opt(l));
}

// Layer l's attention options (global layer numbering: the window pattern is the model's).
AttentionOptions LlamaNetwork::attn_opt(int l) const {
  AttentionOptions o;
  const int gl = stage_.first_layer + l;
  if (cfg_.sliding_window > 0 && (cfg_.window_period == 0 || gl % cfg_.window_period == 0) &&
      cfg_.sliding_window < cfg_.T)
    o.window = cfg_.sliding_window;  // a window as long as the context changes nothing: not passed
  o.softcap = cfg_.attn_softcap;
  // HF multiplies the fp32 scores by query_pre_attn_scalar**-0.5 (a Python float): float(that).
  if (cfg_.query_scale > 0) o.scale = float(std::pow(cfg_.query_scale, -0.5));
  return o;
}

// The collectives between the GEMMs: TpCollectives (core/model/tensor_parallel.h).
int LlamaNetwork::rows(int N) const { return tpc_.rows(N); }
const void* LlamaNetwork::row_parallel_out(void* partial, int N) { return tpc_.reduce_out(partial, N); }
const void* LlamaNetwork::full_rows(const void* mine, int N) { return tpc_.full_rows(mine, N); }
float* LlamaNetwork::norm_grad(float* dweight) { return tpc_.norm_grad(dweight); }
void LlamaNetwork::norm_grad_done(float* dweight) { tpc_.norm_grad_done(dweight); }

void LlamaNetwork::tp_sum(void* buf, int64_t n) {
  if (tp_) tp_->all_reduce(buf, n, be_->act_dtype());
}

// Without tensor parallelism: the fused softmax + cross-entropy. With it,
// the logits are this rank's vocabulary columns; the row max and the
// sum of exponentials (and the target's logit, from the rank holding it)
// are all-reduced, so the full logits are never gathered. With Gemma 2's
// final cap the logits are capped (forward) and the gradient goes through
// the cap to the uncapped logits.
void LlamaNetwork::cross_entropy(const int32_t* targets, int N, bool for_backward, float dloss_scale) {
  void* dlogits = for_backward ? logits_ : nullptr;
  if (!tp_) {
    be_->softmax_cross_entropy(losses_, dlogits, logits_, targets, N, cfg_.V, ldv_, dloss_scale, cfg_.final_softcap);
    return;
  }
  tpc_.vocab_cross_entropy(losses_, dlogits, logits_, targets, ce_rowmax_, ce_stats_, v_begin_, N, v_valid_, ldv_,
                           dloss_scale, cfg_.final_softcap);
}

void LlamaNetwork::forward(UnitAccess& units, const int32_t* inputs, const int32_t* targets, int B, int T,
                           bool for_backward, float dloss_scale, DocumentMask docs) {
  TR_CHECK(B >= 1 && B <= maxB_ && T >= 1 && T <= cfg_.T, "model.forward: batch (", B, ",", T,
           ") exceeds the buffers (", maxB_, ",", cfg_.T, ")");
  TR_CHECK(!for_backward || targets || !stage_.last, "model.forward: for_backward needs targets");
  TR_CHECK(arena_.get(), "model.forward: the activations were freed (free_activations)");
  TR_CHECK(!shared_ || bound_, "LlamaNetwork: a shared_scratch stage computed before bind_transient (a bug)");
  TR_CHECK(!cpa_ || T == cpa_->local_rows(), "model.forward: under context parallelism T is this rank's ",
           cpa_ ? cpa_->local_rows() : 0, " rows per sequence, not ", T, " (a bug)");
  B_ = B;
  T_ = T;
  inputs_ = inputs;
  docs_ = cpa_ ? cpa_->begin_batch(B, docs) : docs;
  ad_ = units.adapters();
  frozen_ = units.base_frozen();
  const int N = B * T, C = cfg_.C, L = cfg_.L, F = F_;
  const size_t es = dtype_size(be_->act_dtype());
  const LlamaBlockOffsets off = offsets();
  (void)F;

  TR_CHECK(!sp_ || N % tp_->plan->size() == 0, "parallel.sequence_parallel: the micro-batch's ", N,
           " tokens (train.micro_batch_size x model.seq_len) do not split over parallel.tensor_parallel (",
           tp_ ? tp_->plan->size() : 1, "); make micro_batch_size x seq_len a multiple of it");
  const int NR = rows(N);

  units.begin_pass(false, for_backward);
  if (moe_) moe_->begin_forward(true, for_backward);
  // The router statistics of the stages before this one (the message's tail).
  if (router_carry_bytes_ && !stage_.first) moe_->start_statistics_from(router_tail(encoded_));
  // A pipeline stage after the first finds its input at stage_input() (encoded_).
  if (stage_.first) embed(units, inputs, B, T);

  // Residual stream: res3_[l] = res2 + mlp(RMSNorm(res2)) of block l, its add
  // fused with the RMSNorm that reads it next (block l+1's, or the final one).
  for (int l = 0; l < L; ++l) {
    const void* p = units.acquire_params(1 + l);
    if (ad_) ad_->begin_block(stage_.first_layer + l, false);
    auto w = block_ptrs<const void*>(p, off, es);
    LayerActs& a = acts(l);
    if (l == 0)
      be_->rmsnorm_forward(a.ln1, a.ln1_rstd, encoded_, w.ln1w, NR, C, eps_, wo_);
    else
      be_->residual_rmsnorm_forward(res3_[l - 1], a.ln1, a.ln1_rstd, acts(l - 1).res2, mlp_out(), w.ln1w,
                                    NR, C, eps_, wo_);
    block_forward(p, l, l == 0 ? encoded_ : res3_[l - 1], B, T);
    if (ad_) ad_->end_block(stage_.first_layer + l, false);
    units.release_params(1 + l);
  }

  if (!stage_.last) {
    // The stage's output (stage_output()): the residual add no RMSNorm follows here.
    be_->residual_forward(res3_[L - 1], acts(L - 1).res2, mlp_out(), int64_t(NR) * C);
    if (router_carry_bytes_) {  // the statistics so far go on; the losses' gradient scale is known here too
      moe_->copy_statistics(router_tail(res3_[L - 1]));
      moe_->set_stage_grad_scale(N, for_backward ? dloss_scale * float(N) : 0.f);
    }
    return;
  }
  const char* head = static_cast<const char*>(units.acquire_params(L + 1));
  be_->residual_rmsnorm_forward(res3_[L - 1], lnf_, lnf_rstd_, acts(L - 1).res2, mlp_out(), head, NR, C,
                                eps_, wo_);
  const void* lnf_in = full_rows(lnf_, N);
  if (cfg_.tied) {
    units.release_params(L + 1);
    be_->lm_head_forward(logits_, lnf_in, units.acquire_params(0), N, C, v_valid_, ldv_);
    units.release_params(0);
  } else {
    be_->lm_head_forward(logits_, lnf_in, head + lm_head_off_ * es, N, C, v_valid_, ldv_);
    units.release_params(L + 1);
  }
  // Gemma 2: the logits the model returns (and the loss reads) are soft-capped.
  if (cfg_.final_softcap > 0.f) be_->logit_softcap_forward(logits_, N, v_valid_, ldv_, cfg_.final_softcap);
  if (targets) cross_entropy(targets, N, for_backward, dloss_scale);
  // The router losses (moe_config.h), each token's loss carrying its share; their gradient waits for the backward.
  if (moe_ && targets) moe_->finish_forward(losses_, N, for_backward ? dloss_scale * float(N) : 0.f);
}

void LlamaNetwork::embed(UnitAccess& units, const int32_t* inputs, int B, int T) {
  const int N = B * T, C = cfg_.C, NR = rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  (void)NR;
  (void)es;
  if (tp_) {
    // Vocab-parallel embedding: this rank's rows, zeros for the others' tokens.
    if (sp_) {
      be_->vocab_embedding_forward(dbuf_c_, inputs, units.acquire_params(0), nullptr, v_begin_, v_valid_, B, T, C);
      be_->copy_device(encoded_, row_parallel_out(dbuf_c_, N), size_t(NR) * C * es);
    } else {
      be_->vocab_embedding_forward(encoded_, inputs, units.acquire_params(0), nullptr, v_begin_, v_valid_, B, T, C);
      tp_sum(encoded_, int64_t(N) * C);
    }
  } else {
    be_->encoder_forward(encoded_, inputs, units.acquire_params(0), nullptr, B, T, C);  // no position table
  }
  if (embed_scale_ > 0.f) be_->scale_act(encoded_, embed_scale_, int64_t(NR) * C);
  units.release_params(0);
}

// Backward through one block: dres holds dL/d(block output) on entry and
// dL/d(block input) on exit; parameter grads accumulate into g.
void LlamaNetwork::block_backward(const void* p, float* g, int l, const void* res_in, void* dres, int B, int T,
                                  const KeptGrads* keep) {
  const int N = B * T, C = cfg_.C, F = F_, NR = rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  const LlamaBlockOffsets off = offsets();
  auto w = block_ptrs<const void*>(p, off, es);
  auto dw = block_ptrs<float*>(g, off, 4);
  LayerActs& a = acts(l);
  // zero_bubble's input step: no weight gradients here (null skips them),
  // the output gradients they need kept for block_weight_grads (gate|up's
  // stays in a.gu, which nothing else reads).
  // A frozen base (adapters): no weight gradients for its linears either.
  auto W = [&](float* x) { return keep || frozen_ ? nullptr : x; };
  // (A frozen base keeps no output gradients for backward_weight: it computes nothing.)
  const int gl = stage_.first_layer + l;
  // MLP: res_out = res2 + down(swiglu(gate_up(RMSNorm(res2))))
  // post_norms: through the MLP output's norm first (dres passes on unchanged to the residual).
  const void* dmlp = full_rows(post_norm_backward(dres, a.mo, a.mo_rstd, w.pfnw, dw.pfnw, NR), N);
  if (moe_) {  // (no tensor/sequence parallelism or zero_bubble with MoE yet: refused in the constructor)
    moe_->backward(ckpt_ ? 0 : l, static_cast<const char*>(p) + off.moe * es, frozen_ ? nullptr : g + off.moe,
                   full_rows(a.ln2, N), dmlp, dbuf_c_, N);
  } else {
  if (keep && !frozen_) be_->copy_device(keep->d_down, dmlp, size_t(N) * C * es);
  be_->matmul_backward(dh_, W(dw.downw), nullptr, dmlp, a.h, w.downw, N, F, C);
  if (ad_) ad_->backward(gl, 3, a.h, dmlp, C, dh_, N);
  if (cfg_.mlp_act == "gelu_tanh")
    be_->geglu_backward(a.gu, dh_, a.gu, N, F);  // in place: gate|up is not read again
  else
    be_->swiglu_backward(a.gu, dh_, a.gu, N, F);
  // (full_rows: dres's gathered copy is consumed; the buffer takes ln2's.)
  const void* x_gu = full_rows(a.ln2, N);
  be_->matmul_backward(dbuf_c_, W(dw.guw), nullptr, a.gu, x_gu, w.guw, N, C, 2 * F);
  if (ad_) ad_->backward(gl, 2, x_gu, a.gu, 2 * F, dbuf_c_, N);
  }
  // column-parallel: each rank's columns add to the input gradient
  const void* dln2 = moe_ ? dbuf_c_ : row_parallel_out(dbuf_c_, N);  // (MoE: replicated, whole)
  be_->rmsnorm_backward(dres, norm_grad(dw.ln2w), dln2, a.res2, w.ln2w, a.ln2_rstd, NR, C, wo_);
  norm_grad_done(dw.ln2w);
  // Attention: res2 = res_in + o(attn(rope(qkv(RMSNorm(res_in)))))
  const void* dattn = full_rows(post_norm_backward(dres, a.ao, a.ao_rstd, w.panw, dw.panw, NR), N);
  if (keep && !frozen_) be_->copy_device(keep->d_o, dattn, size_t(N) * C * es);
  be_->matmul_backward(dbuf_c_, W(dw.ow), nullptr, dattn, a.atty, w.ow, N, Q_, C);
  if (ad_) ad_->backward(gl, 1, a.atty, dattn, C, dbuf_c_, N);
  attention_backward(a, l, B, T);
  be_->rope_backward(dqkv_, rope_, B, T, NH_, NKV_, HS_, 0, docs_.pos);
  if (QN_) qk_norm_backward(a, w.qnw, w.knw, dw.qnw, N);
  if (keep && !frozen_) be_->copy_device(keep->d_qkv, dqkv_, size_t(N) * QKV_ * es);
  const void* x_qkv = full_rows(a.ln1, N);
  qkv_backward(dbuf_c_, W(dw.qkvw), W(dw.qkvb), dqkv_, x_qkv, w.qkvw, N);  // dattn is consumed
  if (ad_) ad_->backward(gl, 0, x_qkv, dqkv_, QKV_, dbuf_c_, N);
  const void* dln1 = row_parallel_out(dbuf_c_, N);
  be_->rmsnorm_backward(dres, norm_grad(dw.ln1w), dln1, res_in, w.ln1w, a.ln1_rstd, NR, C, wo_);
  norm_grad_done(dw.ln1w);
}

// qk-norm's backward, in place on dqkv_'s q|k heads; dw: q_norm|k_norm's
// gradient (2*HS, adjacent). Like the other norms' weight gradients it is
// computed in zero_bubble's input step too. Under TP each rank normalised
// its own heads with the replicated weights, so their gradient is the sum
// over the group: a zeroed scratch, one all-reduce, accumulated (the
// gradient buffer itself holds earlier micro-batches' sums).
void LlamaNetwork::qk_norm_backward(const LayerActs& a, const void* wq, const void* wk, float* dw, int N) {
  float* d = tp_ ? qk_grad_ : dw;
  if (tp_) be_->zero(qk_grad_, 2 * size_t(QN_) * 4);
  be_->qk_norm_backward(dqkv_, d, d + QN_, a.qk_pre, wq, wk, a.qk_rstd, N, NH_, NKV_, HS_);
  if (!tp_) return;
  tp_->all_reduce(qk_grad_, 2 * int64_t(QN_), DType::F32);
  be_->accumulate(dw, qk_grad_, 2 * int64_t(QN_));
}

// Gemma 2's post norms, backward: dout (NR,C) is the gradient of a
// sublayer's normed output; returns that of its raw output (dpost_), the
// norm's weight gradient accumulated into dweight. Without post norms, dout.
const void* LlamaNetwork::post_norm_backward(const void* dout, const void* saved, const float* rstd, const void* w,
                                             float* dweight, int NR) {
  if (!cfg_.post_norms) return dout;
  be_->zero(dpost_, size_t(NR) * cfg_.C * dtype_size(be_->act_dtype()));  // rmsnorm_backward accumulates
  be_->rmsnorm_backward(dpost_, norm_grad(dweight), dout, saved, w, rstd, NR, cfg_.C, wo_);
  norm_grad_done(dweight);
  return dpost_;
}

// The q|k|v projection's backward: dinp (null: skipped) and, with dqkvw,
// its weight gradient (and with dqkvb, null without qkv_bias, its bias's).
void LlamaNetwork::qkv_backward(void* dinp, float* dqkvw, float* dqkvb, const void* dqkv, const void* ln1,
                                const void* wqkv, int N) {
  const int C = cfg_.C;
  if (kv_replicas_ == 1 || !dqkvw) {
    be_->matmul_backward(dinp, dqkvw, dqkvb, dqkv, ln1, wqkv, N, C, QKV_);
  } else {
    // KV heads replicated over kv_replicas_ ranks: each holds the gradient
    // its own query heads give k and v; the true one is their sum. This
    // step's qkv gradient goes to a scratch, its k|v part into this KV
    // head's slot, one all-reduce sums every slot over the group, and each
    // rank adds back its slot (the input gradient needs no change: the
    // ranks' dk Wk terms are the parts of the sum). With biases the
    // scratch is (QKV,C) weights then (QKV) biases, a slot 2*KV*C weights
    // then 2*KV biases: the k|v bias gradients are summed the same way.
    const int64_t qC = int64_t(Q_) * C, kvC = 2 * int64_t(KV_) * C;
    const int64_t kvB = dqkvb ? 2 * int64_t(KV_) : 0, slot = kvC + kvB;
    float* scratch = kv_scratch_;
    float* sbias = scratch + int64_t(QKV_) * C;
    float* slots = kv_slots_;
    be_->zero(scratch, kv_scratch_bytes_);
    be_->matmul_backward(dinp, scratch, dqkvb ? sbias : nullptr, dqkv, ln1, wqkv, N, C, QKV_);
    be_->zero(slots, kv_slots_bytes_);
    float* mine = slots + kv_head_ * slot;
    be_->copy_device(mine, scratch + qC, kvC * 4);
    if (dqkvb) be_->copy_device(mine + kvC, sbias + Q_, kvB * 4);
    tp_->comm->all_reduce(slots, int64_t(NKV_global_) * slot, ReduceOp::Sum);
    be_->accumulate(dqkvw, scratch, qC);
    be_->accumulate(dqkvw + qC, mine, kvC);
    if (dqkvb) {
      be_->accumulate(dqkvb, sbias, Q_);
      be_->accumulate(dqkvb + Q_, mine + kvC, kvB);
    }
  }
}

// zero_bubble's weight step (GPT2::block_weight_grads): the four linears'
// weight gradients from the kept output gradients and the saved inputs.
void LlamaNetwork::block_weight_grads(float* g, int l, const KeptGrads& k, int N) {
  const int C = cfg_.C, F = F_;
  auto dw = block_ptrs<float*>(g, offsets(), 4);
  const LayerActs& a = layers_[size_t(l)];
  be_->matmul_backward(nullptr, dw.downw, nullptr, k.d_down, a.h, nullptr, N, F, C);
  // The norm outputs are this rank's rows under sequence parallelism: gathered again here.
  be_->matmul_backward(nullptr, dw.guw, nullptr, a.gu, full_rows(a.ln2, N), nullptr, N, C, 2 * F);
  be_->matmul_backward(nullptr, dw.ow, nullptr, k.d_o, a.atty, nullptr, N, Q_, C);
  qkv_backward(nullptr, dw.qkvw, dw.qkvb, k.d_qkv, full_rows(a.ln1, N), nullptr, N);
}

void LlamaNetwork::backward_input(UnitAccess& units) {
  TR_CHECK(stage_.split_backward, "LlamaNetwork: backward_input needs a stage built with split_backward (a bug)");
  backward_pass(units, true);
}

void LlamaNetwork::backward_weight(UnitAccess& units) {
  TR_CHECK(stage_.split_backward, "LlamaNetwork: backward_weight needs a stage built with split_backward (a bug)");
  // A frozen base (model.adapter) has no weight gradients; the adapters'
  // own ran with backward_input (adapter_pipeline.h), so none runs here.
  const bool frozen = units.base_frozen();
  for (int l = cfg_.L - 1; l >= 0; --l) {
    if (!frozen) block_weight_grads(units.unit_grads(1 + l), l, kept_[size_t(l)], B_ * T_);
    units.grads_done(1 + l);
  }
}

void LlamaNetwork::backward(UnitAccess& units) { backward_pass(units, false); }

void LlamaNetwork::backward_pass(UnitAccess& units, bool input_only) {
  TR_CHECK(arena_.get(), "model.backward: the activations were freed (free_activations)");
  const int B = B_, T = T_, N = B * T, C = cfg_.C, L = cfg_.L, NR = rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  units.begin_pass(true, false);
  ad_ = units.adapters();
  frozen_ = units.base_frozen();
  // logits_ holds dlogits (forward with for_backward). Tied: the head's
  // gradient lands in the embedding unit's, which stays open until the
  // embedding's own turn at the end.
  // A pipeline stage before the last starts from the caller's dL/d output
  // in dres_ (stage_output_grad()).
  float* gemb = stage_.last ? head_backward(units) : nullptr;
  // The aux loss's gradient (E values): the last stage computed it in its
  // forward and sends it back; the others take it from the message's tail,
  // where it stays for the stage before them.
  if (router_carry_bytes_ && stage_.last && !stage_.first) moe_->copy_aux_grad(router_tail(dres_));
  if (router_carry_bytes_ && !stage_.last) moe_->set_aux_grad(router_tail(dres_));

  const LlamaBlockOffsets off = offsets();
  if (moe_ && ckpt_) moe_->begin_forward(false);  // the recompute routes again; the statistics stay the forward's
  for (int l = L - 1; l >= 0; --l) {
    const void* p = units.acquire_params(1 + l);
    if (ad_) ad_->begin_block(stage_.first_layer + l, true);  // before the recompute, which reads the adapters
    const void* res_in = l == 0 ? encoded_ : res3_[l - 1];
    // Activation checkpointing: refill the shared per-layer set from the
    // kept block input. The recompute ends in dbuf_c_, which the backward
    // overwrites before reading; the checkpoints (res3_) stay untouched.
    if (ckpt_) {
      auto w = block_ptrs<const void*>(p, off, es);
      be_->rmsnorm_forward(acts(l).ln1, acts(l).ln1_rstd, res_in, w.ln1w, NR, C, eps_, wo_);
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
    if (embed_scale_ > 0.f && !frozen_) be_->scale_act(dres_, embed_scale_, int64_t(NR) * C);
    if (frozen_) {
      // A frozen base: the embedding's gradient would be thrown away.
    } else if (tp_) {
      be_->vocab_embedding_backward(gemb, nullptr, full_rows(dres_, N), inputs_, v_begin_, v_valid_, B, T, C);
    } else {
      be_->encoder_backward(gemb, nullptr, dres_, inputs_, B, T, C);  // no position gradient
    }
  }
  if (gemb) units.grads_done(0);
}

// The LM head and final RMSNorm's backward into dres_; returns the
// embedding unit's gradient when the head is tied to it (else null).
float* LlamaNetwork::head_backward(UnitAccess& units) {
  const int N = B_ * T_, C = cfg_.C, L = cfg_.L, NR = rows(N);
  const size_t es = dtype_size(be_->act_dtype());
  float* gemb = nullptr;
  if (cfg_.tied) {
    const void* emb = units.acquire_params(0);
    gemb = units.unit_grads(0);
    // A frozen base (adapters) needs only the input gradient: the head's
    // weight gradient, a (V, C) GEMM, would be thrown away.
    be_->lm_head_backward(dbuf_c_, frozen_ ? nullptr : gemb, logits_, full_rows(lnf_, N), emb, N, C, v_valid_, ldv_);
    units.release_params(0);
  }
  const char* head = static_cast<const char*>(units.acquire_params(L + 1));
  float* ghead = units.unit_grads(L + 1);
  if (!cfg_.tied)
    be_->lm_head_backward(dbuf_c_, frozen_ ? nullptr : ghead + lm_head_off_, logits_, full_rows(lnf_, N), head + lm_head_off_ * es, N, C, v_valid_,
                          ldv_);
  const void* dlnf = row_parallel_out(dbuf_c_, N);  // the head is column-parallel over the vocabulary
  be_->zero(dres_, size_t(NR) * C * es);
  be_->rmsnorm_backward(dres_, norm_grad(ghead), dlnf, res3_[L - 1], head, lnf_rstd_, NR, C, wo_);
  norm_grad_done(ghead);
  units.release_params(L + 1);
  units.grads_done(L + 1);
  return gemb;
}

}  // namespace trainrun
