// GPT-2 parameter layout, deterministic init, forward and backward over the
// Backend interface. No tensor memory is touched on the host here.
#include "core/model/gpt2/gpt2.h"

#include <algorithm>
#include <cmath>

#include "core/common/error.h"
#include "core/model/init_rng.h"

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
    b.add(p + "attn.c_attn.weight", {3 * C, C}, true, S::Column, 3);  // q | k | v, each split by heads
    b.add(p + "attn.c_attn.bias", {3 * C}, false, S::Column, 3);
    b.add(p + "attn.c_proj.weight", {C, C}, true, S::Row);
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
GPT2::GPT2(const GPT2Config& cfg, Backend* be, int maxB, bool activation_checkpointing)
    : cfg_(cfg), layout_(make_gpt2_layout(cfg)), be_(be), maxB_(maxB), ckpt_(activation_checkpointing) {
  TR_CHECK(cfg.C % cfg.NH == 0, "model.n_embd (", cfg.C, ") must be divisible by model.n_head (", cfg.NH, ")");
  const size_t es = dtype_size(be->act_dtype());
  const int64_t N = int64_t(maxB) * cfg.T, C = cfg.C;
  // One arena; every buffer starts on a 64-byte boundary.
  std::vector<std::pair<void**, size_t>> plan;
  auto req = [&](void** slot, size_t bytes) { plan.push_back({slot, (bytes + 63) / 64 * 64}); };
  req(&encoded_, N * C * es);
  res3_.assign(cfg.L, nullptr);
  for (int l = 0; l < cfg.L; ++l) req(&res3_[l], N * C * es);
  layers_.resize(ckpt_ ? 1 : cfg.L);
  for (auto& a : layers_) {
    req(&a.ln1, N * C * es);
    req(reinterpret_cast<void**>(&a.ln1_mean), N * 4);
    req(reinterpret_cast<void**>(&a.ln1_rstd), N * 4);
    req(&a.qkv, N * 3 * C * es);
    req(&a.atty, N * C * es);
    req(reinterpret_cast<void**>(&a.att), be->attention_saved_floats(maxB, cfg.T, cfg.NH) * 4);
    req(&a.res2, N * C * es);
    req(&a.ln2, N * C * es);
    req(reinterpret_cast<void**>(&a.ln2_mean), N * 4);
    req(reinterpret_cast<void**>(&a.ln2_rstd), N * 4);
    req(&a.fch, N * 4 * C * es);
    req(&a.fch_gelu, N * 4 * C * es);
  }
  req(&lnf_, N * C * es);
  req(reinterpret_cast<void**>(&lnf_mean_), N * 4);
  req(reinterpret_cast<void**>(&lnf_rstd_), N * 4);
  ldv_ = be->logits_stride(cfg.V);  // rows padded on the GPU (kernels/backend.h)
  req(&logits_, N * ldv_ * es);
  req(reinterpret_cast<void**>(&losses_), N * 4);
  req(&dres_, N * C * es);
  req(&dbuf_c_, N * C * es);
  req(&dbuf_3c_, N * 3 * C * es);
  req(&dbuf_4c_, N * 4 * C * es);
  size_t total = 0;
  for (auto& p : plan) total += p.second;
  arena_ = DeviceBuffer(be, total);
  char* base = arena_.as<char>();
  for (auto& p : plan) {
    *p.first = base;
    base += p.second;
  }
  act_bytes_ = total;
}

// Pointers into one block unit's parameters (act dtype) or gradients (fp32).
namespace {
template <typename P>
struct BlockPtrs {
  P ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
};
template <typename P, typename Base>
BlockPtrs<P> block_ptrs(Base base, int64_t C, size_t esize) {
  GPT2BlockOffsets o(C);
  auto at = [&](int64_t off) { return reinterpret_cast<P>(reinterpret_cast<uintptr_t>(base) + off * esize); };
  return {at(o.ln1w), at(o.ln1b), at(o.qkvw), at(o.qkvb), at(o.attprojw), at(o.attprojb),
          at(o.ln2w), at(o.ln2b), at(o.fcw), at(o.fcb), at(o.fcprojw), at(o.fcprojb)};
}
}  // namespace

