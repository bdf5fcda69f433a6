// The mixture-of-experts router on the GPU: softmax + top-k, its backward,
// the load statistics and the router losses (backend.h's "mixture of
// experts" section; the CPU reference is kernels/cpu/cpu_moe.cpp).
//
// N tokens, E experts, K chosen per token; pair p = t*K + j.
//   forward   probs(N,E) = softmax(logits) in fp32 (expf/logf, not the fast
//             intrinsics: the router decides which expert a token reaches),
//             lse(N) = max + log(sum), idx(N,K) the K largest probabilities in
//             descending order, ties to the lower expert id, w(N,K) = their
//             probabilities (/ their sum, in slot order, when renorm).
//   backward  dp_e = aux_grad_e + (renorm ? (dw_j - sum_m dw_m w_m) / S : dw_j) for e = idx_j
//             dlogits_e = p_e (dp_e - sum_f p_f dp_f) + z_scale * lse * p_e   (bf16, overwritten)
//   stats     stats(2E+1) += [count_e, sum_t p_te, sum_t lse_t^2]
//   aux loss  out = [E sum_e count_e psum_e / tokens^2, lse2 / tokens], losses(n) += the
//             weighted sum, aux_grad_e = grad_scale * aux_coef * E * count_e / tokens^2
//
// One warp per token for the forward and backward (E is 8 to a few hundred:
// lanes stride over the experts). The top-k takes K passes of a warp arg-max
// over the entries that come after the previous pick in the order
// (p descending, id ascending): no "taken" set, and the tie rule is the
// order itself, so it equals the CPU's "first maximum wins" for any E.
// The statistics give each expert a block that reduces over the tokens in a
// fixed tree: deterministic, no float atomics (counts are integers, exact).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void moe_route_forward(float* probs, float* lse, int32_t* idx, float* w, const bf16* logits, int N, int E, int K,
                       bool renorm, cudaStream_t stream);
void moe_route_backward(bf16* dlogits, const float* dw, const float* probs, const float* lse, const int32_t* idx,
                        const float* aux_grad, float z_scale, int N, int E, int K, bool renorm, cudaStream_t stream);
void moe_router_stats(float* stats, const float* probs, const float* lse, const int32_t* idx, int N, int E, int K,
                      cudaStream_t stream);
void moe_aux_loss(float* out, float* aux_grad, float* losses, int n, const float* stats, int64_t tokens, int E,
                  float aux_coef, float z_coef, float grad_scale, cudaStream_t stream);

}  // namespace trainrun::cuda
