// CPU backend: final logit soft-capping (Gemma 2's final_logit_softcapping)
// and the cross-entropy over the capped logits (kernels/backend.h).
//
// forward (in place):  y = cap * tanh(z / cap) on columns [0, V) of each row.
// cross-entropy over y, as softmax_cross_entropy (cpu_nn.cpp): loss =
// logsumexp(y) - y[target]; its gradient w.r.t. the uncapped z is
//   dloss_scale * (softmax(y) - onehot(target)) * dy/dz,  dy/dz = 1 - tanh^2 = 1 - (y/cap)^2,
// read back from y itself, so nothing but the capped logits is kept and
// dlogits may overwrite them row by row.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/common/error.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/fastmath.h"

namespace trainrun {

void CpuBackend::logit_softcap_forward(void* logits_, int N, int V, int ldv, float cap) {
  TR_CHECK(cap > 0.f, "logit_softcap_forward: the cap ", cap, " must be > 0");
  float* logits = static_cast<float*>(logits_);
  const float inv = 1.0f / cap;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    float* z = logits + int64_t(n) * ldv;
#pragma omp simd
    for (int v = 0; v < V; ++v) z[v] = cap * fastmath::tanh(z[v] * inv);
  }
}

void CpuBackend::softcap_cross_entropy(float* losses, void* dlogits_, const void* logits_, const int32_t* targets,
                                       int N, int V, int ldv, float dloss_scale, float cap) {
  TR_CHECK(cap > 0.f, "softcap_cross_entropy: the cap ", cap, " must be > 0");
  const float* logits = static_cast<const float*>(logits_);
  float* dlogits = static_cast<float*>(dlogits_);
  const float inv = 1.0f / cap;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* y = logits + int64_t(n) * ldv;
    const int tgt = targets[n];
    if (tgt < 0) {
      losses[n] = 0.0f;
      if (dlogits) std::memset(dlogits + int64_t(n) * ldv, 0, sizeof(float) * V);
      continue;
    }
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int v = 0; v < V; ++v) mx = std::max(mx, y[v]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int v = 0; v < V; ++v) sum += fastmath::exp(y[v] - mx);
    losses[n] = mx + std::log(sum) - y[tgt];
    if (dlogits) {
      float* d = dlogits + int64_t(n) * ldv;
      const float ps = dloss_scale / sum;
      const float yt = y[tgt];  // read before the row is overwritten (d may alias y)
#pragma omp simd
      for (int v = 0; v < V; ++v) {
        const float t = y[v] * inv;
        d[v] = ps * fastmath::exp(y[v] - mx) * (1.0f - t * t);
      }
      const float tt = yt * inv;
      d[tgt] -= dloss_scale * (1.0f - tt * tt);
    }
  }
}

}  // namespace trainrun
