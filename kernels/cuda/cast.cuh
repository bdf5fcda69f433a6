// Casts between the fp32 master copy and the bf16 activation/parameter dtype.
//
//   cast_f32_to_bf16   dst(n) = bf16(src(n))   round to nearest even
//   cast_bf16_to_f32   dst(n) = float(src(n))  exact
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void cast_f32_to_bf16(bf16* dst, const float* src, int64_t n, cudaStream_t stream);
void cast_bf16_to_f32(float* dst, const bf16* src, int64_t n, cudaStream_t stream);

}  // namespace trainrun::cuda
