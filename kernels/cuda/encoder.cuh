// Token + position embedding, forward and backward.
//
//   forward   out(B,T,C)[b,t,:] = wte(V,C)[tokens[b,t],:] + wpe(maxT,C)[t,:]     (bf16)
//   backward  dwte(V,C)[v,:]  += sum over (b,t) with tokens[b,t] == v of dout[b,t,:]   (fp32)
//             dwpe(maxT,C)[t,:] += sum over b of dout[b,t,:]                          (fp32)
//
// Deterministic backward (no float atomics): the N = B*T positions are
// sorted by token with a stable radix sort (CUB), so every token's positions
// form one run, in position order. The sorted order is cut into chunks of
// kRunChunk = 128 rows, and a run into segments where it crosses a chunk
// boundary. One block per segment and 256-channel slab sums the segment's
// rows (8 row groups, combined in a fixed order):
//   - a run inside one chunk (the usual case) is one segment, and its block
//     adds the sum to dwte[v] directly;
//   - a longer run (a hot token: padding, a frequent word) is split over
//     several blocks: each segment writes its partial sum to scratch (slot
//     2k for the segment that starts chunk k, 2k+1 for a run that starts
//     inside chunk k and leaves it), and a second kernel adds the run's
//     partials to dwte[v] in chunk order.
// Either way each dwte row has exactly one writer and a fixed summation
// order, so the result is bitwise reproducible; a hot token's rows are
// spread over ceil(run / 128) blocks instead of one. dwpe is a plain column
// sum over b, one thread per (t, c), b in order.
// Scratch: encoder_backward_scratch_bytes(N, C) (sort buffers, CUB temp,
// 2 * ceil(N / 128) partial rows of C floats).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

// pos (B,T) device int32 or null (document masking): wpe row pos[b,t]
// instead of t, and dwpe the scatter of dout by pos, summed the same
// deterministic way as dwte (positions sorted like tokens).
void encoder_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                     cudaStream_t stream, const int32_t* pos = nullptr);

// dwpe null: no position gradient (a position-free architecture).
// skip_token >= 0: rows with that token id are left out of dwte (the
// vocab-parallel backward's "another rank's token"); -1: none. The ids
// must be in [0, skip_token] then (skip sorts last).
size_t encoder_backward_scratch_bytes(int N, int C);
void encoder_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream, const int32_t* pos = nullptr,
                      int skip_token = -1);

}  // namespace trainrun::cuda
