#include "kernels/cuda/scale_rows.cuh"

#include <algorithm>

namespace trainrun::cuda {
namespace {

__global__ void scale_rows_kernel(bf16* x, const float* w, int N, int V, int64_t ldv) {
  const int64_t total = int64_t(N) * V;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / V, v = i - n * V;
    bf16* p = x + n * ldv + v;
    *p = __float2bfloat16(__bfloat162float(*p) * w[n]);
  }
}

}  // namespace

void scale_rows(bf16* x, const float* w, int N, int V, int64_t ldv, cudaStream_t stream) {
  const int64_t total = int64_t(N) * V;
  if (total == 0) return;
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((total + threads - 1) / threads, 65535));
  scale_rows_kernel<<<blocks, threads, 0, stream>>>(x, w, N, V, ldv);
  TR_CUDA_LAUNCH_CHECK("scale_rows");
}

}  // namespace trainrun::cuda
