// Fused AdamW on one contiguous range of n parameters:
//
//   g = grad * grad_scale                       (grad_scale: global-norm clipping)
//   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
//   w = w - lr * ( (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * w )
//   master(n) = w (fp32),  param(n) = bf16(w) (round to nearest even)
//
// bc1 = 1 - beta1^step and bc2 = 1 - beta2^step are computed by the caller in
// double (as the CPU backend does). One pass: reads grad, m, v, master, writes
// m, v, master, param (26 bytes per parameter).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

struct AdamWArgs {
  float lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale;
};

void adamw_update(float* master, bf16* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& a,
                  cudaStream_t stream);

}  // namespace trainrun::cuda
