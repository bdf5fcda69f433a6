// Activation functions as device code, shared by the kernels that apply them
// (gelu.cu, swiglu.cu's gated MLPs). Include from .cu files only.
//
//   gelu_tanh(x)  = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)   (GPT-2, Gemma 2's GeGLU)
//   gelu_tanh'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3*0.044715 x^2)
//   silu(x)       = x sigma(x),  silu'(x) = sigma(x) (1 + x (1 - sigma(x)))  (Llama's SwiGLU)
// sigma uses __expf: for large |x| e^-x overflows to inf or underflows to 0,
// so sigma saturates to 0 or 1 (never inf/inf).
#pragma once
#include <cuda_runtime.h>

namespace trainrun::cuda {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

__device__ __forceinline__ float gelu_tanh_f(float x) {
  const float u = kGeluScale * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}
__device__ __forceinline__ float gelu_tanh_grad_f(float x) {
  const float u = kGeluScale * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + __expf(-x)); }

// The gate activations of the gated MLPs: act(x) and act'(x) together
// (they share their transcendental).
struct SiluAct {
  __device__ __forceinline__ static void both(float x, float& f, float& df) {
    const float s = sigmoid_f(x);
    f = x * s;
    df = s * (1.0f + x * (1.0f - s));
  }
  __device__ __forceinline__ static float value(float x) { return x * sigmoid_f(x); }
};
struct GeluTanhAct {
  __device__ __forceinline__ static void both(float x, float& f, float& df) {
    const float u = kGeluScale * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    f = 0.5f * x * (1.0f + th);
    df = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
  }
  __device__ __forceinline__ static float value(float x) { return gelu_tanh_f(x); }
};

}  // namespace trainrun::cuda
