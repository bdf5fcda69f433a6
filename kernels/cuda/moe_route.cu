// The MoE router's kernels: see moe_route.cuh for the math and the choices.
#include "kernels/cuda/moe_route.cuh"

#include <cmath>

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps: 8 tokens per block
constexpr int kWarps = kThreads / 32;

// Key order of the top-k: a before b when p_a > p_b, or equal and a < b.
__device__ __forceinline__ bool before(float pa, int a, float pb, int b) { return pa > pb || (pa == pb && a < b); }

__global__ void route_forward_kernel(float* probs, float* lse, int32_t* idx, float* w, const bf16* logits, int N,
                                     int E, int K, bool renorm) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (t >= N) return;  // whole warps leave together
  const bf16* x = logits + int64_t(t) * E;
  float* p = probs + int64_t(t) * E;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, to_float(x[e]));
  mx = warp_max(mx);
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) {
    const float v = expf(to_float(x[e]) - mx);
    p[e] = v;
    sum += v;
  }
  sum = warp_sum(sum);
  const float inv = 1.0f / sum;
  for (int e = lane; e < E; e += 32) p[e] *= inv;
  __syncwarp();
  if (lane == 0) lse[t] = mx + logf(sum);
  int32_t* ix = idx + int64_t(t) * K;
  float* wt = w + int64_t(t) * K;
  float prev_p = INFINITY;
  int prev_e = -1;
  float wsum = 0.f;
  for (int j = 0; j < K; ++j) {
    // This lane's best among the entries after (prev_p, prev_e) in the order.
    float bp = -INFINITY;
    int be = E;  // none
    for (int e = lane; e < E; e += 32) {
      const float v = p[e];
      if (before(prev_p, prev_e, v, e) && (be == E || before(v, e, bp, be))) bp = v, be = e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, bp, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (oe != E && (be == E || before(op, oe, bp, be))) bp = op, be = oe;
    }
    if (lane == 0) {
      ix[j] = be;
      wt[j] = bp;
    }
    wsum += bp;  // slot order, as the CPU
    prev_p = bp, prev_e = be;
  }
  if (renorm && lane == 0)
    for (int j = 0; j < K; ++j) wt[j] /= wsum;
}

__global__ void route_backward_kernel(bf16* dlogits, const float* dw, const float* probs, const float* lse,
                                      const int32_t* idx, const float* aux_grad, float z_scale, int N, int E, int K,
                                      bool renorm) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (t >= N) return;
  const float* p = probs + int64_t(t) * E;
  const int32_t* ix = idx + int64_t(t) * K;
  const float* dwt = dw + int64_t(t) * K;
  // Every lane computes S and the dot itself (K is small): no broadcast.
  float S = 0.f, dot = 0.f;
  if (renorm) {
    for (int j = 0; j < K; ++j) S += p[ix[j]];
    for (int j = 0; j < K; ++j) dot += dwt[j] * (p[ix[j]] / S);
  }
  auto dp_of = [&](int e) {
    float d = aux_grad ? aux_grad[e] : 0.f;
    for (int j = 0; j < K; ++j)
      if (ix[j] == e) d += renorm ? (dwt[j] - dot) / S : dwt[j];  // the chosen ids are distinct
    return d;
  };
  float pd = 0.f;
  for (int e = lane; e < E; e += 32) pd += p[e] * dp_of(e);
  pd = warp_sum(pd);
  const float zl = z_scale * lse[t];
  bf16* dl = dlogits + int64_t(t) * E;
  for (int e = lane; e < E; e += 32) dl[e] = from_float<bf16>(p[e] * (dp_of(e) - pd) + zl * p[e]);
}

