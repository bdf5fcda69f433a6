// CPU backend: the mixture-of-experts ops (backend.h's "mixture of
// experts" section; the model side is core/model/moe/moe_mlp.h).
//
// Routing (per token t, experts e, K chosen):
//   p = softmax(logits_t)  (fp32, std::exp: the router decides which
//                           expert a token reaches, so it is exact, not fastmath)
//   idx_t = the K largest p, descending, ties to the lower id (a stable
//           partial sort, as torch.topk on a CPU tensor)
//   w_tj = p[idx_tj] (/ S_t = sum_j p[idx_tj] when renorm)
// Router backward, with dp the gradient on p:
//   dp_e = aux_grad_e (every token) + the chosen weights' share:
//     renorm: dp[idx_j] += (dw_j - sum_m dw_m w_m) / S    (w = p/S)
//     else:   dp[idx_j] += dw_j
//   dlogit_e = p_e (dp_e - sum_f p_f dp_f) + z_scale * lse * p_e
// Expert order: a stable counting sort of the pairs (t, j) by expert, so
// within an expert the rows keep token order and the result does not
// depend on the thread count. The grouped GEMM is one OpenBLAS GEMM per
// expert with rows (matmul_forward / matmul_backward on that row range).
// The unpermute sums a token's K expert outputs in slot order: deterministic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

void CpuBackend::moe_route_forward(float* probs, float* lse, int32_t* idx, float* w, const void* logits_, int N,
                                   int E, int K, bool renorm) {
  TR_CHECK(K >= 1 && K <= E, "moe_route_forward: top-k ", K, " must be in 1..", E, " (the experts)");
  const float* logits = static_cast<const float*>(logits_);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    const float* x = logits + int64_t(t) * E;
    float* p = probs + int64_t(t) * E;
    float mx = x[0];
    for (int e = 1; e < E; ++e) mx = std::max(mx, x[e]);
    double sum = 0;
    for (int e = 0; e < E; ++e) {
      p[e] = std::exp(x[e] - mx);
      sum += p[e];
    }
    const float inv = float(1.0 / sum);
    for (int e = 0; e < E; ++e) p[e] *= inv;
    lse[t] = mx + float(std::log(sum));
    int32_t* ix = idx + int64_t(t) * K;
    float* wt = w + int64_t(t) * K;
    // K passes of "largest not yet taken" (K is small: 1-8): the first maximum wins a tie.
    for (int j = 0; j < K; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int m = 0; m < j; ++m) taken = taken || ix[m] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ix[j] = best;
      wt[j] = p[best];
    }
    if (renorm) {
      float s = 0;
      for (int j = 0; j < K; ++j) s += wt[j];
      for (int j = 0; j < K; ++j) wt[j] /= s;
    }
  }
}

void CpuBackend::moe_route_select_biased(int32_t* idx, float* w, const float* probs, const float* bias, int N, int E,
                                         int K, bool renorm) {
  TR_CHECK(K >= 1 && K <= E, "moe_route_select_biased: top-k ", K, " must be in 1..", E, " (the experts)");
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    const float* p = probs + int64_t(t) * E;
    int32_t* ix = idx + int64_t(t) * K;
    float* wt = w + int64_t(t) * K;
    for (int j = 0; j < K; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int m = 0; m < j; ++m) taken = taken || ix[m] == e;
        if (!taken && (best < 0 || p[e] + bias[e] > p[best] + bias[best])) best = e;
      }
      ix[j] = best;
      wt[j] = p[best];  // the gate weight is the probability: the bias only chooses
    }
    if (renorm) {
      float s = 0;
      for (int j = 0; j < K; ++j) s += wt[j];
      for (int j = 0; j < K; ++j) wt[j] /= s;
    }
  }
}

