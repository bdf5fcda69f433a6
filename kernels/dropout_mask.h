// The adapters' counter-based dropout mask (Backend::dropout_forward), one
// definition for every backend: header-only, host and device, like
// kernels/nf4_format.h, so the CUDA kernel and the CPU loop cannot draw
// different masks.
//
//   element (n, c) of a dropout over N rows of C features, starting at the
//   global row row0, has the counter i = (row0 + n) * C + c (mod 2^64) and
//   is kept when u(seed, i) >= threshold(p), where
//     u(seed, i)   = top 24 bits of mix64(seed ^ mix64(i))     (in [0, 2^24))
//     threshold(p) = floor(p * 2^24)                           (in double)
//   and scaled by keep_scale(p) = 1 / (1 - p) (fp32).
//
// mix64 is splitmix64's finaliser (Steele et al.), the mixer of the model's
// counter-based init. The mask depends on (seed, global row, feature) only:
// the same on any rank layout, in the forward, in an activation-checkpointing
// recompute and in the backward. Integer math only, so bit-equal everywhere.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define TR_DROPOUT_HD __host__ __device__ __forceinline__
#else
#define TR_DROPOUT_HD inline
#endif

namespace trainrun::dropout_mask {

TR_DROPOUT_HD uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Whether counter i survives a dropout of the given threshold.
TR_DROPOUT_HD bool keep(uint64_t seed, uint64_t i, uint32_t threshold) {
  return uint32_t(mix64(seed ^ mix64(i)) >> 40) >= threshold;
}

// p as a threshold on the hash's top 24 bits: exact for the uniform grid.
inline uint32_t threshold(float p) { return uint32_t(double(p) * double(1u << 24)); }
inline float keep_scale(float p) { return 1.0f / (1.0f - p); }

}  // namespace trainrun::dropout_mask
