// Row scaling (Backend::scale_rows): the preference objectives' per-token
// weights on the cross-entropy gradient:
//
//   x[n, v] = bf16(float(x[n, v]) * w[n])   for v < V; x (N, ldv) bf16, w (N) fp32
//
// A grid-stride loop over the N x V elements, one multiply each in fp32,
// rounded once to bf16 (the CPU backend does the same in fp32). A row of
// weight 0 (padding, the prompt) becomes exact zeros. Not yet run on a GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void scale_rows(bf16* x, const float* w, int N, int V, int64_t ldv, cudaStream_t stream);

}  // namespace trainrun::cuda
