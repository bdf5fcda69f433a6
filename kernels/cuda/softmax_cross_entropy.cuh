// Fused softmax + cross-entropy over logits(N,V) with rows ldv >= V apart
// (the pad columns are not touched), one block per row:
//
//   lse = log sum_v exp(z_v)                    (fp32, online max/sum in one pass)
//   losses(N)[n] = lse - z[target]              (0 for target < 0)
//   dlogits(N,V) = dloss_scale * (exp(z - lse) - onehot(target))   (bf16; 0 for target < 0)
//                  times 1 - (z / cap)^2 when cap > 0: the logits are Gemma 2's soft-capped
//                  z = cap * tanh(x / cap) (logit_softcap.cuh) and the gradient is x's
//
// The probabilities are never stored: the second pass recomputes exp(z - lse)
// and writes the gradient straight over the logits when dlogits aliases them
// (each element is read before it is written, by the same thread). Two reads
// and one write of the row when dlogits is given, one read otherwise.
// Rows of odd V are handled with a scalar head and tail around a 16-byte
// vector body.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void softmax_cross_entropy(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, int N, int V,
                           int64_t ldv, float dloss_scale, cudaStream_t stream, float cap = 0.f);

}  // namespace trainrun::cuda
