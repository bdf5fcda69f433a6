// The small elementwise ops:
//
//   residual_forward   out(n) = a(n) + b(n)              bf16, fp32 add, rounded once
//   scale_f32          x(n) *= s                         fp32 (gradient scaling)
//   scale_bf16         x(n) = bf16(x * bf16(s))          bf16, s rounded first as torch's bf16 scalar
//                                                        tensor (Gemma 2's embedding scale)
//   accumulate_f32     dst(n) += src(n)                  fp32 (reduce-scattered gradient shards)
//
// Grid-stride loops over 16-byte packs when every pointer is 16-byte
// aligned; a scalar loop (still coalesced) otherwise, e.g. for tensors at odd
// offsets inside a flat parameter buffer. All memory-bound: one read of each
// input and one write of the output.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void residual_forward(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream);
void scale_f32(float* x, float s, int64_t n, cudaStream_t stream);
void scale_bf16(bf16* x, float s, int64_t n, cudaStream_t stream);
void accumulate_f32(float* dst, const float* src, int64_t n, cudaStream_t stream);

}  // namespace trainrun::cuda
