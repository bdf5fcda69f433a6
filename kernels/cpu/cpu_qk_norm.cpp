// CPU backend: qk-norm (Qwen3Attention's q_norm / k_norm), forward and
// backward (kernels/backend.h).
//
// Per row n and head h of the first NH+NKV heads (q heads use wq, k heads wk),
// with x the head's HS pre-norm values:
//   forward   rstd = 1/sqrt(mean(x^2) + eps),  xhat = x * rstd,  y = xhat * w
//   backward  g = dy * w,  dx = rstd * (g - xhat * mean(g * xhat)),
//             dw += sum over rows and heads of dy * xhat
// the RMSNorm of cpu_rmsnorm.cpp over HS values instead of C. The backward
// overwrites dy with dx (the q|k gradient flows on to the q|k|v GEMM); dw
// is reduced with per-thread partials summed in thread order: bit-identical
// for a fixed thread count.
#include <omp.h>

#include <cmath>
#include <vector>

#include "core/common/error.h"
#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

namespace {
void check_heads(const char* op, int N, int NH, int NKV, int HS) {
  TR_CHECK(N >= 0 && NH > 0 && NKV > 0 && HS > 0, op, ": N ", N, ", NH ", NH, ", NKV ", NKV, " and HS ", HS,
           " must be positive");
}
}  // namespace

void CpuBackend::qk_norm_forward(void* qkv_, void* pre_, float* rstd, const void* wq_, const void* wk_, int N, int NH,
                                 int NKV, int HS, float eps) {
  check_heads("qk_norm_forward", N, NH, NKV, HS);
  float* qkv = static_cast<float*>(qkv_);
  float* pre = static_cast<float*>(pre_);
  const float* wq = static_cast<const float*>(wq_);
  const float* wk = static_cast<const float*>(wk_);
  const int H = NH + NKV;
  const int64_t ld = int64_t(NH + 2 * NKV) * HS, ldp = int64_t(H) * HS;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < int64_t(N) * H; ++i) {
    const int64_t n = i / H;
    const int h = int(i % H);
    float* x = qkv + n * ld + int64_t(h) * HS;
    float* p = pre + n * ldp + int64_t(h) * HS;
    const float* w = h < NH ? wq : wk;
    float ss = 0.0f;
    for (int c = 0; c < HS; ++c) {
      p[c] = x[c];
      ss += x[c] * x[c];
    }
    const float s = 1.0f / std::sqrt(ss / HS + eps);
    for (int c = 0; c < HS; ++c) x[c] = x[c] * s * w[c];
    rstd[i] = s;
  }
}

void CpuBackend::qk_norm_backward(void* dqkv_, float* dwq, float* dwk, const void* pre_, const void* wq_,
                                  const void* wk_, const float* rstd, int N, int NH, int NKV, int HS) {
  check_heads("qk_norm_backward", N, NH, NKV, HS);
  float* dqkv = static_cast<float*>(dqkv_);
  const float* pre = static_cast<const float*>(pre_);
  const float* wq = static_cast<const float*>(wq_);
  const float* wk = static_cast<const float*>(wk_);
  const int H = NH + NKV;
  const int64_t ld = int64_t(NH + 2 * NKV) * HS, ldp = int64_t(H) * HS;
  const int nt = threads();
  // Per thread: dwq (HS) | dwk (HS).
  std::vector<float> partial(size_t(nt) * 2 * HS, 0.0f);
#pragma omp parallel num_threads(nt)
  {
    float* part = partial.data() + size_t(omp_get_thread_num()) * 2 * HS;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < int64_t(N) * H; ++i) {
      const int64_t n = i / H;
      const int h = int(i % H);
      float* d = dqkv + n * ld + int64_t(h) * HS;
      const float* x = pre + n * ldp + int64_t(h) * HS;
      const float* w = h < NH ? wq : wk;
      float* dw = part + (h < NH ? 0 : HS);
      const float s = rstd[i];
      float sum_gx = 0.0f;
      for (int c = 0; c < HS; ++c) sum_gx += d[c] * w[c] * (x[c] * s);
      sum_gx /= HS;
      for (int c = 0; c < HS; ++c) {
        const float xh = x[c] * s;
        dw[c] += d[c] * xh;
        d[c] = s * (d[c] * w[c] - xh * sum_gx);
      }
    }
  }
  for (int t = 0; t < nt; ++t) {
    const float* part = partial.data() + size_t(t) * 2 * HS;
    if (dwq)
      for (int c = 0; c < HS; ++c) dwq[c] += part[c];
    if (dwk)
      for (int c = 0; c < HS; ++c) dwk[c] += part[HS + c];
  }
}

}  // namespace trainrun
