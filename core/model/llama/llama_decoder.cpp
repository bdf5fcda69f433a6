#include "core/model/llama/llama_decoder.h"

#include <cmath>

#include <algorithm>
#include <utility>

#include "core/common/error.h"
#include "core/model/arena_plan.h"
#include "core/model/llama/llama.h"
#include "core/model/moe/moe_mlp.h"
#include "kernels/rope_table.h"

namespace trainrun {

namespace {

// Layer l's window in the cache: the model's sliding window where the layer
// slides (LlamaNetwork::attn_opt's rule) and it is shorter than the cache,
// else 0. A windowed layer's cache is a ring of that many rows
// (Backend::attention_kv_gqa_forward), so generating far past the window
// holds `window` positions, not `capacity`.
int cache_window(const ModelConfig& cfg, int l, int cap) {
  const bool slides = cfg.sliding_window > 0 && (cfg.window_period == 0 || l % cfg.window_period == 0);
  return slides && cfg.sliding_window < cap ? cfg.sliding_window : 0;
}

// The decoder's buffers in arena order; the constructor and bytes_needed
// lay out the same plan (p may point at scratch slots).
ArenaPlan plan_for(const ModelConfig& cfg, const Backend& be, int cap, int chunk, std::vector<void*>& k,
              std::vector<void*>& v, void** p[16]) {
  const size_t es = dtype_size(be.act_dtype());
  const int64_t C = cfg.C, R = chunk, F = cfg.F, HS = cfg.head_size(), Q = cfg.q_dim(),
                KV = int64_t(cfg.kv_heads()) * HS;
  ArenaPlan plan;
  k.assign(size_t(cfg.L), nullptr);
  v.assign(size_t(cfg.L), nullptr);
  for (int l = 0; l < cfg.L; ++l) {
    const size_t rows = size_t(cache_window(cfg, l, cap) > 0 ? cache_window(cfg, l, cap) : cap);
    plan.add(&k[size_t(l)], rows * KV * es);
    plan.add(&v[size_t(l)], rows * KV * es);
  }
  plan.add(p[0], size_t(cap) * HS * 4);            // rope (cap, HS/2, 2) fp32
  plan.add(p[1], size_t(R) * C * es);              // zero_wpe
  plan.add(p[2], size_t(R) * 4);                   // tokens
  plan.add(p[3], size_t(R) * C * es);              // res_a
  plan.add(p[4], size_t(R) * C * es);              // res_b
  plan.add(p[5], size_t(R) * C * es);              // proj
  plan.add(p[6], size_t(R) * C * es);              // ln
  plan.add(p[7], size_t(R) * 4);                   // rstd
  plan.add(p[8], size_t(R) * (Q + 2 * KV) * es);   // qkv
  plan.add(p[9], size_t(R) * Q * es);              // atty
  plan.add(p[10], size_t(R) * 2 * F * es);         // gate|up
  plan.add(p[11], size_t(R) * F * es);             // h
  plan.add(p[12], size_t(be.logits_stride(cfg.V)) * es);  // logits (1, ldv)
  plan.add(p[13], size_t(cfg.V) * 4);              // the same, fp32
  if (cfg.qk_norm) {
    plan.add(p[14], size_t(R) * (Q + KV) * es);    // q|k before qk-norm
    plan.add(p[15], size_t(R) * (cfg.NH + cfg.kv_heads()) * 4);  // its rstd
  }
  return plan;
}
}  // namespace

size_t LlamaDecoder::bytes_needed(const ModelConfig& cfg, const Backend& be, int capacity) {
  std::vector<void*> k, v;
  void* scratch[16];
  void** p[16];
  for (int i = 0; i < 16; ++i) p[i] = &scratch[i];
  const int chunk = std::min(capacity, kChunk);
  const size_t moe = cfg.moe.on() ? MoeMlp::bytes(cfg.moe, cfg.C, dtype_size(be.act_dtype()), chunk, 1, 1, false) : 0;
  return plan_for(cfg, be, capacity, chunk, k, v, p).total + moe;
}

LlamaDecoder::~LlamaDecoder() = default;

size_t LlamaDecoder::bytes() const { return arena_.bytes() + (moe_ ? moe_->own_bytes() : 0); }

LlamaDecoder::LlamaDecoder(const ModelConfig& cfg, const ParamLayout& layout, Backend* be, int capacity)
    : cfg_(cfg), be_(be), cap_(capacity), chunk_(std::min(capacity, kChunk)) {
  TR_CHECK(cfg.NKV > 0 && cfg.F > 0, "LlamaDecoder needs LlamaArch's resolved config (a bug)");
  wo_ = cfg.norm_offset ? 1.f : 0.f;
  attn_.softcap = cfg.attn_softcap;
  if (cfg.query_scale > 0) attn_.scale = float(std::pow(cfg.query_scale, -0.5));  // as LlamaNetwork::attn_opt
  TR_CHECK(capacity >= 1 && capacity <= cfg.T, "decoder: capacity ", capacity, " outside 1..", cfg.T,
           " (model.seq_len)");
  HS_ = cfg.head_size();
  KV_ = cfg.NKV * HS_;
  Q_ = cfg.q_dim();
  QKV_ = Q_ + 2 * KV_;
  eps_ = float(cfg.norm_eps);
  ldv_ = be->logits_stride(cfg.V);
  if (!cfg.tied) {
    const ParamTensor& h = layout.get("lm_head.weight");
    lm_head_off_ = h.offset - layout.units[size_t(h.unit)].offset;
  }
  void** p[16] = {reinterpret_cast<void**>(&rope_), &zero_wpe_, reinterpret_cast<void**>(&tokens_), &res_a_,
                  &res_b_, &proj_, &ln_, reinterpret_cast<void**>(&rstd_), &qkv_, &atty_, &gu_, &h_, &logits_,
                  reinterpret_cast<void**>(&logits_f32_), &qk_pre_, reinterpret_cast<void**>(&qk_rstd_)};
  const ArenaPlan plan = plan_for(cfg, *be, cap_, chunk_, kcache_, vcache_, p);
  arena_ = plan.allocate(be);
  if (cfg.moe.on()) {
    moe_ = std::make_unique<MoeMlp>(cfg.moe, cfg.C, be, chunk_, 1, 1, false);
    moe_->allocate_own();
  }
  be->zero(zero_wpe_, size_t(chunk_) * cfg.C * dtype_size(be->act_dtype()));
  const RopeScaling* scaling = cfg.rope_scaling_type.empty() ? nullptr : &cfg.rope_scaling;
  const std::vector<float> table = rope_table(cap_, HS_, cfg.rope_theta, scaling);
  be->copy_to_device(rope_, table.data(), table.size() * 4);
}

void LlamaDecoder::feed(UnitAccess& units, const int32_t* tokens, int n, std::vector<float>& logits) {
  TR_CHECK(n >= 1 && pos_ + n <= cap_, "decoder: feeding ", n, " tokens at position ", pos_,
           " exceeds its capacity of ", cap_);
  for (int i = 0; i < n; i += chunk_) feed_chunk(units, tokens + i, std::min(chunk_, n - i), i + chunk_ >= n);
  logits.resize(size_t(cfg_.V));
  be_->copy_to_host(logits.data(), logits_f32_, size_t(cfg_.V) * 4);
}

// LlamaNetwork::forward's ops on n rows at positions [pos_, pos_+n), with
// attention over the cache.
void LlamaDecoder::feed_chunk(UnitAccess& units, const int32_t* tokens, int n, bool last_chunk) {
  for (int i = 0; i < n; ++i)
    TR_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.V, "decoder: token ", tokens[i], " is outside the vocab of ", cfg_.V);
  const int C = cfg_.C, L = cfg_.L, F = cfg_.F;
  const size_t es = dtype_size(be_->act_dtype());
  be_->copy_to_device(tokens_, tokens, size_t(n) * 4);

