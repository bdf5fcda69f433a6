// qk-norm (Qwen3Attention's q_norm / k_norm), forward and backward: RMSNorm
// over each head's HS values of q and of k inside the fused q|k|v rows
// (kernels/backend.h; the CPU reference is kernels/cpu/cpu_qk_norm.cpp).
//
//   forward   per (row, head) of the first NH+NKV heads, x its HS values:
//             pre = x (bf16 copy, for the backward), rstd = 1/sqrt(mean(x^2) + eps) (fp32, saved),
//             x' = bf16(bf16(x * rstd) * w)       <- two roundings, as HF's Qwen3RMSNorm
//   backward  xhat = pre * rstd (fp32), g = dy * w,
//             dx = rstd * (g - xhat * mean(g * xhat))  overwrites dy (bf16)
//             dwq / dwk (HS) += sum over rows and heads of dy * xhat (fp32)
//
// One warp per (row, head); lanes take channels c = lane, lane + 32, ...
// (HS <= 256: a lane keeps at most 8 channels in registers). The backward's
// weight gradient: each warp accumulates its heads' dy * xhat per channel
// in registers (q and k apart), the block combines its warps in order in
// shared memory into one partial (2*HS floats) in `scratch`, and a second
// kernel adds the blocks' partials in block order: deterministic for a given
// GPU and shape, no atomics. Not yet run on a GPU (docs/gpu-results.md).
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

constexpr int kQkNormMaxHS = 256;

void qk_norm_forward(bf16* qkv, bf16* pre, float* rstd, const bf16* wq, const bf16* wk, int N, int NH, int NKV,
                     int HS, float eps, cudaStream_t stream);
// scratch: qk_norm_backward_scratch_bytes(N, NH, NKV, HS, num_sms) bytes.
size_t qk_norm_backward_scratch_bytes(int N, int NH, int NKV, int HS, int num_sms);
void qk_norm_backward(bf16* dqkv, float* dwq, float* dwk, const bf16* pre, const bf16* wq, const bf16* wk,
                      const float* rstd, int N, int NH, int NKV, int HS, float* scratch, int num_sms,
                      cudaStream_t stream);

}  // namespace trainrun::cuda
