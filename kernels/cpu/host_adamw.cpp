// Host AdamW kernels; the math and why it is written this way are in host_adamw.h.
#include "kernels/cpu/host_adamw.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/common/error.h"

namespace trainrun {

namespace {

struct Coeffs {
  float b1, b2, c1, c2, bc1, bc2, lr, eps, wd, gs;
};

Coeffs coeffs(const HostAdamWArgs& a) {
  Coeffs k;
  k.b1 = a.beta1;
  k.b2 = a.beta2;
  k.c1 = 1.0f - a.beta1;
  k.c2 = 1.0f - a.beta2;
  k.bc1 = static_cast<float>(1.0 - std::pow(double(a.beta1), a.step));
  k.bc2 = static_cast<float>(1.0 - std::pow(double(a.beta2), a.step));
  k.lr = a.lr;
  k.eps = a.eps;
  k.wd = a.weight_decay;
  k.gs = a.grad_scale;
  return k;
}

void adamw_scalar(float* w, const float* grad, float* m, float* v, int64_t n, const Coeffs& k) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * k.gs;
    const float mi = std::fma(k.b1, m[i], k.c1 * g);
    const float vi = std::fma(k.b2, v[i], (k.c2 * g) * g);
    m[i] = mi;
    v[i] = vi;
    const float u = std::fma(k.wd, w[i], (mi / k.bc1) / (std::sqrt(vi / k.bc2) + k.eps));
    w[i] = std::fma(-k.lr, u, w[i]);
  }
}

__attribute__((target("avx2,fma"))) void adamw_avx2(float* w, const float* grad, float* m, float* v, int64_t n,
                                                    const Coeffs& k) {
  const __m256 b1 = _mm256_set1_ps(k.b1), b2 = _mm256_set1_ps(k.b2), c1 = _mm256_set1_ps(k.c1),
               c2 = _mm256_set1_ps(k.c2), bc1 = _mm256_set1_ps(k.bc1), bc2 = _mm256_set1_ps(k.bc2),
               nlr = _mm256_set1_ps(-k.lr), eps = _mm256_set1_ps(k.eps), wd = _mm256_set1_ps(k.wd),
               gs = _mm256_set1_ps(k.gs);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), gs);
    const __m256 mi = _mm256_fmadd_ps(b1, _mm256_loadu_ps(m + i), _mm256_mul_ps(c1, g));
    const __m256 vi = _mm256_fmadd_ps(b2, _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_mul_ps(c2, g), g));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    const __m256 wi = _mm256_loadu_ps(w + i);
    const __m256 den = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(vi, bc2)), eps);
    const __m256 u = _mm256_fmadd_ps(wd, wi, _mm256_div_ps(_mm256_div_ps(mi, bc1), den));
    _mm256_storeu_ps(w + i, _mm256_fmadd_ps(nlr, u, wi));
  }
  adamw_scalar(w + i, grad + i, m + i, v + i, n - i, k);
}

__attribute__((target("avx512f"))) void adamw_avx512(float* w, const float* grad, float* m, float* v, int64_t n,
                                                     const Coeffs& k) {
  const __m512 b1 = _mm512_set1_ps(k.b1), b2 = _mm512_set1_ps(k.b2), c1 = _mm512_set1_ps(k.c1),
               c2 = _mm512_set1_ps(k.c2), bc1 = _mm512_set1_ps(k.bc1), bc2 = _mm512_set1_ps(k.bc2),
               nlr = _mm512_set1_ps(-k.lr), eps = _mm512_set1_ps(k.eps), wd = _mm512_set1_ps(k.wd),
               gs = _mm512_set1_ps(k.gs);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grad + i), gs);
    const __m512 mi = _mm512_fmadd_ps(b1, _mm512_loadu_ps(m + i), _mm512_mul_ps(c1, g));
    const __m512 vi = _mm512_fmadd_ps(b2, _mm512_loadu_ps(v + i), _mm512_mul_ps(_mm512_mul_ps(c2, g), g));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    const __m512 wi = _mm512_loadu_ps(w + i);
    const __m512 den = _mm512_add_ps(_mm512_sqrt_ps(_mm512_div_ps(vi, bc2)), eps);
    const __m512 u = _mm512_fmadd_ps(wd, wi, _mm512_div_ps(_mm512_div_ps(mi, bc1), den));
    _mm512_storeu_ps(w + i, _mm512_fmadd_ps(nlr, u, wi));
  }
  // The tail (< 16) through AVX2 then scalar: same per-element math.
  adamw_avx2(w + i, grad + i, m + i, v + i, n - i, k);
}

using Kernel = void (*)(float*, const float*, float*, float*, int64_t, const Coeffs&);
Kernel kernel_for(HostIsa isa) {
  switch (isa) {
    case HostIsa::Avx512: return adamw_avx512;
    case HostIsa::Avx2: return adamw_avx2;
    default: return adamw_scalar;
  }
}

// Runs fn(begin, end) over [0, n) in chunks that start on 16-element
// (64-byte) boundaries, one per thread.
template <typename Fn>
void split(int64_t n, int threads, Fn fn) {
  if (threads <= 1 || n < 4096) return fn(int64_t(0), n);
  const int64_t per = ((n + threads - 1) / threads + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
  {
    const int64_t b = std::min(n, per * omp_get_thread_num());
    const int64_t e = std::min(n, b + per);
    if (b < e) fn(b, e);
  }
}

}  // namespace

const char* host_isa_name(HostIsa isa) {
  switch (isa) {
    case HostIsa::Avx512: return "avx512";
    case HostIsa::Avx2: return "avx2";
    default: return "scalar";
  }
}

bool host_isa_supported(HostIsa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case HostIsa::Avx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                                 __builtin_cpu_supports("fma");
    case HostIsa::Avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default: return true;
  }
}

HostIsa host_adamw_best_isa() {
  static const HostIsa best = [] {
    if (const char* env = std::getenv("TRAINRUN_HOST_ADAMW_ISA"); env && *env) {
      HostIsa want = HostIsa::Scalar;
      if (!std::strcmp(env, "avx512")) want = HostIsa::Avx512;
      else if (!std::strcmp(env, "avx2")) want = HostIsa::Avx2;
      else TR_CHECK(!std::strcmp(env, "scalar"), "TRAINRUN_HOST_ADAMW_ISA='", env, "': use scalar, avx2 or avx512");
      TR_CHECK(host_isa_supported(want), "TRAINRUN_HOST_ADAMW_ISA=", env, ": this CPU does not support it");
      return want;
    }
    if (host_isa_supported(HostIsa::Avx512)) return HostIsa::Avx512;
    if (host_isa_supported(HostIsa::Avx2)) return HostIsa::Avx2;
    return HostIsa::Scalar;
  }();
  return best;
}

void host_adamw_update(float* master, const float* grad, float* m, float* v, int64_t n, const HostAdamWArgs& a,
                       int threads, HostIsa isa) {
  TR_CHECK(host_isa_supported(isa), "host AdamW: this CPU cannot run the ", host_isa_name(isa), " kernel");
  const Coeffs k = coeffs(a);
  const Kernel fn = kernel_for(isa);
  split(n, threads, [&](int64_t b, int64_t e) { fn(master + b, grad + b, m + b, v + b, e - b, k); });
}

void host_accumulate(float* dst, const float* src, int64_t n, int threads) {
  split(n, threads, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] += src[i];
  });
}

}  // namespace trainrun
