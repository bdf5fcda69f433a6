// Backend: the one interface between the model/optimizer/sharding code in
// core/ and parallel/ and the device that runs the math.
//
// The contract (shaped by the GPU, implemented first on the CPU):
//  - Memory returned by alloc() is device memory. core/ never dereferences
//    it; it only does pointer arithmetic and passes pointers to ops or to
//    explicit copies (copy_to_device / copy_to_host).
//  - Parameters and activations are in the backend's activation dtype
//    (act_dtype(): fp32 on the CPU, bf16 on CUDA), passed as void*.
//    Master weights, AdamW moments, gradients, LayerNorm statistics and
//    losses are always fp32.
//  - Ops are enqueued in order on the backend's compute stream; the CPU
//    backend runs them synchronously. synchronize() waits for all of them.
//  - Gradient semantics (why: lets backward avoid zeroing activation grads):
//      * every parameter gradient accumulates (+=), so gradient accumulation
//        over micro-batches needs no extra buffers;
//      * matmul_backward and attention_backward overwrite their input grads;
//      * layernorm_backward, rmsnorm_backward and encoder_backward
//        accumulate into theirs, because the residual stream's gradient is
//        the sum of two paths;
//      * rope_backward works in place on the gradient it is given.
// Document masking (data.document_mask; docs/data-format.md): several
// documents packed into one sequence attend only within their own document
// and restart their positions at 0. The ops it changes take two optional
// trailing device arrays (B,T) int32, null = one document per sequence,
// where every bit is as without them:
//      * doc_start[b*T+t]: the index in sequence b of the first token of
//        t's document (0 <= doc_start <= t, non-decreasing in t): the
//        attention ops let query t see keys [doc_start, t];
//      * pos[b*T+t] = t - doc_start[b*T+t]: the position the position ops
//        (encoder/vocab_embedding's wpe row, RoPE's angle) use for row t.
//   Both come from the host (core/data/document_mask.h), once per batch.
//   The trailing parameters default to null so that the many callers
//   without documents stay as they are; every override repeats "= nullptr"
//   (a default argument binds to the static type).
// Dimension letters: B batch, T time, C channels, NH heads, HS = C/NH,
// V vocab, N = B*T rows, OC output channels; for Llama also NKV key/value
// heads (grouped-query attention), HS the head size, F the MLP's width.
//
// Ops added after the first backend have a default implementation that
// throws "<op>: not implemented by the <name()> backend", so a backend that
// has not caught up yet still builds and fails only when a model needs them.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "kernels/attention_block.h"

namespace trainrun {

enum class DType { F32, BF16 };

// What the attention ops do beyond plain causal softmax(q k^T / sqrt(HS)) v
// (the default: every field 0). Gemma 2 needs softcap and scale; window is
// the sliding window (Mistral, Gemma 2's local layers).
//   window   > 0: query t sees only keys (t - window, t]  (HF: the last `window` positions)
//   softcap  > 0: scores s -> softcap * tanh(s / softcap), after the scale, before the mask
//   scale    > 0: the scores' scale (Gemma 2: query_pre_attn_scalar^-0.5); 0: 1/sqrt(HS)
struct AttentionOptions {
  int window = 0;
  float softcap = 0.f;
  float scale = 0.f;
};
inline size_t dtype_size(DType d) { return d == DType::F32 ? 4 : 2; }
inline const char* dtype_name(DType d) { return d == DType::F32 ? "fp32" : "bf16"; }

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda:0"
  virtual DType act_dtype() const = 0;

