// Inverted dropout with the adapters' counter-based mask (Backend::dropout_forward;
// the mask is kernels/dropout_mask.h, shared with the CPU backend):
//
//   out (N,C) = keep(seed, (row0 + n) * C + c) ? inp * 1/(1 - p) : 0
//
// bf16 in and out; the product in fp32, one bf16 rounding. The mask is
// integer math on the global counter, so it is bit-equal to the CPU's for
// the same (seed, row0, N, C, p), and applying the op to a gradient with the
// same arguments is its backward. out may alias inp (each element is read
// and written by one thread, read first).
//
// Memory-bound: one thread per 8 consecutive elements (a 16-byte pack; the
// counter of element idx is row0 * C + idx, so no division) when out and inp
// are 16-byte aligned, else one per element; grid-stride loops.
//
// A column slice of wider rows (a row-parallel linear's input under tensor
// parallelism; key_cols > 0 and not C, or col0 > 0): element (n, c) has the
// counter (row0 + n) * key_cols + col0 + c, the whole rows' one, so every
// rank draws what one rank draws; one element per thread (a division each).
// key_cols 0 means C.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void dropout_forward(bf16* out, const bf16* inp, int N, int C, float p, uint64_t seed, int64_t row0,
                     int64_t key_cols, int64_t col0, cudaStream_t stream);

}  // namespace trainrun::cuda