// The block from its qkv projection to the MLP's output projection. On entry
// acts(l).ln1 holds ln1(res_in) (the caller fuses it with the previous
// block's residual add); on exit dbuf_c_ holds the MLP output, whose residual
// add the caller fuses with the next LayerNorm (the next block's ln1, or lnf).
void GPT2::block_forward(const void* p, int l, const void* res_in, int B, int T) {
  const int N = B * T, C = cfg_.C;
  auto w = block_ptrs<const void*>(p, C, dtype_size(be_->act_dtype()));
  LayerActs& a = acts(l);
  be_->matmul_forward(a.qkv, a.ln1, w.qkvw, w.qkvb, N, C, 3 * C);
  be_->attention_forward(a.atty, a.att, a.qkv, B, T, C, cfg_.NH);
  be_->matmul_forward(dbuf_c_, a.atty, w.attprojw, w.attprojb, N, C, C);
  be_->residual_layernorm_forward(a.res2, a.ln2, a.ln2_mean, a.ln2_rstd, res_in, dbuf_c_, w.ln2w, w.ln2b, N, C);
  be_->matmul_gelu_forward(a.fch_gelu, a.fch, a.ln2, w.fcw, w.fcb, N, C, 4 * C);
  be_->matmul_forward(dbuf_c_, a.fch_gelu, w.fcprojw, w.fcprojb, N, 4 * C, C);
}

void GPT2::forward(UnitAccess& units, const int32_t* inputs, const int32_t* targets, int B, int T,
                   bool for_backward, float dloss_scale) {
  TR_CHECK(B >= 1 && B <= maxB_ && T >= 1 && T <= cfg_.T, "model.forward: batch (", B, ",", T,
           ") exceeds the buffers (", maxB_, ",", cfg_.T, ")");
  TR_CHECK(!for_backward || targets, "model.forward: for_backward needs targets");
  B_ = B;
  T_ = T;
  inputs_ = inputs;
  const int N = B * T, C = cfg_.C, L = cfg_.L;
  const size_t es = dtype_size(be_->act_dtype());

  units.begin_pass(false, for_backward);
  const char* emb = static_cast<const char*>(units.acquire_params(0));
  const void* wte = emb;
  const void* wpe = emb + int64_t(cfg_.V) * C * es;
  be_->encoder_forward(encoded_, inputs, wte, wpe, B, T, C);
  units.release_params(0);

  // Residual stream: res3_[l] = res2 + mlp(ln2(res2)) of block l. Its add is
  // fused with the LayerNorm that reads it next: block l+1's ln1, or lnf.
  for (int l = 0; l < L; ++l) {
    const void* p = units.acquire_params(1 + l);
    auto w = block_ptrs<const void*>(p, C, es);
    LayerActs& a = acts(l);
    if (l == 0)
      be_->layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, encoded_, w.ln1w, w.ln1b, N, C);
    else
      be_->residual_layernorm_forward(res3_[l - 1], a.ln1, a.ln1_mean, a.ln1_rstd, acts(l - 1).res2, dbuf_c_, w.ln1w,
                                      w.ln1b, N, C);
    block_forward(p, l, l == 0 ? encoded_ : res3_[l - 1], B, T);
    units.release_params(1 + l);
  }

  const char* head = static_cast<const char*>(units.acquire_params(L + 1));
  be_->residual_layernorm_forward(res3_[L - 1], lnf_, lnf_mean_, lnf_rstd_, acts(L - 1).res2, dbuf_c_, head,
                                  head + C * es, N, C);
  units.release_params(L + 1);
  emb = static_cast<const char*>(units.acquire_params(0));  // tied LM head
  be_->lm_head_forward(logits_, lnf_, emb, N, C, cfg_.V, ldv_);
  units.release_params(0);
  if (targets)
    be_->softmax_cross_entropy(losses_, for_backward ? logits_ : nullptr, logits_, targets, N, cfg_.V, ldv_,
                               dloss_scale);
}

