// Linear layer (torch.nn.Linear layout), forward and backward, on the one
// cuBLASLt entry point (gemm.h). Row-major shapes as kernels/backend.h:
//
//   forward   out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC)            (bf16 out)
//             col-major: out^T(OC,N) = op_T(weight: (C,OC), ld C) @ inp^T (C,N), ld C
//             -> m=OC n=N k=C, A=weight transposed, B=inp, epilogue Bias when bias
//   backward  dinp(N,C) = dout(N,OC) @ weight(OC,C)                       (bf16, overwritten)
//             -> m=C n=N k=OC, A=weight (C,OC) ld C, B=dout^T (OC,N) ld OC
//             dweight(OC,C) += dout^T @ inp                                (fp32, +=: beta 1)
//             -> m=C n=OC k=N, A=inp^T (C,N) ld C, B=dout transposed (N,OC) ld OC
//             dbias(OC) += sum_n dout[n,:]                                 (fp32, +=)
//
// dbias: by default our own deterministic column-sum kernel (fixed grid,
// partials summed in order, then +=). With TRAINRUN_CUDA_GEMM_BGRAD=1 the
// dweight GEMM computes it in its BGRADB epilogue into scratch (cuBLASLt
// overwrites bias gradients) and one small kernel adds it; that saves a read
// of dout but its reduction order is cuBLASLt's. A shape for which cuBLASLt
// has no BGRADB algorithm silently uses the kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"

namespace trainrun::cuda {

// The three products of a linear layer as cuBLASLt descriptors (the
// mapping above), shared by the ops, the GELU-epilogue variants and the
// benchmark. ld_out: the row stride of out/dout, OC when 0.
GemmDesc linear_forward_desc(int N, int C, int OC, bool bias, int64_t ld_out = 0);   // bf16 out
GemmDesc linear_dinp_desc(int N, int C, int OC, int64_t ld_out = 0);                 // bf16 dinp, overwritten
GemmDesc linear_dweight_desc(int N, int C, int OC, int64_t ld_out = 0);              // fp32 dweight, +=

// ld_out: the row stride of out (and of dout in backward), OC when 0; the
// tied LM head passes its padded logits stride (kernels/backend.h).
void matmul_forward(Gemm& gemm, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C,
                    int OC, cudaStream_t stream, int64_t ld_out = 0);

size_t matmul_backward_scratch_bytes(int N, int OC);
void matmul_backward(Gemm& gemm, bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                     const bf16* weight, int N, int C, int OC, bool bgrad_epilogue, float* scratch,
                     cudaStream_t stream, int64_t ld_out = 0);

// dbias(OC) += column sums of dout(N,OC); deterministic. scratch: bias_grad_scratch_bytes.
size_t bias_grad_scratch_bytes(int N, int OC);
void bias_grad_accumulate(float* dbias, const bf16* dout, int N, int OC, float* scratch, cudaStream_t stream);

}  // namespace trainrun::cuda
