// CPU backend: causal grouped-query self-attention (Llama), forward,
// backward and the KV-cached forward.
//
// qkv (B,T,(NH+2*NKV)*HS): per row NH q heads | NKV k heads | NKV v heads,
// HS wide each; query head h reads key/value head g = h / R, R = NH/NKV (the
// group size; HF's repeat_kv). Every per-head matrix is a strided view with
// leading dimension ld = (NH+2*NKV)*HS and goes straight to sgemm.
// Forward per (b,h):  S = q_h k_g^T / sqrt(HS) (T,T), P = causal_softmax(S),
//                     out[:, h*HS:(h+1)*HS] = P v_g;   out (B,T,NH*HS).
// P (B,NH,T,T) is kept for backward, as in cpu_attention.cpp.
// Backward per (b,g), over the group's query heads h = g*R + r in order r = 0..R-1:
//   dP = dout_h v_g^T,  dS = P * (dP - rowsum(P*dP)) / sqrt(HS),
//   dq_h = dS k_g,      dk_g (+)= dS^T q_h,      dv_g (+)= P^T dout_h,
// the first head of the group writing dk_g/dv_g (beta 0), the others adding
// (beta 1). Each (b,g) belongs to one thread and its sum runs in that fixed
// order, so dqkv is bit-identical across runs and thread counts. The cost:
// only B*NKV work items (B*NH in the forward); per-head dk/dv partials
// summed afterwards would parallelise more at the price of R copies of them.
// With NKV == NH every sgemm and row kernel is the one attention_forward /
// attention_backward runs (tested to agree bit for bit): both are
// causal_head.h per head.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/common/error.h"
#include "kernels/cpu/causal_head.h"
#include "kernels/cpu/causal_softmax.h"
#include "kernels/cpu/cpu_backend.h"

namespace trainrun {

namespace {
void check_gqa_heads(const char* op, int NH, int NKV, int HS) {
  TR_CHECK(NH > 0 && NKV > 0 && HS > 0, op, ": NH ", NH, ", NKV ", NKV, " and HS ", HS, " must be positive");
  TR_CHECK(NH % NKV == 0, op, ": num_key_value_heads ", NKV, " must divide num_attention_heads ", NH);
}
}  // namespace

size_t CpuBackend::attention_gqa_saved_floats(int B, int T, int NH) const { return size_t(B) * NH * T * T; }

void CpuBackend::attention_gqa_forward(void* out_, float* saved, const void* qkv_, int B, int T, int NH, int NKV,
                                       int HS) {
  check_gqa_heads("attention_gqa_forward", NH, NKV, HS);
  float* out = static_cast<float*>(out_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int R = NH / NKV, C = NH * HS, ld = (NH + 2 * NKV) * HS;
  const float sc = 1.0f / std::sqrt(float(HS));
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH, g = h / R;
    const float* row0 = qkv + int64_t(b) * T * ld;
    const float* q = row0 + h * HS;
    const float* k = row0 + (NH + g) * HS;
    const float* v = row0 + (NH + NKV + g) * HS;
    float* P = saved + int64_t(bh) * T * T;
    cpu::causal_head_forward(out + int64_t(b) * T * C + h * HS, C, P, q, k, v, ld, T, HS, sc);
  }
}

void CpuBackend::attention_gqa_backward(void* dqkv_, const void* dout_, const void* qkv_, const void* /*out: P is kept*/,
                                        const float* saved, int B, int T, int NH, int NKV, int HS) {
  check_gqa_heads("attention_gqa_backward", NH, NKV, HS);
  float* dqkv = static_cast<float*>(dqkv_);
  const float* dout = static_cast<const float*>(dout_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int R = NH / NKV, C = NH * HS, ld = (NH + 2 * NKV) * HS;
  const float sc = 1.0f / std::sqrt(float(HS));
  const int nt = threads();
  std::vector<float> scratch(size_t(nt) * T * T);
#pragma omp parallel num_threads(nt)
  {
    float* dP = scratch.data() + size_t(omp_get_thread_num()) * T * T;
#pragma omp for schedule(static)
    for (int bg = 0; bg < B * NKV; ++bg) {
      const int b = bg / NKV, g = bg % NKV;
      const int64_t row0 = int64_t(b) * T * ld;
      const float* k = qkv + row0 + (NH + g) * HS;
      const float* v = qkv + row0 + (NH + NKV + g) * HS;
      float* dk = dqkv + row0 + (NH + g) * HS;
      float* dv = dqkv + row0 + (NH + NKV + g) * HS;
      for (int r = 0; r < R; ++r) {  // the fixed summation order of dk_g, dv_g
        const int h = g * R + r;
        const float beta = r == 0 ? 0.0f : 1.0f;
        const float* q = qkv + row0 + h * HS;
        float* dq = dqkv + row0 + h * HS;
        const float* P = saved + (int64_t(b) * NH + h) * T * T;
        const float* dO = dout + int64_t(b) * T * C + h * HS;
        cpu::causal_head_backward(dq, dk, dv, beta, dP, dO, C, P, q, k, v, ld, T, HS, sc);
      }
    }
  }
}

// KV-cached (sampling): the new tokens' k and v heads are appended to the
// caches (maxT, NKV*HS), then each new query i of head h attends to rows
// [0, pos+i] of KV head h/R: one (Tq x (pos+Tq)) sgemm per head, masked.
void CpuBackend::attention_kv_gqa_forward(void* out_, void* kcache_, void* vcache_, const void* qkv_, int pos, int Tq,
                                          int NH, int NKV, int HS) {
  check_gqa_heads("attention_kv_gqa_forward", NH, NKV, HS);
  float* out = static_cast<float*>(out_);
  float* kc = static_cast<float*>(kcache_);
  float* vc = static_cast<float*>(vcache_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int R = NH / NKV, C = NH * HS, KV = NKV * HS, ld = (NH + 2 * NKV) * HS, Tk = pos + Tq;
  const float sc = 1.0f / std::sqrt(float(HS));
  for (int i = 0; i < Tq; ++i) {
    const float* row = qkv + int64_t(i) * ld;
    std::copy(row + C, row + C + KV, kc + int64_t(pos + i) * KV);
    std::copy(row + C + KV, row + C + 2 * KV, vc + int64_t(pos + i) * KV);
  }
  const int nt = std::min(threads(), NH);
  std::vector<float> scratch(size_t(nt) * Tq * Tk);
#pragma omp parallel num_threads(nt)
  {
    float* S = scratch.data() + size_t(omp_get_thread_num()) * Tq * Tk;
#pragma omp for schedule(static)
    for (int h = 0; h < NH; ++h) {
      const int g = h / R;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, HS, sc, qkv + h * HS, ld, kc + g * HS, KV, 0.0f, S,
                  Tk);
      for (int i = 0; i < Tq; ++i) cpu::causal_softmax_row(S + int64_t(i) * Tk, pos + i, Tk);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, HS, Tk, 1.0f, S, Tk, vc + g * HS, KV, 0.0f,
                  out + h * HS, C);
    }
  }
}

}  // namespace trainrun
