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
// Backward per (b,h), h = g*R + r:
//   dP = dout_h v_g^T,  dS = P * (dP - rowsum(P*dP)) / sqrt(HS),
//   dq_h = dS k_g,      dk_g,r = dS^T q_h,      dv_g,r = P^T dout_h,
// then dk_g = sum_r dk_g,r and dv_g = sum_r dv_g,r in the fixed order
// r = 0..R-1, row by row. The per-head partials (2 x (B,NH,T,HS) floats,
// R times dk/dv's size) let the B*NH heads run in parallel, as in the
// forward, instead of only the B*NKV groups (8 work items for a Llama 8B
// micro-batch of 1 would idle most cores of a big CPU); the ordered sum keeps
// dqkv bit-identical across runs and thread counts. With R = 1 the partial
// is written straight into dqkv (no copies).
// With NKV == NH every sgemm and row kernel is the one attention_forward /
// attention_backward runs (tested to agree bit for bit): both are
// causal_head.h per head.
// AttentionOptions: scale replaces 1/sqrt(HS) everywhere above; softcap caps
// the scaled scores; window limits query t to keys (t - window, t] and the
// sgemms skip the keys before it (causal_head.h's KeyMask).
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
// The score scale, after checking the options.
float score_scale(const char* op, int HS, const AttentionOptions& opt) {
  TR_CHECK(opt.window >= 0, op, ": sliding window ", opt.window, " must be >= 0 (0: none)");
  TR_CHECK(opt.softcap >= 0.f && opt.scale >= 0.f, op, ": softcap ", opt.softcap, " and scale ", opt.scale,
           " must be >= 0 (0: off / 1/sqrt(head size))");
  return opt.scale > 0.f ? opt.scale : 1.0f / std::sqrt(float(HS));
}
}  // namespace

size_t CpuBackend::attention_gqa_saved_floats(int B, int T, int NH) const { return size_t(B) * NH * T * T; }

void CpuBackend::attention_gqa_forward(void* out_, float* saved, const void* qkv_, int B, int T, int NH, int NKV,
                                       int HS, const int32_t* doc_start, const AttentionOptions& opt) {
  check_gqa_heads("attention_gqa_forward", NH, NKV, HS);
  float* out = static_cast<float*>(out_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int R = NH / NKV, C = NH * HS, ld = (NH + 2 * NKV) * HS;
  const float sc = score_scale("attention_gqa_forward", HS, opt);
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH, g = h / R;
    const float* row0 = qkv + int64_t(b) * T * ld;
    const float* q = row0 + h * HS;
    const float* k = row0 + (NH + g) * HS;
    const float* v = row0 + (NH + NKV + g) * HS;
    float* P = saved + int64_t(bh) * T * T;
    cpu::causal_head_forward(out + int64_t(b) * T * C + h * HS, C, P, q, k, v, ld, T, HS, sc,
                             cpu::KeyMask(doc_start ? doc_start + int64_t(b) * T : nullptr, opt.window), opt.softcap);
  }
}

