// Deterministic sum of squares: see sum_squares.cuh.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/sum_squares.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kMaxBlocks = 1024;

// Depends only on n, so the reduction tree (and the result) is the same on
// every run and every GPU.
int sum_squares_blocks(int64_t n) {
  int64_t b = (n + int64_t(kThreads) * 16 - 1) / (int64_t(kThreads) * 16);
  return int(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

template <bool kSquare>
__global__ void sum_partial_kernel(float* partial, const float* x, int64_t n) {
  __shared__ float red[32];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  float acc = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = __ldg(x + i);
    acc = kSquare ? fmaf(v, v, acc) : acc + v;
  }
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One warp adds the partials: lane l takes l, l+32, ... in double, then the
// fixed butterfly combines the lanes.
__global__ void sum_squares_final_kernel(float* out, const float* partial, int nblocks) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < nblocks; i += 32) acc += double(partial[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x == 0) out[0] += float(acc);
}

}  // namespace

size_t sum_squares_scratch_bytes(int64_t n) { return size_t(sum_squares_blocks(n)) * sizeof(float); }

namespace {

template <bool kSquare>
void launch_sum(float* out, const float* x, int64_t n, float* scratch, cudaStream_t stream) {
  if (n <= 0) return;
  const int blocks = sum_squares_blocks(n);
  sum_partial_kernel<kSquare><<<blocks, kThreads, 0, stream>>>(scratch, x, n);
  TR_CUDA_LAUNCH_CHECK("sum_partial");
  sum_squares_final_kernel<<<1, 32, 0, stream>>>(out, scratch, blocks);
  TR_CUDA_LAUNCH_CHECK("sum_final");
}

}  // namespace

void sum_squares(float* out, const float* x, int64_t n, float* scratch, cudaStream_t stream) {
  launch_sum<true>(out, x, n, scratch, stream);
}
void sum(float* out, const float* x, int64_t n, float* scratch, cudaStream_t stream) {
  launch_sum<false>(out, x, n, scratch, stream);
}

}  // namespace trainrun::cuda
