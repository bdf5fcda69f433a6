// Shared by every file of the CUDA backend: the error-checking wrappers, the
// bf16 type, 16-byte vector access, warp/block reductions and grid sizing.
//
// Errors: every CUDA runtime call goes through TR_CUDA_CHECK and every kernel
// launch is followed by TR_CUDA_LAUNCH_CHECK("kernel name"); both throw
// trainrun::Error (never exit()) naming the call or kernel, the CUDA error
// name and string, and the source location.
//
// Kept small on purpose: it is included by every .cu file, so nothing heavy
// (no CUB, no cuBLASLt, no WMMA) lives here.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/common/error.h"

namespace trainrun::cuda {

using bf16 = __nv_bfloat16;

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  std::string hint;
  if (e == cudaErrorMemoryAllocation) hint = "; reduce train.micro_batch_size or the model size";
  if (e == cudaErrorNoKernelImageForDevice)
    hint = "; this trainrun was compiled for sm_80 and sm_90 only (CMAKE_CUDA_ARCHITECTURES)";
  throw Error(detail::cat("cuda: ", what, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                          ") at ", file, ":", line, hint));
}

}  // namespace trainrun::cuda

#define TR_CUDA_CHECK(call)                                                               \
  do {                                                                                    \
    cudaError_t tr_err_ = (call);                                                         \
    if (tr_err_ != cudaSuccess) ::trainrun::cuda::throw_cuda_error(tr_err_, #call, __FILE__, __LINE__); \
  } while (0)

// Right after every <<<...>>>: configuration errors show up here, faults in
// the kernel itself at the next synchronising call.
#define TR_CUDA_LAUNCH_CHECK(kernel_name)                                                 \
  do {                                                                                    \
    cudaError_t tr_err_ = cudaGetLastError();                                             \
    if (tr_err_ != cudaSuccess)                                                           \
      ::trainrun::cuda::throw_cuda_error(tr_err_, "launch of " kernel_name, __FILE__, __LINE__); \
  } while (0)

namespace trainrun::cuda {

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Blocks for a grid-stride loop over `work` items with `threads` per block:
// enough to fill the GPU a few times over, never more than the work needs.
inline int grid_for(int64_t work, int threads, int max_blocks = 4096) {
  int64_t b = (work + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<int>(b);
}

#ifdef __CUDACC__
// The launch the elementwise kernels share: `vec` (the kernel's <true>
// instance: kPack elements per 16-byte pack, its own scalar tail) over the
// packs when every pointer is 16-byte aligned, else `scalar` (<false>: one
// element per thread) over n; grid-stride loops, 256 threads per block.
template <int kPack, typename... Params, typename... Args>
void launch_packed(void (*vec)(Params...), void (*scalar)(Params...), bool aligned, int64_t n, cudaStream_t stream,
                   Args... args) {
  constexpr int kThreads = 256;
  if (aligned) {
    vec<<<grid_for((n + kPack - 1) / kPack, kThreads), kThreads, 0, stream>>>(args...);
  } else {
    scalar<<<grid_for(n, kThreads), kThreads, 0, stream>>>(args...);
  }
}
#endif

#if defined(__CUDACC__)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
// Round to nearest even: deterministic (llm.c rounds AdamW stochastically; we
// prefer bit-reproducible runs).
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

// 16 bytes of T (8 bf16 or 4 float) moved as one int4: coalesced 128-bit
// accesses. Only for 16-byte aligned addresses; callers check.
template <typename T>
struct alignas(16) Pack16 {
  static constexpr int size = 16 / sizeof(T);
  T v[size];
  __device__ __forceinline__ static Pack16 load(const T* p) {
    Pack16 r;
    *reinterpret_cast<int4*>(r.v) = __ldg(reinterpret_cast<const int4*>(p));
    return r;
  }
  // Coherent load (for buffers this kernel also writes, e.g. in-place).
  __device__ __forceinline__ static Pack16 load_rw(const T* p) {
    Pack16 r;
    *reinterpret_cast<int4*>(r.v) = *reinterpret_cast<const int4*>(p);
    return r;
  }
  __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(v); }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. The combination order is fixed (warp butterflies,
// then warp 0 over the warp partials), so the result is deterministic.
// `shared` must hold 32 floats; the function syncs before reusing it.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = lane < nw ? shared[lane] : 0.0f;
  return warp_sum(r);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = lane < nw ? shared[lane] : -INFINITY;
  return warp_max(r);
}

#endif  // __CUDACC__

}  // namespace trainrun::cuda
