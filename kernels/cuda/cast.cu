// fp32 <-> bf16 casts: see cast.cuh.
#include "kernels/cuda/cast.cuh"

namespace trainrun::cuda {

namespace {

// VEC: both pointers 16-byte aligned; 8 values per iteration (two float4
// loads, one 16-byte bf16 store), scalar tail.
template <bool VEC>
__global__ void cast_f32_to_bf16_kernel(bf16* dst, const float* src, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      const float4 lo = __ldg(reinterpret_cast<const float4*>(src + 8 * i));
      const float4 hi = __ldg(reinterpret_cast<const float4*>(src + 8 * i + 4));
      Pack16<bf16> p;
      p.v[0] = from_float<bf16>(lo.x); p.v[1] = from_float<bf16>(lo.y);
      p.v[2] = from_float<bf16>(lo.z); p.v[3] = from_float<bf16>(lo.w);
      p.v[4] = from_float<bf16>(hi.x); p.v[5] = from_float<bf16>(hi.y);
      p.v[6] = from_float<bf16>(hi.z); p.v[7] = from_float<bf16>(hi.w);
      p.store(dst + 8 * i);
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + start; i < n; i += stride) dst[i] = from_float<bf16>(src[i]);
}

template <bool VEC>
__global__ void cast_bf16_to_f32_kernel(float* dst, const bf16* src, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t packs = n / 8;
    for (int64_t i = start; i < packs; i += stride) {
      const auto p = Pack16<bf16>::load(src + 8 * i);
      float4 lo{to_float(p.v[0]), to_float(p.v[1]), to_float(p.v[2]), to_float(p.v[3])};
      float4 hi{to_float(p.v[4]), to_float(p.v[5]), to_float(p.v[6]), to_float(p.v[7])};
      reinterpret_cast<float4*>(dst + 8 * i)[0] = lo;
      reinterpret_cast<float4*>(dst + 8 * i)[1] = hi;
    }
    tail = packs * 8;
  }
  for (int64_t i = tail + start; i < n; i += stride) dst[i] = to_float(src[i]);
}

}  // namespace

void cast_f32_to_bf16(bf16* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<8>(cast_f32_to_bf16_kernel<true>, cast_f32_to_bf16_kernel<false>, aligned16(dst) && aligned16(src), n,
                   stream, dst, src, n);
  TR_CUDA_LAUNCH_CHECK("cast_f32_to_bf16");
}

void cast_bf16_to_f32(float* dst, const bf16* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch_packed<8>(cast_bf16_to_f32_kernel<true>, cast_bf16_to_f32_kernel<false>, aligned16(dst) && aligned16(src), n,
                   stream, dst, src, n);
  TR_CUDA_LAUNCH_CHECK("cast_bf16_to_f32");
}

}  // namespace trainrun::cuda