// Backward through one block. On entry dres holds dL/d(block output); on
// exit dL/d(block input). Parameter grads accumulate into g.
void GPT2::block_backward(const void* p, float* g, int l, const void* res_in, void* dres, int B, int T) {
  const int N = B * T, C = cfg_.C;
  const size_t es = dtype_size(be_->act_dtype());
  auto w = block_ptrs<const void*>(p, C, es);
  auto dw = block_ptrs<float*>(g, C, 4);
  LayerActs& a = acts(l);
  // MLP: res_out = res2 + fcproj(gelu(fc(ln2(res2))))
  be_->matmul_backward_dgelu(dbuf_4c_, dw.fcprojw, dw.fcprojb, dres, a.fch_gelu, w.fcprojw, a.fch, N, 4 * C, C);
  be_->matmul_backward(dbuf_c_, dw.fcw, dw.fcb, dbuf_4c_, a.ln2, w.fcw, N, C, 4 * C);
  be_->layernorm_backward(dres, dw.ln2w, dw.ln2b, dbuf_c_, a.res2, w.ln2w, a.ln2_mean, a.ln2_rstd, N, C);
  // Attention: res2 = res_in + attproj(attn(qkv(ln1(res_in))))
  be_->matmul_backward(dbuf_c_, dw.attprojw, dw.attprojb, dres, a.atty, w.attprojw, N, C, C);
  be_->attention_backward(dbuf_3c_, dbuf_c_, a.qkv, a.atty, a.att, B, T, C, cfg_.NH);
  be_->matmul_backward(dbuf_c_, dw.qkvw, dw.qkvb, dbuf_3c_, a.ln1, w.qkvw, N, C, 3 * C);
  be_->layernorm_backward(dres, dw.ln1w, dw.ln1b, dbuf_c_, res_in, w.ln1w, a.ln1_mean, a.ln1_rstd, N, C);
}

void GPT2::backward(UnitAccess& units) {
  const int B = B_, T = T_, N = B * T, C = cfg_.C, L = cfg_.L;
  const size_t es = dtype_size(be_->act_dtype());
  units.begin_pass(true, false);
  // logits_ now holds dlogits (see forward). Tied head: grads land in the
  // embedding unit's wte gradient, which stays open until the encoder's turn.
  const void* emb = units.acquire_params(0);
  float* gemb = units.unit_grads(0);
  be_->lm_head_backward(dbuf_c_, gemb, logits_, lnf_, emb, N, C, cfg_.V, ldv_);
  units.release_params(0);

  const char* head = static_cast<const char*>(units.acquire_params(L + 1));
  float* ghead = units.unit_grads(L + 1);
  be_->zero(dres_, size_t(N) * C * es);
  be_->layernorm_backward(dres_, ghead, ghead + C, dbuf_c_, res3_[L - 1], head, lnf_mean_, lnf_rstd_, N, C);
  units.release_params(L + 1);
  units.grads_done(L + 1);

  for (int l = L - 1; l >= 0; --l) {
    const void* p = units.acquire_params(1 + l);
    const void* res_in = l == 0 ? encoded_ : res3_[l - 1];
    // Activation checkpointing: only block outputs (res3_) were kept; rerun
    // this block's forward (from its ln1) to refill the shared per-layer
    // scratch. The recompute ends in dbuf_c_, which backward overwrites
    // before reading, so the checkpoints stay untouched.
    if (ckpt_) {
      auto w = block_ptrs<const void*>(p, C, es);
      LayerActs& a = acts(l);
      be_->layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, res_in, w.ln1w, w.ln1b, N, C);
      block_forward(p, l, res_in, B, T);
    }
    block_backward(p, units.unit_grads(1 + l), l, res_in, dres_, B, T);
    units.release_params(1 + l);
    units.grads_done(1 + l);
  }

  be_->encoder_backward(gemb, gemb + int64_t(cfg_.V) * C, dres_, inputs_, B, T, C);
  units.grads_done(0);
}

}  // namespace trainrun
