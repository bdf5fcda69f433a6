#include "core/model/gpt2/gpt2_decoder.h"

#include <algorithm>
#include <utility>

#include "core/common/error.h"
#include "core/model/arena_plan.h"

namespace trainrun {

// Both the constructor and bytes_needed lay out the same plan (slots may be
// scratch pointers when only the size is wanted).
static ArenaPlan plan_for(const GPT2Config& cfg, const Backend& be, int cap, int chunk, std::vector<void*>& k,
                     std::vector<void*>& v, void** p[13], int ldv) {
  const size_t es = dtype_size(be.act_dtype());
  const int64_t C = cfg.C, R = chunk;
  ArenaPlan plan;
  k.assign(cfg.L, nullptr);
  v.assign(cfg.L, nullptr);
  for (int l = 0; l < cfg.L; ++l) {
    plan.add(&k[size_t(l)], size_t(cap) * C * es);
    plan.add(&v[size_t(l)], size_t(cap) * C * es);
  }
  plan.add(p[0], size_t(R) * 4);             // tokens
  plan.add(p[1], size_t(R) * C * es);        // res_a
  plan.add(p[2], size_t(R) * C * es);        // res_b
  plan.add(p[3], size_t(R) * C * es);        // proj
  plan.add(p[4], size_t(R) * C * es);        // ln
  plan.add(p[5], size_t(R) * 4);             // mean
  plan.add(p[6], size_t(R) * 4);             // rstd
  plan.add(p[7], size_t(R) * 3 * C * es);    // qkv
  plan.add(p[8], size_t(R) * C * es);        // atty
  plan.add(p[9], size_t(R) * 4 * C * es);    // fch
  plan.add(p[10], size_t(R) * 4 * C * es);   // fch_gelu
  plan.add(p[11], size_t(ldv) * es);         // logits (1, ldv)
  plan.add(p[12], size_t(cfg.V) * 4);        // the same, fp32
  return plan;
}

size_t GPT2Decoder::bytes_needed(const GPT2Config& cfg, const Backend& be, int capacity) {
  std::vector<void*> k, v;
  void* scratch[13];
  void** p[13];
  for (int i = 0; i < 13; ++i) p[i] = &scratch[i];
  return plan_for(cfg, be, capacity, std::min(capacity, kChunk), k, v, p, be.logits_stride(cfg.V)).total;
}

GPT2Decoder::GPT2Decoder(const GPT2Config& cfg, Backend* be, int capacity)
    : cfg_(cfg), be_(be), cap_(capacity), chunk_(std::min(capacity, kChunk)) {
  TR_CHECK(capacity >= 1 && capacity <= cfg.T, "decoder: capacity ", capacity, " outside 1..", cfg.T,
           " (the model's position table)");
  TR_CHECK(cfg.C % cfg.NH == 0, "model.n_embd (", cfg.C, ") must be divisible by model.n_head (", cfg.NH, ")");
  ldv_ = be->logits_stride(cfg.V);
  void** p[13] = {reinterpret_cast<void**>(&tokens_), &res_a_, &res_b_, &proj_, &ln_,
                  reinterpret_cast<void**>(&mean_), reinterpret_cast<void**>(&rstd_), &qkv_, &atty_, &fch_,
                  &fch_gelu_, &logits_, reinterpret_cast<void**>(&logits_f32_)};
  const ArenaPlan plan = plan_for(cfg, *be, cap_, chunk_, kcache_, vcache_, p, ldv_);
  arena_ = plan.allocate(be);
}

void GPT2Decoder::feed(UnitAccess& units, const int32_t* tokens, int n, std::vector<float>& logits) {
  TR_CHECK(n >= 1 && pos_ + n <= cap_, "decoder: feeding ", n, " tokens at position ", pos_,
           " exceeds its capacity of ", cap_);
  for (int i = 0; i < n; i += chunk_) feed_chunk(units, tokens + i, std::min(chunk_, n - i), i + chunk_ >= n);
  logits.resize(size_t(cfg_.V));
  be_->copy_to_host(logits.data(), logits_f32_, size_t(cfg_.V) * 4);
}

// The same ops, in the same order, as GPT2::forward (so the two agree to
// rounding), on n rows at positions [pos_, pos_+n), with attention over the
// cache. Only the last row's logits are computed, and only for the last chunk.
void GPT2Decoder::feed_chunk(UnitAccess& units, const int32_t* tokens, int n, bool last_chunk) {
  for (int i = 0; i < n; ++i)
    TR_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.V, "decoder: token ", tokens[i], " is outside the vocab of ", cfg_.V);
  const int C = cfg_.C, L = cfg_.L;
  const size_t es = dtype_size(be_->act_dtype());
  be_->copy_to_device(tokens_, tokens, size_t(n) * 4);

