// Sum of squares for the global gradient norm:  out[0] += sum_i x(n)[i]^2   (fp32),
// and the plain sum for loss totals.
//
// Deterministic two-stage reduction: a grid whose size depends only on n
// writes one fp32 partial per block (per-thread fp32 accumulation, then the
// fixed-order block_sum); one block adds the partials in block order (in
// double) and adds the total to out[0]. Scratch: sum_squares_scratch_bytes(n).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace trainrun::cuda {

size_t sum_squares_scratch_bytes(int64_t n);
void sum_squares(float* out, const float* x, int64_t n, float* scratch, cudaStream_t stream);
// out[0] += sum_i x[i]: the same reduction without the square (loss totals).
void sum(float* out, const float* x, int64_t n, float* scratch, cudaStream_t stream);

}  // namespace trainrun::cuda
