// CPU backend: the adapters' ops (core/model/adapter/lora.h), gemm and
// counter-based dropout.
//
//   gemm:    c (M,N) = alpha op(a) op(b) + beta c, one cblas_sgemm (fp32 is
//            both the act dtype and c_f32 here).
//   dropout: out = inp * keep / (1-p), keep(n, c) the counter-based mask of
//            kernels/dropout_mask.h (shared with the CUDA kernel): the same
//            mask for the same global row on any rank and backend, in
//            forward, in the recompute of activation checkpointing and in
//            backward; a column slice (TP) keys (row0+n)*key_cols + col0 + c.
#include <cblas.h>

#include <cstdint>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/dropout_mask.h"

namespace trainrun {

void CpuBackend::gemm(void* c, int ldc, bool c_f32, const void* a, int lda, GemmOp ta, const void* b, int ldb,
                      GemmOp tb, int M, int N, int K, float alpha, float beta) {
  (void)c_f32;  // fp32 either way on the CPU
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, ta == GemmOp::T ? CblasTrans : CblasNoTrans, tb == GemmOp::T ? CblasTrans : CblasNoTrans,
              M, N, K, alpha, static_cast<const float*>(a), lda, static_cast<const float*>(b), ldb, beta,
              static_cast<float*>(c), ldc);
}

void CpuBackend::dropout_forward(void* out_, const void* inp_, int N, int C, float p, uint64_t seed, int64_t row0,
                                 int64_t key_cols, int64_t col0) {
  float* out = static_cast<float*>(out_);
  const float* inp = static_cast<const float*>(inp_);
  const float keep_scale = dropout_mask::keep_scale(p);
  const uint32_t threshold = dropout_mask::threshold(p);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const uint64_t base = uint64_t(row0 + n) * uint64_t(key_cols > 0 ? key_cols : C) + uint64_t(col0);
    for (int c = 0; c < C; ++c) {
      const int64_t i = int64_t(n) * C + c;
      out[i] = dropout_mask::keep(seed, base + uint64_t(c), threshold) ? inp[i] * keep_scale : 0.0f;
    }
  }
}

}  // namespace trainrun
