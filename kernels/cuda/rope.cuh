// Rotary position embedding (HF Llama's rotate_half form), forward and
// backward, in place on the q and k heads of the fused qkv.
//
// Shapes: qkv (B, T, (NH + 2*NKV) * HS) bf16, per row NH q heads | NKV k
// heads | NKV v heads; cos_sin (maxT, HS/2, 2) fp32 device memory,
// [(p*HS/2 + i)*2] = cos(p f_i), [.. + 1] = sin(p f_i) (kernels/rope_table.h;
// maxT >= pos0 + T, which the caller guarantees: the table's length is not
// passed). Row t is at position p = pos0 + t. For each of the NH + NKV
// rotated heads and i < HS/2, with x1 = x[i], x2 = x[i + HS/2], c, s the
// table's entries at (p, i):
//   forward   x1' = x1 c - x2 s,   x2' = x2 c + x1 s
//   backward  dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s   (the transpose: s -> -s)
// The v heads are never read or written (their gradient passes through).
//
// Rounding: fp32 math on bf16 inputs with the fp32 table, one bf16 rounding
// per output. HF instead casts cos/sin to bf16 and rounds each product and
// the sum (q * cos + rotate_half(q) * sin in bf16): ours is the more
// accurate of the two and matches the fp32 CPU reference more closely. Each
// output is one fmaf and one multiply in a fixed form, so a row gives the
// same bits whichever path (vector or scalar) and whichever call (the whole
// sequence at pos0 = 0, or a piece at pos0 = its first position) rotates it.
//
// One thread per 8 pairs (16-byte packs of x1 and x2, 4 float4 of the
// table) when HS/2 % 8 == 0 and qkv and cos_sin are 16-byte aligned, else one
// per pair; grid-stride loops, 256 threads per block. Each thread reads the
// elements it writes, and no two threads share one: in place is safe.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

// pos (B,T) device int32 or null: document masking, row (b,t) at position
// pos0 + pos[b,t] instead of pos0 + t.
void rope_forward(bf16* qkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                  cudaStream_t stream, const int32_t* pos = nullptr);
void rope_backward(bf16* dqkv, const float* cos_sin, int B, int T, int NH, int NKV, int HS, int pos0,
                   cudaStream_t stream, const int32_t* pos = nullptr);

}  // namespace trainrun::cuda