void CpuBackend::moe_route_backward(void* dlogits_, const float* dw, const float* probs, const float* lse,
                                    const int32_t* idx, const float* aux_grad, float z_scale, int N, int E, int K,
                                    bool renorm) {
  float* dlogits = static_cast<float*>(dlogits_);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    const float* p = probs + int64_t(t) * E;
    const int32_t* ix = idx + int64_t(t) * K;
    const float* dwt = dw + int64_t(t) * K;
    float* dl = dlogits + int64_t(t) * E;  // dp first, then dlogits in place
    for (int e = 0; e < E; ++e) dl[e] = aux_grad ? aux_grad[e] : 0.f;
    if (renorm) {
      float S = 0, dot = 0;
      for (int j = 0; j < K; ++j) S += p[ix[j]];
      for (int j = 0; j < K; ++j) dot += dwt[j] * (p[ix[j]] / S);
      for (int j = 0; j < K; ++j) dl[ix[j]] += (dwt[j] - dot) / S;
    } else {
      for (int j = 0; j < K; ++j) dl[ix[j]] += dwt[j];
    }
    double pd = 0;
    for (int e = 0; e < E; ++e) pd += double(p[e]) * dl[e];
    for (int e = 0; e < E; ++e) dl[e] = p[e] * (dl[e] - float(pd)) + z_scale * lse[t] * p[e];
  }
}

void CpuBackend::moe_router_stats(float* stats, const float* probs, const float* lse, const int32_t* idx, int N,
                                  int E, int K) {
  // Serial over tokens in a fixed order (E*N adds; the GEMMs dominate).
  for (int t = 0; t < N; ++t) {
    for (int j = 0; j < K; ++j) stats[idx[int64_t(t) * K + j]] += 1.f;
    const float* p = probs + int64_t(t) * E;
    for (int e = 0; e < E; ++e) stats[E + e] += p[e];
    stats[2 * E] += lse[t] * lse[t];
  }
}

void CpuBackend::moe_aux_loss(float* out, float* aux_grad, float* losses, int n, const float* stats, int64_t tokens,
                              int E, float aux_coef, float z_coef, float grad_scale) {
  const double T2 = double(tokens) * double(tokens);
  double aux = 0;
  for (int e = 0; e < E; ++e) aux += double(stats[e]) * stats[E + e];
  aux *= double(E) / T2;
  const double z = double(stats[2 * E]) / double(tokens);
  out[0] = float(aux);
  out[1] = float(z);
  const float add = float(aux_coef * aux + z_coef * z);
  if (losses && add != 0.f)
    for (int i = 0; i < n; ++i) losses[i] += add;
  if (aux_grad)
    for (int e = 0; e < E; ++e) aux_grad[e] = float(double(grad_scale) * aux_coef * E * stats[e] / T2);
}

void CpuBackend::moe_permute(int32_t* pos, int32_t* offsets, void* xp_, const int32_t* idx, const void* x_, int N,
                             int K, int E, int C) {
  const int64_t P = int64_t(N) * K;
  std::vector<int64_t> next(size_t(E) + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    const int32_t e = idx[p];
    TR_CHECK(e >= 0 && e < E, "moe_permute: pair ", p, " names expert ", e, " outside 0..", E - 1, " (a bug)");
    ++next[size_t(e) + 1];
  }
  for (int e = 0; e < E; ++e) next[size_t(e) + 1] += next[size_t(e)];
  for (int e = 0; e <= E; ++e) offsets[e] = int32_t(next[size_t(e)]);
  for (int64_t p = 0; p < P; ++p) pos[p] = int32_t(next[size_t(idx[p])]++);
  float* xp = static_cast<float*>(xp_);
  const float* x = static_cast<const float*>(x_);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < P; ++p) std::copy_n(x + (p / K) * C, C, xp + int64_t(pos[p]) * C);
}

void CpuBackend::moe_permute_backward(void* dx_, const void* dxp_, const int32_t* pos, int N, int K, int C) {
  float* dx = static_cast<float*>(dx_);
  const float* dxp = static_cast<const float*>(dxp_);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    float* d = dx + int64_t(t) * C;
    for (int j = 0; j < K; ++j) {
      const float* s = dxp + int64_t(pos[int64_t(t) * K + j]) * C;
      for (int c = 0; c < C; ++c) d[c] += s[c];
    }
  }
}

