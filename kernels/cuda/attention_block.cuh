// Attention by blocks on the GPU (context parallelism): the math, masks and
// layouts are kernels/attention_block.h's. This first version is the
// straightforward one, for correctness against the CPU op (test_cuda_ops),
// not speed: one thread per (b, h, query row) for the forward, the merge and
// dq; one thread per (b, g, key row) for dk and dv, looping over the group's
// query heads and the query rows that see the key, so every sum runs in a
// fixed order with no atomics (deterministic). fp32 math on bf16 operands;
// HS <= 256. A tiled flash kernel taking the block's offsets is the
// integration's work. Not yet run on a GPU.
#pragma once
#include <cuda_runtime.h>

#include "kernels/attention_block.h"
#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void attention_block_forward(bf16* out, float* lse, const AttentionBlock& a, cudaStream_t stream);
void attention_block_backward(float* dq, float* dk, float* dv, const bf16* dout, const bf16* out, const float* lse,
                              const AttentionBlock& a, cudaStream_t stream);
void attention_block_merge(bf16* out, float* lse, const bf16* block_out, const float* block_lse,
                           const AttentionBlock& a, cudaStream_t stream);
// Element types: bf16 when the flag is set, else fp32.
void copy_rows(void* dst, bool dst_bf16, int64_t dst_ld, const void* src, bool src_bf16, int64_t src_ld, int64_t rows,
               int64_t cols, cudaStream_t stream);
void add_rows_f32(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols,
                  cudaStream_t stream);

}  // namespace trainrun::cuda
