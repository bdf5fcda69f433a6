// CPU backend: RMSNorm (HF LlamaRMSNorm), forward, fused residual forward
// and backward.
//
// Forward, per row x (C):  rstd = 1/sqrt(mean(x^2) + eps),  y = x * rstd * w.
// With w_offset (Gemma 2: 1) every w below reads w_offset + w; dw is unchanged
// (d(w_offset + w)/dw = 1).
//   out (N,C), rstd (N) saved for backward, weight (C).
// Backward, with xhat = x * rstd and g = dy * w:
//   dx += rstd * (g - xhat * mean(g * xhat)),   dw += sum_rows dy * xhat.
// (d rstd / d x_j = -rstd^3 x_j / C, so the second term is the
// normalisation's own gradient.) dinp and dweight accumulate, as
// layernorm_backward: the residual stream's gradient is the sum of two paths.
// dw is reduced with per-thread partials summed in thread order: bit-identical
// for a fixed thread count.
#include <omp.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

namespace {
inline float* F(void* p) { return static_cast<float*>(p); }
inline const float* F(const void* p) { return static_cast<const float*>(p); }

// One row; both forward ops share it, so the fused residual variant is
// bit-identical to residual_forward followed by rmsnorm_forward.
inline void rmsnorm_row(float* o, float* rstd, const float* x, const float* w, int C, float eps, float wo) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int c = 0; c < C; ++c) ss += x[c] * x[c];
  const float s = 1.0f / std::sqrt(ss / C + eps);
#pragma omp simd
  for (int c = 0; c < C; ++c) o[c] = x[c] * s * (wo + w[c]);
  *rstd = s;
}
}  // namespace

void CpuBackend::rmsnorm_forward(void* out_, float* rstd, const void* inp_, const void* w_, int N, int C, float eps,
                                 float w_offset) {
  float* out = F(out_);
  const float* inp = F(inp_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) rmsnorm_row(out + int64_t(n) * C, rstd + n, inp + int64_t(n) * C, F(w_), C, eps, w_offset);
}

void CpuBackend::residual_rmsnorm_forward(void* res_out_, void* out_, float* rstd, const void* a_, const void* b_,
                                          const void* w_, int N, int C, float eps, float w_offset) {
  float* res = F(res_out_);
  float* out = F(out_);
  const float* a = F(a_);
  const float* b = F(b_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    float* r = res + int64_t(n) * C;
    const float* ar = a + int64_t(n) * C;
    const float* br = b + int64_t(n) * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) r[c] = ar[c] + br[c];
    rmsnorm_row(out + int64_t(n) * C, rstd + n, r, F(w_), C, eps, w_offset);
  }
}

void CpuBackend::rmsnorm_backward(void* dinp_, float* dweight, const void* dout_, const void* inp_, const void* w_,
                                  const float* rstd, int N, int C, float w_offset) {
  float* dinp = F(dinp_);
  const float* dout = F(dout_);
  const float* inp = F(inp_);
  const float* w = F(w_);
  const int nt = threads();
  std::vector<float> partial(size_t(nt) * C, 0.0f);
#pragma omp parallel num_threads(nt)
  {
    float* pdw = partial.data() + size_t(omp_get_thread_num()) * C;
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n) {
      const float* x = inp + int64_t(n) * C;
      const float* dy = dout + int64_t(n) * C;
      float* dx = dinp + int64_t(n) * C;
      const float s = rstd[n];
      float sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_gx)
      for (int c = 0; c < C; ++c) sum_gx += dy[c] * (w_offset + w[c]) * (x[c] * s);
      sum_gx /= C;
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        const float xh = x[c] * s;
        dx[c] += s * (dy[c] * (w_offset + w[c]) - xh * sum_gx);
        pdw[c] += dy[c] * xh;
      }
    }
  }
  for (int t = 0; t < nt; ++t) {
    const float* pdw = partial.data() + size_t(t) * C;
    for (int c = 0; c < C; ++c) dweight[c] += pdw[c];
  }
}

}  // namespace trainrun
