// Permute / unpermute and the shared expert's gate: see moe_permute.cuh.
#include "kernels/cuda/moe_permute.cuh"

#include <cub/device/device_radix_sort.cuh>

namespace trainrun::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

int id_bits(int E) {
  int b = 1;
  while ((1 << b) < E) ++b;
  return b;
}

__global__ void iota_kernel(int32_t* v, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) v[i] = int32_t(i);
}

// Row r of expert order holds pair sorted_pair[r]: pos is its inverse, and
// the boundaries between ids give offsets. Every offsets[e] is written by
// exactly one thread: row r writes the starts of the ids in (id[r-1], id[r]],
// the last row also the ends past its id.
__global__ void scatter_positions_kernel(int32_t* pos, int32_t* offsets, const int32_t* sorted_id,
                                         const int32_t* sorted_pair, int64_t R, int E) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < R; r += stride) {
    pos[sorted_pair[r]] = int32_t(r);
    const int id = sorted_id[r];
    const int lo = r == 0 ? 0 : sorted_id[r - 1] + 1;
    for (int e = lo; e <= id; ++e) offsets[e] = int32_t(r);
    if (r == R - 1)
      for (int e = id + 1; e <= E; ++e) offsets[e] = int32_t(R);
  }
}

__global__ void empty_offsets_kernel(int32_t* offsets, int E) {
  for (int e = threadIdx.x; e <= E; e += blockDim.x) offsets[e] = 0;
}

// xp row r = x[sorted_pair[r] / K], 16-byte packs when C % 8 == 0 and aligned.
template <bool VEC>
__global__ void gather_rows_kernel(bf16* xp, const bf16* x, const int32_t* sorted_pair, int K, int C, int64_t work) {
  constexpr int kW = VEC ? 8 : 1;
  const int per_row = C / kW;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < work; i += stride) {
    const int64_t r = i / per_row;
    const int c = int(i % per_row) * kW;
    const bf16* src = x + int64_t(sorted_pair[r] / K) * C + c;
    bf16* dst = xp + r * C + c;
    if (VEC) Pack16<bf16>::load(src).store(dst);
    else *dst = *src;
  }
}

// dx[t,c] += sum_j dxp[pos[t*K+j], c], one element per thread.
__global__ void permute_backward_kernel(bf16* dx, const bf16* dxp, const int32_t* pos, int N, int K, int C) {
  const int64_t n = int64_t(N) * C, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t t = i / C;
    const int c = int(i % C);
    float s = to_float(dx[i]);
    for (int j = 0; j < K; ++j) s += to_float(dxp[int64_t(pos[t * K + j]) * C + c]);
    dx[i] = from_float<bf16>(s);
  }
}

__global__ void unpermute_forward_kernel(bf16* out, const bf16* yp, const int32_t* pos, const float* w, int N, int K,
                                         int C) {
  const int64_t n = int64_t(N) * C, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t t = i / C;
    const int c = int(i % C);
    float s = 0.f;
    for (int j = 0; j < K; ++j) s += w[t * K + j] * to_float(yp[int64_t(pos[t * K + j]) * C + c]);
    out[i] = from_float<bf16>(s);
  }
}

// One warp per pair.
__global__ void unpermute_backward_kernel(bf16* dyp, float* dw, const bf16* dout, const bf16* yp, const int32_t* pos,
                                          const float* w, int64_t P, int K, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t p = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (p >= P) return;
  const bf16* d = dout + (p / K) * C;
  const int64_t row = pos[p];
  const bf16* y = yp + row * C;
  bf16* dy = dyp + row * C;
  const float wp = w[p];
  float dot = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float dv = to_float(d[c]);
    dot += dv * to_float(y[c]);
    dy[c] = from_float<bf16>(wp * dv);
  }
  dot = warp_sum(dot);
  if (lane == 0) dw[p] = dot;
}

__device__ __forceinline__ float sigmoid_exact(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void sigmoid_gate_forward_kernel(bf16* out, const bf16* y, const bf16* g, int N, int C) {
  const int64_t n = int64_t(N) * C, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float s = sigmoid_exact(to_float(g[i / C]));
    out[i] = from_float<bf16>(to_float(out[i]) + s * to_float(y[i]));
  }
}

// One warp per token.
__global__ void sigmoid_gate_backward_kernel(bf16* dy, bf16* dg, const bf16* dout, const bf16* y, const bf16* g, int N,
                                             int C) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= N) return;
  const float s = sigmoid_exact(to_float(g[t]));
  float dot = 0.f;
  for (int c = lane; c < C; c += 32) {
    const int64_t i = t * C + c;
    const float d = to_float(dout[i]);
    dot += d * to_float(y[i]);
    dy[i] = from_float<bf16>(s * d);
  }
  dot = warp_sum(dot);
  if (lane == 0) dg[t] = from_float<bf16>(dot * s * (1.f - s));
}

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

size_t cub_temp_bytes(int64_t R, int E) {
  size_t temp = 0;
  TR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), R, 0, id_bits(E)));
  return temp;
}

void check_rows(const char* op, int N, int K, int C) {
  TR_CHECK(N >= 0 && K >= 1 && C >= 1 && int64_t(N) * K <= INT32_MAX, op, ": N ", N, ", K ", K, ", C ", C,
           " (needs N >= 0, K >= 1, C >= 1 and N*K rows addressable by int32)");
}

}  // namespace

