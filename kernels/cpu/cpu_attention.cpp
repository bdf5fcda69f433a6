// CPU backend: causal multi-head self-attention, forward and backward.
//
// qkv (B,T,3C) holds q | k | v; head h of q is the HS = C/NH columns at
// h*HS (k at C + h*HS, v at 2C + h*HS), so every per-head matrix is a strided
// view and goes straight to sgemm with lda = 3C — no transposes or copies.
// Forward per (b,h):  S = q k^T / sqrt(HS) (T,T), P = causal_softmax(S),
//                     out[:, h*HS:(h+1)*HS] = P v.
// P (B,NH,T,T) is kept for backward (a GPU flash kernel keeps only the
// log-sum-exp; on the CPU memory is cheap relative to recomputation).
// Backward per (b,h): dP = dout v^T, dS = P * (dP - rowsum(P*dP)) / sqrt(HS),
//                     dq = dS k, dk = dS^T q, dv = P^T dout.
// Each (b,h) is causal_head.h's forward/backward, which skips the masked
// upper triangle block by block without changing a bit, and with doc_start
// (document masking) also the blocks of keys before a block's document.
// The (b,h) pairs are spread over OpenMP threads; inside the parallel region
// the OpenMP build of OpenBLAS runs each sgemm single-threaded. The row
// softmax and its backward are shared with grouped-query attention
// (causal_softmax.h; cpu_attention_gqa.cpp).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/causal_head.h"
#include "kernels/cpu/causal_softmax.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/fastmath.h"

namespace trainrun {

size_t CpuBackend::attention_saved_floats(int B, int T, int NH) const {
  return size_t(B) * NH * T * T;
}

void CpuBackend::attention_forward(void* out_, float* saved, const void* qkv_, int B, int T, int C, int NH,
                                   const int32_t* doc_start) {
  float* out = static_cast<float*>(out_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int HS = C / NH;
  const int C3 = 3 * C;
  const float sc = 1.0f / std::sqrt(float(HS));
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH;
    const float* q = qkv + int64_t(b) * T * C3 + h * HS;
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* P = saved + int64_t(bh) * T * T;
    cpu::causal_head_forward(out + int64_t(b) * T * C + h * HS, C, P, q, k, v, C3, T, HS, sc,
                             doc_start ? doc_start + int64_t(b) * T : nullptr);
  }
}

void CpuBackend::attention_backward(void* dqkv_, const void* dout_, const void* qkv_, const void* /*out: P is kept*/,
                                    const float* saved, int B, int T, int C, int NH, const int32_t* doc_start) {
  float* dqkv = static_cast<float*>(dqkv_);
  const float* dout = static_cast<const float*>(dout_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int HS = C / NH;
  const int C3 = 3 * C;
  const float sc = 1.0f / std::sqrt(float(HS));
  const int nt = threads();
  std::vector<float> scratch(size_t(nt) * T * T);
#pragma omp parallel num_threads(nt)
  {
    float* dP = scratch.data() + size_t(omp_get_thread_num()) * T * T;
#pragma omp for schedule(static)
    for (int bh = 0; bh < B * NH; ++bh) {
      const int b = bh / NH, h = bh % NH;
      const int64_t base = int64_t(b) * T * C3 + h * HS;
      const float* q = qkv + base;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + base;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* P = saved + int64_t(bh) * T * T;
      const float* dO = dout + int64_t(b) * T * C + h * HS;
      cpu::causal_head_backward(dq, dk, dv, C3, 0.0f, dP, dO, C, P, q, k, v, C3, T, HS, sc,
                                doc_start ? doc_start + int64_t(b) * T : nullptr);
    }
  }
}

}  // namespace trainrun

namespace trainrun {

// KV-cached attention (sampling): append the new tokens' k and v to the
// cache, then each new query i attends to cache rows [0, pos+i]. Per head
// the scores are one sgemm (Tq x (pos+Tq)) over the cache, masked above each
// query's own position; decoding (Tq = 1) is a matrix-vector product.
void CpuBackend::attention_kv_forward(void* out_, void* kcache_, void* vcache_, const void* qkv_, int pos, int Tq,
                                      int C, int NH) {
  float* out = static_cast<float*>(out_);
  float* kc = static_cast<float*>(kcache_);
  float* vc = static_cast<float*>(vcache_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int HS = C / NH, C3 = 3 * C, Tk = pos + Tq;
  const float sc = 1.0f / std::sqrt(float(HS));
  for (int i = 0; i < Tq; ++i) {
    std::copy(qkv + int64_t(i) * C3 + C, qkv + int64_t(i) * C3 + 2 * C, kc + int64_t(pos + i) * C);
    std::copy(qkv + int64_t(i) * C3 + 2 * C, qkv + int64_t(i) * C3 + 3 * C, vc + int64_t(pos + i) * C);
  }
  const int nt = std::min(threads(), NH);
  std::vector<float> scratch(size_t(nt) * Tq * Tk);
#pragma omp parallel num_threads(nt)
  {
    float* S = scratch.data() + size_t(omp_get_thread_num()) * Tq * Tk;
#pragma omp for schedule(static)
    for (int h = 0; h < NH; ++h) {
      const float* q = qkv + h * HS;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, HS, sc, q, C3, kc + h * HS, C, 0.0f, S, Tk);
      for (int i = 0; i < Tq; ++i) {
        float* row = S + int64_t(i) * Tk;
        const int last = pos + i;  // the query's own position: the causal edge
        float mx = -INFINITY;
        for (int j = 0; j <= last; ++j) mx = std::max(mx, row[j]);
        float sum = 0.0f;
        for (int j = 0; j <= last; ++j) sum += row[j] = fastmath::exp(row[j] - mx);
        const float inv = 1.0f / sum;
        for (int j = 0; j <= last; ++j) row[j] *= inv;
        for (int j = last + 1; j < Tk; ++j) row[j] = 0.0f;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, HS, Tk, 1.0f, S, Tk, vc + h * HS, C, 0.0f,
                  out + h * HS, C);
    }
  }
}

}  // namespace trainrun
