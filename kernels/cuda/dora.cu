// DoRA's forward term and backward (magnitude gradient, in-place output
// gradients): see dora.cuh.
#include "kernels/cuda/dora.cuh"

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kCols = 32;           // columns per backward block (one per lane)
constexpr int kRowGroups = 8;       // warps per backward block
constexpr int kRowsPerChunk = 256;  // rows per backward block

int row_chunks(int N) { return (N + kRowsPerChunk - 1) / kRowsPerChunk; }

__global__ void dora_forward_kernel(bf16* y, int ldy, const bf16* xw, const bf16* xba, const bf16* mag,
                                    const float* norm, float s, int out, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / out;
    const int o = int(i - r * out);
    const float g = to_float(mag[o]) / norm[o];
    bf16* yp = y + r * ldy + o;
    *yp = from_float<bf16>(to_float(*yp) + ((g - 1.0f) * to_float(xw[i]) + g * to_float(xba[i]) * s));
  }
}

__global__ void dora_backward_partial_kernel(float* partial, bf16* xw, bf16* xba, const bf16* dy, int ldy,
                                             const bf16* mag, const float* norm, float s, int N, int out) {
  __shared__ float red[kRowGroups][kCols];
  const int lane = threadIdx.x, k = threadIdx.y;
  const int o = blockIdx.x * kCols + lane;
  const int r0 = blockIdx.y * kRowsPerChunk;
  const int r1 = min(N, r0 + kRowsPerChunk);
  float acc = 0.0f;
  if (o < out) {
    const float g = to_float(mag[o]) / norm[o];
    for (int r = r0 + k; r < r1; r += kRowGroups) {
      const int64_t i = int64_t(r) * out + o;
      const float d = to_float(dy[int64_t(r) * ldy + o]);
      acc = fmaf(d, to_float(xw[i]) + s * to_float(xba[i]), acc);
      xw[i] = from_float<bf16>((g - 1.0f) * d);
      xba[i] = from_float<bf16>(g * s * d);
    }
  }
  red[k][lane] = acc;
  __syncthreads();
  if (k == 0 && o < out) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kRowGroups; ++j) sum += red[j][lane];
    partial[int64_t(blockIdx.y) * out + o] = sum;
  }
}

__global__ void dora_backward_finish_kernel(float* dmag, const float* partial, const float* norm, int chunks,
                                            int out) {
  for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < out; o += gridDim.x * blockDim.x) {
    float sum = 0.0f;
    for (int c = 0; c < chunks; ++c) sum += partial[int64_t(c) * out + o];
    dmag[o] += sum / norm[o];
  }
}

}  // namespace

void dora_forward(bf16* y, int ldy, const bf16* xw, const bf16* xba, const bf16* mag, const float* norm, float s,
                  int N, int out, cudaStream_t stream) {
  TR_CHECK(N >= 0 && out >= 0 && ldy >= out, "dora_forward: N ", N, ", out ", out, " and ldy ", ldy,
           " must be >= 0 with ldy >= out");
  const int64_t n = int64_t(N) * out;
  if (n == 0) return;
  dora_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(y, ldy, xw, xba, mag, norm, s, out, n);
  TR_CUDA_LAUNCH_CHECK("dora_forward");
}

size_t dora_backward_scratch_bytes(int N, int out) {
  return size_t(row_chunks(N)) * size_t(out > 0 ? out : 0) * sizeof(float);
}

void dora_backward(float* dmag, bf16* xw, bf16* xba, const bf16* dy, int ldy, const bf16* mag, const float* norm,
                   float s, int N, int out, float* scratch, cudaStream_t stream) {
  TR_CHECK(N >= 0 && out >= 0 && ldy >= out, "dora_backward: N ", N, ", out ", out, " and ldy ", ldy,
           " must be >= 0 with ldy >= out");
  if (out == 0 || N == 0) return;  // no rows: dmag += an empty sum
  const int chunks = row_chunks(N);
  TR_CHECK(chunks <= 65535, "dora_backward: ", N, " rows exceed the grid's ", 65535 * kRowsPerChunk);
  dim3 grid((out + kCols - 1) / kCols, chunks), block(kCols, kRowGroups);
  dora_backward_partial_kernel<<<grid, block, 0, stream>>>(scratch, xw, xba, dy, ldy, mag, norm, s, N, out);
  TR_CUDA_LAUNCH_CHECK("dora_backward_partial");
  dora_backward_finish_kernel<<<grid_for(out, kThreads, 1024), kThreads, 0, stream>>>(dmag, scratch, norm, chunks,
                                                                                     out);
  TR_CUDA_LAUNCH_CHECK("dora_backward_finish");
}

}  // namespace trainrun::cuda
