// CPU backend: embedding, LayerNorm, linear layers and the fused
// softmax + cross-entropy. Forward and backward of each op sit together.
// Shapes use B, T, C, V, N = B*T, OC (see kernels/backend.h).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/common/error.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/scatter_rows.h"
#include "kernels/cpu/fastmath.h"

namespace trainrun {

namespace {
inline float* F(void* p) { return static_cast<float*>(p); }
inline const float* F(const void* p) { return static_cast<const float*>(p); }
}  // namespace

// ---- embedding ----------------------------------------------------------------
// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
void CpuBackend::encoder_forward(void* out_, const int32_t* tokens, const void* wte_, const void* wpe_, int B,
                                 int T, int C, const int32_t* pos) {
  float* out = F(out_);
  const float* wte = F(wte_);
  const float* wpe = F(wpe_);
  if (!wpe) {  // a position-free architecture (Llama): the lookup alone
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < int64_t(B) * T; ++bt)
      std::copy_n(wte + int64_t(tokens[bt]) * C, C, out + bt * C);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < int64_t(B) * T; ++bt) {
    const float* e = wte + int64_t(tokens[bt]) * C;
    const float* p = wpe + (pos ? pos[bt] : bt % T) * C;
    float* o = out + bt * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
  }
}

// dwte[tok] += dout[b,t]; dwpe[t] += sum_b dout[b,t].
// The scatter into dwte would race when two positions share a token, so
// threads split the channel dimension instead (scatter_rows): each thread
// walks every position in order for its own channels -> no races, fixed
// summation order.
void CpuBackend::encoder_backward(float* dwte, float* dwpe, const void* dout_, const int32_t* tokens, int B,
                                  int T, int C, const int32_t* pos) {
  const float* dout = F(dout_);
  cpu::scatter_rows(dwte, dout, tokens, int64_t(B) * T, C);
  cpu::add_position_grads(dwpe, dout, pos, B, T, C);
}

// ---- LayerNorm ------------------------------------------------------------------
// y = (x - mean) * rstd * w + b, rstd = 1/sqrt(var + 1e-5) (biased variance,
// as torch). mean/rstd (N) are saved for backward.
namespace {
// One row of LayerNorm; both forward ops share it so the fused residual
// variant is bit-identical to residual_forward followed by layernorm_forward.
inline void layernorm_row(float* o, float* mean, float* rstd, const float* x, const float* w, const float* b, int C) {
  float m = 0.0f;
#pragma omp simd reduction(+ : m)
  for (int c = 0; c < C; ++c) m += x[c];
  m /= C;
  float v = 0.0f;
#pragma omp simd reduction(+ : v)
  for (int c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
  v /= C;
  float s = 1.0f / std::sqrt(v + 1e-5f);
#pragma omp simd
  for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * w[c] + b[c];
  *mean = m;
  *rstd = s;
}
}  // namespace

void CpuBackend::layernorm_forward(void* out_, float* mean, float* rstd, const void* inp_, const void* w_,
                                   const void* b_, int N, int C) {
  float* out = F(out_);
  const float* inp = F(inp_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n)
    layernorm_row(out + int64_t(n) * C, mean + n, rstd + n, inp + int64_t(n) * C, F(w_), F(b_), C);
}

// The row's sum is written and then normalised while it is still in cache.
void CpuBackend::residual_layernorm_forward(void* res_out_, void* out_, float* mean, float* rstd, const void* a_,
                                            const void* b_, const void* w_, const void* bias_, int N, int C) {
  float* res = F(res_out_);
  float* out = F(out_);
  const float* a = F(a_);
  const float* b = F(b_);
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    float* r = res + int64_t(n) * C;
    const float* ar = a + int64_t(n) * C;
    const float* br = b + int64_t(n) * C;
#pragma omp simd
    for (int c = 0; c < C; ++c) r[c] = ar[c] + br[c];
    layernorm_row(out + int64_t(n) * C, mean + n, rstd + n, r, F(w_), F(bias_), C);
  }
}

