// Final logit soft-capping: see logit_softcap.cuh.
#include "kernels/cuda/logit_softcap.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void logit_softcap_kernel(bf16* logits, int V, int64_t ldv, float cap, float inv_cap, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    bf16* z = logits + (i / V) * ldv + i % V;
    *z = from_float<bf16>(cap * tanhf(to_float(*z) * inv_cap));
  }
}

}  // namespace

void logit_softcap_forward(bf16* logits, int N, int V, int64_t ldv, float cap, cudaStream_t stream) {
  TR_CHECK(cap > 0.f, "logit_softcap_forward: the cap ", cap, " must be > 0");
  TR_CHECK(N >= 0 && V >= 0 && ldv >= V, "logit_softcap_forward: N ", N, ", V ", V, ", ldv ", ldv,
           " (need N, V >= 0 and ldv >= V)");
  const int64_t n = int64_t(N) * V;
  if (n == 0) return;
  logit_softcap_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(logits, V, ldv, cap, 1.0f / cap, n);
  TR_CUDA_LAUNCH_CHECK("logit_softcap_forward");
}

}  // namespace trainrun::cuda