  // ---- memory -------------------------------------------------------------
  virtual void* alloc(size_t bytes) = 0;  // zero-initialised, 64-byte aligned
  virtual void free(void* p) = 0;
  virtual void copy_to_device(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void synchronize() = 0;
  // Peak and current bytes allocated through alloc().
  virtual size_t bytes_in_use() const = 0;
  virtual size_t peak_bytes() const = 0;
  virtual void reset_peak() = 0;
  // Page-locking host memory for fast device copies (parallel.offload's
  // state). A backend whose copies run from pageable memory as fast says
  // no (the CPU's "device" is host memory); pin_host returns false when it
  // cannot, and the caller keeps the memory pageable.
  virtual bool wants_pinned_host() const { return false; }
  virtual bool pin_host(void* p, size_t bytes) { return false; }
  virtual void unpin_host(void* p) {}
  // Device -> host in chunks without a host wait on the compute stream
  // (parallel.offload's gradients, read on the store's comm thread while the
  // compute stream runs the backward of earlier units). `src` is read once
  // `ready` has passed: a backend point (Communicator::compute_point,
  // PendingCollective::ready_point; null: everything enqueued on the
  // compute stream so far). Each chunk goes to consume(chunk, offset, bytes)
  // on the calling thread, in order; `chunk` is the backend's memory, valid
  // during the call only. Returns when the last chunk is consumed. CUDA:
  // pinned landing buffers and a copy stream of its own; the default (and
  // the CPU's, whose device memory is host memory) needs no landing.
  using HostChunkSink = std::function<void(const void* chunk, size_t offset, size_t bytes)>;
  virtual void copy_to_host_chunks(const void* src, size_t bytes, const std::shared_ptr<void>& ready,
                                   const HostChunkSink& consume);

  // ---- timing on the compute stream (the pipeline's measured bubble) -------
  // A point in the compute stream's order, stamped with the time the stream
  // reaches it. The default, right for any backend whose ops run
  // synchronously on the calling thread (the CPU's), reads the host clock
  // now; CUDA records a timing event on the compute stream, so a host that
  // only enqueues work still measures what the GPU did. ms_between waits
  // until `to` has been reached: read marks after the step's host sync.
  virtual std::shared_ptr<void> time_mark() {
    return std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  }
  virtual double ms_between(const std::shared_ptr<void>& from, const std::shared_ptr<void>& to) {
    using TP = std::chrono::steady_clock::time_point;
    return std::chrono::duration<double, std::milli>(*static_cast<const TP*>(to.get()) -
                                                     *static_cast<const TP*>(from.get()))
        .count();
  }

  // ---- conversions (master fp32 <-> act dtype) ----------------------------
  // dst (act dtype, n) = src (fp32, n). On fp32 backends with dst == src, a no-op.
  virtual void cast_from_f32(void* dst, const float* src, int64_t n) = 0;
  virtual void cast_to_f32(float* dst, const void* src, int64_t n) = 0;

  // ---- embedding: out(B,T,C) = wte[tokens] + wpe[t] -----------------------
  // With pos (document masking, above): wpe[pos[b,t]] instead of wpe[t].
  // wpe null: no position table (Llama and the other RoPE families): out =
  // wte[tokens], and encoder_backward's dwpe is null too.
  virtual void encoder_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                               int B, int T, int C, const int32_t* pos = nullptr) = 0;
  // dwte(V,C) += scatter(dout), dwpe(T,C) += sum_b dout (with pos: the
  // scatter of dout by pos). Deterministic.
  virtual void encoder_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens,
                                int B, int T, int C, const int32_t* pos = nullptr) = 0;

  // ---- LayerNorm over the last dim: out = (x-mean)*rstd*w + b, eps 1e-5 -----
  virtual void layernorm_forward(void* out, float* mean, float* rstd, const void* inp,
                                 const void* weight, const void* bias, int N, int C) = 0;
  // Fused residual add + LayerNorm (forward only): res_out = a + b, then
  // out = LayerNorm(res_out) as above. res_out must not alias a or b. Its
  // backward is layernorm_backward into the residual gradient: the add
  // passes its gradient through unchanged, and that op accumulates.
  virtual void residual_layernorm_forward(void* res_out, void* out, float* mean, float* rstd, const void* a,
                                          const void* b, const void* weight, const void* bias, int N, int C) = 0;
  // dinp += .., dweight += .., dbias += ..
  virtual void layernorm_backward(void* dinp, float* dweight, float* dbias, const void* dout,
                                  const void* inp, const void* weight, const float* mean,
                                  const float* rstd, int N, int C) = 0;

  // ---- linear: out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC) -----------
  // bias may be null. weight row-major (OC,C), as torch.nn.Linear.
  virtual void matmul_forward(void* out, const void* inp, const void* weight, const void* bias,
                              int N, int C, int OC) = 0;
  // dinp(N,C) = dout @ weight (overwritten; skipped when null),
  // dweight(OC,C) += dout^T @ inp, dbias(OC) += sum_n dout (each skipped
  // when null: zero_bubble computes dinp and dweight in separate steps).
  virtual void matmul_backward(void* dinp, float* dweight, float* dbias, const void* dout,
                               const void* inp, const void* weight, int N, int C, int OC) = 0;

  // ---- linear + GELU: the MLP's first layer and its backward ---------------
  // pre(N,OC) = inp @ weight^T + bias; out = gelu(pre). Both are kept: the
  // next layer reads out, the backward reads pre. A GPU fuses the GELU into
  // the GEMM's epilogue (saves a read and a write of the (N,OC) activation).
  virtual void matmul_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const void* bias, int N,
                                   int C, int OC) = 0;
  // The backward of a linear layer whose input was gelu(pre), fused with
  // GELU's backward: dinp(N,C) = (dout @ weight) * gelu'(pre) (overwritten),
  // dweight/dbias += as matmul_backward. pre is (N,C).
  virtual void matmul_backward_dgelu(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                     const void* weight, const void* pre, int N, int C, int OC) = 0;

  // ---- tied LM head over row-padded logits ---------------------------------
  // Row stride (elements) of the logits buffer, >= V. The CUDA backend pads
  // it to a multiple of 64 so each row starts 128-byte aligned: with
  // V = 50257 an unpadded bf16 row is only 2-byte aligned, which forces
  // cuBLASLt onto slow kernels for the largest GEMMs of the model. The pad
  // columns [V, ldv) are never written or read. The CPU needs no padding.
  virtual int logits_stride(int V) const { return V; }
  // logits(N, ldv)[:, :V] = inp(N,C) @ wte(V,C)^T.
  virtual void lm_head_forward(void* logits, const void* inp, const void* wte, int N, int C, int V, int ldv) = 0;
  // dinp(N,C) = dlogits[:, :V] @ wte (overwritten), dwte(V,C) += dlogits[:, :V]^T @ inp
  // (null: skipped, as for a frozen base under adapters).
  virtual void lm_head_backward(void* dinp, float* dwte, const void* dlogits, const void* inp, const void* wte, int N,
                                int C, int V, int ldv) = 0;

  // ---- causal self-attention ------------------------------------------------
  // qkv(B,T,3C) holds q|k|v, each split into NH heads of HS; out(B,T,C).
  // `saved` is backend-private state for backward, attention_saved_floats() long
  // (the CPU keeps the (B,NH,T,T) probabilities; a flash kernel keeps (B,NH,T) log-sum-exp).
  virtual size_t attention_saved_floats(int B, int T, int NH) const = 0;
  // With doc_start (document masking, above) query t sees keys [doc_start, t].
  virtual void attention_forward(void* out, float* saved, const void* qkv, int B, int T, int C,
                                 int NH, const int32_t* doc_start = nullptr) = 0;
  // dqkv(B,T,3C) overwritten. `out` is the forward's output (B,T,C): a flash
  // backward needs rowsum(dout * out) and must not have to recompute it.
  virtual void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                  const float* saved, int B, int T, int C, int NH,
                                  const int32_t* doc_start = nullptr) = 0;
  // Incremental (KV-cached) causal attention for one sequence, the sampler's
  // op. qkv(Tq,3C) holds q|k|v of Tq new tokens at positions [pos, pos+Tq).
  // Their k and v are first written to rows [pos, pos+Tq) of kcache and
  // vcache (each (maxT, C), act dtype, row r = position r, heads side by
  // side as in qkv); then out(Tq,C) row i = softmax(q_i K[0..pos+i]^T /
  // sqrt(HS)) V[0..pos+i] per head. Tq = the prompt's length prefills the
  // cache in one call; Tq = 1 decodes one token. No saved state: inference only.
  virtual void attention_kv_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq,
                                    int C, int NH) = 0;

  // ---- GELU (tanh approximation), elementwise ------------------------------
  virtual void gelu_forward(void* out, const void* inp, int64_t n) = 0;
  // dinp = gelu'(inp) * dout (overwritten; dinp may alias dout).
  virtual void gelu_backward(void* dinp, const void* inp, const void* dout, int64_t n) = 0;

  // ---- residual: out = a + b ------------------------------------------------
  virtual void residual_forward(void* out, const void* a, const void* b, int64_t n) = 0;
  // x(n) *= s in the activation dtype, as torch multiplies a tensor by a
  // scalar tensor of its dtype: s rounded to that dtype first (bf16: nearest
  // even), an fp32 product, one rounding (Gemma 2's embedding scale and its
  // gradient). On fp32 it is scale().
  virtual void scale_act(void* x, float s, int64_t n) {
    if (act_dtype() != DType::F32) not_implemented("scale_act");
    scale(static_cast<float*>(x), s, n);
  }

  // ---- fused softmax + cross-entropy over logits(N,V), rows ldv apart --------
  // losses(N) = -log softmax(logits)[target]. When dlogits is non-null it
  // receives dloss_scale * (softmax - onehot(target)) (may alias logits, which
  // is then overwritten). Targets < 0 are ignored (loss 0, grad 0). Both
  // buffers have row stride ldv >= V; columns [V, ldv) are not touched.
  // cap > 0 (Gemma 2's final logit soft-cap): the logits are the capped
  // y = cap * tanh(z / cap) (logit_softcap_forward) and dlogits is the
  // gradient of the *uncapped* z: the above times dy/dz = 1 - (y / cap)^2,
  // read back from y itself, so nothing else is kept.
  virtual void softmax_cross_entropy(float* losses, void* dlogits, const void* logits, const int32_t* targets, int N,
                                     int V, int ldv, float dloss_scale, float cap = 0.f) = 0;
  // x(N, ldv)[:, :V] act dtype, row n times w[n] (fp32, device): per-token
  // weights on the cross-entropy gradient (the preference objectives,
  // core/train/preference.h). Columns [V, ldv) are not touched.
  virtual void scale_rows(void* x, const float* w, int N, int V, int ldv) { not_implemented("scale_rows"); }
  // Final logit soft-capping: logits[:, :V] <- cap * tanh(logits / cap), in
  // place (what the model returns as its logits). Elementwise, so a rank's
  // vocabulary columns cap alone (tensor parallelism).
  virtual void logit_softcap_forward(void* logits, int N, int V, int ldv, float cap) {
    not_implemented("logit_softcap_forward");
  }

  // ---- Llama ops (RMSNorm, RoPE, SwiGLU, grouped-query attention) ----------------
  // Defaults throw (see the top of this file); the CPU backend has them all.

  // RMSNorm over the last dim, as HF's LlamaRMSNorm, in fp32:
  // out(N,C) = inp * rstd * (w_offset + weight), rstd(N) = 1/sqrt(mean_c(inp^2) + eps) (kept for backward).
  // w_offset is 1 for Gemma 2's RMSNorm (x * (1 + w), its weights stored around 0), else 0;
  // the backward takes the same w_offset.
  virtual void rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int N, int C, float eps,
                               float w_offset = 0.f) {
    not_implemented("rmsnorm_forward");
  }
  // Fused residual add + RMSNorm (forward only), as residual_layernorm_forward:
  // res_out = a + b, then out = RMSNorm(res_out). res_out must not alias a or b;
  // the backward is rmsnorm_backward into the residual gradient.
  virtual void residual_rmsnorm_forward(void* res_out, void* out, float* rstd, const void* a, const void* b,
                                        const void* weight, int N, int C, float eps, float w_offset = 0.f) {
    not_implemented("residual_rmsnorm_forward");
  }
  // dinp(N,C) += .., dweight(C) += .. (as layernorm_backward).
  virtual void rmsnorm_backward(void* dinp, float* dweight, const void* dout, const void* inp, const void* weight,
                                const float* rstd, int N, int C, float w_offset = 0.f) {
    not_implemented("rmsnorm_backward");
  }

  // Rotary position embedding, HF Llama's convention (rotate_half): within a
  // head, element i pairs with i + HS/2, and at position p
  //   x'[i]      = x[i] cos(p f_i) - x[i+HS/2] sin(p f_i)
  //   x'[i+HS/2] = x[i+HS/2] cos(p f_i) + x[i] sin(p f_i),   i < HS/2.
  // Applied in place to the q and k heads of the fused qkv(B,T,(NH+2*NKV)*HS)
  // (per row: NH q heads | NKV k heads | NKV v heads); v is not touched. Row t
  // is at position pos0 + t (pos0 > 0: KV-cached decoding; training uses 0).
  // cos_sin is fp32 device memory (maxT, HS/2, 2): cos_sin[(p*HS/2 + i)*2] =
  // cos(p f_i), [.. + 1] = sin(p f_i), as kernels/rope_table.h computes it on
  // the host; it needs maxT >= pos0 + T rows. HS must be even. With pos
  // (document masking, above) row (b,t) is at position pos0 + pos[b,t].
  virtual void rope_forward(void* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                            const int32_t* pos = nullptr) {
    not_implemented("rope_forward");
  }
  // In place on dqkv's dq and dk heads: the transposed rotation (angle -p f_i).
  // dv is not touched (v passes through RoPE unchanged).
  virtual void rope_backward(void* dqkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                             const int32_t* pos = nullptr) {
    not_implemented("rope_backward");
  }

  // qk-norm (Qwen3): RMSNorm over each head's HS values of q and of k in the
  // fused qkv(N,(NH+2*NKV)*HS) rows (NH q heads | NKV k heads | NKV v heads),
  // in place, before RoPE. Every q head is scaled by wq(HS), every k head by
  // wk(HS); v is not touched. pre(N,(NH+NKV)*HS) receives the q|k values
  // before the norm and rstd(N,NH+NKV) fp32 one statistic per head, for the
  // backward:  rstd = 1/sqrt(mean(x^2) + eps), x' = x * rstd * w.
  virtual void qk_norm_forward(void* qkv, void* pre, float* rstd, const void* wq, const void* wk, int N, int NH,
                               int NKV, int HS, float eps) {
    not_implemented("qk_norm_forward");
  }
  // In place on dqkv's dq and dk heads (d normalised in, d pre-norm out; dv
  // untouched); dwq(HS) and dwk(HS) fp32 accumulate (+=), as rmsnorm_backward.
  virtual void qk_norm_backward(void* dqkv, float* dwq, float* dwk, const void* pre, const void* wq, const void* wk,
                                const float* rstd, int N, int NH, int NKV, int HS) {
    not_implemented("qk_norm_backward");
  }

  // SwiGLU: inp(N,2F) holds gate | up per row (the fused gate|up GEMM's
  // output); out(N,F) = silu(gate) * up, silu(x) = x * sigmoid(x).
  virtual void swiglu_forward(void* out, const void* inp, int N, int F) { not_implemented("swiglu_forward"); }
  // dinp(N,2F) = [dout * up * silu'(gate) | dout * silu(gate)] (overwritten;
  // dinp may alias inp).
  virtual void swiglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) {
    not_implemented("swiglu_backward");
  }
  // GeGLU (Gemma 2's MLP, HF hidden_activation gelu_pytorch_tanh), as SwiGLU
  // with gelu (tanh approximation) for silu: out(N,F) = gelu(gate) * up;
  // dinp(N,2F) = [dout * up * gelu'(gate) | dout * gelu(gate)] (may alias inp).
  virtual void geglu_forward(void* out, const void* inp, int N, int F) { not_implemented("geglu_forward"); }
  virtual void geglu_backward(void* dinp, const void* dout, const void* inp, int N, int F) {
    not_implemented("geglu_backward");
  }

  // Causal grouped-query self-attention. qkv(B,T,(NH+2*NKV)*HS) is laid out
  // as for rope_forward; NKV divides NH and query head h uses key/value head
  // h / (NH/NKV) (HF's repeat_kv). out(B,T,NH*HS), heads side by side. With
  // NKV == NH it is attention_forward with C = NH*HS. `saved` is
  // backend-private, attention_gqa_saved_floats() long.
  virtual size_t attention_gqa_saved_floats(int B, int T, int NH) const {
    not_implemented("attention_gqa_saved_floats");
  }
  // opt: AttentionOptions (above); a backend refuses by name what it does not implement.
  virtual void attention_gqa_forward(void* out, float* saved, const void* qkv, int B, int T, int NH, int NKV,
                                     int HS, const int32_t* doc_start = nullptr, const AttentionOptions& opt = {}) {
    not_implemented("attention_gqa_forward");
  }
  // dqkv(B,T,(NH+2*NKV)*HS) overwritten. dk and dv of a KV head are summed
  // over the query heads of its group in a fixed order, so the result is
  // bit-reproducible run to run and across thread counts.
  virtual void attention_gqa_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                      const float* saved, int B, int T, int NH, int NKV, int HS,
                                      const int32_t* doc_start = nullptr, const AttentionOptions& opt = {}) {
    not_implemented("attention_gqa_backward");
  }
  // KV-cached grouped-query attention for one sequence, as attention_kv_forward:
  // qkv(Tq,(NH+2*NKV)*HS) holds the Tq new tokens at positions [pos, pos+Tq)
  // (already rotated by rope_forward with pos0 = pos); their k and v heads go
  // to rows [pos, pos+Tq) of kcache and vcache (each (maxT, NKV*HS)), then
  // out(Tq, NH*HS) row i attends to cache rows [0, pos+i]. With opt.window
  // W > 0 the caches are rings of W rows (position p at row p % W): row i
  // attends to positions (pos+i-W, pos+i], the Tq new rows included, and
  // the ring keeps the last W positions (the decoder's cache stays W long).
  virtual void attention_kv_gqa_forward(void* out, void* kcache, void* vcache, const void* qkv, int pos, int Tq,
                                        int NH, int NKV, int HS, const AttentionOptions& opt = {}) {
    not_implemented("attention_kv_gqa_forward");
  }

  // ---- attention by blocks (context parallelism; kernels/attention_block.h) ----------
  // out/lse per AttentionBlock's strides (out in act dtype, lse fp32).
  virtual void attention_block_forward(void* out, float* lse, const AttentionBlock& a) {
    not_implemented("attention_block_forward");
  }
  // dq (laid out like a.q, q_ld/q_bs), dk and dv (like a.k/a.v) are fp32 and
  // accumulate; dout and out use o_ld/o_bs, lse lse_bs/lse_hs.
  virtual void attention_block_backward(float* dq, float* dk, float* dv, const void* dout, const void* out,
                                        const float* lse, const AttentionBlock& a) {
    not_implemented("attention_block_backward");
  }
  // out/lse (a's o_* and lse_* strides) merged with a dense block partial
  // block_out (B,Tq,NH*HS) act dtype and block_lse (B,NH,Tq) fp32.
  virtual void attention_block_merge(void* out, float* lse, const void* block_out, const float* block_lse,
                                     const AttentionBlock& a) {
    not_implemented("attention_block_merge");
  }
  // rows x cols elements from src (row stride src_ld) to dst (dst_ld), each
  // side fp32 or the act dtype (converted): packs K/V for the ring, moves
  // heads and rows for all_to_all, writes fp32 gradients into act dqkv.
  virtual void copy_rows(void* dst, DType dst_type, int64_t dst_ld, const void* src, DType src_type, int64_t src_ld,
                         int64_t rows, int64_t cols) {
    not_implemented("copy_rows");
  }
  // dst += src over rows x cols fp32 elements (row strides dst_ld, src_ld):
  // all_to_all attention sums a replicated KV head's gradient over the
  // ranks that used it, in rank order.
  virtual void add_rows_f32(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) {
    not_implemented("add_rows_f32");
  }

  // ---- vocab-parallel embedding and cross-entropy (tensor parallelism) ----------
  // A rank of a TP group holds rows [v_begin, v_begin + v_count) of the
  // vocabulary (wte(v_count, C) here is that slice). Defaults throw.
  //
  // out(B,T,C) = (v_begin <= tok < v_begin + v_count ? wte[tok - v_begin] : 0)
  //            + (wpe ? wpe[t] : 0).
  // Summed over the group (all-reduce) it is encoder_forward: exactly one
  // rank owns each token; one rank passes wpe, the others null.
  // With pos (document masking): wpe[pos[b,t]], as encoder_forward.
  virtual void vocab_embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                                       int v_begin, int v_count, int B, int T, int C,
                                       const int32_t* pos = nullptr) {
    not_implemented("vocab_embedding_forward");
  }
  // dwte(v_count,C) += scatter of dout over the tokens in range; dwpe(T,C)
  // += sum_b dout when dwpe is non-null. Deterministic, as encoder_backward.
  virtual void vocab_embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens,
                                        int v_begin, int v_count, int B, int T, int C,
                                        const int32_t* pos = nullptr) {
    not_implemented("vocab_embedding_backward");
  }
  // Cross-entropy over logits split by vocabulary, without gathering them
  // (Megatron's vocab-parallel cross-entropy). logits(N, ldv)[:, :V] are
  // this rank's V columns, global ids [v_begin, v_begin + V). Three steps,
  // with the caller's all-reduces between them:
  //   vocab_ce_max:     rowmax(N) = max_j logits[n, j]  (-inf when V = 0)   -> all-reduce max
  //   vocab_ce_sumexp:  stats(2N): [0,N) sum_j exp(logits[n,j] - rowmax[n]),
  //                     [N,2N) logits[n, target - v_begin] when this rank
  //                     holds the target, else 0                          -> all-reduce sum
  //   vocab_ce_finish:  losses(N) = log(stats[n]) + rowmax[n] - stats[N+n];
  //                     with dlogits (may alias logits), dloss_scale *
  //                     (softmax - onehot(target)) on this rank's columns,
  //                     times 1 - (logits / cap)^2 when cap > 0 (the logits
  //                     are soft-capped: as softmax_cross_entropy's cap).
  // Targets < 0 are ignored (loss 0, grad 0), as in softmax_cross_entropy.
  virtual void vocab_ce_max(float* rowmax, const void* logits, int N, int V, int ldv) {
    not_implemented("vocab_ce_max");
  }
  virtual void vocab_ce_sumexp(float* stats, const void* logits, const int32_t* targets, const float* rowmax,
                               int v_begin, int N, int V, int ldv) {
    not_implemented("vocab_ce_sumexp");
  }
  virtual void vocab_ce_finish(float* losses, void* dlogits, const void* logits, const int32_t* targets,
                               const float* rowmax, const float* stats, int v_begin, int N, int V, int ldv,
                               float dloss_scale, float cap = 0.f) {
    not_implemented("vocab_ce_finish");
  }

  // ---- the adapters' small products (core/model/adapter) -------------------------
  // c (M,N), rows ldc apart = alpha * op(a) @ op(b) + beta * c, where op(x) is
  // x or x^T (GemmOp::T) and a, b are act dtype with rows lda / ldb apart;
  // c is act dtype, or fp32 with c_f32 (the adapters' weight gradients,
  // accumulated with beta = 1; CUDA takes beta 0 or 1 only). LoRA needs products with a strided output
  // (its share of a fused q|k|v GEMM) and accumulation into one, which
  // matmul_forward/backward do not give.
  enum class GemmOp { N, T };
  virtual void gemm(void* c, int ldc, bool c_f32, const void* a, int lda, GemmOp ta, const void* b, int ldb,
                    GemmOp tb, int M, int N, int K, float alpha, float beta) {
    not_implemented("gemm");
  }
  // Inverted dropout, counter-based: out (N,C) = inp * keep / (1 - p), where
  // keep for element (n, c) is hash(seed, (row0 + n) * C + c) >= p, so the
  // mask depends on the global row, not on which rank or micro-batch holds
  // it. Applied to a gradient with the same arguments it is its own
  // backward. out may alias inp. A slice of wider rows (a row-parallel
  // linear's input columns under tensor parallelism) keys its elements as
  // the whole rows would: key_cols is the whole row's width (0: C) and col0
  // the slice's first column, so the key is (row0 + n) * key_cols + col0 + c
  // and every rank draws the mask one rank draws.
  virtual void dropout_forward(void* out, const void* inp, int N, int C, float p, uint64_t seed, int64_t row0,
                               int64_t key_cols = 0, int64_t col0 = 0) {
    not_implemented("dropout_forward");
  }
  // DoRA (Liu et al. 2024, as peft computes it; core/model/adapter/dora.cpp):
  // the adapted weight W' = g * (W + s B A) per output row o, g = mag / norm,
  // norm_o = ||W_o + s (B A)_o|| held constant (no gradient through it).
  //   row_norms:     out[o] = ||w[o, :]||_2 over `cols` (w act dtype, rows
  //                  contiguous; out fp32)
  //   dora_forward:  y[n, o] += (g_o - 1) xw[n, o] + g_o s xba[n, o], where
  //                  xw = dropout(x) W^T and xba = dropout(x) A^T B^T (N, out,
  //                  rows `out` apart; y rows ldy apart): the extra output
  //                  peft adds to the base linear's
  //   dora_backward: dmag[o] += sum_n dy[n, o] (xw[n, o] + s xba[n, o]) / norm_o
  //                  (fp32, accumulated), then in place xw := (g - 1) dy (the
  //                  gradient of xw) and xba := g s dy (that of xba)
  // mag is the magnitude parameter (act dtype, `out` values).
  virtual void row_norms(float* out, const void* w, int rows, int cols) { not_implemented("row_norms"); }
  // Under tensor parallelism a row-parallel target's rows are split over
  // the group: each rank's out[o] = sum of w[o, :]^2 over its columns (fp32),
  // the group sums them, and sqrt_in_place (x = sqrt(x), n fp32) gives the norm.
  virtual void row_sum_squares(float* out, const void* w, int rows, int cols) { not_implemented("row_sum_squares"); }
  virtual void sqrt_in_place(float* x, int64_t n) { not_implemented("sqrt_in_place"); }
  virtual void dora_forward(void* y, int ldy, const void* xw, const void* xba, const void* mag, const float* norm,
                            float s, int N, int out) {
    not_implemented("dora_forward");
  }
  virtual void dora_backward(float* dmag, void* xw, void* xba, const void* dy, int ldy, const void* mag,
                             const float* norm, float s, int N, int out) {
    not_implemented("dora_backward");
  }

  // ---- NF4 dequantization (QLoRA's frozen base; kernels/nf4_format.h) -------------
  // out (n) = the NF4 tensor's values, fp32 (out_dtype F32) or bf16 (BF16,
  // round to nearest even), whatever the backend's act dtype:
  //   out[i] = ftz(code[nibble i] * ftz(ftz(map[qabsmax[i/64]] * absmax2[i/16384]) + offset))
  // packed (ceil(n/2) bytes, element 2j in byte j's high nibble), qabsmax
  // (ceil(n/64) bytes), absmax2 (ceil(n/16384) fp32) and map (the 256-entry
  // dynamic map, fp32) are device memory; offset is the tensor's. Every
  // backend gives the same bits (no fused multiply-add, bitsandbytes'
  // subnormal flush).
  virtual void nf4_dequantize(void* out, DType out_dtype, const uint8_t* packed, const uint8_t* qabsmax,
                              const float* absmax2, const float* map, float offset, int64_t n) {
    not_implemented("nf4_dequantize");
  }
  // The same with each 64-block's dequantized absmax given instead of
  // qabsmax/absmax2/map/offset (block_absmax (ceil(n/64)) fp32, device):
  //   out[i] = ftz(code[nibble i] * block_absmax[i/64])
  // For a tensor-parallel rank's NF4 slice (nf4_frozen_store.cpp): its
  // blocks are whole blocks of the global tensor but not a contiguous run
  // of them (a row-parallel slice takes a few blocks of every row), so the
  // global double quantization cannot be indexed by local block; the store
  // computes each block's absmax on the host with nf4::block_scale (the
  // same operations as above), so both ops give the same bits.
  virtual void nf4_dequantize_blocks(void* out, DType out_dtype, const uint8_t* packed, const float* block_absmax,
                                     int64_t n) {
    not_implemented("nf4_dequantize_blocks");
  }

  // ---- mixture of experts (core/model/moe/moe_config.h; CPU: cpu_moe.cpp) --------
  // N tokens, E experts, K chosen per token; a "pair" is (token t, slot j),
  // numbered t*K + j. Routing state is fp32 whatever the act dtype (as HF's
  // softmax(router_logits, dtype=float)).
  //
  // moe_route_forward: probs(N,E) = softmax(logits(N,E)), lse(N) its
  // logsumexp, idx(N,K) the K largest probabilities in descending order (ties:
  // the lower expert id), w(N,K) = their probabilities, divided by their sum
  // when renorm.
  virtual void moe_route_forward(float* probs, float* lse, int32_t* idx, float* w, const void* logits, int N, int E,
                                 int K, bool renorm) {
    not_implemented("moe_route_forward");
  }
  // moe_route_select_biased: aux-loss-free balancing (DeepSeek-V3): idx(N,K)
  // again, the K largest probs + bias(E) (ties: the lower expert id), and
  // w(N,K) their probabilities without the bias (renormalised when renorm):
  // the bias steers the choice only. The backward is moe_route_backward's.
  virtual void moe_route_select_biased(int32_t* idx, float* w, const float* probs, const float* bias, int N, int E,
                                       int K, bool renorm) {
    not_implemented("moe_route_select_biased (model.moe_balance: bias)");
  }
  // The router's backward, dlogits(N,E) (act dtype, overwritten), through
  // the softmax from: dw(N,K) the chosen weights' gradient (through the
  // renormalisation when renorm), aux_grad(E) a gradient on every token's
  // probabilities (the load-balancing loss's; null: none), and z_scale *
  // lse * probs added to dlogits (the z-loss's, d lse^2 = 2 lse p).
  virtual void moe_route_backward(void* dlogits, const float* dw, const float* probs, const float* lse,
                                  const int32_t* idx, const float* aux_grad, float z_scale, int N, int E, int K,
                                  bool renorm) {
    not_implemented("moe_route_backward");
  }
  // stats(2E+1) += [0,E) pairs routed to each expert, [E,2E) sum_t probs[t,e],
  // [2E] sum_t lse^2: what the losses below and the load metrics need.
  virtual void moe_router_stats(float* stats, const float* probs, const float* lse, const int32_t* idx, int N, int E,
                                int K) {
    not_implemented("moe_router_stats");
  }
  // The router losses from stats summed over `tokens` router rows (every
  // layer's tokens): out[0] = aux = E * sum_e count_e * psum_e / tokens^2,
  // out[1] = z = lse2 / tokens; losses(n) += aux_coef * aux + z_coef * z
  // (each per-token loss carries the micro-batch's share); aux_grad(E) =
  // grad_scale * aux_coef * E * count_e / tokens^2, the gradient of that
  // term on each probability (moe_route_backward). All on the device.
  virtual void moe_aux_loss(float* out, float* aux_grad, float* losses, int n, const float* stats, int64_t tokens,
                            int E, float aux_coef, float z_coef, float grad_scale) {
    not_implemented("moe_aux_loss");
  }
  // Into expert order: a stable counting sort of the N*K pairs by expert.
  // pos(N*K): pair p's row in expert order; offsets(E+1): expert e's rows
  // are [offsets[e], offsets[e+1]); xp(N*K,C) row pos[t*K+j] = x[t].
  virtual void moe_permute(int32_t* pos, int32_t* offsets, void* xp, const int32_t* idx, const void* x, int N, int K,
                           int E, int C) {
    not_implemented("moe_permute");
  }
  // dx(N,C) += sum_j dxp[pos[t*K+j]] (accumulates, as the residual's norms do).
  virtual void moe_permute_backward(void* dx, const void* dxp, const int32_t* pos, int N, int K, int C) {
    not_implemented("moe_permute_backward");
  }
  // Grouped GEMM over expert order: rows [offsets[e], offsets[e+1]) of
  // out(R,OC) = those of in(R,IC) @ w[e]^T, w(E,OC,IC) stacked nn.Linear
  // weights. offsets is device memory (moe_permute's).
  virtual void moe_expert_matmul_forward(void* out, const void* in, const void* w, const int32_t* offsets, int E,
                                         int IC, int OC) {
    not_implemented("moe_expert_matmul_forward");
  }
  // din(R,IC) = dout @ w[e] per group (overwritten; null skipped), dw(E,OC,IC)
  // += dout^T @ in per group (null skipped), as matmul_backward.
  virtual void moe_expert_matmul_backward(void* din, float* dw, const void* dout, const void* in, const void* w,
                                          const int32_t* offsets, int E, int IC, int OC) {
    not_implemented("moe_expert_matmul_backward");
  }
  // Back to token order: out(N,C) = sum_j w[t,j] * yp[pos[t*K+j]] (overwritten).
  virtual void moe_unpermute_forward(void* out, const void* yp, const int32_t* pos, const float* w, int N, int K,
                                     int C) {
    not_implemented("moe_unpermute_forward");
  }
  // dyp[pos[t*K+j]] = w[t,j] * dout[t] and dw[t,j] = dout[t] . yp[pos[t*K+j]] (both overwritten).
  virtual void moe_unpermute_backward(void* dyp, float* dw, const void* dout, const void* yp, const int32_t* pos,
                                      const float* w, int N, int K, int C) {
    not_implemented("moe_unpermute_backward");
  }
  // Qwen2-MoE's shared expert: out(N,C) += sigmoid(g[t]) * y(N,C)[t], g(N) act dtype.
  virtual void moe_sigmoid_gate_forward(void* out, const void* y, const void* g, int N, int C) {
    not_implemented("moe_sigmoid_gate_forward");
  }
  // dy(N,C) = sigmoid(g) * dout, dg(N) = (dout . y) * sigmoid'(g) (both overwritten, act dtype).
  virtual void moe_sigmoid_gate_backward(void* dy, void* dg, const void* dout, const void* y, const void* g, int N,
                                         int C) {
    not_implemented("moe_sigmoid_gate_backward");
  }

  // ---- optimizer --------------------------------------------------------------
  // out[0] += sum(x^2) over n fp32 values (for the global grad norm).
  virtual void sum_squares(float* out, const float* x, int64_t n) = 0;
  // out[0] += sum(x) over n fp32 values. The trainer keeps the step's loss
  // total on the device with it, so no micro-batch waits for a host copy.
  virtual void sum(float* out, const float* x, int64_t n) = 0;
  virtual void scale(float* x, float s, int64_t n) = 0;
  // dst += src (fp32): accumulating reduce-scattered gradient shards.
  virtual void accumulate(float* dst, const float* src, int64_t n) = 0;
  // Fused AdamW on one contiguous range. grad is multiplied by grad_scale
  // (clipping) first. master/m/v fp32; param (act dtype) receives the
  // updated weights (may alias master on fp32 backends). `step` is 1-based
  // for bias correction. weight_decay is decoupled: w -= lr*wd*w.
  virtual void adamw_update(float* master, void* param, const float* grad, float* m, float* v,
                            int64_t n, float lr, float beta1, float beta2, float eps,
                            float weight_decay, int step, float grad_scale) = 0;

 protected:
  [[noreturn]] void not_implemented(const char* op) const {
    TR_FAIL(op, ": not implemented by the ", name(), " backend; run this model with backend: cpu until it is");
  }
};

