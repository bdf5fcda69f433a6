// DoRA's per-output-row ops (Backend::dora_forward / dora_backward; the
// model side is core/model/adapter/dora.cpp), forward and backward:
//
//   g[o] = mag[o] / norm[o]                                       (fp32)
//   forward   y[n, o] += (g[o] - 1) xw[n, o] + g[o] xba[n, o] s   (peft's order of terms)
//   backward  dmag[o] += sum_n dy[n, o] (xw[n, o] + s xba[n, o]) / norm[o]   (fp32, +=)
//             then in place xw[n, o] := (g[o] - 1) dy[n, o],  xba[n, o] := g[o] s dy[n, o]
//
// Shapes: xw, xba (N, out) bf16, rows `out` apart; y, dy (N, out) bf16 rows
// ldy apart (a target's columns inside a fused output); mag (out) bf16 (the
// parameter); norm (out) fp32; dmag (out) fp32.
//
// fp32 everywhere inside: g, each term, and the dmag sum (the CPU sums it in
// double); every bf16 output is one rounding of its fp32 value (y: of
// y + the fp32 term).
//
// Forward: elementwise, one thread per (n, o), grid-stride. Backward: a
// column reduction that is deterministic: grid (ceil(out/32), row chunks of
// 256), block (32, 8); lane l owns column 32 bx + l (coalesced rows), warp k
// rows k, k+8, ... of the chunk, each thread rewriting the xw and xba
// elements it has read; the 8 warps' sums are combined in order into
// partial[chunk][o], and a second kernel adds the chunks in order, divides by
// norm and adds into dmag. Scratch: dora_backward_scratch_bytes(N, out).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void dora_forward(bf16* y, int ldy, const bf16* xw, const bf16* xba, const bf16* mag, const float* norm, float s,
                  int N, int out, cudaStream_t stream);

size_t dora_backward_scratch_bytes(int N, int out);
void dora_backward(float* dmag, bf16* xw, bf16* xba, const bf16* dy, int ldy, const bf16* mag, const float* norm,
                   float s, int N, int out, float* scratch, cudaStream_t stream);

}  // namespace trainrun::cuda
