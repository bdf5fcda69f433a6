// CPU backend: SwiGLU, the Llama MLP's activation, forward and backward.
//
// inp (N,2F) is the fused gate|up GEMM's output: per row, gate g = inp[:F],
// up u = inp[F:]. With sigma(x) = 1/(1+e^-x) and silu(x) = x sigma(x):
//   forward:  out (N,F) = silu(g) * u
//   backward: dg = dout * u * sigma(g) (1 + g (1 - sigma(g)))   (= dout * u * silu'(g))
//             du = dout * silu(g)
//   dinp (N,2F) = dg | du, overwritten; dinp may alias inp (the model can
//   drop the pre-activation as its gradient replaces it).
// sigma uses fastmath::exp (clamped to [-87, 88], so large |g| saturates to 0
// or 1 instead of producing inf/inf).
#include <cstdint>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/fastmath.h"

namespace trainrun {

namespace {
inline float sigmoid(float x) { return 1.0f / (1.0f + fastmath::exp(-x)); }
}  // namespace

void CpuBackend::swiglu_forward(void* out_, const void* inp_, int N, int F) {
  float* out = static_cast<float*>(out_);
  const float* inp = static_cast<const float*>(inp_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* g = inp + int64_t(n) * 2 * F;
    const float* u = g + F;
    float* o = out + int64_t(n) * F;
#pragma omp simd
    for (int f = 0; f < F; ++f) o[f] = g[f] * sigmoid(g[f]) * u[f];
  }
}

void CpuBackend::swiglu_backward(void* dinp_, const void* dout_, const void* inp_, int N, int F) {
  float* dinp = static_cast<float*>(dinp_);
  const float* dout = static_cast<const float*>(dout_);
  const float* inp = static_cast<const float*>(inp_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* g = inp + int64_t(n) * 2 * F;
    const float* u = g + F;
    const float* dy = dout + int64_t(n) * F;
    float* dg = dinp + int64_t(n) * 2 * F;
    float* du = dg + F;
#pragma omp simd
    for (int f = 0; f < F; ++f) {
      const float gf = g[f], uf = u[f], sg = sigmoid(gf);  // read both before writing: dinp may alias inp
      dg[f] = dy[f] * uf * sg * (1.0f + gf * (1.0f - sg));
      du[f] = dy[f] * gf * sg;
    }
  }
}

}  // namespace trainrun
