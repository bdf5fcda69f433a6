// The MLP's GELU fused into its neighbouring GEMMs through cuBLASLt
// epilogues (gemm.h), row-major shapes as matmul.cuh:
//
//   forward   pre(N,OC) = inp(N,C) @ weight(OC,C)^T + bias;  out = gelu(pre)
//             -> matmul_forward's product with GeluAuxBias: D = out, aux = pre (ld OC)
//   backward  dinp(N,C) = (dout(N,OC) @ weight(OC,C)) * gelu'(pre(N,C))
//             -> matmul_backward's dinp product with DGelu: aux = pre (ld C)
//
// cuBLASLt's GELU is the tanh approximation, as GPT-2 and gelu.cuh. Each
// returns false, having done nothing, when cuBLASLt has no algorithm for the
// fused descriptor (aux needs ld a multiple of 8; alignments); the caller
// then runs the unfused pair. The CPU backend is the reference for both.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"

namespace trainrun::cuda {

bool matmul_gelu_forward(Gemm& gemm, bf16* out, bf16* pre, const bf16* inp, const bf16* weight, const bf16* bias,
                         int N, int C, int OC, cudaStream_t stream);

bool matmul_dinp_dgelu(Gemm& gemm, bf16* dinp, const bf16* dout, const bf16* weight, const bf16* pre, int N, int C,
                       int OC, cudaStream_t stream);

}  // namespace trainrun::cuda
