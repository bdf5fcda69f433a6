// NF4 dequantization: see nf4.cuh (and kernels/nf4_format.h for the format).
#include "kernels/cuda/nf4.cuh"

#include <algorithm>

#include "kernels/nf4_format.h"

namespace trainrun::cuda {

namespace {

__constant__ float kNf4Code[16] = {TR_NF4_CODE_VALUES};

// a(b) of nf4.cuh: two separately rounded ops, as bitsandbytes does them.
__device__ __forceinline__ float block_value(const float* map, const uint8_t* qabsmax, const float* absmax2,
                                             float offset, int64_t b) {
  const float p = nf4::ftz(__fmul_rn(__ldg(map + __ldg(qabsmax + b)), __ldg(absmax2 + b / nf4::kAbsmaxBlock)));
  return nf4::ftz(__fadd_rn(p, offset));
}

__device__ __forceinline__ void load_code(float* code) {
  if (threadIdx.x < 16) code[threadIdx.x] = kNf4Code[threadIdx.x];
  __syncthreads();
}

__device__ __forceinline__ float element(const float* code, const uint8_t* packed, const uint8_t* qabsmax,
                                         const float* absmax2, const float* map, float offset, int64_t i) {
  const uint8_t byte = __ldg(packed + (i >> 1));
  const float a = block_value(map, qabsmax, absmax2, offset, i / nf4::kBlock);
  return nf4::ftz(__fmul_rn(code[(i & 1) ? (byte & 15) : (byte >> 4)], a));
}

// 16 consecutive outputs starting 16-element aligned.
__device__ __forceinline__ void store16(float* out, const float* v) {
  float4* o = reinterpret_cast<float4*>(out);
#pragma unroll
  for (int k = 0; k < 4; ++k) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}
__device__ __forceinline__ void store16(bf16* out, const float* v) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    Pack16<bf16> p;
#pragma unroll
    for (int k = 0; k < 8; ++k) p.v[k] = from_float<bf16>(v[8 * h + k]);
    p.store(out + 8 * h);
  }
}

// VEC: out 16-byte and packed 8-byte aligned; 16 elements per thread, then
// the n % 16 tail one per thread. Else one element per thread throughout.
template <typename T, bool VEC>
__global__ void nf4_dequantize_kernel(T* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2,
                                      const float* map, float offset, int64_t n) {
  __shared__ float code[16];
  load_code(code);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t groups = n / 16;
    for (int64_t g = start; g < groups; g += stride) {
      const uint2 bytes = __ldg(reinterpret_cast<const uint2*>(packed) + g);
      const float a = block_value(map, qabsmax, absmax2, offset, g / (nf4::kBlock / 16));
      float v[16];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t byte = ((k < 4 ? bytes.x : bytes.y) >> (8 * (k & 3))) & 0xffu;
        v[2 * k] = nf4::ftz(__fmul_rn(code[byte >> 4], a));
        v[2 * k + 1] = nf4::ftz(__fmul_rn(code[byte & 15], a));
      }
      store16(out + 16 * g, v);
    }
    tail = groups * 16;
  }
  for (int64_t i = tail + start; i < n; i += stride)
    out[i] = from_float<T>(element(code, packed, qabsmax, absmax2, map, offset, i));
}

template <typename T>
void launch(T* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
            float offset, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const bool aligned = aligned16(out) && (reinterpret_cast<uintptr_t>(packed) & 7) == 0;
  if (aligned) {
    nf4_dequantize_kernel<T, true><<<grid_for(std::max<int64_t>(1, n / 16), kThreads), kThreads, 0, stream>>>(
        out, packed, qabsmax, absmax2, map, offset, n);
  } else {
    nf4_dequantize_kernel<T, false><<<grid_for(n, kThreads), kThreads, 0, stream>>>(out, packed, qabsmax, absmax2,
                                                                                    map, offset, n);
  }
  TR_CUDA_LAUNCH_CHECK("nf4_dequantize");
}

}  // namespace

void nf4_dequantize(float* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
                    float offset, int64_t n, cudaStream_t stream) {
  launch(out, packed, qabsmax, absmax2, map, offset, n, stream);
}

void nf4_dequantize(bf16* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
                    float offset, int64_t n, cudaStream_t stream) {
  launch(out, packed, qabsmax, absmax2, map, offset, n, stream);
}

}  // namespace trainrun::cuda
