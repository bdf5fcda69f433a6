// Attention by blocks on the GPU (context parallelism): the math, masks and
// layouts are kernels/attention_block.h's. Forward and backward are tiled
// flash kernels (64 x 64 tiles on the tensor cores, bf16 in, fp32
// accumulate), built from attention_tiles.cuh's steps like the
// whole-sequence kernels in attention.cu, on the block's strided views and
// global positions (q_pos0, k_pos0): causal masking, per-row document starts
// and the window apply across chunk boundaries, and whole 64 x 64 tiles that
// no query of the tile may see are skipped (attention_block.cu counts them).
// The forward returns the CPU op's partials (out normalised over the block's
// visible keys, lse = m + log l; out = 0, lse = -inf for a row that sees
// none), so attention_block_merge combines them in the ring's fixed order.
// The backward adds (+=) into the caller's fp32 dq, dk, dv: dq per (query
// tile, head), dk/dv per (key tile, KV head) over the group's heads and the
// query tiles in a fixed order, each element written by one block: no
// atomics, deterministic. D = rowsum(dout * out) is recomputed per query
// tile (the op has no scratch). Soft-cap, window and scale as the CPU op.
// Head sizes up to kAttnMaxHeadSize (128). The merge is one thread per row.
//
// Overlap with the ring's K/V transfer (parallel/context/ring_attention.cpp):
// these kernels run on the backend's compute stream. The ring posts the next
// K/V block with Communicator::send_recv_deferred before it enqueues the
// current block's kernels; NcclCommunicator runs that grouped send/recv on
// the cp communicator's own non-blocking stream, after an event recorded on
// the compute stream at the post (so the receive buffer, read by the
// previous step's kernels, is free), and the compute stream waits on the
// transfer's event only at order_compute_after(), after this step's kernels
// are enqueued. Compute and transfer are thus on different streams and
// overlap; nothing here synchronises the host. Not yet run on a GPU.
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