size_t moe_permute_scratch_bytes(int N, int K, int E) {
  const int64_t R = int64_t(N) * K;
  if (R == 0) return 0;
  // the pairs (iota), the sorted ids, the sorted pairs, CUB's storage
  return 3 * align256(size_t(R) * 4) + align256(cub_temp_bytes(R, E));
}

void moe_permute(int32_t* pos, int32_t* offsets, bf16* xp, const int32_t* idx, const bf16* x, int N, int K, int E,
                 int C, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
  check_rows("moe_permute", N, K, C);
  TR_CHECK(E >= 1, "moe_permute: ", E, " experts (needs at least 1)");
  const int64_t R = int64_t(N) * K;
  if (R == 0) {
    empty_offsets_kernel<<<1, kThreads, 0, stream>>>(offsets, E);
    TR_CUDA_LAUNCH_CHECK("empty_offsets_kernel");
    return;
  }
  TR_CHECK(scratch_bytes >= moe_permute_scratch_bytes(N, K, E), "moe_permute: scratch of ", scratch_bytes,
           " bytes, needs ", moe_permute_scratch_bytes(N, K, E), " (a bug)");
  char* s = static_cast<char*>(scratch);
  auto take = [&](size_t b) {
    char* p = s;
    s += align256(b);
    return p;
  };
  int32_t* pairs = reinterpret_cast<int32_t*>(take(size_t(R) * 4));
  int32_t* sorted_id = reinterpret_cast<int32_t*>(take(size_t(R) * 4));
  int32_t* sorted_pair = reinterpret_cast<int32_t*>(take(size_t(R) * 4));
  size_t temp = cub_temp_bytes(R, E);
  void* cub_temp = take(temp);
  iota_kernel<<<grid_for(R, kThreads), kThreads, 0, stream>>>(pairs, R);
  TR_CUDA_LAUNCH_CHECK("iota_kernel");
  // The ids as unsigned keys (they are 0..E-1): only their low id_bits(E) bits are sorted.
  TR_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, temp, reinterpret_cast<const uint32_t*>(idx),
                                                reinterpret_cast<uint32_t*>(sorted_id), pairs, sorted_pair, R, 0,
                                                id_bits(E), stream));
  scatter_positions_kernel<<<grid_for(R, kThreads), kThreads, 0, stream>>>(pos, offsets, sorted_id, sorted_pair, R, E);
  TR_CUDA_LAUNCH_CHECK("scatter_positions_kernel");
  const bool vec = C % 8 == 0 && aligned16(xp) && aligned16(x);
  const int64_t work = R * (vec ? C / 8 : C);
  if (vec) gather_rows_kernel<true><<<grid_for(work, kThreads), kThreads, 0, stream>>>(xp, x, sorted_pair, K, C, work);
  else gather_rows_kernel<false><<<grid_for(work, kThreads), kThreads, 0, stream>>>(xp, x, sorted_pair, K, C, work);
  TR_CUDA_LAUNCH_CHECK("gather_rows_kernel");
}

void moe_permute_backward(bf16* dx, const bf16* dxp, const int32_t* pos, int N, int K, int C, cudaStream_t stream) {
  check_rows("moe_permute_backward", N, K, C);
  if (N == 0) return;
  const int64_t n = int64_t(N) * C;
  permute_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(dx, dxp, pos, N, K, C);
  TR_CUDA_LAUNCH_CHECK("permute_backward_kernel");
}

void moe_unpermute_forward(bf16* out, const bf16* yp, const int32_t* pos, const float* w, int N, int K, int C,
                           cudaStream_t stream) {
  check_rows("moe_unpermute_forward", N, K, C);
  if (N == 0) return;
  const int64_t n = int64_t(N) * C;
  unpermute_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(out, yp, pos, w, N, K, C);
  TR_CUDA_LAUNCH_CHECK("unpermute_forward_kernel");
}

void moe_unpermute_backward(bf16* dyp, float* dw, const bf16* dout, const bf16* yp, const int32_t* pos,
                            const float* w, int N, int K, int C, cudaStream_t stream) {
  check_rows("moe_unpermute_backward", N, K, C);
  const int64_t P = int64_t(N) * K;
  if (P == 0) return;
  unpermute_backward_kernel<<<int((P + kWarps - 1) / kWarps), kThreads, 0, stream>>>(dyp, dw, dout, yp, pos, w, P, K,
                                                                                      C);
  TR_CUDA_LAUNCH_CHECK("unpermute_backward_kernel");
}

void moe_sigmoid_gate_forward(bf16* out, const bf16* y, const bf16* g, int N, int C, cudaStream_t stream) {
  check_rows("moe_sigmoid_gate_forward", N, 1, C);
  if (N == 0) return;
  const int64_t n = int64_t(N) * C;
  sigmoid_gate_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(out, y, g, N, C);
  TR_CUDA_LAUNCH_CHECK("sigmoid_gate_forward_kernel");
}

void moe_sigmoid_gate_backward(bf16* dy, bf16* dg, const bf16* dout, const bf16* y, const bf16* g, int N, int C,
                               cudaStream_t stream) {
  check_rows("moe_sigmoid_gate_backward", N, 1, C);
  if (N == 0) return;
  sigmoid_gate_backward_kernel<<<(N + kWarps - 1) / kWarps, kThreads, 0, stream>>>(dy, dg, dout, y, g, N, C);
  TR_CUDA_LAUNCH_CHECK("sigmoid_gate_backward_kernel");
}

}  // namespace trainrun::cuda
