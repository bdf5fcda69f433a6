// CPU backend: x[n, :V] *= w[n] (kernels/backend.h, Backend::scale_rows).
// The preference objectives' per-token weights on dloss/dlogits, fp32.
#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

void CpuBackend::scale_rows(void* x_, const float* w, int N, int V, int ldv) {
  float* x = static_cast<float*>(x_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    float* row = x + int64_t(n) * ldv;
    const float s = w[n];
#pragma omp simd
    for (int v = 0; v < V; ++v) row[v] *= s;
  }
}

}  // namespace trainrun
