// LayerNorm over the last dimension, forward and backward.
//
//   forward   mean(N), rstd(N) = 1/sqrt(var + 1e-5) (biased variance, fp32, saved)
//             out(N,C) = (inp - mean) * rstd * weight(C) + bias(C)                  (bf16)
//   backward  xhat = (inp - mean) * rstd, g = dout * weight,
//             dinp(N,C) += rstd * (g - mean_c(g) - xhat * mean_c(g * xhat))   (bf16, +=)
//             dweight(C) += sum_n dout * xhat,  dbias(C) += sum_n dout      (fp32, +=)
//
// Forward: one warp per row, statistics in fp32 (two passes over the row:
// mean, then centred variance, which is exact where E[x^2]-E[x]^2 cancels).
// Backward: a fixed grid; each block owns a contiguous range of rows and
// keeps dweight/dbias partials of 2C floats in shared memory, one per
// "team" of warps (8 teams of 1 warp for small C, down to 1 team of all 8
// warps from C = 3070 up, so the partials stay within 48 KiB where they can:
// C = 4096 uses 32 KiB, C = 8192 64 KiB through the opt-in limit); threads
// own channels, so no atomics. The block combines its teams in order into
// one partial row in `scratch`, and a second kernel adds the blocks'
// partials in block order to dweight/dbias: deterministic for a given GPU.
// The grid fills every SM to its occupancy (cudaOccupancyMax-
// ActiveBlocksPerMultiprocessor); that and the opt-in limit are queried
// once per device and cached. C is limited by the opt-in shared memory:
// about 29000 channels on an H100, 20800 on an A100 (a clear error above).
// residual_layernorm_forward fuses the residual add in front of it:
// res_out = a + b (bf16, rounded), then LayerNorm of res_out; it saves the
// (N,C) write-then-read of the residual stream between two kernels. Backward
// needs no fused twin: layernorm_backward already accumulates into the
// residual stream's gradient (dinp +=), which is the add's backward.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight, const bf16* bias,
                       int N, int C, cudaStream_t stream);

void residual_layernorm_forward(bf16* res_out, bf16* out, float* mean, float* rstd, const bf16* a, const bf16* b,
                                const bf16* weight, const bf16* bias, int N, int C, cudaStream_t stream);

size_t layernorm_backward_scratch_bytes(int N, int C, int num_sms);
void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int N, int C, float* scratch,
                        int num_sms, cudaStream_t stream);

}  // namespace trainrun::cuda