// Block e < E: count_e over the N*K pairs and psum_e over the tokens; block E: sum lse^2.
__global__ void router_stats_kernel(float* stats, const float* probs, const float* lse, const int32_t* idx, int N,
                                    int E, int K) {
  __shared__ float shared[32];
  const int e = blockIdx.x;
  if (e < E) {
    const int64_t P = int64_t(N) * K;
    float count = 0.f, psum = 0.f;  // count: an integer below 2^24 per thread, exact
    for (int64_t q = threadIdx.x; q < P; q += blockDim.x) count += idx[q] == e ? 1.f : 0.f;
    for (int64_t t = threadIdx.x; t < N; t += blockDim.x) psum += probs[t * E + e];
    count = block_sum(count, shared);
    psum = block_sum(psum, shared);
    if (threadIdx.x == 0) {
      stats[e] += count;
      stats[E + e] += psum;
    }
  } else {
    float s = 0.f;
    for (int64_t t = threadIdx.x; t < N; t += blockDim.x) s += lse[t] * lse[t];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) stats[2 * E] += s;
  }
}

// One block: the two losses in double (as the CPU), then the per-token add and aux_grad.
__global__ void aux_loss_kernel(float* out, float* aux_grad, float* losses, int n, const float* stats, double tokens,
                                int E, float aux_coef, float z_coef, float grad_scale) {
  __shared__ double partial[kThreads];
  __shared__ float add;
  double a = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) a += double(stats[e]) * stats[E + e];
  partial[threadIdx.x] = a;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {  // a fixed tree: deterministic
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const double T2 = tokens * tokens;
  if (threadIdx.x == 0) {
    const double aux = partial[0] * double(E) / T2;
    const double z = double(stats[2 * E]) / tokens;
    out[0] = float(aux);
    out[1] = float(z);
    add = float(aux_coef * aux + z_coef * z);
  }
  __syncthreads();
  if (losses && add != 0.f)
    for (int i = threadIdx.x; i < n; i += blockDim.x) losses[i] += add;
  if (aux_grad)
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      aux_grad[e] = float(double(grad_scale) * aux_coef * E * stats[e] / T2);
}

void check_route_shape(const char* op, int N, int E, int K) {
  TR_CHECK(N >= 0 && E >= 1 && K >= 1 && K <= E, op, ": N ", N, ", E ", E, ", top-k ", K,
           " (needs N >= 0 and 1 <= top-k <= E)");
}

}  // namespace

void moe_route_forward(float* probs, float* lse, int32_t* idx, float* w, const bf16* logits, int N, int E, int K,
                       bool renorm, cudaStream_t stream) {
  check_route_shape("moe_route_forward", N, E, K);
  if (N == 0) return;
  route_forward_kernel<<<(N + kWarps - 1) / kWarps, kThreads, 0, stream>>>(probs, lse, idx, w, logits, N, E, K,
                                                                            renorm);
  TR_CUDA_LAUNCH_CHECK("route_forward_kernel");
}

void moe_route_backward(bf16* dlogits, const float* dw, const float* probs, const float* lse, const int32_t* idx,
                        const float* aux_grad, float z_scale, int N, int E, int K, bool renorm, cudaStream_t stream) {
  check_route_shape("moe_route_backward", N, E, K);
  if (N == 0) return;
  route_backward_kernel<<<(N + kWarps - 1) / kWarps, kThreads, 0, stream>>>(dlogits, dw, probs, lse, idx, aux_grad,
                                                                             z_scale, N, E, K, renorm);
  TR_CUDA_LAUNCH_CHECK("route_backward_kernel");
}

void moe_router_stats(float* stats, const float* probs, const float* lse, const int32_t* idx, int N, int E, int K,
                      cudaStream_t stream) {
  check_route_shape("moe_router_stats", N, E, K);
  if (N == 0) return;
  router_stats_kernel<<<E + 1, kThreads, 0, stream>>>(stats, probs, lse, idx, N, E, K);
  TR_CUDA_LAUNCH_CHECK("router_stats_kernel");
}

void moe_aux_loss(float* out, float* aux_grad, float* losses, int n, const float* stats, int64_t tokens, int E,
                  float aux_coef, float z_coef, float grad_scale, cudaStream_t stream) {
  TR_CHECK(tokens >= 1 && E >= 1, "moe_aux_loss: ", tokens, " router rows and ", E,
           " experts (needs at least one of each)");
  aux_loss_kernel<<<1, kThreads, 0, stream>>>(out, aux_grad, losses, n, stats, double(tokens), E, aux_coef, z_coef,
                                              grad_scale);
  TR_CUDA_LAUNCH_CHECK("aux_loss_kernel");
}

}  // namespace trainrun::cuda
