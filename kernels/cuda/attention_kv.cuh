// KV-cached causal attention for one sequence (the sampler's op), forward
// only: prefill (Tq = the prompt's length) and decode (Tq = 1).
//
// Shapes (bf16 throughout; HS = C/NH; scale = 1/sqrt(HS)):
//   qkv     (Tq, 3C)   q | k | v of the Tq new tokens, at positions [pos, pos+Tq)
//   kcache  (maxT, C)  row r = the key of position r, heads side by side (as in qkv)
//   vcache  (maxT, C)  likewise the values
//   out     (Tq, C)
// Math, per head h and new token i (its position is pos + i):
//   kcache[pos+i], vcache[pos+i] = k_i, v_i                      (first, for every i)
//   s_j   = scale * q_i . kcache[j, h]     for j in [0, pos+i]   (fp32)
//   out_i = sum_j softmax(s)_j vcache[j, h]                      (fp32, rounded to bf16 once)
// Rows >= pos+Tq of the caches are never read, rows outside [pos, pos+Tq)
// never written.
//
// Two kernels: the cache write, then the attention (a separate launch, so
// every block sees every new row; same stream, so no extra sync).
// Attention: CUDA cores, fp32, online (flash-style) softmax; the scores and
// probabilities never leave registers. A block is 8 warps for one head; the
// warps are split as QPB queries x S key splits (S = 8 for decode, fewer as
// Tq grows, 1 from Tq = 8 up). A warp walks its query's keys 32 at a time
// (chunks s, s+S, s+2S, ... of its split): lane l scores key j0+l against
// the query (kept, pre-scaled, in shared memory), the warp takes the chunk's
// max and sum with shuffles, and then every lane adds the chunk's 32
// p_j * v_j to the head dims it owns (lane + 32t; coalesced v reads). The S
// partial states (max, sum, acc) of a query are merged in a fixed order in
// shared memory, so the result is deterministic.
// Head sizes up to kKvMaxHeadSize (256); any HS works (HS % 8 == 0 with
// 16-byte-aligned buffers takes 16-byte loads of the key rows).
// Not tuned: decode uses one block per head (no split across blocks), the
// products are not on the tensor cores (prefill at pos 0 could reuse the
// WMMA flash kernel of attention.cuh).
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

constexpr int kKvMaxHeadSize = 256;

void attention_kv_forward(bf16* out, bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int C, int NH,
                          cudaStream_t stream);

}  // namespace trainrun::cuda
