// Tensor parallelism's vocab-parallel embedding and cross-entropy (the math
// is in kernels/backend.h). A rank holds vocabulary rows [v_begin,
// v_begin + v_count).
//
//   vocab_embedding_forward   out(B,T,C) = (tok in range ? wte[tok - v_begin] : 0) + (wpe ? wpe[t] : 0)   (bf16)
//   vocab_embedding_backward  the deterministic encoder_backward (encoder.cuh) on tokens remapped to
//                             local ids, out-of-range ones to a spare row (v_count) of an fp32 scratch
//                             table that is then added to dwte; the positions' sum goes to dwpe, or to
//                             a scratch table when dwpe is null. Scratch: vocab_embedding_backward_scratch_bytes.
//   vocab_ce_max              rowmax(N): one block per row.
//   vocab_ce_sumexp           stats(2N): sum exp(z - rowmax), the target's logit when held (else 0).
//   vocab_ce_finish           losses = log(S) + M - z_t; dlogits (may alias logits) = scale * (softmax - onehot),
//                             times 1 - (z / cap)^2 when cap > 0 (soft-capped logits: softmax_cross_entropy.cuh).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void vocab_embedding_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int v_begin,
                             int v_count, int B, int T, int C, cudaStream_t stream, const int32_t* pos = nullptr);
size_t vocab_embedding_backward_scratch_bytes(int v_count, int B, int T, int C);
void vocab_embedding_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int v_begin,
                              int v_count, int B, int T, int C, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream, const int32_t* pos = nullptr);

void vocab_ce_max(float* rowmax, const bf16* logits, int N, int V, int64_t ldv, cudaStream_t stream);
void vocab_ce_sumexp(float* stats, const bf16* logits, const int32_t* targets, const float* rowmax, int v_begin, int N,
                     int V, int64_t ldv, cudaStream_t stream);
void vocab_ce_finish(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, const float* rowmax,
                     const float* stats, int v_begin, int N, int V, int64_t ldv, float dloss_scale,
                     cudaStream_t stream, float cap = 0.f);

}  // namespace trainrun::cuda