  units.begin_pass(false, false);
  be_->encoder_forward(res_a_, tokens_, units.acquire_params(0), zero_wpe_, 1, n, C);
  units.release_params(0);
  if (cfg_.embed_scale) be_->scale_act(res_a_, float(std::sqrt(double(C))), int64_t(n) * C);
  // Gemma 2's post norms: proj_ <- RMSNorm(proj_) through ln_ (free between the norms that fill it).
  auto post_norm = [&](const void* w) {
    be_->rmsnorm_forward(ln_, rstd_, proj_, w, n, C, eps_, wo_);
    be_->copy_device(proj_, ln_, size_t(n) * C * es);
  };

  const LlamaBlockOffsets o(C, Q_, KV_, F, cfg_.qk_norm ? HS_ : 0, cfg_.qkv_bias, cfg_.post_norms,
                            cfg_.moe.on() ? MoeOffsets(C, cfg_.moe).total : 0);
  // Adapters (generate --adapter, a LoRA run's sample) add to each GEMM's
  // output unmerged, after the same GEMMs as LlamaNetwork::block_forward
  // (0 q|k|v, before RoPE; 1 o_proj; 2 gate|up; 3 down_proj).
  LinearAdapters* ad = units.adapters();
  for (int l = 0; l < L; ++l) {
    const char* p = static_cast<const char*>(units.acquire_params(1 + l));
    if (ad) ad->begin_block(l, false);
    auto w = [&](int64_t off) { return p + off * int64_t(es); };
    if (l == 0)
      be_->rmsnorm_forward(ln_, rstd_, res_a_, w(o.ln1w), n, C, eps_, wo_);
    else
      be_->residual_rmsnorm_forward(res_a_, ln_, rstd_, res_b_, proj_, w(o.ln1w), n, C, eps_, wo_);
    be_->matmul_forward(qkv_, ln_, w(o.qkvw), o.has_qkvb ? w(o.qkvb) : nullptr, n, C, QKV_);
    if (ad) ad->forward(l, 0, ln_, qkv_, QKV_, n);
    if (cfg_.qk_norm)
      be_->qk_norm_forward(qkv_, qk_pre_, qk_rstd_, w(o.qnw), w(o.knw), n, cfg_.NH, cfg_.NKV, HS_, eps_);
    be_->rope_forward(qkv_, rope_, 1, n, cfg_.NH, cfg_.NKV, HS_, pos_);
    AttentionOptions opt = attn_;
    opt.window = cache_window(cfg_, l, cap_);
    be_->attention_kv_gqa_forward(atty_, kcache_[size_t(l)], vcache_[size_t(l)], qkv_, pos_, n, cfg_.NH, cfg_.NKV,
                                  HS_, opt);
    be_->matmul_forward(proj_, atty_, w(o.ow), nullptr, n, Q_, C);
    if (ad) ad->forward(l, 1, atty_, proj_, C, n);
    if (cfg_.post_norms) post_norm(w(o.panw));
    be_->residual_rmsnorm_forward(res_b_, ln_, rstd_, res_a_, proj_, w(o.ln2w), n, C, eps_, wo_);
    if (moe_) {
      moe_->begin_forward(false);
      moe_->forward(0, w(o.moe), ln_, proj_, n);
    } else {
      be_->matmul_forward(gu_, ln_, w(o.guw), nullptr, n, C, 2 * F);
      if (ad) ad->forward(l, 2, ln_, gu_, 2 * F, n);
      if (cfg_.mlp_act == "gelu_tanh")
        be_->geglu_forward(h_, gu_, n, F);
      else
        be_->swiglu_forward(h_, gu_, n, F);
      be_->matmul_forward(proj_, h_, w(o.downw), nullptr, n, F, C);
      if (ad) ad->forward(l, 3, h_, proj_, C, n);
    }
    if (cfg_.post_norms) post_norm(w(o.pfnw));
    if (ad) ad->end_block(l, false);
    units.release_params(1 + l);
  }
  pos_ += n;
  const char* head = static_cast<const char*>(units.acquire_params(L + 1));
  be_->residual_rmsnorm_forward(res_a_, ln_, rstd_, res_b_, proj_, head, n, C, eps_, wo_);
  const char* last = static_cast<const char*>(ln_) + size_t(n - 1) * C * es;
  if (!last_chunk) {
    units.release_params(L + 1);
    return;
  }
  if (cfg_.tied) {
    units.release_params(L + 1);
    be_->lm_head_forward(logits_, last, units.acquire_params(0), 1, C, cfg_.V, ldv_);
    units.release_params(0);
  } else {
    be_->lm_head_forward(logits_, last, head + lm_head_off_ * int64_t(es), 1, C, cfg_.V, ldv_);
    units.release_params(L + 1);
  }
  if (cfg_.final_softcap > 0.f) be_->logit_softcap_forward(logits_, 1, cfg_.V, ldv_, cfg_.final_softcap);
  be_->cast_to_f32(logits_f32_, logits_, cfg_.V);
}

}  // namespace trainrun
