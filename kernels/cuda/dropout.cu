// Counter-based inverted dropout: see dropout.cuh.
#include "kernels/cuda/dropout.cuh"

#include "kernels/dropout_mask.h"

namespace trainrun::cuda {

namespace {

// VEC: pack i covers elements [8i, 8i+8); the n % 8 tail is scalar in the
// same grid-stride loop. Coherent loads: out may alias inp.
template <bool VEC>
__global__ void dropout_kernel(bf16* out, const bf16* inp, int64_t n, uint64_t counter0, uint64_t seed,
                               uint32_t threshold, float scale) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      const auto x = Pack16<bf16>::load_rw(inp + 8 * i);
      Pack16<bf16> y;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const bool kept = dropout_mask::keep(seed, counter0 + uint64_t(8 * i + k), threshold);
        y.v[k] = from_float<bf16>(kept ? to_float(x.v[k]) * scale : 0.0f);
      }
      y.store(out + 8 * i);
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + start; i < n; i += stride) {
    const bool kept = dropout_mask::keep(seed, counter0 + uint64_t(i), threshold);
    out[i] = from_float<bf16>(kept ? to_float(inp[i]) * scale : 0.0f);
  }
}

// A column slice: element i = (r, c) of (N, C) has the counter
// (row0 + r) * key_cols + col0 + c. One element per thread.
__global__ void dropout_slice_kernel(bf16* out, const bf16* inp, int64_t n, int C, uint64_t row0, uint64_t key_cols,
                                     uint64_t col0, uint64_t seed, uint32_t threshold, float scale) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t r = uint64_t(i / C), c = uint64_t(i % C);
    const bool kept = dropout_mask::keep(seed, (row0 + r) * key_cols + col0 + c, threshold);
    out[i] = from_float<bf16>(kept ? to_float(inp[i]) * scale : 0.0f);
  }
}

}  // namespace

void dropout_forward(bf16* out, const bf16* inp, int N, int C, float p, uint64_t seed, int64_t row0,
                     int64_t key_cols, int64_t col0, cudaStream_t stream) {
  TR_CHECK(N >= 0 && C >= 0 && row0 >= 0, "dropout_forward: N ", N, ", C ", C, " and row0 ", row0, " must be >= 0");
  TR_CHECK(p >= 0.0f && p < 1.0f, "dropout_forward: p ", p, " must be in [0, 1)");
  if (key_cols <= 0) key_cols = C;
  TR_CHECK(col0 >= 0 && col0 + C <= key_cols, "dropout_forward: columns [", col0, ", ", col0 + C,
           ") are not inside rows of ", key_cols);
  const int64_t n = int64_t(N) * C;
  if (n == 0) return;
  if (key_cols != C) {
    launch_packed<1>(dropout_slice_kernel, dropout_slice_kernel, false, n, stream, out, inp, n, C, uint64_t(row0),
                     uint64_t(key_cols), uint64_t(col0), seed, dropout_mask::threshold(p), dropout_mask::keep_scale(p));
    TR_CUDA_LAUNCH_CHECK("dropout_forward (column slice)");
    return;
  }
  const uint64_t counter0 = uint64_t(row0) * uint64_t(C);  // (row0 + n) * C + c = counter0 + n * C + c
  launch_packed<8>(dropout_kernel<true>, dropout_kernel<false>, aligned16(out) && aligned16(inp), n, stream, out, inp,
                   n, counter0, seed, dropout_mask::threshold(p), dropout_mask::keep_scale(p));
  TR_CUDA_LAUNCH_CHECK("dropout_forward");
}

}  // namespace trainrun::cuda
