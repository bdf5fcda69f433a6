// NF4 dequantization (QLoRA's frozen base), the format of
// kernels/nf4_format.h:
//
//   out[i] = ftz(code[nibble i] * a(i/64)),
//   a(b)   = ftz(ftz(map[qabsmax[b]] * absmax2[b/256]) + offset)
//
// out (n) fp32 or bf16 (round to nearest even of the fp32 value); packed
// (ceil(n/2) bytes, element 2j in the high nibble of byte j), qabsmax
// (ceil(n/64)), absmax2 (ceil(n/16384) fp32) and map (256 fp32) on the
// device. Every multiply and add is an explicit round-to-nearest intrinsic
// (no fused multiply-add), so the bits equal the CPU backend's.
//
// nf4_dequantize_blocks: the same with a(b) given (block_absmax, ceil(n/64)
// fp32 on the device; Backend::nf4_dequantize_blocks): a tensor-parallel
// slice's blocks. One kernel serves both (templated on how a(b) is found).
// Not yet run on a GPU (compiled only).
//
// Kernel: memory-bound (0.5 byte in, 2 or 4 bytes out per element). One
// thread per 16 elements: 8 packed bytes in one 8-byte load, all inside one
// 64-block, so one absmax per thread; the 16 NF4 values in shared memory
// (a warp's lookups hit distinct banks or broadcast, where __constant__
// memory would serialise divergent indices); 16-byte stores. Unaligned
// pointers, and the n % 16 tail: one element per thread.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace trainrun::cuda {

void nf4_dequantize(float* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
                    float offset, int64_t n, cudaStream_t stream);
void nf4_dequantize(bf16* out, const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
                    float offset, int64_t n, cudaStream_t stream);

void nf4_dequantize_blocks(float* out, const uint8_t* packed, const float* block_absmax, int64_t n,
                           cudaStream_t stream);
void nf4_dequantize_blocks(bf16* out, const uint8_t* packed, const float* block_absmax, int64_t n,
                           cudaStream_t stream);

}  // namespace trainrun::cuda
