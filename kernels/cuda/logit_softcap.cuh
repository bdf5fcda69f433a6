// Final logit soft-capping (Gemma 2's final_logit_softcapping), forward:
//
//   logits(N, :V) <- cap * tanh(logits / cap)   in place, rows ldv >= V apart (pad columns untouched)
//
// bf16 in and out, fp32 math, one rounding (HF: logits / cap, tanh, * cap in
// the logits' dtype, each rounded: within a bf16 ulp of this). The backward
// is the cross-entropy's cap argument (softmax_cross_entropy.cuh,
// vocab_parallel.cuh), which reads tanh' = 1 - (y / cap)^2 back from the
// capped y. Elementwise: under tensor parallelism each rank caps its own
// vocabulary columns. One thread per element in grid-stride loops (memory
// bound: one read and one write of the logits).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void logit_softcap_forward(bf16* logits, int N, int V, int64_t ldv, float cap, cudaStream_t stream);

}  // namespace trainrun::cuda