// The CPU backend (fp32, OpenBLAS + OpenMP). `threads` <= 0: OpenMP's default.
// `logits_align` > 1 pads logits rows to a multiple of it, as the CUDA
// backend does (64): the model's padded-logits path then runs, and is
// tested, without a GPU. Training never needs it on the CPU.
std::unique_ptr<Backend> make_cpu_backend(int threads = 0, int logits_align = 1);

// RAII owner of one device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* be, size_t bytes) : be_(be), bytes_(bytes), p_(bytes ? be->alloc(bytes) : nullptr) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      be_ = o.be_; bytes_ = o.bytes_; p_ = o.p_;
      o.p_ = nullptr; o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void reset() {
    if (p_) be_->free(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return p_; }
  template <typename T> T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  Backend* be_ = nullptr;
  size_t bytes_ = 0;
  void* p_ = nullptr;
};

inline void Backend::copy_to_host_chunks(const void* src, size_t bytes, const std::shared_ptr<void>& ready,
                                         const HostChunkSink& consume) {
  (void)ready;  // copy_to_host runs after everything enqueued so far
  constexpr size_t kChunk = size_t(4) << 20;
  std::vector<unsigned char> landing(std::min(bytes, kChunk));
  for (size_t off = 0; off < bytes; off += kChunk) {
    const size_t n = std::min(kChunk, bytes - off);
    copy_to_host(landing.data(), static_cast<const unsigned char*>(src) + off, n);
    consume(landing.data(), off, n);
  }
}

}  // namespace trainrun
