// CPU backend: final logit soft-capping (Gemma 2's final_logit_softcapping),
// in place: y = cap * tanh(z / cap) on columns [0, V) of each row
// (kernels/backend.h). Its backward is the cross-entropy's: softmax_cross_entropy
// (cpu_nn.cpp) and vocab_ce_finish (cpu_vocab_parallel.cpp) take the cap and
// multiply by dy/dz = 1 - (y / cap)^2, read back from y.
#include <algorithm>
#include <cmath>

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

}  // namespace trainrun
