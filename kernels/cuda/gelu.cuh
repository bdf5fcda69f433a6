// GELU, tanh approximation (GPT-2), elementwise over n values (bf16).
//
//   forward   out = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   backward  dinp = dout * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3*0.044715 x^2))
//             (overwritten; dinp may alias dout)
//
// fp32 math, 16-byte vector access when every pointer is 16-byte aligned.
// The GEMM wrapper can fuse both into the neighbouring matmul (GeluAux,
// DGelu epilogues, matmul_gelu.cuh), which the model uses; these run where
// cuBLASLt has no fused algorithm, or with TRAINRUN_CUDA_GEMM_GELU=0.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void gelu_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream);
void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, cudaStream_t stream);

}  // namespace trainrun::cuda
