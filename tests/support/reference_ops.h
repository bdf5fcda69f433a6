// Plain double-precision reference implementations of the Backend ops and of
// the whole GPT-2 forward, for the numerical tests.
//
// Why a second implementation: the CPU backend is itself the project's
// numerical reference, so it needs something independent to be checked
// against. These are the textbook loops, in double, with no BLAS, no OpenMP
// and no fusion — slow, but obviously right by reading, and accurate enough
// (double) that central finite differences of them are a trustworthy source
// of gradients for checking the fp32 backward ops.
//
// All tensors are row-major std::vector<double>; shapes use the letters of
// kernels/backend.h (B, T, C, NH, HS = C/NH, V, N rows, OC output channels).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/model/gpt2/gpt2.h"

namespace trainrun::ref {

using Vec = std::vector<double>;
using Tokens = std::vector<int32_t>;

// out(B,T,C) = wte[tokens[b,t]] + wpe[t]
Vec encoder(const Tokens& tokens, const Vec& wte, const Vec& wpe, int B, int T, int C);

// LayerNorm over the last dim of x(N,C): (x - mean) / sqrt(var + 1e-5) * w + b,
// biased variance. When given, mean/rstd (N) receive the row statistics.
Vec layernorm(const Vec& x, const Vec& w, const Vec& b, int N, int C, Vec* mean = nullptr,
              Vec* rstd = nullptr);

// out(N,OC) = x(N,C) W^T + bias, W is (OC,C) as torch.nn.Linear; an empty
// bias means no bias.
Vec linear(const Vec& x, const Vec& W, const Vec& bias, int N, int C, int OC);

// Causal multi-head self-attention. qkv(B,T,3C) holds q | k | v; head h of q
// is columns [h*HS, (h+1)*HS), of k the same shifted by C, of v by 2C.
// out[b,t, h*HS + d] = sum_{j<=t} softmax_j(q_t . k_j / sqrt(HS)) v_j[d].
Vec attention(const Vec& qkv, int B, int T, int C, int NH);

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Vec gelu(const Vec& x);

// out = a + b
Vec residual(const Vec& a, const Vec& b);

// Per-row softmax cross-entropy of logits(N,V): -log softmax(row)[target];
// a negative target is ignored (loss 0).
Vec cross_entropy(const Vec& logits, const Tokens& targets, int N, int V);

// ---- Llama ops -------------------------------------------------------------------

// RMSNorm over the last dim of x(N,C), as HF's LlamaRMSNorm:
// x / sqrt(mean(x^2) + eps) * w. When given, rstd (N) receives 1/sqrt(..).
Vec rmsnorm(const Vec& x, const Vec& w, int N, int C, double eps, Vec* rstd = nullptr);

// RoPE as HF's apply_rotary_pos_emb writes it: x * cos + rotate_half(x) * sin,
// with rotate_half(x) = cat(-x[HS/2:], x[:HS/2]) and cos/sin (HS) the angles
// p * inv_freq (HS/2) repeated over both halves, in double. Applied to the q
// and k heads of qkv(B,T,(NH+2*NKV)*HS) (per row: NH q | NKV k | NKV v heads),
// row t at position pos0 + t; v is copied through.
Vec rope(const Vec& qkv, const Vec& inv_freq, int B, int T, int NH, int NKV, int HS, int pos0);

// SwiGLU: inp(N,2F) = gate | up per row -> out(N,F) = gate * sigmoid(gate) * up.
Vec swiglu(const Vec& inp, int N, int F);

// Causal grouped-query attention over qkv(B,T,(NH+2*NKV)*HS) laid out as for
// rope(): the KV heads are first repeated R = NH/NKV times each (HF's
// repeat_kv: query head h reads KV head h / R), then every query head runs
// the textbook causal softmax attention. out(B,T,NH*HS).
Vec attention_gqa(const Vec& qkv, int B, int T, int NH, int NKV, int HS);
// The same with what kernels/backend.h's AttentionOptions and document
// masks add, straight from the definitions: query t of sequence b sees keys
// j with max(doc_start[b*T+t], t-window+1) <= j <= t (doc_start null: 0;
// window 0: none); scores q.k * scale (0: 1/sqrt(HS)), then softcap *
// tanh(s / softcap) when softcap > 0. Only the visible keys are summed.
Vec attention_gqa_masked(const Vec& qkv, int B, int T, int NH, int NKV, int HS, const int32_t* doc_start, int window,
                         double scale = 0.0, double softcap = 0.0);

// GPT-2 forward (see core/model/gpt2/gpt2.h for the architecture) from the flat
// parameter vector in make_gpt2_layout(cfg)'s layout. Tensors are located by
// their names in the layout, not by recomputing offsets, so a disagreement
// between the layout and the model's own offset arithmetic shows up as a
// test failure. Returns logits (B,T,V); the LM head is tied to wte.
Vec gpt2_logits(const GPT2Config& cfg, const Vec& params, const Tokens& tokens, int B, int T);
// Mean of the per-token losses over all B*T positions (ignored targets count
// as 0 in the sum, matching a backward with dloss_scale = 1/(B*T)).
double gpt2_loss(const GPT2Config& cfg, const Vec& params, const Tokens& tokens, const Tokens& targets,
                 int B, int T);

// ---- test helpers ----------------------------------------------------------------

// sum_i a[i] * b[i]: the scalar L = sum(out * R) whose gradient is checked.
double dot(const Vec& a, const Vec& b);

// Norm-wise relative error ||a - ref||_2 / ||ref||_2 (||a||_2 when ref is all
// zero). Norm-wise rather than element-wise because individual gradient
// entries can be arbitrarily close to zero (cancellations) while the vector
// as a whole is well conditioned; an element-wise relative error would
// report those harmless entries as failures.
double rel_err(const Vec& a, const Vec& ref);

// Central finite differences of f with respect to every entry of x:
// g[i] = (f(x + h e_i) - f(x - h e_i)) / (2h). f reads x (by reference) and
// x is restored after each probe. Truncation error is O(h^2 f'''), round-off
// O(eps |f| / h); with doubles and h = 1e-6 both are ~1e-10 for O(1) values.
Vec central_fd(Vec& x, const std::function<double()>& f, double h = 1e-6);

}  // namespace trainrun::ref
