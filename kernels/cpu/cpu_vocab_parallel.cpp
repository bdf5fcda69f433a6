// CPU backend: the vocab-parallel embedding and cross-entropy of tensor
// parallelism (kernels/backend.h). Forward and backward of each op together;
// the same summation orders as encoder_* and softmax_cross_entropy, so a
// TP group of one gives their results.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/common/error.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/scatter_rows.h"
#include "kernels/cpu/fastmath.h"

namespace trainrun {

namespace {
inline float* F(void* p) { return static_cast<float*>(p); }
inline const float* F(const void* p) { return static_cast<const float*>(p); }
inline bool in_range(int tok, int v_begin, int v_count) { return tok >= v_begin && tok < v_begin + v_count; }
}  // namespace

// ---- embedding ----------------------------------------------------------------

void CpuBackend::vocab_embedding_forward(void* out_, const int32_t* tokens, const void* wte_, const void* wpe_,
                                         int v_begin, int v_count, int B, int T, int C, const int32_t* pos) {
  float* out = F(out_);
  const float* wte = F(wte_);
  const float* wpe = F(wpe_);
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < int64_t(B) * T; ++bt) {
    float* o = out + bt * C;
    const int tok = tokens[bt];
    const float* e = in_range(tok, v_begin, v_count) ? wte + int64_t(tok - v_begin) * C : nullptr;
    const float* p = wpe ? wpe + (pos ? pos[bt] : bt % T) * C : nullptr;
    if (e && p) {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
    } else if (e) {
      std::memcpy(o, e, sizeof(float) * C);
    } else if (p) {
      std::memcpy(o, p, sizeof(float) * C);
    } else {
      std::memset(o, 0, sizeof(float) * C);
    }
  }
}

// As encoder_backward: threads split the channels, so the scatter has no
// races and a fixed order.
void CpuBackend::vocab_embedding_backward(float* dwte, float* dwpe, const void* dout_, const int32_t* tokens,
                                          int v_begin, int v_count, int B, int T, int C, const int32_t* pos) {
  const float* dout = F(dout_);
  const int64_t N = int64_t(B) * T;
#pragma omp parallel
  {
    int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    int c0 = int(int64_t(C) * tid / nt), c1 = int(int64_t(C) * (tid + 1) / nt);
    for (int64_t bt = 0; bt < N; ++bt) {
      const int tok = tokens[bt];
      if (!in_range(tok, v_begin, v_count)) continue;
      float* d = dwte + int64_t(tok - v_begin) * C;
      const float* g = dout + bt * C;
      for (int c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
  if (!dwpe) return;
  cpu::add_position_grads(dwpe, dout, pos, B, T, C);
}

// ---- cross-entropy ------------------------------------------------------------

void CpuBackend::vocab_ce_max(float* rowmax, const void* logits_, int N, int V, int ldv) {
  const float* logits = F(logits_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* z = logits + int64_t(n) * ldv;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int v = 0; v < V; ++v) mx = std::max(mx, z[v]);
    rowmax[n] = mx;
  }
}

void CpuBackend::vocab_ce_sumexp(float* stats, const void* logits_, const int32_t* targets, const float* rowmax,
                                 int v_begin, int N, int V, int ldv) {
  const float* logits = F(logits_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* z = logits + int64_t(n) * ldv;
    const float mx = rowmax[n];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int v = 0; v < V; ++v) sum += fastmath::exp(z[v] - mx);
    stats[n] = sum;
    const int tgt = targets[n];
    stats[N + n] = in_range(tgt, v_begin, V) ? z[tgt - v_begin] : 0.0f;
  }
}

void CpuBackend::vocab_ce_finish(float* losses, void* dlogits_, const void* logits_, const int32_t* targets,
                                 const float* rowmax, const float* stats, int v_begin, int N, int V, int ldv,
                                 float dloss_scale, float cap) {
  TR_CHECK(cap >= 0.f, "vocab_ce_finish: the soft-cap ", cap, " must be >= 0 (0 = none)");
  const float* logits = F(logits_);
  float* dlogits = F(dlogits_);
  const float inv_cap = cap > 0.f ? 1.0f / cap : 0.f;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const int tgt = targets[n];
    if (tgt < 0) {
      losses[n] = 0.0f;
      if (dlogits) std::memset(dlogits + int64_t(n) * ldv, 0, sizeof(float) * V);
      continue;
    }
    const float mx = rowmax[n], sum = stats[n];
    losses[n] = mx + std::log(sum) - stats[N + n];
    if (!dlogits) continue;
    const float* z = logits + int64_t(n) * ldv;
    float* d = dlogits + int64_t(n) * ldv;
    const float inv = 1.0f / sum;
    if (cap > 0.f) {  // the logits are capped: the gradient of the uncapped ones (softmax_cross_entropy's cap)
      const bool mine = in_range(tgt, v_begin, V);
      const float tt = mine ? z[tgt - v_begin] * inv_cap : 0.f;  // read before the row is overwritten
#pragma omp simd
      for (int v = 0; v < V; ++v) {
        const float t = z[v] * inv_cap;
        d[v] = dloss_scale * fastmath::exp(z[v] - mx) * inv * (1.0f - t * t);
      }
      if (mine) d[tgt - v_begin] -= dloss_scale * (1.0f - tt * tt);
      continue;
    }
#pragma omp simd
    for (int v = 0; v < V; ++v) d[v] = dloss_scale * fastmath::exp(z[v] - mx) * inv;
    if (in_range(tgt, v_begin, V)) d[tgt - v_begin] -= dloss_scale;
  }
}

}  // namespace trainrun
