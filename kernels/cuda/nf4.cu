// NF4 dequantization: see nf4.cuh (and kernels/nf4_format.h for the format).
#include "kernels/cuda/nf4.cuh"

#include <algorithm>

#include "kernels/nf4_format.h"

namespace trainrun::cuda {

namespace {

__constant__ float kNf4Code[16] = {TR_NF4_CODE_VALUES};

// a(b) of nf4.cuh: two separately rounded ops, as bitsandbytes does them.
struct DoubleQuantScale {
  const float* map;
  const uint8_t* qabsmax;
  const float* absmax2;
  float offset;
  __device__ __forceinline__ float operator()(int64_t b) const {
    const float p = nf4::ftz(__fmul_rn(__ldg(map + __ldg(qabsmax + b)), __ldg(absmax2 + b / nf4::kAbsmaxBlock)));
    return nf4::ftz(__fadd_rn(p, offset));
  }
};
// nf4_dequantize_blocks: a(b) given, computed on the host with the same ops.
struct GivenScale {
  const float* block_absmax;
  __device__ __forceinline__ float operator()(int64_t b) const { return __ldg(block_absmax + b); }
};

__device__ __forceinline__ void load_code(float* code) {
  if (threadIdx.x < 16) code[threadIdx.x] = kNf4Code[threadIdx.x];
  __syncthreads();
}

template <typename Scale>
__device__ __forceinline__ float element(const float* code, const uint8_t* packed, const Scale& scale, int64_t i) {
  const uint8_t byte = __ldg(packed + (i >> 1));
  const float a = scale(i / nf4::kBlock);
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
template <typename T, bool VEC, typename Scale>
__global__ void nf4_dequantize_kernel(T* out, const uint8_t* packed, Scale scale, int64_t n) {
  __shared__ float code[16];
  load_code(code);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (VEC) {
    const int64_t groups = n / 16;
    for (int64_t g = start; g < groups; g += stride) {
      const uint2 bytes = __ldg(reinterpret_cast<const uint2*>(packed) + g);
      const float a = scale(g / (nf4::kBlock / 16));
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
    out[i] = from_float<T>(element(code, packed, scale, i));
}

template <typename T, typename Scale>
void launch(T* out, const uint8_t* packed, const Scale& scale, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const bool aligned = aligned16(out) && (reinterpret_cast<uintptr_t>(packed) & 7) == 0;
  if (aligned) {
    nf4_dequantize_kernel<T, true><<<grid_for(std::max<int64_t>(1, n / 16), kThreads), kThreads, 0, stream>>>(
        out, packed, scale, n);
  } else {
    nf4_dequantize_kernel<T, false><<<grid_for(n, kThreads), kThreads, 0, stream>>>(out, packed, scale, n);
  }
}

}  // namespace

void nf4_dequantize(float* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
                    float offset, int64_t n, cudaStream_t stream) {
  launch(out, packed, DoubleQuantScale{map, qabsmax, absmax2, offset}, n, stream);
  TR_CUDA_LAUNCH_CHECK("nf4_dequantize");
}

void nf4_dequantize(bf16* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
                    float offset, int64_t n, cudaStream_t stream) {
  launch(out, packed, DoubleQuantScale{map, qabsmax, absmax2, offset}, n, stream);
  TR_CUDA_LAUNCH_CHECK("nf4_dequantize");
}

// Not yet run on a GPU (compiled only).
void nf4_dequantize_blocks(float* out, const uint8_t* packed, const float* block_absmax, int64_t n,
                           cudaStream_t stream) {
  launch(out, packed, GivenScale{block_absmax}, n, stream);
  TR_CUDA_LAUNCH_CHECK("nf4_dequantize_blocks");
}

void nf4_dequantize_blocks(bf16* out, const uint8_t* packed, const float* block_absmax, int64_t n,
                           cudaStream_t stream) {
  launch(out, packed, GivenScale{block_absmax}, n, stream);
  TR_CUDA_LAUNCH_CHECK("nf4_dequantize_blocks");
}

}  // namespace trainrun::cuda
