// One (batch, head) of causal attention on the CPU, forward and backward,
// shared by multi-head (cpu_attention.cpp) and grouped-query
// (cpu_attention_gqa.cpp) attention. q, k, v, dq are (T, HS) strided views
// with leading dimension ld (columns of the fused qkv), dk and dv with
// leading dimension ldkv (ld, or HS for a dense per-head partial); o and dO
// have leading dimension ldo; P and dP are dense (T, T).
//
// Causal block skipping: the rows are taken kCausalBlock at a time, and a
// block of queries [t0, t1) only multiplies keys [0, t1): the sgemms skip
// the zero upper triangle, about 3/8 of the work at T = 256. Every product
// that is skipped is an exact 0 * x term (P and dS are exactly zero above
// the diagonal) that sgemm would have added to an accumulator, so skipping
// it does not change a bit: each output element still sums the same
// non-zero terms in the same order along k. (Tested: the GPT-2 losses and
// the GQA == MHA bit-for-bit test are unchanged.)
//   forward:  S[t0:t1, :t1] = sc q[t0:t1] k[:t1]^T,  P = causal_softmax(S)
//             o[t0:t1] = P[t0:t1, :t1] v[:t1]
//   backward: dP[t0:t1, :t1] = dO[t0:t1] v[:t1]^T,  dS = softmax_backward(dP)
//             dq[t0:t1] = dS[t0:t1, :t1] k[:t1]
//             and by key blocks [j0, j1), the queries [j0, T) that see them:
//             dv[j0:j1] (+)= P[j0:, j0:j1]^T dO[j0:],  dk[j0:j1] (+)= dS[j0:, j0:j1]^T q[j0:]
//   beta_kv 0 overwrites dk/dv, 1 adds (the later heads of a GQA group).
// Soft-capping (Gemma 2, softcap > 0): the scaled scores s go through
// softcap * tanh(s / softcap) before the softmax. The backward recomputes s
// (one more q k^T per block, into the scratch S) for tanh's derivative
// 1 - tanh(s/softcap)^2 rather than keep a second (T, T) matrix per head.
#pragma once
#include <cblas.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/causal_softmax.h"
#include "kernels/cpu/fastmath.h"

namespace trainrun::cpu {

// 64 rows: big enough that each sgemm keeps its speed (HS = 32..128), small
// enough to skip most of the triangle at T = 256..1024.
constexpr int kCausalBlock = 64;

// Which keys a query row t sees: [first(t), t]. ds (T) is this sequence's
// doc_start (kernels/backend.h), null for one document; window > 0 is the
// sliding window (AttentionOptions::window, transformers' Mistral rule
// t - window < j <= t). first(t) = max(ds[t], t - window + 1) never
// decreases along t (doc_start does not), so query block [t0, t1) sees keys
// [first(t0), t1) and key block [j0, j1) is seen by queries [j0,
// queries_end(j1)): up to the first t whose document starts at or after j1,
// and at most j1 + window - 1. The keys before first(t0) are skipped in the
// sgemms, not only masked: with a window W the forward multiplies
// (64 + W - 1) keys per 64-row block instead of t1. The same exact-zero
// argument as the causal skip applies, so without a mask or window (key
// range [0, t1)) every bit is as before.
struct KeyMask {
  const int32_t* ds = nullptr;
  int window = 0;
  KeyMask(const int32_t* doc_start = nullptr, int window_ = 0) : ds(doc_start), window(window_) {}  // NOLINT: implicit
  int first(int t) const {
    const int f = ds ? ds[t] : 0;
    return window > 0 ? std::max(f, t - window + 1) : f;
  }
  int queries_end(int j1, int T) const {
    int end = T;
    if (window > 0) end = std::min<int64_t>(T, int64_t(j1) + window - 1);
    if (!ds) return end;
    int t = j1;
    while (t < end && ds[t] < j1) ++t;
    return t;
  }
};

// The scores of row t over keys [first, t], in place: softcap * tanh(s / softcap).
inline void softcap_row(float* row, int first, int last, float softcap) {
  const float inv = 1.0f / softcap;
#pragma omp simd
  for (int j = first; j <= last; ++j) row[j] = softcap * fastmath::tanh(row[j] * inv);
}

inline void causal_head_forward(float* o, int ldo, float* P, const float* q, const float* k, const float* v, int ld,
                                int T, int HS, float sc, const KeyMask& keys = {}, float softcap = 0.0f) {
  for (int t0 = 0; t0 < T; t0 += kCausalBlock) {
    const int t1 = std::min(T, t0 + kCausalBlock), m = t1 - t0;
    const int kb = keys.first(t0);  // the block's first visible key
    float* Pb = P + int64_t(t0) * T + kb;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, t1 - kb, HS, sc, q + int64_t(t0) * ld, ld,
                k + int64_t(kb) * ld, ld, 0.0f, Pb, T);
    for (int t = t0; t < t1; ++t) {  // zero-fills [0, first) and (t, T)
      if (softcap > 0.0f) softcap_row(P + int64_t(t) * T, keys.first(t), t, softcap);
      causal_softmax_row(P + int64_t(t) * T, keys.first(t), t, T);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, HS, t1 - kb, 1.0f, Pb, T, v + int64_t(kb) * ld, ld, 0.0f,
                o + int64_t(t0) * ldo, ldo);
  }
}