// With xhat = (x-mean)*rstd and g = dout*w:
//   dx += rstd * (g - mean(g) - xhat * mean(g*xhat)),  dw += dout*xhat, db += dout.
// dw/db are reduced over rows with per-thread partials summed in thread order.
void CpuBackend::layernorm_backward(void* dinp_, float* dweight, float* dbias, const void* dout_,
                                    const void* inp_, const void* w_, const float* mean, const float* rstd,
                                    int N, int C) {
  float* dinp = F(dinp_);
  const float* dout = F(dout_);
  const float* inp = F(inp_);
  const float* w = F(w_);
  const int nt = threads();
  std::vector<float> partial(size_t(nt) * 2 * C, 0.0f);
#pragma omp parallel num_threads(nt)
  {
    float* pdw = partial.data() + size_t(omp_get_thread_num()) * 2 * C;
    float* pdb = pdw + C;
#pragma omp for schedule(static)
    for (int n = 0; n < N; ++n) {
      const float* x = inp + int64_t(n) * C;
      const float* dy = dout + int64_t(n) * C;
      float* dx = dinp + int64_t(n) * C;
      const float m = mean[n], s = rstd[n];
      float sum_g = 0.0f, sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gx)
      for (int c = 0; c < C; ++c) {
        float xh = (x[c] - m) * s;
        float g = dy[c] * w[c];
        sum_g += g;
        sum_gx += g * xh;
      }
      sum_g /= C;
      sum_gx /= C;
#pragma omp simd
      for (int c = 0; c < C; ++c) {
        float xh = (x[c] - m) * s;
        float g = dy[c] * w[c];
        dx[c] += s * (g - sum_g - xh * sum_gx);
        pdw[c] += dy[c] * xh;
        pdb[c] += dy[c];
      }
    }
  }
  for (int t = 0; t < nt; ++t) {
    const float* pdw = partial.data() + size_t(t) * 2 * C;
    for (int c = 0; c < C; ++c) {
      dweight[c] += pdw[c];
      dbias[c] += pdw[C + c];
    }
  }
}

// ---- linear ----------------------------------------------------------------------
// out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias: the bias is broadcast into
// out first so one sgemm with beta=1 finishes the job in a single pass.
void CpuBackend::matmul_forward(void* out_, const void* inp_, const void* weight_, const void* bias_, int N,
                                int C, int OC) {
  float* out = F(out_);
  const float* bias = F(bias_);
  float beta = 0.0f;
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; ++n) std::memcpy(out + int64_t(n) * OC, bias, sizeof(float) * OC);
    beta = 1.0f;
  }
  // One row (a decode step of sampling): a matrix-vector product, which
  // OpenBLAS runs as a streaming gemv instead of packing the weights for a
  // GEMM it would use once.
  if (N == 1)
    cblas_sgemv(CblasRowMajor, CblasNoTrans, OC, C, 1.0f, F(weight_), C, F(inp_), 1, beta, out, 1);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, F(inp_), C, F(weight_), C, beta, out,
                OC);
}

void CpuBackend::matmul_backward(void* dinp_, float* dweight, float* dbias, const void* dout_, const void* inp_,
                                 const void* weight_, int N, int C, int OC) {
  const float* dout = F(dout_);
  if (OC <= 0) {
    // No output features (a TP rank whose vocab shard is all padding): dinp
    // is an empty sum, zero; dweight and dbias have no elements. BLAS
    // refuses the k = 0 GEMM's leading dimension of 0.
    if (dinp_ && N > 0 && C > 0) std::fill_n(F(dinp_), int64_t(N) * C, 0.0f);
    return;
  }
  if (dinp_)  // dinp(N,C) = dout(N,OC) @ weight(OC,C)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, F(weight_), C, 0.0f,
                F(dinp_), C);
  // dweight(OC,C) += dout^T(OC,N) @ inp(N,C); null: skipped (zero_bubble's input step)
  if (dweight)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, F(inp_), C, 1.0f, dweight, C);
  if (dbias) {
    // Column sums: threads own disjoint column ranges, rows summed in order.
#pragma omp parallel
    {
      int nt = omp_get_num_threads(), tid = omp_get_thread_num();
      int o0 = int(int64_t(OC) * tid / nt), o1 = int(int64_t(OC) * (tid + 1) / nt);
      if (o1 > o0) {
        std::vector<float> acc(dbias + o0, dbias + o1);
        for (int n = 0; n < N; ++n) {
          const float* row = dout + int64_t(n) * OC;
          for (int o = o0; o < o1; ++o) acc[o - o0] += row[o];
        }
        std::copy(acc.begin(), acc.end(), dbias + o0);
      }
    }
  }
}

