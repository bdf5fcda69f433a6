// NF4 (4-bit NormalFloat, QLoRA) storage format, as bitsandbytes defines it
// for quantize_4bit(A, blocksize=64, compress_statistics=True,
// quant_type="nf4"): the facts every side needs (core/model/adapter/nf4.h
// quantizes; the CPU and CUDA backends dequantize), header-only so the CUDA
// plugin shares them without linking the core.
//
// A tensor of n fp32 elements is stored as
//   packed   (ceil(n/2) bytes)   element 2j in the HIGH nibble of byte j,
//                                element 2j+1 in the low nibble (odd n: the
//                                last low nibble is the code of 0.0, 0b0111);
//                                code c stands for kNf4Code[c]
//   qabsmax  (ceil(n/64) bytes)  block b's absmax (max |x| over elements
//                                [64b, 64b+64)), minus `offset`, as an 8-bit
//                                index into bnb's signed dynamic map (256
//                                fp32 values, create_dynamic_map(signed=True))
//   absmax2  (ceil(ceil(n/64)/256) fp32)  the absmax of (absmax - offset)
//                                over each run of 256 blocks
//   offset   (one fp32)          mean of the block absmaxes
// and dequantized as
//   absmax'(b) = ftz(map[qabsmax[b]] * absmax2[b/256]) + offset     (fp32, two roundings)
//   x'(i)      = ftz(kNf4Code[code(i)] * ftz(absmax'(i/64)))         (fp32; bf16 = round-to-nearest-even of it)
// ftz: bitsandbytes builds its kernels with --use_fast_math, which flushes
// subnormal fp32 operands and results to zero; so does this format, so that
// the same bytes give the same values. The `+ offset` is a torch add
// (IEEE, no flush) in bitsandbytes.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TR_NF4_HD __host__ __device__ __forceinline__
#else
#define TR_NF4_HD inline
#endif

namespace trainrun::nf4 {

constexpr int kBlock = 64;          // elements per absmax
constexpr int kAbsmaxBlock = 256;   // absmaxes per absmax2 (the double quantization)
constexpr int kMapSize = 256;       // entries of the dynamic map

// The 16 NF4 values (bitsandbytes' table: quantiles of N(0,1) scaled to
// [-1, 1], an exact zero at code 7), as fp32 literals. A macro, so the CUDA
// side can put the same values in __constant__ memory.
#define TR_NF4_CODE_VALUES                                                                         \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f, \
      -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f, \
      0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,       \
      0.7229568362236023f, 1.0f

// bitsandbytes' flush of subnormals (see the top).
TR_NF4_HD float ftz(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;  // exponent 0: zero or subnormal -> signed zero
  std::memcpy(&x, &u, 4);
  return x;
}

// fp32 -> bf16, round to nearest even (finite inputs: the format never
// holds Inf or NaN).
TR_NF4_HD uint16_t bf16_bits_rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// The dequantized absmax of one 64-block (the first line at the top).
// ftz() materialises the product as fp32, so no fused multiply-add can
// merge it with the add (bitsandbytes rounds twice: two separate ops).
TR_NF4_HD float block_scale(const float* map, uint8_t q, float absmax2, float offset) {
  return ftz(ftz(map[q] * absmax2) + offset);
}

#if !defined(__CUDACC__)
// Elements [i0, i1) of one 64-block whose dequantized absmax is a: the 16
// possible outputs once, then each element a table lookup. Both host
// dequantizations below run it, so a block gives the same bits through either.
inline void dequantize_block_host(const uint8_t* packed, float a, int64_t i0, int64_t i1, float* out_f32,
                                  uint16_t* out_bf16) {
  static const float code[16] = {TR_NF4_CODE_VALUES};
  float value[16];
  for (int c = 0; c < 16; ++c) value[c] = ftz(code[c] * a);
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t byte = packed[i >> 1];
    const float v = value[(i & 1) ? (byte & 15) : (byte >> 4)];
    if (out_f32)
      out_f32[i] = v;
    else
      out_bf16[i] = bf16_bits_rne(v);
  }
}

// Host dequantization of elements [0, n) into out_f32 or out_bf16 (exactly
// one non-null): the CPU backend's op and core/model/adapter/nf4.h's
// dequantize.
inline void dequantize_host(const uint8_t* packed, const uint8_t* qabsmax, const float* absmax2, const float* map,
                            float offset, int64_t n, float* out_f32, uint16_t* out_bf16) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kBlock, i1 = i0 + kBlock < n ? i0 + kBlock : n;
    dequantize_block_host(packed, block_scale(map, qabsmax[b], absmax2[b / kAbsmaxBlock], offset), i0, i1, out_f32,
                          out_bf16);
  }
}

// The same with each block's dequantized absmax given (block_absmax[b] =
// block_scale(...) of the block, computed once when the tensor was
// quantized): the CPU backend's nf4_dequantize_blocks, for a tensor-parallel
// slice whose blocks are not a run of the whole tensor's
// (parallel/sharding/nf4_frozen_store.cpp).
inline void dequantize_blocks_host(const uint8_t* packed, const float* block_absmax, int64_t n, float* out_f32,
                                   uint16_t* out_bf16) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * kBlock, i1 = i0 + kBlock < n ? i0 + kBlock : n;
    dequantize_block_host(packed, block_absmax[b], i0, i1, out_f32, out_bf16);
  }
}
#endif

}  // namespace trainrun::nf4
