// Per-row L2 norms: see row_norms.cuh.
#include "kernels/cuda/row_norms.cuh"

#include <cmath>

namespace trainrun::cuda {

namespace {

constexpr int kWarps = 8;

template <bool VEC>
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
  if (lane == 0) out[row] = sqrtf(acc);
}

}  // namespace

void row_norms(float* out, const bf16* w, int rows, int cols, cudaStream_t stream) {
  TR_CHECK(rows >= 0 && cols >= 0, "row_norms: rows ", rows, " and cols ", cols, " must be >= 0");
  if (rows == 0) return;
  const int blocks = (rows + kWarps - 1) / kWarps;
  if (cols % 8 == 0 && aligned16(w))
    row_norms_kernel<true><<<blocks, 32 * kWarps, 0, stream>>>(out, w, rows, cols);
  else
    row_norms_kernel<false><<<blocks, 32 * kWarps, 0, stream>>>(out, w, rows, cols);
  TR_CUDA_LAUNCH_CHECK("row_norms");
}

}  // namespace trainrun::cuda
