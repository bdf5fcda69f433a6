// KV-cached causal attention for one sequence (the sampler's op), forward
// only: prefill (Tq = the prompt's length) and decode (Tq = 1); multi-head
// (GPT-2) and grouped-query (Llama).
//
// Shapes (bf16 throughout; scale = 1/sqrt(HS); C = NH*HS, KV = NKV*HS):
//   qkv     (Tq, C + 2*KV)  per row NH q heads | NKV k heads | NKV v heads of
//                           the Tq new tokens, at positions [pos, pos+Tq)
//   kcache  (maxT, KV)      row r = the keys of position r, heads side by side (as in qkv)
//   vcache  (maxT, KV)      likewise the values
//   out     (Tq, C)
// Query head h reads key/value head g = h / (NH/NKV). Multi-head attention
// is NKV = NH (qkv (Tq, 3C), caches (maxT, C)); both entry points run the
// same kernels, so attention_kv_gqa_forward with NKV == NH gives
// attention_kv_forward's bits.
// Math, per query head h and new token i (its position is pos + i), without
// a window (with one: attention_kv_gqa_forward below):
//   kcache[pos+i], vcache[pos+i] = k_i, v_i                      (first, for every i)
//   s_j   = scale * q_i,h . kcache[j, g]   for j in [0, pos+i]   (fp32)
//   out_i,h = sum_j softmax(s)_j vcache[j, g]                    (fp32, rounded to bf16 once)
// Rows >= pos+Tq of the caches are never read, rows outside [pos, pos+Tq)
// never written.
//
// Two kernels: the cache write, then the attention (a separate launch, so
// every block sees every new row; same stream, so no extra sync).
// Attention: CUDA cores, fp32, online (flash-style) softmax; the scores and
// probabilities never leave registers. A block is 8 warps for one query
// head (with GQA the R query heads of a group read the same cache rows, the
// repeats mostly from L2); the warps are split as QPB queries x S key
// splits (S = 8 for decode, fewer as Tq grows, 1 from Tq = 8 up). A warp walks its query's keys 32 at a time
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

#include "kernels/backend.h"  // AttentionOptions
#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

constexpr int kKvMaxHeadSize = 256;

void attention_kv_forward(bf16* out, bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int C, int NH,
                          cudaStream_t stream);
// opt (kernels/backend.h): scale replaces 1/sqrt(HS), softcap caps the
// scaled scores, and window W > 0 makes the caches rings of W rows (position
// p at row p % W, Backend::attention_kv_gqa_forward): query i sees keys
// (pos+i-W, pos+i], read from the ring (older positions) or from qkv (the
// new ones), the 32-key chunks left of the window skipped; the last
// min(Tq, W) new rows are written to the ring after the attention.
void attention_kv_gqa_forward(bf16* out, bf16* kcache, bf16* vcache, const bf16* qkv, int pos, int Tq, int NH,
                              int NKV, int HS, cudaStream_t stream, const AttentionOptions& opt = {});

}  // namespace trainrun::cuda
