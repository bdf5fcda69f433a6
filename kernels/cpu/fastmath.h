// Vectorisable exp and tanh for the CPU kernels.
//
// Why: glibc's expf/tanhf are scalar calls, and GELU's tanh alone took ~25%
// of a training step in the profile (perf, GPT-2 C=256 on one core). These
// inline versions are plain float arithmetic that GCC vectorises inside
// `omp simd` loops (8 lanes on AVX2).
//
// exp: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), e^r by its
// degree-6 Taylor polynomial (truncation < 1.2e-7 relative), 2^n by building
// the exponent bits. Max relative error ~2 ulp on [-87, 88]; inputs are
// clamped there (below: 0 after the clamp's tiny value, above: ~FLT_MAX),
// which covers every use here (softmax arguments are <= 0).
// tanh: 1 - 2/(e^{2u}+1) with the sign restored; absolute error ~1e-7,
// which is what GELU needs (tanh enters as 1 + tanh).
#pragma once
#include <cstdint>

namespace trainrun::fastmath {

// Written so GCC vectorises it without -ffast-math: floorf and fminf do not
// vectorise under strict IEEE semantics, so the clamp is a select and
// round-to-nearest uses the 1.5*2^23 trick (exact for |x*log2e| < 2^22).
inline float exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;   // ln2 high part (exact in float)
  r = r - n * -2.12194440e-4f;      // ln2 low part
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

inline float tanh(float u) {
  const float a = u < 0.0f ? -u : u;
  const float t = 1.0f - 2.0f / (exp(2.0f * a) + 1.0f);
  return u < 0.0f ? -t : t;
}

}  // namespace trainrun::fastmath
