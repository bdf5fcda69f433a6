// Token + position embedding, forward and backward.
//
//   forward   out(B,T,C)[b,t,:] = wte(V,C)[tokens[b,t],:] + wpe(maxT,C)[t,:]     (bf16)
//   backward  dwte(V,C)[v,:]  += sum over (b,t) with tokens[b,t] == v of dout[b,t,:]   (fp32)
//             dwpe(maxT,C)[t,:] += sum over b of dout[b,t,:]                          (fp32)
//
// Deterministic backward (no float atomics): the N = B*T positions are
// sorted by token with a stable radix sort (CUB), so every token's positions
// form one run, in position order. One block per run and 256-channel slab
// sums the run's rows (8 row groups, combined in a fixed order) and adds the
// result to dwte[v] once; each dwte row has exactly one writer. dwpe is a
// plain column sum over b, one thread per (t, c), b in order.
// Scratch: encoder_backward_scratch_bytes(N) (sort buffers, CUB temp).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void encoder_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                     cudaStream_t stream);

size_t encoder_backward_scratch_bytes(int N);
void encoder_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                      void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace trainrun::cuda
