// Tokens into expert order and back (backend.h's moe_permute /
// moe_unpermute; the CPU reference is kernels/cpu/cpu_moe.cpp), and
// Qwen2-MoE's sigmoid-gated shared expert.
//
// N tokens, K slots, E experts, C channels; pair p = t*K + j, R = N*K rows.
//   permute          pos(R): pair p's row in expert order, offsets(E+1): expert e's rows
//                    [offsets[e], offsets[e+1]), xp(R,C) row pos[p] = x[p / K]
//   permute bwd      dx(N,C) += sum_j dxp[pos[t*K+j]]                      (accumulates)
//   unpermute        out(N,C) = sum_j w[t,j] * yp[pos[t*K+j]]              (overwritten)
//   unpermute bwd    dyp[pos[p]] = w[p] * dout[t], dw[p] = dout[t] . yp[pos[p]]  (overwritten)
//   sigmoid gate     out(N,C) += sigmoid(g[t]) y[t]; backward dy = sigmoid(g) dout,
//                    dg = (dout . y) sigmoid'(g)                          (overwritten)
//
// The order must be the CPU's stable counting sort: within an expert the
// rows keep pair order. A stable radix sort of (expert id, pair) does
// exactly that (CUB's DeviceRadixSort is stable and deterministic), over
// only the bits the expert ids need (ceil(log2 E): 3 bits for Mixtral, one
// pass). Its output, the pairs in expert order, is also the gather list of
// the copy into xp, which then writes whole rows in order (coalesced).
// offsets come from the sorted ids: row r starts expert e's range when its
// id is e and the row before has a smaller id; experts no pair chose get the
// next one's start (empty ranges). Ids outside 0..E-1 cannot come from
// moe_route_forward; they are not checked on the device (the CPU backend,
// which the tests hold the model to, checks them).
// Sums over the K slots run in slot order in fp32 with one bf16 rounding of
// the result: deterministic. Dot products are warp reductions in a fixed tree.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

// Device scratch moe_permute needs (the sort's keys, values and CUB's temporary storage).
size_t moe_permute_scratch_bytes(int N, int K, int E);
void moe_permute(int32_t* pos, int32_t* offsets, bf16* xp, const int32_t* idx, const bf16* x, int N, int K, int E,
                 int C, void* scratch, size_t scratch_bytes, cudaStream_t stream);
void moe_permute_backward(bf16* dx, const bf16* dxp, const int32_t* pos, int N, int K, int C, cudaStream_t stream);
void moe_unpermute_forward(bf16* out, const bf16* yp, const int32_t* pos, const float* w, int N, int K, int C,
                           cudaStream_t stream);
void moe_unpermute_backward(bf16* dyp, float* dw, const bf16* dout, const bf16* yp, const int32_t* pos,
                            const float* w, int N, int K, int C, cudaStream_t stream);
void moe_sigmoid_gate_forward(bf16* out, const bf16* y, const bf16* g, int N, int C, cudaStream_t stream);
void moe_sigmoid_gate_backward(bf16* dy, bf16* dg, const bf16* dout, const bf16* y, const bf16* g, int N, int C,
                               cudaStream_t stream);

}  // namespace trainrun::cuda
