// Causal multi-head self-attention, flash style: no (T,T) matrix in memory.
//
// qkv(B,T,3C) holds q | k | v; head h of q is columns [h*HS, (h+1)*HS) (k at
// C + h*HS, v at 2C + h*HS); out(B,T,C); HS = C/NH; scale = 1/sqrt(HS).
//
//   forward   S = q k^T * scale (causal), P = softmax(S), out = P v,
//             lse(B,NH,T) = log-sum-exp of each row of S (fp32, saved)
//   backward  D_i = dout_i . out_i                           (preprocess, fp32 scratch)
//             P = exp(S - lse), dP = dout v^T, dS = P * (dP - D)
//             dq = dS k * scale, dk = dS^T q * scale, dv = P^T dout   (dqkv overwritten)
//
// Tiles of 64 queries x 64 keys, 4 warps per block, each warp owning 16 rows;
// the products run on the tensor cores through WMMA (bf16 in, fp32
// accumulate); the online softmax and the masks are fp32 on CUDA cores.
// Head sizes up to 128 (padded with zeros to a multiple of 16 in shared
// memory, so any HS works: 19 pads to 32).
// Forward: one block per (query tile, head, batch), looping over key tiles
// up to the diagonal; O stays in shared memory (fp32) because the online
// softmax rescales its rows and WMMA fragments do not expose their rows.
// Backward, deterministic (no atomics), in two kernels: dk/dv per key tile
// looping over the query tiles at and below the diagonal (accumulators in
// registers), and dq per query tile looping over the key tiles (so S and
// dP are computed twice: 7 products instead of FlashAttention-2's 5 with
// float atomics on dq).
//
// The backward needs the forward's output for D = rowsum(dout * out); the
// Backend interface passes it (the model keeps it as an activation).
//
// Not tuned: no cp.async / TMA pipelining, no wgmma; a cuDNN fused-attention
// alternative is not wired yet.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

constexpr int kAttnMaxHeadSize = 128;

// Floats of `saved` per forward: the log-sum-exp, (B,NH,T).
size_t attention_saved_floats(int B, int T, int NH);
void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, cudaStream_t stream);

size_t attention_backward_scratch_bytes(int B, int T, int NH);
void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        float* scratch, int B, int T, int C, int NH, cudaStream_t stream);

}  // namespace trainrun::cuda
