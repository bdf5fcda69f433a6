// RMSNorm over the last dimension (Llama), forward, fused residual forward
// and backward.
//
//   forward   rstd(N) = 1/sqrt(mean_c(inp^2) + eps)                         (fp32, saved)
//             xhat = bf16(inp * rstd)          <- rounded to bf16 first, as HF
//             out(N,C) = bf16(xhat * weight(C))
//   backward  xhat = inp * rstd (fp32, not rounded), g = dout * weight,
//             dinp(N,C) += rstd * (g - xhat * mean_c(g * xhat))   (bf16, +=)
//             dweight(C) += sum_n dout * xhat                     (fp32, +=)
//
// HF's LlamaRMSNorm computes in fp32 and then does
// `weight * hidden_states.to(input_dtype)`: with bf16 activations x*rstd is
// rounded to bf16 before the weight multiplies it, and the product is
// rounded again. The forward does exactly that (two roundings), so its
// output is HF's bit for bit given the same rstd (the test checks it against
// that formula on the host). The backward is the gradient of the unrounded
// math, in fp32, as the CPU reference (kernels/cpu/cpu_rmsnorm.cpp): torch's
// autograd would use the rounded xhat for dweight, which differs by one
// bf16 rounding per term, well below bf16 training noise.
// eps comes from the call (config.json's rms_norm_eps), never a constant.
// w_offset 1 (Gemma 2's Gemma2RMSNorm, weights stored around 0): out =
// bf16((inp * rstd) * (1 + weight)) all in fp32, one rounding, as HF
// computes it; the backward reads (w_offset + weight) for weight.
//
// Forward: one warp per row (8 rows per block), sum of squares in fp32, then
// a second pass over the row (from L1/L2) to normalise; 16-byte packs when C
// % 8 == 0 and every pointer is 16-byte aligned, scalar otherwise.
// residual_rmsnorm_forward fuses the residual add in front: res_out = a + b
// (rounded to bf16 and stored), the statistics over the rounded values, so
// it is bit-identical to residual_forward followed by rmsnorm_forward.
// Backward: as layernorm_backward (layernorm.cuh), with one partial row
// (dweight, C floats) per team of warps in shared memory: a fixed grid fills
// every SM to its occupancy, each block owns a contiguous range of rows, its
// teams take rows in turn, threads own channels (no atomics); the block
// combines its teams in order into one partial row in `scratch`, and a
// second kernel adds the blocks' partials in block order to dweight:
// deterministic for a given GPU and shape. Teams: 8 up to C = 1535, 4 up
// to 3070 (C = 2048: 32 KiB), 2 up to 6140, then 1 (C = 8192: 32 KiB); the
// opt-in limit allows C up to about 58000 on an H100, 41700 on an A100 (a
// clear error above). The device's opt-in limit and the occupancy of each
// (variant, shared memory) are queried once per device and cached.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int N, int C, float eps,
                     cudaStream_t stream, float w_offset = 0.f);

// res_out must not alias a or b.
void residual_rmsnorm_forward(bf16* res_out, bf16* out, float* rstd, const bf16* a, const bf16* b, const bf16* weight,
                              int N, int C, float eps, cudaStream_t stream, float w_offset = 0.f);

size_t rmsnorm_backward_scratch_bytes(int N, int C, int num_sms);
void rmsnorm_backward(bf16* dinp, float* dweight, const bf16* dout, const bf16* inp, const bf16* weight,
                      const float* rstd, int N, int C, float* scratch, int num_sms, cudaStream_t stream,
                      float w_offset = 0.f);

}  // namespace trainrun::cuda
