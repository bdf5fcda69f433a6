// Fused softmax + cross-entropy: see softmax_cross_entropy.cuh.
#include "kernels/cuda/softmax_cross_entropy.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 512;

// Online (max, sum of exp(x - max)) of one thread's elements.
struct MaxSum {
  float m = -INFINITY, s = 0.0f;
  __device__ __forceinline__ void add(float x) {
    if (x > m) {
      s = s * __expf(m - x) + 1.0f;
      m = x;
    } else {
      s += __expf(x - m);
    }
  }
};

// One block per row. Element indices [0, head) and [head + 8*body, V) are
// scalar; [head, head + 8*body) are 16-byte packs (when vec: the row start
// is even-aligned so a 16-byte boundary lies within the first 8 elements).
// vec_d: dlogits has the same alignment as logits, so its packs line up.
__global__ void softmax_ce_kernel(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, int V,
                                  int64_t ldv, float dloss_scale, bool vec, bool vec_d, float cap) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  const bf16* z = logits + n * ldv;
  bf16* d = dlogits ? dlogits + n * ldv : nullptr;
  const int tgt = targets[n];
  if (tgt < 0) {  // ignored position: no loss, no gradient
    if (threadIdx.x == 0) losses[n] = 0.0f;
    if (d)
      for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = from_float<bf16>(0.0f);
    return;
  }
  const float zt = to_float(z[tgt]);  // read before any thread overwrites the row
  int head = V, body = 0;
  if (vec) {
    head = int(((16 - (reinterpret_cast<uintptr_t>(z) & 15)) & 15) / 2);
    if (head > V) head = V;
    body = (V - head) / 8;
  }
  const int tail0 = head + 8 * body;

  MaxSum ms;
  for (int v = threadIdx.x; v < head; v += blockDim.x) ms.add(to_float(z[v]));
  for (int i = threadIdx.x; i < body; i += blockDim.x) {
    const auto p = Pack16<bf16>::load_rw(z + head + 8 * i);
#pragma unroll
    for (int k = 0; k < 8; ++k) ms.add(to_float(p.v[k]));
  }
  for (int v = tail0 + threadIdx.x; v < V; v += blockDim.x) ms.add(to_float(z[v]));
  const float M = block_max(ms.m, red);
  const float S = block_sum(ms.m == -INFINITY ? 0.0f : ms.s * __expf(ms.m - M), red);
  const float lse = M + logf(S);
  if (threadIdx.x == 0) losses[n] = lse - zt;
  if (!d) return;

  const float inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;  // 0: no cap, the factor below is 1
  auto grad = [&](int v, float x) {
    const float t = x * inv_cap;
    return dloss_scale * (__expf(x - lse) - (v == tgt ? 1.0f : 0.0f)) * (1.0f - t * t);
  };
  if (vec && vec_d) {
    for (int v = threadIdx.x; v < head; v += blockDim.x) d[v] = from_float<bf16>(grad(v, to_float(z[v])));
    for (int i = threadIdx.x; i < body; i += blockDim.x) {
      const int v0 = head + 8 * i;
      const auto p = Pack16<bf16>::load_rw(z + v0);
      Pack16<bf16> o;
#pragma unroll
      for (int k = 0; k < 8; ++k) o.v[k] = from_float<bf16>(grad(v0 + k, to_float(p.v[k])));
      o.store(d + v0);
    }
    for (int v = tail0 + threadIdx.x; v < V; v += blockDim.x) d[v] = from_float<bf16>(grad(v, to_float(z[v])));
  } else {
    for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = from_float<bf16>(grad(v, to_float(z[v])));
  }
}

}  // namespace

void softmax_cross_entropy(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets, int N, int V,
                           int64_t ldv, float dloss_scale, cudaStream_t stream, float cap) {
  TR_CHECK(cap >= 0.f, "softmax_cross_entropy: the soft-cap ", cap, " must be >= 0 (0 = none)");
  if (N <= 0 || V <= 0) return;
  // Every row starts on an even address; a 16-byte vector body exists when
  // rows are long enough to be worth it.
  const bool vec = V >= 64;
  const bool vec_d = dlogits && ((reinterpret_cast<uintptr_t>(dlogits) - reinterpret_cast<uintptr_t>(logits)) & 15) == 0;
  softmax_ce_kernel<<<N, kThreads, 0, stream>>>(losses, dlogits, logits, targets, V, ldv, dloss_scale, vec,
                                                 vec_d, cap);
  TR_CUDA_LAUNCH_CHECK("softmax_cross_entropy");
}

}  // namespace trainrun::cuda