  units.begin_pass(false, false);
  const char* emb = static_cast<const char*>(units.acquire_params(0));
  // Positions pos_.. read the position table from row pos_ on.
  be_->encoder_forward(res_a_, tokens_, emb, emb + (int64_t(cfg_.V) + pos_) * C * es, 1, n, C);
  units.release_params(0);

  const GPT2BlockOffsets o(C);
  // Adapters (generate --adapter, a LoRA run's sample) add to each GEMM's
  // output unmerged, after the same GEMMs as GPT2::block_forward (0 c_attn,
  // 1 attn.c_proj, 2 c_fc before its GELU, 3 mlp.c_proj).
  LinearAdapters* ad = units.adapters();
  for (int l = 0; l < L; ++l) {
    const char* p = static_cast<const char*>(units.acquire_params(1 + l));
    if (ad) ad->begin_block(l, false);
    auto w = [&](int64_t off) { return p + off * int64_t(es); };
    // ln1 of the residual stream; from block 1 on it is the previous
    // block's last residual add, fused with this LayerNorm.
    if (l == 0)
      be_->layernorm_forward(ln_, mean_, rstd_, res_a_, w(o.ln1w), w(o.ln1b), n, C);
    else
      be_->residual_layernorm_forward(res_a_, ln_, mean_, rstd_, res_b_, proj_, w(o.ln1w), w(o.ln1b), n, C);
    be_->matmul_forward(qkv_, ln_, w(o.qkvw), w(o.qkvb), n, C, 3 * C);
    if (ad) ad->forward(l, 0, ln_, qkv_, 3 * C, n);
    be_->attention_kv_forward(atty_, kcache_[size_t(l)], vcache_[size_t(l)], qkv_, pos_, n, C, cfg_.NH);
    be_->matmul_forward(proj_, atty_, w(o.attprojw), w(o.attprojb), n, C, C);
    if (ad) ad->forward(l, 1, atty_, proj_, C, n);
    be_->residual_layernorm_forward(res_b_, ln_, mean_, rstd_, res_a_, proj_, w(o.ln2w), w(o.ln2b), n, C);
    be_->matmul_gelu_forward(fch_gelu_, fch_, ln_, w(o.fcw), w(o.fcb), n, C, 4 * C);
    if (ad) {
      // An adapter on c_fc adds to the pre-activation: the GELU again over the sum.
      ad->forward(l, 2, ln_, fch_, 4 * C, n);
      be_->gelu_forward(fch_gelu_, fch_, int64_t(n) * 4 * C);
    }
    be_->matmul_forward(proj_, fch_gelu_, w(o.fcprojw), w(o.fcprojb), n, 4 * C, C);
    if (ad) ad->forward(l, 3, fch_gelu_, proj_, C, n);
    if (ad) ad->end_block(l, false);
    units.release_params(1 + l);
  }
  const char* head = static_cast<const char*>(units.acquire_params(L + 1));
  be_->residual_layernorm_forward(res_a_, ln_, mean_, rstd_, res_b_, proj_, head, head + C * es, n, C);
  units.release_params(L + 1);
  pos_ += n;
  if (!last_chunk) return;
  emb = static_cast<const char*>(units.acquire_params(0));  // the tied LM head, last row only
  be_->lm_head_forward(logits_, static_cast<const char*>(ln_) + size_t(n - 1) * C * es, emb, 1, C, cfg_.V, ldv_);
  units.release_params(0);
  be_->cast_to_f32(logits_f32_, logits_, cfg_.V);
}

}  // namespace trainrun