// dP is scratch (T, T); on return it holds dS. With softcap > 0, S is a
// second (T, T) scratch (the recomputed scores).
inline void causal_head_backward(float* dq, float* dk, float* dv, int ldkv, float beta_kv, float* dP, const float* dO,
                                 int ldo, const float* P, const float* q, const float* k, const float* v, int ld, int T,
                                 int HS, float sc, const KeyMask& keys = {}, float softcap = 0.0f,
                                 float* S = nullptr) {
  for (int t0 = 0; t0 < T; t0 += kCausalBlock) {
    const int t1 = std::min(T, t0 + kCausalBlock), m = t1 - t0;
    const int kb = keys.first(t0);
    float* dPb = dP + int64_t(t0) * T + kb;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, t1 - kb, HS, 1.0f, dO + int64_t(t0) * ldo, ldo,
                v + int64_t(kb) * ld, ld, 0.0f, dPb, T);
    for (int t = t0; t < t1; ++t)
      causal_softmax_backward_row(dP + int64_t(t) * T, P + int64_t(t) * T, keys.first(t), t, T,
                                  softcap > 0.0f ? 1.0f : sc);
    if (softcap > 0.0f) {  // through the cap and the scale: dS *= (1 - tanh(s/softcap)^2) sc
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, t1 - kb, HS, sc, q + int64_t(t0) * ld, ld,
                  k + int64_t(kb) * ld, ld, 0.0f, S + int64_t(t0) * T + kb, T);
      const float inv = 1.0f / softcap;
      for (int t = t0; t < t1; ++t) {
        float* d = dP + int64_t(t) * T;
        const float* s = S + int64_t(t) * T;
#pragma omp simd
        for (int j = keys.first(t); j <= t; ++j) {
          const float th = fastmath::tanh(s[j] * inv);
          d[j] *= (1.0f - th * th) * sc;
        }
      }
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, HS, t1 - kb, 1.0f, dPb, T, k + int64_t(kb) * ld, ld,
                0.0f, dq + int64_t(t0) * ld, ld);
  }
  for (int j0 = 0; j0 < T; j0 += kCausalBlock) {
    const int j1 = std::min(T, j0 + kCausalBlock), m = j1 - j0;
    const int kk = keys.queries_end(j1, T) - j0;  // kk: the queries t >= j0 that see a key of the block
    const int64_t at = int64_t(j0) * T + j0;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, HS, kk, 1.0f, P + at, T, dO + int64_t(j0) * ldo, ldo,
                beta_kv, dv + int64_t(j0) * ldkv, ldkv);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, HS, kk, 1.0f, dP + at, T, q + int64_t(j0) * ld, ld,
                beta_kv, dk + int64_t(j0) * ldkv, ldkv);
  }
}

}  // namespace trainrun::cpu