// ---- linear + GELU ------------------------------------------------------------------
// Unfused on the CPU (the same ops, bit-identical to calling them in turn):
// GELU is a cheap pass next to the GEMM here.
void CpuBackend::matmul_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const void* bias,
                                     int N, int C, int OC) {
  matmul_forward(pre, inp, weight, bias, N, C, OC);
  gelu_forward(out, pre, int64_t(N) * OC);
}

void CpuBackend::matmul_backward_dgelu(void* dinp, float* dweight, float* dbias, const void* dout, const void* inp,
                                       const void* weight, const void* pre, int N, int C, int OC) {
  matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  gelu_backward(dinp, pre, dinp, int64_t(N) * C);
}

// ---- tied LM head over row-padded logits -------------------------------------------
void CpuBackend::lm_head_forward(void* logits, const void* inp, const void* wte, int N, int C, int V, int ldv) {
  if (N == 1) return cblas_sgemv(CblasRowMajor, CblasNoTrans, V, C, 1.0f, F(wte), C, F(inp), 1, 0.0f, F(logits), 1);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, V, C, 1.0f, F(inp), C, F(wte), C, 0.0f, F(logits), ldv);
}

void CpuBackend::lm_head_backward(void* dinp, float* dwte, const void* dlogits, const void* inp, const void* wte,
                                  int N, int C, int V, int ldv) {
  if (dinp)  // dinp(N,C) = dlogits(N,V) @ wte(V,C)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, V, 1.0f, F(dlogits), ldv, F(wte), C, 0.0f, F(dinp),
                C);
  // dwte(V,C) += dlogits^T(V,N) @ inp(N,C)
  if (dwte)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, N, 1.0f, F(dlogits), ldv, F(inp), C, 1.0f, dwte, C);
}

// ---- softmax + cross-entropy ------------------------------------------------------
// loss[n] = logsumexp(logits[n]) - logits[n, target]; the gradient of
// dloss_scale * loss[n] w.r.t. the logits is dloss_scale * (softmax - onehot),
// written row by row so it may overwrite the logits (no V-wide buffer kept).
// With a soft-cap the logits are y = cap * tanh(z / cap) and the gradient
// is z's: times dy/dz = 1 - (y / cap)^2 (the target's y is read before its
// row is overwritten).
void CpuBackend::softmax_cross_entropy(float* losses, void* dlogits_, const void* logits_,
                                       const int32_t* targets, int N, int V, int ldv, float dloss_scale, float cap) {
  TR_CHECK(cap >= 0.f, "softmax_cross_entropy: the soft-cap ", cap, " must be >= 0 (0 = none)");
  const float* logits = F(logits_);
  float* dlogits = F(dlogits_);
  const float inv_cap = cap > 0.f ? 1.0f / cap : 0.f;
#pragma omp parallel for schedule(static)
  for (int n = 0; n < N; ++n) {
    const float* z = logits + int64_t(n) * ldv;
    const int tgt = targets[n];
    if (tgt < 0) {
      losses[n] = 0.0f;
      if (dlogits) std::memset(dlogits + int64_t(n) * ldv, 0, sizeof(float) * V);
      continue;
    }
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int v = 0; v < V; ++v) mx = std::max(mx, z[v]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int v = 0; v < V; ++v) sum += fastmath::exp(z[v] - mx);
    const float lse = mx + std::log(sum);
    losses[n] = lse - z[tgt];
    if (dlogits) {
      float* d = dlogits + int64_t(n) * ldv;
      const float inv = 1.0f / sum;
      if (cap > 0.f) {
        const float tt = z[tgt] * inv_cap;
#pragma omp simd
        for (int v = 0; v < V; ++v) {
          const float t = z[v] * inv_cap;
          d[v] = dloss_scale * fastmath::exp(z[v] - mx) * inv * (1.0f - t * t);
        }
        d[tgt] -= dloss_scale * (1.0f - tt * tt);
        continue;
      }
#pragma omp simd
      for (int v = 0; v < V; ++v) d[v] = dloss_scale * fastmath::exp(z[v] - mx) * inv;
      d[tgt] -= dloss_scale;
    }
  }
}

}  // namespace trainrun