void CpuBackend::moe_expert_matmul_forward(void* out_, const void* in_, const void* w_, const int32_t* offsets, int E,
                                           int IC, int OC) {
  float* out = static_cast<float*>(out_);
  const float* in = static_cast<const float*>(in_);
  const float* w = static_cast<const float*>(w_);
  for (int e = 0; e < E; ++e) {
    const int r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;  // an expert no token chose: no GEMM
    matmul_forward(out + int64_t(r0) * OC, in + int64_t(r0) * IC, w + int64_t(e) * OC * IC, nullptr, rows, IC, OC);
  }
}

void CpuBackend::moe_expert_matmul_backward(void* din_, float* dw, const void* dout_, const void* in_, const void* w_,
                                            const int32_t* offsets, int E, int IC, int OC) {
  float* din = static_cast<float*>(din_);
  const float* dout = static_cast<const float*>(dout_);
  const float* in = static_cast<const float*>(in_);
  const float* w = static_cast<const float*>(w_);
  for (int e = 0; e < E; ++e) {
    const int r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;  // its weight gradient stays as it was (+= nothing)
    matmul_backward(din ? din + int64_t(r0) * IC : nullptr, dw ? dw + int64_t(e) * OC * IC : nullptr, nullptr,
                    dout + int64_t(r0) * OC, in + int64_t(r0) * IC, w ? w + int64_t(e) * OC * IC : nullptr, rows, IC,
                    OC);
  }
}

void CpuBackend::moe_unpermute_forward(void* out_, const void* yp_, const int32_t* pos, const float* w, int N, int K,
                                       int C) {
  float* out = static_cast<float*>(out_);
  const float* yp = static_cast<const float*>(yp_);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    float* o = out + int64_t(t) * C;
    std::fill_n(o, C, 0.f);
    for (int j = 0; j < K; ++j) {
      const float wj = w[int64_t(t) * K + j];
      const float* y = yp + int64_t(pos[int64_t(t) * K + j]) * C;
      for (int c = 0; c < C; ++c) o[c] += wj * y[c];
    }
  }
}

void CpuBackend::moe_unpermute_backward(void* dyp_, float* dw, const void* dout_, const void* yp_, const int32_t* pos,
                                        const float* w, int N, int K, int C) {
  float* dyp = static_cast<float*>(dyp_);
  const float* dout = static_cast<const float*>(dout_);
  const float* yp = static_cast<const float*>(yp_);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    const float* d = dout + int64_t(t) * C;
    for (int j = 0; j < K; ++j) {
      const int64_t p = int64_t(t) * K + j, row = pos[p];
      const float* y = yp + row * C;
      float* dy = dyp + row * C;
      double dot = 0;
      for (int c = 0; c < C; ++c) {
        dot += double(d[c]) * y[c];
        dy[c] = w[p] * d[c];
      }
      dw[p] = float(dot);
    }
  }
}

namespace {
inline float sigmoid_exact(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace

void CpuBackend::moe_sigmoid_gate_forward(void* out_, const void* y_, const void* g_, int N, int C) {
  float* out = static_cast<float*>(out_);
  const float* y = static_cast<const float*>(y_);
  const float* g = static_cast<const float*>(g_);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    const float s = sigmoid_exact(g[t]);
    for (int c = 0; c < C; ++c) out[int64_t(t) * C + c] += s * y[int64_t(t) * C + c];
  }
}

void CpuBackend::moe_sigmoid_gate_backward(void* dy_, void* dg_, const void* dout_, const void* y_, const void* g_,
                                           int N, int C) {
  float* dy = static_cast<float*>(dy_);
  float* dg = static_cast<float*>(dg_);
  const float* dout = static_cast<const float*>(dout_);
  const float* y = static_cast<const float*>(y_);
  const float* g = static_cast<const float*>(g_);
#pragma omp parallel for schedule(static)
  for (int t = 0; t < N; ++t) {
    const float s = sigmoid_exact(g[t]);
    double dot = 0;
    for (int c = 0; c < C; ++c) {
      const int64_t i = int64_t(t) * C + c;
      dot += double(dout[i]) * y[i];
      dy[i] = s * dout[i];
    }
    dg[t] = float(dot) * s * (1.f - s);
  }
}

}  // namespace trainrun
