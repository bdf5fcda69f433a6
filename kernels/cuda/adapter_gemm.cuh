// The adapters' general product (Backend::gemm; core/model/adapter/lora.h),
// row-major as kernels/backend.h states it:
//
//   c (M,N), rows ldc apart = alpha * op(a) @ op(b) + beta * c,   op(x) = x or x^T
//
// a (rows lda apart) and b (ldb) bf16; c bf16, or fp32 with c_f32 (the
// adapters' weight gradients, accumulated with beta = 1). Computed in fp32:
// cuBLASLt's CUBLAS_COMPUTE_32F accumulates the products and applies alpha
// and beta in fp32; a bf16 c is rounded once, after the + beta c.
//
// Mapping onto the one cuBLASLt entry point (gemm.h, column-major): a
// row-major (R,S) matrix with row stride ld is the column-major (S,R) one
// with the same leading dimension, so
//
//   c^T (N,M) = op(b)^T (N,K) @ op(a)^T (K,M)
//   -> m = N, n = M, k = K; A = b (transa = tb is T, lda = ldb),
//      B = a (transb = ta is T, ldb = lda), D = c (ldd = ldc).
//
// beta is 0 or 1 (GemmDesc::accumulate); the adapters use no other, and any
// other is an Error. M or N = 0: nothing to do; K = 0: c = beta c (zeroed
// rows for beta 0; cuBLASLt refuses k = 0). Strided, offset operands (a
// target's columns inside a fused q|k|v output: ldc = 3C, a pointer
// out_begin elements in, only 2-byte aligned) are what the wrapper's
// alignment-aware plans are for: a slower kernel, never a fault.
#pragma once
#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm.h"

namespace trainrun::cuda {

// The cuBLASLt descriptor of c = alpha op(a) op(b) + beta c (the mapping
// above); the tests and the launcher share it.
GemmDesc adapter_gemm_desc(int ldc, bool c_f32, int lda, Backend::GemmOp ta, int ldb, Backend::GemmOp tb, int M,
                           int N, int K, float beta);

void adapter_gemm(Gemm& gemm, void* c, int ldc, bool c_f32, const bf16* a, int lda, Backend::GemmOp ta,
                  const bf16* b, int ldb, Backend::GemmOp tb, int M, int N, int K, float alpha, float beta,
                  cudaStream_t stream);

}  // namespace trainrun::cuda
