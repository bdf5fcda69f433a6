// Causal self-attention, multi-head and grouped-query, flash style: no
// (T,T) matrix in memory.
//
// qkv(B,T,(NH+2*NKV)*HS) holds per row NH q heads | NKV k heads | NKV v
// heads, HS wide each: q head h at columns [h*HS, (h+1)*HS), k head g at
// (NH+g)*HS, v head g at (NH+NKV+g)*HS. Query head h reads key/value head
// g = h / R, R = NH/NKV (HF's repeat_kv). out(B,T,NH*HS); scale = 1/sqrt(HS).
// Multi-head attention (GPT-2) is NKV = NH with C = NH*HS: qkv(B,T,3C), k
// head h at C + h*HS, v at 2C + h*HS. Both entry points run the same kernels
// (the head indices are the only difference), so attention_gqa_* with NKV
// == NH gives attention_*'s bits.
//
//   forward   S = q_h k_g^T * scale (causal), P = softmax(S), out_h = P v_g,
//             lse(B,NH,T) = log-sum-exp of each row of S (fp32, saved)
//   backward  D_i = dout_i . out_i                           (preprocess, fp32 scratch)
//             P = exp(S - lse), dP = dout_h v_g^T, dS = P * (dP - D)
//             dq_h = dS k_g * scale                                  (dqkv overwritten)
//             dk_g = sum_{h in g} dS_h^T q_h * scale, dv_g = sum_{h in g} P_h^T dout_h
//
// Tiles of 64 queries x 64 keys, 4 warps per block, each warp owning 16 rows;
// the products run on the tensor cores through WMMA (bf16 in, fp32
// accumulate); the online softmax and the masks are fp32 on CUDA cores.
// Head sizes up to 128 (padded with zeros to a multiple of 16 in shared
// memory, so any HS works: 19 pads to 32).
// Forward: one block per (query tile, head, batch), looping over key tiles
// up to the diagonal; O stays in shared memory (fp32) because the online
// softmax rescales its rows and WMMA fragments do not expose their rows.
// Forward with GQA: each block reads the K/V tiles of its query head's
// group (the R blocks of a group read the same tiles, mostly from L2).
// Backward, deterministic (no atomics), in two kernels: dk/dv per (key
// tile, key/value head) looping over the group's R query heads in order
// and, for each, the query tiles at and below the diagonal (accumulators in
// registers across the whole group: the sum over the group has a fixed
// order), and dq per (query tile, query head) looping over the key tiles
// (so S and dP are computed twice: 7 products instead of FlashAttention-2's
// 5 with float atomics on dq).
//
// The backward needs the forward's output for D = rowsum(dout * out); the
// Backend interface passes it (the model keeps it as an activation).
//
// Not tuned: no cp.async / TMA pipelining, no wgmma; a cuDNN fused-attention
// alternative is not wired yet.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/backend.h"  // AttentionOptions
#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

constexpr int kAttnMaxHeadSize = 128;

// Floats of `saved` per forward: the log-sum-exp, (B,NH,T).
size_t attention_saved_floats(int B, int T, int NH);
// doc_start (B,T) device int32 or null: document masking, query t sees keys
// [doc_start[b,t], t] (kernels/backend.h). Key tiles before a query tile's
// first document and query tiles past a key tile's last document are
// skipped, so short documents cost less.
void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, cudaStream_t stream,
                       const int32_t* doc_start = nullptr);

// dk/dv query splits: the grid of the dk/dv kernel is (key tiles x S,
// NKV, B); split s of a key tile takes the s-th of S equal runs of the
// tile's (query head, query tile) pairs, writes fp32 partials, and a second
// kernel sums the S partials of each key row in order s = 0..S-1 (fixed,
// so the result is deterministic). S = 1: no partials, the kernel writes
// dk/dv itself as before. `requested` > 0 forces S (tests, benches;
// TRAINRUN_CUDA_ATTN_DKV_SPLITS); 0 picks the smallest S that gives the
// grid two blocks per SM (num_sms), at most 8 and at most the
// key tiles (70B tp8, T = 8192, B = 1: 128 blocks on 132 SMs -> S = 3).
int attention_dkv_splits(int B, int T, int NKV, int requested, int num_sms);
// Scratch of both backwards: D, (B,NH,T) fp32, and with S > 1 the dk/dv
// partials, (B, NKV, key tiles, S, 2, 64, HS) fp32.
size_t attention_backward_scratch_bytes(int B, int T, int NH, int NKV, int HS, int dkv_splits);
void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        float* scratch, int B, int T, int C, int NH, cudaStream_t stream,
                        const int32_t* doc_start = nullptr, int dkv_splits = 1);

// Grouped-query: NKV divides NH; lse (B,NH,T) as attention_saved_floats.
// opt (kernels/backend.h's AttentionOptions): scale replaces 1/sqrt(HS);
// softcap > 0 caps the scaled scores, s -> softcap * tanh(s / softcap) (lse
// is of the capped scores; the backward multiplies dS by 1 - tanh^2);
// window W > 0 limits query t to keys t - W < j <= t: the forward and dq
// loops start at the key tile of the tile's first visible key (whole tiles
// left of the window are skipped, the edge tile masked), the dk/dv loop
// stops at the query tile of the last query that reaches the key tile.
void attention_gqa_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HS,
                           cudaStream_t stream, const int32_t* doc_start = nullptr, const AttentionOptions& opt = {});
void attention_gqa_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                            float* scratch, int B, int T, int NH, int NKV, int HS, cudaStream_t stream,
                            const int32_t* doc_start = nullptr, int dkv_splits = 1, const AttentionOptions& opt = {});

}  // namespace trainrun::cuda
