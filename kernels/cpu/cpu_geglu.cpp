// CPU backend: GeGLU, Gemma 2's MLP activation, forward and backward.
//
// As SwiGLU (cpu_swiglu.cpp) with gelu for silu: inp (N,2F) holds gate g |
// up u per row, and with gelu the tanh approximation (HF's
// gelu_pytorch_tanh, the GELU of cpu_backend.cpp):
//   gelu(x)  = 0.5 x (1 + tanh(a)),  a = sqrt(2/pi) (x + 0.044715 x^3)
//   gelu'(x) = 0.5 (1 + tanh(a)) + 0.5 x (1 - tanh(a)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//   forward:  out (N,F) = gelu(g) * u
//   backward: dg = dout * u * gelu'(g),  du = dout * gelu(g);  dinp (N,2F) =
//   dg | du, overwritten; dinp may alias inp.
#include <cstdint>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/fastmath.h"

namespace trainrun {

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline float tanh_arg(float x) { return kSqrt2OverPi * (x + 0.044715f * x * x * x); }
}  // namespace

void CpuBackend::geglu_forward(void* out_, const void* inp_, int N, int F) {
  float* out = static_cast<float*>(out_);
  const float* inp = static_cast<const float*>(inp_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* g = inp + int64_t(n) * 2 * F;
    const float* u = g + F;
    float* o = out + int64_t(n) * F;
#pragma omp simd
    for (int f = 0; f < F; ++f) o[f] = 0.5f * g[f] * (1.0f + fastmath::tanh(tanh_arg(g[f]))) * u[f];
  }
}

void CpuBackend::geglu_backward(void* dinp_, const void* dout_, const void* inp_, int N, int F) {
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
      const float x = g[f], uf = u[f], th = fastmath::tanh(tanh_arg(x));  // read both before writing: may alias
      const float dgelu =
          0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * x * x);
      dg[f] = dy[f] * uf * dgelu;
      du[f] = dy[f] * 0.5f * x * (1.0f + th);
    }
  }
}

}  // namespace trainrun
