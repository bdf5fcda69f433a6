// Per-row L2 norms: see row_norms.cuh.
#include "kernels/cuda/row_norms.cuh"

#include <cmath>

namespace trainrun::cuda {

namespace {

constexpr int kWarps = 8;

template <bool VEC, bool ROOT>
__global__ void row_norms_kernel(float* out, const bf16* w, int rows, int cols) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= rows) return;  // a whole warp leaves together: the shuffles below see full warps
  const bf16* r = w + int64_t(row) * cols;
  float acc = 0.0f;
  if (VEC) {
    for (int c = 8 * lane; c < cols; c += 8 * 32) {
      const auto p = Pack16<bf16>::load(r + c);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float v = to_float(p.v[k]);
        acc = fmaf(v, v, acc);
      }
    }
  } else {
    for (int c = lane; c < cols; c += 32) {
      const float v = to_float(r[c]);
      acc = fmaf(v, v, acc);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) out[row] = ROOT ? sqrtf(acc) : acc;
}

__global__ void sqrt_kernel(float* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) x[i] = sqrtf(x[i]);
}

template <bool ROOT>
void launch_row_norms(float* out, const bf16* w, int rows, int cols, cudaStream_t stream, const char* what) {
  TR_CHECK(rows >= 0 && cols >= 0, what, ": rows ", rows, " and cols ", cols, " must be >= 0");
  if (rows == 0) return;
  const int blocks = (rows + kWarps - 1) / kWarps;
  if (cols % 8 == 0 && aligned16(w))
    row_norms_kernel<true, ROOT><<<blocks, 32 * kWarps, 0, stream>>>(out, w, rows, cols);
  else
    row_norms_kernel<false, ROOT><<<blocks, 32 * kWarps, 0, stream>>>(out, w, rows, cols);
}

}  // namespace

void row_norms(float* out, const bf16* w, int rows, int cols, cudaStream_t stream) {
  launch_row_norms<true>(out, w, rows, cols, stream, "row_norms");
  TR_CUDA_LAUNCH_CHECK("row_norms");
}

void row_sum_squares(float* out, const bf16* w, int rows, int cols, cudaStream_t stream) {
  launch_row_norms<false>(out, w, rows, cols, stream, "row_sum_squares");
  TR_CUDA_LAUNCH_CHECK("row_sum_squares");
}

void sqrt_in_place(float* x, int64_t n, cudaStream_t stream) {
  TR_CHECK(n >= 0, "sqrt_in_place: n ", n, " must be >= 0");
  if (n == 0) return;
  launch_packed<1>(sqrt_kernel, sqrt_kernel, false, n, stream, x, n);
  TR_CUDA_LAUNCH_CHECK("sqrt_in_place");
}

}  // namespace trainrun::cuda