void CpuBackend::attention_gqa_backward(void* dqkv_, const void* dout_, const void* qkv_, const void* /*out: P is kept*/,
                                        const float* saved, int B, int T, int NH, int NKV, int HS,
                                        const int32_t* doc_start, const AttentionOptions& opt) {
  check_gqa_heads("attention_gqa_backward", NH, NKV, HS);
  float* dqkv = static_cast<float*>(dqkv_);
  const float* dout = static_cast<const float*>(dout_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int R = NH / NKV, C = NH * HS, ld = (NH + 2 * NKV) * HS;
  const float sc = score_scale("attention_gqa_backward", HS, opt);
  const int nt = threads();
  const int64_t part = int64_t(T) * HS;  // one head's dk or dv partial, dense (T, HS)
  const bool capped = opt.softcap > 0.f;   // then a second (T, T) per thread: the recomputed scores
  std::vector<float> scratch(size_t(nt) * T * T * (capped ? 2 : 1));
  std::vector<float> partials(R > 1 ? size_t(2) * B * NH * part : 0);
  float* pk = partials.data();
  float* pv = partials.data() + (R > 1 ? int64_t(B) * NH * part : 0);
#pragma omp parallel num_threads(nt)
  {
    float* dP = scratch.data() + size_t(omp_get_thread_num()) * T * T * (capped ? 2 : 1);
    float* S = capped ? dP + int64_t(T) * T : nullptr;
#pragma omp for schedule(static)
    for (int bh = 0; bh < B * NH; ++bh) {
      const int b = bh / NH, h = bh % NH, g = h / R;
      const int64_t row0 = int64_t(b) * T * ld;
      const float* q = qkv + row0 + h * HS;
      const float* k = qkv + row0 + (NH + g) * HS;
      const float* v = qkv + row0 + (NH + NKV + g) * HS;
      float* dq = dqkv + row0 + h * HS;
      const float* P = saved + int64_t(bh) * T * T;
      const float* dO = dout + int64_t(b) * T * C + h * HS;
      const cpu::KeyMask ds(doc_start ? doc_start + int64_t(b) * T : nullptr, opt.window);
      if (R == 1)
        cpu::causal_head_backward(dq, dqkv + row0 + (NH + g) * HS, dqkv + row0 + (NH + NKV + g) * HS, ld, 0.0f, dP, dO,
                                  C, P, q, k, v, ld, T, HS, sc, ds, opt.softcap, S);
      else
        cpu::causal_head_backward(dq, pk + bh * part, pv + bh * part, HS, 0.0f, dP, dO, C, P, q, k, v, ld, T, HS, sc,
                                  ds, opt.softcap, S);
    }
    if (R > 1) {
      // dk_g, dv_g = the group's partials summed in head order, row by row.
#pragma omp for schedule(static)
      for (int64_t bt = 0; bt < int64_t(B) * T; ++bt) {
        const int64_t b = bt / T, t = bt % T;
        for (int g = 0; g < NKV; ++g) {
          float* dk = dqkv + bt * ld + (NH + g) * HS;
          float* dv = dqkv + bt * ld + (NH + NKV + g) * HS;
          const int64_t h0 = (b * NH + int64_t(g) * R) * part + t * HS;
          for (int i = 0; i < HS; ++i) {
            dk[i] = pk[h0 + i];
            dv[i] = pv[h0 + i];
          }
          for (int r = 1; r < R; ++r)
            for (int i = 0; i < HS; ++i) {
              dk[i] += pk[h0 + r * part + i];
              dv[i] += pv[h0 + r * part + i];
            }
        }
      }
    }
  }
}

// KV-cached (sampling): each new query i (position pos+i) of head h attends
// to keys [first, pos+i] of KV head h/R, first = 0, or pos+i-window+1 with a
// window: one (Tq x Tk) sgemm per head over the keys of the call, masked.
// Without a window the new k and v rows are appended to the caches at rows
// [pos, pos+Tq) first and the sgemms read the cache. With one the caches
// are rings of `window` rows (position p at row p % window), which a chunk
// of Tq > 1 new rows would overwrite while its first queries still need the
// old keys: so the keys [pos-window+1, pos+Tq) are gathered (ring, then the
// new rows) into a scratch first, and the last min(Tq, window) new rows are
// written to the ring after. The ring holds `window` positions however long
// the generation runs.
void CpuBackend::attention_kv_gqa_forward(void* out_, void* kcache_, void* vcache_, const void* qkv_, int pos, int Tq,
                                          int NH, int NKV, int HS, const AttentionOptions& opt) {
  check_gqa_heads("attention_kv_gqa_forward", NH, NKV, HS);
  float* out = static_cast<float*>(out_);
  float* kc = static_cast<float*>(kcache_);
  float* vc = static_cast<float*>(vcache_);
  const float* qkv = static_cast<const float*>(qkv_);
  const int R = NH / NKV, C = NH * HS, KV = NKV * HS, ld = (NH + 2 * NKV) * HS, W = opt.window;
  const float sc = score_scale("attention_kv_gqa_forward", HS, opt);
  const int k0 = W > 0 ? std::max(0, pos - W + 1) : 0;  // the first key any new query sees
  const int Tk = pos + Tq - k0;
  auto write_rows = [&](float* kdst, float* vdst, int i, int row) {
    const float* src = qkv + int64_t(i) * ld;
    std::copy(src + C, src + C + KV, kdst + int64_t(row) * KV);
    std::copy(src + C + KV, src + C + 2 * KV, vdst + int64_t(row) * KV);
  };
  std::vector<float> gathered(W > 0 ? size_t(2) * Tk * KV : 0);
  const float* K = kc;
  const float* V = vc;
  if (W > 0) {
    float* gk = gathered.data();
    float* gv = gk + int64_t(Tk) * KV;
    for (int p = k0; p < pos; ++p) {
      std::copy(kc + int64_t(p % W) * KV, kc + int64_t(p % W + 1) * KV, gk + int64_t(p - k0) * KV);
      std::copy(vc + int64_t(p % W) * KV, vc + int64_t(p % W + 1) * KV, gv + int64_t(p - k0) * KV);
    }
    for (int i = 0; i < Tq; ++i) write_rows(gk, gv, i, pos + i - k0);
    for (int i = std::max(0, Tq - W); i < Tq; ++i) write_rows(kc, vc, i, (pos + i) % W);
    K = gk;
    V = gv;
  } else {
    for (int i = 0; i < Tq; ++i) write_rows(kc, vc, i, pos + i);
  }
  const int nt = std::min(threads(), NH);
  std::vector<float> scratch(size_t(nt) * Tq * Tk);
#pragma omp parallel num_threads(nt)
  {
    float* S = scratch.data() + size_t(omp_get_thread_num()) * Tq * Tk;
#pragma omp for schedule(static)
    for (int h = 0; h < NH; ++h) {
      const int g = h / R;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Tq, Tk, HS, sc, qkv + h * HS, ld, K + g * HS, KV, 0.0f, S,
                  Tk);
      for (int i = 0; i < Tq; ++i) {
        const int last = pos + i - k0, first = W > 0 ? std::max(0, last - W + 1) : 0;
        if (opt.softcap > 0.f) cpu::softcap_row(S + int64_t(i) * Tk, first, last, opt.softcap);
        cpu::causal_softmax_row(S + int64_t(i) * Tk, first, last, Tk);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Tq, HS, Tk, 1.0f, S, Tk, V + g * HS, KV, 0.0f,
                  out + h * HS, C);
    }
  }
}

}  // namespace trainrun
