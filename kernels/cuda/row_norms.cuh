// Row norms (Backend::row_norms; DoRA's ||W + s B A|| per output row, and
// its magnitudes' init ||W||):
//
//   out[o] = sqrt(sum_i w[o, i]^2),   w (rows, cols) bf16, rows contiguous; out (rows) fp32
//
// Computed in fp32: each lane of a warp accumulates its share of the row's
// squares (fmaf), then the warp's fixed butterfly adds the lanes, so the
// result is deterministic. (The CPU sums in double; from the same bf16
// values the two differ by a few fp32 ulps, ~1e-6 relative at 8192 columns.)
//
// One warp per row, 8 rows per 256-thread block; 16-byte packs (8 bf16 per
// lane per step) when cols % 8 == 0 and w is 16-byte aligned (then every
// row is), else one element per lane per step.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void row_norms(float* out, const bf16* w, int rows, int cols, cudaStream_t stream);
// The same sums without the root (out[o] = sum_i w[o, i]^2), and the root in
// place (x[i] = sqrt(x[i]), n fp32): a row-parallel DoRA target under tensor
// parallelism sums its ranks' partial squares between the two.
void row_sum_squares(float* out, const bf16* w, int rows, int cols, cudaStream_t stream);
void sqrt_in_place(float* x, int64_t n, cudaStream_t stream);

}  // namespace trainrun::cuda
